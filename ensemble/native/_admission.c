/* The ranker's admission (ensemble/serving/admission.py says what it decides and why) in C, so the
 * native backend can plan a call without the interpreter: the same arithmetic as the Python classes
 * (CostModel, HandOff, Admission), operation for operation in the same order, so both give the same
 * plans and the same fits (tests/unit/test_admission.py runs them side by side). The Python classes
 * stay the reference; this is what serves when the extension was built.
 *
 * Admission(objective_s, state: tuple, texts: tuple) builds one from a Python policy's state
 * (admission.NativeAdmission does); plan(...) and finished(...) are its Python face, and the capsule
 * (api.h) its face for C callers, over the same state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#include "api.h"

/* admission.py's constants */
#define TAIL_QUANTILE 0.9
#define TAIL_STEP 0.02
#define DOOR_S 1.5e-3
#define BULK_WAIT 0.5
#define YIELD_S 1.0

typedef struct {
    PyObject_HEAD
    double objective_s;
    /* CostModel: the prior, the fit's sums and coefficients, the tail ratio */
    double prior_fixed, prior_per_row, prior_per_request;
    double decay, ridge[2], xx[3], xy[2];
    double fixed, per_row, per_request, tail;
    /* HandOff */
    double hand_decay, hand_seconds, hand_requests;
    /* the previous call; whether the current one started on an idle instance */
    int has_last;
    double last_start, last_end;
    int64_t last_requests;
    int idle;
    double interactive_at; /* when a call last held an interactive request (-inf: never) */
    /* refusal texts: a format with (predicted ms, deadline ms, which), what sets a deadline, and the
     * capacity refusal */
    char refusal_format[ENSEMBLE_MESSAGE_SIZE], objective_text[64], timeout_text[64], bulk_text[64];
    char at_capacity[ENSEMBLE_MESSAGE_SIZE];
    /* One call at a time changes the state: the backend plans in C without the interpreter's lock, and
     * a model with more than one instance would plan from several threads. */
    pthread_mutex_t lock;
} Admission;

/* Python's max(a, b) and min(a, b) for floats: the first argument unless the second is strictly
 * greater (smaller). */
static inline double py_max(double a, double b) { return b > a ? b : a; }
static inline double py_min(double a, double b) { return b < a ? b : a; }

static double predict(const Admission *s, int64_t rows, int64_t requests) {
    return s->fixed + s->per_row * (double)rows + s->per_request * (double)requests;
}

static double marginal(const Admission *s, int64_t rows) { return s->per_row * (double)rows + s->per_request; }

static double prior_alone(const Admission *s, int64_t rows) {
    return s->prior_fixed + s->prior_per_row * (double)rows + s->prior_per_request;
}

static void observe(Admission *s, int64_t rows, int64_t requests, double seconds) {
    const double predicted = predict(s, rows, requests);
    if (predicted > 0) {
        const int above = seconds > predicted * s->tail;
        s->tail = py_min(py_max(s->tail + TAIL_STEP * (above ? TAIL_QUANTILE : TAIL_QUANTILE - 1), 1.0), 3.0);
    }
    const double d = s->decay, r = (double)rows;
    const double y = seconds - s->prior_per_request * (double)requests;
    s->xx[0] = d * s->xx[0] + 1.0;
    s->xx[1] = d * s->xx[1] + r;
    s->xx[2] = d * s->xx[2] + (double)(rows * rows);
    s->xy[0] = d * s->xy[0] + y;
    s->xy[1] = d * s->xy[1] + r * y;
    const double a = s->xx[0] + s->ridge[0], b = s->xx[1], c = s->xx[2] + s->ridge[1];
    const double u = s->xy[0] + s->ridge[0] * s->prior_fixed, v = s->xy[1] + s->ridge[1] * s->prior_per_row;
    const double det = a * c - b * b;
    s->fixed = py_max((c * u - b * v) / det, 0.0);
    s->per_row = py_max((a * v - b * u) / det, 0.0);
}

