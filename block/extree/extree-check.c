/*
 * extree core: the checker behind qemu-img check
 *
 * Reads every node of every tree (extent, free-space, reference count,
 * and each snapshot's extent tree) from the backend (not from the cache,
 * so that on-disk damage is seen even with a warm cache), validates it like
 * a first read, and records who claims which host range: nodes of each
 * tree, DATA extents, free ranges, the snapshot table, the bitmaps.  A
 * node or DATA that several roots share is claimed once and its references
 * counted; the counts found are compared with the reference count tree.
 * Sorting the claims shows overlaps (two owners: corruption) and gaps (no
 * owner: leaks).  Every compressed payload is read and decompressed once:
 * its checksum covers the decompressed data.  O(nodes + items) reads and
 * time plus the compressed payloads, O(items) memory.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdarg.h>

#include "extree-int.h"

enum {
    CLAIM_EXTENT_NODE, CLAIM_FREE_NODE, CLAIM_DATA, CLAIM_FREE,
    CLAIM_REF_NODE, CLAIM_SNAP_TABLE, CLAIM_BITMAP, CLAIM_MARK_LOG,
};

/*
 * A node already walked: a second reference to it (from another
 * snapshot's tree) counts, and its subtree's items count for that tree too
 */
typedef struct Visit {
    uint64_t bytenr;
    uint32_t refs;
    uint32_t owner;             /* the tree whose walk recorded it */
    unsigned level;
    uint64_t generation;
    /*
     * if it validated: its first key (none if empty), the end of the last
     * item under it, and the child_bytes its parent must carry
     */
    bool valid, has_first_key;
    uint64_t first_key, end, node_bytes;
    /*
     * extent trees: the end of the last item (or key) below the VM state
     * area under it, checked against each tree's size that reaches it
     */
    uint64_t data_hi;
    uint64_t items, bytes;      /* leaf items and their lengths below */
} Visit;

typedef struct Claim {
    uint64_t start, len;
    /* node: bytenr; DATA: guest offset; bitmap chunk: its index */
    uint64_t key;
    uint32_t bitmap;            /* bitmap chunk: the bitmap's index */
    uint8_t kind;
    bool compressed;            /* DATA: a compressed extent's payload */
} Claim;

/* Claim.bitmap of the bitmap directory */
#define BITMAP_DIR UINT32_MAX

/*
 * Distinct claims of one host block kept for comparison (sweep()): more
 * owners than that are a double use that no repair resolves
 */
#define ACTIVE_MAX 8

/* A host range and a reference count */
typedef struct Seg {
    uint64_t start, end;
    uint32_t count;
} Seg;

typedef struct CheckCtx {
    Extree *t;
    ExtreeCheckResult *res;
    ExtreeReportFn *report;
    void *opaque;
    GArray *claims;
    GHashTable *visited;        /* Visit by bytenr: a node is walked once */
    GArray *refs_found;         /* REFS items of the reference count tree */
    uint8_t *bufs[EXTREE_MAX_LEVELS];
    ExtreeItem last;            /* previous leaf item of the tree walked */
    bool has_last;
    /*
     * Walking the live extent tree (its nodes shared with snapshots come
     * first through it): what counts toward the live image's figures
     */
    bool in_live;
    /*
     * of res->corruptions: in the extent tree (or its accounting), in the
     * free-space tree (or its accounting, or free space claimed twice)
     */
    uint64_t extent_bad, free_bad;
    /* the superblock's extent_count is wrong, the extent tree sound */
    bool count_bad;
    /*
     * reference counts recorded lower than found (corruption), and every
     * mismatch with the count found (Seg, check_counts())
     */
    uint64_t refs_bad;
    GArray *ref_fixes;
    /* snap_generation too low (Extree.snap_gen_bad): "-r all" raises it */
    bool snapgen_bad;
    bool bitmaps_bad;           /* bitmaps left out at open (damaged) */
    bool log_bad;               /* a mark log record lies (not replayed) */
    /*
     * of res->corruptions: a bitmap block that something else uses too
     * (dropping the bitmaps in @bitmap_drop resolves it, with the
     * directory if @dir_drop), and a DATA block the free tree lists
     * (rebuilding the free tree gives it to the extent)
     */
    uint64_t bitmap_dup, data_free;
    bool *bitmap_drop;
    bool dir_drop;
    /* COMPRESSED items (a payload shared by snapshots is checked once) */
    GArray *payloads;
} CheckCtx;

/* One corruption, found in the extent tree (@free false) or the free tree */
static void count(CheckCtx *c, bool free)
{
    c->res->corruptions++;
    if (free) {
        c->free_bad++;
    } else {
        c->extent_bad++;
    }
}

static void G_GNUC_PRINTF(2, 3) say(CheckCtx *c, const char *fmt, ...)
{
    va_list ap;
    char *msg;

    va_start(ap, fmt);
    msg = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    if (c->report) {
        c->report(c->opaque, msg);
    }
    g_free(msg);
}

static void claim(CheckCtx *c, uint64_t start, uint64_t len, uint64_t key,
                  int kind)
{
    Claim cl = { start, len, key, 0, kind, false };
    g_array_append_val(c->claims, cl);
}

/* A compressed extent's payload: it maps the whole unit at @key */
static void claim_payload(CheckCtx *c, uint64_t start, uint64_t len,
                          uint64_t key)
{
    Claim cl = { start, len, key, 0, CLAIM_DATA, true };
    g_array_append_val(c->claims, cl);
}

/* Chunk @chunk of bitmap @i, or the directory (@i BITMAP_DIR) */
static void claim_bitmap(CheckCtx *c, uint64_t start, uint64_t len,
                         uint32_t i, uint64_t chunk)
{
    Claim cl = { start, len, chunk, i, CLAIM_BITMAP, false };
    g_array_append_val(c->claims, cl);
}

