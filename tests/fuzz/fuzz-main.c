/*
 * extree fuzzing: replay inputs without libFuzzer (the regression test)
 *
 *   fuzz-regress [--tap] DIR|FILE...
 *
 * Feeds every file (of every directory, in name order) to the fuzz
 * target's LLVMFuzzerTestOneInput().  Built with any compiler; run under
 * ASan/UBSan by scripts/check.sh.  A violated oracle aborts; the name of
 * each input is printed on stderr before it runs.  With --tap, one TAP
 * test point per argument.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <glib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Run one file; false if it cannot be read */
static bool run_file(const char *path)
{
    gchar *data;
    gsize len;
    GError *err = NULL;

    if (!g_file_get_contents(path, &data, &len, &err)) {
        fprintf(stderr, "fuzz-regress: %s\n", err->message);
        g_error_free(err);
        return false;
    }
    /* on stderr: the last one named is the one that failed */
    fprintf(stderr, "input: %s\n", path);
    LLVMFuzzerTestOneInput((const uint8_t *)data, len);
    g_free(data);
    return true;
}

static gint cmp_str(gconstpointer a, gconstpointer b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Run @path, a file or every file of a directory; -1 on error */
static int run_path(const char *path)
{
    GPtrArray *names;
    const char *name;
    GDir *dir;
    int n = 0;

    if (!g_file_test(path, G_FILE_TEST_IS_DIR)) {
        return run_file(path) ? 1 : -1;
    }
    dir = g_dir_open(path, 0, NULL);
    if (!dir) {
        fprintf(stderr, "fuzz-regress: cannot open %s\n", path);
        return -1;
    }
    names = g_ptr_array_new_with_free_func(g_free);
    while ((name = g_dir_read_name(dir))) {
        g_ptr_array_add(names, g_build_filename(path, name, NULL));
    }
    g_dir_close(dir);
    g_ptr_array_sort(names, cmp_str);
    for (guint i = 0; i < names->len; i++) {
        if (!run_file(names->pdata[i])) {
            n = -1;
            break;
        }
        n++;
    }
    g_ptr_array_free(names, true);
    return n;
}

int main(int argc, char **argv)
{
    bool tap = argc > 1 && !strcmp(argv[1], "--tap");
    int first = tap ? 2 : 1, failed = 0;

    if (argc <= first) {
        fprintf(stderr, "usage: fuzz-regress [--tap] DIR|FILE...\n");
        return 2;
    }
    if (tap) {
        printf("1..%d\n", argc - first);
    }
    for (int i = first; i < argc; i++) {
        gint64 t0 = g_get_monotonic_time();
        int n = run_path(argv[i]);

        failed += n < 0;
        if (tap) {
            printf("%s %d - %s: %d inputs, %.1f s\n", n < 0 ? "not ok" : "ok",
                   i - first + 1, argv[i], MAX(n, 0),
                   (g_get_monotonic_time() - t0) / 1e6);
        } else {
            printf("%s: %d inputs\n", argv[i], n);
        }
        fflush(stdout);
    }
    return failed ? 1 : 0;
}
