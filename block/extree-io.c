/*
 * extree: QEMU driver, guest I/O and commits
 *
 * Requests and s->lock, the commit gate and commits, the corruption
 * helper, then the guest data path: reads, writes (allocating writes
 * read-modify-write their first and last block), flush, discard, write
 * zeroes, truncate and block status.  Every call into the core (extree_*)
 * is made with s->lock held; the data I/O is done without it:
 *
 *   guest request
 *     -> lock: look up (or allocate) the host ranges with a cursor
 *     -> unlock: data I/O on bs->file, bs->backing or zeroes
 *     -> lock: map newly allocated ranges
 *
 * Calls extree-file.c (grow-ahead), never extree.c.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block.h"
#include "block/block_int.h"
#include "qapi/error.h"
#include "qapi/qapi-events-block-core.h"
#include "qemu/coroutine.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/memalign.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "trace/trace-block_extree.h"

#include "extree-qemu.h"

/* Runs looked up per lock hold on the read path */
#define EXTREE_READ_BATCH               16

/* ---- Corruption ---- */

/*
 * Called by the core, from inside the call that found the damage (which
 * then fails with -EIO).  Only records it: marking the image corrupt
 * writes a superblock, which must wait until the core call has returned.
 */
void xt_corrupt_cb(void *opaque, uint64_t offset, const char *msg)
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
static void coroutine_mixed_fn xt_handle_corruption(BDRVExtreeState *s)
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

