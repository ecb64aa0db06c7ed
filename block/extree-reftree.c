/*
 * extree core: the reference count tree on disk
 *
 * Images with snapshots share blocks between trees.  The allocator keeps
 * the counts of 2 and more in memory (t->refs); this file keeps the
 * reference count tree, their durable copy, in step with it: loaded at
 * read-write open, rewritten from the allocator's log of changed ranges at
 * commit, before the free-space tree's sync (the copies this makes
 * allocate and free space, which that sync then records; nothing the
 * free-space tree sync does changes a count).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

/*
 * Open, after the free-space tree: every REFS item into t->refs.  Node
 * validation already checked counts and host ranges; a shared range that
 * is free, or overlaps another, is corruption.  O(items).
 */
int extree_reftree_load(Extree *t)
{
    ExtreeTree *rt = &t->trees[EXTREE_TREE_REFS];
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    uint64_t count = 0, total = 0;
    int ret;

    /* every leaf: the largest readahead batches (as the free tree's) */
    for (ret = extree_bt_first(t, rt, 0, &p, &it); ret == 0;
         p.readahead = EXTREE_READAHEAD_MAX,
         ret = extree_bt_next(t, rt, &p, &it)) {
        if (extree_refs_add_loaded(t, it.key, it.length, it.host) < 0) {
            ret = extree_corrupt(t, p.nodes[0]->bytenr, "corrupt reference "
                                 "count tree node at offset 0x%" PRIx64
                                 ": host range [0x%" PRIx64 ", +0x%" PRIx64
                                 ") with %" PRIu64 " references is free or "
                                 "listed twice", p.nodes[0]->bytenr, it.key,
                                 it.length, it.host);
            break;
        }
        count++;
        total += it.length;
    }
    extree_path_release(t, &p);
    if (ret < 0) {
        return ret;
    }
    rt->nitems = count;
    rt->total = total;
    return 0;
}

/* Make [start, end) of the reference count tree say what t->refs says */
static int sync_range(Extree *t, uint64_t start, uint64_t end)
{
    ExtreeTree *rt = &t->trees[EXTREE_TREE_REFS];
    uint64_t pos = start;
    int ret = 0;

    while (pos < end && ret == 0) {
        ExtreeRefRange r;
        ExtreeItem it = { 0 };

        if (!extree_refs_next(t, pos, end, &r)) {
            return extree_bt_replace(t, rt, &it, pos, end - pos, NULL, NULL);
        }
        if (r.start > pos) {
            ret = extree_bt_replace(t, rt, &it, pos, r.start - pos, NULL,
                                    NULL);
        }
        if (ret == 0) {
            it.key = r.start;
            it.length = r.len;
            it.host = r.count;
            it.type = EXTREE_ITEM_REFS;
            ret = extree_bt_replace(t, rt, &it, r.start, r.len, NULL, NULL);
        }
        pos = r.start + r.len;
    }
    return ret;
}

/*
 * Commit: rewrite the ranges whose counts changed in this transaction.
 * O(ranges logged * log n).
 */
int extree_reftree_sync(Extree *t)
{
    GArray *ops;
    int ret = 0;

    if (!extree_has_refs(t) || !t->refs) {
        return 0;
    }
    ops = extree_refs_steal_log(t);
    extree_ranges_merge(ops);
    for (guint i = 0; i < ops->len && ret == 0; i++) {
        ExtreeAllocOp *op = &g_array_index(ops, ExtreeAllocOp, i);
        ret = sync_range(t, op->start, op->start + op->len);
    }
    g_array_free(ops, true);
    return ret;
}
