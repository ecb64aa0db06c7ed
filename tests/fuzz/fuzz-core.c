/*
 * extree fuzzing: the target over the core, on an in-memory image
 *
 * Each input (fuzz-input.h) is opened read-write (read-only if that
 * fails), walked with cursor queries over the whole virtual size in both
 * coalescing modes, read through lookups forward, backward and at offsets
 * drawn from the input's seed, and checked.  Then a few writes, zeroes and
 * punches, a commit, a reopen and the same reads again.  Sometimes the
 * checker's repair and the corrupt bit are exercised on a copy.  With
 * snapshots, every snapshot is read (convert -l), a revert and a delete
 * run on copies, and the virtual size is grown on a copy.
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
 * Snapshots (issue 38): the reference also holds each snapshot's
 * contents as extree_snapshot_load_tmp() shows them, and the table's ids
 * and virtual sizes.  A node may be shared by several trees: an edit of
 * an extent-tree node lets off, in each tree that reaches it (the live
 * one, a snapshot's), the keys it reaches it by, nothing else.  Edits of
 * the snapshot table, like those of the superblock, may only make
 * things fail; an entry's root moved to another tree's root is not
 * judged.  Edits that can make a reference count lie (a node of the
 * reference count tree, its root, an entry's root) change no read, but
 * after writes, reverts and deletes they are judged like edits that may
 * mislead the allocator while FZ_REFS_MAY_LIE (issue 38 point 6) holds.
 * On the image as it came:
 *   - convert -l: every snapshot through load_tmp on a read-only handle,
 *     read over its own virtual size: each sector as the reference's
 *     snapshot, or the read fails; count, ids and names as the table's;
 *   - snapshot -a or -d of a random snapshot on a writable copy: where
 *     the allocator cannot be misled the image must reopen after success
 *     (after a failure it may fail to open instead) and read: after a
 *     revert to j, the live image as snapshot j; after a delete of j, j
 *     gone; after a failure, as before; every remaining snapshot as
 *     before;
 *   - the VM state of each snapshot (load_tmp, or the live one after a
 *     revert) as the reference's;
 *   - a grow of the virtual size (also after a revert) must map nothing
 *     past the old end: an item there must have been refused;
 * and after the target's writes and commit, every snapshot as before.
 * Known violations let pass by name: tolerated() below.
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
#define MAX_VM_STATE    (1 << 20)

/* Expected state of a sector */
#define SEC_UNKNOWN     0xff    /* after a failed update: anything goes */

/*
 * Issue 38 point 6, being decided: a count of the reference count tree
 * that lies (too low) may today make snapshot delete, revert or an
 * in-place write free or overwrite what a remaining root still uses.
 * While this is true, an edit that can make a count lie - a node of the
 * reference count tree, its root in the superblock, an entry's root in
 * the snapshot table (the tree it names is not the one the counts
 * describe) - is judged like an edit that may mislead the allocator:
 * reads before any update must still be right, but after the target's
 * updates, revert and delete only a clean failure or success without a
 * crash is asked.  False since the core verifies before it frees (a
 * drop checks the roots that stay, an in-place write the snapshots):
 * such edits are judged in full.
 */
#define FZ_REFS_MAY_LIE false

typedef struct FzRef FzRef;

struct FzRef {
    bool valid;
    uint64_t leaks;             /* the checker's, of the reference */
    uint64_t vsize;
    uint64_t nsec;
    uint32_t *crc;              /* crc32c of each sector's contents */
    uint8_t *alloc;             /* 1 if DATA or ZERO */
    FzImage *im;                /* live nodes, for locating edits */
    /*
     * Its snapshots: the table's count, the first FZ_MAX_SNAPS entries
     * and the contents of each as load_tmp reads it (NULL if larger than
     * MAX_REF_SECTORS)
     */
    unsigned nsnaps;
    ExtreeSnapshotInfo *sinfo;
    FzRef *snaps[FZ_MAX_SNAPS];
    /* a snapshot's: its VM state (vm_state_size bytes, up to 1 MiB) */
    bool vm_valid;
    uint64_t vm_len;
    uint32_t vm_crc;
};

typedef enum FzScope {
    SCOPE_NONE,                 /* the reference itself: no edits */
    SCOPE_EXTENT_NODE,
    SCOPE_FREE_NODE,
    SCOPE_SUPER,
    SCOPE_OTHER,                /* no read oracle */
    SCOPE_REFS_NODE,            /* reads strict; counts may lie */
    SCOPE_TABLE,                /* the snapshot table: reads strict */
} FzScope;

