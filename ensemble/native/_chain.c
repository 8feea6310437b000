/* The ranker's whole chain over a call's buffers, in C: Triton's raw dense values and BYTES strings
 * in, the four outputs out, with no Python call, so the native backend (backend.c) can answer a
 * call without the interpreter.
 *
 * It runs the same code the Python path runs, in the same order: the lean feature transform (the
 * categorical lookup of _request.c straight from the wire; the dense fill, clip and +1 of _request.c,
 * then numpy's own float32 log loop, then the normalization in float32), the trees of _trees.c on the
 * same design matrix, both DLRMs through _dlrm.c, the blend of _request.c. Those modules hand their
 * entry points over as capsules (api.h); numpy's log is the loop np.log runs for float32, taken
 * from the ufunc, because NVTabular's values (and the trees' thresholds on them) are numpy's to the
 * bit. ensemble/scoring/chain.py builds a Chain from a loaded release and checks, before anything
 * uses it, that it gives the Python chain's scores bit for bit.
 *
 * A call may use two threads: the rows are cut in two (as the Python pipeline cuts a batch) and a
 * helper thread the Chain keeps scores the second part, lookups and transform included, while the
 * caller scores the first. Every row's outputs are the same either way (each row is scored alone).
 * A helper runs at its callers' priority: the Chain keeps one per nice value that calls it (the native
 * backend's model thread, its bulk lane and the rank model's threads each run at their own), since a
 * thread can lower its priority but not raise it again; one shared helper, lowered once by the bulk
 * lane, scored every later interactive call's second half at the lane's nice 19.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NO_IMPORT_ARRAY /* only numpy's types are read here: none of its C API tables */
#define NO_IMPORT_UFUNC
#include <numpy/ndarraytypes.h>
#include <numpy/ufuncobject.h>

#include "api.h"

#define MODELS 3 /* trees, torch DLRM, TF DLRM: the outputs after the blend */

/* One part list of a call: what score takes. */
/* Helpers a Chain keeps at most: one per nice value its callers run at (the model thread's, the bulk
 * lane's, the rank model's and the loading thread's); a caller at yet another scores alone. */
#define HELPERS 4

typedef struct {
    int32_t parts;
    const float *const *dense;
    const unsigned char *const *wire;
    const uint64_t *wire_size;
    const int64_t *rows;
    double deadline; /* CLOCK_MONOTONIC seconds the call must be done by (0: none): a row store's reads */
} Parts;

/* A helper thread and the one job it may hold. */
typedef struct {
    void *chain; /* the Chain it scores for */
    pthread_t thread;
    pthread_mutex_t lock; /* guards the fields below */
    pthread_cond_t wake;
    bool started, posted, done, stop;
    Parts job;
    int nice; /* the nice value of the threads it helps, which it runs at (fixed when it is started) */
    float *out;
    int64_t stride;
    int result;
    char error[ENSEMBLE_ERROR_SIZE];
    pthread_mutex_t busy; /* held by the call using the helper: another call meanwhile scores alone */
} Helper;

typedef struct {
    PyObject_HEAD
    const EnsembleNativeApi *native;
    const EnsembleTreesApi *trees;
    const EnsembleDlrmApi *dlrm[2]; /* the torch DLRM's and the TF DLRM's engine: _dlrm's or _openvino's */
    PyObject *vocabulary, *torch, *tf; /* held: the kernels read their C fields */
    Py_buffer means, stds, node_column, node_threshold, leaves;
    int held; /* how many of those buffers are held */
    int64_t n_dense, columns, fallback, n_trees;
    int depth;
    float fill, clip_min, base_margin;
    double weights[MODELS], bias, eps;
    PyUFuncGenericFunction log_loop;
    void *log_data;
    pthread_mutex_t helpers_lock; /* guards starting a helper */
    Helper helpers[HELPERS];
} Chain;

