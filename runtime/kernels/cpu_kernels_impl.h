/* One code path of the library's hot loops (cpu_kernels.h), written for VL float lanes per register.
 *
 * Included once by each isa_*.c file, which defines VL (16, 8 or 4), ISA_NAME and KERNELS_TABLE and sets
 * the instruction set with #pragma GCC target before including it. The arithmetic is GCC/Clang vector
 * extensions on vectors of exactly one register, so each path's loops are laid out for its registers
 * (a 16-lane vector is never split into two AVX2 or four SSE registers); the blocking that depends on
 * the register count (accumulators per tile) is chosen per VL below. Loads and stores go through memcpy
 * (unaligned, no aliasing UB). gnu11 lets GCC contract a * b + c into one FMA where the target has it.
 */
#ifndef VL
#error "define VL, ISA_NAME and KERNELS_TABLE before including cpu_kernels_impl.h"
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));
typedef uint16_t vu16 __attribute__((vector_size(2 * VL)));
typedef uint8_t vu8 __attribute__((vector_size(VL)));
typedef int8_t vi8 __attribute__((vector_size(VL)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* x in every lane (x - 0 is x for every x, -0 included, so the subtraction folds away; x + 0 would not) */
static inline vf vsplat(float x) { return x - (vf){0}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline vf vadd(vf a, vf b) { return a + b; }

#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Lane permutations per width: IOTA (0, 1, ...), XORh (lane i <- lane i ^ h) for the horizontal reductions,
 * and for scores(): the transposing reduction tree's masks (level h: lanes of block parity 0 from the first
 * vector, 1 from the second; A keeps a block, B takes its neighbour) and the bit-reversed order that the
 * tree's own lane order undoes. */
#if VL == 16
#define IOTA 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#define HREDUCE(OP, v)                                                                  \
    v = OP(v, SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));          \
    v = OP(v, SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));          \
    v = OP(v, SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));          \
    v = OP(v, SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#define BITREV 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15
#define TREE(a)                                                                                               \
    TREE_LEVEL(a, 8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                                \
               (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));                               \
    TREE_LEVEL(a, 4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),                              \
               (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));                                 \
    TREE_LEVEL(a, 2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),                              \
               (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));                                 \
    TREE_LEVEL(a, 1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),                             \
               (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define UR_BLOCKS 4 /* update_rows: vectors of the head dimension per pass (4 rows x 4 = 16 accumulators) */
#define LANE_RG 3   /* attend_lanes: groups of VL query rows per pass (RG x KB and RG x DBLK tiles) */
#define LANE_KB 8   /* attend_lanes: keys per score tile (3 x 8 = 24 accumulators of 32 zmm registers) */
#define LANE_DBLK 8 /* attend_lanes: head-dimension entries per value tile (3 x 8 = 24 accumulators) */
#define LANE_CK 16  /* attend_lanes: keys per chunk (one online-softmax update), a multiple of VL */
#define BF_NPAN 2   /* MatMulBf16 tiles: panels (16 columns each) per tile */
#define BF_MR 8     /* MatMulBf16 tiles: rows per register tile (8 x 2 accumulators) */
#define BF_UNROLL 2 /* MatMulBf16 single-row tile: K pairs per step (independent accumulators) */
#elif VL == 8
#define IOTA 0, 1, 2, 3, 4, 5, 6, 7
#define HREDUCE(OP, v)                                  \
    v = OP(v, SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3));         \
    v = OP(v, SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5));         \
    v = OP(v, SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6))
