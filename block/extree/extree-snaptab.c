/*
 * extree core: the snapshot table
 *
 * The table of snapshot entries the superblock points at: encode, decode
 * and validate at open, and the copy-on-write move of a changed table
 * (written at commit).  The operations on snapshots are extree-snap.c's;
 * the table sits below the transaction layer, which reads it at open and
 * writes it at commit.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stddef.h>

#include "extree-int.h"

#define SN_OFF(f) offsetof(ExtreeDiskSnapEntry, f)
#define SH_OFF(f) offsetof(ExtreeDiskSnapHeader, f)

static void snap_encode(uint8_t *p, const ExtreeSnap *sn)
{
    size_t ilen = strlen(sn->id), nlen = strlen(sn->name);

    memset(p, 0, EXTREE_SNAP_ENTRY_SIZE);
    extree_root_encode(p + SN_OFF(root), sn->root, sn->root_gen, sn->level);
    ext_st64(p + SN_OFF(generation), sn->generation);
    ext_st64(p + SN_OFF(virtual_size), sn->virtual_size);
    ext_st64(p + SN_OFF(extent_count), sn->extent_count);
    ext_st64(p + SN_OFF(extent_bytes), sn->extent_bytes);
    ext_st64(p + SN_OFF(date_sec), sn->date_sec);
    ext_st32(p + SN_OFF(date_nsec), sn->date_nsec);
    ext_st64(p + SN_OFF(vm_clock_nsec), sn->vm_clock_nsec);
    ext_st64(p + SN_OFF(vm_state_size), sn->vm_state_size);
    ext_st64(p + SN_OFF(icount), sn->icount);
    p[SN_OFF(id_len)] = ilen;
    p[SN_OFF(name_len)] = nlen;
    memcpy(p + SN_OFF(id), sn->id, ilen);
    memcpy(p + SN_OFF(name), sn->name, nlen);
}

/* Entry @p of a table read at open: every field within the spec's range */
static char *snap_decode(Extree *t, const uint8_t *p, ExtreeSnap *sn)
{
    uint64_t key_bytes;
    unsigned ilen = p[SN_OFF(id_len)] | (p[SN_OFF(id_len) + 1] << 8);
    unsigned nlen = p[SN_OFF(name_len)] | (p[SN_OFF(name_len) + 1] << 8);

    memset(sn, 0, sizeof(*sn));
    sn->root = ext_ld64(p + SN_OFF(root) + EXT_RT_BYTENR);
    sn->root_gen = ext_ld64(p + SN_OFF(root) + EXT_RT_GEN);
    sn->level = p[SN_OFF(root) + EXT_RT_LEVEL];
    sn->generation = ext_ld64(p + SN_OFF(generation));
    sn->virtual_size = ext_ld64(p + SN_OFF(virtual_size));
    sn->extent_count = ext_ld64(p + SN_OFF(extent_count));
    sn->extent_bytes = ext_ld64(p + SN_OFF(extent_bytes));
    sn->date_sec = ext_ld64(p + SN_OFF(date_sec));
    sn->date_nsec = ext_ld32(p + SN_OFF(date_nsec));
    sn->vm_clock_nsec = ext_ld64(p + SN_OFF(vm_clock_nsec));
    sn->vm_state_size = ext_ld64(p + SN_OFF(vm_state_size));
    sn->icount = ext_ld64(p + SN_OFF(icount));

    if (!EXTREE_IS_ALIGNED(sn->root, t->block_size) ||
        sn->root < t->data_start || sn->root >= t->host_end ||
        t->host_end - sn->root < t->node_size || sn->root_gen == 0 ||
        sn->root_gen > sn->generation || sn->generation >= t->generation ||
        sn->level >= EXTREE_MAX_LEVELS) {
        return g_strdup_printf("bad root, have offset 0x%" PRIx64
                               " generation %" PRIu64 " level %u (taken at "
                               "generation %" PRIu64 ")", sn->root,
                               sn->root_gen, sn->level, sn->generation);
    }
    key_bytes = EXTREE_ROUND_UP(sn->virtual_size, t->block_size) +
                EXTREE_VMSTATE_MAX;
    if (sn->virtual_size % 512 ||
        sn->virtual_size > EXTREE_SNAP_MAX_VIRTUAL_SIZE ||
        sn->extent_count > key_bytes / t->block_size ||
        !EXTREE_IS_ALIGNED(sn->extent_bytes, t->block_size) ||
        sn->extent_bytes > key_bytes || sn->date_nsec >= 1000000000 ||
        sn->vm_state_size > EXTREE_VMSTATE_MAX) {
        return g_strdup_printf("bad size or count, have virtual_size 0x%"
                               PRIx64 " extent_count %" PRIu64
                               " extent_bytes 0x%" PRIx64 " vm_state_size 0x%"
                               PRIx64, sn->virtual_size, sn->extent_count,
                               sn->extent_bytes, sn->vm_state_size);
    }
    if (ilen < 1 || ilen > EXTREE_SNAP_ID_MAX ||
        nlen > EXTREE_SNAP_NAME_MAX ||
        memchr(p + SN_OFF(id), 0, ilen) ||
        memchr(p + SN_OFF(name), 0, nlen) ||
        !extree_all_zero(p + SN_OFF(id) + ilen,
                         EXTREE_SNAP_ID_MAX + 1 - ilen) ||
        !extree_all_zero(p + SN_OFF(name) + nlen,
                         EXTREE_SNAP_NAME_MAX + 1 - nlen)) {
        return g_strdup_printf("bad id or name (lengths %u, %u)", ilen, nlen);
    }
    memcpy(sn->id, p + SN_OFF(id), ilen);
    memcpy(sn->name, p + SN_OFF(name), nlen);
    return NULL;
}