/* numpy's inner loop of np.log for float32 -> float32 (the first such loop, the one numpy picks). */
static int numpy_log(Chain *c) {
    PyObject *numpy = PyImport_ImportModule("numpy");
    PyObject *log = numpy ? PyObject_GetAttrString(numpy, "log") : NULL;
    Py_XDECREF(numpy);
    if (log == NULL) return -1;
    int found = 0;
    if (strcmp(Py_TYPE(log)->tp_name, "numpy.ufunc") == 0) {
        const PyUFuncObject *u = (const PyUFuncObject *)log;
        for (int i = 0; u->nin == 1 && u->nout == 1 && i < u->ntypes && !found; i++) {
            if (u->types[2 * i] == NPY_FLOAT && u->types[2 * i + 1] == NPY_FLOAT && u->functions[i] != NULL) {
                c->log_loop = u->functions[i];
                c->log_data = u->data ? u->data[i] : NULL;
                found = 1;
            }
        }
    }
    Py_DECREF(log); /* numpy keeps the ufunc, and its loops, for the process's life */
    if (!found) PyErr_SetString(PyExc_TypeError, "Chain: numpy.log has no float32 loop here");
    return found ? 0 : -1;
}

static const void *api_of(const char *capsule) {
    return PyCapsule_Import(capsule, 0);
}

/* The entry points of a DLRM engine object: a _dlrm.Weights or an _openvino.Engine, else NULL (TypeError). */
static const EnsembleDlrmApi *dlrm_api(PyObject *engine) {
    const char *name = Py_TYPE(engine)->tp_name;
    if (strcmp(name, "ensemble.native._dlrm.Weights") == 0) return api_of(ENSEMBLE_DLRM_CAPSULE);
    if (strcmp(name, "ensemble.native._openvino.Engine") == 0) return api_of(ENSEMBLE_OPENVINO_CAPSULE);
    if (strcmp(name, "ensemble.native._tables.Dlrm") == 0) return api_of(ENSEMBLE_TABLES_CAPSULE);
    PyErr_Format(PyExc_TypeError, "Chain: a DLRM must be a _dlrm.Weights, an _openvino.Engine or a _tables.Dlrm, not %s",
                 name);
    return NULL;
}

/* A contiguous buffer of count items of itemsize bytes (count < 0: any number); raw: any buffer of that
 * many bytes (bytes objects, Triton's memory), else one whose items are that size (numpy arrays). */
