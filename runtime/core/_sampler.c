/*
 * runtime.core._core.sample / sample_probs -- the sampler, bit-identical to its twin
 * runtime.core.reference.sample / sample_probs (the recipe is written out there, at "Sampling").
 *
 * Bit-identical means: only IEEE-754 basic operations (+ - * / and comparisons) in the same order
 * as the numpy twin; sums are lane sums (8 interleaved sequential sums, then the 8 in order) or
 * sequential (the twin uses np.cumsum, never the pairwise np.sum); our own exp (exp_neg below; no
 * libm exp, whose last bit differs between libm and numpy's SIMD code); one libm log() per
 * logprobs row (the twin calls math.log: the same libm); no fused multiply-add (setup.py builds
 * with -ffp-contract=off); the same random stream (xoshiro256** over the RNG's uint64[4] state,
 * one draw per non-greedy row). Orders that do not change a result are free: maxima, the top-k
 * threshold (a heap or a quickselect), the top-p candidates (a histogram pass finds a prefix of
 * the ranking that holds the nucleus; its exact cut is decided by the twin's sequential sum).
 *
 * Work buffers (~41 bytes per vocabulary entry) are cached between calls (see work_alloc).
 *
 * ---------------------------------------------------------------------------------------
 * CONTRACT
 * ---------------------------------------------------------------------------------------
 * sample(logits, params, generators, prompt_ids, output_ids, tokens_out, logprobs_out=None, masks=None) -> None
 *     logits        float32 or float64 buffer [B, V], C-contiguous, V >= 1
 *     params        sequence of B objects with temperature, top_k, top_p, min_p,
 *                   repetition_penalty, presence_penalty, frequency_penalty, logprobs
 *                   (SamplingParams); ranges as in SamplingParams.validate (checked again)
 *     generators    sequence of B RNGs (an object whose `state` is a writable uint64[4] buffer,
 *                   not all zero); ignored (may be None) for greedy rows
 *     prompt_ids, output_ids   None, or sequences of B items, each None or a 1-D sequence/buffer
 *                   of integer token ids in [0, V); rows with penalties need both
 *     tokens_out    writable C-contiguous int64 buffer [B]: the sampled tokens
 *     logprobs_out  None, or (chosen float64[B], top_ids int64[B, N], top_logprobs float64[B, N]),
 *                   writable C-contiguous; filled for rows whose params.logprobs is not None
 *                   (which must be <= N and <= V); other rows are left as they were. Without it
 *                   params.logprobs is ignored.
 *     masks         None, or an int32 buffer [B, ceil(V / 32)], C-contiguous: a packed token mask per
 *                   row, bit i of the row (bit i % 32 of word i / 32) = token i allowed. A disallowed
 *                   token's logit is -inf after the penalties and before greedy / temperature / top-k /
 *                   top-p / min-p (the logprobs stay those of the raw logits); a row of all-ones words
 *                   is unconstrained (the same result as no mask). A masked row whose allowed tokens all
 *                   have -inf logits (or that allows none) is an error.
 *     Effect: per row, the twin's recipe; advances each non-greedy row's RNG state by one draw.
 *     Phases: (1) with the GIL, every argument and every row's params/RNG/histories are checked
 *     and copied; (2) without the GIL, the rows are computed into scratch memory; (3) with the
 *     GIL, RNG states and outputs are written. On any error (including NaN logits, or a row with
 *     no finite maximum or no allowed finite logit, reported for the first such row) nothing was
 *     written.
 *     Errors: TypeError (not buffers/sequences, wrong element types, params without a field, masks
 *     not int32), ValueError (shapes, lengths, ranges, token ids outside the vocabulary, NaN, no
 *     finite maximum, a mask that allows no finite logit, penalties without histories, logprobs
 *     wider than logprobs_out), MemoryError.
 *
 * sample_probs(row, params, prompt_ids, output_ids, out, mask=None) -> None
 *     row           float32/float64 buffer [V]; params one SamplingParams; prompt_ids/output_ids
 *                   None or one sequence of token ids each; out writable float64 [V]; mask None or
 *                   an int32 buffer [ceil(V / 32)] (a row of sample's masks)
 *     Effect: out = the distribution the row is drawn from (one-hot on the argmax when greedy).
 *     Errors: as sample; on error out is unchanged.
 * ---------------------------------------------------------------------------------------
 */

#include "_core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- deterministic exp ------------------------------------------------------------------ */

static const double EXP_C[14] = {
    0x1.0p+0, 0x1.0p+0, 0x1.0p-1, 0x1.5555555555555p-3, 0x1.5555555555555p-5,
    0x1.1111111111111p-7, 0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13, 0x1.a01a01a01a01ap-16,
    0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26, 0x1.1eed8eff8d898p-29,
    0x1.6124613a86d09p-33,
}; /* 1/n!, n = 0..13 */
static const double LN2_HI = 0x1.62e42fee00000p-1;
static const double LN2_LO = 0x1.a39ef35793c76p-33;
static const double INV_LN2 = 0x1.71547652b82fep+0;

#define MAGIC 0x1.8p52                     /* 1.5 * 2**52: y + MAGIC rounds |y| < 2**51 to an integer */
#define MAGIC_BITS 0x4338000000000000LL   /* its bit pattern */

/* exp(x) for x <= 0; the twin's exp_neg(): Cody-Waite reduction with k rounded by the MAGIC trick,
 * degree-13 Taylor by Estrin's scheme, 2^k built from k's bits; x < -708 (and -inf) gives 0. Branch-free
 * basic IEEE operations only, so loops over it vectorize. */
static inline double exp_neg(double x) {
    const int ok = x >= -708.0;
    const double xs = ok ? x : 0.0;
    const double t = xs * INV_LN2 + MAGIC;
    const double k = t - MAGIC;
    const double r = (xs - k * LN2_HI) - k * LN2_LO;
    /* Estrin's scheme (short dependency chains; the twin evaluates the same tree) */
    const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    const double q0 = (EXP_C[0] + EXP_C[1] * r) + (EXP_C[2] + EXP_C[3] * r) * r2;
    const double q1 = (EXP_C[4] + EXP_C[5] * r) + (EXP_C[6] + EXP_C[7] * r) * r2;
    const double q2 = (EXP_C[8] + EXP_C[9] * r) + (EXP_C[10] + EXP_C[11] * r) * r2;
    const double q3 = EXP_C[12] + EXP_C[13] * r;
    const double p = (q0 + q1 * r4) + (q2 + q3 * r4) * r8;
    int64_t tb;
    memcpy(&tb, &t, sizeof tb);
    const uint64_t bits = (uint64_t)(tb - MAGIC_BITS + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return ok ? p * scale : 0.0;
}

/* The sum of e[0..n) in 8 interleaved lanes (lane j: e[j], e[j+8], ... in order), then the lanes
 * in order: the twin's _lane_sum (np.cumsum over a [-1, 8] view, then over the lanes). */
static double lane_sum(const double *e, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) {
            acc[j] += e[i + j];
        }
    }
    for (int j = 0; i + j < n; j++) {
        acc[j] += e[i + j];
    }
    double s = acc[0];
    for (int j = 1; j < 8; j++) {
        s += acc[j];
    }
    return s;
}

/* The same sum when only e[idx[k]] (idx ascending) are non-zero. */
static double lane_sum_list(const double *e, const int32_t *idx, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < n; k++) {
        acc[idx[k] & 7] += e[idx[k]];
    }
    double s = acc[0];
    for (int j = 1; j < 8; j++) {
        s += acc[j];
    }
    return s;
}

