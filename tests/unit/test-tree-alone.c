/*
 * Unit test: the B+tree alone, over a space map kept in a hash table,
 * with no allocator, free-space tree, extent or transaction code linked
 * (tests/unit/meson.build builds it against extree-crc32c.c,
 * extree-node.c and extree-btree.c only).
 *
 * Random range replaces against a per-block model; after each batch the
 * tree's items must be the model's maximal mergeable runs, every removed
 * piece reported to the caller must be what the model lost, and the space
 * map must hold exactly one reference to each node of the tree and none
 * to any other block.  Every few batches the dirty nodes are written and
 * the node cache dropped, so the next batch copies nodes on write out of
 * validated on-disk images.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdio.h>

#include "extree-int.h"
#include "extree-backend.h"
#include "test-seed.h"

#define BS 512
#define NS 4096
#define NBLOCKS 40000           /* guest blocks: a tree of three levels */

/* The test's space map: references per node block, a bump allocator */
typedef struct TestMap {
    GHashTable *refs;           /* bytenr -> count */
    uint64_t next;
    uint64_t allocs, drops;
} TestMap;

static int tm_new_node(void *opaque, uint64_t *bytenr)
{
    TestMap *m = opaque;

    *bytenr = m->next;
    m->next += NS;
    g_hash_table_insert(m->refs, g_memdup2(bytenr, 8), GUINT_TO_POINTER(1));
    m->allocs++;
    return 0;
}

static int tm_inc_ref(void *opaque, uint64_t start, uint64_t len)
{
    TestMap *m = opaque;
    gpointer v = g_hash_table_lookup(m->refs, &start);

    g_assert_nonnull(v);
    g_hash_table_insert(m->refs, g_memdup2(&start, 8),
                        GUINT_TO_POINTER(GPOINTER_TO_UINT(v) + 1));
    return 0;
}

static int tm_dec_ref(void *opaque, uint64_t start, uint64_t len, bool node)
{
    TestMap *m = opaque;
    guint n = GPOINTER_TO_UINT(g_hash_table_lookup(m->refs, &start));

    /* the tree gives back nodes only, each one it holds exactly once */
    g_assert_true(node);
    g_assert_cmpuint(len, ==, NS);
    g_assert_cmpuint(n, ==, 1);
    g_hash_table_remove(m->refs, &start);
    m->drops++;
    return 0;
}

static int tm_ref_count(void *opaque, uint64_t start, uint32_t *count)
{
    TestMap *m = opaque;

    *count = GPOINTER_TO_UINT(g_hash_table_lookup(m->refs, &start));
    return 0;
}

static const ExtreeSpaceMapOps tm_ops = {
    .new_node = tm_new_node,
    .inc_ref = tm_inc_ref,
    .dec_ref = tm_dec_ref,
    .ref_count = tm_ref_count,
};

/*
 * The test's own value type (the tree knows items only through one): DATA
 * runs merge when their host ranges are contiguous, ZERO runs always
 */
static bool blk_mergeable(const ExtreeItem *a, const ExtreeItem *b)
{
    if (a->key + a->length != b->key || a->type != b->type) {
        return false;
    }
    return a->type == EXTREE_ITEM_ZERO || a->host + a->length == b->host;
}

static uint64_t blk_host_at(const ExtreeItem *it, uint64_t key)
{
    return it->type == EXTREE_ITEM_ZERO ? it->host :
           it->host + (key - it->key);
}

static const ExtreeValueType blk_vt = {
    .mergeable = blk_mergeable,
    .host_at = blk_host_at,
};

typedef struct Blk {
    uint32_t type;              /* EXTREE_ITEM_*, 0 = none */
    uint64_t host;
} Blk;

typedef struct Fixture {
    Extree *t;
    ExtreeBackend *be;
    TestMap map;
    Blk b[NBLOCKS];
    uint64_t removed;           /* bytes reported removed by this replace */
    uint64_t removed_data;      /* ... of them DATA */
} Fixture;

static ExtreeTree *tree_of(Fixture *f)
{
    return &f->t->trees[EXTREE_TREE_EXTENT];
}

