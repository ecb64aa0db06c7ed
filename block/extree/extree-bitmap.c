/*
 * extree core: persistent dirty bitmaps (EXTREE_INCOMPAT_BITMAPS)
 *
 * A bitmap says which granules of the virtual disk changed since it was
 * created or last cleared.  Its bits live in chunks of one block each, and
 * a directory names the bitmaps and lists their chunks; both are written
 * copy-on-write at commit, in the transaction whose data changes they
 * mark, so a bitmap is exact after any crash (spec: Persistent dirty
 * bitmaps).  What may change data without a commit is a write in place:
 * extree_bitmaps_in_place() allows it only where every enabled bitmap has
 * the granules set in the committed state already, as dm-era marks before
 * it writes.  Everything else changes the mapping, and
 * extree_extent_update() marks the range in the same transaction.
 *
 * In memory each bitmap is its bits, as they will be committed, and a
 * copy of the committed ones (for the in-place rule); both are arrays of
 * bytes in the on-disk order, so loading and writing a chunk is a copy.
 *
 * On disk (the commit and the open) in extree-bitmap-io.c.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"
#include "extree-bitmap-int.h"


uint64_t extree_bm_ngranules(uint64_t size, uint32_t gran_bits)
{
    return (size + ((uint64_t)1 << gran_bits) - 1) >> gran_bits;
}

uint64_t extree_bm_nchunks_for(uint64_t ngran, uint32_t block_size)
{
    uint64_t per = (uint64_t)block_size * 8;

    return (ngran + per - 1) / per;
}

/* Would a bitmap of @nchunks chunks take more memory than we allow? */
bool extree_bm_too_big(const Extree *t, uint64_t nchunks)
{
    return nchunks > t->bm.max_bytes / t->block_size;
}

uint64_t extree_bm_entry_bytes(size_t name_len, uint64_t nchunks)
{
    return sizeof(ExtreeDiskBitmapEntry) + EXTREE_ROUND_UP(name_len, 8) +
           nchunks * sizeof(ExtreeDiskBitmapChunk);
}

/* Directory length with @extra more bytes of entries, sizes at @size */
uint64_t extree_bm_dir_bytes(Extree *t, uint64_t size, uint64_t extra)
{
    uint64_t len = sizeof(ExtreeDiskBitmapHeader) + extra;

    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
        uint64_t ngran = extree_bm_ngranules(size, bm->gran_bits);

        len += extree_bm_entry_bytes(strlen(bm->name),
                                     extree_bm_nchunks_for(ngran,
                                                           t->block_size));
    }
    return len;
}

void extree_bm_free(ExtreeBitmap *bm)
{
    g_free(bm->name);
    for (uint64_t c = 0; bm->cchunk && c < bm->nchunks; c++) {
        g_free(bm->cchunk[c]);
    }
    g_free(bm->bits);
    g_free(bm->cchunk);
    g_free(bm->chunk_off);
    g_free(bm->chunk_csum);
    g_free(bm->chunk_state);
    g_free(bm);
}

ExtreeBitmap *extree_bm_new(Extree *t, const char *name, uint32_t gran_bits,
                            bool enabled)
{
    ExtreeBitmap *bm = g_new0(ExtreeBitmap, 1);

    bm->name = g_strdup(name);
    bm->gran_bits = gran_bits;
    bm->enabled = enabled;
    bm->ngran = extree_bm_ngranules(t->virtual_size, gran_bits);
    bm->nchunks = extree_bm_nchunks_for(bm->ngran, t->block_size);
    bm->bits = g_malloc0((size_t)bm->nchunks * t->block_size);
    bm->cchunk = g_new0(uint8_t *, bm->nchunks);
    bm->chunk_off = g_new0(uint64_t, bm->nchunks);
    bm->chunk_csum = g_new0(uint32_t, bm->nchunks);
    bm->chunk_state = g_malloc0(bm->nchunks);
    return bm;
}

