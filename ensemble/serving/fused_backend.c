/* The fused ranker as a Triton backend of the project's own: Triton loads it into its own process
 * (``libtriton_fused.so`` in the model's folder, ``backend: "fused"`` in its config), so a request
 * reaches the ranker without the python backend's stub process and its shared-memory round trip.
 *
 * The ranker's model code runs in a Python interpreter embedded here (ensemble.serving.embedded):
 * this file moves tensors between Triton and that code, answers each request, and reports the
 * statistics Triton's metrics and perf_analyzer read. A call of ordinary requests (see "a plain call"
 * below) is planned and scored in C, with no Python call and without the interpreter's lock, through
 * the C entry points the model's modules hand over at load (ensemble/kernel_api.h: the admission
 * policy and the whole chain, checked at load against the Python chain to the bit); when the model has
 * no such path, it costs one Python call that returns one score array; any other call goes through the
 * model's execute.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "backend_checks.h"
#include "kernel_api.h"
#include "triton_api.h"

#ifndef PYTHON_LIBRARY /* setup.py names the one this interpreter was built with */
#define PYTHON_LIBRARY "libpython3.11.so.1.0"
#endif
#define ENTRY_MODULE "ensemble.serving.embedded"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static TRITONSERVER_Error *fail(TS_ErrorCode code, const char *format, ...) {
    char message[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    return TRITONSERVER_ErrorNew(code, message);
}

static void log_line(TS_LogLevel level, const char *message) {
    TRITONSERVER_Error *err = TRITONSERVER_LogMessage(level, __FILE__, __LINE__, message);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* The pending Python exception as text (and cleared), for an error message. */
static void python_error_text(char *out, size_t size) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    const char *text = "unknown Python error";
    PyObject *str = value ? PyObject_Str(value) : NULL;
    PyObject *name = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    if (str && PyUnicode_Check(str)) text = PyUnicode_AsUTF8(str);
    snprintf(out, size, "%s: %s", name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : "Error",
             text ? text : "");
    Py_XDECREF(str);
    Py_XDECREF(name);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
}

/* ----- the interpreter ----- */

/* The first python3 on PATH: the launcher puts the project's virtual environment there, which the
 * interpreter then finds through its pyvenv.cfg (the python backend's stub finds it the same way). */
static int find_python(char *out, size_t size) {
    const char *path = getenv("PATH");
    if (path == NULL) return -1;
    const char *start = path;
    while (*start) {
        const char *end = strchr(start, ':');
        size_t length = end ? (size_t)(end - start) : strlen(start);
        if (length > 0 && length + 9 < size) {
            memcpy(out, start, length);
            strcpy(out + length, "/python3");
            if (access(out, X_OK) == 0) return 0;
        }
        if (end == NULL) break;
        start = end + 1;
    }
    return -1;
}

static TRITONSERVER_Error *python_start(void) {
    if (Py_IsInitialized()) return NULL;
    /* Triton opened this library with its symbols local; Python's extension modules (numpy, torch)
     * expect the interpreter's symbols to be global. */
    if (dlopen(PYTHON_LIBRARY, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL) == NULL)
        return fail(TS_ERROR_INTERNAL, "cannot make %s global: %s", PYTHON_LIBRARY, dlerror());
    char executable[4096];
    if (find_python(executable, sizeof executable) != 0)
        return fail(TS_ERROR_INTERNAL, "no python3 on PATH (the launcher puts the project's there)");
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* signals stay Triton's */
    config.parse_argv = 0;
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, executable);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status))
        return fail(TS_ERROR_INTERNAL, "Python did not start: %s", status.err_msg ? status.err_msg : "?");
    PyEval_SaveThread(); /* the lock is taken per call from here on */
    return NULL;
}

/* ----- model and instance state ----- */

#define PLAIN_INPUTS 4   /* the most inputs a plain call may have */
#define PLAIN_OUTPUTS 16 /* the most outputs it may answer */
#define ENGINE_METRICS 8 /* series of the engine metrics one model version holds */
#define MODEL_SERIES 16  /* series of the model's own counters one model version holds */

typedef struct {
    PyObject *model;        /* ensemble.serving.embedded.Model */
    int n_inputs;
    char **input_names;
    /* The plain path (see plain_execute), when the model has one: its Python calls, each input's
     * type and width (in input_names order), and the names of the score array's rows. */
    PyObject *plain_score, *plain_finish;
    TS_DataType plain_type[PLAIN_INPUTS];
    int64_t plain_width[PLAIN_INPUTS];
    int n_outputs;
    char *output_names[PLAIN_OUTPUTS];
    /* The plain path in C (see native_execute), when the model offers it: the chain and the admission
     * policy (None: none), held, read through their modules' entry points; and from how many rows the
     * chain scores a call on two threads (0: never). */
    PyObject *chain, *admission;
    const EnsembleChainApi *chain_api;
    const EnsembleAdmissionApi *admission_api;
    int64_t split_rows;
    /* The nice value the model's instance threads take on their first call (0: left as they are). */
    int thread_nice;
    /* When a call last held an interactive request (now_ns; 0: never): bulk requests go to the bulk
     * lane while one did within the last LANE_YIELD_NS. Written and read with __atomic builtins. */
    uint64_t interactive_ns;
    /* This version's ensemble_engine_info and ensemble_engine_undeclared series, one pair per DLRM step. */
    int n_metrics;
    TRITONSERVER_Metric *metrics[ENGINE_METRICS];
    /* The model's own counters (see model_metrics), when it has any: its metric_updates method and the
     * series created so far. */
    PyObject *metric_updates;
    char metric_model[128], metric_version[24];
    int n_series;
    struct {
        int family;
        char label[32];
        TRITONSERVER_Metric *metric;
    } series[MODEL_SERIES];
} ModelState;

/* The plain path in C from the model's chain and admission objects (None: none), when both modules
 * offer their entry points; else nothing is set. */
static void native_spec(ModelState *state, PyObject *chain, PyObject *admission, long long split_rows) {
    if (chain == Py_None) return;
    const EnsembleChainApi *chain_api = PyCapsule_Import(ENSEMBLE_CHAIN_CAPSULE, 0);
    const EnsembleAdmissionApi *admission_api =
        admission == Py_None ? NULL : PyCapsule_Import(ENSEMBLE_ADMISSION_CAPSULE, 0);
    if (chain_api == NULL || (admission != Py_None && admission_api == NULL) ||
        chain_api->outputs(chain) != state->n_outputs) {
        PyErr_Clear();
        log_line(TS_LOG_WARN, "the installed modules offer no C entry points of version " ENSEMBLE_API_VERSION
                              " (this backend was built by another install of the project: export the release "
                              "again); plain calls are scored through Python");
        return;
    }
    state->chain = Py_NewRef(chain);
    state->admission = admission == Py_None ? NULL : Py_NewRef(admission);
    state->chain_api = chain_api;
    state->admission_api = admission_api;
    state->split_rows = split_rows;
}

/* The model's plain path from its ``plain`` attribute (None: it has none; then nothing is set). */
static void plain_spec(ModelState *state, const char *name) {
    PyObject *spec = PyObject_GetAttrString(state->model, "plain");
    if (spec == NULL) PyErr_Clear();
    PyObject *score, *finish, *inputs, *outputs, *chain, *admission;
    long long split_rows;
    if (spec == NULL || spec == Py_None ||
        !PyArg_ParseTuple(spec, "OOO!O!OOL", &score, &finish, &PyTuple_Type, &inputs, &PyTuple_Type, &outputs, &chain,
                          &admission, &split_rows)) {
        PyErr_Clear();
        Py_XDECREF(spec);
        return;
    }
    bool usable = PyTuple_GET_SIZE(inputs) == state->n_inputs && state->n_inputs <= PLAIN_INPUTS &&
                  PyTuple_GET_SIZE(outputs) <= PLAIN_OUTPUTS;
    for (int i = 0; usable && i < state->n_inputs; i++) {
        int type;
        long long width;
        usable = PyArg_ParseTuple(PyTuple_GET_ITEM(inputs, i), "iL", &type, &width) &&
                 (type == TS_TYPE_FP32 || type == TS_TYPE_BYTES) && width > 0;
        state->plain_type[i] = (TS_DataType)type;
        state->plain_width[i] = width;
    }
    for (Py_ssize_t k = 0; usable && k < PyTuple_GET_SIZE(outputs); k++) {
        const char *name = PyUnicode_Check(PyTuple_GET_ITEM(outputs, k)) ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(outputs, k)) : NULL;
        usable = name != NULL;
        if (name) state->output_names[state->n_outputs++] = strdup(name);
    }
    PyErr_Clear();
    if (usable) {
        state->plain_score = Py_NewRef(score);
        state->plain_finish = Py_NewRef(finish);
        native_spec(state, chain, admission, split_rows);
        char line[300];
        snprintf(line, sizeof line, "model '%s': plain calls are answered from one score array, %s", name,
                 state->chain ? "planned and scored in C" : "scored by score_plain");
        log_line(TS_LOG_INFO, line);
    }
    Py_DECREF(spec);
}

