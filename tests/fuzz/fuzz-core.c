/*
 * extree fuzzing: the target over the core, on an in-memory image
 *
 * Each input (fuzz-input.h) is opened read-write (read-only if that
 * fails), walked with cursor queries over the whole virtual size in both
 * coalescing modes, read through lookups forward, backward and at offsets
 * drawn from the input's seed, and checked.  Then a few writes, zeroes and
 * punches, a commit, a reopen and the same reads again.  Sometimes the
 * checker's repair and the corrupt bit are exercised on a copy.
 *
 * The oracle (issue 22): when the mutator recorded its edits, the image
 * they started from is rebuilt and read once (cached) as the reference,
 * per 512-byte sector: contents and whether it is allocated.  If every
 * edit lies in one node of the extent tree, a successful read of a sector
 * outside that node's key range must return the reference; inside it too,
 * when the node is an interior node (a leaf's items are the mapping
 * itself: without data checksums no reader can tell a changed host offset
 * or type from a real one).  Edits confined to one free-space tree node
 * must not change any read; edits of the superblock (but not of its
 * extent-tree root, which may legitimately name another tree) may only
 * make reads fail.  Block status (allocated or not) is held to the same
 * rules.  After the target's own updates, where the edits cannot mislead
 * the allocator (interior node, superblock, none), a successful commit
 * must reopen and read back what was written; a failed one the state of
 * the last successful commit.  A violation calls abort().
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdio.h>
#include <stdlib.h>

#include "fuzz-input.h"
#include "extree-backend.h"

#define SECTOR          512
/* Bounds that keep one input fast whatever its geometry claims */
#define MAX_QUERIES     20000
#define MAX_FAILURES    64
#define MAX_REF_SECTORS (64 * 1024)
#define REF_CACHE_MAX   64

/* Expected state of a sector */
#define SEC_UNKNOWN     0xff    /* after a failed update: anything goes */

typedef struct FzRef {
    bool valid;
    uint64_t leaks;             /* the checker's, of the reference */
    uint64_t vsize;
    uint64_t nsec;
    uint32_t *crc;              /* crc32c of each sector's contents */
    uint8_t *alloc;             /* 1 if DATA or ZERO */
    FzImage *im;                /* live nodes, for locating edits */
} FzRef;

typedef enum FzScope {
    SCOPE_NONE,                 /* the reference itself: no edits */
    SCOPE_EXTENT_NODE,
    SCOPE_FREE_NODE,
    SCOPE_SUPER,
    SCOPE_OTHER,                /* no read oracle */
} FzScope;

typedef struct FzRun {
    uint64_t rng;
    const FzRef *ref;
    FzScope scope;
    uint64_t lo, hi;            /* SCOPE_EXTENT_NODE: its key range */
    bool inside_strict;         /* reads inside [lo, hi) checked too */
    /*
     * The edited node is the extent tree's root and its items no longer
     * add up to the bytes they mapped: in an image without extent_bytes
     * nothing records that sum, so no reader can see lost items
     * (EXTREE_FUZZ_TOLERATE=root-sum, tests/fuzz/crashes/README)
     */
    bool root_sum_changed;
    /*
     * The edited node is an interior node of the extent tree whose keys
     * changed: a separator moved over a sibling's items hides them from
     * every reader that does not visit that sibling, which reads a hole
     * there; only the checker, which visits every node, can see it.  Only
     * hole answers are let pass (EXTREE_FUZZ_TOLERATE=separator,
     * tests/fuzz/crashes/README).
     */
    bool keys_moved;
    /* the allocator cannot be misled: a commit must reopen */
    bool reopen_oracle;
    /* ... and read back what was written (else: no read oracle then) */
    bool write_oracle;
    uint32_t zero_crc;
    /* expected: what the handle should read now / after reopen */
    uint32_t *exp_crc, *com_crc;
    uint8_t *exp_alloc, *com_alloc;
    const char *phase;
    ExtreeBackend *be;
    uint8_t *buf;
    size_t buf_len;
    int queries;
} FzRun;

/*
 * Known violations to let pass, for a long run to look past one already
 * reported (EXTREE_FUZZ_TOLERATE=root-sum); none by default
 */
