/*
 * extree core: range sets
 *
 * A set of disjoint host ranges: a treap keyed by start whose nodes also
 * know the longest range of their subtree, so that "the lowest range of at
 * least n bytes" (first fit) and "the longest range" cost O(log n),
 * however fragmented the space is.  The allocator keeps its free space in
 * these (extree-alloc.c).  Nodes come from per-set slabs.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"


static uint64_t rn_max(const ExtreeRange *n)
{
    return n ? n->maxlen : 0;
}

/* The longest range of @s, 0 if empty: O(1) */
uint64_t extree_rs_longest(const ExtreeRangeSet *s)
{
    return rn_max(s->root);
}

static void rn_fix(ExtreeRange *n)
{
    n->maxlen = MAX(n->len, MAX(rn_max(n->left), rn_max(n->right)));
}

static uint32_t rs_rand(ExtreeRangeSet *s)
{
    /* xorshift32: deterministic, so that runs are reproducible */
    uint32_t x = s->rng ? s->rng : 2463534242u;

    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    s->rng = x;
    return x;
}

/*
 * A set's nodes come from slabs of its own, twice as large each time up
 * to EXT_RANGE_SLAB_MAX, and freed nodes go to a list for reuse: a
 * read-write open of an image with fragmented free space creates one node
 * per free range, hundreds of thousands of them, and one malloc() and
 * free() each cost about a third of the open.  The slabs go when the set
 * is cleared (close).
 */
#define EXT_RANGE_SLAB_MIN      64
#define EXT_RANGE_SLAB_MAX      65536

static ExtreeRange *rn_alloc(ExtreeRangeSet *s)
{
    ExtreeRange *x = s->free_nodes;

    if (x) {
        s->free_nodes = x->right;
        return x;
    }
    if (!s->slabs || s->slab_used == s->slab_len) {
        if (!s->slabs) {
            s->slabs = g_ptr_array_new_with_free_func(g_free);
        }
        s->slab_len = s->slab_len ? MIN(s->slab_len * 2, EXT_RANGE_SLAB_MAX)
                                  : EXT_RANGE_SLAB_MIN;
        g_ptr_array_add(s->slabs, g_new(ExtreeRange, s->slab_len));
        s->slab_used = 0;
    }
    x = g_ptr_array_index(s->slabs, s->slabs->len - 1);
    return &x[s->slab_used++];
}

static void rn_release(ExtreeRangeSet *s, ExtreeRange *x)
{
    x->right = s->free_nodes;
    s->free_nodes = x;
}

static ExtreeRange *rn_insert(ExtreeRange *n, ExtreeRange *x)
{
    if (!n) {
        return x;
    }
    if (x->start < n->start) {
        n->left = rn_insert(n->left, x);
        if (n->left->prio > n->prio) {
            ExtreeRange *l = n->left;
            n->left = l->right;
            l->right = n;
            rn_fix(n);
            n = l;
        }
    } else {
        n->right = rn_insert(n->right, x);
        if (n->right->prio > n->prio) {
            ExtreeRange *r = n->right;
            n->right = r->left;
            r->left = n;
            rn_fix(n);
            n = r;
        }
    }
    rn_fix(n);
    return n;
}

static ExtreeRange *rn_join(ExtreeRange *a, ExtreeRange *b)
{
    if (!a || !b) {
        return a ? a : b;
    }
    if (a->prio > b->prio) {
        a->right = rn_join(a->right, b);
        rn_fix(a);
        return a;
    }
    b->left = rn_join(a, b->left);
    rn_fix(b);
    return b;
}

/* Remove the range starting at @start (which exists) from @s's @n */
static ExtreeRange *rn_delete(ExtreeRangeSet *s, ExtreeRange *n,
                              uint64_t start)
{
    if (start < n->start) {
        n->left = rn_delete(s, n->left, start);
    } else if (start > n->start) {
        n->right = rn_delete(s, n->right, start);
    } else {
        ExtreeRange *j = rn_join(n->left, n->right);
        rn_release(s, n);
        return j;
    }
    rn_fix(n);
    return n;
}

