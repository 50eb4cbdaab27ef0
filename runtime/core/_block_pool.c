/*
 * The KV block pool of runtime.core._core.Scheduler: a fixed pool of blocks with reference counts and
 * two free queues. Blocks that were never cached ("fresh") are allocated first, FIFO; free blocks that
 * are still in the prefix cache are evicted only when no fresh block is left, least recently used
 * first. Declarations and the shared state: _sched.h. Twin: runtime/core/reference/block_pool.py.
 */

#include "_sched.h"

/* ---- free lists ------------------------------------------------------------------------- */

static void list_push_back(Sched *s, int w, int32_t b) {
    s->where[b] = (uint8_t)w;
    s->lnext[b] = -1;
    s->lprev[b] = s->tail[w];
    if (s->tail[w] >= 0) {
        s->lnext[s->tail[w]] = b;
    } else {
        s->head[w] = b;
    }
    s->tail[w] = b;
    s->count[w]++;
}

static void list_remove(Sched *s, int32_t b) {
    int w = s->where[b];
    int32_t p = s->lprev[b], n = s->lnext[b];
    if (p >= 0) {
        s->lnext[p] = n;
    } else {
        s->head[w] = n;
    }
    if (n >= 0) {
        s->lprev[n] = p;
    } else {
        s->tail[w] = p;
    }
    s->where[b] = IN_USE;
    s->count[w]--;
}

/* ---- pool ------------------------------------------------------------------------------- */

int bp_init(Sched *s) {
    int64_t nb = s->nb;
    s->ref = PyMem_Calloc((size_t)nb, sizeof(int32_t));
    s->where = PyMem_Calloc((size_t)nb, 1);
    s->bcached = PyMem_Calloc((size_t)nb, 1);
    s->bhash = PyMem_Calloc((size_t)nb, sizeof(uint64_t));
    s->bparent = PyMem_Calloc((size_t)nb, sizeof(uint64_t));
    s->btok = s->caching ? PyMem_Calloc((size_t)(nb * s->bs), sizeof(int64_t)) : NULL;
    s->lprev = PyMem_Calloc((size_t)nb, sizeof(int32_t));
    s->lnext = PyMem_Calloc((size_t)nb, sizeof(int32_t));
    if (!s->ref || !s->where || !s->bcached || !s->bhash || !s->bparent || (s->caching && !s->btok) || !s->lprev ||
        !s->lnext) {
        PyErr_NoMemory();
        return -1;
    }
    s->head[IN_FREE] = s->tail[IN_FREE] = s->head[IN_CACHED] = s->tail[IN_CACHED] = -1;
    for (int64_t b = 0; b < nb; b++) {
        list_push_back(s, IN_FREE, (int32_t)b);
    }
    return 0;
}

void bp_free(Sched *s) {
    void *arrays[] = {s->ref, s->where, s->bcached, s->bhash, s->bparent, s->btok, s->lprev, s->lnext};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) {
        PyMem_Free(arrays[i]);
    }
}

int32_t bp_alloc(Sched *s) {
    int32_t b;
    if (s->count[IN_FREE] > 0) {
        b = s->head[IN_FREE];
    } else {
        b = s->head[IN_CACHED];
    }
    list_remove(s, b);
    if (s->bcached[b]) {
        pc_uncache(s, b);
    }
    s->ref[b] = 1;
    return b;
}

int bp_release(Sched *s, int32_t b) {
    if (s->ref[b] < 1) {
        PyErr_Format(PyExc_RuntimeError, "block %d freed twice", (int)b);
        return -1;
    }
    if (--s->ref[b] == 0) {
        list_push_back(s, s->bcached[b] ? IN_CACHED : IN_FREE, b);
    }
    return 0;
}

void bp_claim(Sched *s, int32_t b) { /* a prefix-cache hit */
    if (s->ref[b] == 0) {
        list_remove(s, b);
    }
    s->ref[b]++;
}

void bp_touch(Sched *s, int32_t b) {
    if (s->where[b] == IN_CACHED) {
        list_remove(s, b);
        list_push_back(s, IN_CACHED, b);
    }
}
