/*
 * extree: QEMU driver internals, shared by the driver's files
 *
 * The image format lives in the QEMU-independent core behind
 * block/extree/extree.h (its functions are extree_*).  The QEMU driver is
 *
 *   extree.c           the BlockDriver table, open/close/reopen, inactivate
 *                      and invalidate, the commit timer, info and check glue
 *   extree-create.c    create, measure, amend and their option lists
 *   extree-snapshot.c  internal snapshots and VM state
 *   extree-dirty.c     persistent dirty bitmaps: QEMU's and the core's
 *   extree-range.c     discard, write zeroes, truncate, preallocation
 *   extree-write.c     writes (in place, or read-modify-write to new
 *                      space), inflating compressed units, compressed
 *                      writes, flush
 *   extree-read.c      lock-free lookups, reads, block status
 *   extree-req.c       requests, s->lock and the commit gate, commits,
 *                      allocation requests, the corruption helper, calls
 *                      from the main loop
 *   extree-crypt.c     LUKS encryption of data and the header
 *   extree-codec.c     compression in the thread pool
 *   extree-file.c      the core's backend over bs->file (and over a
 *                      BlockBackend, for create), readahead, grow-ahead of
 *                      the file and the limit of a file that cannot grow
 *   extree-crc32c-qemu.c  the core's CRC-32C as QEMU's crc32c()
 *
 * Calls go downwards in that list (scripts/check-layers.py): a file calls
 * the files below it, never one above.  Every function the driver defines
 * is xt_*, its BlockDriver callbacks included (named after their field:
 * xt_co_preadv_part for .bdrv_co_preadv_part); every extree_* function it
 * calls is the core's, so no name needs a suffix to tell them apart.
 * extree-crc32c-qemu.c stands in for the core's CRC-32C (QEMU's).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef BLOCK_EXTREE_QEMU_H
#define BLOCK_EXTREE_QEMU_H

#include "block/block_int.h"
#include "block/reqlist.h"
#include "qemu/coroutine.h"
#include "qemu/queue.h"
#include "qemu/timer.h"
#include "crypto/block.h"

#include "extree/extree.h"

/*
 * Largest virtual size: the format allows EXTREE_MAX_VIRTUAL_SIZE, QEMU's
 * block layer BDRV_MAX_LENGTH (2^63 - 1 rounded down to 1 GiB), which is
 * smaller.
 */
#define EXTREE_QEMU_MAX_SIZE \
    MIN((uint64_t)EXTREE_MAX_VIRTUAL_SIZE, (uint64_t)BDRV_MAX_LENGTH)


/*
 * A tree node read without s->lock for a no-wait lookup (xt_query()):
 * others that miss the same node wait on @waiters instead of reading it
 * again (single flight).  Lives on the reader's stack.
 */
typedef struct ExtreeNodeRead {
    uint64_t bytenr;
    CoQueue waiters;
    QLIST_ENTRY(ExtreeNodeRead) next;
} ExtreeNodeRead;

