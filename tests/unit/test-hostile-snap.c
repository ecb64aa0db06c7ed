/*
 * Unit tests: damaged images with snapshots whose checksums are all valid
 * (issue: hostile images with snapshots).  Each case once returned wrong
 * data with success, lost the other snapshots, or passed the checker.
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

/*
 * A two-level tree of 400 one-block extents, snapshot "s1" of it, then the
 * live tree's first leaf rewritten (block 0 to new space): the snapshot
 * keeps the old root and first leaf, and shares the other leaves
 */
static ExtreeBackend *make_image(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    Extree *t = ct_open(be);

    for (int i = 0; i < NEXT; i++) {
        ct_write(t, (uint64_t)i * 1024, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    g_strlcpy(info.name, "s1", sizeof(info.name));
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    ct_write(t, 0, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    return be;
}

static Extree *open_opts(ExtreeBackend *be, bool ro, bool check, int want,
                         const char *msg)
{
    ExtreeOpenOptions o = { .read_only = ro, .check = check,
                            .repair = check && !ro };
    Extree *t = NULL;
    char *err = NULL;

    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, want);
    if (msg) {
        g_assert_nonnull(err);
        if (!strstr(err, msg)) {
            g_error("open: want \"%s\" in \"%s\"", msg, err);
        }
    }
    g_free(err);
    return t;
}

/* Rewrite snapshot entry 0 with @edit applied, table checksum fixed */
static void edit_entry(ExtreeBackend *be,
                       void (*edit)(ExtreeDiskSnapEntry *, void *),
                       void *opaque)
{
    ExtreeDiskSuper sb;
    uint64_t off, len;
    uint8_t *buf;

    ct_read_super(be, &sb);
    off = GUINT64_FROM_LE(sb.snap_table_offset);
    len = sizeof(ExtreeDiskSnapHeader) +
          GUINT32_FROM_LE(sb.snap_count) * sizeof(ExtreeDiskSnapEntry);
    buf = g_malloc(len);
    g_assert_cmpint(be->ops->pread(be->opaque, off, buf, len), ==, 0);
    edit((ExtreeDiskSnapEntry *)(buf + sizeof(ExtreeDiskSnapHeader)), opaque);
    ext_st32(buf + 4, 0);
    ext_st32(buf + 4, extree_crc32c(0, buf, len));
    g_assert_cmpint(be->ops->pwrite(be->opaque, off, buf, len), ==, 0);
    g_free(buf);
}

static uint64_t entry_root(ExtreeBackend *be)
{
    ExtreeDiskSuper sb;
    ExtreeDiskSnapEntry e;

    ct_read_super(be, &sb);
    g_assert_cmpint(be->ops->pread(be->opaque,
                                   GUINT64_FROM_LE(sb.snap_table_offset) +
                                   sizeof(ExtreeDiskSnapHeader), &e,
                                   sizeof(e)), ==, 0);
    return GUINT64_FROM_LE(e.root.bytenr);
}

/*
 * 1. snap_generation lowered below the snapshot's generation: the shared
 * leaves would look unshared and a write would change them in place.  A
 * writer's open refuses; read-only opens and the checker go on, and
 * "-r all" raises it, after which the shared data is shared again.
 */
static void test_snap_generation(void)
{
    ExtreeBackend *be = make_image();
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    ExtreeRun run;
    bool shared;
    Extree *t;

    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, &sb,
                                       EXTREE_SB_SIZE), ==, 0);
        sb.snap_generation = GUINT64_TO_LE(1);
        ct_write_super(be, i, &sb);
    }
    open_opts(be, false, false, -EIO, "snap_generation 1 not above");
    /* reads do not depend on it */
    t = open_opts(be, true, false, 0, NULL);
    g_assert_cmpint(ct_lookup1(t, 1024, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    extree_close(t);

    t = open_opts(be, false, true, 0, NULL);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS, &res, ct_report,
                                     &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    g_assert_true(ct_has_msg(&r, "snap_generation 1 not above"));
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                                     &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 1);
    g_assert_true(ct_has_msg(&r, "snap_generation set to"));
    extree_close(t);

    /* repaired: the block the snapshot shares is shared again */
    t = ct_open(be);
    ct_check_clean(t, NULL);
    g_assert_cmpint(ct_lookup1(t, 1024, &run), ==, 0);
    g_assert_cmpint(extree_data_shared(t, 1024, BS, run.host, &shared), ==,
                    0);
    g_assert_true(shared);
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/* The snapshot's root node as the entry names it, minus its last item */
static void drop_last_ptr(ExtreeBackend *be)
{
    uint64_t root = entry_root(be);
    uint8_t *buf = ct_node_read(be, root, NS);
    uint32_t nr = ext_ld32(buf + EXT_NH_NRITEMS);

    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 1);
    g_assert_cmpuint(nr, >=, 3);
    memset(buf + EXTREE_NODE_HEADER_SIZE + (nr - 1) * EXT_PTR_ISZ, 0,
           EXT_PTR_ISZ);
    ext_st32(buf + EXT_NH_NRITEMS, nr - 1);
    ct_node_write(be, root, buf, NS, true);
    g_free(buf);
}

