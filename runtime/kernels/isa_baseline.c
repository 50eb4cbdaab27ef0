/* The baseline code path of the library's hot loops (cpu_kernels_impl.h): 4 float lanes, the SSE2 every
 * x86-64 CPU has (and whatever 16-byte vectors another architecture's compiler maps them to). Chosen where
 * the CPU has neither AVX2 + FMA nor AVX-512, or with OPTIMIZE_CPU_ISA=baseline. */
#define VL 4

#include "cpu_kernels_impl.h"

const CpuKernels optimize_kernels_baseline = {"baseline", VL, attention_item, kv_write_item, quantize_rows_item,
    silu_mul_item, skip_norm_quantize_item, bf16_convert_rows, bf16_rows, NULL};
