/*
 * Unit tests of the memory and POSIX-file backends
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>
#include <glib/gstdio.h>

#include "extree-backend.h"

static int be_read(ExtreeBackend *be, uint64_t off, void *buf, uint64_t n)
{
    return be->ops->pread(be->opaque, off, buf, n);
}

static int be_write(ExtreeBackend *be, uint64_t off, const void *buf,
                    uint64_t n)
{
    return be->ops->pwrite(be->opaque, off, buf, n);
}

static int be_flush(ExtreeBackend *be)
{
    return be->ops->flush(be->opaque);
}

static void fill(uint8_t *buf, size_t n, uint8_t v)
{
    memset(buf, v, n);
}

/* Every byte of [buf, buf + n) equals @v */
static bool all(const uint8_t *buf, size_t n, uint8_t v)
{
    for (size_t i = 0; i < n; i++) {
        if (buf[i] != v) {
            return false;
        }
    }
    return true;
}

static void test_mem_basic(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    uint8_t buf[10000], out[10000];

    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 0);
    /* Past the end reads as zeros */
    fill(out, sizeof(out), 0xaa);
    g_assert_cmpint(be_read(be, 123456, out, sizeof(out)), ==, 0);
    g_assert_true(all(out, sizeof(out), 0));

    /* Unaligned write across pages extends the device */
    fill(buf, sizeof(buf), 0x5a);
    g_assert_cmpint(be_write(be, 4000, buf, sizeof(buf)), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 14000);
    g_assert_cmpint(be_read(be, 4000, out, sizeof(out)), ==, 0);
    g_assert_true(all(out, sizeof(out), 0x5a));
    g_assert_cmpint(be_read(be, 0, out, 4000), ==, 0);
    g_assert_true(all(out, 4000, 0));
    /* 4 KiB pages 0..3 touched */
    g_assert_cmpint(extree_mem_backend_pages(be), ==, 4);

    /* Discard zeros, never extends */
    g_assert_cmpint(be->ops->discard(be->opaque, 5000, 100000), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 14000);
    g_assert_cmpint(be_read(be, 4000, out, 2000), ==, 0);
    g_assert_true(all(out, 1000, 0x5a));
    g_assert_true(all(out + 1000, 1000, 0));

    /* Truncate down then up: the dropped bytes come back as zeros */
    g_assert_cmpint(be_write(be, 0, buf, 8192), ==, 0);
    g_assert_cmpint(be->ops->truncate(be->opaque, 100), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 100);
    g_assert_cmpint(be->ops->truncate(be->opaque, 8192), ==, 0);
    g_assert_cmpint(be_read(be, 0, out, 8192), ==, 0);
    g_assert_true(all(out, 100, 0x5a));
    g_assert_true(all(out + 100, 8092, 0));
    g_assert_cmpint(be_flush(be), ==, 0);

    extree_mem_backend_free(be);
}

static void test_mem_clone(void)
{
    ExtreeBackend *a = extree_mem_backend_new(), *b;
    uint8_t buf[4096];

    fill(buf, sizeof(buf), 1);
    g_assert_cmpint(be_write(a, 1 << 20, buf, sizeof(buf)), ==, 0);
    b = extree_mem_backend_clone(a);
    g_assert_true(extree_mem_backend_equal(a, b));
    buf[17] = 2;
    g_assert_cmpint(be_write(b, 1 << 20, buf, sizeof(buf)), ==, 0);
    g_assert_false(extree_mem_backend_equal(a, b));
    /* Pages are shared copy-on-write: the original did not change */
    g_assert_cmpint(be_read(a, (1 << 20) + 17, buf, 1), ==, 0);
    g_assert_cmpint(buf[0], ==, 1);
    {
        ExtreeBackend *c = extree_mem_backend_clone(a);
        g_assert_cmpint(c->ops->truncate(c->opaque, (1 << 20) + 100), ==, 0);
        g_assert_cmpint(c->ops->discard(c->opaque, 1 << 20, 50), ==, 0);
        g_assert_cmpint(be_read(a, (1 << 20) + 40, buf, 1), ==, 0);
        g_assert_cmpint(buf[0], ==, 1);
        g_assert_cmpint(be_read(a, (1 << 20) + 200, buf, 1), ==, 0);
        g_assert_cmpint(buf[0], ==, 1);
        g_assert_cmpint(a->ops->get_length(a->opaque), ==, (1 << 20) + 4096);
        extree_mem_backend_free(c);
    }
    fill(buf, sizeof(buf), 1);
    /* A zero page equals an absent one */
    fill(buf, sizeof(buf), 1);
    g_assert_cmpint(be_write(b, 1 << 20, buf, sizeof(buf)), ==, 0);
    fill(buf, sizeof(buf), 0);
    g_assert_cmpint(be_write(b, 0, buf, sizeof(buf)), ==, 0);
    g_assert_true(extree_mem_backend_equal(a, b));
    extree_mem_backend_free(a);
    extree_mem_backend_free(b);
}

