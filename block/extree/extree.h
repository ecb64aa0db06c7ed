/*
 * extree core: in-memory types and public API
 *
 * extree maps guest ranges to host extents with a copy-on-write B+tree
 * (include/block/extree-format.h).  This header is all the QEMU driver and
 * the tools see; the layers below talk through block/extree/extree-int.h.
 *
 * Layers, each calling only the ones below it (docs/devel/extree.rst):
 *   check     the checker behind qemu-img check          (extree-check.c)
 *   txn       superblocks, create/open/commit            (extree-txn.c)
 *   extent    guest ranges, placement, cursor            (extree-extent.c)
 *   freetree  the free-space tree: load, sync, rebuild   (extree-freetree.c)
 *   btree     B+tree of range items over a space map     (extree-btree.c)
 *   alloc     free space in memory, the space map        (extree-alloc.c)
 *   node      cache, read + validate once, write         (extree-node.c)
 *   backend   pread/pwrite/flush, supplied by the caller
 *
 * Locking: the core is not thread-safe: the caller serializes all calls
 * (QEMU: s->lock, a CoMutex); backend calls may yield.  Nodes are pinned
 * (reference counted) across backend calls, so no raw pointer into an
 * unpinned cache entry is kept across a call that may yield.
 *
 * All functions return 0 or -errno unless stated otherwise.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef BLOCK_EXTREE_H
#define BLOCK_EXTREE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "block/extree-format.h"

/* ---- Backend: the only way the core does I/O ---- */

typedef struct ExtreeBackendOps {
    int (*pread)(void *opaque, uint64_t offset, void *buf, uint64_t bytes);
    int (*pwrite)(void *opaque, uint64_t offset, const void *buf,
                  uint64_t bytes);
    int (*flush)(void *opaque);
    int (*truncate)(void *opaque, uint64_t size);      /* may be NULL */
    int (*discard)(void *opaque, uint64_t offset,
                   uint64_t bytes);                    /* may be NULL */
    int64_t (*get_length)(void *opaque);
    /*
     * Read @n ranges of @bytes each, concurrently if the backend can:
     * @rets[i] = 0 or -errno for @offsets[i] into @bufs[i].  Used for
     * readahead of the leaves a forward walk is about to visit, so a
     * failure only costs the read again later.  May be NULL: no readahead.
     */
    void (*pread_many)(void *opaque, int n, const uint64_t *offsets,
                       void *const *bufs, uint64_t bytes, int *rets);
} ExtreeBackendOps;

typedef struct ExtreeBackend {
    const ExtreeBackendOps *ops;
    void *opaque;
} ExtreeBackend;

/* ---- Transactions: create, open, commit ---- */

typedef struct Extree Extree;                   /* opaque */

typedef struct ExtreeCreateParams {
    uint64_t virtual_size;                      /* multiple of 512 */
    uint32_t block_size, node_size;             /* 0 = default */
    const char *backing_file, *backing_fmt;     /* may be NULL */
    /*
     * Encryption: the image gets EXTREE_INCOMPAT_ENCRYPTED and keeps
     * [8192, 8192 + crypt_header_length) for the encryption header, which
     * the caller writes (before or after extree_create(), which never
     * touches that range).  The data area starts at the next block
     * boundary.  The core encrypts nothing: that is the caller's.
     */
    uint32_t crypt_method;          /* 0 or EXTREE_CRYPT_LUKS */
    uint64_t crypt_header_length;   /* bytes at 8192, with crypt_method */
    /*
     * EXTREE_COMPRESS_*: the algorithm the caller compresses extents with
     * (extree_map_compressed()); recorded, never used by the core
     */
    uint32_t compression_type;
} ExtreeCreateParams;

/* What a call that failed with -EIO found (ExtreeOpenOptions.damage) */
typedef enum ExtreeDamage {
    EXTREE_DAMAGE_NONE,
    EXTREE_DAMAGE_CORRUPT,      /* a structure is damaged */
    EXTREE_DAMAGE_TRUNCATED,    /* the file ends before a structure does */
} ExtreeDamage;

typedef struct ExtreeOpenOptions {
    bool read_only;
    uint64_t cache_size;        /* bytes of node cache, 0 = 32 MiB */
    /*
     * dirty metadata bytes before a commit is wanted, 0 = 16 MiB: an
     * update that leaves more commits (a forced commit) unless
     * @commit_by_caller
     */
    uint64_t dirty_limit;
    /*
     * Updates never commit: the caller asks extree_commit_wanted() at a
     * safe point of its own and commits then (the QEMU driver, whose
     * commit waits for in-flight requests)
     */
    bool commit_by_caller;
    /*
     * For the checker (qemu-img check -r): open read-write even if the
     * image is marked corrupt or its free-space tree is damaged.  Updates
     * stay refused (-EIO) while the corrupt bit is set or the free space is
     * unknown; extree_check(repair_leaks) repairs and commits, then
     * extree_clear_corrupt() may clear the bit.  Ignored with read_only.
     */
    bool repair;
    /*
     * For the checker (qemu-img check, with or without -r): an extent
     * tree root whose items disagree with the superblock's extent_bytes
     * does not fail the open; extree_check() reports it.  Other opens
     * fail then: what the root lost cannot be told from a hole.
     */
    bool check;
    /*
     * The most memory one persistent bitmap's bits may take, 0 =
     * EXTREE_BITMAP_MAX_BYTES (512 MiB, as qcow2): a larger bitmap is
     * refused at open (left out with @check), when added and on growth
     */
    uint64_t bitmap_max_bytes;
    /*
     * Out, optional: when the open fails with -EIO, whether the image is
     * damaged (EXTREE_DAMAGE_CORRUPT: the caller may mark it corrupt, as
     * qcow2 does) or merely cut short (EXTREE_DAMAGE_TRUNCATED); else
     * EXTREE_DAMAGE_NONE
     */
    ExtreeDamage *damage;
    /*
     * Never add a mark log (spec: Mark log; extree_mark_log_append()); one
     * the image has is used (for comparisons: without one the writes a
     * log lets go in place move to new space instead)
     */
    bool no_mark_log;
} ExtreeOpenOptions;

