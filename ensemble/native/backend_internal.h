/* The native backend's own declarations, shared by its files (one library, libtriton_native.so):
 *
 *   backend.c              Triton's entry points (backend, model, instance, execute)
 *   backend_interpreter.c  the Python interpreter embedded in Triton's process: starting it, the model's
 *                          objects, and the per-request path through the model's execute
 *   backend_plain.c        plain requests planned and scored in C by the release's chain; the bulk lane
 *   backend_statistics.c   metric families and series; statistics reported off the answering thread
 *   backend_io.c           what they all use of Triton: the clock, errors, log lines, a request's
 *                          parameters and its answers
 *   backend_shadow.c       shadow scoring during an experiment: the loaded versions' chains, the score
 *                          differences and top-k overlaps as histograms
 *   backend_tables.c       a row store's metrics (tables larger than memory: ensemble/tables)
 *
 * Nothing here is exported: the library is built with -fvisibility=hidden and only the TRITONBACKEND_
 * entry points (triton_api.h) are visible to Triton. The C entry points the Python modules share with
 * each other and with this backend are in api.h; what the backend checks of a request's own bytes is in
 * backend_checks.h.
 */
#ifndef ENSEMBLE_BACKEND_INTERNAL_H
#define ENSEMBLE_BACKEND_INTERNAL_H

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
#include "api.h"
#include "triton_api.h"

#ifndef PYTHON_LIBRARY /* setup.py names the one this interpreter was built with */
#define PYTHON_LIBRARY "libpython3.11.so.1.0"
#endif
#define ENTRY_MODULE "ensemble.serving.embedded"

/* ----- model and instance state ----- */

#define PLAIN_INPUTS 4   /* the most inputs a plain call may have */
#define PLAIN_OUTPUTS 16 /* the most outputs it may answer */
#define ENGINE_METRICS 8 /* series of the engine metrics one model version holds */
#define MODEL_FAMILIES 4 /* families of the models' own counters (backend_statistics.c) */
#define MODEL_SERIES 16  /* series of the model's own counters one model version holds */
#define SHADOW_SERIES 32 /* series of shadow scoring one model version holds */
#define ARM_RELEASES 8   /* releases one model version counts requests for (backend_statistics.c) */
/* one release's series: its score histogram, then answered and failed requests, then seconds */
enum { ARM_SCORES, ARM_ANSWERED, ARM_FAILED, ARM_SECONDS, ARM_METRICS };

typedef struct {
    PyObject *model;        /* ensemble.serving.embedded.Model */
    int n_inputs;
    char **input_names;
    /* The C path (see "a plain call"), when the model has one: each input's type and width (in
     * input_names order), and the names of the score array's rows. */
    TS_DataType plain_type[PLAIN_INPUTS];
    int64_t plain_width[PLAIN_INPUTS];
    int n_outputs;
    char *output_names[PLAIN_OUTPUTS];
    /* The chain and the admission policy of the C path (NULL: the model has no C path; the admission
     * NULL too when the model plans no admission), held, read through their modules' entry points; and
     * from how many rows the chain scores a call on two threads (0: never). */
    PyObject *chain, *admission;
    const EnsembleChainApi *chain_api;
    const EnsembleAdmissionApi *admission_api;
    int64_t split_rows;
    /* The nice value the model's instance threads take on their first call (0: left as they are). */
    int thread_nice;
    /* The bulk lane's limits, read from the model's lane_limits (ensemble/serving/lane.py: the one set the
     * fused ranker's Python lane reads too): requests it holds, its thread's nice value, and how recently an
     * interactive request must have been served for bulk requests to go to it. */
    int lane_requests, lane_nice;
    uint64_t lane_yield_ns;
    /* When a call last held an interactive request (now_ns; 0: never): bulk requests go to the bulk
     * lane while one did within the last lane_yield_ns. Written and read with __atomic builtins. */
    uint64_t interactive_ns;
    /* This version's ensemble_backend_requests_total series: [0] path "c", [1] path "python". */
    TRITONSERVER_Metric *path_metrics[2];
    /* This version's ensemble_engine_info, ensemble_engine_substituted and its former name's series, three per DLRM step. */
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
    /* The histogram of the blended scores this version answers (backend_statistics.c; NULL: not counted);
     * the blended score's row in the C path's score array (-1: none). */
    TRITONSERVER_Metric *served;
    int score_output;
    /* The releases requests named, each with its series (backend_statistics.c, "requests per arm"). */
    int n_arms;
    struct {
        char release[24];
        TRITONSERVER_Metric *series[ARM_METRICS];
    } arms[ARM_RELEASES];
    /* Shadow scoring (backend_shadow.c): the model's shadow_updates method, when it has one, and the
     * series created so far (kind, candidate release), guarded by the shadow module's lock. */
    PyObject *shadow_updates;
    PyObject *shadow_chain; /* ensemble.serving.embedded.shadow_chain, when the model has a C path */
    /* A row store's metrics (backend_tables.c), when the model's DLRMs keep their tables in one; else NULL. */
    struct TableMetrics *tables;
    int n_shadow;
    struct {
        int kind;
        uint64_t candidate;
        TRITONSERVER_Metric *metric;
    } shadow[SHADOW_SERIES];
} ModelState;

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

/* A model instance's state: its reporter (NULL: reports are made on the answering thread) and its
 * bulk lane (NULL until a call first hands it a request; see "the bulk lane" below). */
typedef struct Lane Lane;

typedef struct {
    Reporter *reporter;
    Lane *lane;
} Instance;

