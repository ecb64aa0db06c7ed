/*
 * extree core: open, close, commit
 *
 * The transaction layer: the only caller of commit below the driver.  The
 * superblock's slots are extree-super.c's, the snapshot table
 * extree-snaptab.c's.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stddef.h>

#include "extree-int.h"

const ExtreeValueType *extree_tree_vt(uint32_t owner)
{
    switch (owner) {
    case EXTREE_TREE_EXTENT:
        return &extree_extent_vt;
    case EXTREE_TREE_FREE:
        return &extree_free_vt;
    default:
        g_assert(owner == EXTREE_TREE_REFS);
        return &extree_refs_vt;
    }
}

static void tree_init(ExtreeTree *tree, uint32_t owner, const ExtreeSuper *s)
{
    tree->owner = owner;
    tree->vt = extree_tree_vt(owner);
    tree->root = s->root[owner];
    tree->root_gen = s->root_gen[owner];
    tree->level = s->root_level[owner];
    tree->nitems = 0;
    tree->total = 0;
    tree->data_end = owner == EXTREE_TREE_EXTENT ?
                     EXTREE_ROUND_UP(s->virtual_size, s->block_size) :
                     UINT64_MAX;
}

/*
 * Every root (live and snapshots) holds a reference to its root node: a
 * count below the number of roots naming a node would let a write free a
 * node another tree still uses.  O(snapshots log snapshots), no I/O.
 */
static int check_root_counts(Extree *t)
{
    unsigned n = t->snap.list->len;
    GArray *roots = g_array_sized_new(false, false, sizeof(uint64_t), n + 1);
    int ret = 0;

    for (unsigned i = 0; i < n; i++) {
        g_array_append_val(roots,
                           g_array_index(t->snap.list, ExtreeSnap, i).root);
    }
    g_array_append_val(roots, t->trees[EXTREE_TREE_EXTENT].root);
    g_array_sort(roots, extree_u64_cmp);
    for (unsigned i = 0, k; i <= n && ret == 0; i = k) {
        uint64_t root = g_array_index(roots, uint64_t, i);
        uint32_t have = 0;

        /* [i, k): the trees naming @root */
        k = i + 1;
        while (k <= n && g_array_index(roots, uint64_t, k) == root) {
            k++;
        }
        t->sm.ops->ref_count(t->sm.opaque, root, &have);
        if (have < k - i) {
            ret = extree_corrupt(t, root, "corrupt reference count tree: "
                                 "extent tree root at offset 0x%" PRIx64
                                 " has %u references, %u trees name it",
                                 root, have, k - i);
        }
    }
    g_array_free(roots, true);
    return ret;
}

/*
 * Every snapshot was taken (or the image reverted) before snap_generation:
 * a lower value makes nodes a snapshot shares look unshared, and the next
 * write would change them in place.  A writer's open fails; a read-only
 * or checker's handle goes on with the safe value (every node older than
 * the running transaction is looked up).  O(snapshots).
 */
static int check_snap_gen(Extree *t, const ExtreeOpenOptions *o)
{
    const ExtreeSnap *top = NULL;

    for (unsigned i = 0; i < t->snap.list->len; i++) {
        const ExtreeSnap *sn = &g_array_index(t->snap.list, ExtreeSnap, i);

        if (!top || sn->generation > top->generation) {
            top = sn;
        }
    }
    if (!top || top->generation < t->snap.gen) {
        return 0;
    }
    if (!t->read_only && !o->check) {
        return extree_corrupt(t, (t->generation % 2) * EXTREE_SB_SIZE,
                              "corrupt superblock at offset 0x%" PRIx64
                              ": snap_generation %" PRIu64 " not above "
                              "snapshot '%s' taken at generation %" PRIu64
                              " (qemu-img check -r all repairs it)",
                              (t->generation % 2) * (uint64_t)EXTREE_SB_SIZE,
                              t->snap.gen, top->id, top->generation);
    }
    t->snap.gen_bad = true;
    t->snap.gen_stored = t->snap.gen;
    t->snap.gen = t->trans_gen;
    return 0;
}

/*
 * The roots open reads next (the extent tree's; a writer's free and
 * reference count trees' too) in one batch: one wait instead of one per
 * tree.  Best effort, as all readahead: extree_node_get() reads and
 * checks each again if need be.
 */
static void readahead_roots(Extree *t)
{
    ExtreeNodeExpect e[EXT_NTREES];
    uint64_t bytenr[EXT_NTREES];
    int n = 0;

    for (uint32_t o = EXTREE_TREE_EXTENT; o < EXT_NTREES; o++) {
        ExtreeTree *tree = &t->trees[o];

        if (!tree->root || (o != EXTREE_TREE_EXTENT && t->read_only) ||
            (o == EXTREE_TREE_REFS && !extree_has_refs(t))) {
            continue;
        }
        extree_tree_expect(t, tree, &e[n]);
        bytenr[n++] = tree->root;
    }
    extree_node_readahead(t, n, bytenr, e);
}

/*
 * The chain's map entries found by extree_mark_log_load(), applied: their
 * host ranges claimed first (the tree updates of the first ones must not
 * take space a later one maps), then each mapped in order as the write
 * did, its marks set by the update.  A read-only handle applies them in
 * memory only: nothing it changes is ever written (extree_commit()
 * refuses it), so it allows the update for the call.  A host range that
 * is not free in the loaded state is damage: the record lies.
 */
