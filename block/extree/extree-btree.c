/*
 * extree core: copy-on-write B+tree of range items
 *
 * Items are ranges [key, key + length) with a host offset and a type; the
 * extent, free-space and reference count trees are all such trees.  The
 * tree knows nothing of what the items mean: it gets and gives back node
 * space through t->sm (ExtreeSpaceMap), reports every piece of an item a
 * range replace removes to its caller, and never commits.  Extent tree
 * nodes may be shared by several roots (snapshots): a node with more than
 * one reference is copied before it changes (release_node()), and a drop
 * frees only what no other root uses (extree_bt_drop()).
 *
 * btrfs vocabulary: a path is nodes[level] + slots[level], every node on it
 * pinned; bt_search descends from the root (CoW-ing each node on the way
 * when asked to), next_leaf climbs the path to the first ancestor with a
 * next slot and descends its leftmost children, re-using the path.
 *
 * Invariants (checked by extree_node_validate when a node is read):
 *   - leaf items sorted by key, non-overlapping; interior keys strictly
 *     increasing; an interior key equals the first key of its child;
 *   - only the root leaf may be empty; an interior root has >= 2 children;
 *   - a node carrying the running transaction's generation was created in
 *     it and may be changed in place; any other node is copied first (CoW:
 *     new location, old location freed - pending until commit - or, if
 *     shared, one reference fewer).
 * Every change bumps t->seq so that cursors notice.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

void extree_path_release(Extree *t, ExtreePath *p)
{
    for (int l = 0; l < EXTREE_MAX_LEVELS; l++) {
        if (p->nodes[l]) {
            extree_node_unref(t, p->nodes[l]);
            p->nodes[l] = NULL;
        }
    }
}

void extree_tree_expect(Extree *t, ExtreeTree *tree, ExtreeNodeExpect *e)
{
    e->owner = tree->owner;
    e->level = tree->level;
    e->generation = tree->root_gen;
    e->has_first_key = false;
    e->first_key = 0;
    e->key_end = UINT64_MAX;
    e->has_bytes = false;
    e->bytes = 0;
    e->data_end = tree->data_end;
}

/* Exclusive key bound of the node at @level of the path */
static uint64_t path_node_end(ExtreeTree *tree, ExtreePath *p, int level)
{
    for (level++; level <= (int)tree->level; level++) {
        ExtreeNode *parent = p->nodes[level];
        int s = p->slots[level];
        if (s + 1 < (int)node_nritems(parent)) {
            return ptr_key(parent, s + 1);
        }
    }
    return UINT64_MAX;
}

/* What child @slot of @parent (whose own key bound is @parent_end) must be */
static void child_expect(ExtreeTree *tree, const ExtreeNode *parent, int slot,
                         uint64_t parent_end, ExtreeNodeExpect *e)
{
    ExtreeKeyPtr kp;

    ptr_get(parent, slot, &kp);
    e->owner = tree->owner;
    e->level = node_level(parent) - 1;
    e->generation = kp.child_gen;
    e->has_first_key = true;
    e->first_key = kp.key;
    e->key_end = slot + 1 < (int)node_nritems(parent) ?
                 ptr_key(parent, slot + 1) : parent_end;
    e->has_bytes = true;
    e->bytes = kp.bytes;
    e->data_end = tree->data_end;
}

/* Pinned child @slot of @parent (whose own key bound is @parent_end) */
static int get_child(Extree *t, ExtreeTree *tree, ExtreeNode *parent,
                     int slot, uint64_t parent_end, ExtreeNode **out)
{
    ExtreeNodeExpect e;

    child_expect(tree, parent, slot, parent_end, &e);
    return extree_node_get(t, ptr_get_child(parent, slot), &e, out);
}

/*
 * First leaf slot with key >= @key.  What costs here is cache misses, not
 * compares: a 16 KiB leaf spans 256 cache lines and a binary search
 * misses on almost every probe.  Keys are offsets, usually spread about
 * evenly over a leaf, so one interpolation step, checked by two probes a
 * few items apart, mostly leaves a handful of items for the binary search;
 * when the guess is wrong, the two probes still narrow the range.
 */
static int leaf_lower_bound(const ExtreeNode *n, uint64_t key)
{
    int lo = 0, hi = node_nritems(n);

    if (hi > 16) {
        uint64_t first = leaf_key(n, 0), last = leaf_key(n, hi - 1);
        int guess, a, b;

        if (key <= first) {
            return 0;
        }
        if (key > last) {
            return hi;
        }
        /* first < key <= last: the answer is in [1, hi - 1] */
        guess = (double)(key - first) / (double)(last - first) * (hi - 1);
        a = MAX(guess - 2, 1);
        b = MIN(guess + 2, hi - 1);
        if (leaf_key(n, a) < key) {
            lo = a + 1;
            if (leaf_key(n, b) < key) {
                lo = b + 1;
            } else {
                hi = b;
            }
        } else {
            hi = a;
        }
    }
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (leaf_key(n, mid) < key) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* Last interior slot with key <= @key, 0 if none */
static int ptr_slot(const ExtreeNode *n, uint64_t key)
{
    int lo = 0, hi = node_nritems(n);

    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (ptr_key(n, mid) <= key) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo ? lo - 1 : 0;
}

/*
 * Does @n have more than one reference?  Only the nodes of a tree that
 * may be shared (the extent tree with snapshots), and of those only nodes
 * older than t->snap_gen, need the space map asked (spec: Sharing, 4).
 */
static int node_shared(Extree *t, ExtreeTree *tree, const ExtreeNode *n,
                       bool *shared)
{
    uint32_t count = 1;
    int ret = 0;

    if (tree->shared && node_gen(n) < t->snap_gen) {
        ret = t->sm.ops->ref_count(t->sm.opaque, n->bytenr, &count);
        /* about to be freed: a count that lies must not free it */
        if (ret == 0 && count == 1 && tree->verify_unshared) {
            ret = tree->verify_unshared(t, (ExtreeNode *)n);
        }
    }
    *shared = count > 1;
    return ret;
}

/*
 * The references @n holds become the references of a copy too: one more
 * for each child (interior) or each item (leaf, through tree->share_item)
 */
static int share_children(Extree *t, ExtreeTree *tree, const ExtreeNode *n)
{
    int nr = node_nritems(n);
    int ret = 0;

    for (int i = 0; i < nr && ret == 0; i++) {
        if (node_level(n)) {
            ret = t->sm.ops->inc_ref(t->sm.opaque, ptr_get_child(n, i),
                                     t->node_size);
        } else if (tree->share_item) {
            ExtreeItem it;

            leaf_get(n, i, &it);
            ret = tree->share_item(t, &it);
        }
    }
    return ret;
}

/*
 * @n leaves the tree while what it refers to stays (copied, or moved into
 * a sibling): unshared, its location is freed and the references move
 * with the contents; shared, the contents gain a reference each and @n
 * loses one (spec: Sharing, 1).
 */
static int release_node(Extree *t, ExtreeTree *tree, ExtreeNode *n)
{
    bool shared;
    int ret = node_shared(t, tree, n, &shared);

    if (ret == 0 && shared) {
        ret = share_children(t, tree, n);
    }
    if (ret == 0) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, n->bytenr, t->node_size,
                                 true);
    }
    if (!shared) {
        extree_node_drop(t, n);
    }
    return ret;
}

