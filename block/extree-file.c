/*
 * extree: QEMU driver, the host file
 *
 * The core's backend over bs->file (ExtreeBackendOps), with readahead of
 * node batches (pread_many), and a backend over a BlockBackend for image
 * creation; grow-ahead of the file before allocations reach its end, the
 * host limit of a file that cannot grow, and the trim of the tail past
 * host_end.
 *
 * Calls only the core and the block layer, never the driver's other files.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/aio_task.h"
#include "block/block_int.h"
#include "qemu/coroutine.h"
#include "qemu/memalign.h"
#include "qemu/units.h"
#include "system/block-backend.h"
#include "trace/trace-block_extree.h"

#include "extree-qemu.h"

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

/* ---- Backend over bs->file ---- */

/*
 * The core calls these with s->lock held, in coroutine context, or from
 * open/close/reopen outside coroutine context with no request in flight:
 * the co_wrapper_mixed functions work in both.
 */
static int coroutine_mixed_fn GRAPH_RDLOCK
xt_be_pread(void *opaque, uint64_t offset, void *buf, uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pread(s->bs->file, offset, bytes, buf, 0);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
xt_be_pwrite(void *opaque, uint64_t offset, const void *buf,
             uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pwrite(s->bs->file, offset, bytes, buf, 0);
}

static int coroutine_mixed_fn GRAPH_RDLOCK xt_be_flush(void *opaque)
{
    BDRVExtreeState *s = opaque;

    return bdrv_flush(s->bs->file->bs);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
xt_be_truncate(void *opaque, uint64_t size)
{
    BDRVExtreeState *s = opaque;

    trace_extree_host_shrink(s, size);
    s->file_len = -1;
    return bdrv_truncate(s->bs->file, size, false, PREALLOC_MODE_OFF, 0,
                         NULL);
}

static int coroutine_mixed_fn GRAPH_RDLOCK
xt_be_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    BDRVExtreeState *s = opaque;

    return bdrv_pdiscard(s->bs->file, offset, bytes);
}

static int64_t coroutine_mixed_fn GRAPH_RDLOCK
xt_be_get_length(void *opaque)
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

static int coroutine_fn GRAPH_RDLOCK xt_read_task(AioTask *task)
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
xt_be_pread_many(void *opaque, int n, const uint64_t *offsets,
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
            .task.func = xt_read_task,
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

const ExtreeBackendOps xt_file_backend_ops = {
    .pread = xt_be_pread,
    .pread_many = xt_be_pread_many,
    .pwrite = xt_be_pwrite,
    .flush = xt_be_flush,
    .truncate = xt_be_truncate,
    .discard = xt_be_discard,
    .get_length = xt_be_get_length,
};

/* Backend over a BlockBackend, for image creation (coroutine context) */
static int coroutine_fn xt_blk_pread(void *opaque, uint64_t offset,
                                     void *buf, uint64_t bytes)
{
    return blk_co_pread(opaque, offset, bytes, buf, 0);
}

static int coroutine_fn xt_blk_pwrite(void *opaque, uint64_t offset,
                                      const void *buf, uint64_t bytes)
{
    return blk_co_pwrite(opaque, offset, bytes, buf, 0);
}

static int coroutine_fn xt_blk_flush(void *opaque)
{
    return blk_co_flush(opaque);
}

static int64_t coroutine_fn xt_blk_get_length(void *opaque)
{
    return blk_co_getlength(opaque);
}

const ExtreeBackendOps xt_blk_backend_ops = {
    .pread = xt_blk_pread,
    .pwrite = xt_blk_pwrite,
    .flush = xt_blk_flush,
    .get_length = xt_blk_get_length,
};

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
void coroutine_fn GRAPH_RDLOCK
xt_grow_file(BDRVExtreeState *s, uint64_t end)
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
void coroutine_fn GRAPH_RDLOCK
xt_grow_before(BDRVExtreeState *s, uint64_t bytes)
{
    if (!s->core_read_only) {
        xt_grow_file(s, extree_grow_bound(s->t, bytes));
    }
}

/*
 * Storage of fixed size may have grown since the core was told its limit
 * (an LV after lvextend, a loop device after losetup -c, a protocol node
 * after block_resize), as thin provisioning does when allocation crosses
 * the write threshold or the guest paused on ENOSPC: ask the protocol node
 * for its length again and raise the limit.  True if the storage grew (a
 * write that failed with -ENOSPC is worth another try).  Called with
 * s->lock held, after an allocation failed with -ENOSPC, so this costs
 * nothing while space lasts.
 */
bool coroutine_fn GRAPH_RDLOCK xt_storage_grew(BDRVExtreeState *s)
{
    BlockDriverState *file = s->bs->file->bs;
    int64_t len;

    if (!s->grow_off || s->core_read_only) {
        return false;
    }
    /* host_device and NBD cache their length: read the device's */
    bdrv_co_refresh_total_sectors(file, file->total_sectors);
    len = bdrv_co_getlength(file);
    trace_extree_storage_grew(s, s->file_len, len);
    if (len <= s->file_len) {
        return false;
    }
    s->file_len = len;
    extree_set_host_limit(s->t, len);
    return true;
}

/*
 * The same before an update that allocates nodes only, and @contig bytes
 * in one run (a snapshot table): no growth while free space holds them
 */
void coroutine_fn GRAPH_RDLOCK
xt_grow_before_nodes(BDRVExtreeState *s, uint64_t contig)
{
    if (!s->core_read_only) {
        xt_grow_file(s, extree_grow_bound_nodes(s->t, contig));
    }
}

/*
 * Cut what lies past host_end off the file (grow-ahead's tail, or one a
 * crash left), so that a closed image is no longer than its contents, and
 * discard the freed node space no later commit will.
 * Only after a successful commit, with the core read-write and no request
 * in flight: then host_end is the durable one and nothing past it is in
 * use.  Never on an image found damaged or being checked: what lies past
 * host_end may be evidence.  Best effort.  Called with s->lock held or
 * from close.
 */
void coroutine_mixed_fn GRAPH_RDLOCK xt_trim_file(BDRVExtreeState *s)
{
    uint64_t end;
    int64_t len;
    int ret;

    if (!s->t || s->core_read_only || s->inactive || extree_is_dirty(s->t) ||
        extree_corruption_pending(s->t) || s->signaled_corruption ||
        (extree_incompat_features(s->t) & EXTREE_INCOMPAT_CORRUPT) ||
        (s->bs->open_flags & BDRV_O_CHECK)) {
        return;
    }
    extree_discard_deferred(s->t);
    end = extree_host_end(s->t);
    len = bdrv_getlength(s->bs->file->bs);
    if (len < 0 || (uint64_t)len <= end) {
        return;
    }
    s->file_len = -1;
    ret = bdrv_truncate(s->bs->file, end, false, PREALLOC_MODE_OFF, 0, NULL);
    trace_extree_trim_file(s, len, end, ret);
}

/* ---- Pieces of a request in parallel ---- */

typedef struct XtPieceTask {
    AioTask task;
    XtPieceFn *fn;
    void *opaque;
    uint64_t offset, bytes;
} XtPieceTask;

/* Runs while the request that started it holds the graph lock (qcow2's) */
static int coroutine_fn GRAPH_RDLOCK xt_piece_task(AioTask *task)
{
    XtPieceTask *t = container_of(task, XtPieceTask, task);

    return t->fn(t->opaque, t->offset, t->bytes);
}

/*
 * @fn(@opaque, offset, length) over [0, @bytes) in pieces of @piece
 * bytes, up to @workers at once, as qcow2 runs a request's clusters: one
 * piece's I/O overlaps another's work in the thread pool, and both cores
 * work.  No new piece starts after one failed; the first error is
 * returned.
 */
int coroutine_fn GRAPH_RDLOCK
xt_run_pieces(uint64_t bytes, uint64_t piece, int workers, XtPieceFn *fn,
              void *opaque)
{
    AioTaskPool *pool;
    int ret;

    if (bytes <= piece) {
        return fn(opaque, 0, bytes);
    }
    pool = aio_task_pool_new(workers);
    for (uint64_t o = 0; o < bytes; o += piece) {
        XtPieceTask *t = g_new(XtPieceTask, 1);

        if (aio_task_pool_status(pool) < 0) {
            g_free(t);
            break;
        }
        *t = (XtPieceTask) {
            .task.func = xt_piece_task,
            .fn = fn,
            .opaque = opaque,
            .offset = o,
            .bytes = MIN(piece, bytes - o),
        };
        /* the pool frees the task when it is done */
        aio_task_pool_start_task(pool, &t->task);
    }
    aio_task_pool_wait_all(pool);
    ret = aio_task_pool_status(pool);
    aio_task_pool_free(pool);
    return ret;
}