static void point_at_leaf(ExtreeDiskSnapEntry *e, void *opaque)
{
    const uint64_t *leaf = opaque;

    e->root.bytenr = GUINT64_TO_LE(leaf[0]);
    e->root.generation = GUINT64_TO_LE(leaf[1]);
    e->root.level = 0;
}

/*
 * Load, revert to and delete the snapshot: each fails with -EIO and leaves
 * the image as it was (it opens, the live tree reads as before)
 */
static void snapshot_ops_fail(ExtreeBackend *be, const char *msg)
{
    ExtreeRun run;
    Extree *t;

    t = open_opts(be, true, false, 0, NULL);
    ct_corrupt_calls = 0;
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    g_assert_cmpint(extree_snapshot_load_tmp(t, 0), ==, -EIO);
    g_assert_cmpint(ct_corrupt_calls, ==, 1);
    g_assert_nonnull(strstr(extree_last_error(t), msg));
    extree_close(t);

    t = ct_open(be);
    g_assert_cmpint(extree_snapshot_goto(t, 0), ==, -EIO);
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), msg));
    extree_close(t);

    t = ct_open(be);
    g_assert_cmpuint(extree_snapshot_count(t), ==, 1);
    for (int i = 0; i < NEXT; i++) {
        g_assert_cmpint(ct_lookup1(t, (uint64_t)i * 1024, &run), ==, 0);
        g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    }
    extree_close(t);
}

/*
 * 2. A snapshot's root that maps less than its entry says: one item fewer,
 * or one of the tree's leaves named as the root (its generation and level
 * right).  Reads would find holes, a revert would store a tree the
 * superblock contradicts.
 */
static void test_snap_root_lost_items(void)
{
    ExtreeBackend *be = make_image();
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    Extree *t;

    drop_last_ptr(be);
    snapshot_ops_fail(be, "snapshot '1' has extent_count 400");
    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "snapshot '1' has extent_count 400"));
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_snap_root_is_leaf(void)
{
    ExtreeBackend *be = make_image();
    uint64_t leaf[2];
    uint8_t *buf;

    /* the old root's second child: a leaf the live tree still shares */
    buf = ct_node_read(be, entry_root(be), NS);
    leaf[0] = ext_ld64(buf + EXTREE_NODE_HEADER_SIZE + EXT_PTR_ISZ +
                       EXT_KP_CHILD);
    leaf[1] = ext_ld64(buf + EXTREE_NODE_HEADER_SIZE + EXT_PTR_ISZ +
                       EXT_KP_GEN);
    g_free(buf);
    edit_entry(be, point_at_leaf, leaf);
    snapshot_ops_fail(be, "is a leaf of 126 items");
    extree_mem_backend_free(be);
}

/* Item @slot (-1: the last) of the leaf at @leaf moved to guest @key */
static void move_item(ExtreeBackend *be, uint64_t leaf, int slot,
                      uint64_t key)
{
    uint8_t *buf = ct_node_read(be, leaf, NS);

    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 0);
    if (slot < 0) {
        slot = ext_ld32(buf + EXT_NH_NRITEMS) - 1;
    }
    ct_item(buf, slot)->key = GUINT64_TO_LE(key);
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);
}

