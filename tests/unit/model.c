/*
 * Reference model of an extree mapping for the randomized and crash tests
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include <glib.h>

#include "block/extree-format.h"
#include "model.h"

void model_init(Model *m, uint64_t virtual_size, uint32_t block_size)
{
    m->virtual_size = virtual_size;
    m->block_size = block_size;
    m->nblocks = (virtual_size + block_size - 1) / block_size;
    m->b = g_new0(ModelBlock, m->nblocks);
}

void model_destroy(Model *m)
{
    g_free(m->b);
    m->b = NULL;
}

void model_copy(Model *dst, const Model *src)
{
    g_assert(dst->nblocks == src->nblocks &&
             dst->block_size == src->block_size);
    memcpy(dst->b, src->b, src->nblocks * sizeof(ModelBlock));
}

static bool block_equal(const ModelBlock *a, const ModelBlock *b)
{
    return a->type == b->type &&
           (a->type != EXTREE_RUN_DATA || a->host == b->host);
}

bool model_equal(const Model *a, const Model *b)
{
    if (a->nblocks != b->nblocks) {
        return false;
    }
    for (uint64_t i = 0; i < a->nblocks; i++) {
        if (!block_equal(&a->b[i], &b->b[i])) {
            return false;
        }
    }
    return true;
}

void model_set(Model *m, uint64_t blk, uint64_t n, ExtreeRunType type,
               uint64_t host, uint32_t tag)
{
    g_assert(blk + n <= m->nblocks);
    for (uint64_t i = 0; i < n; i++) {
        ModelBlock *b = &m->b[blk + i];
        b->type = type;
        b->host = type == EXTREE_RUN_DATA ? host + i * m->block_size : 0;
        b->tag = tag;
    }
}

/*
 * Whether block @i continues the run that block @i - 1 is part of, whose
 * first block has type @first
 */
static bool joins(const Model *m, uint64_t i, uint32_t first, int coalesce)
{
    const ModelBlock *prev = &m->b[i - 1], *cur = &m->b[i];

    if (coalesce == EXTREE_COALESCE_ALLOC) {
        return (first == EXTREE_RUN_UNALLOC) ==
               (cur->type == EXTREE_RUN_UNALLOC);
    }
    if (cur->type != prev->type) {
        return false;
    }
    return cur->type != EXTREE_RUN_DATA ||
           cur->host == prev->host + m->block_size;
}

void model_run(const Model *m, uint64_t guest, uint64_t max_bytes,
               int coalesce, ExtreeRun *run)
{
    uint64_t bs = m->block_size;
    uint64_t blk = guest / bs;
    uint64_t limit = MIN(guest + max_bytes, m->virtual_size);
    uint64_t next = blk + 1;
    const ModelBlock *first = &m->b[blk];

    g_assert(guest < m->virtual_size && max_bytes > 0);
    while (next * bs < limit && joins(m, next, first->type, coalesce)) {
        next++;
    }
    run->guest = guest;
    run->length = MIN(next * bs, limit) - guest;
    run->type = first->type;
    run->host = first->type == EXTREE_RUN_DATA ?
                first->host + guest % bs : 0;
}

uint64_t model_extent_starts(const Model *m, uint64_t blk, uint64_t end)
{
    uint64_t count = 0;

    end = MIN(end, m->nblocks);
    for (uint64_t i = blk; i < end; i++) {
        if (m->b[i].type != EXTREE_RUN_UNALLOC &&
            (i == 0 || !joins(m, i, m->b[i].type, EXTREE_COALESCE_HOST))) {
            count++;
        }
    }
    return count;
}

uint64_t model_extent_count(const Model *m)
{
    return model_extent_starts(m, 0, m->nblocks);
}

uint64_t model_data_blocks(const Model *m)
{
    uint64_t count = 0;

    for (uint64_t i = 0; i < m->nblocks; i++) {
        count += m->b[i].type == EXTREE_RUN_DATA;
    }
    return count;
}

static const char *type_name(unsigned type)
{
    switch (type) {
    case EXTREE_RUN_UNALLOC:
        return "unalloc";
    case EXTREE_RUN_DATA:
        return "data";
    case EXTREE_RUN_ZERO:
        return "zero";
    }
    return "?";
}

