/*
 * extree fuzzing: structure-aware mutator (libFuzzer only)
 *
 * Parses the image (superblocks at 0 and 4096, then both trees from their
 * roots), edits one field of a node or a superblock - keys, lengths, host
 * offsets, types, child pointers, generations and child_bytes, nritems,
 * levels, owners, superblock geometry, roots, generation, extent_count,
 * extent_bytes, free_bytes, host_end, features, backing file name bytes,
 * the reference count tree's root, the snapshot table's offset and count,
 * snap_generation; with snapshots, also the nodes of the reference count
 * tree and of the snapshots' trees, and the fields of the snapshot table
 * (root, generation, virtual size, counts, id and name) - or moves items
 * around, and stores the crc32c again (nodes: of bytes 4
 * .. node_size - 1 at 0; superblocks: of the slot with bytes 16..19
 * zeroed; the snapshot table: of header and entries, its field zeroed)
 * so that the edit reaches the semantic checks.  Each edit is recorded in
 * the input's trailer (fuzz-input.h) for the target's oracle.  Edits keep
 * to one node most of the time: that is the case the oracle judges.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "fuzz-input.h"


typedef struct Rec {
    uint64_t off;
    uint32_t len;
    uint8_t *orig;
} Rec;

typedef struct Mut {
    uint64_t rng;
    uint8_t *img;               /* the image being edited */
    size_t len;
    FzImage *im;                /* parsed before this round of edits */
    GArray *recs;               /* Rec */
    size_t rec_bytes;           /* serialized size of recs */
    uint64_t touched_sb;        /* bit per slot: checksum to fix */
    int touched_node;           /* index into im->nodes, -1 none */
    bool touched_table;         /* the snapshot table: checksum to fix */
    bool keep_csum;
} Mut;

static uint64_t mrand(Mut *m)
{
    return fz_splitmix64(&m->rng);
}

static uint64_t below(Mut *m, uint64_t n)
{
    return n ? mrand(m) % n : 0;
}

/* Is every byte of [off, off + len) already covered by a record? */
static bool covered(Mut *m, uint64_t off, uint32_t len)
{
    for (uint64_t b = off; b < off + len; b++) {
        bool hit = false;

        for (guint i = 0; i < m->recs->len && !hit; i++) {
            Rec *r = &g_array_index(m->recs, Rec, i);
            hit = b >= r->off && b < r->off + r->len;
        }
        if (!hit) {
            return false;
        }
    }
    return true;
}

/*
 * Overwrite image bytes, recording what was there unless an earlier
 * record already holds the original of every byte (undo applies records
 * last to first, so the earliest record of a byte restores it)
 */
static void edit(Mut *m, uint64_t off, const void *val, uint32_t len)
{
    if (off > m->len || len > m->len - off || len == 0) {
        return;
    }
    if (!covered(m, off, len)) {
        Rec r = { off, len, g_memdup2(m->img + off, len) };

        g_array_append_val(m->recs, r);
        m->rec_bytes += FZ_REC_HDR + len;
    }
    memcpy(m->img + off, val, len);
}

static void edit_le(Mut *m, uint64_t off, uint64_t v, int width)
{
    uint8_t b[8];

    for (int i = 0; i < width; i++) {
        b[i] = v >> (8 * i);
    }
    edit(m, off, b, width);
}

static uint64_t load_le(Mut *m, uint64_t off, int width)
{
    uint64_t v = 0;

    for (int i = 0; i < width && off + i < m->len; i++) {
        v |= (uint64_t)m->img[off + i] << (8 * i);
    }
    return v;
}

/* A node other than the target, or the target */
static const FzNode *any_node(Mut *m)
{
    return &m->im->nodes[below(m, m->im->nnodes)];
}

/*
 * A new value for a field that holds @cur: near it, a boundary of the
 * image's geometry, another node's location or generation, or anything
 */