/* max of x[0..n) and whether any is NaN (the max is exact whatever the order; with a NaN the
 * returned max is meaningless and the caller reports the NaN). SSE2 where available. */
#if defined(__SSE2__)
#include <emmintrin.h>

static double lanes_max(const double *x, int64_t n, int *nan) {
    __m128d m0 = _mm_set1_pd(-INFINITY), m1 = m0, bad = _mm_setzero_pd();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m128d a = _mm_loadu_pd(x + i), b = _mm_loadu_pd(x + i + 2);
        m0 = _mm_max_pd(m0, a);
        m1 = _mm_max_pd(m1, b);
        bad = _mm_or_pd(bad, _mm_or_pd(_mm_cmpunord_pd(a, a), _mm_cmpunord_pd(b, b)));
    }
    double mm[4], r = -INFINITY;
    _mm_storeu_pd(mm, m0);
    _mm_storeu_pd(mm + 2, m1);
    int b = _mm_movemask_pd(bad) != 0;
    for (int j = 0; j < 4; j++) {
        r = mm[j] > r ? mm[j] : r;
    }
    for (; i < n; i++) {
        r = x[i] > r ? x[i] : r;
        b |= x[i] != x[i];
    }
    *nan = b;
    return r;
}

static float lanes_max_f32(const float *x, int64_t n, int *nan) {
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, bad = _mm_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
        m0 = _mm_max_ps(m0, a);
        m1 = _mm_max_ps(m1, b);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
    }
    float mm[8], r = -INFINITY;
    _mm_storeu_ps(mm, m0);
    _mm_storeu_ps(mm + 4, m1);
    int b = _mm_movemask_ps(bad) != 0;
    for (int j = 0; j < 8; j++) {
        r = mm[j] > r ? mm[j] : r;
    }
    for (; i < n; i++) {
        r = x[i] > r ? x[i] : r;
        b |= x[i] != x[i];
    }
    *nan = b;
    return r;
}

/* The first i with x[i] == m (m is in x). */
static int64_t first_equal_f32(const float *x, int64_t n, float m) {
    const __m128 mv = _mm_set1_ps(m);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const int mask = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), mv));
        if (mask) {
            return i + __builtin_ctz((unsigned)mask);
        }
    }
    for (; i < n; i++) {
        if (x[i] == m) {
            return i;
        }
    }
    return 0;
}
#else
static double lanes_max(const double *x, int64_t n, int *nan) {
    double r = -INFINITY;
    int b = 0;
    for (int64_t i = 0; i < n; i++) {
        r = x[i] > r ? x[i] : r;
        b |= x[i] != x[i];
    }
    *nan = b;
    return r;
}

static float lanes_max_f32(const float *x, int64_t n, int *nan) {
    float r = -INFINITY;
    int b = 0;
    for (int64_t i = 0; i < n; i++) {
        r = x[i] > r ? x[i] : r;
        b |= x[i] != x[i];
    }
    *nan = b;
    return r;
}

static int64_t first_equal_f32(const float *x, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++) {
        if (x[i] == m) {
            return i;
        }
    }
    return 0;
}
#endif

/* ---- xoshiro256** ----------------------------------------------------------------------- */

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static double rng_random(uint64_t s[4]) {
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double)(result >> 11) * 0x1.0p-53;
}

/* ---- ranking: (value desc, id asc) ------------------------------------------------------ */

typedef struct {
    double v;
    int32_t i;
} pair_t;

static inline int better(const pair_t *a, const pair_t *b) { return a->v > b->v || (a->v == b->v && a->i < b->i); }

static int pair_cmp(const void *pa, const void *pb) {
    const pair_t *a = pa, *b = pb;
    return better(a, b) ? -1 : (better(b, a) ? 1 : 0);
}

