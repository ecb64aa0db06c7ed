/*
 * extree core: host space allocator
 *
 * In memory, free host space is two sets of ranges (GSequence, O(log n)):
 *   avail    allocatable now;
 *   pending  freed in the running transaction.  Not reusable until the
 *            superblock of that transaction is durable: until then the
 *            previous superblock, which may still reference it, is the one
 *            a crash falls back to (dm persistent-data: "never allocate a
 *            block from the previous transaction").
 * Both are free in the state the next commit writes.  Every change is
 * also appended to an operation log, which commit replays into the
 * free-space tree (extree_alloc_sync).
 *
 * Placement: metadata goes into a metadata chunk (a reserved run of node
 * slots) or the lowest free space; data goes right after its guest
 * neighbour's host extent, so sequential guest writes grow one extent,
 * and never into the metadata chunk.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

typedef struct ExtreeRange {
    uint64_t start, len;
} ExtreeRange;

/* A search key has len 0 and sorts after a range with the same start */
static gint range_cmp(gconstpointer a, gconstpointer b, gpointer opaque)
{
    const ExtreeRange *x = a, *y = b;

    if (x->start != y->start) {
        return x->start < y->start ? -1 : 1;
    }
    if (!x->len) {
        return 1;
    }
    if (!y->len) {
        return -1;
    }
    return 0;
}

/* The range with the greatest start <= @off, or NULL */
static GSequenceIter *rs_floor(GSequence *s, uint64_t off)
{
    ExtreeRange key = { off, 0 };
    GSequenceIter *it = g_sequence_search(s, &key, range_cmp, NULL);

    if (g_sequence_iter_is_begin(it)) {
        return NULL;
    }
    return g_sequence_iter_prev(it);
}

static ExtreeRange *rs_get(GSequenceIter *it)
{
    return g_sequence_get(it);
}

/* Does any range of @s overlap [start, start + len)?  O(log n) */
static bool rs_overlaps(GSequence *s, uint64_t start, uint64_t len)
{
    GSequenceIter *it = rs_floor(s, start + len - 1);
    ExtreeRange *r;

    if (!it) {
        return false;
    }
    r = rs_get(it);
    return r->start + r->len > start;
}

/* Add [start, start + len), merging with neighbours.  The caller checked
 * that it overlaps nothing.  O(log n). */
static void rs_add(GSequence *s, uint64_t start, uint64_t len)
{
    GSequenceIter *it = rs_floor(s, start);
    GSequenceIter *next;
    ExtreeRange *r;

    if (it && rs_get(it)->start + rs_get(it)->len == start) {
        r = rs_get(it);
        r->len += len;
    } else {
        r = g_new(ExtreeRange, 1);
        r->start = start;
        r->len = len;
        it = g_sequence_insert_sorted(s, r, range_cmp, NULL);
    }
    next = g_sequence_iter_next(it);
    if (!g_sequence_iter_is_end(next) &&
        rs_get(next)->start == r->start + r->len) {
        r->len += rs_get(next)->len;
        g_sequence_remove(next);
    }
}

/* Remove [start, start + len), which lies inside one range.  O(log n). */
static void rs_remove(GSequence *s, uint64_t start, uint64_t len)
{
    GSequenceIter *it = rs_floor(s, start);
    ExtreeRange *r = rs_get(it);
    uint64_t end = start + len, rend = r->start + r->len;

    g_assert(r->start <= start && end <= rend);
    if (r->start == start && rend == end) {
        g_sequence_remove(it);
    } else if (r->start == start) {
        r->start = end;
        r->len = rend - end;
    } else {
        r->len = start - r->start;
        if (end < rend) {
            ExtreeRange *tail = g_new(ExtreeRange, 1);
            tail->start = end;
            tail->len = rend - end;
            g_sequence_insert_sorted(s, tail, range_cmp, NULL);
        }
    }
}

void extree_alloc_init(Extree *t)
{
    t->avail = g_sequence_new(g_free);
    t->pending = g_sequence_new(g_free);
    t->oplog = g_array_new(false, false, sizeof(ExtreeAllocOp));
}

void extree_alloc_destroy(Extree *t)
{
    if (t->avail) {
        g_sequence_free(t->avail);
        g_sequence_free(t->pending);
        g_array_free(t->oplog, true);
    }
}

