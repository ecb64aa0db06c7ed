/*
 * extree core: B+tree structural changes (insert, delete, split, merge,
 * root growth and collapse) and item operations (insert, update, range
 * replace), each one copy-on-write descent; the path is stale afterwards
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"
#include "extree-btree-int.h"

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
int extree_bt_free_node(Extree *t, ExtreeNode *n)
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
        ret = extree_bt_release(t, tree, root);
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
        ret = extree_bt_child(t, tree, parent, ps + 1,
                              extree_bt_node_end(tree, p, level + 1), &sib);
        if (ret < 0) {
            return ret;
        }
        snr = node_nritems(sib);
        if (nr + snr <= cap * 3 / 4) {
            memcpy(node_item(n, nr, isz), node_item(sib, 0, isz),
                   (size_t)snr * isz);
            node_set_nritems(n, nr + snr);
            ret = extree_bt_release(t, tree, sib);
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
        ret = extree_bt_child(t, tree, parent, ps - 1, ptr_key(parent, ps),
                              &sib);
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
        ret = extree_bt_cow(t, tree, &sp, level);
        if (ret == 0) {
            sib = sp.nodes[level];
            memcpy(node_item(sib, snr, isz), node_item(n, 0, isz),
                   (size_t)nr * isz);
            node_set_nritems(sib, nr + snr);
            ret = extree_bt_free_node(t, n);
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
        ret = extree_bt_free_node(t, n);
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
    int ret = extree_bt_search(t, tree, key, key, p, true, false);

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
    int ret = extree_bt_search(t, tree, it->key, it->key, &p, true, false);

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
static int report_removed(ExtreeTree *tree, ExtreeRemovedFn *removed,
                          void *opaque, const ExtreeItem *old, uint64_t from,
                          uint64_t to)
{
    ExtreeItem piece = *old;

    if (!removed) {
        return 0;
    }
    piece.key = from;
    piece.length = to - from;
    piece.host = tree->vt->host_at(old, from);
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
    ml = hp && tree->vt->mergeable(&prev, it);
    mr = hn && tree->vt->mergeable(it, &next);
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
            ret = report_removed(tree, removed, opaque, &prev, start,
                                 MIN(pend, end));
        }
        if (ret == 0 && pend > end) {
            ExtreeItem tail = prev;
            tail.key = end;
            tail.length = pend - end;
            tail.host = tree->vt->host_at(&prev, end);
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
            cut.host = tree->vt->host_at(&next, end);
            ret = bt_update_item(t, tree, next.key, &cut);
            if (ret == 0) {
                ret = report_removed(tree, removed, opaque, &next, next.key,
                                     end);
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
                ret = report_removed(tree, removed, opaque, &x, x.key,
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