/* The last child of the interior root at @root */
static uint64_t last_child(ExtreeBackend *be, uint64_t root)
{
    uint8_t *buf = ct_node_read(be, root, NS);
    uint32_t nr = ext_ld32(buf + EXT_NH_NRITEMS);
    uint64_t child = ext_ld64(buf + EXTREE_NODE_HEADER_SIZE +
                              (nr - 1) * EXT_PTR_ISZ + EXT_KP_CHILD);

    g_free(buf);
    return child;
}

/*
 * 3. An extent item moved past the virtual size (but below the VM state
 * area) in a leaf the live tree and the snapshot share: reading it fails,
 * from either tree, and the checker reports it.  Also when the leaf was
 * first read, and cached, through a tree it does fit (a snapshot larger
 * than the live image).
 */
static void test_item_past_size(void)
{
    ExtreeBackend *be = make_image();
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t leaf;
    ExtreeRun run;
    Extree *t;

    ct_read_super(be, &sb);
    leaf = last_child(be, GUINT64_FROM_LE(sb.extent_root.bytenr));
    g_assert_cmpuint(leaf, ==, last_child(be, entry_root(be)));
    /* the last item, guest 399k, moved to 5 MiB */
    move_item(be, leaf, -1, 5 * 1024 * 1024);

    t = ct_open(be);
    ct_corrupt_calls = 0;
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    g_assert_cmpint(ct_lookup1(t, 399 * 1024, &run), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "beyond the tree's "
                            "virtual size"));
    extree_close(t);
    /* growing the image must not bring the item to light: it fails */
    t = ct_open(be);
    g_assert_cmpint(extree_set_virtual_size(t, 8 * 1024 * 1024), ==, -EIO);
    g_assert_cmpuint(extree_virtual_size(t), ==, VSIZE);
    g_assert_nonnull(strstr(extree_last_error(t), "beyond the tree's "
                            "virtual size"));
    extree_close(t);

    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "beyond the tree's virtual size"));
    extree_close(t);

    t = open_opts(be, true, false, 0, NULL);
    g_assert_cmpint(extree_snapshot_load_tmp(t, 0), ==, 0);
    g_assert_cmpint(ct_lookup1(t, 399 * 1024, &run), ==, -EIO);
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

static void test_item_past_size_cached(void)
{
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeBackend *be = ct_create(2 * 1024 * 1024, BS, NS);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeDiskSuper sb;
    uint64_t leaf;
    ExtreeRun run;
    Extree *t = ct_open(be);

    /* a 2 MiB snapshot, then the live image grown to 4 MiB */
    for (int i = 0; i < 300; i++) {
        ct_write(t, (uint64_t)i * 1024, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_strlcpy(info.name, "small", sizeof(info.name));
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    g_assert_cmpint(extree_set_virtual_size(t, VSIZE), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    /* the last item of the shared last leaf moved to 3 MiB */
    ct_read_super(be, &sb);
    leaf = last_child(be, GUINT64_FROM_LE(sb.extent_root.bytenr));
    g_assert_cmpuint(leaf, ==, last_child(be, entry_root(be)));
    move_item(be, leaf, -1, 3 * 1024 * 1024);

    /* the checker walks the live tree first: the leaf is shared */
    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "beyond the tree's virtual size"));
    extree_close(t);
    g_ptr_array_free(r.msgs, true);

    /*
     * Read through the live tree, where 3 MiB is inside the size, the leaf
     * stays cached; reverting to the snapshot makes the 2 MiB tree reach it
     */
    t = ct_open(be);
    g_assert_cmpint(ct_lookup1(t, 298 * 1024, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpint(extree_snapshot_goto(t, 0), ==, 0);
    g_assert_cmpuint(extree_virtual_size(t), ==, 2 * 1024 * 1024);
    g_assert_cmpint(ct_lookup1(t, 298 * 1024, &run), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "beyond the tree's "
                            "virtual size"));
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * 4. A reference count recorded above the one found: a leak, which
 * "-r leaks" repairs, not "no errors"
 */
static void test_refs_leak(void)
{
    ExtreeBackend *be = make_image();
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t refs;
    uint8_t *buf;
    Extree *t;

    ct_read_super(be, &sb);
    refs = GUINT64_FROM_LE(sb.ref_root.bytenr);
    buf = ct_node_read(be, refs, NS);
    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 0);
    g_assert_cmpuint(ext_ld32(buf + EXT_NH_NRITEMS), >=, 1);
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 0)->host_offset), ==, 2);
    ct_item(buf, 0)->host_offset = GUINT64_TO_LE(3);
    ct_node_write(be, refs, buf, NS, true);
    g_free(buf);

    t = ct_open(be);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, >=, 1);
    g_assert_cmpuint(res.leaked_ref_bytes, >=, NS);
    g_assert_true(ct_has_msg(&r, "3 references recorded, 2 found"));
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.repaired_leaks, ==, res.leaks);
    ct_check_clean(t, NULL);
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/*
 * 6. Reference counts recorded too low (a REFS item removed, checksum
 * fixed): the count of what the snapshot and the live tree share says 1.
 * A delete, a revert or an in-place write would free or change what
 * another root still uses; each fails with -EIO instead, before it frees
 * or writes anything, and "-r all" repairs the counts.
 */