#define BITREV 0, 4, 2, 6, 1, 5, 3, 7
#define TREE(a)                                                                                 \
    TREE_LEVEL(a, 4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15));                 \
    TREE_LEVEL(a, 2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15));                 \
    TREE_LEVEL(a, 1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#define UR_BLOCKS 2 /* 4 rows x 2 = 8 accumulators + 2 value vectors of 16 ymm registers */
#define LANE_RG 3   /* 3 x 4 = 12 accumulators + 3 query vectors + a broadcast of 16 ymm registers */
#define LANE_KB 4
#define LANE_DBLK 4
#define LANE_CK 16
#define BF_NPAN 1   /* one panel = 2 vectors per row */
#define BF_MR 4     /* 4 rows x 2 = 8 accumulators, 4 widened weight vectors, 2 broadcasts */
#define BF_UNROLL 2
#elif VL == 4
#define IOTA 0, 1, 2, 3
#define HREDUCE(OP, v)                          \
    v = OP(v, SHUF(v, 2, 3, 0, 1));             \
    v = OP(v, SHUF(v, 1, 0, 3, 2))
#define BITREV 0, 2, 1, 3
#define TREE(a)                                                         \
    TREE_LEVEL(a, 2, (0, 1, 4, 5), (2, 3, 6, 7));                       \
    TREE_LEVEL(a, 1, (0, 4, 2, 6), (1, 5, 3, 7))
#define UR_BLOCKS 2
#define LANE_RG 2
#define LANE_KB 4
#define LANE_DBLK 4
#define LANE_CK 8
#define BF_NPAN 1   /* one panel = 4 vectors per row */
#define BF_MR 2
#define BF_UNROLL 1
#else
#error "VL must be 16, 8 or 4"
#endif
_Static_assert(ROWS_TARGET % (LANE_RG * VL) == 0, "an attention work item is whole lanes passes");

#define UNPAREN(...) __VA_ARGS__
/* one level of the tree: a[i] = the pairwise sums of a[2i] and a[2i + 1] (in place, ascending) */
#define TREE_LEVEL(a, n, MA, MB)                                                                    \
    for (int i_ = 0; i_ < (n); i_++)                                                                \
    a[i_] = SHUF2(a[2 * i_], a[2 * i_ + 1], UNPAREN MA) + SHUF2(a[2 * i_], a[2 * i_ + 1], UNPAREN MB)

static inline float hsum(vf v) {
    HREDUCE(vadd, v);
    return v[0];
}

static inline float hmax(vf v) {
    HREDUCE(vmax, v);
    return v[0];
}

/* 2^x for x <= 0 (x = -inf and x <= -126 give 0): Cephes exp2f's polynomial on [-0.5, 0.5] (~2 ulp). */
static inline vf vexp2_neg(vf x) {
    const vi tiny = x <= -126.0f;
    x = vmax(x, vsplat(-126.0f));
    const vf xr = x + 0.5f;
    vi n = __builtin_convertvector(xr, vi);          /* toward zero */
    n = n + (__builtin_convertvector(n, vf) > xr);   /* floor: -1 where truncation went up */
    const vf f = x - __builtin_convertvector(n, vf); /* [-0.5, 0.5] */
    vf p = vsplat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const vf r = p * (vf)((n + 127) << 23);
    return (vf)((vi)r & ~tiny);
}

static inline float exp2_neg(float x) { return vexp2_neg(vsplat(x))[0]; }

/* ==== attention ========================================================================================== */

/* float32 rows: the pools, or a chunk's dequantized scratch */
#define ROW_T float
#define ROW_LOAD(p) vload(p)
#define SCORES scores
#define UPDATE_ROWS update_rows
#include "cpu_kernels_rows.h"
#undef ROW_T
#undef ROW_LOAD
#undef SCORES
#undef UPDATE_ROWS

/* VL int8 codes widened to float32 (exact). GCC's vector extensions turn an int8 -> int32 or -> float
 * conversion into one scalar conversion per lane, so on x86 the sign extension is written with the
 * instruction set's own intrinsics: one vpmovsxbd (AVX-512, AVX2) or two unpacks and a shift (SSE2), then
 * one int32 -> float conversion. */
#if defined(__x86_64__) && VL == 16
static inline vf vload_i8(const int8_t *p) {
    const __m128i c = _mm_loadu_si128((const __m128i *)(const void *)p);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
}
#elif defined(__x86_64__) && VL == 8
static inline vf vload_i8(const int8_t *p) {
    const __m128i c = _mm_loadl_epi64((const __m128i *)(const void *)p);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
}
#elif defined(__x86_64__) && VL == 4
static inline vf vload_i8(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    __m128i w = _mm_cvtsi32_si128(four);
    w = _mm_unpacklo_epi8(w, w);                    /* each byte twice */
    w = _mm_srai_epi32(_mm_unpacklo_epi16(w, w), 24); /* four times: its int32's top byte, shifted down */
    return (vf)_mm_cvtepi32_ps(w);
}
#else
static inline vf vload_i8(const int8_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = (float)p[i];
    return v;
}
#endif

/* int8 rows: an int8 pool's codes, in place */
#define ROW_T int8_t
#define ROW_LOAD(p) vload_i8(p)
#define SCORES scores_i8
#define UPDATE_ROWS update_rows_i8
#include "cpu_kernels_rows.h"
#undef ROW_T
#undef ROW_LOAD
#undef SCORES
#undef UPDATE_ROWS

/* dst[0:D] = codes * scale (DequantizeLinear with zero point 0) */
static inline void dequant_row(float *dst, const int8_t *src, int64_t D, float scale) {
    int64_t d = 0;
    for (; d + VL <= D; d += VL) vstore(dst + d, vload_i8(src + d) * scale);
    for (; d < D; d++) dst[d] = (float)src[d] * scale;
}

/* rows[jj] = the pool row (element offset: [block][slot][kv head][D]) of key j0 + jj of sequence seq, jj < nk,
 * walking the block table with one division per chunk */
static inline void pool_rows(const Job *job, int64_t seq, int64_t kv_head, int64_t j0, int64_t nk, int64_t *rows) {
    const int64_t BS = job->block_size, KVH = job->kv_heads, D = job->head_dim;
    const int32_t *table = job->bt + seq * job->max_blocks;
    int64_t blk = j0 / BS, off = j0 % BS;
    for (int64_t jj = 0; jj < nk; jj++) {
        rows[jj] = (((int64_t)table[blk] * BS + off) * KVH + kv_head) * D;
        if (++off == BS) {
            off = 0;
            blk++;
        }
    }
}

/* krow/vrow[jj] = the rows of keys j0 + jj (jj < nk; the rest repeat key j0's): the pools', or with int8
 * pools the step's own float32 rows and the past's dequantized into the item's scratch */
static inline void chunk_rows(const Job *job, int64_t seq, int64_t kv_head, int64_t j0, int64_t nk,
                              const float **krow, const float **vrow, float *kbuf, float *vbuf) {
    const int64_t D = job->head_dim, past = job->past[seq];
    int64_t rows[VL];
    pool_rows(job, seq, kv_head, j0, nk, rows);
    for (int64_t jj = 0; jj < nk; jj++) {
        if (job->kc8 && j0 + jj >= past) { /* int8 pools, a key of this step: its float32 row */
            const int64_t t = job->cu[seq] + (j0 + jj - past);
            krow[jj] = job->kstep + t * job->kstep_stride + kv_head * D;
            vrow[jj] = job->vstep + t * job->vstep_stride + kv_head * D;
        } else if (job->kc8) { /* int8 pools, a past key: dequantized into the item's scratch (code * scale) */
            float *kd = kbuf + jj * D, *vd = vbuf + jj * D;
            dequant_row(kd, job->kc8 + rows[jj], D, job->k_scale[kv_head]);
            dequant_row(vd, job->vc8 + rows[jj], D, job->v_scale[kv_head]);
            krow[jj] = kd;
            vrow[jj] = vd;
        } else {
            krow[jj] = job->kc + rows[jj];
            vrow[jj] = job->vc + rows[jj];
        }
    }
    for (int64_t jj = nk; jj < VL; jj++) {
        krow[jj] = krow[0];
        vrow[jj] = vrow[0];
    }
}

/* krow8/vrow8[jj] = an int8 pool's code rows of past keys j0 + jj (jj < nk; the rest repeat key j0's) */
static inline void chunk_rows_i8(const Job *job, int64_t seq, int64_t kv_head, int64_t j0, int64_t nk,
                                 const int8_t **krow, const int8_t **vrow) {
    int64_t rows[VL];
    rows[0] = 0; /* nk >= 1: pool_rows sets it; said so for the compiler */
    pool_rows(job, seq, kv_head, j0, nk, rows);
    for (int64_t jj = 0; jj < VL; jj++) {
        krow[jj] = job->kc8 + rows[jj < nk ? jj : 0];
        vrow[jj] = job->vc8 + rows[jj < nk ? jj : 0];
    }
}

/* Ask for the pool rows of keys j0 .. j0 + nk - 1 (K and V, every cache line of each row) ahead of their
 * use: a decode step reads each sequence's K/V once, from memory rather than cache, and one KV head's rows
 * are KVH * D elements apart in the pool, so the hardware prefetcher alone leaves the loads waiting. The
 * rows asked for are the pool's (int8 pools: the codes; a step's own keys there are read from the step,
 * and asking for their pool rows is harmless: a prefetch never faults). */
#define PF_NEXT(left) ((left) < VL ? (left) : VL)
static inline void prefetch_rows(const Job *job, int64_t seq, int64_t kv_head, int64_t j0, int64_t nk) {
    const int64_t esize = job->kc8 ? 1 : 4, bytes = job->head_dim * esize;
    const char *kbase = job->kc8 ? (const char *)job->kc8 : (const char *)job->kc;
    const char *vbase = job->kc8 ? (const char *)job->vc8 : (const char *)job->vc;
    int64_t rows[VL];
    pool_rows(job, seq, kv_head, j0, nk, rows);
    for (int64_t jj = 0; jj < nk; jj++)
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(kbase + rows[jj] * esize + b, 0, 3);
            __builtin_prefetch(vbase + rows[jj] * esize + b, 0, 3);
        }
}

