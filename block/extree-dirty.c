/*
 * extree: persistent dirty bitmaps between QEMU's BdrvDirtyBitmaps and the
 * core's
 *
 * QEMU keeps the bits users see, exports over NBD and backs up from in its
 * BdrvDirtyBitmaps, and changes them itself: writes mark them when they
 * complete, QMP clears, merges, enables and disables them, backup jobs
 * give them successors.  The core keeps the committed bits and marks
 * every change of the mapping in the transaction that makes it
 * (extree_bitmaps_in_place() keeps writes in place to granules it has
 * marked already).  The two meet at every commit: xt_bitmaps_sync() gives
 * the core QEMU's bits, with the commit gate closed, so no write in place
 * is between its lookup and its completion and every completed one is in
 * QEMU's bits.  At open, xt_bitmaps_load() makes QEMU's bitmaps from the
 * core's.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "block/dirty-bitmap.h"
#include "qapi/error.h"
#include "qemu/error-report.h"
#include "trace/trace-block_extree.h"
#include "extree-qemu.h"

/* QEMU's bits of @bm, in a buffer of at least @core_bytes */
static uint8_t *xt_serialize(BdrvDirtyBitmap *bm, uint64_t core_bytes)
{
    uint64_t size = bdrv_dirty_bitmap_size(bm);
    uint64_t len = bdrv_dirty_bitmap_serialization_size(bm, 0, size);
    uint8_t *buf = g_malloc0(MAX(len, core_bytes));

    bdrv_dirty_bitmap_lock(bm);
    bdrv_dirty_bitmap_serialize_part(bm, buf, 0, size);
    bdrv_dirty_bitmap_unlock(bm);
    return buf;
}

/*
 * bdrv_dirty_bitmap_change_gen() of bitmap @name when the core last took
 * its bits (s->bitmap_gens), 0 if never
 */
static uint64_t xt_synced_gen(BDRVExtreeState *s, const char *name)
{
    uint64_t *gen = s->bitmap_gens ?
                    g_hash_table_lookup(s->bitmap_gens, name) : NULL;

    return gen ? *gen : 0;
}

static void xt_set_synced_gen(BDRVExtreeState *s, const char *name,
                              uint64_t gen)
{
    if (!s->bitmap_gens) {
        s->bitmap_gens = g_hash_table_new_full(g_str_hash, g_str_equal,
                                               g_free, g_free);
    }
    g_hash_table_insert(s->bitmap_gens, g_strdup(name),
                        g_memdup2(&gen, sizeof(gen)));
}

/*
 * Bitmaps the core does not take from QEMU: not persistent, being
 * removed, inconsistent, or of another size than the disk
 */
static bool xt_sync_skips(BDRVExtreeState *s, BdrvDirtyBitmap *bm,
                          uint64_t vsize)
{
    const char *name = bdrv_dirty_bitmap_name(bm);

    return !name || !bdrv_dirty_bitmap_get_persistence(bm) ||
           (s->bitmap_removing && !strcmp(name, s->bitmap_removing)) ||
           bdrv_dirty_bitmap_inconsistent(bm) ||
           bdrv_dirty_bitmap_size(bm) != vsize;
}

bool xt_bitmaps_any(BDRVExtreeState *s)
{
    BdrvDirtyBitmap *bm;

    if (s->t && extree_bitmap_count(s->t)) {
        return true;
    }
    FOR_EACH_DIRTY_BITMAP(s->bs, bm) {
        if (bdrv_dirty_bitmap_get_persistence(bm)) {
            return true;
        }
    }
    return false;
}