typedef struct {
    const void *data[PLAIN_INPUTS];
    uint64_t size[PLAIN_INPUTS];
    int64_t rows;
    uint64_t timeout_us;
    uint32_t wanted;    /* bit k: output k asked for */
    int bulk;           /* marked bulk by its client */
    const char *shadow; /* the releases that score it too (the "ensemble-shadow" parameter), or NULL */
} PlainRequest;


/* backend_io.c: the clock, errors, log lines, a request's parameters and its answers */
TRITONSERVER_Error *add_output(TRITONBACKEND_Response *response, const char *name, TS_DataType datatype,
                               const int64_t *shape, uint32_t dims, const void *data, uint64_t size);
TRITONSERVER_Error *fail(TS_ErrorCode code, const char *format, ...);
void log_line(TS_LogLevel level, const char *message);
uint64_t now_ns(void);
int request_parameters(TRITONBACKEND_Request *request, const char **release, const char **shadow);
void send_error(TRITONBACKEND_Request *request, int code, const char *message);
bool send_final(TRITONBACKEND_Response *response, TRITONSERVER_Error *problem);

/* backend_interpreter.c: the embedded interpreter and the per-request path through the model's execute */
void engine_metrics(ModelState *state, const char *name, uint64_t version);
void plain_spec(ModelState *state, const char *name);
void python_error_text(char *out, size_t size);
void python_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t request_count,
                    uint64_t exec_start, bool *answered, bool *succeeded, uint64_t *compute_start,
                    uint64_t *compute_end, char *text, size_t text_size, TS_ErrorCode *code);
TRITONSERVER_Error *python_start(void);

/* backend_statistics.c: metrics and the statistics reported off the answering thread */
bool another_core(void);
void count_path(ModelState *state, int path, uint32_t requests);
void create_path_metrics(ModelState *state, const char *name, uint64_t version);
void ensure_model_families(void);
void create_served_metrics(ModelState *state);
void count_scores(TRITONSERVER_Metric *histogram, const float *scores, int64_t rows);
void count_arm(ModelState *state, const char *release, bool answered, uint64_t nanoseconds, const float *scores,
               int64_t rows);
void delete_served_metrics(ModelState *state);
TRITONSERVER_MetricFamily *new_family(TS_MetricKind kind, const char *name, const char *help);
#define METRIC_LABELS_MAX 6 /* the most labels a series of labelled() / labelled_histogram() carries */
TRITONSERVER_Metric *labelled(TRITONSERVER_MetricFamily *family, const char *const *names,
                              const char *const *values, int count, double value);
TRITONSERVER_Metric *labelled_histogram(TRITONSERVER_MetricFamily *family, const char *const *names,
                                        const char *const *values, int count, const double *bounds, uint64_t n_bounds);
TRITONSERVER_Metric *model_series(ModelState *state, int family, const char *label);
void report(Reporter *reporter, TRITONBACKEND_ModelInstance *instance, const Report *item);
void *reporter_main(void *arg);
void stop_worker(pthread_mutex_t *lock, pthread_cond_t *wake, bool *stop, pthread_t thread);

/* backend_built.c: which C modules this install has, as a metric (once, at the first model load) */
void c_module_metrics(void);

/* backend_tables.c: a row store's metrics */
typedef struct TableMetrics TableMetrics;
void table_metrics_create(ModelState *state, const char *name, uint64_t version);
void table_metrics_update(ModelState *state);
void table_metrics_delete(ModelState *state);

/* backend_plain.c: plain requests planned and scored in C, and the bulk lane */
Lane *lane_of(Instance *owner, ModelState *state, TRITONBACKEND_ModelInstance *instance);
void lane_stop(Lane *lane);
void native_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t count,
                    const PlainRequest *plain, Lane *lane, uint64_t handed_ns, bool *answered, bool *succeeded,
                    bool *deferred, uint64_t *rows, char *text, size_t text_size, TS_ErrorCode *code);
bool plain_request(const ModelState *state, TRITONBACKEND_Request *request, PlainRequest *out);

/* backend_shadow.c: shadow scoring during an experiment */
void shadow_register(ModelState *state);
typedef struct ShadowWork ShadowWork;
ShadowWork *shadow_take(ModelState *state, const PlainRequest *request, const float *scores, int64_t offset);
void shadow_run(ModelState *state, ShadowWork *work);
void shadow_drop(ShadowWork *work);
void shadow_python(ModelState *state);
void shadow_series_delete(ModelState *state);

/* ----- allocations that fail on demand -----
 *
 * Every allocation of the backend's own is checked: one that fails answers the requests it was for with
 * an error (UNAVAILABLE when a call's memory ran out: the client may retry), never a crash. To test that,
 * tests/fuzz/sanitize.py builds the backend with -DENSEMBLE_ALLOC_FAULTS; ENSEMBLE_ALLOC_FAULTS=N in the
 * server's environment then fails every Nth malloc, calloc and strdup of this code from the first call on
 * (a model loads as usual). Any other build calls the C library directly, at no cost. */
#ifdef ENSEMBLE_ALLOC_FAULTS
void faults_arm(void);
void *fault_malloc(size_t size);
void *fault_calloc(size_t count, size_t size);
char *fault_strdup(const char *text);
#define malloc(size) fault_malloc(size)
#define calloc(count, size) fault_calloc(count, size)
#define strdup(text) fault_strdup(text)
#define FAULTS_ARM() faults_arm()
#else
#define FAULTS_ARM() ((void)0)
#endif

#endif
