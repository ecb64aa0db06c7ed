/*
 * extree backends for tests and tools: memory, and POSIX files and block
 * devices (the nbdkit plugin's)
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#define _GNU_SOURCE             /* fallocate, FALLOC_FL_PUNCH_HOLE */

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/fs.h>           /* BLKGETSIZE64, BLKDISCARD */
#endif

#include <glib.h>

#include "extree-backend.h"

/* ------------------------------------------------------------------------ */
/* Memory backend                                                            */

#define MEM_PAGE_BITS   12
#define MEM_PAGE_SIZE   (1u << MEM_PAGE_BITS)
#define MEM_SECTOR      512u

typedef struct MemFault {
    unsigned mask;
    uint64_t countdown;         /* matching operations to let through */
    bool sticky;
    bool tripped;               /* sticky fault has fired */
    uint64_t count;
} MemFault;

/*
 * Pages are shared between clones and copied on write, so that a clone
 * (a crash image, a snapshot) costs a reference per page
 */
typedef struct MemPage {
    uint32_t refcnt;
    uint8_t data[MEM_PAGE_SIZE];
} MemPage;

typedef struct MemBackend {
    ExtreeBackend be;
    GHashTable *pages;          /* page index -> MemPage */
    uint64_t length;
    /* A device of fixed size: no write or truncate past it (0: none) */
    uint64_t fixed_size;

    bool recording;
    struct MemBackend *base;    /* contents when recording started */
    GArray *log;                /* of ExtreeLogEntry; data g_malloc'd */
    /*
     * base plus log entries [0, replay_pos), replay_pos just after a
     * flush: crash images of growing prefixes start from here
     */
    struct MemBackend *replay;
    size_t replay_pos;

    MemFault fault;
    ExtreeMemStats stats;
} MemBackend;

static const ExtreeBackendOps mem_ops;

static MemBackend *mem_of(ExtreeBackend *be)
{
    assert(be && be->ops == &mem_ops);
    return be->opaque;
}

static void mem_page_unref(gpointer p)
{
    MemPage *page = p;

    if (--page->refcnt == 0) {
        g_free(page);
    }
}

/* The page for reading, NULL if it reads as zeros */
static const uint8_t *mem_page(MemBackend *m, uint64_t index)
{
    MemPage *page = g_hash_table_lookup(m->pages, (gpointer)(uintptr_t)index);

    return page ? page->data : NULL;
}

/* The page for writing: private to @m; created zeroed if @alloc */
static uint8_t *mem_page_w(MemBackend *m, uint64_t index, bool alloc)
{
    gpointer key = (gpointer)(uintptr_t)index;
    MemPage *page = g_hash_table_lookup(m->pages, key);

    if (page && page->refcnt > 1) {
        MemPage *copy = g_new(MemPage, 1);
        copy->refcnt = 1;
        memcpy(copy->data, page->data, MEM_PAGE_SIZE);
        g_hash_table_replace(m->pages, key, copy);  /* unrefs @page */
        page = copy;
    } else if (!page && alloc) {
        page = g_new0(MemPage, 1);
        page->refcnt = 1;
        g_hash_table_insert(m->pages, key, page);
    }
    return page ? page->data : NULL;
}

/* Whether the next operation of kind @kind must fail */
static bool mem_fault_hit(MemBackend *m, unsigned kind)
{
    MemFault *f = &m->fault;

    if (!(f->mask & kind)) {
        return false;
    }
    if (f->tripped) {
        f->count++;
        return true;
    }
    if (f->countdown > 0) {
        f->countdown--;
        return false;
    }
    f->count++;
    if (f->sticky) {
        f->tripped = true;
    } else {
        f->mask = 0;
    }
    return true;
}

