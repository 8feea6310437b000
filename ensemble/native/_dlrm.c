/* A DLRM forward pass in C, for the weights of either trained DLRM (ensemble/models/dlrm_kernel.py
 * reads them from the exported TorchScript or TFLite model): bottom MLP (ReLU after every layer),
 * one gather from the stacked embedding table, the dot product of every pair of the 1 + F vectors,
 * top MLP (ReLU between layers), sigmoid.
 *
 * Why: at one row the frameworks' per-operator dispatch is most of a DLRM's time (TorchScript
 * ~60-100 us for work worth a few microseconds); at a hundred rows the layers are small matrices
 * where a register-tiled loop keeps up with a BLAS call. One call per batch, no interpreter.
 *
 * A layer computes rows in tiles of 6 rows x 16 outputs held in registers (12 of the 16 AVX2 registers;
 * weights stored [in x out] so a tile reads 16 consecutive weights per input, once for 6 rows: 4-row
 * tiles read the weights 1.5x as often and measured ~10% slower at 100 rows). The kernels are built
 * twice, for x86-64-v3 (AVX2, FMA) and for the baseline instruction set, and the CPU picks at load
 * (GCC's target_clones); ``vectorized()`` says whether the first applies (the baseline build is
 * correct but slow, so the scorers keep the frameworks on such a CPU). Where the CPU has AVX-512
 * (x86-64-v4) the layers whose width is a multiple of 16 and the interaction run 16 lanes wide instead
 * (layer16, interact16; in blocks of 16 rows or more rows_interact16, a row a lane, and layer16_fm after
 * it), with the same floats as the AVX2 build; ``wide()`` says whether they run.
 *
 * The scorers call a Weights object, which takes and checks the weight arrays once and holds them,
 * so a call hands over only its rows; forward() takes everything per call (tests, one-off use).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

#include "api.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

#define TILE_ROWS 6
#define TILE_COLS 16
/* Rows go through every layer in blocks of this many, so a block's activations (~4.7 KB a row for the
 * exported DLRMs) stay in the core's L2 cache between layers: whole 8,192-row batches layer by layer
 * ran at half the speed per row. Each row's arithmetic is the same in any block. */
