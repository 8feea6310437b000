/* The categorical lookup straight from a request's BYTES tensor (_native.Vocabulary.lookup_wire, the
 * served path's and the C chain's): against the vocabularies' own dicts, on any bytes.
 *
 * Input: one byte of mode, then a wire buffer. Mode bit 0 set: a one-column vocabulary is built from
 * the buffer's own values (hostile keys: long, empty, colliding) and each value must find the id of its
 * first occurrence. Clear: three fixed columns of short (inline) and long (arena) keys, and each value
 * must get dict.get(value, fallback). Bits 1-2 make the expected count wrong (one less, one more, zero),
 * which must be refused. */
#include "fuzz_python.h"
#include "native/_request.c"

#define FALLBACK 7

static PyObject *fixed; /* the three-column Vocabulary */
static PyObject *fixed_tables;

static PyObject *make_vocabulary(PyObject *tables) {
    PyObject *args = PyTuple_Pack(1, tables);
    PyObject *vocabulary = vocabulary_new(&VocabularyType, args, NULL);
    Py_DECREF(args);
    return vocabulary;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_start_python();
    if (PyType_Ready(&VocabularyType) < 0) abort();
    static const char *keys[3][6] = {
        {"", "a", "68fd1e64", "05db9164", "this key is longer than eight bytes", "x\xff"},
        {"\x00", "8cf07265", "ab", "0123456789", "25c83c98", "zz"},
        {"7e0ccccf", "", "a1b2c3d4e5f6a7b8c9d0", "fbad5c96", "q", "1"},
    };
    fixed_tables = PyTuple_New(3);
    for (int j = 0; j < 3; j++) {
        PyObject *table = PyDict_New();
        for (int k = 0; k < 6; k++) {
            const size_t n = (j == 1 && k == 0) ? 1 : strlen(keys[j][k]);
            PyObject *key = PyBytes_FromStringAndSize(keys[j][k], (Py_ssize_t)n), *id = PyLong_FromLong(100 * j + k + 1);
            PyDict_SetItem(table, key, id);
            Py_DECREF(key);
            Py_DECREF(id);
        }
        PyTuple_SET_ITEM(fixed_tables, j, table);
    }
    fixed = make_vocabulary(fixed_tables);
    if (fixed == NULL) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    if (size < 1) return 0;
    const unsigned mode = data[0];
    const unsigned char *wire = data + 1;
    const size_t wire_size = size - 1;
    const long long values = fuzz_wire_count(wire, wire_size);
    PyObject *tables = fixed_tables, *vocabulary = fixed;
    if ((mode & 1) && values >= 0) { /* the buffer's own values as the vocabulary, id = first index */
        PyObject *table = PyDict_New();
        for (long long i = 0; i < values; i++) {
            size_t n;
            const unsigned char *v = fuzz_wire_value(wire, i, &n);
            PyObject *key = PyBytes_FromStringAndSize((const char *)v, (Py_ssize_t)n), *id = PyLong_FromLongLong(i);
            if (PyDict_GetItem(table, key) == NULL) PyDict_SetItem(table, key, id);
            Py_DECREF(key);
            Py_DECREF(id);
        }
        tables = PyTuple_Pack(1, table);
        Py_DECREF(table);
        vocabulary = make_vocabulary(tables);
        FUZZ_CHECK(vocabulary != NULL, "Vocabulary of the buffer's values");
    }
    const Vocabulary *v = (const Vocabulary *)vocabulary;
    long long count = values < 0 ? (long long)(mode >> 3) : values;
    if (((mode >> 1) & 3) == 1) count -= 1;
    if (((mode >> 1) & 3) == 2) count += 1;
    if (((mode >> 1) & 3) == 3) count = 0;
    if (count < 0) count = 0;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    char error[ENSEMBLE_ERROR_SIZE] = "";
    const int failed = lookup_wire(v, wire, wire_size, FALLBACK, ids, (size_t)count, error, sizeof error);
    if (values < 0 || count != values) {
        FUZZ_CHECK(failed && error[0] != '\0', "%lld values looked up as %lld", values, count);
    } else {
        FUZZ_CHECK(!failed, "well-formed buffer refused: %s", error);
        for (long long i = 0; i < count; i++) {
            size_t n;
            const unsigned char *value = fuzz_wire_value(wire, i, &n);
            PyObject *key = PyBytes_FromStringAndSize((const char *)value, (Py_ssize_t)n);
            PyObject *found = PyDict_GetItem(PyTuple_GET_ITEM(tables, i % v->columns), key);
            const long long want = found ? PyLong_AsLongLong(found) : FALLBACK;
            FUZZ_CHECK(ids[i] == want, "value %lld: id %lld, the dict's %lld", i, (long long)ids[i], want);
            Py_DECREF(key);
        }
    }
    free(ids);
    if (vocabulary != fixed) {
        Py_DECREF(vocabulary);
        Py_DECREF(tables);
    }
    return 0;
}