static uint64_t new_value(Mut *m, uint64_t cur, int width)
{
    const FzImage *im = m->im;
    uint64_t bs = im->bs, ns = im->ns;
    uint64_t mask = width == 8 ? UINT64_MAX : (1ULL << (8 * width)) - 1;
    uint64_t v;

    switch (below(m, 16)) {
    case 0:
        v = cur + 1;
        break;
    case 1:
        v = cur - 1;
        break;
    case 2:
        v = cur + bs * (1 + below(m, 4));
        break;
    case 3:
        v = cur - bs * (1 + below(m, 4));
        break;
    case 4:
        v = below(m, 2) ? cur + ns : cur - ns;
        break;
    case 5: {
        static const uint64_t special[] = {
            0, 1, UINT64_MAX, UINT64_MAX - 1, INT64_MAX, 1ULL << 63,
            1ULL << 32, UINT32_MAX, 4096, 8192, 512,
        };
        v = special[below(m, G_N_ELEMENTS(special))];
        break;
    }
    case 6:
        v = im->vsize - below(m, 2) * bs;
        break;
    case 7:
        v = im->host_end - below(m, 3) * bs;
        break;
    case 8:
        v = any_node(m)->bytenr;
        break;
    case 9:
        v = any_node(m)->gen + below(m, 3) - 1;
        break;
    case 10:
        v = im->gen + below(m, 3) - 1;
        break;
    case 11:
        v = im->data_start + below(m, 8) * bs;
        break;
    case 12:
        v = cur ^ (1ULL << below(m, 8 * width));
        break;
    case 13:
        v = below(m, im->vsize / bs + 2) * bs;
        break;
    case 14:
        v = m->len - below(m, 4) * bs;
        break;
    default:
        v = mrand(m);
        break;
    }
    return v & mask;
}

/* ---- nodes ---- */

static void mutate_header(Mut *m, const FzNode *n)
{
    static const struct { int off, width; } f[] = {
        { EXT_NH_GEN, 8 }, { EXT_NH_OWNER, 4 }, { EXT_NH_LEVEL, 1 },
        { EXT_NH_NRITEMS, 4 }, { EXT_NH_BYTENR, 8 }, { EXT_NH_MAGIC, 4 },
        { 29, 1 }, { 36, 4 }, { 40, 8 },
    };
    int k = below(m, G_N_ELEMENTS(f));
    uint64_t off = n->bytenr + f[k].off;
    uint64_t cur = load_le(m, off, f[k].width);

    if (f[k].off == EXT_NH_NRITEMS && below(m, 2)) {
        /* mostly small changes: one item more or less, or none */
        static const int64_t d[] = { -1, 1, -2, 2 };
        int64_t v = (int64_t)cur + d[below(m, 4)];
        edit_le(m, off, below(m, 4) ? (uint64_t)v : 0, 4);
        return;
    }
    edit_le(m, off, new_value(m, cur, f[k].width), f[k].width);
}

static uint64_t item_off(const FzNode *n, uint32_t i)
{
    return n->bytenr + EXTREE_NODE_HEADER_SIZE + (uint64_t)i * 32;
}

/* One field of one item (leaf: key, length, host, type, flags) */
static void mutate_item_field(Mut *m, const FzNode *n)
{
    uint32_t cap = n->level ? EXTREE_INTERIOR_CAPACITY(m->im->ns)
                            : EXTREE_LEAF_CAPACITY(m->im->ns);
    /* one slot past the items: what nritems + 1 would expose */
    uint32_t i = below(m, n->nritems + (n->nritems < cap));
    uint64_t base = item_off(n, i);
    int field = below(m, n->level ? 4 : 5);
    uint64_t off = base + field * 8;
    int width = 8;
    uint64_t cur, v;

    if (!n->level && field >= 3) {
        off = base + 24 + (field - 3) * 4;
        width = 4;
    }
    cur = load_le(m, off, width);
    if (!n->level && field == 3) {
        v = below(m, 8);        /* type: DATA, ZERO, FREE, or unknown */
    } else if (n->level && field == 1 && below(m, 2)) {
        /* a child pointer and generation of another node */
        const FzNode *o = any_node(m);
        edit_le(m, base + 16, o->gen, 8);
        v = o->bytenr;
    } else if (i > 0 && below(m, 4) == 0) {
        /* the same field of the previous item */
        v = load_le(m, off - 32, width);
    } else {
        v = new_value(m, cur, width);
    }
    edit_le(m, off, v, width);
}

