/*
 * extree core: the cursor: block status and reads, one descent and then
 * forward along the leaves (extree_cursor_query() and its no-wait form)
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

void extree_cursor_init(ExtreeCursor *c, Extree *t)
{
    memset(c, 0, sizeof(*c));
    c->t = t;
}

void extree_cursor_release(ExtreeCursor *c)
{
    if (c->t) {
        extree_path_release(c->t, &c->path);
    }
    c->valid = false;
}

/*
 * Move the cursor's leaf slot past the items that end at or before @guest;
 * returns the new slot (== @nr when the leaf has no such item left)
 */
static inline int cursor_skip_ended(ExtreeCursor *c, const ExtreeNode *n,
                                    int nr, uint64_t guest)
{
    int slot = c->path.slots[0];

    while (slot < nr && leaf_key(n, slot) + leaf_len(n, slot) <= guest) {
        slot++;
    }
    c->path.slots[0] = slot;
    return slot;
}

/*
 * Put slots[0] on the first item that ends after @guest (or past the last
 * item of the last leaf).  Forward from the current position when it is
 * still valid and at most two leaves away, else one descent.  A no-wait
 * query walks forward only from exactly where the last answer ended (a
 * walk, whose missing leaf is left to the blocking query's readahead):
 * after a jump, a descent names the one node it misses.
 */
static int cursor_seek(ExtreeCursor *c, uint64_t guest)
{
    Extree *t = c->t;
    ExtreeTree *tree = &t->trees[EXTREE_TREE_EXTENT];
    ExtreeNode *n;
    int slot, nr, ret;

    if (c->valid && c->seq == t->seq && guest >= c->pos &&
        (!t->nc.nowait || guest == c->pos)) {
        for (int hops = 0; ; hops++) {
            n = c->path.nodes[0];
            nr = node_nritems(n);
            slot = cursor_skip_ended(c, n, nr, guest);
            if (slot < nr) {
                return 0;
            }
            if (hops == 2) {
                break;
            }
            ret = extree_bt_next_leaf(t, tree, &c->path);
            if (ret == 1) {
                return 0;
            } else if (ret < 0) {
                c->valid = false;
                return ret;
            }
        }
    }
    c->valid = false;
    ret = extree_bt_seek(t, tree, guest, &c->path);
    if (ret < 0) {
        return ret;
    }
    n = c->path.nodes[0];
    slot = c->path.slots[0];
    if (slot > 0 && leaf_key(n, slot - 1) + leaf_len(n, slot - 1) > guest) {
        c->path.slots[0] = slot - 1;
    } else if (slot >= (int)node_nritems(n)) {
        ret = extree_bt_next_leaf(t, tree, &c->path);
        if (ret < 0) {
            return ret;
        }
    }
    c->valid = true;
    c->seq = t->seq;
    return 0;
}

static bool run_joins(int coalesce, const ExtreeItem *cur, const ExtreeItem *nx)
{
    if (cur->key + cur->length != nx->key) {
        return false;
    }
    if (coalesce == EXTREE_COALESCE_ALLOC) {
        return true;
    }
    if (coalesce == EXTREE_COALESCE_STATUS &&
        cur->type == EXTREE_ITEM_COMPRESSED &&
        nx->type == EXTREE_ITEM_COMPRESSED) {
        return true;
    }
    return extree_extent_vt.mergeable(cur, nx);
}

/* The run's type and host at @guest inside item @it */
static inline void run_from_item(ExtreeRun *run, const ExtreeItem *it,
                                 uint64_t guest)
{
    if (it->type == EXTREE_ITEM_DATA) {
        run->type = EXTREE_RUN_DATA;
        run->host = it->host + (guest - it->key);
    } else if (it->type == EXTREE_ITEM_COMPRESSED) {
        run->type = EXTREE_RUN_COMPRESSED;
        run->host = it->host;
        run->ext_guest = it->key;
        run->ext_length = it->length;
        run->payload_len = extree_compressed_len(it);
        run->alg = extree_compressed_alg(it);
    } else {
        run->type = EXTREE_RUN_ZERO;
        run->host = 0;
    }
}

/*
 * The general query: seek (forward or one descent), then coalesce across
 * items and leaves.  @limit is the already clamped end of the query.
 */
