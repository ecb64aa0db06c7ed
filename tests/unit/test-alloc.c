/*
 * Unit tests: allocator placement, pending frees, free-space tree sync
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 4096
#define NS 16384

/* Sequential guest writes, commits in between, make ONE extent */
static void test_sequential_one_extent(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeRun runs[4];
    int n;

    for (int i = 0; i < 2000; i++) {
        ct_write(t, (uint64_t)i * BS, BS);
        if (i % 64 == 63) {
            g_assert_cmpint(extree_commit(t), ==, 0);
        }
    }
    g_assert_cmpuint(extree_extent_count(t), ==, 1);
    g_assert_cmpint(extree_lookup(t, 0, 2000 * BS, runs, 4, &n), ==, 0);
    g_assert_cmpint(n, ==, 1);
    g_assert_cmpint(runs[0].type, ==, EXTREE_RUN_DATA);
    g_assert_cmpuint(runs[0].length, ==, 2000 * BS);
    ct_check_clean(t, NULL);

    /* and it keeps growing after a reopen */
    extree_close(t);
    t = ct_open(be);
    for (int i = 2000; i < 2100; i++) {
        ct_write(t, (uint64_t)i * BS, BS);
    }
    g_assert_cmpuint(extree_extent_count(t), ==, 1);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* The block after the guest neighbour's extent is used when it is free */
static void test_near_hint(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeRun runs[2];
    uint64_t host, got;
    int n;

    ct_write(t, 0, 4 * BS);            /* A */
    ct_write(t, 1000 * BS, 4 * BS);    /* B, placed right after A */
    g_assert_cmpuint(extree_extent_count(t), ==, 2);
    g_assert_cmpint(extree_punch(t, 1000 * BS, 4 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* B's space is free again: growing A reuses it, A stays one extent */
    g_assert_cmpint(extree_alloc_data(t, 4 * BS, 2 * BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_map_data(t, 4 * BS, got, host), ==, 0);
    g_assert_cmpuint(got, ==, 2 * BS);
    g_assert_cmpint(extree_lookup(t, 0, 6 * BS, runs, 2, &n), ==, 0);
    g_assert_cmpint(n, ==, 1);
    g_assert_cmpuint(extree_extent_count(t), ==, 1);

    /*
     * before the following extent: free the first half of 100..103,
     * then rewriting it lands right before the second half
     */
    ct_write(t, 100 * BS, 4 * BS);
    g_assert_cmpint(extree_punch(t, 100 * BS, 2 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_write(t, 100 * BS, 2 * BS);
    g_assert_cmpint(extree_lookup(t, 100 * BS, 4 * BS, runs, 2, &n), ==, 0);
    g_assert_cmpint(n, ==, 1);
    g_assert_cmpuint(runs[0].length, ==, 4 * BS);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

static bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen)
{
    return a < b + blen && b < a + alen;
}

/*
 * After a reopen, a free range of a node up to 256 KiB counts as node
 * space: data with no neighbour to follow goes first fit into the longer
 * free ranges, not into the lower short hole.  A hole shorter than a node
 * is data's again: first fit fills it.
 */
static void test_short_free_after_open(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t short_host, sub_host, long_host, host, got;
    ExtreeRun run;
    int n;

    ct_write(t, 0, 1000 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_lookup(t, 100 * BS, BS, &run, 1, &n), ==, 0);
    short_host = run.host;
    g_assert_cmpint(extree_lookup(t, 300 * BS, BS, &run, 1, &n), ==, 0);
    sub_host = run.host;
    g_assert_cmpint(extree_lookup(t, 500 * BS, BS, &run, 1, &n), ==, 0);
    long_host = run.host;
    g_assert_cmpuint(short_host, <, sub_host);
    g_assert_cmpuint(sub_host, <, long_host);
    g_assert_cmpint(extree_punch(t, 100 * BS, 4 * BS), ==, 0);
    g_assert_cmpint(extree_punch(t, 300 * BS, BS), ==, 0);
    g_assert_cmpint(extree_punch(t, 500 * BS, 400 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    /*
     * Single blocks at guest offsets apart from each other, until one
     * lands in the long range: the lower free space fills first, and the
     * short hole not at all (first fit over every free range would fill
     * it before reaching the long one)
     */
    t = ct_open(be);
    g_assert_true(extree_alloc_is_free(t, short_host, 4 * BS));
    g_assert_true(extree_alloc_is_free(t, sub_host, BS));
    for (int i = 0;; i++) {
        uint64_t guest = (uint64_t)(5000 + 2 * i) * BS;

        g_assert_cmpint(i, <, 5000);
        g_assert_cmpint(extree_alloc_data(t, guest, BS, &host, &got), ==, 0);
        g_assert_cmpuint(got, ==, BS);
        g_assert_false(overlaps(host, got, short_host, 4 * BS));
        g_assert_cmpint(extree_map_data(t, guest, got, host), ==, 0);
        if (overlaps(host, got, long_host, 400 * BS)) {
            break;
        }
    }
    g_assert_true(extree_alloc_is_free(t, short_host, 4 * BS));
    g_assert_false(extree_alloc_is_free(t, sub_host, BS));
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Space freed in a transaction is reused only after its commit */
static void test_pending_free(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeRun run;
    uint64_t h, host, got, free_before;
    int n;

    ct_write(t, 0, 16 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_lookup(t, 0, 16 * BS, &run, 1, &n), ==, 0);
    h = run.host;

    free_before = extree_free_bytes(t);
    g_assert_cmpint(extree_punch(t, 0, 16 * BS), ==, 0);
    g_assert_cmpuint(extree_free_bytes(t), >=, free_before + 16 * BS);
    for (int i = 0; i < 8; i++) {
        g_assert_cmpint(extree_alloc_data(t, (1000 + 100 * i) * BS, 16 * BS,
                                          &host, &got), ==, 0);
        g_assert_false(overlaps(host, got, h, 16 * BS));
        g_assert_cmpint(extree_free_data(t, host, got), ==, 0);
    }
    /* a node for the next CoW does not get it either */
    ct_write(t, 5000 * BS, BS);
    g_assert_cmpint(extree_lookup(t, 5000 * BS, BS, &run, 1, &n), ==, 0);
    g_assert_false(overlaps(run.host, BS, h, 16 * BS));

    g_assert_cmpint(extree_commit(t), ==, 0);
    /* now it is the lowest fitting free range: first fit takes it */
    g_assert_cmpint(extree_alloc_data(t, 3000 * BS, 16 * BS, &host, &got),
                    ==, 0);
    g_assert_true(overlaps(host, got, h, 16 * BS));
    g_assert_cmpint(extree_map_data(t, 3000 * BS, got, host), ==, 0);

    /* freeing free space, or mapping it, is refused */
    g_assert_cmpint(extree_alloc_data(t, 7000 * BS, BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_free_data(t, host, got), ==, 0);
    g_assert_cmpint(extree_free_data(t, host, got), ==, -EINVAL);
    g_assert_cmpint(extree_map_data(t, 7000 * BS, got, host), ==, -EINVAL);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Many scattered frees: the free tree grows several levels and the sync
 * loop reaches its fixed point; open loads the same free space
 */
static void test_free_tree_sync(void)
{
    ExtreeBackend *be = ct_create(1 << 26, 512, 4096);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    uint64_t free_bytes;

    for (int i = 0; i < 20000; i++) {
        ct_write(t, (uint64_t)i * 512, 512);
        /* interleave with zero items so data extents are not merged */
        g_assert_cmpint(extree_set_zero(t, (uint64_t)(40000 + i) * 512, 512),
                        ==, 0);
        if (i % 3 == 0) {
            g_assert_cmpint(extree_set_zero(t, (uint64_t)(i + 1) * 512,
                                            512), ==, 0);
        }
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* free every other block of data: scattered free ranges */
    for (int i = 0; i < 20000; i += 2) {
        g_assert_cmpint(extree_punch(t, (uint64_t)i * 512, 512), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, &res);
    if (g_test_verbose()) {
        g_printerr("free items %" PRIu64 ", nodes %" PRIu64 "\n",
                   res.free_items, res.nodes);
    }
    g_assert_cmpuint(res.free_items, >, 1000);
    g_assert_cmpuint(res.free_bytes, ==, extree_free_bytes(t));
    free_bytes = extree_free_bytes(t);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpuint(extree_free_bytes(t), ==, free_bytes);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Host range of the DATA run at @guest */
static uint64_t host_of(Extree *t, uint64_t guest)
{
    ExtreeRun run;
    int n;

    g_assert_cmpint(extree_lookup(t, guest, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    return run.host;
}

/*
 * Free space is reused however it is spread: the lowest range that fits,
 * found among thousands; when none fits but much is free, a partial
 * allocation from the longest range instead of growing the file.
 */
static void test_fragmented_reuse(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t host_end, host, got, low, total = 0;
    int pieces = 0;

    /* 4000 one-block extents, not host-contiguous in guest order */
    for (int i = 0; i < 4000; i++) {
        ct_write(t, (uint64_t)i * 2 * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* punch every other one: 2000 one-block holes all over the file */
    for (int i = 0; i < 4000; i += 2) {
        g_assert_cmpint(extree_punch(t, (uint64_t)i * 2 * BS, BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    host_end = extree_host_end(t);
    g_assert_cmpuint(extree_free_bytes(t), >=, 2000 * BS);

    /* one block at a guest offset with no neighbour: the lowest hole */
    low = host_of(t, 2 * BS);
    for (int i = 4; i < 4000; i += 4) {
        low = MIN(low, host_of(t, (uint64_t)i * 2 * BS + 2 * BS));
    }
    g_assert_cmpint(extree_alloc_data(t, 100000 * BS, BS, &host, &got), ==,
                    0);
    g_assert_cmpuint(got, ==, BS);
    g_assert_cmpuint(host, <, low);
    g_assert_cmpint(extree_free_data(t, host, got), ==, 0);

    /*
     * 64 blocks: no hole is that long, a quarter of the file is free:
     * pieces of existing space, the file does not grow
     */
    while (total < 64 * BS) {
        g_assert_cmpint(extree_alloc_data(t, (200000 + total / BS) * BS,
                                          64 * BS - total, &host, &got), ==,
                        0);
        g_assert_cmpuint(got, <, 64 * BS);
        g_assert_cmpuint(host + got, <=, host_end);
        g_assert_cmpint(extree_map_data(t, (200000 + total / BS) * BS, got,
                                        host), ==, 0);
        total += got;
        pieces++;
    }
    g_assert_cmpuint(extree_host_end(t), ==, host_end);
    g_assert_cmpint(pieces, >, 1);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Rewriting, punching and zeroing at random for a long time: the file
 * stays within a small multiple of the space in use
 */
static void test_bounded_growth(void)
{
    uint64_t vsize = 16 << 20, nblocks = vsize / BS;
    ExtreeBackend *be = ct_create(vsize, BS, NS);
    Extree *t = ct_open(be);
    GRand *r = g_rand_new_with_seed(test_seed("churn", 17));
    uint64_t max_end = 0;

    for (int op = 0; op < 30000; op++) {
        uint64_t n = g_rand_int_range(r, 0, 8) ? g_rand_int_range(r, 1, 9)
                                              : g_rand_int_range(r, 1, 257);
        uint64_t blk = g_rand_int_range(r, 0, nblocks - n + 1);
        int kind = g_rand_int_range(r, 0, 10);

        if (kind < 6) {
            ct_write(t, blk * BS, n * BS);
        } else if (kind < 8) {
            g_assert_cmpint(extree_punch(t, blk * BS, n * BS), ==, 0);
        } else {
            g_assert_cmpint(extree_set_zero(t, blk * BS, n * BS), ==, 0);
        }
        if (op % 400 == 399) {
            g_assert_cmpint(extree_commit(t), ==, 0);
        }
        max_end = MAX(max_end, extree_host_end(t));
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    if (g_test_verbose()) {
        g_printerr("host_end max %" PRIu64 " MiB, end %" PRIu64 " MiB, free %"
                   PRIu64 " MiB\n", max_end >> 20, extree_host_end(t) >> 20,
                   extree_free_bytes(t) >> 20);
    }
    /*
     * data (at most the virtual size), one transaction's frees, free
     * space below 1/4 of the file, metadata
     */
    g_assert_cmpuint(max_end, <=, 3 * vsize);
    ct_check_clean(t, NULL);
    g_rand_free(r);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * The nodes one commit writes come from the metadata reserve, mostly
 * consecutive: few, large writes
 */
static void test_metadata_reserve(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, 4096);
    Extree *t = ct_open(be);
    ExtreeMemStats st;
    ExtreeStats ts0, ts1;

    for (int i = 0; i < 3000; i++) {
        ct_write(t, (uint64_t)i * 2 * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (int round = 0; round < 3; round++) {
        for (int i = round; i < 3000; i += 7) {
            g_assert_cmpint(extree_set_zero(t, (uint64_t)i * 2 * BS, BS), ==,
                            0);
        }
        extree_stats(t, &ts0);
        extree_mem_backend_reset_stats(be);
        g_assert_cmpint(extree_commit(t), ==, 0);
        extree_mem_backend_stats(be, &st);
        extree_stats(t, &ts1);
        if (g_test_verbose()) {
            g_printerr("%" PRIu64 " nodes in %" PRIu64 " writes\n",
                       ts1.nodes_written - ts0.nodes_written, st.writes);
        }
        g_assert_cmpuint(ts1.nodes_written - ts0.nodes_written, >, 20);
        /* the superblock, and the nodes in a handful of runs */
        g_assert_cmpuint(st.writes, <=, 6);
    }
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* One free range of the model below, in the set open put it in */
typedef struct LoadedRange {
    uint64_t start, len;
    bool nfree;
} LoadedRange;

/* The lowest range of @nfree's set with at least @len bytes, or -1 */
static int model_first_fit(GArray *m, bool nfree, uint64_t len)
{
    for (guint i = 0; i < m->len; i++) {
        LoadedRange *r = &g_array_index(m, LoadedRange, i);
        if (r->nfree == nfree && r->len >= len) {
            return i;
        }
    }
    return -1;
}

/*
 * Open builds the free sets from the free-space tree's ranges in order,
 * along the treap's right spine, not by search and insert.  Over a
 * thousand ranges of all lengths, then first-fit allocations of random sizes:
 * each must be the lowest fit of a model read from the tree itself, and a
 * write longer than any range must get the longest (a longest-range field
 * left stale by the build would skip a fit, or find a shorter range).
 */
static void test_load_in_order(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    GRand *r = g_rand_new_with_seed(test_seed("load-in-order", 5));
    GArray *m = g_array_new(false, false, sizeof(LoadedRange));
    Extree *t = ct_open(be);
    uint64_t off = 0, end = 128 << 20;
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    int ret;

    ct_write(t, 0, end);
    g_assert_cmpint(extree_commit(t), ==, 0);
    while (off < end) {
        uint64_t len = g_rand_int_range(r, 0, 4) ? g_rand_int_range(r, 1, 9)
                                                : g_rand_int_range(r, 9, 100);
        len = MIN(len * BS, end - off);
        g_assert_cmpint(extree_punch(t, off, len), ==, 0);
        off += len + g_rand_int_range(r, 1, 5) * BS;
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    t = ct_open(be);
    /* open read the first and last leaf: the rest joins by search */
    g_assert_true(t->space.alloc_partial);
    g_assert_cmpint(extree_freetree_load_rest(t), ==, 0);
    g_assert_false(t->space.alloc_partial);
    for (ret = extree_bt_first(t, &t->trees[EXTREE_TREE_FREE], 0, &p, &it);
         ret == 0;
         ret = extree_bt_next(t, &t->trees[EXTREE_TREE_FREE], &p, &it)) {
        LoadedRange lr = {
            it.key, it.length,
            it.length >= NS && it.length < 256 * 1024,
        };
        g_array_append_val(m, lr);
    }
    extree_path_release(t, &p);
    g_assert_cmpint(ret, ==, 1);                       /* the end */
    g_assert_cmpuint(m->len, >, 1000);

    /* a data write longer than any range takes the longest one */
    {
        uint64_t max[2] = { 0, 0 }, host, got;
        bool nfree;
        int k = -1;

        for (guint i = 0; i < m->len; i++) {
            LoadedRange *lr = &g_array_index(m, LoadedRange, i);
            max[lr->nfree] = MAX(max[lr->nfree], lr->len);
        }
        nfree = max[0] < max[1];
        k = model_first_fit(m, nfree, max[nfree]);
        g_assert_cmpint(extree_alloc_take_any(t, 1 << 30, &host, &got), ==,
                        0);
        g_assert_cmphex(host, ==, g_array_index(m, LoadedRange, k).start);
        g_assert_cmphex(got, ==, max[nfree]);
        g_array_remove_index(m, k);
    }

    for (int i = 0; i < 2000; i++) {
        uint64_t len = g_rand_int_range(r, 1, 120) * BS, host;
        int k = model_first_fit(m, false, len);
        LoadedRange *lr;

        if (k < 0) {
            k = model_first_fit(m, true, len);
        }
        if (k < 0) {
            break;
        }
        g_assert_cmpint(extree_alloc_contig(t, len, &host), ==, 0);
        lr = &g_array_index(m, LoadedRange, k);
        g_assert_cmphex(host, ==, lr->start);
        lr->start += len;
        lr->len -= len;
    }
    g_array_free(m, true);
    g_rand_free(r);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * An update that allocates nodes only (and a snapshot table's run) needs
 * no growth while one free range holds it and a reserve's worth of nodes:
 * the bound is host_end itself then, and such updates keep to it
 */
static void test_grow_bound_nodes(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t end;

    /* nothing free: the nodes come from the end of the file */
    ct_write(t, 0, 64 << 20);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), >, end);

    /* most of the data discarded: one long free range inside the file */
    ct_write(t, 64 << 20, BS);
    g_assert_cmpint(extree_punch(t, 0, 60 << 20), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), ==, end);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 8 * BS), ==, end);
    /* a run no free range holds */
    g_assert_cmpuint(extree_grow_bound_nodes(t, 100 << 20), >,
                     end + (100 << 20));
    /* data still counts the reserve on top */
    g_assert_cmpuint(extree_grow_bound(t, BS), >, end);

    /* node-only updates over many leaves keep within the bound */
    for (int i = 0; i < 2000; i++) {
        g_assert_cmpint(extree_set_zero(t, (uint64_t)(61 << 20) +
                                        (uint64_t)i * 2 * BS, BS), ==, 0);
    }
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), ==, end);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <=, end);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * A backend of fixed size (a block device): writes fill it up to the
 * metadata headroom, the last one partially, then fail with -ENOSPC; the
 * image commits and checks clean, nothing lies past the limit, and space
 * freed by a discard is used again
 */
static void test_host_limit(void)
{
    uint64_t limit = 2 << 20, vsize = 64 << 20, guest = 0;
    ExtreeBackend *be = ct_create(vsize, BS, NS);
    Extree *t = ct_open(be);
    uint64_t host, got;
    int ret = 0;

    extree_set_host_limit(t, limit);
    while (guest < vsize) {
        /* every other 4 blocks: one extent each, so the tree grows too */
        ret = extree_alloc_data(t, guest, 4 * BS, &host, &got);
        if (ret < 0) {
            break;
        }
        g_assert_cmpuint(host + got, <=, limit);
        g_assert_cmpint(extree_map_data(t, guest, got, host), ==, 0);
        guest += got == 4 * BS ? 8 * BS : got;
    }
    g_assert_cmpint(ret, ==, -ENOSPC);
    g_assert_cmpuint(guest, >, limit / 4);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <=, limit);
    ct_check_clean(t, NULL);

    /* a discard makes room again, below the limit */
    g_assert_cmpint(extree_punch(t, 0, 64 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_alloc_data(t, vsize - 4 * BS, 4 * BS, &host,
                                      &got), ==, 0);
    g_assert_cmpuint(host + got, <=, limit);
    g_assert_cmpint(extree_map_data(t, vsize - 4 * BS, got, host), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * A backend found to be of fixed size after an open that read the
 * free-space tree in part: nodes can no longer grow the file, so the rest
 * is read at once, and all free space is there for them.  With no room
 * left to grow, a reserve taken from free space was once cut to nothing
 * (and handed out nodes past its end, over free space): commit looped.
 */
static void test_host_limit_partial(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t free_bytes, end;

    ct_write(t, 0, 32 << 20);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t b = 0; b < 8192; b += 8) {
        g_assert_cmpint(extree_punch(t, b * BS, 4 * BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    t = ct_open(be);
    g_assert_true(t->space.alloc_partial);
    free_bytes = extree_free_bytes(t);
    end = extree_host_end(t);
    extree_set_host_limit(t, end);
    g_assert_false(t->space.alloc_partial);
    g_assert_cmpuint(extree_free_bytes(t), ==, free_bytes);
    /* the freed 16 KiB holes hold the nodes of more punches */
    for (uint64_t b = 4; b < 8192; b += 64) {
        g_assert_cmpint(extree_punch(t, b * BS, BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <=, end);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

static uint64_t nodes_read(Extree *t)
{
    ExtreeStats st;

    extree_stats(t, &st);
    return st.cache_misses + st.readahead;
}

/*
 * After an open that read the free-space tree in part, the bound for an
 * update that allocates nodes only looks for a long free range in the
 * unread part by the subtrees' child_bytes: it reads the leaf that holds
 * one, and nothing where none can be.  The update then takes its nodes
 * there without growing the file.
 */
static void test_grow_bound_partial(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t end, before;

    ct_write(t, 0, 64 << 20);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t b = 0; b < 16384; b += 2) {
        if (b < 2400 || b >= 14000) {
            g_assert_cmpint(extree_punch(t, b * BS, BS), ==, 0);
        }
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    /* short free ranges only: the bound grows, and reads nothing */
    t = ct_open(be);
    g_assert_true(t->space.alloc_partial);
    end = extree_host_end(t);
    before = nodes_read(t);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), >, end);
    g_assert_cmpuint(nodes_read(t), ==, before);
    g_assert_true(t->space.alloc_partial);
    /* 8 MiB freed in the middle of the tree's keys */
    g_assert_cmpint(extree_punch(t, 6000 * BS, 2000 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    t = ct_open(be);
    g_assert_true(t->space.alloc_partial);
    g_assert_false(extree_alloc_fits(t, extree_alloc_nodes_need(t, 0)));
    end = extree_host_end(t);
    before = nodes_read(t);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), ==, end);
    g_assert_cmpuint(nodes_read(t) - before, <=, 2);
    g_assert_true(t->space.alloc_partial);
    g_assert_true(extree_alloc_fits(t, extree_alloc_nodes_need(t, 0)));
    g_assert_cmpint(extree_punch(t, 2 * BS, 4000 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <=, end);
    g_assert_true(t->space.alloc_partial);
    ct_check_clean(t, NULL);
    g_assert_false(t->space.alloc_partial);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Free space in node-sized pieces, none as long as a reserve: an update
 * that allocates nodes only needs no growth while the pieces hold its
 * nodes and those of its commit, and after an open that read the free
 * tree in part the known pieces count without reading more.  Random
 * updates check what the driver relies on: host_end stays within the
 * bound taken before the update, and after the commit within the larger
 * of that and the bound taken before the commit.
 */
static void test_grow_bound_room(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    GRand *r = g_rand_new_with_seed(23);
    Extree *t = ct_open(be);
    uint64_t end, before, b2;
    bool grew = false, kept = false;

    ct_write(t, 0, 64 << 20);
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* 16 KiB (one node) free in every 32 KiB */
    for (uint64_t b = 0; b < 16384; b += 8) {
        g_assert_cmpint(extree_punch(t, b * BS, 4 * BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    g_assert_false(extree_alloc_fits(t, extree_alloc_nodes_need(t, 0)));
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), ==, end);
    g_assert_cmpuint(extree_grow_bound_nodes(t, NS), ==, end);
    /* a run no piece holds */
    g_assert_cmpuint(extree_grow_bound_nodes(t, 8 << 20), >, end);
    extree_close(t);

    t = ct_open(be);
    g_assert_true(t->space.alloc_partial);
    before = nodes_read(t);
    g_assert_cmpuint(extree_grow_bound_nodes(t, 0), ==, extree_host_end(t));
    g_assert_cmpuint(nodes_read(t), ==, before);

    g_assert_true(t->space.alloc_partial);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);

    /*
     * Data and free space in alternate 4 KiB pieces: the free space holds
     * no node, and frees all over it make the commit's sync copy many
     * leaves of the free tree.  Transactions of 1 to 400 single-block
     * updates, the last third after a snapshot: the nodes each update
     * takes, and those its commit takes, stay within the estimate made
     * before it.
     */
    be = ct_create(1 << 30, BS, NS);
    t = ct_open(be);
    ct_write(t, 0, 131072 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t b = 1; b < 131072; b += 2) {
        g_assert_cmpint(extree_punch(t, b * BS, BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    for (int i = 0; i < 90; i++) {
        int n = g_rand_int_range(r, 0, 3) ? g_rand_int_range(r, 1, 4)
                                          : g_rand_int_range(r, 100, 400);
        ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
        ExtreeStats st0, st1;
        uint64_t est;

        /*
         * Then with a snapshot: updates copy shared leaves, and the
         * commit syncs the reference count tree too
         */
        if (i == 60) {
            g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
            g_assert_cmpint(extree_commit(t), ==, 0);
        }

        for (int j = 0; j < n; j++) {
            uint64_t blk = g_rand_int_range(r, 0, 131072);

            est = extree_alloc_nodes_estimate(t);
            extree_stats(t, &st0);
            if (g_rand_boolean(r)) {
                g_assert_cmpint(extree_punch(t, blk * BS, BS), ==, 0);
            } else {
                g_assert_cmpint(extree_set_zero(t, blk * BS, BS), ==, 0);
            }
            extree_stats(t, &st1);
            g_assert_cmpuint(st1.dirty_nodes - st0.dirty_nodes, <=, est);
        }
        est = extree_alloc_nodes_estimate(t);
        b2 = extree_grow_bound_nodes(t, 0);
        end = extree_host_end(t);
        grew |= b2 > end;
        kept |= b2 == end;
        extree_stats(t, &st0);
        g_assert_cmpint(extree_commit(t), ==, 0);
        extree_stats(t, &st1);
        g_assert_cmpuint(st1.nodes_written - st0.nodes_written -
                         st0.dirty_nodes, <=, est);
        g_assert_cmpuint(extree_host_end(t), <=, MAX(end, b2));
    }
    /* both outcomes were seen: the test weighs the estimate */
    g_assert_true(grew);
    g_assert_true(kept);
    ct_check_clean(t, NULL);
    extree_close(t);
    g_rand_free(r);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/alloc/host-limit", test_host_limit);
    g_test_add_func("/alloc/sequential-one-extent",
                    test_sequential_one_extent);
    g_test_add_func("/alloc/near-hint", test_near_hint);
    g_test_add_func("/alloc/short-free-after-open",
                    test_short_free_after_open);
    g_test_add_func("/alloc/pending-free", test_pending_free);
    g_test_add_func("/alloc/free-tree-sync", test_free_tree_sync);
    g_test_add_func("/alloc/fragmented-reuse", test_fragmented_reuse);
    g_test_add_func("/alloc/bounded-growth", test_bounded_growth);
    g_test_add_func("/alloc/metadata-reserve", test_metadata_reserve);
    g_test_add_func("/alloc/grow-bound-nodes", test_grow_bound_nodes);
    g_test_add_func("/alloc/load-in-order", test_load_in_order);
    g_test_add_func("/alloc/grow-bound-room", test_grow_bound_room);
    g_test_add_func("/alloc/grow-bound-partial", test_grow_bound_partial);
    g_test_add_func("/alloc/host-limit-partial", test_host_limit_partial);
    return g_test_run();
}