/* ----- the model's own counters -----
 *
 * A model whose Python object has `metric_updates` (the rank model's online-store lookups:
 * ensemble/serving/embedded.py) reports counters through Triton's metrics: after each call the backend
 * takes (family, label, increment) triples from it, each family one of MODEL_FAMILIES, and adds them to
 * the family's series {model, version[, outcome]}. The series go when the version unloads. */
typedef struct {
    const char *name, *help;
} ModelFamily;
static const ModelFamily model_family_specs[] = {
    {"ensemble_store_entities_total",
     "entities a ranking request by ids named, by outcome: cache_hit, store_hit, unknown_user, unknown_item, "
     "stale_served, stale_refused"},
    {"ensemble_store_failures_total", "ranking requests by ids refused because the online store did not answer"},
    {"ensemble_store_round_trips_total", "round trips to the online store (one MGET, or one per cluster node)"},
    {"ensemble_store_round_trip_seconds_total", "seconds spent in round trips to the online store"},
};
#define MODEL_FAMILIES ((int)(sizeof model_family_specs / sizeof model_family_specs[0]))
static TRITONSERVER_MetricFamily *model_families[MODEL_FAMILIES];
static pthread_once_t model_families_once = PTHREAD_ONCE_INIT;

static void create_model_families(void) {
    for (int f = 0; f < MODEL_FAMILIES; f++) {
        TRITONSERVER_Error *err = TRITONSERVER_MetricFamilyNew(&model_families[f], TS_METRIC_COUNTER,
                                                               model_family_specs[f].name, model_family_specs[f].help);
        if (err) {
            TRITONSERVER_ErrorDelete(err);
            model_families[f] = NULL;
        }
    }
}

/* The series of (family, label) of this version, created on first use; NULL when it cannot be. */
static TRITONSERVER_Metric *labelled(TRITONSERVER_MetricFamily *family, const char *const *names,
                                     const char *const *values, int count, double value);

static TRITONSERVER_Metric *model_series(ModelState *state, int family, const char *label) {
    for (int k = 0; k < state->n_series; k++)
        if (state->series[k].family == family && strcmp(state->series[k].label, label) == 0)
            return state->series[k].metric;
    if (state->n_series >= MODEL_SERIES || model_families[family] == NULL || strlen(label) >= 32) return NULL;
    const char *names[] = {"model", "version", "outcome"};
    const char *values[] = {state->metric_model, state->metric_version, label};
    TRITONSERVER_Metric *metric = labelled(model_families[family], names, values, label[0] ? 3 : 2, 0.0);
    if (metric == NULL) return NULL;
    state->series[state->n_series].family = family;
    snprintf(state->series[state->n_series].label, 32, "%s", label);
    state->series[state->n_series++].metric = metric;
    return metric;
}

/* After a call, with the interpreter's lock held: the model's counter increments to its series. */
static void model_metrics(ModelState *state) {
    if (state->metric_updates == NULL) return;
    PyObject *updates = PyObject_CallNoArgs(state->metric_updates);
    if (updates == NULL || !PyTuple_Check(updates) || PyTuple_GET_SIZE(updates) == 0) {
        PyErr_Clear();
        Py_XDECREF(updates);
        return;
    }
    TRITONSERVER_Error *err = NULL;
    pthread_once(&model_families_once, create_model_families);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(updates); i++) {
        int family;
        const char *label;
        double increment;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(updates, i), "isd", &family, &label, &increment)) {
            PyErr_Clear();
            continue;
        }
        if (family < 0 || family >= MODEL_FAMILIES || !(increment > 0)) continue;
        TRITONSERVER_Metric *metric = model_series(state, family, label);
        if (metric && (err = TRITONSERVER_MetricIncrement(metric, increment))) TRITONSERVER_ErrorDelete(err);
    }
    Py_DECREF(updates);
}

/* ----- which engine scores each DLRM step, as metrics -----
 *
 * ensemble_engine_info{model, version, step, engine, declared} is 1 per DLRM step of a loaded version
 * (engine: what scores it here; declared: what its release declares, ensemble/models/engines.py), and
 * ensemble_engine_undeclared{model, version, step} is 1 when the two differ (the load logged why), else 0:
 * what an alert watches. The series go when the version unloads. */
static TRITONSERVER_MetricFamily *engine_info_family, *engine_undeclared_family;

static TRITONSERVER_Metric *labelled(TRITONSERVER_MetricFamily *family, const char *const *names,
                                     const char *const *values, int count, double value) {
    const TRITONSERVER_Parameter *labels[5];
    for (int k = 0; k < count; k++) labels[k] = TRITONSERVER_ParameterNew(names[k], TS_PARAMETER_STRING, values[k]);
    TRITONSERVER_Metric *metric = NULL;
    TRITONSERVER_Error *err = TRITONSERVER_MetricNew(&metric, family, labels, (uint64_t)count);
    for (int k = 0; k < count; k++) TRITONSERVER_ParameterDelete((TRITONSERVER_Parameter *)labels[k]);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return NULL;
    }
    if ((err = TRITONSERVER_MetricSet(metric, value))) TRITONSERVER_ErrorDelete(err);
    return metric;
}

/* The series of the model's engines attribute ((step, engine, declared) tuples), when it has one. Called
 * with the interpreter's lock held. */
static void engine_metrics(ModelState *state, const char *name, uint64_t version) {
    PyObject *engines = PyObject_GetAttrString(state->model, "engines");
    if (engines == NULL || !PyTuple_Check(engines)) {
        PyErr_Clear();
        Py_XDECREF(engines);
        return;
    }
    TRITONSERVER_Error *err = NULL;
    if (engine_info_family == NULL &&
        (err = TRITONSERVER_MetricFamilyNew(&engine_info_family, TS_METRIC_GAUGE, "ensemble_engine_info",
                                            "1 per DLRM step: the engine that scores it here and the one its "
                                            "release declares")) == NULL)
        err = TRITONSERVER_MetricFamilyNew(&engine_undeclared_family, TS_METRIC_GAUGE, "ensemble_engine_undeclared",
                                           "1 when a DLRM step does not score with the engine its release declares");
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        log_line(TS_LOG_WARN, "the engine metrics could not be created");
        Py_DECREF(engines);
        return;
    }
    char version_text[24];
    snprintf(version_text, sizeof version_text, "%llu", (unsigned long long)version);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(engines) && state->n_metrics + 2 <= ENGINE_METRICS; i++) {
        const char *step, *engine, *declared;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(engines, i), "sss", &step, &engine, &declared)) {
            PyErr_Clear();
            continue;
        }
        const char *info_names[] = {"model", "version", "step", "engine", "declared"};
        const char *info_values[] = {name, version_text, step, engine, declared};
        TRITONSERVER_Metric *info = labelled(engine_info_family, info_names, info_values, 5, 1.0);
        TRITONSERVER_Metric *off = labelled(engine_undeclared_family, info_names, info_values, 3,
                                            strcmp(engine, declared) != 0 && strcmp(declared, "none") != 0);
        if (info) state->metrics[state->n_metrics++] = info;
        if (off) state->metrics[state->n_metrics++] = off;
    }
    Py_DECREF(engines);
}

TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend) {
    (void)backend;
    uint32_t major, minor;
    TRITONSERVER_Error *err = TRITONBACKEND_ApiVersion(&major, &minor);
    if (err) return err;
    if (major != ENSEMBLE_BACKEND_API_MAJOR || minor < ENSEMBLE_BACKEND_API_MINOR)
        return fail(TS_ERROR_UNSUPPORTED, "the fused backend needs backend API %d.%d+, this Triton has %u.%u",
                    ENSEMBLE_BACKEND_API_MAJOR, ENSEMBLE_BACKEND_API_MINOR, major, minor);
    return python_start();
}