/*
 * Give the core QEMU's persistent bitmaps before a commit: new ones are
 * added, the bits of each are QEMU's plus the core's marks of changes
 * whose requests may not have returned yet (kept since the node last
 * drained: QEMU marks a request when it returns, which may be after the
 * commit that stored it: an emulated FUA flush, a request in pieces).
 * Unless @full, a bitmap QEMU changed only by guest writes since the last
 * sync is skipped (its change counter, patches/qemu/0012, says so).  A
 * bitmap with a successor (a backup job runs) is frozen in QEMU and its
 * successor takes the changes: the core keeps its own bits and marks, so
 * a crash during the job loses nothing the next backup needs.  Bitmaps
 * QEMU does not store (skip_store, migration) are left as they are; the
 * core drops a bitmap only when told (xt_bitmaps_remove()).
 * Called with s->lock held and no data request between lookup and end.
 */
void xt_bitmaps_sync(BDRVExtreeState *s, bool full)
{
    BdrvDirtyBitmap *bm;
    uint64_t vsize;

    if (!s->t || s->core_read_only || s->inactive) {
        return;
    }
    full |= s->bitmaps_resync;
    s->bitmaps_resync = false;
    vsize = extree_virtual_size(s->t);
    if (s->bitmap_removing &&
        !bdrv_find_dirty_bitmap(s->bs, s->bitmap_removing)) {
        g_free(s->bitmap_removing);
        s->bitmap_removing = NULL;
    }
    FOR_EACH_DIRTY_BITMAP(s->bs, bm) {
        const char *name = bdrv_dirty_bitmap_name(bm);
        ExtreeBitmapInfo info;
        bool keep = false, enabled;
        uint8_t *buf;
        int i, ret;

        if (xt_sync_skips(s, bm, vsize)) {
            continue;
        }
        enabled = bdrv_dirty_bitmap_enabled(bm);
        i = extree_bitmap_find(s->t, name);
        if (i < 0) {
            ret = extree_bitmap_add(s->t, name,
                                    bdrv_dirty_bitmap_granularity(bm),
                                    enabled);
            if (ret < 0) {
                error_report("extree: %s: could not store bitmap '%s': %s",
                             bdrv_get_device_or_node_name(s->bs), name,
                             strerror(-ret));
                continue;
            }
            i = extree_bitmap_find(s->t, name);
        }
        extree_bitmap_info(s->t, i, &info);
        if (info.granularity != bdrv_dirty_bitmap_granularity(bm)) {
            continue;
        }
        if (bdrv_dirty_bitmap_has_successor(bm)) {
            keep = true;
            enabled = info.enabled;
        } else if (!full && xt_synced_gen(s, name) ==
                   bdrv_dirty_bitmap_change_gen(bm)) {
            /*
             * Nothing but guest writes since the last sync: the core has
             * every one of them marked (patches/qemu/0012)
             */
            continue;
        }
        buf = xt_serialize(bm, extree_bitmap_bytes(s->t, i));
        ret = extree_bitmap_sync(s->t, i, buf, enabled, keep);
        g_free(buf);
        if (ret == 0) {
            xt_set_synced_gen(s, name, bdrv_dirty_bitmap_change_gen(bm));
        }
        trace_extree_bitmap_sync(s, name, enabled, keep, ret);
    }
}

/*
 * Would xt_bitmaps_sync(s, false) change anything?  Only guest writes since
 * the last sync (the core marked them itself) and no new bitmap: false.
 * Called with s->lock held.
 */
bool xt_bitmaps_sync_needed(BDRVExtreeState *s)
{
    BdrvDirtyBitmap *bm;
    uint64_t vsize;

    if (!s->t || s->core_read_only || s->inactive) {
        return false;
    }
    if (s->bitmaps_resync) {
        return true;
    }
    vsize = extree_virtual_size(s->t);
    FOR_EACH_DIRTY_BITMAP(s->bs, bm) {
        const char *name = bdrv_dirty_bitmap_name(bm);

        if (xt_sync_skips(s, bm, vsize)) {
            continue;
        }
        if (extree_bitmap_find(s->t, name) < 0 ||
            bdrv_dirty_bitmap_has_successor(bm) ||
            xt_synced_gen(s, name) != bdrv_dirty_bitmap_change_gen(bm)) {
            return true;
        }
    }
    return false;
}

