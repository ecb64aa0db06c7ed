/*
 * extree core: host space allocator
 *
 * In memory, free host space is kept in four disjoint parts:
 *   avail    allocatable now;
 *   nfree    allocatable now, freed node space: nodes look here first and
 *            data last, so that metadata recycles its own space (a hot,
 *            already allocated region of the host file, and consecutive
 *            nodes for few, large writes) instead of scattering data into
 *            node holes and moving the nodes to new space every commit
 *            (at open, the free tree's short ranges come here too);
 *   pending  freed in the running transaction.  Not reusable until the
 *            superblock of that transaction is durable: until then the
 *            previous superblock, which may still reference it, is the one
 *            a crash falls back to (dm persistent-data: "never allocate a
 *            block from the previous transaction").  Node space that the
 *            running transaction allocated itself (fresh) is the
 *            exception: no superblock references it, so when it is freed
 *            it goes straight back to nfree;
 *   reserve  the metadata chunk: one run of free space handed out to nodes
 *            front to back, so that the nodes of a commit are mostly
 *            consecutive (few large writes) and do not land in the middle
 *            of data that grows at the end of the file.
 * All four are free in the state the next commit writes.  Every change is
 * also logged as a host range; commit rewrites the logged ranges of the
 * free-space tree from the four sets (extree_freetree_sync()).  After a
 * partial load (t->space.alloc_partial, extree-freetree.c) the sets hold only
 * part of the free space, and the rest is counted in t->space.unloaded_bytes.
 *
 * avail, nfree and pending are range sets: treaps keyed by start whose
 * nodes also
 * know the longest range of their subtree, so that "the lowest range of at
 * least n bytes" (first fit) and "the longest range" cost O(log n), however
 * fragmented the free space is.
 *
 * Placement:
 *   data      right after the guest neighbour's extent (or right before
 *             the following one), so that sequential guest writes grow one
 *             extent; else the lowest range of avail that fits (first fit
 *             keeps the file compact and the free space at its end, where
 *             commit can cut it off); else, if free space is plentiful, the
 *             lowest range of nfree that fits, else the longest free range
 *             (a partial allocation: the caller loops); the file grows only
 *             when free space is scarce, which bounds host_end to about 4/3
 *             of the space in use plus one transaction's frees;
 *   metadata  the reserve; else a new reserve from the lowest run of
 *             EXT_RESERVE_NFREE_MIN nodes in nfree, or from the lowest
 *             free range of EXT_RESERVE_MIN nodes; else any free
 *             node-sized range (nfree first); else a new reserve at the
 *             end of the file.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

/*
 * A new reserve needs at least this many nodes of contiguous free space,
 * or this many of contiguous freed node space
 */
#define EXT_RESERVE_MIN         32
#define EXT_RESERVE_NFREE_MIN   4
/* The largest reserve grown at the end of the file */
#define EXT_RESERVE_MAX         (64 * 1024 * 1024)
/*
 * Data grows the file only when less than 1/EXT_SCARCE_DIV of the data
 * area is allocatable
 */
#define EXT_SCARCE_DIV          4
/*
 * On a backend of fixed size (host_limit), data leaves this much room for
 * the nodes its own mapping and the commits after it need: a full device
 * fails the guest's write with -ENOSPC, not a tree update half-way
 */
#define EXT_META_HEADROOM_NODES 64
/*
 * ... of which a tree update needs this much to begin (the guard,
 * extree_alloc_update_fits()): one piece's copies, splits and merges and
 * the commit of what it logs.  The difference keeps the mapping of data
 * just placed from being refused, and lets discards run on a device that
 * data has filled and whose commits used some of the headroom.
 */
#define EXT_UPDATE_HEADROOM_NODES 32
/* Commit cuts free space at the end of the file from this size on */
#define EXT_SHRINK_MIN          (1024 * 1024)

/* ---- the allocator ---- */

void extree_alloc_init(Extree *t)
{
    t->space.avail.unit = t->space.nfree.unit = t->node_size;
    t->space.oplog = g_array_new(false, false, sizeof(ExtreeAllocOp));
    t->space.freed_data = g_array_new(false, false, sizeof(ExtreeAllocOp));
    t->space.freed_nodes = g_array_new(false, false, sizeof(ExtreeAllocOp));
    t->space.discard_later = g_array_new(false, false, sizeof(ExtreeAllocOp));
}

void extree_alloc_destroy(Extree *t)
{
    extree_rs_clear(&t->space.avail);
    extree_rs_clear(&t->space.nfree);
    extree_rs_clear(&t->space.pending);
    extree_rs_clear(&t->space.touched);
    extree_rs_clear(&t->space.fresh);
    extree_rs_clear(&t->space.fresh_data);
    extree_rs_clear(&t->space.rest_avail);
    extree_rs_clear(&t->space.rest_nfree);
    if (t->space.oplog) {
        g_array_free(t->space.oplog, true);
        g_array_free(t->space.freed_data, true);
        g_array_free(t->space.freed_nodes, true);
        g_array_free(t->space.discard_later, true);
        t->space.oplog = NULL;
    }
}

static uint64_t resv_bytes(const Extree *t)
{
    return t->space.resv_end - t->space.resv_start;
}