#define BLOCK_ROWS 64
#define GROUP_ROWS 16 /* rows a lane in rows_interact16 (AVX-512 builds) */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline __attribute__((always_inline)) v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* dst[0 .. n) = src[0 .. n): 8 floats a step when n is a multiple of 8 (an embedding of 16), else memcpy. */
static inline __attribute__((always_inline)) void copy_floats(float *dst, const float *src, Py_ssize_t n) {
    if (n % 8 == 0) {
        for (Py_ssize_t i = 0; i < n; i += 8) store8(dst + i, load8(src + i));
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

/* Rows [b0, b0 + NB) x outputs [j0, j0 + 16) of y = act(x @ wt + bias), accumulated in registers.
 * NB is a constant at each call site, so the loops over rows unroll. */
static inline __attribute__((always_inline)) void tile(const int NB, int in, int out, const float *x,
                                                      const float *wt, const float *bias, float *y,
                                                      Py_ssize_t b0, int j0, int relu) {
    v8 acc[TILE_ROWS][2];
    const float *xr[TILE_ROWS];
    for (int r = 0; r < NB; r++) {
        acc[r][0] = load8(bias + j0);
        acc[r][1] = load8(bias + j0 + 8);
        xr[r] = x + (b0 + r) * in;
    }
    for (int k = 0; k < in; k++) {
        const v8 w0 = load8(wt + (size_t)k * out + j0), w1 = load8(wt + (size_t)k * out + j0 + 8);
        for (int r = 0; r < NB; r++) {
            const float s = xr[r][k];
            acc[r][0] += s * w0;
            acc[r][1] += s * w1;
        }
    }
    const v8 zero = {0};
    for (int r = 0; r < NB; r++) {
        v8 a0 = acc[r][0], a1 = acc[r][1];
        if (relu) { /* keep the positive lanes: the comparison's mask is all ones there */
            a0 = (v8)((v8i)a0 & (a0 > zero));
            a1 = (v8)((v8i)a1 & (a1 > zero));
        }
        store8(y + (b0 + r) * out + j0, a0);
        store8(y + (b0 + r) * out + j0 + 8, a1);
    }
}

/* y[B x out] = act(x[B x in] @ wt[in x out] + bias) */
CLONES static void layer(Py_ssize_t B, int in, int out, const float *x, const float *wt, const float *bias, float *y,
                         int relu) {
    if (out % TILE_COLS == 0) {
        for (Py_ssize_t b0 = 0; b0 < B; b0 += TILE_ROWS) {
            const Py_ssize_t nb = B - b0 < TILE_ROWS ? B - b0 : TILE_ROWS;
            for (int j0 = 0; j0 < out; j0 += TILE_COLS) {
                switch (nb) {
                case 6: tile(6, in, out, x, wt, bias, y, b0, j0, relu); break;
                case 5: tile(5, in, out, x, wt, bias, y, b0, j0, relu); break;
                case 4: tile(4, in, out, x, wt, bias, y, b0, j0, relu); break;
                case 3: tile(3, in, out, x, wt, bias, y, b0, j0, relu); break;
                case 2: tile(2, in, out, x, wt, bias, y, b0, j0, relu); break;
                default: tile(1, in, out, x, wt, bias, y, b0, j0, relu); break;
                }
            }
        }
        return;
    }
    if (out == 1) { /* the last layer: a dot product a row, 8 lanes at a time, then the lanes' sum */
        for (Py_ssize_t b = 0; b < B; b++) {
            const float *xb = x + b * in;
            v8 acc = {0};
            int k = 0;
            for (; k + 8 <= in; k += 8) acc += load8(xb + k) * load8(wt + k);
            float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (; k < in; k++) sum += xb[k] * wt[k];
            sum += bias[0];
            y[b] = relu && !(sum > 0.f) ? 0.f : sum;
        }
        return;
    }
    for (Py_ssize_t b = 0; b < B; b++) {
        for (int j = 0; j < out; j++) y[b * out + j] = bias[j];
        for (int k = 0; k < in; k++) {
            const float s = x[b * in + k];
            const float *w = wt + (size_t)k * out;
            for (int j = 0; j < out; j++) y[b * out + j] += s * w[j];
        }
        if (relu)
            for (int j = 0; j < out; j++) y[b * out + j] = y[b * out + j] > 0.f ? y[b * out + j] : 0.f;
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* The same layer for CPUs with AVX-512 (x86-64-v4): 16-lane registers and 32 of them, so a tile holds
 * 8 rows x 32 outputs (16 accumulators; 8 rows x 16 outputs when a layer's width is 16 mod 32). Each
 * output is still bias + the products in input order, one fused multiply-add each, as in the AVX2 tile:
 * the two builds give the same floats, bit for bit (the tests compare them). Picked at import when the
 * CPU has AVX-512 (wide()). With interact16, a forward pass of either exported DLRM ran 1.34-1.51x as
 * fast a row at 100 and 1,400 rows as the AVX2 build on the Intel Xeon VM, in two runs (benchmarks.kernels
 * times both builds; tests/unit/test_models.py compares their floats). */
#define WIDE 1
#define V4 __attribute__((target("arch=x86-64-v4")))
#define WIDE_ROWS 8
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) V4 v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) V4 void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Rows [b0, b0 + NB) x outputs [j0, j0 + 16 * NV) (NV = 1 or 2 registers a row); NB, NV and FM constants.
 * Input k of row r is x[r * in + k], or with FM (feature-major input) x[k * ld + r]. */
static inline __attribute__((always_inline)) V4 void tile16(const int NB, const int NV, const int FM, int in, int out,
                                                           const float *x, Py_ssize_t ld, const float *wt,
                                                           const float *bias, float *y, Py_ssize_t b0, int j0,
                                                           int relu) {
    v16 acc[WIDE_ROWS][2];
    const float *xr[WIDE_ROWS];
    for (int r = 0; r < NB; r++) {
        for (int v = 0; v < NV; v++) acc[r][v] = load16(bias + j0 + 16 * v);
        xr[r] = x + (b0 + r) * in;
    }
    const float *xk = x + b0;
    for (int k = 0; k < in; k++, xk += ld) {
        v16 w[2];
        for (int v = 0; v < NV; v++) w[v] = load16(wt + (size_t)k * out + j0 + 16 * v);
        for (int r = 0; r < NB; r++) {
            const float s = FM ? xk[r] : xr[r][k];
            for (int v = 0; v < NV; v++) acc[r][v] += s * w[v];
        }
    }
    const v16 zero = {0};
    for (int r = 0; r < NB; r++)
        for (int v = 0; v < NV; v++) {
            v16 a = acc[r][v];
            if (relu) a = (v16)((v16i)a & (a > zero));
            store16(y + (b0 + r) * out + j0 + 16 * v, a);
        }
}

#define TILE16_CASES(NV, FM)                                                                                \
    switch (nb) {                                                                                            \
    case 8: tile16(8, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 7: tile16(7, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 6: tile16(6, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 5: tile16(5, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 4: tile16(4, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 3: tile16(3, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    case 2: tile16(2, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                             \
    default: tile16(1, NV, FM, in, out, x, ld, wt, bias, y, b0, j0, relu); break;                            \
    }

/* layer() for widths that are a multiple of 16; others go to layer(). */
V4 static void layer16(Py_ssize_t B, int in, int out, const float *x, const float *wt, const float *bias, float *y,
                       int relu) {
    const Py_ssize_t ld = 0;
    for (Py_ssize_t b0 = 0; b0 < B; b0 += WIDE_ROWS) {
        const Py_ssize_t nb = B - b0 < WIDE_ROWS ? B - b0 : WIDE_ROWS;
        int j0 = 0;
        for (; j0 + 32 <= out; j0 += 32) TILE16_CASES(2, 0)
        if (j0 < out) TILE16_CASES(1, 0)
    }
}

/* layer16() over a feature-major input (rows_interact16's output): input k of row r at x[k * ld + r]. */
V4 static void layer16_fm(Py_ssize_t B, int in, int out, const float *x, Py_ssize_t ld, const float *wt,
                          const float *bias, float *y, int relu) {
    for (Py_ssize_t b0 = 0; b0 < B; b0 += WIDE_ROWS) {
        const Py_ssize_t nb = B - b0 < WIDE_ROWS ? B - b0 : WIDE_ROWS;
        int j0 = 0;
        for (; j0 + 32 <= out; j0 += 32) TILE16_CASES(2, 1)
        if (j0 < out) TILE16_CASES(1, 1)
    }
}

/* Whether the CPU runs the AVX-512 kernels. */
static int cpu_wide(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4");
}
#else
#define WIDE 0
static int cpu_wide(void) { return 0; }
#endif
/* Whether the AVX-512 kernels run: set at import when the CPU has them; wide(False) turns them off. */
static int wide_ok;

/* y = act(x @ wt + bias) through the widest kernel this CPU runs. */
static void any_layer(Py_ssize_t B, int in, int out, const float *x, const float *wt, const float *bias, float *y,
                      int relu) {
#if WIDE
    if (wide_ok && out % 16 == 0) {
        layer16(B, in, out, x, wt, bias, y, relu);
        return;
    }
#endif
    layer(B, in, out, x, wt, bias, y, relu);
}

/* Whether the pairs are DLRM's: every (i, j) with j < i, i = 1..n-1, in that order (row i's pairs are then
 * out[dim + i(i-1)/2 ...], consecutive). */
static int lower_triangle(int n_vectors, int n_pairs, const int32_t *pair_i, const int32_t *pair_j) {
    if (n_pairs != n_vectors * (n_vectors - 1) / 2) return 0;
    for (int i = 1, p = 0; i < n_vectors; i++)
        for (int j = 0; j < i; j++, p++)
            if (pair_i[p] != i || pair_j[p] != j) return 0;
    return 1;
}

/* out[b] = [vector 0 of row b, then <v_i, v_j> for each pair]: stacked [B x V x dim] -> [B x (dim + P)].
 * Up to 32 vectors: the row's vectors transposed to t[dim x 32], then Gram-matrix entries computed in
 * blocks of 8 vectors i x 8 vectors j (8 accumulators of 8 lanes, one FMA per dimension each: enough
 * independent sums to keep both FMA units busy), only the blocks some pair reads (for DLRM's pairs
 * i > j, 10 of the 16). For DLRM's pairs a block's sums go straight to the output: row i's 8 sums
 * land at its pairs' place, the lanes j >= i spilling into the next rows' places, which a later
 * store always rewrites (blocks in ascending i, each i's blocks in descending j, the diagonal block
 * first), and past the batch's last row into OUT_SLACK floats the caller leaves after ``out``.
 * Other pairs are picked from a Gram matrix. */
#define MAX_GRAM 32
#define OUT_SLACK 16 /* the widest block's spill: 16 lanes */

/* A row's Gram blocks of W x W vectors (W lanes of VEC, read and written with LOAD and STORE), over the
 * transposed vectors t[dim][MAX_GRAM], into the row's output o (DLRM's pairs, direct) or into gram
 * (then picked per pair): interact() runs it 8 lanes wide, interact16() 16. */
#define GRAM_BLOCKS(W, VEC, LOAD, STORE)                                                                     \
    for (int ib = 0; ib < MAX_GRAM / (W); ib++) {                                                            \
        for (int jb = MAX_GRAM / (W) - 1; jb >= 0; jb--) {                                                   \
            if (!(need[ib] >> jb & 1u)) continue;                                                            \
            VEC acc[W] = {{0}};                                                                              \
            for (int d = 0; d < dim; d++) {                                                                  \
                const VEC w = LOAD(&t[d][(W) * jb]);                                                         \
                for (int k = 0; k < (W); k++) acc[k] += t[d][(W) * ib + k] * w;                              \
            }                                                                                                \
            for (int k = 0; k < (W); k++) {                                                                  \
                const int i = (W) * ib + k;                                                                  \
                if (!direct)                                                                                 \
                    STORE(&gram[i][(W) * jb], acc[k]);                                                       \
                else if (i >= 1 && i < n_vectors && (W) * jb < i)                                            \
                    STORE(o + dim + i * (i - 1) / 2 + (W) * jb, acc[k]);                                     \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    if (!direct)                                                                                             \
        for (int p = 0; p < n_pairs; p++) o[dim + p] = gram[pair_i[p]][pair_j[p]];

/* Which W x W blocks some pair reads (bit jb of need[ib]), and whether the pairs are DLRM's; the
 * transposed vectors' padding (t[d][v] for v past the last vector) zeroed. */
static int gram_plan(int W, int n_vectors, int dim, int n_pairs, const int32_t *pair_i, const int32_t *pair_j,
                     unsigned *need, float t[][MAX_GRAM]) {
    for (int d = 0; d < dim; d++)
        for (int v = n_vectors; v < MAX_GRAM; v++) t[d][v] = 0.f;
    for (int b = 0; b < MAX_GRAM / W; b++) need[b] = 0;
    for (int p = 0; p < n_pairs; p++) need[pair_i[p] / W] |= 1u << (pair_j[p] / W);
    return lower_triangle(n_vectors, n_pairs, pair_i, pair_j);
}
CLONES static void interact(Py_ssize_t B, int n_vectors, int dim, int n_pairs, const int32_t *pair_i,
                            const int32_t *pair_j, const float *stacked, float *out) {
    const int width = dim + n_pairs;
    if (n_vectors <= MAX_GRAM && dim <= 64) {
        float t[64][MAX_GRAM];
        float gram[MAX_GRAM][MAX_GRAM];
        unsigned need[MAX_GRAM / 8];
        const int direct = gram_plan(8, n_vectors, dim, n_pairs, pair_i, pair_j, need, t);
        for (Py_ssize_t b = 0; b < B; b++) {
            const float *s = stacked + b * n_vectors * dim;
            float *o = out + b * width;
            memcpy(o, s, sizeof(float) * dim);
            for (int v = 0; v < n_vectors; v++)
                for (int d = 0; d < dim; d++) t[d][v] = s[v * dim + d];
            GRAM_BLOCKS(8, v8, load8, store8)
        }
        return;
    }
    for (Py_ssize_t b = 0; b < B; b++) {
        const float *s = stacked + b * n_vectors * dim;
        float *o = out + b * width;
        memcpy(o, s, sizeof(float) * dim);
        for (int p = 0; p < n_pairs; p++) {
            const float *u = s + pair_i[p] * dim, *v = s + pair_j[p] * dim;
            float acc = 0.f;
            for (int d = 0; d < dim; d++) acc += u[d] * v[d];
            o[dim + p] = acc;
        }
    }
}

#if WIDE
/* dst[c * dst_stride + i] = lane c of r[i] for i, c < 16: a 16 x 16 block transposed in registers, in four
 * rounds of two-register shuffles (pairs of floats, pairs of pairs, then 128-bit quarters twice);
 * transpose16 loads the block as dst[c * dst_stride + i] = src[i * src_stride + c] (rows i >= n_rows
 * read as zeros). */
static inline __attribute__((always_inline)) V4 void transpose16_regs(const __m512 *r, float *dst, Py_ssize_t dst_stride) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) { /* a[2i], a[2i+1]: rows 2i and 2i+1 interleaved, low and high pairs */
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* b[4g + c], quarter L: column 4L + c of rows 4g .. 4g + 3 */
        b[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[4 * g]), _mm512_castps_pd(a[4 * g + 2])));
        b[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[4 * g]), _mm512_castps_pd(a[4 * g + 2])));
        b[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[4 * g + 1]), _mm512_castps_pd(a[4 * g + 3])));
        b[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[4 * g + 1]), _mm512_castps_pd(a[4 * g + 3])));
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c gathers quarter L of b[c], b[4 + c], b[8 + c], b[12 + c] */
        const __m512 p0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
        const __m512 q0 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44), q1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
        _mm512_storeu_ps(dst + c * dst_stride, _mm512_shuffle_f32x4(p0, q0, 0x88));
        _mm512_storeu_ps(dst + (4 + c) * dst_stride, _mm512_shuffle_f32x4(p0, q0, 0xDD));
        _mm512_storeu_ps(dst + (8 + c) * dst_stride, _mm512_shuffle_f32x4(p1, q1, 0x88));
        _mm512_storeu_ps(dst + (12 + c) * dst_stride, _mm512_shuffle_f32x4(p1, q1, 0xDD));
    }
}

static inline __attribute__((always_inline)) V4 void transpose16(const float *src, Py_ssize_t src_stride, int n_rows,
                                                                float *dst, Py_ssize_t dst_stride) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = i < n_rows ? _mm512_loadu_ps(src + i * src_stride) : _mm512_setzero_ps();
    transpose16_regs(r, dst, dst_stride);
}

/* interact() with 16 x 16 blocks in AVX-512 registers (16 accumulators of 16 lanes), for up to 32 vectors
 * of up to 64 floats: DLRM's 27 vectors need 3 blocks instead of 10. Every product is the same fused
 * multiply-add in the same order of dimensions, so the sums equal interact()'s bit for bit. The spill
 * of a direct store is up to 15 floats (OUT_SLACK). */
V4 static void interact16(Py_ssize_t B, int n_vectors, int dim, int n_pairs, const int32_t *pair_i,
                          const int32_t *pair_j, const float *stacked, float *out) {
    const int width = dim + n_pairs;
    float t[64][MAX_GRAM] __attribute__((aligned(64)));
    float gram[MAX_GRAM][MAX_GRAM];
    unsigned need[MAX_GRAM / 16];
    const int direct = gram_plan(16, n_vectors, dim, n_pairs, pair_i, pair_j, need, t);
    for (Py_ssize_t b = 0; b < B; b++) {
        const float *s = stacked + b * n_vectors * dim;
        float *o = out + b * width;
        memcpy(o, s, sizeof(float) * dim);
        if (dim % 16 == 0) {
            for (int v0 = 0; v0 < n_vectors; v0 += 16)
                for (int d0 = 0; d0 < dim; d0 += 16)
                    transpose16(s + v0 * dim + d0, dim, n_vectors - v0, &t[d0][v0], MAX_GRAM);
        } else {
            for (int v = 0; v < n_vectors; v++)
                for (int d = 0; d < dim; d++) t[d][v] = s[v * dim + d];
        }
        GRAM_BLOCKS(16, v16, load16, store16)
    }
}

/* DLRM's interaction over whole groups of 16 rows, a row a lane, for blocks of 16 rows or more: a group's
 * vectors are transposed to tt[v][d][16 rows] (one 16 x 16 transpose per vector and 16 dimensions), then
 * every pair's dot product is computed for the 16 rows at once, 8 pairs side by side. The Gram blocks of
 * interact16 compute about twice the products DLRM's pairs need and transpose every row on its own;
 * here each product is one a pair needs. Each sum is still dim fused multiply-adds in the order of
 * dimensions from zero: the same float as interact16's, bit for bit. The group's vectors are read where
 * they are (Gather), not from a copy. The output is feature-major,
 * x[k * ld + r] for row r and input k of the first top layer (vector 0, then the pairs in DLRM's
 * order), which layer16_fm reads. Rows past the last whole group, copied to stacked (a row every
 * (1 + F) x dim floats, from row 0), go through interact16 into spare
 * (16 rows x (dim + pairs) + OUT_SLACK floats) and into x from there. Only for DLRM's pairs
 * (lower_triangle), dim a multiple of 16 up to 64, and up to MAX_GRAM vectors (Net.rows16). */
#define PAIR_LANES 8 /* pairs summed side by side: independent chains of multiply-adds for both FMA units */

/* Where a block's vectors are: row r's vector 0 at bottom + r * dim, its vector 1 + c at table + (offsets[c]
 * + ids[r * F + c]) * dim (ids checked against their tables before). */
typedef struct {
    const float *bottom, *table;
    const int64_t *offsets, *ids;
} Gather;

/* The dot products of vector ti with the n (a constant at each call site) consecutive vectors from tj,
 * for the group's 16 rows, into dst[q * ld] for pair q. */
static inline __attribute__((always_inline)) V4 void pair_dots(const int n, const float *ti, const float *tj, int dim,
                                                              float *dst, Py_ssize_t ld) {
    v16 acc[PAIR_LANES];
    for (int q = 0; q < n; q++) acc[q] = (v16){0};
    for (int d = 0; d < dim; d++) {
        const v16 a = load16(ti + d * GROUP_ROWS);
        for (int q = 0; q < n; q++) acc[q] += a * load16(tj + ((Py_ssize_t)q * dim + d) * GROUP_ROWS);
    }
    for (int q = 0; q < n; q++) store16(dst + q * ld, acc[q]);
}

V4 static void rows_interact16(Py_ssize_t B, int n_vectors, int dim, int n_pairs, const int32_t *pair_i,
                               const int32_t *pair_j, const Gather *g, const float *stacked, float *tt, float *spare,
                               float *x, Py_ssize_t ld) {
    const Py_ssize_t row = (Py_ssize_t)n_vectors * dim;
    Py_ssize_t g0 = 0;
    for (; g0 + GROUP_ROWS <= B; g0 += GROUP_ROWS) {
        /* the group's vectors straight from the bottom MLP's output and the embedding table */
        const float *at[GROUP_ROWS];
        for (int v = 0; v < n_vectors; v++) {
            for (int i = 0; i < GROUP_ROWS; i++)
                at[i] = v == 0 ? g->bottom + (g0 + i) * dim
                               : g->table + (g->offsets[v - 1] + g->ids[(g0 + i) * (n_vectors - 1) + v - 1]) * dim;
            for (int d0 = 0; d0 < dim; d0 += 16) {
                __m512 r[GROUP_ROWS];
                for (int i = 0; i < GROUP_ROWS; i++) r[i] = _mm512_loadu_ps(at[i] + d0);
                transpose16_regs(r, tt + ((Py_ssize_t)v * dim + d0) * GROUP_ROWS, GROUP_ROWS);
            }
        }
        float *o = x + g0;
        for (int d = 0; d < dim; d++, o += ld) store16(o, load16(tt + d * GROUP_ROWS));
        for (int i = 1; i < n_vectors; i++) {
            const float *ti = tt + (Py_ssize_t)i * dim * GROUP_ROWS;
            int j0 = 0;
            for (; j0 + PAIR_LANES <= i; j0 += PAIR_LANES, o += PAIR_LANES * ld)
                pair_dots(PAIR_LANES, ti, tt + (Py_ssize_t)j0 * dim * GROUP_ROWS, dim, o, ld);
            const float *tj = tt + (Py_ssize_t)j0 * dim * GROUP_ROWS;
            switch (i - j0) {
            case 7: pair_dots(7, ti, tj, dim, o, ld); break;
            case 6: pair_dots(6, ti, tj, dim, o, ld); break;
            case 5: pair_dots(5, ti, tj, dim, o, ld); break;
            case 4: pair_dots(4, ti, tj, dim, o, ld); break;
            case 3: pair_dots(3, ti, tj, dim, o, ld); break;
            case 2: pair_dots(2, ti, tj, dim, o, ld); break;
            case 1: pair_dots(1, ti, tj, dim, o, ld); break;
            default: break;
            }
            o += (i - j0) * ld;
        }
    }
    if (g0 < B) {
        const int width = dim + n_pairs;
        interact16(B - g0, n_vectors, dim, n_pairs, pair_i, pair_j, stacked + g0 * row, spare);
        for (Py_ssize_t r = 0; r < B - g0; r++)
            for (int k = 0; k < width; k++) x[k * ld + g0 + r] = spare[r * width + k];
    }
}
#endif

/* interact() through the widest kernel this CPU runs. */
static void any_interact(Py_ssize_t B, int n_vectors, int dim, int n_pairs, const int32_t *pair_i,
                         const int32_t *pair_j, const float *stacked, float *out) {
#if WIDE
    if (wide_ok && n_vectors <= MAX_GRAM && dim <= 64) {
        interact16(B, n_vectors, dim, n_pairs, pair_i, pair_j, stacked, out);
        return;
    }
#endif
    interact(B, n_vectors, dim, n_pairs, pair_i, pair_j, stacked, out);
}

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

static int take(PyObject *obj, Buffer *b, const char *name, Py_ssize_t itemsize, int writable) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", name, b->view.itemsize, itemsize);
        return -1;
    }
    return 0;
}