TRITONSERVER_Error *TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model *model) {
    const char *name, *repository, *config_json;
    uint64_t version;
    size_t config_size;
    TB_ArtifactType artifact;
    TRITONSERVER_Message *config;
    TRITONSERVER_Error *err;
    if ((err = TRITONBACKEND_ModelName(model, &name))) return err;
    if ((err = TRITONBACKEND_ModelVersion(model, &version))) return err;
    if ((err = TRITONBACKEND_ModelRepository(model, &artifact, &repository))) return err;
    if ((err = TRITONBACKEND_ModelConfig(model, 1, &config))) return err;
    if ((err = TRITONSERVER_MessageSerializeToJson(config, &config_json, &config_size))) {
        TRITONSERVER_MessageDelete(config);
        return err;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    ModelState *state = calloc(1, sizeof *state);
    PyObject *module = PyImport_ImportModule(ENTRY_MODULE);
    if (module) {
        state->model = PyObject_CallMethod(module, "Model", "s#sK", config_json, (Py_ssize_t)config_size,
                                           repository, (unsigned long long)version);
        Py_DECREF(module);
    }
    TRITONSERVER_MessageDelete(config);
    if (state->model) {
        PyObject *names = PyObject_GetAttrString(state->model, "input_names");
        if (names && PyTuple_Check(names)) {
            state->n_inputs = (int)PyTuple_GET_SIZE(names);
            state->input_names = calloc(state->n_inputs, sizeof(char *));
            for (int i = 0; i < state->n_inputs; i++)
                state->input_names[i] = strdup(PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, i)));
        }
        Py_XDECREF(names);
        if (state->input_names) plain_spec(state, name);
        PyObject *nice = PyObject_GetAttrString(state->model, "thread_nice");
        if (nice == NULL) PyErr_Clear(); /* a model without the attribute: threads left as they are */
        else if (PyLong_Check(nice)) state->thread_nice = (int)PyLong_AsLong(nice);
        Py_XDECREF(nice);
        engine_metrics(state, name, version);
        state->metric_updates = PyObject_GetAttrString(state->model, "metric_updates");
        if (state->metric_updates == NULL) PyErr_Clear(); /* a model without counters of its own */
        snprintf(state->metric_model, sizeof state->metric_model, "%s", name);
        snprintf(state->metric_version, sizeof state->metric_version, "%llu", (unsigned long long)version);
    }
    if (state->model == NULL || state->input_names == NULL) {
        char text[900];
        python_error_text(text, sizeof text);
        Py_XDECREF(state->model);
        free(state);
        PyGILState_Release(gil);
        return fail(TS_ERROR_INTERNAL, "model '%s' version %llu did not load: %s", name,
                    (unsigned long long)version, text);
    }
    PyGILState_Release(gil);
    return TRITONBACKEND_ModelSetState(model, state);
}

TRITONSERVER_Error *TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model *model) {
    void *raw;
    TRITONSERVER_Error *err = TRITONBACKEND_ModelState(model, &raw);
    if (err) return err;
    ModelState *state = raw;
    if (state == NULL) return NULL; /* Triton finalizes a model whose initialization failed, too */
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = PyObject_CallMethod(state->model, "close", NULL);
    if (result == NULL) PyErr_Clear();
    Py_XDECREF(result);
    Py_XDECREF(state->plain_score);
    Py_XDECREF(state->plain_finish);
    Py_XDECREF(state->chain);
    Py_XDECREF(state->admission);
    Py_XDECREF(state->metric_updates);
    Py_DECREF(state->model);
    PyGILState_Release(gil);
    for (int k = 0; k < state->n_metrics; k++) {
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->metrics[k]);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    for (int k = 0; k < state->n_series; k++) {
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->series[k].metric);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    for (int k = 0; k < state->n_outputs; k++) free(state->output_names[k]);
    for (int i = 0; i < state->n_inputs; i++) free(state->input_names[i]);
    free(state->input_names);
    free(state);
    return NULL;
}

/* ----- statistics, reported off the answering thread -----
 *
 * Triton updates its latency summaries (the Prometheus quantile estimators behind the *_summary_us
 * metrics) inside TRITONBACKEND_ModelInstanceReportStatistics, and every so often that update takes
 * milliseconds. Made on the thread that answers, it holds up the next request (the served p99 of
 * one-row requests). So each instance hands its answered requests' statistics, and their release, to
 * a reporter thread of the lowest priority (SCHED_IDLE), which runs when the answering thread waits.
 * When the reporter falls behind (a full queue: a saturated core), the answering thread reports
 * itself, so the memory held by unreleased requests stays bounded. Statistics therefore trail the
 * answers by as long as the reporter waits for a free core. A server allowed only one core (taskset)
 * reports on the answering thread: there the reporter would compete for the same core,
 * and measured with a closed loop on one core its tail was longer, not shorter. */

#define REPORT_QUEUE 1024
#define REPORT_BATCH 64 /* reports taken from the queue per lock */

typedef struct {
    TRITONBACKEND_Request *request; /* NULL: the call's batch statistics (rows) */
    bool success;
    uint64_t rows, exec_start, compute_start, compute_end, exec_end;
} Report;

typedef struct {
    TRITONBACKEND_ModelInstance *instance;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    bool running, stop;
    size_t head, count;
    Report queue[REPORT_QUEUE];
} Reporter;

static void report_now(TRITONBACKEND_ModelInstance *instance, const Report *report) {
    TRITONSERVER_Error *err;
    if (report->request == NULL) {
        err = TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, report->rows, report->exec_start,
                                                               report->compute_start, report->compute_end,
                                                               report->exec_end);
        if (err) TRITONSERVER_ErrorDelete(err);
        return;
    }
    err = TRITONBACKEND_ModelInstanceReportStatistics(instance, report->request, report->success,
                                                      report->exec_start, report->compute_start,
                                                      report->compute_end, report->exec_end);
    if (err) TRITONSERVER_ErrorDelete(err);
    err = TRITONBACKEND_RequestRelease(report->request, TS_REQUEST_RELEASE_ALL);
    if (err) TRITONSERVER_ErrorDelete(err);
}

static void *reporter_main(void *arg) {
    Reporter *reporter = arg;
    /* SCHED_IDLE: Linux preempts this thread for any ordinary one that wakes (a request's), where a
     * low nice value alone still lets it finish its time slice first. Nice 19 if that is refused. */
    struct sched_param lowest = {0};
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &lowest) != 0)
        setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    Report batch[REPORT_BATCH];
    for (;;) {
        pthread_mutex_lock(&reporter->lock);
        while (reporter->count == 0 && !reporter->stop) pthread_cond_wait(&reporter->wake, &reporter->lock);
        size_t n = 0;
        while (n < REPORT_BATCH && reporter->count > 0) {
            batch[n++] = reporter->queue[reporter->head];
            reporter->head = (reporter->head + 1) % REPORT_QUEUE;
            reporter->count--;
        }
        bool done = n == 0 && reporter->stop;
        pthread_mutex_unlock(&reporter->lock);
        if (done) return NULL;
        for (size_t i = 0; i < n; i++) report_now(reporter->instance, &batch[i]);
    }
}

/* Whether this thread may run on more than one core (checked per call: taskset can change it). */
static bool another_core(void) {
    cpu_set_t cores;
    return sched_getaffinity(0, sizeof cores, &cores) == 0 && CPU_COUNT(&cores) > 1;
}

/* Hands a report to the reporter, or makes it here when there is none or its queue is full. */
static void report(Reporter *reporter, TRITONBACKEND_ModelInstance *instance, const Report *item) {
    if (reporter != NULL && reporter->running) {
        pthread_mutex_lock(&reporter->lock);
        if (reporter->count < REPORT_QUEUE) {
            reporter->queue[(reporter->head + reporter->count) % REPORT_QUEUE] = *item;
            if (reporter->count++ == 0) pthread_cond_signal(&reporter->wake);
            pthread_mutex_unlock(&reporter->lock);
            return;
        }
        pthread_mutex_unlock(&reporter->lock);
    }
    report_now(instance, item);
}

/* Ends a worker thread (the reporter, a bulk lane): sets its stop flag under its lock, wakes it and
 * waits for it; the worker finishes what it holds before it returns. */
static void stop_worker(pthread_mutex_t *lock, pthread_cond_t *wake, bool *stop, pthread_t thread) {
    pthread_mutex_lock(lock);
    *stop = true;
    pthread_cond_signal(wake);
    pthread_mutex_unlock(lock);
    pthread_join(thread, NULL);
}

/* A model instance's state: its reporter (NULL: reports are made on the answering thread) and its
 * bulk lane (NULL until a call first hands it a request; see "the bulk lane" below). */
typedef struct Lane Lane;
typedef struct {
    Reporter *reporter;
    Lane *lane;
} Instance;

static void lane_stop(Lane *lane);

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance *instance) {
    Instance *state = calloc(1, sizeof *state);
    if (state == NULL) return fail(TS_ERROR_INTERNAL, "out of memory for a model instance");
    Reporter *reporter = calloc(1, sizeof *reporter);
    if (reporter != NULL) { /* without one, statistics are reported on the answering thread */
        reporter->instance = instance;
        pthread_mutex_init(&reporter->lock, NULL);
        pthread_cond_init(&reporter->wake, NULL);
        reporter->running = pthread_create(&reporter->thread, NULL, reporter_main, reporter) == 0;
        state->reporter = reporter;
    }
    return TRITONBACKEND_ModelInstanceSetState(instance, state);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance *instance) {
    void *raw = NULL;
    TRITONSERVER_Error *err = TRITONBACKEND_ModelInstanceState(instance, &raw);
    if (err) return err;
    Instance *state = raw;
    if (state == NULL) return NULL;
    if (state->lane != NULL) lane_stop(state->lane); /* answers every request it holds, reporting through the reporter */
    Reporter *reporter = state->reporter;
    if (reporter != NULL) {
        if (reporter->running) /* the reporter makes every queued report before it ends */
            stop_worker(&reporter->lock, &reporter->wake, &reporter->stop, reporter->thread);
        pthread_cond_destroy(&reporter->wake);
        pthread_mutex_destroy(&reporter->lock);
        free(reporter);
    }
    free(state);
    return NULL;
}