/* Move whole items: copy, swap, delete, duplicate, re-point */
static void mutate_items(Mut *m, const FzNode *n)
{
    uint32_t nr = n->nritems;
    uint32_t cap = n->level ? EXTREE_INTERIOR_CAPACITY(m->im->ns)
                            : EXTREE_LEAF_CAPACITY(m->im->ns);
    uint32_t i = below(m, nr), j = below(m, nr);
    uint8_t tmp[32], *items;
    size_t bytes;

    if (nr == 0) {
        return;
    }
    switch (below(m, 6)) {
    case 0:
        /* item j over item i */
        memcpy(tmp, m->img + item_off(n, j), 32);
        edit(m, item_off(n, i), tmp, 32);
        break;
    case 1:
        /* swap neighbours */
        if (i + 1 < nr) {
            uint8_t two[64];
            memcpy(two, m->img + item_off(n, i + 1), 32);
            memcpy(two + 32, m->img + item_off(n, i), 32);
            edit(m, item_off(n, i), two, 64);
        }
        break;
    case 2:
        /* delete item i */
        bytes = (size_t)(nr - i - 1) * 32;
        items = g_malloc0(bytes + 32);
        memcpy(items, m->img + item_off(n, i + 1), bytes);
        edit(m, item_off(n, i), items, bytes + 32);
        edit_le(m, n->bytenr + EXT_NH_NRITEMS, nr - 1, 4);
        g_free(items);
        break;
    case 3:
        /* duplicate item i */
        if (nr < cap) {
            bytes = (size_t)(nr - i) * 32;
            items = g_memdup2(m->img + item_off(n, i), bytes);
            edit(m, item_off(n, i + 1), items, bytes);
            edit_le(m, n->bytenr + EXT_NH_NRITEMS, nr + 1, 4);
            g_free(items);
        }
        break;
    case 4:
        /*
         * Interior: item i + 1's child pointer and generation into item i
         * (issue 22's first recipe); leaf: item i grown up to item i + 1
         */
        if (i + 1 < nr && n->level) {
            memcpy(tmp, m->img + item_off(n, i + 1) + 8, 16);
            edit(m, item_off(n, i) + 8, tmp, 16);
        } else if (i + 1 < nr) {
            uint64_t key = load_le(m, item_off(n, i), 8);
            uint64_t next = load_le(m, item_off(n, i + 1), 8);
            edit_le(m, item_off(n, i) + 8, next - key, 8);
        }
        break;
    default:
        /*
         * child_bytes moved from one child to another (the sum the parent
         * checks stays); leaf: a key and length shifted together
         */
        if (n->level && i != j) {
            uint64_t d = m->im->bs * (1 + below(m, 4));
            uint64_t bi = load_le(m, item_off(n, i) + 24, 8);
            uint64_t bj = load_le(m, item_off(n, j) + 24, 8);
            edit_le(m, item_off(n, i) + 24, bi + d, 8);
            edit_le(m, item_off(n, j) + 24, bj - d, 8);
        } else if (!n->level) {
            uint64_t d = m->im->bs * (1 + below(m, 2));
            uint64_t key = load_le(m, item_off(n, i), 8);
            uint64_t len = load_le(m, item_off(n, i) + 8, 8);
            edit_le(m, item_off(n, i), key + d, 8);
            edit_le(m, item_off(n, i) + 8, len - d, 8);
        }
        break;
    }
}

/* libFuzzer's byte-level mutations on a slice of the node */
static void mutate_raw(Mut *m, uint64_t start, uint64_t size)
{
    uint64_t n = MIN(size, 1 + below(m, 64));
    uint64_t off = start + below(m, size - n + 1);
    uint8_t buf[64];
    size_t got;

    memcpy(buf, m->img + off, n);
    got = LLVMFuzzerMutate(buf, n, n);
    edit(m, off, buf, MIN(got, n));
}

static void mutate_node(Mut *m, int ni)
{
    const FzNode *n = &m->im->nodes[ni];

    if (n->bytenr > m->len || m->len - n->bytenr < m->im->ns) {
        return;
    }
    m->touched_node = ni;
    switch (below(m, 8)) {
    case 0:
    case 1:
        mutate_header(m, n);
        break;
    case 2 ... 4:
        mutate_item_field(m, n);
        break;
    case 5:
    case 6:
        mutate_items(m, n);
        break;
    default:
        mutate_raw(m, n->bytenr + 4, m->im->ns - 4);
        break;
    }
}

/* ---- superblocks ---- */

