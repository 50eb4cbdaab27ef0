/*
 * The prefix cache of runtime.core._core.Scheduler: full, computed blocks keyed by a chained hash
 * (hash(block j) = H(hash(block j-1), its block_size token ids), H keyed by the scheduler's seed), one
 * block per hash in an open-addressing map; the longest cached prefix of a waiting sequence (a hit also
 * compares the stored parent hash and tokens: a collision is a miss); registration of the blocks a step
 * computed; eviction; the KV-cache event log. The cached blocks live in the pool (_block_pool.c), which
 * calls pc_uncache when it evicts one. Declarations and the shared state: _sched.h.
 * Twin: runtime/core/reference/prefix_cache.py.
 */

#include "_sched.h"

#include <string.h>

/* ---- prefix cache map ------------------------------------------------------------------- */

static int32_t cmap_get(const Sched *s, uint64_t h) {
    uint64_t i = core_mix64(h) & s->cmask;
    while (s->cv[i] >= 0) {
        if (s->ck[i] == h) {
            return s->cv[i];
        }
        i = (i + 1) & s->cmask;
    }
    return -1;
}

static void cmap_put(Sched *s, uint64_t h, int32_t b) { /* h absent; load <= 1/2 */
    uint64_t i = core_mix64(h) & s->cmask;
    while (s->cv[i] >= 0) {
        i = (i + 1) & s->cmask;
    }
    s->ck[i] = h;
    s->cv[i] = b;
}

static void cmap_del(Sched *s, uint64_t h) { /* backward-shift deletion */
    uint64_t i = core_mix64(h) & s->cmask;
    while (s->cv[i] >= 0 && s->ck[i] != h) {
        i = (i + 1) & s->cmask;
    }
    if (s->cv[i] < 0) {
        return;
    }
    for (;;) {
        s->cv[i] = -1;
        uint64_t j = i;
        for (;;) {
            j = (j + 1) & s->cmask;
            if (s->cv[j] < 0) {
                return;
            }
            uint64_t k = core_mix64(s->ck[j]) & s->cmask;
            if ((j > i) ? (k <= i || k > j) : (k <= i && k > j)) {
                s->ck[i] = s->ck[j];
                s->cv[i] = s->cv[j];
                i = j;
                break;
            }
        }
    }
}

/* ---- KV-cache events ----------------------------------------------------------------------- */

enum { EV_STORED = 1, EV_REMOVED = 2, EV_CLEARED = 3 };

/* Room for n more words; on failure the log is dropped and kv_events() reports it once. */
static uint64_t *ev_room(Sched *s, int64_t n) {
    if (core_grow((void **)&s->ev, &s->capev, s->nev + n, sizeof(uint64_t)) < 0) {
        PyErr_Clear();
        s->events_lost = 1;
        s->nev = 0;
        return NULL;
    }
    uint64_t *p = s->ev + s->nev;
    s->nev += n;
    return p;
}

static void ev_stored(Sched *s, uint64_t h, uint64_t parent, int has_parent, const int64_t *tok) {
    uint64_t *p = ev_room(s, 4 + s->bs);
    if (p != NULL) {
        p[0] = EV_STORED;
        p[1] = h;
        p[2] = has_parent ? parent : 0;
        p[3] = (uint64_t)has_parent;
        memcpy(p + 4, tok, (size_t)s->bs * sizeof(int64_t));
    }
}

static void ev_removed(Sched *s, uint64_t h) {
    uint64_t *p = ev_room(s, 2);
    if (p != NULL) {
        p[0] = EV_REMOVED;
        p[1] = h;
    }
}

/* ---- eviction --------------------------------------------------------------------------- */

void pc_uncache(Sched *s, int32_t b) {
    if (s->events_on) {
        ev_removed(s, s->bhash[b]);
    }
    cmap_del(s, s->bhash[b]);
    s->bcached[b] = 0;
    s->bhash[b] = 0;
    s->bparent[b] = 0;
}

/* ---- hashing ---------------------------------------------------------------------------- */

/* Width of the block hashes of schedulers created from now on: 64 in production. Tests narrow it
 * (set_hash_bits_for_tests) so that distinct blocks collide and the collision path runs; the twin
 * has the same hook (reference.set_hash_bits_for_tests) with the same semantics: every chained
 * hash, parents included, is the 64-bit hash masked to its low `bits` bits. */
static int test_hash_bits = 64;

static PyObject *set_hash_bits_for_tests(PyObject *Py_UNUSED(module), PyObject *arg) {
    long bits = PyLong_AsLong(arg);
    if (bits == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bits < 1 || bits > 64) {
        PyErr_Format(PyExc_ValueError, "hash bits must be in [1, 64], got %ld", bits);
        return NULL;
    }
    long previous = test_hash_bits;
    test_hash_bits = (int)bits;
    return PyLong_FromLong(previous);
}

PyMethodDef pc_methods[] = {
    {"set_hash_bits_for_tests", set_hash_bits_for_tests, METH_O,
     "set_hash_bits_for_tests(bits) -> previous: block-hash width of schedulers created later (tests only)."},
    {NULL, NULL, 0, NULL},
};

