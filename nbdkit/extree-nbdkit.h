/*
 * extree nbdkit plugin: state shared by its three files
 *
 *   extree-nbdkit.c       the plugin table, parameters, open and close of
 *                         the image and of connections, periodic commits
 *   extree-nbdkit-io.c    xp.lock and the commit gate, commits, the
 *                         corruption helper, reads, writes, flush, trim,
 *                         zero and block status
 *   extree-nbdkit-file.c  the core's backend over the image file
 *
 * Calls go one way only: extree-nbdkit.c -> extree-nbdkit-io.c ->
 * extree-nbdkit-file.c, and all three -> the core's public API
 * (block/extree/extree.h, nothing below it).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef EXTREE_NBDKIT_H
#define EXTREE_NBDKIT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "extree.h"
#include "extree-backend.h"

#define XP_ROUND_UP(n, d)       (((n) + (d) - 1) / (d) * (d))
#define XP_ALIGN_DOWN(n, d)     ((n) / (d) * (d))
#define XP_MIN(a, b)            ((a) < (b) ? (a) : (b))

/* The one image every connection serves */
typedef struct XpState {
    /* Set by .get_ready (before any connection), constant afterwards */
    int fd;
    bool fd_read_only;              /* the file could not be opened O_RDWR */
    bool is_blk;                    /* a block device: of fixed size */
    /* the core's POSIX backend over @fd (extree_posix_backend_wrap()) */
    ExtreeBackend *be;

    /*
     * @lock: every call into the core, and every field below.  Dropped
     * around data I/O and node reads; never held across a wait for
     * anything but @cond (or @committer_cond, by the committer).
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
    /* Periodic commits (extree-nbdkit.c); @committer_cond: stop */
    pthread_t committer;
    pthread_cond_t committer_cond;
    bool committer_running, committer_stop;
    /* fallocate(FALLOC_FL_ZERO_RANGE) has not failed as unsupported */
    bool zero_range_ok;
    /* A block device's size as the core knows it (its host limit) */
    int64_t blk_size;
    /*
     * Mark log group commit (xp_mark_log(), as the driver's): ranges
     * waiting for a record, the batch the next record takes, the last
     * batch whose record was written (or failed), whether a thread writes
     * one; @mark_cond: a record was written.  One record at a time, in
     * slot order (spec: Mark log, 2).
     */
    ExtreeMarkRange mark_pending[EXTREE_MARK_LOG_RANGES];
    unsigned mark_npending;
    uint64_t mark_batch, mark_done;
    bool mark_busy;
    pthread_cond_t mark_cond;
} XpState;

extern XpState xp;

/* One connection */
typedef struct XpConn {
    /* block status walks forward: one descent per walk (under xp.lock) */
    ExtreeCursor status;
    bool read_only;
} XpConn;

/* ---- extree-nbdkit-file.c ---- */

/* Whole reads (zeroes past the end of the file) and writes of xp.fd */
static inline int xp_pread_full(void *buf, uint64_t bytes, uint64_t offset)
{
    return xp.be->ops->pread(xp.be->opaque, offset, buf, bytes);
}

static inline int xp_pwrite_full(const void *buf, uint64_t bytes,
                                 uint64_t offset)
{
    return xp.be->ops->pwrite(xp.be->opaque, offset, buf, bytes);
}

/* The file's length, or a block device's size; -errno */
static inline int64_t xp_file_length(void)
{
    return xp.be->ops->get_length(xp.be->opaque);
}
/*
 * Take QEMU's locks for an image opened read-only or (@write) read/write;
 * -EAGAIN with QEMU's message in *@errmsg if another process (QEMU, another
 * nbdkit) holds it in a way that conflicts.  Kept until xp.fd is closed.
 */
int xp_lock_image(bool write, char **errmsg);

/* ---- extree-nbdkit-io.c ---- */

void xp_lock(void);
/* Reports corruption the core found meanwhile, then unlocks */
void xp_unlock(void);
int xp_commit_locked(void);

struct nbdkit_extents;
int xp_pread(void *handle, void *buf, uint32_t count, uint64_t offset,
             uint32_t flags);
int xp_pwrite(void *handle, const void *buf, uint32_t count,
              uint64_t offset, uint32_t flags);
int xp_flush(void *handle, uint32_t flags);
int xp_trim(void *handle, uint32_t count, uint64_t offset, uint32_t flags);
int xp_zero(void *handle, uint32_t count, uint64_t offset, uint32_t flags);
int xp_extents(void *handle, uint32_t count, uint64_t offset,
               uint32_t flags, struct nbdkit_extents *extents);

#endif /* EXTREE_NBDKIT_H */
