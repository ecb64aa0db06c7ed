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

/*
 * An image with a one-leaf extent tree: DATA at guest 0, 8, 16, 24 (2
 * blocks each, not host-contiguous) and free space from a punched one
 */
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
    /*
     * open reads the extent root: refused; the checker needs an open
     * image, so damage a copy of the root instead ...
     */
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

/* Every run of the image, for comparison before and after a repair */
static GArray *snapshot(Extree *t)
{
    GArray *runs = g_array_new(false, false, sizeof(ExtreeRun));
    ExtreeCursor c;
    uint64_t g = 0;

    extree_cursor_init(&c, t);
    while (g < extree_virtual_size(t)) {
        ExtreeRun run;
        g_assert_cmpint(extree_cursor_query(&c, g, extree_virtual_size(t) - g,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
        g_array_append_val(runs, run);
        g += run.length;
    }
    extree_cursor_release(&c);
    return runs;
}

static void assert_same_runs(GArray *a, GArray *b)
{
    g_assert_cmpuint(a->len, ==, b->len);
    for (guint i = 0; i < a->len; i++) {
        ExtreeRun *x = &g_array_index(a, ExtreeRun, i);
        ExtreeRun *y = &g_array_index(b, ExtreeRun, i);
        g_assert_cmpuint(x->guest, ==, y->guest);
        g_assert_cmpuint(x->length, ==, y->length);
        g_assert_cmpint(x->type, ==, y->type);
        if (x->type == EXTREE_RUN_DATA) {
            g_assert_cmphex(x->host, ==, y->host);
        }
    }
}

static Extree *open_repair(ExtreeBackend *be)
{
    ExtreeOpenOptions o = { .repair = true };
    Extree *t = NULL;
    char *err = NULL;

    if (extree_open(be, &o, &t, &err) < 0) {
        g_error("repair open failed: %s", err);
    }
    return t;
}

/*
 * D1 + D2: a free-space tree node with a bad checksum.  Reading and
 * checking work read-only; a writer cannot open it, but can mark it
 * corrupt without a handle; the repair open plus the checker rebuild the
 * free tree from the extent tree, and the corrupt bit can then be cleared.
 */
static void test_free_tree_damage_repair(void)
{
    ExtreeOpenOptions ro = { .read_only = true }, rw = { 0 };
    ExtreeBackend *be = ct_create(1 << 30, 512, NS);
    ExtreeDiskSuper sb;
    ExtreeCheckResult res;
    GArray *before, *after;
    uint64_t froot, host, got;
    uint8_t *buf;
    CtReport r;
    Extree *t;
    char *err = NULL, *want;

    /* enough scattered free space for a free tree of several leaves */
    t = ct_open(be);
    for (int i = 0; i < 3000; i++) {
        ct_write(t, (uint64_t)i * 2 * 512, 512);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (int i = 0; i < 3000; i += 2) {
        g_assert_cmpint(extree_punch(t, (uint64_t)i * 2 * 512, 512), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    before = snapshot(t);
    extree_close(t);
    ct_read_super(be, &sb);
    g_assert_cmpuint(sb.free_root.level, >, 0);

    /* damage the free tree's root */
    froot = GUINT64_FROM_LE(sb.free_root.bytenr);
    buf = ct_node_read(be, froot, NS);
    buf[200] ^= 0x40;
    ct_node_write(be, froot, buf, NS, false);
    g_free(buf);

    /* read-only: opens, reads, reports the superblock's free space */
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, 0);
    g_assert_cmpuint(extree_free_bytes(t), ==,
                     GUINT64_FROM_LE(sb.free_bytes));
    after = snapshot(t);
    assert_same_runs(before, after);
    g_array_free(after, true);
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    want = g_strdup_printf("corrupt free tree node at offset 0x%" PRIx64
                           ": bad checksum", froot);
    g_assert_true(ct_has_msg(&r, want));
    g_free(want);
    g_ptr_array_free(r.msgs, true);
    extree_close(t);

    /* read-write: refused, with the structure and offset */
    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -EIO);
    g_assert_nonnull(strstr(err, "corrupt free tree node at offset"));
    g_clear_pointer(&err, g_free);

    /* marked corrupt without a handle: one new generation, once */
    g_assert_cmpint(extree_mark_corrupt_image(be), ==, 0);
    g_assert_cmpint(extree_mark_corrupt_image(be), ==, 0);
    {
        ExtreeDiskSuper nsb;
        ct_read_super(be, &nsb);
        g_assert_cmpuint(GUINT64_FROM_LE(nsb.generation), ==,
                         GUINT64_FROM_LE(sb.generation) + 1);
        g_assert_cmphex(GUINT64_FROM_LE(nsb.incompat_features), ==,
                        EXTREE_INCOMPAT_CORRUPT);
    }
    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -EACCES);
    g_clear_pointer(&err, g_free);

    /* repair open: no updates until repaired, no clearing before a check */
    t = open_repair(be);
    g_assert_cmpint(extree_punch(t, 0, 512), ==, -EIO);
    g_assert_cmpint(extree_alloc_data(t, 0, 512, &host, &got), ==, -EIO);
    g_assert_cmpint(extree_clear_corrupt(t), ==, -EINVAL);
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
    g_assert_true(ct_has_msg(&r, "free-space tree rebuilt"));
    g_ptr_array_free(r.msgs, true);
    /* still corrupt-flagged until cleared */
    g_assert_cmpint(extree_punch(t, 0, 512), ==, -EIO);
    g_assert_cmpint(extree_clear_corrupt(t), ==, 0);
    g_assert_cmphex(extree_incompat_features(t), ==, 0);
    g_assert_cmpint(extree_clear_corrupt(t), ==, 0);
    extree_close(t);

    /* an ordinary image again: same mapping, clean, writable */
    t = ct_open(be);
    g_assert_cmphex(extree_incompat_features(t), ==, 0);
    after = snapshot(t);
    assert_same_runs(before, after);
    g_array_free(after, true);
    ct_check_clean(t, &res);
    g_assert_cmpuint(res.free_bytes, ==, extree_free_bytes(t));
    for (int i = 0; i < 3000; i += 2) {
        ct_write(t, (uint64_t)i * 2 * 512, 512);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    g_array_free(before, true);
    extree_mem_backend_free(be);
}

/*
 * A free tree that loads but lists space an extent uses: the checker of a
 * writable handle rebuilds it (the "-r all" case without a corrupt bit)
 */
static void test_free_tree_overlap_rebuild(void)
{
    uint64_t leaf, free_at;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeDiskSuper sb;
    ExtreeCheckResult res;
    GArray *before, *after;
    CtReport r;
    uint8_t *buf;
    Extree *t;

    /* the free tree claims the host range of the extent at guest 8 */
    t = ct_open(be);
    before = snapshot(t);
    extree_close(t);
    buf = ct_node_read(be, leaf, NS);
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 2)->key), ==, 8 * BS);
    free_at = GUINT64_FROM_LE(ct_item(buf, 2)->host_offset);
    g_free(buf);
    ct_read_super(be, &sb);
    buf = ct_node_read(be, GUINT64_FROM_LE(sb.free_root.bytenr), NS);
    {
        ExtreeDiskNodeHeader *h = (ExtreeDiskNodeHeader *)buf;
        uint32_t nr = GUINT32_FROM_LE(h->nritems);
        ExtreeDiskItem it = {
            .key = GUINT64_TO_LE(free_at), .length = GUINT64_TO_LE(BS),
            .host_offset = GUINT64_TO_LE(free_at),
            .type = GUINT32_TO_LE(EXTREE_ITEM_FREE),
        };
        int slot = 0;
        while (slot < (int)nr &&
               GUINT64_FROM_LE(ct_item(buf, slot)->key) < free_at) {
            slot++;
        }
        memmove(ct_item(buf, slot + 1), ct_item(buf, slot),
                (nr - slot) * sizeof(ExtreeDiskItem));
        *ct_item(buf, slot) = it;
        h->nritems = GUINT32_TO_LE(nr + 1);
    }
    ct_node_write(be, GUINT64_FROM_LE(sb.free_root.bytenr), buf, NS, true);
    g_free(buf);
    sb.free_bytes = GUINT64_TO_LE(GUINT64_FROM_LE(sb.free_bytes) + BS);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);

    t = ct_open(be);
    /* leaks only: the corruption stays */
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS, &res, ct_report,
                                     &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    g_ptr_array_free(r.msgs, true);
    g_assert_cmpint(extree_clear_corrupt(t), ==, 0);    /* not flagged */
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                                     &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_true(ct_has_msg(&r, "overlaps extent at guest offset 0x8000"));
    g_assert_cmpuint(res.repaired_corruptions, ==, 1);
    g_ptr_array_free(r.msgs, true);
    ct_check_clean(t, NULL);
    after = snapshot(t);
    assert_same_runs(before, after);
    g_array_free(after, true);
    extree_close(t);
    t = ct_open(be);
    ct_check_clean(t, NULL);
    extree_close(t);
    g_array_free(before, true);
    extree_mem_backend_free(be);
}

