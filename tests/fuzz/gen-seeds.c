/*
 * extree fuzzing: write the seed images into a directory
 *
 *   gen-seeds DIR
 *
 * Each seed is an image made by the core on the memory backend and dumped
 * as a flat file: 512-byte blocks and 4 KiB nodes keep them small (126
 * items a node).  Free space is zeroed in the file, as a discard would:
 * old copies of nodes would only be noise to the fuzzer (and legitimate
 * targets for an edited pointer).  Deterministic: the same core writes the
 * same files.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdio.h>
#include <stdlib.h>

#include "extree-backend.h"
#include "fuzz-input.h"

typedef struct Gen {
    ExtreeBackend *be;
    Extree *t;
    uint32_t bs;
    uint64_t rng;
    /*
     * Data sectors hold 16 random bytes and zeroes: as distinct to the
     * oracle (a crc32c per sector), and inputs made from the image
     * compress (the snapshot seeds: their corpus is large)
     */
    bool tagged;
    /* marked corrupt at the end: a superblock the chain lags behind */
    bool corrupt;
} Gen;

static uint64_t gen_rand(Gen *g)
{
    return fz_splitmix64(&g->rng);
}

static void must(int ret, const char *what)
{
    if (ret < 0) {
        fprintf(stderr, "gen-seeds: %s: %s\n", what, g_strerror(-ret));
        exit(1);
    }
}

static void gen_open(Gen *g)
{
    /* no forced commits: the generator says when */
    ExtreeOpenOptions o = { .dirty_limit = UINT64_MAX / 2 };
    char *err = NULL;

    if (extree_open(g->be, &o, &g->t, &err) < 0) {
        fprintf(stderr, "gen-seeds: open: %s\n", err);
        exit(1);
    }
}

/* gen_start() with an encryption header of @crypt_len bytes (0: none) */
static void gen_start_crypt(Gen *g, uint64_t vsize, uint32_t bs, uint32_t ns,
                            const char *backing, uint64_t seed,
                            uint64_t crypt_len)
{
    ExtreeCreateParams p = {
        .virtual_size = vsize, .block_size = bs, .node_size = ns,
        .backing_file = backing, .backing_fmt = backing ? "qcow2" : NULL,
        .crypt_method = crypt_len ? EXTREE_CRYPT_LUKS : 0,
        .crypt_header_length = crypt_len,
    };
    char *err = NULL;

    g->be = extree_mem_backend_new();
    g->bs = bs;
    g->rng = seed;
    g->tagged = false;
    g->corrupt = false;
    if (crypt_len) {
        /*
         * A stand-in for the LUKS header, written first as the driver
         * does: its magic, then a pattern (the core never reads it)
         */
        static const uint8_t magic[] = { 'L', 'U', 'K', 'S', 0xba, 0xbe,
                                         0, 1 };
        uint8_t *hdr = g_malloc(crypt_len);

        for (uint64_t i = 0; i < crypt_len; i++) {
            hdr[i] = i < sizeof(magic) ? magic[i] : (i % 512 < 64 ? i : 0);
        }
        must(g->be->ops->pwrite(g->be->opaque, EXTREE_SB_AREA, hdr,
                                crypt_len), "header");
        g_free(hdr);
    }
    if (extree_create(g->be, &p, &err) < 0) {
        fprintf(stderr, "gen-seeds: create: %s\n", err);
        exit(1);
    }
    gen_open(g);
}

static void gen_start(Gen *g, uint64_t vsize, uint32_t bs, uint32_t ns,
                      const char *backing, uint64_t seed)
{
    gen_start_crypt(g, vsize, bs, ns, backing, seed, 0);
}

/* DATA at [guest, +blocks) with pseudo-random contents */
static void gen_write(Gen *g, uint64_t blk, uint64_t blocks)
{
    uint64_t guest = blk * g->bs, bytes = blocks * g->bs;

    while (bytes) {
        uint64_t host, got;
        uint8_t *buf;

        must(extree_alloc_data(g->t, guest, bytes, &host, &got),
             "alloc_data");
        buf = g_malloc0(got);
        for (uint64_t i = 0; i < got; i += 8) {
            if (!g->tagged || i % 512 < 16) {
                ext_st64(buf + i, gen_rand(g));
            }
        }
        must(g->be->ops->pwrite(g->be->opaque, host, buf, got), "pwrite");
        g_free(buf);
        must(extree_map_data(g->t, guest, got, host), "map_data");
        guest += got;
        bytes -= got;
    }
}

