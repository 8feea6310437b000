/* Embedding tables larger than memory (ensemble/tables): the row store's file format, the rows no
 * training step touched, the hot tier in RAM and the cold reads from disk.
 *
 * A table file holds its rows in id order, packed into 4 KiB blocks: a header block, then block b with
 * rows [b * per_block, (b + 1) * per_block), zero padding, and in its last 4 bytes the CRC-32 (zlib's) of
 * the block's index and its other 4092 bytes. A row is one of three formats: fp32, fp16, or FBGEMM's
 * 8-bit rowwise (the row's dim values as uint8 q, then float32 scale and bias: value = q * scale + bias).
 * A cold read is one aligned 4 KiB block (O_DIRECT: the page cache is not a hidden tier), checked
 * against its CRC before any row of it is scored.
 *
 * A Store serves the tables of one DLRM: a table of few rows is read whole into RAM at load; a large one
 * is read through the hot tier, one set-associative cache per Store (8 ways a set, CLOCK eviction in the
 * set, a budget of bytes), warmed at load from the warm file (the rows training touched most, in that
 * order, read sequentially) and filled on misses as the admission policy says: every miss ("always"), a
 * key's second miss within a window ("second", a doorkeeper bitmap as in TinyLFU), or none ("none").
 * A gather deduplicates a call's keys per table, serves what RAM holds, and reads the rest: through
 * io_uring with a bounded queue depth ("uring"), one pread at a time ("pread"), or a shared mapping of
 * the file ("mmap", the page cache's way). It runs without the interpreter's lock.
 *
 * The rows no training step touched are initialised by init_rows: value k of row r of a table seeded s
 * is uniform in [-0.05, 0.05) from splitmix64 (the range of torch's and Keras's embedding initialisers),
 * so a table of 40M rows needs no 40M rows in memory to be trained, and the export writes every row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#ifdef ENSEMBLE_URING
#include <liburing.h>
#endif
#ifdef ENSEMBLE_HIREDIS
#include <hiredis/hiredis.h>
#endif

#include "api.h"

#define BLOCK 4096
#define CRC_BYTES 4
#define MAGIC "ENSROWS1"
#define FORMAT_VERSION 1
#define WAYS 8
#define LOCKS 4096
#define MAX_TABLES 64
#define MAX_DEPTH 256
#define INIT_RANGE 0.05f
#define LATENCY_BUCKETS 13
static const double LATENCY_BOUNDS_MS[LATENCY_BUCKETS - 1] = {0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000};

enum { FMT_FP32 = 0, FMT_FP16 = 1, FMT_INT8 = 2 };
static const char *FORMAT_NAMES[] = {"fp32", "fp16", "int8"};
enum { ADMIT_ALWAYS = 0, ADMIT_SECOND = 1, ADMIT_NONE = 2 };
static const char *ADMISSION_NAMES[] = {"always", "second", "none"};
enum { IO_URING = 0, IO_PREAD = 1, IO_MMAP = 2, IO_REDIS = 3 };
static const char *IO_NAMES[] = {"uring", "pread", "mmap", "redis"};
#define MAX_NODES 16

static PyObject *TableError;

/* ----- formats ----- */

static int row_bytes_of(int format, int dim) {
    switch (format) {
    case FMT_FP32: return 4 * dim;
    case FMT_FP16: return 2 * dim;
    case FMT_INT8: return dim + 8;
    default: return -1;
    }
}

static int per_block_of(int row_bytes) { return row_bytes > 0 ? (BLOCK - CRC_BYTES) / row_bytes : 0; }

/* The header block's fields (the rest of the block is zero but for its CRC, as any block's). */
typedef struct {
    char magic[8];
    uint32_t version, format, dim, row_bytes, per_block, reserved;
    uint64_t rows, blocks, seed;
} Header;

static uint32_t block_crc(uint64_t index, const unsigned char *block) {
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(index >> (8 * i));
    uLong crc = crc32_z(0L, le, 8);
    return (uint32_t)crc32_z(crc, block, BLOCK - CRC_BYTES);
}

static uint32_t stored_crc(const unsigned char *block) {
    uint32_t v;
    memcpy(&v, block + BLOCK - CRC_BYTES, 4);
    return v;
}

/* ----- the rows nobody trained ----- */

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* Row `row` of the table seeded `seed`: dim floats uniform in [-INIT_RANGE, INIT_RANGE). */
static void init_row(uint64_t seed, uint64_t row, int dim, float *out) {
    const uint64_t base = splitmix64(seed * 0xD1B54A32D192ED03ULL ^ row);
    for (int k = 0; k < dim; k += 2) {
        const uint64_t h = splitmix64(base + (uint64_t)(k >> 1));
        out[k] = ((float)(uint32_t)(h >> 40) * (1.0f / 16777216.0f)) * (2 * INIT_RANGE) - INIT_RANGE;
        if (k + 1 < dim) out[k + 1] = ((float)(uint32_t)((h >> 8) & 0xFFFFFF) * (1.0f / 16777216.0f)) * (2 * INIT_RANGE) - INIT_RANGE;
    }
}

/* ----- fp16 ----- */

static float half_to_float_soft(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = mant;
            do {
                e++;
                m <<= 1;
            } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_half_soft(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    uint32_t mant = x & 0x7FFFFF;
    if (((x >> 23) & 0xFF) == 0xFF) return (uint16_t)(sign | 0x7C00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7C00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        const int shift = 14 - exp;
        uint32_t half = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) static void half_to_float_f16c(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = half_to_float_soft(src[i]);
}
__attribute__((target("avx,f16c"))) static void float_to_half_f16c(const float *src, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = float_to_half_soft(src[i]);
}
#endif

static int has_f16c;

static void half_to_float(const uint16_t *src, float *dst, int n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_f16c) {
        half_to_float_f16c(src, dst, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) dst[i] = half_to_float_soft(src[i]);
}

static void float_to_half(const float *src, uint16_t *dst, int n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_f16c) {
        float_to_half_f16c(src, dst, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) dst[i] = float_to_half_soft(src[i]);
}

/* ----- a row in its format ----- */

static void encode_row(int format, int dim, const float *src, unsigned char *dst) {
    switch (format) {
    case FMT_FP32: memcpy(dst, src, 4 * (size_t)dim); break;
    case FMT_FP16: {
        uint16_t h[dim > 0 ? dim : 1];
        float_to_half(src, h, dim);
        memcpy(dst, h, 2 * (size_t)dim);
        break;
    }
    case FMT_INT8: {
        float lo = src[0], hi = src[0];
        for (int k = 1; k < dim; k++) {
            lo = src[k] < lo ? src[k] : lo;
            hi = src[k] > hi ? src[k] : hi;
        }
        const float scale = (hi - lo) / 255.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
        for (int k = 0; k < dim; k++) {
            const float q = nearbyintf((src[k] - lo) * inv);
            dst[k] = (unsigned char)(q < 0 ? 0 : q > 255 ? 255 : q);
        }
        memcpy(dst + dim, &scale, 4);
        memcpy(dst + dim + 4, &lo, 4);
        break;
    }
    }
}

static void decode_row(int format, int dim, const unsigned char *src, float *dst) {
    switch (format) {
    case FMT_FP32: memcpy(dst, src, 4 * (size_t)dim); break;
    case FMT_FP16: {
        uint16_t h[dim > 0 ? dim : 1];
        memcpy(h, src, 2 * (size_t)dim);
        half_to_float(h, dst, dim);
        break;
    }
    case FMT_INT8: {
        float scale, bias;
        memcpy(&scale, src + dim, 4);
        memcpy(&bias, src + dim + 4, 4);
        for (int k = 0; k < dim; k++) dst[k] = (float)src[k] * scale + bias;
        break;
    }
    }
}

/* ----- buffers ----- */

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

static int take(PyObject *obj, Buffer *b, const char *name, Py_ssize_t itemsize, int writable) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    if (itemsize > 0 && b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", name, b->view.itemsize, itemsize);
        return -1;
    }
    return 0;
}

static void give_back(Buffer *buffers, int n) {
    for (int i = 0; i < n; i++)
        if (buffers[i].held) {
            PyBuffer_Release(&buffers[i].view);
            buffers[i].held = 0;
        }
}

static int format_of(const char *name) {
    for (int f = 0; f < 3; f++)
        if (strcmp(name, FORMAT_NAMES[f]) == 0) return f;
    PyErr_Format(PyExc_ValueError, "format must be fp32, fp16 or int8, not %s", name);
    return -1;
}

/* ----- module functions over arrays ----- */

/* init_rows(seed, first_row, out: float32 [count x dim]) */
static PyObject *py_init_rows(PyObject *self, PyObject *args) {
    unsigned long long seed, first;
    PyObject *out;
    int dim;
    if (!PyArg_ParseTuple(args, "KKiO", &seed, &first, &dim, &out)) return NULL;
    Buffer b = {0};
    if (take(out, &b, "out", 4, 1) < 0) {
        give_back(&b, 1);
        return NULL;
    }
    if (dim <= 0 || b.view.len % (4 * dim)) {
        give_back(&b, 1);
        PyErr_SetString(PyExc_ValueError, "out must hold whole rows of dim floats");
        return NULL;
    }
    const Py_ssize_t count = b.view.len / (4 * dim);
    float *o = b.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < count; r++) init_row(seed, first + (uint64_t)r, dim, o + r * dim);
    Py_END_ALLOW_THREADS
    give_back(&b, 1);
    Py_RETURN_NONE;
}

/* init_ids(seed, ids: int64 [n], dim, out: float32 [n x dim]): the initial rows of arbitrary ids */
static PyObject *py_init_ids(PyObject *self, PyObject *args) {
    unsigned long long seed;
    PyObject *ids, *out;
    int dim;
    if (!PyArg_ParseTuple(args, "KOiO", &seed, &ids, &dim, &out)) return NULL;
    Buffer b[2] = {0};
    if (take(ids, &b[0], "ids", 8, 0) < 0 || take(out, &b[1], "out", 4, 1) < 0) {
        give_back(b, 2);
        return NULL;
    }
    const Py_ssize_t n = b[0].view.len / 8;
    if (dim <= 0 || b[1].view.len != n * dim * 4) {
        give_back(b, 2);
        PyErr_SetString(PyExc_ValueError, "out must be [len(ids) x dim] float32");
        return NULL;
    }
    const int64_t *id = b[0].view.buf;
    float *o = b[1].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) init_row(seed, (uint64_t)id[r], dim, o + r * dim);
    Py_END_ALLOW_THREADS
    give_back(b, 2);
    Py_RETURN_NONE;
}

/* encode(rows: float32 [n x dim], dim, format, out: uint8 [n x row_bytes]) and decode(data: uint8 [n x row_bytes],
 * dim, format, out: float32 [n x dim]): one body, the direction its flag. */
static PyObject *convert_rows(PyObject *args, int encoding) {
    PyObject *in, *out;
    const char *fname;
    int dim;
    if (!PyArg_ParseTuple(args, "OisO", &in, &dim, &fname, &out)) return NULL;
    const int format = format_of(fname);
    if (format < 0) return NULL;
    const int rb = row_bytes_of(format, dim);
    const Py_ssize_t in_row = encoding ? 4 * (Py_ssize_t)dim : rb, out_row = encoding ? rb : 4 * (Py_ssize_t)dim;
    Buffer b[2] = {0};
    if (take(in, &b[0], encoding ? "rows" : "data", encoding ? 4 : 1, 0) < 0 ||
        take(out, &b[1], "out", encoding ? 1 : 4, 1) < 0) {
        give_back(b, 2);
        return NULL;
    }
    const Py_ssize_t n = dim > 0 && in_row > 0 ? b[0].view.len / in_row : 0;
    if (dim <= 0 || b[0].view.len != n * in_row || b[1].view.len != n * out_row) {
        give_back(b, 2);
        PyErr_SetString(PyExc_ValueError, encoding ? "rows must be [n x dim] float32 and out [n x row_bytes] uint8"
                                                   : "data must be [n x row_bytes] uint8 and out [n x dim] float32");
        return NULL;
    }
    const unsigned char *src = b[0].view.buf;
    unsigned char *dst = b[1].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        if (encoding)
            encode_row(format, dim, (const float *)(src + r * in_row), dst + r * out_row);
        else
            decode_row(format, dim, src + r * in_row, (float *)(dst + r * out_row));
    }
    Py_END_ALLOW_THREADS
    give_back(b, 2);
    Py_RETURN_NONE;
}