/* ----- a call ----- */

/* One input as Python sees it: (datatype, shape, buffer) or None when the request lacks it. The
 * buffer is a read-only view of Triton's memory (valid until the request is released) or, when the
 * tensor arrived in pieces, a bytes copy. NULL with `problem` set when the input is there but cannot
 * be read here (a buffer in GPU memory, pieces that do not add up to its size, no memory for the copy):
 * the request is then answered with that error. */
static PyObject *input_object(TRITONBACKEND_Request *request, const char *name, PyObject **view, char *problem,
                              size_t problem_size) {
    TRITONBACKEND_Input *input;
    TRITONSERVER_Error *err = TRITONBACKEND_RequestInput(request, name, &input);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        Py_RETURN_NONE;
    }
    const char *input_name;
    TS_DataType datatype;
    const int64_t *shape;
    uint32_t dims, buffers;
    uint64_t size;
    if ((err = TRITONBACKEND_InputProperties(input, &input_name, &datatype, &shape, &dims, &size, &buffers))) {
        TRITONSERVER_ErrorDelete(err);
        Py_RETURN_NONE;
    }
    PyObject *data = NULL;
    uint64_t offset = 0;
    for (uint32_t b = 0; b < buffers; b++) {
        const void *buffer;
        uint64_t buffer_size;
        TS_MemoryType memory = TS_MEMORY_CPU;
        int64_t memory_id = 0;
        if ((err = TRITONBACKEND_InputBuffer(input, b, &buffer, &buffer_size, &memory, &memory_id))) {
            snprintf(problem, problem_size, "input '%s': buffer %u of %u: %s", name, b, buffers,
                     TRITONSERVER_ErrorMessage(err));
            TRITONSERVER_ErrorDelete(err);
            goto fail;
        }
        if (!backend_memory_readable(memory)) {
            snprintf(problem, problem_size, "input '%s' is in GPU memory; this backend reads inputs in CPU memory only",
                     name);
            goto fail;
        }
        if (buffer_size > size - offset) {
            snprintf(problem, problem_size, "input '%s': its buffers hold more than its %llu bytes", name,
                     (unsigned long long)size);
            goto fail;
        }
        if (buffers == 1) {
            data = PyMemoryView_FromMemory((char *)buffer, (Py_ssize_t)buffer_size, PyBUF_READ);
            if (data == NULL) goto no_memory;
            *view = Py_NewRef(data);
        } else {
            if (data == NULL && (data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size)) == NULL) goto no_memory;
            memcpy(PyBytes_AS_STRING(data) + offset, buffer, (size_t)buffer_size);
        }
        offset += buffer_size;
    }
    if (offset != size) {
        snprintf(problem, problem_size, "input '%s': its buffers hold %llu of its %llu bytes", name,
                 (unsigned long long)offset, (unsigned long long)size);
        goto fail;
    }
    if (data == NULL && (data = PyBytes_FromStringAndSize(NULL, 0)) == NULL) goto no_memory;
    PyObject *shape_tuple = PyTuple_New(dims);
    for (uint32_t d = 0; shape_tuple != NULL && d < dims; d++) {
        PyObject *extent = PyLong_FromLongLong(shape[d]);
        if (extent == NULL) Py_CLEAR(shape_tuple);
        else PyTuple_SET_ITEM(shape_tuple, d, extent);
    }
    if (shape_tuple == NULL) goto no_memory;
    PyObject *result = Py_BuildValue("(iNN)", (int)datatype, shape_tuple, data);
    if (result != NULL) return result;
    data = NULL; /* taken by Py_BuildValue, failed or not */
no_memory:
    python_error_text(problem, problem_size);
fail:
    Py_XDECREF(data);
    if (problem[0] == '\0') snprintf(problem, problem_size, "input '%s' could not be read", name);
    return NULL;
}

/* The request's "bulk" flag and its "ensemble-release" parameter (the release a fleet's gateway routed
 * it to, forwarded from its header by tritonserver; NULL when absent), valid during the request. */
static int request_parameters(TRITONBACKEND_Request *request, const char **release) {
    uint32_t count = 0;
    int bulk = 0;
    *release = NULL;
    TRITONSERVER_Error *err = TRITONBACKEND_RequestParameterCount(request, &count);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return 0;
    }
    for (uint32_t i = 0; i < count; i++) {
        const char *key;
        TS_ParameterType type;
        const void *value;
        err = TRITONBACKEND_RequestParameter(request, i, &key, &type, &value);
        if (err) {
            TRITONSERVER_ErrorDelete(err);
            continue;
        }
        backend_parameter(key, type, value, &bulk, release);
    }
    return bulk;
}

/* (inputs, timeout_us, bulk, requested_outputs, release or None) for one request; NULL with `problem`
 * set when the request cannot be handed to Python (see input_object). */
static PyObject *request_object(ModelState *state, TRITONBACKEND_Request *request, PyObject *views, char *problem,
                               size_t problem_size) {
    PyObject *inputs = PyTuple_New(state->n_inputs), *outputs = NULL;
    for (int i = 0; inputs != NULL && i < state->n_inputs; i++) {
        PyObject *view = NULL;
        PyObject *value = input_object(request, state->input_names[i], &view, problem, problem_size);
        if (view && PyList_Append(views, view) < 0) { /* not released after the call: released now */
            python_error_text(problem, problem_size);
            PyObject *released = PyObject_CallMethod(view, "release", NULL);
            if (released == NULL) PyErr_Clear();
            Py_XDECREF(released);
            Py_CLEAR(value);
        }
        Py_XDECREF(view);
        if (value == NULL) goto fail;
        PyTuple_SET_ITEM(inputs, i, value);
    }
    if (inputs == NULL) goto no_memory;
    uint64_t timeout_us = 0;
    TRITONSERVER_Error *err = TRITONBACKEND_InferenceRequestTimeoutMicroseconds(request, &timeout_us);
    if (err) TRITONSERVER_ErrorDelete(err);
    uint32_t count = 0;
    err = TRITONBACKEND_RequestOutputCount(request, &count);
    if (err) TRITONSERVER_ErrorDelete(err);
    if ((outputs = PyTuple_New(count)) == NULL) goto no_memory;
    for (uint32_t i = 0; i < count; i++) {
        const char *name = "";
        err = TRITONBACKEND_RequestOutputName(request, i, &name);
        if (err) TRITONSERVER_ErrorDelete(err);
        PyObject *text = PyUnicode_DecodeUTF8(name, (Py_ssize_t)strlen(name), "replace");
        if (text == NULL) goto no_memory;
        PyTuple_SET_ITEM(outputs, i, text);
    }
    const char *release = NULL;
    int bulk = request_parameters(request, &release);
    PyObject *release_object = backend_release_object(release);
    if (release_object == NULL) goto no_memory;
    PyObject *result = Py_BuildValue("(NKONN)", inputs, (unsigned long long)timeout_us, bulk ? Py_True : Py_False,
                                     outputs, release_object);
    if (result != NULL) return result;
    python_error_text(problem, problem_size); /* Py_BuildValue took inputs and outputs */
    return NULL;
no_memory:
    python_error_text(problem, problem_size);
fail:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    return NULL;
}

/* Add one output tensor to a response, its bytes copied from `data`. */
static TRITONSERVER_Error *add_output(TRITONBACKEND_Response *response, const char *name, TS_DataType datatype,
                                      const int64_t *shape, uint32_t dims, const void *data, uint64_t size) {
    TRITONBACKEND_Output *output;
    void *buffer;
    TS_MemoryType memory = TS_MEMORY_CPU;
    int64_t memory_id = 0;
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseOutput(response, &output, name, datatype, shape, dims);
    if (err == NULL) err = TRITONBACKEND_OutputBuffer(output, &buffer, size, &memory, &memory_id);
    if (err == NULL) memcpy(buffer, data, (size_t)size);
    return err;
}

/* Send a response as final, failed with `problem` when not NULL (deleted here); whether it succeeded. */
static bool send_final(TRITONBACKEND_Response *response, TRITONSERVER_Error *problem) {
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseSend(response, TS_RESPONSE_COMPLETE_FINAL, problem);
    if (err) TRITONSERVER_ErrorDelete(err);
    if (problem) {
        TRITONSERVER_ErrorDelete(problem);
        return false;
    }
    return true;
}

