/*
 * extree core: internal snapshots
 *
 * A snapshot is one more root of the extent tree (btrfs's subvolume
 * snapshot): taking one adds a reference to the live root and nothing
 * else; the B+tree copies shared nodes lazily, one at a time, when they
 * change (extree-btree.c, release_node()); deleting one drops the parts
 * no other root shares (extree_bt_drop()).  Every operation is one
 * transaction of its own, committed here.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

unsigned extree_snapshot_count(const Extree *t)
{
    return t->snap.list ? t->snap.list->len : 0;
}

uint64_t extree_snapshot_table_bytes(const Extree *t, unsigned count)
{
    return extree_snap_table_bytes(count, t->block_size);
}

static void info_from_snap(const ExtreeSnap *sn, ExtreeSnapshotInfo *info)
{
    memset(info, 0, sizeof(*info));
    g_strlcpy(info->id, sn->id, sizeof(info->id));
    g_strlcpy(info->name, sn->name, sizeof(info->name));
    info->date_sec = sn->date_sec;
    info->date_nsec = sn->date_nsec;
    info->vm_clock_nsec = sn->vm_clock_nsec;
    info->vm_state_size = sn->vm_state_size;
    info->icount = sn->icount;
    info->generation = sn->generation;
    info->virtual_size = sn->virtual_size;
    info->extent_count = sn->extent_count;
    info->extent_bytes = sn->extent_bytes;
}

int extree_snapshot_get(const Extree *t, unsigned index,
                        ExtreeSnapshotInfo *info)
{
    if (index >= extree_snapshot_count(t)) {
        return -ENOENT;
    }
    info_from_snap(&g_array_index(t->snap.list, ExtreeSnap, index), info);
    return 0;
}

static int find_id(const Extree *t, const char *id)
{
    for (unsigned i = 0; i < extree_snapshot_count(t); i++) {
        if (!strcmp(g_array_index(t->snap.list, ExtreeSnap, i).id, id)) {
            return i;
        }
    }
    return -ENOENT;
}

int extree_snapshot_find(const Extree *t, const char *id_or_name)
{
    int i = find_id(t, id_or_name);

    if (i >= 0) {
        return i;
    }
    for (unsigned k = 0; k < extree_snapshot_count(t); k++) {
        if (!strcmp(g_array_index(t->snap.list, ExtreeSnap, k).name,
                    id_or_name)) {
            return k;
        }
    }
    return -ENOENT;
}

/*
 * The first snapshot on an image: the feature bit and an empty reference
 * count tree, in the transaction that shares the first block
 */
static int enable_snapshots(Extree *t)
{
    ExtreeTree *rt = &t->trees[EXTREE_TREE_REFS];
    int ret;

    if (extree_has_refs(t)) {
        return 0;
    }
    if (t->virtual_size > EXTREE_SNAP_MAX_VIRTUAL_SIZE) {
        return -EFBIG;
    }
    t->incompat |= EXTREE_INCOMPAT_SNAPSHOTS;
    rt->owner = EXTREE_TREE_REFS;
    rt->vt = &extree_refs_vt;
    rt->data_end = UINT64_MAX;
    ret = extree_bt_new_root(t, rt);
    if (ret < 0) {
        t->incompat &= ~EXTREE_INCOMPAT_SNAPSHOTS;
        return ret;
    }
    t->trees[EXTREE_TREE_EXTENT].shared = true;
    return 0;
}

/* Nothing pending, and the handle may change; @index an existing entry */
static int begin(Extree *t, unsigned index)
{
    int ret;

    if (index != UINT_MAX && index >= extree_snapshot_count(t)) {
        return -ENOENT;
    }
    ret = extree_check_writable(t);
    t->bm.unlogged = true;      /* no map record holds it */
    if (ret == 0) {
        ret = extree_probe_end(t);
    }
    if (ret == 0) {
        ret = extree_commit(t);
    }
    return ret;
}

