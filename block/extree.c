/*
 * extree: QEMU block driver glue
 *
 * The image format (a copy-on-write B+tree of extents, docs/interop/extree.rst)
 * lives in the QEMU-independent core behind block/extree.h.  This file is
 * only the BlockDriver: it supplies the core's backend over bs->file,
 * serializes the core behind one CoMutex, does the guest data I/O outside
 * that lock, and turns the core's errors into QEMU's.
 *
 *   guest request
 *     -> lock: look up (or allocate) the host ranges with a cursor
 *     -> unlock: data I/O on bs->file, bs->backing or zeroes
 *     -> lock: map newly allocated ranges
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/aio_task.h"
#include "block/block_int.h"
#include "block/qdict.h"
#include "qapi/error.h"
#include "qapi/qapi-events-block-core.h"
#include "qapi/qapi-visit-block-core.h"
#include "qapi/qobject-input-visitor.h"
#include "qemu/coroutine.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/memalign.h"
#include "qemu/module.h"
#include "qemu/option.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "qobject/qdict.h"
#include "system/block-backend.h"
#include "trace/trace-block_extree.h"

#include "extree.h"

#define EXTREE_OPT_CACHE_SIZE       "cache-size"
#define EXTREE_OPT_COMMIT_INTERVAL  "commit-interval"
#define EXTREE_OPT_BLOCK_SIZE       "block_size"
#define EXTREE_OPT_NODE_SIZE        "node_size"

#define EXTREE_DEFAULT_COMMIT_INTERVAL  5           /* seconds */
#define EXTREE_MAX_COMMIT_INTERVAL      (24 * 3600) /* seconds */

/*
 * The core's own forced commit (ExtreeOpenOptions.dirty_limit) could run in
 * the middle of an update while another request has allocated host space
 * it has not mapped yet.  The driver bounds dirty metadata itself, at points
 * where no request is in flight (extree_commit_locked()), and keeps the
 * core's limit out of the way.
 */
#define EXTREE_CORE_DIRTY_LIMIT_OFF     (UINT64_MAX / 2)

/*
 * Largest virtual size: the format allows EXTREE_MAX_VIRTUAL_SIZE, QEMU's
 * block layer BDRV_MAX_LENGTH (2^63 - 1 rounded down to 1 GiB), which is
 * smaller.
 */
#define EXTREE_QEMU_MAX_SIZE \
    MIN((uint64_t)EXTREE_MAX_VIRTUAL_SIZE, (uint64_t)BDRV_MAX_LENGTH)

/* Runs looked up per lock hold on the read path */
#define EXTREE_READ_BATCH               16

/*
 * Grow-ahead.  New host space is taken at the end of the file, and on ext4
 * and XFS a direct write that extends the file completes inside io_submit:
 * allocating writes in flight would run one after another.  So before an
 * allocation reaches past the file's end, the file is grown (sparse, no
 * space used) this far beyond it, as QEMU's preallocate filter does; the
 * tail past host_end is cut when the image is closed, inactivated or made
 * read-only.  The format allows a file longer than host_end, so a crash
 * in between leaves a valid image.
 */
#define EXTREE_GROW_AHEAD               (64 * MiB)
#define EXTREE_GROW_ALIGN               (1 * MiB)

/*
 * An allocating write in flight: guest blocks [start, end) have host space
 * allocated but not mapped yet.  Others that want to allocate or change
 * blocks of this range wait on @waiters.  Lives on the writer's stack.
 */
typedef struct ExtreeAllocReq {
    uint64_t start, end;
    CoQueue waiters;
    QLIST_ENTRY(ExtreeAllocReq) next;
} ExtreeAllocReq;

typedef struct BDRVExtreeState {
    BlockDriverState *bs;
    ExtreeBackend backend;              /* over bs->file, opaque = this */

    /*
     * The metadata lock.  Every call into the core, that is every use of
     * @t and of the cursors, happens with it held; backend calls made by
     * the core may yield with it held.  Guest data I/O is done without it.
     */
    CoMutex lock;

    /*
     * Requests: from extree_enter() to extree_leave(), a request may hold
     * cursors (pinned nodes of @t) and host ranges looked up in @t across
     * an unlock, so @t must not be replaced meanwhile.  Invalidation sets
     * @replacing, which holds new requests back on @replace_queue, and
     * waits on @idle_queue until @requests is zero; the block layer does
     * not drain the node for it.  Protected by lock.
     */
    unsigned requests;
    bool replacing;
    CoQueue replace_queue;
    CoQueue idle_queue;

    /*
     * NULL after a failed invalidation (bs->drv is cleared then, but
     * requests queued on @lock meanwhile still run).  Protected by lock.
     */
    Extree *t;
    bool core_read_only;                /* @t was opened read-only */
    bool inactive;                      /* BDRV_O_INACTIVE: no writes */

    /*
     * Grow-ahead (EXTREE_GROW_AHEAD): the file's length as last read or
     * set by extree_grow_file(), -1 when unknown (a truncate ran since);
     * @grow_off once growing failed (a block device, a protocol that
     * cannot resize): the writes extend the file themselves.
     * Protected by lock.
     */
    int64_t file_len;
    bool grow_off;
    uint32_t block_size;                /* of @t, constant while open */
    uint32_t node_size;

    /* block_status walks forward from where the last query ended */
    ExtreeCursor status_cursor;         /* Protected by lock */

    /*
     * Virtual size of @t, for bdrv_co_getlength(), which takes no lock.
     * Written with lock held, read with qatomic_read().
     */
    uint64_t virtual_size;

    /*
     * Allocating writes in flight (ExtreeAllocReq); two requests never
     * allocate the same guest block.  Protected by lock.
     */
    QLIST_HEAD(, ExtreeAllocReq) alloc_reqs;

    /*
     * Commit gate.  A data request looks up (or allocates) host ranges with
     * the lock held and does the I/O without it; from the lookup until the
     * I/O is done (and, for an allocating write, the range mapped) it is
     * counted in @io_inflight.  A commit makes the space freed in the
     * transaction reusable (and discards it in the host file) and records
     * every allocation as used, so it must not run while a request is
     * counted: it bumps @commit_waiting,
     * which holds new lookups back on @io_queue, and waits on
     * @commit_queue until @io_inflight drops to zero.  Protected by lock.
     */
    unsigned io_inflight;
    unsigned commit_waiting;
    CoQueue io_queue;
    CoQueue commit_queue;

    /*
     * Corruption seen by the core, handled after the core call returned
     * (extree_handle_corruption()).  Protected by lock.
     */
    bool corrupt_pending;
    bool signaled_corruption;
    uint64_t corrupt_offset;
    char *corrupt_msg;

    /* Runtime options */
    uint64_t cache_size;                /* bytes, 0 = core default */
    uint64_t commit_interval;           /* seconds, 0 = no timer */
    uint64_t dirty_limit;               /* bytes of dirty metadata */

    /*
     * Commits uncommitted metadata @commit_interval seconds after the first
     * change; lives in bs's AioContext.
     */
    QEMUTimer *commit_timer;
} BDRVExtreeState;

typedef struct ExtreeReopenState {
    Extree *t;                          /* new core handle, or NULL */
    bool core_read_only;
    uint64_t cache_size;
    uint64_t commit_interval;
} ExtreeReopenState;

static QemuOptsList extree_create_opts;
static BlockDriver bdrv_extree;

static void coroutine_fn GRAPH_RDLOCK
extree_grow_before(BDRVExtreeState *s, uint64_t bytes);

static QemuOptsList extree_runtime_opts = {
    .name = "extree",
    .head = QTAILQ_HEAD_INITIALIZER(extree_runtime_opts.head),
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
        { /* end of list */ }
    },
};

static const char *const extree_mutable_opts[] = {
    EXTREE_OPT_CACHE_SIZE,
    EXTREE_OPT_COMMIT_INTERVAL,
    NULL
};

/* ---- Backend over bs->file ---- */

/*
 * The core calls these with s->lock held, in coroutine context, or from
 * open/close/reopen outside coroutine context with no request in flight:
 * the co_wrapper_mixed functions work in both.
 */
