/*
 * extree: nbdkit plugin over the QEMU-independent core
 *
 * Serves an extree image to any NBD client (a distribution's own QEMU,
 * libguestfs, nbdcopy, fio) without QEMU's block layer:
 *
 *   nbdkit .../nbdkit-extree-plugin.so file=disk.extree [snapshot=NAME]
 *
 * One core handle (Extree) serves every connection, so a flush from any
 * of them commits the writes of all: multi-conn is safe.  The thread model
 * is parallel (extree-nbdkit-io.c says what runs with the lock).  This
 * file: the plugin table, its parameters, the image's open (read-only at
 * startup, read/write at the first writable connection) and close,
 * connections, and the periodic commits.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#define _GNU_SOURCE             /* fallocate */
#define NBDKIT_API_VERSION 2

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

#include <glib.h>
#include <nbdkit-plugin.h>

#include "extree-nbdkit.h"

#define THREAD_MODEL NBDKIT_THREAD_MODEL_PARALLEL

#define XP_DEFAULT_COMMIT_INTERVAL  5           /* seconds, as the driver */

/* Parameters: set by .config, read-only from .config_complete on */
static struct {
    char *file;
    char *snapshot;                 /* export this one, read-only */
    bool create;
    int64_t size;                   /* create=true: virtual size */
    uint32_t block_size, node_size; /* create=true: 0 = default */
    uint64_t cache_size;            /* 0 = the core's default */
    unsigned commit_interval;       /* seconds, 0 = only on flush */
} cfg = {
    .commit_interval = XP_DEFAULT_COMMIT_INTERVAL,
};

/* nbdkit -D extree.trace=1: the core's trace points as debug messages */
NBDKIT_DLL_PUBLIC int extree_debug_trace;

static void xp_trace(void *opaque, ExtreeTraceEvent ev, uint64_t a,
                     uint64_t b, uint64_t c)
{
    static const char *const what[] = {
        [EXTREE_TRACE_ALLOC_DATA] = "alloc data: guest, bytes, host",
        [EXTREE_TRACE_ALLOC_NODE] = "alloc node: host",
        [EXTREE_TRACE_FREE] = "free: host, bytes, node",
        [EXTREE_TRACE_COMMIT_STEP] = "commit step: generation, step",
        [EXTREE_TRACE_COMMIT_DONE] = "commit done: generation, -, ret",
        [EXTREE_TRACE_BITMAP_SYNC] = "bitmap sync: index, bits set, changed",
        [EXTREE_TRACE_ROLLBACK] = "rollback: generation, -, ret",
        [EXTREE_TRACE_MARK_LOG] = "mark log: generation, record, ranges",
    };

    if (ev == EXTREE_TRACE_COMMIT_DONE || ev == EXTREE_TRACE_ROLLBACK) {
        nbdkit_debug("extree %s %" PRIu64 " - %" PRId64, what[ev], a,
                     (int64_t)c);
    } else {
        nbdkit_debug("extree %s 0x%" PRIx64 " 0x%" PRIx64 " 0x%" PRIx64,
                     ev < G_N_ELEMENTS(what) ? what[ev] : "?", a, b, c);
    }
}

/* Periodic commits, so that unflushed writes reach the disk too */
static void *xp_committer(void *arg)
{
    struct timespec ts;

    xp_lock();
    clock_gettime(CLOCK_REALTIME, &ts);
    while (!xp.committer_stop) {
        ts.tv_sec += cfg.commit_interval;
        while (!xp.committer_stop &&
               pthread_cond_timedwait(&xp.committer_cond, &xp.lock,
                                      &ts) != ETIMEDOUT) {
            /* woken early: wait for the stop or the deadline */
        }
        if (xp.committer_stop) {
            break;
        }
        if (xp.t && !xp.core_read_only && !extree_is_broken(xp.t)) {
            /* marks only the mark log holds are stored now too */
            extree_mark_log_checkpoint(xp.t);
            if (extree_is_dirty(xp.t)) {
                xp_commit_locked();
            }
        }
    }
    xp_unlock();
    return NULL;
}

/* ---- Configuration and open ---- */

static void xp_unload(void)
{
    g_free(cfg.file);
    g_free(cfg.snapshot);
}

static int xp_parse_u32_size(const char *key, const char *value,
                             uint32_t *out)
{
    int64_t v = nbdkit_parse_size(value);

    if (v < 0) {
        return -1;
    }
    if (v == 0 || v > UINT32_MAX) {
        nbdkit_error("%s: %s is out of range", key, value);
        return -1;
    }
    *out = v;
    return 0;
}