static inline void coroutine_fn xt_unlock(BDRVExtreeState *s)
{
    if (unlikely(s->corrupt_pending)) {
        xt_handle_corruption(s);
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
static int coroutine_fn xt_enter_nested(BDRVExtreeState *s, bool nested)
{
    xt_lock(s);
    while (s->replacing && !nested) {
        xt_queue_wait(s, &s->replace_queue);
    }
    if (!s->t) {
        qemu_co_mutex_unlock(&s->lock);
        return -ENOMEDIUM;
    }
    s->requests++;
    return 0;
}

int coroutine_fn xt_enter(BDRVExtreeState *s)
{
    return xt_enter_nested(s, false);
}

/* End a request started by xt_enter(); drops s->lock */
void coroutine_fn xt_leave(BDRVExtreeState *s)
{
    assert(s->requests > 0);
    if (--s->requests == 0 && s->replacing) {
        qemu_co_queue_restart_all(&s->idle_queue);
    }
    xt_unlock(s);
}

/*
 * Count a request that is about to look up host ranges for data I/O.
 * Called with s->lock held; waits (dropping it) while a commit is pending.
 */
static void coroutine_fn xt_io_begin(BDRVExtreeState *s)
{
    while (s->commit_waiting) {
        xt_queue_wait(s, &s->io_queue);
    }
    s->io_inflight++;
}

/* Called with s->lock held */
static void coroutine_fn xt_io_end(BDRVExtreeState *s)
{
    assert(s->io_inflight > 0);
    if (--s->io_inflight == 0 && s->commit_waiting) {
        qemu_co_queue_restart_all(&s->commit_queue);
    }
}

/* Called with s->lock held */
static ExtreeAllocReq *xt_find_alloc(BDRVExtreeState *s, uint64_t start,
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
static bool coroutine_fn xt_wait_alloc(BDRVExtreeState *s, uint64_t start,
                                       uint64_t end)
{
    ExtreeAllocReq *other;
    bool waited = false;

    while ((other = xt_find_alloc(s, start, end))) {
        trace_extree_alloc_wait(s, start, end);
        xt_queue_wait(s, &other->waiters);
        waited = true;
    }
    return waited;
}

/*
 * Commit, with no request in flight: open, close, reopen, inactivate (the
 * node is drained there).
 */
int coroutine_mixed_fn GRAPH_RDLOCK
xt_commit_now(BDRVExtreeState *s)
{
    int ret;

    if (!s->t || s->core_read_only) {
        return 0;
    }
    assert(s->io_inflight == 0);
    /* no request in flight: QEMU's bitmaps have every change */
    extree_bitmaps_marks_reflected(s->t);
    xt_bitmaps_sync(s, true);
    if (!extree_is_dirty(s->t)) {
        return 0;
    }
    trace_extree_commit_start(s, extree_generation(s->t) + 1, 0);
    ret = extree_commit(s->t);
    xt_handle_corruption(s);
    trace_extree_commit_done(s, extree_generation(s->t), ret);
    return ret;
}

/*
 * Commit the transaction: waits until no request is between its lookup and
 * the end of its data I/O, holding new ones back meanwhile.
 * Called with s->lock held; may drop and retake it.
 */
int coroutine_fn GRAPH_RDLOCK xt_commit_locked(BDRVExtreeState *s)
{
    bool bitmaps;
    int ret = 0;

    if (s->core_read_only) {
        return 0;
    }
    bitmaps = xt_bitmaps_any(s);
    if (!bitmaps && !extree_is_dirty(s->t)) {
        return 0;
    }
    trace_extree_commit_start(s, extree_generation(s->t) + 1,
                              s->io_inflight);
    s->commit_waiting++;
    while (s->io_inflight > 0) {
        xt_queue_wait(s, &s->commit_queue);
    }
    /*
     * QEMU's bitmaps now hold every write in place that completed, and no
     * other is in flight: what a clear or disable there left out of the
     * core's bits cannot be written in place before this commit
     */
    if (bitmaps) {
        xt_bitmaps_sync(s, false);
    }
    if (!extree_is_dirty(s->t)) {
        goto out;
    }
    /* the free-space tree's nodes are allocated now */
    xt_grow_before_nodes(s, 0);
    ret = extree_commit(s->t);
    if (ret < 0 && extree_is_broken(s->t) && extree_can_roll_back(s->t)) {
        /*
         * Out of space half-way through an update or this commit: an
         * estimate fell short, or storage of fixed size ended before the
         * grow-ahead found out.  No request holds a range of the
         * transaction (the gate is closed), so drop it and go on from the
         * last commit, as a reopen would, instead of failing every later
         * request.  The failed commit reports the loss.
         */
        error_report("extree: %s: no space left for metadata; changes "
                     "since the last commit are lost",
                     bdrv_get_device_or_node_name(s->bs));
        if (extree_rollback(s->t) == 0) {
            s->file_len = -1;
            qatomic_set(&s->virtual_size, extree_virtual_size(s->t));
            extree_cursor_release(&s->status_cursor);
            extree_cursor_init(&s->status_cursor, s->t);
        }
        ret = -ENOSPC;
    }
out:
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
 * Close the gate for an operation that replaces or drops whole trees
 * (snapshots): as for a commit, new lookups are held back and the call
 * waits until no request holds host ranges it looked up.  Called with
 * s->lock held; may drop and retake it.  xt_gate_open() ends it.
 */
void coroutine_fn xt_gate_close(BDRVExtreeState *s)
{
    s->commit_waiting++;
    while (s->io_inflight > 0) {
        xt_queue_wait(s, &s->commit_queue);
    }
}

/* Called with s->lock held */
void coroutine_fn xt_gate_open(BDRVExtreeState *s)
{
    assert(s->commit_waiting > 0);
    if (--s->commit_waiting == 0) {
        qemu_co_queue_restart_all(&s->io_queue);
    }
}

/*
 * After a request changed the tree: commit if too much metadata is dirty,
 * else make sure the commit timer runs.  Called with s->lock held, after
 * the request's own xt_io_end().
 */
void coroutine_fn GRAPH_RDLOCK xt_update_done(BDRVExtreeState *s)
{
    if (s->core_read_only || !extree_is_dirty(s->t)) {
        return;
    }
    if (extree_commit_wanted(s->t)) {
        /* A failure is reported by the next flush, which retries */
        xt_commit_locked(s);
        return;
    }
    if (s->commit_timer && s->commit_interval &&
        !timer_pending(s->commit_timer)) {
        timer_mod(s->commit_timer, qemu_clock_get_ms(QEMU_CLOCK_REALTIME) +
                  s->commit_interval * 1000);
    }
}

/* ---- Lookups: tree nodes read without the lock ---- */

/* No-wait lookups of one query before it falls back to a blocking one */
#define EXTREE_NOWAIT_TRIES             (2 * EXTREE_MAX_LEVELS)

/*
 * Read tree node @bytenr without s->lock and hand it to the core, which
 * validates it when the lookup asks again.  One read per node: a request
 * that misses a node already being read waits for that read instead.
 * @epoch: from extree_missing_node(); the core refuses the image if a
 * commit completed meanwhile (the location may have been reused).
 * Called with s->lock held, in a request; drops and retakes it.  The
 * request may or may not be counted by xt_io_begin(): the read touches
 * only a node of the current tree, which no commit can free and reuse
 * before the core would refuse the image, and a waiter waits only for
 * this read, never for a commit.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_read_node(BDRVExtreeState *s, uint64_t bytenr, uint64_t epoch)
{
    BlockDriverState *bs = s->bs;
    ExtreeNodeRead *other, r = { .bytenr = bytenr };
    void *buf;
    int ret;

    QLIST_FOREACH(other, &s->node_reads, next) {
        if (other->bytenr == bytenr) {
            trace_extree_node_read_wait(s, bytenr);
            xt_queue_wait(s, &other->waiters);
            /* @other is gone: the caller asks the core again */
            return 0;
        }
    }
    buf = qemu_try_blockalign(bs->file->bs, s->node_size);
    if (!buf) {
        return -ENOMEM;
    }
    qemu_co_queue_init(&r.waiters);
    QLIST_INSERT_HEAD(&s->node_reads, &r, next);
    qemu_co_mutex_unlock(&s->lock);

    ret = bdrv_co_pread(bs->file, bytenr, s->node_size, buf, 0);

    xt_lock(s);
    trace_extree_node_read(s, bytenr, ret);
    if (ret >= 0) {
        extree_node_prefetch(s->t, bytenr, epoch, buf);
    }
    QLIST_REMOVE(&r, next);
    qemu_co_queue_restart_all(&r.waiters);
    qemu_vfree(buf);
    return ret;
}

/*
 * extree_cursor_query() that holds s->lock across no node read: the
 * no-wait query names a node it misses, xt_read_node() reads it without
 * the lock, and the query runs again (each node a descent needs, one by
 * one).  Concurrent random lookups over a tree larger than the node cache
 * so wait for their own nodes, not for each other's.  A forward walk's
 * next leaf (missing node 0), a failed read, or too many tries (the
 * images refused after commits or evicted) go to the blocking query, which
 * reads with the lock held, with readahead, and reports errors its usual
 * way.  Called with s->lock held; may drop and retake it.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_query(BDRVExtreeState *s, ExtreeCursor *c, uint64_t guest,
         uint64_t max_bytes, int coalesce, ExtreeRun *run)
{
    for (int tries = 0; tries < EXTREE_NOWAIT_TRIES; tries++) {
        uint64_t bytenr, epoch;
        int ret;

        ret = extree_cursor_query_nowait(c, guest, max_bytes, coalesce, run);
        if (ret != -EWOULDBLOCK) {
            return ret;
        }
        bytenr = extree_missing_node(s->t, &epoch);
        trace_extree_node_miss(s, guest, bytenr);
        if (!bytenr || xt_read_node(s, bytenr, epoch) < 0) {
            break;
        }
    }
    return extree_cursor_query(c, guest, max_bytes, coalesce, run);
}

/* ---- Reads ---- */

/*
 * What guest [@guest, @guest + @bytes) reads as in a run of @type that is
 * not DATA: the backing chain for UNALLOC (zeroes past its end or without
 * one), zeroes for ZERO.  Called without s->lock.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_read_unmapped(BDRVExtreeState *s, ExtreeRunType type, uint64_t guest,
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
 * Guest [run->guest, + run->length) of COMPRESSED run @run into @qiov at
 * @qiov_offset: the whole extent decompressed, the part copied out.
 * Called without s->lock, the request counted (xt_io_begin()).
 */
static int coroutine_fn GRAPH_RDLOCK
xt_read_compressed(BDRVExtreeState *s, const ExtreeRun *run,
                   QEMUIOVector *qiov, size_t qiov_offset)
{
    uint8_t *buf = qemu_try_blockalign(s->bs, run->ext_length);
    int ret;

    if (!buf) {
        return -ENOMEM;
    }
    ret = xt_decompress_run(s, run, buf);
    if (ret == 0) {
        qemu_iovec_from_buf(qiov, qiov_offset,
                            buf + (run->guest - run->ext_guest), run->length);
    }
    qemu_vfree(buf);
    return ret;
}

/*
 * One lookup of up to EXTREE_READ_BATCH runs with the request's cursor,
 * then their I/O without the lock.  DATA runs are host-contiguous pieces
 * already merged by the cursor (EXTREE_COALESCE_HOST): one host read each.
 */
int coroutine_fn GRAPH_RDLOCK
extree_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                      QEMUIOVector *qiov, size_t qiov_offset,
                      BdrvRequestFlags flags)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeRun runs[EXTREE_READ_BATCH];
    ExtreeCursor cur;
    int ret = 0;

    trace_extree_co_preadv_start(s, offset, bytes);
    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    extree_cursor_init(&cur, s->t);
    while (bytes > 0) {
        uint64_t pos = offset, left = bytes;
        int nr = 0;

        xt_io_begin(s);
        while (nr < EXTREE_READ_BATCH && left > 0) {
            if (pos >= extree_virtual_size(s->t)) {
                /*
                 * Not past the node's end (load_tmp gives the node the
                 * snapshot's size): a guard, read as unallocated
                 */
                runs[nr++] = (ExtreeRun) {
                    .guest = pos, .length = left, .type = EXTREE_RUN_UNALLOC,
                };
                pos += left;
                left = 0;
                break;
            }
            ret = xt_query(s, &cur, pos, left, EXTREE_COALESCE_HOST,
                           &runs[nr]);
            if (ret < 0) {
                break;
            }
            pos += runs[nr].length;
            left -= runs[nr].length;
            nr++;
        }
        if (ret < 0) {
            xt_io_end(s);
            break;
        }
        qemu_co_mutex_unlock(&s->lock);

        for (int i = 0; i < nr && ret >= 0; i++) {
            ExtreeRun *run = &runs[i];
            size_t qoff = qiov_offset + (run->guest - offset);

            trace_extree_read_run(s, run->guest, run->length, run->type,
                                  run->host);
            if (run->type == EXTREE_RUN_DATA && s->crypto) {
                BLKDBG_CO_EVENT(bs->file, BLKDBG_READ_AIO);
                ret = xt_crypt_read(s, run->host, run->guest, run->length,
                                    qiov, qoff);
            } else if (run->type == EXTREE_RUN_DATA) {
                BLKDBG_CO_EVENT(bs->file, BLKDBG_READ_AIO);
                ret = bdrv_co_preadv_part(bs->file, run->host, run->length,
                                          qiov, qoff, 0);
            } else if (run->type == EXTREE_RUN_COMPRESSED) {
                BLKDBG_CO_EVENT(bs->file, BLKDBG_READ_COMPRESSED);
                ret = xt_read_compressed(s, run, qiov, qoff);
            } else {
                ret = xt_read_unmapped(s, run->type, run->guest,
                                       run->length, qiov, qoff);
            }
        }

        xt_lock(s);
        xt_io_end(s);
        if (ret < 0) {
            break;
        }
        qiov_offset += pos - offset;
        offset = pos;
        bytes = left;
    }
    extree_cursor_release(&cur);
    xt_leave(s);
    trace_extree_co_preadv_done(s, offset, ret);
    return ret < 0 ? ret : 0;
}