static void log_op(Extree *t, uint64_t start, uint64_t len, bool is_free)
{
    if (t->oplog->len) {
        ExtreeAllocOp *last = &g_array_index(t->oplog, ExtreeAllocOp,
                                             t->oplog->len - 1);
        if (last->is_free == is_free && last->start + last->len == start) {
            last->len += len;
            return;
        }
    }
    g_array_append_val(t->oplog, ((ExtreeAllocOp){ start, len, is_free }));
}

/* Take [start, start + len) out of avail */
static void take(Extree *t, uint64_t start, uint64_t len)
{
    rs_remove(t->avail, start, len);
    t->avail_bytes -= len;
    log_op(t, start, len, false);
}

/* Grow the host file; the new space is used by the caller (nothing to log:
 * the free tree never covered it) */
static int grow(Extree *t, uint64_t len, uint64_t *start)
{
    if (t->host_end > (uint64_t)INT64_MAX - len) {
        return -ENOSPC;
    }
    *start = t->host_end;
    t->host_end += len;
    t->super_dirty = true;
    return 0;
}

/* Bytes of [start, start + len) that avoid the metadata chunk, from start */
static uint64_t outside_meta(Extree *t, uint64_t start, uint64_t len)
{
    if (start >= t->meta_end || start + len <= t->meta_start) {
        return len;
    }
    return start < t->meta_start ? t->meta_start - start : 0;
}

/* A node-sized piece of avail inside [lo, hi), lowest first; scans at most
 * 64 ranges */
static bool find_node_slot(Extree *t, uint64_t lo, uint64_t hi,
                           uint64_t *out)
{
    GSequenceIter *it = rs_floor(t->avail, lo);
    int n = 0;

    if (!it) {
        it = g_sequence_get_begin_iter(t->avail);
    }
    for (; !g_sequence_iter_is_end(it) && n < 64;
         it = g_sequence_iter_next(it), n++) {
        ExtreeRange *r = rs_get(it);
        uint64_t s = MAX(r->start, lo), e = MIN(r->start + r->len, hi);
        if (r->start >= hi) {
            break;
        }
        if (e > s && e - s >= t->node_size) {
            *out = s;
            return true;
        }
    }
    return false;
}

/* Reserve a new metadata chunk at the end of the file: its first node is
 * returned, the rest becomes free space.  Chunks grow with the file so a
 * sequential data stream is interrupted O(log size) times. */
static int new_meta_chunk(Extree *t, uint64_t *node)
{
    uint64_t size = MAX(32 * (uint64_t)t->node_size,
                        EXTREE_ROUND_UP(t->host_end / 32, t->node_size));
    uint64_t start;
    int ret;

    size = MIN(size, MAX(64 * 1024 * 1024, 32 * (uint64_t)t->node_size));
    ret = grow(t, size, &start);
    if (ret < 0) {
        return ret;
    }
    t->meta_start = start;
    t->meta_end = start + size;
    if (node) {
        *node = start;
        start += t->node_size;
        size -= t->node_size;
    }
    if (size) {
        rs_add(t->avail, start, size);
        t->avail_bytes += size;
        log_op(t, start, size, true);
    }
    return 0;
}

static bool meta_chunk_has_room(Extree *t)
{
    uint64_t dummy;
    return t->meta_end > t->meta_start &&
           find_node_slot(t, t->meta_start, t->meta_end, &dummy);
}

/* One node of host space: the metadata chunk, else the lowest free space,
 * else a new chunk.  O(log n). */
int extree_alloc_meta(Extree *t, uint64_t *out)
{
    uint64_t s;

    if ((t->meta_end > t->meta_start &&
         find_node_slot(t, t->meta_start, t->meta_end, &s)) ||
        find_node_slot(t, 0, UINT64_MAX, &s)) {
        take(t, s, t->node_size);
        *out = s;
        return 0;
    }
    return new_meta_chunk(t, out);
}

bool extree_alloc_is_free(Extree *t, uint64_t start, uint64_t len)
{
    return rs_overlaps(t->avail, start, len) ||
           rs_overlaps(t->pending, start, len);
}

/*
 * Free [start, start + len): pending until the next commit is durable.
 * Freeing space that is already free means two owners claimed it: a
 * corrupt image (or a caller bug) - refuse instead of double-counting.
 */