static void give_back(Buffer *buffers, int n) {
    for (int i = 0; i < n; i++)
        if (buffers[i].held) PyBuffer_Release(&buffers[i].view);
}

/* A DLRM's weights as the forward pass reads them: pointers into buffers someone holds (a Weights
 * object for its life, or forward() for one call). */
#define MAX_LAYERS 32
typedef struct {
    int n_bottom, n_top;
    Py_ssize_t F, P, dim, table_rows, n_dense, width;
    const float *table;
    const int64_t *offsets;
    const int32_t *pair_i, *pair_j;
    const float *wt[MAX_LAYERS], *bias[MAX_LAYERS];
    int in[MAX_LAYERS], out[MAX_LAYERS];
    int rows16; /* blocks of 16 rows or more may take rows_interact16 and layer16_fm (where wide_ok) */
    int pooled; /* the rows are gathered already (forward_pooled): ids index them, no table check */
} Net;

/* Takes the weights' buffers (fixed: 4, layers: 2 a layer; released by the caller, also on failure) and
 * checks that they chain; -1 with an exception set otherwise. */
static int net_take(PyObject *bottom, PyObject *table, PyObject *offsets, PyObject *pair_i, PyObject *pair_j,
                    PyObject *top, Buffer *fixed, Buffer *layers, Net *net) {
    if (!PyTuple_Check(bottom) || !PyTuple_Check(top)) {
        PyErr_SetString(PyExc_TypeError, "bottom and top are tuples of (weights, bias) pairs");
        return -1;
    }
    const Py_ssize_t n_bottom = PyTuple_GET_SIZE(bottom), n_top = PyTuple_GET_SIZE(top);
    if (n_bottom < 1 || n_top < 1 || n_bottom + n_top > MAX_LAYERS - 1) {
        PyErr_SetString(PyExc_ValueError, "1..31 bottom and top layers");
        return -1;
    }
    if (take(table, &fixed[0], "table", 4, 0) < 0 || take(offsets, &fixed[1], "offsets", 8, 0) < 0 ||
        take(pair_i, &fixed[2], "pair_i", 4, 0) < 0 || take(pair_j, &fixed[3], "pair_j", 4, 0) < 0)
        return -1;
    for (Py_ssize_t l = 0; l < n_bottom + n_top; l++) {
        PyObject *pair = PyTuple_GET_ITEM(l < n_bottom ? bottom : top, l < n_bottom ? l : l - n_bottom);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "a layer is a (weights [in x out], bias [out]) pair");
            return -1;
        }
        if (take(PyTuple_GET_ITEM(pair, 0), &layers[2 * l], "weights", 4, 0) < 0 ||
            take(PyTuple_GET_ITEM(pair, 1), &layers[2 * l + 1], "bias", 4, 0) < 0)
            return -1;
        if (layers[2 * l].view.ndim != 2 || layers[2 * l + 1].view.len / 4 != layers[2 * l].view.shape[1]) {
            PyErr_SetString(PyExc_ValueError, "weights must be [in x out] with a bias of out");
            return -1;
        }
        net->wt[l] = layers[2 * l].view.buf;
        net->bias[l] = layers[2 * l + 1].view.buf;
        net->in[l] = (int)layers[2 * l].view.shape[0];
        net->out[l] = (int)layers[2 * l].view.shape[1];
    }
    net->n_bottom = (int)n_bottom;
    net->n_top = (int)n_top;
    net->F = fixed[1].view.len / 8;
    net->P = fixed[2].view.len / 4;
    net->dim = fixed[0].view.ndim == 2 ? fixed[0].view.shape[1] : 0;
    net->table_rows = net->dim ? fixed[0].view.shape[0] : 0;
    net->n_dense = net->in[0];
    const int last = net->n_bottom + net->n_top - 1;
    if (net->dim < 1 || fixed[3].view.len / 4 != net->P || net->out[net->n_bottom - 1] != net->dim ||
        net->in[net->n_bottom] != net->dim + net->P || net->out[last] != 1) {
        PyErr_SetString(PyExc_ValueError, "shapes do not chain: dense -> bottom -> dim; dim + pairs -> top -> 1");
        return -1;
    }
    for (int l = 1; l <= last; l++) {
        if (l != net->n_bottom && net->in[l] != net->out[l - 1]) {
            PyErr_SetString(PyExc_ValueError, "a layer's input width is not the previous layer's output width");
            return -1;
        }
    }
    net->table = fixed[0].view.buf;
    net->offsets = fixed[1].view.buf;
    net->pair_i = fixed[2].view.buf;
    net->pair_j = fixed[3].view.buf;
    for (Py_ssize_t p = 0; p < net->P; p++)
        if (net->pair_i[p] < 0 || net->pair_i[p] > net->F || net->pair_j[p] < 0 || net->pair_j[p] > net->F) {
            PyErr_SetString(PyExc_ValueError, "a pair names a vector beyond the 1 + F");
            return -1;
        }
    net->width = net->dim + net->P;
    net->rows16 = net->dim % 16 == 0 && net->dim <= 64 && net->F + 1 <= MAX_GRAM && net->out[net->n_bottom] % 16 == 0 &&
                  lower_triangle((int)net->F + 1, (int)net->P, net->pair_i, net->pair_j);
    for (int l = 0; l <= last; l++)
        if (net->out[l] > net->width) net->width = net->out[l];
    return 0;
}

