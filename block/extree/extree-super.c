/*
 * extree core: the superblock
 *
 * Two slots (LMDB's two meta pages): the commit of generation G writes
 * slot G % 2, so the previous generation stays intact in the other slot
 * until the new one is durable.  Open takes the valid slot with the
 * highest generation; a torn newer slot fails its checksum and the older
 * one is used.  Here: encode, decode and validate a slot, read both,
 * write one (after the check its own reader would make), and the corrupt
 * bit.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stddef.h>

#include "extree-int.h"

#define SB_OFF(f) offsetof(ExtreeDiskSuper, f)

static uint32_t sb_csum(const uint8_t *buf)
{
    uint8_t zero[4] = { 0 };
    uint32_t c = extree_crc32c(0, buf, SB_OFF(csum));
    c = extree_crc32c(c, zero, 4);
    return extree_crc32c(c, buf + SB_OFF(csum) + 4,
                         EXTREE_SB_SIZE - SB_OFF(csum) - 4);
}

/* Where the superblock keeps the root of tree @owner */
static size_t sb_root_off(uint32_t owner)
{
    switch (owner) {
    case EXTREE_TREE_FREE:
        return SB_OFF(free_root);
    case EXTREE_TREE_REFS:
        return SB_OFF(ref_root);
    default:
        return SB_OFF(extent_root);
    }
}

void extree_sb_encode(const ExtreeSuper *s, uint8_t *buf)
{
    size_t flen = strlen(s->backing_file), mlen = strlen(s->backing_fmt);

    memset(buf, 0, EXTREE_SB_SIZE);
    ext_st64(buf + SB_OFF(magic), EXTREE_MAGIC);
    ext_st32(buf + SB_OFF(version), EXTREE_VERSION);
    ext_st32(buf + SB_OFF(sb_size), EXTREE_SB_SIZE);
    ext_st64(buf + SB_OFF(generation), s->generation);
    ext_st64(buf + SB_OFF(incompat_features), s->incompat);
    ext_st64(buf + SB_OFF(compat_features), s->compat);
    ext_st64(buf + SB_OFF(autoclear_features), s->autoclear);
    ext_st64(buf + SB_OFF(virtual_size), s->virtual_size);
    ext_st32(buf + SB_OFF(block_size), s->block_size);
    ext_st32(buf + SB_OFF(node_size), s->node_size);
    ext_st64(buf + SB_OFF(host_end), s->host_end);
    for (uint32_t o = EXTREE_TREE_EXTENT; o < EXT_NTREES; o++) {
        extree_root_encode(buf + sb_root_off(o), s->root[o], s->root_gen[o],
                    s->root_level[o]);
    }
    ext_st64(buf + SB_OFF(extent_count), s->extent_count);
    ext_st64(buf + SB_OFF(free_bytes), s->free_bytes);
    ext_st64(buf + SB_OFF(extent_bytes), s->extent_bytes);
    ext_st64(buf + SB_OFF(snap_table_offset), s->snap_table);
    ext_st32(buf + SB_OFF(snap_count), s->snap_count);
    ext_st64(buf + SB_OFF(snap_generation), s->snap_gen);
    ext_st32(buf + SB_OFF(crypt_method), s->crypt_method);
    ext_st64(buf + SB_OFF(crypt_header_offset), s->crypt_header_offset);
    ext_st64(buf + SB_OFF(crypt_header_length), s->crypt_header_length);
    ext_st32(buf + SB_OFF(compression_type), s->compression_type);
    ext_st64(buf + SB_OFF(bitmap_dir_offset), s->bitmap_dir);
    ext_st32(buf + SB_OFF(bitmap_dir_length), s->bitmap_dir_len);
    ext_st32(buf + SB_OFF(bitmap_count), s->bitmap_count);
    ext_st64(buf + SB_OFF(mark_log_offset), s->mark_log);
    ext_st32(buf + SB_OFF(mark_log_length), s->mark_log_len);
    ext_st32(buf + SB_OFF(log_lag), s->log_lag);
    buf[SB_OFF(backing_file_len)] = flen & 0xff;
    buf[SB_OFF(backing_file_len) + 1] = flen >> 8;
    buf[SB_OFF(backing_fmt_len)] = mlen & 0xff;
    buf[SB_OFF(backing_fmt_len) + 1] = mlen >> 8;
    memcpy(buf + SB_OFF(backing_fmt), s->backing_fmt, mlen);
    memcpy(buf + SB_OFF(backing_file), s->backing_file, flen);
    ext_st32(buf + SB_OFF(csum), sb_csum(buf));
}