#define EXTREE_DEFAULT_CACHE_SIZE   (32 * 1024 * 1024)
#define EXTREE_DEFAULT_DIRTY_LIMIT  (16 * 1024 * 1024)

typedef void ExtreeCorruptFn(void *opaque, uint64_t offset, const char *msg);

/* Damage found by the core and not yet reported (extree_take_corruption()) */
typedef struct ExtreeCorruption {
    uint64_t offset;    /* host offset of the damaged structure */
    char *msg;          /* "corrupt <structure> at offset 0x..: <reason>" */
    bool fatal;         /* the caller should mark the image corrupt */
} ExtreeCorruption;

/*
 * Everything that can be wrong with @p, checked before anything is
 * written: -EINVAL with the message in *@errmsg (g_malloc'd), as a user
 * should see it.
 */
int extree_create_check(const ExtreeCreateParams *p, char **errmsg);

/*
 * extree_create_check() @p, write an empty extent tree and free tree and
 * both superblock slots (generation 1), flush.  Writes nothing below 8192
 * but the superblocks, and nothing in the encryption header's range.
 */
int extree_create(ExtreeBackend *be, const ExtreeCreateParams *p,
                  char **errmsg);

/*
 * Pick the valid superblock with the highest generation (a torn newer slot
 * falls back to the older one), validate every field, read the extent
 * tree's root node and, read-write only, load the free-space tree: O(free
 * items); the extent tree is not walked.  A read-only handle never reads
 * the free-space tree, so damage there does not prevent reading (or
 * checking) the image.  When open fails after skipping an invalid slot,
 * *@errmsg names that slot first ("corrupt superblock at offset 0x..: ..;
 * slot skipped, ...; then: <error>").
 * Unknown incompat bits: -ENOTSUP.  CORRUPT bit: -EACCES unless read-only
 * or @o->repair.  Damaged free-space tree, read-write without @o->repair:
 * -EIO (extree_mark_corrupt_image() can then flag the image).
 */
int extree_open(ExtreeBackend *be, const ExtreeOpenOptions *o, Extree **out,
                char **errmsg);

/*
 * Set when extree_open() skipped a superblock slot whose checksum was
 * right but whose fields were not (a crash does not do that, so the
 * newest commit may be lost, and the next commit overwrites that slot):
 * "corrupt superblock at offset 0x..: <reason>; slot skipped ...".
 * NULL otherwise.  Valid until extree_close().
 */
const char *extree_open_warning(const Extree *t);

/*
 * Mark an image corrupt without opening it: write the newest valid
 * superblock again, one generation later, with INCOMPAT_CORRUPT set.
 * Reads only the two superblock slots, so it works when extree_open()
 * fails on damaged trees.  0 if the bit was already set; -ENOTSUP for
 * unknown incompatible features; -EEXIST (nothing written) if that would
 * overwrite a slot with a valid checksum, bad fields and a higher
 * generation (extree_open_warning()).  Flushes.
 */
int extree_mark_corrupt_image(ExtreeBackend *be);

/* Free all memory.  Does NOT commit: uncommitted changes are lost. */
void extree_close(Extree *t);

/*
 * Make every change since the last commit durable: sync the free tree,
 * write dirty nodes, flush, write the other superblock slot, flush.
 * No-op if nothing is dirty.  O(dirty nodes + allocations since commit).
 *
 * Then give space back to the host file (best effort, errors ignored):
 *   - ops->discard the DATA the commit freed (overwritten, zeroed, punched,
 *     returned by extree_free_data) and leaks the checker repaired;
 *   - ops->discard node space (copied-on-write, merged nodes) the previous
 *     commit freed and nothing has reused since, in runs of 256 KiB or
 *     more: metadata churn is mostly recycled within a commit or two, and
 *     a discard would only leave a hole for the host to fill again;
 *   - when commit lowered host_end, ops->truncate the file to it.  Commit
 *     lowers host_end when the space at the end of the file is free in the
 *     last durable state as well and at least 1 MiB long; space freed by
 *     the transaction itself is cut by the next commit.
 * The caller must not access freed host space after a commit (the QEMU
 * driver's commit gate).
 */
int extree_commit(Extree *t);
bool extree_is_dirty(const Extree *t);
/*
 * A failed update left memory ahead of the last commit: nothing more is
 * committed; reopen, or extree_rollback() if extree_can_roll_back(), to go
 * on (the failure was returned when it happened)
 */
bool extree_is_broken(const Extree *t);

/*
 * A rollback dropped the changes of a transaction since this handle was
 * opened: writes the caller acknowledged may be gone.  Sticky, as a
 * failed fsync is: every later flush of the caller must fail (-EIO) until
 * the image is opened again, so that nobody takes a later flush as
 * saying those writes are durable.  O(1).
 */
bool extree_changes_lost(const Extree *t);
/*
 * Commit, as the driver and the plugin do it: if the commit (or an update
 * before it) ran out of space and broke the handle, the running
 * transaction is dropped (extree_rollback(); the loss is sticky, see
 * extree_changes_lost()) and -ENOSPC returned.  *@rollback: 0 if none was
 * needed, 1 if the handle is at its last commit again (the caller's
 * lookups are stale), or the rollback's error (the handle stays broken:
 * reopen).  The caller must hold no host range of the transaction.
 */
