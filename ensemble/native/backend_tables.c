/* The native backend's row store metrics (see backend_internal.h): per DLRM step of a loaded version whose
 * tables are a row store's (ensemble/tables), per table: lookups, unique keys, hot hits (on unique keys), cold
 * rows, blocks and bytes, read failures by kind, and hot rows; per step: the hot tier's bytes and the cold
 * reads' latency (a histogram: cumulative _bucket counters by le, _count, _sum). The counters are read from
 * the Stores without the interpreter's lock (api.h's EnsembleTablesStatsApi) after each call and added to
 * Triton's as increments, one caller at a time; the series go when the version unloads. */
#include "backend_internal.h"

#define STEPS 2        /* row store steps a version may have: both DLRMs */
#define MAX_TABLES 64  /* tables a store may have (ensemble/native/_tables.c) */

enum { F_LOOKUPS, F_UNIQUE, F_HITS, F_COLD_ROWS, F_COLD_BLOCKS, F_COLD_BYTES, F_FAILURES, F_HOT_ROWS, F_HOT_BYTES,
       F_READ_BUCKET, F_READ_COUNT, F_READ_SUM, F_READING, FAMILIES };

static const struct {
    const char *name, *help;
    TS_MetricKind kind;
} specs[FAMILIES] = {
    {"ensemble_table_lookups_total", "ids a row store's table was asked for (every position of every row)", TS_METRIC_COUNTER},
    {"ensemble_table_unique_keys_total", "distinct ids a row store's table was asked for, per call", TS_METRIC_COUNTER},
    {"ensemble_table_hot_hits_total",
     "distinct ids answered from RAM (a small table, the hot tier, a release's delta): the hit rate's numerator",
     TS_METRIC_COUNTER},
    {"ensemble_table_cold_rows_total", "distinct ids read from disk", TS_METRIC_COUNTER},
    {"ensemble_table_cold_blocks_total", "4 KiB blocks read from disk (rows of one block read once per call)",
     TS_METRIC_COUNTER},
    {"ensemble_table_cold_bytes_total", "bytes read from disk", TS_METRIC_COUNTER},
    {"ensemble_table_read_failures_total",
     "calls a table failed, by kind: read_error, checksum (a block that fails its CRC: its rows are never scored), "
     "deadline (cold reads past the request's deadline); each answered UNAVAILABLE",
     TS_METRIC_COUNTER},
    {"ensemble_table_hot_rows", "rows of a table in the hot tier", TS_METRIC_GAUGE},
    {"ensemble_table_hot_bytes", "bytes of rows in a step's hot tier", TS_METRIC_GAUGE},
    {"ensemble_table_read_seconds_bucket",
     "calls whose cold reads took at most le seconds (cumulative: a histogram's buckets)", TS_METRIC_COUNTER},
    {"ensemble_table_read_seconds_count", "calls that read cold rows", TS_METRIC_COUNTER},
    {"ensemble_table_read_seconds_sum", "seconds calls spent reading cold rows", TS_METRIC_COUNTER},
    {"ensemble_table_reading_seconds_total",
     "seconds during which the server read cold rows, calls that overlap counted once (with one request in flight: "
     "its cold-read time); the process's total split among the versions that report it",
     TS_METRIC_COUNTER},
};

static TRITONSERVER_MetricFamily *families[FAMILIES];
static pthread_once_t families_once = PTHREAD_ONCE_INIT;

static void create_families(void) {
    for (int f = 0; f < FAMILIES; f++) families[f] = new_family(specs[f].kind, specs[f].name, specs[f].help);
}

/* One table's series: its counters (three failure kinds) and its hot rows; what was reported last. */
enum { S_LOOKUPS, S_UNIQUE, S_HITS, S_COLD_ROWS, S_COLD_BLOCKS, S_COLD_BYTES, S_READ_ERROR, S_CHECKSUM, S_DEADLINE,
       S_HOT_ROWS, SERIES };
/* each series' counter in api.h's order */
static const int counter_of[SERIES] = {ENSEMBLE_TABLE_LOOKUPS, ENSEMBLE_TABLE_UNIQUE, ENSEMBLE_TABLE_HITS,
                                       ENSEMBLE_TABLE_COLD_ROWS, ENSEMBLE_TABLE_COLD_BLOCKS, ENSEMBLE_TABLE_COLD_BYTES,
                                       ENSEMBLE_TABLE_READ_ERRORS, ENSEMBLE_TABLE_CHECKSUM_ERRORS, ENSEMBLE_TABLE_LATE,
                                       ENSEMBLE_TABLE_HOT_ROWS};

