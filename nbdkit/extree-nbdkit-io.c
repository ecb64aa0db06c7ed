/*
 * extree nbdkit plugin: requests, xp.lock and the commit gate, commits
 *
 * Every call into the core is made with xp.lock held (the core is not
 * thread-safe); data I/O mostly without it:
 *
 *   read              lock: look up runs (node reads without the lock,
 *                     through the core's no-wait queries) -> unlock: pread
 *   write in place    lock: look up, unshared DATA -> unlock: pwrite
 *   allocating write  lock held throughout: allocate, read-modify-write
 *                     the first and last block, pwrite, map
 *   trim, zero        lock held throughout (metadata; zeroing in place)
 *   flush, FUA        commit: waits until no request is between its lookup
 *                     and the end of its data I/O (freed host space may be
 *                     reused once the commit is durable)
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#define _GNU_SOURCE             /* fallocate */
#define NBDKIT_API_VERSION 2

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>
#include <nbdkit-plugin.h>

#include "extree-nbdkit.h"

/* Runs looked up per lock hold on the read path (as the QEMU driver) */
#define XP_READ_BATCH           16
/* No-wait lookups of one query before a blocking one (xp_query) */
#define XP_NOWAIT_TRIES         (2 * EXTREE_MAX_LEVELS)
/* Extents answered per call: the client asks again for the rest */
#define XP_EXTENTS_MAX          65536
/* Zeroes written per pwrite when zeroing in place cannot be delegated */
#define XP_ZERO_BUF             (1024 * 1024)

/* ---- Lock, corruption, commit gate ---- */

/*
 * As qcow2 and the QEMU driver do: the request that hit damage fails with
 * -EIO and its message; a writable image is marked corrupt (the core
 * refuses updates from then on, reads go on).  Called with xp.lock held.
 */
static void xp_handle_corruption(void)
{
    ExtreeCorruption c;
    int ret;

    if (!extree_take_corruption(xp.t, !xp.core_read_only, &c)) {
        return;
    }
    nbdkit_error("%s%s", c.msg, c.fatal ? "; marking the image corrupt" : "");
    g_free(c.msg);
    if (c.fatal) {
        ret = extree_mark_corrupt(xp.t);
        if (ret < 0) {
            nbdkit_error("could not mark the image corrupt: %s",
                         strerror(-ret));
        }
    }
}

void xp_lock(void)
{
    pthread_mutex_lock(&xp.lock);
}

void xp_unlock(void)
{
    if (xp.t && extree_corruption_pending(xp.t)) {
        xp_handle_corruption();
    }
    pthread_mutex_unlock(&xp.lock);
}

/* A request is about to look up host ranges.  Called with xp.lock held */
static void xp_io_begin(void)
{
    while (xp.commit_waiting) {
        pthread_cond_wait(&xp.cond, &xp.lock);
    }
    xp.inflight++;
}

/* Called with xp.lock held */
static void xp_io_end(void)
{
    if (--xp.inflight == 0 && xp.commit_waiting) {
        pthread_cond_broadcast(&xp.cond);
    }
}

/*
 * Commit: wait until no request holds host ranges it looked up, holding
 * new ones back meanwhile.  Called with xp.lock held; drops it while
 * waiting.  The caller must not be counted in xp.inflight.
 */
int xp_commit_locked(void)
{
    int ret, rollback;

    if (xp.core_read_only || !extree_is_dirty(xp.t)) {
        return 0;
    }
    xp.commit_waiting++;
    while (xp.inflight > 0) {
        pthread_cond_wait(&xp.cond, &xp.lock);
    }
    /* no request holds a range of the transaction (none in flight) */
    ret = extree_commit_or_roll_back(xp.t, &rollback);
    if (rollback) {
        nbdkit_error("no space left for metadata; changes since the last "
                     "commit are lost%s", rollback < 0 ?
                     ", and the image must be opened again" : "");
    }
    xp.commit_waiting--;
    pthread_cond_broadcast(&xp.cond);
    if (ret < 0 && !extree_corruption_pending(xp.t)) {
        nbdkit_error("could not commit metadata: %s", strerror(-ret));
    }
    return ret;
}

