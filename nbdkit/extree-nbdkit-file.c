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
