/*
 * Model-based randomized test of the extree core
 *
 * Random inserts (allocate + map), overwrites, punches, zeroes, returned
 * allocations, commits and close/reopen (with or without a commit) are
 * applied both to an extree on the memory backend and to a per-block
 * reference model.  After every operation the runs around it, a random
 * probe and the extent count are compared; every few thousand operations
 * the whole image is walked in both coalescing modes; after every reopen
 * and at the end the checker must find nothing.  A reopen that reads the
 * free-space tree in part is followed by up to 300 operations that
 * allocate no data (punches, zeroes, commits, reopens): they must leave it
 * in part, and the checker (which reads the rest) must then find nothing.
 *
 * Persistent bitmaps (issue 49, point 3): guest writes go in place as the
 * QEMU driver decides it (marked before the data goes out; through a mark
 * log record where the committed bitmaps lack the range; else to new
 * space), among bitmap adds, clears (a sync of all-clear bits, the last
 * write in place possibly still in flight), merges (a sync with keep),
 * removes, and shrinking the disk and growing it back.  After every
 * reopen, with or without a commit before it, the bitmaps committed load,
 * and in each every granule whose content, as the committed state reads
 * (writes in place after it included), differs from its content at the
 * add or last clear is set, and no granule is set that no operation
 * touched since (or since the commit before, whose marks a sync adds).
 *
 * The seed is fixed and printed; EXTREE_TEST_SEED=<n> replays a run (or
 * EXTREE_TEST_SEED=random picks one, test-seed.h), EXTREE_MODEL_SCALE=<f>
 * multiplies the number of operations.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <glib.h>

#include "extree.h"
#include "extree-backend.h"
#include "model.h"
#include "test-seed.h"

typedef struct Variant {
    const char *name;
    uint64_t virtual_size;
    uint32_t block_size, node_size;
    uint64_t cache_size, dirty_limit;   /* 0 = default */
    uint64_t ops;
    uint32_t max_len;           /* blocks per operation, long tail */
    uint32_t short_len;         /* blocks per operation, usual case */
    unsigned commit_one_in;     /* explicit commit probability 1/n */
    unsigned reopen_one_in;
    unsigned walk_every;
    unsigned bitmap_one_in;     /* bitmap operation probability 1/n */
} Variant;

#define TRACE_LEN 32

/*
 * A persistent bitmap as the model expects it, pending or as committed:
 * every granule whose content differs from @base must be set, and none
 * may be set whose blocks no operation touched after @since (issue 49,
 * point 3)
 */
#define NBM 4

typedef struct BmRec {
    bool present;
    uint64_t gran;              /* bytes */
    /*
     * Each block's content (model_content()) when the bitmap was added or
     * last cleared; a g_rc_box shared by the pending and committed record
     */
    uint32_t *base;
    /*
     * Run.stamp of the last commit before the add or clear: a sync adds
     * the marks of the running transaction, so its earlier changes may be
     * set too (after a merge: the older of the two)
     */
    uint64_t since;
} BmRec;

static const char *const bm_name[NBM] = { "m0", "m1", "m2", "m3" };

/* Host blocks: in use by the current mapping / by the committed one */
#define HOST_CUR        1
#define HOST_COMMITTED  2

typedef struct Run {
    const Variant *v;
    uint64_t seed, rng;
    ExtreeBackend *be;
    Extree *t;
    ExtreeOpenOptions opts;
    ExtreeCursor cur;
    uint64_t bs;

    Model model;
    Model committed;            /* state the last commit made durable */

    uint64_t gen;               /* generation of the last commit */
    uint64_t extents;           /* model_extent_count(), incrementally */
    uint8_t *hostmap;           /* HOST_* per host block */
    uint64_t hostmap_len;
    GArray *host_changed;       /* host blocks whose HOST_CUR changed */
    uint64_t data_start;
    uint64_t seq_next;          /* block after the last insert */
    /*
     * Operations left that allocate no data, after an open that read the
     * free tree in part: punches, zeroes and commits work on it as it is
     */
    uint64_t partial_left;

    /* Persistent bitmaps */
    uint32_t tag;               /* of the last write: each has its own */
    uint8_t *buf;               /* data of writes in place */
    BmRec bm[NBM];              /* pending */
    BmRec cbm[NBM];             /* as the last commit stored them */
    uint64_t *touched;          /* per guest block: stamp of its last op */
    uint64_t stamp;             /* operations that touched blocks */
    uint64_t commit_stamp;      /* stamp at the last commit */
    /*
     * The last write in place since the last commit, whose request may not
     * have returned when QEMU clears its bitmap (it marks its copy when the
     * request returns): its block and content before it; -1: none
     */
    int64_t inflight;
    uint32_t inflight_prev;

    uint64_t opno;
    char trace[TRACE_LEN][112];

    struct {
        uint64_t inserts, overwrites, seq, seq_extended, frees, punches;
        uint64_t zeroes;
        uint64_t commits, forced, reopens, dropped, walks, checks;
        uint64_t partial_opens, partial_ops;
        uint64_t shrinks;       /* commits that lowered host_end */
        uint64_t host_end;      /* after the last commit */
        uint64_t max_extents;
        unsigned max_depth;
        uint64_t in_place, logged, moved, checkpoints;
        uint64_t bm_adds, bm_clears, bm_merges, bm_removes, resizes;
        uint64_t bm_checks, granules, granules_set, replayed;
        uint64_t map_logged, map_syncs, map_replayed;
    } n;
} Run;

