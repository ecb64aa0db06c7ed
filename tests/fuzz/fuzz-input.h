/*
 * extree fuzzing: the input format and a raw image parser shared by the
 * fuzz target, its structure-aware mutator and the seed generator
 *
 * An input is an extree image, optionally followed by a trailer that
 * records how the mutator changed it:
 *
 *   image | record 0 | record 1 | ... | footer (FzFooter, 24 bytes)
 *   record:     offset (u64) | length (u32) | the image bytes at
 *               [offset, offset + length) *before* this edit
 *
 * Undoing the records from the last to the first gives back the image the
 * mutator started from; the footer holds its crc32c, so an input whose
 * image bytes were changed some other way is recognised and fuzzed without
 * the oracle.  An input without a valid footer is an image and nothing
 * else (the seeds).
 *
 * The image is either the file as it is (the seeds) or, as the mutator
 * writes it, sparse: magic (u64 FZ_SPARSE_MAGIC) | length (u64) | runs of
 * offset (u64) | length (u32) | bytes, everything else zero.  Images are
 * mostly free space: sparse, the inputs stay small, and so do the corpus
 * and the cost of copying them around.  All integers are little-endian.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef TESTS_FUZZ_FUZZ_INPUT_H
#define TESTS_FUZZ_FUZZ_INPUT_H

#include "extree-int.h"

#define FZ_MAGIC        0x5a465458u     /* "XTFZ" */
#define FZ_SPARSE_MAGIC 0x45535241505346ULL     /* "FSPARSE" */
#define FZ_FOOTER_SIZE  24
#define FZ_REC_HDR      12
#define FZ_RUN_HDR      12
#define FZ_MAX_RECORDS  24
#define FZ_MAX_IMAGE    (16 << 20)
#define FZ_SECTOR       512

/* Trailer fields at the end of an input */
typedef struct FzFooter {
    uint64_t ops_seed;          /* drives the target's queries and writes */
    uint32_t orig_crc;          /* crc32c of the image with records undone */
    uint32_t nrec;
    uint32_t trailer_len;       /* records + footer */
} FzFooter;

typedef struct FzRecord {
    uint64_t off;
    uint32_t len;
    const uint8_t *orig;        /* into the input */
} FzRecord;

typedef struct FzInput {
    const uint8_t *raw;         /* the image as stored in the input */
    size_t raw_len;
    bool sparse;
    size_t img_len;             /* the image's length */
    bool has_trailer;
    FzFooter f;
    FzRecord rec[FZ_MAX_RECORDS];
} FzInput;

/* Check a sparse image's runs and set img_len; false if malformed */
static inline bool fz_sparse_parse(FzInput *in)
{
    const uint8_t *p = in->raw + 16, *end = in->raw + in->raw_len;
    uint64_t len = ext_ld64(in->raw + 8);

    if (len > FZ_MAX_IMAGE) {
        return false;
    }
    while (p < end) {
        uint64_t off;
        uint32_t n;

        if (end - p < FZ_RUN_HDR) {
            return false;
        }
        off = ext_ld64(p);
        n = ext_ld32(p + 8);
        p += FZ_RUN_HDR;
        if ((uint64_t)(end - p) < n || off > len || n > len - off) {
            return false;
        }
        p += n;
    }
    in->sparse = true;
    in->img_len = len;
    return true;
}

/*
 * Split @data into image and trailer; false if either is malformed (then
 * @data may be taken as a flat image)
 */
