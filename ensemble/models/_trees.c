/* Boosted trees as arrays, evaluated tree-major over the whole batch.
 *
 * Every tree is stored as a complete binary tree of the model's maximum depth D (node i's children
 * at 2i+1 and 2i+2; a leaf above depth D fills every complete-tree leaf below it with its value),
 * so a row's path is D steps of the same branch-free arithmetic: no mispredicted branches, and no
 * per-tree code to fetch. The whole batch passes through one tree before the next (the tree's
 * nodes stay in L1), and rows go in groups of LANES whose paths are independent, so the CPU works
 * on LANES loads at once instead of waiting for one path's chain of loads.
 *
 * Node layout (ensemble/models/xgb.py, TreeArrays): feature index with bit 31 set when a missing
 * value (NaN) takes the left child; threshold: a present value goes left when value < threshold
 * (XGBoost's rule). The sum over trees is in float32, in tree order, then the base margin and the
 * sigmoid: XGBoost's operations in XGBoost's order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MISSING_LEFT 0x80000000u

static void evaluate(const float *x, Py_ssize_t n_rows, Py_ssize_t n_features, Py_ssize_t n_trees, int depth,
                     const uint32_t *node_feature, const float *node_threshold, const float *leaves,
                     float base_margin, float *out) {
    const Py_ssize_t n_internal = ((Py_ssize_t)1 << depth) - 1, n_leaves = (Py_ssize_t)1 << depth;
    memset(out, 0, sizeof(float) * (size_t)n_rows);
    for (Py_ssize_t t = 0; t < n_trees; t++) {
        const uint32_t *nf = node_feature + t * n_internal;
        const float *nt = node_threshold + t * n_internal;
        const float *lv = leaves + t * n_leaves - n_internal; /* indexed by complete-tree node */
        Py_ssize_t r0 = 0;
        for (; r0 + LANES <= n_rows; r0 += LANES) {
            const float *xr = x + r0 * n_features;
            uint32_t idx[LANES] = {0};
            for (int level = 0; level < depth; level++) {
                for (int k = 0; k < LANES; k++) {
                    uint32_t i = idx[k], f = nf[i];
                    float v = xr[k * n_features + (f & ~MISSING_LEFT)];
                    uint32_t right = (uint32_t)(v >= nt[i]) | ((uint32_t)(v != v) & ((f >> 31) ^ 1u));
                    idx[k] = 2 * i + 1 + right;
                }
            }
            for (int k = 0; k < LANES; k++) out[r0 + k] += lv[idx[k]];
        }
        for (; r0 < n_rows; r0++) {
            const float *xr = x + r0 * n_features;
            uint32_t i = 0;
            for (int level = 0; level < depth; level++) {
                uint32_t f = nf[i];
                float v = xr[f & ~MISSING_LEFT];
                uint32_t right = (uint32_t)(v >= nt[i]) | ((uint32_t)(v != v) & ((f >> 31) ^ 1u));
                i = 2 * i + 1 + right;
            }
            out[r0] += lv[i];
        }
    }
    for (Py_ssize_t r = 0; r < n_rows; r++) out[r] = 1.0f / (1.0f + expf(-(out[r] + base_margin)));
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

/* predict(x, n_features, node_feature, node_threshold, leaves, depth, base_margin, out) */
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
    if (get(nf_obj, &nf, "node_feature", 0, 4) < 0) goto fail_x;
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
    /* Feature indices are checked once, when the arrays are built (TreeArrays in xgb.py): not per call. */
    Py_BEGIN_ALLOW_THREADS
    evaluate(x.buf, n_rows, n_features, n_trees, depth, nf.buf, nt.buf, lv.buf, base_margin, out.buf);
    Py_END_ALLOW_THREADS
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

static PyMethodDef methods[] = {
    {"predict", predict, METH_VARARGS, "predict(x, n_features, node_feature, node_threshold, leaves, depth, "
                                       "base_margin, out): P(click) of every row into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_trees", "Boosted trees as arrays.", -1, methods};

PyMODINIT_FUNC PyInit__trees(void) { return PyModule_Create(&module); }
