/* The registration helper of the custom-op library: what an op file (op_*.c) declares, and the helpers it shares.
 *
 * The library (runtime.kernels._paged_attention_cpu, registered by runtime/kernels/paged_attention_cpu.py) holds
 * one ONNX Runtime custom op per op_*.c file, all in the domain "optimize". An op file defines its kernel state,
 * its create and compute functions and one OpDesc: the op type, its inputs' and outputs' element types, how many
 * trailing inputs are optional. ort_ops.c turns each descriptor into an OrtCustomOp (a struct that embeds
 * OrtCustomOp as its first member and points at the descriptor, so every callback reads its op from the pointer
 * ONNX Runtime passes), registers them in the order of its table (RegisterCustomOps), chooses the per-CPU code
 * path of every op (OPTIMIZE_CPU_ISA; cpu_kernels.h) and reports the choice (optimize_kernel_paths).
 */
#ifndef OPTIMIZE_ORT_OPS_H
#define OPTIMIZE_ORT_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cpu_kernels.h"
#include "ort_api.h"

typedef struct OpDesc OpDesc;

/* The start of every op's kernel state (the op's own struct embeds it as its first member): set by ort_ops.c
 * when ONNX Runtime creates the kernel, before the op's init runs. */
typedef struct {
    const OpDesc *desc;
    const CpuKernels *paths; /* the op's code path, copied from the choice when ONNX Runtime creates the kernel */
} OpKernel;

struct OpDesc {
    const char *name;         /* the op type (domain "optimize") */
    const char *input_types;  /* one letter per input (ort_type_of): F float32, I int32, L int64, B bfloat16,
                               * Q uint8, U any (the op checks the element type itself) */
    size_t optional_inputs;   /* how many of the last inputs are optional */
    const char *output_types; /* one letter per output, as input_types */
    size_t kernel_size;       /* sizeof the op's kernel state (at least sizeof(OpKernel)); zeroed at creation */
    /* reads the node's attributes into the zeroed state (NULL: the op has none); an error fails the creation */
    OrtStatus *(*init)(OpKernel *kernel, const OrtKernelInfo *info);
    OrtStatus *(*compute)(const OpKernel *kernel, OrtKernelContext *ctx);
    /* called whenever the code paths are chosen (optimize_select_kernel_paths): the name the report gives the
     * op's path (NULL: the chosen path's name) */
    const char *(*choose_path)(const CpuKernels *chosen);
};

/* The ops, one per op_*.c file (ort_ops.c registers and reports them in this order). */
extern const OpDesc optimize_op_paged_attention HIDDEN;
extern const OpDesc optimize_op_rotary_paged_attention HIDDEN;
extern const OpDesc optimize_op_quantize_rows HIDDEN;
extern const OpDesc optimize_op_matmul_bf16 HIDDEN;
extern const OpDesc optimize_op_silu_mul HIDDEN;
extern const OpDesc optimize_op_skip_norm_quantize HIDDEN;

/* ONNX Runtime's function table, set by the first RegisterCustomOps (through ORT_FN: ort_api.h). */
extern const OrtApi *g_api HIDDEN;

/* A status ONNX Runtime raises in the caller as an exception. */
HIDDEN OrtStatus *ort_status(OrtErrorCode code, const char *msg);

/* The element type an input_types / output_types letter stands for. */
HIDDEN ONNXTensorElementDataType ort_type_of(char c);

/* Whether this CPU has a feature, as __builtin_cpu_supports names it ("avx512f", "avx512bf16", "avx2", "fma",
 * ...; always 0 off x86-64). */
HIDDEN int cpu_has(const char *feature);

/* ---- tensor access ----------------------------------------------------------------------------------- */

typedef struct {
    void *data;
    int64_t dims[4];
    size_t rank;
    ONNXTensorElementDataType type;
} Tensor;

/* Input `index` of the node: its data, element type and shape (rank 4 at most); an error when it is absent. */
HIDDEN OrtStatus *ort_read_input(OrtKernelContext *ctx, size_t index, Tensor *t);

/* Input 0 of a one-input op on rows (QuantizeRows, SiluMul): a float32 tensor of rank 1 or more. */
HIDDEN OrtStatus *ort_read_rows(OrtKernelContext *ctx, const char *opname, Tensor *x);

/* Input `index` of a rows op, when the node has it: one float32 per row of x (x's rank, last dimension 1, `rows`
 * values: QuantizeRows' scale output); *scale is NULL when the node has no such input. */
HIDDEN OrtStatus *ort_read_row_scale(OrtKernelContext *ctx, const char *opname, size_t index, size_t rank,
                                     int64_t rows, const float **scale);

/* Run `item` over `rows` rows of `width` elements: items of whole rows, at least 64K elements each (a decode
 * step's few rows run inline, larger inputs on ONNX Runtime's pool). Sets *rows_per_item (a field of `job`)
 * before the first item runs. */
HIDDEN OrtStatus *ort_run_rows(OrtKernelContext *ctx, void (*item)(void *job, size_t index), void *job,
                               int64_t rows, int64_t width, int64_t *rows_per_item);

/* Return an ORT_INVALID_ARGUMENT status "optimize.<opname>: <printf message>" (the caller declares the char
 * array `msg` and the string `opname`). */
#define FAIL(...)                                                                                          \
    do {                                                                                                   \
        int used_ = snprintf(msg, sizeof msg, "optimize.%s: ", opname);                                    \
        snprintf(msg + used_, sizeof msg - (size_t)used_, __VA_ARGS__);                                    \
        return ort_status(ORT_INVALID_ARGUMENT, msg);                                                      \
    } while (0)

#endif /* OPTIMIZE_ORT_OPS_H */
