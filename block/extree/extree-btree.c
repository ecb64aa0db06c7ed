/*
 * extree core: copy-on-write B+tree of range items: the spine (search,
 * copy-on-write of a path) and the read side (walks, probes)
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
 * The tree's files: this one (search, spine, walks, probes),
 * extree-btree-edit.c (structural changes and item operations) and
 * extree-btree-drop.c (whole trees), as dm persistent-data's dm-btree.c,
 * dm-btree-remove.c and dm-btree-spine.c.  What the items mean comes from
 * each tree's value type (ExtreeValueType).
 */

#include "extree-int.h"
#include "extree-btree-int.h"

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
uint64_t extree_bt_node_end(ExtreeTree *tree, ExtreePath *p, int level)
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
void extree_bt_child_expect(ExtreeTree *tree, const ExtreeNode *parent,
                            int slot, uint64_t parent_end,
                            ExtreeNodeExpect *e)
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
int extree_bt_child(Extree *t, ExtreeTree *tree, ExtreeNode *parent,
                    int slot, uint64_t parent_end, ExtreeNode **out)
{
    ExtreeNodeExpect e;

    extree_bt_child_expect(tree, parent, slot, parent_end, &e);
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
 * older than t->snap.gen, need the space map asked (spec: Sharing, 4).
 */
static int node_shared(Extree *t, ExtreeTree *tree, const ExtreeNode *n,
                       bool *shared)
{
    uint32_t count = 1;
    int ret = 0;

    if (tree->shared && node_gen(n) < t->snap.gen) {
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
int extree_bt_release(Extree *t, ExtreeTree *tree, ExtreeNode *n)
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
int extree_bt_cow(Extree *t, ExtreeTree *tree, ExtreePath *p, int level)
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
    ret = extree_bt_release(t, tree, n);
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
int extree_bt_search(Extree *t, ExtreeTree *tree, uint64_t dkey,
                     uint64_t key, ExtreePath *p, bool cow,
                     bool count_descent)
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
            ret = extree_bt_cow(t, tree, p, level);
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
        extree_bt_child_expect(tree, n, slot, end, &e);
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
    uint64_t parent_end = extree_bt_node_end(tree, p, 1);
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
        extree_bt_child_expect(tree, parent, slot, parent_end, &e[n]);
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
                                        : extree_bt_node_end(tree, p, level);
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
                if (t->nc.nowait) {
                    /* a miss here is left to the query with readahead */
                    t->nc.walk_miss = true;
                } else {
                    readahead_leaves(t, tree, p);
                }
            }
            ret = extree_bt_child(t, tree, parent, s,
                                  extree_bt_node_end(tree, p, level), &c);
            t->nc.walk_miss = false;
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
        ret = extree_bt_child(t, tree, n, i, end, &c);
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
        ret = extree_bt_child(t, tree, n, i, end, &c);
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
    return extree_bt_search(t, tree, key, key, p, false, true);
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
        *end = extree_bt_node_end(tree, &p, 0);
    }
    extree_path_release(t, &p);
    return ret;
}

/* First item with key >= @key: 0 and *@it, 1 if none, <0 */
int extree_bt_first(Extree *t, ExtreeTree *tree, uint64_t key,
                    ExtreePath *p, ExtreeItem *it)
{
    int ret = extree_bt_search(t, tree, key, key, p, false, true);

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
    ret = extree_bt_search(t, tree, key ? key - 1 : 0, key, &p, false, false);
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
        extree_bt_child_expect(tree, n, slot, pr->hi[l], &e);
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
