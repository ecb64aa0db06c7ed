/*
 * Unit tests: B+tree insert/split/merge/delete and the cursor, against a
 * per-block array model.  Small nodes (4 KiB, 126 items a leaf) and 512-byte
 * blocks give deep trees quickly.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdio.h>

#include "core-test.h"

#define BS 512
#define NS 4096

typedef struct Blk {
    uint8_t type;               /* ExtreeRunType */
    uint64_t host;
} Blk;

typedef struct Model {
    uint64_t nblocks;
    Blk *b;
} Model;

static void model_check(Extree *t, Model *m)
{
    ExtreeCursor c;
    uint64_t g = 0, vs = m->nblocks * BS, items = 0;
    ExtreeStats before, after;

    /* The extent count equals the number of maximal mergeable runs */
    for (uint64_t i = 0; i < m->nblocks; i++) {
        Blk *b = &m->b[i];
        if (b->type == EXTREE_RUN_UNALLOC) {
            continue;
        }
        if (i == 0 || m->b[i - 1].type != b->type ||
            (b->type == EXTREE_RUN_DATA && m->b[i - 1].host + BS != b->host)) {
            items++;
        }
    }
    g_assert_cmpuint(extree_extent_count(t), ==, items);

    extree_stats(t, &before);
    extree_cursor_init(&c, t);
    while (g < vs) {
        ExtreeRun run;
        g_assert_cmpint(extree_cursor_query(&c, g, vs - g,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
        g_assert_cmpuint(run.guest, ==, g);
        g_assert_cmpuint(run.length, >, 0);
        g_assert_cmpuint(run.length % BS, ==, 0);
        for (uint64_t i = 0; i < run.length / BS; i++) {
            Blk *b = &m->b[g / BS + i];
            g_assert_cmpint(b->type, ==, run.type);
            if (run.type == EXTREE_RUN_DATA) {
                g_assert_cmphex(b->host, ==, run.host + i * BS);
            }
        }
        /* maximal: the next block does not continue the run */
        if (g + run.length < vs) {
            Blk *last = &m->b[(g + run.length) / BS - 1];
            Blk *nb = &m->b[(g + run.length) / BS];
            g_assert_true(nb->type != last->type ||
                          (nb->type == EXTREE_RUN_DATA &&
                           nb->host != last->host + BS));
        }
        g += run.length;
    }
    extree_cursor_release(&c);
    extree_stats(t, &after);
    /* the whole walk: one descent, the rest by next_leaf */
    g_assert_cmpuint(after.descents - before.descents, ==, 1);
}

static void model_set(Model *m, uint64_t guest, uint64_t bytes, uint8_t type,
                      uint64_t host)
{
    for (uint64_t i = 0; i < bytes / BS; i++) {
        m->b[guest / BS + i].type = type;
        m->b[guest / BS + i].host = type == EXTREE_RUN_DATA ? host + i * BS : 0;
    }
}

static void random_ops(uint64_t seed, int nops, uint64_t nblocks,
                       unsigned min_depth)
{
    ExtreeBackend *be = ct_create(nblocks * BS, BS, NS);
    Extree *t = ct_open(be);
    Model m = { nblocks, g_new0(Blk, nblocks) };
    GRand *r = g_rand_new_with_seed(test_seed("random_ops", seed));
    unsigned max_depth = 0;

    for (int op = 0; op < nops; op++) {
        uint64_t blk = g_rand_int_range(r, 0, nblocks);
        uint64_t len = g_rand_int_range(r, 1, 9);
        uint64_t n = MIN(len, nblocks - blk);
        uint64_t guest = blk * BS, bytes = n * BS;
        int kind = g_rand_int_range(r, 0, 10);

        if (kind < 6) {
            while (bytes) {
                uint64_t host, got;
                g_assert_cmpint(extree_alloc_data(t, guest, bytes, &host,
                                                  &got), ==, 0);
                g_assert_cmpint(extree_map_data(t, guest, got, host), ==, 0);
                model_set(&m, guest, got, EXTREE_RUN_DATA, host);
                guest += got;
                bytes -= got;
            }
        } else if (kind < 8) {
            g_assert_cmpint(extree_set_zero(t, guest, bytes), ==, 0);
            model_set(&m, guest, bytes, EXTREE_RUN_ZERO, 0);
        } else {
            g_assert_cmpint(extree_punch(t, guest, bytes), ==, 0);
            model_set(&m, guest, bytes, EXTREE_RUN_UNALLOC, 0);
        }
        max_depth = MAX(max_depth, extree_depth(t));
        if (op % 997 == 0) {
            model_check(t, &m);
        }
        if (g_rand_int_range(r, 0, 300) == 0) {
            g_assert_cmpint(extree_commit(t), ==, 0);
        }
    }
    model_check(t, &m);
    ct_check_clean(t, NULL);
    /* reopen: same mapping */
    extree_close(t);
    t = ct_open(be);
    model_check(t, &m);
    ct_check_clean(t, NULL);

    /* punch nearly everything: merges shrink the tree again */
    for (uint64_t b = 0; b < nblocks; b += 64) {
        uint64_t n = MIN(63, nblocks - b);
        g_assert_cmpint(extree_punch(t, b * BS, n * BS), ==, 0);
        model_set(&m, b * BS, n * BS, EXTREE_RUN_UNALLOC, 0);
    }
    model_check(t, &m);
    ct_check_clean(t, NULL);
    if (g_test_verbose()) {
        g_printerr("max depth %u, depth after punch %u\n", max_depth,
                   extree_depth(t));
    }
    g_assert_cmpuint(max_depth, >=, min_depth);
    g_assert_cmpuint(extree_depth(t), <, max_depth);

    extree_close(t);
    extree_mem_backend_free(be);
    g_rand_free(r);
    g_free(m.b);
}

static void test_random(void)
{
    random_ops(1, 60000, 131072, 3);
}

static void test_random_small(void)
{
    /* dense: lots of splitting and merging of neighbours */
    random_ops(7, 20000, 4096, 2);
}

/* Sequential appends split unevenly: leaves end up (almost) full */
static void test_sequential_fill(void)
{
    const uint64_t n = 20000;
    ExtreeBackend *be = ct_create(2 * n * BS, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    uint64_t leaf_cap = EXTREE_LEAF_CAPACITY(NS), leaves;

    /* every other block: items cannot merge */
    for (uint64_t i = 0; i < n; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpuint(extree_extent_count(t), ==, n);
    ct_check_clean(t, &res);
    leaves = (n + leaf_cap - 1) / leaf_cap;
    if (g_test_verbose()) {
        g_printerr("%" PRIu64 " nodes for %" PRIu64 " extents (min leaves %"
                   PRIu64 "), depth %u, free tree %" PRIu64 " items\n",
                   res.nodes, n, leaves, extree_depth(t), res.free_items);
    }
    /* extent tree leaves + a few interior nodes + the free tree */
    g_assert_cmpuint(res.nodes, <=, leaves + leaves / 50 + 8);

    /* descending order: left-end splits keep nodes full too */
    extree_close(t);
    extree_mem_backend_free(be);
    be = ct_create(2 * n * BS, BS, NS);
    t = ct_open(be);
    for (uint64_t i = n; i-- > 0;) {
        ct_write(t, 2 * i * BS, BS);
    }
    ct_check_clean(t, &res);
    g_assert_cmpuint(res.nodes, <=, leaves + leaves / 50 + 8);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A whole-image walk: one descent, every leaf read exactly once (cold) */
static void test_walk_reads_each_leaf_once(void)
{
    const uint64_t n = 10000;
    ExtreeBackend *be = ct_create(2 * n * BS, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    ExtreeMemStats ms;
    ExtreeStats st, st0;
    ExtreeCursor c;
    uint64_t g = 0, runs = 0;

    for (uint64_t i = 0; i < n; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    extree_stats(t, &st0);
    extree_mem_backend_reset_stats(be);
    extree_cursor_init(&c, t);
    while (g < 2 * n * BS) {
        ExtreeRun run;
        g_assert_cmpint(extree_cursor_query(&c, g, UINT64_MAX,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
        g += run.length;
        runs++;
    }
    extree_cursor_release(&c);
    g_assert_cmpuint(runs, ==, 2 * n);
    extree_stats(t, &st);
    extree_mem_backend_stats(be, &ms);
    g_assert_cmpuint(st.descents - st0.descents, ==, 1);
    ct_check_clean(t, &res);
    /*
     * every extent-tree node once: the cold walk read all the extent tree
     * but its root (read at open), and nothing twice; most leaves came in
     * readahead batches
     */
    g_assert_cmpuint(st.cache_misses - st0.cache_misses +
                     st.readahead - st0.readahead, ==,
                     res.nodes - 1 - (res.free_items ? 1 : 1));
    g_assert_cmpuint(ms.reads, ==, st.cache_misses - st0.cache_misses +
                                   st.readahead - st0.readahead);
    g_assert_cmpuint(st.readahead - st0.readahead, >,
                     (res.nodes - 2) * 3 / 4);
    g_assert_cmpuint(ms.read_batches, >, 0);
    g_assert_cmpuint(ms.read_batches, <=,
                     (res.nodes + EXTREE_READAHEAD_MAX - 1) /
                     EXTREE_READAHEAD_MAX + 8);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Find the extent-tree leaves of a freshly committed image (one
 * transaction: every leaf image in the file is live), in key order
 */
static GArray *find_leaves(ExtreeBackend *be, uint64_t start)
{
    int64_t len = be->ops->get_length(be->opaque);
    GArray *offs = g_array_new(false, false, sizeof(uint64_t));
    GArray *keys = g_array_new(false, false, sizeof(uint64_t));
    uint8_t hdr[EXTREE_NODE_HEADER_SIZE + 8];

    for (uint64_t off = start; off + NS <= (uint64_t)len; off += BS) {
        g_assert_cmpint(be->ops->pread(be->opaque, off, hdr, sizeof(hdr)),
                        ==, 0);
        if (ext_ld32(hdr + EXT_NH_MAGIC) == EXTREE_NODE_MAGIC &&
            ext_ld64(hdr + EXT_NH_BYTENR) == off &&
            ext_ld32(hdr + EXT_NH_OWNER) == EXTREE_TREE_EXTENT &&
            hdr[EXT_NH_LEVEL] == 0 && ext_ld32(hdr + EXT_NH_NRITEMS) > 0) {
            uint64_t key = ext_ld64(hdr + EXTREE_NODE_HEADER_SIZE);
            guint i = 0;

            while (i < keys->len && g_array_index(keys, uint64_t, i) < key) {
                i++;
            }
            g_array_insert_val(keys, i, key);
            g_array_insert_val(offs, i, off);
        }
    }
    g_array_free(keys, true);
    return offs;
}

/*
 * Readahead is best effort: a leaf it cannot read is read again when the
 * walk gets there; a damaged one is reported then, by the walk, at its
 * offset, and nothing before it fails
 */
static void test_readahead_failures(void)
{
    const uint64_t n = 10000;
    ExtreeBackend *be = ct_create(2 * n * BS, BS, NS);
    Extree *t = ct_open(be);
    ExtreeStats st0, st;
    ExtreeCursor c;
    ExtreeRun run;
    GArray *leaves;
    uint64_t g, bad, bad_key;
    uint8_t *buf;
    char hex[32];
    int ret = 0;

    for (uint64_t i = 0; i < n; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    /* a failed read inside a batch: the walk still succeeds */
    t = ct_open(be);
    extree_stats(t, &st0);
    extree_mem_backend_inject_fault(be, EXTREE_FAULT_READ, 5, false);
    extree_cursor_init(&c, t);
    for (g = 0; g < 2 * n * BS; g += run.length) {
        g_assert_cmpint(extree_cursor_query(&c, g, UINT64_MAX,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
    }
    extree_cursor_release(&c);
    g_assert_cmpuint(extree_mem_backend_faults(be), ==, 1);
    extree_stats(t, &st);
    g_assert_cmpuint(st.readahead - st0.readahead, >, 0);
    extree_close(t);

    /* a damaged leaf that readahead reads: the walk reports it there */
    leaves = find_leaves(be, 2 * EXTREE_SB_SIZE);
    g_assert_cmpuint(leaves->len, >, 20);
    bad = g_array_index(leaves, uint64_t, 10);
    buf = ct_node_read(be, bad, NS);
    bad_key = ext_ld64(buf + EXTREE_NODE_HEADER_SIZE);
    ct_item(buf, 0)->length = GUINT64_TO_LE(3 * BS);  /* overlaps item 1 */
    ct_node_write(be, bad, buf, NS, true);
    g_free(buf);
    t = ct_open(be);
    extree_cursor_init(&c, t);
    for (g = 0; g < 2 * n * BS; g += run.length) {
        ret = extree_cursor_query(&c, g, UINT64_MAX, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret < 0) {
            break;
        }
    }
    extree_cursor_release(&c);
    g_assert_cmpint(ret, ==, -EIO);
    /*
     * the query that needed the leaf: the previous leaf's last item, whose
     * run might have continued into it
     */
    g_assert_cmpuint(g, ==, bad_key - 2 * BS);
    snprintf(hex, sizeof(hex), "0x%" PRIx64, bad);
    g_assert_nonnull(strstr(extree_last_error(t), hex));
    extree_close(t);
    g_array_free(leaves, true);
    extree_mem_backend_free(be);
}

/* A change between queries makes the cursor re-descend, not crash */
static void test_cursor_invalidation(void)
{
    ExtreeBackend *be = ct_create(1 << 20, BS, NS);
    Extree *t = ct_open_opts(be, false, 64 * NS, 0);
    ExtreeCursor c;
    ExtreeRun run;

    for (int i = 0; i < 1000; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query(&c, 0, 1 << 20, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpint(extree_cursor_query(&c, BS, 1 << 20, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    /* change everything the cursor has pinned */
    g_assert_cmpint(extree_punch(t, 0, 1000 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_cursor_query(&c, 2 * BS, 1 << 20, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    g_assert_cmpuint(run.length, ==, 998 * BS);
    g_assert_cmpint(extree_cursor_query(&c, 1000 * BS, 1 << 20, 0, &run),
                    ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    /* backwards: re-descends */
    g_assert_cmpint(extree_cursor_query(&c, 0, BS, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    g_assert_cmpuint(run.length, ==, BS);
    extree_cursor_release(&c);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * The cached query answers a forward walk on the cursor's leaf and declines
 * (-EAGAIN, cursor and answer untouched) whatever needs the general path:
 * a fresh or stale cursor, a backward query, a leaf end, adjacent items.
 * It never reads a node.
 */
static void test_cursor_query_cached(void)
{
    ExtreeBackend *be = ct_create(4000 * BS, BS, NS);
    Extree *t = ct_open_opts(be, false, 64 * NS, 0);
    ExtreeStats st0, st1;
    ExtreeCursor c;
    ExtreeRun run, full;
    uint64_t g = 0, vs = 4000 * BS;
    int cached = 0, declined = 0;

    for (int i = 0; i < 1000; i++) {
        ct_write(t, 4 * i * BS, BS);
    }
    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query_cached(&c, 0, vs, &run), ==, -EAGAIN);
    while (g < vs) {
        int ret;

        extree_stats(t, &st0);
        ret = extree_cursor_query_cached(&c, g, vs - g, &run);
        extree_stats(t, &st1);
        g_assert_cmpuint(st1.cache_misses, ==, st0.cache_misses);
        g_assert_cmpuint(st1.cache_hits, ==, st0.cache_hits);
        if (ret == -EAGAIN) {
            declined++;
            ret = extree_cursor_query(&c, g, vs - g, 0, &run);
        } else {
            cached++;
            /* the same answer from a fresh cursor */
            ExtreeCursor c2;
            extree_cursor_init(&c2, t);
            g_assert_cmpint(extree_cursor_query(&c2, g, vs - g, 0, &full),
                            ==, 0);
            extree_cursor_release(&c2);
            g_assert_cmpint(full.type, ==, run.type);
            g_assert_cmpuint(full.length, ==, run.length);
            g_assert_cmphex(full.host, ==, run.host);
        }
        g_assert_cmpint(ret, ==, 0);
        g_assert_cmpuint(run.guest, ==, g);
        g_assert_cmpint(run.type, ==, (g / BS) % 4 ? EXTREE_RUN_UNALLOC
                                                   : EXTREE_RUN_DATA);
        g_assert_cmpuint(run.length, ==, (g / BS) % 4 ? 3 * BS : BS);
        g += run.length;
    }
    /* 2000 runs; the general path only at leaf ends (126 items a leaf) */
    g_assert_cmpint(cached + declined, ==, 2000);
    g_assert_cmpint(declined, <, 40);
    /* backwards and past the end */
    g_assert_cmpint(extree_cursor_query_cached(&c, 0, BS, &run), ==, -EAGAIN);
    g_assert_cmpint(extree_cursor_query_cached(&c, vs, 1, &run), ==, -EINVAL);
    /* a change makes the cursor stale */
    g_assert_cmpint(extree_cursor_query(&c, 0, BS, 0, &run), ==, 0);
    ct_write(t, 2 * BS, BS);
    g_assert_cmpint(extree_cursor_query_cached(&c, BS, BS, &run), ==, -EAGAIN);
    /* adjacent items may coalesce: declined */
    g_assert_cmpint(extree_cursor_query(&c, BS, BS, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    ct_write(t, 3 * BS, BS);
    g_assert_cmpint(extree_cursor_query(&c, 0, BS, 0, &run), ==, 0);
    g_assert_cmpint(extree_cursor_query_cached(&c, 2 * BS, vs, &run), ==,
                    -EAGAIN);
    extree_cursor_release(&c);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* COALESCE_ALLOC joins DATA and ZERO neighbours; lookup splits runs */
static void test_coalesce_and_lookup(void)
{
    ExtreeBackend *be = ct_create(64 * BS, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCursor c;
    ExtreeRun run, runs[8];
    int n;

    ct_write(t, 0, 4 * BS);
    g_assert_cmpint(extree_set_zero(t, 4 * BS, 4 * BS), ==, 0);
    ct_write(t, 8 * BS, 2 * BS);
    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query(&c, BS, 64 * BS,
                                        EXTREE_COALESCE_ALLOC, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpuint(run.length, ==, 9 * BS);
    g_assert_cmpint(extree_cursor_query(&c, 10 * BS, 64 * BS,
                                        EXTREE_COALESCE_ALLOC, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    g_assert_cmpuint(run.length, ==, 54 * BS);
    /* never past the virtual size */
    g_assert_cmpint(extree_cursor_query(&c, 64 * BS, 1, 0, &run), ==, -EINVAL);
    extree_cursor_release(&c);

    g_assert_cmpint(extree_lookup(t, BS, 20 * BS, runs, 8, &n), ==, 0);
    g_assert_cmpint(n, ==, 4);
    g_assert_cmpint(runs[3].type, ==, EXTREE_RUN_UNALLOC);
    g_assert_cmpuint(runs[3].length, ==, 11 * BS);
    g_assert_cmpint(runs[0].type, ==, EXTREE_RUN_DATA);
    g_assert_cmpuint(runs[0].length, ==, 3 * BS);
    g_assert_cmpint(runs[1].type, ==, EXTREE_RUN_ZERO);
    g_assert_cmpint(runs[2].type, ==, EXTREE_RUN_DATA);
    g_assert_cmpint(extree_lookup(t, 0, 64 * BS, runs, 2, &n), ==, 0);
    g_assert_cmpint(n, ==, 2);

    /* unaligned updates are refused */
    g_assert_cmpint(extree_punch(t, 1, BS), ==, -EINVAL);
    g_assert_cmpint(extree_set_zero(t, 0, 100), ==, -EINVAL);
    g_assert_cmpint(extree_punch(t, 60 * BS, 8 * BS), ==, -EINVAL);
    extree_close(t);
    extree_mem_backend_free(be);
}

static uint64_t nodes_read(Extree *t, const ExtreeStats *st0)
{
    ExtreeStats st;

    extree_stats(t, &st);
    return st.cache_misses - st0->cache_misses +
           st.readahead - st0->readahead;
}

/* One allocation query; checks the answer's type and length */
static void alloc_query(ExtreeCursor *c, uint64_t g, uint64_t max,
                        uint32_t type, uint64_t length)
{
    ExtreeRun run;

    g_assert_cmpint(extree_cursor_query(c, g, max, EXTREE_COALESCE_ALLOC,
                                        &run), ==, 0);
    g_assert_cmpuint(run.guest, ==, g);
    g_assert_cmpint(run.type, ==, type);
    g_assert_cmpuint(run.length, ==, length);
}

/*
 * An allocation query steps over the subtrees whose child_bytes shows
 * them without holes: cold, over 20,000 adjacent extents in three levels,
 * it reads about one descent; it still finds a hole punched since the
 * commit (a dirty child's child_bytes is stale until the commit), and
 * queries that end inside a skippable subtree continue correctly.
 */
static void test_alloc_query_skips(void)
{
    const uint64_t n = 20000, h = n / 2 + 1, vs = (n + 64) * BS;
    ExtreeBackend *be = ct_create(vs, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    ExtreeStats st0, st;
    ExtreeCursor c;

    /* DATA, ZERO, DATA, ...: adjacent items that never merge */
    for (uint64_t i = 0; i < n; i++) {
        if (i & 1) {
            g_assert_cmpint(extree_set_zero(t, i * BS, BS), ==, 0);
        } else {
            ct_write(t, i * BS, BS);
        }
    }
    ct_write(t, (n + 8) * BS, 4 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpuint(extree_depth(t), ==, 3);

    extree_stats(t, &st0);
    extree_cursor_init(&c, t);
    alloc_query(&c, 0, vs, EXTREE_RUN_DATA, n * BS);
    g_assert_cmpuint(nodes_read(t, &st0), <=, 12);
    extree_stats(t, &st);
    g_assert_cmpuint(st.subtrees_skipped - st0.subtrees_skipped, >, 100);
    alloc_query(&c, n * BS, vs, EXTREE_RUN_UNALLOC, 8 * BS);
    alloc_query(&c, (n + 8) * BS, vs, EXTREE_RUN_DATA, 4 * BS);
    alloc_query(&c, (n + 12) * BS, vs, EXTREE_RUN_UNALLOC, 52 * BS);

    /* limits that end inside subtrees the query could otherwise skip */
    for (uint64_t g = 0; g < n * BS;) {
        uint64_t len = MIN(777 * BS, n * BS - g);

        alloc_query(&c, g, 777 * BS, (g / BS) & 1 ? EXTREE_RUN_ZERO
                                                   : EXTREE_RUN_DATA, len);
        g += len;
    }
    extree_cursor_release(&c);

    /* a hole in a leaf changed since the commit */
    g_assert_cmpint(extree_punch(t, h * BS, BS), ==, 0);
    extree_cursor_init(&c, t);
    alloc_query(&c, 0, vs, EXTREE_RUN_DATA, h * BS);
    alloc_query(&c, h * BS, vs, EXTREE_RUN_UNALLOC, BS);
    alloc_query(&c, (h + 1) * BS, vs, EXTREE_RUN_DATA, (n - h - 1) * BS);
    extree_cursor_release(&c);

    /* committed, the commit's child_bytes say the same, read cold */
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    extree_stats(t, &st0);
    extree_cursor_init(&c, t);
    alloc_query(&c, 0, vs, EXTREE_RUN_DATA, h * BS);
    alloc_query(&c, h * BS, vs, EXTREE_RUN_UNALLOC, BS);
    alloc_query(&c, (h + 1) * BS, vs, EXTREE_RUN_DATA, (n - h - 1) * BS);
    g_assert_cmpuint(nodes_read(t, &st0), <=, 16);
    extree_cursor_release(&c);
    ct_check_clean(t, &res);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Bounded cache: a walk over more nodes than fit keeps the bound */
static void test_cache_bound(void)
{
    const uint64_t n = 20000;
    ExtreeBackend *be = ct_create(2 * n * BS, BS, NS);
    Extree *t = ct_open(be);
    ExtreeStats st;
    ExtreeRun run;
    ExtreeCursor c;
    uint64_t g = 0;

    for (uint64_t i = 0; i < n; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open_opts(be, true, 40 * NS, 0);
    extree_cursor_init(&c, t);
    while (g < 2 * n * BS) {
        g_assert_cmpint(extree_cursor_query(&c, g, UINT64_MAX, 0, &run), ==, 0);
        g += run.length;
        extree_stats(t, &st);
        g_assert_cmpuint(st.cached_nodes, <=, 40);
    }
    extree_cursor_release(&c);
    g_assert_cmpuint(st.evictions, >, 0);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Leaf search guesses the slot from the keys' spread; keys bunched at both
 * ends of a huge range make the guess wrong by far.  Every item, and every
 * gap around it, must still be found, by lookups at random offsets and by
 * updates next to each item.
 */
static void test_skewed_keys(void)
{
    uint64_t vsize = 1ULL << 40, far = vsize / BS - 400;
    ExtreeBackend *be = ct_create(vsize, BS, NS);
    Extree *t = ct_open(be);
    GArray *keys = g_array_new(false, false, sizeof(uint64_t));

    /*
     * 60 items at the start, 60 near the end, a few in the middle: one
     * leaf (126 items)
     */
    for (uint64_t i = 0; i < 60; i++) {
        uint64_t k[2] = { 2 * i, far + 3 * i };
        for (int j = 0; j < 2; j++) {
            g_assert_cmpint(extree_set_zero(t, k[j] * BS, BS), ==, 0);
            g_array_append_val(keys, k[j]);
        }
    }
    for (uint64_t i = 1; i <= 4; i++) {
        uint64_t k = i * (vsize / BS / 5);
        g_assert_cmpint(extree_set_zero(t, k * BS, BS), ==, 0);
        g_array_append_val(keys, k);
    }
    g_assert_cmpuint(extree_depth(t), ==, 1);
    for (int pass = 0; pass < 2; pass++) {
        for (guint i = 0; i < keys->len; i++) {
            uint64_t k = g_array_index(keys, uint64_t, i);
            for (int d = k ? -1 : 0; d <= 1; d++) {
                ExtreeRun run;
                int n;
                g_assert_cmpint(extree_lookup(t, (k + d) * BS, BS, &run, 1,
                                              &n), ==, 0);
                g_assert_cmpint(run.type, ==, d == 0 ? EXTREE_RUN_ZERO
                                                     : EXTREE_RUN_UNALLOC);
            }
        }
        g_assert_cmpuint(extree_extent_count(t), ==, keys->len);
        /*
         * the same after a commit and reopen, and after an update right
         * behind every item (which merges with it)
         */
        g_assert_cmpint(extree_commit(t), ==, 0);
        extree_close(t);
        t = ct_open(be);
        if (pass == 0) {
            for (guint i = 0; i < keys->len; i++) {
                uint64_t k = g_array_index(keys, uint64_t, i);
                g_assert_cmpint(extree_punch(t, (k + 1) * BS, BS), ==, 0);
            }
        }
    }
    ct_check_clean(t, NULL);
    g_array_free(keys, true);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* qemu-img check's figures: DATA blocks and host discontinuities */
static void test_count_fragments(void)
{
    ExtreeBackend *be = ct_create(1 << 20, BS, NS);
    Extree *t = ct_open(be);
    uint64_t data, frags, host, got;

    g_assert_cmpint(extree_count_fragments(t, &data, &frags), ==, 0);
    g_assert_cmpuint(data, ==, 0);
    g_assert_cmpuint(frags, ==, 0);

    /* blocks 0-3 and 8-9 follow each other on the host: one run */
    ct_write(t, 0, 4 * BS);
    ct_write(t, 8 * BS, 2 * BS);
    /* a zero run and a hole between them change nothing */
    g_assert_cmpint(extree_set_zero(t, 4 * BS, 2 * BS), ==, 0);
    g_assert_cmpint(extree_count_fragments(t, &data, &frags), ==, 0);
    g_assert_cmpuint(data, ==, 6);
    g_assert_cmpuint(frags, ==, 0);

    /* blocks 20 and 40 get the next host blocks: still in host order */
    g_assert_cmpint(extree_alloc_data(t, 20 * BS, BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_map_data(t, 20 * BS, BS, host), ==, 0);
    g_assert_cmpint(extree_alloc_data(t, 30 * BS, BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_map_data(t, 40 * BS, BS, host), ==, 0);
    g_assert_cmpint(extree_count_fragments(t, &data, &frags), ==, 0);
    g_assert_cmpuint(data, ==, 8);
    g_assert_cmpuint(frags, ==, 0);

    /*
     * re-map block 2 past the end: the jumps to block 2's new place and
     * back to block 3 are two fragments
     */
    g_assert_cmpint(extree_alloc_data(t, 50 * BS, BS, &host, &got), ==, 0);
    g_assert_cmpint(extree_map_data(t, 2 * BS, BS, host), ==, 0);
    g_assert_cmpint(extree_count_fragments(t, &data, &frags), ==, 0);
    g_assert_cmpuint(data, ==, 8);
    g_assert_cmpuint(frags, ==, 2);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/btree/skewed-keys", test_skewed_keys);
    g_test_add_func("/btree/coalesce-and-lookup", test_coalesce_and_lookup);
    g_test_add_func("/btree/alloc-query-skips", test_alloc_query_skips);
    g_test_add_func("/btree/count-fragments", test_count_fragments);
    g_test_add_func("/btree/cursor-invalidation", test_cursor_invalidation);
    g_test_add_func("/btree/cursor-query-cached", test_cursor_query_cached);
    g_test_add_func("/btree/readahead-failures", test_readahead_failures);
    g_test_add_func("/btree/sequential-fill", test_sequential_fill);
    g_test_add_func("/btree/walk-reads-each-leaf-once",
                    test_walk_reads_each_leaf_once);
    g_test_add_func("/btree/cache-bound", test_cache_bound);
    g_test_add_func("/btree/random-small", test_random_small);
    g_test_add_func("/btree/random", test_random);
    return g_test_run();
}
