/* The custom op optimize.MatMulBf16: the weight product of an artifact built with target.matmul: bfloat16
 * (compiler/fusion/matmul_bf16.py writes it in place of a float MatMul / Gemm with a constant weight).
 *
 * y [.., N] = a [.., K] @ W [K, N] with W stored in bfloat16 and a rounded to bfloat16 on the way in
 * (round to nearest, ties to even), products summed in float32. W comes packed in panels of 16 columns,
 * each column's K values in pairs (k, k + 1): w [ceil(N / 16), ceil(K / 2), 16, 2] (compiler/fusion/
 * matmul_bf16.py packs it; zeros pad N and K), so one 64-byte load holds a pair of rows of 16 columns,
 * the operand layout of AVX-512 BF16's vdpbf16ps. Where the CPU has it the kernel multiplies with that
 * instruction (32 products per instruction, twice the float32 FMA's); elsewhere each path widens the
 * pairs to float32 in registers (a 16-bit shift, exact) and uses FMA (AVX2, AVX-512) or multiply + add
 * (baseline): the same products of the same bf16 values, half the weight bytes of float32 read from
 * memory; the rounded activations are then kept as float32, so broadcasting one is a single load.
 * Work items are (64 rows, 32 columns): the columns' panel pair stays in L2 while the rows pass over it, in
 * register tiles of rows x panels sized per path (cpu_kernels_impl.h); the avx512 path's vdpbf16ps tiles are in
 * isa_avx512.c.
 */
#include <stdlib.h>
#include <string.h>

#include "ort_ops.h"

typedef struct {
    OpKernel base;
    int64_t n_out; /* the attribute n: N */
    int dp;        /* multiplies with AVX-512 BF16's vdpbf16ps (the path chosen when the kernel was created) */
} Bf16Kernel;

/* the current choice: vdpbf16ps on the avx512 path where the CPU has AVX-512 BF16, unless OPTIMIZE_BF16_DOT=0 */
static int g_dp;

static const char *choose_path(const CpuKernels *chosen) {
    const char *dot = getenv("OPTIMIZE_BF16_DOT"); /* 0: the FMA tiles even where vdpbf16ps exists */
    g_dp = chosen->bf16_rows_dp && cpu_has("avx512bf16") && !(dot && strcmp(dot, "0") == 0);
    return g_dp ? "avx512_bf16" : chosen->name;
}

static OrtStatus *init(OpKernel *kernel, const OrtKernelInfo *info) {
    Bf16Kernel *k = (Bf16Kernel *)kernel;
    OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "n", &k->n_out);
    if (!st && k->n_out < 0) st = ort_status(ORT_INVALID_ARGUMENT, "optimize.MatMulBf16: n must not be negative");
    if (st) return st;
    k->dp = g_dp;
    return NULL;
}

/* one work item: rows [64 mi, 64 mi + 64) x the panel pair ci (32 columns) */
static void bf16_item(void *arg, size_t index) {
    const BfJob *job = (const BfJob *)arg;
    const int64_t mi = (int64_t)index / job->NC, ci = (int64_t)index % job->NC;
    const int64_t m0 = mi * BF_MC, nr = job->M - m0 < BF_MC ? job->M - m0 : BF_MC;
    const int64_t p0 = 2 * ci, has1 = p0 + 1 < job->NP;
    const uint32_t *w0 = job->w + p0 * job->KP * BF_PANEL, *w1 = has1 ? w0 + job->KP * BF_PANEL : w0;
    const int64_t n0 = p0 * BF_PANEL;
    const int64_t c0 = job->N - n0 < BF_PANEL ? job->N - n0 : BF_PANEL;
    const int64_t c1 = has1 ? (job->N - n0 - BF_PANEL < BF_PANEL ? job->N - n0 - BF_PANEL : BF_PANEL) : 0;
    const void *a = job->a_f32 ? (const void *)((const float *)job->ab + m0 * 2 * job->KP)
                               : (const void *)((const uint16_t *)job->ab + m0 * 2 * job->KP);
    float *y = job->y + m0 * job->N + n0;
    job->rows(a, job->KP, nr, w0, w1, job->KP, y, job->N, c0, c1);
}

static OrtStatus *compute(const OpKernel *kernel, OrtKernelContext *ctx) {
    const Bf16Kernel *kern = (const Bf16Kernel *)kernel;
    const char *opname = kernel->desc->name;
    char msg[256];
    Tensor a, w;
    OrtStatus *st = ort_read_input(ctx, 0, &a);
    if (!st) st = ort_read_input(ctx, 1, &w);
    if (st) return st;
    if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("a must be float32");
    if (w.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) FAIL("w must be bfloat16");
    if (a.rank < 1) FAIL("a must have rank 1 or more");
    const int64_t K = a.dims[a.rank - 1], N = kern->n_out, KP = (K + 1) / 2, NP = (N + BF_PANEL - 1) / BF_PANEL;
    if (w.rank != 4 || w.dims[0] != NP || w.dims[1] != KP || w.dims[2] != BF_PANEL || w.dims[3] != 2)
        FAIL("w must be packed as [ceil(N / 16) = %lld, ceil(K / 2) = %lld, 16, 2] for K = %lld, N = %lld",
             (long long)NP, (long long)KP, (long long)K, (long long)N);
    int64_t M = 1, out_dims[4];
    for (size_t i = 0; i + 1 < a.rank; i++) {
        M *= a.dims[i];
        out_dims[i] = a.dims[i];
    }
    out_dims[a.rank - 1] = N;
    OrtValue *out_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, a.rank, &out_v)))
        return st;
    if (M == 0 || N == 0) return NULL;
    BfJob job = {(const float *)a.data, NULL, (const uint32_t *)w.data, NULL, M, K, KP, N, NP, (NP + 1) / 2, 0,
                 kern->dp ? kernel->paths->bf16_rows_dp : kernel->paths->bf16_rows, !kern->dp};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(out_v, (void **)&job.y))) return st;
    if (K == 0) {
        memset(job.y, 0, sizeof(float) * (size_t)(M * N));
        return NULL;
    }
    job.ab = malloc((job.a_f32 ? sizeof(float) : sizeof(uint16_t)) * (size_t)(M * 2 * KP));
    if (!job.ab) FAIL("out of memory for the bfloat16 copy of a [%lld, %lld]", (long long)M, (long long)K);
    OrtKernelContextParallelForFn parallel_for =
        ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn);
    job.rows_per_conv = ((1 << 16) + K - 1) / K;
    const size_t conv_items = (size_t)((M + job.rows_per_conv - 1) / job.rows_per_conv);
    if (conv_items > 1)
        st = parallel_for(ctx, kernel->paths->bf16_convert_rows, conv_items, 0, &job);
    else
        kernel->paths->bf16_convert_rows(&job, 0);
    const size_t items = (size_t)(((M + BF_MC - 1) / BF_MC) * job.NC);
    /* below ~64K multiply-adds the fork/join costs more than it saves */
    if (!st && items > 1 && M * K * N >= (1 << 16))
        st = parallel_for(ctx, bf16_item, items, 0, &job);
    else if (!st)
        for (size_t i = 0; i < items; i++) bf16_item(&job, i);
    free(job.ab);
    return st;
}

/* a float32, w bfloat16 (packed) -> y float32; attribute n */
const OpDesc optimize_op_matmul_bf16 = {
    .name = "MatMulBf16",
    .input_types = "FB",
    .output_types = "F",
    .kernel_size = sizeof(Bf16Kernel),
    .init = init,
    .compute = compute,
    .choose_path = choose_path,
};