static int coroutine_mixed_fn GRAPH_RDLOCK
extree_be_pread(void *opaque, uint64_t offset, void *buf, uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pread(s->bs->file, offset, bytes, buf, 0);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
extree_be_pwrite(void *opaque, uint64_t offset, const void *buf,
                 uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pwrite(s->bs->file, offset, bytes, buf, 0);
}

static int coroutine_mixed_fn GRAPH_RDLOCK extree_be_flush(void *opaque)
{
    BDRVExtreeState *s = opaque;

    return bdrv_flush(s->bs->file->bs);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
extree_be_truncate(void *opaque, uint64_t size)
{
    BDRVExtreeState *s = opaque;

    trace_extree_host_shrink(s, size);
    s->file_len = -1;
    return bdrv_truncate(s->bs->file, size, false, PREALLOC_MODE_OFF, 0,
                         NULL);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
extree_be_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pdiscard(s->bs->file, offset, bytes);
}

static int64_t coroutine_mixed_fn GRAPH_RDLOCK
extree_be_get_length(void *opaque)
{
    BDRVExtreeState *s = opaque;

    return bdrv_getlength(s->bs->file->bs);
}

/*
 * Readahead requests: nodes closer than this in the file are read with one
 * request, the bytes between them into a scratch buffer (one more request
 * costs more than reading that much more, warm or cold); at most this many
 * requests in flight, and this many buffers in one request (IOV_MAX)
 */
#define EXTREE_RA_MAX_GAP       (64 * KiB)
#define EXTREE_RA_CONCURRENCY   8
#define EXTREE_RA_MAX_IOV       512

/* One request of a readahead batch; freed by the pool */
typedef struct ExtreeReadTask {
    AioTask task;
    BdrvChild *file;
    uint64_t offset;
    QEMUIOVector qiov;
    int *rets;
    const int *idx;             /* of its nodes, into rets */
    int n;
} ExtreeReadTask;

static int coroutine_fn GRAPH_RDLOCK extree_read_task(AioTask *task)
{
    ExtreeReadTask *t = container_of(task, ExtreeReadTask, task);
    int ret = bdrv_co_preadv(t->file, t->offset, t->qiov.size, &t->qiov, 0);

    for (int i = 0; i < t->n; i++) {
        t->rets[t->idx[i]] = ret;
    }
    qemu_iovec_destroy(&t->qiov);
    return 0;           /* each node has its own result */
}

/*
 * Readahead of a batch of nodes: sorted by offset, nodes that lie close
 * together in the file (a commit writes the nodes it copied into one
 * metadata reserve) are read with one request, and the requests are in
 * flight together, so a forward walk waits for about one read per batch,
 * not one per leaf.
 */
static void coroutine_mixed_fn GRAPH_RDLOCK
extree_be_pread_many(void *opaque, int n, const uint64_t *offsets,
                     void *const *bufs, uint64_t bytes, int *rets)
{
    BDRVExtreeState *s = opaque;
    AioTaskPool *pool;
    void *scratch = NULL;
    int *idx;
    int i, j, reqs = 0;

    if (!qemu_in_coroutine()) {
        for (i = 0; i < n; i++) {
            rets[i] = bdrv_pread(s->bs->file, offsets[i], bytes, bufs[i], 0);
        }
        return;
    }
    /* by offset: mostly in order already */
    idx = g_new(int, n);
    for (i = 0; i < n; i++) {
        for (j = i; j > 0 && offsets[idx[j - 1]] > offsets[i]; j--) {
            idx[j] = idx[j - 1];
        }
        idx[j] = i;
    }
    pool = aio_task_pool_new(EXTREE_RA_CONCURRENCY);
    for (i = 0; i < n; i = j) {
        ExtreeReadTask *t = g_new(ExtreeReadTask, 1);
        uint64_t end = offsets[idx[i]] + bytes;

        *t = (ExtreeReadTask) {
            .task.func = extree_read_task,
            .file = s->bs->file,
            .offset = offsets[idx[i]],
            .rets = rets,
            .idx = &idx[i],
        };
        qemu_iovec_init(&t->qiov, 16);
        qemu_iovec_add(&t->qiov, bufs[idx[i]], bytes);
        for (j = i + 1; j < n; j++) {
            uint64_t off = offsets[idx[j]];

            if (off < end || off - end > EXTREE_RA_MAX_GAP ||
                t->qiov.niov + 2 > EXTREE_RA_MAX_IOV) {
                break;      /* overlapping (damaged), far, or full */
            }
            if (off > end) {
                if (!scratch) {
                    scratch = qemu_blockalign(s->bs, EXTREE_RA_MAX_GAP);
                }
                qemu_iovec_add(&t->qiov, scratch, off - end);
            }
            qemu_iovec_add(&t->qiov, bufs[idx[j]], bytes);
            end = off + bytes;
        }
        t->n = j - i;
        reqs++;
        aio_task_pool_start_task(pool, &t->task);
    }
    aio_task_pool_wait_all(pool);
    aio_task_pool_free(pool);
    trace_extree_readahead(s, n, reqs, offsets[idx[0]],
                           offsets[idx[n - 1]] + bytes - offsets[idx[0]]);
    qemu_vfree(scratch);
    g_free(idx);
}

static const ExtreeBackendOps extree_file_backend_ops = {
    .pread = extree_be_pread,
    .pread_many = extree_be_pread_many,
    .pwrite = extree_be_pwrite,
    .flush = extree_be_flush,
    .truncate = extree_be_truncate,
    .discard = extree_be_discard,
    .get_length = extree_be_get_length,
};

/* Backend over a BlockBackend, for image creation (coroutine context) */
static int coroutine_fn extree_blk_pread(void *opaque, uint64_t offset,
                                         void *buf, uint64_t bytes)
{
    return blk_co_pread(opaque, offset, bytes, buf, 0);
}

static int coroutine_fn extree_blk_pwrite(void *opaque, uint64_t offset,
                                          const void *buf, uint64_t bytes)
{
    return blk_co_pwrite(opaque, offset, bytes, buf, 0);
}

static int coroutine_fn extree_blk_flush(void *opaque)
{
    return blk_co_flush(opaque);
}

static int64_t coroutine_fn extree_blk_get_length(void *opaque)
{
    return blk_co_getlength(opaque);
}

static const ExtreeBackendOps extree_blk_backend_ops = {
    .pread = extree_blk_pread,
    .pwrite = extree_blk_pwrite,
    .flush = extree_blk_flush,
    .get_length = extree_blk_get_length,
};

/* ---- Corruption ---- */

/*
 * Called by the core, from inside the call that found the damage (which
 * then fails with -EIO).  Only records it: marking the image corrupt
 * writes a superblock, which must wait until the core call has returned.
 */
static void extree_corrupt_cb(void *opaque, uint64_t offset, const char *msg)
{
    BDRVExtreeState *s = opaque;

    if (!s->corrupt_pending) {
        s->corrupt_pending = true;
        s->corrupt_offset = offset;
        g_free(s->corrupt_msg);
        s->corrupt_msg = g_strdup(msg);
    }
}

/*
 * The one corruption helper, in the spirit of qcow2_signal_corruption():
 * logs the damaged structure and its offset, sends BLOCK_IMAGE_CORRUPTED
 * and, if the image is writable, sets the corrupt bit in a new superblock
 * (the core refuses updates from then on; reads go on).  The request that
 * hit the damage has already failed with -EIO.
 *
 * Called with s->lock held, or with no request in flight.
 */
static void coroutine_mixed_fn extree_handle_corruption(BDRVExtreeState *s)
{
    BlockDriverState *bs = s->bs;
    const char *node_name;
    bool fatal;
    int ret;

    if (!s->corrupt_pending) {
        return;
    }
    s->corrupt_pending = false;
    fatal = s->t && !s->core_read_only && !s->inactive &&
            !(extree_incompat_features(s->t) & EXTREE_INCOMPAT_CORRUPT);
    trace_extree_corruption(s, s->corrupt_offset, fatal);

    if (!s->signaled_corruption || fatal) {
        if (fatal) {
            error_report("extree: Marking image as corrupt: %s; further "
                         "corruption events will be suppressed",
                         s->corrupt_msg);
        } else {
            error_report("extree: Image is corrupt: %s; further non-fatal "
                         "corruption events will be suppressed",
                         s->corrupt_msg);
        }
        node_name = bdrv_get_node_name(bs);
        qapi_event_send_block_image_corrupted(bdrv_get_device_name(bs),
                                              *node_name ? node_name : NULL,
                                              s->corrupt_msg, true,
                                              s->corrupt_offset, false, 0,
                                              fatal);
        s->signaled_corruption = true;
    }
    if (fatal) {
        ret = extree_mark_corrupt(s->t);
        if (ret < 0) {
            error_report("extree: Could not mark the image corrupt: %s",
                         strerror(-ret));
        }
    }
}

/* ---- Lock, commit gate, commits ---- */

static inline void coroutine_fn extree_lock(BDRVExtreeState *s)
{
    qemu_co_mutex_lock(&s->lock);
}

/* qemu_co_queue_wait() on s->lock, which it retakes */
static void coroutine_fn extree_queue_wait(BDRVExtreeState *s, CoQueue *q)
{
    qemu_co_queue_wait(q, &s->lock);
}

static inline void coroutine_fn extree_unlock(BDRVExtreeState *s)
{
    if (unlikely(s->corrupt_pending)) {
        extree_handle_corruption(s);
    }
    qemu_co_mutex_unlock(&s->lock);
}

/*
 * Start a request: take s->lock and count the request (see
 * BDRVExtreeState.requests).  -ENOMEDIUM, with the lock not held, if
 * there is no core handle (a failed invalidation).  @nested: called from
 * a request that is counted already (which holds invalidation back, so
 * waiting for it would deadlock).
 */
static int coroutine_fn extree_enter_nested(BDRVExtreeState *s, bool nested)
{
    extree_lock(s);
    while (s->replacing && !nested) {
        extree_queue_wait(s, &s->replace_queue);
    }
    if (!s->t) {
        qemu_co_mutex_unlock(&s->lock);
        return -ENOMEDIUM;
    }
    s->requests++;
    return 0;
}

static int coroutine_fn extree_enter(BDRVExtreeState *s)
{
    return extree_enter_nested(s, false);
}

/* End a request started by extree_enter(); drops s->lock */
static void coroutine_fn extree_leave(BDRVExtreeState *s)
{
    assert(s->requests > 0);
    if (--s->requests == 0 && s->replacing) {
        qemu_co_queue_restart_all(&s->idle_queue);
    }
    extree_unlock(s);
}

/*
 * Count a request that is about to look up host ranges for data I/O.
 * Called with s->lock held; waits (dropping it) while a commit is pending.
 */
static void coroutine_fn extree_io_begin(BDRVExtreeState *s)
{
    while (s->commit_waiting) {
        extree_queue_wait(s, &s->io_queue);
    }
    s->io_inflight++;
}

/* Called with s->lock held */
static void coroutine_fn extree_io_end(BDRVExtreeState *s)
{
    assert(s->io_inflight > 0);
    if (--s->io_inflight == 0 && s->commit_waiting) {
        qemu_co_queue_restart_all(&s->commit_queue);
    }
}

/* Called with s->lock held */
static ExtreeAllocReq *extree_find_alloc(BDRVExtreeState *s, uint64_t start,
                                         uint64_t end)
{
    ExtreeAllocReq *req;

    QLIST_FOREACH(req, &s->alloc_reqs, next) {
        if (req->start < end && start < req->end) {
            return req;
        }
    }
    return NULL;
}

/*
 * Wait until no allocating write overlaps guest [start, end).  Called with
 * s->lock held; drops it while waiting.  Returns true if it waited (the
 * caller's view of the mapping is stale then).
 */
static bool coroutine_fn extree_wait_alloc(BDRVExtreeState *s, uint64_t start,
                                           uint64_t end)
{
    ExtreeAllocReq *other;
    bool waited = false;

    while ((other = extree_find_alloc(s, start, end))) {
        trace_extree_alloc_wait(s, start, end);
        extree_queue_wait(s, &other->waiters);
        waited = true;
    }
    return waited;
}

/*
 * Commit, with no request in flight: open, close, reopen, inactivate (the
 * node is drained there).
 */
static int coroutine_mixed_fn GRAPH_RDLOCK
extree_commit_now(BDRVExtreeState *s)
{
    int ret;

    if (!s->t || s->core_read_only || !extree_is_dirty(s->t)) {
        return 0;
    }
    assert(s->io_inflight == 0);
    trace_extree_commit_start(s, extree_generation(s->t) + 1, 0);
    ret = extree_commit(s->t);
    extree_handle_corruption(s);
    trace_extree_commit_done(s, extree_generation(s->t), ret);
    return ret;
}

/*
 * Commit the transaction: waits until no request is between its lookup and
 * the end of its data I/O, holding new ones back meanwhile.
 * Called with s->lock held; may drop and retake it.
 */
static int coroutine_fn GRAPH_RDLOCK extree_commit_locked(BDRVExtreeState *s)
{
    int ret;

    if (s->core_read_only || !extree_is_dirty(s->t)) {
        return 0;
    }
    trace_extree_commit_start(s, extree_generation(s->t) + 1,
                              s->io_inflight);
    s->commit_waiting++;
    while (s->io_inflight > 0) {
        extree_queue_wait(s, &s->commit_queue);
    }
    /* the free-space tree's nodes are allocated now */
    extree_grow_before(s, 0);
    ret = extree_commit(s->t);
    if (--s->commit_waiting == 0) {
        qemu_co_queue_restart_all(&s->io_queue);
    }
    trace_extree_commit_done(s, extree_generation(s->t), ret);
    if (s->commit_timer && !extree_is_dirty(s->t)) {
        timer_del(s->commit_timer);
    }
    return ret;
}

/*
 * After a request changed the tree: commit if too much metadata is dirty,
 * else make sure the commit timer runs.  Called with s->lock held, after
 * the request's own extree_io_end().
 */
static void coroutine_fn GRAPH_RDLOCK extree_update_done(BDRVExtreeState *s)
{
    ExtreeStats st;

    if (s->core_read_only || !extree_is_dirty(s->t)) {
        return;
    }
    extree_stats(s->t, &st);
    if (st.dirty_nodes * s->node_size >= s->dirty_limit) {
        /* A failure is reported by the next flush, which retries */
        extree_commit_locked(s);
        return;
    }
    if (s->commit_timer && s->commit_interval &&
        !timer_pending(s->commit_timer)) {
        timer_mod(s->commit_timer, qemu_clock_get_ms(QEMU_CLOCK_REALTIME) +
                  s->commit_interval * 1000);
    }
}

static void coroutine_fn extree_commit_timer_entry(void *opaque)
{
    BDRVExtreeState *s = opaque;
    BlockDriverState *bs = s->bs;

    GRAPH_RDLOCK_GUARD();

    trace_extree_commit_timer(s);
    if (extree_enter(s) == 0) {
        if (!s->inactive) {
            extree_commit_locked(s);
        }
        extree_leave(s);
    }
    bdrv_dec_in_flight(bs);
}

static void extree_start_commit_co(BDRVExtreeState *s)
{
    Coroutine *co = qemu_coroutine_create(extree_commit_timer_entry, s);

    bdrv_inc_in_flight(s->bs);
    aio_co_enter(bdrv_get_aio_context(s->bs), co);
}

static void extree_commit_timer_cb(void *opaque)
{
    extree_start_commit_co(opaque);
}

static void extree_detach_aio_context(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer) {
        timer_free(s->commit_timer);
        s->commit_timer = NULL;
    }
}

static void extree_attach_aio_context(BlockDriverState *bs,
                                      AioContext *new_context)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer || !s->t || s->core_read_only || s->inactive) {
        return;
    }
    s->commit_timer = aio_timer_new(new_context, QEMU_CLOCK_REALTIME,
                                    SCALE_MS, extree_commit_timer_cb, s);
    if (s->commit_interval && extree_is_dirty(s->t)) {
        timer_mod(s->commit_timer, qemu_clock_get_ms(QEMU_CLOCK_REALTIME) +
                  s->commit_interval * 1000);
    }
}

