/* _native.tsv_to_wire, the batch-scoring client's parse of Criteo-shaped lines, on any bytes: None
 * (outside its grammar) or a BYTES wire buffer of rows x categorical values whose row ends, labels and
 * dense values fill their outputs exactly.
 *
 * Input: one byte of shape (rows 0-7, label or not, dense columns 0-3... from its bits), then the lines. */
#include "fuzz_python.h"
#include "native/_request.c"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_start_python();
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    if (size < 1) return 0;
    const Py_ssize_t rows = data[0] & 7, label = (data[0] >> 3) & 1, n_dense = (data[0] >> 4) & 3,
                     n_cat = (data[0] >> 6) & 3;
    PyObject *blob = PyMemoryView_FromMemory((char *)data + 1, (Py_ssize_t)size - 1, PyBUF_READ);
    PyObject *labels = PyByteArray_FromStringAndSize(NULL, rows);
    PyObject *dense = PyByteArray_FromStringAndSize(NULL, rows * n_dense * 4);
    PyObject *ends = PyByteArray_FromStringAndSize(NULL, rows * 8);
    PyObject *args = Py_BuildValue("(OnOnnOOO)", blob, rows, label ? Py_True : Py_False, n_dense, n_cat, labels, dense,
                                   ends);
    FUZZ_CHECK(args != NULL, "arguments");
    PyObject *wire = tsv_to_wire(NULL, args);
    FUZZ_CHECK(wire != NULL, "tsv_to_wire raised");
    if (wire != Py_None) {
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(wire);
        const size_t wire_size = (size_t)PyBytes_GET_SIZE(wire);
        FUZZ_CHECK(fuzz_wire_count(p, wire_size) == rows * n_cat, "%zd x %zd values expected", rows, n_cat);
        const int64_t *end = (const int64_t *)PyByteArray_AS_STRING(ends);
        for (Py_ssize_t r = 0; r < rows; r++)
            FUZZ_CHECK(end[r] >= (r ? end[r - 1] : 0) && (size_t)end[r] <= wire_size, "row %zd ends at %lld", r,
                       (long long)end[r]);
        FUZZ_CHECK(rows == 0 || (size_t)end[rows - 1] == wire_size, "the last row ends before the buffer");
    }
    Py_DECREF(wire);
    Py_DECREF(args);
    Py_DECREF(blob);
    Py_DECREF(labels);
    Py_DECREF(dense);
    Py_DECREF(ends);
    return 0;
}