/*
 * Make the node at @level of the path writable in this transaction: copy
 * it to a newly allocated location, point the parent (already writable,
 * we go top-down) or the root at the copy, release the old location.
 */
static int cow_node(Extree *t, ExtreeTree *tree, ExtreePath *p, int level)
{
    ExtreeNode *n = p->nodes[level], *c;
    uint64_t bytenr;
    int ret;

    if (node_gen(n) == t->trans_gen) {
        return 0;
    }
    if (t->read_only) {
        return -EROFS;
    }
    ret = t->sm.ops->new_node(t->sm.opaque, &bytenr);
    if (ret < 0) {
        return ret;
    }
    ret = extree_node_new_copy(t, bytenr, tree->owner, level, n, &c);
    if (ret < 0) {
        return ret;
    }
    if (level == (int)tree->level) {
        tree->root = bytenr;
        tree->root_gen = t->trans_gen;
    } else {
        uint8_t *ip = node_item(p->nodes[level + 1], p->slots[level + 1],
                                EXT_PTR_ISZ);
        ext_st64(ip + EXT_KP_CHILD, bytenr);
        ext_st64(ip + EXT_KP_GEN, t->trans_gen);
    }
    ret = release_node(t, tree, n);
    extree_node_unref(t, n);
    p->nodes[level] = c;
    t->stats.cows++;
    return ret;
}

/* Remember @p as the last path of @tree: pin its nodes, unpin the old */
static void pcache_store(Extree *t, ExtreeTree *tree, const ExtreePath *p)
{
    ExtreePath *pc = &t->pcache[tree->owner];

    for (int l = 0; l < EXTREE_MAX_LEVELS; l++) {
        ExtreeNode *n = l <= (int)tree->level ? p->nodes[l] : NULL;
        if (pc->nodes[l] != n) {
            if (n) {
                extree_node_ref(n);
            }
            if (pc->nodes[l]) {
                extree_node_unref(t, pc->nodes[l]);
            }
            pc->nodes[l] = n;
        }
    }
}

/*
 * The last path's node at @level if it is the node @bytenr the search
 * goes to next (same location, still in the tree, as @e expects), pinned;
 * else NULL.  A node dropped from the tree is an orphan, and a live node is
 * the only one at its location, so this is the node a cache lookup finds;
 * one that disagrees with @e is left to extree_node_get() to report.
 */
static ExtreeNode *pcache_get(Extree *t, ExtreeTree *tree, uint64_t bytenr,
                              const ExtreeNodeExpect *e)
{
    ExtreeNode *n =
        t->pcache[tree->owner].nodes[e->level];

    if (n && n->bytenr == bytenr && !n->orphan && extree_node_matches(n, e)) {
        extree_node_ref(n);
        return n;
    }
    return NULL;
}

/*
 * Descend to the leaf for @dkey; slots[0] = first item with key >= @key.
 * (@dkey = @key - 1 lands on the leaf holding the last item < @key.)
 * With @cow every node on the path is made writable.  Nodes on the tree's
 * last path are taken from there; a search that finds all of them there
 * (same leaf as the last one) is a path hit, not a descent, unless
 * @count_descent.  O(depth log cap).
 */
static int bt_search(Extree *t, ExtreeTree *tree, uint64_t dkey, uint64_t key,
                     ExtreePath *p, bool cow, bool count_descent)
{
    ExtreeNodeExpect e;
    ExtreeNode *n;
    uint64_t end = UINT64_MAX;
    bool lookup = count_descent;
    int ret;

    extree_path_release(t, p);
    p->readahead = 0;
    extree_tree_expect(t, tree, &e);
    n = pcache_get(t, tree, tree->root, &e);
    if (!n) {
        lookup = true;
        ret = extree_node_get(t, tree->root, &e, &n);
        if (ret < 0) {
            return ret;
        }
    }
    for (int level = tree->level; ; level--) {
        int slot;

        p->nodes[level] = n;
        if (cow) {
            ret = cow_node(t, tree, p, level);
            if (ret < 0) {
                goto fail;
            }
            n = p->nodes[level];
        }
        if (level == 0) {
            p->slots[0] = leaf_lower_bound(n, key);
            break;
        }
        slot = ptr_slot(n, dkey);
        p->slots[level] = slot;
        child_expect(tree, n, slot, end, &e);
        n = pcache_get(t, tree, ptr_get_child(n, slot), &e);
        if (!n) {
            lookup = true;
            ret = extree_node_get(t, ptr_get_child(p->nodes[level], slot),
                                  &e, &n);
            if (ret < 0) {
                goto fail;
            }
        }
        if (slot + 1 < (int)node_nritems(p->nodes[level])) {
            end = ptr_key(p->nodes[level], slot + 1);
        }
    }
    if (lookup) {
        t->stats.descents++;
    } else {
        t->stats.path_hits++;
    }
    pcache_store(t, tree, p);
    return 0;
fail:
    extree_path_release(t, p);
    return ret;
}