/*
 * Two DATA claims on host byte @at: the same data only if both map it
 * from the same guest offset (trees share data where they share guest
 * offsets; a compressed payload goes with its whole unit)
 */
static bool same_data(const Claim *a, const Claim *b, uint64_t at)
{
    if (a->compressed || b->compressed) {
        return a->compressed && b->compressed && a->start == b->start &&
               a->key == b->key;
    }
    return a->key + (at - a->start) == b->key + (at - b->start);
}

static int claim_kind(uint32_t owner)
{
    switch (owner) {
    case EXTREE_TREE_EXTENT:
        return CLAIM_EXTENT_NODE;
    case EXTREE_TREE_REFS:
        return CLAIM_REF_NODE;
    default:
        return CLAIM_FREE_NODE;
    }
}

/*
 * What a node walked before must be for another parent of @owner's tree
 * (expecting @e), as extree_node_get() checks a cached node: the same
 * tree, level and generation and, if it validated, the parent's first
 * key, a key range that holds every item under it, and its child_bytes.
 * NULL if it is, else why not (g_malloc'd).
 */
static char *visit_disagrees(const Visit *v, uint32_t owner,
                             const ExtreeNodeExpect *e)
{
    if (v->owner != owner) {
        /* a node that validated has its walk's owner in its header */
        return g_strdup_printf(v->valid ? "bad owner, have %u expect %u" :
                               "reached from trees %u and %u", v->owner,
                               owner);
    }
    if (v->level != e->level || v->generation != e->generation) {
        return g_strdup_printf("shared node is level %u generation %"
                               PRIu64 ", a parent expects %u %" PRIu64,
                               v->level, v->generation, e->level,
                               e->generation);
    }
    if (!v->valid) {
        return NULL;
    }
    if (e->has_first_key && v->has_first_key &&
        v->first_key != e->first_key) {
        return g_strdup_printf("first key mismatch, have 0x%" PRIx64
                               " expect 0x%" PRIx64 " (parent key)",
                               v->first_key, e->first_key);
    }
    if (v->end > e->key_end) {
        return g_strdup_printf("items beyond parent range, have end 0x%"
                               PRIx64 " limit 0x%" PRIx64, v->end,
                               e->key_end);
    }
    if (e->has_bytes && v->node_bytes != e->bytes) {
        return g_strdup_printf("subtree bytes mismatch, have 0x%" PRIx64
                               " expect 0x%" PRIx64 " (parent's "
                               "child_bytes)", v->node_bytes, e->bytes);
    }
    if (owner == EXTREE_TREE_EXTENT && v->data_hi > e->data_end) {
        return g_strdup_printf("item beyond the tree's virtual size, have "
                               "end 0x%" PRIx64 " max 0x%" PRIx64,
                               v->data_hi, e->data_end);
    }
    return NULL;
}

/*
 * A node with a sound header of another known tree than @owner: that
 * tree's walk is to claim and count it, whichever walk comes first
 */
static bool foreign_node(Extree *t, const uint8_t *buf, uint64_t bytenr,
                         uint32_t owner)
{
    uint32_t o = ext_ld32(buf + EXT_NH_OWNER);

    return o != owner && o >= EXTREE_TREE_EXTENT && o < EXT_NTREES &&
           ext_ld32(buf + EXT_NH_MAGIC) == EXTREE_NODE_MAGIC &&
           ext_ld64(buf + EXT_NH_BYTENR) == bytenr &&
           ext_ld32(buf + EXT_NH_CSUM) ==
           extree_crc32c(0, buf + EXT_NH_MAGIC, t->node_size - EXT_NH_MAGIC);
}

/*
 * Walk the subtree at @bytenr; *@items and *@bytes: its leaf items and
 * their lengths.  A node reached again (a snapshot shares it) is not
 * walked again: its reference is counted, and it must be what its new
 * parent expects (visit_disagrees()).
 */