int extree_commit_or_roll_back(Extree *t, int *rollback);

/*
 * May the handle drop its running transaction (extree_rollback())?  A
 * writable handle that is healthy or broken only because host space ran
 * out (-ENOSPC in an update or a commit); not after a failed flush or a
 * corruption, which need a reopen.  O(1).
 */
bool extree_can_roll_back(const Extree *t);

/*
 * Drop the running transaction: the handle is at its last commit again,
 * as after a reopen (the options, the corruption handler and the limit of
 * extree_set_host_limit() stay).  Space the transaction allocated is free
 * again: the caller must hold no host range it allocated, looked up or
 * was told of since the last commit (the QEMU driver calls it within its
 * commit gate).  Cursors may stay, and look up afresh.  -EIO if
 * !extree_can_roll_back(), or the error of reading the committed state
 * (then the handle is broken).  O(cached nodes) plus an open's reads.
 */
int extree_rollback(Extree *t);

/*
 * Before a close with nothing dirty: the node space the last commit freed
 * would wait for a next commit that will not come; discard what of it is
 * still free, in runs of 256 KiB or more (a snapshot delete frees the
 * dropped tree's nodes this way).  Best effort, like commit's discards.
 */
void extree_discard_deferred(Extree *t);

/*
 * Commit soon: more dirty metadata than ExtreeOpenOptions.dirty_limit, or,
 * on a backend of fixed size (extree_set_host_limit()), too little room
 * left for the nodes of the next update and commit while space this
 * transaction freed waits for the commit
 */
bool extree_commit_wanted(const Extree *t);

/*
 * @fn is called once per detected corruption with the host offset of the
 * damaged structure and "corrupt <structure> at offset 0x..: <reason>";
 * the failing call returns -EIO.  Without a handler the message is only
 * recorded (extree_last_error).
 */
void extree_set_corrupt_handler(Extree *t, ExtreeCorruptFn *fn, void *opaque);
const char *extree_last_error(const Extree *t);

/*
 * The first damage found since the last extree_take_corruption(), kept by
 * the core for every caller (the QEMU driver, the plugin): the call that
 * found it failed with -EIO, and the caller reports it once that call has
 * returned, since marking the image corrupt writes a superblock.
 * extree_take_corruption() hands it over (the caller g_free()s c->msg);
 * c->fatal says whether to mark the image corrupt (extree_mark_corrupt()):
 * the caller may write (@writable) and the image is not marked yet.  False
 * if nothing is pending.  extree_drop_corruption() forgets it (a checker,
 * which reports damage itself).
 */
bool extree_corruption_pending(const Extree *t);
bool extree_take_corruption(Extree *t, bool writable, ExtreeCorruption *c);
void extree_drop_corruption(Extree *t);

/*
 * Trace points of the core, for the caller's tracing (the QEMU driver's
 * trace events, the plugin's debug flag); @a, @b and @c per event
 */
typedef enum ExtreeTraceEvent {
    EXTREE_TRACE_ALLOC_DATA,    /* guest, bytes, host */
    EXTREE_TRACE_ALLOC_NODE,    /* host, -, - */
    EXTREE_TRACE_FREE,          /* host, bytes, 1 if node space */
    EXTREE_TRACE_COMMIT_STEP,   /* generation written, step (2..8), - */
    EXTREE_TRACE_COMMIT_DONE,   /* generation written, -, -errno or 0 */
    EXTREE_TRACE_BITMAP_SYNC,   /* bitmap index, bits set, 1 if changed */
    EXTREE_TRACE_ROLLBACK,      /* generation rolled back to, -, -errno or 0 */
    EXTREE_TRACE_MARK_LOG,      /* generation, record's slot, ranges */
} ExtreeTraceEvent;
typedef void ExtreeTraceFn(void *opaque, ExtreeTraceEvent ev, uint64_t a,
                           uint64_t b, uint64_t c);
/* @fn is called at every trace point (NULL: none, the default) */
void extree_set_trace(Extree *t, ExtreeTraceFn *fn, void *opaque);

/*
 * Write a new superblock generation with INCOMPAT_CORRUPT set (committed
 * trees, uncommitted changes dropped); later updates fail with -EIO.
 */
int extree_mark_corrupt(Extree *t);

/*
 * Clear INCOMPAT_CORRUPT in a new superblock generation.  Only on a
 * writable handle (ExtreeOpenOptions.repair) right after an extree_check()
 * of the current generation that left no corruption unrepaired (leaks do
 * not count); -EINVAL otherwise.  0 if the bit is not set.
 */
int extree_clear_corrupt(Extree *t);

/* Read-only accessors, O(1) */
uint64_t extree_virtual_size(const Extree *t);
uint32_t extree_block_size(const Extree *t);
uint32_t extree_node_size(const Extree *t);
uint64_t extree_generation(const Extree *t);        /* last committed */
uint64_t extree_extent_count(const Extree *t);
unsigned extree_depth(const Extree *t);             /* levels, >= 1 */
/* read-only: the superblock's */
uint64_t extree_free_bytes(const Extree *t);
uint64_t extree_host_end(const Extree *t);
/* ROUND_UP(8192 + extree_crypt_header_length(), bs) */
uint64_t extree_data_start(const Extree *t);
uint64_t extree_incompat_features(const Extree *t);
/*
 * Encryption (EXTREE_INCOMPAT_ENCRYPTED): the method, and where its header
 * lies, [offset, offset + length), below extree_data_start().  Never
 * changed by the core: snapshots, commits and the checker keep them.
 */
uint32_t extree_compression_type(const Extree *t);    /* EXTREE_COMPRESS_* */
uint32_t extree_crypt_method(const Extree *t);          /* 0: not encrypted */
uint64_t extree_crypt_header_offset(const Extree *t);   /* 0 if none */
uint64_t extree_crypt_header_length(const Extree *t);   /* 0 if none */
const char *extree_backing_file(const Extree *t);   /* NULL if none */
const char *extree_backing_fmt(const Extree *t);    /* NULL if none */