static double hand_per_request(const Admission *s) { return s->hand_seconds / s->hand_requests; }

static double busy_gap(const Admission *s, int64_t requests) {
    return 2 * hand_per_request(s) * (double)requests + 5e-4;
}

static double waited(Admission *s, double now, int64_t requests) {
    s->idle = 1;
    if (!s->has_last) return hand_per_request(s) * (double)requests;
    const double gap = now - s->last_end, busy = busy_gap(s, s->last_requests + requests);
    if (requests > 1) {
        s->hand_seconds = s->hand_decay * s->hand_seconds + py_min(gap, 2 * busy);
        s->hand_requests = s->hand_decay * s->hand_requests + (double)(s->last_requests + requests);
    }
    if (gap <= busy) {
        s->idle = 0;
        return now - s->last_start;
    }
    return hand_per_request(s) * (double)requests;
}

typedef struct {
    int bulk;
    double deadline;
    const char *which;
    double marginal;
} Priced;

static void refusal(const Admission *s, char *out, double predicted_s, double deadline_s, const char *which) {
    snprintf(out, ENSEMBLE_MESSAGE_SIZE, s->refusal_format, predicted_s * 1e3, deadline_s * 1e3, which);
}

static void greedy(const Admission *s, const Priced *priced, int32_t n, double waited_s, double hand_off, double cap,
                   EnsemblePlan *plan) {
    plan->n_first = plan->n_bulk = plan->n_crowded = 0;
    memset(plan->refused, 0, (size_t)n);
    const double fixed = s->tail * s->fixed;
    double spent = fixed, room = INFINITY;
    for (int32_t i = 0; i < n; i++) {
        const Priced p = priced[i];
        if (p.bulk) continue;
        const double own = p.deadline - waited_s - hand_off;
        if (fixed + p.marginal > own) {
            plan->refused[i] = 1;
            refusal(s, plan->message[i], waited_s + fixed + p.marginal + hand_off, p.deadline, p.which);
        } else if (spent + p.marginal <= py_min(py_min(room, own), plan->n_first ? cap : INFINITY)) {
            plan->first[plan->n_first++] = i;
            spent += p.marginal;
            room = py_min(room, own);
        } else {
            const int meets = spent + p.marginal <= py_min(room, own);
            plan->refused[i] = 1;
            if (meets)
                snprintf(plan->message[i], ENSEMBLE_MESSAGE_SIZE, "%s", s->at_capacity);
            else
                refusal(s, plan->message[i], waited_s + spent + p.marginal + hand_off, p.deadline, p.which);
            plan->crowded[plan->n_crowded++] = i;
        }
    }
    for (int32_t i = 0; i < n; i++) {
        const Priced p = priced[i];
        if (!p.bulk) continue;
        if (waited_s + spent + p.marginal + hand_off > p.deadline) {
            plan->refused[i] = 1;
            refusal(s, plan->message[i], waited_s + spent + p.marginal + hand_off, p.deadline, p.which);
        } else {
            plan->bulk[plan->n_bulk++] = i;
            spent += p.marginal;
        }
    }
}