static uint8_t byte_at(ExtreeBackend *be, uint64_t off)
{
    uint8_t v;

    g_assert_cmpint(be_read(be, off, &v, 1), ==, 0);
    return v;
}

static void test_mem_crash_image(void)
{
    ExtreeBackend *be = extree_mem_backend_new(), *img;
    ExtreeLogEntry e;
    uint8_t buf[2048];
    bool seen_old = false, seen_new = false, seen_garbage = false;

    fill(buf, sizeof(buf), 1);
    g_assert_cmpint(be_write(be, 0, buf, sizeof(buf)), ==, 0);
    extree_mem_backend_start_recording(be);
    fill(buf, sizeof(buf), 2);
    g_assert_cmpint(be_write(be, 0, buf, 512), ==, 0);          /* 0 */
    g_assert_cmpint(be_flush(be), ==, 0);                      /* 1 */
    g_assert_cmpint(be_write(be, 0, buf, sizeof(buf)), ==, 0);  /* 2 */
    fill(buf, sizeof(buf), 3);
    g_assert_cmpint(be_write(be, 4096, buf, 512), ==, 0);       /* 3 */
    g_assert_cmpint(extree_mem_backend_log_length(be), ==, 4);
    extree_mem_backend_log_entry(be, 1, &e);
    g_assert_cmpint(e.op, ==, EXTREE_LOG_FLUSH);
    extree_mem_backend_log_entry(be, 3, &e);
    g_assert_cmpint(e.op, ==, EXTREE_LOG_WRITE);
    g_assert_cmpint(e.offset, ==, 4096);
    g_assert_cmpint(e.bytes, ==, 512);
    g_assert_cmpint(e.data[0], ==, 3);

    /* Empty prefix: the base */
    img = extree_mem_backend_crash_image(be, 0, EXTREE_CRASH_KEEP, 0);
    g_assert_cmpint(byte_at(img, 0), ==, 1);
    g_assert_cmpint(byte_at(img, 1024), ==, 1);
    extree_mem_backend_free(img);

    /* Unflushed write 0 kept or dropped */
    img = extree_mem_backend_crash_image(be, 1, EXTREE_CRASH_KEEP, 0);
    g_assert_cmpint(byte_at(img, 0), ==, 2);
    extree_mem_backend_free(img);
    img = extree_mem_backend_crash_image(be, 1, EXTREE_CRASH_DROP, 0);
    g_assert_cmpint(byte_at(img, 0), ==, 1);
    extree_mem_backend_free(img);

    /* After the flush write 0 stays whatever the mode */
    img = extree_mem_backend_crash_image(be, 4, EXTREE_CRASH_DROP, 0);
    g_assert_cmpint(byte_at(img, 0), ==, 2);
    g_assert_cmpint(byte_at(img, 1024), ==, 1);
    g_assert_cmpint(byte_at(img, 4096), ==, 0);
    g_assert_cmpint(img->ops->get_length(img->opaque), ==, 2048);
    extree_mem_backend_free(img);
    img = extree_mem_backend_crash_image(be, 4, EXTREE_CRASH_KEEP, 0);
    g_assert_cmpint(byte_at(img, 4096), ==, 3);
    g_assert_cmpint(img->ops->get_length(img->opaque), ==, 4608);
    extree_mem_backend_free(img);

    /*
     * Tearing works per 512-byte sector; each sector is all old or all
     * new, and over many seeds both happen
     */
    for (uint64_t seed = 0; seed < 64; seed++) {
        img = extree_mem_backend_crash_image(be, 3, EXTREE_CRASH_TEAR, seed);
        for (int s = 0; s < 4; s++) {
            uint8_t sec[512];
            g_assert_cmpint(be_read(img, s * 512, sec, 512), ==, 0);
            g_assert_true(all(sec, 512, sec[0]));
            g_assert_true(sec[0] == 2 || (s > 0 && sec[0] == 1));
            seen_old |= s > 0 && sec[0] == 1;
            seen_new |= s > 0 && sec[0] == 2;
        }
        extree_mem_backend_free(img);

        img = extree_mem_backend_crash_image(be, 3, EXTREE_CRASH_GARBAGE,
                                             seed);
        for (int s = 1; s < 4; s++) {
            uint8_t sec[512];
            g_assert_cmpint(be_read(img, s * 512, sec, 512), ==, 0);
            if (!all(sec, 512, 1) && !all(sec, 512, 2)) {
                seen_garbage = true;
            }
        }
        extree_mem_backend_free(img);
    }
    g_assert_true(seen_old && seen_new && seen_garbage);

    /* Same seed, same image */
    {
        ExtreeBackend *x, *y;
        x = extree_mem_backend_crash_image(be, 4, EXTREE_CRASH_GARBAGE, 7);
        y = extree_mem_backend_crash_image(be, 4, EXTREE_CRASH_GARBAGE, 7);
        g_assert_true(extree_mem_backend_equal(x, y));
        extree_mem_backend_free(x);
        extree_mem_backend_free(y);
    }

    /* Stopping keeps the log but adds nothing */
    extree_mem_backend_stop_recording(be);
    g_assert_cmpint(be_flush(be), ==, 0);
    g_assert_cmpint(extree_mem_backend_log_length(be), ==, 4);
    extree_mem_backend_free(be);
}

