/*
 * extree core: the mark log (EXTREE_INCOMPAT_MARK_LOG; spec: Mark log)
 *
 * A write in place over granules whose bits the committed bitmaps lack
 * must not reach the disk before its marks do (spec: Persistent dirty
 * bitmaps, 2).  Without the log the marks reach the disk only with a
 * commit, so such a write goes to new space and changes the mapping
 * instead: a tree update for every first write to a granule, and four
 * times its size in node writes.  With the log, its caller appends one
 * record of guest ranges (the marks of every write waiting at the time:
 * group commit), flushes, and then writes in place: dm-era's order, with
 * an append instead of a commit.
 *
 * Records belong to the running transaction (generation trans_gen) and
 * form a chain from slot 0; a reader replays the chain that follows the
 * superblock it opened and stops at the first record that is torn, stale
 * or out of order.  Replaying sets bits, so it may be repeated, and a
 * record of a write that never reached the disk only sets more bits than
 * needed.  A commit stores the bits, which makes the chain stale: the next
 * one starts at slot 0 with the next generation.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stddef.h>

#include "extree-int.h"

#define LH_OFF(f) offsetof(ExtreeDiskMarkLogHeader, f)

static uint32_t slots(const Extree *t)
{
    return t->bm.log_len / EXTREE_MARK_LOG_RECORD;
}

/* CRC-32C of a record with its csum field taken as 0 */
static uint32_t record_csum(const uint8_t *rec)
{
    static const uint8_t zero[4];
    uint32_t c = extree_crc32c(0, rec, LH_OFF(csum));

    c = extree_crc32c(c, zero, sizeof(zero));
    return extree_crc32c(c, rec + LH_OFF(csum) + 4,
                         EXTREE_MARK_LOG_RECORD - LH_OFF(csum) - 4);
}

/*
 * Is @rec the record of slot @seq of the chain of generation @gen?  Its
 * count and ranges are checked by the caller.
 */
static bool record_valid(const uint8_t *rec, uint64_t gen, uint32_t seq)
{
    return ext_ld64(rec + LH_OFF(magic)) == EXTREE_MARK_LOG_MAGIC &&
           ext_ld64(rec + LH_OFF(generation)) == gen &&
           ext_ld32(rec + LH_OFF(seq)) == seq &&
           ext_ld32(rec + LH_OFF(csum)) == record_csum(rec);
}

/* Why the entries of a valid map record cannot be (g_free()), or NULL */
static char *map_record_bad(const Extree *t, const uint8_t *rec,
                            uint64_t data_end)
{
    uint32_t count = ext_ld32(rec + LH_OFF(count));
    const uint8_t *e = rec + sizeof(ExtreeDiskMarkLogHeader);
    uint64_t bs = t->block_size;

    if (count == 0 || count > EXTREE_MAP_LOG_ENTRIES) {
        return g_strdup_printf("bad count %u (1 to %zu)", count,
                               (size_t)EXTREE_MAP_LOG_ENTRIES);
    }
    for (uint32_t i = 0; i < count; i++, e += sizeof(ExtreeDiskMapLogEntry)) {
        uint64_t guest = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, guest));
        uint64_t host = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, host));
        uint64_t len = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, length));
        uint32_t rsv = ext_ld32(e + offsetof(ExtreeDiskMapLogEntry,
                                             reserved));

        if (len == 0 || len > EXTREE_MAP_LOG_MAX_ENTRY ||
            !EXTREE_IS_ALIGNED(guest | host | len, bs) ||
            guest >= data_end || len > data_end - guest ||
            host < t->data_start || host > (uint64_t)INT64_MAX - len ||
            rsv) {
            return g_strdup_printf("entry %u: guest offset 0x%" PRIx64
                                   " host offset 0x%" PRIx64 " length 0x%"
                                   PRIx64 " is not whole blocks of the "
                                   "virtual disk and the data area", i,
                                   guest, host, len);
        }
    }
    return NULL;
}

