/*
 * extree core: guest ranges to host extents
 *
 * The extent semantics over the B+tree of range items: DATA maps guest
 * to host, ZERO reads as zeroes, no item is a hole.  Mapping, zeroing and
 * punching replace a guest range and give the DATA space that left the
 * tree back to the space map; placement puts new data next to its guest
 * neighbour's extent; the cursor answers block status in one forward pass
 * over the leaves.  Nothing here commits: extree-txn.c decides that.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

/* ---- updates ---- */

/*
 * A block-aligned range of the virtual disk, or with snapshots of the VM
 * state area (extree-snap.c writes VM state there)
 */
/*
 * Extent items (ExtreeValueType): adjacent items of one type merge into
 * one when their host ranges are contiguous too (ZERO items have none); a
 * compressed item is never merged nor split (one payload each)
 */
static bool extent_mergeable(const ExtreeItem *a, const ExtreeItem *b)
{
    if (a->key + a->length != b->key || a->type != b->type) {
        return false;
    }
    switch (a->type) {
    case EXTREE_ITEM_ZERO:
        return true;
    case EXTREE_ITEM_COMPRESSED:
        return false;
    default:
        return a->host + a->length == b->host;
    }
}

static uint64_t extent_host_at(const ExtreeItem *it, uint64_t key)
{
    switch (it->type) {
    case EXTREE_ITEM_ZERO:
    case EXTREE_ITEM_COMPRESSED:
        return it->host;
    default:
        return it->host + (key - it->key);
    }
}

const ExtreeValueType extree_extent_vt = {
    .mergeable = extent_mergeable,
    .host_at = extent_host_at,
};

static bool range_ok(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t vend = EXTREE_ROUND_UP(t->virtual_size, t->block_size);

    if (!bytes || !EXTREE_IS_ALIGNED(guest | bytes, t->block_size)) {
        return false;
    }
    if (guest < vend) {
        return bytes <= vend - guest;
    }
    return extree_has_refs(t) && guest >= EXTREE_VMSTATE_BASE &&
           guest < EXTREE_VMSTATE_END && bytes <= EXTREE_VMSTATE_END - guest;
}

/*
 * Every snapshot's root, read and checked against its entry: a root that
 * names another tree's node (tests/fuzz/fixed/snap-root-names-free-root)
 * must stop the first update before that tree moves off the node.
 * O(snapshots).
 */
static int probe_snap_roots(Extree *t)
{
    for (unsigned i = 0; t->snap.list && i < t->snap.list->len; i++) {
        ExtreeNodeExpect e;
        ExtreeNode *root;
        ExtreeTree tree;
        int ret;

        extree_snap_tree(t, &g_array_index(t->snap.list, ExtreeSnap, i), &tree);
        extree_tree_expect(t, &tree, &e);
        ret = extree_node_get(t, tree.root, &e, &root);
        if (ret < 0) {
            return ret;
        }
        extree_node_unref(t, root);
    }
    return 0;
}

/*
 * Before the first update of a handle.  New space starts at host_end: a
 * superblock whose host_end was lowered below blocks still in use would
 * let new data overwrite them, and the nodes that use them would pass
 * their checks once host_end had grown past
 * (tests/fuzz/fixed/host-end-lowered-vmstate).  Such blocks exist only
 * where the backend holds bytes past host_end (base_tail): after a clean
 * close the file ends at host_end, and nothing lies past it that a node
 * could use.  Only then is every tree read (the
 * live extent tree, the free-space and reference count trees, every
 * snapshot's), so that a node of the opened state that points at or past
 * its host_end is found (extree-node.c, host_limit()) before any space
 * there is handed out: O(nodes), shared subtrees read once.  Otherwise
 * O(snapshots): their roots are checked.  Once per handle.
 */