/* Remove the REFS item that covers host offset @host */
static void refs_remove(ExtreeBackend *be, uint64_t host)
{
    ExtreeDiskSuper sb;
    uint64_t refs;
    uint8_t *buf;
    uint32_t nr;
    int i;

    ct_read_super(be, &sb);
    refs = GUINT64_FROM_LE(sb.ref_root.bytenr);
    buf = ct_node_read(be, refs, NS);
    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 0);
    nr = ext_ld32(buf + EXT_NH_NRITEMS);
    for (i = 0; i < (int)nr; i++) {
        uint64_t key = GUINT64_FROM_LE(ct_item(buf, i)->key);
        uint64_t len = GUINT64_FROM_LE(ct_item(buf, i)->length);

        if (key <= host && host - key < len) {
            break;
        }
    }
    g_assert_cmpint(i, <, (int)nr);
    memmove(ct_item(buf, i), ct_item(buf, i + 1),
            (nr - i - 1) * sizeof(ExtreeDiskItem));
    memset(ct_item(buf, nr - 1), 0, sizeof(ExtreeDiskItem));
    ext_st32(buf + EXT_NH_NRITEMS, nr - 1);
    ct_node_write(be, refs, buf, NS, true);
    g_free(buf);
}

/* The host offset of guest @guest in the live tree */
static uint64_t live_host(ExtreeBackend *be, uint64_t guest)
{
    Extree *t = open_opts(be, true, false, 0, NULL);
    ExtreeRun run;
    uint64_t host;

    g_assert_cmpint(ct_lookup1(t, guest, &run), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    host = run.host;
    extree_close(t);
    return host;
}

/* After the failed operation: every extent of both trees intact */
static void refs_low_after(ExtreeBackend *be)
{
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeRun run;
    Extree *t;

    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpuint(extree_snapshot_count(t), ==, 1);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    /* the count shortfall, and nothing freed that a tree uses */
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "1 references recorded, 2 found"));
    g_assert_false(ct_has_msg(&r, "free"));
    extree_close(t);

    t = open_opts(be, false, true, 0, NULL);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                                     &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, res.repaired_corruptions);
    extree_close(t);
    t = ct_open(be);
    ct_check_clean(t, NULL);
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, 0);
    ct_check_clean(t, NULL);
    for (int i = 0; i < NEXT; i++) {
        g_assert_cmpint(ct_lookup1(t, (uint64_t)i * 1024, &run), ==, 0);
        g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    }
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
}

static void test_refs_low_delete_data(void)
{
    ExtreeBackend *be = make_image();
    Extree *t;

    /* guest 1k: s1's old first leaf and the live copy share its data */
    refs_remove(be, live_host(be, 1024));
    t = ct_open(be);
    ct_corrupt_calls = 0;
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, -EIO);
    g_assert_cmpint(ct_corrupt_calls, ==, 1);
    g_assert_nonnull(strstr(extree_last_error(t), "another root maps it"));
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

static void test_refs_low_delete_node(void)
{
    ExtreeBackend *be = make_image();
    ExtreeDiskSuper sb;
    Extree *t;

    /* the last leaf: s1 and the live tree share it */
    ct_read_super(be, &sb);
    refs_remove(be, last_child(be, GUINT64_FROM_LE(sb.extent_root.bytenr)));
    t = ct_open(be);
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "another root reaches"));
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

