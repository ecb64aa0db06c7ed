/*
 * extree core: internal interfaces between the layers
 *
 * Not for the QEMU driver: it uses block/extree/extree.h only.
 *
 * Nodes are kept in the cache as their raw little-endian on-disk image
 * (node_size bytes) and read through the inline load/store helpers below:
 * decoding costs nothing at read time and encoding is a checksum at write
 * time.  CPU-side values (ExtreeItem, ExtreeKeyPtr) are separate types.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef BLOCK_EXTREE_INT_H
#define BLOCK_EXTREE_INT_H

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <string.h>
#include <glib.h>

#include "extree.h"

#define EXTREE_ROUND_UP(x, a)   (((x) + (a) - 1) & ~((uint64_t)(a) - 1))
#define EXTREE_IS_ALIGNED(x, a) (((x) & ((uint64_t)(a) - 1)) == 0)

/* ---- Little-endian loads and stores into node buffers ---- */

static inline uint64_t ext_ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return GUINT64_FROM_LE(v);
}

static inline uint32_t ext_ld32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return GUINT32_FROM_LE(v);
}

static inline void ext_st64(uint8_t *p, uint64_t v)
{
    v = GUINT64_TO_LE(v);
    memcpy(p, &v, 8);
}

static inline void ext_st32(uint8_t *p, uint32_t v)
{
    v = GUINT32_TO_LE(v);
    memcpy(p, &v, 4);
}

/* ---- crc32c (extree-crc32c.c; extree_crc32c() in extree.h) ---- */

/*
 * The table version on any CPU, for tests/unit/test-crc32c.c: where
 * extree_crc32c() uses the crc32 instruction the tables are still tested
 */
uint32_t extree_crc32c_software(uint32_t crc, const void *buf, size_t len);

/* ---- CPU types ---- */

typedef struct ExtreeItem {
    uint64_t key, length, host;
    uint32_t type;              /* EXTREE_ITEM_*, 0 = none (punch) */
    uint32_t flags;             /* COMPRESSED: payload length, algorithm */
} ExtreeItem;

typedef struct ExtreeKeyPtr {
    uint64_t key, child, child_gen;
    uint64_t bytes;             /* child_bytes: leaf item lengths summed */
} ExtreeKeyPtr;

/* Field offsets in node buffers, from the format's structs */
#define EXT_NH_CSUM     offsetof(ExtreeDiskNodeHeader, csum)
#define EXT_NH_MAGIC    offsetof(ExtreeDiskNodeHeader, magic)
#define EXT_NH_BYTENR   offsetof(ExtreeDiskNodeHeader, bytenr)
#define EXT_NH_GEN      offsetof(ExtreeDiskNodeHeader, generation)
#define EXT_NH_OWNER    offsetof(ExtreeDiskNodeHeader, owner)
#define EXT_NH_LEVEL    offsetof(ExtreeDiskNodeHeader, level)
#define EXT_NH_NRITEMS  offsetof(ExtreeDiskNodeHeader, nritems)
#define EXT_IT_KEY      offsetof(ExtreeDiskItem, key)
#define EXT_IT_LEN      offsetof(ExtreeDiskItem, length)
#define EXT_IT_HOST     offsetof(ExtreeDiskItem, host_offset)
#define EXT_IT_TYPE     offsetof(ExtreeDiskItem, type)
#define EXT_IT_FLAGS    offsetof(ExtreeDiskItem, flags)
#define EXT_KP_KEY      offsetof(ExtreeDiskKeyPtr, key)
#define EXT_KP_CHILD    offsetof(ExtreeDiskKeyPtr, child)
#define EXT_KP_GEN      offsetof(ExtreeDiskKeyPtr, child_generation)
#define EXT_KP_BYTES    offsetof(ExtreeDiskKeyPtr, child_bytes)
#define EXT_RT_BYTENR   offsetof(ExtreeDiskRoot, bytenr)
#define EXT_RT_GEN      offsetof(ExtreeDiskRoot, generation)
#define EXT_RT_LEVEL    offsetof(ExtreeDiskRoot, level)
#define EXT_LEAF_ISZ    ((int)sizeof(ExtreeDiskItem))
#define EXT_PTR_ISZ     ((int)sizeof(ExtreeDiskKeyPtr))

/* ---- Node cache (extree-node.c) ---- */

typedef struct ExtreeNode {
    uint64_t bytenr;            /* hash key: where it lives on disk */
    uint8_t *buf;               /* node_size bytes, on-disk image */
    /*
     * One list at a time: t->nc.lru (clean, unpinned) or t->nc.dirty (dirty) or
     * none (clean and pinned)
     */
    struct ExtreeNode *prev, *next;
    /*
     * child_bytes the node's parent must carry: the lengths of the leaf
     * items under it.  Set when the node is read or committed; stale while
     * dirty (the parent's value is refreshed only at commit).
     */
    uint64_t bytes;
    uint32_t refcnt;
    bool dirty;
    bool orphan;                /* dropped from the tree while pinned */
    uint8_t list;               /* EXT_LIST_* */
} ExtreeNode;

enum { EXT_LIST_NONE, EXT_LIST_LRU, EXT_LIST_DIRTY };

