/* What every part of the native backend uses of Triton (see backend_internal.h): the clock, errors and log
 * lines, a request's own parameters, and its answers. */
#include "backend_internal.h"

uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

TRITONSERVER_Error *fail(TS_ErrorCode code, const char *format, ...) {
    char message[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    return TRITONSERVER_ErrorNew(code, message);
}

void log_line(TS_LogLevel level, const char *message) {
    TRITONSERVER_Error *err = TRITONSERVER_LogMessage(level, __FILE__, __LINE__, message);
    if (err) TRITONSERVER_ErrorDelete(err);
}

/* The request's "bulk" flag, its "ensemble-release" parameter (the release a fleet's gateway routed
 * it to, forwarded from its header by tritonserver; NULL when absent) and its "ensemble-shadow" one (the
 * releases that score it too during an experiment; NULL when absent), valid during the request. */
int request_parameters(TRITONBACKEND_Request *request, const char **release, const char **shadow) {
    uint32_t count = 0;
    int bulk = 0;
    *release = NULL;
    *shadow = NULL;
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
        backend_parameter(key, type, value, &bulk, release, shadow);
    }
    return bulk;
}

/* Add one output tensor to a response, its bytes copied from `data`. */
TRITONSERVER_Error *add_output(TRITONBACKEND_Response *response, const char *name, TS_DataType datatype,
                               const int64_t *shape, uint32_t dims, const void *data, uint64_t size) {
    TRITONBACKEND_Output *output;
    void *buffer;
    TS_MemoryType memory = TS_MEMORY_CPU;
    int64_t memory_id = 0;
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseOutput(response, &output, name, datatype, shape, dims);
    if (err == NULL) err = TRITONBACKEND_OutputBuffer(output, &buffer, size, &memory, &memory_id);
    /* an empty tensor (a ranking request's `dropped` when none was) may get no buffer: nothing to copy */
    if (err == NULL && size > 0) memcpy(buffer, data, (size_t)size);
    return err;
}

/* Send a response as final, failed with `problem` when not NULL (deleted here); whether it succeeded. */
bool send_final(TRITONBACKEND_Response *response, TRITONSERVER_Error *problem) {
    TRITONSERVER_Error *err = TRITONBACKEND_ResponseSend(response, TS_RESPONSE_COMPLETE_FINAL, problem);
    if (err) TRITONSERVER_ErrorDelete(err);
    if (problem) {
        TRITONSERVER_ErrorDelete(problem);
        return false;
    }
    return true;
}

/* Answer a request with an error (Triton's code, the message). */
void send_error(TRITONBACKEND_Request *request, int code, const char *message) {
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

#ifdef ENSEMBLE_ALLOC_FAULTS
/* Allocations that fail on demand (see backend_internal.h): the parenthesised names below call the C
 * library's functions, not the macros. Counted over every thread, once the first call has armed them. */
static uint64_t fault_every; /* ENSEMBLE_ALLOC_FAULTS; 0: none fail */
static uint64_t fault_count;
static bool fault_armed;
static pthread_once_t fault_once = PTHREAD_ONCE_INIT;

static void fault_read(void) {
    const char *every = getenv("ENSEMBLE_ALLOC_FAULTS");
    fault_every = every ? strtoull(every, NULL, 10) : 0;
    __atomic_store_n(&fault_armed, true, __ATOMIC_RELEASE);
}

void faults_arm(void) { pthread_once(&fault_once, fault_read); }

static bool fault_now(void) {
    return __atomic_load_n(&fault_armed, __ATOMIC_ACQUIRE) && fault_every > 0 &&
           __atomic_add_fetch(&fault_count, 1, __ATOMIC_RELAXED) % fault_every == 0;
}

void *fault_malloc(size_t size) { return fault_now() ? NULL : (malloc)(size); }

void *fault_calloc(size_t count, size_t size) { return fault_now() ? NULL : (calloc)(count, size); }

char *fault_strdup(const char *text) { return fault_now() ? NULL : (strdup)(text); }
#endif
