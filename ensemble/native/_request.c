/* The per-value loops of the request path, in C.
 *
 * A 100-row request carries 2,600 categorical strings. In Python, splitting Triton's BYTES wire
 * format into bytes objects, looking each one up in its column's vocabulary and (on the client)
 * joining them back into the wire format cost about 0.4-0.5 ms each on the build machine: a third
 * of the fused ranker's time per 100-row request. These three functions do the same work with
 * the same objects (Python bytes, the vocabularies' own dicts), so results are identical by
 * construction; ensemble/native/__init__.py falls back to the Python loops when this module was not built.
 * gather joins the cached rows of a ranking request by ids (ensemble/online.py).
 * Two more do a request's elementwise arithmetic in one pass each (the continuous features before
 * their logarithm; the blender), where numpy's ten-odd calls per step cost ~20 us at one row.
 *
 * Wire format (Triton BYTES tensor): per element a uint32 little-endian length, then the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <zlib.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "api.h"

/* split_wire(buffer) -> list[bytes] */
static PyObject *split_wire(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t size = view.len, offset = 0, count = 0;
    /* First pass: count and validate, so the list is allocated once. */
    while (offset < size) {
        if (size - offset < 4) goto truncated;
        uint32_t length = ensemble_u32le(data + offset);
        offset += 4;
        if ((Py_ssize_t)length > size - offset) goto truncated;
        offset += length;
        count++;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) { PyBuffer_Release(&view); return NULL; }
    /* Second pass: every bound checked again, since the buffer may be memory another process writes
     * meanwhile (a client's shared-memory region). */
    offset = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (size - offset < 4) goto changed;
        uint32_t length = ensemble_u32le(data + offset);
        offset += 4;
        if ((Py_ssize_t)length > size - offset) goto changed;
        PyObject *item = PyBytes_FromStringAndSize((const char *)data + offset, length);
        if (item == NULL) { Py_DECREF(out); PyBuffer_Release(&view); return NULL; }
        PyList_SET_ITEM(out, i, item);
        offset += length;
    }
    PyBuffer_Release(&view);
    return out;
changed:
    Py_DECREF(out);
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "BYTES tensor changed while it was read (at byte %zd of %zd)", offset, size);
    return NULL;
truncated:
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "BYTES tensor truncated at byte %zd of %zd", offset, size);
    return NULL;
}

/* join_wire(list[bytes]) -> bytes */
static PyObject *join_wire(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "join_wire takes a list of bytes");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(arg), total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        if (!PyBytes_Check(item)) {
            PyErr_Format(PyExc_TypeError, "element %zd is %s, not bytes", i, Py_TYPE(item)->tp_name);
            return NULL;
        }
        if (PyBytes_GET_SIZE(item) > (Py_ssize_t)UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "element %zd is longer than 4 GiB", i);
            return NULL;
        }
        total += 4 + PyBytes_GET_SIZE(item);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        Py_ssize_t length = PyBytes_GET_SIZE(item);
        dst[0] = length & 0xff; dst[1] = (length >> 8) & 0xff;
        dst[2] = (length >> 16) & 0xff; dst[3] = (length >> 24) & 0xff;
        memcpy(dst + 4, PyBytes_AS_STRING(item), length);
        dst += 4 + length;
    }
    return out;
}

/* lookup(values: list, tables: tuple[dict, ...], default: int, out: writable int64 buffer) -> None
 *
 * out[i] = tables[i % len(tables)].get(values[i], default): row-major values, one dict per column.
 */
