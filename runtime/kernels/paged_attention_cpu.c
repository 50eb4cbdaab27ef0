/* Paged attention for ONNX Runtime CPU: the custom op optimize.PagedAttention (domain "optimize").
 *
 * One node per layer over the ForwardBatch's packed tokens (compiler/attention/lowering.py emits it):
 *
 *   inputs   query [T, H*D], key [T, KVH*D], value [T, KVH*D]       this step's tokens (after RoPE)
 *            key_cache, value_cache [num_blocks, block_size, KVH, D] the layer's pools (float32 or int8)
 *            cu_seqlens int32 [B+1], past_lens int32 [B], block_table int32 [B, max_blocks]
 *            k_scale, v_scale [KVH] (optional; int8 pools only)      one scale per KV head
 *   attrs    num_heads, kv_num_heads, scale, local_window_size (-1: none)
 *   output   [T, H*D]
 *
 * int8 pools (quantize_kv_cache int8): the step's K/V are stored as QuantizeLinear writes them
 * (round_half_even(x / scale), saturated, zero point 0); a past key chunk is dequantized (code * scale)
 * into the work item's scratch before use, while the step's own keys and values are read unquantized,
 * as the decomposed path attends to them, so both paths give the same numbers.
 *
 * Token i of sequence b (packed row cu_seqlens[b] + i) sits at position p = past_lens[b] + i. The op
 * first writes the step's K/V into the pools in place at block_table[b][p / block_size], offset
 * p % block_size (the slots the runtime's scheduler assigns), then attends each token to positions
 * [lo, p] of its own sequence read from the pools through the block table, lo = p - window + 1 (>= 0)
 * with a sliding window, else 0. No past is gathered into new tensors and no token of one sequence is
 * scored against another's.
 *
 * Work is split into items (sequence, KV head, query tile); a tile holds up to QT query tokens times
 * the G = H / KVH query heads that share the KV head, so every key row read from the pool serves all G
 * heads. Per item: keys in chunks of KC positions, an online softmax in base 2 (running max and sum per
 * query row, float32 accumulation), the weighted values accumulated per row. Items of 16 rows or more
 * (prefill tiles) put 16 query rows in the vector lanes (attend_lanes: Q transposed once, a broadcast
 * key or value element per multiply-add, the softmax per lane); smaller ones (decode) take a dot product
 * per (row, key), vectorized over the head dimension. Items run on ONNX Runtime's
 * intra-op thread pool (KernelContext_ParallelFor), the session's own threads; a step too small to pay
 * for a fork/join runs inline. The hot function is compiled for x86-64-v4 (AVX-512), v3 (AVX2 + FMA)
 * and baseline x86-64, chosen at load by the CPU (GCC target_clones).
 *
 * The second op, optimize.RotaryPagedAttention, takes the QKV projection's output as it is and applies the
 * rotary embedding itself (what ONNX Runtime's RotaryEmbedding computes), so that a decoder layer's
 * attention is one node from the fused QKV Gemm to o_proj (compiler/fusion/attention.py writes it):
 *
 *   inputs   qkv [T, (H + 2*KVH)*D]                   q | k | v of this step's tokens (before RoPE)
 *            positions int64 [T]                       each token's position (the rotation's row)
 *            cos_cache, sin_cache [P, R/2]              R = rotary_embedding_dim (0: D)
 *            key_cache, value_cache, cu_seqlens, past_lens, block_table   as above
 *   attrs    those above + rotary_embedding_dim, interleaved (0: rotate-half pairs (i, i + R/2); 1: (2i, 2i+1))
 *   output   [T, H*D]
 *
 * K is rotated on its way into the pool and Q on its way into a work item's scratch; dimensions from R
 * on pass through unrotated. No [T, H*D] copy of the rotated queries is made.
 *
 * The third op, optimize.QuantizeRows, is the per-token activation quantization of INT8 W8A8 graphs
 * (compiler/quant/onnx_rules.py writes it as Abs, ReduceMax, Mul(1/127), Max(1e-12), Div, QuantizeLinear;
 * compiler/fusion/quantize_rows.py replaces those six nodes with it): x [.., K] float32 ->
 * codes uint8 [.., K] = saturate(round_half_even(x / s) + 128), scale [.., 1] = max(amax(|x|) * (1/127), 1e-12),
 * the same float operations in the same order, so the codes are the ones the six nodes give.
 *
 * optimize.MatMulBf16 (below) multiplies by bfloat16 weights (target.matmul: bfloat16); optimize.SiluMul
 * (below) is a SwiGLU MLP's Split + SiLU + Mul as one node: x [.., 2I] -> silu(x[.., :I]) * x[.., I:].
 *
 * Every index is validated before anything is written: a block table entry outside the pool, a
 * sequence longer than its table, or shapes that disagree return an error status (ONNX Runtime raises
 * it as an exception in the caller) and leave the pools untouched.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define DOMAIN "optimize"
#define OP_NAME "PagedAttention"
#define ROPE_OP_NAME "RotaryPagedAttention"
#define QROWS_OP_NAME "QuantizeRows"
#define KC 16          /* key positions per chunk */
#define ROWS_TARGET 64 /* query rows (tokens x group heads) per work item, at most */
#define INLINE_WORK (1 << 18) /* multiply-adds below which a step runs without the thread pool */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(OPTIMIZE_NO_CLONES)
#define HOT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT_CLONES
#endif

static const OrtApi *g_api;
static OrtCustomOpDomain *g_domain;

static OrtStatus *status(OrtErrorCode code, const char *msg) {
    return ORT_FN(g_api, CreateStatus, OrtCreateStatusFn)(code, msg);
}

/* ---- kernel state and the per-step job --------------------------------------------------------------- */

typedef struct {
    int64_t num_heads, kv_heads, window;
    float scale;
    int64_t inline_work; /* below this many multiply-adds a step runs without the thread pool */
    int rope;            /* RotaryPagedAttention: packed qkv input, rotary applied here */
    int qrows;           /* QuantizeRows (no attributes; none of the fields above) */
    int bf16;            /* MatMulBf16 (attribute n: n_out) */
    int bf16_dp;         /* MatMulBf16 multiplies with AVX-512 BF16's vdpbf16ps */
    int silu_mul;        /* SiluMul (no attributes) */
    int64_t n_out;
    int64_t rotary_dim;  /* 0: head_dim */
    int64_t interleaved;
} Kernel;

typedef struct {
    int32_t seq, kv_head, q0, q1; /* query tokens [q0, q1) of sequence seq */
} Item;

typedef struct {
    const float *q;
    int64_t q_stride; /* floats from one token's query row to the next (H*D, or (H + 2*KVH)*D packed) */
    const int64_t *pos; /* RotaryPagedAttention: token positions, the rotation's cache rows; else NULL */
    const float *cos, *sin;
    int64_t rdim, interleaved;
    float *kc, *vc;
    /* int8 pools (quantize_kv_cache int8): codes and one scale per KV head; kc/vc are NULL then */
    int8_t *kc8, *vc8;
    const float *k_scale, *v_scale;
    /* with int8 pools, the step's own keys and values are read unquantized from here (as the decomposed
     * path attends to them): token t's key row of KV head h at kstep + t * kstep_stride + h * D */
    const float *kstep, *vstep;
    int64_t kstep_stride, vstep_stride;
    const int32_t *cu, *past, *bt;
    float *out;
    int64_t max_blocks, block_size, num_heads, kv_heads, head_dim, group, window;
    float scale_log2; /* softmax scale * log2(e): scores are exponentiated in base 2 */
    const Item *items;
    int failed; /* set by an item that could not allocate its scratch */
} Job;

/* 16-lane float vectors (GCC/Clang vector extensions): one AVX-512 register, two AVX2 or four SSE ones,
 * depending on the clone the CPU selects. Loads and stores go through memcpy (unaligned, no aliasing UB). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
#define VL 16

static inline v16f vload(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f vsplat(float x) { return (v16f){0} + x; }
static inline v16f vselect(v16i mask, v16f a, v16f b) { return (v16f)((mask & (v16i)a) | (~mask & (v16i)b)); }
static inline v16f vmax(v16f a, v16f b) { return vselect(a > b, a, b); }

#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline float hsum(v16f v) {
    v = v + SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = v + SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline float hmax(v16f v) {
    v = vmax(v, SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* 2^x for x <= 0 (x = -inf and x <= -126 give 0): Cephes exp2f's polynomial on [-0.5, 0.5] (~2 ulp). */