/* Dirty the superblock; committed by the next commit */
int extree_set_backing(Extree *t, const char *file, const char *fmt);
/*
 * Grow: just sets.  Shrink: punches [ROUND_UP(size, bs), old end) first.
 * O(extents removed).
 */
int extree_set_virtual_size(Extree *t, uint64_t size);

/* Debug and benchmark counters, cumulative since open */
typedef struct ExtreeStats {
    /* root-to-leaf searches that looked up at least one node in the cache */
    uint64_t descents;
    uint64_t next_leaf;         /* leaf steps that re-used the path */
    /* subtrees an allocation query stepped over unread (child_bytes) */
    uint64_t subtrees_skipped;
    uint64_t cache_hits;
    uint64_t cache_misses;      /* nodes read one at a time */
    uint64_t readahead;         /* nodes cached by readahead */
    uint64_t evictions;
    uint64_t cows;              /* nodes copied on write */
    uint64_t nodes_written;
    uint64_t commits;
    uint64_t forced_commits;    /* by dirty_limit */
    uint64_t cached_nodes;      /* current */
    uint64_t dirty_nodes;       /* current */
    /*
     * searches answered from the tree's last path alone (same leaf):
     * not descents
     */
    uint64_t path_hits;
    /* node misses served from images the caller read (prefetch) */
    uint64_t prefetched;
    /*
     * current: 1 while the handle knows only part of the free-space tree
     * (an open reads its first and last leaf; data placement, the checker
     * and a backend of fixed size read the rest)
     */
    uint64_t free_tree_partial;
    uint64_t rollbacks;         /* transactions dropped (extree_rollback) */
} ExtreeStats;
void extree_stats(const Extree *t, ExtreeStats *st);

/* ---- Mapping ---- */

typedef enum {
    EXTREE_RUN_UNALLOC = 0,
    EXTREE_RUN_DATA = 1,
    EXTREE_RUN_ZERO = 2,
    EXTREE_RUN_COMPRESSED = 3,
} ExtreeRunType;

typedef struct ExtreeRun {
    uint64_t guest, length;
    uint64_t host;      /* DATA: of @guest; COMPRESSED: the payload's */
    ExtreeRunType type;
    /*
     * COMPRESSED: the whole extent [ext_guest, + ext_length) (a run is
     * one extent, or with EXTREE_COALESCE_STATUS the first of several),
     * its payload's length and algorithm
     */
    uint64_t ext_guest, ext_length;
    uint32_t payload_len, alg;
} ExtreeRun;

/*
 * A position in a tree: nodes[level] (pinned) and slots[level], btrfs
 * style.  Fields private to the core.
 */
struct ExtreeNode;
typedef struct ExtreePath {
    struct ExtreeNode *nodes[EXTREE_MAX_LEVELS];
    int slots[EXTREE_MAX_LEVELS];
    int readahead;              /* next readahead batch, 0 = first */
} ExtreePath;

/*
 * Cursor: lives in caller memory, no allocation per query.  A query at an
 * offset >= the end of the previous answer, with the tree unchanged
 * (modification sequence number), continues on the current leaf
 * (slots[0]++, next leaf through the parent path); anything else descends
 * once.  Holds pins on its path: call extree_cursor_release() before the
 * Extree is closed.  Fields private by convention.
 */
typedef struct ExtreeCursor {
    Extree *t;
    uint64_t seq;               /* t's modification count when positioned */
    uint64_t pos;               /* items before the slot end <= pos */
    bool valid;
    ExtreePath path;
} ExtreeCursor;

void extree_cursor_init(ExtreeCursor *c, Extree *t);
void extree_cursor_release(ExtreeCursor *c);

/* merge DATA only if host-contiguous, ZERO with ZERO */
#define EXTREE_COALESCE_HOST    0
/* merge every adjacent item; type and host of the first piece */
#define EXTREE_COALESCE_ALLOC   1
/* as HOST, and adjacent COMPRESSED items too (block status: no offsets) */
#define EXTREE_COALESCE_STATUS  2

/*
 * run->guest = @guest, run->length in (0, @max_bytes], never past the
 * virtual size.  -EINVAL if @guest >= virtual size or @max_bytes == 0.
 * O(1) amortized when walking forward, O(log n) otherwise.
 */
int extree_cursor_query(ExtreeCursor *c, uint64_t guest, uint64_t max_bytes,
                        int coalesce, ExtreeRun *run);

/*
 * The same answer and cursor state as extree_cursor_query() when the
 * answer lies on the cursor's current leaf and needs no coalescing (so
 * either @coalesce gives it); otherwise -EAGAIN with the answer unset.
 * Reads nothing but the cursor's pinned leaf: never does I/O, never calls
 * the backend, never allocates, so a caller may run it under a lock that
 * must not be held across I/O.  -EINVAL as extree_cursor_query().
 */
int extree_cursor_query_cached(ExtreeCursor *c, uint64_t guest,
                               uint64_t max_bytes, ExtreeRun *run);

/*
 * No-wait queries, for a caller that must not hold its lock across a node
 * read (the QEMU driver: concurrent readers each wait for their own node,
 * not for each other's).  extree_cursor_query_nowait() gives the answer of
 * extree_cursor_query() when every node it needs is cached or prefetched;
 * where it would read a node it fails with -EWOULDBLOCK instead, with the
 * cursor released (the next query descends again), and skips readahead.
 * The caller then reads the node named by extree_missing_node() itself
 * (node_size bytes at that offset of the image) without its lock, hands
 * the image to extree_node_prefetch() and asks again.
 */
