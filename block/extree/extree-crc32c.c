/*
 * extree core: crc32c (Castagnoli, reflected, init ~0, final ~0)
 *
 * Portable slice-by-8 table version; on x86-64 with SSE4.2 the crc32
 * instruction is used instead, three streams at a time (a 16 KiB node:
 * well under 1 us instead of ~10 us, which matters because every commit
 * checksums every dirty node).
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

/*
 * The crc32 instruction has a latency of 3 cycles and a throughput of 1 a
 * cycle: three independent streams over three consecutive pieces of a
 * buffer run about three times as fast as one.  The pieces are then joined
 * with CRC linearity, crc(A B) = crc(A) * x^(8 |B|) + crc(B) mod P (raw
 * registers, crc(B) from 0), where "* x^(8 |B|)" is a table lookup for the
 * two piece lengths used (zlib's crc32_combine, Mark Adler's crc32c.c).
 */
#define CRC_LONG    4096
#define CRC_SHORT   256

static uint32_t crc_long_tab[4][256], crc_short_tab[4][256];

/* a * b mod P, reflected (bit 31 is x^0) */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;

    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) {
                break;
            }
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* The operator "append @len zero bytes" as four byte-indexed tables */
static void crc_shift_init(uint32_t tab[4][256], uint64_t len)
{
    uint32_t xpow = 1u << 31, sq = 1u << 30;    /* x^0, x^1 */

    /* x^(8 len) by squaring */
    for (uint64_t n = 8 * len; n; n >>= 1) {
        if (n & 1) {
            xpow = multmodp(sq, xpow);
        }
        sq = multmodp(sq, sq);
    }
    for (int k = 0; k < 4; k++) {
        for (uint32_t b = 0; b < 256; b++) {
            tab[k][b] = multmodp(xpow, b << (8 * k));
        }
    }
}

static inline uint32_t crc_shift(const uint32_t tab[4][256], uint32_t c)
{
    return tab[0][c & 0xff] ^ tab[1][(c >> 8) & 0xff] ^
           tab[2][(c >> 16) & 0xff] ^ tab[3][c >> 24];
}

/* Three streams over blocks of 3 @len bytes, as long as they last */
__attribute__((target("sse4.2")))
static uint64_t crc32c_hw3(uint64_t c0, const uint8_t **pp, size_t *lenp,
                           size_t len, const uint32_t tab[4][256])
{
    const uint8_t *p = *pp;

    while (*lenp >= 3 * len) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *end = p + len;

        do {
            uint64_t a, b, d;
            memcpy(&a, p, 8);
            memcpy(&b, p + len, 8);
            memcpy(&d, p + 2 * len, 8);
            c0 = __builtin_ia32_crc32di(c0, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, d);
            p += 8;
        } while (p < end);
        c0 = crc_shift(tab, (uint32_t)c0) ^ c1;
        c0 = crc_shift(tab, (uint32_t)c0) ^ c2;
        p += 2 * len;
        *lenp -= 3 * len;
    }
    *pp = p;
    return c0;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p, size_t len)
{
    uint64_t c = crc;

    while (len && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        len--;
    }
    c = crc32c_hw3(c, &p, &len, CRC_LONG, crc_long_tab);
    c = crc32c_hw3(c, &p, &len, CRC_SHORT, crc_short_tab);
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

static inline void crc32c_init(void)
{
    if (g_once_init_enter(&crc_impl)) {
        gsize impl = 1;
        crc32c_init_table();
#ifdef EXTREE_CRC_HW
        if (__builtin_cpu_supports("sse4.2") &&
            !g_getenv("EXTREE_CRC32C_SOFTWARE")) {
            crc_shift_init(crc_long_tab, CRC_LONG);
            crc_shift_init(crc_short_tab, CRC_SHORT);
            impl = 2;
        }
#endif
        g_once_init_leave(&crc_impl, impl);
    }
}

uint32_t extree_crc32c(uint32_t crc, const void *buf, size_t len)
{
    crc32c_init();
#ifdef EXTREE_CRC_HW
    if (crc_impl == 2) {
        return ~crc32c_hw(~crc, buf, len);
    }
#endif
    return ~crc32c_sw(~crc, buf, len);
}

/* See extree-int.h */
uint32_t extree_crc32c_software(uint32_t crc, const void *buf, size_t len)
{
    crc32c_init();
    return ~crc32c_sw(~crc, buf, len);
}