static int plan_call(Admission *s, const EnsembleAdmitted *requests, int32_t n, double now, EnsemblePlan *plan) {
    Priced *priced = PyMem_RawMalloc(sizeof(Priced) * (size_t)(n ? n : 1));
    if (priced == NULL) return -1;
    const double waited_s = waited(s, now, n);
    const double hand_off = hand_per_request(s) * (double)n + DOOR_S;
    const double tail = s->tail;
    for (int32_t i = 0; i < n; i++) { /* a call holding an interactive request: bulk yields from now on */
        const EnsembleAdmitted r = requests[i];
        if (!(r.bulk || py_min(prior_alone(s, r.rows), predict(s, r.rows, 1)) > s->objective_s)) {
            s->interactive_at = now;
            break;
        }
    }
    const int yielding = now - s->interactive_at <= py_max(YIELD_S, s->objective_s);
    for (int32_t i = 0; i < n; i++) {
        const EnsembleAdmitted r = requests[i];
        const double alone = py_min(prior_alone(s, r.rows), predict(s, r.rows, 1));
        const int bulk = r.bulk || alone > s->objective_s;
        const double timeout = r.timeout_s > 0 ? r.timeout_s : INFINITY;
        if (bulk) {
            const double bound = yielding ? s->tail * predict(s, r.rows, 1) + BULK_WAIT * s->objective_s : INFINITY;
            priced[i] = (Priced){1, bound < timeout ? bound : timeout, bound < timeout ? s->bulk_text : s->timeout_text,
                                 tail * marginal(s, r.rows)};
        } else {
            const int by_timeout = timeout < s->objective_s;
            priced[i] = (Priced){0, by_timeout ? timeout : s->objective_s,
                                 by_timeout ? s->timeout_text : s->objective_text, tail * marginal(s, r.rows)};
        }
    }
    greedy(s, priced, n, waited_s, hand_off, INFINITY, plan);
    if (plan->n_first + plan->n_bulk == 0 && s->idle) { /* take one at the prior's price */
        for (int32_t i = 0; i < n; i++) {
            if (!priced[i].bulk && prior_alone(s, requests[i].rows) <= priced[i].deadline - waited_s - hand_off) {
                plan->refused[i] = 0;
                int32_t kept = 0;
                for (int32_t k = 0; k < plan->n_crowded; k++)
                    if (plan->crowded[k] != i) plan->crowded[kept++] = plan->crowded[k];
                plan->n_crowded = kept;
                plan->first[plan->n_first++] = i;
                break;
            }
        }
    }
    if (plan->n_crowded && plan->n_first) { /* keep the refusals prompt */
        double soonest = priced[plan->crowded[0]].deadline;
        for (int32_t k = 1; k < plan->n_crowded; k++) soonest = py_min(soonest, priced[plan->crowded[k]].deadline);
        greedy(s, priced, n, waited_s, hand_off, soonest / 2 - waited_s / 2 - hand_off, plan);
    }
    PyMem_RawFree(priced);
    return 0;
}

static void finished(Admission *s, double start, double end, int64_t requests, int64_t rows, int64_t scored) {
    if (scored) observe(s, rows, scored, end - start);
    s->has_last = 1;
    s->last_start = start;
    s->last_end = end;
    s->last_requests = requests;
}

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ----- the C face ----- */

static int api_plan(PyObject *admission, const EnsembleAdmitted *requests, int32_t n, double now, EnsemblePlan *plan) {
    Admission *s = (Admission *)admission;
    pthread_mutex_lock(&s->lock);
    const int result = plan_call(s, requests, n, now, plan);
    pthread_mutex_unlock(&s->lock);
    return result;
}

static void api_finished(PyObject *admission, double start, double end, int64_t requests, int64_t rows,
                         int64_t scored) {
    Admission *s = (Admission *)admission;
    pthread_mutex_lock(&s->lock);
    finished(s, start, end, requests, rows, scored);
    pthread_mutex_unlock(&s->lock);
}

static const EnsembleAdmissionApi API = {monotonic_now, api_plan, api_finished};

/* ----- the Python face ----- */

static int copy_text(PyObject *text, char *out, size_t size, const char *what) {
    const char *utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : NULL;
    if (utf8 == NULL || strlen(utf8) >= size) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "Admission: %s must be a str shorter than %zu", what, size);
        return -1;
    }
    strcpy(out, utf8);
    return 0;
}

/* Admission(objective_s, (prior_fixed, prior_per_row, prior_per_request, decay, ridge0, ridge1, xx0, xx1, xx2,
 *           xy0, xy1, fixed, per_row, per_request, tail, hand_decay, hand_seconds, hand_requests),
 *           (refusal_format, objective_text, timeout_text, at_capacity, bulk_text)) */