static bool tolerated(const FzRun *r, const ExtreeRun *run)
{
    static int root_sum = -1, separator;

    if (root_sum < 0) {
        const char *env = g_getenv("EXTREE_FUZZ_TOLERATE");
        root_sum = env && strstr(env, "root-sum");
        separator = env && strstr(env, "separator");
    }
    return (root_sum && r->root_sum_changed) ||
           (separator && r->keys_moved && run->type == EXTREE_RUN_UNALLOC);
}

static GHashTable *ref_cache;

/*
 * Buffers reused from one input to the next: fresh ones of this size
 * would be mapped and unmapped every time
 */
static void *scratch(void **buf, size_t *cap, size_t len)
{
    if (len > *cap) {
        g_free(*buf);
        *cap = MAX(len, *cap * 2);
        *buf = g_malloc(*cap);
    }
    return *buf;
}

static uint64_t fz_rand(FzRun *r)
{
    return fz_splitmix64(&r->rng);
}

static uint64_t fz_below(FzRun *r, uint64_t n)
{
    return n ? fz_rand(r) % n : 0;
}

static void G_GNUC_PRINTF(2, 3) G_GNUC_NORETURN
violation(FzRun *r, const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "extree fuzz oracle violation (%s, scope %d, node range "
            "[0x%" PRIx64 ", 0x%" PRIx64 ")): ", r->phase, r->scope, r->lo,
            r->hi);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    abort();
}

/*
 * The memory backend, except that a discard of more than 1 MiB does
 * nothing (discard is advisory): the memory backend zeroes page by page,
 * and an edited host_end can make the core discard terabytes
 */
typedef struct FzBackend {
    ExtreeBackend be;           /* what the core gets */
    ExtreeBackend *mem;
} FzBackend;

static const ExtreeBackendOps *mem_ops;
static ExtreeBackendOps fz_ops;

static int fz_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    return bytes > (1 << 20) ? 0 : mem_ops->discard(opaque, offset, bytes);
}

static ExtreeBackend *fz_backend(ExtreeBackend *mem)
{
    FzBackend *f = g_new(FzBackend, 1);

    if (!mem_ops) {
        mem_ops = mem->ops;
        fz_ops = *mem->ops;
        fz_ops.discard = fz_discard;
    }
    f->be.ops = &fz_ops;
    f->be.opaque = mem->opaque;
    f->mem = mem;
    return &f->be;
}

static void fz_backend_free(ExtreeBackend *be)
{
    FzBackend *f = (FzBackend *)be;     /* be is the first member */

    extree_mem_backend_free(f->mem);
    g_free(f);
}

static ExtreeBackend *fz_backend_clone(ExtreeBackend *be)
{
    return fz_backend(extree_mem_backend_clone(
                          ((FzBackend *)be)->mem));
}

/* An image in memory; all-zero pages are left as holes */
static ExtreeBackend *backend_from(const uint8_t *img, size_t len)
{
    ExtreeBackend *be = fz_backend(extree_mem_backend_new());

    for (size_t off = 0; off < len; off += 4096) {
        size_t n = MIN(len - off, 4096);

        if (off + n == len || !fz_is_zero(img + off, n)) {
            be->ops->pwrite(be->opaque, off, img + off, n);
        }
    }
    return be;
}

static int fz_open(ExtreeBackend *be, bool ro, bool repair, Extree **t)
{
    ExtreeOpenOptions o = {
        .read_only = ro, .repair = repair,
        /* a small cache: eviction and re-reads are part of the test */
        .cache_size = 64 * 4096,
    };
    char *err = NULL;
    int ret = extree_open(be, &o, t, &err);

    g_free(err);
    return ret;
}

/* ---- the reference ---- */

static void ref_free(gpointer p)
{
    FzRef *ref = p;

    g_free(ref->crc);
    g_free(ref->alloc);
    g_free(ref->im);
    g_free(ref);
}

/*
 * Read every sector of an image that opens and checks without
 * corruption; valid = false otherwise
 */
