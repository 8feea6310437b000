/* What every fuzz target shares: an embedded interpreter whose objects come from malloc (so
 * AddressSanitizer sees their bounds), and a check that stops the run with a message. */
#ifndef FUZZ_PYTHON_H
#define FUZZ_PYTHON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>

static inline void fuzz_start_python(void) {
    PyPreConfig preconfig;
    PyPreConfig_InitIsolatedConfig(&preconfig);
    preconfig.allocator = PYMEM_ALLOCATOR_MALLOC;
    if (PyStatus_Exception(Py_PreInitialize(&preconfig))) abort();
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);
    config.site_import = 0;
    config.install_signal_handlers = 0;
    if (PyStatus_Exception(Py_InitializeFromConfig(&config))) abort();
    PyConfig_Clear(&config);
}

#define FUZZ_CHECK(condition, ...)                                                        \
    do {                                                                                  \
        if (!(condition)) {                                                               \
            fprintf(stderr, "fuzz check failed (%s:%d): %s: ", __FILE__, __LINE__, #condition); \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fputc('\n', stderr);                                                          \
            if (PyErr_Occurred()) PyErr_Print();                                          \
            abort();                                                                      \
        }                                                                                 \
    } while (0)

/* The values of a BYTES wire buffer, walked independently of the code under test: how many, or -1
 * when the buffer is not exactly a sequence of (uint32 little-endian length, bytes). */
static inline long long fuzz_wire_count(const unsigned char *p, size_t size) {
    size_t at = 0;
    long long count = 0;
    while (at < size) {
        if (size - at < 4) return -1;
        const size_t length = (size_t)p[at] | (size_t)p[at + 1] << 8 | (size_t)p[at + 2] << 16 | (size_t)p[at + 3] << 24;
        at += 4;
        if (length > size - at) return -1;
        at += length;
        count++;
    }
    return count;
}

/* Value i of a wire buffer fuzz_wire_count accepted: its first byte and length. */
static inline const unsigned char *fuzz_wire_value(const unsigned char *p, long long i, size_t *length) {
    size_t at = 0;
    for (;;) {
        const size_t n = (size_t)p[at] | (size_t)p[at + 1] << 8 | (size_t)p[at + 2] << 16 | (size_t)p[at + 3] << 24;
        if (i-- == 0) {
            *length = n;
            return p + at + 4;
        }
        at += 4 + n;
    }
}

#endif
