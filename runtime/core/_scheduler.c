/*
 * runtime.core._core.Scheduler -- sequences, the waiting and running queues, the scheduler step
 * (decode first, chunked prefill, FCFS admission, preemption by recompute), ForwardBatch packing,
 * the post-step update, and the Python type. It runs on the block pool (_block_pool.c: reference
 * counts, LRU eviction) and the prefix cache (_prefix_cache.c: chained block hashes, lookup,
 * registration, KV-cache events); their shared state is declared in _sched.h.
 *
 * The twin is runtime.core.reference.Scheduler (runtime/core/reference/scheduler.py, on
 * block_pool.py and prefix_cache.py): every decision is the same (block ids, eviction order, entries,
 * copies, counters, error types and messages), and its module docstring draws the index arithmetic.
 * The class the engine uses is runtime.core._cwrap.Scheduler, a subclass that owns the pack buffers
 * and turns `_pack`'s sizes into ForwardBatch views.
 *
 * ---------------------------------------------------------------------------------------
 * CONTRACT (all methods need the GIL; none releases it)
 * ---------------------------------------------------------------------------------------
 * Scheduler(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
 *           enable_prefix_caching, enable_copy_on_write, seed, entry_type, batch_type, stats_type,
 *           buffers)
 *     the five limits: ints in [1, 2**31); enable_prefix_caching, enable_copy_on_write: bools
 *     (SchedulerConfig's meaning); seed: int in [0, 2**64)
 *     (key of the block hash); entry_type: a tuple subclass without extra fields (BatchEntry);
 *     batch_type: callable(entries, block_copies) (ScheduledBatch); stats_type:
 *     callable(requests, queries, hits) (PrefixCacheStats); buffers: 7 writable C-contiguous
 *     1-D buffers, held until the object dies: input_ids int64[>= T], positions int64[>= T],
 *     slot_mapping int64[>= T], cu_seqlens int32[>= S+1], past_lens int32[>= S],
 *     block_table int32[>= S*M], logits_index int64[>= S], where T = max_num_batched_tokens,
 *     S = max_num_seqs, M = ceil(max_model_len / block_size).
 *     Errors: TypeError / ValueError naming the argument; RuntimeError when called twice.
 *     On error the object stays unusable (every method raises RuntimeError).
 *
 * add(seq_id, prompt_ids) -> None          queue a request (FCFS)
 *     seq_id: int in [0, 2**63) not in the scheduler; prompt_ids: sequence of ints in [0, 2**63),
 *     1..max_model_len of them, needing at most num_blocks blocks.
 *     Errors: TypeError (not ints), ValueError (range, duplicate id, empty, too long). On error
 *     nothing changed.
 * abort(seq_id) -> None                    drop a request wherever it is, free its blocks now;
 *     anything that is not a known id is ignored. Never raises (except RuntimeError on a broken
 *     invariant).
 * finish(seq_id) -> None                   the same for a known id; ValueError otherwise.
 * schedule(drafts=None) -> ScheduledBatch | None      one step (see the twin): entries in packing
 *     order and the (src, dst) copy-on-write block copies to apply before the forward. drafts:
 *     None or a dict seq id -> list/tuple of token ids (speculative decoding: a decoding sequence
 *     named there verifies a prefix of them in a chunk of 1 + d tokens; checked whole first:
 *     TypeError / ValueError, nothing changed).
 *     Errors: RuntimeError when one sequence alone outgrows the pool; the state is then the
 *     twin's at the same point (preemptions and allocations done before the raise stay done).
 *     MemoryError: the state may be ahead of what was returned.
 * _pack(batch) -> (T, B, max_blocks, num_logits)
 *     fills the buffers' first T / B+1 / B / B*max_blocks / num_logits elements with the
 *     ForwardBatch of batch.entries (any sequence of BatchEntry-like objects). Validates every
 *     entry against its sequence first (known id, no duplicate, start == computed, 1 <= n,
 *     start + n <= known, needs_logits == (start + n == known), blocks held), then the sizes
 *     (B <= max_num_seqs, T <= max_num_batched_tokens). Errors: TypeError/ValueError; on error
 *     nothing was written. The scheduler's state never changes. Entries that are the very objects
 *     the last schedule() returned (at the same positions) are read from its C copy of their
 *     fields (they are immutable tuples; the scheduler holds them), any other entry is parsed;
 *     both are checked the same way.
 * update(batch, next_tokens) -> None       after the forward: advance computed counts, append
 *     next_tokens[seq_id] (a mapping; ints in [0, 2**63), or a list/tuple of them: accepted
 *     draft tokens then the next one, the rest of the draft rolled back) to each entry that
 *     needs logits, offer newly full blocks to the prefix cache. Entries of unknown (aborted) ids are skipped.
 *     Errors: ValueError (stale entry, duplicate, missing token, bad token), TypeError,
 *     RuntimeError (a sequence already at max_model_len). Everything is checked first: on error
 *     nothing changed.
 * enable_kv_events() -> None             start the KV-cache event log (the prefix cache must be empty:
 *     RuntimeError otherwise; a second call is a no-op). It opens with a "cleared" record; from then
 *     on every block entering the prefix cache logs "stored" (its hash, its parent's hash unless it
 *     is a sequence's first block, its block_size token ids) and every cached block evicted logs
 *     "removed" (its hash), in the order the pool changed.
 * kv_events() -> bytes                     the records logged since the last call, then forgets them:
 *     native-endian uint64 words, [1, hash, parent, has_parent, tok * block_size] | [2, hash] | [3]
 *     (runtime.core.reference.decode_kv_events reads them). b"" when off or nothing happened.
 *     MemoryError once when a record could not be logged (the log was then dropped whole).
 * num_waiting, num_running, num_free_blocks, num_preemptions (read-only ints), has_unfinished(),
 * seq_tokens(id), seq_num_prompt(id), seq_num_cached(id), seq_block_table(id), seq_ids(),
 * prefix_cache_stats(), block_pool_state(): introspection, as in the twin; ValueError for an
 *     unknown id.
 * ---------------------------------------------------------------------------------------
 */

#include "_sched.h"

#include <string.h>

#define I64_MAX_ ((int64_t)0x7FFFFFFFFFFFFFFFLL)

static const char *BUF_NAMES[7] = {"input_ids", "positions", "slot_mapping", "cu_seqlens",
                                   "past_lens", "block_table", "logits_index"};

/* ---- sequence map ----------------------------------------------------------------------- */

static seq_t *smap_get(const Sched *s, int64_t id) {
    uint64_t i = core_mix64((uint64_t)id) & s->smask;
    while (s->sv[i] != NULL) {
        if (s->sk[i] == id) {
            return s->sv[i];
        }
        i = (i + 1) & s->smask;
    }
    return NULL;
}

static void smap_insert_raw(int64_t *sk, seq_t **sv, uint64_t mask, seq_t *q) {
    uint64_t i = core_mix64((uint64_t)q->id) & mask;
    while (sv[i] != NULL) {
        i = (i + 1) & mask;
    }
    sk[i] = q->id;
    sv[i] = q;
}

