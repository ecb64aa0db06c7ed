/*
 * extree: QEMU block driver glue
 *
 * The image format (a copy-on-write B+tree of extents, docs/interop/extree.rst)
 * lives in the QEMU-independent core behind block/extree/extree.h.  This
 * file is the BlockDriver table and the driver's life cycle: probe, open,
 * close, reopen, inactivate and invalidate, the commit timer, info and the
 * check glue; it turns the core's errors into QEMU's.  Create, measure and
 * amend are in extree-create.c.
 * Guest I/O and commits are in extree-req.c, -read.c, -write.c, -range.c
 * and -compressed.c, the core's backend over
 * bs->file and grow-ahead in extree-file.c (block/extree-qemu.h).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block_int.h"
#include "block/dirty-bitmap.h"
#include "block/qdict.h"
#include "crypto.h"
#include "qapi/error.h"
#include "qapi/qapi-visit-block-core.h"
#include "qapi/qobject-input-visitor.h"
#include "qemu/coroutine.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/module.h"
#include "qemu/option.h"
#include "qemu/option_int.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "qobject/qdict.h"
#include "system/block-backend.h"
#include "trace/trace-block_extree.h"

#include "extree-qemu.h"

#define EXTREE_OPT_CACHE_SIZE       "cache-size"
#define EXTREE_OPT_COMMIT_INTERVAL  "commit-interval"
#define EXTREE_OPT_MARK_LOG         "mark-log"

#define EXTREE_DEFAULT_COMMIT_INTERVAL  5           /* seconds */
#define EXTREE_MAX_COMMIT_INTERVAL      (24 * 3600) /* seconds */

typedef struct ExtreeReopenState {
    Extree *t;                          /* new core handle, or NULL */
    bool core_read_only;
    uint64_t cache_size;
    uint64_t commit_interval;
    bool mark_log;
} ExtreeReopenState;

static BlockDriver bdrv_extree;

static QemuOptsList xt_runtime_opts = {
    .name = "extree",
    .head = QTAILQ_HEAD_INITIALIZER(xt_runtime_opts.head),
    .desc = {
        {
            .name = EXTREE_OPT_CACHE_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Maximum size of the metadata node cache in bytes "
                    "(default: 32 MiB); dirty nodes are kept until commit "
                    "regardless",
        },
        {
            .name = EXTREE_OPT_COMMIT_INTERVAL,
            .type = QEMU_OPT_NUMBER,
            .help = "Commit uncommitted metadata at the latest this many "
                    "seconds after the first change (default: 5, at most "
                    "86400; 0: only on flush and when 16 MiB of metadata "
                    "are dirty)",
        },
        {
            .name = EXTREE_OPT_MARK_LOG,
            .type = QEMU_OPT_BOOL,
            .help = "Add a mark log to an image with bitmaps that has none "
                    "(default: on; off: a write in place over granules "
                    "the stored bitmaps lack moves to new space)",
        },
        { /* end of list */ }
    },
};

/* The key decides what the image reads as (bdrv_refresh_filename()) */
static const char *const xt_strong_runtime_opts[] = {
    "encrypt." BLOCK_CRYPTO_OPT_LUKS_KEY_SECRET,
    NULL
};

static const char *const xt_mutable_opts[] = {
    EXTREE_OPT_CACHE_SIZE,
    EXTREE_OPT_COMMIT_INTERVAL,
    NULL
};

/* ---- Commit timer, AioContext ---- */

/*
 * The commit timer is armed by xt_update_done() (extree-req.c) on the first
 * change after a commit; it commits in a coroutine, through the gate.
 */
static void coroutine_fn xt_commit_timer_entry(void *opaque)
{
    BDRVExtreeState *s = opaque;
    BlockDriverState *bs = s->bs;

    GRAPH_RDLOCK_GUARD();

    trace_extree_commit_timer(s);
    if (xt_enter(s) == 0) {
        if (!s->inactive) {
            /* the marks only the mark log holds are stored now too */
            extree_mark_log_checkpoint(s->t);
            xt_commit_locked(s);
        }
        xt_leave(s);
    }
    bdrv_dec_in_flight(bs);
}

static void xt_start_commit_co(BDRVExtreeState *s)
{
    Coroutine *co = qemu_coroutine_create(xt_commit_timer_entry, s);

    bdrv_inc_in_flight(s->bs);
    aio_co_enter(bdrv_get_aio_context(s->bs), co);
}

static void xt_commit_timer_cb(void *opaque)
{
    xt_start_commit_co(opaque);
}

static void xt_detach_aio_context(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer) {
        timer_free(s->commit_timer);
        s->commit_timer = NULL;
    }
}