/*
 * COMPRESSED at [guest, +blocks) with @alg: text-like contents (so that
 * it compresses), the payload in as many blocks as it needs
 */
static void gen_compressed(Gen *g, uint64_t blk, uint64_t blocks,
                           uint32_t alg)
{
    uint64_t guest = blk * g->bs, bytes = blocks * g->bs, host, got;
    uint8_t *buf = g_malloc(bytes), *pay = g_malloc0(bytes);
    size_t plen;

    for (uint64_t i = 0; i < bytes; i++) {
        buf[i] = "extent tree leaf node "[(i / 5 + gen_rand(g) % 3) % 22];
    }
    must(extree_compress(alg, buf, bytes, pay, bytes - g->bs, &plen),
         "compress");
    must(extree_alloc_data(g->t, guest, EXTREE_ROUND_UP(plen, g->bs), &host,
                           &got), "alloc_data");
    if (got != EXTREE_ROUND_UP(plen, g->bs)) {
        must(-ENOSPC, "alloc_data (contiguous payload)");
    }
    must(g->be->ops->pwrite(g->be->opaque, host, pay, got), "pwrite");
    must(extree_map_compressed(g->t, guest, bytes, host, plen, alg),
         "map_compressed");
    g_free(buf);
    g_free(pay);
}

static void gen_zero(Gen *g, uint64_t blk, uint64_t blocks)
{
    must(extree_set_zero(g->t, blk * g->bs, blocks * g->bs), "set_zero");
}

static void gen_punch(Gen *g, uint64_t blk, uint64_t blocks)
{
    must(extree_punch(g->t, blk * g->bs, blocks * g->bs), "punch");
}

static void gen_commit(Gen *g)
{
    must(extree_commit(g->t), "commit");
}

/* Zero every range the free-space tree lists */
static void wipe_free_space(uint8_t *buf, size_t len)
{
    FzImage *im = g_new(FzImage, 1);

    if (!fz_image_parse(im, buf, len)) {
        fprintf(stderr, "gen-seeds: cannot parse the image\n");
        exit(1);
    }
    for (int i = 0; i < im->nnodes; i++) {
        const FzNode *n = &im->nodes[i];
        const uint8_t *items = buf + n->bytenr + EXTREE_NODE_HEADER_SIZE;

        for (uint32_t k = 0; n->owner == EXTREE_TREE_FREE && !n->level &&
                             k < n->nritems; k++) {
            uint64_t start = ext_ld64(items + k * 32);
            uint64_t bytes = ext_ld64(items + k * 32 + 8);

            memset(buf + start, 0, MIN(bytes, len - MIN(start, len)));
        }
    }
    g_free(im);
}

/* Nodes of each tree and snapshots, with snapshots */
static void print_trees(const uint8_t *buf, size_t len)
{
    FzImage *im = g_new(FzImage, 1);
    int refs = 0, snap_only = 0;

    fz_image_parse(im, buf, len);
    if (im->snap_count) {
        for (int i = 0; i < im->nnodes; i++) {
            refs += im->nodes[i].owner == EXTREE_TREE_REFS;
        }
        /* fz_image_parse adds the snapshots' unshared nodes last */
        for (int i = 0; i < im->nnodes; i++) {
            if (im->nodes[i].owner == EXTREE_TREE_REFS) {
                snap_only = im->nnodes - i - 1;
            }
        }
        printf("%u snapshots, %d reference count nodes, %d nodes of "
               "snapshots only, ", im->snap_count, refs,
               im->nsnaps ? snap_only : 0);
    }
    g_free(im);
}

/* Commit, close, check the image is clean and write it to DIR/NAME */
/*
 * After the last commit: the DATA blocks @blk[0..n) written in place as the
 * driver writes over granules the committed bitmaps lack, each through a
 * record of the mark log (appended, written, flushed, durable), so that an
 * open of the image replays the chain
 */