/* After an update: commit when the core wants it.  xp.lock held */
static int xp_update_done(void)
{
    if (xp.core_read_only) {
        return 0;
    }
    if (extree_mark_log_checkpoint_wanted(xp.t)) {
        /* half the mark log is used: store its marks, start a new one */
        extree_mark_log_checkpoint(xp.t);
        return xp_commit_locked();
    }
    if (extree_commit_wanted(xp.t)) {
        return xp_commit_locked();
    }
    return 0;
}

/*
 * Make the marks of guest [@start, + @len) durable through the mark log
 * (spec: Mark log), with those of every write waiting meanwhile in one
 * record and one flush, as the QEMU driver does (xt_mark_log()).  xp.lock
 * held and the request counted (xp_io_begin(): no commit runs between a
 * record and the writes it lets go in place); drops and retakes it.  The
 * caller looks the range up again.
 */
static void xp_mark_log(uint64_t start, uint64_t len)
{
    uint64_t batch;

    while (xp.mark_npending == EXTREE_MARK_LOG_RANGES) {
        pthread_cond_wait(&xp.mark_cond, &xp.lock);
    }
    xp.mark_pending[xp.mark_npending++] = (ExtreeMarkRange){ start, len };
    batch = xp.mark_batch;
    while (xp.mark_done < batch) {
        ExtreeMarkRange r[EXTREE_MARK_LOG_RANGES];
        uint64_t mine, off;
        uint8_t *rec;
        unsigned n;
        int ret;

        if (xp.mark_busy) {
            pthread_cond_wait(&xp.mark_cond, &xp.lock);
            continue;
        }
        xp.mark_busy = true;
        n = xp.mark_npending;
        memcpy(r, xp.mark_pending, n * sizeof(r[0]));
        xp.mark_npending = 0;
        mine = xp.mark_batch++;
        ret = extree_mark_log_append(xp.t, r, n, &rec, &off);
        if (ret == 0) {
            pthread_mutex_unlock(&xp.lock);
            ret = xp_pwrite_full(rec, EXTREE_MARK_LOG_RECORD, off);
            if (ret == 0) {
                ret = xp.be->ops->flush(xp.be->opaque);
            }
            pthread_mutex_lock(&xp.lock);
            g_free(rec);
            if (ret == 0) {
                extree_mark_log_durable(xp.t, r, n);
            }
        }
        if (ret < 0 && ret != -ENOSPC) {
            nbdkit_debug("mark log record: %s", strerror(-ret));
        }
        xp.mark_done = mine;
        xp.mark_busy = false;
        pthread_cond_broadcast(&xp.mark_cond);
    }
}

/*
 * Guest [@start, @end) becomes ZERO (@zero) or holes.  On storage of
 * fixed size the core stops between two leaves when the room for nodes
 * runs short (docs/devel/extree.rst, "Running out of space"): commit what
 * the transaction did, which makes the space it freed reusable, and go
 * on with the same range (both are idempotent); a call that changed
 * nothing leaves the transaction clean after the commit, and the storage
 * is full.  xp.lock held, not counted in xp.inflight.
 */
static int xp_update_range(uint64_t start, uint64_t end, bool zero)
{
    int ret;

    for (;;) {
        ret = zero ? extree_set_zero(xp.t, start, end - start) :
                     extree_punch(xp.t, start, end - start);
        if (ret != -ENOSPC || !extree_is_dirty(xp.t) ||
            xp_commit_locked() < 0) {
            return ret;
        }
    }
}

/*
 * A block device may have grown since the core was told its end (lvextend,
 * losetup -c, a bigger LUN): after -ENOSPC, ask it again and raise the
 * limit.  True if it grew.  xp.lock held.
 */
static bool xp_storage_grew(void)
{
    int64_t len;

    if (!xp.is_blk || xp.core_read_only) {
        return false;
    }
    len = xp_file_length();
    if (len <= xp.blk_size) {
        return false;
    }
    xp.blk_size = len;
    extree_set_host_limit(xp.t, len);
    return true;
}

/* Set errno for nbdkit from a -errno and return -1 */
static int xp_fail(int ret)
{
    nbdkit_set_error(-ret);
    return -1;
}

/* ---- Lookups ---- */

/*
 * extree_cursor_query() that holds xp.lock across no node read: the
 * no-wait query names the node it misses, which is read without the lock
 * and handed to the core, which validates it when the query asks again.
 * A forward walk's next leaf (missing node 0), a failed read or too many
 * tries go to the blocking query (readahead, usual error reports).
 * Called with xp.lock held; may drop and retake it.
 */
