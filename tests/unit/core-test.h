/*
 * Helpers shared by the core's unit tests (test-node, test-btree, ...)
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef TESTS_UNIT_CORE_TEST_H
#define TESTS_UNIT_CORE_TEST_H

#include "extree-int.h"
#include "extree-backend.h"
#include "test-seed.h"

static inline Extree *ct_open_opts(ExtreeBackend *be, bool ro,
                                   uint64_t cache, uint64_t dirty)
{
    ExtreeOpenOptions o = { .read_only = ro, .cache_size = cache,
                            .dirty_limit = dirty };
    Extree *t = NULL;
    char *err = NULL;
    int ret = extree_open(be, &o, &t, &err);
    if (ret < 0) {
        g_error("open failed: %s (%s)", g_strerror(-ret), err);
    }
    return t;
}

static inline Extree *ct_open(ExtreeBackend *be)
{
    return ct_open_opts(be, false, 0, 0);
}

static inline ExtreeBackend *ct_create(uint64_t vsize, uint32_t bs,
                                       uint32_t ns)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeCreateParams p = { .virtual_size = vsize, .block_size = bs,
                             .node_size = ns };
    char *err = NULL;
    int ret = extree_create(be, &p, &err);
    if (ret < 0) {
        g_error("create failed: %s", err);
    }
    return be;
}

/* Map guest range to freshly allocated host space (loops on partial) */
static inline void ct_write(Extree *t, uint64_t guest, uint64_t bytes)
{
    while (bytes) {
        uint64_t host, got;
        g_assert_cmpint(extree_alloc_data(t, guest, bytes, &host, &got), ==,
                        0);
        g_assert_cmpuint(got, >, 0);
        g_assert_cmpuint(got, <=, bytes);
        g_assert_cmpint(extree_map_data(t, guest, got, host), ==, 0);
        guest += got;
        bytes -= got;
    }
}

typedef struct CtReport {
    GPtrArray *msgs;
} CtReport;

static inline void ct_report(void *opaque, const char *msg)
{
    CtReport *r = opaque;
    if (g_test_verbose()) {
        g_printerr("check: %s\n", msg);
    }
    g_ptr_array_add(r->msgs, g_strdup(msg));
}

static inline bool ct_has_msg(CtReport *r, const char *needle)
{
    for (guint i = 0; i < r->msgs->len; i++) {
        if (strstr(r->msgs->pdata[i], needle)) {
            return true;
        }
    }
    return false;
}

/* Run the checker, assert no corruption and no leak */
static inline void ct_check_clean(Extree *t, ExtreeCheckResult *res)
{
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult local;

    if (!res) {
        res = &local;
    }
    g_assert_cmpint(extree_check(t, false, res, ct_report, &r), ==, 0);
    if (res->corruptions || res->leaks) {
        for (guint i = 0; i < r.msgs->len; i++) {
            g_printerr("check: %s\n", (char *)r.msgs->pdata[i]);
        }
    }
    g_assert_cmpuint(res->corruptions, ==, 0);
    g_assert_cmpuint(res->leaks, ==, 0);
    g_ptr_array_free(r.msgs, true);
}

/* Corruption reports counted (extree_set_corrupt_handler()) */
static G_GNUC_UNUSED int ct_corrupt_calls;

static inline void ct_count_corrupt(void *opaque, uint64_t offset,
                                    const char *msg)
{
    if (g_test_verbose()) {
        g_printerr("corrupt at 0x%" PRIx64 ": %s\n", offset, msg);
    }
    ct_corrupt_calls++;
}

/* The run at guest @guest, one block long */
static inline int ct_lookup1(Extree *t, uint64_t guest, ExtreeRun *run)
{
    int n = 0;

    return extree_lookup(t, guest, extree_block_size(t), run, 1, &n);
}

/* ---- editing the image behind the core's back ---- */

/* The valid superblock with the highest generation; returns its slot */
static inline int ct_read_super(ExtreeBackend *be, ExtreeDiskSuper *sb)
{
    ExtreeDiskSuper s[2];
    int best = -1;

    for (int i = 0; i < 2; i++) {
        g_assert_cmpint(be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, &s[i],
                                       EXTREE_SB_SIZE), ==, 0);
        if (GUINT64_FROM_LE(s[i].magic) == EXTREE_MAGIC &&
            (best < 0 || GUINT64_FROM_LE(s[i].generation) >
                         GUINT64_FROM_LE(s[best].generation))) {
            best = i;
        }
    }
    g_assert_cmpint(best, >=, 0);
    *sb = s[best];
    return best;
}

/* Rewrite superblock slot @slot with a correct checksum */
static inline void ct_write_super(ExtreeBackend *be, int slot,
                                  ExtreeDiskSuper *sb)
{
    sb->csum = 0;
    sb->csum = GUINT32_TO_LE(extree_crc32c(0, sb, EXTREE_SB_SIZE));
    g_assert_cmpint(be->ops->pwrite(be->opaque, slot * EXTREE_SB_SIZE, sb,
                                    EXTREE_SB_SIZE), ==, 0);
}

static inline uint8_t *ct_node_read(ExtreeBackend *be, uint64_t off,
                                    uint32_t ns)
{
    uint8_t *buf = g_malloc(ns);
    g_assert_cmpint(be->ops->pread(be->opaque, off, buf, ns), ==, 0);
    return buf;
}

/* Write a node image back, with (@fix_csum) or without a valid checksum */
static inline void ct_node_write(ExtreeBackend *be, uint64_t off,
                                 uint8_t *buf, uint32_t ns, bool fix_csum)
{
    if (fix_csum) {
        ext_st32(buf, extree_crc32c(0, buf + 4, ns - 4));
    }
    g_assert_cmpint(be->ops->pwrite(be->opaque, off, buf, ns), ==, 0);
}

/* Leaf item @i of a node image */
static inline ExtreeDiskItem *ct_item(uint8_t *buf, int i)
{
    return (ExtreeDiskItem *)(buf + EXTREE_NODE_HEADER_SIZE) + i;
}

#endif