uint64_t extree_alloc_free_bytes(const Extree *t)
{
    const ExtreeSpace *sp = &t->space;

    return sp->avail.bytes + sp->nfree.bytes + sp->pending.bytes +
           resv_bytes(t) + sp->unloaded_bytes;
}

static void log_op(Extree *t, uint64_t start, uint64_t len, bool is_free)
{
    ExtreeSpace *sp = &t->space;

    if (sp->alloc_partial && start < sp->free_hi && start + len > sp->free_lo) {
        uint64_t s = MAX(start, sp->free_lo);

        extree_rs_union(&sp->touched, s, MIN(start + len, sp->free_hi) - s);
    }
    if (t->space.oplog->len) {
        ExtreeAllocOp *last = &g_array_index(t->space.oplog, ExtreeAllocOp,
                                             t->space.oplog->len - 1);
        if (last->is_free == is_free && last->start + last->len == start) {
            last->len += len;
            return;
        }
    }
    g_array_append_val(t->space.oplog,
                       ((ExtreeAllocOp){ start, len, is_free }));
}

/* Take [start, start + len) out of @set (avail or nfree) */
static void take(Extree *t, ExtreeRangeSet *set, uint64_t start,
                 uint64_t len)
{
    extree_rs_remove(set, start, len);
    log_op(t, start, len, false);
}

/*
 * How far host_end may grow: to the backend's limit, if it has one, less
 * the metadata headroom for @data
 */
static uint64_t grow_room(const Extree *t, bool data)
{
    uint64_t limit = t->space.host_limit ?
                     MIN(t->space.host_limit, (uint64_t)INT64_MAX) :
                     (uint64_t)INT64_MAX;
    uint64_t room = limit > t->host_end ? limit - t->host_end : 0;

    if (data && t->space.host_limit) {
        uint64_t head = (uint64_t)EXT_META_HEADROOM_NODES * t->node_size;
        room = room > head ? room - head : 0;
    }
    return room / t->block_size * t->block_size;
}

/*
 * What a writer holds back from data besides the nodes it writes: on a
 * backend of fixed size the metadata headroom, and a metadata reserve of
 * the least size (qemu-img measure)
 */
uint64_t extree_alloc_headroom(uint32_t node_size)
{
    return (uint64_t)(EXT_META_HEADROOM_NODES + EXT_RESERVE_MIN) * node_size;
}

/* The size of a new reserve at the end of the file (reserve_refill()) */
static uint64_t reserve_grow_size(const Extree *t)
{
    uint64_t ns = t->node_size;
    uint64_t want = MAX(EXT_RESERVE_MIN * ns,
                        EXTREE_ROUND_UP(t->host_end / 32, ns));

    return MIN(want, MAX(EXT_RESERVE_MAX, EXT_RESERVE_MIN * ns));
}

/*
 * The free range an update that allocates only nodes and @contig bytes in
 * one run needs so that host_end stays: nodes and a contiguous run come
 * from free space while any fits (extree_alloc_meta(),
 * extree_alloc_contig()), so one range of the run and a reserve's worth
 * of nodes does (extree_grow_bound_nodes())
 */
uint64_t extree_alloc_nodes_need(const Extree *t, uint64_t contig)
{
    return contig + reserve_grow_size(t);
}

/*
 * The nodes an update that allocates no data may take, with the commit
 * after it: the headroom a backend of fixed size keeps for an update's
 * nodes and commits, per range logged so far a copy of a path through
 * the free or reference count tree and a split, which is what the
 * commit's syncs write for it, and the new places of the bitmap chunks
 * this transaction changed and of the bitmap directory
 */
static uint64_t nodes_per_logged(const Extree *t)
{
    return 2 * (MAX(t->trees[EXTREE_TREE_FREE].level,
                    t->trees[EXTREE_TREE_REFS].level) + 2);
}

uint64_t extree_alloc_nodes_estimate(const Extree *t)
{
    uint64_t logged = t->space.oplog->len +
                      (t->space.reflog ? t->space.reflog->len : 0);

    return EXT_META_HEADROOM_NODES + logged * nodes_per_logged(t) +
           t->space.commit_extra;
}

/*
 * What the next commit takes besides the trees' nodes, in nodes, as its
 * caller counts it (the bitmaps' new chunks and directory): part of the
 * estimate from now on; and what one update may add to it at most
 * (@mark_max), part of the grow bounds.  O(1).
 */
void extree_alloc_commit_extra(Extree *t, uint64_t nodes, uint64_t mark_max)
{
    t->space.commit_extra = nodes;
    t->space.mark_max = mark_max;
}

/*
 * The room for nodes in the known free space with host_end where it is:
 * nodes come from any free node-sized range before the file grows
 * (extree_alloc_meta()), so what counts is the nodes all of them hold
 * (the sets count them, ExtreeRangeSet.units), not one long range.  (A
 * lower bound that took a node's length less a block off each range
 * counted 1 MiB free in 4 KiB holes as 72 nodes, and refused data on a
 * device a quarter empty.)  O(1).
 */
static uint64_t node_room(const Extree *t)
{
    return resv_bytes(t) +
           (t->space.avail.units + t->space.nfree.units) * t->node_size;
}