static void mutate_super(Mut *m)
{
    static const struct { int off, width; } f[] = {
        { 24, 8 },      /* generation */
        { 24, 8 },
        { 32, 8 },      /* incompat_features */
        { 40, 8 },      /* compat_features */
        { 48, 8 },      /* autoclear_features */
        { 56, 8 },      /* virtual_size */
        { 64, 4 },      /* block_size */
        { 68, 4 },      /* node_size */
        { 72, 8 },      /* host_end */
        { 80, 8 },      /* extent_root */
        { 88, 8 },
        { 96, 1 },
        { 104, 8 },     /* free_root */
        { 112, 8 },
        { 120, 1 },
        { 128, 8 },     /* extent_count */
        { 128, 8 },
        { 136, 8 },     /* free_bytes */
        { 152, 8 },     /* extent_bytes */
        { 152, 8 },
        { 144, 2 },     /* backing_file_len */
        { 146, 2 },     /* backing_fmt_len */
        { 8, 4 },       /* version */
        { 12, 4 },      /* sb_size */
        { 20, 4 },      /* reserved0 */
        { 148, 4 },     /* reserved1 */
        { 101, 1 },     /* root reserved bytes */
        { 160, 8 },     /* ref_root */
        { 168, 8 },
        { 176, 1 },
        { 184, 8 },     /* snap_table_offset */
        { 192, 4 },     /* snap_count */
        { 200, 8 },     /* snap_generation */
        { 200, 8 },
        { 208, 4 },     /* crypt_method */
        { 216, 8 },     /* crypt_header_offset */
        { 224, 8 },     /* crypt_header_length */
        { 224, 8 },
    };
    int k = below(m, G_N_ELEMENTS(f) + 3);
    int slot = m->im->slot, both = below(m, 4) == 0;
    int off, width;
    uint64_t cur, v;

    if (below(m, 8) == 0) {
        slot = !slot;
    }
    if (k >= (int)G_N_ELEMENTS(f)) {
        /* a byte of the backing names or of a reserved area */
        static const int area[][2] = {
            { 1024, 32 }, { 2048, 1024 }, { 160, 1024 - 160 },
        };
        int a = k - G_N_ELEMENTS(f);
        uint16_t flen = load_le(m, slot * EXTREE_SB_SIZE + 144, 2);

        off = area[a][0] + below(m, area[a][1]);
        if (a == 1 && flen && below(m, 2)) {
            /* around the end of the name */
            off = 2048 + MIN(flen + below(m, 3) - 1, 1023);
        }
        width = 1;
        v = below(m, 2) ? 0 : 1 + below(m, 255);
    } else {
        off = f[k].off;
        width = f[k].width;
        cur = load_le(m, slot * EXTREE_SB_SIZE + off, width);
        if (off == 128 && below(m, 2)) {
            /* extent_count at the spec's bound, or one beyond */
            v = m->im->vsize / m->im->bs + below(m, 2);
        } else if (off == 24 && below(m, 2)) {
            /* a generation about to wrap */
            v = UINT64_MAX - below(m, 3);
        } else if (off == 200 && below(m, 2)) {
            /* below a snapshot's generation (issue 38 point 1) */
            v = below(m, 2) || !m->im->nsnaps ? below(m, 3) :
                m->im->snaps[below(m, m->im->nsnaps)].gen - below(m, 2);
        } else if ((off == 80 || off == 104 || off == 160) &&
                   m->im->nnodes &&
                   below(m, 2)) {
            /* the root moved to another node, with its generation */
            const FzNode *o = any_node(m);
            edit_le(m, slot * EXTREE_SB_SIZE + off + 8, o->gen, 8);
            edit_le(m, slot * EXTREE_SB_SIZE + off + 16, o->level, 1);
            v = o->bytenr;
        } else {
            v = new_value(m, cur, width);
        }
    }
    for (int s = 0; s < EXTREE_SB_SLOTS; s++) {
        if (s == slot || both) {
            edit_le(m, s * EXTREE_SB_SIZE + off, v, width);
            m->touched_sb |= 1u << s;
        }
    }
}

/* ---- the snapshot table ---- */

/*
 * One field of one entry (root, generation, sizes, counts, id and name)
 * or of the header; the table's checksum is fixed afterwards
 */
