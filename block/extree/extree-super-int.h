/*
 * extree core: below the transaction layer, what extree-txn.c and the
 * checker call of the superblock (extree-super.c), the snapshot table
 * (extree-snaptab.c), the bitmaps' and the mark log's load and commit
 * steps (extree-bitmap*.c, extree-marklog.c) and the image's creation
 * (extree-init.c).  Included by extree-int.h, after struct Extree.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef BLOCK_EXTREE_SUPER_INT_H
#define BLOCK_EXTREE_SUPER_INT_H

/* CPU view of ExtreeDiskSuper */
typedef struct ExtreeSuper {
    uint64_t generation, incompat, compat, autoclear;
    uint64_t virtual_size, host_end;
    uint32_t block_size, node_size;
    /* indexed by tree owner (EXT_NTREES) */
    uint64_t root[EXT_NTREES], root_gen[EXT_NTREES];
    unsigned root_level[EXT_NTREES];
    uint64_t extent_count, free_bytes;
    uint64_t extent_bytes;      /* valid with EXTREE_AUTOCLEAR_EXTENT_BYTES */
    /* with EXTREE_INCOMPAT_SNAPSHOTS, root[EXTREE_TREE_REFS] too */
    uint64_t snap_table, snap_gen;
    uint32_t snap_count;
    /* with EXTREE_INCOMPAT_ENCRYPTED; 0 without */
    uint32_t crypt_method;
    uint64_t crypt_header_offset, crypt_header_length;
    uint32_t compression_type;
    /* with EXTREE_INCOMPAT_BITMAPS; 0 without */
    uint64_t bitmap_dir;
    uint32_t bitmap_dir_len, bitmap_count;
    /* with EXTREE_INCOMPAT_MARK_LOG; 0 without */
    uint64_t mark_log;
    uint32_t mark_log_len;
    /*
     * with EXTREE_INCOMPAT_LOG_LAG, else 0: the chain replayed is that of
     * generation + 1 - log_lag
     */
    uint32_t log_lag;
    char backing_file[EXTREE_BACKING_FILE_MAX + 1];
    char backing_fmt[EXTREE_BACKING_FMT_MAX + 1];
} ExtreeSuper;

/* What extree_sb_read() found out about the slot it did not use */
typedef struct ExtreeSkipped {
    bool both_bad;              /* no slot valid: damage, not a version */
    bool skipped;               /* the slot is invalid */
    bool sum_ok;                /* ... but magic and checksum were right */
    uint64_t raw_gen;           /* its generation field, as stored */
    /*
     * "corrupt superblock at offset 0x..: ..; slot skipped, ..." (g_malloc'd)
     */
    char *why;
} ExtreeSkipped;

/* Little helpers of the on-disk checks */
static inline bool extree_all_zero(const uint8_t *p, size_t len)
{
    return len == 0 || (p[0] == 0 && memcmp(p, p + 1, len - 1) == 0);
}

static inline bool extree_is_pow2_in(uint64_t v, uint64_t lo, uint64_t hi)
{
    return v >= lo && v <= hi && (v & (v - 1)) == 0;
}

static inline void extree_root_encode(uint8_t *p, uint64_t bytenr,
                                      uint64_t gen, unsigned level)
{
    ext_st64(p + EXT_RT_BYTENR, bytenr);
    ext_st64(p + EXT_RT_GEN, gen);
    p[EXT_RT_LEVEL] = level;
}

/* Bytes of a snapshot table of @count entries */
static inline uint64_t extree_snap_table_bytes(uint32_t count,
                                               uint32_t block_size)
{
    return EXTREE_ROUND_UP(sizeof(ExtreeDiskSnapHeader) +
                           (uint64_t)count * EXTREE_SNAP_ENTRY_SIZE,
                           block_size);
}

/*
 * Start of the data area: the first block boundary after the superblock
 * slots and the encryption header (@crypt_header_length, 0 without one).
 * The one place it is computed; extree_sb_data_start() for a superblock.
 */
static inline uint64_t extree_data_start_for(uint32_t block_size,
                                             uint64_t crypt_header_length)
{
    return EXTREE_ROUND_UP(EXTREE_SB_AREA + crypt_header_length, block_size);
}

/* data_start of superblock @s, whose fields were validated */
static inline uint64_t extree_sb_data_start(const struct ExtreeSuper *s)
{
    return extree_data_start_for(s->block_size, s->crypt_header_length);
}