static void G_GNUC_PRINTF(2, 3) G_GNUC_NORETURN
fail(Run *r, const char *fmt, ...)
{
    va_list ap;
    char *msg;

    va_start(ap, fmt);
    msg = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL variant %s seed %" PRIu64 " op %" PRIu64 ": %s\n",
            r->v->name, r->seed, r->opno, msg);
    fprintf(stderr, "last operations (oldest first):\n");
    for (uint64_t i = r->opno >= TRACE_LEN ? r->opno - TRACE_LEN + 1 : 0;
         i <= r->opno; i++) {
        fprintf(stderr, "  %s\n", r->trace[i % TRACE_LEN]);
    }
    fprintf(stderr, "replay: EXTREE_TEST_SEED=%" PRIu64
            " test-model -p /model/%s\n", r->seed, r->v->name);
    g_test_message("FAIL variant %s seed %" PRIu64 " op %" PRIu64 ": %s",
                   r->v->name, r->seed, r->opno, msg);
    g_free(msg);
    g_assert_not_reached();
}

static void G_GNUC_PRINTF(2, 3) trace(Run *r, const char *fmt, ...)
{
    char *s = r->trace[r->opno % TRACE_LEN];
    int len = snprintf(s, sizeof(r->trace[0]), "%" PRIu64 ": ", r->opno);
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(s + len, sizeof(r->trace[0]) - len, fmt, ap);
    va_end(ap);
}

static void check_ret(Run *r, int ret, const char *what)
{
    if (ret < 0) {
        fail(r, "%s: %s (last error: %s)", what, g_strerror(-ret),
             r->t ? extree_last_error(r->t) : "-");
    }
}

/* ---- host space bookkeeping ---- */

static uint8_t *host_slot(Run *r, uint64_t host)
{
    uint64_t i = host / r->bs;

    if (i >= r->hostmap_len) {
        uint64_t len = MAX(i + 1, r->hostmap_len * 2);
        r->hostmap = g_realloc(r->hostmap, len);
        memset(r->hostmap + r->hostmap_len, 0, len - r->hostmap_len);
        r->hostmap_len = len;
    }
    return &r->hostmap[i];
}

/* The durable state is now the current one */
static void host_commit(Run *r)
{
    r->n.shrinks += extree_host_end(r->t) < r->n.host_end;
    r->n.host_end = extree_host_end(r->t);
    for (guint i = 0; i < r->host_changed->len; i++) {
        uint8_t *s = &r->hostmap[g_array_index(r->host_changed, uint64_t, i)];
        *s = (*s & HOST_CUR) ? HOST_CUR | HOST_COMMITTED : 0;
    }
    g_array_set_size(r->host_changed, 0);
}

/* Set or clear HOST_CUR of host block @host */
static void host_use(Run *r, uint64_t host, bool used)
{
    uint8_t *s = host_slot(r, host);
    uint64_t i = host / r->bs;

    *s = used ? *s | HOST_CUR : *s & ~HOST_CUR;
    g_array_append_val(r->host_changed, i);
}

/* Rebuild from the model after a reopen: current = committed = model */
static void host_rebuild(Run *r)
{
    memset(r->hostmap, 0, r->hostmap_len);
    g_array_set_size(r->host_changed, 0);
    for (uint64_t i = 0; i < r->model.nblocks; i++) {
        if (r->model.b[i].type == EXTREE_RUN_DATA) {
            *host_slot(r, r->model.b[i].host) = HOST_CUR | HOST_COMMITTED;
        }
    }
}

/*
 * An allocation must be aligned, inside the data area, and touch neither
 * live data nor data the last commit still references
 */
static void check_alloc(Run *r, uint64_t bytes, uint64_t host, uint64_t got)
{
    if (got == 0 || got > bytes || got % r->bs || host % r->bs ||
        host < r->data_start) {
        fail(r, "alloc of 0x%" PRIx64 " gave host 0x%" PRIx64 " got 0x%"
             PRIx64 " (data start 0x%" PRIx64 ")", bytes, host, got,
             r->data_start);
    }
    for (uint64_t h = host; h < host + got; h += r->bs) {
        uint8_t s = *host_slot(r, h);
        if (s) {
            fail(r, "alloc gave host 0x%" PRIx64 ", which is used by the %s"
                 " mapping", h, (s & HOST_CUR) ? "current" : "committed");
        }
    }
}

/* Apply to model and host map */
static void model_apply(Run *r, uint64_t blk, uint64_t n, ExtreeRunType type,
                        uint64_t host)
{
    uint32_t tag = type == EXTREE_RUN_DATA ? ++r->tag : 0;

    for (uint64_t i = blk; i < blk + n; i++) {
        if (r->model.b[i].type == EXTREE_RUN_DATA) {
            host_use(r, r->model.b[i].host, false);
        }
    }
    model_set(&r->model, blk, n, type, host, tag);
    if (type == EXTREE_RUN_DATA) {
        for (uint64_t i = 0; i < n; i++) {
            host_use(r, host + i * r->bs, true);
        }
    }
}

/* ---- checks ---- */

static void check_range(Run *r, uint64_t guest, uint64_t bytes, int coalesce)
{
    char *diff = model_compare_range(&r->model, &r->cur, guest, bytes,
                                     coalesce);
    if (diff) {
        fail(r, "%s", diff);
    }
}

/* extree_lookup over [guest, guest + bytes), at most @max runs */
static void check_lookup(Run *r, uint64_t guest, uint64_t bytes, int max)
{
    ExtreeRun runs[8], exp;
    uint64_t end = MIN(guest + bytes, r->v->virtual_size);
    int n, ret;

    g_assert(max <= (int)G_N_ELEMENTS(runs));
    ret = extree_lookup(r->t, guest, end - guest, runs, max, &n);
    check_ret(r, ret, "extree_lookup");
    if (n < 1 || n > max) {
        fail(r, "lookup(0x%" PRIx64 ", 0x%" PRIx64 ", %d) gave %d runs",
             guest, end - guest, max, n);
    }
    for (int i = 0; i < n; i++) {
        model_run(&r->model, guest, end - guest, EXTREE_COALESCE_HOST, &exp);
        if (runs[i].guest != exp.guest || runs[i].length != exp.length ||
            runs[i].type != exp.type ||
            (exp.type == EXTREE_RUN_DATA && runs[i].host != exp.host)) {
            fail(r, "lookup run %d: have type %u 0x%" PRIx64 "+0x%" PRIx64
                 " host 0x%" PRIx64 ", expect type %u 0x%" PRIx64 "+0x%"
                 PRIx64 " host 0x%" PRIx64, i, runs[i].type, runs[i].guest,
                 runs[i].length, runs[i].host, exp.type, exp.guest,
                 exp.length, exp.host);
        }
        guest += exp.length;
    }
    /* Fewer runs than allowed only when the range is covered */
    if (n < max && guest != end) {
        fail(r, "lookup stopped at 0x%" PRIx64 " of 0x%" PRIx64 " after %d "
             "of %d runs", guest, end, n, max);
    }
}

