/* Shadow scoring (see backend_internal.h): during an experiment with a shadow share, the gateway sends a
 * sample of the serving release's requests with an "ensemble-shadow" header naming the candidates
 * (ensemble/fleet/gateway.py). The serving version answers such a request as any other, then scores
 * its rows again with each candidate's chain, loaded in this process as another version of the same
 * model, and records how far each row's score moved: ensemble_shadow_score_difference{model, version,
 * candidate}, a histogram of |candidate - serving| per row. The rank model (Python) reports the same
 * for ranking requests, and the share of the serving release's top k that the candidate's top k keeps:
 * ensemble_shadow_top_k_overlap. ensemble_shadow_requests_total{..., outcome} counts the shadowed
 * requests: scored, or missing (the candidate is not loaded here) or failed.
 *
 * The answer is sent before the shadow work starts, so a shadowed request's own latency does not grow;
 * the work delays only what waits behind it on the model thread. A candidate's chain is found through
 * the interpreter (ensemble.serving.embedded.shadow_chain: each release's version folder holds its own
 * copy of this library, so C state is not shared between versions; the interpreter is) and held by a
 * reference while it scores, so a version that unloads meanwhile cannot take it away. */
#include <math.h>

#include "backend_internal.h"

#define SHADOW_CANDIDATES 4 /* candidates one request can name */

enum { SHADOW_DIFFERENCE, SHADOW_OVERLAP, SHADOW_SCORED, SHADOW_MISSING, SHADOW_FAILED, SHADOW_KINDS };

static pthread_mutex_t series_lock = PTHREAD_MUTEX_INITIALIZER;

static TRITONSERVER_MetricFamily *difference_family, *overlap_family, *requests_family;
static pthread_once_t families_once = PTHREAD_ONCE_INIT;

/* Bucket bounds: score differences (probabilities, so at most 1) and overlaps (shares, 0 to 1). */
static const double difference_buckets[] = {1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0};
static const double overlap_buckets[] = {0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};

static void families(void) {
    struct {
        TRITONSERVER_MetricFamily **family;
        TS_MetricKind kind;
        const char *name, *help;
    } specs[] = {
        {&difference_family, TS_METRIC_HISTOGRAM, "ensemble_shadow_score_difference",
         "|candidate score - serving score| per row of the requests shadowed during an experiment"},
        {&overlap_family, TS_METRIC_HISTOGRAM, "ensemble_shadow_top_k_overlap",
         "share of the serving release's top k that the candidate's top k keeps, per shadowed ranking request"},
        {&requests_family, TS_METRIC_COUNTER, "ensemble_shadow_requests_total",
         "requests shadowed during an experiment, by outcome: scored, missing (the candidate is not loaded "
         "here), failed"},
    };
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++)
        *specs[k].family = new_family(specs[k].kind, specs[k].name, specs[k].help);
}

void shadow_register(ModelState *state) {
    state->shadow_updates = PyObject_GetAttrString(state->model, "shadow_updates");
    if (state->shadow_updates == NULL) PyErr_Clear(); /* a model that reports no shadow scoring of its own */
    if (state->chain == NULL) return; /* no C path: nothing to shadow in C */
    PyObject *module = PyImport_ImportModule(ENTRY_MODULE);
    state->shadow_chain = module ? PyObject_GetAttrString(module, "shadow_chain") : NULL;
    if (state->shadow_chain == NULL) PyErr_Clear();
    Py_XDECREF(module);
}

/* The series of `kind` for `candidate` of this version, created on first use (NULL: it cannot be). */
static TRITONSERVER_Metric *series(ModelState *state, int kind, uint64_t candidate) {
    pthread_once(&families_once, families);
    pthread_mutex_lock(&series_lock);
    TRITONSERVER_Metric *found = NULL;
    for (int k = 0; k < state->n_shadow && found == NULL; k++)
        if (state->shadow[k].kind == kind && state->shadow[k].candidate == candidate) found = state->shadow[k].metric;
    if (found == NULL && state->n_shadow < SHADOW_SERIES) {
        static const char *const outcomes[] = {"scored", "missing", "failed"};
        TRITONSERVER_MetricFamily *family = kind == SHADOW_DIFFERENCE ? difference_family
                                            : kind == SHADOW_OVERLAP  ? overlap_family
                                                                      : requests_family;
        char candidate_text[24];
        snprintf(candidate_text, sizeof candidate_text, "%llu", (unsigned long long)candidate);
        const char *names[] = {"model", "version", "candidate", "outcome"};
        const char *values[] = {state->metric_model, state->metric_version, candidate_text,
                                kind >= SHADOW_SCORED ? outcomes[kind - SHADOW_SCORED] : NULL};
        if (family != NULL && kind >= SHADOW_SCORED) {
            found = labelled(family, names, values, 4, 0.0);
        } else if (family != NULL) {
            const bool difference = kind == SHADOW_DIFFERENCE;
            found = labelled_histogram(family, names, values, 3, difference ? difference_buckets : overlap_buckets,
                                       difference ? sizeof difference_buckets / sizeof(double)
                                                  : sizeof overlap_buckets / sizeof(double));
        }
        if (found != NULL) {
            state->shadow[state->n_shadow].kind = kind;
            state->shadow[state->n_shadow].candidate = candidate;
            state->shadow[state->n_shadow++].metric = found;
        }
    }
    pthread_mutex_unlock(&series_lock);
    return found;
}