static void xt_attach_aio_context(BlockDriverState *bs,
                                  AioContext *new_context)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer || !s->t || s->core_read_only || s->inactive) {
        return;
    }
    s->commit_timer = aio_timer_new(new_context, QEMU_CLOCK_REALTIME,
                                    SCALE_MS, xt_commit_timer_cb, s);
    if (s->commit_interval && extree_is_dirty(s->t)) {
        timer_mod(s->commit_timer, qemu_clock_get_ms(QEMU_CLOCK_REALTIME) +
                  s->commit_interval * 1000);
    }
}

/*
 * A drained section must not see the timer start I/O: commit now instead
 * (the drain waits for it), as QED does with its need-check timer.
 */
static void xt_drain_begin(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer && timer_pending(s->commit_timer)) {
        timer_del(s->commit_timer);
        xt_start_commit_co(s);
    }
}

/*
 * Drained: every request has returned and QEMU's bitmaps have its marks,
 * so the core's marks kept for requests in flight can go
 * (extree_bitmaps_keep_marks()).  Nothing else uses the handle now.
 */
static void xt_drain_end(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->t && extree_bitmaps_have_marks(s->t)) {
        extree_bitmaps_marks_reflected(s->t);
        /* a sync that took them stored more than QEMU has: redo it */
        s->bitmaps_resync = true;
    }
}

/* ---- Probe, open, close ---- */

static int xt_probe(const uint8_t *buf, int buf_size, const char *filename)
{
    uint64_t magic;

    if (buf_size < (int)sizeof(magic)) {
        return 0;
    }
    memcpy(&magic, buf, sizeof(magic));
    return le64_to_cpu(magic) == EXTREE_MAGIC ? 100 : 0;
}

static int xt_parse_runtime_opts(QDict *options, uint64_t *cache_size,
                                 uint64_t *commit_interval, bool *mark_log,
                                 Error **errp)
{
    QemuOpts *opts;
    int ret = 0;

    opts = qemu_opts_create(&xt_runtime_opts, NULL, 0, &error_abort);
    if (!qemu_opts_absorb_qdict(opts, options, errp)) {
        ret = -EINVAL;
        goto out;
    }
    *cache_size = qemu_opt_get_size(opts, EXTREE_OPT_CACHE_SIZE, 0);
    *commit_interval = qemu_opt_get_number(opts, EXTREE_OPT_COMMIT_INTERVAL,
                                           EXTREE_DEFAULT_COMMIT_INTERVAL);
    *mark_log = qemu_opt_get_bool(opts, EXTREE_OPT_MARK_LOG, true);
    if (*commit_interval > EXTREE_MAX_COMMIT_INTERVAL) {
        error_setg(errp, "'" EXTREE_OPT_COMMIT_INTERVAL "' must be between 0 "
                   "and %d seconds", EXTREE_MAX_COMMIT_INTERVAL);
        ret = -EINVAL;
    }
out:
    qemu_opts_del(opts);
    return ret;
}

/*
 * Open a core handle on bs->file.  @flags decide read-only: an inactive
 * image (incoming migration) is opened read-only until invalidate_cache.
 * qemu-img check -r (BDRV_O_CHECK, read/write) opens in repair mode, which
 * accepts an image marked corrupt or with a damaged free-space tree.
 *
 * A read/write open that finds damaged metadata marks the image corrupt
 * (the handle cannot be had, so the core does it from the superblocks) and
 * fails; it can then be opened read-only.
 */
static int coroutine_mixed_fn GRAPH_RDLOCK
xt_open_core(BDRVExtreeState *s, int flags, uint64_t cache_size,
             Extree **out, bool *read_only, Error **errp)
{
    ExtreeDamage damage = EXTREE_DAMAGE_NONE;
    ExtreeOpenOptions o = {
        .read_only = !(flags & BDRV_O_RDWR) || (flags & BDRV_O_INACTIVE),
        .cache_size = cache_size,
        /*
         * A commit must wait for requests that hold allocated space they
         * have not mapped yet: the driver commits through its gate when
         * the core wants it (xt_update_done())
         */
        .dirty_limit = s->dirty_limit,
        .commit_by_caller = true,
        .repair = (flags & BDRV_O_CHECK) && (flags & BDRV_O_RDWR),
        .check = flags & BDRV_O_CHECK,
        .damage = &damage,
        .no_mark_log = !s->mark_log,
    };
    g_autofree char *msg = NULL;
    const char *warning;
    int ret;

    ret = extree_open(&s->backend, &o, out, &msg);
    if (ret == -EACCES) {
        error_setg(errp, "extree: Image is corrupt; cannot be opened "
                   "read/write");
        return ret;
    } else if (ret == -EIO && !o.read_only &&
               damage == EXTREE_DAMAGE_CORRUPT) {
        int ret2 = extree_mark_corrupt_image(&s->backend);
        ExtreeOpenOptions ro = { .read_only = true };
        g_autofree char *ro_msg = NULL;
        Extree *ro_t = NULL;

        error_setg(errp, "extree: %s", msg);
        if (ret2 == 0 && extree_open(&s->backend, &ro, &ro_t, &ro_msg) == 0) {
            error_append_hint(errp, "The image has been marked corrupt; it "
                              "can still be opened read-only.\n");
        } else if (ret2 == 0) {
            error_append_hint(errp, "The image has been marked corrupt; "
                              "'qemu-img check' reports the damage.\n");
        }
        extree_close(ro_t);
        return ret;
    } else if (ret < 0) {
        error_setg(errp, "extree: %s", msg ? msg : strerror(-ret));
        return ret;
    }

    warning = extree_open_warning(*out);
    if (warning) {
        warn_report("extree: %s", warning);
    }
    *read_only = o.read_only;
    return 0;
}

