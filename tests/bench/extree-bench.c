/*
 * extree benchmark: a tree of N extents (default 1 M) on a POSIX file in a
 * temporary directory and on the memory backend
 *
 *   insert    N single-block extents in random order, allocate + map,
 *             commit every 4096 (seconds, one run)
 *   walk      cursor query over the whole image, warm (ns per extent)
 *   lookup    extree_lookup of one block at random offsets, warm (us)
 *   open      close + open, warm page cache (ms)
 *   metadata  on-disk bytes of both trees per extent (checker's count)
 *
 * Walk, lookup and open are the median of --runs runs.  Extents are every
 * other guest block so that none of them merge.  Not a test.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <glib.h>
#include <glib/gstdio.h>

#include "extree.h"
#include "extree-backend.h"

#define COMMIT_EVERY    4096
#define LOOKUPS         200000

typedef struct Options {
    uint64_t extents;
    unsigned runs;
    uint64_t cache_mb, dirty_mb;
    uint32_t block_size, node_size;
    bool csv, mem, file;
    char *dir;
} Options;

typedef struct Result {
    const char *backend;
    double insert_s, walk_ns, lookup_us, open_ms, meta_per_extent;
    double check_s;
    double descents_per_insert, written_per_commit;
    double mib_per_commit, writes_per_commit, discards_per_commit;
    uint64_t extents, nodes, metadata_bytes, commits, forced;
    unsigned depth;
} Result;

static double now(void)
{
    return g_get_monotonic_time() / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static double median(double *v, unsigned n)
{
    qsort(v, n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static uint64_t rng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void die(const char *what, int ret, Extree *t)
{
    fprintf(stderr, "extree-bench: %s: %s%s%s\n", what, g_strerror(-ret),
            t ? ": " : "", t ? extree_last_error(t) : "");
    exit(1);
}

static Extree *bench_open(ExtreeBackend *be, const Options *o)
{
    ExtreeOpenOptions oo = {
        .cache_size = o->cache_mb << 20,
        .dirty_limit = o->dirty_mb << 20,
    };
    char *err = NULL;
    Extree *t;
    int ret = extree_open(be, &oo, &t, &err);

    if (ret < 0) {
        fprintf(stderr, "extree-bench: open: %s\n", err ? err : "");
        exit(1);
    }
    return t;
}

/* Counts the I/O the core does, whatever the backend underneath */
typedef struct CountingBackend {
    ExtreeBackend be;
    ExtreeBackend *inner;
    uint64_t writes, bytes_written, flushes, discards, truncates;
} CountingBackend;

static int cnt_pread(void *opaque, uint64_t offset, void *buf, uint64_t bytes)
{
    CountingBackend *c = opaque;

    return c->inner->ops->pread(c->inner->opaque, offset, buf, bytes);
}

static int cnt_pwrite(void *opaque, uint64_t offset, const void *buf,
                      uint64_t bytes)
{
    CountingBackend *c = opaque;

    c->writes++;
    c->bytes_written += bytes;
    return c->inner->ops->pwrite(c->inner->opaque, offset, buf, bytes);
}

static int cnt_flush(void *opaque)
{
    CountingBackend *c = opaque;

    c->flushes++;
    return c->inner->ops->flush(c->inner->opaque);
}

static int cnt_truncate(void *opaque, uint64_t size)
{
    CountingBackend *c = opaque;

    c->truncates++;
    return c->inner->ops->truncate(c->inner->opaque, size);
}

static int cnt_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    CountingBackend *c = opaque;

    c->discards++;
    return c->inner->ops->discard(c->inner->opaque, offset, bytes);
}

static int64_t cnt_get_length(void *opaque)
{
    CountingBackend *c = opaque;

    return c->inner->ops->get_length(c->inner->opaque);
}

static const ExtreeBackendOps cnt_ops = {
    .pread = cnt_pread,
    .pwrite = cnt_pwrite,
    .flush = cnt_flush,
    .truncate = cnt_truncate,
    .discard = cnt_discard,
    .get_length = cnt_get_length,
};

