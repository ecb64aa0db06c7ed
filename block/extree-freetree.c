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
            extree_alloc_add_loaded(t, it.key, it.length);
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
        extree_alloc_add_loaded(t, it.key, it.length);
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

    if (!t->alloc_partial) {
        return t->alloc_loaded ? 0 : -EIO;
    }
    have = t->unloaded_bytes;
    extree_alloc_rest_begin(t);
    for (ret = extree_bt_first(t, ft, 0, &p, &it);
         ret == 0 && it.key < t->free_hi;
         p.readahead = EXTREE_READAHEAD_MAX,
         ret = extree_bt_next(t, ft, &p, &it)) {
        if (extree_alloc_add_unloaded(t, it.key, it.length) < 0) {
            ret = extree_corrupt(t, p.nodes[0]->bytenr, "corrupt free tree "
                                 "node at offset 0x%" PRIx64 ": free range "
                                 "[0x%" PRIx64 ", +0x%" PRIx64 ") is in use"
                                 " or beyond the superblock's free_bytes",
                                 p.nodes[0]->bytenr, it.key, it.length);
            break;
        }
    }
    extree_path_release(t, &p);
    extree_alloc_rest_end(t);
    if (ret >= 0 && t->unloaded_bytes) {
        ret = bad_free_bytes(t, have, have - t->unloaded_bytes);
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
    ret = extree_alloc_add_leaf(t, items, nr);
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

    if (!t->alloc_partial) {
        return 0;
    }
    ret = extree_bt_leaves_with_bytes(t, &t->trees[EXTREE_TREE_FREE], len,
                                      t->free_lo, t->free_hi, load_fit_leaf,
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
