/*
 * extree nbdkit plugin: the image file: its state, and QEMU's locks
 *
 * Its I/O is the core's POSIX backend over xp.fd
 * (extree_posix_backend_wrap(): a regular file grows by writes past its
 * end and gives space back by punching holes; a block device has a fixed
 * size, the core is told its limit at open, and gives space back by
 * BLKDISCARD).
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
#include <sys/stat.h>


/* Defined in the lowest of the plugin's files that use it */
XpState xp = {
    .fd = -1,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .cond = PTHREAD_COND_INITIALIZER,
    .committer_cond = PTHREAD_COND_INITIALIZER,
    .zero_range_ok = true,
    .mark_batch = 1,
    .mark_cond = PTHREAD_COND_INITIALIZER,
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
