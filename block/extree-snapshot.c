/*
 * extree: internal snapshots and VM state in the QEMU driver
 *
 * The BlockDriver's snapshot callbacks (qemu-img snapshot, info and
 * convert -l; savevm, loadvm, delvm and the snapshot-save/-load/-delete
 * jobs) over the core's snapshots (block/extree/extree.h), and the VM state
 * savevm writes before it takes the snapshot.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block_int.h"
#include "qapi/error.h"
#include "qemu/coroutine.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/timer.h"
#include "system/block-backend.h"
#include "trace/trace-block_extree.h"

#include "extree-qemu.h"

/* ---- Internal snapshots ---- */

/*
 * qemu-img snapshot -c/-a/-d/-l, qemu-img info and convert -l (the core's
 * snapshots, docs/interop/extree.rst "Snapshots"), modelled on qcow2.  Each
 * runs in a coroutine with s->lock held, as a request; the core commits
 * each operation itself.  Those that replace or drop trees (create, goto,
 * delete, load_tmp) close the commit gate first, so that no request holds
 * host ranges looked up in a tree that changes under it, and commit what
 * is pending through the gate.  VM state (savevm, loadvm) goes to the
 * core's VM state area of the live tree (extree_vmstate_write/read), which
 * taking the snapshot hands over to it.
 */

typedef struct ExtreeSnapArgs {
    QEMUSnapshotInfo *sn_info;          /* create: in, id_str out */
    const char *id, *name;              /* goto: @id is an id or a name */
    QEMUSnapshotInfo **psn_tab;         /* list */
    uint64_t size;                      /* goto: the snapshot's size */
    Error **errp;
} ExtreeSnapArgs;

/*
 * Index of the first snapshot with both @id and @name, or with @id, or
 * with @name (NULL: not asked), or -ENOENT, as qcow2 looks them up.
 * Called with s->lock held.
 */
static int xt_find_snapshot(BDRVExtreeState *s, const char *id,
                            const char *name)
{
    ExtreeSnapshotInfo info;

    if (!id && !name) {
        return -ENOENT;
    }
    for (unsigned i = 0; i < extree_snapshot_count(s->t); i++) {
        if (extree_snapshot_get(s->t, i, &info) == 0 &&
            (!id || !strcmp(info.id, id)) &&
            (!name || !strcmp(info.name, name))) {
            return i;
        }
    }
    return -ENOENT;
}

/*
 * Begin an operation that replaces or drops trees: close the gate, commit
 * what is pending, make room for the nodes and the snapshot table of
 * @table_bytes.  Called with s->lock held; may drop and retake it.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_begin(BDRVExtreeState *s, uint64_t table_bytes)
{
    int ret;

    xt_gate_close(s);
    ret = xt_commit_locked(s);
    if (ret == 0) {
        xt_grow_before_nodes(s, table_bytes);
    }
    return ret;
}

/*
 * End it: the live tree (or, for load_tmp, the tree reads see) may have
 * been replaced; the block-status cursor starts afresh.  Called with
 * s->lock held.
 */
static void coroutine_fn xt_snapshot_end(BDRVExtreeState *s)
{
    extree_cursor_release(&s->status_cursor);
    extree_cursor_init(&s->status_cursor, s->t);
    if (s->commit_timer && !extree_is_dirty(s->t)) {
        timer_del(s->commit_timer);
    }
    xt_gate_open(s);
}

