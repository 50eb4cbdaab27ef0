/* The custom op optimize.SkipNormQuantize: residual add, RMS norm and per-token INT8 quantization as one node.
 *
 * A W8A8 decoder layer (quantize_int8 with per-token activations) ends its attention and its MLP as
 *
 *   y = Mul(MatMulIntegerToFloat(..), s)                      the projection times its input's row scale
 *   n, sum = SkipSimplifiedLayerNormalization(y, skip, gamma)  (com.microsoft; sum: the residual stream)
 *   codes, scale = QuantizeRows(n)                             the next projection's input
 *
 * compiler/fusion/skip_norm_quantize.py writes SkipNormQuantize(x, skip, gamma[, s]) -> (codes, scale, sum)
 * instead: one pass over x and skip writes sum, the normalized row lives in a row of scratch, and neither the
 * scaled projection nor the normalized tensor is written to memory. The arithmetic is that of the three nodes,
 * operation for operation: sum = x * s + skip (the product rounded first), the mean square added in float32
 * element after element as ONNX Runtime's CPU SkipSimplifiedLayerNormalization adds it, rms = sqrt(ms / D +
 * epsilon), n = sum / rms * gamma, then QuantizeRows' codes and scale, so all three outputs are bit-identical
 * to the nodes it replaces (tests/test_paged_cpu_kernel.py). Rows of a decode step run inline; larger inputs
 * split into items of at least 64K elements on ONNX Runtime's pool (the work item, per code path:
 * skip_norm_quantize_item in cpu_kernels_impl.h).
 */
#include <math.h>

#include "ort_ops.h"

typedef struct {
    OpKernel base;
    float epsilon;
} SnqKernel;

static OrtStatus *init(OpKernel *kernel, const OrtKernelInfo *info) {
    SnqKernel *k = (SnqKernel *)kernel;
    const char *opname = kernel->desc->name;
    char msg[256];
    OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_float, OrtKernelInfoGetAttributeFloatFn)(info, "epsilon",
                                                                                                  &k->epsilon);
    if (st) return st;
    if (!(k->epsilon >= 0.0f) || !isfinite(k->epsilon)) FAIL("epsilon must be finite and >= 0, got %g", k->epsilon);
    return NULL;
}

static OrtStatus *compute(const OpKernel *kern, OrtKernelContext *ctx) {
    const char *opname = kern->desc->name;
    char msg[256];
    Tensor x, skip, gamma;
    OrtStatus *st = ort_read_rows(ctx, opname, &x);
    if (st) return st;
    if ((st = ort_read_input(ctx, 1, &skip)) || (st = ort_read_input(ctx, 2, &gamma))) return st;
    const int64_t D = x.dims[x.rank - 1];
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < x.rank; i++) rows *= x.dims[i];
    if (skip.rank != x.rank || memcmp(skip.dims, x.dims, sizeof(int64_t) * x.rank) != 0)
        FAIL("skip must have x's shape");
    if (gamma.rank != 1 || gamma.dims[0] != D) FAIL("gamma must be [%lld], x's last dimension", (long long)D);
    const float *row_scale = NULL;
    if ((st = ort_read_row_scale(ctx, opname, 3, x.rank, rows, &row_scale))) return st;
    int64_t scale_dims[4];
    memcpy(scale_dims, x.dims, sizeof scale_dims);
    scale_dims[x.rank - 1] = 1;
    OrtValue *codes_v = NULL, *scale_v = NULL, *sum_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, x.dims, x.rank, &codes_v)) ||
        (st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 1, scale_dims, x.rank,
                                                                                   &scale_v)) ||
        (st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 2, x.dims, x.rank, &sum_v)))
        return st;
    if (rows == 0 || D == 0) return NULL;
    SnqJob job = {(const float *)x.data, row_scale, (const float *)skip.data, (const float *)gamma.data, NULL, NULL,
                  NULL, ((const SnqKernel *)kern)->epsilon, D, 0, rows, 0};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(codes_v, (void **)&job.codes)) ||
        (st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(scale_v, (void **)&job.scale)) ||
        (st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(sum_v, (void **)&job.sum)))
        return st;
    if ((st = ort_run_rows(ctx, kern->paths->skip_norm_quantize_item, &job, rows, D, &job.rows_per_item)))
        return st;
    if (job.failed) return ort_status(ORT_FAIL, "optimize.SkipNormQuantize: out of memory for a row of scratch");
    return NULL;
}

/* x float32, skip float32, gamma float32, optional row scale s float32 -> (codes uint8, scale float32,
 * sum float32); attribute epsilon (float, required) */
const OpDesc optimize_op_skip_norm_quantize = {
    .name = "SkipNormQuantize",
    .input_types = "FFFF",
    .optional_inputs = 1,
    .output_types = "QFF",
    .kernel_size = sizeof(SnqKernel),
    .init = init,
    .compute = compute,
};
