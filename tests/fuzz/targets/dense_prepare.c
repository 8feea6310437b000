/* The dense transform's first step (_native's prepare: fill, clip, +1), which reads a request's float32
 * tensor where Triton holds it, at any address. The values start one byte into the fuzzer's bytes, so
 * never at a float's alignment; each output must equal the same arithmetic on the value copied out.
 *
 * Input: one byte choosing the fill and clip values, then the float32 values (a partial last one is
 * ignored). */
#include <math.h>

#include "fuzz_python.h"
#include "native/_request.c"

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    if (size < 1) return 0;
    static const float fills[4] = {0.0f, -1.0f, 3.5f, NAN}, clips[4] = {0.0f, -1.0f, 3.5f, -INFINITY};
    const float fill = fills[data[0] & 3], clip_min = clips[(data[0] >> 2) & 3];
    const size_t n = (size - 1) / sizeof(float);
    float *out = malloc((n ? n : 1) * sizeof(float));
    prepare(data + 1, out, n, fill, clip_min);
    for (size_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, data + 1 + i * sizeof v, sizeof v);
        v = isfinite(v) ? v : fill;
        v = v < clip_min ? clip_min : v;
        v = v + 1.0f;
        FUZZ_CHECK(memcmp(&v, &out[i], sizeof v) == 0 || (isnan(v) && isnan(out[i])), "value %zu", i);
    }
    free(out);
    return 0;
}