/*
 * The end of an operation: commit it.  Host space that ran out (the
 * snapshot table, the nodes of the commit's syncs, a backend of fixed
 * size whose end the commit's writes found) undoes it: begin() committed
 * everything before it, so the rollback loses nothing else (nothing a
 * flush need report), and the handle goes on as it was.  Any other
 * failure gives up on the handle.
 */
static int finish(Extree *t, int ret)
{
    t->seq++;
    if (ret == 0) {
        ret = extree_commit(t);
    }
    if (ret == -ENOSPC && extree_can_roll_back(t) &&
        extree_rollback_own(t) == 0) {
        return ret;
    }
    if (ret < 0) {
        /* memory is ahead of the last commit: reopen to go on */
        t->broken = true;
    }
    return ret;
}

/*
 * Punch the live tree's VM state area, committed if it held anything.
 * Runs after the snapshot's own commit, so it answers nothing: a failure
 * leaves the handle as it leaves it, not through finish().  After a
 * failed write the punch stays pending and the next commit retries it; a
 * failed flush or punch marks the handle broken (extree_commit(),
 * extree_extent_update()), so that updates fail until a reopen, except
 * that a punch or commit that ran out of space half-way is rolled back,
 * and one the guard refused or stopped between two pieces (nothing
 * broken) stays for the next commit.  Either way the committed live
 * tree still holds the area (or part of it), which costs space
 * only: the next savevm overwrites it, and a later snapshot taken
 * without VM state carries it unread (vm_state_size 0).
 */
static void vmstate_drop(Extree *t)
{
    ExtreeItem none = { 0 };
    int ret;

    t->seq++;
    ret = extree_extent_update(t, &none, EXTREE_VMSTATE_BASE,
                               EXTREE_VMSTATE_MAX);
    if (ret == 0) {
        ret = extree_commit(t);
    }
    if (ret == -ENOSPC && extree_is_broken(t) && extree_can_roll_back(t)) {
        /*
         * Only the punch is lost: the snapshot was committed before it,
         * so no flush need fail for it.  A punch refused, or stopped
         * between two pieces, by the guard broke nothing: what it did
         * stays for the next commit.
         */
        extree_rollback_own(t);
    }
}

int extree_snapshot_create(Extree *t, ExtreeSnapshotInfo *info)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeSnap sn;
    int ret;

    if (strlen(info->id) > EXTREE_SNAP_ID_MAX ||
        strlen(info->name) > EXTREE_SNAP_NAME_MAX) {
        return -EINVAL;
    }
    if (extree_snapshot_count(t) >= EXTREE_MAX_SNAPSHOTS ||
        t->virtual_size > EXTREE_SNAP_MAX_VIRTUAL_SIZE) {
        return -EFBIG;
    }
    if (info->id[0] && find_id(t, info->id) >= 0) {
        return -EEXIST;
    }
    ret = begin(t, UINT_MAX);
    if (ret < 0) {
        return ret;
    }
    if (!info->id[0]) {
        /* the lowest number not in use, as qcow2 does */
        for (unsigned n = 1; ; n++) {
            g_snprintf(info->id, sizeof(info->id), "%u", n);
            if (find_id(t, info->id) < 0) {
                break;
            }
        }
    }
    ret = enable_snapshots(t);
    if (ret < 0) {
        return ret;
    }
    memset(&sn, 0, sizeof(sn));
    sn.root = et->root;
    sn.root_gen = et->root_gen;
    sn.level = et->level;
    sn.generation = t->generation;
    sn.virtual_size = t->virtual_size;
    sn.extent_count = et->nitems;
    sn.extent_bytes = et->total;
    sn.date_sec = info->date_sec;
    sn.date_nsec = info->date_nsec % 1000000000;
    sn.vm_clock_nsec = info->vm_clock_nsec;
    sn.vm_state_size = info->vm_state_size;
    sn.icount = info->icount;
    g_strlcpy(sn.id, info->id, sizeof(sn.id));
    g_strlcpy(sn.name, info->name, sizeof(sn.name));

    /* the one metadata change: the root gains the snapshot's reference */
    ret = t->sm.ops->inc_ref(t->sm.opaque, et->root, t->node_size);
    if (ret == 0) {
        g_array_append_val(t->snap.list, sn);
        t->snap.gen = t->trans_gen;
        ret = extree_snap_table_moved(t);
    }
    ret = finish(t, ret);
    if (ret == 0) {
        info_from_snap(&sn, info);
        /*
         * The VM state saved for it is the snapshot's now; the live tree
         * lets go of it, so that the next snapshot does not share it.
         * The snapshot is durable whatever the drop does: that is the
         * answer.
         */
        vmstate_drop(t);
    }
    return ret;
}