static FzRef *ref_build(const uint8_t *img, size_t len)
{
    FzRef *ref = g_new0(FzRef, 1);
    ExtreeBackend *be = backend_from(img, len);
    ExtreeCheckResult res;
    ExtreeCursor c;
    Extree *t;
    uint8_t sec[SECTOR];
    uint64_t g = 0;

    ref->im = g_new(FzImage, 1);
    if (!fz_image_parse(ref->im, img, len) ||
        fz_open(be, true, false, &t) < 0) {
        fz_backend_free(be);
        return ref;
    }
    ref->vsize = extree_virtual_size(t);
    ref->nsec = ref->vsize / SECTOR;
    if (ref->nsec > MAX_REF_SECTORS ||
        extree_check(t, false, &res, NULL, NULL) < 0 || res.corruptions) {
        goto out;
    }
    ref->leaks = res.leaks;
    ref->crc = g_new(uint32_t, ref->nsec);
    ref->alloc = g_new(uint8_t, ref->nsec);
    extree_cursor_init(&c, t);
    while (g < ref->vsize) {
        ExtreeRun run;

        if (extree_cursor_query(&c, g, ref->vsize - g, EXTREE_COALESCE_HOST,
                                &run) < 0) {
            break;
        }
        for (uint64_t off = 0; off < run.length; off += SECTOR) {
            uint64_t s = (g + off) / SECTOR;

            memset(sec, 0, SECTOR);
            if (run.type == EXTREE_RUN_DATA &&
                be->ops->pread(be->opaque, run.host + off, sec, SECTOR) < 0) {
                break;
            }
            ref->crc[s] = extree_crc32c(0, sec, SECTOR);
            ref->alloc[s] = run.type != EXTREE_RUN_UNALLOC;
        }
        g += run.length;
    }
    extree_cursor_release(&c);
    ref->valid = g == ref->vsize;
out:
    extree_close(t);
    fz_backend_free(be);
    return ref;
}

static const FzRef *ref_get(const uint8_t *img, size_t len)
{
    uint64_t key = (uint64_t)len << 32 | extree_crc32c(0, img, len);
    FzRef *ref;

    if (!ref_cache) {
        ref_cache = g_hash_table_new_full(g_int64_hash, g_int64_equal,
                                          g_free, ref_free);
    }
    ref = g_hash_table_lookup(ref_cache, &key);
    if (!ref) {
        if (g_hash_table_size(ref_cache) >= REF_CACHE_MAX) {
            g_hash_table_remove_all(ref_cache);
        }
        ref = ref_build(img, len);
        g_hash_table_insert(ref_cache, g_memdup2(&key, sizeof(key)), ref);
    }
    return ref->valid ? ref : NULL;
}

/*
 * Which structure the recorded edits changed, in the reference's terms,
 * and so which oracles apply
 */
/* Summed lengths under an interior node (child_bytes) or of a leaf */
static uint64_t node_sum(const uint8_t *img, size_t len, uint64_t bytenr,
                         uint32_t ns)
{
    const uint8_t *b = img + bytenr;
    unsigned level;
    uint32_t nr;
    uint64_t sum = 0;

    if (bytenr > len || len - bytenr < ns) {
        return 0;
    }
    level = b[EXT_NH_LEVEL];
    nr = MIN(ext_ld32(b + EXT_NH_NRITEMS), EXTREE_LEAF_CAPACITY(ns));
    for (uint32_t i = 0; i < nr; i++) {
        sum += ext_ld64(b + EXTREE_NODE_HEADER_SIZE + i * 32 +
                        (level ? 24 : 8));
    }
    return sum;
}

/* An interior node at @bytenr whose keys differ from the original's */
static bool keys_moved(const uint8_t *img, const uint8_t *orig, size_t len,
                       uint64_t bytenr, uint32_t ns)
{
    const uint8_t *a = orig + bytenr, *b = img + bytenr;
    uint32_t nr;

    if (bytenr > len || len - bytenr < ns || !a[EXT_NH_LEVEL]) {
        return false;
    }
    nr = MIN(MAX(ext_ld32(a + EXT_NH_NRITEMS), ext_ld32(b + EXT_NH_NRITEMS)),
             EXTREE_INTERIOR_CAPACITY(ns));
    for (uint32_t i = 0; i < nr; i++) {
        size_t off = EXTREE_NODE_HEADER_SIZE + (size_t)i * EXT_PTR_ISZ +
                     EXT_KP_KEY;
        if (ext_ld64(a + off) != ext_ld64(b + off)) {
            return true;
        }
    }
    return false;
}