static void mem_read(MemBackend *m, uint64_t offset, void *buf,
                     uint64_t bytes)
{
    uint8_t *out = buf;

    while (bytes > 0) {
        uint64_t in_page = offset & (MEM_PAGE_SIZE - 1);
        uint64_t n = MIN(bytes, MEM_PAGE_SIZE - in_page);
        const uint8_t *p = NULL;

        if (offset < m->length) {
            p = mem_page(m, offset >> MEM_PAGE_BITS);
        }
        if (p) {
            /* Bytes of the page past the length were zeroed on truncate */
            memcpy(out, p + in_page, n);
        } else {
            memset(out, 0, n);
        }
        out += n;
        offset += n;
        bytes -= n;
    }
}

static void mem_write(MemBackend *m, uint64_t offset, const void *buf,
                      uint64_t bytes)
{
    const uint8_t *in = buf;
    uint64_t end = offset + bytes;

    while (bytes > 0) {
        uint64_t in_page = offset & (MEM_PAGE_SIZE - 1);
        uint64_t n = MIN(bytes, MEM_PAGE_SIZE - in_page);

        memcpy(mem_page_w(m, offset >> MEM_PAGE_BITS, true) + in_page, in, n);
        in += n;
        offset += n;
        bytes -= n;
    }
    m->length = MAX(m->length, end);
}

/* Zero [offset, offset + bytes), dropping whole pages; does not extend */
static void mem_zero(MemBackend *m, uint64_t offset, uint64_t bytes)
{
    while (bytes > 0) {
        uint64_t index = offset >> MEM_PAGE_BITS;
        uint64_t in_page = offset & (MEM_PAGE_SIZE - 1);
        uint64_t n = MIN(bytes, MEM_PAGE_SIZE - in_page);

        if (n == MEM_PAGE_SIZE) {
            g_hash_table_remove(m->pages, (gpointer)(uintptr_t)index);
        } else {
            uint8_t *p = mem_page_w(m, index, false);
            if (p) {
                memset(p + in_page, 0, n);
            }
        }
        offset += n;
        bytes -= n;
    }
}

static void mem_truncate(MemBackend *m, uint64_t size)
{
    if (size < m->length) {
        /*
         * Later growth must read zeros, so clear the dropped bytes.  The
         * range is bounded by pages that actually exist.
         */
        GHashTableIter it;
        gpointer key;
        uint64_t first = size >> MEM_PAGE_BITS;
        uint64_t in_page = size & (MEM_PAGE_SIZE - 1);
        uint8_t *p;

        g_hash_table_iter_init(&it, m->pages);
        while (g_hash_table_iter_next(&it, &key, NULL)) {
            uint64_t index = (uintptr_t)key;
            if (index > first || (index == first && !in_page)) {
                g_hash_table_iter_remove(&it);
            }
        }
        p = in_page ? mem_page_w(m, first, false) : NULL;
        if (p) {
            memset(p + in_page, 0, MEM_PAGE_SIZE - in_page);
        }
    }
    m->length = size;
}

/* g_memdup2 needs glib 2.68 */
static void *mem_dup(const void *buf, size_t bytes)
{
    return memcpy(g_malloc(bytes), buf, bytes);
}

static void mem_log(MemBackend *m, ExtreeLogOp op, uint64_t offset,
                    const void *buf, uint64_t bytes)
{
    ExtreeLogEntry e = {
        .op = op,
        .offset = offset,
        .bytes = bytes,
    };

    if (m->recording) {
        e.data = buf ? mem_dup(buf, bytes) : NULL;
        g_array_append_val(m->log, e);
    }
}

static int mem_op_pread(void *opaque, uint64_t offset, void *buf,
                        uint64_t bytes)
{
    MemBackend *m = opaque;

    if (mem_fault_hit(m, EXTREE_FAULT_READ)) {
        return -EIO;
    }
    mem_read(m, offset, buf, bytes);
    m->stats.reads++;
    m->stats.bytes_read += bytes;
    return 0;
}