/* Answer a request with an error (Triton's code, the message). */
static void send_error(TRITONBACKEND_Request *request, int code, const char *message) {
    TRITONBACKEND_Response *response;
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseNew(&response, request);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return;
    }
    TRITONSERVER_Error *answer_error = TRITONSERVER_ErrorNew((TS_ErrorCode)code, message ? message : "error");
    err = TRITONBACKEND_ResponseSend(response, TS_RESPONSE_COMPLETE_FINAL, answer_error);
    TRITONSERVER_ErrorDelete(answer_error);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* Send one answer: ("error", code, message) or ("ok", ((name, array), ...)). False when the
 * answer could not be built (the request then gets an INTERNAL error). */
static bool send_answer(TRITONBACKEND_Request *request, PyObject *answer) {
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(answer, 0));
    if (strcmp(kind, "error") == 0) {
        send_error(request, (int)PyLong_AsLong(PyTuple_GET_ITEM(answer, 1)), PyUnicode_AsUTF8(PyTuple_GET_ITEM(answer, 2)));
        return false;
    }
    TRITONBACKEND_Response *response;
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseNew(&response, request);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return false;
    }
    PyObject *tensors = PyTuple_GET_ITEM(answer, 1);
    TRITONSERVER_Error *problem = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors) && problem == NULL; i++) {
        PyObject *pair = PyTuple_GET_ITEM(tensors, i);
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(pair, 0));
        Py_buffer view;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) != 0) {
            PyErr_Clear();
            problem = fail(TS_ERROR_INTERNAL, "output '%s' is not a contiguous array", name);
            break;
        }
        int64_t shape[8];
        int dims = view.ndim < 8 ? view.ndim : 8;
        for (int d = 0; d < dims; d++) shape[d] = view.shape[d];
        /* float32 scores, or int32 indices (the rank model's order): numpy's buffer formats "f" and "i". */
        const char *format = view.format ? view.format : "B";
        if (*format == '<' || *format == '=') format++;
        TS_DataType datatype = strcmp(format, "f") == 0 ? TS_TYPE_FP32 : strcmp(format, "i") == 0 ? TS_TYPE_INT32
                                                                                                  : TS_TYPE_INVALID;
        if (datatype == TS_TYPE_INVALID) {
            PyBuffer_Release(&view);
            problem = fail(TS_ERROR_INTERNAL, "output '%s' is neither float32 nor int32", name);
            break;
        }
        problem = add_output(response, name, datatype, shape, (uint32_t)dims, view.buf, (uint64_t)view.len);
        PyBuffer_Release(&view);
    }
    return send_final(response, problem);
}

/* ----- a plain call -----
 *
 * Most calls hold only ordinary requests: each input in its served type and width, its rows in one
 * CPU buffer, the strings well formed. With the chain in C such a call is planned and scored in C
 * (native_execute), bulk requests included; otherwise, when it holds no bulk request, the backend
 * joins each input's buffers in request order and makes one Python call, the model's score_plain (the
 * same admission and the same kernel chain as its execute), then answers every request from the one
 * score array it returns. Any other call goes through the model's execute, which also gives each
 * malformed request its own error. */

typedef struct {
    const void *data[PLAIN_INPUTS];
    uint64_t size[PLAIN_INPUTS];
    int64_t rows;
    uint64_t timeout_us;
    uint32_t wanted; /* bit k: output k asked for */
    int bulk;        /* marked bulk by its client */
} PlainRequest;

/* Whether a request is plain; if so, what the call needs of it. */
static bool plain_request(const ModelState *state, TRITONBACKEND_Request *request, PlainRequest *out) {
    const char *release;
    out->bulk = request_parameters(request, &release);
    if (out->bulk && state->chain == NULL) return false; /* score_plain takes no bulk request */
    out->rows = -1;
    TRITONSERVER_Error *err = NULL;
    for (int i = 0; i < state->n_inputs; i++) {
        TRITONBACKEND_Input *input;
        const char *name;
        TS_DataType datatype;
        const int64_t *shape;
        uint32_t dims, buffers;
        uint64_t size;
        const void *buffer;
        uint64_t buffer_size;
        TS_MemoryType memory = TS_MEMORY_CPU;
        int64_t memory_id = 0;
        if ((err = TRITONBACKEND_RequestInput(request, state->input_names[i], &input))) break;
        if ((err = TRITONBACKEND_InputProperties(input, &name, &datatype, &shape, &dims, &size, &buffers))) break;
        if (!backend_plain_input(state->plain_type[i], state->plain_width[i], datatype, shape, dims, buffers, out->rows))
            return false;
        out->rows = shape[0];
        if ((err = TRITONBACKEND_InputBuffer(input, 0, &buffer, &buffer_size, &memory, &memory_id))) break;
        if (!backend_plain_buffer(datatype, shape[0], shape[1], memory, buffer, buffer_size)) return false;
        out->data[i] = buffer;
        out->size[i] = buffer_size;
    }
    uint32_t count = 0;
    if (err == NULL && out->rows >= 1) err = TRITONBACKEND_RequestOutputCount(request, &count);
    out->wanted = count ? 0 : (1u << state->n_outputs) - 1;
    for (uint32_t j = 0; err == NULL && j < count; j++) {
        const char *name;
        if ((err = TRITONBACKEND_RequestOutputName(request, j, &name))) break;
        int k = 0;
        while (k < state->n_outputs && strcmp(name, state->output_names[k]) != 0) k++;
        if (k == state->n_outputs) return false;
        out->wanted |= 1u << k;
    }
    if (err == NULL && out->rows >= 1) err = TRITONBACKEND_InferenceRequestTimeoutMicroseconds(request, &out->timeout_us);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return false;
    }
    return out->rows >= 1;
}

/* Send rows [offset, offset + rows) of each asked-for output, from the [outputs x total] scores. */
static bool send_scores(const ModelState *state, TRITONBACKEND_Request *request, const float *scores, int64_t total,
                        int64_t offset, int64_t rows, uint32_t wanted) {
    TRITONBACKEND_Response *response;
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseNew(&response, request);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return false;
    }
    TRITONSERVER_Error *problem = NULL;
    int64_t shape[2] = {rows, 1};
    for (int k = 0; k < state->n_outputs && problem == NULL; k++) {
        if (wanted & (1u << k))
            problem = add_output(response, state->output_names[k], TS_TYPE_FP32, shape, 2, scores + k * total + offset,
                                 (uint64_t)rows * sizeof(float));
    }
    return send_final(response, problem);
}

/* A plain call, with the interpreter's lock held. A request left unanswered (the Python side
 * failed as a whole: `text` says why) gets that error from the caller. */
static void plain_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t count,
                          const PlainRequest *plain, bool *answered, bool *succeeded, char *text, size_t text_size) {
    /* Any allocation that fails leaves its Python error, and result NULL: every request then gets it. */
    PyObject *joined = PyTuple_New(state->n_inputs);
    for (int i = 0; joined != NULL && i < state->n_inputs; i++) {
        uint64_t size = 0;
        for (uint32_t r = 0; r < count; r++) size += plain[r].size[i];
        PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        if (bytes == NULL) {
            Py_CLEAR(joined);
            break;
        }
        char *at = PyBytes_AS_STRING(bytes);
        for (uint32_t r = 0; r < count; r++) {
            memcpy(at, plain[r].data[i], plain[r].size[i]);
            at += plain[r].size[i];
        }
        PyTuple_SET_ITEM(joined, i, bytes);
    }
    PyObject *counts = joined ? PyTuple_New(count) : NULL, *timeouts = counts ? PyTuple_New(count) : NULL;
    for (uint32_t r = 0; timeouts != NULL && r < count; r++) {
        PyObject *rows = PyLong_FromLongLong(plain[r].rows), *timeout = PyLong_FromUnsignedLongLong(plain[r].timeout_us);
        if (rows == NULL || timeout == NULL) {
            Py_XDECREF(rows);
            Py_XDECREF(timeout);
            Py_CLEAR(timeouts);
            break;
        }
        PyTuple_SET_ITEM(counts, r, rows);
        PyTuple_SET_ITEM(timeouts, r, timeout);
    }
    PyObject *result =
        timeouts ? PyObject_CallFunctionObjArgs(state->plain_score, joined, counts, timeouts, NULL) : NULL;
    Py_XDECREF(joined);
    Py_XDECREF(counts);
    Py_XDECREF(timeouts);
    PyObject *scores, *taken, *refused;
    if (result == NULL || !PyArg_ParseTuple(result, "OO!O!", &scores, &PyTuple_Type, &taken, &PyTuple_Type, &refused)) {
        python_error_text(text, text_size);
    } else {
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(refused); j++) {
            int index, code;
            const char *message;
            if (PyArg_ParseTuple(PyTuple_GET_ITEM(refused, j), "iis", &index, &code, &message) && index >= 0 &&
                (uint32_t)index < count && !answered[index]) {
                send_error(requests[index], code, message);
                answered[index] = true;
            }
        }
        Py_buffer view;
        if (PyObject_GetBuffer(scores, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) == 0) {
            const char *format = view.format ? view.format : "B";
            if (*format == '<' || *format == '=') format++;
            int64_t total = view.ndim == 2 ? view.shape[1] : -1, offset = 0;
            if (view.ndim == 2 && view.shape[0] == state->n_outputs && strcmp(format, "f") == 0) {
                for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(taken); j++) {
                    long index = PyLong_AsLong(PyTuple_GET_ITEM(taken, j));
                    if (index < 0 || (uint32_t)index >= count || answered[index] || offset + plain[index].rows > total)
                        break;
                    succeeded[index] = send_scores(state, requests[index], view.buf, total, offset, plain[index].rows,
                                                   plain[index].wanted);
                    answered[index] = true;
                    offset += plain[index].rows;
                }
            }
            PyBuffer_Release(&view);
            if (offset != total) snprintf(text, text_size, "the scores (%lld rows) do not match the call's requests",
                                          (long long)total);
        }
        if (PyErr_Occurred()) python_error_text(text, text_size);
    }
    Py_XDECREF(result);
    PyObject *done = PyObject_CallNoArgs(state->plain_finish);
    if (done == NULL) {
        char why[300];
        python_error_text(why, sizeof why);
        log_line(TS_LOG_ERROR, why);
    }
    Py_XDECREF(done);
}