static void walk(CheckCtx *c, uint32_t owner, uint64_t bytenr,
                 const ExtreeNodeExpect *e, uint64_t *items, uint64_t *bytes)
{
    Extree *t = c->t;
    const char *tree = extree_tree_name(owner);
    uint8_t *buf = c->bufs[e->level];
    ExtreeNode view;
    Visit *v;
    char *why = NULL;
    uint32_t nr;
    bool placed;
    int ret = 0;

    *items = *bytes = 0;
    v = g_hash_table_lookup(c->visited, &bytenr);
    if (v) {
        c->has_last = false;
        if (v->owner == owner &&
            (owner != EXTREE_TREE_EXTENT || !extree_has_refs(t))) {
            count(c, owner == EXTREE_TREE_FREE);
            say(c, "corrupt %s node at offset 0x%" PRIx64 ": referenced "
                "twice", tree, bytenr);
            return;
        }
        why = visit_disagrees(v, owner, e);
        if (why) {
            /* not counted as shared: no repair may add a reference */
            count(c, owner == EXTREE_TREE_FREE);
            say(c, "corrupt %s node at offset 0x%" PRIx64 ": %s; the node "
                "is reachable from two parents", tree, bytenr, why);
            g_free(why);
            return;
        }
        v->refs++;
        *items = v->items;
        *bytes = v->bytes;
        return;
    }

    placed = EXTREE_IS_ALIGNED(bytenr, t->block_size) &&
            bytenr >= t->data_start && bytenr < t->host_end &&
            t->host_end - bytenr >= t->node_size;
    if (placed) {
        ret = t->be->ops->pread(t->be->opaque, bytenr, buf, t->node_size);
        if (ret == 0) {
            ret = extree_node_validate(t, buf, bytenr, e, &why);
        } else {
            why = g_strdup_printf("read error: %s", g_strerror(-ret));
        }
        if (ret < 0 && foreign_node(t, buf, bytenr, owner)) {
            /* the pointer is the damage: the node's own tree counts it */
            count(c, owner == EXTREE_TREE_FREE);
            say(c, "corrupt %s node at offset 0x%" PRIx64 ": %s", tree,
                bytenr, why);
            g_free(why);
            c->has_last = false;
            return;
        }
    }
    v = g_new0(Visit, 1);
    v->bytenr = bytenr;
    v->refs = 1;
    v->owner = owner;
    v->level = e->level;
    v->generation = e->generation;
    g_hash_table_insert(c->visited, &v->bytenr, v);
    c->res->nodes++;
    c->res->metadata_bytes += t->node_size;
    claim(c, bytenr, t->node_size, bytenr, claim_kind(owner));

    if (!placed) {
        count(c, owner == EXTREE_TREE_FREE);
        say(c, "corrupt %s node at offset 0x%" PRIx64 ": bad location", tree,
            bytenr);
        return;
    }
    if (ret < 0) {
        count(c, owner == EXTREE_TREE_FREE);
        say(c, "corrupt %s node at offset 0x%" PRIx64 ": %s", tree, bytenr,
            why);
        g_free(why);
        c->has_last = false;
        return;
    }
    view.buf = buf;
    nr = node_nritems(&view);
    v->valid = true;
    v->has_first_key = nr > 0;
    v->first_key = nr ? node_key(&view, 0) : 0;
    v->node_bytes = extree_node_subtree_bytes(&view);
    if (nr && e->level == 0) {
        v->end = leaf_key(&view, nr - 1) + leaf_len(&view, nr - 1);
    } else if (nr) {
        /* at least past its last key, whatever its last child holds */
        v->end = ptr_key(&view, nr - 1) + 1;
    }
    for (uint32_t i = 0; i < nr; i++) {
        if (e->level) {
            ExtreeNodeExpect ce;
            ExtreeKeyPtr kp;
            uint64_t ci, cb;
            Visit *cv;

            ptr_get(&view, i, &kp);
            ce.owner = owner;
            ce.level = e->level - 1;
            ce.generation = kp.child_gen;
            ce.has_first_key = true;
            ce.first_key = kp.key;
            ce.key_end = i + 1 < nr ? ptr_key(&view, i + 1) : e->key_end;
            ce.has_bytes = true;
            ce.bytes = kp.bytes;
            ce.data_end = e->data_end;
            walk(c, owner, kp.child, &ce, &ci, &cb);
            *items += ci;
            *bytes += cb;
            /* the child's walk reused deeper buffers only */
            cv = g_hash_table_lookup(c->visited, &kp.child);
            if (i + 1 == nr && cv && cv->valid && cv->owner == owner) {
                v->end = MAX(v->end, cv->end);
            }
            if (cv && cv->valid && cv->owner == owner) {
                v->data_hi = MAX(v->data_hi, cv->data_hi);
            }
        } else {
            ExtreeItem it;
            leaf_get(&view, i, &it);
            if (c->has_last &&
                extree_tree_vt(owner)->mergeable(&c->last, &it)) {
                c->res->unmerged++;
            }
            c->last = it;
            c->has_last = true;
            (*items)++;
            *bytes += it.length;
            if (it.key < EXTREE_VMSTATE_BASE) {
                v->data_hi = MAX(v->data_hi, it.key + it.length);
            }
            if (owner == EXTREE_TREE_EXTENT) {
                if (it.type == EXTREE_ITEM_DATA) {
                    c->res->data_bytes += it.length;
                    claim(c, it.host, it.length, it.key, CLAIM_DATA);
                } else if (it.type == EXTREE_ITEM_COMPRESSED) {
                    /* the payload's blocks, once per item (never split) */
                    c->res->data_bytes += it.length;
                    if (c->in_live) {
                        /* of the live image, as allocated_clusters is */
                        c->res->compressed_bytes += it.length;
                    }
                    claim_payload(c, it.host,
                                  extree_item_host_bytes(&it, t->block_size),
                                  it.key);
                    g_array_append_val(c->payloads, it);
                }
            } else if (owner == EXTREE_TREE_REFS) {
                g_array_append_val(c->refs_found, it);
            } else {
                c->res->free_items++;
                c->res->free_bytes += it.length;
                claim(c, it.host, it.length, it.key, CLAIM_FREE);
            }
        }
    }
    v->items = *items;
    v->bytes = *bytes;
}

/*
 * Every snapshot's tree: walked (nodes shared with trees walked before are
 * counted, not walked again), its items and bytes compared with its
 * entry; the table's blocks claimed
 */
/*
 * The bitmap directory and chunks: validated when the handle opened
 * (extree_bitmaps_load()); here their blocks are claimed
 */
static void check_bitmaps(CheckCtx *c)
{
    Extree *t = c->t;
    uint64_t len = EXTREE_ROUND_UP(t->bm.dir_len, t->block_size);

    if (t->bm.bad) {
        /* left out at open; a repair removes them */
        c->res->corruptions++;
        c->bitmaps_bad = true;
        say(c, "%s", t->bm.bad);
    }
    if (t->bm.dir) {
        claim_bitmap(c, t->bm.dir, len, BITMAP_DIR, 0);
        c->res->metadata_bytes += len;
    }
    if (t->bm.log) {
        claim(c, t->bm.log, t->bm.log_len, 0, CLAIM_MARK_LOG);
        c->res->metadata_bytes += t->bm.log_len;
    }
    if (t->bm.log_bad) {
        /* the records from there on were not replayed: marks may be lost */
        c->res->corruptions++;
        c->log_bad = true;
        say(c, "%s", t->bm.log_bad);
    }
    c->bitmap_drop = g_new0(bool, t->bm.list ? t->bm.list->len : 0);
    for (guint i = 0; t->bm.list && i < t->bm.list->len; i++) {
        ExtreeBitmap *bm = g_ptr_array_index(t->bm.list, i);

        for (uint64_t ch = 0; ch < bm->nchunks; ch++) {
            if (bm->chunk_off[ch]) {
                claim_bitmap(c, bm->chunk_off[ch], t->block_size, i, ch);
                c->res->metadata_bytes += t->block_size;
            }
        }
    }
}