static int mem_op_pwrite(void *opaque, uint64_t offset, const void *buf,
                         uint64_t bytes)
{
    MemBackend *m = opaque;

    if (offset + bytes < offset) {
        return -EINVAL;
    }
    if (m->fixed_size && offset + bytes > m->fixed_size) {
        return -ENOSPC;
    }
    if (mem_fault_hit(m, EXTREE_FAULT_WRITE)) {
        return -EIO;
    }
    mem_write(m, offset, buf, bytes);
    mem_log(m, EXTREE_LOG_WRITE, offset, buf, bytes);
    m->stats.writes++;
    m->stats.bytes_written += bytes;
    return 0;
}

static int mem_op_flush(void *opaque)
{
    MemBackend *m = opaque;

    if (mem_fault_hit(m, EXTREE_FAULT_FLUSH)) {
        return -EIO;
    }
    mem_log(m, EXTREE_LOG_FLUSH, 0, NULL, 0);
    m->stats.flushes++;
    return 0;
}

static int mem_op_truncate(void *opaque, uint64_t size)
{
    MemBackend *m = opaque;

    if (m->fixed_size) {
        /* like a raw node with size= or a block device */
        return size == m->length ? 0 : -ENOTSUP;
    }
    if (mem_fault_hit(m, EXTREE_FAULT_TRUNCATE)) {
        return -EIO;
    }
    mem_truncate(m, size);
    mem_log(m, EXTREE_LOG_TRUNCATE, size, NULL, 0);
    m->stats.truncates++;
    return 0;
}

static int mem_op_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    MemBackend *m = opaque;

    if (offset + bytes < offset) {
        return -EINVAL;
    }
    if (mem_fault_hit(m, EXTREE_FAULT_DISCARD)) {
        return -EIO;
    }
    mem_zero(m, offset, MIN(bytes, m->length > offset ?
                                   m->length - offset : 0));
    mem_log(m, EXTREE_LOG_DISCARD, offset, NULL, bytes);
    m->stats.discards++;
    return 0;
}

static int64_t mem_op_get_length(void *opaque)
{
    MemBackend *m = opaque;

    return m->length;
}

/* Readahead: one read after another, each subject to fault injection */
static void mem_op_pread_many(void *opaque, int n, const uint64_t *offsets,
                              void *const *bufs, uint64_t bytes, int *rets)
{
    MemBackend *m = opaque;

    m->stats.read_batches++;
    for (int i = 0; i < n; i++) {
        rets[i] = mem_op_pread(opaque, offsets[i], bufs[i], bytes);
    }
}

static const ExtreeBackendOps mem_ops = {
    .pread = mem_op_pread,
    .pread_many = mem_op_pread_many,
    .pwrite = mem_op_pwrite,
    .flush = mem_op_flush,
    .truncate = mem_op_truncate,
    .discard = mem_op_discard,
    .get_length = mem_op_get_length,
};

static MemBackend *mem_new(void)
{
    MemBackend *m = g_new0(MemBackend, 1);

    m->be.ops = &mem_ops;
    m->be.opaque = m;
    m->pages = g_hash_table_new_full(g_direct_hash, g_direct_equal,
                                     NULL, mem_page_unref);
    m->log = g_array_new(false, false, sizeof(ExtreeLogEntry));
    return m;
}

ExtreeBackend *extree_mem_backend_new(void)
{
    return &mem_new()->be;
}

static void mem_clear_log(MemBackend *m)
{
    for (guint i = 0; i < m->log->len; i++) {
        g_free((void *)g_array_index(m->log, ExtreeLogEntry, i).data);
    }
    g_array_set_size(m->log, 0);
    if (m->base) {
        extree_mem_backend_free(&m->base->be);
        m->base = NULL;
    }
    if (m->replay) {
        extree_mem_backend_free(&m->replay->be);
        m->replay = NULL;
    }
}

