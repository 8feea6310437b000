/* The fused ranker as a Triton backend of the project's own: Triton loads it into its own process
 * (``libtriton_native.so`` in the model's folder, ``backend: "native"`` in its config), so a request
 * reaches the ranker without the python backend's stub process and its shared-memory round trip.
 *
 * The ranker's model code runs in a Python interpreter embedded here (ensemble.serving.embedded):
 * this file moves tensors between Triton and that code, answers each request, and reports the
 * statistics Triton's metrics and perf_analyzer read. A call's plain requests (see "a plain call"
 * below) are planned and scored in C, with no Python call and without the interpreter's lock, through
 * the C entry points the model's modules hand over at load (ensemble/native/api.h: the admission
 * policy and the whole chain, checked at load against the step-by-step pipeline to the bit); every
 * other request goes through the model's execute. ensemble_backend_requests_total{path} counts both.
 */

#include "backend_internal.h"

/* What this build of the backend does, read by the operator's side (ensemble.native.backend.capabilities) before
 * it relies on a feature: the version of the C entry points it calls in the model's modules (api.h), then its
 * features, space-separated: `shadow` (shadow scoring: backend_shadow.c), `tables` (the row store's metrics:
 * backend_tables.c). */
BACKEND_EXPORT const char *ensemble_backend_capabilities(void) {
    return "api=" ENSEMBLE_API_VERSION " shadow tables";
}

TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend) {
    (void)backend;
    uint32_t major, minor;
    TRITONSERVER_Error *err = TRITONBACKEND_ApiVersion(&major, &minor);
    if (err) return err;
    if (major != ENSEMBLE_BACKEND_API_MAJOR || minor < ENSEMBLE_BACKEND_API_MINOR)
        return fail(TS_ERROR_UNSUPPORTED, "the native backend needs backend API %d.%d+, this Triton has %u.%u",
                    ENSEMBLE_BACKEND_API_MAJOR, ENSEMBLE_BACKEND_API_MINOR, major, minor);
    return python_start();
}

/* The model's input names (its input_names attribute: a tuple of str) copied into the state; false with a
 * Python exception set when they cannot be (state->n_inputs counts the names copied, for freeing). */
static bool copy_input_names(ModelState *state) {
    PyObject *names = PyObject_GetAttrString(state->model, "input_names");
    if (names == NULL) return false;
    bool copied = PyTuple_Check(names);
    if (!copied) PyErr_SetString(PyExc_TypeError, "the model's input_names is not a tuple");
    const Py_ssize_t n = copied ? PyTuple_GET_SIZE(names) : 0;
    if (copied && (state->input_names = calloc(n ? (size_t)n : 1, sizeof(char *))) == NULL) {
        PyErr_NoMemory();
        copied = false;
    }
    for (Py_ssize_t i = 0; copied && i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(names, i);
        const char *name = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        if (name == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "an input name is not a str");
        if (name != NULL && (state->input_names[i] = strdup(name)) == NULL) PyErr_NoMemory();
        copied = state->input_names[i] != NULL;
        state->n_inputs += copied;
    }
    Py_DECREF(names);
    return copied;
}

/* Everything a model's state holds let go (the model closed, Triton's series deleted) and the state freed:
 * at unload, and after a load that failed part way (whatever was not made yet is NULL or not counted). */
