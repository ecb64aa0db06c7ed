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
 * is parallel; every call into the core is made with xp.lock held (the
 * core is not thread-safe), data I/O mostly without it:
 *
 *   read              lock: look up runs (node reads without the lock, as
 *                     the QEMU driver's no-wait lookups) -> unlock: pread
 *   write in place    lock: look up, unshared DATA -> unlock: pwrite
 *   allocating write  lock held throughout: allocate, read-modify-write
 *                     the first and last block, pwrite, map
 *   trim, zero        lock held throughout (metadata; zeroing in place)
 *   flush, FUA        commit: waits until no request is between its lookup
 *                     and the end of its data I/O (freed host space may be
 *                     reused once the commit is durable)
 *
 * Calls only block/extree/extree.h (the core's public API).
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include <glib.h>
#include <nbdkit-plugin.h>

#include "extree.h"

#define THREAD_MODEL NBDKIT_THREAD_MODEL_PARALLEL

/* Runs looked up per lock hold on the read path (as the QEMU driver) */
#define XP_READ_BATCH           16
/* No-wait lookups of one query before a blocking one (xp_query) */
#define XP_NOWAIT_TRIES         (2 * EXTREE_MAX_LEVELS)
/* Extents answered per call: the client asks again for the rest */
#define XP_EXTENTS_MAX          65536
/* Zeroes written per pwrite when zeroing in place cannot be delegated */
#define XP_ZERO_BUF             (1024 * 1024)
#define XP_DEFAULT_COMMIT_INTERVAL  5           /* seconds, as the driver */

#define XP_ROUND_UP(n, d)       (((n) + (d) - 1) / (d) * (d))
#define XP_ALIGN_DOWN(n, d)     ((n) / (d) * (d))
#define XP_MIN(a, b)            ((a) < (b) ? (a) : (b))

/* ---- State ---- */

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

static struct {
    /* Set by .get_ready (before any connection), constant afterwards */
    int fd;
    bool fd_read_only;              /* the file could not be opened O_RDWR */
    bool is_blk;                    /* a block device: of fixed size */
    ExtreeBackend be;

    /*
     * @lock: every call into the core, and every field below.  Dropped
     * around data I/O and node reads; never held across a wait for
     * anything but @cond.
     */
    pthread_mutex_t lock;
    /* @inflight dropped to 0, or a commit ended */
    pthread_cond_t cond;
    Extree *t;
    bool core_read_only;
    unsigned conns;                 /* open connections */
    /*
     * Requests between their lookup of host ranges and the end of their
     * data I/O without @lock (reads, writes in place): a commit waits
     * until none is left, and @commit_waiting holds new ones back meanwhile.
     */
    unsigned inflight;
    unsigned commit_waiting;
    /* The core reported damage in the call that is returning */
    bool corrupt_pending;
    char *corrupt_msg;
    /* Periodic commits (cfg.commit_interval); @committer_cond: stop */
    pthread_t committer;
    pthread_cond_t committer_cond;
    bool committer_running, committer_stop;
    /* fallocate(FALLOC_FL_ZERO_RANGE) has not failed as unsupported */
    bool zero_range_ok;
} xp = {
    .fd = -1,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .cond = PTHREAD_COND_INITIALIZER,
    .committer_cond = PTHREAD_COND_INITIALIZER,
    .zero_range_ok = true,
};

/* One connection */
typedef struct XpConn {
    /* block status walks forward: one descent per walk (under xp.lock) */
    ExtreeCursor status;
    bool read_only;
} XpConn;

/* ---- Backend: the image file, for the core ---- */

/* Reads past the end of the file return zeroes, as QEMU's file protocol */
static int xp_pread_full(void *buf, uint64_t bytes, uint64_t offset)
{
    uint8_t *out = buf;

    while (bytes > 0) {
        ssize_t n = pread(xp.fd, out, XP_MIN(bytes, (uint64_t)1 << 30),
                          offset);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (n == 0) {
            memset(out, 0, bytes);
            break;
        }
        out += n;
        offset += n;
        bytes -= n;
    }
    return 0;
}

static int xp_pwrite_full(const void *buf, uint64_t bytes, uint64_t offset)
{
    const uint8_t *in = buf;

    while (bytes > 0) {
        ssize_t n = pwrite(xp.fd, in, XP_MIN(bytes, (uint64_t)1 << 30),
                           offset);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        in += n;
        offset += n;
        bytes -= n;
    }
    return 0;
}

static int64_t xp_file_length(void)
{
    struct stat st;
    uint64_t len;

    if (fstat(xp.fd, &st) < 0) {
        return -errno;
    }
    if (!S_ISBLK(st.st_mode)) {
        return st.st_size;
    }
    if (ioctl(xp.fd, BLKGETSIZE64, &len) < 0) {
        return -errno;
    }
    return len;
}

static int be_pread(void *opaque, uint64_t offset, void *buf, uint64_t bytes)
{
    return xp_pread_full(buf, bytes, offset);
}

static int be_pwrite(void *opaque, uint64_t offset, const void *buf,
                     uint64_t bytes)
{
    return xp_pwrite_full(buf, bytes, offset);
}

static int be_flush(void *opaque)
{
    return fdatasync(xp.fd) < 0 ? -errno : 0;
}

static int be_truncate(void *opaque, uint64_t size)
{
    if (xp.is_blk) {
        return -ENOTSUP;
    }
    if (size > INT64_MAX) {
        return -EFBIG;
    }
    return ftruncate(xp.fd, size) < 0 ? -errno : 0;
}

static int be_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    if (xp.is_blk) {
        uint64_t range[2] = { offset, bytes };

        return ioctl(xp.fd, BLKDISCARD, range) < 0 ? -errno : 0;
    }
    if (fallocate(xp.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  offset, bytes) < 0) {
        return -errno;
    }
    return 0;
}

static int64_t be_get_length(void *opaque)
{
    return xp_file_length();
}

/* Readahead of the leaves of a forward walk: one read after another */
static void be_pread_many(void *opaque, int n, const uint64_t *offsets,
                          void *const *bufs, uint64_t bytes, int *rets)
{
    for (int i = 0; i < n; i++) {
        rets[i] = xp_pread_full(bufs[i], bytes, offsets[i]);
    }
}

static const ExtreeBackendOps xp_backend_ops = {
    .pread = be_pread,
    .pwrite = be_pwrite,
    .flush = be_flush,
    .truncate = be_truncate,
    .discard = be_discard,
    .get_length = be_get_length,
    .pread_many = be_pread_many,
};

/* ---- Lock, corruption, commit gate ---- */

/* Called by the core from the call that found the damage (-EIO) */
static void xp_corrupt_cb(void *opaque, uint64_t offset, const char *msg)
{
    if (!xp.corrupt_pending) {
        xp.corrupt_pending = true;
        g_free(xp.corrupt_msg);
        xp.corrupt_msg = g_strdup(msg);
    }
}

/*
 * As qcow2 and the QEMU driver do: the request that hit damage fails with
 * -EIO and its message; a writable image is marked corrupt (the core
 * refuses updates from then on, reads go on).  Called with xp.lock held.
 */
static void xp_handle_corruption(void)
{
    bool fatal;
    int ret;

    if (!xp.corrupt_pending) {
        return;
    }
    xp.corrupt_pending = false;
    fatal = !xp.core_read_only &&
            !(extree_incompat_features(xp.t) & EXTREE_INCOMPAT_CORRUPT);
    nbdkit_error("%s%s", xp.corrupt_msg,
                 fatal ? "; marking the image corrupt" : "");
    if (fatal) {
        ret = extree_mark_corrupt(xp.t);
        if (ret < 0) {
            nbdkit_error("could not mark the image corrupt: %s",
                         strerror(-ret));
        }
    }
}

static void xp_lock(void)
{
    pthread_mutex_lock(&xp.lock);
}

static void xp_unlock(void)
{
    if (xp.corrupt_pending) {
        xp_handle_corruption();
    }
    pthread_mutex_unlock(&xp.lock);
}

/* A request is about to look up host ranges.  Called with xp.lock held */
static void xp_io_begin(void)
{
    while (xp.commit_waiting) {
        pthread_cond_wait(&xp.cond, &xp.lock);
    }
    xp.inflight++;
}

/* Called with xp.lock held */
static void xp_io_end(void)
{
    if (--xp.inflight == 0 && xp.commit_waiting) {
        pthread_cond_broadcast(&xp.cond);
    }
}

/*
 * Commit: wait until no request holds host ranges it looked up, holding
 * new ones back meanwhile.  Called with xp.lock held; drops it while
 * waiting.  The caller must not be counted in xp.inflight.
 */
static int xp_commit_locked(void)
{
    int ret;

    if (xp.core_read_only || !extree_is_dirty(xp.t)) {
        return 0;
    }
    xp.commit_waiting++;
    while (xp.inflight > 0) {
        pthread_cond_wait(&xp.cond, &xp.lock);
    }
    ret = extree_commit(xp.t);
    xp.commit_waiting--;
    pthread_cond_broadcast(&xp.cond);
    if (ret < 0 && !xp.corrupt_pending) {
        nbdkit_error("could not commit metadata: %s", strerror(-ret));
    }
    return ret;
}

/* After an update: commit when the core wants it.  xp.lock held */
static int xp_update_done(void)
{
    if (!xp.core_read_only && extree_commit_wanted(xp.t)) {
        return xp_commit_locked();
    }
    return 0;
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
        if (xp.t && !xp.core_read_only && extree_is_dirty(xp.t) &&
            !extree_is_broken(xp.t)) {
            xp_commit_locked();
        }
    }
    xp_unlock();
    return NULL;
}

