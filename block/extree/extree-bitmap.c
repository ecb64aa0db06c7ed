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
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

#define BH_OFF(f) offsetof(ExtreeDiskBitmapHeader, f)
#define BE_OFF(f) offsetof(ExtreeDiskBitmapEntry, f)
#define BC_OFF(f) offsetof(ExtreeDiskBitmapChunk, f)

/* A guest range this transaction changed, [start, end) */
typedef struct ExtreeBitmapMark {
    uint64_t start, end;
} ExtreeBitmapMark;

enum { CHUNK_CLEAN, CHUNK_CHANGED, CHUNK_MOVED };

static uint64_t ngranules(uint64_t size, uint32_t gran_bits)
{
    return (size + ((uint64_t)1 << gran_bits) - 1) >> gran_bits;
}

static uint64_t nchunks_for(uint64_t ngran, uint32_t block_size)
{
    uint64_t per = (uint64_t)block_size * 8;

    return (ngran + per - 1) / per;
}

/* Would a bitmap of @nchunks chunks take more memory than we allow? */
static bool too_big(const Extree *t, uint64_t nchunks)
{
    return nchunks > t->bitmap_max_bytes / t->block_size;
}

static uint64_t entry_bytes(size_t name_len, uint64_t nchunks)
{
    return sizeof(ExtreeDiskBitmapEntry) + EXTREE_ROUND_UP(name_len, 8) +
           nchunks * sizeof(ExtreeDiskBitmapChunk);
}

/* Directory length with @extra more bytes of entries, sizes at @size */
static uint64_t dir_bytes(Extree *t, uint64_t size, uint64_t extra)
{
    uint64_t len = sizeof(ExtreeDiskBitmapHeader) + extra;

    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        len += entry_bytes(strlen(bm->name),
                           nchunks_for(ngranules(size, bm->gran_bits),
                                       t->block_size));
    }
    return len;
}

static void bm_free(ExtreeBitmap *bm)
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

static ExtreeBitmap *bm_new(Extree *t, const char *name, uint32_t gran_bits,
                            bool enabled)
{
    ExtreeBitmap *bm = g_new0(ExtreeBitmap, 1);

    bm->name = g_strdup(name);
    bm->gran_bits = gran_bits;
    bm->enabled = enabled;
    bm->ngran = ngranules(t->virtual_size, gran_bits);
    bm->nchunks = nchunks_for(bm->ngran, t->block_size);
    bm->bits = g_malloc0((size_t)bm->nchunks * t->block_size);
    bm->cchunk = g_new0(uint8_t *, bm->nchunks);
    bm->chunk_off = g_new0(uint64_t, bm->nchunks);
    bm->chunk_csum = g_new0(uint32_t, bm->nchunks);
    bm->chunk_state = g_malloc0(bm->nchunks);
    return bm;
}

static bool chunk_zero(Extree *t, const ExtreeBitmap *bm, uint64_t c)
{
    return extree_all_zero(bm->bits + c * t->block_size, t->block_size);
}

/*
 * Bits set in @x.  QEMU is not built for a CPU with popcnt, so the
 * builtin is a libgcc call, and GCC turns this very expression into that
 * call too: popcount() below uses the instruction where the CPU has it
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

static uint64_t popcount(const uint8_t *p, size_t len)
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
        t->bitmap_chunks_changed++;
    }
}

/*
 * Tell the allocator what the next commit takes for the bitmaps, so that
 * updates stop (-ENOSPC) before a commit could run out of room on storage
 * of fixed size: a block for each changed chunk (counted as a node: it
 * may take a free node-sized range) and the directory, which moves whole.
 * O(bitmaps).
 */
void extree_bitmaps_commit_space(Extree *t)
{
    uint64_t dir = 0;

    if (t->bitmaps_dirty && t->bitmaps && t->bitmaps->len) {
        dir = EXTREE_ROUND_UP(dir_bytes(t, t->virtual_size, 0),
                              t->block_size);
        dir = (dir + t->node_size - 1) / t->node_size + 1;
    }
    extree_alloc_commit_extra(t, t->bitmap_chunks_changed + dir);
}

