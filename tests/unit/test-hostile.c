/*
 * Unit tests: damaged images whose checksums are valid (issue: hostile
 * images).  Each case once returned wrong data with success, or made the
 * writer commit a superblock its own reader rejects.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 512
#define NS 4096
#define VSIZE (4 * 1024 * 1024)
#define NEXT 400            /* one-block extents at guest 0, 1k, 2k, ... */

/* A two-level extent tree: 126 items per leaf, 4 leaves under the root */
static ExtreeBackend *make_image(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);

    for (int i = 0; i < NEXT; i++) {
        ct_write(t, (uint64_t)i * 1024, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    extree_close(t);
    return be;
}

/*
 * Item 0 of the root points at item 1's child.  Cold, the wrong parent is
 * caught by the first-key check on read; with the leaf cached under its
 * rightful parent, a lookup through item 0 must fail the same way rather
 * than find no extent there (a hole, zeroes with success).
 */
static void test_two_parents(void)
{
    ExtreeBackend *be = make_image();
    ExtreeDiskSuper sb;
    ExtreeRun run;
    uint64_t root;
    uint8_t *buf;
    Extree *t;

    ct_read_super(be, &sb);
    root = GUINT64_FROM_LE(sb.extent_root.bytenr);
    buf = ct_node_read(be, root, NS);
    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 1);
    memcpy(buf + EXTREE_NODE_HEADER_SIZE + 8,
           buf + EXTREE_NODE_HEADER_SIZE + EXT_PTR_ISZ + 8, 16);
    ct_node_write(be, root, buf, NS, true);
    g_free(buf);

    for (int cached = 0; cached < 2; cached++) {
        t = ct_open_opts(be, cached == 1, 0, 0);
        extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
        ct_corrupt_calls = 0;
        if (cached) {
            /* item 1's range: guest 126k is its first extent */
            g_assert_cmpint(ct_lookup1(t, 126 * 1024, &run), ==, 0);
            g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
        }
        g_assert_cmpint(ct_lookup1(t, 0, &run), ==, -EIO);
        g_assert_cmpint(ct_corrupt_calls, ==, 1);
        g_assert_nonnull(strstr(extree_last_error(t), "first key mismatch"));
        /* and a write there must not copy the shared leaf */
        if (!cached) {
            uint64_t host, got;
            g_assert_cmpint(extree_alloc_data(t, 0, BS, &host, &got), ==,
                            -EIO);
        }
        /* the rightful range still reads */
        g_assert_cmpint(ct_lookup1(t, 127 * 1024, &run), ==, 0);
        g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
        extree_close(t);
    }
    extree_mem_backend_free(be);
}

static void set_super_u64(ExtreeBackend *be, bool both, size_t off,
                          uint64_t v)
{
    ExtreeDiskSuper sb;
    int slot = ct_read_super(be, &sb);

    for (int i = 0; i < 2; i++) {
        if (i != slot && !both) {
            continue;
        }
        g_assert_cmpint(be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, &sb,
                                       EXTREE_SB_SIZE), ==, 0);
        ext_st64((uint8_t *)&sb + off, v);
        ct_write_super(be, i, &sb);
    }
}

static int try_open(ExtreeBackend *be, bool ro, Extree **t, char **err)
{
    ExtreeOpenOptions o = { .read_only = ro };

    *err = NULL;
    return extree_open(be, &o, t, err);
}

