/*
 * runtime.core._core -- the C engine core: KV scatter and block copy (this file), the Scheduler
 * type (_scheduler.c on _block_pool.c and _prefix_cache.c, sharing _sched.h), sampling
 * (_sampler.c). Shared internals: _core.h.
 *
 * Plain C against the CPython API and the buffer protocol: no numpy headers, no PyTorch.
 * The pure-Python twin of every function lives in the package runtime/core/reference/ (a module
 * per C file) and is the test oracle (tests/test_core_c.py compares the two).
 *
 * ---------------------------------------------------------------------------------------
 * CONTRACT (this file)
 * ---------------------------------------------------------------------------------------
 * scatter_kv(pool, new, slot_mapping) -> None
 *     pool          writable, C-contiguous buffer, 4-D [num_blocks, block_size, kv_heads, head_dim]
 *     new           C-contiguous buffer, 3-D [T, kv_heads, head_dim], same element type as pool
 *                   (float32 'f', float16 'e', float64 'd', or any integer/bool type: same kind
 *                   and itemsize as pool; native byte order)
 *     slot_mapping  C-contiguous 1-D int64 buffer [T]
 *     Effect: for t in 0..T-1, pool's flat slot slot_mapping[t] (slot = block * block_size +
 *     offset, i.e. row slot of pool viewed as [num_blocks*block_size, kv_heads, head_dim])
 *     receives new[t]. Later t wins when slots repeat. Everything is validated before the
 *     first byte is written; the copy loop runs without the GIL.
 *     Errors (the message names the argument):
 *       TypeError   an argument without the buffer protocol; element type of new differs from
 *                   pool's (kind or itemsize); unsupported or non-native format; slot_mapping
 *                   not int64
 *       ValueError  wrong number of dimensions; new's [kv_heads, head_dim] differs from pool's;
 *                   len(slot_mapping) != T; a buffer not C-contiguous; pool read-only; a slot
 *                   outside [0, num_blocks * block_size)
 *
 * scatter_kv_layers(pools, news, slot_mapping) -> None
 *     pools, news   sequences of equal length L (one pool and one new tensor per layer)
 *     slot_mapping  as above, shared by every layer
 *     Effect: scatter_kv(pools[i], news[i], slot_mapping) for every i, in one call. All layers
 *     are validated before any is written (no partial update on error); one GIL release.
 *     Errors: as scatter_kv, message prefixed with "layer i: "; TypeError when pools/news are
 *     not sequences; ValueError when their lengths differ.
 *
 * copy_blocks(pools, pairs) -> None
 *     pools         sequence of 4-D writable C-contiguous buffers [num_blocks, block_size, ...]
 *                   (every layer's K and V pool; element type as in scatter_kv)
 *     pairs         (src, dst) block ids: an integer buffer [P, 2] (C-contiguous) or a sequence
 *                   of 2-item sequences of ints
 *     Effect: for each pair in order, for each pool: pool[dst] = pool[src] (a block is
 *     block_size * kv_heads * head_dim elements); src == dst is a no-op. Everything is
 *     validated before the first byte is written; the copies run without the GIL.
 *     Errors: TypeError (not buffers / not pairs of ints / unsupported format), ValueError
 *     (dimensions, contiguity, read-only, a block id outside [0, num_blocks) of some pool,
 *     naming the pair and the pool).
 * ---------------------------------------------------------------------------------------
 */

#include "_core.h"

#include <string.h>
int core_grow(void **arr, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) {
        return 0;
    }
    int64_t ncap = *cap > 4 ? *cap : 4;
    while (ncap < need) {
        ncap *= 2;
    }
    void *p = PyMem_Realloc(*arr, (size_t)ncap * item);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = ncap;
    return 0;
}

/* Element kind of a struct-module format: 'f' float, 'i' signed int, 'u' unsigned, 'b' bool;
 * 0 for anything else (compound, non-native byte order, pointers, ...). */
char core_format_kind(const char *fmt) {
    if (fmt == NULL) {
        return 'u'; /* NULL format means unsigned bytes ('B') */
    }
    if (fmt[0] == '@' || fmt[0] == '=' ) {
        fmt++;
    } else if (fmt[0] == '<' || fmt[0] == '>' || fmt[0] == '!') {
        const uint16_t probe = 1;
        const int little = *(const uint8_t *)&probe == 1;
        if ((fmt[0] == '<') != little) {
            return 0;
        }
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0') {
        return 0;
    }
    switch (fmt[0]) {
    case 'e': case 'f': case 'd':
        return 'f';
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        return 'i';
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        return 'u';
    case '?':
        return 'b';
    default:
        return 0;
    }
}