int extree_probe_end(Extree *t)
{
    uint32_t last = extree_has_refs(t) ? EXTREE_TREE_REFS : EXTREE_TREE_FREE;
    GHashTable *seen;
    int ret = 0;

    if (t->end_probed) {
        return 0;
    }
    if (!t->base_tail) {
        ret = probe_snap_roots(t);
    } else {
        seen = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free,
                                     NULL);
        for (uint32_t o = EXTREE_TREE_EXTENT; o <= last && ret == 0; o++) {
            ret = extree_bt_read_all(t, &t->trees[o], seen);
        }
        for (unsigned i = 0; ret == 0 && t->snap.list && i < t->snap.list->len;
             i++) {
            ExtreeTree tree;

            extree_snap_tree(t, &g_array_index(t->snap.list, ExtreeSnap, i),
                             &tree);
            ret = extree_bt_read_all(t, &tree, seen);
        }
        g_hash_table_destroy(seen);
    }
    /*
     * Like a read error half-way through an update: the handle takes no
     * update any more (it changed nothing, but what it could not read may
     * be anything)
     */
    t->end_probed = ret == 0;
    t->broken |= ret < 0;
    return ret;
}

static int check_update(Extree *t, uint64_t guest, uint64_t bytes)
{
    int ret = extree_check_writable(t);

    if (ret < 0) {
        return ret;
    }
    if (!range_ok(t, guest, bytes)) {
        return -EINVAL;
    }
    return extree_probe_end(t);
}

/* What a range replace of the extent tree puts in place */
typedef struct ReleaseCtx {
    Extree *t;
    const ExtreeItem *keep;
} ReleaseCtx;

static int snapshots_use(Extree *t, uint64_t guest, uint64_t bytes,
                         uint64_t host);
static int leaf_first_ending_after(const ExtreeNode *leaf, uint64_t pos);

static int drop_data(Extree *t, uint64_t start, uint64_t len)
{
    return t->sm.ops->dec_ref(t->sm.opaque, start, len, false);
}

/*
 * The live tree lets go of DATA [host, + len) it mapped at @guest: blocks
 * whose count says 1 are freed, so no snapshot may map them there
 * (snapshots_use()); counts of 2 and more are only lowered
 */
static int drop_live_data(Extree *t, uint64_t guest, uint64_t host,
                          uint64_t len)
{
    if (t->snap.list && t->snap.list->len &&
        !extree_refs_all_shared(t, host, len)) {
        int ret = snapshots_use(t, guest, len, host);

        if (ret < 0) {
            return ret;
        }
    }
    return drop_data(t, host, len);
}

/*
 * The live tree lets go of COMPRESSED item @it, whole (never split): its
 * payload loses a reference.  A snapshot that maps the same payload at the
 * same guest offset needs a count of 2 or more on it, as for DATA.
 */
static int drop_live_compressed(Extree *t, const ExtreeItem *it)
{
    uint64_t hbytes = extree_item_host_bytes(it, t->block_size);
    bool counted = extree_refs_all_shared(t, it->host, hbytes);

    for (unsigned i = 0; !counted && t->snap.list && i < t->snap.list->len;
         i++) {
        const ExtreeSnap *sn = &g_array_index(t->snap.list, ExtreeSnap, i);
        ExtreeTree tree;
        ExtreeProbe pr = { .tree = &tree };
        ExtreeNode *leaf;
        ExtreeItem x = { 0 };
        int ret, slot;

        extree_snap_tree(t, sn, &tree);
        ret = extree_bt_probe(t, &pr, it->key, 0, &leaf);
        if (ret == 0) {
            slot = leaf_first_ending_after(leaf, it->key);
            if (slot < (int)node_nritems(leaf)) {
                leaf_get(leaf, slot, &x);
            }
        }
        extree_probe_release(t, &pr);
        if (ret < 0) {
            return ret;
        }
        if (x.key == it->key && x.type == EXTREE_ITEM_COMPRESSED &&
            x.host == it->host) {
            return extree_corrupt(t, it->host, "corrupt reference count "
                                  "tree: compressed payload at offset 0x%"
                                  PRIx64 " has 1 reference, snapshot '%s' "
                                  "maps it too", it->host, sn->id);
        }
    }
    return drop_data(t, it->host, hbytes);
}