/*
 * The snapshot's root must map what its entry says: a root that lost
 * items, or an entry naming another node of the right level and
 * generation, would read holes with success, and reverting to it would
 * store an extent tree the superblock's extent_bytes contradicts.  The
 * root alone: O(1), one node read.  Deeper damage is found as the nodes
 * are read (each against its parent's child_bytes).
 */
static int snap_root_check(Extree *t, const ExtreeSnap *sn)
{
    ExtreeTree tree;
    ExtreeNodeExpect e;
    ExtreeNode *n;
    int ret;

    extree_snap_tree(t, sn, &tree);
    extree_tree_expect(t, &tree, &e);
    ret = extree_node_get(t, sn->root, &e, &n);
    if (ret < 0) {
        return ret;
    }
    if (n->bytes != sn->extent_bytes ||
        (node_level(n) == 0 && node_nritems(n) != sn->extent_count)) {
        ret = extree_corrupt(t, t->snap.table, "corrupt snapshot table at "
                             "offset 0x%" PRIx64 ": snapshot '%s' has "
                             "extent_count %" PRIu64 " extent_bytes 0x%"
                             PRIx64 ", its root at offset 0x%" PRIx64
                             " %s%u items mapping 0x%" PRIx64,
                             t->snap.table, sn->id, sn->extent_count,
                             sn->extent_bytes, sn->root,
                             node_level(n) ? "has " : "is a leaf of ",
                             node_nritems(n), n->bytes);
    }
    extree_node_unref(t, n);
    return ret;
}

/*
 * A drop that verifies before it frees (docs/reliability.rst, "Reference
 * counts recorded too low"): the roots that stay are probed at every node
 * the drop frees (extree_bt_drop()'s guard), and each leaf it frees is
 * merged with their leaves of the same key range (drop_leaf()).  A root
 * that maps what the counts say only the dropped tree uses fails the drop
 * with -EIO before anything it uses is freed: the operation fails and the
 * last commit stands.
 */
typedef struct DropCtx {
    Extree *t;
    ExtreeTree *trees;
    ExtreeDropGuard guard;
} DropCtx;

static int drop_leaf(ExtreeDropGuard *guard, ExtreeNode *leaf);

/* The roots that stay: every snapshot but @skip, and the live tree */
static void keep_init(Extree *t, DropCtx *dc, unsigned skip, bool live)
{
    unsigned n = 0;

    dc->t = t;
    dc->trees = g_new(ExtreeTree, extree_snapshot_count(t) + 1);
    dc->guard.keep = g_new0(ExtreeProbe, extree_snapshot_count(t) + 1);
    for (unsigned i = 0; i < extree_snapshot_count(t); i++) {
        if (i != skip) {
            extree_snap_tree(t, &g_array_index(t->snap.list, ExtreeSnap, i),
                             &dc->trees[n++]);
        }
    }
    if (live) {
        dc->trees[n++] = t->trees[EXTREE_TREE_EXTENT];
    }
    for (unsigned i = 0; i < n; i++) {
        dc->guard.keep[i].tree = &dc->trees[i];
    }
    dc->guard.nkeep = n;
    dc->guard.leaf_fn = drop_leaf;
    dc->guard.opaque = dc;
}

static void keep_destroy(DropCtx *dc)
{
    for (unsigned i = 0; i < dc->guard.nkeep; i++) {
        extree_probe_release(dc->t, &dc->guard.keep[i]);
    }
    g_free(dc->guard.keep);
    g_free(dc->trees);
}