/* Chunk @c as committed */
static const uint8_t *chunk_committed(Extree *t, const ExtreeBitmap *bm,
                                      uint64_t c)
{
    return bm->cchunk[c] ? bm->cchunk[c] : bm->bits + c * t->block_size;
}

/* Does chunk @c differ from its committed copy? */
static bool chunk_differs(Extree *t, const ExtreeBitmap *bm, uint64_t c)
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
static int chunk_release(Extree *t, ExtreeBitmap *bm, uint64_t c)
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

static void bitmaps_changed(Extree *t)
{
    t->bitmaps_dirty = true;
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
    GArray *m = t->bitmap_marks;

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

void extree_bitmaps_mark(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t end = MIN(guest + bytes, t->virtual_size);
    ExtreeBitmapMark *last;
    bool changed = false;

    if (!t->bitmaps || !t->bitmaps->len || guest >= end) {
        return;
    }
    last = t->bitmap_marks->len ?
           &g_array_index(t->bitmap_marks, ExtreeBitmapMark,
                          t->bitmap_marks->len - 1) : NULL;
    if (last && last->end >= guest && last->start <= end) {
        last->start = MIN(last->start, guest);
        last->end = MAX(last->end, end);
    } else {
        ExtreeBitmapMark m = { guest, end };
        g_array_append_val(t->bitmap_marks, m);
        if (t->bitmap_marks->len > MARKS_MAX) {
            marks_coarsen(t);
        }
    }
    for (guint i = 0; t->bitmaps_enabled && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        if (bm->enabled) {
            changed |= set_range(t, bm, guest >> bm->gran_bits,
                                 ngranules(end, bm->gran_bits));
        }
    }
    if (changed) {
        bitmaps_changed(t);
    }
}

bool extree_bitmaps_in_place(Extree *t, uint64_t guest, uint64_t bytes)
{
    uint64_t end = MIN(guest + bytes, t->virtual_size);
    bool ok = true, after_commit = true;

    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);
        uint64_t g0 = guest >> bm->gran_bits;
        uint64_t g1 = ngranules(end, bm->gran_bits);
        bool set;

        /* enabled now or in the committed state a crash returns to */
        if (!(bm->enabled || bm->cenabled) || guest >= end) {
            continue;
        }
        set = all_set(bm->bits, g0, g1);
        if (!set || !all_set_committed(t, bm, g0, g1)) {
            ok = false;
            /* the next commit makes the bits committed, @enabled too */
            after_commit &= set || !bm->enabled;
        }
    }
    if (!ok && after_commit) {
        t->bitmap_held++;
    }
    return ok;
}

/* ---- The public operations ---- */

unsigned extree_bitmap_count(Extree *t)
{
    return t->bitmaps ? t->bitmaps->len : 0;
}