/* How many threads the chain scores `rows` rows on: two from split_rows rows (0: never), where the
 * Python pipeline splits a batch too. */
static int chain_threads(const ModelState *state, int64_t rows) {
    return state->split_rows && rows >= state->split_rows ? 2 : 1;
}

/* ----- the bulk lane -----
 *
 * Triton's queue is first come, first served: an interactive request that arrives behind bulk
 * requests waits for all of them. So while interactive requests are being served (a call held one
 * within the last LANE_YIELD_NS), a call hands the bulk requests its plan takes to its instance's lane
 * and returns: the lane's thread scores them one at a time, in arrival order, at nice LANE_NICE (below
 * the model thread's), so an interactive request handed over meanwhile takes the core from it at once
 * (a running thread of equal weight would finish its time slice first). The lane holds at most
 * LANE_REQUESTS requests; more are refused (UNAVAILABLE, retryable). A request that has waited in the
 * lane past its own timeout is refused when its turn comes. Unloading the model first answers every
 * request the lane holds. Bulk requests on a server with no interactive traffic are scored in the
 * call, as before, on the model thread. */

#define LANE_REQUESTS 64
#define LANE_NICE 19
#define LANE_YIELD_NS 1000000000ull

/* What the lane did with a request: the `outcome` label of ensemble_bulk_lane_requests_total. */
enum { LANE_SCORED, LANE_FAILED, LANE_REFUSED_FULL, LANE_REFUSED_LATE, LANE_OUTCOMES };
static const char *const lane_outcome_names[LANE_OUTCOMES] = {"scored", "failed", "refused_full", "refused_late"};

/* ensemble_bulk_lane_waiting{model, version}: the requests a version's lane holds now;
 * ensemble_bulk_lane_requests_total{model, version, outcome}: what it did with them. */
static TRITONSERVER_MetricFamily *lane_waiting_family, *lane_total_family;
static pthread_once_t lane_families_once = PTHREAD_ONCE_INIT;

static void lane_families(void) {
    TRITONSERVER_Error *err = TRITONSERVER_MetricFamilyNew(
        &lane_waiting_family, TS_METRIC_GAUGE, "ensemble_bulk_lane_waiting",
        "bulk requests the native ranker's bulk lane holds now (handed to it beside interactive traffic)");
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        lane_waiting_family = NULL;
    }
    err = TRITONSERVER_MetricFamilyNew(&lane_total_family, TS_METRIC_COUNTER, "ensemble_bulk_lane_requests_total",
                                       "bulk requests handed to the bulk lane, by outcome: scored, failed, "
                                       "refused_full (the lane held its limit), refused_late (past their timeout)");
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        lane_total_family = NULL;
    }
}

typedef struct {
    TRITONBACKEND_Request *request;
    PlainRequest plain;
    uint64_t handed_ns; /* when its call started: the request arrived before */
} LaneItem;

struct Lane {
    ModelState *state;
    TRITONBACKEND_ModelInstance *instance;
    Reporter *reporter;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    bool stop;
    size_t head, count;
    TRITONSERVER_Metric *waiting, *outcomes[LANE_OUTCOMES]; /* NULL: not created */
    LaneItem items[LANE_REQUESTS];
};

static void lane_count(Lane *lane, int outcome) {
    if (lane->outcomes[outcome] == NULL) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricIncrement(lane->outcomes[outcome], 1.0);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* The gauge to the lane's count; called with the lane's lock held. */
static void lane_gauge(Lane *lane) {
    if (lane->waiting == NULL) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricSet(lane->waiting, (double)lane->count);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* Scores (or refuses) one request of the lane and answers it; its statistics and release go the
 * way the model thread's do. Returns what it did (LANE_SCORED ...). */
static int lane_answer(Lane *lane, const LaneItem *item) {
    ModelState *state = lane->state;
    const PlainRequest *p = &item->plain;
    const uint64_t start = now_ns();
    uint64_t compute_start = start, compute_end = start;
    bool success = false;
    int outcome = LANE_FAILED;
    if (p->timeout_us > 0 && start - item->handed_ns > p->timeout_us * 1000ull) {
        outcome = LANE_REFUSED_LATE;
        char message[ENSEMBLE_MESSAGE_SIZE];
        snprintf(message, sizeof message,
                 "refused: the bulk request waited %.0f ms behind interactive traffic, past its timeout (%.0f ms); "
                 "retry with backoff",
                 (double)(start - item->handed_ns) / 1e6, (double)p->timeout_us / 1e3);
        send_error(item->request, TS_ERROR_UNAVAILABLE, message);
    } else {
        char text[ENSEMBLE_ERROR_SIZE] = "";
        const float *dense = p->data[0];
        const unsigned char *wire = p->data[1];
        const uint64_t wire_size = p->size[1];
        const int64_t rows = p->rows;
        float *scores = malloc((size_t)rows * (size_t)state->n_outputs * sizeof(float));
        if (scores == NULL) {
            send_error(item->request, TS_ERROR_INTERNAL, "out of memory for a bulk request's scores");
        } else {
            compute_start = now_ns();
            const int failed = state->chain_api->score(state->chain, 1, &dense, &wire, &wire_size, &rows,
                                                       chain_threads(state, rows), scores, text, sizeof text);
            compute_end = now_ns();
            if (failed) {
                char message[ENSEMBLE_ERROR_SIZE + 32];
                snprintf(message, sizeof message, "the ranker failed: %s", text[0] ? text : "no answer");
                send_error(item->request, TS_ERROR_INTERNAL, message);
            } else {
                success = send_scores(state, item->request, scores, rows, 0, rows, p->wanted);
                outcome = LANE_SCORED;
            }
            free(scores);
        }
    }
    const uint64_t end = now_ns();
    Report done = {item->request, success, 0, start, compute_start, compute_end, end};
    report(lane->reporter, lane->instance, &done);
    if (success) {
        Report batch = {NULL, true, (uint64_t)p->rows, start, compute_start, compute_end, end};
        report(lane->reporter, lane->instance, &batch);
    }
    return outcome;
}

static void *lane_main(void *arg) {
    Lane *lane = arg;
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), LANE_NICE); /* only lowers: needs no privilege */
    for (;;) {
        pthread_mutex_lock(&lane->lock);
        while (lane->count == 0 && !lane->stop) pthread_cond_wait(&lane->wake, &lane->lock);
        if (lane->count == 0) { /* stopped, and every request answered */
            pthread_mutex_unlock(&lane->lock);
            return NULL;
        }
        LaneItem item = lane->items[lane->head]; /* stays counted until answered: the bound covers it */
        pthread_mutex_unlock(&lane->lock);
        lane_count(lane, lane_answer(lane, &item));
        pthread_mutex_lock(&lane->lock);
        lane->head = (lane->head + 1) % LANE_REQUESTS;
        lane->count--;
        lane_gauge(lane);
        pthread_mutex_unlock(&lane->lock);
    }
}

static void lane_metrics_delete(Lane *lane) {
    TRITONSERVER_Metric *all[1 + LANE_OUTCOMES] = {lane->waiting};
    for (int k = 0; k < LANE_OUTCOMES; k++) all[1 + k] = lane->outcomes[k];
    for (int k = 0; k < 1 + LANE_OUTCOMES; k++) {
        TRITONSERVER_Error *err = all[k] ? TRITONSERVER_MetricDelete(all[k]) : NULL;
        if (err) TRITONSERVER_ErrorDelete(err);
    }
}