static PyObject *py_encode(PyObject *self, PyObject *args) { return convert_rows(args, 1); }

static PyObject *py_decode(PyObject *self, PyObject *args) { return convert_rows(args, 0); }

/* pack(rows: uint8 [n x row_bytes], row_bytes, first_block, out: uint8 [blocks x 4096]): rows into blocks,
 * padding zeroed, each block's CRC in its last 4 bytes; n must fill the blocks but for the last. */
static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *rows, *out;
    int rb;
    unsigned long long first;
    if (!PyArg_ParseTuple(args, "OiKO", &rows, &rb, &first, &out)) return NULL;
    const int per = per_block_of(rb);
    Buffer b[2] = {0};
    if (take(rows, &b[0], "rows", 1, 0) < 0 || take(out, &b[1], "out", 1, 1) < 0) {
        give_back(b, 2);
        return NULL;
    }
    const Py_ssize_t n = per > 0 ? b[0].view.len / rb : 0;
    const Py_ssize_t blocks = per > 0 ? (n + per - 1) / per : 0;
    if (per <= 0 || b[0].view.len != n * rb || b[1].view.len != blocks * BLOCK) {
        give_back(b, 2);
        PyErr_SetString(PyExc_ValueError, "out must be [ceil(n / per_block) x 4096] uint8 for n rows of row_bytes");
        return NULL;
    }
    const unsigned char *src = b[0].view.buf;
    unsigned char *dst = b[1].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < blocks; k++) {
        unsigned char *block = dst + k * BLOCK;
        const Py_ssize_t r0 = k * per, count = n - r0 < per ? n - r0 : per;
        memcpy(block, src + r0 * rb, (size_t)(count * rb));
        memset(block + count * rb, 0, (size_t)(BLOCK - count * rb));
        const uint32_t crc = block_crc(first + (uint64_t)k, block);
        memcpy(block + BLOCK - CRC_BYTES, &crc, 4);
    }
    Py_END_ALLOW_THREADS
    give_back(b, 2);
    Py_RETURN_NONE;
}

/* check_blocks(data: uint8 [blocks x 4096], first_block) -> index of the first block whose CRC fails, or -1 */
static PyObject *py_check_blocks(PyObject *self, PyObject *args) {
    PyObject *data;
    unsigned long long first;
    if (!PyArg_ParseTuple(args, "OK", &data, &first)) return NULL;
    Buffer b = {0};
    if (take(data, &b, "data", 1, 0) < 0) {
        give_back(&b, 1);
        return NULL;
    }
    if (b.view.len % BLOCK) {
        give_back(&b, 1);
        PyErr_SetString(PyExc_ValueError, "data must be whole 4096-byte blocks");
        return NULL;
    }
    const Py_ssize_t blocks = b.view.len / BLOCK;
    const unsigned char *p = b.view.buf;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < blocks && bad < 0; k++)
        if (block_crc(first + (uint64_t)k, p + k * BLOCK) != stored_crc(p + k * BLOCK)) bad = k;
    Py_END_ALLOW_THREADS
    give_back(&b, 1);
    return PyLong_FromSsize_t(bad);
}

/* header(format, dim, rows, seed) -> the 4096-byte header block of a table file */
static PyObject *py_header(PyObject *self, PyObject *args) {
    const char *fname;
    int dim;
    unsigned long long rows, seed;
    if (!PyArg_ParseTuple(args, "siKK", &fname, &dim, &rows, &seed)) return NULL;
    const int format = format_of(fname);
    if (format < 0) return NULL;
    const int rb = row_bytes_of(format, dim), per = per_block_of(rb);
    if (dim <= 0 || per <= 0) {
        PyErr_Format(PyExc_ValueError, "a row of %d %s values does not fit a block", dim, fname);
        return NULL;
    }
    unsigned char block[BLOCK] = {0};
    Header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, MAGIC, 8);
    h.version = FORMAT_VERSION;
    h.format = (uint32_t)format;
    h.dim = (uint32_t)dim;
    h.row_bytes = (uint32_t)rb;
    h.per_block = (uint32_t)per;
    h.rows = rows;
    h.blocks = (rows + (uint64_t)per - 1) / (uint64_t)per;
    h.seed = seed;
    memcpy(block, &h, sizeof h);
    const uint32_t crc = block_crc(UINT64_MAX, block);
    memcpy(block + BLOCK - CRC_BYTES, &crc, 4);
    return PyBytes_FromStringAndSize((const char *)block, BLOCK);
}

static PyObject *py_row_bytes(PyObject *self, PyObject *args) {
    const char *fname;
    int dim;
    if (!PyArg_ParseTuple(args, "si", &fname, &dim)) return NULL;
    const int format = format_of(fname);
    return format < 0 ? NULL : PyLong_FromLong(row_bytes_of(format, dim));
}

/* ----- a compact map: uint64 key -> uint32 value (open addressing, linear probing) ----- */

typedef struct {
    PyObject_HEAD
    uint64_t *keys; /* key + 1 (0: empty) */
    uint32_t *values;
    uint64_t capacity, size; /* capacity a power of two */
} Map;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    return x ^ (x >> 33);
}

static int map_grow(Map *m, uint64_t capacity) {
    uint64_t *keys = calloc(capacity, sizeof *keys);
    uint32_t *values = malloc(capacity * sizeof *values);
    if (keys == NULL || values == NULL) {
        free(keys);
        free(values);
        return -1;
    }
    for (uint64_t i = 0; i < m->capacity; i++) {
        if (!m->keys[i]) continue;
        uint64_t at = mix64(m->keys[i]) & (capacity - 1);
        while (keys[at]) at = (at + 1) & (capacity - 1);
        keys[at] = m->keys[i];
        values[at] = m->values[i];
    }
    free(m->keys);
    free(m->values);
    m->keys = keys;
    m->values = values;
    m->capacity = capacity;
    return 0;
}

/* The value of key, inserting next (and incrementing *next) when absent; UINT32_MAX when out of memory. */
static uint32_t map_get_or_add(Map *m, uint64_t key, uint32_t *next) {
    if ((m->size + 1) * 4 > m->capacity * 3 && map_grow(m, m->capacity ? m->capacity * 2 : 1024) < 0) return UINT32_MAX;
    const uint64_t stored = key + 1, mask = m->capacity - 1;
    uint64_t at = mix64(stored) & mask;
    while (m->keys[at]) {
        if (m->keys[at] == stored) return m->values[at];
        at = (at + 1) & mask;
    }
    m->keys[at] = stored;
    m->values[at] = (*next)++;
    m->size++;
    return m->values[at];
}

static int64_t map_find(const Map *m, uint64_t key) {
    if (!m->capacity) return -1;
    const uint64_t stored = key + 1, mask = m->capacity - 1;
    uint64_t at = mix64(stored) & mask;
    while (m->keys[at]) {
        if (m->keys[at] == stored) return m->values[at];
        at = (at + 1) & mask;
    }
    return -1;
}

static void map_dealloc(PyObject *obj) {
    Map *m = (Map *)obj;
    free(m->keys);
    free(m->values);
    Py_TYPE(obj)->tp_free(obj);
}

/* Map.add(keys: int64 [n], out: int32 [n]) -> how many keys were new: each key's value, new keys numbered
 * from the map's size on (the slots of a growing arena); Map.find(keys, out): each key's value, -1 when
 * absent. One body, `adding` telling which. */
static PyObject *map_lookup(PyObject *obj, PyObject *args, int adding) {
    Map *m = (Map *)obj;
    PyObject *keys, *out;
    if (!PyArg_ParseTuple(args, "OO", &keys, &out)) return NULL;
    Buffer b[2] = {0};
    if (take(keys, &b[0], "keys", 8, 0) < 0 || take(out, &b[1], "out", 4, 1) < 0) {
        give_back(b, 2);
        return NULL;
    }
    const Py_ssize_t n = b[0].view.len / 8;
    if (b[1].view.len != n * 4) {
        give_back(b, 2);
        PyErr_SetString(PyExc_ValueError, "out must be int32 [len(keys)]");
        return NULL;
    }
    const uint64_t before = m->size;
    uint32_t next = (uint32_t)m->size;
    const int64_t *k = b[0].view.buf;
    int32_t *o = b[1].view.buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        if (!adding) {
            o[i] = (int32_t)map_find(m, (uint64_t)k[i]);
            continue;
        }
        const uint32_t v = map_get_or_add(m, (uint64_t)k[i], &next);
        if (v == UINT32_MAX) failed = 1;
        o[i] = (int32_t)v;
    }
    Py_END_ALLOW_THREADS
    give_back(b, 2);
    if (failed) return PyErr_NoMemory();
    if (!adding) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(m->size - before);
}

static PyObject *map_add(PyObject *obj, PyObject *args) { return map_lookup(obj, args, 1); }

static PyObject *map_find_py(PyObject *obj, PyObject *args) { return map_lookup(obj, args, 0); }

/* Map.keys(out: int64 [len]): every key, in the order of their values */
static PyObject *map_keys(PyObject *obj, PyObject *args) {
    Map *m = (Map *)obj;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "O", &out)) return NULL;
    Buffer b = {0};
    if (take(out, &b, "out", 8, 1) < 0) {
        give_back(&b, 1);
        return NULL;
    }
    if ((uint64_t)(b.view.len / 8) != m->size) {
        give_back(&b, 1);
        PyErr_SetString(PyExc_ValueError, "out must be int64 [len(map)]");
        return NULL;
    }
    int64_t *o = b.view.buf;
    for (uint64_t i = 0; i < m->capacity; i++)
        if (m->keys[i] && m->values[i] < m->size) o[m->values[i]] = (int64_t)(m->keys[i] - 1);
    give_back(&b, 1);
    Py_RETURN_NONE;
}

static Py_ssize_t map_len(PyObject *obj) { return (Py_ssize_t)((Map *)obj)->size; }

static PyObject *map_nbytes(PyObject *obj, void *closure) {
    const Map *m = (Map *)obj;
    return PyLong_FromUnsignedLongLong(m->capacity * (sizeof *m->keys + sizeof *m->values));
}

static PyObject *map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (!PyArg_ParseTuple(args, ":Map")) return NULL;
    return type->tp_alloc(type, 0);
}