static int xp_query(ExtreeCursor *c, uint64_t guest, uint64_t max_bytes,
                    int coalesce, ExtreeRun *run)
{
    uint32_t ns = extree_node_size(xp.t);
    void *buf = NULL;
    int ret;

    for (int tries = 0; tries < XP_NOWAIT_TRIES; tries++) {
        uint64_t bytenr, epoch;

        ret = extree_cursor_query_nowait(c, guest, max_bytes, coalesce, run);
        if (ret != -EWOULDBLOCK) {
            g_free(buf);
            return ret;
        }
        bytenr = extree_missing_node(xp.t, &epoch);
        if (!bytenr) {
            break;
        }
        if (!buf) {
            buf = g_malloc(ns);
        }
        pthread_mutex_unlock(&xp.lock);
        ret = xp_pread_full(buf, ns, bytenr);
        pthread_mutex_lock(&xp.lock);
        if (ret < 0) {
            break;
        }
        extree_node_prefetch(xp.t, bytenr, epoch, buf);
    }
    g_free(buf);
    return extree_cursor_query(c, guest, max_bytes, coalesce, run);
}

/* ---- Reads ---- */

/*
 * Guest [run->guest, + run->length) of COMPRESSED run @run into @out: the
 * whole extent decompressed (the core's codec checks the payload).  Called
 * without xp.lock, the request counted (xp_io_begin()).
 */
static int xp_read_compressed(const ExtreeRun *run, uint8_t *out)
{
    uint8_t *payload = g_malloc(run->payload_len);
    uint8_t *buf = g_malloc(run->ext_length);
    int ret = xp_pread_full(payload, run->payload_len, run->host);

    if (ret == 0) {
        ret = extree_decompress(run->alg, payload, run->payload_len, buf,
                                run->ext_length);
        if (ret == -EIO) {
            nbdkit_error("damaged compressed extent at guest offset 0x%"
                         PRIx64 " length 0x%" PRIx64 ": its payload at "
                         "host offset 0x%" PRIx64 " (%u bytes) does not "
                         "decompress to it", run->ext_guest,
                         run->ext_length, run->host, run->payload_len);
        }
    }
    if (ret == 0) {
        memcpy(out, buf + (run->guest - run->ext_guest), run->length);
    }
    g_free(payload);
    g_free(buf);
    return ret;
}

/*
 * Up to XP_READ_BATCH runs per lock hold, then their reads without the
 * lock.  Holes and ZERO extents read as zeroes (no backing file).
 */