/*
 * Read ahead the leaves a forward walk will visit next: children
 * p->slots[1].. of p->nodes[1], when the first of them is not cached.
 * The batch doubles along one walk (p->readahead).
 */
static void readahead_leaves(Extree *t, ExtreeTree *tree, ExtreePath *p)
{
    ExtreeNode *parent = p->nodes[1];
    uint64_t parent_end = path_node_end(tree, p, 1);
    int slot = p->slots[1];
    int nr = node_nritems(parent);
    int want = p->readahead ? p->readahead : EXTREE_READAHEAD_FIRST;
    ExtreeNodeExpect *e;
    uint64_t *bytenr;
    ExtreeKeyPtr first;
    int n = 0;

    if (!t->be->ops->pread_many || slot >= nr) {
        return;
    }
    ptr_get(parent, slot, &first);
    if (extree_node_cached(t, first.child)) {
        return;
    }
    p->readahead = MIN(want * 2, EXTREE_READAHEAD_MAX);
    want = MIN(want, nr - slot);
    e = g_new(ExtreeNodeExpect, want);
    bytenr = g_new(uint64_t, want);
    for (; n < want; slot++, n++) {
        bytenr[n] = ptr_get_child(parent, slot);
        child_expect(tree, parent, slot, parent_end, &e[n]);
    }
    extree_node_readahead(t, n, bytenr, e);
    g_free(e);
    g_free(bytenr);
}

/*
 * Move the path to the next leaf.  With @end, for an allocation run that
 * ends at *@end: the subtrees met on the way that continue the run without
 * a hole (first key *@end, child_bytes equal to their key range) and end by
 * @limit are stepped over unread, and *@end moves past them.  A dirty
 * child's child_bytes is stale until the commit: such a child is read
 * instead.  Reads the nodes of about one descent however many leaves the
 * run spans.  The rightmost child of each level has no finite bound and is
 * never skipped, so 1 (no next leaf) comes only with *@end unchanged.
 */
static int next_leaf_skip(Extree *t, ExtreeTree *tree, ExtreePath *p,
                          uint64_t *end, uint64_t limit)
{
    int level = 1;

    for (;;) {
        /* up to the lowest node with a next slot */
        for (; level <= (int)tree->level; level++) {
            if (p->slots[level] + 1 < (int)node_nritems(p->nodes[level])) {
                break;
            }
        }
        if (level > (int)tree->level) {
            return 1;
        }
        p->slots[level]++;
        /* down, stepping over the children the run covers */
        while (level > 0) {
            ExtreeNode *parent = p->nodes[level], *c;
            int nr = node_nritems(parent), s = p->slots[level], ret;
            uint64_t bound = s + 1 < nr ? ptr_key(parent, s + 1)
                                        : path_node_end(tree, p, level);
            ExtreeKeyPtr kp;

            ptr_get(parent, s, &kp);
            if (end && kp.key == *end && bound <= limit &&
                kp.bytes == bound - kp.key &&
                !extree_node_is_dirty(t, kp.child)) {
                *end = bound;
                t->stats.subtrees_skipped++;
                if (s + 1 < nr) {
                    p->slots[level]++;
                    continue;
                }
                level++;
                break;
            }
            if (level == 1) {
                if (t->nowait) {
                    /* a miss here is left to the query with readahead */
                    t->walk_miss = true;
                } else {
                    readahead_leaves(t, tree, p);
                }
            }
            ret = get_child(t, tree, parent, s, path_node_end(tree, p, level),
                            &c);
            t->walk_miss = false;
            if (ret < 0) {
                return ret;
            }
            extree_node_unref(t, p->nodes[level - 1]);
            p->nodes[level - 1] = c;
            p->slots[level - 1] = 0;
            level--;
        }
        if (level == 0) {
            t->stats.next_leaf++;
            return 0;
        }
    }
}

/*
 * Move the path to slot 0 of the next leaf without a root descent.
 * 0: moved, 1: no next leaf, <0: error.  Read-only.
 */
int extree_bt_next_leaf(Extree *t, ExtreeTree *tree, ExtreePath *p)
{
    return next_leaf_skip(t, tree, p, NULL, 0);
}

/*
 * The next leaf, stepping over the subtrees that continue a run of items
 * without a hole from *@end up to @limit (next_leaf_skip())
 */
int extree_bt_next_leaf_covered(Extree *t, ExtreeTree *tree, ExtreePath *p,
                                uint64_t *end, uint64_t limit)
{
    return next_leaf_skip(t, tree, p, end, limit);
}

static int leaves_with_bytes(Extree *t, ExtreeTree *tree, ExtreeNode *n,
                             uint64_t end, uint64_t min_bytes, uint64_t lo,
                             uint64_t hi, ExtreeLeafFn *fn, void *opaque)
{
    int nr = node_nritems(n);

    if (node_level(n) == 0) {
        return fn(t, n, opaque);
    }
    for (int i = 0; i < nr; i++) {
        uint64_t kend = i + 1 < nr ? ptr_key(n, i + 1) : end;
        ExtreeNode *c;
        int ret;

        if (ptr_bytes(n, i) < min_bytes || kend <= lo || ptr_key(n, i) >= hi) {
            continue;
        }
        ret = get_child(t, tree, n, i, end, &c);
        if (ret == 0) {
            ret = leaves_with_bytes(t, tree, c, kend, min_bytes, lo, hi, fn,
                                    opaque);
            extree_node_unref(t, c);
        }
        if (ret) {
            return ret;
        }
    }
    return 0;
}