/* One layer's validated views. */
typedef struct {
    Py_buffer pool;
    Py_buffer new_;
    int have_pool;
    int have_new;
    char *pool_base;
    const char *new_base;
    Py_ssize_t row_bytes;
} layer_t;

static void layer_release(layer_t *l) {
    if (l->have_pool) {
        PyBuffer_Release(&l->pool);
        l->have_pool = 0;
    }
    if (l->have_new) {
        PyBuffer_Release(&l->new_);
        l->have_new = 0;
    }
}

/* Get a strided buffer with format; TypeError naming `name` when obj has none. */
int core_get_buffer(PyObject *obj, Py_buffer *view, int extra_flags, const char *prefix, const char *name) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s%s: expected an object with the buffer protocol, got %.100s",
                     prefix, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO | extra_flags) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_ValueError, "%s%s: cannot export a %sstrided buffer (%S)", prefix, name,
                     (extra_flags & PyBUF_WRITABLE) ? "writable " : "", value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    return 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, const char *prefix, const char *name) {
    return core_get_buffer(obj, view, 0, prefix, name);
}

/* Validate slot_mapping; fill *slots, *n. */
static int check_slots(Py_buffer *s, const int64_t **slots, Py_ssize_t *n) {
    if (s->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "slot_mapping: expected 1 dimension [T], got %d", s->ndim);
        return -1;
    }
    if (core_format_kind(s->format) != 'i' || s->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "slot_mapping: expected int64, got format '%s' with itemsize %zd",
                     s->format ? s->format : "B", s->itemsize);
        return -1;
    }
    if (!PyBuffer_IsContiguous(s, 'C')) {
        PyErr_SetString(PyExc_ValueError, "slot_mapping: must be C-contiguous");
        return -1;
    }
    *slots = (const int64_t *)s->buf;
    *n = s->shape[0];
    return 0;
}

/* Get and validate one layer's pool and new against slots[0..n). `prefix` goes in front of
 * every message ("" or "layer 3: "). On error the views acquired so far stay in `l` for
 * layer_release. */
static int check_layer(layer_t *l, PyObject *pool_obj, PyObject *new_obj, const int64_t *slots,
                       Py_ssize_t n, const char *prefix) {
    if (get_buffer(pool_obj, &l->pool, prefix, "pool") < 0) {
        return -1;
    }
    l->have_pool = 1;
    if (get_buffer(new_obj, &l->new_, prefix, "new") < 0) {
        return -1;
    }
    l->have_new = 1;
    Py_buffer *p = &l->pool, *w = &l->new_;

    if (p->ndim != 4) {
        PyErr_Format(PyExc_ValueError,
                     "%spool: expected 4 dimensions [num_blocks, block_size, kv_heads, head_dim], got %d",
                     prefix, p->ndim);
        return -1;
    }
    if (w->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%snew: expected 3 dimensions [T, kv_heads, head_dim], got %d",
                     prefix, w->ndim);
        return -1;
    }
    char pk = core_format_kind(p->format), wk = core_format_kind(w->format);
    if (pk == 0) {
        PyErr_Format(PyExc_TypeError, "%spool: unsupported element format '%s'", prefix, p->format);
        return -1;
    }
    if (wk != pk || w->itemsize != p->itemsize) {
        PyErr_Format(PyExc_TypeError,
                     "%snew: element format '%s' (itemsize %zd) does not match pool's '%s' (itemsize %zd)",
                     prefix, w->format ? w->format : "B", w->itemsize, p->format ? p->format : "B",
                     p->itemsize);
        return -1;
    }
    if (w->shape[1] != p->shape[2] || w->shape[2] != p->shape[3]) {
        PyErr_Format(PyExc_ValueError,
                     "%snew: shape [%zd, %zd, %zd] does not match pool's [kv_heads, head_dim] = [%zd, %zd]",
                     prefix, w->shape[0], w->shape[1], w->shape[2], p->shape[2], p->shape[3]);
        return -1;
    }
    if (w->shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "%sslot_mapping: length %zd != new's T=%zd", prefix, n, w->shape[0]);
        return -1;
    }
    if (!PyBuffer_IsContiguous(p, 'C')) {
        PyErr_Format(PyExc_ValueError, "%spool: must be C-contiguous", prefix);
        return -1;
    }
    if (!PyBuffer_IsContiguous(w, 'C')) {
        PyErr_Format(PyExc_ValueError, "%snew: must be C-contiguous", prefix);
        return -1;
    }
    if (p->readonly) {
        PyErr_Format(PyExc_ValueError, "%spool: buffer is read-only", prefix);
        return -1;
    }
    Py_ssize_t num_slots = p->shape[0] * p->shape[1];
    for (Py_ssize_t t = 0; t < n; t++) {
        if (slots[t] < 0 || slots[t] >= (int64_t)num_slots) {
            PyErr_Format(PyExc_ValueError, "%sslot_mapping: slot %lld (token %zd) outside the pool's [0, %zd)",
                         prefix, (long long)slots[t], t, num_slots);
            return -1;
        }
    }
    l->row_bytes = p->shape[2] * p->shape[3] * p->itemsize;
    l->pool_base = (char *)p->buf;
    l->new_base = (const char *)w->buf;
    return 0;
}

