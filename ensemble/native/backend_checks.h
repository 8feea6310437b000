/* What the native backend (backend.c) reads of a request's own bytes before it trusts them: the
 * request parameters (the "bulk" flag, the "ensemble-release" and "ensemble-shadow" parameters a fleet's
 * gateway forwards from its headers), where an input's buffer lives, and whether a request is plain (each input in its served
 * type and width, its rows in one CPU buffer, its strings well formed). Pure functions of their
 * arguments, with no Triton call, so tests/fuzz compiles them into its fuzz targets as they are. */
#ifndef ENSEMBLE_BACKEND_CHECKS_H
#define ENSEMBLE_BACKEND_CHECKS_H

#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>

#include "api.h"
#include "triton_api.h"

#define PLAIN_MAX_ROWS (1 << 24) /* the most rows a plain request may have */

/* One request parameter into the request's bulk flag, release name and shadow list (valid while the
 * request is). */
static inline void backend_parameter(const char *key, TS_ParameterType type, const void *value, int *bulk,
                                     const char **release, const char **shadow) {
    if (key == NULL || value == NULL) return;
    if (strcmp(key, "bulk") == 0 && type == TS_PARAMETER_BOOL) *bulk = *(const bool *)value ? 1 : 0;
    if (strcasecmp(key, "ensemble-release") == 0 && type == TS_PARAMETER_STRING) *release = (const char *)value;
    if (strcasecmp(key, "ensemble-shadow") == 0 && type == TS_PARAMETER_STRING) *shadow = (const char *)value;
}

/* The next release named in a shadow list ("5" or "5,7": the releases that score a shadowed request
 * too, as the gateway writes it), from *cursor: its number in *release (1 to 2^63 - 1) and true, the
 * cursor moved past it; false at the end of the list. Anything but digits between the commas ends the
 * list, as does a number that would not fit. */
static inline bool backend_shadow_next(const char **cursor, uint64_t *release) {
    const char *s = *cursor;
    if (s == NULL || *s < '0' || *s > '9') return false;
    uint64_t value = 0;
    while (*s >= '0' && *s <= '9') {
        if (value > UINT64_C(922337203685477579)) return false; /* value * 10 + 9 would pass 2^63 - 1 */
        value = value * 10 + (uint64_t)(*s++ - '0');
    }
    if (*s != '\0' && *s != ',') return false;
    if (value == 0) return false;
    *cursor = *s == ',' ? s + 1 : s;
    *release = value;
    return true;
}

/* The release name for Python: a str, None when absent; bytes that are not UTF-8 with each bad byte
 * replaced by U+FFFD (a name no release has, which the rank model refuses as the client's error);
 * NULL only when out of memory. */
static inline PyObject *backend_release_object(const char *release) {
    if (release == NULL) return Py_NewRef(Py_None);
    return PyUnicode_DecodeUTF8(release, (Py_ssize_t)strlen(release), "replace");
}

/* Whether the backend can read a buffer in this memory (host memory, pinned or not). */
static inline bool backend_memory_readable(TS_MemoryType memory) {
    return memory == TS_MEMORY_CPU || memory == TS_MEMORY_CPU_PINNED;
}

/* Whether an input's properties fit a plain request whose inputs so far have `rows` rows (-1: none
 * yet): the served type, shape [rows x width], one buffer. */
static inline bool backend_plain_input(TS_DataType want_type, int64_t want_width, TS_DataType datatype,
                                       const int64_t *shape, uint32_t dims, uint32_t buffers, int64_t rows) {
    return datatype == want_type && dims == 2 && shape[0] >= 1 && shape[0] <= PLAIN_MAX_ROWS &&
           shape[1] == want_width && buffers == 1 && (rows < 0 || shape[0] == rows);
}

/* Whether that input's one buffer holds its [rows x width] values: float32 values, or exactly that many
 * strings in Triton's BYTES wire format; in memory the backend reads. */
static inline bool backend_plain_buffer(TS_DataType datatype, int64_t rows, int64_t width, TS_MemoryType memory,
                                        const void *buffer, uint64_t buffer_size) {
    if (!backend_memory_readable(memory) || rows < 1 || rows > PLAIN_MAX_ROWS || width < 1 ||
        width > INT64_MAX / PLAIN_MAX_ROWS)
        return false;
    const int64_t values = rows * width;
    if (datatype == TS_TYPE_FP32)
        return buffer_size % sizeof(float) == 0 && buffer_size / sizeof(float) == (uint64_t)values;
    return datatype == TS_TYPE_BYTES && ensemble_wire_offset(buffer, buffer_size, values) == buffer_size;
}

#endif