/*
 * Fields without a rule of their own are set at open, by
 * .bdrv_reopen_commit or by invalidation, with no request in flight, and
 * only read otherwise.
 */
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
     * Requests: from xt_enter() to xt_leave(), a request may hold
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
    /*
     * BDRV_O_INACTIVE: no writes.  Set by .bdrv_inactivate after its
     * commit, cleared by invalidation; flush reads it without the lock.
     */
    bool inactive;

    /*
     * Grow-ahead (EXTREE_GROW_AHEAD, extree-file.c): the file's length
     * as last read or set by xt_grow_file(), -1 when unknown (a truncate
     * ran since); @grow_off once growing failed (a block device, a
     * protocol that cannot resize): the writes extend the file themselves.
     * Protected by lock.
     */
    int64_t file_len;
    bool grow_off;
    uint32_t block_size;                /* of @t, constant while open */
    /*
     * Compressed writes: units of @compress_unit bytes (one COMPRESSED
     * extent each: XT_COMPRESS_UNIT, or a block if larger) compressed with
     * @compress_alg (EXTREE_COMPRESS_*, @t's compression_type); constant
     * while open
     */
    uint32_t compress_unit, compress_alg;
    uint32_t node_size;

    /* block_status walks forward from where the last query ended */
    ExtreeCursor status_cursor;         /* Protected by lock */

    /*
     * Virtual size of @t, for bdrv_co_getlength(), which takes no lock;
     * after a snapshot's load_tmp, the size the node had before (reads
     * past the end of a smaller snapshot see it unallocated).  Written
     * with lock held, read with qatomic_read().
     */
    uint64_t virtual_size;

    /*
     * Allocating writes in flight, QEMU's request list (block/reqlist.h):
     * a BlockReq on the writer's stack says that guest blocks [offset,
     * offset + bytes) have host space allocated but not mapped yet;
     * others that want to allocate or change blocks of the range wait on
     * it (xt_wait_alloc()).  Two requests never allocate the same guest
     * block.  Protected by lock.
     */
    BlockReqList alloc_reqs;

    /*
     * Node reads in flight without the lock (ExtreeNodeRead), at most one
     * per node.  Protected by lock.
     */
    QLIST_HEAD(, ExtreeNodeRead) node_reads;

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
     * Mark log group commit (xt_mark_log()): ranges waiting for a record
     * (@mark_pending), the batch the next record takes (@mark_batch; a
     * waiter's range is durable, or its record failed, once @mark_done
     * reaches the batch it joined), whether a coroutine is writing a
     * record (@mark_busy), and where the others wait (@mark_queue).
     * Protected by lock.  A writer of a record holds its request counted,
     * so no commit runs between the record and its data.
     */
    ExtreeMarkRange mark_pending[EXTREE_MARK_LOG_RANGES];
    unsigned mark_npending;
    uint64_t mark_batch, mark_done;
    bool mark_busy;
    CoQueue mark_queue;

    /*
     * Deferred writes (xt_defer_write()): writes in place that wait only
     * for a mark log record, acknowledged at once and written by a
     * coroutine of their own, which joins the record's group commit.
     * Until written, each holds its guest range in @deferred_reqs: reads,
     * writes and range updates that overlap it wait (xt_wait_deferred());
     * a flush waits for those acknowledged before it (numbered by
     * @deferred_seq), a gate or a resize for all.  @deferred_count and
     * @deferred_bytes: what is held, bounded by XT_DEFER_MAX_*.
     * @deferred_err: the first failure of one, which every flush returns
     * from then on (the guest was told that the write succeeded).  Waiters
     * for a flush wait on @deferred_queue.  @writes_since_flush: guest
     * writes since the last flush, counted up to XT_DEFER_QUIET_WRITES
     * (below it none is deferred).  Protected by lock; each deferred
     * write is also counted in bs->in_flight, so that a drain waits for
     * it.
     */
    BlockReqList deferred_reqs;
    unsigned deferred_count;
    unsigned writes_since_flush;
    uint64_t deferred_bytes;
    uint64_t deferred_seq;
    int deferred_err;
    CoQueue deferred_queue;

    /*
     * BLOCK_IMAGE_CORRUPTED was sent for this image (later non-fatal
     * damage is only logged); the damage itself is kept by the core until
     * xt_handle_corruption().  Protected by lock.
     */
    bool signaled_corruption;

    /* Runtime options */
    uint64_t cache_size;                /* bytes, 0 = core default */
    uint64_t commit_interval;           /* seconds, 0 = no timer */
    bool mark_log;                      /* runtime option mark-log */
    uint64_t dirty_limit;               /* bytes of dirty metadata */

    /*
     * Commits uncommitted metadata @commit_interval seconds after the first
     * change; lives in bs's AioContext.
     */
    QEMUTimer *commit_timer;

    /*
     * LUKS (extree-crypt.c): NULL if the image is not encrypted.  Set at
     * open and kept until close (reopen and invalidation keep it: the
     * header does not move); the crypto layer locks its own ciphers, so
     * requests use it without s->lock.  The header's place, from the
     * superblock, is constant too.
     */
    QCryptoBlock *crypto;
    uint64_t crypt_hdr_offset;
    uint64_t crypt_hdr_len;

    /*
     * A persistent bitmap removed from the image whose BdrvDirtyBitmap
     * QEMU has not released yet: commits must not store it again
     * (extree-dirty.c).  Protected by lock.
     */
    char *bitmap_removing;
    /*
     * Bitmap name -> bdrv_dirty_bitmap_change_gen() when the core last
     * took its bits (uint64_t *).  Protected by lock.
     */
    GHashTable *bitmap_gens;
    /*
     * The core's marks were dropped since a sync that added them: the
     * next commit syncs every bitmap.  Set in .bdrv_drain_end (drained),
     * otherwise protected by lock.
     */
    bool bitmaps_resync;
} BDRVExtreeState;