static int xp_config(const char *key, const char *value)
{
    int r;

    if (strcmp(key, "file") == 0) {
        g_free(cfg.file);
        /* not nbdkit_realpath(): create=true makes a file that is not there */
        cfg.file = nbdkit_absolute_path(value);
        return cfg.file ? 0 : -1;
    } else if (strcmp(key, "snapshot") == 0) {
        g_free(cfg.snapshot);
        cfg.snapshot = g_strdup(value);
        return 0;
    } else if (strcmp(key, "create") == 0) {
        r = nbdkit_parse_bool(value);
        if (r < 0) {
            return -1;
        }
        cfg.create = r;
        return 0;
    } else if (strcmp(key, "size") == 0) {
        cfg.size = nbdkit_parse_size(value);
        return cfg.size < 0 ? -1 : 0;
    } else if (strcmp(key, "block-size") == 0) {
        return xp_parse_u32_size(key, value, &cfg.block_size);
    } else if (strcmp(key, "node-size") == 0) {
        return xp_parse_u32_size(key, value, &cfg.node_size);
    } else if (strcmp(key, "cache-size") == 0) {
        int64_t v = nbdkit_parse_size(value);

        if (v < 0) {
            return -1;
        }
        cfg.cache_size = v;
        return 0;
    } else if (strcmp(key, "commit-interval") == 0) {
        return nbdkit_parse_unsigned(key, value, &cfg.commit_interval);
    }
    nbdkit_error("unknown parameter '%s'", key);
    return -1;
}

static int xp_config_complete(void)
{
    if (!cfg.file) {
        nbdkit_error("you must supply the file=<IMAGE> parameter");
        return -1;
    }
    if (cfg.create && cfg.size <= 0) {
        nbdkit_error("create=true needs size=<SIZE>");
        return -1;
    }
    if (!cfg.create && (cfg.size || cfg.block_size || cfg.node_size)) {
        nbdkit_error("size, block-size and node-size are only for "
                     "create=true");
        return -1;
    }
    if (cfg.create && cfg.snapshot) {
        nbdkit_error("a new image has no snapshot to export");
        return -1;
    }
    return 0;
}

/* Open the core handle (xp.t), read-only or not.  xp.lock held or idle */
static int xp_open_core(bool read_only)
{
    ExtreeOpenOptions o = {
        .read_only = read_only,
        .cache_size = cfg.cache_size,
        .commit_by_caller = true,
    };
    char *errmsg = NULL;
    const char *warn;
    int ret, idx;

    ret = xp_lock_image(!read_only, &errmsg);
    if (ret < 0) {
        nbdkit_error("%s: %s", cfg.file, errmsg);
        g_free(errmsg);
        xp.t = NULL;
        return -1;
    }
    ret = extree_open(xp.be, &o, &xp.t, &errmsg);
    if (ret < 0) {
        if (ret == -EACCES && !read_only) {
            nbdkit_error("%s: image is marked corrupt and cannot be opened "
                         "read/write (serve it read-only with nbdkit -r, "
                         "repair it with qemu-img check -r all)%s%s",
                         cfg.file, errmsg ? ": " : "", errmsg ? errmsg : "");
        } else {
            nbdkit_error("%s: %s", cfg.file,
                         errmsg ? errmsg : strerror(-ret));
        }
        g_free(errmsg);
        xp.t = NULL;
        return -1;
    }
    warn = extree_open_warning(xp.t);
    if (warn) {
        nbdkit_debug("%s: %s", cfg.file, warn);
    }
    /*
     * Guest data of an encrypted image is LUKS ciphertext: refuse before
     * anything is served or changed (nothing was written: open does not
     * write, and the handle is closed without a commit)
     */
    if (extree_crypt_method(xp.t) != EXTREE_CRYPT_NONE) {
        nbdkit_error("%s: the image is encrypted (LUKS); the extree plugin "
                     "cannot decrypt it: export it with qemu-nbd or "
                     "qemu-storage-daemon and --object secret", cfg.file);
        goto fail;
    }
    /*
     * Compressed extents are read (decompressed) here; a write into one
     * rewrites it, which only QEMU's driver does
     */
    if (!read_only &&
        (extree_incompat_features(xp.t) & EXTREE_INCOMPAT_COMPRESSED)) {
        nbdkit_error("%s: the image has compressed extents, which the extree "
                     "plugin serves read-only: add readonly=true (nbdkit "
                     "-r), or export it writable with qemu-nbd or "
                     "qemu-storage-daemon", cfg.file);
        goto fail;
    }
    xp.core_read_only = read_only;
    if (extree_debug_trace) {
        extree_set_trace(xp.t, xp_trace, NULL);
    }
    if (extree_backing_file(xp.t)) {
        nbdkit_error("%s: the image has a backing file (%s), which this "
                     "plugin cannot open: serve it with qemu-nbd, or make "
                     "it stand-alone first (qemu-img convert -O extree)",
                     cfg.file, extree_backing_file(xp.t));
        goto fail;
    }
    if (xp.is_blk && !read_only) {
        int64_t len = xp_file_length();

        if (len < 0) {
            nbdkit_error("%s: %s", cfg.file, strerror(-len));
            goto fail;
        }
        extree_set_host_limit(xp.t, len);
        xp.blk_size = len;
    }
    if (cfg.snapshot) {
        idx = extree_snapshot_find(xp.t, cfg.snapshot);
        if (idx < 0) {
            nbdkit_error("%s: no snapshot with id or name '%s'", cfg.file,
                         cfg.snapshot);
            goto fail;
        }
        ret = extree_snapshot_load_tmp(xp.t, idx);
        if (ret < 0) {
            nbdkit_error("%s: could not load snapshot '%s': %s", cfg.file,
                         cfg.snapshot, extree_corruption_pending(xp.t) ?
                         extree_last_error(xp.t) : strerror(-ret));
            goto fail;
        }
    }
    return 0;

fail:
    extree_close(xp.t);
    xp.t = NULL;
    return -1;
}

