/* _native.split_wire on any bytes, as the served path calls it on a request's BYTES tensor: it returns
 * exactly the values an independent walk finds (join_wire gives the buffer back), or raises
 * ValueError when the walk finds the buffer malformed. */
#include "fuzz_python.h"
#include "native/_request.c"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_start_python();
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    PyObject *view = PyMemoryView_FromMemory((char *)data, (Py_ssize_t)size, PyBUF_READ);
    FUZZ_CHECK(view != NULL, "memoryview");
    PyObject *values = split_wire(NULL, view);
    const long long expected = fuzz_wire_count(data, size);
    if (expected < 0) {
        FUZZ_CHECK(values == NULL && PyErr_ExceptionMatches(PyExc_ValueError), "malformed buffer of %zu bytes accepted",
                   size);
        PyErr_Clear();
    } else {
        FUZZ_CHECK(values != NULL && PyList_GET_SIZE(values) == expected, "%lld values expected", expected);
        for (long long i = 0; i < expected; i++) {
            size_t length;
            const unsigned char *value = fuzz_wire_value(data, i, &length);
            PyObject *item = PyList_GET_ITEM(values, i);
            FUZZ_CHECK(PyBytes_GET_SIZE(item) == (Py_ssize_t)length && memcmp(PyBytes_AS_STRING(item), value, length) == 0,
                       "value %lld differs", i);
        }
        PyObject *joined = join_wire(NULL, values);
        FUZZ_CHECK(joined != NULL && PyBytes_GET_SIZE(joined) == (Py_ssize_t)size &&
                       memcmp(PyBytes_AS_STRING(joined), data, size) == 0,
                   "join_wire(split_wire(buffer)) != buffer");
        Py_DECREF(joined);
        FUZZ_CHECK(Py_REFCNT(values) == 1, "the list is referenced elsewhere");
        Py_DECREF(values);
    }
    Py_DECREF(view);
    return 0;
}