/*
 * @fn on the leaves of @tree whose items sum to @min_bytes or more (their
 * child_bytes), with keys in [@lo, @hi), in key order, until it returns
 * nonzero (returned then).  Subtrees that hold less are stepped over
 * unread: a search for one long free range among short ones reads
 * nothing below the root.  0 when all are seen, <0 on error.
 */
int extree_bt_leaves_with_bytes(Extree *t, ExtreeTree *tree,
                                uint64_t min_bytes, uint64_t lo, uint64_t hi,
                                ExtreeLeafFn *fn, void *opaque)
{
    ExtreeNodeExpect e;
    ExtreeNode *root;
    int ret;

    extree_tree_expect(t, tree, &e);
    ret = extree_node_get(t, tree->root, &e, &root);
    if (ret < 0) {
        return ret;
    }
    ret = leaves_with_bytes(t, tree, root, UINT64_MAX, min_bytes, lo, hi, fn,
                            opaque);
    extree_node_unref(t, root);
    return ret;
}

static int read_all(Extree *t, ExtreeTree *tree, ExtreeNode *n,
                    uint64_t end, GHashTable *seen)
{
    int nr = node_nritems(n);

    if (node_level(n) == 0) {
        return 0;
    }
    for (int i = 0; i < nr; i++) {
        uint64_t child = ptr_get_child(n, i);
        uint64_t kend = i + 1 < nr ? ptr_key(n, i + 1) : end;
        ExtreeNode *c;
        int ret;

        /*
         * A node seen before is still checked against what this parent
         * expects of it (owner, level, generation, keys), only its
         * subtree is not walked again
         */
        ret = get_child(t, tree, n, i, end, &c);
        if (ret < 0) {
            return ret;
        }
        if (!g_hash_table_contains(seen, &child)) {
            g_hash_table_add(seen, g_memdup2(&child, sizeof(child)));
            ret = read_all(t, tree, c, kend, seen);
        }
        extree_node_unref(t, c);
        if (ret < 0) {
            return ret;
        }
    }
    return 0;
}

/*
 * Read, and so validate, every node of @tree that is not in @seen (a set
 * of uint64_t bytenrs, g_int64_hash, keys freed with it), and add it:
 * under a node already seen the subtree is skipped, so trees that share
 * most nodes (snapshots) cost what they do not share.  A node seen before
 * is still checked against what this tree expects of it (a snapshot's
 * root that names another tree's node is damage).  O(nodes).
 */
int extree_bt_read_all(Extree *t, ExtreeTree *tree, GHashTable *seen)
{
    ExtreeNodeExpect e;
    ExtreeNode *root;
    int ret;

    /* a root seen before (as another tree's node) must still be a root */
    extree_tree_expect(t, tree, &e);
    ret = extree_node_get(t, tree->root, &e, &root);
    if (ret < 0 || g_hash_table_contains(seen, &tree->root)) {
        if (ret == 0) {
            extree_node_unref(t, root);
        }
        return ret;
    }
    g_hash_table_add(seen, g_memdup2(&tree->root, sizeof(tree->root)));
    ret = read_all(t, tree, root, UINT64_MAX, seen);
    extree_node_unref(t, root);
    return ret;
}

/*
 * Read-only path to the leaf slot of the first item with key >= @key
 * (possibly one past the leaf's last item): one descent
 */
int extree_bt_seek(Extree *t, ExtreeTree *tree, uint64_t key, ExtreePath *p)
{
    return bt_search(t, tree, key, key, p, false, true);
}

/*
 * The exclusive key bound of the leaf that holds @key (UINT64_MAX for the
 * last leaf): an update cut there changes one leaf's items at a time.
 * One descent, read-only.
 */
int extree_bt_leaf_end(Extree *t, ExtreeTree *tree, uint64_t key,
                       uint64_t *end)
{
    ExtreePath p = { { 0 } };
    int ret = extree_bt_seek(t, tree, key, &p);

    if (ret == 0) {
        *end = path_node_end(tree, &p, 0);
    }
    extree_path_release(t, &p);
    return ret;
}

/* First item with key >= @key: 0 and *@it, 1 if none, <0 */
int extree_bt_first(Extree *t, ExtreeTree *tree, uint64_t key,
                    ExtreePath *p, ExtreeItem *it)
{
    int ret = bt_search(t, tree, key, key, p, false, true);

    if (ret < 0) {
        return ret;
    }
    while (p->slots[0] >= (int)node_nritems(p->nodes[0])) {
        ret = extree_bt_next_leaf(t, tree, p);
        if (ret) {
            return ret;
        }
    }
    leaf_get(p->nodes[0], p->slots[0], it);
    return 0;
}

int extree_bt_next(Extree *t, ExtreeTree *tree, ExtreePath *p,
                   ExtreeItem *it)
{
    p->slots[0]++;
    while (p->slots[0] >= (int)node_nritems(p->nodes[0])) {
        int ret = extree_bt_next_leaf(t, tree, p);
        if (ret) {
            return ret;
        }
    }
    leaf_get(p->nodes[0], p->slots[0], it);
    return 0;
}

/*
 * The last item with key < @key (*@prev) and the first with key >= @key
 * (*@next).  One search (plus one leaf step for next); none if the last
 * call asked the same and the trees did not change since (alloc_data, then
 * map_data at the same offset).
 */