static PyObject *lookup(PyObject *self, PyObject *args) {
    PyObject *values, *tables;
    long long fallback;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!O!Lw*", &PyList_Type, &values, &PyTuple_Type, &tables, &fallback, &out))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(values), columns = PyTuple_GET_SIZE(tables);
    if (columns == 0 || out.len != count * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "lookup: %zd values, %zd tables, %zd output bytes", count, columns, out.len);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < columns; j++) {
        if (!PyDict_Check(PyTuple_GET_ITEM(tables, j))) {
            PyBuffer_Release(&out);
            PyErr_SetString(PyExc_TypeError, "lookup: tables must be dicts");
            return NULL;
        }
    }
    int64_t *ids = out.buf;
    for (Py_ssize_t i = 0, j = 0; i < count; i++, j = (j + 1 == columns) ? 0 : j + 1) {
        PyObject *found = PyDict_GetItemWithError(PyTuple_GET_ITEM(tables, j), PyList_GET_ITEM(values, i));
        if (found == NULL) {
            if (PyErr_Occurred()) {  /* an unhashable value: the caller's dict.get would raise too */
                PyBuffer_Release(&out);
                return NULL;
            }
            ids[i] = fallback;
            continue;
        }
        long long id = PyLong_AsLongLong(found);
        if (id == -1 && PyErr_Occurred()) { PyBuffer_Release(&out); return NULL; }
        ids[i] = id;
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* dense_prepare(src: float32 buffer, out: writable float32 buffer, fill: float, clip_min: float) -> None
 *
 * The continuous features' arithmetic before the logarithm, in one pass and in float32 as numpy does
 * it: a value that is not finite becomes ``fill``, then max(value, clip_min), then value + 1. The
 * caller takes the logarithm with numpy (its float32 log is the one the workflow was fitted with).
 */
static void prepare(const void *x, float *y, size_t n, float fill, float clip_min) {
    /* x may lie at any address: a request's float32 tensor starts wherever its client's request body put it
     * (an HTTP request's binary data follows a JSON header of any length), so each value is copied out. */
    const unsigned char *bytes = x;
    for (size_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, bytes + i * sizeof v, sizeof v);
        v = isfinite(v) ? v : fill;
        v = v < clip_min ? clip_min : v;
        y[i] = v + 1.0f;
    }
}

static PyObject *dense_prepare(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    double fill, clip_min;
    if (!PyArg_ParseTuple(args, "y*w*dd", &src, &out, &fill, &clip_min)) return NULL;
    if (src.len != out.len || src.len % (Py_ssize_t)sizeof(float) != 0) {
        PyErr_Format(PyExc_ValueError, "dense_prepare: %zd input bytes, %zd output bytes", src.len, out.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    prepare(src.buf, out.buf, (size_t)src.len / sizeof(float), (float)fill, (float)clip_min);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* blend(scores: tuple of float32 buffers of B values, weights: tuple of float, bias: float, eps: float,
 *       out: writable float32 buffer of B) -> None
 *
 * out[b] = sigmoid(bias + sum_m weights[m] * logit(clip(scores[m][b], eps, 1 - eps))), in float64
 * like the blender's numpy form, rounded to float32 once at the end.
 */
#define BLEND_MAX 16
static void blend_rows(const float *const *scores, int models, const double *w, double bias, double eps, float *y,
                       size_t rows) {
    for (size_t b = 0; b < rows; b++) {
        double z = 0.0;
        for (int m = 0; m < models; m++) {
            double p = scores[m][b];
            p = p < eps ? eps : (p > 1.0 - eps ? 1.0 - eps : p);
            z += (log(p) - log1p(-p)) * w[m];
        }
        z += bias;
        y[b] = (float)(1.0 / (1.0 + exp(-z)));
    }
}

static PyObject *blend(PyObject *self, PyObject *args) {
    PyObject *scores, *weights;
    double bias, eps;
    Py_buffer out, views[BLEND_MAX];
    double w[BLEND_MAX];
    if (!PyArg_ParseTuple(args, "O!O!ddw*", &PyTuple_Type, &scores, &PyTuple_Type, &weights, &bias, &eps, &out))
        return NULL;
    Py_ssize_t models = PyTuple_GET_SIZE(scores), taken = 0;
    Py_ssize_t rows = out.len / (Py_ssize_t)sizeof(float);
    if (models == 0 || models > BLEND_MAX || PyTuple_GET_SIZE(weights) != models) {
        PyErr_Format(PyExc_ValueError, "blend: %zd score arrays, %zd weights", models, PyTuple_GET_SIZE(weights));
        goto fail;
    }
    for (Py_ssize_t m = 0; m < models; m++) {
        w[m] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, m));
        if (w[m] == -1.0 && PyErr_Occurred()) goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(scores, m), &views[m], PyBUF_C_CONTIGUOUS) < 0) goto fail;
        taken++;
        if (views[m].len != out.len) {
            PyErr_Format(PyExc_ValueError, "blend: score array %zd has %zd bytes, the output %zd", m, views[m].len, out.len);
            goto fail;
        }
    }
    const float *columns[BLEND_MAX];
    for (Py_ssize_t m = 0; m < models; m++) columns[m] = views[m].buf;
    blend_rows(columns, (int)models, w, bias, eps, out.buf, (size_t)rows);
    for (Py_ssize_t m = 0; m < taken; m++) PyBuffer_Release(&views[m]);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t m = 0; m < taken; m++) PyBuffer_Release(&views[m]);
    PyBuffer_Release(&out);
    return NULL;
}