/* Why the ranges of a valid record cannot be (g_free()), NULL if they can */
static char *record_bad(const Extree *t, const uint8_t *rec,
                        uint64_t data_end)
{
    uint32_t count = ext_ld32(rec + LH_OFF(count));
    uint32_t kind = ext_ld32(rec + LH_OFF(kind));
    const uint8_t *r = rec + sizeof(ExtreeDiskMarkLogHeader);

    if (kind == EXTREE_LOG_MAPS && (t->incompat & EXTREE_INCOMPAT_MAP_LOG)) {
        return map_record_bad(t, rec, data_end);
    }
    if (kind != EXTREE_LOG_MARKS) {
        return g_strdup_printf("unknown kind %u", kind);
    }
    if (count == 0 || count > EXTREE_MARK_LOG_RANGES) {
        return g_strdup_printf("bad count %u (1 to %zu)", count,
                               (size_t)EXTREE_MARK_LOG_RANGES);
    }
    for (uint32_t i = 0; i < count; i++, r += sizeof(ExtreeDiskMarkLogRange)) {
        uint64_t start = ext_ld64(r), len = ext_ld64(r + 8);

        if (len == 0 || start >= data_end || len > data_end - start) {
            return g_strdup_printf("range %u at guest offset 0x%" PRIx64
                                   " length 0x%" PRIx64 " not inside the "
                                   "virtual disk (0x%" PRIx64 ")", i, start,
                                   len, data_end);
        }
    }
    return NULL;
}

/*
 * Is the data each entry of map record @rec names on the disk, as its
 * checksum says?  Not: the write never became durable, and no flush
 * covered it or anything logged after it (spec: Mark log, map records).
 * The data must lie inside the backend (a crash may have lost the file's
 * growth).  Reads every entry's data: O(bytes logged).
 */
static int map_record_durable(Extree *t, const uint8_t *rec, bool *durable)
{
    uint32_t count = ext_ld32(rec + LH_OFF(count));
    const uint8_t *e = rec + sizeof(ExtreeDiskMarkLogHeader);
    int64_t flen = t->be->ops->get_length(t->be->opaque);

    *durable = true;
    if (flen < 0) {
        return flen;
    }
    for (uint32_t i = 0; i < count; i++, e += sizeof(ExtreeDiskMapLogEntry)) {
        uint64_t host = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, host));
        uint64_t len = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, length));
        uint32_t want = ext_ld32(e + offsetof(ExtreeDiskMapLogEntry, csum));
        uint8_t *data;
        int ret;

        if (host + len > (uint64_t)flen) {
            *durable = false;
            return 0;
        }
        data = g_try_malloc(len);
        if (!data) {
            return -ENOMEM;
        }
        ret = t->be->ops->pread(t->be->opaque, host, data, len);
        if (ret == 0 && extree_crc32c(0, data, len) != want) {
            *durable = false;
        }
        g_free(data);
        if (ret < 0 || !*durable) {
            return ret;
        }
    }
    return 0;
}

/* Keep the entries of durable map record @rec for extree_map_log_apply() */
static void map_record_keep(Extree *t, const uint8_t *rec)
{
    uint32_t count = ext_ld32(rec + LH_OFF(count));
    const uint8_t *e = rec + sizeof(ExtreeDiskMarkLogHeader);

    if (!t->bm.map_replay) {
        t->bm.map_replay = g_array_new(false, false, sizeof(ExtreeMapEntry));
    }
    for (uint32_t i = 0; i < count; i++, e += sizeof(ExtreeDiskMapLogEntry)) {
        ExtreeMapEntry me = {
            .guest = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, guest)),
            .host = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, host)),
            .length = ext_ld64(e + offsetof(ExtreeDiskMapLogEntry, length)),
            .csum = ext_ld32(e + offsetof(ExtreeDiskMapLogEntry, csum)),
        };
        g_array_append_val(t->bm.map_replay, me);
    }
}

static void map_state_clear(Extree *t)
{
    if (t->bm.map_pending) {
        g_array_set_size(t->bm.map_pending, 0);
    }
    extree_rs_clear(&t->bm.map_hosts);
    t->bm.unlogged = false;
}