/* A forward pass's scratch: kept by each thread between calls, grown when a call needs more, freed when
 * the thread exits; 64-byte aligned, as is each buffer carved from it (scratch_at), so a 16-float load
 * or store never straddles two cache lines. An allocation a call (~300-400 KB for a 64-row block) was
 * above glibc's mmap threshold: every call mapped and faulted in new pages, or, once glibc raised the
 * threshold, got 16-byte aligned memory; in the measurements behind this either cost 5-15% of a 100-row
 * forward pass. */
typedef struct {
    size_t floats;
    float *data;
} Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_made;

static void scratch_release(void *p) {
    Scratch *s = p;
    free(s->data);
    free(s);
}

static void scratch_key_make(void) { scratch_key_made = pthread_key_create(&scratch_key, scratch_release) == 0; }

/* This thread's scratch of at least n floats, or NULL when out of memory. */
static float *thread_scratch(size_t n) {
    pthread_once(&scratch_once, scratch_key_make);
    if (!scratch_key_made) return NULL;
    Scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        if ((s = calloc(1, sizeof *s)) == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->floats < n) {
        free(s->data);
        s->floats = 0;
        void *p = NULL;
        if (posix_memalign(&p, 64, sizeof(float) * n) != 0) return s->data = NULL;
        s->data = p;
        s->floats = n;
    }
    return s->data;
}