bool extree_bm_chunk_zero(Extree *t, const ExtreeBitmap *bm, uint64_t c)
{
    return extree_all_zero(bm->bits + c * t->block_size, t->block_size);
}

/*
 * Bits set in @x.  QEMU is not built for a CPU with popcnt, so the
 * builtin is a libgcc call, and GCC turns this very expression into that
 * call too: extree_bm_popcount() below uses the instruction where the CPU
 * has it
 */
static inline unsigned pc64(uint64_t x)
{
    x -= (x >> 1) & 0x5555555555555555ULL;
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (x * 0x0101010101010101ULL) >> 56;
}

static inline uint64_t word_at(const uint8_t *p, size_t i)
{
    uint64_t w;

    memcpy(&w, p + 8 * i, 8);
    return w;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define EXTREE_POPCNT_HW 1

/* Every bitmap is counted at open: 128 KiB of bits per 64 GiB at 64 KiB */
__attribute__((target("popcnt")))
static uint64_t popcount_words_hw(const uint8_t *p, size_t words)
{
    uint64_t n = 0;

    for (size_t i = 0; i < words; i++) {
        n += __builtin_popcountll(word_at(p, i));
    }
    return n;
}
#endif

/* See extree-int.h */
uint64_t extree_popcount(const uint8_t *p, size_t len, bool software)
{
    size_t words = len / 8;
    uint64_t n = 0;

#ifdef EXTREE_POPCNT_HW
    if (!software && __builtin_cpu_supports("popcnt")) {
        n = popcount_words_hw(p, words);
    } else
#endif
    {
        for (size_t i = 0; i < words; i++) {
            n += pc64(word_at(p, i));
        }
    }
    for (size_t i = words * 8; i < len; i++) {
        n += pc64(p[i]);
    }
    return n;
}

uint64_t extree_bm_popcount(const uint8_t *p, size_t len)
{
    return extree_popcount(p, len, false);
}

/* Every granule of [g0, g1) set in @bits? */
static bool all_set(const uint8_t *bits, uint64_t g0, uint64_t g1)
{
    while (g0 < g1 && (g0 & 7)) {
        if (!(bits[g0 >> 3] & (1 << (g0 & 7)))) {
            return false;
        }
        g0++;
    }
    while (g0 + 8 <= g1) {
        if (bits[g0 >> 3] != 0xff) {
            return false;
        }
        g0 += 8;
    }
    while (g0 < g1) {
        if (!(bits[g0 >> 3] & (1 << (g0 & 7)))) {
            return false;
        }
        g0++;
    }
    return true;
}

/*
 * Chunk @c of @bm is about to change in memory: the first change since
 * the last commit keeps its committed copy
 */
static void chunk_touch(Extree *t, ExtreeBitmap *bm, uint64_t c)
{
    if (bm->chunk_state[c] == CHUNK_CLEAN) {
        bm->cchunk[c] = g_memdup2(bm->bits + c * t->block_size,
                                  t->block_size);
        bm->chunk_state[c] = CHUNK_CHANGED;
        t->bm.chunks_changed++;
    }
}

/* Nodes' worth of space a directory of @len bytes takes at a commit */
static uint64_t dir_nodes(Extree *t, uint64_t len)
{
    len = EXTREE_ROUND_UP(len, t->block_size);
    return (len + t->node_size - 1) / t->node_size + 1;
}

/*
 * Tell the allocator what the next commit takes for the bitmaps, so that
 * updates stop (-ENOSPC) before a commit could run out of room on storage
 * of fixed size: a block for each changed chunk (counted as a node: it
 * may take a free node-sized range) and the directory, which moves whole;
 * and what one update's marks may add to that at most, for the grow
 * bounds (extree_grow_bound()).  O(bitmaps).
 */
void extree_bitmaps_commit_space(Extree *t)
{
    uint64_t dir = 0, all = 0;

    if (t->bm.list && t->bm.list->len) {
        dir = dir_nodes(t, extree_bm_dir_bytes(t, t->virtual_size, 0));
    }
    /* what one update's marks may add: every chunk, O(bitmaps) */
    for (guint i = 0; t->bm.enabled && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        all += bm->enabled ? bm->nchunks : 0;
    }
    extree_alloc_commit_extra(t, t->bm.chunks_changed +
                              (t->bm.dirty ? dir : 0),
                              all + (all && !t->bm.dirty ? dir : 0));
}

/*
 * What a change of @chunks more chunks, or of the directory alone (@dir),
 * adds to that, in nodes: the chunks, and the directory if nothing of the
 * bitmaps changed yet
 */
static uint64_t more_space(Extree *t, uint64_t chunks, bool dir)
{
    if (!(chunks || dir) || t->bm.dirty) {
        return chunks;
    }
    return chunks + dir_nodes(t, extree_bm_dir_bytes(t, t->virtual_size, 0));
}

/*
 * What marking guest [guest, + bytes) (extree_bitmaps_mark()) adds to the
 * next commit's space, in nodes: a chunk of every enabled bitmap whose
 * granules in the range are not all set, unless this transaction changed
 * it already, and the directory.  An update asks the guard for it before
 * it begins (extree_alloc_update_fits()): one update after a clear
 * changes a chunk in every bitmap, 63 of them with 63 bitmaps, more than
 * the guard's headroom for one update, and its commit ran out of space.
 * O(bitmaps + granules).
 */
uint64_t extree_bitmaps_mark_space(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t end = MIN(guest + bytes, t->virtual_size);
    uint64_t per = (uint64_t)t->block_size * 8, n = 0;

    for (guint i = 0; t->bm.enabled && guest < end && i < t->bm.list->len;
         i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
        uint64_t g0 = guest >> bm->gran_bits;
        uint64_t g1 = extree_bm_ngranules(end, bm->gran_bits);

        while (bm->enabled && g0 < g1) {
            uint64_t c = g0 / per, e = MIN(g1, (c + 1) * per);

            n += bm->chunk_state[c] == CHUNK_CLEAN &&
                 !all_set(bm->bits, g0, e);
            g0 = e;
        }
    }
    return more_space(t, n, false);
}

/* Chunk @c as committed */
static const uint8_t *chunk_committed(Extree *t, const ExtreeBitmap *bm,
                                      uint64_t c)
{
    return bm->cchunk[c] ? bm->cchunk[c] : bm->bits + c * t->block_size;
}

/* Does chunk @c differ from its committed copy? */
bool extree_bm_chunk_differs(Extree *t, const ExtreeBitmap *bm, uint64_t c)
{
    return bm->cchunk[c] && memcmp(bm->cchunk[c], bm->bits +
                                   c * t->block_size, t->block_size);
}

/* Every granule of [g0, g1) set in @bm's committed bits? */
static bool all_set_committed(Extree *t, const ExtreeBitmap *bm,
                              uint64_t g0, uint64_t g1)
{
    uint64_t per = (uint64_t)t->block_size * 8;

    while (g0 < g1) {
        uint64_t c = g0 / per, end = MIN(g1, (c + 1) * per);

        if (!all_set(chunk_committed(t, bm, c), g0 - c * per,
                     end - c * per)) {
            return false;
        }
        g0 = end;
    }
    return true;
}

/* Set [g0, g1) in @bm's bits; the chunks that changed are marked */
static bool set_range(Extree *t, ExtreeBitmap *bm, uint64_t g0, uint64_t g1)
{
    uint64_t per = (uint64_t)t->block_size * 8;
    bool changed = false;

    while (g0 < g1) {
        uint64_t c = g0 / per, end = MIN(g1, (c + 1) * per), g = g0;
        uint64_t added = 0;

        if (all_set(bm->bits, g0, end)) {
            g0 = end;
            continue;
        }
        chunk_touch(t, bm, c);
        while (g < end) {
            uint8_t *b = &bm->bits[g >> 3];
            unsigned lo = g & 7, n = MIN(8 - lo, end - g);
            uint8_t mask = ((1u << n) - 1) << lo;

            added += pc64(mask & ~*b);
            *b |= mask;
            g += n;
        }
        bm->count += added;
        changed = true;
        g0 = end;
    }
    return changed;
}

/* Chunk @c of @bm loses its block (freed at commit), if it has one */
int extree_bm_chunk_release(Extree *t, ExtreeBitmap *bm, uint64_t c)
{
    int ret = 0;

    if (bm->chunk_off[c]) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, bm->chunk_off[c],
                                 t->block_size, false);
        bm->chunk_off[c] = 0;
        bm->chunk_csum[c] = 0;
    }
    return ret;
}