static PyMethodDef map_methods[] = {
    {"add", map_add, METH_VARARGS, "add(keys int64 [n], out int32 [n]) -> new keys: each key's slot, new ones numbered on"},
    {"find", map_find_py, METH_VARARGS, "find(keys int64 [n], out int32 [n]): each key's slot, -1 when absent"},
    {"keys", map_keys, METH_VARARGS, "keys(out int64 [len]): the keys in slot order"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef map_getset[] = {{"nbytes", map_nbytes, NULL, "bytes the map holds", NULL}, {NULL}};
static PySequenceMethods map_sequence = {.sq_length = map_len};

static PyTypeObject MapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._tables.Map",
    .tp_basicsize = sizeof(Map),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Map(): int64 keys -> int32 slots numbered in order of arrival; 12 bytes a slot, 3/8 to 3/4 of them used",
    .tp_new = map_new,
    .tp_dealloc = map_dealloc,
    .tp_methods = map_methods,
    .tp_getset = map_getset,
    .tp_as_sequence = &map_sequence,
};

/* ----- the hot tier ----- */

typedef struct {
    uint64_t *tags; /* (table + 1) << 40 | id; 0: empty */
    uint8_t *referenced;
    uint8_t *hands; /* per set: the CLOCK hand */
    unsigned char *data;
    size_t data_bytes;
    uint64_t sets, slots;
    int slot_bytes;
    pthread_mutex_t locks[LOCKS];
    uint64_t *doorkeeper; /* ADMIT_SECOND: a bitmap of keys missed once */
    uint64_t door_bits;
    atomic_uint_fast64_t door_set; /* bits set since the last reset */
    atomic_uint_fast64_t filled;   /* slots holding a row */
    atomic_uint_fast64_t evictions, admitted;
} Cache;

static inline uint64_t cache_key(int table, int64_t id) { return ((uint64_t)(table + 1) << 40) | (uint64_t)id; }

static void cache_free(Cache *c) {
    if (c == NULL) return;
    free(c->tags);
    free(c->referenced);
    free(c->hands);
    free(c->doorkeeper);
    if (c->data && c->data != MAP_FAILED) munmap(c->data, c->data_bytes);
    for (int i = 0; i < LOCKS; i++) pthread_mutex_destroy(&c->locks[i]);
    free(c);
}

static Cache *cache_new(uint64_t budget, int slot_bytes, int admission) {
    const uint64_t per_slot = (uint64_t)slot_bytes + sizeof(uint64_t) + 1;
    uint64_t sets = budget / per_slot / WAYS;
    if (sets == 0) return NULL;
    Cache *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    for (int i = 0; i < LOCKS; i++) pthread_mutex_init(&c->locks[i], NULL);
    c->sets = sets;
    c->slots = sets * WAYS;
    c->slot_bytes = slot_bytes;
    c->tags = calloc(c->slots, sizeof *c->tags);
    c->referenced = calloc(c->slots, 1);
    c->hands = calloc(c->sets, 1);
    c->data_bytes = c->slots * (size_t)slot_bytes;
    /* untouched pages cost nothing: resident memory grows as the tier fills */
    c->data = mmap(NULL, c->data_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (admission == ADMIT_SECOND) {
        c->door_bits = 1; /* 8 to 16 bits a slot: a byte or two beside a row of 136 */
        while (c->door_bits < c->slots * 8) c->door_bits <<= 1;
        c->doorkeeper = calloc(c->door_bits / 64, sizeof(uint64_t));
    }
    if (!c->tags || !c->referenced || !c->hands || c->data == MAP_FAILED ||
        (admission == ADMIT_SECOND && !c->doorkeeper)) {
        cache_free(c);
        return NULL;
    }
    return c;
}

static inline uint64_t cache_set(const Cache *c, uint64_t key) { return mix64(key) % c->sets; }

/* Copies key's row into dst when the tier holds it: 1, else 0. */
static int cache_get(Cache *c, uint64_t key, unsigned char *dst) {
    const uint64_t set = cache_set(c, key), first = set * WAYS;
    pthread_mutex_t *lock = &c->locks[set % LOCKS];
    int found = 0;
    pthread_mutex_lock(lock);
    for (int w = 0; w < WAYS; w++)
        if (c->tags[first + w] == key) {
            memcpy(dst, c->data + (first + w) * (size_t)c->slot_bytes, (size_t)c->slot_bytes);
            c->referenced[first + w] = 1;
            found = 1;
            break;
        }
    pthread_mutex_unlock(lock);
    return found;
}

/* Whether the doorkeeper lets a missed key in: its second miss since the bitmap was last cleared. */
static int door_admits(Cache *c, uint64_t key) {
    const uint64_t bit = mix64(key ^ 0xA5A5A5A5A5A5A5A5ULL) & (c->door_bits - 1);
    const uint64_t mask = 1ULL << (bit % 64);
    const uint64_t old = __atomic_fetch_or(&c->doorkeeper[bit / 64], mask, __ATOMIC_RELAXED);
    if (old & mask) return 1;
    if (atomic_fetch_add_explicit(&c->door_set, 1, memory_order_relaxed) + 1 > c->door_bits / 2) {
        atomic_store_explicit(&c->door_set, 0, memory_order_relaxed); /* a new window: forget the old misses */
        memset(c->doorkeeper, 0, c->door_bits / 8);
    }
    return 0;
}

/* Puts key's row in the tier (evict: whether a row may leave for it). Returns the table (0-based) of the row
 * it evicted, -1 when none was, -2 when it did not go in. */
static int cache_put(Cache *c, uint64_t key, const unsigned char *src, int evict) {
    const uint64_t set = cache_set(c, key), first = set * WAYS;
    pthread_mutex_t *lock = &c->locks[set % LOCKS];
    int result = -2;
    pthread_mutex_lock(lock);
    int way = -1;
    for (int w = 0; w < WAYS; w++) {
        if (c->tags[first + w] == key) {
            pthread_mutex_unlock(lock);
            return -2;
        }
        if (way < 0 && c->tags[first + w] == 0) way = w;
    }
    if (way >= 0) {
        atomic_fetch_add_explicit(&c->filled, 1, memory_order_relaxed);
        result = -1;
    } else if (evict) {
        int hand = c->hands[set];
        for (int turn = 0; turn < 2 * WAYS; turn++, hand = (hand + 1) % WAYS) {
            if (c->referenced[first + hand]) {
                c->referenced[first + hand] = 0;
                continue;
            }
            break;
        }
        way = hand;
        c->hands[set] = (uint8_t)((hand + 1) % WAYS);
        result = (int)(c->tags[first + way] >> 40) - 1;
        atomic_fetch_add_explicit(&c->evictions, 1, memory_order_relaxed);
    }
    if (way >= 0) {
        c->tags[first + way] = key;
        c->referenced[first + way] = 0;
        memcpy(c->data + (first + way) * (size_t)c->slot_bytes, src, (size_t)c->slot_bytes);
        atomic_fetch_add_explicit(&c->admitted, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(lock);
    return result;
}

/* ----- tables and their statistics ----- */

typedef struct {
    atomic_uint_fast64_t lookups, unique, hits, cold_rows, cold_blocks, cold_bytes, read_errors, checksum_errors,
        late, cached;
} TableStats;

typedef struct {
    char name[64], path[1024];
    char key[256];           /* the cold tier in Redis: this table's keys are key:header and key:<block> */
    uint64_t rows, blocks;
    int dim, format, row_bytes, per_block;
    int fd;                  /* big tables: the file, O_DIRECT where it can be */
    unsigned char *memory;   /* small tables: every block; mmap mode: the file's mapping */
    size_t memory_bytes;
    int mapped;              /* memory is a mapping of the file */
    uint64_t n_delta;        /* the rows a release changed since the file's: sorted ids, their rows */
    int64_t *delta_ids;
    unsigned char *delta_rows;
    TableStats stats;
} Table;

typedef struct {
    atomic_uint_fast64_t calls, cold_calls, latency_ns, buckets[LATENCY_BUCKETS];
    atomic_uint_fast64_t warmed_rows;
} StoreStats;

/* ----- a thread's scratch for one gather ----- */

typedef struct {
    int64_t *keys;       /* per unique key of a table: its id */
    int64_t *first;      /* its first position (row * F + column) */
    int32_t *slots;      /* open addressing over a table's unique keys: index + 1 */
    int32_t *miss_table; /* per missed key: its table, its id, where its row goes, its block buffer */
    int64_t *miss_id, *miss_dest, *miss_block;
    int32_t *miss_buffer, *order;
    int64_t *read_block; /* per block to read: its index and table */
    int32_t *read_table;
    unsigned char *row;  /* one encoded row */
    unsigned char *io;   /* 4096-aligned block buffers */
    size_t n_rows, n_missed, n_io, row_bytes, n_slots;
} Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_made;

static void scratch_free(void *p) {
    Scratch *s = p;
    if (s == NULL) return;
    free(s->keys), free(s->first), free(s->slots);
    free(s->miss_table), free(s->miss_id), free(s->miss_dest), free(s->miss_block), free(s->miss_buffer), free(s->order);
    free(s->read_block), free(s->read_table);
    free(s->row), free(s->io);
    free(s);
}

static void scratch_key_make(void) { scratch_key_made = pthread_key_create(&scratch_key, scratch_free) == 0; }

/* Grows *p to hold n items of size each; 0, or -1 out of memory (*p kept). */
static int grow(void **p, size_t n, size_t size) {
    void *q = realloc(*p, (n ? n : 1) * size);
    if (q == NULL) return -1;
    *p = q;
    return 0;
}

/* The open-addressing capacity for a table's keys in a call of rows rows: a power of two >= 2 rows. */
static size_t slots_for(size_t rows) {
    size_t cap = 16;
    while (cap < 2 * rows) cap <<= 1;
    return cap;
}

/* This thread's scratch for calls of rows rows x columns tables, n_io block buffers and rows of row_bytes;
 * NULL when out of memory. */
static Scratch *thread_scratch(size_t rows, size_t columns, size_t n_io, size_t row_bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    if (!scratch_key_made) return NULL;
    Scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (rows > s->n_rows) {
        if (grow((void **)&s->keys, rows, sizeof *s->keys) || grow((void **)&s->first, rows, sizeof *s->first)) return NULL;
        s->n_rows = rows;
    }
    if (slots_for(rows) > s->n_slots) {
        if (grow((void **)&s->slots, slots_for(rows), sizeof *s->slots)) return NULL;
        s->n_slots = slots_for(rows);
    }
    const size_t missed = rows * columns;
    if (missed > s->n_missed) {
        if (grow((void **)&s->miss_table, missed, sizeof *s->miss_table) || grow((void **)&s->miss_id, missed, 8) ||
            grow((void **)&s->miss_dest, missed, 8) || grow((void **)&s->miss_block, missed, 8) ||
            grow((void **)&s->miss_buffer, missed, 4) || grow((void **)&s->order, missed, 4) ||
            grow((void **)&s->read_block, missed, 8) || grow((void **)&s->read_table, missed, 4))
            return NULL;
        s->n_missed = missed;
    }
    if (row_bytes > s->row_bytes) {
        if (grow((void **)&s->row, row_bytes, 1)) return NULL;
        s->row_bytes = row_bytes;
    }
    if (n_io > s->n_io) {
        unsigned char *io = NULL;
        if (posix_memalign((void **)&io, BLOCK, n_io * BLOCK) != 0) return NULL;
        free(s->io);
        s->io = io;
        s->n_io = n_io;
    }
    return s;
}

/* This thread's last failure (a table that could not be read, a deadline passed) as text. */
static __thread char failure_text[ENSEMBLE_ERROR_SIZE];

#ifdef ENSEMBLE_URING
/* A thread's ring. A call whose reads pass its deadline returns at once; its reads still in flight keep their
 * buffers (the kernel writes into them), which the ring holds as abandoned until their completions arrive, told
 * apart from a later call's by the generation in their user data. */
#define ABANDONED 8
typedef struct {
    struct io_uring ring;
    int ready;
    uint32_t generation;
    struct {
        unsigned char *buffer;
        int outstanding;
        uint32_t generation;
    } abandoned[ABANDONED];
} Ring;
static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static int ring_key_made;

/* A completion of an abandoned call: one read less outstanding; its buffer freed with the last. */
static void ring_settle(Ring *r, uint32_t generation) {
    for (int a = 0; a < ABANDONED; a++)
        if (r->abandoned[a].buffer && r->abandoned[a].generation == generation && --r->abandoned[a].outstanding == 0) {
            free(r->abandoned[a].buffer);
            r->abandoned[a].buffer = NULL;
        }
}

static void ring_free(void *p) {
    Ring *r = p;
    if (r == NULL) return;
    if (r->ready) {
        for (int a = 0; a < ABANDONED; a++) { /* the thread ends: its abandoned reads are waited for */
            while (r->abandoned[a].buffer) {
                struct io_uring_cqe *cqe;
                if (io_uring_wait_cqe(&r->ring, &cqe) < 0) break;
                ring_settle(r, (uint32_t)(io_uring_cqe_get_data64(cqe) >> 32));
                io_uring_cqe_seen(&r->ring, cqe);
            }
            free(r->abandoned[a].buffer);
        }
        io_uring_queue_exit(&r->ring);
    }
    free(r);
}
static void ring_key_make(void) { ring_key_made = pthread_key_create(&ring_key, ring_free) == 0; }
static Ring *thread_ring(void) {
    pthread_once(&ring_once, ring_key_make);
    if (!ring_key_made) return NULL;
    Ring *r = pthread_getspecific(ring_key);
    if (r == NULL) {
        r = calloc(1, sizeof *r);
        if (r == NULL) return NULL;
        if (io_uring_queue_init(MAX_DEPTH, &r->ring, 0) < 0 || pthread_setspecific(ring_key, r) != 0) {
            free(r);
            return NULL;
        }
        r->ready = 1;
    }
    return r;
}
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ----- the cold tier in Redis ----- */

#ifdef ENSEMBLE_HIREDIS
/* Redis Cluster's key slot: CRC16 (XMODEM) of the key, or of its {hash tag} when it has one, mod 16384. */
static uint16_t crc16(const char *p, size_t n) {
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)((unsigned char)p[i] << 8);
        for (int b = 0; b < 8; b++) crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

static uint16_t key_slot(const char *key, size_t n) {
    const char *open = memchr(key, '{', n);
    if (open) {
        const char *close = memchr(open + 1, '}', n - (size_t)(open + 1 - key));
        if (close && close > open + 1) return crc16(open + 1, (size_t)(close - open - 1)) & 16383;
    }
    return crc16(key, n) & 16383;
}

/* This thread's connection to each node (hiredis contexts are not shared between threads). */
typedef struct {
    redisContext *ctx[MAX_NODES];
    const void *store; /* the store they belong to: another store's call reconnects */
} Links;
static pthread_key_t links_key;
static pthread_once_t links_once = PTHREAD_ONCE_INIT;
static int links_key_made;
static void links_free(void *p) {
    Links *l = p;
    if (l == NULL) return;
    for (int k = 0; k < MAX_NODES; k++)
        if (l->ctx[k]) redisFree(l->ctx[k]);
    free(l);
}
static void links_key_make(void) { links_key_made = pthread_key_create(&links_key, links_free) == 0; }

static struct timeval timeval_of(double seconds) {
    if (seconds < 0.001) seconds = 0.001;
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    return tv;
}

/* This thread's connection to node k of the store (NULL, failure_text set, when it cannot be made). */
static redisContext *link_to(const void *store, const char (*hosts)[128], const int *ports, int k, double timeout) {
    pthread_once(&links_once, links_key_make);
    if (!links_key_made) return NULL;
    Links *l = pthread_getspecific(links_key);
    if (l == NULL) {
        l = calloc(1, sizeof *l);
        if (l == NULL || pthread_setspecific(links_key, l) != 0) {
            free(l);
            snprintf(failure_text, sizeof failure_text, "the cold tier: no memory for a connection");
            return NULL;
        }
    }
    if (l->store != store) { /* another store's (an earlier release's) links */
        for (int i = 0; i < MAX_NODES; i++)
            if (l->ctx[i]) {
                redisFree(l->ctx[i]);
                l->ctx[i] = NULL;
            }
        l->store = store;
    }
    if (l->ctx[k] && l->ctx[k]->err) {
        redisFree(l->ctx[k]);
        l->ctx[k] = NULL;
    }
    if (l->ctx[k] == NULL) {
        l->ctx[k] = redisConnectWithTimeout(hosts[k], ports[k], timeval_of(timeout));
        if (l->ctx[k] == NULL || l->ctx[k]->err) {
            snprintf(failure_text, sizeof failure_text, "the cold tier: cannot reach redis://%s:%d (%s)", hosts[k], ports[k],
                     l->ctx[k] ? l->ctx[k]->errstr : "no memory");
            if (l->ctx[k]) redisFree(l->ctx[k]);
            l->ctx[k] = NULL;
            return NULL;
        }
    }
    return l->ctx[k];
}
#endif

/* ----- the store ----- */

typedef struct {
    PyObject_HEAD
    int n_tables, dim, admission, io, depth;
    Table tables[MAX_TABLES];
    /* The cold tier in Redis (io "redis"): its nodes, and which node holds each of the cluster's 16,384 slots
     * (a node not in cluster mode holds them all). */
    int n_nodes;
    char node_host[MAX_NODES][128];
    int node_port[MAX_NODES];
    uint8_t slot_node[16384];
    Cache *cache;
    uint64_t budget;
    StoreStats stats;
    double warm_seconds;
} Store;

static void table_close(Table *t) {
    if (t->fd >= 0) close(t->fd);
    t->fd = -1;
    if (t->memory) {
        if (t->mapped)
            munmap(t->memory, t->memory_bytes);
        else
            free(t->memory);
    }
    t->memory = NULL;
    free(t->delta_ids);
    free(t->delta_rows);
    t->delta_ids = NULL;
    t->delta_rows = NULL;
}

static void store_dealloc(PyObject *obj) {
    Store *s = (Store *)obj;
    for (int i = 0; i < s->n_tables; i++) table_close(&s->tables[i]);
    cache_free(s->cache);
    Py_TYPE(obj)->tp_free(obj);
}

/* Reads and checks a table file's header into t; -1 with an exception set (naming the file) when it is not one. */
static int table_open(Table *t, int in_memory, int io) {
    t->fd = -1;
    int fd = open(t->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        PyErr_Format(TableError, "table %s: cannot open %s: %s", t->name, t->path, strerror(errno));
        return -1;
    }
    unsigned char block[BLOCK];
    const ssize_t got = pread(fd, block, BLOCK, 0);
    Header h;
    memcpy(&h, block, sizeof h);
    if (got != BLOCK || memcmp(h.magic, MAGIC, 8) != 0 || block_crc(UINT64_MAX, block) != stored_crc(block)) {
        close(fd);
        PyErr_Format(TableError, "table %s: %s is not a table file (its header %s)", t->name, t->path,
                     got != BLOCK ? "is short" : "fails its check");
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != (h.blocks + 1) * BLOCK || h.version != FORMAT_VERSION ||
        h.rows != t->rows || (int)h.dim != t->dim || h.format > FMT_INT8 ||
        (int)h.row_bytes != row_bytes_of((int)h.format, (int)h.dim) || (int)h.per_block != per_block_of((int)h.row_bytes)) {
        close(fd);
        PyErr_Format(TableError, "table %s: %s holds %llu rows of %u %s values in %lld bytes; the release expects %llu rows "
                     "of %d (a truncated or foreign file)", t->name, t->path, (unsigned long long)h.rows, h.dim,
                     h.format <= FMT_INT8 ? FORMAT_NAMES[h.format] : "?", (long long)st.st_size,
                     (unsigned long long)t->rows, t->dim);
        return -1;
    }
    t->format = (int)h.format;
    t->row_bytes = (int)h.row_bytes;
    t->per_block = (int)h.per_block;
    t->blocks = h.blocks;
    if (in_memory) { /* read whole, every block checked */
        t->memory_bytes = (size_t)h.blocks * BLOCK;
        t->memory = malloc(t->memory_bytes ? t->memory_bytes : 1);
        if (t->memory == NULL) {
            close(fd);
            PyErr_NoMemory();
            return -1;
        }
        size_t done = 0;
        while (done < t->memory_bytes) {
            const ssize_t n = pread(fd, t->memory + done, t->memory_bytes - done, BLOCK + (off_t)done);
            if (n <= 0) {
                close(fd);
                PyErr_Format(TableError, "table %s: reading %s: %s", t->name, t->path, n < 0 ? strerror(errno) : "short");
                return -1;
            }
            done += (size_t)n;
        }
        for (uint64_t b = 0; b < h.blocks; b++)
            if (block_crc(b, t->memory + b * BLOCK) != stored_crc(t->memory + b * BLOCK)) {
                close(fd);
                PyErr_Format(TableError, "table %s: block %llu of %s fails its checksum", t->name, (unsigned long long)b,
                             t->path);
                return -1;
            }
        close(fd);
        return 0;
    }
    if (io == IO_MMAP) {
        t->memory_bytes = (size_t)(h.blocks + 1) * BLOCK;
        t->memory = mmap(NULL, t->memory_bytes, PROT_READ, MAP_SHARED, fd, 0);
        if (t->memory == MAP_FAILED) {
            t->memory = NULL;
            close(fd);
            PyErr_Format(TableError, "table %s: cannot map %s: %s", t->name, t->path, strerror(errno));
            return -1;
        }
        madvise(t->memory, t->memory_bytes, MADV_RANDOM);
        t->mapped = 1;
        close(fd);
        return 0;
    }
    close(fd);
    t->fd = open(t->path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (t->fd < 0) t->fd = open(t->path, O_RDONLY | O_CLOEXEC); /* a file system without O_DIRECT */
    if (t->fd < 0) {
        PyErr_Format(TableError, "table %s: cannot open %s: %s", t->name, t->path, strerror(errno));
        return -1;
    }
    return 0;
}

/* The cold tier's nodes from "host:port[,host:port...]": a cluster's (CLUSTER SLOTS, asked of the first that
 * answers) or one node's; -1 with an exception set when none answers. With the interpreter's lock held. */
static int redis_nodes(Store *s, const char *list) {
#ifdef ENSEMBLE_HIREDIS
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", list);
    char *path = strchr(copy, '/'); /* a database number after the nodes (a cluster has only 0): not used */
    if (path) *path = 0;
    if (strchr(copy, '@')) {
        PyErr_SetString(TableError, "the cold tier: a password in the URL is not supported (a cluster on a private network)");
        return -1;
    }
    char *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strrchr(item, ':');
        if (colon == NULL) continue;
        *colon = 0;
        const char *host = item;
        const int port = atoi(colon + 1);
        redisContext *c = redisConnectWithTimeout(host, port, timeval_of(5.0));
        if (c == NULL || c->err) {
            if (c) redisFree(c);
            continue;
        }
        redisSetTimeout(c, timeval_of(5.0));
        redisReply *r = redisCommand(c, "CLUSTER SLOTS");
        if (r && r->type == REDIS_REPLY_ARRAY) { /* a cluster: every slot range's master */
            for (size_t i = 0; i < r->elements && s->n_nodes >= 0; i++) {
                redisReply *range = r->element[i];
                if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[2]->type != REDIS_REPLY_ARRAY ||
                    range->element[2]->elements < 2)
                    continue;
                const char *h = range->element[2]->element[0]->str;
                const int p = (int)range->element[2]->element[1]->integer;
                int node = -1;
                for (int k = 0; k < s->n_nodes; k++)
                    if (strcmp(s->node_host[k], h && h[0] ? h : host) == 0 && s->node_port[k] == p) node = k;
                if (node < 0) {
                    if (s->n_nodes == MAX_NODES) {
                        s->n_nodes = -1;
                        break;
                    }
                    node = s->n_nodes++;
                    snprintf(s->node_host[node], sizeof s->node_host[node], "%s", h && h[0] ? h : host);
                    s->node_port[node] = p;
                }
                for (long long slot = range->element[0]->integer; slot <= range->element[1]->integer && slot < 16384; slot++)
                    s->slot_node[slot] = (uint8_t)node;
            }
        } else { /* not a cluster: this node holds every key */
            s->n_nodes = 1;
            snprintf(s->node_host[0], sizeof s->node_host[0], "%s", host);
            s->node_port[0] = port;
            memset(s->slot_node, 0, sizeof s->slot_node);
        }
        if (r) freeReplyObject(r);
        redisFree(c);
        if (s->n_nodes > 0) return 0;
        if (s->n_nodes < 0) {
            PyErr_Format(TableError, "the cold tier %s: more than %d nodes", list, MAX_NODES);
            return -1;
        }
    }
    PyErr_Format(TableError, "the cold tier redis://%s: no node answered", list);
    return -1;
#else
    PyErr_SetString(TableError, "this build has no Redis client");
    return -1;
#endif
}

/* A large table whose blocks are in Redis: its header (key:header) fetched and checked as a file's would be;
 * -1 with an exception naming the table and the key. */
static int redis_table_open(Store *s, Table *t) {
#ifdef ENSEMBLE_HIREDIS
    char key[300];
    const int n = snprintf(key, sizeof key, "%s:header", t->key);
    const int node = s->slot_node[key_slot(key, (size_t)n)];
    redisContext *c = redisConnectWithTimeout(s->node_host[node], s->node_port[node], timeval_of(5.0));
    if (c == NULL || c->err) {
        PyErr_Format(TableError, "table %s: the cold tier redis://%s:%d does not answer", t->name, s->node_host[node],
                     s->node_port[node]);
        if (c) redisFree(c);
        return -1;
    }
    redisSetTimeout(c, timeval_of(5.0));
    redisReply *r = redisCommand(c, "GET %b", key, (size_t)n);
    int ok = r && r->type == REDIS_REPLY_STRING && r->len == BLOCK;
    Header h;
    if (ok) {
        memcpy(&h, r->str, sizeof h);
        ok = memcmp(h.magic, MAGIC, 8) == 0 && block_crc(UINT64_MAX, (const unsigned char *)r->str) ==
                                                    stored_crc((const unsigned char *)r->str) &&
             h.version == FORMAT_VERSION && h.rows == t->rows && (int)h.dim == t->dim && h.format <= FMT_INT8 &&
             (int)h.row_bytes == row_bytes_of((int)h.format, (int)h.dim) && (int)h.per_block == per_block_of((int)h.row_bytes);
    }
    const int missing = r && r->type == REDIS_REPLY_NIL;
    if (r) freeReplyObject(r);
    redisFree(c);
    if (!ok) {
        PyErr_Format(TableError, "table %s: the cold tier redis://%s:%d %s %s", t->name, s->node_host[node],
                     s->node_port[node], missing ? "holds no" : "holds a foreign or mismatched", key);
        return -1;
    }
    t->format = (int)h.format;
    t->row_bytes = (int)h.row_bytes;
    t->per_block = (int)h.per_block;
    t->blocks = h.blocks;
    return 0;
#else
    PyErr_SetString(TableError, "this build has no Redis client");
    return -1;
#endif
}

/* Store(tables, budget_bytes, admission="always", io="uring", depth=32)
 *   tables: a sequence of (name, path, rows, dim, in_memory, delta_ids int64 [n] or None, delta_rows bytes or None) */
static PyObject *store_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"tables", "budget_bytes", "admission", "io", "depth", NULL};
    PyObject *tables;
    unsigned long long budget = 0;
    const char *admission = "always", *io = "uring";
    int depth = 32;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OK|ssi:Store", names, &tables, &budget, &admission, &io, &depth))
        return NULL;
    PyObject *seq = PySequence_Fast(tables, "tables must be a sequence");
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_TABLES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "a store holds 1 to %d tables", MAX_TABLES);
        return NULL;
    }
    Store *s = (Store *)type->tp_alloc(type, 0);
    if (s == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (int i = 0; i < MAX_TABLES; i++) s->tables[i].fd = -1;
    s->admission = -1;
    for (int a = 0; a < 3; a++)
        if (strcmp(admission, ADMISSION_NAMES[a]) == 0) s->admission = a;
    s->io = -1;
    for (int k = 0; k < 3; k++)
        if (strcmp(io, IO_NAMES[k]) == 0) s->io = k;
    if (strncmp(io, "redis://", 8) == 0) s->io = IO_REDIS;
#ifndef ENSEMBLE_URING
    if (s->io == IO_URING) s->io = -2;
#endif
#ifndef ENSEMBLE_HIREDIS
    if (s->io == IO_REDIS) s->io = -3;
#endif
    if (s->admission < 0 || s->io < 0 || depth < 1 || depth > MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, s->io == -2   ? "io=uring: this build has no io_uring (liburing was missing at install)"
                                       : s->io == -3 ? "io=redis://: this build has no Redis client (hiredis was missing at "
                                                       "install)"
                                                     : "admission must be always, second or none; io uring, pread, mmap "
                                                       "or redis://host:port[,host:port...]; depth 1 to %d",
                     MAX_DEPTH);
        goto fail;
    }
    if (s->io == IO_REDIS && redis_nodes(s, io + 8) < 0) goto fail;
    s->depth = depth;
    s->budget = budget;
    int big_bytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Table *t = &s->tables[i];
        const char *name, *path;
        unsigned long long rows;
        int dim, in_memory;
        PyObject *delta_ids, *delta_rows;
        const char *key = "";
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ssKipOO|s", &name, &path, &rows, &dim, &in_memory,
                              &delta_ids, &delta_rows, &key))
            goto fail;
        snprintf(t->name, sizeof t->name, "%s", name);
        snprintf(t->path, sizeof t->path, "%s", path);
        snprintf(t->key, sizeof t->key, "%s", key);
        if (s->io == IO_REDIS && !in_memory && !key[0]) {
            PyErr_Format(PyExc_ValueError, "table %s: a large table read from Redis needs its key", name);
            goto fail;
        }
        t->rows = rows;
        t->dim = dim;
        s->n_tables = (int)i + 1;
        if (s->dim && dim != s->dim) {
            PyErr_SetString(PyExc_ValueError, "every table of a store has one width");
            goto fail;
        }
        s->dim = dim;
        if ((s->io == IO_REDIS && !in_memory ? redis_table_open(s, t) : table_open(t, in_memory, s->io)) < 0) goto fail;
        if (!in_memory) {
            if (big_bytes && t->row_bytes != big_bytes) {
                PyErr_SetString(PyExc_ValueError, "the large tables of a store share one format");
                goto fail;
            }
            big_bytes = t->row_bytes;
        }
        if (delta_ids != Py_None) {
            Buffer b[2] = {0};
            if (take(delta_ids, &b[0], "delta_ids", 8, 0) < 0 || take(delta_rows, &b[1], "delta_rows", 1, 0) < 0) {
                give_back(b, 2);
                goto fail;
            }
            const Py_ssize_t nd = b[0].view.len / 8;
            if (b[1].view.len != nd * t->row_bytes) {
                give_back(b, 2);
                PyErr_Format(PyExc_ValueError, "table %s: delta_rows must hold a row of its format per delta id", name);
                goto fail;
            }
            t->delta_ids = malloc((size_t)(nd ? nd : 1) * 8);
            t->delta_rows = malloc((size_t)(nd ? nd : 1) * (size_t)t->row_bytes);
            if (!t->delta_ids || !t->delta_rows) {
                give_back(b, 2);
                PyErr_NoMemory();
                goto fail;
            }
            memcpy(t->delta_ids, b[0].view.buf, (size_t)nd * 8);
            memcpy(t->delta_rows, b[1].view.buf, (size_t)(nd * t->row_bytes));
            t->n_delta = (uint64_t)nd;
            give_back(b, 2);
            for (uint64_t k = 1; k < t->n_delta; k++)
                if (t->delta_ids[k] <= t->delta_ids[k - 1]) {
                    PyErr_Format(PyExc_ValueError, "table %s: delta ids must be sorted and distinct", name);
                    goto fail;
                }
        }
    }
    Py_CLEAR(seq);
    if (big_bytes && budget) {
        s->cache = cache_new(budget, big_bytes, s->admission);
        if (s->cache == NULL) {
            PyErr_Format(PyExc_MemoryError, "the hot tier: %llu bytes hold no set of %d rows, or memory ran out", budget, WAYS);
            goto fail;
        }
    }
    return (PyObject *)s;