/* Many query rows (prefill tiles): the rows in the vector lanes, RG groups of VL rows per pass. Q is
 * transposed once per pass (Qt [D][RG][VL]), so a key chunk's scores are s[g][jj] = sum_d Qt[d][g] *
 * k_jj[d]: each broadcast key element feeds RG multiply-adds, in register tiles of RG x LANE_KB
 * accumulators (independent chains, enough to keep both FMA pipes busy). The softmax runs per lane with
 * no horizontal reductions, and the weighted values accumulate into Ot [D][RG][VL] in tiles of RG x
 * LANE_DBLK (a broadcast value element per RG multiply-adds). Rows g0 .. g0 + RG * VL - 1 of the item's
 * scratch Q [R][Dp] (scaled, rotated; rows past R are padding, their results dropped); the result goes
 * to out. kbuf/vbuf: the item's [LANE_CK][D] scratch for an int8 pool's dequantized rows (chunk_rows). */
static inline __attribute__((always_inline)) void lanes_pass(const Job *job, const Item it, const float *Q,
                                                             int64_t Dp, int64_t R, int64_t g0, const int RG,
                                                             float *scratch, float *kbuf, float *vbuf) {
    const int64_t D = job->head_dim, G = job->group;
    const int64_t H = job->num_heads, past = job->past[it.seq], row0 = job->cu[it.seq];
    const int64_t window = job->window;
    float *Qt = scratch, *Ot = Qt + D * LANE_RG * VL;
    const float *krow[LANE_CK], *vrow[LANE_CK];
    const int64_t nr = R - g0 < RG * VL ? R - g0 : RG * VL; /* real rows of this pass */
    for (int64_t d = 0; d < D; d++)
        for (int64_t r = 0; r < RG * VL; r++) Qt[d * RG * VL + r] = r < nr ? Q[(g0 + r) * Dp + d] : 0.0f;
    memset(Ot, 0, sizeof(float) * (size_t)(D * RG * VL));
    /* each lane's position; padding lanes repeat the last row's (their results are dropped) */
    vi prow[LANE_RG], lo_row[LANE_RG];
    int64_t gmin[LANE_RG], gmax[LANE_RG];
    for (int g = 0; g < RG; g++) {
        int32_t pos_arr[VL];
        for (int64_t r = 0; r < VL; r++) {
            const int64_t rr = g * VL + r < nr ? g * VL + r : nr - 1;
            pos_arr[r] = (int32_t)(past + it.q0 + (g0 + rr) / G);
        }
        memcpy(&prow[g], pos_arr, sizeof prow[g]);
        lo_row[g] = window > 0 ? prow[g] - (int32_t)(window - 1) : (vi){0};
        gmin[g] = pos_arr[0];
        gmax[g] = pos_arr[VL - 1];
    }
    const int64_t p_min = gmin[0], p_max = gmax[RG - 1];
    int64_t k_begin = window > 0 ? p_min - window + 1 : 0;
    if (k_begin < 0) k_begin = 0;
    vf m[LANE_RG], l[LANE_RG];
    for (int g = 0; g < RG; g++) {
        m[g] = vsplat(-INFINITY);
        l[g] = (vf){0};
    }
    vf sc[LANE_RG][LANE_CK];
    for (int64_t j0 = k_begin; j0 <= p_max; j0 += LANE_CK) {
        const int64_t nk = (p_max - j0 + 1) < LANE_CK ? (p_max - j0 + 1) : LANE_CK;
        /* the chunk's rows, VL keys at a time (keys past nk repeat key j0's: scored, then masked) */
        for (int64_t c = 0; c < LANE_CK; c += VL) {
            if (c < nk)
                chunk_rows(job, it.seq, it.kv_head, j0 + c, nk - c < VL ? nk - c : VL, krow + c, vrow + c,
                           kbuf + c * D, vbuf + c * D);
            else
                for (int64_t jj = c; jj < c + VL; jj++) {
                    krow[jj] = krow[0];
                    vrow[jj] = vrow[0];
                }
        }
        for (int64_t c = LANE_CK; c < 2 * LANE_CK && j0 + c <= p_max; c += VL)
            prefetch_rows(job, it.seq, it.kv_head, j0 + c, PF_NEXT(p_max - j0 - c + 1));
        for (int kb = 0; kb < LANE_CK; kb += LANE_KB) {
            vf acc[LANE_RG][LANE_KB];
            for (int g = 0; g < RG; g++)
                for (int k = 0; k < LANE_KB; k++) acc[g][k] = (vf){0};
            for (int64_t d = 0; d < D; d++) {
                vf q[LANE_RG];
                for (int g = 0; g < RG; g++) q[g] = vload(Qt + (d * RG + g) * VL);
                for (int k = 0; k < LANE_KB; k++) {
                    const vf b = vsplat(krow[kb + k][d]);
                    for (int g = 0; g < RG; g++) acc[g][k] += q[g] * b;
                }
            }
            for (int g = 0; g < RG; g++)
                for (int k = 0; k < LANE_KB; k++) sc[g][kb + k] = acc[g][k];
        }
        vf alpha[LANE_RG];
        for (int g = 0; g < RG; g++) {
            /* mask keys a lane may not see: past its position, before its window, beyond the chunk */
            const int full = j0 + nk - 1 <= gmin[g] && (window <= 0 || j0 >= gmax[g] - window + 1) && nk == LANE_CK;
            vf mx = vsplat(-INFINITY);
            for (int64_t jj = 0; jj < LANE_CK; jj++) {
                if (!full) {
                    const int32_t j = (int32_t)(j0 + jj);
                    const vi ok = (prow[g] >= j) & (lo_row[g] <= j) & (jj < nk ? (vi){0} - 1 : (vi){0});
                    sc[g][jj] = vselect(ok, sc[g][jj], vsplat(-INFINITY));
                }
                mx = vmax(mx, sc[g][jj]);
            }
            const vf m_new = vmax(m[g], mx);
            /* a lane that has seen no key yet keeps m = -inf: exponentiate against 0 there (all terms are 0) */
            const vf m_use = vselect(m_new == vsplat(-INFINITY), (vf){0}, m_new);
            alpha[g] = vexp2_neg(m[g] - m_use);
            vf psum = {0};
            for (int64_t jj = 0; jj < LANE_CK; jj++) {
                sc[g][jj] = vexp2_neg(sc[g][jj] - m_use);
                psum += sc[g][jj];
            }
            l[g] = l[g] * alpha[g] + psum;
            m[g] = m_new;
        }
        int64_t d = 0;
        for (; d + LANE_DBLK <= D; d += LANE_DBLK) {
            vf a[LANE_RG][LANE_DBLK];
            for (int g = 0; g < RG; g++)
                for (int i = 0; i < LANE_DBLK; i++) a[g][i] = vload(Ot + ((d + i) * RG + g) * VL) * alpha[g];
            for (int64_t jj = 0; jj < nk; jj++) {
                vf p[LANE_RG];
                for (int g = 0; g < RG; g++) p[g] = sc[g][jj];
                for (int i = 0; i < LANE_DBLK; i++) {
                    const vf b = vsplat(vrow[jj][d + i]);
                    for (int g = 0; g < RG; g++) a[g][i] += p[g] * b;
                }
            }
            for (int g = 0; g < RG; g++)
                for (int i = 0; i < LANE_DBLK; i++) vstore(Ot + ((d + i) * RG + g) * VL, a[g][i]);
        }
        for (; d < D; d++) {
            for (int g = 0; g < RG; g++) {
                vf a = vload(Ot + (d * RG + g) * VL) * alpha[g];
                for (int64_t jj = 0; jj < nk; jj++) a += sc[g][jj] * vrow[jj][d];
                vstore(Ot + (d * RG + g) * VL, a);
            }
        }
    }
    for (int g = 0; g < RG; g++) {
        float inv[VL];
        for (int64_t r = 0; r < VL; r++) inv[r] = l[g][r] > 0.0f ? 1.0f / l[g][r] : 0.0f;
        for (int64_t r = 0; r < VL && g * VL + r < nr; r++) {
            const int64_t i = (g0 + g * VL + r) / G, h = (g0 + g * VL + r) % G;
            float *dst = job->out + (row0 + it.q0 + i) * H * D + (it.kv_head * G + h) * D;
            for (int64_t dd = 0; dd < D; dd++) dst[dd] = Ot[(dd * RG + g) * VL + r] * inv[r];
        }
    }
}