static void mutate_snap_table(Mut *m)
{
    static const struct { int off, width; } f[] = {
        { 0, 8 },       /* root: bytenr, generation, level */
        { 0, 8 },
        { 8, 8 },
        { 16, 1 },
        { 24, 8 },      /* generation */
        { 32, 8 },      /* virtual_size */
        { 32, 8 },
        { 40, 8 },      /* extent_count */
        { 48, 8 },      /* extent_bytes */
        { 80, 8 },      /* vm_state_size */
        { 96, 2 },      /* id_len */
        { 98, 2 },      /* name_len */
        { 64, 4 },      /* date_nsec */
        { 100, 1 },     /* reserved */
    };
    const FzImage *im = m->im;
    int i = below(m, im->nsnaps), k = below(m, G_N_ELEMENTS(f) + 3);
    uint64_t e = fz_snap_entry(im, i), off, cur, v;
    int width;

    m->touched_table = true;
    if (k == G_N_ELEMENTS(f)) {
        /* a header field: count, entry size, magic */
        static const int h[] = { 8, 12, 0 };
        off = im->snap_table + h[below(m, 3)];
        edit_le(m, off, new_value(m, load_le(m, off, 4), 4), 4);
        return;
    }
    if (k > (int)G_N_ELEMENTS(f)) {
        /* a byte of the id or the name, or just past it */
        uint64_t base = e + (below(m, 2) ? 128 : 256);
        uint16_t l = load_le(m, base == e + 128 ? e + 96 : e + 98, 2);

        uint64_t pos = l ? l - 1 + below(m, 3) : below(m, 2);

        off = base + MIN(pos, base == e + 128 ? 127u : 255u);
        edit_le(m, off, below(m, 2) ? 0 : 1 + below(m, 255), 1);
        return;
    }
    off = e + f[k].off;
    width = f[k].width;
    cur = load_le(m, off, width);
    if (f[k].off == 0 && below(m, 2)) {
        /*
         * The root moved to another node with its generation and level
         * (issue 38 point 2: to one of the tree's own nodes)
         */
        const FzNode *o = any_node(m);
        edit_le(m, e + 8, o->gen, 8);
        edit_le(m, e + 16, o->level, 1);
        v = o->bytenr;
    } else if (f[k].off == 32 && below(m, 2)) {
        /* smaller or larger by a few blocks (issue 38 point 3) */
        int64_t d = (int64_t)(1 + below(m, 8)) * im->bs;
        v = below(m, 2) ? cur - d : cur + d;
    } else if (f[k].off == 24 && below(m, 2)) {
        /* at or above snap_generation (issue 38 point 1) */
        v = im->snap_gen + below(m, 3) - 1;
    } else {
        v = new_value(m, cur, width);
    }
    edit_le(m, off, v, width);
}

/* ---- the mutator ---- */

static void fix_checksums(Mut *m)
{
    if (m->keep_csum) {
        return;
    }
    for (int s = 0; s < EXTREE_SB_SLOTS; s++) {
        if (m->touched_sb & (1u << s) &&
            (size_t)(s + 1) * EXTREE_SB_SIZE <= m->len) {
            uint8_t sb[EXTREE_SB_SIZE];

            memcpy(sb, m->img + s * EXTREE_SB_SIZE, EXTREE_SB_SIZE);
            fz_sb_fix_csum(sb);
            edit(m, s * EXTREE_SB_SIZE + 16, sb + 16, 4);
        }
    }
    if (m->touched_table &&
        m->im->snap_table + fz_snap_table_used(m->im) <= m->len) {
        uint64_t t = m->im->snap_table;
        uint8_t *tab = g_memdup2(m->img, t + fz_snap_table_used(m->im));

        fz_snap_table_fix_csum(tab, t + fz_snap_table_used(m->im), m->im);
        edit(m, t + 4, tab + t + 4, 4);
        g_free(tab);
    }
    if (m->touched_node >= 0) {
        uint64_t b = m->im->nodes[m->touched_node].bytenr;
        uint32_t ns = m->im->ns;

        edit_le(m, b, extree_crc32c(0, m->img + b + 4, ns - 4), 4);
    }
}

/* The node a previous record edited, to keep edits in one node */
static int recorded_node(Mut *m)
{
    for (guint i = 0; i < m->recs->len; i++) {
        Rec *r = &g_array_index(m->recs, Rec, i);
        int n = fz_node_at(m->im, r->off, r->len);

        if (n >= 0) {
            return n;
        }
    }
    return -1;
}