static void run_backend(ExtreeBackend *inner, const Options *o, Result *res)
{
    CountingBackend cnt = { .be = { &cnt_ops, &cnt }, .inner = inner };
    ExtreeBackend *be = &cnt.be;
    ExtreeCreateParams cp = {
        .virtual_size = 2 * o->extents * o->block_size,
        .block_size = o->block_size,
        .node_size = o->node_size,
    };
    uint64_t bs = o->block_size, n = o->extents;
    uint64_t *order = g_new(uint64_t, n);
    double *samples = g_new(double, o->runs);
    uint64_t rng = 1;
    ExtreeCheckResult cr;
    ExtreeStats st;
    char *err = NULL;
    Extree *t;
    double t0;
    int ret;

    ret = extree_create(be, &cp, &err);
    if (ret < 0) {
        fprintf(stderr, "extree-bench: create: %s\n", err ? err : "");
        exit(1);
    }
    t = bench_open(be, o);

    /* Random order: Fisher-Yates over every other block */
    for (uint64_t i = 0; i < n; i++) {
        order[i] = i;
    }
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = rng_next(&rng) % (i + 1), x = order[i];
        order[i] = order[j];
        order[j] = x;
    }
    t0 = now();
    for (uint64_t i = 0; i < n; i++) {
        uint64_t guest = order[i] * 2 * bs, host, got;

        ret = extree_alloc_data(t, guest, bs, &host, &got);
        if (ret < 0) {
            die("alloc", ret, t);
        }
        ret = extree_map_data(t, guest, got, host);
        if (ret < 0) {
            die("map", ret, t);
        }
        if ((i + 1) % COMMIT_EVERY == 0) {
            ret = extree_commit(t);
            if (ret < 0) {
                die("commit", ret, t);
            }
        }
    }
    ret = extree_commit(t);
    if (ret < 0) {
        die("commit", ret, t);
    }
    res->insert_s = now() - t0;
    extree_stats(t, &st);
    res->commits = st.commits;
    res->forced = st.forced_commits;
    /* Where insert time goes: searches per insert, nodes CoW'd per commit */
    res->descents_per_insert = (double)st.descents / n;
    res->written_per_commit = (double)st.nodes_written / MAX(st.commits, 1);
    res->mib_per_commit = cnt.bytes_written / 1048576.0 / MAX(st.commits, 1);
    res->writes_per_commit = (double)cnt.writes / MAX(st.commits, 1);
    res->discards_per_commit = (double)cnt.discards / MAX(st.commits, 1);
    res->extents = extree_extent_count(t);
    res->depth = extree_depth(t);
    if (res->extents != n) {
        fprintf(stderr, "extree-bench: %" PRIu64 " extents, expected %" PRIu64
                "\n", res->extents, n);
        exit(1);
    }

    /* Forward walk; the first pass warms the cache */
    for (unsigned r = 0; r <= o->runs; r++) {
        ExtreeCursor c;
        ExtreeRun run;
        uint64_t guest = 0, data = 0;

        extree_cursor_init(&c, t);
        t0 = now();
        while (guest < cp.virtual_size) {
            ret = extree_cursor_query(&c, guest, cp.virtual_size - guest,
                                      EXTREE_COALESCE_HOST, &run);
            if (ret < 0) {
                die("query", ret, t);
            }
            data += run.type == EXTREE_RUN_DATA;
            guest += run.length;
        }
        if (r > 0) {
            samples[r - 1] = (now() - t0) * 1e9 / n;
        }
        extree_cursor_release(&c);
        if (data != n) {
            fprintf(stderr, "extree-bench: walk found %" PRIu64 " extents\n",
                    data);
            exit(1);
        }
    }
    res->walk_ns = median(samples, o->runs);

    /* Random point lookups, warm after the walk */
    for (unsigned r = 0; r < o->runs; r++) {
        ExtreeRun run;
        int nruns;

        t0 = now();
        for (unsigned i = 0; i < LOOKUPS; i++) {
            uint64_t guest = (rng_next(&rng) % (2 * n)) * bs;
            ret = extree_lookup(t, guest, bs, &run, 1, &nruns);
            if (ret < 0 || nruns != 1) {
                die("lookup", ret, t);
            }
        }
        samples[r] = (now() - t0) * 1e6 / LOOKUPS;
    }
    res->lookup_us = median(samples, o->runs);

    t0 = now();
    ret = extree_check(t, false, &cr, NULL, NULL);
    res->check_s = now() - t0;
    if (ret < 0 || cr.corruptions || cr.leaks) {
        fprintf(stderr, "extree-bench: check: %d, %" PRIu64 " corruptions, %"
                PRIu64 " leaks\n", ret, cr.corruptions, cr.leaks);
        exit(1);
    }
    res->nodes = cr.nodes;
    res->metadata_bytes = cr.metadata_bytes;
    res->meta_per_extent = (double)cr.metadata_bytes / n;

    /* Open: close and open again, warm */
    for (unsigned r = 0; r < o->runs; r++) {
        extree_close(t);
        t0 = now();
        t = bench_open(be, o);
        samples[r] = (now() - t0) * 1e3;
    }
    res->open_ms = median(samples, o->runs);

    extree_close(t);
    g_free(order);
    g_free(samples);
}