/* g_array_sort() order of uint64_t */
static inline gint extree_u64_cmp(gconstpointer a, gconstpointer b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* extree-super.c */
void extree_sb_encode(const ExtreeSuper *s, uint8_t *buf);
int extree_sb_decode(const uint8_t *buf, ExtreeSuper *s, char **why,
                     bool *sum_ok);
void extree_sb_from_tree(Extree *t, ExtreeSuper *s);
int extree_sb_write(ExtreeBackend *be, const ExtreeSuper *s, char **why);
int extree_sb_check(Extree *t, const ExtreeSuper *s);
int extree_sb_write_t(Extree *t, const ExtreeSuper *s);
int extree_sb_read(ExtreeBackend *be, ExtreeSuper sb[2], int *best,
                   char **errmsg, ExtreeSkipped *skip);

/* extree-snaptab.c */
int extree_snap_table_load(Extree *t, const ExtreeSuper *sb);

/* extree-bitmap.c */
/*
 * Bits set in [p, p + len): the popcnt instruction where the CPU has it,
 * unless @software (tests compare the two)
 */
uint64_t extree_popcount(const uint8_t *p, size_t len, bool software);
/* Writes held out of place by marks not yet committed that ask for one */
#define EXTREE_BITMAP_COMMIT_HELD 256
int extree_bitmaps_load(Extree *t, const ExtreeSuper *sb, bool tolerate);
void extree_bitmaps_drop_damaged(Extree *t);
/*
 * A repair's: the bitmaps @drop says (by index) go without giving their
 * blocks back, and the directory too if @dir; the caller rebuilds the
 * free-space tree from what is in use, since another structure may own a
 * block they claim
 */
void extree_bitmaps_forget(Extree *t, const bool *drop, bool dir);
void extree_bitmaps_free(Extree *t);
int extree_bitmaps_resize_ok(Extree *t, uint64_t size);
void extree_bitmaps_commit_space(Extree *t);
/* Nodes marking guest [guest, + bytes) adds to the next commit */
uint64_t extree_bitmaps_mark_space(Extree *t, uint64_t guest, uint64_t bytes);
int extree_bitmaps_resize(Extree *t, uint64_t size);
int extree_bitmaps_prepare(Extree *t);
int extree_bitmaps_write(Extree *t);
void extree_bitmaps_commit_done(Extree *t);
/*
 * Marks whose durability the mark log provides: set like
 * extree_bitmaps_mark()'s, but they leave the handle clean (t->bm.dirty_logged)
 */
void extree_bitmaps_mark_logged(Extree *t, uint64_t guest, uint64_t bytes);
/* Records of the log: [@guest, + @bytes) is marked durably */
void extree_bitmaps_logged_add(Extree *t, uint64_t guest, uint64_t bytes);
/* The granularity of the finest bitmap (block_size without one) */
uint64_t extree_bitmaps_min_granule(Extree *t);

/* extree-marklog.c */
/* Default size of a new mark log: 512 records */
#define EXTREE_MARK_LOG_DEFAULT (2 * 1024 * 1024)
int extree_mark_log_load(Extree *t, const ExtreeSuper *sb, bool tolerate);
/* The log is usable and has a slot free */
bool extree_mark_log_room(const Extree *t);
int extree_mark_log_commit_prepare(Extree *t);
void extree_mark_log_commit_done(Extree *t);
/* Map records: what a replay reads at most before a checkpoint commits */
#define EXTREE_MAP_LOG_MAX_BYTES (256 * 1024 * 1024)
/*
 * Flushes of a handle that had to commit, with no log, before the next
 * commit adds a log for map records to an image without bitmaps: an image
 * flushed that often (a database, a booting guest) gains one device flush
 * a flush; one written and flushed a few times keeps its layout
 */
#define EXTREE_MAP_LOG_AFTER    8
void extree_map_log_add(Extree *t, uint64_t guest, uint64_t bytes,
                        uint64_t host, uint32_t csum);
/* Does a map entry of the chain or waiting for one map host bytes here? */
bool extree_map_log_hosts(Extree *t, uint64_t host, uint64_t bytes);

/* extree-snaptab.c */
uint8_t *extree_snap_table_encode(Extree *t, uint64_t *len);
int extree_snap_table_moved(Extree *t);

/* extree-init.c */
/* Whether a backing file name and format can be stored (*@errmsg why not) */
int extree_check_backing(const char *file, const char *fmt, char **errmsg);

#endif /* BLOCK_EXTREE_SUPER_INT_H */
