/*
 * extree nbdkit plugin: the core's backend over the image file
 *
 * A regular file grows by writes past its end and gives space back by
 * punching holes; a block device has a fixed size (the core is told its
 * limit at open) and gives space back by BLKDISCARD.  Reads past the end
 * return zeroes, as QEMU's file protocol.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#define _GNU_SOURCE             /* fallocate */
#define NBDKIT_API_VERSION 2

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>
#include <nbdkit-plugin.h>

#include "extree-nbdkit.h"
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>


/* Defined in the lowest of the plugin's files that use it */
XpState xp = {
    .fd = -1,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .cond = PTHREAD_COND_INITIALIZER,
    .committer_cond = PTHREAD_COND_INITIALIZER,
    .zero_range_ok = true,
};

/* Reads past the end of the file return zeroes, as QEMU's file protocol */
int xp_pread_full(void *buf, uint64_t bytes, uint64_t offset)
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

int xp_pwrite_full(const void *buf, uint64_t bytes, uint64_t offset)
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

int64_t xp_file_length(void)
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

const ExtreeBackendOps xp_backend_ops = {
    .pread = be_pread,
    .pwrite = be_pwrite,
    .flush = be_flush,
    .truncate = be_truncate,
    .discard = be_discard,
    .get_length = be_get_length,
    .pread_many = be_pread_many,
};

/* ---- Image locking, as QEMU's file protocol does it ---- */

/*
 * QEMU (block/file-posix.c) takes a shared OFD lock on byte 100 + bit for
 * each permission it holds and on byte 200 + bit for each it does not
 * share with others; the bits are BLK_PERM_*.  Taking the same locks keeps
 * QEMU and the plugin from writing one image at once: qemu-img refuses an
 * image the plugin serves, and the other way round.
 */
#define XP_LOCK_PERM_BASE       100
#define XP_LOCK_SHARED_BASE     200
#define XP_PERM_CONSISTENT_READ 0x01
#define XP_PERM_WRITE           0x02
#define XP_PERM_WRITE_UNCHANGED 0x04
#define XP_PERM_RESIZE          0x08
#define XP_PERM_BITS            4

static const char *const xp_perm_names[XP_PERM_BITS] = {
    "consistent read", "write", "write unchanged", "resize",
};

/* Does another open file hold byte @off?  0: no, 1: yes, -errno */
static int xp_lock_test(int off)
{
    struct flock fl = {
        .l_whence = SEEK_SET, .l_start = off, .l_len = 1, .l_type = F_WRLCK,
    };

    if (fcntl(xp.fd, F_OFD_GETLK, &fl) < 0) {
        return -errno;
    }
    return fl.l_type != F_UNLCK;
}

static int xp_lock_byte(int off)
{
    struct flock fl = {
        .l_whence = SEEK_SET, .l_start = off, .l_len = 1, .l_type = F_RDLCK,
    };

    return fcntl(xp.fd, F_OFD_SETLK, &fl) < 0 ? -errno : 0;
}

int xp_lock_image(bool write, char **errmsg)
{
    /* what QEMU holds for a format node over a file (bdrv_default_perms) */
    unsigned perm = XP_PERM_CONSISTENT_READ;
    unsigned shared = XP_PERM_CONSISTENT_READ | XP_PERM_WRITE_UNCHANGED;
    int ret;

    if (write) {
        perm |= XP_PERM_WRITE | XP_PERM_WRITE_UNCHANGED | XP_PERM_RESIZE;
    }
    for (int i = 0; i < XP_PERM_BITS; i++) {
        /* another process does not share what we want */
        ret = (perm & (1u << i)) ? xp_lock_test(XP_LOCK_SHARED_BASE + i) : 0;
        if (ret > 0) {
            *errmsg = g_strdup_printf("Failed to get \"%s\" lock: Is another "
                                      "process using the image?",
                                      xp_perm_names[i]);
            return -EAGAIN;
        }
        /* another process holds what we do not share */
        if (ret == 0 && !(shared & (1u << i))) {
            ret = xp_lock_test(XP_LOCK_PERM_BASE + i);
            if (ret > 0) {
                *errmsg = g_strdup_printf("Failed to get shared \"%s\" "
                                          "lock: Is another process using "
                                          "the image?", xp_perm_names[i]);
                return -EAGAIN;
            }
        }
        if (ret < 0) {
            *errmsg = g_strdup_printf("Failed to test the image's locks: %s",
                                      strerror(-ret));
            return ret;
        }
    }
    for (int i = 0; i < XP_PERM_BITS; i++) {
        ret = 0;
        if (perm & (1u << i)) {
            ret = xp_lock_byte(XP_LOCK_PERM_BASE + i);
        }
        if (ret == 0 && !(shared & (1u << i))) {
            ret = xp_lock_byte(XP_LOCK_SHARED_BASE + i);
        }
        if (ret < 0) {
            *errmsg = g_strdup_printf("Failed to lock byte %d: %s",
                                      XP_LOCK_PERM_BASE + i, strerror(-ret));
            return ret;
        }
    }
    return 0;
}
