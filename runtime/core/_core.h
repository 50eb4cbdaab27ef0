/*
 * Internal header of runtime.core._core: what its C files share. Not a public API.
 *
 *   _core.c          module, KV scatter and KV block copy (contract at its top)
 *   _scheduler.c     the Scheduler type: sequences, queues, schedule/pack/update (contract at its top),
 *                    on _block_pool.c (the KV block pool) and _prefix_cache.c (the prefix cache);
 *                    the three share the scheduler's state through _sched.h
 *   _sampler.c       sample() and sample_probs() (contract at its top)
 *
 * Conventions in every file:
 *   - Functions returning int return 0 on success and -1 with a Python exception set.
 *   - User input (shapes, dtypes, ids, lengths) is validated and reported as TypeError /
 *     ValueError naming the argument; RuntimeError is for states the caller produced (a sequence
 *     that outgrows the pool) and for broken internal invariants; nothing calls abort().
 *   - Memory comes from PyMem_* (the GIL is held whenever it is called).
 */
#ifndef OPTIMIZE_CORE_H
#define OPTIMIZE_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* Element kind of a struct-module format: 'f' float, 'i' signed int, 'u' unsigned, 'b' bool;
 * 0 for anything else (compound, non-native byte order, pointers, ...). */
char core_format_kind(const char *fmt);

/* PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO | extra) with messages naming prefix+name:
 * TypeError when obj has no buffer protocol, ValueError when it cannot export. */
int core_get_buffer(PyObject *obj, Py_buffer *view, int extra_flags, const char *prefix, const char *name);

/* Grow *arr (PyMem, items of `item` bytes, capacity *cap) to hold at least `need` items, doubling
 * from 4; MemoryError on failure (*arr unchanged). */
int core_grow(void **arr, int64_t *cap, int64_t need, size_t item);

/* splitmix64's finalizer (also used by the block hash and the RNG seeding). */
static inline uint64_t core_mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#define CORE_GOLDEN 0x9E3779B97F4A7C15ULL

/* Registration hooks called by PyInit__core. */
int core_scheduler_register(PyObject *module);
extern PyMethodDef core_sampler_methods[];

#endif
