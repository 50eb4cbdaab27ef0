/* The custom op optimize.SiluMul: a SwiGLU MLP's Split + SiLU + Mul as one node.
 *
 * y [.., I] = silu(x[.., :I]) * x[.., I:] for x [.., 2I]: a SwiGLU MLP's Split + QuickGelu(alpha 1) + Mul in
 * one pass over the fused gate/up projection's output (compiler/fusion/swiglu.py). With the optional second
 * input s [.., 1], x's row r is first multiplied by s[r] in float32 (x * s rounded, as the Mul by a per-token
 * INT8 GEMM's row scale that it replaces computes it: compiler/fusion/row_scale.py). silu(g) = g * sigmoid(g)
 * with sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (vexp2_neg, ~2 ulp), so
 * neither branch overflows. Rows of a decode step run inline; long prefills split into items of 64K
 * elements on ONNX Runtime's pool (the work item, per code path: silu_mul_item in cpu_kernels_impl.h).
 */
#include "ort_ops.h"

static OrtStatus *compute(const OpKernel *kern, OrtKernelContext *ctx) {
    const char *opname = kern->desc->name;
    char msg[256];
    Tensor x;
    OrtStatus *st = ort_read_rows(ctx, opname, &x);
    if (st) return st;
    const int64_t last = x.dims[x.rank - 1];
    if (last % 2) FAIL("x's last dimension (%lld) must be even: gate and up halves", (long long)last);
    int64_t rows = 1, out_dims[4];
    for (size_t i = 0; i + 1 < x.rank; i++) {
        rows *= x.dims[i];
        out_dims[i] = x.dims[i];
    }
    out_dims[x.rank - 1] = last / 2;
    /* the optional row scale: one float32 per row of x ([.., 1], QuantizeRows' scale output) */
    const float *row_scale = NULL;
    if ((st = ort_read_row_scale(ctx, opname, 1, x.rank, rows, &row_scale))) return st;
    OrtValue *y_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, x.rank, &y_v)))
        return st;
    if (rows == 0 || last == 0) return NULL;
    SmJob job = {(const float *)x.data, row_scale, NULL, last / 2, 0, rows};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(y_v, (void **)&job.y))) return st;
    return ort_run_rows(ctx, kern->paths->silu_mul_item, &job, rows, last, &job.rows_per_item);
}

/* x float32, optional row scale s float32 -> y float32; no attributes */
const OpDesc optimize_op_silu_mul = {
    .name = "SiluMul",
    .input_types = "FF",
    .optional_inputs = 1,
    .output_types = "F",
    .kernel_size = sizeof(OpKernel),
    .compute = compute,
};