/*
 * A drained section must not see the timer start I/O: commit now instead
 * (the drain waits for it), as QED does with its need-check timer.
 */
static void extree_drain_begin(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    if (s->commit_timer && timer_pending(s->commit_timer)) {
        timer_del(s->commit_timer);
        extree_start_commit_co(s);
    }
}

/* ---- Grow-ahead (EXTREE_GROW_AHEAD) ---- */

/*
 * Make the file reach @end before an allocation that ends there is
 * written.  If it cannot grow (a block device, an NBD export: protocol
 * nodes of fixed size), the core is told to keep host_end within the
 * file's length from then on, and a full file fails allocating writes with
 * -ENOSPC.  Called with s->lock held, so no other allocation runs
 * meanwhile; no request is in flight past the file's end, so the truncate
 * waits for none.
 */
static void coroutine_fn GRAPH_RDLOCK
extree_grow_file(BDRVExtreeState *s, uint64_t end)
{
    BdrvChild *file = s->bs->file;
    int64_t len;
    uint64_t want;
    int ret;

    if (s->grow_off ||
        (s->file_len >= 0 && end <= (uint64_t)s->file_len)) {
        return;
    }
    len = bdrv_co_getlength(file->bs);
    if (len < 0) {
        s->file_len = -1;
        return;
    }
    s->file_len = len;
    if (end <= (uint64_t)len) {
        return;
    }
    /* A regular file is cut to exactly @want: never less than @len */
    want = ROUND_UP(end + EXTREE_GROW_AHEAD, EXTREE_GROW_ALIGN);
    ret = bdrv_co_truncate(file, want, false, PREALLOC_MODE_OFF, 0, NULL);
    trace_extree_grow_file(s, len, want, ret);
    if (ret < 0) {
        s->grow_off = true;
        extree_set_host_limit(s->t, len);
        return;
    }
    s->file_len = want;
}

/*
 * Before a tree update that may allocate up to @bytes of data (0: nodes
 * only): grow the file as far as the allocation can move host_end, so
 * that a file of fixed size is known as such before anything is allocated
 * past its end.  O(1) while the file is long enough.  Called with s->lock
 * held.
 */
static void coroutine_fn GRAPH_RDLOCK
extree_grow_before(BDRVExtreeState *s, uint64_t bytes)
{
    if (!s->core_read_only) {
        extree_grow_file(s, extree_grow_bound(s->t, bytes));
    }
}

/*
 * Cut what lies past host_end off the file (grow-ahead's tail, or one a
 * crash left), so that a closed image is no longer than its contents.
 * Only after a successful commit, with the core read-write and no request
 * in flight: then host_end is the durable one and nothing past it is in
 * use.  Never on an image found damaged or being checked: what lies past
 * host_end may be evidence.  Best effort.  Called with s->lock held or
 * from close.
 */
static void coroutine_mixed_fn GRAPH_RDLOCK extree_trim_file(BDRVExtreeState *s)
{
    uint64_t end;
    int64_t len;
    int ret;

    if (!s->t || s->core_read_only || s->inactive || extree_is_dirty(s->t) ||
        s->corrupt_pending || s->signaled_corruption ||
        (extree_incompat_features(s->t) & EXTREE_INCOMPAT_CORRUPT) ||
        (s->bs->open_flags & BDRV_O_CHECK)) {
        return;
    }
    end = extree_host_end(s->t);
    len = bdrv_getlength(s->bs->file->bs);
    if (len < 0 || (uint64_t)len <= end) {
        return;
    }
    s->file_len = -1;
    ret = bdrv_truncate(s->bs->file, end, false, PREALLOC_MODE_OFF, 0, NULL);
    trace_extree_trim_file(s, len, end, ret);
}

/* ---- Probe, open, close ---- */

static int extree_probe(const uint8_t *buf, int buf_size, const char *filename)
{
    uint64_t magic;

    if (buf_size < (int)sizeof(magic)) {
        return 0;
    }
    memcpy(&magic, buf, sizeof(magic));
    return le64_to_cpu(magic) == EXTREE_MAGIC ? 100 : 0;
}