int extree_bt_find(Extree *t, ExtreeTree *tree, uint64_t key,
                   ExtreeItem *prev, bool *has_prev,
                   ExtreeItem *next, bool *has_next)
{
    ExtreeFindCache *fc = &t->fcache;
    ExtreePath p = { { 0 } };
    int ret, slot;

    if (fc->valid && fc->seq == t->seq && fc->owner == tree->owner &&
        fc->key == key) {
        *prev = fc->prev;
        *has_prev = fc->has_prev;
        *next = fc->next;
        *has_next = fc->has_next;
        t->stats.path_hits++;
        return 0;
    }
    *has_prev = *has_next = false;
    ret = bt_search(t, tree, key ? key - 1 : 0, key, &p, false, false);
    if (ret < 0) {
        return ret;
    }
    slot = p.slots[0];
    if (slot > 0) {
        leaf_get(p.nodes[0], slot - 1, prev);
        *has_prev = true;
    }
    if (slot >= (int)node_nritems(p.nodes[0])) {
        ret = extree_bt_next_leaf(t, tree, &p);
        slot = 0;
    }
    if (ret == 0) {
        leaf_get(p.nodes[0], slot, next);
        *has_next = true;
    }
    extree_path_release(t, &p);
    if (ret < 0) {
        return ret;
    }
    fc->valid = true;
    fc->seq = t->seq;
    fc->owner = tree->owner;
    fc->key = key;
    fc->prev = *prev;
    fc->has_prev = *has_prev;
    fc->next = *next;
    fc->has_next = *has_next;
    return 0;
}

/* ---- structural changes; the path is stale afterwards ---- */

static int item_size(int level)
{
    return level ? EXT_PTR_ISZ : EXT_LEAF_ISZ;
}

static void raw_insert(ExtreeNode *n, int slot, const uint8_t *item, int isz)
{
    int nr = node_nritems(n);
    memmove(node_item(n, slot + 1, isz), node_item(n, slot, isz),
            (size_t)(nr - slot) * isz);
    memcpy(node_item(n, slot, isz), item, isz);
    node_set_nritems(n, nr + 1);
}

/*
 * Remove @count items from @slot; unused space stays zero so that node
 * images (and checksums) are deterministic
 */
static void raw_delete(ExtreeNode *n, int slot, int count, int isz)
{
    int nr = node_nritems(n);
    memmove(node_item(n, slot, isz), node_item(n, slot + count, isz),
            (size_t)(nr - slot - count) * isz);
    memset(node_item(n, nr - count, isz), 0, (size_t)count * isz);
    node_set_nritems(n, nr - count);
}

/* The first key of the node at @level became @key: fix the ancestors */
static void fixup_keys(ExtreeTree *tree, ExtreePath *p, int level,
                       uint64_t key)
{
    for (int l = level + 1; l <= (int)tree->level; l++) {
        ext_st64(node_item(p->nodes[l], p->slots[l], EXT_PTR_ISZ), key);
        if (p->slots[l] != 0) {
            break;
        }
    }
}

/* A new root above the current one (the path's top node) */
static int grow_root(Extree *t, ExtreeTree *tree, ExtreePath *p)
{
    int level = tree->level;
    ExtreeNode *old = p->nodes[level], *root;
    ExtreeKeyPtr kp;
    uint64_t bytenr;
    int ret;

    if (level + 1 >= EXTREE_MAX_LEVELS) {
        return -EFBIG;
    }
    ret = t->sm.ops->new_node(t->sm.opaque, &bytenr);
    if (ret < 0) {
        return ret;
    }
    ret = extree_node_new(t, bytenr, tree->owner, level + 1, &root);
    if (ret < 0) {
        return ret;
    }
    kp.key = node_key(old, 0);
    kp.child = old->bytenr;
    kp.child_gen = node_gen(old);
    kp.bytes = extree_node_subtree_bytes(old);
    ptr_set(root, 0, &kp);
    node_set_nritems(root, 1);
    tree->root = bytenr;
    tree->root_gen = t->trans_gen;
    tree->level = level + 1;
    p->nodes[level + 1] = root;
    p->slots[level + 1] = 0;
    return 0;
}

/*
 * Insert raw @item at (@level, @slot) of a writable path, splitting full
 * nodes bottom-up.  A split at the right end (appending) keeps the left node
 * full and starts the right one with the new item only; at the left end it
 * keeps all old items together: sequential insertion fills nodes ~100%.
 */
static int insert_at(Extree *t, ExtreeTree *tree, ExtreePath *p, int level,
                     int slot, const uint8_t *item)
{
    ExtreeNode *n = p->nodes[level], *right, *dst;
    int isz = item_size(level);
    int cap = level ? t->ptr_cap : t->leaf_cap;
    int nr = node_nritems(n);
    int mid, dslot, ret;
    uint8_t raw[EXT_PTR_ISZ];
    ExtreeKeyPtr kp;
    uint64_t bytenr;

    t->seq++;
    if (nr < cap) {
        raw_insert(n, slot, item, isz);
        if (slot == 0) {
            fixup_keys(tree, p, level, ext_ld64(item));
        }
        return 0;
    }
    if (level == (int)tree->level) {
        ret = grow_root(t, tree, p);
        if (ret < 0) {
            return ret;
        }
    }
    mid = slot == nr ? nr : slot == 0 ? 0 : nr / 2;
    ret = t->sm.ops->new_node(t->sm.opaque, &bytenr);
    if (ret < 0) {
        return ret;
    }
    ret = extree_node_new(t, bytenr, tree->owner, level, &right);
    if (ret < 0) {
        return ret;
    }
    memcpy(node_item(right, 0, isz), node_item(n, mid, isz),
           (size_t)(nr - mid) * isz);
    memset(node_item(n, mid, isz), 0, (size_t)(nr - mid) * isz);
    node_set_nritems(right, nr - mid);
    node_set_nritems(n, mid);
    if (slot < mid || mid == 0) {
        dst = n;
        dslot = slot;
    } else {
        dst = right;
        dslot = slot - mid;
    }
    raw_insert(dst, dslot, item, isz);
    if (dst == n && dslot == 0) {
        fixup_keys(tree, p, level, ext_ld64(item));
    }
    kp.key = node_key(right, 0);
    kp.child = right->bytenr;
    kp.child_gen = t->trans_gen;
    /* both halves are dirty: the commit sets their child_bytes again */
    kp.bytes = extree_node_subtree_bytes(right);
    extree_node_unref(t, right);
    ext_st64(raw, kp.key);
    ext_st64(raw + EXT_KP_CHILD, kp.child);
    ext_st64(raw + EXT_KP_GEN, kp.child_gen);
    ext_st64(raw + EXT_KP_BYTES, kp.bytes);
    return insert_at(t, tree, p, level + 1, p->slots[level + 1] + 1, raw);
}