/*
 * The encryption fields of @s: all zero without the encryption bit; with
 * it, a known method and a header of 512-byte sectors right after the
 * superblock slots, at most EXTREE_CRYPT_HEADER_MAX long.  Checked before
 * data_start is derived from the header's length.
 */
static int decode_crypt(const ExtreeSuper *s, char **why)
{
    if (!(s->incompat & EXTREE_INCOMPAT_ENCRYPTED)) {
        if (s->crypt_method || s->crypt_header_offset ||
            s->crypt_header_length) {
            *why = g_strdup_printf("encryption fields set without the "
                                   "encryption feature, have crypt_method "
                                   "%u crypt_header_offset 0x%" PRIx64
                                   " crypt_header_length 0x%" PRIx64,
                                   s->crypt_method, s->crypt_header_offset,
                                   s->crypt_header_length);
            return -EINVAL;
        }
        return 0;
    }
    if (s->crypt_method != EXTREE_CRYPT_LUKS) {
        *why = g_strdup_printf("bad crypt_method %u with the encryption "
                               "feature, expect %u (LUKS)", s->crypt_method,
                               EXTREE_CRYPT_LUKS);
        return -EINVAL;
    }
    if (s->crypt_header_offset != EXTREE_CRYPT_HEADER_OFFSET) {
        *why = g_strdup_printf("bad crypt_header_offset, have 0x%" PRIx64
                               " expect 0x%x", s->crypt_header_offset,
                               EXTREE_CRYPT_HEADER_OFFSET);
        return -EINVAL;
    }
    if (s->crypt_header_length == 0 ||
        !EXTREE_IS_ALIGNED(s->crypt_header_length,
                           EXTREE_CRYPT_HEADER_ALIGN) ||
        s->crypt_header_length > EXTREE_CRYPT_HEADER_MAX) {
        *why = g_strdup_printf("bad crypt_header_length 0x%" PRIx64 " (a "
                               "nonzero multiple of %d, at most 0x%x)",
                               s->crypt_header_length,
                               EXTREE_CRYPT_HEADER_ALIGN,
                               EXTREE_CRYPT_HEADER_MAX);
        return -EINVAL;
    }
    return 0;
}

/*
 * Decode and validate a superblock slot.  -EINVAL (bad magic or field),
 * -ENOTSUP (version), -EIO (checksum); *@why says what.  *@sum_ok tells
 * whether magic and checksum were right: a slot that fails after that was
 * not torn by a crash.
 */