static int extree_parse_runtime_opts(QDict *options, uint64_t *cache_size,
                                     uint64_t *commit_interval, Error **errp)
{
    QemuOpts *opts;
    int ret = 0;

    opts = qemu_opts_create(&extree_runtime_opts, NULL, 0, &error_abort);
    if (!qemu_opts_absorb_qdict(opts, options, errp)) {
        ret = -EINVAL;
        goto out;
    }
    *cache_size = qemu_opt_get_size(opts, EXTREE_OPT_CACHE_SIZE, 0);
    *commit_interval = qemu_opt_get_number(opts, EXTREE_OPT_COMMIT_INTERVAL,
                                           EXTREE_DEFAULT_COMMIT_INTERVAL);
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
extree_open_core(BDRVExtreeState *s, int flags, uint64_t cache_size,
                 Extree **out, bool *read_only, Error **errp)
{
    ExtreeOpenOptions o = {
        .read_only = !(flags & BDRV_O_RDWR) || (flags & BDRV_O_INACTIVE),
        .cache_size = cache_size,
        .dirty_limit = EXTREE_CORE_DIRTY_LIMIT_OFF,
        .repair = (flags & BDRV_O_CHECK) && (flags & BDRV_O_RDWR),
        .check = flags & BDRV_O_CHECK,
    };
    g_autofree char *msg = NULL;
    const char *warning;
    int ret;

    ret = extree_open(&s->backend, &o, out, &msg);
    if (ret == -EACCES) {
        error_setg(errp, "extree: Image is corrupt; cannot be opened "
                   "read/write");
        return ret;
    } else if (ret == -EIO && !o.read_only && msg &&
               g_str_has_prefix(msg, "corrupt ")) {
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
static void GRAPH_RDLOCK extree_install_core(BDRVExtreeState *s, Extree *t,
                                             bool read_only)
{
    BlockDriverState *bs = s->bs;
    const char *backing_file, *backing_fmt;

    s->t = t;
    s->core_read_only = read_only;
    s->file_len = -1;
    s->grow_off = false;
    s->block_size = extree_block_size(t);
    s->node_size = extree_node_size(t);
    extree_set_corrupt_handler(t, extree_corrupt_cb, s);
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
static void extree_drop_core(BDRVExtreeState *s)
{
    if (s->t) {
        trace_extree_close(s, extree_generation(s->t));
        extree_cursor_release(&s->status_cursor);
        extree_close(s->t);
        s->t = NULL;
    }
    extree_cursor_init(&s->status_cursor, NULL);
}

static void extree_init_state(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    s->bs = bs;
    s->backend.ops = &extree_file_backend_ops;
    s->backend.opaque = s;
    qemu_co_mutex_init(&s->lock);
    qemu_co_queue_init(&s->io_queue);
    qemu_co_queue_init(&s->commit_queue);
    qemu_co_queue_init(&s->replace_queue);
    qemu_co_queue_init(&s->idle_queue);
    QLIST_INIT(&s->alloc_reqs);
    s->dirty_limit = EXTREE_DEFAULT_DIRTY_LIMIT;
}

typedef struct ExtreeOpenCo {
    BlockDriverState *bs;
    int flags;
    Error **errp;
    int ret;
} ExtreeOpenCo;

static void coroutine_fn extree_open_entry(void *opaque)
{
    ExtreeOpenCo *oc = opaque;
    BDRVExtreeState *s = oc->bs->opaque;
    Extree *t = NULL;
    bool read_only;

    GRAPH_RDLOCK_GUARD();

    extree_lock(s);
    oc->ret = extree_open_core(s, oc->flags, s->cache_size, &t, &read_only,
                               oc->errp);
    if (oc->ret == 0) {
        extree_install_core(s, t, read_only);
    }
    qemu_co_mutex_unlock(&s->lock);
    aio_wait_kick();
}

static int extree_open_bs(BlockDriverState *bs, QDict *options, int flags,
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
    extree_init_state(bs);
    ret = extree_parse_runtime_opts(options, &s->cache_size,
                                    &s->commit_interval, errp);
    if (ret < 0) {
        return ret;
    }
    s->inactive = flags & BDRV_O_INACTIVE;

    assert(!qemu_in_coroutine());
    assert(qemu_get_current_aio_context() == qemu_get_aio_context());
    aio_co_enter(bdrv_get_aio_context(bs),
                 qemu_coroutine_create(extree_open_entry, &oc));
    AIO_WAIT_WHILE_UNLOCKED(NULL, oc.ret == -EINPROGRESS);
    ret = oc.ret;
    if (ret < 0) {
        return ret;
    }

    bs->supported_zero_flags = BDRV_REQ_MAY_UNMAP | BDRV_REQ_NO_FALLBACK;
    bs->supported_truncate_flags = BDRV_REQ_ZERO_WRITE;

    extree_attach_aio_context(bs, bdrv_get_aio_context(bs));
    return 0;
}

static void extree_refresh_limits(BlockDriverState *bs, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;

    /* Any alignment: sub-block writes are read-modify-write of a block */
    bs->bl.request_alignment = 1;
    bs->bl.pdiscard_alignment = s->block_size;
    bs->bl.pwrite_zeroes_alignment = s->block_size;
}

static void GRAPH_RDLOCK extree_do_close(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    extree_detach_aio_context(bs);
    if (!s->inactive) {
        int ret = extree_commit_now(s);
        if (ret < 0) {
            error_report("extree: Could not commit metadata on close: %s",
                         strerror(-ret));
        }
        extree_trim_file(s);
    }
    extree_drop_core(s);
}

static void GRAPH_UNLOCKED extree_close_bs(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    extree_do_close(bs);
    g_free(s->corrupt_msg);
    s->corrupt_msg = NULL;
}

/*
 * Run @fn in a coroutine with s->lock held, from outside coroutine context
 * (main loop), and wait for it: for the callbacks that are not drained, so
 * that requests and the commit timer may be running.
 */
typedef int coroutine_fn GRAPH_RDLOCK ExtreeLockedFn(BDRVExtreeState *s);

typedef struct ExtreeCallCo {
    BlockDriverState *bs;
    ExtreeLockedFn *fn;
    int ret;
} ExtreeCallCo;

static void coroutine_fn extree_call_entry(void *opaque)
{
    ExtreeCallCo *c = opaque;
    BDRVExtreeState *s = c->bs->opaque;
    int ret;

    GRAPH_RDLOCK_GUARD();

    ret = extree_enter(s);
    if (ret == 0) {
        ret = c->fn(s);
        extree_leave(s);
    }
    c->ret = ret;
    aio_wait_kick();
}

static int GRAPH_RDLOCK extree_call_locked(BlockDriverState *bs,
                                           ExtreeLockedFn *fn)
{
    ExtreeCallCo c = { .bs = bs, .fn = fn, .ret = -EINPROGRESS };

    assert(!qemu_in_coroutine());
    aio_co_enter(bdrv_get_aio_context(bs),
                 qemu_coroutine_create(extree_call_entry, &c));
    BDRV_POLL_WHILE(bs, c.ret == -EINPROGRESS);
    return c.ret;
}

/* ---- Reopen, inactivate, invalidate ---- */

static int GRAPH_UNLOCKED
extree_reopen_prepare(BDRVReopenState *state, BlockReopenQueue *queue,
                      Error **errp)
{
    BDRVExtreeState *s = state->bs->opaque;
    ExtreeReopenState *r;
    bool want_ro = !(state->flags & BDRV_O_RDWR) ||
                   (state->flags & BDRV_O_INACTIVE);
    bool new_handle;
    int ret;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    r = g_new0(ExtreeReopenState, 1);
    ret = extree_parse_runtime_opts(state->options, &r->cache_size,
                                    &r->commit_interval, errp);
    if (ret < 0) {
        goto fail;
    }

    /* Going read-only: everything must be committed now */
    if (want_ro && !s->core_read_only) {
        ret = extree_commit_now(s);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not commit extree metadata");
            goto fail;
        }
        /* While bs->file still grants resize */
        extree_trim_file(s);
    }

    /*
     * A new core handle for a change of read-only mode or cache size: it
     * is opened from the committed state, which is all there is now.
     */
    new_handle = want_ro != s->core_read_only ||
                 r->cache_size != s->cache_size;
    trace_extree_reopen_prepare(s, want_ro, new_handle);
    if (new_handle) {
        if (!s->core_read_only && extree_is_dirty(s->t)) {
            ret = extree_commit_now(s);
            if (ret < 0) {
                error_setg_errno(errp, -ret,
                                 "Could not commit extree metadata");
                goto fail;
            }
        }
        ret = extree_open_core(s, state->flags, r->cache_size, &r->t,
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

static void GRAPH_UNLOCKED extree_reopen_commit(BDRVReopenState *state)
{
    BDRVExtreeState *s = state->bs->opaque;
    ExtreeReopenState *r = state->opaque;

    GRAPH_RDLOCK_GUARD_MAINLOOP();

    s->cache_size = r->cache_size;
    s->commit_interval = r->commit_interval;
    if (r->t) {
        extree_detach_aio_context(state->bs);
        extree_drop_core(s);
        extree_install_core(s, r->t, r->core_read_only);
        extree_attach_aio_context(state->bs,
                                  bdrv_get_aio_context(state->bs));
    }
    g_free(r);
    state->opaque = NULL;
}

static void GRAPH_UNLOCKED extree_reopen_abort(BDRVReopenState *state)
{
    ExtreeReopenState *r = state->opaque;

    if (r) {
        extree_close(r->t);
        g_free(r);
        state->opaque = NULL;
    }
}

static int coroutine_fn GRAPH_RDLOCK
extree_inactivate_locked(BDRVExtreeState *s)
{
    int ret = extree_commit_locked(s);

    if (ret == 0) {
        /* Reads may run, but below host_end only */
        extree_trim_file(s);
    }
    return ret;
}

/*
 * Migration (or blockdev-set-active): the destination takes over; commit
 * and stop writing.  Not drained: reads may go on meanwhile.
 */
static int GRAPH_RDLOCK extree_inactivate(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    trace_extree_inactivate(s);
    extree_detach_aio_context(bs);
    ret = extree_call_locked(bs, extree_inactivate_locked);
    if (ret < 0) {
        error_report("extree: Could not commit metadata on inactivation: %s",
                     strerror(-ret));
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
extree_co_invalidate_cache(BlockDriverState *bs, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    Extree *t = NULL;
    bool read_only;
    int ret;

    trace_extree_invalidate_cache(s);
    extree_lock(s);
    assert(!s->replacing);
    s->replacing = true;
    while (s->requests > 0) {
        extree_queue_wait(s, &s->idle_queue);
    }
    extree_detach_aio_context(bs);
    if (!s->inactive) {
        extree_commit_now(s);
    }
    extree_drop_core(s);
    s->inactive = false;
    s->signaled_corruption = false;
    ret = extree_open_core(s, bs->open_flags & ~BDRV_O_INACTIVE,
                           s->cache_size, &t, &read_only, errp);
    if (ret == 0) {
        extree_install_core(s, t, read_only);
    }
    s->replacing = false;
    qemu_co_queue_restart_all(&s->replace_queue);
    qemu_co_mutex_unlock(&s->lock);
    if (ret < 0) {
        error_prepend(errp, "Could not reopen extree layer: ");
        bs->drv = NULL;
        return;
    }
    extree_attach_aio_context(bs, bdrv_get_aio_context(bs));
}

/* ---- Reads ---- */

/*
 * What guest [@guest, @guest + @bytes) reads as in a run of @type that is
 * not DATA: the backing chain for UNALLOC (zeroes past its end or without
 * one), zeroes for ZERO.  Called without s->lock.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_read_unmapped(BDRVExtreeState *s, ExtreeRunType type, uint64_t guest,
                     uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset)
{
    if (type == EXTREE_RUN_UNALLOC && s->bs->backing) {
        return bdrv_co_preadv_part(s->bs->backing, guest, bytes, qiov,
                                   qiov_offset, 0);
    }
    qemu_iovec_memset(qiov, qiov_offset, 0, bytes);
    return 0;
}

/*
 * One lookup of up to EXTREE_READ_BATCH runs with the request's cursor,
 * then their I/O without the lock.  DATA runs are host-contiguous pieces
 * already merged by the cursor (EXTREE_COALESCE_HOST): one host read each.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                      QEMUIOVector *qiov, size_t qiov_offset,
                      BdrvRequestFlags flags)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeRun runs[EXTREE_READ_BATCH];
    ExtreeCursor cur;
    int ret = 0;

    trace_extree_co_preadv_start(s, offset, bytes);
    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    extree_cursor_init(&cur, s->t);
    while (bytes > 0) {
        uint64_t pos = offset, left = bytes;
        int nr = 0;

        extree_io_begin(s);
        while (nr < EXTREE_READ_BATCH && left > 0) {
            ret = extree_cursor_query(&cur, pos, left, EXTREE_COALESCE_HOST,
                                      &runs[nr]);
            if (ret < 0) {
                break;
            }
            pos += runs[nr].length;
            left -= runs[nr].length;
            nr++;
        }
        if (ret < 0) {
            extree_io_end(s);
            break;
        }
        qemu_co_mutex_unlock(&s->lock);

        for (int i = 0; i < nr && ret >= 0; i++) {
            ExtreeRun *run = &runs[i];
            size_t qoff = qiov_offset + (run->guest - offset);

            trace_extree_read_run(s, run->guest, run->length, run->type,
                                  run->host);
            if (run->type == EXTREE_RUN_DATA) {
                BLKDBG_CO_EVENT(bs->file, BLKDBG_READ_AIO);
                ret = bdrv_co_preadv_part(bs->file, run->host, run->length,
                                          qiov, qoff, 0);
            } else {
                ret = extree_read_unmapped(s, run->type, run->guest,
                                           run->length, qiov, qoff);
            }
        }

        extree_lock(s);
        extree_io_end(s);
        if (ret < 0) {
            break;
        }
        qiov_offset += pos - offset;
        offset = pos;
        bytes = left;
    }
    extree_cursor_release(&cur);
    extree_leave(s);
    trace_extree_co_preadv_done(s, offset, ret);
    return ret < 0 ? ret : 0;
}

/* ---- Writes ---- */

/*
 * Fill @buf (@bytes) with what guest [@guest, @guest + @bytes) reads as now,
 * for a run of @type that is not DATA; bytes past @vsize read as zeroes.
 * Called without s->lock.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_read_old(BDRVExtreeState *s, ExtreeRunType type, uint64_t guest,
                uint64_t bytes, uint64_t vsize, uint8_t *buf)
{
    memset(buf, 0, bytes);
    if (type == EXTREE_RUN_UNALLOC && s->bs->backing && guest < vsize) {
        return bdrv_co_pread(s->bs->backing, guest, MIN(bytes, vsize - guest),
                             buf, 0);
    }
    return 0;
}

/*
 * The allocating part of a write: guest [@offset, @offset + @n) lies in
 * @run, which is UNALLOC or ZERO.  Allocates host space for the blocks it
 * touches, writes the guest data there together with the rest of its first
 * and last block (read-modify-write: backing file or zeroes), then maps the
 * blocks.  *@done is the part of the request written (the allocation may
 * have been shorter).
 *
 * Called with s->lock held and the request counted (extree_io_begin());
 * returns with s->lock held and the count dropped.  -EAGAIN: it waited for
 * an overlapping allocating write, look the mapping up again.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_alloc_write(BDRVExtreeState *s, const ExtreeRun *run, uint64_t offset,
                   uint64_t n, QEMUIOVector *qiov, size_t qiov_offset,
                   uint64_t *done)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    uint64_t vsize = extree_virtual_size(s->t);
    uint64_t start = QEMU_ALIGN_DOWN(offset, bsz);
    uint64_t end = ROUND_UP(offset + n, bsz);
    uint64_t host, got, head, wlen, tail, pend;
    uint8_t *head_buf = NULL, *tail_buf = NULL;
    ExtreeAllocReq req;
    QEMUIOVector hd_qiov;
    int ret;

    if (extree_find_alloc(s, start, end)) {
        extree_io_end(s);
        extree_wait_alloc(s, start, end);
        return -EAGAIN;
    }

    extree_grow_before(s, end - start);
    ret = extree_alloc_data(s->t, start, end - start, &host, &got);
    if (ret < 0) {
        extree_io_end(s);
        return ret;
    }
    extree_grow_file(s, host + got);
    pend = start + got;
    req.start = start;
    req.end = pend;
    qemu_co_queue_init(&req.waiters);
    QLIST_INSERT_HEAD(&s->alloc_reqs, &req, next);
    qemu_co_mutex_unlock(&s->lock);

    head = offset - start;
    wlen = MIN(offset + n, pend) - offset;
    tail = pend - (offset + wlen);
    trace_extree_alloc_write_start(s, start, pend, host, wlen);

    qemu_iovec_init(&hd_qiov, qiov->niov + 2);
    if (head) {
        head_buf = qemu_blockalign(bs, head);
        ret = extree_read_old(s, run->type, start, head, vsize, head_buf);
        qemu_iovec_add(&hd_qiov, head_buf, head);
    }
    if (ret == 0) {
        qemu_iovec_concat(&hd_qiov, qiov, qiov_offset, wlen);
    }
    if (ret == 0 && tail) {
        tail_buf = qemu_blockalign(bs, tail);
        ret = extree_read_old(s, run->type, offset + wlen, tail, vsize,
                              tail_buf);
        qemu_iovec_add(&hd_qiov, tail_buf, tail);
    }
    if (ret == 0) {
        BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
        ret = bdrv_co_pwritev(bs->file, host, got, &hd_qiov, 0);
    }
    qemu_iovec_destroy(&hd_qiov);
    qemu_vfree(head_buf);
    qemu_vfree(tail_buf);

    extree_lock(s);
    if (ret == 0) {
        /* The data is written: now the mapping may reach a commit */
        ret = extree_map_data(s->t, start, got, host);
    }
    if (ret < 0) {
        extree_free_data(s->t, host, got);
    }
    QLIST_REMOVE(&req, next);
    qemu_co_queue_restart_all(&req.waiters);
    extree_io_end(s);
    trace_extree_alloc_write_done(s, start, host, ret);
    *done = wlen;
    return ret;
}

/* @nested: see extree_enter_nested() */
static int coroutine_fn GRAPH_RDLOCK
extree_pwritev(BlockDriverState *bs, int64_t offset, int64_t bytes,
               QEMUIOVector *qiov, size_t qiov_offset, bool nested)
{
    BDRVExtreeState *s = bs->opaque;
    bool committed = false;
    ExtreeCursor cur;
    int ret = 0;

    trace_extree_co_pwritev_start(s, offset, bytes);
    ret = extree_enter_nested(s, nested);
    if (ret < 0) {
        return ret;
    }
    extree_cursor_init(&cur, s->t);
    while (bytes > 0) {
        ExtreeRun run;
        uint64_t n;

        extree_io_begin(s);
        ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret < 0) {
            extree_io_end(s);
            break;
        }
        n = run.length;
        if (run.type == EXTREE_RUN_DATA) {
            /* Data in place: no metadata change */
            qemu_co_mutex_unlock(&s->lock);
            trace_extree_write_in_place(s, offset, n, run.host);
            BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
            ret = bdrv_co_pwritev_part(bs->file, run.host, n, qiov,
                                       qiov_offset, 0);
            extree_lock(s);
            extree_io_end(s);
        } else {
            ret = extree_alloc_write(s, &run, offset, n, qiov, qiov_offset,
                                     &n);
            if (ret == -EAGAIN) {
                continue;
            }
            if (ret == -ENOSPC && !committed && extree_is_dirty(s->t)) {
                /*
                 * A full node of fixed size: space freed in this
                 * transaction (a discard) is reusable once committed
                 */
                committed = true;
                if (extree_commit_locked(s) == 0) {
                    continue;
                }
                ret = -ENOSPC;
            }
        }
        if (ret < 0) {
            break;
        }
        offset += n;
        bytes -= n;
        qiov_offset += n;
    }
    extree_cursor_release(&cur);
    extree_update_done(s);
    extree_leave(s);
    trace_extree_co_pwritev_done(s, offset, ret);
    return ret < 0 ? ret : 0;
}

static int coroutine_fn GRAPH_RDLOCK
extree_co_pwritev_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                       QEMUIOVector *qiov, size_t qiov_offset,
                       BdrvRequestFlags flags)
{
    return extree_pwritev(bs, offset, bytes, qiov, qiov_offset, false);
}

/* ---- Flush ---- */

static int coroutine_fn GRAPH_RDLOCK extree_co_flush_to_os(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    if (s->inactive) {
        return 0;
    }
    ret = extree_enter(s);
    if (ret == 0) {
        ret = extree_commit_locked(s);
        extree_leave(s);
    }
    return ret;
}

/* ---- Metadata-only range updates: discard, zeroes, truncate ---- */

typedef enum ExtreeRangeOp {
    EXTREE_OP_PUNCH,        /* unallocated: the backing chain shows */
    EXTREE_OP_ZERO,         /* a ZERO extent */
} ExtreeRangeOp;

/*
 * Make block-aligned guest [start, end) unallocated or a ZERO extent,
 * freeing its DATA space.  Waits for allocating writes into the range
 * first.  Called with s->lock held; may drop and retake it.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_update_range(BDRVExtreeState *s, uint64_t start, uint64_t end,
                    ExtreeRangeOp op)
{
    assert(QEMU_IS_ALIGNED(start | end, s->block_size) && start < end);
    trace_extree_update_range(s, start, end, op);
    extree_wait_alloc(s, start, end);
    extree_grow_before(s, 0);
    if (op == EXTREE_OP_ZERO) {
        return extree_set_zero(s->t, start, end - start);
    }
    return extree_punch(s->t, start, end - start);
}

/*
 * Discard whole blocks (partial blocks are ignored, except the partial
 * block at the end of the disk when the request reaches the end).  The
 * range becomes unallocated, or, when a backing file would show through,
 * a ZERO extent (like qcow2); its space is freed.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_co_pdiscard(BlockDriverState *bs, int64_t offset, int64_t bytes)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t bsz = s->block_size;
    uint64_t start, end;
    int ret;

    trace_extree_co_pdiscard_start(s, offset, bytes);
    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    start = ROUND_UP(offset, bsz);
    if (offset + bytes >= extree_virtual_size(s->t)) {
        end = ROUND_UP(extree_virtual_size(s->t), bsz);
    } else {
        end = QEMU_ALIGN_DOWN(offset + bytes, bsz);
    }
    if (start >= end) {
        ret = -ENOTSUP;
    } else {
        ret = extree_update_range(s, start, end, bs->backing ?
                                  EXTREE_OP_ZERO : EXTREE_OP_PUNCH);
        extree_update_done(s);
    }
    extree_leave(s);
    trace_extree_co_pdiscard_done(s, offset, ret);
    return ret;
}

/*
 * Zero part of one block: guest [offset, offset + bytes) within a single
 * block, not the whole of it.  DATA: zero in place in the host file.
 * ZERO: nothing to do.  Unallocated without a backing file: the block
 * reads as zeroes, make it a ZERO extent.  Unallocated with one: write a
 * buffer of zeroes (read-modify-write of the block), unless the caller
 * forbids that fallback.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_zero_partial(BDRVExtreeState *s, uint64_t offset, uint64_t bytes,
                    BdrvRequestFlags flags)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    uint64_t bstart = QEMU_ALIGN_DOWN(offset, bsz);
    ExtreeCursor cur;
    ExtreeRun run;
    int ret;

    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    for (;;) {
        extree_io_begin(s);
        extree_cursor_init(&cur, s->t);
        ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                                  &run);
        extree_cursor_release(&cur);
        if (ret < 0 || run.type != EXTREE_RUN_UNALLOC ||
            !extree_find_alloc(s, bstart, bstart + bsz)) {
            break;
        }
        /* The block is being allocated: wait and look again */
        extree_io_end(s);
        extree_wait_alloc(s, bstart, bstart + bsz);
    }
    if (ret < 0) {
        extree_io_end(s);
        goto out;
    }

    switch (run.type) {
    case EXTREE_RUN_DATA:
        qemu_co_mutex_unlock(&s->lock);
        ret = bdrv_co_pwrite_zeroes(bs->file, run.host, bytes,
                                    flags & BDRV_REQ_NO_FALLBACK);
        extree_lock(s);
        extree_io_end(s);
        break;
    case EXTREE_RUN_ZERO:
        extree_io_end(s);
        break;
    case EXTREE_RUN_UNALLOC:
        extree_io_end(s);
        if (!bs->backing) {
            ret = extree_update_range(s, bstart, bstart + bsz,
                                      EXTREE_OP_ZERO);
            extree_update_done(s);
        } else if (flags & BDRV_REQ_NO_FALLBACK) {
            ret = -ENOTSUP;
        } else {
            QEMUIOVector qiov;
            void *buf = qemu_blockalign0(bs, bytes);

            extree_leave(s);
            qemu_iovec_init_buf(&qiov, buf, bytes);
            ret = extree_pwritev(bs, offset, bytes, &qiov, 0, false);
            qemu_vfree(buf);
            return ret;
        }
        break;
    }
out:
    extree_leave(s);
    return ret;
}

/*
 * Zero whole blocks [start, end) (end may be the rounded-up end of the
 * disk).  With BDRV_REQ_MAY_UNMAP: one ZERO extent, DATA space freed.
 * Without: DATA keeps its space and is zeroed in place; the rest becomes
 * ZERO extents.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_zero_blocks(BDRVExtreeState *s, uint64_t start, uint64_t end,
                   BdrvRequestFlags flags)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    ExtreeCursor cur;
    int ret;

    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    if (flags & BDRV_REQ_MAY_UNMAP) {
        ret = extree_update_range(s, start, end, EXTREE_OP_ZERO);
        goto out;
    }

    extree_cursor_init(&cur, s->t);
    while (start < end) {
        uint64_t vsize = extree_virtual_size(s->t);
        ExtreeRun run;

        if (start >= vsize) {
            break;
        }
        extree_io_begin(s);
        ret = extree_cursor_query(&cur, start, MIN(end, vsize) - start,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            extree_io_end(s);
            break;
        }
        if (run.type == EXTREE_RUN_DATA) {
            qemu_co_mutex_unlock(&s->lock);
            ret = bdrv_co_pwrite_zeroes(bs->file, run.host,
                                        ROUND_UP(run.length, bsz),
                                        flags & BDRV_REQ_NO_FALLBACK);
            extree_lock(s);
            extree_io_end(s);
        } else {
            extree_io_end(s);
            if (run.type == EXTREE_RUN_UNALLOC) {
                ret = extree_update_range(s, start,
                                          ROUND_UP(start + run.length, bsz),
                                          EXTREE_OP_ZERO);
            }
        }
        if (ret < 0) {
            break;
        }
        start = ROUND_UP(start + run.length, bsz);
    }
    extree_cursor_release(&cur);
out:
    extree_update_done(s);
    extree_leave(s);
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
extree_co_pwrite_zeroes(BlockDriverState *bs, int64_t offset, int64_t bytes,
                        BdrvRequestFlags flags)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t bsz = s->block_size;
    uint64_t pos = offset, end = offset + bytes;
    uint64_t vsize = bs->total_sectors * BDRV_SECTOR_SIZE;
    int ret = 0;

    trace_extree_co_pwrite_zeroes_start(s, offset, bytes, flags);
    while (pos < end && ret == 0) {
        uint64_t aend = end >= vsize ? ROUND_UP(vsize, bsz)
                                     : QEMU_ALIGN_DOWN(end, bsz);

        if (QEMU_IS_ALIGNED(pos, bsz) && aend > pos) {
            ret = extree_zero_blocks(s, pos, aend, flags);
            pos = MIN(aend, end);
        } else {
            uint64_t n = MIN(end, QEMU_ALIGN_DOWN(pos, bsz) + bsz) - pos;
            ret = extree_zero_partial(s, pos, n, flags);
            pos += n;
        }
    }
    trace_extree_co_pwrite_zeroes_done(s, offset, ret);
    return ret;
}

/* ---- Truncate ---- */

/*
 * Preallocate whole blocks [start, end), which are unallocated: allocate,
 * make the host space read as zeroes (@mode: metadata may leave holes,
 * falloc allocates, full writes zeroes), map as DATA.
 * Called with s->lock held; the I/O is done with it held (truncate is
 * rare, and nothing else may allocate meanwhile).
 */
static int coroutine_fn GRAPH_RDLOCK
extree_preallocate(BDRVExtreeState *s, uint64_t start, uint64_t end,
                   PreallocMode mode, Error **errp)
{
    BlockDriverState *bs = s->bs;
    int64_t file_len = bdrv_co_getlength(bs->file->bs);
    uint64_t max_end = 0;
    int ret = 0;

    if (file_len < 0) {
        error_setg_errno(errp, -file_len, "Could not get the file length");
        return file_len;
    }
    while (start < end) {
        uint64_t host, got, zlen;

        ret = extree_alloc_data(s->t, start, end - start, &host, &got);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not allocate space");
            return ret;
        }
        zlen = host < (uint64_t)file_len ? MIN(got, file_len - host) : 0;
        if (zlen && mode == PREALLOC_MODE_FULL) {
            size_t chunk = MIN(zlen, 1 * MiB);
            void *buf = qemu_blockalign0(bs, chunk);
            for (uint64_t o = 0; o < zlen && ret == 0; o += chunk) {
                ret = bdrv_co_pwrite(bs->file, host + o, MIN(chunk, zlen - o),
                                     buf, 0);
            }
            qemu_vfree(buf);
        } else if (zlen) {
            ret = bdrv_co_pwrite_zeroes(bs->file, host, zlen,
                                        mode == PREALLOC_MODE_METADATA ?
                                        BDRV_REQ_MAY_UNMAP : 0);
        }
        if (ret == 0) {
            ret = extree_map_data(s->t, start, got, host);
        }
        if (ret < 0) {
            extree_free_data(s->t, host, got);
            error_setg_errno(errp, -ret, "Could not preallocate");
            return ret;
        }
        max_end = MAX(max_end, host + got);
        start += got;
    }
    if (max_end > (uint64_t)file_len) {
        /* metadata: a sparse file that covers the data, like qcow2 */
        s->file_len = -1;
        ret = bdrv_co_truncate(bs->file, max_end, false,
                               mode == PREALLOC_MODE_METADATA ?
                               PREALLOC_MODE_OFF : mode, 0, errp);
    }
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
extree_co_truncate(BlockDriverState *bs, int64_t offset, bool exact,
                   PreallocMode prealloc, BdrvRequestFlags flags,
                   Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t bsz = s->block_size;
    uint64_t old;
    int ret = 0;

    if (offset % BDRV_SECTOR_SIZE) {
        error_setg(errp, "The new size must be a multiple of 512");
        return -EINVAL;
    }
    if ((uint64_t)offset > EXTREE_QEMU_MAX_SIZE) {
        error_setg(errp, "The new size must be at most %" PRIu64 " bytes",
                   EXTREE_QEMU_MAX_SIZE);
        return -EINVAL;
    }
    if (prealloc != PREALLOC_MODE_OFF && prealloc != PREALLOC_MODE_METADATA &&
        prealloc != PREALLOC_MODE_FALLOC && prealloc != PREALLOC_MODE_FULL) {
        error_setg(errp, "Unsupported preallocation mode '%s'",
                   PreallocMode_str(prealloc));
        return -ENOTSUP;
    }

    ret = extree_enter(s);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not resize the image");
        return ret;
    }
    old = extree_virtual_size(s->t);
    trace_extree_co_truncate_start(s, old, offset, prealloc, flags);
    if (offset < old) {
        if (prealloc != PREALLOC_MODE_OFF) {
            error_setg(errp, "Preallocation can't be used for shrinking an "
                       "image");
            ret = -EINVAL;
            goto out;
        }
        extree_wait_alloc(s, QEMU_ALIGN_DOWN(offset, bsz), UINT64_MAX);
        ret = extree_set_virtual_size(s->t, offset);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not shrink the image");
            goto out;
        }
        qatomic_set(&s->virtual_size, offset);
    } else if (offset > old) {
        ret = extree_set_virtual_size(s->t, offset);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not grow the image");
            goto out;
        }
        qatomic_set(&s->virtual_size, offset);

        /*
         * The rest of the old last block may hold old data (written before
         * a shrink) or show the backing file: it must read as zeroes.
         */
        if (old % bsz) {
            uint64_t len = MIN((uint64_t)offset, ROUND_UP(old, bsz)) - old;
            ExtreeCursor cur;
            ExtreeRun run;

            extree_cursor_init(&cur, s->t);
            ret = extree_cursor_query(&cur, old, len, EXTREE_COALESCE_HOST,
                                      &run);
            extree_cursor_release(&cur);
            if (ret == 0 && run.type == EXTREE_RUN_DATA) {
                ret = bdrv_co_pwrite_zeroes(bs->file, run.host, len, 0);
            } else if (ret == 0 && run.type == EXTREE_RUN_UNALLOC &&
                       (flags & BDRV_REQ_ZERO_WRITE)) {
                QEMUIOVector qiov;
                void *buf = qemu_blockalign0(bs, len);

                extree_unlock(s);
                qemu_iovec_init_buf(&qiov, buf, len);
                ret = extree_pwritev(bs, old, len, &qiov, 0, true);
                qemu_vfree(buf);
                extree_lock(s);
            }
            if (ret < 0) {
                error_setg_errno(errp, -ret, "Could not zero the old end of "
                                 "the image");
                goto out;
            }
        }

        if (ROUND_UP(old, bsz) < ROUND_UP(offset, bsz)) {
            uint64_t astart = ROUND_UP(old, bsz);
            uint64_t aend = ROUND_UP(offset, bsz);
            if (prealloc != PREALLOC_MODE_OFF) {
                ret = extree_preallocate(s, astart, aend, prealloc, errp);
            } else if (flags & BDRV_REQ_ZERO_WRITE) {
                ret = extree_update_range(s, astart, aend, EXTREE_OP_ZERO);
                if (ret < 0) {
                    error_setg_errno(errp, -ret, "Could not zero the new "
                                     "area");
                }
            }
            if (ret < 0) {
                goto out;
            }
        }
    }

    /* Rare and administrative: make the new size durable right away */
    ret = extree_commit_locked(s);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not commit extree metadata");
    }