static int take_items(PyObject *obj, Py_buffer *view, Py_ssize_t count, int itemsize, int raw, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if ((raw ? view->len % itemsize != 0 : view->itemsize != itemsize) || (count >= 0 && view->len / itemsize != count)) {
        PyErr_Format(PyExc_ValueError, "Chain: %s must hold %zd items of %d bytes", name, count, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void helper_stop(Helper *h) {
    if (h->started) {
        pthread_mutex_lock(&h->lock);
        h->stop = true;
        pthread_cond_broadcast(&h->wake);
        pthread_mutex_unlock(&h->lock);
        pthread_join(h->thread, NULL);
        h->started = false;
    }
}

static void chain_dealloc(PyObject *obj) {
    Chain *c = (Chain *)obj;
    for (int i = 0; i < HELPERS; i++) {
        helper_stop(&c->helpers[i]);
        pthread_cond_destroy(&c->helpers[i].wake);
        pthread_mutex_destroy(&c->helpers[i].lock);
        pthread_mutex_destroy(&c->helpers[i].busy);
    }
    pthread_mutex_destroy(&c->helpers_lock);
    Py_buffer *views[] = {&c->means, &c->stds, &c->node_column, &c->node_threshold, &c->leaves};
    for (int i = 0; i < c->held; i++) PyBuffer_Release(views[i]);
    Py_XDECREF(c->vocabulary);
    Py_XDECREF(c->torch);
    Py_XDECREF(c->tf);
    Py_TYPE(obj)->tp_free(obj);
}

/* Chain(vocabulary, fallback, fill, clip_min, means, stds,
 *       node_column, node_threshold, leaves, depth, base_margin,
 *       torch_weights, tf_weights, blend_weights, blend_bias, blend_eps) */
static PyObject *chain_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *vocabulary, *means, *stds, *node_column, *node_threshold, *leaves, *torch, *tf, *weights;
    long long fallback;
    double fill, clip_min, base_margin, bias, eps;
    int depth;
    if (!PyArg_ParseTuple(args, "OLddOOOOOidOOO!dd:Chain", &vocabulary, &fallback, &fill, &clip_min, &means, &stds,
                          &node_column, &node_threshold, &leaves, &depth, &base_margin, &torch, &tf, &PyTuple_Type,
                          &weights, &bias, &eps))
        return NULL;
    Chain *c = (Chain *)type->tp_alloc(type, 0);
    if (c == NULL) return NULL;
    pthread_mutex_init(&c->helpers_lock, NULL);
    for (int i = 0; i < HELPERS; i++) {
        c->helpers[i].chain = c;
        pthread_mutex_init(&c->helpers[i].lock, NULL);
        pthread_mutex_init(&c->helpers[i].busy, NULL);
        pthread_cond_init(&c->helpers[i].wake, NULL);
    }
    c->native = api_of(ENSEMBLE_REQUEST_CAPSULE);
    c->trees = c->native ? api_of(ENSEMBLE_TREES_CAPSULE) : NULL;
    c->dlrm[0] = c->trees ? dlrm_api(torch) : NULL;
    c->dlrm[1] = c->dlrm[0] ? dlrm_api(tf) : NULL;
    if (c->dlrm[1] == NULL || numpy_log(c) < 0) goto fail;
    if (strcmp(Py_TYPE(vocabulary)->tp_name, "ensemble.native._request.Vocabulary") != 0) {
        PyErr_SetString(PyExc_TypeError, "Chain: a _request.Vocabulary and two DLRM engines");
        goto fail;
    }
    c->vocabulary = Py_NewRef(vocabulary);
    c->torch = Py_NewRef(torch);
    c->tf = Py_NewRef(tf);
    c->columns = c->native->columns(vocabulary);
    c->n_dense = c->dlrm[0]->n_dense(torch);
    if (take_items(means, &c->means, c->n_dense, 4, 0, "means") < 0) goto fail;
    c->held++;
    if (take_items(stds, &c->stds, c->n_dense, 4, 0, "stds") < 0) goto fail;
    c->held++;
    if (depth < 1 || depth > 20) {
        PyErr_SetString(PyExc_ValueError, "Chain: the trees' depth must be 1..20");
        goto fail;
    }
    const Py_ssize_t n_internal = ((Py_ssize_t)1 << depth) - 1;
    if (take_items(node_column, &c->node_column, -1, 4, 0, "node_column") < 0) goto fail;
    c->held++;
    c->n_trees = c->node_column.len / 4 / n_internal;
    if (take_items(node_threshold, &c->node_threshold, c->n_trees * n_internal, 4, 0, "node_threshold") < 0) goto fail;
    c->held++;
    if (take_items(leaves, &c->leaves, c->n_trees * (n_internal + 1), 4, 0, "leaves") < 0) goto fail;
    c->held++;
    if (c->n_trees < 1 || c->node_column.len / 4 != c->n_trees * n_internal || c->dlrm[1]->n_dense(tf) != c->n_dense ||
        c->dlrm[0]->n_ids(torch) != c->columns || c->dlrm[1]->n_ids(tf) != c->columns || PyTuple_GET_SIZE(weights) != MODELS) {
        PyErr_SetString(PyExc_ValueError, "Chain: the trees, both DLRMs and the vocabulary do not take the same "
                                          "features, or the blend does not weigh three scores");
        goto fail;
    }
    /* Each node's column is below 2 x (dense + columns): TreeArrays checked it for its own features. */
    const uint32_t *nc = c->node_column.buf;
    for (Py_ssize_t i = 0; i < c->node_column.len / 4; i++) {
        if (nc[i] >= 2 * (uint32_t)(c->n_dense + c->columns)) {
            PyErr_SetString(PyExc_ValueError, "Chain: a tree reads a feature beyond the dense values and ids");
            goto fail;
        }
    }
    for (int m = 0; m < MODELS; m++) {
        c->weights[m] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, m));
        if (PyErr_Occurred()) goto fail;
    }
    c->fallback = fallback;
    c->fill = (float)fill;
    c->clip_min = (float)clip_min;
    c->depth = depth;
    c->base_margin = (float)base_margin;
    c->bias = bias;
    c->eps = eps;
    return (PyObject *)c;
fail:
    Py_DECREF(c);
    return NULL;
}