/*
 * Corruption in the extent tree: the repair open checks but repairs
 * nothing, and the corrupt bit stays
 */
static void test_extent_damage_not_repaired(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t leaf;
    uint8_t *buf;
    CtReport r;
    Extree *t = ct_open(be);

    for (int i = 0; i < 300; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    ct_read_super(be, &sb);
    buf = ct_node_read(be, GUINT64_FROM_LE(sb.extent_root.bytenr), NS);
    leaf = GUINT64_FROM_LE(((ExtreeDiskKeyPtr *)(buf + 64))[1].child);
    g_free(buf);
    buf = ct_node_read(be, leaf, NS);
    buf[100] ^= 1;
    ct_node_write(be, leaf, buf, NS, false);
    g_free(buf);
    g_assert_cmpint(extree_mark_corrupt_image(be), ==, 0);

    t = open_repair(be);
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, >=, 1);
    g_assert_cmpuint(res.repaired_leaks, ==, 0);
    g_assert_true(ct_has_msg(&r, "leaks not repaired: the image has "
                                 "corruptions"));
    g_ptr_array_free(r.msgs, true);
    g_assert_cmpint(extree_clear_corrupt(t), ==, -EINVAL);
    extree_close(t);
    ct_read_super(be, &sb);
    g_assert_cmphex(GUINT64_FROM_LE(sb.incompat_features), ==,
                    EXTREE_INCOMPAT_CORRUPT);
    extree_mem_backend_free(be);
}