/*
 * Bytes of growth the nodes of an update, its bitmap chunks at most
 * (mark_max) and the commit after it (extree_alloc_nodes_estimate()) and
 * @contig bytes in one run may need beyond the known free space
 */
uint64_t extree_alloc_nodes_short(const Extree *t, uint64_t contig)
{
    uint64_t ns = t->node_size;
    uint64_t want = (extree_alloc_nodes_estimate(t) + t->space.mark_max +
                     (contig + ns - 1) / ns + 1) * ns;

    return want > node_room(t) ? want - node_room(t) : 0;
}

/*
 * The data, a new reserve, and what the nodes may need beyond the known
 * free space, bitmap chunks included: a device whose end is not known
 * yet (after a reopen) must be found out before the update, whose guard
 * then counts them, not by its commit (which ran out so, issue 49 B)
 */
uint64_t extree_grow_bound(const Extree *t, uint64_t bytes)
{
    return t->host_end + bytes + reserve_grow_size(t) +
           extree_alloc_nodes_short(t, 0);
}

/*
 * Can the known free space take those nodes and @contig bytes in one run
 * with host_end where it is?  O(1).
 */
bool extree_alloc_nodes_fit(const Extree *t, uint64_t contig)
{
    if (contig && !extree_alloc_fits(t, contig)) {
        return false;
    }
    return !extree_alloc_nodes_short(t, contig);
}

/* Do the sets hold a free range of @len bytes or more? */
bool extree_alloc_fits(const Extree *t, uint64_t len)
{
    return MAX(extree_rs_longest(&t->space.avail),
               extree_rs_longest(&t->space.nfree)) >= len;
}

/*
 * Grow the host file; the new space is used by the caller (nothing to log:
 * the free tree never covered it)
 */
static int grow(Extree *t, uint64_t len, uint64_t *start)
{
    if (len > grow_room(t, false)) {
        return -ENOSPC;
    }
    *start = t->host_end;
    t->host_end += len;
    t->super_dirty = true;
    return 0;
}

/*
 * Hand the rest of the reserve back to where it came from (it stays
 * free)
 */
static void reserve_release(Extree *t)
{
    if (resv_bytes(t)) {
        extree_rs_add(t->space.resv_nfree ? &t->space.nfree : &t->space.avail,
                      t->space.resv_start, resv_bytes(t));
    }
    t->space.resv_start = t->space.resv_end = 0;
}

/*
 * A new reserve: the lowest run of EXT_RESERVE_NFREE_MIN freed nodes or
 * more (old metadata space, recycled in order, so that the nodes of a
 * commit stay consecutive), else the lowest free range of EXT_RESERVE_MIN
 * nodes or more (moving free space to the reserve changes nothing on
 * disk), else, with @may_grow, new space at the end of the file.  Reserves
 * grow with the file, so a sequential data stream is interrupted
 * O(log size) times; at most one exists, so they cannot make the file grow
 * without bound.  -ENOSPC when nothing was found and growing is not
 * allowed.
 */
static int reserve_refill(Extree *t, bool may_grow)
{
    uint64_t ns = t->node_size;
    uint64_t want = reserve_grow_size(t);
    ExtreeRangeSet *set = &t->space.nfree;
    ExtreeRange *r;
    uint64_t start;
    int ret;

    reserve_release(t);
    r = extree_rs_first_fit(set, EXT_RESERVE_NFREE_MIN * ns);
    if (!r) {
        set = &t->space.avail;
        r = extree_rs_first_fit(set, EXT_RESERVE_MIN * ns);
    }
    if (r) {
        uint64_t len = MIN(want, r->len / ns * ns);
        start = r->start;
        extree_rs_remove(set, start, len);
        t->space.resv_start = start;
        t->space.resv_end = start + len;
        t->space.resv_nfree = set == &t->space.nfree;
        return 0;
    }
    /*
     * A backend of fixed size: what is left of it, at least one node (a
     * refill from free space above is not capped: it grows nothing)
     */
    want = MIN(want, grow_room(t, false) / ns * ns);
    if (!may_grow || want < ns) {
        return -ENOSPC;
    }
    ret = grow(t, want, &start);
    if (ret < 0) {
        return ret;
    }
    /* new free space: the free tree must learn about it */
    log_op(t, start, want, true);
    t->space.resv_start = start;
    t->space.resv_end = start + want;
    t->space.resv_nfree = false;
    return 0;
}

/*
 * One node of host space: the reserve, a new reserve from freed node
 * space or free space, any free node-sized range (freed node space
 * first), a new reserve at the end.  O(log n).
 */
int extree_alloc_meta(Extree *t, uint64_t *out)
{
    ExtreeRange *r;
    int ret;

    if (!t->space.alloc_loaded) {
        return -EIO;
    }
    if (resv_bytes(t) < t->node_size && reserve_refill(t, false) < 0) {
        ExtreeRangeSet *set = &t->space.nfree;
        r = extree_rs_first_fit(set, t->node_size);
        if (!r) {
            set = &t->space.avail;
            r = extree_rs_first_fit(set, t->node_size);
        }
        if (r) {
            *out = r->start;
            take(t, set, r->start, t->node_size);
            extree_rs_add(&t->space.fresh, *out, t->node_size);
            return 0;
        }
        ret = reserve_refill(t, true);
        if (ret < 0) {
            return ret;
        }
    }
    *out = t->space.resv_start;
    t->space.resv_start += t->node_size;
    log_op(t, *out, t->node_size, false);
    extree_rs_add(&t->space.fresh, *out, t->node_size);
    return 0;
}