static void free_recs(Mut *m)
{
    for (guint i = 0; i < m->recs->len; i++) {
        g_free(g_array_index(m->recs, Rec, i).orig);
    }
    g_array_set_size(m->recs, 0);
    m->rec_bytes = 0;
}

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size,
                               unsigned int seed)
{
    /* reused: fresh buffers of this size cost an mmap every time */
    static uint8_t *img_buf, *out_buf;
    static size_t img_cap, out_cap;
    static FzImage im;
    Mut m = { .rng = seed, .touched_node = -1 };
    FzInput in;
    uint64_t ops_seed;
    uint32_t orig_crc;
    size_t out;
    uint8_t *p;

    if (!fz_input_parse(data, size, &in)) {
        memset(&in, 0, sizeof(in));
        in.raw = data;
        in.raw_len = in.img_len = size;
    }
    if (in.img_len > img_cap) {
        g_free(img_buf);
        img_cap = MAX(in.img_len, 2 * img_cap);
        img_buf = g_malloc(img_cap);
    }
    if (max_size > out_cap) {
        g_free(out_buf);
        out_cap = max_size;
        out_buf = g_malloc(out_cap);
    }
    m.len = in.img_len;
    m.img = img_buf;
    fz_input_expand(&in, m.img);
    m.recs = g_array_new(false, false, sizeof(Rec));
    m.im = &im;
    if (in.has_trailer) {
        ops_seed = in.f.ops_seed;
        orig_crc = in.f.orig_crc;
        for (uint32_t i = 0; i < in.f.nrec; i++) {
            Rec r = { in.rec[i].off, in.rec[i].len,
                      g_memdup2(in.rec[i].orig, in.rec[i].len) };
            g_array_append_val(m.recs, r);
            m.rec_bytes += FZ_REC_HDR + r.len;
        }
    } else {
        ops_seed = mrand(&m);
        orig_crc = extree_crc32c(0, m.img, m.len);
    }

    /* Too many records (or no room): start again from the original */
    if (m.recs->len + 8 > FZ_MAX_RECORDS ||
        m.rec_bytes + 2 * 4096 + FZ_FOOTER_SIZE > max_size / 2) {
        for (int i = m.recs->len - 1; i >= 0; i--) {
            Rec *r = &g_array_index(m.recs, Rec, i);
            memcpy(m.img + r->off, r->orig, r->len);
        }
        free_recs(&m);
    }

    if (below(&m, 8) == 0) {
        ops_seed = mrand(&m);
    }
    m.keep_csum = below(&m, 64) == 0;
    if (!fz_image_parse(&im, m.img, m.len) || im.nnodes == 0) {
        /* no usable superblock: bytes only */
        if (m.len) {
            mutate_raw(&m, 0, MIN(m.len, EXTREE_SB_AREA));
        }
    } else {
        int rounds = 1 + (below(&m, 4) == 0) * below(&m, 3);
        int node = recorded_node(&m);

        if (node < 0 || below(&m, 4) == 0) {
            node = below(&m, im.nnodes);
        }
        /* with snapshots: edits of the table one time in eight */
        bool table = im.nsnaps && below(&m, 8) == 0;

        for (int i = 0; i < rounds; i++) {
            if (table) {
                mutate_snap_table(&m);
            } else if (below(&m, 8) == 0) {
                mutate_super(&m);
            } else {
                mutate_node(&m, node);
            }
        }
        fix_checksums(&m);
    }

    /* sparse image | records | footer, if it fits */
    out = fz_sparse_encode(m.img, m.len, out_buf,
                           max_size - MIN(max_size, m.rec_bytes +
                                                    FZ_FOOTER_SIZE));
    if (out == 0) {
        out = size;
        goto done;
    }
    p = out_buf + out;
    for (guint i = 0; i < m.recs->len; i++) {
        Rec *r = &g_array_index(m.recs, Rec, i);
        ext_st64(p, r->off);
        ext_st32(p + 8, r->len);
        memcpy(p + FZ_REC_HDR, r->orig, r->len);
        p += FZ_REC_HDR + r->len;
    }
    ext_st64(p, ops_seed);
    ext_st32(p + 8, orig_crc);
    ext_st32(p + 12, m.recs->len);
    ext_st32(p + 16, m.rec_bytes + FZ_FOOTER_SIZE);
    ext_st32(p + 20, FZ_MAGIC);
    out = p + FZ_FOOTER_SIZE - out_buf;
    memcpy(data, out_buf, out);
done:
    free_recs(&m);
    g_array_free(m.recs, true);
    return out;
}