void extree_mem_backend_free(ExtreeBackend *be)
{
    MemBackend *m;

    if (!be) {
        return;
    }
    m = mem_of(be);
    mem_clear_log(m);
    g_array_free(m->log, true);
    g_hash_table_destroy(m->pages);
    g_free(m);
}

static MemBackend *mem_clone(MemBackend *src)
{
    MemBackend *m = mem_new();
    GHashTableIter it;
    gpointer key, value;

    g_hash_table_iter_init(&it, src->pages);
    while (g_hash_table_iter_next(&it, &key, &value)) {
        ((MemPage *)value)->refcnt++;
        g_hash_table_insert(m->pages, key, value);
    }
    m->length = src->length;
    return m;
}

ExtreeBackend *extree_mem_backend_clone(ExtreeBackend *be)
{
    return &mem_clone(mem_of(be))->be;
}

void extree_mem_backend_set_fixed_size(ExtreeBackend *be, uint64_t size)
{
    MemBackend *m = mem_of(be);

    if (size && m->length != size) {
        mem_truncate(m, size);
    }
    m->fixed_size = size;
}

bool extree_mem_backend_equal(ExtreeBackend *a, ExtreeBackend *b)
{
    MemBackend *ma = mem_of(a), *mb = mem_of(b);
    static const uint8_t zero[MEM_PAGE_SIZE];
    GHashTableIter it;
    gpointer key, value;

    if (ma->length != mb->length) {
        return false;
    }
    /* A missing page equals an all-zero one; check both directions */
    for (int pass = 0; pass < 2; pass++) {
        MemBackend *x = pass ? mb : ma, *y = pass ? ma : mb;

        g_hash_table_iter_init(&it, x->pages);
        while (g_hash_table_iter_next(&it, &key, &value)) {
            const uint8_t *other = mem_page(y, (uintptr_t)key);
            if (memcmp(((MemPage *)value)->data, other ? other : zero,
                       MEM_PAGE_SIZE)) {
                return false;
            }
        }
    }
    return true;
}

uint64_t extree_mem_backend_pages(ExtreeBackend *be)
{
    return g_hash_table_size(mem_of(be)->pages);
}

void extree_mem_backend_start_recording(ExtreeBackend *be)
{
    MemBackend *m = mem_of(be);

    mem_clear_log(m);
    m->base = mem_clone(m);
    m->recording = true;
}

void extree_mem_backend_stop_recording(ExtreeBackend *be)
{
    mem_of(be)->recording = false;
}

size_t extree_mem_backend_log_length(ExtreeBackend *be)
{
    return mem_of(be)->log->len;
}

void extree_mem_backend_log_entry(ExtreeBackend *be, size_t i,
                                  ExtreeLogEntry *e)
{
    MemBackend *m = mem_of(be);

    assert(i < m->log->len);
    *e = g_array_index(m->log, ExtreeLogEntry, i);
}

/* splitmix64: small, fast, and the same everywhere */
static uint64_t crash_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void crash_apply(MemBackend *m, const ExtreeLogEntry *e)
{
    switch (e->op) {
    case EXTREE_LOG_WRITE:
        mem_write(m, e->offset, e->data, e->bytes);
        break;
    case EXTREE_LOG_TRUNCATE:
        mem_truncate(m, e->offset);
        break;
    case EXTREE_LOG_DISCARD:
        mem_zero(m, e->offset, MIN(e->bytes, m->length > e->offset ?
                                             m->length - e->offset : 0));
        break;
    case EXTREE_LOG_FLUSH:
        break;
    }
}

/*
 * Apply an unflushed write sector by sector, each one kept, skipped or
 * (with @garbage) overwritten with noise
 */