static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_create_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    QEMUSnapshotInfo *sn_info = a->sn_info;
    ExtreeSnapshotInfo info = {
        .date_sec = sn_info->date_sec,
        .date_nsec = sn_info->date_nsec,
        .vm_clock_nsec = sn_info->vm_clock_nsec,
        .vm_state_size = sn_info->vm_state_size,
        .icount = sn_info->icount,
    };
    int ret;

    if (strlen(sn_info->id_str) > EXTREE_SNAP_ID_MAX ||
        strlen(sn_info->name) > EXTREE_SNAP_NAME_MAX) {
        error_report("extree: Snapshot ids are at most %d bytes long, names "
                     "at most %d", EXTREE_SNAP_ID_MAX, EXTREE_SNAP_NAME_MAX);
        return -EINVAL;
    }
    if (s->core_read_only || s->inactive) {
        return -EACCES;
    }
    pstrcpy(info.id, sizeof(info.id), sn_info->id_str);
    pstrcpy(info.name, sizeof(info.name), sn_info->name);

    ret = xt_snapshot_begin(s, extree_snapshot_table_bytes(s->t,
                                extree_snapshot_count(s->t) + 1));
    if (ret == 0) {
        ret = extree_snapshot_create(s->t, &info);
    }
    trace_extree_snapshot_create(s, info.id, info.name, ret);
    xt_snapshot_end(s);
    if (ret == 0) {
        /* the core chose the id if none was given */
        pstrcpy(sn_info->id_str, sizeof(sn_info->id_str), info.id);
    }
    return ret;
}

/* Like qcow2: the id is generated when @sn_info->id_str is empty */
int GRAPH_RDLOCK
xt_snapshot_create(BlockDriverState *bs, QEMUSnapshotInfo *sn_info)
{
    ExtreeSnapArgs a = { .sn_info = sn_info };

    return xt_call_locked_op(bs, xt_snapshot_create_locked, &a);
}

/* The virtual size of snapshot @a->id (an id or a name) */
static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_size_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    ExtreeSnapshotInfo info;
    int index;

    index = extree_snapshot_find(s->t, a->id);
    if (index < 0) {
        return -ENOENT;
    }
    extree_snapshot_get(s->t, index, &info);
    a->size = info.virtual_size;
    return 0;
}

static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_goto_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    int index, ret;

    index = extree_snapshot_find(s->t, a->id);
    if (index < 0) {
        return -ENOENT;
    }
    if (s->core_read_only || s->inactive) {
        return -EACCES;
    }
    ret = xt_snapshot_begin(s, 0);
    if (ret == 0) {
        ret = extree_snapshot_goto(s->t, index);
    }
    trace_extree_snapshot_goto(s, index, extree_virtual_size(s->t), ret);
    /* the snapshot's size; bs->total_sectors follows in the main loop */
    qatomic_set(&s->virtual_size, extree_virtual_size(s->t));
    xt_snapshot_end(s);
    return ret;
}

/*
 * The live image becomes the snapshot (@snapshot_id: an id or a name), its
 * virtual size too, as qcow2 does; what only the old live state used is
 * freed.  Like qcow2, a snapshot of another size first resizes the live
 * image, which tells the parents (a guest device) the new size.
 */