/* Was [start, start + len) allocated as node space in this transaction? */
static bool rs_covers(ExtreeRangeSet *set, uint64_t start, uint64_t len)
{
    ExtreeRange *r = extree_rs_floor(set, start);

    return r && r->start + r->len >= start + len;
}

static bool is_fresh(Extree *t, uint64_t start, uint64_t len)
{
    return rs_covers(&t->space.fresh, start, len);
}

void extree_alloc_data_fresh_add(Extree *t, uint64_t start, uint64_t len)
{
    /* never twice: freed data stays pending until the commit */
    if (!extree_rs_overlaps(&t->space.fresh_data, start, len)) {
        extree_rs_add(&t->space.fresh_data, start, len);
    }
}

bool extree_alloc_data_is_fresh(Extree *t, uint64_t start, uint64_t len)
{
    return rs_covers(&t->space.fresh_data, start, len);
}

/* A commit begins: what it writes may map the fresh data */
void extree_alloc_data_fresh_end(Extree *t)
{
    extree_rs_clear(&t->space.fresh_data);
}

bool extree_alloc_is_free(Extree *t, uint64_t start, uint64_t len)
{
    return extree_rs_overlaps(&t->space.avail, start, len) ||
           extree_rs_overlaps(&t->space.nfree, start, len) ||
           extree_rs_overlaps(&t->space.pending, start, len) ||
           (start < t->space.resv_end && t->space.resv_start < start + len);
}

/* Remember a freed range for discard; adjacent frees merge */
static void note_freed(GArray *list, uint64_t start, uint64_t len)
{
    if (list->len) {
        ExtreeAllocOp *last = &g_array_index(list, ExtreeAllocOp,
                                             list->len - 1);
        if (last->start + last->len == start) {
            last->len += len;
            return;
        }
    }
    g_array_append_val(list, ((ExtreeAllocOp){ start, len, true }));
}

/*
 * Free [start, start + len): pending until the next commit is durable.
 * Freeing space that is already free means two owners claimed it: a
 * corrupt image (or a caller bug) - refuse instead of double-counting.
 */
int extree_alloc_free(Extree *t, uint64_t start, uint64_t len, bool node)
{
    if (!len) {
        return 0;
    }
    if (start < t->data_start || start >= t->host_end ||
        len > t->host_end - start || extree_alloc_is_free(t, start, len)) {
        return extree_corrupt(t, start, "corrupt %s: host range at "
                              "offset 0x%" PRIx64 " length 0x%" PRIx64
                              " freed twice or outside the data area",
                              node ? "tree" : "extent tree", start, len);
    }
    if (node && is_fresh(t, start, len)) {
        /*
         * A node of this transaction (a copy emptied by a punch, a split
         * merged back): nothing durable uses it and it was never written
         * where a committed state could see it, so it is reusable at
         * once, as btrfs_free_tree_block() does with a block of the
         * running transaction
         */
        extree_rs_remove(&t->space.fresh, start, len);
        extree_rs_add(&t->space.nfree, start, len);
        log_op(t, start, len, true);
        return 0;
    }
    extree_rs_add(&t->space.pending, start, len);
    log_op(t, start, len, true);
    note_freed(node ? t->space.freed_nodes : t->space.freed_data, start, len);
    extree_trace(t, EXTREE_TRACE_FREE, start, len, node);
    return 0;
}

/*
 * Leak repair and free-tree rebuild: space owned by nobody becomes free in
 * the next commit (and allocatable after it, like any freed space)
 */
int extree_alloc_add_free(Extree *t, uint64_t start, uint64_t len)
{
    if (!len || start < t->data_start || start >= t->host_end ||
        len > t->host_end - start || extree_alloc_is_free(t, start, len)) {
        return -EINVAL;
    }
    extree_rs_add(&t->space.pending, start, len);
    log_op(t, start, len, true);
    note_freed(t->space.freed_data, start, len);
    return 0;
}

/* The range of avail or nfree that contains @off, and its set */
static ExtreeRange *free_at(Extree *t, uint64_t off, ExtreeRangeSet **set)
{
    ExtreeRangeSet *sets[2] = { &t->space.avail, &t->space.nfree };

    for (int i = 0; i < 2; i++) {
        ExtreeRange *r = extree_rs_floor(sets[i], off);
        if (r && r->start + r->len > off) {
            *set = sets[i];
            return r;
        }
    }
    return NULL;
}

/* Take up to @bytes at @hint if it is allocatable; returns bytes taken */
uint64_t extree_alloc_take_at(Extree *t, uint64_t hint, uint64_t bytes)
{
    ExtreeRangeSet *set;
    ExtreeRange *r;
    uint64_t got;

    if (hint == t->host_end) {
        /* Right at the end: grow the extent, as far as the backend allows */
        got = MIN(bytes, grow_room(t, true));
        return got && grow(t, got, &hint) == 0 ? got : 0;
    }
    r = free_at(t, hint, &set);
    if (!r) {
        return 0;
    }
    got = MIN(bytes, r->start + r->len - hint);
    take(t, set, hint, got);
    return got;
}