/* The continuous features of rows x into x itself: numpy's float32 log, then (x - mean) / std in float32. */
static void finish_dense(const Chain *c, float *x, int64_t rows) {
    npy_intp n = (npy_intp)(rows * c->n_dense), steps[2] = {sizeof(float), sizeof(float)};
    char *args[2] = {(char *)x, (char *)x};
    c->log_loop(args, &n, steps, c->log_data);
    const float *means = c->means.buf, *stds = c->stds.buf;
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * c->n_dense;
        for (int64_t j = 0; j < c->n_dense; j++) {
            const float centred = row[j] - means[j];
            row[j] = centred / stds[j];
        }
    }
}

/* The outputs of the parts' rows into out: output k of row r at out[k * stride + r]. */
static int score_rows(const Chain *c, const Parts *in, float *out, int64_t stride, char *error, size_t error_size) {
    const int64_t D = c->n_dense, C = c->columns, W = D + C;
    int64_t total = 0;
    for (int32_t p = 0; p < in->parts; p++) total += in->rows[p];
    if (total == 0) return 0;
    const size_t tree_scratch = c->trees->scratch_floats(W);
    char *memory = PyMem_RawMalloc((size_t)total * (size_t)(D * 4 + C * 8 + W * 4) + tree_scratch * 4);
    if (memory == NULL) {
        snprintf(error, error_size, "out of memory for %lld rows", (long long)total);
        return -1;
    }
    int64_t *ids = (int64_t *)memory;
    float *x = (float *)(ids + total * C), *design = x + total * D, *scratch = design + total * W;
    int64_t at = 0;
    for (int32_t p = 0; p < in->parts; p++) {
        c->native->dense_prepare(in->dense[p], x + at * D, (size_t)(in->rows[p] * D), c->fill, c->clip_min);
        if (c->native->lookup_wire(c->vocabulary, in->wire[p], in->wire_size[p], c->fallback, ids + at * C,
                                   (size_t)(in->rows[p] * C), error, error_size) < 0)
            goto fail;
        at += in->rows[p];
    }
    finish_dense(c, x, total);
    for (int64_t r = 0; r < total; r++) { /* the trees' input: the features, then the ids as values */
        memcpy(design + r * W, x + r * D, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j < C; j++) design[r * W + D + j] = (float)ids[r * C + j];
    }
    float *models = out + stride; /* out: the blend's row, then one per model */
    c->trees->predict(design, total, W, c->n_trees, c->depth, c->node_column.buf, c->node_threshold.buf,
                      c->leaves.buf, c->base_margin, scratch, models);
    PyObject *dlrms[2] = {c->torch, c->tf};
    for (int k = 0; k < 2; k++) {
        if (c->dlrm[k]->deadline) c->dlrm[k]->deadline(in->deadline); /* this thread's, for its reads */
        const int64_t bad = c->dlrm[k]->forward(dlrms[k], x, ids, total, models + (k + 1) * stride);
        if (bad != -1) {
            if (bad == -2)
                snprintf(error, error_size, "out of memory for %lld rows", (long long)total);
            else if (bad == -3)
                snprintf(error, error_size, "the %s DLRM's inference engine failed", k ? "TF" : "torch");
            else if (bad == -4) { /* a row store could not be read in time: the request may be retried */
                const char *why = c->dlrm[k]->failure ? c->dlrm[k]->failure(dlrms[k]) : NULL;
                snprintf(error, error_size, "the %s DLRM: %s", k ? "TF" : "torch", why && *why ? why : "a table read failed");
                PyMem_RawFree(memory);
                return -2;
            }
            else
                snprintf(error, error_size, "row %lld, column %lld: id %lld is outside its embedding table",
                         (long long)(bad / C), (long long)(bad % C), (long long)ids[bad]);
            goto fail;
        }
    }
    const float *scores[MODELS] = {models, models + stride, models + 2 * stride};
    c->native->blend(scores, MODELS, c->weights, c->bias, c->eps, out, (size_t)total);
    PyMem_RawFree(memory);
    return 0;
fail:
    PyMem_RawFree(memory);
    return -1;
}