static inline uint32_t node_nritems(const ExtreeNode *n)
{
    return ext_ld32(n->buf + EXT_NH_NRITEMS);
}
static inline void node_set_nritems(ExtreeNode *n, uint32_t v)
{
    ext_st32(n->buf + EXT_NH_NRITEMS, v);
}
static inline unsigned node_level(const ExtreeNode *n)
{
    return n->buf[EXT_NH_LEVEL];
}
static inline uint32_t node_owner(const ExtreeNode *n)
{
    return ext_ld32(n->buf + EXT_NH_OWNER);
}
static inline uint64_t node_gen(const ExtreeNode *n)
{
    return ext_ld64(n->buf + EXT_NH_GEN);
}
/* Offset of item @i: leaf items and key pointers both start with the key */
static inline uint8_t *node_item(const ExtreeNode *n, int i, int isz)
{
    return n->buf + EXTREE_NODE_HEADER_SIZE + (size_t)i * isz;
}
static inline uint64_t leaf_key(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, EXT_LEAF_ISZ));
}
static inline uint64_t leaf_len(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, EXT_LEAF_ISZ) + EXT_IT_LEN);
}
static inline void leaf_get(const ExtreeNode *n, int i, ExtreeItem *it)
{
    const uint8_t *p = node_item(n, i, EXT_LEAF_ISZ);
    it->key = ext_ld64(p + EXT_IT_KEY);
    it->length = ext_ld64(p + EXT_IT_LEN);
    it->host = ext_ld64(p + EXT_IT_HOST);
    it->type = ext_ld32(p + EXT_IT_TYPE);
    it->flags = ext_ld32(p + EXT_IT_FLAGS);
}
static inline void leaf_set(ExtreeNode *n, int i, const ExtreeItem *it)
{
    uint8_t *p = node_item(n, i, EXT_LEAF_ISZ);
    ext_st64(p + EXT_IT_KEY, it->key);
    ext_st64(p + EXT_IT_LEN, it->length);
    ext_st64(p + EXT_IT_HOST, it->host);
    ext_st32(p + EXT_IT_TYPE, it->type);
    ext_st32(p + EXT_IT_FLAGS, it->flags);
}
static inline uint64_t ptr_key(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, EXT_PTR_ISZ));
}
static inline void ptr_get(const ExtreeNode *n, int i, ExtreeKeyPtr *kp)
{
    const uint8_t *p = node_item(n, i, EXT_PTR_ISZ);
    kp->key = ext_ld64(p + EXT_KP_KEY);
    kp->child = ext_ld64(p + EXT_KP_CHILD);
    kp->child_gen = ext_ld64(p + EXT_KP_GEN);
    kp->bytes = ext_ld64(p + EXT_KP_BYTES);
}
static inline uint64_t ptr_get_child(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, EXT_PTR_ISZ) + EXT_KP_CHILD);
}
static inline uint64_t ptr_bytes(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, EXT_PTR_ISZ) + EXT_KP_BYTES);
}
static inline void ptr_set(ExtreeNode *n, int i, const ExtreeKeyPtr *kp)
{
    uint8_t *p = node_item(n, i, EXT_PTR_ISZ);
    ext_st64(p + EXT_KP_KEY, kp->key);
    ext_st64(p + EXT_KP_CHILD, kp->child);
    ext_st64(p + EXT_KP_GEN, kp->child_gen);
    ext_st64(p + EXT_KP_BYTES, kp->bytes);
}
static inline uint64_t node_key(const ExtreeNode *n, int i)
{
    return ext_ld64(node_item(n, i, node_level(n) ? EXT_PTR_ISZ
                                                  : EXT_LEAF_ISZ));
}

/* What a reader expects of a node: checked once, when read from disk */
typedef struct ExtreeNodeExpect {
    uint32_t owner;
    unsigned level;
    uint64_t generation;        /* from the parent pointer or superblock */
    bool has_first_key;
    uint64_t first_key;         /* parent's key for this child */
    /*
     * every item ends <= this (next parent key), UINT64_MAX for the last child
     */
    uint64_t key_end;
    /*
     * the parent's child_bytes for this child; none for a root, and none
     * is checked for a dirty node (its parent's value is refreshed only
     * when the transaction commits)
     */
    bool has_bytes;
    uint64_t bytes;
    /*
     * extent trees: guest keys end at or below this, the rounded virtual
     * size of the tree the node is reached from; only the VM state area
     * lies beyond (ExtreeTree's data_end)
     */
    uint64_t data_end;
} ExtreeNodeExpect;

/*
 * Space map: where the B+tree gets the space of a new node and gives back
 * the old one, and where the extent layer gives back DATA, in the manner
 * of device-mapper's dm_space_map passed to its btree.  The B+tree calls
 * nothing else of the allocator, so it runs over any space map (the unit
 * tests give it a table in memory).
 *
 * References are counted per block: 0 free, 1 one owner, more shared.
 * Without snapshots no block is shared and the map refuses a second
 * reference; with them (EXTREE_INCOMPAT_SNAPSHOTS) the counts of 2 and
 * more are kept in t->refs and the reference count tree, and extent tree
 * nodes and DATA are shared between the live tree and the snapshots.
 * Space whose last reference is dropped is free once the transaction
 * commits, not before (the last durable state still uses it).
 */
typedef struct ExtreeSpaceMapOps {
    /* A node_size block for a node of this transaction, one reference */
    int (*new_node)(void *opaque, uint64_t *bytenr);
    /* One more reference to every block of [start, start + len) */
    int (*inc_ref)(void *opaque, uint64_t start, uint64_t len);
    /* One reference fewer; @node: node space (reused first, discarded late) */
    int (*dec_ref)(void *opaque, uint64_t start, uint64_t len, bool node);
    /* *@count = references to the block at @start */
    int (*ref_count)(void *opaque, uint64_t start, uint32_t *count);
} ExtreeSpaceMapOps;

typedef struct ExtreeSpaceMap {
    const ExtreeSpaceMapOps *ops;
    void *opaque;
} ExtreeSpaceMap;

/*
 * A shared leaf is copied: its item @it gains a reference (the extent
 * layer's: DATA space), see ExtreeTree.share_item
 */
typedef int ExtreeShareFn(Extree *t, const ExtreeItem *it);

/*
 * A node older than snap_gen whose count says 1 is about to be freed by a
 * copy: 0 if no other root reaches it, else -EIO (the count lied), see
 * ExtreeTree.verify_unshared
 */
typedef int ExtreeVerifyFn(Extree *t, struct ExtreeNode *n);

/*
 * What a tree's items mean, for the B+tree (dm persistent-data's
 * dm_btree_value_type): the tree stores, splits and merges items through
 * these and knows nothing else of them.  One per kind of tree, owned by
 * the layer that gives the items their meaning: extree_extent_vt (DATA,
 * ZERO, COMPRESSED), extree_free_vt (FREE), extree_refs_vt (REFS).
 */
typedef struct ExtreeValueType {
    /* @a and @b (adjacent keys, @a first) may be stored as one item */
    bool (*mergeable)(const ExtreeItem *a, const ExtreeItem *b);
    /* The host field of the piece of @it that starts at key @key */
    uint64_t (*host_at)(const ExtreeItem *it, uint64_t key);
} ExtreeValueType;

extern const ExtreeValueType extree_extent_vt, extree_free_vt,
                             extree_refs_vt;