static void fx_init(Fixture *f)
{
    Extree *t = g_new0(Extree, 1);
    ExtreeNode *root;
    uint64_t bytenr;

    memset(f, 0, sizeof(*f));
    f->be = extree_mem_backend_new();
    f->map.refs = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free,
                                        NULL);
    t->be = f->be;
    t->block_size = BS;
    t->node_size = NS;
    t->leaf_cap = EXTREE_LEAF_CAPACITY(NS);
    t->ptr_cap = EXTREE_INTERIOR_CAPACITY(NS);
    t->virtual_size = (uint64_t)NBLOCKS * BS;
    t->data_start = EXTREE_ROUND_UP(EXTREE_SB_AREA, BS);
    f->map.next = t->data_start;
    t->host_end = t->sb_host_end = 1ull << 40;
    t->generation = 1;
    t->trans_gen = 2;
    t->nc.limit = 1 << 20;
    t->nc.dirty_limit = UINT64_MAX;
    t->sm = (ExtreeSpaceMap){ &tm_ops, &f->map };
    extree_cache_init(t);
    f->t = t;

    g_assert_cmpint(t->sm.ops->new_node(t->sm.opaque, &bytenr), ==, 0);
    g_assert_cmpint(extree_node_new(t, bytenr, EXTREE_TREE_EXTENT, 0, &root),
                    ==, 0);
    extree_node_unref(t, root);
    *tree_of(f) = (ExtreeTree){ .owner = EXTREE_TREE_EXTENT, .vt = &blk_vt,
                                .root = bytenr,
                                .root_gen = t->trans_gen,
                                .data_end = UINT64_MAX };
}

static void fx_destroy(Fixture *f)
{
    EXT_FOR_EACH_TREE(owner) {
        extree_path_release(f->t, &f->t->pcache[owner]);
    }
    extree_cache_destroy(f->t);
    g_free(f->t);
    g_hash_table_destroy(f->map.refs);
    extree_mem_backend_free(f->be);
}

/* Write the dirty nodes, drop the cache, start the next transaction */
static void fx_persist(Fixture *f)
{
    Extree *t = f->t;

    g_assert_cmpint(extree_node_write_dirty(t), ==, 0);
    extree_node_commit_done(t);
    EXT_FOR_EACH_TREE(owner) {
        extree_path_release(t, &t->pcache[owner]);
    }
    t->fcache.valid = false;
    extree_cache_destroy(t);
    extree_cache_init(t);
    t->generation = t->trans_gen++;
    t->seq++;
}

static int on_removed(void *opaque, const ExtreeItem *piece)
{
    Fixture *f = opaque;

    /* the piece is exactly what the model held there */
    g_assert_cmpuint(piece->key % BS, ==, 0);
    g_assert_cmpuint(piece->length % BS, ==, 0);
    for (uint64_t i = 0; i < piece->length / BS; i++) {
        Blk *b = &f->b[piece->key / BS + i];
        g_assert_cmpuint(b->type, ==, piece->type);
        if (piece->type == EXTREE_ITEM_DATA) {
            g_assert_cmphex(b->host, ==, piece->host + i * BS);
        }
    }
    f->removed += piece->length;
    if (piece->type == EXTREE_ITEM_DATA) {
        f->removed_data += piece->length;
    }
    return 0;
}

/* Replace blocks [first, first + n) by @type (0: punch) in tree and model */
static void replace(Fixture *f, uint64_t first, uint64_t n, uint32_t type,
                    uint64_t host)
{
    ExtreeItem it = { first * BS, n * BS, type == EXTREE_ITEM_DATA ? host : 0,
                      type };
    uint64_t had = 0;

    for (uint64_t i = first; i < first + n; i++) {
        had += f->b[i].type ? BS : 0;
    }
    f->removed = f->removed_data = 0;
    g_assert_cmpint(extree_bt_replace(f->t, tree_of(f), &it, first * BS,
                                      n * BS, on_removed, f), ==, 0);
    g_assert_cmpuint(f->removed, ==, had);
    for (uint64_t i = first; i < first + n; i++) {
        f->b[i].type = type;
        f->b[i].host = type == EXTREE_ITEM_DATA ? host + (i - first) * BS : 0;
    }
}

/* Nodes reachable from the root; each must hold one map reference */
static uint64_t count_nodes(Fixture *f, uint64_t bytenr, unsigned level,
                            uint64_t gen)
{
    ExtreeNodeExpect e = { .owner = EXTREE_TREE_EXTENT, .level = level,
                           .generation = gen, .key_end = UINT64_MAX,
                           .data_end = UINT64_MAX };
    uint32_t refs = 0;
    uint64_t count = 1;
    ExtreeNode *n;

    g_assert_cmpint(tm_ref_count(&f->map, bytenr, &refs), ==, 0);
    g_assert_cmpuint(refs, ==, 1);
    g_assert_cmpint(extree_node_get(f->t, bytenr, &e, &n), ==, 0);
    for (int i = 0; level && i < (int)node_nritems(n); i++) {
        ExtreeKeyPtr kp;
        ptr_get(n, i, &kp);
        count += count_nodes(f, kp.child, level - 1, kp.child_gen);
    }
    extree_node_unref(f->t, n);
    return count;
}