/*
 * A piece of an extent left the tree: its DATA space loses its reference,
 * except what the new item re-uses (re-mapping in place)
 */
static int release_space(void *opaque, const ExtreeItem *old)
{
    ReleaseCtx *rc = opaque;
    const ExtreeItem *keep = rc->keep;
    uint64_t hs, he, ks, ke;
    int ret = 0;

    if (old->type == EXTREE_ITEM_COMPRESSED) {
        return drop_live_compressed(rc->t, old);
    }
    if (old->type != EXTREE_ITEM_DATA) {
        return 0;
    }
    hs = old->host;
    he = hs + old->length;
    if (keep->type == EXTREE_ITEM_DATA) {
        ks = keep->host;
        ke = keep->host + keep->length;
        if (ks < he && hs < ke) {
            if (hs < ks) {
                ret = drop_live_data(rc->t, old->key, hs, ks - hs);
            }
            if (ret == 0 && ke < he) {
                ret = drop_live_data(rc->t, old->key + (ke - hs), ke,
                                     he - ke);
            }
            return ret;
        }
    }
    return drop_live_data(rc->t, old->key, hs, he - hs);
}

/*
 * One range replace of the extent tree.  A failure may have stopped
 * half-way: the handle then refuses further updates (reads stay
 * possible); after -ENOSPC it can be rolled back to the last commit
 * (extree_rollback()), else it must be reopened.
 */
static int replace(Extree *t, const ExtreeItem *it, uint64_t guest,
                   uint64_t bytes)
{
    ReleaseCtx rc = { t, it };
    int ret = extree_bt_replace(t, &t->trees[EXTREE_TREE_EXTENT], it, guest,
                                bytes, release_space, &rc);

    if (ret < 0) {
        t->broken = true;
        t->broken_nospace = ret == -ENOSPC;
    } else {
        /* the live tree's mapping changed: in this transaction's marks */
        extree_bitmaps_mark(t, guest, bytes);
    }
    return ret;
}

/*
 * Is guest [pos, end) one ZERO item's already?  Then a ZERO update of it
 * changes nothing: a range that stopped for room and is taken up again
 * (extree_set_zero()) must not copy the leaves it did before, or the
 * caller's commit-and-retry would never end.  One search, mostly cached.
 */
static int zero_already(Extree *t, uint64_t pos, uint64_t end, bool *yes)
{
    ExtreeItem prev, next;
    bool hp, hn;
    int ret = extree_bt_find(t, &t->trees[EXTREE_TREE_EXTENT], pos, &prev,
                             &hp, &next, &hn);

    if (hn && next.key == pos) {
        prev = next;
        hp = true;
    }
    *yes = ret == 0 && hp && prev.type == EXTREE_ITEM_ZERO &&
           prev.key <= pos && prev.key + prev.length >= end;
    return ret;
}

/*
 * Make guest [guest, guest + bytes) hold @it (DATA or ZERO), or nothing
 * if it->type is 0.
 *
 * On a backend of fixed size no update may run out of node space
 * half-way (issue 33), so each begins only while the room for nodes holds
 * what it and the commit after it may take (extree_alloc_update_fits()),
 * and fails with -ENOSPC, unchanged, otherwise.  A ZERO or punch range
 * can remove any number of items, and the commit's nodes grow with each
 * item freed, so it runs in pieces of one leaf's items, each one checked
 * before it begins: when the room runs short between two, the update
 * stops with -ENOSPC, and what it did is a consistent state the caller
 * commits (or the core does, without commit_by_caller) before it goes on
 * with the rest: ZERO and punch are idempotent, so the same call again
 * finishes the range, and pieces done already change nothing again (a
 * punch finds no item, a ZERO piece one ZERO item: zero_already()).
 * DATA is mapped in one piece: the caller allocated it for the whole
 * range.
 */