int GRAPH_UNLOCKED
xt_snapshot_goto(BlockDriverState *bs, const char *snapshot_id)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeSnapArgs a = { .id = snapshot_id };
    Error *local_err = NULL;
    BlockBackend *blk;
    int ret;

    bdrv_graph_rdlock_main_loop();
    ret = xt_call_locked_op(bs, xt_snapshot_size_locked, &a);
    bdrv_graph_rdunlock_main_loop();
    if (ret < 0) {
        return ret;
    }
    if (a.size != bs->total_sectors * BDRV_SECTOR_SIZE) {
        blk = blk_new_with_bs(bs, BLK_PERM_RESIZE, BLK_PERM_ALL, &local_err);
        if (!blk) {
            error_report_err(local_err);
            return -ENOTSUP;
        }
        ret = blk_truncate(blk, a.size, true, PREALLOC_MODE_OFF, 0,
                           &local_err);
        blk_unref(blk);
        if (ret < 0) {
            error_report_err(local_err);
            return ret;
        }
    }

    bdrv_graph_rdlock_main_loop();
    ret = xt_call_locked_op(bs, xt_snapshot_goto_locked, &a);
    bs->total_sectors = qatomic_read(&s->virtual_size) / BDRV_SECTOR_SIZE;
    if (ret == 0) {
        /* as if the whole disk were written: the core marked it too */
        bdrv_set_dirty(bs, 0, bs->total_sectors * BDRV_SECTOR_SIZE);
    }
    bdrv_graph_rdunlock_main_loop();
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_delete_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    int index, ret;

    index = xt_find_snapshot(s, a->id, a->name);
    if (index < 0) {
        error_setg(a->errp, "Can't find the snapshot");
        return -ENOENT;
    }
    if (s->core_read_only || s->inactive) {
        error_setg(a->errp, "The image is read-only");
        return -EACCES;
    }
    ret = xt_snapshot_begin(s, 0);
    if (ret < 0) {
        error_setg_errno(a->errp, -ret, "Could not commit extree metadata");
    } else {
        ret = extree_snapshot_delete(s->t, index);
        if (ret < 0) {
            error_setg_errno(a->errp, -ret, "Failed to delete the snapshot");
        }
    }
    trace_extree_snapshot_delete(s, index, ret);
    xt_snapshot_end(s);
    return ret;
}

/* By id and name, by id or by name (the other NULL), as qcow2 does */
int GRAPH_RDLOCK
xt_snapshot_delete(BlockDriverState *bs, const char *snapshot_id,
                   const char *name, Error **errp)
{
    ExtreeSnapArgs a = { .id = snapshot_id, .name = name, .errp = errp };

    return xt_call_locked_op(bs, xt_snapshot_delete_locked, &a);
}

static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_list_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    unsigned count = extree_snapshot_count(s->t);
    QEMUSnapshotInfo *tab;

    *a->psn_tab = NULL;
    if (!count) {
        return 0;
    }
    tab = g_new0(QEMUSnapshotInfo, count);
    for (unsigned i = 0; i < count; i++) {
        ExtreeSnapshotInfo info;
        QEMUSnapshotInfo *sn = &tab[i];

        extree_snapshot_get(s->t, i, &info);
        pstrcpy(sn->id_str, sizeof(sn->id_str), info.id);
        pstrcpy(sn->name, sizeof(sn->name), info.name);
        sn->vm_state_size = info.vm_state_size;
        /* QEMUSnapshotInfo's date is 32 bits, as in qcow2's table */
        sn->date_sec = info.date_sec;
        sn->date_nsec = info.date_nsec;
        sn->vm_clock_nsec = info.vm_clock_nsec;
        sn->icount = info.icount;
    }
    *a->psn_tab = tab;
    return count;
}

int GRAPH_RDLOCK
xt_snapshot_list(BlockDriverState *bs, QEMUSnapshotInfo **psn_tab)
{
    ExtreeSnapArgs a = { .psn_tab = psn_tab };

    return xt_call_locked_op(bs, xt_snapshot_list_locked, &a);
}

static int coroutine_fn GRAPH_RDLOCK
xt_snapshot_load_tmp_locked(BDRVExtreeState *s, void *opaque)
{
    ExtreeSnapArgs *a = opaque;
    int index, ret;

    index = xt_find_snapshot(s, a->id, a->name);
    if (index < 0) {
        error_setg(a->errp, "Can't find snapshot");
        return -ENOENT;
    }
    if (!s->core_read_only) {
        error_setg(a->errp, "Device is not readonly");
        return -EINVAL;
    }
    xt_gate_close(s);
    ret = extree_snapshot_load_tmp(s->t, index);
    if (ret < 0) {
        error_setg_errno(a->errp, -ret, "Failed to load snapshot");
    } else {
        /* the snapshot's size; bs->total_sectors follows in the main loop */
        qatomic_set(&s->virtual_size, extree_virtual_size(s->t));
    }
    trace_extree_snapshot_load_tmp(s, index, extree_virtual_size(s->t), ret);
    xt_snapshot_end(s);
    return ret;
}

