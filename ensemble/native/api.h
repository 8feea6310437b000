/* The C entry points the project's extension modules hand each other, so that a served call can run
 * from Triton's buffers to the answers with no Python call in between (ensemble/native/backend.c).
 *
 * Each module that offers some publishes one table of function pointers as a capsule named
 * "<module>._C_API_<version>" (PyCapsule_Import finds it). The version changes with any table's
 * shape, so a caller built against another one (a release folder's backend, copied there by an
 * earlier install) finds no table and keeps its Python path instead of calling through a table of
 * another shape. A function that takes a PyObject * reads only the
 * C fields of that object (of the type the comment names): it may be called without the interpreter's
 * lock as long as the caller keeps a reference to the object. None of them calls into Python.
 */
#ifndef ENSEMBLE_KERNEL_API_H
#define ENSEMBLE_KERNEL_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ENSEMBLE_ERROR_SIZE 512

/* A 4-byte little-endian length in a Triton BYTES wire buffer (any alignment): one load on a
 * little-endian CPU, where GCC did not merge the four byte loads of the portable form. */
static inline uint32_t ensemble_u32le(const unsigned char *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
#endif
}

/* The byte offset in a Triton BYTES wire buffer (per value a 4-byte little-endian length, then its
 * bytes) just after its first count values, or UINT64_MAX when the size bytes do not hold them. */
static inline uint64_t ensemble_wire_offset(const unsigned char *wire, uint64_t size, int64_t count) {
    uint64_t at = 0;
    for (int64_t i = 0; i < count; i++) {
        if (size - at < 4) return UINT64_MAX;
        const uint32_t length = ensemble_u32le(wire + at);
        at += 4;
        if (size - at < length) return UINT64_MAX;
        at += length;
    }
    return at;
}
#define ENSEMBLE_API_VERSION "3"
#define ENSEMBLE_API_ATTRIBUTE "_C_API_" ENSEMBLE_API_VERSION

/* ensemble.native._trees: the trees as arrays (ensemble.models.xgb.TreeArrays). */
#define ENSEMBLE_TREES_CAPSULE "ensemble.native._trees." ENSEMBLE_API_ATTRIBUTE
typedef struct {
    /* The floats of scratch that predict needs for rows of n_features features. */
    size_t (*scratch_floats)(int64_t n_features);
    /* P(click) of each row of x [rows x n_features] into out [rows]. */
    void (*predict)(const float *x, int64_t rows, int64_t n_features, int64_t n_trees, int depth,
                    const uint32_t *node_column, const float *node_threshold, const float *leaves,
                    float base_margin, float *scratch, float *out);
} EnsembleTreesApi;

/* ensemble.native._dlrm: a DLRM's forward pass over a _dlrm.Weights object. */
#define ENSEMBLE_DLRM_CAPSULE "ensemble.native._dlrm." ENSEMBLE_API_ATTRIBUTE
typedef struct {
    /* The dense inputs and the id columns a row has for this net. */
    int64_t (*n_dense)(PyObject *weights);
    int64_t (*n_ids)(PyObject *weights);
    /* P(click) of rows of dense [rows x n_dense] float32 and ids [rows x n_ids] int64 into out [rows]:
     * -1 when done; -2 out of memory; else the flat index into ids of an id outside its table (the
     * rows from its block on are not scored). */
    int64_t (*forward)(PyObject *weights, const float *dense, const int64_t *ids, int64_t rows, float *out);
    /* The MLPs alone, over rows already gathered: pooled [rows x n_ids x dim] float32 (row-major), dense as
     * forward's; -1 done, -2 out of memory, -3 the engine failed. NULL: the engine has no such pass. */
    int64_t (*forward_pooled)(PyObject *weights, const float *dense, const float *pooled, int64_t rows, float *out);
    /* Why this thread's last forward returned -4 (a table could not be read by the call's deadline; the request
     * is answered UNAVAILABLE). NULL: forward never returns -4. */
    const char *(*failure)(PyObject *weights);
    /* The deadline of this thread's next forward calls (CLOCK_MONOTONIC seconds; 0: none). NULL: none applies. */
    void (*deadline)(double deadline);
} EnsembleDlrmApi;

/* ensemble.native._tables: a DLRM whose embedding rows come from a row store (a _tables.Dlrm object: its
 * tables in RAM and on disk, its MLPs through a _dlrm.Weights or an _openvino.Engine's forward_pooled),
 * the same entry points; its forward also returns -4 when a table cannot be read in time. */
#define ENSEMBLE_TABLES_CAPSULE "ensemble.native._tables." ENSEMBLE_API_ATTRIBUTE

/* ensemble.native._tables: a Store's counters (a _tables.Store object), read without the interpreter's lock
 * (the native backend's ensemble_table_* metrics). */
/* The stats entry points have a version of their own: reading_seconds was added at the end in version 4, and
 * the module also offers the same struct under version 3's name, so a release's backend built before it
 * (which reads only the fields before) keeps its row store metrics without a new export. */