/* ---- Writes ---- */

/*
 * Fill @buf (@bytes) with what guest [@guest, @guest + @bytes) reads as now;
 * it lies in a block of @run (possibly before @run->guest or past its end,
 * within the same block).  DATA (shared with a snapshot, so not written in
 * place): the old bytes in bs->file, decrypted.  UNALLOC: the backing file,
 * or zeroes.  ZERO: zeroes.  Bytes past @vsize read as zeroes.  Called
 * without s->lock.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_read_old(BDRVExtreeState *s, const ExtreeRun *run, uint64_t guest,
            uint64_t bytes, uint64_t vsize, uint8_t *buf)
{
    memset(buf, 0, bytes);
    if (guest >= vsize) {
        return 0;
    }
    bytes = MIN(bytes, vsize - guest);
    if (run->type == EXTREE_RUN_DATA) {
        /* extents are whole blocks: the block is host-contiguous */
        int ret = bdrv_co_pread(s->bs->file, run->host + guest - run->guest,
                                bytes, buf, 0);

        if (ret == 0 && s->crypto) {
            ret = xt_crypt(s, false, guest, buf, bytes);
        }
        return ret;
    }
    if (run->type == EXTREE_RUN_UNALLOC && s->bs->backing) {
        return bdrv_co_pread(s->bs->backing, guest, bytes, buf, 0);
    }
    return 0;
}

/*
 * How guest [@offset, @offset + *@n) of DATA run @run is written: in place
 * (*@in_place), or by the allocating path when a snapshot shares it (spec:
 * Sharing, 3).  Shortens *@n so that blocks written in place are unshared,
 * and so that the partial first and last block of an allocating write are
 * shared: its read-modify-write of such a block must not race with a write
 * in place to the rest of it (shared blocks are never written in place).
 * Whole unshared blocks inside an allocating write move to new space with
 * the rest (a write in place into them overlaps this one).
 * O(log n) lookups.  Called with s->lock held.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_write_mode(BDRVExtreeState *s, const ExtreeRun *run, uint64_t offset,
              uint64_t *n, bool *in_place)
{
    uint64_t bsz = s->block_size;
    uint64_t start = QEMU_ALIGN_DOWN(offset, bsz);
    uint64_t end = ROUND_UP(offset + *n, bsz);
    uint64_t len;
    bool head;
    int ret;

    ret = extree_in_place(s->t, run, start, end - start, in_place);
    if (ret < 0 || *in_place) {
        return ret;
    }
    /* a single block was just asked about */
    head = false;
    if (end - start > bsz) {
        ret = extree_in_place(s->t, run, start, bsz, &head);
        if (ret < 0) {
            return ret;
        }
    }
    if (head) {
        /* the unshared head, found by doubling (the whole is shared) */
        len = bsz;
        while (len * 2 < end - start) {
            ret = extree_in_place(s->t, run, start, len * 2, &head);
            if (ret < 0) {
                return ret;
            }
            if (!head) {
                break;
            }
            len *= 2;
        }
        *n = start + len - offset;
        *in_place = true;
        return 0;
    }
    if (end - start > bsz && (offset + *n) % bsz) {
        bool tail;

        ret = extree_in_place(s->t, run, end - bsz, bsz, &tail);
        if (ret == 0 && tail) {
            /* the partial last block is written in place, next round */
            *n = end - bsz - offset;
        }
    }
    return ret;
}

/*
 * The allocating part of a write: guest [@offset, @offset + @n) lies in
 * @run, which is UNALLOC or ZERO, or DATA that a snapshot shares.
 * Allocates host space for the blocks it touches, writes the guest data
 * there together with the rest of its first and last block (read-modify-
 * write: the shared DATA, the backing file or zeroes), then maps the
 * blocks (the old mapping loses its reference).  *@done is the part of
 * the request written (the allocation may have been shorter).
 *
 * Called with s->lock held and the request counted (xt_io_begin());
 * returns with s->lock held and the count dropped.  -EAGAIN: it waited for
 * an overlapping allocating write, look the mapping up again.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_alloc_write(BDRVExtreeState *s, const ExtreeRun *run, uint64_t offset,
               uint64_t n, QEMUIOVector *qiov, size_t qiov_offset,
               uint64_t *done)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    uint64_t vsize = extree_virtual_size(s->t);
    uint64_t start = QEMU_ALIGN_DOWN(offset, bsz);
    uint64_t end = ROUND_UP(offset + n, bsz);
    uint64_t host, got, head, wlen, tail, pend;
    uint8_t *head_buf = NULL, *tail_buf = NULL, *crypt_buf = NULL;
    ExtreeAllocReq req;
    QEMUIOVector hd_qiov;
    int ret;

    if (xt_find_alloc(s, start, end)) {
        xt_io_end(s);
        xt_wait_alloc(s, start, end);
        return -EAGAIN;
    }

    xt_grow_before(s, end - start);
    ret = extree_alloc_data(s->t, start, end - start, &host, &got);
    if (ret < 0) {
        xt_io_end(s);
        return ret;
    }
    xt_grow_file(s, host + got);
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
        ret = xt_read_old(s, run, start, head, vsize, head_buf);
        qemu_iovec_add(&hd_qiov, head_buf, head);
    }
    if (ret == 0) {
        qemu_iovec_concat(&hd_qiov, qiov, qiov_offset, wlen);
    }
    if (ret == 0 && tail) {
        tail_buf = qemu_blockalign(bs, tail);
        ret = xt_read_old(s, run, offset + wlen, tail, vsize, tail_buf);
        qemu_iovec_add(&hd_qiov, tail_buf, tail);
    }
    if (ret == 0 && s->crypto) {
        /* the whole of the new blocks, encrypted at their guest offset */
        crypt_buf = qemu_try_blockalign(bs->file->bs, got);
        ret = crypt_buf ? 0 : -ENOMEM;
        if (ret == 0) {
            qemu_iovec_to_buf(&hd_qiov, 0, crypt_buf, got);
            ret = xt_crypt(s, true, start, crypt_buf, got);
        }
        if (ret == 0) {
            qemu_iovec_reset(&hd_qiov);
            qemu_iovec_add(&hd_qiov, crypt_buf, got);
        }
    }
    if (ret == 0) {
        BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
        ret = bdrv_co_pwritev(bs->file, host, got, &hd_qiov, 0);
    }
    qemu_iovec_destroy(&hd_qiov);
    qemu_vfree(head_buf);
    qemu_vfree(tail_buf);
    qemu_vfree(crypt_buf);

    xt_lock(s);
    if (ret == 0) {
        /* The data is written: now the mapping may reach a commit */
        ret = extree_map_data(s->t, start, got, host);
    }
    if (ret < 0) {
        extree_free_data(s->t, host, got);
    }
    QLIST_REMOVE(&req, next);
    qemu_co_queue_restart_all(&req.waiters);
    xt_io_end(s);
    trace_extree_alloc_write_done(s, start, host, ret);
    *done = wlen;
    return ret;
}