static int map_log_apply(Extree *t)
{
    GArray *a = t->bm.map_replay;
    bool ro = t->read_only;
    uint64_t corrupt = t->incompat & EXTREE_INCOMPAT_CORRUPT;
    int ret = 0;

    if (!a || !a->len) {
        return 0;
    }
    /* the writer's own updates, made again: allowed on a corrupt image */
    t->read_only = false;
    t->incompat &= ~corrupt;
    if (ro) {
        /*
         * What a reader's replay takes past host_end is never written:
         * no node there can be overwritten, so it need not read every
         * tree first (extree_probe_end(); that also spares the open of
         * a damaged image marked corrupt the damaged nodes)
         */
        t->end_probed = true;
    }
    ret = extree_probe_end(t);
    if (ret == 0 && t->space.alloc_partial) {
        ret = extree_freetree_load_rest(t);
    }
    for (guint i = 0; ret == 0 && i < a->len; i++) {
        ExtreeMapEntry *me = &g_array_index(a, ExtreeMapEntry, i);

        ret = extree_alloc_claim(t, me->host, me->length);
        if (ret == -EEXIST) {
            char *msg = g_strdup_printf("corrupt mark log at offset 0x%"
                                        PRIx64 ": map entry %u: host offset"
                                        " 0x%" PRIx64 " length 0x%" PRIx64
                                        " is in use", t->bm.log, i, me->host,
                                        me->length);
            if (t->repair) {
                /*
                 * A repair goes on without the chain's maps: what it
                 * claimed is a leak it frees, and every bitmap is marked
                 * whole (the records' marks are unknown)
                 */
                g_free(t->bm.log_bad);
                t->bm.log_bad = msg;
                t->read_only = ro;
                t->incompat |= corrupt;
                g_array_set_size(a, 0);
                return 0;
            }
            ret = extree_corrupt(t, t->bm.log, "%s", msg);
            g_free(msg);
        }
    }
    t->bm.logging = true;
    for (guint i = 0; ret == 0 && i < a->len; i++) {
        ExtreeMapEntry *me = &g_array_index(a, ExtreeMapEntry, i);
        ExtreeItem it = { me->guest, me->length, me->host, EXTREE_ITEM_DATA };

        ret = extree_extent_update(t, &it, me->guest, me->length);
        if (ret == 0) {
            extree_rs_union(&t->bm.map_hosts, me->host, me->length);
            t->bm.map_replayed++;
        }
    }
    t->bm.logging = false;
    t->read_only = ro;
    t->incompat |= corrupt;
    g_array_set_size(a, 0);
    if (ret < 0) {
        t->broken = true;
    }
    return ret;
}

/*
 * The map records of the chain (spec: Mark log, map records), applied.  A
 * read-only handle loads the free space and reference counts for it.  A
 * checker's handle does not apply them: it checks the committed state and
 * the records against it (extree-check.c), and its repair commits only
 * after a writer's replay (extree_check()).
 */
static int load_map_log(Extree *t, const ExtreeSuper *sb)
{
    int ret = 0;

    if (t->read_only) {
        extree_refs_init(t);
        ret = extree_freetree_load(t, sb->free_bytes, true);
        if (ret == 0 && extree_has_refs(t)) {
            ret = extree_reftree_load(t);
        }
    }
    return ret < 0 ? ret : map_log_apply(t);
}

/*
 * The state of the committed superblock @sb, into a handle whose cache
 * and space map are set up and empty: sizes, roots, the extent root read
 * and checked, the snapshot table, and for a writer the free space and
 * the reference counts.  Open, and rollback (extree_rollback()).
 */