static inline v16f vexp2_neg(v16f x) {
    const v16i tiny = x <= -126.0f;
    x = vmax(x, vsplat(-126.0f));
    const v16f xr = x + 0.5f;
    v16i n = __builtin_convertvector(xr, v16i);          /* toward zero */
    n = n + (__builtin_convertvector(n, v16f) > xr);     /* floor: -1 where truncation went up */
    const v16f f = x - __builtin_convertvector(n, v16f); /* [-0.5, 0.5] */
    v16f p = vsplat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const v16f r = p * (v16f)((n + 127) << 23);
    return (v16f)((v16i)r & ~tiny);
}

static inline float exp2_neg(float x) { return vexp2_neg(vsplat(x))[0]; }

/* dot(a, b) over n floats (a's rows are padded to whole vectors with zeros; b is read to n only) */
static inline float dot(const float *a, const float *b, int64_t n) {
    v16f s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 2 * VL <= n; d += 2 * VL) {
        s0 += vload(a + d) * vload(b + d);
        s1 += vload(a + d + VL) * vload(b + d + VL);
    }
    for (; d + VL <= n; d += VL) s0 += vload(a + d) * vload(b + d);
    float t = hsum(s0 + s1);
    for (; d < n; d++) t += a[d] * b[d];
    return t;
}

/* The 16 dot products q . krow[jj] (jj < 16) as one vector, lane jj = key jj: 16 per-key accumulators over
 * whole vectors of the head dimension, then a transposing reduction tree (4 levels of shuffle + add; the
 * accumulators are filled in bit-reversed order, which the tree's own lane order undoes), then the
 * dimensions past the last whole vector. */