/* All of an item's rows in passes of LANE_RG groups of VL rows, the last pass as few groups as it needs */
static inline void attend_lanes(const Job *job, const Item it, const float *Q, int64_t Dp, int64_t R,
                                float *scratch, float *kbuf, float *vbuf) {
    for (int64_t g0 = 0; g0 < R;) {
        const int64_t left = R - g0;
#if LANE_RG >= 3
        if (left > 2 * VL) {
            lanes_pass(job, it, Q, Dp, R, g0, 3, scratch, kbuf, vbuf);
            g0 += 3 * VL;
            continue;
        }
#endif
        if (left > VL) {
            lanes_pass(job, it, Q, Dp, R, g0, 2, scratch, kbuf, vbuf);
            g0 += 2 * VL;
        } else {
            lanes_pass(job, it, Q, Dp, R, g0, 1, scratch, kbuf, vbuf);
            g0 += VL;
        }
    }
}

/* One work item: its query rows scaled (and rotated) into scratch, then attend_lanes for many rows, or per
 * row dot products for few (decode): chunks of VL keys, NR rows per score pass. */
static void attention_item(void *arg, size_t index) {
    Job *job = (Job *)arg;
    const Item it = job->items[index];
    const int64_t D = job->head_dim, G = job->group;
    const int64_t H = job->num_heads, Dp = (D + VL - 1) / VL * VL;
    const int64_t nq = it.q1 - it.q0, R = nq * G, Rp = (R + NR - 1) / NR * NR;
    const int64_t past = job->past[it.seq], row0 = job->cu[it.seq];
    const int64_t window = job->window;
    const int lanes = R >= LANES_MIN; /* many rows: attend_lanes */

    /* scratch: Q [Rp][Dp] (scaled; zero rows/columns pad to whole passes and vectors), acc [Rp][Dp],
     * attend_lanes' Qt and Ot [D][LANE_RG][VL], a chunk's dequantized K and V rows [LANE_CK][D] each (int8 pools),
     * m [R], l [R] */
    const int64_t ls = (2 * LANE_RG * VL + 2 * LANE_CK) * D;
    float *mem = (float *)malloc(sizeof(float) * (size_t)(2 * Rp * Dp + ls + 2 * R + 2 * VL));
    if (!mem) {
        job->failed = 1;
        return;
    }
    float *Q = mem, *acc = Q + Rp * Dp, *lanes_scratch = acc + Rp * Dp, *m = lanes_scratch + ls, *l = m + R;
    float *kbuf = lanes_scratch + 2 * LANE_RG * D * VL, *vbuf = kbuf + D * LANE_CK;
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
        attend_lanes(job, it, Q, Dp, R, lanes_scratch, kbuf, vbuf);
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
    const int8_t *krow8[VL], *vrow8[VL];
    const float k_scale = job->kc8 ? job->k_scale[it.kv_head] : 1.0f, v_scale = job->kc8 ? job->v_scale[it.kv_head] : 1.0f;
    const vi lane = {IOTA};
    vf s[NR], pv[NR];
    float alpha[NR];

    for (int64_t j0 = k_begin; j0 <= p_last; j0 += VL) {
        const int64_t nk = (p_last - j0 + 1) < VL ? (p_last - j0 + 1) : VL;
        /* an int8 pool's chunk of past keys only: its codes are read in place (scores_i8, update_rows_i8),
         * the key scale applied to the scores and the value scale to the weights; a chunk that holds this
         * step's own keys (read unquantized) goes through chunk_rows' dequantized scratch */
        const int codes = job->kc8 && j0 + nk <= past;
        if (codes)
            chunk_rows_i8(job, it.seq, it.kv_head, j0, nk, krow8, vrow8);
        else
            chunk_rows(job, it.seq, it.kv_head, j0, nk, krow, vrow, kbuf, vbuf);
        if (j0 + VL <= p_last) prefetch_rows(job, it.seq, it.kv_head, j0 + VL, PF_NEXT(p_last - j0 - VL + 1));
        for (int64_t r0 = 0; r0 < R; r0 += NR) {
            const int64_t nr = R - r0 < NR ? R - r0 : NR;
            /* rows r0..r0+nr: skip when no key of this chunk is visible to any of them */
            const int64_t p_lo = past + it.q0 + r0 / G, p_hi = past + it.q0 + (r0 + nr - 1) / G;
            if (j0 > p_hi || j0 + nk - 1 < (window > 0 ? p_lo - window + 1 : 0)) continue;
            if (codes)
                for (int64_t k = 0; k < nr; k++) s[k] = scores_i8(Q + (r0 + k) * Dp, krow8, D) * k_scale;
            else
                for (int64_t k = 0; k < nr; k++) s[k] = scores(Q + (r0 + k) * Dp, krow, D);
            for (int64_t k = 0; k < nr; k++) {
                const int64_t r = r0 + k;
                const int64_t p = past + it.q0 + r / G; /* this row's position */
                const int64_t lo = window > 0 ? p - window + 1 : 0;
                const vi j = lane + (int32_t)j0;
                const vi ok = (j <= (int32_t)p) & (j >= (int32_t)lo) & (lane < (int32_t)nk);
                const vf sc = vselect(ok, s[k], vsplat(-INFINITY));
                const float mx = hmax(sc);
                if (mx == -INFINITY) { /* nothing visible to this row here: leave it as it is */
                    s[k] = (vf){0};
                    alpha[k] = 1.0f;
                    continue;
                }
                const float m_new = fmaxf(mx, m[r]);
                alpha[k] = exp2_neg(m[r] - m_new);
                s[k] = vexp2_neg(sc - m_new);
                l[r] = l[r] * alpha[k] + hsum(s[k]);
                m[r] = m_new;
            }
            if (codes) {
                for (int64_t k = 0; k < nr; k++) pv[k] = s[k] * v_scale;
                for (int64_t k = 0; k < nr; k += 4)
                    update_rows_i8(acc + (r0 + k) * Dp, Dp, D, nr - k < 4 ? nr - k : 4, alpha + k, pv + k, vrow8, nk);
            } else {
                for (int64_t k = 0; k < nr; k += 4)
                    update_rows(acc + (r0 + k) * Dp, Dp, D, nr - k < 4 ? nr - k : 4, alpha + k, s + k, vrow, nk);
            }
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

/* VL int32 values in [0, 255] (vstore_u8) or [-128, 127] (vstore_i8) stored as bytes. GCC narrows int32 -> 8-bit
 * vectors lane by lane (an extract and a byte store each) except on AVX-512 (vpmovdb), so AVX2 and SSE2 pack
 * with their intrinsics (the values are in range: the saturating packs change nothing). */
#if defined(__x86_64__) && VL == 8
static inline __m128i pack_bytes(vi v, int is_signed) {
    const __m256i w = (__m256i)v;
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)); /* 8 x int16 */
    return is_signed ? _mm_packs_epi16(h, h) : _mm_packus_epi16(h, h);
}
static inline void vstore_u8(uint8_t *dst, vi v) { _mm_storel_epi64((__m128i *)(void *)dst, pack_bytes(v, 0)); }
static inline void vstore_i8(int8_t *dst, vi v) { _mm_storel_epi64((__m128i *)(void *)dst, pack_bytes(v, 1)); }
#elif defined(__x86_64__) && VL == 4
static inline void store_four(void *dst, vi v, int is_signed) {
    const __m128i h = _mm_packs_epi32((__m128i)v, (__m128i)v);
    const int32_t four = _mm_cvtsi128_si32(is_signed ? _mm_packs_epi16(h, h) : _mm_packus_epi16(h, h));
    memcpy(dst, &four, sizeof four);
}
static inline void vstore_u8(uint8_t *dst, vi v) { store_four(dst, v, 0); }
static inline void vstore_i8(int8_t *dst, vi v) { store_four(dst, v, 1); }
#else
static inline void vstore_u8(uint8_t *dst, vi v) {
    const vu8 c = __builtin_convertvector(v, vu8);
    memcpy(dst, &c, sizeof c);
}
static inline void vstore_i8(int8_t *dst, vi v) {
    const vi8 c = __builtin_convertvector(v, vi8);
    memcpy(dst, &c, sizeof c);
}
#endif

/* ==== the pool writes ===================================================================================== */

/* quant_row (cpu_kernels.h) VL values at a time: x / s clamped to [-128, 127], then rounded to the nearest
 * integer, ties to even, by adding and subtracting 1.5 * 2^23 (clamping before rounding gives the codes
 * rounding then saturating gives: the bounds are integers) */
static inline void quant_row_v(int8_t *dst, const float *src, int64_t D, float scale) {
    const vf sv = vsplat(scale), magic = vsplat(12582912.0f), lo = vsplat(-128.0f), hi = vsplat(127.0f);
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
        vf v = vload(src + d) / sv;
        v = vmax(v, lo);
        v = vselect(v > hi, hi, v);
        vstore_i8(dst + d, __builtin_convertvector((v + magic) - magic, vi));
    }
    if (d < D) quant_row(dst + d, src + d, D - d, scale);
}

