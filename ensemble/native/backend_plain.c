/* The native backend's C path (see backend_internal.h): plain requests planned by the compiled admission policy
 * and scored by the release's chain in C, without the interpreter's lock; and the bulk lane beside it. */
#include "backend_internal.h"

/* ----- a plain call -----
 *
 * A call is scored on one of two paths. The requests that are plain (each input in its served type
 * and width, its rows in one CPU buffer, the strings well formed, only known outputs asked for) are
 * planned and scored in C by the release's chain (native_execute), bulk ones included, without the
 * interpreter's lock. Every other request goes through the model's execute (python_execute), which
 * gives each malformed one its own error; the plain requests of the same call keep the C path. A
 * release without the chain in C scores every request through execute. */

/* Whether a request is plain; if so, what the call needs of it. */
bool plain_request(const ModelState *state, TRITONBACKEND_Request *request, PlainRequest *out) {
    const char *release;
    out->bulk = request_parameters(request, &release, &out->shadow);
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
    bool sent = send_final(response, problem);
    if (sent && state->score_output >= 0 && (wanted & (1u << state->score_output)))
        count_scores(state->served, scores + state->score_output * total + offset, rows);
    return sent;
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
 * within the last lane_yield_ns), a call hands the bulk requests its plan takes to its instance's lane
 * and returns: the lane's thread scores them one at a time, in arrival order, at nice lane_nice (below
 * the model thread's), so an interactive request handed over meanwhile takes the core from it at once
 * (a running thread of equal weight would finish its time slice first). The lane holds at most
 * lane_requests requests; more are refused (UNAVAILABLE, retryable). The three limits are the model's
 * (ensemble/serving/lane.py, read at load: the fused ranker's Python lane reads the same). A request
 * that has waited in the lane past its own timeout is refused when its turn comes. Unloading the model first answers every
 * request the lane holds. While the lane holds requests, later bulk requests join it too, so they are
 * scored in arrival order and the model thread stays free for interactive requests that a starved
 * client sends late. Bulk requests on a server with no interactive traffic and an empty lane are
 * scored in the call, as before, on the model thread. */

/* What the lane did with a request: the `outcome` label of ensemble_bulk_lane_requests_total. */
enum { LANE_SCORED, LANE_FAILED, LANE_REFUSED_FULL, LANE_REFUSED_LATE, LANE_OUTCOMES };

static const char *const lane_outcome_names[LANE_OUTCOMES] = {"scored", "failed", "refused_full", "refused_late"};

/* ensemble_bulk_lane_waiting{model, version}: the requests a version's lane holds now;
 * ensemble_bulk_lane_requests_total{model, version, outcome}: what it did with them. */
static TRITONSERVER_MetricFamily *lane_waiting_family, *lane_total_family;

static pthread_once_t lane_families_once = PTHREAD_ONCE_INIT;

static void lane_families(void) {
    lane_waiting_family = new_family(
        TS_METRIC_GAUGE, "ensemble_bulk_lane_waiting",
        "bulk requests the native ranker's bulk lane holds now (handed to it beside interactive traffic)");
    lane_total_family = new_family(TS_METRIC_COUNTER, "ensemble_bulk_lane_requests_total",
                                   "bulk requests handed to the bulk lane, by outcome: scored, failed, "
                                   "refused_full (the lane held its limit), refused_late (past their timeout)");
}

/* When a request must be answered: its call's start and its client's timeout (CLOCK_MONOTONIC seconds; 0: no
 * timeout sent). A row store's cold reads may not pass it (ensemble/native/_tables.c). */
static double deadline_at(uint64_t handed_ns, uint64_t timeout_us) {
    return timeout_us ? (double)handed_ns * 1e-9 + (double)timeout_us * 1e-6 : 0.0;
}

/* A part of a call whose chain could not read a row store's rows in time (the chain answered -2): each of its
 * requests scored alone, answered with its scores, or UNAVAILABLE naming the table, so a block that fails its
 * checksum or a slow read fails only the requests whose rows it holds. */
static void answer_alone(ModelState *state, TRITONBACKEND_Request **requests, const PlainRequest *plain,
                         const int32_t *kept, const EnsemblePlan *plan, int32_t from, int32_t to, uint64_t handed_ns,
                         bool *answered, bool *succeeded, uint64_t *rows) {
    for (int32_t k = from; k < to; k++) {
        const int32_t r = kept[k < plan->n_first ? plan->first[k] : plan->bulk[k - plan->n_first]];
        const PlainRequest *p = &plain[r];
        float *scores = malloc((size_t)(p->rows ? p->rows : 1) * (size_t)state->n_outputs * sizeof(float));
        char text[ENSEMBLE_ERROR_SIZE] = "";
        int failed = -2; /* stays so without memory for the scores: UNAVAILABLE, the client may retry */
        if (scores == NULL) {
            snprintf(text, sizeof text, "out of memory for %lld rows", (long long)p->rows);
        } else {
            const float *dense = p->data[0];
            const unsigned char *wire = p->data[1];
            const uint64_t wire_size = p->size[1];
            failed = state->chain_api->score(state->chain, 1, &dense, &wire, &wire_size, &p->rows,
                                             chain_threads(state, p->rows), scores, text, sizeof text,
                                             deadline_at(handed_ns, p->timeout_us));
        }
        if (failed == 0) {
            succeeded[r] = send_scores(state, requests[r], scores, p->rows, 0, p->rows, p->wanted);
            *rows += (uint64_t)p->rows;
        } else {
            char message[ENSEMBLE_ERROR_SIZE + 32];
            snprintf(message, sizeof message, "the ranker failed: %s", text[0] ? text : "no answer");
            send_error(requests[r], failed == -2 ? TS_ERROR_UNAVAILABLE : TS_ERROR_INTERNAL, message);
        }
        answered[r] = true;
        free(scores);
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
    size_t capacity; /* the model's lane_requests */
    LaneItem *items;
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
            send_error(item->request, TS_ERROR_UNAVAILABLE, "out of memory for a bulk request's scores");
        } else {
            compute_start = now_ns();
            const int failed = state->chain_api->score(state->chain, 1, &dense, &wire, &wire_size, &rows,
                                                       chain_threads(state, rows), scores, text, sizeof text,
                                                       deadline_at(item->handed_ns, p->timeout_us));
            compute_end = now_ns();
            if (failed) {
                char message[ENSEMBLE_ERROR_SIZE + 32];
                snprintf(message, sizeof message, "the ranker failed: %s", text[0] ? text : "no answer");
                send_error(item->request, failed == -2 ? TS_ERROR_UNAVAILABLE : TS_ERROR_INTERNAL, message);
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
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), lane->state->lane_nice); /* only lowers: no privilege */
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
        lane->head = (lane->head + 1) % lane->capacity;
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
Lane *lane_of(Instance *owner, ModelState *state, TRITONBACKEND_ModelInstance *instance) {
    if (owner == NULL) return NULL;
    if (owner->lane != NULL) return owner->lane;
    if (state->lane_requests < 1) return NULL;
    Lane *lane = calloc(1, sizeof *lane);
    if (lane == NULL) return NULL;
    lane->capacity = (size_t)state->lane_requests;
    lane->items = calloc(lane->capacity, sizeof *lane->items);
    if (lane->items == NULL) {
        free(lane);
        return NULL;
    }
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
        free(lane->items);
        free(lane);
        log_line(TS_LOG_WARN, "could not start the bulk lane's thread: bulk requests are scored in the call");
        return NULL;
    }
    owner->lane = lane;
    return lane;
}

/* The requests the lane holds now (the one it scores included). */
static size_t lane_held(Lane *lane) {
    pthread_mutex_lock(&lane->lock);
    const size_t held = lane->count;
    pthread_mutex_unlock(&lane->lock);
    return held;
}

/* Hands a request to the lane: false when the lane is full (the caller refuses it). */
static bool lane_take(Lane *lane, TRITONBACKEND_Request *request, const PlainRequest *plain, uint64_t handed_ns) {
    pthread_mutex_lock(&lane->lock);
    const bool room = lane->count < lane->capacity && !lane->stop;
    if (room) {
        lane->items[(lane->head + lane->count) % lane->capacity] = (LaneItem){request, *plain, handed_ns};
        if (lane->count++ == 0) pthread_cond_signal(&lane->wake);
        lane_gauge(lane);
    }
    pthread_mutex_unlock(&lane->lock);
    if (!room) lane_count(lane, LANE_REFUSED_FULL);
    return room;
}

void lane_stop(Lane *lane) {
    stop_worker(&lane->lock, &lane->wake, &lane->stop, lane->thread);
    pthread_cond_destroy(&lane->wake);
    pthread_mutex_destroy(&lane->lock);
    lane_metrics_delete(lane);
    free(lane->items);
    free(lane);
}

/* A plain call in C, without the interpreter's lock: beside interactive traffic, the bulk requests
 * handed to the lane; then the admission plan of the others, the refusals answered, one chain call
 * over the taken requests' buffers in the plan's order (two when the plan takes interactive and bulk
 * requests: the interactive ones first), on two threads from split_rows rows, where the Python
 * pipeline splits a batch too; each taken request answered from the score array, the call recorded
 * for the admission's fits (as execute, score_plain and finish_plain do).
 * Adds the rows scored to *rows (the caller's 0); a request left unanswered gets `text` as its error from
 * the caller, with *code (UNAVAILABLE when memory ran out; else the caller's INTERNAL); one handed to the
 * lane is marked in `deferred` (the lane answers, reports and releases it). */
void native_execute(ModelState *state, TRITONBACKEND_Request **requests, uint32_t count,
                    const PlainRequest *plain, Lane *lane, uint64_t handed_ns, bool *answered, bool *succeeded,
                    bool *deferred, uint64_t *rows, char *text, size_t text_size, TS_ErrorCode *code) {
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
        *code = TS_ERROR_UNAVAILABLE;
        goto done;
    }
    /* Beside interactive traffic the bulk requests go to the lane (see "the bulk lane"); the plan then
     * prices only what this call scores. */
    bool interactive = false;
    for (uint32_t r = 0; r < count && !interactive; r++) interactive = !plain[r].bulk;
    if (interactive) __atomic_store_n(&state->interactive_ns, handed_ns, __ATOMIC_RELAXED);
    const uint64_t last = __atomic_load_n(&state->interactive_ns, __ATOMIC_RELAXED);
    /* While the lane still holds requests, later bulk requests queue behind them there (arrival order,
     * and the model thread stays free), however long ago the last interactive request was served. */
    const bool yielding = lane != NULL && deferred != NULL &&
                          ((last != 0 && handed_ns - last <= state->lane_yield_ns) || lane_held(lane) > 0);
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
                     state->lane_requests);
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
            *code = TS_ERROR_UNAVAILABLE;
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
            *code = TS_ERROR_UNAVAILABLE;
            break;
        }
        double deadline = 0.0; /* the part's soonest client deadline: what its row store reads may not pass */
        for (int32_t k = from; k < to; k++) {
            const PlainRequest *p = &plain[kept[k < plan.n_first ? plan.first[k] : plan.bulk[k - plan.n_first]]];
            const double d = deadline_at(handed_ns, p->timeout_us);
            if (d > 0 && (deadline == 0 || d < deadline)) deadline = d;
        }
        const int failed = state->chain_api->score(state->chain, to - from, dense, wire, wire_size, part_rows,
                                                   chain_threads(state, total), scores, text, text_size, deadline);
        if (failed == -2) { /* a row store could not be read in time: each request alone, so the others keep theirs */
            answer_alone(state, requests, plain, kept, &plan, from, to, handed_ns, answered, succeeded, rows);
            scored += to - from;
            continue;
        }
        if (failed != 0) break;
        int64_t offset = 0;
        for (int32_t k = from; k < to; k++) {
            const int32_t r = kept[k < plan.n_first ? plan.first[k] : plan.bulk[k - plan.n_first]];
            /* a shadowed request's inputs are copied before its answer goes, then its candidates score them */
            ShadowWork *shadow = plain[r].shadow != NULL && !plain[r].bulk ? shadow_take(state, &plain[r], scores, offset)
                                                                           : NULL;
            succeeded[r] = send_scores(state, requests[r], scores, total, offset, plain[r].rows, plain[r].wanted);
            answered[r] = true;
            if (shadow != NULL) shadow_run(state, shadow);
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
