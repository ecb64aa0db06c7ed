/*
 * extree: QEMU driver, writes
 *
 * Writes in place where the core allows it (extree_in_place(); marked
 * before the data goes out), else to new space with the rest of their
 * first and last block (read-modify-write), then mapped; compressed
 * units inflated when written to; flush.
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
 * Make the marks of guest [@start, + @len) durable through the mark log
 * (spec: Mark log), with those of every write that waits meanwhile in one
 * record and one flush (group commit): the first waiter to find no record
 * being written writes one for all of them.  Called with s->lock held and
 * the request counted (xt_io_begin(): no commit runs between a record and
 * the writes it lets go in place); may drop and retake s->lock.  Returns
 * once the record that took the range is durable or failed: the caller
 * looks the range up again and writes in place only where the core now
 * allows it.
 */
static void coroutine_fn GRAPH_RDLOCK
xt_mark_log(BDRVExtreeState *s, uint64_t start, uint64_t len)
{
    uint64_t gran = extree_mark_log_granule(s->t);
    uint64_t batch;

    if (gran) {
        /* as the record will: writes to one granule share a range */
        uint64_t end = ROUND_UP(start + len, gran);

        start = QEMU_ALIGN_DOWN(start, gran);
        len = end - start;
    }
    for (unsigned i = 0; i < s->mark_npending; i++) {
        ExtreeMarkRange *p = &s->mark_pending[i];

        if (start >= p->start && start + len <= p->start + p->len) {
            /* the next record holds it already: wait for that one */
            goto queued;
        }
    }
    while (s->mark_npending == EXTREE_MARK_LOG_RANGES) {
        xt_queue_wait(s, &s->mark_queue);
    }
    s->mark_pending[s->mark_npending++] = (ExtreeMarkRange){ start, len };
queued:
    batch = s->mark_batch;
    while (s->mark_done < batch) {
        ExtreeMarkRange r[EXTREE_MARK_LOG_RANGES];
        uint64_t mine, off;
        uint8_t *rec;
        unsigned n;
        int ret;

        if (s->mark_busy) {
            xt_queue_wait(s, &s->mark_queue);
            continue;
        }
        s->mark_busy = true;
        n = s->mark_npending;
        memcpy(r, s->mark_pending, n * sizeof(r[0]));
        s->mark_npending = 0;
        mine = s->mark_batch++;
        ret = extree_mark_log_append(s->t, r, n, &rec, &off);
        if (ret == 0) {
            /*
             * Durable before the writes it lets go in place are issued: a
             * write, then a flush once it has completed.  Not a FUA write:
             * where FUA is emulated (file-posix with aio=threads, filters
             * such as blklogwrites) the flush runs before the write counts
             * in the node's write generation, and is skipped when nothing
             * else was written since the last flush.  Aligned, so that
             * O_DIRECT takes it.
             */
            void *buf = qemu_blockalign(s->bs->file->bs,
                                        EXTREE_MARK_LOG_RECORD);

            memcpy(buf, rec, EXTREE_MARK_LOG_RECORD);
            g_free(rec);
            qemu_co_mutex_unlock(&s->lock);
            ret = bdrv_co_pwrite(s->bs->file, off, EXTREE_MARK_LOG_RECORD,
                                 buf, 0);
            if (ret == 0) {
                ret = bdrv_co_flush(s->bs->file->bs);
            }
            xt_lock(s);
            qemu_vfree(buf);
            if (ret == 0) {
                extree_mark_log_durable(s->t, r, n);
            }
        }
        trace_extree_mark_log(s, mine, n, ret);
        s->mark_done = mine;
        s->mark_busy = false;
        qemu_co_queue_restart_all(&s->mark_queue);
    }
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
    uint8_t *head_buf = NULL, *tail_buf = NULL, *whole_buf = NULL;
    BlockReq req;
    QEMUIOVector hd_qiov;
    uint32_t csum = 0;
    bool logged;
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
    xt_alloc_begin(s, &req, start, pend);
    /* its mapping may go into a map record instead of a commit */
    logged = extree_map_log_usable(s->t);
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
    if (ret == 0 && (s->crypto || logged)) {
        /*
         * The whole of the new blocks in one buffer: encrypted at their
         * guest offset; for a map record, a copy, so that the checksum is
         * of what is written even if the guest changes its buffer while
         * the write is in flight (a replay would end the chain there)
         */
        whole_buf = qemu_try_blockalign(bs->file->bs, got);
        ret = whole_buf ? 0 : -ENOMEM;
        if (ret == 0) {
            qemu_iovec_to_buf(&hd_qiov, 0, whole_buf, got);
        }
        if (ret == 0 && s->crypto) {
            ret = xt_crypt(s, true, start, whole_buf, got);
        }
        if (ret == 0) {
            qemu_iovec_reset(&hd_qiov);
            qemu_iovec_add(&hd_qiov, whole_buf, got);
        }
        if (ret == 0 && logged) {
            /* the record's checksum of the host bytes: a replay checks it */
            csum = extree_crc32c(0, whole_buf, got);
        }
    }
    if (ret == 0) {
        BLKDBG_CO_EVENT(bs->file, BLKDBG_WRITE_AIO);
        ret = bdrv_co_pwritev(bs->file, host, got, &hd_qiov, 0);
    }
    qemu_iovec_destroy(&hd_qiov);
    qemu_vfree(head_buf);
    qemu_vfree(tail_buf);
    qemu_vfree(whole_buf);

    xt_lock(s);
    if (ret == 0 && logged) {
        /* The data is written: now the mapping may reach a record */
        ret = extree_map_data_logged(s->t, start, got, host, csum);
    } else if (ret == 0) {
        /* The data is written: now the mapping may reach a commit */
        ret = extree_map_data(s->t, start, got, host);
    }
    if (ret < 0) {
        extree_free_data(s->t, host, got);
    }
    xt_alloc_done(&req);
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
int coroutine_fn GRAPH_RDLOCK
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
    BlockReq req;
    uint8_t *buf;
    int ret;

    assert(run->type == EXTREE_RUN_COMPRESSED && !s->crypto);
    if (xt_find_alloc(s, cstart, cend)) {
        xt_io_end(s);
        xt_wait_alloc(s, cstart, cend);
        return -EAGAIN;
    }
    wlen = qiov ? MIN(offset + n, cend) - offset : 0;
    xt_alloc_begin(s, &req, cstart, cend);
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
    xt_alloc_done(&req);
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
int coroutine_fn GRAPH_RDLOCK
xt_settle_range(BDRVExtreeState *s, uint64_t start, uint64_t end)
{
    for (;;) {
        int ret;

        xt_wait_deferred(s, start, end);
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

/* ---- Deferred writes ---- */

/*
 * A write in place that waits only for its mark log record is
 * acknowledged at once and written by a coroutine of its own (deferred):
 * the records' group commit then takes every write that arrives during a
 * record's flush, not only the guest's queue depth, and the guest does
 * not wait for the flush.  The spec's order holds: the data still goes
 * out only once its record is durable.  What a crash loses is at most
 * such acknowledged writes that no flush covered, which a crash may lose
 * anyway; a flush waits for them (xt_co_flush_to_os()).  Bounded:
 */
#define XT_DEFER_MAX_WRITE      (256 * KiB)     /* larger ones wait */
/*
 * and only while the guest is not flushing after nearly every write: its
 * next flush waits for the record anyway, and acknowledging early only
 * lets it queue more flushes behind the same record, so each record took
 * fewer writes (fio's --fsync=16 job sends about one flush a write:
 * 7,868 IOPS deferring, 10,352 not, alternating, 3 rounds, medians)
 */
#define XT_DEFER_QUIET_WRITES   16
#define XT_DEFER_MAX_BYTES      (16 * MiB)      /* data held at once */
/* writes held at once: two records' worth (one written, one filling) */
#define XT_DEFER_MAX_COUNT      (2 * EXTREE_MARK_LOG_RANGES)

typedef struct XtDeferredWrite {
    BlockReq req;               /* in s->deferred_reqs until written */
    BDRVExtreeState *s;
    uint64_t seq;
    void *buf;
} XtDeferredWrite;

/* xt_pwritev_flags() */
enum {
    XT_WRITE_NESTED = 1,        /* see xt_enter_nested() */
    XT_WRITE_DEFERRED = 2,      /* a deferred write's own: not deferred */
};

static int coroutine_fn GRAPH_RDLOCK
xt_pwritev_flags(BlockDriverState *bs, int64_t offset, int64_t bytes,
                 QEMUIOVector *qiov, size_t qiov_offset, unsigned flags);

/*
 * Wait until every deferred write numbered up to @upto is written.
 * Called with s->lock held; drops it while waiting.
 */
static void coroutine_fn xt_wait_deferred_upto(BDRVExtreeState *s,
                                               uint64_t upto)
{
    for (;;) {
        BlockReq *req;
        bool older = false;

        QLIST_FOREACH(req, &s->deferred_reqs, list) {
            XtDeferredWrite *dw = container_of(req, XtDeferredWrite, req);

            if (dw->seq <= upto) {
                older = true;
                break;
            }
        }
        if (!older) {
            return;
        }
        xt_queue_wait(s, &s->deferred_queue);
    }
}

/* The coroutine that writes a deferred write; see xt_defer_write() */
static void coroutine_fn xt_deferred_write_entry(void *opaque)
{
    XtDeferredWrite *dw = opaque;
    BDRVExtreeState *s = dw->s;
    BlockDriverState *bs = s->bs;
    QEMUIOVector qiov;
    int ret;

    qemu_iovec_init_buf(&qiov, dw->buf, dw->req.bytes);
    WITH_GRAPH_RDLOCK_GUARD() {
        ret = xt_pwritev_flags(bs, dw->req.offset, dw->req.bytes, &qiov, 0,
                               XT_WRITE_DEFERRED);
    }
    qemu_co_mutex_lock(&s->lock);
    trace_extree_deferred_write_done(s, dw->seq, dw->req.offset, ret);
    if (ret < 0 && !s->deferred_err) {
        error_report("extree: %s: an acknowledged write to guest offset "
                     "0x%" PRIx64 " failed (%s); every flush fails from "
                     "now on", bdrv_get_device_or_node_name(bs),
                     (uint64_t)dw->req.offset, strerror(-ret));
        s->deferred_err = ret;
    }
    s->deferred_count--;
    s->deferred_bytes -= dw->req.bytes;
    reqlist_remove_req(&dw->req);
    qemu_co_queue_restart_all(&s->deferred_queue);
    qemu_co_mutex_unlock(&s->lock);
    qemu_vfree(dw->buf);
    g_free(dw);
    bdrv_dec_in_flight(bs);
}

/*
 * Take guest [@offset, + @bytes) from @qiov at @qiov_offset as a deferred
 * write, if the bounds allow: true if it did (the caller's request is
 * done).  The caller found that the write goes in place once a mark log
 * record holds its marks.  Called with s->lock held.
 */
static bool coroutine_fn xt_defer_write(BDRVExtreeState *s, uint64_t offset,
                                        uint64_t bytes, QEMUIOVector *qiov,
                                        size_t qiov_offset)
{
    XtDeferredWrite *dw;
    Coroutine *co;
    void *buf;

    if (bytes > XT_DEFER_MAX_WRITE ||
        s->writes_since_flush < XT_DEFER_QUIET_WRITES ||
        s->deferred_count >= XT_DEFER_MAX_COUNT ||
        s->deferred_bytes + bytes > XT_DEFER_MAX_BYTES ||
        /* came while this one looked up: they were concurrent */
        reqlist_find_conflict(&s->deferred_reqs, offset, bytes)) {
        return false;
    }
    buf = qemu_try_blockalign(s->bs->file->bs, bytes);
    if (!buf) {
        return false;
    }
    qemu_iovec_to_buf(qiov, qiov_offset, buf, bytes);
    dw = g_new0(XtDeferredWrite, 1);
    dw->s = s;
    dw->buf = buf;
    dw->seq = ++s->deferred_seq;
    reqlist_init_req(&s->deferred_reqs, &dw->req, offset, bytes);
    s->deferred_count++;
    s->deferred_bytes += bytes;
    trace_extree_deferred_write(s, dw->seq, offset, bytes);
    /* entered once this coroutine yields; a drain waits for it */
    bdrv_inc_in_flight(s->bs);
    co = qemu_coroutine_create(xt_deferred_write_entry, dw);
    aio_co_enter(bdrv_get_aio_context(s->bs), co);
    return true;
}

static int coroutine_fn GRAPH_RDLOCK
xt_pwritev_flags(BlockDriverState *bs, int64_t offset, int64_t bytes,
                 QEMUIOVector *qiov, size_t qiov_offset, unsigned flags)
{
    BDRVExtreeState *s = bs->opaque;
    bool committed = false, in_place, logged;
    bool first = true;
    ExtreeCursor cur;
    int ret = 0;

    trace_extree_co_pwritev_start(s, offset, bytes);
    ret = xt_enter_nested(s, flags & XT_WRITE_NESTED);
    logged = false;
    if (ret < 0) {
        return ret;
    }
    if (!flags && s->writes_since_flush < XT_DEFER_QUIET_WRITES) {
        s->writes_since_flush++;
    }
    if (!(flags & XT_WRITE_DEFERRED)) {
        /* an acknowledged write to the range goes first */
        xt_wait_deferred(s, offset, offset + bytes);
    }
    extree_cursor_init(&cur, s->t);
    while (bytes > 0) {
        ExtreeRun run;
        uint64_t n;

        xt_io_begin(s);
        /* a node missing from the cache is read without the lock */
        ret = xt_query(s, &cur, offset, bytes, EXTREE_COALESCE_HOST, &run);
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
        if (!in_place && !logged && run.type == EXTREE_RUN_DATA) {
            uint64_t bsz = s->block_size;
            uint64_t start = QEMU_ALIGN_DOWN(offset, bsz);
            uint64_t end = ROUND_UP(offset + n, bsz);

            if (extree_mark_log_wanted(s->t, &run, start, end - start)) {
                if (first && !flags && n == bytes &&
                    xt_defer_write(s, offset, n, qiov, qiov_offset)) {
                    xt_io_end(s);
                    offset += n;
                    bytes = 0;
                    break;
                }
                /*
                 * Only the bitmaps' committed marks keep it out of place:
                 * make them durable with a record, then look again (the
                 * lock was dropped).  Once a request, so that a record
                 * that did not help leaves it to the allocating path.
                 */
                xt_mark_log(s, start, end - start);
                logged = true;
                xt_io_end(s);
                continue;
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
        logged = false;
        first = false;
    }
    extree_cursor_release(&cur);
    xt_update_done(s);
    xt_leave(s);
    trace_extree_co_pwritev_done(s, offset, ret);
    return ret < 0 ? ret : 0;
}

/* @nested: see xt_enter_nested() */
int coroutine_fn GRAPH_RDLOCK
xt_pwritev(BlockDriverState *bs, int64_t offset, int64_t bytes,
           QEMUIOVector *qiov, size_t qiov_offset, bool nested)
{
    return xt_pwritev_flags(bs, offset, bytes, qiov, qiov_offset,
                            nested ? XT_WRITE_NESTED : 0);
}

int coroutine_fn GRAPH_RDLOCK
xt_co_pwritev_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                   QEMUIOVector *qiov, size_t qiov_offset,
                   BdrvRequestFlags flags)
{
    return xt_pwritev(bs, offset, bytes, qiov, qiov_offset, false);
}

/* ---- Flush ---- */

int coroutine_fn GRAPH_RDLOCK xt_co_flush_to_os(BlockDriverState *bs)
{
    BDRVExtreeState *s = bs->opaque;
    int ret;

    if (s->inactive) {
        return 0;
    }
    ret = xt_enter(s);
    if (ret == 0) {
        /* the writes acknowledged before this flush are written first */
        s->writes_since_flush = 0;
        xt_wait_deferred_upto(s, s->deferred_seq);
        ret = s->deferred_err;
        if (ret == 0) {
            /* a commit, or map records where they hold every change */
            ret = xt_commit_or_log(s, true);
        }
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