void extree_bm_changed(Extree *t)
{
    t->bm.dirty = true;
    t->super_dirty = true;
    extree_bitmaps_commit_space(t);
}

/* ---- Marks: every change of the live tree's guest range ---- */

/* Kept marks (extree_bitmaps_keep_marks()) beyond this many get coarser */
#define MARKS_MAX 16384

static int mark_cmp(const void *a, const void *b)
{
    const ExtreeBitmapMark *x = a, *y = b;

    return x->start < y->start ? -1 : x->start > y->start;
}

/*
 * Bound the marks' memory while no drain drops them: sorted, merged, and
 * neighbours joined across their gaps until half the limit is left.  Only
 * a sync uses them, as a superset of what may be missing from the
 * caller's copy: a wider range costs false positives, never a miss.
 */
static void marks_coarsen(Extree *t)
{
    GArray *m = t->bm.marks;

    while (m->len > MARKS_MAX / 2) {
        guint out = 0;

        g_array_sort(m, mark_cmp);
        for (guint i = 0; i < m->len; i++) {
            ExtreeBitmapMark *cur = &g_array_index(m, ExtreeBitmapMark, i);
            ExtreeBitmapMark *last = out ?
                &g_array_index(m, ExtreeBitmapMark, out - 1) : NULL;

            /* every other one joins its predecessor */
            if (last && (cur->start <= last->end || (i & 1))) {
                last->end = MAX(last->end, cur->end);
            } else {
                g_array_index(m, ExtreeBitmapMark, out++) = *cur;
            }
        }
        g_array_set_size(m, out);
    }
}