/* May @it (DATA or COMPRESSED) be mapped: its host space allocated? */
static bool host_space_ok(Extree *t, const ExtreeItem *it)
{
    uint64_t hbytes = extree_item_host_bytes(it, t->block_size);

    if (it->type == EXTREE_ITEM_COMPRESSED &&
        (it->length > EXTREE_COMPRESSED_MAX ||
         !extree_compressed_len(it) ||
         extree_compressed_len(it) > it->length ||
         (extree_compressed_alg(it) != EXTREE_COMPRESS_ZLIB &&
          extree_compressed_alg(it) != EXTREE_COMPRESS_ZSTD))) {
        return false;
    }
    return EXTREE_IS_ALIGNED(it->host, t->block_size) &&
           it->host >= t->data_start && it->host < t->host_end &&
           hbytes <= t->host_end - it->host &&
           !extree_alloc_is_free(t, it->host, hbytes);
}

/*
 * COMPRESSED items are never split (spec: Compressed extents): an update
 * must cover each one it touches whole.  -EINVAL when one reaches across
 * @guest or @guest + @bytes: the caller rewrites it uncompressed first.
 * Two searches, only in images with the compressed bit.
 */
static int compressed_edges_ok(Extree *t, uint64_t guest, uint64_t bytes)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    uint64_t at[2] = { guest, guest + bytes };

    if (!(t->incompat & EXTREE_INCOMPAT_COMPRESSED)) {
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        ExtreeItem prev, next;
        bool hp, hn;
        int ret = extree_bt_find(t, et, at[i], &prev, &hp, &next, &hn);

        if (ret < 0) {
            return ret;
        }
        if (hp && prev.type == EXTREE_ITEM_COMPRESSED &&
            prev.key + prev.length > at[i]) {
            return -EINVAL;
        }
    }
    return 0;
}

int extree_extent_update(Extree *t, const ExtreeItem *it, uint64_t guest,
                         uint64_t bytes)
{
    ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
    uint64_t pos = guest, end = guest + bytes;
    int ret = check_update(t, guest, bytes);

    if (ret == 0) {
        ret = compressed_edges_ok(t, guest, bytes);
    }
    if (ret < 0) {
        return ret;
    }
    if ((it->type == EXTREE_ITEM_DATA ||
         it->type == EXTREE_ITEM_COMPRESSED) &&
        (!host_space_ok(t, it) || it->length != bytes)) {
        return -EINVAL;
    }
    if (it->type == EXTREE_ITEM_DATA || it->type == EXTREE_ITEM_COMPRESSED ||
        !t->space.host_limit) {
        if (!extree_alloc_update_fits(t, extree_bitmaps_mark_space(t, guest,
                                                                  bytes))) {
            return -ENOSPC;
        }
        return replace(t, it, guest, bytes);
    }
    while (pos < end) {
        uint64_t cut;
        bool done = false;

        ret = extree_bt_leaf_end(t, et, pos, &cut);
        if (ret == 0 && it->type == EXTREE_ITEM_ZERO) {
            ret = zero_already(t, pos, MIN(cut, end), &done);
        }
        if (ret < 0) {
            return ret;
        }
        cut = MIN(cut, end);
        if (!done) {
            /* each piece with the chunks its marks change */
            if (!extree_alloc_update_fits(t, extree_bitmaps_mark_space(t,
                                                 pos, cut - pos))) {
                return -ENOSPC;
            }
            ret = replace(t, it, pos, cut - pos);
            if (ret < 0) {
                return ret;
            }
        }
        pos = cut;
    }
    return 0;
}

/*
 * Replace guest [guest, + sum of @len) by DATA pieces: @n pieces of @len[i]
 * bytes at host @host[i], in guest order.  For a rewrite of COMPRESSED
 * items whose new space came in pieces: the range is emptied and the
 * pieces mapped in one update, so no state between is ever committed (a
 * failure half-way leaves the handle refusing updates, as any update's).
 */