int xp_pread(void *handle, void *buf, uint32_t count, uint64_t offset,
                    uint32_t flags)
{
    ExtreeRun runs[XP_READ_BATCH];
    uint8_t *out = buf;
    ExtreeCursor cur;
    int ret = 0;

    xp_lock();
    extree_cursor_init(&cur, xp.t);
    while (count > 0) {
        uint64_t pos = offset, left = count;
        int nr = 0;

        xp_io_begin();
        while (nr < XP_READ_BATCH && left > 0) {
            ret = xp_query(&cur, pos, left, EXTREE_COALESCE_HOST, &runs[nr]);
            if (ret < 0) {
                break;
            }
            pos += runs[nr].length;
            left -= runs[nr].length;
            nr++;
        }
        if (ret < 0) {
            xp_io_end();
            break;
        }
        pthread_mutex_unlock(&xp.lock);
        for (int i = 0; i < nr && ret == 0; i++) {
            uint8_t *p = out + (runs[i].guest - offset);

            if (runs[i].type == EXTREE_RUN_DATA) {
                ret = xp_pread_full(p, runs[i].length, runs[i].host);
            } else if (runs[i].type == EXTREE_RUN_COMPRESSED) {
                ret = xp_read_compressed(&runs[i], p);
            } else {
                memset(p, 0, runs[i].length);
            }
        }
        pthread_mutex_lock(&xp.lock);
        xp_io_end();
        if (ret < 0) {
            nbdkit_error("read of the image file failed: %s",
                         strerror(-ret));
            break;
        }
        out += pos - offset;
        count = left;
        offset = pos;
    }
    extree_cursor_release(&cur);
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Writes ---- */

/*
 * Fill @buf with what guest [@guest, + @bytes) reads as now; it lies in a
 * block of @run (possibly outside @run's guest range, in the same block).
 * Bytes past the virtual size read as zeroes.  xp.lock held.
 */
static int xp_read_old(const ExtreeRun *run, uint64_t guest, uint64_t bytes,
                       uint8_t *buf)
{
    uint64_t vsize = extree_virtual_size(xp.t);

    memset(buf, 0, bytes);
    if (run->type != EXTREE_RUN_DATA || guest >= vsize) {
        return 0;
    }
    return xp_pread_full(buf, XP_MIN(bytes, vsize - guest),
                         run->host + guest - run->guest);
}

/*
 * Write guest [@offset, + @n) of @run (a hole, a ZERO extent or DATA a
 * snapshot shares) to new host space together with the rest of its first
 * and last block, then map it.  @data NULL writes zeroes.  *@done: bytes
 * of the request written (the allocation may be shorter).  xp.lock held
 * throughout: no other update, and no commit, runs meanwhile.
 */
static int xp_alloc_write(const ExtreeRun *run, uint64_t offset, uint64_t n,
                          const uint8_t *data, uint64_t *done)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t start = XP_ALIGN_DOWN(offset, bs);
    uint64_t end = XP_ROUND_UP(offset + n, bs);
    uint64_t host, got, head, wlen, tail, pend;
    uint8_t *edge = NULL, *zeroes = NULL;
    /* the mapping may go into a map record: the checksum of its bytes */
    bool logged = extree_map_log_usable(xp.t);
    uint32_t csum = 0;
    int ret;

    ret = extree_alloc_data(xp.t, start, end - start, &host, &got);
    if (ret < 0) {
        return ret;
    }
    pend = start + got;
    head = offset - start;
    wlen = XP_MIN(offset + n, pend) - offset;
    tail = pend - (offset + wlen);

    edge = g_malloc(bs);
    if (head) {
        ret = xp_read_old(run, start, head, edge);
        if (ret == 0) {
            csum = extree_crc32c(csum, edge, head);
            ret = xp_pwrite_full(edge, head, host);
        }
    }
    if (ret == 0 && data) {
        csum = extree_crc32c(csum, data, wlen);
        ret = xp_pwrite_full(data, wlen, host + head);
    } else if (ret == 0) {
        zeroes = g_malloc0(XP_MIN(wlen, XP_ZERO_BUF));
        for (uint64_t w = 0; w < wlen && ret == 0; w += XP_ZERO_BUF) {
            uint64_t k = XP_MIN(wlen - w, XP_ZERO_BUF);

            csum = extree_crc32c(csum, zeroes, k);
            ret = xp_pwrite_full(zeroes, k, host + head + w);
        }
    }
    if (ret == 0 && tail) {
        ret = xp_read_old(run, offset + wlen, tail, edge);
        if (ret == 0) {
            csum = extree_crc32c(csum, edge, tail);
            ret = xp_pwrite_full(edge, tail, host + head + wlen);
        }
    }
    g_free(edge);
    g_free(zeroes);
    if (ret == 0 && logged) {
        /* the data is written: now the mapping may reach a record */
        ret = extree_map_data_logged(xp.t, start, got, host, csum);
    } else if (ret == 0) {
        /* the data is written: now the mapping may reach a commit */
        ret = extree_map_data(xp.t, start, got, host);
    }
    if (ret < 0) {
        extree_free_data(xp.t, host, got);
        return ret;
    }
    *done = wlen;
    return 0;
}

/*
 * May DATA run @run be changed in place for guest [@offset, + @n)?  The
 * core decides for the plugin and the driver alike (extree_in_place());
 * a caller that writes in place marks the range first.  xp.lock held.
 */
static int xp_in_place(const ExtreeRun *run, uint64_t offset, uint64_t n,
                       bool *in_place)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t start = XP_ALIGN_DOWN(offset, bs);
    uint64_t end = XP_ROUND_UP(offset + n, bs);

    return extree_in_place(xp.t, run, start, end - start, in_place);
}

/*
 * Write @data (NULL: zeroes) to guest [@offset, + @count): in place into
 * unshared DATA (without the lock), else through xp_alloc_write().  A
 * full device (-ENOSPC) is retried once after a commit: space freed in
 * this transaction is reusable once committed.  xp.lock held.
 */