static int load_state(Extree *t, const ExtreeSuper *sb,
                      const ExtreeOpenOptions *o)
{
    int ret;

    t->virtual_size = sb->virtual_size;
    t->host_end = t->sb_host_end = sb->host_end;
    t->base_host_end = sb->host_end;
    t->base_gen = sb->generation;
    t->end_probed = false;
    {
        /*
         * Bytes past host_end (a crash's grow-ahead, storage of fixed
         * size, or a superblock whose host_end was lowered): the trees
         * are read before space there is handed out (extree_probe_end())
         */
        int64_t len = t->be->ops->get_length(t->be->opaque);

        t->base_tail = len < 0 || (uint64_t)len > sb->host_end;
    }
    t->generation = sb->generation;
    t->trans_gen = t->generation + 1;
    /* the lag is the superblock's: the next commit's chain is its own */
    t->incompat = sb->incompat & ~EXTREE_INCOMPAT_LOG_LAG;
    t->compat = sb->compat;
    t->crypt_method = sb->crypt_method;
    t->crypt_header_offset = sb->crypt_header_offset;
    t->crypt_header_length = sb->crypt_header_length;
    t->compression_type = sb->compression_type;
    t->backing_file = sb->backing_file[0] ?
                      g_strdup(sb->backing_file) : NULL;
    t->backing_fmt = sb->backing_fmt[0] ?
                     g_strdup(sb->backing_fmt) : NULL;
    EXT_FOR_EACH_TREE(owner) {
        tree_init(&t->trees[owner], owner, sb);
    }
    t->snap_view = -1;
    if (extree_has_refs(t)) {
        tree_init(&t->trees[EXTREE_TREE_REFS], EXTREE_TREE_REFS, sb);
        t->trees[EXTREE_TREE_EXTENT].shared = true;
        t->snap.gen = sb->snap_gen;
    }
    t->trees[EXTREE_TREE_EXTENT].share_item = extree_extent_share;
    t->trees[EXTREE_TREE_EXTENT].verify_unshared = extree_extent_node_unshared;
    t->trees[EXTREE_TREE_EXTENT].nitems = sb->extent_count;
    t->trees[EXTREE_TREE_FREE].total = sb->free_bytes;
    /* an unknown autoclear bit is cleared by the next commit */
    t->super_dirty = (sb->autoclear & ~EXTREE_AUTOCLEAR_MASK) &&
                     !t->read_only;

    /*
     * The extent root only: a bad root fails open, not the first read.
     * Reads never need the free-space tree: a read-only handle does not
     * load it (damage there is the checker's to find).  A writer must
     * know the free space; with @repair a damaged free tree leaves the
     * handle without an allocator, for extree_check() to rebuild it.
     */
    readahead_roots(t);
    {
        ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
        ExtreeNodeExpect e;
        ExtreeNode *n;
        extree_tree_expect(t, et, &e);
        ret = extree_node_get(t, et->root, &e, &n);
        if (ret == 0) {
            /*
             * The root's children are checked against its child_bytes as
             * they are read; the root itself against the superblock
             */
            et->total = n->bytes;
            if ((sb->autoclear & EXTREE_AUTOCLEAR_EXTENT_BYTES) &&
                n->bytes != sb->extent_bytes && o->check) {
                t->chk.root_bytes_bad = true;
                t->chk.root_bytes_want = sb->extent_bytes;
            } else if ((sb->autoclear & EXTREE_AUTOCLEAR_EXTENT_BYTES) &&
                       n->bytes != sb->extent_bytes) {
                ret = extree_corrupt(t, et->root, "corrupt extent tree node "
                                     "at offset 0x%" PRIx64 ": subtree bytes"
                                     " mismatch, have 0x%" PRIx64 " expect "
                                     "0x%" PRIx64 " (superblock's "
                                     "extent_bytes)", et->root, n->bytes,
                                     sb->extent_bytes);
            }
            extree_node_unref(t, n);
        }
    }
    if (ret == 0) {
        ret = extree_snap_table_load(t, sb);
    }
    if (ret == 0) {
        ret = check_snap_gen(t, o);
    }
    if (ret == 0) {
        ret = extree_bitmaps_load(t, sb, o->check);
    }
    if (ret == 0) {
        /* the marks of writes in place made since @sb, into the bits */
        ret = extree_mark_log_load(t, sb, o->check);
    }
    if (ret == 0 && !t->read_only) {
        extree_refs_init(t);
        ret = extree_freetree_load(t, sb->free_bytes, t->repair);
        if (ret == 0 && extree_has_refs(t)) {
            ret = extree_reftree_load(t);
            if (ret < 0) {
                /* counts unknown: no updates (the checker may look) */
                extree_alloc_set_loaded(t, false);
            } else {
                /* counts known but wrong: the checker can repair them */
                ret = check_root_counts(t);
            }
        }
        if (ret < 0 && t->repair) {
            ret = 0;
        }
    }
    if (ret == 0 && t->bm.map_replay && t->bm.map_replay->len &&
        !(o->check && t->read_only)) {
        const char *why = NULL;

        if (t->bm.map_skip) {
            /* a corrupt image's chain that did not apply: extree_open() */
            why = "map records not replayed: they did not apply";
        } else if (t->read_only || t->space.alloc_loaded) {
            ret = load_map_log(t, sb);
            t->bm.map_failed = ret < 0;
        } else {
            /* a repair without free space: the maps are left out */
            why = "map records not replayed: the free space is unknown";
        }
        if (why && t->repair && !t->bm.log_bad) {
            /* the repair marks every bitmap whole */
            t->bm.log_bad = g_strdup(why);
        } else if (why && !t->repair && !t->bm.map_skip &&
                   !t->open_warning) {
            t->open_warning = g_strdup(why);
        }
        if (why) {
            g_array_set_size(t->bm.map_replay, 0);
        }
    }
    return ret;
}

/*
 * A handle for the superblock @sb, its state not yet loaded.  @map_skip:
 * without the chain's map records (an image marked corrupt, extree_open()).
 */
static Extree *handle_new(ExtreeBackend *be, const ExtreeOpenOptions *o,
                          const ExtreeSuper *sb, const ExtreeSkipped *skip,
                          bool map_skip)
{
    Extree *t = g_new0(Extree, 1);

    t->be = be;
    t->read_only = o->read_only;
    t->repair = o->repair && !o->read_only;
    /*
     * Not a torn write: someone wrote a bad superblock, perhaps the newest
     * one; it is overwritten by the next commit
     */
    t->open_warning = skip->sum_ok ? g_strdup(skip->why) : NULL;
    t->block_size = sb->block_size;
    t->node_size = sb->node_size;
    t->leaf_cap = EXTREE_LEAF_CAPACITY(t->node_size);
    t->ptr_cap = EXTREE_INTERIOR_CAPACITY(t->node_size);
    t->data_start = extree_sb_data_start(sb);
    t->csb = g_new(ExtreeSuper, 1);
    *t->csb = *sb;
    t->nc.limit = MAX((o->cache_size ? o->cache_size
                              : EXTREE_DEFAULT_CACHE_SIZE) / t->node_size, 32);
    t->nc.dirty_limit = MAX((o->dirty_limit ? o->dirty_limit
                                  : EXTREE_DEFAULT_DIRTY_LIMIT) / t->node_size,
                            16);
    t->commit_by_caller = o->commit_by_caller;
    t->bm.max_bytes = o->bitmap_max_bytes ? o->bitmap_max_bytes :
                          EXTREE_BITMAP_MAX_BYTES;
    t->bm.no_log = o->no_mark_log;
    extree_cache_init(t);
    extree_sm_init(t);
    t->bm.map_skip = map_skip;
    return t;
}