/* This thread's nice value, or 0 when it cannot be read. */
static int thread_nice(void) {
    errno = 0;
    const int nice = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
    return errno ? 0 : nice;
}

static void *helper_main(void *arg) {
    Helper *h = arg;
    Chain *c = h->chain;
    /* The helper scores half of its callers' calls, so it runs at their priority (the native backend
     * lowers its model thread's, backend.c: lower_priority). A new thread takes its creator's nice value,
     * which is the callers'; it only ever lowers its own, which needs no privilege. */
    if (h->nice > thread_nice()) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), h->nice);
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->posted && !h->stop) pthread_cond_wait(&h->wake, &h->lock);
        if (h->stop) break;
        h->posted = false;
        pthread_mutex_unlock(&h->lock);
        const int result = score_rows(c, &h->job, h->out, h->stride, h->error, sizeof h->error);
        pthread_mutex_lock(&h->lock);
        h->result = result;
        h->done = true;
        pthread_cond_broadcast(&h->wake);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

/* The helper of callers at nice value `nice`, started on first use, with its `busy` lock held; NULL when
 * it is busy with another call, every slot belongs to other nice values, or it cannot start (the call
 * then scores alone). */
static Helper *helper_for(Chain *c, int nice) {
    pthread_mutex_lock(&c->helpers_lock);
    Helper *h = NULL;
    for (int i = 0; i < HELPERS && h == NULL; i++)
        if (!c->helpers[i].started || c->helpers[i].nice == nice) h = &c->helpers[i];
    if (h != NULL && !h->started) {
        h->nice = nice;
        pthread_mutex_lock(&h->lock);
        h->started = pthread_create(&h->thread, NULL, helper_main, h) == 0;
        pthread_mutex_unlock(&h->lock);
        if (!h->started) h = NULL;
    }
    pthread_mutex_unlock(&c->helpers_lock);
    if (h != NULL && pthread_mutex_trylock(&h->busy) != 0) h = NULL;
    return h;
}

/* The byte offset in a BYTES wire buffer after its first count values, or its end when it does not
 * hold them (the lookup then refuses the part that runs short). */
static uint64_t wire_offset(const unsigned char *wire, uint64_t size, int64_t count) {
    const uint64_t at = ensemble_wire_offset(wire, size, count);
    return at == UINT64_MAX ? size : at;
}