/*
 * Rewrite COMPRESSED extent @run uncompressed into new space (spec:
 * Compressed extents; it is never split), with guest [@offset, @offset +
 * @n) of it, clipped to the extent, taken from @qiov at @qiov_offset (no
 * @qiov: as it is).  The new space may come in pieces; they are mapped in
 * one update.  *@done is the part of the request written.
 *
 * Called with s->lock held and the request counted (xt_io_begin()), which
 * keeps the payload's space from being reused; returns with s->lock held
 * and the count dropped.  -EAGAIN: it waited for an overlapping
 * allocating write, look the mapping up again.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_inflate(BDRVExtreeState *s, const ExtreeRun *run, uint64_t offset,
           uint64_t n, QEMUIOVector *qiov, size_t qiov_offset,
           uint64_t *done)
{
    BlockDriverState *bs = s->bs;
    uint64_t cstart = run->ext_guest, len = run->ext_length;
    uint64_t cend = cstart + len;
    /* at most one piece per block */
    g_autofree uint64_t *hosts = g_new(uint64_t, len / s->block_size);
    g_autofree uint64_t *lens = g_new(uint64_t, len / s->block_size);
    unsigned np = 0;
    uint64_t pos = 0, wlen;
    ExtreeAllocReq req;
    uint8_t *buf;
    int ret;

    assert(run->type == EXTREE_RUN_COMPRESSED && !s->crypto);
    if (xt_find_alloc(s, cstart, cend)) {
        xt_io_end(s);
        xt_wait_alloc(s, cstart, cend);
        return -EAGAIN;
    }
    wlen = qiov ? MIN(offset + n, cend) - offset : 0;
    req.start = cstart;
    req.end = cend;
    qemu_co_queue_init(&req.waiters);
    QLIST_INSERT_HEAD(&s->alloc_reqs, &req, next);
    qemu_co_mutex_unlock(&s->lock);
    trace_extree_inflate(s, cstart, cend, wlen);

    buf = qemu_try_blockalign(bs->file->bs, len);
    ret = buf ? xt_decompress_run(s, run, buf) : -ENOMEM;
    if (ret == 0 && wlen) {
        qemu_iovec_to_buf(qiov, qiov_offset, buf + (offset - cstart), wlen);
    }

    xt_lock(s);
    if (ret == 0) {
        xt_grow_before(s, len);
    }
    while (ret == 0 && pos < len) {
        uint64_t got;

        ret = extree_alloc_data(s->t, cstart + pos, len - pos, &hosts[np],
                                &got);
        if (ret == 0) {
            lens[np] = got;
            xt_grow_file(s, hosts[np] + got);
            pos += got;
            np++;
        }
    }
    qemu_co_mutex_unlock(&s->lock);

    for (unsigned i = 0, o = 0; ret == 0 && i < np; o += lens[i], i++) {
        BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
        ret = bdrv_co_pwrite(bs->file, hosts[i], lens[i], buf + o, 0);
    }
    qemu_vfree(buf);

    xt_lock(s);
    if (ret == 0) {
        /* The data is written: now the mapping may reach a commit */
        ret = extree_map_data_pieces(s->t, cstart, hosts, lens, np);
    }
    if (ret < 0) {
        for (unsigned i = 0; i < np; i++) {
            extree_free_data(s->t, hosts[i], lens[i]);
        }
    }
    QLIST_REMOVE(&req, next);
    qemu_co_queue_restart_all(&req.waiters);
    xt_io_end(s);
    *done = wlen;
    return ret;
}

/*
 * An update of guest ranges that start or end at @at (block-aligned)
 * must not split a COMPRESSED extent: one that lies across @at is
 * rewritten uncompressed first.  0 if no extent lies across @at: s->lock
 * was held throughout and the request is still counted; 1 if it rewrote
 * one or waited (s->lock was dropped: the caller looks at its range
 * again), or -errno, both with the count dropped.  Called with s->lock
 * held and the request counted (xt_io_begin()).
 */
static int coroutine_fn GRAPH_RDLOCK
xt_unsplit_at(BDRVExtreeState *s, uint64_t at)
{
    ExtreeCursor cur;
    ExtreeRun run;
    uint64_t done;
    int ret;

    if (!(extree_incompat_features(s->t) & EXTREE_INCOMPAT_COMPRESSED) ||
        at >= extree_virtual_size(s->t)) {
        return 0;
    }
    extree_cursor_init(&cur, s->t);
    ret = extree_cursor_query(&cur, at, s->block_size, EXTREE_COALESCE_HOST,
                              &run);
    extree_cursor_release(&cur);
    if (ret < 0) {
        xt_io_end(s);
        return ret;
    }
    if (run.type != EXTREE_RUN_COMPRESSED || run.ext_guest == at) {
        return 0;
    }
    ret = xt_inflate(s, &run, at, 0, NULL, 0, &done);
    return ret == 0 || ret == -EAGAIN ? 1 : ret;
}

/*
 * Wait until no allocating write overlaps guest [@start, @end) and no
 * COMPRESSED extent lies across either end (rewritten uncompressed if
 * one does), and count the request (xt_io_begin()): the caller then
 * updates the range without dropping s->lock.  Called with s->lock held;
 * may drop and retake it.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_settle_range(BDRVExtreeState *s, uint64_t start, uint64_t end)
{
    for (;;) {
        int ret;

        xt_wait_alloc(s, start, end);
        /* waits while a commit is pending, dropping the lock: look again */
        xt_io_begin(s);
        if (xt_find_alloc(s, start, end)) {
            xt_io_end(s);
            continue;
        }
        ret = xt_unsplit_at(s, start);
        if (ret == 0) {
            ret = xt_unsplit_at(s, end);
        }
        if (ret <= 0) {
            return ret;
        }
    }
}

