/*
 * Crash-point enumeration and I/O failure tests of the extree core
 *
 * A workload of several transactions (maps with data, overwrites, punches,
 * zeroes, explicit commits and commits forced by a small dirty limit; one
 * that makes the file shrink and grow; one over free space in so many
 * pieces that opens read the free-space tree in part; one with persistent
 * bitmaps and writes in place) runs on a recording memory backend.  Then
 * for every prefix of the log of writes, flushes, discards and truncates,
 * with the entries after its last flush kept, dropped, torn or torn with
 * garbage, the resulting device must open, show exactly one
 * committed state (mapping, generation, backing file and the data it points
 * to) that a crash at that point may legitimately leave, and pass the
 * checker without corruption or leak.  With bitmaps, that state's bitmaps
 * load, and each enabled one has the granule of every block whose content,
 * as the image reads (a write in place after the commit included, torn or
 * not), differs from what it was when the bitmap was added or last
 * cleared (issue 49, point 3).  A crash during create leaves either no
 * image or the empty one.
 *
 * Failed writes and flushes during a commit must fail the commit and leave
 * the previous committed state on disk; a failed node read must fail the
 * call and leave the image as last committed.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <glib.h>

#include "extree.h"
#include "extree-backend.h"
#include "block/extree-format.h"
#include "model.h"
#include "test-seed.h"

/*
 * Small blocks and nodes: some 30 leaves from a few thousand extents, so
 * that the smallest dirty limit (16 nodes) forces commits
 */
#define VSIZE           (8 << 20)
#define BS              512
#define NODE            4096
#define DATA_MAGIC      0x4154414445455254ULL   /* "TREEDATA" */
#define WBUF            (64 * 1024)             /* data write size */

/* First bytes of every data block the workload writes */
typedef struct DataHeader {
    uint64_t magic;
    uint64_t guest;             /* guest offset of the block */
    uint64_t tag;               /* which write */
} DataHeader;

/*
 * A persistent bitmap as the workload made it (the pending state), or as
 * a committed state holds it
 */
#define NBM             4

typedef struct BmRec {
    bool present, enabled;
    uint64_t gran;              /* bytes */
    /*
     * Each block's content (0: reads as zeroes, else its data's tag) when
     * the bitmap was added or last cleared: every granule whose content
     * differs from it must be set in an enabled bitmap
     */
    uint32_t *base;
    uint8_t *bits;              /* committed, disabled only: unchanging */
    uint64_t nbits;
} BmRec;

typedef struct State {
    uint64_t gen;
    Model m;
    bool forced;                /* by the dirty limit */
    const char *backing;        /* static string or NULL */
    uint64_t host_end;
    size_t sb_index;            /* log index of its superblock write */
    size_t end;                 /* log prefix that makes it durable */
    BmRec bm[NBM];
} State;

typedef struct Workload {
    uint64_t seed, rng;
    ExtreeBackend *be;
    Extree *t;
    Model model;
    GArray *states;             /* of State */
    uint32_t tag;
    uint8_t *buf;
    const char *backing;
    BmRec bm[NBM];
    /*
     * Host block -> 1 + log index of its last write in place: a crash
     * image may hold it, torn or not, with the mapping of any state
     * committed before it
     */
    GHashTable *in_place;
    /*
     * The last write in place, whose request may not have returned when
     * the caller clears a bitmap (QEMU marks its copy when it returns):
     * its block and content before it; -1: none since the last commit
     */
    int64_t inflight;
    uint32_t inflight_prev;
    uint64_t n_in_place, n_moved, n_clears;
} Workload;

static const char *bm_name[NBM] = { "b0", "b1", "b2", "b3" };

static void bm_rec_copy(BmRec *dst, const BmRec *src, uint64_t nblocks)
{
    *dst = *src;
    dst->base = src->base ? g_memdup2(src->base, nblocks * sizeof(uint32_t))
                          : NULL;
    dst->bits = src->bits ? g_memdup2(src->bits, src->nbits) : NULL;
}

static void bm_rec_free(BmRec *b)
{
    g_free(b->base);
    g_free(b->bits);
    b->base = NULL;
    b->bits = NULL;
}

static const ExtreeCreateParams create_params = {
    .virtual_size = VSIZE,
    .block_size = BS,
    .node_size = NODE,
};

static void wl_open(Workload *w, uint64_t dirty_limit)
{
    ExtreeOpenOptions o = { .dirty_limit = dirty_limit };
    char *err = NULL;
    int ret = extree_open(w->be, &o, &w->t, &err);

    if (ret < 0) {
        g_error("extree_open: %s: %s", g_strerror(-ret), err ? err : "");
    }
}

/* Log index of the last superblock write in [from, to) */
static size_t find_sb_write(ExtreeBackend *be, size_t from, size_t to)
{
    size_t found = SIZE_MAX;

    for (size_t i = from; i < to; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(be, i, &e);
        if (e.op == EXTREE_LOG_WRITE && e.offset < EXTREE_SB_AREA) {
            found = i;
        }
    }
    return found;
}

/* A commit has happened within log entries [from, now) */
static void wl_record_state(Workload *w, size_t from, bool forced)
{
    State s = {
        .gen = extree_generation(w->t),
        .end = extree_mem_backend_log_length(w->be),
    };

    s.sb_index = find_sb_write(w->be, from, s.end);
    g_assert_cmpuint(s.sb_index, !=, SIZE_MAX);
    /* Durable once the first flush after the superblock write is done */
    for (size_t i = s.sb_index + 1; i < s.end; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(w->be, i, &e);
        if (e.op == EXTREE_LOG_FLUSH) {
            s.end = i + 1;
            break;
        }
    }
    model_init(&s.m, VSIZE, BS);
    model_copy(&s.m, &w->model);
    s.forced = forced;
    s.backing = w->backing;
    s.host_end = extree_host_end(w->t);
    for (int i = 0; i < NBM; i++) {
        BmRec *b = &w->bm[i];

        if (b->present && !b->enabled && !b->bits) {
            /* disabled: what this commit stored stays */
            int k = extree_bitmap_find(w->t, bm_name[i]);

            g_assert_cmpint(k, >=, 0);
            b->nbits = extree_bitmap_bytes(w->t, k);
            b->bits = g_malloc(b->nbits);
            extree_bitmap_read(w->t, k, b->bits);
        }
        bm_rec_copy(&s.bm[i], b, VSIZE / BS);
    }
    w->inflight = -1;
    g_array_append_val(w->states, s);
}