/* One tree: extent, free or reference counts */
typedef struct ExtreeTree {
    uint32_t owner;             /* EXTREE_TREE_* */
    const ExtreeValueType *vt;  /* what its items mean */
    /*
     * Nodes of this tree may be shared (the extent tree of an image with
     * snapshots): copy-on-write of a node with more than one reference
     * adds one to its children's, through @share_item for leaf items
     */
    bool shared;
    ExtreeShareFn *share_item;
    /* the live extent tree's: the other roots are probed (extree-extent.c) */
    ExtreeVerifyFn *verify_unshared;
    uint64_t root;              /* bytenr */
    uint64_t root_gen;
    unsigned level;             /* of the root */
    uint64_t nitems;            /* leaf items */
    uint64_t total;             /* sum of item lengths */
    /*
     * Extent trees: the virtual size of this tree rounded up to a block
     * (a snapshot's own size for a snapshot's tree); no item may reach
     * past it except in the VM state area.  UINT64_MAX for other trees.
     */
    uint64_t data_end;
} ExtreeTree;

static inline uint32_t extree_compressed_len(const ExtreeItem *it)
{
    return it->flags & EXTREE_COMPRESSED_LEN_MASK;
}

static inline uint32_t extree_compressed_alg(const ExtreeItem *it)
{
    return it->flags >> EXTREE_COMPRESSED_ALG_SHIFT;
}

/*
 * The host space an extent-tree item holds: DATA its length, COMPRESSED
 * its payload rounded up to blocks, ZERO none
 */
static inline uint64_t extree_item_host_bytes(const ExtreeItem *it,
                                              uint32_t block_size)
{
    switch (it->type) {
    case EXTREE_ITEM_DATA:
        return it->length;
    case EXTREE_ITEM_COMPRESSED:
        return EXTREE_ROUND_UP((uint64_t)extree_compressed_len(it),
                               block_size);
    default:
        return 0;
    }
}

/* The piece [item->key, + item->length) of a leaf item left the tree */
typedef int ExtreeRemovedFn(void *opaque, const ExtreeItem *piece);

/*
 * Per-tree arrays are indexed by the tree's owner number (slot 0 unused).
 * EXT_FOR_EACH_TREE: the trees every image has; the reference count tree
 * exists only with EXTREE_INCOMPAT_SNAPSHOTS (extree_has_refs()).
 */
#define EXT_NTREES      (EXTREE_TREE_REFS + 1)
#define EXT_FOR_EACH_TREE(owner) \
    for (uint32_t owner = EXTREE_TREE_EXTENT; owner <= EXTREE_TREE_FREE; \
         owner++)

/*
 * The most memory one bitmap's bits may take (bytes), as qcow2 bounds a
 * bitmap (BME_MAX_PHYS_SIZE): 2^32 granules, 256 TiB of disk at 64 KiB.
 * An implementation limit, not a format rule: a larger bitmap is refused
 * at open (a checker's handle leaves it out, so that a repair can remove
 * it), when added and when a resize would grow one past it.
 */
#define EXTREE_BITMAP_MAX_BYTES (512ULL * 1024 * 1024)

/* A snapshot table entry, CPU side (ExtreeDiskSnapEntry) */
/*
 * A persistent dirty bitmap (extree-bitmap.c).  @bits is @nchunks blocks,
 * in the on-disk order (granule g: bit g % 8 of byte g / 8).  The
 * committed content is @bits too, except for the chunks this transaction
 * changed: @cchunk[c] holds the committed copy of such a chunk (NULL for
 * a clean one), so that memory is one copy of the bits plus what changed.
 */
typedef struct ExtreeBitmap {
    char *name;
    uint32_t gran_bits;         /* log2 of the granularity */
    bool enabled;
    bool cenabled;              /* enabled in the committed state */
    uint64_t ngran;             /* granules: virtual size / granularity, up */
    uint64_t nchunks;
    uint64_t count;             /* granules set in @bits */
    uint8_t *bits;              /* the content, as the next commit stores it */
    uint8_t **cchunk;           /* committed copies of changed chunks */
    uint64_t *chunk_off;        /* where each chunk lies, 0: all clear */
    uint32_t *chunk_csum;
    /* clean, changed in memory, or given new space by this commit */
    uint8_t *chunk_state;
} ExtreeBitmap;

typedef struct ExtreeSnap {
    uint64_t root, root_gen;
    unsigned level;
    uint64_t generation, virtual_size, extent_count, extent_bytes;
    uint64_t date_sec, vm_clock_nsec, vm_state_size, icount;
    uint32_t date_nsec;
    char id[EXTREE_SNAP_ID_MAX + 1];
    char name[EXTREE_SNAP_NAME_MAX + 1];
} ExtreeSnap;

/* A host range whose blocks have @count references, @count >= 2 */
typedef struct ExtreeRefRange {
    uint64_t start, len;
    uint32_t count;
} ExtreeRefRange;

/* A logged change of free space, or just a host range */
typedef struct ExtreeAllocOp {
    uint64_t start, len;
    bool is_free;
} ExtreeAllocOp;

/*
 * A set of disjoint host ranges (extree-rangeset.c: a treap keyed by
 * start, augmented with the longest range of each subtree)
 */
typedef struct ExtreeRange ExtreeRange;
struct ExtreeRange {
    uint64_t start, len;
    uint64_t maxlen;            /* longest range in this subtree */
    uint32_t prio;              /* heap order: parent prio >= child prio */
    ExtreeRange *left, *right;
};

typedef struct ExtreeRangeSet {
    ExtreeRange *root;
    uint64_t count, bytes;
    /*
     * With @unit set (the allocator's avail and nfree: node_size), the
     * sum of len / unit over the ranges: how many nodes they hold
     */
    uint64_t unit, units;
    uint32_t rng;
    /* open: the right spine while ranges are appended in order */
    GPtrArray *spine;
    /* the set's nodes: slabs, and a list of the free ones */
    GPtrArray *slabs;
    ExtreeRange *free_nodes;
    uint32_t slab_used, slab_len;
} ExtreeRangeSet;

/*
 * Freed node space is discarded in runs of at least this size (and one
 * node): single nodes are recycled within a commit or two, and a discard
 * would only leave a hole for the host to fill again.  Free ranges of one
 * node up to this size load as node space.
 */
#define EXT_DISCARD_NODES_MIN   (256 * 1024)