/* Floats to reserve for a buffer of n floats carved from the scratch: n rounded up to 16 (64 bytes). */
static inline Py_ssize_t scratch_at(Py_ssize_t n) { return (n + 15) / 16 * 16; }

/* The row stride of rows_interact16's feature-major output for a block of `rows` rows: the rows rounded
 * up to 16 floats, then to an odd number of cache lines. A power of two (64 rows) put the first top
 * layer's reads of 8 rows' inputs in a quarter of the L1 cache's sets, and it ran ~20% slower. Never
 * smaller for more rows, so a block's stride sizes the buffers for every block after it. */
static inline Py_ssize_t fm_stride(Py_ssize_t rows) {
    const Py_ssize_t lines = (rows + GROUP_ROWS - 1) / GROUP_ROWS;
    return (lines % 2 ? lines : lines + 1) * GROUP_ROWS;
}

/* Whether id is a row of column c's table (the columns' tables stacked: column c from offsets[c], the
 * last to table_rows). */
static inline int id_in_table(const int64_t *offsets, Py_ssize_t F, Py_ssize_t table_rows, Py_ssize_t c, int64_t id) {
    const int64_t end = c + 1 < F ? offsets[c + 1] : table_rows;
    return id >= 0 && id < end - offsets[c];
}

/* The rows of dense [B x n_dense] and ids [B x F] through net into out [B]: -1 when done, -2 out of
 * memory, else the flat index into ids of an id outside its column's table (rows from its block on
 * are not scored). No Python call: it runs without the interpreter's lock. */