static inline void pair_swap(pair_t *a, pair_t *b) {
    pair_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorder p[0..n) so that p[0..m) are the m best (in any order); 0 < m <= n. Quickselect with a
 * median-of-three pivot; after 64 rounds it falls back to sorting the rest (never quadratic). */
static void select_best(pair_t *p, int64_t n, int64_t m) {
    int64_t lo = 0, hi = n - 1, rounds = 0;
    while (lo < hi) {
        if (++rounds > 64) {
            qsort(p + lo, (size_t)(hi - lo + 1), sizeof(pair_t), pair_cmp);
            return;
        }
        int64_t mid = lo + (hi - lo) / 2;
        if (better(&p[mid], &p[lo])) pair_swap(&p[mid], &p[lo]);
        if (better(&p[hi], &p[lo])) pair_swap(&p[hi], &p[lo]);
        if (better(&p[hi], &p[mid])) pair_swap(&p[hi], &p[mid]);
        pair_t pivot = p[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (better(&p[i], &pivot)) i++;
            while (better(&pivot, &p[j])) j--;
            if (i <= j) {
                pair_swap(&p[i], &p[j]);
                i++;
                j--;
            }
        }
        /* [lo, j] are >= pivot-ish, [i, hi] <= pivot-ish; the m-th best (index m-1) lies in one */
        if (m - 1 <= j) {
            hi = j;
        } else if (m - 1 >= i) {
            lo = i;
        } else {
            return;
        }
    }
}

static int dbl_cmp(const void *pa, const void *pb) {
    const double a = *(const double *)pa, b = *(const double *)pb;
    return (a > b) - (a < b);
}

/* The value at ascending position pos (np.partition(v, pos)[pos]) of v[0..n) (no NaN), reordering v.
 * Quickselect with a median-of-three pivot; after 64 rounds it sorts the rest (never quadratic). */
static double select_value(double *v, int64_t n, int64_t pos) {
    int64_t lo = 0, hi = n - 1, rounds = 0;
    while (lo < hi) {
        if (++rounds > 64) {
            qsort(v + lo, (size_t)(hi - lo + 1), sizeof(double), dbl_cmp);
            return v[pos];
        }
        int64_t mid = lo + (hi - lo) / 2;
        double a = v[lo], b = v[mid], c = v[hi];
        double pivot = (a < b) ? ((b < c) ? b : ((a < c) ? c : a)) : ((a < c) ? a : ((b < c) ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot) i++;
            while (pivot < v[j]) j--;
            if (i <= j) {
                double t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (pos <= j) {
            hi = j;
        } else if (pos >= i) {
            lo = i;
        } else {
            return v[pos];
        }
    }
    return v[pos];
}

/* The k-th largest of x[0..n) (np.partition(x, n - k)[n - k]): a min-heap of the k largest in
 * heap[0..k) when k is small (one predictable compare per element), quickselect on a copy otherwise. */
static double kth_largest(const double *x, int64_t n, int64_t k, double *heap) {
    if (k > 4096 || k * 16 > n) {
        memcpy(heap, x, (size_t)n * sizeof(double));
        return select_value(heap, n, n - k);
    }
    for (int64_t i = 0; i < k; i++) { /* sift up */
        int64_t c = i;
        const double v = x[i];
        while (c > 0 && heap[(c - 1) / 2] > v) {
            heap[c] = heap[(c - 1) / 2];
            c = (c - 1) / 2;
        }
        heap[c] = v;
    }
    for (int64_t i = k; i < n; i++) {
        const double v = x[i];
        if (!(v > heap[0])) {
            continue;
        }
        int64_t c = 0; /* replace the root, sift down */
        for (;;) {
            int64_t l = 2 * c + 1, best = c;
            double bv = v;
            if (l < k && heap[l] < bv) {
                best = l;
                bv = heap[l];
            }
            if (l + 1 < k && heap[l + 1] < bv) {
                best = l + 1;
            }
            if (best == c) {
                break;
            }
            heap[c] = heap[best];
            c = best;
        }
        heap[c] = v;
    }
    return heap[0];
}

#define HIST_BUCKETS 4096 /* weights in (0, 1]: exponent (<= 1023) and 2 mantissa bits: bits >> 50 < 4096 */

/* ---- one row ---------------------------------------------------------------------------- */

typedef struct {
    double temperature, top_p, min_p, rep, pres, freq;
    int64_t top_k, logprobs; /* logprobs: -1 = none */
    int penalized;
    int has_rng;
    uint64_t state[4];
    int64_t prompt_off, prompt_len, output_off, output_len; /* into the history scratch; len -1 = None */
    const uint32_t *mask; /* the row's packed token mask, NULL when none (or all ones) */
} row_t;

typedef struct {
    int64_t vocab;
    double *x;     /* [V] working values: logits, then scaled, then weights */
    double *tmp;   /* [V] top-k selection */
    pair_t *pairs; /* [V] top-p ranking, logprobs top-N */
    int32_t *idx;  /* [V] kept token ids */
    int32_t *cnt;  /* [V] output counts, zero between uses */
    uint8_t *mark; /* [V] repetition marks, zero between uses */
    const int64_t *hist;
} work_t;

enum { ROW_OK = 0, ROW_NAN = 1, ROW_NOMAX = 2, ROW_MASKED = 3 };

/* x = float64(row) / div (div 1: a plain conversion). */
static void load_row(const char *base, int is_double, int64_t v, double div, double *x) {
    if (is_double) {
        const double *d = (const double *)base;
        for (int64_t i = 0; i < v; i++) {
            x[i] = d[i] / div;
        }
    } else {
        const float *f = (const float *)base;
        for (int64_t i = 0; i < v; i++) {
            x[i] = (double)f[i] / div;
        }
    }
}

static void apply_penalties(const row_t *r, work_t *w) {
    double *x = w->x;
    const int64_t *prompt = w->hist + r->prompt_off, *output = w->hist + r->output_off;
    if (r->rep != 1.0) {
        const int64_t *lists[2] = {prompt, output};
        const int64_t lens[2] = {r->prompt_len, r->output_len};
        for (int l = 0; l < 2; l++) {
            for (int64_t k = 0; k < lens[l]; k++) {
                const int64_t t = lists[l][k];
                if (!w->mark[t]) {
                    w->mark[t] = 1;
                    const double v = x[t];
                    x[t] = v > 0 ? v / r->rep : v * r->rep;
                }
            }
        }
        for (int l = 0; l < 2; l++) {
            for (int64_t k = 0; k < lens[l]; k++) {
                w->mark[lists[l][k]] = 0;
            }
        }
    }
    if (r->output_len > 0 && (r->freq != 0.0 || r->pres != 0.0)) {
        for (int64_t k = 0; k < r->output_len; k++) {
            w->cnt[output[k]]++;
        }
        for (int64_t k = 0; k < r->output_len; k++) {
            const int64_t t = output[k];
            const int32_t c = w->cnt[t];
            if (c == 0) {
                continue; /* already applied */
            }
            if (r->freq != 0.0) {
                x[t] = x[t] - r->freq * (double)c;
            }
            if (r->pres != 0.0) {
                x[t] = x[t] - r->pres;
            }
            w->cnt[t] = 0;
        }
    }
}

static int64_t first_equal(const double *x, int64_t v, double m) {
    for (int64_t i = 0; i < v; i++) {
        if (x[i] == m) {
            return i;
        }
    }
    return 0;
}

/* x[i] = -inf for every token i whose bit is clear in mask (words of 32 tokens, bit i % 32 of word i / 32). */
static void apply_mask(double *x, const uint32_t *mask, int64_t v) {
    for (int64_t w = 0; w * 32 < v; w++) {
        const uint32_t bits = mask[w];
        if (bits == 0xFFFFFFFFu) {
            continue;
        }
        const int64_t n = v - w * 32 < 32 ? v - w * 32 : 32;
        double *xw = x + w * 32;
        for (int64_t j = 0; j < n; j++) {
            xw[j] = (bits >> j) & 1u ? xw[j] : -INFINITY;
        }
    }
}

/* Whether every one of the row's n words is all ones (the row constrains nothing). */
static int mask_all_ones(const uint32_t *mask, int64_t n) {
    uint32_t acc = 0xFFFFFFFFu;
    for (int64_t w = 0; w < n; w++) {
        acc &= mask[w];
    }
    return acc == 0xFFFFFFFFu;
}

/* Greedy: argmax of the (penalised, masked) logits, first maximum on ties. */
static int greedy_row(const row_t *r, work_t *w, const char *base, int is_double, int64_t *token) {
    const int64_t v = w->vocab;
    int nan;
    if (!r->penalized && !is_double && r->mask == NULL) { /* straight on the float32 row */
        const float *f = (const float *)base;
        const float m = lanes_max_f32(f, v, &nan);
        if (nan) {
            return ROW_NAN;
        }
        *token = first_equal_f32(f, v, m);
        return ROW_OK;
    }
    load_row(base, is_double, v, 1.0, w->x);
    lanes_max(w->x, v, &nan);
    if (nan) {
        return ROW_NAN;
    }
    if (r->penalized) {
        apply_penalties(r, w);
    }
    int dummy;
    if (r->mask != NULL) {
        apply_mask(w->x, r->mask, v);
        const double m = lanes_max(w->x, v, &dummy);
        if (m == -INFINITY) {
            return ROW_MASKED;
        }
        *token = first_equal(w->x, v, m);
        return ROW_OK;
    }
    *token = first_equal(w->x, v, lanes_max(w->x, v, &dummy));
    return ROW_OK;
}

static int idx_cmp(const void *pa, const void *pb) {
    const int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

/* Non-greedy: the kept weights e in w->x (0 = dropped). *nkept < 0: every id may be non-zero
 * (dense); else w->idx[0..*nkept) are the kept ids, ascending. *total: their lane sum. */
static int kept_weights(const row_t *r, work_t *w, const char *base, int is_double, int64_t *nkept,
                        double *total) {
    const int64_t v = w->vocab;
    double *x = w->x;
    int nan;
    if (r->penalized) {
        load_row(base, is_double, v, 1.0, x);
        lanes_max(x, v, &nan);
        if (nan) {
            return ROW_NAN;
        }
        apply_penalties(r, w);
        for (int64_t i = 0; i < v; i++) {
            x[i] = x[i] / r->temperature;
        }
    } else {
        load_row(base, is_double, v, r->temperature, x); /* NaN stays NaN through the division */
    }
    if (r->mask != NULL) {
        if (!r->penalized) { /* a NaN is reported wherever it is, masked or not */
            lanes_max(x, v, &nan);
            if (nan) {
                return ROW_NAN;
            }
        }
        apply_mask(x, r->mask, v); /* -inf / temperature = -inf: masking after the division is the same */
    }
    const double m = lanes_max(x, v, &nan);
    if (nan) {
        return ROW_NAN;
    }
    if (!isfinite(m)) {
        return r->mask != NULL && m == -INFINITY ? ROW_MASKED : ROW_NOMAX;
    }
    const int topk = r->top_k > 0 && r->top_k < v;
    int64_t nk = -1;
    if (topk) { /* weights of the kept ids only; every other weight 0 */
        const double kth = kth_largest(x, v, r->top_k, w->tmp);
        nk = 0;
        for (int64_t i = 0; i < v; i++) {
            if (x[i] >= kth) {
                w->idx[nk] = (int32_t)i;
                w->tmp[nk++] = exp_neg(x[i] - m);
            }
        }
        memset(x, 0, (size_t)v * sizeof(double));
        for (int64_t k = 0; k < nk; k++) {
            x[w->idx[k]] = w->tmp[k];
        }
    } else {
        for (int64_t i = 0; i < v; i++) {
            x[i] = exp_neg(x[i] - m);
        }
    }
    if (r->top_p < 1.0) {
        const double threshold = r->top_p * lane_sum(x, v);
        /* Rank-prefix candidates: a histogram of the weights by exponent and 2 mantissa bits gives
         * (approximately) the mass above each bucket edge; every weight in or above the bucket where
         * that mass passes the threshold (with a margin far above rounding) is a candidate. They
         * are a prefix of the ranking (ties share a bucket), so walking them sorted decides the
         * cut exactly; if they were not enough, the walk goes on over every weight. */
        double *hist = w->tmp; /* HIST_BUCKETS doubles */
        memset(hist, 0, HIST_BUCKETS * sizeof(double));
        for (int64_t i = 0; i < v; i++) {
            uint64_t bits;
            memcpy(&bits, &x[i], sizeof bits);
            hist[bits >> 50] += x[i];
        }
        uint64_t edge = 0;
        double mass = 0.0;
        for (int64_t bkt = HIST_BUCKETS - 1; bkt >= 0; bkt--) {
            mass += hist[bkt];
            if (mass >= threshold * (1.0 + 1e-9) + 1e-300) {
                edge = (uint64_t)bkt;
                break;
            }
        }
        int64_t nc = 0;
        for (int64_t i = 0; i < v; i++) {
            uint64_t bits;
            memcpy(&bits, &x[i], sizeof bits);
            if (x[i] > 0.0 && (bits >> 50) >= edge) {
                w->pairs[nc].v = x[i];
                w->pairs[nc].i = (int32_t)i;
                nc++;
            }
        }
        qsort(w->pairs, (size_t)nc, sizeof(pair_t), pair_cmp);
        double before = 0.0;
        int64_t cut = -1;
        for (int64_t j = 0; j < nc; j++) {
            if (before >= threshold) {
                cut = j;
                break;
            }
            before += w->pairs[j].v;
        }
        if (cut < 0 && before < threshold && edge > 0) { /* not enough: every positive weight */
            nc = 0;
            for (int64_t i = 0; i < v; i++) {
                if (x[i] > 0.0) {
                    w->pairs[nc].v = x[i];
                    w->pairs[nc].i = (int32_t)i;
                    nc++;
                }
            }
            qsort(w->pairs, (size_t)nc, sizeof(pair_t), pair_cmp);
            before = 0.0;
            for (int64_t j = 0; j < nc; j++) {
                if (before >= threshold) {
                    cut = j;
                    break;
                }
                before += w->pairs[j].v;
            }
        }
        if (cut < 0) {
            cut = nc; /* every candidate is kept */
        }
        /* keep ranks [0, cut): zero every other weight */
        for (int64_t j = 0; j < cut; j++) {
            w->idx[j] = w->pairs[j].i;
            w->tmp[j] = x[w->pairs[j].i];
        }
        memset(x, 0, (size_t)v * sizeof(double));
        for (int64_t j = 0; j < cut; j++) {
            x[w->idx[j]] = w->tmp[j];
        }
        nk = cut;
        qsort(w->idx, (size_t)nk, sizeof(int32_t), idx_cmp);
    } else if (topk) { /* drop weights that underflowed to 0 from the list */
        int64_t kept = 0;
        for (int64_t k = 0; k < nk; k++) {
            if (x[w->idx[k]] > 0.0) {
                w->idx[kept++] = w->idx[k];
            }
        }
        nk = kept;
    }
    if (r->min_p > 0.0) {
        if (nk < 0) {
            int dummy;
            const double threshold = r->min_p * lanes_max(x, v, &dummy);
            for (int64_t i = 0; i < v; i++) {
                x[i] = x[i] < threshold ? 0.0 : x[i];
            }
        } else {
            double emax = 0.0;
            for (int64_t k = 0; k < nk; k++) {
                emax = x[w->idx[k]] > emax ? x[w->idx[k]] : emax;
            }
            const double threshold = r->min_p * emax;
            int64_t kept = 0;
            for (int64_t k = 0; k < nk; k++) {
                const int32_t t = w->idx[k];
                if (x[t] < threshold) {
                    x[t] = 0.0;
                } else {
                    w->idx[kept++] = t;
                }
            }
            nk = kept;
        }
    }
    *nkept = nk;
    *total = nk < 0 ? lane_sum(x, v) : lane_sum_list(x, w->idx, nk);
    return ROW_OK;
}

/* The first id whose sequential cumulative weight exceeds u * total (the last kept id if rounding
 * leaves none): the twin's searchsorted(cumsum(e), u * total, side="right"). */
static int64_t draw(const work_t *w, int64_t nkept, double total, double u) {
    const double target = u * total;
    const double *e = w->x;
    double c = 0.0;
    if (nkept >= 0) {
        for (int64_t k = 0; k < nkept; k++) {
            c += e[w->idx[k]];
            if (c > target) {
                return w->idx[k];
            }
        }
        return w->idx[nkept - 1];
    }
    int64_t last = 0;
    for (int64_t i = 0; i < w->vocab; i++) {
        c += e[i];
        if (e[i] != 0.0) {
            last = i;
        }
        if (c > target) {
            return i;
        }
    }
    return last;
}

/* Raw-logits log-softmax: the chosen token's logprob and the top n (ids, logprobs). */
static int row_logprobs(const char *base, int is_double, work_t *w, int64_t token, int64_t n, double *chosen,
                        int64_t *top_ids, double *top_lp) {
    const int64_t v = w->vocab;
    double *x = w->x, *e = w->tmp;
    load_row(base, is_double, v, 1.0, x);
    int nan;
    const double m = lanes_max(x, v, &nan);
    if (nan) {
        return ROW_NAN;
    }
    if (!isfinite(m)) {
        return ROW_NOMAX;
    }
    for (int64_t i = 0; i < v; i++) {
        e[i] = exp_neg(x[i] - m);
    }
    const double lse = log(lane_sum(e, v));
    *chosen = (x[token] - m) - lse;
    if (n > 0) {
        for (int64_t i = 0; i < v; i++) {
            w->pairs[i].v = x[i];
            w->pairs[i].i = (int32_t)i;
        }
        select_best(w->pairs, v, n);
        qsort(w->pairs, (size_t)n, sizeof(pair_t), pair_cmp);
        for (int64_t j = 0; j < n; j++) {
            top_ids[j] = w->pairs[j].i;
            top_lp[j] = (x[w->pairs[j].i] - m) - lse;
        }
    }
    return ROW_OK;
}

/* ---- argument parsing (phase 1, with the GIL) -------------------------------------------- */

/* Interned attribute names (created once, with the GIL, on first use). */
static PyObject *attr_name(const char *name, PyObject **slot) {
    if (*slot == NULL) {
        *slot = PyUnicode_InternFromString(name);
    }
    return *slot;
}

static int get_field(PyObject *p, Py_ssize_t i, const char *name, PyObject **slot, PyObject **out) {
    PyObject *key = attr_name(name, slot);
    if (key == NULL) {
        return -1;
    }
    *out = PyObject_GetAttr(p, key);
    if (*out == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "params[%zd]: expected SamplingParams, %.100s has no '%s'", i,
                     Py_TYPE(p)->tp_name, name);
    }
    return *out ? 0 : -1;
}

static int is_intlike(PyObject *o) {
    return !PyBool_Check(o) && !PyFloat_Check(o) && (PyLong_Check(o) || PyIndex_Check(o));
}

static int read_row_params(PyObject *p, Py_ssize_t i, row_t *r) {
    static const char *names[8] = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty", "logprobs"};
    static PyObject *keys[8];
    double f[8] = {0};
    int64_t ints[8] = {0};
    for (int k = 0; k < 8; k++) {
        PyObject *o;
        if (get_field(p, i, names[k], &keys[k], &o) < 0) {
            return -1;
        }
        if (k == 1 || k == 7) {
            if (k == 7 && o == Py_None) {
                ints[k] = -1;
                Py_DECREF(o);
                continue;
            }
            if (!is_intlike(o)) {
                PyErr_Format(PyExc_TypeError, "params[%zd].%s: expected an integer, got %.100s", i, names[k],
                             Py_TYPE(o)->tp_name);
                Py_DECREF(o);
                return -1;
            }
            PyObject *idx = PyNumber_Index(o);
            int overflow = 0;
            long long v = idx ? PyLong_AsLongLongAndOverflow(idx, &overflow) : -1;
            Py_XDECREF(idx);
            if (idx == NULL || (v == -1 && PyErr_Occurred())) {
                Py_DECREF(o);
                return -1;
            }
            if (overflow || v < 0 || v > 0x7FFFFFFFLL) {
                PyErr_Format(PyExc_ValueError, "params[%zd].%s must be in [0, 2**31), got %R", i, names[k], o);
                Py_DECREF(o);
                return -1;
            }
            ints[k] = v;
        } else {
            if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o) || PyIndex_Check(o) ||
                                     (Py_TYPE(o)->tp_as_number && Py_TYPE(o)->tp_as_number->nb_float))) {
                PyErr_Format(PyExc_TypeError, "params[%zd].%s: expected a number, got %.100s", i, names[k],
                             Py_TYPE(o)->tp_name);
                Py_DECREF(o);
                return -1;
            }
            double v = PyFloat_AsDouble(o);
            if (v == -1.0 && PyErr_Occurred()) {
                Py_DECREF(o);
                return -1;
            }
            if (!isfinite(v)) {
                PyObject *fo = PyFloat_FromDouble(v);
                PyErr_Format(PyExc_ValueError, "params[%zd].%s must be finite, got %R", i, names[k], fo);
                Py_XDECREF(fo);
                Py_DECREF(o);
                return -1;
            }
            f[k] = v;
        }
        Py_DECREF(o);
    }
    r->temperature = f[0];
    r->top_k = ints[1];
    r->top_p = f[2];
    r->min_p = f[3];
    r->rep = f[4];
    r->pres = f[5];
    r->freq = f[6];
    r->logprobs = ints[7];
    r->penalized = r->rep != 1.0 || r->pres != 0.0 || r->freq != 0.0;
    PyObject *shown = NULL;
    if (r->temperature < 0) {
        shown = PyFloat_FromDouble(r->temperature);
        PyErr_Format(PyExc_ValueError, "params[%zd].temperature must be >= 0, got %R", i, shown);
    } else if (!(r->top_p > 0.0 && r->top_p <= 1.0)) {
        shown = PyFloat_FromDouble(r->top_p);
        PyErr_Format(PyExc_ValueError, "params[%zd].top_p must be in (0, 1], got %R", i, shown);
    } else if (!(r->min_p >= 0.0 && r->min_p <= 1.0)) {
        shown = PyFloat_FromDouble(r->min_p);
        PyErr_Format(PyExc_ValueError, "params[%zd].min_p must be in [0, 1], got %R", i, shown);
    } else if (r->rep <= 0.0) {
        shown = PyFloat_FromDouble(r->rep);
        PyErr_Format(PyExc_ValueError, "params[%zd].repetition_penalty must be > 0, got %R", i, shown);
    } else {
        return 0;
    }
    Py_XDECREF(shown);
    return -1;
}