fail:
    Py_XDECREF(seq);
    Py_DECREF(s);
    return NULL;
}

static int64_t delta_find(const Table *t, int64_t id) {
    uint64_t lo = 0, hi = t->n_delta;
    while (lo < hi) {
        const uint64_t mid = (lo + hi) / 2;
        if (t->delta_ids[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < t->n_delta && t->delta_ids[lo] == id ? (int64_t)lo : -1;
}

/* The process's cold-read wall time: the seconds during which at least one call was reading cold rows. Calls
 * that overlap (the chain's threads, both DLRMs' stores) count once, so with one request in flight it is that
 * request's cold-read time, beside which fio's time for its blocks is set (docs/tables.md). */
static pthread_mutex_t reading_lock = PTHREAD_MUTEX_INITIALIZER;
static int reading_calls;
static double reading_since;
static atomic_uint_fast64_t reading_ns;

static void reading_begins(void) {
    pthread_mutex_lock(&reading_lock);
    if (reading_calls++ == 0) reading_since = now_s();
    pthread_mutex_unlock(&reading_lock);
}

static void reading_ends(void) {
    pthread_mutex_lock(&reading_lock);
    if (--reading_calls == 0)
        atomic_fetch_add_explicit(&reading_ns, (uint64_t)((now_s() - reading_since) * 1e9), memory_order_relaxed);
    pthread_mutex_unlock(&reading_lock);
}

static void record_latency(Store *s, double seconds) {
    const double ms = seconds * 1e3;
    int b = 0;
    while (b < LATENCY_BUCKETS - 1 && ms > LATENCY_BOUNDS_MS[b]) b++;
    atomic_fetch_add_explicit(&s->stats.buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->stats.latency_ns, (uint64_t)(seconds * 1e9), memory_order_relaxed);
    atomic_fetch_add_explicit(&s->stats.cold_calls, 1, memory_order_relaxed);
}

/* The blocks from the cold tier in Redis: per node, one pipeline of GETs, its replies read back by the deadline.
 * 0, or -1 with failure_text set (a node that does not answer in time, a block it does not hold). */
static int redis_read(Store *s, Scratch *sc, const int32_t *table_of, const int64_t *block, int32_t n, double deadline) {
#ifdef ENSEMBLE_HIREDIS
    uint8_t *node_of = malloc((size_t)(n ? n : 1));
    if (node_of == NULL) {
        snprintf(failure_text, sizeof failure_text, "the cold tier: no memory for %d reads", n);
        return -1;
    }
    char key[300];
    for (int32_t k = 0; k < n; k++) {
        const int len = snprintf(key, sizeof key, "%s:%lld", s->tables[table_of[k]].key, (long long)block[k]);
        node_of[k] = s->slot_node[key_slot(key, (size_t)len)];
    }
    int result = 0;
    for (int j = 0; j < s->n_nodes && result == 0; j++) {
        const double left = deadline > 0 ? deadline - now_s() : 5.0;
        redisContext *c = link_to(s, s->node_host, s->node_port, j, left > 0 ? left : 0.001);
        if (c == NULL) { /* said as the first table whose blocks that node holds, and counted as its read error */
            for (int32_t k = 0; k < n; k++)
                if (node_of[k] == j) {
                    const Table *t = &s->tables[table_of[k]];
                    atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.read_errors, 1, memory_order_relaxed);
                    char said[ENSEMBLE_ERROR_SIZE];
                    snprintf(said, sizeof said, "%s", failure_text);
                    snprintf(failure_text, sizeof failure_text, "table %.64s: %.400s", t->name, said);
                    break;
                }
            result = -1;
            break;
        }
        int32_t asked = 0;
        for (int32_t k = 0; k < n; k++) {
            if (node_of[k] != j) continue;
            const int len = snprintf(key, sizeof key, "%s:%lld", s->tables[table_of[k]].key, (long long)block[k]);
            redisAppendCommand(c, "GET %b", key, (size_t)len);
            asked++;
        }
        if (asked == 0) continue;
        redisSetTimeout(c, timeval_of(deadline > 0 ? deadline - now_s() : 5.0));
        for (int32_t k = 0; k < n && result == 0; k++) {
            if (node_of[k] != j) continue;
            redisReply *r = NULL;
            const Table *t = &s->tables[table_of[k]];
            if (redisGetReply(c, (void **)&r) != REDIS_OK || r == NULL) {
                const int late = deadline > 0 && now_s() >= deadline;
                atomic_fetch_add_explicit((atomic_uint_fast64_t *)(late ? &t->stats.late : &t->stats.read_errors), 1,
                                          memory_order_relaxed);
                snprintf(failure_text, sizeof failure_text,
                         late ? "table %s: cold reads did not finish within the request's deadline (redis://%s:%d)"
                              : "table %s: the cold tier redis://%s:%d failed: %s",
                         t->name, s->node_host[j], s->node_port[j], c->errstr);
                c->err = c->err ? c->err : REDIS_ERR_IO; /* the connection's replies are out of step: made anew */
                result = -1;
            } else if (r->type != REDIS_REPLY_STRING || r->len != BLOCK) {
                atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.read_errors, 1, memory_order_relaxed);
                snprintf(failure_text, sizeof failure_text, "table %s: the cold tier redis://%s:%d holds no block %lld (%s)",
                         t->name, s->node_host[j], s->node_port[j], (long long)block[k],
                         r->type == REDIS_REPLY_NIL ? "missing" : "not a block");
                result = -1;
                c->err = REDIS_ERR_OTHER; /* later replies of this pipeline are not read: the connection is made anew */
            } else {
                memcpy(sc->io + (size_t)k * BLOCK, r->str, BLOCK);
            }
            if (r) freeReplyObject(r);
        }
    }
    free(node_of);
    return result;
#else
    snprintf(failure_text, sizeof failure_text, "this build has no Redis client");
    return -1;
#endif
}

/* Reads blocks [k] (of tables table_of[k]) into buffers; 0, or -1 with failure_text set. */
static int read_blocks(Store *s, Scratch *sc, const int32_t *table_of, const int64_t *block, int32_t n, double deadline) {
    for (int32_t k = 0; k < n; k++)
        if (s->tables[table_of[k]].mapped) { /* mmap: the page cache's way */
            const Table *t = &s->tables[table_of[k]];
            memcpy(sc->io + (size_t)k * BLOCK, t->memory + (size_t)(block[k] + 1) * BLOCK, BLOCK);
        }
    if (s->io == IO_MMAP) return 0;
    if (s->io == IO_REDIS) return redis_read(s, sc, table_of, block, n, deadline);
    if (s->io == IO_PREAD) {
        for (int32_t k = 0; k < n; k++) {
            const Table *t = &s->tables[table_of[k]];
            if (deadline > 0 && now_s() > deadline) {
                snprintf(failure_text, sizeof failure_text, "table %s: cold reads did not finish within the request's deadline",
                         t->name);
                atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.late, 1, memory_order_relaxed);
                return -1;
            }
            const ssize_t got = pread(t->fd, sc->io + (size_t)k * BLOCK, BLOCK, (off_t)(block[k] + 1) * BLOCK);
            if (got != BLOCK) {
                snprintf(failure_text, sizeof failure_text, "table %s: reading block %lld of %s failed: %s", t->name,
                         (long long)block[k], t->path, got < 0 ? strerror(errno) : "short read");
                atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.read_errors, 1, memory_order_relaxed);
                return -1;
            }
        }
        return 0;
    }
