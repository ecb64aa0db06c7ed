/*
 * extree core: the free-space tree on disk
 *
 * The allocator (extree-alloc.c) keeps free space in memory; this file
 * keeps the free-space tree, its durable copy, in step with it: loaded
 * into the allocator at open, rewritten from the allocator's log of
 * changed ranges at commit, rebuilt from the extent tree by the checker.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

/*
 * Loading into the allocator's sets (extree-alloc.c).  A partial load
 * (extree_freetree_load()) adds the free space of [data_start, free_lo)
 * and of [free_hi, ...); the rest comes later, merged in one ordered pass
 * (extree_freetree_load_rest()).
 */

/*
 * Open: a range of the free-space tree is allocatable.  The tree does not
 * say what used it; a range of one node up to EXT_DISCARD_NODES_MIN is
 * treated as freed node space (nfree), as it mostly is: holes between live
 * nodes.  Data placed first fit into such holes would be freed again in as
 * many small pieces, each its own discard.  A range shorter than a node
 * was data (the old copy of a block a write after a snapshot copied, say)
 * and only data can use it again: in nfree, which data takes last, it
 * would stay free for good, and the free-space tree, which every
 * read-write open loads, would only grow.
 */
static ExtreeRangeSet *loaded_set(Extree *t, uint64_t len)
{
    bool node_space = len >= t->node_size && len < EXT_DISCARD_NODES_MIN;

    return node_space ? &t->space.nfree : &t->space.avail;
}

/*
 * Free-space items (ExtreeValueType): host ranges; neighbours merge when
 * they are contiguous
 */
static bool free_mergeable(const ExtreeItem *a, const ExtreeItem *b)
{
    return a->key + a->length == b->key && a->type == b->type &&
           a->host + a->length == b->host;
}

static uint64_t free_host_at(const ExtreeItem *it, uint64_t key)
{
    return it->host + (key - it->key);
}

const ExtreeValueType extree_free_vt = {
    .mergeable = free_mergeable,
    .host_at = free_host_at,
};

static void add_loaded(Extree *t, uint64_t start, uint64_t len)
{
    /* in order: node validation keeps a tree's items sorted, disjoint */
    extree_rs_append(loaded_set(t, len), start, len);
}

/*
 * Loading the rest rebuilds avail and nfree in one ordered pass, as open
 * builds them (extree_rs_append(), no search per range): their ranges move to
 * the old sets here and come back in key order, interleaved with the
 * tree's (add_unloaded()), until rest_end().
 */
static void rest_begin(Extree *t)
{
    t->space.rest_avail = t->space.avail;
    t->space.rest_nfree = t->space.nfree;
    memset(&t->space.avail, 0, sizeof(t->space.avail));
    memset(&t->space.nfree, 0, sizeof(t->space.nfree));
    t->space.avail.unit = t->space.nfree.unit = t->node_size;
}

/* The old sets' ranges that start before @pos back into the sets */
static void rest_flush(Extree *t, uint64_t pos)
{
    for (;;) {
        ExtreeSpace *sp = &t->space;
        ExtreeRange *a = extree_rs_from(&sp->rest_avail, sp->rest_done);
        ExtreeRange *n = extree_rs_from(&sp->rest_nfree, sp->rest_done);
        ExtreeRange *r = a && (!n || a->start < n->start) ? a : n;

        if (!r || r->start >= pos) {
            return;
        }
        extree_rs_append(r == a ? &t->space.avail : &t->space.nfree,
                         r->start, r->len);
        t->space.rest_done = r->start + r->len;
    }
}

/*
 * A free range of the tree's unread part, [start, start + len), as the
 * tree says it now: its part in [free_lo, free_hi) not touched since the
 * open is free space the sets did not hold, and joins them.  @in_order:
 * while the rest loads (rest_begin()), in key order.
 * Untouched space in use, shared or already in the sets, or more of it
 * than the superblock counted, is corruption: -EINVAL.
 */