/* Install core handle @t; called with no request in flight */
static void GRAPH_RDLOCK xt_install_core(BDRVExtreeState *s, Extree *t,
                                         bool read_only)
{
    BlockDriverState *bs = s->bs;
    const char *backing_file, *backing_fmt;

    s->t = t;
    s->core_read_only = read_only;
    /* QEMU marks its bitmaps when a request has returned (extree-dirty.c) */
    extree_bitmaps_keep_marks(t);
    s->file_len = -1;
    s->grow_off = false;
    s->block_size = extree_block_size(t);
    s->node_size = extree_node_size(t);
    s->compress_unit = MAX(XT_COMPRESS_UNIT, s->block_size);
    s->compress_alg = extree_compression_type(t) ?: EXTREE_COMPRESS_ZSTD;
    extree_set_trace(t, xt_core_trace, s);
    extree_cursor_init(&s->status_cursor, t);
    qatomic_set(&s->virtual_size, extree_virtual_size(t));

    backing_file = extree_backing_file(t);
    backing_fmt = extree_backing_fmt(t);
    if (backing_file) {
        /* Like qcow2: keep user-given names unless the image changed them */
        if (!g_str_equal(backing_file, bs->backing_file)) {
            pstrcpy(bs->backing_file, sizeof(bs->backing_file),
                    backing_file);
            pstrcpy(bs->auto_backing_file, sizeof(bs->auto_backing_file),
                    backing_file);
        }
        if (backing_fmt) {
            pstrcpy(bs->backing_format, sizeof(bs->backing_format),
                    backing_fmt);
        }
    }
    bs->total_sectors = extree_virtual_size(t) / BDRV_SECTOR_SIZE;
    trace_extree_open(s, extree_generation(t), extree_virtual_size(t),
                      read_only);
}

/*
 * Drop the core handle; called with no request in flight.  No cursor may
 * point into the freed handle: requests' own cursors are gone with them,
 * and the block-status cursor is reset.
 */
static void xt_drop_core(BDRVExtreeState *s)
{
    if (s->t) {
        /* damage a closing commit found is reported, not dropped */
        xt_handle_corruption(s);
        trace_extree_close(s, extree_generation(s->t));
        extree_cursor_release(&s->status_cursor);
        extree_close(s->t);
        s->t = NULL;
    }
    extree_cursor_init(&s->status_cursor, NULL);
}

static void xt_init_state(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    s->bs = bs;
    s->backend.ops = &xt_file_backend_ops;
    s->backend.opaque = s;
    qemu_co_mutex_init(&s->lock);
    qemu_co_queue_init(&s->io_queue);
    qemu_co_queue_init(&s->commit_queue);
    qemu_co_queue_init(&s->replace_queue);
    qemu_co_queue_init(&s->idle_queue);
    qemu_co_queue_init(&s->mark_queue);
    QLIST_INIT(&s->deferred_reqs);
    qemu_co_queue_init(&s->deferred_queue);
    s->mark_batch = 1;
    QLIST_INIT(&s->alloc_reqs);
    QLIST_INIT(&s->node_reads);
    s->dirty_limit = EXTREE_DEFAULT_DIRTY_LIMIT;
}

typedef struct ExtreeOpenCo {
    BlockDriverState *bs;
    int flags;
    QDict *encryptopts;
    Error **errp;
    int ret;
} ExtreeOpenCo;

static void coroutine_fn xt_open_entry(void *opaque)
{
    ExtreeOpenCo *oc = opaque;
    BDRVExtreeState *s = oc->bs->opaque;
    Extree *t = NULL;
    bool read_only;
    int ret;

    GRAPH_RDLOCK_GUARD();

    xt_lock(s);
    ret = xt_open_core(s, oc->flags, s->cache_size, &t, &read_only,
                       oc->errp);
    if (ret == 0) {
        xt_install_core(s, t, read_only);
        /* The key is checked before anything is written */
        ret = xt_crypt_open(s, oc->encryptopts, oc->flags, oc->errp);
        if (ret == 0 && !(oc->flags & BDRV_O_INACTIVE)) {
            ret = xt_bitmaps_load(s, oc->errp);
            if (ret < 0) {
                bdrv_release_named_dirty_bitmaps(oc->bs);
                xt_crypt_close(s);
            }
        }
        if (ret < 0) {
            xt_drop_core(s);
        }
    }
    qemu_co_mutex_unlock(&s->lock);
    /* Last: the caller stops waiting when it changes */
    oc->ret = ret;
    aio_wait_kick();
}