int extree_extent_map_pieces(Extree *t, uint64_t guest, const uint64_t *host,
                             const uint64_t *len, unsigned n)
{
    ExtreeItem none = { 0 };
    uint64_t bytes = 0, pos = guest;
    int ret;

    for (unsigned i = 0; i < n; i++) {
        ExtreeItem it = { pos, len[i], host[i], EXTREE_ITEM_DATA };

        if (!len[i] || !host_space_ok(t, &it)) {
            return -EINVAL;
        }
        bytes += len[i];
        pos += len[i];
    }
    ret = check_update(t, guest, bytes);
    if (ret == 0) {
        ret = compressed_edges_ok(t, guest, bytes);
    }
    if (ret < 0) {
        return ret;
    }
    if (!n) {
        return -EINVAL;
    }
    if (!extree_alloc_update_fits(t, extree_bitmaps_mark_space(t, guest,
                                                              bytes))) {
        return -ENOSPC;
    }
    ret = replace(t, &none, guest, bytes);
    for (unsigned i = 0; i < n && ret == 0; i++) {
        ExtreeItem it = { guest, len[i], host[i], EXTREE_ITEM_DATA };

        ret = replace(t, &it, guest, len[i]);
        guest += len[i];
    }
    return ret;
}

/* A shared leaf was copied: its DATA (or payload) gains the copy's */
int extree_extent_share(Extree *t, const ExtreeItem *it)
{
    uint64_t hbytes = extree_item_host_bytes(it, t->block_size);

    if (!hbytes) {
        return 0;
    }
    return t->sm.ops->inc_ref(t->sm.opaque, it->host, hbytes);
}

/* An item of a leaf that a dropped tree freed: its DATA loses one */
int extree_extent_release(void *opaque, const ExtreeItem *it)
{
    Extree *t = opaque;
    uint64_t hbytes = extree_item_host_bytes(it, t->block_size);

    if (!hbytes) {
        return 0;
    }
    return drop_data(t, it->host, hbytes);
}

/* The first item of @leaf that ends after @pos */
static int leaf_first_ending_after(const ExtreeNode *leaf, uint64_t pos)
{
    int lo = 0, hi = node_nritems(leaf);

    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;

        if (leaf_key(leaf, mid) + leaf_len(leaf, mid) > pos) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return lo;
}

/*
 * The first part of guest [guest, guest + len) that the tree of @pr maps
 * to the same host bytes as DATA at @host does (guest g at host + (g -
 * guest)): *@found and *@flen, or *@flen = 0 if none.  The tree's leaves
 * of the range are read through the probe.
 */
int extree_probe_same_data(Extree *t, ExtreeProbe *pr, uint64_t guest,
                           uint64_t len, uint64_t host, uint64_t *found,
                           uint64_t *flen)
{
    uint64_t pos = guest, end = guest + len;

    *flen = 0;
    while (pos < end) {
        ExtreeNode *leaf;
        int nr, i, ret;

        ret = extree_bt_probe(t, pr, pos, 0, &leaf);
        if (ret < 0) {
            return ret;
        }
        nr = node_nritems(leaf);
        /*
         * Looks at increasing offsets (a drop's) go on from where the last
         * one stopped in the same leaf, without a search
         */
        i = pr->slot_hint;
        if (i > nr || (i > 0 && leaf_key(leaf, i - 1) +
                       leaf_len(leaf, i - 1) > pos)) {
            i = leaf_first_ending_after(leaf, pos);
        }
        while (i < nr && leaf_key(leaf, i) + leaf_len(leaf, i) <= pos) {
            i++;
        }
        for (; i < nr && leaf_key(leaf, i) < end; i++) {
            ExtreeItem it;

            leaf_get(leaf, i, &it);
            /* keys and host offsets are below 2^63: no overflow */
            if (it.type == EXTREE_ITEM_DATA &&
                it.host + guest == host + it.key) {
                *found = MAX(it.key, pos);
                *flen = MIN(it.key + it.length, end) - *found;
                pr->slot_hint = i;
                return 0;
            }
        }
        pr->slot_hint = i > 0 ? i - 1 : 0;
        if (pr->hi[0] == UINT64_MAX) {
            break;
        }
        pos = pr->hi[0];
    }
    return 0;
}