int extree_mark_log_load(Extree *t, const ExtreeSuper *sb, bool tolerate)
{
    uint64_t data_end = EXTREE_ROUND_UP(sb->virtual_size, t->block_size);
    /* the chain of the transaction after the state (a corrupt mark lags) */
    uint64_t gen = sb->generation + 1 - sb->log_lag;
    uint8_t *buf;
    uint32_t seq;
    int ret;

    t->bm.log = sb->mark_log;
    t->bm.log_len = sb->mark_log_len;
    t->bm.log_ok = sb->mark_log != 0;
    /* a log without bitmaps holds map records only: it stays */
    t->bm.map_wanted = sb->mark_log && !sb->bitmap_count;
    t->bm.flush_commits = 0;
    t->bm.log_next = t->bm.log_replayed = 0;
    t->bm.map_replayed = 0;
    map_state_clear(t);
    if (t->bm.map_replay) {
        g_array_set_size(t->bm.map_replay, 0);
    }
    if (!t->bm.log) {
        return 0;
    }
    buf = g_malloc(t->bm.log_len);
    ret = t->be->ops->pread(t->be->opaque, t->bm.log, buf, t->bm.log_len);
    for (seq = 0; ret == 0 && seq < slots(t); seq++) {
        const uint8_t *rec = buf + (size_t)seq * EXTREE_MARK_LOG_RECORD;
        const uint8_t *r = rec + sizeof(ExtreeDiskMarkLogHeader);
        uint64_t off = t->bm.log + (uint64_t)seq * EXTREE_MARK_LOG_RECORD;
        char *why;

        if (!record_valid(rec, gen, seq)) {
            break;
        }
        why = record_bad(t, rec, data_end);
        if (why) {
            char *msg = g_strdup_printf("corrupt mark log at offset 0x%"
                                        PRIx64 ": record %u: %s", off, seq,
                                        why);
            g_free(why);
            if (tolerate) {
                /* a checker's: what came before is replayed, -r repairs */
                g_free(t->bm.log_bad);
                t->bm.log_bad = msg;
                break;
            }
            ret = extree_corrupt(t, off, "%s", msg);
            g_free(msg);
            break;
        }
        if (ext_ld32(rec + LH_OFF(kind)) == EXTREE_LOG_MAPS) {
            bool durable;

            ret = map_record_durable(t, rec, &durable);
            if (ret < 0 || !durable) {
                /* its data, and what came after it, was never flushed */
                break;
            }
            map_record_keep(t, rec);
            continue;
        }
        for (uint32_t i = 0; i < ext_ld32(rec + LH_OFF(count));
             i++, r += sizeof(ExtreeDiskMarkLogRange)) {
            extree_bitmaps_mark_logged(t, ext_ld64(r), ext_ld64(r + 8));
            extree_bitmaps_logged_add(t, ext_ld64(r), ext_ld64(r + 8));
        }
    }
    /*
     * A record of this generation past the chain's end (after a torn one,
     * or after a map record whose data never became durable) would join
     * the chain once a new record filled the gap, and a stale map record
     * replayed after newer ones could undo a flushed write: no record is
     * appended to this chain, the next commit starts a new one
     */
    for (uint32_t s2 = seq; ret == 0 && s2 < slots(t); s2++) {
        const uint8_t *rec = buf + (size_t)s2 * EXTREE_MARK_LOG_RECORD;

        if (ext_ld64(rec + LH_OFF(magic)) == EXTREE_MARK_LOG_MAGIC &&
            ext_ld64(rec + LH_OFF(generation)) == gen) {
            t->bm.log_ok = false;
            break;
        }
    }
    g_free(buf);
    if (sb->log_lag) {
        /* the chain is not the running transaction's: commit first */
        t->bm.log_ok = false;
    }
    /* a later record of this chain goes after what is there */
    t->bm.log_next = t->bm.log_replayed = seq;
    return ret;
}

bool extree_mark_log_room(const Extree *t)
{
    return t->bm.log_ok && !t->read_only && t->bm.log_next < slots(t);
}

