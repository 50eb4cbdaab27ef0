/*
 * Internal header of the Scheduler type of runtime.core._core: the state that its three files share.
 * Not a public API.
 *
 *   _block_pool.c    the KV block pool: reference counts, the fresh and cached free queues (LRU),
 *                    allocate / release / claim / touch                                   (bp_*)
 *   _prefix_cache.c  the prefix cache: hash -> block map, chained block hashes, longest-prefix lookup,
 *                    registration of computed full blocks, eviction, the KV-cache event log (pc_*)
 *   _scheduler.c     sequences, waiting / running queues, preemption, schedule / pack / update, and
 *                    the Python type (its contract at the top)
 *
 * Twins: runtime/core/reference/block_pool.py, prefix_cache.py, scheduler.py. Conventions: _core.h.
 */
#ifndef OPTIMIZE_SCHED_H
#define OPTIMIZE_SCHED_H

#include "_core.h"

/* Where a block is: held by sequences, in the fresh free queue, or in the cached free queue (LRU). */
enum { IN_USE = 0, IN_FREE = 1, IN_CACHED = 2 };

/* One request. _scheduler.c owns it; the prefix cache reads its tokens, root and table and memoises
 * its block hashes (hashes, nhash) and registration progress (nregistered). */
typedef struct seq_s {
    int64_t id;
    int64_t arrival;
    int64_t *tokens; /* prompt + generated */
    int64_t ntok, captok;
    int64_t nprompt;
    int64_t ncomputed;
    int32_t *table;
    int64_t ntable, captable;
    uint64_t *hashes; /* chained hashes of its first full blocks (memo) */
    int64_t nhash, caphash;
    int64_t nregistered; /* leading table blocks already offered to the cache */
    uint64_t root;       /* parent hash of its first block: 0, or its cache salt (prefix-cache isolation) */
    int64_t ncached;     /* prompt tokens served by the cache at the first admission; -1 before */
    int64_t ndraft;      /* proposals verified in this step, in tokens[ntok .. ntok + ndraft) */
    int decoding;
    int running;
    uint64_t stamp; /* == the scheduler's stamp: scheduled in this step / seen in this check */
    struct seq_s *prev, *next; /* waiting queue */
} seq_t;

/* The Scheduler object. The block pool's fields are written by _block_pool.c, except the cache fields
 * of a block (bcached, bhash, bparent, btok), which _prefix_cache.c writes along with the map, the
 * key and the event log; the rest belongs to _scheduler.c. */
typedef struct {
    PyObject_HEAD
    int ready;
    int64_t bs, nb, max_seqs, max_tokens, max_len, max_blocks_seq;
    int caching, cow;
    uint64_t key;       /* of the block hash */
    uint64_t hash_mask; /* all ones; fewer bits only under set_hash_bits_for_tests */
    PyObject *entry_type, *batch_type, *stats_type;
    /* block pool */
    int32_t *ref;
    uint8_t *where;   /* IN_USE / IN_FREE / IN_CACHED */
    uint8_t *bcached; /* has a hash, is in the cache map */
    uint64_t *bhash, *bparent;
    int64_t *btok; /* [nb * bs] tokens of cached blocks (NULL without caching) */
    int32_t *lprev, *lnext;
    int32_t head[3], tail[3];
    int64_t count[3];
    /* prefix cache: hash -> block, open addressing, linear probing, empty = -1 */
    uint64_t *ck;
    int32_t *cv;
    uint64_t cmask;
    /* sequences: id -> seq, open addressing, empty = NULL */
    int64_t *sk;
    seq_t **sv;
    uint64_t smask;
    int64_t scount;
    /* queues */
    seq_t **running; /* [max_seqs], sorted by arrival */
    int64_t nrunning;
    seq_t **snap; /* [max_seqs] */
    seq_t *whead, *wtail;
    int64_t nwaiting;
    int64_t arrivals, preemptions;
    int64_t stats[3]; /* requests, queries, hits */
    uint64_t stamp;
    /* one step's output before it becomes Python objects */
    int64_t *e_sid, *e_start, *e_n;
    uint8_t *e_logits;
    int64_t ne;
    int32_t *c_src, *c_dst;
    int64_t nc;
    int32_t *hits; /* [max_blocks_seq] */
    /* KV-cache event log (enable_kv_events): uint64 records, see the contract */
    int events_on, events_lost;
    uint64_t *ev;
    int64_t nev, capev;
    PyObject **last; /* [max_seqs] strong refs to the entries the last schedule() returned (e_* hold their fields) */
    int64_t nlast;
    /* pack buffers */
    Py_buffer buf[7];
    int nbuf;
} Sched;

static inline int64_t blocks_needed(const Sched *s, int64_t ntokens) { return (ntokens + s->bs - 1) / s->bs; }
static inline int64_t num_free(const Sched *s) { return s->count[IN_FREE] + s->count[IN_CACHED]; }

/* ---- block pool (_block_pool.c) --------------------------------------------------------- */

/* Allocate the pool's arrays for s->nb blocks of s->bs tokens (s->caching: room for cached tokens)
 * and queue every block as fresh. */
int bp_init(Sched *s);
/* Free what bp_init allocated (safe on a partly initialised pool). */
void bp_free(Sched *s);
/* One block, ref_count 1: the fresh queue first, then the LRU cached block (evicted from the prefix
 * cache). Caller checked num_free. */
int32_t bp_alloc(Sched *s);
/* Drop one reference; at 0 the block joins the tail of its free queue. RuntimeError when already free. */
int bp_release(Sched *s, int32_t b);
/* Take a reference to a cached block (a prefix-cache hit); a free one leaves its queue. */
void bp_claim(Sched *s, int32_t b);
/* A free cached block becomes the most recently used. */
void bp_touch(Sched *s, int32_t b);

/* ---- prefix cache (_prefix_cache.c) ----------------------------------------------------- */

/* Module functions of the prefix cache: set_hash_bits_for_tests. */
extern PyMethodDef pc_methods[];
/* The hash key from seed, the hash width of set_hash_bits_for_tests, and the empty hash map. */
int pc_init(Sched *s, uint64_t seed);
/* Free the hash map and the event log. */
void pc_free(Sched *s);
/* Forget cached block b (an eviction): out of the map, "removed" logged. */
void pc_uncache(Sched *s, int32_t b);
/* Longest cached prefix of a waiting sequence into s->hits (no effects on the pool). Returns the
 * number of hits (or -1 on error); *cow: the copy-on-write source or -1; *cached: the tokens served
 * from the cache. */
int64_t pc_lookup(Sched *s, seq_t *q, int32_t *cow, int64_t *cached);
/* Offer q's newly full, computed blocks to the cache ("stored" logged for each that enters). */
int pc_register_full_blocks(Sched *s, seq_t *q);
/* enable_kv_events() and kv_events() (see the contract in _scheduler.c). */
PyObject *pc_enable_events(Sched *s);
PyObject *pc_take_events(Sched *s);

#endif
