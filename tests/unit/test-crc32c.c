/*
 * Unit tests: crc32c
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

/* Bit-at-a-time reference */
static uint32_t ref_crc32c(const uint8_t *p, size_t len)
{
    uint32_t c = ~0u;
    while (len--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) {
            c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
        }
    }
    return ~c;
}

static void test_vectors(void)
{
    uint8_t buf[32];

    g_assert_cmphex(extree_crc32c(0, "123456789", 9), ==, 0xE3069283);
    g_assert_cmphex(extree_crc32c(0, "", 0), ==, 0);
    /* RFC 3720 B.4 */
    memset(buf, 0, sizeof(buf));
    g_assert_cmphex(extree_crc32c(0, buf, 32), ==, 0x8A9136AA);
    memset(buf, 0xff, sizeof(buf));
    g_assert_cmphex(extree_crc32c(0, buf, 32), ==, 0x62A8AB43);
    for (int i = 0; i < 32; i++) {
        buf[i] = i;
    }
    g_assert_cmphex(extree_crc32c(0, buf, 32), ==, 0x46DD794E);
}

static void test_random_and_chained(void)
{
    GRand *r = g_rand_new_with_seed(1);
    uint8_t *buf = g_malloc(70000);

    for (int i = 0; i < 70000; i++) {
        buf[i] = g_rand_int(r);
    }
    for (int iter = 0; iter < 200; iter++) {
        size_t off = g_rand_int_range(r, 0, 64);
        size_t len = g_rand_int_range(r, 0, 69000 - 64);
        size_t cut = len ? g_rand_int_range(r, 0, len) : 0;
        uint32_t want = ref_crc32c(buf + off, len);
        uint32_t c;

        g_assert_cmphex(extree_crc32c(0, buf + off, len), ==, want);
        c = extree_crc32c(0, buf + off, cut);
        c = extree_crc32c(c, buf + off + cut, len - cut);
        g_assert_cmphex(c, ==, want);
    }
    g_free(buf);
    g_rand_free(r);
}

/*
 * Every length around the sizes where the hardware version switches
 * between its three-stream blocks (3 x 4096, 3 x 256) and one stream, at
 * every alignment; in software too
 */
static void test_block_boundaries(void)
{
    size_t lens[] = { 0, 1, 7, 8, 9, 767, 768, 769, 775, 776, 1535, 1536,
                      4092, 12287, 12288, 12289, 12295, 13055, 13056, 13057,
                      16380, 16384, 24576, 24577, 36863, 36864, 65532 };
    uint8_t *buf = g_malloc(65536 + 16);
    GRand *r = g_rand_new_with_seed(2);

    for (int i = 0; i < 65536 + 16; i++) {
        buf[i] = g_rand_int(r);
    }
    for (size_t i = 0; i < G_N_ELEMENTS(lens); i++) {
        for (size_t off = 0; off < 9; off++) {
            uint32_t want = ref_crc32c(buf + off, lens[i]);
            g_assert_cmphex(extree_crc32c(0, buf + off, lens[i]), ==, want);
        }
    }
    g_free(buf);
    g_rand_free(r);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/crc32c/vectors", test_vectors);
    g_test_add_func("/crc32c/random-and-chained", test_random_and_chained);
    g_test_add_func("/crc32c/block-boundaries", test_block_boundaries);
    return g_test_run();
}