typedef struct {
    PyObject *store;
    char step[32];
    int tables;
    TRITONSERVER_Metric *series[MAX_TABLES][SERIES];
    uint64_t last[MAX_TABLES][ENSEMBLE_TABLE_COUNTERS];
    TRITONSERVER_Metric *hot_bytes, *buckets[ENSEMBLE_READ_BUCKETS], *count, *sum;
    uint64_t last_buckets[ENSEMBLE_READ_BUCKETS];
    double last_seconds;
} StoreMetrics;

struct TableMetrics {
    pthread_mutex_t lock; /* one caller reports at a time: increments are differences from `last` */
    const EnsembleTablesStatsApi *api;
    int n;
    StoreMetrics stores[STEPS];
    TRITONSERVER_Metric *reading;
};

/* The process's reading seconds already reported (by any version's series). */
static pthread_mutex_t reading_lock = PTHREAD_MUTEX_INITIALIZER;
static double reading_reported;

static TRITONSERVER_Metric *series_of(int family, const char *model, const char *version, const char *step,
                                      const char *label, const char *value) {
    if (families[family] == NULL) return NULL;
    const char *names[] = {"model", "version", "step", label};
    const char *values[] = {model, version, step, value};
    return labelled(families[family], names, values, label ? 4 : 3, 0.0);
}

/* Reads the model's `tables` ((step, Store) pairs) and makes their series; with the interpreter's lock held.
 * A model without row stores (or a failure to make them, logged) leaves state->tables NULL. */
void table_metrics_create(ModelState *state, const char *name, uint64_t version) {
    PyObject *tables = PyObject_GetAttrString(state->model, "tables");
    if (tables == NULL || !PyTuple_Check(tables) || PyTuple_GET_SIZE(tables) == 0) {
        PyErr_Clear();
        Py_XDECREF(tables);
        return;
    }
    const EnsembleTablesStatsApi *api = PyCapsule_Import(ENSEMBLE_TABLES_STATS_CAPSULE, 0);
    TableMetrics *m = calloc(1, sizeof *m);
    if (api == NULL || m == NULL) {
        PyErr_Clear();
        free(m);
        Py_DECREF(tables);
        log_line(TS_LOG_WARN, "the row store metrics could not be set up (no _tables module of this API, or no memory)");
        return;
    }
    pthread_once(&families_once, create_families);
    pthread_mutex_init(&m->lock, NULL);
    m->api = api;
    char version_text[24];
    snprintf(version_text, sizeof version_text, "%llu", (unsigned long long)version);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tables) && m->n < STEPS; i++) {
        const char *step;
        PyObject *store;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tables, i), "sO", &step, &store)) {
            PyErr_Clear();
            continue;
        }
        StoreMetrics *s = &m->stores[m->n++];
        s->store = Py_NewRef(store);
        snprintf(s->step, sizeof s->step, "%s", step);
        s->tables = api->tables(store) < MAX_TABLES ? api->tables(store) : MAX_TABLES;
        static const int family_of[SERIES] = {F_LOOKUPS, F_UNIQUE, F_HITS, F_COLD_ROWS, F_COLD_BLOCKS, F_COLD_BYTES,
                                              F_FAILURES, F_FAILURES, F_FAILURES, F_HOT_ROWS};
        static const char *kinds[SERIES] = {[S_READ_ERROR] = "read_error", [S_CHECKSUM] = "checksum",
                                            [S_DEADLINE] = "deadline"};
        for (int t = 0; t < s->tables; t++) {
            const char *table = api->name(store, t);
            for (int k = 0; k < SERIES; k++) {
                if (kinds[k] == NULL) {
                    s->series[t][k] = series_of(family_of[k], name, version_text, step, "table", table);
                    continue;
                }
                const char *names[] = {"model", "version", "step", "table", "kind"};
                const char *values[] = {name, version_text, step, table, kinds[k]};
                s->series[t][k] = families[F_FAILURES] ? labelled(families[F_FAILURES], names, values, 5, 0.0) : NULL;
            }
        }
        s->hot_bytes = series_of(F_HOT_BYTES, name, version_text, step, NULL, NULL);
        s->count = series_of(F_READ_COUNT, name, version_text, step, NULL, NULL);
        s->sum = series_of(F_READ_SUM, name, version_text, step, NULL, NULL);
        for (int b = 0; b < ENSEMBLE_READ_BUCKETS; b++) {
            char le[32];
            if (b < ENSEMBLE_READ_BUCKETS - 1)
                snprintf(le, sizeof le, "%g", api->bounds_ms[b] / 1e3);
            else
                snprintf(le, sizeof le, "+Inf");
            s->buckets[b] = series_of(F_READ_BUCKET, name, version_text, step, "le", le);
        }
    }
    if (families[F_READING] != NULL) {
        const char *names[] = {"model", "version"};
        const char *values[] = {name, version_text};
        m->reading = labelled(families[F_READING], names, values, 2, 0.0);
    }
    Py_DECREF(tables);
    state->tables = m;
}