static void free_model_state(ModelState *state) {
    PyGILState_STATE gil = PyGILState_Ensure();
    if (state->model != NULL) {
        PyObject *result = PyObject_CallMethod(state->model, "close", NULL);
        if (result == NULL) PyErr_Clear();
        Py_XDECREF(result);
    }
    Py_XDECREF(state->chain);
    Py_XDECREF(state->admission);
    Py_XDECREF(state->metric_updates);
    Py_XDECREF(state->shadow_updates);
    Py_XDECREF(state->shadow_chain);
    table_metrics_delete(state);
    Py_XDECREF(state->model);
    PyGILState_Release(gil);
    for (int k = 0; k < 2; k++) {
        if (state->path_metrics[k] == NULL) continue;
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->path_metrics[k]);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    for (int k = 0; k < state->n_metrics; k++) {
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->metrics[k]);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    for (int k = 0; k < state->n_series; k++) {
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(state->series[k].metric);
        if (gone) TRITONSERVER_ErrorDelete(gone);
    }
    shadow_series_delete(state);
    delete_served_metrics(state);
    for (int k = 0; k < state->n_outputs; k++) free(state->output_names[k]);
    for (int i = 0; i < state->n_inputs; i++) free(state->input_names[i]);
    free(state->input_names);
    free(state);
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
    ModelState *state = calloc(1, sizeof *state);
    if (state == NULL)
        return fail(TS_ERROR_UNAVAILABLE, "model '%s' version %llu did not load: out of memory", name,
                    (unsigned long long)version);
    if ((err = TRITONBACKEND_ModelConfig(model, 1, &config))) {
        free(state);
        return err;
    }
    if ((err = TRITONSERVER_MessageSerializeToJson(config, &config_json, &config_size))) {
        TRITONSERVER_MessageDelete(config);
        free(state);
        return err;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *module = PyImport_ImportModule(ENTRY_MODULE);
    if (module) {
        state->model = PyObject_CallMethod(module, "Model", "s#sK", config_json, (Py_ssize_t)config_size,
                                           repository, (unsigned long long)version);
        Py_DECREF(module);
    }
    TRITONSERVER_MessageDelete(config);
    if (state->model == NULL || !copy_input_names(state)) {
        char text[900];
        python_error_text(text, sizeof text);
        PyGILState_Release(gil);
        free_model_state(state);
        return fail(TS_ERROR_INTERNAL, "model '%s' version %llu did not load: %s", name,
                    (unsigned long long)version, text);
    }
    plain_spec(state, name);
    PyObject *nice = PyObject_GetAttrString(state->model, "thread_nice");
    if (nice == NULL) PyErr_Clear(); /* a model without the attribute: threads left as they are */
    else if (PyLong_Check(nice)) state->thread_nice = (int)PyLong_AsLong(nice);
    Py_XDECREF(nice);
    PyObject *limits = PyObject_GetAttrString(state->model, "lane_limits");
    double yield_s = 0.0;
    if (limits == NULL || !PyArg_ParseTuple(limits, "iid", &state->lane_requests, &state->lane_nice, &yield_s) ||
        state->lane_requests < 1 || state->lane_nice < 0 || state->lane_nice > 19 || !(yield_s >= 0)) {
        PyErr_Clear();
        state->lane_requests = 0; /* no lane: bulk requests are scored in the call, as without a lane thread */
        char text[300];
        snprintf(text, sizeof text, "model '%s': no bulk lane limits (lane_limits): bulk requests are scored in the call",
                 name);
        log_line(TS_LOG_WARN, text);
    }
    state->lane_yield_ns = (uint64_t)(yield_s * 1e9);
    Py_XDECREF(limits);
    c_module_metrics();
    engine_metrics(state, name, version);
    table_metrics_create(state, name, version);
    create_path_metrics(state, name, version);
    state->metric_updates = PyObject_GetAttrString(state->model, "metric_updates");
    if (state->metric_updates == NULL) PyErr_Clear(); /* a model without counters of its own */
    snprintf(state->metric_model, sizeof state->metric_model, "%s", name);
    snprintf(state->metric_version, sizeof state->metric_version, "%llu", (unsigned long long)version);
    shadow_register(state);
    PyGILState_Release(gil);
    state->score_output = -1;
    for (int k = 0; k < state->n_outputs; k++)
        if (strcmp(state->output_names[k], "score") == 0) state->score_output = k;
    create_served_metrics(state);
    if ((err = TRITONBACKEND_ModelSetState(model, state))) free_model_state(state); /* Triton will not finalize it */
    return err;
}

TRITONSERVER_Error *TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model *model) {
    void *raw;
    TRITONSERVER_Error *err = TRITONBACKEND_ModelState(model, &raw);
    if (err) return err;
    if (raw != NULL) free_model_state(raw); /* NULL: Triton finalizes a model whose initialization failed, too */
    return NULL;
}

/* An instance's state let go: its lane answers every request it holds (reporting through the reporter), then
 * the reporter makes every queued report, and both end. */