static inline v16f scores16(const float *q, const float *const *krow, int64_t D) {
    static const int bitrev[VL] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    v16f a[VL];
    for (int64_t i = 0; i < VL; i++) a[i] = (v16f){0};
    const int64_t D16 = D / VL * VL;
    for (int64_t d = 0; d < D16; d += VL) {
        const v16f qv = vload(q + d);
        for (int64_t jj = 0; jj < VL; jj++) a[bitrev[jj]] += qv * vload(krow[jj] + d);
    }
    v16f b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = SHUF2(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF2(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = SHUF2(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               SHUF2(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = SHUF2(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUF2(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    v16f out = SHUF2(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               SHUF2(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    if (D16 < D) {
        float tail[VL];
        for (int64_t jj = 0; jj < VL; jj++) {
            float t = 0.0f;
            for (int64_t d = D16; d < D; d++) t += q[d] * krow[jj][d];
            tail[jj] = t;
        }
        out += vload(tail);
    }
    return out;
}

#define NR 8 /* query rows per score pass (independent accumulators) */
#define LANES_MIN 16 /* an item of at least this many query rows takes attend_lanes */

/* Rows r0..r0+n (n <= 4) of acc: acc = acc * alpha[k] + sum_jj p[k][jj] * vrow[jj] for jj < nk, one
 * d-block at a time so the accumulators stay in registers across the chunk's keys. */
static inline void update_rows(float *acc, int64_t Dp, int64_t D, int64_t n, const float *alpha, const v16f *p,
                               const float *const *vrow, int64_t nk) {
    int64_t d = 0;
    /* four vectors of the head dimension at once: up to 16 independent accumulator chains per key */
    for (; d + 4 * VL <= D; d += 4 * VL) {
        v16f a[4][4];
        for (int64_t k = 0; k < n; k++)
            for (int64_t b = 0; b < 4; b++) a[k][b] = vload(acc + k * Dp + d + b * VL) * alpha[k];
        for (int64_t jj = 0; jj < nk; jj++) {
            v16f v[4];
            for (int64_t b = 0; b < 4; b++) v[b] = vload(vrow[jj] + d + b * VL);
            for (int64_t k = 0; k < n; k++) {
                const float pk = p[k][jj];
                for (int64_t b = 0; b < 4; b++) a[k][b] += pk * v[b];
            }
        }
        for (int64_t k = 0; k < n; k++)
            for (int64_t b = 0; b < 4; b++) vstore(acc + k * Dp + d + b * VL, a[k][b]);
    }
    for (; d + VL <= D; d += VL) {
        v16f a[4];
        for (int64_t k = 0; k < n; k++) a[k] = vload(acc + k * Dp + d) * alpha[k];
        for (int64_t jj = 0; jj < nk; jj++) {
            const v16f v = vload(vrow[jj] + d);
            for (int64_t k = 0; k < n; k++) a[k] += p[k][jj] * v;
        }
        for (int64_t k = 0; k < n; k++) vstore(acc + k * Dp + d, a[k]);
    }
    for (; d < D; d++) {
        for (int64_t k = 0; k < n; k++) {
            float t = acc[k * Dp + d] * alpha[k];
            for (int64_t jj = 0; jj < nk; jj++) t += p[k][jj] * vrow[jj][d];
            acc[k * Dp + d] = t;
        }
    }
}

/* dst[0:D] = rotary(src[0:D]) * mult: pairs (i, i + R/2) (or (2i, 2i+1) interleaved) for i < R/2 turned by
 * angle row c/s, as ONNX Runtime's RotaryEmbedding does (x*cos - y*sin, y*cos + x*sin); dimensions >= R copied */
static inline void rope_row(float *dst, const float *src, int64_t D, int64_t R, int64_t interleaved,
                            const float *c, const float *s, float mult) {
    const int64_t half = R / 2;
    if (interleaved) {
        for (int64_t i = 0; i < half; i++) {
            const float x = src[2 * i], y = src[2 * i + 1];
            dst[2 * i] = (x * c[i] - y * s[i]) * mult;
            dst[2 * i + 1] = (y * c[i] + x * s[i]) * mult;
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float x = src[i], y = src[i + half];
            dst[i] = (x * c[i] - y * s[i]) * mult;
            dst[i + half] = (y * c[i] + x * s[i]) * mult;
        }
    }
    for (int64_t d = R; d < D; d++) dst[d] = src[d] * mult;
}

typedef int8_t v16i8 __attribute__((vector_size(16)));

/* dst[0:D] = codes * scale (DequantizeLinear with zero point 0) */
static inline void dequant_row(float *dst, const int8_t *src, int64_t D, float scale) {
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
        v16i8 c;
        memcpy(&c, src + d, sizeof c);
        vstore(dst + d, __builtin_convertvector(c, v16f) * scale);
    }
    for (; d < D; d++) dst[d] = (float)src[d] * scale;
}

/* dst[0:D] = saturate(round_half_even(src / scale)) as QuantizeLinear to int8 (zero point 0) writes it */
static inline void quant_row(int8_t *dst, const float *src, int64_t D, float scale) {
    for (int64_t d = 0; d < D; d++) {
        float v = nearbyintf(src[d] / scale);
        v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
        dst[d] = (int8_t)v;
    }
}

/* krow/vrow[jj] = the pool rows of keys j0 + jj (jj < nk; the rest repeat key j0's), walking the block
 * table with one division per chunk */
static inline void chunk_rows(const Job *job, int64_t seq, int64_t kv_head, int64_t j0, int64_t nk,
                              const float **krow, const float **vrow, float *kbuf, float *vbuf) {
    const int64_t BS = job->block_size, KVH = job->kv_heads, D = job->head_dim;
    const int32_t *table = job->bt + seq * job->max_blocks;
    const int64_t past = job->past[seq];
    int64_t blk = j0 / BS, off = j0 % BS;
    for (int64_t jj = 0; jj < nk; jj++) {
        const int64_t row = (((int64_t)table[blk] * BS + off) * KVH + kv_head) * D;
        if (job->kc8 && j0 + jj >= past) { /* int8 pools, a key of this step: its float32 row */
            const int64_t t = job->cu[seq] + (j0 + jj - past);
            krow[jj] = job->kstep + t * job->kstep_stride + kv_head * D;
            vrow[jj] = job->vstep + t * job->vstep_stride + kv_head * D;
        } else if (job->kc8) { /* int8 pools, a past key: dequantized into the item's scratch (code * scale) */
            float *kd = kbuf + jj * D, *vd = vbuf + jj * D;
            dequant_row(kd, job->kc8 + row, D, job->k_scale[kv_head]);
            dequant_row(vd, job->vc8 + row, D, job->v_scale[kv_head]);
            krow[jj] = kd;
            vrow[jj] = vd;
        } else {
            krow[jj] = job->kc + row;
            vrow[jj] = job->vc + row;
        }
        if (++off == BS) {
            off = 0;
            blk++;
        }
    }
    for (int64_t jj = nk; jj < VL; jj++) {
        krow[jj] = krow[0];
        vrow[jj] = vrow[0];
    }
}

/* Many query rows (prefill tiles): 16 rows at a time in the vector lanes. Q is transposed once per group
 * (Qt [D][16]), so a key chunk's scores are s[jj] = sum_d Qt[d] * k_jj[d] (a broadcast key element per
 * multiply-add, no transposition of keys), the softmax runs per lane with no horizontal reductions, and
 * the weighted values accumulate into Ot [D][16] (a broadcast value element per multiply-add). Rows are
 * those of the item's scratch Q [R][Dp] (scaled, rotated); the result goes to out. */
static inline __attribute__((always_inline)) void attend_lanes(const Job *job, const Item it, const float *Q,
                                                               int64_t Dp, int64_t R, float *scratch) {
    const int64_t D = job->head_dim, G = job->group;
    const int64_t H = job->num_heads, past = job->past[it.seq], row0 = job->cu[it.seq];
    const int64_t window = job->window;
    float *Qt = scratch, *Ot = Qt + D * VL, *kbuf = Ot + D * VL, *vbuf = kbuf + D * VL;
    const float *krow[VL], *vrow[VL];
    for (int64_t g0 = 0; g0 < R; g0 += VL) {
        const int64_t nr = R - g0 < VL ? R - g0 : VL;
        for (int64_t d = 0; d < D; d++)
            for (int64_t r = 0; r < VL; r++) Qt[d * VL + r] = r < nr ? Q[(g0 + r) * Dp + d] : 0.0f;
        memset(Ot, 0, sizeof(float) * (size_t)(D * VL));
        /* each lane's position; padding lanes repeat the last row's (their results are dropped) */
        int32_t pos_arr[VL];
        for (int64_t r = 0; r < VL; r++) pos_arr[r] = (int32_t)(past + it.q0 + (g0 + (r < nr ? r : nr - 1)) / G);
        v16i prow;
        memcpy(&prow, pos_arr, sizeof prow);
        const int64_t p_min = pos_arr[0], p_max = pos_arr[nr - 1];
        const v16i lo_row = window > 0 ? prow - (int32_t)(window - 1) : (v16i){0};
        int64_t k_begin = window > 0 ? p_min - window + 1 : 0;
        if (k_begin < 0) k_begin = 0;
        v16f m = vsplat(-INFINITY), l = {0};
        for (int64_t j0 = k_begin; j0 <= p_max; j0 += VL) {
            const int64_t nk = (p_max - j0 + 1) < VL ? (p_max - j0 + 1) : VL;
            chunk_rows(job, it.seq, it.kv_head, j0, nk, krow, vrow, kbuf, vbuf);
            v16f sc[VL];
            for (int64_t jj = 0; jj < VL; jj++) sc[jj] = (v16f){0};
            for (int64_t d = 0; d < D; d++) {
                const v16f q = vload(Qt + d * VL);
                for (int64_t jj = 0; jj < VL; jj++) sc[jj] += q * krow[jj][d];
            }
            /* mask keys a lane may not see: past its position, before its window, beyond the chunk */
            const int full = j0 + nk - 1 <= p_min && (window <= 0 || j0 >= p_max - window + 1) && nk == VL;
            v16f mx = vsplat(-INFINITY);
            for (int64_t jj = 0; jj < VL; jj++) {
                if (!full) {
                    const int32_t j = (int32_t)(j0 + jj);
                    const v16i ok = (prow >= j) & (lo_row <= j) & (jj < nk ? (v16i){0} - 1 : (v16i){0});
                    sc[jj] = vselect(ok, sc[jj], vsplat(-INFINITY));
                }
                mx = vmax(mx, sc[jj]);
            }
            const v16f m_new = vmax(m, mx);
            /* a lane that has seen no key yet keeps m = -inf: exponentiate against 0 there (all terms are 0) */
            const v16f m_use = vselect(m_new == vsplat(-INFINITY), (v16f){0}, m_new);
            const v16f alpha = vexp2_neg(m - m_use);
            v16f psum = {0};
            for (int64_t jj = 0; jj < VL; jj++) {
                sc[jj] = vexp2_neg(sc[jj] - m_use);
                psum += sc[jj];
            }
            l = l * alpha + psum;
            m = m_new;
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
                v16f a[8];
                for (int64_t i = 0; i < 8; i++) a[i] = vload(Ot + (d + i) * VL) * alpha;
                for (int64_t jj = 0; jj < nk; jj++)
                    for (int64_t i = 0; i < 8; i++) a[i] += sc[jj] * vrow[jj][d + i];
                for (int64_t i = 0; i < 8; i++) vstore(Ot + (d + i) * VL, a[i]);
            }
            for (; d < D; d++) {
                v16f a = vload(Ot + d * VL) * alpha;
                for (int64_t jj = 0; jj < nk; jj++) a += sc[jj] * vrow[jj][d];
                vstore(Ot + d * VL, a);
            }
        }
        float inv[VL];
        for (int64_t r = 0; r < VL; r++) inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = (g0 + r) / G, h = (g0 + r) % G;
            float *dst = job->out + (row0 + it.q0 + i) * H * D + (it.kv_head * G + h) * D;
            for (int64_t dd = 0; dd < D; dd++) dst[dd] = Ot[dd * VL + r] * inv[r];
        }
    }
}

HOT_CLONES
static void run_item(Job *job, size_t index) {
    const Item it = job->items[index];
    const int64_t D = job->head_dim, G = job->group;
    const int64_t H = job->num_heads, Dp = (D + VL - 1) / VL * VL;
    const int64_t nq = it.q1 - it.q0, R = nq * G, Rp = (R + NR - 1) / NR * NR;
    const int64_t past = job->past[it.seq], row0 = job->cu[it.seq];
    const int64_t window = job->window;
    const int lanes = R >= LANES_MIN; /* many rows: attend_lanes */

    /* scratch: Q [Rp][Dp] (scaled; zero rows/columns pad to whole passes and vectors), acc [Rp][Dp],
     * attend_lanes' Qt and Ot [D][VL], a chunk's dequantized K and V rows [VL][D] each (int8 pools),
     * m [R], l [R] */
    float *mem = (float *)malloc(sizeof(float) * (size_t)(2 * Rp * Dp + 4 * D * VL + 2 * R + 2 * VL));
    if (!mem) {
        job->failed = 1;
        return;
    }
    float *Q = mem, *acc = Q + Rp * Dp, *lanes_scratch = acc + Rp * Dp, *m = lanes_scratch + 4 * D * VL, *l = m + R;
    float *kbuf = lanes_scratch + 2 * D * VL, *vbuf = kbuf + D * VL;
    memset(mem, 0, sizeof(float) * (size_t)(2 * Rp * Dp));
    for (int64_t i = 0; i < nq; i++) {
        const int64_t t = row0 + it.q0 + i;
        for (int64_t h = 0; h < G; h++) {
            const float *src = job->q + t * job->q_stride + (it.kv_head * G + h) * D;
            float *dst = Q + (i * G + h) * Dp;
            if (job->pos) {
                const int64_t half = job->rdim / 2;
                rope_row(dst, src, D, job->rdim, job->interleaved, job->cos + job->pos[t] * half,
                         job->sin + job->pos[t] * half, job->scale_log2);
            } else {
                for (int64_t d = 0; d < D; d++) dst[d] = src[d] * job->scale_log2;
            }
        }
    }
    if (lanes) {
        attend_lanes(job, it, Q, Dp, R, lanes_scratch);
        free(mem);
        return;
    }
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t p_first = past + it.q0, p_last = past + it.q1 - 1;
    int64_t k_begin = window > 0 ? p_first - window + 1 : 0;
    if (k_begin < 0) k_begin = 0;
    const float *krow[VL], *vrow[VL];
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f s[NR];
    float alpha[NR];

    for (int64_t j0 = k_begin; j0 <= p_last; j0 += VL) {
        const int64_t nk = (p_last - j0 + 1) < VL ? (p_last - j0 + 1) : VL;
        chunk_rows(job, it.seq, it.kv_head, j0, nk, krow, vrow, kbuf, vbuf);
        for (int64_t r0 = 0; r0 < R; r0 += NR) {
            const int64_t nr = R - r0 < NR ? R - r0 : NR;
            /* rows r0..r0+nr: skip when no key of this chunk is visible to any of them */
            const int64_t p_lo = past + it.q0 + r0 / G, p_hi = past + it.q0 + (r0 + nr - 1) / G;
            if (j0 > p_hi || j0 + nk - 1 < (window > 0 ? p_lo - window + 1 : 0)) continue;
            for (int64_t k = 0; k < nr; k++) s[k] = scores16(Q + (r0 + k) * Dp, krow, D);
            for (int64_t k = 0; k < nr; k++) {
                const int64_t r = r0 + k;
                const int64_t p = past + it.q0 + r / G; /* this row's position */
                const int64_t lo = window > 0 ? p - window + 1 : 0;
                const v16i j = lane + (int32_t)j0;
                const v16i ok = (j <= (int32_t)p) & (j >= (int32_t)lo) & (lane < (int32_t)nk);
                const v16f sc = vselect(ok, s[k], vsplat(-INFINITY));
                const float mx = hmax(sc);
                if (mx == -INFINITY) { /* nothing visible to this row here: leave it as it is */
                    s[k] = (v16f){0};
                    alpha[k] = 1.0f;
                    continue;
                }
                const float m_new = fmaxf(mx, m[r]);
                alpha[k] = exp2_neg(m[r] - m_new);
                s[k] = vexp2_neg(sc - m_new);
                l[r] = l[r] * alpha[k] + hsum(s[k]);
                m[r] = m_new;
            }
            for (int64_t k = 0; k < nr; k += 4)
                update_rows(acc + (r0 + k) * Dp, Dp, D, nr - k < 4 ? nr - k : 4, alpha + k, s + k, vrow, nk);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        for (int64_t h = 0; h < G; h++) {
            const int64_t r = i * G + h;
            float *dst = job->out + (row0 + it.q0 + i) * H * D + (it.kv_head * G + h) * D;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[r * Dp + d] * inv;
        }
    }
    free(mem);
}

static void run_item_cb(void *job, size_t index) { run_item((Job *)job, index); }

/* ---- tensor access ----------------------------------------------------------------------------------- */

typedef struct {
    void *data;
    int64_t dims[4];
    size_t rank;
    ONNXTensorElementDataType type;
} Tensor;

static OrtStatus *read_input(OrtKernelContext *ctx, size_t index, Tensor *t) {
    const OrtValue *v = NULL;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, index, &v);
    if (st) return st;
    if (!v) return status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: a required input is missing");
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((st = ORT_FN(g_api, GetTensorTypeAndShape, OrtGetTensorTypeAndShapeFn)(v, &info))) return st;
    st = ORT_FN(g_api, GetTensorElementType, OrtGetTensorElementTypeFn)(info, &t->type);
    if (!st) st = ORT_FN(g_api, GetDimensionsCount, OrtGetDimensionsCountFn)(info, &t->rank);
    if (!st && t->rank > 4) st = status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: input rank above 4");
    if (!st) st = ORT_FN(g_api, GetDimensions, OrtGetDimensionsFn)(info, t->dims, t->rank);
    ORT_FN(g_api, ReleaseTensorTypeAndShapeInfo, OrtReleaseTensorTypeAndShapeInfoFn)(info);
    if (st) return st;
    return ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)((OrtValue *)v, &t->data);
}

#define FAIL(...)                                                                                          \
    do {                                                                                                   \
        int used_ = snprintf(msg, sizeof msg, "optimize.%s: ", opname);                                    \
        snprintf(msg + used_, sizeof msg - (size_t)used_, __VA_ARGS__);                                    \
        return status(ORT_INVALID_ARGUMENT, msg);                                                          \
    } while (0)

/* Element types of the two ops' inputs (F float32, I int32, L int64, U any: the pools are float32 or
 * int8), in order; the last two (k_scale, v_scale) are optional. */
static const char PLAIN_TYPES[] = "FFFUUIIIFF";
static const char ROPE_TYPES[] = "FLFFUUIIIFF";
#define N_SCALES 2

static ONNXTensorElementDataType type_of(char c) {
    return c == 'F' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : c == 'I' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
         : c == 'B' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16
         : c == 'U' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

static OrtStatus *quantize_rows_compute(OrtKernelContext *ctx);
static OrtStatus *matmul_bf16_compute(const Kernel *kern, OrtKernelContext *ctx);
static OrtStatus *silu_mul_compute(OrtKernelContext *ctx);

static OrtStatus *compute(void *op_kernel, OrtKernelContext *ctx) {
    const Kernel *k = (const Kernel *)op_kernel;
    if (k->qrows) return quantize_rows_compute(ctx);
    if (k->bf16) return matmul_bf16_compute(k, ctx);
    if (k->silu_mul) return silu_mul_compute(ctx);
    const char *opname = k->rope ? ROPE_OP_NAME : OP_NAME;
    const char *types = k->rope ? ROPE_TYPES : PLAIN_TYPES;
    const size_t n_all = strlen(types), n_req = n_all - N_SCALES;
    char msg[320];
    Tensor in[11];
    size_t count = 0;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInputCount, OrtKernelContextGetInputCountFn)(ctx, &count);
    if (st) return st;
    if (count != n_req && count != n_all) FAIL("expects %zu inputs (%zu with k_scale and v_scale), got %zu", n_req,
                                               n_all, count);
    size_t n_in = n_req;
    for (size_t i = 0; i < n_req; i++)
        if ((st = read_input(ctx, i, &in[i]))) return st;
    if (count == n_all) { /* the scales, when the node has them (an absent optional input reads as NULL) */
        const OrtValue *v = NULL;
        if ((st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, n_req, &v))) return st;
        if (v) {
            n_in = n_all;
            for (size_t i = n_req; i < n_all; i++)
                if ((st = read_input(ctx, i, &in[i]))) return st;
        }
    }
    static const char *plain_names[10] = {"query", "key", "value", "key_cache", "value_cache", "cu_seqlens",
                                          "past_lens", "block_table", "k_scale", "v_scale"};
    static const char *rope_names[11] = {"qkv", "positions", "cos_cache", "sin_cache", "key_cache", "value_cache",
                                         "cu_seqlens", "past_lens", "block_table", "k_scale", "v_scale"};
    static const size_t plain_ranks[10] = {2, 2, 2, 4, 4, 1, 1, 2, 1, 1};
    static const size_t rope_ranks[11] = {2, 1, 2, 2, 4, 4, 1, 1, 2, 1, 1};
    const char *const *names = k->rope ? rope_names : plain_names;
    const size_t *ranks = k->rope ? rope_ranks : plain_ranks;
    for (size_t i = 0; i < n_in; i++) {
        if (types[i] == 'U') {
            if (in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
                FAIL("%s must be float32 or int8", names[i]);
        } else if (in[i].type != type_of(types[i])) {
            FAIL("%s must be %s", names[i], types[i] == 'F' ? "float32" : types[i] == 'I' ? "int32" : "int64");
        }
        if (in[i].rank != ranks[i]) FAIL("%s must have rank %zu, has %zu", names[i], ranks[i], in[i].rank);
    }
    /* the pools and the step description sit at the same places after the first `base` inputs */
    const Tensor *kct = &in[k->rope ? 4 : 3], *vct = &in[k->rope ? 5 : 4], *cut = &in[k->rope ? 6 : 5];
    const Tensor *pastt = &in[k->rope ? 7 : 6], *btt = &in[k->rope ? 8 : 7];
    const int64_t T = in[0].dims[0], H = k->num_heads, KVH = k->kv_heads;
    const int64_t NB = kct->dims[0], BS = kct->dims[1], D = kct->dims[3];
    const int64_t B = pastt->dims[0], MB = btt->dims[1];
    if (kct->dims[2] != KVH) FAIL("key_cache has %lld KV heads, kv_num_heads is %lld",
                                  (long long)kct->dims[2], (long long)KVH);
    if (vct->type != kct->type) FAIL("key_cache and value_cache must have one element type");
    const int pools_i8 = kct->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (pools_i8 != (n_in == n_all)) FAIL("int8 pools take k_scale and v_scale (one per KV head); float32 pools none");
    const float *k_scale = NULL, *v_scale = NULL;
    if (pools_i8) {
        for (size_t i = n_req; i < n_all; i++)
            if (in[i].dims[0] != KVH) FAIL("%s must have kv_num_heads = %lld entries", names[i], (long long)KVH);
        k_scale = (const float *)in[n_req].data;
        v_scale = (const float *)in[n_req + 1].data;
        for (int64_t h = 0; h < KVH; h++)
            if (!(k_scale[h] > 0.0f) || !(v_scale[h] > 0.0f) || isinf(k_scale[h]) || isinf(v_scale[h]))
                FAIL("the KV scales must be positive and finite");
    }
    for (int d = 0; d < 4; d++)
        if (vct->dims[d] != kct->dims[d]) FAIL("value_cache's shape differs from key_cache's");
    /* where q, k and v of token t start, and the floats between two tokens' rows */
    const float *qsrc = (const float *)in[0].data, *ksrc, *vsrc;
    int64_t q_stride, kv_stride, rdim = 0, rows = 0;
    const int64_t *pos = NULL;
    if (k->rope) {
        q_stride = kv_stride = (H + 2 * KVH) * D;
        if (in[0].dims[1] != q_stride) FAIL("qkv has %lld columns, (num_heads + 2 * kv_num_heads) * head_dim is %lld",
                                            (long long)in[0].dims[1], (long long)q_stride);
        ksrc = qsrc + H * D;
        vsrc = qsrc + (H + KVH) * D;
        rdim = k->rotary_dim > 0 ? k->rotary_dim : D;
        if (rdim > D || rdim % 2) FAIL("rotary_embedding_dim %lld must be even and at most head_dim %lld",
                                       (long long)rdim, (long long)D);
        if (in[1].dims[0] != T) FAIL("positions must have one entry per token");
        rows = in[2].dims[0];
        for (int i = 2; i < 4; i++)
            if (in[i].dims[0] != rows || in[i].dims[1] != rdim / 2)
                FAIL("%s must be [rows, rotary_embedding_dim / 2 = %lld]", names[i], (long long)(rdim / 2));
        pos = (const int64_t *)in[1].data;
        for (int64_t t = 0; t < T; t++)
            if (pos[t] < 0 || pos[t] >= rows)
                FAIL("position %lld of token %lld is outside the rotary cache of %lld rows", (long long)pos[t],
                     (long long)t, (long long)rows);
    } else {
        q_stride = H * D;
        kv_stride = KVH * D;
        if (in[0].dims[1] != H * D) FAIL("query has %lld columns, num_heads * head_dim is %lld",
                                         (long long)in[0].dims[1], (long long)(H * D));
        for (int i = 1; i < 3; i++)
            if (in[i].dims[0] != T || in[i].dims[1] != KVH * D)
                FAIL("%s must be [T, kv_num_heads * head_dim]", names[i]);
        ksrc = (const float *)in[1].data;
        vsrc = (const float *)in[2].data;
    }
    if (cut->dims[0] != B + 1) FAIL("cu_seqlens must have past_lens' length + 1");
    if (btt->dims[0] != B) FAIL("block_table must have one row per sequence");
    if (BS <= 0) FAIL("block_size must be positive");
    const int32_t *cu = (const int32_t *)cut->data, *past = (const int32_t *)pastt->data;
    const int32_t *bt = (const int32_t *)btt->data;
    if (cu[0] != 0) FAIL("cu_seqlens must start at 0");
    if (cu[B] != T) FAIL("cu_seqlens must end at the number of tokens (%lld)", (long long)T);
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        if (cu[b + 1] < cu[b]) FAIL("cu_seqlens must not decrease");
        if (past[b] < 0) FAIL("past_lens must not be negative");
        const int64_t total = (int64_t)past[b] + (cu[b + 1] - cu[b]);
        if (total == 0) continue;
        const int64_t need = (total + BS - 1) / BS;
        if (need > MB) FAIL("sequence %lld needs %lld blocks, its block_table row has %lld",
                            (long long)b, (long long)need, (long long)MB);
        for (int64_t j = 0; j < need; j++) {
            const int32_t blk = bt[b * MB + j];
            if (blk < 0 || blk >= NB) FAIL("block_table[%lld][%lld] = %d is outside the pool of %lld blocks",
                                           (long long)b, (long long)j, blk, (long long)NB);
        }
        const int64_t n = cu[b + 1] - cu[b];
        work += n * (k->window > 0 && k->window < total ? k->window : total) * H * D;
    }

    int64_t out_dims[2] = {T, H * D};
    OrtValue *out_value = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, 2, &out_value)))
        return st;
    if (T == 0) return NULL;
    float *out = NULL;
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(out_value, (void **)&out))) return st;

    /* this step's K/V into the pools, in place (K rotated on the way by RotaryPagedAttention; quantized per
     * KV head into int8 pools) */
    float *kc = pools_i8 ? NULL : (float *)kct->data, *vc = pools_i8 ? NULL : (float *)vct->data;
    int8_t *kc8 = pools_i8 ? (int8_t *)kct->data : NULL, *vc8 = pools_i8 ? (int8_t *)vct->data : NULL;
    const size_t row_bytes = sizeof(float) * (size_t)(KVH * D);
    const float *cos_c = k->rope ? (const float *)in[2].data : NULL, *sin_c = k->rope ? (const float *)in[3].data : NULL;
    /* int8 pools and rotary: the step's rotated keys [T][KVH * D], quantized into the pool and read unquantized
     * by the step itself */
    float *rot = NULL;
    if (pools_i8 && pos && !(rot = (float *)malloc(sizeof(float) * (size_t)(T * KVH * D + 1)))) FAIL("out of memory");
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = cu[b]; t < cu[b + 1]; t++) {
            const int64_t p = past[b] + (t - cu[b]);
            const int64_t slot = (int64_t)bt[b * MB + p / BS] * BS + p % BS;
            const float *ks = ksrc + t * kv_stride, *vs = vsrc + t * kv_stride;
            if (pools_i8) {
                for (int64_t h = 0; h < KVH; h++) {
                    const int64_t at = (slot * KVH + h) * D;
                    if (pos) {
                        float *r = rot + (t * KVH + h) * D;
                        rope_row(r, ks + h * D, D, rdim, k->interleaved, cos_c + pos[t] * (rdim / 2),
                                 sin_c + pos[t] * (rdim / 2), 1.0f);
                        quant_row(kc8 + at, r, D, k_scale[h]);
                    } else {
                        quant_row(kc8 + at, ks + h * D, D, k_scale[h]);
                    }
                    quant_row(vc8 + at, vs + h * D, D, v_scale[h]);
                }
                continue;
            }
            if (pos) {
                const float *c = cos_c + pos[t] * (rdim / 2), *s = sin_c + pos[t] * (rdim / 2);
                for (int64_t h = 0; h < KVH; h++)
                    rope_row(kc + (slot * KVH + h) * D, ks + h * D, D, rdim, k->interleaved, c, s, 1.0f);
            } else {
                memcpy(kc + slot * KVH * D, ks, row_bytes);
            }
            memcpy(vc + slot * KVH * D, vs, row_bytes);
        }
    }

    const int64_t G = H / KVH;
    /* query tokens per tile: at most ROWS_TARGET rows, a multiple of NR rows where G allows */
    int64_t step = NR;
    while (step > 1 && (G * step) % (2 * NR) == 0) step /= 2;
    while (step > 1 && (G * (step / 2)) % NR == 0) step /= 2;
    int64_t qt = ROWS_TARGET / G / step * step;
    if (qt < 1) qt = ROWS_TARGET / G > 0 ? ROWS_TARGET / G : 1;
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) n_items += KVH * ((cu[b + 1] - cu[b] + qt - 1) / qt);
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(n_items > 0 ? n_items : 1));
    if (!items) {
        free(rot);
        FAIL("out of memory");
    }
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = cu[b + 1] - cu[b];
        for (int64_t q1 = len; q1 > 0; q1 -= qt) { /* last tiles (the longest) first */
            const int64_t q0 = q1 - qt > 0 ? q1 - qt : 0;
            for (int64_t g = 0; g < KVH; g++) items[n++] = (Item){(int32_t)b, (int32_t)g, (int32_t)q0, (int32_t)q1};
        }
    }
    Job job = {qsrc, q_stride, pos, cos_c, sin_c, rdim, k->interleaved, kc, vc, kc8, vc8, k_scale, v_scale,
               rot ? rot : ksrc, vsrc, rot ? KVH * D : kv_stride, kv_stride, cu, past, bt, out, MB, BS, H, KVH,
               D, G, k->window, k->scale * 1.4426950408889634f, items, 0};
    OrtKernelContextParallelForFn parallel_for =
        ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn);
    if (work >= k->inline_work && n_items > 1) {
        st = parallel_for(ctx, run_item_cb, (size_t)n_items, 0, &job);
    } else {
        for (int64_t i = 0; i < n_items; i++) run_item(&job, (size_t)i);
    }
    free(items);
    free(rot);
    if (st) return st;
    if (job.failed) {
        snprintf(msg, sizeof msg, "optimize.%s: out of memory for a work item's scratch", opname);
        return status(ORT_FAIL, msg);
    }
    return NULL;
}