static void add(TRITONSERVER_Metric *metric, double increment) {
    if (metric == NULL || !(increment > 0)) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricIncrement(metric, increment);
    if (err) TRITONSERVER_ErrorDelete(err);
}

static void set(TRITONSERVER_Metric *metric, double value) {
    if (metric == NULL) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricSet(metric, value);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* Adds what the stores counted since the last report (no interpreter's lock needed: the model holds the
 * stores, and the state holds a reference to each). A caller that finds another reporting skips: the next
 * call reports both. */
void table_metrics_update(ModelState *state) {
    TableMetrics *m = state->tables;
    if (m == NULL || pthread_mutex_trylock(&m->lock) != 0) return;
    for (int i = 0; i < m->n; i++) {
        StoreMetrics *s = &m->stores[i];
        for (int t = 0; t < s->tables; t++) {
            uint64_t now[ENSEMBLE_TABLE_COUNTERS];
            m->api->counters(s->store, t, now);
            for (int k = 0; k < SERIES; k++) {
                const int c = counter_of[k];
                if (k == S_HOT_ROWS)
                    set(s->series[t][k], (double)now[c]);
                else
                    add(s->series[t][k], (double)(now[c] - s->last[t][c]));
            }
            memcpy(s->last[t], now, sizeof now);
        }
        set(s->hot_bytes, (double)m->api->hot_bytes(s->store));
        uint64_t buckets[ENSEMBLE_READ_BUCKETS];
        double seconds;
        m->api->reads(s->store, buckets, &seconds);
        uint64_t added = 0; /* the new calls at or below each bound: a cumulative bucket's increment */
        for (int b = 0; b < ENSEMBLE_READ_BUCKETS; b++) {
            added += buckets[b] - s->last_buckets[b];
            add(s->buckets[b], (double)added);
        }
        add(s->count, (double)added);
        add(s->sum, seconds - s->last_seconds);
        memcpy(s->last_buckets, buckets, sizeof buckets);
        s->last_seconds = seconds;
    }
    pthread_mutex_lock(&reading_lock);
    const double reading = m->api->reading_seconds();
    add(m->reading, reading - reading_reported);
    reading_reported = reading;
    pthread_mutex_unlock(&reading_lock);
    pthread_mutex_unlock(&m->lock);
}

static void delete_metric(TRITONSERVER_Metric *metric) {
    if (metric == NULL) return;
    TRITONSERVER_Error *err = TRITONSERVER_MetricDelete(metric);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* The series go and the stores are let go (with the interpreter's lock held). */
void table_metrics_delete(ModelState *state) {
    TableMetrics *m = state->tables;
    if (m == NULL) return;
    for (int i = 0; i < m->n; i++) {
        StoreMetrics *s = &m->stores[i];
        for (int t = 0; t < s->tables; t++)
            for (int k = 0; k < SERIES; k++) delete_metric(s->series[t][k]);
        delete_metric(s->hot_bytes);
        delete_metric(s->count);
        delete_metric(s->sum);
        for (int b = 0; b < ENSEMBLE_READ_BUCKETS; b++) delete_metric(s->buckets[b]);
        Py_XDECREF(s->store);
    }
    delete_metric(m->reading);
    pthread_mutex_destroy(&m->lock);
    free(m);
    state->tables = NULL;
}
