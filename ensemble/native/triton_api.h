/* The part of Triton's backend API (API version 1.19, as exported by the pip tritonserver's
 * libtritonserver) that the fused backend calls, declared from Triton's public documentation of
 * that API. Triton resolves these symbols in its own process when it loads the backend.
 *
 * Only what backend.c uses is declared; the enum values follow the documented order.
 */
#ifndef ENSEMBLE_TRITON_API_H
#define ENSEMBLE_TRITON_API_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ENSEMBLE_BACKEND_API_MAJOR 1
#define ENSEMBLE_BACKEND_API_MINOR 19

#define BACKEND_EXPORT __attribute__((visibility("default")))

/* Opaque handles owned by Triton. */
typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;

typedef enum {
    TS_TYPE_INVALID, TS_TYPE_BOOL, TS_TYPE_UINT8, TS_TYPE_UINT16, TS_TYPE_UINT32, TS_TYPE_UINT64,
    TS_TYPE_INT8, TS_TYPE_INT16, TS_TYPE_INT32, TS_TYPE_INT64, TS_TYPE_FP16, TS_TYPE_FP32,
    TS_TYPE_FP64, TS_TYPE_BYTES, TS_TYPE_BF16
} TS_DataType;

typedef enum { TS_MEMORY_CPU, TS_MEMORY_CPU_PINNED, TS_MEMORY_GPU } TS_MemoryType;

typedef enum {
    TS_PARAMETER_STRING, TS_PARAMETER_INT, TS_PARAMETER_BOOL, TS_PARAMETER_DOUBLE, TS_PARAMETER_BYTES
} TS_ParameterType;

typedef enum {
    TS_ERROR_UNKNOWN, TS_ERROR_INTERNAL, TS_ERROR_NOT_FOUND, TS_ERROR_INVALID_ARG,
    TS_ERROR_UNAVAILABLE, TS_ERROR_UNSUPPORTED, TS_ERROR_ALREADY_EXISTS, TS_ERROR_CANCELLED
} TS_ErrorCode;

typedef enum { TS_LOG_INFO, TS_LOG_WARN, TS_LOG_ERROR, TS_LOG_VERBOSE } TS_LogLevel;

typedef enum { TB_ARTIFACT_FILESYSTEM } TB_ArtifactType;

enum { TS_REQUEST_RELEASE_ALL = 1 };
enum { TS_RESPONSE_COMPLETE_FINAL = 1 };

/* Errors and messages */
TRITONSERVER_Error *TRITONSERVER_ErrorNew(TS_ErrorCode code, const char *message);
void TRITONSERVER_ErrorDelete(TRITONSERVER_Error *error);
const char *TRITONSERVER_ErrorMessage(TRITONSERVER_Error *error);
TRITONSERVER_Error *TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message *message,
                                                        const char **base, size_t *byte_size);
TRITONSERVER_Error *TRITONSERVER_MessageDelete(TRITONSERVER_Message *message);
TRITONSERVER_Error *TRITONSERVER_LogMessage(TS_LogLevel level, const char *file, int line,
                                            const char *message);

/* Custom metrics (Triton's metrics endpoint shows them beside its own) */
typedef struct TRITONSERVER_MetricFamily TRITONSERVER_MetricFamily;
typedef struct TRITONSERVER_Metric TRITONSERVER_Metric;
typedef struct TRITONSERVER_Parameter TRITONSERVER_Parameter;
typedef enum { TS_METRIC_COUNTER, TS_METRIC_GAUGE, TS_METRIC_HISTOGRAM } TS_MetricKind;
typedef struct TRITONSERVER_MetricArgs TRITONSERVER_MetricArgs;
TRITONSERVER_Error *TRITONSERVER_MetricFamilyNew(TRITONSERVER_MetricFamily **family, TS_MetricKind kind,
                                                 const char *name, const char *description);
TRITONSERVER_Error *TRITONSERVER_MetricNew(TRITONSERVER_Metric **metric, TRITONSERVER_MetricFamily *family,
                                           const TRITONSERVER_Parameter **labels, uint64_t label_count);
TRITONSERVER_Error *TRITONSERVER_MetricDelete(TRITONSERVER_Metric *metric);
/* A histogram series: its bucket bounds set on the arguments it is created with, then observed */
TRITONSERVER_Error *TRITONSERVER_MetricArgsNew(TRITONSERVER_MetricArgs **args);
TRITONSERVER_Error *TRITONSERVER_MetricArgsSetHistogram(TRITONSERVER_MetricArgs *args, const double *buckets,
                                                        uint64_t buckets_count);
TRITONSERVER_Error *TRITONSERVER_MetricArgsDelete(TRITONSERVER_MetricArgs *args);
TRITONSERVER_Error *TRITONSERVER_MetricNewWithArgs(TRITONSERVER_Metric **metric, TRITONSERVER_MetricFamily *family,
                                                   const TRITONSERVER_Parameter **labels, uint64_t label_count,
                                                   const TRITONSERVER_MetricArgs *args);
