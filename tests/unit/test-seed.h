/*
 * Seeds of the randomized unit tests
 *
 * Fixed by default, so that every run of the test suite does the same
 * thing.  EXTREE_TEST_SEED=<n> runs every randomized test with seed n
 * instead, EXTREE_TEST_SEED=random with a new seed each run (soak runs);
 * the seed in use is printed as a TAP comment, so a failure can be
 * replayed.  EXTREE_SEED=<n> is the older name of the variable.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef TESTS_UNIT_TEST_SEED_H
#define TESTS_UNIT_TEST_SEED_H

#include <inttypes.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>

/* @fixed, or what EXTREE_TEST_SEED asks for; printed */
static inline uint64_t test_seed(const char *what, uint64_t fixed)
{
    static uint64_t random_seed;
    const char *env = g_getenv("EXTREE_TEST_SEED");
    uint64_t seed = fixed;

    if (!env || !*env) {
        env = g_getenv("EXTREE_SEED");
    }
    if (env && !strcmp(env, "random")) {
        /* one per process: every test of the run replays with it */
        while (!random_seed) {
            random_seed = (uint64_t)g_get_real_time() *
                          0x9e3779b97f4a7c15ULL ^ getpid();
        }
        seed = random_seed;
    } else if (env && *env) {
        seed = g_ascii_strtoull(env, NULL, 0);
    }
    g_test_message("%s: seed %" PRIu64 " (%s; EXTREE_TEST_SEED=%" PRIu64
                   " replays it)", what, seed,
                   env && *env ? "from the environment" : "fixed", seed);
    return seed;
}

#endif