static void wl_commit(Workload *w)
{
    size_t from = extree_mem_backend_log_length(w->be);
    uint64_t gen = extree_generation(w->t);
    bool dirty = extree_is_dirty(w->t);

    g_assert_cmpint(extree_commit(w->t), ==, 0);
    g_assert_cmpuint(extree_generation(w->t), ==, gen + dirty);
    if (dirty) {
        wl_record_state(w, from, false);
    } else {
        /* Nothing dirty: nothing written */
        g_assert_cmpuint(extree_mem_backend_log_length(w->be), ==, from);
    }
}

static void fill_block(uint8_t *p, uint64_t guest, uint64_t tag)
{
    DataHeader h = { DATA_MAGIC, guest, tag };

    memset(p, (uint8_t)tag, BS);
    memcpy(p, &h, sizeof(h));
}

/*
 * An update call may end with a commit forced by the dirty limit, which
 * makes the state after the call durable
 */
static void wl_after_update(Workload *w, uint64_t gen, size_t from)
{
    if (extree_generation(w->t) != gen) {
        g_assert_cmpuint(extree_generation(w->t), ==, gen + 1);
        wl_record_state(w, from, true);
    }
}

/*
 * Allocate, write the data (unless @tag is 0), map: what a guest write
 * does
 */
static void wl_insert(Workload *w, uint64_t blk, uint64_t n, bool data)
{
    uint64_t guest = blk * BS, left = n * BS;
    uint32_t tag = data ? ++w->tag : 0;

    while (left > 0) {
        uint64_t host, got, gen = extree_generation(w->t);
        size_t from = extree_mem_backend_log_length(w->be);

        g_assert_cmpint(extree_alloc_data(w->t, guest, left, &host, &got),
                        ==, 0);
        wl_after_update(w, gen, from);
        g_assert_cmpuint(got, >, 0);
        for (uint64_t done = 0; tag && done < got; done += WBUF) {
            uint64_t len = MIN(WBUF, got - done);
            for (uint64_t i = 0; i < len; i += BS) {
                fill_block(w->buf + i, guest + done + i, tag);
            }
            g_assert_cmpint(w->be->ops->pwrite(w->be->opaque, host + done,
                                               w->buf, len), ==, 0);
        }

        gen = extree_generation(w->t);
        from = extree_mem_backend_log_length(w->be);
        g_assert_cmpint(extree_map_data(w->t, guest, got, host), ==, 0);
        model_set(&w->model, guest / BS, got / BS, EXTREE_RUN_DATA, host,
                  tag);
        wl_after_update(w, gen, from);
        guest += got;
        left -= got;
    }
}

static void wl_random_op(Workload *w, unsigned insert_pct)
{
    uint64_t n = 1 + model_rand_below(&w->rng, 8);
    uint64_t blk = model_rand_below(&w->rng, VSIZE / BS - n + 1);
    unsigned dice = model_rand_below(&w->rng, 100);
    uint64_t gen = extree_generation(w->t);
    size_t from = extree_mem_backend_log_length(w->be);

    if (dice < insert_pct) {
        wl_insert(w, blk, n, true);
    } else if (dice < insert_pct + (100 - insert_pct) / 2) {
        g_assert_cmpint(extree_punch(w->t, blk * BS, n * BS), ==, 0);
        model_set(&w->model, blk, n, EXTREE_RUN_UNALLOC, 0, 0);
        wl_after_update(w, gen, from);
    } else {
        g_assert_cmpint(extree_set_zero(w->t, blk * BS, n * BS), ==, 0);
        model_set(&w->model, blk, n, EXTREE_RUN_ZERO, 0, 0);
        wl_after_update(w, gen, from);
    }
}

/* Create an image and start recording; states[0] is the created one */
static void wl_start(Workload *w, uint64_t seed)
{
    State s0 = { 0 };
    char *err = NULL;

    memset(w, 0, sizeof(*w));
    w->seed = w->rng = seed;
    w->be = extree_mem_backend_new();
    w->states = g_array_new(false, false, sizeof(State));
    w->buf = g_malloc(WBUF);
    w->in_place = g_hash_table_new(NULL, NULL);
    w->inflight = -1;
    model_init(&w->model, VSIZE, BS);
    g_assert_cmpint(extree_create(w->be, &create_params, &err), ==, 0);

    extree_mem_backend_start_recording(w->be);
    wl_open(w, 0);
    s0.gen = extree_generation(w->t);
    s0.host_end = extree_host_end(w->t);
    model_init(&s0.m, VSIZE, BS);
    g_array_append_val(w->states, s0);
}

static void wl_stop(Workload *w)
{
    extree_close(w->t);
    w->t = NULL;
    extree_mem_backend_stop_recording(w->be);
}

/* Several transactions of every kind of update, some commits forced */
static void wl_mixed(Workload *w)
{
    /* T1: a few thousand extents, without data to keep the log short */
    for (int i = 0; i < 2500; i++) {
        wl_insert(w, model_rand_below(&w->rng, VSIZE / BS - 2),
                  1 + model_rand_below(&w->rng, 2), false);
    }
    wl_commit(w);
    /* T2, T3: overwrite, punch, zero; then an empty commit */
    for (int i = 0; i < 120; i++) {
        wl_random_op(w, 50);
    }
    wl_commit(w);
    for (int i = 0; i < 40; i++) {
        wl_random_op(w, 30);
    }
    wl_commit(w);
    wl_commit(w);
    /* A transaction that changes the superblock only */
    w->backing = "base.qcow2";
    g_assert_cmpint(extree_set_backing(w->t, w->backing, "qcow2"), ==, 0);
    wl_commit(w);
    /* T4: the smallest dirty limit forces commits on the way */
    extree_close(w->t);
    wl_open(w, NODE);
    for (int i = 0; i < 300; i++) {
        wl_random_op(w, 50);
    }
    wl_commit(w);
    /* T5: free most of the image (thousands of discards after commit) */
    g_assert_cmpint(extree_punch(w->t, VSIZE / 8, VSIZE - VSIZE / 8), ==, 0);
    model_set(&w->model, VSIZE / 8 / BS, (VSIZE - VSIZE / 8) / BS,
              EXTREE_RUN_UNALLOC, 0, 0);
    wl_commit(w);
    for (int i = 0; i < 20; i++) {
        wl_random_op(w, 50);
    }
    wl_commit(w);
}

