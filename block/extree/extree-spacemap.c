/*
 * extree core: the space map
 *
 * One object, as device-mapper persistent-data's space map is: the free
 * space (extree-alloc.c), the reference counts (extree-reftree.c) and the
 * two trees that keep them on disk (extree-freetree.c, extree-reftree.c),
 * with their state in ExtreeSpace.  The B+tree gets and gives back node
 * space, and the extent layer DATA, through ExtreeSpaceMapOps (dm's
 * dm_space_map); the transaction layer commits it with extree_sm_commit()
 * before it writes the nodes and extree_sm_commit_done() once the
 * superblock is durable (dm's pre-commit and commit).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

static int sm_new_node(void *opaque, uint64_t *bytenr)
{
    ExtreeSpace *sp = opaque;
    int ret = extree_alloc_meta(sp->t, bytenr);

    if (ret == 0) {
        extree_trace(sp->t, EXTREE_TRACE_ALLOC_NODE, *bytenr, 0, 0);
    }
    return ret;
}

/*
 * A second (third, ...) reference to used blocks: only images with
 * snapshots count them (t->space.refs)
 */
static int sm_inc_ref(void *opaque, uint64_t start, uint64_t len)
{
    ExtreeSpace *sp = opaque;
    Extree *t = sp->t;

    if (!t->space.refs || !extree_has_refs(t)) {
        return -ENOTSUP;
    }
    if (!len || start < t->data_start || start >= t->host_end ||
        len > t->host_end - start || extree_alloc_is_free(t, start, len)) {
        return extree_corrupt(t, start, "corrupt reference count tree: "
                              "reference to host range at offset 0x%" PRIx64
                              " length 0x%" PRIx64 ", which is free or "
                              "outside the data area", start, len);
    }
    return extree_refs_inc(t, start, len);
}

static int sm_dec_ref(void *opaque, uint64_t start, uint64_t len, bool node)
{
    ExtreeSpace *sp = opaque;

    return extree_refs_dec(sp->t, start, len, node);
}

static int sm_ref_count(void *opaque, uint64_t start, uint32_t *count)
{
    ExtreeSpace *sp = opaque;
    Extree *t = sp->t;


    if (start < t->data_start || start >= t->host_end) {
        return -EINVAL;
    }
    if (extree_alloc_is_free(t, start, t->block_size)) {
        *count = 0;
    } else {
        *count = t->space.refs ? extree_refs_max(t, start, t->block_size) : 1;
    }
    return 0;
}

static const ExtreeSpaceMapOps space_map_ops = {
    .new_node = sm_new_node,
    .inc_ref = sm_inc_ref,
    .dec_ref = sm_dec_ref,
    .ref_count = sm_ref_count,
};

/* The handle's space map: its state, and t->sm pointing at it */
void extree_sm_init(Extree *t)
{
    t->space.t = t;
    extree_alloc_init(t);
    t->sm = (ExtreeSpaceMap){ &space_map_ops, &t->space };
}

/*
 * Pre-commit: the on-disk trees take in this transaction's changes.  The
 * reference count tree first (its copies allocate and free space), then
 * free space at the end of the file that the last durable state does not
 * use either leaves the data area (lower host_end), then the free-space
 * tree takes in every allocation and free (pending frees are free in the
 * next generation), to a fixed point.  A failure leaves the trees half
 * synced: the caller gives up on the handle.
 */
int extree_sm_commit(ExtreeSpace *sp)
{
    Extree *t = sp->t;
    int ret;

    ret = extree_reftree_sync(t);
    if (ret < 0) {
        return ret;
    }
    if (extree_alloc_trim_tail(t)) {
        sp->trimmed = true;
    }
    return extree_freetree_sync(t);
}

/*
 * The superblock of the new generation is durable: space freed in it may
 * be reused now; *@freed gets what to discard
 */
void extree_sm_commit_done(ExtreeSpace *sp, GArray *freed)
{
    extree_alloc_commit_done(sp->t, freed);
}