static void check_snapshots(CheckCtx *c)
{
    Extree *t = c->t;

    if (t->snap.table) {
        claim(c, t->snap.table, t->snap.table_len, 0, CLAIM_SNAP_TABLE);
        c->res->metadata_bytes += t->snap.table_len;
    }
    if (t->snap.gen_bad) {
        c->res->corruptions++;
        c->snapgen_bad = true;
        say(c, "corrupt superblock at offset 0x%" PRIx64 ": snap_generation "
            "%" PRIu64 " not above every snapshot's generation",
            (t->generation % 2) * (uint64_t)EXTREE_SB_SIZE,
            t->snap.gen_stored);
    }
    for (guint i = 0; i < t->snap.list->len; i++) {
        const ExtreeSnap *sn = &g_array_index(t->snap.list, ExtreeSnap, i);
        ExtreeNodeExpect e = {
            .owner = EXTREE_TREE_EXTENT, .level = sn->level,
            .generation = sn->root_gen, .key_end = UINT64_MAX,
            .data_end = EXTREE_ROUND_UP(sn->virtual_size, t->block_size),
        };
        uint64_t items, bytes;

        c->has_last = false;
        walk(c, EXTREE_TREE_EXTENT, sn->root, &e, &items, &bytes);
        if (items != sn->extent_count || bytes != sn->extent_bytes) {
            count(c, false);
            say(c, "corrupt snapshot table at offset 0x%" PRIx64 ": "
                "snapshot '%s' has extent_count %" PRIu64 " extent_bytes "
                "0x%" PRIx64 ", its tree %" PRIu64 " and 0x%" PRIx64,
                t->snap.table, sn->id, sn->extent_count, sn->extent_bytes,
                items, bytes);
        }
    }
}

static gint seg_cmp(gconstpointer a, gconstpointer b)
{
    const Seg *x = a, *y = b;

    return x->start < y->start ? -1 : x->start > y->start;
}

/* The count of @pos in sorted disjoint @segs (1 if none), moving *@i on */
static uint32_t seg_count(GArray *segs, guint *i, uint64_t pos)
{
    while (*i < segs->len && g_array_index(segs, Seg, *i).end <= pos) {
        (*i)++;
    }
    if (*i < segs->len && g_array_index(segs, Seg, *i).start <= pos) {
        return g_array_index(segs, Seg, *i).count;
    }
    return 1;
}

static void add_bound(GArray *b, uint64_t pos)
{
    g_array_append_val(b, pos);
}

/*
 * Counts of 2 and more found by the walk (nodes reached from several
 * parents or roots, DATA blocks of several leaves) against those the
 * reference count tree records.  Fewer recorded than found is corruption
 * (a writer would free a block still in use); more is a leak of
 * references.  O(claims log claims).
 */
static void check_counts(CheckCtx *c)
{
    Extree *t = c->t;
    GArray *found = g_array_new(false, false, sizeof(Seg));
    GArray *rec = g_array_new(false, false, sizeof(Seg));
    GArray *ev = g_array_new(false, false, sizeof(uint64_t) * 2);
    GArray *bounds = g_array_new(false, false, sizeof(uint64_t));
    GHashTableIter hi;
    gpointer val;
    uint64_t depth = 0, prev = 0;
    guint fi = 0, ri = 0;

    /* DATA: how many claims cover each block (a sweep over their ends) */
    for (guint i = 0; i < c->claims->len; i++) {
        const Claim *cl = &g_array_index(c->claims, Claim, i);
        uint64_t e1[2] = { cl->start, 1 }, e2[2] = { cl->start + cl->len, 0 };

        if (cl->kind == CLAIM_DATA) {
            g_array_append_vals(ev, e1, 1);
            g_array_append_vals(ev, e2, 1);
        }
    }
    g_array_sort(ev, extree_u64_cmp);
    for (guint i = 0; i < ev->len; i++) {
        uint64_t *x = &g_array_index(ev, uint64_t, 2 * i);

        if (x[0] > prev && depth >= 2) {
            Seg sg = { prev, x[0], depth };
            g_array_append_val(found, sg);
        }
        prev = x[0];
        depth = x[1] ? depth + 1 : depth - 1;
    }
    g_hash_table_iter_init(&hi, c->visited);
    while (g_hash_table_iter_next(&hi, NULL, &val)) {
        Visit *v = val;
        if (v->refs >= 2) {
            Seg sg = { v->bytenr, v->bytenr + t->node_size, v->refs };
            g_array_append_val(found, sg);
        }
    }
    g_array_sort(found, seg_cmp);
    for (guint i = 0; i < c->refs_found->len; i++) {
        const ExtreeItem *it = &g_array_index(c->refs_found, ExtreeItem, i);
        Seg sg = { it->key, it->key + it->length, it->host };
        g_array_append_val(rec, sg);
    }
    for (guint i = 0; i < found->len; i++) {
        add_bound(bounds, g_array_index(found, Seg, i).start);
        add_bound(bounds, g_array_index(found, Seg, i).end);
    }
    for (guint i = 0; i < rec->len; i++) {
        add_bound(bounds, g_array_index(rec, Seg, i).start);
        add_bound(bounds, g_array_index(rec, Seg, i).end);
    }
    g_array_sort(bounds, extree_u64_cmp);
    for (guint i = 0; i + 1 < bounds->len; i++) {
        uint64_t a = g_array_index(bounds, uint64_t, i);
        uint64_t b = g_array_index(bounds, uint64_t, i + 1);
        uint32_t want, have;

        if (a == b) {
            continue;
        }
        want = seg_count(found, &fi, a);
        have = seg_count(rec, &ri, a);
        if (want == have) {
            continue;
        }
        {
            Seg fix = { a, b, want };
            g_array_append_val(c->ref_fixes, fix);
        }
        if (have < want) {
            c->res->corruptions++;
            c->refs_bad++;
            say(c, "corrupt reference count tree: host range at offset 0x%"
                PRIx64 " length 0x%" PRIx64 " has %u references recorded, %u"
                " found", a, b - a, have, want);
        } else {
            c->res->leaks++;
            c->res->leaked_ref_bytes += b - a;
            say(c, "leaked references: host range at offset 0x%" PRIx64
                " length 0x%" PRIx64 " has %u references recorded, %u found",
                a, b - a, have, want);
        }
    }
    g_array_free(found, true);
    g_array_free(rec, true);
    g_array_free(ev, true);
    g_array_free(bounds, true);
}