int extree_bitmap_find(Extree *t, const char *name)
{
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

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
    bm = g_ptr_array_index(t->bitmaps, i);
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
    uint64_t n = nchunks_for(ngranules(virtual_size, gbits), bs);

    /* every chunk, and the entry in a directory that moves at commit */
    return n * bs + 2 * EXTREE_ROUND_UP(entry_bytes(name_len, n), bs);
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
    nch = nchunks_for(ngranules(t->virtual_size,
                                __builtin_ctzll(granularity)), t->block_size);
    if (too_big(t, nch)) {
        /* qcow2's words */
        *why = g_strdup_printf("Too much space will be occupied by the "
                               "bitmap (more than %" PRIu64 " bytes). Use "
                               "larger granularity", t->bitmap_max_bytes);
        return -EFBIG;
    }
    if (dir_bytes(t, t->virtual_size, entry_bytes(len, nch)) >
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
    int ret = extree_check_writable(t);

    if (ret == 0) {
        ret = extree_bitmap_check_new(t, name, granularity, &why);
        g_free(why);
    }
    if (ret < 0) {
        return ret;
    }
    if (!t->bitmaps) {
        t->bitmaps = g_ptr_array_new();
    }
    g_ptr_array_add(t->bitmaps, bm_new(t, name, __builtin_ctzll(granularity),
                                       enabled));
    t->bitmaps_enabled += enabled;
    t->incompat |= EXTREE_INCOMPAT_BITMAPS;
    bitmaps_changed(t);
    return 0;
}

int extree_bitmap_remove(Extree *t, const char *name)
{
    int i = extree_bitmap_find(t, name);
    ExtreeBitmap *bm;
    int ret = extree_check_writable(t);

    if (ret < 0) {
        return ret;
    }
    if (i < 0) {
        return i;
    }
    bm = g_ptr_array_index(t->bitmaps, i);
    for (uint64_t c = 0; c < bm->nchunks; c++) {
        ret = chunk_release(t, bm, c);
        if (ret < 0) {
            return ret;
        }
    }
    t->bitmaps_enabled -= bm->enabled;
    g_ptr_array_remove_index(t->bitmaps, i);
    bm_free(bm);
    bitmaps_changed(t);
    return 0;
}

uint64_t extree_bitmap_bytes(Extree *t, unsigned i)
{
    ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

    return (bm->ngran + 7) / 8;
}

void extree_bitmap_read(Extree *t, unsigned i, uint8_t *buf)
{
    ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

    memcpy(buf, bm->bits, extree_bitmap_bytes(t, i));
}

int extree_bitmap_sync(Extree *t, unsigned i, const uint8_t *buf,
                       bool enabled, bool keep)
{
    ExtreeBitmap *bm;
    size_t len, n;
    uint8_t *want;
    bool changed = false;
    int ret = extree_check_writable(t);

    if (ret < 0) {
        return ret;
    }
    if (i >= extree_bitmap_count(t)) {
        return -ENOENT;
    }
    bm = g_ptr_array_index(t->bitmaps, i);
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
        for (guint m = 0; m < t->bitmap_marks->len; m++) {
            ExtreeBitmapMark *mk = &g_array_index(t->bitmap_marks,
                                                  ExtreeBitmapMark, m);
            uint64_t g = mk->start >> bm->gran_bits;
            uint64_t g1 = ngranules(MIN(mk->end, t->virtual_size),
                                    bm->gran_bits);

            for (; g < g1; g++) {
                want[g >> 3] |= 1 << (g & 7);
            }
        }
    }
    for (uint64_t c = 0; c < bm->nchunks; c++) {
        size_t off = c * t->block_size;

        if (memcmp(want + off, bm->bits + off, t->block_size)) {
            chunk_touch(t, bm, c);
            bm->count += popcount(want + off, t->block_size);
            bm->count -= popcount(bm->bits + off, t->block_size);
            memcpy(bm->bits + off, want + off, t->block_size);
            changed = true;
        }
    }
    g_free(want);
    if (enabled != bm->enabled) {
        t->bitmaps_enabled += enabled ? 1 : -1;
        bm->enabled = enabled;
        changed = true;
    }
    if (changed) {
        bitmaps_changed(t);
    }
    return 0;
}

/* ---- Virtual size: granules come and go at the end ---- */

int extree_bitmaps_resize_ok(Extree *t, uint64_t size)
{
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        if (too_big(t, nchunks_for(ngranules(size, bm->gran_bits),
                                   t->block_size))) {
            g_free(t->last_error);
            t->last_error = g_strdup_printf("bitmap '%s' would take more "
                                            "than %" PRIu64 " bytes at that "
                                            "size; remove it first",
                                            bm->name, t->bitmap_max_bytes);
            return -EFBIG;
        }
    }
    if (dir_bytes(t, size, 0) > EXTREE_BITMAP_DIR_MAX) {
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
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);
        uint64_t ngran = ngranules(size, bm->gran_bits);
        uint64_t nch = nchunks_for(ngran, t->block_size);
        size_t bs = t->block_size;

        if (ngran == bm->ngran) {
            continue;
        }
        for (uint64_t c = nch; c < bm->nchunks; c++) {
            int ret = chunk_release(t, bm, c);

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
        bm->count = popcount(bm->bits, nch * bs);
        bitmaps_changed(t);
    }
    return 0;
}

/* ---- Commit: new places for what changed, then the writes ---- */