/* Add @guest.. to the marks and set their bits; did any bit change? */
static bool mark_bits(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t end = MIN(guest + bytes, t->virtual_size);
    ExtreeBitmapMark *last;
    bool changed = false;

    if (!t->bm.list || !t->bm.list->len || guest >= end) {
        return false;
    }
    last = t->bm.marks->len ?
           &g_array_index(t->bm.marks, ExtreeBitmapMark,
                          t->bm.marks->len - 1) : NULL;
    if (last && last->end >= guest && last->start <= end) {
        last->start = MIN(last->start, guest);
        last->end = MAX(last->end, end);
    } else {
        ExtreeBitmapMark m = { guest, end };
        g_array_append_val(t->bm.marks, m);
        if (t->bm.marks->len > MARKS_MAX) {
            marks_coarsen(t);
        }
    }
    for (guint i = 0; t->bm.enabled && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        if (bm->enabled) {
            changed |= set_range(t, bm, guest >> bm->gran_bits,
                                 extree_bm_ngranules(end, bm->gran_bits));
        }
    }
    return changed;
}

void extree_bitmaps_mark(Extree *t, uint64_t guest, uint64_t bytes)
{
    if (mark_bits(t, guest, bytes)) {
        extree_bm_changed(t);
    }
}

void extree_bitmaps_mark_logged(Extree *t, uint64_t guest, uint64_t bytes)
{
    if (mark_bits(t, guest, bytes)) {
        /* stored by the next commit, which needs room for the chunks */
        t->bm.dirty_logged = true;
        extree_bitmaps_commit_space(t);
    }
}

