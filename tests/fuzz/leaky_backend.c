/* A Triton backend that leaks on purpose: each model it loads allocates a block and forgets it. It is
 * the leak check's own test (tests/fuzz/sanitize.py, "native backend in tritonserver"): the sanitized
 * tritonserver, with the same preloads, options and suppressions the native backend runs under, must
 * report this block at exit, from TRITONBACKEND_ModelInitialize below (its stack runs through Triton's
 * own frames, as every allocation of a backend's does), or the step fails. */
#include <stdio.h>
#include <stdlib.h>

#include "triton_api.h"

#define LEAKED_BYTES 4321 /* the size the step looks for in the report */

TRITONSERVER_Error *TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model *model) {
    (void)model;
    char *forgotten = malloc(LEAKED_BYTES);
    if (forgotten != NULL) snprintf(forgotten, LEAKED_BYTES, "a block no one frees");
    return NULL;
}

/* Never called (nothing is sent to the model), but Triton loads no backend without it. */
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance *instance,
                                                       TRITONBACKEND_Request **requests, uint32_t request_count) {
    (void)instance;
    for (uint32_t r = 0; r < request_count; r++) {
        TRITONSERVER_Error *err = TRITONBACKEND_RequestRelease(requests[r], TS_REQUEST_RELEASE_ALL);
        if (err) TRITONSERVER_ErrorDelete(err);
    }
    return NULL;
}