/* @nested: see xt_enter_nested() */
static int coroutine_fn GRAPH_RDLOCK
xt_pwritev(BlockDriverState *bs, int64_t offset, int64_t bytes,
           QEMUIOVector *qiov, size_t qiov_offset, bool nested)
{
    BDRVExtreeState *s = bs->opaque;
    bool committed = false, in_place;
    ExtreeCursor cur;
    int ret = 0;

    trace_extree_co_pwritev_start(s, offset, bytes);
    ret = xt_enter_nested(s, nested);
    if (ret < 0) {
        return ret;
    }
    extree_cursor_init(&cur, s->t);
    while (bytes > 0) {
        ExtreeRun run;
        uint64_t n;

        xt_io_begin(s);
        ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret < 0) {
            xt_io_end(s);
            break;
        }
        n = run.length;
        in_place = false;
        if (run.type == EXTREE_RUN_DATA) {
            ret = xt_write_mode(s, &run, offset, &n, &in_place);
            if (ret < 0) {
                xt_io_end(s);
                break;
            }
        }
        if (in_place) {
            /*
             * Data in place: no mapping change, but marked before the
             * data is issued (spec: Persistent dirty bitmaps, 2): QEMU
             * marks its bitmaps only when the request returns, after a
             * commit inside it (an emulated FUA flush) or between its
             * runs (a concurrent flush) may have stored them
             */
            extree_bitmaps_mark(s->t, offset, n);
            qemu_co_mutex_unlock(&s->lock);
            trace_extree_write_in_place(s, offset, n, run.host);
            BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
            if (s->crypto) {
                ret = xt_crypt_write(s, run.host, offset, n, qiov,
                                     qiov_offset);
            } else {
                ret = bdrv_co_pwritev_part(bs->file, run.host, n, qiov,
                                           qiov_offset, 0);
            }
            xt_lock(s);
            xt_io_end(s);
        } else {
            if (run.type == EXTREE_RUN_COMPRESSED) {
                ret = xt_inflate(s, &run, offset, n, qiov, qiov_offset, &n);
            } else {
                ret = xt_alloc_write(s, &run, offset, n, qiov, qiov_offset,
                                     &n);
            }
            if (ret == -EAGAIN) {
                continue;
            }
            if (ret == -ENOSPC && xt_storage_grew(s)) {
                /* thin provisioning: the device was extended meanwhile */
                continue;
            }
            if (ret == -ENOSPC && !committed && extree_is_dirty(s->t)) {
                /*
                 * A full node of fixed size: space freed in this
                 * transaction (a discard) is reusable once committed
                 */
                committed = true;
                if (xt_commit_locked(s) == 0) {
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
    xt_update_done(s);
    xt_leave(s);
    trace_extree_co_pwritev_done(s, offset, ret);
    return ret < 0 ? ret : 0;
}

int coroutine_fn GRAPH_RDLOCK
extree_co_pwritev_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                       QEMUIOVector *qiov, size_t qiov_offset,
                       BdrvRequestFlags flags)
{
    return xt_pwritev(bs, offset, bytes, qiov, qiov_offset, false);
}

/* ---- Flush ---- */

/* ---- Compressed writes ---- */

/*
 * Map compressed guest [@offset, + @len) (block-aligned), whose payload
 * (@plen bytes, the rest of its last block zeroed) is in @payload.
 * -ENOSPC: no room, or no contiguous room for the payload: the caller
 * writes the data as it is.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_map_payload(BDRVExtreeState *s, uint64_t offset, uint64_t len,
               const uint8_t *payload, size_t plen)
{
    uint64_t need = ROUND_UP(plen, s->block_size), host, got;
    ExtreeAllocReq req;
    int ret;

    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    /* no COMPRESSED extent across either end (it is never split) */
    ret = xt_settle_range(s, offset, offset + len);
    if (ret < 0) {
        goto out;
    }
    xt_grow_before(s, need);
    ret = extree_alloc_data(s->t, offset, need, &host, &got);
    if (ret == 0 && got < need) {
        extree_free_data(s->t, host, got);
        ret = -ENOSPC;
    }
    if (ret < 0) {
        xt_io_end(s);
        goto out;
    }
    xt_grow_file(s, host + need);
    req.start = offset;
    req.end = offset + len;
    qemu_co_queue_init(&req.waiters);
    QLIST_INSERT_HEAD(&s->alloc_reqs, &req, next);
    qemu_co_mutex_unlock(&s->lock);

    trace_extree_compressed_write(s, offset, len, host, plen);
    BLKDBG_CO_EVENT(s->bs->file, BLKDBG_WRITE_COMPRESSED);
    ret = bdrv_co_pwrite(s->bs->file, host, need, payload, 0);

    xt_lock(s);
    if (ret == 0) {
        ret = extree_map_compressed(s->t, offset, len, host, plen,
                                    s->compress_alg);
    }
    if (ret < 0) {
        extree_free_data(s->t, host, need);
    }
    QLIST_REMOVE(&req, next);
    qemu_co_queue_restart_all(&req.waiters);
    xt_io_end(s);
out:
    xt_update_done(s);
    xt_leave(s);
    return ret;
}

/*
 * One unit of a compressed write: guest [@offset, + @bytes), @offset
 * block-aligned, @bytes at most s->compress_unit and a multiple of the
 * block size unless the unit ends the disk (the rest of its last block is
 * compressed as zeroes).  Zeroes become a ZERO extent; data whose payload
 * would not save a block is written as it is.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_compressed_unit(BlockDriverState *bs, uint64_t offset, uint64_t bytes,
                   QEMUIOVector *qiov, size_t qiov_offset)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t len = ROUND_UP(bytes, s->block_size);
    uint8_t *buf = qemu_try_blockalign(bs, len);
    uint8_t *payload = qemu_try_blockalign(bs->file->bs, len);
    size_t plen = 0;
    int ret = buf && payload ? 0 : -ENOMEM;

    if (ret == 0) {
        memset(buf + bytes, 0, len - bytes);
        qemu_iovec_to_buf(qiov, qiov_offset, buf, bytes);
        if (buffer_is_zero(buf, len)) {
            ret = 1;
        }
    }
    if (ret == 0) {
        /* it must save a block, or it is not worth its decompression */
        ret = xt_compress(s->compress_alg, buf, len, payload,
                          len - s->block_size, &plen);
    }
    if (ret == 0) {
        memset(payload + plen, 0, ROUND_UP(plen, s->block_size) - plen);
        ret = xt_map_payload(s, offset, len, payload, plen);
    }
    qemu_vfree(buf);
    qemu_vfree(payload);
    if (ret == 1) {
        return extree_co_pwrite_zeroes(bs, offset, bytes,
                                       BDRV_REQ_MAY_UNMAP);
    } else if (ret == -ENOSPC) {
        return xt_pwritev(bs, offset, bytes, qiov, qiov_offset, false);
    }
    return ret;
}

typedef struct XtCompressRw {
    BlockDriverState *bs;
    uint64_t offset;
    QEMUIOVector *qiov;
    size_t qiov_offset;
} XtCompressRw;