void extree_bitmaps_logged_add(Extree *t, uint64_t guest, uint64_t bytes)
{
    extree_rs_union(&t->bm.logged, guest, bytes);
}

uint64_t extree_bitmaps_min_granule(Extree *t)
{
    uint32_t bits = 63;

    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        bits = MIN(bits, bm->gran_bits);
    }
    return bits == 63 ? t->block_size : (uint64_t)1 << bits;
}

/*
 * Do durable records of the mark log cover the granules of [@guest,
 * @end)?  Records name whole granules of the finest bitmap, so a later
 * write into a granule a record marked is covered without one of its own.
 */
static bool logged_covers(Extree *t, uint64_t guest, uint64_t end)
{
    uint64_t g = extree_bitmaps_min_granule(t);
    ExtreeRange *r;

    if (!t->bm.logged.count || guest >= end) {
        return false;
    }
    guest = guest / g * g;
    end = MIN(EXTREE_ROUND_UP(end, g), t->virtual_size);
    r = extree_rs_floor(&t->bm.logged, guest);
    return r && r->start + r->len >= end;
}

/*
 * Bitmap @i leaves the list.  One enabled in the committed state stays
 * in t->bm.removed until the commit: a crash before it returns to a
 * state where the bitmap records changes, so a write in place must still
 * find its committed bits set (spec: Persistent dirty bitmaps, rule 2)
 */
void extree_bm_drop(Extree *t, guint i)
{
    ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

    t->bm.enabled -= bm->enabled;
    g_ptr_array_remove_index(t->bm.list, i);
    if (!bm->cenabled) {
        extree_bm_free(bm);
        return;
    }
    if (!t->bm.removed) {
        t->bm.removed = g_ptr_array_new_with_free_func(
            (GDestroyNotify)extree_bm_free);
    }
    g_ptr_array_add(t->bm.removed, bm);
}

bool extree_bitmaps_in_place(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t end = MIN(guest + bytes, t->virtual_size);
    bool ok = true, after_commit = true;

    /* removed ones count until the commit; after it they are gone */
    for (guint i = 0; t->bm.removed && i < t->bm.removed->len &&
                      guest < end; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.removed, i);
        uint64_t g1 = extree_bm_ngranules(end, bm->gran_bits);

        /* a crash replays the mark log into it too */
        if (g1 > bm->ngran ||
            !(all_set_committed(t, bm, guest >> bm->gran_bits, g1) ||
              logged_covers(t, guest, end))) {
            ok = false;
        }
    }

    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
        uint64_t g0 = guest >> bm->gran_bits;
        uint64_t g1 = extree_bm_ngranules(end, bm->gran_bits);
        bool set;

        /* enabled now or in the committed state a crash returns to */
        if (!(bm->enabled || bm->cenabled) || guest >= end) {
            continue;
        }
        set = all_set(bm->bits, g0, g1);
        /* the mark log's durable records count as committed marks */
        if (!set || !(all_set_committed(t, bm, g0, g1) ||
                      logged_covers(t, guest, end))) {
            ok = false;
            /* the next commit makes the bits committed, @enabled too */
            after_commit &= set || !bm->enabled;
        }
    }
    if (!ok && after_commit) {
        t->bm.held++;
    }
    return ok;
}

/* ---- The public operations ---- */

unsigned extree_bitmap_count(Extree *t)
{
    return t->bm.list ? t->bm.list->len : 0;
}

int extree_bitmap_find(Extree *t, const char *name)
{
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        if (!strcmp(bm->name, name)) {
            return i;
        }
    }
    return -ENOENT;
}

int extree_bitmap_info(Extree *t, unsigned i, ExtreeBitmapInfo *info)
{
    ExtreeBitmap *bm;

    if (i >= extree_bitmap_count(t)) {
        return -ENOENT;
    }
    bm = g_ptr_array_index(t->bm.list, i);
    info->name = bm->name;
    info->granularity = (uint64_t)1 << bm->gran_bits;
    info->enabled = bm->enabled;
    info->dirty_granules = bm->count;
    return 0;
}