/* Vocabulary: the categorical columns' dicts (bytes -> id) as open-addressing tables over one arena
 * of key bytes, so Triton's BYTES wire buffer is looked up in place, with no bytes object per value.
 * Built from the same dicts as ``lookup``; a key in the dict is found with the dict's id, anything
 * else gets the fallback id, so both paths give the same ids.
 *
 * Served, a request's lookups find the tables cold (the rest of the request has been through the
 * caches since the last one): one lookup waited on up to two cache misses, the slot and its key's
 * bytes, ~15% of the server's CPU at 100 rows. So a key of at most 8 bytes (Criteo's are 8) is kept
 * in its slot, and the lookup first hashes every value of the buffer and prefetches its slot, then
 * probes: the misses overlap instead of coming one after another. */
typedef struct {
    uint64_t hash;  /* 0: empty slot (hashes are forced odd) */
    int64_t id;
    uint64_t inline_key;  /* a key of at most INLINE_KEY bytes, zero-padded; else 0 */
    uint32_t length;
    uint32_t offset;  /* a longer key's bytes in the arena */
} VocabSlot;

#define INLINE_KEY 8

typedef struct {
    VocabSlot *slots;
    size_t mask;
} VocabTable;

typedef struct {
    PyObject_HEAD
    Py_ssize_t columns;
    VocabTable *tables;
    char *arena;
    uint64_t *buckets; /* per column: > 0, a hashed column (id = crc32(value) % buckets, no table); NULL: none is */
    PyObject **compact; /* per column: a CompactVocabulary (its table then empty), or NULL */
} Vocabulary;

static uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t short_key(const unsigned char *p, Py_ssize_t n) {
    uint64_t k = 0;
    memcpy(&k, p, (size_t)n);
    return k;
}

static uint64_t key_hash(const unsigned char *p, Py_ssize_t n) {
    uint64_t h;
    if (n <= INLINE_KEY) {
        h = short_key(p, n) ^ ((uint64_t)n * 0x9e3779b97f4a7c15ULL);
    } else {  /* 8 bytes a step (perf_analyzer's random strings are 128 bytes: byte by byte was 13% of
               * the server's CPU under its 100-row requests) */
        h = (uint64_t)n * 0x9e3779b97f4a7c15ULL;
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            h ^= w * 0x87c37b91114253d5ULL;
            h = ((h << 27) | (h >> 37)) * 0x4cf5ad432745937fULL + 0x52dce729;
        }
        h ^= short_key(p + i, n - i) * 0x87c37b91114253d5ULL;
    }
    return mix64(h) | 1;
}

/* CompactVocabulary: one vocabulary column too large for a dict (ensemble.features.transforms.COMPACT_FROM
 * entries and up) as slots of 12 bytes, the value's 64-bit hash (key_hash) and its id, open addressing at a
 * load of at most 0.7: about 17 bytes an entry where a dict of bytes costs over 100. No value's bytes are
 * kept, so two values whose hashes are equal share the first one's id (counted at build: `collisions`), and an
 * unseen value whose hash equals a vocabulary value's (odds of entries / 2^63 a lookup) gets that id. */
typedef struct __attribute__((packed)) {
    uint64_t hash; /* 0: an empty slot (hashes are odd) */
    uint32_t id;
} CompactSlot;

typedef struct {
    PyObject_HEAD
    CompactSlot *slots;
    uint64_t capacity;
    Py_ssize_t entries, collisions;
} CompactVocabulary;

static inline uint64_t compact_home(const CompactVocabulary *c, uint64_t hash) {
    return (uint64_t)(((unsigned __int128)hash * c->capacity) >> 64);
}

static inline int64_t compact_find(const CompactVocabulary *c, uint64_t hash, int64_t fallback) {
    for (uint64_t s = compact_home(c, hash);; s = s + 1 == c->capacity ? 0 : s + 1) {
        if (c->slots[s].hash == hash) return c->slots[s].id;
        if (c->slots[s].hash == 0) return fallback;
    }
}