static inline bool fz_input_parse(const uint8_t *data, size_t size,
                                  FzInput *in)
{
    const uint8_t *ft = data, *p, *end;

    memset(in, 0, sizeof(*in));
    in->raw = data;
    in->raw_len = in->img_len = size;
    if (size >= FZ_FOOTER_SIZE) {
        ft = data + size - FZ_FOOTER_SIZE;
    }
    if (size >= FZ_FOOTER_SIZE && ext_ld32(ft + 20) == FZ_MAGIC) {
        in->f.ops_seed = ext_ld64(ft);
        in->f.orig_crc = ext_ld32(ft + 8);
        in->f.nrec = ext_ld32(ft + 12);
        in->f.trailer_len = ext_ld32(ft + 16);
        if (in->f.trailer_len < FZ_FOOTER_SIZE ||
            in->f.trailer_len > size || in->f.nrec > FZ_MAX_RECORDS) {
            return false;
        }
        in->raw_len = in->img_len = size - in->f.trailer_len;
        in->has_trailer = true;
    }
    if (in->raw_len >= 16 && ext_ld64(in->raw) == FZ_SPARSE_MAGIC &&
        !fz_sparse_parse(in)) {
        return false;
    }
    if (!in->has_trailer) {
        return true;
    }
    p = data + in->raw_len;
    end = ft;
    for (uint32_t i = 0; i < in->f.nrec; i++) {
        FzRecord *r = &in->rec[i];

        if (end - p < FZ_REC_HDR) {
            return false;
        }
        r->off = ext_ld64(p);
        r->len = ext_ld32(p + 8);
        p += FZ_REC_HDR;
        if ((uint64_t)(end - p) < r->len || r->off > in->img_len ||
            r->len > in->img_len - r->off) {
            return false;
        }
        r->orig = p;
        p += r->len;
    }
    return p == end;
}

/* The image, in @buf (img_len bytes) */
static inline void fz_input_expand(const FzInput *in, uint8_t *buf)
{
    const uint8_t *p = in->raw + 16, *end = in->raw + in->raw_len;

    if (!in->sparse) {
        memcpy(buf, in->raw, in->img_len);
        return;
    }
    memset(buf, 0, in->img_len);
    while (p < end) {
        uint32_t n = ext_ld32(p + 8);

        memcpy(buf + ext_ld64(p), p + FZ_RUN_HDR, n);
        p += FZ_RUN_HDR + n;
    }
}

/* Undo the recorded edits of an image expanded into @buf */
static inline void fz_input_undo(const FzInput *in, uint8_t *buf)
{
    for (int i = in->f.nrec - 1; i >= 0; i--) {
        memcpy(buf + in->rec[i].off, in->rec[i].orig, in->rec[i].len);
    }
}

static inline bool fz_is_zero(const uint8_t *p, size_t n)
{
    uint64_t acc = 0;

    for (size_t i = 0; i + 8 <= n; i += 8) {
        acc |= ext_ld64(p + i);
    }
    for (size_t i = n & ~(size_t)7; i < n; i++) {
        acc |= p[i];
    }
    return acc == 0;
}

/*
 * Write @img sparse (runs of non-zero sectors) into @out if it fits in
 * @max bytes; returns the length, 0 if it does not fit
 */
static inline size_t fz_sparse_encode(const uint8_t *img, size_t len,
                                      uint8_t *out, size_t max)
{
    size_t o = 16;

    if (max < 16) {
        return 0;
    }
    ext_st64(out, FZ_SPARSE_MAGIC);
    ext_st64(out + 8, len);
    for (size_t s = 0; s < len;) {
        size_t e;

        if (fz_is_zero(img + s, MIN(FZ_SECTOR, len - s))) {
            s += FZ_SECTOR;
            continue;
        }
        for (e = s + FZ_SECTOR;
             e < len && !fz_is_zero(img + e, MIN(FZ_SECTOR, len - e));
             e += FZ_SECTOR) {
            continue;
        }
        e = MIN(e, len);
        if (o + FZ_RUN_HDR + (e - s) > max) {
            return 0;
        }
        ext_st64(out + o, s);
        ext_st32(out + o + 8, e - s);
        memcpy(out + o + FZ_RUN_HDR, img + s, e - s);
        o += FZ_RUN_HDR + (e - s);
        s = e;
    }
    return o;
}

/* ---- Raw image parsing: the live nodes reachable from the superblock ---- */

#define FZ_MAX_NODES    4096

