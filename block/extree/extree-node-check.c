/*
 * extree core: node validation (btrfs's tree-checker)
 *
 * Every node read from the backend is validated here, once, against what
 * its reader expects (owner, level, generation, key range, items, and the
 * host space they may point into); a cached node reached again is checked
 * against the new reader's expectation (extree_node_matches()).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdio.h>

#include "extree-int.h"

/* ---- validation ---- */

/*
 * The end of the host space a node of generation @gen may point into: the
 * last commit's host_end, or for a node as old as the state the handle
 * started from, that state's (struct Extree: base_host_end)
 */
static uint64_t host_limit(const Extree *t, uint64_t gen)
{
    return gen <= t->base_gen ? MIN(t->base_host_end, t->sb_host_end)
                              : t->sb_host_end;
}

/*
 * A COMPRESSED item (key, length and tree bounds checked already): only
 * with the compressed bit, a known algorithm, a payload of 1 byte up to
 * the item's length (at most EXTREE_COMPRESSED_MAX: a reader's memory
 * bound), whose blocks lie inside the data area
 */
static int compressed_item_check(Extree *t, const ExtreeItem *it, int i,
                                 uint64_t he, char **why)
{
    uint32_t clen = extree_compressed_len(it);
    uint32_t alg = extree_compressed_alg(it);
    uint64_t hbytes = extree_item_host_bytes(it, t->block_size);

    if (!(t->incompat & EXTREE_INCOMPAT_COMPRESSED)) {
        *why = g_strdup_printf("compressed item at slot %d without the "
                               "compressed feature", i);
        return -EIO;
    }
    if (t->incompat & EXTREE_INCOMPAT_ENCRYPTED) {
        *why = g_strdup_printf("compressed item at slot %d in an encrypted "
                               "image", i);
        return -EIO;
    }
    if (it->key >= EXTREE_VMSTATE_BASE) {
        *why = g_strdup_printf("compressed item at slot %d in the VM state "
                               "area", i);
        return -EIO;
    }
    if (alg != EXTREE_COMPRESS_ZLIB && alg != EXTREE_COMPRESS_ZSTD) {
        *why = g_strdup_printf("bad compression algorithm at slot %d, have "
                               "%u expect %d or %d", i, alg,
                               EXTREE_COMPRESS_ZLIB, EXTREE_COMPRESS_ZSTD);
        return -EIO;
    }
    if (it->length > EXTREE_COMPRESSED_MAX || clen == 0 ||
        clen > it->length) {
        *why = g_strdup_printf("bad compressed item at slot %d, length 0x%"
                               PRIx64 " payload 0x%x (payload 1 to length, "
                               "length at most 0x%x)", i, it->length, clen,
                               EXTREE_COMPRESSED_MAX);
        return -EIO;
    }
    if (!EXTREE_IS_ALIGNED(it->host, t->block_size) ||
        it->host < t->data_start || it->host >= he ||
        hbytes > he - it->host) {
        *why = g_strdup_printf("bad host range at slot %d, have [0x%" PRIx64
                               ", +0x%" PRIx64 ") expect inside [0x%" PRIx64
                               ", 0x%" PRIx64 ")", i, it->host, hbytes,
                               t->data_start, he);
        return -EIO;
    }
    return 0;
}

