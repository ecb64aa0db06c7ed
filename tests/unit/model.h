/*
 * Reference model of an extree mapping for the randomized and crash tests
 *
 * One entry per guest block: simple enough to be obviously right, which is
 * the point.  Runs are derived from it with the same coalescing rules the
 * cursor promises.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef TESTS_UNIT_MODEL_H
#define TESTS_UNIT_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "extree.h"
#include "extree-backend.h"

typedef struct ModelBlock {
    uint64_t host;              /* DATA: host offset of this block */
    uint32_t type;              /* ExtreeRunType */
    uint32_t tag;               /* free for the test (data version) */
} ModelBlock;

typedef struct Model {
    uint64_t virtual_size;
    uint32_t block_size;
    uint64_t nblocks;           /* DIV_ROUND_UP(virtual_size, block_size) */
    ModelBlock *b;
} Model;

void model_init(Model *m, uint64_t virtual_size, uint32_t block_size);
void model_destroy(Model *m);
/* @dst must be initialised with the same geometry */
void model_copy(Model *dst, const Model *src);
bool model_equal(const Model *a, const Model *b);

/*
 * Set blocks [blk, blk + n): DATA at consecutive host blocks from @host,
 * or ZERO / UNALLOC (host ignored)
 */
void model_set(Model *m, uint64_t blk, uint64_t n, ExtreeRunType type,
               uint64_t host, uint32_t tag);

/*
 * The run extree_cursor_query(guest, max_bytes, coalesce) must return.
 * O(run length), bounded by max_bytes.
 */
void model_run(const Model *m, uint64_t guest, uint64_t max_bytes,
               int coalesce, ExtreeRun *run);

/*
 * Items the extent tree must hold: maximal DATA (host-contiguous) and ZERO
 * runs.  O(blocks).
 */
uint64_t model_extent_count(const Model *m);
/* Items that start in blocks [blk, end) */
uint64_t model_extent_starts(const Model *m, uint64_t blk, uint64_t end);
uint64_t model_data_blocks(const Model *m);

/*
 * Walk the whole image with one cursor and compare every run with the
 * model.  Returns NULL if equal, else a g_malloc'd description of the first
 * difference.  *@nruns (may be NULL) gets the number of runs.
 */
char *model_compare_walk(const Model *m, Extree *t, int coalesce,
                         uint64_t *nruns);

/* Compare the runs covering [guest, guest + bytes) with @c */
char *model_compare_range(const Model *m, ExtreeCursor *c, uint64_t guest,
                          uint64_t bytes, int coalesce);

/*
 * What block @i reads as, for the bitmap checks: 0 for zeroes, else its
 * data's tag (the test gives each write its own)
 */
static inline uint32_t model_content(const Model *m, uint64_t i)
{
    return m->b[i].type == EXTREE_RUN_DATA ? m->b[i].tag : 0;
}

/*
 * The QEMU driver's way to write guest [guest, + bytes) of @run (DATA)
 * in place where extree_in_place() refused it only because the committed
 * bitmaps lack its granules (spec: Mark log): a record from
 * extree_mark_log_append(), written where it says through @be, a flush,
 * extree_mark_log_durable(); extree_in_place() must allow the range then.
 * 0: the caller writes the data in place; -ENOSPC: no log wanted or no
 * room (the write goes to new space); -EPROTO: still not in place.
 */
int model_mark_log_write(Extree *t, ExtreeBackend *be, const ExtreeRun *run,
                         uint64_t guest, uint64_t bytes);

/* Small deterministic PRNG (splitmix64) */
static inline uint64_t model_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [0, n), n > 0 */
static inline uint64_t model_rand_below(uint64_t *state, uint64_t n)
{
    return model_rand(state) % n;
}

#endif /* TESTS_UNIT_MODEL_H */