static void gen_log_writes(Gen *g, const uint64_t *blk, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        ExtreeMarkRange r = { blk[i] * g->bs, g->bs };
        ExtreeRun run;
        ExtreeCursor cur;
        uint8_t *rec, *buf;
        uint64_t off;
        bool in_place;

        extree_cursor_init(&cur, g->t);
        must(extree_cursor_query(&cur, r.start, r.len, EXTREE_COALESCE_HOST,
                                 &run), "query");
        extree_cursor_release(&cur);
        must(extree_in_place(g->t, &run, r.start, r.len, &in_place),
             "in_place");
        if (in_place || !extree_mark_log_wanted(g->t, &run, r.start,
                                                r.len)) {
            fprintf(stderr, "gen-seeds: block %" PRIu64 " needs no record\n",
                    blk[i]);
            exit(1);
        }
        must(extree_mark_log_append(g->t, &r, 1, &rec, &off), "append");
        must(g->be->ops->pwrite(g->be->opaque, off, rec,
                                EXTREE_MARK_LOG_RECORD), "pwrite");
        must(g->be->ops->flush(g->be->opaque), "flush");
        g_free(rec);
        extree_mark_log_durable(g->t, &r, 1);
        buf = g_malloc0(g->bs);
        ext_st64(buf, gen_rand(g));
        must(g->be->ops->pwrite(g->be->opaque,
                                run.host + (r.start - run.guest), buf, g->bs),
             "pwrite");
        g_free(buf);
    }
}

/*
 * After the last commit: guest blocks @blk[0..n), holes, written to new
 * space as the driver writes them, each mapped by a map record of its own
 * (written, not flushed: the memory backend keeps every write), so that
 * an open replays the chain.  The data is zeroes: wipe_free_space() clears
 * what the committed state calls free, and the records' checksums must
 * keep matching.
 */
static void gen_map_writes(Gen *g, const uint64_t *blk, unsigned n)
{
    uint8_t *zero = g_malloc0(g->bs);

    for (unsigned i = 0; i < n; i++) {
        uint64_t host, got;

        must(extree_alloc_data(g->t, blk[i] * g->bs, g->bs, &host, &got),
             "alloc");
        must(g->be->ops->pwrite(g->be->opaque, host, zero, got), "pwrite");
        must(extree_map_data_logged(g->t, blk[i] * g->bs, got, host,
                                    extree_crc32c(0, zero, got)), "map");
        must(extree_map_log_sync(g->t), "records");
    }
    g_free(zero);
}

static void gen_finish_log(Gen *g, const char *dir, const char *name,
                           unsigned want_depth, const uint64_t *log_blk,
                           unsigned nlog, const uint64_t *map_blk,
                           unsigned nmap)
{
    ExtreeCheckResult res;
    int64_t len;
    uint8_t *buf;
    char *path;
    GError *gerr = NULL;

    gen_commit(g);
    must(extree_check(g->t, false, &res, NULL, NULL), "check");
    if (res.corruptions || res.leaks ||
        extree_depth(g->t) != want_depth) {
        fprintf(stderr, "gen-seeds: %s: %" PRIu64 " corruptions, %" PRIu64
                " leaks, depth %u expect %u\n", name, res.corruptions,
                res.leaks, extree_depth(g->t), want_depth);
        exit(1);
    }
    printf("%s: depth %u, %" PRIu64 " extents, %" PRIu64 " nodes, ",
           name, extree_depth(g->t), res.extents, res.nodes);
    gen_log_writes(g, log_blk, nlog);
    if (nlog) {
        printf("%u mark log records, ", nlog);
    }
    gen_map_writes(g, map_blk, nmap);
    if (nmap) {
        printf("%u map records, ", nmap);
    }
    extree_close(g->t);
    if (g->corrupt) {
        must(extree_mark_corrupt_image(g->be), "mark corrupt");
        printf("marked corrupt, ");
    }

    len = g->be->ops->get_length(g->be->opaque);
    buf = g_malloc(len);
    must(g->be->ops->pread(g->be->opaque, 0, buf, len), "pread");
    wipe_free_space(buf, len);
    print_trees(buf, len);
    path = g_build_filename(dir, name, NULL);
    if (!g_file_set_contents(path, (char *)buf, len, &gerr)) {
        fprintf(stderr, "gen-seeds: %s\n", gerr->message);
        exit(1);
    }
    printf("%" PRId64 " bytes\n", len);
    g_free(path);
    g_free(buf);
    extree_mem_backend_free(g->be);
}