static int64_t net_run(const Net *net, const float *dense, const int64_t *ids, Py_ssize_t B, float *out) {
    const Py_ssize_t F = net->F, dim = net->dim, width = net->width;
    const Py_ssize_t block = B < BLOCK_ROWS ? (B ? B : 1) : BLOCK_ROWS;
#if WIDE
    const int rows16 = wide_ok && net->rows16 && block >= GROUP_ROWS;
#else
    const int rows16 = 0;
#endif
    /* a and b each end with OUT_SLACK floats for interact's spill; with rows16 they hold a feature-major
     * block of width x fm_stride(block) floats, and tt and spare follow stacked */
    const Py_ssize_t held = (rows16 ? fm_stride(block) : block) * width;
    const Py_ssize_t ab = scratch_at(held + OUT_SLACK), st = scratch_at(block * (F + 1) * dim),
                     tts = rows16 ? scratch_at(GROUP_ROWS * (F + 1) * dim) : 0,
                     spare_floats = rows16 ? GROUP_ROWS * width + OUT_SLACK : 0;
    float *scratch = thread_scratch((size_t)(2 * ab + st + tts + spare_floats));
    if (scratch == NULL) return -2;
    const int64_t *offsets = net->offsets;
    int64_t bad = -1;
    float *a = scratch, *b = a + ab, *stacked = b + ab; /* with rows16, tt and spare follow stacked */
    const float *table = net->table;
    const Py_ssize_t table_rows = net->table_rows;
    const int n_layers = net->n_bottom + net->n_top;
    for (Py_ssize_t r0 = 0; r0 < B; r0 += block) {
        const Py_ssize_t nb = B - r0 < block ? B - r0 : block;
        const float *x = dense + r0 * net->n_dense;
        for (int l = 0; l < net->n_bottom; l++) {
            float *y = (l % 2 == 0) ? a : b;
            any_layer(nb, net->in[l], net->out[l], x, net->wt[l], net->bias[l], y, 1);
            x = y;
        }
        /* rows16 reads the rows of whole groups of 16 where they are: only their ids are checked here;
         * the rows after them are copied to stacked */
        const int grouped = rows16 && nb >= GROUP_ROWS; /* this block through rows_interact16 */
        const Py_ssize_t in_place = grouped ? nb / GROUP_ROWS * GROUP_ROWS : 0;
        for (Py_ssize_t r = 0; r < in_place && bad < 0; r++) {
            const int64_t *row_ids = ids + (r0 + r) * F;
            for (Py_ssize_t c = 0; c < F && !net->pooled; c++)
                if (!id_in_table(offsets, F, table_rows, c, row_ids[c])) {
                    bad = (r0 + r) * F + c;
                    break;
                }
        }
        for (Py_ssize_t r = in_place; r < nb && bad < 0; r++) {
            float *s = stacked + r * (F + 1) * dim;
            const int64_t *row_ids = ids + (r0 + r) * F;
            if (r + 1 < nb) /* the next row's embeddings: their cache misses overlap this row's copies */
                for (Py_ssize_t c = 0; c < F; c++)
                    if (net->pooled || id_in_table(offsets, F, table_rows, c, row_ids[F + c]))
                        __builtin_prefetch(table + (offsets[c] + row_ids[F + c]) * dim);
            copy_floats(s, x + r * dim, dim);
            for (Py_ssize_t c = 0; c < F; c++) { /* an id must stay inside its own column's table */
                const int64_t id = row_ids[c];
                if (!net->pooled && !id_in_table(offsets, F, table_rows, c, id)) {
                    bad = (r0 + r) * F + c;
                    break;
                }
                copy_floats(s + (c + 1) * dim, table + (offsets[c] + id) * dim, dim);
            }
        }
        if (bad >= 0) break;
        float *inter = (x == a) ? b : a;
        int l = net->n_bottom;
#if WIDE
        if (grouped) { /* the interaction feature-major, read so by the first top layer */
            const Py_ssize_t ld = fm_stride(nb);
            const Gather g = {x, table, offsets, ids + r0 * F};
            float *tt = stacked + st, *spare = tt + tts;
            rows_interact16(nb, (int)(F + 1), (int)dim, (int)net->P, net->pair_i, net->pair_j, &g, stacked, tt,
                            spare, inter, ld);
            float *y = (inter == a) ? b : a;
            layer16_fm(nb, net->in[l], net->out[l], inter, ld, net->wt[l], net->bias[l], y, l < n_layers - 1);
            x = y;
            l++;
        } else
#endif
        {
            any_interact(nb, (int)(F + 1), (int)dim, (int)net->P, net->pair_i, net->pair_j, stacked, inter);
            x = inter;
        }
        for (; l < n_layers; l++) {
            float *y = (x == a) ? b : a;
            any_layer(nb, net->in[l], net->out[l], x, net->wt[l], net->bias[l], y, l < n_layers - 1);
            x = y;
        }
        for (Py_ssize_t r = 0; r < nb; r++) out[r0 + r] = 1.0f / (1.0f + expf(-x[r]));
    }
    return bad;
}

