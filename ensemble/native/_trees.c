/* Boosted trees as arrays, evaluated tree-major over blocks of rows.
 *
 * Every tree is stored as a complete binary tree of the model's maximum depth D (node i's children
 * at 2i+1 and 2i+2; a leaf above depth D fills every complete-tree leaf below it with its value),
 * so a row's path is D steps of the same branch-free arithmetic: no mispredicted branches, and no
 * per-tree code to fetch. A block of rows passes through one tree before the next (the tree's nodes
 * stay in L1, the block's values too), and rows go in groups of LANES whose paths are independent
 * and held in registers, so the CPU works on LANES chains of loads at once.
 *
 * Missing values cost nothing per node: each feature f is given twice, column 2f with NaN read as
 * -inf and column 2f + 1 with NaN read as +inf, and a node whose missing values go right reads
 * column 2f + 1 (+inf >= any finite threshold), one whose missing values go left column 2f; present
 * values are the same in both. A step is then: column, value, value >= threshold (XGBoost sends a
 * present value left when value < threshold), next node. Node layout (ensemble/models/xgb.py,
 * TreeArrays): the column, and a finite threshold. The block's values are stored column-major per
 * group ([column][lane]), so a lane's value is at a fixed offset from the column's.
 *
 * A block of fewer than LANES rows (a request of a few rows) goes the other way: each row through
 * TREE_LANES trees at once, their leaf values then added in tree order. One row's path through one
 * tree is a chain of dependent loads (each node's index comes from the previous node's comparison),
 * and a tree's nodes are in L2 or further at one row, so one row walked tree by tree waited on one
 * load at a time: 9.5 us a call for one row of the exported 222 trees, 4.1 us this way.
 *
 * On a CPU with AVX-512 (x86-64-v4), a block of 16 rows or more of trees at least 6 deep goes 16 rows
 * a vector instead (walk16): a step is a gather of the 16 rows' values at their nodes' columns, one
 * compare and a masked add. The first five levels' 31 nodes of a tree sit in four registers (their
 * thresholds in two, their columns in two), read by a permute; deeper nodes and the leaves are
 * gathered from the arrays. One chain of steps waits on its gathers, so 8 chains run at once: 4
 * groups of 16 rows through 2 trees, or fewer groups through 4 trees (a block's last group has lanes
 * without rows, filled with zeros and not written out). The paths, the leaves and the sums are the
 * walk's above, so the scores are the same floats bit for bit (tests/unit/test_models.py compares the
 * two). The exported 207 trees of depth 8, pinned to one core on the Intel Xeon VM (benchmarks.kernels):
 * 1.56x as fast a row at 16 rows, 1.80x at 100 and 1.99x at 1,400. Blocks under 16 rows keep the
 * 8-lane walk, whose lanes they fill.
 *
 * The sum over trees is in float32, in tree order, then the base margin and the sigmoid: XGBoost's
 * operations in XGBoost's order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "api.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define WIDE 1
#define V4 __attribute__((target("arch=x86-64-v4")))
#else
#define WIDE 0
#endif

#define LANES 8 /* measured at 100 rows: 4 lanes 1.45x the time, 16 lanes 1.04x */
#define TREE_LANES 16 /* trees one row walks at once in a block under LANES rows (1-row TreeScorer call: 6.2-6.6 us; 8 trees: 6.9-8.2) */
#define BLOCK_ROWS 64 /* 64 rows x 2 x 39 features = 20 KB of values, in L1 */
_Static_assert(BLOCK_ROWS % LANES == 0, "a block is whole groups of lanes");

/* The paths of n rows (lanes k0 .. k0 + n - 1 of a group) through one tree, added to their sums. n is a
 * constant at each call site, so the lanes unroll and their node indices stay in registers. */
static inline __attribute__((always_inline)) void walk(const int n, const float *vg, int k0, const uint32_t *nc,
                                                      const float *nt, const float *lv, int depth, float *sum) {
    uint32_t idx[LANES] = {0};
    for (int level = 0; level < depth; level++) {
#pragma GCC unroll 16
        for (int k = 0; k < n; k++) {
            const uint32_t i = idx[k];
            idx[k] = 2 * i + 1 + (uint32_t)(vg[nc[i] * LANES + k0 + k] >= nt[i]);
        }
    }
#pragma GCC unroll 16
    for (int k = 0; k < n; k++) sum[k0 + k] += lv[idx[k]];
}

