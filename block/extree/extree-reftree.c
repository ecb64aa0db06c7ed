/*
 * extree core: the reference count tree on disk
 *
 * Images with snapshots share blocks between trees.  The allocator keeps
 * the counts of 2 and more in memory (t->space.refs); this file keeps the
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

/* ---- counts of 2 and more, in memory ---- */

/*
 * t->space.refs: the ranges whose blocks have two references or more, disjoint,
 * keyed by start (a GTree: O(log n) per lookup, split and merge).  A used
 * block outside them has one reference.  Every change is logged in
 * t->space.reflog for the reference count tree's sync at commit.
 */

/*
 * Reference count items (ExtreeValueType): the host field is the count,
 * the same for every piece; neighbours merge when their counts agree
 */
static bool refs_mergeable(const ExtreeItem *a, const ExtreeItem *b)
{
    return a->key + a->length == b->key && a->type == b->type &&
           a->host == b->host;
}

static uint64_t refs_host_at(const ExtreeItem *it, uint64_t key)
{
    return it->host;
}

const ExtreeValueType extree_refs_vt = {
    .mergeable = refs_mergeable,
    .host_at = refs_host_at,
};

static gint ref_key_cmp(gconstpointer a, gconstpointer b, gpointer unused)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

void extree_refs_init(Extree *t)
{
    t->space.refs = g_tree_new_full(ref_key_cmp, NULL, NULL, g_free);
    t->space.reflog = g_array_new(false, false, sizeof(ExtreeAllocOp));
}

void extree_refs_destroy(Extree *t)
{
    if (t->space.refs) {
        g_tree_destroy(t->space.refs);
        g_array_free(t->space.reflog, true);
        t->space.refs = NULL;
        t->space.reflog = NULL;
    }
}

/* The range with the largest start <= @off, or NULL */
static ExtreeRefRange *ref_floor(Extree *t, uint64_t off)
{
    GTreeNode *n = g_tree_upper_bound(t->space.refs, &off);

    n = n ? g_tree_node_previous(n) : g_tree_node_last(t->space.refs);
    return n ? g_tree_node_value(n) : NULL;
}

/* The first range with start >= @off, or NULL */
static ExtreeRefRange *ref_ceil(Extree *t, uint64_t off)
{
    GTreeNode *n = g_tree_lower_bound(t->space.refs, &off);

    return n ? g_tree_node_value(n) : NULL;
}

static void ref_insert(Extree *t, uint64_t start, uint64_t len,
                       uint32_t count)
{
    ExtreeRefRange *r = g_new(ExtreeRefRange, 1);

    r->start = start;
    r->len = len;
    r->count = count;
    g_tree_insert(t->space.refs, &r->start, r);
}

/* A range boundary at @off: split the range that covers it */
static void ref_split(Extree *t, uint64_t off)
{
    ExtreeRefRange *r = ref_floor(t, off);

    if (r && r->start < off && off < r->start + r->len) {
        uint64_t tail = r->start + r->len - off;

        r->len = off - r->start;
        ref_insert(t, off, tail, r->count);
    }
}

/* Merge equal neighbours around [start, end) after a change there */
static void ref_merge(Extree *t, uint64_t start, uint64_t end)
{
    ExtreeRefRange *r = ref_floor(t, start ? start - 1 : 0);

    if (!r) {
        r = ref_ceil(t, start);
    }
    while (r && r->start <= end) {
        ExtreeRefRange *n = ref_ceil(t, r->start + 1);

        if (n && n->start == r->start + r->len && n->count == r->count) {
            r->len += n->len;
            g_tree_remove(t->space.refs, &n->start);
            continue;
        }
        r = n;
    }
}

static void ref_log(Extree *t, uint64_t start, uint64_t len)
{
    if (t->space.reflog->len) {
        ExtreeAllocOp *last = &g_array_index(t->space.reflog, ExtreeAllocOp,
                                             t->space.reflog->len - 1);
        if (last->start + last->len == start) {
            last->len += len;
            return;
        }
    }
    g_array_append_val(t->space.reflog, ((ExtreeAllocOp){ start, len, false }));
}

/* Open: the reference count tree's item, validated against free space */
int extree_refs_add_loaded(Extree *t, uint64_t start, uint64_t len,
                           uint32_t count)
{
    ExtreeRefRange *r = ref_floor(t, start + len - 1);

    if (count < 2 || extree_alloc_is_free(t, start, len) ||
        (r && r->start + r->len > start)) {
        return -EINVAL;
    }
    ref_insert(t, start, len, count);
    return 0;
}

/* The highest count of a block of [start, start + len), 1 if none shared */
uint32_t extree_refs_max(Extree *t, uint64_t start, uint64_t len)
{
    ExtreeRefRange *r = ref_floor(t, start);
    uint32_t max = 1;

    if (!r || r->start + r->len <= start) {
        r = ref_ceil(t, start);
    }
    for (; r && r->start < start + len; r = ref_ceil(t, r->start + 1)) {
        max = MAX(max, r->count);
    }
    return max;
}