/*
 * Marked corrupt, but only leaks: the repair open repairs them, the bit
 * can be cleared, and the image is writable again
 */
static void test_corrupt_bit_cleared_after_leak_repair(void)
{
    uint64_t leaf, host, got;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeCheckResult res;
    Extree *t = ct_open(be);
    CtReport r;

    g_assert_cmpint(extree_alloc_data(t, 500 * BS, 3 * BS, &host, &got), ==,
                    0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_mark_corrupt(t), ==, 0);
    extree_close(t);

    t = open_repair(be);
    r.msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 1);
    g_assert_cmpuint(res.repaired_leaks, ==, 1);
    g_ptr_array_free(r.msgs, true);
    g_assert_cmpint(extree_clear_corrupt(t), ==, 0);
    extree_close(t);

    t = ct_open(be);
    ct_check_clean(t, NULL);
    ct_write(t, 600 * BS, 2 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Check with @fix on a repair open; the messages in *@r */
static void check_fix(ExtreeBackend *be, unsigned fix, ExtreeCheckResult *res,
                      CtReport *r)
{
    ExtreeOpenOptions o = { .repair = true, .check = true };
    Extree *t;
    char *err = NULL;

    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, 0);
    r->msgs = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_check_fix(t, fix, res, ct_report, r), ==, 0);
    extree_close(t);
}