int extree_cursor_query_nowait(ExtreeCursor *c, uint64_t guest,
                               uint64_t max_bytes, int coalesce,
                               ExtreeRun *run);
/*
 * After -EWOULDBLOCK: the missing node's offset, and in *@epoch the value
 * to pass to extree_node_prefetch().  0 when the missing node is a leaf
 * that a forward walk steps onto: the blocking query reads it together
 * with the leaves after it (readahead), which one node read cannot match.
 */
uint64_t extree_missing_node(const Extree *t, uint64_t *epoch);
/*
 * Keep a copy of the node image @buf (node_size bytes) read from @bytenr
 * for the next miss of that location, which validates it exactly as a
 * node read from disk (so damage is reported the same way).  Ignored if a
 * commit completed since extree_missing_node() gave @epoch (the location
 * may hold another node by now), or if the node is cached.  At most
 * EXTREE_PREFETCH_MAX images are kept, the oldest dropped first; all are
 * dropped at commit.  O(EXTREE_PREFETCH_MAX).
 */
#define EXTREE_PREFETCH_MAX     64
void extree_node_prefetch(Extree *t, uint64_t bytenr, uint64_t epoch,
                          const void *buf);

/*
 * For qemu-img check: *@data_blocks = blocks mapped as DATA, *@fragments =
 * DATA runs that do not start where the previous one ended in the host
 * file.  O(extents).
 */
int extree_count_fragments(Extree *t, uint64_t *data_blocks,
                           uint64_t *fragments);

/*
 * Consecutive runs (COALESCE_HOST) covering [guest, guest + bytes), at most
 * @max_runs of them; *nruns is set to the number filled in.
 */
int extree_lookup(Extree *t, uint64_t guest, uint64_t bytes, ExtreeRun *runs,
                  int max_runs, int *nruns);

/*
 * ---- Updates ----
 * Guest offsets and lengths must be block-aligned (-EINVAL).  Mapping,
 * zeroing, punching and shrinking may end with a forced commit when dirty
 * metadata exceeds dirty_limit (not with commit_by_caller).
 * Space freed here becomes reusable only after the next commit is durable.
 */

/*
 * Allocate host space for a guest range without mapping it.  Prefers the
 * block right after the DATA extent mapping guest - 1 (or right before the
 * one at guest + bytes) so that sequential writes extend one extent; then
 * first fit; then the end of the file.  *@got may be < @bytes (the caller
 * loops).  O(log n).
 */
int extree_alloc_data(Extree *t, uint64_t guest, uint64_t bytes,
                      uint64_t *host, uint64_t *got);
/* Return an allocation that was never mapped */
int extree_free_data(Extree *t, uint64_t host, uint64_t bytes);
/*
 * Map guest -> host as DATA, replacing what is there (replaced DATA space
 * is freed).  O(log n + items replaced).
 */
int extree_map_data(Extree *t, uint64_t guest, uint64_t bytes, uint64_t host);
/*
 * Map guest [guest, + bytes) as one COMPRESSED extent whose payload, of
 * @payload_len bytes compressed with @alg (EXTREE_COMPRESS_ZLIB or _ZSTD),
 * the caller wrote at @host (allocated with extree_alloc_data() for the
 * payload's blocks).  @bytes at most EXTREE_COMPRESSED_MAX.  The first
 * one sets the compressed feature bit.  The core reads payloads only in
 * the checker.
 *
 * A COMPRESSED extent is never split: every update (map, zero, punch,
 * a smaller virtual size) must cover each one it touches whole, or fails
 * with -EINVAL and changes nothing.  The caller rewrites such an extent
 * uncompressed first: new space (one or more allocations) holding its
 * data, mapped with extree_map_data_pieces().
 */
int extree_map_compressed(Extree *t, uint64_t guest, uint64_t bytes,
                          uint64_t host, uint32_t payload_len, uint32_t alg);
/*
 * Map @n DATA pieces in guest order from @guest: @len[i] bytes at
 * @host[i] each, replacing what is there in one update
 */
int extree_map_data_pieces(Extree *t, uint64_t guest, const uint64_t *host,
                           const uint64_t *len, unsigned n);

/*
 * Payloads of compressed extents (extree-compress.c; no I/O, no state, any
 * thread).  extree_compress(): @len (1 to EXTREE_COMPRESSED_MAX) bytes of
 * @src into at most @cap bytes of @dst, *@out the payload's length;
 * -ENOSPC when it does not fit (it does not pay), -EINVAL for an unknown
 * @alg.  extree_decompress(): 0 only if the whole payload [@src, + @len)
 * gives exactly @dst_len bytes with its checksum right, else -EIO (or
 * -ENOMEM).
 */
int extree_compress(uint32_t alg, const void *src, size_t len, void *dst,
                    size_t cap, size_t *out);
int extree_decompress(uint32_t alg, const void *src, size_t len, void *dst,
                      size_t dst_len);
const char *extree_compression_name(uint32_t alg);  /* NULL if unknown */

/*
 * The backend cannot grow past @limit bytes (a block device, an NBD
 * export), 0 for no limit.  Allocations then stay below it: data fails
 * with -ENOSPC while room for the metadata that maps it and for commits is
 * left, metadata fails with -ENOSPC only when nothing is left.
 */
void extree_set_host_limit(Extree *t, uint64_t limit);

/*
 * How far host_end can move at most when @bytes of data are allocated
 * next: the data, a new metadata reserve, and the nodes the update and
 * the commit after it may need beyond the known free space (bitmap chunks
 * included: every chunk of every enabled bitmap, as a range may mark
 * them all).  A caller that grows the backend ahead of allocations grows
 * it this far, and so finds a device's end before the update.
 */