static void classify(FzRun *r, const FzInput *in, const uint8_t *img,
                     const uint8_t *orig)
{
    const FzImage *im = r->ref->im;
    int node = -1;
    bool sb = false, sb_root = false;
    uint64_t gen;

    r->scope = SCOPE_NONE;
    r->reopen_oracle = r->write_oracle = true;
    for (uint32_t i = 0; i < in->f.nrec; i++) {
        const FzRecord *rec = &in->rec[i];
        int n;

        if (rec->len == 0) {
            continue;
        }
        if (rec->off + rec->len <= EXTREE_SB_AREA) {
            uint64_t s = rec->off % EXTREE_SB_SIZE;

            sb = true;
            /* extent_root: bytenr, generation, level */
            sb_root |= s < 104 && s + rec->len > 80;
            continue;
        }
        n = fz_node_at(im, rec->off, rec->len);
        if (node == -2 || n < 0 || (node >= 0 && n != node)) {
            node = -2;          /* not one node */
            continue;
        }
        node = n;
    }
    if (sb && node == -1) {
        /*
         * The whole disk is "inside": reads may fail, not change.  Unless
         * the edits name another extent tree, or make the other slot the
         * newest: an older tree is as valid as the newest one.  Either
         * way the writer must keep its image openable.
         */
        r->scope = SCOPE_SUPER;
        r->lo = 0;
        r->hi = UINT64_MAX;
        r->inside_strict = true;
        if (sb_root || fz_best_slot(img, in->img_len, &gen) != im->slot) {
            r->scope = SCOPE_OTHER;
            r->write_oracle = false;
        }
    } else if (sb || node == -2) {
        r->scope = SCOPE_OTHER;
        r->reopen_oracle = r->write_oracle = false;
    } else if (node >= 0 && im->nodes[node].owner == EXTREE_TREE_EXTENT) {
        /*
         * A changed leaf item may name space in use elsewhere (no reader
         * can know), which the writer then frees and reuses
         */
        r->scope = SCOPE_EXTENT_NODE;
        r->lo = im->nodes[node].lo;
        r->hi = im->nodes[node].hi;
        r->inside_strict = im->nodes[node].level > 0;
        r->reopen_oracle = r->write_oracle = im->nodes[node].level > 0;
        r->root_sum_changed = node == 0 &&
            node_sum(orig, in->img_len, im->nodes[0].bytenr, im->ns) !=
            node_sum(img, in->img_len, im->nodes[0].bytenr, im->ns);
        r->keys_moved = keys_moved(img, orig, in->img_len,
                                   im->nodes[node].bytenr, im->ns);
    } else if (node >= 0) {
        /* reads do not use the free-space tree; the allocator trusts it */
        r->scope = SCOPE_FREE_NODE;
        r->reopen_oracle = r->write_oracle = false;
    }
}

/* ---- reads, checked against the expected state ---- */

static bool sector_checked(FzRun *r, uint64_t s)
{
    uint64_t off = s * SECTOR;

    if (!r->ref || s >= r->ref->nsec || r->scope == SCOPE_OTHER) {
        return false;
    }
    if (r->scope == SCOPE_EXTENT_NODE || r->scope == SCOPE_SUPER) {
        bool inside = off < r->hi && off + SECTOR > r->lo;
        return !inside || r->inside_strict;
    }
    return true;
}

/*
 * The whole sectors of a run (a lookup need not be sector-aligned):
 * [*first, *end) and the offset of *first into the run
 */
static uint64_t run_sectors(const ExtreeRun *run, uint64_t *first,
                            uint64_t *end)
{
    uint64_t start = EXTREE_ROUND_UP(run->guest, SECTOR);

    *first = start / SECTOR;
    *end = (run->guest + run->length) / SECTOR;
    return start - run->guest;
}

/* A run answered successfully: its allocation status */
static void check_status(FzRun *r, const ExtreeRun *run)
{
    bool alloc = run->type != EXTREE_RUN_UNALLOC;
    uint64_t s, end;

    run_sectors(run, &s, &end);
    for (; r->ref && s < MIN(end, r->ref->nsec); s++) {
        if (sector_checked(r, s) && r->exp_alloc[s] != SEC_UNKNOWN &&
            r->exp_alloc[s] != alloc && !tolerated(r, run)) {
            violation(r, "block status of sector 0x%" PRIx64 " (guest 0x%"
                      PRIx64 "): allocated %d, expect %d (run [0x%" PRIx64
                      ", +0x%" PRIx64 ") type %d)", s, s * SECTOR, alloc,
                      r->exp_alloc[s], run->guest, run->length, run->type);
        }
    }
}