/*
 * Make QEMU's bitmaps from the core's, at open and after invalidation: a
 * bitmap QEMU has already (migrated to this side) stays as it is, and the
 * next commit stores it.  Read-only images get read-only bitmaps.
 */
int xt_bitmaps_load(BDRVExtreeState *s, Error **errp)
{
    BlockDriverState *bs = s->bs;
    unsigned n = extree_bitmap_count(s->t);

    for (unsigned i = 0; i < n; i++) {
        ExtreeBitmapInfo info;
        BdrvDirtyBitmap *bm;
        uint64_t size = extree_virtual_size(s->t);
        uint8_t *buf;
        uint64_t len;

        extree_bitmap_info(s->t, i, &info);
        if (bdrv_find_dirty_bitmap(bs, info.name)) {
            continue;
        }
        bm = bdrv_create_dirty_bitmap(bs, info.granularity, info.name, errp);
        if (!bm) {
            error_prepend(errp, "Could not load bitmap '%s': ", info.name);
            return -EINVAL;
        }
        len = bdrv_dirty_bitmap_serialization_size(bm, 0, size);
        buf = g_malloc0(MAX(len, extree_bitmap_bytes(s->t, i)));
        extree_bitmap_read(s->t, i, buf);
        bdrv_dirty_bitmap_deserialize_part(bm, buf, 0, size, true);
        g_free(buf);
        bdrv_dirty_bitmap_set_persistence(bm, true);
        if (!info.enabled) {
            bdrv_disable_dirty_bitmap(bm);
        }
        if (s->core_read_only) {
            bdrv_dirty_bitmap_set_readonly(bm, true);
        }
        xt_set_synced_gen(s, info.name, bdrv_dirty_bitmap_change_gen(bm));
        trace_extree_bitmap_load(s, info.name, info.granularity,
                                 info.enabled, info.dirty_granules);
    }
    return 0;
}

/* Inactivation: the bitmaps are committed, the image's next user has them */
void xt_bitmaps_release(BDRVExtreeState *s)
{
    BdrvDirtyBitmap *bm, *next;

    bm = bdrv_dirty_bitmap_first(s->bs);
    while (bm) {
        next = bdrv_dirty_bitmap_next(bm);
        if (bdrv_dirty_bitmap_get_persistence(bm) &&
            !bdrv_dirty_bitmap_has_successor(bm)) {
            bdrv_release_dirty_bitmap(bm);
        }
        bm = next;
    }
}

/* Reopen: persistent bitmaps are read-only with the image */
void xt_bitmaps_set_readonly(BDRVExtreeState *s, bool ro)
{
    BdrvDirtyBitmap *bm;

    FOR_EACH_DIRTY_BITMAP(s->bs, bm) {
        if (bdrv_dirty_bitmap_get_persistence(bm)) {
            bdrv_dirty_bitmap_set_readonly(bm, ro);
        }
    }
}

/*
 * .bdrv_co_can_store_new_dirty_bitmap: what the core would refuse, with
 * qcow2's wording around it
 */
bool xt_bitmaps_can_store(BDRVExtreeState *s, const char *name,
                          uint32_t granularity, Error **errp)
{
    char *why = NULL;
    int ret;

    if (bdrv_find_dirty_bitmap(s->bs, name)) {
        error_setg(errp, "Bitmap already exists: %s", name);
        return false;
    }
    /*
     * A bitmap of this name removed before is gone from QEMU too: the new
     * one must be stored (a sync would only forget the name once QEMU no
     * longer has it, which a re-add right away prevents)
     */
    if (s->bitmap_removing && !strcmp(s->bitmap_removing, name)) {
        g_free(s->bitmap_removing);
        s->bitmap_removing = NULL;
    }
    ret = extree_bitmap_check_new(s->t, name, granularity, &why);
    if (ret < 0) {
        error_setg(errp, "Can't make bitmap '%s' persistent in '%s': %s",
                   name, bdrv_get_device_or_node_name(s->bs), why);
        g_free(why);
        return false;
    }
    return true;
}