/* The rows of dense [B x n_dense] and ids [B x F] (buffers taken into io[0], io[1]) through net into out
 * (io[2], B floats); None, or NULL with an exception set. */
static PyObject *net_forward(const Net *net, Buffer *io) {
    const Py_ssize_t B = io[2].view.len / 4, F = net->F;
    if (io[1].view.len / 8 != B * F || io[0].view.len / 4 != B * net->n_dense) {
        PyErr_SetString(PyExc_ValueError, "dense must be [rows x the first layer's inputs], ids [rows x columns], "
                                          "out [rows]");
        return NULL;
    }
    const int64_t *ids = io[1].view.buf;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = net_run(net, io[0].view.buf, ids, B, io[2].view.buf);
    Py_END_ALLOW_THREADS
    if (bad == -2) return PyErr_NoMemory();
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "row %zd, column %zd: id %lld is outside its embedding table", (Py_ssize_t)(bad / F),
                     (Py_ssize_t)(bad % F), (long long)ids[bad]);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int io_take(PyObject *dense, PyObject *ids, PyObject *out, Buffer *io) {
    return take(dense, &io[0], "dense", 4, 0) < 0 || take(ids, &io[1], "ids", 8, 0) < 0 || take(out, &io[2], "out", 4, 1) < 0
               ? -1
               : 0;
}

/* forward(dense, ids, bottom, table, offsets, pair_i, pair_j, top, out)
 *   dense [B x n_dense] f32, ids [B x F] i64, bottom/top: tuples of (wt [in x out] f32, bias [out] f32),
 *   table [rows x dim] f32, offsets [F] i64, pair_i/pair_j [P] i32, out [B] f32 */
static PyObject *forward(PyObject *self, PyObject *args) {
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    Buffer fixed[4] = {0}, layers[2 * MAX_LAYERS] = {0}, io[3] = {0};
    Net net;
    PyObject *result = NULL;
    if (net_take(o[2], o[3], o[4], o[5], o[6], o[7], fixed, layers, &net) == 0 && io_take(o[0], o[1], o[8], io) == 0)
        result = net_forward(&net, io);
    give_back(io, 3);
    give_back(fixed, 4);
    give_back(layers, 2 * MAX_LAYERS);
    return result;
}

/* Weights(bottom, table, offsets, pair_i, pair_j, top): the weights taken and checked once, held for the
 * object's life; calling it, (dense, ids, out), is forward() for them without the per-call taking
 * and checking of every weight array (about a third of a one-row call). */
typedef struct {
    PyObject_HEAD
    Buffer fixed[4];
    Buffer layers[2 * MAX_LAYERS];
    Net net;
} Weights;

