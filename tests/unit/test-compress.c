/*
 * Unit tests: compressed extents (issue 34), the core's part.  Payload
 * codecs (round trip, damaged payloads), COMPRESSED items (map, lookup,
 * never split, rewritten in pieces, shared by snapshots, checked) and
 * their validation.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <zstd.h>

#include "core-test.h"

#define BS 4096
#define NS 4096
#define VSIZE (8 * 1024 * 1024)
#define UNIT (64 * 1024)

static const uint32_t algs[] = { EXTREE_COMPRESS_ZLIB, EXTREE_COMPRESS_ZSTD };

/* Compressible bytes: text-like, different for each @seed */
static void fill(uint8_t *buf, size_t len, unsigned seed)
{
    static const char words[] = "extent tree leaf node block guest host ";

    for (size_t i = 0; i < len; i++) {
        buf[i] = words[(i / 7 + seed * 13 + (i % 7)) % (sizeof(words) - 1)];
    }
}

static void test_codec_roundtrip(void)
{
    for (unsigned a = 0; a < G_N_ELEMENTS(algs); a++) {
        for (size_t len = BS; len <= EXTREE_COMPRESSED_MAX; len *= 8) {
            uint8_t *src = g_malloc(len), *out = g_malloc(len);
            uint8_t *pay = g_malloc(len);
            size_t plen = 0;

            fill(src, len, len);
            g_assert_cmpint(extree_compress(algs[a], src, len, pay, len,
                                            &plen), ==, 0);
            g_assert_cmpuint(plen, >, 0);
            g_assert_cmpuint(plen, <, len / 4);
            g_assert_cmpint(extree_decompress(algs[a], pay, plen, out, len),
                            ==, 0);
            g_assert_cmpmem(src, len, out, len);
            g_free(src);
            g_free(out);
            g_free(pay);
        }
    }
}

/* Random bytes do not fit in less than their length: -ENOSPC */
static void test_codec_incompressible(void)
{
    GRand *r = g_rand_new_with_seed(test_seed("incompressible", 34));
    uint8_t *src = g_malloc(UNIT), *pay = g_malloc(UNIT);
    size_t plen;

    for (size_t i = 0; i < UNIT; i++) {
        src[i] = g_rand_int(r);
    }
    for (unsigned a = 0; a < G_N_ELEMENTS(algs); a++) {
        g_assert_cmpint(extree_compress(algs[a], src, UNIT, pay,
                                        UNIT - BS, &plen), ==, -ENOSPC);
    }
    g_assert_cmpint(extree_compress(7, src, UNIT, pay, UNIT, &plen), ==,
                    -EINVAL);
    g_assert_cmpint(extree_compress(EXTREE_COMPRESS_ZSTD, src, 0, pay, UNIT,
                                    &plen), ==, -EINVAL);
    g_free(src);
    g_free(pay);
    g_rand_free(r);
}

/*
 * Hostile payloads: every single-byte change, a cut, trailing bytes, a
 * wrong expected length, a wrong algorithm: -EIO, never a success with
 * other data
 */
static void test_codec_damaged(void)
{
    for (unsigned a = 0; a < G_N_ELEMENTS(algs); a++) {
        uint8_t *src = g_malloc(UNIT), *out = g_malloc(UNIT + BS);
        uint8_t *pay = g_malloc(UNIT + 16);
        size_t plen;

        fill(src, UNIT, 3);
        g_assert_cmpint(extree_compress(algs[a], src, UNIT, pay, UNIT,
                                        &plen), ==, 0);
        for (size_t i = 0; i < plen; i++) {
            int ret;

            pay[i] ^= 0x20;
            ret = extree_decompress(algs[a], pay, plen, out, UNIT);
            pay[i] ^= 0x20;
            if (ret == 0) {
                /* a change the format cannot see must not change the data */
                g_assert_cmpmem(src, UNIT, out, UNIT);
            } else {
                g_assert_cmpint(ret, ==, -EIO);
            }
        }
        g_assert_cmpint(extree_decompress(algs[a], pay, plen - 1, out, UNIT),
                        ==, -EIO);
        pay[plen] = 0;
        g_assert_cmpint(extree_decompress(algs[a], pay, plen + 1, out, UNIT),
                        ==, -EIO);
        g_assert_cmpint(extree_decompress(algs[a], pay, plen, out, UNIT - BS),
                        ==, -EIO);
        g_assert_cmpint(extree_decompress(algs[a], pay, plen, out, UNIT + BS),
                        ==, -EIO);
        g_assert_cmpint(extree_decompress(algs[1 - a], pay, plen, out, UNIT),
                        ==, -EIO);
        g_assert_cmpint(extree_decompress(0, pay, plen, out, UNIT), ==, -EIO);
        g_free(src);
        g_free(out);
        g_free(pay);
    }
}