/* Set errno for nbdkit from a -errno and return -1 */
static int xp_fail(int ret)
{
    nbdkit_set_error(-ret);
    return -1;
}

/* ---- Lookups ---- */

/*
 * extree_cursor_query() that holds xp.lock across no node read: the
 * no-wait query names the node it misses, which is read without the lock
 * and handed to the core, which validates it when the query asks again.
 * A forward walk's next leaf (missing node 0), a failed read or too many
 * tries go to the blocking query (readahead, usual error reports).
 * Called with xp.lock held; may drop and retake it.
 */
static int xp_query(ExtreeCursor *c, uint64_t guest, uint64_t max_bytes,
                    int coalesce, ExtreeRun *run)
{
    uint32_t ns = extree_node_size(xp.t);
    void *buf = NULL;
    int ret;

    for (int tries = 0; tries < XP_NOWAIT_TRIES; tries++) {
        uint64_t bytenr, epoch;

        ret = extree_cursor_query_nowait(c, guest, max_bytes, coalesce, run);
        if (ret != -EWOULDBLOCK) {
            g_free(buf);
            return ret;
        }
        bytenr = extree_missing_node(xp.t, &epoch);
        if (!bytenr) {
            break;
        }
        if (!buf) {
            buf = g_malloc(ns);
        }
        pthread_mutex_unlock(&xp.lock);
        ret = xp_pread_full(buf, ns, bytenr);
        pthread_mutex_lock(&xp.lock);
        if (ret < 0) {
            break;
        }
        extree_node_prefetch(xp.t, bytenr, epoch, buf);
    }
    g_free(buf);
    return extree_cursor_query(c, guest, max_bytes, coalesce, run);
}