/* A run answered successfully (COALESCE_HOST): the data it reads */
static void check_data(FzRun *r, const ExtreeRun *run)
{
    uint8_t sec[SECTOR];
    uint64_t s, end, off = run_sectors(run, &s, &end);

    check_status(r, run);
    for (; r->ref && s < MIN(end, r->ref->nsec); s++, off += SECTOR) {
        uint32_t crc = r->zero_crc;

        if (!sector_checked(r, s) || r->exp_alloc[s] == SEC_UNKNOWN) {
            continue;
        }
        if (run->type == EXTREE_RUN_DATA) {
            if (r->be->ops->pread(r->be->opaque, run->host + off, sec,
                                  SECTOR) < 0) {
                continue;
            }
            crc = extree_crc32c(0, sec, SECTOR);
        }
        if (crc != r->exp_crc[s] && !tolerated(r, run)) {
            violation(r, "sector 0x%" PRIx64 " (guest 0x%" PRIx64 ") reads "
                      "wrong data with success: run [0x%" PRIx64 ", +0x%"
                      PRIx64 ") type %d host 0x%" PRIx64, s, s * SECTOR,
                      run->guest, run->length, run->type, run->host);
        }
    }
}

static bool budget(FzRun *r)
{
    return ++r->queries <= MAX_QUERIES;
}

/* One cursor over the whole virtual size; a failure skips a block */
static void walk(FzRun *r, Extree *t, int coalesce, uint64_t max_bytes)
{
    uint64_t vsize = extree_virtual_size(t), bs = extree_block_size(t);
    uint64_t g = 0;
    int fails = 0;
    ExtreeCursor c;

    extree_cursor_init(&c, t);
    while (g < vsize && budget(r)) {
        ExtreeRun run;
        int ret = extree_cursor_query(&c, g, max_bytes, coalesce, &run);

        if (ret < 0) {
            if (++fails > MAX_FAILURES) {
                break;
            }
            g = (g / bs + 1) * bs;
            continue;
        }
        if (run.guest != g || run.length == 0 || run.length > max_bytes ||
            run.length > vsize - g) {
            violation(r, "cursor query at 0x%" PRIx64 " max 0x%" PRIx64
                      " answered [0x%" PRIx64 ", +0x%" PRIx64 ")", g,
                      max_bytes, run.guest, run.length);
        }
        if (coalesce == EXTREE_COALESCE_HOST) {
            check_data(r, &run);
        } else {
            check_status(r, &run);
        }
        g += run.length;
        /* the lock-free fast path on the same leaf */
        if (g < vsize && (g & 1024)) {
            ret = extree_cursor_query_cached(&c, g, max_bytes, &run);
            if (ret == 0) {
                check_data(r, &run);
                g += run.length;
            }
        }
    }
    extree_cursor_release(&c);
}

static void lookup(FzRun *r, Extree *t, uint64_t guest, uint64_t bytes)
{
    ExtreeRun runs[8];
    int n = 0;

    if (!budget(r)) {
        return;
    }
    extree_lookup(t, guest, bytes, runs, G_N_ELEMENTS(runs), &n);
    for (int i = 0; i < n; i++) {
        check_data(r, &runs[i]);
    }
}

/* About @n lookups backward over [lo, hi) */
static void sweep_back(FzRun *r, Extree *t, uint64_t lo, uint64_t hi, int n)
{
    uint64_t vsize = extree_virtual_size(t), bs = extree_block_size(t);
    uint64_t blocks, step;

    hi = MIN(hi, vsize);
    if (lo >= hi) {
        return;
    }
    blocks = (hi - lo) / bs;
    step = MAX(blocks / n, 1);
    for (uint64_t b = blocks; b > 0;) {
        b = b > step ? b - step : 0;
        lookup(r, t, lo + (b + fz_below(r, step)) * bs,
               bs * (1 + fz_below(r, 4)));
    }
}

/*
 * Lookups in an order the cache does not expect: backward over the disk
 * and over the edited node's range (a node's right sibling first, then
 * the node: issue 22's first recipe), then at random offsets, some near
 * the edges of the edited node's range, some not sector-aligned
 */
