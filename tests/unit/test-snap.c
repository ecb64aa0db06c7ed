/*
 * Internal snapshots: a model-based randomized test
 *
 * Writes (in place where extree_data_shared() allows it, to new space
 * otherwise), zeroes and punches against a per-block model, interleaved
 * with snapshot create, revert and delete; the model keeps a copy of the
 * map per snapshot.  After every batch: every block of the live image
 * reads back its tag, the checker finds the reference counts exact (no
 * corruption, no leak), and sometimes the image is reopened and each
 * snapshot read through extree_snapshot_load_tmp() on a read-only handle.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"
#include "model.h"

#define BS          4096
#define NS          4096        /* small nodes: deep trees, much sharing */
#define NBLOCKS     1536
#define VSIZE       ((uint64_t)NBLOCKS * BS)

enum { TAG_HOLE = 0, TAG_ZERO = 1 };    /* data tags start at 2 */

typedef struct Snap {
    char id[16];
    uint32_t *tags;
} Snap;

typedef struct Ctx {
    ExtreeBackend *be;
    Extree *t;
    uint32_t *tags;             /* live image, per block */
    GArray *snaps;              /* Snap */
    uint32_t next_tag;
    uint64_t rng;
    uint8_t *buf;
    uint64_t in_place, copied;
    bool always_new;            /* never in place (the crash test) */
} Ctx;

static void fill(uint8_t *buf, uint32_t tag, uint64_t blk)
{
    for (int i = 0; i < BS; i += 8) {
        uint64_t v = ((uint64_t)tag << 32) | (blk ^ i);
        memcpy(buf + i, &v, 8);
    }
}

/* Write blocks [blk, blk + n) with fresh tags, as the QEMU driver would */
static void do_write(Ctx *c, uint64_t blk, uint64_t n)
{
    uint64_t guest = blk * BS, end = (blk + n) * BS;
    ExtreeCursor cur;

    extree_cursor_init(&cur, c->t);
    while (guest < end) {
        ExtreeRun run;
        uint64_t b = guest / BS, len;
        bool shared = true;

        g_assert_cmpint(extree_cursor_query(&cur, guest, end - guest,
                                            EXTREE_COALESCE_HOST, &run), ==,
                        0);
        len = run.length;
        if (run.type == EXTREE_RUN_DATA) {
            g_assert_cmpint(extree_data_shared(c->t, guest, len, run.host,
                                               &shared), ==, 0);
        }
        if (run.type == EXTREE_RUN_DATA && !shared && !c->always_new) {
            for (uint64_t k = 0; k < len / BS; k++) {
                uint32_t tag = c->next_tag++;
                fill(c->buf, tag, b + k);
                g_assert_cmpint(c->be->ops->pwrite(c->be->opaque,
                                                   run.host + k * BS, c->buf,
                                                   BS), ==, 0);
                c->tags[b + k] = tag;
            }
            c->in_place += len / BS;
        } else {
            uint64_t host, got;

            g_assert_cmpint(extree_alloc_data(c->t, guest, len, &host, &got),
                            ==, 0);
            for (uint64_t k = 0; k < got / BS; k++) {
                uint32_t tag = c->next_tag++;
                fill(c->buf, tag, b + k);
                g_assert_cmpint(c->be->ops->pwrite(c->be->opaque,
                                                   host + k * BS, c->buf, BS),
                                ==, 0);
                c->tags[b + k] = tag;
            }
            g_assert_cmpint(extree_map_data(c->t, guest, got, host), ==, 0);
            extree_cursor_release(&cur);
            extree_cursor_init(&cur, c->t);
            c->copied += got / BS;
            len = got;
        }
        guest += len;
    }
    extree_cursor_release(&cur);
}

/* Every block of @t reads as @tags says */
static void verify(Extree *t, ExtreeBackend *be, const uint32_t *tags,
                   uint8_t *buf)
{
    uint8_t *want = g_malloc(BS);
    ExtreeCursor cur;

    extree_cursor_init(&cur, t);
    for (uint64_t b = 0; b < extree_virtual_size(t) / BS; b++) {
        ExtreeRun run;

        g_assert_cmpint(extree_cursor_query(&cur, b * BS, BS,
                                            EXTREE_COALESCE_HOST, &run), ==,
                        0);
        switch (tags[b]) {
        case TAG_HOLE:
            g_assert_cmpint(run.type, ==, EXTREE_RUN_UNALLOC);
            break;
        case TAG_ZERO:
            g_assert_cmpint(run.type, ==, EXTREE_RUN_ZERO);
            break;
        default:
            g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
            g_assert_cmpint(be->ops->pread(be->opaque, run.host, buf, BS), ==,
                            0);
            fill(want, tags[b], b);
            if (memcmp(buf, want, BS)) {
                g_error("block %" PRIu64 ": want tag %u, host 0x%" PRIx64
                        " holds another", b, tags[b], run.host);
            }
        }
    }
    extree_cursor_release(&cur);
    g_free(want);
}

