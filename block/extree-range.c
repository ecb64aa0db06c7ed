/*
 * extree: QEMU driver, discard, write zeroes, truncate and preallocation
 *
 * Range updates that change the mapping without guest data (discard,
 * zeroes), zeroes in place, resizing (the cut-off range punched, the
 * old tail zeroed, the bitmaps marked) and preallocation.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block.h"
#include "block/block_int.h"
#include "block/dirty-bitmap.h"
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
xt_co_pdiscard(BlockDriverState *bs, int64_t offset, int64_t bytes)
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
xt_co_pwrite_zeroes(BlockDriverState *bs, int64_t offset, int64_t bytes,
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
xt_co_truncate(BlockDriverState *bs, int64_t offset, bool exact,
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
    /* none may write past a new end, nor into blocks that grow back */
    xt_wait_deferred(s, 0, UINT64_MAX);
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
                ret = extree_in_place(s->t, &run, QEMU_ALIGN_DOWN(old, bsz),
                                      bsz, &in_place);
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
xt_co_getlength(BlockDriverState *bs)
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