/*
 * A zstd frame that is well-formed but lacks the content checksum or the
 * content size is refused: it could decode other data with success
 */
static void test_codec_zstd_no_checksum(void)
{
    uint8_t *src = g_malloc(UNIT), *out = g_malloc(UNIT);
    size_t cap = ZSTD_compressBound(UNIT), n;
    uint8_t *pay = g_malloc(cap);
    ZSTD_CCtx *cctx = ZSTD_createCCtx();

    fill(src, UNIT, 4);
    /* the simple API: content size, no checksum */
    n = ZSTD_compress(pay, cap, src, UNIT, 3);
    g_assert_false(ZSTD_isError(n));
    g_assert_cmpint(extree_decompress(EXTREE_COMPRESS_ZSTD, pay, n, out, UNIT),
                    ==, -EIO);
    /* a checksum, no content size */
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
    n = ZSTD_compress2(cctx, pay, cap, src, UNIT);
    g_assert_false(ZSTD_isError(n));
    g_assert_cmpint(extree_decompress(EXTREE_COMPRESS_ZSTD, pay, n, out, UNIT),
                    ==, -EIO);
    /* both: accepted */
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
    n = ZSTD_compress2(cctx, pay, cap, src, UNIT);
    g_assert_false(ZSTD_isError(n));
    g_assert_cmpint(extree_decompress(EXTREE_COMPRESS_ZSTD, pay, n, out, UNIT),
                    ==, 0);
    g_assert_cmpmem(src, UNIT, out, UNIT);
    ZSTD_freeCCtx(cctx);
    g_free(src);
    g_free(out);
    g_free(pay);
}

/* Write @len bytes of compressed data (seed @seed) at guest @guest */
static uint64_t put_compressed(Extree *t, ExtreeBackend *be, uint64_t guest,
                               uint64_t len, unsigned seed, uint32_t alg)
{
    uint8_t *src = g_malloc(len), *pay = g_malloc(len);
    uint64_t host, got;
    size_t plen;

    fill(src, len, seed);
    g_assert_cmpint(extree_compress(alg, src, len, pay, len, &plen), ==, 0);
    g_assert_cmpint(extree_alloc_data(t, guest, EXTREE_ROUND_UP(plen, BS),
                                      &host, &got), ==, 0);
    g_assert_cmpuint(got, ==, EXTREE_ROUND_UP(plen, BS));
    g_assert_cmpint(be->ops->pwrite(be->opaque, host, pay, plen), ==, 0);
    g_assert_cmpint(extree_map_compressed(t, guest, len, host, plen, alg), ==,
                    0);
    g_free(src);
    g_free(pay);
    return host;
}

/* Read guest [guest, + len) of COMPRESSED run @run and compare to @seed */
static void assert_compressed(ExtreeBackend *be, const ExtreeRun *run,
                              uint64_t len, unsigned seed)
{
    uint8_t *want = g_malloc(len), *out = g_malloc(len);
    uint8_t *pay = g_malloc(run->payload_len);

    g_assert_cmpint(run->type, ==, EXTREE_RUN_COMPRESSED);
    g_assert_cmpuint(run->ext_length, ==, len);
    fill(want, len, seed);
    g_assert_cmpint(be->ops->pread(be->opaque, run->host, pay,
                                   run->payload_len), ==, 0);
    g_assert_cmpint(extree_decompress(run->alg, pay, run->payload_len, out,
                                      len), ==, 0);
    g_assert_cmpmem(want, len, out, len);
    g_free(want);
    g_free(out);
    g_free(pay);
}