/* ---- Configuration and open ---- */

static void xp_unload(void)
{
    g_free(cfg.file);
    g_free(cfg.snapshot);
    g_free(xp.corrupt_msg);
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

    ret = extree_open(&xp.be, &o, &xp.t, &errmsg);
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
    xp.core_read_only = read_only;
    extree_set_corrupt_handler(xp.t, xp_corrupt_cb, NULL);
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
                         cfg.snapshot, xp.corrupt_msg ? xp.corrupt_msg :
                         strerror(-ret));
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

    ret = extree_create(&xp.be, &p, &errmsg);
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
    xp.be.ops = &xp_backend_ops;
    xp.be.opaque = NULL;

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
            ret = xp_commit_locked();
            if (ret == 0) {
                extree_discard_deferred(xp.t);
            }
        }
        xp_unlock();
        extree_close(xp.t);
        xp.t = NULL;
    }
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

/* ---- Reads ---- */

/*
 * Up to XP_READ_BATCH runs per lock hold, then their reads without the
 * lock.  Holes and ZERO extents read as zeroes (no backing file).
 */
static int xp_pread(void *handle, void *buf, uint32_t count, uint64_t offset,
                    uint32_t flags)
{
    ExtreeRun runs[XP_READ_BATCH];
    uint8_t *out = buf;
    ExtreeCursor cur;
    int ret = 0;

    xp_lock();
    extree_cursor_init(&cur, xp.t);
    while (count > 0) {
        uint64_t pos = offset, left = count;
        int nr = 0;

        xp_io_begin();
        while (nr < XP_READ_BATCH && left > 0) {
            ret = xp_query(&cur, pos, left, EXTREE_COALESCE_HOST, &runs[nr]);
            if (ret < 0) {
                break;
            }
            pos += runs[nr].length;
            left -= runs[nr].length;
            nr++;
        }
        if (ret < 0) {
            xp_io_end();
            break;
        }
        pthread_mutex_unlock(&xp.lock);
        for (int i = 0; i < nr && ret == 0; i++) {
            uint8_t *p = out + (runs[i].guest - offset);

            if (runs[i].type == EXTREE_RUN_DATA) {
                ret = xp_pread_full(p, runs[i].length, runs[i].host);
            } else {
                memset(p, 0, runs[i].length);
            }
        }
        pthread_mutex_lock(&xp.lock);
        xp_io_end();
        if (ret < 0) {
            nbdkit_error("read of the image file failed: %s",
                         strerror(-ret));
            break;
        }
        out += pos - offset;
        count = left;
        offset = pos;
    }
    extree_cursor_release(&cur);
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Writes ---- */

/*
 * Fill @buf with what guest [@guest, + @bytes) reads as now; it lies in a
 * block of @run (possibly outside @run's guest range, in the same block).
 * Bytes past the virtual size read as zeroes.  xp.lock held.
 */
static int xp_read_old(const ExtreeRun *run, uint64_t guest, uint64_t bytes,
                       uint8_t *buf)
{
    uint64_t vsize = extree_virtual_size(xp.t);

    memset(buf, 0, bytes);
    if (run->type != EXTREE_RUN_DATA || guest >= vsize) {
        return 0;
    }
    return xp_pread_full(buf, XP_MIN(bytes, vsize - guest),
                         run->host + guest - run->guest);
}

/*
 * Write guest [@offset, + @n) of @run (a hole, a ZERO extent or DATA a
 * snapshot shares) to new host space together with the rest of its first
 * and last block, then map it.  @data NULL writes zeroes.  *@done: bytes
 * of the request written (the allocation may be shorter).  xp.lock held
 * throughout: no other update, and no commit, runs meanwhile.
 */
static int xp_alloc_write(const ExtreeRun *run, uint64_t offset, uint64_t n,
                          const uint8_t *data, uint64_t *done)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t start = XP_ALIGN_DOWN(offset, bs);
    uint64_t end = XP_ROUND_UP(offset + n, bs);
    uint64_t host, got, head, wlen, tail, pend;
    uint8_t *edge = NULL, *zeroes = NULL;
    int ret;

    ret = extree_alloc_data(xp.t, start, end - start, &host, &got);
    if (ret < 0) {
        return ret;
    }
    pend = start + got;
    head = offset - start;
    wlen = XP_MIN(offset + n, pend) - offset;
    tail = pend - (offset + wlen);

    edge = g_malloc(bs);
    if (head) {
        ret = xp_read_old(run, start, head, edge);
        if (ret == 0) {
            ret = xp_pwrite_full(edge, head, host);
        }
    }
    if (ret == 0 && data) {
        ret = xp_pwrite_full(data, wlen, host + head);
    } else if (ret == 0) {
        zeroes = g_malloc0(XP_MIN(wlen, XP_ZERO_BUF));
        for (uint64_t w = 0; w < wlen && ret == 0; w += XP_ZERO_BUF) {
            ret = xp_pwrite_full(zeroes, XP_MIN(wlen - w, XP_ZERO_BUF),
                                 host + head + w);
        }
    }
    if (ret == 0 && tail) {
        ret = xp_read_old(run, offset + wlen, tail, edge);
        if (ret == 0) {
            ret = xp_pwrite_full(edge, tail, host + head + wlen);
        }
    }
    g_free(edge);
    g_free(zeroes);
    if (ret == 0) {
        /* the data is written: now the mapping may reach a commit */
        ret = extree_map_data(xp.t, start, got, host);
    }
    if (ret < 0) {
        extree_free_data(xp.t, host, got);
        return ret;
    }
    *done = wlen;
    return 0;
}

