/* The native backend's checks of whether a request is plain (backend_checks.h, as backend.c
 * compiles them): an input's type, shape, buffer count and memory, and whether its one buffer holds
 * exactly its [rows x width] values, float32 or BYTES strings, on any properties and bytes.
 *
 * Input: 23 bytes of properties (datatype, served type, dims, buffers, memory, served width, shape[0],
 * shape[1] as int64 little-endian, rows so far), then the buffer. */
#include "fuzz_python.h"
#include "native/backend_checks.h"

static int64_t int64_at(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return (int64_t)v;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    if (size < 23) return 0;
    const TS_DataType datatype = (TS_DataType)(data[0] % 16);
    const TS_DataType want_type = data[1] & 1 ? TS_TYPE_BYTES : TS_TYPE_FP32;
    const uint32_t dims = data[2] % 4, buffers = data[3] % 3;
    const TS_MemoryType memory = (TS_MemoryType)(data[4] % 3);
    const int64_t want_width = (data[5] & 15) + 1;
    int64_t shape[3] = {int64_at(data + 6), int64_at(data + 14), 1};
    const int64_t rows = data[22] == 0 ? -1 : data[22] == 1 ? shape[0] : data[22];
    const unsigned char *buffer = data + 23;
    const uint64_t buffer_size = size - 23;

    const bool input = backend_plain_input(want_type, want_width, datatype, shape, dims, buffers, rows);
    const bool expected_input = datatype == want_type && dims == 2 && shape[0] >= 1 && shape[0] <= (1 << 24) &&
                                shape[1] == want_width && buffers == 1 && (rows == -1 || rows == shape[0]);
    FUZZ_CHECK(input == expected_input, "plain input %d, expected %d", input, expected_input);

    /* The buffer check on any rows and width, not only those a plain input passes. */
    const bool held = backend_plain_buffer(datatype, shape[0], shape[1], memory, buffer, buffer_size);
    bool expected_held = false;
    if (memory != TS_MEMORY_GPU && shape[0] >= 1 && shape[0] <= (1 << 24) && shape[1] >= 1 &&
        shape[1] <= INT64_MAX / (1 << 24)) {
        const int64_t values = shape[0] * shape[1];
        if (datatype == TS_TYPE_FP32)
            expected_held = buffer_size % 4 == 0 && buffer_size / 4 == (uint64_t)values;
        else if (datatype == TS_TYPE_BYTES)
            expected_held = fuzz_wire_count(buffer, buffer_size) == values;
    }
    FUZZ_CHECK(held == expected_held, "buffer of %llu bytes held %d, expected %d", (unsigned long long)buffer_size,
               held, expected_held);
    return 0;
}