#define ENSEMBLE_TABLES_STATS_VERSION "4"
#define ENSEMBLE_TABLES_STATS_CAPSULE "ensemble.native._tables._C_STATS_" ENSEMBLE_TABLES_STATS_VERSION
#define ENSEMBLE_TABLES_STATS_CAPSULE_3 "ensemble.native._tables._C_STATS_3"
enum { /* a table's counters, in the order counters() writes them */
    ENSEMBLE_TABLE_LOOKUPS, ENSEMBLE_TABLE_UNIQUE, ENSEMBLE_TABLE_HITS, ENSEMBLE_TABLE_COLD_ROWS,
    ENSEMBLE_TABLE_COLD_BLOCKS, ENSEMBLE_TABLE_COLD_BYTES, ENSEMBLE_TABLE_READ_ERRORS,
    ENSEMBLE_TABLE_CHECKSUM_ERRORS, ENSEMBLE_TABLE_LATE, ENSEMBLE_TABLE_HOT_ROWS, ENSEMBLE_TABLE_COUNTERS
};
#define ENSEMBLE_READ_BUCKETS 13 /* the cold reads' latency: 12 bounds, then +Inf */
typedef struct {
    int (*tables)(PyObject *store);
    const char *(*name)(PyObject *store, int table);
    void (*counters)(PyObject *store, int table, uint64_t *out); /* ENSEMBLE_TABLE_COUNTERS values */
    uint64_t (*hot_bytes)(PyObject *store);
    /* the calls with cold reads per latency bucket (not cumulative), and the seconds they read */
    void (*reads)(PyObject *store, uint64_t *buckets, double *seconds);
    const double *bounds_ms; /* ENSEMBLE_READ_BUCKETS - 1 upper bounds */
    /* the process's seconds with at least one call reading cold rows (overlapping calls counted once) */
    double (*reading_seconds)(void);
} EnsembleTablesStatsApi;

/* ensemble.native._openvino: a DLRM compiled by OpenVINO (an _openvino.Engine object), the same entry points
 * as _dlrm's; its forward also returns -3 when the runtime fails. */
#define ENSEMBLE_OPENVINO_CAPSULE "ensemble.native._openvino." ENSEMBLE_API_ATTRIBUTE

/* ensemble.native._request: the categorical lookup and the elementwise steps. */
#define ENSEMBLE_REQUEST_CAPSULE "ensemble.native._request." ENSEMBLE_API_ATTRIBUTE
typedef struct {
    /* The id columns of a _request.Vocabulary. */
    int64_t (*columns)(PyObject *vocabulary);
    /* out[i] = the id of value i of a BYTES wire buffer in column i % columns (fallback when absent);
     * the buffer must hold exactly count values. 0, or -1 with the reason in error. */
    int (*lookup_wire)(PyObject *vocabulary, const unsigned char *data, size_t size, int64_t fallback, int64_t *out,
                       size_t count, char *error, size_t error_size);
    /* out[i] = max(x[i] if finite else fill, clip_min) + 1, in float32; x at any address (4-byte aligned or not). */
    void (*dense_prepare)(const void *x, float *out, size_t n, float fill, float clip_min);
    /* out[b] = sigmoid(bias + sum_m weights[m] * logit(clip(scores[m][b], eps, 1 - eps))), in float64. */
    void (*blend)(const float *const *scores, int models, const double *weights, double bias, double eps, float *out,
                  size_t rows);
} EnsembleNativeApi;

/* ensemble.native._admission: the ranker's admission (ensemble.serving.admission). */
#define ENSEMBLE_ADMISSION_CAPSULE "ensemble.native._admission." ENSEMBLE_API_ATTRIBUTE
#define ENSEMBLE_MESSAGE_SIZE 256
typedef struct {
    int64_t rows;
    double timeout_s; /* 0: none sent */
    int bulk;         /* marked bulk by its client */
} EnsembleAdmitted;
typedef struct { /* arrays of the call's request count, the caller's */
    int32_t *first, *bulk, *crowded;
    int32_t n_first, n_bulk, n_crowded;
    char *refused;                          /* per request: 1 refused */
    char (*message)[ENSEMBLE_MESSAGE_SIZE]; /* per refused request: why */
} EnsemblePlan;
typedef struct {
    /* The clock plan and finished read (time.perf_counter's: CLOCK_MONOTONIC), in seconds. */
    double (*now)(void);
    /* The plan for a call of n requests handed over at now, into plan (over a _admission.Admission).
     * 0, or -1 out of memory (then nothing was decided and the state is unchanged). */
    int (*plan)(PyObject *admission, const EnsembleAdmitted *requests, int32_t n, double now, EnsemblePlan *plan);
    /* Records a call handed requests requests at start, of which scored (rows rows) were scored by end. */
    void (*finished)(PyObject *admission, double start, double end, int64_t requests, int64_t rows, int64_t scored);
} EnsembleAdmissionApi;

/* ensemble.native._chain: the ranker's whole chain over Triton's buffers (a _chain.Chain). */
#define ENSEMBLE_CHAIN_CAPSULE "ensemble.native._chain." ENSEMBLE_API_ATTRIBUTE
typedef struct {
    /* The outputs (blend, then each model) of the rows of parts requests into out [outputs x total
     * rows]: part p has rows[p] rows, dense[p] [rows x n_dense] float32 raw features, and wire[p] the
     * BYTES wire buffer (wire_size[p] bytes) of its [rows x columns] categorical strings; on two
     * threads when threads is 2 (the same outputs). deadline: when the call must be done (CLOCK_MONOTONIC
     * seconds; 0: none), what a row store's cold reads may not pass. 0, -1 with the reason in error, or -2
     * when a DLRM's row store could not be read in time (the reason in error: answered UNAVAILABLE). */
    int (*score)(PyObject *chain, int32_t parts, const float *const *dense, const unsigned char *const *wire,
                 const uint64_t *wire_size, const int64_t *rows, int threads, float *out, char *error,
                 size_t error_size, double deadline);
    int64_t (*outputs)(PyObject *chain);
} EnsembleChainApi;

#endif