static int xt_open(BlockDriverState *bs, QDict *options, int flags,
                   Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeOpenCo oc = {
        .bs = bs,
        .flags = flags,
        .errp = errp,
        .ret = -EINPROGRESS,
    };
    int ret;

    ret = bdrv_open_file_child(NULL, options, "file", bs, errp);
    if (ret < 0) {
        return ret;
    }
    xt_init_state(bs);
    ret = xt_parse_runtime_opts(options, &s->cache_size,
                                &s->commit_interval, &s->mark_log, errp);
    if (ret < 0) {
        return ret;
    }
    qdict_extract_subqdict(options, &oc.encryptopts, "encrypt.");
    s->inactive = flags & BDRV_O_INACTIVE;

    assert(!qemu_in_coroutine());
    assert(qemu_get_current_aio_context() == qemu_get_aio_context());
    aio_co_enter(bdrv_get_aio_context(bs),
                 qemu_coroutine_create(xt_open_entry, &oc));
    AIO_WAIT_WHILE_UNLOCKED(NULL, oc.ret == -EINPROGRESS);
    qobject_unref(oc.encryptopts);
    ret = oc.ret;
    if (ret < 0) {
        return ret;
    }

    bs->supported_zero_flags = BDRV_REQ_MAY_UNMAP | BDRV_REQ_NO_FALLBACK;
    bs->supported_truncate_flags = BDRV_REQ_ZERO_WRITE;

    xt_attach_aio_context(bs, bdrv_get_aio_context(bs));
    return 0;
}

static void xt_refresh_limits(BlockDriverState *bs, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;

    /*
     * Any alignment: sub-block writes are read-modify-write of a block.
     * Encrypted: whole sectors of the cipher.
     */
    bs->bl.request_alignment = s->crypto ?
        qcrypto_block_get_sector_size(s->crypto) : 1;
    bs->bl.pdiscard_alignment = s->block_size;
    bs->bl.pwrite_zeroes_alignment = s->block_size;
}

static void GRAPH_RDLOCK xt_do_close(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    xt_detach_aio_context(bs);
    /*
     * A broken handle commits nothing more: the request that broke it has
     * failed and said why (whether the commit timer tried again since is
     * a matter of timing, so close does not repeat it)
     */
    if (!s->inactive && !(s->t && extree_is_broken(s->t))) {
        int ret = xt_commit_now(s);
        if (ret < 0) {
            error_report("extree: Could not commit metadata on close: %s",
                         strerror(-ret));
        }
        xt_trim_file(s);
    }
    xt_drop_core(s);
}

static void GRAPH_UNLOCKED xt_close(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    xt_do_close(bs);
    xt_crypt_close(s);
    g_free(s->bitmap_removing);
    s->bitmap_removing = NULL;
    if (s->bitmap_gens) {
        g_hash_table_destroy(s->bitmap_gens);
        s->bitmap_gens = NULL;
    }
}

/* ---- Persistent dirty bitmaps (extree-dirty.c) ---- */

static bool xt_supports_persistent_dirty_bitmap(BlockDriverState *bs)
{
    return true;
}

static bool coroutine_fn GRAPH_RDLOCK
xt_co_can_store_new_dirty_bitmap(BlockDriverState *bs, const char *name,
                                 uint32_t granularity, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    bool ok;

    if (xt_enter(s) < 0) {
        error_setg(errp, "extree: the image is not open");
        return false;
    }
    ok = xt_bitmaps_can_store(s, name, granularity, errp);
    xt_leave(s);
    return ok;
}

/*
 * Removed from the image at once, as qcow2 does; QEMU releases its own
 * bitmap after this returns, so the commit's sync must not store it again
 * meanwhile (s->bitmaps_removing)
 */
static int coroutine_fn GRAPH_RDLOCK
xt_co_remove_persistent_dirty_bitmap(BlockDriverState *bs,
                                     const char *name, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    int ret = xt_enter(s);

    if (ret < 0) {
        error_setg_errno(errp, -ret, "extree: the image is not open");
        return ret;
    }
    if (s->core_read_only || s->inactive) {
        ret = -EROFS;
        error_setg(errp, "Can't remove bitmap '%s' from read-only image '%s'",
                   name, bdrv_get_device_or_node_name(bs));
    } else if (extree_bitmap_find(s->t, name) >= 0) {
        /* not stored yet is not an error (bdrv_remove_persistent_...) */
        g_free(s->bitmap_removing);
        s->bitmap_removing = g_strdup(name);
        ret = extree_bitmap_remove(s->t, name);
        if (ret == 0) {
            ret = xt_commit_locked(s);
        }
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not remove bitmap '%s' from "
                             "'%s'", name, bdrv_get_device_or_node_name(bs));
        }
    }
    xt_leave(s);
    return ret;
}