int extree_open(ExtreeBackend *be, const ExtreeOpenOptions *o, Extree **out,
                char **errmsg)
{
    ExtreeOpenOptions defaults = { 0 };
    ExtreeSuper sb[2];
    ExtreeSkipped skip;
    int best, ret;
    Extree *t;

    *out = NULL;
    *errmsg = NULL;
    if (!o) {
        o = &defaults;
    }
    if (o->damage) {
        *o->damage = EXTREE_DAMAGE_NONE;
    }
    ret = extree_sb_read(be, sb, &best, errmsg, &skip);
    if (best < 0) {
        if (o->damage && skip.both_bad) {
            *o->damage = EXTREE_DAMAGE_CORRUPT;
        }
        return ret;
    }

    if (sb[best].incompat & ~EXTREE_INCOMPAT_MASK) {
        *errmsg = g_strdup_printf("Unsupported incompatible features 0x%"
                                  PRIx64, (uint64_t)(sb[best].incompat &
                                  ~EXTREE_INCOMPAT_MASK));
        g_free(skip.why);
        return -ENOTSUP;
    }
    if ((sb[best].incompat & EXTREE_INCOMPAT_CORRUPT) && !o->read_only &&
        !o->repair) {
        *errmsg = g_strdup("Image is marked corrupt; it can only be opened "
                           "read-only");
        g_free(skip.why);
        return -EACCES;
    }

    if (sb[best].generation >= EXTREE_MAX_GENERATION && !o->read_only) {
        *errmsg = g_strdup_printf("Generation %" PRIu64 " is at the limit "
                                  "of the format; the image can only be "
                                  "opened read-only", sb[best].generation);
        g_free(skip.why);
        return -EROFS;
    }

    t = handle_new(be, o, &sb[best], &skip, false);
    ret = load_state(t, &sb[best], o);
    if (ret < 0 && t->bm.map_failed && (t->read_only || t->repair) &&
        (sb[best].incompat & EXTREE_INCOMPAT_CORRUPT)) {
        /*
         * An image marked corrupt may be damaged where its map records
         * apply: it is still opened read-only, in its committed state, as
         * qcow2 opens a corrupt image; a repair goes on without them (and
         * marks every bitmap whole, load_state())
         */
        char *why = g_strdup(t->last_error ? t->last_error
                                           : g_strerror(-ret));

        extree_close(t);
        t = handle_new(be, o, &sb[best], &skip, true);
        ret = load_state(t, &sb[best], o);
        if (ret == 0 && !t->repair) {
            char *w = t->open_warning;

            t->open_warning = g_strdup_printf("%s%smap records not "
                                              "replayed: %s", w ? w : "",
                                              w ? "; " : "", why);
            g_free(w);
        }
        g_free(why);
    }
    if (ret < 0) {
        const char *why = t->last_error ? t->last_error : g_strerror(-ret);
        /*
         * The skipped slot may be the real problem (a durable commit
         * discards what the older generation alone used)
         */
        if (skip.skipped) {
            *errmsg = g_strdup_printf("%s; then: %s", skip.why, why);
        } else {
            *errmsg = g_strdup(why);
        }
        if (o->damage && ret == -EIO) {
            /* a skipped slot is damage whatever the other slot's state */
            *o->damage = skip.skipped ? EXTREE_DAMAGE_CORRUPT : t->damage;
        }
        g_free(skip.why);
        extree_close(t);
        return ret;
    }
    g_free(skip.why);
    *out = t;
    return 0;
}

void extree_close(Extree *t)
{
    if (!t) {
        return;
    }
    for (uint32_t o = EXTREE_TREE_EXTENT; o < EXT_NTREES; o++) {
        extree_path_release(t, &t->pcache[o]);
    }
    extree_cache_destroy(t);
    extree_alloc_destroy(t);
    extree_refs_destroy(t);
    if (t->snap.list) {
        g_array_free(t->snap.list, true);
    }
    extree_bitmaps_free(t);
    g_free(t->backing_file);
    g_free(t->backing_fmt);
    g_free(t->csb);
    g_free(t->last_error);
    g_free(t->pending.msg);
    g_free(t->open_warning);
    g_free(t);
}

bool extree_is_dirty(const Extree *t)
{
    return t->nc.ndirty > 0 || t->super_dirty || t->space.oplog->len > 0 ||
           (t->space.reflog && t->space.reflog->len > 0);
}

bool extree_changes_lost(const Extree *t)
{
    return t->changes_lost;
}

int extree_commit_or_roll_back(Extree *t, int *rollback)
{
    int ret = extree_commit(t);

    *rollback = 0;
    if (ret < 0 && extree_is_broken(t) && extree_can_roll_back(t)) {
        /*
         * Out of space half-way through an update or this commit: an
         * estimate fell short, or storage of fixed size ended before the
         * caller's growing found out.  Go on from the last commit, as a
         * reopen would, instead of failing every later update.
         */
        int r = extree_rollback(t);

        *rollback = r < 0 ? r : 1;
        ret = -ENOSPC;
    }
    return ret;
}

bool extree_is_broken(const Extree *t)
{
    return t->broken;
}

bool extree_can_roll_back(const Extree *t)
{
    return !t->read_only && !t->repair && t->snap_view < 0 &&
           (!t->broken || t->broken_nospace) &&
           !(t->incompat & EXTREE_INCOMPAT_CORRUPT);
}

/*
 * Back to the last commit, in memory, as a reopen would be: nodes, free
 * space, counts and the snapshot table of the running transaction are
 * dropped and the committed state is loaded again (the free-space tree
 * as at open).  What the caller keeps: its options, the corruption
 * handler, the backend's limit.  Cursors see t->seq change.  A failed
 * load leaves the handle broken.  O(cached nodes) plus open's reads.
 */