/* extree-rangeset.c */
void extree_rs_add(ExtreeRangeSet *s, uint64_t start, uint64_t len);
ExtreeRange *extree_rs_after(const ExtreeRangeSet *s, uint64_t off);
void extree_rs_append(ExtreeRangeSet *s, uint64_t start, uint64_t len);
void extree_rs_append_done(ExtreeRangeSet *s);
void extree_rs_clear(ExtreeRangeSet *s);
ExtreeRange *extree_rs_first_fit(const ExtreeRangeSet *s, uint64_t len);
ExtreeRange *extree_rs_floor(const ExtreeRangeSet *s, uint64_t off);
ExtreeRange *extree_rs_from(const ExtreeRangeSet *s, uint64_t pos);
void extree_rs_insert(ExtreeRangeSet *s, uint64_t start, uint64_t len);
ExtreeRange *extree_rs_last(const ExtreeRangeSet *s);
uint64_t extree_rs_longest(const ExtreeRangeSet *s);
bool extree_rs_overlaps(const ExtreeRangeSet *s, uint64_t start, uint64_t len);
void extree_rs_remove(ExtreeRangeSet *s, uint64_t start, uint64_t len);
void extree_rs_union(ExtreeRangeSet *s, uint64_t start, uint64_t len);

/* The result of the last extree_bt_find(), valid while t->seq is */
typedef struct ExtreeFindCache {
    bool valid;
    uint32_t owner;
    uint64_t seq, key;
    ExtreeItem prev, next;
    bool has_prev, has_next;
} ExtreeFindCache;

/*
 * The space map's own state, as dm persistent-data's sm_disk owns its
 * bitmaps, counts and roots: the free space in memory (extree-alloc.c),
 * the counts of 2 and more (extree-reftree.c), the logs their on-disk
 * trees are synced from at commit (extree_sm_commit(), extree-spacemap.c).
 * The B+tree and the extent layer reach it only through t->sm
 * (ExtreeSpaceMapOps, whose opaque this is) and the allocator's and the
 * reference counts' functions; nothing above the transaction layer
 * touches it.  @t: the handle whose node layer keeps its trees (dm's
 * transaction manager).
 */
typedef struct ExtreeSpace {
    struct Extree *t;
    /* free space known: the free tree loaded (never for read-only handles) */
    bool alloc_loaded;
    ExtreeRangeSet avail;       /* allocatable now */
    ExtreeRangeSet nfree;       /* allocatable now, freed node space */
    ExtreeRangeSet pending;     /* freed in this transaction */
    uint64_t resv_start, resv_end;  /* metadata reserve, free */
    /*
     * The free tree loaded in part (extree_freetree_load()): the sets
     * hold the free space of [data_start, free_lo), of [free_hi, ...) and
     * of @touched, every range of [free_lo, free_hi) whose state changed
     * since the open (memory knows it better than the tree does until a
     * sync); the tree's rest, @unloaded_bytes of free space, is read by
     * extree_freetree_load_rest() before anything that wants the whole
     * picture (data placement, the checker, a backend of fixed size).
     * Nodes and the snapshot table come from the sets, else new space.
     */
    bool alloc_partial;
    uint64_t free_lo, free_hi, unloaded_bytes;
    ExtreeRangeSet touched;
    /* while the rest loads: avail and nfree as they were, and how far */
    ExtreeRangeSet rest_avail, rest_nfree;
    uint64_t rest_done;
    bool resv_nfree;            /* ... taken from nfree */
    /*
     * Node space allocated in the running transaction: no committed
     * state uses it, so a node freed there goes straight back to nfree
     * (btrfs_free_tree_block(), dm's sm_disk_new_block())
     */
    ExtreeRangeSet fresh;
    /*
     * Data space extree_alloc_data() handed out since the last commit
     * began, while the image had bitmaps: no committed state maps it, so
     * a write into it changes nothing a crash returns to
     * (extree_data_fresh())
     */
    ExtreeRangeSet fresh_data;
    /*
     * Nodes' worth of space the next commit takes besides the trees'
     * nodes (bitmap chunks and directory; extree_alloc_commit_extra())
     */
    uint64_t commit_extra;
    /*
     * ... and what the marks of one update may add to it at most (every
     * chunk of every enabled bitmap), for the bounds a caller grows to
     * (extree_grow_bound()): while a device's end is unknown no guard
     * counts an update's chunks, so the bound must find the end first
     */
    uint64_t mark_max;
    /* ExtreeAllocOp since the last free-tree sync */
    GArray *oplog;
    /*
     * What to discard after commit (ExtreeAllocOp): DATA and other space
     * freed in this transaction, at once; node space freed in it, after
     * the next commit if still unused then (metadata churn is mostly
     * reused right away, a discard would only cost a hole to refill)
     */
    GArray *freed_data, *freed_nodes, *discard_later;
    /* host_end lowered in this transaction: truncate after commit */
    bool trimmed;
    /*
     * The largest host_end the backend can hold (a block device, an NBD
     * export); 0: the backend grows as needed
     */
    uint64_t host_limit;
    /*
     * Reference counts of 2 and more (ExtreeRefRange by start, disjoint),
     * loaded from the reference count tree at read-write open; @reflog:
     * ranges changed since its last sync (ExtreeAllocOp)
     */
    GTree *refs;
    GArray *reflog;
} ExtreeSpace;

/*
 * The node cache (extree-node.c; reads and writes through it in
 * extree-node-io.c): O(1) lookup by bytenr, intrusive LRU of clean
 * unpinned nodes; dirty nodes stay until commit
 */
typedef struct ExtreeCache {
    GHashTable *map;
    ExtreeNode lru;             /* list head; lru.next is the oldest */
    ExtreeNode dirty;           /* list head */
    uint64_t ncached, ndirty;
    uint64_t limit;             /* nodes */
    uint64_t dirty_limit;       /* nodes */
    /*
     * Node buffers: carved from slabs (EXT_SLAB_SIZE), recycled through
     * spare_bufs (CoW allocates and frees one per copy), freed at close
     */
    GPtrArray *spare_bufs;
    GPtrArray *slabs;
    uint8_t *slab_next;
    size_t slab_left;           /* buffers left in the newest slab */
    uint8_t *bounce;            /* commit: consecutive nodes, one write */
    /*
     * No-wait queries (extree_cursor_query_nowait()): while @nowait, a
     * node miss fails with -EWOULDBLOCK instead of reading, and records
     * the node in @missing (0: a forward walk's leaf, left to the blocking
     * query and its readahead).  @walk_miss: the miss at hand is one.
     */
    bool nowait, walk_miss;
    uint64_t missing;
    /*
     * Node images the caller read for a no-wait query
     * (extree_node_prefetch()), taken by the next miss of their location;
     * a ring, @prefetch_next the oldest slot, buf NULL when empty.  All
     * dropped, and @prefetch_epoch bumped, at every commit (extree-node.c
     * says why that keeps them from going stale).
     */
    struct {
        uint64_t bytenr;
        uint8_t *buf;
    } prefetch[EXTREE_PREFETCH_MAX];
    unsigned prefetch_next, nprefetch;
    uint64_t prefetch_epoch;
} ExtreeCache;

