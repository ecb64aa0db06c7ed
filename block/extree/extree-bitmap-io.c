/*
 * extree core: persistent dirty bitmaps on disk: the commit (new places
 * for the chunks and directory that changed, then their writes) and the
 * open (the directory and every chunk, validated)
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"
#include "extree-bitmap-int.h"

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
             extree_bm_chunk_differs(t, bm, c))) {
            n += !extree_bm_chunk_zero(t, bm, c);
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

    /* marks only the mark log held so far: this commit stores them */
    t->bm.dirty |= t->bm.dirty_logged;
    if (!t->bm.dirty) {
        return 0;
    }
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
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
                !extree_bm_chunk_differs(t, bm, c)) {
                /* changed and changed back: it stays where it is */
                g_free(bm->cchunk[c]);
                bm->cchunk[c] = NULL;
                bm->chunk_state[c] = CHUNK_CLEAN;
                continue;
            }
            ret = extree_bm_chunk_release(t, bm, c);
            if (ret < 0) {
                return ret;
            }
            bm->chunk_state[c] = CHUNK_MOVED;
            if (!extree_bm_chunk_zero(t, bm, c) && run) {
                /* in chunk order: the next open reads them in one go */
                bm->chunk_off[c] = run_host;
                run_host += t->block_size;
                run--;
                bm->chunk_csum[c] = extree_crc32c(0, bm->bits + off,
                                                  t->block_size);
            } else if (!extree_bm_chunk_zero(t, bm, c)) {
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
    if (t->bm.dir) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, t->bm.dir,
                                 EXTREE_ROUND_UP(t->bm.dir_len,
                                                 t->block_size), false);
        if (ret < 0) {
            return ret;
        }
        t->bm.dir = t->bm.dir_len = 0;
    }
    if (!extree_bitmap_count(t)) {
        return 0;
    }
    len = extree_bm_dir_bytes(t, t->virtual_size, 0);
    ret = extree_alloc_contig(t, EXTREE_ROUND_UP(len, t->block_size),
                              &t->bm.dir);
    if (ret < 0) {
        return ret;
    }
    t->bm.dir_len = len;
    return 0;
}

static uint8_t *dir_encode(Extree *t, uint64_t *alloc_len)
{
    uint64_t len = t->bm.dir_len;
    uint8_t *buf, *p;

    *alloc_len = EXTREE_ROUND_UP(len, t->block_size);
    buf = g_malloc0(*alloc_len);
    ext_st32(buf + BH_OFF(magic), EXTREE_BITMAP_MAGIC);
    ext_st32(buf + BH_OFF(count), t->bm.list->len);
    ext_st32(buf + BH_OFF(length), len);
    p = buf + sizeof(ExtreeDiskBitmapHeader);
    for (guint i = 0; i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);
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

    if (!t->bm.dirty) {
        return 0;
    }
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

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
    if (!t->bm.dir) {
        return 0;
    }
    buf = dir_encode(t, &len);
    ret = t->be->ops->pwrite(t->be->opaque, t->bm.dir, buf, len);
    g_free(buf);
    return ret;
}

void extree_bitmaps_keep_marks(Extree *t)
{
    t->bm.marks_kept = true;
}

void extree_bitmaps_marks_reflected(Extree *t)
{
    if (t->bm.marks) {
        g_array_set_size(t->bm.marks, 0);
    }
}

bool extree_bitmaps_have_marks(Extree *t)
{
    return t->bm.marks && t->bm.marks->len;
}

void extree_bitmaps_commit_done(Extree *t)
{
    if (t->bm.marks && !t->bm.marks_kept) {
        g_array_set_size(t->bm.marks, 0);
    }
    t->bm.held = 0;
    t->bm.chunks_changed = 0;
    if (t->bm.removed) {
        /* committed without them: no state a crash returns to has them */
        g_ptr_array_set_size(t->bm.removed, 0);
    }
    if (!t->bm.dirty) {
        extree_bitmaps_commit_space(t);
        return;
    }
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

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
    t->bm.dirty = false;
    extree_bitmaps_commit_space(t);
}

/* ---- Open: the directory and every chunk, validated ---- */