static void check_walk(Run *r)
{
    for (int coalesce = 0; coalesce < 2; coalesce++) {
        ExtreeStats before, after;
        uint64_t runs;
        char *diff;

        extree_stats(r->t, &before);
        diff = model_compare_walk(&r->model, r->t, coalesce, &runs);
        extree_stats(r->t, &after);
        if (diff) {
            fail(r, "full walk: %s", diff);
        }
        /* One search from the root, then leaf to leaf */
        if (after.descents - before.descents != 1) {
            fail(r, "full walk (coalesce %d, %" PRIu64 " runs, %" PRIu64
                 " extents, depth %u) took %" PRIu64 " descents", coalesce,
                 runs, r->extents, extree_depth(r->t),
                 after.descents - before.descents);
        }
    }
    if (extree_extent_count(r->t) != model_extent_count(&r->model)) {
        fail(r, "extent count %" PRIu64 ", model %" PRIu64,
             extree_extent_count(r->t), model_extent_count(&r->model));
    }
    r->n.walks++;
    r->n.max_depth = MAX(r->n.max_depth, extree_depth(r->t));
}

static void check_report(void *opaque, const char *msg)
{
    Run *r = opaque;

    fprintf(stderr, "check (variant %s seed %" PRIu64 " op %" PRIu64 "): %s\n",
            r->v->name, r->seed, r->opno, msg);
}

static void check_tree(Run *r)
{
    ExtreeCheckResult res;
    int ret = extree_check(r->t, false, &res, check_report, r);

    check_ret(r, ret, "extree_check");
    if (res.corruptions || res.leaks || res.unmerged) {
        fail(r, "checker: %" PRIu64 " corruptions, %" PRIu64 " leaks (%"
             PRIu64 " bytes), %" PRIu64 " unmerged items", res.corruptions,
             res.leaks, res.leaked_bytes, res.unmerged);
    }
    if (res.extents != r->extents ||
        res.data_bytes != model_data_blocks(&r->model) * r->bs) {
        fail(r, "checker: %" PRIu64 " extents, %" PRIu64 " data bytes; model %"
             PRIu64 ", %" PRIu64, res.extents, res.data_bytes, r->extents,
             model_data_blocks(&r->model) * r->bs);
    }
    if (res.free_bytes != extree_free_bytes(r->t)) {
        fail(r, "checker: %" PRIu64 " free bytes, tree says %" PRIu64,
             res.free_bytes, extree_free_bytes(r->t));
    }
    /*
     * Free space must be reused: the file may not grow far beyond what the
     * guest can map, plus metadata and one transaction's pending frees
     */
    if (extree_host_end(r->t) > r->data_start + 4 * r->v->virtual_size +
                                (64 << 20)) {
        fail(r, "host_end %" PRIu64 " MiB for a %" PRIu64 " MiB image (%"
             PRIu64 " MiB free, %" PRIu64 " MiB of data)",
             extree_host_end(r->t) >> 20, r->v->virtual_size >> 20,
             extree_free_bytes(r->t) >> 20,
             model_data_blocks(&r->model) * r->bs >> 20);
    }
    r->n.checks++;
}

/* ---- persistent bitmaps ---- */

/* An operation went over blocks [blk, blk + n): call after it */
static void touch(Run *r, uint64_t blk, uint64_t n)
{
    r->stamp++;
    for (uint64_t i = blk; i < blk + n; i++) {
        r->touched[i] = r->stamp;
    }
}

static void bm_rec_set(BmRec *dst, const BmRec *src)
{
    if (dst->base) {
        g_rc_box_release(dst->base);
    }
    *dst = *src;
    if (dst->base) {
        g_rc_box_acquire(dst->base);
    }
}

static void bm_rec_drop(BmRec *b)
{
    if (b->base) {
        g_rc_box_release(b->base);
    }
    memset(b, 0, sizeof(*b));
}

/* Bitmap @i was added or cleared now: the content it is relative to */
static void bm_rebase(Run *r, int i)
{
    BmRec *b = &r->bm[i];

    if (b->base) {
        g_rc_box_release(b->base);
    }
    b->base = g_rc_box_alloc(r->model.nblocks * sizeof(uint32_t));
    for (uint64_t blk = 0; blk < r->model.nblocks; blk++) {
        b->base[blk] = model_content(&r->model, blk);
    }
    b->since = r->commit_stamp;
}

/* A commit stored the pending bitmaps */
static void bm_commit(Run *r)
{
    for (int i = 0; i < NBM; i++) {
        bm_rec_set(&r->cbm[i], &r->bm[i]);
    }
    r->commit_stamp = r->stamp;
    r->inflight = -1;
}

/*
 * After an open: the committed bitmaps load, and in each, every granule
 * whose content (as the committed state reads, writes in place after it
 * included) differs from its content at the add or last clear is set,
 * and every set granule has a block that an operation touched since then
 */