static int smap_reserve(Sched *s, int64_t count) { /* room for `count` entries at load <= 1/2 */
    uint64_t cap = s->smask + 1;
    if ((uint64_t)count * 2 <= cap) {
        return 0;
    }
    uint64_t ncap = cap;
    while ((uint64_t)count * 2 > ncap) {
        ncap *= 2;
    }
    int64_t *nk = PyMem_Calloc(ncap, sizeof(int64_t));
    seq_t **nv = PyMem_Calloc(ncap, sizeof(seq_t *));
    if (nk == NULL || nv == NULL) {
        PyMem_Free(nk);
        PyMem_Free(nv);
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < cap; i++) {
        if (s->sv[i] != NULL) {
            smap_insert_raw(nk, nv, ncap - 1, s->sv[i]);
        }
    }
    PyMem_Free(s->sk);
    PyMem_Free(s->sv);
    s->sk = nk;
    s->sv = nv;
    s->smask = ncap - 1;
    return 0;
}

static void smap_del(Sched *s, int64_t id) {
    uint64_t i = core_mix64((uint64_t)id) & s->smask;
    while (s->sv[i] != NULL && s->sk[i] != id) {
        i = (i + 1) & s->smask;
    }
    if (s->sv[i] == NULL) {
        return;
    }
    s->scount--;
    for (;;) {
        s->sv[i] = NULL;
        uint64_t j = i;
        for (;;) {
            j = (j + 1) & s->smask;
            if (s->sv[j] == NULL) {
                return;
            }
            uint64_t k = core_mix64((uint64_t)s->sk[j]) & s->smask;
            if ((j > i) ? (k <= i || k > j) : (k <= i && k > j)) {
                s->sk[i] = s->sk[j];
                s->sv[i] = s->sv[j];
                i = j;
                break;
            }
        }
    }
}

/* ---- sequences -------------------------------------------------------------------------- */

static void seq_dealloc(seq_t *q) {
    PyMem_Free(q->tokens);
    PyMem_Free(q->table);
    PyMem_Free(q->hashes);
    PyMem_Free(q);
}

static void waiting_remove(Sched *s, seq_t *q) {
    if (q->prev) {
        q->prev->next = q->next;
    } else {
        s->whead = q->next;
    }
    if (q->next) {
        q->next->prev = q->prev;
    } else {
        s->wtail = q->prev;
    }
    q->prev = q->next = NULL;
    s->nwaiting--;
}

static void waiting_push_back(Sched *s, seq_t *q) {
    q->next = NULL;
    q->prev = s->wtail;
    if (s->wtail) {
        s->wtail->next = q;
    } else {
        s->whead = q;
    }
    s->wtail = q;
    s->nwaiting++;
}

static void waiting_push_front(Sched *s, seq_t *q) {
    q->prev = NULL;
    q->next = s->whead;
    if (s->whead) {
        s->whead->prev = q;
    } else {
        s->wtail = q;
    }
    s->whead = q;
    s->nwaiting++;
}

static void running_remove(Sched *s, seq_t *q) {
    for (int64_t i = 0; i < s->nrunning; i++) {
        if (s->running[i] == q) {
            memmove(&s->running[i], &s->running[i + 1], (size_t)(s->nrunning - i - 1) * sizeof(seq_t *));
            s->nrunning--;
            q->running = 0;
            return;
        }
    }
}

static void running_insert(Sched *s, seq_t *q) { /* bisect.insort by arrival */
    int64_t i = s->nrunning;
    while (i > 0 && s->running[i - 1]->arrival > q->arrival) {
        i--;
    }
    memmove(&s->running[i + 1], &s->running[i], (size_t)(s->nrunning - i) * sizeof(seq_t *));
    s->running[i] = q;
    s->nrunning++;
    q->running = 1;
}

static int seq_free_blocks(Sched *s, seq_t *q) {
    for (int64_t i = q->ntable - 1; i >= 0; i--) {
        if (bp_release(s, q->table[i]) < 0) {
            return -1;
        }
    }
    q->ntable = 0;
    return 0;
}
/* ---- argument helpers ------------------------------------------------------------------- */

/* A sequence id in [0, 2**63): TypeError / ValueError like the twin's _seq_id. */
static int parse_seq_id(PyObject *obj, int64_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        PyErr_Format(PyExc_TypeError, "sequence id: expected an integer, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(idx);
        return -1;
    }
    if (overflow || v < 0) {
        PyErr_Format(PyExc_ValueError, "sequence id %S outside [0, 2**63)", idx);
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *out = (int64_t)v;
    return 0;
}

/* A token id in [0, 2**63): TypeError / ValueError "<what>: ..." like the twin's _token. */
static int parse_token(PyObject *obj, int64_t *out, const char *what_fmt, int64_t what_id) {
    PyObject *idx = PyNumber_Index(obj);
    long long v = 0;
    int overflow = 0;
    if (idx != NULL) {
        v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(idx);
            return -1;
        }
        if (!overflow && v >= 0) {
            Py_DECREF(idx);
            *out = (int64_t)v;
            return 0;
        }
    }
    PyErr_Clear();
    PyObject *what = PyUnicode_FromFormat(what_fmt, (long long)what_id);
    if (what != NULL) {
        if (idx == NULL) {
            PyErr_Format(PyExc_TypeError, "%U: expected an integer token id, got %.100s", what,
                         Py_TYPE(obj)->tp_name);
        } else {
            PyErr_Format(PyExc_ValueError, "%U: token id %S outside [0, 2**63)", what, idx);
        }
        Py_DECREF(what);
    }
    Py_XDECREF(idx);
    return -1;
}

/* The twin's _is_int + dict lookup: an int (not bool) naming a live sequence, or NULL. */
static seq_t *find_seq(Sched *s, PyObject *obj) {
    int64_t id;
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        return NULL;
    }
    if (parse_seq_id(obj, &id) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return smap_get(s, id);
}

static int check_ready(Sched *s) {
    if (!s->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Scheduler is not initialized");
        return -1;
    }
    return 0;
}

static seq_t *get_seq(Sched *s, PyObject *obj) { /* ValueError "unknown sequence id" like the twin */
    seq_t *q = find_seq(s, obj);
    if (q == NULL) {
        PyErr_Format(PyExc_ValueError, "unknown sequence id %R", obj);
    }
    return q;
}

/* ---- type lifecycle --------------------------------------------------------------------- */

static void release_last(Sched *s) {
    for (int64_t i = 0; i < s->nlast; i++) {
        Py_CLEAR(s->last[i]);
    }
    s->nlast = 0;
}

static void S_clear_state(Sched *s) {
    if (s->last != NULL) {
        release_last(s);
    }
    if (s->sv != NULL) {
        for (uint64_t i = 0; i <= s->smask; i++) {
            if (s->sv[i] != NULL) {
                seq_dealloc(s->sv[i]);
            }
        }
    }
    bp_free(s);
    pc_free(s);
    void *arrays[] = {s->sk, s->sv, s->running, s->snap, s->e_sid, s->e_start, s->e_n, s->e_logits, s->c_src,
                      s->c_dst, s->hits, s->last};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) {
        PyMem_Free(arrays[i]);
    }
    for (int i = 0; i < s->nbuf; i++) {
        PyBuffer_Release(&s->buf[i]);
    }
    s->nbuf = 0;
    Py_CLEAR(s->entry_type);
    Py_CLEAR(s->batch_type);
    Py_CLEAR(s->stats_type);
    s->ready = 0;
}

static void S_dealloc(Sched *s) {
    S_clear_state(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int parse_limit(PyObject *obj, const char *name, int64_t *out) {
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || v < 1 || v > 0x7FFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "%s must be a positive integer below 2**31, got %R", name, obj);
        return -1;
    }
    *out = v;
    return 0;
}