/*
 * Data at the end of the file is freed: a later commit lowers host_end
 * and truncates the file; then the file grows again
 */
static void wl_shrink(Workload *w)
{
    wl_insert(w, 0, (4 << 20) / BS, true);
    wl_commit(w);
    g_assert_cmpint(extree_punch(w->t, 0, 4 << 20), ==, 0);
    model_set(&w->model, 0, (4 << 20) / BS, EXTREE_RUN_UNALLOC, 0, 0);
    wl_commit(w);
    for (int i = 0; i < 10; i++) {
        wl_random_op(w, 70);
    }
    wl_commit(w);
    wl_insert(w, (4 << 20) / BS, (2 << 20) / BS, true);
    for (int i = 0; i < 10; i++) {
        wl_random_op(w, 70);
    }
    wl_commit(w);
}

static bool free_tree_partial(Workload *w)
{
    ExtreeStats st;

    extree_stats(w->t, &st);
    return st.free_tree_partial;
}

/*
 * Free space in a thousand pieces: an open reads the free-space tree in
 * part.  Punches and zeroes free space in the unread part and take nodes
 * from the read one, over commits, some forced; after a reopen, data
 * placement reads the rest in the middle of a transaction of frees.
 */
static void wl_partial(Workload *w)
{
    uint64_t n = (1 << 20) / BS;

    wl_insert(w, 0, n, false);
    wl_commit(w);
    for (uint64_t b = 0; b < n; b += 2) {
        g_assert_cmpint(extree_punch(w->t, b * BS, BS), ==, 0);
        model_set(&w->model, b, 1, EXTREE_RUN_UNALLOC, 0, 0);
    }
    wl_commit(w);
    extree_close(w->t);
    wl_open(w, NODE);
    g_assert_true(free_tree_partial(w));
    for (int i = 0; i < 150; i++) {
        /* in the data: frees all over the free tree's unread part */
        uint64_t len = 1 + model_rand_below(&w->rng, 8);
        uint64_t blk = model_rand_below(&w->rng, n - len);
        uint64_t gen = extree_generation(w->t);
        size_t from = extree_mem_backend_log_length(w->be);
        bool zero = i % 3 == 0;

        g_assert_cmpint((zero ? extree_set_zero : extree_punch)(
                            w->t, blk * BS, len * BS), ==, 0);
        model_set(&w->model, blk, len,
                  zero ? EXTREE_RUN_ZERO : EXTREE_RUN_UNALLOC, 0, 0);
        wl_after_update(w, gen, from);
        if (i % 50 == 49) {
            wl_commit(w);
        }
    }
    g_assert_true(free_tree_partial(w));
    extree_close(w->t);
    wl_open(w, 0);
    g_assert_true(free_tree_partial(w));
    for (int i = 0; i < 20; i++) {
        wl_random_op(w, 0);
    }
    for (int i = 0; i < 20; i++) {
        wl_random_op(w, 50);
    }
    g_assert_false(free_tree_partial(w));
    wl_commit(w);
}

/* ---- persistent dirty bitmaps ---- */

static void bm_set_base(Workload *w, BmRec *b)
{
    if (!b->base) {
        b->base = g_new(uint32_t, VSIZE / BS);
    }
    for (uint64_t i = 0; i < VSIZE / BS; i++) {
        b->base[i] = model_content(&w->model, i);
    }
}

static void wl_bm_add(Workload *w, int i, uint64_t gran)
{
    BmRec *b = &w->bm[i];

    g_assert_cmpint(extree_bitmap_add(w->t, bm_name[i], gran, true), ==, 0);
    b->present = b->enabled = true;
    b->gran = gran;
    bm_set_base(w, b);
}

/*
 * The caller cleared bitmap @i in its copy and syncs it, as QEMU's
 * block-dirty-bitmap-clear (or a backup) and the driver's next commit do.
 * The last write in place may not have returned yet: then it counts as a
 * change after the clear (issue 49 A), and only its mark, made before its
 * data went out, keeps it in the bitmap.
 */
static void wl_bm_clear(Workload *w, int i)
{
    BmRec *b = &w->bm[i];
    int k = extree_bitmap_find(w->t, bm_name[i]);
    uint8_t *zero = g_malloc0(extree_bitmap_bytes(w->t, k));

    g_assert_cmpint(extree_bitmap_sync(w->t, k, zero, b->enabled, false), ==,
                    0);
    g_free(zero);
    bm_set_base(w, b);
    if (w->inflight >= 0 && model_rand_below(&w->rng, 2)) {
        b->base[w->inflight] = w->inflight_prev;
    }
    w->n_clears++;
}

/* Disabled in the caller's copy, its bits as they are */
static void wl_bm_disable(Workload *w, int i)
{
    int k = extree_bitmap_find(w->t, bm_name[i]);
    uint8_t *bits = g_malloc(extree_bitmap_bytes(w->t, k));

    extree_bitmap_read(w->t, k, bits);
    g_assert_cmpint(extree_bitmap_sync(w->t, k, bits, false, false), ==, 0);
    g_free(bits);
    w->bm[i].enabled = false;
}

/* block-dirty-bitmap-merge of @src into @dst (the same granularity) */
static void wl_bm_merge(Workload *w, int dst, int src)
{
    int kd = extree_bitmap_find(w->t, bm_name[dst]);
    int ks = extree_bitmap_find(w->t, bm_name[src]);
    uint8_t *bits = g_malloc(extree_bitmap_bytes(w->t, ks));

    g_assert_cmpuint(w->bm[dst].gran, ==, w->bm[src].gran);
    extree_bitmap_read(w->t, ks, bits);
    g_assert_cmpint(extree_bitmap_sync(w->t, kd, bits, w->bm[dst].enabled,
                                       true), ==, 0);
    g_free(bits);
}