/* One row's paths through n consecutive trees at once (n a constant at each call site), their leaf
 * values into leaf[0 .. n). v: the row's values, column c at v[c * LANES]. */
static inline __attribute__((always_inline)) void walk_trees(const int n, const float *v, const uint32_t *nc,
                                                            const float *nt, const float *lv, Py_ssize_t n_internal,
                                                            Py_ssize_t n_leaves, int depth, float *leaf) {
    uint32_t idx[TREE_LANES] = {0};
    for (int level = 0; level < depth; level++) {
#pragma GCC unroll 16
        for (int k = 0; k < n; k++) {
            const uint32_t i = idx[k];
            idx[k] = 2 * i + 1 + (uint32_t)(v[nc[k * n_internal + i] * LANES] >= nt[k * n_internal + i]);
        }
    }
#pragma GCC unroll 16
    for (int k = 0; k < n; k++) leaf[k] = lv[k * n_leaves + idx[k]];
}

/* A block's values for the walks: row r's feature f as columns 2f (NaN as -inf) and 2f + 1 (NaN as +inf),
 * stored per group of `lanes` rows as [column][lane] (lanes a constant at each call site). Rows nb to
 * rows - 1, lanes without a row, get 0 (any finite value: their paths are walked, never written out). */
static inline __attribute__((always_inline)) void fill_values(const float *x, Py_ssize_t nb, Py_ssize_t rows,
                                                             Py_ssize_t n_features, const int lanes, float *values) {
    const Py_ssize_t cols = 2 * n_features;
    for (Py_ssize_t r = 0; r < rows; r++) {
        float *vr = values + (r / lanes) * cols * lanes + r % lanes;
        for (Py_ssize_t f = 0; f < n_features; f++) {
            const float v = r < nb ? x[r * n_features + f] : 0.f;
            vr[(2 * f) * lanes] = v != v ? -INFINITY : v;
            vr[(2 * f + 1) * lanes] = v != v ? INFINITY : v;
        }
    }
}

#if WIDE
#define WIDE_LANES 16
#define PERMUTED_LEVELS 5 /* nodes 0..30, permuted from registers (16 nodes each); a tree needs 32 nodes (depth >= 6) */

/* ng groups of 16 rows (vb: their values, [group][column][lane]) through `trees` consecutive trees
 * at once (ng and trees constants at each call site, so the chains' node indices stay in registers),
 * the leaf values added to acc[group] tree by tree in tree order. nc, nt, lv: the first tree's node
 * columns, thresholds and leaves (lv indexed by complete-tree node). */
static inline __attribute__((always_inline)) V4 void walk16(const int ng, const int trees, const float *vb,
        Py_ssize_t cols, const uint32_t *nc, const float *nt, const float *lv, Py_ssize_t n_internal,
        Py_ssize_t n_leaves, int depth, __m512 *acc) {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 thr_lo[4], thr_hi[4];
    __m512i col_lo[4], col_hi[4], idx[4][4];
#pragma GCC unroll 4
    for (int k = 0; k < trees; k++) {
        thr_lo[k] = _mm512_loadu_ps(nt + k * n_internal);
        thr_hi[k] = _mm512_loadu_ps(nt + k * n_internal + 16);
        col_lo[k] = _mm512_loadu_si512(nc + k * n_internal);
        col_hi[k] = _mm512_loadu_si512(nc + k * n_internal + 16);
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) idx[k][g] = _mm512_setzero_si512();
    }