static void free_instance(Instance *state) {
    if (state->lane != NULL) lane_stop(state->lane);
    Reporter *reporter = state->reporter;
    if (reporter != NULL) {
        if (reporter->running) stop_worker(&reporter->lock, &reporter->wake, &reporter->stop, reporter->thread);
        pthread_cond_destroy(&reporter->wake);
        pthread_mutex_destroy(&reporter->lock);
        free(reporter);
    }
    free(state);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance *instance) {
    Instance *state = calloc(1, sizeof *state);
    if (state == NULL) return fail(TS_ERROR_UNAVAILABLE, "out of memory for a model instance");
    Reporter *reporter = calloc(1, sizeof *reporter);
    if (reporter != NULL) { /* without one, statistics are reported on the answering thread */
        reporter->instance = instance;
        pthread_mutex_init(&reporter->lock, NULL);
        pthread_cond_init(&reporter->wake, NULL);
        reporter->running = pthread_create(&reporter->thread, NULL, reporter_main, reporter) == 0;
        state->reporter = reporter;
    }
    TRITONSERVER_Error *err = TRITONBACKEND_ModelInstanceSetState(instance, state);
    if (err) free_instance(state); /* Triton will not finalize it */
    return err;
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance *instance) {
    void *raw = NULL;
    TRITONSERVER_Error *err = TRITONBACKEND_ModelInstanceState(instance, &raw);
    if (err) return err;
    if (raw != NULL) free_instance(raw);
    return NULL;
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
    FAULTS_ARM();
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
    /* The call's requests in the order they are scored: the plain ones first (the C path, when the model
     * has it), then every other (the model's execute), each group in arrival order; the flags below are
     * indexed by that order. Without memory for `plain`, every request goes through the model's execute. */
    const size_t slots = request_count ? request_count : 1;
    TRITONBACKEND_Request **ordered = malloc(slots * sizeof *ordered);
    bool *answered = calloc(slots, sizeof(bool));
    bool *succeeded = calloc(slots, sizeof(bool));
    bool *deferred = calloc(slots, sizeof(bool)); /* handed to the bulk lane: it answers and reports them */
    PlainRequest *plain = state->chain ? malloc(slots * sizeof *plain) : NULL;
    uint64_t compute_start = 0, compute_end = 0, rows = 0;
    char text[900] = "";
    TS_ErrorCode code = TS_ERROR_INTERNAL; /* what a request no path answered gets, with `text` */
    uint32_t n_plain = 0;
    if (ordered == NULL || answered == NULL || succeeded == NULL || deferred == NULL) {
        snprintf(text, sizeof text, "out of memory for a call of %u requests", request_count);
        code = TS_ERROR_UNAVAILABLE;
        free(ordered);
        ordered = requests; /* every request is still answered below, in arrival order */
    } else {
        uint32_t n_other = 0;
        for (uint32_t r = 0; r < request_count; r++) {
            if (plain != NULL && plain_request(state, requests[r], &plain[n_plain])) ordered[n_plain++] = requests[r];
            else ordered[request_count - 1 - n_other++] = requests[r]; /* from the end: reversed just below */
        }
        for (uint32_t i = n_plain, j = request_count; i + 1 < j; i++, j--) {
            TRITONBACKEND_Request *kept = ordered[i];
            ordered[i] = ordered[j - 1];
            ordered[j - 1] = kept;
        }
        if (n_plain > 0) {
            compute_start = now_ns();
            native_execute(state, ordered, n_plain, plain, lane_of(owner, state, instance), exec_start, answered,
                           succeeded, deferred, &rows, text, sizeof text, &code);
            compute_end = now_ns();
            count_path(state, 0, n_plain);
        }
        if (n_other > 0) {
            uint64_t python_start = 0;
            PyGILState_STATE gil = PyGILState_Ensure();
            python_execute(state, ordered + n_plain, n_other, exec_start, answered + n_plain, succeeded + n_plain,
                           &python_start, &compute_end, text, sizeof text, &code);
            PyObject *scored = PyObject_GetAttrString(state->model, "rows");
            if (scored && PyLong_Check(scored)) rows += PyLong_AsUnsignedLongLong(scored);
            if (scored == NULL || PyErr_Occurred()) PyErr_Clear();
            Py_XDECREF(scored);
            PyGILState_Release(gil);
            count_path(state, 1, n_other);
            if (compute_start == 0) compute_start = python_start;
        }
    }
    free(plain);
    uint64_t exec_end = now_ns();

    for (uint32_t r = 0; r < request_count; r++) {
        if (deferred != NULL && deferred[r]) continue; /* the lane answers, reports and releases it */
        if (answered == NULL || !answered[r]) { /* its path failed as a whole: every request still gets an answer */
            char message[sizeof text + 32];
            snprintf(message, sizeof message, "the ranker failed: %s", text[0] ? text : "no answer");
            send_error(ordered[r], code, message);
        }
        Report item = {ordered[r], succeeded != NULL && succeeded[r], 0, exec_start, compute_start, compute_end, exec_end};
        report(reporter, instance, &item);
    }
    if (rows) {
        Report item = {NULL, true, rows, exec_start, compute_start, compute_end, exec_end};
        report(reporter, instance, &item);
    }
    table_metrics_update(state);
    if (ordered != requests) free(ordered);
    free(answered);
    free(succeeded);
    free(deferred);
    return NULL;
}
