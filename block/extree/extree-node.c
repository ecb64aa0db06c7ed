/*
 * extree core: the node cache
 *
 * Cached nodes are the raw on-disk image, validated once when read
 * (extree-node-check.c) by extree-node-io.c, which reads and writes them;
 * the rest of the core trusts cached nodes.
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
 * The one corruption helper: record the message (and keep the first one
 * for extree_take_corruption()), tell the handler, return -EIO for the
 * failing call to pass up.
 */
int extree_damage(Extree *t, ExtreeDamage kind, uint64_t offset,
                  const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    g_free(t->last_error);
    t->last_error = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    t->damage = kind;
    if (!t->pending.msg) {
        t->pending.offset = offset;
        t->pending.msg = g_strdup(t->last_error);
    }
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

    if (t->nc.spare_bufs->len) {
        return g_ptr_array_steal_index_fast(t->nc.spare_bufs,
                                            t->nc.spare_bufs->len - 1);
    }
    if (!t->nc.slab_left) {
        size_t size = slab_size(t, t->nc.slabs->len);
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
        g_ptr_array_add(t->nc.slabs, slab);
        t->nc.slab_next = slab;
        t->nc.slab_left = size / t->node_size;
    }
    buf = t->nc.slab_next;
    t->nc.slab_next += t->node_size;
    t->nc.slab_left--;
    return buf;
}

void extree_cache_init(Extree *t)
{
    t->nc.spare_bufs = g_ptr_array_new();
    t->nc.slabs = g_ptr_array_new();
    t->nc.slab_left = 0;
    t->nc.map = g_hash_table_new(g_int64_hash, g_int64_equal);
    list_init(&t->nc.lru);
    list_init(&t->nc.dirty);
}

void extree_cache_node_free(Extree *t, ExtreeNode *n)
{
    g_ptr_array_add(t->nc.spare_bufs, n->buf);
    g_free(n);
}

void extree_cache_destroy(Extree *t)
{
    GHashTableIter it;
    gpointer key, value;

    if (!t->nc.map) {
        return;
    }
    extree_prefetch_drop_all(t);
    g_hash_table_iter_init(&it, t->nc.map);
    while (g_hash_table_iter_next(&it, &key, &value)) {
        g_free(value);
    }
    g_hash_table_destroy(t->nc.map);
    t->nc.map = NULL;
    g_ptr_array_free(t->nc.spare_bufs, true);
    t->nc.spare_bufs = NULL;
    for (unsigned i = 0; i < t->nc.slabs->len; i++) {
#ifdef MAP_POPULATE
        munmap(t->nc.slabs->pdata[i], slab_size(t, i));
#else
        g_free(t->nc.slabs->pdata[i]);
#endif
    }
    g_ptr_array_free(t->nc.slabs, true);
    t->nc.slabs = NULL;
    g_free(t->nc.bounce);
    t->nc.bounce = NULL;
}

static void cache_remove(Extree *t, ExtreeNode *n)
{
    g_hash_table_remove(t->nc.map, &n->bytenr);
    t->nc.ncached--;
    if (n->list != EXT_LIST_NONE) {
        list_del(n);
    }
    if (n->dirty) {
        n->dirty = false;
        t->nc.ndirty--;
    }
}

void extree_cache_shrink(Extree *t)
{
    while (t->nc.ncached > t->nc.limit && t->nc.lru.next != &t->nc.lru) {
        ExtreeNode *n = t->nc.lru.next;
        cache_remove(t, n);
        extree_cache_node_free(t, n);
        t->stats.evictions++;
    }
}

/* The cached node at @bytenr (not pinned), NULL if none */
ExtreeNode *extree_cache_lookup(Extree *t, uint64_t bytenr)
{
    return g_hash_table_lookup(t->nc.map, &bytenr);
}

/*
 * A node for the image at @bytenr, not cached yet: in @buf (a prefetched
 * image) or, if NULL, in a fresh buffer
 */
ExtreeNode *extree_cache_node_alloc(Extree *t, uint64_t bytenr, uint8_t *buf)
{
    ExtreeNode *n = g_new0(ExtreeNode, 1);

    n->bytenr = bytenr;
    n->buf = buf ? buf : buf_alloc(t);
    return n;
}

/*
 * Cache the validated node @n: pinned by the caller, or unpinned at the
 * head of the eviction order (readahead).  The caller shrinks the cache.
 */
void extree_cache_insert(Extree *t, ExtreeNode *n, bool pinned)
{
    n->bytes = extree_node_subtree_bytes(n);
    g_hash_table_insert(t->nc.map, &n->bytenr, n);
    t->nc.ncached++;
    if (pinned) {
        n->refcnt = 1;
    } else {
        list_add_tail(&t->nc.lru, n, EXT_LIST_LRU);
    }
}