static int coroutine_fn GRAPH_RDLOCK
xt_compress_rw_unit(void *opaque, uint64_t offset, uint64_t bytes)
{
    XtCompressRw *rw = opaque;

    return xt_compressed_unit(rw->bs, rw->offset + offset, bytes, rw->qiov,
                              rw->qiov_offset + offset);
}

/*
 * Compressed writes (qemu-img convert -c, rebase -c, backup compress=on):
 * units of s->compress_unit, each one COMPRESSED extent, compressed up to
 * XT_COMPRESS_WORKERS at once, so that both cores compress while
 * qemu-img writes one chunk at a time.  A request that is not
 * block-aligned (except at the end of the disk) is written as it is.
 */
int coroutine_fn GRAPH_RDLOCK
extree_co_pwritev_compressed_part(BlockDriverState *bs, int64_t offset,
                                  int64_t bytes, QEMUIOVector *qiov,
                                  size_t qiov_offset)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t bsz = s->block_size;
    uint64_t vsize = qatomic_read(&s->virtual_size);
    XtCompressRw rw = {
        .bs = bs, .offset = offset, .qiov = qiov, .qiov_offset = qiov_offset,
    };

    if (!bytes) {
        /* qemu-img convert's end of the image: nothing is buffered */
        return 0;
    }
    if (s->crypto) {
        error_report_once("extree: compressed writes are not supported on "
                          "encrypted images");
        return -ENOTSUP;
    }
    if (!QEMU_IS_ALIGNED(offset, bsz) ||
        (!QEMU_IS_ALIGNED(bytes, bsz) && offset + bytes != vsize)) {
        return xt_pwritev(bs, offset, bytes, qiov, qiov_offset, false);
    }
    return xt_run_pieces(bytes, s->compress_unit, XT_COMPRESS_WORKERS,
                         xt_compress_rw_unit, &rw);
}

int coroutine_fn GRAPH_RDLOCK extree_co_flush_to_os(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    if (s->inactive) {
        return 0;
    }
    ret = xt_enter(s);
    if (ret == 0) {
        ret = xt_commit_locked(s);
        if (ret == 0 && extree_changes_lost(s->t)) {
            /*
             * A rollback (out of space, xt_commit_locked()) dropped
             * writes that may have been acknowledged: no flush succeeds
             * until the image is opened again, as with a failed fsync
             */
            ret = -EIO;
        }
        xt_leave(s);
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
xt_update_range(BDRVExtreeState *s, uint64_t start, uint64_t end,
                ExtreeRangeOp op)
{
    int ret;

    assert(QEMU_IS_ALIGNED(start | end, s->block_size) && start < end);
    trace_extree_update_range(s, start, end, op);
    for (;;) {
        ret = xt_settle_range(s, start, end);
        if (ret < 0) {
            return ret;
        }
        /* nothing below drops the lock: the count is not needed */
        xt_io_end(s);
        xt_grow_before_nodes(s, 0);
        if (op == EXTREE_OP_ZERO) {
            ret = extree_set_zero(s->t, start, end - start);
        } else {
            ret = extree_punch(s->t, start, end - start);
        }
        /*
         * On storage of fixed size the core stops between two leaves when
         * the room for nodes runs short (docs/devel/extree.rst, "Running
         * out of space"): commit what the transaction did, which makes
         * the space it freed reusable, and go on with the same range
         * (punch and zero are idempotent).  A call that changed nothing
         * leaves the transaction clean after the commit: the storage is
         * full.  The commit drops the lock: look for allocating writes
         * into the range again.
         */
        if (ret != -ENOSPC || !extree_is_dirty(s->t) ||
            xt_commit_locked(s) < 0) {
            return ret;
        }
    }
}

/*
 * Discard whole blocks (partial blocks are ignored, except the partial
 * block at the end of the disk when the request reaches the end).  The
 * range becomes unallocated, or, when a backing file would show through,
 * a ZERO extent (like qcow2); its space is freed.
 */
int coroutine_fn GRAPH_RDLOCK
extree_co_pdiscard(BlockDriverState *bs, int64_t offset, int64_t bytes)
{
    BDRVExtreeState *s = bs->opaque;
    uint64_t bsz = s->block_size;
    uint64_t start, end;
    int ret;

    trace_extree_co_pdiscard_start(s, offset, bytes);
    ret = xt_enter(s);
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
        ret = xt_update_range(s, start, end, bs->backing ?
                              EXTREE_OP_ZERO : EXTREE_OP_PUNCH);
        xt_update_done(s);
    }
    xt_leave(s);
    trace_extree_co_pdiscard_done(s, offset, ret);
    return ret;
}

/*
 * Zero part of one block: guest [offset, offset + bytes) within a single
 * block, not the whole of it.  DATA: zero in place in the host file.
 * ZERO: nothing to do.  Unallocated without a backing file: the block
 * reads as zeroes, make it a ZERO extent.  Unallocated with one, or DATA a
 * snapshot shares (never written in place), or any DATA of an encrypted
 * image: write a buffer of zeroes (read-modify-write of the block into new
 * space, or encrypted), unless the caller forbids that fallback.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_zero_partial(BDRVExtreeState *s, uint64_t offset, uint64_t bytes,
                BdrvRequestFlags flags)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    uint64_t bstart = QEMU_ALIGN_DOWN(offset, bsz);
    bool in_place = false;
    QEMUIOVector qiov;
    ExtreeCursor cur;
    ExtreeRun run;
    void *buf;
    int ret;

    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    for (;;) {
        xt_io_begin(s);
        extree_cursor_init(&cur, s->t);
        ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                                  &run);
        extree_cursor_release(&cur);
        if (ret < 0 || run.type != EXTREE_RUN_UNALLOC ||
            !xt_find_alloc(s, bstart, bstart + bsz)) {
            break;
        }
        /* The block is being allocated: wait and look again */
        xt_io_end(s);
        xt_wait_alloc(s, bstart, bstart + bsz);
    }
    if (ret < 0) {
        xt_io_end(s);
        goto out;
    }

    ret = extree_in_place(s->t, &run, bstart, bsz, &in_place);
    if (ret < 0) {
        xt_io_end(s);
        goto out;
    }

    switch (run.type) {
    case EXTREE_RUN_COMPRESSED:
        /* never in place: rewritten with the zeroes (xt_inflate()) */
        xt_io_end(s);
        if (flags & BDRV_REQ_NO_FALLBACK) {
            ret = -ENOTSUP;
            break;
        }
        goto write_buffer;
    case EXTREE_RUN_DATA:
        if (!in_place || s->crypto) {
            /*
             * A snapshot shares the block: a buffer of zeroes to new space.
             * Encrypted: zeroes on the host would decrypt to garbage, the
             * buffer is written encrypted (in place if unshared).
             */
            xt_io_end(s);
            if (flags & BDRV_REQ_NO_FALLBACK) {
                ret = -ENOTSUP;
                break;
            }
            goto write_buffer;
        }
        /* in place: marked before the zeroes are issued, as a write */
        extree_bitmaps_mark(s->t, offset, bytes);
        qemu_co_mutex_unlock(&s->lock);
        ret = bdrv_co_pwrite_zeroes(bs->file, run.host, bytes,
                                    flags & BDRV_REQ_NO_FALLBACK);
        xt_lock(s);
        xt_io_end(s);
        break;
    case EXTREE_RUN_ZERO:
        xt_io_end(s);
        break;
    case EXTREE_RUN_UNALLOC:
        xt_io_end(s);
        if (!bs->backing) {
            ret = xt_update_range(s, bstart, bstart + bsz,
                                  EXTREE_OP_ZERO);
            xt_update_done(s);
        } else if (flags & BDRV_REQ_NO_FALLBACK) {
            ret = -ENOTSUP;
        } else {
            goto write_buffer;
        }
        break;
    }