/* Snapshots (EXTREE_INCOMPAT_SNAPSHOTS; extree-snap.c, extree-snaptab.c) */
typedef struct ExtreeSnaps {
    /*
     * The table (ExtreeSnap), where the committed one lies, and whether
     * this transaction changed it.  Nodes of generation >= @gen have one
     * reference (spec: Sharing).
     */
    GArray *list;
    uint64_t table, table_len;
    bool dirty;
    uint64_t gen;
    /*
     * The superblock's snap_generation is not above every snapshot's
     * generation (@gen_stored): shared nodes would look unshared.  Only a
     * read-only or checker's handle opens so, with @gen raised to the
     * running transaction's; the checker reports it and "-r all" commits
     * the raised value.
     */
    bool gen_bad;
    uint64_t gen_stored;
} ExtreeSnaps;

/* Persistent dirty bitmaps (EXTREE_INCOMPAT_BITMAPS, extree-bitmap.c) */
typedef struct ExtreeBitmaps {
    /*
     * The ExtreeBitmap pointers, in directory order; where the committed
     * directory lies (@dir_len bytes in use); whether this transaction
     * writes a new one; how many bitmaps are enabled; the guest ranges
     * this transaction changed (ExtreeRange: start, len), marked in the
     * enabled bitmaps, for extree_bitmap_sync()
     */
    GPtrArray *list;
    /*
     * Bitmaps enabled in the committed state that the running
     * transaction removed: a crash returns to a state that has them, so
     * until the commit writes in place must still find their committed
     * bits set (extree_bitmaps_in_place()); freed by the commit
     */
    GPtrArray *removed;
    uint64_t dir;
    uint32_t dir_len;
    bool dirty;
    unsigned enabled;
    GArray *marks;
    /* extree_bitmaps_keep_marks(): commits keep @marks */
    bool marks_kept;
    /*
     * Writes refused in place only because the marks they need are not
     * committed yet (extree_bitmaps_in_place()): they go to new space, as
     * would later ones to the same granules until a commit, so enough of
     * them ask for one (EXTREE_BITMAP_COMMIT_HELD).  A write that is the
     * first to its granule does not: a commit would not let it in.
     */
    uint64_t held;
    /*
     * Chunks this transaction changed (each takes a new block at the
     * commit, as the directory does): counted in what a commit needs
     * (extree_alloc_nodes_estimate())
     */
    uint64_t chunks_changed;
    /*
     * A checker's handle: what was wrong with the bitmaps it left out
     * (extree_bitmaps_load()), NULL if nothing
     */
    char *bad;
    /* ExtreeOpenOptions.bitmap_max_bytes, the default filled in */
    uint64_t max_bytes;
    /*
     * The mark log (EXTREE_INCOMPAT_MARK_LOG, extree-marklog.c): where it
     * lies (0: none; usable once a superblock names it, @log_ok); the
     * slot of the running transaction's next record; the guest ranges of
     * its durable records (the in-place rule takes them as committed
     * marks); whether marks were set that only the log has made durable
     * (the next commit stores them; they alone do not make the handle
     * dirty, so a flush need not commit); records replayed at the last
     * load; what was wrong with the log at a checker's open, NULL if
     * nothing.  @no_log: ExtreeOpenOptions.no_mark_log.
     */
    uint64_t log;
    uint32_t log_len;
    bool log_ok, no_log;
    uint32_t log_next;
    ExtreeRangeSet logged;
    bool dirty_logged;
    uint32_t log_replayed;
    char *log_bad;
    /*
     * Map records (EXTREE_INCOMPAT_MAP_LOG): writes to new space whose
     * data is written, their entries not yet in a record (ExtreeMapEntry,
     * in write order); the host ranges that the chain's or those entries
     * map, never written in place until a commit (a record's checksum
     * must keep matching its data; their bytes bound a replay's reads);
     * the chain's entries read at the last load, applied once the
     * allocator is loaded (@map_replay, freed then); the
     * running transaction changed something no record holds, so a flush
     * must commit (@unlogged); an update made for a map entry is running
     * (@logging: it does not set @unlogged).  The open of an image
     * marked corrupt whose chain did not apply tries again without it
     * (@map_failed, then @map_skip).  A log of map records only is wanted
     * without bitmaps (@map_wanted): the image had one at open, or the
     * handle's flushes committed EXTREE_MAP_LOG_AFTER times
     * (@flush_commits, counted while there is no log).
     * All under the caller's serialisation of the handle (extree.h).
     */
    GArray *map_pending;
    ExtreeRangeSet map_hosts;
    GArray *map_replay;
    uint32_t map_replayed;
    bool unlogged, logging;
    bool map_failed, map_skip;
    bool map_wanted;
    uint32_t flush_commits;
} ExtreeBitmaps;

/* What a checker's handle found at open (extree-check.c) */
typedef struct ExtreeCheckState {
    /*
     * The extent tree root's item lengths disagree with the superblock's
     * extent_bytes (opened for the checker only): @root_bytes_want
     */
    bool root_bytes_bad;
    uint64_t root_bytes_want;
    /* generation checked without unrepaired corruption, 0 if none */
    uint64_t clean_gen;
} ExtreeCheckState;

