/*
 * compiler.quant._int4 -- round-to-nearest INT4 of a float32 weight in one pass per group, and the packing of
 * INT4 codes for MatMulNBits: the hot loops of quantize_rtn and pack_matmulnbits (compiler/quant/int4.py),
 * which every INT4 build runs over every Linear weight.
 *
 * Plain C against the CPython API and the buffer protocol: no numpy headers, no PyTorch. The Python twins are
 * int4.quantize_rtn_reference (torch) and int4.pack_matmulnbits_reference (numpy); tests/test_quant_int4_c.py
 * compares them with hypothesis, bit for bit. SSE2 (every x86-64 CPU) where the compiler targets it, the same operations in scalar C elsewhere and
 * for the tails.
 *
 * ---------------------------------------------------------------------------------------
 * CONTRACT
 * ---------------------------------------------------------------------------------------
 * rtn_int4(w, group_size, symmetric, codes, scales, zeros) -> bool
 *     w           C-contiguous 2-D float32 buffer [N, K]
 *     group_size  int >= 1: groups of group_size consecutive columns per row, the last one holding
 *                 K - (G - 1) * group_size columns, G = ceil(K / group_size)
 *     symmetric   bool
 *     codes       writable C-contiguous 2-D uint8 buffer [N, K]
 *     scales      writable C-contiguous 2-D float32 buffer [N, G]
 *     zeros       writable C-contiguous 2-D uint8 buffer [N, G]
 *     Effect, per row and group with real columns x (float32 arithmetic, IEEE round-to-nearest-even):
 *       asymmetric: lo = min(min x, 0), hi = max(max x, 0), s = max(hi - lo, 1e-5f) / 15,
 *                   z = clamp(rint(-lo / s), 0, 15)
 *       symmetric:  a = max(|min x|, |max x|), s = max(2 a, 1e-5f) / 15, z = 8
 *       codes = clamp(rint(x / s) + z, 0, 15); scales = s; zeros = z.
 *     Returns True; False when w holds an infinity or NaN (the outputs are then unspecified and the
 *     caller computes them the reference way, whose NaN semantics are torch's). The loop runs
 *     without the GIL.
 *     Errors: TypeError (not a buffer, wrong element type), ValueError (dimensions, shapes that do
 *     not match w, not C-contiguous, read-only output, group_size < 1).
 *
 * pack_nbits(codes, zeros, block_size, b, zero_points) -> None
 *     codes        C-contiguous 2-D uint8 buffer [N, K], values 0..15
 *     zeros        C-contiguous 2-D uint8 buffer [N, G], G = ceil(K / block_size), values 0..15
 *     block_size   even int >= 2
 *     b            writable C-contiguous 2-D uint8 buffer [N, G * block_size / 2]
 *     zero_points  writable C-contiguous 2-D uint8 buffer [N, ceil(G / 2)]
 *     Effect: com.microsoft.MatMulNBits' layout (int4.pack_matmulnbits_reference, its twin): each row's
 *     codes, padded to G * block_size columns with the last group's zero point, two to a byte (the first
 *     in the low nibble); each row's zero points two to a byte, an odd count padded with 0. The loop runs
 *     without the GIL.
 *     Errors: as rtn_int4; ValueError for an odd block_size.
 * ---------------------------------------------------------------------------------------
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAXQ 15.0f
#define SYMMETRIC_ZERO 8.0f
#define MIN_RANGE 1e-5f
/* x + 1.5 * 2^23 - 1.5 * 2^23 is x rounded to the nearest integer, ties to even, for |x| < 2^22 in the default
 * rounding mode: the quotients here are at most about 15 in magnitude when w is finite. */
#define ROUNDER 12582912.0f

static inline float round_even(float x) { return (x + ROUNDER) - ROUNDER; }

static inline float clampq(float x) {
    x = x < 0.0f ? 0.0f : x;
    return x > MAXQ ? MAXQ : x;
}

/* min and max of x[0..n), and whether every value is finite (x * 0 is 0 for a finite x, NaN otherwise). */
static int group_range(const float *x, Py_ssize_t n, float *mn_out, float *mx_out) {
    float mn = x[0], mx = x[0], bad = 0.0f;
    Py_ssize_t j = 0;
#ifdef __SSE2__
    if (n >= 4) {
        __m128 vmn = _mm_loadu_ps(x), vmx = vmn, vbad = _mm_setzero_ps(), zero = _mm_setzero_ps();
        for (; j + 4 <= n; j += 4) {
            __m128 v = _mm_loadu_ps(x + j);
            vmn = _mm_min_ps(vmn, v);
            vmx = _mm_max_ps(vmx, v);
            vbad = _mm_add_ps(vbad, _mm_mul_ps(v, zero));
        }
        float a[4], b[4], c[4];
        _mm_storeu_ps(a, vmn);
        _mm_storeu_ps(b, vmx);
        _mm_storeu_ps(c, vbad);
        mn = a[0];
        mx = b[0];
        for (int i = 0; i < 4; i++) {
            mn = a[i] < mn ? a[i] : mn;
            mx = b[i] > mx ? b[i] : mx;
            bad += c[i];
        }
    }
#endif
    for (; j < n; j++) {
        float v = x[j];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        bad += v * 0.0f;
    }
    *mn_out = mn;
    *mx_out = mx;
    return bad == 0.0f;
}