typedef struct FzNode {
    uint64_t bytenr;
    uint64_t gen;
    uint32_t owner;
    unsigned level;
    uint32_t nritems;           /* clamped to the node's capacity */
    uint64_t lo, hi;            /* key range from the parents */
} FzNode;

/* Snapshot table entries parsed (the table may hold more) */
#define FZ_MAX_SNAPS    8

typedef struct FzSnap {
    uint64_t root, root_gen, gen, vsize;
    unsigned level;
} FzSnap;

typedef struct FzImage {
    const uint8_t *buf;
    size_t len;
    int slot;                   /* newest superblock with a good checksum */
    uint64_t gen, vsize, host_end;
    uint32_t bs, ns;
    /* as the superblock says, the encryption header too (unchecked) */
    uint64_t data_start;
    /*
     * Snapshots feature: the reference count tree's root, the snapshot
     * table (snap_count entries from its offset, header first) and the
     * entries of the first FZ_MAX_SNAPS of them (nsnaps; 0 if the table
     * lies outside the image or has a bad magic)
     */
    uint64_t ref_root, snap_table, snap_gen;
    uint32_t snap_count;
    int nsnaps;
    FzSnap snaps[FZ_MAX_SNAPS];
    int nnodes;
    /*
     * [0]: the extent tree's root, then the nodes of the extent tree, the
     * free-space tree, the reference count tree and those of the
     * snapshots' extent trees that the live one does not reach; a node
     * shared by several trees appears once, with the key range of the
     * first tree that reaches it
     */
    FzNode nodes[FZ_MAX_NODES];
} FzImage;

static inline uint32_t fz_sb_csum(const uint8_t *sb)
{
    uint8_t tmp[EXTREE_SB_SIZE];

    memcpy(tmp, sb, EXTREE_SB_SIZE);
    memset(tmp + 16, 0, 4);
    return extree_crc32c(0, tmp, EXTREE_SB_SIZE);
}

static inline bool fz_sb_ok(const uint8_t *sb)
{
    return ext_ld64(sb) == EXTREE_MAGIC && ext_ld32(sb + 16) == fz_sb_csum(sb);
}

static inline int fz_find_node(const FzImage *im, uint64_t bytenr)
{
    for (int i = 0; i < im->nnodes; i++) {
        if (im->nodes[i].bytenr == bytenr) {
            return i;
        }
    }
    return -1;
}

/* Node whose bytes contain [off, off + len), or -1 */
static inline int fz_node_at(const FzImage *im, uint64_t off, uint64_t len)
{
    for (int i = 0; i < im->nnodes; i++) {
        uint64_t b = im->nodes[i].bytenr;

        if (off >= b && off - b < im->ns && len <= im->ns - (off - b)) {
            return i;
        }
    }
    return -1;
}

static inline void fz_add_tree(FzImage *im, uint32_t owner, uint64_t root,
                               uint64_t hi)
{
    int first = im->nnodes;

    if (fz_find_node(im, root) >= 0 || im->nnodes == FZ_MAX_NODES) {
        return;
    }
    im->nodes[im->nnodes++] = (FzNode) { .bytenr = root, .lo = 0, .hi = hi };
    /* Breadth first; a node appears once even if two parents point at it */
    for (int i = first; i < im->nnodes; i++) {
        FzNode *n = &im->nodes[i];
        const uint8_t *b;
        uint32_t cap;

        if (n->bytenr > im->len || im->len - n->bytenr < im->ns) {
            continue;
        }
        b = im->buf + n->bytenr;
        if (ext_ld32(b + EXT_NH_MAGIC) != EXTREE_NODE_MAGIC) {
            continue;
        }
        n->gen = ext_ld64(b + EXT_NH_GEN);
        n->owner = ext_ld32(b + EXT_NH_OWNER);
        n->level = b[EXT_NH_LEVEL];
        cap = n->level ? EXTREE_INTERIOR_CAPACITY(im->ns)
                       : EXTREE_LEAF_CAPACITY(im->ns);
        n->nritems = MIN(ext_ld32(b + EXT_NH_NRITEMS), cap);
        if (!n->level || n->owner != owner) {
            continue;
        }
        for (uint32_t k = 0; k < n->nritems; k++) {
            const uint8_t *it = b + EXTREE_NODE_HEADER_SIZE + k * EXT_PTR_ISZ;
            uint64_t child = ext_ld64(it + 8);

            if (im->nnodes == FZ_MAX_NODES) {
                break;
            }
            if (fz_find_node(im, child) >= 0 || (child % im->bs) ||
                child < im->data_start) {
                continue;
            }
            im->nodes[im->nnodes++] = (FzNode) {
                .bytenr = child,
                .lo = ext_ld64(it),
                .hi = k + 1 < n->nritems ? ext_ld64(it + EXT_PTR_ISZ)
                                         : n->hi,
            };
        }
    }
}

