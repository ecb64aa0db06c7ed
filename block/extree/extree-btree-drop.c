/*
 * extree core: whole B+trees: dropping one (freeing what no other root
 * uses, checked against the roots a guard keeps) and new empty roots
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"
#include "extree-btree-int.h"

/*
 * Does a root of @guard reach the node @n (about to be freed)?  Then its
 * count was too low: corruption.  O(roots x depth) node lookups, about
 * one walk of the roots' nodes in the key range a drop covers.
 */
static int guard_check(Extree *t, ExtreeDropGuard *guard, ExtreeNode *n)
{
    for (unsigned i = 0; guard && i < guard->nkeep; i++) {
        bool reaches;
        int ret = extree_bt_probe_reaches(t, &guard->keep[i], n, &reaches);

        if (ret < 0) {
            return ret;
        }
        if (reaches) {
            return extree_corrupt(t, n->bytenr, "corrupt reference count "
                                  "tree: extent tree node at offset 0x%"
                                  PRIx64 " has 1 reference, but another "
                                  "root reaches it too", n->bytenr);
        }
    }
    return 0;
}

/* ---- whole trees ---- */

/*
 * The children of @n that a drop will read (those with one reference: the
 * others only lose one), read at once, concurrently where the backend can:
 * deleting a snapshot that was mostly overwritten reads every node of its
 * tree, and one read at a time waits on each
 */
static void drop_readahead(Extree *t, ExtreeTree *tree, const ExtreeNode *n,
                           uint64_t key_end)
{
    int nr = node_nritems(n), k = 0;
    ExtreeNodeExpect *e = g_new(ExtreeNodeExpect, nr);
    uint64_t *bytenr = g_new(uint64_t, nr);

    for (int i = 0; i < nr; i++) {
        uint32_t count;
        uint64_t child = ptr_get_child(n, i);

        if (!extree_node_cached(t, child) &&
            t->sm.ops->ref_count(t->sm.opaque, child, &count) == 0 &&
            count == 1) {
            bytenr[k] = child;
            extree_bt_child_expect(tree, n, i, key_end, &e[k]);
            k++;
        }
    }
    for (int i = 0; i < k; i += EXTREE_READAHEAD_MAX) {
        extree_node_readahead(t, MIN(k - i, EXTREE_READAHEAD_MAX),
                              bytenr + i, e + i);
    }
    g_free(e);
    g_free(bytenr);
}

/* drop_tree(): one reference fewer for the node @bytenr (@e expects it) */
static int drop_node(Extree *t, ExtreeTree *tree, uint64_t bytenr,
                     const ExtreeNodeExpect *e, ExtreeRemovedFn *removed,
                     void *opaque, ExtreeDropGuard *guard)
{
    uint32_t count;
    ExtreeNode *n;
    int nr, ret;

    ret = t->sm.ops->ref_count(t->sm.opaque, bytenr, &count);
    if (ret < 0) {
        return ret;
    }
    if (count > 1) {
        return t->sm.ops->dec_ref(t->sm.opaque, bytenr, t->node_size, true);
    }
    ret = extree_node_get(t, bytenr, e, &n);
    if (ret < 0) {
        return ret;
    }
    ret = guard_check(t, guard, n);
    if (ret == 0 && guard && guard->leaf_fn && !node_level(n)) {
        ret = guard->leaf_fn(guard, n);
    }
    if (ret < 0) {
        extree_node_unref(t, n);
        return ret;
    }
    nr = node_nritems(n);
    if (node_level(n)) {
        drop_readahead(t, tree, n, e->key_end);
    }
    for (int i = 0; i < nr && ret == 0; i++) {
        if (node_level(n)) {
            ExtreeNodeExpect ce;

            extree_bt_child_expect(tree, n, i, e->key_end, &ce);
            ret = drop_node(t, tree, ptr_get_child(n, i), &ce, removed,
                            opaque, guard);
        } else if (removed) {
            ExtreeItem it;

            leaf_get(n, i, &it);
            ret = removed(opaque, &it);
        }
    }
    if (ret == 0) {
        ret = extree_bt_free_node(t, n);
    }
    extree_node_unref(t, n);
    return ret;
}

/*
 * The root of @tree loses a reference (a snapshot deleted, a live tree
 * replaced by a revert): every node that thereby loses its last one is
 * freed and its children lose one, recursively; @removed is told of each
 * item of a freed leaf.  Visits only the nodes no other root shares:
 * O(nodes freed).  The tree must hold no node of this transaction.
 */
int extree_bt_drop(Extree *t, ExtreeTree *tree, ExtreeRemovedFn *removed,
                   void *opaque, ExtreeDropGuard *guard)
{
    ExtreeNodeExpect e;

    extree_path_release(t, &t->pcache[tree->owner]);
    extree_tree_expect(t, tree, &e);
    t->seq++;
    return drop_node(t, tree, tree->root, &e, removed, opaque, guard);
}

/* @tree becomes an empty root leaf in new space */
int extree_bt_new_root(Extree *t, ExtreeTree *tree)
{
    ExtreeNode *root;
    uint64_t bytenr;
    int ret;

    ret = t->sm.ops->new_node(t->sm.opaque, &bytenr);
    if (ret < 0) {
        return ret;
    }
    ret = extree_node_new(t, bytenr, tree->owner, 0, &root);
    if (ret < 0) {
        return ret;
    }
    extree_node_unref(t, root);
    extree_path_release(t, &t->pcache[tree->owner]);
    tree->root = bytenr;
    tree->root_gen = t->trans_gen;
    tree->level = 0;
    tree->nitems = 0;
    tree->total = 0;
    t->super_dirty = true;
    t->seq++;
    return 0;
}