/*
 * May DATA run @run be changed in place for guest [@offset, + @n)?  Only
 * if no snapshot shares its blocks.  xp.lock held.
 */
static int xp_in_place(const ExtreeRun *run, uint64_t offset, uint64_t n,
                       bool *in_place)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t start = XP_ALIGN_DOWN(offset, bs);
    uint64_t end = XP_ROUND_UP(offset + n, bs);
    bool shared = true;
    int ret = 0;

    *in_place = false;
    if (run->type == EXTREE_RUN_DATA) {
        ret = extree_data_shared(xp.t, start, end - start,
                                 run->host - (offset - start), &shared);
        *in_place = ret == 0 && !shared;
    }
    return ret;
}

/*
 * Write @data (NULL: zeroes) to guest [@offset, + @count): in place into
 * unshared DATA (without the lock), else through xp_alloc_write().  A
 * full device (-ENOSPC) is retried once after a commit: space freed in
 * this transaction is reusable once committed.  xp.lock held.
 */
static int xp_write_locked(const uint8_t *data, uint64_t count,
                           uint64_t offset)
{
    bool committed = false, in_place;
    ExtreeCursor cur;
    int ret = 0;

    extree_cursor_init(&cur, xp.t);
    while (count > 0) {
        ExtreeRun run;
        uint64_t n;

        xp_io_begin();
        ret = extree_cursor_query(&cur, offset, count, EXTREE_COALESCE_HOST,
                                  &run);
        if (ret == 0) {
            ret = xp_in_place(&run, offset, run.length, &in_place);
        }
        if (ret < 0) {
            xp_io_end();
            break;
        }
        n = run.length;
        if (in_place && data) {
            pthread_mutex_unlock(&xp.lock);
            ret = xp_pwrite_full(data, n, run.host);
            pthread_mutex_lock(&xp.lock);
            xp_io_end();
        } else {
            xp_io_end();
            ret = xp_alloc_write(&run, offset, n, data, &n);
            if (ret == -ENOSPC && !committed && extree_is_dirty(xp.t)) {
                committed = true;
                extree_cursor_release(&cur);
                if (xp_commit_locked() == 0) {
                    continue;
                }
                ret = -ENOSPC;
            }
        }
        if (ret < 0) {
            break;
        }
        offset += n;
        count -= n;
        if (data) {
            data += n;
        }
    }
    extree_cursor_release(&cur);
    return ret;
}