int extree_sb_decode(const uint8_t *buf, ExtreeSuper *s, char **why,
                     bool *sum_ok)
{
    uint64_t magic = ext_ld64(buf + SB_OFF(magic));
    uint32_t version = ext_ld32(buf + SB_OFF(version));
    uint32_t csum = ext_ld32(buf + SB_OFF(csum)), want;
    uint64_t data_start, key_bytes;
    unsigned flen, mlen;
    bool snaps;
    int ret;

    *sum_ok = false;
    if (magic != EXTREE_MAGIC) {
        *why = g_strdup_printf("bad magic, have 0x%016" PRIx64 " expect 0x%016"
                               PRIx64, magic, (uint64_t)EXTREE_MAGIC);
        return -EINVAL;
    }
    want = sb_csum(buf);
    if (csum != want) {
        *why = g_strdup_printf("bad checksum, have 0x%08x expect 0x%08x",
                               csum, want);
        return -EIO;
    }
    *sum_ok = true;
    if (version != EXTREE_VERSION) {
        *why = g_strdup_printf("unsupported version, have %u expect %u",
                               version, EXTREE_VERSION);
        return -ENOTSUP;
    }
    if (ext_ld32(buf + SB_OFF(sb_size)) != EXTREE_SB_SIZE) {
        *why = g_strdup_printf("bad sb_size, have %u expect %u",
                               ext_ld32(buf + SB_OFF(sb_size)),
                               EXTREE_SB_SIZE);
        return -EINVAL;
    }
    memset(s, 0, sizeof(*s));
    s->generation = ext_ld64(buf + SB_OFF(generation));
    s->incompat = ext_ld64(buf + SB_OFF(incompat_features));
    s->compat = ext_ld64(buf + SB_OFF(compat_features));
    s->autoclear = ext_ld64(buf + SB_OFF(autoclear_features));
    s->virtual_size = ext_ld64(buf + SB_OFF(virtual_size));
    s->block_size = ext_ld32(buf + SB_OFF(block_size));
    s->node_size = ext_ld32(buf + SB_OFF(node_size));
    s->host_end = ext_ld64(buf + SB_OFF(host_end));
    /* the reference count tree's too: all zero without snapshots */
    for (uint32_t o = EXTREE_TREE_EXTENT; o < EXT_NTREES; o++) {
        const uint8_t *r = buf + sb_root_off(o);
        s->root[o] = ext_ld64(r + EXT_RT_BYTENR);
        s->root_gen[o] = ext_ld64(r + EXT_RT_GEN);
        s->root_level[o] = r[EXT_RT_LEVEL];
    }
    s->extent_count = ext_ld64(buf + SB_OFF(extent_count));
    s->free_bytes = ext_ld64(buf + SB_OFF(free_bytes));
    s->extent_bytes = ext_ld64(buf + SB_OFF(extent_bytes));
    s->snap_table = ext_ld64(buf + SB_OFF(snap_table_offset));
    s->snap_count = ext_ld32(buf + SB_OFF(snap_count));
    s->snap_gen = ext_ld64(buf + SB_OFF(snap_generation));
    s->crypt_method = ext_ld32(buf + SB_OFF(crypt_method));
    s->crypt_header_offset = ext_ld64(buf + SB_OFF(crypt_header_offset));
    s->crypt_header_length = ext_ld64(buf + SB_OFF(crypt_header_length));
    s->compression_type = ext_ld32(buf + SB_OFF(compression_type));
    s->bitmap_dir = ext_ld64(buf + SB_OFF(bitmap_dir_offset));
    s->bitmap_dir_len = ext_ld32(buf + SB_OFF(bitmap_dir_length));
    s->bitmap_count = ext_ld32(buf + SB_OFF(bitmap_count));
    s->mark_log = ext_ld64(buf + SB_OFF(mark_log_offset));
    s->mark_log_len = ext_ld32(buf + SB_OFF(mark_log_length));
    s->log_lag = ext_ld32(buf + SB_OFF(log_lag));
    flen = buf[SB_OFF(backing_file_len)] |
           (buf[SB_OFF(backing_file_len) + 1] << 8);
    mlen = buf[SB_OFF(backing_fmt_len)] |
           (buf[SB_OFF(backing_fmt_len) + 1] << 8);

    if (s->generation == 0 || s->generation > EXTREE_MAX_GENERATION) {
        *why = g_strdup_printf("bad generation %" PRIu64 " (max %" PRIu64 ")",
                               s->generation,
                               (uint64_t)EXTREE_MAX_GENERATION);
        return -EINVAL;
    }
    if (!extree_is_pow2_in(s->block_size, EXTREE_MIN_BLOCK_SIZE,
                    EXTREE_MAX_BLOCK_SIZE)) {
        *why = g_strdup_printf("bad block_size %u", s->block_size);
        return -EINVAL;
    }
    if (!extree_is_pow2_in(s->node_size, EXTREE_MIN_NODE_SIZE,
                    EXTREE_MAX_NODE_SIZE) || s->node_size < s->block_size) {
        *why = g_strdup_printf("bad node_size %u (block_size %u)",
                               s->node_size, s->block_size);
        return -EINVAL;
    }
    if (s->virtual_size % 512 || s->virtual_size > EXTREE_MAX_VIRTUAL_SIZE) {
        *why = g_strdup_printf("bad virtual_size 0x%" PRIx64,
                               s->virtual_size);
        return -EINVAL;
    }
    /* the encryption header decides where the data area starts */
    ret = decode_crypt(s, why);
    if (ret < 0) {
        return ret;
    }
    if (s->compression_type > EXTREE_COMPRESS_ZSTD) {
        *why = g_strdup_printf("bad compression_type %u (0 to %d)",
                               s->compression_type, EXTREE_COMPRESS_ZSTD);
        return -EINVAL;
    }
    data_start = extree_sb_data_start(s);
    if (!EXTREE_IS_ALIGNED(s->host_end, s->block_size) ||
        s->host_end < data_start + s->node_size ||
        s->host_end > (uint64_t)INT64_MAX) {
        if (s->crypt_header_length) {
            *why = g_strdup_printf("bad host_end 0x%" PRIx64 " (data_start "
                                   "0x%" PRIx64 " after crypt_header_length"
                                   " 0x%" PRIx64 ")", s->host_end,
                                   data_start, s->crypt_header_length);
        } else {
            *why = g_strdup_printf("bad host_end 0x%" PRIx64, s->host_end);
        }
        return -EINVAL;
    }
    snaps = s->incompat & EXTREE_INCOMPAT_SNAPSHOTS;
    if (!snaps && (s->root[EXTREE_TREE_REFS] ||
                   s->root_gen[EXTREE_TREE_REFS] ||
                   s->root_level[EXTREE_TREE_REFS] || s->snap_table ||
                   s->snap_count || s->snap_gen)) {
        *why = g_strdup("snapshot fields set without the snapshots "
                        "feature");
        return -EINVAL;
    }
    if (snaps && s->virtual_size > EXTREE_SNAP_MAX_VIRTUAL_SIZE) {
        *why = g_strdup_printf("bad virtual_size 0x%" PRIx64 " (max 0x%"
                               PRIx64 " with snapshots)", s->virtual_size,
                               EXTREE_SNAP_MAX_VIRTUAL_SIZE);
        return -EINVAL;
    }
    if (snaps && (s->snap_count > EXTREE_MAX_SNAPSHOTS ||
                  s->snap_gen > s->generation + 1 ||
                  (s->snap_count == 0) != (s->snap_table == 0) ||
                  (s->snap_table &&
                   (!EXTREE_IS_ALIGNED(s->snap_table, s->block_size) ||
                    s->snap_table < data_start ||
                    s->snap_table >= s->host_end ||
                    s->host_end - s->snap_table <
                    extree_snap_table_bytes(s->snap_count, s->block_size))))) {
        *why = g_strdup_printf("bad snapshot table, have offset 0x%" PRIx64
                               " count %u snap_generation %" PRIu64,
                               s->snap_table, s->snap_count, s->snap_gen);
        return -EINVAL;
    }
    if (!(s->incompat & EXTREE_INCOMPAT_BITMAPS) &&
        (s->bitmap_dir || s->bitmap_dir_len || s->bitmap_count)) {
        *why = g_strdup("bitmap fields set without the bitmaps feature");
        return -EINVAL;
    }
    if ((s->bitmap_count == 0) != (s->bitmap_dir == 0) ||
        (s->bitmap_count == 0) != (s->bitmap_dir_len == 0) ||
        s->bitmap_count > EXTREE_MAX_BITMAPS ||
        (s->bitmap_dir &&
         (!EXTREE_IS_ALIGNED(s->bitmap_dir, s->block_size) ||
          s->bitmap_dir < data_start || s->bitmap_dir >= s->host_end ||
          s->bitmap_dir_len < sizeof(ExtreeDiskBitmapHeader) ||
          s->bitmap_dir_len > EXTREE_BITMAP_DIR_MAX ||
          s->host_end - s->bitmap_dir <
          EXTREE_ROUND_UP(s->bitmap_dir_len, s->block_size)))) {
        *why = g_strdup_printf("bad bitmap directory, have offset 0x%" PRIx64
                               " length %u count %u", s->bitmap_dir,
                               s->bitmap_dir_len, s->bitmap_count);
        return -EINVAL;
    }
    if (!(s->incompat & EXTREE_INCOMPAT_MARK_LOG) !=
        (!s->mark_log && !s->mark_log_len) ||
        (s->mark_log &&
         (!(s->incompat & (EXTREE_INCOMPAT_BITMAPS |
                           EXTREE_INCOMPAT_MAP_LOG)) ||
          !EXTREE_IS_ALIGNED(s->mark_log, s->block_size) ||
          !EXTREE_IS_ALIGNED(s->mark_log_len, s->block_size) ||
          !EXTREE_IS_ALIGNED(s->mark_log_len, EXTREE_MARK_LOG_RECORD) ||
          s->mark_log_len < EXTREE_MARK_LOG_MIN ||
          s->mark_log_len > EXTREE_MARK_LOG_MAX ||
          s->mark_log < data_start || s->mark_log >= s->host_end ||
          s->host_end - s->mark_log < s->mark_log_len))) {
        *why = g_strdup_printf("bad mark log, have offset 0x%" PRIx64
                               " length %u", s->mark_log, s->mark_log_len);
        return -EINVAL;
    }
    if ((s->incompat & EXTREE_INCOMPAT_MAP_LOG) &&
        !(s->incompat & EXTREE_INCOMPAT_MARK_LOG)) {
        *why = g_strdup("map log feature without a mark log");
        return -EINVAL;
    }
    if (!(s->incompat & EXTREE_INCOMPAT_LOG_LAG) != !s->log_lag ||
        (s->log_lag && (!(s->incompat & EXTREE_INCOMPAT_MAP_LOG) ||
                        s->log_lag > s->generation))) {
        *why = g_strdup_printf("bad log lag %u", s->log_lag);
        return -EINVAL;
    }
    for (uint32_t o = EXTREE_TREE_EXTENT;
         o <= (snaps ? EXTREE_TREE_REFS : EXTREE_TREE_FREE); o++) {
        if (!EXTREE_IS_ALIGNED(s->root[o], s->block_size) ||
            s->root[o] < data_start || s->root[o] >= s->host_end ||
            s->host_end - s->root[o] < s->node_size ||
            s->root_gen[o] == 0 || s->root_gen[o] > s->generation ||
            s->root_level[o] >= EXTREE_MAX_LEVELS) {
            *why = g_strdup_printf("bad %s root, have offset 0x%" PRIx64
                                   " generation %" PRIu64 " level %u",
                                   extree_tree_name(o), s->root[o],
                                   s->root_gen[o], s->root_level[o]);
            return -EINVAL;
        }
    }
    key_bytes = EXTREE_ROUND_UP(s->virtual_size, s->block_size) +
                (snaps ? EXTREE_VMSTATE_MAX : 0);
    if (s->extent_count > key_bytes / s->block_size) {
        *why = g_strdup_printf("bad extent_count %" PRIu64 " (max %" PRIu64
                               ")", s->extent_count,
                               key_bytes / s->block_size);
        return -EINVAL;
    }
    if ((s->autoclear & EXTREE_AUTOCLEAR_EXTENT_BYTES) &&
        (!EXTREE_IS_ALIGNED(s->extent_bytes, s->block_size) ||
         s->extent_bytes > key_bytes)) {
        *why = g_strdup_printf("bad extent_bytes 0x%" PRIx64,
                               s->extent_bytes);
        return -EINVAL;
    }
    if (s->free_bytes > s->host_end - data_start ||
        !EXTREE_IS_ALIGNED(s->free_bytes, s->block_size)) {
        *why = g_strdup_printf("bad free_bytes 0x%" PRIx64, s->free_bytes);
        return -EINVAL;
    }
    if (flen > EXTREE_BACKING_FILE_MAX || mlen > EXTREE_BACKING_FMT_MAX ||
        memchr(buf + SB_OFF(backing_file), 0, flen) ||
        memchr(buf + SB_OFF(backing_fmt), 0, mlen) || (mlen && !flen) ||
        !extree_all_zero(buf + SB_OFF(backing_file) + flen,
                  EXTREE_BACKING_FILE_MAX + 1 - flen) ||
        !extree_all_zero(buf + SB_OFF(backing_fmt) + mlen,
                  EXTREE_BACKING_FMT_MAX + 1 - mlen)) {
        *why = g_strdup_printf("bad backing file name (length %u, format "
                               "length %u)", flen, mlen);
        return -EINVAL;
    }
    memcpy(s->backing_file, buf + SB_OFF(backing_file), flen);
    memcpy(s->backing_fmt, buf + SB_OFF(backing_fmt), mlen);
    return 0;
}