/*
 * How an edit constrains the reads of one tree (the live one, or a
 * snapshot's): a node shared by several trees has a key range in each
 */
typedef struct FzTreeScope {
    bool reached;               /* the edited node lies in this tree */
    uint64_t lo, hi;            /* ... under these keys */
    /*
     * Its root lost or gained items (the sum of their lengths changed),
     * which the entry's extent_bytes should tell (issue 38 point 2,
     * EXTREE_FUZZ_TOLERATE=snap-root)
     */
    bool root_edit;
    bool vsize_edit;            /* its entry's virtual size was edited */
    /*
     * Its entry's root now names the root of another tree (of as many
     * bytes, or not): indistinguishable from a real one, not judged
     */
    bool skip;
    bool root_moved;            /* its entry's root field was edited */
    /*
     * The edited node is its root: a revert to it must check the root as
     * an open checks the live one (EXTREE_FUZZ_TOLERATE=snap-root-valid)
     */
    bool root_node;
} FzTreeScope;

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
    /*
     * The tree being read is a snapshot's (or became the live one) whose
     * root was edited: FzTreeScope.root_edit
     */
    bool root_edit;
    bool root_node;             /* ... FzTreeScope.root_node */
    /*
     * snap_generation or an entry's generation edited: a shared node may
     * look unshared and be overwritten in place (issue 38 point 1,
     * EXTREE_FUZZ_TOLERATE=snap-gen)
     */
    bool snap_gen_edit;
    /* the edits may make a reference count lie (FZ_REFS_MAY_LIE) */
    bool refs_edit;
    /* snapshot table edits (SCOPE_TABLE) */
    bool table_edit;
    FzTreeScope live_ts, snap_ts[FZ_MAX_SNAPS];
    char phase_buf[80];
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
 * reported (EXTREE_FUZZ_TOLERATE=root-sum,separator,...); none by default.
 * Those of issue 38, open while the core is being fixed:
 *   snap-gen    point 1: snap_generation (or an entry's generation) edited
 *               so that a shared node looks unshared: after writes, the
 *               snapshots read what the live image wrote
 *   snap-root   point 2: a snapshot's root with fewer (more) items than
 *               its entry's extent_bytes says reads holes with success,
 *               and a revert to it leaves an image that does not open
 *   past-vsize  point 3: an item moved past the virtual size of its tree
 *               is accepted; grown, the image reads it
 *   snap-root-valid  (found with point 2's checks) a revert to a snapshot
 *               whose root node an open would refuse as the live root (a
 *               key past the parent range, a child generation above its
 *               own) succeeds, and the image then does not open
 * tests/fuzz/meson.build sets them for the corpus replay until the fixes
 * land (tests/fuzz/crashes/README).  @run may be NULL (no read).
 */
static int tol_root_sum = -1, tol_separator, tol_snap_gen, tol_snap_root,
           tol_past_vsize, tol_snap_root_valid;

static void tolerate_init(void)
{
    if (tol_root_sum < 0) {
        const char *env = g_getenv("EXTREE_FUZZ_TOLERATE");
        tol_root_sum = env && strstr(env, "root-sum");
        tol_separator = env && strstr(env, "separator");
        tol_snap_gen = env && strstr(env, "snap-gen");
        tol_snap_root = env && strstr(env, "snap-root,");
        tol_snap_root |= env && g_str_has_suffix(env, "snap-root");
        tol_snap_root_valid = env && strstr(env, "snap-root-valid");
        tol_past_vsize = env && strstr(env, "past-vsize");
    }
}

static bool tolerated(const FzRun *r, const ExtreeRun *run)
{
    tolerate_init();
    return (tol_root_sum && r->root_sum_changed) ||
           (tol_separator && r->keys_moved && run &&
            run->type == EXTREE_RUN_UNALLOC) ||
           (tol_snap_gen && r->snap_gen_edit) ||
           (tol_snap_root && r->root_edit) ||
           (tol_snap_root_valid && r->root_node && !run);
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

    if (err && g_getenv("EXTREE_FUZZ_EXPLAIN")) {
        fprintf(stderr, "open%s: %s\n", ro ? " read-only" : "", err);
    }
    g_free(err);
    return ret;
}

/* ---- the reference ---- */

static void ref_free(gpointer p)
{
    FzRef *ref = p;

    if (!ref) {
        return;
    }
    for (int i = 0; i < FZ_MAX_SNAPS; i++) {
        ref_free(ref->snaps[i]);
    }
    g_free(ref->sinfo);
    g_free(ref->crc);
    g_free(ref->alloc);
    g_free(ref->im);
    g_free(ref);
}

/*
 * The guest data of a COMPRESSED run's whole extent (run->ext_length
 * bytes, g_free()), or NULL if its payload does not decompress: the
 * driver fails such a read with -EIO, which is no violation
 */
static uint8_t *run_inflate(ExtreeBackend *be, const ExtreeRun *run)
{
    uint8_t *pay = g_malloc(run->payload_len);
    uint8_t *out = g_malloc(run->ext_length);

    if (be->ops->pread(be->opaque, run->host, pay, run->payload_len) < 0 ||
        extree_decompress(run->alg, pay, run->payload_len, out,
                          run->ext_length) < 0) {
        g_free(out);
        out = NULL;
    }
    g_free(pay);
    return out;
}

/*
 * Read every sector of what @t shows now (the live image, or the
 * snapshot load_tmp chose) into @ref; false if a query fails
 */
static bool ref_read(FzRef *ref, Extree *t, ExtreeBackend *be)
{
    ExtreeCursor c;
    uint8_t sec[SECTOR];
    uint64_t g = 0;

    ref->vsize = extree_virtual_size(t);
    ref->nsec = ref->vsize / SECTOR;
    ref->crc = g_new(uint32_t, MAX(ref->nsec, 1));
    ref->alloc = g_new(uint8_t, MAX(ref->nsec, 1));
    extree_cursor_init(&c, t);
    while (g < ref->vsize) {
        ExtreeRun run;

        uint8_t *inflated = NULL;

        if (extree_cursor_query(&c, g, ref->vsize - g, EXTREE_COALESCE_HOST,
                                &run) < 0) {
            break;
        }
        if (run.type == EXTREE_RUN_COMPRESSED) {
            inflated = run_inflate(be, &run);
        }
        for (uint64_t off = 0; off < run.length; off += SECTOR) {
            uint64_t s = (g + off) / SECTOR;

            if (s >= ref->nsec) {
                break;
            }
            memset(sec, 0, SECTOR);
            if (run.type == EXTREE_RUN_DATA &&
                be->ops->pread(be->opaque, run.host + off, sec, SECTOR) < 0) {
                break;
            }
            if (inflated) {
                memcpy(sec, inflated + (g - run.ext_guest) + off, SECTOR);
            }
            ref->crc[s] = extree_crc32c(0, sec, SECTOR);
            ref->alloc[s] = run.type != EXTREE_RUN_UNALLOC;
        }
        g_free(inflated);
        g += run.length;
    }
    extree_cursor_release(&c);
    return g == ref->vsize;
}

/*
 * crc32c of the first @len bytes of the VM state @t shows (the live
 * tree's, or the snapshot's that load_tmp chose), -1 if the read fails
 */
static int64_t vm_crc(Extree *t, uint64_t len)
{
    uint8_t *buf = g_malloc(MAX(len, 1));
    int ret = extree_vmstate_read(t, 0, buf, len);
    uint32_t crc = extree_crc32c(0, buf, len);

    g_free(buf);
    return ret < 0 ? -1 : (int64_t)crc;
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
    Extree *t;

    ref->im = g_new(FzImage, 1);
    if (!fz_image_parse(ref->im, img, len) ||
        fz_open(be, true, false, &t) < 0) {
        fz_backend_free(be);
        return ref;
    }
    if (extree_virtual_size(t) / SECTOR > MAX_REF_SECTORS ||
        extree_check(t, false, &res, NULL, NULL) < 0 || res.corruptions) {
        goto out;
    }
    ref->leaks = res.leaks;
    if (!ref_read(ref, t, be)) {
        goto out;
    }
    /* then each snapshot, as convert -l reads it */
    ref->nsnaps = extree_snapshot_count(t);
    ref->sinfo = g_new0(ExtreeSnapshotInfo, FZ_MAX_SNAPS);
    for (unsigned i = 0; i < MIN(ref->nsnaps, FZ_MAX_SNAPS); i++) {
        FzRef *sr;

        if (extree_snapshot_get(t, i, &ref->sinfo[i]) < 0 ||
            extree_snapshot_load_tmp(t, i) < 0) {
            goto out;
        }
        if (extree_virtual_size(t) / SECTOR > MAX_REF_SECTORS) {
            continue;
        }
        sr = ref->snaps[i] = g_new0(FzRef, 1);
        if (!ref_read(sr, t, be)) {
            goto out;
        }
        sr->valid = true;
        sr->vm_len = ref->sinfo[i].vm_state_size;
        if (sr->vm_len <= MAX_VM_STATE) {
            int64_t crc = vm_crc(t, sr->vm_len);

            sr->vm_valid = crc >= 0;
            sr->vm_crc = crc;
        }
    }
    ref->valid = true;
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

/*
 * Where the extent tree from @bytenr (keys [lo, hi)) of image @buf (the
 * reference's: im->buf may be gone) reaches @target: the union of the
 * key ranges of every path to it, in @ts
 */
static void reach(const FzImage *im, const uint8_t *buf, uint64_t bytenr,
                  uint64_t lo,
                  uint64_t hi, uint64_t target, int depth, FzTreeScope *ts,
                  int *budget)
{
    const uint8_t *b;
    uint32_t nr;

    if (bytenr == target) {
        ts->lo = ts->reached ? MIN(ts->lo, lo) : lo;
        ts->hi = ts->reached ? MAX(ts->hi, hi) : hi;
        ts->reached = true;
        return;
    }
    if (depth >= EXTREE_MAX_LEVELS || --*budget < 0 || bytenr > im->len ||
        im->len - bytenr < im->ns) {
        return;
    }
    b = buf + bytenr;
    if (ext_ld32(b + EXT_NH_MAGIC) != EXTREE_NODE_MAGIC ||
        ext_ld32(b + EXT_NH_OWNER) != EXTREE_TREE_EXTENT ||
        b[EXT_NH_LEVEL] == 0) {
        return;
    }
    nr = MIN(ext_ld32(b + EXT_NH_NRITEMS), EXTREE_INTERIOR_CAPACITY(im->ns));
    for (uint32_t k = 0; k < nr; k++) {
        const uint8_t *it = b + EXTREE_NODE_HEADER_SIZE + k * EXT_PTR_ISZ;

        reach(im, buf, ext_ld64(it + 8), ext_ld64(it),
              k + 1 < nr ? ext_ld64(it + EXT_PTR_ISZ) : hi, target,
              depth + 1, ts, budget);
    }
}

/*
 * An interior node at @bytenr with a child pointer changed to another
 * extent-tree node of the reference that this node did not point to:
 * with snapshots, that may be another tree's version of the same child
 * (same keys, same lengths, other data), which no reader can tell from
 * the real one
 */
static bool redirected(const FzImage *im, const uint8_t *img,
                       const uint8_t *orig, size_t len, uint64_t bytenr)
{
    const uint8_t *a = orig + bytenr, *b = img + bytenr;
    uint32_t na, nb;

    if (!im->nsnaps || bytenr > len || len - bytenr < im->ns ||
        !a[EXT_NH_LEVEL]) {
        return false;
    }
    na = MIN(ext_ld32(a + EXT_NH_NRITEMS), EXTREE_INTERIOR_CAPACITY(im->ns));
    nb = MIN(ext_ld32(b + EXT_NH_NRITEMS), EXTREE_INTERIOR_CAPACITY(im->ns));
    for (uint32_t i = 0; i < nb; i++) {
        uint64_t child = ext_ld64(b + EXTREE_NODE_HEADER_SIZE +
                                  (size_t)i * EXT_PTR_ISZ + 8);
        int n = fz_find_node(im, child);
        bool known = false;

        if (n < 0 || im->nodes[n].owner != EXTREE_TREE_EXTENT) {
            continue;
        }
        for (uint32_t k = 0; k < na && !known; k++) {
            known = child == ext_ld64(a + EXTREE_NODE_HEADER_SIZE +
                                      (size_t)k * EXT_PTR_ISZ + 8);
        }
        if (!known) {
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
    bool sb = false, sb_root = false, table = false;
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
            uint64_t s = rec->off % EXTREE_SB_SIZE, e = s + rec->len;

            sb = true;
            /* extent_root: bytenr, generation, level */
            sb_root |= s < 104 && e > 80;
            /* ref_root; snap_generation */
            r->refs_edit |= s < 184 && e > 160;
            r->snap_gen_edit |= s < 208 && e > 200;
            continue;
        }
        if (fz_in_snap_table(im, rec->off, rec->len)) {
            int j = fz_snap_entry_at(im, rec->off, rec->len);
            uint64_t s = j >= 0 ? rec->off - fz_snap_entry(im, j) : 0;
            uint64_t e = s + rec->len;

            table = true;
            if (j >= 0 && j < FZ_MAX_SNAPS) {
                /* another root: the counts no longer describe it */
                r->refs_edit |= s < 24;
                r->snap_ts[j].root_moved |= s < 24;
                r->snap_gen_edit |= s < 32 && e > 24;
                r->snap_ts[j].vsize_edit |= s < 40 && e > 32;
                /* extent_count, extent_bytes: point 2 from the other side */
                r->snap_ts[j].root_edit |= s < 56 && e > 40;
            }
            continue;
        }
        n = fz_node_at(im, rec->off, rec->len);
        if (node == -2 || n < 0 || (node >= 0 && n != node)) {
            node = -2;          /* not one node */
            continue;
        }
        node = n;
    }
    if (sb && node == -1 && !table) {
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
    } else if (table && node == -1 && !sb) {
        /*
         * Every read strict, the table may only make things fail; but an
         * entry whose root names another tree's root reads that tree
         */
        r->scope = SCOPE_TABLE;
        r->table_edit = true;
        for (int j = 0; j < MIN(im->nsnaps, FZ_MAX_SNAPS); j++) {
            uint64_t e = fz_snap_entry(im, j), root;

            if (!r->snap_ts[j].root_moved) {
                continue;
            }
            root = e + 8 <= in->img_len ? ext_ld64(img + e) : 0;
            r->snap_ts[j].skip = root == im->nodes[0].bytenr;
            for (int k = 0; k < im->nsnaps; k++) {
                r->snap_ts[j].skip |= root == im->snaps[k].root;
            }
            r->snap_ts[j].root_edit = !r->snap_ts[j].skip;
        }
    } else if (sb || table || node == -2) {
        r->scope = SCOPE_OTHER;
        r->reopen_oracle = r->write_oracle = false;
    } else if (node >= 0 && im->nodes[node].owner == EXTREE_TREE_EXTENT) {
        const FzNode *nd = &im->nodes[node];
        bool sum_changed = node_sum(orig, in->img_len, nd->bytenr, im->ns) !=
                           node_sum(img, in->img_len, nd->bytenr, im->ns);
        int budget = 64 * 1024;

        /*
         * A changed leaf item may name space in use elsewhere (no reader
         * can know), which the writer then frees and reuses.  The node
         * may be shared: each tree that reaches it is let off under the
         * keys it reaches it by, no other
         */
        r->scope = SCOPE_EXTENT_NODE;
        reach(im, orig, im->nodes[0].bytenr, 0, UINT64_MAX, nd->bytenr, 0,
              &r->live_ts, &budget);
        for (int j = 0; j < im->nsnaps; j++) {
            reach(im, orig, im->snaps[j].root, 0, UINT64_MAX, nd->bytenr, 0,
                  &r->snap_ts[j], &budget);
            r->snap_ts[j].root_node = nd->bytenr == im->snaps[j].root;
            r->snap_ts[j].root_edit = r->snap_ts[j].root_node && sum_changed;
        }
        r->lo = r->live_ts.reached ? r->live_ts.lo : 0;
        r->hi = r->live_ts.reached ? r->live_ts.hi : 0;
        r->inside_strict = nd->level > 0;
        r->reopen_oracle = r->write_oracle = nd->level > 0;
        if (redirected(im, img, orig, in->img_len, nd->bytenr)) {
            /*
             * Under the node, judged like a leaf; and the count of the
             * new child lies (one more parent than it says)
             */
            r->inside_strict = false;
            r->refs_edit = true;
        }
        r->root_sum_changed = node == 0 && sum_changed;
        r->keys_moved = keys_moved(img, orig, in->img_len, nd->bytenr,
                                   im->ns);
    } else if (node >= 0 && im->nodes[node].owner == EXTREE_TREE_REFS) {
        /* reads do not use the counts; snapshot ops and writes do */
        r->scope = SCOPE_REFS_NODE;
        r->refs_edit = true;
    } else if (node >= 0) {
        /* reads do not use the free-space tree; the allocator trusts it */
        r->scope = SCOPE_FREE_NODE;
        r->reopen_oracle = r->write_oracle = false;
    }
    if (FZ_REFS_MAY_LIE && r->refs_edit) {
        r->reopen_oracle = r->write_oracle = false;
    }
    if (g_getenv("EXTREE_FUZZ_EXPLAIN")) {
        /* what the oracle makes of the edits, to read a violation by */
        for (uint32_t i = 0; i < in->f.nrec; i++) {
            int n = fz_node_at(im, in->rec[i].off, in->rec[i].len);

            fprintf(stderr, "edit [0x%" PRIx64 ", +%u)", in->rec[i].off,
                    in->rec[i].len);
            if (n >= 0) {
                fprintf(stderr, " node 0x%" PRIx64 " +0x%" PRIx64
                        " owner %u level %u", im->nodes[n].bytenr,
                        in->rec[i].off - im->nodes[n].bytenr,
                        im->nodes[n].owner, im->nodes[n].level);
            }
            fprintf(stderr, "\n");
        }
        fprintf(stderr, "scope %d, live [0x%" PRIx64 ", 0x%" PRIx64 ") "
                "strict %d, oracles reopen %d write %d, refs %d, snap_gen "
                "%d, table %d\n", r->scope, r->lo, r->hi, r->inside_strict,
                r->reopen_oracle, r->write_oracle, r->refs_edit,
                r->snap_gen_edit, r->table_edit);
        for (int j = 0; j < im->nsnaps; j++) {
            const FzTreeScope *ts = &r->snap_ts[j];

            fprintf(stderr, "snapshot %d root 0x%" PRIx64 ": reached %d "
                    "[0x%" PRIx64 ", 0x%" PRIx64 "), root_edit %d, skip %d"
                    "\n", j, im->snaps[j].root, ts->reached, ts->lo, ts->hi,
                    ts->root_edit, ts->skip);
        }
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
    g_autofree uint8_t *inflated = NULL;

    check_status(r, run);
    if (r->ref && run->type == EXTREE_RUN_COMPRESSED) {
        inflated = run_inflate(r->be, run);
        if (!inflated) {
            /* a damaged payload: the read fails, as it must */
            return;
        }
    }
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
        } else if (inflated) {
            crc = extree_crc32c(0, inflated + (run->guest - run->ext_guest) +
                                off, SECTOR);
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

/* ---- snapshots: convert -l, snapshot -a, snapshot -d ---- */

/*
 * @sub: @r judging reads of a tree whose reference is @ref (NULL: none,
 * nothing judged) and whose scope is @ts; its phase named by @fmt
 */
static void G_GNUC_PRINTF(5, 6)
tree_run(FzRun *sub, const FzRun *r, const FzRef *ref, const FzTreeScope *ts,
         const char *fmt, ...)
{
    va_list ap;

    *sub = *r;
    sub->root_edit = ts && ts->root_edit;
    sub->root_node = ts && ts->root_node;
    if (!ref || !ts || ts->skip || !r->ref || r->scope == SCOPE_OTHER) {
        sub->ref = NULL;
        sub->scope = SCOPE_OTHER;
    } else {
        sub->ref = ref;
        sub->exp_crc = ref->crc;
        sub->exp_alloc = ref->alloc;
        if (r->scope == SCOPE_EXTENT_NODE) {
            sub->lo = ts->reached ? ts->lo : 0;
            sub->hi = ts->reached ? ts->hi : 0;
        }
    }
    va_start(ap, fmt);
    vsnprintf(sub->phase_buf, sizeof(sub->phase_buf), fmt, ap);
    va_end(ap);
    sub->phase = sub->phase_buf;
}

/*
 * Reads of @t as @sub judges them, and of its VM state (which lies in
 * the extent tree from EXTREE_VMSTATE_BASE: let off under an edited leaf
 * whose keys reach there, or after edits of the table, which holds its
 * size); @r's generator goes on
 */
static void tree_reads(FzRun *r, FzRun *sub, Extree *t)
{
    const FzRef *ref = sub->ref;

    reads(sub, t, sub->phase_buf, false);
    r->rng = sub->rng;
    if (ref && ref->vm_valid && !sub->table_edit &&
        (sub->scope != SCOPE_EXTENT_NODE || sub->inside_strict ||
         sub->hi <= EXTREE_VMSTATE_BASE)) {
        int64_t crc = vm_crc(t, ref->vm_len);

        if (crc >= 0 && crc != ref->vm_crc && !tolerated(sub, NULL)) {
            violation(sub, "VM state (0x%" PRIx64 " bytes) reads wrong "
                      "data with success", ref->vm_len);
        }
    }
}

/*
 * Every snapshot of @be through a read-only handle (qemu-img convert -l:
 * load_tmp, then reads over its own virtual size), and first the live
 * image if @live_ref: each sector reads the reference's or the read
 * fails (if @judge).  @removed: the reference's snapshot that was
 * deleted, -1 none.
 * False if the image does not open.
 */
static bool check_snaps(FzRun *r, ExtreeBackend *be, const char *what,
                        int removed, bool judge, const FzRef *live_ref,
                        const FzTreeScope *live_ts)
{
    bool judged = judge && r->ref && r->scope != SCOPE_OTHER;
    unsigned n, want = 0;
    FzRun sub;
    Extree *t;

    if (fz_open(be, true, false, &t) < 0) {
        return false;
    }
    if (live_ref) {
        tree_run(&sub, r, live_ref, live_ts, "%s: live", what);
        tree_reads(r, &sub, t);
    }
    n = extree_snapshot_count(t);
    if (judged) {
        want = r->ref->nsnaps - (removed >= 0);
        r->phase = what;
        if (n != want) {
            violation(r, "%u snapshots, expect %u", n, want);
        }
    }
    for (unsigned k = 0; k < MIN(n, 2 * FZ_MAX_SNAPS); k++) {
        unsigned ri = removed >= 0 && k >= (unsigned)removed ? k + 1 : k;
        const FzRef *sr = judged && ri < FZ_MAX_SNAPS ? r->ref->snaps[ri]
                                                      : NULL;
        ExtreeSnapshotInfo info;

        if (extree_snapshot_get(t, k, &info) < 0 ||
            extree_snapshot_load_tmp(t, k) < 0) {
            continue;
        }
        tree_run(&sub, r, sr, ri < FZ_MAX_SNAPS ? &r->snap_ts[ri] : NULL,
                 "%s: snapshot %u (id %s)", what, k, info.id);
        if (sub.ref && !r->table_edit &&
            (strcmp(info.id, r->ref->sinfo[ri].id) ||
             strcmp(info.name, r->ref->sinfo[ri].name))) {
            violation(&sub, "id %s name %s, expect %s and %s", info.id,
                      info.name, r->ref->sinfo[ri].id,
                      r->ref->sinfo[ri].name);
        }
        if (sub.ref && !r->snap_ts[ri].vsize_edit &&
            extree_virtual_size(t) != sr->vsize && !tolerated(&sub, NULL)) {
            violation(&sub, "virtual size 0x%" PRIx64 ", expect 0x%" PRIx64,
                      extree_virtual_size(t), sr->vsize);
        }
        tree_reads(r, &sub, t);
    }
    extree_close(t);
    return true;
}

/*
 * Grow the virtual size of writable handle @t (not committed): what was
 * never written, past the old end, must not map (an item moved past the
 * virtual size must be refused, issue 38 point 3)
 */
static void grow_check(FzRun *r, Extree *t, const char *what)
{
    uint64_t bs = extree_block_size(t);
    uint64_t end = EXTREE_ROUND_UP(extree_virtual_size(t), bs);
    /* a few blocks, or to twice the size */
    uint64_t add = bs * (1 + fz_below(r, 64)) + (fz_below(r, 2) ? end : 0);
    ExtreeRun runs[8];
    int n = 0;

    tolerate_init();
    if (end + add > EXTREE_SNAP_MAX_VIRTUAL_SIZE ||
        extree_set_virtual_size(t, end + add) < 0 ||
        extree_lookup(t, end, add, runs, G_N_ELEMENTS(runs), &n) < 0) {
        return;
    }
    r->phase = what;
    for (int i = 0; i < n; i++) {
        if (runs[i].type != EXTREE_RUN_UNALLOC && !tol_past_vsize) {
            violation(r, "grown from 0x%" PRIx64 " by 0x%" PRIx64 ": [0x%"
                      PRIx64 ", +0x%" PRIx64 ") maps type %d host 0x%"
                      PRIx64, end, add, runs[i].guest, runs[i].length,
                      runs[i].type, runs[i].host);
        }
    }
}

/* The grow check on a writable copy of the image as it came */
static void grow_copy(FzRun *r, ExtreeBackend *orig)
{
    ExtreeBackend *be = fz_backend_clone(orig);
    Extree *t;

    if (fz_open(be, false, false, &t) == 0) {
        if (r->ref && r->scope != SCOPE_OTHER) {
            grow_check(r, t, "grow");
        }
        extree_close(t);
    }
    fz_backend_free(be);
}

/*
 * qemu-img snapshot -a (@del false) or -d of a random snapshot on a
 * writable copy of the image as it came, which then must reopen (or, if
 * the operation failed, may fail to open with an error) and read: after
 * a revert to snapshot j, the live image as j and every snapshot as
 * before; after a delete, j gone and the rest as before; after a failure,
 * everything as before.  Judged when the edits cannot mislead the
 * allocator (nor make a count lie, FZ_REFS_MAY_LIE); else only run.
 */
static void snap_op(FzRun *r, ExtreeBackend *orig, bool del)
{
    ExtreeBackend *be = fz_backend_clone(orig);
    bool oracle = r->ref && r->scope != SCOPE_OTHER && r->write_oracle;
    const FzRef *live_ref = oracle ? r->ref : NULL;
    const FzTreeScope *live_ts = &r->live_ts;
    char what[48];
    unsigned n, j;
    FzRun sub;
    Extree *t;
    int ret;

    if (fz_open(be, false, false, &t) < 0) {
        goto out;
    }
    n = extree_snapshot_count(t);
    if (n == 0) {
        extree_close(t);
        goto out;
    }
    j = fz_below(r, n);
    ret = del ? extree_snapshot_delete(t, j) : extree_snapshot_goto(t, j);
    extree_close(t);
    snprintf(what, sizeof(what), "snapshot %s %u %s", del ? "delete" : "goto",
             j, ret < 0 ? "(failed)" : "");
    if (ret == 0 && !del) {
        live_ref = oracle && j < FZ_MAX_SNAPS ? r->ref->snaps[j] : NULL;
        live_ts = j < FZ_MAX_SNAPS ? &r->snap_ts[j] : NULL;
    }
    tree_run(&sub, r, live_ref, live_ts, "%s: reopen", what);
    if (fz_open(be, false, false, &t) < 0) {
        if (ret == 0 && oracle && !tolerated(&sub, NULL)) {
            violation(&sub, "succeeded, then the image does not open");
        }
        goto out;
    }
    /*
     * Never written past its end, whatever space the edits made the
     * operation free: a check of the mapping only
     */
    if (r->ref && r->scope != SCOPE_OTHER && ret == 0) {
        grow_check(&sub, t, sub.phase_buf);
        r->rng = sub.rng;
    }
    extree_close(t);
    if (!check_snaps(r, be, what, del && ret == 0 ? (int)j : -1, oracle,
                     live_ref, live_ts) && oracle) {
        violation(&sub, "opens read-write but not read-only");
    }
out:
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
 * Encryption bit: nothing the core did through a writable handle touched
 * [8192, @data_start), where the encryption header lies, whatever the
 * image: every node, extent and free range it may use lies at data_start
 * or above.  @img is what the backend held before.
 */
static void check_crypt_header(FzRun *r, const uint8_t *img, size_t len,
                               uint64_t data_start)
{
    uint64_t n = data_start - EXTREE_SB_AREA;
    uint8_t *buf = g_malloc(n);

    if (r->be->ops->pread(r->be->opaque, EXTREE_SB_AREA, buf, n) < 0) {
        g_free(buf);
        return;
    }
    for (uint64_t i = 0; i < n; i++) {
        uint64_t off = EXTREE_SB_AREA + i;
        uint8_t want = off < len ? img[off] : 0;

        if (buf[i] != want) {
            r->phase = "encryption header";
            violation(r, "the core changed byte 0x%" PRIx64 " of the "
                      "encryption header [0x2000, 0x%" PRIx64 ")", off,
                      data_start);
        }
    }
    g_free(buf);
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
    ExtreeBackend *be, *snap_be = NULL;
    Extree *t = NULL;
    uint8_t *img, *orig = NULL;
    uint64_t crypt_end = 0;
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
    /* the image as it came, for the snapshot operations */
    if (in.img_len >= EXTREE_SB_AREA &&
        ((ext_ld64(img + 32) | ext_ld64(img + EXTREE_SB_SIZE + 32)) &
         EXTREE_INCOMPAT_SNAPSHOTS)) {
        snap_be = fz_backend_clone(be);
    }
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
    if (snap_be) {
        /* every snapshot reads as it did (convert -l) */
        check_snaps(&r, snap_be, "load_tmp", -1, true, NULL, NULL);
        /* one of revert and delete: each costs a copy and a reopen */
        snap_op(&r, snap_be, fz_below(&r, 2));
    }
    if (snap_be || fz_below(&r, 4) == 0) {
        grow_copy(&r, snap_be ? snap_be : be);
    }
    if (ro) {
        extree_close(t);
        goto out;
    }

    /* The core's own updates and commit */
    if (!r.write_oracle) {
        r.scope = SCOPE_OTHER;
    }
    if (extree_crypt_method(t)) {
        crypt_end = extree_data_start(t);
    }
    ret = updates(&r, t);
    if (ret == 0) {
        reads(&r, t, "after commit", false);
    }
    extree_close(t);
    if (crypt_end) {
        check_crypt_header(&r, img, in.img_len, crypt_end);
    }

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
    if (snap_be && (r.write_oracle || fz_below(&r, 4) == 0)) {
        /* the live image's writes left every snapshot alone */
        check_snaps(&r, be, "after updates", -1, r.write_oracle, NULL, NULL);
    }

out:
    if (snap_be) {
        fz_backend_free(snap_be);
    }
    fz_backend_free(be);
    g_free(r.buf);
    return 0;
}