/* Unlink a node from the tree: its location is freed */
static int free_node(Extree *t, ExtreeNode *n)
{
    int ret = t->sm.ops->dec_ref(t->sm.opaque, n->bytenr, t->node_size,
                                 true);
    extree_node_drop(t, n);
    return ret;
}

/*
 * The root is interior with one child: the child becomes the root.  Only
 * the first root is this transaction's; below it the root may come to an
 * uncopied node that a snapshot shares, and when that one has a single
 * child too, it is released like a copied node: its child gains the
 * reference the root descriptor now holds.
 */
static int collapse_root(Extree *t, ExtreeTree *tree)
{
    while (tree->level > 0) {
        ExtreeNodeExpect e;
        ExtreeNode *root;
        ExtreeKeyPtr kp;
        int ret;

        extree_tree_expect(t, tree, &e);
        ret = extree_node_get(t, tree->root, &e, &root);
        if (ret < 0) {
            return ret;
        }
        if (node_nritems(root) != 1) {
            extree_node_unref(t, root);
            return 0;
        }
        ptr_get(root, 0, &kp);
        tree->root = kp.child;
        tree->root_gen = kp.child_gen;
        tree->level--;
        ret = release_node(t, tree, root);
        extree_node_unref(t, root);
        if (ret < 0) {
            return ret;
        }
    }
    return 0;
}

static int delete_at(Extree *t, ExtreeTree *tree, ExtreePath *p, int level,
                     int slot, int count);

/*
 * The node at @level is under a quarter full: merge it with a sibling
 * under the same parent when both fit in 3/4 of a node (hysteresis against
 * split/merge ping-pong).
 */
static int try_merge(Extree *t, ExtreeTree *tree, ExtreePath *p, int level)
{
    ExtreeNode *n = p->nodes[level], *parent = p->nodes[level + 1], *sib;
    int ps = p->slots[level + 1], pn = node_nritems(parent);
    int isz = item_size(level), cap = level ? t->ptr_cap : t->leaf_cap;
    int nr = node_nritems(n), snr, ret;

    if (ps + 1 < pn) {
        /*
         * right sibling folds into n; it need not be copied, it goes (if
         * shared, its contents gain the references n now holds)
         */
        ret = get_child(t, tree, parent, ps + 1,
                        path_node_end(tree, p, level + 1), &sib);
        if (ret < 0) {
            return ret;
        }
        snr = node_nritems(sib);
        if (nr + snr <= cap * 3 / 4) {
            memcpy(node_item(n, nr, isz), node_item(sib, 0, isz),
                   (size_t)snr * isz);
            node_set_nritems(n, nr + snr);
            ret = release_node(t, tree, sib);
            extree_node_unref(t, sib);
            if (ret < 0) {
                return ret;
            }
            return delete_at(t, tree, p, level + 1, ps + 1, 1);
        }
        extree_node_unref(t, sib);
    }
    if (ps > 0) {
        /* n folds into its left sibling, which must be made writable */
        ExtreePath sp = { { 0 } };
        ret = get_child(t, tree, parent, ps - 1, ptr_key(parent, ps), &sib);
        if (ret < 0) {
            return ret;
        }
        snr = node_nritems(sib);
        if (nr + snr > cap * 3 / 4) {
            extree_node_unref(t, sib);
            return 0;
        }
        /* a one-level path to CoW the sibling under the same parent */
        sp.nodes[level] = sib;
        sp.nodes[level + 1] = parent;
        sp.slots[level + 1] = ps - 1;
        extree_node_ref(parent);
        ret = cow_node(t, tree, &sp, level);
        if (ret == 0) {
            sib = sp.nodes[level];
            memcpy(node_item(sib, snr, isz), node_item(n, 0, isz),
                   (size_t)nr * isz);
            node_set_nritems(sib, nr + snr);
            ret = free_node(t, n);
        }
        extree_path_release(t, &sp);
        if (ret < 0) {
            return ret;
        }
        return delete_at(t, tree, p, level + 1, ps, 1);
    }
    return 0;
}

/*
 * Remove @count items at (@level, @slot) of a writable path; free empty
 * nodes, merge underfull ones, collapse a single-child root
 */
static int delete_at(Extree *t, ExtreeTree *tree, ExtreePath *p, int level,
                     int slot, int count)
{
    ExtreeNode *n = p->nodes[level];
    int cap = level ? t->ptr_cap : t->leaf_cap;
    int nr;
    int ret;

    t->seq++;
    raw_delete(n, slot, count, item_size(level));
    nr = node_nritems(n);
    if (level == (int)tree->level) {
        return level > 0 && nr == 1 ? collapse_root(t, tree) : 0;
    }
    if (nr == 0) {
        ret = free_node(t, n);
        if (ret < 0) {
            return ret;
        }
        return delete_at(t, tree, p, level + 1, p->slots[level + 1], 1);
    }
    if (slot == 0) {
        fixup_keys(tree, p, level, node_key(n, 0));
    }
    if (nr < cap / 4) {
        return try_merge(t, tree, p, level);
    }
    return 0;
}