uint64_t extree_bitmap_meta_bytes(uint64_t virtual_size, uint32_t block_size,
                                  size_t name_len, uint64_t granularity)
{
    uint64_t bs = block_size ? block_size : EXTREE_DEFAULT_BLOCK_SIZE;
    uint32_t gbits = __builtin_ctzll(granularity);
    uint64_t n = extree_bm_nchunks_for(extree_bm_ngranules(virtual_size,
                                                           gbits), bs);

    /* every chunk, and the entry in a directory that moves at commit */
    return n * bs + 2 * EXTREE_ROUND_UP(extree_bm_entry_bytes(name_len, n), bs);
}

int extree_bitmap_check_new(Extree *t, const char *name, uint64_t granularity,
                            char **why)
{
    size_t len = strlen(name);
    uint64_t nch;

    if (t->read_only) {
        *why = g_strdup("the image is read-only");
        return -EROFS;
    }
    if (!len || len > EXTREE_BITMAP_NAME_MAX) {
        *why = g_strdup_printf("the name must be 1 to %d bytes long",
                               EXTREE_BITMAP_NAME_MAX);
        return -EINVAL;
    }
    if (!extree_is_pow2_in(granularity, t->block_size,
                           (uint64_t)1 << EXTREE_BITMAP_GRAN_MAX_BITS)) {
        *why = g_strdup_printf("granularity %" PRIu64 " must be a power "
                               "of two, at least the image's block size "
                               "(%u) and at most %llu", granularity,
                               t->block_size,
                               1ULL << EXTREE_BITMAP_GRAN_MAX_BITS);
        return -EINVAL;
    }
    if (extree_bitmap_find(t, name) >= 0) {
        *why = g_strdup_printf("a bitmap named '%s' exists", name);
        return -EEXIST;
    }
    if (extree_bitmap_count(t) >= EXTREE_MAX_BITMAPS) {
        *why = g_strdup_printf("the image has %d bitmaps already",
                               EXTREE_MAX_BITMAPS);
        return -EFBIG;
    }
    nch = extree_bm_nchunks_for(extree_bm_ngranules(t->virtual_size,
                                        __builtin_ctzll(granularity)),
                                t->block_size);
    if (extree_bm_too_big(t, nch)) {
        /* qcow2's words */
        *why = g_strdup_printf("Too much space will be occupied by the "
                               "bitmap (more than %" PRIu64 " bytes). Use "
                               "larger granularity", t->bm.max_bytes);
        return -EFBIG;
    }
    if (extree_bm_dir_bytes(t, t->virtual_size,
                            extree_bm_entry_bytes(len, nch)) >
        EXTREE_BITMAP_DIR_MAX) {
        *why = g_strdup_printf("the bitmap directory would exceed %d bytes",
                               EXTREE_BITMAP_DIR_MAX);
        return -EFBIG;
    }
    return 0;
}

int extree_bitmap_add(Extree *t, const char *name, uint64_t granularity,
                      bool enabled)
{
    char *why = NULL;
    uint64_t entry, need;
    int ret = extree_check_writable(t);

    t->bm.unlogged = true;      /* no map record holds it */
    if (ret == 0) {
        ret = extree_bitmap_check_new(t, name, granularity, &why);
        g_free(why);
    }
    if (ret < 0) {
        return ret;
    }
    /*
     * On storage of fixed size, the directory's growth must fit before
     * anything changes, as an update's nodes must (the guard)
     */
    entry = extree_bm_entry_bytes(strlen(name),
                                  extree_bm_nchunks_for(extree_bm_ngranules(
                                      t->virtual_size,
                                      __builtin_ctzll(granularity)),
                                      t->block_size));
    need = dir_nodes(t, extree_bm_dir_bytes(t, t->virtual_size, entry));
    if (t->bm.dirty && extree_bitmap_count(t)) {
        need -= dir_nodes(t, extree_bm_dir_bytes(t, t->virtual_size, 0));
    }
    if (!extree_alloc_update_fits(t, need)) {
        return -ENOSPC;
    }
    if (!t->bm.list) {
        t->bm.list = g_ptr_array_new();
    }
    g_ptr_array_add(t->bm.list, extree_bm_new(t, name,
                                              __builtin_ctzll(granularity),
                                              enabled));
    t->bm.enabled += enabled;
    t->incompat |= EXTREE_INCOMPAT_BITMAPS;
    extree_bm_changed(t);
    return 0;
}