static int add_unread(Extree *t, uint64_t start, uint64_t len, bool in_order)
{
    uint64_t pos = MAX(start, t->space.free_lo);
    uint64_t end = MIN(start + len, t->space.free_hi);

    while (pos < end) {
        ExtreeRange *r = extree_rs_from(&t->space.touched, pos);
        ExtreeRefRange ref;
        uint64_t e;
        bool bad;

        if (r && r->start <= pos) {
            pos = r->start + r->len;
            continue;
        }
        e = r ? MIN(r->start, end) : end;
        if (in_order) {
            /* avail and nfree hold nothing past the last piece yet */
            bad = extree_rs_overlaps(&t->space.rest_avail, pos, e - pos) ||
                  extree_rs_overlaps(&t->space.rest_nfree, pos, e - pos) ||
                  extree_rs_overlaps(&t->space.pending, pos, e - pos) ||
                  (pos < t->space.resv_end && t->space.resv_start < e);
        } else {
            bad = extree_alloc_is_free(t, pos, e - pos);
        }
        if (bad || e - pos > t->space.unloaded_bytes ||
            (t->space.refs && extree_refs_next(t, pos, e, &ref))) {
            return -EINVAL;
        }
        if (in_order) {
            rest_flush(t, pos);
            extree_rs_append(loaded_set(t, e - pos), pos, e - pos);
        } else {
            extree_rs_add(loaded_set(t, e - pos), pos, e - pos);
        }
        t->space.unloaded_bytes -= e - pos;
        pos = e;
    }
    return 0;
}

/* Loading the rest: the next free range of the tree, in key order */
static int add_unloaded(Extree *t, uint64_t start, uint64_t len)
{
    return add_unread(t, start, len, true);
}

/*
 * One leaf of the unread part, read out of turn (extree_freetree_load_fit()):
 * its free ranges join the sets, and memory knows all free space of
 * [@first, @end) from now on, where no other leaf has any
 */
static int add_leaf(Extree *t, const ExtreeItem *items, int nr)
{
    uint64_t first, end;

    if (!nr) {
        return 0;
    }
    for (int i = 0; i < nr; i++) {
        int ret = add_unread(t, items[i].key, items[i].length, false);

        if (ret < 0) {
            return ret;
        }
    }
    first = MAX(items[0].key, t->space.free_lo);
    end = MIN(items[nr - 1].key + items[nr - 1].length, t->space.free_hi);
    if (first < end) {
        extree_rs_union(&t->space.touched, first, end - first);
    }
    return 0;
}

/* The rest is in: the old sets' remaining ranges follow */
static void rest_end(Extree *t)
{
    rest_flush(t, UINT64_MAX);
    extree_rs_append_done(&t->space.avail);
    extree_rs_append_done(&t->space.nfree);
    extree_rs_clear(&t->space.rest_avail);
    extree_rs_clear(&t->space.rest_nfree);
    t->space.rest_done = 0;
}

static int bad_free_bytes(Extree *t, uint64_t have, uint64_t expect)
{
    uint64_t off = (t->generation % 2) * EXTREE_SB_SIZE;

    return extree_corrupt(t, off, "corrupt superblock at offset 0x%" PRIx64
                          ": free_bytes mismatch, have %" PRIu64 " expect %"
                          PRIu64 " (free tree)", off, have, expect);
}

/*
 * Partial load: the items of the tree's first (@last false) or last leaf
 * into the sets.  *@bound: where the free space the leaf tells all of
 * ends (the first leaf: its last item's end; nothing free lies between
 * that and the next leaf's first item) or begins (the last leaf: its first
 * item's key; no earlier item reaches past it).
 */
static int load_leaf(Extree *t, bool last, uint64_t *bound, uint64_t *total)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];
    ExtreePath p = { { 0 } };
    int ret = extree_bt_seek(t, ft, last ? UINT64_MAX : 0, &p);

    if (ret == 0) {
        ExtreeNode *n = p.nodes[0];
        uint32_t nr = node_nritems(n);

        for (uint32_t i = 0; i < nr; i++) {
            ExtreeItem it;

            leaf_get(n, i, &it);
            add_loaded(t, it.key, it.length);
            *total += it.length;
            if (last ? i == 0 : i + 1 == nr) {
                *bound = last ? it.key : it.key + it.length;
            }
        }
    }
    extree_path_release(t, &p);
    return ret;
}

/*
 * Open: the free-space tree becomes the allocator's sets.  @whole, or a
 * tree of one leaf: all of it, O(free items).  Else only its first and
 * last leaf, O(leaf): the low free space, which first fit hands out to
 * nodes and snapshot tables, and the tail, which commit cuts off; a
 * snapshot command then costs the same on an image whose free space is
 * in hundreds of thousands of pieces as on any other.  The rest waits
 * for extree_freetree_load_rest().  The extent tree is not read.  Node
 * validation already guarantees sorted, non-overlapping ranges inside the
 * data area.
 */