/* one level of one chain: the lanes' values at their nodes' columns, >= the thresholds, next nodes */
#define STEP16(K, G, THR, COL)                                                                           \
    do {                                                                                                 \
        const __m512i at_ = _mm512_add_epi32(_mm512_slli_epi32(COL, 4), lane);                           \
        const __m512 v_ = _mm512_i32gather_ps(at_, vb + (G) * cols * WIDE_LANES, 4);                     \
        const __mmask16 right_ = _mm512_cmp_ps_mask(v_, THR, _CMP_GE_OQ);                                \
        idx[K][G] = _mm512_add_epi32(_mm512_add_epi32(idx[K][G], idx[K][G]), one);                       \
        idx[K][G] = _mm512_mask_add_epi32(idx[K][G], right_, idx[K][G], one);                            \
    } while (0)
    for (int level = 0; level < PERMUTED_LEVELS; level++) {
#pragma GCC unroll 4
        for (int k = 0; k < trees; k++)
#pragma GCC unroll 4
            for (int g = 0; g < ng; g++) {
                const __m512 thr = _mm512_permutex2var_ps(thr_lo[k], idx[k][g], thr_hi[k]);
                const __m512i col = _mm512_permutex2var_epi32(col_lo[k], idx[k][g], col_hi[k]);
                STEP16(k, g, thr, col);
            }
    }
    for (int level = PERMUTED_LEVELS; level < depth; level++) {
#pragma GCC unroll 4
        for (int k = 0; k < trees; k++)
#pragma GCC unroll 4
            for (int g = 0; g < ng; g++) {
                const __m512 thr = _mm512_i32gather_ps(idx[k][g], nt + k * n_internal, 4);
                const __m512i col = _mm512_i32gather_epi32(idx[k][g], (const int *)(nc + k * n_internal), 4);
                STEP16(k, g, thr, col);
            }
    }
#undef STEP16
#pragma GCC unroll 4
    for (int k = 0; k < trees; k++)
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) acc[g] = _mm512_add_ps(acc[g], _mm512_i32gather_ps(idx[k][g], lv + k * n_leaves, 4));
}

/* One block of nb (16..BLOCK_ROWS) rows through every tree, 16 lanes wide; their sums into sum. */
V4 static void block16(const float *x, Py_ssize_t nb, Py_ssize_t n_features, Py_ssize_t n_trees, int depth,
                       const uint32_t *node_column, const float *node_threshold, const float *leaves,
                       float *values, float *sum) {
    const Py_ssize_t n_internal = ((Py_ssize_t)1 << depth) - 1, n_leaves = (Py_ssize_t)1 << depth;
    const Py_ssize_t cols = 2 * n_features;
    /* trees at once: ~8 chains in flight. Against the 8-lane walk (the exported 207 trees of depth 8, pinned,
     * Intel Xeon VM): 16 rows through 1, 2 or 4 trees at once 0.77x, 1.18x and 1.56x as fast; 64 rows 1.80x,
     * 1.99x and 1.84x (16 chains run out of registers) */
    const int ng = (int)((nb + WIDE_LANES - 1) / WIDE_LANES), at_once = ng > 2 ? 2 : 4;
    fill_values(x, nb, ng * WIDE_LANES, n_features, WIDE_LANES, values);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    Py_ssize_t t = 0;
#define WALK16(G, N)                                                                                      \
    walk16(G, N, values, cols, node_column + t * n_internal, node_threshold + t * n_internal,              \
           leaves + t * n_leaves - n_internal, n_internal, n_leaves, depth, acc)
    for (; t + at_once <= n_trees; t += at_once) {
        switch (ng) {
        case 4: WALK16(4, 2); break;
        case 3: WALK16(3, 2); break;
        case 2: WALK16(2, 4); break;
        default: WALK16(1, 4); break;
        }
    }
    for (; t < n_trees; t++) { /* the last trees, one at a time */
        switch (ng) {
        case 4: WALK16(4, 1); break;
        case 3: WALK16(3, 1); break;
        case 2: WALK16(2, 1); break;
        default: WALK16(1, 1); break;
        }
    }
#undef WALK16
    float lanes[BLOCK_ROWS];
    for (int g = 0; g < ng; g++) _mm512_storeu_ps(lanes + g * WIDE_LANES, acc[g]);
    memcpy(sum, lanes, sizeof(float) * (size_t)nb);
}

static int cpu_wide(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4");
}
#else
static int cpu_wide(void) { return 0; }
#endif
_Static_assert(BLOCK_ROWS <= 64, "walk16 takes at most 4 groups of 16 rows");

/* Whether blocks of 16 rows or more go 16 lanes wide: set at import when the CPU has AVX-512;
 * wide(False) turns it off. */
static int wide_ok;

/* One block of nb (1..BLOCK_ROWS) rows through every tree, 8 lanes wide (or, under 8 rows, each row
 * through TREE_LANES trees at once); their sums into sum. */