#ifdef ENSEMBLE_URING
    Ring *r = thread_ring();
    if (r == NULL) {
        snprintf(failure_text, sizeof failure_text, "the cold reads' io_uring could not be set up");
        return -1;
    }
    struct io_uring *ring = &r->ring;
    struct io_uring_cqe *cqe = NULL;
    while (io_uring_peek_cqe(ring, &cqe) == 0) { /* completions of calls that gave up on them */
        ring_settle(r, (uint32_t)(io_uring_cqe_get_data64(cqe) >> 32));
        io_uring_cqe_seen(ring, cqe);
    }
    const uint32_t generation = ++r->generation;
    int32_t next = 0, inflight = 0, failed = -1, late = 0;
    int error = 0;
    while (next < n || inflight > 0) {
        while (next < n && inflight < s->depth && failed < 0) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            if (sqe == NULL) break;
            const Table *t = &s->tables[table_of[next]];
            io_uring_prep_read(sqe, t->fd, sc->io + (size_t)next * BLOCK, BLOCK, (uint64_t)(block[next] + 1) * BLOCK);
            io_uring_sqe_set_data64(sqe, ((uint64_t)generation << 32) | (uint64_t)next);
            next++;
            inflight++;
        }
        if (inflight == 0) break;
        io_uring_submit(ring);
        int rc;
        if (deadline > 0) {
            double left = deadline - now_s();
            if (left < 0) left = 0;
            struct __kernel_timespec ts = {(long long)left, (long long)((left - (double)(long long)left) * 1e9)};
            rc = io_uring_wait_cqe_timeout(ring, &cqe, &ts);
            if (rc == -ETIME) {
                late = 1;
                break;
            }
        } else {
            rc = io_uring_wait_cqe(ring, &cqe);
        }
        if (rc < 0) {
            if (rc == -EINTR) continue;
            failed = 0;
            error = -rc;
            break;
        }
        do {
            const uint64_t data = io_uring_cqe_get_data64(cqe);
            if ((uint32_t)(data >> 32) != generation) { /* an abandoned call's */
                ring_settle(r, (uint32_t)(data >> 32));
            } else {
                const int32_t k = (int32_t)(data & 0xFFFFFFFF);
                if (cqe->res != BLOCK && failed < 0) {
                    failed = k;
                    error = cqe->res < 0 ? -cqe->res : 0;
                }
                inflight--;
            }
            io_uring_cqe_seen(ring, cqe);
        } while (inflight > 0 && io_uring_peek_cqe(ring, &cqe) == 0);
        if (failed >= 0) break;
    }
    if (inflight > 0) { /* give up on the reads in flight: their buffer stays theirs until they complete */
        int slot = -1;
        for (int a = 0; a < ABANDONED && slot < 0; a++)
            if (r->abandoned[a].buffer == NULL) slot = a;
        if (slot >= 0) {
            r->abandoned[slot].buffer = sc->io;
            r->abandoned[slot].outstanding = inflight;
            r->abandoned[slot].generation = generation;
            sc->io = NULL; /* the next call takes a new buffer */
            sc->n_io = 0;
        } else { /* too many abandoned calls: this one waits for its own reads */
            while (inflight > 0 && io_uring_wait_cqe(ring, &cqe) == 0) {
                const uint64_t data = io_uring_cqe_get_data64(cqe);
                if ((uint32_t)(data >> 32) == generation)
                    inflight--;
                else
                    ring_settle(r, (uint32_t)(data >> 32));
                io_uring_cqe_seen(ring, cqe);
            }
        }
    }
    if (late) {
        const Table *t = &s->tables[table_of[next < n ? next : n - 1]];
        atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.late, 1, memory_order_relaxed);
        snprintf(failure_text, sizeof failure_text, "table %s: cold reads did not finish within the request's deadline",
                 t->name);
        return -1;
    }
    if (failed >= 0) {
        const Table *t = &s->tables[table_of[failed]];
        atomic_fetch_add_explicit((atomic_uint_fast64_t *)&t->stats.read_errors, 1, memory_order_relaxed);
        snprintf(failure_text, sizeof failure_text, "table %s: reading block %lld of %s failed: %s", t->name,
                 (long long)block[failed], t->path, error ? strerror(error) : "short read");
        return -1;
    }
    return 0;