static void compact_dealloc(CompactVocabulary *self) {
    free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* CompactVocabulary(offsets: int64 [n + 1], data: bytes-like, ids: int64 [n]): value k is data[offsets[k]:
 * offsets[k + 1]], its id ids[k] (< 0: left out, as a missing value is; at most 2^32 - 1). */
static PyObject *compact_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_buffer offsets, data, ids;
    if (!PyArg_ParseTuple(args, "y*y*y*:CompactVocabulary", &offsets, &data, &ids)) return NULL;
    CompactVocabulary *self = NULL;
    const Py_ssize_t n = ids.len / 8;
    const int64_t *off = offsets.buf, *id = ids.buf;
    const char *bad = NULL;
    if (offsets.len != (n + 1) * 8 || ids.len % 8) bad = "offsets must be int64 [n + 1] and ids int64 [n]";
    for (Py_ssize_t k = 0; bad == NULL && k < n; k++)
        if (off[k] < 0 || off[k + 1] < off[k] || off[k + 1] > data.len)
            bad = "offsets must rise within the data";
        else if (id[k] > (int64_t)UINT32_MAX)
            bad = "an id past 2^32 - 1";
    if (bad != NULL) {
        PyErr_Format(PyExc_ValueError, "CompactVocabulary: %s", bad);
        goto done;
    }
    self = (CompactVocabulary *)type->tp_alloc(type, 0);
    if (self == NULL) goto done;
    self->capacity = (uint64_t)(n / 0.7) + 8;
    self->slots = calloc(self->capacity, sizeof(CompactSlot));
    if (self->slots == NULL) {
        Py_CLEAR(self);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        if (id[k] < 0) continue;
        const uint64_t h = key_hash((const unsigned char *)data.buf + off[k], off[k + 1] - off[k]);
        uint64_t s = compact_home(self, h);
        while (self->slots[s].hash != 0 && self->slots[s].hash != h) s = s + 1 == self->capacity ? 0 : s + 1;
        if (self->slots[s].hash == h) {
            self->collisions++;
            continue;
        }
        self->slots[s] = (CompactSlot){h, (uint32_t)id[k]};
        self->entries++;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    PyBuffer_Release(&ids);
    return (PyObject *)self;
}

/* CompactVocabulary.find(values: list, fallback, out: int64 buffer): out[i] = the id of values[i] (bytes), or
 * fallback (a value that is not bytes too, as a dict of bytes answers). */
static PyObject *compact_find_list(CompactVocabulary *self, PyObject *args) {
    PyObject *values;
    long long fallback;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!Lw*", &PyList_Type, &values, &fallback, &out)) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(values);
    if (out.len != n * 8) {
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "find: %zd values, room for %zd ids", n, out.len / 8);
        return NULL;
    }
    int64_t *ids = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        ids[i] = PyBytes_Check(v) ? compact_find(self, key_hash((const unsigned char *)PyBytes_AS_STRING(v),
                                                                PyBytes_GET_SIZE(v)), fallback)
                                  : fallback;
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static Py_ssize_t compact_len(CompactVocabulary *self) { return self->entries; }

static PyObject *compact_nbytes(CompactVocabulary *self, void *unused) {
    return PyLong_FromUnsignedLongLong((unsigned long long)(self->capacity * sizeof(CompactSlot) + sizeof *self));
}

static PyObject *compact_collisions(CompactVocabulary *self, void *unused) { return PyLong_FromSsize_t(self->collisions); }

static PyMethodDef compact_methods[] = {
    {"find", (PyCFunction)compact_find_list, METH_VARARGS, "list of bytes, fallback, out int64 -> ids into out"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef compact_getset[] = {
    {"nbytes", (getter)compact_nbytes, NULL, "bytes the slots take", NULL},
    {"collisions", (getter)compact_collisions, NULL, "values left out at build: their hash was another's", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods compact_sequence = {.sq_length = (lenfunc)compact_len};

static PyTypeObject CompactVocabularyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ensemble.native._request.CompactVocabulary",
    .tp_basicsize = sizeof(CompactVocabulary),
    .tp_dealloc = (destructor)compact_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A vocabulary column too large for a dict: 12-byte slots of (value hash, id).",
    .tp_methods = compact_methods,
    .tp_getset = compact_getset,
    .tp_as_sequence = &compact_sequence,
    .tp_new = compact_new,
};

static void vocabulary_dealloc(Vocabulary *self) {
    if (self->tables != NULL) {
        for (Py_ssize_t j = 0; j < self->columns; j++) PyMem_Free(self->tables[j].slots);
        PyMem_Free(self->tables);
    }
    PyMem_Free(self->arena);
    PyMem_Free(self->buckets);
    if (self->compact != NULL)
        for (Py_ssize_t j = 0; j < self->columns; j++) Py_XDECREF(self->compact[j]);
    PyMem_Free(self->compact);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Vocabulary(tables: tuple[dict[bytes, int] | CompactVocabulary, ...], buckets: tuple[int, ...] = ()): buckets[j] > 0
 * makes column j a hashed column (its dict is not used: an id is crc32(value) % buckets[j], zlib's CRC-32, as
 * Python's zlib.crc32) */
static PyObject *vocabulary_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *tables, *bucket_tuple = NULL;
    if (!PyArg_ParseTuple(args, "O!|O!:Vocabulary", &PyTuple_Type, &tables, &PyTuple_Type, &bucket_tuple)) return NULL;
    Py_ssize_t columns = PyTuple_GET_SIZE(tables), arena_size = 0;
    if (bucket_tuple != NULL && PyTuple_GET_SIZE(bucket_tuple) != 0 && PyTuple_GET_SIZE(bucket_tuple) != columns) {
        PyErr_SetString(PyExc_ValueError, "Vocabulary: buckets must give one count per column (0: not hashed)");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < columns; j++) {
        PyObject *table = PyTuple_GET_ITEM(tables, j), *key, *value;
        if (PyObject_TypeCheck(table, &CompactVocabularyType)) continue;
        if (!PyDict_Check(table)) {
            PyErr_SetString(PyExc_TypeError, "Vocabulary: tables must be dicts or CompactVocabulary");
            return NULL;
        }
        Py_ssize_t pos = 0;
        while (PyDict_Next(table, &pos, &key, &value)) {
            if (!PyBytes_Check(key) || !PyLong_Check(value)) {
                PyErr_SetString(PyExc_TypeError, "Vocabulary: keys must be bytes and ids ints");
                return NULL;
            }
            if (PyBytes_GET_SIZE(key) > INLINE_KEY) arena_size += PyBytes_GET_SIZE(key);
        }
    }
    if (arena_size > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "Vocabulary: more than 4 GiB of long keys");
        return NULL;
    }
    Vocabulary *self = (Vocabulary *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->columns = columns;
    self->tables = PyMem_Calloc(columns ? columns : 1, sizeof(VocabTable));
    self->arena = PyMem_Malloc(arena_size ? arena_size : 1);
    self->compact = PyMem_Calloc(columns ? columns : 1, sizeof(PyObject *));
    if (self->tables == NULL || self->arena == NULL || self->compact == NULL) goto nomem;
    if (bucket_tuple != NULL && PyTuple_GET_SIZE(bucket_tuple) == columns) {
        self->buckets = PyMem_Calloc(columns ? columns : 1, sizeof(uint64_t));
        if (self->buckets == NULL) goto nomem;
        for (Py_ssize_t j = 0; j < columns; j++) {
            const long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(bucket_tuple, j));
            if (n < 0 || (n == -1 && PyErr_Occurred())) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Vocabulary: buckets must be >= 0");
                goto fail;
            }
            self->buckets[j] = (uint64_t)n;
        }
    }
    Py_ssize_t used = 0;
    for (Py_ssize_t j = 0; j < columns; j++) {
        PyObject *table = PyTuple_GET_ITEM(tables, j), *key, *value;
        size_t capacity = 8;
        const int is_compact = PyObject_TypeCheck(table, &CompactVocabularyType);
        if (is_compact) self->compact[j] = Py_NewRef(table);
        while (!is_compact && capacity < (size_t)PyDict_GET_SIZE(table) * 2) capacity <<= 1;  /* load <= 1/2 */
        VocabTable *t = &self->tables[j];
        t->slots = PyMem_Calloc(capacity, sizeof(VocabSlot));
        if (t->slots == NULL) goto nomem;
        t->mask = capacity - 1;
        Py_ssize_t pos = 0;
        while (!is_compact && PyDict_Next(table, &pos, &key, &value)) {
            const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(key);
            Py_ssize_t n = PyBytes_GET_SIZE(key);
            long long id = PyLong_AsLongLong(value);
            if (id == -1 && PyErr_Occurred()) goto fail;
            VocabSlot slot = {key_hash(bytes, n), id, 0, (uint32_t)n, 0};
            if (n <= INLINE_KEY) {
                slot.inline_key = short_key(bytes, n);
            } else {
                memcpy(self->arena + used, bytes, n);
                slot.offset = (uint32_t)used;
                used += n;
            }
            size_t i = slot.hash & t->mask;
            while (t->slots[i].hash != 0) i = (i + 1) & t->mask;  /* dict keys are distinct */
            t->slots[i] = slot;
        }
    }
    return (PyObject *)self;
nomem:
    PyErr_NoMemory();
fail:
    Py_DECREF(self);
    return NULL;
}

typedef struct {
    uint64_t hash;
    uint64_t key8;  /* the value itself when at most INLINE_KEY bytes, zero-padded; else 0 */
    Py_ssize_t start;  /* the value's first byte in the wire buffer */
    Py_ssize_t length;
} WireValue;

/* out[i] = tables[i % columns].get(value i of the BYTES wire buffer, fallback); the buffer must hold
 * exactly count values. 0, or -1 with the reason in error. No Python call. */
static int lookup_wire(const Vocabulary *self, const unsigned char *data, size_t size_, int64_t fallback, int64_t *ids,
                       size_t count_, char *error, size_t error_size) {
    const Py_ssize_t size = (Py_ssize_t)size_, count = (Py_ssize_t)count_;
    Py_ssize_t offset = 0, i = 0, j = 0;
    if (self->columns == 0) {
        snprintf(error, error_size, "lookup_wire: no columns");
        return -1;
    }
    WireValue *values = PyMem_RawMalloc(sizeof(WireValue) * (size_t)(count ? count : 1));
    if (values == NULL) {
        snprintf(error, error_size, "lookup_wire: out of memory");
        return -1;
    }
    /* Pass 1: check the buffer, hash each value and prefetch the slot its probe starts at. */
    for (; offset < size; i++, j = (j + 1 == self->columns) ? 0 : j + 1) {
        if (size - offset < 4) {
            snprintf(error, error_size, "BYTES tensor truncated at byte %zd of %zd", offset, size);
            goto fail;
        }
        Py_ssize_t n = ensemble_u32le(data + offset);
        if (n > size - offset - 4) {
            snprintf(error, error_size, "BYTES tensor truncated at byte %zd of %zd", offset, size);
            goto fail;
        }
        const Py_ssize_t start = offset + 4;
        offset = start + n;
        if (i >= count) continue;  /* counted below, so the error names the real count */
        if (self->buckets && self->buckets[j]) { /* a hashed column: the id from the hash alone */
            ids[i] = (int64_t)(crc32_z(0L, data + start, (size_t)n) % self->buckets[j]);
            values[i] = (WireValue){0, 0, start, n};
            continue;
        }
        const uint64_t h = key_hash(data + start, n);
        values[i] = (WireValue){h, n <= INLINE_KEY ? short_key(data + start, n) : 0, start, n};
        const CompactVocabulary *c = (const CompactVocabulary *)self->compact[j];
        if (c != NULL)
            __builtin_prefetch(&c->slots[compact_home(c, h)]);
        else
            __builtin_prefetch(&self->tables[j].slots[h & self->tables[j].mask]);
    }
    if (i != count) {
        snprintf(error, error_size, "%zd values in the BYTES tensor, %zd expected", i, count);
        goto fail;
    }
    /* Pass 2: probe. */
    for (i = 0, j = 0; i < count; i++, j = (j + 1 == self->columns) ? 0 : j + 1) {
        const VocabTable *t = &self->tables[j];
        const WireValue v = values[i];
        if (v.hash == 0) continue; /* a hashed column's: set in pass 1 */
        if (self->compact[j] != NULL) {
            ids[i] = compact_find((const CompactVocabulary *)self->compact[j], v.hash, fallback);
            continue;
        }
        int64_t id = fallback;
        for (size_t s = v.hash & t->mask;; s = (s + 1) & t->mask) {
            const VocabSlot *slot = &t->slots[s];
            if (slot->hash == 0) break;
            if (slot->hash == v.hash && slot->length == (uint32_t)v.length &&
                (v.length <= INLINE_KEY ? slot->inline_key == v.key8
                                        : memcmp(self->arena + slot->offset, data + v.start, v.length) == 0)) {
                id = slot->id;
                break;
            }
        }
        ids[i] = id;
    }
    PyMem_RawFree(values);
    return 0;
fail:
    PyMem_RawFree(values);
    return -1;
}

/* Vocabulary.lookup_wire(buffer, fallback: int, out: writable int64 buffer) -> None
 *
 * out[i] = tables[i % columns].get(value i of the BYTES wire buffer, fallback); the buffer must
 * hold exactly len(out) values. */
static PyObject *vocabulary_lookup_wire(Vocabulary *self, PyObject *args) {
    Py_buffer wire, out;
    long long fallback;
    if (!PyArg_ParseTuple(args, "y*Lw*", &wire, &fallback, &out)) return NULL;
    char error[ENSEMBLE_ERROR_SIZE];
    const int failed = lookup_wire(self, wire.buf, (size_t)wire.len, fallback, out.buf,
                                   (size_t)out.len / sizeof(int64_t), error, sizeof error);
    PyBuffer_Release(&wire);
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef vocabulary_methods[] = {
    {"lookup_wire", (PyCFunction)vocabulary_lookup_wire, METH_VARARGS,
     "BYTES wire buffer -> int64 ids into out, value i in column i % columns (missing: fallback)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject VocabularyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ensemble.native._request.Vocabulary",
    .tp_basicsize = sizeof(Vocabulary),
    .tp_dealloc = (destructor)vocabulary_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The categorical columns' vocabularies as C hash tables (see lookup_wire).",
    .tp_methods = vocabulary_methods,
    .tp_new = vocabulary_new,
};

/* tsv_to_wire(blob, rows, label, dense, categorical, labels_out, dense_out, row_ends_out) -> bytes | None
 *
 * A batch-scoring client's parse of Criteo-shaped TSV lines (each ending in '\n') straight into the
 * request: [rows x dense] float32 (empty = NaN), the categorical values as Triton's BYTES wire buffer
 * (row-major, empty = b""), the int8 labels when ``label``, and each row's end offset in that buffer.
 * It takes only lines of a narrow grammar, for which it gives what pandas' read_csv gives (the
 * general parser, ensemble.data.criteo.parse_criteo): every line has exactly the fields expected,
 * a label or continuous value is empty (continuous only) or an optional '-' and 1-15 digits (exact in
 * a double, then rounded to float32 as pandas does), and a categorical value holds only ASCII
 * bytes other than NUL and CR. For anything else it returns None and the caller parses the block
 * the general way (which also names the offending line).
 */
static int parse_digits(const unsigned char *p, const unsigned char *end, double *value) {
    int negative = 0;
    if (p < end && *p == '-') { negative = 1; p++; }
    if (p == end || end - p > 15) return -1;
    int64_t v = 0;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    *value = negative ? -(double)v : (double)v; /* "-0" is -0.0, as pandas reads it */
    return 0;
}

static PyObject *tsv_to_wire(PyObject *self, PyObject *args) {
    Py_buffer blob, labels_view, dense_view, ends_view;
    Py_ssize_t rows, n_dense, n_cat;
    int label;
    PyObject *labels_obj;
    if (!PyArg_ParseTuple(args, "y*npnnOw*w*", &blob, &rows, &label, &n_dense, &n_cat, &labels_obj, &dense_view,
                          &ends_view))
        return NULL;
    PyObject *out = NULL;
    int have_labels = 0;
    if (label) {
        if (PyObject_GetBuffer(labels_obj, &labels_view, PyBUF_WRITABLE) < 0) goto done;
        have_labels = 1;
    }
    if (rows < 0 || n_dense < 0 || n_cat < 0 || dense_view.len != rows * n_dense * (Py_ssize_t)sizeof(float) ||
        ends_view.len != rows * (Py_ssize_t)sizeof(int64_t) || (label && labels_view.len != rows)) {
        PyErr_SetString(PyExc_ValueError, "tsv_to_wire: output sizes do not match the rows and columns");
        goto done;
    }
    /* The wire buffer holds every categorical byte of the blob plus 4 bytes a value: an upper bound. */
    Py_ssize_t capacity = blob.len + 4 * rows * n_cat;
    out = PyBytes_FromStringAndSize(NULL, capacity);
    if (out == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out), *const dst0 = dst;
    const unsigned char *p = blob.buf, *const end = p + blob.len;
    float *dense = dense_view.buf;
    int8_t *labels = have_labels ? labels_view.buf : NULL;
    int64_t *ends = ends_view.buf;
    const Py_ssize_t fields = (label ? 1 : 0) + n_dense + n_cat;
    const Py_ssize_t first_cat = fields - n_cat;
    int fast = 1;
    Py_ssize_t row = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; row < rows && fast; row++) {
        for (Py_ssize_t f = 0; f < fields; f++) {
            const unsigned char *start = p;
            const unsigned char last = f + 1 == fields ? '\n' : '\t';
            if (f < first_cat) {
                while (p < end && *p != '\t' && *p != '\n') p++;
            } else {
                while (p < end && *p != '\t' && *p != '\n') {
                    if (*p == 0 || *p == '\r' || *p >= 0x80) { fast = 0; break; }
                    p++;
                }
            }
            if (!fast || p == end || *p != last) { fast = 0; break; }
            if (label && f == 0) {
                double v;
                if (parse_digits(start, p, &v) < 0 || v < -128 || v > 127) { fast = 0; break; }
                labels[row] = (int8_t)v;
            } else if (f < first_cat) {
                double v = NAN;
                if (p != start && parse_digits(start, p, &v) < 0) { fast = 0; break; }
                *dense++ = (float)v;
            } else {
                uint32_t length = (uint32_t)(p - start);
                dst[0] = length & 0xff; dst[1] = (length >> 8) & 0xff;
                dst[2] = (length >> 16) & 0xff; dst[3] = (length >> 24) & 0xff;
                memcpy(dst + 4, start, length);
                dst += 4 + length;
            }
            p++; /* the tab or newline */
        }
        if (fast) ends[row] = dst - dst0;
    }
    Py_END_ALLOW_THREADS
    if (!fast || row != rows || p != end) {
        Py_CLEAR(out);
        out = Py_None;
        Py_INCREF(out);
    } else if (_PyBytes_Resize(&out, dst - dst0) < 0) {
        out = NULL;
    }
done:
    if (have_labels) PyBuffer_Release(&labels_view);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&dense_view);
    PyBuffer_Release(&ends_view);
    return out;
}

/* gather(table, keys) -> (bytes, bytes) | None
 *
 * The online store's cache hit (ensemble/online.py): `table` maps each key (bytes) to a pair of bytes
 * (a stored row's fixed part and its categorical part); the answer is every key's first parts joined
 * in key order and its second parts joined, or None when a key is absent (the caller then takes its
 * Python path, which asks the store). No Python code runs between the two passes (the keys are exact
 * bytes, whose hashing and comparison are C), so the pairs found in the first are the second's. */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *table, *keys;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &table, &PyList_Type, &keys)) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    Py_ssize_t sizes[2] = {0, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key)) {
            PyErr_Format(PyExc_TypeError, "gather: key %zd is %s, not bytes", i, Py_TYPE(key)->tp_name);
            return NULL;
        }
        PyObject *pair = PyDict_GetItemWithError(table, key); /* borrowed */
        if (pair == NULL) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_Format(PyExc_TypeError, "gather: the value of key %zd is not a pair of bytes", i);
            return NULL;
        }
        for (int part = 0; part < 2; part++) {
            const Py_ssize_t size = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, part));
            if (size > PY_SSIZE_T_MAX - sizes[part]) return PyErr_NoMemory();
            sizes[part] += size;
        }
    }
    PyObject *joined[2] = {PyBytes_FromStringAndSize(NULL, sizes[0]), PyBytes_FromStringAndSize(NULL, sizes[1])};
    if (joined[0] == NULL || joined[1] == NULL) {
        Py_XDECREF(joined[0]);
        Py_XDECREF(joined[1]);
        return NULL;
    }
    char *at[2] = {PyBytes_AS_STRING(joined[0]), PyBytes_AS_STRING(joined[1])};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyDict_GetItemWithError(table, PyList_GET_ITEM(keys, i));
        for (int part = 0; part < 2; part++) {
            PyObject *value = PyTuple_GET_ITEM(pair, part);
            memcpy(at[part], PyBytes_AS_STRING(value), (size_t)PyBytes_GET_SIZE(value));
            at[part] += PyBytes_GET_SIZE(value);
        }
    }
    PyObject *out = PyTuple_Pack(2, joined[0], joined[1]);
    Py_DECREF(joined[0]);
    Py_DECREF(joined[1]);
    return out;
}