static void verify_snapshots(Ctx *c)
{
    g_assert_cmpint(extree_commit(c->t), ==, 0);
    for (guint i = 0; i < c->snaps->len; i++) {
        Snap *s = &g_array_index(c->snaps, Snap, i);
        Extree *ro = ct_open_opts(c->be, true, 0, 0);
        int idx = extree_snapshot_find(ro, s->id);

        g_assert_cmpint(idx, >=, 0);
        g_assert_cmpint(extree_snapshot_load_tmp(ro, idx), ==, 0);
        verify(ro, c->be, s->tags, c->buf);
        extree_close(ro);
    }
}

static void snap_create(Ctx *c)
{
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    Snap s;

    g_strlcpy(info.name, "model", sizeof(info.name));
    g_assert_cmpint(extree_snapshot_create(c->t, &info), ==, 0);
    g_assert_cmpuint(info.extent_count, ==, extree_extent_count(c->t));
    g_strlcpy(s.id, info.id, sizeof(s.id));
    s.tags = g_memdup2(c->tags, NBLOCKS * sizeof(uint32_t));
    g_array_append_val(c->snaps, s);
    /* taking a snapshot leaves nothing dirty */
    g_assert_false(extree_is_dirty(c->t));
}

static void snap_goto(Ctx *c, guint i)
{
    Snap *s = &g_array_index(c->snaps, Snap, i);
    int idx = extree_snapshot_find(c->t, s->id);

    g_assert_cmpint(idx, >=, 0);
    g_assert_cmpint(extree_snapshot_goto(c->t, idx), ==, 0);
    memcpy(c->tags, s->tags, NBLOCKS * sizeof(uint32_t));
}

static void snap_delete(Ctx *c, guint i)
{
    Snap *s = &g_array_index(c->snaps, Snap, i);
    int idx = extree_snapshot_find(c->t, s->id);

    g_assert_cmpint(idx, >=, 0);
    g_assert_cmpint(extree_snapshot_delete(c->t, idx), ==, 0);
    g_free(s->tags);
    g_array_remove_index(c->snaps, i);
}

static void test_random(void)
{
    uint64_t seed = test_seed("test-snap", 0x5eed5a9);
    Ctx c = { 0 };

    c.be = ct_create(VSIZE, BS, NS);
    c.t = ct_open(c.be);
    c.tags = g_new0(uint32_t, NBLOCKS);
    c.snaps = g_array_new(false, false, sizeof(Snap));
    c.next_tag = 2;
    c.rng = seed;
    c.buf = g_malloc(BS);

    /* a fragmented start: many extents, a tree of several levels */
    for (uint64_t b = 0; b < NBLOCKS; b += 2) {
        do_write(&c, b, 1);
    }
    for (int round = 0; round < 60; round++) {
        for (int op = 0; op < 40; op++) {
            uint64_t r = model_rand(&c.rng);
            uint64_t blk = r % NBLOCKS;
            uint64_t n = 1 + (r >> 16) % 24;

            n = MIN(n, NBLOCKS - blk);
            switch ((r >> 32) % 10) {
            case 0:
                if (extree_set_zero(c.t, blk * BS, n * BS) < 0) {
                    g_error("set_zero: %s", extree_last_error(c.t));
                }
                for (uint64_t k = 0; k < n; k++) {
                    c.tags[blk + k] = TAG_ZERO;
                }
                break;
            case 1:
                g_assert_cmpint(extree_punch(c.t, blk * BS, n * BS), ==, 0);
                for (uint64_t k = 0; k < n; k++) {
                    c.tags[blk + k] = TAG_HOLE;
                }
                break;
            default:
                do_write(&c, blk, n);
            }
        }
        switch (model_rand(&c.rng) % 6) {
        case 0:
        case 1:
            if (c.snaps->len < 6) {
                snap_create(&c);
            }
            break;
        case 2:
            if (c.snaps->len) {
                snap_goto(&c, model_rand(&c.rng) % c.snaps->len);
            }
            break;
        case 3:
            if (c.snaps->len) {
                snap_delete(&c, model_rand(&c.rng) % c.snaps->len);
            }
            break;
        default:
            g_assert_cmpint(extree_commit(c.t), ==, 0);
        }
        verify(c.t, c.be, c.tags, c.buf);
        ct_check_clean(c.t, NULL);
        if (round % 10 == 9) {
            extree_close(c.t);
            verify_snapshots(&(Ctx){ .be = c.be, .snaps = c.snaps,
                                     .buf = c.buf,
                                     .t = ct_open(c.be) });
            c.t = ct_open(c.be);
            verify(c.t, c.be, c.tags, c.buf);
        }
    }
    /* every snapshot gone: every shared block back to one reference */
    while (c.snaps->len) {
        snap_delete(&c, 0);
    }
    g_assert_cmpuint(g_tree_nnodes(c.t->space.refs), ==, 0);
    ct_check_clean(c.t, NULL);
    verify(c.t, c.be, c.tags, c.buf);
    g_test_message("%" PRIu64 " blocks written in place, %" PRIu64
                   " to new space", c.in_place, c.copied);
    g_assert_cmpuint(c.in_place, >, 0);
    g_assert_cmpuint(c.copied, >, 0);

    extree_close(c.t);
    extree_mem_backend_free(c.be);
    g_free(c.tags);
    g_free(c.buf);
    g_array_free(c.snaps, true);
}