/* ---- optimize.QuantizeRows ------------------------------------------------------------------------- */

typedef struct {
    const float *x;
    uint8_t *codes;
    float *scale;
    int64_t K, rows_per_item, rows;
} QuantJob;

HOT_CLONES
static void quantize_rows_item(void *arg, size_t index) {
    const QuantJob *job = (const QuantJob *)arg;
    const float inv_qmax = 1.0f / 127.0f, tiny = 1e-12f;
    const int64_t r0 = (int64_t)index * job->rows_per_item;
    const int64_t r1 = r0 + job->rows_per_item < job->rows ? r0 + job->rows_per_item : job->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = job->x + r * job->K;
        uint8_t *q = job->codes + r * job->K;
        v16f m = {0};
        int64_t k = 0;
        for (; k + VL <= job->K; k += VL) {
            const v16f v = vload(x + k);
            m = vmax(m, vselect(v < 0, -v, v));
        }
        float amax = hmax(m);
        for (; k < job->K; k++) amax = fmaxf(amax, fabsf(x[k]));
        const float sd = amax * inv_qmax;
        const float s = sd > tiny ? sd : tiny;
        job->scale[r] = s;
        /* QuantizeLinear(x / s, 1, 128): x / s is within [-127, 127] up to rounding, where adding and
         * subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even (the default rounding mode),
         * as nearbyintf does; then + 128 and saturation to [0, 255] */
        const v16f sv = vsplat(s), magic = vsplat(12582912.0f);
        for (k = 0; k + VL <= job->K; k += VL) {
            v16f v = ((vload(x + k) / sv + magic) - magic) + 128.0f;
            v = vmax(v, (v16f){0});
            v = vselect(v > 255.0f, vsplat(255.0f), v);
            const v16u8 c = __builtin_convertvector(__builtin_convertvector(v, v16i), v16u8);
            memcpy(q + k, &c, sizeof c);
        }
        for (; k < job->K; k++) {
            float v = nearbyintf(x[k] / s) + 128.0f;
            v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
            q[k] = (uint8_t)v;
        }
    }
}