static int xp_write_locked(const uint8_t *data, uint64_t count,
                           uint64_t offset)
{
    bool committed = false, in_place, logged = false;
    ExtreeCursor cur;
    int ret = 0;

    extree_cursor_init(&cur, xp.t);
    while (count > 0) {
        ExtreeRun run;
        uint64_t n;

        xp_io_begin();
        ret = extree_cursor_query(&cur, offset, count, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret == 0) {
            ret = xp_in_place(&run, offset, run.length, &in_place);
        }
        if (ret < 0) {
            xp_io_end();
            break;
        }
        if (!in_place && !logged && data) {
            uint64_t bs = extree_block_size(xp.t);
            uint64_t start = XP_ALIGN_DOWN(offset, bs);
            uint64_t end = XP_ROUND_UP(offset + run.length, bs);

            if (extree_mark_log_wanted(xp.t, &run, start, end - start)) {
                /* only the committed marks keep it out: a record, again */
                xp_mark_log(start, end - start);
                logged = true;
                xp_io_end();
                continue;
            }
        }
        n = run.length;
        if (in_place && data) {
            extree_bitmaps_mark(xp.t, offset, n);
            pthread_mutex_unlock(&xp.lock);
            ret = xp_pwrite_full(data, n, run.host);
            pthread_mutex_lock(&xp.lock);
            xp_io_end();
        } else {
            xp_io_end();
            ret = xp_alloc_write(&run, offset, n, data, &n);
            if (ret == -ENOSPC && xp_storage_grew()) {
                continue;
            }
            if (ret == -ENOSPC && !committed && extree_is_dirty(xp.t)) {
                committed = true;
                extree_cursor_release(&cur);
                if (xp_commit_locked() == 0) {
                    continue;
                }
                ret = -ENOSPC;
            }
        }
        if (ret < 0) {
            break;
        }
        offset += n;
        count -= n;
        logged = false;
        if (data) {
            data += n;
        }
    }
    extree_cursor_release(&cur);
    return ret;
}

/*
 * Map records hold every change since the commit (spec: Mark log, map
 * records): the waiting ones written, with no request in flight (a mark
 * log record's writer holds its request counted, so the chain is written
 * in slot order), then a flush of the data and the records.  A commit
 * instead if the log filled.  xp.lock held.
 */
static int xp_map_log_locked(void)
{
    int ret;

    xp.commit_waiting++;
    while (xp.inflight > 0) {
        pthread_cond_wait(&xp.cond, &xp.lock);
    }
    ret = extree_map_log_sync(xp.t);
    xp.commit_waiting--;
    pthread_cond_broadcast(&xp.cond);
    if (ret == -ENOSPC) {
        return xp_commit_locked();
    }
    if (ret == 0) {
        ret = fdatasync(xp.fd) < 0 ? -errno : 0;
    }
    return ret;
}

/*
 * FUA: a commit if metadata changed (map records if they hold it), else a
 * flush of the data.  After a rollback dropped writes that may have been
 * acknowledged, every flush fails until the image is opened again
 * (extree_changes_lost())
 */
static int xp_fua_locked(void)
{
    int ret;

    if (extree_is_dirty(xp.t) && extree_map_log_sync_wanted(xp.t)) {
        ret = xp_map_log_locked();
    } else if (extree_is_dirty(xp.t)) {
        extree_map_log_flush_commit(xp.t);
        ret = xp_commit_locked();
    } else {
        ret = fdatasync(xp.fd) < 0 ? -errno : 0;
    }
    if (ret == 0 && extree_changes_lost(xp.t)) {
        nbdkit_error("writes since an earlier commit were lost (no space "
                     "left for metadata); reopen the image");
        ret = -EIO;
    }
    return ret;
}

