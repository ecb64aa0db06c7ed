/*
 * extree core: node I/O: a read through the cache and validation
 * (extree_node_get()), readahead of several nodes in one backend call, and
 * the write-back of dirty nodes at commit
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

int extree_node_get(Extree *t, uint64_t bytenr, const ExtreeNodeExpect *e,
                    ExtreeNode **out)
{
    ExtreeNode *n = extree_cache_lookup(t, bytenr);
    const char *tree = extree_tree_name(e->owner);
    char *why = NULL;
    uint8_t *buf;
    int ret;

    *out = NULL;
    if (n) {
        t->stats.cache_hits++;
        why = extree_node_disagrees(n, e);
        if (why) {
            ret = extree_corrupt(t, bytenr, "corrupt %s node at offset 0x%"
                                 PRIx64 ": %s; the node is reachable from "
                                 "two parents", tree, bytenr, why);
            g_free(why);
            return ret;
        }
        extree_cache_pin(t, n);
        *out = n;
        return 0;
    }

    if (!EXTREE_IS_ALIGNED(bytenr, t->block_size) ||
        bytenr < t->data_start || bytenr >= t->sb_host_end ||
        t->sb_host_end - bytenr < t->node_size) {
        return extree_corrupt(t, bytenr, "corrupt %s node at offset 0x%"
                              PRIx64 ": bad location, expect inside [0x%"
                              PRIx64 ", 0x%" PRIx64 ")", tree, bytenr,
                              t->data_start, t->sb_host_end);
    }
    buf = extree_prefetch_take(t, bytenr);
    if (!buf && t->nc.nowait) {
        t->nc.missing = t->nc.walk_miss ? 0 : bytenr;
        return -EWOULDBLOCK;
    }
    t->stats.cache_misses++;
    n = extree_cache_node_alloc(t, bytenr, buf);
    if (buf) {
        /* read by the caller, and validated below like any other */
        t->stats.prefetched++;
    } else {
        ret = t->be->ops->pread(t->be->opaque, bytenr, n->buf, t->node_size);
        if (ret < 0) {
            extree_cache_node_free(t, n);
            return ret;
        }
    }
    ret = extree_node_validate(t, n->buf, bytenr, e, &why);
    if (ret < 0) {
        int64_t len = t->be->ops->get_length(t->be->opaque);

        /*
         * Reads past the end of the file return zeroes: say why the node
         * is damaged when the file was cut short (no corruption to flag)
         */
        if (len >= 0 && bytenr + t->node_size > (uint64_t)len) {
            ret = extree_truncated(t, bytenr, "truncated image: %s node at "
                                 "offset 0x%" PRIx64 " lies past the end of "
                                 "the file (%" PRId64 " bytes)", tree, bytenr,
                                 len);
        } else {
            ret = extree_corrupt(t, bytenr, "corrupt %s node at offset 0x%"
                                 PRIx64 ": %s", tree, bytenr, why);
        }
        g_free(why);
        extree_cache_node_free(t, n);
        return ret;
    }
    /* The read may have yielded: someone else may have cached it */
    if (extree_cache_lookup(t, bytenr)) {
        extree_cache_node_free(t, n);
        return extree_node_get(t, bytenr, e, out);
    }
    extree_cache_insert(t, n, true);
    extree_cache_shrink(t);
    *out = n;
    return 0;
}


/*
 * Read the nodes at @bytenr[0..n) that are not cached, with one
 * pread_many call, and cache those that validate, unpinned (least
 * recently used first to go).  Best effort: a node that cannot be read or
 * fails validation is left out, and extree_node_get() reads it again and
 * says why.  At most a quarter of the cache, so readahead never evicts
 * what it just read.
 */
void extree_node_readahead(Extree *t, int n, const uint64_t *bytenr,
                           const ExtreeNodeExpect *e)
{
    ExtreeNode **nodes;
    const ExtreeNodeExpect **exp;
    uint64_t *offs;
    void **bufs;
    int *rets;
    int k = 0;

    n = MIN(n, EXTREE_READAHEAD_MAX);
    n = MIN((uint64_t)n, t->nc.limit / 4);
    if (!t->be->ops->pread_many || n < 2) {
        return;
    }
    nodes = g_new(ExtreeNode *, n);
    exp = g_new(const ExtreeNodeExpect *, n);
    offs = g_new(uint64_t, n);
    bufs = g_new(void *, n);
    rets = g_new(int, n);
    for (int i = 0; i < n; i++) {
        if (extree_node_cached(t, bytenr[i]) ||
            !EXTREE_IS_ALIGNED(bytenr[i], t->block_size) ||
            bytenr[i] < t->data_start || bytenr[i] >= t->sb_host_end ||
            t->sb_host_end - bytenr[i] < t->node_size) {
            continue;
        }
        nodes[k] = extree_cache_node_alloc(t, bytenr[i], NULL);
        exp[k] = &e[i];
        offs[k] = bytenr[i];
        bufs[k] = nodes[k]->buf;
        k++;
    }
    /* one node alone is read by extree_node_get() as usual */
    if (k > 1) {
        t->be->ops->pread_many(t->be->opaque, k, offs, bufs, t->node_size,
                               rets);
    }
    for (int i = 0; i < k; i++) {
        ExtreeNode *nd = nodes[i];
        char *why = NULL;

        /* the reads may have yielded: someone else may have cached it */
        if (k < 2 || rets[i] < 0 || extree_node_cached(t, nd->bytenr) ||
            extree_node_validate(t, nd->buf, nd->bytenr, exp[i], &why) < 0) {
            g_free(why);
            extree_cache_node_free(t, nd);
            continue;
        }
        extree_cache_insert(t, nd, false);
        t->stats.readahead++;
    }
    extree_cache_shrink(t);
    g_free(nodes);
    g_free(exp);
    g_free(offs);
    g_free(bufs);
    g_free(rets);
}