static PyObject *STATE_KEY;

static int read_rng(PyObject *rng, Py_ssize_t i, uint64_t state[4]) {
    PyObject *key = attr_name("state", &STATE_KEY);
    if (key == NULL) {
        return -1;
    }
    PyObject *st = PyObject_GetAttr(rng, key);
    if (st == NULL) {
        PyErr_Clear();
    }
    Py_buffer v;
    int ok = st != NULL && PyObject_CheckBuffer(st) && PyObject_GetBuffer(st, &v, PyBUF_RECORDS) == 0;
    if (st != NULL && !ok) {
        PyErr_Clear();
    }
    Py_XDECREF(st);
    if (ok) {
        int good = v.ndim == 1 && v.shape[0] == 4 && v.itemsize == 8 && core_format_kind(v.format) == 'u' &&
                   PyBuffer_IsContiguous(&v, 'C') && !v.readonly;
        if (good) {
            memcpy(state, v.buf, 4 * sizeof(uint64_t));
        }
        PyBuffer_Release(&v);
        ok = good;
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "generators[%zd]: expected an RNG from make_generator (a writable uint64[4] "
                     "state)", i);
        return -1;
    }
    if (!(state[0] | state[1] | state[2] | state[3])) {
        PyErr_Format(PyExc_ValueError, "generators[%zd]: RNG state is all zero", i);
        return -1;
    }
    return 0;
}