static uint32_t snap_table_csum(const uint8_t *buf, uint64_t len)
{
    uint8_t zero[4] = { 0 };
    uint32_t c = extree_crc32c(0, buf, SH_OFF(csum));

    c = extree_crc32c(c, zero, 4);
    return extree_crc32c(c, buf + SH_OFF(csum) + 4, len - SH_OFF(csum) - 4);
}

/* The table as it is in memory, ready to write (extree_snap_table_bytes()) */
uint8_t *extree_snap_table_encode(Extree *t, uint64_t *len)
{
    uint32_t n = t->snap.list->len;
    uint64_t used = sizeof(ExtreeDiskSnapHeader) +
                    (uint64_t)n * EXTREE_SNAP_ENTRY_SIZE;
    uint8_t *buf;

    *len = extree_snap_table_bytes(n, t->block_size);
    buf = g_malloc0(*len);
    ext_st32(buf + SH_OFF(magic), EXTREE_SNAP_MAGIC);
    ext_st32(buf + SH_OFF(count), n);
    ext_st32(buf + SH_OFF(entry_size), EXTREE_SNAP_ENTRY_SIZE);
    for (uint32_t i = 0; i < n; i++) {
        snap_encode(buf + sizeof(ExtreeDiskSnapHeader) +
                    (size_t)i * EXTREE_SNAP_ENTRY_SIZE,
                    &g_array_index(t->snap.list, ExtreeSnap, i));
    }
    ext_st32(buf + SH_OFF(csum), snap_table_csum(buf, used));
    return buf;
}

/* Open: read and validate the snapshot table @sb names.  O(snapshots). */
int extree_snap_table_load(Extree *t, const ExtreeSuper *sb)
{
    uint64_t len = extree_snap_table_bytes(sb->snap_count, t->block_size);
    uint64_t used = sizeof(ExtreeDiskSnapHeader) +
                    (uint64_t)sb->snap_count * EXTREE_SNAP_ENTRY_SIZE;
    GHashTable *ids;
    uint8_t *buf;
    char *why = NULL;
    int ret;

    t->snap.list = g_array_new(false, false, sizeof(ExtreeSnap));
    if (!sb->snap_count) {
        return 0;
    }
    buf = g_malloc(len);
    ret = t->be->ops->pread(t->be->opaque, sb->snap_table, buf, len);
    if (ret < 0) {
        g_free(buf);
        return ret;
    }
    if (ext_ld32(buf + SH_OFF(magic)) != EXTREE_SNAP_MAGIC) {
        why = g_strdup_printf("bad magic 0x%08x",
                              ext_ld32(buf + SH_OFF(magic)));
    } else if (ext_ld32(buf + SH_OFF(csum)) != snap_table_csum(buf, used)) {
        why = g_strdup_printf("bad checksum, have 0x%08x expect 0x%08x",
                              ext_ld32(buf + SH_OFF(csum)),
                              snap_table_csum(buf, used));
    } else if (ext_ld32(buf + SH_OFF(count)) != sb->snap_count ||
               ext_ld32(buf + SH_OFF(entry_size)) !=
               EXTREE_SNAP_ENTRY_SIZE) {
        why = g_strdup_printf("bad count %u or entry size %u, expect %u "
                              "and %u", ext_ld32(buf + SH_OFF(count)),
                              ext_ld32(buf + SH_OFF(entry_size)),
                              sb->snap_count, EXTREE_SNAP_ENTRY_SIZE);
    }
    ids = g_hash_table_new(g_str_hash, g_str_equal);
    for (uint32_t i = 0; !why && i < sb->snap_count; i++) {
        ExtreeSnap sn;

        why = snap_decode(t, buf + sizeof(ExtreeDiskSnapHeader) +
                          (size_t)i * EXTREE_SNAP_ENTRY_SIZE, &sn);
        if (!why) {
            g_array_append_val(t->snap.list, sn);
            if (!g_hash_table_add(ids, g_array_index(t->snap.list, ExtreeSnap,
                                                     i).id)) {
                why = g_strdup_printf("snapshot id '%s' used twice", sn.id);
            }
        }
        if (why) {
            char *w = g_strdup_printf("entry %u: %s", i, why);
            g_free(why);
            why = w;
        }
    }
    g_hash_table_destroy(ids);
    g_free(buf);
    if (why) {
        ret = extree_corrupt(t, sb->snap_table, "corrupt snapshot table at "
                             "offset 0x%" PRIx64 ": %s", sb->snap_table, why);
        g_free(why);
        g_array_set_size(t->snap.list, 0);
        return ret;
    }
    t->snap.table = sb->snap_table;
    t->snap.table_len = len;
    return 0;
}

/*
 * The table changed in this transaction: its old copy is freed, the new
 * one gets new space (copy-on-write; written at commit)
 */
int extree_snap_table_moved(Extree *t)
{
    uint64_t len = extree_snap_table_bytes(t->snap.list->len, t->block_size);
    uint64_t host;
    int ret;

    if (t->snap.table) {
        ret = t->sm.ops->dec_ref(t->sm.opaque, t->snap.table,
                                 t->snap.table_len, false);
        if (ret < 0) {
            return ret;
        }
        t->snap.table = t->snap.table_len = 0;
    }
    t->snap.dirty = true;
    t->super_dirty = true;
    if (!t->snap.list->len) {
        return 0;
    }
    ret = extree_alloc_contig(t, len, &host);
    if (ret < 0) {
        return ret;
    }
    t->snap.table = host;
    t->snap.table_len = len;
    return 0;
}