static void test_map_lookup_reopen(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    ExtreeRun run;

    g_assert_false(extree_incompat_features(t) & EXTREE_INCOMPAT_COMPRESSED);
    put_compressed(t, be, 0, UNIT, 1, EXTREE_COMPRESS_ZSTD);
    put_compressed(t, be, UNIT, UNIT, 2, EXTREE_COMPRESS_ZLIB);
    ct_write(t, 2 * UNIT, UNIT);
    g_assert_true(extree_incompat_features(t) & EXTREE_INCOMPAT_COMPRESSED);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    t = ct_open(be);
    g_assert_true(extree_incompat_features(t) & EXTREE_INCOMPAT_COMPRESSED);
    /* a query inside the extent: the whole extent is named */
    g_assert_cmpint(ct_lookup1(t, BS, &run), ==, 0);
    g_assert_cmpuint(run.guest, ==, BS);
    g_assert_cmpuint(run.ext_guest, ==, 0);
    assert_compressed(be, &run, UNIT, 1);
    /* two compressed extents are two runs (one payload each) ... */
    {
        ExtreeRun runs[4];
        int n;

        g_assert_cmpint(extree_lookup(t, 0, 3 * UNIT, runs, 4, &n), ==, 0);
        g_assert_cmpint(n, ==, 3);
        assert_compressed(be, &runs[1], UNIT, 2);
        g_assert_cmpint(runs[1].alg, ==, EXTREE_COMPRESS_ZLIB);
        g_assert_cmpint(runs[2].type, ==, EXTREE_RUN_DATA);
    }
    /* ... and one for block status */
    {
        ExtreeCursor c;

        extree_cursor_init(&c, t);
        g_assert_cmpint(extree_cursor_query(&c, 0, VSIZE,
                                            EXTREE_COALESCE_STATUS, &run),
                        ==, 0);
        g_assert_cmpint(run.type, ==, EXTREE_RUN_COMPRESSED);
        g_assert_cmpuint(run.length, ==, 2 * UNIT);
        extree_cursor_release(&c);
    }
    ct_check_clean(t, &res);
    g_assert_cmpuint(res.compressed_bytes, ==, 2 * UNIT);
    g_assert_cmpuint(res.data_bytes, ==, 3 * UNIT);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Never split: an update that covers part of a COMPRESSED extent fails
 * with -EINVAL and changes nothing; one that covers it whole frees the
 * payload
 */
static void test_never_split(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    uint64_t free0, host, got;
    ExtreeRun run;

    put_compressed(t, be, UNIT, UNIT, 5, EXTREE_COMPRESS_ZSTD);
    g_assert_cmpint(extree_commit(t), ==, 0);
    free0 = extree_free_bytes(t);

    g_assert_cmpint(extree_punch(t, UNIT + BS, BS), ==, -EINVAL);
    g_assert_cmpint(extree_punch(t, 0, UNIT + BS), ==, -EINVAL);
    g_assert_cmpint(extree_punch(t, 2 * UNIT - BS, 2 * BS), ==, -EINVAL);
    g_assert_cmpint(extree_set_zero(t, UNIT, UNIT - BS), ==, -EINVAL);
    g_assert_cmpint(extree_alloc_data(t, UNIT, BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_map_data(t, UNIT + BS, BS, host), ==, -EINVAL);
    g_assert_cmpint(extree_free_data(t, host, got), ==, 0);
    g_assert_cmpint(extree_set_virtual_size(t, UNIT + UNIT / 2), ==,
                    -EINVAL);
    g_assert_false(extree_is_broken(t));
    g_assert_cmpint(ct_lookup1(t, UNIT, &run), ==, 0);
    assert_compressed(be, &run, UNIT, 5);
    ct_check_clean(t, NULL);

    /* whole: the payload's block is free after the commit (nodes move) */
    g_assert_cmpint(extree_punch(t, 0, 3 * UNIT), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_free_bytes(t), >=,
                     free0 + EXTREE_ROUND_UP(run.payload_len, BS));
    g_assert_cmpint(ct_lookup1(t, UNIT, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A rewrite in pieces: the compressed extent becomes DATA in one update */
static void test_map_pieces(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    uint64_t host[3], len[3] = { BS, UNIT - 3 * BS, 2 * BS }, got;
    ExtreeRun runs[4];
    int n;

    put_compressed(t, be, 0, UNIT, 6, EXTREE_COMPRESS_ZLIB);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (int i = 0; i < 3; i++) {
        g_assert_cmpint(extree_alloc_data(t, 0, len[i], &host[i], &got), ==,
                        0);
        g_assert_cmpuint(got, ==, len[i]);
    }
    /* not the whole extent: refused, nothing changed */
    g_assert_cmpint(extree_map_data_pieces(t, 0, host, len, 2), ==, -EINVAL);
    g_assert_cmpint(extree_map_data_pieces(t, 0, host, len, 3), ==, 0);
    /* (pieces contiguous in the host are merged) */
    g_assert_cmpint(extree_lookup(t, 0, UNIT, runs, 4, &n), ==, 0);
    for (int i = 0, g = 0; i < 3; g += len[i], i++) {
        g_assert_cmpint(ct_lookup1(t, g, &runs[0]), ==, 0);
        g_assert_cmpint(runs[0].type, ==, EXTREE_RUN_DATA);
        g_assert_cmpuint(runs[0].host, ==, host[i]);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Snapshots share compressed extents: counted, kept, freed by the last */
static void test_snapshot_share(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeRun run;
    int idx;

    put_compressed(t, be, 0, UNIT, 7, EXTREE_COMPRESS_ZSTD);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    ct_check_clean(t, NULL);
    /* the live tree lets go of it: the snapshot keeps the payload */
    g_assert_cmpint(extree_punch(t, 0, UNIT), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    g_assert_cmpint(ct_lookup1(t, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    extree_close(t);

    t = ct_open_opts(be, true, 0, 0);
    idx = extree_snapshot_find(t, info.id);
    g_assert_cmpint(idx, >=, 0);
    g_assert_cmpint(extree_snapshot_load_tmp(t, idx), ==, 0);
    g_assert_cmpint(ct_lookup1(t, BS, &run), ==, 0);
    assert_compressed(be, &run, UNIT, 7);
    extree_close(t);

    /* revert, then delete the snapshot: the live tree has it again */
    t = ct_open(be);
    g_assert_cmpint(extree_snapshot_goto(t, idx), ==, 0);
    g_assert_cmpint(extree_snapshot_delete(t, idx), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(ct_lookup1(t, 0, &run), ==, 0);
    assert_compressed(be, &run, UNIT, 7);
    ct_check_clean(t, NULL);
    /* and the last reference frees it */
    g_assert_cmpint(extree_punch(t, 0, UNIT), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    g_assert_true(extree_alloc_is_free(t, run.host,
                                       EXTREE_ROUND_UP(run.payload_len, BS)));
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Bad map requests are refused before anything changes */
static void test_map_bad_args(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    uint64_t host, got;

    g_assert_cmpint(extree_alloc_data(t, 0, BS, &host, &got), ==, 0);
    /* payload longer than the extent, empty, bad algorithm, too long */
    g_assert_cmpint(extree_map_compressed(t, 0, BS, host, BS + 1,
                                          EXTREE_COMPRESS_ZSTD), ==, -EINVAL);
    g_assert_cmpint(extree_map_compressed(t, 0, UNIT, host, 0,
                                          EXTREE_COMPRESS_ZSTD), ==, -EINVAL);
    g_assert_cmpint(extree_map_compressed(t, 0, UNIT, host, 100, 3), ==,
                    -EINVAL);
    g_assert_cmpint(extree_map_compressed(t, 0, 4 * 1024 * 1024, host, 100,
                                          EXTREE_COMPRESS_ZSTD), ==, -EINVAL);
    /* a payload of two blocks where one was allocated */
    g_assert_cmpint(extree_map_compressed(t, 0, UNIT, host, BS + 1,
                                          EXTREE_COMPRESS_ZSTD), ==, -EINVAL);
    g_assert_cmpint(extree_free_data(t, host, got), ==, 0);
    g_assert_false(extree_is_broken(t));
    /* refused first maps leave no compressed bit behind */
    g_assert_false(extree_incompat_features(t) & EXTREE_INCOMPAT_COMPRESSED);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Patch the first item of the extent root and fix the node's checksum */
static void patch_item(ExtreeBackend *be, uint64_t root, int field_off,
                       int size, uint64_t val)
{
    uint8_t *buf = ct_node_read(be, root, NS);

    for (int i = 0; i < size; i++) {
        buf[EXTREE_NODE_HEADER_SIZE + field_off + i] = val >> (8 * i);
    }
    ct_node_write(be, root, buf, NS, true);
    g_free(buf);
}

/* Damaged COMPRESSED items: each named when the leaf is read */
static void test_validation(void)
{
    static const struct {
        int off, size;
        uint64_t val;
        const char *msg;
    } cases[] = {
        { EXT_IT_FLAGS, 4, (3u << 24) | 100, "bad compression algorithm" },
        { EXT_IT_FLAGS, 4, 2u << 24, "bad compressed item" },
        { EXT_IT_FLAGS, 4, (2u << 24) | (UNIT + 1), "bad compressed item" },
        { EXT_IT_LEN, 8, 4 * 1024 * 1024, "bad compressed item" },
        { EXT_IT_HOST, 8, 4096 * 1024 * 1024ULL, "bad host range" },
        { EXT_IT_HOST, 8, 4097, "bad host range" },
    };

    for (unsigned c = 0; c < G_N_ELEMENTS(cases) + 1; c++) {
        ExtreeBackend *be = ct_create(VSIZE * 2, BS, NS);
        Extree *t = ct_open(be);
        uint64_t root;
        ExtreeRun run;
        const char *msg;
        char *err = NULL;

        put_compressed(t, be, 0, UNIT, 8, EXTREE_COMPRESS_ZSTD);
        g_assert_cmpint(extree_commit(t), ==, 0);
        root = t->trees[EXTREE_TREE_EXTENT].root;
        extree_close(t);
        if (c < G_N_ELEMENTS(cases)) {
            patch_item(be, root, cases[c].off, cases[c].size, cases[c].val);
        } else {
            /* the compressed bit cleared: the item is not allowed */
            ExtreeDiskSuper sb;

            for (int s = 0; s < 2; s++) {
                g_assert_cmpint(be->ops->pread(be->opaque, s * EXTREE_SB_SIZE,
                                               &sb, sizeof(sb)), ==, 0);
                sb.incompat_features &=
                    GUINT64_TO_LE(~EXTREE_INCOMPAT_COMPRESSED);
                ct_write_super(be, s, &sb);
            }
        }
        msg = c < G_N_ELEMENTS(cases) ? cases[c].msg
                                      : "without the compressed feature";
        ct_corrupt_calls = 0;
        if (extree_open(be, &(ExtreeOpenOptions) { .read_only = true }, &t,
                        &err) == 0) {
            extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
            g_assert_cmpint(ct_lookup1(t, 0, &run), ==, -EIO);
            g_assert_cmpint(ct_corrupt_calls, >, 0);
            g_assert_nonnull(strstr(extree_last_error(t), msg));
            extree_close(t);
        } else {
            /* the open read the leaf already */
            g_assert_nonnull(strstr(err, msg));
            g_free(err);
        }
        extree_mem_backend_free(be);
    }
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/compress/codec-roundtrip", test_codec_roundtrip);
    g_test_add_func("/compress/codec-incompressible",
                    test_codec_incompressible);
    g_test_add_func("/compress/codec-damaged", test_codec_damaged);
    g_test_add_func("/compress/codec-zstd-no-checksum",
                    test_codec_zstd_no_checksum);
    g_test_add_func("/compress/map-lookup-reopen", test_map_lookup_reopen);
    g_test_add_func("/compress/never-split", test_never_split);
    g_test_add_func("/compress/map-pieces", test_map_pieces);
    g_test_add_func("/compress/snapshot-share", test_snapshot_share);
    g_test_add_func("/compress/map-bad-args", test_map_bad_args);
    g_test_add_func("/compress/validation", test_validation);
    return g_test_run();
}
