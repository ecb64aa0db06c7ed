/*
 * extree core: crc32c (Castagnoli, reflected, init ~0, final ~0)
 *
 * Portable slice-by-8 table version; on x86-64 with SSE4.2 the crc32
 * instruction is used instead (a 16 KiB node: ~2 us instead of ~10 us,
 * which matters because every commit checksums every dirty node).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

#define CRC32C_POLY 0x82f63b78u     /* reflected 0x1edc6f41 */

static uint32_t crc_table[8][256];

static void crc32c_init_table(void)
{
    for (unsigned i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1)));
        }
        crc_table[0][i] = c;
    }
    for (unsigned i = 0; i < 256; i++) {
        for (int s = 1; s < 8; s++) {
            uint32_t c = crc_table[s - 1][i];
            crc_table[s][i] = (c >> 8) ^ crc_table[0][c & 0xff];
        }
    }
}

static uint32_t crc32c_sw(uint32_t crc, const uint8_t *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
        len--;
    }
    while (len >= 8) {
        uint32_t lo = ext_ld32(p) ^ crc;
        uint32_t hi = ext_ld32(p + 4);
        crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
              crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
              crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
              crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    }
    return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define EXTREE_CRC_HW 1
__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p, size_t len)
{
    uint64_t c = crc;

    while (len && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        len -= 8;
    }
    while (len--) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    }
    return (uint32_t)c;
}
#endif

/* 0: not initialised, 1: table, 2: hardware */
static gsize crc_impl;

uint32_t extree_crc32c(uint32_t crc, const void *buf, size_t len)
{
    if (g_once_init_enter(&crc_impl)) {
        gsize impl = 1;
        crc32c_init_table();
#ifdef EXTREE_CRC_HW
        if (__builtin_cpu_supports("sse4.2") &&
            !g_getenv("EXTREE_CRC32C_SOFTWARE")) {
            impl = 2;
        }
#endif
        g_once_init_leave(&crc_impl, impl);
    }
#ifdef EXTREE_CRC_HW
    if (crc_impl == 2) {
        return ~crc32c_hw(~crc, buf, len);
    }
#endif
    return ~crc32c_sw(~crc, buf, len);
}