/*
 * Encrypted I/O larger than a piece goes in pieces (each with its own
 * bounce buffer), this many at a time
 */
/*
 * Compressed writes: a COMPRESSED extent holds XT_COMPRESS_UNIT bytes (or
 * a block, if larger); qemu-img writes XT_COMPRESS_CHUNK at a time
 * (bdi.compressed_cluster_size), whose units are compressed
 * XT_COMPRESS_WORKERS at once in the thread pool
 */
#define XT_COMPRESS_UNIT    (256 * 1024)
#define XT_COMPRESS_CHUNK   (512 * 1024)
#define XT_COMPRESS_WORKERS 4
#define XT_CRYPT_PIECE      (256 * 1024)
#define XT_CRYPT_WORKERS    4
/* Buffers this small are en- or decrypted in the coroutine */
#define XT_CRYPT_INLINE     (16 * 1024)

/* ---- extree-file.c: a request's pieces in parallel ---- */

typedef int coroutine_fn GRAPH_RDLOCK XtPieceFn(void *opaque, uint64_t offset,
                                                uint64_t bytes);
int coroutine_fn GRAPH_RDLOCK
xt_run_pieces(uint64_t bytes, uint64_t piece, int workers, XtPieceFn *fn,
              void *opaque);

/* ---- extree-codec.c ---- */

int coroutine_fn xt_compress(uint32_t alg, const void *src, size_t len,
                             void *dst, size_t cap, size_t *plen);
int coroutine_fn GRAPH_RDLOCK
xt_decompress_run(BDRVExtreeState *s, const ExtreeRun *run, void *buf);

/* ---- extree-file.c ---- */

/* Backend over bs->file, opaque = BDRVExtreeState */
extern const ExtreeBackendOps xt_file_backend_ops;

/* extree-crypt.c */
int coroutine_fn GRAPH_RDLOCK
xt_crypt_open(BDRVExtreeState *s, QDict *encryptopts, int flags,
              Error **errp);
void xt_crypt_close(BDRVExtreeState *s);
int coroutine_fn xt_crypt_create(BlockBackend *blk,
                                 QCryptoBlockCreateOptions *opts,
                                 uint64_t *header_len, Error **errp);
int xt_crypt_measure(QCryptoBlockCreateOptions *opts, uint64_t *header_len,
                     Error **errp);
int GRAPH_RDLOCK xt_crypt_amend(BDRVExtreeState *s,
                                QCryptoBlockAmendOptions *opts, bool force,
                                Error **errp);
int coroutine_fn xt_crypt(BDRVExtreeState *s, bool encrypt, uint64_t guest,
                          void *buf, size_t len);
int coroutine_fn GRAPH_RDLOCK
xt_crypt_read(BDRVExtreeState *s, uint64_t host, uint64_t guest,
              uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset);
int coroutine_fn GRAPH_RDLOCK
xt_crypt_write(BDRVExtreeState *s, uint64_t host, uint64_t guest,
               uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset);
/* Backend over a BlockBackend (opaque), for image creation */
extern const ExtreeBackendOps xt_blk_backend_ops;