/*
 * The DATA of @leaf that the tree of @pr maps to the same host bytes at
 * the same guest offsets: @fn is called with each such host range (and
 * @opaque), in guest order; it returns 0 to go on, or an error that ends
 * the walk.  A merge of @leaf's items with the probed tree's over @leaf's
 * key range: O(items of both), each of the tree's leaves read once over
 * calls at increasing keys.
 */
int extree_probe_leaf_shared(Extree *t, ExtreeProbe *pr,
                             const ExtreeNode *leaf,
                             int (*fn)(void *opaque, uint64_t host,
                                       uint64_t len),
                             void *opaque)
{
    int nl = node_nritems(leaf), i = 0;
    uint64_t from = 0;

    while (i < nl) {
        ExtreeNode *m;
        uint64_t pos = MAX(leaf_key(leaf, i), from);
        int nm, j, ret;

        ret = extree_bt_probe(t, pr, pos, 0, &m);
        if (ret < 0) {
            return ret;
        }
        nm = node_nritems(m);
        j = leaf_first_ending_after(m, pos);
        while (i < nl && j < nm) {
            ExtreeItem a, b;

            leaf_get(leaf, i, &a);
            leaf_get(m, j, &b);
            if (a.key + a.length <= b.key) {
                i++;
            } else if (b.key + b.length <= a.key) {
                j++;
            } else {
                uint64_t g0 = MAX(a.key, b.key);
                uint64_t g1 = MIN(a.key + a.length, b.key + b.length);

                /* keys and host offsets are below 2^63: no overflow */
                if (a.type == EXTREE_ITEM_DATA &&
                    b.type == EXTREE_ITEM_DATA &&
                    a.host + b.key == b.host + a.key) {
                    ret = fn(opaque, a.host + (g0 - a.key), g1 - g0);
                } else if (a.type == EXTREE_ITEM_COMPRESSED &&
                           b.type == EXTREE_ITEM_COMPRESSED &&
                           a.key == b.key && a.host == b.host) {
                    /* the same payload (a compressed item is whole) */
                    ret = fn(opaque, a.host,
                             extree_item_host_bytes(&a, t->block_size));
                }
                if (ret < 0) {
                    return ret;
                }
                if (a.key + a.length <= b.key + b.length) {
                    i++;
                } else {
                    j++;
                }
            }
        }
        if (i >= nl || pr->hi[0] == UINT64_MAX) {
            break;
        }
        /* the rest of @leaf lies in the tree's next leaves */
        from = pr->hi[0];
    }
    return 0;
}

/*
 * Before the live tree changes DATA [host, + bytes) at guest @guest in
 * place, or lets it go (a new mapping replaces it): a snapshot that maps
 * the same host bytes there needs a count of 2 or more on them, or the
 * count lied (corruption) and the change would alter or free the
 * snapshot's data.  A descent per snapshot, through cached nodes mostly.
 */
static int snapshots_use(Extree *t, uint64_t guest, uint64_t bytes,
                         uint64_t host)
{
    int ret = 0;

    for (unsigned i = 0; t->snap.list && i < t->snap.list->len && ret == 0;
         i++) {
        const ExtreeSnap *sn = &g_array_index(t->snap.list, ExtreeSnap, i);
        ExtreeTree tree;
        ExtreeProbe pr = { .tree = &tree };
        uint64_t pos = guest, end = guest + bytes, found, flen;

        extree_snap_tree(t, sn, &tree);
        while (ret == 0 && pos < end) {
            ret = extree_probe_same_data(t, &pr, pos, end - pos,
                                         host + (pos - guest), &found,
                                         &flen);
            if (ret < 0 || !flen) {
                break;
            }
            if (!extree_refs_all_shared(t, host + (found - guest), flen)) {
                ret = extree_corrupt(t, host + (found - guest), "corrupt "
                                     "reference count tree: host range at "
                                     "offset 0x%" PRIx64 " length 0x%" PRIx64
                                     " has 1 reference, snapshot '%s' maps "
                                     "it too", host + (found - guest), flen,
                                     sn->id);
            }
            pos = found + flen;
        }
        extree_probe_release(t, &pr);
    }
    return ret;
}