/* ---- Reopen, inactivate, invalidate ---- */

static int GRAPH_UNLOCKED
xt_reopen_prepare(BDRVReopenState *state, BlockReopenQueue *queue,
                  Error **errp)
{
    BDRVExtreeState *s = state->bs->opaque;
    ExtreeReopenState *r;
    bool want_ro = !(state->flags & BDRV_O_RDWR) ||
                   (state->flags & BDRV_O_INACTIVE);
    QDict *encryptopts = NULL;
    bool new_handle;
    int ret;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    r = g_new0(ExtreeReopenState, 1);
    ret = xt_parse_runtime_opts(state->options, &r->cache_size,
                                &r->commit_interval, &r->mark_log, errp);
    if (ret < 0) {
        goto fail;
    }
    /* The LUKS context opened with the image stays: the key is not reread */
    qdict_extract_subqdict(state->options, &encryptopts, "encrypt.");
    qobject_unref(encryptopts);

    /* Going read-only: everything must be committed now */
    if (want_ro && !s->core_read_only) {
        ret = xt_commit_now(s);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not commit extree metadata");
            goto fail;
        }
        /* While bs->file still grants resize */
        xt_trim_file(s);
    }

    /*
     * A new core handle for a change of read-only mode or cache size: it
     * is opened from the committed state, which is all there is now.
     */
    new_handle = want_ro != s->core_read_only ||
                 r->cache_size != s->cache_size;
    trace_extree_reopen_prepare(s, want_ro, new_handle);
    if (new_handle) {
        if (!s->core_read_only) {
            ret = xt_commit_now(s);
            if (ret < 0) {
                error_setg_errno(errp, -ret,
                                 "Could not commit extree metadata");
                goto fail;
            }
        }
        ret = xt_open_core(s, state->flags, r->cache_size, &r->t,
                           &r->core_read_only, errp);
        if (ret < 0) {
            goto fail;
        }
    }
    state->opaque = r;
    return 0;

fail:
    g_free(r);
    return ret;
}

static void GRAPH_UNLOCKED xt_reopen_commit(BDRVReopenState *state)
{
    BDRVExtreeState *s = state->bs->opaque;
    ExtreeReopenState *r = state->opaque;

    GRAPH_RDLOCK_GUARD_MAINLOOP();

    s->cache_size = r->cache_size;
    s->commit_interval = r->commit_interval;
    s->mark_log = r->mark_log;
    if (r->t) {
        xt_detach_aio_context(state->bs);
        xt_drop_core(s);
        xt_install_core(s, r->t, r->core_read_only);
        xt_bitmaps_set_readonly(s, r->core_read_only);
        xt_attach_aio_context(state->bs,
                              bdrv_get_aio_context(state->bs));
    }
    g_free(r);
    state->opaque = NULL;
}

static void GRAPH_UNLOCKED xt_reopen_abort(BDRVReopenState *state)
{
    ExtreeReopenState *r = state->opaque;

    if (r) {
        extree_close(r->t);
        g_free(r);
        state->opaque = NULL;
    }
}

static int coroutine_fn GRAPH_RDLOCK
xt_inactivate_locked(BDRVExtreeState *s)
{
    int ret;

    /* no writer is left (the block layer checked): every bit, exactly */
    xt_bitmaps_sync(s, true);
    ret = xt_commit_locked(s);

    if (ret == 0) {
        /* Reads may run, but below host_end only */
        xt_trim_file(s);
    }
    return ret;
}

/*
 * Migration (or blockdev-set-active): the destination takes over; commit
 * and stop writing.  Not drained: reads may go on meanwhile.
 */
static int GRAPH_RDLOCK xt_inactivate(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    trace_extree_inactivate(s);
    xt_detach_aio_context(bs);
    ret = xt_call_locked(bs, xt_inactivate_locked);
    if (ret < 0) {
        error_report("extree: Could not commit metadata on inactivation: %s",
                     strerror(-ret));
    } else {
        /* committed: the image's next user loads them (as qcow2's) */
        xt_bitmaps_release(s);
    }
    s->inactive = true;
    return ret;
}

/*
 * The source wrote the image meanwhile: drop everything cached and open
 * the core afresh from the image's last commit.  The block layer does not
 * drain the node for this (NBD may go on reading an inactive node), so
 * requests in flight are waited for, and new ones held back, while the
 * handle they would use is replaced.
 */