static void block8(const float *x, Py_ssize_t nb, Py_ssize_t n_features, Py_ssize_t n_trees, int depth,
                   const uint32_t *node_column, const float *node_threshold, const float *leaves, float *values,
                   float *sum) {
    const Py_ssize_t n_internal = ((Py_ssize_t)1 << depth) - 1, n_leaves = (Py_ssize_t)1 << depth;
    const Py_ssize_t cols = 2 * n_features;
    fill_values(x, nb, nb, n_features, LANES, values);
    memset(sum, 0, sizeof(float) * (size_t)nb);
    if (nb < LANES) { /* a few rows: each row through TREE_LANES trees at once, summed in tree order */
        for (Py_ssize_t r = 0; r < nb; r++) {
            const float *v = values + r; /* one group: lane r */
            float leaf[TREE_LANES], total = 0.f;
            Py_ssize_t t = 0;
            for (; t + TREE_LANES <= n_trees; t += TREE_LANES) {
                walk_trees(TREE_LANES, v, node_column + t * n_internal, node_threshold + t * n_internal,
                           leaves + t * n_leaves - n_internal, n_internal, n_leaves, depth, leaf);
                for (int k = 0; k < TREE_LANES; k++) total += leaf[k];
            }
            for (; t < n_trees; t++) {
                walk_trees(1, v, node_column + t * n_internal, node_threshold + t * n_internal,
                           leaves + t * n_leaves - n_internal, n_internal, n_leaves, depth, leaf);
                total += leaf[0];
            }
            sum[r] = total;
        }
    } else {
        for (Py_ssize_t t = 0; t < n_trees; t++) {
            const uint32_t *nc = node_column + t * n_internal;
            const float *nt = node_threshold + t * n_internal;
            const float *lv = leaves + t * n_leaves - n_internal; /* indexed by complete-tree node */
            for (Py_ssize_t g0 = 0; g0 < nb; g0 += LANES) {
                const float *vg = values + (g0 / LANES) * cols * LANES;
                const int n = nb - g0 < LANES ? (int)(nb - g0) : LANES;
                if (n == LANES) {
                    walk(LANES, vg, 0, nc, nt, lv, depth, sum + g0);
                } else { /* the block's last rows: 4, 2 and 1 lanes, never a lane without a row */
                    int k0 = 0;
                    if (n & 4) walk(4, vg, k0, nc, nt, lv, depth, sum + g0), k0 += 4;
                    if (n & 2) walk(2, vg, k0, nc, nt, lv, depth, sum + g0), k0 += 2;
                    if (n & 1) walk(1, vg, k0, nc, nt, lv, depth, sum + g0);
                }
            }
        }
    }
}

static void evaluate(const float *x, Py_ssize_t n_rows, Py_ssize_t n_features, Py_ssize_t n_trees, int depth,
                     const uint32_t *node_column, const float *node_threshold, const float *leaves,
                     float base_margin, float *values, float *out) {
    float sum[BLOCK_ROWS];
    for (Py_ssize_t r0 = 0; r0 < n_rows; r0 += BLOCK_ROWS) {
        const Py_ssize_t nb = n_rows - r0 < BLOCK_ROWS ? n_rows - r0 : BLOCK_ROWS;
#if WIDE
        if (wide_ok && nb >= WIDE_LANES && depth > PERMUTED_LEVELS)
            block16(x + r0 * n_features, nb, n_features, n_trees, depth, node_column, node_threshold, leaves,
                    values, sum);
        else
#endif
            block8(x + r0 * n_features, nb, n_features, n_trees, depth, node_column, node_threshold, leaves,
                   values, sum);
        for (Py_ssize_t r = 0; r < nb; r++) out[r0 + r] = 1.0f / (1.0f + expf(-(sum[r] + base_margin)));
    }
}

static int get(PyObject *obj, Py_buffer *view, const char *name, int writable, Py_ssize_t itemsize) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", name, view->itemsize, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The C entry point (api.h): predict's arithmetic on arrays its caller holds. */
static size_t scratch_floats(int64_t n_features) { return (size_t)(BLOCK_ROWS * 2 * n_features); }