static void print_table(const Options *o, const Result *res, int nres)
{
    printf("extree-bench: %" PRIu64 " extents, block %u, node %u, cache %"
           PRIu64 " MiB, dirty limit %" PRIu64 " MiB, median of %u runs\n\n",
           o->extents, o->block_size, o->node_size, o->cache_mb, o->dirty_mb,
           o->runs);
    printf("%-34s", "");
    for (int i = 0; i < nres; i++) {
        printf("%14s", res[i].backend);
    }
    printf("%14s\n", "target");

#define ROW(label, field, fmt, target) do {                                 \
        printf("%-34s", label);                                             \
        for (int i_ = 0; i_ < nres; i_++) {                                 \
            printf(fmt, res[i_].field);                                     \
        }                                                                   \
        printf("%14s\n", target);                                           \
    } while (0)

    ROW("insert random, commit/4096 (s)", insert_s, "%14.2f", "<= 5");
    ROW("forward walk warm (ns/extent)", walk_ns, "%14.1f", "<= 50");
    ROW("random lookup warm (us)", lookup_us, "%14.3f", "<= 1");
    ROW("open (ms)", open_ms, "%14.3f", "<= 5");
    ROW("metadata (bytes/extent)", meta_per_extent, "%14.1f", "<= 64");
    ROW("check (s)", check_s, "%14.2f", "");
    ROW("depth", depth, "%14u", "");
    ROW("nodes", nodes, "%14" PRIu64, "");
    ROW("insert: descents per insert", descents_per_insert, "%14.2f", "");
    ROW("insert: nodes written per commit", written_per_commit, "%14.0f",
        "");
    ROW("insert: MiB written per commit", mib_per_commit, "%14.1f", "");
    ROW("insert: pwrites per commit", writes_per_commit, "%14.0f", "");
    ROW("insert: discards per commit", discards_per_commit, "%14.0f", "");
    ROW("commits", commits, "%14" PRIu64, "");
    ROW("forced commits", forced, "%14" PRIu64, "");
#undef ROW
}

static void print_csv(const Options *o, const Result *res, int nres)
{
    printf("backend,extents,insert_s,walk_ns_per_extent,lookup_us,open_ms,"
           "metadata_bytes_per_extent,check_s,depth,nodes,commits,"
           "forced_commits,descents_per_insert,nodes_written_per_commit,"
           "mib_written_per_commit,pwrites_per_commit,discards_per_commit\n");
    for (int i = 0; i < nres; i++) {
        const Result *r = &res[i];
        printf("%s,%" PRIu64 ",%.3f,%.2f,%.4f,%.4f,%.2f,%.3f,%u,%" PRIu64
               ",%" PRIu64 ",%" PRIu64 ",%.2f,%.0f,%.2f,%.0f,%.0f\n",
               r->backend, o->extents, r->insert_s, r->walk_ns, r->lookup_us,
               r->open_ms, r->meta_per_extent, r->check_s, r->depth,
               r->nodes, r->commits, r->forced, r->descents_per_insert,
               r->written_per_commit, r->mib_per_commit,
               r->writes_per_commit, r->discards_per_commit);
    }
}