static int leaf_item_check(Extree *t, const ExtreeNodeExpect *e,
                           const ExtreeItem *it, uint32_t flags, int i,
                           uint64_t he, char **why)
{
    uint32_t owner = e->owner;
    uint64_t bs = t->block_size;
    uint64_t vend = extree_key_limit(t);

    if (flags && it->type != EXTREE_ITEM_COMPRESSED) {
        *why = g_strdup_printf("bad item flags at slot %d, have 0x%x "
                               "expect 0x0", i, flags);
        return -EIO;
    }
    if (!it->length || !EXTREE_IS_ALIGNED(it->key | it->length, bs)) {
        *why = g_strdup_printf("bad item at slot %d: key 0x%" PRIx64
                               " length 0x%" PRIx64 " not a non-empty "
                               "multiple of block size %u", i, it->key,
                               it->length, t->block_size);
        return -EIO;
    }
    if (owner == EXTREE_TREE_EXTENT) {
        if (it->key >= vend || it->length > vend - it->key) {
            *why = g_strdup_printf("item at slot %d beyond virtual size, "
                                   "have end 0x%" PRIx64 " max 0x%" PRIx64,
                                   i, it->key + it->length, vend);
            return -EIO;
        }
        if (extree_item_past_size(it->key, it->length, e->data_end)) {
            *why = g_strdup_printf("item at slot %d beyond the tree's "
                                   "virtual size, have end 0x%" PRIx64
                                   " max 0x%" PRIx64, i,
                                   it->key + it->length, e->data_end);
            return -EIO;
        }
        if (it->type == EXTREE_ITEM_ZERO) {
            if (it->host) {
                *why = g_strdup_printf("bad zero item at slot %d, host "
                                       "have 0x%" PRIx64 " expect 0x0", i,
                                       it->host);
                return -EIO;
            }
            return 0;
        }
        if (it->type == EXTREE_ITEM_COMPRESSED) {
            return compressed_item_check(t, it, i, he, why);
        }
        if (it->type != EXTREE_ITEM_DATA) {
            *why = g_strdup_printf("bad item type at slot %d, have %u", i,
                                   it->type);
            return -EIO;
        }
    } else if (owner == EXTREE_TREE_REFS) {
        if (it->type != EXTREE_ITEM_REFS) {
            *why = g_strdup_printf("bad item type at slot %d, have %u "
                                   "expect %u", i, it->type,
                                   EXTREE_ITEM_REFS);
            return -EIO;
        }
        if (it->host < 2 || it->host > UINT32_MAX) {
            *why = g_strdup_printf("bad reference count at slot %d, have %"
                                   PRIu64 " expect 2 to %u", i, it->host,
                                   UINT32_MAX);
            return -EIO;
        }
        if (!EXTREE_IS_ALIGNED(it->key, bs) || it->key < t->data_start ||
            it->key >= he ||
            it->length > he - it->key) {
            *why = g_strdup_printf("bad host range at slot %d, have [0x%"
                                   PRIx64 ", +0x%" PRIx64 ") expect inside "
                                   "[0x%" PRIx64 ", 0x%" PRIx64 ")", i,
                                   it->key, it->length, t->data_start,
                                   he);
            return -EIO;
        }
        return 0;
    } else {
        if (it->type != EXTREE_ITEM_FREE) {
            *why = g_strdup_printf("bad item type at slot %d, have %u "
                                   "expect %u", i, it->type,
                                   EXTREE_ITEM_FREE);
            return -EIO;
        }
        if (it->host != it->key) {
            *why = g_strdup_printf("bad free item at slot %d, host have 0x%"
                                   PRIx64 " expect 0x%" PRIx64, i, it->host,
                                   it->key);
            return -EIO;
        }
    }
    /* DATA and FREE: a host range inside the data area */
    if (!EXTREE_IS_ALIGNED(it->host, bs) || it->host < t->data_start ||
        it->host >= he ||
        it->length > he - it->host) {
        *why = g_strdup_printf("bad host range at slot %d, have [0x%" PRIx64
                               ", +0x%" PRIx64 ") expect inside [0x%" PRIx64
                               ", 0x%" PRIx64 ")", i, it->host, it->length,
                               t->data_start, he);
        return -EIO;
    }
    return 0;
}

/*
 * Every check that the item loop of extree_node_validate() makes on an
 * extent-tree leaf, with few branches: a valid leaf, the common case,
 * costs a few instructions an item (a cold walk validates every leaf it
 * reads); the loop then says what is wrong with one that fails.
 */
