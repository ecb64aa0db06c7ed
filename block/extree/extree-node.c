/*
 * extree core: node cache, node validation (tree-checker), node writes
 *
 * Every node read from the backend is validated here, once, against what
 * its reader expects (owner, level, generation, key range); the rest of the
 * core trusts cached nodes.  Cached nodes are the raw on-disk image.
 *
 * Cache: GHashTable keyed by bytenr (O(1)), an intrusive LRU list of clean
 * unpinned nodes (O(1) touch and evict), an intrusive list of dirty nodes
 * (never evicted: they are written at commit).  A node pinned by a path or
 * cursor (refcnt > 0) is never evicted; a pinned node dropped from the tree
 * becomes an orphan and is freed on its last unref.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdarg.h>
#include <stdio.h>

#include <stdlib.h>
#include <sys/mman.h>

#include "extree-int.h"

const char *extree_tree_name(uint32_t owner)
{
    switch (owner) {
    case EXTREE_TREE_EXTENT:
        return "extent tree";
    case EXTREE_TREE_FREE:
        return "free tree";
    case EXTREE_TREE_REFS:
        return "reference count tree";
    default:
        return "unknown tree";
    }
}

/*
 * The one corruption helper: record the message, tell the handler, return
 * -EIO for the failing call to pass up.
 */
int extree_corrupt(Extree *t, uint64_t offset, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    g_free(t->last_error);
    t->last_error = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    if (t->corrupt_fn) {
        t->corrupt_fn(t->corrupt_opaque, offset, t->last_error);
    }
    return -EIO;
}

/* ---- intrusive lists ---- */

static void list_init(ExtreeNode *head)
{
    head->prev = head->next = head;
}

static void list_del(ExtreeNode *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = NULL;
    n->list = EXT_LIST_NONE;
}

static void list_add_tail(ExtreeNode *head, ExtreeNode *n, uint8_t which)
{
    n->prev = head->prev;
    n->next = head;
    head->prev->next = n;
    head->prev = n;
    n->list = which;
}

/*
 * Node buffers come from slabs (64 KiB, doubling up to 2 MiB) whose pages
 * are populated when the slab is mapped: page faults on fresh node buffers
 * were half the time of a first-hole search over 131,072 extents, cold or
 * warm.  Freed buffers are recycled; slabs go at close, so memory follows
 * the cache's high-water mark.
 */
#define EXT_SLAB_SIZE   (2 * 1024 * 1024)

/* Slab @i: 64 KiB, doubling up to 2 MiB, so a small image stays small */
static size_t slab_size(Extree *t, unsigned i)
{
    size_t size = (size_t)64 * 1024 << MIN(i, 5u);

    return MAX(MIN(size, (size_t)EXT_SLAB_SIZE), t->node_size);
}