struct Extree {
    ExtreeBackend *be;
    bool read_only;
    /*
     * a failed commit left memory inconsistent, or marked corrupt:
     * refuse updates
     */
    bool broken;
    /*
     * ... only because host space ran out (-ENOSPC) in an update or a
     * commit: extree_rollback() brings the handle back to its last commit
     */
    bool broken_nospace;
    bool repair;                /* opened for the checker (repair option) */
    uint32_t block_size, node_size;
    int leaf_cap, ptr_cap;
    uint64_t virtual_size, host_end, data_start;
    /*
     * host_end of the last committed state: nodes read from disk lie below it
     */
    uint64_t sb_host_end;
    /*
     * The state the handle was opened from or rolled back to: a node of
     * generation @base_gen or older was reachable from it, so everything
     * it points to lies below @base_host_end however far host_end has
     * grown since.  A superblock with host_end lowered below blocks that
     * only unread nodes use (a snapshot's) would otherwise let new space
     * overwrite them and the old nodes pass once host_end has grown past
     * (spec: Readers, Validation).
     */
    uint64_t base_gen, base_host_end;
    /*
     * The backend held bytes past base_host_end when this state was
     * loaded: nodes of that state may use them (a lowered host_end), so
     * every tree is read before the first update (extree_probe_end())
     */
    bool base_tail;
    /*
     * extree_probe_end() found nothing reaching past base_host_end (or
     * nothing could: no base_tail): the space past host_end may be
     * handed out
     */
    bool end_probed;
    /* extree_rollback() dropped a transaction (extree_changes_lost()) */
    bool changes_lost;
    uint64_t generation;        /* last committed superblock */
    /* generation + 1: nodes of this transaction carry it and are writable */
    uint64_t trans_gen;
    uint64_t incompat, compat;
    /*
     * With EXTREE_INCOMPAT_ENCRYPTED: where the encryption header lies,
     * [crypt_header_offset, + crypt_header_length), below data_start.
     * Set at open, never changed: all 0 without the bit.
     */
    uint32_t crypt_method;
    uint64_t crypt_header_offset, crypt_header_length;
    /* EXTREE_COMPRESS_*: what the caller compresses new extents with */
    uint32_t compression_type;
    char *backing_file, *backing_fmt;
    bool super_dirty;

    ExtreeTree trees[EXT_NTREES];
    struct ExtreeSuper *csb;    /* last committed superblock */

    ExtreeCache nc;             /* the node cache */

    uint64_t seq;               /* bumped by every tree change */
    /*
     * The B+tree allocates and frees nodes here (the allocator's map, set
     * at open and create)
     */
    ExtreeSpaceMap sm;
    /*
     * Updates never commit: the caller asks extree_commit_wanted() at a
     * point of its own (ExtreeOpenOptions.commit_by_caller)
     */
    bool commit_by_caller;

    /*
     * Last search path of each tree, pinned: a search that passes through
     * the same nodes takes them from here instead of the node cache, and a
     * search of the same leaf costs no lookup at all (alloc_data, map_data
     * and the free-tree sync search the same leaf several times)
     */
    ExtreePath pcache[EXT_NTREES];
    ExtreeFindCache fcache;

    /*
     * The space map (ExtreeSpace): free space, reference counts and their
     * trees.  t->sm's opaque.
     */
    ExtreeSpace space;

    char *open_warning;

    ExtreeSnaps snap;           /* snapshots */
    ExtreeBitmaps bm;           /* persistent dirty bitmaps */
    ExtreeCheckState chk;       /* what a checker's handle found at open */

    /*
     * Read-only view of a snapshot (extree_snapshot_load_tmp()): -1, or
     * the index whose tree t->trees[EXTREE_TREE_EXTENT] is
     */
    int snap_view;

    ExtreeStats stats;
    ExtreeCorruptFn *corrupt_fn;
    void *corrupt_opaque;
    ExtreeCorruption pending;   /* msg NULL: none (extree_take_corruption) */
    char *last_error;
    ExtreeDamage damage;        /* the kind of the last damage found */
    ExtreeTraceFn *trace_fn;    /* extree_set_trace() */
    void *trace_opaque;
};

/* A trace point: a test and nothing more while nobody traces */
static inline void extree_trace(Extree *t, ExtreeTraceEvent ev, uint64_t a,
                                uint64_t b, uint64_t c)
{
    if (G_UNLIKELY(t->trace_fn)) {
        t->trace_fn(t->trace_opaque, ev, a, b, c);
    }
}

/* extree-node.c: the node cache */
void extree_cache_init(Extree *t);
void extree_cache_destroy(Extree *t);
int extree_node_new(Extree *t, uint64_t bytenr, uint32_t owner,
                    unsigned level, ExtreeNode **out);
int extree_node_new_copy(Extree *t, uint64_t bytenr, uint32_t owner,
                         unsigned level, const ExtreeNode *src,
                         ExtreeNode **out);
void extree_node_ref(ExtreeNode *n);
void extree_node_unref(Extree *t, ExtreeNode *n);
void extree_node_drop(Extree *t, ExtreeNode *n);
void extree_cache_shrink(Extree *t);
void extree_cache_forget(Extree *t);
bool extree_node_cached(Extree *t, uint64_t bytenr);
bool extree_node_is_dirty(Extree *t, uint64_t bytenr);
uint64_t extree_node_subtree_bytes(const ExtreeNode *n);
/* Commit step 7: dirty nodes are now committed, clean and evictable */
void extree_node_commit_done(Extree *t);
void extree_prefetch_drop_all(Extree *t);
/*
 * Damage found at host @offset: the message is recorded (t->last_error)
 * and given to the corrupt handler, its kind kept in t->damage; -EIO
 */
int extree_damage(Extree *t, ExtreeDamage kind, uint64_t offset,
                  const char *fmt, ...) G_GNUC_PRINTF(4, 5);
#define extree_corrupt(t, offset, ...) \
    extree_damage(t, EXTREE_DAMAGE_CORRUPT, offset, __VA_ARGS__)
/* ... a structure past the end of the file: the file was cut short */
#define extree_truncated(t, offset, ...) \
    extree_damage(t, EXTREE_DAMAGE_TRUNCATED, offset, __VA_ARGS__)
const char *extree_tree_name(uint32_t owner);
/* ... for extree-node-io.c only */
ExtreeNode *extree_cache_lookup(Extree *t, uint64_t bytenr);
void extree_cache_pin(Extree *t, ExtreeNode *n);
ExtreeNode *extree_cache_node_alloc(Extree *t, uint64_t bytenr,
                                    uint8_t *buf);
void extree_cache_node_free(Extree *t, ExtreeNode *n);
void extree_cache_insert(Extree *t, ExtreeNode *n, bool pinned);
GPtrArray *extree_cache_dirty_pinned(Extree *t);
uint8_t *extree_prefetch_take(Extree *t, uint64_t bytenr);

/* extree-node-check.c: validation */
int extree_node_validate(Extree *t, const uint8_t *buf, uint64_t bytenr,
                         const ExtreeNodeExpect *e, char **why);