/* codes of x[0..n) with scale s and zero point z. */
static void quantize_group(const float *x, Py_ssize_t n, float s, float z, uint8_t *out) {
    Py_ssize_t j = 0;
#ifdef __SSE2__
    const __m128 vs = _mm_set1_ps(s), vz = _mm_set1_ps(z), vr = _mm_set1_ps(ROUNDER);
    const __m128 lo = _mm_setzero_ps(), hi = _mm_set1_ps(MAXQ);
    for (; j + 16 <= n; j += 16) {
        __m128i q[4];
        for (int i = 0; i < 4; i++) {
            __m128 v = _mm_div_ps(_mm_loadu_ps(x + j + 4 * i), vs);
            v = _mm_sub_ps(_mm_add_ps(v, vr), vr);
            v = _mm_min_ps(_mm_max_ps(_mm_add_ps(v, vz), lo), hi);
            q[i] = _mm_cvttps_epi32(v); /* integral values 0..15: exact */
        }
        __m128i w16 = _mm_packs_epi32(q[0], q[1]), x16 = _mm_packs_epi32(q[2], q[3]);
        _mm_storeu_si128((__m128i *)(out + j), _mm_packus_epi16(w16, x16));
    }
#endif
    for (; j < n; j++) {
        out[j] = (uint8_t)clampq(round_even(x[j] / s) + z);
    }
}

typedef struct {
    const float *w;
    uint8_t *codes;
    float *scales;
    uint8_t *zeros;
    Py_ssize_t n, k, g, gs;
    int symmetric;
} rtn_job;

static int run_rtn(const rtn_job *job) {
    int finite = 1;
    for (Py_ssize_t r = 0; r < job->n && finite; r++) {
        const float *row = job->w + r * job->k;
        for (Py_ssize_t gi = 0; gi < job->g; gi++) {
            Py_ssize_t j0 = gi * job->gs;
            Py_ssize_t len = job->k - j0 < job->gs ? job->k - j0 : job->gs;
            float mn, mx, s, z;
            if (!group_range(row + j0, len, &mn, &mx)) {
                finite = 0;
                break;
            }
            if (job->symmetric) {
                float a = fabsf(mn) > fabsf(mx) ? fabsf(mn) : fabsf(mx);
                float d = 2.0f * a;
                s = (d < MIN_RANGE ? MIN_RANGE : d) / MAXQ;
                z = SYMMETRIC_ZERO;
            } else {
                float lo = mn < 0.0f ? mn : 0.0f, hi = mx > 0.0f ? mx : 0.0f;
                float d = hi - lo;
                s = (d < MIN_RANGE ? MIN_RANGE : d) / MAXQ;
                z = clampq(round_even(-lo / s));
            }
            job->scales[r * job->g + gi] = s;
            job->zeros[r * job->g + gi] = (uint8_t)z;
            quantize_group(row + j0, len, s, z, job->codes + r * job->k + j0);
        }
    }
    return finite;
}

/* A 2-D C-contiguous buffer of one element type; 0 on success, -1 with an exception set. */
static int get_2d(PyObject *obj, Py_buffer *v, const char *name, char fmt, int writable) {
    int flags = (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS;
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a buffer, got %s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous%s buffer", name, writable ? ", writable" : "");
        return -1;
    }
    const char *f = v->format ? v->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') {
        f++;
    }
    if (f[0] != fmt || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s: expected element type '%c', got '%s'", name, fmt, v->format);
        PyBuffer_Release(v);
        return -1;
    }
    if (v->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s: expected 2 dimensions, got %d", name, v->ndim);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *rtn_int4(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *wo, *co, *so, *zo;
    Py_ssize_t gs;
    int symmetric;
    if (!PyArg_ParseTuple(args, "OnpOOO:rtn_int4", &wo, &gs, &symmetric, &co, &so, &zo)) {
        return NULL;
    }
    if (gs < 1) {
        PyErr_Format(PyExc_ValueError, "group_size: expected >= 1, got %zd", gs);
        return NULL;
    }
    Py_buffer w, c, s, z;
    if (get_2d(wo, &w, "w", 'f', 0) < 0) {
        return NULL;
    }
    if (get_2d(co, &c, "codes", 'B', 1) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    if (get_2d(so, &s, "scales", 'f', 1) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&c);
        return NULL;
    }
    if (get_2d(zo, &z, "zeros", 'B', 1) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&c);
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_ssize_t n = w.shape[0], k = w.shape[1], g = (k + gs - 1) / gs;
    PyObject *result = NULL;
    if (c.shape[0] != n || c.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "codes: expected [%zd, %zd], got [%zd, %zd]", n, k, c.shape[0], c.shape[1]);
    } else if (s.shape[0] != n || s.shape[1] != g) {
        PyErr_Format(PyExc_ValueError, "scales: expected [%zd, %zd], got [%zd, %zd]", n, g, s.shape[0], s.shape[1]);
    } else if (z.shape[0] != n || z.shape[1] != g) {
        PyErr_Format(PyExc_ValueError, "zeros: expected [%zd, %zd], got [%zd, %zd]", n, g, z.shape[0], z.shape[1]);
    } else {
        rtn_job job = {w.buf, c.buf, s.buf, z.buf, n, k, g, gs, symmetric};
        int finite = 1;
        if (n > 0 && k > 0) {
            Py_BEGIN_ALLOW_THREADS finite = run_rtn(&job);
            Py_END_ALLOW_THREADS
        }
        result = PyBool_FromLong(finite);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&c);
    PyBuffer_Release(&s);
    PyBuffer_Release(&z);
    return result;
}