static bool extent_leaf_ok(Extree *t, const uint8_t *buf, uint32_t nr,
                           const ExtreeNodeExpect *e, uint64_t he,
                           uint64_t *sum)
{
    uint64_t key_end = e->key_end, data_end = e->data_end;
    uint64_t mask = t->block_size - 1;
    uint64_t vend = extree_key_limit(t);
    uint64_t ds = t->data_start;
    const uint8_t *p = buf + EXTREE_NODE_HEADER_SIZE;
    uint64_t prev_end = 0, bad = 0, total = 0;

    for (uint32_t i = 0; i < nr; i++, p += EXT_LEAF_ISZ) {
        uint64_t key = ext_ld64(p + EXT_IT_KEY);
        uint64_t len = ext_ld64(p + EXT_IT_LEN);
        uint64_t host = ext_ld64(p + EXT_IT_HOST);
        uint32_t type = ext_ld32(p + EXT_IT_TYPE);

        bad |= ((key | len) & mask) | (len == 0) |
               (key < prev_end) | (key >= vend) | (len > vend - key) |
               extree_item_past_size(key, len, data_end);
        if (type == EXTREE_ITEM_DATA) {
            bad |= ext_ld32(p + EXT_IT_FLAGS) | (host & mask) | (host < ds) |
                   (host >= he) | (len > he - host);
        } else if (type == EXTREE_ITEM_COMPRESSED) {
            /* the item loop says what is wrong */
            ExtreeItem it = { key, len, host, type,
                              ext_ld32(p + EXT_IT_FLAGS) };
            char *why = NULL;

            bad |= compressed_item_check(t, &it, i, he, &why) < 0;
            g_free(why);
        } else {
            bad |= ext_ld32(p + EXT_IT_FLAGS);
            bad |= (type != EXTREE_ITEM_ZERO) | (host != 0);
        }
        prev_end = key + len;
        total += len;
    }
    *sum = total;
    return !bad && prev_end <= key_end;
}


static int check_subtree_bytes(const ExtreeNodeExpect *e, uint64_t sum,
                               char **why)
{
    if (e->has_bytes && sum != e->bytes) {
        *why = g_strdup_printf("subtree bytes mismatch, have 0x%" PRIx64
                               " expect 0x%" PRIx64 " (parent's child_bytes)",
                               sum, e->bytes);
        return -EIO;
    }
    return 0;
}

/*
 * Tree-checker: every header field and every item of a node image read
 * from @bytenr.  Nodes on disk belong to the last committed state: they
 * are checked against its host_end, which the running transaction may
 * have lowered (extree_alloc_trim_tail()) or raised.  On failure *@why
 * says what (g_malloc'd), e.g. "bad checksum, have 0x1234 expect 0x5678".
 */
