/* Which of the project's C modules this install has, as a metric: ensemble_c_module_built{module} is 1 for a
 * module that is built and 0 for one that is not (ensemble/native/built.py says what serves in its place; a
 * missing one costs speed, never answers). Made once, at the first model load, with the interpreter's lock
 * held; each missing module is also a warning in the server's log. The series describe the install, so they
 * stay until the server stops. */
#include "backend_internal.h"

#define MODULE_SERIES 32 /* more than the modules setup.py builds */

static pthread_once_t made = PTHREAD_ONCE_INIT;
/* Held here for the life of the process (a series dropped by every pointer would be a leak). */
static TRITONSERVER_MetricFamily *family;
static TRITONSERVER_Metric *series[MODULE_SERIES];
static int n_series;

static void make_series(void) {
    PyObject *module = PyImport_ImportModule("ensemble.native.built");
    PyObject *found = module ? PyObject_CallMethod(module, "built", NULL) : NULL;
    PyObject *lines = module ? PyObject_CallMethod(module, "missing_lines", NULL) : NULL;
    Py_XDECREF(module);
    if (found == NULL || !PyDict_Check(found) || lines == NULL || !PyList_Check(lines)) {
        PyErr_Clear();
        Py_XDECREF(found);
        Py_XDECREF(lines);
        log_line(TS_LOG_WARN, "which C modules are built could not be read (ensemble.native.built)");
        return;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lines); i++) {
        PyObject *item = PyList_GET_ITEM(lines, i);
        const char *line = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        if (line != NULL) log_line(TS_LOG_WARN, line);
        else PyErr_Clear();
    }
    family = new_family(
        TS_METRIC_GAUGE, "ensemble_c_module_built",
        "1 for a C module of this install that is built, 0 for one that is not (the log says what serves instead)");
    if (family == NULL) log_line(TS_LOG_WARN, "the ensemble_c_module_built metric could not be created");
    PyObject *key, *value;
    Py_ssize_t at = 0;
    while (family != NULL && n_series < MODULE_SERIES && PyDict_Next(found, &at, &key, &value)) {
        const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        if (name == NULL) {
            PyErr_Clear();
            continue;
        }
        const char *names[] = {"module"};
        const char *values[] = {name};
        series[n_series++] = labelled(family, names, values, 1, PyObject_IsTrue(value) == 1 ? 1.0 : 0.0);
    }
    Py_DECREF(found);
    Py_DECREF(lines);
}

void c_module_metrics(void) {
    pthread_once(&made, make_series);
}