int extree_rollback(Extree *t)
{
    ExtreeOpenOptions o = { 0 };
    uint64_t limit = t->space.host_limit;
    int ret;

    if (!extree_can_roll_back(t)) {
        return t->read_only ? -EROFS : -EIO;
    }
    for (uint32_t owner = EXTREE_TREE_EXTENT; owner < EXT_NTREES; owner++) {
        extree_path_release(t, &t->pcache[owner]);
    }
    t->fcache.valid = false;
    extree_cache_forget(t);
    extree_alloc_destroy(t);
    extree_refs_destroy(t);
    memset(&t->space, 0, sizeof(t->space));
    extree_sm_init(t);
    t->space.host_limit = limit;
    if (t->snap.list) {
        g_array_free(t->snap.list, true);
        t->snap.list = NULL;
    }
    g_free(t->backing_file);
    g_free(t->backing_fmt);
    memset(t->trees, 0, sizeof(t->trees));
    t->snap.gen = 0;
    t->snap.table = t->snap.table_len = 0;
    t->snap.dirty = false;
    extree_bitmaps_free(t);
    t->broken = t->broken_nospace = false;
    t->stats.rollbacks++;
    /* what the dropped transaction held may have been acknowledged */
    t->changes_lost = true;

    ret = load_state(t, t->csb, &o);
    if (ret == 0 && limit && t->space.alloc_partial) {
        ret = extree_freetree_load_rest(t);
    }
    if (ret < 0) {
        t->broken = true;
    }
    t->seq++;
    extree_trace(t, EXTREE_TRACE_ROLLBACK, t->generation, 0, ret);
    return ret;
}

/*
 * extree_rollback() of a transaction that holds nothing but its caller's
 * failed operation, begun on a handle with nothing uncommitted (the caller
 * committed first: a snapshot operation, the VM state's punch after a
 * snapshot).  Nothing acknowledged is dropped, so extree_changes_lost()
 * stays as it was: a snapshot whose punch ran out of space made every
 * later flush fail until a reopen (issue 49).
 */
int extree_rollback_own(Extree *t)
{
    bool lost = t->changes_lost;
    int ret = extree_rollback(t);

    t->changes_lost = lost;
    return ret;
}

/*
 * After a commit: give the host file back what the commit freed.  Discard
 * the ranges that became free (old node locations included), and cut the
 * file at host_end when commit lowered it.  Nothing can allocate this space
 * before extree_commit() returns, so the discards cannot hit new data.
 * Best effort: a failure costs space, not data.
 */
static void give_back_space(Extree *t, GArray *freed)
{
    const ExtreeBackendOps *ops = t->be->ops;

    for (guint i = 0; ops->discard && i < freed->len; i++) {
        ExtreeAllocOp *r = &g_array_index(freed, ExtreeAllocOp, i);
        ops->discard(t->be->opaque, r->start, r->len);
    }
    if (t->space.trimmed && ops->truncate) {
        int64_t len = ops->get_length(t->be->opaque);
        if (len > (int64_t)t->host_end) {
            ops->truncate(t->be->opaque, t->host_end);
        }
    }
    t->space.trimmed = false;
}

void extree_discard_deferred(Extree *t)
{
    GArray *later;

    if (t->read_only || t->broken || !t->space.alloc_loaded ||
        extree_is_dirty(t)) {
        return;
    }
    later = g_array_new(false, false, sizeof(ExtreeAllocOp));
    extree_alloc_deferred(t, later);
    give_back_space(t, later);
    g_array_free(later, true);
}

/*
 * A node write failed with -ENOSPC.  If the backend ends before host_end,
 * it is of fixed size and its end was not known: its length is the limit
 * from now on (as if the caller had said so with
 * extree_set_host_limit()), and no retry can write there.  True then.
 * Otherwise the storage under a file that holds host_end ran out (a full
 * host file system, a thin volume): the commit keeps its dirty state and
 * a later one retries, once there is space again.
 */
static bool learn_host_limit(Extree *t)
{
    int64_t len = t->be->ops->get_length(t->be->opaque);

    if (len <= (int64_t)t->data_start || (uint64_t)len >= t->host_end) {
        return false;
    }
    if (!t->space.host_limit || (uint64_t)len < t->space.host_limit) {
        t->space.host_limit = len;
    }
    return true;
}

/*
 * Commit generation G + 1 (G = t->generation).  The order is the crash
 * safety argument: nothing reachable from a durable superblock is ever
 * overwritten, and a superblock is written only after everything it points
 * to is durable.
 */
