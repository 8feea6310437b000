/* The native backend's metrics and statistics (see backend_internal.h): the metric families it adds to
 * Triton's, and each call's statistics, reported to Triton off the answering thread. */
#include "backend_internal.h"

#include <math.h> /* after: backend_internal.h defines _GNU_SOURCE first */

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

_Static_assert(sizeof model_family_specs / sizeof model_family_specs[0] == MODEL_FAMILIES,
               "MODEL_FAMILIES (backend_internal.h) counts the families");

static TRITONSERVER_MetricFamily *model_families[MODEL_FAMILIES];

static pthread_once_t model_families_once = PTHREAD_ONCE_INIT;

/* Which path scored each request: declared, so a C path that declines requests shows in the metrics. */
static TRITONSERVER_MetricFamily *path_family;

/* The served scores' histogram family (see "served scores" below). */
static TRITONSERVER_MetricFamily *served_family;

/* The per-release families (see "requests per arm" below): the scores' histogram; requests; seconds. */
static TRITONSERVER_MetricFamily *arm_families[3];
static const ModelFamily arm_specs[3] = {
    {"ensemble_arm_score", "blended scores answered, by the release a request named (a histogram)"},
    {"ensemble_arm_requests_total", "requests that named the release scoring them, by outcome: answered, failed"},
    {"ensemble_arm_request_seconds_total", "seconds from the call's start to the answer, by the release a request named"},
};

/* A metric family, or NULL when Triton cannot make it (its error dropped: the series are then left out). */
TRITONSERVER_MetricFamily *new_family(TS_MetricKind kind, const char *name, const char *help) {
    TRITONSERVER_MetricFamily *family = NULL;
    TRITONSERVER_Error *err = TRITONSERVER_MetricFamilyNew(&family, kind, name, help);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return NULL;
    }
    return family;
}

/* Counter families named and described by `specs` (NULL where one cannot be made). */
static void counter_families(TRITONSERVER_MetricFamily **families, const ModelFamily *specs, int n) {
    for (int f = 0; f < n; f++) families[f] = new_family(TS_METRIC_COUNTER, specs[f].name, specs[f].help);
}

static void create_model_families(void) {
    path_family = new_family(
        TS_METRIC_COUNTER, "ensemble_backend_requests_total",
        "requests the native backend scored, by path: c (planned and scored in C by the release's chain) or "
        "python (through the model's execute: a request that is not plain, or any request of a model without a C path)");
    served_family = new_family(TS_METRIC_HISTOGRAM, "ensemble_served_score",
                               "blended scores answered, by model version (a histogram: NaN, an item the online store "
                               "does not hold, is not a score)");
    arm_families[0] = new_family(TS_METRIC_HISTOGRAM, arm_specs[0].name, arm_specs[0].help);
    counter_families(arm_families + 1, arm_specs + 1, 2);
    counter_families(model_families, model_family_specs, MODEL_FAMILIES);
}

TRITONSERVER_Metric *model_series(ModelState *state, int family, const char *label) {
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

TRITONSERVER_Metric *labelled(TRITONSERVER_MetricFamily *family, const char *const *names,
                              const char *const *values, int count, double value) {
    const TRITONSERVER_Parameter *labels[METRIC_LABELS_MAX];
    if (count > METRIC_LABELS_MAX) return NULL;
    bool made = true; /* every label made: a value may be missing, and Triton may have no memory for one */
    for (int k = 0; k < count; k++) {
        labels[k] = values[k] ? TRITONSERVER_ParameterNew(names[k], TS_PARAMETER_STRING, values[k]) : NULL;
        made = made && labels[k] != NULL;
    }
    TRITONSERVER_Metric *metric = NULL;
    TRITONSERVER_Error *err = made ? TRITONSERVER_MetricNew(&metric, family, labels, (uint64_t)count) : NULL;
    for (int k = 0; k < count; k++)
        if (labels[k]) TRITONSERVER_ParameterDelete((TRITONSERVER_Parameter *)labels[k]);
    if (!made) return NULL;
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        return NULL;
    }
    if ((err = TRITONSERVER_MetricSet(metric, value))) TRITONSERVER_ErrorDelete(err);
    return metric;
}