/* The generation is bounded: no commit can make it wrap */
static void test_generation_limit(void)
{
    ExtreeBackend *be = make_image();
    Extree *t;
    char *err;

    /* above the limit: both slots invalid */
    set_super_u64(be, true, offsetof(ExtreeDiskSuper, generation),
                  UINT64_MAX);
    g_assert_cmpint(try_open(be, true, &t, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "bad generation"));
    g_free(err);

    /* at the limit: readable, but never written again */
    set_super_u64(be, true, offsetof(ExtreeDiskSuper, generation),
                  EXTREE_MAX_GENERATION);
    g_assert_cmpint(try_open(be, false, &t, &err), ==, -EROFS);
    g_assert_nonnull(strstr(err, "at the limit"));
    g_free(err);
    g_assert_cmpint(try_open(be, true, &t, &err), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, EXTREE_MAX_GENERATION);
    extree_close(t);

    /* one below: one more commit, then the next is refused */
    set_super_u64(be, true, offsetof(ExtreeDiskSuper, generation),
                  EXTREE_MAX_GENERATION - 1);
    t = ct_open(be);
    ct_write(t, 2 * 1024 * 1024 + 1024, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, EXTREE_MAX_GENERATION);
    ct_write(t, 2 * 1024 * 1024 + 2048, BS);
    g_assert_cmpint(extree_commit(t), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "bad generation"));
    extree_close(t);
    g_assert_cmpint(try_open(be, true, &t, &err), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, EXTREE_MAX_GENERATION);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * extent_count at the format's maximum (the true count is lower): a
 * commit that adds extents must be refused, leaving the committed state,
 * and the checker (repair mode) must set the count right.
 */
static void test_extent_count(void)
{
    ExtreeBackend *be = make_image();
    uint64_t max = VSIZE / BS;
    ExtreeOpenOptions ro = { .read_only = true };
    ExtreeOpenOptions rep = { .repair = true };
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    uint64_t gen;
    Extree *t;
    char *err;

    /* one more than the maximum is refused at open, exactly */
    set_super_u64(be, false, offsetof(ExtreeDiskSuper, extent_count),
                  max + 1);
    g_assert_cmpint(try_open(be, true, &t, &err), ==, 0);
    g_assert_nonnull(strstr(extree_open_warning(t), "bad extent_count"));
    extree_close(t);
    g_free(err);

    set_super_u64(be, false, offsetof(ExtreeDiskSuper, extent_count), max);
    t = ct_open(be);
    gen = extree_generation(t);
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    ct_corrupt_calls = 0;
    ct_write(t, 2 * 1024 * 1024 + 1024, BS);
    g_assert_cmpint(extree_commit(t), ==, -EIO);
    g_assert_cmpint(ct_corrupt_calls, ==, 1);
    g_assert_nonnull(strstr(extree_last_error(t), "bad extent_count"));
    extree_close(t);

    /* the committed state is intact: the same generation, no skip */
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, gen);
    g_assert_null(extree_open_warning(t));
    extree_close(t);

    /* repair: the count is recomputed and committed */
    g_assert_cmpint(extree_open(be, &rep, &t, &err), ==, 0);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                                     &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 1);
    g_assert_true(ct_has_msg(&r, "extent_count mismatch"));
    g_assert_cmpuint(extree_extent_count(t), ==, NEXT);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpuint(extree_extent_count(t), ==, NEXT);
    ct_write(t, 2 * 1024 * 1024 + 1024, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/* Bytes after the backing file name must be zero, as the spec says */
static void test_backing_junk(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeCreateParams p = { .virtual_size = VSIZE, .block_size = BS,
                             .node_size = NS, .backing_file = "base.img" };
    ExtreeDiskSuper sb;
    Extree *t;
    char *err = NULL;

    g_assert_cmpint(extree_create(be, &p, &err), ==, 0);
    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, &sb,
                                       EXTREE_SB_SIZE), ==, 0);
        ((uint8_t *)&sb)[offsetof(ExtreeDiskSuper, backing_file) + 10] = 'x';
        ct_write_super(be, i, &sb);
    }
    g_assert_cmpint(try_open(be, true, &t, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "bad backing file name"));
    g_free(err);
    extree_mem_backend_free(be);
}

/*
 * The allocator hands out a block that a live node occupies (free space
 * overlapping the extent tree): a new node there must be refused as
 * corruption, not replace the pinned node in the cache.
 */
