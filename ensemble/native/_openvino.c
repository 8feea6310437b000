/* A DLRM scored by OpenVINO's CPU runtime through its C API, callable from C without the interpreter:
 * the engine a release records for a DLRM step when it measured fastest on the machine
 * (ensemble/models/engines.py chooses and records it; the model is the step's OpenVINO IR, written at
 * export from the TorchScript or TFLite model).
 *
 * An Engine holds a compiled copy of the model and its inference request per caller that may run at once
 * (the chain scores a call's two halves on two threads). A call wraps the caller's buffers as tensors (no
 * copy in), runs the request synchronously and copies the probabilities out. Ids are checked against
 * each column's table before the run, as the C forward pass checks them: OpenVINO's gather answers an
 * id outside its table with a zero vector instead of an error.
 *
 * It publishes the same entry points as ensemble.native._dlrm (api.h: EnsembleDlrmApi) under
 * its own capsule, so the chain (ensemble/native/_chain.c) scores through either.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <openvino/c/openvino.h>

#include "api.h"

#define SLOTS 8 /* most compiled copies of a model one Engine holds */

typedef struct {
    PyObject_HEAD
    ov_core_t *core;
    int slots;
    ov_compiled_model_t *compiled[SLOTS]; /* one copy per caller that may run at once */
    ov_infer_request_t *request[SLOTS];
    int busy[SLOTS]; /* guarded by lock */
    pthread_mutex_t lock;
    int64_t n_dense, n_ids;
    size_t dense_index, ids_index;
    int64_t *limits; /* each id column's table size */
    int64_t pooled_width; /* > 0: the model's second input is the gathered rows, float32 [rows x pooled_width] */
    char precision[16];
} Engine;

static PyObject *OpenVinoError;

static void set_error(const char *what, ov_status_e status) {
    const char *detail = ov_get_last_err_msg();
    PyErr_Format(OpenVinoError, "OpenVINO: %s: %s%s%s", what, ov_get_error_info(status),
                 detail && *detail ? ": " : "", detail ? detail : "");
}

/* A free slot's request (*slot set), or, when every slot is busy, a request made for this call on the first
 * copy (*slot = -1; OpenVINO runs it after the copy's other call). NULL: out of memory. */
static ov_infer_request_t *take_request(Engine *e, int *slot) {
    pthread_mutex_lock(&e->lock);
    for (int k = 0; k < e->slots; k++) {
        if (!e->busy[k]) {
            e->busy[k] = 1;
            pthread_mutex_unlock(&e->lock);
            *slot = k;
            return e->request[k];
        }
    }
    pthread_mutex_unlock(&e->lock);
    *slot = -1;
    ov_infer_request_t *request = NULL;
    return ov_compiled_model_create_infer_request(e->compiled[0], &request) == OK ? request : NULL;
}

static void give_request(Engine *e, ov_infer_request_t *request, int slot) {
    if (slot < 0) {
        ov_infer_request_free(request);
        return;
    }
    pthread_mutex_lock(&e->lock);
    e->busy[slot] = 0;
    pthread_mutex_unlock(&e->lock);
}

static ov_tensor_t *wrap(ov_element_type_e type, int64_t rows, int64_t width, const void *data) {
    int64_t dims[2] = {rows, width};
    ov_shape_t shape;
    ov_tensor_t *tensor = NULL;
    if (ov_shape_create(2, dims, &shape) != OK) return NULL;
    if (ov_tensor_create_from_host_ptr(type, shape, (void *)data, &tensor) != OK) tensor = NULL;
    ov_shape_free(&shape);
    return tensor;
}

/* One inference: the dense rows and the second input (ids, or a row store's pooled rows) in, one score a row
 * out. -1 done, -2 out of memory, -3 the runtime failed (its message on stderr). */
