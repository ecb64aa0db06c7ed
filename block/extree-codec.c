/*
 * QEMU extree driver: compressed extents' payloads through the thread pool
 *
 * The codecs are the core's (block/extree/extree-compress.c); here they
 * run off the AioContext, and a payload is read from bs->file and checked
 * against the extent it belongs to.  No s->lock: callers hold what keeps
 * the payload's space from being reused (a counted request, see
 * xt_io_begin()).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block-io.h"
#include "block/thread-pool.h"
#include "qemu/error-report.h"
#include "qemu/memalign.h"
#include "trace/trace-block_extree.h"
#include "extree-qemu.h"

typedef struct XtCodecTask {
    bool compress;
    uint32_t alg;
    const void *src;
    size_t src_len;
    void *dst;
    size_t dst_len;             /* compress: capacity */
    size_t out;                 /* compress: payload length */
} XtCodecTask;

static int xt_codec_pool_fn(void *opaque)
{
    XtCodecTask *t = opaque;

    if (t->compress) {
        return extree_compress(t->alg, t->src, t->src_len, t->dst,
                               t->dst_len, &t->out);
    }
    return extree_decompress(t->alg, t->src, t->src_len, t->dst, t->dst_len);
}

/*
 * Compress @len bytes of @src with @alg into at most @cap bytes of @dst;
 * *@plen the payload's length.  -ENOSPC: it does not fit (store the data
 * as it is).
 */
int coroutine_fn xt_compress(uint32_t alg, const void *src, size_t len,
                             void *dst, size_t cap, size_t *plen)
{
    XtCodecTask t = {
        .compress = true, .alg = alg, .src = src, .src_len = len,
        .dst = dst, .dst_len = cap,
    };
    int ret = thread_pool_submit_co(xt_codec_pool_fn, &t);

    *plen = t.out;
    return ret;
}

/*
 * The guest data of COMPRESSED run @run, its whole extent
 * (run->ext_length bytes), into @buf: the payload read from the image and
 * decompressed.  A payload that does not decompress to exactly the
 * extent, with its checksum right, is damage: -EIO, and a message naming
 * the extent.
 */
int coroutine_fn GRAPH_RDLOCK
xt_decompress_run(BDRVExtreeState *s, const ExtreeRun *run, void *buf)
{
    void *payload = qemu_try_blockalign(s->bs->file->bs, run->payload_len);
    XtCodecTask t = {
        .alg = run->alg, .src = payload, .src_len = run->payload_len,
        .dst = buf, .dst_len = run->ext_length,
    };
    int ret;

    if (!payload) {
        return -ENOMEM;
    }
    trace_extree_decompress(s, run->ext_guest, run->ext_length, run->host,
                            run->payload_len, run->alg);
    ret = bdrv_co_pread(s->bs->file, run->host, run->payload_len, payload, 0);
    if (ret == 0) {
        ret = thread_pool_submit_co(xt_codec_pool_fn, &t);
        if (ret == -EIO) {
            error_report("extree: damaged compressed extent at guest offset "
                         "0x%" PRIx64 " length 0x%" PRIx64 ": its %s payload "
                         "at host offset 0x%" PRIx64 " (%u bytes) does not "
                         "decompress to it", run->ext_guest, run->ext_length,
                         extree_compression_name(run->alg) ?: "?", run->host,
                         run->payload_len);
        }
    }
    qemu_vfree(payload);
    return ret;
}