static void crash_tear_write(MemBackend *m, const ExtreeLogEntry *e,
                             bool garbage, uint64_t *rng)
{
    uint64_t pos = e->offset, end = e->offset + e->bytes;
    uint8_t noise[MEM_SECTOR];

    while (pos < end) {
        /* Sectors are aligned on the device, not within the write */
        uint64_t n = MIN(end, (pos | (MEM_SECTOR - 1)) + 1) - pos;
        uint64_t r = crash_rand(rng) % (garbage ? 3 : 2);

        if (r == 0) {
            mem_write(m, pos, e->data + (pos - e->offset), n);
        } else if (r == 2) {
            for (uint64_t i = 0; i < n; i += 8) {
                uint64_t v = crash_rand(rng);
                memcpy(noise + i, &v, MIN(8, n - i));
            }
            mem_write(m, pos, noise, n);
        }
        pos += n;
    }
}

ExtreeBackend *extree_mem_backend_crash_image(ExtreeBackend *be,
                                              size_t prefix,
                                              ExtreeCrashMode mode,
                                              uint64_t seed)
{
    MemBackend *m = mem_of(be);
    MemBackend *out;
    size_t flushed = prefix;    /* entries up to and including last flush */
    uint64_t rng = seed;

    assert(m->base && prefix <= m->log->len);
    while (flushed > 0 &&
           g_array_index(m->log, ExtreeLogEntry, flushed - 1).op !=
           EXTREE_LOG_FLUSH) {
        flushed--;
    }
    /*
     * Bring the flushed image up to date; start over if asked for an
     * earlier one.  Enumerating prefixes in order costs O(log) in all.
     */
    if (!m->replay || m->replay_pos > flushed) {
        if (m->replay) {
            extree_mem_backend_free(&m->replay->be);
        }
        m->replay = mem_clone(m->base);
        m->replay_pos = 0;
    }
    for (; m->replay_pos < flushed; m->replay_pos++) {
        crash_apply(m->replay, &g_array_index(m->log, ExtreeLogEntry,
                                              m->replay_pos));
    }
    out = mem_clone(m->replay);
    for (size_t i = flushed; i < prefix; i++) {
        const ExtreeLogEntry *e = &g_array_index(m->log, ExtreeLogEntry, i);

        if (mode == EXTREE_CRASH_KEEP) {
            crash_apply(out, e);
        } else if (mode == EXTREE_CRASH_DROP) {
            continue;
        } else if (e->op == EXTREE_LOG_WRITE) {
            crash_tear_write(out, e, mode == EXTREE_CRASH_GARBAGE, &rng);
        } else if (crash_rand(&rng) & 1) {
            crash_apply(out, e);
        }
    }
    return &out->be;
}

void extree_mem_backend_inject_fault(ExtreeBackend *be, unsigned mask,
                                     uint64_t nth, bool sticky)
{
    MemBackend *m = mem_of(be);

    m->fault.mask = mask;
    m->fault.countdown = nth;
    m->fault.sticky = sticky;
    m->fault.tripped = false;
}

uint64_t extree_mem_backend_faults(ExtreeBackend *be)
{
    return mem_of(be)->fault.count;
}

void extree_mem_backend_stats(ExtreeBackend *be, ExtreeMemStats *st)
{
    *st = mem_of(be)->stats;
}

void extree_mem_backend_reset_stats(ExtreeBackend *be)
{
    memset(&mem_of(be)->stats, 0, sizeof(ExtreeMemStats));
}

/* ------------------------------------------------------------------------ */
/* POSIX file backend                                                        */

typedef struct PosixBackend {
    ExtreeBackend be;
    int fd;
    bool owned;                 /* opened here: closed by close() */
    bool is_blk;                /* a block device: of fixed size */
} PosixBackend;