static void copy_layer(const layer_t *l, const int64_t *slots, Py_ssize_t n) {
    const Py_ssize_t row = l->row_bytes;
    for (Py_ssize_t t = 0; t < n; t++) {
        memmove(l->pool_base + (Py_ssize_t)slots[t] * row, l->new_base + t * row, (size_t)row);
    }
}

PyDoc_STRVAR(scatter_kv_doc,
             "scatter_kv(pool, new, slot_mapping)\n--\n\n"
             "Copy new[t] ([T, kv_heads, head_dim]) into flat slot slot_mapping[t] (int64) of pool\n"
             "([num_blocks, block_size, kv_heads, head_dim], writable, C-contiguous, same dtype).\n"
             "Validates everything first; raises TypeError/ValueError naming the argument.");

static PyObject *scatter_kv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pool_obj, *new_obj, *slot_obj;
    if (!PyArg_ParseTuple(args, "OOO:scatter_kv", &pool_obj, &new_obj, &slot_obj)) {
        return NULL;
    }
    Py_buffer sview;
    if (get_buffer(slot_obj, &sview, "", "slot_mapping") < 0) {
        return NULL;
    }
    const int64_t *slots;
    Py_ssize_t n;
    layer_t layer = {0};
    PyObject *result = NULL;
    if (check_slots(&sview, &slots, &n) < 0 || check_layer(&layer, pool_obj, new_obj, slots, n, "") < 0) {
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_layer(&layer, slots, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    layer_release(&layer);
    PyBuffer_Release(&sview);
    return result;
}

PyDoc_STRVAR(scatter_kv_layers_doc,
             "scatter_kv_layers(pools, news, slot_mapping)\n--\n\n"
             "scatter_kv(pools[i], news[i], slot_mapping) for every layer i in one call.\n"
             "All layers are validated before any is written.");

static PyObject *scatter_kv_layers(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pools_obj, *news_obj, *slot_obj;
    if (!PyArg_ParseTuple(args, "OOO:scatter_kv_layers", &pools_obj, &news_obj, &slot_obj)) {
        return NULL;
    }
    PyObject *pools = NULL, *news = NULL, *result = NULL;
    layer_t *layers = NULL;
    Py_ssize_t num_layers = 0;
    Py_buffer sview;
    int have_slots = 0;

    pools = PySequence_Fast(pools_obj, "pools: expected a sequence of pool buffers");
    if (pools == NULL) {
        goto done;
    }
    news = PySequence_Fast(news_obj, "news: expected a sequence of new K/V buffers");
    if (news == NULL) {
        goto done;
    }
    num_layers = PySequence_Fast_GET_SIZE(pools);
    if (PySequence_Fast_GET_SIZE(news) != num_layers) {
        PyErr_Format(PyExc_ValueError, "pools and news: %zd pools but %zd new tensors", num_layers,
                     PySequence_Fast_GET_SIZE(news));
        goto done;
    }
    if (get_buffer(slot_obj, &sview, "", "slot_mapping") < 0) {
        goto done;
    }
    have_slots = 1;
    const int64_t *slots;
    Py_ssize_t n;
    if (check_slots(&sview, &slots, &n) < 0) {
        goto done;
    }
    layers = PyMem_Calloc(num_layers > 0 ? (size_t)num_layers : 1, sizeof(layer_t));
    if (layers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < num_layers; i++) {
        char prefix[48];
        snprintf(prefix, sizeof prefix, "layer %zd: ", i);
        if (check_layer(&layers[i], PySequence_Fast_GET_ITEM(pools, i), PySequence_Fast_GET_ITEM(news, i),
                        slots, n, prefix) < 0) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < num_layers; i++) {
        copy_layer(&layers[i], slots, n);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (layers != NULL) {
        for (Py_ssize_t i = 0; i < num_layers; i++) {
            layer_release(&layers[i]);
        }
        PyMem_Free(layers);
    }
    if (have_slots) {
        PyBuffer_Release(&sview);
    }
    Py_XDECREF(pools);
    Py_XDECREF(news);
    return result;
}

/* ---- copy_blocks ------------------------------------------------------------------------ */

static int pair_value(PyObject *obj, int64_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "pairs: expected (src, dst) pairs of integer block ids, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "pairs: block id out of range");
        return -1;
    }
    *out = v;
    return 0;
}

/* pairs -> PyMem array of 2 * *count int64 (caller frees). */
static int parse_pairs(PyObject *obj, int64_t **out, Py_ssize_t *count) {
    *out = NULL;
    *count = 0;
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer v;
        if (get_buffer(obj, &v, "", "pairs") < 0) {
            return -1;
        }
        char kind = core_format_kind(v.format);
        Py_ssize_t n = v.ndim >= 1 ? v.shape[0] : 0;
        if (v.len == 0) {
            PyBuffer_Release(&v);
            *out = PyMem_Malloc(sizeof(int64_t) * 2);
            return *out ? 0 : (PyErr_NoMemory(), -1);
        }
        if (v.ndim != 2 || v.shape[1] != 2 || (kind != 'i' && kind != 'u') ||
            (v.itemsize != 1 && v.itemsize != 2 && v.itemsize != 4 && v.itemsize != 8)) {
            PyErr_Format(PyExc_TypeError, "pairs: expected (src, dst) pairs of integer block ids, got format '%s' "
                         "with %d dimensions", v.format ? v.format : "B", v.ndim);
            PyBuffer_Release(&v);
            return -1;
        }
        int64_t *p = PyMem_Malloc((size_t)n * 2 * sizeof(int64_t));
        if (p == NULL) {
            PyBuffer_Release(&v);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            for (int j = 0; j < 2; j++) {
                const char *e = (const char *)v.buf + i * v.strides[0] + j * v.strides[1];
                int64_t x;
                if (kind == 'i') {
                    switch (v.itemsize) {
                    case 1: x = *(const int8_t *)e; break;
                    case 2: { int16_t t; memcpy(&t, e, 2); x = t; break; }
                    case 4: { int32_t t; memcpy(&t, e, 4); x = t; break; }
                    default: memcpy(&x, e, 8); break;
                    }
                } else {
                    uint64_t u;
                    switch (v.itemsize) {
                    case 1: u = *(const uint8_t *)e; break;
                    case 2: { uint16_t t; memcpy(&t, e, 2); u = t; break; }
                    case 4: { uint32_t t; memcpy(&t, e, 4); u = t; break; }
                    default: memcpy(&u, e, 8); break;
                    }
                    if (u > (uint64_t)INT64_MAX) {
                        PyMem_Free(p);
                        PyBuffer_Release(&v);
                        PyErr_SetString(PyExc_ValueError, "pairs: block id out of range");
                        return -1;
                    }
                    x = (int64_t)u;
                }
                p[2 * i + j] = x;
            }
        }
        PyBuffer_Release(&v);
        *out = p;
        *count = n;
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "pairs: expected (src, dst) pairs of block ids");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *p = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(int64_t));
    if (p == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i),
                                         "pairs: expected (src, dst) pairs of integer block ids");
        int bad = pair == NULL;
        if (!bad && PySequence_Fast_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "pairs: expected (src, dst) pairs of integer block ids");
            bad = 1;
        }
        if (!bad && (pair_value(PySequence_Fast_GET_ITEM(pair, 0), &p[2 * i]) < 0 ||
                     pair_value(PySequence_Fast_GET_ITEM(pair, 1), &p[2 * i + 1]) < 0)) {
            bad = 1;
        }
        Py_XDECREF(pair);
        if (bad) {
            PyMem_Free(p);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = p;
    *count = n;
    return 0;
}