uint64_t extree_grow_bound(const Extree *t, uint64_t bytes);
/*
 * The same when only nodes and @contig bytes in one run (a snapshot table)
 * are allocated next, and the commit after them: host_end itself while the
 * known free space holds the run and room for the nodes (headroom, more
 * per range the transaction logged, the bitmap chunks an update may
 * change), so that an update that allocates no data does not make the
 * backend grow (and shrink again at close); else past host_end by what is
 * short, or by a reserve if no free range holds the run and one.  After
 * an open that read the free-space tree in part, it reads the leaves that
 * may hold such a range when the known free space is short.
 */
uint64_t extree_grow_bound_nodes(Extree *t, uint64_t contig);
int extree_set_zero(Extree *t, uint64_t guest, uint64_t bytes);
int extree_punch(Extree *t, uint64_t guest, uint64_t bytes);

/*
 * ---- Internal snapshots ----
 * A snapshot is another root of the extent tree, sharing its nodes and
 * data with the live tree; counts of the shared blocks are kept in the
 * reference count tree (docs/interop/extree.rst, Snapshots).  Each call
 * that changes the table commits whatever is pending first, then commits
 * its own change: afterwards nothing is dirty.
 */
typedef struct ExtreeSnapshotInfo {
    char id[EXTREE_SNAP_ID_MAX + 1];            /* "" on create: next free */
    char name[EXTREE_SNAP_NAME_MAX + 1];
    uint64_t date_sec;
    uint32_t date_nsec;
    uint64_t vm_clock_nsec, vm_state_size;
    uint64_t icount;                            /* UINT64_MAX: none */
    /* filled in by the core */
    uint64_t generation, virtual_size, extent_count, extent_bytes;
} ExtreeSnapshotInfo;

unsigned extree_snapshot_count(const Extree *t);
/* Host bytes of the snapshot table with @count entries (spec) */
uint64_t extree_snapshot_table_bytes(const Extree *t, unsigned count);
/* Entry @index (0 = oldest) */
int extree_snapshot_get(const Extree *t, unsigned index,
                        ExtreeSnapshotInfo *info);
/*
 * Index of the snapshot whose id (else, if none has it, whose name) is
 * @id_or_name, or -ENOENT
 */
int extree_snapshot_find(const Extree *t, const char *id_or_name);
/*
 * Take a snapshot of the current state: O(1) metadata.  info->id empty:
 * the lowest unused number.  -EEXIST: id in use; -EFBIG: 65535 snapshots,
 * or a virtual size above 2^62; -EINVAL: id or name too long.
 */
int extree_snapshot_create(Extree *t, ExtreeSnapshotInfo *info);
/*
 * The live image becomes snapshot @index (its virtual size too); the old
 * live state's unshared blocks are freed.  O(nodes freed).
 */
int extree_snapshot_goto(Extree *t, unsigned index);
/* Drop snapshot @index: O(nodes no other root shares) */
int extree_snapshot_delete(Extree *t, unsigned index);
/*
 * Read-only handle: reads and queries see snapshot @index from now on
 * (qemu-img convert -l).  -EROFS on a read-write handle.
 */
int extree_snapshot_load_tmp(Extree *t, unsigned index);
/*
 * The VM state of the live image, bytes [pos, pos + bytes) of it (savevm
 * writes it, then takes the snapshot, which keeps it and takes it out of
 * the live image; loadvm reverts to the snapshot, then reads it).  Kept
 * in the extent tree above the virtual disk (spec: VM state); writing
 * enables the snapshots feature.  Unwritten bytes read as zeroes.
 */
int extree_vmstate_write(Extree *t, uint64_t pos, const void *buf,
                         uint64_t bytes);
int extree_vmstate_read(Extree *t, uint64_t pos, void *buf, uint64_t bytes);
/*
 * May the guest range [guest, + bytes), mapped as DATA at @host, be
 * overwritten in place?  *@shared: no, a snapshot shares it, the write
 * must go to new space (extree_alloc_data + extree_map_data).  O(1)
 * without snapshots.
 */
int extree_data_shared(Extree *t, uint64_t guest, uint64_t bytes,
                       uint64_t host, bool *shared);
/*
 * Was host [host, + bytes) allocated by extree_alloc_data() in the running
 * transaction?  No committed state maps it then: a write into it is seen
 * only with the mapping that commits it, which marks the bitmaps, so the
 * bitmaps need not allow it in place (extree_bitmaps_in_place()).
 * O(log n).
 */
bool extree_data_fresh(Extree *t, uint64_t host, uint64_t bytes);
/*
 * May guest [@guest, + @bytes) (block-aligned) of run @run, as a cursor
 * query of the live tree gave it, be changed in place on the host?  Only
 * DATA that no snapshot shares, and with persistent bitmaps only where
 * extree_data_fresh() or extree_bitmaps_in_place() allow it.  A caller
 * that then changes it in place marks the range first, before its data
 * is issued (extree_bitmaps_mark()): a commit may store the bitmaps
 * before the caller's own copy of them has the change.  O(log n).
 */
int extree_in_place(Extree *t, const ExtreeRun *run, uint64_t guest,
                    uint64_t bytes, bool *in_place);

/*
 * The mark log (spec: Mark log; an image with bitmaps gets one at a commit
 * unless ExtreeOpenOptions.no_mark_log): makes the marks of writes in
 * place durable with one record and one flush, where a commit would be
 * needed otherwise.  A write in place of [@guest, + @bytes) of @run that
 * extree_in_place() refused only because the committed bitmaps lack its
 * granules, and for which the log has room: extree_mark_log_wanted().
 * Then the caller (for every such write waiting at the time: group commit)
 * takes a record from extree_mark_log_append() (which sets the marks in
 * the bits the next commit stores, as extree_bitmaps_mark() does), writes
 * it at *@offset (EXTREE_MARK_LOG_RECORD bytes, g_free() it), flushes the
 * backend, calls extree_mark_log_durable() and looks the range up again:
 * extree_in_place() allows it now.  No commit may run between the append
 * and durable (the caller holds its commit gate).  -ENOSPC: the log is
 * full or not usable yet (the write goes to new space as before).
 */
