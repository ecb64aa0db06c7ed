/*
 * Unit tests: encrypted images (issue 36), the core's part.  The core
 * encrypts nothing; it records where the encryption header lies, keeps
 * the data area after it and never writes there.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define NS 4096
#define VSIZE (4 * 1024 * 1024)
/* the node size of the images with blocks of @bs */
#define NS_FOR(bs) MAX((bs), NS)

/* The byte the test's "LUKS header" has at host offset @off */
static uint8_t header_byte(uint64_t off)
{
    return (uint8_t)(off * 7 + 0x5a);
}

/*
 * An encrypted image as the driver makes one: the header written first,
 * then extree_create(); every later backend operation recorded.  The
 * pattern covers [8192, data_start), the rounding after the header too.
 */
static ExtreeBackend *make_crypt(uint32_t bs, uint64_t len)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeCreateParams p = {
        .virtual_size = VSIZE, .block_size = bs, .node_size = NS_FOR(bs),
        .crypt_method = EXTREE_CRYPT_LUKS, .crypt_header_length = len,
    };
    uint64_t end = EXTREE_ROUND_UP(EXTREE_SB_AREA + len, bs);
    uint8_t *hdr = g_malloc(end - EXTREE_SB_AREA);
    char *err = NULL;

    for (uint64_t i = 0; i < end - EXTREE_SB_AREA; i++) {
        hdr[i] = header_byte(EXTREE_SB_AREA + i);
    }
    g_assert_cmpint(be->ops->pwrite(be->opaque, EXTREE_SB_AREA, hdr,
                                    end - EXTREE_SB_AREA), ==, 0);
    g_free(hdr);
    extree_mem_backend_start_recording(be);
    g_assert_cmpint(extree_create(be, &p, &err), ==, 0);
    g_assert_null(err);
    return be;
}

/* The header's bytes are still the ones written before create */
static void assert_header_intact(ExtreeBackend *be, uint64_t data_start)
{
    uint64_t n = data_start - EXTREE_SB_AREA;
    uint8_t *buf = g_malloc(n);

    g_assert_cmpint(be->ops->pread(be->opaque, EXTREE_SB_AREA, buf, n), ==,
                    0);
    for (uint64_t i = 0; i < n; i++) {
        if (buf[i] != header_byte(EXTREE_SB_AREA + i)) {
            g_error("header byte at 0x%" PRIx64 " changed",
                    EXTREE_SB_AREA + i);
        }
    }
    g_free(buf);
}

/* No write, discard or truncate since create reached [8192, data_start) */
static void assert_log_clear(ExtreeBackend *be, uint64_t data_start)
{
    size_t n = extree_mem_backend_log_length(be);

    for (size_t i = 0; i < n; i++) {
        ExtreeLogEntry e;

        extree_mem_backend_log_entry(be, i, &e);
        switch (e.op) {
        case EXTREE_LOG_WRITE:
        case EXTREE_LOG_DISCARD:
            g_assert_true(e.offset + e.bytes <= EXTREE_SB_AREA ||
                          e.offset >= data_start);
            break;
        case EXTREE_LOG_TRUNCATE:
            g_assert_cmpuint(e.offset, >=, data_start);
            break;
        default:
            break;
        }
    }
}

/* Every DATA run of the live image lies in the data area */
static void assert_data_placed(Extree *t)
{
    uint64_t pos = 0, ds = extree_data_start(t);

    while (pos < extree_virtual_size(t)) {
        ExtreeRun runs[16];
        int n = 0;

        g_assert_cmpint(extree_lookup(t, pos, extree_virtual_size(t) - pos,
                                      runs, 16, &n), ==, 0);
        g_assert_cmpint(n, >, 0);
        for (int i = 0; i < n; i++) {
            if (runs[i].type == EXTREE_RUN_DATA) {
                g_assert_cmpuint(runs[i].host, >=, ds);
            }
            pos = runs[i].guest + runs[i].length;
        }
    }
}

static void assert_crypt_fields(Extree *t, uint32_t bs, uint64_t len)
{
    g_assert_cmpuint(extree_crypt_method(t), ==, EXTREE_CRYPT_LUKS);
    g_assert_cmpuint(extree_crypt_header_offset(t), ==, 8192);
    g_assert_cmpuint(extree_crypt_header_length(t), ==, len);
    g_assert_cmpuint(extree_data_start(t), ==,
                     EXTREE_ROUND_UP(8192 + len, bs));
    g_assert_true(extree_incompat_features(t) & EXTREE_INCOMPAT_ENCRYPTED);
}