/* Point snapshot @i's root at @root (generation @gen, level @level) */
static void set_snap_root(ExtreeBackend *be, unsigned i, uint64_t root,
                          uint64_t gen, unsigned level, uint64_t count,
                          uint64_t bytes)
{
    ExtreeDiskSuper sb;
    uint64_t off, len;
    uint32_t n, csum;
    uint8_t *buf, *e, zero[4] = { 0 };

    ct_read_super(be, &sb);
    off = GUINT64_FROM_LE(sb.snap_table_offset);
    n = GUINT32_FROM_LE(sb.snap_count);
    g_assert_cmpuint(i, <, n);
    len = 64 + (uint64_t)EXTREE_SNAP_ENTRY_SIZE * n;
    buf = g_malloc(len);
    g_assert_cmpint(be->ops->pread(be->opaque, off, buf, len), ==, 0);
    e = buf + 64 + (size_t)EXTREE_SNAP_ENTRY_SIZE * i;
    ext_st64(e + offsetof(ExtreeDiskSnapEntry, root) + EXT_RT_BYTENR, root);
    ext_st64(e + offsetof(ExtreeDiskSnapEntry, root) + EXT_RT_GEN, gen);
    e[offsetof(ExtreeDiskSnapEntry, root) + EXT_RT_LEVEL] = level;
    ext_st64(e + offsetof(ExtreeDiskSnapEntry, generation), gen);
    ext_st64(e + offsetof(ExtreeDiskSnapEntry, extent_count), count);
    ext_st64(e + offsetof(ExtreeDiskSnapEntry, extent_bytes), bytes);
    csum = extree_crc32c(0, buf, 4);
    csum = extree_crc32c(csum, zero, 4);
    csum = extree_crc32c(csum, buf + 8, len - 8);
    ext_st32(buf + 4, csum);
    g_assert_cmpint(be->ops->pwrite(be->opaque, off, buf, len), ==, 0);
    g_free(buf);
}

/*
 * A snapshot whose root is the reference count tree's root (issue 37,
 * 6).  That tree is walked first; the snapshot reaches the node again
 * and must not count it as a shared extent tree node: its counts would
 * fall short by one, and -r all would write a count of 2 over it.  The
 * snapshot's counts are made to match the node's items, so that nothing
 * else gives the damage away.
 */
static void test_snapshot_into_refs_tree(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    ExtreeNode view;
    CtReport r;
    uint64_t rroot, rgen, gen, bytes = 0;
    char *want;
    uint32_t nr;

    for (int i = 0; i < 8; i++) {
        ct_write(t, i * 2 * BS, BS);
    }
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    ct_write(t, 0, BS);                 /* copies the shared leaf */
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_write(t, 100 * BS, BS);          /* counts stay: refs tree unchanged */
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    ct_read_super(be, &sb);
    rroot = GUINT64_FROM_LE(sb.ref_root.bytenr);
    rgen = GUINT64_FROM_LE(sb.ref_root.generation);
    gen = GUINT64_FROM_LE(sb.generation);
    g_assert_cmpuint(sb.ref_root.level, ==, 0);
    g_assert_cmpuint(rgen, <, gen);
    view.buf = ct_node_read(be, rroot, NS);
    nr = node_nritems(&view);
    g_assert_cmpuint(nr, >, 0);
    for (uint32_t i = 0; i < nr; i++) {
        bytes += leaf_len(&view, i);
    }
    g_free(view.buf);
    set_snap_root(be, 0, rroot, rgen, 0, nr, bytes);

    want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                           ": bad owner", rroot);
    check_fix(be, 0, &res, &r);
    g_assert_true(ct_has_msg(&r, want));
    g_assert_false(ct_has_msg(&r, "2 found"));
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_ptr_array_free(r.msgs, true);

    /* nothing repaired, nothing committed: no count over the node */
    check_fix(be, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS, &res, &r);
    g_assert_true(ct_has_msg(&r, want));
    g_assert_false(ct_has_msg(&r, "reference counts of"));
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    g_ptr_array_free(r.msgs, true);
    ct_read_super(be, &sb);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.generation), ==, gen);
    g_free(want);
    extree_mem_backend_free(be);
}

/*
 * The live extent tree points at the free-space tree's root, which the
 * extent tree's walk thus reaches first.  That pointer is the damage;
 * the free tree still owns the node: its walk counts the node and its
 * free ranges as on any other image.
 */