static void test_new_node_over_live(void)
{
    ExtreeBackend *be = make_image();
    Extree *t = ct_open(be);
    ExtreeTree *tree = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeNodeExpect e;
    ExtreeNode *root, *n;

    extree_tree_expect(t, tree, &e);
    g_assert_cmpint(extree_node_get(t, tree->root, &e, &root), ==, 0);
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    ct_corrupt_calls = 0;
    g_assert_cmpint(extree_node_new(t, tree->root, EXTREE_TREE_EXTENT, 0,
                                    &n), ==, -EIO);
    g_assert_null(n);
    g_assert_cmpint(ct_corrupt_calls, ==, 1);
    g_assert_nonnull(strstr(extree_last_error(t), "in use by a pinned"));
    g_assert_true(extree_node_cached(t, tree->root));
    extree_node_unref(t, root);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * An item deleted from the root (the fuzzer's find): the root's items are
 * checked against nothing but the superblock's extent_bytes.  Opens fail
 * rather than read the lost range as a hole; the checker opens and says so.
 */
static void test_root_item_lost(void)
{
    ExtreeBackend *be = make_image();
    ExtreeOpenOptions ro = { .read_only = true };
    ExtreeOpenOptions chk = { .read_only = true, .check = true };
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t root;
    uint8_t *buf;
    Extree *t;
    char *err = NULL;
    int nr;

    ct_read_super(be, &sb);
    g_assert_true(GUINT64_FROM_LE(sb.autoclear_features) &
                  EXTREE_AUTOCLEAR_EXTENT_BYTES);
    root = GUINT64_FROM_LE(sb.extent_root.bytenr);
    buf = ct_node_read(be, root, NS);
    nr = ext_ld32(buf + EXT_NH_NRITEMS);
    g_assert_cmpint(nr, >=, 3);
    memmove(buf + EXTREE_NODE_HEADER_SIZE + EXT_PTR_ISZ,
            buf + EXTREE_NODE_HEADER_SIZE + 2 * EXT_PTR_ISZ,
            (size_t)(nr - 2) * EXT_PTR_ISZ);
    memset(buf + EXTREE_NODE_HEADER_SIZE + (nr - 1) * EXT_PTR_ISZ, 0,
           EXT_PTR_ISZ);
    ext_st32(buf + EXT_NH_NRITEMS, nr - 1);
    ct_node_write(be, root, buf, NS, true);
    g_free(buf);

    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -EIO);
    g_assert_nonnull(strstr(err, "superblock's extent_bytes"));
    g_free(err);
    g_assert_cmpint(extree_open(be, &chk, &t, &err), ==, 0);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "superblock's extent_bytes"));
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/*
 * Free space in 1,024 pieces: a read-write open reads the free-space
 * tree's first and last leaf only
 */
