/* The native backend's embedded interpreter (see backend_internal.h): it starts Python inside Triton's process,
 * loads the model's Python object, reads what it offers the C path, and scores every request that is not
 * plain through the model's execute, each bad request with its own error. */
#include "backend_internal.h"

/* The pending Python exception as text (and cleared), for an error message. */
void python_error_text(char *out, size_t size) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    const char *text = "unknown Python error";
    PyObject *str = value ? PyObject_Str(value) : NULL;
    PyObject *name = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    if (str && PyUnicode_Check(str)) text = PyUnicode_AsUTF8(str);
    const char *kind = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    snprintf(out, size, "%s: %s", kind ? kind : "Error", text ? text : "");
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

TRITONSERVER_Error *python_start(void) {
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

/* The model's C path from its ``plain`` attribute: ((Triton type, width) per input, output names, the
 * chain in C, the admission policy in C or None, split rows), or None when its release has none; then,
 * or when the installed modules offer other entry points, every call goes through the model's execute. */
void plain_spec(ModelState *state, const char *name) {
    PyObject *spec = PyObject_GetAttrString(state->model, "plain");
    if (spec == NULL) PyErr_Clear();
    PyObject *inputs, *outputs, *chain, *admission;
    long long split_rows;
    if (spec == NULL || spec == Py_None ||
        !PyArg_ParseTuple(spec, "O!O!OOL", &PyTuple_Type, &inputs, &PyTuple_Type, &outputs, &chain, &admission,
                          &split_rows)) {
        PyErr_Clear();
        Py_XDECREF(spec);
        char line[300];
        snprintf(line, sizeof line, "model '%s': every call is scored through its execute (it offers no C path here)", name);
        log_line(TS_LOG_INFO, line);
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
        const char *output = PyUnicode_Check(PyTuple_GET_ITEM(outputs, k)) ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(outputs, k)) : NULL;
        char *copy = output ? strdup(output) : NULL; /* NULL (no memory): no C path, every call through execute */
        usable = copy != NULL;
        if (copy) state->output_names[state->n_outputs++] = copy;
    }
    PyErr_Clear();
    const EnsembleChainApi *chain_api = usable ? PyCapsule_Import(ENSEMBLE_CHAIN_CAPSULE, 0) : NULL;
    const EnsembleAdmissionApi *admission_api =
        usable && admission != Py_None ? PyCapsule_Import(ENSEMBLE_ADMISSION_CAPSULE, 0) : NULL;
    if (usable && (chain_api == NULL || (admission != Py_None && admission_api == NULL) ||
                   chain_api->outputs(chain) != state->n_outputs)) {
        PyErr_Clear();
        log_line(TS_LOG_WARN, "the installed modules offer no C entry points of version " ENSEMBLE_API_VERSION
                 " (this backend was built by another install of the project: export the release "
                    "again); every call is scored through Python");
        usable = false;
    }
    if (usable) {
        state->chain = Py_NewRef(chain);
        state->admission = admission == Py_None ? NULL : Py_NewRef(admission);
        state->chain_api = chain_api;
        state->admission_api = admission_api;
        state->split_rows = split_rows;
        char line[300];
        snprintf(line, sizeof line, "model '%s': plain requests are planned and scored in C, any other through Python",
                 name);
        log_line(TS_LOG_INFO, line);
    }
    Py_DECREF(spec);
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
    ensure_model_families();
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
 * ensemble_engine_info{model, version, step, engine, recorded, declared} is 1 per DLRM step of a loaded
 * version (engine: what scores it here; recorded: what its release records, ensemble/models/engines.py;
 * declared: recorded's former name, the same value, kept for one release), and
 * ensemble_engine_substituted{model, version, step} is 1 when the two differ (the load logged why), else 0:
 * what an alert watches; ensemble_engine_undeclared, its former name, says the same for one release. The series
 * go when the version unloads. */
static TRITONSERVER_MetricFamily *engine_info_family, *engine_substituted_family, *engine_undeclared_family;

/* The series of the model's engines attribute ((step, engine, recorded) tuples), when it has one. Called
 * with the interpreter's lock held. */
void engine_metrics(ModelState *state, const char *name, uint64_t version) {
    PyObject *engines = PyObject_GetAttrString(state->model, "engines");
    if (engines == NULL || !PyTuple_Check(engines)) {
        PyErr_Clear();
        Py_XDECREF(engines);
        return;
    }
    if (engine_info_family == NULL) {
        engine_info_family = new_family(TS_METRIC_GAUGE, "ensemble_engine_info",
                                        "1 per DLRM step: the engine that scores it here and the one its release records "
                                        "(label recorded; declared: its former name)");
        if (engine_info_family != NULL) {
            engine_substituted_family = new_family(TS_METRIC_GAUGE, "ensemble_engine_substituted",
                                                   "1 when a DLRM step scores with another engine than its release records");
            engine_undeclared_family = new_family(TS_METRIC_GAUGE, "ensemble_engine_undeclared",
                                                  "deprecated: ensemble_engine_substituted's former name, kept for one "
                                                  "release");
        }
    }
    if (engine_info_family == NULL || engine_substituted_family == NULL || engine_undeclared_family == NULL) {
        log_line(TS_LOG_WARN, "the engine metrics could not be created");
        Py_DECREF(engines);
        return;
    }
    char version_text[24];
    snprintf(version_text, sizeof version_text, "%llu", (unsigned long long)version);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(engines) && state->n_metrics + 3 <= ENGINE_METRICS; i++) {
        const char *step, *engine, *recorded;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(engines, i), "sss", &step, &engine, &recorded)) {
            PyErr_Clear();
            continue;
        }
        const char *info_names[] = {"model", "version", "step", "engine", "recorded", "declared"};
        const char *info_values[] = {name, version_text, step, engine, recorded, recorded};
        TRITONSERVER_Metric *info = labelled(engine_info_family, info_names, info_values, 6, 1.0);
        const double other = strcmp(engine, recorded) != 0 && strcmp(recorded, "none") != 0;
        TRITONSERVER_Metric *off = labelled(engine_substituted_family, info_names, info_values, 3, other);
        TRITONSERVER_Metric *former = labelled(engine_undeclared_family, info_names, info_values, 3, other);
        if (info) state->metrics[state->n_metrics++] = info;
        if (off) state->metrics[state->n_metrics++] = off;
        if (former) state->metrics[state->n_metrics++] = former;
    }
    Py_DECREF(engines);
}