void extree_bitmaps_free(Extree *t)
{
    if (t->bm.list) {
        g_ptr_array_set_free_func(t->bm.list, (GDestroyNotify)extree_bm_free);
        g_ptr_array_free(t->bm.list, true);
        t->bm.list = NULL;
    }
    if (t->bm.removed) {
        g_ptr_array_free(t->bm.removed, true);
        t->bm.removed = NULL;
    }
    if (t->bm.marks) {
        g_array_free(t->bm.marks, true);
        t->bm.marks = NULL;
    }
    t->bm.dir = t->bm.dir_len = 0;
    t->bm.dirty = false;
    t->bm.enabled = 0;
    t->bm.chunks_changed = 0;
    g_free(t->bm.bad);
    t->bm.bad = NULL;
    /* the mark log's state goes with the bits it marked */
    t->bm.log = t->bm.log_len = 0;
    t->bm.log_ok = t->bm.dirty_logged = false;
    t->bm.log_next = t->bm.log_replayed = 0;
    extree_rs_clear(&t->bm.logged);
    g_free(t->bm.log_bad);
    t->bm.log_bad = NULL;
    if (t->bm.map_pending) {
        g_array_free(t->bm.map_pending, true);
        t->bm.map_pending = NULL;
    }
    if (t->bm.map_replay) {
        g_array_free(t->bm.map_replay, true);
        t->bm.map_replay = NULL;
    }
    extree_rs_clear(&t->bm.map_hosts);
    t->bm.map_replayed = 0;
    t->bm.unlogged = t->bm.logging = false;
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
    want_nch = extree_bm_nchunks_for(extree_bm_ngranules(t->virtual_size,
                                                         gbits),
                                     t->block_size);
    if (nch != want_nch) {
        return g_strdup_printf("bad nr_chunks %u, expect %" PRIu64, nch,
                               want_nch);
    }
    *used = extree_bm_entry_bytes(nlen, nch);
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
    if (extree_bm_too_big(t, nch)) {
        /* valid, but more than this implementation holds in memory */
        *big = g_strdup_printf("bitmap '%s' takes %" PRIu64 " bytes of "
                               "memory, more than %" PRIu64 "; 'qemu-img "
                               "check -r all' removes it", name,
                               (uint64_t)nch * t->block_size,
                               t->bm.max_bytes);
        g_free(name);
        *out = NULL;
        return NULL;
    }
    bm = extree_bm_new(t, name, gbits, flags & EXTREE_BITMAP_ENABLED);
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
            extree_bm_free(bm);
            return why;
        }
        if (!off && csum) {
            char *why = g_strdup_printf("bitmap '%s': chunk %" PRIu64
                                        " without offset has checksum",
                                        bm->name, c);
            extree_bm_free(bm);
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
    count = extree_bm_popcount(bm->bits, (size_t)bm->nchunks * t->block_size);
    bm->count = count;
    if (count != want_count) {
        return extree_corrupt(t, t->bm.dir, "corrupt bitmap directory at "
                              "offset 0x%" PRIx64 ": bitmap '%s' has %"
                              PRIu64 " granules set, its entry says %"
                              PRIu64, t->bm.dir, bm->name, count,
                              want_count);
    }
    return 0;
}

/*
 * A checker's handle (@tolerate) opens with damaged bitmaps left out:
 * t->bm.bad says what was wrong, and only a repair drops them from
 * the image (extree_bitmaps_drop_damaged()); their blocks are leaks then.
 */
static void note_bad(Extree *t)
{
    char *all = t->bm.bad ?
                g_strdup_printf("%s; %s", t->bm.bad, t->last_error) :
                g_strdup(t->last_error);

    g_free(t->bm.bad);
    t->bm.bad = all;
}

void extree_bitmaps_drop_damaged(Extree *t)
{
    g_free(t->bm.bad);
    t->bm.bad = NULL;
    extree_bm_changed(t);
}

void extree_bitmaps_forget(Extree *t, const bool *drop, bool dir)
{
    for (guint i = t->bm.list->len; i-- > 0;) {
        if (drop[i]) {
            extree_bm_drop(t, i);
        }
    }
    if (dir) {
        /* not freed at the commit either: another owner keeps it */
        t->bm.dir = t->bm.dir_len = 0;
    }
    extree_bm_changed(t);
}

/* No bitmap: after damage that fails (or, for a checker, skips) them */
static void bitmaps_reset(Extree *t)
{
    extree_bitmaps_free(t);
    t->bm.list = g_ptr_array_new();
    t->bm.marks = g_array_new(false, false, sizeof(ExtreeBitmapMark));
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

    t->bm.list = g_ptr_array_new();
    t->bm.marks = g_array_new(false, false, sizeof(ExtreeBitmapMark));
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
            g_ptr_array_add(t->bm.list, bm);
            g_hash_table_add(names, bm->name);
            t->bm.enabled += bm->enabled;
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
    t->bm.dir = sb->bitmap_dir;
    t->bm.dir_len = len;
    /* second pass for the counts: the entries are valid */
    for (guint i = 0; i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        ret = load_chunks(t, bm, bm->count);
        if (ret == -EIO && tolerate) {
            /* this one only: its chunks are leaks */
            note_bad(t);
            t->bm.enabled -= bm->enabled;
            g_ptr_array_remove_index(t->bm.list, i--);
            extree_bm_free(bm);
            ret = 0;
        } else if (ret < 0) {
            break;
        }
    }
    g_free(buf);
    if (ret < 0) {
        bitmaps_reset(t);
    }
    extree_bitmaps_commit_space(t);
    return ret;
}