/* The superblock describing the in-memory state */
void extree_sb_from_tree(Extree *t, ExtreeSuper *s)
{
    memset(s, 0, sizeof(*s));
    s->generation = t->trans_gen;
    s->incompat = t->incompat;
    s->compat = t->compat;
    s->virtual_size = t->virtual_size;
    s->block_size = t->block_size;
    s->node_size = t->node_size;
    s->host_end = t->host_end;
    EXT_FOR_EACH_TREE(o) {
        s->root[o] = t->trees[o].root;
        s->root_gen[o] = t->trees[o].root_gen;
        s->root_level[o] = t->trees[o].level;
    }
    s->extent_count = t->trees[EXTREE_TREE_EXTENT].nitems;
    s->free_bytes = t->trees[EXTREE_TREE_FREE].total;
    s->extent_bytes = t->trees[EXTREE_TREE_EXTENT].total;
    s->autoclear = EXTREE_AUTOCLEAR_EXTENT_BYTES;
    s->crypt_method = t->crypt_method;
    s->crypt_header_offset = t->crypt_header_offset;
    s->crypt_header_length = t->crypt_header_length;
    s->compression_type = t->compression_type;
    s->bitmap_dir = t->bm.dir;
    s->bitmap_dir_len = t->bm.dir_len;
    s->bitmap_count = t->bm.list ? t->bm.list->len : 0;
    s->mark_log = t->bm.log;
    s->mark_log_len = t->bm.log_len;
    if (extree_has_refs(t)) {
        ExtreeTree *rt = &t->trees[EXTREE_TREE_REFS];

        s->root[EXTREE_TREE_REFS] = rt->root;
        s->root_gen[EXTREE_TREE_REFS] = rt->root_gen;
        s->root_level[EXTREE_TREE_REFS] = rt->level;
        s->snap_table = t->snap.table;
        s->snap_count = t->snap.list ? t->snap.list->len : 0;
        s->snap_gen = t->snap.gen;
    }
    g_strlcpy(s->backing_file, t->backing_file ? t->backing_file : "",
              sizeof(s->backing_file));
    g_strlcpy(s->backing_fmt, t->backing_fmt ? t->backing_fmt : "",
              sizeof(s->backing_fmt));
}