static void test_refs_low_goto(void)
{
    ExtreeBackend *be = make_image();
    Extree *t;

    refs_remove(be, live_host(be, 1024));
    t = ct_open(be);
    g_assert_cmpint(extree_snapshot_goto(t, 0), ==, -EIO);
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

static void test_refs_low_write(void)
{
    ExtreeBackend *be = make_image();
    uint64_t host = live_host(be, 1024);
    bool shared = false;
    Extree *t;

    refs_remove(be, host);
    t = ct_open(be);
    g_assert_cmpint(extree_data_shared(t, 1024, BS, host, &shared), ==,
                    -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "snapshot '1' maps it"));
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

/* A new mapping over DATA a lying count says only the live tree uses */
static void test_refs_low_replace(void)
{
    ExtreeBackend *be = make_image();
    Extree *t;

    refs_remove(be, live_host(be, 1024));
    t = ct_open(be);
    ct_corrupt_calls = 0;
    extree_set_corrupt_handler(t, ct_count_corrupt, NULL);
    /* to new space, as a write the counts call shared would go */
    g_assert_cmpint(extree_punch(t, 1024, BS), ==, -EIO);
    g_assert_cmpint(ct_corrupt_calls, ==, 1);
    g_assert_nonnull(strstr(extree_last_error(t), "snapshot '1' maps it"));
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

/* A copy of a node a lying count says only the live tree uses */
static void test_refs_low_cow(void)
{
    ExtreeBackend *be = make_image();
    ExtreeDiskSuper sb;
    Extree *t;

    ct_read_super(be, &sb);
    refs_remove(be, last_child(be, GUINT64_FROM_LE(sb.extent_root.bytenr)));
    t = ct_open(be);
    /* a write into the shared last leaf's range copies it */
    g_assert_cmpint(extree_punch(t, 399 * 1024, BS), ==, -EIO);
    g_assert_nonnull(strstr(extree_last_error(t), "reaches it too"));
    extree_close(t);
    refs_low_after(be);
    extree_mem_backend_free(be);
}

/*
 * F (issue 49): the snapshot's own first leaf maps guest 1024 to the host
 * block of guest 2048.  Trees share data only where they share guest
 * offsets, so the checker reports a double use and "-r all" must not
 * adopt it by raising the reference count (it did, and reported the
 * image clean): the repair is refused and the corruption stays reported.
 */
static void test_double_use_not_adopted(void)
{
    ExtreeBackend *be = make_image();
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    uint64_t root = entry_root(be), leaf;
    uint8_t *buf;
    Extree *t;

    buf = ct_node_read(be, root, NS);
    g_assert_cmpuint(buf[EXT_NH_LEVEL], ==, 1);
    leaf = ext_ld64(buf + EXTREE_NODE_HEADER_SIZE + EXT_KP_CHILD);
    g_free(buf);
    buf = ct_node_read(be, leaf, NS);
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 1)->key), ==, 1024);
    g_assert_cmpuint(GUINT64_FROM_LE(ct_item(buf, 2)->key), ==, 2048);
    ct_item(buf, 1)->host_offset = ct_item(buf, 2)->host_offset;
    ct_node_write(be, leaf, buf, NS, true);
    g_free(buf);

    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_true(ct_has_msg(&r, "double use of host offset"));
    extree_close(t);

    t = open_opts(be, false, true, 0, NULL);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.repaired_corruptions, <, res.corruptions);
    extree_close(t);
    t = open_opts(be, true, true, 0, NULL);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    extree_close(t);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/*
 * Point chunk @chunk of bitmap @bm at @target in the directory, with the
 * checksums and the entry's count of set bits made to match what lies
 * there (a CRC-valid edit, as the red team made them)
 */