static void check_bitmaps(Run *r)
{
    const Model *m = &r->committed;
    unsigned present = 0;
    ExtreeMarkLogInfo li;

    extree_mark_log_info(r->t, &li);
    r->n.replayed += li.replayed;
    r->n.map_replayed += li.map_replayed;

    for (int i = 0; i < NBM; i++) {
        const BmRec *b = &r->cbm[i];
        int k = extree_bitmap_find(r->t, bm_name[i]);
        ExtreeBitmapInfo info;
        uint64_t per, len;
        uint8_t *bits;

        if (!b->present) {
            if (k >= 0) {
                fail(r, "bitmap %s loads, not committed", bm_name[i]);
            }
            continue;
        }
        present++;
        if (k < 0) {
            fail(r, "bitmap %s missing", bm_name[i]);
        }
        check_ret(r, extree_bitmap_info(r->t, k, &info), "bitmap_info");
        if (!info.enabled || info.granularity != b->gran) {
            fail(r, "bitmap %s: enabled %d granularity %" PRIu64
                 ", expected 1 %" PRIu64, bm_name[i], info.enabled,
                 info.granularity, b->gran);
        }
        len = extree_bitmap_bytes(r->t, k);
        bits = g_malloc(len);
        extree_bitmap_read(r->t, k, bits);
        per = b->gran / r->bs;
        for (uint64_t g = 0; g * per < m->nblocks; g++) {
            uint64_t end = MIN((g + 1) * per, m->nblocks);
            uint64_t changed = UINT64_MAX;
            bool touched = false, set;

            g_assert(g / 8 < len);
            set = bits[g / 8] & (1 << (g % 8));
            for (uint64_t blk = g * per; blk < end; blk++) {
                if (changed == UINT64_MAX &&
                    model_content(m, blk) != b->base[blk]) {
                    changed = blk;
                }
                touched |= r->touched[blk] > b->since;
            }
            if (changed != UINT64_MAX && !set) {
                fail(r, "bitmap %s: granule %" PRIu64 " not set, block %"
                     PRIu64 " reads %u, was %u at the add or last clear",
                     bm_name[i], g, changed, model_content(m, changed),
                     b->base[changed]);
            }
            if (set && !touched) {
                fail(r, "bitmap %s: granule %" PRIu64 " set, no operation "
                     "touched it since the add or last clear", bm_name[i],
                     g);
            }
            r->n.granules++;
            r->n.granules_set += set;
        }
        g_free(bits);
    }
    if (extree_bitmap_count(r->t) != present) {
        fail(r, "%u bitmaps load, expected %u", extree_bitmap_count(r->t),
             present);
    }
    r->n.bm_checks++;
}

/* ---- operations ---- */

/*
 * An update call may end with a commit forced by the dirty limit: then the
 * state after the call is durable.  Call after every update call.
 */
static void after_update(Run *r, uint64_t gen_before)
{
    if (extree_generation(r->t) == gen_before) {
        return;
    }
    if (extree_generation(r->t) != gen_before + 1 || extree_is_dirty(r->t)) {
        fail(r, "generation went from %" PRIu64 " to %" PRIu64 " (%s) in "
             "one update", gen_before, extree_generation(r->t),
             extree_is_dirty(r->t) ? "dirty" : "clean");
    }
    r->gen = extree_generation(r->t);
    model_copy(&r->committed, &r->model);
    host_commit(r);
    bm_commit(r);
    r->n.forced++;
}

/* extree_alloc_data plus the checks of its result */
static void alloc(Run *r, uint64_t guest, uint64_t bytes, uint64_t *host,
                  uint64_t *got)
{
    uint64_t gen = extree_generation(r->t);

    check_ret(r, extree_alloc_data(r->t, guest, bytes, host, got),
              "extree_alloc_data");
    after_update(r, gen);
    check_alloc(r, bytes, *host, *got);
}

static void do_insert(Run *r, uint64_t blk, uint64_t n)
{
    uint64_t guest = blk * r->bs, left = n * r->bs;

    for (uint64_t i = blk; i < blk + n; i++) {
        if (r->model.b[i].type == EXTREE_RUN_DATA) {
            r->n.overwrites++;
            break;
        }
    }
    while (left > 0) {
        uint64_t host, got, gen;

        alloc(r, guest, left, &host, &got);
        gen = extree_generation(r->t);
        if (extree_map_log_usable(r->t) && model_rand_below(&r->rng, 2)) {
            /*
             * As the driver maps a write to new space with map records:
             * the checksum of what the host bytes hold (the model keeps
             * no content for them), which nothing may change before the
             * commit that ends the chain
             */
            uint8_t *data = g_malloc(got);

            check_ret(r, r->be->ops->pread(r->be->opaque, host, data, got),
                      "pread");
            check_ret(r, extree_map_data_logged(r->t, guest, got, host,
                                                extree_crc32c(0, data, got)),
                      "extree_map_data_logged");
            g_free(data);
            r->n.map_logged++;
        } else {
            check_ret(r, extree_map_data(r->t, guest, got, host),
                      "extree_map_data");
        }
        model_apply(r, guest / r->bs, got / r->bs, EXTREE_RUN_DATA, host);
        after_update(r, gen);
        guest += got;
        left -= got;
    }
    r->seq_next = blk + n;
    r->n.inserts++;
}

/* Allocate and give back without mapping */
static void do_free(Run *r, uint64_t blk, uint64_t n)
{
    uint64_t host, got, gen;

    alloc(r, blk * r->bs, n * r->bs, &host, &got);
    gen = extree_generation(r->t);
    check_ret(r, extree_free_data(r->t, host, got), "extree_free_data");
    after_update(r, gen);
    r->n.frees++;
}

static void do_commit(Run *r)
{
    bool dirty = extree_is_dirty(r->t);

    check_ret(r, extree_commit(r->t), "extree_commit");
    if (extree_is_dirty(r->t)) {
        fail(r, "dirty after commit");
    }
    if (extree_generation(r->t) != r->gen + dirty) {
        fail(r, "generation %" PRIu64 " after commit, expected %" PRIu64,
             extree_generation(r->t), r->gen + dirty);
    }
    r->gen = extree_generation(r->t);
    model_copy(&r->committed, &r->model);
    host_commit(r);
    bm_commit(r);
    r->n.commits++;
}