static int write_rng(PyObject *rng, const uint64_t state[4]) {
    PyObject *key = attr_name("state", &STATE_KEY);
    PyObject *st = key ? PyObject_GetAttr(rng, key) : NULL;
    if (st == NULL) {
        return -1;
    }
    Py_buffer v;
    int rc = PyObject_GetBuffer(st, &v, PyBUF_RECORDS);
    Py_DECREF(st);
    if (rc < 0) {
        return -1;
    }
    if (v.len == 4 * (Py_ssize_t)sizeof(uint64_t) && !v.readonly) {
        memcpy(v.buf, state, 4 * sizeof(uint64_t));
    }
    PyBuffer_Release(&v);
    return 0;
}

typedef struct {
    int64_t *data;
    int64_t len, cap;
} hist_t;

static int hist_push(hist_t *h, int64_t x) {
    if (h->len == h->cap) {
        int64_t ncap = h->cap ? h->cap * 2 : 256;
        int64_t *p = PyMem_Realloc(h->data, (size_t)ncap * sizeof(int64_t));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->data = p;
        h->cap = ncap;
    }
    h->data[h->len++] = x;
    return 0;
}

static int bad_history(const char *name, Py_ssize_t i) {
    PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a 1-D sequence of integer token ids", name, i);
    return -1;
}

static int out_of_vocab(const char *name, Py_ssize_t i, PyObject *value, int64_t vocab) {
    PyErr_Format(PyExc_ValueError, "%s[%zd]: token id %S outside the vocabulary [0, %lld)", name, i, value,
                 (long long)vocab);
    return -1;
}