static uint8_t *buf_alloc(Extree *t)
{
    uint8_t *buf;

    if (t->spare_bufs->len) {
        return g_ptr_array_steal_index_fast(t->spare_bufs,
                                            t->spare_bufs->len - 1);
    }
    if (!t->slab_left) {
        size_t size = slab_size(t, t->slabs->len);
        void *slab;

#ifdef MAP_POPULATE
        /* populated in one call: no page fault per page later */
        slab = mmap(NULL, size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (slab == MAP_FAILED) {
            g_error("extree: out of memory for a %zu-byte slab", size);
        }
#else
        slab = g_malloc(size);
#endif
        g_ptr_array_add(t->slabs, slab);
        t->slab_next = slab;
        t->slab_left = size / t->node_size;
    }
    buf = t->slab_next;
    t->slab_next += t->node_size;
    t->slab_left--;
    return buf;
}

void extree_cache_init(Extree *t)
{
    t->spare_bufs = g_ptr_array_new();
    t->slabs = g_ptr_array_new();
    t->slab_left = 0;
    t->cache = g_hash_table_new(g_int64_hash, g_int64_equal);
    list_init(&t->lru);
    list_init(&t->dirty);
}

static void node_free(Extree *t, ExtreeNode *n)
{
    g_ptr_array_add(t->spare_bufs, n->buf);
    g_free(n);
}

void extree_cache_destroy(Extree *t)
{
    GHashTableIter it;
    gpointer key, value;

    if (!t->cache) {
        return;
    }
    extree_prefetch_drop_all(t);
    g_hash_table_iter_init(&it, t->cache);
    while (g_hash_table_iter_next(&it, &key, &value)) {
        g_free(value);
    }
    g_hash_table_destroy(t->cache);
    t->cache = NULL;
    g_ptr_array_free(t->spare_bufs, true);
    t->spare_bufs = NULL;
    for (unsigned i = 0; i < t->slabs->len; i++) {
#ifdef MAP_POPULATE
        munmap(t->slabs->pdata[i], slab_size(t, i));
#else
        g_free(t->slabs->pdata[i]);
#endif
    }
    g_ptr_array_free(t->slabs, true);
    t->slabs = NULL;
    g_free(t->bounce);
    t->bounce = NULL;
}

static void cache_remove(Extree *t, ExtreeNode *n)
{
    g_hash_table_remove(t->cache, &n->bytenr);
    t->ncached--;
    if (n->list != EXT_LIST_NONE) {
        list_del(n);
    }
    if (n->dirty) {
        n->dirty = false;
        t->ndirty--;
    }
}

void extree_cache_shrink(Extree *t)
{
    while (t->ncached > t->cache_limit && t->lru.next != &t->lru) {
        ExtreeNode *n = t->lru.next;
        cache_remove(t, n);
        node_free(t, n);
        t->stats.evictions++;
    }
}

void extree_node_ref(ExtreeNode *n)
{
    n->refcnt++;
}

static void node_pin(Extree *t, ExtreeNode *n)
{
    if (n->refcnt++ == 0 && n->list == EXT_LIST_LRU) {
        list_del(n);
    }
}

void extree_node_unref(Extree *t, ExtreeNode *n)
{
    g_assert(n->refcnt > 0);
    if (--n->refcnt > 0) {
        return;
    }
    if (n->orphan) {
        node_free(t, n);
    } else if (!n->dirty) {
        list_add_tail(&t->lru, n, EXT_LIST_LRU);
        if (t->ncached > t->cache_limit) {
            extree_cache_shrink(t);
        }
    }
}

/* The node's location was freed: forget it (pinned: free on last unref) */
void extree_node_drop(Extree *t, ExtreeNode *n)
{
    cache_remove(t, n);
    if (n->refcnt) {
        n->orphan = true;
    } else {
        node_free(t, n);
    }
    t->seq++;
}

/*
 * Rollback (extree_rollback()): every node leaves the cache, dirty ones
 * unwritten; a pinned one (a cursor's, which sees t->seq change) is freed
 * on its last unref.  O(cached nodes).
 */
void extree_cache_forget(Extree *t)
{
    GPtrArray *all = g_ptr_array_sized_new(t->ncached);
    GHashTableIter it;
    gpointer key, value;

    g_hash_table_iter_init(&it, t->cache);
    while (g_hash_table_iter_next(&it, &key, &value)) {
        g_ptr_array_add(all, value);
    }
    for (unsigned i = 0; i < all->len; i++) {
        extree_node_drop(t, all->pdata[i]);
    }
    g_ptr_array_free(all, true);
    extree_prefetch_drop_all(t);
    t->seq++;
}

/* ---- Prefetched node images ---- */

/*
 * Why a prefetched image is never stale.  A no-wait query misses only a
 * node that is reachable from the current tree and clean, that is a node
 * of the last committed state; its location is not free.  Space is freed
 * by copy-on-write or merge as a pending free, allocatable only once the
 * commit that frees it has completed, and a new node is written there by
 * a commit after that one.  So nothing but that node lies at the location
 * from the miss until the next commit completes: an image read in between
 * and handed over before it is the node's, or damage that validation
 * reports.  A commit empties the table and bumps @prefetch_epoch, so an
 * image whose read began before it is refused, and a node created at a
 * location drops that location's image (it could only be an older one).
 */

static int prefetch_find(Extree *t, uint64_t bytenr)
{
    if (!t->nprefetch) {
        return -1;
    }
    for (int i = 0; i < EXTREE_PREFETCH_MAX; i++) {
        if (t->prefetch[i].buf && t->prefetch[i].bytenr == bytenr) {
            return i;
        }
    }
    return -1;
}

/* The image prefetched at @bytenr, taken out of the table; NULL if none */
static uint8_t *prefetch_take(Extree *t, uint64_t bytenr)
{
    int i = prefetch_find(t, bytenr);
    uint8_t *buf;

    if (i < 0) {
        return NULL;
    }
    buf = t->prefetch[i].buf;
    t->prefetch[i].buf = NULL;
    t->nprefetch--;
    return buf;
}

static void prefetch_drop(Extree *t, uint64_t bytenr)
{
    uint8_t *buf = prefetch_take(t, bytenr);

    if (buf) {
        g_ptr_array_add(t->spare_bufs, buf);
    }
}

/* At commit and close: no image survives a commit */
void extree_prefetch_drop_all(Extree *t)
{
    for (int i = 0; i < EXTREE_PREFETCH_MAX && t->nprefetch; i++) {
        if (t->prefetch[i].buf) {
            g_ptr_array_add(t->spare_bufs, t->prefetch[i].buf);
            t->prefetch[i].buf = NULL;
            t->nprefetch--;
        }
    }
    t->prefetch_epoch++;
}

void extree_node_prefetch(Extree *t, uint64_t bytenr, uint64_t epoch,
                          const void *buf)
{
    unsigned i = t->prefetch_next;

    if (epoch != t->prefetch_epoch || extree_node_cached(t, bytenr) ||
        prefetch_find(t, bytenr) >= 0) {
        return;
    }
    if (t->prefetch[i].buf) {
        g_ptr_array_add(t->spare_bufs, t->prefetch[i].buf);
        t->nprefetch--;
    }
    t->prefetch[i].bytenr = bytenr;
    t->prefetch[i].buf = buf_alloc(t);
    memcpy(t->prefetch[i].buf, buf, t->node_size);
    t->nprefetch++;
    t->prefetch_next = (i + 1) % EXTREE_PREFETCH_MAX;
}

uint64_t extree_missing_node(const Extree *t, uint64_t *epoch)
{
    *epoch = t->prefetch_epoch;
    return t->missing;
}

/*
 * A new node of this transaction at the newly allocated @bytenr, dirty and
 * pinned once: empty, or with the items of @src (copy-on-write).  Bytes
 * after the last item are zero, so that node images (and checksums) are
 * deterministic.  A node still cached at @bytenr is a stale clean copy of
 * a freed location and is forgotten; if it is dirty or pinned, it is part
 * of the tree: the allocator handed out a block that has an owner (the
 * free-space tree is damaged), and writing there would destroy it.
 */
int extree_node_new_copy(Extree *t, uint64_t bytenr, uint32_t owner,
                         unsigned level, const ExtreeNode *src,
                         ExtreeNode **out)
{
    ExtreeNode *n, *old = g_hash_table_lookup(t->cache, &bytenr);
    size_t used = EXTREE_NODE_HEADER_SIZE;

    *out = NULL;
    prefetch_drop(t, bytenr);
    if (old) {
        if (old->dirty || old->refcnt) {
            t->broken = true;
            return extree_corrupt(t, bytenr, "corrupt free tree: block at "
                                  "offset 0x%" PRIx64 " allocated for a new "
                                  "node is in use by a %s %s node (free "
                                  "space overlaps the %s)", bytenr,
                                  old->dirty ? "dirty" : "pinned",
                                  extree_tree_name(node_owner(old)),
                                  extree_tree_name(node_owner(old)));
        }
        extree_node_drop(t, old);
    }
    n = g_new0(ExtreeNode, 1);
    n->bytenr = bytenr;
    n->buf = buf_alloc(t);
    if (src) {
        used += (size_t)node_nritems(src) *
                (level ? EXT_PTR_ISZ : EXT_LEAF_ISZ);
        memcpy(n->buf, src->buf, used);
    }
    memset(n->buf, 0, EXTREE_NODE_HEADER_SIZE);
    memset(n->buf + used, 0, t->node_size - used);
    if (src) {
        node_set_nritems(n, node_nritems(src));
    }
    ext_st32(n->buf + EXT_NH_MAGIC, EXTREE_NODE_MAGIC);
    ext_st64(n->buf + EXT_NH_BYTENR, bytenr);
    ext_st64(n->buf + EXT_NH_GEN, t->trans_gen);
    ext_st32(n->buf + EXT_NH_OWNER, owner);
    n->buf[EXT_NH_LEVEL] = level;
    n->refcnt = 1;
    n->dirty = true;
    list_add_tail(&t->dirty, n, EXT_LIST_DIRTY);
    g_hash_table_insert(t->cache, &n->bytenr, n);
    t->ncached++;
    t->ndirty++;
    t->seq++;
    *out = n;
    return 0;
}

int extree_node_new(Extree *t, uint64_t bytenr, uint32_t owner,
                    unsigned level, ExtreeNode **out)
{
    return extree_node_new_copy(t, bytenr, owner, level, NULL, out);
}

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

/* child_bytes of the node: the lengths of the leaf items under it */
uint64_t extree_node_subtree_bytes(const ExtreeNode *n)
{
    int nr = node_nritems(n);
    uint64_t sum = 0;

    if (node_level(n)) {
        for (int i = 0; i < nr; i++) {
            sum += ptr_bytes(n, i);
        }
    } else {
        for (int i = 0; i < nr; i++) {
            sum += leaf_len(n, i);
        }
    }
    return sum;
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

static char *node_disagrees(const ExtreeNode *n, const ExtreeNodeExpect *e)
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
    char *why = node_disagrees(n, e);

    g_free(why);
    return why == NULL;
}

/*
 * Get node @bytenr pinned: from the cache (O(1), checked against the
 * parent's expectations by node_disagrees()) or read (or taken from the
 * prefetched images) and validated in full.  In a no-wait query a node
 * neither cached nor prefetched is -EWOULDBLOCK, not read.
 */
int extree_node_get(Extree *t, uint64_t bytenr, const ExtreeNodeExpect *e,
                    ExtreeNode **out)
{
    ExtreeNode *n = g_hash_table_lookup(t->cache, &bytenr);
    const char *tree = extree_tree_name(e->owner);
    char *why = NULL;
    uint8_t *buf;
    int ret;

    *out = NULL;
    if (n) {
        t->stats.cache_hits++;
        why = node_disagrees(n, e);
        if (why) {
            ret = extree_corrupt(t, bytenr, "corrupt %s node at offset 0x%"
                                 PRIx64 ": %s; the node is reachable from "
                                 "two parents", tree, bytenr, why);
            g_free(why);
            return ret;
        }
        node_pin(t, n);
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
    buf = prefetch_take(t, bytenr);
    if (!buf && t->nowait) {
        t->missing = t->walk_miss ? 0 : bytenr;
        return -EWOULDBLOCK;
    }
    t->stats.cache_misses++;
    n = g_new0(ExtreeNode, 1);
    n->bytenr = bytenr;
    if (buf) {
        /* read by the caller, and validated below like any other */
        n->buf = buf;
        t->stats.prefetched++;
    } else {
        n->buf = buf_alloc(t);
        ret = t->be->ops->pread(t->be->opaque, bytenr, n->buf, t->node_size);
        if (ret < 0) {
            node_free(t, n);
            return ret;
        }
    }
    ret = extree_node_validate(t, n->buf, bytenr, e, &why);
    if (ret < 0) {
        int64_t len = t->be->ops->get_length(t->be->opaque);

        /*
         * Reads past the end of the file return zeroes: say why the node
         * is damaged when the file was cut short (no corruption to flag:
         * the caller may tell the two apart by the message's first word)
         */
        if (len >= 0 && bytenr + t->node_size > (uint64_t)len) {
            ret = extree_corrupt(t, bytenr, "truncated image: %s node at "
                                 "offset 0x%" PRIx64 " lies past the end of "
                                 "the file (%" PRId64 " bytes)", tree, bytenr,
                                 len);
        } else {
            ret = extree_corrupt(t, bytenr, "corrupt %s node at offset 0x%"
                                 PRIx64 ": %s", tree, bytenr, why);
        }
        g_free(why);
        node_free(t, n);
        return ret;
    }
    /* The read may have yielded: someone else may have cached it */
    if (g_hash_table_lookup(t->cache, &bytenr)) {
        node_free(t, n);
        return extree_node_get(t, bytenr, e, out);
    }
    n->refcnt = 1;
    n->bytes = extree_node_subtree_bytes(n);
    g_hash_table_insert(t->cache, &n->bytenr, n);
    t->ncached++;
    extree_cache_shrink(t);
    *out = n;
    return 0;
}

bool extree_node_cached(Extree *t, uint64_t bytenr)
{
    return g_hash_table_lookup(t->cache, &bytenr) != NULL;
}

bool extree_node_is_dirty(Extree *t, uint64_t bytenr)
{
    ExtreeNode *n = g_hash_table_lookup(t->cache, &bytenr);

    return n && n->dirty;
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
    n = MIN((uint64_t)n, t->cache_limit / 4);
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
        nodes[k] = g_new0(ExtreeNode, 1);
        nodes[k]->bytenr = bytenr[i];
        nodes[k]->buf = buf_alloc(t);
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
            node_free(t, nd);
            continue;
        }
        nd->bytes = extree_node_subtree_bytes(nd);
        g_hash_table_insert(t->cache, &nd->bytenr, nd);
        t->ncached++;
        list_add_tail(&t->lru, nd, EXT_LIST_LRU);
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
            ExtreeNode *c = g_hash_table_lookup(t->cache, &child);

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
    GPtrArray *arr = g_ptr_array_sized_new(t->ndirty);
    guint batch = MAX(1, (1024 * 1024) / t->node_size);
    int ret = 0;

    for (ExtreeNode *n = t->dirty.next; n != &t->dirty; n = n->next) {
        /* pinned: the writes may yield */
        extree_node_ref(n);
        g_ptr_array_add(arr, n);
    }
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
            if (!t->bounce) {
                t->bounce = g_malloc((size_t)batch * t->node_size);
            }
            for (guint k = i; k < j; k++) {
                ExtreeNode *n = arr->pdata[k];
                extree_node_finish(t, n->buf);
                memcpy(t->bounce + (size_t)(k - i) * t->node_size, n->buf,
                       t->node_size);
            }
            ret = t->be->ops->pwrite(t->be->opaque, first->bytenr, t->bounce,
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

/* Commit step 7: dirty nodes are now committed, clean and evictable */
void extree_node_commit_done(Extree *t)
{
    while (t->dirty.next != &t->dirty) {
        ExtreeNode *n = t->dirty.next;
        list_del(n);
        n->dirty = false;
        n->bytes = extree_node_subtree_bytes(n);
        t->ndirty--;
        if (n->refcnt == 0) {
            list_add_tail(&t->lru, n, EXT_LIST_LRU);
        }
    }
    extree_prefetch_drop_all(t);
    extree_cache_shrink(t);
}