int extree_commit(Extree *t)
{
    ExtreeSuper s;
    GArray *freed;
    int ret;

    /* 1. Nothing to do */
    if (!extree_is_dirty(t)) {
        return 0;
    }
    if (t->read_only) {
        return -EROFS;
    }
    if (t->broken || !t->space.alloc_loaded) {
        return t->broken && t->broken_nospace ? -ENOSPC : -EIO;
    }
    /* from here the data allocated so far may be mapped by a superblock */
    extree_alloc_data_fresh_end(t);
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 2, 0);

    /*
     * 2. The space map's pre-commit: the reference count and free-space
     *    trees take in this transaction's changes, and free space at the
     *    end of the file that state G does not use either leaves the data
     *    area (extree_sm_commit()).  A failure here leaves the trees
     *    half-synced: give up on them.
     */
    ret = extree_mark_log_commit_prepare(t);
    if (ret == 0) {
        ret = extree_bitmaps_prepare(t);
    }
    if (ret == 0) {
        ret = extree_sm_commit(&t->space);
    }
    if (ret < 0) {
        t->broken = true;
        t->broken_nospace = ret == -ENOSPC;
        goto fail;
    }

    /*
     * 3. Every dirty node to its new location (never part of G).  First
     *    the superblock G + 1 is built and checked as a reader would
     *    check it: if it is invalid (a count gone out of range because
     *    the one read was wrong), nothing is written and G stays.
     */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 3, 0);
    extree_sb_from_tree(t, &s);
    ret = extree_sb_check(t, &s);
    if (ret < 0) {
        t->broken = true;
        goto fail;
    }
    ret = extree_node_write_dirty(t);
    if (ret == 0 && t->snap.dirty && t->snap.table) {
        uint64_t len;
        uint8_t *buf = extree_snap_table_encode(t, &len);

        ret = t->be->ops->pwrite(t->be->opaque, t->snap.table, buf, len);
        g_free(buf);
    }
    if (ret == 0) {
        ret = extree_bitmaps_write(t);
    }
    if (ret == -ENOSPC && learn_host_limit(t)) {
        /*
         * A backend of fixed size whose end was not known (and that the
         * caller's growing did not find out) ends before host_end: its
         * end is known now, and the transaction can only be dropped
         * (extree_rollback())
         */
        t->broken = t->broken_nospace = true;
    }
    if (ret < 0) {
        goto fail;
    }

    /*
     * 4. Nodes, and guest data written before this commit, durable before
     *    a superblock points at them
     */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 4, 0);
    ret = t->be->ops->flush(t->be->opaque);
    if (ret < 0) {
        goto flush_failed;
    }

    /* 5. Superblock G + 1 into slot (G + 1) % 2; slot G % 2 keeps G */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 5, 0);
    ret = extree_sb_write_t(t, &s);
    if (ret < 0) {
        goto fail;
    }

    /* 6. G + 1 durable */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 6, 0);
    ret = t->be->ops->flush(t->be->opaque);
    if (ret < 0) {
        goto flush_failed;
    }

    /* 7. Only now may space freed in G + 1 be reused */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->trans_gen, 7, 0);
    freed = g_array_new(false, false, sizeof(ExtreeAllocOp));
    extree_sm_commit_done(&t->space, freed);
    extree_node_commit_done(t);
    extree_bitmaps_commit_done(t);
    extree_mark_log_commit_done(t);
    *t->csb = s;
    t->sb_host_end = s.host_end;
    t->generation = t->trans_gen;
    t->trans_gen++;
    t->super_dirty = false;
    t->snap.dirty = false;
    t->stats.commits++;

    /*
     * 8. Discard what G + 1 freed; truncate the file if host_end went
     *    down.  A crash before or during this loses nothing.
     */
    extree_trace(t, EXTREE_TRACE_COMMIT_STEP, t->generation, 8, 0);
    give_back_space(t, freed);
    g_array_free(freed, true);
    extree_trace(t, EXTREE_TRACE_COMMIT_DONE, t->generation, 0, 0);
    return 0;

flush_failed:
    /*
     * After a failed flush the host may have dropped the unflushed writes
     * (Linux marks the pages clean), so a retry could "succeed" without the
     * data being durable: no more commits or updates until reopen, like
     * file-posix after a failed fdatasync.
     */
    t->broken = true;
    t->broken_nospace = false;
fail:
    extree_trace(t, EXTREE_TRACE_COMMIT_DONE, t->trans_gen, 0, ret);
    return ret;
}

void extree_set_corrupt_handler(Extree *t, ExtreeCorruptFn *fn, void *opaque)
{
    t->corrupt_fn = fn;
    t->corrupt_opaque = opaque;
}

void extree_set_trace(Extree *t, ExtreeTraceFn *fn, void *opaque)
{
    t->trace_fn = fn;
    t->trace_opaque = opaque;
}

const char *extree_last_error(const Extree *t)
{
    return t->last_error;
}

bool extree_corruption_pending(const Extree *t)
{
    return t->pending.msg != NULL;
}

bool extree_take_corruption(Extree *t, bool writable, ExtreeCorruption *c)
{
    if (!t->pending.msg) {
        return false;
    }
    *c = t->pending;
    c->fatal = writable && !t->read_only &&
               !(t->incompat & EXTREE_INCOMPAT_CORRUPT);
    t->pending.msg = NULL;
    return true;
}

void extree_drop_corruption(Extree *t)
{
    g_free(t->pending.msg);
    t->pending.msg = NULL;
}

const char *extree_open_warning(const Extree *t)
{
    return t->open_warning;
}

/* free_bytes of the last committed superblock */
uint64_t extree_sb_free_bytes(const Extree *t)
{
    return t->csb->free_bytes;
}

int extree_clear_corrupt(Extree *t)
{
    int ret;

    if (t->read_only) {
        return -EROFS;
    }
    if (!(t->incompat & EXTREE_INCOMPAT_CORRUPT)) {
        return 0;
    }
    if (t->broken || !t->space.alloc_loaded || extree_is_dirty(t) ||
        t->chk.clean_gen != t->generation) {
        return -EINVAL;
    }
    t->incompat &= ~EXTREE_INCOMPAT_CORRUPT;
    t->super_dirty = true;
    ret = extree_commit(t);
    if (ret < 0) {
        t->incompat |= EXTREE_INCOMPAT_CORRUPT;
    }
    return ret;
}

uint64_t extree_virtual_size(const Extree *t)
{
    return t->virtual_size;
}

uint32_t extree_block_size(const Extree *t)
{
    return t->block_size;
}

uint32_t extree_node_size(const Extree *t)
{
    return t->node_size;
}

uint64_t extree_generation(const Extree *t)
{
    return t->generation;
}

uint64_t extree_extent_count(const Extree *t)
{
    return t->trees[EXTREE_TREE_EXTENT].nitems;
}

unsigned extree_depth(const Extree *t)
{
    return t->trees[EXTREE_TREE_EXTENT].level + 1;
}

/*
 * Growing stops at @limit: nodes can no longer take new space at the end
 * of the file while unseen free space is left, so the free tree is read
 * whole now.  A failure leaves the handle without an allocator (updates
 * fail with -EIO).
 */
void extree_set_host_limit(Extree *t, uint64_t limit)
{
    t->space.host_limit = limit;
    if (limit && t->space.alloc_partial) {
        extree_freetree_load_rest(t);
    }
}