static int __attribute__((noinline))
cursor_query_slow(ExtreeCursor *c, uint64_t guest, uint64_t limit,
                  int coalesce, ExtreeRun *run)
{
    Extree *t = c->t;
    ExtreeTree *tree = &t->trees[EXTREE_TREE_EXTENT];
    uint64_t end;
    ExtreeNode *n;
    ExtreeItem cur;
    int slot, nr, ret;

    ret = cursor_seek(c, guest);
    if (ret < 0) {
        extree_cursor_release(c);
        return ret;
    }
    n = c->path.nodes[0];
    nr = node_nritems(n);
    slot = c->path.slots[0];
    run->guest = guest;
    run->host = 0;
    if (slot >= nr || leaf_key(n, slot) > guest) {
        run->type = EXTREE_RUN_UNALLOC;
        end = slot >= nr ? limit : MIN(leaf_key(n, slot), limit);
    } else {
        leaf_get(n, slot, &cur);
        run_from_item(run, &cur, guest);
        end = cur.key + cur.length;
        while (end < limit) {
            ExtreeItem nx;

            if (coalesce == EXTREE_COALESCE_ALLOC &&
                slot + 1 < nr && leaf_key(n, slot + 1) == end) {
                /* every adjacent item joins: just follow the keys */
                do {
                    slot++;
                    end += leaf_len(n, slot);
                } while (end < limit && slot + 1 < nr &&
                         leaf_key(n, slot + 1) == end);
                leaf_get(n, slot, &cur);
                continue;
            }
            if (slot + 1 < nr) {
                slot++;
            } else {
                c->path.slots[0] = slot + 1;
                if (coalesce == EXTREE_COALESCE_ALLOC) {
                    ret = extree_bt_next_leaf_covered(t, tree, &c->path, &end,
                                                      limit);
                    /* what the run joins next must start at end */
                    cur.key = end;
                    cur.length = 0;
                } else {
                    ret = extree_bt_next_leaf(t, tree, &c->path);
                }
                if (ret < 0) {
                    extree_cursor_release(c);
                    return ret;
                }
                if (ret == 1) {
                    slot = nr;
                    break;
                }
                n = c->path.nodes[0];
                nr = node_nritems(n);
                slot = 0;
            }
            leaf_get(n, slot, &nx);
            if (!run_joins(coalesce, &cur, &nx)) {
                break;
            }
            cur = nx;
            end = nx.key + nx.length;
        }
        end = MIN(end, limit);
    }
    c->path.slots[0] = slot;
    run->length = end - guest;
    c->pos = end;
    return 0;
}

/*
 * The query's fast path: the cursor is still valid and the answer is the
 * item (or the hole before it) at or a few slots after its position on the
 * same leaf, and that answer does not continue into the next item (the
 * next item is not adjacent, or the run reaches @limit).  Everything else
 * (leaf ends, adjacent items that may coalesce, stale cursor) returns
 * -EAGAIN for the general path, which gives the same answer and cursor
 * state.  Reads only the cursor's pinned leaf: no I/O, no allocation.
 */
static inline int cursor_query_fast(ExtreeCursor *c, uint64_t guest,
                                    uint64_t limit, ExtreeRun *run)
{
    const Extree *t = c->t;
    const ExtreeNode *n;
    ExtreeItem it;
    uint64_t end;
    int slot, nr;

    if (!c->valid || c->seq != t->seq || guest < c->pos) {
        return -EAGAIN;
    }
    n = c->path.nodes[0];
    nr = node_nritems(n);
    slot = cursor_skip_ended(c, n, nr, guest);
    if (slot >= nr) {
        return -EAGAIN;
    }
    leaf_get(n, slot, &it);
    if (it.key > guest) {
        end = MIN(it.key, limit);
        run->type = EXTREE_RUN_UNALLOC;
        run->host = 0;
    } else {
        end = it.key + it.length;
        if (end >= limit) {
            end = limit;
        } else if (slot + 1 < nr && leaf_key(n, slot + 1) != end) {
            slot++;
        } else {
            return -EAGAIN;
        }
        run_from_item(run, &it, guest);
        c->path.slots[0] = slot;
    }
    run->guest = guest;
    run->length = end - guest;
    c->pos = end;
    return 0;
}