static gint payload_cmp(gconstpointer a, gconstpointer b)
{
    const ExtreeItem *x = a, *y = b;

    if (x->host != y->host) {
        return x->host < y->host ? -1 : 1;
    }
    if (x->key != y->key) {
        return x->key < y->key ? -1 : 1;
    }
    if (x->length != y->length) {
        return x->length < y->length ? -1 : 1;
    }
    return x->flags < y->flags ? -1 : x->flags > y->flags;
}

/*
 * Every compressed payload, once (an item several trees share is one):
 * read and decompressed, since its checksum (zlib's Adler-32, zstd's
 * content checksum) covers the decompressed data.  No repair can give
 * the data back: a bad payload is reported, and its item stays.  Memory:
 * two buffers of EXTREE_COMPRESSED_MAX.
 */
static int check_payloads(CheckCtx *c)
{
    Extree *t = c->t;
    GArray *p = c->payloads;
    uint8_t *src = NULL, *dst = NULL;
    int ret = 0;

    g_array_sort(p, payload_cmp);
    for (guint i = 0; i < p->len && ret >= 0; i++) {
        const ExtreeItem *it = &g_array_index(p, ExtreeItem, i);
        uint32_t len = extree_compressed_len(it);
        uint32_t alg = extree_compressed_alg(it);
        char *why;

        if (i && !payload_cmp(it, it - 1)) {
            continue;
        }
        if (!src) {
            src = g_malloc(EXTREE_COMPRESSED_MAX);
            dst = g_malloc(EXTREE_COMPRESSED_MAX);
        }
        ret = t->be->ops->pread(t->be->opaque, it->host, src, len);
        if (ret < 0) {
            why = g_strdup_printf("read error: %s", g_strerror(-ret));
        } else {
            ret = extree_decompress(alg, src, len, dst, it->length);
            why = g_strdup_printf("its %s payload of %u bytes does not "
                                  "decompress to it",
                                  extree_compression_name(alg), len);
        }
        if (ret == -EIO) {
            c->res->corruptions++;
            say(c, "corrupt compressed payload at offset 0x%" PRIx64 ": "
                "extent at guest offset 0x%" PRIx64 " length 0x%" PRIx64
                ": %s", it->host, it->key, it->length, why);
            ret = 0;
        }
        g_free(why);
    }
    g_free(src);
    g_free(dst);
    return ret;
}

static gint claim_cmp(gconstpointer a, gconstpointer b)
{
    const Claim *x = a, *y = b;
    if (x->start != y->start) {
        return x->start < y->start ? -1 : 1;
    }
    return x->kind - y->kind;
}

static const char *claim_name(CheckCtx *c, const Claim *cl, char *buf,
                              size_t size)
{
    switch (cl->kind) {
    case CLAIM_EXTENT_NODE:
        g_snprintf(buf, size, "extent tree node 0x%" PRIx64, cl->key);
        break;
    case CLAIM_FREE_NODE:
        g_snprintf(buf, size, "free tree node 0x%" PRIx64, cl->key);
        break;
    case CLAIM_DATA:
        g_snprintf(buf, size, "extent at guest offset 0x%" PRIx64, cl->key);
        break;
    case CLAIM_REF_NODE:
        g_snprintf(buf, size, "reference count tree node 0x%" PRIx64,
                   cl->key);
        break;
    case CLAIM_SNAP_TABLE:
        g_snprintf(buf, size, "snapshot table");
        break;
    case CLAIM_MARK_LOG:
        g_snprintf(buf, size, "mark log");
        break;
    case CLAIM_BITMAP:
        if (cl->bitmap == BITMAP_DIR) {
            g_snprintf(buf, size, "bitmap directory");
        } else {
            ExtreeBitmap *bm = g_ptr_array_index(c->t->bm.list, cl->bitmap);

            g_snprintf(buf, size, "bitmap '%s' chunk %" PRIu64, bm->name,
                       cl->key);
        }
        break;
    default:
        g_snprintf(buf, size, "free space");
        break;
    }
    return buf;
}

static bool free_side(const Claim *cl)
{
    return cl->kind == CLAIM_FREE || cl->kind == CLAIM_FREE_NODE;
}

/* A repair drops the bitmap of @cl (every bitmap, for the directory) */
static void drop_bitmap(CheckCtx *c, const Claim *cl)
{
    if (cl->bitmap != BITMAP_DIR) {
        c->bitmap_drop[cl->bitmap] = true;
        return;
    }
    c->dir_drop = true;
    for (guint i = 0; i < c->t->bm.list->len; i++) {
        c->bitmap_drop[i] = true;
    }
}