static int64_t run(Engine *e, const float *dense, ov_element_type_e second_type, int64_t second_width,
                   const void *second, int64_t rows, float *out) {
    int slot;
    ov_infer_request_t *request = take_request(e, &slot);
    if (request == NULL) return -2;
    ov_tensor_t *d = wrap(F32, rows, e->n_dense, dense), *x = wrap(second_type, rows, second_width, second);
    ov_tensor_t *result = NULL;
    int64_t status = -1;
    ov_status_e s = d && x ? OK : NOT_ALLOCATED;
    if (s == OK) s = ov_infer_request_set_input_tensor_by_index(request, e->dense_index, d);
    if (s == OK) s = ov_infer_request_set_input_tensor_by_index(request, e->ids_index, x);
    if (s == OK) s = ov_infer_request_infer(request);
    if (s == OK) s = ov_infer_request_get_output_tensor_by_index(request, 0, &result);
    void *data = NULL;
    size_t size = 0;
    if (s == OK) s = ov_tensor_get_size(result, &size);
    if (s == OK) s = ov_tensor_data(result, &data);
    if (s == OK && size == (size_t)rows) {
        memcpy(out, data, sizeof(float) * (size_t)rows);
    } else {
        fprintf(stderr, "ensemble: OpenVINO engine failed (%s: %s)\n", ov_get_error_info(s), ov_get_last_err_msg());
        status = s == NOT_ALLOCATED ? -2 : -3;
    }
    if (result) ov_tensor_free(result);
    if (d) ov_tensor_free(d);
    if (x) ov_tensor_free(x);
    give_request(e, request, slot);
    return status;
}

/* api.h's forward: -1 done, -2 out of memory, -3 the runtime failed (its message on stderr),
 * else the flat index of an id outside its table (nothing scored). */
static int64_t engine_forward(PyObject *obj, const float *dense, const int64_t *ids, int64_t rows, float *out) {
    Engine *e = (Engine *)obj;
    if (rows <= 0) return -1;
    if (e->pooled_width > 0) return -3; /* the model takes gathered rows, not ids */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *row = ids + r * e->n_ids;
        for (int64_t c = 0; c < e->n_ids; c++)
            if (row[c] < 0 || row[c] >= e->limits[c]) return r * e->n_ids + c;
    }
    return run(e, dense, I64, e->n_ids, ids, rows, out);
}

/* api.h's forward_pooled, for a model whose second input is the gathered rows (a row store's DLRM):
 * -1 done, -2 out of memory, -3 the runtime failed (its message on stderr) or the model takes ids. */
static int64_t engine_forward_pooled(PyObject *obj, const float *dense, const float *pooled, int64_t rows, float *out) {
    Engine *e = (Engine *)obj;
    if (rows <= 0) return -1;
    if (e->pooled_width <= 0) return -3;
    return run(e, dense, F32, e->pooled_width, pooled, rows, out);
}

static int64_t engine_n_dense(PyObject *obj) { return ((Engine *)obj)->n_dense; }
static int64_t engine_n_ids(PyObject *obj) { return ((Engine *)obj)->n_ids; }

static const EnsembleDlrmApi API = {engine_n_dense, engine_n_ids, engine_forward, engine_forward_pooled, NULL, NULL};

static void engine_dealloc(PyObject *obj) {
    Engine *e = (Engine *)obj;
    for (int k = 0; k < e->slots; k++) {
        if (e->request[k]) ov_infer_request_free(e->request[k]);
        if (e->compiled[k]) ov_compiled_model_free(e->compiled[k]);
    }
    if (e->core) ov_core_free(e->core);
    PyMem_RawFree(e->limits);
    pthread_mutex_destroy(&e->lock);
    Py_TYPE(obj)->tp_free(obj);
}

/* Engine(model_path, precision, limits, n_dense, dense_index, threads, pooled_width=0): precision "f32" or
 * "bf16"; limits: each id column's table size (int64 buffer); dense_index: which of the model's two inputs
 * takes the dense values (the other takes the ids, or with pooled_width > 0 the gathered rows, float32
 * [rows x pooled_width]); threads: the callers that may run at once (1..8), each given a compiled copy of
 * its own. */