static void weights_dealloc(PyObject *obj) {
    Weights *w = (Weights *)obj;
    give_back(w->fixed, 4);
    give_back(w->layers, 2 * MAX_LAYERS);
    Py_TYPE(obj)->tp_free(obj);
}

static PyObject *weights_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *o[6];
    if ((kwargs && PyDict_GET_SIZE(kwargs)) ||
        !PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Weights(bottom, table, offsets, pair_i, pair_j, top)");
        return NULL;
    }
    Weights *w = (Weights *)type->tp_alloc(type, 0); /* zeroed: no buffer held yet */
    if (w == NULL) return NULL;
    if (net_take(o[0], o[1], o[2], o[3], o[4], o[5], w->fixed, w->layers, &w->net) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

static PyObject *weights_call(PyObject *obj, PyObject *args, PyObject *kwargs) {
    PyObject *dense, *ids, *out;
    if ((kwargs && PyDict_GET_SIZE(kwargs)) || !PyArg_ParseTuple(args, "OOO", &dense, &ids, &out)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "call with (dense, ids, out)");
        return NULL;
    }
    Buffer io[3] = {0};
    PyObject *result = io_take(dense, ids, out, io) == 0 ? net_forward(&((Weights *)obj)->net, io) : NULL;
    give_back(io, 3);
    return result;
}

static int64_t api_forward_pooled(PyObject *weights, const float *dense, const float *pooled, int64_t rows, float *out);

/* weights.pooled(dense, pooled, out): the MLPs over gathered rows (pooled float32 [rows x F x dim]) */
static PyObject *weights_pooled(PyObject *obj, PyObject *args) {
    PyObject *dense, *pooled, *out;
    if (!PyArg_ParseTuple(args, "OOO", &dense, &pooled, &out)) return NULL;
    const Net *net = &((Weights *)obj)->net;
    Buffer io[3] = {0};
    PyObject *result = NULL;
    if (take(dense, &io[0], "dense", 4, 0) == 0 && take(pooled, &io[1], "pooled", 4, 0) == 0 &&
        take(out, &io[2], "out", 4, 1) == 0) {
        const Py_ssize_t B = io[2].view.len / 4;
        if (io[0].view.len != B * net->n_dense * 4 || io[1].view.len != B * net->F * net->dim * 4) {
            PyErr_SetString(PyExc_ValueError, "dense must be [rows x n_dense], pooled [rows x F x dim], out [rows]");
        } else {
            int64_t bad;
            Py_BEGIN_ALLOW_THREADS
            bad = api_forward_pooled(obj, io[0].view.buf, io[1].view.buf, B, io[2].view.buf);
            Py_END_ALLOW_THREADS
            result = bad == -1 ? Py_NewRef(Py_None) : PyErr_NoMemory();
        }
    }
    give_back(io, 3);
    return result;
}

static PyMethodDef weights_methods[] = {
    {"pooled", weights_pooled, METH_VARARGS, "pooled(dense, pooled, out): the MLPs over rows gathered already"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WeightsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ensemble.native._dlrm.Weights",
    .tp_basicsize = sizeof(Weights),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Weights(bottom, table, offsets, pair_i, pair_j, top): forward()'s weights, taken once; "
              "call with (dense, ids, out)",
    .tp_new = weights_new,
    .tp_dealloc = weights_dealloc,
    .tp_call = weights_call,
    .tp_methods = weights_methods,
};

/* The C entry point (api.h), over a Weights object its caller holds. */
static int64_t api_n_dense(PyObject *weights) { return ((Weights *)weights)->net.n_dense; }
static int64_t api_n_ids(PyObject *weights) { return ((Weights *)weights)->net.F; }
static int64_t api_forward(PyObject *weights, const float *dense, const int64_t *ids, int64_t rows, float *out) {
    return net_run(&((Weights *)weights)->net, dense, ids, rows, out);
}

/* The MLPs over rows gathered already (a row store's, ensemble/native/_tables.c): pooled [rows x F x dim] is the
 * table, row r's column c its row r * F + c, every offset 0; the same kernels and floats as forward's. */
static int64_t api_forward_pooled(PyObject *weights, const float *dense, const float *pooled, int64_t rows, float *out) {
    const Net *held = &((Weights *)weights)->net;
    if (rows <= 0) return -1;
    int64_t *index = malloc((size_t)(rows * held->F) * sizeof *index + (size_t)held->F * sizeof *index);
    if (index == NULL) return -2;
    int64_t *zero = index + rows * held->F;
    for (int64_t i = 0; i < rows * held->F; i++) index[i] = i;
    memset(zero, 0, (size_t)held->F * sizeof *zero);
    Net net = *held;
    net.table = pooled;
    net.offsets = zero;
    net.table_rows = rows * held->F;
    net.pooled = 1;
    const int64_t result = net_run(&net, dense, index, rows, out);
    free(index);
    return result;
}

static const EnsembleDlrmApi API = {api_n_dense, api_n_ids, api_forward, api_forward_pooled, NULL, NULL};

static PyObject *vectorized(PyObject *self, PyObject *unused) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("x86-64-v3"));
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *wide(PyObject *self, PyObject *args) {
    int enable = -1;
    if (!PyArg_ParseTuple(args, "|p", &enable)) return NULL;
    if (enable >= 0) wide_ok = enable && cpu_wide();
    return PyBool_FromLong(wide_ok);
}

static PyMethodDef methods[] = {
    {"wide", wide, METH_VARARGS,
     "wide([enable]): whether the AVX-512 build of the layers and the interaction runs; wide(False) turns it "
     "off for the process and wide(True) back on where the CPU has it (both give the same floats)"},
    {"vectorized", vectorized, METH_NOARGS, "whether this CPU runs the AVX2+FMA build of the kernels"},
    {"forward", forward, METH_VARARGS,
     "forward(dense, ids, bottom, table, offsets, pair_i, pair_j, top, out): DLRM probabilities into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_dlrm", .m_doc = "A DLRM forward pass in C.",
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__dlrm(void) {
    wide_ok = cpu_wide();
    if (PyType_Ready(&WeightsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_DLRM_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Weights", (PyObject *)&WeightsType) < 0 || PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