int extree_node_validate(Extree *t, const uint8_t *buf, uint64_t bytenr,
                         const ExtreeNodeExpect *e, char **why)
{
    uint32_t have_csum = ext_ld32(buf + EXT_NH_CSUM);
    uint32_t csum = extree_crc32c(0, buf + EXT_NH_MAGIC,
                                 t->node_size - EXT_NH_MAGIC);
    uint32_t magic = ext_ld32(buf + EXT_NH_MAGIC);
    uint64_t hb = ext_ld64(buf + EXT_NH_BYTENR);
    uint64_t gen = ext_ld64(buf + EXT_NH_GEN);
    uint32_t owner = ext_ld32(buf + EXT_NH_OWNER);
    unsigned level = buf[EXT_NH_LEVEL];
    uint32_t nr = ext_ld32(buf + EXT_NH_NRITEMS);
    uint32_t cap = level ? EXTREE_INTERIOR_CAPACITY(t->node_size)
                         : EXTREE_LEAF_CAPACITY(t->node_size);
    ExtreeNode fake = { .buf = (uint8_t *)buf };
    uint64_t he = host_limit(t, gen);
    uint64_t prev_end = 0, sum = 0;

    *why = NULL;
    if (have_csum != csum) {
        *why = g_strdup_printf("bad checksum, have 0x%08x expect 0x%08x",
                               have_csum, csum);
        return -EIO;
    }
    if (magic != EXTREE_NODE_MAGIC) {
        *why = g_strdup_printf("bad magic, have 0x%08x expect 0x%08x",
                               magic, EXTREE_NODE_MAGIC);
        return -EIO;
    }
    if (hb != bytenr) {
        *why = g_strdup_printf("bad bytenr, have 0x%" PRIx64 " expect 0x%"
                               PRIx64, hb, bytenr);
        return -EIO;
    }
    if (owner != e->owner) {
        *why = g_strdup_printf("bad owner, have %u expect %u", owner,
                               e->owner);
        return -EIO;
    }
    if (level != e->level) {
        *why = g_strdup_printf("bad level, have %u expect %u", level,
                               e->level);
        return -EIO;
    }
    if (gen != e->generation) {
        *why = g_strdup_printf("bad generation, have %" PRIu64 " expect %"
                               PRIu64, gen, e->generation);
        return -EIO;
    }
    if (nr > cap) {
        *why = g_strdup_printf("too many items, have %u max %u", nr, cap);
        return -EIO;
    }
    if (nr == 0 && (level > 0 || e->has_first_key)) {
        *why = g_strdup_printf("empty %s node",
                               level ? "interior" : "non-root leaf");
        return -EIO;
    }
    if (nr > 0 && e->has_first_key && node_key(&fake, 0) != e->first_key) {
        *why = g_strdup_printf("first key mismatch, have 0x%" PRIx64
                               " expect 0x%" PRIx64 " (parent key)",
                               node_key(&fake, 0), e->first_key);
        return -EIO;
    }
    if (!level && owner == EXTREE_TREE_EXTENT &&
        extent_leaf_ok(t, buf, nr, e, he, &sum)) {
        return check_subtree_bytes(e, sum, why);
    }
    for (uint32_t i = 0; i < nr; i++) {
        if (level) {
            ExtreeKeyPtr kp;
            ptr_get(&fake, i, &kp);
            if (i > 0 && kp.key <= prev_end) {
                *why = g_strdup_printf("unsorted keys at slot %u, have 0x%"
                                       PRIx64 " after 0x%" PRIx64, i,
                                       kp.key, prev_end);
                return -EIO;
            }
            if (kp.key >= e->key_end) {
                *why = g_strdup_printf("key beyond parent range at slot %u,"
                                       " have 0x%" PRIx64 " limit 0x%"
                                       PRIx64, i, kp.key, e->key_end);
                return -EIO;
            }
            if (owner == EXTREE_TREE_EXTENT &&
                extree_item_past_size(kp.key, 1, e->data_end)) {
                *why = g_strdup_printf("key at slot %u beyond the tree's "
                                       "virtual size, have 0x%" PRIx64
                                       " max 0x%" PRIx64, i, kp.key,
                                       e->data_end);
                return -EIO;
            }
            prev_end = kp.key;
            if (!EXTREE_IS_ALIGNED(kp.child, t->block_size) ||
                kp.child < t->data_start || kp.child >= he ||
                he - kp.child < t->node_size) {
                *why = g_strdup_printf("bad child pointer at slot %u, have "
                                       "0x%" PRIx64, i, kp.child);
                return -EIO;
            }
            if (kp.child_gen == 0 || kp.child_gen > gen) {
                *why = g_strdup_printf("bad child generation at slot %u, "
                                       "have %" PRIu64 " max %" PRIu64, i,
                                       kp.child_gen, gen);
                return -EIO;
            }
        } else {
            ExtreeItem it;
            uint32_t flags = ext_ld32(node_item(&fake, i, EXT_LEAF_ISZ) + 28);
            int ret;

            leaf_get(&fake, i, &it);
            ret = leaf_item_check(t, e, &it, flags, i, he, why);
            if (ret < 0) {
                return ret;
            }
            if (i > 0 && it.key < prev_end) {
                *why = g_strdup_printf("unsorted or overlapping items at slot"
                                       " %u, key 0x%" PRIx64 " before end "
                                       "0x%" PRIx64, i, it.key, prev_end);
                return -EIO;
            }
            prev_end = it.key + it.length;
            if (prev_end > e->key_end) {
                *why = g_strdup_printf("item beyond parent range at slot %u,"
                                       " have end 0x%" PRIx64 " limit 0x%"
                                       PRIx64, i, prev_end, e->key_end);
                return -EIO;
            }
        }
    }
    /*
     * child_bytes, once the keys are known sorted: non-zero (a child has
     * items), whole blocks, and no more than the child's key range, so
     * that the sum cannot overflow
     */
    for (uint32_t i = 0; level && i < nr; i++) {
        uint64_t key = ptr_key(&fake, i), bytes = ptr_bytes(&fake, i);
        uint64_t bound = i + 1 < nr ? ptr_key(&fake, i + 1) : e->key_end;

        if (bytes == 0 || !EXTREE_IS_ALIGNED(bytes, t->block_size) ||
            bytes > bound - key) {
            *why = g_strdup_printf("bad child_bytes at slot %u, have 0x%"
                                   PRIx64, i, bytes);
            return -EIO;
        }
    }
    return check_subtree_bytes(e, extree_node_subtree_bytes(&fake), why);
}