static PyObject *engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    const char *path, *precision;
    PyObject *limits;
    long long n_dense, pooled_width = 0;
    int dense_index, threads;
    if (!PyArg_ParseTuple(args, "ssOLii|L:Engine", &path, &precision, &limits, &n_dense, &dense_index, &threads,
                          &pooled_width))
        return NULL;
    if (strcmp(precision, "f32") != 0 && strcmp(precision, "bf16") != 0) {
        PyErr_SetString(PyExc_ValueError, "Engine: precision must be 'f32' or 'bf16'");
        return NULL;
    }
    if (n_dense < 1 || (dense_index != 0 && dense_index != 1) || threads < 1 || threads > SLOTS) {
        PyErr_SetString(PyExc_ValueError, "Engine: n_dense >= 1, dense_index 0 or 1, threads 1..8");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(limits, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (view.itemsize != 8 || view.len < 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "Engine: limits must be int64, one per id column");
        return NULL;
    }
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (e == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    e->n_ids = view.len / 8;
    e->limits = PyMem_RawMalloc((size_t)view.len);
    if (e->limits) memcpy(e->limits, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (e->limits == NULL) {
        Py_DECREF(e);
        return PyErr_NoMemory();
    }
    e->n_dense = n_dense;
    e->pooled_width = pooled_width;
    e->dense_index = (size_t)dense_index;
    e->ids_index = (size_t)(1 - dense_index);
    snprintf(e->precision, sizeof e->precision, "%s", precision);
    ov_status_e s;
    Py_BEGIN_ALLOW_THREADS
    s = ov_core_create(&e->core);
    /* A copy of one stream of one thread per caller: a synchronous call runs on its caller's thread, and
     * callers on two threads (the chain's two halves) run at once. Two callers of one copy wait for each
     * other, and a copy of two streams hands each call to a thread of its own: both measured slower (two
     * DLRMs of the seed's size, 100 rows cut in two on two threads: 1.44 ms with a copy per thread, 2.44
     * with one shared single-stream copy, 1.51 with one two-stream copy; AMD EPYC, 2 cores). The threads
     * are not pinned (the server's own CPU list applies). */
    for (int k = 0; s == OK && k < threads; k++) {
        s = ov_core_compile_model_from_file(e->core, path, "CPU", 12, &e->compiled[k], ov_property_key_num_streams, "1",
                                            ov_property_key_inference_num_threads, "1",
                                            ov_property_key_hint_enable_cpu_pinning, "NO",
                                            ov_property_key_hint_performance_mode, "LATENCY",
                                            ov_property_key_hint_inference_precision, precision,
                                            ov_property_key_hint_enable_hyper_threading, "NO");
        if (s == OK) {
            e->slots = k + 1;
            s = ov_compiled_model_create_infer_request(e->compiled[k], &e->request[k]);
        }
    }
    Py_END_ALLOW_THREADS
    if (s != OK) {
        set_error(path, s);
        Py_DECREF(e);
        return NULL;
    }
    return (PyObject *)e;
}

/* engine(dense, ids, out): score C-contiguous float32 [rows x n_dense] and int64 [rows x n_ids] into
 * float32 out [rows], without the interpreter's lock. */
static PyObject *engine_call(PyObject *obj, PyObject *args, PyObject *kwargs) {
    Engine *e = (Engine *)obj;
    PyObject *a, *b, *c;
    if (!PyArg_ParseTuple(args, "OOO:Engine", &a, &b, &c)) return NULL;
    Py_buffer dense, ids, out;
    if (PyObject_GetBuffer(a, &dense, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(b, &ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&dense);
        return NULL;
    }
    if (PyObject_GetBuffer(c, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&dense);
        PyBuffer_Release(&ids);
        return NULL;
    }
    const int64_t rows = (int64_t)(out.len / 4);
    PyObject *result = NULL;
    if (dense.itemsize != 4 || ids.itemsize != 8 || out.itemsize != 4 || dense.len != rows * e->n_dense * 4 ||
        ids.len != rows * e->n_ids * 8) {
        PyErr_Format(PyExc_ValueError, "Engine: float32 [rows x %lld], int64 [rows x %lld] and float32 [rows]",
                     (long long)e->n_dense, (long long)e->n_ids);
    } else {
        int64_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = engine_forward(obj, dense.buf, ids.buf, rows, out.buf);
        Py_END_ALLOW_THREADS
        if (bad == -1)
            result = Py_NewRef(Py_None);
        else if (bad == -2)
            PyErr_NoMemory();
        else if (bad == -3)
            PyErr_SetString(OpenVinoError, "OpenVINO: the inference failed (see the log)");
        else
            PyErr_Format(PyExc_ValueError, "row %lld, column %lld: id %lld is outside its embedding table",
                         (long long)(bad / e->n_ids), (long long)(bad % e->n_ids), (long long)((int64_t *)ids.buf)[bad]);
    }
    PyBuffer_Release(&dense);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

/* engine.pooled(dense, pooled, out): a pooled model (pooled_width > 0) over float32 [rows x n_dense] and
 * [rows x pooled_width] into float32 out [rows], without the interpreter's lock. */
static PyObject *engine_pooled(PyObject *obj, PyObject *args) {
    Engine *e = (Engine *)obj;
    Py_buffer dense, pooled, out;
    if (!PyArg_ParseTuple(args, "y*y*w*:pooled", &dense, &pooled, &out)) return NULL;
    const int64_t rows = (int64_t)(out.len / 4);
    PyObject *result = NULL;
    if (e->pooled_width <= 0 || dense.len != rows * e->n_dense * 4 || pooled.len != rows * e->pooled_width * 4) {
        PyErr_Format(PyExc_ValueError, "Engine.pooled: a pooled model, float32 [rows x %lld], [rows x %lld], [rows]",
                     (long long)e->n_dense, (long long)e->pooled_width);
    } else {
        int64_t status;
        Py_BEGIN_ALLOW_THREADS
        status = engine_forward_pooled(obj, dense.buf, pooled.buf, rows, out.buf);
        Py_END_ALLOW_THREADS
        if (status == -1)
            result = Py_NewRef(Py_None);
        else if (status == -2)
            PyErr_NoMemory();
        else
            PyErr_SetString(OpenVinoError, "OpenVINO: the inference failed (see the log)");
    }
    PyBuffer_Release(&dense);
    PyBuffer_Release(&pooled);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef engine_methods[] = {
    {"pooled", engine_pooled, METH_VARARGS, "pooled(dense, pooled, out): a pooled model's probabilities into out"},
    {NULL, NULL, 0, NULL},
};

static PyObject *engine_get_precision(PyObject *obj, void *closure) {
    return PyUnicode_FromString(((Engine *)obj)->precision);
}

static PyGetSetDef engine_getset[] = {
    {"precision", engine_get_precision, NULL, "the inference precision the model was compiled for", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._openvino.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A DLRM compiled by OpenVINO's CPU runtime: Engine(model_path, precision, limits, n_dense, "
              "dense_index, threads); engine(dense, ids, out).",
    .tp_new = engine_new,
    .tp_dealloc = engine_dealloc,
    .tp_call = engine_call,
    .tp_getset = engine_getset,
    .tp_methods = engine_methods,
};

/* version(): the OpenVINO runtime's build string. */
static PyObject *version(PyObject *self, PyObject *args) {
    ov_version_t v;
    if (ov_get_openvino_version(&v) != OK) Py_RETURN_NONE;
    PyObject *text = PyUnicode_FromString(v.buildNumber);
    ov_version_free(&v);
    return text;
}

static PyMethodDef methods[] = {
    {"version", version, METH_NOARGS, "The OpenVINO runtime's build string."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_openvino", "OpenVINO's CPU runtime for the DLRMs, from C.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__openvino(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    OpenVinoError = PyErr_NewException("ensemble.native._openvino.OpenVinoError", PyExc_RuntimeError, NULL);
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_OPENVINO_CAPSULE, NULL);
    if (OpenVinoError == NULL || capsule == NULL || PyModule_AddObjectRef(m, "OpenVinoError", OpenVinoError) < 0 ||
        PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
