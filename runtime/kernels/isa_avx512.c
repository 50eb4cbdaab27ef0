/* The AVX-512 code path of the library's hot loops (cpu_kernels_impl.h): 16 float lanes, one zmm register
 * per vector (x86-64-v4: AVX-512 F, BW, DQ, VL), a * b + c contracted to FMA; and MatMulBf16's tiles with
 * AVX-512 BF16's vdpbf16ps (two bf16 products per float32 lane and instruction), used where the CPU has
 * that extension too. Chosen on a CPU with AVX-512, or with OPTIMIZE_CPU_ISA=avx512. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
#define VL 16

#include <immintrin.h>

#include "cpu_kernels_impl.h"

#define BF16_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,avx512bf16")))
/* MR rows x two panels (32 columns) with vdpbf16ps: acc += a_pair . w_pair per lane. */
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
            vf t0, t1;                                                                                     \
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
static void bf16_rows_dp(const void *a, int64_t lda, int64_t nr, const uint32_t *w0, const uint32_t *w1,
                         int64_t KP, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    const uint32_t *a2 = (const uint32_t *)a;
    int64_t r = 0;
    for (; r + 8 <= nr; r += 8) bf16_tile_dp_8(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);
    if (nr - r >= 4) {
        bf16_tile_dp_4(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);
        r += 4;
    }
    if (nr - r >= 2) {
        bf16_tile_dp_2(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);
        r += 2;
    }
    if (nr - r >= 1) bf16_tile_dp_1(a2 + r * lda, lda, w0, w1, KP, y + r * ldy, ldy, c0, c1);
}

const CpuKernels optimize_kernels_avx512 = {"avx512", VL, attention_item, kv_write_item, quantize_rows_item,
    silu_mul_item, skip_norm_quantize_item, bf16_convert_rows, bf16_rows, bf16_rows_dp};
#endif