/*
 * Host space claimed by @a and by @b, which starts inside @a.  The
 * free-space tree and the bitmaps are derived data: a repair rebuilds the
 * one and drops the other, and what they overlap keeps its blocks (as
 * qcow2 trusts its L2 tables over its refcounts).  Any other two claims
 * are a double use that no repair resolves: nothing says which is right.
 */
static void overlap(CheckCtx *c, const Claim *a, const Claim *b)
{
    uint64_t at = b->start;
    char an[128], bn[128];

    if (free_side(a) || free_side(b)) {
        count(c, true);
        if (a->kind == CLAIM_DATA || b->kind == CLAIM_DATA) {
            c->data_free++;
        }
    } else if (a->kind == CLAIM_BITMAP || b->kind == CLAIM_BITMAP) {
        c->res->corruptions++;
        c->bitmap_dup++;
        if (a->kind == CLAIM_BITMAP) {
            drop_bitmap(c, a);
        }
        if (b->kind == CLAIM_BITMAP) {
            drop_bitmap(c, b);
        }
    } else {
        count(c, false);
    }
    if (a->kind == CLAIM_DATA && b->kind == CLAIM_DATA) {
        say(c, "corrupt extent tree: double use of host offset 0x%" PRIx64
            " by extents at guest offsets 0x%" PRIx64 " and 0x%" PRIx64,
            at, a->key, b->key);
    } else if (a->kind == CLAIM_FREE || b->kind == CLAIM_FREE) {
        const Claim *o = a->kind == CLAIM_FREE ? b : a;
        say(c, "corrupt free tree: free space at offset 0x%" PRIx64
            " overlaps %s", at, claim_name(c, o, an, sizeof(an)));
    } else {
        say(c, "corrupt host space at offset 0x%" PRIx64 ": %s overlaps %s",
            at, claim_name(c, a, an, sizeof(an)),
            claim_name(c, b, bn, sizeof(bn)));
    }
}

/*
 * @cl against every claim before it that still covers its start (@act,
 * sorted claims): each pair is judged on its own, since the claim that
 * reaches furthest (a free range, say) may hide two others that overlap
 * each other.  Data shared by snapshots is kept as one claim.  O(1) a
 * claim: more than ACTIVE_MAX owners of one block are not kept apart,
 * and no repair resolves them.
 */
static void sweep(CheckCtx *c, GArray *act, const Claim *cl)
{
    bool shared = false;
    guint n = 0;

    for (guint i = 0; i < act->len; i++) {
        Claim *a = &g_array_index(act, Claim, i);

        if (a->start + a->len <= cl->start) {
            continue;
        }
        g_array_index(act, Claim, n) = *a;
        a = &g_array_index(act, Claim, n++);
        if (a->kind == CLAIM_DATA && cl->kind == CLAIM_DATA &&
            extree_has_refs(c->t) && same_data(a, cl, cl->start)) {
            /* shared by snapshots: the counts are checked later */
            a->len = MAX(a->len, cl->start + cl->len - a->start);
            shared = true;
        } else {
            overlap(c, a, cl);
        }
    }
    g_array_set_size(act, n);
    if (shared) {
        return;
    }
    if (n < ACTIVE_MAX) {
        g_array_append_val(act, *cl);
        return;
    }
    count(c, false);
    say(c, "corrupt host space at offset 0x%" PRIx64 ": more than %d "
        "owners", cl->start, ACTIVE_MAX);
}

/*
 * The chain's map records that a read-only check did not apply
 * (extree-txn.c, load_map_log()): a replay claims each host range, so it
 * must be free in the committed state (or lie past its host_end) and
 * apart from the others (spec: Mark log, map records).  After the claims
 * are sorted: O(claims log entries).
 */
static void check_map_records(CheckCtx *c)
{
    GArray *a = c->t->bm.map_replay;
    ExtreeRangeSet hosts = { 0 };
    char name[128];

    if (!a || !a->len) {
        return;
    }
    for (guint i = 0; i < a->len; i++) {
        ExtreeMapEntry *me = &g_array_index(a, ExtreeMapEntry, i);

        if (extree_rs_overlaps(&hosts, me->host, me->length)) {
            c->res->corruptions++;
            c->log_bad = true;
            say(c, "corrupt mark log at offset 0x%" PRIx64 ": map entry %u:"
                " host offset 0x%" PRIx64 " mapped twice", c->t->bm.log, i,
                me->host);
            continue;
        }
        extree_rs_union(&hosts, me->host, me->length);
    }
    for (guint i = 0; i < c->claims->len; i++) {
        const Claim *cl = &g_array_index(c->claims, Claim, i);

        if (!free_side(cl) && extree_rs_overlaps(&hosts, cl->start,
                                                 cl->len)) {
            c->res->corruptions++;
            c->log_bad = true;
            say(c, "corrupt mark log at offset 0x%" PRIx64 ": a map entry's"
                " host range overlaps %s at offset 0x%" PRIx64, c->t->bm.log,
                claim_name(c, cl, name, sizeof(name)), cl->start);
        }
    }
    extree_rs_clear(&hosts);
}

static void leak(CheckCtx *c, GArray *leaks, uint64_t start, uint64_t end)
{
    Claim l = { .start = start, .len = end - start, .kind = CLAIM_FREE };

    c->res->leaks++;
    c->res->leaked_bytes += end - start;
    say(c, "leaked host space at offset 0x%" PRIx64 ", length 0x%" PRIx64,
        start, end - start);
    g_array_append_val(leaks, l);
}

/*
 * Everything but the free-space tree and free space (extent-tree nodes,
 * DATA extents, reference count tree nodes, the snapshot table), sorted
 * and merged (ExtreeAllocOp)
 */