static void do_reopen(Run *r, bool commit);

/*
 * A flush as the driver makes it: the waiting map records written if they
 * hold every change since the commit (then what the model holds now is
 * what a crash returns to), else a commit
 */
static void do_flush(Run *r)
{
    if (!extree_map_log_sync_wanted(r->t)) {
        do_commit(r);
        return;
    }
    check_ret(r, extree_map_log_sync(r->t), "extree_map_log_sync");
    model_copy(&r->committed, &r->model);
    r->n.map_syncs++;
    if (model_rand_below(&r->rng, 8) == 0) {
        /* a crash right after it: the open replays the chain */
        trace(r, "reopen dropping changes after a flush");
        do_reopen(r, false);
    }
}

static void do_open(Run *r)
{
    char *err = NULL;
    int ret = extree_open(r->be, &r->opts, &r->t, &err);

    if (ret < 0) {
        fail(r, "extree_open: %s: %s", g_strerror(-ret), err ? err : "");
    }
    extree_cursor_init(&r->cur, r->t);
}

/* Does the handle know only part of the free-space tree? */
static bool is_partial(Run *r)
{
    ExtreeStats st;

    extree_stats(r->t, &st);
    return st.free_tree_partial;
}

static void do_reopen(Run *r, bool commit)
{
    char *diff;

    if (commit) {
        do_commit(r);
    }
    extree_cursor_release(&r->cur);
    extree_close(r->t);
    r->t = NULL;
    if (r->n.reopens % 4 == 0) {
        /* A read-only open in between sees the same and changes nothing */
        ExtreeOpenOptions ro = r->opts;
        ExtreeMarkLogInfo li;
        char *err = NULL;
        Extree *t;
        int ret;

        ro.read_only = true;
        ret = extree_open(r->be, &ro, &t, &err);
        if (ret < 0) {
            fail(r, "read-only open: %s: %s", g_strerror(-ret), err);
        }
        diff = model_compare_walk(&r->committed, t, EXTREE_COALESCE_ALLOC,
                                  NULL);
        if (diff) {
            fail(r, "read-only open: %s", diff);
        }
        extree_mark_log_info(t, &li);
        /* map records replayed leave it dirty, never written */
        if (extree_punch(t, 0, r->bs) != -EROFS ||
            (li.map_replayed ? extree_commit(t) != -EROFS :
             extree_commit(t) != 0 || extree_is_dirty(t))) {
            fail(r, "read-only open accepts updates");
        }
        extree_close(t);
    }
    do_open(r);

    if (extree_generation(r->t) != r->gen) {
        fail(r, "reopened generation %" PRIu64 ", committed %" PRIu64,
             extree_generation(r->t), r->gen);
    }
    if (extree_virtual_size(r->t) != r->v->virtual_size ||
        extree_block_size(r->t) != r->bs ||
        extree_data_start(r->t) != r->data_start) {
        fail(r, "reopened geometry differs");
    }
    diff = model_compare_walk(&r->committed, r->t, EXTREE_COALESCE_HOST,
                              NULL);
    if (diff) {
        fail(r, "reopen (%s) does not show the committed state: %s",
             commit ? "after commit" : "uncommitted changes dropped", diff);
    }
    if (!commit) {
        r->n.dropped++;
    }
    check_bitmaps(r);
    for (int i = 0; i < NBM; i++) {
        bm_rec_set(&r->bm[i], &r->cbm[i]);
    }
    r->inflight = -1;
    model_copy(&r->model, &r->committed);
    host_rebuild(r);
    r->extents = model_extent_count(&r->model);
    check_walk(r);
    r->partial_left = 0;
    if (is_partial(r)) {
        /* the checker reads all of it: only after some updates */
        r->n.partial_opens++;
        r->partial_left = 1 + model_rand_below(&r->rng, 300);
    } else {
        check_tree(r);
        if (extree_generation(r->t) != r->gen) {
            /* the checker committed the replayed map records first */
            r->gen = extree_generation(r->t);
            host_commit(r);
            bm_commit(r);
        }
    }
    r->n.reopens++;
}

/* Random block-aligned range of 1..short_len (sometimes 1..max_len) blocks */
static void pick_range(Run *r, uint64_t *blk, uint64_t *n)
{
    uint64_t max = model_rand_below(&r->rng, 8) == 0 ? r->v->max_len
                                                   : r->v->short_len;

    *n = 1 + model_rand_below(&r->rng, max);
    *n = MIN(*n, r->model.nblocks);
    *blk = model_rand_below(&r->rng, r->model.nblocks - *n + 1);
}

/*
 * A guest write of blocks [blk, blk + n) as the QEMU driver makes it, run
 * by run: in place where extree_in_place() allows it, marked before the
 * data goes out (extree_bitmaps_mark()); in place after a mark log record
 * where the committed bitmaps lack it and the log has room; else to new
 * space.  A log half full is checkpointed by a commit, as the driver does.
 */