/* Grow-ahead: the file reaches @end.  Called with s->lock held */
void coroutine_fn GRAPH_RDLOCK xt_grow_file(BDRVExtreeState *s, uint64_t end);
/* Before an update that may allocate @bytes of data.  s->lock held */
void coroutine_fn GRAPH_RDLOCK xt_grow_before(BDRVExtreeState *s,
                                              uint64_t bytes);
/* After -ENOSPC: did storage of fixed size grow?  s->lock held */
bool coroutine_fn GRAPH_RDLOCK xt_storage_grew(BDRVExtreeState *s);
/* ... that allocates nodes and @contig bytes in one run only */
void coroutine_fn GRAPH_RDLOCK xt_grow_before_nodes(BDRVExtreeState *s,
                                                  uint64_t contig);
/*
 * Cut the file back to host_end, right after a successful commit.  Called
 * with s->lock held or from close
 */
void coroutine_mixed_fn GRAPH_RDLOCK xt_trim_file(BDRVExtreeState *s);

/* ---- extree-req.c ---- */

static inline void coroutine_fn xt_lock(BDRVExtreeState *s)
{
    qemu_co_mutex_lock(&s->lock);
}

/* qemu_co_queue_wait() on s->lock, which it retakes */
static inline void coroutine_fn xt_queue_wait(BDRVExtreeState *s, CoQueue *q)
{
    qemu_co_queue_wait(q, &s->lock);
}

/* Drop s->lock, handling a corruption the core recorded meanwhile */
void coroutine_fn xt_unlock(BDRVExtreeState *s);
/* Start a request: takes s->lock; -ENOMEDIUM without a core handle */
int coroutine_fn xt_enter(BDRVExtreeState *s);
/*
 * The same from a request that is counted already (@nested), which must
 * not wait for an invalidation its own request holds back
 */
int coroutine_fn xt_enter_nested(BDRVExtreeState *s, bool nested);
/* End a request: drops s->lock (and handles a recorded corruption) */
void coroutine_fn xt_leave(BDRVExtreeState *s);
/*
 * Count a request between its lookup and the end of its data I/O; waits
 * (dropping s->lock) while a commit is pending.  s->lock held.
 */
void coroutine_fn xt_io_begin(BDRVExtreeState *s);
void coroutine_fn xt_io_end(BDRVExtreeState *s);
/* The allocating write that overlaps guest [start, end), if any */
BlockReq *xt_find_alloc(BDRVExtreeState *s, uint64_t start, uint64_t end);
/*
 * Hold guest blocks [start, end) for an allocating write (@req on the
 * writer's stack) until xt_alloc_done().  s->lock held; nothing may
 * overlap (xt_wait_alloc() first).
 */
void xt_alloc_begin(BDRVExtreeState *s, BlockReq *req, uint64_t start,
                    uint64_t end);
/* Let the waiters on @req go.  s->lock held. */
void coroutine_fn xt_alloc_done(BlockReq *req);
/*
 * Wait until no deferred write (xt_defer_write()) overlaps guest [@start,
 * @end) (UINT64_MAX: to the end).  s->lock held; dropped while waiting.
 */
void coroutine_fn xt_wait_deferred(BDRVExtreeState *s, uint64_t start,
                                   uint64_t end);
/*
 * Wait until no allocating write overlaps guest [start, end); true if it
 * waited.  s->lock held; dropped while waiting.
 */
bool coroutine_fn xt_wait_alloc(BDRVExtreeState *s, uint64_t start,
                                uint64_t end);

/*
 * Report the damage the core found since the last call, if any, and mark
 * a writable image corrupt.  s->lock held, or no request in flight.
 */
void coroutine_mixed_fn xt_handle_corruption(BDRVExtreeState *s);
/* The core's trace points as QEMU trace events (extree_set_trace()) */
void xt_core_trace(void *opaque, ExtreeTraceEvent ev, uint64_t a, uint64_t b,
                   uint64_t c);

/* Commit with no request in flight: open, close, reopen, invalidation */
int coroutine_mixed_fn GRAPH_RDLOCK xt_commit_now(BDRVExtreeState *s);
/* Commit through the gate.  Called with s->lock held; may drop it */
int coroutine_fn GRAPH_RDLOCK xt_commit_locked(BDRVExtreeState *s);
int coroutine_fn GRAPH_RDLOCK xt_commit_or_log(BDRVExtreeState *s,
                                               bool may_log);