out:
    extree_leave(s);
    trace_extree_co_truncate_done(s, offset, ret);
    return ret;
}

static int64_t coroutine_fn GRAPH_RDLOCK
extree_co_getlength(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;

    return qatomic_read(&s->virtual_size);
}

/*
 * qemu-img commit (and the commit block job) empty the top image after
 * committing it down: everything unallocated, space freed, committed.
 * Called with s->lock held.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_make_empty_locked(BDRVExtreeState *s)
{
    uint64_t end = ROUND_UP(extree_virtual_size(s->t), s->block_size);
    int ret;

    if (s->core_read_only) {
        return -EACCES;
    }
    if (!end) {
        return 0;
    }
    ret = extree_update_range(s, 0, end, EXTREE_OP_PUNCH);
    if (ret == 0) {
        ret = extree_commit_locked(s);
    }
    return ret;
}

static int GRAPH_RDLOCK extree_make_empty(BlockDriverState *bs)
{
    return extree_call_locked(bs, extree_make_empty_locked);
}

/* ---- Block status ---- */

/*
 * At most one descent per query: s->status_cursor continues on its leaf
 * when a query starts where the last one ended (qemu-img map, mirror,
 * convert all walk forward).
 *
 * want_zero: runs that read alike (host-contiguous DATA, ZERO, unallocated)
 * with the host offset.  !want_zero (is_allocated): every adjacent
 * allocated extent in one answer, like SEEK_HOLE; no host offset then.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_co_block_status(BlockDriverState *bs, bool want_zero, int64_t offset,
                       int64_t bytes, int64_t *pnum, int64_t *map,
                       BlockDriverState **file)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeRun run;
    int ret;

    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    ret = extree_cursor_query(&s->status_cursor, offset, bytes,
                              want_zero ? EXTREE_COALESCE_HOST
                                        : EXTREE_COALESCE_ALLOC, &run);
    extree_leave(s);
    if (ret < 0) {
        return ret;
    }
    trace_extree_co_block_status(s, want_zero, offset, bytes, run.type,
                                 run.length, run.host);

    *pnum = run.length;
    switch (run.type) {
    case EXTREE_RUN_DATA:
        if (!want_zero) {
            return BDRV_BLOCK_DATA;
        }
        *map = run.host;
        *file = bs->file->bs;
        return BDRV_BLOCK_DATA | BDRV_BLOCK_OFFSET_VALID;
    case EXTREE_RUN_ZERO:
        /* Allocated in this layer; !want_zero may span DATA too */
        return want_zero ? BDRV_BLOCK_ZERO : BDRV_BLOCK_DATA;
    default:
        return 0;
    }
}

