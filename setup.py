"""Build the C code: the engine core extension (plain C, CPython API + buffer protocol; no numpy headers),
the ONNX Runtime custom-op library with the CPU paged-attention kernel (plain C, ORT's C ABI), and the
compiler's INT4 loops, round-to-nearest and MatMulNBits packing (plain C, CPython API + buffer protocol).

`-ffp-contract=off`: no fused multiply-add, so the sampler's float arithmetic is the same IEEE
operations as its numpy twin (runtime/core/reference/sampler.py) on every compiler and CPU.
`-fno-trapping-math`: FP exceptions are not observed, which lets GCC vectorize the branch-free
selects of the sampler's loops; it changes no result (no reassociation, no fast-math).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "runtime.core._core",
            sources=["runtime/core/_core.c", "runtime/core/_block_pool.c", "runtime/core/_prefix_cache.c",
                     "runtime/core/_scheduler.c", "runtime/core/_sampler.c"],
            depends=["runtime/core/_core.h", "runtime/core/_sched.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-trapping-math"],
        ),
        # quantize_rtn's and pack_matmulnbits' hot loops (compiler/quant/int4.py); their twins are the torch/numpy
        # references, compared bit for bit (tests/test_quant_int4_c.py)
        Extension(
            "compiler.quant._int4",
            sources=["compiler/quant/_int4.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-ffp-contract=off"],
        ),
        # Not a Python module: a custom-op library that ONNX Runtime loads (SessionOptions.
        # register_custom_ops_library); runtime/kernels/paged_attention_cpu.py finds and registers it.
        # One file per op (op_*.c: its descriptor, create and compute), registered by ort_ops.c from its table
        # of descriptors (ort_ops.h); one code path per instruction set (isa_avx512.c, isa_avx2.c,
        # isa_baseline.c: the same loops for 16, 8 and 4 float lanes, each file setting its target with
        # #pragma GCC target), chosen per op at registration from the CPU's features or OPTIMIZE_CPU_ISA.
        # scripts/memcheck.sh builds these sources (read from this list) with sanitizers. gnu11 allows fused
        # multiply-add (tolerance-tested against the reference attention); -Wno-psabi: the vector types only
        # cross static inline helpers, never an ABI boundary.
        Extension(
            "runtime.kernels._paged_attention_cpu",
            sources=["runtime/kernels/ort_ops.c", "runtime/kernels/op_paged_attention.c",
                     "runtime/kernels/op_rotary_paged_attention.c", "runtime/kernels/op_quantize_rows.c",
                     "runtime/kernels/op_matmul_bf16.c", "runtime/kernels/op_silu_mul.c",
                     "runtime/kernels/op_skip_norm_quantize.c",
                     "runtime/kernels/isa_avx512.c", "runtime/kernels/isa_avx2.c", "runtime/kernels/isa_baseline.c"],
            depends=["runtime/kernels/ort_api.h", "runtime/kernels/ort_ops.h", "runtime/kernels/paged_attention.h",
                     "runtime/kernels/cpu_kernels.h", "runtime/kernels/cpu_kernels_impl.h",
                     "runtime/kernels/cpu_kernels_rows.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-psabi", "-fno-trapping-math"],
        ),
    ]
)
