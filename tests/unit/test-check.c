/*
 * Unit tests: the checker finds each injected problem and repairs leaks
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 4096
#define NS 4096

/* An image with a one-leaf extent tree: DATA at guest 0, 8, 16, 24 (2
 * blocks each, not host-contiguous) and free space from a punched one */
static ExtreeBackend *make_image(uint64_t *leaf)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeDiskSuper sb;

    for (int i = 0; i < 5; i++) {
        ct_write(t, i * 8 * BS, 2 * BS);
        g_assert_cmpint(extree_set_zero(t, (i * 8 + 2) * BS, BS), ==, 0);
    }
    g_assert_cmpint(extree_punch(t, 32 * BS, 2 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 1);
    ct_check_clean(t, NULL);
    extree_close(t);
    ct_read_super(be, &sb);
    *leaf = GUINT64_FROM_LE(sb.extent_root.bytenr);
    return be;
}

/* Run the checker on a fresh open (read-only: nothing is committed) */
static void run_check(ExtreeBackend *be, bool repair, ExtreeCheckResult *res,
                      CtReport *r)
{
    Extree *t = ct_open_opts(be, !repair, 0, 0);
    r->msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check(t, repair, res, ct_report, r), ==, 0);
    extree_close(t);
}

static void test_clean(void)
{
    uint64_t leaf;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeCheckResult res;
    CtReport r;

    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 0);
    g_assert_cmpuint(res.extents, ==, 9);
    g_assert_cmpuint(res.data_bytes, ==, 8 * BS);
    g_assert_cmpuint(res.unmerged, ==, 0);
    g_assert_cmpuint(r.msgs->len, ==, 0);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_bad_crc(void)
{
    uint64_t leaf;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeCheckResult res;
    CtReport r;
    Extree *t;
    char *want;
    uint8_t *buf = ct_node_read(be, leaf, NS);

    buf[300] ^= 1;
    ct_node_write(be, leaf, buf, NS, false);
    g_free(buf);
    /* open reads the extent root: refused; the checker needs an open
     * image, so damage a copy of the root instead ... */
    g_assert_cmpint(extree_open(be, &(ExtreeOpenOptions){ .read_only = true },
                                &t, &want), ==, -EIO);
    g_free(want);
    extree_mem_backend_free(be);

    /* ... a leaf under a two-level tree */
    be = ct_create(1 << 30, BS, NS);
    t = ct_open(be);
    for (int i = 0; i < 300; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    extree_close(t);
    {
        ExtreeDiskSuper sb;
        ct_read_super(be, &sb);
        buf = ct_node_read(be, GUINT64_FROM_LE(sb.extent_root.bytenr), NS);
        leaf = GUINT64_FROM_LE(((ExtreeDiskKeyPtr *)(buf + 64))[0].child);
        g_free(buf);
    }
    buf = ct_node_read(be, leaf, NS);
    buf[300] ^= 1;
    ct_node_write(be, leaf, buf, NS, false);
    g_free(buf);
    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, >=, 1);
    want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                           ": bad checksum, have 0x", leaf);
    g_assert_true(ct_has_msg(&r, want));
    g_free(want);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_overlapping_extents(void)
{
    uint64_t leaf;
    ExtreeBackend *be = make_image(&leaf);
    uint8_t *buf = ct_node_read(be, leaf, NS);
    ExtreeCheckResult res;
    CtReport r;
    Extree *t;
    char *err = NULL;

    /* item 1 (ZERO at 2) grows over item 2 (DATA at 8) */
    ct_item(buf, 1)->length = GUINT64_TO_LE(8 * BS);
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);
    /* the root is read (and refused) at open: the image cannot be opened */
    g_assert_cmpint(extree_open(be, &(ExtreeOpenOptions){ .read_only = true },
                                &t, &err), ==, -EIO);
    g_assert_nonnull(strstr(err, "unsorted or overlapping items at slot 2"));
    g_free(err);
    extree_mem_backend_free(be);

    /* in a deeper tree the checker reports it */
    be = ct_create(1 << 30, BS, NS);
    t = ct_open(be);
    for (int i = 0; i < 300; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    {
        ExtreeDiskSuper sb;
        ct_read_super(be, &sb);
        buf = ct_node_read(be, GUINT64_FROM_LE(sb.extent_root.bytenr), NS);
        leaf = GUINT64_FROM_LE(((ExtreeDiskKeyPtr *)(buf + 64))[1].child);
        g_free(buf);
    }
    buf = ct_node_read(be, leaf, NS);
    ct_item(buf, 3)->length = GUINT64_TO_LE(4 * BS);
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);
    run_check(be, false, &res, &r);
    /* the node, and the extent count its skipped items make wrong */
    g_assert_cmpuint(res.corruptions, ==, 2);
    g_assert_true(ct_has_msg(&r, "unsorted or overlapping items at slot 4"));
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_extent_over_free_space(void)
{
    uint64_t leaf;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeDiskSuper sb;
    ExtreeCheckResult res;
    CtReport r;
    uint8_t *buf;
    uint64_t free_at;

    /* the first free range */
    ct_read_super(be, &sb);
    buf = ct_node_read(be, GUINT64_FROM_LE(sb.free_root.bytenr), NS);
    g_assert_cmpuint(GUINT32_FROM_LE(((ExtreeDiskNodeHeader *)buf)->nritems),
                     >, 0);
    free_at = GUINT64_FROM_LE(ct_item(buf, 0)->key);
    g_free(buf);

    buf = ct_node_read(be, leaf, NS);
    g_assert_cmpuint(GUINT32_FROM_LE(ct_item(buf, 0)->type), ==,
                     EXTREE_ITEM_DATA);
    ct_item(buf, 0)->host_offset = GUINT64_TO_LE(free_at);
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);
    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "corrupt free tree: free space at offset"));
    g_assert_true(ct_has_msg(&r, "overlaps extent at guest offset 0x0"));
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_double_use(void)
{
    uint64_t leaf;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeCheckResult res;
    CtReport r;
    uint8_t *buf = ct_node_read(be, leaf, NS);

    /* items 0 (guest 0) and 2 (guest 8) both DATA: share a host range */
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 2)->key), ==, 8 * BS);
    ct_item(buf, 2)->host_offset = ct_item(buf, 0)->host_offset;
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);
    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "double use of host offset"));
    g_assert_true(ct_has_msg(&r, "guest offsets 0x0 and 0x8000"));
    /* the space item 2 owned is now owned by nobody */
    g_assert_cmpuint(res.leaks, ==, 1);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_leak_repair(void)
{
    uint64_t leaf, host, got;
    ExtreeBackend *be = make_image(&leaf);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    CtReport r;

    /* allocated, committed, never mapped: leaked */
    g_assert_cmpint(extree_alloc_data(t, 500 * BS, 3 * BS, &host, &got), ==,
                    0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 1);
    g_assert_cmpuint(res.leaked_bytes, ==, got);
    g_assert_true(ct_has_msg(&r, "leaked host space at offset 0x"));
    g_ptr_array_free(r.msgs, true);

    run_check(be, true, &res, &r);
    g_assert_cmpuint(res.leaks, ==, 1);
    g_assert_cmpuint(res.repaired_leaks, ==, 1);
    g_ptr_array_free(r.msgs, true);
    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 0);
    g_ptr_array_free(r.msgs, true);

    /* the repaired space is allocatable again */
    t = ct_open(be);
    g_assert_cmpuint(extree_free_bytes(t), >=, got);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/check/clean", test_clean);
    g_test_add_func("/check/bad-crc", test_bad_crc);
    g_test_add_func("/check/overlapping-extents", test_overlapping_extents);
    g_test_add_func("/check/extent-over-free-space",
                    test_extent_over_free_space);
    g_test_add_func("/check/double-use", test_double_use);
    g_test_add_func("/check/leak-repair", test_leak_repair);
    return g_test_run();
}