/* DATA a root that stays maps too: its count must keep it */
static int shared_kept(void *opaque, uint64_t host, uint64_t len)
{
    DropCtx *dc = opaque;

    if (!extree_refs_all_shared(dc->t, host, len)) {
        return extree_corrupt(dc->t, host, "corrupt reference count tree: "
                              "host range at offset 0x%" PRIx64 " length 0x%"
                              PRIx64 " has 1 reference, but another root "
                              "maps it too", host, len);
    }
    return 0;
}

/*
 * A leaf the drop frees: before its items' DATA lose the dropped tree's
 * reference, every part a root that stays maps too must have a count that
 * keeps it (a merge with each root's leaves of the same key range)
 */
static int drop_leaf(ExtreeDropGuard *guard, ExtreeNode *leaf)
{
    DropCtx *dc = guard->opaque;
    int ret = 0;

    for (unsigned i = 0; i < guard->nkeep && ret == 0; i++) {
        ret = extree_probe_leaf_shared(dc->t, &guard->keep[i], leaf,
                                       shared_kept, dc);
    }
    return ret;
}

int extree_snapshot_goto(Extree *t, unsigned index)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeTree old;
    ExtreeSnap *sn;
    DropCtx dc;
    int ret;

    ret = begin(t, index);
    if (ret < 0) {
        return ret;
    }
    sn = &g_array_index(t->snap.list, ExtreeSnap, index);
    ret = snap_root_check(t, sn);
    if (ret == 0) {
        ret = extree_bitmaps_resize_ok(t, sn->virtual_size);
    }
    if (ret < 0) {
        return ret;
    }
    /* first the new reference: the old live root may be the same node */
    ret = t->sm.ops->inc_ref(t->sm.opaque, sn->root, t->node_size);
    if (ret == 0) {
        ret = extree_bitmaps_resize(t, sn->virtual_size);
    }
    if (ret == 0) {
        old = *et;
        extree_snap_tree(t, sn, et);
        t->virtual_size = sn->virtual_size;
        /* the whole disk may have changed: as if written */
        extree_bitmaps_mark(t, 0, t->virtual_size);
        t->snap.gen = t->trans_gen;
        t->super_dirty = true;
        /* every snapshot stays, the one reverted to among them */
        keep_init(t, &dc, UINT_MAX, false);
        ret = extree_bt_drop(t, &old, extree_extent_release, t, &dc.guard);
        keep_destroy(&dc);
    }
    return finish(t, ret);
}

int extree_snapshot_delete(Extree *t, unsigned index)
{
    ExtreeTree tree;
    DropCtx dc;
    int ret;

    ret = begin(t, index);
    if (ret < 0) {
        return ret;
    }
    ret = snap_root_check(t, &g_array_index(t->snap.list, ExtreeSnap, index));
    if (ret < 0) {
        return ret;
    }
    extree_snap_tree(t, &g_array_index(t->snap.list, ExtreeSnap, index), &tree);
    keep_init(t, &dc, index, true);
    ret = extree_bt_drop(t, &tree, extree_extent_release, t, &dc.guard);
    keep_destroy(&dc);
    if (ret == 0) {
        g_array_remove_index(t->snap.list, index);
        ret = extree_snap_table_moved(t);
    }
    /* the live tree's path cache may hold nodes the drop freed */
    extree_path_release(t, &t->pcache[EXTREE_TREE_EXTENT]);
    return finish(t, ret);
}

int extree_snapshot_load_tmp(Extree *t, unsigned index)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeSnap *sn;
    int ret;

    if (!t->read_only) {
        return -EROFS;
    }
    if (index >= extree_snapshot_count(t)) {
        return -ENOENT;
    }
    sn = &g_array_index(t->snap.list, ExtreeSnap, index);
    ret = snap_root_check(t, sn);
    if (ret < 0) {
        return ret;
    }
    extree_path_release(t, &t->pcache[EXTREE_TREE_EXTENT]);
    extree_snap_tree(t, sn, et);
    t->virtual_size = sn->virtual_size;
    t->snap_view = index;
    t->seq++;
    return 0;
}