#else
    snprintf(failure_text, sizeof failure_text, "io_uring is not in this build");
    return -1;
#endif
}

static inline void add_stat(atomic_uint_fast64_t *counter, uint64_t n) {
    atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

/* The rows of ids [B x F] into out [B x F x dim] float32 (row-major): -1 done, -2 out of memory, -4 a table
 * could not be read in time (failure_text says which and why), else the flat index of an id outside its
 * table. No Python call: it runs without the interpreter's lock. */
static int64_t store_gather(Store *s, const int64_t *ids, int64_t B, float *out, double deadline) {
    const int F = s->n_tables, dim = s->dim;
    for (int64_t r = 0; r < B; r++)
        for (int c = 0; c < F; c++) {
            const int64_t id = ids[r * F + c];
            if (id < 0 || (uint64_t)id >= s->tables[c].rows) return r * F + c;
        }
    if (B == 0) return -1;
    int max_row = 0;
    for (int c = 0; c < F; c++) max_row = s->tables[c].row_bytes > max_row ? s->tables[c].row_bytes : max_row;
    Scratch *sc = thread_scratch((size_t)B, (size_t)F, 1, (size_t)max_row);
    if (sc == NULL) return -2;
    add_stat(&s->stats.calls, 1);
    const size_t cap = slots_for((size_t)B);
    int64_t n_missed = 0;
    /* per table: its unique keys; what RAM holds is decoded at the key's first position at once */
    for (int c = 0; c < F; c++) {
        Table *t = &s->tables[c];
        memset(sc->slots, 0, cap * sizeof *sc->slots);
        int32_t unique = 0;
        for (int64_t r = 0; r < B; r++) {
            const int64_t id = ids[r * F + c];
            size_t at = (size_t)(mix64((uint64_t)id) & (cap - 1));
            while (sc->slots[at] && sc->keys[sc->slots[at] - 1] != id) at = (at + 1) & (cap - 1);
            if (!sc->slots[at]) {
                sc->keys[unique] = id;
                sc->first[unique] = r * F + c;
                sc->slots[at] = ++unique;
            }
        }
        add_stat(&t->stats.lookups, (uint64_t)B);
        add_stat(&t->stats.unique, (uint64_t)unique);
        uint64_t hits = 0;
        for (int32_t u = 0; u < unique; u++) {
            const int64_t id = sc->keys[u];
            float *dst = out + (size_t)sc->first[u] * (size_t)dim;
            const int64_t d = t->n_delta ? delta_find(t, id) : -1;
            if (d >= 0) { /* a row this release changed (of a small table or a large one): in RAM */
                decode_row(t->format, dim, t->delta_rows + (size_t)d * (size_t)t->row_bytes, dst);
                hits++;
                continue;
            }
            if (t->memory && !t->mapped) { /* a small table, in RAM */
                const uint64_t b = (uint64_t)id / (uint64_t)t->per_block, k = (uint64_t)id % (uint64_t)t->per_block;
                decode_row(t->format, dim, t->memory + b * BLOCK + k * (uint64_t)t->row_bytes, dst);
                hits++;
                continue;
            }
            if (s->cache && cache_get(s->cache, cache_key(c, id), sc->row)) {
                decode_row(t->format, dim, sc->row, dst);
                hits++;
                continue;
            }
            sc->miss_table[n_missed] = c;
            sc->miss_id[n_missed] = id;
            sc->miss_dest[n_missed] = sc->first[u];
            sc->miss_block[n_missed] = id / t->per_block;
            sc->order[n_missed] = (int32_t)n_missed;
            n_missed++;
        }
        add_stat(&t->stats.hits, hits);
    }
    if (n_missed > 0) {
        /* the blocks to read: missed keys sorted by (table, block), each block read once */
        int32_t *order = sc->order;
        for (int64_t i = 1; i < n_missed; i++) { /* insertion sort: a call misses a few hundred keys */
            const int32_t v = order[i];
            int64_t j = i - 1;
            while (j >= 0 && (sc->miss_table[order[j]] > sc->miss_table[v] ||
                              (sc->miss_table[order[j]] == sc->miss_table[v] && sc->miss_block[order[j]] > sc->miss_block[v]))) {
                order[j + 1] = order[j];
                j--;
            }
            order[j + 1] = v;
        }
        int32_t n_blocks = 0;
        for (int64_t i = 0; i < n_missed; i++) {
            const int32_t k = order[i];
            if (n_blocks == 0 || sc->read_table[n_blocks - 1] != sc->miss_table[k] ||
                sc->read_block[n_blocks - 1] != sc->miss_block[k]) {
                sc->read_table[n_blocks] = sc->miss_table[k];
                sc->read_block[n_blocks] = sc->miss_block[k];
                n_blocks++;
            }
            sc->miss_buffer[k] = n_blocks - 1;
        }
        if ((size_t)n_blocks > sc->n_io && thread_scratch((size_t)B, (size_t)F, (size_t)n_blocks, (size_t)max_row) == NULL)
            return -2;
        const double start = now_s();
        reading_begins();
        const int read = read_blocks(s, sc, sc->read_table, sc->read_block, n_blocks, deadline);
        reading_ends();
        if (read < 0) return -4;
        record_latency(s, now_s() - start);
        for (int32_t b = 0; b < n_blocks; b++) {
            Table *t = &s->tables[sc->read_table[b]];
            add_stat(&t->stats.cold_blocks, 1);
            add_stat(&t->stats.cold_bytes, BLOCK);
            if (block_crc((uint64_t)sc->read_block[b], sc->io + (size_t)b * BLOCK) != stored_crc(sc->io + (size_t)b * BLOCK)) {
                add_stat(&t->stats.checksum_errors, 1);
                snprintf(failure_text, sizeof failure_text,
                         "table %s: block %lld of %s fails its checksum: its rows are not scored", t->name,
                         (long long)sc->read_block[b], t->path);
                return -4;
            }
        }
        for (int64_t k = 0; k < n_missed; k++) {
            const int c = sc->miss_table[k];
            Table *t = &s->tables[c];
            const unsigned char *row = sc->io + (size_t)sc->miss_buffer[k] * BLOCK +
                                       (size_t)(sc->miss_id[k] % t->per_block) * (size_t)t->row_bytes;
            decode_row(t->format, dim, row, out + (size_t)sc->miss_dest[k] * (size_t)dim);
            add_stat(&t->stats.cold_rows, 1);
            const uint64_t key = cache_key(c, sc->miss_id[k]);
            if (s->cache && s->admission != ADMIT_NONE && (s->admission == ADMIT_ALWAYS || door_admits(s->cache, key))) {
                const int evicted = cache_put(s->cache, key, row, 1);
                if (evicted != -2) add_stat(&t->stats.cached, 1);
                if (evicted >= 0) atomic_fetch_sub_explicit(&s->tables[evicted].stats.cached, 1, memory_order_relaxed);
            }
        }
    }
    /* every other position of a key takes its first position's row */
    for (int c = 0; c < F; c++) {
        memset(sc->slots, 0, cap * sizeof *sc->slots);
        for (int64_t r = 0; r < B; r++) {
            const int64_t id = ids[r * F + c];
            size_t at = (size_t)(mix64((uint64_t)id) & (cap - 1));
            while (sc->slots[at] && ids[(int64_t)(sc->slots[at] - 1) * F + c] != id) at = (at + 1) & (cap - 1);
            if (!sc->slots[at]) {
                sc->slots[at] = (int32_t)r + 1;
                continue;
            }
            memcpy(out + (size_t)(r * F + c) * (size_t)dim, out + (size_t)((sc->slots[at] - 1) * F + c) * (size_t)dim,
                   sizeof(float) * (size_t)dim);
        }
    }
    return -1;
}

/* Store.gather(ids: int64 [B x F], out: float32 [B x F x dim], deadline: float = 0) */
static PyObject *store_gather_py(PyObject *obj, PyObject *args) {
    Store *s = (Store *)obj;
    PyObject *ids, *out;
    double deadline = 0.0;
    if (!PyArg_ParseTuple(args, "OO|d", &ids, &out, &deadline)) return NULL;
    Buffer b[2] = {0};
    if (take(ids, &b[0], "ids", 8, 0) < 0 || take(out, &b[1], "out", 4, 1) < 0) {
        give_back(b, 2);
        return NULL;
    }
    const Py_ssize_t B = b[0].view.len / 8 / s->n_tables;
    if (b[0].view.len != B * s->n_tables * 8 || b[1].view.len != B * s->n_tables * s->dim * 4) {
        give_back(b, 2);
        PyErr_Format(PyExc_ValueError, "ids must be [rows x %d] int64 and out [rows x %d x %d] float32", s->n_tables,
                     s->n_tables, s->dim);
        return NULL;
    }
    int64_t result;
    const int64_t *id = b[0].view.buf;
    Py_BEGIN_ALLOW_THREADS
    result = store_gather(s, id, B, b[1].view.buf, deadline);
    Py_END_ALLOW_THREADS
    PyObject *ret = NULL;
    if (result == -1)
        ret = Py_NewRef(Py_None);
    else if (result == -2)
        PyErr_NoMemory();
    else if (result == -4)
        PyErr_SetString(TableError, failure_text);
    else
        PyErr_Format(PyExc_ValueError, "row %lld, table %s: id %lld is outside its %llu rows", (long long)(result / s->n_tables),
                     s->tables[result % s->n_tables].name, (long long)id[result],
                     (unsigned long long)s->tables[result % s->n_tables].rows);
    give_back(b, 2);
    return ret;
}

/* Store.warm(path, keys: int64 [n], max_rows=-1) -> rows put in the hot tier: a warm file (a table file of the
 * rows keys name, table << 40 | id, in that order) read sequentially, each block checked, until the tier is
 * full or the file ends; a row no table of this store owns, or that a delta replaces, is skipped. */
static PyObject *store_warm(PyObject *obj, PyObject *args) {
    Store *s = (Store *)obj;
    const char *path;
    PyObject *keys;
    long long max_rows = -1;
    if (!PyArg_ParseTuple(args, "sO|L", &path, &keys, &max_rows)) return NULL;
    if (s->cache == NULL) return PyLong_FromLong(0);
    Buffer b = {0};
    if (take(keys, &b, "keys", 8, 0) < 0) {
        give_back(&b, 1);
        return NULL;
    }
    const int64_t *key = b.view.buf;
    const int64_t n_keys = b.view.len / 8;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        give_back(&b, 1);
        return PyErr_Format(TableError, "the warm file %s: %s", path, strerror(errno));
    }
    unsigned char head[BLOCK];
    Header h;
    const ssize_t got = pread(fd, head, BLOCK, 0);
    memcpy(&h, head, sizeof h);
    if (got != BLOCK || memcmp(h.magic, MAGIC, 8) != 0 || block_crc(UINT64_MAX, head) != stored_crc(head) ||
        (int64_t)h.rows != n_keys || (int)h.row_bytes != s->cache->slot_bytes) {
        close(fd);
        give_back(&b, 1);
        return PyErr_Format(TableError, "the warm file %s does not match its keys or this store's format", path);
    }
    const size_t chunk_blocks = 256; /* 1 MiB a read */
    unsigned char *chunk = malloc(chunk_blocks * BLOCK);
    if (chunk == NULL) {
        close(fd);
        give_back(&b, 1);
        return PyErr_NoMemory();
    }
    const double start = now_s();
    int64_t put = 0, row = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t b0 = 0; b0 < h.blocks && !bad; b0 += chunk_blocks) {
        const size_t want = (size_t)(h.blocks - b0 < chunk_blocks ? h.blocks - b0 : chunk_blocks);
        if (pread(fd, chunk, want * BLOCK, (off_t)(b0 + 1) * BLOCK) != (ssize_t)(want * BLOCK)) {
            bad = 1;
            break;
        }
        for (size_t k = 0; k < want && !bad; k++) {
            const unsigned char *block = chunk + k * BLOCK;
            if (block_crc(b0 + k, block) != stored_crc(block)) {
                bad = 2;
                break;
            }
            for (uint32_t i = 0; i < h.per_block && row < n_keys; i++, row++) {
                const int table = (int)(key[row] >> 40);
                const int64_t id = key[row] & ((1LL << 40) - 1);
                if (table < 0 || table >= s->n_tables || s->tables[table].fd < 0 || (uint64_t)id >= s->tables[table].rows ||
                    (s->tables[table].n_delta && delta_find(&s->tables[table], id) >= 0))
                    continue;
                const int r = cache_put(s->cache, cache_key(table, id), block + (size_t)i * h.row_bytes, 0);
                if (r == -1) {
                    put++;
                    add_stat(&s->tables[table].stats.cached, 1);
                }
            }
            if ((max_rows >= 0 && put >= max_rows) ||
                atomic_load_explicit(&s->cache->filled, memory_order_relaxed) >= s->cache->slots)
                b0 = h.blocks; /* the tier is full */
        }
    }
    Py_END_ALLOW_THREADS
    free(chunk);
    close(fd);
    give_back(&b, 1);
    if (bad)
        return PyErr_Format(TableError, "the warm file %s: %s at row %lld", path, bad == 1 ? "a short read" : "a block fails its checksum",
                            (long long)row);
    add_stat(&s->stats.warmed_rows, (uint64_t)put);
    s->warm_seconds += now_s() - start;
    return PyLong_FromLongLong(put);
}