static GArray *used_ranges(CheckCtx *c)
{
    GArray *used = g_array_new(false, false, sizeof(ExtreeAllocOp));

    for (guint i = 0; i < c->claims->len; i++) {
        const Claim *cl = &g_array_index(c->claims, Claim, i);
        ExtreeAllocOp *last = used->len ?
            &g_array_index(used, ExtreeAllocOp, used->len - 1) : NULL;

        if (free_side(cl) || (cl->kind == CLAIM_BITMAP &&
                              (cl->bitmap == BITMAP_DIR ? c->dir_drop :
                               c->bitmap_drop[cl->bitmap]))) {
            continue;
        }
        if (last && cl->start <= last->start + last->len) {
            last->len = MAX(last->len, cl->start + cl->len - last->start);
        } else {
            ExtreeAllocOp op = { cl->start, cl->len, false };
            g_array_append_val(used, op);
        }
    }
    return used;
}

/*
 * The repairs @repair_leaks allows, after the walk.  Returns 0 or the error
 * of the commit that makes them durable.
 */
static int repair(CheckCtx *c, unsigned fix, GArray *leaks)
{
    Extree *t = c->t;
    ExtreeCheckResult *res = c->res;
    bool free_bad = c->free_bad || c->bitmap_dup || !t->space.alloc_loaded;
    uint64_t fixed = 0;
    int ret = 0;

    if (t->read_only || t->broken || c->extent_bad ||
        ((free_bad || c->count_bad || c->refs_bad || c->snapgen_bad ||
          c->bitmaps_bad || c->log_bad) && !(fix & EXTREE_FIX_ERRORS))) {
        if (leaks->len && (fix & EXTREE_FIX_LEAKS)) {
            say(c, "leaks not repaired: %s", t->read_only ? "read-only" :
                t->broken ? "the image handle failed earlier" :
                "the image has corruptions");
        }
        return 0;
    }
    if (c->ref_fixes->len && t->space.alloc_loaded &&
        (fix & EXTREE_FIX_LEAKS)) {
        /*
         * The counts the walk found become the recorded ones: references
         * leaked with "-r leaks", missing ones (corruption) with "-r all"
         */
        uint64_t over = 0;

        for (guint i = 0; i < c->ref_fixes->len && ret == 0; i++) {
            const Seg *sg = &g_array_index(c->ref_fixes, Seg, i);
            ret = extree_refs_set(t, sg->start, sg->end - sg->start,
                                  sg->count);
        }
        if (ret < 0) {
            say(c, "repairing reference counts failed: %s",
                g_strerror(-ret));
            return ret;
        }
        over = c->ref_fixes->len - c->refs_bad;
        say(c, "reference counts of %u host ranges set to those found",
            c->ref_fixes->len);
        res->repaired_leaks += over;
        fixed += c->refs_bad;
    }
    if (c->snapgen_bad) {
        /* "-r all": the value open raised it to (check_snap_gen()) */
        t->snap.gen_bad = false;
        t->super_dirty = true;
        say(c, "snap_generation set to %" PRIu64, t->snap.gen);
        fixed++;
    }
    if (c->bitmaps_bad) {
        /* "-r all": the damaged bitmaps go; their blocks are leaks */
        extree_bitmaps_drop_damaged(t);
        say(c, "damaged bitmaps removed");
        fixed++;
    }
    if (c->log_bad) {
        /*
         * "-r all": what the records from the damaged one on marked is
         * unknown, so every enabled bitmap marks everything (the next
         * incremental backup is a full one); the commit below stores it
         * and leaves the chain stale
         */
        extree_bitmaps_mark(t, 0, t->virtual_size);
        g_free(t->bm.log_bad);
        t->bm.log_bad = NULL;
        t->super_dirty = true;
        say(c, "mark log damaged: every enabled bitmap marked whole");
        fixed++;
    }
    if (c->bitmap_dup) {
        /*
         * "-r all": a bitmap is derived data; it goes, and whatever else
         * claims its blocks keeps them (the free tree is rebuilt below)
         */
        for (guint i = 0; i < t->bm.list->len; i++) {
            if (c->bitmap_drop[i]) {
                say(c, "bitmap '%s' removed: it shares host space with "
                    "another structure",
                    ((ExtreeBitmap *)g_ptr_array_index(t->bm.list, i))->name);
            }
        }
        extree_bitmaps_forget(t, c->bitmap_drop, c->dir_drop);
        fixed += c->bitmap_dup;
    }
    if (c->count_bad) {
        /* "-r all": the walk counted the extent tree's items */
        t->trees[EXTREE_TREE_EXTENT].nitems = res->extents;
        t->super_dirty = true;
        fixed++;
    }
    if (free_bad) {
        /*
         * "-r all": the extent tree is sound, the free tree is not; every
         * block that is neither an extent-tree node nor DATA is free
         */
        GArray *used = used_ranges(c);

        ret = extree_freetree_rebuild(t, used);
        g_array_free(used, true);
        if (ret == 0) {
            ret = extree_commit(t);
        }
        if (ret < 0) {
            say(c, "rebuilding the free-space tree failed: %s",
                g_strerror(-ret));
            t->broken = true;
            return ret;
        }
        say(c, "free-space tree rebuilt from the extent tree");
        if (c->data_free) {
            /* as qcow2 trusts an L2 entry over a refcount of 0 */
            say(c, "extents keep the host space the free tree listed under "
                "them (%" PRIu64 " overlaps): they read what it holds",
                c->data_free);
        }
        res->repaired_corruptions = c->free_bad + fixed;
        res->repaired_leaks = res->leaks;
        return 0;
    }
    for (guint i = 0; (fix & EXTREE_FIX_LEAKS) && i < leaks->len &&
         ret == 0; i++) {
        const Claim *l = &g_array_index(leaks, Claim, i);
        ret = extree_alloc_add_free(t, l->start, l->len);
        if (ret == 0) {
            res->repaired_leaks++;
        }
    }
    if (ret == 0 && extree_is_dirty(t)) {
        ret = extree_commit(t);
    }
    if (ret == 0 && c->count_bad) {
        say(c, "extent_count set to %" PRIu64, res->extents);
    }
    if (ret == 0) {
        res->repaired_corruptions += fixed;
    }
    return ret;
}

