/*
 * Unit tests: no-wait queries and prefetched node images
 * (extree_cursor_query_nowait(), extree_missing_node(),
 * extree_node_prefetch()), the core's half of the QEMU driver's node reads
 * outside its lock.  A tree of a few hundred nodes under a 40-node cache.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 512
#define NS 4096
#define N_ITEMS 20000               /* every other block: 160+ leaves */
#define CACHE (40 * NS)

typedef struct Misses {
    uint64_t prefetches;        /* nodes read and handed over */
    uint64_t walks;             /* forward-walk misses: blocking query */
} Misses;

/* The driver's loop: no-wait query, read the missing node, prefetch, again */
static int nowait_query(Extree *t, ExtreeBackend *be, ExtreeCursor *c,
                        uint64_t g, uint64_t max, int coalesce,
                        ExtreeRun *run, Misses *m)
{
    uint8_t *buf = g_malloc(NS);
    int ret;

    for (int tries = 0; ; tries++) {
        uint64_t bytenr, epoch;

        ret = extree_cursor_query_nowait(c, g, max, coalesce, run);
        if (ret != -EWOULDBLOCK) {
            break;
        }
        /* the cursor was released: nothing pinned, the next one descends */
        g_assert_false(c->valid);
        g_assert_null(c->path.nodes[0]);
        g_assert_cmpint(tries, <, 2 * EXTREE_MAX_LEVELS);
        bytenr = extree_missing_node(t, &epoch);
        if (!bytenr) {
            m->walks++;
            ret = extree_cursor_query(c, g, max, coalesce, run);
            break;
        }
        g_assert_true(EXTREE_IS_ALIGNED(bytenr, BS));
        g_assert_false(extree_node_cached(t, bytenr));
        g_assert_cmpint(be->ops->pread(be->opaque, bytenr, buf, NS), ==, 0);
        extree_node_prefetch(t, bytenr, epoch, buf);
        m->prefetches++;
    }
    g_free(buf);
    return ret;
}

static ExtreeBackend *make_image(void)
{
    ExtreeBackend *be = ct_create(2 * N_ITEMS * BS, BS, NS);
    Extree *t = ct_open(be);

    for (uint64_t i = 0; i < N_ITEMS; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    return be;
}

static void assert_same_run(const ExtreeRun *a, const ExtreeRun *b)
{
    g_assert_cmpuint(a->guest, ==, b->guest);
    g_assert_cmpuint(a->length, ==, b->length);
    g_assert_cmpint(a->type, ==, b->type);
    if (a->type == EXTREE_RUN_DATA) {
        g_assert_cmphex(a->host, ==, b->host);
    }
}

/*
 * No-wait answers on @t equal blocking answers on @ref: random queries
 * (both coalescing modes), then a forward walk over the whole image
 */
static void compare_all(Extree *t, ExtreeBackend *be, Extree *ref,
                        uint64_t seed, Misses *m)
{
    uint64_t vs = extree_virtual_size(t), g = 0;
    GRand *r = g_rand_new_with_seed(seed);
    ExtreeCursor c, rc;
    ExtreeRun a, b;

    extree_cursor_init(&c, t);
    extree_cursor_init(&rc, ref);
    for (int i = 0; i < 3000; i++) {
        uint64_t pos = (uint64_t)g_rand_int_range(r, 0, vs / BS) * BS;
        uint64_t max = (uint64_t)g_rand_int_range(r, 1, 64) * BS;
        int co = g_rand_int_range(r, 0, 2);

        g_assert_cmpint(nowait_query(t, be, &c, pos, max, co, &a, m), ==, 0);
        g_assert_cmpint(extree_cursor_query(&rc, pos, max, co, &b), ==, 0);
        assert_same_run(&a, &b);
    }
    while (g < vs) {
        g_assert_cmpint(nowait_query(t, be, &c, g, vs - g,
                                     EXTREE_COALESCE_HOST, &a, m), ==, 0);
        g_assert_cmpint(extree_cursor_query(&rc, g, vs - g,
                                            EXTREE_COALESCE_HOST, &b), ==, 0);
        assert_same_run(&a, &b);
        g += a.length;
    }
    extree_cursor_release(&c);
    extree_cursor_release(&rc);
    g_rand_free(r);
}

/*
 * The root's child for @guest, from the image on disk: what a cold
 * descent misses first (the root is cached at open)
 */
static uint64_t root_child(Extree *t, ExtreeBackend *be, uint64_t guest)
{
    uint8_t *buf = ct_node_read(be, t->trees[EXTREE_TREE_EXTENT].root, NS);
    ExtreeNode fake = { .buf = buf };
    uint64_t child;
    int slot = 0;

    g_assert_cmpuint(node_level(&fake), >, 0);
    while (slot + 1 < (int)node_nritems(&fake) &&
           ptr_key(&fake, slot + 1) <= guest) {
        slot++;
    }
    child = ptr_get_child(&fake, slot);
    g_free(buf);
    return child;
}

/*
 * A cold no-wait query names the node it misses and reads nothing; with
 * the images prefetched, every answer is the blocking query's
 */
static void test_nowait_matches(void)
{
    ExtreeBackend *be = make_image();
    Extree *t = ct_open_opts(be, true, CACHE, 0);
    Extree *ref = ct_open_opts(be, true, CACHE, 0);
    uint64_t guest = 2 * (N_ITEMS / 2) * BS, bytenr, epoch, want;
    ExtreeMemStats ms0, ms;
    ExtreeStats st0, st;
    Misses m = { 0 };
    ExtreeCursor c;
    ExtreeRun run;

    g_assert_cmpuint(extree_depth(t), >=, 2);
    want = root_child(t, be, guest);
    extree_stats(t, &st0);
    extree_mem_backend_stats(be, &ms0);
    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EWOULDBLOCK);
    g_assert_false(c.valid);
    bytenr = extree_missing_node(t, &epoch);
    g_assert_cmphex(bytenr, ==, want);
    /* the same again: nothing was read, nothing is cached */
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EWOULDBLOCK);
    g_assert_cmphex(extree_missing_node(t, &epoch), ==, bytenr);
    extree_mem_backend_stats(be, &ms);
    g_assert_cmpuint(ms.reads, ==, ms0.reads);
    extree_stats(t, &st);
    g_assert_cmpuint(st.cache_misses, ==, st0.cache_misses);
    extree_cursor_release(&c);

    compare_all(t, be, ref, 1, &m);
    extree_stats(t, &st);
    g_assert_cmpuint(m.prefetches, >, 100);
    /* every prefetched image was used (each was the next node missed) */
    g_assert_cmpuint(st.prefetched - st0.prefetched, ==, m.prefetches);
    g_assert_cmpuint(st.evictions, >, 0);
    g_assert_cmpuint(st.cached_nodes, <=, 40);
    if (g_test_verbose()) {
        g_printerr("%" PRIu64 " prefetched, %" PRIu64 " walk misses\n",
                   m.prefetches, m.walks);
    }
    extree_close(t);
    extree_close(ref);
    extree_mem_backend_free(be);
}