typedef struct ExtreeMarkRange {
    uint64_t start, len;        /* guest bytes */
} ExtreeMarkRange;
bool extree_mark_log_wanted(Extree *t, const ExtreeRun *run, uint64_t guest,
                            uint64_t bytes);
int extree_mark_log_append(Extree *t, const ExtreeMarkRange *r, unsigned n,
                           uint8_t **record, uint64_t *offset);
void extree_mark_log_durable(Extree *t, const ExtreeMarkRange *r,
                             unsigned n);
/*
 * The granule a record rounds its ranges out to (the finest enabled
 * bitmap's), so that a caller gathering ranges for one record can merge
 * those of one granule; 0 without bitmaps
 */
uint64_t extree_mark_log_granule(Extree *t);
/*
 * Marks only the log holds: they do not make the handle dirty (a flush
 * needs no commit for them), but a commit should store them when the log
 * is half full (checkpoint_wanted), at the commit timer and at close:
 * extree_mark_log_checkpoint() makes the next commit run for them.
 */
bool extree_mark_log_pending(const Extree *t);
bool extree_mark_log_checkpoint_wanted(const Extree *t);
void extree_mark_log_checkpoint(Extree *t);
typedef struct ExtreeMarkLogInfo {
    uint64_t offset;            /* 0: no log */
    uint32_t length;            /* bytes */
    uint32_t records;           /* in the chain of the running transaction */
    uint32_t replayed;          /* of them, found at the last open */
    bool maps;                  /* EXTREE_INCOMPAT_MAP_LOG */
    uint32_t map_replayed;      /* map entries applied at the last open */
} ExtreeMarkLogInfo;
void extree_mark_log_info(const Extree *t, ExtreeMarkLogInfo *info);

/*
 * Map records (spec: Mark log, map records; EXTREE_INCOMPAT_MAP_LOG, set
 * with the log): a write to new space is mapped with
 * extree_map_data_logged() once its data is written, with the CRC-32C of
 * the host bytes it wrote; its entry waits in memory.  A flush then needs
 * no commit if extree_map_log_sync_wanted(): the caller takes the records
 * of the waiting entries from extree_map_log_records() (consecutive slots
 * from *@offset, *@len bytes, g_free() them; none: *@len is 0), writes
 * them, and flushes the backend; a failed write is reported with
 * extree_map_log_failed() (the log is unusable until a commit).  As for
 * mark records, no commit and no other record write may run between
 * taking the records and their write completing (the caller holds its
 * commit gate and writes records one batch at a time).  Blocks a map
 * entry maps are never written in place until a commit (extree_in_place()
 * refuses them): a later write to them moves again.
 */
typedef struct ExtreeMapEntry {
    uint64_t guest, host, length;
    uint32_t csum;
} ExtreeMapEntry;
/* CRC-32C as the format uses it: crc(A B) = extree_crc32c(crc(A), B) */
uint32_t extree_crc32c(uint32_t crc, const void *buf, size_t len);
bool extree_map_log_usable(Extree *t);
int extree_map_data_logged(Extree *t, uint64_t guest, uint64_t bytes,
                           uint64_t host, uint32_t csum);
bool extree_map_log_sync_wanted(Extree *t);
/*
 * A flush is about to commit because no records could hold its changes:
 * after EXTREE_MAP_LOG_AFTER of them, that commit adds a log for map
 * records to an image without bitmaps (it has one with them), unless
 * ExtreeOpenOptions.no_mark_log
 */
void extree_map_log_flush_commit(Extree *t);
int extree_map_log_records(Extree *t, uint8_t **records, uint64_t *offset,
                           uint64_t *len);
void extree_map_log_failed(Extree *t);
/*
 * The same for a caller without asynchronous I/O (the nbdkit plugin):
 * writes the records through the backend; the caller flushes it
 */
int extree_map_log_sync(Extree *t);

/* ---- Persistent dirty bitmaps (EXTREE_INCOMPAT_BITMAPS) ---- */

/*
 * A bitmap marks the granules whose content changed since it was created
 * or last cleared; the core marks every change of the live tree's mapping
 * (writes to new space, zeroes, discards, shrinking, reverting) in the
 * enabled bitmaps, in the transaction that makes it, and commits the bits
 * with it.  Writes in place change no mapping: the caller asks
 * extree_bitmaps_in_place() first, and writes to new space where it says
 * no.  The content of a bitmap is an array of bytes, granule g in bit
 * g % 8 of byte g / 8 (QEMU's serialization of an HBitmap), of
 * extree_bitmap_bytes() bytes.
 */
typedef struct ExtreeBitmapInfo {
    const char *name;           /* valid until the bitmap is removed */
    uint64_t granularity;
    bool enabled;
    uint64_t dirty_granules;
} ExtreeBitmapInfo;

unsigned extree_bitmap_count(Extree *t);
/* Index of the bitmap named @name, or -ENOENT */
int extree_bitmap_find(Extree *t, const char *name);
int extree_bitmap_info(Extree *t, unsigned i, ExtreeBitmapInfo *info);
/*
 * Could a bitmap @name of @granularity be added?  0, or -errno with *@why
 * (g_malloc'd): read-only, name empty or longer than 1023 bytes, a
 * granularity that is not a power of two from the block size to 2 GiB,
 * the name taken, too many bitmaps
 */
