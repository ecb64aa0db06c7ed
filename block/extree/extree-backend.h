/*
 * extree backends for tests and tools: memory and POSIX file
 *
 * Not part of QEMU: the QEMU driver supplies its own backend over a
 * BdrvChild.  The memory backend can record every write and flush so that
 * tests can rebuild the device a power cut could leave behind, and can make
 * chosen operations fail.
 *
 * Both backends follow QEMU's file protocol: a read past the end of the
 * device returns zeros, a write past it extends the device.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef BLOCK_EXTREE_BACKEND_H
#define BLOCK_EXTREE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "extree.h"     /* ExtreeBackendOps, ExtreeBackend */

/*
 * Memory backend: sparse, 4 KiB pages allocated on first write and shared
 * copy-on-write between clones
 */
ExtreeBackend *extree_mem_backend_new(void);
void extree_mem_backend_free(ExtreeBackend *be);

/*
 * A new memory backend with a copy of @be's contents (not its log, faults
 * or counters).  O(pages) references, no data copied.
 */
ExtreeBackend *extree_mem_backend_clone(ExtreeBackend *be);

/*
 * Make @be a device of @size bytes that cannot change size (a block device,
 * a raw node with size=): its length becomes @size, a write that reaches
 * past it fails with -ENOSPC and a truncate to another length with
 * -ENOTSUP, both without any effect.  @size 0 makes it growable again.
 * Clones do not inherit it.
 */
void extree_mem_backend_set_fixed_size(ExtreeBackend *be, uint64_t size);

/* Byte-for-byte comparison of two memory backends (contents and length) */
bool extree_mem_backend_equal(ExtreeBackend *a, ExtreeBackend *b);

/* Number of 4 KiB pages holding data, i.e. memory in use / 4096 */
uint64_t extree_mem_backend_pages(ExtreeBackend *be);

/* ---- Recording and crash images ---- */

typedef enum ExtreeLogOp {
    EXTREE_LOG_WRITE,
    EXTREE_LOG_FLUSH,
    EXTREE_LOG_TRUNCATE,        /* offset = new length */
    EXTREE_LOG_DISCARD,         /* reads as zeros afterwards */
} ExtreeLogOp;

typedef struct ExtreeLogEntry {
    ExtreeLogOp op;
    uint64_t offset;
    uint64_t bytes;
    const uint8_t *data;        /* EXTREE_LOG_WRITE only; owned by the log */
} ExtreeLogEntry;

/*
 * Take a copy of the current contents as the base of a new log and log
 * every later successful write, flush, truncate and discard (failed ones
 * are not logged).  A previous log is discarded.
 */
void extree_mem_backend_start_recording(ExtreeBackend *be);
void extree_mem_backend_stop_recording(ExtreeBackend *be);
size_t extree_mem_backend_log_length(ExtreeBackend *be);
void extree_mem_backend_log_entry(ExtreeBackend *be, size_t i,
                                  ExtreeLogEntry *e);

/* What happens to the entries after the last flush of a log prefix */
typedef enum ExtreeCrashMode {
    EXTREE_CRASH_KEEP,          /* all of them reached the disk, in order */
    EXTREE_CRASH_DROP,          /* none of them did */
    /*
     * each 512-byte sector of each write (and each truncate/discard)
     * independently did or did not
     */
    EXTREE_CRASH_TEAR,
    /* as TEAR, but a sector may also end up holding garbage */
    EXTREE_CRASH_GARBAGE,
} ExtreeCrashMode;

/*
 * Build the device a crash after the first @prefix log entries could leave:
 * the recording base plus entries [0, @prefix), with the unflushed tail
 * treated per @mode.  @seed drives TEAR and GARBAGE deterministically.
 * Returns a new memory backend (not recording).  O(pages + unflushed tail)
 * when prefixes are asked for in increasing order (the flushed part is
 * kept up to date incrementally), O(pages + logged bytes) otherwise.
 */
ExtreeBackend *extree_mem_backend_crash_image(ExtreeBackend *be,
                                              size_t prefix,
                                              ExtreeCrashMode mode,
                                              uint64_t seed);

/* ---- Fault injection ---- */

#define EXTREE_FAULT_READ       (1u << 0)
#define EXTREE_FAULT_WRITE      (1u << 1)
#define EXTREE_FAULT_FLUSH      (1u << 2)
#define EXTREE_FAULT_TRUNCATE   (1u << 3)
#define EXTREE_FAULT_DISCARD    (1u << 4)

/*
 * Make the @nth (0 = the next) operation whose kind is in @mask fail with
 * -EIO without any effect.  With @sticky every matching operation after it
 * fails too.  Replaces an earlier injection; @mask 0 disarms.
 */
void extree_mem_backend_inject_fault(ExtreeBackend *be, unsigned mask,
                                     uint64_t nth, bool sticky);
/* Number of operations failed by injection so far */
uint64_t extree_mem_backend_faults(ExtreeBackend *be);

typedef struct ExtreeMemStats {
    uint64_t reads, writes, flushes, truncates, discards;
    uint64_t read_batches;      /* pread_many calls; their reads count too */
    uint64_t bytes_read, bytes_written;
} ExtreeMemStats;

/* Counts of successful operations since creation or the last reset */
void extree_mem_backend_stats(ExtreeBackend *be, ExtreeMemStats *st);
void extree_mem_backend_reset_stats(ExtreeBackend *be);

/* ---- POSIX file backend ---- */

/*
 * A regular file or a block device.  Reads past the end of a file return
 * zeroes (as QEMU's file protocol); flush is fdatasync; a file grows by
 * writes past its end and gives space back by punching holes, a block
 * device has a fixed size (truncate: -ENOTSUP) and gives it back by
 * BLKDISCARD.
 *
 * Open (@create: create or truncate to 0) the file @path.  On failure
 * returns NULL with a g_malloc'd message in *@errmsg.
 */
ExtreeBackend *extree_posix_backend_open(const char *path, bool create,
                                         char **errmsg);
/* Over @fd, opened (and locked) by the caller, who closes it */
ExtreeBackend *extree_posix_backend_wrap(int fd);
bool extree_posix_backend_is_blk(ExtreeBackend *be);
void extree_posix_backend_close(ExtreeBackend *be);

#endif /* BLOCK_EXTREE_BACKEND_H */