/* After a request changed the tree: commit soon.  s->lock held. */
void coroutine_fn GRAPH_RDLOCK xt_update_done(BDRVExtreeState *s);

/*
 * Run @fn in a coroutine with s->lock held, from outside coroutine context
 * (main loop), and wait for it: for the callbacks that are not drained, so
 * that requests and the commit timer may be running.
 */
typedef int coroutine_fn GRAPH_RDLOCK ExtreeLockedFn(BDRVExtreeState *s);
typedef int coroutine_fn GRAPH_RDLOCK ExtreeLockedOpFn(BDRVExtreeState *s,
                                                       void *opaque);
int GRAPH_RDLOCK xt_call_locked(BlockDriverState *bs, ExtreeLockedFn *fn);
int GRAPH_RDLOCK xt_call_locked_op(BlockDriverState *bs,
                                   ExtreeLockedOpFn *fn, void *opaque);

/* ---- extree-read.c ---- */

/*
 * extree_cursor_query() that reads a node missing from the cache without
 * s->lock (others missing the same node wait for that read).  Called with
 * s->lock held; may drop and retake it: the answer holds until the caller
 * next drops the lock.
 */
int coroutine_fn GRAPH_RDLOCK
xt_query(BDRVExtreeState *s, ExtreeCursor *c, uint64_t guest,
         uint64_t max_bytes, int coalesce, ExtreeRun *run);

/* ---- extree-write.c ---- */

/*
 * Write guest [@offset, + @bytes) from @qiov; @nested: from a request
 * that is counted already (xt_enter_nested())
 */
int coroutine_fn GRAPH_RDLOCK
xt_pwritev(BlockDriverState *bs, int64_t offset, int64_t bytes,
           QEMUIOVector *qiov, size_t qiov_offset, bool nested);

/*
 * The part of a write, guest [@offset, + @n), that falls into compressed
 * run @run: the unit is rewritten as data with it.  *@done: the part
 * written.  Called as xt_pwritev() calls it.
 */
int coroutine_fn GRAPH_RDLOCK
xt_inflate(BDRVExtreeState *s, const ExtreeRun *run, uint64_t offset,
           uint64_t n, QEMUIOVector *qiov, size_t qiov_offset,
           uint64_t *done);
/*
 * Before a range update of guest [@start, @end): waits until no
 * allocating write overlaps it and no compressed extent lies across
 * either end (rewritten uncompressed if one does), and counts the request
 * (xt_io_begin()).  s->lock held; may be dropped and retaken.
 */
int coroutine_fn GRAPH_RDLOCK
xt_settle_range(BDRVExtreeState *s, uint64_t start, uint64_t end);

/* ---- extree-create.c: create, measure, amend and their options ---- */

#define EXTREE_OPT_BLOCK_SIZE       "block_size"
#define EXTREE_OPT_NODE_SIZE        "node_size"

extern QemuOptsList xt_create_opts;
extern QemuOptsList xt_amend_opts;
int coroutine_fn GRAPH_UNLOCKED
xt_co_create(BlockdevCreateOptions *opts, Error **errp);
int coroutine_fn GRAPH_UNLOCKED
xt_co_create_opts(BlockDriver *drv, const char *filename, QemuOpts *opts,
                  Error **errp);
BlockMeasureInfo *xt_measure(QemuOpts *opts, BlockDriverState *in_bs,
                             Error **errp);
int GRAPH_RDLOCK
xt_amend_options(BlockDriverState *bs, QemuOpts *opts,
                 BlockDriverAmendStatusCB *status_cb, void *cb_opaque,
                 bool force, Error **errp);
int coroutine_fn GRAPH_RDLOCK
xt_co_amend(BlockDriverState *bs, BlockdevAmendOptions *opts, bool force,
            Error **errp);