static void gen_finish(Gen *g, const char *dir, const char *name,
                       unsigned want_depth)
{
    gen_finish_log(g, dir, name, want_depth, NULL, 0, NULL, 0);
}

/* One leaf: a few DATA, ZERO and overwritten extents over two commits */
static void seed_leaf(const char *dir)
{
    Gen g;

    gen_start(&g, 1 << 20, 512, 4096, NULL, 1);
    for (int i = 0; i < 12; i++) {
        gen_write(&g, i * 40, 1 + i % 4);
        gen_zero(&g, i * 40 + 20, 2 + i % 3);
    }
    gen_commit(&g);
    gen_write(&g, 41, 2);         /* overwrite: the old blocks are freed */
    gen_punch(&g, 120, 2);
    gen_write(&g, 2040, 8);       /* the last blocks of the disk */
    gen_finish(&g, dir, "leaf-512.img", 1);
}

/*
 * 4 KiB blocks, a backing file name and a virtual size that ends inside
 * a block
 */
static void seed_backing(const char *dir)
{
    Gen g;

    gen_start(&g, (2 << 20) + 1536, 4096, 4096, "base.qcow2", 2);
    gen_write(&g, 0, 3);
    gen_zero(&g, 10, 5);
    gen_write(&g, 100, 1);
    gen_write(&g, 512, 1);        /* the partial last block */
    gen_finish(&g, dir, "backing-4k.img", 1);
}

/* Two levels: ~300 extents, one DATA in four */
static void seed_two_levels(const char *dir)
{
    Gen g;

    gen_start(&g, 4 << 20, 512, 4096, NULL, 3);
    for (int i = 0; i < 300; i++) {
        if (i % 4 == 0) {
            gen_write(&g, i * 3, 1);
        } else {
            gen_zero(&g, i * 3, 1 + i % 2);
        }
        if (i % 100 == 99) {
            gen_commit(&g);
        }
    }
    gen_finish(&g, dir, "two-levels-512.img", 2);
}

/*
 * A free-space tree of two levels: 260 DATA blocks at consecutive host
 * blocks but separate guest offsets, every other one punched after a
 * commit, leaves 130 free runs
 */
static void seed_free_tree(const char *dir)
{
    Gen g;

    gen_start(&g, 1 << 20, 512, 4096, NULL, 4);
    for (int i = 0; i < 260; i++) {
        gen_write(&g, i * 2, 1);
    }
    gen_commit(&g);
    for (int i = 0; i < 260; i += 2) {
        gen_punch(&g, i * 2, 1);
    }
    gen_finish(&g, dir, "free-tree-512.img", 2);
}

/*
 * Three levels with as few nodes as the tree allows: items appended one
 * block apart fill leaves completely, so 126 * 126 + 1 items make the root
 * split; then the leaves of the left subtree are punched down to 31 (a
 * node under a quarter full would merge and collapse the root).  To get
 * the file small again, every remaining node is copied on write into the
 * space of the punched ones, and 2 MiB of data written and punched at the
 * end make the free tail long enough (1 MiB) for commit to cut it.
 */
static void build_three_levels(Gen *g, uint64_t seed)
{
    uint64_t per_leaf = EXTREE_LEAF_CAPACITY(4096);
    uint64_t items = per_leaf * EXTREE_INTERIOR_CAPACITY(4096) + 1;
    uint64_t hole = 31 * per_leaf * 2, hole_len = (126 - 31) * per_leaf * 2;

    gen_start(g, 16 << 20, 512, 4096, NULL, seed);
    for (uint64_t i = 0; i < items; i++) {
        if (i % 512 == 0) {
            gen_write(g, i * 2, 1);
        } else {
            gen_zero(g, i * 2, 1);
        }
    }
    gen_commit(g);
    gen_punch(g, hole, hole_len);
    gen_commit(g);
    /*
     * Rewrite an item of every leaf: each leaf is copied, with its
     * parents, to the lowest freed node space; a few rounds pack them
     */
    for (int round = 0; round < 6; round++) {
        for (uint64_t i = 0; i < 31; i++) {
            gen_zero(g, i * per_leaf * 2 + 1 + round * 2, 1);
        }
        gen_zero(g, 126 * per_leaf * 2 + 1 + round * 2, 1);
        gen_commit(g);
    }
    gen_write(g, hole, 4096);
    gen_commit(g);
    gen_punch(g, hole, 4096);
    gen_commit(g);
}

