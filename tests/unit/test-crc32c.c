/*
 * Unit tests: crc32c, as the core calls it (the crc32 instruction where
 * the CPU has SSE4.2) and the table version, which is tested on every
 * machine through extree_crc32c_software()
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"
#include "test-seed.h"

typedef struct CrcImpl {
    const char *name;
    uint32_t (*fn)(uint32_t crc, const void *buf, size_t len);
} CrcImpl;

static const CrcImpl impl[] = {
    { "core", extree_crc32c },
    { "software", extree_crc32c_software },
};

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

static void test_vectors(gconstpointer opaque)
{
    const CrcImpl *ci = opaque;
    uint8_t buf[32];

    g_assert_cmphex(ci->fn(0, "123456789", 9), ==, 0xE3069283);
    g_assert_cmphex(ci->fn(0, "", 0), ==, 0);
    /* RFC 3720 B.4 */
    memset(buf, 0, sizeof(buf));
    g_assert_cmphex(ci->fn(0, buf, 32), ==, 0x8A9136AA);
    memset(buf, 0xff, sizeof(buf));
    g_assert_cmphex(ci->fn(0, buf, 32), ==, 0x62A8AB43);
    for (int i = 0; i < 32; i++) {
        buf[i] = i;
    }
    g_assert_cmphex(ci->fn(0, buf, 32), ==, 0x46DD794E);
}

static void test_random_and_chained(gconstpointer opaque)
{
    const CrcImpl *ci = opaque;
    GRand *r = g_rand_new_with_seed(test_seed("random-and-chained", 1));
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

        g_assert_cmphex(ci->fn(0, buf + off, len), ==, want);
        c = ci->fn(0, buf + off, cut);
        c = ci->fn(c, buf + off + cut, len - cut);
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
static void test_block_boundaries(gconstpointer opaque)
{
    const CrcImpl *ci = opaque;
    size_t lens[] = { 0, 1, 7, 8, 9, 767, 768, 769, 775, 776, 1535, 1536,
                      4092, 12287, 12288, 12289, 12295, 13055, 13056, 13057,
                      16380, 16384, 24576, 24577, 36863, 36864, 65532 };
    uint8_t *buf = g_malloc(65536 + 16);
    GRand *r = g_rand_new_with_seed(test_seed("block-boundaries", 2));

    for (int i = 0; i < 65536 + 16; i++) {
        buf[i] = g_rand_int(r);
    }
    for (size_t i = 0; i < G_N_ELEMENTS(lens); i++) {
        for (size_t off = 0; off < 9; off++) {
            uint32_t want = ref_crc32c(buf + off, lens[i]);
            g_assert_cmphex(ci->fn(0, buf + off, lens[i]), ==, want);
        }
    }
    g_free(buf);
    g_rand_free(r);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    for (size_t i = 0; i < G_N_ELEMENTS(impl); i++) {
        char *p;

        p = g_strdup_printf("/crc32c/%s/vectors", impl[i].name);
        g_test_add_data_func(p, &impl[i], test_vectors);
        g_free(p);
        p = g_strdup_printf("/crc32c/%s/random-and-chained", impl[i].name);
        g_test_add_data_func(p, &impl[i], test_random_and_chained);
        g_free(p);
        p = g_strdup_printf("/crc32c/%s/block-boundaries", impl[i].name);
        g_test_add_data_func(p, &impl[i], test_block_boundaries);
        g_free(p);
    }
    return g_test_run();
}