int extree_mark_log_append(Extree *t, const ExtreeMarkRange *r, unsigned n,
                           uint8_t **record, uint64_t *offset)
{
    uint64_t gran = extree_bitmaps_min_granule(t);
    uint8_t *rec, *p;
    uint64_t space = 0;
    uint32_t count = 0;
    int ret = extree_check_writable(t);

    *record = NULL;
    if (ret < 0) {
        return ret;
    }
    if (!extree_mark_log_room(t)) {
        return -ENOSPC;
    }
    if (n == 0 || n > EXTREE_MARK_LOG_RANGES) {
        return -EINVAL;
    }
    /*
     * The chunks the marks change are written by the next commit: on
     * storage of fixed size, only where the guard keeps room for them
     * (else the writes go to new space, under the same guard)
     */
    for (unsigned i = 0; i < n; i++) {
        space += extree_bitmaps_mark_space(t, r[i].start, r[i].len);
    }
    if (!extree_alloc_update_fits(t, space)) {
        return -ENOSPC;
    }
    rec = g_malloc0(EXTREE_MARK_LOG_RECORD);
    p = rec + sizeof(ExtreeDiskMarkLogHeader);
    for (unsigned i = 0; i < n; i++) {
        uint64_t start = r[i].start / gran * gran;
        uint64_t end = MIN(EXTREE_ROUND_UP(r[i].start + r[i].len, gran),
                           t->virtual_size);

        if (start >= end) {
            continue;
        }
        /* set now: a commit before the write returns stores them too */
        extree_bitmaps_mark_logged(t, start, end - start);
        ext_st64(p, start);
        ext_st64(p + 8, end - start);
        p += sizeof(ExtreeDiskMarkLogRange);
        count++;
    }
    if (!count) {
        g_free(rec);
        return -EINVAL;
    }
    ext_st64(rec + LH_OFF(magic), EXTREE_MARK_LOG_MAGIC);
    ext_st64(rec + LH_OFF(generation), t->trans_gen);
    ext_st32(rec + LH_OFF(seq), t->bm.log_next);
    ext_st32(rec + LH_OFF(count), count);
    ext_st32(rec + LH_OFF(csum), record_csum(rec));
    *offset = t->bm.log + (uint64_t)t->bm.log_next * EXTREE_MARK_LOG_RECORD;
    *record = rec;
    t->bm.log_next++;
    extree_trace(t, EXTREE_TRACE_MARK_LOG, t->trans_gen, t->bm.log_next - 1,
                 count);
    return 0;
}

void extree_mark_log_durable(Extree *t, const ExtreeMarkRange *r, unsigned n)
{
    uint64_t gran = extree_bitmaps_min_granule(t);

    for (unsigned i = 0; i < n; i++) {
        uint64_t start = r[i].start / gran * gran;
        uint64_t end = MIN(EXTREE_ROUND_UP(r[i].start + r[i].len, gran),
                           t->virtual_size);

        if (start < end) {
            extree_bitmaps_logged_add(t, start, end - start);
        }
    }
}

uint64_t extree_mark_log_granule(Extree *t)
{
    return extree_bitmap_count(t) ? extree_bitmaps_min_granule(t) : 0;
}

bool extree_mark_log_checkpoint_wanted(const Extree *t)
{
    return (t->bm.dirty_logged || t->bm.map_hosts.count) && t->bm.log_ok &&
           (t->bm.log_next >= slots(t) / 2 ||
            t->bm.map_hosts.bytes > EXTREE_MAP_LOG_MAX_BYTES);
}

bool extree_mark_log_pending(const Extree *t)
{
    return (t->bm.dirty_logged || t->bm.map_hosts.count) && !t->read_only;
}

void extree_mark_log_checkpoint(Extree *t)
{
    if (extree_mark_log_pending(t)) {
        /* a commit with nothing else to do: it stores the marks */
        t->super_dirty = true;
    }
}