/* The first range of counts >= 2 that ends after @pos, clipped to @end */
bool extree_refs_next(Extree *t, uint64_t pos, uint64_t end,
                      ExtreeRefRange *out)
{
    ExtreeRefRange *r = ref_floor(t, pos);

    if (!r || r->start + r->len <= pos) {
        r = ref_ceil(t, pos);
    }
    if (!r || r->start >= end) {
        return false;
    }
    out->start = MAX(r->start, pos);
    out->len = MIN(r->start + r->len, end) - out->start;
    out->count = r->count;
    return true;
}

/*
 * Checker repair: every block of [start, start + len) has @count
 * references (at least 1: the blocks are in use)
 */
int extree_refs_set(Extree *t, uint64_t start, uint64_t len, uint32_t count)
{
    uint64_t end = start + len;
    ExtreeRefRange *r;

    if (!t->space.refs || !extree_has_refs(t) || !len || !count ||
        len > UINT64_MAX - start || extree_alloc_is_free(t, start, len)) {
        return -EINVAL;
    }
    ref_split(t, start);
    ref_split(t, end);
    while ((r = ref_ceil(t, start)) && r->start < end) {
        uint64_t key = r->start;
        g_tree_remove(t->space.refs, &key);
    }
    if (count >= 2) {
        ref_insert(t, start, len, count);
    }
    ref_merge(t, start, end);
    ref_log(t, start, len);
    return 0;
}

GArray *extree_refs_steal_log(Extree *t)
{
    GArray *log = t->space.reflog;

    t->space.reflog = g_array_new(false, false, sizeof(ExtreeAllocOp));
    return log;
}


/* Every block of host [start, start + len) has a count of 2 or more */
bool extree_refs_all_shared(Extree *t, uint64_t start, uint64_t len)
{
    uint64_t pos = start, end = start + len;
    ExtreeRefRange r;

    while (pos < end) {
        if (!extree_refs_next(t, pos, end, &r) || r.start > pos) {
            return false;
        }
        pos = r.start + r.len;
    }
    return true;
}

/*
 * One more reference to every block of [start, start + len), a used host
 * range (the space map checked it): counts of 2 and more go up, the others
 * become 2.  O(ranges touched log ranges).
 */
int extree_refs_inc(Extree *t, uint64_t start, uint64_t len)
{
    uint64_t pos = start, end = start + len;

    ref_split(t, start);
    ref_split(t, end);
    while (pos < end) {
        ExtreeRefRange *r = ref_ceil(t, pos);

        if (r && r->start == pos) {
            if (r->count == UINT32_MAX) {
                return extree_corrupt(t, pos, "corrupt reference count "
                                      "tree: count of host offset 0x%"
                                      PRIx64 " overflows", pos);
            }
            r->count++;
            pos += r->len;
        } else {
            uint64_t gap_end = r && r->start < end ? r->start : end;

            ref_insert(t, pos, gap_end - pos, 2);
            pos = gap_end;
        }
    }
    ref_merge(t, start, end);
    ref_log(t, start, len);
    return 0;
}

/*
 * One reference fewer: counts of 2 and more go down, blocks of count 1 are
 * freed (extree_alloc_free(): free once the commit is durable)
 */
int extree_refs_dec(Extree *t, uint64_t start, uint64_t len, bool node)
{
    uint64_t pos = start, end = start + len;
    bool changed = false;
    int ret = 0;

    if (!t->space.refs || !g_tree_nnodes(t->space.refs)) {
        return extree_alloc_free(t, start, len, node);
    }
    if (!len || len > UINT64_MAX - start) {
        return extree_alloc_free(t, start, len, node);
    }
    ref_split(t, start);
    ref_split(t, end);
    while (pos < end && ret == 0) {
        ExtreeRefRange *r = ref_ceil(t, pos);

        if (r && r->start == pos) {
            uint64_t rlen = r->len;

            changed = true;
            if (--r->count < 2) {
                g_tree_remove(t->space.refs, &pos);
            }
            pos += rlen;
        } else {
            uint64_t gap_end = r && r->start < end ? r->start : end;

            ret = extree_alloc_free(t, pos, gap_end - pos, node);
            pos = gap_end;
        }
    }
    if (changed) {
        ref_merge(t, start, end);
        ref_log(t, start, len);
    }
    return ret;
}

/* ---- the reference count tree ---- */

/*
 * Open, after the free-space tree: every REFS item into t->space.refs.  Node
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

/* Make [start, end) of the reference count tree say what t->space.refs says */
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

    if (!extree_has_refs(t) || !t->space.refs) {
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