bool extree_node_matches(const ExtreeNode *n, const ExtreeNodeExpect *e);
/* Why cached node @n is not what @e expects (g_free()), NULL if it is */
char *extree_node_disagrees(const ExtreeNode *n, const ExtreeNodeExpect *e);

/* extree-node-io.c: reads through the cache, readahead, write-back */
int extree_node_get(Extree *t, uint64_t bytenr, const ExtreeNodeExpect *e,
                    ExtreeNode **out);
/*
 * Leaves read at once when a forward walk steps onto an uncached one: the
 * first batch of a walk is small (a read that merely crosses a leaf
 * boundary), each next one twice the last, as in the kernel's readahead
 */
#define EXTREE_READAHEAD_FIRST  4
#define EXTREE_READAHEAD_MAX    512
void extree_node_readahead(Extree *t, int n, const uint64_t *bytenr,
                           const ExtreeNodeExpect *e);
void extree_node_finish(Extree *t, uint8_t *buf);
int extree_node_write_dirty(Extree *t);

static inline bool extree_has_refs(const Extree *t)
{
    return t->incompat & EXTREE_INCOMPAT_SNAPSHOTS;
}

/*
 * Extent tree items lie below this: the virtual size, or with snapshots
 * the end of the VM state area (snapshot trees have sizes of their own)
 */
static inline uint64_t extree_key_limit(const Extree *t)
{
    return extree_has_refs(t) ? EXTREE_VMSTATE_END
                              : EXTREE_ROUND_UP(t->virtual_size,
                                                t->block_size);
}

/*
 * An extent item [@key, +@len) reaches past @data_end (ExtreeTree's) but
 * not into the VM state area: beyond the virtual size of its tree.  @len
 * is at most extree_key_limit() - @key.
 */
static inline bool extree_item_past_size(uint64_t key, uint64_t len,
                                         uint64_t data_end)
{
    return key < EXTREE_VMSTATE_BASE && key + len > data_end;
}

/* A tree descriptor for snapshot @sn's extent tree */
static inline void extree_snap_tree(Extree *t, const ExtreeSnap *sn,
                                    ExtreeTree *tree)
{
    *tree = t->trees[EXTREE_TREE_EXTENT];
    tree->root = sn->root;
    tree->root_gen = sn->root_gen;
    tree->level = sn->level;
    tree->nitems = sn->extent_count;
    tree->total = sn->extent_bytes;
    tree->data_end = EXTREE_ROUND_UP(sn->virtual_size, t->block_size);
}

/*
 * Updates need a handle that may change: read-write, not broken, not
 * marked corrupt, free space known.  A handle broken by a lack of space
 * says so (-ENOSPC) until it is rolled back.
 */
static inline int extree_check_writable(const Extree *t)
{
    if (t->read_only) {
        return -EROFS;
    }
    if (t->broken && t->broken_nospace) {
        return -ENOSPC;
    }
    if (t->broken || (t->incompat & EXTREE_INCOMPAT_CORRUPT) ||
        !t->space.alloc_loaded) {
        return -EIO;
    }
    if (t->snap_view >= 0) {
        return -EROFS;
    }
    return 0;
}

/* extree-btree.c: a B+tree of range items over a space map */
void extree_path_release(Extree *t, ExtreePath *p);

/*
 * A probe into a tree that is not being changed (another root than the one
 * a drop or a write works on): a path kept between calls, with the key
 * range of each node on it, so that probes at increasing keys read each
 * node they reach about once.  Zero-initialise; extree_probe_release().
 */
typedef struct ExtreeProbe {
    ExtreeTree *tree;
    ExtreePath p;
    uint64_t lo[EXTREE_MAX_LEVELS], hi[EXTREE_MAX_LEVELS];
    /* the leaf item the last look stopped at, in p.nodes[0] */
    int slot_hint;
} ExtreeProbe;
int extree_bt_probe(Extree *t, ExtreeProbe *pr, uint64_t key,
                    unsigned level, ExtreeNode **out);
void extree_probe_release(Extree *t, ExtreeProbe *pr);
int extree_bt_probe_reaches(Extree *t, ExtreeProbe *pr, ExtreeNode *n,
                            bool *reaches);
/*
 * A drop's guard: the roots that stay.  Before a node is freed, each of
 * them is probed at the node's first key and level; one that reaches it
 * means the node's count was too low (corruption), and the drop fails
 * before it frees anything the others use.  @leaf_fn, if set, is called
 * with each leaf the drop frees before its items are reported (the
 * caller checks what the items refer to).
 */
typedef struct ExtreeDropGuard {
    ExtreeProbe *keep;
    unsigned nkeep;
    int (*leaf_fn)(struct ExtreeDropGuard *guard, ExtreeNode *leaf);
    void *opaque;
} ExtreeDropGuard;
int extree_bt_replace(Extree *t, ExtreeTree *tree, const ExtreeItem *it,
                      uint64_t start, uint64_t len,
                      ExtreeRemovedFn *removed, void *opaque);
int extree_bt_seek(Extree *t, ExtreeTree *tree, uint64_t key,
                   ExtreePath *p);
int extree_bt_leaf_end(Extree *t, ExtreeTree *tree, uint64_t key,
                       uint64_t *end);
int extree_bt_first(Extree *t, ExtreeTree *tree, uint64_t key,
                    ExtreePath *p, ExtreeItem *it);
int extree_bt_next(Extree *t, ExtreeTree *tree, ExtreePath *p,
                   ExtreeItem *it);
int extree_bt_find(Extree *t, ExtreeTree *tree, uint64_t key,
                   ExtreeItem *prev, bool *has_prev,
                   ExtreeItem *next, bool *has_next);
int extree_bt_next_leaf(Extree *t, ExtreeTree *tree, ExtreePath *p);
typedef int ExtreeLeafFn(Extree *t, ExtreeNode *leaf, void *opaque);
int extree_bt_leaves_with_bytes(Extree *t, ExtreeTree *tree,
                                uint64_t min_bytes, uint64_t lo, uint64_t hi,
                                ExtreeLeafFn *fn, void *opaque);
int extree_bt_next_leaf_covered(Extree *t, ExtreeTree *tree, ExtreePath *p,
                                uint64_t *end, uint64_t limit);