/* Tokens [index * write_tokens, ..) of the step into their pool slots (block_table[b][p / block_size], offset
 * p % block_size): keys rotated on the way (RotaryPagedAttention), both quantized per KV head into int8 pools
 * (the rotated keys also kept in rot, which the step attends to unquantized). Items cover disjoint tokens, and
 * every token has its own slot, so items write disjoint memory. Compiled with fp-contract off: the rotation's
 * x * cos - y * sin rounds each product, so the pools hold the same values on every code path. */
__attribute__((optimize("fp-contract=off"))) static void kv_write_item(void *arg, size_t index) {
    const Job *job = (const Job *)arg;
    const int64_t KVH = job->kv_heads, D = job->head_dim, BS = job->block_size, MB = job->max_blocks;
    const int64_t half = job->rdim / 2, stride = job->kv_src_stride;
    const int64_t t0 = (int64_t)index * job->write_tokens;
    const int64_t t1 = t0 + job->write_tokens < job->tokens ? t0 + job->write_tokens : job->tokens;
    int64_t b = 0;
    for (int64_t t = t0; t < t1; t++) {
        while (job->cu[b + 1] <= t) b++;
        const int64_t p = job->past[b] + (t - job->cu[b]);
        const int64_t slot = (int64_t)job->bt[b * MB + p / BS] * BS + p % BS;
        const float *ks = job->ksrc + t * stride, *vs = job->vsrc + t * stride;
        const float *c = job->pos ? job->cos + job->pos[t] * half : NULL;
        const float *s = job->pos ? job->sin + job->pos[t] * half : NULL;
        if (job->kc8) {
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t at = (slot * KVH + h) * D;
                if (job->pos) {
                    float *r = job->rot + (t * KVH + h) * D;
                    rope_row(r, ks + h * D, D, job->rdim, job->interleaved, c, s, 1.0f);
                    quant_row_v(job->kc8 + at, r, D, job->k_scale[h]);
                } else {
                    quant_row_v(job->kc8 + at, ks + h * D, D, job->k_scale[h]);
                }
                quant_row_v(job->vc8 + at, vs + h * D, D, job->v_scale[h]);
            }
            continue;
        }
        if (job->pos) {
            for (int64_t h = 0; h < KVH; h++)
                rope_row(job->kc + (slot * KVH + h) * D, ks + h * D, D, job->rdim, job->interleaved, c, s, 1.0f);
        } else {
            memcpy(job->kc + slot * KVH * D, ks, sizeof(float) * (size_t)(KVH * D));
        }
        memcpy(job->vc + slot * KVH * D, vs, sizeof(float) * (size_t)(KVH * D));
    }
}

