/*
 * extree in QEMU: the core's CRC-32C is QEMU's crc32c()
 *
 * The core built alone (unit tests, fuzzers, the nbdkit plugin) has its
 * own (block/extree/extree-crc32c.c); in QEMU this file replaces it, so
 * there is one implementation in the binary, QEMU's (which uses SSE4.2's
 * crc32 instruction where the host has it, patches/qemu/0014).
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "qemu/crc32c.h"
#include "extree/extree-int.h"

/*
 * extree_crc32c() takes and returns finished values (init ~0, final ~0:
 * crc(A B) = extree_crc32c(crc(A), B)); crc32c() takes a raw register
 */
uint32_t extree_crc32c(uint32_t crc, const void *buf, size_t len)
{
    const uint8_t *p = buf;

    do {
        unsigned int n = MIN(len, (size_t)1 << 30);

        crc = crc32c(crc ^ 0xffffffff, p, n);
        p += n;
        len -= n;
    } while (len);
    return crc;
}