static int S_init(Sched *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                             "max_model_len", "enable_prefix_caching", "enable_copy_on_write", "seed", "entry_type",
                             "batch_type", "stats_type", "buffers", NULL};
    PyObject *lim[5], *caching, *cow, *seed, *entry_type, *batch_type, *stats_type, *buffers;
    if (s->ready || s->ref != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Scheduler.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOOO:Scheduler", kwlist, &lim[0], &lim[1], &lim[2],
                                     &lim[3], &lim[4], &caching, &cow, &seed, &entry_type, &batch_type, &stats_type,
                                     &buffers)) {
        return -1;
    }
    int64_t v[5];
    for (int i = 0; i < 5; i++) {
        if (parse_limit(lim[i], kwlist[i], &v[i]) < 0) {
            return -1;
        }
    }
    s->bs = v[0];
    s->nb = v[1];
    s->max_seqs = v[2];
    s->max_tokens = v[3];
    s->max_len = v[4];
    s->max_blocks_seq = blocks_needed(s, s->max_len);
    if (!PyBool_Check(caching)) {
        PyErr_SetString(PyExc_TypeError, "enable_prefix_caching: expected a bool");
        return -1;
    }
    s->caching = caching == Py_True;
    if (!PyBool_Check(cow)) {
        PyErr_SetString(PyExc_TypeError, "enable_copy_on_write: expected a bool");
        return -1;
    }
    s->cow = cow == Py_True;
    if (!PyLong_Check(seed)) {
        PyErr_SetString(PyExc_TypeError, "seed: expected an int");
        return -1;
    }
    unsigned long long sd = PyLong_AsUnsignedLongLong(seed);
    if (sd == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "seed must be in [0, 2**64), got %R", seed);
        return -1;
    }
    if (!PyType_Check(entry_type) || !PyType_IsSubtype((PyTypeObject *)entry_type, &PyTuple_Type) ||
        ((PyTypeObject *)entry_type)->tp_basicsize != PyTuple_Type.tp_basicsize ||
        ((PyTypeObject *)entry_type)->tp_itemsize != PyTuple_Type.tp_itemsize) {
        PyErr_SetString(PyExc_TypeError, "entry_type: expected a tuple subclass without extra fields (BatchEntry)");
        return -1;
    }
    if (!PyCallable_Check(batch_type) || !PyCallable_Check(stats_type)) {
        PyErr_SetString(PyExc_TypeError, "batch_type and stats_type must be callable");
        return -1;
    }
    s->entry_type = Py_NewRef(entry_type);
    s->batch_type = Py_NewRef(batch_type);
    s->stats_type = Py_NewRef(stats_type);

    /* pack buffers */
    PyObject *bufs = PySequence_Fast(buffers, "buffers: expected a sequence of 7 buffers");
    if (bufs == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(bufs) != 7) {
        PyErr_Format(PyExc_ValueError, "buffers: expected 7 buffers, got %zd", PySequence_Fast_GET_SIZE(bufs));
        Py_DECREF(bufs);
        return -1;
    }
    const Py_ssize_t sizes[7] = {(Py_ssize_t)s->max_tokens, (Py_ssize_t)s->max_tokens, (Py_ssize_t)s->max_tokens,
                                 (Py_ssize_t)s->max_seqs + 1, (Py_ssize_t)s->max_seqs,
                                 (Py_ssize_t)(s->max_seqs * s->max_blocks_seq), (Py_ssize_t)s->max_seqs};
    const Py_ssize_t items[7] = {8, 8, 8, 4, 4, 4, 8};
    for (int i = 0; i < 7; i++) {
        Py_buffer *b = &s->buf[i];
        if (core_get_buffer(PySequence_Fast_GET_ITEM(bufs, i), b, PyBUF_WRITABLE, "buffers: ", BUF_NAMES[i]) < 0) {
            Py_DECREF(bufs);
            return -1;
        }
        s->nbuf = i + 1;
        if (b->ndim != 1 || core_format_kind(b->format) != 'i' || b->itemsize != items[i] ||
            !PyBuffer_IsContiguous(b, 'C') || b->shape[0] < sizes[i]) {
            PyErr_Format(PyExc_ValueError, "buffers: %s must be a writable C-contiguous 1-D int%d buffer of "
                         ">= %zd elements", BUF_NAMES[i], (int)(items[i] * 8), sizes[i]);
            Py_DECREF(bufs);
            return -1;
        }
    }
    Py_DECREF(bufs);
    /* pool, prefix cache and tables */
    if (bp_init(s) < 0 || pc_init(s, (uint64_t)sd) < 0) {
        return -1;
    }
    s->smask = 15;
    s->sk = PyMem_Calloc(16, sizeof(int64_t));
    s->sv = PyMem_Calloc(16, sizeof(seq_t *));
    s->running = PyMem_Calloc((size_t)s->max_seqs, sizeof(seq_t *));
    s->snap = PyMem_Calloc((size_t)s->max_seqs, sizeof(seq_t *));
    s->e_sid = PyMem_Calloc((size_t)s->max_seqs, sizeof(int64_t));
    s->e_start = PyMem_Calloc((size_t)s->max_seqs, sizeof(int64_t));
    s->e_n = PyMem_Calloc((size_t)s->max_seqs, sizeof(int64_t));
    s->e_logits = PyMem_Calloc((size_t)s->max_seqs, 1);
    s->c_src = PyMem_Calloc((size_t)s->max_seqs, sizeof(int32_t));
    s->c_dst = PyMem_Calloc((size_t)s->max_seqs, sizeof(int32_t));
    s->hits = PyMem_Calloc((size_t)(s->max_blocks_seq + 1), sizeof(int32_t));
    s->last = PyMem_Calloc((size_t)s->max_seqs, sizeof(PyObject *));
    if (!s->sk || !s->sv || !s->running || !s->snap || !s->e_sid || !s->e_start || !s->e_n || !s->e_logits ||
        !s->c_src || !s->c_dst || !s->hits || !s->last) {
        PyErr_NoMemory();
        return -1;
    }
    s->ready = 1;
    return 0;
}

/* ---- lifecycle -------------------------------------------------------------------------- */