/* ==== QuantizeRows ======================================================================================= */

/* One row x[0:K] -> codes q[0:K] and its scale: amax(|x|) * (1/127), at least 1e-12 (QuantizeRows' arithmetic) */
static inline float quantize_row_u8(const float *x, int64_t K, uint8_t *q) {
    const float inv_qmax = 1.0f / 127.0f, tiny = 1e-12f;
    vf m = {0};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        const vf v = vload(x + k);
        m = vmax(m, vselect(v < 0, -v, v));
    }
    float amax = hmax(m);
    for (; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    const float sd = amax * inv_qmax;
    const float s = sd > tiny ? sd : tiny;
    /* QuantizeLinear(x / s, 1, 128): x / s is within [-127, 127] up to rounding, where adding and
     * subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even (the default rounding mode),
     * as nearbyintf does; then + 128 and saturation to [0, 255] */
    const vf sv = vsplat(s), magic = vsplat(12582912.0f);
    for (k = 0; k + VL <= K; k += VL) {
        vf v = ((vload(x + k) / sv + magic) - magic) + 128.0f;
        v = vmax(v, (vf){0});
        v = vselect(v > 255.0f, vsplat(255.0f), v);
        vstore_u8(q + k, __builtin_convertvector(v, vi));
    }
    for (; k < K; k++) {
        float v = nearbyintf(x[k] / s) + 128.0f;
        v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
        q[k] = (uint8_t)v;
    }
    return s;
}

static void quantize_rows_item(void *arg, size_t index) {
    const QuantJob *job = (const QuantJob *)arg;
    const int64_t r0 = (int64_t)index * job->rows_per_item;
    const int64_t r1 = r0 + job->rows_per_item < job->rows ? r0 + job->rows_per_item : job->rows;
    for (int64_t r = r0; r < r1; r++)
        job->scale[r] = quantize_row_u8(job->x + r * job->K, job->K, job->codes + r * job->K);
}

/* ==== SkipNormQuantize =================================================================================== */