/* input 0 of a one-input op on rows (QuantizeRows, SiluMul): a float32 tensor of rank 1 or more */
static OrtStatus *read_rows(OrtKernelContext *ctx, const char *opname, Tensor *x) {
    char msg[256];
    OrtStatus *st = read_input(ctx, 0, x);
    if (st) return st;
    if (x->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("x must be float32");
    if (x->rank < 1) FAIL("x must have rank 1 or more");
    return NULL;
}

static OrtStatus *quantize_rows_compute(OrtKernelContext *ctx) {
    Tensor x;
    OrtStatus *st = read_rows(ctx, QROWS_OP_NAME, &x);
    if (st) return st;
    int64_t rows = 1, K = x.dims[x.rank - 1];
    for (size_t i = 0; i + 1 < x.rank; i++) rows *= x.dims[i];
    int64_t scale_dims[4];
    memcpy(scale_dims, x.dims, sizeof scale_dims);
    scale_dims[x.rank - 1] = 1;
    OrtValue *codes_v = NULL, *scale_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, x.dims, x.rank, &codes_v)))
        return st;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 1, scale_dims, x.rank,
                                                                                   &scale_v)))
        return st;
    if (rows == 0) return NULL;
    QuantJob job = {(const float *)x.data, NULL, NULL, K, 0, rows};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(codes_v, (void **)&job.codes))) return st;
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(scale_v, (void **)&job.scale))) return st;
    /* items of at least 64K elements: a decode step's few rows run inline */
    job.rows_per_item = K > 0 ? ((1 << 16) + K - 1) / K : rows;
    if (job.rows_per_item < 1) job.rows_per_item = 1;
    const size_t items = (size_t)((rows + job.rows_per_item - 1) / job.rows_per_item);
    if (items > 1)
        return ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn)(ctx, quantize_rows_item, items, 0,
                                                                                      &job);
    quantize_rows_item(&job, 0);
    return NULL;
}