static uint32_t dir_csum(const uint8_t *buf, uint64_t len)
{
    uint8_t zero[4] = { 0 };
    uint32_t c = extree_crc32c(0, buf, BH_OFF(csum));

    c = extree_crc32c(c, zero, 4);
    return extree_crc32c(c, buf + BH_OFF(csum) + 4, len - BH_OFF(csum) - 4);
}

/*
 * The chunks of @bm this commit writes: one contiguous range for all of
 * them if the allocator has one (*@run chunks at *@host), else none (they
 * are placed one by one)
 */
static int prepare_run(Extree *t, ExtreeBitmap *bm, uint64_t *run,
                       uint64_t *host)
{
    uint64_t n = 0;
    int ret;

    for (uint64_t c = 0; c < bm->nchunks; c++) {
        if (bm->chunk_state[c] == CHUNK_MOVED ||
            (bm->chunk_state[c] == CHUNK_CHANGED &&
             chunk_differs(t, bm, c))) {
            n += !chunk_zero(t, bm, c);
        }
    }
    *run = 0;
    if (n < 2) {
        return 0;
    }
    ret = extree_alloc_contig(t, n * t->block_size, host);
    if (ret == 0) {
        *run = n;
    }
    return ret == -ENOSPC ? 0 : ret;
}

int extree_bitmaps_prepare(Extree *t)
{
    uint64_t len;
    int ret;

    if (!t->bitmaps_dirty) {
        return 0;
    }
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);
        uint64_t run = 0, run_host = 0;

        ret = prepare_run(t, bm, &run, &run_host);
        if (ret < 0) {
            return ret;
        }
        for (uint64_t c = 0; c < bm->nchunks; c++) {
            size_t off = c * t->block_size;

            if (bm->chunk_state[c] == CHUNK_CLEAN) {
                continue;
            }
            if (bm->chunk_state[c] == CHUNK_CHANGED &&
                !chunk_differs(t, bm, c)) {
                /* changed and changed back: it stays where it is */
                g_free(bm->cchunk[c]);
                bm->cchunk[c] = NULL;
                bm->chunk_state[c] = CHUNK_CLEAN;
                continue;
            }
            ret = chunk_release(t, bm, c);
            if (ret < 0) {
                return ret;
            }
            bm->chunk_state[c] = CHUNK_MOVED;
            if (!chunk_zero(t, bm, c) && run) {
                /* in chunk order: the next open reads them in one go */
                bm->chunk_off[c] = run_host;
                run_host += t->block_size;
                run--;
                bm->chunk_csum[c] = extree_crc32c(0, bm->bits + off,
                                                  t->block_size);
            } else if (!chunk_zero(t, bm, c)) {
                ret = extree_alloc_contig(t, t->block_size,
                                          &bm->chunk_off[c]);
                if (ret < 0) {
                    return ret;
                }
                bm->chunk_csum[c] = extree_crc32c(0, bm->bits + off,
                                                  t->block_size);
            }
        }
    }
    if (t->bitmap_dir) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, t->bitmap_dir,
                                 EXTREE_ROUND_UP(t->bitmap_dir_len,
                                                 t->block_size), false);
        if (ret < 0) {
            return ret;
        }
        t->bitmap_dir = t->bitmap_dir_len = 0;
    }
    if (!extree_bitmap_count(t)) {
        return 0;
    }
    len = dir_bytes(t, t->virtual_size, 0);
    ret = extree_alloc_contig(t, EXTREE_ROUND_UP(len, t->block_size),
                              &t->bitmap_dir);
    if (ret < 0) {
        return ret;
    }
    t->bitmap_dir_len = len;
    return 0;
}