static void coroutine_fn GRAPH_RDLOCK
xt_co_invalidate_cache(BlockDriverState *bs, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    Extree *t = NULL;
    bool read_only;
    int ret;

    trace_extree_invalidate_cache(s);
    xt_lock(s);
    assert(!s->replacing);
    s->replacing = true;
    while (s->requests > 0) {
        xt_queue_wait(s, &s->idle_queue);
    }
    xt_detach_aio_context(bs);
    if (!s->inactive) {
        xt_commit_now(s);
    }
    xt_drop_core(s);
    s->inactive = false;
    s->signaled_corruption = false;
    ret = xt_open_core(s, bs->open_flags & ~BDRV_O_INACTIVE,
                       s->cache_size, &t, &read_only, errp);
    if (ret == 0) {
        xt_install_core(s, t, read_only);
        ret = xt_bitmaps_load(s, errp);
    }
    s->replacing = false;
    qemu_co_queue_restart_all(&s->replace_queue);
    qemu_co_mutex_unlock(&s->lock);
    if (ret < 0) {
        error_prepend(errp, "Could not reopen extree layer: ");
        bs->drv = NULL;
        return;
    }
    xt_attach_aio_context(bs, bdrv_get_aio_context(bs));
}

static int GRAPH_RDLOCK xt_make_empty(BlockDriverState *bs)
{
    return xt_call_locked(bs, xt_make_empty_locked);
}

/* ---- Check ---- */

static void xt_check_report(void *opaque, const char *msg)
{
    fprintf(stderr, "%s\n", msg);
}

/*
 * qemu-img check.  -r leaks: leaked space goes back to the free-space tree
 * (only if nothing is corrupt).  -r all: also a damaged free-space tree is
 * rebuilt from the extent tree.  Damage to the extent tree is never
 * repaired.  When no corruption is left, the corrupt bit is cleared, as
 * qcow2 does.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_co_check(BlockDriverState *bs, BdrvCheckResult *result,
            BdrvCheckMode fix)
{
    BDRVExtreeState *s = bs->opaque;
    unsigned core_fix = (fix & BDRV_FIX_LEAKS ? EXTREE_FIX_LEAKS : 0) |
                        (fix & BDRV_FIX_ERRORS ? EXTREE_FIX_ERRORS : 0);
    ExtreeCheckResult r;
    uint64_t leaked_blocks;
    int ret;

    trace_extree_co_check_start(s, fix);
    ret = xt_enter(s);
    if (ret < 0) {
        result->check_errors++;
        return ret;
    }
    ret = xt_commit_locked(s);
    if (ret < 0) {
        result->check_errors++;
        goto out;
    }
    ret = extree_check_fix(s->t, core_fix, &r, xt_check_report, NULL);
    if (ret < 0) {
        fprintf(stderr, "extree: check failed: %s\n", strerror(-ret));
        result->check_errors++;
        goto out;
    }
    if (r.repaired_corruptions && !s->core_read_only) {
        Error *local_err = NULL;

        /*
         * A repair may have changed the bitmaps (removed, or marked whole
         * after a damaged mark log): QEMU's copies are read again, so that
         * the close does not store the old bits over the repair
         */
        xt_bitmaps_release(s);
        if (xt_bitmaps_load(s, &local_err) < 0) {
            error_report_err(local_err);
            result->check_errors++;
        }
    }
    /* BdrvCheckResult counts in int: a huge leak saturates */
    leaked_blocks = MIN((r.leaked_bytes + r.leaked_ref_bytes) /
                        s->block_size, INT_MAX);
    result->corruptions = r.corruptions - r.repaired_corruptions;
    result->corruptions_fixed = r.repaired_corruptions;
    if (r.leaks && r.repaired_leaks == r.leaks) {
        result->leaks_fixed = leaked_blocks;
    } else {
        result->leaks = leaked_blocks;
    }
    if (core_fix && !result->corruptions &&
        (extree_incompat_features(s->t) & EXTREE_INCOMPAT_CORRUPT)) {
        ret = extree_clear_corrupt(s->t);
        if (ret < 0) {
            fprintf(stderr, "extree: could not clear the corrupt bit: %s\n",
                    strerror(-ret));
            result->check_errors++;
        } else {
            fprintf(stderr, "extree: corrupt bit cleared\n");
        }
    }
    result->image_end_offset = extree_host_end(s->t);
    result->bfi.total_clusters =
        DIV_ROUND_UP(extree_virtual_size(s->t), s->block_size);
    if (!result->corruptions) {
        uint64_t data_blocks, fragments;

        ret = extree_count_fragments(s->t, &data_blocks, &fragments);
        result->bfi.allocated_clusters = data_blocks;
        result->bfi.fragmented_clusters = fragments;
        result->bfi.compressed_clusters = r.compressed_bytes / s->block_size;
        if (ret < 0) {
            result->check_errors++;
        }
    }
    ret = 0;