static void seed_three_levels(const char *dir)
{
    Gen g;

    build_three_levels(&g, 5);
    gen_zero(&g, 3, 1);
    gen_finish(&g, dir, "three-levels-512.img", 3);
}

/*
 * Snapshots: two levels shared by two snapshots, partly copied by later
 * writes (reference count tree items, shared nodes and DATA), VM state
 * kept by one snapshot, one snapshot deleted
 */
static void seed_snapshots(const char *dir)
{
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };
    uint8_t state[3000];
    Gen g;

    gen_start(&g, 4 << 20, 512, 4096, NULL, 6);
    g.tagged = true;
    for (int i = 0; i < 300; i++) {
        if (i % 3 == 0) {
            gen_write(&g, i * 3, 1 + i % 2);
        } else {
            gen_zero(&g, i * 3, 1);
        }
    }
    gen_commit(&g);
    memset(state, 0x5a, sizeof(state));
    must(extree_vmstate_write(g.t, 0, state, sizeof(state)), "vmstate");
    info.vm_state_size = sizeof(state);
    g_strlcpy(info.name, "first", sizeof(info.name));
    must(extree_snapshot_create(g.t, &info), "snapshot create");
    for (int i = 0; i < 40; i++) {
        gen_write(&g, i * 21, 1);
    }
    gen_commit(&g);
    memset(&info, 0, sizeof(info));
    info.icount = UINT64_MAX;
    g_strlcpy(info.name, "second", sizeof(info.name));
    must(extree_snapshot_create(g.t, &info), "snapshot create");
    gen_punch(&g, 600, 100);
    gen_write(&g, 3, 2);
    gen_commit(&g);
    g_strlcpy(info.id, "", sizeof(info.id));
    g_strlcpy(info.name, "third", sizeof(info.name));
    must(extree_snapshot_create(g.t, &info), "snapshot create");
    must(extree_snapshot_delete(g.t, 1), "snapshot delete");
    gen_write(&g, 50, 1);
    gen_finish(&g, dir, "snapshots-512.img", 2);
}

/*
 * A snapshot named @name of the state committed now, with @vmstate bytes
 * of VM state (written first, at an unaligned length: it ends inside a
 * block)
 */
static void gen_snapshot(Gen *g, const char *name, size_t vmstate)
{
    ExtreeSnapshotInfo info = { .icount = UINT64_MAX };

    if (vmstate) {
        uint8_t *state = g_malloc(vmstate);

        for (size_t i = 0; i < vmstate; i++) {
            state[i] = gen_rand(g);
        }
        must(extree_vmstate_write(g->t, 0, state, vmstate), "vmstate");
        g_free(state);
        info.vm_state_size = vmstate;
    }
    g_strlcpy(info.name, name, sizeof(info.name));
    info.date_sec = 1700000000 + gen_rand(g) % 1000000;
    must(extree_snapshot_create(g->t, &info), "snapshot create");
}

/*
 * Three levels shared at every level by three snapshots: the first taken
 * of the whole tree (with VM state); then leaves of the left subtree
 * rewritten (the root, one level-1 node and those leaves copied, the
 * rest shared), the second taken; then a leaf of the right subtree
 * rewritten, the image grown to 20 MiB and written in the new range, the
 * third taken (a larger virtual size, with VM state); the live image
 * shrunk to 18 MiB
 */
static void seed_snap_levels(const char *dir)
{
    uint64_t per_leaf = EXTREE_LEAF_CAPACITY(4096);
    Gen g;

    build_three_levels(&g, 7);
    g.tagged = true;
    gen_snapshot(&g, "whole", 5000);
    for (int i = 0; i < 4; i++) {
        gen_write(&g, i * 7 * per_leaf * 2 + 5, 2);
    }
    gen_commit(&g);
    gen_snapshot(&g, "left", 0);
    gen_write(&g, 126 * per_leaf * 2 + 9, 1);
    must(extree_set_virtual_size(g.t, 20 << 20), "grow");
    gen_write(&g, (16 << 20) / 512 + 100, 3);
    gen_write(&g, (19 << 20) / 512 + 7, 2);
    gen_commit(&g);
    gen_snapshot(&g, "large", 700);
    must(extree_set_virtual_size(g.t, 18 << 20), "shrink");
    gen_zero(&g, 3, 1);
    gen_finish(&g, dir, "snap-levels-512.img", 3);
}