int extree_freetree_load(Extree *t, uint64_t expect_bytes, bool whole)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    uint64_t count = 0, total = 0;
    int ret;

    if (!whole && ft->level > 0) {
        uint64_t lo = t->data_start, hi = UINT64_MAX;
        ExtreeNodeExpect e;
        ExtreeNode *root;

        /*
         * The root's child_bytes sum the tree (each child is checked
         * against them when read): free_bytes is checked here, as a whole
         * load checks it
         */
        extree_tree_expect(t, ft, &e);
        ret = extree_node_get(t, ft->root, &e, &root);
        if (ret == 0) {
            uint64_t bytes = root->bytes;

            extree_node_unref(t, root);
            if (bytes != expect_bytes) {
                ret = bad_free_bytes(t, expect_bytes, bytes);
            }
        }
        if (ret == 0) {
            ret = load_leaf(t, false, &lo, &total);
        }
        if (ret == 0) {
            ret = load_leaf(t, true, &hi, &total);
        }
        if (ret == 0 && total > expect_bytes) {
            ret = bad_free_bytes(t, expect_bytes, total);
        }
        if (ret < 0) {
            extree_alloc_set_loaded(t, false);
            return ret;
        }
        /* the sum is checked; the item count is not kept (nothing reads it) */
        ft->total = expect_bytes;
        ft->nitems = 0;
        extree_alloc_set_loaded(t, true);
        extree_alloc_set_partial(t, lo, hi, expect_bytes - total);
        return 0;
    }

    /*
     * A load visits every leaf: read them ahead in the largest batches
     * from the first on, not doubling up from a few as a query does
     */
    for (ret = extree_bt_first(t, ft, 0, &p, &it); ret == 0;
         p.readahead = EXTREE_READAHEAD_MAX,
         ret = extree_bt_next(t, ft, &p, &it)) {
        add_loaded(t, it.key, it.length);
        count++;
        total += it.length;
    }
    extree_path_release(t, &p);
    if (ret < 0) {
        extree_alloc_set_loaded(t, false);
        return ret;
    }
    if (total != expect_bytes) {
        extree_alloc_set_loaded(t, false);
        return bad_free_bytes(t, expect_bytes, total);
    }
    ft->nitems = count;
    ft->total = total;
    extree_alloc_set_loaded(t, true);
    return 0;
}

/*
 * The free space a partial load left out joins the sets: every item of
 * the tree as it is now, less what changed since the open (the sets know
 * that).  Then the sets hold all free space, and the superblock's
 * free_bytes is checked as a whole load checks it.  On failure the handle
 * has no allocator (updates fail with -EIO).  O(free items).  Not while
 * the free tree itself is being synced: no caller is.
 */
int extree_freetree_load_rest(Extree *t)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    uint64_t have;
    int ret;

    if (!t->space.alloc_partial) {
        return t->space.alloc_loaded ? 0 : -EIO;
    }
    have = t->space.unloaded_bytes;
    rest_begin(t);
    for (ret = extree_bt_first(t, ft, 0, &p, &it);
         ret == 0 && it.key < t->space.free_hi;
         p.readahead = EXTREE_READAHEAD_MAX,
         ret = extree_bt_next(t, ft, &p, &it)) {
        if (add_unloaded(t, it.key, it.length) < 0) {
            ret = extree_corrupt(t, p.nodes[0]->bytenr, "corrupt free tree "
                                 "node at offset 0x%" PRIx64 ": free range "
                                 "[0x%" PRIx64 ", +0x%" PRIx64 ") is in use"
                                 " or beyond the superblock's free_bytes",
                                 p.nodes[0]->bytenr, it.key, it.length);
            break;
        }
    }
    extree_path_release(t, &p);
    rest_end(t);
    if (ret >= 0 && t->space.unloaded_bytes) {
        ret = bad_free_bytes(t, have, have - t->space.unloaded_bytes);
    }
    if (ret < 0) {
        extree_alloc_set_loaded(t, false);
        return ret;
    }
    extree_alloc_set_partial(t, 0, 0, 0);
    return 0;
}