/* Taking a snapshot writes O(1) metadata, whatever the image's size */
static void test_create_constant(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeStats before, after;

    for (uint64_t b = 0; b < NBLOCKS; b += 2) {
        ct_write(t, b * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), >=, 2);
    extree_stats(t, &before);
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    extree_stats(t, &after);
    g_assert_cmpstr(info.id, ==, "1");
    /* the reference count tree's root, the free tree's path: a handful */
    g_assert_cmpuint(after.nodes_written - before.nodes_written, <=, 8);
    g_assert_cmpuint(after.cows - before.cows, <=, 8);
    ct_check_clean(t, NULL);
    /* the first write under a shared root copies one path, not more */
    extree_stats(t, &before);
    ct_write(t, 1 * BS, BS);
    extree_stats(t, &after);
    g_assert_cmpuint(after.cows - before.cows, <=, extree_depth(t) + 4);
    /*
     * then each leaf it reaches first costs one copy, the leaf's: the
     * extents are at the even blocks, 126 to a full leaf of 4 KiB, so
     * these writes into odd blocks land in leaves 1, 2, ... under a root
     * already copied
     */
    for (uint64_t b = 253; b < NBLOCKS; b += 252) {
        extree_stats(t, &before);
        ct_write(t, b * BS, BS);
        extree_stats(t, &after);
        g_assert_cmpuint(after.cows - before.cows, ==, 1);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    ct_check_clean(t, NULL);
    /* duplicate id, unknown snapshot */
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, -EEXIST);
    g_assert_cmpint(extree_snapshot_find(t, "nosuch"), ==, -ENOENT);
    g_assert_cmpint(extree_snapshot_delete(t, 5), ==, -ENOENT);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A committed state of the crash workload */
typedef struct CrashState {
    uint64_t gen;
    uint32_t *tags;
    unsigned nsnaps;
} CrashState;

static void crash_state(Ctx *c, GArray *states)
{
    CrashState cs = { extree_generation(c->t),
                      g_memdup2(c->tags, NBLOCKS * sizeof(uint32_t)),
                      extree_snapshot_count(c->t) };

    g_assert_false(extree_is_dirty(c->t));
    g_array_append_val(states, cs);
}

/*
 * Crash at every point of a workload that takes, reverts to and deletes
 * snapshots: every crash image opens at a committed state, reads as that
 * state, has its snapshots, and checks clean with exact reference counts
 * and no leak.  Writes go to new space only, so a state's data is all in
 * its own generation.
 */
static void test_crash(void)
{
    uint64_t seed = test_seed("test-snap crash", 0xc4a5);
    GArray *states = g_array_new(false, false, sizeof(CrashState));
    uint64_t images = 0;
    Ctx c = { 0 };
    size_t len;

    c.be = ct_create(256 * BS, BS, NS);
    c.t = ct_open(c.be);
    c.tags = g_new0(uint32_t, NBLOCKS);
    c.snaps = g_array_new(false, false, sizeof(Snap));
    c.next_tag = 2;
    c.rng = seed;
    c.buf = g_malloc(BS);
    c.always_new = true;
    for (uint64_t b = 0; b < 256; b += 2) {
        do_write(&c, b, 1);
    }
    g_assert_cmpint(extree_commit(c.t), ==, 0);
    crash_state(&c, states);
    extree_mem_backend_start_recording(c.be);
    for (int step = 0; step < 12; step++) {
        for (int k = 0; k < 6; k++) {
            uint64_t r = model_rand(&c.rng);
            do_write(&c, r % 250, 1 + (r >> 20) % 6);
        }
        g_assert_cmpint(extree_commit(c.t), ==, 0);
        crash_state(&c, states);
        switch (step % 4) {
        case 0:
        case 1:
            snap_create(&c);
            break;
        case 2:
            snap_goto(&c, 0);
            break;
        default:
            snap_delete(&c, c.snaps->len - 1);
        }
        crash_state(&c, states);
    }
    extree_mem_backend_stop_recording(c.be);
    len = extree_mem_backend_log_length(c.be);
    for (size_t p = 0; p <= len; p++) {
        for (int mode = EXTREE_CRASH_KEEP; mode <= EXTREE_CRASH_DROP;
             mode++) {
            ExtreeBackend *img = extree_mem_backend_crash_image(c.be, p, mode,
                                                                seed + p);
            Extree *t = ct_open(img);
            CrashState *st = NULL;
            uint32_t *live;

            for (guint i = 0; i < states->len; i++) {
                CrashState *x = &g_array_index(states, CrashState, i);
                if (x->gen == extree_generation(t)) {
                    st = x;
                }
            }
            if (!st) {
                g_error("prefix %zu: generation %" PRIu64 " was never "
                        "committed", p, extree_generation(t));
            }
            g_assert_cmpuint(extree_snapshot_count(t), ==, st->nsnaps);
            live = g_new0(uint32_t, NBLOCKS);
            memcpy(live, st->tags, NBLOCKS * sizeof(uint32_t));
            verify(t, img, live, c.buf);
            ct_check_clean(t, NULL);
            g_free(live);
            extree_close(t);
            extree_mem_backend_free(img);
            images++;
        }
    }
    g_test_message("%" PRIu64 " crash images of %zu log entries, %u states",
                   images, len, states->len);
    for (guint i = 0; i < states->len; i++) {
        g_free(g_array_index(states, CrashState, i).tags);
    }
    g_array_free(states, true);
    while (c.snaps->len) {
        snap_delete(&c, 0);
    }
    extree_close(c.t);
    extree_mem_backend_free(c.be);
    g_free(c.tags);
    g_free(c.buf);
    g_array_free(c.snaps, true);
}

/*
 * VM state: written at unaligned offsets, kept by the snapshot taken
 * next, gone from the live image, back after a revert
 */
static void test_vmstate(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    size_t len = 3 * BS + 1234;
    uint8_t *state = g_malloc(len), *back = g_malloc(len);
    uint64_t seed = 7;

    for (size_t i = 0; i < len; i++) {
        state[i] = model_rand(&seed);
    }
    ct_write(t, 0, 4 * BS);
    /* as migration writes it: pieces, not aligned to blocks */
    g_assert_cmpint(extree_vmstate_write(t, 0, state, 100), ==, 0);
    g_assert_cmpint(extree_vmstate_write(t, 100, state + 100, BS), ==, 0);
    g_assert_cmpint(extree_vmstate_write(t, 100 + BS, state + 100 + BS,
                                         len - 100 - BS), ==, 0);
    g_assert_cmpint(extree_vmstate_read(t, 0, back, len), ==, 0);
    g_assert_cmpmem(back, len, state, len);
    info.vm_state_size = len;
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    /* the live image no longer holds it */
    g_assert_cmpint(extree_vmstate_read(t, 0, back, len), ==, 0);
    for (size_t i = 0; i < len; i++) {
        g_assert_cmpint(back[i], ==, 0);
    }
    ct_write(t, 0, 2 * BS);
    ct_check_clean(t, NULL);
    extree_close(t);
    t = ct_open(be);
    g_assert_cmpint(extree_snapshot_goto(t, 0), ==, 0);
    g_assert_cmpint(extree_vmstate_read(t, 0, back, len), ==, 0);
    g_assert_cmpmem(back, len, state, len);
    ct_check_clean(t, NULL);
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, 0);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
    g_free(state);
    g_free(back);
}