/*
 * A map record's replay (spec: Mark log, map records): [@start, + @len)
 * becomes used as it was when the logged write allocated it, from the
 * free space of the loaded state or past host_end (the file grew after
 * the commit; the space between becomes free).  -EEXIST: part of it is in
 * use or lies before the data area (the record lies).  O(log n) a range.
 */
int extree_alloc_claim(Extree *t, uint64_t start, uint64_t len)
{
    uint64_t end = start + len, lim, pos, at;

    if (!len || start < t->data_start || end < start) {
        return -EEXIST;
    }
    /* the caller loaded all free space (extree_freetree_load_rest()) */
    if (t->space.alloc_partial) {
        return -EINVAL;
    }
    lim = MIN(end, t->host_end);
    if (end > t->host_end) {
        uint64_t from = MAX(start, t->host_end);

        if (start > t->host_end) {
            uint64_t gap = start - t->host_end;

            if (grow(t, gap, &at) < 0) {
                return -ENOSPC;
            }
            extree_rs_add(&t->space.avail, at, gap);
            log_op(t, at, gap, true);
        }
        if (grow(t, end - from, &at) < 0) {
            return -ENOSPC;
        }
    }
    for (pos = start; pos < lim; ) {
        ExtreeRangeSet *set;
        ExtreeRange *r = free_at(t, pos, &set);
        uint64_t got;

        if (!r) {
            return -EEXIST;
        }
        got = MIN(lim, r->start + r->len) - pos;
        take(t, set, pos, got);
        pos += got;
    }
    return 0;
}

/*
 * Take the @bytes that end at @end if they are allocatable (data placed
 * right before its guest successor's extent)
 */
bool extree_alloc_take_before(Extree *t, uint64_t end, uint64_t bytes)
{
    ExtreeRangeSet *set;
    ExtreeRange *r = free_at(t, end - bytes, &set);

    if (r && r->start + r->len >= end) {
        take(t, set, end - bytes, bytes);
        return true;
    }
    return false;
}

/*
 * A backend of fixed size whose room for nodes (the known free space and
 * what is left up to its end) no longer holds the nodes the running
 * transaction's commit may need and those of another update
 * (extree_alloc_nodes_estimate()): space this transaction freed is
 * reusable only after a commit, so the caller should commit now rather
 * than run out half-way through an update or a commit.  O(1).
 */
bool extree_alloc_room_short(const Extree *t)
{
    uint64_t logged = t->space.oplog->len +
                      (t->space.reflog ? t->space.reflog->len : 0);

    if (!t->space.host_limit || !t->space.alloc_loaded || !logged) {
        return false;
    }
    return (node_room(t) + grow_room(t, false)) / t->node_size <
           extree_alloc_nodes_estimate(t) + EXT_META_HEADROOM_NODES;
}

/*
 * The guard of a backend of fixed size (issue 33): may a tree update, or
 * the next piece of one, begin?  Only while the room for nodes (the known
 * free space and what is left up to the device's end) holds
 * extree_alloc_nodes_estimate() with EXT_UPDATE_HEADROOM_NODES for its
 * headroom, which takes the nodes one piece (the items of one leaf)
 * copies, splits and merges and the commit of what it logs; the rest of
 * the estimate is the nodes the commit after it needs for what the
 * transaction logged before.  @extra is what the update adds to the
 * commit besides what it logs, in nodes: the bitmap chunks it changes
 * (extree_bitmaps_mark_space()), which may be one per enabled bitmap,
 * more than that headroom.  An update that would start without that room
 * fails with -ENOSPC before it changes anything, and one cut into pieces
 * (extree_extent_update()) stops between two: either way the handle can
 * commit what it has, and the commit makes the space the transaction
 * freed reusable.  Always true on a backend that grows.  O(1).
 */
bool extree_alloc_update_fits(const Extree *t, uint64_t extra)
{
    if (!t->space.host_limit || !t->space.alloc_loaded) {
        return true;
    }
    return (node_room(t) + grow_room(t, false)) / t->node_size >=
           extree_alloc_nodes_estimate(t) - EXT_META_HEADROOM_NODES +
           EXT_UPDATE_HEADROOM_NODES + extra;
}

/*
 * On a backend of fixed size, the most data may take now: what leaves
 * extree_alloc_update_fits(@extra) true after the take, which logs a
 * range and may split a free range (a node's room lost); UINT64_MAX on a
 * backend that grows.  So the mapping of data placed always finds the room the
 * guard asks for, unless other updates came in between.  O(1).
 */
uint64_t extree_alloc_data_allowance(const Extree *t, uint64_t extra)
{
    uint64_t ns = t->node_size, room, need;

    if (!t->space.host_limit || !t->space.alloc_loaded) {
        return UINT64_MAX;
    }
    room = node_room(t) + grow_room(t, false);
    need = (extree_alloc_nodes_estimate(t) + nodes_per_logged(t) + 1 +
            extra) * ns;
    return room > need ? (room - need) / t->block_size * t->block_size : 0;
}