/*
 * ExtreeTree.verify_unshared of the live tree: a copy is about to free
 * node @n, older than snap_gen, whose count says 1.  No snapshot may
 * reach it (one probe per snapshot at its first key and level).
 */
int extree_extent_node_unshared(Extree *t, ExtreeNode *n)
{
    int ret = 0;

    for (unsigned i = 0; t->snap.list && i < t->snap.list->len && ret == 0;
         i++) {
        const ExtreeSnap *sn = &g_array_index(t->snap.list, ExtreeSnap, i);
        ExtreeTree tree;
        ExtreeProbe pr = { .tree = &tree };
        bool reaches;

        extree_snap_tree(t, sn, &tree);
        ret = extree_bt_probe_reaches(t, &pr, n, &reaches);
        if (ret == 0 && reaches) {
            ret = extree_corrupt(t, n->bytenr, "corrupt reference count "
                                 "tree: extent tree node at offset 0x%"
                                 PRIx64 " has 1 reference, snapshot '%s' "
                                 "reaches it too", n->bytenr, sn->id);
        }
        extree_probe_release(t, &pr);
    }
    return ret;
}

/*
 * May the DATA that guest [guest, guest + bytes) maps at @host be written
 * in place?  Not when a block of it, or a node on a path to it, has more
 * than one reference (spec: Sharing, 3).  A leaf of generation snap_gen or
 * newer and the nodes above it have one (Sharing, 4), so only older paths
 * are looked up.  No snapshots: never shared, O(1).
 */
int extree_data_shared(Extree *t, uint64_t guest, uint64_t bytes,
                       uint64_t host, bool *shared)
{
    ExtreeTree *tree = &t->trees[EXTREE_TREE_EXTENT];
    uint64_t pos = guest, end = guest + bytes;
    ExtreePath p = { { 0 } };
    int ret = 0;

    *shared = false;
    if (!extree_has_refs(t) || !t->space.refs) {
        return 0;
    }
    if (extree_refs_max(t, host, bytes) > 1) {
        *shared = true;
        return 0;
    }
    while (pos < end && !*shared) {
        ExtreeNode *leaf;
        int nr;

        ret = extree_bt_seek(t, tree, pos, &p);
        if (ret < 0) {
            break;
        }
        leaf = p.nodes[0];
        nr = node_nritems(leaf);
        if (node_gen(leaf) < t->snap.gen) {
            for (int l = 0; l <= (int)tree->level && !*shared; l++) {
                uint32_t count;

                ret = t->sm.ops->ref_count(t->sm.opaque, p.nodes[l]->bytenr,
                                           &count);
                if (ret < 0) {
                    break;
                }
                *shared = count > 1;
            }
        }
        if (ret < 0 || !nr ||
            leaf_key(leaf, nr - 1) + leaf_len(leaf, nr - 1) <= pos) {
            break;
        }
        pos = leaf_key(leaf, nr - 1) + leaf_len(leaf, nr - 1);
    }
    extree_path_release(t, &p);
    if (ret == 0 && !*shared) {
        ret = snapshots_use(t, guest, bytes, host);
    }
    return ret;
}

/* ---- placement ---- */

/*
 * Host space for guest [guest, guest + bytes): after the guest neighbour's
 * extent, else before the following one, else wherever the allocator
 * places it (extree_alloc_take_any()).  On a backend of fixed size at
 * most what leaves the room its mapping's guard asks for
 * (extree_alloc_data_allowance()), or -ENOSPC.  O(log n).
 */