static inline int query_limit(const ExtreeCursor *c, uint64_t guest,
                              uint64_t max_bytes, uint64_t *limit)
{
    uint64_t vsize;

    /* a cursor reset by its owner when its handle went */
    if (!c->t) {
        return -EINVAL;
    }
    vsize = c->t->virtual_size;
    if (guest >= vsize || max_bytes == 0) {
        return -EINVAL;
    }
    *limit = max_bytes < vsize - guest ? guest + max_bytes : vsize;
    return 0;
}

int extree_cursor_query(ExtreeCursor *c, uint64_t guest, uint64_t max_bytes,
                        int coalesce, ExtreeRun *run)
{
    uint64_t limit;
    int ret = query_limit(c, guest, max_bytes, &limit);

    if (ret < 0) {
        return ret;
    }
    ret = cursor_query_fast(c, guest, limit, run);
    if (__builtin_expect(ret == 0, 1)) {
        return 0;
    }
    return cursor_query_slow(c, guest, limit, coalesce, run);
}

int extree_cursor_query_cached(ExtreeCursor *c, uint64_t guest,
                               uint64_t max_bytes, ExtreeRun *run)
{
    uint64_t limit;
    int ret = query_limit(c, guest, max_bytes, &limit);

    if (ret < 0) {
        return ret;
    }
    return cursor_query_fast(c, guest, limit, run);
}

int extree_cursor_query_nowait(ExtreeCursor *c, uint64_t guest,
                               uint64_t max_bytes, int coalesce,
                               ExtreeRun *run)
{
    uint64_t limit;
    int ret = query_limit(c, guest, max_bytes, &limit);

    if (ret < 0) {
        return ret;
    }
    ret = cursor_query_fast(c, guest, limit, run);
    if (ret == 0) {
        return 0;
    }
    c->t->nc.nowait = true;
    ret = cursor_query_slow(c, guest, limit, coalesce, run);
    c->t->nc.nowait = false;
    return ret;
}

int extree_lookup(Extree *t, uint64_t guest, uint64_t bytes, ExtreeRun *runs,
                  int max_runs, int *nruns)
{
    ExtreeCursor c;
    uint64_t end;
    int ret = 0;

    *nruns = 0;
    if (guest >= t->virtual_size || !bytes) {
        return -EINVAL;
    }
    end = guest + MIN(bytes, t->virtual_size - guest);
    extree_cursor_init(&c, t);
    while (guest < end && *nruns < max_runs) {
        ret = extree_cursor_query(&c, guest, end - guest,
                                  EXTREE_COALESCE_HOST, &runs[*nruns]);
        if (ret < 0) {
            break;
        }
        guest += runs[*nruns].length;
        (*nruns)++;
    }
    extree_cursor_release(&c);
    return ret;
}

/*
 * qemu-img check's figures: blocks of DATA and COMPRESSED extents, and
 * runs that do not continue in the host file where the previous one
 * ended.  One forward walk: O(extents).
 */
int extree_count_fragments(Extree *t, uint64_t *data_blocks,
                           uint64_t *fragments)
{
    uint64_t pos = 0, next_host = 0;
    ExtreeCursor c;
    int ret = 0;

    *data_blocks = *fragments = 0;
    extree_cursor_init(&c, t);
    while (pos < t->virtual_size) {
        ExtreeRun run;

        ret = extree_cursor_query(&c, pos, t->virtual_size - pos,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            break;
        }
        if (run.type == EXTREE_RUN_DATA) {
            uint64_t blocks = EXTREE_ROUND_UP(run.length, t->block_size) /
                              t->block_size;
            *data_blocks += blocks;
            if (next_host && run.host != next_host) {
                (*fragments)++;
            }
            next_host = run.host + blocks * t->block_size;
        } else if (run.type == EXTREE_RUN_COMPRESSED) {
            /* guest blocks; the payload's place for fragmentation */
            *data_blocks += EXTREE_ROUND_UP(run.length, t->block_size) /
                            t->block_size;
            if (next_host && run.host != next_host) {
                (*fragments)++;
            }
            next_host = run.host + EXTREE_ROUND_UP(run.payload_len,
                                                   t->block_size);
        }
        pos += run.length;
    }
    extree_cursor_release(&c);
    return ret;
}