int xp_pwrite(void *handle, const void *buf, uint32_t count,
                     uint64_t offset, uint32_t flags)
{
    int ret;

    xp_lock();
    ret = xp_write_locked(buf, count, offset);
    if (ret == 0) {
        ret = xp_update_done();
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    if (ret < 0 && !extree_corruption_pending(xp.t)) {
        nbdkit_error("write failed: %s", strerror(-ret));
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

int xp_flush(void *handle, uint32_t flags)
{
    int ret;

    xp_lock();
    ret = xp_fua_locked();
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Trim and zero ---- */

/*
 * The whole blocks of guest [@offset, + @count); the partial block at the
 * end of the disk counts as whole when the range reaches the end.  False
 * if there are none.
 */
static bool xp_whole_blocks(uint64_t offset, uint64_t count,
                            uint64_t *start, uint64_t *end)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t vsize = extree_virtual_size(xp.t);

    *start = XP_ROUND_UP(offset, bs);
    if (offset + count >= vsize) {
        *end = XP_ROUND_UP(vsize, bs);
    } else {
        *end = XP_ALIGN_DOWN(offset + count, bs);
    }
    return *start < *end;
}

/* Trim: whole blocks become holes and their space is freed */
int xp_trim(void *handle, uint32_t count, uint64_t offset,
                   uint32_t flags)
{
    uint64_t start, end;
    int ret = 0;

    xp_lock();
    if (xp_whole_blocks(offset, count, &start, &end)) {
        ret = xp_update_range(start, end, false);
        if (ret == 0) {
            ret = xp_update_done();
        }
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/*
 * Zero host [@host, + @bytes) of unshared DATA in place: a fallocate
 * where the file system can (a metadata change), else zeroes written
 * (-ENOTSUP instead with @fast).  xp.lock held.
 */
static int xp_zero_host(uint64_t host, uint64_t bytes, bool fast)
{
    uint8_t *zeroes;
    int ret = 0;

    if (!xp.is_blk && xp.zero_range_ok) {
        if (fallocate(xp.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
                      host, bytes) == 0) {
            return 0;
        }
        if (errno == EOPNOTSUPP) {
            xp.zero_range_ok = false;
        }
    }
    if (fast) {
        return -ENOTSUP;
    }
    zeroes = g_malloc0(XP_MIN(bytes, XP_ZERO_BUF));
    for (uint64_t w = 0; w < bytes && ret == 0; w += XP_ZERO_BUF) {
        ret = xp_pwrite_full(zeroes, XP_MIN(bytes - w, XP_ZERO_BUF),
                             host + w);
    }
    g_free(zeroes);
    return ret;
}

/*
 * Zero part of one block, guest [@offset, + @bytes): unshared DATA in
 * place; a hole becomes a ZERO extent (it reads as zeroes already); a
 * ZERO extent stays; shared DATA gets a new block (read-modify-write).
 * xp.lock held.
 */
static int xp_zero_partial(uint64_t offset, uint64_t bytes, bool fast)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t bstart = XP_ALIGN_DOWN(offset, bs);
    ExtreeCursor cur;
    ExtreeRun run;
    bool in_place;
    int ret;

    extree_cursor_init(&cur, xp.t);
    ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                              &run);
    extree_cursor_release(&cur);
    if (ret == 0) {
        ret = xp_in_place(&run, offset, bytes, &in_place);
    }
    if (ret < 0) {
        return ret;
    }
    switch (run.type) {
    case EXTREE_RUN_ZERO:
        return 0;
    case EXTREE_RUN_UNALLOC:
        return xp_update_range(bstart, bstart + bs, true);
    default:
        if (in_place) {
            extree_bitmaps_mark(xp.t, offset, bytes);
            return xp_zero_host(run.host, bytes, false);
        }
        return fast ? -ENOTSUP : xp_write_locked(NULL, bytes, offset);
    }
}

/*
 * Zero whole blocks [@start, @end).  @may_trim: one ZERO extent, space
 * freed.  Without (the client wants the space kept): unshared DATA is
 * zeroed in place, the rest becomes ZERO extents.  xp.lock held.
 */
static int xp_zero_blocks(uint64_t start, uint64_t end, bool may_trim,
                          bool fast)
{
    uint64_t bs = extree_block_size(xp.t);
    ExtreeCursor cur;
    int ret = 0;

    if (may_trim) {
        return xp_update_range(start, end, true);
    }
    extree_cursor_init(&cur, xp.t);
    while (start < end) {
        uint64_t vsize = extree_virtual_size(xp.t), next;
        ExtreeRun run;
        bool in_place;

        if (start >= vsize) {
            break;
        }
        ret = extree_cursor_query(&cur, start, XP_MIN(end, vsize) - start,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret == 0) {
            ret = xp_in_place(&run, start, run.length, &in_place);
        }
        if (ret < 0) {
            break;
        }
        next = XP_ROUND_UP(start + run.length, bs);
        if (run.type == EXTREE_RUN_DATA && in_place) {
            extree_bitmaps_mark(xp.t, start, next - start);
            ret = xp_zero_host(run.host, next - start, fast);
        } else if (run.type != EXTREE_RUN_ZERO) {
            ret = xp_update_range(start, next, true);
        }
        if (ret < 0) {
            break;
        }
        start = next;
    }
    extree_cursor_release(&cur);
    return ret;
}

/*
 * NBDKIT_FLAG_FAST_ZERO: can guest [@pos, @stop), whose whole blocks are
 * [@start, @end), be zeroed without writing zeroes?  Asked before anything
 * changes, so that a slow request fails with ENOTSUP having changed
 * nothing.  Slow: shared DATA in a partial block (a new block is written),
 * and unshared DATA in whole blocks without @may_trim where the file
 * system cannot zero a range itself.  xp.lock held.
 */
static int xp_zero_is_fast(uint64_t pos, uint64_t stop, uint64_t start,
                           uint64_t end, bool may_trim, bool *fast)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t vsize = extree_virtual_size(xp.t);
    bool delegate = !xp.is_blk && xp.zero_range_ok;
    ExtreeCursor cur;
    int ret = 0;

    *fast = true;
    extree_cursor_init(&cur, xp.t);
    while (*fast && pos < stop && pos < vsize) {
        bool whole = pos >= start && pos < end, in_place;
        uint64_t lim;
        ExtreeRun run;

        if (whole && may_trim) {
            pos = end;
            continue;
        }
        lim = whole ? end : XP_MIN(stop, XP_ALIGN_DOWN(pos, bs) + bs);
        ret = extree_cursor_query(&cur, pos, XP_MIN(lim, vsize) - pos,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret == 0) {
            ret = xp_in_place(&run, pos, run.length, &in_place);
        }
        if (ret < 0) {
            break;
        }
        if (run.type == EXTREE_RUN_DATA) {
            *fast = whole ? !in_place || delegate : in_place;
        }
        pos += run.length;
    }
    extree_cursor_release(&cur);
    return ret;
}

int xp_zero(void *handle, uint32_t count, uint64_t offset,
                   uint32_t flags)
{
    bool may_trim = flags & NBDKIT_FLAG_MAY_TRIM;
    bool fast = flags & NBDKIT_FLAG_FAST_ZERO;
    uint64_t bs, start, end, pos = offset, stop = offset + count;
    int ret = 0;

    xp_lock();
    bs = extree_block_size(xp.t);
    if (!xp_whole_blocks(offset, count, &start, &end)) {
        start = end = stop;
    }
    if (fast) {
        bool ok;

        ret = xp_zero_is_fast(pos, stop, start, end, may_trim, &ok);
        if (ret == 0 && !ok) {
            ret = -ENOTSUP;
        }
    }
    /* the partial block before the whole ones, then those, then after */
    while (ret == 0 && pos < stop) {
        if (pos == start && start < end) {
            ret = xp_zero_blocks(start, end, may_trim, fast);
            pos = XP_MIN(end, stop);
        } else {
            uint64_t n = XP_MIN(stop, XP_ALIGN_DOWN(pos, bs) + bs) - pos;

            ret = xp_zero_partial(pos, n, fast);
            pos += n;
        }
    }
    if (ret == 0) {
        ret = xp_update_done();
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    if (ret < 0 && ret != -ENOTSUP && !extree_corruption_pending(xp.t)) {
        nbdkit_error("zero failed: %s", strerror(-ret));
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Block status ---- */

/*
 * The one-pass leaf walk: the connection's cursor continues where its
 * last answer ended.  DATA is data; ZERO extents and holes read as
 * zeroes and need no space (hole | zero).
 */
int xp_extents(void *handle, uint32_t count, uint64_t offset,
                      uint32_t flags, struct nbdkit_extents *extents)
{
    XpConn *c = handle;
    uint64_t end = offset + count;
    int nr = 0, ret = 0;

    xp_lock();
    while (offset < end && nr < XP_EXTENTS_MAX) {
        ExtreeRun run;
        uint32_t type;

        ret = xp_query(&c->status, offset, end - offset,
                       EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            break;
        }
        type = run.type == EXTREE_RUN_DATA ||
               run.type == EXTREE_RUN_COMPRESSED ? 0 :
               NBDKIT_EXTENT_HOLE | NBDKIT_EXTENT_ZERO;
        if (nbdkit_add_extent(extents, offset, run.length, type) < 0) {
            ret = errno ? -errno : -EIO;
            break;
        }
        offset += run.length;
        nr++;
        if (flags & NBDKIT_FLAG_REQ_ONE) {
            break;
        }
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}