static void run_pack(const uint8_t *codes, const uint8_t *zeros, uint8_t *b, uint8_t *zp, Py_ssize_t n,
                     Py_ssize_t k, Py_ssize_t g, Py_ssize_t bs) {
    Py_ssize_t half = bs / 2, zbytes = (g + 1) / 2, whole = k / 2;
    for (Py_ssize_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * k, *z = zeros + r * g;
        uint8_t *out = b + r * g * half, *zo = zp + r * zbytes;
        for (Py_ssize_t j = 0; j < whole; j++) { /* pairs of real columns */
            out[j] = (uint8_t)((c[2 * j] & 0x0F) | (c[2 * j + 1] << 4));
        }
        uint8_t pad = z[g - 1];
        for (Py_ssize_t j = whole; j < g * half; j++) { /* a pair with padding, then padding only */
            uint8_t lo = 2 * j < k ? c[2 * j] : pad, hi = 2 * j + 1 < k ? c[2 * j + 1] : pad;
            out[j] = (uint8_t)((lo & 0x0F) | (hi << 4));
        }
        for (Py_ssize_t j = 0; j < zbytes; j++) {
            uint8_t lo = z[2 * j], hi = 2 * j + 1 < g ? z[2 * j + 1] : 0;
            zo[j] = (uint8_t)((lo & 0x0F) | (hi << 4));
        }
    }
}

static PyObject *pack_nbits(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *co, *zo, *bo, *po;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OOnOO:pack_nbits", &co, &zo, &bs, &bo, &po)) {
        return NULL;
    }
    if (bs < 2 || bs % 2) {
        PyErr_Format(PyExc_ValueError, "block_size: expected an even number >= 2, got %zd", bs);
        return NULL;
    }
    Py_buffer v[4];
    const char *names[4] = {"codes", "zeros", "b", "zero_points"};
    PyObject *objs[4] = {co, zo, bo, po};
    int got = 0;
    for (; got < 4; got++) {
        if (get_2d(objs[got], &v[got], names[got], 'B', got >= 2) < 0) {
            break;
        }
    }
    PyObject *result = NULL;
    if (got == 4) {
        Py_ssize_t n = v[0].shape[0], k = v[0].shape[1], g = (k + bs - 1) / bs;
        Py_ssize_t want[4][2] = {{n, k}, {n, g}, {n, g * (bs / 2)}, {n, (g + 1) / 2}};
        int i = 1;
        for (; i < 4; i++) {
            if (v[i].shape[0] != want[i][0] || v[i].shape[1] != want[i][1]) {
                PyErr_Format(PyExc_ValueError, "%s: expected [%zd, %zd], got [%zd, %zd]", names[i], want[i][0],
                             want[i][1], v[i].shape[0], v[i].shape[1]);
                break;
            }
        }
        if (i == 4) {
            if (n > 0 && k > 0) {
                Py_BEGIN_ALLOW_THREADS run_pack(v[0].buf, v[1].buf, v[2].buf, v[3].buf, n, k, g, bs);
                Py_END_ALLOW_THREADS
            }
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    for (int i = 0; i < got; i++) {
        PyBuffer_Release(&v[i]);
    }
    return result;
}

static PyMethodDef int4_methods[] = {
    {"rtn_int4", rtn_int4, METH_VARARGS,
     "rtn_int4(w, group_size, symmetric, codes, scales, zeros) -> bool: round-to-nearest INT4 of the float32 "
     "[N, K] buffer w into codes [N, K] uint8, scales [N, G] float32, zeros [N, G] uint8; False when w is not "
     "finite (outputs unspecified)."},
    {"pack_nbits", pack_nbits, METH_VARARGS,
     "pack_nbits(codes, zeros, block_size, b, zero_points) -> None: INT4 codes [N, K] and zero points [N, G] "
     "(uint8) packed two to a byte as com.microsoft.MatMulNBits reads them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef int4_module = {
    PyModuleDef_HEAD_INIT, "_int4", "Round-to-nearest INT4 quantization and MatMulNBits packing (the hot loops of compiler/quant/int4.py).", -1,
    int4_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__int4(void) { return PyModule_Create(&int4_module); }