static void test_mem_faults(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeMemStats st;
    uint8_t buf[512] = { 9 };

    extree_mem_backend_start_recording(be);
    /* The third write fails, once, without effect */
    extree_mem_backend_inject_fault(be, EXTREE_FAULT_WRITE, 2, false);
    g_assert_cmpint(be_write(be, 0, buf, 512), ==, 0);
    g_assert_cmpint(be_flush(be), ==, 0);
    g_assert_cmpint(be_write(be, 512, buf, 512), ==, 0);
    g_assert_cmpint(be_write(be, 1024, buf, 512), ==, -EIO);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 1024);
    g_assert_cmpint(be_write(be, 1024, buf, 512), ==, 0);
    g_assert_cmpint(extree_mem_backend_faults(be), ==, 1);
    /* Failed operations are not logged */
    g_assert_cmpint(extree_mem_backend_log_length(be), ==, 4);

    /* Sticky flush failure: the next flush and all later ones */
    extree_mem_backend_inject_fault(be, EXTREE_FAULT_FLUSH, 0, true);
    g_assert_cmpint(be_write(be, 0, buf, 512), ==, 0);
    g_assert_cmpint(be_flush(be), ==, -EIO);
    g_assert_cmpint(be_flush(be), ==, -EIO);
    g_assert_cmpint(extree_mem_backend_faults(be), ==, 3);
    extree_mem_backend_inject_fault(be, 0, 0, false);
    g_assert_cmpint(be_flush(be), ==, 0);

    extree_mem_backend_stats(be, &st);
    g_assert_cmpint(st.writes, ==, 4);
    g_assert_cmpint(st.flushes, ==, 2);
    g_assert_cmpint(st.bytes_written, ==, 2048);
    extree_mem_backend_reset_stats(be);
    extree_mem_backend_stats(be, &st);
    g_assert_cmpint(st.writes, ==, 0);
    extree_mem_backend_free(be);
}

static void test_posix(void)
{
    g_autofree char *dir = g_dir_make_tmp("extree-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "img", NULL);
    g_autofree char *bad = g_build_filename(dir, "no", "such", NULL);
    char *err = NULL;
    ExtreeBackend *be;
    uint8_t buf[8192], out[8192];
    int fd;

    g_assert_nonnull(dir);
    g_assert_null(extree_posix_backend_open(bad, true, &err));
    g_assert_nonnull(strstr(err, "Could not create"));
    g_free(err);
    err = NULL;
    g_assert_null(extree_posix_backend_open(path, false, &err));
    g_assert_nonnull(strstr(err, "Could not open"));
    g_free(err);

    be = extree_posix_backend_open(path, true, &err);
    g_assert_nonnull(be);
    fill(buf, sizeof(buf), 0x77);
    g_assert_cmpint(be_write(be, 4096, buf, sizeof(buf)), ==, 0);
    g_assert_cmpint(be_flush(be), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 12288);
    /* A read crossing EOF is zero-filled */
    g_assert_cmpint(be_read(be, 8192, out, sizeof(out)), ==, 0);
    g_assert_true(all(out, 4096, 0x77));
    g_assert_true(all(out + 4096, 4096, 0));
    if (be->ops->discard(be->opaque, 4096, 4096) == 0) {
        g_assert_cmpint(be_read(be, 4096, out, 4096), ==, 0);
        g_assert_true(all(out, 4096, 0));
    }
    g_assert_cmpint(be->ops->truncate(be->opaque, 4096), ==, 0);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 4096);
    extree_posix_backend_close(be);

    be = extree_posix_backend_open(path, false, &err);
    g_assert_nonnull(be);
    g_assert_cmpint(be->ops->get_length(be->opaque), ==, 4096);
    g_assert_false(extree_posix_backend_is_blk(be));
    extree_posix_backend_close(be);

    /* over the caller's descriptor (the plugin's): left open at close */
    fd = open(path, O_RDWR);
    g_assert_cmpint(fd, >=, 0);
    be = extree_posix_backend_wrap(fd);
    g_assert_cmpint(be_write(be, 0, buf, 4096), ==, 0);
    g_assert_cmpint(be_read(be, 0, out, 8192), ==, 0);
    g_assert_true(all(out, 4096, 0x77));
    g_assert_true(all(out + 4096, 4096, 0));
    g_assert_nonnull(be->ops->pread_many);
    extree_posix_backend_close(be);
    g_assert_cmpint(fcntl(fd, F_GETFD), >=, 0);
    close(fd);
    g_assert_cmpint(g_unlink(path), ==, 0);
    g_assert_cmpint(g_rmdir(dir), ==, 0);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/backend/mem/basic", test_mem_basic);
    g_test_add_func("/backend/mem/clone", test_mem_clone);
    g_test_add_func("/backend/mem/crash-image", test_mem_crash_image);
    g_test_add_func("/backend/mem/faults", test_mem_faults);
    g_test_add_func("/backend/posix", test_posix);
    return g_test_run();
}