/*
 * A backend of fixed size that cannot grow by @bytes of data: may data
 * take them from free space?  Only while the nodes of the update and of
 * the commits after it still fit in what is left there and at the
 * device's end (extree_alloc_nodes_estimate(): data that ate the
 * nodes' room would fail the commit half-way).  O(1).
 */
static bool fixed_leaves_room(const Extree *t, uint64_t bytes)
{
    uint64_t ns = t->node_size;
    uint64_t room;

    if (!t->space.host_limit || grow_room(t, true) >= bytes) {
        return false;
    }
    room = node_room(t) + grow_room(t, false);
    return room >= bytes + ns &&
           (room - bytes - ns) / ns >= extree_alloc_nodes_estimate(t);
}

/*
 * Host space for data with no neighbour to follow: the lowest free range
 * that fits, else (free space plentiful) the longest free range, else the
 * end of the file.  *@got may be less than @bytes.  O(log n).
 */
int extree_alloc_take_any(Extree *t, uint64_t bytes, uint64_t *host,
                          uint64_t *got)
{
    ExtreeRangeSet *set;
    ExtreeRange *r;
    int ret;

    set = &t->space.avail;
    r = extree_rs_first_fit(set, bytes);
    if (!r && (t->space.avail.bytes + t->space.nfree.bytes >=
               (t->host_end - t->data_start) / EXT_SCARCE_DIV ||
               fixed_leaves_room(t, bytes))) {
        /*
         * Plentiful but not in avail, or fragmented: node space, then part
         * of the request from the longest range, instead of growing.  The
         * same when a backend of fixed size cannot grow by the request:
         * free space is all there is (after a reopen the holes between
         * data load as node space, and growing would fail the write)
         */
        set = &t->space.nfree;
        r = extree_rs_first_fit(set, bytes);
        if (!r) {
            set = extree_rs_longest(&t->space.avail) >=
                  extree_rs_longest(&t->space.nfree) ?
                  &t->space.avail : &t->space.nfree;
            /* both empty: a device of fixed size may be full */
            r = extree_rs_longest(set) ?
                extree_rs_first_fit(set, extree_rs_longest(set)) : NULL;
        }
    }
    if (r) {
        *host = r->start;
        *got = MIN(bytes, r->len);
        take(t, set, *host, *got);
        return 0;
    }
    /*
     * Grow the file; reserve metadata room first so that the nodes this
     * write needs do not land right behind it
     */
    if (resv_bytes(t) < t->node_size) {
        ret = reserve_refill(t, true);
        if (ret < 0) {
            return ret;
        }
    }
    /* on a backend of fixed size, what fits (the caller loops) */
    *got = MIN(bytes, grow_room(t, true));
    if (!*got) {
        return -ENOSPC;
    }
    return grow(t, *got, host);
}

/*
 * Commit, before the free-tree sync: free space at the end of the file
 * that is allocatable (free in the last durable state too) leaves the data
 * area: host_end moves down to its start.  The caller truncates the file
 * once the superblock that says so is durable.  Pending frees are never
 * cut: state G still uses them, and space at the new host_end may be
 * reused by this very commit.  The reserve is not cut either.
 * Returns true if host_end moved.
 */
bool extree_alloc_trim_tail(Extree *t)
{
    ExtreeRangeSet *set = &t->space.avail;
    ExtreeRange *r = extree_rs_last(set);
    uint64_t start;

    if (!r || r->start + r->len != t->host_end) {
        set = &t->space.nfree;
        r = extree_rs_last(set);
    }
    if (!t->space.alloc_loaded || !r || r->start + r->len != t->host_end ||
        r->len < EXT_SHRINK_MIN) {
        return false;
    }
    start = r->start;
    take(t, set, start, r->len);
    t->host_end = start;
    t->super_dirty = true;
    return true;
}

static gint op_cmp(gconstpointer a, gconstpointer b)
{
    const ExtreeAllocOp *x = a, *y = b;

    return x->start < y->start ? -1 : x->start > y->start;
}

/*
 * The first free piece [*fs, *fe) of host space at or after @pos and
 * before @end, the three sets joined.  False if there is none.
 */
bool extree_alloc_next_free(Extree *t, uint64_t pos, uint64_t end,
                            uint64_t *fs, uint64_t *fe)
{
    ExtreeRangeSet *sets[3] = {
        &t->space.avail, &t->space.nfree, &t->space.pending
    };
    uint64_t s = UINT64_MAX, e = 0;

    for (int i = 0; i < 3; i++) {
        ExtreeRange *r = extree_rs_from(sets[i], pos);
        if (r && r->start < s) {
            s = r->start;
            e = r->start + r->len;
        }
    }
    if (resv_bytes(t) && t->space.resv_end > pos && t->space.resv_start < s) {
        s = t->space.resv_start;
        e = t->space.resv_end;
    }
    if (s >= end) {
        return false;
    }
    /* neighbours from the other sets continue the piece */
    for (;;) {
        uint64_t old = e;
        for (int i = 0; i < 3; i++) {
            ExtreeRange *n = extree_rs_floor(sets[i], e);
            if (n && n->start == e) {
                e += n->len;
            }
        }
        if (resv_bytes(t) && t->space.resv_start == e) {
            e = t->space.resv_end;
        }
        if (e == old) {
            break;
        }
    }
    *fs = MAX(s, pos);
    *fe = MIN(e, end);
    return true;
}

