/* The AVX2 + FMA code path of the library's hot loops (cpu_kernels_impl.h): 8 float lanes, one ymm register
 * per vector, a * b + c contracted to FMA. Chosen on a CPU with AVX2 and FMA but not AVX-512 (AMD Zen 2/3,
 * Intel before Skylake-SP and most client parts), or with OPTIMIZE_CPU_ISA=avx2. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#define VL 8

#include "cpu_kernels_impl.h"

const CpuKernels optimize_kernels_avx2 = {"avx2", VL, attention_item, kv_write_item, quantize_rows_item,
    silu_mul_item, skip_norm_quantize_item, bf16_convert_rows, bf16_rows, NULL};
#endif