static uint8_t *dir_encode(Extree *t, uint64_t *alloc_len)
{
    uint64_t len = t->bitmap_dir_len;
    uint8_t *buf, *p;

    *alloc_len = EXTREE_ROUND_UP(len, t->block_size);
    buf = g_malloc0(*alloc_len);
    ext_st32(buf + BH_OFF(magic), EXTREE_BITMAP_MAGIC);
    ext_st32(buf + BH_OFF(count), t->bitmaps->len);
    ext_st32(buf + BH_OFF(length), len);
    p = buf + sizeof(ExtreeDiskBitmapHeader);
    for (guint i = 0; i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);
        size_t nlen = strlen(bm->name);

        p[BE_OFF(name_len)] = nlen & 0xff;
        p[BE_OFF(name_len) + 1] = nlen >> 8;
        p[BE_OFF(granularity_bits)] = bm->gran_bits;
        p[BE_OFF(flags)] = bm->enabled ? EXTREE_BITMAP_ENABLED : 0;
        ext_st64(p + BE_OFF(dirty_granules), bm->count);
        ext_st32(p + BE_OFF(nr_chunks), bm->nchunks);
        p += sizeof(ExtreeDiskBitmapEntry);
        memcpy(p, bm->name, nlen);
        p += EXTREE_ROUND_UP(nlen, 8);
        for (uint64_t c = 0; c < bm->nchunks; c++) {
            ext_st64(p + BC_OFF(offset), bm->chunk_off[c]);
            ext_st32(p + BC_OFF(csum), bm->chunk_csum[c]);
            p += sizeof(ExtreeDiskBitmapChunk);
        }
    }
    g_assert(p == buf + len);
    ext_st32(buf + BH_OFF(csum), dir_csum(buf, len));
    return buf;
}

int extree_bitmaps_write(Extree *t)
{
    uint64_t len;
    uint8_t *buf;
    int ret;

    if (!t->bitmaps_dirty) {
        return 0;
    }
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        for (uint64_t c = 0; c < bm->nchunks; c++) {
            if (bm->chunk_state[c] == CHUNK_MOVED && bm->chunk_off[c]) {
                ret = t->be->ops->pwrite(t->be->opaque, bm->chunk_off[c],
                                         bm->bits + c * t->block_size,
                                         t->block_size);
                if (ret < 0) {
                    return ret;
                }
            }
        }
    }
    if (!t->bitmap_dir) {
        return 0;
    }
    buf = dir_encode(t, &len);
    ret = t->be->ops->pwrite(t->be->opaque, t->bitmap_dir, buf, len);
    g_free(buf);
    return ret;
}

void extree_bitmaps_keep_marks(Extree *t)
{
    t->bitmap_marks_kept = true;
}

void extree_bitmaps_marks_reflected(Extree *t)
{
    if (t->bitmap_marks) {
        g_array_set_size(t->bitmap_marks, 0);
    }
}

bool extree_bitmaps_have_marks(Extree *t)
{
    return t->bitmap_marks && t->bitmap_marks->len;
}

void extree_bitmaps_commit_done(Extree *t)
{
    if (t->bitmap_marks && !t->bitmap_marks_kept) {
        g_array_set_size(t->bitmap_marks, 0);
    }
    t->bitmap_held = 0;
    t->bitmap_chunks_changed = 0;
    extree_alloc_commit_extra(t, 0);
    if (!t->bitmaps_dirty) {
        return;
    }
    for (guint i = 0; t->bitmaps && i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        bm->cenabled = bm->enabled;
        for (uint64_t c = 0; c < bm->nchunks; c++) {
            if (bm->chunk_state[c] != CHUNK_CLEAN) {
                /* committed now: @bits is the committed content again */
                g_free(bm->cchunk[c]);
                bm->cchunk[c] = NULL;
                bm->chunk_state[c] = CHUNK_CLEAN;
            }
        }
    }
    t->bitmaps_dirty = false;
}

/* ---- Open: the directory and every chunk, validated ---- */

void extree_bitmaps_free(Extree *t)
{
    if (t->bitmaps) {
        g_ptr_array_set_free_func(t->bitmaps, (GDestroyNotify)bm_free);
        g_ptr_array_free(t->bitmaps, true);
        t->bitmaps = NULL;
    }
    if (t->bitmap_marks) {
        g_array_free(t->bitmap_marks, true);
        t->bitmap_marks = NULL;
    }
    t->bitmap_dir = t->bitmap_dir_len = 0;
    t->bitmaps_dirty = false;
    t->bitmaps_enabled = 0;
    t->bitmap_chunks_changed = 0;
    g_free(t->bitmaps_bad);
    t->bitmaps_bad = NULL;
}