/*
 * Write superblock @s into its slot, after the validation a reader applies
 * to it: a writer must never commit what its own reader would reject (the
 * image would fall back to an older generation, or be lost).  -EIO with
 * *@why (g_malloc'd) if @s is invalid; nothing is written then.
 */
int extree_sb_write(ExtreeBackend *be, const ExtreeSuper *s, char **why)
{
    uint8_t *buf = g_malloc(EXTREE_SB_SIZE);
    ExtreeSuper check;
    bool sum_ok;
    int ret;

    *why = NULL;
    extree_sb_encode(s, buf);
    if (extree_sb_decode(buf, &check, why, &sum_ok) < 0) {
        g_free(buf);
        return -EIO;
    }
    ret = be->ops->pwrite(be->opaque, (s->generation % 2) * EXTREE_SB_SIZE,
                          buf, EXTREE_SB_SIZE);
    g_free(buf);
    return ret;
}

/* Check @s as a reader would, without writing it: invalid is corruption */
int extree_sb_check(Extree *t, const ExtreeSuper *s)
{
    uint8_t *buf = g_malloc(EXTREE_SB_SIZE);
    ExtreeSuper check;
    char *why = NULL;
    bool sum_ok;
    int ret = 0;

    extree_sb_encode(s, buf);
    if (extree_sb_decode(buf, &check, &why, &sum_ok) < 0) {
        ret = extree_corrupt(t, (s->generation % 2) * EXTREE_SB_SIZE,
                             "corrupt superblock at offset 0x%" PRIx64
                             ": refusing to commit generation %" PRIu64
                             " with %s", (s->generation % 2) *
                             (uint64_t)EXTREE_SB_SIZE, s->generation, why);
        g_free(why);
    }
    g_free(buf);
    return ret;
}