/*
 * Give the range starting at @key (which exists) a new start and length
 * that keep it between its neighbours
 */
static void rn_update(ExtreeRange *n, uint64_t key, uint64_t start,
                      uint64_t len)
{
    if (key < n->start) {
        rn_update(n->left, key, start, len);
    } else if (key > n->start) {
        rn_update(n->right, key, start, len);
    } else {
        n->start = start;
        n->len = len;
    }
    rn_fix(n);
}

/* The range with the greatest start <= @off, or NULL.  O(log n) */
ExtreeRange *extree_rs_floor(const ExtreeRangeSet *s, uint64_t off)
{
    ExtreeRange *n = s->root, *best = NULL;

    while (n) {
        if (n->start <= off) {
            best = n;
            n = n->right;
        } else {
            n = n->left;
        }
    }
    return best;
}

/* The range with the smallest start > @off, or NULL.  O(log n) */
ExtreeRange *extree_rs_after(const ExtreeRangeSet *s, uint64_t off)
{
    ExtreeRange *n = s->root, *best = NULL;

    while (n) {
        if (n->start > off) {
            best = n;
            n = n->left;
        } else {
            n = n->right;
        }
    }
    return best;
}

ExtreeRange *extree_rs_last(const ExtreeRangeSet *s)
{
    ExtreeRange *n = s->root;

    while (n && n->right) {
        n = n->right;
    }
    return n;
}

/* The lowest range of at least @len bytes, or NULL.  O(log n) */
ExtreeRange *extree_rs_first_fit(const ExtreeRangeSet *s, uint64_t len)
{
    ExtreeRange *n = s->root;

    if (rn_max(n) < len) {
        return NULL;
    }
    for (;;) {
        if (rn_max(n->left) >= len) {
            n = n->left;
        } else if (n->len >= len) {
            return n;
        } else {
            n = n->right;
        }
    }
}

/* Does any range of @s overlap [start, start + len)?  O(log n) */
bool extree_rs_overlaps(const ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    ExtreeRange *r = extree_rs_floor(s, start + len - 1);

    return r && r->start + r->len > start;
}

/* What a range of @len adds to s->units */
static uint64_t rs_units(const ExtreeRangeSet *s, uint64_t len)
{
    return s->unit ? len / s->unit : 0;
}

void extree_rs_insert(ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    ExtreeRange *x = rn_alloc(s);

    x->start = start;
    x->len = x->maxlen = len;
    x->prio = rs_rand(s);
    x->left = x->right = NULL;
    s->root = rn_insert(s->root, x);
    s->count++;
    s->units += rs_units(s, len);
}

/*
 * Add [start, start + len), merging with neighbours.  The caller checked
 * that it overlaps nothing.  O(log n).
 */
void extree_rs_add(ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    ExtreeRange *prev = extree_rs_floor(s, start);
    ExtreeRange *next = extree_rs_after(s, start);
    bool join_prev = prev && prev->start + prev->len == start;
    bool join_next = next && next->start == start + len;

    s->bytes += len;
    if (join_prev && join_next) {
        uint64_t nlen = next->len;
        s->units += rs_units(s, prev->len + len + nlen) -
                    rs_units(s, prev->len) - rs_units(s, nlen);
        s->root = rn_delete(s, s->root, next->start);
        s->count--;
        rn_update(s->root, prev->start, prev->start, prev->len + len + nlen);
    } else if (join_prev) {
        s->units += rs_units(s, prev->len + len) - rs_units(s, prev->len);
        rn_update(s->root, prev->start, prev->start, prev->len + len);
    } else if (join_next) {
        s->units += rs_units(s, next->len + len) - rs_units(s, next->len);
        rn_update(s->root, next->start, start, next->len + len);
    } else {
        extree_rs_insert(s, start, len);
    }
}

/*
 * Open: add [start, start + len) at or past the end of every range, as
 * the free-space tree hands them out, merging with the last one.  The
 * treap is built along its right spine: amortised O(1) and no search,
 * where extree_rs_add() costs O(log n) per range.  The spine's longest-range
 * fields are stale until extree_rs_append_done(); nothing else may use the set
 * before.
 */