/* One entry at @p (@left bytes of the directory left); *@why on damage */
static char *decode_entry(Extree *t, const uint8_t *p, uint64_t left,
                          GHashTable *names, uint64_t *used,
                          ExtreeBitmap **out, char **big)
{
    const uint8_t *entry = p;
    uint32_t nlen = p[BE_OFF(name_len)] | (p[BE_OFF(name_len) + 1] << 8);
    uint32_t gbits, flags, nch;
    uint64_t want_nch;
    ExtreeBitmap *bm;
    char *name;

    if (left < sizeof(ExtreeDiskBitmapEntry)) {
        return g_strdup("entry past the directory's length");
    }
    gbits = p[BE_OFF(granularity_bits)];
    flags = p[BE_OFF(flags)];
    nch = ext_ld32(p + BE_OFF(nr_chunks));
    if (nlen == 0 || nlen > EXTREE_BITMAP_NAME_MAX) {
        return g_strdup_printf("bad name_len %u", nlen);
    }
    if ((1ULL << gbits) < t->block_size ||
        gbits > EXTREE_BITMAP_GRAN_MAX_BITS) {
        return g_strdup_printf("bad granularity_bits %u", gbits);
    }
    if (flags & ~EXTREE_BITMAP_ENABLED) {
        return g_strdup_printf("bad flags 0x%x", flags);
    }
    want_nch = nchunks_for(ngranules(t->virtual_size, gbits), t->block_size);
    if (nch != want_nch) {
        return g_strdup_printf("bad nr_chunks %u, expect %" PRIu64, nch,
                               want_nch);
    }
    *used = entry_bytes(nlen, nch);
    if (*used > left) {
        return g_strdup("entry past the directory's length");
    }
    name = g_strndup((const char *)p + sizeof(ExtreeDiskBitmapEntry), nlen);
    if (strlen(name) != nlen ||
        !extree_all_zero(p + sizeof(ExtreeDiskBitmapEntry) + nlen,
                         EXTREE_ROUND_UP(nlen, 8) - nlen)) {
        g_free(name);
        return g_strdup("name with a zero byte or not zero-padded");
    }
    if (g_hash_table_contains(names, name)) {
        char *why = g_strdup_printf("bitmap name '%s' used twice", name);
        g_free(name);
        return why;
    }
    if (too_big(t, nch)) {
        /* valid, but more than this implementation holds in memory */
        *big = g_strdup_printf("bitmap '%s' takes %" PRIu64 " bytes of "
                               "memory, more than %" PRIu64 "; 'qemu-img "
                               "check -r all' removes it", name,
                               (uint64_t)nch * t->block_size,
                               t->bitmap_max_bytes);
        g_free(name);
        *out = NULL;
        return NULL;
    }
    bm = bm_new(t, name, gbits, flags & EXTREE_BITMAP_ENABLED);
    bm->cenabled = bm->enabled;
    /* checked against the chunks by load_chunks() */
    bm->count = ext_ld64(entry + BE_OFF(dirty_granules));
    g_free(name);
    p += sizeof(ExtreeDiskBitmapEntry) + EXTREE_ROUND_UP(nlen, 8);
    for (uint64_t c = 0; c < nch; c++, p += sizeof(ExtreeDiskBitmapChunk)) {
        uint64_t off = ext_ld64(p + BC_OFF(offset));
        uint32_t csum = ext_ld32(p + BC_OFF(csum));

        if (off && (!EXTREE_IS_ALIGNED(off, t->block_size) ||
                    off < t->data_start || off >= t->host_end ||
                    t->host_end - off < t->block_size)) {
            char *why = g_strdup_printf("bitmap '%s': chunk %" PRIu64
                                        " at bad offset 0x%" PRIx64,
                                        bm->name, c, off);
            bm_free(bm);
            return why;
        }
        if (!off && csum) {
            char *why = g_strdup_printf("bitmap '%s': chunk %" PRIu64
                                        " without offset has checksum",
                                        bm->name, c);
            bm_free(bm);
            return why;
        }
        bm->chunk_off[c] = off;
        bm->chunk_csum[c] = csum;
    }
    /* the count is checked when the chunks are read (load_chunks()) */
    *out = bm;
    return NULL;
}