static void test_extent_tree_into_free_tree(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    ExtreeKeyPtr kp;
    ExtreeNode view;
    CtReport r;
    uint64_t root, froot, fgen;
    char *want;

    /* a root over two leaves of 126 and 74 one-block extents */
    for (int i = 0; i < 200; i++) {
        ct_write(t, i * 2 * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    extree_close(t);

    ct_read_super(be, &sb);
    root = GUINT64_FROM_LE(sb.extent_root.bytenr);
    froot = GUINT64_FROM_LE(sb.free_root.bytenr);
    fgen = GUINT64_FROM_LE(sb.free_root.generation);
    g_assert_cmpuint(sb.free_root.level, ==, 0);
    view.buf = ct_node_read(be, root, NS);
    g_assert_cmpuint(node_nritems(&view), ==, 2);
    g_assert_cmpuint(fgen, <=, ext_ld64(view.buf + EXT_NH_GEN));
    ptr_get(&view, 1, &kp);
    g_assert_cmpuint(kp.bytes, ==, 74 * BS);
    kp.child = froot;
    kp.child_gen = fgen;
    ptr_set(&view, 1, &kp);
    ct_node_write(be, root, view.buf, NS, true);
    g_free(view.buf);

    want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                           ": bad owner", froot);
    check_fix(be, 0, &res, &r);
    g_assert_true(ct_has_msg(&r, want));
    g_assert_false(ct_has_msg(&r, "corrupt free tree"));
    g_assert_false(ct_has_msg(&r, "free_bytes mismatch"));
    /* what the lost leaf held: the leaf and its extents, nothing else */
    g_assert_cmpuint(res.leaked_bytes, ==, NS + 74 * BS);
    g_ptr_array_free(r.msgs, true);
    g_free(want);
    extree_mem_backend_free(be);
}

/*
 * A node shared by the live tree and a snapshot must be what each parent
 * expects, whichever walk reaches it first: the snapshot's root gives
 * its shared second leaf a first key (@variant 0) or child_bytes (1) the
 * leaf does not have.  The live tree's walk reaches it first, validly.
 */
static void test_shared_node_mismatch(void)
{
    for (int variant = 0; variant < 2; variant++) {
        ExtreeBackend *be = ct_create(1 << 30, BS, NS);
        Extree *t = ct_open(be);
        ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
        ExtreeCheckResult res;
        ExtreeKeyPtr kp;
        ExtreeNode view;
        CtReport r;
        uint64_t sroot;
        char *want;

        for (int i = 0; i < 200; i++) {
            ct_write(t, i * 2 * BS, BS);
        }
        g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
        sroot = t->trees[EXTREE_TREE_EXTENT].root;
        g_assert_cmpuint(extree_depth(t), ==, 2);
        /* the first leaf and the root are copied, the second is shared */
        ct_write(t, BS, BS);
        g_assert_cmpint(extree_commit(t), ==, 0);
        g_assert_cmpuint(t->trees[EXTREE_TREE_EXTENT].root, !=, sroot);
        extree_close(t);
        check_fix(be, 0, &res, &r);
        g_assert_cmpuint(res.corruptions + res.leaks, ==, 0);
        g_ptr_array_free(r.msgs, true);

        view.buf = ct_node_read(be, sroot, NS);
        ptr_get(&view, 1, &kp);
        if (variant == 0) {
            kp.key += BS;
        } else {
            kp.bytes -= BS;
        }
        ptr_set(&view, 1, &kp);
        ct_node_write(be, sroot, view.buf, NS, true);
        g_free(view.buf);

        want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                               ": %s", kp.child, variant ?
                               "subtree bytes mismatch" :
                               "first key mismatch");
        check_fix(be, 0, &res, &r);
        g_assert_true(ct_has_msg(&r, want));
        g_assert_cmpuint(res.corruptions, >=, 1);
        g_ptr_array_free(r.msgs, true);
        g_free(want);
        extree_mem_backend_free(be);
    }
}

/* A free range of at least @len bytes (the free tree is one leaf) */
static uint64_t free_range(ExtreeBackend *be, uint64_t len)
{
    ExtreeDiskSuper sb;
    uint64_t at = 0;
    uint8_t *buf;
    uint32_t nr;

    ct_read_super(be, &sb);
    g_assert_cmpuint(sb.free_root.level, ==, 0);
    buf = ct_node_read(be, GUINT64_FROM_LE(sb.free_root.bytenr), NS);
    nr = GUINT32_FROM_LE(((ExtreeDiskNodeHeader *)buf)->nritems);
    for (uint32_t i = 0; i < nr && !at; i++) {
        if (GUINT64_FROM_LE(ct_item(buf, i)->length) >= len) {
            at = GUINT64_FROM_LE(ct_item(buf, i)->key);
        }
    }
    g_free(buf);
    g_assert_cmpuint(at, !=, 0);
    return at;
}