void extree_mark_log_info(const Extree *t, ExtreeMarkLogInfo *info)
{
    info->offset = t->bm.log;
    info->length = t->bm.log_len;
    info->records = t->bm.log_next;
    info->replayed = t->bm.log_replayed;
    info->maps = !!(t->incompat & EXTREE_INCOMPAT_MAP_LOG);
    info->map_replayed = t->bm.map_replayed;
}

/* ---- Map records ---- */

void extree_map_log_flush_commit(Extree *t)
{
    if (!t->bm.log && !t->bm.map_wanted &&
        ++t->bm.flush_commits >= EXTREE_MAP_LOG_AFTER) {
        /* this commit adds the log (extree_mark_log_commit_prepare()) */
        t->bm.map_wanted = true;
    }
}

bool extree_map_log_usable(Extree *t)
{
    return (t->incompat & EXTREE_INCOMPAT_MAP_LOG) && !t->bm.no_log &&
           extree_mark_log_room(t);
}

/* An entry mapped: see extree_map_data_logged() (extree-txn.c) */
void extree_map_log_add(Extree *t, uint64_t guest, uint64_t bytes,
                        uint64_t host, uint32_t csum)
{
    ExtreeMapEntry me = { guest, host, bytes, csum };

    if (!t->bm.map_pending) {
        t->bm.map_pending = g_array_new(false, false, sizeof(ExtreeMapEntry));
    }
    g_array_append_val(t->bm.map_pending, me);
    extree_rs_union(&t->bm.map_hosts, host, bytes);
}

bool extree_map_log_hosts(Extree *t, uint64_t host, uint64_t bytes)
{
    return t->bm.map_hosts.count &&
           extree_rs_overlaps(&t->bm.map_hosts, host, bytes);
}

static uint32_t map_slots_needed(const Extree *t)
{
    uint32_t n = t->bm.map_pending ? t->bm.map_pending->len : 0;

    return (n + EXTREE_MAP_LOG_ENTRIES - 1) / EXTREE_MAP_LOG_ENTRIES;
}

/*
 * A flush may make the running transaction durable with records alone:
 * nothing changed that no record holds, the log is usable, and the
 * waiting entries fit in the first half of it (past it a commit
 * checkpoints, as for marks; it also bounds what a replay reads)
 */
bool extree_map_log_sync_wanted(Extree *t)
{
    return !t->bm.unlogged && extree_map_log_usable(t) &&
           t->bm.log_next + map_slots_needed(t) <= slots(t) / 2 &&
           t->bm.map_hosts.bytes <= EXTREE_MAP_LOG_MAX_BYTES;
}

int extree_map_log_records(Extree *t, uint8_t **records, uint64_t *offset,
                           uint64_t *len)
{
    uint32_t need = map_slots_needed(t);
    GArray *a = t->bm.map_pending;
    int ret = extree_check_writable(t);
    uint8_t *buf;

    *records = NULL;
    *len = 0;
    if (ret < 0) {
        return ret;
    }
    if (!need) {
        return 0;
    }
    if (!extree_map_log_usable(t) || t->bm.log_next + need > slots(t)) {
        return -ENOSPC;
    }
    buf = g_malloc0((size_t)need * EXTREE_MARK_LOG_RECORD);
    for (uint32_t k = 0; k < need; k++) {
        uint8_t *rec = buf + (size_t)k * EXTREE_MARK_LOG_RECORD;
        uint8_t *e = rec + sizeof(ExtreeDiskMarkLogHeader);
        uint32_t first = k * EXTREE_MAP_LOG_ENTRIES;
        uint32_t count = MIN(a->len - first, EXTREE_MAP_LOG_ENTRIES);

        for (uint32_t i = 0; i < count;
             i++, e += sizeof(ExtreeDiskMapLogEntry)) {
            ExtreeMapEntry *me = &g_array_index(a, ExtreeMapEntry, first + i);

            ext_st64(e + offsetof(ExtreeDiskMapLogEntry, guest), me->guest);
            ext_st64(e + offsetof(ExtreeDiskMapLogEntry, host), me->host);
            ext_st64(e + offsetof(ExtreeDiskMapLogEntry, length), me->length);
            ext_st32(e + offsetof(ExtreeDiskMapLogEntry, csum), me->csum);
        }
        ext_st64(rec + LH_OFF(magic), EXTREE_MARK_LOG_MAGIC);
        ext_st64(rec + LH_OFF(generation), t->trans_gen);
        ext_st32(rec + LH_OFF(seq), t->bm.log_next + k);
        ext_st32(rec + LH_OFF(count), count);
        ext_st32(rec + LH_OFF(kind), EXTREE_LOG_MAPS);
        ext_st32(rec + LH_OFF(csum), record_csum(rec));
        extree_trace(t, EXTREE_TRACE_MARK_LOG, t->trans_gen,
                     t->bm.log_next + k, count);
    }
    *offset = t->bm.log + (uint64_t)t->bm.log_next * EXTREE_MARK_LOG_RECORD;
    *len = (uint64_t)need * EXTREE_MARK_LOG_RECORD;
    *records = buf;
    t->bm.log_next += need;
    g_array_set_size(a, 0);
    return 0;
}