static void point_chunk(ExtreeBackend *be, unsigned bm, unsigned chunk,
                        uint64_t target)
{
    ExtreeDiskSuper sb;
    uint64_t dir, len, p = sizeof(ExtreeDiskBitmapHeader);
    uint8_t blk[BS], *buf;

    ct_read_super(be, &sb);
    dir = GUINT64_FROM_LE(sb.bitmap_dir_offset);
    len = GUINT32_FROM_LE(sb.bitmap_dir_length);
    buf = g_malloc(len);
    g_assert_cmpint(be->ops->pread(be->opaque, dir, buf, len), ==, 0);
    for (unsigned i = 0;; i++) {
        uint32_t nch = ext_ld32(buf + p + 16);
        uint64_t tab = p + 24 + EXTREE_ROUND_UP(buf[p] | buf[p + 1] << 8, 8);
        uint64_t count = 0;

        if (i < bm) {
            p = tab + nch * 16;
            continue;
        }
        ext_st64(buf + tab + chunk * 16, target);
        for (uint32_t c = 0; c < nch; c++) {
            uint64_t off = ext_ld64(buf + tab + c * 16);

            if (off) {
                g_assert_cmpint(be->ops->pread(be->opaque, off, blk, BS), ==,
                                0);
                for (int b = 0; b < BS; b++) {
                    count += __builtin_popcount(blk[b]);
                }
                ext_st32(buf + tab + c * 16 + 8, extree_crc32c(0, blk, BS));
            }
        }
        ext_st64(buf + p + 8, count);
        break;
    }
    ext_st32(buf + 4, 0);
    ext_st32(buf + 4, extree_crc32c(0, buf, len));
    g_assert_cmpint(be->ops->pwrite(be->opaque, dir, buf, len), ==, 0);
    g_free(buf);
}

/*
 * F (issue 49): bitmap "b"'s first chunk pointed (checksums fixed) at the
 * live tree's DATA block of guest 2048 (@what 0), at a leaf both trees
 * share (1), at the snapshot table (2), at bitmap "c"'s first chunk (3).
 * A double use; bitmaps are derived data, so "-r all" drops the bitmap
 * (both of them for 3) and the other owner keeps its block; the image is
 * then clean.  Before, the repair was refused (or, over free space,
 * adopted both owners) and the image stayed corrupt.
 */
static void test_bitmap_chunk_double_use(void)
{
    static const char *const names[] = {
        "extent at guest offset 0x800", "extent tree node",
        "snapshot table", "bitmap 'c' chunk 0",
    };

    for (int what = 0; what < 4; what++) {
        ExtreeBackend *be = make_image();
        CtReport r = { g_ptr_array_new_with_free_func(g_free) };
        ExtreeCheckResult res;
        ExtreeDiskSuper sb;
        uint64_t target, data = live_host(be, 2048), old;
        ExtreeRun run;
        Extree *t;

        t = ct_open(be);
        g_assert_cmpint(extree_bitmap_add(t, "b", BS, true), ==, 0);
        g_assert_cmpint(extree_bitmap_add(t, "c", BS, true), ==, 0);
        ct_write(t, 0, 2 * BS);
        g_assert_cmpint(extree_commit(t), ==, 0);
        old = ((ExtreeBitmap *)g_ptr_array_index(t->bm.list, 0))->chunk_off[0];
        target = ((ExtreeBitmap *)g_ptr_array_index(t->bm.list,
                                                    1))->chunk_off[0];
        g_assert_cmpuint(old, !=, 0);
        extree_close(t);
        ct_read_super(be, &sb);
        switch (what) {
        case 0:
            target = live_host(be, 2048);
            break;
        case 1:
            target = last_child(be, GUINT64_FROM_LE(sb.extent_root.bytenr));
            break;
        case 2:
            target = GUINT64_FROM_LE(sb.snap_table_offset);
            break;
        }
        point_chunk(be, 0, 0, target);

        t = open_opts(be, true, true, 0, NULL);
        g_assert_cmpuint(extree_bitmap_count(t), ==, 2);
        g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
        g_assert_cmpuint(res.corruptions, >=, 1);
        if (!ct_has_msg(&r, "bitmap 'b' chunk 0") ||
            !ct_has_msg(&r, names[what])) {
            g_error("case %d: no double use of 'b' chunk 0 and %s", what,
                    names[what]);
        }
        extree_close(t);

        t = open_opts(be, false, true, 0, NULL);
        g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
        g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
        extree_close(t);

        t = ct_open(be);
        ct_check_clean(t, NULL);
        g_assert_cmpint(extree_bitmap_find(t, "b"), <, 0);
        g_assert_cmpint(extree_bitmap_find(t, "c"), ==,
                        what == 3 ? -ENOENT : 0);
        g_assert_cmpuint(extree_snapshot_count(t), ==, 1);
        g_assert_cmpint(ct_lookup1(t, 2048, &run), ==, 0);
        g_assert_cmphex(run.host, ==, data);
        /* the block the chunk left is free again, and used: no leak */
        ct_write(t, 500 * 1024, 64 * 1024);
        g_assert_cmpint(extree_commit(t), ==, 0);
        ct_check_clean(t, NULL);
        extree_close(t);
        g_ptr_array_free(r.msgs, true);
        extree_mem_backend_free(be);
    }
}