static int score(PyObject *obj, int32_t parts, const float *const *dense, const unsigned char *const *wire,
                 const uint64_t *wire_size, const int64_t *rows, int threads, float *out, char *error,
                 size_t error_size, double deadline) {
    Chain *c = (Chain *)obj;
    const Parts all = {parts, dense, wire, wire_size, rows, deadline};
    int64_t total = 0;
    for (int32_t p = 0; p < parts; p++) total += rows[p];
    const int64_t cut = (total / 2 + 15) / 16 * 16; /* the Python pipeline's cut: whole groups of 16 rows */
    if (threads < 2 || cut <= 0 || cut >= total) return score_rows(c, &all, out, total, error, error_size);
    /* this thread's nice value, read once: the backend sets it before the thread's first call */
    static __thread int poster_nice = -100;
    if (poster_nice == -100) poster_nice = thread_nice();
    Helper *h = helper_for(c, poster_nice);
    if (h == NULL) return score_rows(c, &all, out, total, error, error_size);
    /* The parts cut at row `cut`: [0, k] for this thread (part k's first `head` rows), [k, parts) for the
     * helper (part k's remaining rows), each list of at most parts + 1 entries. */
    const size_t n = (size_t)parts + 1;
    const float **d = malloc(2 * n * sizeof *d);
    const unsigned char **w = malloc(2 * n * sizeof *w);
    uint64_t *ws = malloc(2 * n * sizeof *ws);
    int64_t *r = malloc(2 * n * sizeof *r);
    if (d == NULL || w == NULL || ws == NULL || r == NULL) {
        free(d), free(w), free(ws), free(r);
        pthread_mutex_unlock(&h->busy);
        return score_rows(c, &all, out, total, error, error_size);
    }
    int32_t k = 0;
    int64_t before = 0;
    while (before + rows[k] <= cut) before += rows[k++];
    const int64_t head = cut - before; /* part k's rows on this thread (0: it starts the helper's) */
    for (int32_t p = 0; p < k; p++) d[p] = dense[p], w[p] = wire[p], ws[p] = wire_size[p], r[p] = rows[p];
    int32_t first = k;
    const uint64_t split = head ? wire_offset(wire[k], wire_size[k], head * c->columns) : 0;
    if (head) d[first] = dense[k], w[first] = wire[k], ws[first] = split, r[first] = head, first++;
    const float **d2 = d + n;
    const unsigned char **w2 = w + n;
    uint64_t *ws2 = ws + n;
    int64_t *r2 = r + n;
    d2[0] = dense[k] + head * c->n_dense, w2[0] = wire[k] + split, ws2[0] = wire_size[k] - split;
    r2[0] = rows[k] - head;
    for (int32_t p = k + 1; p < parts; p++)
        d2[p - k] = dense[p], w2[p - k] = wire[p], ws2[p - k] = wire_size[p], r2[p - k] = rows[p];
    pthread_mutex_lock(&h->lock);
    h->job = (Parts){parts - k, d2, w2, ws2, r2, deadline};
    h->out = out + cut;
    h->stride = total;
    h->done = false;
    h->posted = true;
    pthread_cond_broadcast(&h->wake);
    pthread_mutex_unlock(&h->lock);
    const Parts mine = {first, d, w, ws, r, deadline};
    int result = score_rows(c, &mine, out, total, error, error_size);
    pthread_mutex_lock(&h->lock);
    while (!h->done) pthread_cond_wait(&h->wake, &h->lock);
    if (result == 0 && h->result != 0) {
        result = h->result;
        snprintf(error, error_size, "%s", h->error);
    }
    pthread_mutex_unlock(&h->lock);
    pthread_mutex_unlock(&h->busy);
    free(d), free(w), free(ws), free(r);
    return result;
}

static int64_t outputs(PyObject *obj) { return 1 + MODELS; }

static const EnsembleChainApi API = {score, outputs};

/* ----- the Python face: what tests and the load-time check call ----- */