/* Set the checksum of a node image about to be written */
void extree_node_finish(Extree *t, uint8_t *buf)
{
    ext_st32(buf + EXT_NH_CSUM, extree_crc32c(0, buf + EXT_NH_MAGIC,
                                 t->node_size - EXT_NH_MAGIC));
}

static gint cmp_bytenr(gconstpointer a, gconstpointer b)
{
    const ExtreeNode *x = *(ExtreeNode * const *)a;
    const ExtreeNode *y = *(ExtreeNode * const *)b;
    return x->bytenr < y->bytenr ? -1 : x->bytenr > y->bytenr;
}

static gint cmp_level(gconstpointer a, gconstpointer b)
{
    const ExtreeNode *x = *(ExtreeNode * const *)a;
    const ExtreeNode *y = *(ExtreeNode * const *)b;
    return (int)node_level(x) - (int)node_level(y);
}

/*
 * The child_bytes of every interior item whose child changed in this
 * transaction, bottom-up.  Tree updates leave them stale (a change to a
 * leaf would otherwise touch every ancestor); each dirty node's parent is
 * dirty too (copy-on-write), and an item whose child is clean was copied
 * with its value from the committed parent.  O(dirty nodes * fan-out).
 */
static int fix_subtree_bytes(Extree *t, GPtrArray *arr)
{
    g_ptr_array_sort(arr, cmp_level);
    for (guint i = 0; i < arr->len; i++) {
        ExtreeNode *n = arr->pdata[i];
        int nr = node_nritems(n);

        if (!node_level(n)) {
            continue;
        }
        for (int k = 0; k < nr; k++) {
            uint8_t *ip = node_item(n, k, EXT_PTR_ISZ);
            uint64_t child = ext_ld64(ip + EXT_KP_CHILD);
            ExtreeNode *c = extree_cache_lookup(t, child);

            if (!c || !c->dirty) {
                continue;
            }
            /*
             * A damaged item pointing at a location this transaction
             * reused (a freed node's, even its own parent's) must not get
             * that node's sum: the superblock would name a tree the
             * reader rejects
             */
            if (node_owner(c) != node_owner(n) ||
                node_level(c) + 1 != node_level(n) ||
                (node_nritems(c) && node_key(c, 0) != ext_ld64(ip))) {
                t->broken = true;
                return extree_corrupt(t, child, "corrupt %s node at offset "
                                      "0x%" PRIx64 ": item %d points at 0x%"
                                      PRIx64 ", a node of level %u with "
                                      "first key 0x%" PRIx64 " written in "
                                      "this transaction; refusing to "
                                      "commit", extree_tree_name(
                                      node_owner(n)), n->bytenr, k, child,
                                      node_level(c), node_nritems(c) ?
                                      node_key(c, 0) : 0);
            }
            ext_st64(ip + EXT_KP_BYTES, extree_node_subtree_bytes(c));
        }
    }
    return 0;
}

/*
 * Commit step 3: write every dirty node at its (freshly allocated)
 * location, in offset order, nodes at consecutive offsets in one write of
 * up to 1 MiB.  O(dirty nodes).  The nodes stay dirty until
 * extree_node_commit_done(), so a failed commit can be retried.
 */
int extree_node_write_dirty(Extree *t)
{
    /* pinned: the writes may yield */
    GPtrArray *arr = extree_cache_dirty_pinned(t);
    guint batch = MAX(1, (1024 * 1024) / t->node_size);
    int ret = 0;

    ret = fix_subtree_bytes(t, arr);
    g_ptr_array_sort(arr, cmp_bytenr);
    for (guint i = 0; i < arr->len && ret == 0;) {
        ExtreeNode *first = arr->pdata[i];
        guint j = i + 1;

        while (j < arr->len && j - i < batch &&
               ((ExtreeNode *)arr->pdata[j])->bytenr ==
               first->bytenr + (uint64_t)(j - i) * t->node_size) {
            j++;
        }
        /*
         * Checksum each node right before it is copied or written: one
         * pass over memory that is still in the CPU cache for the next
         */
        if (j - i == 1) {
            extree_node_finish(t, first->buf);
            ret = t->be->ops->pwrite(t->be->opaque, first->bytenr, first->buf,
                                     t->node_size);
        } else {
            /*
             * kept for the next commit: fresh memory for each commit
             * costs page faults
             */
            if (!t->nc.bounce) {
                t->nc.bounce = g_malloc((size_t)batch * t->node_size);
            }
            for (guint k = i; k < j; k++) {
                ExtreeNode *n = arr->pdata[k];
                extree_node_finish(t, n->buf);
                memcpy(t->nc.bounce + (size_t)(k - i) * t->node_size, n->buf,
                       t->node_size);
            }
            ret = t->be->ops->pwrite(t->be->opaque, first->bytenr, t->nc.bounce,
                                     (uint64_t)(j - i) * t->node_size);
        }
        if (ret == 0) {
            t->stats.nodes_written += j - i;
        }
        i = j;
    }
    for (guint i = 0; i < arr->len; i++) {
        extree_node_unref(t, arr->pdata[i]);
    }
    g_ptr_array_free(arr, true);
    return ret;
}