static void do_write(Run *r, uint64_t blk, uint64_t n)
{
    uint64_t guest = blk * r->bs, end = (blk + n) * r->bs;

    if (end > r->v->virtual_size) {
        /* the block the disk ends in goes to new space, as inserts do */
        do_insert(r, r->model.nblocks - 1, 1);
        end -= r->bs;
    }
    while (guest < end) {
        ExtreeRun run;
        bool in_place = false, logged = false;
        uint64_t len;

        check_ret(r, extree_cursor_query(&r->cur, guest, end - guest,
                                         EXTREE_COALESCE_HOST, &run),
                  "extree_cursor_query");
        len = MIN(run.length, end - guest);
        if (run.type == EXTREE_RUN_DATA) {
            check_ret(r, extree_in_place(r->t, &run, guest, len, &in_place),
                      "extree_in_place");
            if (in_place) {
                extree_bitmaps_mark(r->t, guest, len);
            } else {
                int ret = model_mark_log_write(r->t, r->be, &run, guest,
                                               len);
                if (ret == -EPROTO) {
                    fail(r, "not in place after its mark log record");
                } else if (ret != -ENOSPC) {
                    check_ret(r, ret, "model_mark_log_write");
                    in_place = logged = true;
                }
            }
        }
        if (in_place) {
            uint64_t b0 = guest / r->bs, nb = len / r->bs;
            uint64_t host = run.host + guest - run.guest;
            uint32_t tag = ++r->tag;

            memset(r->buf, tag, len);
            check_ret(r, r->be->ops->pwrite(r->be->opaque, host, r->buf, len),
                      "pwrite in place");
            r->inflight = b0 + nb - 1;
            r->inflight_prev = model_content(&r->model, b0 + nb - 1);
            for (uint64_t b = b0; b < b0 + nb; b++) {
                ModelBlock *c = &r->committed.b[b];
                ModelBlock *cur = &r->model.b[b];

                cur->tag = tag;
                /* durable now if the committed state maps it there */
                if (c->type == EXTREE_RUN_DATA && c->host == cur->host) {
                    c->tag = tag;
                }
            }
            r->n.in_place++;
            r->n.logged += logged;
            if (logged && extree_mark_log_checkpoint_wanted(r->t)) {
                extree_mark_log_checkpoint(r->t);
                do_commit(r);
                r->n.checkpoints++;
            }
        } else {
            do_insert(r, guest / r->bs, len / r->bs);
            r->n.moved++;
        }
        guest += len;
    }
}

/*
 * Add, clear (a sync of all-clear bits, as QEMU's clear and the driver's
 * next sync do), merge (a sync with keep) or remove a bitmap, or shrink
 * the disk and grow it back (extree_set_virtual_size())
 */
static void do_bitmap_op(Run *r)
{
    unsigned dice = model_rand_below(&r->rng, 100);
    int i = model_rand_below(&r->rng, NBM), j = model_rand_below(&r->rng, NBM);
    BmRec *b = &r->bm[i];
    uint64_t gen = extree_generation(r->t);
    int k;

    if (dice < 30 || (dice < 85 && !b->present)) {
        if (b->present) {
            trace(r, "bitmap remove %s", bm_name[i]);
            check_ret(r, extree_bitmap_remove(r->t, bm_name[i]),
                      "extree_bitmap_remove");
            bm_rec_drop(b);
            r->n.bm_removes++;
        } else {
            b->gran = r->bs << model_rand_below(&r->rng, 4);
            trace(r, "bitmap add %s granularity %" PRIu64, bm_name[i],
                  b->gran);
            check_ret(r, extree_bitmap_add(r->t, bm_name[i], b->gran, true),
                      "extree_bitmap_add");
            b->present = true;
            bm_rebase(r, i);
            r->n.bm_adds++;
        }
    } else if (dice < 60) {
        uint8_t *zero;

        trace(r, "bitmap clear %s", bm_name[i]);
        k = extree_bitmap_find(r->t, bm_name[i]);
        zero = g_malloc0(extree_bitmap_bytes(r->t, k));
        check_ret(r, extree_bitmap_sync(r->t, k, zero, true, false),
                  "extree_bitmap_sync");
        g_free(zero);
        bm_rebase(r, i);
        if (r->inflight >= 0 && model_rand_below(&r->rng, 2)) {
            /* the last write in place had not returned: after the clear */
            b->base[r->inflight] = r->inflight_prev;
        }
        r->n.bm_clears++;
    } else if (dice < 85) {
        BmRec *src = &r->bm[j];
        uint8_t *bits;
        int ks;

        if (j == i || !src->present || src->gran != b->gran) {
            return;
        }
        trace(r, "bitmap merge %s into %s", bm_name[j], bm_name[i]);
        k = extree_bitmap_find(r->t, bm_name[i]);
        ks = extree_bitmap_find(r->t, bm_name[j]);
        bits = g_malloc(extree_bitmap_bytes(r->t, ks));
        extree_bitmap_read(r->t, ks, bits);
        check_ret(r, extree_bitmap_sync(r->t, k, bits, true, true),
                  "extree_bitmap_sync");
        g_free(bits);
        b->since = MIN(b->since, src->since);
        r->n.bm_merges++;
    } else {
        uint64_t keep = r->model.nblocks / 2 +
                        model_rand_below(&r->rng, r->model.nblocks / 2);
        uint64_t gen_grow;

        trace(r, "shrink to blk %" PRIu64 ", grow back", keep);
        check_ret(r, extree_set_virtual_size(r->t, keep * r->bs),
                  "extree_set_virtual_size (shrink)");
        model_apply(r, keep, r->model.nblocks - keep, EXTREE_RUN_UNALLOC, 0);
        after_update(r, gen);
        gen_grow = extree_generation(r->t);
        check_ret(r, extree_set_virtual_size(r->t, r->v->virtual_size),
                  "extree_set_virtual_size (grow)");
        after_update(r, gen_grow);
        if (gen_grow != gen && extree_generation(r->t) == gen_grow) {
            /* the small size is committed: a reopen wants the full one */
            do_commit(r);
        }
        r->extents = model_extent_count(&r->model);
        touch(r, keep, r->model.nblocks - keep);
        r->seq_next = MIN(r->seq_next, keep);
        r->n.resizes++;
        return;
    }
    after_update(r, gen);
}

