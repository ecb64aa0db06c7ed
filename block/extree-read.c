/*
 * extree: QEMU driver, reads and block status
 *
 * Lookups read tree nodes without s->lock where they can (a node not in
 * the cache is read with the lock dropped, then the lookup retries);
 * reads copy data from bs->file, the backing file or zeroes, and
 * inflate compressed units; block status answers from one cursor.
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
int coroutine_fn GRAPH_RDLOCK
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
xt_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
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
    /* an acknowledged write not yet written: read what it wrote */
    xt_wait_deferred(s, offset, offset + bytes);
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
xt_co_block_status(BlockDriverState *bs, bool want_zero, int64_t offset,
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