/* FUA: a commit if metadata changed, else a flush of the data */
static int xp_fua_locked(void)
{
    if (extree_is_dirty(xp.t)) {
        return xp_commit_locked();
    }
    return fdatasync(xp.fd) < 0 ? -errno : 0;
}

static int xp_pwrite(void *handle, const void *buf, uint32_t count,
                     uint64_t offset, uint32_t flags)
{
    int ret;

    xp_lock();
    ret = xp_write_locked(buf, count, offset);
    if (ret == 0) {
        ret = xp_update_done();
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    if (ret < 0 && !xp.corrupt_pending) {
        nbdkit_error("write failed: %s", strerror(-ret));
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

static int xp_flush(void *handle, uint32_t flags)
{
    int ret;

    xp_lock();
    ret = xp_fua_locked();
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Trim and zero ---- */

/*
 * The whole blocks of guest [@offset, + @count); the partial block at the
 * end of the disk counts as whole when the range reaches the end.  False
 * if there are none.
 */
static bool xp_whole_blocks(uint64_t offset, uint64_t count,
                            uint64_t *start, uint64_t *end)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t vsize = extree_virtual_size(xp.t);

    *start = XP_ROUND_UP(offset, bs);
    if (offset + count >= vsize) {
        *end = XP_ROUND_UP(vsize, bs);
    } else {
        *end = XP_ALIGN_DOWN(offset + count, bs);
    }
    return *start < *end;
}

/* Trim: whole blocks become holes and their space is freed */
static int xp_trim(void *handle, uint32_t count, uint64_t offset,
                   uint32_t flags)
{
    uint64_t start, end;
    int ret = 0;

    xp_lock();
    if (xp_whole_blocks(offset, count, &start, &end)) {
        ret = extree_punch(xp.t, start, end - start);
        if (ret == 0) {
            ret = xp_update_done();
        }
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/*
 * Zero host [@host, + @bytes) of unshared DATA in place: a fallocate
 * where the file system can (a metadata change), else zeroes written
 * (-ENOTSUP instead with @fast).  xp.lock held.
 */
static int xp_zero_host(uint64_t host, uint64_t bytes, bool fast)
{
    uint8_t *zeroes;
    int ret = 0;

    if (!xp.is_blk && xp.zero_range_ok) {
        if (fallocate(xp.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
                      host, bytes) == 0) {
            return 0;
        }
        if (errno == EOPNOTSUPP) {
            xp.zero_range_ok = false;
        }
    }
    if (fast) {
        return -ENOTSUP;
    }
    zeroes = g_malloc0(XP_MIN(bytes, XP_ZERO_BUF));
    for (uint64_t w = 0; w < bytes && ret == 0; w += XP_ZERO_BUF) {
        ret = xp_pwrite_full(zeroes, XP_MIN(bytes - w, XP_ZERO_BUF),
                             host + w);
    }
    g_free(zeroes);
    return ret;
}

/*
 * Zero part of one block, guest [@offset, + @bytes): unshared DATA in
 * place; a hole becomes a ZERO extent (it reads as zeroes already); a
 * ZERO extent stays; shared DATA gets a new block (read-modify-write).
 * xp.lock held.
 */
static int xp_zero_partial(uint64_t offset, uint64_t bytes, bool fast)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t bstart = XP_ALIGN_DOWN(offset, bs);
    ExtreeCursor cur;
    ExtreeRun run;
    bool in_place;
    int ret;

    extree_cursor_init(&cur, xp.t);
    ret = extree_cursor_query(&cur, offset, bytes, EXTREE_COALESCE_HOST,
                              &run);
    extree_cursor_release(&cur);
    if (ret == 0) {
        ret = xp_in_place(&run, offset, bytes, &in_place);
    }
    if (ret < 0) {
        return ret;
    }
    switch (run.type) {
    case EXTREE_RUN_ZERO:
        return 0;
    case EXTREE_RUN_UNALLOC:
        return extree_set_zero(xp.t, bstart, bs);
    default:
        if (in_place) {
            return xp_zero_host(run.host, bytes, false);
        }
        return fast ? -ENOTSUP : xp_write_locked(NULL, bytes, offset);
    }
}

/*
 * Zero whole blocks [@start, @end).  @may_trim: one ZERO extent, space
 * freed.  Without (the client wants the space kept): unshared DATA is
 * zeroed in place, the rest becomes ZERO extents.  xp.lock held.
 */
static int xp_zero_blocks(uint64_t start, uint64_t end, bool may_trim,
                          bool fast)
{
    uint64_t bs = extree_block_size(xp.t);
    ExtreeCursor cur;
    int ret = 0;

    if (may_trim) {
        return extree_set_zero(xp.t, start, end - start);
    }
    extree_cursor_init(&cur, xp.t);
    while (start < end) {
        uint64_t vsize = extree_virtual_size(xp.t), next;
        ExtreeRun run;
        bool in_place;

        if (start >= vsize) {
            break;
        }
        ret = extree_cursor_query(&cur, start, XP_MIN(end, vsize) - start,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret == 0) {
            ret = xp_in_place(&run, start, run.length, &in_place);
        }
        if (ret < 0) {
            break;
        }
        next = XP_ROUND_UP(start + run.length, bs);
        if (run.type == EXTREE_RUN_DATA && in_place) {
            ret = xp_zero_host(run.host, next - start, fast);
        } else if (run.type != EXTREE_RUN_ZERO) {
            ret = extree_set_zero(xp.t, start, next - start);
        }
        if (ret < 0) {
            break;
        }
        start = next;
    }
    extree_cursor_release(&cur);
    return ret;
}

/*
 * NBDKIT_FLAG_FAST_ZERO: can guest [@pos, @stop), whose whole blocks are
 * [@start, @end), be zeroed without writing zeroes?  Asked before anything
 * changes, so that a slow request fails with ENOTSUP having changed
 * nothing.  Slow: shared DATA in a partial block (a new block is written),
 * and unshared DATA in whole blocks without @may_trim where the file
 * system cannot zero a range itself.  xp.lock held.
 */
static int xp_zero_is_fast(uint64_t pos, uint64_t stop, uint64_t start,
                           uint64_t end, bool may_trim, bool *fast)
{
    uint64_t bs = extree_block_size(xp.t);
    uint64_t vsize = extree_virtual_size(xp.t);
    bool delegate = !xp.is_blk && xp.zero_range_ok;
    ExtreeCursor cur;
    int ret = 0;

    *fast = true;
    extree_cursor_init(&cur, xp.t);
    while (*fast && pos < stop && pos < vsize) {
        bool whole = pos >= start && pos < end, in_place;
        uint64_t lim;
        ExtreeRun run;

        if (whole && may_trim) {
            pos = end;
            continue;
        }
        lim = whole ? end : XP_MIN(stop, XP_ALIGN_DOWN(pos, bs) + bs);
        ret = extree_cursor_query(&cur, pos, XP_MIN(lim, vsize) - pos,
                                  EXTREE_COALESCE_HOST, &run);
        if (ret == 0) {
            ret = xp_in_place(&run, pos, run.length, &in_place);
        }
        if (ret < 0) {
            break;
        }
        if (run.type == EXTREE_RUN_DATA) {
            *fast = whole ? !in_place || delegate : in_place;
        }
        pos += run.length;
    }
    extree_cursor_release(&cur);
    return ret;
}

static int xp_zero(void *handle, uint32_t count, uint64_t offset,
                   uint32_t flags)
{
    bool may_trim = flags & NBDKIT_FLAG_MAY_TRIM;
    bool fast = flags & NBDKIT_FLAG_FAST_ZERO;
    uint64_t bs, start, end, pos = offset, stop = offset + count;
    int ret = 0;

    xp_lock();
    bs = extree_block_size(xp.t);
    if (!xp_whole_blocks(offset, count, &start, &end)) {
        start = end = stop;
    }
    if (fast) {
        bool ok;

        ret = xp_zero_is_fast(pos, stop, start, end, may_trim, &ok);
        if (ret == 0 && !ok) {
            ret = -ENOTSUP;
        }
    }
    /* the partial block before the whole ones, then those, then after */
    while (ret == 0 && pos < stop) {
        if (pos == start && start < end) {
            ret = xp_zero_blocks(start, end, may_trim, fast);
            pos = XP_MIN(end, stop);
        } else {
            uint64_t n = XP_MIN(stop, XP_ALIGN_DOWN(pos, bs) + bs) - pos;

            ret = xp_zero_partial(pos, n, fast);
            pos += n;
        }
    }
    if (ret == 0) {
        ret = xp_update_done();
    }
    if (ret == 0 && (flags & NBDKIT_FLAG_FUA)) {
        ret = xp_fua_locked();
    }
    if (ret < 0 && ret != -ENOTSUP && !xp.corrupt_pending) {
        nbdkit_error("zero failed: %s", strerror(-ret));
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
}

/* ---- Block status ---- */

/*
 * The one-pass leaf walk: the connection's cursor continues where its
 * last answer ended.  DATA is data; ZERO extents and holes read as
 * zeroes and need no space (hole | zero).
 */
static int xp_extents(void *handle, uint32_t count, uint64_t offset,
                      uint32_t flags, struct nbdkit_extents *extents)
{
    XpConn *c = handle;
    uint64_t end = offset + count;
    int nr = 0, ret = 0;

    xp_lock();
    while (offset < end && nr < XP_EXTENTS_MAX) {
        ExtreeRun run;
        uint32_t type;

        ret = xp_query(&c->status, offset, end - offset,
                       EXTREE_COALESCE_HOST, &run);
        if (ret < 0) {
            break;
        }
        type = run.type == EXTREE_RUN_DATA ? 0 :
               NBDKIT_EXTENT_HOLE | NBDKIT_EXTENT_ZERO;
        if (nbdkit_add_extent(extents, offset, run.length, type) < 0) {
            ret = errno ? -errno : -EIO;
            break;
        }
        offset += run.length;
        nr++;
        if (flags & NBDKIT_FLAG_REQ_ONE) {
            break;
        }
    }
    xp_unlock();
    return ret < 0 ? xp_fail(ret) : 0;
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