static void one_op(Run *r)
{
    uint64_t blk, n, probe, max;
    uint64_t before_starts, gen;
    unsigned dice = model_rand_below(&r->rng, 100);
    bool seq;

    if (model_rand_below(&r->rng, r->v->reopen_one_in) == 0) {
        /* Half the reopens drop the uncommitted changes */
        bool commit = model_rand_below(&r->rng, 2) == 0;
        trace(r, "reopen%s", commit ? " after commit" : " dropping changes");
        do_reopen(r, commit);
        return;
    }
    if (model_rand_below(&r->rng, r->v->commit_one_in) == 0) {
        trace(r, "commit");
        do_commit(r);
        return;
    }
    if (model_rand_below(&r->rng, r->v->commit_one_in / 16) == 0) {
        trace(r, "flush");
        do_flush(r);
        return;
    }
    if (!r->partial_left &&
        model_rand_below(&r->rng, r->v->bitmap_one_in) == 0) {
        do_bitmap_op(r);
        return;
    }

    if (r->partial_left) {
        /* no data allocation: punch or zero instead */
        dice = MAX(dice, 58 + model_rand_below(&r->rng, 42));
        r->n.partial_ops++;
        if (--r->partial_left == 0) {
            if (!is_partial(r)) {
                fail(r, "updates without data loaded the whole free tree");
            }
            /* the checker commits first: so does the model */
            do_commit(r);
            check_tree(r);
        }
    }
    pick_range(r, &blk, &n);
    seq = dice < 10 && r->seq_next < r->model.nblocks;
    if (seq) {
        /* Sequential write after the previous insert: must extend it */
        blk = r->seq_next;
        n = MIN(n, r->model.nblocks - blk);
    }
    before_starts = model_extent_starts(&r->model, blk, blk + n + 1);

    if (seq) {
        trace(r, "seq insert blk %" PRIu64 " n %" PRIu64, blk, n);
        do_insert(r, blk, n);
        r->n.seq++;
        /* The allocator should have put it right after its predecessor */
        if (blk > 0 && r->model.b[blk - 1].type == EXTREE_RUN_DATA &&
            r->model.b[blk].host == r->model.b[blk - 1].host + r->bs) {
            r->n.seq_extended++;
        }
    } else if (dice < 40) {
        trace(r, "insert blk %" PRIu64 " n %" PRIu64, blk, n);
        do_insert(r, blk, n);
    } else if (dice < 55) {
        trace(r, "write blk %" PRIu64 " n %" PRIu64, blk, n);
        do_write(r, blk, n);
    } else if (dice < 58) {
        trace(r, "alloc+free blk %" PRIu64 " n %" PRIu64, blk, n);
        do_free(r, blk, n);
    } else if (dice < 79) {
        trace(r, "punch blk %" PRIu64 " n %" PRIu64, blk, n);
        gen = extree_generation(r->t);
        check_ret(r, extree_punch(r->t, blk * r->bs, n * r->bs),
                  "extree_punch");
        model_apply(r, blk, n, EXTREE_RUN_UNALLOC, 0);
        after_update(r, gen);
        r->n.punches++;
    } else {
        trace(r, "zero blk %" PRIu64 " n %" PRIu64, blk, n);
        gen = extree_generation(r->t);
        check_ret(r, extree_set_zero(r->t, blk * r->bs, n * r->bs),
                  "extree_set_zero");
        model_apply(r, blk, n, EXTREE_RUN_ZERO, 0);
        after_update(r, gen);
        r->n.zeroes++;
    }
    touch(r, blk, n);

    /* The item count changes only around the operation */
    r->extents += model_extent_starts(&r->model, blk, blk + n + 1);
    r->extents -= before_starts;
    if (extree_extent_count(r->t) != r->extents) {
        fail(r, "extent count %" PRIu64 ", model %" PRIu64,
             extree_extent_count(r->t), r->extents);
    }
    r->n.max_extents = MAX(r->n.max_extents, r->extents);

    /*
     * The runs around the operation, then a random probe at a 512-byte
     * aligned offset with a random limit (the cursor goes back and forth)
     */
    check_range(r, blk ? (blk - 1) * r->bs : 0, (n + 2) * r->bs,
                r->opno & 1);
    probe = model_rand_below(&r->rng, r->v->virtual_size / 512) * 512;
    max = (1 + model_rand_below(&r->rng, 64 * r->bs / 512)) * 512;
    check_range(r, probe, MIN(max, r->v->virtual_size - probe),
                (r->opno >> 1) & 1);
    check_lookup(r, blk ? (blk - 1) * r->bs : 0, (n + 2) * r->bs,
                 1 + model_rand_below(&r->rng, 8));
}