void extree_rs_append(ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    ExtreeRange *x, *last = NULL, *popped = NULL;

    if (!s->spine) {
        s->spine = g_ptr_array_new();
        for (x = s->root; x; x = x->right) {
            g_ptr_array_add(s->spine, x);
        }
    }
    if (s->spine->len) {
        last = g_ptr_array_index(s->spine, s->spine->len - 1);
    }
    g_assert(!last || last->start + last->len <= start);
    s->bytes += len;
    if (last && last->start + last->len == start) {
        s->units += rs_units(s, last->len + len) - rs_units(s, last->len);
        last->len += len;
        return;
    }
    x = rn_alloc(s);
    x->start = start;
    x->len = x->maxlen = len;
    x->prio = rs_rand(s);
    x->right = NULL;
    /* the spine's tail of lower priority becomes the new range's left */
    while (s->spine->len) {
        ExtreeRange *top = g_ptr_array_index(s->spine, s->spine->len - 1);

        if (top->prio >= x->prio) {
            break;
        }
        rn_fix(top);
        popped = top;
        g_ptr_array_set_size(s->spine, s->spine->len - 1);
    }
    x->left = popped;
    if (s->spine->len) {
        ExtreeRange *top = g_ptr_array_index(s->spine, s->spine->len - 1);
        top->right = x;
    } else {
        s->root = x;
    }
    g_ptr_array_add(s->spine, x);
    s->count++;
    s->units += rs_units(s, len);
}

/* The appends are over: the spine's longest-range fields, bottom up */
void extree_rs_append_done(ExtreeRangeSet *s)
{
    if (!s->spine) {
        return;
    }
    for (guint i = s->spine->len; i-- > 0;) {
        rn_fix(g_ptr_array_index(s->spine, i));
    }
    g_ptr_array_free(s->spine, true);
    s->spine = NULL;
}

/* Remove [start, start + len), which lies inside one range.  O(log n). */
void extree_rs_remove(ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    ExtreeRange *r = extree_rs_floor(s, start);
    uint64_t rs = r->start, end = start + len, rend = r->start + r->len;

    g_assert(r->start <= start && end <= rend);
    s->bytes -= len;
    s->units -= rs_units(s, rend - rs);
    if (rs == start && rend == end) {
        s->root = rn_delete(s, s->root, rs);
        s->count--;
    } else if (rs == start) {
        s->units += rs_units(s, rend - end);
        rn_update(s->root, rs, end, rend - end);
    } else {
        s->units += rs_units(s, start - rs);
        rn_update(s->root, rs, rs, start - rs);
        if (end < rend) {
            extree_rs_insert(s, end, rend - end);
        }
    }
}

/* The first range of @s that ends after @pos, or NULL */
ExtreeRange *extree_rs_from(const ExtreeRangeSet *s, uint64_t pos)
{
    ExtreeRange *r = extree_rs_floor(s, pos);

    if (r && r->start + r->len > pos) {
        return r;
    }
    return extree_rs_after(s, pos);
}

/* Add what of [start, start + len) @s does not hold yet */
void extree_rs_union(ExtreeRangeSet *s, uint64_t start, uint64_t len)
{
    uint64_t pos = start, end = start + len;

    while (pos < end) {
        ExtreeRange *r = extree_rs_from(s, pos);

        if (r && r->start <= pos) {
            pos = r->start + r->len;
        } else {
            uint64_t e = r ? MIN(r->start, end) : end;

            extree_rs_add(s, pos, e - pos);
            pos = e;
        }
    }
}

void extree_rs_clear(ExtreeRangeSet *s)
{
    extree_rs_append_done(s);
    if (s->slabs) {
        g_ptr_array_free(s->slabs, true);
    }
    s->slabs = NULL;
    s->free_nodes = NULL;
    s->slab_used = s->slab_len = 0;
    s->root = NULL;
    s->count = s->bytes = s->units = 0;
}