static void api_predict(const float *x, int64_t rows, int64_t n_features, int64_t n_trees, int depth,
                        const uint32_t *node_column, const float *node_threshold, const float *leaves,
                        float base_margin, float *scratch, float *out) {
    evaluate(x, rows, n_features, n_trees, depth, node_column, node_threshold, leaves, base_margin, scratch, out);
}

static const EnsembleTreesApi API = {scratch_floats, api_predict};

/* predict(x, n_features, node_column, node_threshold, leaves, depth, base_margin, out) */
static PyObject *predict(PyObject *self, PyObject *args) {
    PyObject *x_obj, *nf_obj, *nt_obj, *lv_obj, *out_obj;
    Py_ssize_t n_features;
    int depth;
    float base_margin;
    if (!PyArg_ParseTuple(args, "OnOOOifO", &x_obj, &n_features, &nf_obj, &nt_obj, &lv_obj, &depth, &base_margin,
                          &out_obj))
        return NULL;
    if (depth < 1 || depth > 20 || n_features < 1) {
        PyErr_SetString(PyExc_ValueError, "depth must be 1..20 and n_features >= 1");
        return NULL;
    }
    Py_buffer x, nf, nt, lv, out;
    if (get(x_obj, &x, "x", 0, 4) < 0) return NULL;
    if (get(nf_obj, &nf, "node_column", 0, 4) < 0) goto fail_x;
    if (get(nt_obj, &nt, "node_threshold", 0, 4) < 0) goto fail_nf;
    if (get(lv_obj, &lv, "leaves", 0, 4) < 0) goto fail_nt;
    if (get(out_obj, &out, "out", 1, 4) < 0) goto fail_lv;
    Py_ssize_t n_internal = ((Py_ssize_t)1 << depth) - 1, n_leaves = (Py_ssize_t)1 << depth;
    Py_ssize_t n_trees = nf.len / 4 / n_internal, n_rows = x.len / 4 / n_features;
    if (nf.len / 4 != n_trees * n_internal || nt.len != nf.len || lv.len / 4 != n_trees * n_leaves ||
        x.len / 4 != n_rows * n_features || out.len / 4 != n_rows) {
        PyErr_SetString(PyExc_ValueError, "array sizes do not match the depth, features and rows");
        goto fail_out;
    }
    /* Columns (< 2 n_features) and finite thresholds are checked once, when the arrays are built
     * (TreeArrays in xgb.py): not per call. */
    float *values = PyMem_RawMalloc(sizeof(float) * scratch_floats(n_features));
    if (values == NULL) {
        PyErr_NoMemory();
        goto fail_out;
    }
    Py_BEGIN_ALLOW_THREADS
    evaluate(x.buf, n_rows, n_features, n_trees, depth, nf.buf, nt.buf, lv.buf, base_margin, values, out.buf);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(values);
    PyBuffer_Release(&out);
    PyBuffer_Release(&lv);
    PyBuffer_Release(&nt);
    PyBuffer_Release(&nf);
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
fail_out:
    PyBuffer_Release(&out);
fail_lv:
    PyBuffer_Release(&lv);
fail_nt:
    PyBuffer_Release(&nt);
fail_nf:
    PyBuffer_Release(&nf);
fail_x:
    PyBuffer_Release(&x);
    return NULL;
}

static PyObject *wide(PyObject *self, PyObject *args) {
    int enable = -1;
    if (!PyArg_ParseTuple(args, "|p", &enable)) return NULL;
    if (enable >= 0) wide_ok = enable && cpu_wide();
    return PyBool_FromLong(wide_ok);
}

static PyMethodDef methods[] = {
    {"wide", wide, METH_VARARGS,
     "wide([enable]): whether blocks of 16 rows or more walk the trees 16 lanes wide (AVX-512); wide(False) "
     "turns it off for the process and wide(True) back on where the CPU has it (both give the same floats)"},
    {"predict", predict, METH_VARARGS, "predict(x, n_features, node_column, node_threshold, leaves, depth, "
                                       "base_margin, out): P(click) of every row into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_trees", .m_doc = "Boosted trees as arrays.",
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__trees(void) {
    wide_ok = cpu_wide();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&API, ENSEMBLE_TREES_CAPSULE, NULL);
    if (PyModule_AddObject(m, ENSEMBLE_API_ATTRIBUTE, capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