static uint64_t block_hash(uint64_t parent, const int64_t *tok, int64_t n, uint64_t key) {
    uint64_t h = parent ^ key;
    for (int64_t i = 0; i < n; i++) {
        h = core_mix64((h ^ (uint64_t)tok[i]) + CORE_GOLDEN);
    }
    return h;
}

/* Hash of q's full block j (its tokens must be known), memoised. */
static int seq_hash(Sched *s, seq_t *q, int64_t j, uint64_t *out) {
    if (q->nhash <= j) {
        if (core_grow((void **)&q->hashes, &q->caphash, j + 1, sizeof(uint64_t)) < 0) {
            return -1;
        }
        while (q->nhash <= j) {
            int64_t k = q->nhash;
            q->hashes[k] = block_hash(k ? q->hashes[k - 1] : q->root, q->tokens + k * s->bs, s->bs, s->key) & s->hash_mask;
            q->nhash++;
        }
    }
    *out = q->hashes[j];
    return 0;
}

/* ---- lookup and registration ------------------------------------------------------------ */

int64_t pc_lookup(Sched *s, seq_t *q, int32_t *cow, int64_t *cached) {
    *cow = -1;
    *cached = 0;
    if (!s->caching) {
        return 0;
    }
    int64_t nfull = q->ntok / s->bs, nh = 0;
    uint64_t parent = q->root;
    for (int64_t j = 0; j < nfull; j++) {
        uint64_t h;
        if (seq_hash(s, q, j, &h) < 0) {
            return -1;
        }
        int32_t b = cmap_get(s, h);
        if (b < 0 || s->bparent[b] != parent ||
            memcmp(s->btok + (int64_t)b * s->bs, q->tokens + j * s->bs, (size_t)s->bs * sizeof(int64_t)) != 0) {
            break; /* a miss, or a hash collision: never somebody else's K/V */
        }
        s->hits[nh++] = b;
        parent = h;
    }
    if (nh * s->bs < q->ntok) {
        *cached = nh * s->bs;
        return nh;
    }
    nh--; /* every known token is cached: the last one must still run (its logits) */
    if (s->cow && s->bs > 1) {
        *cow = s->hits[nh];
        *cached = q->ntok - 1;
    } else {
        *cached = nh * s->bs;
    }
    return nh;
}

int pc_register_full_blocks(Sched *s, seq_t *q) {
    int64_t full = q->ncomputed / s->bs;
    for (int64_t j = q->nregistered; j < full; j++) {
        uint64_t h;
        if (seq_hash(s, q, j, &h) < 0) {
            return -1;
        }
        int32_t b = q->table[j];
        if (s->bcached[b] || s->ref[b] < 1) {
            PyErr_Format(PyExc_RuntimeError, "block %d cannot be cached (cached %d, ref_count %d)", (int)b,
                         (int)s->bcached[b], (int)s->ref[b]);
            return -1;
        }
        if (cmap_get(s, h) >= 0) {
            continue; /* one block per hash: this one stays a plain block */
        }
        cmap_put(s, h, b);
        s->bcached[b] = 1;
        s->bhash[b] = h;
        s->bparent[b] = j ? q->hashes[j - 1] : q->root;
        memcpy(s->btok + (int64_t)b * s->bs, q->tokens + j * s->bs, (size_t)s->bs * sizeof(int64_t));
        if (s->events_on) {
            ev_stored(s, h, s->bparent[b], j > 0, q->tokens + j * s->bs);
        }
    }
    if (full > q->nregistered) {
        q->nregistered = full;
    }
    return 0;
}

/* ---- lifecycle and the event log's Python side ------------------------------------------------ */

int pc_init(Sched *s, uint64_t seed) {
    s->key = core_mix64(seed + CORE_GOLDEN);
    s->hash_mask = test_hash_bits >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << test_hash_bits) - 1);
    uint64_t ccap = 16;
    while (ccap < (uint64_t)s->nb * 2) {
        ccap *= 2;
    }
    s->cmask = ccap - 1;
    s->ck = PyMem_Calloc(ccap, sizeof(uint64_t));
    s->cv = PyMem_Malloc(ccap * sizeof(int32_t));
    if (!s->ck || !s->cv) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < ccap; i++) {
        s->cv[i] = -1;
    }
    return 0;
}

void pc_free(Sched *s) {
    PyMem_Free(s->ck);
    PyMem_Free(s->cv);
    PyMem_Free(s->ev);
}

PyObject *pc_enable_events(Sched *s) {
    if (s->events_on) {
        Py_RETURN_NONE;
    }
    for (int64_t b = 0; b < s->nb; b++) {
        if (s->bcached[b]) {
            PyErr_SetString(PyExc_RuntimeError,
                            "enable_kv_events() needs an empty prefix cache: call it before the first step");
            return NULL;
        }
    }
    uint64_t *p = ev_room(s, 1);
    if (p == NULL) {
        s->events_lost = 0;
        return PyErr_NoMemory();
    }
    p[0] = EV_CLEARED;
    s->events_on = 1;
    Py_RETURN_NONE;
}

PyObject *pc_take_events(Sched *s) {
    if (s->events_lost) {
        s->events_lost = 0;
        PyErr_SetString(PyExc_MemoryError, "the KV event log lost records (out of memory)");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)s->ev, (Py_ssize_t)(s->nev * (int64_t)sizeof(uint64_t)));
    if (out != NULL) {
        s->nev = 0;
    }
    return out;
}