int main(int argc, char **argv)
{
    Options o = {
        .extents = 1 << 20, .runs = 5, .cache_mb = 256, .dirty_mb = 256,
        .block_size = 4096, .node_size = 16384,
    };
    gint64 extents = o.extents, runs = o.runs, cache = o.cache_mb;
    gint64 dirty = o.dirty_mb, block = o.block_size, node = o.node_size;
    gchar *backend = NULL;
    gboolean keep = false, csv = false;
    GOptionEntry entries[] = {
        { "extents", 'n', 0, G_OPTION_ARG_INT64, &extents,
          "Extents in the tree (default 1048576)", "N" },
        { "runs", 'r', 0, G_OPTION_ARG_INT64, &runs,
          "Runs of each cheap measurement (default 5)", "R" },
        { "csv", 0, 0, G_OPTION_ARG_NONE, &csv, "Print CSV", NULL },
        { "backend", 'b', 0, G_OPTION_ARG_STRING, &backend,
          "mem, file or both (default)", "B" },
        { "dir", 'd', 0, G_OPTION_ARG_FILENAME, &o.dir,
          "Directory for the image file (default: a new one in /tmp)",
          "DIR" },
        { "keep", 0, 0, G_OPTION_ARG_NONE, &keep,
          "Keep the image file", NULL },
        { "cache-mb", 0, 0, G_OPTION_ARG_INT64, &cache,
          "Node cache (default 256)", "MB" },
        { "dirty-mb", 0, 0, G_OPTION_ARG_INT64, &dirty,
          "Dirty limit (default 256: only the explicit commits)", "MB" },
        { "block-size", 0, 0, G_OPTION_ARG_INT64, &block,
          "Block size (default 4096)", "B" },
        { "node-size", 0, 0, G_OPTION_ARG_INT64, &node,
          "Node size (default 16384)", "B" },
        { NULL },
    };
    GOptionContext *ctx = g_option_context_new("- extree benchmark");
    GError *gerr = NULL;
    Result res[2];
    int nres = 0;
    char *tmpdir = NULL, *path = NULL;

    g_option_context_add_main_entries(ctx, entries, NULL);
    if (!g_option_context_parse(ctx, &argc, &argv, &gerr)) {
        fprintf(stderr, "extree-bench: %s\n", gerr->message);
        return 2;
    }
    g_option_context_free(ctx);
    if (extents < 1 || runs < 1 || cache < 0 || dirty < 0) {
        fprintf(stderr, "extree-bench: bad option value\n");
        return 2;
    }
    o.csv = csv;
    o.extents = extents;
    o.runs = runs;
    o.cache_mb = cache;
    o.dirty_mb = dirty;
    o.block_size = block;
    o.node_size = node;
    o.mem = !backend || !strcmp(backend, "mem") || !strcmp(backend, "both");
    o.file = !backend || !strcmp(backend, "file") || !strcmp(backend, "both");
    if (!o.mem && !o.file) {
        fprintf(stderr, "extree-bench: --backend: mem, file or both\n");
        return 2;
    }

    if (o.file) {
        ExtreeBackend *be;
        char *err = NULL;

        if (!o.dir) {
            tmpdir = g_dir_make_tmp("extree-bench-XXXXXX", NULL);
            if (!tmpdir) {
                fprintf(stderr, "extree-bench: cannot make a temporary "
                        "directory\n");
                return 1;
            }
        }
        path = g_build_filename(o.dir ? o.dir : tmpdir, "bench.extree", NULL);
        be = extree_posix_backend_open(path, true, &err);
        if (!be) {
            fprintf(stderr, "extree-bench: %s\n", err);
            return 1;
        }
        res[nres].backend = "file";
        run_backend(be, &o, &res[nres++]);
        extree_posix_backend_close(be);
        if (!keep) {
            g_unlink(path);
        } else {
            fprintf(stderr, "extree-bench: image kept in %s\n", path);
        }
        if (tmpdir && !keep) {
            g_rmdir(tmpdir);
        }
    }
    if (o.mem) {
        ExtreeBackend *be = extree_mem_backend_new();

        res[nres].backend = "mem";
        run_backend(be, &o, &res[nres++]);
        extree_mem_backend_free(be);
    }

    if (o.csv) {
        print_csv(&o, res, nres);
    } else {
        print_table(&o, res, nres);
    }
    g_free(path);
    g_free(tmpdir);
    g_free(backend);
    g_free(o.dir);
    return 0;
}