int extree_check(Extree *t, bool repair_leaks, ExtreeCheckResult *res,
                 ExtreeReportFn *report, void *opaque)
{
    unsigned fix = 0;

    if (repair_leaks) {
        fix = EXTREE_FIX_LEAKS | (t->repair ? EXTREE_FIX_ERRORS : 0);
    }
    return extree_check_fix(t, fix, res, report, opaque);
}

int extree_check_fix(Extree *t, unsigned fix, ExtreeCheckResult *res,
                     ExtreeReportFn *report, void *opaque)
{
    CheckCtx c = { .t = t, .res = res, .report = report, .opaque = opaque };
    GArray *leaks = g_array_new(false, false, sizeof(Claim));
    uint64_t sb_off = (t->generation % 2) * EXTREE_SB_SIZE;
    GArray *active = g_array_new(false, false, sizeof(Claim));
    uint64_t pos;
    int ret = 0;

    memset(res, 0, sizeof(*res));
    t->chk.clean_gen = 0;
    if (t->space.alloc_partial) {
        /* repairs need all free space; damage found leaves none loaded */
        extree_freetree_load_rest(t);
    }
    if (!t->read_only && !t->broken && t->space.alloc_loaded) {
        ret = extree_commit(t);
        if (ret < 0) {
            g_array_free(leaks, true);
            return ret;
        }
    }
    c.claims = g_array_new(false, false, sizeof(Claim));
    c.visited = g_hash_table_new_full(g_int64_hash, g_int64_equal, NULL,
                                      g_free);
    for (int l = 0; l < EXTREE_MAX_LEVELS; l++) {
        c.bufs[l] = g_malloc(t->node_size);
    }
    c.refs_found = g_array_new(false, false, sizeof(ExtreeItem));
    c.payloads = g_array_new(false, false, sizeof(ExtreeItem));
    c.ref_fixes = g_array_new(false, false, sizeof(Seg));
    for (uint32_t owner = EXTREE_TREE_EXTENT; owner < EXT_NTREES; owner++) {
        ExtreeTree *tree = &t->trees[owner];
        ExtreeNodeExpect e;
        uint64_t items, bytes;

        if (owner == EXTREE_TREE_REFS && !extree_has_refs(t)) {
            continue;
        }
        extree_tree_expect(t, tree, &e);
        c.has_last = false;
        c.in_live = owner == EXTREE_TREE_EXTENT;
        walk(&c, tree->owner, tree->root, &e, &items, &bytes);
        c.in_live = false;
        if (owner == EXTREE_TREE_EXTENT) {
            res->extents = items;
        }
    }
    check_bitmaps(&c);
    if (extree_has_refs(t)) {
        check_snapshots(&c);
        check_counts(&c);
    }
    if (t->chk.root_bytes_bad) {
        count(&c, false);
        say(&c, "corrupt extent tree node at offset 0x%" PRIx64 ": subtree "
            "bytes mismatch, have 0x%" PRIx64 " expect 0x%" PRIx64
            " (superblock's extent_bytes)", t->trees[EXTREE_TREE_EXTENT].root,
            t->trees[EXTREE_TREE_EXTENT].total, t->chk.root_bytes_want);
    }
    if (res->extents != t->trees[EXTREE_TREE_EXTENT].nitems) {
        res->corruptions++;
        c.count_bad = true;
        say(&c, "corrupt superblock at offset 0x%" PRIx64 ": extent_count "
            "mismatch, have %" PRIu64 " expect %" PRIu64, sb_off,
            t->trees[EXTREE_TREE_EXTENT].nitems, res->extents);
    }
    if (res->free_bytes != extree_sb_free_bytes(t)) {
        count(&c, true);
        say(&c, "corrupt superblock at offset 0x%" PRIx64 ": free_bytes "
            "mismatch, have %" PRIu64 " expect %" PRIu64 " (free tree)",
            sb_off, extree_sb_free_bytes(t), res->free_bytes);
    }

    /* Every block of [data_start, host_end) has exactly one owner */
    g_array_sort(c.claims, claim_cmp);
    check_map_records(&c);
    pos = t->data_start;
    for (guint i = 0; i < c.claims->len; i++) {
        const Claim *cl = &g_array_index(c.claims, Claim, i);
        if (cl->start > pos) {
            leak(&c, leaks, pos, cl->start);
        }
        sweep(&c, active, cl);
        pos = MAX(pos, cl->start + cl->len);
    }
    if (pos < t->host_end) {
        leak(&c, leaks, pos, t->host_end);
    }

    ret = check_payloads(&c);
    if (ret == 0 && fix) {
        ret = repair(&c, fix, leaks);
    }
    if (ret == 0 && res->corruptions == res->repaired_corruptions &&
        !extree_is_dirty(t)) {
        t->chk.clean_gen = t->generation;
    }

    for (int l = 0; l < EXTREE_MAX_LEVELS; l++) {
        g_free(c.bufs[l]);
    }
    g_hash_table_destroy(c.visited);
    g_array_free(c.refs_found, true);
    g_array_free(c.ref_fixes, true);
    g_array_free(c.claims, true);
    g_array_free(c.payloads, true);
    g_array_free(active, true);
    g_free(c.bitmap_drop);
    g_array_free(leaks, true);
    return ret;
}