/* score(parts: tuple of (dense, wire, rows), out: writable float32 [outputs x total rows], threads=1) -> None */
static PyObject *chain_score(Chain *self, PyObject *args) {
    PyObject *parts_obj, *out_obj;
    int threads = 1;
    double deadline = 0.0;
    if (!PyArg_ParseTuple(args, "O!O|id", &PyTuple_Type, &parts_obj, &out_obj, &threads, &deadline)) return NULL;
    const Py_ssize_t parts = PyTuple_GET_SIZE(parts_obj);
    if (parts > INT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "score: too many parts");
        return NULL;
    }
    const size_t n = (size_t)(parts ? parts : 1);
    Py_buffer *views = PyMem_Calloc(2 * n + 1, sizeof(Py_buffer));
    const float **dense = PyMem_Calloc(n, sizeof *dense);
    const unsigned char **wire = PyMem_Calloc(n, sizeof *wire);
    uint64_t *wire_size = PyMem_Calloc(n, sizeof *wire_size);
    int64_t *rows = PyMem_Calloc(n, sizeof *rows), total = 0;
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (views == NULL || dense == NULL || wire == NULL || wire_size == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0; p < parts; p++) {
        PyObject *dense_obj, *wire_obj;
        long long count;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts_obj, p), "OOL", &dense_obj, &wire_obj, &count)) goto done;
        if (count < 0 || take_items(dense_obj, &views[held], count * self->n_dense, 4, 1, "dense") < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "score: a part of negative rows");
            goto done;
        }
        dense[p] = views[held++].buf;
        if (PyObject_GetBuffer(wire_obj, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        wire[p] = views[held].buf;
        wire_size[p] = (uint64_t)views[held++].len;
        rows[p] = count;
        total += count;
    }
    if (take_items(out_obj, &views[held], (1 + MODELS) * total, 4, 1, "out") < 0) goto done;
    Py_buffer *out = &views[held++];
    if (out->readonly) {
        PyErr_SetString(PyExc_ValueError, "score: out must be writable");
        goto done;
    }
    char error[ENSEMBLE_ERROR_SIZE];
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = score((PyObject *)self, (int32_t)parts, dense, wire, wire_size, rows, threads, out->buf, error,
                   sizeof error, deadline);
    Py_END_ALLOW_THREADS
    if (failed == -2)
        PyErr_SetString(PyExc_ConnectionError, error); /* a table not read in time: retryable */
    else if (failed)
        PyErr_SetString(PyExc_ValueError, error);
    else
        result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; views != NULL && i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(dense);
    PyMem_Free(wire);
    PyMem_Free(wire_size);
    PyMem_Free(rows);
    return result;
}

/* transform_dense(dense, out): the lean transform's continuous features, from raw values. */
static PyObject *chain_transform_dense(Chain *self, PyObject *args) {
    Py_buffer src, out;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &out)) return NULL;
    PyObject *result = NULL;
    if (src.len != out.len || src.len % (4 * self->n_dense) != 0) {
        PyErr_SetString(PyExc_ValueError, "transform_dense: [rows x dense] float32 in and out");
    } else {
        const int64_t rows = src.len / (4 * self->n_dense);
        self->native->dense_prepare(src.buf, out.buf, (size_t)(rows * self->n_dense), self->fill, self->clip_min);
        finish_dense(self, out.buf, rows);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef chain_methods[] = {
    {"score", (PyCFunction)chain_score, METH_VARARGS,
     "score(((dense, wire, rows), ...), out, threads=1, deadline=0.0): the outputs of every part's rows into out "
     "[outputs x rows], on one thread or two"},
    {"transform_dense", (PyCFunction)chain_transform_dense, METH_VARARGS,
     "transform_dense(dense, out): the continuous features of raw float32 values"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChainType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._chain.Chain",
    .tp_basicsize = sizeof(Chain),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The ranker's chain in C over raw dense values and BYTES wire buffers.",
    .tp_new = chain_new,
    .tp_dealloc = chain_dealloc,
    .tp_methods = chain_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_chain",
                                    .m_doc = "The ranker's chain in C.", .m_size = -1};

PyMODINIT_FUNC PyInit__chain(void) {
    if (PyType_Ready(&ChainType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_CHAIN_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Chain", (PyObject *)&ChainType) < 0 || PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