/* ---- VM state: the area from EXTREE_VMSTATE_BASE of the live tree ---- */

static int vmstate_range(Extree *t, uint64_t pos, uint64_t bytes)
{
    if (pos > EXTREE_VMSTATE_MAX || bytes > EXTREE_VMSTATE_MAX - pos) {
        return -EFBIG;
    }
    return 0;
}

/* Block @blk of the area as the live tree holds it (zeroes if unmapped) */
static int vmstate_read_block(Extree *t, uint64_t blk, uint8_t *buf)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    uint64_t key = EXTREE_VMSTATE_BASE + blk * t->block_size;
    ExtreeItem prev, next;
    bool hp, hn;
    int ret;

    memset(buf, 0, t->block_size);
    if (!extree_has_refs(t)) {
        return 0;
    }
    ret = extree_bt_find(t, et, key, &prev, &hp, &next, &hn);
    if (ret < 0) {
        return ret;
    }
    if (hn && next.key == key) {
        prev = next;
        hp = true;
    }
    if (hp && prev.type == EXTREE_ITEM_DATA && prev.key <= key &&
        key - prev.key < prev.length) {
        return t->be->ops->pread(t->be->opaque, prev.host + (key - prev.key),
                                 buf, t->block_size);
    }
    return 0;
}

int extree_vmstate_read(Extree *t, uint64_t pos, void *buf, uint64_t bytes)
{
    uint64_t bs = t->block_size;
    uint8_t *blk = g_malloc(bs);
    int ret = vmstate_range(t, pos, bytes);

    while (ret == 0 && bytes) {
        uint64_t off = pos % bs, n = MIN(bytes, bs - off);

        ret = vmstate_read_block(t, pos / bs, blk);
        memcpy(buf, blk + off, n);
        buf = (uint8_t *)buf + n;
        pos += n;
        bytes -= n;
    }
    g_free(blk);
    return ret;
}

/*
 * Always to new space, block by block of the allocation (partial blocks
 * read back first), then mapped: the VM state is written once per savevm
 */
int extree_vmstate_write(Extree *t, uint64_t pos, const void *buf,
                         uint64_t bytes)
{
    uint64_t bs = t->block_size;
    int ret = extree_check_writable(t);

    t->bm.unlogged = true;      /* no map record holds it */
    if (ret == 0) {
        ret = vmstate_range(t, pos, bytes);
    }
    if (ret == 0) {
        ret = extree_probe_end(t);
    }
    if (ret == 0) {
        ret = enable_snapshots(t);
    }
    while (ret == 0 && bytes) {
        uint64_t start = pos / bs * bs;
        uint64_t end = EXTREE_ROUND_UP(pos + bytes, bs);
        uint64_t host, got, n;
        uint8_t *tmp;

        ret = extree_alloc_data(t, EXTREE_VMSTATE_BASE + start, end - start,
                                &host, &got);
        if (ret < 0) {
            break;
        }
        tmp = g_malloc(got);
        if (pos > start) {
            ret = vmstate_read_block(t, start / bs, tmp);
        }
        n = MIN(bytes, start + got - pos);
        if (ret == 0 && (pos + n) % bs) {
            uint64_t last = (pos + n) / bs * bs;

            ret = vmstate_read_block(t, last / bs, tmp + (last - start));
        }
        if (ret == 0) {
            memcpy(tmp + (pos - start), buf, n);
            ret = t->be->ops->pwrite(t->be->opaque, host, tmp, got);
        }
        if (ret == 0) {
            ret = extree_map_data(t, EXTREE_VMSTATE_BASE + start, got, host);
        }
        if (ret < 0) {
            extree_free_data(t, host, got);
        }
        g_free(tmp);
        buf = (const uint8_t *)buf + n;
        pos += n;
        bytes -= n;
    }
    return ret;
}