/* The instance's lane, started on first use; NULL when it cannot be (the caller then scores in the call). */
static Lane *lane_of(Instance *owner, ModelState *state, TRITONBACKEND_ModelInstance *instance) {
    if (owner == NULL) return NULL;
    if (owner->lane != NULL) return owner->lane;
    Lane *lane = calloc(1, sizeof *lane);
    if (lane == NULL) return NULL;
    lane->state = state;
    lane->instance = instance;
    lane->reporter = owner->reporter;
    TRITONBACKEND_Model *model;
    const char *name;
    uint64_t version;
    pthread_once(&lane_families_once, lane_families);
    TRITONSERVER_Error *err = TRITONBACKEND_ModelInstanceModel(instance, &model);
    if (err == NULL) err = TRITONBACKEND_ModelName(model, &name);
    if (err == NULL) err = TRITONBACKEND_ModelVersion(model, &version);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
    } else {
        char version_text[24];
        snprintf(version_text, sizeof version_text, "%llu", (unsigned long long)version);
        const char *names[] = {"model", "version", "outcome"};
        const char *values[] = {name, version_text, NULL};
        if (lane_waiting_family) lane->waiting = labelled(lane_waiting_family, names, values, 2, 0.0);
        for (int k = 0; k < LANE_OUTCOMES && lane_total_family; k++) {
            values[2] = lane_outcome_names[k];
            lane->outcomes[k] = labelled(lane_total_family, names, values, 3, 0.0);
        }
    }
    pthread_mutex_init(&lane->lock, NULL);
    pthread_cond_init(&lane->wake, NULL);
    if (pthread_create(&lane->thread, NULL, lane_main, lane) != 0) {
        pthread_cond_destroy(&lane->wake);
        pthread_mutex_destroy(&lane->lock);
        lane_metrics_delete(lane);
        free(lane);
        log_line(TS_LOG_WARN, "could not start the bulk lane's thread: bulk requests are scored in the call");
        return NULL;
    }
    owner->lane = lane;
    return lane;
}

/* Hands a request to the lane: false when the lane is full (the caller refuses it). */
static bool lane_take(Lane *lane, TRITONBACKEND_Request *request, const PlainRequest *plain, uint64_t handed_ns) {
    pthread_mutex_lock(&lane->lock);
    const bool room = lane->count < LANE_REQUESTS && !lane->stop;
    if (room) {
        lane->items[(lane->head + lane->count) % LANE_REQUESTS] = (LaneItem){request, *plain, handed_ns};
        if (lane->count++ == 0) pthread_cond_signal(&lane->wake);
        lane_gauge(lane);
    }
    pthread_mutex_unlock(&lane->lock);
    if (!room) lane_count(lane, LANE_REFUSED_FULL);
    return room;
}

static void lane_stop(Lane *lane) {
    stop_worker(&lane->lock, &lane->wake, &lane->stop, lane->thread);
    pthread_cond_destroy(&lane->wake);
    pthread_mutex_destroy(&lane->lock);
    lane_metrics_delete(lane);
    free(lane);
}

/* A plain call in C, without the interpreter's lock: beside interactive traffic, the bulk requests
 * handed to the lane; then the admission plan of the others, the refusals answered, one chain call
 * over the taken requests' buffers in the plan's order (two when the plan takes interactive and bulk
 * requests: the interactive ones first), on two threads from split_rows rows, where the Python
 * pipeline splits a batch too; each taken request answered from the score array, the call recorded
 * for the admission's fits (as execute, score_plain and finish_plain do).
 * Adds the rows scored to *rows (the caller's 0); a request left unanswered gets `text` as its error from
 * the caller; one handed to the lane is marked in `deferred` (the lane answers, reports and releases it). */
static void native_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t count,
                           const PlainRequest *plain, Lane *lane, uint64_t handed_ns, bool *answered, bool *succeeded,
                           bool *deferred, uint64_t *rows, char *text, size_t text_size) {
    const EnsembleAdmissionApi *policy = state->admission ? state->admission_api : NULL;
    const double started = policy ? policy->now() : 0.0;
    int32_t *lists = malloc(3 * (size_t)count * sizeof(int32_t));
    int32_t *kept = malloc(count * sizeof *kept); /* the requests the call itself plans: indices into requests */
    char *refused = calloc(count, 1);
    char(*message)[ENSEMBLE_MESSAGE_SIZE] = policy ? malloc((size_t)count * ENSEMBLE_MESSAGE_SIZE) : NULL;
    EnsembleAdmitted *admitted = policy ? malloc(count * sizeof *admitted) : NULL;
    const float **dense = malloc(count * sizeof *dense);
    const unsigned char **wire = malloc(count * sizeof *wire);
    uint64_t *wire_size = malloc(count * sizeof *wire_size);
    int64_t *part_rows = malloc(count * sizeof *part_rows);
    float *scores = NULL;
    EnsemblePlan plan = {lists, lists + count, lists + 2 * (size_t)count, 0, 0, 0, refused, message};
    if (lists == NULL || kept == NULL || refused == NULL || dense == NULL || wire == NULL || wire_size == NULL ||
        part_rows == NULL || (policy && (message == NULL || admitted == NULL))) {
        snprintf(text, text_size, "out of memory for a call of %u requests", count);
        goto done;
    }
    /* Beside interactive traffic the bulk requests go to the lane (see "the bulk lane"); the plan then
     * prices only what this call scores. */
    bool interactive = false;
    for (uint32_t r = 0; r < count && !interactive; r++) interactive = !plain[r].bulk;
    if (interactive) __atomic_store_n(&state->interactive_ns, handed_ns, __ATOMIC_RELAXED);
    const uint64_t last = __atomic_load_n(&state->interactive_ns, __ATOMIC_RELAXED);
    const bool yielding = lane != NULL && deferred != NULL && last != 0 && handed_ns - last <= LANE_YIELD_NS;
    int32_t n = 0;
    for (uint32_t r = 0; r < count; r++) {
        if (!yielding || !plain[r].bulk) {
            kept[n++] = (int32_t)r;
            continue;
        }
        if (lane_take(lane, requests[r], &plain[r], handed_ns)) {
            deferred[r] = true;
        } else {
            char why[ENSEMBLE_MESSAGE_SIZE];
            snprintf(why, sizeof why,
                     "refused: %d bulk requests already wait beside interactive traffic (the bulk lane's limit); "
                     "retry with backoff",
                     LANE_REQUESTS);
            send_error(requests[r], TS_ERROR_UNAVAILABLE, why);
        }
        answered[r] = true;
    }
    if (n == 0) { /* every request went to the lane: the call is recorded, without rows */
        if (policy) policy->finished(state->admission, started, policy->now(), 0, 0, 0);
        goto done;
    }
    if (policy) {
        for (int32_t k = 0; k < n; k++) {
            const PlainRequest *p = &plain[kept[k]];
            admitted[k] = (EnsembleAdmitted){p->rows, (double)p->timeout_us * 1e-6, p->bulk};
        }
        if (policy->plan(state->admission, admitted, n, started, &plan) < 0) {
            snprintf(text, text_size, "out of memory planning a call of %u requests", count);
            goto done;
        }
        for (int32_t k = 0; k < n; k++) {
            if (refused[k]) {
                send_error(requests[kept[k]], TS_ERROR_UNAVAILABLE, message[k]);
                answered[kept[k]] = true;
            }
        }
    } else {
        for (int32_t k = 0; k < n; k++) plan.first[k] = k;
        plan.n_first = n;
    }
    /* The taken requests in the plan's order: the interactive ones, then the bulk ones. When a call
     * takes both, the interactive ones are scored and answered first and the bulk ones after (as the
     * model's execute flushes between them), so those answers do not wait for the bulk rows. */
    const int32_t taken = plan.n_first + plan.n_bulk;
    const int32_t bounds[3] = {0, plan.n_first && plan.n_bulk ? plan.n_first : taken, taken};
    int32_t scored = 0;
    for (int part = 0; part < 2; part++) {
        const int32_t from = bounds[part], to = bounds[part + 1];
        if (from == to) continue;
        int64_t total = 0;
        for (int32_t k = from; k < to; k++) {
            const PlainRequest *p = &plain[kept[k < plan.n_first ? plan.first[k] : plan.bulk[k - plan.n_first]]];
            dense[k - from] = p->data[0];
            wire[k - from] = p->data[1];
            wire_size[k - from] = p->size[1];
            part_rows[k - from] = p->rows;
            total += p->rows;
        }
        free(scores);
        scores = malloc((size_t)(total ? total : 1) * (size_t)state->n_outputs * sizeof(float));
        if (scores == NULL) {
            snprintf(text, text_size, "out of memory for %lld rows", (long long)total);
            break;
        }
        if (state->chain_api->score(state->chain, to - from, dense, wire, wire_size, part_rows,
                                    chain_threads(state, total), scores, text,
                                    text_size) != 0)
            break;
        int64_t offset = 0;
        for (int32_t k = from; k < to; k++) {
            const int32_t r = kept[k < plan.n_first ? plan.first[k] : plan.bulk[k - plan.n_first]];
            succeeded[r] = send_scores(state, requests[r], scores, total, offset, plain[r].rows, plain[r].wanted);
            answered[r] = true;
            offset += plain[r].rows;
        }
        *rows += (uint64_t)total;
        scored += to - from;
    }
    if (policy)
        policy->finished(state->admission, started, policy->now(), n, (int64_t)*rows, *rows ? scored : 0);
done:
    free(lists);
    free(kept);
    free(refused);
    free(message);
    free(admitted);
    free(dense);
    free(wire);
    free(wire_size);
    free(part_rows);
    free(scores);
}