int extree_bitmap_remove(Extree *t, const char *name)
{
    int i = extree_bitmap_find(t, name);
    ExtreeBitmap *bm;
    int ret = extree_check_writable(t);

    t->bm.unlogged = true;      /* no map record holds it */
    if (ret < 0) {
        return ret;
    }
    if (i < 0) {
        return i;
    }
    bm = g_ptr_array_index(t->bm.list, i);
    for (uint64_t c = 0; c < bm->nchunks; c++) {
        ret = extree_bm_chunk_release(t, bm, c);
        if (ret < 0) {
            return ret;
        }
    }
    extree_bm_drop(t, i);
    extree_bm_changed(t);
    return 0;
}

uint64_t extree_bitmap_bytes(Extree *t, unsigned i)
{
    ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

    return (bm->ngran + 7) / 8;
}

void extree_bitmap_read(Extree *t, unsigned i, uint8_t *buf)
{
    ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

    memcpy(buf, bm->bits, extree_bitmap_bytes(t, i));
}

int extree_bitmap_sync(Extree *t, unsigned i, const uint8_t *buf,
                       bool enabled, bool keep)
{
    ExtreeBitmap *bm;
    size_t len, n;
    uint8_t *want;
    uint64_t touch = 0, need;
    bool changed = false;
    int ret = extree_check_writable(t);

    if (ret < 0) {
        return ret;
    }
    if (i >= extree_bitmap_count(t)) {
        return -ENOENT;
    }
    bm = g_ptr_array_index(t->bm.list, i);
    len = (size_t)bm->nchunks * t->block_size;
    n = extree_bitmap_bytes(t, i);
    want = g_malloc0(len);
    memcpy(want, buf, n);
    /* granules past the end are never set */
    if (bm->ngran & 7) {
        want[n - 1] &= (1 << (bm->ngran & 7)) - 1;
    }
    if (keep) {
        for (size_t b = 0; b < n; b++) {
            want[b] |= bm->bits[b];
        }
    }
    if (enabled) {
        /*
         * changes whose requests may not have told the caller yet: this
         * transaction's, or those since extree_bitmaps_marks_reflected()
         */
        for (guint m = 0; m < t->bm.marks->len; m++) {
            ExtreeBitmapMark *mk = &g_array_index(t->bm.marks,
                                                  ExtreeBitmapMark, m);
            uint64_t g = mk->start >> bm->gran_bits;
            uint64_t g1 = extree_bm_ngranules(MIN(mk->end, t->virtual_size),
                                              bm->gran_bits);

            for (; g < g1; g++) {
                want[g >> 3] |= 1 << (g & 7);
            }
        }
    }
    /*
     * A clear or merge changes chunks no update counted: on storage of
     * fixed size their new blocks must fit before anything changes
     * (extree_alloc_update_fits()), or the commit could run out of space
     */
    for (uint64_t c = 0; c < bm->nchunks; c++) {
        size_t off = c * t->block_size;

        touch += bm->chunk_state[c] == CHUNK_CLEAN &&
                 memcmp(want + off, bm->bits + off, t->block_size);
    }
    need = more_space(t, touch, enabled != bm->enabled);
    if (need && !extree_alloc_update_fits(t, need)) {
        g_free(want);
        return -ENOSPC;
    }
    for (uint64_t c = 0; c < bm->nchunks; c++) {
        size_t off = c * t->block_size;

        if (memcmp(want + off, bm->bits + off, t->block_size)) {
            chunk_touch(t, bm, c);
            bm->count += extree_bm_popcount(want + off, t->block_size);
            bm->count -= extree_bm_popcount(bm->bits + off, t->block_size);
            memcpy(bm->bits + off, want + off, t->block_size);
            changed = true;
        }
    }
    g_free(want);
    if (enabled != bm->enabled) {
        t->bm.enabled += enabled ? 1 : -1;
        bm->enabled = enabled;
        changed = true;
    }
    if (changed) {
        /* no map record holds it (a sync that changes nothing needs none) */
        t->bm.unlogged = true;
        extree_bm_changed(t);
    }
    extree_trace(t, EXTREE_TRACE_BITMAP_SYNC, i, bm->count, changed);
    return 0;
}

