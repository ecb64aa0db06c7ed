/*
 * extree: QEMU driver, compressed writes
 *
 * .bdrv_co_pwritev_compressed_part: each unit compressed in the thread
 * pool (extree-codec.c) and its payload mapped as one COMPRESSED extent;
 * a unit that does not shrink is written as data, one of zeroes becomes a
 * ZERO extent (extree-range.c).
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
    BlockReq req;
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
    xt_alloc_begin(s, &req, offset, offset + len);
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
    xt_alloc_done(&req);
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
        return xt_co_pwrite_zeroes(bs, offset, bytes,
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
xt_co_pwritev_compressed_part(BlockDriverState *bs, int64_t offset,
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