/* ---- Check ---- */

static void extree_check_report(void *opaque, const char *msg)
{
    fprintf(stderr, "%s\n", msg);
}

/*
 * Count DATA extents that do not follow the previous one in the host file
 * (qemu-img check's fragmentation figure).  Called with s->lock held.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_count_fragments(BDRVExtreeState *s, BlockFragInfo *bfi)
{
    uint64_t vsize = extree_virtual_size(s->t);
    uint64_t pos = 0, next_host = 0;
    ExtreeCursor cur;
    int ret = 0;

    extree_cursor_init(&cur, s->t);
    while (pos < vsize) {
        ExtreeRun run;

        ret = extree_cursor_query(&cur, pos, vsize - pos,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            break;
        }
        if (run.type == EXTREE_RUN_DATA) {
            uint64_t blocks = DIV_ROUND_UP(run.length, s->block_size);
            bfi->allocated_clusters += blocks;
            if (next_host && run.host != next_host) {
                bfi->fragmented_clusters++;
            }
            next_host = run.host + blocks * s->block_size;
        }
        pos += run.length;
    }
    extree_cursor_release(&cur);
    return ret;
}

/*
 * qemu-img check.  -r leaks: leaked space goes back to the free-space tree
 * (only if nothing is corrupt).  -r all: also a damaged free-space tree is
 * rebuilt from the extent tree.  Damage to the extent tree is never
 * repaired.  When no corruption is left, the corrupt bit is cleared, as
 * qcow2 does.
 */
static int coroutine_fn GRAPH_RDLOCK
extree_co_check(BlockDriverState *bs, BdrvCheckResult *result,
                BdrvCheckMode fix)
{
    BDRVExtreeState *s = bs->opaque;
    unsigned core_fix = (fix & BDRV_FIX_LEAKS ? EXTREE_FIX_LEAKS : 0) |
                        (fix & BDRV_FIX_ERRORS ? EXTREE_FIX_ERRORS : 0);
    ExtreeCheckResult r;
    uint64_t leaked_blocks;
    int ret;

    trace_extree_co_check_start(s, fix);
    ret = extree_enter(s);
    if (ret < 0) {
        result->check_errors++;
        return ret;
    }
    ret = extree_commit_locked(s);
    if (ret < 0) {
        result->check_errors++;
        goto out;
    }
    ret = extree_check_fix(s->t, core_fix, &r, extree_check_report, NULL);
    if (ret < 0) {
        fprintf(stderr, "extree: check failed: %s\n", strerror(-ret));
        result->check_errors++;
        goto out;
    }
    /* BdrvCheckResult counts in int: a huge leak saturates */
    leaked_blocks = MIN(r.leaked_bytes / s->block_size, INT_MAX);
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
        ret = extree_count_fragments(s, &result->bfi);
        if (ret < 0) {
            result->check_errors++;
        }
    }
    ret = 0;