#define FZ_SNAP_HDR     64

/* Image offset of snapshot table entry @i */
static inline uint64_t fz_snap_entry(const FzImage *im, uint32_t i)
{
    return im->snap_table + FZ_SNAP_HDR + (uint64_t)i * EXTREE_SNAP_ENTRY_SIZE;
}

/* The newest superblock slot with a good checksum, or -1 */
static inline int fz_best_slot(const uint8_t *buf, size_t len, uint64_t *gen)
{
    int best = -1;

    for (int i = 0; i < EXTREE_SB_SLOTS; i++) {
        const uint8_t *s = buf + i * EXTREE_SB_SIZE;

        if ((size_t)(i + 1) * EXTREE_SB_SIZE > len || !fz_sb_ok(s)) {
            continue;
        }
        if (best < 0 || ext_ld64(s + 24) > *gen) {
            best = i;
            *gen = ext_ld64(s + 24);
        }
    }
    return best;
}

/*
 * Parse the newest superblock with a good checksum and walk its trees -
 * extent, free-space, and with snapshots the reference count tree and
 * the snapshot table's extent trees - without trusting them: bounds are
 * checked, checksums are not.
 * False if no superblock slot is usable.  O(nodes^2), nodes <= 4096.
 */
static inline bool fz_image_parse(FzImage *im, const uint8_t *buf, size_t len)
{
    const uint8_t *sb;
    uint64_t crypt_len;

    im->buf = buf;
    im->len = len;
    im->nnodes = 0;
    im->slot = fz_best_slot(buf, len, &im->gen);
    if (im->slot < 0) {
        return false;
    }
    sb = buf + im->slot * EXTREE_SB_SIZE;
    im->vsize = ext_ld64(sb + 56);
    im->bs = ext_ld32(sb + 64);
    im->ns = ext_ld32(sb + 68);
    im->host_end = ext_ld64(sb + 72);
    if (im->bs < EXTREE_MIN_BLOCK_SIZE || im->bs > EXTREE_MAX_BLOCK_SIZE ||
        (im->bs & (im->bs - 1)) || im->ns < EXTREE_MIN_NODE_SIZE ||
        im->ns > EXTREE_MAX_NODE_SIZE || (im->ns & (im->ns - 1))) {
        return false;
    }
    crypt_len = (ext_ld64(sb + 32) & EXTREE_INCOMPAT_ENCRYPTED) ?
                MIN(ext_ld64(sb + 224), EXTREE_CRYPT_HEADER_MAX) : 0;
    im->data_start = extree_data_start_for(im->bs, crypt_len);
    fz_add_tree(im, EXTREE_TREE_EXTENT, ext_ld64(sb + 80), UINT64_MAX);
    fz_add_tree(im, EXTREE_TREE_FREE, ext_ld64(sb + 104), UINT64_MAX);
    im->ref_root = im->snap_table = im->snap_gen = 0;
    im->snap_count = 0;
    im->nsnaps = 0;
    if (!(ext_ld64(sb + 32) & EXTREE_INCOMPAT_SNAPSHOTS)) {
        return true;
    }
    im->ref_root = ext_ld64(sb + 160);
    im->snap_table = ext_ld64(sb + 184);
    im->snap_count = ext_ld32(sb + 192);
    im->snap_gen = ext_ld64(sb + 200);
    fz_add_tree(im, EXTREE_TREE_REFS, im->ref_root, UINT64_MAX);
    if (im->snap_table < len && len - im->snap_table >= FZ_SNAP_HDR &&
        ext_ld32(buf + im->snap_table) == EXTREE_SNAP_MAGIC) {
        for (uint32_t i = 0; i < MIN(im->snap_count, FZ_MAX_SNAPS); i++) {
            uint64_t e = fz_snap_entry(im, i);
            FzSnap *sn = &im->snaps[im->nsnaps];

            if (e > len || len - e < EXTREE_SNAP_ENTRY_SIZE) {
                break;
            }
            sn->root = ext_ld64(buf + e);
            sn->root_gen = ext_ld64(buf + e + 8);
            sn->level = buf[e + 16];
            sn->gen = ext_ld64(buf + e + 24);
            sn->vsize = ext_ld64(buf + e + 32);
            im->nsnaps++;
        }
    }
    for (int i = 0; i < im->nsnaps; i++) {
        fz_add_tree(im, EXTREE_TREE_EXTENT, im->snaps[i].root, UINT64_MAX);
    }
    return true;
}