static ExtreeBackend *make_fragmented(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);

    ct_write(t, 0, 1 << 20);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t g = 0; g < (1 << 20); g += 2 * BS) {
        g_assert_cmpint(extree_punch(t, g, BS), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    return be;
}

static bool free_tree_partial(Extree *t)
{
    ExtreeStats st;

    extree_stats(t, &st);
    return st.free_tree_partial;
}

/* free_bytes one block off: an open that reads part of the tree refuses */
static void test_partial_free_bytes(void)
{
    ExtreeBackend *be = make_fragmented();
    ExtreeDiskSuper sb;
    uint64_t fb;
    Extree *t;
    char *err;

    ct_read_super(be, &sb);
    fb = GUINT64_FROM_LE(sb.free_bytes);
    t = ct_open(be);
    g_assert_true(free_tree_partial(t));
    extree_close(t);
    for (int d = -1; d <= 1; d += 2) {
        set_super_u64(be, false, offsetof(ExtreeDiskSuper, free_bytes),
                      fb + d * BS);
        g_assert_cmpint(try_open(be, false, &t, &err), ==, -EIO);
        g_assert_nonnull(strstr(err, "free_bytes mismatch"));
        g_free(err);
    }
    extree_mem_backend_free(be);
}

/*
 * A free range of the tree's unread part reaches over a live block, its
 * parent's child_bytes and the superblock's free_bytes agreeing: a punch
 * of that block is a double free the allocator cannot see.  The commit's
 * accounting must refuse it, leaving the committed state.
 */
static void test_partial_double_free(void)
{
    ExtreeBackend *be = make_fragmented();
    ExtreeDiskSuper sb;
    uint64_t root, leaf, live = 0, guest = UINT64_MAX, gen, host;
    uint8_t *rbuf, *lbuf;
    ExtreeRun run;
    Extree *t;
    int nr, ci, i;

    ct_read_super(be, &sb);
    root = GUINT64_FROM_LE(sb.free_root.bytenr);
    rbuf = ct_node_read(be, root, NS);
    nr = ext_ld32(rbuf + EXT_NH_NRITEMS);
    g_assert_cmpint(nr, >=, 4);
    g_assert_cmpint(rbuf[EXT_NH_LEVEL], ==, 1);
    ci = nr / 2;
    leaf = ext_ld64(rbuf + EXTREE_NODE_HEADER_SIZE + ci * EXT_PTR_ISZ +
                    EXT_KP_CHILD);
    lbuf = ct_node_read(be, leaf, NS);
    for (i = 0; i + 1 < (int)ext_ld32(lbuf + EXT_NH_NRITEMS); i++) {
        ExtreeDiskItem *a = ct_item(lbuf, i), *b = ct_item(lbuf, i + 1);
        uint64_t end = GUINT64_FROM_LE(a->key) + GUINT64_FROM_LE(a->length);

        if (GUINT64_FROM_LE(b->key) >= end + BS) {
            live = end;
            a->length = GUINT64_TO_LE(GUINT64_FROM_LE(a->length) + BS);
            break;
        }
    }
    g_assert_cmpuint(live, !=, 0);
    ct_node_write(be, leaf, lbuf, NS, true);
    ext_st64(rbuf + EXTREE_NODE_HEADER_SIZE + ci * EXT_PTR_ISZ + EXT_KP_BYTES,
             ext_ld64(rbuf + EXTREE_NODE_HEADER_SIZE + ci * EXT_PTR_ISZ +
                      EXT_KP_BYTES) + BS);
    ct_node_write(be, root, rbuf, NS, true);
    set_super_u64(be, false, offsetof(ExtreeDiskSuper, free_bytes),
                  GUINT64_FROM_LE(sb.free_bytes) + BS);
    g_free(lbuf);
    g_free(rbuf);

    t = ct_open(be);
    g_assert_true(free_tree_partial(t));
    gen = extree_generation(t);
    for (uint64_t g = BS; g < (1 << 20); g += 2 * BS) {
        g_assert_cmpint(ct_lookup1(t, g, &run), ==, 0);
        if (run.type == EXTREE_RUN_DATA && run.host == live) {
            guest = g;
        }
    }
    g_assert_cmpuint(guest, !=, UINT64_MAX);
    g_assert_cmpint(extree_punch(t, guest, BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "accounting mismatch"));
    extree_close(t);

    t = ct_open(be);
    g_assert_cmpuint(extree_generation(t), ==, gen);
    g_assert_cmpint(ct_lookup1(t, guest, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpuint(run.host, ==, live);
    /*
     * Once data placement has read the rest, the allocator sees the
     * double free as a whole load does: at the punch
     */
    g_assert_cmpint(extree_alloc_data(t, 2 << 20, BS, &host, &gen), ==, 0);
    g_assert_false(free_tree_partial(t));
    g_assert_cmpint(extree_punch(t, guest, BS), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "freed twice"));
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/hostile/two-parents", test_two_parents);
    g_test_add_func("/hostile/generation-limit", test_generation_limit);
    g_test_add_func("/hostile/extent-count", test_extent_count);
    g_test_add_func("/hostile/backing-junk", test_backing_junk);
    g_test_add_func("/hostile/new-node-over-live", test_new_node_over_live);
    g_test_add_func("/hostile/root-item-lost", test_root_item_lost);
    g_test_add_func("/hostile/partial-free-bytes", test_partial_free_bytes);
    g_test_add_func("/hostile/partial-double-free",
                    test_partial_double_free);
    return g_test_run();
}