static PyObject *S_add(Sched *s, PyObject *args) {
    PyObject *sid_obj, *prompt, *root_obj = NULL;
    unsigned long long root = 0;
    if (check_ready(s) < 0 || !PyArg_ParseTuple(args, "OO|O:add", &sid_obj, &prompt, &root_obj)) {
        return NULL;
    }
    int64_t id;
    if (parse_seq_id(sid_obj, &id) < 0) {
        return NULL;
    }
    if (root_obj != NULL) {
        root = PyLong_Check(root_obj) && !PyBool_Check(root_obj) ? PyLong_AsUnsignedLongLong(root_obj) : (unsigned long long)-1;
        if ((root == (unsigned long long)-1 && PyErr_Occurred()) || !PyLong_Check(root_obj) || PyBool_Check(root_obj)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "sequence %lld: root must be an integer in [0, 2**64)", (long long)id);
            return NULL;
        }
    }
    if (smap_get(s, id) != NULL) {
        PyErr_Format(PyExc_ValueError, "sequence id %lld is already in the scheduler", (long long)id);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(prompt, "prompt_ids: expected a sequence of token ids");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    seq_t *q = PyMem_Calloc(1, sizeof(seq_t));
    if (q == NULL || core_grow((void **)&q->tokens, &q->captok, n + 1, sizeof(int64_t)) < 0) {
        if (q == NULL) {
            PyErr_NoMemory();
        } else {
            seq_dealloc(q);
        }
        Py_DECREF(fast);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_token(items[i], &q->tokens[i], "sequence %lld: prompt", id) < 0) {
            seq_dealloc(q);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    q->ntok = q->nprompt = n;
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "sequence %lld: empty prompt", (long long)id);
        seq_dealloc(q);
        return NULL;
    }
    if (n > s->max_len) {
        PyErr_Format(PyExc_ValueError, "sequence %lld: prompt of %zd tokens exceeds max_model_len=%lld",
                     (long long)id, n, (long long)s->max_len);
        seq_dealloc(q);
        return NULL;
    }
    int64_t need = blocks_needed(s, n);
    if (need > s->nb) {
        PyErr_Format(PyExc_ValueError, "sequence %lld: prompt of %zd tokens needs %lld KV blocks of %lld tokens; "
                     "the pool has only %lld", (long long)id, n, (long long)need, (long long)s->bs,
                     (long long)s->nb);
        seq_dealloc(q);
        return NULL;
    }
    if (smap_reserve(s, s->scount + 1) < 0) {
        seq_dealloc(q);
        return NULL;
    }
    q->id = id;
    q->root = (uint64_t)root;
    q->arrival = s->arrivals++;
    q->ncached = -1;
    smap_insert_raw(s->sk, s->sv, s->smask, q);
    s->scount++;
    waiting_push_back(s, q);
    Py_RETURN_NONE;
}

static int drop(Sched *s, seq_t *q) {
    if (q->running) {
        running_remove(s, q);
    } else {
        waiting_remove(s, q);
    }
    int rc = seq_free_blocks(s, q);
    smap_del(s, q->id);
    seq_dealloc(q);
    return rc;
}

