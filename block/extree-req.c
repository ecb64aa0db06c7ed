/*
 * extree: QEMU driver, requests, the commit gate and commits
 *
 * Every request takes s->lock (xt_enter()) and counts itself between its
 * lookup and the end of its data I/O (xt_io_begin(), xt_io_end()); a
 * commit closes the gate, waits until none is counted and commits
 * (xt_commit_locked()).  Allocating writes hold their host ranges in
 * s->allocs, and others that overlap them wait.  Corruption reported by
 * the core is handled here, and the main loop's calls into coroutines.
 * Every call into the core (extree_*) is made with s->lock held; the data
 * I/O is done without it:
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

/* ---- Core trace points, corruption ---- */

void xt_core_trace(void *opaque, ExtreeTraceEvent ev, uint64_t a, uint64_t b,
                   uint64_t c)
{
    switch (ev) {
    case EXTREE_TRACE_ALLOC_DATA:
        trace_extree_core_alloc_data(opaque, a, b, c);
        break;
    case EXTREE_TRACE_ALLOC_NODE:
        trace_extree_core_alloc_node(opaque, a);
        break;
    case EXTREE_TRACE_FREE:
        trace_extree_core_free(opaque, a, b, c);
        break;
    case EXTREE_TRACE_COMMIT_STEP:
        trace_extree_core_commit_step(opaque, a, b);
        break;
    case EXTREE_TRACE_COMMIT_DONE:
        trace_extree_core_commit_done(opaque, a, (int64_t)c);
        break;
    case EXTREE_TRACE_BITMAP_SYNC:
        trace_extree_core_bitmap_sync(opaque, a, b, c);
        break;
    case EXTREE_TRACE_ROLLBACK:
        trace_extree_core_rollback(opaque, a, (int64_t)c);
        break;
    case EXTREE_TRACE_MARK_LOG:
        trace_extree_core_mark_log(opaque, a, b, c);
        break;
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
void coroutine_mixed_fn xt_handle_corruption(BDRVExtreeState *s)
{
    BlockDriverState *bs = s->bs;
    ExtreeCorruption c;
    const char *node_name;
    int ret;

    if (!s->t ||
        !extree_take_corruption(s->t, !s->core_read_only && !s->inactive,
                                &c)) {
        return;
    }
    trace_extree_corruption(s, c.offset, c.fatal);

    if (!s->signaled_corruption || c.fatal) {
        if (c.fatal) {
            error_report("extree: Marking image as corrupt: %s; further "
                         "corruption events will be suppressed", c.msg);
        } else {
            error_report("extree: Image is corrupt: %s; further non-fatal "
                         "corruption events will be suppressed", c.msg);
        }
        node_name = bdrv_get_node_name(bs);
        qapi_event_send_block_image_corrupted(bdrv_get_device_name(bs),
                                              *node_name ? node_name : NULL,
                                              c.msg, true, c.offset, false, 0,
                                              c.fatal);
        s->signaled_corruption = true;
    }
    if (c.fatal) {
        ret = extree_mark_corrupt(s->t);
        if (ret < 0) {
            error_report("extree: Could not mark the image corrupt: %s",
                         strerror(-ret));
        }
    }
    g_free(c.msg);
}

/* ---- Lock, commit gate, commits ---- */

void coroutine_fn xt_unlock(BDRVExtreeState *s)
{
    if (unlikely(s->t && extree_corruption_pending(s->t))) {
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
int coroutine_fn xt_enter_nested(BDRVExtreeState *s, bool nested)
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
void coroutine_fn xt_io_begin(BDRVExtreeState *s)
{
    while (s->commit_waiting) {
        xt_queue_wait(s, &s->io_queue);
    }
    s->io_inflight++;
}

/* Called with s->lock held */
void coroutine_fn xt_io_end(BDRVExtreeState *s)
{
    assert(s->io_inflight > 0);
    if (--s->io_inflight == 0 && s->commit_waiting) {
        qemu_co_queue_restart_all(&s->commit_queue);
    }
}

/* QEMU's request list counts in int64_t: @end may be UINT64_MAX */
static int64_t xt_req_bytes(uint64_t start, uint64_t end)
{
    return MIN(end, (uint64_t)INT64_MAX) - MIN(start, (uint64_t)INT64_MAX);
}

/* Called with s->lock held */
BlockReq *xt_find_alloc(BDRVExtreeState *s, uint64_t start, uint64_t end)
{
    return reqlist_find_conflict(&s->alloc_reqs, start,
                                 xt_req_bytes(start, end));
}

/* Called with s->lock held */
void xt_alloc_begin(BDRVExtreeState *s, BlockReq *req, uint64_t start,
                    uint64_t end)
{
    reqlist_init_req(&s->alloc_reqs, req, start, xt_req_bytes(start, end));
}

/* Called with s->lock held */
void coroutine_fn xt_alloc_done(BlockReq *req)
{
    reqlist_remove_req(req);
}

/*
 * Wait until no deferred write (extree-write.c) overlaps guest [start,
 * end).  Called with s->lock held; drops it while waiting.
 */
void coroutine_fn xt_wait_deferred(BDRVExtreeState *s, uint64_t start,
                                   uint64_t end)
{
    while (reqlist_wait_one(&s->deferred_reqs, start,
                            xt_req_bytes(start, end), &s->lock)) {
        /* look again: another may have come meanwhile */
    }
}

/*
 * Wait until no allocating write overlaps guest [start, end).  Called with
 * s->lock held; drops it while waiting.  Returns true if it waited (the
 * caller's view of the mapping is stale then).
 */
bool coroutine_fn xt_wait_alloc(BDRVExtreeState *s, uint64_t start,
                                uint64_t end)
{
    bool waited = false;

    while (xt_find_alloc(s, start, end)) {
        trace_extree_alloc_wait(s, start, end);
        reqlist_wait_one(&s->alloc_reqs, start, xt_req_bytes(start, end),
                         &s->lock);
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
    /* a close or inactivation stores what only the mark log holds */
    extree_mark_log_checkpoint(s->t);
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
 * The map records of the entries waiting (spec: Mark log, map records),
 * written with the gate closed: no record write is in flight (a writer of
 * one holds its request counted), so the chain is written in slot order,
 * and no commit runs before the write is done.  The caller's flush of
 * bs->file makes them durable with the data they map.  -ENOSPC: the log
 * has no room, commit instead.  Called with s->lock held; drops it.
 */
static int coroutine_fn GRAPH_RDLOCK xt_map_log_write(BDRVExtreeState *s)
{
    uint64_t off, len;
    uint8_t *rec;
    void *buf;
    int ret = extree_map_log_records(s->t, &rec, &off, &len);

    if (ret < 0 || !len) {
        return ret;
    }
    buf = qemu_blockalign(s->bs->file->bs, len);
    memcpy(buf, rec, len);
    g_free(rec);
    qemu_co_mutex_unlock(&s->lock);
    ret = bdrv_co_pwrite(s->bs->file, off, len, buf, 0);
    xt_lock(s);
    qemu_vfree(buf);
    if (ret < 0) {
        extree_map_log_failed(s->t);
    }
    trace_extree_map_log_write(s, off, len, ret);
    return ret;
}

/*
 * Commit the transaction: waits until no request is between its lookup and
 * the end of its data I/O, holding new ones back meanwhile.  @may_log (a
 * flush): if map records hold every change since the last commit, write
 * the waiting ones instead.  Called with s->lock held; may drop and
 * retake it.
 */
int coroutine_fn GRAPH_RDLOCK xt_commit_locked(BDRVExtreeState *s)
{
    return xt_commit_or_log(s, false);
}

int coroutine_fn GRAPH_RDLOCK xt_commit_or_log(BDRVExtreeState *s,
                                               bool may_log)
{
    bool bitmaps;
    int ret = 0, rollback;

    if (s->core_read_only) {
        return 0;
    }
    bitmaps = xt_bitmaps_any(s);
    if (!extree_is_dirty(s->t) &&
        (!bitmaps || (may_log && !xt_bitmaps_sync_needed(s)))) {
        /*
         * Nothing to store, and a flush need not give the core bits it
         * has (a sync without changes): no gate.  Closing it made every
         * flush wait for every request in flight and hold back new ones,
         * so concurrent flushes and mark records could not be batched
         */
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
    if (may_log && extree_map_log_sync_wanted(s->t)) {
        ret = xt_map_log_write(s);
        if (ret != -ENOSPC) {
            goto out;
        }
    } else if (may_log) {
        extree_map_log_flush_commit(s->t);
    }
    /* the free-space tree's nodes are allocated now */
    xt_grow_before_nodes(s, 0);
    /* no request holds a range of the transaction: the gate is closed */
    ret = extree_commit_or_roll_back(s->t, &rollback);
    if (rollback) {
        error_report("extree: %s: no space left for metadata; changes "
                     "since the last commit are lost%s",
                     bdrv_get_device_or_node_name(s->bs),
                     rollback < 0 ? ", and the image must be opened again" :
                     "");
    }
    if (rollback > 0) {
        s->file_len = -1;
        qatomic_set(&s->virtual_size, extree_virtual_size(s->t));
        extree_cursor_release(&s->status_cursor);
        extree_cursor_init(&s->status_cursor, s->t);
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
    /* before the gate: a deferred write passes it to be written */
    xt_wait_deferred(s, 0, UINT64_MAX);
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
    if (s->core_read_only) {
        return;
    }
    if (extree_mark_log_checkpoint_wanted(s->t)) {
        /* half the mark log is used: store its marks, start a new one */
        extree_mark_log_checkpoint(s->t);
        xt_commit_locked(s);
        return;
    }
    if (!extree_is_dirty(s->t) && !extree_mark_log_pending(s->t)) {
        return;
    }
    if (extree_is_dirty(s->t) && extree_commit_wanted(s->t)) {
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
