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

/* The messages a user sees, each check on its own, nothing written */
static void test_create_check(void)
{
    static const struct {
        uint64_t size;
        uint32_t bs, ns;
        const char *file, *fmt, *msg;
    } bad[] = {
        { 1ull << 63, 0, 0, NULL, NULL,
          "Image size must be at most 9223372036852678656 bytes" },
        { 1000, 0, 0, NULL, NULL,
          "Image size must be a multiple of 512 bytes" },
        { 1 << 20, 1000, 0, NULL, NULL,
          "Block size must be a power of two between 512 and 1048576 bytes" },
        { 1 << 20, 2 << 20, 0, NULL, NULL,
          "Block size must be a power of two between 512 and 1048576 bytes" },
        { 1 << 20, 0, 2048, NULL, NULL,
          "Node size must be a power of two between 4096 and 1048576 bytes" },
        { 1 << 20, 65536, 16384, NULL, NULL,
          "Node size (16384) must not be smaller than the block size "
          "(65536)" },
        { 1 << 20, 0, 0, NULL, "qcow2",
          "Backing format cannot be used without backing file" },
    };
    ExtreeBackend *be = extree_mem_backend_new();
    char longname[EXTREE_BACKING_FILE_MAX + 2];
    char *err = NULL;

    for (size_t i = 0; i < G_N_ELEMENTS(bad); i++) {
        ExtreeCreateParams p = { bad[i].size, bad[i].bs, bad[i].ns,
                                 bad[i].file, bad[i].fmt };
        g_assert_cmpint(extree_create_check(&p, &err), ==, -EINVAL);
        g_assert_cmpstr(err, ==, bad[i].msg);
        g_clear_pointer(&err, g_free);
        g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
        g_assert_cmpstr(err, ==, bad[i].msg);
        g_clear_pointer(&err, g_free);
        g_assert_cmpuint(extree_mem_backend_pages(be), ==, 0);
    }
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    {
        ExtreeCreateParams p = { .virtual_size = 1 << 20,
                                 .backing_file = longname };
        g_assert_cmpint(extree_create_check(&p, &err), ==, -EINVAL);
        g_assert_cmpstr(err, ==, "Backing file name too long (at most 1023 "
                                 "bytes)");
        g_clear_pointer(&err, g_free);
        longname[EXTREE_BACKING_FILE_MAX] = 0;
        g_assert_cmpint(extree_create_check(&p, &err), ==, 0);
        g_assert_null(err);
    }
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

/*
 * Open reads both superblock slots with one request; when that read
 * fails, slot by slot, so that an error costs only the slot it hits.
 * Every read of an open made to fail in turn: the open fails cleanly or
 * finds the newest generation, never garbage.
 */
static void test_open_read_faults(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    ExtreeMemStats st;
    Extree *t = ct_open(be);
    uint64_t gen, reads;
    char *err = NULL;

    for (int i = 0; i < 400; i++) {
        ct_write(t, (uint64_t)i * 8 * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_punch(t, 0, 800 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    gen = extree_generation(t);
    extree_close(t);

    extree_mem_backend_reset_stats(be);
    t = ct_open(be);
    extree_mem_backend_stats(be, &st);
    extree_close(t);
    reads = st.reads;
    g_assert_cmpuint(reads, >=, 3);

    for (uint64_t nth = 0; nth < reads; nth++) {
        uint64_t faults = extree_mem_backend_faults(be);
        int ret;

        extree_mem_backend_inject_fault(be, EXTREE_FAULT_READ, nth, false);
        ret = extree_open(be, NULL, &t, &err);
        g_assert_cmpuint(extree_mem_backend_faults(be), ==, faults + 1);
        extree_mem_backend_inject_fault(be, 0, 0, false);
        if (nth == 0) {
            /* the first read, of both slots: each is read again alone */
            g_assert_cmpint(ret, ==, 0);
        }
        if (ret < 0) {
            g_assert_cmpint(ret, ==, -EIO);
            g_assert_nonnull(err);
            g_free(err);
            err = NULL;
            continue;
        }
        g_assert_cmpuint(extree_generation(t), ==, gen);
        g_assert_null(extree_open_warning(t));
        ct_check_clean(t, NULL);
        extree_close(t);
    }
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
    /*
     * gen 3 into slot 1, and the crash comes before the flush after it:
     * a durable commit would give back (discard) what gen 2 uses
     */
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

    /* an intact image of another version: said so, not called damage */
    sb.version = GUINT32_TO_LE(1);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -ENOTSUP);
    g_assert_cmpstr(err, ==, "unsupported extree version 1 (this "
                    "implementation reads version 2)");
    g_clear_pointer(&err, g_free);
    sb.version = GUINT32_TO_LE(EXTREE_VERSION);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);

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

/* A failed write during commit leaves the state dirty; retrying succeeds */
static void test_commit_failure_retry(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeRun run;
    int n;

    ct_write(t, 0, 4 * BS);
    for (int nth = 0; nth < 3; nth++) {
        extree_mem_backend_inject_fault(be, EXTREE_FAULT_WRITE, nth, false);
        if (extree_commit(t) == 0) {
            break;
        }
        g_assert_true(extree_is_dirty(t));
        extree_mem_backend_inject_fault(be, 0, 0, false);
        ct_write(t, (100 + nth) * BS, BS);
    }
    extree_mem_backend_inject_fault(be, 0, 0, false);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpint(extree_lookup(t, 0, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * A failed flush during commit may have lost unflushed writes: the handle
 * refuses further commits and updates until it is reopened, and the image
 * then opens clean at one committed state.
 */
static void test_commit_flush_failure(void)
{
    for (int nth = 0; nth < 2; nth++) {
        ExtreeBackend *be = ct_create(1 << 30, BS, NS);
        Extree *t = ct_open(be);
        uint64_t host, got;

        ct_write(t, 0, 4 * BS);
        extree_mem_backend_inject_fault(be, EXTREE_FAULT_FLUSH, nth, false);
        g_assert_cmpint(extree_commit(t), ==, -EIO);
        extree_mem_backend_inject_fault(be, 0, 0, false);
        g_assert_cmpint(extree_commit(t), ==, -EIO);
        g_assert_cmpint(extree_alloc_data(t, 8 * BS, BS, &host, &got), ==,
                        -EIO);
        extree_close(t);

        t = ct_open(be);
        g_assert_cmpuint(extree_generation(t), >=, 1);
        ct_check_clean(t, NULL);
        extree_close(t);
        extree_mem_backend_free(be);
    }
}

/*
 * A file cut short: the node that lies past its end is reported as a
 * truncated image, not as corruption (QEMU then leaves the image alone)
 */
static void test_open_truncated(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    char *msg = NULL;

    ct_write(t, 0, 4 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    g_assert_cmpint(be->ops->truncate(be->opaque, EXTREE_SB_AREA + BS), ==,
                    0);
    g_assert_cmpint(extree_open(be, &(ExtreeOpenOptions) { 0 }, &t, &msg),
                    ==, -EIO);
    g_assert_nonnull(msg);
    g_assert_true(g_str_has_prefix(msg, "truncated image: "));
    g_free(msg);
    extree_mem_backend_free(be);
}

/* Memory backend ops without truncate and discard */
static ExtreeBackendOps bare_ops;

static ExtreeBackend *bare_backend(ExtreeBackend *be, ExtreeBackend *bare)
{
    bare_ops = *be->ops;
    bare_ops.truncate = NULL;
    bare_ops.discard = NULL;
    bare->ops = &bare_ops;
    bare->opaque = be->opaque;
    return bare;
}

/* D3: a slot with a good checksum and a bad field is reported */
static void test_open_warning(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS), bare;
    Extree *t = ct_open(bare_backend(be, &bare));
    ExtreeDiskSuper sb;
    const char *w;
    uint8_t junk[64];
    int slot;

    /* (without discard, so that generation 2 survives generation 3) */
    g_assert_null(extree_open_warning(t));
    ct_write(t, 0, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);          /* gen 2, slot 0 */
    ct_write(t, BS, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);          /* gen 3, slot 1 */
    extree_close(t);
    t = ct_open(be);
    g_assert_null(extree_open_warning(t));
    extree_close(t);

    slot = ct_read_super(be, &sb);
    g_assert_cmpint(slot, ==, 1);
    sb.block_size = GUINT32_TO_LE(3000);
    ct_write_super(be, slot, &sb);
    t = ct_open(be);
    g_assert_cmpuint(extree_generation(t), ==, 2);
    w = extree_open_warning(t);
    g_assert_nonnull(w);
    g_assert_nonnull(strstr(w, "corrupt superblock at offset 0x1000: bad "
                               "block_size 3000"));
    g_assert_nonnull(strstr(w, "generation field is 3"));
    g_assert_nonnull(strstr(w, "opened at generation 2 from offset 0x0"));
    extree_close(t);

    /* a torn slot (bad checksum) is what a crash leaves: no warning */
    memset(junk, 0xa5, sizeof(junk));
    g_assert_cmpint(be->ops->pwrite(be->opaque, 4096 + 200, junk,
                                    sizeof(junk)), ==, 0);
    t = ct_open(be);
    g_assert_cmpuint(extree_generation(t), ==, 2);
    g_assert_null(extree_open_warning(t));
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * D6 + D7: the newest slot is bad after its commit was durable, and the
 * older generation is incomplete (space it alone used was reused or
 * discarded): open fails and says which superblock was skipped; marking
 * the image corrupt refuses to overwrite that slot
 */
static void test_skipped_slot_open_fails(void)
{
    ExtreeOpenOptions ro = { .read_only = true };
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    ExtreeDiskSuper sb, again;
    uint8_t junk[64];
    char *err = NULL;
    int slot;

    ct_write(t, 0, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);          /* gen 2, slot 0 */
    ct_write(t, BS, BS);
    g_assert_cmpint(extree_commit(t), ==, 0);          /* gen 3, slot 1 */
    extree_close(t);

    slot = ct_read_super(be, &sb);
    g_assert_cmpint(slot, ==, 1);
    g_assert_cmpint(be->ops->pread(be->opaque, 0, &again, EXTREE_SB_SIZE),
                    ==, 0);
    g_assert_cmpuint(GUINT64_FROM_LE(again.generation), ==, 2);
    g_assert_cmpint(be->ops->discard(be->opaque,
                                     GUINT64_FROM_LE(again.extent_root.bytenr),
                                     NS), ==, 0);
    sb.block_size = GUINT32_TO_LE(3000);
    ct_write_super(be, slot, &sb);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -EIO);
    g_assert_true(g_str_has_prefix(err, "corrupt superblock at offset "
                                        "0x1000: bad block_size 3000; slot "
                                        "skipped"));
    g_assert_nonnull(strstr(err, "; then: corrupt extent tree node at "
                                 "offset 0x"));
    g_clear_pointer(&err, g_free);

    /* nothing written over the only copy of generation 3 */
    g_assert_cmpint(extree_mark_corrupt_image(be), ==, -EEXIST);
    g_assert_cmpint(be->ops->pread(be->opaque, EXTREE_SB_SIZE, &again,
                                   EXTREE_SB_SIZE), ==, 0);
    g_assert_cmpmem(&again, EXTREE_SB_SIZE, &sb, EXTREE_SB_SIZE);

    /* a bad checksum is named too */
    memset(junk, 0xa5, sizeof(junk));
    g_assert_cmpint(be->ops->pwrite(be->opaque, 4096 + 200, junk,
                                    sizeof(junk)), ==, 0);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -EIO);
    g_assert_true(g_str_has_prefix(err, "corrupt superblock at offset "
                                        "0x1000: bad checksum"));
    g_clear_pointer(&err, g_free);
    /* ... and a torn slot may be overwritten */
    g_assert_cmpint(extree_mark_corrupt_image(be), ==, 0);
    extree_mem_backend_free(be);
}

/* D5: a huge dirty limit means no forced commit, however much is dirty */
static void test_dirty_limit_off(void)
{
    ExtreeBackend *be = ct_create(1 << 30, 512, 4096);
    Extree *t = ct_open_opts(be, false, 0, UINT64_MAX / 2);
    ExtreeStats st;

    for (int i = 0; i < 20000; i++) {
        ct_write(t, (uint64_t)i * 2 * 512, 512);
    }
    extree_stats(t, &st);
    g_assert_cmpuint(st.forced_commits, ==, 0);
    g_assert_cmpuint(st.commits, ==, 0);
    g_assert_cmpuint(st.dirty_nodes, >, 100);
    g_assert_cmpuint(extree_generation(t), ==, 1);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * Log index of the first flush after the last superblock write of the
 * log, i.e. where the last commit became durable
 */
static size_t log_durable_at(ExtreeBackend *be)
{
    size_t len = extree_mem_backend_log_length(be), sb = SIZE_MAX;

    for (size_t i = 0; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(be, i, &e);
        if (e.op == EXTREE_LOG_WRITE && e.offset < EXTREE_SB_AREA) {
            sb = i;
        } else if (e.op == EXTREE_LOG_FLUSH && sb != SIZE_MAX && i > sb) {
            return i;
        }
    }
    g_assert_not_reached();
}

static bool all_zero(ExtreeBackend *be, uint64_t off, uint64_t len)
{
    uint8_t *buf = g_malloc(len);
    bool zero = true;

    g_assert_cmpint(be->ops->pread(be->opaque, off, buf, len), ==, 0);
    for (uint64_t i = 0; i < len; i++) {
        zero = zero && !buf[i];
    }
    g_free(buf);
    return zero;
}

/*
 * Discards in the log after the point where its last commit was durable
 * (none before it), added up over [lo, hi)
 */
static uint64_t logged_discards(ExtreeBackend *be, uint64_t lo, uint64_t hi)
{
    size_t durable = log_durable_at(be);
    size_t len = extree_mem_backend_log_length(be);
    uint64_t total = 0;

    for (size_t i = 0; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(be, i, &e);
        if (e.op != EXTREE_LOG_DISCARD) {
            continue;
        }
        g_assert_cmpuint(i, >, durable);
        if (e.offset < hi && lo < e.offset + e.bytes) {
            total += MIN(hi, e.offset + e.bytes) - MAX(lo, e.offset);
        }
    }
    return total;
}

/* Commit with the log recording */
static void commit_recorded(ExtreeBackend *be, Extree *t)
{
    extree_mem_backend_start_recording(be);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_mem_backend_stop_recording(be);
}

/*
 * D4: what a commit frees is discarded once the commit is durable: data at
 * once; node space after the next commit if nothing reused it meanwhile,
 * in runs of 256 KiB or more (a single copied node is not worth a hole)
 */
static void test_discard_after_commit(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint8_t *pattern = g_malloc(64 * BS);
    uint64_t data, old_root;
    ExtreeDiskSuper sb;
    ExtreeRun run;
    int n;

    ct_write(t, 0, 64 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_lookup(t, 0, BS, &run, 1, &n), ==, 0);
    data = run.host;
    memset(pattern, 0x77, 64 * BS);
    g_assert_cmpint(be->ops->pwrite(be->opaque, data, pattern, 64 * BS), ==,
                    0);
    ct_read_super(be, &sb);
    old_root = GUINT64_FROM_LE(sb.extent_root.bytenr);

    g_assert_cmpint(extree_punch(t, 0, 32 * BS), ==, 0);
    commit_recorded(be, t);
    g_assert_cmpuint(logged_discards(be, data, data + 32 * BS), ==, 32 * BS);
    g_assert_cmpuint(logged_discards(be, old_root, old_root + NS), ==, 0);
    g_assert_true(all_zero(be, data, 32 * BS));
    g_assert_false(all_zero(be, data + 32 * BS, 32 * BS));
    ct_check_clean(t, NULL);

    /* one node: not even after the next commit */
    g_assert_true(extree_alloc_is_free(t, old_root, NS));
    ct_write(t, 1000 * BS, BS);
    commit_recorded(be, t);
    g_assert_cmpuint(logged_discards(be, old_root, old_root + NS), ==, 0);

    /*
     * a tree of 100 leaves collapses: their run of node space goes after
     * the commit that follows
     */
    for (int i = 0; i < 12000; i++) {
        ct_write(t, (uint64_t)(4000 + 2 * i) * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    g_assert_cmpint(extree_punch(t, 4000 * BS, 24000 * BS), ==, 0);
    commit_recorded(be, t);
    g_assert_cmpuint(extree_depth(t), ==, 1);
    ct_write(t, 2000 * BS, BS);
    commit_recorded(be, t);
    /* the old leaves (and the free-tree nodes that commit copied) */
    {
        uint64_t total = logged_discards(be, 0, UINT64_MAX);
        if (g_test_verbose()) {
            g_printerr("node space discarded: %" PRIu64 " KiB\n",
                       total >> 10);
        }
        g_assert_cmpuint(total, >=, 256 * 1024);
        g_assert_cmpuint(total, <=, 200 * NS);
    }
    ct_check_clean(t, NULL);
    extree_close(t);
    g_free(pattern);
    extree_mem_backend_free(be);
}

/* Clean now, closed, clean when opened again; then freed */
static void check_close_reopen(ExtreeBackend *be, Extree *t)
{
    ct_check_clean(t, NULL);
    extree_close(t);
    t = ct_open(be);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* The free space around [start, start + len), which is free */
static uint64_t free_around(Extree *t, uint64_t start, uint64_t len)
{
    uint64_t lo = start, hi = start + len;

    while (lo - BS >= extree_data_start(t) &&
           extree_alloc_is_free(t, lo - BS, BS)) {
        lo -= BS;
    }
    while (hi < extree_host_end(t) && extree_alloc_is_free(t, hi, BS)) {
        hi += BS;
    }
    return hi - lo;
}

/*
 * D4: at close no next commit will discard the node space the last one
 * freed: extree_discard_deferred() does, in free ranges of 256 KiB or more,
 * once, and nothing while changes are uncommitted
 */
static void test_discard_deferred(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t total = 0;
    ExtreeMemStats st;
    size_t len;

    for (int i = 0; i < 12000; i++) {
        ct_write(t, (uint64_t)(4000 + 2 * i) * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_punch(t, 4000 * BS, 24000 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 1);

    /* uncommitted changes: nothing yet */
    ct_write(t, 100 * BS, BS);
    extree_mem_backend_reset_stats(be);
    extree_discard_deferred(t);
    extree_mem_backend_stats(be, &st);
    g_assert_cmpuint(st.discards, ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);

    /* that commit discarded the leaves; free some again, commit, close */
    for (int i = 0; i < 12000; i++) {
        ct_write(t, (uint64_t)(40000 + 2 * i) * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_punch(t, 40000 * BS, 24000 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_mem_backend_start_recording(be);
    extree_discard_deferred(t);
    extree_mem_backend_stop_recording(be);
    len = extree_mem_backend_log_length(be);
    for (size_t i = 0; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(be, i, &e);
        g_assert_cmpint(e.op, ==, EXTREE_LOG_DISCARD);
        g_assert_true(extree_alloc_is_free(t, e.offset, e.bytes));
        /*
         * in free space of 256 KiB or more; the node space the last
         * commit freed next to it stays
         */
        g_assert_cmpuint(free_around(t, e.offset, e.bytes), >=, 256 * 1024);
        total += e.bytes;
    }
    g_assert_cmpuint(total, >=, 256 * 1024);
    /* whole free ranges: they may take in the first round's leaves too */
    g_assert_cmpuint(total, <=, 400 * NS);

    /* once */
    extree_mem_backend_reset_stats(be);
    extree_discard_deferred(t);
    extree_mem_backend_stats(be, &st);
    g_assert_cmpuint(st.discards, ==, 0);
    check_close_reopen(be, t);
}

/*
 * D4: node space freed a few nodes per commit joins up into long free
 * ranges that no single commit freed; those go to the host whole (at the
 * commit after, or at close), so that no free range of 256 KiB or more
 * keeps old nodes
 */
static void test_discard_joined_runs(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS);
    Extree *t = ct_open(be);
    uint64_t pos, fs, fe, long_bytes = 0;

    for (int i = 0; i < 12000; i++) {
        ct_write(t, (uint64_t)(4000 + 2 * i) * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    /* 120 extents per commit, in guest order: a leaf or two each time */
    for (int i = 0; i < 100; i++) {
        g_assert_cmpint(extree_punch(t, (uint64_t)(4000 + 240 * i) * BS,
                                     240 * BS), ==, 0);
        g_assert_cmpint(extree_commit(t), ==, 0);
    }
    extree_discard_deferred(t);
    for (pos = 0; extree_alloc_next_free(t, pos, UINT64_MAX, &fs, &fe);
         pos = fe) {
        if (fe - fs >= 256 * 1024) {
            if (!all_zero(be, fs, fe - fs)) {
                g_error("free range at 0x%" PRIx64 " length 0x%" PRIx64
                        " still holds data", fs, fe - fs);
            }
            long_bytes += fe - fs;
        }
    }
    if (g_test_verbose()) {
        g_printerr("free in long ranges: %" PRIu64 " KiB\n",
                   long_bytes >> 10);
    }
    g_assert_cmpuint(long_bytes, >=, 256 * 1024);
    check_close_reopen(be, t);
}

/*
 * D4: free space at the end of the file leaves it: host_end goes down in
 * the first commit after the one that freed it, and the file is truncated
 * once that commit is durable
 */
static void test_trim_tail(void)
{
    ExtreeBackend *be = ct_create(1 << 30, BS, NS), bare;
    Extree *t = ct_open(be);
    uint64_t end_full, end_trimmed, durable;
    bool truncated = false;
    ExtreeMemStats st;
    size_t len;

    ct_write(t, 0, 2048 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end_full = extree_host_end(t);
    g_assert_cmpint(be->ops->pwrite(be->opaque, end_full - BS,
                                    (uint8_t[BS]) { 1 }, BS), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, end_full);

    /* freed by this commit: not reusable yet, so not cut yet */
    g_assert_cmpint(extree_punch(t, 1024 * BS, 1024 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), ==, end_full);

    /* the next commit cuts it, and truncates after it is durable */
    ct_write(t, 5000 * BS, BS);
    extree_mem_backend_start_recording(be);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_mem_backend_stop_recording(be);
    end_trimmed = extree_host_end(t);
    g_assert_cmpuint(end_trimmed, <=, end_full - 1000 * BS);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, end_trimmed);
    durable = log_durable_at(be);
    len = extree_mem_backend_log_length(be);
    for (size_t i = 0; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(be, i, &e);
        if (e.op == EXTREE_LOG_TRUNCATE) {
            g_assert_cmpuint(i, >, durable);
            g_assert_cmpuint(e.offset, ==, end_trimmed);
            truncated = true;
        }
    }
    g_assert_true(truncated);
    ct_check_clean(t, NULL);
    /* nothing to commit: nothing written, nothing cut */
    g_assert_false(extree_is_dirty(t));
    extree_close(t);

    t = ct_open(be);
    g_assert_cmpuint(extree_host_end(t), ==, end_trimmed);
    ct_check_clean(t, NULL);
    /* writes grow the file again */
    ct_write(t, 1024 * BS, 512 * BS);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), >, end_trimmed);
    ct_check_clean(t, NULL);

    /*
     * the same without truncate and discard: host_end still goes down,
     * the file stays as long as it was
     */
    g_assert_cmpint(extree_punch(t, 1024 * BS, 512 * BS), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end_full = extree_host_end(t);
    extree_close(t);
    t = ct_open(bare_backend(be, &bare));
    ct_write(t, 6000 * BS, BS);
    extree_mem_backend_reset_stats(be);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <, end_full);
    extree_mem_backend_stats(be, &st);
    g_assert_cmpuint(st.truncates, ==, 0);
    g_assert_cmpuint(st.discards, ==, 0);
    check_close_reopen(be, t);
}

/*
 * The trim lowers host_end before the free tree is synced; the sync then
 * reads committed free-tree nodes that list the cut space, which must still
 * pass validation (against the committed host_end)
 */
static void test_trim_evicted_free_leaf(void)
{
    ExtreeBackend *be = ct_create(1 << 30, 512, 4096);
    Extree *t = ct_open(be);
    uint64_t end;
    ExtreeCursor c;
    ExtreeRun run;

    /* a free tree of many leaves, then 2 MiB of data at the end */
    for (int i = 0; i < 4000; i++) {
        ct_write(t, (uint64_t)i * 2 * 512, 512);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (int i = 0; i < 4000; i += 2) {
        g_assert_cmpint(extree_punch(t, (uint64_t)i * 2 * 512, 512), ==, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_write(t, 100000 * 512, 4096 * 512);
    g_assert_cmpint(extree_commit(t), ==, 0);
    end = extree_host_end(t);
    g_assert_cmpint(extree_punch(t, 100000 * 512, 4096 * 512), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), ==, end);
    extree_close(t);

    /* the smallest cache, filled with extent-tree nodes */
    t = ct_open_opts(be, false, 1, 0);
    extree_cursor_init(&c, t);
    for (uint64_t g = 0; g < extree_virtual_size(t); g += run.length) {
        g_assert_cmpint(extree_cursor_query(&c, g, extree_virtual_size(t) - g,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
    }
    extree_cursor_release(&c);
    ct_write(t, 512, 512);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_host_end(t), <, end - (1 << 20));
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* ---- crash points of commits that discard, trim and truncate ---- */

#define CR_BLOCKS       4096            /* 16 MiB of 4 KiB blocks */
#define CR_MAGIC        0x5452494d44415441ULL

typedef struct CrState {
    uint64_t gen;
    bool damaged;               /* free tree damaged on purpose */
    size_t sb_index, end;
    uint8_t type[CR_BLOCKS];
    uint64_t host[CR_BLOCKS];
    uint32_t tag[CR_BLOCKS];
} CrState;

typedef struct CrWork {
    ExtreeBackend *be;
    Extree *t;
    GPtrArray *states;
    CrState cur;
    uint32_t tag;
} CrWork;

static void cr_record(CrWork *w, size_t from)
{
    CrState *s = g_memdup2(&w->cur, sizeof(w->cur));
    size_t len = extree_mem_backend_log_length(w->be);

    s->gen = extree_generation(w->t);
    s->sb_index = SIZE_MAX;
    s->end = len;
    for (size_t i = from; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(w->be, i, &e);
        if (e.op == EXTREE_LOG_WRITE && e.offset < EXTREE_SB_AREA) {
            s->sb_index = i;
        } else if (e.op == EXTREE_LOG_FLUSH && s->sb_index != SIZE_MAX &&
                   s->end == len) {
            s->end = i + 1;
        }
    }
    g_assert_cmpuint(s->sb_index, !=, SIZE_MAX);
    g_ptr_array_add(w->states, s);
}

static void cr_commit(CrWork *w)
{
    size_t from = extree_mem_backend_log_length(w->be);

    g_assert_true(extree_is_dirty(w->t));
    g_assert_cmpint(extree_commit(w->t), ==, 0);
    cr_record(w, from);
}

/* Allocate, write tagged data, map: what a guest write does */
static void cr_write(CrWork *w, uint64_t blk, uint64_t n)
{
    uint64_t guest = blk * BS, left = n * BS;
    uint32_t tag = ++w->tag;

    while (left) {
        uint64_t host, got;
        uint8_t *buf;

        g_assert_cmpint(extree_alloc_data(w->t, guest, left, &host, &got),
                        ==, 0);
        buf = g_malloc0(got);
        for (uint64_t i = 0; i < got / BS; i++) {
            uint64_t hdr[3] = { CR_MAGIC, guest / BS + i, tag };
            memcpy(buf + i * BS, hdr, sizeof(hdr));
            w->cur.type[guest / BS + i] = EXTREE_RUN_DATA;
            w->cur.host[guest / BS + i] = host + i * BS;
            w->cur.tag[guest / BS + i] = tag;
        }
        g_assert_cmpint(w->be->ops->pwrite(w->be->opaque, host, buf, got),
                        ==, 0);
        g_free(buf);
        g_assert_cmpint(extree_map_data(w->t, guest, got, host), ==, 0);
        guest += got;
        left -= got;
    }
}

static void cr_unmap(CrWork *w, uint64_t blk, uint64_t n, bool zero)
{
    if (zero) {
        g_assert_cmpint(extree_set_zero(w->t, blk * BS, n * BS), ==, 0);
    } else {
        g_assert_cmpint(extree_punch(w->t, blk * BS, n * BS), ==, 0);
    }
    for (uint64_t i = blk; i < blk + n; i++) {
        w->cur.type[i] = zero ? EXTREE_RUN_ZERO : EXTREE_RUN_UNALLOC;
        w->cur.host[i] = 0;
        w->cur.tag[i] = 0;
    }
}

static char *cr_compare(ExtreeBackend *img, Extree *t, const CrState *s)
{
    ExtreeCursor c;
    uint64_t g = 0;
    char *diff = NULL;

    extree_cursor_init(&c, t);
    while (g < CR_BLOCKS * BS && !diff) {
        ExtreeRun run;
        g_assert_cmpint(extree_cursor_query(&c, g, CR_BLOCKS * BS - g,
                                            EXTREE_COALESCE_HOST, &run), ==, 0);
        for (uint64_t i = 0; i < run.length / BS && !diff; i++) {
            uint64_t b = g / BS + i, hdr[3];
            if (run.type != s->type[b] || (run.type == EXTREE_RUN_DATA &&
                                           run.host + i * BS != s->host[b])) {
                diff = g_strdup_printf("block %" PRIu64 ": type %d host 0x%"
                                       PRIx64 ", expect type %d host 0x%"
                                       PRIx64, b, run.type,
                                       run.host + i * BS, s->type[b],
                                       s->host[b]);
                break;
            }
            if (run.type != EXTREE_RUN_DATA) {
                continue;
            }
            g_assert_cmpint(img->ops->pread(img->opaque, s->host[b], hdr,
                                            sizeof(hdr)), ==, 0);
            if (hdr[0] != CR_MAGIC || hdr[1] != b || hdr[2] != s->tag[b]) {
                diff = g_strdup_printf("data of block %" PRIu64 " at 0x%"
                                       PRIx64 ": tag %" PRIu64 ", expect %u",
                                       b, s->host[b], hdr[2], s->tag[b]);
            }
        }
        g += run.length;
    }
    extree_cursor_release(&c);
    return diff;
}

/*
 * Every prefix of the log, every crash mode: a complete state, the newest
 * durable one or a newer one whose superblock survived, clean
 */
static void cr_enumerate(CrWork *w, const char *what)
{
    size_t len = extree_mem_backend_log_length(w->be);
    uint64_t images = 0;

    for (size_t p = 0; p <= len; p++) {
        for (int mode = EXTREE_CRASH_KEEP; mode <= EXTREE_CRASH_GARBAGE;
             mode++) {
            for (uint64_t seed = 0; seed < (mode >= EXTREE_CRASH_TEAR ? 3 : 1);
                 seed++) {
                ExtreeBackend *img = extree_mem_backend_crash_image(
                    w->be, p, mode, p * 16 + seed);
                ExtreeCheckResult res;
                CtReport r = { g_ptr_array_new_with_free_func(g_free) };
                guint lo = 0, hi = 0, k;
                CrState *s = NULL;
                ExtreeOpenOptions ro = { .read_only = true };
                Extree *t;
                char *err = NULL, *diff;

                for (guint i = 0; i < w->states->len; i++) {
                    CrState *si = w->states->pdata[i];
                    if (si->end <= p) {
                        lo = i;
                    }
                    if (i > 0 && si->sb_index < p) {
                        hi = i;
                    }
                }
                /*
                 * read-only: a damaged free tree does not matter; the
                 * checker reads it
                 */
                if (extree_open(img, &ro, &t, &err) < 0) {
                    g_error("%s: prefix %zu mode %d: open: %s", what, p,
                            mode, err);
                }
                for (k = lo; k <= hi; k++) {
                    CrState *sk = w->states->pdata[k];
                    if (sk->gen == extree_generation(t)) {
                        s = sk;
                        break;
                    }
                }
                if (!s) {
                    g_error("%s: prefix %zu mode %d: generation %" PRIu64
                            " not in states %u..%u", what, p, mode,
                            extree_generation(t), lo, hi);
                }
                diff = cr_compare(img, t, s);
                if (diff) {
                    g_error("%s: prefix %zu mode %d, generation %" PRIu64
                            ": %s", what, p, mode, s->gen, diff);
                }
                g_assert_cmpint(extree_check(t, false, &res, ct_report, &r),
                                ==, 0);
                if ((res.corruptions || res.leaks) && !s->damaged) {
                    for (guint i = 0; i < r.msgs->len; i++) {
                        g_printerr("%s\n", (char *)r.msgs->pdata[i]);
                    }
                    g_error("%s: prefix %zu mode %d, generation %" PRIu64
                            ": %" PRIu64 " corruptions, %" PRIu64 " leaks",
                            what, p, mode, s->gen, res.corruptions,
                            res.leaks);
                }
                g_ptr_array_free(r.msgs, true);
                extree_close(t);
                extree_mem_backend_free(img);
                images++;
            }
        }
    }
    if (g_test_verbose()) {
        g_printerr("%s: %zu log entries, %u states, %" PRIu64 " images\n",
                   what, len, w->states->len, images);
    }
}

static void cr_start(CrWork *w)
{
    ExtreeCreateParams p = { .virtual_size = CR_BLOCKS * BS,
                             .block_size = BS, .node_size = NS };
    char *err = NULL;
    CrState *s0;

    memset(w, 0, sizeof(*w));
    w->be = extree_mem_backend_new();
    w->states = g_ptr_array_new_with_free_func(g_free);
    g_assert_cmpint(extree_create(w->be, &p, &err), ==, 0);
    extree_mem_backend_start_recording(w->be);
    w->t = ct_open(w->be);
    s0 = g_new0(CrState, 1);
    s0->gen = extree_generation(w->t);
    g_ptr_array_add(w->states, s0);
}

static void cr_finish(CrWork *w)
{
    extree_close(w->t);
    extree_mem_backend_stop_recording(w->be);
    g_ptr_array_free(w->states, true);
    extree_mem_backend_free(w->be);
}

static void test_trim_discard_crash(void)
{
    CrWork w;
    uint64_t end;
    GRand *r = g_rand_new_with_seed(test_seed("trim-discard-crash", 5));

    cr_start(&w);
    cr_write(&w, 0, 1024);                      /* 4 MiB at the end */
    cr_commit(&w);
    end = extree_host_end(w.t);
    cr_unmap(&w, 512, 512, false);              /* its second half */
    cr_commit(&w);                              /* discards */
    cr_write(&w, 3100, 2);
    cr_unmap(&w, 100, 50, true);
    cr_commit(&w);                              /* trims, truncates */
    g_assert_cmpuint(extree_host_end(w.t), <, end);
    for (int i = 0; i < 60; i++) {
        uint64_t blk = g_rand_int_range(r, 0, CR_BLOCKS - 16);
        int dice = g_rand_int_range(r, 0, 3);
        if (dice == 0) {
            cr_write(&w, blk, g_rand_int_range(r, 1, 16));
        } else {
            cr_unmap(&w, blk, g_rand_int_range(r, 1, 16), dice == 1);
        }
        if (i % 20 == 19) {
            cr_commit(&w);
        }
    }
    cr_write(&w, 2048, 768);                    /* 3 MiB more at the end */
    cr_commit(&w);
    end = extree_host_end(w.t);
    cr_unmap(&w, 2048, 768, false);
    cr_commit(&w);
    cr_write(&w, 10, 1);
    cr_commit(&w);                              /* trims again */
    g_assert_cmpuint(extree_host_end(w.t), <, end);
    cr_enumerate(&w, "trim-discard");
    cr_finish(&w);
    g_rand_free(r);
}

/*
 * D2: a crash while the checker rebuilds the free tree or clears the
 * corrupt bit leaves the damaged state or the repaired one
 */
static void test_rebuild_crash(void)
{
    ExtreeOpenOptions rep = { .repair = true };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t froot;
    uint8_t *buf;
    char *err = NULL;
    CrWork w;
    size_t from;

    cr_start(&w);
    for (int i = 0; i < 300; i++) {
        cr_write(&w, i * 3, 1 + i % 2);
    }
    cr_commit(&w);
    for (int i = 0; i < 300; i += 2) {
        cr_unmap(&w, i * 3, 1, i % 4 == 0);
    }
    cr_commit(&w);
    extree_close(w.t);

    /* damage the free tree, flag the image (a new generation) */
    ct_read_super(w.be, &sb);
    froot = GUINT64_FROM_LE(sb.free_root.bytenr);
    buf = ct_node_read(w.be, froot, NS);
    buf[100] ^= 8;
    ct_node_write(w.be, froot, buf, NS, false);
    g_free(buf);
    ((CrState *)w.states->pdata[w.states->len - 1])->damaged = true;
    from = extree_mem_backend_log_length(w.be);
    g_assert_cmpint(extree_mark_corrupt_image(w.be), ==, 0);
    g_assert_cmpint(extree_open(w.be, &rep, &w.t, &err), ==, 0);
    cr_record(&w, from);
    ((CrState *)w.states->pdata[w.states->len - 1])->damaged = true;

    /* rebuild, clear, write on */
    from = extree_mem_backend_log_length(w.be);
    g_assert_cmpint(extree_check(w.t, true, &res, NULL, NULL), ==, 0);
    g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
    cr_record(&w, from);
    from = extree_mem_backend_log_length(w.be);
    g_assert_cmpint(extree_clear_corrupt(w.t), ==, 0);
    cr_record(&w, from);
    for (int i = 0; i < 50; i++) {
        cr_write(&w, 2000 + i * 2, 1);
    }
    cr_commit(&w);
    ct_check_clean(w.t, NULL);
    cr_enumerate(&w, "rebuild");
    cr_finish(&w);
}

/* The core's trace points (extree_set_trace()), as the driver sees them */
typedef struct TraceRec {
    ExtreeTraceEvent ev;
    uint64_t a, b, c;
} TraceRec;

static void on_trace(void *opaque, ExtreeTraceEvent ev, uint64_t a,
                     uint64_t b, uint64_t c)
{
    TraceRec r = { ev, a, b, c };

    g_array_append_val((GArray *)opaque, r);
}

static unsigned trace_count(GArray *log, ExtreeTraceEvent ev)
{
    unsigned n = 0;

    for (guint i = 0; i < log->len; i++) {
        n += g_array_index(log, TraceRec, i).ev == ev;
    }
    return n;
}

static void test_trace(void)
{
    ExtreeBackend *be = ct_create(1 << 24, BS, NS);
    Extree *t = ct_open(be);
    GArray *log = g_array_new(false, false, sizeof(TraceRec));
    int step = 2;

    extree_set_trace(t, on_trace, log);
    ct_write(t, 0, 10 * BS);
    g_assert_cmpuint(trace_count(log, EXTREE_TRACE_ALLOC_DATA), ==, 1);
    g_assert_cmpuint(g_array_index(log, TraceRec, 0).a, ==, 0);
    g_assert_cmpuint(g_array_index(log, TraceRec, 0).b, ==, 10 * BS);
    g_assert_cmpuint(trace_count(log, EXTREE_TRACE_ALLOC_NODE), >=, 1);
    g_array_set_size(log, 0);

    /* a commit: steps 2 to 8 in order, then done with its generation */
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (guint i = 0; i < log->len; i++) {
        TraceRec *r = &g_array_index(log, TraceRec, i);

        if (r->ev == EXTREE_TRACE_COMMIT_STEP) {
            g_assert_cmpuint(r->a, ==, 2);
            g_assert_cmpuint(r->b, ==, step++);
        }
    }
    g_assert_cmpint(step, ==, 9);
    g_assert_cmpuint(trace_count(log, EXTREE_TRACE_COMMIT_DONE), ==, 1);
    g_assert_cmpuint(g_array_index(log, TraceRec, log->len - 1).ev, ==,
                     EXTREE_TRACE_COMMIT_DONE);
    g_assert_cmpuint(g_array_index(log, TraceRec, log->len - 1).c, ==, 0);
    g_array_set_size(log, 0);

    /* frees, and a rollback to generation 2 */
    g_assert_cmpint(extree_punch(t, 0, 10 * BS), ==, 0);
    g_assert_cmpuint(trace_count(log, EXTREE_TRACE_FREE), >=, 1);
    g_assert_cmpint(extree_rollback(t), ==, 0);
    g_assert_cmpuint(g_array_index(log, TraceRec, log->len - 1).ev, ==,
                     EXTREE_TRACE_ROLLBACK);
    g_assert_cmpuint(g_array_index(log, TraceRec, log->len - 1).a, ==, 2);

    /* none once unset */
    g_array_set_size(log, 0);
    extree_set_trace(t, NULL, NULL);
    ct_write(t, 0, BS);
    g_assert_cmpuint(log->len, ==, 0);
    g_array_free(log, true);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/txn/create-params", test_create_params);
    g_test_add_func("/txn/create-check", test_create_check);
    g_test_add_func("/txn/commit-reopen", test_commit_reopen);
    g_test_add_func("/txn/trace", test_trace);
    g_test_add_func("/txn/torn-super", test_torn_super);
    g_test_add_func("/txn/open-read-faults", test_open_read_faults);
    g_test_add_func("/txn/features", test_features);
    g_test_add_func("/txn/dirty-limit", test_dirty_limit);
    g_test_add_func("/txn/commit-failure-retry", test_commit_failure_retry);
    g_test_add_func("/txn/commit-flush-failure", test_commit_flush_failure);
    g_test_add_func("/txn/open-truncated", test_open_truncated);
    g_test_add_func("/txn/open-warning", test_open_warning);
    g_test_add_func("/txn/skipped-slot-open-fails",
                    test_skipped_slot_open_fails);
    g_test_add_func("/txn/dirty-limit-off", test_dirty_limit_off);
    g_test_add_func("/txn/discard-after-commit", test_discard_after_commit);
    g_test_add_func("/txn/discard-deferred", test_discard_deferred);
    g_test_add_func("/txn/discard-joined-runs", test_discard_joined_runs);
    g_test_add_func("/txn/trim-tail", test_trim_tail);
    g_test_add_func("/txn/trim-evicted-free-leaf",
                    test_trim_evicted_free_leaf);
    g_test_add_func("/txn/trim-discard-crash", test_trim_discard_crash);
    g_test_add_func("/txn/rebuild-crash", test_rebuild_crash);
    return g_test_run();
}