/* Check the image of @be, repairing with @fix; returns the result */
static ExtreeCheckResult check_fix(ExtreeBackend *be, unsigned fix,
                                  const char *want_msg)
{
    ExtreeOpenOptions o = { .repair = true, .check = true };
    CtReport r = { g_ptr_array_new_with_free_func(g_free) };
    ExtreeCheckResult res;
    Extree *t;
    char *err = NULL;

    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, 0);
    g_assert_cmpint(extree_check_fix(t, fix, &res, ct_report, &r), ==, 0);
    if (want_msg && !ct_has_msg(&r, want_msg)) {
        g_error("check did not say '%s'", want_msg);
    }
    g_ptr_array_free(r.msgs, true);
    extree_close(t);
    return res;
}

/*
 * Counts recorded too high leak references (-r leaks repairs them); too
 * low is corruption (a block in use could be freed; -r all repairs it)
 */
static void test_check_counts(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeCheckResult res;
    ExtreeRun run;
    int n;

    for (uint64_t b = 0; b < NBLOCKS; b += 2) {
        ct_write(t, b * BS, BS);
    }
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    ct_write(t, 0, BS);         /* copies a path: DATA counts of 2 */
    g_assert_cmpint(extree_lookup(t, 2 * BS, BS, &run, 1, &n), ==, 0);
    g_assert_cmpint(run.type, ==, EXTREE_RUN_DATA);
    g_assert_cmpuint(extree_refs_max(t, run.host, BS), ==, 2);

    /* one too many */
    g_assert_cmpint(extree_refs_set(t, run.host, BS, 3), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    res = check_fix(be, 0, "leaked references");
    g_assert_cmpuint(res.leaks, ==, 1);
    g_assert_cmpuint(res.corruptions, ==, 0);
    res = check_fix(be, EXTREE_FIX_LEAKS, "leaked references");
    g_assert_cmpuint(res.repaired_leaks, ==, 1);
    res = check_fix(be, 0, NULL);
    g_assert_cmpuint(res.leaks + res.corruptions, ==, 0);

    /* one too few */
    t = ct_open(be);
    g_assert_cmpint(extree_refs_set(t, run.host, BS, 1), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    res = check_fix(be, EXTREE_FIX_LEAKS, "corrupt reference count tree");
    g_assert_cmpuint(res.corruptions, ==, 1);
    g_assert_cmpuint(res.repaired_corruptions, ==, 0);
    res = check_fix(be, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                    "corrupt reference count tree");
    g_assert_cmpuint(res.repaired_corruptions, ==, 1);
    res = check_fix(be, 0, NULL);
    g_assert_cmpuint(res.leaks + res.corruptions, ==, 0);
    extree_mem_backend_free(be);
}

/*
 * A root node whose count is below the number of trees naming it: a write
 * would free it under the snapshot.  Read-write open refuses, read-only
 * open reads, the checker reports and -r all repairs.
 */
static void test_root_count(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    ExtreeOpenOptions rw = { 0 };
    ExtreeCheckResult res;
    char *err = NULL;
    uint64_t root;

    ct_write(t, 0, 4 * BS);
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    root = t->trees[EXTREE_TREE_EXTENT].root;
    g_assert_cmpuint(extree_refs_max(t, root, NS), ==, 2);
    g_assert_cmpint(extree_refs_set(t, root, NS, 1), ==, 0);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);

    g_assert_cmpint(extree_open(be, &rw, &t, &err), ==, -EIO);
    g_assert_nonnull(strstr(err, "has 1 references, 2 trees name it"));
    g_free(err);
    t = ct_open_opts(be, true, 0, 0);
    extree_close(t);
    res = check_fix(be, EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS,
                    "corrupt reference count tree");
    g_assert_cmpuint(res.repaired_corruptions, ==, res.corruptions);
    res = check_fix(be, 0, NULL);
    g_assert_cmpuint(res.leaks + res.corruptions, ==, 0);
    t = ct_open(be);
    extree_close(t);
    extree_mem_backend_free(be);
}

/*
 * The space map's counts directly: ranges split and merged as counts go
 * up and down, the last reference frees (pending until commit), counts
 * survive a commit and reopen through the reference count tree
 */
static void test_space_map(void)
{
    ExtreeBackend *be = ct_create(VSIZE, BS, NS);
    Extree *t = ct_open(be);
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    const ExtreeSpaceMapOps *sm;
    uint64_t host, got, free0;
    uint32_t c;

    /* 16 blocks of DATA, then snapshots on (an empty table entry) */
    g_assert_cmpint(extree_alloc_data(t, 0, 16 * BS, &host, &got), ==, 0);
    g_assert_cmpuint(got, ==, 16 * BS);
    g_assert_cmpint(extree_map_data(t, 0, 16 * BS, host), ==, 0);
    g_assert_cmpint(extree_snapshot_create(t, &info), ==, 0);
    sm = t->sm.ops;

    /* [4, 12) + 1, then [8, 16) + 1: counts 1 2 3 2 by quarter... */
    g_assert_cmpint(sm->inc_ref(t->sm.opaque, host + 4 * BS, 8 * BS), ==, 0);
    g_assert_cmpint(sm->inc_ref(t->sm.opaque, host + 8 * BS, 8 * BS), ==, 0);
    for (int b = 0; b < 16; b++) {
        uint32_t want = 1 + (b >= 4 && b < 12) + (b >= 8);
        g_assert_cmpint(sm->ref_count(t->sm.opaque, host + b * BS, &c), ==, 0);
        g_assert_cmpuint(c, ==, want);
    }
    g_assert_cmpuint(extree_refs_max(t, host, 16 * BS), ==, 3);
    /* ... three ranges of 2, 3, 2, and the shared root node */
    g_assert_cmpuint(g_tree_nnodes(t->space.refs), ==, 4);
    /* survives commit and reopen */
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_close(t);
    t = ct_open(be);
    sm = t->sm.ops;
    g_assert_cmpuint(g_tree_nnodes(t->space.refs), ==, 4);
    g_assert_cmpuint(t->trees[EXTREE_TREE_REFS].nitems, ==, 4);
    for (int b = 0; b < 16; b++) {
        uint32_t want = 1 + (b >= 4 && b < 12) + (b >= 8);
        g_assert_cmpint(sm->ref_count(t->sm.opaque, host + b * BS, &c), ==, 0);
        g_assert_cmpuint(c, ==, want);
    }
    /* back down: equal neighbours merge again */
    g_assert_cmpint(sm->dec_ref(t->sm.opaque, host + 8 * BS, 4 * BS, false),
                    ==, 0);
    /* [4, 16) of 2 is one range again, and the root */
    g_assert_cmpuint(g_tree_nnodes(t->space.refs), ==, 2);
    g_assert_cmpint(sm->dec_ref(t->sm.opaque, host + 4 * BS, 12 * BS, false),
                    ==, 0);
    g_assert_cmpuint(g_tree_nnodes(t->space.refs), ==, 1);
    /*
     * the last reference frees (pending, not allocatable before commit):
     * once the snapshot is gone, nothing shares the data
     */
    g_assert_cmpint(extree_snapshot_delete(t, 0), ==, 0);
    g_assert_cmpuint(g_tree_nnodes(t->space.refs), ==, 0);
    free0 = extree_free_bytes(t);
    g_assert_cmpint(extree_punch(t, 0, 2 * BS), ==, 0);
    g_assert_cmpuint(extree_free_bytes(t), ==, free0 + 2 * BS);
    g_assert_cmpint(sm->ref_count(t->sm.opaque, host, &c), ==, 0);
    g_assert_cmpuint(c, ==, 0);
    /* a reference to free space is refused as corruption */
    g_assert_cmpint(sm->inc_ref(t->sm.opaque, host, BS), ==, -EIO);
    extree_close(t);
    t = ct_open(be);
    /* the failed update left nothing behind: the committed state checks */
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* A node image of @level at @off holding the key pointers @kp[0..n) */
static void craft_interior(ExtreeBackend *be, uint64_t off, uint64_t gen,
                           unsigned level, const ExtreeKeyPtr *kp, int n)
{
    uint8_t *buf = g_malloc0(NS);
    ExtreeNode view = { .buf = buf };

    ext_st32(buf + EXT_NH_MAGIC, EXTREE_NODE_MAGIC);
    ext_st64(buf + EXT_NH_BYTENR, off);
    ext_st64(buf + EXT_NH_GEN, gen);
    ext_st32(buf + EXT_NH_OWNER, EXTREE_TREE_EXTENT);
    buf[EXT_NH_LEVEL] = level;
    for (int i = 0; i < n; i++) {
        ptr_set(&view, i, &kp[i]);
    }
    node_set_nritems(&view, n);
    ct_node_write(be, off, buf, NS, true);
    g_free(buf);
}

/*
 * A root collapsing onto a shared node of one child (issue 37, 5).  Our
 * writer merges such interior nodes away, another may not: the image is
 * made by hand, a root over two interior nodes of one leaf each.  The
 * snapshot shares it all; punching the first leaf's range empties the
 * live tree's copy of the left interior node, the root is left with one
 * child and collapses through the shared right one down to its leaf.  The
 * leaf must gain the reference the live root now holds: else a write
 * frees it under the snapshot.
 */
static void test_collapse_shared(void)
{
    Ctx c = { 0 };
    ExtreeDiskSuper sb;
    ExtreeKeyPtr kp[2], top[2];
    ExtreeNode view;
    uint64_t root, gen, end, a, b;
    uint8_t *buf;
    int slot;

    c.be = ct_create(VSIZE, BS, NS);
    c.t = ct_open(c.be);
    c.tags = g_new0(uint32_t, NBLOCKS);
    c.snaps = g_array_new(false, false, sizeof(Snap));
    c.next_tag = 2;
    c.buf = g_malloc(BS);
    /* 200 extents: a root over two leaves of 126 and 74 items */
    for (uint64_t blk = 0; blk < 400; blk += 2) {
        do_write(&c, blk, 1);
    }
    g_assert_cmpint(extree_commit(c.t), ==, 0);
    g_assert_cmpuint(extree_depth(c.t), ==, 2);
    extree_close(c.t);

    /* the root becomes level 2 over two new nodes of one pointer each */
    slot = ct_read_super(c.be, &sb);
    root = GUINT64_FROM_LE(sb.extent_root.bytenr);
    gen = GUINT64_FROM_LE(sb.generation);
    end = GUINT64_FROM_LE(sb.host_end);
    buf = ct_node_read(c.be, root, NS);
    view.buf = buf;
    g_assert_cmpuint(node_nritems(&view), ==, 2);
    ptr_get(&view, 0, &kp[0]);
    ptr_get(&view, 1, &kp[1]);
    g_free(buf);
    a = end;
    b = end + NS;
    craft_interior(c.be, a, gen, 1, &kp[0], 1);
    craft_interior(c.be, b, gen, 1, &kp[1], 1);
    top[0] = (ExtreeKeyPtr){ kp[0].key, a, gen, kp[0].bytes };
    top[1] = (ExtreeKeyPtr){ kp[1].key, b, gen, kp[1].bytes };
    craft_interior(c.be, root, gen, 2, top, 2);
    sb.extent_root.generation = GUINT64_TO_LE(gen);
    sb.extent_root.level = 2;
    sb.host_end = GUINT64_TO_LE(end + 2 * NS);
    ct_write_super(c.be, slot, &sb);

    c.t = ct_open(c.be);
    g_assert_cmpuint(extree_depth(c.t), ==, 3);
    ct_check_clean(c.t, NULL);
    verify(c.t, c.be, c.tags, c.buf);
    snap_create(&c);

    /* the left leaf's range goes: the root collapses to the right leaf */
    g_assert_cmpint(extree_punch(c.t, 0, kp[1].key), ==, 0);
    for (uint64_t blk = 0; blk < kp[1].key / BS; blk++) {
        c.tags[blk] = TAG_HOLE;
    }
    g_assert_cmpuint(extree_depth(c.t), ==, 1);
    g_assert_cmpuint(c.t->trees[EXTREE_TREE_EXTENT].root, ==, kp[1].child);
    /* the live root and the snapshot's right node both name the leaf */
    g_assert_cmpuint(extree_refs_max(c.t, kp[1].child, NS), ==, 2);
    g_assert_cmpuint(extree_refs_max(c.t, b, NS), ==, 1);
    ct_check_clean(c.t, NULL);

    /*
     * writes into the leaf copy it, the snapshot keeps it; node space
     * freed by each commit is reused by the next
     */
    for (int round = 0; round < 4; round++) {
        for (uint64_t blk = kp[1].key / BS + round; blk < 400; blk += 8) {
            do_write(&c, blk, 1);
        }
        g_assert_cmpint(extree_commit(c.t), ==, 0);
        verify(c.t, c.be, c.tags, c.buf);
        ct_check_clean(c.t, NULL);
    }
    extree_close(c.t);
    c.t = ct_open(c.be);
    verify_snapshots(&c);
    ct_check_clean(c.t, NULL);
    snap_delete(&c, 0);
    g_assert_cmpuint(g_tree_nnodes(c.t->space.refs), ==, 0);
    ct_check_clean(c.t, NULL);
    verify(c.t, c.be, c.tags, c.buf);

    extree_close(c.t);
    extree_mem_backend_free(c.be);
    g_free(c.tags);
    g_free(c.buf);
    g_array_free(c.snaps, true);
}

/*
 * Taking a snapshot succeeds once its commit has (issue 37, 7): the live
 * tree letting go of the VM state afterwards is a transaction of its own,
 * and its failure must not report the snapshot as not taken.  Each write,
 * then each flush, of the operation fails in turn; the answer must agree
 * with the committed generation and with the image reopened.
 */
static void test_vmstate_drop_fails(void)
{
    size_t len = 3 * BS + 1234;
    uint8_t *state = g_malloc(len), *back = g_malloc(len);
    uint64_t seed = 11;

    for (size_t i = 0; i < len; i++) {
        state[i] = model_rand(&seed);
    }
    for (int kind = 0; kind < 2; kind++) {
        unsigned mask = kind ? EXTREE_FAULT_FLUSH : EXTREE_FAULT_WRITE;
        unsigned after = 0;     /* faults that hit the drop */
        bool done = false;

        for (uint64_t nth = 0; !done; nth++) {
            ExtreeBackend *be = ct_create(VSIZE, BS, NS);
            Extree *t = ct_open(be), *ro;
            ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
            uint64_t gen;
            bool taken;
            int ret;

            ct_write(t, 0, 4 * BS);
            g_assert_cmpint(extree_vmstate_write(t, 0, state, len), ==, 0);
            g_assert_cmpint(extree_commit(t), ==, 0);
            gen = extree_generation(t);
            info.vm_state_size = len;
            extree_mem_backend_inject_fault(be, mask, nth, false);
            ret = extree_snapshot_create(t, &info);
            done = extree_mem_backend_faults(be) == 0;
            extree_mem_backend_inject_fault(be, 0, 0, false);
            taken = extree_generation(t) > gen;
            if (g_test_verbose()) {
                g_printerr("%s fault %" PRIu64 ": create %d, generation "
                           "%" PRIu64 " -> %" PRIu64 "\n",
                           kind ? "flush" : "write", nth, ret, gen,
                           extree_generation(t));
            }
            g_assert_cmpint(ret, ==, taken ? 0 : -EIO);
            if (taken && !done) {
                after++;
                /*
                 * a failed write leaves the drop pending for the next
                 * commit; a failed flush leaves the handle broken
                 */
                g_assert_cmpint(extree_commit(t), ==, kind ? -EIO : 0);
            }
            extree_close(t);

            t = ct_open(be);
            if (!kind) {
                g_assert_cmpuint(extree_snapshot_count(t), ==, taken);
                g_assert_cmpint(extree_vmstate_read(t, 0, back, len), ==, 0);
                for (size_t i = 0; i < len; i++) {
                    g_assert_cmpint(back[i], ==, taken ? 0 : state[i]);
                }
            } else if (taken) {
                g_assert_cmpuint(extree_snapshot_count(t), ==, 1);
            }
            ct_check_clean(t, NULL);
            extree_close(t);
            if (taken) {
                ro = ct_open_opts(be, true, 0, 0);
                g_assert_cmpint(extree_snapshot_load_tmp(ro, 0), ==, 0);
                g_assert_cmpint(extree_vmstate_read(ro, 0, back, len), ==,
                                0);
                g_assert_cmpmem(back, len, state, len);
                extree_close(ro);
            }
            extree_mem_backend_free(be);
        }
        g_assert_cmpuint(after, >, 0);
    }
    g_free(state);
    g_free(back);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/snap/space-map", test_space_map);
    g_test_add_func("/snap/create-constant", test_create_constant);
    g_test_add_func("/snap/random", test_random);
    g_test_add_func("/snap/crash", test_crash);
    g_test_add_func("/snap/vmstate", test_vmstate);
    g_test_add_func("/snap/check-counts", test_check_counts);
    g_test_add_func("/snap/root-count", test_root_count);
    g_test_add_func("/snap/collapse-shared", test_collapse_shared);
    g_test_add_func("/snap/vmstate-drop-fails", test_vmstate_drop_fails);
    return g_test_run();
}
