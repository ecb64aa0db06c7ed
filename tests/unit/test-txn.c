/*
 * Unit tests: create, open, commit, superblock choice, features
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 4096
#define NS 4096

static void test_create_params(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeCreateParams p = { .virtual_size = 1 << 20 };
    char *err = NULL;
    char longname[2000];

    p.block_size = 1000;
    g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "Block size"));
    g_clear_pointer(&err, g_free);
    p.block_size = 8192;
    p.node_size = 4096;
    g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "Node size"));
    g_clear_pointer(&err, g_free);
    p.block_size = p.node_size = 0;
    p.virtual_size = 1000;
    g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
    g_clear_pointer(&err, g_free);
    p.virtual_size = 1 << 20;
    memset(longname, 'a', sizeof(longname));
    longname[sizeof(longname) - 1] = 0;
    p.backing_file = longname;
    g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
    g_clear_pointer(&err, g_free);
    p.backing_file = "base.img";
    p.backing_fmt = "qcow2";
    g_assert_cmpint(extree_create(be, &p, &err), ==, 0);
    g_assert_null(err);
    extree_mem_backend_free(be);
}

static void test_commit_reopen(void)
{
    ExtreeBackend *be;
    Extree *t;
    ExtreeRun run;
    int n;

    be = ct_create(1 << 30, BS, NS);
    t = ct_open(be);
    g_assert_cmpuint(extree_generation(t), ==, 1);
    g_assert_cmpuint(extree_block_size(t), ==, BS);
    g_assert_cmpuint(extree_node_size(t), ==, NS);
    g_assert_cmpuint(extree_data_start(t), ==, 8192);
    g_assert_false(extree_is_dirty(t));
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, 1);

    ct_write(t, 0, 10 * BS);
    g_assert_true(extree_is_dirty(t));
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, 2);
    g_assert_false(extree_is_dirty(t));
    g_assert_cmpint(extree_set_backing(t, "base.raw", "raw"), ==, 0);
    g_assert_cmpint(extree_set_virtual_size(t, 1ULL << 31), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* uncommitted: lost at close */
    ct_write(t, 100 * BS, BS);
    extree_close(t);

    t = ct_open(be);
    g_assert_cmpuint(extree_generation(t), ==, 3);
    g_assert_cmpstr(extree_backing_file(t), ==, "base.raw");
    g_assert_cmpstr(extree_backing_fmt(t), ==, "raw");
    g_assert_cmpuint(extree_virtual_size(t), ==, 1ULL << 31);
    g_assert_cmpuint(extree_extent_count(t), ==, 1);
    g_assert_cmpint(extree_lookup(t, 100 * BS, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    ct_check_clean(t, NULL);

    /* shrink punches what is cut off and frees its data */
    g_assert_cmpint(extree_set_virtual_size(t, 5 * BS), ==, 0);
    g_assert_cmpint(extree_lookup(t, 0, 5 * BS, &run, 1, &n), ==, 0);
    g_assert_cmpuint(run.length, ==, 5 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    g_assert_cmpuint(extree_extent_count(t), ==, 1);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A torn newer superblock: open falls back to the older slot */
static void test_torn_super(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    ExtreeOpenOptions ro = { .read_only = true };
    Extree *t = ct_open(be);
    ExtreeDiskSuper sb;
    ExtreeRun run;
    uint8_t junk[512];
    char *err = NULL;
    int slot, n;

    ct_write(t, 0, 4 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);          /* gen 2, slot 0 */
    ct_write(t, 50 * BS, 4 * BS);
    g_assert_cmpint(extree_punch(t, 0, 4 * BS), ==, 0);
    /* gen 3 into slot 1, and the crash comes before the flush after it:
     * a durable commit would give back (discard) what gen 2 uses */
    extree_mem_backend_inject_fault(be, EXTREE_FAULT_FLUSH, 1, false);
    g_assert_cmpint(extree_commit(t), ==, -EIO);
    extree_close(t);

    slot = ct_read_super(be, &sb);
    g_assert_cmpint(slot, ==, 1);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.generation), ==, 3);
    /* tear it: half a sector of new garbage */
    memset(junk, 0x5a, sizeof(junk));
    g_assert_cmpint(be->ops->pwrite(be->opaque, 4096 + 1024, junk, 256), ==,
                    0);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, 2);
    g_assert_cmpint(extree_lookup(t, 0, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpint(extree_lookup(t, 50 * BS, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
    /* the generation-2 state is complete: nothing it uses was reused */
    ct_check_clean(t, NULL);
    extree_close(t);

    /* writable open commits generation 3 again, into slot 1 */
    t = ct_open(be);
    ct_write(t, 70 * BS, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_generation(t), ==, 3);
    extree_close(t);
    g_assert_cmpint(ct_read_super(be, &sb), ==, 1);

    /* both slots bad: -EIO, a message for each */
    g_assert_cmpint(be->ops->pwrite(be->opaque, 100, junk, 4), ==, 0);
    g_assert_cmpint(be->ops->pwrite(be->opaque, 4096 + 100, junk, 4), ==, 0);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -EIO);
    g_assert_nonnull(strstr(err, "corrupt superblock at offset 0x0: bad "
                                 "checksum"));
    g_assert_nonnull(strstr(err, "offset 0x1000"));
    g_free(err);
    extree_mem_backend_free(be);

    /* not an extree image */
    be = extree_mem_backend_new();
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "bad magic"));
    g_free(err);
    extree_mem_backend_free(be);
}

static void test_features(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    ExtreeOpenOptions ro = { .read_only = true }, rw = { 0 };
    ExtreeDiskSuper sb;
    Extree *t;
    char *err = NULL;
    uint64_t host, got;
    int slot;

    /* unknown incompatible bit: refused, even read-only */
    slot = ct_read_super(be, &sb);
    sb.incompat_features = GUINT64_TO_LE(1ULL << 40);
    ct_write_super(be, slot, &sb);
    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -ENOTSUP);
    g_clear_pointer(&err, g_free);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -ENOTSUP);
    g_clear_pointer(&err, g_free);
    sb.incompat_features = 0;
    ct_write_super(be, slot, &sb);

    /* bad superblock field: -EINVAL */
    sb.block_size = GUINT32_TO_LE(3000);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);
    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -EINVAL);
    g_assert_nonnull(strstr(err, "bad block_size 3000"));
    g_clear_pointer(&err, g_free);
    sb.block_size = GUINT32_TO_LE(BS);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);

    /* marked corrupt: read-only only */
    t = ct_open(be);
    ct_write(t, 0, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_write(t, BS, BS);
    g_assert_cmpint(extree_mark_corrupt(t), ==, 0);
    g_assert_cmpint(extree_punch(t, 0, BS), ==, -EIO);
    extree_close(t);
    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -EACCES);
    g_clear_pointer(&err, g_free);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, 0);
    g_assert_cmphex(extree_incompat_features(t), ==, EXTREE_INCOMPAT_CORRUPT);
    g_assert_cmpuint(extree_extent_count(t), ==, 1);
    /* read-only: updates refused */
    g_assert_cmpint(extree_punch(t, 0, BS), ==, -EROFS);
    g_assert_cmpint(extree_alloc_data(t, 0, BS, &host, &got), ==, -EROFS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* dirty_limit forces commits */
static void test_dirty_limit(void)
{
    ExtreeBackend *be = ct_create(1 << 30, 512, 4096);
    Extree *t = ct_open_opts(be, false, 0, 16 * 4096);
    ExtreeStats st;

    for (int i = 0; i < 5000; i++) {
        ct_write(t, (uint64_t)i * 2 * 512, 512);
        extree_stats(t, &st);
        g_assert_cmpuint(st.dirty_nodes, <=, 16 + 2 * extree_depth(t));
    }
    g_assert_cmpuint(st.forced_commits, >, 0);
    g_assert_cmpuint(extree_generation(t), >, 1);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A failed commit leaves the state dirty; retrying succeeds */
static void test_commit_failure_retry(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeRun run;
    int n;

    ct_write(t, 0, 4 * BS);
    for (unsigned mask = EXTREE_FAULT_WRITE; mask <= EXTREE_FAULT_FLUSH;
         mask <<= 1) {
        for (int nth = 0; nth < 3; nth++) {
            extree_mem_backend_inject_fault(be, mask, nth, false);
            if (extree_commit(t) == 0) {
                break;
            }
            g_assert_true(extree_is_dirty(t));
            extree_mem_backend_inject_fault(be, 0, 0, false);
            ct_write(t, (100 + nth) * BS, BS);
        }
        extree_mem_backend_inject_fault(be, 0, 0, false);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpint(extree_lookup(t, 0, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/txn/create-params", test_create_params);
    g_test_add_func("/txn/commit-reopen", test_commit_reopen);
    g_test_add_func("/txn/torn-super", test_torn_super);
    g_test_add_func("/txn/features", test_features);
    g_test_add_func("/txn/dirty-limit", test_dirty_limit);
    g_test_add_func("/txn/commit-failure-retry", test_commit_failure_retry);
    return g_test_run();
}