/*
 * A reference count tree of more than one leaf: 300 DATA blocks every
 * third guest block, shared by a snapshot, every leaf copied by a write,
 * then every other block overwritten: the counts of 2 left alternate
 * with blocks of one reference, 150 separate items.  Four snapshots in
 * all, of 2, 4, 4 and 3 MiB (taken around a grow and a shrink), two with
 * VM state, one deleted between them; the live image at 3 MiB.
 */
static void seed_snap_refs(const char *dir)
{
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 8);
    g.tagged = true;
    for (int i = 0; i < 300; i++) {
        gen_write(&g, i * 3, 1);
        gen_zero(&g, i * 3 + 1, 1);
    }
    gen_commit(&g);
    gen_snapshot(&g, "two-mib", 1500);
    for (int i = 0; i < 300; i += 2) {
        gen_write(&g, i * 3, 1);
    }
    gen_commit(&g);
    must(extree_set_virtual_size(g.t, 4 << 20), "grow");
    gen_write(&g, 5000, 40);
    gen_commit(&g);
    gen_snapshot(&g, "four-mib", 0);
    gen_snapshot(&g, "doomed", 0);
    for (int i = 1; i < 300; i += 4) {
        gen_write(&g, i * 3, 1);
    }
    gen_commit(&g);
    gen_snapshot(&g, "four-mib-2", 2600);
    must(extree_snapshot_delete(g.t, 2), "snapshot delete");
    must(extree_set_virtual_size(g.t, 3 << 20), "shrink");
    gen_commit(&g);
    gen_snapshot(&g, "three-mib", 0);
    gen_write(&g, 7, 2);
    gen_punch(&g, 30, 6);
    gen_finish(&g, dir, "snap-refs-512.img", 2);
}

/*
 * Encryption bit: a header of 25 sectors at 8192 (data_start 0x5200),
 * two levels of DATA and ZERO, a snapshot with VM state, then writes
 */
static void seed_crypt(const char *dir)
{
    Gen g;

    gen_start_crypt(&g, 2 << 20, 512, 4096, NULL, 9, 25 * 512);
    g.tagged = true;
    for (int i = 0; i < 200; i++) {
        if (i % 3 == 0) {
            gen_write(&g, i * 4, 1 + i % 2);
        } else {
            gen_zero(&g, i * 4, 1);
        }
    }
    gen_commit(&g);
    gen_snapshot(&g, "before", 1200);
    for (int i = 0; i < 20; i++) {
        gen_write(&g, i * 37, 1);
    }
    gen_punch(&g, 400, 40);
    gen_finish(&g, dir, "crypt-512.img", 2);
}

/*
 * Compressed-extents bit: zstd and zlib extents of 8 to 16 blocks among
 * DATA and ZERO, two levels, a snapshot sharing them, then a punch of
 * some (the snapshot keeps their payloads)
 */
static void seed_compressed(const char *dir)
{
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 11);
    g.tagged = true;
    for (int i = 0; i < 200; i++) {
        if (i % 4 == 0) {
            gen_compressed(&g, i * 20, 8 + i % 9,
                           i % 8 ? EXTREE_COMPRESS_ZSTD
                                 : EXTREE_COMPRESS_ZLIB);
        } else if (i % 4 == 1) {
            gen_write(&g, i * 20, 1 + i % 3);
        } else if (i % 4 == 2) {
            gen_zero(&g, i * 20, 2);
        }
    }
    gen_commit(&g);
    gen_snapshot(&g, "before", 0);
    gen_punch(&g, 0, 20 * 20);
    gen_finish(&g, dir, "compressed-512.img", 2);
}