/* extree_sb_write() for a handle: an invalid superblock is corruption */
int extree_sb_write_t(Extree *t, const ExtreeSuper *s)
{
    char *why = NULL;
    int ret = extree_sb_check(t, s);

    if (ret == 0) {
        ret = extree_sb_write(t->be, s, &why);
        g_free(why);
    }
    return ret;
}

/*
 * Read and decode both superblock slots; *@best is the valid one with the
 * highest generation, or -1 (then *@errmsg says why, and the return value
 * is the error).  @skip describes the other slot if it is invalid.
 */
int extree_sb_read(ExtreeBackend *be, ExtreeSuper sb[2], int *best,
                   char **errmsg, ExtreeSkipped *skip)
{
    uint8_t *buf = g_malloc(2 * EXTREE_SB_SIZE);
    char *why[2] = { NULL, NULL };
    bool sum_ok[2] = { false, false };
    uint64_t raw_gen[2] = { 0, 0 };
    uint32_t ver[2] = { 0, 0 };
    int rc[2], ret = 0;

    memset(skip, 0, sizeof(*skip));
    *best = -1;
    /*
     * Both slots with one request (one wait fewer at every open); slot by
     * slot after an error, so that a bad sector costs only its own slot
     */
    rc[0] = rc[1] = be->ops->pread(be->opaque, 0, buf, 2 * EXTREE_SB_SIZE);
    for (int i = 0; i < 2; i++) {
        uint8_t *sbuf = buf + i * EXTREE_SB_SIZE;

        if (rc[i] < 0) {
            rc[i] = be->ops->pread(be->opaque, i * EXTREE_SB_SIZE, sbuf,
                                   EXTREE_SB_SIZE);
        }
        if (rc[i] < 0) {
            why[i] = g_strdup_printf("read error: %s", g_strerror(-rc[i]));
        } else {
            rc[i] = extree_sb_decode(sbuf, &sb[i], &why[i], &sum_ok[i]);
            raw_gen[i] = ext_ld64(sbuf + SB_OFF(generation));
            ver[i] = ext_ld32(sbuf + SB_OFF(version));
        }
        if (rc[i] == 0 && (*best < 0 ||
                           sb[i].generation > sb[*best].generation)) {
            *best = i;
        }
    }
    g_free(buf);
    if (*best < 0 && rc[0] == -ENOTSUP && rc[1] == -ENOTSUP &&
        ver[0] == ver[1]) {
        /* Intact, but of another version: not damage */
        *errmsg = g_strdup_printf("unsupported extree version %u (this "
                                  "implementation reads version %u)",
                                  ver[0], EXTREE_VERSION);
        ret = -ENOTSUP;
    } else if (*best < 0) {
        /* Neither slot: report slot 0's problem first, it has the magic */
        ret = rc[0];
        if (rc[0] == -EINVAL && rc[1] != -EINVAL) {
            ret = rc[1];
        }
        skip->both_bad = true;
        *errmsg = g_strdup_printf("corrupt superblock at offset 0x0: %s; "
                                  "corrupt superblock at offset 0x1000: %s",
                                  why[0], why[1]);
    } else if (rc[!*best] < 0) {
        int i = !*best;
        skip->skipped = true;
        skip->sum_ok = sum_ok[i];
        skip->raw_gen = raw_gen[i];
        if (sum_ok[i]) {
            skip->why = g_strdup_printf("corrupt superblock at offset 0x%x: "
                                        "%s; slot skipped (its generation "
                                        "field is %" PRIu64 "), image opened"
                                        " at generation %" PRIu64 " from "
                                        "offset 0x%x", i * EXTREE_SB_SIZE,
                                        why[i], raw_gen[i],
                                        sb[*best].generation,
                                        *best * EXTREE_SB_SIZE);
        } else {
            skip->why = g_strdup_printf("corrupt superblock at offset 0x%x: "
                                        "%s; slot skipped, image opened at "
                                        "generation %" PRIu64 " from offset "
                                        "0x%x", i * EXTREE_SB_SIZE, why[i],
                                        sb[*best].generation,
                                        *best * EXTREE_SB_SIZE);
        }
    }
    g_free(why[0]);
    g_free(why[1]);
    return ret;
}