static void wl_bm_remove(Workload *w, int i)
{
    g_assert_cmpint(extree_bitmap_remove(w->t, bm_name[i]), ==, 0);
    bm_rec_free(&w->bm[i]);
    w->bm[i].present = false;
}

/*
 * A guest write of blocks [blk, blk + n), block by block as the driver
 * decides it (xt_write_mode()): in place where extree_in_place() allows
 * it, marked before the data goes out (extree_bitmaps_mark()), else to
 * new space
 */
static void wl_write_bm(Workload *w, uint64_t blk, uint64_t n)
{
    for (uint64_t b = blk; b < blk + n; b++) {
        ExtreeCursor c;
        ExtreeRun run;
        bool in_place = false;

        extree_cursor_init(&c, w->t);
        g_assert_cmpint(extree_cursor_query(&c, b * BS, BS,
                                            EXTREE_COALESCE_HOST, &run), ==,
                        0);
        if (run.type == EXTREE_RUN_DATA) {
            g_assert_cmpint(extree_in_place(w->t, &run, b * BS, BS,
                                            &in_place), ==, 0);
        }
        extree_cursor_release(&c);
        if (in_place) {
            uint64_t host = run.host + b * BS - run.guest;
            uint32_t tag = ++w->tag;

            extree_bitmaps_mark(w->t, b * BS, BS);
            fill_block(w->buf, b * BS, tag);
            g_assert_cmpint(w->be->ops->pwrite(w->be->opaque, host, w->buf,
                                               BS), ==, 0);
            g_hash_table_insert(w->in_place, GSIZE_TO_POINTER(host / BS),
                                GSIZE_TO_POINTER(
                                    extree_mem_backend_log_length(w->be)));
            w->inflight = b;
            w->inflight_prev = model_content(&w->model, b);
            model_set(&w->model, b, 1, EXTREE_RUN_DATA, host, tag);
            w->n_in_place++;
        } else {
            wl_insert(w, b, 1, true);
            w->n_moved++;
        }
    }
}

/* Writes (mostly over data written before), zeroes, punches, clears */
static void wl_bm_random_op(Workload *w, uint64_t area)
{
    uint64_t n = 1 + model_rand_below(&w->rng, 8);
    uint64_t blk = model_rand_below(&w->rng, area - n + 1);
    unsigned dice = model_rand_below(&w->rng, 100);
    uint64_t gen = extree_generation(w->t);
    size_t from = extree_mem_backend_log_length(w->be);
    int i = model_rand_below(&w->rng, NBM);

    if (dice < 70) {
        wl_write_bm(w, blk, n);
    } else if (dice < 82) {
        g_assert_cmpint(extree_set_zero(w->t, blk * BS, n * BS), ==, 0);
        model_set(&w->model, blk, n, EXTREE_RUN_ZERO, 0, 0);
        wl_after_update(w, gen, from);
    } else if (dice < 90) {
        g_assert_cmpint(extree_punch(w->t, blk * BS, n * BS), ==, 0);
        model_set(&w->model, blk, n, EXTREE_RUN_UNALLOC, 0, 0);
        wl_after_update(w, gen, from);
    } else if (dice < 95 && w->bm[i].present && w->bm[i].enabled) {
        wl_bm_clear(w, i);
    } else if (dice >= 95) {
        wl_commit(w);
    }
}

/*
 * Persistent bitmaps (issue 49, point 3): b0 enabled throughout; b1
 * disabled half-way; b2 added, merged into (b0) and cleared later; b3
 * added and removed; clears at random.  Writes go in place where the core
 * allows it and to new space elsewhere, among zeroes and punches.
 */