/* One history row (None -> *len = -1) appended to h. */
static int read_history(PyObject *obj, const char *name, Py_ssize_t i, int64_t vocab, hist_t *h, int64_t *off,
                        int64_t *len) {
    *off = h->len;
    *len = -1;
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer v;
        if (PyObject_GetBuffer(obj, &v, PyBUF_RECORDS_RO) < 0) {
            PyErr_Clear();
            return bad_history(name, i);
        }
        char kind = core_format_kind(v.format);
        int rc = 0;
        if (v.len == 0) {
            *len = 0;
        } else if (v.ndim != 1 || (kind != 'i' && kind != 'u') ||
                   (v.itemsize != 1 && v.itemsize != 2 && v.itemsize != 4 && v.itemsize != 8)) {
            rc = bad_history(name, i);
        } else {
            for (Py_ssize_t k = 0; k < v.shape[0] && rc == 0; k++) {
                const char *e = (const char *)v.buf + k * v.strides[0];
                int64_t t;
                uint64_t u = 0;
                int neg = 0;
                if (kind == 'i') {
                    switch (v.itemsize) {
                    case 1: t = *(const int8_t *)e; break;
                    case 2: { int16_t a; memcpy(&a, e, 2); t = a; break; }
                    case 4: { int32_t a; memcpy(&a, e, 4); t = a; break; }
                    default: memcpy(&t, e, 8); break;
                    }
                    neg = t < 0;
                    u = (uint64_t)t;
                } else {
                    switch (v.itemsize) {
                    case 1: u = *(const uint8_t *)e; break;
                    case 2: { uint16_t a; memcpy(&a, e, 2); u = a; break; }
                    case 4: { uint32_t a; memcpy(&a, e, 4); u = a; break; }
                    default: memcpy(&u, e, 8); break;
                    }
                }
                if (neg || u >= (uint64_t)vocab) {
                    PyObject *shown = kind == 'i' ? PyLong_FromLongLong((long long)(int64_t)u)
                                                  : PyLong_FromUnsignedLongLong((unsigned long long)u);
                    rc = shown ? out_of_vocab(name, i, shown, vocab) : -1;
                    Py_XDECREF(shown);
                } else {
                    rc = hist_push(h, (int64_t)u);
                }
            }
            *len = rc == 0 ? (int64_t)v.shape[0] : -1;
        }
        PyBuffer_Release(&v);
        return rc;
    }
    PyObject *seq = PySequence_Fast(obj, "history");
    if (seq == NULL) {
        PyErr_Clear();
        return bad_history(name, i);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!is_intlike(items[k])) {
            Py_DECREF(seq);
            return bad_history(name, i);
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *idx = PyNumber_Index(items[k]);
        int overflow = 0;
        long long t = idx ? PyLong_AsLongLongAndOverflow(idx, &overflow) : -1;
        if (idx == NULL || (t == -1 && PyErr_Occurred())) {
            Py_XDECREF(idx);
            Py_DECREF(seq);
            return -1;
        }
        if (overflow || t < 0 || t >= vocab) {
            out_of_vocab(name, i, idx, vocab);
            Py_DECREF(idx);
            Py_DECREF(seq);
            return -1;
        }
        Py_DECREF(idx);
        if (hist_push(h, (int64_t)t) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *len = n;
    return 0;
}

/* A sequence of exactly b items (or None when optional): a PySequence_Fast, or NULL. */
static int seq_of(PyObject *obj, const char *name, Py_ssize_t b, int optional, PyObject **out) {
    *out = NULL;
    if (obj == Py_None && optional) {
        return 0;
    }
    PyObject *s = PySequence_Check(obj) ? PySequence_Fast(obj, "") : NULL;
    if (s == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of %zd items, got %.100s", name, b,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(s) != b) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items for %zd logits rows", name, PySequence_Fast_GET_SIZE(s), b);
        Py_DECREF(s);
        return -1;
    }
    *out = s;
    return 0;
}

static int check_logits(Py_buffer *v, const char *what_ndim) {
    char kind = core_format_kind(v->format);
    if (kind != 'f' || (v->itemsize != 4 && v->itemsize != 8)) {
        PyErr_Format(PyExc_TypeError, "logits: expected float32 or float64, got format '%s'",
                     v->format ? v->format : "B");
        return -1;
    }
    if (!PyBuffer_IsContiguous(v, 'C')) {
        PyErr_SetString(PyExc_ValueError, "logits: must be C-contiguous");
        return -1;
    }
    if (v->shape[v->ndim - 1] < 1) {
        PyErr_SetString(PyExc_ValueError, "logits: vocabulary of size 0");
        return -1;
    }
    if (v->shape[v->ndim - 1] > 0x7FFFFFFF) {
        PyErr_Format(PyExc_ValueError, "logits: vocabulary of %zd exceeds 2**31 - 1 %s", v->shape[v->ndim - 1],
                     what_ndim);
        return -1;
    }
    return 0;
}

static int check_out(Py_buffer *v, const char *name, char kind, Py_ssize_t ndim, const Py_ssize_t *shape) {
    int ok = v->ndim == ndim && core_format_kind(v->format) == kind && v->itemsize == 8 &&
             PyBuffer_IsContiguous(v, 'C') && !v->readonly;
    for (Py_ssize_t d = 0; ok && d < ndim; d++) {
        ok = v->shape[d] == shape[d];
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable C-contiguous %s%s buffer of the right shape", name,
                     kind == 'f' ? "float64" : "int64", v->readonly ? " (got a read-only one)" : "");
        return -1;
    }
    return 0;
}