static void run_variant(gconstpointer opaque)
{
    const Variant *v = opaque;
    ExtreeCreateParams cp = {
        .virtual_size = v->virtual_size,
        .block_size = v->block_size,
        .node_size = v->node_size,
    };
    const char *scale_env = getenv("EXTREE_MODEL_SCALE");
    double scale = scale_env ? g_ascii_strtod(scale_env, NULL) : 1.0;
    uint64_t ops = v->ops * scale;
    Run *r = g_new0(Run, 1);
    char *err = NULL;
    gint64 t0 = g_get_monotonic_time();
    int ret;

    r->v = v;
    r->seed = r->rng = test_seed(v->name, 1);
    g_test_message("variant %s: %" PRIu64 " operations", v->name, ops);
    r->bs = v->block_size;
    r->opts.cache_size = v->cache_size;
    r->opts.dirty_limit = v->dirty_limit;
    model_init(&r->model, v->virtual_size, v->block_size);
    model_init(&r->committed, v->virtual_size, v->block_size);
    r->hostmap_len = 1024;
    r->hostmap = g_malloc0(r->hostmap_len);
    r->host_changed = g_array_new(false, false, sizeof(uint64_t));
    r->buf = g_malloc(v->max_len * r->bs);
    r->touched = g_new0(uint64_t, r->model.nblocks);
    r->inflight = -1;

    r->be = extree_mem_backend_new();
    ret = extree_create(r->be, &cp, &err);
    if (ret < 0) {
        fail(r, "extree_create: %s: %s", g_strerror(-ret), err ? err : "");
    }
    trace(r, "create");
    do_open(r);
    r->gen = extree_generation(r->t);
    r->data_start = extree_data_start(r->t);
    check_walk(r);
    check_tree(r);

    for (r->opno = 1; r->opno <= ops; r->opno++) {
        one_op(r);
        if (r->opno % v->walk_every == 0) {
            check_walk(r);
        }
    }
    r->opno++;
    trace(r, "final commit and reopen");
    do_reopen(r, true);
    check_tree(r);
    if (scale >= 1 && !r->n.partial_opens) {
        fail(r, "no open read the free tree in part");
    }

    g_test_message("variant %s: %" PRIu64 " inserts (%" PRIu64 " overwriting, %"
                   PRIu64 " sequential of which %" PRIu64 " extended the "
                   "previous extent), %" PRIu64 " alloc+free, %" PRIu64
                   " punches, %" PRIu64 " zeroes", v->name, r->n.inserts,
                   r->n.overwrites, r->n.seq, r->n.seq_extended, r->n.frees,
                   r->n.punches, r->n.zeroes);
    g_test_message("variant %s: %" PRIu64 " commits, %" PRIu64 " forced, %"
                   PRIu64 " reopens (%" PRIu64 " dropping changes), %" PRIu64
                   " full walks, %" PRIu64 " checks; %" PRIu64 " commits "
                   "shrank the file", v->name, r->n.commits, r->n.forced,
                   r->n.reopens, r->n.dropped, r->n.walks, r->n.checks,
                   r->n.shrinks);
    g_test_message("variant %s: %" PRIu64 " opens read the free tree in "
                   "part, %" PRIu64 " operations followed them", v->name,
                   r->n.partial_opens, r->n.partial_ops);
    g_test_message("variant %s: up to %" PRIu64 " extents, depth up to %u, "
                   "%" PRIu64 " at the end; host end %" PRIu64 " MiB, %"
                   PRIu64 " MiB free, %" PRIu64 " MiB of data; %.2f s",
                   v->name, r->n.max_extents, r->n.max_depth, r->extents,
                   extree_host_end(r->t) >> 20, extree_free_bytes(r->t) >> 20,
                   model_data_blocks(&r->model) * r->bs >> 20,
                   (g_get_monotonic_time() - t0) / 1e6);
    g_test_message("variant %s: %" PRIu64 " runs written in place (%" PRIu64
                   " after a mark log record, %" PRIu64 " checkpoints), %"
                   PRIu64 " to new space; bitmaps: %" PRIu64 " adds, %" PRIu64
                   " clears, %" PRIu64 " merges, %" PRIu64 " removes, %"
                   PRIu64 " shrinks and grows; %" PRIu64 " checks of %"
                   PRIu64 " granules, %" PRIu64 " set; %" PRIu64 " mark log "
                   "records replayed", v->name,
                   r->n.in_place, r->n.logged, r->n.checkpoints, r->n.moved,
                   r->n.bm_adds, r->n.bm_clears, r->n.bm_merges,
                   r->n.bm_removes, r->n.resizes, r->n.bm_checks,
                   r->n.granules, r->n.granules_set, r->n.replayed);
    g_test_message("variant %s: map records: %" PRIu64 " writes to new space"
                   " logged, %" PRIu64 " flushes without a commit, %" PRIu64
                   " entries replayed at opens", v->name, r->n.map_logged,
                   r->n.map_syncs, r->n.map_replayed);
    if (scale >= 1 && (!r->n.map_syncs || !r->n.map_replayed)) {
        fail(r, "no flush wrote map records, or no open replayed them");
    }

    extree_cursor_release(&r->cur);
    extree_close(r->t);
    extree_mem_backend_free(r->be);
    model_destroy(&r->model);
    model_destroy(&r->committed);
    g_free(r->hostmap);
    g_array_free(r->host_changed, true);
    for (int i = 0; i < NBM; i++) {
        bm_rec_drop(&r->bm[i]);
        bm_rec_drop(&r->cbm[i]);
    }
    g_free(r->buf);
    g_free(r->touched);
    g_free(r);
}

static const Variant variants[] = {
    {
        /* The default geometry over 64 MiB: 16384 guest blocks */
        .name = "4k-16k",
        .virtual_size = 64 << 20,
        .block_size = 4096, .node_size = 16384,
        .ops = 450000, .max_len = 256, .short_len = 8,
        .commit_one_in = 400, .reopen_one_in = 4000,
        .walk_every = 2000, .bitmap_one_in = 500,
    },
    {
        /*
         * Small blocks and nodes, short operations and a small cache:
         * many items, a deep tree, constant eviction
         */
        .name = "512-4k-deep",
        .virtual_size = 32 << 20,
        .block_size = 512, .node_size = 4096,
        .cache_size = 256 << 10,
        .ops = 350000, .max_len = 64, .short_len = 2,
        .commit_one_in = 1000, .reopen_one_in = 10000,
        .walk_every = 5000, .bitmap_one_in = 1000,
    },
    {
        /*
         * A virtual size that ends inside a block, and the smallest dirty
         * limit (16 nodes) over a tree of some 40 leaves: commits are
         * forced every few operations
         */
        .name = "4k-4k-forced",
        .virtual_size = (64 << 20) + 1536,
        .block_size = 4096, .node_size = 4096,
        .dirty_limit = 64 << 10,
        .ops = 200000, .max_len = 128, .short_len = 2,
        .commit_one_in = 2000, .reopen_one_in = 1000,
        .walk_every = 1000, .bitmap_one_in = 300,
    },
};

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    for (size_t i = 0; i < G_N_ELEMENTS(variants); i++) {
        char *path = g_strdup_printf("/model/%s", variants[i].name);
        g_test_add_data_func(path, &variants[i], run_variant);
        g_free(path);
    }
    return g_test_run();
}