/*
 * A damaged prefetched image is reported exactly as the same damage read
 * from disk: -EIO, the same message, and the query does not go on
 */
static void test_prefetch_damaged(void)
{
    ExtreeBackend *be = make_image(), *bad;
    Extree *t = ct_open_opts(be, true, CACHE, 0), *tb;
    uint64_t guest = 2 * 100 * BS, bytenr, epoch;
    uint8_t *buf = g_malloc(NS);
    char *msg;
    ExtreeCursor c;
    ExtreeRun run;

    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EWOULDBLOCK);
    bytenr = extree_missing_node(t, &epoch);
    g_assert_cmpint(be->ops->pread(be->opaque, bytenr, buf, NS), ==, 0);
    buf[NS / 2] ^= 0x40;
    extree_node_prefetch(t, bytenr, epoch, buf);
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EIO);
    g_assert_false(c.valid);
    msg = g_strdup(extree_last_error(t));
    g_assert_nonnull(strstr(msg, "bad checksum"));
    /* not cached: the blocking query reads the (good) node from disk */
    g_assert_false(extree_node_cached(t, bytenr));
    g_assert_cmpint(extree_cursor_query(&c, guest, BS, 0, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    extree_cursor_release(&c);

    /* the same damage on disk, read by a blocking query */
    bad = extree_mem_backend_clone(be);
    g_assert_cmpint(bad->ops->pwrite(bad->opaque, bytenr, buf, NS), ==, 0);
    tb = ct_open_opts(bad, true, CACHE, 0);
    extree_cursor_init(&c, tb);
    g_assert_cmpint(extree_cursor_query(&c, guest, BS, 0, &run), ==, -EIO);
    g_assert_cmpstr(extree_last_error(tb), ==, msg);
    extree_cursor_release(&c);

    g_free(msg);
    g_free(buf);
    extree_close(tb);
    extree_close(t);
    extree_mem_backend_free(bad);
    extree_mem_backend_free(be);
}

/*
 * Prefetched images never outlive a commit: the table is emptied at
 * commit, an image whose read began before a commit is refused, and a
 * location freed by copy-on-write and reused by a new node is read anew.
 */
static void test_prefetch_commit(void)
{
    ExtreeBackend *be = make_image(), *ref_be;
    Extree *t = ct_open_opts(be, false, CACHE, 0), *ref;
    uint64_t guest = 2 * 5000 * BS, bytenr, epoch, old_epoch;
    uint8_t *old = g_malloc(NS), *now;
    Misses m = { 0 };
    ExtreeCursor c;
    ExtreeRun run;

    extree_cursor_init(&c, t);
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EWOULDBLOCK);
    bytenr = extree_missing_node(t, &old_epoch);
    g_assert_cmpint(be->ops->pread(be->opaque, bytenr, old, NS), ==, 0);

    /* kept until a commit, which drops it */
    extree_node_prefetch(t, bytenr, old_epoch, old);
    g_assert_cmpuint(t->nc.nprefetch, ==, 1);
    ct_write(t, 0, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(t->nc.nprefetch, ==, 0);

    /* read before that commit, handed over after it: refused */
    extree_node_prefetch(t, bytenr, old_epoch, old);
    g_assert_cmpuint(t->nc.nprefetch, ==, 0);
    g_assert_cmpint(extree_cursor_query_nowait(&c, guest, BS, 0, &run), ==,
                    -EWOULDBLOCK);
    /* (the write copied the path above it: the node may have moved) */
    bytenr = extree_missing_node(t, &epoch);
    g_assert_cmpuint(bytenr, !=, 0);
    g_assert_cmpuint(epoch, !=, old_epoch);
    g_assert_cmpint(be->ops->pread(be->opaque, bytenr, old, NS), ==, 0);

    /*
     * Prefetched in this transaction, then the whole tree copied (every
     * item rewritten) and committed twice: the second round's nodes reuse
     * the first round's freed space, the old location among it
     */
    extree_node_prefetch(t, bytenr, epoch, old);
    g_assert_cmpuint(t->nc.nprefetch, ==, 1);
    for (int round = 0; ; round++) {
        bool reused;

        g_assert_cmpint(round, <, 20);
        for (uint64_t i = 0; i < N_ITEMS; i++) {
            ct_write(t, 2 * i * BS, BS);
        }
        g_assert_cmpint(extree_commit(t), ==, 0);
        g_assert_cmpuint(t->nc.nprefetch, ==, 0);
        now = ct_node_read(be, bytenr, NS);
        reused = memcmp(now, old, NS) != 0;
        g_free(now);
        if (reused) {
            if (g_test_verbose()) {
                g_printerr("location reused in round %d\n", round);
            }
            break;
        }
    }

    /* every answer is the new tree's, read anew */
    ref_be = extree_mem_backend_clone(be);
    ref = ct_open_opts(ref_be, true, CACHE, 0);
    extree_cursor_release(&c);
    compare_all(t, be, ref, 2, &m);
    g_assert_cmpuint(m.prefetches, >, 0);
    ct_check_clean(t, NULL);

    g_free(old);
    extree_close(ref);
    extree_close(t);
    extree_mem_backend_free(ref_be);
    extree_mem_backend_free(be);
}

/*
 * A failed no-wait query leaves nothing behind: blocking and no-wait
 * queries at random offsets, mixed on one cursor, answer right
 */
static void test_nowait_cursor_reuse(void)
{
    ExtreeBackend *be = make_image();
    Extree *t = ct_open_opts(be, true, CACHE, 0);
    uint64_t vs = extree_virtual_size(t), epoch;
    GRand *r = g_rand_new_with_seed(3);
    int blocked = 0, answered = 0;
    ExtreeCursor c;
    ExtreeRun run;

    extree_cursor_init(&c, t);
    for (int i = 0; i < 4000; i++) {
        uint64_t g = (uint64_t)g_rand_int_range(r, 0, vs / BS) * BS;
        int ret = i % 2 ? extree_cursor_query_nowait(&c, g, BS, 0, &run)
                        : extree_cursor_query(&c, g, BS, 0, &run);

        if (ret == -EWOULDBLOCK) {
            /* 0 at a leaf boundary: the next leaf is a walk's */
            extree_missing_node(t, &epoch);
            g_assert_false(c.valid);
            blocked++;
            continue;
        }
        g_assert_cmpint(ret, ==, 0);
        g_assert_cmpuint(run.guest, ==, g);
        g_assert_cmpuint(run.length, ==, BS);
        g_assert_cmpint(run.type, ==, (g / BS) % 2 ? EXTREE_RUN_UNALLOC
                                                   : EXTREE_RUN_DATA);
        answered += i % 2;
    }
    extree_cursor_release(&c);
    g_assert_cmpint(blocked, >, 0);
    g_assert_cmpint(answered, >, 0);
    g_rand_free(r);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/prefetch/nowait-matches", test_nowait_matches);
    g_test_add_func("/prefetch/damaged", test_prefetch_damaged);
    g_test_add_func("/prefetch/commit", test_prefetch_commit);
    g_test_add_func("/prefetch/nowait-cursor-reuse",
                    test_nowait_cursor_reuse);
    return g_test_run();
}