int extree_free_space(Extree *t, uint64_t start, uint64_t len)
{
    if (!len) {
        return 0;
    }
    if (start < t->data_start || start >= t->host_end ||
        len > t->host_end - start || extree_alloc_is_free(t, start, len)) {
        return extree_corrupt(t, start, "corrupt extent tree: host range at "
                              "offset 0x%" PRIx64 " length 0x%" PRIx64
                              " freed twice or outside the data area",
                              start, len);
    }
    rs_add(t->pending, start, len);
    t->pending_bytes += len;
    log_op(t, start, len, true);
    return 0;
}

/* Leak repair: space owned by nobody becomes allocatable at once */
int extree_alloc_add_avail(Extree *t, uint64_t start, uint64_t len)
{
    if (extree_alloc_is_free(t, start, len)) {
        return -EINVAL;
    }
    rs_add(t->avail, start, len);
    t->avail_bytes += len;
    log_op(t, start, len, true);
    return 0;
}

int extree_free_data(Extree *t, uint64_t host, uint64_t bytes)
{
    if (t->read_only) {
        return -EROFS;
    }
    if (t->broken) {
        return -EIO;
    }
    if (!bytes || !EXTREE_IS_ALIGNED(host | bytes, t->block_size) ||
        host < t->data_start || host >= t->host_end ||
        bytes > t->host_end - host || extree_alloc_is_free(t, host, bytes)) {
        return -EINVAL;
    }
    return extree_free_space(t, host, bytes);
}

/* Take up to @bytes at @hint if it is allocatable; returns bytes taken */
static uint64_t take_at(Extree *t, uint64_t hint, uint64_t bytes)
{
    GSequenceIter *it;
    ExtreeRange *r;
    uint64_t got;

    if (hint == t->host_end) {
        /* Right at the end: grow the extent */
        return grow(t, bytes, &hint) < 0 ? 0 : bytes;
    }
    it = rs_floor(t->avail, hint);
    if (!it) {
        return 0;
    }
    r = rs_get(it);
    if (r->start + r->len <= hint) {
        return 0;
    }
    got = outside_meta(t, hint, MIN(bytes, r->start + r->len - hint));
    if (got) {
        take(t, hint, got);
    }
    return got;
}

/*
 * Host space for guest [guest, guest + bytes): after the guest neighbour's
 * extent, else before the following one, else first fit (at most 64 ranges
 * looked at), else the end of the file.  O(log n).
 */
int extree_alloc_data(Extree *t, uint64_t guest, uint64_t bytes,
                      uint64_t *host, uint64_t *got)
{
    ExtreeTree *tree = &t->trees[EXT_TREE_EXTENT];
    uint64_t vend = EXTREE_ROUND_UP(t->virtual_size, t->block_size);
    ExtreeItem prev, next;
    bool hp, hn;
    GSequenceIter *it;
    int n, ret;

    if (t->read_only) {
        return -EROFS;
    }
    if (t->broken) {
        return -EIO;
    }
    if (!bytes || !EXTREE_IS_ALIGNED(guest | bytes, t->block_size) ||
        guest >= vend || bytes > vend - guest) {
        return -EINVAL;
    }
    ret = extree_bt_find(t, tree, guest, &prev, &hp, &next, &hn);
    if (ret < 0) {
        return ret;
    }
    if (hp && prev.type == EXTREE_ITEM_DATA &&
        prev.key + prev.length == guest) {
        *got = take_at(t, prev.host + prev.length, bytes);
        if (*got) {
            *host = prev.host + prev.length;
            return 0;
        }
    }
    if (hn && next.type == EXTREE_ITEM_DATA && next.key == guest + bytes &&
        next.host >= t->data_start + bytes) {
        uint64_t h = next.host - bytes;
        it = rs_floor(t->avail, h);
        if (it && rs_get(it)->start + rs_get(it)->len >= next.host &&
            outside_meta(t, h, bytes) == bytes) {
            take(t, h, bytes);
            *host = h;
            *got = bytes;
            return 0;
        }
    }
    for (it = g_sequence_get_begin_iter(t->avail), n = 0;
         !g_sequence_iter_is_end(it) && n < 64;
         it = g_sequence_iter_next(it), n++) {
        ExtreeRange *r = rs_get(it);
        uint64_t s = r->start, e = r->start + r->len;
        /* the part before or after the metadata chunk */
        if (s < t->meta_end && e > t->meta_start) {
            if (s >= t->meta_start) {
                s = t->meta_end;
            } else {
                e = t->meta_start;
            }
        }
        if (e > s && e - s >= bytes) {
            take(t, s, bytes);
            *host = s;
            *got = bytes;
            return 0;
        }
    }
    /* Grow the file; reserve metadata room first so that the nodes this
     * write needs do not land right behind it */
    if (!meta_chunk_has_room(t)) {
        ret = new_meta_chunk(t, NULL);
        if (ret < 0) {
            return ret;
        }
    }
    ret = grow(t, bytes, host);
    if (ret < 0) {
        return ret;
    }
    *got = bytes;
    return 0;
}