static PyObject *S_abort(Sched *s, PyObject *arg) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    seq_t *q = find_seq(s, arg);
    if (q != NULL && drop(s, q) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *S_finish(Sched *s, PyObject *arg) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    seq_t *q = get_seq(s, arg);
    if (q == NULL || drop(s, q) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- one step --------------------------------------------------------------------------- */

static void too_long(Sched *s, seq_t *q) {
    PyErr_Format(PyExc_RuntimeError, "sequence %lld has %lld tokens and needs %lld KV blocks of %lld tokens to "
                 "continue; the whole pool has %lld", (long long)q->id, (long long)q->ntok,
                 (long long)blocks_needed(s, q->ntok), (long long)s->bs, (long long)s->nb);
}

static seq_t *newest_unscheduled(Sched *s) {
    for (int64_t i = s->nrunning - 1; i >= 0; i--) {
        if (s->running[i]->stamp != s->stamp) {
            return s->running[i];
        }
    }
    PyErr_SetString(PyExc_RuntimeError, "no running sequence left to preempt");
    return NULL;
}

static int preempt(Sched *s, seq_t *q) {
    running_remove(s, q);
    if (seq_free_blocks(s, q) < 0) {
        return -1;
    }
    q->ncomputed = 0;
    q->nregistered = 0;
    q->decoding = 0;
    q->ndraft = 0;
    waiting_push_front(s, q);
    s->preemptions++;
    return 0;
}

static void record_entry(Sched *s, seq_t *q, int64_t n) {
    int64_t k = s->ne++;
    s->e_sid[k] = q->id;
    s->e_start[k] = q->ncomputed;
    s->e_n[k] = n;
    s->e_logits[k] = q->ncomputed + n == q->ntok + q->ndraft;
    q->stamp = s->stamp;
}

static int64_t fit_chunk(Sched *s, seq_t *q, int64_t n) {
    int64_t capacity = (q->ntable + num_free(s)) * s->bs - q->ncomputed;
    int64_t r = n < capacity ? n : capacity;
    return r > 0 ? r : 0;
}

/* Append `need` fresh blocks to q's table (capacity reserved first: no partial effect). */
static int seq_allocate(Sched *s, seq_t *q, int64_t need) {
    if (need <= 0) {
        return 0;
    }
    if (core_grow((void **)&q->table, &q->captable, q->ntable + need, sizeof(int32_t)) < 0) {
        return -1;
    }
    for (int64_t i = 0; i < need; i++) {
        q->table[q->ntable++] = bp_alloc(s);
    }
    return 0;
}

static PyObject *build_batch(Sched *s) {
    PyObject *entries = PyList_New((Py_ssize_t)s->ne);
    PyObject *copies = PyList_New((Py_ssize_t)s->nc);
    PyObject *result = NULL;
    if (entries == NULL || copies == NULL) {
        goto done;
    }
    PyTypeObject *et = (PyTypeObject *)s->entry_type;
    for (int64_t i = 0; i < s->ne; i++) {
        PyObject *e = et->tp_alloc(et, 4);
        if (e == NULL) {
            goto done;
        }
        PyList_SET_ITEM(entries, i, e);
        PyObject *f0 = PyLong_FromLongLong(s->e_sid[i]);
        PyObject *f1 = PyLong_FromLongLong(s->e_start[i]);
        PyObject *f2 = PyLong_FromLongLong(s->e_n[i]);
        PyTuple_SET_ITEM(e, 0, f0);
        PyTuple_SET_ITEM(e, 1, f1);
        PyTuple_SET_ITEM(e, 2, f2);
        PyTuple_SET_ITEM(e, 3, Py_NewRef(s->e_logits[i] ? Py_True : Py_False));
        if (f0 == NULL || f1 == NULL || f2 == NULL) {
            goto done;
        }
    }
    for (int64_t i = 0; i < s->nc; i++) {
        PyObject *pair = Py_BuildValue("(ii)", (int)s->c_src[i], (int)s->c_dst[i]);
        if (pair == NULL) {
            goto done;
        }
        PyList_SET_ITEM(copies, i, pair);
    }
    result = PyObject_CallFunctionObjArgs(s->batch_type, entries, copies, NULL);
    if (result != NULL) {
        for (int64_t i = 0; i < s->ne; i++) {
            s->last[i] = Py_NewRef(PyList_GET_ITEM(entries, i));
        }
        s->nlast = s->ne;
    }
done:
    Py_XDECREF(entries);
    Py_XDECREF(copies);
    return result;
}

/* schedule()'s drafts, checked whole (the twin's _check_drafts): 0, or -1 with the error set. */
static int check_drafts(PyObject *drafts) {
    if (drafts == Py_None) {
        return 0;
    }
    if (!PyDict_Check(drafts)) {
        PyErr_Format(PyExc_TypeError, "drafts: expected None or a dict of sequence id -> token ids, got %.100s",
                     Py_TYPE(drafts)->tp_name);
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(drafts, &pos, &key, &value)) {
        int64_t sid, tok;
        if (parse_seq_id(key, &sid) < 0) {
            return -1;
        }
        if (!PyList_Check(value) && !PyTuple_Check(value)) {
            PyErr_Format(PyExc_TypeError, "drafts[%lld]: expected a list of token ids, got %.100s", (long long)sid,
                         Py_TYPE(value)->tp_name);
            return -1;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
        PyObject **items = PySequence_Fast_ITEMS(value);
        for (Py_ssize_t j = 0; j < n; j++) {
            if (parse_token(items[j], &tok, "sequence %lld: draft token", sid) < 0) {
                return -1;
            }
        }
    }
    return 0;
}

/* The proposals of q in drafts (a checked dict; borrowed list/tuple), or NULL (none, or an error set). */
static PyObject *draft_of(PyObject *drafts, seq_t *q) {
    if (drafts == Py_None || PyDict_GET_SIZE(drafts) == 0) {
        return NULL;
    }
    PyObject *key = PyLong_FromLongLong(q->id);
    if (key == NULL) {
        return NULL;
    }
    PyObject *value = PyDict_GetItemWithError(drafts, key);
    Py_DECREF(key);
    return value;
}

/* How many proposals q (its next token's block allocated) may verify now: the twin's _draft_room. */
static int64_t draft_room(Sched *s, seq_t *q, int64_t spare, int64_t reserve) {
    int64_t blocks = num_free(s) - reserve;
    blocks = blocks > 0 ? blocks : 0;
    int64_t r = (q->ntable + blocks) * s->bs - q->ncomputed - 1;
    r = spare < r ? spare : r;
    int64_t by_len = s->max_len - q->ntok - 1;
    r = by_len < r ? by_len : r;
    return r > 0 ? r : 0;
}

static PyObject *S_schedule(Sched *s, PyObject *args) {
    PyObject *drafts = Py_None;
    if (check_ready(s) < 0 || !PyArg_ParseTuple(args, "|O:schedule", &drafts) || check_drafts(drafts) < 0) {
        return NULL;
    }
    int64_t budget = s->max_tokens;
    int preempted = 0;
    release_last(s); /* e_* are rewritten below */
    s->ne = s->nc = 0;
    s->stamp++;
    int64_t decoders_left = 0;
    for (int64_t i = 0; i < s->nrunning; i++) {
        s->running[i]->ndraft = 0;
        decoders_left += s->running[i]->decoding != 0;
    }

    /* 1. decode: one token per decoding sequence (plus its draft), in order of arrival. */
    int64_t nsnap = s->nrunning;
    memcpy(s->snap, s->running, (size_t)nsnap * sizeof(seq_t *));
    for (int64_t i = 0; i < nsnap; i++) {
        if (budget == 0) {
            break;
        }
        seq_t *q = s->snap[i];
        if (!q->running || !q->decoding) {
            continue;
        }
        decoders_left--;
        int64_t need = blocks_needed(s, q->ncomputed + 1) - q->ntable;
        while (need > num_free(s)) {
            seq_t *victim = newest_unscheduled(s);
            if (victim == NULL) {
                return NULL;
            }
            if (victim == q && s->nrunning == 1) {
                too_long(s, q);
                return NULL;
            }
            if (preempt(s, victim) < 0) {
                return NULL;
            }
            preempted = 1;
            if (victim == q) {
                break;
            }
        }
        if (!q->running) {
            continue;
        }
        if (seq_allocate(s, q, need) < 0) {
            return NULL;
        }
        PyObject *proposal = draft_of(drafts, q);
        if (proposal == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if (proposal != NULL && PySequence_Fast_GET_SIZE(proposal) > 0) {
            int64_t d = draft_room(s, q, budget - 1 - decoders_left, decoders_left);
            int64_t have = (int64_t)PySequence_Fast_GET_SIZE(proposal);
            d = have < d ? have : d;
            if (core_grow((void **)&q->tokens, &q->captok, q->ntok + d + 1, sizeof(int64_t)) < 0) {
                return NULL;
            }
            PyObject **items = PySequence_Fast_ITEMS(proposal);
            for (int64_t j = 0; j < d; j++) {
                if (parse_token(items[j], &q->tokens[q->ntok + j], "sequence %lld: draft token", q->id) < 0) {
                    return NULL; /* unreachable: checked above */
                }
            }
            q->ndraft = d;
            if (seq_allocate(s, q, blocks_needed(s, q->ncomputed + 1 + d) - q->ntable) < 0) {
                return NULL;
            }
        }
        record_entry(s, q, 1 + q->ndraft);
        budget -= 1 + q->ndraft;
    }

    /* 2. running sequences in the middle of their prefill (or recompute) continue. */
    nsnap = s->nrunning;
    memcpy(s->snap, s->running, (size_t)nsnap * sizeof(seq_t *));
    for (int64_t i = 0; i < nsnap; i++) {
        if (budget == 0) {
            break;
        }
        seq_t *q = s->snap[i];
        if (!q->running || q->decoding || q->stamp == s->stamp) {
            continue;
        }
        int64_t todo = q->ntok - q->ncomputed;
        int64_t n = fit_chunk(s, q, todo < budget ? todo : budget);
        while (n == 0) {
            seq_t *victim = newest_unscheduled(s);
            if (victim == NULL) {
                return NULL;
            }
            if (victim == q) {
                if (s->nrunning == 1) {
                    too_long(s, q);
                    return NULL;
                }
                break;
            }
            if (preempt(s, victim) < 0) {
                return NULL;
            }
            preempted = 1;
            n = fit_chunk(s, q, todo < budget ? todo : budget);
        }
        if (n == 0) {
            continue;
        }
        if (seq_allocate(s, q, blocks_needed(s, q->ncomputed + n) - q->ntable) < 0) {
            return NULL;
        }
        record_entry(s, q, n);
        budget -= n;
    }

    /* 3. admit waiting requests, FCFS, each after its longest cached prefix. */
    while (!preempted && budget > 0 && s->whead != NULL && s->nrunning < s->max_seqs) {
        seq_t *q = s->whead;
        int32_t cow;
        int64_t cached;
        int64_t nh = pc_lookup(s, q, &cow, &cached);
        if (nh < 0) {
            return NULL;
        }
        int64_t n = q->ntok - cached < budget ? q->ntok - cached : budget;
        int64_t need = blocks_needed(s, cached + n) - nh;
        int64_t reclaimed = 0;
        for (int64_t i = 0; i < nh; i++) {
            reclaimed += s->ref[s->hits[i]] == 0;
        }
        if (need > num_free(s) - reclaimed) {
            if (s->nrunning == 0) {
                too_long(s, q);
                return NULL;
            }
            break;
        }
        if (core_grow((void **)&q->table, &q->captable, nh + need, sizeof(int32_t)) < 0) {
            return NULL;
        }
        waiting_remove(s, q);
        running_insert(s, q);
        for (int64_t i = 0; i < nh; i++) {
            bp_claim(s, s->hits[i]);
            q->table[i] = s->hits[i];
        }
        q->ntable = nh;
        if (cow >= 0) {
            bp_touch(s, cow);
        }
        for (int64_t i = 0; i < need; i++) {
            q->table[q->ntable++] = bp_alloc(s);
        }
        if (cow >= 0 && q->table[nh] != cow) {
            s->c_src[s->nc] = cow;
            s->c_dst[s->nc] = q->table[nh];
            s->nc++;
        }
        q->ncomputed = cached;
        q->nregistered = nh;
        if (s->caching) {
            s->stats[0] += 1;
            s->stats[1] += q->ntok;
            s->stats[2] += cached;
        }
        if (q->ncached < 0) {
            q->ncached = cached < q->nprompt ? cached : q->nprompt;
        }
        record_entry(s, q, n);
        budget -= n;
    }

    if (s->ne == 0) {
        Py_RETURN_NONE;
    }
    return build_batch(s);
}

/* ---- batch checks shared by _pack and update ---------------------------------------------- */

typedef struct {
    seq_t *q;
    int64_t n;
    int logits;
} checked_t;

static PyObject *FIELD_KEYS[5]; /* interned on first use: seq_id, start, num_tokens, needs_logits, entries */
static const char *FIELD_NAMES[5] = {"seq_id", "start", "num_tokens", "needs_logits", "entries"};

static PyObject *field_key(int i) {
    if (FIELD_KEYS[i] == NULL) {
        FIELD_KEYS[i] = PyUnicode_InternFromString(FIELD_NAMES[i]);
    }
    return FIELD_KEYS[i];
}

static PyObject *entry_field(PyObject *e, int is_entry, int i) {
    if (is_entry) {
        return Py_NewRef(PyTuple_GET_ITEM(e, i));
    }
    PyObject *key = field_key(i);
    return key ? PyObject_GetAttr(e, key) : NULL;
}

/* Validate batch.entries against the sequences (the twin's _check_entries). On success
 * *out is a PyMem array of *count checked entries (caller frees). */
static int check_entries(Sched *s, PyObject *batch, int skip_unknown, checked_t **out, Py_ssize_t *count) {
    *out = NULL;
    *count = 0;
    PyObject *entries_obj = field_key(4) ? PyObject_GetAttr(batch, field_key(4)) : NULL;
    if (entries_obj == NULL) {
        return -1;
    }
    PyObject *entries = PySequence_Fast(entries_obj, "batch.entries: expected a sequence of BatchEntry");
    Py_DECREF(entries_obj);
    if (entries == NULL) {
        return -1;
    }
    Py_ssize_t ne = PySequence_Fast_GET_SIZE(entries);
    checked_t *c = PyMem_Malloc((size_t)(ne > 0 ? ne : 1) * sizeof(checked_t));
    if (c == NULL) {
        Py_DECREF(entries);
        PyErr_NoMemory();
        return -1;
    }
    s->stamp++;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < ne; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(entries, i);
        if (i < s->nlast && e == s->last[i]) { /* made by the last schedule(): its fields are in e_* */
            const int64_t sid = s->e_sid[i], start = s->e_start[i], n = s->e_n[i];
            const int logits = s->e_logits[i];
            seq_t *q = smap_get(s, sid);
            if (q == NULL) {
                if (skip_unknown) {
                    continue;
                }
                PyErr_Format(PyExc_ValueError, "unknown sequence id %lld", (long long)sid);
                goto fail;
            }
            if (q->stamp == s->stamp) {
                PyErr_Format(PyExc_ValueError, "sequence %lld appears twice in the batch", (long long)sid);
                goto fail;
            }
            q->stamp = s->stamp;
            const int64_t known = q->ntok + q->ndraft;
            if (start != q->ncomputed || n > known - start || logits != (start + n == known)) {
                PyErr_Format(PyExc_ValueError, "stale batch entry for sequence %lld: start=%lld, num_tokens=%lld, "
                             "computed=%lld, known=%lld", (long long)sid, (long long)start, (long long)n,
                             (long long)q->ncomputed, (long long)known);
                goto fail;
            }
            if (blocks_needed(s, start + n) > q->ntable) {
                PyErr_Format(PyExc_ValueError, "sequence %lld holds %lld blocks; the entry needs %lld", (long long)sid,
                             (long long)q->ntable, (long long)blocks_needed(s, start + n));
                goto fail;
            }
            c[k].q = q;
            c[k].n = n;
            c[k].logits = logits;
            k++;
            continue;
        }
        int is_entry = Py_IS_TYPE(e, (PyTypeObject *)s->entry_type) && PyTuple_GET_SIZE(e) == 4;
        PyObject *f_sid = NULL, *f_start = NULL, *f_n = NULL, *f_logits = NULL, *i_start = NULL, *i_n = NULL;
        int ok = 0;
        int64_t sid;
        f_sid = entry_field(e, is_entry, 0);
        if (f_sid == NULL || parse_seq_id(f_sid, &sid) < 0) {
            goto entry_done;
        }
        seq_t *q = smap_get(s, sid);
        if (q == NULL) {
            if (skip_unknown) {
                ok = 2;
                goto entry_done;
            }
            PyErr_Format(PyExc_ValueError, "unknown sequence id %lld", (long long)sid);
            goto entry_done;
        }
        if (q->stamp == s->stamp) {
            PyErr_Format(PyExc_ValueError, "sequence %lld appears twice in the batch", (long long)sid);
            goto entry_done;
        }
        q->stamp = s->stamp;
        if ((f_start = entry_field(e, is_entry, 1)) == NULL ||
            (f_n = entry_field(e, is_entry, 2)) == NULL ||
            (i_start = PyNumber_Index(f_start)) == NULL || (i_n = PyNumber_Index(f_n)) == NULL) {
            goto entry_done;
        }
        int ov1 = 0, ov2 = 0;
        long long start = PyLong_AsLongLongAndOverflow(i_start, &ov1);
        long long n = PyLong_AsLongLongAndOverflow(i_n, &ov2);
        if (PyErr_Occurred()) {
            goto entry_done;
        }
        if ((f_logits = entry_field(e, is_entry, 3)) == NULL) {
            goto entry_done;
        }
        int logits = PyObject_IsTrue(f_logits);
        if (logits < 0) {
            goto entry_done;
        }
        const int64_t known = q->ntok + q->ndraft;
        if (ov1 || ov2 || start != q->ncomputed || n < 1 || n > known - start || logits != (start + n == known)) {
            PyErr_Format(PyExc_ValueError, "stale batch entry for sequence %lld: start=%S, num_tokens=%S, "
                         "computed=%lld, known=%lld", (long long)sid, i_start, i_n, (long long)q->ncomputed,
                         (long long)known);
            goto entry_done;
        }
        if (blocks_needed(s, start + n) > q->ntable) {
            PyErr_Format(PyExc_ValueError, "sequence %lld holds %lld blocks; the entry needs %lld", (long long)sid,
                         (long long)q->ntable, (long long)blocks_needed(s, start + n));
            goto entry_done;
        }
        c[k].q = q;
        c[k].n = n;
        c[k].logits = logits;
        k++;
        ok = 1;
    entry_done:
        Py_XDECREF(f_sid);
        Py_XDECREF(f_start);
        Py_XDECREF(f_n);
        Py_XDECREF(f_logits);
        Py_XDECREF(i_start);
        Py_XDECREF(i_n);
        if (!ok) {
            goto fail;
        }
    }
    Py_DECREF(entries);
    *out = c;
    *count = k;
    return 0;
fail:
    PyMem_Free(c);
    Py_DECREF(entries);
    return -1;
}

static PyObject *S_pack(Sched *s, PyObject *batch) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    checked_t *c;
    Py_ssize_t b;
    if (check_entries(s, batch, 0, &c, &b) < 0) {
        return NULL;
    }
    int64_t t = 0, mb = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        t += c[i].n;
        int64_t nb = blocks_needed(s, c[i].q->ncomputed + c[i].n);
        mb = nb > mb ? nb : mb;
    }
    if (t > s->max_tokens || b > s->max_seqs) {
        PyErr_Format(PyExc_ValueError, "batch of %zd sequences and %lld tokens exceeds max_num_seqs=%lld or "
                     "max_num_batched_tokens=%lld", b, (long long)t, (long long)s->max_seqs,
                     (long long)s->max_tokens);
        PyMem_Free(c);
        return NULL;
    }
    int64_t *input_ids = s->buf[0].buf, *positions = s->buf[1].buf, *slots = s->buf[2].buf;
    int32_t *cu = s->buf[3].buf, *past = s->buf[4].buf, *bt = s->buf[5].buf;
    int64_t *li = s->buf[6].buf;
    int64_t off = 0, nl = 0;
    const int64_t bs = s->bs;
    cu[0] = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const seq_t *q = c[i].q;
        const int64_t lo = q->ncomputed, n = c[i].n, need = blocks_needed(s, lo + n);
        memcpy(input_ids + off, q->tokens + lo, (size_t)n * sizeof(int64_t));
        for (int64_t j = 0; j < n; j++) {
            const int64_t p = lo + j;
            positions[off + j] = p;
            slots[off + j] = (int64_t)q->table[p / bs] * bs + p % bs;
        }
        int32_t *row = bt + i * mb;
        memcpy(row, q->table, (size_t)need * sizeof(int32_t));
        for (int64_t j = need; j < mb; j++) {
            row[j] = -1;
        }
        past[i] = (int32_t)lo;
        off += n;
        cu[i + 1] = (int32_t)off;
        if (c[i].logits) {
            li[nl++] = off - 1;
        }
    }
    PyMem_Free(c);
    return Py_BuildValue("(LLLL)", (long long)t, (long long)b, (long long)mb, (long long)nl);
}