static PyMethodDef methods[] = {
    {"split_wire", split_wire, METH_O, "Triton BYTES wire buffer -> list of bytes."},
    {"join_wire", join_wire, METH_O, "list of bytes -> Triton BYTES wire buffer."},
    {"gather", gather, METH_VARARGS, "dict of key -> (bytes, bytes), list of keys -> both parts joined, or None."},
    {"lookup", lookup, METH_VARARGS, "Row-major values -> int64 ids, one dict per column, into out."},
    {"dense_prepare", dense_prepare, METH_VARARGS, "Fill non-finite, clip, add one (float32), into out."},
    {"blend", blend, METH_VARARGS, "The blender's sigmoid of weighted logits, into out."},
    {"tsv_to_wire", tsv_to_wire, METH_VARARGS, "Criteo-shaped TSV lines -> labels, float32 dense, BYTES wire buffer "
                                               "(None outside its grammar)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_request", .m_size = -1, .m_methods = methods};

/* The C entry points (api.h). */
static int64_t api_columns(PyObject *vocabulary) { return ((Vocabulary *)vocabulary)->columns; }
static int api_lookup_wire(PyObject *vocabulary, const unsigned char *data, size_t size, int64_t fallback, int64_t *out,
                           size_t count, char *error, size_t error_size) {
    return lookup_wire((const Vocabulary *)vocabulary, data, size, fallback, out, count, error, error_size);
}

static const EnsembleNativeApi API = {api_columns, api_lookup_wire, prepare, blend_rows};

PyMODINIT_FUNC PyInit__request(void) {
    if (PyType_Ready(&VocabularyType) < 0 || PyType_Ready(&CompactVocabularyType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_REQUEST_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Vocabulary", (PyObject *)&VocabularyType) < 0 ||
        PyModule_AddObjectRef(m, "CompactVocabulary", (PyObject *)&CompactVocabularyType) < 0 ||
        PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