static int xp_create_image(void)
{
    ExtreeCreateParams p = {
        .virtual_size = cfg.size,
        .block_size = cfg.block_size,
        .node_size = cfg.node_size,
    };
    char *errmsg = NULL;
    int ret;

    ret = extree_create(xp.be, &p, &errmsg);
    if (ret < 0) {
        nbdkit_error("%s: could not create the image: %s", cfg.file,
                     errmsg ? errmsg : strerror(-ret));
        g_free(errmsg);
        return -1;
    }
    return 0;
}

/*
 * Before the first connection (and before nbdkit forks into the
 * background, so errors reach the command line): open the file, create
 * the image if asked, open it read-only to report damage now.  The first
 * connection reopens it read/write unless nbdkit -r.
 */
static int xp_get_ready(void)
{
    char *errmsg = NULL;
    bool existed;
    struct stat st;
    int flags = O_RDWR | O_CLOEXEC;

    existed = stat(cfg.file, &st) == 0;
    if (cfg.create && existed && S_ISREG(st.st_mode) && st.st_size > 0) {
        nbdkit_error("%s: the file exists: create=true makes a new image "
                     "only in a new or empty file", cfg.file);
        return -1;
    }
    if (cfg.create && !existed) {
        flags |= O_CREAT | O_EXCL;
    }
    if (cfg.snapshot) {
        flags = O_RDONLY | O_CLOEXEC;
    }
    xp.fd = open(cfg.file, flags, 0644);
    if (xp.fd < 0 && !cfg.create && (errno == EACCES || errno == EROFS ||
                                     errno == EPERM)) {
        xp.fd = open(cfg.file, O_RDONLY | O_CLOEXEC);
        xp.fd_read_only = true;
    } else if (cfg.snapshot) {
        xp.fd_read_only = true;
    }
    if (xp.fd < 0) {
        nbdkit_error("%s: %m", cfg.file);
        return -1;
    }
    if (fstat(xp.fd, &st) < 0) {
        nbdkit_error("%s: %m", cfg.file);
        return -1;
    }
    xp.is_blk = S_ISBLK(st.st_mode);
    xp.be = extree_posix_backend_wrap(xp.fd);

    if (cfg.create && xp_lock_image(true, &errmsg) < 0) {
        nbdkit_error("%s: %s", cfg.file, errmsg);
        g_free(errmsg);
        return -1;
    }
    if (cfg.create && xp_create_image() < 0) {
        if (!existed) {
            unlink(cfg.file);
        }
        return -1;
    }
    return xp_open_core(true);
}

static int xp_after_fork(void)
{
    int err;

    if (cfg.commit_interval == 0 || xp.fd_read_only) {
        return 0;
    }
    err = pthread_create(&xp.committer, NULL, xp_committer, NULL);
    if (err) {
        nbdkit_error("pthread_create: %s", strerror(err));
        return -1;
    }
    xp.committer_running = true;
    return 0;
}

/* After the last connection: commit, stop the committer, close */
static void xp_cleanup(void)
{
    int ret;

    xp_lock();
    xp.committer_stop = true;
    pthread_cond_broadcast(&xp.committer_cond);
    xp_unlock();
    if (xp.committer_running) {
        pthread_join(xp.committer, NULL);
    }
    if (xp.t) {
        xp_lock();
        if (!xp.core_read_only && !extree_is_broken(xp.t)) {
            extree_mark_log_checkpoint(xp.t);
            ret = xp_commit_locked();
            if (ret == 0) {
                extree_discard_deferred(xp.t);
            }
        }
        xp_unlock();
        extree_close(xp.t);
        xp.t = NULL;
    }
    extree_posix_backend_close(xp.be);
    xp.be = NULL;
    if (xp.fd >= 0) {
        close(xp.fd);
        xp.fd = -1;
    }
}

