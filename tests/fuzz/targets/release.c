/* The request parameters the native backend reads (backend_checks.h): the "bulk" flag and the
 * "ensemble-release" and "ensemble-shadow" parameters, which tritonserver forwards from a client's HTTP
 * header or gRPC metadata, so their values are any bytes. The release reaches Python as a str equal to
 * those bytes, or, when they are not UTF-8, a str with U+FFFD in place of each bad byte; None only when
 * absent. The shadow list yields only releases of 1 to 2^63 - 1, each written in digits in it, and stops.
 *
 * Input: one byte of parameter type, then the key up to the first NUL, then the value. */
#include "fuzz_python.h"
#include "native/backend_checks.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_start_python();
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    if (size < 1) return 0;
    const TS_ParameterType type = (TS_ParameterType)(data[0] % 5);
    const unsigned char *end = memchr(data + 1, 0, size - 1);
    const size_t key_size = end ? (size_t)(end - data - 1) : size - 1;
    const size_t value_size = end ? size - 2 - key_size : 0;
    char *key = malloc(key_size + 1), *value = malloc(value_size + 1);
    memcpy(key, data + 1, key_size);
    key[key_size] = '\0';
    if (value_size) memcpy(value, end + 1, value_size);
    value[value_size] = '\0';
    bool flag = value_size > 0 && value[0] != 0;
    const void *parameter = type == TS_PARAMETER_BOOL ? (const void *)&flag : (const void *)value;

    int bulk = 0;
    const char *release = NULL, *shadow = NULL;
    backend_parameter(key, type, parameter, &bulk, &release, &shadow);
    const bool shadowed = strcasecmp(key, "ensemble-shadow") == 0 && type == TS_PARAMETER_STRING;
    FUZZ_CHECK(shadowed ? shadow == value : shadow == NULL, "shadow %p", (const void *)shadow);
    const char *cursor = value;
    uint64_t candidate;
    int listed = 0;
    while (backend_shadow_next(&cursor, &candidate)) {
        FUZZ_CHECK(candidate >= 1 && candidate < (UINT64_C(1) << 63), "shadow release %llu out of range",
                   (unsigned long long)candidate);
        FUZZ_CHECK(cursor > value && cursor <= value + value_size, "shadow cursor out of the value");
        char written[24];
        snprintf(written, sizeof written, "%llu", (unsigned long long)candidate);
        FUZZ_CHECK(strstr(value, written) != NULL, "shadow release %s not written in the list", written);
        FUZZ_CHECK(++listed <= (int)value_size, "more shadow releases than bytes");
    }
    FUZZ_CHECK(bulk == (strcmp(key, "bulk") == 0 && type == TS_PARAMETER_BOOL && flag), "bulk %d", bulk);
    const bool named = strcasecmp(key, "ensemble-release") == 0 && type == TS_PARAMETER_STRING;
    FUZZ_CHECK(named ? release == value : release == NULL, "release %p", (const void *)release);

    PyObject *text = backend_release_object(release);
    FUZZ_CHECK(text != NULL, "release object");
    FUZZ_CHECK((text == Py_None) == (release == NULL), "release None iff absent");
    if (text != Py_None) {
        Py_ssize_t n;
        const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
        FUZZ_CHECK(utf8 != NULL, "the release's str is not encodable");
        PyObject *check = PyUnicode_DecodeUTF8(release, (Py_ssize_t)strlen(release), "strict");
        if (check != NULL) {  /* UTF-8: the str is exactly the bytes */
            FUZZ_CHECK((size_t)n == strlen(release) && memcmp(utf8, release, (size_t)n) == 0,
                       "the release's str differs from its bytes");
            Py_DECREF(check);
        } else {  /* not UTF-8: replaced, never a version number */
            PyErr_Clear();
            FUZZ_CHECK(PyUnicode_FindChar(text, 0xFFFD, 0, PyUnicode_GET_LENGTH(text), 1) >= 0,
                       "a release that is not UTF-8 has no replacement character");
        }
    }
    Py_DECREF(text);
    free(key);
    free(value);
    return 0;
}