/* ---- item operations: one CoW descent each ---- */

static void encode_item(uint8_t *raw, const ExtreeItem *it)
{
    ext_st64(raw, it->key);
    ext_st64(raw + EXT_IT_LEN, it->length);
    ext_st64(raw + EXT_IT_HOST, it->host);
    ext_st32(raw + EXT_IT_TYPE, it->type);
    ext_st32(raw + EXT_IT_FLAGS, it->flags);
}

/* Write path to the item with key @key exactly */
static int search_exact(Extree *t, ExtreeTree *tree, uint64_t key,
                        ExtreePath *p)
{
    int ret = bt_search(t, tree, key, key, p, true, false);

    if (ret < 0) {
        return ret;
    }
    if (p->slots[0] >= (int)node_nritems(p->nodes[0]) ||
        leaf_key(p->nodes[0], p->slots[0]) != key) {
        extree_path_release(t, p);
        return extree_corrupt(t, 0, "corrupt %s: item 0x%" PRIx64
                              " vanished", extree_tree_name(tree->owner),
                              key);
    }
    return 0;
}

static int bt_insert_item(Extree *t, ExtreeTree *tree, const ExtreeItem *it)
{
    ExtreePath p = { { 0 } };
    uint8_t raw[EXT_LEAF_ISZ];
    int ret = bt_search(t, tree, it->key, it->key, &p, true, false);

    if (ret == 0) {
        encode_item(raw, it);
        ret = insert_at(t, tree, &p, 0, p.slots[0], raw);
    }
    extree_path_release(t, &p);
    if (ret == 0) {
        tree->nitems++;
        tree->total += it->length;
    }
    return ret;
}

/* Replace the item with key @key by @it, which sorts at the same place */
static int bt_update_item(Extree *t, ExtreeTree *tree, uint64_t key,
                          const ExtreeItem *it)
{
    ExtreePath p = { { 0 } };
    int ret = search_exact(t, tree, key, &p);

    if (ret < 0) {
        return ret;
    }
    tree->total += it->length - leaf_len(p.nodes[0], p.slots[0]);
    leaf_set(p.nodes[0], p.slots[0], it);
    if (p.slots[0] == 0 && it->key != key) {
        fixup_keys(tree, &p, 0, it->key);
    }
    t->seq++;
    extree_path_release(t, &p);
    return 0;
}

/* Tell the caller that @old's part [from, to) left the tree */
static int report_removed(ExtreeRemovedFn *removed, void *opaque,
                          const ExtreeItem *old, uint64_t from, uint64_t to)
{
    ExtreeItem piece = *old;

    if (!removed) {
        return 0;
    }
    piece.key = from;
    piece.length = to - from;
    piece.host = extree_item_host_at(old, from);
    return removed(opaque, &piece);
}

/*
 * Insert @it into a hole, merged with mergeable neighbours.  @known: the
 * caller's *@prev / *@next (items before and from it->key) are current.
 */
static int insert_merged(Extree *t, ExtreeTree *tree, const ExtreeItem *it,
                         bool known, ExtreeItem prev, bool hp,
                         ExtreeItem next, bool hn)
{
    ExtreeItem m;
    bool ml, mr;
    int ret = 0;

    if (!known) {
        ret = extree_bt_find(t, tree, it->key, &prev, &hp, &next, &hn);
        if (ret < 0) {
            return ret;
        }
    }
    ml = hp && extree_items_mergeable(&prev, it);
    mr = hn && extree_items_mergeable(it, &next);
    if (ml && mr) {
        ExtreePath p = { { 0 } };
        ret = search_exact(t, tree, next.key, &p);
        if (ret == 0) {
            ret = delete_at(t, tree, &p, 0, p.slots[0], 1);
        }
        extree_path_release(t, &p);
        if (ret < 0) {
            return ret;
        }
        tree->nitems--;
        tree->total -= next.length;
        m = prev;
        m.length += it->length + next.length;
        return bt_update_item(t, tree, prev.key, &m);
    } else if (ml) {
        m = prev;
        m.length += it->length;
        return bt_update_item(t, tree, prev.key, &m);
    } else if (mr) {
        m = *it;
        m.length += next.length;
        return bt_update_item(t, tree, next.key, &m);
    }
    return bt_insert_item(t, tree, it);
}

/*
 * Make [start, start + len) of @tree hold @it (one item, merged with
 * mergeable neighbours) or, if it->type is 0, nothing.  Items overlapping
 * the range are trimmed, split or deleted; DATA space they no longer
 * reference is freed.  O(log n + items removed); a handful of descents.
 */