static void *xp_open(int readonly)
{
    XpConn *c;

    xp_lock();
    if (!readonly && xp.t && xp.core_read_only && !xp.fd_read_only &&
        xp.conns == 0) {
        /* the first writable connection: reopen read/write */
        extree_close(xp.t);
        if (xp_open_core(false) < 0) {
            /* refused (the message is out): this open fails, -r works */
            xp_open_core(true);
            xp_unlock();
            return NULL;
        }
    }
    if (!xp.t && xp_open_core(true) < 0) {
        xp_unlock();
        return NULL;
    }
    c = g_new0(XpConn, 1);
    c->read_only = readonly || xp.core_read_only;
    extree_cursor_init(&c->status, xp.t);
    xp.conns++;
    xp_unlock();
    return c;
}

static void xp_close(void *handle)
{
    XpConn *c = handle;

    xp_lock();
    extree_cursor_release(&c->status);
    if (--xp.conns == 0 && !xp.core_read_only &&
        !extree_is_broken(xp.t)) {
        /* a client that left without a flush: what it wrote is kept */
        xp_commit_locked();
    }
    xp_unlock();
    g_free(c);
}

static int64_t xp_get_size(void *handle)
{
    int64_t size;

    xp_lock();
    size = extree_virtual_size(xp.t);
    xp_unlock();
    return size;
}

static int xp_can_write(void *handle)
{
    XpConn *c = handle;

    return !c->read_only;
}

static int xp_can_true(void *handle)
{
    return 1;
}

static int xp_can_fua(void *handle)
{
    return NBDKIT_FUA_NATIVE;
}

static int xp_is_rotational(void *handle)
{
    return 0;
}

static int xp_block_size(void *handle, uint32_t *minimum,
                         uint32_t *preferred, uint32_t *maximum)
{
    uint32_t bs;

    xp_lock();
    bs = extree_block_size(xp.t);
    xp_unlock();
    *minimum = 1;
    *preferred = bs > 4096 ? bs : 4096;
    if (*preferred > 2 * 1024 * 1024) {
        *preferred = 2 * 1024 * 1024;
    }
    *maximum = 0xffffffff;
    return 0;
}
/* ---- Registration ---- */

static void xp_dump_plugin(void)
{
    printf("extree_format_version=%d\n", EXTREE_VERSION);
}

#define xp_config_help \
    "file=<IMAGE>        (required) The extree image file or block device.\n" \
    "snapshot=<ID|NAME>  Export this internal snapshot, read-only.\n" \
    "create=true         Make a new image in a new or empty file first.\n" \
    "size=<SIZE>         create=true: its virtual size.\n" \
    "block-size=<SIZE>   create=true: its block size (default 4096).\n" \
    "node-size=<SIZE>    create=true: its tree node size (default 16384).\n" \
    "cache-size=<SIZE>   Tree node cache (default 32M).\n" \
    "commit-interval=<S> Commit unflushed writes after S seconds (default " \
    "5, 0: only on flush)."

static struct nbdkit_plugin plugin = {
    .name = "extree",
    .longname = "extree disk image plugin",
    .version = "0.1",
    .description = "Serves extree disk images (copy-on-write extent tree "
                   "format) without QEMU",
    .unload = xp_unload,
    .config = xp_config,
    .config_complete = xp_config_complete,
    .config_help = xp_config_help,
    .magic_config_key = "file",
    .dump_plugin = xp_dump_plugin,
    .get_ready = xp_get_ready,
    .after_fork = xp_after_fork,
    .cleanup = xp_cleanup,
    .open = xp_open,
    .close = xp_close,
    .get_size = xp_get_size,
    .block_size = xp_block_size,
    .can_write = xp_can_write,
    .can_flush = xp_can_true,
    .can_trim = xp_can_true,
    .can_zero = xp_can_true,
    .can_fast_zero = xp_can_true,
    .can_fua = xp_can_fua,
    .can_multi_conn = xp_can_true,
    .can_extents = xp_can_true,
    .is_rotational = xp_is_rotational,
    .pread = xp_pread,
    .pwrite = xp_pwrite,
    .flush = xp_flush,
    .trim = xp_trim,
    .zero = xp_zero,
    .extents = xp_extents,
};

NBDKIT_REGISTER_PLUGIN(plugin)