static PyObject *S_update(Sched *s, PyObject *args) {
    PyObject *batch, *next_tokens;
    if (check_ready(s) < 0 || !PyArg_ParseTuple(args, "OO:update", &batch, &next_tokens)) {
        return NULL;
    }
    checked_t *c;
    Py_ssize_t b;
    if (check_entries(s, batch, 1, &c, &b) < 0) {
        return NULL;
    }
    /* entry i's new tokens: tokens[off[i] .. off[i] + m[i]) (m[i] = 0: a chunk without logits) */
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        total += c[i].q->ndraft + 1;
    }
    int64_t *tokens = PyMem_Malloc((size_t)(total > 0 ? total : 1) * sizeof(int64_t));
    int64_t *off = PyMem_Malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t));
    int64_t *m = PyMem_Malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t));
    if (tokens == NULL || off == NULL || m == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    int64_t used = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        seq_t *q = c[i].q;
        off[i] = used;
        m[i] = 0;
        if (!c[i].logits) {
            continue;
        }
        PyObject *key = PyLong_FromLongLong(q->id);
        PyObject *value = key ? PyObject_GetItem(next_tokens, key) : NULL;
        Py_XDECREF(key);
        if (value == NULL) {
            if (PyErr_ExceptionMatches(PyExc_KeyError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "sequence %lld got logits in this step but no next token",
                             (long long)q->id);
            }
            goto error;
        }
        const int64_t d = q->ndraft;
        if (PyList_Check(value) || PyTuple_Check(value)) {
            PyObject *fast = PySequence_Fast(value, "next tokens"); /* a copy of a list: stable while parsing */
            if (fast == NULL) {
                Py_DECREF(value);
                goto error;
            }
            Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
            PyObject **items = PySequence_Fast_ITEMS(fast);
            for (Py_ssize_t j = 0; j < n; j++) {
                int64_t t;
                if (parse_token(items[j], &t, "sequence %lld: next token", q->id) < 0) {
                    Py_DECREF(fast);
                    Py_DECREF(value);
                    goto error;
                }
                if (j <= d) {
                    tokens[used + j] = t;
                }
            }
            Py_DECREF(fast);
            m[i] = (int64_t)n;
        } else {
            if (parse_token(value, &tokens[used], "sequence %lld: next token", q->id) < 0) {
                Py_DECREF(value);
                goto error;
            }
            m[i] = 1;
        }
        Py_DECREF(value);
        if (m[i] < 1 || m[i] > d + 1) {
            PyErr_Format(PyExc_ValueError, "sequence %lld: %lld next tokens after a draft of %lld; expected 1 to %lld",
                         (long long)q->id, (long long)m[i], (long long)d, (long long)(d + 1));
            goto error;
        }
        for (int64_t j = 0; j + 1 < m[i]; j++) {
            if (tokens[used + j] != q->tokens[q->ntok + j]) {
                PyErr_Format(PyExc_ValueError, "sequence %lld: the accepted tokens must be a prefix of its draft",
                             (long long)q->id);
                goto error;
            }
        }
        if (q->ntok + m[i] > s->max_len) {
            PyErr_Format(PyExc_RuntimeError, "sequence %lld already has max_model_len=%lld tokens; the engine "
                         "must finish it", (long long)q->id, (long long)s->max_len);
            goto error;
        }
        if (core_grow((void **)&q->tokens, &q->captok, q->ntok + m[i] + 1, sizeof(int64_t)) < 0) {
            goto error;
        }
        used += m[i];
    }
    for (Py_ssize_t i = 0; i < b; i++) { /* memo room for the hashes of newly full blocks */
        seq_t *q = c[i].q;
        int64_t full = (q->ncomputed + c[i].n) / s->bs;
        if (s->caching && core_grow((void **)&q->hashes, &q->caphash, full, sizeof(uint64_t)) < 0) {
            goto error;
        }
    }
    for (Py_ssize_t i = 0; i < b; i++) {
        seq_t *q = c[i].q;
        const int64_t d = q->ndraft;
        q->ncomputed += m[i] ? c[i].n - (d + 1 - m[i]) : c[i].n; /* rejected proposals are not computed */
        if (m[i]) {
            memcpy(q->tokens + q->ntok, tokens + off[i], (size_t)m[i] * sizeof(int64_t));
            q->ntok += m[i];
            q->decoding = 1;
        }
        if (d) {
            q->ndraft = 0;
            const int64_t keep = blocks_needed(s, q->ntok);
            for (int64_t j = q->ntable - 1; j >= keep; j--) { /* blocks that held only rejected proposals */
                if (bp_release(s, q->table[j]) < 0) {
                    goto error;
                }
            }
            if (q->ntable > keep) {
                q->ntable = keep;
            }
        }
        if (s->caching && pc_register_full_blocks(s, q) < 0) {
            goto error;
        }
    }
    PyMem_Free(tokens);
    PyMem_Free(off);
    PyMem_Free(m);
    PyMem_Free(c);
    Py_RETURN_NONE;
