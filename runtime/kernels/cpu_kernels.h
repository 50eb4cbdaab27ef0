/* The hot loops of the custom-op library (one op per op_*.c file, ort_ops.h), shared by its per-CPU code paths.
 *
 * The op files hold the ONNX Runtime glue (inputs, validation, the thread pool); the work
 * items they hand to the thread pool are compiled once per instruction set from one source,
 * cpu_kernels_impl.h, with the vector width of that instruction set's registers:
 *
 *   isa_avx512.c    16 float lanes (zmm), x86-64-v4 (AVX-512 F/BW/DQ/VL); plus MatMulBf16 with vdpbf16ps
 *                   (AVX-512 BF16) in its own functions
 *   isa_avx2.c       8 float lanes (ymm), AVX2 + FMA
 *   isa_baseline.c   4 float lanes (xmm), what every x86-64 (SSE2) or other CPU has
 *
 * Each file exports one CpuKernels table; ort_ops.c picks a table per op when ONNX Runtime registers the
 * library (the CPU's features, or OPTIMIZE_CPU_ISA) and reports the choice (optimize_kernel_paths).
 */
#ifndef OPTIMIZE_CPU_KERNELS_H
#define OPTIMIZE_CPU_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NR 8 /* query rows per score pass of the decode path (independent accumulators) */
#define LANES_MIN 16 /* an attention work item of at least this many query rows takes the lanes path */
/* query rows (tokens x group heads) per attention work item, at most: a whole number of every code path's
 * lanes passes (LANE_RG x VL rows: 48 on AVX-512, 24 on AVX2, 8 on SSE2; cpu_kernels_impl.h checks), so no
 * item of a long prefill ends in a pass of one register of rows, which reads every key for a third of the
 * work (64 rows did so on AVX-512: 48 + 16) */
#define ROWS_TARGET 48
#define BF_PANEL 16 /* MatMulBf16's packed weight: panels of 16 columns (compiler/fusion/matmul_bf16.py) */
#define BF_MC 64 /* MatMulBf16: rows per work item */

#define HIDDEN __attribute__((visibility("hidden")))

/* ---- attention: one work item = (sequence, KV head, query tile) ----------------------------------------- */

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
    /* the pool writes (kv_write_item, before the attention items): the step's K and V rows as the op reads
     * them (token t's at ksrc / vsrc + t * kv_src_stride), `write_tokens` tokens per item of `tokens`, and
     * for int8 pools with rotary the rotated keys [T][KVH * D] that the step then reads (kstep) */
    const float *ksrc, *vsrc;
    int64_t kv_src_stride, tokens, write_tokens;
    float *rot;
} Job;

/* ---- QuantizeRows, SiluMul, SkipNormQuantize: items of whole rows ------------------------------------- */

typedef struct {
    const float *x;
    uint8_t *codes;
    float *scale;
    int64_t K, rows_per_item, rows;
} QuantJob;

typedef struct {
    const float *x;
    const float *s; /* one scale per row of x, applied first (x * s in float32), or NULL */
    float *y;
    int64_t I, rows_per_item, rows;
} SmJob;

/* SkipNormQuantize: sum = x * s + skip, then the RMS norm of sum times gamma, quantized per row as QuantizeRows */
typedef struct {
    const float *x;
    const float *s; /* x's row scale, applied first (x * s in float32), or NULL */
    const float *skip, *gamma;
    uint8_t *codes;
    float *scale, *sum;
    float epsilon;
    int64_t D, rows_per_item, rows;
    int failed; /* set by an item that could not allocate its row scratch */
} SnqJob;

/* ---- MatMulBf16 ------------------------------------------------------------------------------------------- */

/* nr rows of a row block against two panels (w1 may repeat w0: an odd last panel, then c1 = 0): y's columns
 * [0, c0) from w0 and [16, 16 + c1) from w1. a: the rows' bf16-rounded values, lda K pairs apart: float32
 * [.., 2 * lda] for the FMA tiles (a broadcast is then one load), bf16 pairs uint32 [.., lda] for vdpbf16ps. */
typedef void (*BfRowsFn)(const void *a, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                         int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1);

typedef struct {
    const float *a;
    void *ab;         /* a rounded to bf16, [M][2 * KP] (KP pairs per row, the odd K padded with 0): float32
                       * values (a_f32) or bf16 bits (uint16) */
    const uint32_t *w; /* [NP][KP][16] pairs */
    float *y;
    int64_t M, K, KP, N, NP, NC, rows_per_conv;
    BfRowsFn rows;    /* the path's tiles */
    int a_f32;        /* ab holds float32 (the FMA tiles) rather than bf16 bits (vdpbf16ps) */
} BfJob;

/* ---- one code path: the functions the thread pool runs (signature of ONNX Runtime's ParallelFor) -------- */

typedef struct {
    const char *name;  /* "avx512", "avx2", "baseline" */
    int lanes;         /* float lanes per vector register */
    void (*attention_item)(void *job, size_t index);  /* Job */
    void (*kv_write_item)(void *job, size_t index);  /* Job: the step's K/V into the pools */
    void (*quantize_rows_item)(void *job, size_t index);  /* QuantJob */
    void (*silu_mul_item)(void *job, size_t index);  /* SmJob */
    void (*skip_norm_quantize_item)(void *job, size_t index);  /* SnqJob */
    void (*bf16_convert_rows)(void *job, size_t index);  /* BfJob: a -> ab */
    BfRowsFn bf16_rows;
    BfRowsFn bf16_rows_dp; /* AVX-512 BF16's vdpbf16ps (avx512 table only; NULL elsewhere) */
} CpuKernels;

extern const CpuKernels optimize_kernels_baseline HIDDEN;
#if defined(__x86_64__) && defined(__GNUC__)
#define OPTIMIZE_X86_PATHS 1
extern const CpuKernels optimize_kernels_avx2 HIDDEN;
extern const CpuKernels optimize_kernels_avx512 HIDDEN;
#endif

/* ---- scalar helpers the op files share with the paths ------------------------------------------------------- */

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

/* dst[0:D] = saturate(round_half_even(src / scale)) as QuantizeLinear to int8 (zero point 0) writes it */
static inline void quant_row(int8_t *dst, const float *src, int64_t D, float scale) {
    for (int64_t d = 0; d < D; d++) {
        float v = nearbyintf(src[d] / scale);
        v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
        dst[d] = (int8_t)v;
    }
}

/* float32 -> bfloat16 bits, round to nearest, ties to even (a NaN stays a NaN: its quiet bit is kept) */
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