/* A histogram series of `family` with these bucket bounds (the last bucket, +Inf, implied), labelled as
 * `labelled` labels; NULL when Triton cannot make it. */
TRITONSERVER_Metric *labelled_histogram(TRITONSERVER_MetricFamily *family, const char *const *names,
                                        const char *const *values, int count, const double *bounds, uint64_t n_bounds) {
    const TRITONSERVER_Parameter *labels[METRIC_LABELS_MAX];
    if (family == NULL || count > METRIC_LABELS_MAX) return NULL;
    bool made = true;
    for (int k = 0; k < count; k++) {
        labels[k] = values[k] ? TRITONSERVER_ParameterNew(names[k], TS_PARAMETER_STRING, values[k]) : NULL;
        made = made && labels[k] != NULL;
    }
    TRITONSERVER_Metric *metric = NULL;
    TRITONSERVER_MetricArgs *args = NULL;
    TRITONSERVER_Error *err = made ? TRITONSERVER_MetricArgsNew(&args) : NULL;
    if (made && err == NULL) err = TRITONSERVER_MetricArgsSetHistogram(args, bounds, n_bounds);
    if (made && err == NULL) err = TRITONSERVER_MetricNewWithArgs(&metric, family, labels, (uint64_t)count, args);
    if (err) {
        TRITONSERVER_ErrorDelete(err);
        metric = NULL;
    }
    if (args && (err = TRITONSERVER_MetricArgsDelete(args))) TRITONSERVER_ErrorDelete(err);
    for (int k = 0; k < count; k++)
        if (labels[k]) TRITONSERVER_ParameterDelete((TRITONSERVER_Parameter *)labels[k]);
    return made ? metric : NULL;
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

void *reporter_main(void *arg) {
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
bool another_core(void) {
    cpu_set_t cores;
    return sched_getaffinity(0, sizeof cores, &cores) == 0 && CPU_COUNT(&cores) > 1;
}

/* Hands a report to the reporter, or makes it here when there is none or its queue is full. */
void report(Reporter *reporter, TRITONBACKEND_ModelInstance *instance, const Report *item) {
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
void stop_worker(pthread_mutex_t *lock, pthread_cond_t *wake, bool *stop, pthread_t thread) {
    pthread_mutex_lock(lock);
    *stop = true;
    pthread_cond_signal(wake);
    pthread_mutex_unlock(lock);
    pthread_join(thread, NULL);
}

/* Adds `requests` to the version's ensemble_backend_requests_total series of `path` (0: c, 1: python). */
void count_path(ModelState *state, int path, uint32_t requests) {
    if (state->path_metrics[path] == NULL || requests == 0) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricIncrement(state->path_metrics[path], (double)requests);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* The version's ensemble_backend_requests_total series: path "c" when the model has the C path, and
 * "python" (NULL where a series cannot be made). Called after plain_spec. */
void create_path_metrics(ModelState *state, const char *name, uint64_t version) {
    pthread_once(&model_families_once, create_model_families);
    for (int k = state->chain != NULL ? 0 : 1; k < 2 && path_family != NULL; k++) {
        char version_text[24];
        snprintf(version_text, sizeof version_text, "%llu", (unsigned long long)version);
        const char *names[] = {"model", "version", "path"};
        const char *values[] = {name, version_text, k == 0 ? "c" : "python"};
        state->path_metrics[k] = labelled(path_family, names, values, 3, 0.0);
    }
}

/* The model's own counter families, created once per process. */
void ensure_model_families(void) { pthread_once(&model_families_once, create_model_families); }

/* ----- served scores -----
 *
 * Each version observes the blended score of every row it answers (the ranker's "score", the rank model's
 * "scores"; NaN, an item the online store does not hold, is not a score) in the histogram
 * ensemble_served_score{model, version} (its _bucket{le}, _count and _sum series, typed histogram in
 * Prometheus's metadata), after the answer is sent. Scores are probabilities: the bounds are finer near 0,
 * where most of them lie. */
static const double score_bounds[] = {0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99};
#define SCORE_BOUNDS (sizeof score_bounds / sizeof score_bounds[0])

void create_served_metrics(ModelState *state) {
    pthread_once(&model_families_once, create_model_families);
    const char *names[2] = {"model", "version"};
    const char *values[2] = {state->metric_model, state->metric_version};
    state->served = labelled_histogram(served_family, names, values, 2, score_bounds, SCORE_BOUNDS);
}

static void add(TRITONSERVER_Metric *metric, double value) {
    if (metric == NULL) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricIncrement(metric, value);
    if (err) TRITONSERVER_ErrorDelete(err);
}

void count_scores(TRITONSERVER_Metric *histogram, const float *scores, int64_t rows) {
    if (histogram == NULL) return;
    for (int64_t i = 0; i < rows; i++) {
        if (isnan(scores[i])) continue;
        TRITONSERVER_Error *err = TRITONSERVER_MetricObserve(histogram, (double)scores[i]);
        if (err) {
            TRITONSERVER_ErrorDelete(err);
            return;
        }
    }
}

static void delete_series(TRITONSERVER_Metric **series, int n) {
    for (int k = 0; k < n; k++) {
        if (series[k] == NULL) continue;
        TRITONSERVER_Error *gone = TRITONSERVER_MetricDelete(series[k]);
        if (gone) TRITONSERVER_ErrorDelete(gone);
        series[k] = NULL;
    }
}

void delete_served_metrics(ModelState *state) {
    delete_series(&state->served, 1);
    for (int a = 0; a < state->n_arms; a++) delete_series(state->arms[a].series, ARM_METRICS);
    state->n_arms = 0;
}

/* ----- requests per arm -----
 *
 * A request that names the release scoring it (the "ensemble-release" parameter: during an experiment
 * the gateway names each request's arm) and is answered through the model's execute (a ranking
 * request) is counted per release as well: ensemble_arm_requests_total{model, version, release,
 * outcome} (answered or failed), ensemble_arm_request_seconds_total{model, version, release} (from the
 * call's start to the answer) and its answer's scores in the histogram ensemble_arm_score{..., release}. A release gets series once a request naming it is answered (so it is one this server
 * scores with, not any text a client sends), up to ARM_RELEASES per version; failures count for
 * releases that have series. Called with the interpreter's lock held, which guards the table. */

/* The series of `release` (decimal digits), created when `create`; NULL when it has none. */
static TRITONSERVER_Metric **arm_series(ModelState *state, const char *release, bool create) {
    size_t length = strlen(release);
    if (length == 0 || length >= sizeof state->arms[0].release || strspn(release, "0123456789") != length) return NULL;
    for (int a = 0; a < state->n_arms; a++)
        if (strcmp(state->arms[a].release, release) == 0) return state->arms[a].series;
    if (!create || state->n_arms >= ARM_RELEASES) return NULL;
    pthread_once(&model_families_once, create_model_families);
    TRITONSERVER_Metric **series = state->arms[state->n_arms].series;
    snprintf(state->arms[state->n_arms].release, sizeof state->arms[0].release, "%s", release);
    const char *names[4] = {"model", "version", "release"};
    const char *values[4] = {state->metric_model, state->metric_version, release};
    series[ARM_SCORES] = labelled_histogram(arm_families[0], names, values, 3, score_bounds, SCORE_BOUNDS);
    names[3] = "outcome";
    for (int k = 0; k < 2 && arm_families[1] != NULL; k++) {
        values[3] = k == 0 ? "answered" : "failed";
        series[ARM_ANSWERED + k] = labelled(arm_families[1], names, values, 4, 0.0);
    }
    if (arm_families[2] != NULL) series[ARM_SECONDS] = labelled(arm_families[2], names, values, 3, 0.0);
    state->n_arms++;
    return series;
}

void count_arm(ModelState *state, const char *release, bool answered, uint64_t nanoseconds, const float *scores,
               int64_t rows) {
    if (release == NULL) return;
    TRITONSERVER_Metric **series = arm_series(state, release, answered);
    if (series == NULL) return;
    add(series[answered ? ARM_ANSWERED : ARM_FAILED], 1.0);
    add(series[ARM_SECONDS], (double)nanoseconds * 1e-9);
    if (scores != NULL) count_scores(series[ARM_SCORES], scores, rows);
}