static int load_chunks(Extree *t, ExtreeBitmap *bm, uint64_t want_count)
{
    uint64_t count;

    for (uint64_t c = 0, run = 0; c < bm->nchunks; c++) {
        uint8_t *p = bm->bits + c * t->block_size;
        uint32_t sum;
        int ret;

        if (!bm->chunk_off[c]) {
            continue;
        }
        if (!run) {
            /* chunks stored one after the other are read at once */
            run = 1;
            while (c + run < bm->nchunks &&
                   bm->chunk_off[c + run] ==
                   bm->chunk_off[c] + run * t->block_size) {
                run++;
            }
            ret = t->be->ops->pread(t->be->opaque, bm->chunk_off[c], p,
                                    run * t->block_size);
            if (ret < 0) {
                return ret;
            }
        }
        run--;
        sum = extree_crc32c(0, p, t->block_size);
        if (sum != bm->chunk_csum[c]) {
            return extree_corrupt(t, bm->chunk_off[c], "corrupt bitmap chunk "
                                  "at offset 0x%" PRIx64 ": bitmap '%s' "
                                  "chunk %" PRIu64 ": bad checksum, have "
                                  "0x%08x expect 0x%08x", bm->chunk_off[c],
                                  bm->name, c, sum, bm->chunk_csum[c]);
        }
    }
    /* nothing set past the last granule */
    if (bm->nchunks) {
        uint64_t g = bm->ngran, bytes = (uint64_t)bm->nchunks * t->block_size;
        uint64_t c = (g - 1) / (t->block_size * 8);
        uint8_t tail = g & 7 ? bm->bits[g >> 3] >> (g & 7) : 0;

        if (tail || !extree_all_zero(bm->bits + (g + 7) / 8,
                                     bytes - (g + 7) / 8)) {
            return extree_corrupt(t, bm->chunk_off[c], "corrupt bitmap "
                                  "chunk at offset 0x%" PRIx64 ": bitmap "
                                  "'%s' has granules set past the virtual "
                                  "size", bm->chunk_off[c], bm->name);
        }
    }
    count = popcount(bm->bits, (size_t)bm->nchunks * t->block_size);
    bm->count = count;
    if (count != want_count) {
        return extree_corrupt(t, t->bitmap_dir, "corrupt bitmap directory at "
                              "offset 0x%" PRIx64 ": bitmap '%s' has %"
                              PRIu64 " granules set, its entry says %"
                              PRIu64, t->bitmap_dir, bm->name, count,
                              want_count);
    }
    return 0;
}

/*
 * A checker's handle (@tolerate) opens with damaged bitmaps left out:
 * t->bitmaps_bad says what was wrong, and only a repair drops them from
 * the image (extree_bitmaps_drop_damaged()); their blocks are leaks then.
 */
static void note_bad(Extree *t)
{
    char *all = t->bitmaps_bad ?
                g_strdup_printf("%s; %s", t->bitmaps_bad, t->last_error) :
                g_strdup(t->last_error);

    g_free(t->bitmaps_bad);
    t->bitmaps_bad = all;
}

void extree_bitmaps_drop_damaged(Extree *t)
{
    g_free(t->bitmaps_bad);
    t->bitmaps_bad = NULL;
    bitmaps_changed(t);
}

void extree_bitmaps_forget(Extree *t, const bool *drop, bool dir)
{
    for (guint i = t->bitmaps->len; i-- > 0;) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        if (drop[i]) {
            t->bitmaps_enabled -= bm->enabled;
            g_ptr_array_remove_index(t->bitmaps, i);
            bm_free(bm);
        }
    }
    if (dir) {
        /* not freed at the commit either: another owner keeps it */
        t->bitmap_dir = t->bitmap_dir_len = 0;
    }
    bitmaps_changed(t);
}

/* No bitmap: after damage that fails (or, for a checker, skips) them */
static void bitmaps_reset(Extree *t)
{
    extree_bitmaps_free(t);
    t->bitmaps = g_ptr_array_new();
    t->bitmap_marks = g_array_new(false, false, sizeof(ExtreeBitmapMark));
}