static int load_fit_leaf(Extree *t, ExtreeNode *leaf, void *opaque)
{
    uint64_t *len = opaque;
    uint32_t nr = node_nritems(leaf);
    ExtreeItem *items = g_new(ExtreeItem, nr);
    int ret;

    for (uint32_t i = 0; i < nr; i++) {
        leaf_get(leaf, i, &items[i]);
    }
    ret = add_leaf(t, items, nr);
    g_free(items);
    if (ret < 0) {
        return extree_corrupt(t, leaf->bytenr, "corrupt free tree node at "
                              "offset 0x%" PRIx64 ": a free range is in use "
                              "or beyond the superblock's free_bytes",
                              leaf->bytenr);
    }
    return extree_alloc_fits(t, *len);
}

/*
 * After a partial load: read the leaves of the unread part that may hold
 * a free range of @len bytes or more (their child_bytes reach @len; the
 * others are stepped over unread) until one does.  Their free space joins
 * the sets.  O(depth + leaves read).  Not while the free tree is being
 * synced.  A leaf found damaged leaves the handle without an allocator.
 */
int extree_freetree_load_fit(Extree *t, uint64_t len)
{
    int ret;

    if (!t->space.alloc_partial) {
        return 0;
    }
    ret = extree_bt_leaves_with_bytes(t, &t->trees[EXTREE_TREE_FREE], len,
                                      t->space.free_lo, t->space.free_hi,
                                      load_fit_leaf,
                                      &len);
    if (ret < 0) {
        extree_alloc_set_loaded(t, false);
        return ret;
    }
    return 0;
}

/* Make [start, end) of the free tree say what the three sets say */
static int sync_range(Extree *t, uint64_t start, uint64_t end)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];
    uint64_t pos = start;
    int ret = 0;

    while (pos < end && ret == 0) {
        uint64_t fs = end, fe = end;
        ExtreeItem it = { 0 };

        extree_alloc_next_free(t, pos, end, &fs, &fe);
        if (fs > pos) {
            ret = extree_bt_replace(t, ft, &it, pos, fs - pos, NULL, NULL);
        }
        if (ret == 0 && fe > fs) {
            it.key = it.host = fs;
            it.length = fe - fs;
            it.type = EXTREE_ITEM_FREE;
            ret = extree_bt_replace(t, ft, &it, fs, fe - fs, NULL, NULL);
        }
        pos = fe;
    }
    return ret;
}

/*
 * Commit step 2: bring the free-space tree up to date.  The host ranges
 * logged since the last sync, sorted and merged, are rewritten from the
 * in-memory sets (the rest of the tree is current).  That CoWs free-tree
 * nodes, which allocates and frees more space, which is logged again: loop
 * until nothing is left (each round touches only nodes not yet copied, so
 * a few rounds do).  Address order keeps consecutive changes on the same
 * leaf.  O(ranges logged * log n).
 */
int extree_freetree_sync(Extree *t)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];

    for (int round = 0; round < 32; round++) {
        GArray *ops = extree_alloc_steal_log(t);
        int ret = 0;

        if (!ops->len) {
            g_array_free(ops, true);
            if (ft->total != extree_alloc_free_bytes(t)) {
                return extree_corrupt(t, 0, "corrupt free tree: free space "
                                      "accounting mismatch, have %" PRIu64
                                      " expect %" PRIu64, ft->total,
                                      extree_alloc_free_bytes(t));
            }
            return 0;
        }
        /* in address order, overlapping and adjacent ranges merged */
        extree_ranges_merge(ops);
        for (guint i = 0; i < ops->len && ret == 0; i++) {
            ExtreeAllocOp *op = &g_array_index(ops, ExtreeAllocOp, i);
            ret = sync_range(t, op->start, op->start + op->len);
        }
        g_array_free(ops, true);
        if (ret < 0) {
            return ret;
        }
    }
    return extree_corrupt(t, 0, "corrupt free tree: sync did not converge "
                          "after 32 rounds");
}

/*
 * Checker, "repair all": replace the free-space tree by one that lists
 * every range of [data_start, host_end) not in @used (sorted, disjoint
 * ExtreeAllocOp ranges: extent-tree nodes and DATA extents).  All of that
 * is pending (extree_alloc_reset_free()); the new tree starts as an empty
 * root leaf in new space at the end of the file, and the commit the caller
 * runs next fills it.
 */
int extree_freetree_rebuild(Extree *t, GArray *used)
{
    ExtreeTree *ft = &t->trees[EXTREE_TREE_FREE];

    extree_alloc_reset_free(t, used);
    return extree_bt_new_root(t, ft);
}