out:
    xt_leave(s);
    return ret;

write_buffer:
    xt_leave(s);
    buf = qemu_blockalign0(bs, bytes);
    qemu_iovec_init_buf(&qiov, buf, bytes);
    ret = xt_pwritev(bs, offset, bytes, &qiov, 0, false);
    qemu_vfree(buf);
    return ret;
}

/*
 * Zero whole blocks [start, end) (end may be the rounded-up end of the
 * disk).  With BDRV_REQ_MAY_UNMAP: one ZERO extent, DATA space freed.
 * Without: DATA keeps its space and is zeroed in place, except DATA a
 * snapshot shares, which becomes a ZERO extent (never written in place),
 * and DATA of an encrypted image (host zeroes are not guest zeroes); the
 * rest becomes ZERO extents.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_zero_blocks(BDRVExtreeState *s, uint64_t start, uint64_t end,
               BdrvRequestFlags flags)
{
    BlockDriverState *bs = s->bs;
    uint64_t bsz = s->block_size;
    ExtreeCursor cur;
    bool in_place;
    int ret;

    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    if (flags & BDRV_REQ_MAY_UNMAP) {
        ret = xt_update_range(s, start, end, EXTREE_OP_ZERO);
        goto out;
    }

    extree_cursor_init(&cur, s->t);
    while (start < end) {
        uint64_t vsize = extree_virtual_size(s->t);
        ExtreeRun run;

        if (start >= vsize) {
            break;
        }
        xt_io_begin(s);
        ret = extree_cursor_query(&cur, start, MIN(end, vsize) - start,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            xt_io_end(s);
            break;
        }
        ret = extree_in_place(s->t, &run, start, ROUND_UP(run.length, bsz),
                          &in_place);
        if (ret < 0) {
            xt_io_end(s);
            break;
        }
        if ((run.type == EXTREE_RUN_DATA && (!in_place || s->crypto)) ||
            run.type == EXTREE_RUN_COMPRESSED) {
            /*
             * A snapshot shares it: not in place, a ZERO extent instead.
             * Encrypted: zeroes on the host would not read as zeroes.
             * Compressed: never in place (xt_update_range() rewrites a
             * part of one first).
             */
            xt_io_end(s);
            ret = xt_update_range(s, start, ROUND_UP(start + run.length, bsz),
                                  EXTREE_OP_ZERO);
        } else if (run.type == EXTREE_RUN_DATA) {
            /* in place: marked before the zeroes are issued, as a write */
            extree_bitmaps_mark(s->t, start, ROUND_UP(run.length, bsz));
            qemu_co_mutex_unlock(&s->lock);
            ret = bdrv_co_pwrite_zeroes(bs->file, run.host,
                                        ROUND_UP(run.length, bsz),
                                        flags & BDRV_REQ_NO_FALLBACK);
            xt_lock(s);
            xt_io_end(s);
        } else {
            xt_io_end(s);
            if (run.type == EXTREE_RUN_UNALLOC) {
                ret = xt_update_range(s, start,
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
    xt_update_done(s);
    xt_leave(s);
    return ret;
}

int coroutine_fn GRAPH_RDLOCK
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
            ret = xt_zero_blocks(s, pos, aend, flags);
            pos = MIN(aend, end);
        } else {
            uint64_t n = MIN(end, QEMU_ALIGN_DOWN(pos, bsz) + bsz) - pos;
            ret = xt_zero_partial(s, pos, n, flags);
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
 * falloc allocates, full writes zeroes; on an encrypted image every mode
 * writes encrypted zeroes), map as DATA.
 * Called with s->lock held; the I/O is done with it held (truncate is
 * rare, and nothing else may allocate meanwhile).
 */
static int coroutine_fn GRAPH_RDLOCK
xt_preallocate(BDRVExtreeState *s, uint64_t start, uint64_t end,
               PreallocMode mode, Error **errp)
{
    BlockDriverState *bs = s->bs;
    int64_t file_len;
    uint64_t max_end = 0, first = start, need;
    int ret = 0;

    /*
     * On storage of fixed size (a block device, an NBD export), refuse
     * before anything is allocated when the data cannot fit: growing
     * tells the core where the storage ends
     */
    xt_grow_before(s, end - start);
    file_len = bdrv_co_getlength(bs->file->bs);
    if (file_len < 0) {
        error_setg_errno(errp, -file_len, "Could not get the file length");
        return file_len;
    }
    need = extree_grow_bound(s->t, end - start) - extree_free_bytes(s->t);
    if (s->grow_off && need > (uint64_t)file_len) {
        error_setg(errp, "Preallocating %" PRIu64 " bytes needs about %"
                   PRIu64 " bytes of storage, which holds %" PRId64,
                   end - start, need, file_len);
        return -ENOSPC;
    }
    while (start < end) {
        uint64_t host, got, zlen;

        ret = extree_alloc_data(s->t, start, end - start, &host, &got);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not allocate space");
            goto undo;
        }
        zlen = host < (uint64_t)file_len ? MIN(got, file_len - host) : 0;
        if (s->crypto) {
            /* host zeroes would decrypt to garbage: every mode is full */
            ret = xt_crypt_write(s, host, start, got, NULL, 0);
        } else if (zlen && mode == PREALLOC_MODE_FULL) {
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
            goto undo;
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
        if (ret < 0) {
            goto undo;
        }
    }
    return 0;

undo:
    /* What this call mapped goes again: no later commit may keep it */
    if (start > first) {
        extree_punch(s->t, first, start - first);
    }
    return ret;
}

int coroutine_fn GRAPH_RDLOCK
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

    ret = xt_enter(s);
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
        /*
         * The cut-off blocks first, so that on full storage of fixed size
         * they go in pieces with commits in between (xt_update_range())
         */
        if (ROUND_UP(offset, bsz) < ROUND_UP(old, bsz)) {
            ret = xt_update_range(s, ROUND_UP(offset, bsz),
                                  ROUND_UP(old, bsz), EXTREE_OP_PUNCH);
        }
        if (ret == 0) {
            xt_wait_alloc(s, QEMU_ALIGN_DOWN(offset, bsz), UINT64_MAX);
            ret = extree_set_virtual_size(s->t, offset);
        }
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not shrink the image");
            goto out;
        }
        qatomic_set(&s->virtual_size, offset);
    } else if (offset > old) {
        ret = extree_set_virtual_size(s->t, offset);
        if (ret == -EFBIG && extree_last_error(s->t)) {
            /* a bitmap would grow past what we hold in memory */
            error_setg(errp, "Could not grow the image: %s",
                       extree_last_error(s->t));
            goto out;
        } else if (ret < 0) {
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
            bool in_place = false;

            extree_cursor_init(&cur, s->t);
            ret = extree_cursor_query(&cur, old, len, EXTREE_COALESCE_HOST,
                                      &run);
            extree_cursor_release(&cur);
            if (ret == 0) {
                ret = extree_in_place(s->t, &run, QEMU_ALIGN_DOWN(old, bsz), bsz,
                                  &in_place);
            }
            if (ret == 0 && in_place && !s->crypto) {
                ret = bdrv_co_pwrite_zeroes(bs->file, run.host, len, 0);
            } else if (ret == 0 && (run.type == EXTREE_RUN_DATA ||
                                    run.type == EXTREE_RUN_COMPRESSED ||
                                    (run.type == EXTREE_RUN_UNALLOC &&
                                     (flags & BDRV_REQ_ZERO_WRITE)))) {
                /*
                 * shared with a snapshot, encrypted, or compressed (the
                 * unit is inflated): a buffer
                 */
                QEMUIOVector qiov;
                void *buf = qemu_blockalign0(bs, len);

                xt_unlock(s);
                qemu_iovec_init_buf(&qiov, buf, len);
                ret = xt_pwritev(bs, old, len, &qiov, 0, true);
                qemu_vfree(buf);
                xt_lock(s);
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
                ret = xt_preallocate(s, astart, aend, prealloc, errp);
                if (ret < 0) {
                    /* it mapped nothing that stays: the old size again */
                    extree_set_virtual_size(s->t, old);
                    qatomic_set(&s->virtual_size, old);
                }
            } else if (flags & BDRV_REQ_ZERO_WRITE) {
                ret = xt_update_range(s, astart, aend, EXTREE_OP_ZERO);
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

    /*
     * What grew in reads as zeroes where it may have held data before a
     * shrink: changed.  The core marked it (extree_set_virtual_size());
     * QEMU's bitmaps take the new size now, as the block layer would after
     * this returns (a no-op then), so that they can have it marked too.
     */
    if (offset > old) {
        bdrv_dirty_bitmap_truncate(bs, offset);
        bdrv_set_dirty(bs, old, offset - old);
    }

    /* Rare and administrative: make the new size durable right away */
    ret = xt_commit_locked(s);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not commit extree metadata");
    }
out:
    xt_leave(s);
    trace_extree_co_truncate_done(s, offset, ret);
    return ret;
}

int64_t coroutine_fn GRAPH_RDLOCK
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
int coroutine_fn GRAPH_RDLOCK
xt_make_empty_locked(BDRVExtreeState *s)
{
    uint64_t end = ROUND_UP(extree_virtual_size(s->t), s->block_size);
    int ret;

    if (s->core_read_only) {
        return -EACCES;
    }
    if (!end) {
        return 0;
    }
    ret = xt_update_range(s, 0, end, EXTREE_OP_PUNCH);
    if (ret == 0) {
        ret = xt_commit_locked(s);
    }
    return ret;
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
int coroutine_fn GRAPH_RDLOCK
extree_co_block_status(BlockDriverState *bs, bool want_zero, int64_t offset,
                       int64_t bytes, int64_t *pnum, int64_t *map,
                       BlockDriverState **file)
{
    BDRVExtreeState *s = bs->opaque;
    ExtreeRun run;
    int ret;

    ret = xt_enter(s);
    if (ret < 0) {
        return ret;
    }
    if (offset >= extree_virtual_size(s->t)) {
        /* a guard: the node has the tree's size (load_tmp too) */
        xt_leave(s);
        *pnum = bytes;
        return 0;
    }
    ret = xt_query(s, &s->status_cursor, offset, bytes,
                   want_zero ? EXTREE_COALESCE_STATUS : EXTREE_COALESCE_ALLOC,
                   &run);
    xt_leave(s);
    if (ret < 0) {
        return ret;
    }
    trace_extree_co_block_status(s, want_zero, offset, bytes, run.type,
                                 run.length, run.host);

    *pnum = run.length;
    switch (run.type) {
    case EXTREE_RUN_DATA:
        if (!want_zero || s->crypto) {
            /* the host bytes of an encrypted image are not the data */
            return BDRV_BLOCK_DATA;
        }
        *map = run.host;
        *file = bs->file->bs;
        return BDRV_BLOCK_DATA | BDRV_BLOCK_OFFSET_VALID;
    case EXTREE_RUN_ZERO:
        /* Allocated in this layer; !want_zero may span DATA too */
        return want_zero ? BDRV_BLOCK_ZERO : BDRV_BLOCK_DATA;
    case EXTREE_RUN_COMPRESSED:
        /* adjacent compressed extents in one answer (no host offsets) */
        return want_zero ? BDRV_BLOCK_DATA | BDRV_BLOCK_COMPRESSED
                         : BDRV_BLOCK_DATA;
    default:
        return 0;
    }
}

/* ---- Calls from the main loop ---- */

/*
 * Run @fn in a coroutine with s->lock held, from outside coroutine context
 * (main loop), and wait for it: for the callbacks that are not drained, so
 * that requests and the commit timer may be running.
 */
typedef struct ExtreeCallCo {
    BlockDriverState *bs;
    ExtreeLockedFn *fn;
    ExtreeLockedOpFn *op_fn;            /* instead of @fn, with @opaque */
    void *opaque;
    int ret;
} ExtreeCallCo;

static void coroutine_fn xt_call_entry(void *opaque)
{
    ExtreeCallCo *c = opaque;
    BDRVExtreeState *s = c->bs->opaque;
    int ret;

    GRAPH_RDLOCK_GUARD();

    ret = xt_enter(s);
    if (ret == 0) {
        ret = c->fn ? c->fn(s) : c->op_fn(s, c->opaque);
        xt_leave(s);
    }
    c->ret = ret;
    aio_wait_kick();
}

static int GRAPH_RDLOCK xt_call(ExtreeCallCo *c)
{
    assert(!qemu_in_coroutine());
    c->ret = -EINPROGRESS;
    aio_co_enter(bdrv_get_aio_context(c->bs),
                 qemu_coroutine_create(xt_call_entry, c));
    BDRV_POLL_WHILE(c->bs, c->ret == -EINPROGRESS);
    return c->ret;
}

int GRAPH_RDLOCK xt_call_locked(BlockDriverState *bs, ExtreeLockedFn *fn)
{
    ExtreeCallCo c = { .bs = bs, .fn = fn };

    return xt_call(&c);
}

/* xt_call_locked() for a function that takes an argument */
int GRAPH_RDLOCK xt_call_locked_op(BlockDriverState *bs,
                                   ExtreeLockedOpFn *fn, void *opaque)
{
    ExtreeCallCo c = { .bs = bs, .op_fn = fn, .opaque = opaque };

    return xt_call(&c);
}