error:
    PyMem_Free(tokens);
    PyMem_Free(off);
    PyMem_Free(m);
    PyMem_Free(c);
    return NULL;
}

/* ---- introspection ---------------------------------------------------------------------- */

static PyObject *S_has_unfinished(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    return PyBool_FromLong(s->scount > 0);
}

static PyObject *int64_list(const int64_t *v, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, x);
    }
    return list;
}

static PyObject *int32_list(const int32_t *v, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, x);
    }
    return list;
}

static PyObject *S_seq_tokens(Sched *s, PyObject *arg) {
    seq_t *q = check_ready(s) < 0 ? NULL : get_seq(s, arg);
    return q ? int64_list(q->tokens, q->ntok) : NULL;
}

static PyObject *S_seq_num_prompt(Sched *s, PyObject *arg) {
    seq_t *q = check_ready(s) < 0 ? NULL : get_seq(s, arg);
    return q ? PyLong_FromLongLong(q->nprompt) : NULL;
}

static PyObject *S_seq_num_cached(Sched *s, PyObject *arg) {
    seq_t *q = check_ready(s) < 0 ? NULL : get_seq(s, arg);
    return q ? PyLong_FromLongLong(q->ncached < 0 ? 0 : q->ncached) : NULL;
}

static PyObject *S_seq_block_table(Sched *s, PyObject *arg) {
    seq_t *q = check_ready(s) < 0 ? NULL : get_seq(s, arg);
    return q ? int32_list(q->table, q->ntable) : NULL;
}