/*
 * F (issue 49): DATA items pointed into space the free tree lists.  One
 * extent alone there is adopted, as qcow2 adopts a cluster its L2 table
 * maps and its refcount calls free (@two false).  Two extents from
 * different guest offsets there (@two) are a double use: the sweep
 * compared each claim only with the one reaching furthest (the free
 * range), missed it, and "-r all" rebuilt the free tree around both and
 * reported every corruption repaired.
 */
static void free_listed_data(bool two)
{
    uint64_t leaf, free_at;
    ExtreeBackend *be = make_image(&leaf);
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    ExtreeRun run;
    CtReport r;
    uint8_t *buf;
    Extree *t;

    /* 8 free blocks in a row; the extents go inside, past the first */
    t = ct_open(be);
    ct_write(t, 100 * BS, 8 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_punch(t, 100 * BS, 8 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    ct_read_super(be, &sb);
    leaf = GUINT64_FROM_LE(sb.extent_root.bytenr);
    free_at = free_range(be, 8 * BS) + BS;
    buf = ct_node_read(be, leaf, NS);
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 2)->key), ==, 8 * BS);
    ct_item(buf, 0)->host_offset = GUINT64_TO_LE(free_at);
    if (two) {
        ct_item(buf, 2)->host_offset = GUINT64_TO_LE(free_at);
    }
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);

    run_check(be, false, &res, &r);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "corrupt free tree: free space at offset"));
    g_assert_cmpint(ct_has_msg(&r, "double use of host offset"), ==, two);
    g_ptr_array_free(r.msgs, true);

    check_fix(be, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS, &res, &r);
    if (two) {
        g_assert_cmpuint(res.repaired_corruptions, ==, 0);
        g_assert_true(ct_has_msg(&r, "leaks not repaired"));
        g_ptr_array_free(r.msgs, true);
        run_check(be, false, &res, &r);
        g_assert_true(ct_has_msg(&r, "double use of host offset"));
    } else {
        g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
        g_assert_true(ct_has_msg(&r, "extents keep the host space the free "
                                     "tree listed under them (1 overlaps)"));
        t = ct_open(be);
        ct_check_clean(t, NULL);
        g_assert_cmpint(ct_lookup1(t, 0, &run), ==, 0);
        g_assert_cmphex(run.host, ==, free_at);
        extree_close(t);
    }
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_free_listed_data_adopted(void)
{
    free_listed_data(false);
}

static void test_free_listed_data_double_use(void)
{
    free_listed_data(true);
}

#define UNIT (16 * BS)

/*
 * An image with two compressed extents (zstd at guest 0, zlib at guest
 * UNIT) in a one-leaf tree; their payloads' host offsets in @host
 */