/* ONNX Runtime's SkipSimplifiedLayerNormalization (CPU, float32) followed by QuantizeRows, row by row, with the
 * same roundings: sum = x * s + skip (the product rounded, never an FMA: this function is compiled with
 * fp-contract off), ms = the squares of sum added one element after another in float32 (four rows' chains
 * interleaved, each in its own order), rms = sqrtf(ms / D + epsilon), y = sum / rms * gamma into a row
 * scratch, then the row's codes and scale. */
__attribute__((optimize("fp-contract=off"))) static void skip_norm_quantize_item(void *arg, size_t index) {
    SnqJob *job = (SnqJob *)arg;
    const int64_t D = job->D, r0 = (int64_t)index * job->rows_per_item;
    const int64_t r1 = r0 + job->rows_per_item < job->rows ? r0 + job->rows_per_item : job->rows;
    float *y = (float *)malloc(sizeof(float) * (size_t)D);
    if (!y) {
        job->failed = 1;
        return;
    }
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4;
        for (int64_t i = 0; i < n; i++) {
            const float *x = job->x + (r + i) * D, *sk = job->skip + (r + i) * D;
            float *v = job->sum + (r + i) * D;
            const float s = job->s ? job->s[r + i] : 1.0f;
            int64_t d = 0;
            if (job->s) {
                const vf sv = vsplat(s);
                for (; d + VL <= D; d += VL) vstore(v + d, vload(x + d) * sv + vload(sk + d));
                for (; d < D; d++) v[d] = x[d] * s + sk[d];
            } else {
                for (; d + VL <= D; d += VL) vstore(v + d, vload(x + d) + vload(sk + d));
                for (; d < D; d++) v[d] = x[d] + sk[d];
            }
        }
        const float *v0 = job->sum + r * D;
        const float *v1 = n > 1 ? v0 + D : v0, *v2 = n > 2 ? v0 + 2 * D : v0, *v3 = n > 3 ? v0 + 3 * D : v0;
        float ms[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t d = 0; d < D; d++) {
            ms[0] += v0[d] * v0[d];
            ms[1] += v1[d] * v1[d];
            ms[2] += v2[d] * v2[d];
            ms[3] += v3[d] * v3[d];
        }
        for (int64_t i = 0; i < n; i++) {
            const float rms = sqrtf(ms[i] / (float)D + job->epsilon);
            const float *v = v0 + i * D;
            const vf rv = vsplat(rms);
            int64_t d = 0;
            for (; d + VL <= D; d += VL) vstore(y + d, vload(v + d) / rv * vload(job->gamma + d));
            for (; d < D; d++) y[d] = v[d] / rms * job->gamma[d];
            job->scale[r + i] = quantize_row_u8(y, D, job->codes + (r + i) * D);
        }
    }
    free(y);
}

/* ==== SiluMul ============================================================================================ */

static inline vf vsilu_mul(vf g, vf u) {
    const vf a = vselect(g < 0, -g, g);
    const vf e = vexp2_neg(a * -1.4426950408889634f);
    const vf sig = vselect(g < 0, e, vsplat(1.0f)) / (e + 1.0f);
    return g * sig * u;
}

static void silu_mul_item(void *arg, size_t index) {
    const SmJob *job = (const SmJob *)arg;
    const int64_t I = job->I, r0 = (int64_t)index * job->rows_per_item;
    const int64_t r1 = r0 + job->rows_per_item < job->rows ? r0 + job->rows_per_item : job->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = job->x + r * 2 * I, *u = g + I;
        float *y = job->y + r * I;
        int64_t k = 0;
        if (job->s) { /* x * s first, each product rounded to float32 (a multiply, never fused into an FMA) */
            const vf sv = vsplat(job->s[r]);
            for (; k + VL <= I; k += VL) vstore(y + k, vsilu_mul(vload(g + k) * sv, vload(u + k) * sv));
        } else {
            for (; k + VL <= I; k += VL) vstore(y + k, vsilu_mul(vload(g + k), vload(u + k)));
        }
        if (k < I) { /* the last partial vector, through zero-padded lanes: the same arithmetic */
            float tg[VL] = {0}, tu[VL] = {0}, ty[VL];
            memcpy(tg, g + k, sizeof(float) * (size_t)(I - k));
            memcpy(tu, u + k, sizeof(float) * (size_t)(I - k));
            const vf sv = vsplat(job->s ? job->s[r] : 1.0f);
            vstore(ty, vsilu_mul(vload(tg) * sv, vload(tu) * sv));
            memcpy(y + k, ty, sizeof(float) * (size_t)(I - k));
        }
    }
}

/* ==== MatMulBf16 ========================================================================================= */

static void bf16_convert_rows(void *arg, size_t index) {
    const BfJob *job = (const BfJob *)arg;
    const int64_t r0 = (int64_t)index * job->rows_per_conv;
    const int64_t r1 = r0 + job->rows_per_conv < job->M ? r0 + job->rows_per_conv : job->M;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = job->a + r * job->K;
        uint16_t *o = (uint16_t *)job->ab + r * 2 * job->KP;
        uint32_t *of = (uint32_t *)job->ab + r * 2 * job->KP; /* a_f32: the bf16 value as float32 bits */
        int64_t k = 0;
        for (; k + VL <= job->K; k += VL) {
            vu32 u;
            memcpy(&u, x + k, sizeof u);
            const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
            const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            const vu32 quiet = (u >> 16) | 0x40u;
            const vu32 bits = (vu32)((nan & (vi)quiet) | (~nan & (vi)rounded));
            if (job->a_f32) {
                const vu32 wide = bits << 16;
                memcpy(of + k, &wide, sizeof wide);
            } else {
                const vu16 b = __builtin_convertvector(bits, vu16);
                memcpy(o + k, &b, sizeof b);
            }
        }
        for (; k < job->K; k++) {
            if (job->a_f32)
                of[k] = (uint32_t)bf16_round(x[k]) << 16;
            else
                o[k] = bf16_round(x[k]);
        }
        if (job->K % 2) {
            if (job->a_f32)
                of[job->K] = 0;
            else
                o[job->K] = 0;
        }
    }
}