/* ---- optimize.MatMulBf16 ------------------------------------------------------------------------- */

/* y [.., N] = a [.., K] @ W [K, N] with W stored in bfloat16 and a rounded to bfloat16 on the way in
 * (round to nearest, ties to even), products summed in float32. W comes packed in panels of 16 columns,
 * each column's K values in pairs (k, k + 1): w [ceil(N / 16), ceil(K / 2), 16, 2] (compiler/fusion/
 * matmul_bf16.py packs it; zeros pad N and K), so one 64-byte load holds a pair of rows of 16 columns,
 * the operand layout of AVX-512 BF16's vdpbf16ps. Where the CPU has it the kernel multiplies with that
 * instruction (32 products per instruction, twice the float32 FMA's); elsewhere it widens the pairs to
 * float32 (a 16-bit shift) and uses FMA, the same products of the same bf16 values. Work items are
 * (64 rows, 32 columns): the columns' panel pair stays in L2 while the rows pass over it, 8 rows at a
 * time against two panels = 16 accumulators. */
#define BF_OP_NAME "MatMulBf16"
#define BF_MR 8     /* rows per register tile */
#define BF_MC 64    /* rows per work item */

typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

typedef struct {
    const float *a;
    uint16_t *a16;    /* a in bf16, [M][2 * KP] (KP pairs per row, the odd K padded with 0) */
    const uint32_t *w; /* [NP][KP][16] pairs */
    float *y;
    int64_t M, K, KP, N, NP, NC, rows_per_conv;
    int dp;
} BfJob;

/* float32 -> bfloat16 bits, round to nearest, ties to even (a NaN stays a NaN: its quiet bit is kept) */
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

HOT_CLONES
static void bf16_convert_rows(void *arg, size_t index) {
    const BfJob *job = (const BfJob *)arg;
    const int64_t r0 = (int64_t)index * job->rows_per_conv;
    const int64_t r1 = r0 + job->rows_per_conv < job->M ? r0 + job->rows_per_conv : job->M;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = job->a + r * job->K;
        uint16_t *o = job->a16 + r * 2 * job->KP;
        int64_t k = 0;
        for (; k + VL <= job->K; k += VL) {
            v16u32 u;
            memcpy(&u, x + k, sizeof u);
            const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
            const v16u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            const v16u32 quiet = (u >> 16) | 0x40u;
            const v16u16 b = __builtin_convertvector((v16u32)((nan & (v16i)quiet) | (~nan & (v16i)rounded)), v16u16);
            memcpy(o + k, &b, sizeof b);
        }
        for (; k < job->K; k++) o[k] = bf16_round(x[k]);
        if (job->K % 2) o[job->K] = 0;
    }
}

/* Store 16 columns of a row (fewer at the right edge of y). */
static inline void bf16_store(float *dst, v16f v, int64_t ncols) {
    if (ncols >= VL) {
        vstore(dst, v);
    } else if (ncols > 0) {
        float t[VL];
        vstore(t, v);
        memcpy(dst, t, sizeof(float) * (size_t)ncols);
    }
}

/* MR rows x two panels (32 columns) over all K, widening the bf16 pairs to float32: the portable path.
 * w1 may repeat w0 (an odd last panel); its columns are then not stored (ncols1 = 0). */
#define BF16_GENERIC(MR)                                                                                   \
    static inline __attribute__((always_inline)) void bf16_tile_fma_##MR(                                  \
        const uint32_t *a2, int64_t lda, const uint32_t *w0, const uint32_t *w1, int64_t KP, float *y,      \
        int64_t ldy, int64_t ncols0, int64_t ncols1) {                                                     \
        v16f acc0[MR], acc1[MR];                                                                           \
        for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = (v16f){0};                                        \
        for (int64_t kk = 0; kk < KP; kk++) {                                                              \
            v16u32 b0, b1;                                                                                 \
            memcpy(&b0, w0 + kk * VL, sizeof b0);                                                          \
            memcpy(&b1, w1 + kk * VL, sizeof b1);                                                          \
            const v16f e0 = (v16f)(b0 << 16), o0 = (v16f)(b0 & 0xffff0000u);                               \
            const v16f e1 = (v16f)(b1 << 16), o1 = (v16f)(b1 & 0xffff0000u);                               \
            for (int r = 0; r < MR; r++) {                                                                 \
                const uint32_t p = a2[r * lda + kk], pe = p << 16, po = p & 0xffff0000u;                    \
                float ae, ao;                                                                              \
                memcpy(&ae, &pe, sizeof ae);                                                               \
                memcpy(&ao, &po, sizeof ao);                                                               \
                acc0[r] += ae * e0 + ao * o0;                                                              \
                acc1[r] += ae * e1 + ao * o1;                                                              \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < MR; r++) {                                                                     \
            bf16_store(y + r * ldy, acc0[r], ncols0);                                                      \
            bf16_store(y + r * ldy + VL, acc1[r], ncols1);                                                 \
        }                                                                                                  \
    }
BF16_GENERIC(8)
BF16_GENERIC(4)
BF16_GENERIC(2)
BF16_GENERIC(1)

/* nr rows of a block: register tiles of 8 rows, then one of 4, 2 and 1 as the rest needs */
#define BF16_ROWS(PATH)                                                                                     \
    do {                                                                                                   \
        int64_t r = 0;                                                                                     \
        for (; r + 8 <= nr; r += 8)                                                                        \
            bf16_tile_##PATH##_8(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);                 \
        for (int64_t mr = 4; mr >= 1; mr /= 2) {                                                           \
            if (nr - r < mr) continue;                                                                     \
            if (mr == 4) bf16_tile_##PATH##_4(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);    \
            if (mr == 2) bf16_tile_##PATH##_2(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);    \
            if (mr == 1) bf16_tile_##PATH##_1(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);    \
            r += mr;                                                                                       \
        }                                                                                                  \
    } while (0)

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define BF16_DP_TARGET __attribute__((target("avx512f,avx512bf16")))
/* The same tile with vdpbf16ps: acc += a_pair . w_pair per lane (two products per float32 lane). */
#define BF16_DP(MR)                                                                                        \
    static inline __attribute__((always_inline)) BF16_DP_TARGET void bf16_tile_dp_##MR(                    \
        const uint32_t *a2, int64_t lda, const uint32_t *w0, const uint32_t *w1, int64_t KP, float *y,      \
        int64_t ldy, int64_t ncols0, int64_t ncols1) {                                                     \
        __m512 acc0[MR], acc1[MR];                                                                         \
        for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();                              \
        for (int64_t kk = 0; kk < KP; kk++) {                                                              \
            const __m512i b0 = _mm512_loadu_si512((const void *)(w0 + kk * VL));                           \
            const __m512i b1 = _mm512_loadu_si512((const void *)(w1 + kk * VL));                           \
            for (int r = 0; r < MR; r++) {                                                                 \
                const __m512i a = _mm512_set1_epi32((int)a2[r * lda + kk]);                                \
                acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)a, (__m512bh)b0);                            \
                acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)a, (__m512bh)b1);                            \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < MR; r++) {                                                                     \
            v16f t0, t1;                                                                                   \
            memcpy(&t0, &acc0[r], sizeof t0);                                                              \
            memcpy(&t1, &acc1[r], sizeof t1);                                                              \
            bf16_store(y + r * ldy, t0, ncols0);                                                           \
            bf16_store(y + r * ldy + VL, t1, ncols1);                                                      \
        }                                                                                                  \
    }