/* extree-snapshot.c: internal snapshots and VM state */
int GRAPH_RDLOCK xt_snapshot_create(BlockDriverState *bs,
                                    QEMUSnapshotInfo *sn_info);
int GRAPH_UNLOCKED xt_snapshot_goto(BlockDriverState *bs,
                                    const char *snapshot_id);
int GRAPH_RDLOCK xt_snapshot_delete(BlockDriverState *bs,
                                    const char *snapshot_id,
                                    const char *name, Error **errp);
int GRAPH_RDLOCK xt_snapshot_list(BlockDriverState *bs,
                                  QEMUSnapshotInfo **psn_tab);
int GRAPH_RDLOCK xt_snapshot_load_tmp(BlockDriverState *bs,
                                      const char *snapshot_id,
                                      const char *name, Error **errp);
int coroutine_fn GRAPH_RDLOCK
xt_co_save_vmstate(BlockDriverState *bs, QEMUIOVector *qiov,
                         int64_t pos);
int coroutine_fn GRAPH_RDLOCK
xt_co_load_vmstate(BlockDriverState *bs, QEMUIOVector *qiov,
                        int64_t pos);
/*
 * Hold new data lookups back and wait until no request holds host ranges
 * it looked up (as a commit does), for snapshot operations, which replace
 * or drop whole trees; xt_gate_open() lets them go again.  Called with
 * s->lock held; xt_gate_close() may drop it.
 */
void coroutine_fn xt_gate_close(BDRVExtreeState *s);
void coroutine_fn xt_gate_open(BDRVExtreeState *s);
/* .bdrv_make_empty.  Called with s->lock held; may drop it */
int coroutine_fn GRAPH_RDLOCK xt_make_empty_locked(BDRVExtreeState *s);

/* BlockDriver callbacks */
int coroutine_fn GRAPH_RDLOCK
xt_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                  QEMUIOVector *qiov, size_t qiov_offset,
                  BdrvRequestFlags flags);
int coroutine_fn GRAPH_RDLOCK
xt_co_pwritev_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                   QEMUIOVector *qiov, size_t qiov_offset,
                   BdrvRequestFlags flags);
int coroutine_fn GRAPH_RDLOCK
xt_co_pwritev_compressed_part(BlockDriverState *bs, int64_t offset,
                              int64_t bytes, QEMUIOVector *qiov,
                              size_t qiov_offset);
int coroutine_fn GRAPH_RDLOCK xt_co_flush_to_os(BlockDriverState *bs);
int coroutine_fn GRAPH_RDLOCK
xt_co_pdiscard(BlockDriverState *bs, int64_t offset, int64_t bytes);
int coroutine_fn GRAPH_RDLOCK
xt_co_pwrite_zeroes(BlockDriverState *bs, int64_t offset, int64_t bytes,
                    BdrvRequestFlags flags);
int coroutine_fn GRAPH_RDLOCK
xt_co_truncate(BlockDriverState *bs, int64_t offset, bool exact,
               PreallocMode prealloc, BdrvRequestFlags flags,
               Error **errp);
int64_t coroutine_fn GRAPH_RDLOCK xt_co_getlength(BlockDriverState *bs);
int coroutine_fn GRAPH_RDLOCK
xt_co_block_status(BlockDriverState *bs, bool want_zero, int64_t offset,
                   int64_t bytes, int64_t *pnum, int64_t *map,
                   BlockDriverState **file);

/* extree-dirty.c: persistent dirty bitmaps */
bool xt_bitmaps_any(BDRVExtreeState *s);
void xt_bitmaps_sync(BDRVExtreeState *s, bool full);
bool xt_bitmaps_sync_needed(BDRVExtreeState *s);
int xt_bitmaps_load(BDRVExtreeState *s, Error **errp);
void xt_bitmaps_release(BDRVExtreeState *s);
void xt_bitmaps_set_readonly(BDRVExtreeState *s, bool ro);
bool xt_bitmaps_can_store(BDRVExtreeState *s, const char *name,
                          uint32_t granularity, Error **errp);

#endif /* BLOCK_EXTREE_QEMU_H */