/* A token-mask buffer: int32, C-contiguous, ndim dimensions [rows, words] (or [words]). */
static int check_mask(Py_buffer *m, const char *name, int ndim, Py_ssize_t rows, int64_t vocab) {
    const Py_ssize_t words = (Py_ssize_t)((vocab + 31) / 32);
    if (core_format_kind(m->format) != 'i' || m->itemsize != 4) {
        PyErr_Format(PyExc_TypeError, "%s: expected int32 words, got format '%s' with itemsize %zd", name,
                     m->format ? m->format : "B", m->itemsize);
        return -1;
    }
    if (m->ndim != ndim || (ndim == 2 && m->shape[0] != rows) || m->shape[ndim - 1] != words) {
        PyErr_Format(PyExc_ValueError, "%s: expected shape %s%zd words (ceil(vocab / 32) for a vocabulary of %lld)",
                     name, ndim == 2 ? "[rows of logits, " : "[", words, (long long)vocab);
        return -1;
    }
    if (!PyBuffer_IsContiguous(m, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: must be C-contiguous", name);
        return -1;
    }
    return 0;
}

/* Work buffers. One set is cached between calls (mapped pages, no page faults per call; it
 * grows to the largest vocabulary seen: ~41 bytes per token). A call that finds it in use
 * (another thread samples while this one released the GIL) gets its own. GIL held here. */
static work_t CACHE;
static int64_t CACHE_V;
static int CACHE_BUSY;

static void work_free_arrays(work_t *w) {
    PyMem_Free(w->x);
    PyMem_Free(w->tmp);
    PyMem_Free(w->pairs);
    PyMem_Free(w->idx);
    PyMem_Free(w->cnt);
    PyMem_Free(w->mark);
    memset(w, 0, sizeof *w);
}

static int work_alloc_arrays(work_t *w, int64_t vocab) {
    memset(w, 0, sizeof *w);
    const size_t v = (size_t)(vocab > 0 ? vocab : 1);
    w->x = PyMem_Malloc(v * sizeof(double));
    w->tmp = PyMem_Malloc((v > HIST_BUCKETS ? v : HIST_BUCKETS) * sizeof(double)); /* also the top-p histogram */
    w->pairs = PyMem_Malloc(v * sizeof(pair_t));
    w->idx = PyMem_Malloc(v * sizeof(int32_t));
    w->cnt = PyMem_Calloc(v, sizeof(int32_t));
    w->mark = PyMem_Calloc(v, 1);
    if (!w->x || !w->tmp || !w->pairs || !w->idx || !w->cnt || !w->mark) {
        work_free_arrays(w);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* *cached: whether w is the cache (give it back with work_release). */
static int work_alloc(work_t *w, int64_t vocab, int *cached) {
    *cached = 0;
    if (!CACHE_BUSY) {
        if (CACHE_V < vocab) {
            work_free_arrays(&CACHE);
            CACHE_V = 0;
            if (work_alloc_arrays(&CACHE, vocab) < 0) {
                return -1;
            }
            CACHE_V = vocab;
        }
        CACHE_BUSY = 1;
        *w = CACHE;
        w->vocab = vocab;
        *cached = 1;
        return 0;
    }
    if (work_alloc_arrays(w, vocab) < 0) {
        return -1;
    }
    w->vocab = vocab;
    return 0;
}

static void work_release(work_t *w, int cached) {
    if (cached) {
        CACHE_BUSY = 0; /* cnt and mark are all zero again: every use resets what it set */
    } else {
        work_free_arrays(w);
    }
}

static void row_error(int code, Py_ssize_t row) {
    if (code == ROW_NAN) {
        PyErr_Format(PyExc_ValueError, "logits row %zd contains NaN", row);
    } else if (code == ROW_MASKED) {
        PyErr_Format(PyExc_ValueError, "logits row %zd: its token mask allows no token with a finite logit", row);
    } else {
        PyErr_Format(PyExc_ValueError, "logits row %zd has no finite maximum (all -inf, or +inf)", row);
    }
}

/* ---- sample ------------------------------------------------------------------------------ */

static PyObject *sample(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *logits_obj, *params_obj, *rngs_obj, *prompt_obj, *output_obj, *tokens_obj, *lp_obj = Py_None;
    PyObject *mask_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOOO|OO:sample", &logits_obj, &params_obj, &rngs_obj, &prompt_obj, &output_obj,
                          &tokens_obj, &lp_obj, &mask_obj)) {
        return NULL;
    }
    Py_buffer lv, tv, lpv[3], mv;
    int have_lv = 0, have_tv = 0, have_lp = 0, have_mv = 0;
    PyObject *params = NULL, *rngs = NULL, *prompts = NULL, *outputs = NULL, *lp_seq = NULL, *result = NULL;
    row_t *rows = NULL;
    int64_t *tok_scratch = NULL;
    double *lp_chosen = NULL;
    int64_t *lp_ids = NULL;
    double *lp_vals = NULL;
    hist_t hist = {0};
    work_t w = {0};
    int have_work = 0, cached = 0;

    if (core_get_buffer(logits_obj, &lv, 0, "", "logits") < 0) {
        goto done;
    }
    have_lv = 1;
    if (lv.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "logits: expected 2 dimensions [B, vocab], got %d", lv.ndim);
        goto done;
    }
    if (check_logits(&lv, "") < 0) {
        goto done;
    }
    const Py_ssize_t b = lv.shape[0];
    const int64_t vocab = lv.shape[1];
    if (seq_of(params_obj, "params", b, 0, &params) < 0 || seq_of(rngs_obj, "generators", b, 0, &rngs) < 0 ||
        seq_of(prompt_obj, "prompt_ids", b, 1, &prompts) < 0 || seq_of(output_obj, "output_ids", b, 1, &outputs) < 0) {
        goto done;
    }
    if (core_get_buffer(tokens_obj, &tv, PyBUF_WRITABLE, "", "tokens_out") < 0) {
        goto done;
    }
    have_tv = 1;
    if (check_out(&tv, "tokens_out", 'i', 1, &b) < 0) {
        goto done;
    }
    Py_ssize_t width = 0;
    if (lp_obj != Py_None) {
        if (!(PyTuple_Check(lp_obj) || PyList_Check(lp_obj)) || PySequence_Size(lp_obj) != 3) {
            PyErr_SetString(PyExc_TypeError, "logprobs_out: expected None or (chosen, top_ids, top_logprobs)");
            goto done;
        }
        lp_seq = PySequence_Fast(lp_obj, "logprobs_out");
        if (lp_seq == NULL) {
            goto done;
        }
        static const char *lp_names[3] = {"logprobs_out[0]", "logprobs_out[1]", "logprobs_out[2]"};
        for (int k = 0; k < 3; k++) {
            if (core_get_buffer(PySequence_Fast_GET_ITEM(lp_seq, k), &lpv[k], PyBUF_WRITABLE, "", lp_names[k]) < 0) {
                for (int j = 0; j < k; j++) {
                    PyBuffer_Release(&lpv[j]);
                }
                goto done;
            }
        }
        have_lp = 1;
        if (lpv[1].ndim != 2) {
            PyErr_SetString(PyExc_ValueError, "logprobs_out[1]: expected 2 dimensions [B, N]");
            goto done;
        }
        width = lpv[1].shape[1];
        const Py_ssize_t shape2[2] = {b, width};
        if (check_out(&lpv[0], "logprobs_out[0]", 'f', 1, &b) < 0 || check_out(&lpv[1], "logprobs_out[1]", 'i', 2, shape2) < 0 ||
            check_out(&lpv[2], "logprobs_out[2]", 'f', 2, shape2) < 0) {
            goto done;
        }
    }

    if (mask_obj != Py_None) {
        if (core_get_buffer(mask_obj, &mv, 0, "", "masks") < 0) {
            goto done;
        }
        have_mv = 1;
        if (check_mask(&mv, "masks", 2, b, vocab) < 0) {
            goto done;
        }
    }

    rows = PyMem_Calloc(b > 0 ? (size_t)b : 1, sizeof(row_t));
    tok_scratch = PyMem_Calloc(b > 0 ? (size_t)b : 1, sizeof(int64_t));
    if (rows == NULL || tok_scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < b; i++) {
        row_t *r = &rows[i];
        if (read_row_params(PySequence_Fast_GET_ITEM(params, i), i, r) < 0) {
            goto done;
        }
        if (have_mv) {
            const int64_t words = (vocab + 31) / 32;
            const uint32_t *m = (const uint32_t *)mv.buf + i * words;
            r->mask = mask_all_ones(m, words) ? NULL : m;
        }
        if (r->temperature != 0.0) {
            if (read_rng(PySequence_Fast_GET_ITEM(rngs, i), i, r->state) < 0) {
                goto done;
            }
            r->has_rng = 1;
        }
        if (read_history(prompts ? PySequence_Fast_GET_ITEM(prompts, i) : Py_None, "prompt_ids", i, vocab, &hist,
                         &r->prompt_off, &r->prompt_len) < 0 ||
            read_history(outputs ? PySequence_Fast_GET_ITEM(outputs, i) : Py_None, "output_ids", i, vocab, &hist,
                         &r->output_off, &r->output_len) < 0) {
            goto done;
        }
        if (r->penalized && (r->prompt_len < 0 || r->output_len < 0)) {
            PyErr_Format(PyExc_ValueError, "params[%zd]: penalties need the row's prompt_ids and output_ids", i);
            goto done;
        }
        if (!have_lp) {
            r->logprobs = -1;
        } else if (r->logprobs > width) {
            PyErr_Format(PyExc_ValueError, "params[%zd].logprobs=%lld exceeds logprobs_out's width %zd", i,
                         (long long)r->logprobs, width);
            goto done;
        } else if (r->logprobs > vocab) {
            PyErr_Format(PyExc_ValueError, "params[%zd].logprobs=%lld exceeds the vocabulary size %lld", i,
                         (long long)r->logprobs, (long long)vocab);
            goto done;
        }
    }
    if (have_lp) {
        lp_chosen = PyMem_Calloc(b > 0 ? (size_t)b : 1, sizeof(double));
        lp_ids = PyMem_Calloc(b * width > 0 ? (size_t)(b * width) : 1, sizeof(int64_t));
        lp_vals = PyMem_Calloc(b * width > 0 ? (size_t)(b * width) : 1, sizeof(double));
        if (!lp_chosen || !lp_ids || !lp_vals) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (b > 0) {
        if (work_alloc(&w, vocab, &cached) < 0) {
            goto done;
        }
        have_work = 1;
    }
    w.hist = hist.data;

    int err = ROW_OK;
    Py_ssize_t err_row = -1;
    const int is_double = lv.itemsize == 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b && err == ROW_OK; i++) {
        row_t *r = &rows[i];
        const char *base = (const char *)lv.buf + i * vocab * lv.itemsize;
        if (r->temperature == 0.0) {
            err = greedy_row(r, &w, base, is_double, &tok_scratch[i]);
        } else {
            int64_t nkept;
            double total;
            err = kept_weights(r, &w, base, is_double, &nkept, &total);
            if (err == ROW_OK) {
                tok_scratch[i] = draw(&w, nkept, total, rng_random(r->state));
            }
        }
        if (err != ROW_OK) {
            err_row = i;
            break;
        }
        if (r->logprobs >= 0) {
            err = row_logprobs(base, is_double, &w, tok_scratch[i], r->logprobs, &lp_chosen[i], lp_ids + i * width,
                               lp_vals + i * width);
            if (err != ROW_OK) {
                err_row = i;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (err != ROW_OK) {
        row_error(err, err_row);
        goto done;
    }
    for (Py_ssize_t i = 0; i < b; i++) {
        if (rows[i].has_rng && write_rng(PySequence_Fast_GET_ITEM(rngs, i), rows[i].state) < 0) {
            goto done; /* only if the RNG object changed under us */
        }
    }
    memcpy(tv.buf, tok_scratch, (size_t)b * sizeof(int64_t));
    if (have_lp) {
        for (Py_ssize_t i = 0; i < b; i++) {
            const int64_t n = rows[i].logprobs;
            if (n < 0) {
                continue;
            }
            ((double *)lpv[0].buf)[i] = lp_chosen[i];
            memcpy((int64_t *)lpv[1].buf + i * width, lp_ids + i * width, (size_t)n * sizeof(int64_t));
            memcpy((double *)lpv[2].buf + i * width, lp_vals + i * width, (size_t)n * sizeof(double));
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (have_work) {
        work_release(&w, cached);
    }
    PyMem_Free(hist.data);
    PyMem_Free(rows);
    PyMem_Free(tok_scratch);
    PyMem_Free(lp_chosen);
    PyMem_Free(lp_ids);
    PyMem_Free(lp_vals);
    if (have_lp) {
        for (int k = 0; k < 3; k++) {
            PyBuffer_Release(&lpv[k]);
        }
    }
    if (have_tv) {
        PyBuffer_Release(&tv);
    }
    if (have_mv) {
        PyBuffer_Release(&mv);
    }
    if (have_lv) {
        PyBuffer_Release(&lv);
    }
    Py_XDECREF(params);
    Py_XDECREF(rngs);
    Py_XDECREF(prompts);
    Py_XDECREF(outputs);
    Py_XDECREF(lp_seq);
    return result;
}

/* ---- sample_probs ------------------------------------------------------------------------ */

static PyObject *sample_probs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *row_obj, *params_obj, *prompt_obj, *output_obj, *out_obj, *mask_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOO|O:sample_probs", &row_obj, &params_obj, &prompt_obj, &output_obj, &out_obj,
                          &mask_obj)) {
        return NULL;
    }
    Py_buffer lv, ov, mv;
    int have_lv = 0, have_ov = 0, have_mv = 0, have_work = 0, cached = 0;
    hist_t hist = {0};
    work_t w = {0};
    row_t r;
    memset(&r, 0, sizeof r);
    PyObject *result = NULL;
    if (core_get_buffer(row_obj, &lv, 0, "", "logits") < 0) {
        goto done;
    }
    have_lv = 1;
    if (lv.ndim != 1) {
        PyErr_Format(PyExc_ValueError, "logits: expected 1 dimension [vocab], got %d", lv.ndim);
        goto done;
    }
    if (check_logits(&lv, "") < 0) {
        goto done;
    }
    const int64_t vocab = lv.shape[0];
    if (core_get_buffer(out_obj, &ov, PyBUF_WRITABLE, "", "out") < 0) {
        goto done;
    }
    have_ov = 1;
    const Py_ssize_t shape[1] = {(Py_ssize_t)vocab};
    if (check_out(&ov, "out", 'f', 1, shape) < 0 || read_row_params(params_obj, 0, &r) < 0 ||
        read_history(prompt_obj, "prompt_ids", 0, vocab, &hist, &r.prompt_off, &r.prompt_len) < 0 ||
        read_history(output_obj, "output_ids", 0, vocab, &hist, &r.output_off, &r.output_len) < 0) {
        goto done;
    }
    if (r.penalized && (r.prompt_len < 0 || r.output_len < 0)) {
        PyErr_SetString(PyExc_ValueError, "params[0]: penalties need the row's prompt_ids and output_ids");
        goto done;
    }
    if (mask_obj != Py_None) {
        if (core_get_buffer(mask_obj, &mv, 0, "", "mask") < 0) {
            goto done;
        }
        have_mv = 1;
        if (check_mask(&mv, "mask", 1, 1, vocab) < 0) {
            goto done;
        }
        r.mask = mask_all_ones(mv.buf, (vocab + 31) / 32) ? NULL : mv.buf;
    }
    if (work_alloc(&w, vocab, &cached) < 0) {
        goto done;
    }
    have_work = 1;
    w.hist = hist.data;
    double *out = ov.buf;
    if (r.temperature == 0.0) {
        int64_t best;
        int err = greedy_row(&r, &w, lv.buf, lv.itemsize == 8, &best);
        if (err != ROW_OK) {
            row_error(err, 0);
            goto done;
        }
        memset(out, 0, (size_t)vocab * sizeof(double));
        out[best] = 1.0;
    } else {
        int64_t nkept;
        double total;
        int err = kept_weights(&r, &w, lv.buf, lv.itemsize == 8, &nkept, &total);
        if (err != ROW_OK) {
            row_error(err, 0);
            goto done;
        }
        for (int64_t i = 0; i < vocab; i++) {
            out[i] = w.x[i] / total;
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (have_work) {
        work_release(&w, cached);
    }
    PyMem_Free(hist.data);
    if (have_mv) {
        PyBuffer_Release(&mv);
    }
    if (have_ov) {
        PyBuffer_Release(&ov);
    }
    if (have_lv) {
        PyBuffer_Release(&lv);
    }
    return result;
}

PyMethodDef core_sampler_methods[] = {
    {"sample", sample, METH_VARARGS,
     "sample(logits, params, generators, prompt_ids, output_ids, tokens_out, logprobs_out=None, masks=None)\n--\n\n"
     "One token per row into tokens_out; see the contract in _sampler.c (twin: reference.sample)."},
    {"sample_probs", sample_probs, METH_VARARGS,
     "sample_probs(row, params, prompt_ids, output_ids, out, mask=None)\n--\n\n"
     "The distribution a row is drawn from, into out (twin: reference.sample_probs)."},
    {NULL, NULL, 0, NULL},
};