static void verify(Fixture *f)
{
    ExtreeTree *tree = tree_of(f);
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    uint64_t i = 0, items = 0, total = 0;
    int ret;

    /* the items are the model's maximal mergeable runs, in order */
    ret = extree_bt_first(f->t, tree, 0, &p, &it);
    while (i < NBLOCKS) {
        ExtreeItem run;
        if (!f->b[i].type) {
            i++;
            continue;
        }
        run = (ExtreeItem){ i * BS, BS, f->b[i].host, f->b[i].type };
        for (i++; i < NBLOCKS; i++) {
            ExtreeItem nx = { i * BS, BS, f->b[i].host, f->b[i].type };
            if (!nx.type || !blk_mergeable(&run, &nx)) {
                break;
            }
            run.length += BS;
        }
        g_assert_cmpint(ret, ==, 0);
        g_assert_cmphex(it.key, ==, run.key);
        g_assert_cmphex(it.length, ==, run.length);
        g_assert_cmpuint(it.type, ==, run.type);
        if (run.type == EXTREE_ITEM_DATA) {
            g_assert_cmphex(it.host, ==, run.host);
        }
        items++;
        total += run.length;
        ret = extree_bt_next(f->t, tree, &p, &it);
    }
    g_assert_cmpint(ret, ==, 1);
    extree_path_release(f->t, &p);
    g_assert_cmpuint(tree->nitems, ==, items);
    g_assert_cmpuint(tree->total, ==, total);

    /* one reference to each node of the tree, none to anything else */
    g_assert_cmpuint(count_nodes(f, tree->root, tree->level, tree->root_gen),
                     ==, g_hash_table_size(f->map.refs));
}

static void test_random(void)
{
    GRand *rng = g_rand_new_with_seed(test_seed("/tree-alone/random",
                                                20261204));
    Fixture *f = g_new(Fixture, 1);
    unsigned max_level = 0;

    fx_init(f);
    for (int batch = 0; batch < 60; batch++) {
        for (int op = 0; op < 1000; op++) {
            uint64_t first = g_rand_int_range(rng, 0, NBLOCKS);
            uint64_t n = 1 + g_rand_int_range(rng, 0, batch % 8 == 7 ? 64 : 2);
            uint32_t kind = g_rand_int_range(rng, 0, 10);
            /*
             * hosts that sometimes continue the neighbour's, so that items
             * merge, mostly not, so that the tree grows
             */
            uint64_t host = f->t->data_start +
                            (first + (g_rand_int_range(rng, 0, 4) ? 7 * op : 0))
                            * BS;

            n = MIN(n, NBLOCKS - first);
            replace(f, first, n, kind < 8 ? EXTREE_ITEM_DATA :
                                 kind < 9 ? EXTREE_ITEM_ZERO : 0, host);
        }
        verify(f);
        max_level = MAX(max_level, tree_of(f)->level);
        g_test_message("batch %d: root level %u, %" PRIu64 " items", batch,
                       tree_of(f)->level, tree_of(f)->nitems);
        if (batch % 4 == 3) {
            uint64_t drops = f->map.drops;
            fx_persist(f);
            verify(f);
            /* the next change copies the nodes on its path */
            replace(f, 0, 1, EXTREE_ITEM_ZERO, 0);
            g_assert_cmpuint(f->map.drops, >, drops);
            verify(f);
        }
    }
    /* deep enough to have split and merged interior nodes */
    g_assert_cmpuint(max_level, >=, 2);
    /* then empty it: everything collapses into one root leaf */
    replace(f, 0, NBLOCKS, 0, 0);
    verify(f);
    g_assert_cmpuint(tree_of(f)->level, ==, 0);
    g_assert_cmpuint(g_hash_table_size(f->map.refs), ==, 1);
    g_assert_cmpuint(f->map.allocs - f->map.drops, ==, 1);
    fx_destroy(f);
    g_free(f);
    g_rand_free(rng);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/tree-alone/random", test_random);
    return g_test_run();
}