/*
 * The walk of every tree before a handle's first update (the lowered
 * host_end class, tests/fuzz/fixed/host-end-lowered-vmstate) runs only
 * when the backend holds bytes past host_end: after a clean close the
 * file ends there, and the first update reads a handful of nodes, however
 * many the trees hold (issue 50).  With a tail (a crash's grow-ahead, or
 * an edited host_end) every node is read first.
 */
static void test_probe_only_with_tail(void)
{
    ExtreeBackend *be = ct_create(64 * VSIZE, BS, NS);
    ExtreeSnapshotInfo info = { .name = "s" };
    ExtreeStats before, after;
    uint64_t end, clean, tail;
    Extree *t = ct_open(be);

    for (uint64_t i = 0; i < 20000; i++) {
        ct_write(t, i * 2 * BS, BS);
    }
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    ct_write(t, 0, 64 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    extree_close(t);
    /* as the driver leaves it at close */
    g_assert_cmpint(be->ops->truncate(be->opaque, end), ==, 0);

    t = ct_open(be);
    extree_stats(t, &before);
    ct_write(t, 40001 * BS, BS);
    extree_stats(t, &after);
    clean = after.cache_misses - before.cache_misses;
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    extree_close(t);

    g_assert_cmpint(be->ops->truncate(be->opaque, end), ==, 0);
    g_assert_cmpint(be->ops->truncate(be->opaque, end + 64 * NS), ==, 0);
    t = ct_open(be);
    extree_stats(t, &before);
    ct_write(t, 40003 * BS, BS);
    extree_stats(t, &after);
    tail = after.cache_misses - before.cache_misses;
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);

    /* 20,000 extents, a snapshot and its copies: over a hundred nodes */
    g_test_message("first update reads %" PRIu64 " nodes without a tail, %"
                   PRIu64 " with one", clean, tail);
    g_assert_cmpuint(clean, <, 32);
    g_assert_cmpuint(tail, >, 100);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/hostile-snap/snap-generation", test_snap_generation);
    g_test_add_func("/hostile-snap/root-lost-items",
                    test_snap_root_lost_items);
    g_test_add_func("/hostile-snap/root-is-leaf", test_snap_root_is_leaf);
    g_test_add_func("/hostile-snap/item-past-size", test_item_past_size);
    g_test_add_func("/hostile-snap/item-past-size-cached",
                    test_item_past_size_cached);
    g_test_add_func("/hostile-snap/refs-leak", test_refs_leak);
    g_test_add_func("/hostile-snap/refs-low-delete-data",
                    test_refs_low_delete_data);
    g_test_add_func("/hostile-snap/refs-low-delete-node",
                    test_refs_low_delete_node);
    g_test_add_func("/hostile-snap/refs-low-goto", test_refs_low_goto);
    g_test_add_func("/hostile-snap/refs-low-write", test_refs_low_write);
    g_test_add_func("/hostile-snap/refs-low-replace", test_refs_low_replace);
    g_test_add_func("/hostile-snap/refs-low-cow", test_refs_low_cow);
    g_test_add_func("/hostile-snap/double-use-not-adopted",
                    test_double_use_not_adopted);
    g_test_add_func("/hostile-snap/bitmap-chunk-double-use",
                    test_bitmap_chunk_double_use);
    g_test_add_func("/hostile-snap/probe-only-with-tail",
                    test_probe_only_with_tail);
    return g_test_run();
}