/* The dirty nodes, each pinned (the caller unrefs them) */
GPtrArray *extree_cache_dirty_pinned(Extree *t)
{
    GPtrArray *arr = g_ptr_array_sized_new(t->nc.ndirty);

    for (ExtreeNode *n = t->nc.dirty.next; n != &t->nc.dirty; n = n->next) {
        extree_node_ref(n);
        g_ptr_array_add(arr, n);
    }
    return arr;
}

void extree_node_ref(ExtreeNode *n)
{
    n->refcnt++;
}

void extree_cache_pin(Extree *t, ExtreeNode *n)
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
        extree_cache_node_free(t, n);
    } else if (!n->dirty) {
        list_add_tail(&t->nc.lru, n, EXT_LIST_LRU);
        if (t->nc.ncached > t->nc.limit) {
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
        extree_cache_node_free(t, n);
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
    GPtrArray *all = g_ptr_array_sized_new(t->nc.ncached);
    GHashTableIter it;
    gpointer key, value;

    g_hash_table_iter_init(&it, t->nc.map);
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
    if (!t->nc.nprefetch) {
        return -1;
    }
    for (int i = 0; i < EXTREE_PREFETCH_MAX; i++) {
        if (t->nc.prefetch[i].buf && t->nc.prefetch[i].bytenr == bytenr) {
            return i;
        }
    }
    return -1;
}

/* The image prefetched at @bytenr, taken out of the table; NULL if none */
uint8_t *extree_prefetch_take(Extree *t, uint64_t bytenr)
{
    int i = prefetch_find(t, bytenr);
    uint8_t *buf;

    if (i < 0) {
        return NULL;
    }
    buf = t->nc.prefetch[i].buf;
    t->nc.prefetch[i].buf = NULL;
    t->nc.nprefetch--;
    return buf;
}

static void prefetch_drop(Extree *t, uint64_t bytenr)
{
    uint8_t *buf = extree_prefetch_take(t, bytenr);

    if (buf) {
        g_ptr_array_add(t->nc.spare_bufs, buf);
    }
}

/* At commit and close: no image survives a commit */
void extree_prefetch_drop_all(Extree *t)
{
    for (int i = 0; i < EXTREE_PREFETCH_MAX && t->nc.nprefetch; i++) {
        if (t->nc.prefetch[i].buf) {
            g_ptr_array_add(t->nc.spare_bufs, t->nc.prefetch[i].buf);
            t->nc.prefetch[i].buf = NULL;
            t->nc.nprefetch--;
        }
    }
    t->nc.prefetch_epoch++;
}

void extree_node_prefetch(Extree *t, uint64_t bytenr, uint64_t epoch,
                          const void *buf)
{
    unsigned i = t->nc.prefetch_next;

    if (epoch != t->nc.prefetch_epoch || extree_node_cached(t, bytenr) ||
        prefetch_find(t, bytenr) >= 0) {
        return;
    }
    if (t->nc.prefetch[i].buf) {
        g_ptr_array_add(t->nc.spare_bufs, t->nc.prefetch[i].buf);
        t->nc.nprefetch--;
    }
    t->nc.prefetch[i].bytenr = bytenr;
    t->nc.prefetch[i].buf = buf_alloc(t);
    memcpy(t->nc.prefetch[i].buf, buf, t->node_size);
    t->nc.nprefetch++;
    t->nc.prefetch_next = (i + 1) % EXTREE_PREFETCH_MAX;
}

uint64_t extree_missing_node(const Extree *t, uint64_t *epoch)
{
    *epoch = t->nc.prefetch_epoch;
    return t->nc.missing;
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
    ExtreeNode *n, *old = g_hash_table_lookup(t->nc.map, &bytenr);
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
    list_add_tail(&t->nc.dirty, n, EXT_LIST_DIRTY);
    g_hash_table_insert(t->nc.map, &n->bytenr, n);
    t->nc.ncached++;
    t->nc.ndirty++;
    t->seq++;
    *out = n;
    return 0;
}

int extree_node_new(Extree *t, uint64_t bytenr, uint32_t owner,
                    unsigned level, ExtreeNode **out)
{
    return extree_node_new_copy(t, bytenr, owner, level, NULL, out);
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

bool extree_node_cached(Extree *t, uint64_t bytenr)
{
    return g_hash_table_lookup(t->nc.map, &bytenr) != NULL;
}

bool extree_node_is_dirty(Extree *t, uint64_t bytenr)
{
    ExtreeNode *n = g_hash_table_lookup(t->nc.map, &bytenr);

    return n && n->dirty;
}


/* Commit step 7: dirty nodes are now committed, clean and evictable */
void extree_node_commit_done(Extree *t)
{
    while (t->nc.dirty.next != &t->nc.dirty) {
        ExtreeNode *n = t->nc.dirty.next;
        list_del(n);
        n->dirty = false;
        n->bytes = extree_node_subtree_bytes(n);
        t->nc.ndirty--;
        if (n->refcnt == 0) {
            list_add_tail(&t->nc.lru, n, EXT_LIST_LRU);
        }
    }
    extree_prefetch_drop_all(t);
    extree_cache_shrink(t);
}