/*
 * @s one generation later with the corrupt bit: a superblock, not a
 * commit.  The state stays that of @s, so the chain to replay stays the
 * one @s's readers replay: its lag grows by one (spec: Map records, rule
 * 5), or the writes only map records hold would be lost.
 */
static void sb_mark_corrupt(ExtreeSuper *s)
{
    s->generation++;
    s->incompat |= EXTREE_INCOMPAT_CORRUPT;
    s->autoclear &= EXTREE_AUTOCLEAR_MASK;
    if (s->incompat & EXTREE_INCOMPAT_MARK_LOG) {
        s->log_lag++;
        s->incompat |= EXTREE_INCOMPAT_MAP_LOG | EXTREE_INCOMPAT_LOG_LAG;
    }
}

int extree_mark_corrupt(Extree *t)
{
    ExtreeSuper s = *t->csb;
    int ret;

    t->incompat |= EXTREE_INCOMPAT_CORRUPT;
    t->broken = true;
    /* no record after the chain of the state marked: nothing replays it */
    t->bm.log_ok = false;
    if (t->read_only || (s.incompat & EXTREE_INCOMPAT_CORRUPT)) {
        /* (a repair that finds more: the superblock says so already) */
        return 0;
    }
    sb_mark_corrupt(&s);
    ret = extree_sb_write_t(t, &s);
    if (ret == 0) {
        ret = t->be->ops->flush(t->be->opaque);
    }
    if (ret == 0) {
        *t->csb = s;
        t->generation = s.generation;
        t->trans_gen = s.generation + 1;
    }
    return ret;
}

/*
 * Without a handle: the newest valid superblock again, one generation
 * later, with the corrupt bit.  Reads nothing but the two slots, so it works
 * whatever else is damaged.
 */
int extree_mark_corrupt_image(ExtreeBackend *be)
{
    ExtreeSuper sb[2];
    ExtreeSkipped skip;
    char *msg = NULL;
    int best, ret;

    ret = extree_sb_read(be, sb, &best, &msg, &skip);
    g_free(msg);
    g_free(skip.why);
    if (best < 0) {
        return ret;
    }
    if (sb[best].incompat & ~EXTREE_INCOMPAT_MASK) {
        return -ENOTSUP;
    }
    /*
     * The slot written next holds a newer superblock with a bad field:
     * the only copy of the newest state, perhaps repairable by hand
     */
    if (skip.skipped && skip.sum_ok &&
        skip.raw_gen > sb[best].generation) {
        return -EEXIST;
    }
    if (sb[best].incompat & EXTREE_INCOMPAT_CORRUPT) {
        return 0;
    }
    sb_mark_corrupt(&sb[best]);
    ret = extree_sb_write(be, &sb[best], &msg);
    g_free(msg);
    if (ret == 0) {
        ret = be->ops->flush(be->opaque);
    }
    return ret;
}