static void lookups(FzRun *r, Extree *t)
{
    uint64_t vsize = extree_virtual_size(t), bs = extree_block_size(t);

    sweep_back(r, t, 0, vsize, 32);
    if (r->scope == SCOPE_EXTENT_NODE) {
        sweep_back(r, t, r->lo, r->hi, 32);
    }
    for (int i = 0; i < 8; i++) {
        uint64_t g = fz_below(r, vsize / bs + 1) * bs;

        if (r->scope == SCOPE_EXTENT_NODE && fz_below(r, 2)) {
            g = (fz_below(r, 2) ? r->lo : r->hi) + (fz_below(r, 5) - 2) * bs;
        }
        if (fz_below(r, 8) == 0) {
            g += fz_below(r, bs);
        }
        lookup(r, t, g, bs * (1 + fz_below(r, 64)));
    }
}

/*
 * The first read of an image gets everything; later ones (after the
 * core's own updates) one walk and some of the rest
 */
static void reads(FzRun *r, Extree *t, const char *phase, bool all)
{
    uint64_t vsize = extree_virtual_size(t);

    r->phase = phase;
    r->queries = 0;
    walk(r, t, EXTREE_COALESCE_HOST, vsize);
    if (all || fz_below(r, 4) == 0) {
        walk(r, t, EXTREE_COALESCE_ALLOC, vsize);
    }
    if (fz_below(r, 4) == 0) {
        walk(r, t, EXTREE_COALESCE_HOST, extree_block_size(t) *
             (1 + fz_below(r, 16)));
    }
    if (all || fz_below(r, 2) == 0) {
        lookups(r, t);
    }
}

/* ---- updates ---- */

static void expect_set(FzRun *r, uint64_t guest, uint64_t bytes,
                       const uint8_t *data, uint8_t alloc)
{
    for (uint64_t off = 0; off < bytes; off += SECTOR) {
        uint64_t s = (guest + off) / SECTOR;

        if (!r->ref || s >= r->ref->nsec) {
            break;
        }
        r->exp_alloc[s] = alloc;
        r->exp_crc[s] = data ? extree_crc32c(0, data + off, SECTOR)
                             : r->zero_crc;
    }
}

/* Allocate, fill and map [guest, +bytes); 0 or -errno */
static int do_write(FzRun *r, Extree *t, uint64_t guest, uint64_t bytes)
{
    while (bytes) {
        uint64_t host, got;
        int ret = extree_alloc_data(t, guest, bytes, &host, &got);

        if (ret < 0) {
            return ret;
        }
        if (got == 0 || got > bytes) {
            violation(r, "alloc_data(0x%" PRIx64 ", 0x%" PRIx64 ") got 0x%"
                      PRIx64, guest, bytes, got);
        }
        if (got > r->buf_len) {
            r->buf = g_realloc(r->buf, got);
            r->buf_len = got;
        }
        for (uint64_t i = 0; i < got; i += 8) {
            ext_st64(r->buf + i, fz_rand(r));
        }
        ret = r->be->ops->pwrite(r->be->opaque, host, r->buf, got);
        if (ret == 0) {
            ret = extree_map_data(t, guest, got, host);
        }
        if (ret < 0) {
            /* never mapped: give it back, or the checker sees a leak */
            extree_free_data(t, host, got);
            expect_set(r, guest, got, NULL, SEC_UNKNOWN);
            return ret;
        }
        expect_set(r, guest, got, r->buf, 1);
        guest += got;
        bytes -= got;
    }
    return 0;
}

static void snapshot(FzRun *r)
{
    if (r->ref) {
        memcpy(r->com_crc, r->exp_crc, r->ref->nsec * sizeof(uint32_t));
        memcpy(r->com_alloc, r->exp_alloc, r->ref->nsec);
    }
}

static void restore(FzRun *r)
{
    if (r->ref) {
        memcpy(r->exp_crc, r->com_crc, r->ref->nsec * sizeof(uint32_t));
        memcpy(r->exp_alloc, r->com_alloc, r->ref->nsec);
    }
}

/*
 * A few updates and a commit; returns the commit's result.  Without the
 * write oracle the expected state is dropped: the edits may have made the
 * allocator hand out space that is in use.
 */