/* The pending Python exception as `problem` (and cleared), and the code a request that met it is answered
 * with: UNAVAILABLE when memory ran out (the client may retry), else INTERNAL. */
static int python_problem(char *problem, size_t problem_size) {
    const int code = PyErr_ExceptionMatches(PyExc_MemoryError) ? TS_ERROR_UNAVAILABLE : TS_ERROR_INTERNAL;
    python_error_text(problem, problem_size);
    return code;
}

/* One input as Python sees it: (datatype, shape, buffer) or None when the request lacks it. The
 * buffer is a read-only view of Triton's memory (valid until the request is released) or, when the
 * tensor arrived in pieces, a bytes copy. NULL with `problem` set when the input is there but cannot
 * be read here: the request is then answered with that error, of the request's own making (*code left
 * INVALID_ARG: a buffer in GPU memory, pieces that do not add up to its size) or not (no memory for
 * the copy, see python_problem). */
static PyObject *input_object(TRITONBACKEND_Request *request, const char *name, PyObject **view, char *problem,
                              size_t problem_size, int *code) {
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
            /* an empty piece may have no address */
            if (buffer_size > 0) memcpy(PyBytes_AS_STRING(data) + offset, buffer, (size_t)buffer_size);
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
    *code = python_problem(problem, problem_size);
fail:
    Py_XDECREF(data);
    if (problem[0] == '\0') snprintf(problem, problem_size, "input '%s' could not be read", name);
    return NULL;
}

/* (inputs, timeout_us, bulk, requested_outputs, release or None) for one request; NULL with `problem`
 * and its *code set when the request cannot be handed to Python (see input_object). */