static ExtreeBackend *make_compressed(uint64_t *leaf, uint64_t host[2])
{
    static const uint32_t alg[2] = { EXTREE_COMPRESS_ZSTD,
                                     EXTREE_COMPRESS_ZLIB };
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint8_t *src = g_malloc(UNIT), *pay = g_malloc(UNIT);
    ExtreeDiskSuper sb;

    for (int i = 0; i < 2; i++) {
        uint64_t got;
        size_t plen;

        for (size_t j = 0; j < UNIT; j++) {
            src[j] = "compressed payload "[(j / 5 + i + j % 5) % 19];
        }
        g_assert_cmpint(extree_compress(alg[i], src, UNIT, pay, UNIT, &plen),
                        ==, 0);
        g_assert_cmpint(extree_alloc_data(t, i * UNIT,
                                          EXTREE_ROUND_UP(plen, BS),
                                          &host[i], &got), ==, 0);
        g_assert_cmpint(be->ops->pwrite(be->opaque, host[i], pay, plen), ==,
                        0);
        g_assert_cmpint(extree_map_compressed(t, i * UNIT, UNIT, host[i],
                                              plen, alg[i]), ==, 0);
    }
    ct_write(t, 2 * UNIT, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    ct_read_super(be, &sb);
    *leaf = GUINT64_FROM_LE(sb.extent_root.bytenr);
    g_free(src);
    g_free(pay);
    return be;
}

/*
 * H (issue 49): check reads and verifies every compressed payload.  A
 * flipped payload bit, a payload length one off (both ways) and the other
 * algorithm: the reads fail with -EIO, and check said "No errors".  No
 * repair can give the data back: "-r all" leaves the item, reported.
 */
static void test_compressed_payload(void)
{
    for (int what = 0; what < 4; what++) {
        uint64_t leaf, host[2];
        ExtreeBackend *be = make_compressed(&leaf, host);
        int victim = what == 2 ? 1 : 0;
        ExtreeCheckResult res;
        uint8_t *buf, byte;
        CtReport r;
        char *want;

        buf = ct_node_read(be, leaf, NS);
        g_assert_cmpuint(GUINT32_FROM_LE(ct_item(buf, victim)->type), ==,
                         EXTREE_ITEM_COMPRESSED);
        switch (what) {
        case 0:     /* a bit in the middle of the zstd payload */
            be->ops->pread(be->opaque, host[0] + 20, &byte, 1);
            byte ^= 0x10;
            be->ops->pwrite(be->opaque, host[0] + 20, &byte, 1);
            break;
        case 1:     /* zstd payload one byte shorter */
        case 2:     /* zlib payload one byte longer */
        {
            uint32_t f = GUINT32_FROM_LE(ct_item(buf, victim)->flags);
            uint32_t len = f & EXTREE_COMPRESSED_LEN_MASK;
            uint32_t nlen = what == 1 ? len - 1 : len + 1;

            /* the same blocks: nothing but the payload changes */
            g_assert_cmpuint(EXTREE_ROUND_UP(len, BS), ==,
                             EXTREE_ROUND_UP(nlen, BS));
            f = (f & ~EXTREE_COMPRESSED_LEN_MASK) | nlen;
            ct_item(buf, victim)->flags = GUINT32_TO_LE(f);
            break;
        }
        default:    /* zstd payload said to be zlib */
        {
            uint32_t f = GUINT32_FROM_LE(ct_item(buf, victim)->flags);

            f = (f & EXTREE_COMPRESSED_LEN_MASK) |
                (EXTREE_COMPRESS_ZLIB << EXTREE_COMPRESSED_ALG_SHIFT);
            ct_item(buf, victim)->flags = GUINT32_TO_LE(f);
            break;
        }
        }
        ct_node_write(be, leaf, buf, NS, true);
        g_free(buf);

        run_check(be, false, &res, &r);
        g_assert_cmpuint(res.corruptions, ==, 1);
        g_assert_cmpuint(res.leaks, ==, 0);
        want = g_strdup_printf("corrupt compressed payload at offset 0x%"
                               PRIx64 ": extent at guest offset 0x%x",
                               host[victim], victim * UNIT);
        if (!ct_has_msg(&r, want)) {
            g_error("case %d: no \"%s\"", what, want);
        }
        g_ptr_array_free(r.msgs, true);

        /* reported, never repaired; other repairs still run */
        check_fix(be, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS, &res, &r);
        g_assert_cmpuint(res.corruptions, ==, 1);
        g_assert_cmpuint(res.repaired_corruptions, ==, 0);
        g_assert_true(ct_has_msg(&r, want));
        g_ptr_array_free(r.msgs, true);
        run_check(be, false, &res, &r);
        g_assert_cmpuint(res.corruptions, ==, 1);
        g_ptr_array_free(r.msgs, true);
        g_free(want);
        extree_mem_backend_free(be);
    }
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
    g_test_add_func("/check/free-tree-damage-repair",
                    test_free_tree_damage_repair);
    g_test_add_func("/check/free-tree-overlap-rebuild",
                    test_free_tree_overlap_rebuild);
    g_test_add_func("/check/extent-damage-not-repaired",
                    test_extent_damage_not_repaired);
    g_test_add_func("/check/corrupt-bit-cleared-after-leak-repair",
                    test_corrupt_bit_cleared_after_leak_repair);
    g_test_add_func("/check/snapshot-into-refs-tree",
                    test_snapshot_into_refs_tree);
    g_test_add_func("/check/extent-tree-into-free-tree",
                    test_extent_tree_into_free_tree);
    g_test_add_func("/check/shared-node-mismatch", test_shared_node_mismatch);
    g_test_add_func("/check/free-listed-data-adopted",
                    test_free_listed_data_adopted);
    g_test_add_func("/check/free-listed-data-double-use",
                    test_free_listed_data_double_use);
    g_test_add_func("/check/compressed-payload", test_compressed_payload);
    return g_test_run();
}