static void snap(Extree *t, const char *name, size_t vmstate)
{
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };

    if (vmstate) {
        uint8_t *state = g_malloc(vmstate);

        memset(state, 0xa5, vmstate);
        g_assert_cmpint(extree_vmstate_write(t, 0, state, vmstate), ==, 0);
        g_free(state);
        info.vm_state_size = vmstate;
    }
    g_strlcpy(info.name, name, sizeof(info.name));
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
}

/*
 * Create, reopen, fill, overwrite, snapshots: the fields stay, the roots
 * and every block allocated lie at data_start or above, and nothing ever
 * touches the header
 */
static void test_layout(gconstpointer opaque)
{
    const uint64_t *arg = opaque;
    uint32_t bs = arg[0];
    uint64_t len = arg[1];
    uint64_t ds = EXTREE_ROUND_UP(8192 + len, bs), ns = NS_FOR(bs);
    ExtreeBackend *be = make_crypt(bs, len);
    ExtreeDiskSuper sb;
    Extree *t;

    ct_read_super(be, &sb);
    g_assert_cmpuint(GUINT32_FROM_LE(sb.crypt_method), ==, EXTREE_CRYPT_LUKS);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.crypt_header_offset), ==, 8192);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.crypt_header_length), ==, len);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.extent_root.bytenr), ==, ds);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.free_root.bytenr), ==, ds + ns);
    g_assert_cmpuint(GUINT64_FROM_LE(sb.host_end), ==, ds + 2 * ns);

    t = ct_open(be);
    assert_crypt_fields(t, bs, len);
    ct_check_clean(t, NULL);

    /* the whole disk, then holes in it, then filled again */
    ct_write(t, 0, VSIZE);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t g = 0; g < VSIZE; g += 8 * bs) {
        g_assert_cmpint(extree_punch(t, g, 3 * bs), ==, 0);
    }
    g_assert_cmpint(extree_set_zero(t, 5 * bs, bs), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    for (uint64_t g = 0; g < VSIZE; g += 8 * bs) {
        ct_write(t, g + bs, bs);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    assert_data_placed(t);
    ct_check_clean(t, NULL);

    /* snapshots: take, diverge, go back, delete */
    snap(t, "one", 3000);
    ct_write(t, 0, VSIZE / 4);
    g_assert_cmpint(extree_commit(t), ==, 0);
    snap(t, "two", 0);
    ct_write(t, VSIZE / 2, VSIZE / 8);
    g_assert_cmpint(extree_commit(t), ==, 0);
    assert_crypt_fields(t, bs, len);
    g_assert_cmpint(extree_snapshot_goto(t, extree_snapshot_find(t, "one")),
                    ==, 0);
    g_assert_cmpint(extree_snapshot_delete(t, extree_snapshot_find(t, "two")),
                    ==, 0);
    assert_crypt_fields(t, bs, len);
    assert_data_placed(t);
    ct_check_clean(t, NULL);
    extree_close(t);

    t = ct_open(be);
    assert_crypt_fields(t, bs, len);
    ct_write(t, 3 * VSIZE / 4, VSIZE / 16);
    g_assert_cmpint(extree_snapshot_delete(t, extree_snapshot_find(t, "one")),
                    ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);

    t = ct_open_opts(be, true, 0, 0);
    assert_crypt_fields(t, bs, len);
    assert_data_placed(t);
    ct_check_clean(t, NULL);
    extree_close(t);

    assert_header_intact(be, ds);
    assert_log_clear(be, ds);
    extree_mem_backend_free(be);
}

/*
 * The checker's walk starts at data_start: the header is neither leaked
 * nor handed to the free-space tree, by a leak repair or by a rebuild of
 * the free-space tree ("repair all")
 */
static void test_check_repair(void)
{
    uint32_t bs = 4096;
    uint64_t len = 0x20200, ds = EXTREE_ROUND_UP(8192 + len, bs);
    ExtreeBackend *be = make_crypt(bs, len);
    ExtreeOpenOptions rep = { .repair = true };
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    ExtreeDiskSuper sb;
    uint64_t host, got;
    char *err = NULL;
    Extree *t;

    t = ct_open(be);
    ct_write(t, 0, 64 * bs);
    /* allocated, committed, never mapped: leaked */
    g_assert_cmpint(extree_alloc_data(t, 100 * bs, 3 * bs, &host, &got), ==,
                    0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpint(extree_check(t, false, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 1);
    g_assert_cmpuint(res.leaked_bytes, ==, got);
    g_assert_cmpint(extree_check(t, true, &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.repaired_leaks, ==, 1);
    ct_check_clean(t, NULL);
    extree_close(t);

    /* free_bytes off by one block: the free-space tree is rebuilt */
    ct_read_super(be, &sb);
    sb.free_bytes = GUINT64_TO_LE(GUINT64_FROM_LE(sb.free_bytes) + bs);
    ct_write_super(be, 0, &sb);
    ct_write_super(be, 1, &sb);
    g_assert_cmpint(extree_open(be, &rep, &t, &err), ==, 0);
    g_assert_cmpint(extree_check_fix(t, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                                     &res, ct_report, &r), ==, 0);
    g_assert_cmpuint(res.corruptions, >=, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
    ct_check_clean(t, NULL);
    assert_crypt_fields(t, bs, len);
    /* what the rebuilt tree hands out lies in the data area */
    ct_write(t, 300 * bs, 200 * bs);
    g_assert_cmpint(extree_commit(t), ==, 0);
    assert_data_placed(t);
    extree_close(t);

    t = ct_open(be);
    assert_crypt_fields(t, bs, len);
    ct_check_clean(t, NULL);
    extree_close(t);
    assert_header_intact(be, ds);
    assert_log_clear(be, ds);
    g_ptr_array_free(r.msgs, true);
    extree_mem_backend_free(be);
}

/* The corrupt bit's own superblock writes keep the fields */
static void test_mark_corrupt(void)
{
    ExtreeBackend *be = make_crypt(512, 1024);
    ExtreeOpenOptions ro = { .read_only = true };
    char *err = NULL;
    Extree *t;

    g_assert_cmpint(extree_mark_corrupt_image(be), ==, 0);
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, 0);
    assert_crypt_fields(t, 512, 1024);
    g_assert_true(extree_incompat_features(t) & EXTREE_INCOMPAT_CORRUPT);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Images without the bit: no header, data_start as before */
static void test_plain(void)
{
    ExtreeBackend *be = ct_create(VSIZE, 4096, NS);
    Extree *t = ct_open(be);

    g_assert_cmpuint(extree_crypt_method(t), ==, 0);
    g_assert_cmpuint(extree_crypt_header_offset(t), ==, 0);
    g_assert_cmpuint(extree_crypt_header_length(t), ==, 0);
    g_assert_cmpuint(extree_data_start(t), ==, 8192);
    g_assert_false(extree_incompat_features(t) & EXTREE_INCOMPAT_ENCRYPTED);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* The messages a user sees; nothing is written */
static void test_create_check(void)
{
    static const struct {
        uint32_t method;
        uint64_t len;
        const char *msg;
    } bad[] = {
        { 2, 4096, "Unknown encryption method 2" },
        { EXTREE_CRYPT_LUKS, 0,
          "Encrypted images need an encryption header length" },
        { EXTREE_CRYPT_LUKS, 1000,
          "Encryption header length (1000) must be a multiple of 512 bytes" },
        { EXTREE_CRYPT_LUKS, EXTREE_CRYPT_HEADER_MAX + 512,
          "Encryption header length (67109376) must be at most 67108864 "
          "bytes" },
        { 0, 4096, "An encryption header length needs an encryption "
          "method" },
    };
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeCreateParams p = { .virtual_size = VSIZE };
    char *err = NULL;
    Extree *t;

    for (size_t i = 0; i < G_N_ELEMENTS(bad); i++) {
        p.crypt_method = bad[i].method;
        p.crypt_header_length = bad[i].len;
        g_assert_cmpint(extree_create_check(&p, &err), ==, -EINVAL);
        g_assert_cmpstr(err, ==, bad[i].msg);
        g_clear_pointer(&err, g_free);
        g_assert_cmpint(extree_create(be, &p, &err), ==, -EINVAL);
        g_clear_pointer(&err, g_free);
    }
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 0);

    /* the largest header */
    p.crypt_method = EXTREE_CRYPT_LUKS;
    p.crypt_header_length = EXTREE_CRYPT_HEADER_MAX;
    g_assert_cmpint(extree_create(be, &p, &err), ==, 0);
    t = ct_open(be);
    assert_crypt_fields(t, EXTREE_DEFAULT_BLOCK_SIZE,
                        EXTREE_CRYPT_HEADER_MAX);
    ct_write(t, 0, 16 * 4096);
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* ---- superblocks with bad encryption fields ---- */

/* Patch @width bytes at @off of both slots, checksums fixed */
static void patch_super(ExtreeBackend *be, size_t off, int width, uint64_t v)
{
    for (int i = 0; i < 2; i++) {
        ExtreeDiskSuper sb;

        g_assert_cmpint(be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, &sb,
                                       EXTREE_SB_SIZE), ==, 0);
        if (width == 4) {
            ext_st32((uint8_t *)&sb + off, v);
        } else {
            ext_st64((uint8_t *)&sb + off, v);
        }
        ct_write_super(be, i, &sb);
    }
}

#define SBF(f) offsetof(ExtreeDiskSuper, f)

static void test_bad_super(void)
{
    static const struct {
        bool crypt;             /* start from an encrypted image */
        size_t off;
        int width;
        uint64_t v;
        const char *msg;
    } bad[] = {
        /* the bit without a method, a method without the bit */
        { false, SBF(incompat_features), 8, EXTREE_INCOMPAT_ENCRYPTED,
          "bad crypt_method 0" },
        { true, SBF(crypt_method), 4, 0, "bad crypt_method 0" },
        { false, SBF(crypt_method), 4, EXTREE_CRYPT_LUKS,
          "encryption fields set without the encryption feature, have "
          "crypt_method 1" },
        { false, SBF(crypt_header_length), 8, 4096,
          "crypt_header_length 0x1000" },
        { true, SBF(incompat_features), 8, 0,
          "encryption fields set without the encryption feature" },
        { true, SBF(crypt_method), 4, 2, "bad crypt_method 2" },
        { true, SBF(crypt_header_offset), 8, 4096,
          "bad crypt_header_offset, have 0x1000 expect 0x2000" },
        { true, SBF(crypt_header_offset), 8, 0,
          "bad crypt_header_offset, have 0x0 expect 0x2000" },
        { true, SBF(crypt_header_length), 8, 0,
          "bad crypt_header_length 0x0" },
        { true, SBF(crypt_header_length), 8, 1000,
          "bad crypt_header_length 0x3e8" },
        { true, SBF(crypt_header_length), 8, EXTREE_CRYPT_HEADER_MAX + 512,
          "bad crypt_header_length 0x4000200" },
        /* valid lengths that move data_start past host_end, past a root */
        { true, SBF(crypt_header_length), 8, EXTREE_CRYPT_HEADER_MAX,
          "bad host_end 0x" },
        { true, SBF(crypt_header_length), 8, 4096 + NS,
          "bad extent tree root" },
    };

    for (size_t i = 0; i < G_N_ELEMENTS(bad); i++) {
        ExtreeBackend *be = bad[i].crypt ? make_crypt(4096, 4096) :
                            ct_create(VSIZE, 4096, NS);
        ExtreeOpenOptions ro = { .read_only = true };
        char *err = NULL;
        Extree *t = NULL;
        int ret;

        patch_super(be, bad[i].off, bad[i].width, bad[i].v);
        ret = extree_open(be, &ro, &t, &err);
        if (g_test_verbose()) {
            g_printerr("case %zu: %d %s\n", i, ret, err);
        }
        g_assert_cmpint(ret, ==, -EINVAL);
        g_assert_null(t);
        g_assert_nonnull(strstr(err, bad[i].msg));
        g_free(err);
        /* nor can it be marked corrupt: no valid slot */
        g_assert_cmpint(extree_mark_corrupt_image(be), ==, -EINVAL);
        extree_mem_backend_free(be);
    }
}

/* An old reader's view: the bit is incompatible */
static void test_unknown_bit(void)
{
    ExtreeBackend *be = make_crypt(4096, 4096);
    ExtreeOpenOptions ro = { .read_only = true };
    char *err = NULL;
    Extree *t = NULL;

    patch_super(be, SBF(incompat_features), 8,
                EXTREE_INCOMPAT_ENCRYPTED | (1ULL << 63));
    g_assert_cmpint(extree_open(be, &ro, &t, &err), ==, -ENOTSUP);
    g_assert_nonnull(strstr(err, "Unsupported incompatible features 0x8000000000000000"));
    g_free(err);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    /* block size, header length */
    static const uint64_t layouts[][2] = {
        { 512, 1024 },          /* data_start right after the header */
        { 4096, 0x20200 },      /* a LUKS header of 257 sectors, rounded */
        { 65536, 512 },         /* a block larger than the header */
    };

    g_test_init(&argc, &argv, NULL);
    for (size_t i = 0; i < G_N_ELEMENTS(layouts); i++) {
        char *name = g_strdup_printf("/crypt/layout/bs%" PRIu64
                                     "-len%" PRIu64, layouts[i][0],
                                     layouts[i][1]);
        g_test_add_data_func(name, layouts[i], test_layout);
        g_free(name);
    }
    g_test_add_func("/crypt/check-repair", test_check_repair);
    g_test_add_func("/crypt/mark-corrupt", test_mark_corrupt);
    g_test_add_func("/crypt/plain", test_plain);
    g_test_add_func("/crypt/create-check", test_create_check);
    g_test_add_func("/crypt/bad-super", test_bad_super);
    g_test_add_func("/crypt/unknown-bit", test_unknown_bit);
    return g_test_run();
}
