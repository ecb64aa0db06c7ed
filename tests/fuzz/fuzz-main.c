/*
 * extree fuzzing: replay inputs without libFuzzer (the regression test)
 *
 *   fuzz-regress [--tap] DIR|FILE...
 *
 * Feeds every file (of every directory, in name order) to the fuzz
 * target's LLVMFuzzerTestOneInput().  Built with any compiler; run under
 * ASan/UBSan by scripts/check.sh.  A violated oracle aborts; the name of
 * the input being run is printed first.  With --tap, one TAP test point
 * per argument.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#if defined(__SANITIZE_ADDRESS__)
#define HAVE_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define HAVE_SANITIZER 1
#endif
#endif

#ifdef HAVE_SANITIZER
void __sanitizer_set_death_callback(void (*callback)(void));
#endif

static char current[4096];

static void say_current(void)
{
    static const char msg[] = "fuzz-regress: failing input: ";

    if (write(2, msg, sizeof(msg) - 1) < 0 ||
        write(2, current, strlen(current)) < 0 || write(2, "\n", 1) < 0) {
        return;
    }
}

static void on_signal(int sig)
{
    say_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

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
    g_strlcpy(current, path, sizeof(current));
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
#ifdef HAVE_SANITIZER
    __sanitizer_set_death_callback(say_current);
#else
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
#endif
    signal(SIGABRT, on_signal);
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