int extree_bitmaps_load(Extree *t, const ExtreeSuper *sb, bool tolerate)
{
    uint64_t len = sb->bitmap_dir_len, alloc = EXTREE_ROUND_UP(len,
                                                              t->block_size);
    GHashTable *names;
    uint8_t *buf;
    const uint8_t *p;
    char *why = NULL;
    int ret;

    t->bitmaps = g_ptr_array_new();
    t->bitmap_marks = g_array_new(false, false, sizeof(ExtreeBitmapMark));
    if (!sb->bitmap_count) {
        return 0;
    }
    buf = g_malloc(alloc);
    ret = t->be->ops->pread(t->be->opaque, sb->bitmap_dir, buf, alloc);
    if (ret < 0) {
        g_free(buf);
        return ret;
    }
    if (ext_ld32(buf + BH_OFF(magic)) != EXTREE_BITMAP_MAGIC) {
        why = g_strdup_printf("bad magic 0x%08x",
                              ext_ld32(buf + BH_OFF(magic)));
    } else if (ext_ld32(buf + BH_OFF(csum)) != dir_csum(buf, len)) {
        why = g_strdup_printf("bad checksum, have 0x%08x expect 0x%08x",
                              ext_ld32(buf + BH_OFF(csum)),
                              dir_csum(buf, len));
    } else if (ext_ld32(buf + BH_OFF(count)) != sb->bitmap_count ||
               ext_ld32(buf + BH_OFF(length)) != len) {
        why = g_strdup_printf("bad count %u or length %u, expect %u and %"
                              PRIu64, ext_ld32(buf + BH_OFF(count)),
                              ext_ld32(buf + BH_OFF(length)),
                              sb->bitmap_count, len);
    }
    names = g_hash_table_new(g_str_hash, g_str_equal);
    p = buf + sizeof(ExtreeDiskBitmapHeader);
    for (uint32_t i = 0; !why && i < sb->bitmap_count; i++) {
        ExtreeBitmap *bm = NULL;
        uint64_t used = 0;
        char *big = NULL;

        why = decode_entry(t, p, buf + len - p, names, &used, &bm, &big);
        if (big) {
            g_free(t->last_error);
            t->last_error = big;
            if (!tolerate) {
                g_hash_table_destroy(names);
                g_free(buf);
                bitmaps_reset(t);
                return -EFBIG;
            }
            /* left out: its chunks are leaks until a repair drops it */
            note_bad(t);
            p += used;
        } else if (!why) {
            g_ptr_array_add(t->bitmaps, bm);
            g_hash_table_add(names, bm->name);
            t->bitmaps_enabled += bm->enabled;
            p += used;
        } else {
            char *w = g_strdup_printf("entry %u: %s", i, why);
            g_free(why);
            why = w;
        }
    }
    if (!why && p != buf + len) {
        why = g_strdup("entries end before the directory's length");
    }
    g_hash_table_destroy(names);
    if (why) {
        g_free(buf);
        ret = extree_corrupt(t, sb->bitmap_dir, "corrupt bitmap directory at "
                             "offset 0x%" PRIx64 ": %s", sb->bitmap_dir, why);
        g_free(why);
        bitmaps_reset(t);
        if (tolerate) {
            /* all of them: the directory and every chunk are leaks */
            note_bad(t);
            return 0;
        }
        return ret;
    }
    t->bitmap_dir = sb->bitmap_dir;
    t->bitmap_dir_len = len;
    /* second pass for the counts: the entries are valid */
    for (guint i = 0; i < t->bitmaps->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bitmaps, i);

        ret = load_chunks(t, bm, bm->count);
        if (ret == -EIO && tolerate) {
            /* this one only: its chunks are leaks */
            note_bad(t);
            t->bitmaps_enabled -= bm->enabled;
            g_ptr_array_remove_index(t->bitmaps, i--);
            bm_free(bm);
            ret = 0;
        } else if (ret < 0) {
            break;
        }
    }
    g_free(buf);
    if (ret < 0) {
        bitmaps_reset(t);
    }
    return ret;
}