void extree_tree_expect(Extree *t, ExtreeTree *tree, ExtreeNodeExpect *e);
int extree_bt_read_all(Extree *t, ExtreeTree *tree, GHashTable *seen);
/* extree-extent.c: before the first update, every tree read */
int extree_probe_end(Extree *t);
int extree_bt_drop(Extree *t, ExtreeTree *tree, ExtreeRemovedFn *removed,
                   void *opaque, ExtreeDropGuard *guard);
int extree_bt_new_root(Extree *t, ExtreeTree *tree);

/* extree-alloc.c: free space in memory, placement, the space map */
void extree_alloc_init(Extree *t);
void extree_alloc_destroy(Extree *t);
int extree_alloc_meta(Extree *t, uint64_t *out);
int extree_alloc_add_free(Extree *t, uint64_t start, uint64_t len);
bool extree_alloc_is_free(Extree *t, uint64_t start, uint64_t len);
void extree_alloc_data_fresh_add(Extree *t, uint64_t start, uint64_t len);
bool extree_alloc_data_is_fresh(Extree *t, uint64_t start, uint64_t len);
void extree_alloc_data_fresh_end(Extree *t);
uint64_t extree_alloc_free_bytes(const Extree *t);
bool extree_alloc_trim_tail(Extree *t);
int extree_alloc_free(Extree *t, uint64_t start, uint64_t len, bool node);
void extree_alloc_commit_done(Extree *t, GArray *freed);
void extree_alloc_deferred(Extree *t, GArray *discard);
uint64_t extree_alloc_take_at(Extree *t, uint64_t hint, uint64_t bytes);
int extree_alloc_claim(Extree *t, uint64_t start, uint64_t len);
bool extree_alloc_take_before(Extree *t, uint64_t end, uint64_t bytes);
int extree_alloc_take_any(Extree *t, uint64_t bytes, uint64_t *host,
                          uint64_t *got);
void extree_alloc_set_loaded(Extree *t, bool loaded);
void extree_alloc_set_partial(Extree *t, uint64_t free_lo, uint64_t free_hi,
                              uint64_t unloaded);
uint64_t extree_alloc_nodes_need(const Extree *t, uint64_t contig);
bool extree_alloc_fits(const Extree *t, uint64_t len);
uint64_t extree_alloc_nodes_estimate(const Extree *t);
void extree_alloc_commit_extra(Extree *t, uint64_t nodes, uint64_t mark_max);
bool extree_alloc_nodes_fit(const Extree *t, uint64_t contig);
uint64_t extree_alloc_nodes_short(const Extree *t, uint64_t contig);
bool extree_alloc_room_short(const Extree *t);
bool extree_alloc_update_fits(const Extree *t, uint64_t extra);
uint64_t extree_alloc_data_allowance(const Extree *t, uint64_t extra);
GArray *extree_alloc_steal_log(Extree *t);
bool extree_alloc_next_free(Extree *t, uint64_t pos, uint64_t end,
                            uint64_t *fs, uint64_t *fe);
void extree_alloc_reset_free(Extree *t, GArray *used);
void extree_ranges_merge(GArray *list);
int extree_alloc_contig(Extree *t, uint64_t bytes, uint64_t *host);
uint64_t extree_alloc_headroom(uint32_t node_size);

/* extree-reftree.c: reference counts in memory */
void extree_refs_init(Extree *t);
void extree_refs_destroy(Extree *t);
int extree_refs_add_loaded(Extree *t, uint64_t start, uint64_t len,
                           uint32_t count);
uint32_t extree_refs_max(Extree *t, uint64_t start, uint64_t len);
bool extree_refs_next(Extree *t, uint64_t pos, uint64_t end,
                      ExtreeRefRange *out);
GArray *extree_refs_steal_log(Extree *t);
int extree_refs_set(Extree *t, uint64_t start, uint64_t len, uint32_t count);
int extree_refs_inc(Extree *t, uint64_t start, uint64_t len);
bool extree_refs_all_shared(Extree *t, uint64_t start, uint64_t len);
int extree_refs_dec(Extree *t, uint64_t start, uint64_t len, bool node);

/* extree-reftree.c: the reference count tree on disk */
int extree_reftree_load(Extree *t);
int extree_reftree_sync(Extree *t);

/* extree-freetree.c: the free-space tree on disk */
int extree_freetree_load(Extree *t, uint64_t expect_bytes, bool whole);
int extree_freetree_load_rest(Extree *t);
int extree_freetree_load_fit(Extree *t, uint64_t len);
int extree_freetree_sync(Extree *t);
int extree_freetree_rebuild(Extree *t, GArray *used);

/*
 * extree-spacemap.c: the space map as one object (ExtreeSpace), its ops
 * (t->sm) and its two-phase commit
 */
void extree_sm_init(Extree *t);
int extree_sm_commit(ExtreeSpace *sp);
void extree_sm_commit_done(ExtreeSpace *sp, GArray *freed);

/* extree-extent.c: guest ranges to host extents */
int extree_extent_update(Extree *t, const ExtreeItem *it, uint64_t guest,
                         uint64_t bytes);
int extree_extent_share(Extree *t, const ExtreeItem *it);
int extree_extent_map_pieces(Extree *t, uint64_t guest, const uint64_t *host,
                             const uint64_t *len, unsigned n);
int extree_extent_node_unshared(Extree *t, ExtreeNode *n);
int extree_extent_release(void *opaque, const ExtreeItem *it);
int extree_probe_same_data(Extree *t, ExtreeProbe *pr, uint64_t guest,
                           uint64_t len, uint64_t host, uint64_t *found,
                           uint64_t *flen);
int extree_probe_leaf_shared(Extree *t, ExtreeProbe *pr,
                             const ExtreeNode *leaf,
                             int (*fn)(void *opaque, uint64_t host,
                                       uint64_t len),
                             void *opaque);

/*
 * Below the transaction layer: the superblock, the snapshot table, the
 * bitmaps' and the mark log's I/O (extree-super-int.h)
 */
#include "extree-super-int.h"

/* extree-txn.c */
uint64_t extree_sb_free_bytes(const Extree *t);
/*
 * extree_rollback() of only the caller's own failed operation, begun
 * with nothing uncommitted: extree_changes_lost() stays as it was
 */
int extree_rollback_own(Extree *t);
/* The value type of the trees of @owner (EXTREE_TREE_*) */
const ExtreeValueType *extree_tree_vt(uint32_t owner);

#endif /* BLOCK_EXTREE_INT_H */