/*
 * Bitmaps bit: three persistent bitmaps (granularity 512, 4096 and 64 KiB,
 * one disabled) with granules set by writes, zeroes and punches committed
 * in several transactions, one chunk of the 512-byte one left all clear
 */
static void bitmaps_image(Gen *g)
{
    g->tagged = true;
    for (int i = 0; i < 100; i++) {
        gen_write(g, i * 30, 1 + i % 4);
    }
    gen_commit(g);
    must(extree_bitmap_add(g->t, "b512", 512, true), "bitmap");
    must(extree_bitmap_add(g->t, "b4k", 4096, true), "bitmap");
    must(extree_bitmap_add(g->t, "off", 65536, false), "bitmap");
    gen_commit(g);
    for (int i = 0; i < 40; i++) {
        if (i % 3 == 0) {
            gen_write(g, 2048 + i * 17, 1 + i % 5);
        } else if (i % 3 == 1) {
            gen_zero(g, i * 31, 2);
        } else {
            gen_punch(g, i * 29, 1);
        }
        if (i % 10 == 9) {
            gen_commit(g);
        }
    }
}

static void seed_bitmaps(const char *dir)
{
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 13);
    bitmaps_image(&g);
    gen_finish(&g, dir, "bitmaps-512.img", 1);
}

/*
 * Mark log bit: the bitmaps image with a live chain of three records (the
 * writes in place after its last commit, over granules its bitmaps lack):
 * every open replays them
 */
static void seed_mark_log(const char *dir)
{
    static const uint64_t blk[] = { 60, 1500, 2370 };
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 13);
    bitmaps_image(&g);
    gen_finish_log(&g, dir, "mark-log-512.img", 1, blk, G_N_ELEMENTS(blk),
                   NULL, 0);
}

/*
 * One mark record, then three map records (issue 47): writes to holes
 * logged instead of committed
 */
static void seed_map_log(const char *dir)
{
    static const uint64_t blk[] = { 60 };
    static const uint64_t map_blk[] = { 3000, 3001, 3900 };
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 13);
    bitmaps_image(&g);
    gen_finish_log(&g, dir, "map-log-512.img", 1, blk, G_N_ELEMENTS(blk),
                   map_blk, G_N_ELEMENTS(map_blk));
}

/*
 * Map records without bitmaps: the log added after eight flushes that
 * committed (bits 5 and 6 without bit 4), then three map records
 */
static void seed_map_log_plain(const char *dir)
{
    static const uint64_t map_blk[] = { 3000, 3001, 3900 };
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 14);
    for (int i = 0; i < EXTREE_MAP_LOG_AFTER; i++) {
        gen_write(&g, 40 + i * 37, 1 + i % 3);
        extree_map_log_flush_commit(g.t);
        gen_commit(&g);
    }
    gen_finish_log(&g, dir, "map-log-plain-512.img", 1, NULL, 0, map_blk,
                   G_N_ELEMENTS(map_blk));
}

/*
 * The same, marked corrupt afterwards (log lag bit): a superblock one
 * generation on whose readers replay the chain of the one before
 */
static void seed_map_log_corrupt(const char *dir)
{
    static const uint64_t blk[] = { 60 };
    static const uint64_t map_blk[] = { 3000, 3001, 3900 };
    Gen g;

    gen_start(&g, 2 << 20, 512, 4096, NULL, 13);
    bitmaps_image(&g);
    g.corrupt = true;
    gen_finish_log(&g, dir, "map-log-corrupt-512.img", 1, blk,
                   G_N_ELEMENTS(blk), map_blk, G_N_ELEMENTS(map_blk));
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen-seeds DIR\n");
        return 2;
    }
    g_mkdir_with_parents(argv[1], 0755);
    seed_leaf(argv[1]);
    seed_backing(argv[1]);
    seed_two_levels(argv[1]);
    seed_free_tree(argv[1]);
    seed_three_levels(argv[1]);
    seed_snapshots(argv[1]);
    seed_snap_levels(argv[1]);
    seed_snap_refs(argv[1]);
    seed_bitmaps(argv[1]);
    seed_mark_log(argv[1]);
    seed_map_log(argv[1]);
    seed_map_log_corrupt(argv[1]);
    seed_map_log_plain(argv[1]);
    seed_crypt(argv[1]);
    seed_compressed(argv[1]);
    return 0;
}