static int set_item(PyObject *dict, const char *key, PyObject *value) {
    if (value == NULL) return -1;
    const int rc = PyDict_SetItemString(dict, key, value);
    Py_DECREF(value);
    return rc;
}

#define LOAD(x) PyLong_FromUnsignedLongLong((unsigned long long)atomic_load_explicit(&(x), memory_order_relaxed))

/* Store.stats() -> {"tables": {name: counters}, the hot tier's and the cold reads' figures} */
static PyObject *store_stats(PyObject *obj, PyObject *unused) {
    Store *s = (Store *)obj;
    PyObject *result = PyDict_New(), *tables = PyDict_New();
    if (result == NULL || tables == NULL) goto fail;
    for (int i = 0; i < s->n_tables; i++) {
        Table *t = &s->tables[i];
        PyObject *d = PyDict_New();
        if (d == NULL || PyDict_SetItemString(tables, t->name, d) < 0) {
            Py_XDECREF(d);
            goto fail;
        }
        Py_DECREF(d);
        const char *where = t->fd >= 0 ? "disk" : t->mapped ? "mmap" : "memory";
        if (set_item(d, "rows", PyLong_FromUnsignedLongLong(t->rows)) || set_item(d, "format", PyUnicode_FromString(FORMAT_NAMES[t->format])) ||
            set_item(d, "where", PyUnicode_FromString(where)) || set_item(d, "delta_rows", PyLong_FromUnsignedLongLong(t->n_delta)) ||
            set_item(d, "lookups", LOAD(t->stats.lookups)) || set_item(d, "unique", LOAD(t->stats.unique)) ||
            set_item(d, "hits", LOAD(t->stats.hits)) || set_item(d, "cold_rows", LOAD(t->stats.cold_rows)) ||
            set_item(d, "cold_blocks", LOAD(t->stats.cold_blocks)) || set_item(d, "cold_bytes", LOAD(t->stats.cold_bytes)) ||
            set_item(d, "read_errors", LOAD(t->stats.read_errors)) ||
            set_item(d, "checksum_errors", LOAD(t->stats.checksum_errors)) || set_item(d, "late", LOAD(t->stats.late)) ||
            set_item(d, "hot_rows", LOAD(t->stats.cached)))
            goto fail;
    }
    if (PyDict_SetItemString(result, "tables", tables) < 0) goto fail;
    PyObject *buckets = PyList_New(LATENCY_BUCKETS);
    if (buckets == NULL) goto fail;
    for (int b = 0; b < LATENCY_BUCKETS; b++)
        PyList_SET_ITEM(buckets, b, Py_BuildValue("(dK)", b < LATENCY_BUCKETS - 1 ? LATENCY_BOUNDS_MS[b] : INFINITY,
                                                  (unsigned long long)atomic_load(&s->stats.buckets[b])));
    const Cache *c = s->cache;
    if (set_item(result, "read_latency_ms", buckets) || set_item(result, "calls", LOAD(s->stats.calls)) ||
        set_item(result, "cold_calls", LOAD(s->stats.cold_calls)) ||
        set_item(result, "read_seconds", PyFloat_FromDouble((double)atomic_load(&s->stats.latency_ns) * 1e-9)) ||
        set_item(result, "reading_seconds", PyFloat_FromDouble((double)atomic_load(&reading_ns) * 1e-9)) ||
        set_item(result, "budget_bytes", PyLong_FromUnsignedLongLong(s->budget)) ||
        set_item(result, "hot_capacity_rows", PyLong_FromUnsignedLongLong(c ? c->slots : 0)) ||
        set_item(result, "hot_rows", PyLong_FromUnsignedLongLong(c ? (unsigned long long)atomic_load(&((Cache *)c)->filled) : 0)) ||
        set_item(result, "hot_bytes", PyLong_FromUnsignedLongLong(c ? (unsigned long long)atomic_load(&((Cache *)c)->filled) * (unsigned long long)c->slot_bytes : 0)) ||
        set_item(result, "hot_tier_bytes", PyLong_FromUnsignedLongLong(c ? (unsigned long long)(c->data_bytes + c->slots * 9 + (c->doorkeeper ? c->door_bits / 8 : 0)) : 0)) ||
        set_item(result, "evictions", c ? LOAD(((Cache *)c)->evictions) : PyLong_FromLong(0)) ||
        set_item(result, "admitted", c ? LOAD(((Cache *)c)->admitted) : PyLong_FromLong(0)) ||
        set_item(result, "warmed_rows", LOAD(s->stats.warmed_rows)) ||
        set_item(result, "warm_seconds", PyFloat_FromDouble(s->warm_seconds)) ||
        set_item(result, "admission", PyUnicode_FromString(ADMISSION_NAMES[s->admission])) ||
        set_item(result, "io", PyUnicode_FromString(IO_NAMES[s->io])) || set_item(result, "depth", PyLong_FromLong(s->depth)))
        goto fail;
    Py_DECREF(tables);
    return result;
fail:
    Py_XDECREF(tables);
    Py_XDECREF(result);
    return NULL;
}

static PyObject *store_get_dim(PyObject *obj, void *closure) { return PyLong_FromLong(((Store *)obj)->dim); }
static PyObject *store_get_tables(PyObject *obj, void *closure) { return PyLong_FromLong(((Store *)obj)->n_tables); }