static PyObject *admission_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    double objective_s;
    PyObject *state, *texts;
    if (!PyArg_ParseTuple(args, "dO!O!:Admission", &objective_s, &PyTuple_Type, &state, &PyTuple_Type, &texts))
        return NULL;
    if (PyTuple_GET_SIZE(state) != 18 || PyTuple_GET_SIZE(texts) != 5) {
        PyErr_SetString(PyExc_ValueError, "Admission: 18 state values and 5 texts");
        return NULL;
    }
    Admission *s = (Admission *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    pthread_mutex_init(&s->lock, NULL);
    double v[18];
    for (int i = 0; i < 18; i++) {
        v[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(state, i));
        if (v[i] == -1.0 && PyErr_Occurred()) goto fail;
    }
    s->objective_s = objective_s;
    s->prior_fixed = v[0], s->prior_per_row = v[1], s->prior_per_request = v[2];
    s->decay = v[3], s->ridge[0] = v[4], s->ridge[1] = v[5];
    s->xx[0] = v[6], s->xx[1] = v[7], s->xx[2] = v[8], s->xy[0] = v[9], s->xy[1] = v[10];
    s->fixed = v[11], s->per_row = v[12], s->per_request = v[13], s->tail = v[14];
    s->hand_decay = v[15], s->hand_seconds = v[16], s->hand_requests = v[17];
    s->idle = 1;
    s->interactive_at = -INFINITY;
    if (copy_text(PyTuple_GET_ITEM(texts, 0), s->refusal_format, sizeof s->refusal_format, "refusal_format") < 0 ||
        copy_text(PyTuple_GET_ITEM(texts, 1), s->objective_text, sizeof s->objective_text, "objective_text") < 0 ||
        copy_text(PyTuple_GET_ITEM(texts, 2), s->timeout_text, sizeof s->timeout_text, "timeout_text") < 0 ||
        copy_text(PyTuple_GET_ITEM(texts, 3), s->at_capacity, sizeof s->at_capacity, "at_capacity") < 0 ||
        copy_text(PyTuple_GET_ITEM(texts, 4), s->bulk_text, sizeof s->bulk_text, "bulk_text") < 0)
        goto fail;
    return (PyObject *)s;
fail:
    Py_DECREF(s);
    return NULL;
}

static void admission_dealloc(PyObject *obj) {
    pthread_mutex_destroy(&((Admission *)obj)->lock);
    Py_TYPE(obj)->tp_free(obj);
}

static PyObject *indices(const int32_t *items, int32_t n) {
    PyObject *out = PyTuple_New(n);
    for (int32_t k = 0; out != NULL && k < n; k++) PyTuple_SET_ITEM(out, k, PyLong_FromLong(items[k]));
    return out;
}

/* plan(rows: tuple[int], timeouts_s: tuple[float], bulk: tuple[bool], now: float)
 *   -> (first, bulk, ((index, message), ...) refused in index order, crowded) */