out:
    /* The checker reports damage itself; don't mark on its behalf */
    s->corrupt_pending = false;
    extree_leave(s);
    trace_extree_co_check_done(s, result->corruptions, result->leaks, ret);
    return ret;
}

/* ---- Info ---- */

static int coroutine_fn
extree_co_get_info(BlockDriverState *bs, BlockDriverInfo *bdi)
{
    BDRVExtreeState *s = bs->opaque;

    bdi->cluster_size = s->block_size;
    bdi->is_dirty = false;
    return 0;
}

static ImageInfoSpecific * GRAPH_RDLOCK
extree_get_specific_info(BlockDriverState *bs, Error **errp)
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
    return spec_info;
}

/* ---- Backing file ---- */

static int coroutine_fn GRAPH_RDLOCK
extree_co_change_backing_file(BlockDriverState *bs, const char *backing_file,
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
    ret = extree_enter(s);
    if (ret < 0) {
        return ret;
    }
    ret = extree_set_backing(s->t, backing_file, backing_file ? backing_fmt
                                                              : NULL);
    if (ret == 0) {
        ret = extree_commit_locked(s);
    }
    extree_leave(s);
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

/* ---- Create ---- */

/*
 * Everything that can be wrong with the creation options, checked before
 * anything is written.
 */
static int extree_check_create(uint64_t size, uint64_t block_size,
                               uint64_t node_size, const char *backing_file,
                               bool has_backing_fmt, PreallocMode prealloc,
                               Error **errp)
{
    if (size > EXTREE_QEMU_MAX_SIZE) {
        error_setg(errp, "Image size must be at most %" PRIu64 " bytes",
                   EXTREE_QEMU_MAX_SIZE);
        return -EINVAL;
    }
    if (size % BDRV_SECTOR_SIZE) {
        error_setg(errp, "Image size must be a multiple of 512 bytes");
        return -EINVAL;
    }
    if (block_size < EXTREE_MIN_BLOCK_SIZE ||
        block_size > EXTREE_MAX_NODE_SIZE || !is_power_of_2(block_size)) {
        error_setg(errp, "Block size must be a power of two between %d and "
                   "%d bytes", EXTREE_MIN_BLOCK_SIZE, EXTREE_MAX_NODE_SIZE);
        return -EINVAL;
    }
    if (node_size < EXTREE_MIN_NODE_SIZE ||
        node_size > EXTREE_MAX_NODE_SIZE || !is_power_of_2(node_size)) {
        error_setg(errp, "Node size must be a power of two between %d and "
                   "%d bytes", EXTREE_MIN_NODE_SIZE, EXTREE_MAX_NODE_SIZE);
        return -EINVAL;
    }
    if (node_size < block_size) {
        error_setg(errp, "Node size (%" PRIu64 ") must not be smaller than "
                   "the block size (%" PRIu64 ")", node_size, block_size);
        return -EINVAL;
    }
    if (has_backing_fmt && !backing_file) {
        error_setg(errp, "Backing format cannot be used without backing file");
        return -EINVAL;
    }
    if (backing_file && strlen(backing_file) > EXTREE_BACKING_FILE_MAX) {
        error_setg(errp, "Backing file name too long (at most %d bytes)",
                   EXTREE_BACKING_FILE_MAX);
        return -EINVAL;
    }
    if (backing_file && prealloc != PREALLOC_MODE_OFF) {
        error_setg(errp, "Backing file and preallocation cannot be used at "
                   "the same time");
        return -EINVAL;
    }
    if (prealloc != PREALLOC_MODE_OFF && prealloc != PREALLOC_MODE_METADATA &&
        prealloc != PREALLOC_MODE_FALLOC && prealloc != PREALLOC_MODE_FULL) {
        error_setg(errp, "Unsupported preallocation mode '%s'",
                   PreallocMode_str(prealloc));
        return -EINVAL;
    }
    return 0;
}

static uint64_t extree_default_node_size(uint64_t block_size)
{
    return MAX(EXTREE_DEFAULT_NODE_SIZE, block_size);
}

static int coroutine_fn GRAPH_UNLOCKED
extree_co_create(BlockdevCreateOptions *opts, Error **errp)
{
    BlockdevCreateOptionsExtree *xo;
    BlockDriverState *bs = NULL;
    BlockBackend *blk = NULL;
    ExtreeBackend be;
    ExtreeCreateParams params;
    PreallocMode prealloc;
    uint64_t block_size, node_size;
    g_autofree char *msg = NULL;
    const char *backing_fmt = NULL;
    int ret;

    assert(opts->driver == BLOCKDEV_DRIVER_EXTREE);
    xo = &opts->u.extree;

    block_size = xo->has_block_size ? xo->block_size
                                    : EXTREE_DEFAULT_BLOCK_SIZE;
    node_size = xo->has_node_size ? xo->node_size
                                  : extree_default_node_size(block_size);
    prealloc = xo->has_preallocation ? xo->preallocation : PREALLOC_MODE_OFF;
    ret = extree_check_create(xo->size, block_size, node_size,
                              xo->backing_file, xo->has_backing_fmt, prealloc,
                              errp);
    if (ret < 0) {
        return ret;
    }
    if (xo->has_backing_fmt) {
        backing_fmt = BlockdevDriver_str(xo->backing_fmt);
    }

    bs = bdrv_co_open_blockdev_ref(xo->file, errp);
    if (bs == NULL) {
        return -EIO;
    }
    blk = blk_co_new_with_bs(bs, BLK_PERM_WRITE | BLK_PERM_RESIZE,
                             BLK_PERM_ALL, errp);
    if (!blk) {
        ret = -EPERM;
        goto out;
    }
    blk_set_allow_write_beyond_eof(blk, true);

    /*
     * Not exact: a block device or an NBD export keeps its size (the
     * image's superblocks say where it ends), a regular file is emptied
     */
    ret = blk_co_truncate(blk, 0, false, PREALLOC_MODE_OFF, 0, errp);
    if (ret < 0) {
        goto out;
    }

    /* Preallocation is a grow of an empty image, done by the driver */
    params = (ExtreeCreateParams) {
        .virtual_size = prealloc == PREALLOC_MODE_OFF ? xo->size : 0,
        .block_size = block_size,
        .node_size = node_size,
        .backing_file = xo->backing_file,
        .backing_fmt = backing_fmt,
    };
    be.ops = &extree_blk_backend_ops;
    be.opaque = blk;
    ret = extree_create(&be, &params, &msg);
    if (ret < 0) {
        error_setg(errp, "%s", msg ? msg : strerror(-ret));
        goto out;
    }

    if (prealloc != PREALLOC_MODE_OFF) {
        QDict *options = qdict_new();

        blk_co_unref(blk);
        qdict_put_str(options, "driver", "extree");
        qdict_put_str(options, "file", bs->node_name);
        blk = blk_co_new_open(NULL, NULL, options,
                              BDRV_O_RDWR | BDRV_O_RESIZE | BDRV_O_NO_BACKING,
                              errp);
        if (blk == NULL) {
            ret = -EIO;
            goto out;
        }
        ret = blk_co_truncate(blk, xo->size, false, prealloc, 0, errp);
        if (ret < 0) {
            error_prepend(errp, "Could not preallocate: ");
            goto out;
        }
    }
    ret = 0;
out:
    blk_co_unref(blk);
    bdrv_co_unref(bs);
    return ret;
}

static int coroutine_fn GRAPH_UNLOCKED
extree_co_create_opts(BlockDriver *drv, const char *filename, QemuOpts *opts,
                      Error **errp)
{
    BlockdevCreateOptions *create_options = NULL;
    BlockDriverState *bs = NULL;
    QDict *qdict;
    Visitor *v;
    const char *prealloc_str, *backing_fmt;
    PreallocMode prealloc;
    uint64_t size, block_size;
    Error *local_err = NULL;
    int ret;

    static const QDictRenames opt_renames[] = {
        { BLOCK_OPT_BACKING_FILE,       "backing-file" },
        { BLOCK_OPT_BACKING_FMT,        "backing-fmt" },
        { EXTREE_OPT_BLOCK_SIZE,         "block-size" },
        { EXTREE_OPT_NODE_SIZE,         "node-size" },
        { NULL, NULL },
    };

    /* Validate before the file is created: bad options write nothing */
    size = ROUND_UP(qemu_opt_get_size(opts, BLOCK_OPT_SIZE, 0),
                    BDRV_SECTOR_SIZE);
    block_size = qemu_opt_get_size(opts, EXTREE_OPT_BLOCK_SIZE,
                                   EXTREE_DEFAULT_BLOCK_SIZE);
    prealloc_str = qemu_opt_get(opts, BLOCK_OPT_PREALLOC);
    prealloc = qapi_enum_parse(&PreallocMode_lookup, prealloc_str,
                               PREALLOC_MODE_OFF, &local_err);
    if (local_err) {
        error_free(local_err);
        error_setg(errp, "Invalid preallocation mode '%s' (allowed values: "
                   "off, metadata, falloc, full)", prealloc_str);
        return -EINVAL;
    }
    backing_fmt = qemu_opt_get(opts, BLOCK_OPT_BACKING_FMT);
    if (backing_fmt &&
        qapi_enum_parse(&BlockdevDriver_lookup, backing_fmt, -1, NULL) < 0) {
        error_setg(errp, "Unknown backing file format '%s'", backing_fmt);
        return -EINVAL;
    }
    ret = extree_check_create(size, block_size,
                              qemu_opt_get_size(opts, EXTREE_OPT_NODE_SIZE,
                                    extree_default_node_size(block_size)),
                              qemu_opt_get(opts, BLOCK_OPT_BACKING_FILE),
                              backing_fmt, prealloc, errp);
    if (ret < 0) {
        return ret;
    }

    qdict = qemu_opts_to_qdict_filtered(opts, NULL, &extree_create_opts,
                                        true);
    if (!qdict_rename_keys(qdict, opt_renames, errp)) {
        ret = -EINVAL;
        goto finish;
    }

    ret = bdrv_co_create_file(filename, opts, errp);
    if (ret < 0) {
        goto finish;
    }
    bs = bdrv_co_open(filename, NULL, NULL,
                      BDRV_O_RDWR | BDRV_O_RESIZE | BDRV_O_PROTOCOL, errp);
    if (bs == NULL) {
        ret = -EIO;
        goto finish;
    }

    qdict_put_str(qdict, "driver", "extree");
    qdict_put_str(qdict, "file", bs->node_name);
    v = qobject_input_visitor_new_flat_confused(qdict, errp);
    if (!v) {
        ret = -EINVAL;
        goto finish;
    }
    visit_type_BlockdevCreateOptions(v, NULL, &create_options, errp);
    visit_free(v);
    if (!create_options) {
        ret = -EINVAL;
        goto finish;
    }

    /* Silently round up the size, as the other drivers do */
    assert(create_options->driver == BLOCKDEV_DRIVER_EXTREE);
    create_options->u.extree.size = size;

    ret = extree_co_create(create_options, errp);
finish:
    if (ret < 0 && bs) {
        bdrv_graph_co_rdlock();
        bdrv_co_delete_file_noerr(bs);
        bdrv_graph_co_rdunlock();
    }
    qobject_unref(qdict);
    bdrv_co_unref(bs);
    qapi_free_BlockdevCreateOptions(create_options);
    return ret;
}

/* ---- Measure ---- */

static BlockMeasureInfo *extree_measure(QemuOpts *opts, BlockDriverState *in_bs,
                                        Error **errp)
{
    Error *local_err = NULL;
    BlockMeasureInfo *info;
    g_autofree char *optstr = NULL;
    uint64_t block_size, node_size, virtual_size, vend;
    uint64_t required_data = 0, nr_extents = 0;
    PreallocMode prealloc;
    bool has_backing_file;

    block_size = qemu_opt_get_size_del(opts, EXTREE_OPT_BLOCK_SIZE,
                                       EXTREE_DEFAULT_BLOCK_SIZE);
    node_size = qemu_opt_get_size_del(opts, EXTREE_OPT_NODE_SIZE,
                                      extree_default_node_size(block_size));
    optstr = qemu_opt_get_del(opts, BLOCK_OPT_PREALLOC);
    prealloc = qapi_enum_parse(&PreallocMode_lookup, optstr,
                               PREALLOC_MODE_OFF, &local_err);
    if (local_err) {
        error_propagate(errp, local_err);
        return NULL;
    }
    g_free(optstr);
    optstr = qemu_opt_get_del(opts, BLOCK_OPT_BACKING_FILE);
    has_backing_file = !!optstr;
    virtual_size = ROUND_UP(qemu_opt_get_size_del(opts, BLOCK_OPT_SIZE, 0),
                            BDRV_SECTOR_SIZE);

    if (in_bs) {
        int64_t ssize = bdrv_getlength(in_bs);
        if (ssize < 0) {
            error_setg_errno(errp, -ssize, "Unable to get image virtual_size");
            return NULL;
        }
        virtual_size = ROUND_UP(ssize, BDRV_SECTOR_SIZE);
    }
    if (extree_check_create(virtual_size, block_size, node_size,
                            optstr, false, prealloc, errp) < 0) {
        return NULL;
    }
    vend = ROUND_UP(virtual_size, block_size);

    if (in_bs && has_backing_file) {
        /* Nothing known about what the backing file shares: all of it */
        required_data = vend;
        nr_extents = 0;
    } else if (in_bs) {
        int64_t ssize = virtual_size;
        uint64_t counted_end = 0;
        int64_t offset, pnum = 0;

        for (offset = 0; offset < ssize; offset += pnum) {
            int ret = bdrv_block_status_above(in_bs, NULL, offset,
                                              ssize - offset, &pnum, NULL,
                                              NULL);
            if (ret < 0) {
                error_setg_errno(errp, -ret, "Unable to get block status");
                return NULL;
            }
            if (ret & BDRV_BLOCK_ZERO) {
                continue;
            }
            if ((ret & (BDRV_BLOCK_DATA | BDRV_BLOCK_ALLOCATED)) ==
                (BDRV_BLOCK_DATA | BDRV_BLOCK_ALLOCATED)) {
                uint64_t s = MAX(QEMU_ALIGN_DOWN(offset, block_size),
                                 counted_end);
                uint64_t e = ROUND_UP(offset + pnum, block_size);
                if (e > s) {
                    required_data += e - s;
                    counted_end = e;
                }
                nr_extents++;
            }
        }
    }
    if (prealloc != PREALLOC_MODE_OFF) {
        required_data = vend;
        nr_extents = 1;
    }

    info = g_new0(BlockMeasureInfo, 1);
    /* Fully allocated in the worst order: one extent per block */
    info->fully_allocated = vend + extree_metadata_bound(virtual_size,
                                                         block_size,
                                                         node_size, 0);
    info->required = required_data +
        extree_metadata_bound(virtual_size, block_size, node_size,
                              nr_extents ? nr_extents : 1);
    return info;
}

/* ---- Amend ---- */

static int GRAPH_RDLOCK
extree_amend_options(BlockDriverState *bs, QemuOpts *opts,
                     BlockDriverAmendStatusCB *status_cb, void *cb_opaque,
                     bool force, Error **errp)
{
    BDRVExtreeState *s = bs->opaque;
    const char *backing_file, *backing_fmt;
    uint64_t v;

    if (qemu_opt_find(opts, EXTREE_OPT_BLOCK_SIZE)) {
        v = qemu_opt_get_size(opts, EXTREE_OPT_BLOCK_SIZE, 0);
        if (v != s->block_size) {
            error_setg(errp, "Cannot change the block size of an extree "
                       "image");
            error_append_hint(errp, "Convert the image with qemu-img "
                              "convert instead.\n");
            return -ENOTSUP;
        }
    }
    if (qemu_opt_find(opts, EXTREE_OPT_NODE_SIZE)) {
        v = qemu_opt_get_size(opts, EXTREE_OPT_NODE_SIZE, 0);
        if (v != s->node_size) {
            error_setg(errp, "Cannot change the node size of an extree "
                       "image");
            error_append_hint(errp, "Convert the image with qemu-img "
                              "convert instead.\n");
            return -ENOTSUP;
        }
    }
    backing_file = qemu_opt_get(opts, BLOCK_OPT_BACKING_FILE);
    backing_fmt = qemu_opt_get(opts, BLOCK_OPT_BACKING_FMT);
    if ((backing_file &&
         g_strcmp0(backing_file, extree_backing_file(s->t))) ||
        (backing_fmt && g_strcmp0(backing_fmt, extree_backing_fmt(s->t)))) {
        error_setg(errp, "Cannot amend the backing file");
        error_append_hint(errp, "You can use 'qemu-img rebase' instead.\n");
        return -EINVAL;
    }

    if (qemu_opt_find(opts, BLOCK_OPT_SIZE)) {
        uint64_t new_size = qemu_opt_get_size(opts, BLOCK_OPT_SIZE, 0);
        BlockBackend *blk;
        int ret;

        blk = blk_new_with_bs(bs, BLK_PERM_RESIZE, BLK_PERM_ALL, errp);
        if (!blk) {
            return -EPERM;
        }
        ret = blk_truncate(blk, new_size, true, PREALLOC_MODE_OFF, 0, errp);
        blk_unref(blk);
        if (ret < 0) {
            return ret;
        }
    }
    return 0;
}

/* ---- Driver table ---- */

static QemuOptsList extree_create_opts = {
    .name = "extree-create-opts",
    .head = QTAILQ_HEAD_INITIALIZER(extree_create_opts.head),
    .desc = {
        {
            .name = BLOCK_OPT_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Virtual disk size (at most 0x7fffffffc0000000 bytes)"
        },
        {
            .name = BLOCK_OPT_BACKING_FILE,
            .type = QEMU_OPT_STRING,
            .help = "File name of a base image (at most 1023 bytes)"
        },
        {
            .name = BLOCK_OPT_BACKING_FMT,
            .type = QEMU_OPT_STRING,
            .help = "Image format of the base image"
        },
        {
            .name = EXTREE_OPT_BLOCK_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Allocation granularity in bytes: a power of two from "
                    "512 to 1M; writes smaller than a block into "
                    "unallocated space read-modify-write the block",
            .def_value_str = stringify(EXTREE_DEFAULT_BLOCK_SIZE)
        },
        {
            .name = EXTREE_OPT_NODE_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Metadata tree node size in bytes: a power of two from "
                    "4k to 1M, at least block_size (default: 16k, or "
                    "block_size if that is larger)"
        },
        {
            .name = BLOCK_OPT_PREALLOC,
            .type = QEMU_OPT_STRING,
            .help = "Preallocation mode (allowed values: off, metadata, "
                    "falloc, full); not with a backing file"
        },
        { /* end of list */ }
    }
};

static QemuOptsList extree_amend_opts = {
    .name = "extree-amend-opts",
    .head = QTAILQ_HEAD_INITIALIZER(extree_amend_opts.head),
    .desc = {
        {
            .name = BLOCK_OPT_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Virtual disk size"
        },
        {
            .name = BLOCK_OPT_BACKING_FILE,
            .type = QEMU_OPT_STRING,
            .help = "File name of a base image (cannot be changed: use "
                    "qemu-img rebase)"
        },
        {
            .name = BLOCK_OPT_BACKING_FMT,
            .type = QEMU_OPT_STRING,
            .help = "Image format of the base image (cannot be changed: use "
                    "qemu-img rebase)"
        },
        {
            .name = EXTREE_OPT_BLOCK_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Allocation granularity (cannot be changed)"
        },
        {
            .name = EXTREE_OPT_NODE_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Metadata tree node size (cannot be changed)"
        },
        { /* end of list */ }
    }
};

static BlockDriver bdrv_extree = {
    .format_name                    = "extree",
    .instance_size                  = sizeof(BDRVExtreeState),
    .create_opts                    = &extree_create_opts,
    .amend_opts                     = &extree_amend_opts,
    .mutable_opts                   = extree_mutable_opts,
    .is_format                      = true,
    .supports_backing               = true,

    .bdrv_probe                     = extree_probe,
    .bdrv_open                      = extree_open_bs,
    .bdrv_close                     = extree_close_bs,
    .bdrv_reopen_prepare            = extree_reopen_prepare,
    .bdrv_reopen_commit             = extree_reopen_commit,
    .bdrv_reopen_abort              = extree_reopen_abort,
    .bdrv_child_perm                = bdrv_default_perms,
    .bdrv_co_create                 = extree_co_create,
    .bdrv_co_create_opts            = extree_co_create_opts,
    .bdrv_has_zero_init             = bdrv_has_zero_init_1,
    .bdrv_inactivate                = extree_inactivate,
    .bdrv_co_invalidate_cache       = extree_co_invalidate_cache,

    .bdrv_co_preadv_part            = extree_co_preadv_part,
    .bdrv_co_pwritev_part           = extree_co_pwritev_part,
    .bdrv_co_flush_to_os            = extree_co_flush_to_os,
    .bdrv_co_pwrite_zeroes          = extree_co_pwrite_zeroes,
    .bdrv_co_pdiscard               = extree_co_pdiscard,
    .bdrv_co_truncate               = extree_co_truncate,
    .bdrv_co_getlength              = extree_co_getlength,
    .bdrv_co_block_status           = extree_co_block_status,
    .bdrv_make_empty                = extree_make_empty,

    .bdrv_co_check                  = extree_co_check,
    .bdrv_co_get_info               = extree_co_get_info,
    .bdrv_get_specific_info         = extree_get_specific_info,
    .bdrv_measure                   = extree_measure,
    .bdrv_amend_options             = extree_amend_options,
    .bdrv_co_change_backing_file    = extree_co_change_backing_file,
    .bdrv_refresh_limits            = extree_refresh_limits,

    .bdrv_detach_aio_context        = extree_detach_aio_context,
    .bdrv_attach_aio_context        = extree_attach_aio_context,
    .bdrv_drain_begin               = extree_drain_begin,
};

static void bdrv_extree_init(void)
{
    bdrv_register(&bdrv_extree);
}

block_init(bdrv_extree_init);