/* Bytes of the snapshot table that its checksum covers */
static inline uint64_t fz_snap_table_used(const FzImage *im)
{
    return FZ_SNAP_HDR + (uint64_t)im->snap_count * EXTREE_SNAP_ENTRY_SIZE;
}

/* Entry @i of the snapshot table within [0, snap_count), or -1 */
static inline int fz_snap_entry_at(const FzImage *im, uint64_t off,
                                   uint64_t len)
{
    uint64_t t = im->snap_table;

    if (!im->snap_table || off < t + FZ_SNAP_HDR ||
        off - t >= fz_snap_table_used(im)) {
        return -1;
    }
    off -= t + FZ_SNAP_HDR;
    if (off % EXTREE_SNAP_ENTRY_SIZE + len > EXTREE_SNAP_ENTRY_SIZE) {
        return -1;
    }
    return off / EXTREE_SNAP_ENTRY_SIZE;
}

/* Does [off, off + len) lie in the snapshot table (header or entries)? */
static inline bool fz_in_snap_table(const FzImage *im, uint64_t off,
                                    uint64_t len)
{
    return im->snap_table && off >= im->snap_table &&
           off - im->snap_table < fz_snap_table_used(im) &&
           len <= fz_snap_table_used(im) - (off - im->snap_table);
}

/* The table's checksum: crc32c of header and entries, csum field zero */
static inline void fz_snap_table_fix_csum(uint8_t *buf, size_t len,
                                          const FzImage *im)
{
    uint64_t t = im->snap_table, used = fz_snap_table_used(im);
    uint8_t zero[4] = { 0 };
    uint32_t c;

    if (!t || t > len || len - t < used) {
        return;
    }
    c = extree_crc32c(0, buf + t, 4);
    c = extree_crc32c(c, zero, 4);
    c = extree_crc32c(c, buf + t + 8, used - 8);
    ext_st32(buf + t + 4, c);
}

/* Store a node's checksum: crc32c of bytes 4 .. node_size - 1 at 0 */
static inline void fz_node_fix_csum(uint8_t *node, uint32_t ns)
{
    ext_st32(node, extree_crc32c(0, node + 4, ns - 4));
}

static inline void fz_sb_fix_csum(uint8_t *sb)
{
    ext_st32(sb + 16, fz_sb_csum(sb));
}

/* libFuzzer's entry points (fuzz-core.c, fuzz-mutator.c) */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size,
                               unsigned int seed);

/* splitmix64: the one generator of the target, mutator and seed builder */
static inline uint64_t fz_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

#endif /* TESTS_FUZZ_FUZZ_INPUT_H */