BF16_DP(8)
BF16_DP(4)
BF16_DP(2)
BF16_DP(1)

BF16_DP_TARGET
static void bf16_rows_dp(const uint32_t *a2, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                         int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    BF16_ROWS(dp);
}

static int bf16_cpu_has_dp(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}
#else
static void bf16_rows_dp(const uint32_t *a2, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                         int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    (void)a2; (void)lda; (void)nr; (void)w0; (void)w1; (void)KP; (void)y; (void)ldy; (void)c0; (void)c1;
}
static int bf16_cpu_has_dp(void) { return 0; }
#endif

HOT_CLONES
static void bf16_rows_fma(const uint32_t *a2, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                          int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    BF16_ROWS(fma);
}

/* item = (row block, panel pair), row block major: a thread's consecutive items share their rows */
static void bf16_item(void *arg, size_t index) {
    const BfJob *job = (const BfJob *)arg;
    const int64_t mi = (int64_t)index / job->NC, ci = (int64_t)index % job->NC;
    const int64_t m0 = mi * BF_MC, nr = job->M - m0 < BF_MC ? job->M - m0 : BF_MC;
    const int64_t p0 = 2 * ci, has1 = p0 + 1 < job->NP;
    const uint32_t *w0 = job->w + p0 * job->KP * VL, *w1 = has1 ? w0 + job->KP * VL : w0;
    const int64_t n0 = p0 * VL;
    const int64_t c0 = job->N - n0 < VL ? job->N - n0 : VL;
    const int64_t c1 = has1 ? (job->N - n0 - VL < VL ? job->N - n0 - VL : VL) : 0;
    const uint32_t *a2 = (const uint32_t *)(const void *)(job->a16 + m0 * 2 * job->KP);
    float *y = job->y + m0 * job->N + n0;
    if (job->dp)
        bf16_rows_dp(a2, job->KP, nr, w0, w1, job->KP, y, job->N, c0, c1);
    else
        bf16_rows_fma(a2, job->KP, nr, w0, w1, job->KP, y, job->N, c0, c1);
}

static OrtStatus *matmul_bf16_compute(const Kernel *kern, OrtKernelContext *ctx) {
    const char *opname = BF_OP_NAME;
    char msg[256];
    Tensor a, w;
    OrtStatus *st = read_input(ctx, 0, &a);
    if (!st) st = read_input(ctx, 1, &w);
    if (st) return st;
    if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("a must be float32");
    if (w.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) FAIL("w must be bfloat16");
    if (a.rank < 1) FAIL("a must have rank 1 or more");
    const int64_t K = a.dims[a.rank - 1], N = kern->n_out, KP = (K + 1) / 2, NP = (N + VL - 1) / VL;
    if (w.rank != 4 || w.dims[0] != NP || w.dims[1] != KP || w.dims[2] != VL || w.dims[3] != 2)
        FAIL("w must be packed as [ceil(N / 16) = %lld, ceil(K / 2) = %lld, 16, 2] for K = %lld, N = %lld",
             (long long)NP, (long long)KP, (long long)K, (long long)N);
    int64_t M = 1, out_dims[4];
    for (size_t i = 0; i + 1 < a.rank; i++) {
        M *= a.dims[i];
        out_dims[i] = a.dims[i];
    }
    out_dims[a.rank - 1] = N;
    OrtValue *out_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, a.rank, &out_v)))
        return st;
    if (M == 0 || N == 0) return NULL;
    BfJob job = {(const float *)a.data, NULL, (const uint32_t *)w.data, NULL, M, K, KP, N, NP, (NP + 1) / 2, 0,
                 kern->bf16_dp};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(out_v, (void **)&job.y))) return st;
    if (K == 0) {
        memset(job.y, 0, sizeof(float) * (size_t)(M * N));
        return NULL;
    }
    job.a16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * 2 * KP));
    if (!job.a16) FAIL("out of memory for the bfloat16 copy of a [%lld, %lld]", (long long)M, (long long)K);
    OrtKernelContextParallelForFn parallel_for =
        ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn);
    job.rows_per_conv = ((1 << 16) + K - 1) / K;
    const size_t conv_items = (size_t)((M + job.rows_per_conv - 1) / job.rows_per_conv);
    if (conv_items > 1)
        st = parallel_for(ctx, bf16_convert_rows, conv_items, 0, &job);
    else
        bf16_convert_rows(&job, 0);
    const size_t items = (size_t)(((M + BF_MC - 1) / BF_MC) * job.NC);
    /* below ~64K multiply-adds the fork/join costs more than it saves */
    if (!st && items > 1 && M * K * N >= (1 << 16))
        st = parallel_for(ctx, bf16_item, items, 0, &job);
    else if (!st)
        for (size_t i = 0; i < items; i++) bf16_item(&job, i);
    free(job.a16);
    return st;
}

/* ---- optimize.SiluMul ----------------------------------------------------------------------------- */

/* y [.., I] = silu(x[.., :I]) * x[.., I:] for x [.., 2I]: a SwiGLU MLP's Split + QuickGelu(alpha 1) + Mul in
 * one pass over the fused gate/up projection's output (compiler/fusion/swiglu.py). silu(g) = g * sigmoid(g)
 * with sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (vexp2_neg, ~2 ulp), so
 * neither branch overflows. Rows of a decode step run inline; long prefills split into items of 64K
 * elements on ONNX Runtime's pool. */
#define SM_OP_NAME "SiluMul"

typedef struct {
    const float *x;
    float *y;
    int64_t I, rows_per_item, rows;
} SmJob;

static inline v16f vsilu_mul(v16f g, v16f u) {
    const v16f a = vselect(g < 0, -g, g);
    const v16f e = vexp2_neg(a * -1.4426950408889634f);
    const v16f sig = vselect(g < 0, e, vsplat(1.0f)) / (e + 1.0f);
    return g * sig * u;
}

HOT_CLONES
static void silu_mul_item(void *arg, size_t index) {
    const SmJob *job = (const SmJob *)arg;
    const int64_t I = job->I, r0 = (int64_t)index * job->rows_per_item;
    const int64_t r1 = r0 + job->rows_per_item < job->rows ? r0 + job->rows_per_item : job->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = job->x + r * 2 * I, *u = g + I;
        float *y = job->y + r * I;
        int64_t k = 0;
        for (; k + VL <= I; k += VL) vstore(y + k, vsilu_mul(vload(g + k), vload(u + k)));
        if (k < I) { /* the last partial vector, through zero-padded lanes: the same arithmetic */
            float tg[VL] = {0}, tu[VL] = {0}, ty[VL];
            memcpy(tg, g + k, sizeof(float) * (size_t)(I - k));
            memcpy(tu, u + k, sizeof(float) * (size_t)(I - k));
            vstore(ty, vsilu_mul(vload(tg), vload(tu)));
            memcpy(y + k, ty, sizeof(float) * (size_t)(I - k));
        }
    }
}