int extree_bt_replace(Extree *t, ExtreeTree *tree, const ExtreeItem *it,
                      uint64_t start, uint64_t len,
                      ExtreeRemovedFn *removed, void *opaque)
{
    uint64_t end = start + len;
    ExtreeItem prev, next, none = { 0 };
    bool hp, hn, changed = false;
    int ret;

    if (!it->type) {
        it = &none;
    }
    ret = extree_bt_find(t, tree, start, &prev, &hp, &next, &hn);
    if (ret < 0) {
        return ret;
    }
    /*
     * An item starting before the range reaches into it: keep its head
     * (and its tail beyond the range)
     */
    if (hp && prev.key + prev.length > start) {
        uint64_t pend = prev.key + prev.length;
        ExtreeItem head = prev;

        changed = true;
        head.length = start - prev.key;
        /*
         * The update first: it copies a shared leaf, which gives the
         * item's space the copy's reference before the piece drops it
         */
        ret = bt_update_item(t, tree, prev.key, &head);
        if (ret == 0) {
            ret = report_removed(removed, opaque, &prev, start,
                                 MIN(pend, end));
        }
        if (ret == 0 && pend > end) {
            ExtreeItem tail = prev;
            tail.key = end;
            tail.length = pend - end;
            tail.host = extree_item_host_at(&prev, end);
            ret = bt_insert_item(t, tree, &tail);
        }
        if (ret < 0) {
            return ret;
        }
    }
    /*
     * Items starting inside the range: delete them, a leaf's worth per
     * descent, or cut the front of the last one
     */
    while (hn && next.key < end) {
        ExtreePath p = { { 0 } };

        changed = true;
        if (next.key + next.length > end) {
            ExtreeItem cut = next;
            cut.key = end;
            cut.length = next.key + next.length - end;
            cut.host = extree_item_host_at(&next, end);
            ret = bt_update_item(t, tree, next.key, &cut);
            if (ret == 0) {
                ret = report_removed(removed, opaque, &next, next.key, end);
            }
            if (ret < 0) {
                return ret;
            }
            break;
        }
        ret = search_exact(t, tree, next.key, &p);
        if (ret == 0) {
            ExtreeNode *leaf = p.nodes[0];
            int s = p.slots[0], nr = node_nritems(leaf), count = 0;
            uint64_t gone = 0;

            for (int i = s; i < nr && ret == 0; i++) {
                ExtreeItem x;
                leaf_get(leaf, i, &x);
                if (x.key >= end || x.key + x.length > end) {
                    break;
                }
                ret = report_removed(removed, opaque, &x, x.key,
                                     x.key + x.length);
                count++;
                gone += x.length;
            }
            if (ret == 0) {
                ret = delete_at(t, tree, &p, 0, s, count);
                tree->nitems -= count;
                tree->total -= gone;
            }
        }
        extree_path_release(t, &p);
        if (ret < 0) {
            return ret;
        }
        ret = extree_bt_find(t, tree, start, &prev, &hp, &next, &hn);
        if (ret < 0) {
            return ret;
        }
    }
    if (!it->type) {
        return 0;
    }
    {
        ExtreeItem n = *it;
        n.key = start;
        n.length = len;
        return insert_merged(t, tree, &n, !changed, prev, hp, next, hn);
    }
}


/* ---- probes into other roots ---- */

void extree_probe_release(Extree *t, ExtreeProbe *pr)
{
    extree_path_release(t, &pr->p);
}

/*
 * The node at @level of pr->tree whose key range holds @key (*@out, pinned
 * by the probe), or NULL if the tree is not that deep.  Levels of the last
 * probe's path whose range still holds @key are kept: probes at
 * increasing keys cost one walk of the nodes they reach, each node
 * validated against its parent as on any descent.
 */
int extree_bt_probe(Extree *t, ExtreeProbe *pr, uint64_t key,
                    unsigned level, ExtreeNode **out)
{
    ExtreeTree *tree = pr->tree;
    ExtreePath *p = &pr->p;
    int l = tree->level;
    int ret;

    *out = NULL;
    if (level > tree->level) {
        return 0;
    }
    /* the lowest kept level whose range holds @key */
    while (l > (int)level && p->nodes[l - 1] &&
           key >= pr->lo[l - 1] && key < pr->hi[l - 1]) {
        l--;
    }
    if (!p->nodes[tree->level] || p->nodes[tree->level]->bytenr != tree->root) {
        ExtreeNodeExpect e;

        extree_path_release(t, p);
        extree_tree_expect(t, tree, &e);
        ret = extree_node_get(t, tree->root, &e, &p->nodes[tree->level]);
        if (ret < 0) {
            return ret;
        }
        pr->lo[tree->level] = 0;
        pr->hi[tree->level] = UINT64_MAX;
        l = tree->level;
    }
    for (; l > (int)level; l--) {
        ExtreeNode *n = p->nodes[l];
        int slot = ptr_slot(n, key);
        ExtreeNodeExpect e;

        for (int k = l - 1; k >= 0 && p->nodes[k]; k--) {
            extree_node_unref(t, p->nodes[k]);
            p->nodes[k] = NULL;
        }
        child_expect(tree, n, slot, pr->hi[l], &e);
        ret = extree_node_get(t, ptr_get_child(n, slot), &e, &p->nodes[l - 1]);
        if (ret < 0) {
            return ret;
        }
        p->slots[l] = slot;
        pr->lo[l - 1] = ptr_key(n, slot);
        pr->hi[l - 1] = e.key_end;
        pr->slot_hint = 0;
    }
    *out = p->nodes[level];
    return 0;
}

/*
 * Does pr->tree reach the node @n?  A tree that holds @n holds it at its
 * first key and level (its parent's key is that first key): one probe.
 */
int extree_bt_probe_reaches(Extree *t, ExtreeProbe *pr, ExtreeNode *n,
                            bool *reaches)
{
    ExtreeNode *m = NULL;
    int ret = 0;

    if (pr->tree->root == n->bytenr) {
        m = n;
    } else if (node_nritems(n)) {
        ret = extree_bt_probe(t, pr, node_key(n, 0), node_level(n), &m);
    }
    *reaches = ret == 0 && m && m->bytenr == n->bytenr;
    return ret;
}

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
            child_expect(tree, n, i, key_end, &e[k]);
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

            child_expect(tree, n, i, e->key_end, &ce);
            ret = drop_node(t, tree, ptr_get_child(n, i), &ce, removed,
                            opaque, guard);
        } else if (removed) {
            ExtreeItem it;

            leaf_get(n, i, &it);
            ret = removed(opaque, &it);
        }
    }
    if (ret == 0) {
        ret = free_node(t, n);
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