static PyObject *S_seq_ids(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    PyObject *list = PyList_New(0);
    for (int64_t i = 0; list != NULL && i < s->nrunning; i++) {
        PyObject *x = PyLong_FromLongLong(s->running[i]->id);
        if (x == NULL || PyList_Append(list, x) < 0) {
            Py_XDECREF(x);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(x);
    }
    for (seq_t *q = s->whead; list != NULL && q != NULL; q = q->next) {
        PyObject *x = PyLong_FromLongLong(q->id);
        if (x == NULL || PyList_Append(list, x) < 0) {
            Py_XDECREF(x);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(x);
    }
    return list;
}

static PyObject *S_prefix_cache_stats(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    return PyObject_CallFunction(s->stats_type, "LLL", (long long)s->stats[0], (long long)s->stats[1],
                                 (long long)s->stats[2]);
}

static PyObject *list_of_queue(Sched *s, int w) {
    PyObject *list = PyList_New(0);
    for (int32_t b = s->head[w]; list != NULL && b >= 0; b = s->lnext[b]) {
        PyObject *x = PyLong_FromLong(b);
        if (x == NULL || PyList_Append(list, x) < 0) {
            Py_XDECREF(x);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(x);
    }
    return list;
}

static PyObject *S_block_pool_state(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    PyObject *refs = int32_list(s->ref, s->nb);
    PyObject *free_ = list_of_queue(s, IN_FREE);
    PyObject *cached_free = list_of_queue(s, IN_CACHED);
    PyObject *cached = PyList_New(0);
    PyObject *result = NULL;
    if (refs == NULL || free_ == NULL || cached_free == NULL || cached == NULL) {
        goto done;
    }
    for (int64_t b = 0; b < s->nb; b++) {
        if (!s->bcached[b]) {
            continue;
        }
        PyObject *pair = Py_BuildValue("[lK]", (long)b, (unsigned long long)s->bhash[b]);
        if (pair == NULL || PyList_Append(cached, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    result = Py_BuildValue("{sOsOsOsO}", "ref_counts", refs, "free", free_, "cached_free", cached_free, "cached",
                           cached);
done:
    Py_XDECREF(refs);
    Py_XDECREF(free_);
    Py_XDECREF(cached_free);
    Py_XDECREF(cached);
    return result;
}
static PyObject *S_enable_kv_events(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    return pc_enable_events(s);
}

static PyObject *S_kv_events(Sched *s, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    return pc_take_events(s);
}

static PyObject *get_int(Sched *s, int64_t v) {
    if (check_ready(s) < 0) {
        return NULL;
    }
    return PyLong_FromLongLong(v);
}

static PyObject *S_get_num_waiting(Sched *s, void *c) {
    (void)c;
    return get_int(s, s->nwaiting);
}
static PyObject *S_get_num_running(Sched *s, void *c) {
    (void)c;
    return get_int(s, s->nrunning);
}
static PyObject *S_get_num_free_blocks(Sched *s, void *c) {
    (void)c;
    return get_int(s, num_free(s));
}
static PyObject *S_get_num_preemptions(Sched *s, void *c) {
    (void)c;
    return get_int(s, s->preemptions);
}

static PyMethodDef S_methods[] = {
    {"add", (PyCFunction)S_add, METH_VARARGS, "add(seq_id, prompt_ids, root=0): queue a request (FCFS); root: its first block's parent hash "
     "(a cache salt: only sequences with the same root share prefix-cache blocks)."},
    {"abort", (PyCFunction)S_abort, METH_O, "abort(seq_id): drop a request, free its blocks; unknown ids ignored."},
    {"finish", (PyCFunction)S_finish, METH_O, "finish(seq_id): the engine is done with a sequence."},
    {"schedule", (PyCFunction)S_schedule, METH_VARARGS,
     "schedule(drafts=None) -> ScheduledBatch | None: one step; drafts: seq id -> proposed tokens."},
    {"_pack", (PyCFunction)S_pack, METH_O, "_pack(batch) -> (T, B, max_blocks, num_logits): fill the buffers."},
    {"update", (PyCFunction)S_update, METH_VARARGS, "update(batch, next_tokens): after the forward."},
    {"has_unfinished", (PyCFunction)S_has_unfinished, METH_NOARGS, "has_unfinished() -> bool"},
    {"seq_tokens", (PyCFunction)S_seq_tokens, METH_O, "seq_tokens(seq_id) -> prompt + generated tokens"},
    {"seq_num_prompt", (PyCFunction)S_seq_num_prompt, METH_O, "seq_num_prompt(seq_id) -> int"},
    {"seq_num_cached", (PyCFunction)S_seq_num_cached, METH_O,
     "seq_num_cached(seq_id) -> prompt tokens served from the prefix cache at the first admission"},
    {"seq_block_table", (PyCFunction)S_seq_block_table, METH_O, "seq_block_table(seq_id) -> list of block ids"},
    {"seq_ids", (PyCFunction)S_seq_ids, METH_NOARGS, "seq_ids() -> running (by arrival) then waiting ids"},
    {"prefix_cache_stats", (PyCFunction)S_prefix_cache_stats, METH_NOARGS, "prefix_cache_stats() -> counters"},
    {"block_pool_state", (PyCFunction)S_block_pool_state, METH_NOARGS, "block_pool_state() -> dict (tests)"},
    {"enable_kv_events", (PyCFunction)S_enable_kv_events, METH_NOARGS,
     "enable_kv_events(): log prefix-cache stored/removed events from now on (cache must be empty)."},
    {"kv_events", (PyCFunction)S_kv_events, METH_NOARGS,
     "kv_events() -> bytes: the event records logged since the last call (see the contract)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef S_getset[] = {
    {"num_waiting", (getter)S_get_num_waiting, NULL, "requests waiting", NULL},
    {"num_running", (getter)S_get_num_running, NULL, "sequences running", NULL},
    {"num_free_blocks", (getter)S_get_num_free_blocks, NULL, "allocatable blocks (fresh + cached unused)", NULL},
    {"num_preemptions", (getter)S_get_num_preemptions, NULL, "preemptions so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SchedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "runtime.core._core.Scheduler",
    .tp_basicsize = sizeof(Sched),
    .tp_dealloc = (destructor)S_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The C scheduler (see the contract in _scheduler.c); use runtime.core.Scheduler.",
    .tp_methods = S_methods,
    .tp_getset = S_getset,
    .tp_init = (initproc)S_init,
    .tp_new = PyType_GenericNew,
};

int core_scheduler_register(PyObject *module) {
    if (PyModule_AddFunctions(module, pc_methods) < 0 || PyType_Ready(&SchedType) < 0) {
        return -1;
    }
    Py_INCREF(&SchedType);
    if (PyModule_AddObject(module, "Scheduler", (PyObject *)&SchedType) < 0) {
        Py_DECREF(&SchedType);
        return -1;
    }
    return 0;
}