void extree_map_log_failed(Extree *t)
{
    /*
     * What the slots hold is unknown: no record may follow them (a torn
     * one would end the chain before it), and only a commit makes what
     * the lost ones held durable
     */
    t->bm.unlogged = true;
    t->bm.log_ok = false;
}

int extree_map_log_sync(Extree *t)
{
    uint8_t *buf;
    uint64_t off, len;
    int ret = extree_map_log_records(t, &buf, &off, &len);

    if (ret == 0 && len) {
        ret = t->be->ops->pwrite(t->be->opaque, off, buf, len);
        if (ret < 0) {
            extree_map_log_failed(t);
        }
    }
    g_free(buf);
    return ret;
}

/*
 * Commit step 2: a log for an image with bitmaps, where the room allows
 * (it is a help, never a need: without it writes go to new space as
 * before); none for one without.  A new log is usable once the
 * superblock naming it is durable.
 */
int extree_mark_log_commit_prepare(Extree *t)
{
    /* for marks with bitmaps, for map records alone without */
    bool want = (extree_bitmap_count(t) || t->bm.map_wanted) &&
                !t->bm.no_log;
    uint64_t len = EXTREE_ROUND_UP(EXTREE_MARK_LOG_DEFAULT, t->block_size);
    int ret;

    if (want && t->bm.log && !(t->incompat & EXTREE_INCOMPAT_MAP_LOG)) {
        /* a log of an older writer: its records may be maps from now on */
        t->incompat |= EXTREE_INCOMPAT_MAP_LOG;
        t->super_dirty = true;
    }
    if (want && !t->bm.log) {
        if (extree_alloc_data_allowance(t, 0) / 2 < len) {
            return 0;
        }
        ret = extree_alloc_contig(t, len, &t->bm.log);
        if (ret < 0) {
            t->bm.log = 0;
            return ret == -ENOSPC ? 0 : ret;
        }
        t->bm.log_len = len;
        t->bm.log_ok = false;
        t->incompat |= EXTREE_INCOMPAT_MARK_LOG | EXTREE_INCOMPAT_MAP_LOG;
        t->super_dirty = true;
    } else if (!want && t->bm.log) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, t->bm.log, t->bm.log_len,
                                 false);
        if (ret < 0) {
            return ret;
        }
        t->bm.log = 0;
        t->bm.log_len = 0;
        t->bm.log_ok = false;
        t->incompat &= ~(EXTREE_INCOMPAT_MARK_LOG | EXTREE_INCOMPAT_MAP_LOG);
        t->super_dirty = true;
    }
    return 0;
}

/* Commit step 7: the bits are stored; the chain is stale */
void extree_mark_log_commit_done(Extree *t)
{
    t->bm.log_ok = t->bm.log != 0;
    t->bm.log_next = 0;
    t->bm.dirty_logged = false;
    extree_rs_clear(&t->bm.logged);
    map_state_clear(t);
}