/* Reads past the end of the file return zeroes, as QEMU's file protocol */
static int posix_op_pread(void *opaque, uint64_t offset, void *buf,
                          uint64_t bytes)
{
    PosixBackend *p = opaque;
    uint8_t *out = buf;

    while (bytes > 0) {
        ssize_t n = pread(p->fd, out, MIN(bytes, (uint64_t)1 << 30), offset);
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

static int posix_op_pwrite(void *opaque, uint64_t offset, const void *buf,
                           uint64_t bytes)
{
    PosixBackend *p = opaque;
    const uint8_t *in = buf;

    while (bytes > 0) {
        ssize_t n = pwrite(p->fd, in, MIN(bytes, (uint64_t)1 << 30), offset);
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

static int posix_op_flush(void *opaque)
{
    PosixBackend *p = opaque;

    return fdatasync(p->fd) < 0 ? -errno : 0;
}

static int posix_op_truncate(void *opaque, uint64_t size)
{
    PosixBackend *p = opaque;

    if (p->is_blk) {
        return -ENOTSUP;
    }
    if (size > INT64_MAX) {
        return -EFBIG;
    }
    return ftruncate(p->fd, size) < 0 ? -errno : 0;
}

/* A hole where the filesystem can punch one; BLKDISCARD on a device */
static int posix_op_discard(void *opaque, uint64_t offset, uint64_t bytes)
{
    PosixBackend *p = opaque;

#ifdef BLKDISCARD
    if (p->is_blk) {
        uint64_t range[2] = { offset, bytes };

        return ioctl(p->fd, BLKDISCARD, range) < 0 ? -errno : 0;
    }
#endif
#ifdef FALLOC_FL_PUNCH_HOLE
    if (fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  offset, bytes) < 0) {
        return -errno;
    }
    return 0;
#else
    return -ENOTSUP;
#endif
}

static int64_t posix_op_get_length(void *opaque)
{
    PosixBackend *p = opaque;
    struct stat st;

    if (fstat(p->fd, &st) < 0) {
        return -errno;
    }
#ifdef BLKGETSIZE64
    if (S_ISBLK(st.st_mode)) {
        uint64_t len;

        return ioctl(p->fd, BLKGETSIZE64, &len) < 0 ? -errno : (int64_t)len;
    }
#endif
    return st.st_size;
}

/* Readahead of the leaves of a forward walk: one read after another */
static void posix_op_pread_many(void *opaque, int n, const uint64_t *offsets,
                                void *const *bufs, uint64_t bytes, int *rets)
{
    for (int i = 0; i < n; i++) {
        rets[i] = posix_op_pread(opaque, offsets[i], bufs[i], bytes);
    }
}

static const ExtreeBackendOps posix_ops = {
    .pread = posix_op_pread,
    .pwrite = posix_op_pwrite,
    .flush = posix_op_flush,
    .truncate = posix_op_truncate,
    .discard = posix_op_discard,
    .get_length = posix_op_get_length,
    .pread_many = posix_op_pread_many,
};

static ExtreeBackend *posix_new(int fd, bool owned)
{
    PosixBackend *p = g_new0(PosixBackend, 1);
    struct stat st;

    p->be.ops = &posix_ops;
    p->be.opaque = p;
    p->fd = fd;
    p->owned = owned;
    p->is_blk = fstat(fd, &st) == 0 && S_ISBLK(st.st_mode);
    return &p->be;
}

ExtreeBackend *extree_posix_backend_open(const char *path, bool create,
                                         char **errmsg)
{
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0);
    int fd;

    do {
        fd = open(path, flags, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errmsg) {
            *errmsg = g_strdup_printf("Could not %s '%s': %s",
                                      create ? "create" : "open", path,
                                      g_strerror(errno));
        }
        return NULL;
    }
    return posix_new(fd, true);
}

ExtreeBackend *extree_posix_backend_wrap(int fd)
{
    return posix_new(fd, false);
}

bool extree_posix_backend_is_blk(ExtreeBackend *be)
{
    assert(be->ops == &posix_ops);
    return ((PosixBackend *)be->opaque)->is_blk;
}

void extree_posix_backend_close(ExtreeBackend *be)
{
    PosixBackend *p;

    if (!be) {
        return;
    }
    assert(be->ops == &posix_ops);
    p = be->opaque;
    if (p->owned) {
        close(p->fd);
    }
    g_free(p);
}