out:
    /* The checker reports damage itself; don't mark on its behalf */
    if (s->t) {
        extree_drop_corruption(s->t);
    }
    xt_leave(s);
    trace_extree_co_check_done(s, result->corruptions, result->leaks, ret);
    return ret;
}

/* ---- Info ---- */

static int coroutine_fn
xt_co_get_info(BlockDriverState *bs, BlockDriverInfo *bdi)
{
    BDRVExtreeState *s = bs->opaque;

    bdi->cluster_size = s->block_size;
    /*
     * What qemu-img convert -c and rebase -c write at a time
     * (patches/qemu/0009): two compression units, one for each core
     */
    bdi->compressed_cluster_size = MIN(MAX(XT_COMPRESS_CHUNK,
                                           s->compress_unit),
                                       EXTREE_COMPRESSED_MAX);
    /*
     * New dirty bitmaps at 64 KiB, as on a qcow2 image of default clusters
     * (patches/qemu/0013), not at the block: a sixteenth of the bits, and
     * a first write after a clear moves once per 64 KiB.  At least a
     * block: a persistent bitmap may not be finer.
     */
    bdi->bitmap_granularity = MAX(64 * KiB, s->block_size);
    bdi->is_dirty = false;
    return 0;
}

static ImageInfoSpecific * GRAPH_RDLOCK
xt_get_specific_info(BlockDriverState *bs, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    ImageInfoSpecific *spec_info;

    /* Main loop: a failed invalidation leaves no handle */
    if (!s->t) {
        error_setg(errp, "extree: the image is not open");
        return NULL;
    }
    spec_info = g_new(ImageInfoSpecific, 1);
    *spec_info = (ImageInfoSpecific){
        .type = IMAGE_INFO_SPECIFIC_KIND_EXTREE,
        .u.extree.data = g_new0(ImageInfoSpecificExtree, 1),
    };
    *spec_info->u.extree.data = (ImageInfoSpecificExtree){
        .block_size = extree_block_size(s->t),
        .node_size = extree_node_size(s->t),
        .generation = extree_generation(s->t),
        .extent_count = extree_extent_count(s->t),
        .tree_depth = extree_depth(s->t),
        .free_bytes = extree_free_bytes(s->t),
        .host_end = extree_host_end(s->t),
        .corrupt = !!(extree_incompat_features(s->t) &
                      EXTREE_INCOMPAT_CORRUPT),
    };
    if (extree_compression_type(s->t) ||
        (extree_incompat_features(s->t) & EXTREE_INCOMPAT_COMPRESSED)) {
        ImageInfoSpecificExtree *x = spec_info->u.extree.data;

        x->has_compression_type = true;
#ifdef CONFIG_ZSTD
        x->compression_type = s->compress_alg == EXTREE_COMPRESS_ZSTD ?
                              QCOW2_COMPRESSION_TYPE_ZSTD :
                              QCOW2_COMPRESSION_TYPE_ZLIB;
#else
        /* (the core decompresses zstd even so) */
        x->compression_type = QCOW2_COMPRESSION_TYPE_ZLIB;
        x->has_compression_type = s->compress_alg == EXTREE_COMPRESS_ZLIB;
#endif
    }
    if (extree_bitmap_count(s->t)) {
        ImageInfoSpecificExtree *x = spec_info->u.extree.data;
        Qcow2BitmapInfoList **tail = &x->bitmaps;

        /* as qcow2's: listed when there are some */
        x->has_bitmaps = true;
        for (unsigned i = 0; i < extree_bitmap_count(s->t); i++) {
            Qcow2BitmapInfo *bi = g_new0(Qcow2BitmapInfo, 1);
            ExtreeBitmapInfo info;

            extree_bitmap_info(s->t, i, &info);
            bi->name = g_strdup(info.name);
            bi->granularity = info.granularity;
            if (info.enabled) {
                QAPI_LIST_PREPEND(bi->flags, QCOW2_BITMAP_INFO_FLAGS_AUTO);
            }
            QAPI_LIST_APPEND(tail, bi);
        }
    }
    if (extree_incompat_features(s->t) & EXTREE_INCOMPAT_MARK_LOG) {
        ImageInfoSpecificExtree *x = spec_info->u.extree.data;
        ExtreeMarkLogInfo li;

        extree_mark_log_info(s->t, &li);
        x->mark_log = g_new0(ImageInfoSpecificExtreeMarkLog, 1);
        x->mark_log->length = li.length;
        x->mark_log->records = li.records;
        x->mark_log->map_records = li.maps;
        x->mark_log->replayed_map_entries = li.map_replayed;
    }
    if (s->crypto) {
        QCryptoBlockInfo *encrypt = qcrypto_block_get_info(s->crypto, errp);

        if (!encrypt) {
            qapi_free_ImageInfoSpecific(spec_info);
            return NULL;
        }
        spec_info->u.extree.data->encrypt = encrypt;
    }
    return spec_info;
}

