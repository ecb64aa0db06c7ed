/*
 * extree core: payloads of compressed extents (zlib, zstd)
 *
 * One call compresses or decompresses one extent's data, whole, from and
 * into the caller's buffers: memory is bounded by the extent
 * (EXTREE_COMPRESSED_MAX) and the codec's context.  A payload read from
 * the image is hostile input: decompression succeeds only when the
 * payload, to its last byte, gives exactly the extent's length, and its
 * checksum (zlib's Adler-32, zstd's content checksum) holds.  No I/O, no
 * state: callers may run it in any thread.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

/* zlib as qcow2 uses it (default level), but with its header and checksum */
static int zlib_compress(const void *src, size_t len, void *dst, size_t cap,
                         size_t *out)
{
    z_stream z = { 0 };
    int ret;

    if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15, 8,
                     Z_DEFAULT_STRATEGY) != Z_OK) {
        return -ENOMEM;
    }
    z.next_in = (Bytef *)src;
    z.avail_in = len;
    z.next_out = dst;
    z.avail_out = cap;
    ret = deflate(&z, Z_FINISH);
    *out = z.total_out;
    deflateEnd(&z);
    /* Z_OK or Z_BUF_ERROR: it did not fit, it does not pay */
    return ret == Z_STREAM_END ? 0 : -ENOSPC;
}

static int zlib_decompress(const void *src, size_t len, void *dst,
                           size_t dst_len)
{
    z_stream z = { 0 };
    int ret;

    if (inflateInit2(&z, 15) != Z_OK) {
        return -ENOMEM;
    }
    z.next_in = (Bytef *)src;
    z.avail_in = len;
    z.next_out = dst;
    z.avail_out = dst_len;
    ret = inflate(&z, Z_FINISH);
    inflateEnd(&z);
    if (ret != Z_STREAM_END || z.avail_out || z.avail_in) {
        return -EIO;
    }
    return 0;
}

static int zstd_compress(const void *src, size_t len, void *dst, size_t cap,
                         size_t *out)
{
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    size_t n;

    if (!cctx) {
        return -ENOMEM;
    }
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, ZSTD_CLEVEL_DEFAULT);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
    n = ZSTD_compress2(cctx, dst, cap, src, len);
    ZSTD_freeCCtx(cctx);
    if (ZSTD_isError(n)) {
        /* dstSize_tooSmall: it does not pay; anything else: no memory */
        return ZSTD_getErrorCode(n) == ZSTD_error_dstSize_tooSmall ? -ENOSPC
                                                                   : -ENOMEM;
    }
    *out = n;
    return 0;
}

static int zstd_decompress(const void *src, size_t len, void *dst,
                           size_t dst_len)
{
    ZSTD_DCtx *dctx;
    size_t n;

    /*
     * Exactly one frame, the whole payload, that declares the extent's
     * length and carries a content checksum (Frame_Header_Descriptor bit
     * 2): a frame without one could decode other data with success
     */
    n = ZSTD_findFrameCompressedSize(src, len);
    if (ZSTD_isError(n) || n != len || len < 5 ||
        !(((const uint8_t *)src)[4] & 0x04) ||
        ZSTD_getFrameContentSize(src, len) != dst_len) {
        return -EIO;
    }
    dctx = ZSTD_createDCtx();
    if (!dctx) {
        return -ENOMEM;
    }
    /* one-shot into @dst: the window is @dst, nothing else is allocated */
    n = ZSTD_decompressDCtx(dctx, dst, dst_len, src, len);
    ZSTD_freeDCtx(dctx);
    return ZSTD_isError(n) || n != dst_len ? -EIO : 0;
}

int extree_compress(uint32_t alg, const void *src, size_t len, void *dst,
                    size_t cap, size_t *out)
{
    if (!len || len > EXTREE_COMPRESSED_MAX) {
        return -EINVAL;
    }
    switch (alg) {
    case EXTREE_COMPRESS_ZLIB:
        return zlib_compress(src, len, dst, cap, out);
    case EXTREE_COMPRESS_ZSTD:
        return zstd_compress(src, len, dst, cap, out);
    default:
        return -EINVAL;
    }
}

int extree_decompress(uint32_t alg, const void *src, size_t len, void *dst,
                      size_t dst_len)
{
    if (!len || len > dst_len || dst_len > EXTREE_COMPRESSED_MAX) {
        return -EIO;
    }
    switch (alg) {
    case EXTREE_COMPRESS_ZLIB:
        return zlib_decompress(src, len, dst, dst_len);
    case EXTREE_COMPRESS_ZSTD:
        return zstd_decompress(src, len, dst, dst_len);
    default:
        return -EIO;
    }
}

const char *extree_compression_name(uint32_t alg)
{
    switch (alg) {
    case EXTREE_COMPRESS_ZLIB:
        return "zlib";
    case EXTREE_COMPRESS_ZSTD:
        return "zstd";
    default:
        return NULL;
    }
}