/*
 * The host ranges whose free state changed since the last call, in the
 * order logged: the free-tree sync rewrites them (a new log starts)
 */
GArray *extree_alloc_steal_log(Extree *t)
{
    GArray *ops = t->space.oplog;

    t->space.oplog = g_array_new(false, false, sizeof(ExtreeAllocOp));
    return ops;
}

/* Sort and merge a list of ranges in place */
void extree_ranges_merge(GArray *list)
{
    guint n = 0;

    g_array_sort(list, op_cmp);
    for (guint i = 0; i < list->len; i++) {
        ExtreeAllocOp *op = &g_array_index(list, ExtreeAllocOp, i);
        ExtreeAllocOp *last = n ? &g_array_index(list, ExtreeAllocOp, n - 1)
                                : NULL;
        if (last && op->start <= last->start + last->len) {
            last->len = MAX(last->len, op->start + op->len - last->start);
        } else {
            g_array_index(list, ExtreeAllocOp, n++) = *op;
        }
    }
    g_array_set_size(list, n);
}

/*
 * Commit step 7: the superblock is durable, pending frees are reusable:
 * freed node space goes to nfree, the rest to avail.  Appends to @discard
 * (ExtreeAllocOp) what the caller should discard now: the space this
 * commit freed, except node space, and the free ranges of at least
 * EXT_DISCARD_NODES_MIN that hold node space the previous commit freed
 * (extree_alloc_deferred()).  Node space this commit freed waits for the
 * next commit.  O(pending ranges * log n).
 */
void extree_alloc_commit_done(Extree *t, GArray *discard)
{
    /* pending is exactly freed_data + freed_nodes */
    extree_rs_clear(&t->space.pending);
    extree_rs_clear(&t->space.fresh);
    extree_ranges_merge(t->space.freed_data);
    extree_ranges_merge(t->space.freed_nodes);
    for (guint i = 0; i < t->space.freed_data->len; i++) {
        ExtreeAllocOp *op = &g_array_index(t->space.freed_data,
                                           ExtreeAllocOp, i);
        extree_rs_add(&t->space.avail, op->start, op->len);
    }
    for (guint i = 0; i < t->space.freed_nodes->len; i++) {
        ExtreeAllocOp *op = &g_array_index(t->space.freed_nodes,
                                           ExtreeAllocOp, i);
        extree_rs_add(&t->space.nfree, op->start, op->len);
    }
    g_array_append_vals(discard, t->space.freed_data->data,
                        t->space.freed_data->len);
    g_array_set_size(t->space.freed_data, 0);

    extree_alloc_deferred(t, discard);
    g_array_append_vals(t->space.discard_later, t->space.freed_nodes->data,
                        t->space.freed_nodes->len);
    g_array_set_size(t->space.freed_nodes, 0);
}

/*
 * Appends to @discard the free range [start, end) less the node space this
 * commit freed (t->space.freed_nodes, sorted and merged; empty after a commit):
 * the previous superblock's tree stays intact until the next commit.
 */