/*
 * Commit step 2: replay the allocations and frees of this transaction into
 * the free-space tree.  That CoWs free-tree nodes, which allocates and
 * frees more space, which is logged again: loop until nothing is left
 * (each round touches only nodes not yet copied, so a few rounds do).
 * O(operations logged * log n).
 */
int extree_alloc_sync(Extree *t)
{
    ExtreeTree *ft = &t->trees[EXT_TREE_FREE];

    for (int round = 0; round < 32; round++) {
        GArray *ops = t->oplog;
        int ret = 0;

        if (!ops->len) {
            if (ft->total != t->avail_bytes + t->pending_bytes) {
                return extree_corrupt(t, 0, "corrupt free tree: free space "
                                      "accounting mismatch, have %" PRIu64
                                      " expect %" PRIu64, ft->total,
                                      t->avail_bytes + t->pending_bytes);
            }
            return 0;
        }
        t->oplog = g_array_new(false, false, sizeof(ExtreeAllocOp));
        for (guint i = 0; i < ops->len && ret == 0; i++) {
            ExtreeAllocOp *op = &g_array_index(ops, ExtreeAllocOp, i);
            ExtreeItem it = {
                .key = op->start, .length = op->len, .host = op->start,
                .type = op->is_free ? EXTREE_ITEM_FREE : 0,
            };
            ret = extree_bt_replace(t, ft, &it, op->start, op->len);
        }
        g_array_free(ops, true);
        if (ret < 0) {
            return ret;
        }
    }
    return extree_corrupt(t, 0, "corrupt free tree: sync did not converge "
                          "after 32 rounds");
}

/* Commit step 7: the superblock is durable, pending frees are reusable */
void extree_alloc_commit_done(Extree *t)
{
    GSequenceIter *it = g_sequence_get_begin_iter(t->pending);

    for (; !g_sequence_iter_is_end(it); it = g_sequence_iter_next(it)) {
        ExtreeRange *r = rs_get(it);
        rs_add(t->avail, r->start, r->len);
    }
    t->avail_bytes += t->pending_bytes;
    t->pending_bytes = 0;
    g_sequence_remove_range(g_sequence_get_begin_iter(t->pending),
                            g_sequence_get_end_iter(t->pending));
}

/*
 * Open: the free-space tree becomes the avail set.  O(free items); the
 * extent tree is not read.  Node validation already guarantees sorted,
 * non-overlapping ranges inside the data area.
 */
int extree_alloc_load(Extree *t, uint64_t expect_bytes)
{
    ExtreeTree *ft = &t->trees[EXT_TREE_FREE];
    ExtreePath p = { { 0 } };
    ExtreeItem it;
    uint64_t count = 0, total = 0;
    int ret;

    for (ret = extree_bt_first(t, ft, 0, &p, &it); ret == 0;
         ret = extree_bt_next(t, ft, &p, &it)) {
        rs_add(t->avail, it.key, it.length);
        count++;
        total += it.length;
    }
    extree_path_release(t, &p);
    if (ret < 0) {
        return ret;
    }
    if (total != expect_bytes) {
        return extree_corrupt(t, 0, "corrupt superblock at offset 0x0: "
                              "free_bytes mismatch, have %" PRIu64
                              " expect %" PRIu64 " (free tree)",
                              expect_bytes, total);
    }
    t->avail_bytes = total;
    ft->nitems = count;
    ft->total = total;
    return 0;
}