/* Store VL columns of a row (fewer at the right edge of y; none when ncols <= 0). */
static inline void bf16_store(float *dst, vf v, int64_t ncols) {
    if (ncols >= VL) {
        vstore(dst, v);
    } else if (ncols > 0) {
        float t[VL];
        vstore(t, v);
        memcpy(dst, t, sizeof(float) * (size_t)ncols);
    }
}

/* A packed panel's pair row kk holds 16 columns x (k, k + 1) as uint32: PV vectors of VL pairs. Widening a
 * pair vector to float32: the even k's value is the low half shifted up 16 bits, the odd k's the high half
 * with the low bits cleared (bf16 -> float32 is exact). */
#define PV (BF_PANEL / VL)
#define NV (BF_NPAN * PV) /* vectors of a tile's row */

static inline void bf16_widen(const uint32_t *const *w, int64_t kk, vf *e, vf *o) {
    for (int v = 0; v < NV; v++) {
        vu32 b;
        memcpy(&b, w[v / PV] + kk * BF_PANEL + (v % PV) * VL, sizeof b);
        e[v] = (vf)(b << 16);
        o[v] = (vf)(b & 0xffff0000u);
    }
}

static inline void bf16_store_row(float *y, const vf *acc, const int64_t *ncols) {
    for (int v = 0; v < NV; v++) bf16_store(y + (v / PV) * BF_PANEL + (v % PV) * VL, acc[v], ncols[v / PV] - (v % PV) * VL);
}

/* MR rows x BF_NPAN panels over all K: acc += a_even * w_even + a_odd * w_odd (two FMAs per vector). */
#define BF16_TILE(MR)                                                                                          \
    static inline __attribute__((always_inline)) void bf16_tile_##MR(const float *af, int64_t lda,             \
                                                                     const uint32_t *const *w, int64_t KP,      \
                                                                     float *y, int64_t ldy,                     \
                                                                     const int64_t *ncols) {                   \
        vf acc[MR][NV];                                                                                        \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};                                                  \
        for (int64_t kk = 0; kk < KP; kk++) {                                                                  \
            vf e[NV], o[NV];                                                                                   \
            bf16_widen(w, kk, e, o);                                                                           \
            for (int r = 0; r < MR; r++) {                                                                     \
                const float ae = af[r * 2 * lda + 2 * kk], ao = af[r * 2 * lda + 2 * kk + 1];                  \
                for (int v = 0; v < NV; v++) acc[r][v] += ae * e[v] + ao * o[v];                               \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++) bf16_store_row(y + r * ldy, acc[r], ncols);                               \
    }
#if BF_MR >= 8
BF16_TILE(8)
#endif
#if BF_MR >= 4
BF16_TILE(4)
#endif
BF16_TILE(2)

/* One row (decode): the even and odd products in separate accumulators and BF_UNROLL pair rows per step,
 * so 2 * BF_UNROLL * NV multiply-add chains run at once while the weights stream from memory. */
static inline __attribute__((always_inline)) void bf16_tile_1(const float *af, int64_t lda,
                                                               const uint32_t *const *w, int64_t KP, float *y,
                                                               int64_t ldy, const int64_t *ncols) {
    (void)lda;
    (void)ldy;
    vf ae_acc[BF_UNROLL][NV], ao_acc[BF_UNROLL][NV];
    for (int u = 0; u < BF_UNROLL; u++)
        for (int v = 0; v < NV; v++) ae_acc[u][v] = ao_acc[u][v] = (vf){0};
    int64_t kk = 0;
    for (; kk + BF_UNROLL <= KP; kk += BF_UNROLL) {
        for (int u = 0; u < BF_UNROLL; u++) {
            vf e[NV], o[NV];
            const float ae = af[2 * (kk + u)], ao = af[2 * (kk + u) + 1];
            bf16_widen(w, kk + u, e, o);
            for (int v = 0; v < NV; v++) {
                ae_acc[u][v] += ae * e[v];
                ao_acc[u][v] += ao * o[v];
            }
        }
    }
    for (; kk < KP; kk++) {
        vf e[NV], o[NV];
        const float ae = af[2 * kk], ao = af[2 * kk + 1];
        bf16_widen(w, kk, e, o);
        for (int v = 0; v < NV; v++) {
            ae_acc[0][v] += ae * e[v];
            ao_acc[0][v] += ao * o[v];
        }
    }
    vf sum[NV];
    for (int v = 0; v < NV; v++) {
        sum[v] = ae_acc[0][v] + ao_acc[0][v];
        for (int u = 1; u < BF_UNROLL; u++) sum[v] += ae_acc[u][v] + ao_acc[u][v];
    }
    bf16_store_row(y, sum, ncols);
}

static void bf16_rows(const void *a, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                      int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    const float *af = (const float *)a;
    const uint32_t *wp[2] = {w0, w1};
    const int64_t nc[2] = {c0, c1};
    for (int p = 0; p < 2; p += BF_NPAN) {
        if (nc[p] <= 0) break;
        const uint32_t *const *w = wp + p;
        const int64_t *ncols = nc + p;
        float *yp = y + p * BF_PANEL;
        int64_t r = 0;
        if (nr == 1) {
            bf16_tile_1(af, lda, w, KP, yp, ldy, ncols);
            continue;
        }
        for (; r + BF_MR <= nr; r += BF_MR) {
#if BF_MR == 8
            bf16_tile_8(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
#elif BF_MR == 4
            bf16_tile_4(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
#else
            bf16_tile_2(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
#endif
        }
#if BF_MR > 4
        if (nr - r >= 4) {
            bf16_tile_4(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
            r += 4;
        }
#endif
#if BF_MR > 2
        if (nr - r >= 2) {
            bf16_tile_2(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
            r += 2;
        }
#endif
        if (nr - r >= 1) bf16_tile_1(af + r * 2 * lda, lda, w, KP, yp + r * ldy, ldy, ncols);
    }
}