static OrtStatus *silu_mul_compute(OrtKernelContext *ctx) {
    const char *opname = SM_OP_NAME;
    char msg[256];
    Tensor x;
    OrtStatus *st = read_rows(ctx, opname, &x);
    if (st) return st;
    const int64_t last = x.dims[x.rank - 1];
    if (last % 2) FAIL("x's last dimension (%lld) must be even: gate and up halves", (long long)last);
    int64_t rows = 1, out_dims[4];
    for (size_t i = 0; i + 1 < x.rank; i++) {
        rows *= x.dims[i];
        out_dims[i] = x.dims[i];
    }
    out_dims[x.rank - 1] = last / 2;
    OrtValue *y_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, x.rank, &y_v)))
        return st;
    if (rows == 0 || last == 0) return NULL;
    SmJob job = {(const float *)x.data, NULL, last / 2, 0, rows};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(y_v, (void **)&job.y))) return st;
    job.rows_per_item = ((1 << 16) + last - 1) / last;
    const size_t items = (size_t)((rows + job.rows_per_item - 1) / job.rows_per_item);
    if (items > 1)
        return ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn)(ctx, silu_mul_item, items, 0,
                                                                                      &job);
    silu_mul_item(&job, 0);
    return NULL;
}

/* ---- the OrtCustomOp callbacks ----------------------------------------------------------------------- */

static OrtCustomOp g_op, g_rope_op, g_qrows_op, g_bf16_op, g_sm_op; /* defined below */

static OrtStatus *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)api;
    char msg[256];
    Kernel *k = (Kernel *)calloc(1, sizeof(Kernel));
    if (!k) return status(ORT_FAIL, "optimize.PagedAttention: out of memory");
    k->rope = op == &g_rope_op;
    k->qrows = op == &g_qrows_op;
    k->bf16 = op == &g_bf16_op;
    k->silu_mul = op == &g_sm_op;
    if (k->qrows || k->silu_mul) {
        *out = k;
        return NULL;
    }
    if (k->bf16) {
        OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
            info, "n", &k->n_out);
        if (!st && k->n_out < 0) st = status(ORT_INVALID_ARGUMENT, "optimize.MatMulBf16: n must not be negative");
        if (st) {
            free(k);
            return st;
        }
        /* OPTIMIZE_BF16_DOT=0 takes the FMA path on a CPU with AVX-512 BF16 (tests compare the two) */
        const char *env = getenv("OPTIMIZE_BF16_DOT");
        k->bf16_dp = bf16_cpu_has_dp() && !(env && strcmp(env, "0") == 0);
        *out = k;
        return NULL;
    }
    const char *opname = k->rope ? ROPE_OP_NAME : OP_NAME;
    OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "num_heads", &k->num_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "kv_num_heads", &k->kv_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_float, OrtKernelInfoGetAttributeFloatFn)(
        info, "scale", &k->scale);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "local_window_size", &k->window);
    if (!st && k->rope) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "rotary_embedding_dim", &k->rotary_dim);
    if (!st && k->rope) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "interleaved", &k->interleaved);
    if (!st && (k->num_heads <= 0 || k->kv_heads <= 0 || k->num_heads % k->kv_heads)) {
        snprintf(msg, sizeof msg, "optimize.%s: num_heads %lld must be a positive multiple of "
                 "kv_num_heads %lld", opname, (long long)k->num_heads, (long long)k->kv_heads);
        st = status(ORT_INVALID_ARGUMENT, msg);
    }
    if (!st && (k->rotary_dim < 0 || k->rotary_dim % 2 || (k->interleaved != 0 && k->interleaved != 1))) {
        snprintf(msg, sizeof msg, "optimize.%s: rotary_embedding_dim %lld must be even and not negative, "
                 "interleaved %lld 0 or 1", opname, (long long)k->rotary_dim, (long long)k->interleaved);
        st = status(ORT_INVALID_ARGUMENT, msg);
    }
    if (st) {
        free(k);
        return st;
    }
    /* OPTIMIZE_PAGED_CPU_INLINE_WORK overrides the threshold (0: always the thread pool; tests use it) */
    const char *env = getenv("OPTIMIZE_PAGED_CPU_INLINE_WORK");
    k->inline_work = env && *env ? strtoll(env, NULL, 10) : INLINE_WORK;
    *out = k;
    return NULL;
}

static void *create_kernel_v1(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    void *k = NULL;
    OrtStatus *st = create_kernel(op, api, info, &k);
    if (st) ORT_FN(g_api, ReleaseStatus, OrtReleaseStatusFn)(st);
    return k;
}

static void compute_v1(void *op_kernel, OrtKernelContext *ctx) {
    OrtStatus *st = compute(op_kernel, ctx);
    if (st) ORT_FN(g_api, ReleaseStatus, OrtReleaseStatusFn)(st);
}

static void destroy_kernel(void *op_kernel) { free(op_kernel); }
static const char *op_name(const OrtCustomOp *op) {
    return op == &g_rope_op    ? ROPE_OP_NAME
           : op == &g_qrows_op ? QROWS_OP_NAME
           : op == &g_bf16_op  ? BF_OP_NAME
           : op == &g_sm_op    ? SM_OP_NAME
                               : OP_NAME;
}
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static const char *op_types(const OrtCustomOp *op) {
    return op == &g_rope_op ? ROPE_TYPES : op == &g_qrows_op || op == &g_sm_op ? "F" : op == &g_bf16_op ? "FB" : PLAIN_TYPES;
}
static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) { return type_of(op_types(op)[i]); }
static size_t input_count(const OrtCustomOp *op) { return strlen(op_types(op)); }
static ONNXTensorElementDataType output_type(const OrtCustomOp *op, size_t i) {
    /* QuantizeRows: (codes uint8, scale float32); the attention ops: output float32 */
    return op == &g_qrows_op && i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t output_count(const OrtCustomOp *op) { return op == &g_qrows_op ? 2 : 1; }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) {
    (void)op; (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
/* the attention ops' k_scale and v_scale (their last two inputs) are optional: int8 pools only */
static OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp *op, size_t i) {
    const int attention = op == &g_op || op == &g_rope_op;
    return attention && i + N_SCALES >= input_count(op) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtMemType input_mem(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return OrtMemTypeDefault; }
static int one(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return INT_MAX; }
static size_t no_pairs(int **in, int **out) { *in = NULL; *out = NULL; return 0; }
static void release_pairs(int *in, int *out) { (void)in; (void)out; }

#define CUSTOM_OP                                                                                          \
    {                                                                                                      \
        ORT_API_VERSION_USED, create_kernel_v1, op_name, op_provider, input_type, input_count, output_type,  \
        output_count, compute_v1, destroy_kernel, input_characteristic, required, input_mem, one, one, one, one, \
        create_kernel, compute, NULL, start_version, end_version, no_pairs, release_pairs, no_pairs,         \
        release_pairs,                                                                                     \
    }
static OrtCustomOp g_op = CUSTOM_OP;
static OrtCustomOp g_rope_op = CUSTOM_OP; /* told apart by their addresses */
static OrtCustomOp g_qrows_op = CUSTOM_OP;
static OrtCustomOp g_bf16_op = CUSTOM_OP;
static OrtCustomOp g_sm_op = CUSTOM_OP;

/* ONNX Runtime's entry point for SessionOptions.register_custom_ops_library. */
__attribute__((visibility("default")))
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *api_base) {
    if (!g_api) {
        const OrtApi *api = api_base->GetApi(ORT_API_VERSION_USED);
        if (!api) {
            /* every runtime serves version 1 of the table, whose slot 0 is CreateStatus */
            char msg[160];
            snprintf(msg, sizeof msg, "optimize.PagedAttention: ONNX Runtime %s is older than API version %d "
                     "(onnxruntime 1.%d)", api_base->GetVersionString(), ORT_API_VERSION_USED, ORT_API_VERSION_USED);
            return ORT_FN(api_base->GetApi(1), CreateStatus, OrtCreateStatusFn)(ORT_FAIL, msg);
        }
        const char *info = ORT_FN(api, GetBuildInfoString, OrtGetBuildInfoStringFn)();
        if (!info || strncmp(info, "ORT Build Info", 14) != 0)
            return ORT_FN(api, CreateStatus, OrtCreateStatusFn)(
                ORT_FAIL, "optimize.PagedAttention: the OrtApi table's layout is not the one this library declares");
        g_api = api;
    }
    OrtStatus *st = NULL;
    if (!g_domain) {
        if ((st = ORT_FN(g_api, CreateCustomOpDomain, OrtCreateCustomOpDomainFn)(DOMAIN, &g_domain))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_rope_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_qrows_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_bf16_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_sm_op))) return st;
    }
    return ORT_FN(g_api, AddCustomOpDomain, OrtAddCustomOpDomainFn)(options, g_domain);
}