PyDoc_STRVAR(copy_blocks_doc,
             "copy_blocks(pools, pairs)\n--\n\n"
             "For each (src, dst) in order, pool[dst] = pool[src] in every pool ([num_blocks, block_size,\n"
             "kv_heads, head_dim], writable, C-contiguous). Validates everything before writing.");

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pools_obj, *pairs_obj;
    if (!PyArg_ParseTuple(args, "OO:copy_blocks", &pools_obj, &pairs_obj)) {
        return NULL;
    }
    PyObject *pools = PySequence_Fast(pools_obj, "pools: expected a sequence of pool buffers");
    if (pools == NULL) {
        return NULL;
    }
    int64_t *pairs = NULL;
    Py_ssize_t npairs = 0, npools = PySequence_Fast_GET_SIZE(pools), have = 0;
    Py_buffer *views = NULL;
    PyObject *result = NULL;
    if (parse_pairs(pairs_obj, &pairs, &npairs) < 0) {
        goto done;
    }
    views = PyMem_Calloc(npools > 0 ? (size_t)npools : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < npools; i++) {
        char name[48];
        snprintf(name, sizeof name, "pools[%zd]", i);
        Py_buffer *v = &views[i];
        if (get_buffer(PySequence_Fast_GET_ITEM(pools, i), v, "", name) < 0) {
            goto done;
        }
        have = i + 1;
        if (v->ndim != 4) {
            PyErr_Format(PyExc_ValueError, "%s: expected 4 dimensions [num_blocks, block_size, kv_heads, head_dim], "
                         "got %d", name, v->ndim);
            goto done;
        }
        if (core_format_kind(v->format) == 0) {
            PyErr_Format(PyExc_TypeError, "%s: unsupported element format '%s'", name, v->format);
            goto done;
        }
        if (!PyBuffer_IsContiguous(v, 'C')) {
            PyErr_Format(PyExc_ValueError, "%s: must be C-contiguous", name);
            goto done;
        }
        if (v->readonly) {
            PyErr_Format(PyExc_ValueError, "%s: buffer is read-only", name);
            goto done;
        }
        for (Py_ssize_t k = 0; k < 2 * npairs; k++) {
            if (pairs[k] < 0 || pairs[k] >= (int64_t)v->shape[0]) {
                PyErr_Format(PyExc_ValueError, "pairs: block id %lld (pair %zd) outside %s's [0, %zd)",
                             (long long)pairs[k], k / 2, name, v->shape[0]);
                goto done;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < npools; i++) {
        char *base = (char *)views[i].buf;
        const Py_ssize_t block = views[i].shape[0] > 0 ? views[i].len / views[i].shape[0] : 0;
        for (Py_ssize_t k = 0; k < npairs; k++) {
            if (pairs[2 * k] != pairs[2 * k + 1]) {
                memcpy(base + pairs[2 * k + 1] * block, base + pairs[2 * k] * block, (size_t)block);
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < have; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(pairs);
    Py_DECREF(pools);
    return result;
}

static PyMethodDef core_methods[] = {
    {"scatter_kv", scatter_kv, METH_VARARGS, scatter_kv_doc},
    {"scatter_kv_layers", scatter_kv_layers, METH_VARARGS, scatter_kv_layers_doc},
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(core_doc,
             "The C engine core of the optimize runtime (twin: runtime.core.reference).\n\n"
             "scatter_kv / scatter_kv_layers: write new K/V rows into the paged pools.\n"
             "copy_blocks: copy-on-write copies of KV blocks in every pool.\n"
             "Scheduler: block pool, prefix cache, scheduler step, packing (use runtime.core.Scheduler).\n"
             "sample / sample_probs: the sampler (use runtime.sampling.Sampler).");

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", core_doc, -1, core_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddFunctions(m, core_sampler_methods) < 0 || core_scheduler_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