static PyMethodDef store_methods[] = {
    {"gather", store_gather_py, METH_VARARGS,
     "gather(ids int64 [B x F], out float32 [B x F x dim], deadline=0.0): every row, from RAM or disk; TableError when "
     "a table cannot be read by the deadline (time.monotonic seconds; 0: none)"},
    {"warm", store_warm, METH_VARARGS, "warm(path, keys int64 [n], max_rows=-1) -> rows put in the hot tier from a warm file"},
    {"stats", store_stats, METH_NOARGS, "stats() -> the tables' and the hot tier's counters"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef store_getset[] = {{"dim", store_get_dim, NULL, "the rows' width", NULL},
                                     {"columns", store_get_tables, NULL, "the tables (id columns)", NULL},
                                     {NULL}};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._tables.Store",
    .tp_basicsize = sizeof(Store),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Store(tables, budget_bytes, admission='always', io='uring', depth=32): one DLRM's tables, small ones in "
              "RAM, large ones through the hot tier and cold reads",
    .tp_new = store_new,
    .tp_dealloc = store_dealloc,
    .tp_methods = store_methods,
    .tp_getset = store_getset,
};

/* ----- a DLRM over a store: its rows gathered, then its engine's MLPs ----- */

#define POOL_ROWS 256 /* rows gathered and scored at a time: their rows stay in the core's caches */

typedef struct {
    PyObject_HEAD
    PyObject *store, *engine;
    const EnsembleDlrmApi *mlp;
    double read_timeout; /* seconds a call's cold reads may take when the caller names no deadline (0: none) */
} Dlrm;

static __thread double thread_deadline; /* the deadline of this thread's call (0: none), set by the caller */

static const EnsembleDlrmApi *engine_api(PyObject *engine) {
    const char *name = Py_TYPE(engine)->tp_name;
    const char *capsule = strcmp(name, "ensemble.native._dlrm.Weights") == 0      ? ENSEMBLE_DLRM_CAPSULE
                          : strcmp(name, "ensemble.native._openvino.Engine") == 0 ? ENSEMBLE_OPENVINO_CAPSULE
                                                                                  : NULL;
    if (capsule == NULL) {
        PyErr_Format(PyExc_TypeError, "Dlrm: the engine must be a _dlrm.Weights or an _openvino.Engine, not %s", name);
        return NULL;
    }
    const EnsembleDlrmApi *api = PyCapsule_Import(capsule, 0);
    if (api != NULL && api->forward_pooled == NULL) {
        PyErr_Format(PyExc_TypeError, "Dlrm: %s has no pass over gathered rows", name);
        return NULL;
    }
    return api;
}

static int64_t dlrm_forward(PyObject *obj, const float *dense, const int64_t *ids, int64_t rows, float *out) {
    Dlrm *d = (Dlrm *)obj;
    Store *s = (Store *)d->store;
    const int64_t F = s->n_tables, dim = s->dim, n_dense = d->mlp->n_dense(d->engine);
    const int64_t block = rows < POOL_ROWS ? rows : POOL_ROWS;
    float *pooled = malloc((size_t)(block ? block : 1) * (size_t)(F * dim) * sizeof(float));
    if (pooled == NULL) return -2;
    /* the sooner of the caller's deadline and the server's cap on a call's cold reads (0: neither) */
    const double cap = d->read_timeout > 0 ? now_s() + d->read_timeout : 0;
    const double deadline = thread_deadline > 0 && (cap == 0 || thread_deadline < cap) ? thread_deadline : cap;
    int64_t result = -1;
    for (int64_t r0 = 0; r0 < rows && result == -1; r0 += block) {
        const int64_t nb = rows - r0 < block ? rows - r0 : block;
        result = store_gather(s, ids + r0 * F, nb, pooled, deadline);
        if (result >= 0) result += r0 * F;
        if (result == -1) result = d->mlp->forward_pooled(d->engine, dense + r0 * n_dense, pooled, nb, out + r0);
    }
    free(pooled);
    return result;
}

static int64_t dlrm_n_dense(PyObject *obj) { return ((Dlrm *)obj)->mlp->n_dense(((Dlrm *)obj)->engine); }
static int64_t dlrm_n_ids(PyObject *obj) { return ((Store *)((Dlrm *)obj)->store)->n_tables; }
static const char *dlrm_failure(PyObject *obj) { return failure_text; }
static void dlrm_deadline(double deadline) { thread_deadline = deadline; }

static const EnsembleDlrmApi DLRM_API = {dlrm_n_dense, dlrm_n_ids, dlrm_forward, NULL, dlrm_failure, dlrm_deadline};

static void dlrm_dealloc(PyObject *obj) {
    Dlrm *d = (Dlrm *)obj;
    Py_XDECREF(d->store);
    Py_XDECREF(d->engine);
    Py_TYPE(obj)->tp_free(obj);
}

/* Dlrm(store, engine, read_timeout=0.0) */
static PyObject *dlrm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"store", "engine", "read_timeout", NULL};
    PyObject *store, *engine;
    double timeout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|d:Dlrm", names, &StoreType, &store, &engine, &timeout)) return NULL;
    const EnsembleDlrmApi *api = engine_api(engine);
    if (api == NULL) return NULL;
    if (api->n_ids(engine) != ((Store *)store)->n_tables) {
        PyErr_Format(PyExc_ValueError, "Dlrm: the engine takes %lld id columns, the store has %d tables",
                     (long long)api->n_ids(engine), ((Store *)store)->n_tables);
        return NULL;
    }
    Dlrm *d = (Dlrm *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    d->store = Py_NewRef(store);
    d->engine = Py_NewRef(engine);
    d->mlp = api;
    d->read_timeout = timeout;
    return (PyObject *)d;
}

/* Dlrm(dense float32 [B x n_dense], ids int64 [B x F], out float32 [B], deadline=0.0) */
static PyObject *dlrm_call(PyObject *obj, PyObject *args, PyObject *kwargs) {
    PyObject *dense, *ids, *out;
    double deadline = 0.0;
    if ((kwargs && PyDict_GET_SIZE(kwargs)) || !PyArg_ParseTuple(args, "OOO|d", &dense, &ids, &out, &deadline)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "call with (dense, ids, out[, deadline])");
        return NULL;
    }
    Dlrm *d = (Dlrm *)obj;
    const int64_t F = dlrm_n_ids(obj), n_dense = dlrm_n_dense(obj);
    Buffer b[3] = {0};
    if (take(dense, &b[0], "dense", 4, 0) < 0 || take(ids, &b[1], "ids", 8, 0) < 0 || take(out, &b[2], "out", 4, 1) < 0) {
        give_back(b, 3);
        return NULL;
    }
    const Py_ssize_t B = b[2].view.len / 4;
    if (b[1].view.len != B * F * 8 || b[0].view.len != B * n_dense * 4) {
        give_back(b, 3);
        PyErr_Format(PyExc_ValueError, "dense must be [rows x %lld], ids [rows x %lld], out [rows]", (long long)n_dense,
                     (long long)F);
        return NULL;
    }
    int64_t result;
    const int64_t *id = b[1].view.buf;
    Py_BEGIN_ALLOW_THREADS
    thread_deadline = deadline;
    result = dlrm_forward(obj, b[0].view.buf, id, B, b[2].view.buf);
    thread_deadline = 0;
    Py_END_ALLOW_THREADS
    PyObject *ret = NULL;
    if (result == -1)
        ret = Py_NewRef(Py_None);
    else if (result == -2)
        PyErr_NoMemory();
    else if (result == -3)
        PyErr_SetString(PyExc_RuntimeError, "the DLRM's inference engine failed");
    else if (result == -4)
        PyErr_SetString(TableError, failure_text);
    else
        PyErr_Format(PyExc_ValueError, "row %lld, table %s: id %lld is outside its table", (long long)(result / F),
                     ((Store *)d->store)->tables[result % F].name, (long long)id[result]);
    give_back(b, 3);
    return ret;
}

static PyObject *dlrm_get_store(PyObject *obj, void *closure) { return Py_NewRef(((Dlrm *)obj)->store); }
static PyObject *dlrm_get_engine(PyObject *obj, void *closure) { return Py_NewRef(((Dlrm *)obj)->engine); }
static PyGetSetDef dlrm_getset[] = {{"store", dlrm_get_store, NULL, "the tables", NULL},
                                    {"engine", dlrm_get_engine, NULL, "the MLPs' engine", NULL},
                                    {NULL}};

static PyTypeObject DlrmType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._tables.Dlrm",
    .tp_basicsize = sizeof(Dlrm),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Dlrm(store, engine, read_timeout=0.0): a DLRM whose rows come from a Store and whose MLPs the engine "
              "runs; call with (dense, ids, out[, deadline])",
    .tp_new = dlrm_new,
    .tp_dealloc = dlrm_dealloc,
    .tp_call = dlrm_call,
    .tp_getset = dlrm_getset,
};

/* ----- the counters, read from C (api.h's EnsembleTablesStatsApi) ----- */

_Static_assert(LATENCY_BUCKETS == ENSEMBLE_READ_BUCKETS, "api.h's ENSEMBLE_READ_BUCKETS counts the buckets");

static int stats_tables(PyObject *obj) { return ((Store *)obj)->n_tables; }
static const char *stats_name(PyObject *obj, int table) { return ((Store *)obj)->tables[table].name; }
static void stats_counters(PyObject *obj, int table, uint64_t *out) {
    TableStats *t = &((Store *)obj)->tables[table].stats;
    atomic_uint_fast64_t *fields[ENSEMBLE_TABLE_COUNTERS] = {&t->lookups, &t->unique, &t->hits, &t->cold_rows,
                                                             &t->cold_blocks, &t->cold_bytes, &t->read_errors,
                                                             &t->checksum_errors, &t->late, &t->cached};
    for (int k = 0; k < ENSEMBLE_TABLE_COUNTERS; k++) out[k] = atomic_load_explicit(fields[k], memory_order_relaxed);
}
static uint64_t stats_hot_bytes(PyObject *obj) {
    const Cache *c = ((Store *)obj)->cache;
    return c ? (uint64_t)atomic_load_explicit(&((Cache *)c)->filled, memory_order_relaxed) * (uint64_t)c->slot_bytes : 0;
}
static void stats_reads(PyObject *obj, uint64_t *buckets, double *seconds) {
    StoreStats *s = &((Store *)obj)->stats;
    for (int b = 0; b < LATENCY_BUCKETS; b++) buckets[b] = atomic_load_explicit(&s->buckets[b], memory_order_relaxed);
    *seconds = (double)atomic_load_explicit(&s->latency_ns, memory_order_relaxed) * 1e-9;
}

static double stats_reading_seconds(void) {
    return (double)atomic_load_explicit(&reading_ns, memory_order_relaxed) * 1e-9;
}

static const EnsembleTablesStatsApi STATS_API = {stats_tables, stats_name, stats_counters, stats_hot_bytes, stats_reads,
                                                 LATENCY_BOUNDS_MS, stats_reading_seconds};

/* ----- the module ----- */

static PyObject *py_has_uring(PyObject *self, PyObject *unused) {
#ifdef ENSEMBLE_URING
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_has_redis(PyObject *self, PyObject *unused) {
#ifdef ENSEMBLE_HIREDIS
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"has_redis", py_has_redis, METH_NOARGS, "whether this build reads a cold tier in Redis (hiredis)"},
    {"init_rows", py_init_rows, METH_VARARGS, "init_rows(seed, first_row, dim, out float32 [n x dim]): rows nobody trained"},
    {"init_ids", py_init_ids, METH_VARARGS, "init_ids(seed, ids int64 [n], dim, out float32 [n x dim]): those rows of ids"},
    {"encode", py_encode, METH_VARARGS, "encode(rows float32 [n x dim], dim, format, out uint8 [n x row_bytes])"},
    {"decode", py_decode, METH_VARARGS, "decode(data uint8 [n x row_bytes], dim, format, out float32 [n x dim])"},
    {"pack", py_pack, METH_VARARGS, "pack(rows uint8 [n x row_bytes], row_bytes, first_block, out uint8 [blocks x 4096])"},
    {"check_blocks", py_check_blocks, METH_VARARGS, "check_blocks(data, first_block) -> the first block failing its CRC, or -1"},
    {"header", py_header, METH_VARARGS, "header(format, dim, rows, seed) -> a table file's header block"},
    {"row_bytes", py_row_bytes, METH_VARARGS, "row_bytes(format, dim) -> bytes a row takes"},
    {"has_uring", py_has_uring, METH_NOARGS, "whether this build reads with io_uring"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_tables",
                                    .m_doc = "Embedding tables larger than memory: the row store, the hot tier, cold reads.",
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__tables(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    has_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    if (PyType_Ready(&MapType) < 0 || PyType_Ready(&StoreType) < 0 || PyType_Ready(&DlrmType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    TableError = PyErr_NewException("ensemble.native._tables.TableError", PyExc_RuntimeError, NULL);
    PyObject *capsule = PyCapsule_New((void *)&DLRM_API, ENSEMBLE_TABLES_CAPSULE, NULL);
    PyObject *stats = PyCapsule_New((void *)&STATS_API, ENSEMBLE_TABLES_STATS_CAPSULE, NULL);
    PyObject *stats_3 = PyCapsule_New((void *)&STATS_API, ENSEMBLE_TABLES_STATS_CAPSULE_3, NULL);
    const int added = stats != NULL && stats_3 != NULL &&
                      PyModule_AddObjectRef(m, "_C_STATS_" ENSEMBLE_TABLES_STATS_VERSION, stats) == 0 &&
                      PyModule_AddObjectRef(m, "_C_STATS_3", stats_3) == 0;
    Py_XDECREF(stats);
    Py_XDECREF(stats_3);
    if (!added) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    if (TableError == NULL || capsule == NULL || PyModule_AddObjectRef(m, "TableError", TableError) < 0 ||
        PyModule_AddObjectRef(m, "Map", (PyObject *)&MapType) < 0 || PyModule_AddObjectRef(m, "Store", (PyObject *)&StoreType) < 0 ||
        PyModule_AddObjectRef(m, "Dlrm", (PyObject *)&DlrmType) < 0 || PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0 ||
        PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