static void discard_less_freed(Extree *t, uint64_t start, uint64_t end,
                               GArray *discard)
{
    GArray *fn = t->space.freed_nodes;
    guint lo = 0, hi = fn->len;

    while (lo < hi) {
        guint mid = (lo + hi) / 2;
        ExtreeAllocOp *op = &g_array_index(fn, ExtreeAllocOp, mid);
        if (op->start + op->len <= start) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    for (guint i = lo; i < fn->len && start < end; i++) {
        ExtreeAllocOp *op = &g_array_index(fn, ExtreeAllocOp, i);
        if (op->start >= end) {
            break;
        }
        if (op->start > start) {
            g_array_append_val(discard, ((ExtreeAllocOp){ start,
                                          op->start - start, true }));
        }
        start = MAX(start, op->start + op->len);
    }
    if (start < end) {
        g_array_append_val(discard, ((ExtreeAllocOp){ start, end - start,
                                                      true }));
    }
}

/*
 * The length of the free space @r of nfree is part of, with the ranges of
 * avail right before and after it: node space next to free data space.
 */
static uint64_t joined_len(Extree *t, const ExtreeRange *r)
{
    ExtreeRange *before = r->start ?
                          extree_rs_floor(&t->space.avail, r->start - 1) :
                          NULL;
    ExtreeRange *after = extree_rs_after(&t->space.avail, r->start);
    uint64_t len = r->len;

    if (before && before->start + before->len == r->start) {
        len += before->len;
    }
    if (after && after->start == r->start + r->len) {
        len += after->len;
    }
    return len;
}

/*
 * Appends to @discard (ExtreeAllocOp) the node space the last commit freed
 * that is still allocatable, where it lies in free space of at least
 * EXT_DISCARD_NODES_MIN (with free data space next to it), and forgets the
 * rest of it.  The whole free range of nfree goes, not only the part this
 * commit freed: nodes freed one at a time over several commits join up
 * into long runs that no single commit freed, and would otherwise keep
 * their host space for good (a range that long loads as ordinary free
 * space at the next open, which nothing discards).  After the next
 * commit, or when no commit will come (close).
 */
void extree_alloc_deferred(Extree *t, GArray *discard)
{
    uint64_t done = 0;      /* end of the last range given */

    for (guint i = 0; i < t->space.discard_later->len; i++) {
        ExtreeAllocOp *op = &g_array_index(t->space.discard_later,
                                           ExtreeAllocOp, i);
        uint64_t end = op->start + op->len;
        ExtreeRange *r = extree_rs_from(&t->space.nfree, MAX(op->start, done));

        for (; r && r->start < end;
             r = extree_rs_after(&t->space.nfree, r->start)) {
            if (joined_len(t, r) >= MAX(t->node_size, EXT_DISCARD_NODES_MIN)) {
                discard_less_freed(t, r->start, r->start + r->len, discard);
                done = r->start + r->len;
            }
        }
    }
    g_array_set_size(t->space.discard_later, 0);
}

/*
 * Open: the free space is known (all of it added, or the part
 * extree_alloc_set_partial() says), or not (dropped)
 */
void extree_alloc_set_loaded(Extree *t, bool loaded)
{
    extree_rs_append_done(&t->space.avail);
    extree_rs_append_done(&t->space.nfree);
    if (!loaded) {
        extree_rs_clear(&t->space.avail);
        extree_rs_clear(&t->space.nfree);
        extree_rs_clear(&t->space.touched);
        t->space.alloc_partial = false;
        t->space.unloaded_bytes = 0;
    }
    t->space.alloc_loaded = loaded;
}

/*
 * Open: the ranges added are the free space of [data_start, free_lo) and
 * of [free_hi, ...); the tree's others hold @unloaded bytes.  With
 * @free_lo >= @free_hi, the whole tree (again, after
 * extree_freetree_load_rest()).
 */
void extree_alloc_set_partial(Extree *t, uint64_t free_lo, uint64_t free_hi,
                              uint64_t unloaded)
{
    t->space.alloc_partial = free_lo < free_hi;
    t->space.free_lo = free_lo;
    t->space.free_hi = free_hi;
    t->space.unloaded_bytes = t->space.alloc_partial ? unloaded : 0;
    extree_rs_clear(&t->space.touched);
}

/*
 * Checker, "repair all": every range of [data_start, host_end) not in
 * @used (sorted, disjoint ExtreeAllocOp ranges: extent-tree nodes and DATA
 * extents) becomes free.  Nothing the last durable state uses may be
 * overwritten before the next commit, and the old free tree (part of that
 * state) cannot be trusted to say where its own nodes are: so all that
 * space is pending, and the nodes of the new free tree come from new space
 * at the end of the file (extree_freetree_rebuild()).
 */
void extree_alloc_reset_free(Extree *t, GArray *used)
{
    uint64_t pos = t->data_start;

    extree_rs_clear(&t->space.avail);
    extree_rs_clear(&t->space.nfree);
    extree_rs_clear(&t->space.pending);
    extree_rs_clear(&t->space.fresh);
    extree_rs_clear(&t->space.fresh_data);
    extree_alloc_set_partial(t, 0, 0, 0);
    t->space.resv_start = t->space.resv_end = 0;
    g_array_set_size(t->space.oplog, 0);
    g_array_set_size(t->space.freed_data, 0);
    g_array_set_size(t->space.freed_nodes, 0);
    g_array_set_size(t->space.discard_later, 0);
    for (guint i = 0; i <= used->len; i++) {
        const ExtreeAllocOp *u = i < used->len ?
            &g_array_index(used, ExtreeAllocOp, i) : NULL;
        uint64_t s = u ? u->start : t->host_end;
        if (s > pos) {
            extree_rs_add(&t->space.pending, pos, s - pos);
            log_op(t, pos, s - pos, true);
            note_freed(t->space.freed_data, pos, s - pos);
        }
        if (u) {
            pos = MAX(pos, u->start + u->len);
        }
    }
    t->space.alloc_loaded = true;
}

/*
 * @bytes of contiguous space (the snapshot table, bitmap chunks and
 * directory): the lowest range of avail or freed node space that fits,
 * else the end of the file, else the front of the metadata reserve.  The
 * reserve is free space that node_room() counts, and so does the guard:
 * a commit whose chunks found no free range but the reserve's ran out of
 * space with the reserve still holding 85 nodes (issue 49 B).
 */
int extree_alloc_contig(Extree *t, uint64_t bytes, uint64_t *host)
{
    ExtreeRangeSet *set = &t->space.avail;
    ExtreeRange *r = extree_rs_first_fit(set, bytes);
    int ret;

    if (!r) {
        set = &t->space.nfree;
        r = extree_rs_first_fit(set, bytes);
    }
    if (r) {
        *host = r->start;
        take(t, set, *host, bytes);
        return 0;
    }
    ret = grow(t, bytes, host);
    if (ret == -ENOSPC && resv_bytes(t) >= bytes) {
        *host = t->space.resv_start;
        t->space.resv_start += bytes;
        log_op(t, *host, bytes, false);
        ret = 0;
    }
    return ret;
}