/*
 * What a cached node must agree with, whichever parent reaches it: the
 * parent's expectations of owner, level, generation, first key, key range
 * and (clean nodes) child_bytes.  The node's items were validated when it
 * was read or are this transaction's own, so only the first and the last
 * item are looked at: O(1).  NULL if it agrees, else why not (g_malloc'd).
 * Checked on every descent, cached or not, as btrfs checks a cached
 * buffer against its parent: a node validated under its rightful parent
 * must not be trusted under another that points at it by mistake.
 */
/* End of item @i: a leaf item's end, an interior key's next byte */
static uint64_t item_end(const ExtreeNode *n, int i)
{
    return node_level(n) ? ptr_key(n, i) + 1 : leaf_key(n, i) + leaf_len(n, i);
}

/*
 * A node validated under a tree of another virtual size (a snapshot's)
 * reached from this one: its first item (key) ending past @data_end must
 * lie in the VM state area.  O(log items), and only for a node that
 * reaches past @data_end at all.
 */
static char *node_past_size(const ExtreeNode *n, uint64_t data_end)
{
    int lo = 0, hi = node_nritems(n);

    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;

        if (item_end(n, mid) > data_end) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    if (lo < (int)node_nritems(n) &&
        extree_item_past_size(node_key(n, lo), item_end(n, lo) -
                              node_key(n, lo), data_end)) {
        return g_strdup_printf("item at slot %d beyond the tree's virtual "
                               "size, have end 0x%" PRIx64 " max 0x%" PRIx64,
                               lo, item_end(n, lo), data_end);
    }
    return NULL;
}

char *extree_node_disagrees(const ExtreeNode *n, const ExtreeNodeExpect *e)
{
    unsigned level = node_level(n);
    uint32_t nr = node_nritems(n);

    if (node_owner(n) != e->owner || level != e->level ||
        node_gen(n) != e->generation) {
        return g_strdup_printf("have owner %u level %u generation %" PRIu64
                               " expect %u %u %" PRIu64, node_owner(n),
                               level, node_gen(n), e->owner, e->level,
                               e->generation);
    }
    if (nr == 0) {
        if (level > 0 || e->has_first_key) {
            return g_strdup_printf("empty %s node",
                                   level ? "interior" : "non-root leaf");
        }
    } else {
        uint64_t first = node_key(n, 0);
        uint64_t last = level ? ptr_key(n, nr - 1)
                              : leaf_key(n, nr - 1) + leaf_len(n, nr - 1);

        if (e->has_first_key && first != e->first_key) {
            return g_strdup_printf("first key mismatch, have 0x%" PRIx64
                                   " expect 0x%" PRIx64 " (parent key)",
                                   first, e->first_key);
        }
        if (level ? last >= e->key_end : last > e->key_end) {
            return g_strdup_printf("items beyond parent range, have end 0x%"
                                   PRIx64 " limit 0x%" PRIx64, last,
                                   e->key_end);
        }
        if (e->owner == EXTREE_TREE_EXTENT && last >= e->data_end) {
            char *why = node_past_size(n, e->data_end);
            if (why) {
                return why;
            }
        }
    }
    if (e->has_bytes && !n->dirty && n->bytes != e->bytes) {
        return g_strdup_printf("subtree bytes mismatch, have 0x%" PRIx64
                               " expect 0x%" PRIx64 " (parent's child_bytes)",
                               n->bytes, e->bytes);
    }
    return NULL;
}

bool extree_node_matches(const ExtreeNode *n, const ExtreeNodeExpect *e)
{
    char *why = extree_node_disagrees(n, e);

    g_free(why);
    return why == NULL;
}

/*
 * Get node @bytenr pinned: from the cache (O(1), checked against the
 * parent's expectations by extree_node_disagrees()) or read (or taken from the
 * prefetched images) and validated in full.  In a no-wait query a node
 * neither cached nor prefetched is -EWOULDBLOCK, not read.
 */