static PyObject *request_object(ModelState *state, TRITONBACKEND_Request *request, PyObject *views, char *problem,
                                size_t problem_size, int *code) {
    PyObject *inputs = PyTuple_New(state->n_inputs), *outputs = NULL;
    for (int i = 0; inputs != NULL && i < state->n_inputs; i++) {
        PyObject *view = NULL;
        PyObject *value = input_object(request, state->input_names[i], &view, problem, problem_size, code);
        if (view && PyList_Append(views, view) < 0) { /* not released after the call: released now */
            *code = python_problem(problem, problem_size);
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
    const char *release = NULL, *shadow = NULL;
    int bulk = request_parameters(request, &release, &shadow);
    PyObject *release_object = backend_release_object(release);
    if (release_object == NULL) goto no_memory;
    PyObject *shadow_object = backend_release_object(shadow);
    if (shadow_object == NULL) {
        Py_DECREF(release_object);
        goto no_memory;
    }
    PyObject *result = Py_BuildValue("(NKONNN)", inputs, (unsigned long long)timeout_us, bulk ? Py_True : Py_False,
                                     outputs, release_object, shadow_object);
    if (result != NULL) return result;
    *code = python_problem(problem, problem_size); /* Py_BuildValue took inputs and outputs */
    return NULL;
no_memory:
    *code = python_problem(problem, problem_size);
fail:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    return NULL;
}

/* The release a request names (NULL: none), valid during the request. */
static const char *named_release(TRITONBACKEND_Request *request) {
    const char *release, *shadow;
    request_parameters(request, &release, &shadow);
    return release;
}

/* Send one answer: ("error", code, message) or ("ok", ((name, array), ...)). False when the
 * answer could not be built (the request then gets an INTERNAL error). Counted in the served scores,
 * and per release when the request names one (exec_start: the call's start). */
static bool send_answer(ModelState *state, TRITONBACKEND_Request *request, PyObject *answer, uint64_t exec_start) {
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(answer, 0));
    if (kind == NULL || strcmp(kind, "error") == 0) {
        /* the message's UTF-8 copy may need memory (then it is NULL, and send_error says "error") */
        long code = kind ? PyLong_AsLong(PyTuple_GET_ITEM(answer, 1)) : TS_ERROR_UNAVAILABLE;
        const char *message = kind ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(answer, 2)) : "out of memory for the answer";
        if (PyErr_Occurred()) PyErr_Clear();
        send_error(request, code >= 0 && code <= TS_ERROR_CANCELLED ? (int)code : TS_ERROR_INTERNAL, message);
        count_arm(state, named_release(request), false, now_ns() - exec_start, NULL, 0);
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
    Py_ssize_t served = -1; /* the answer's blended scores, counted once it is sent */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors) && problem == NULL; i++) {
        PyObject *pair = PyTuple_GET_ITEM(tensors, i);
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(pair, 0));
        if (name == NULL) { /* its UTF-8 copy needed memory */
            PyErr_Clear();
            problem = fail(TS_ERROR_UNAVAILABLE, "out of memory for an output's name");
            break;
        }
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
        if (problem == NULL && datatype == TS_TYPE_FP32 && (strcmp(name, "score") == 0 || strcmp(name, "scores") == 0))
            served = i;
        PyBuffer_Release(&view);
    }
    bool sent = send_final(response, problem);
    const uint64_t took = now_ns() - exec_start;
    Py_buffer view = {0};
    bool scored = sent && served >= 0; /* the blended scores, counted from the answer's array (still held by it) */
    if (scored && PyObject_GetBuffer(PyTuple_GET_ITEM(PyTuple_GET_ITEM(tensors, served), 1), &view,
                                     PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        scored = false;
    }
    const int64_t rows = scored ? (int64_t)(view.len / (Py_ssize_t)sizeof(float)) : 0;
    if (scored) count_scores(state->served, view.buf, rows);
    count_arm(state, named_release(request), sent, took, scored ? view.buf : NULL, rows);
    if (scored) PyBuffer_Release(&view);
    return sent;
}

/* Any other call, with the interpreter's lock held: the model's execute answers each request. */
void python_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t request_count,
                    uint64_t exec_start, bool *answered, bool *succeeded, uint64_t *compute_start,
                    uint64_t *compute_end, char *text, size_t text_size, TS_ErrorCode *code) {
    PyObject *views = PyList_New(0);
    PyObject *batch = PyList_New(0);
    uint32_t *request_at = malloc((request_count ? request_count : 1) * sizeof *request_at); /* batch -> call */
    if (views == NULL || batch == NULL || request_at == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        *code = (TS_ErrorCode)python_problem(text, text_size);
        goto done;
    }
    /* A request whose inputs cannot be read here is answered now with why; the rest go to Python. */
    for (uint32_t r = 0; r < request_count; r++) {
        char problem[400] = "";
        int problem_code = TS_ERROR_INVALID_ARG;
        PyObject *item = request_object(state, requests[r], views, problem, sizeof problem, &problem_code);
        if (item != NULL && PyList_Append(batch, item) < 0) {
            problem_code = python_problem(problem, sizeof problem);
            Py_CLEAR(item);
        }
        if (item == NULL) {
            send_error(requests[r], problem_code, problem);
            count_arm(state, named_release(requests[r]), false, now_ns() - exec_start, NULL, 0);
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
        if (handed) *code = (TS_ErrorCode)python_problem(text, text_size);
    } else {
        PyObject *item;
        while ((item = PyIter_Next(answers)) != NULL) {
            long index = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
            if (index >= 0 && index < handed && !answered[request_at[index]]) {
                succeeded[request_at[index]] = send_answer(state, requests[request_at[index]], PyTuple_GET_ITEM(item, 1),
                                                           exec_start);
                answered[request_at[index]] = true;
            }
            Py_DECREF(item);
        }
        if (PyErr_Occurred()) *code = (TS_ErrorCode)python_problem(text, text_size);
        Py_DECREF(answers);
    }
    *compute_end = now_ns();
    model_metrics(state); /* with the interpreter's lock held: the model's threads take turns here */
    shadow_python(state);
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