int extree_bitmap_check_new(Extree *t, const char *name, uint64_t granularity,
                            char **why);
/* A new bitmap, all clear; sets EXTREE_INCOMPAT_BITMAPS */
int extree_bitmap_add(Extree *t, const char *name, uint64_t granularity,
                      bool enabled);
int extree_bitmap_remove(Extree *t, const char *name);
uint64_t extree_bitmap_bytes(Extree *t, unsigned i);
void extree_bitmap_read(Extree *t, unsigned i, uint8_t *buf);
/*
 * The bitmap's content becomes @buf (extree_bitmap_bytes() bytes), plus
 * its own if @keep, plus, if @enabled, the marks (what this transaction
 * changed, see extree_bitmaps_keep_marks()); @enabled becomes its state.
 * What a caller that keeps its own copy of the bits (QEMU's) calls before
 * each commit, so that a clear, merge or disable made there is committed.
 */
int extree_bitmap_sync(Extree *t, unsigned i, const uint8_t *buf,
                       bool enabled, bool keep);
/*
 * The marks extree_bitmap_sync() adds: by default the changes of the
 * running transaction.  A caller whose copy learns of a change only when
 * its request has returned, which may be after the commit that stored it
 * (QEMU: after an emulated FUA flush, between the pieces of a request),
 * keeps them across commits instead, and says when every change so far is
 * in its copy (no request in flight: a drained node).
 */
void extree_bitmaps_keep_marks(Extree *t);
void extree_bitmaps_marks_reflected(Extree *t);
bool extree_bitmaps_have_marks(Extree *t);
/*
 * May guest [guest, + bytes) be written in place as far as the bitmaps are
 * concerned?  Only if every enabled bitmap has all its granules set, both
 * committed and in this transaction.  O(bitmaps + granules).
 */
bool extree_bitmaps_in_place(Extree *t, uint64_t guest, uint64_t bytes);
/*
 * Mark guest [guest, + bytes) changed in every enabled bitmap, and keep
 * it among the marks a sync adds to the caller's bits (see
 * extree_bitmaps_keep_marks()).  Updates of the mapping mark themselves;
 * a caller that changes data in place marks it before the data is issued
 * (extree_in_place()).  O(bitmaps + granules).
 */
void extree_bitmaps_mark(Extree *t, uint64_t guest, uint64_t bytes);
/* Upper bound of the bytes a bitmap takes (qemu-img measure) */
uint64_t extree_bitmap_meta_bytes(uint64_t virtual_size, uint32_t block_size,
                                  size_t name_len, uint64_t granularity);

/* ---- Checker ---- */

typedef struct ExtreeCheckResult {
    uint64_t corruptions, leaks, leaked_bytes, repaired_leaks;
    /* host bytes whose recorded reference count is above the one found */
    uint64_t leaked_ref_bytes;
    uint64_t nodes, extents, free_items;
    uint64_t data_bytes, metadata_bytes, free_bytes;
    uint64_t compressed_bytes;  /* of the live image, in compressed extents */
    uint64_t unmerged;          /* adjacent mergeable items: not an error */
    /* of @corruptions: fixed by rebuilding the free-space tree */
    uint64_t repaired_corruptions;
} ExtreeCheckResult;

typedef void ExtreeReportFn(void *opaque, const char *msg);

/* What extree_check_fix() may repair (qemu-img check -r leaks / -r all) */
#define EXTREE_FIX_LEAKS        1u
#define EXTREE_FIX_ERRORS       2u

/*
 * Commit pending changes (when writable), then read every node of both
 * trees from the backend (not the cache) and verify it, and verify that
 * every block of [data_start, host_end) has exactly one owner, and the
 * superblock's extent_count and free_bytes.  One @report line per problem,
 * "corrupt <structure> at offset 0x..: <reason>" for corruption.
 * Repairs, on a writable handle only:
 *   - EXTREE_FIX_LEAKS, no corruption found: leaked ranges are added to the
 *     free tree and committed (repaired_leaks);
 *   - EXTREE_FIX_ERRORS, corruption of the free-space tree only (its nodes,
 *     its accounting, free space also claimed by a node or an extent, or a
 *     free tree that could not be loaded at open): the free-space tree is
 *     rebuilt from the extent tree - every block that is neither an
 *     extent-tree node nor DATA becomes free - and committed
 *     (repaired_corruptions; leaks are repaired with it); a bitmap whose
 *     blocks another structure claims too is removed, the same way;
 *   - corruption of the extent tree, or any other block claimed twice:
 *     nothing is repaired;
 *   - a compressed payload that does not decompress: reported, never
 *     repaired.
 * A check that leaves no corruption unrepaired allows
 * extree_clear_corrupt().  O(nodes + items) time and O(items) memory,
 * plus reading and decompressing every compressed payload once.
 * Returns 0 when the check ran (even if it found problems).
 */
int extree_check_fix(Extree *t, unsigned fix, ExtreeCheckResult *res,
                     ExtreeReportFn *report, void *opaque);

/*
 * extree_check_fix() with EXTREE_FIX_LEAKS if @repair_leaks, plus
 * EXTREE_FIX_ERRORS if @repair_leaks and @t was opened with repair
 */
int extree_check(Extree *t, bool repair_leaks, ExtreeCheckResult *res,
                 ExtreeReportFn *report, void *opaque);

/*
 * Upper bound of metadata bytes for qemu-img measure (@nr_extents 0:
 * worst case, one extent per block).  Without an encryption header: an
 * encrypted image needs ROUND_UP(crypt_header_length, block_size) more.
 */
uint64_t extree_metadata_bound(uint64_t virtual_size, uint32_t block_size,
                               uint32_t node_size, uint64_t nr_extents);

#endif /* BLOCK_EXTREE_H */