/* NULL if @got is @exp, else the difference */
static char *run_diff(const ExtreeRun *got, const ExtreeRun *exp,
                      uint64_t max_bytes, int coalesce)
{
    if (got->guest == exp->guest && got->length == exp->length &&
        got->type == exp->type &&
        (exp->type != EXTREE_RUN_DATA || got->host == exp->host)) {
        return NULL;
    }
    return g_strdup_printf("query(guest 0x%" PRIx64 ", max 0x%" PRIx64
                           ", coalesce %d): have %s 0x%" PRIx64 "+0x%" PRIx64
                           " host 0x%" PRIx64 ", expect %s 0x%" PRIx64
                           "+0x%" PRIx64 " host 0x%" PRIx64,
                           exp->guest, max_bytes, coalesce,
                           type_name(got->type), got->guest, got->length,
                           got->host, type_name(exp->type), exp->guest,
                           exp->length, exp->host);
}

/*
 * As the QEMU driver asks: the cached query first (it must give the same
 * answer as the full one or -EAGAIN), the full query when it declines
 */
static int query_as_driver(ExtreeCursor *c, uint64_t guest, uint64_t max,
                           int coalesce, ExtreeRun *run)
{
    int ret = extree_cursor_query_cached(c, guest, max, run);

    if (ret != -EAGAIN) {
        return ret;
    }
    return extree_cursor_query(c, guest, max, coalesce, run);
}

char *model_compare_range(const Model *m, ExtreeCursor *c, uint64_t guest,
                          uint64_t bytes, int coalesce)
{
    uint64_t end = MIN(guest + bytes, m->virtual_size);
    ExtreeRun got, exp;

    while (guest < end) {
        /* alternate the two entry points on the same cursor */
        int ret = (guest / 4096) & 1 ?
            query_as_driver(c, guest, end - guest, coalesce, &got) :
            extree_cursor_query(c, guest, end - guest, coalesce, &got);
        char *diff;

        if (ret < 0) {
            return g_strdup_printf("query(guest 0x%" PRIx64 ", max 0x%" PRIx64
                                   "): %s", guest, end - guest,
                                   g_strerror(-ret));
        }
        model_run(m, guest, end - guest, coalesce, &exp);
        diff = run_diff(&got, &exp, end - guest, coalesce);
        if (diff) {
            return diff;
        }
        guest += got.length;
    }
    return NULL;
}

char *model_compare_walk(const Model *m, Extree *t, int coalesce,
                         uint64_t *nruns)
{
    ExtreeCursor c;
    uint64_t runs = 0;
    uint64_t guest = 0;
    char *diff = NULL;

    extree_cursor_init(&c, t);
    while (guest < m->virtual_size) {
        uint64_t max = m->virtual_size - guest;
        ExtreeRun got, exp;
        int ret = query_as_driver(&c, guest, max, coalesce, &got);

        if (ret < 0) {
            diff = g_strdup_printf("query(guest 0x%" PRIx64 "): %s", guest,
                                   g_strerror(-ret));
            break;
        }
        model_run(m, guest, max, coalesce, &exp);
        diff = run_diff(&got, &exp, max, coalesce);
        if (diff) {
            break;
        }
        runs++;
        guest += got.length;
    }
    extree_cursor_release(&c);
    if (nruns) {
        *nruns = runs;
    }
    return diff;
}

int model_mark_log_write(Extree *t, ExtreeBackend *be, const ExtreeRun *run,
                         uint64_t guest, uint64_t bytes)
{
    ExtreeMarkRange r = { guest, bytes };
    uint8_t *rec;
    uint64_t off;
    bool in_place = false;
    int ret;

    if (!extree_mark_log_wanted(t, run, guest, bytes)) {
        return -ENOSPC;
    }
    ret = extree_mark_log_append(t, &r, 1, &rec, &off);
    if (ret < 0) {
        return ret;
    }
    ret = be->ops->pwrite(be->opaque, off, rec, EXTREE_MARK_LOG_RECORD);
    g_free(rec);
    if (ret == 0) {
        ret = be->ops->flush(be->opaque);
    }
    if (ret < 0) {
        return ret;
    }
    extree_mark_log_durable(t, &r, 1);
    ret = extree_in_place(t, run, guest, bytes, &in_place);
    if (ret < 0) {
        return ret;
    }
    return in_place ? 0 : -EPROTO;
}