static void wl_bitmaps(Workload *w)
{
    uint64_t area = (1 << 20) / BS;

    wl_bm_add(w, 0, BS);
    wl_bm_add(w, 1, 8 * BS);
    wl_write_bm(w, 0, area / 4);
    wl_commit(w);
    for (int i = 0; i < 150; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_commit(w);
    wl_bm_add(w, 2, BS);
    wl_bm_add(w, 3, 4 * BS);
    for (int i = 0; i < 100; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_commit(w);
    wl_bm_disable(w, 1);
    for (int i = 0; i < 60; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_bm_merge(w, 2, 0);
    for (int i = 0; i < 60; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_commit(w);
    wl_bm_clear(w, 2);
    for (int i = 0; i < 60; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_bm_remove(w, 3);
    for (int i = 0; i < 100; i++) {
        wl_bm_random_op(w, area / 4);
    }
    wl_commit(w);
    g_test_message("bitmaps: %" PRIu64 " blocks written in place, %" PRIu64
                   " to new space, %" PRIu64 " clears", w->n_in_place,
                   w->n_moved, w->n_clears);
    g_assert_cmpuint(w->n_in_place, >, 0);
}

typedef struct Script {
    void (*run)(Workload *w);
    bool truncates;             /* must make the file shorter */
} Script;

static const Script script_mixed = { wl_mixed, false };
static const Script script_shrink = { wl_shrink, true };
static const Script script_partial = { wl_partial, false };
static const Script script_bitmaps = { wl_bitmaps, false };

static void wl_free(Workload *w)
{
    for (guint i = 0; i < w->states->len; i++) {
        State *s = &g_array_index(w->states, State, i);
        model_destroy(&s->m);
        for (int j = 0; j < NBM; j++) {
            bm_rec_free(&s->bm[j]);
        }
    }
    for (int j = 0; j < NBM; j++) {
        bm_rec_free(&w->bm[j]);
    }
    g_hash_table_destroy(w->in_place);
    g_array_free(w->states, true);
    model_destroy(&w->model);
    extree_mem_backend_free(w->be);
    g_free(w->buf);
}

/* ---- verification of one crash image ---- */

typedef struct CrashStats {
    uint64_t images, leaky_images, leaks, leaked_bytes, granules_checked;
    uint64_t per_state[64];
} CrashStats;

/*
 * Was host block @host written in place after state @s was committed?  It
 * may hold anything then: the write, torn or not, or what it had.
 */
static bool written_after(Workload *w, const State *s, uint64_t host)
{
    size_t at = GPOINTER_TO_SIZE(g_hash_table_lookup(w->in_place,
                                                     GSIZE_TO_POINTER(host /
                                                                      BS)));

    return at > s->sb_index + 1;
}

/*
 * Every DATA block of @s holds what was written for it, but for writes in
 * place after it
 */
static char *check_data(Workload *w, ExtreeBackend *img, const State *s)
{
    const Model *m = &s->m;
    DataHeader h;

    for (uint64_t i = 0; i < m->nblocks; i++) {
        const ModelBlock *b = &m->b[i];
        if (b->type != EXTREE_RUN_DATA || !b->tag ||
            written_after(w, s, b->host)) {
            continue;
        }
        g_assert_cmpint(img->ops->pread(img->opaque, b->host, &h, sizeof(h)),
                        ==, 0);
        if (h.magic != DATA_MAGIC || h.guest != i * BS || h.tag != b->tag) {
            return g_strdup_printf("data of guest 0x%" PRIx64 " at host 0x%"
                                   PRIx64 ": have guest 0x%" PRIx64 " tag %"
                                   PRIu64 ", expect tag %u", i * BS, b->host,
                                   h.guest, h.tag, b->tag);
        }
    }
    return NULL;
}

/*
 * The bitmaps of state @s, and in each enabled one the granule of every
 * block whose content (as the image reads now) differs from its content
 * when the bitmap was added or last cleared (spec: Persistent dirty
 * bitmaps); a disabled one as committed
 */
static char *check_bitmaps(Workload *w, ExtreeBackend *img, Extree *t,
                           const State *s, CrashStats *cs)
{
    unsigned present = 0;

    for (int i = 0; i < NBM; i++) {
        const BmRec *b = &s->bm[i];
        ExtreeBitmapInfo info;
        uint8_t *bits;
        uint64_t len, per;
        int k;

        if (!b->present) {
            if (extree_bitmap_find(t, bm_name[i]) >= 0) {
                return g_strdup_printf("bitmap %s loads, removed",
                                       bm_name[i]);
            }
            continue;
        }
        present++;
        k = extree_bitmap_find(t, bm_name[i]);
        if (k < 0) {
            return g_strdup_printf("bitmap %s missing", bm_name[i]);
        }
        g_assert_cmpint(extree_bitmap_info(t, k, &info), ==, 0);
        if (info.enabled != b->enabled || info.granularity != b->gran) {
            return g_strdup_printf("bitmap %s: enabled %d granularity %"
                                   PRIu64 ", expected %d %" PRIu64,
                                   bm_name[i], info.enabled,
                                   info.granularity, b->enabled, b->gran);
        }
        len = extree_bitmap_bytes(t, k);
        bits = g_malloc(len);
        extree_bitmap_read(t, k, bits);
        if (!b->enabled) {
            bool same = len == b->nbits && !memcmp(bits, b->bits, len);

            g_free(bits);
            if (!same) {
                return g_strdup_printf("disabled bitmap %s changed",
                                       bm_name[i]);
            }
            continue;
        }
        per = b->gran / BS;
        for (uint64_t blk = 0; blk < s->m.nblocks; blk++) {
            const ModelBlock *mb = &s->m.b[blk];
            uint64_t g = blk / per;
            uint32_t now = model_content(&s->m, blk);
            bool unknown = false;

            if (mb->type == EXTREE_RUN_DATA && mb->tag &&
                written_after(w, s, mb->host)) {
                DataHeader h;

                /* what the write in place left, if it is any write */
                g_assert_cmpint(img->ops->pread(img->opaque, mb->host, &h,
                                                sizeof(h)), ==, 0);
                unknown = h.magic != DATA_MAGIC || h.guest != blk * BS;
                now = h.tag;
            }
            if ((unknown || now != b->base[blk]) &&
                !(bits[g / 8] & (1 << (g % 8)))) {
                char *msg = g_strdup_printf(
                    "bitmap %s: granule %" PRIu64 " not set, block %" PRIu64
                    " reads %s%u, was %u at the add or last clear",
                    bm_name[i], g, blk, unknown ? "torn " : "", now,
                    b->base[blk]);

                g_free(bits);
                return msg;
            }
            cs->granules_checked++;
        }
        g_free(bits);
    }
    if (extree_bitmap_count(t) != present) {
        return g_strdup_printf("%u bitmaps, expected %u",
                               extree_bitmap_count(t), present);
    }
    return NULL;
}

static void report_line(void *opaque, const char *msg)
{
    fprintf(stderr, "  check: %s\n", msg);
}

static const char *mode_name[] = { "keep", "drop", "tear", "garbage" };

/*
 * Open the crash image of log prefix @p in @mode and verify it.  The
 * states it may show: the newest whose commit had flushed its superblock
 * (@lo), or a newer one whose superblock write is among the unflushed
 * writes, if they survived (always in KEEP, never in DROP).
 */
static void verify_image(Workload *w, size_t p, ExtreeCrashMode mode,
                         uint64_t seed, CrashStats *cs)
{
    ExtreeBackend *img = extree_mem_backend_crash_image(w->be, p, mode, seed);
    ExtreeOpenOptions o = { 0 };
    ExtreeCheckResult res;
    Extree *t;
    char *err = NULL, *diff = NULL;
    guint lo = 0, hi = 0, k;
    State *s = NULL;
    int ret;

    for (guint i = 0; i < w->states->len; i++) {
        State *si = &g_array_index(w->states, State, i);
        if (si->end <= p) {
            lo = i;
        }
        if (i > 0 && si->sb_index < p) {
            hi = i;
        }
    }
    ret = extree_open(img, &o, &t, &err);
    if (ret < 0) {
        g_error("prefix %zu (%s, seed %" PRIu64 "): open failed: %s: %s", p,
                mode_name[mode], w->seed, g_strerror(-ret), err ? err : "");
    }
    for (k = lo; k <= hi; k++) {
        if (g_array_index(w->states, State, k).gen == extree_generation(t)) {
            s = &g_array_index(w->states, State, k);
            break;
        }
    }
    if (!s || (mode == EXTREE_CRASH_DROP && k != lo) ||
        (mode == EXTREE_CRASH_KEEP && k != hi)) {
        g_error("prefix %zu (%s, seed %" PRIu64 "): opened generation %"
                PRIu64 ", expected states %u..%u (generations %" PRIu64 "..%"
                PRIu64 ")", p, mode_name[mode], w->seed,
                extree_generation(t), lo, hi,
                g_array_index(w->states, State, lo).gen,
                g_array_index(w->states, State, hi).gen);
    }
    diff = model_compare_walk(&s->m, t, EXTREE_COALESCE_HOST, NULL);
    if (!diff) {
        diff = check_data(w, img, s);
    }
    if (!diff) {
        diff = check_bitmaps(w, img, t, s, cs);
    }
    if (!diff && g_strcmp0(extree_backing_file(t), s->backing)) {
        diff = g_strdup_printf("backing file '%s', expected '%s'",
                               extree_backing_file(t), s->backing);
    }
    if (diff) {
        g_error("prefix %zu (%s, seed %" PRIu64 "), state %u (generation %"
                PRIu64 "): %s", p, mode_name[mode], w->seed, k, s->gen, diff);
    }
    ret = extree_check(t, false, &res, report_line, NULL);
    if (ret < 0 || res.corruptions) {
        g_error("prefix %zu (%s, seed %" PRIu64 "), state %u: check returned"
                " %d, %" PRIu64 " corruptions", p, mode_name[mode], w->seed,
                k, ret, res.corruptions);
    }
    if (res.leaks) {
        cs->leaky_images++;
        cs->leaks += res.leaks;
        cs->leaked_bytes += res.leaked_bytes;
    }
    cs->images++;
    cs->per_state[MIN(k, G_N_ELEMENTS(cs->per_state) - 1)]++;
    extree_close(t);
    extree_mem_backend_free(img);
}

static void test_enumerate(gconstpointer opaque)
{
    const Script *script = opaque;
    Workload w;
    CrashStats cs = { 0 };
    size_t len, count[EXTREE_LOG_DISCARD + 1] = { 0 };
    gint64 t0 = g_get_monotonic_time();
    uint64_t seed = test_seed("workload", 1);

    wl_start(&w, seed);
    script->run(&w);
    wl_stop(&w);
    len = extree_mem_backend_log_length(w.be);
    for (size_t i = 0; i < len; i++) {
        ExtreeLogEntry e;
        extree_mem_backend_log_entry(w.be, i, &e);
        count[e.op]++;
    }
    g_test_message("log: %zu entries: %zu writes, %zu flushes, %zu truncates, "
                   "%zu discards; %u committed states", len,
                   count[EXTREE_LOG_WRITE], count[EXTREE_LOG_FLUSH],
                   count[EXTREE_LOG_TRUNCATE], count[EXTREE_LOG_DISCARD],
                   w.states->len);
    for (guint i = 0; i < w.states->len; i++) {
        State *s = &g_array_index(w.states, State, i);
        g_test_message("  state %u: generation %" PRIu64 ", %" PRIu64
                       " extents, host end 0x%" PRIx64 ", superblock write "
                       "at %zu, durable at %zu%s", i, s->gen,
                       model_extent_count(&s->m), s->host_end,
                       i ? s->sb_index : 0, s->end,
                       s->forced ? " (forced)" : "");
    }
    g_assert_cmpuint(w.states->len, >=, 4);
    if (script->truncates) {
        g_assert_cmpuint(count[EXTREE_LOG_TRUNCATE], >, 0);
    }

    for (size_t p = 0; p <= len; p++) {
        verify_image(&w, p, EXTREE_CRASH_KEEP, 0, &cs);
        verify_image(&w, p, EXTREE_CRASH_DROP, 0, &cs);
        for (uint64_t s = 0; s < 4; s++) {
            verify_image(&w, p, EXTREE_CRASH_TEAR, seed + p * 8 + s, &cs);
        }
        for (uint64_t s = 4; s < 6; s++) {
            verify_image(&w, p, EXTREE_CRASH_GARBAGE, seed + p * 8 + s, &cs);
        }
    }
    g_test_message("%" PRIu64 " crash images verified in %.2f s; %" PRIu64
                   " with leaks (%" PRIu64 " leaks, %" PRIu64 " bytes); %"
                   PRIu64 " bitmap granules checked",
                   cs.images, (g_get_monotonic_time() - t0) / 1e6,
                   cs.leaky_images, cs.leaks, cs.leaked_bytes,
                   cs.granules_checked);
    for (guint i = 0; i < MIN(w.states->len, G_N_ELEMENTS(cs.per_state)); i++) {
        g_test_message("  state %u shown by %" PRIu64 " images", i,
                       cs.per_state[i]);
    }
    /* The format promises that a crash never leaks space */
    g_assert_cmpuint(cs.leaky_images, ==, 0);
    wl_free(&w);
}

/*
 * A crash while the image is being created: it either does not open, or
 * opens empty and clean
 */
static void test_create(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    uint64_t opened = 0, refused = 0;
    char *err = NULL;
    size_t len;

    extree_mem_backend_start_recording(be);
    g_assert_cmpint(extree_create(be, &create_params, &err), ==, 0);
    extree_mem_backend_stop_recording(be);
    len = extree_mem_backend_log_length(be);
    for (size_t p = 0; p <= len; p++) {
        for (int mode = EXTREE_CRASH_KEEP; mode <= EXTREE_CRASH_GARBAGE;
             mode++) {
            ExtreeBackend *img = extree_mem_backend_crash_image(be, p, mode,
                                                                p);
            ExtreeOpenOptions o = { 0 };
            ExtreeCheckResult res;
            Model empty;
            Extree *t;
            char *diff;

            err = NULL;
            if (extree_open(img, &o, &t, &err) < 0) {
                g_free(err);
                refused++;
                extree_mem_backend_free(img);
                continue;
            }
            model_init(&empty, VSIZE, BS);
            diff = model_compare_walk(&empty, t, EXTREE_COALESCE_HOST, NULL);
            g_assert_null(diff);
            g_assert_cmpint(extree_check(t, false, &res, report_line, NULL),
                            ==, 0);
            g_assert_cmpuint(res.corruptions, ==, 0);
            g_assert_cmpuint(res.leaks, ==, 0);
            model_destroy(&empty);
            extree_close(t);
            extree_mem_backend_free(img);
            opened++;
        }
    }
    /* The complete log opens in every mode */
    g_assert_cmpuint(opened, >=, 4);
    g_test_message("create: %zu log entries, %" PRIu64 " images opened, %"
                   PRIu64 " refused", len, opened, refused);
    extree_mem_backend_free(be);
}

/* ---- failed I/O during commit ---- */

/*
 * An image with a committed state S0 plus an open handle with uncommitted
 * changes on top, applied identically every time
 */
static Extree *fault_setup(ExtreeBackend *be, Model *s0, Model *s1)
{
    ExtreeOpenOptions o = { 0 };
    Extree *t;
    char *err = NULL;
    uint64_t rng = 42;

    g_assert_cmpint(extree_create(be, &create_params, &err), ==, 0);
    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, 0);
    for (int round = 0; round < 2; round++) {
        Model *m = round ? s1 : s0;
        for (int i = 0; i < 200; i++) {
            uint64_t blk = model_rand_below(&rng, VSIZE / BS - 4);
            uint64_t host, got;

            if (i % 5 == 4) {
                g_assert_cmpint(extree_punch(t, blk * BS, 2 * BS), ==, 0);
                model_set(m, blk, 2, EXTREE_RUN_UNALLOC, 0, 0);
                continue;
            }
            g_assert_cmpint(extree_alloc_data(t, blk * BS, BS, &host, &got),
                            ==, 0);
            g_assert_cmpint(extree_map_data(t, blk * BS, got, host), ==, 0);
            model_set(m, blk, 1, EXTREE_RUN_DATA, host, 0);
        }
        if (round == 0) {
            g_assert_cmpint(extree_commit(t), ==, 0);
            model_copy(s1, s0);
        }
    }
    return t;
}

static void expect_state(ExtreeBackend *be, const Model *m, uint64_t gen,
                         const char *what, unsigned nth)
{
    ExtreeOpenOptions o = { 0 };
    ExtreeCheckResult res;
    Extree *t;
    char *err = NULL, *diff;

    if (extree_open(be, &o, &t, &err) < 0) {
        g_error("%s %u: reopen failed: %s", what, nth, err);
    }
    g_assert_cmpuint(extree_generation(t), ==, gen);
    diff = model_compare_walk(m, t, EXTREE_COALESCE_HOST, NULL);
    if (diff) {
        g_error("%s %u: %s", what, nth, diff);
    }
    g_assert_cmpint(extree_check(t, false, &res, report_line, NULL), ==, 0);
    g_assert_cmpuint(res.corruptions, ==, 0);
    g_assert_cmpuint(res.leaks, ==, 0);
    extree_close(t);
}

static void test_faults(void)
{
    ExtreeBackend *be = extree_mem_backend_new();
    ExtreeMemStats st;
    Model s0, s1;
    Extree *t;
    uint64_t gen0;
    unsigned nwrites, nflushes, retried = 0;

    model_init(&s0, VSIZE, BS);
    model_init(&s1, VSIZE, BS);
    t = fault_setup(be, &s0, &s1);
    gen0 = extree_generation(t);
    /* How many writes and flushes the commit takes */
    extree_mem_backend_reset_stats(be);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_mem_backend_stats(be, &st);
    nwrites = st.writes;
    nflushes = st.flushes;
    extree_close(t);
    extree_mem_backend_free(be);
    g_assert_cmpuint(nwrites, >=, 2);
    g_assert_cmpuint(nflushes, >=, 2);

    for (unsigned kind = 0; kind < 2; kind++) {
        unsigned count = kind ? nflushes : nwrites;
        const char *what = kind ? "failed flush" : "failed write";

        for (unsigned nth = 0; nth < count; nth++) {
            Model m0, m1;
            ExtreeBackend *img;
            int ret;

            be = extree_mem_backend_new();
            model_init(&m0, VSIZE, BS);
            model_init(&m1, VSIZE, BS);
            t = fault_setup(be, &m0, &m1);
            g_assert_true(model_equal(&m0, &s0) && model_equal(&m1, &s1));
            extree_mem_backend_start_recording(be);
            extree_mem_backend_inject_fault(be, kind ? EXTREE_FAULT_FLUSH
                                                     : EXTREE_FAULT_WRITE,
                                            nth, false);
            ret = extree_commit(t);
            if (ret != -EIO) {
                g_error("%s %u of %u: commit returned %d", what, nth, count,
                        ret);
            }
            g_assert_cmpuint(extree_mem_backend_faults(be), ==, 1);

            /* A crash now loses whatever was not flushed: the old state */
            img = extree_mem_backend_crash_image(be,
                    extree_mem_backend_log_length(be), EXTREE_CRASH_DROP, 0);
            expect_state(img, &s0, gen0, what, nth);
            extree_mem_backend_free(img);

            /*
             * Retrying once the device works again either fails or
             * commits the changes
             */
            ret = extree_commit(t);
            extree_close(t);
            if (ret == 0) {
                expect_state(be, &s1, gen0 + 1, what, nth);
                retried++;
            } else if (kind == 1 && nth == count - 1) {
                /*
                 * The superblock write went through, only the flush after
                 * it failed: the device holds the new state
                 */
                expect_state(be, &s1, gen0 + 1, what, nth);
            } else {
                expect_state(be, &s0, gen0, what, nth);
            }
            model_destroy(&m0);
            model_destroy(&m1);
            extree_mem_backend_free(be);
        }
    }
    g_test_message("commit: %u writes, %u flushes; each failure tested, %u"
                   " retried commits succeeded", nwrites, nflushes, retried);
    model_destroy(&s0);
    model_destroy(&s1);
}

/* ---- failed reads ---- */

/*
 * With a cache smaller than the tree, walk the image, make 300 random
 * updates and commit; stop at the first error, which must be -EIO.
 * Returns whether everything (including the commit) succeeded.
 */
static bool read_workload(Extree *t, Model *m, bool *failed)
{
    uint64_t rng = 7;
    ExtreeCursor c;
    ExtreeRun run;
    bool changing = false;      /* the failed call changes the tree */
    int ret = 0;

    extree_cursor_init(&c, t);
    for (uint64_t g = 0; g < VSIZE && ret == 0; g += run.length) {
        ExtreeRun exp;
        ret = extree_cursor_query(&c, g, VSIZE - g, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret == 0) {
            model_run(m, g, VSIZE - g, EXTREE_COALESCE_HOST, &exp);
            g_assert_cmpuint(run.length, ==, exp.length);
            g_assert_cmpuint(run.type, ==, exp.type);
        }
    }
    extree_cursor_release(&c);
    if (ret < 0) {
        /* A failed query changes nothing: the updates still work */
        g_assert_cmpint(ret, ==, -EIO);
        *failed = true;
        ret = 0;
    }
    for (int i = 0; i < 300 && ret == 0; i++) {
        uint64_t blk = model_rand_below(&rng, VSIZE / BS - 4);
        uint64_t n = 1 + model_rand_below(&rng, 4);
        unsigned dice = model_rand_below(&rng, 3);
        uint64_t host, got;

        changing = true;
        if (dice == 0) {
            ret = extree_punch(t, blk * BS, n * BS);
            if (ret == 0) {
                model_set(m, blk, n, EXTREE_RUN_UNALLOC, 0, 0);
            }
        } else if (dice == 1) {
            ret = extree_set_zero(t, blk * BS, n * BS);
            if (ret == 0) {
                model_set(m, blk, n, EXTREE_RUN_ZERO, 0, 0);
            }
        } else {
            changing = false;
            ret = extree_alloc_data(t, blk * BS, n * BS, &host, &got);
            if (ret == 0) {
                changing = true;
                ret = extree_map_data(t, blk * BS, got, host);
            }
            if (ret == 0) {
                model_set(m, blk, got / BS, EXTREE_RUN_DATA, host, 0);
            }
        }
    }
    if (ret < 0) {
        g_assert_cmpint(ret, ==, -EIO);
        *failed = true;
        /*
         * An update that failed may have stopped half-way: the handle
         * must refuse further updates, and commit anything only if
         * nothing was changed yet
         */
        if (!changing) {
            return false;
        }
        g_assert_cmpint(extree_punch(t, 0, BS), ==, -EIO);
        ret = extree_commit(t);
        g_assert_true(ret == -EIO || (ret == 0 && !extree_is_dirty(t)));
        return false;
    }
    ret = extree_commit(t);
    if (ret < 0) {
        g_assert_cmpint(ret, ==, -EIO);
        *failed = true;
    }
    return ret == 0;
}

static void test_read_faults(void)
{
    ExtreeOpenOptions small = { .cache_size = 1 };     /* the minimum */
    ExtreeBackend *base = extree_mem_backend_new();
    ExtreeMemStats st;
    Model s0, m;
    Extree *t;
    char *err = NULL;
    uint64_t rng = 3, reads, gen0, committed = 0, failed_count = 0;
    ExtreeStats ts;

    /* A tree of some 60 leaves, twice the smallest cache */
    model_init(&s0, VSIZE, BS);
    model_init(&m, VSIZE, BS);
    g_assert_cmpint(extree_create(base, &create_params, &err), ==, 0);
    g_assert_cmpint(extree_open(base, &small, &t, &err), ==, 0);
    for (int i = 0; i < 6000; i++) {
        uint64_t blk = model_rand_below(&rng, VSIZE / BS - 1), host, got;
        g_assert_cmpint(extree_alloc_data(t, blk * BS, BS, &host, &got), ==,
                        0);
        g_assert_cmpint(extree_map_data(t, blk * BS, got, host), ==, 0);
        model_set(&s0, blk, 1, EXTREE_RUN_DATA, host, 0);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    gen0 = extree_generation(t);
    extree_close(t);

    /* How many reads the workload does when nothing fails */
    {
        ExtreeBackend *img = extree_mem_backend_clone(base);
        bool failed = false;

        model_copy(&m, &s0);
        g_assert_cmpint(extree_open(img, &small, &t, &err), ==, 0);
        extree_mem_backend_reset_stats(img);
        g_assert_true(read_workload(t, &m, &failed));
        extree_mem_backend_stats(img, &st);
        extree_stats(t, &ts);
        extree_close(t);
        extree_mem_backend_free(img);
        reads = st.reads;
        g_assert_cmpuint(ts.evictions, >, 0);
    }

    for (uint64_t nth = 0; nth < reads; nth++) {
        ExtreeBackend *img = extree_mem_backend_clone(base);
        bool failed = false, ok;
        ExtreeCheckResult res;
        char *diff;

        model_copy(&m, &s0);
        g_assert_cmpint(extree_open(img, &small, &t, &err), ==, 0);
        extree_mem_backend_inject_fault(img, EXTREE_FAULT_READ, nth, false);
        ok = read_workload(t, &m, &failed);
        g_assert_cmpuint(extree_mem_backend_faults(img), ==, 1);
        extree_close(t);

        /* The last commit survives, and nothing is damaged or leaked */
        g_assert_cmpint(extree_open(img, &small, &t, &err), ==, 0);
        g_assert_cmpuint(extree_generation(t), ==, gen0 + ok);
        diff = model_compare_walk(ok ? &m : &s0, t, EXTREE_COALESCE_HOST,
                                  NULL);
        if (diff) {
            g_error("read %" PRIu64 " failed: %s", nth, diff);
        }
        g_assert_cmpint(extree_check(t, false, &res, report_line, NULL), ==,
                        0);
        g_assert_cmpuint(res.corruptions, ==, 0);
        g_assert_cmpuint(res.leaks, ==, 0);
        extree_close(t);
        extree_mem_backend_free(img);
        committed += ok;
        failed_count += failed;
    }
    g_test_message("%" PRIu64 " node reads, each made to fail: %" PRIu64
                   " runs failed with -EIO, %" PRIu64 " still committed "
                   "(the read was retried or not needed)", reads,
                   failed_count, committed);
    model_destroy(&s0);
    model_destroy(&m);
    extree_mem_backend_free(base);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/crash/create", test_create);
    g_test_add_data_func("/crash/enumerate/mixed", &script_mixed,
                         test_enumerate);
    g_test_add_data_func("/crash/enumerate/shrink", &script_shrink,
                         test_enumerate);
    g_test_add_data_func("/crash/enumerate/partial", &script_partial,
                         test_enumerate);
    g_test_add_data_func("/crash/enumerate/bitmaps", &script_bitmaps,
                         test_enumerate);
    g_test_add_func("/crash/faults", test_faults);
    g_test_add_func("/crash/read-faults", test_read_faults);
    return g_test_run();
}