/*
 * Read-only node: reads see the snapshot from now on (qemu-img convert -l),
 * and the node takes the snapshot's size, as qcow2's does.
 */
int GRAPH_RDLOCK
xt_snapshot_load_tmp(BlockDriverState *bs, const char *snapshot_id,
                     const char *name, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeSnapArgs a = { .id = snapshot_id, .name = name, .errp = errp };
    int ret;

    assert(bdrv_is_read_only(bs));
    ret = xt_call_locked_op(bs, xt_snapshot_load_tmp_locked, &a);
    if (ret == 0) {
        bs->total_sectors = qatomic_read(&s->virtual_size) / BDRV_SECTOR_SIZE;
    }
    return ret;
}

/* ---- VM state ---- */

/*
 * savevm writes the VM state in pieces at increasing @pos before it takes
 * the snapshot; loadvm reads it after the revert.  The core keeps it above
 * the virtual disk in the live tree (spec: VM state), always in new space.
 * Under s->lock, as a request: the core's writes go through the backend
 * (bs->file) with the lock held, so no commit runs between the allocation
 * and the mapping.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_vmstate_rw(BlockDriverState *bs, QEMUIOVector *qiov, int64_t pos,
              bool write)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t start = pos, len = qiov->size, head = 0;
    uint8_t *buf;
    int ret;

    if (pos < 0) {
        return -EINVAL;
    }
    if (s->crypto) {
        /*
         * Encrypted (the VM state is guest memory): whole sectors, each
         * with the IV of its guest offset in the tree; the partial first
         * and last sector of a write are read-modify-write
         */
        start = QEMU_ALIGN_DOWN(pos, BDRV_SECTOR_SIZE);
        head = pos - start;
        len = ROUND_UP(pos + qiov->size, BDRV_SECTOR_SIZE) - start;
    }
    buf = g_try_malloc0(len);
    if (!buf && len) {
        return -ENOMEM;
    }
    ret = xt_enter(s);
    if (ret == 0) {
        if (write && (s->core_read_only || s->inactive)) {
            ret = -EACCES;
        } else if (write) {
            if (s->crypto && len != qiov->size) {
                ret = extree_vmstate_read(s->t, start, buf, len);
                if (ret == 0) {
                    ret = xt_crypt(s, false, EXTREE_VMSTATE_BASE + start,
                                   buf, len);
                }
            }
            qemu_iovec_to_buf(qiov, 0, buf + head, qiov->size);
            if (ret == 0 && s->crypto) {
                ret = xt_crypt(s, true, EXTREE_VMSTATE_BASE + start, buf,
                               len);
            }
            if (ret == 0) {
                xt_grow_before(s, len);
                ret = extree_vmstate_write(s->t, start, buf, len);
                xt_update_done(s);
            }
        } else {
            ret = extree_vmstate_read(s->t, start, buf, len);
            if (ret == 0 && s->crypto) {
                ret = xt_crypt(s, false, EXTREE_VMSTATE_BASE + start, buf,
                               len);
            }
        }
        trace_extree_vmstate(s, write, pos, qiov->size, ret);
        xt_leave(s);
    }
    if (ret == 0 && !write) {
        qemu_iovec_from_buf(qiov, 0, buf + head, qiov->size);
    }
    g_free(buf);
    return ret;
}

int coroutine_fn GRAPH_RDLOCK
xt_co_save_vmstate(BlockDriverState *bs, QEMUIOVector *qiov,
                         int64_t pos)
{
    return xt_vmstate_rw(bs, qiov, pos, true);
}

int coroutine_fn GRAPH_RDLOCK
xt_co_load_vmstate(BlockDriverState *bs, QEMUIOVector *qiov,
                        int64_t pos)
{
    return xt_vmstate_rw(bs, qiov, pos, false);
}