/* ---- Virtual size: granules come and go at the end ---- */

int extree_bitmaps_resize_ok(Extree *t, uint64_t size)
{
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
        uint64_t ngran = extree_bm_ngranules(size, bm->gran_bits);

        if (extree_bm_too_big(t, extree_bm_nchunks_for(ngran,
                                                       t->block_size))) {
            g_free(t->last_error);
            t->last_error = g_strdup_printf("bitmap '%s' would take more "
                                            "than %" PRIu64 " bytes at that "
                                            "size; remove it first",
                                            bm->name, t->bm.max_bytes);
            return -EFBIG;
        }
    }
    if (extree_bm_dir_bytes(t, size, 0) > EXTREE_BITMAP_DIR_MAX) {
        g_free(t->last_error);
        t->last_error = g_strdup_printf("the bitmap directory would exceed "
                                        "%d bytes at that size",
                                        EXTREE_BITMAP_DIR_MAX);
        return -EFBIG;
    }
    return 0;
}

int extree_bitmaps_resize(Extree *t, uint64_t size)
{
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
        uint64_t ngran = extree_bm_ngranules(size, bm->gran_bits);
        uint64_t nch = extree_bm_nchunks_for(ngran, t->block_size);
        size_t bs = t->block_size;

        if (ngran == bm->ngran) {
            continue;
        }
        for (uint64_t c = nch; c < bm->nchunks; c++) {
            int ret = extree_bm_chunk_release(t, bm, c);

            if (ret < 0) {
                return ret;
            }
        }
        for (uint64_t c = nch; c < bm->nchunks; c++) {
            g_free(bm->cchunk[c]);
        }
        bm->bits = g_realloc(bm->bits, nch * bs);
        bm->cchunk = g_renew(uint8_t *, bm->cchunk, nch);
        bm->chunk_off = g_renew(uint64_t, bm->chunk_off, nch);
        bm->chunk_csum = g_renew(uint32_t, bm->chunk_csum, nch);
        bm->chunk_state = g_realloc(bm->chunk_state, nch);
        if (nch > bm->nchunks) {
            size_t old = bm->nchunks;

            memset(bm->bits + old * bs, 0, (nch - old) * bs);
            memset(bm->cchunk + old, 0, (nch - old) * sizeof(uint8_t *));
            memset(bm->chunk_off + old, 0, (nch - old) * sizeof(uint64_t));
            memset(bm->chunk_csum + old, 0, (nch - old) * sizeof(uint32_t));
            memset(bm->chunk_state + old, CHUNK_CLEAN, nch - old);
        }
        bm->nchunks = nch;
        if (ngran < bm->ngran) {
            /* the granules cut off are clear: a later growth is clean */
            for (uint64_t g = ngran; g < MIN(bm->ngran, nch * bs * 8); g++) {
                if (bm->bits[g >> 3] & (1 << (g & 7))) {
                    chunk_touch(t, bm, g / (bs * 8));
                    bm->bits[g >> 3] &= ~(1 << (g & 7));
                }
            }
        }
        bm->ngran = ngran;
        bm->count = extree_bm_popcount(bm->bits, nch * bs);
        extree_bm_changed(t);
    }
    return 0;
}