uint64_t extree_grow_bound_nodes(Extree *t, uint64_t contig)
{
    uint64_t need = extree_alloc_nodes_need(t, contig);

    if (extree_alloc_nodes_fit(t, contig)) {
        return t->host_end;
    }
    /* a read error leaves the bound where the known ranges put it */
    if (!extree_alloc_fits(t, need) && t->space.alloc_partial) {
        extree_freetree_load_fit(t, need);
    }
    /*
     * One range that holds a reserve is not enough while the free space
     * is short of the nodes an update and its commit may take, its
     * bitmap chunks included: a device's end must be found before the
     * update (whose guard then counts them), not by the commit
     */
    return t->host_end + MAX(extree_alloc_fits(t, need) ? 0 : need,
                             extree_alloc_nodes_short(t, contig));
}

uint64_t extree_free_bytes(const Extree *t)
{
    return t->space.alloc_loaded ? extree_alloc_free_bytes(t) :
                                   t->csb->free_bytes;
}

uint64_t extree_host_end(const Extree *t)
{
    return t->host_end;
}

uint64_t extree_data_start(const Extree *t)
{
    return t->data_start;
}

uint64_t extree_incompat_features(const Extree *t)
{
    return t->incompat;
}

uint32_t extree_compression_type(const Extree *t)
{
    return t->compression_type;
}

uint32_t extree_crypt_method(const Extree *t)
{
    return t->crypt_method;
}

uint64_t extree_crypt_header_offset(const Extree *t)
{
    return t->crypt_header_offset;
}

uint64_t extree_crypt_header_length(const Extree *t)
{
    return t->crypt_header_length;
}

const char *extree_backing_file(const Extree *t)
{
    return t->backing_file;
}

const char *extree_backing_fmt(const Extree *t)
{
    return t->backing_fmt;
}

int extree_set_backing(Extree *t, const char *file, const char *fmt)
{
    char *msg = NULL;
    int ret;

    ret = extree_check_writable(t);
    t->bm.unlogged = true;      /* no map record holds it */
    if (ret < 0) {
        return ret;
    }
    ret = extree_check_backing(file, fmt, &msg);
    g_free(msg);
    if (ret < 0) {
        return ret;
    }
    g_free(t->backing_file);
    g_free(t->backing_fmt);
    t->backing_file = file && *file ? g_strdup(file) : NULL;
    t->backing_fmt = fmt && *fmt ? g_strdup(fmt) : NULL;
    t->super_dirty = true;
    return 0;
}

static int update_done(Extree *t, int ret);

/* Shrinking punches the cut-off range first: O(extents removed) */
int extree_set_virtual_size(Extree *t, uint64_t size)
{
    uint64_t new_end = EXTREE_ROUND_UP(size, t->block_size);
    uint64_t old_end = EXTREE_ROUND_UP(t->virtual_size, t->block_size);
    uint64_t old_size;
    int ret = extree_check_writable(t);

    if (ret == 0) {
        ret = extree_probe_end(t);
    }
    if (ret < 0) {
        return ret;
    }
    if (size % 512 || size > (extree_has_refs(t) ?
                              EXTREE_SNAP_MAX_VIRTUAL_SIZE :
                              EXTREE_MAX_VIRTUAL_SIZE)) {
        return -EINVAL;
    }
    ret = extree_bitmaps_resize_ok(t, size);
    if (ret < 0) {
        return ret;
    }
    if (new_end < old_end) {
        ExtreeItem none = { 0 };
        ret = extree_extent_update(t, &none, new_end, old_end - new_end);
        if (ret < 0) {
            return ret;
        }
    } else if (new_end > old_end) {
        /*
         * Nothing may lie in the range growing brings in: the path to its
         * start is validated against the old size, and any key in the
         * range would be on it (the smallest such key is either a key of
         * a node on the path or inside the child the path takes).  One
         * descent.
         */
        ExtreeTree *et = &t->trees[EXTREE_TREE_EXTENT];
        ExtreeItem prev, next;
        bool hp, hn;

        ret = extree_bt_find(t, et, old_end, &prev, &hp, &next, &hn);
        if (ret < 0) {
            return ret;
        }
        if ((hp && prev.key + prev.length > old_end) ||
            (hn && next.key < EXTREE_VMSTATE_BASE)) {
            return extree_corrupt(t, et->root, "corrupt extent tree: item "
                                  "beyond the virtual size 0x%" PRIx64,
                                  old_end);
        }
    }
    ret = extree_bitmaps_resize(t, size);
    if (ret < 0) {
        return ret;
    }
    old_size = t->virtual_size;
    t->virtual_size = size;
    t->trees[EXTREE_TREE_EXTENT].data_end = new_end;
    t->super_dirty = true;
    /*
     * What grows in reads as zeroes, where it may have held data before a
     * shrink (and the rest of the old last block is zeroed): changed, so
     * marked, the granule across the old end included (spec: Persistent
     * dirty bitmaps, 1)
     */
    if (size > old_size) {
        extree_bitmaps_mark(t, old_size, size - old_size);
    }
    return update_done(t, 0);
}

/* ---- updates: commit when the dirty metadata asks for it ---- */

/*
 * Too much dirty metadata, or on a backend of fixed size too little room
 * left for the nodes of the commit and of the next update: the space the
 * transaction freed becomes reusable by committing (issue 33).  Or many
 * writes went to new space only because the bitmap marks they need are
 * not committed yet: later ones to the same granules go in place once
 * they are.
 */
bool extree_commit_wanted(const Extree *t)
{
    return t->nc.ndirty > t->nc.dirty_limit || extree_alloc_room_short(t) ||
           t->bm.held >= EXTREE_BITMAP_COMMIT_HELD;
}