static PyObject *admission_plan(Admission *self, PyObject *args) {
    PyObject *rows, *timeouts, *bulk;
    double now;
    if (!PyArg_ParseTuple(args, "O!O!O!d", &PyTuple_Type, &rows, &PyTuple_Type, &timeouts, &PyTuple_Type, &bulk, &now))
        return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(rows);
    if (PyTuple_GET_SIZE(timeouts) != n || PyTuple_GET_SIZE(bulk) != n || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "plan: rows, timeouts and bulk must have one item per request");
        return NULL;
    }
    const size_t count = (size_t)(n ? n : 1);
    EnsembleAdmitted *requests = PyMem_Calloc(count, sizeof *requests);
    int32_t *lists = PyMem_Calloc(3 * count, sizeof(int32_t));
    char *refused = PyMem_Calloc(count, 1);
    char(*message)[ENSEMBLE_MESSAGE_SIZE] = PyMem_Calloc(count, ENSEMBLE_MESSAGE_SIZE);
    PyObject *result = NULL;
    if (requests == NULL || lists == NULL || refused == NULL || message == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        requests[i].rows = PyLong_AsLongLong(PyTuple_GET_ITEM(rows, i));
        requests[i].timeout_s = PyFloat_AsDouble(PyTuple_GET_ITEM(timeouts, i));
        requests[i].bulk = PyObject_IsTrue(PyTuple_GET_ITEM(bulk, i));
        if (PyErr_Occurred()) goto done;
    }
    EnsemblePlan plan = {lists, lists + count, lists + 2 * count, 0, 0, 0, refused, message};
    int failed;
    Py_BEGIN_ALLOW_THREADS /* the lock may be held by a call planned in C */
    failed = api_plan((PyObject *)self, requests, (int32_t)n, now, &plan);
    Py_END_ALLOW_THREADS
    if (failed < 0) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *refusals = PyList_New(0);
    for (Py_ssize_t i = 0; refusals != NULL && i < n; i++) {
        if (!refused[i]) continue;
        PyObject *item = Py_BuildValue("(ns)", i, message[i]);
        if (item == NULL || PyList_Append(refusals, item) < 0) Py_CLEAR(refusals);
        Py_XDECREF(item);
    }
    if (refusals != NULL) {
        result = Py_BuildValue("(NNNN)", indices(plan.first, plan.n_first), indices(plan.bulk, plan.n_bulk),
                               PyList_AsTuple(refusals), indices(plan.crowded, plan.n_crowded));
        Py_DECREF(refusals);
    }
done:
    PyMem_Free(requests);
    PyMem_Free(lists);
    PyMem_Free(refused);
    PyMem_Free(message);
    return result;
}

/* finished(start, end, requests, rows, scored) -> None */
static PyObject *admission_finished(Admission *self, PyObject *args) {
    double start, end;
    long long requests, rows, scored;
    if (!PyArg_ParseTuple(args, "ddLLL", &start, &end, &requests, &rows, &scored)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    api_finished((PyObject *)self, start, end, requests, rows, scored);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* state() -> (fixed, per_row, tail, hand-off per request, (last start, end, requests) or None) */
static PyObject *admission_state(Admission *self, PyObject *unused) {
    pthread_mutex_lock(&self->lock); /* held only while a call is planned or recorded */
    const double fixed = self->fixed, per_row = self->per_row, tail = self->tail, hand = hand_per_request(self);
    const int has_last = self->has_last;
    const double start = self->last_start, end = self->last_end;
    const long long requests = (long long)self->last_requests;
    pthread_mutex_unlock(&self->lock);
    PyObject *last = has_last ? Py_BuildValue("(ddL)", start, end, requests) : Py_NewRef(Py_None);
    if (last == NULL) return NULL;
    return Py_BuildValue("(ddddN)", fixed, per_row, tail, hand, last);
}

static PyMethodDef admission_methods[] = {
    {"plan", (PyCFunction)admission_plan, METH_VARARGS,
     "plan(rows, timeouts_s, bulk, now) -> (first, bulk, ((index, message), ...), crowded)"},
    {"finished", (PyCFunction)admission_finished, METH_VARARGS, "finished(start, end, requests, rows, scored)"},
    {"state", (PyCFunction)admission_state, METH_NOARGS,
     "(fixed, per_row, tail, hand-off per request, (start, end, requests) of the last call or None)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AdmissionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._admission.Admission",
    .tp_basicsize = sizeof(Admission),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The ranker's admission in C (see ensemble/serving/admission.py).",
    .tp_methods = admission_methods,
    .tp_new = admission_new,
    .tp_dealloc = admission_dealloc,
};

static PyObject *now(PyObject *self, PyObject *unused) { return PyFloat_FromDouble(monotonic_now()); }

static PyMethodDef methods[] = {
    {"now", now, METH_NOARGS, "the clock plan and finished take (CLOCK_MONOTONIC, seconds)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_admission", .m_doc = "The ranker's admission in C.",
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__admission(void) {
    if (PyType_Ready(&AdmissionType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_ADMISSION_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Admission", (PyObject *)&AdmissionType) < 0 ||
        PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