static int updates(FzRun *r, Extree *t)
{
    uint64_t bs = extree_block_size(t);
    uint64_t nblocks = EXTREE_ROUND_UP(extree_virtual_size(t), bs) / bs;
    int nops = 1 + fz_below(r, 4);
    int ret;

    snapshot(r);
    for (int i = 0; i < nops && nblocks; i++) {
        uint64_t blk = fz_below(r, nblocks);
        uint64_t len = 1 + fz_below(r, 16);
        uint64_t guest, bytes;

        if (r->scope == SCOPE_EXTENT_NODE && fz_below(r, 2)) {
            blk = (fz_below(r, 2) ? r->lo : r->hi) / bs + fz_below(r, 5) - 2;
        }
        if (blk >= nblocks) {
            blk = nblocks - 1;
        }
        len = MIN(len, nblocks - blk);
        guest = blk * bs;
        bytes = len * bs;
        switch (fz_below(r, 8)) {
        case 0 ... 3:
            ret = do_write(r, t, guest, bytes);
            break;
        case 4:
        case 5:
            ret = extree_set_zero(t, guest, bytes);
            expect_set(r, guest, bytes, NULL, ret < 0 ? SEC_UNKNOWN : 1);
            break;
        case 6:
            ret = extree_punch(t, guest, bytes);
            expect_set(r, guest, bytes, NULL, ret < 0 ? SEC_UNKNOWN : 0);
            break;
        default:
            ret = extree_commit(t);
            if (ret == 0) {
                snapshot(r);
            }
            break;
        }
        if (ret < 0) {
            break;
        }
    }
    if (fz_below(r, 8) == 0) {
        extree_set_backing(t, fz_below(r, 2) ? "other.img" : NULL, NULL);
    }
    ret = extree_commit(t);
    if (ret == 0) {
        snapshot(r);
    }
    return ret;
}

/* ---- side paths on copies: repair, the corrupt bit ---- */

static void repair_copy(FzRun *r, ExtreeBackend *orig)
{
    ExtreeBackend *be = fz_backend_clone(orig);
    ExtreeCheckResult res;
    Extree *t;

    if (fz_open(be, false, true, &t) == 0) {
        unsigned fix = EXTREE_FIX_LEAKS | EXTREE_FIX_ERRORS;

        if (extree_check_fix(t, fix, &res, NULL, NULL) == 0 &&
            res.corruptions == res.repaired_corruptions) {
            extree_clear_corrupt(t);
        }
        extree_close(t);
        if (fz_open(be, true, false, &t) == 0) {
            extree_check(t, false, &res, NULL, NULL);
            extree_close(t);
        }
    }
    fz_backend_free(be);
}

static void mark_corrupt_copy(ExtreeBackend *orig)
{
    ExtreeBackend *be = fz_backend_clone(orig);
    Extree *t;

    extree_mark_corrupt_image(be);
    if (fz_open(be, true, false, &t) == 0) {
        extree_close(t);
    }
    fz_backend_free(be);
}

/* ---- the target ---- */

static void check_image(FzRun *r, Extree *t, bool must_be_clean)
{
    ExtreeCheckResult res;
    int ret = extree_check(t, false, &res, NULL, NULL);

    if (must_be_clean &&
        (ret < 0 || res.corruptions || res.leaks > r->ref->leaks)) {
        violation(r, "check of an image only the core wrote: ret %d, %"
                  PRIu64 " corruptions, %" PRIu64 " leaks", ret,
                  res.corruptions, res.leaks);
    }
}

/*
 * Superblock edits may make the reader fall back to the other slot, as it
 * must after a torn write: then the older state, read from the original
 * with the newest slot wiped, is the reference.  NULL if that has no
 * valid reference either.
 */
static const FzRef *pick_ref(FzRun *r, Extree *t, const uint8_t *orig,
                             size_t len)
{
    int slot = r->ref->im->slot;
    const uint8_t *newest = orig + slot * EXTREE_SB_SIZE;
    const uint8_t *other = orig + (!slot) * EXTREE_SB_SIZE;
    const FzRef *ref;
    uint8_t *alt;

    if (t->trees[EXTREE_TREE_EXTENT].root == ext_ld64(newest + 80)) {
        return r->ref;
    }
    if (len < EXTREE_SB_AREA || !fz_sb_ok(other) ||
        t->trees[EXTREE_TREE_EXTENT].root != ext_ld64(other + 80)) {
        return NULL;
    }
    alt = g_memdup2(orig, len);
    memset(alt + slot * EXTREE_SB_SIZE, 0, EXTREE_SB_SIZE);
    ref = ref_get(alt, len);
    g_free(alt);
    return ref;
}