TRITONSERVER_Error *TRITONSERVER_MetricObserve(TRITONSERVER_Metric *metric, double value);
TRITONSERVER_Error *TRITONSERVER_MetricSet(TRITONSERVER_Metric *metric, double value);
TRITONSERVER_Error *TRITONSERVER_MetricIncrement(TRITONSERVER_Metric *metric, double value);
TRITONSERVER_Parameter *TRITONSERVER_ParameterNew(const char *name, TS_ParameterType type, const void *value);
void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter *parameter);

/* Backend, model, instance */
TRITONSERVER_Error *TRITONBACKEND_ApiVersion(uint32_t *major, uint32_t *minor);
TRITONSERVER_Error *TRITONBACKEND_ModelName(TRITONBACKEND_Model *model, const char **name);
TRITONSERVER_Error *TRITONBACKEND_ModelVersion(TRITONBACKEND_Model *model, uint64_t *version);
TRITONSERVER_Error *TRITONBACKEND_ModelRepository(TRITONBACKEND_Model *model,
                                                  TB_ArtifactType *artifact_type,
                                                  const char **location);
TRITONSERVER_Error *TRITONBACKEND_ModelConfig(TRITONBACKEND_Model *model, uint32_t config_version,
                                              TRITONSERVER_Message **config);
TRITONSERVER_Error *TRITONBACKEND_ModelSetState(TRITONBACKEND_Model *model, void *state);
TRITONSERVER_Error *TRITONBACKEND_ModelState(TRITONBACKEND_Model *model, void **state);
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance *instance,
                                                     TRITONBACKEND_Model **model);
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance *instance,
                                                        void *state);
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance *instance,
                                                     void **state);

/* Requests */
TRITONSERVER_Error *TRITONBACKEND_RequestInput(TRITONBACKEND_Request *request, const char *name,
                                               TRITONBACKEND_Input **input);
TRITONSERVER_Error *TRITONBACKEND_InputProperties(TRITONBACKEND_Input *input, const char **name,
                                                  TS_DataType *datatype, const int64_t **shape,
                                                  uint32_t *dims_count, uint64_t *byte_size,
                                                  uint32_t *buffer_count);
TRITONSERVER_Error *TRITONBACKEND_InputBuffer(TRITONBACKEND_Input *input, uint32_t index,
                                              const void **buffer, uint64_t *buffer_byte_size,
                                              TS_MemoryType *memory_type, int64_t *memory_type_id);
TRITONSERVER_Error *TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request *request,
                                                     uint32_t *count);
TRITONSERVER_Error *TRITONBACKEND_RequestOutputName(TRITONBACKEND_Request *request,
                                                    uint32_t index, const char **name);
TRITONSERVER_Error *TRITONBACKEND_InferenceRequestTimeoutMicroseconds(
    TRITONBACKEND_Request *request, uint64_t *timeout_us);
TRITONSERVER_Error *TRITONBACKEND_RequestParameterCount(TRITONBACKEND_Request *request,
                                                        uint32_t *count);
TRITONSERVER_Error *TRITONBACKEND_RequestParameter(TRITONBACKEND_Request *request, uint32_t index,
                                                   const char **key, TS_ParameterType *type,
                                                   const void **value);
TRITONSERVER_Error *TRITONBACKEND_RequestRelease(TRITONBACKEND_Request *request,
                                                 uint32_t release_flags);

/* Responses */
TRITONSERVER_Error *TRITONBACKEND_ResponseNew(TRITONBACKEND_Response **response,
                                              TRITONBACKEND_Request *request);
TRITONSERVER_Error *TRITONBACKEND_ResponseOutput(TRITONBACKEND_Response *response,
                                                 TRITONBACKEND_Output **output, const char *name,
                                                 TS_DataType datatype, const int64_t *shape,
                                                 uint32_t dims_count);
TRITONSERVER_Error *TRITONBACKEND_OutputBuffer(TRITONBACKEND_Output *output, void **buffer,
                                               uint64_t byte_size, TS_MemoryType *memory_type,
                                               int64_t *memory_type_id);
TRITONSERVER_Error *TRITONBACKEND_ResponseSend(TRITONBACKEND_Response *response,
                                               uint32_t send_flags, TRITONSERVER_Error *error);
TRITONSERVER_Error *TRITONBACKEND_ResponseDelete(TRITONBACKEND_Response *response);

/* Statistics (perf_analyzer reads them; a model without them is refused by it) */
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportStatistics(
    TRITONBACKEND_ModelInstance *instance, TRITONBACKEND_Request *request, bool success,
    uint64_t exec_start_ns, uint64_t compute_start_ns, uint64_t compute_end_ns,
    uint64_t exec_end_ns);
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportBatchStatistics(
    TRITONBACKEND_ModelInstance *instance, uint64_t batch_size, uint64_t exec_start_ns,
    uint64_t compute_start_ns, uint64_t compute_end_ns, uint64_t exec_end_ns);

/* What the backend defines (Triton looks these up by name). */
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend);
BACKEND_EXPORT const char *ensemble_backend_capabilities(void); /* the project's own: backend.c */
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model *model);
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model *model);
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(
    TRITONBACKEND_ModelInstance *instance);
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(
    TRITONBACKEND_ModelInstance *instance);
BACKEND_EXPORT TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance *instance, TRITONBACKEND_Request **requests,
    uint32_t request_count);

#ifdef __cplusplus
}
#endif

#endif