/*
 * After an update, which is a safe point for the core: commit if the
 * dirty metadata asks for it, unless the caller does that itself
 */
static int update_done(Extree *t, int ret)
{
    if (!t->bm.logging) {
        /* no map record holds this change: a flush commits */
        t->bm.unlogged = true;
    }
    if (ret < 0 || t->commit_by_caller || !extree_commit_wanted(t)) {
        return ret;
    }
    t->stats.forced_commits++;
    return extree_commit(t);
}

int extree_map_data(Extree *t, uint64_t guest, uint64_t bytes, uint64_t host)
{
    ExtreeItem it = { guest, bytes, host, EXTREE_ITEM_DATA };

    return update_done(t, extree_extent_update(t, &it, guest, bytes));
}

int extree_map_data_logged(Extree *t, uint64_t guest, uint64_t bytes,
                           uint64_t host, uint32_t csum)
{
    ExtreeItem it = { guest, bytes, host, EXTREE_ITEM_DATA };
    int ret;

    if (!extree_map_log_usable(t) || bytes > EXTREE_MAP_LOG_MAX_ENTRY) {
        return extree_map_data(t, guest, bytes, host);
    }
    t->bm.logging = true;
    ret = extree_extent_update(t, &it, guest, bytes);
    if (ret == 0) {
        extree_map_log_add(t, guest, bytes, host, csum);
    } else {
        t->bm.unlogged = true;
    }
    ret = update_done(t, ret);
    t->bm.logging = false;
    return ret;
}

int extree_map_compressed(Extree *t, uint64_t guest, uint64_t bytes,
                          uint64_t host, uint32_t payload_len, uint32_t alg)
{
    ExtreeItem it = { guest, bytes, host, EXTREE_ITEM_COMPRESSED,
                      payload_len | (alg << EXTREE_COMPRESSED_ALG_SHIFT) };
    bool first = !(t->incompat & EXTREE_INCOMPAT_COMPRESSED);
    int ret;

    if (payload_len > EXTREE_COMPRESSED_LEN_MASK || alg > UINT8_MAX) {
        return -EINVAL;
    }
    /*
     * Set before the update (a leaf holding the item, read back, must
     * validate), in the commit that writes the first one; a refused
     * update leaves the image as it was
     */
    t->incompat |= EXTREE_INCOMPAT_COMPRESSED;
    ret = extree_extent_update(t, &it, guest, bytes);
    if (first && ret < 0 && !t->broken) {
        t->incompat &= ~EXTREE_INCOMPAT_COMPRESSED;
    } else if (first) {
        t->super_dirty = true;
    }
    return update_done(t, ret);
}

int extree_map_data_pieces(Extree *t, uint64_t guest, const uint64_t *host,
                           const uint64_t *len, unsigned n)
{
    return update_done(t, extree_extent_map_pieces(t, guest, host, len, n));
}

/*
 * A ZERO or punch range: on a backend of fixed size it may stop between
 * two leaves with -ENOSPC (extree_extent_update()).  Unless the caller
 * commits itself, commit what was done and go on with the same call: a
 * call that does nothing leaves the transaction clean after such a
 * commit, so the loop ends (an update too large for the room left
 * commits in pieces).
 */
static int update_range(Extree *t, const ExtreeItem *it, uint64_t guest,
                        uint64_t bytes)
{
    int ret;

    while ((ret = extree_extent_update(t, it, guest, bytes)) == -ENOSPC &&
           !t->commit_by_caller && extree_is_dirty(t)) {
        t->stats.forced_commits++;
        if (extree_commit(t) < 0) {
            break;
        }
    }
    return update_done(t, ret);
}

int extree_set_zero(Extree *t, uint64_t guest, uint64_t bytes)
{
    ExtreeItem it = { guest, bytes, 0, EXTREE_ITEM_ZERO };

    return update_range(t, &it, guest, bytes);
}

int extree_punch(Extree *t, uint64_t guest, uint64_t bytes)
{
    ExtreeItem it = { 0 };

    return update_range(t, &it, guest, bytes);
}

void extree_stats(const Extree *t, ExtreeStats *st)
{
    *st = t->stats;
    st->cached_nodes = t->nc.ncached;
    st->dirty_nodes = t->nc.ndirty;
    st->free_tree_partial = t->space.alloc_partial;
}

/*
 * Bound for qemu-img measure: both trees at half-full nodes, twice (the
 * copies of one transaction coexist with the committed nodes), plus the
 * superblocks, plus what the allocator holds back from data on a backend
 * of fixed size (extree_alloc_headroom()), so that an image converted onto
 * a device of the measured size fits.
 */
uint64_t extree_metadata_bound(uint64_t virtual_size, uint32_t block_size,
                               uint32_t node_size, uint64_t nr_extents)
{
    uint32_t bs = block_size ? block_size : EXTREE_DEFAULT_BLOCK_SIZE;
    uint32_t ns = node_size ? node_size : EXTREE_DEFAULT_NODE_SIZE;
    uint64_t per_leaf = EXTREE_LEAF_CAPACITY(ns) / 2;
    uint64_t per_ptr = EXTREE_INTERIOR_CAPACITY(ns) / 2;
    uint64_t items = nr_extents ? nr_extents
                                : (virtual_size + bs - 1) / bs + 1;
    uint64_t nodes = 0;

    /* extent tree plus a free tree of at most as many items */
    for (int tree = 0; tree < 2; tree++) {
        uint64_t level = (items + per_leaf - 1) / per_leaf;
        nodes += MAX(level, 1);
        while (level > 1) {
            level = (level + per_ptr - 1) / per_ptr;
            nodes += level;
        }
    }
    return extree_data_start_for(bs, 0) + 2 * nodes * ns +
           extree_alloc_headroom(ns);
}