/* Any other call, with the interpreter's lock held: the model's execute answers each request. */
static void python_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t request_count,
                           uint64_t exec_start, bool *answered, bool *succeeded, uint64_t *compute_start,
                           uint64_t *compute_end, char *text, size_t text_size) {
    PyObject *views = PyList_New(0);
    PyObject *batch = PyList_New(0);
    uint32_t *request_at = malloc((request_count ? request_count : 1) * sizeof *request_at); /* batch -> call */
    if (views == NULL || batch == NULL || request_at == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        python_error_text(text, text_size);
        goto done;
    }
    /* A request whose inputs cannot be read here is answered now with why; the rest go to Python. */
    for (uint32_t r = 0; r < request_count; r++) {
        char problem[400] = "";
        PyObject *item = request_object(state, requests[r], views, problem, sizeof problem);
        if (item != NULL && PyList_Append(batch, item) < 0) {
            python_error_text(problem, sizeof problem);
            Py_CLEAR(item);
        }
        if (item == NULL) {
            send_error(requests[r], TS_ERROR_INVALID_ARG, problem);
            answered[r] = true;
            continue;
        }
        Py_DECREF(item);
        request_at[PyList_GET_SIZE(batch) - 1] = r;
    }
    *compute_start = now_ns();
    /* The Python side yields answers in the order they should go out: (index, answer) pairs, the
     * refusals and interactive answers before a bulk request's rows are scored. */
    const Py_ssize_t handed = PyList_GET_SIZE(batch);
    PyObject *answers =
        handed ? PyObject_CallMethod(state->model, "execute", "Od", batch, (double)exec_start * 1e-9) : NULL;
    if (answers == NULL) {
        if (handed) python_error_text(text, text_size);
    } else {
        PyObject *item;
        while ((item = PyIter_Next(answers)) != NULL) {
            long index = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
            if (index >= 0 && index < handed && !answered[request_at[index]]) {
                succeeded[request_at[index]] = send_answer(requests[request_at[index]], PyTuple_GET_ITEM(item, 1));
                answered[request_at[index]] = true;
            }
            Py_DECREF(item);
        }
        if (PyErr_Occurred()) python_error_text(text, text_size);
        Py_DECREF(answers);
    }
    *compute_end = now_ns();
    model_metrics(state); /* with the interpreter's lock held: the model's threads take turns here */
    /* The views into Triton's buffers end here: the requests are released after the call. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(views); i++) {
        PyObject *released = PyObject_CallMethod(PyList_GET_ITEM(views, i), "release", NULL);
        if (released == NULL) {
            char leak[300];
            python_error_text(leak, sizeof leak);
            log_line(TS_LOG_ERROR, leak);
        }
        Py_XDECREF(released);
    }
done:
    Py_XDECREF(views);
    Py_XDECREF(batch);
    free(request_at);
}

/* This thread (a model instance's, on its first call) to nice value ``nice``, so that on a core it
 * shares with Triton's front-end threads the threads parsing and answering requests run before it:
 * the dynamic batcher then gathers the requests that arrive meanwhile into the next call. At the
 * same priority the model thread, woken for each single request, took the core from the front end
 * as soon as one request was queued, and calls under 4-16 concurrent clients stayed at one request
 * (configs.py: MODEL_THREAD_NICE says what that cost). The chain's helper thread, started at load by
 * another thread, takes the value of the thread whose call it shares (_chain.c). Only ever lowers the
 * priority, which needs no privilege. */
static void lower_priority(int nice) {
    if (nice <= 0) return;
    const pid_t tid = (pid_t)syscall(SYS_gettid);
    errno = 0;
    const int now = getpriority(PRIO_PROCESS, (id_t)tid);
    if (errno != 0 || now >= nice) return;
    if (setpriority(PRIO_PROCESS, (id_t)tid, nice) != 0) {
        char text[200];
        snprintf(text, sizeof text, "could not lower the model thread's priority to nice %d (%s); it keeps nice %d",
                 nice, strerror(errno), now);
        log_line(TS_LOG_WARN, text);
    }
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance *instance,
                                                       TRITONBACKEND_Request **requests,
                                                       uint32_t request_count) {
    uint64_t exec_start = now_ns();
    TRITONBACKEND_Model *model;
    void *raw;
    TRITONSERVER_Error *err = TRITONBACKEND_ModelInstanceModel(instance, &model);
    if (err == NULL) err = TRITONBACKEND_ModelState(model, &raw);
    if (err) return err; /* Triton answers every request with this error */
    ModelState *state = raw;
    void *instance_raw = NULL;
    err = TRITONBACKEND_ModelInstanceState(instance, &instance_raw);
    if (err) TRITONSERVER_ErrorDelete(err); /* then reported here, on this thread */
    Instance *owner = instance_raw;
    Reporter *reporter = owner != NULL && another_core() ? owner->reporter : NULL;

    /* Keep this thread's Python state across calls: the state PyGILState_Ensure creates for a
     * thread Python did not start is destroyed by the matching Release, and a new one per call
     * starts Python and the frameworks' thread-local caches cold every time. */
    static __thread int thread_state_kept = 0;
    if (!thread_state_kept) {
        PyGILState_Ensure();
        PyEval_SaveThread();
        thread_state_kept = 1;
        lower_priority(state->thread_nice);
    }
    bool *answered = calloc(request_count, sizeof(bool));
    bool *succeeded = calloc(request_count, sizeof(bool));
    bool *deferred = calloc(request_count, sizeof(bool)); /* handed to the bulk lane: it answers and reports them */
    uint64_t compute_start = 0, compute_end = 0;
    char text[900] = "";
    PlainRequest *plain = state->plain_score ? malloc(request_count * sizeof *plain) : NULL;
    for (uint32_t r = 0; plain != NULL && r < request_count; r++) {
        if (!plain_request(state, requests[r], &plain[r])) {
            free(plain);
            plain = NULL;
        }
    }
    uint64_t rows = 0;
    if (plain != NULL && state->chain != NULL) {
        compute_start = now_ns();
        Lane *lane = deferred != NULL ? lane_of(owner, state, instance) : NULL;
        native_execute(state, requests, request_count, plain, lane, exec_start, answered, succeeded, deferred, &rows,
                       text, sizeof text);
        compute_end = now_ns();
        free(plain);
    } else {
        PyGILState_STATE gil = PyGILState_Ensure();
        if (plain != NULL) {
            compute_start = now_ns();
            plain_execute(state, requests, request_count, plain, answered, succeeded, text, sizeof text);
            compute_end = now_ns();
            free(plain);
        } else {
            python_execute(state, requests, request_count, exec_start, answered, succeeded, &compute_start,
                           &compute_end, text, sizeof text);
        }
        PyObject *scored = PyObject_GetAttrString(state->model, "rows");
        if (scored && PyLong_Check(scored)) rows = PyLong_AsUnsignedLongLong(scored);
        if (scored == NULL || PyErr_Occurred()) PyErr_Clear();
        Py_XDECREF(scored);
        PyGILState_Release(gil);
    }
    uint64_t exec_end = now_ns();

    for (uint32_t r = 0; r < request_count; r++) {
        if (deferred != NULL && deferred[r]) continue; /* the lane answers, reports and releases it */
        if (!answered[r]) { /* the Python side failed as a whole: every request still gets an answer */
            TRITONBACKEND_Response *response;
            if (TRITONBACKEND_ResponseNew(&response, requests[r]) == NULL) {
                TRITONSERVER_Error *why = fail(TS_ERROR_INTERNAL, "the ranker failed: %s", text[0] ? text : "no answer");
                TRITONSERVER_Error *send = TRITONBACKEND_ResponseSend(response, TS_RESPONSE_COMPLETE_FINAL, why);
                if (send) TRITONSERVER_ErrorDelete(send);
                TRITONSERVER_ErrorDelete(why);
            }
        }
        Report item = {requests[r], succeeded[r], 0, exec_start, compute_start, compute_end, exec_end};
        report(reporter, instance, &item);
    }
    if (rows) {
        Report item = {NULL, true, rows, exec_start, compute_start, compute_end, exec_end};
        report(reporter, instance, &item);
    }
    free(answered);
    free(succeeded);
    free(deferred);
    return NULL;
}