/* ---- Backing file ---- */

static int coroutine_fn GRAPH_RDLOCK
xt_co_change_backing_file(BlockDriverState *bs, const char *backing_file,
                          const char *backing_fmt)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    trace_extree_change_backing_file(s, backing_file ?: "",
                                     backing_fmt ?: "");
    if (backing_file && strlen(backing_file) > EXTREE_BACKING_FILE_MAX) {
        return -EINVAL;
    }
    if (backing_fmt && strlen(backing_fmt) > EXTREE_BACKING_FMT_MAX) {
        return -EINVAL;
    }
    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    ret = extree_set_backing(s->t, backing_file, backing_file ? backing_fmt
                                                              : NULL);
    if (ret == 0) {
        ret = xt_commit_locked(s);
    }
    xt_leave(s);
    if (ret < 0) {
        return ret;
    }

    pstrcpy(bs->auto_backing_file, sizeof(bs->auto_backing_file),
            backing_file ?: "");
    pstrcpy(bs->backing_file, sizeof(bs->backing_file), backing_file ?: "");
    pstrcpy(bs->backing_format, sizeof(bs->backing_format),
            backing_fmt ?: "");
    return 0;
}

/* ---- Driver table ---- */

static BlockDriver bdrv_extree = {
    .format_name                    = "extree",
    .instance_size                  = sizeof(BDRVExtreeState),
    .create_opts                    = &xt_create_opts,
    .amend_opts                     = &xt_amend_opts,
    .mutable_opts                   = xt_mutable_opts,
    .strong_runtime_opts            = xt_strong_runtime_opts,
    .is_format                      = true,
    .supports_backing               = true,

    .bdrv_probe                     = xt_probe,
    .bdrv_open                      = xt_open,
    .bdrv_close                     = xt_close,
    .bdrv_reopen_prepare            = xt_reopen_prepare,
    .bdrv_reopen_commit             = xt_reopen_commit,
    .bdrv_reopen_abort              = xt_reopen_abort,
    .bdrv_child_perm                = bdrv_default_perms,
    .bdrv_co_create                 = xt_co_create,
    .bdrv_co_create_opts            = xt_co_create_opts,
    .bdrv_has_zero_init             = bdrv_has_zero_init_1,
    .bdrv_inactivate                = xt_inactivate,
    .bdrv_co_invalidate_cache       = xt_co_invalidate_cache,

    .bdrv_co_preadv_part            = xt_co_preadv_part,
    .bdrv_co_pwritev_part           = xt_co_pwritev_part,
    .bdrv_co_pwritev_compressed_part = xt_co_pwritev_compressed_part,
    .bdrv_co_flush_to_os            = xt_co_flush_to_os,
    .bdrv_co_pwrite_zeroes          = xt_co_pwrite_zeroes,
    .bdrv_co_pdiscard               = xt_co_pdiscard,
    .bdrv_co_truncate               = xt_co_truncate,
    .bdrv_co_getlength              = xt_co_getlength,
    .bdrv_co_block_status           = xt_co_block_status,
    .bdrv_make_empty                = xt_make_empty,

    .bdrv_supports_persistent_dirty_bitmap =
        xt_supports_persistent_dirty_bitmap,
    .bdrv_co_can_store_new_dirty_bitmap = xt_co_can_store_new_dirty_bitmap,
    .bdrv_co_remove_persistent_dirty_bitmap =
        xt_co_remove_persistent_dirty_bitmap,

    .bdrv_co_check                  = xt_co_check,
    .bdrv_co_get_info               = xt_co_get_info,
    .bdrv_get_specific_info         = xt_get_specific_info,
    .bdrv_measure                   = xt_measure,
    .bdrv_amend_options             = xt_amend_options,
    .bdrv_co_amend                  = xt_co_amend,
    .bdrv_co_change_backing_file    = xt_co_change_backing_file,
    .bdrv_snapshot_create           = xt_snapshot_create,
    .bdrv_snapshot_goto             = xt_snapshot_goto,
    .snapshot_goto_marks_dirty      = true,
    .bdrv_snapshot_delete           = xt_snapshot_delete,
    .bdrv_snapshot_list             = xt_snapshot_list,
    .bdrv_snapshot_load_tmp         = xt_snapshot_load_tmp,
    .bdrv_co_save_vmstate           = xt_co_save_vmstate,
    .bdrv_co_load_vmstate           = xt_co_load_vmstate,
    .bdrv_refresh_limits            = xt_refresh_limits,

    .bdrv_detach_aio_context        = xt_detach_aio_context,
    .bdrv_attach_aio_context        = xt_attach_aio_context,
    .bdrv_drain_begin               = xt_drain_begin,
    .bdrv_drain_end                 = xt_drain_end,
};

static void bdrv_extree_init(void)
{
    bdrv_register(&bdrv_extree);
}

block_init(bdrv_extree_init);