static int alloc_data_place(Extree *t, uint64_t guest, uint64_t bytes,
                            uint64_t *host, uint64_t *got)
{
    ExtreeTree *tree = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeItem prev, next;
    bool hp, hn;
    int ret;

    ret = check_update(t, guest, bytes);
    if (ret < 0) {
        return ret;
    }
    /* placement weighs all free space (a partial load has not seen it) */
    ret = extree_freetree_load_rest(t);
    if (ret < 0) {
        return ret;
    }
    /* a backend of fixed size: no more than leaves its mapping room */
    bytes = MIN(bytes, extree_alloc_data_allowance(t,
                            extree_bitmaps_mark_space(t, guest, bytes)));
    if (!bytes) {
        return -ENOSPC;
    }
    ret = extree_bt_find(t, tree, guest, &prev, &hp, &next, &hn);
    if (ret < 0) {
        return ret;
    }
    if (hp && prev.type == EXTREE_ITEM_DATA &&
        prev.key + prev.length == guest) {
        *got = extree_alloc_take_at(t, prev.host + prev.length, bytes);
        if (*got) {
            *host = prev.host + prev.length;
            return 0;
        }
    }
    if (hn && next.type == EXTREE_ITEM_DATA && next.key == guest + bytes &&
        next.host >= t->data_start + bytes &&
        extree_alloc_take_before(t, next.host, bytes)) {
        *host = next.host - bytes;
        *got = bytes;
        return 0;
    }
    return extree_alloc_take_any(t, bytes, host, got);
}

int extree_alloc_data(Extree *t, uint64_t guest, uint64_t bytes,
                      uint64_t *host, uint64_t *got)
{
    int ret = alloc_data_place(t, guest, bytes, host, got);

    /*
     * Only the bitmaps' in-place rule asks (extree_data_fresh()): without
     * bitmaps the set stays empty; one added later finds earlier
     * allocations of the transaction not fresh, which only moves writes
     */
    if (ret == 0 && extree_bitmap_count(t)) {
        extree_alloc_data_fresh_add(t, *host, *got);
    }
    if (ret == 0) {
        extree_trace(t, EXTREE_TRACE_ALLOC_DATA, guest, *got, *host);
    }
    return ret;
}

bool extree_data_fresh(Extree *t, uint64_t host, uint64_t bytes)
{
    return !t->broken && extree_alloc_data_is_fresh(t, host, bytes);
}

/*
 * The one in-place decision of the driver and the plugin: DATA no
 * snapshot shares (spec: Sharing, 3), and with persistent bitmaps either
 * blocks this transaction allocated (no committed state maps them, their
 * mapping commits with its mark) or granules marked committed already
 * (spec: Persistent dirty bitmaps, 2).  O(log n).
 */
int extree_in_place(Extree *t, const ExtreeRun *run, uint64_t guest,
                    uint64_t bytes, bool *in_place)
{
    uint64_t host = run->host + (guest - run->guest);
    bool shared = true;
    int ret = 0;

    *in_place = false;
    if (run->type != EXTREE_RUN_DATA) {
        return 0;
    }
    ret = extree_data_shared(t, guest, bytes, host, &shared);
    /* a map record's checksum covers these bytes until the commit */
    *in_place = ret == 0 && !shared &&
                !extree_map_log_hosts(t, host, bytes) &&
                (extree_data_fresh(t, host, bytes) ||
                 extree_bitmaps_in_place(t, guest, bytes));
    return ret;
}

bool extree_mark_log_wanted(Extree *t, const ExtreeRun *run, uint64_t guest,
                            uint64_t bytes)
{
    uint64_t host = run->host + (guest - run->guest);
    bool shared = true;

    if (run->type != EXTREE_RUN_DATA || !extree_bitmap_count(t) ||
        !extree_mark_log_room(t) || extree_data_fresh(t, host, bytes) ||
        extree_map_log_hosts(t, host, bytes)) {
        return false;
    }
    return extree_data_shared(t, guest, bytes, host, &shared) == 0 &&
           !shared;
}

/* Return an allocation that was never mapped */
int extree_free_data(Extree *t, uint64_t host, uint64_t bytes)
{
    int ret = extree_check_writable(t);

    t->bm.unlogged = true;      /* no map record holds it */
    if (ret < 0) {
        return ret;
    }
    if (!bytes || !EXTREE_IS_ALIGNED(host | bytes, t->block_size) ||
        host < t->data_start || host >= t->host_end ||
        bytes > t->host_end - host || extree_alloc_is_free(t, host, bytes)) {
        return -EINVAL;
    }
    return drop_data(t, host, bytes);
}