static void observe(ModelState *state, int kind, uint64_t candidate, double value) {
    TRITONSERVER_Metric *metric = series(state, kind, candidate);
    if (metric == NULL) return;
    TRITONSERVER_Error *err = kind >= SHADOW_SCORED ? TRITONSERVER_MetricIncrement(metric, value)
                                                    : TRITONSERVER_MetricObserve(metric, value);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* Each candidate's chain, held (a reference each; NULL: that version is not loaded here with a chain). */
static void candidate_chains(ModelState *state, const uint64_t *candidates, int n, PyObject **chains) {
    PyGILState_STATE gil = PyGILState_Ensure();
    for (int c = 0; c < n; c++) {
        PyObject *chain = PyObject_CallFunction(state->shadow_chain, "K", (unsigned long long)candidates[c]);
        if (chain == NULL) PyErr_Clear();
        if (chain == Py_None || (chain != NULL && state->chain_api->outputs(chain) < 1)) Py_CLEAR(chain);
        chains[c] = chain;
    }
    PyGILState_Release(gil);
}

/* What shadow scoring needs of a plain request, copied before its answer is sent: once the answer has
 * gone, Triton's front end may reuse the memory the request's inputs are in. */
struct ShadowWork {
    int n;
    uint64_t candidates[SHADOW_CANDIDATES];
    int64_t rows;
    uint64_t wire_size;
    float *dense, *serving; /* [rows x dense width], the serving release's blended scores [rows] */
    unsigned char *wire;
};

ShadowWork *shadow_take(ModelState *state, const PlainRequest *request, const float *scores, int64_t offset) {
    if (state->shadow_chain == NULL) return NULL;
    ShadowWork *work = calloc(1, sizeof *work);
    if (work == NULL) return NULL;
    const char *cursor = request->shadow;
    while (work->n < SHADOW_CANDIDATES && backend_shadow_next(&cursor, &work->candidates[work->n])) work->n++;
    const int64_t rows = request->rows;
    work->rows = rows;
    work->wire_size = request->size[1];
    work->dense = malloc(request->size[0] ? (size_t)request->size[0] : 1);
    work->serving = malloc((size_t)rows * sizeof(float));
    work->wire = malloc(work->wire_size ? (size_t)work->wire_size : 1);
    if (work->n == 0 || work->dense == NULL || work->serving == NULL || work->wire == NULL) {
        shadow_drop(work);
        return NULL;
    }
    memcpy(work->dense, request->data[0], (size_t)request->size[0]);
    memcpy(work->wire, request->data[1], (size_t)work->wire_size);
    memcpy(work->serving, scores + offset, (size_t)rows * sizeof(float)); /* row r's blended score: output 0 */
    return work;
}

void shadow_drop(ShadowWork *work) {
    if (work == NULL) return;
    free(work->dense);
    free(work->serving);
    free(work->wire);
    free(work);
}

void shadow_run(ModelState *state, ShadowWork *work) {
    PyObject *chains[SHADOW_CANDIDATES];
    candidate_chains(state, work->candidates, work->n, chains);
    const float *dense = work->dense;
    const unsigned char *wire = work->wire;
    for (int c = 0; c < work->n; c++) {
        int outcome = SHADOW_MISSING;
        float *theirs = NULL;
        if (chains[c] != NULL) { /* scored without the interpreter's lock, as the C path scores */
            char text[ENSEMBLE_ERROR_SIZE] = "out of memory";
            const int64_t outputs = state->chain_api->outputs(chains[c]);
            theirs = malloc((size_t)work->rows * (size_t)outputs * sizeof(float));
            outcome = theirs != NULL && state->chain_api->score(chains[c], 1, &dense, &wire, &work->wire_size,
                                                                &work->rows, 1, theirs, text, sizeof text, 0.0) == 0
                          ? SHADOW_SCORED
                          : SHADOW_FAILED;
            if (outcome == SHADOW_FAILED) {
                char line[ENSEMBLE_ERROR_SIZE + 120];
                snprintf(line, sizeof line, "model '%s' version %s: shadow scoring with release %llu failed: %s",
                         state->metric_model, state->metric_version, (unsigned long long)work->candidates[c], text);
                log_line(TS_LOG_WARN, line);
            }
        }
        if (outcome == SHADOW_SCORED) /* row r's blended score: row r of output 0 */
            for (int64_t r = 0; r < work->rows; r++)
                observe(state, SHADOW_DIFFERENCE, work->candidates[c], fabs((double)theirs[r] - (double)work->serving[r]));
        observe(state, outcome, work->candidates[c], 1.0);
        free(theirs);
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    for (int c = 0; c < work->n; c++) Py_XDECREF(chains[c]);
    PyGILState_Release(gil);
    shadow_drop(work);
}

/* After a call through the model's execute, with the interpreter's lock held: what its shadow_updates
 * reports, ((candidate, kind, value), ...) with kind 0 a score difference, 1 a top-k overlap, 2-4 a
 * request's outcome, into the series. */
void shadow_python(ModelState *state) {
    if (state->shadow_updates == NULL) return;
    PyObject *updates = PyObject_CallNoArgs(state->shadow_updates);
    if (updates == NULL || !PyTuple_Check(updates)) {
        PyErr_Clear();
        Py_XDECREF(updates);
        return;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(updates); i++) {
        unsigned long long candidate;
        int kind;
        double value;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(updates, i), "Kid", &candidate, &kind, &value)) {
            PyErr_Clear();
            continue;
        }
        if (kind >= 0 && kind < SHADOW_KINDS && candidate > 0 && isfinite(value)) observe(state, kind, candidate, value);
    }
    Py_DECREF(updates);
}

void shadow_series_delete(ModelState *state) {
    for (int k = 0; k < state->n_shadow; k++) {
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->shadow[k].metric);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    state->n_shadow = 0;
}