static void expect_init(FzRun *r)
{
    static void *bufs[4];
    static size_t caps[4];
    uint8_t zero[SECTOR] = { 0 };
    size_t n;

    if (!r->ref) {
        r->scope = SCOPE_OTHER;
        r->write_oracle = false;
        return;
    }
    n = r->ref->nsec;
    r->zero_crc = extree_crc32c(0, zero, SECTOR);
    r->exp_crc = scratch(&bufs[0], &caps[0], n * sizeof(uint32_t));
    r->com_crc = scratch(&bufs[1], &caps[1], n * sizeof(uint32_t));
    r->exp_alloc = scratch(&bufs[2], &caps[2], n);
    r->com_alloc = scratch(&bufs[3], &caps[3], n);
    memcpy(r->exp_crc, r->ref->crc, n * sizeof(uint32_t));
    memcpy(r->exp_alloc, r->ref->alloc, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static void *img_buf, *orig_buf;
    static size_t img_cap, orig_cap;
    FzInput in;
    FzRun r = { .scope = SCOPE_OTHER };
    ExtreeBackend *be;
    Extree *t = NULL;
    uint8_t *img, *orig = NULL;
    bool ro = false;
    int ret;

    if (!fz_input_parse(data, size, &in)) {
        /* a damaged trailer: all of it is the image, without oracle */
        memset(&in, 0, sizeof(in));
        in.raw = data;
        in.raw_len = in.img_len = size;
    }
    img = scratch(&img_buf, &img_cap, MAX(in.img_len, 1));
    fz_input_expand(&in, img);
    if (!in.has_trailer) {
        /* a seed: its own reference */
        r.ref = ref_get(img, in.img_len);
        r.scope = SCOPE_NONE;
        r.reopen_oracle = r.write_oracle = true;
    } else {
        orig = scratch(&orig_buf, &orig_cap, MAX(in.img_len, 1));
        memcpy(orig, img, in.img_len);
        fz_input_undo(&in, orig);
        if (extree_crc32c(0, orig, in.img_len) == in.f.orig_crc) {
            r.ref = ref_get(orig, in.img_len);
        }
        if (r.ref) {
            classify(&r, &in, img, orig);
        }
    }
    r.rng = in.has_trailer ? in.f.ops_seed : extree_crc32c(0, data, size);

    be = r.be = backend_from(img, in.img_len);
    if (fz_below(&r, 8) == 0) {
        repair_copy(&r, be);
    }
    if (fz_below(&r, 32) == 0) {
        mark_corrupt_copy(be);
    }

    ret = fz_open(be, false, false, &t);
    if (ret < 0) {
        ro = true;
        ret = fz_open(be, true, false, &t);
    }
    if (ret == 0 && r.scope == SCOPE_SUPER) {
        r.ref = pick_ref(&r, t, orig, in.img_len);
    }
    expect_init(&r);
    if (ret < 0) {
        goto out;
    }
    reads(&r, t, "read", true);
    if (fz_below(&r, 4) == 0) {
        check_image(&r, t, false);
    }
    if (ro) {
        extree_close(t);
        goto out;
    }

    /* The core's own updates and commit */
    if (!r.write_oracle) {
        r.scope = SCOPE_OTHER;
    }
    ret = updates(&r, t);
    if (ret == 0) {
        reads(&r, t, "after commit", false);
    }
    extree_close(t);

    ret = fz_open(be, false, false, &t);
    if (ret < 0) {
        if (r.reopen_oracle) {
            r.phase = "reopen";
            violation(&r, "the image does not reopen after the core's "
                      "updates and commit: %s", g_strerror(-ret));
        }
        goto out;
    }
    /* what the last successful commit made durable */
    restore(&r);
    reads(&r, t, "after reopen", false);
    if (r.scope == SCOPE_NONE || fz_below(&r, 4) == 0) {
        check_image(&r, t, r.scope == SCOPE_NONE);
    }
    extree_close(t);

out:
    fz_backend_free(be);
    g_free(r.buf);
    return 0;
}
