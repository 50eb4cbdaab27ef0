/* The custom op optimize.QuantizeRows: the per-token activation quantization of INT8 W8A8 graphs as one node.
 *
 * compiler/quant/onnx_rules.py writes it as Abs, ReduceMax, Mul(1/127), Max(1e-12), Div, QuantizeLinear;
 * compiler/fusion/quantize_rows.py replaces those six nodes with this op: x [.., K] float32 ->
 * codes uint8 [.., K] = saturate(round_half_even(x / s) + 128), scale [.., 1] = max(amax(|x|) * (1/127), 1e-12),
 * the same float operations in the same order, so the codes are the ones the six nodes give. Rows of a decode
 * step run inline; larger inputs split into items of at least 64K elements on ONNX Runtime's pool (the work
 * item, per code path: quantize_rows_item in cpu_kernels_impl.h).
 */
#include <string.h>

#include "ort_ops.h"

static OrtStatus *compute(const OpKernel *kern, OrtKernelContext *ctx) {
    Tensor x;
    OrtStatus *st = ort_read_rows(ctx, kern->desc->name, &x);
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
    return ort_run_rows(ctx, kern->paths->quantize_rows_item, &job, rows, K, &job.rows_per_item);
}

/* x float32 -> (codes uint8, scale float32); no attributes */
const OpDesc optimize_op_quantize_rows = {
    .name = "QuantizeRows",
    .input_types = "F",
    .output_types = "QF",
    .kernel_size = sizeof(OpKernel),
    .compute = compute,
};
