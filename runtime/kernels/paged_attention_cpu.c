/* Paged attention for ONNX Runtime CPU: the custom op optimize.PagedAttention (domain "optimize").
 *
 * One node per layer over the ForwardBatch's packed tokens (compiler/attention/lowering.py emits it):
 *
 *   inputs   query [T, H*D], key [T, KVH*D], value [T, KVH*D]       this step's tokens (after RoPE)
 *            key_cache, value_cache [num_blocks, block_size, KVH, D] the layer's pools (float32 or int8)
 *            cu_seqlens int32 [B+1], past_lens int32 [B], block_table int32 [B, max_blocks]
 *            k_scale, v_scale [KVH] (optional; int8 pools only)      one scale per KV head
 *   attrs    num_heads, kv_num_heads, scale, local_window_size (-1: none)
 *   output   [T, H*D]
 *
 * int8 pools (quantize_kv_cache int8): the step's K/V are stored as QuantizeLinear writes them
 * (round_half_even(x / scale), saturated, zero point 0); a past key chunk is dequantized (code * scale)
 * into the work item's scratch before use, while the step's own keys and values are read unquantized,
 * as the decomposed path attends to them, so both paths give the same numbers.
 *
 * Token i of sequence b (packed row cu_seqlens[b] + i) sits at position p = past_lens[b] + i. The op
 * first writes the step's K/V into the pools in place at block_table[b][p / block_size], offset
 * p % block_size (the slots the runtime's scheduler assigns), then attends each token to positions
 * [lo, p] of its own sequence read from the pools through the block table, lo = p - window + 1 (>= 0)
 * with a sliding window, else 0. No past is gathered into new tensors and no token of one sequence is
 * scored against another's.
 *
 * Work is split into items (sequence, KV head, query tile); a tile holds up to QT query tokens times
 * the G = H / KVH query heads that share the KV head, so every key row read from the pool serves all G
 * heads. Per item: keys in chunks of VL positions (a code path's float lanes), an online softmax in base 2
 * (running max and sum per query row, float32 accumulation), the weighted values accumulated per row.
 * Items of 16 rows or more (prefill tiles) put VL query rows in the vector lanes (attend_lanes: Q
 * transposed once, a broadcast key or value element per multiply-add, the softmax per lane); smaller ones
 * (decode) take a dot product per (row, key), vectorized over the head dimension. Items run on ONNX
 * Runtime's intra-op thread pool (KernelContext_ParallelFor), the session's own threads; a step too small
 * to pay for a fork/join runs inline.
 *
 * Code paths per CPU: the work items of every op (cpu_kernels_impl.h) are compiled three times, for
 * AVX-512 (16 lanes, isa_avx512.c, plus vdpbf16ps for MatMulBf16 where AVX-512 BF16 exists), AVX2 + FMA
 * (8 lanes, isa_avx2.c) and baseline SSE2 (4 lanes, isa_baseline.c). At registration each op gets the
 * widest path the CPU supports (__builtin_cpu_supports, which also checks that the OS saves the
 * registers), or the one OPTIMIZE_CPU_ISA=avx512|avx2|baseline pins: a pin the CPU cannot run fails the
 * registration naming the missing features. optimize_kernel_paths() reports the choice as JSON (op ->
 * path); a kernel keeps the path it was created with. No ifunc resolvers: the choice is a plain function
 * pointer, which AddressSanitizer builds (scripts/memcheck.sh) keep.
 *
 * The second op, optimize.RotaryPagedAttention, takes the QKV projection's output as it is and applies the
 * rotary embedding itself (what ONNX Runtime's RotaryEmbedding computes), so that a decoder layer's
 * attention is one node from the fused QKV Gemm to o_proj (compiler/fusion/attention.py writes it):
 *
 *   inputs   qkv [T, (H + 2*KVH)*D]                   q | k | v of this step's tokens (before RoPE)
 *            positions int64 [T]                       each token's position (the rotation's row)
 *            cos_cache, sin_cache [P, R/2]              R = rotary_embedding_dim (0: D)
 *            key_cache, value_cache, cu_seqlens, past_lens, block_table   as above
 *   attrs    those above + rotary_embedding_dim, interleaved (0: rotate-half pairs (i, i + R/2); 1: (2i, 2i+1))
 *   output   [T, H*D]
 *
 * K is rotated on its way into the pool and Q on its way into a work item's scratch; dimensions from R
 * on pass through unrotated. No [T, H*D] copy of the rotated queries is made.
 *
 * The third op, optimize.QuantizeRows, is the per-token activation quantization of INT8 W8A8 graphs
 * (compiler/quant/onnx_rules.py writes it as Abs, ReduceMax, Mul(1/127), Max(1e-12), Div, QuantizeLinear;
 * compiler/fusion/quantize_rows.py replaces those six nodes with it): x [.., K] float32 ->
 * codes uint8 [.., K] = saturate(round_half_even(x / s) + 128), scale [.., 1] = max(amax(|x|) * (1/127), 1e-12),
 * the same float operations in the same order, so the codes are the ones the six nodes give.
 *
 * optimize.MatMulBf16 (below) multiplies by bfloat16 weights (target.matmul: bfloat16); optimize.SiluMul
 * (below) is a SwiGLU MLP's Split + SiLU + Mul as one node: x [.., 2I] -> silu(x[.., :I]) * x[.., I:], with an
 * optional per-row scale s [.., 1] applied to x first (a per-token INT8 GEMM's row scale).
 *
 * Every index is validated before anything is written: a block table entry outside the pool, a
 * sequence longer than its table, or shapes that disagree return an error status (ONNX Runtime raises
 * it as an exception in the caller) and leave the pools untouched.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "ort_api.h"

#define DOMAIN "optimize"
#define OP_NAME "PagedAttention"
#define ROPE_OP_NAME "RotaryPagedAttention"
#define QROWS_OP_NAME "QuantizeRows"
#define ROWS_TARGET 64 /* query rows (tokens x group heads) per work item, at most */
#define INLINE_WORK (1 << 18) /* multiply-adds below which a step runs without the thread pool */

static const OrtApi *g_api;
static OrtCustomOpDomain *g_domain;

static OrtStatus *status(OrtErrorCode code, const char *msg) {
    return ORT_FN(g_api, CreateStatus, OrtCreateStatusFn)(code, msg);
}

/* ---- the code path per op: chosen from the CPU's features, pinned by OPTIMIZE_CPU_ISA, reported ---------- */

/* The ops, in the order optimize_kernel_paths() reports them. */
enum { OPI_PAGED, OPI_ROPE, OPI_QROWS, OPI_BF16, OPI_SILU, N_OPS };
static const char *const g_op_names[N_OPS] = {"PagedAttention", "RotaryPagedAttention", "QuantizeRows",
                                              "MatMulBf16", "SiluMul"};

/* The paths, widest first, and the CPU features each needs (as __builtin_cpu_supports names them). */
typedef struct {
    const char *name;
    const CpuKernels *kernels;
    const char *const *needs;
} IsaPath;

#ifdef OPTIMIZE_X86_PATHS
static const char *const g_avx512_needs[] = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", NULL};
static const char *const g_avx2_needs[] = {"avx2", "fma", NULL};
#endif
static const char *const g_no_needs[] = {NULL};
static const IsaPath g_paths[] = {
#ifdef OPTIMIZE_X86_PATHS
    {"avx512", &optimize_kernels_avx512, g_avx512_needs},
    {"avx2", &optimize_kernels_avx2, g_avx2_needs},
#endif
    {"baseline", &optimize_kernels_baseline, g_no_needs},
};
#define N_PATHS (sizeof g_paths / sizeof g_paths[0])

static int cpu_has(const char *feature) {
#ifdef OPTIMIZE_X86_PATHS
    /* __builtin_cpu_supports takes string literals only */
#define HAS(f) if (strcmp(feature, f) == 0) return __builtin_cpu_supports(f)
    __builtin_cpu_init();
    HAS("avx512f");
    HAS("avx512bw");
    HAS("avx512dq");
    HAS("avx512vl");
    HAS("avx512bf16");
    HAS("avx2");
    HAS("fma");
#undef HAS
#endif
    (void)feature;
    return 0;
}

/* the features of path p this CPU lacks, space-separated into buf ("" when it can run p) */
static const char *missing_features(const IsaPath *p, char *buf, size_t size) {
    buf[0] = '\0';
    for (const char *const *f = p->needs; *f; f++)
        if (!cpu_has(*f)) {
            size_t used = strlen(buf);
            snprintf(buf + used, size - used, "%s%s", used ? " " : "", *f);
        }
    return buf;
}

/* The current choice: set by optimize_select_kernel_paths (which ONNX Runtime's registration calls when
 * nothing chose yet). A kernel copies its op's path when ONNX Runtime creates it, so a session keeps the
 * path it was created with. */
static const CpuKernels *g_sel[N_OPS];
static int g_bf16_dp;     /* MatMulBf16 takes vdpbf16ps */
static char g_source[32]; /* "cpu" (the widest this CPU runs), "OPTIMIZE_CPU_ISA", or "call" */
static char g_error[320];
static char g_report[1024];

static void write_report(void) {
    char feats[160] = "";
    static const char *const all[] = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16", "avx2", "fma"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (cpu_has(all[i])) {
            size_t used = strlen(feats);
            snprintf(feats + used, sizeof feats - used, "%s\"%s\"", used ? ", " : "", all[i]);
        }
    char avail[96] = "";
    char miss[96];
    for (size_t i = 0; i < N_PATHS; i++)
        if (!*missing_features(&g_paths[i], miss, sizeof miss)) {
            size_t used = strlen(avail);
            snprintf(avail + used, sizeof avail - used, "%s\"%s\"", used ? ", " : "", g_paths[i].name);
        }
    int n = snprintf(g_report, sizeof g_report, "{\"isa\": \"%s\", \"source\": \"%s\", \"available\": [%s], "
                     "\"cpu_features\": [%s], \"ops\": {", g_sel[0]->name, g_source, avail, feats);
    for (int op = 0; op < N_OPS && n > 0 && (size_t)n < sizeof g_report; op++)
        n += snprintf(g_report + n, sizeof g_report - (size_t)n, "%s\"%s\": \"%s\"", op ? ", " : "", g_op_names[op],
                      op == OPI_BF16 && g_bf16_dp ? "avx512_bf16" : g_sel[op]->name);
    if (n > 0 && (size_t)n < sizeof g_report) snprintf(g_report + n, sizeof g_report - (size_t)n, "}}");
}

/* Choose every op's path: `request` "avx512", "avx2" or "baseline" pins it (NULL: OPTIMIZE_CPU_ISA's value;
 * unset, empty or "auto": the widest path this CPU runs). A pinned path this CPU cannot run, or an unknown
 * name, is an error (-1; optimize_kernel_error() says which features are missing): a pin never falls back
 * silently. MatMulBf16 on the avx512 path multiplies with vdpbf16ps where the CPU has AVX-512 BF16, unless
 * OPTIMIZE_BF16_DOT=0. Returns 0 on success. */
__attribute__((visibility("default"))) int optimize_select_kernel_paths(const char *request) {
    const char *source = request ? "call" : "OPTIMIZE_CPU_ISA";
    const char *want = request ? request : getenv("OPTIMIZE_CPU_ISA");
    const IsaPath *chosen = NULL;
    char miss[96];
    if (!want || !*want || strcmp(want, "auto") == 0) {
        for (size_t i = 0; i < N_PATHS && !chosen; i++)
            if (!*missing_features(&g_paths[i], miss, sizeof miss)) chosen = &g_paths[i];
        source = "cpu";
    } else {
        for (size_t i = 0; i < N_PATHS && !chosen; i++)
            if (strcmp(want, g_paths[i].name) == 0) chosen = &g_paths[i];
        if (!chosen) {
            snprintf(g_error, sizeof g_error, "%s=%.40s is not a code path of this build (avx512, avx2, baseline "
                     "or auto on x86-64; baseline or auto elsewhere)", request ? "cpu isa" : "OPTIMIZE_CPU_ISA", want);
            return -1;
        }
        if (*missing_features(chosen, miss, sizeof miss)) {
            snprintf(g_error, sizeof g_error, "%s=%s asks for the %s code path, but this CPU lacks %s",
                     request ? "cpu isa" : "OPTIMIZE_CPU_ISA", chosen->name, chosen->name, miss);
            return -1;
        }
    }
    for (int op = 0; op < N_OPS; op++) g_sel[op] = chosen->kernels;
    const char *dot = getenv("OPTIMIZE_BF16_DOT"); /* 0: the FMA tiles even where vdpbf16ps exists */
    g_bf16_dp = chosen->kernels->bf16_rows_dp && cpu_has("avx512bf16") && !(dot && strcmp(dot, "0") == 0);
    snprintf(g_source, sizeof g_source, "%s", source);
    g_error[0] = '\0';
    write_report();
    return 0;
}

/* JSON: {"isa", "source" (cpu | OPTIMIZE_CPU_ISA | call), "available": [paths this CPU runs], "cpu_features",
 * "ops": {op: path}} of the current choice (made from OPTIMIZE_CPU_ISA first if none was); on an error,
 * {"error": "..."}. */
__attribute__((visibility("default"))) const char *optimize_kernel_paths(void) {
    if (!g_sel[0] && optimize_select_kernel_paths(NULL) != 0) {
        snprintf(g_report, sizeof g_report, "{\"error\": \"%s\"}", g_error);
        return g_report;
    }
    return g_report;
}

/* The last optimize_select_kernel_paths error ("" when it succeeded). */
__attribute__((visibility("default"))) const char *optimize_kernel_error(void) { return g_error; }

/* ---- kernel state ------------------------------------------------------------------------------------ */

typedef struct {
    int64_t num_heads, kv_heads, window;
    float scale;
    int64_t inline_work; /* below this many multiply-adds a step runs without the thread pool */
    int rope;            /* RotaryPagedAttention: packed qkv input, rotary applied here */
    int qrows;           /* QuantizeRows (no attributes; none of the fields above) */
    int bf16;            /* MatMulBf16 (attribute n: n_out) */
    int bf16_dp;         /* MatMulBf16 multiplies with AVX-512 BF16's vdpbf16ps */
    const CpuKernels *paths; /* the op's code path, copied from the choice when ONNX Runtime creates the kernel */
    int silu_mul;        /* SiluMul (no attributes) */
    int64_t n_out;
    int64_t rotary_dim;  /* 0: head_dim */
    int64_t interleaved;
} Kernel;

/* ---- tensor access ----------------------------------------------------------------------------------- */

typedef struct {
    void *data;
    int64_t dims[4];
    size_t rank;
    ONNXTensorElementDataType type;
} Tensor;

static OrtStatus *read_input(OrtKernelContext *ctx, size_t index, Tensor *t) {
    const OrtValue *v = NULL;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, index, &v);
    if (st) return st;
    if (!v) return status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: a required input is missing");
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((st = ORT_FN(g_api, GetTensorTypeAndShape, OrtGetTensorTypeAndShapeFn)(v, &info))) return st;
    st = ORT_FN(g_api, GetTensorElementType, OrtGetTensorElementTypeFn)(info, &t->type);
    if (!st) st = ORT_FN(g_api, GetDimensionsCount, OrtGetDimensionsCountFn)(info, &t->rank);
    if (!st && t->rank > 4) st = status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: input rank above 4");
    if (!st) st = ORT_FN(g_api, GetDimensions, OrtGetDimensionsFn)(info, t->dims, t->rank);
    ORT_FN(g_api, ReleaseTensorTypeAndShapeInfo, OrtReleaseTensorTypeAndShapeInfoFn)(info);
    if (st) return st;
    return ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)((OrtValue *)v, &t->data);
}

#define FAIL(...)                                                                                          \
    do {                                                                                                   \
        int used_ = snprintf(msg, sizeof msg, "optimize.%s: ", opname);                                    \
        snprintf(msg + used_, sizeof msg - (size_t)used_, __VA_ARGS__);                                    \
        return status(ORT_INVALID_ARGUMENT, msg);                                                          \
    } while (0)

/* Element types of the two ops' inputs (F float32, I int32, L int64, U any: the pools are float32 or
 * int8), in order; the last two (k_scale, v_scale) are optional. */
static const char PLAIN_TYPES[] = "FFFUUIIIFF";
static const char ROPE_TYPES[] = "FLFFUUIIIFF";
#define N_SCALES 2

static ONNXTensorElementDataType type_of(char c) {
    return c == 'F' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : c == 'I' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
         : c == 'B' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16
         : c == 'U' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

static OrtStatus *quantize_rows_compute(const Kernel *kern, OrtKernelContext *ctx);
static OrtStatus *matmul_bf16_compute(const Kernel *kern, OrtKernelContext *ctx);
static OrtStatus *silu_mul_compute(const Kernel *kern, OrtKernelContext *ctx);

static OrtStatus *compute(void *op_kernel, OrtKernelContext *ctx) {
    const Kernel *k = (const Kernel *)op_kernel;
    if (k->qrows) return quantize_rows_compute(k, ctx);
    if (k->bf16) return matmul_bf16_compute(k, ctx);
    if (k->silu_mul) return silu_mul_compute(k, ctx);
    const char *opname = k->rope ? ROPE_OP_NAME : OP_NAME;
    const char *types = k->rope ? ROPE_TYPES : PLAIN_TYPES;
    const size_t n_all = strlen(types), n_req = n_all - N_SCALES;
    char msg[320];
    Tensor in[11];
    size_t count = 0;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInputCount, OrtKernelContextGetInputCountFn)(ctx, &count);
    if (st) return st;
    if (count != n_req && count != n_all) FAIL("expects %zu inputs (%zu with k_scale and v_scale), got %zu", n_req,
                                               n_all, count);
    size_t n_in = n_req;
    for (size_t i = 0; i < n_req; i++)
        if ((st = read_input(ctx, i, &in[i]))) return st;
    if (count == n_all) { /* the scales, when the node has them (an absent optional input reads as NULL) */
        const OrtValue *v = NULL;
        if ((st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, n_req, &v))) return st;
        if (v) {
            n_in = n_all;
            for (size_t i = n_req; i < n_all; i++)
                if ((st = read_input(ctx, i, &in[i]))) return st;
        }
    }
    static const char *plain_names[10] = {"query", "key", "value", "key_cache", "value_cache", "cu_seqlens",
                                          "past_lens", "block_table", "k_scale", "v_scale"};
    static const char *rope_names[11] = {"qkv", "positions", "cos_cache", "sin_cache", "key_cache", "value_cache",
                                         "cu_seqlens", "past_lens", "block_table", "k_scale", "v_scale"};
    static const size_t plain_ranks[10] = {2, 2, 2, 4, 4, 1, 1, 2, 1, 1};
    static const size_t rope_ranks[11] = {2, 1, 2, 2, 4, 4, 1, 1, 2, 1, 1};
    const char *const *names = k->rope ? rope_names : plain_names;
    const size_t *ranks = k->rope ? rope_ranks : plain_ranks;
    for (size_t i = 0; i < n_in; i++) {
        if (types[i] == 'U') {
            if (in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
                FAIL("%s must be float32 or int8", names[i]);
        } else if (in[i].type != type_of(types[i])) {
            FAIL("%s must be %s", names[i], types[i] == 'F' ? "float32" : types[i] == 'I' ? "int32" : "int64");
        }
        if (in[i].rank != ranks[i]) FAIL("%s must have rank %zu, has %zu", names[i], ranks[i], in[i].rank);
    }
    /* the pools and the step description sit at the same places after the first `base` inputs */
    const Tensor *kct = &in[k->rope ? 4 : 3], *vct = &in[k->rope ? 5 : 4], *cut = &in[k->rope ? 6 : 5];
    const Tensor *pastt = &in[k->rope ? 7 : 6], *btt = &in[k->rope ? 8 : 7];
    const int64_t T = in[0].dims[0], H = k->num_heads, KVH = k->kv_heads;
    const int64_t NB = kct->dims[0], BS = kct->dims[1], D = kct->dims[3];
    const int64_t B = pastt->dims[0], MB = btt->dims[1];
    if (kct->dims[2] != KVH) FAIL("key_cache has %lld KV heads, kv_num_heads is %lld",
                                  (long long)kct->dims[2], (long long)KVH);
    if (vct->type != kct->type) FAIL("key_cache and value_cache must have one element type");
    const int pools_i8 = kct->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (pools_i8 != (n_in == n_all)) FAIL("int8 pools take k_scale and v_scale (one per KV head); float32 pools none");
    const float *k_scale = NULL, *v_scale = NULL;
    if (pools_i8) {
        for (size_t i = n_req; i < n_all; i++)
            if (in[i].dims[0] != KVH) FAIL("%s must have kv_num_heads = %lld entries", names[i], (long long)KVH);
        k_scale = (const float *)in[n_req].data;
        v_scale = (const float *)in[n_req + 1].data;
        for (int64_t h = 0; h < KVH; h++)
            if (!(k_scale[h] > 0.0f) || !(v_scale[h] > 0.0f) || isinf(k_scale[h]) || isinf(v_scale[h]))
                FAIL("the KV scales must be positive and finite");
    }
    for (int d = 0; d < 4; d++)
        if (vct->dims[d] != kct->dims[d]) FAIL("value_cache's shape differs from key_cache's");
    /* where q, k and v of token t start, and the floats between two tokens' rows */
    const float *qsrc = (const float *)in[0].data, *ksrc, *vsrc;
    int64_t q_stride, kv_stride, rdim = 0, rows = 0;
    const int64_t *pos = NULL;
    if (k->rope) {
        q_stride = kv_stride = (H + 2 * KVH) * D;
        if (in[0].dims[1] != q_stride) FAIL("qkv has %lld columns, (num_heads + 2 * kv_num_heads) * head_dim is %lld",
                                            (long long)in[0].dims[1], (long long)q_stride);
        ksrc = qsrc + H * D;
        vsrc = qsrc + (H + KVH) * D;
        rdim = k->rotary_dim > 0 ? k->rotary_dim : D;
        if (rdim > D || rdim % 2) FAIL("rotary_embedding_dim %lld must be even and at most head_dim %lld",
                                       (long long)rdim, (long long)D);
        if (in[1].dims[0] != T) FAIL("positions must have one entry per token");
        rows = in[2].dims[0];
        for (int i = 2; i < 4; i++)
            if (in[i].dims[0] != rows || in[i].dims[1] != rdim / 2)
                FAIL("%s must be [rows, rotary_embedding_dim / 2 = %lld]", names[i], (long long)(rdim / 2));
        pos = (const int64_t *)in[1].data;
        for (int64_t t = 0; t < T; t++)
            if (pos[t] < 0 || pos[t] >= rows)
                FAIL("position %lld of token %lld is outside the rotary cache of %lld rows", (long long)pos[t],
                     (long long)t, (long long)rows);
    } else {
        q_stride = H * D;
        kv_stride = KVH * D;
        if (in[0].dims[1] != H * D) FAIL("query has %lld columns, num_heads * head_dim is %lld",
                                         (long long)in[0].dims[1], (long long)(H * D));
        for (int i = 1; i < 3; i++)
            if (in[i].dims[0] != T || in[i].dims[1] != KVH * D)
                FAIL("%s must be [T, kv_num_heads * head_dim]", names[i]);
        ksrc = (const float *)in[1].data;
        vsrc = (const float *)in[2].data;
    }
    if (cut->dims[0] != B + 1) FAIL("cu_seqlens must have past_lens' length + 1");
    if (btt->dims[0] != B) FAIL("block_table must have one row per sequence");
    if (BS <= 0) FAIL("block_size must be positive");
    const int32_t *cu = (const int32_t *)cut->data, *past = (const int32_t *)pastt->data;
    const int32_t *bt = (const int32_t *)btt->data;
    if (cu[0] != 0) FAIL("cu_seqlens must start at 0");
    if (cu[B] != T) FAIL("cu_seqlens must end at the number of tokens (%lld)", (long long)T);
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        if (cu[b + 1] < cu[b]) FAIL("cu_seqlens must not decrease");
        if (past[b] < 0) FAIL("past_lens must not be negative");
        const int64_t total = (int64_t)past[b] + (cu[b + 1] - cu[b]);
        if (total == 0) continue;
        const int64_t need = (total + BS - 1) / BS;
        if (need > MB) FAIL("sequence %lld needs %lld blocks, its block_table row has %lld",
                            (long long)b, (long long)need, (long long)MB);
        for (int64_t j = 0; j < need; j++) {
            const int32_t blk = bt[b * MB + j];
            if (blk < 0 || blk >= NB) FAIL("block_table[%lld][%lld] = %d is outside the pool of %lld blocks",
                                           (long long)b, (long long)j, blk, (long long)NB);
        }
        const int64_t n = cu[b + 1] - cu[b];
        work += n * (k->window > 0 && k->window < total ? k->window : total) * H * D;
    }

    int64_t out_dims[2] = {T, H * D};
    OrtValue *out_value = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, 2, &out_value)))
        return st;
    if (T == 0) return NULL;
    float *out = NULL;
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(out_value, (void **)&out))) return st;

    /* this step's K/V into the pools, in place (K rotated on the way by RotaryPagedAttention; quantized per
     * KV head into int8 pools) */
    float *kc = pools_i8 ? NULL : (float *)kct->data, *vc = pools_i8 ? NULL : (float *)vct->data;
    int8_t *kc8 = pools_i8 ? (int8_t *)kct->data : NULL, *vc8 = pools_i8 ? (int8_t *)vct->data : NULL;
    const size_t row_bytes = sizeof(float) * (size_t)(KVH * D);
    const float *cos_c = k->rope ? (const float *)in[2].data : NULL, *sin_c = k->rope ? (const float *)in[3].data : NULL;
    /* int8 pools and rotary: the step's rotated keys [T][KVH * D], quantized into the pool and read unquantized
     * by the step itself */
    float *rot = NULL;
    if (pools_i8 && pos && !(rot = (float *)malloc(sizeof(float) * (size_t)(T * KVH * D + 1)))) FAIL("out of memory");
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = cu[b]; t < cu[b + 1]; t++) {
            const int64_t p = past[b] + (t - cu[b]);
            const int64_t slot = (int64_t)bt[b * MB + p / BS] * BS + p % BS;
            const float *ks = ksrc + t * kv_stride, *vs = vsrc + t * kv_stride;
            if (pools_i8) {
                for (int64_t h = 0; h < KVH; h++) {
                    const int64_t at = (slot * KVH + h) * D;
                    if (pos) {
                        float *r = rot + (t * KVH + h) * D;
                        rope_row(r, ks + h * D, D, rdim, k->interleaved, cos_c + pos[t] * (rdim / 2),
                                 sin_c + pos[t] * (rdim / 2), 1.0f);
                        quant_row(kc8 + at, r, D, k_scale[h]);
                    } else {
                        quant_row(kc8 + at, ks + h * D, D, k_scale[h]);
                    }
                    quant_row(vc8 + at, vs + h * D, D, v_scale[h]);
                }
                continue;
            }
            if (pos) {
                const float *c = cos_c + pos[t] * (rdim / 2), *s = sin_c + pos[t] * (rdim / 2);
                for (int64_t h = 0; h < KVH; h++)
                    rope_row(kc + (slot * KVH + h) * D, ks + h * D, D, rdim, k->interleaved, c, s, 1.0f);
            } else {
                memcpy(kc + slot * KVH * D, ks, row_bytes);
            }
            memcpy(vc + slot * KVH * D, vs, row_bytes);
        }
    }

    const int64_t G = H / KVH;
    /* query tokens per tile: at most ROWS_TARGET rows, a multiple of NR rows where G allows */
    int64_t step = NR;
    while (step > 1 && (G * step) % (2 * NR) == 0) step /= 2;
    while (step > 1 && (G * (step / 2)) % NR == 0) step /= 2;
    int64_t qt = ROWS_TARGET / G / step * step;
    if (qt < 1) qt = ROWS_TARGET / G > 0 ? ROWS_TARGET / G : 1;
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) n_items += KVH * ((cu[b + 1] - cu[b] + qt - 1) / qt);
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(n_items > 0 ? n_items : 1));
    if (!items) {
        free(rot);
        FAIL("out of memory");
    }
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = cu[b + 1] - cu[b];
        for (int64_t q1 = len; q1 > 0; q1 -= qt) { /* last tiles (the longest) first */
            const int64_t q0 = q1 - qt > 0 ? q1 - qt : 0;
            for (int64_t g = 0; g < KVH; g++) items[n++] = (Item){(int32_t)b, (int32_t)g, (int32_t)q0, (int32_t)q1};
        }
    }
    Job job = {qsrc, q_stride, pos, cos_c, sin_c, rdim, k->interleaved, kc, vc, kc8, vc8, k_scale, v_scale,
               rot ? rot : ksrc, vsrc, rot ? KVH * D : kv_stride, kv_stride, cu, past, bt, out, MB, BS, H, KVH,
               D, G, k->window, k->scale * 1.4426950408889634f, items, 0};
    OrtKernelContextParallelForFn parallel_for =
        ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn);
    if (work >= k->inline_work && n_items > 1) {
        st = parallel_for(ctx, k->paths->attention_item, (size_t)n_items, 0, &job);
    } else {
        for (int64_t i = 0; i < n_items; i++) k->paths->attention_item(&job, (size_t)i);
    }
    free(items);
    free(rot);
    if (st) return st;
    if (job.failed) {
        snprintf(msg, sizeof msg, "optimize.%s: out of memory for a work item's scratch", opname);
        return status(ORT_FAIL, msg);
    }
    return NULL;
}

/* ---- optimize.QuantizeRows ------------------------------------------------------------------------- */

/* input 0 of a one-input op on rows (QuantizeRows, SiluMul): a float32 tensor of rank 1 or more */
static OrtStatus *read_rows(OrtKernelContext *ctx, const char *opname, Tensor *x) {
    char msg[256];
    OrtStatus *st = read_input(ctx, 0, x);
    if (st) return st;
    if (x->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("x must be float32");
    if (x->rank < 1) FAIL("x must have rank 1 or more");
    return NULL;
}

static OrtStatus *quantize_rows_compute(const Kernel *kern, OrtKernelContext *ctx) {
    Tensor x;
    OrtStatus *st = read_rows(ctx, QROWS_OP_NAME, &x);
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
    /* items of at least 64K elements: a decode step's few rows run inline */
    job.rows_per_item = K > 0 ? ((1 << 16) + K - 1) / K : rows;
    if (job.rows_per_item < 1) job.rows_per_item = 1;
    const size_t items = (size_t)((rows + job.rows_per_item - 1) / job.rows_per_item);
    if (items > 1)
        return ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn)(ctx, kern->paths->quantize_rows_item, items, 0,
                                                                                      &job);
    kern->paths->quantize_rows_item(&job, 0);
    return NULL;
}

/* ---- optimize.MatMulBf16 ------------------------------------------------------------------------- */

/* y [.., N] = a [.., K] @ W [K, N] with W stored in bfloat16 and a rounded to bfloat16 on the way in
 * (round to nearest, ties to even), products summed in float32. W comes packed in panels of 16 columns,
 * each column's K values in pairs (k, k + 1): w [ceil(N / 16), ceil(K / 2), 16, 2] (compiler/fusion/
 * matmul_bf16.py packs it; zeros pad N and K), so one 64-byte load holds a pair of rows of 16 columns,
 * the operand layout of AVX-512 BF16's vdpbf16ps. Where the CPU has it the kernel multiplies with that
 * instruction (32 products per instruction, twice the float32 FMA's); elsewhere each path widens the
 * pairs to float32 in registers (a 16-bit shift, exact) and uses FMA (AVX2, AVX-512) or multiply + add
 * (baseline): the same products of the same bf16 values, half the weight bytes of float32 read from
 * memory; the rounded activations are then kept as float32, so broadcasting one is a single load. Work items are (64 rows, 32 columns): the columns' panel pair stays in L2 while the rows pass
 * over it, in register tiles of rows x panels sized per path (cpu_kernels_impl.h). */
#define BF_OP_NAME "MatMulBf16"

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

static OrtStatus *matmul_bf16_compute(const Kernel *kern, OrtKernelContext *ctx) {
    const char *opname = BF_OP_NAME;
    char msg[256];
    Tensor a, w;
    OrtStatus *st = read_input(ctx, 0, &a);
    if (!st) st = read_input(ctx, 1, &w);
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
                 kern->bf16_dp ? kern->paths->bf16_rows_dp : kern->paths->bf16_rows, !kern->bf16_dp};
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
        st = parallel_for(ctx, kern->paths->bf16_convert_rows, conv_items, 0, &job);
    else
        kern->paths->bf16_convert_rows(&job, 0);
    const size_t items = (size_t)(((M + BF_MC - 1) / BF_MC) * job.NC);
    /* below ~64K multiply-adds the fork/join costs more than it saves */
    if (!st && items > 1 && M * K * N >= (1 << 16))
        st = parallel_for(ctx, bf16_item, items, 0, &job);
    else if (!st)
        for (size_t i = 0; i < items; i++) bf16_item(&job, i);
    free(job.ab);
    return st;
}

/* ---- optimize.SiluMul ----------------------------------------------------------------------------- */

/* y [.., I] = silu(x[.., :I]) * x[.., I:] for x [.., 2I]: a SwiGLU MLP's Split + QuickGelu(alpha 1) + Mul in
 * one pass over the fused gate/up projection's output (compiler/fusion/swiglu.py). With the optional second
 * input s [.., 1], x's row r is first multiplied by s[r] in float32 (x * s rounded, as the Mul by a per-token
 * INT8 GEMM's row scale that it replaces computes it: compiler/fusion/row_scale.py). silu(g) = g * sigmoid(g)
 * with sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (vexp2_neg, ~2 ulp), so
 * neither branch overflows. Rows of a decode step run inline; long prefills split into items of 64K
 * elements on ONNX Runtime's pool. */
#define SM_OP_NAME "SiluMul"

static OrtStatus *silu_mul_compute(const Kernel *kern, OrtKernelContext *ctx) {
    const char *opname = SM_OP_NAME;
    char msg[256];
    Tensor x;
    OrtStatus *st = read_rows(ctx, opname, &x);
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
    size_t count = 0;
    if ((st = ORT_FN(g_api, KernelContext_GetInputCount, OrtKernelContextGetInputCountFn)(ctx, &count))) return st;
    if (count > 1) {
        Tensor s;
        if ((st = read_input(ctx, 1, &s))) return st;
        if (s.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("scale must be float32");
        int64_t n = 1;
        for (size_t i = 0; i < s.rank; i++) n *= s.dims[i];
        if (s.rank != x.rank || s.dims[s.rank - 1] != 1 || n != rows)
            FAIL("scale must hold one value per row of x ([.., 1], %lld rows), got %lld values", (long long)rows,
                 (long long)n);
        row_scale = (const float *)s.data;
    }
    OrtValue *y_v = NULL;
    if ((st = ORT_FN(g_api, KernelContext_GetOutput, OrtKernelContextGetOutputFn)(ctx, 0, out_dims, x.rank, &y_v)))
        return st;
    if (rows == 0 || last == 0) return NULL;
    SmJob job = {(const float *)x.data, row_scale, NULL, last / 2, 0, rows};
    if ((st = ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)(y_v, (void **)&job.y))) return st;
    job.rows_per_item = ((1 << 16) + last - 1) / last;
    const size_t items = (size_t)((rows + job.rows_per_item - 1) / job.rows_per_item);
    if (items > 1)
        return ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn)(ctx, kern->paths->silu_mul_item, items, 0,
                                                                                      &job);
    kern->paths->silu_mul_item(&job, 0);
    return NULL;
}

/* ---- the OrtCustomOp callbacks ----------------------------------------------------------------------- */

static OrtCustomOp g_op, g_rope_op, g_qrows_op, g_bf16_op, g_sm_op; /* defined below */

static OrtStatus *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)api;
    char msg[256];
    Kernel *k = (Kernel *)calloc(1, sizeof(Kernel));
    if (!k) return status(ORT_FAIL, "optimize.PagedAttention: out of memory");
    k->rope = op == &g_rope_op;
    k->qrows = op == &g_qrows_op;
    k->bf16 = op == &g_bf16_op;
    k->silu_mul = op == &g_sm_op;
    const int opi = k->rope ? OPI_ROPE : k->qrows ? OPI_QROWS : k->bf16 ? OPI_BF16 : k->silu_mul ? OPI_SILU : OPI_PAGED;
    k->paths = g_sel[opi] ? g_sel[opi] : &optimize_kernels_baseline; /* chosen at registration (set there) */
    if (k->qrows || k->silu_mul) {
        *out = k;
        return NULL;
    }
    if (k->bf16) {
        OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
            info, "n", &k->n_out);
        if (!st && k->n_out < 0) st = status(ORT_INVALID_ARGUMENT, "optimize.MatMulBf16: n must not be negative");
        if (st) {
            free(k);
            return st;
        }
        k->bf16_dp = g_bf16_dp;
        *out = k;
        return NULL;
    }
    const char *opname = k->rope ? ROPE_OP_NAME : OP_NAME;
    OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "num_heads", &k->num_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "kv_num_heads", &k->kv_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_float, OrtKernelInfoGetAttributeFloatFn)(
        info, "scale", &k->scale);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "local_window_size", &k->window);
    if (!st && k->rope) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "rotary_embedding_dim", &k->rotary_dim);
    if (!st && k->rope) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "interleaved", &k->interleaved);
    if (!st && (k->num_heads <= 0 || k->kv_heads <= 0 || k->num_heads % k->kv_heads)) {
        snprintf(msg, sizeof msg, "optimize.%s: num_heads %lld must be a positive multiple of "
                 "kv_num_heads %lld", opname, (long long)k->num_heads, (long long)k->kv_heads);
        st = status(ORT_INVALID_ARGUMENT, msg);
    }
    if (!st && (k->rotary_dim < 0 || k->rotary_dim % 2 || (k->interleaved != 0 && k->interleaved != 1))) {
        snprintf(msg, sizeof msg, "optimize.%s: rotary_embedding_dim %lld must be even and not negative, "
                 "interleaved %lld 0 or 1", opname, (long long)k->rotary_dim, (long long)k->interleaved);
        st = status(ORT_INVALID_ARGUMENT, msg);
    }
    if (st) {
        free(k);
        return st;
    }
    /* OPTIMIZE_PAGED_CPU_INLINE_WORK overrides the threshold (0: always the thread pool; tests use it) */
    const char *env = getenv("OPTIMIZE_PAGED_CPU_INLINE_WORK");
    k->inline_work = env && *env ? strtoll(env, NULL, 10) : INLINE_WORK;
    *out = k;
    return NULL;
}

static void *create_kernel_v1(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    void *k = NULL;
    OrtStatus *st = create_kernel(op, api, info, &k);
    if (st) ORT_FN(g_api, ReleaseStatus, OrtReleaseStatusFn)(st);
    return k;
}

static void compute_v1(void *op_kernel, OrtKernelContext *ctx) {
    OrtStatus *st = compute(op_kernel, ctx);
    if (st) ORT_FN(g_api, ReleaseStatus, OrtReleaseStatusFn)(st);
}

static void destroy_kernel(void *op_kernel) { free(op_kernel); }
static const char *op_name(const OrtCustomOp *op) {
    return op == &g_rope_op    ? ROPE_OP_NAME
           : op == &g_qrows_op ? QROWS_OP_NAME
           : op == &g_bf16_op  ? BF_OP_NAME
           : op == &g_sm_op    ? SM_OP_NAME
                               : OP_NAME;
}
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static const char *op_types(const OrtCustomOp *op) {
    return op == &g_rope_op ? ROPE_TYPES : op == &g_qrows_op ? "F" : op == &g_sm_op ? "FF" : op == &g_bf16_op ? "FB"
                                                                                                : PLAIN_TYPES;
}
static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) { return type_of(op_types(op)[i]); }
static size_t input_count(const OrtCustomOp *op) { return strlen(op_types(op)); }
static ONNXTensorElementDataType output_type(const OrtCustomOp *op, size_t i) {
    /* QuantizeRows: (codes uint8, scale float32); the attention ops: output float32 */
    return op == &g_qrows_op && i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t output_count(const OrtCustomOp *op) { return op == &g_qrows_op ? 2 : 1; }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) {
    (void)op; (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
/* the attention ops' k_scale and v_scale (their last two inputs) are optional: int8 pools only; so is
 * SiluMul's row scale (its second input) */
static OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp *op, size_t i) {
    const int attention = op == &g_op || op == &g_rope_op;
    if (op == &g_sm_op) return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    return attention && i + N_SCALES >= input_count(op) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtMemType input_mem(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return OrtMemTypeDefault; }
static int one(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return INT_MAX; }
static size_t no_pairs(int **in, int **out) { *in = NULL; *out = NULL; return 0; }
static void release_pairs(int *in, int *out) { (void)in; (void)out; }

#define CUSTOM_OP                                                                                          \
    {                                                                                                      \
        ORT_API_VERSION_USED, create_kernel_v1, op_name, op_provider, input_type, input_count, output_type,  \
        output_count, compute_v1, destroy_kernel, input_characteristic, required, input_mem, one, one, one, one, \
        create_kernel, compute, NULL, start_version, end_version, no_pairs, release_pairs, no_pairs,         \
        release_pairs,                                                                                     \
    }
static OrtCustomOp g_op = CUSTOM_OP;
static OrtCustomOp g_rope_op = CUSTOM_OP; /* told apart by their addresses */
static OrtCustomOp g_qrows_op = CUSTOM_OP;
static OrtCustomOp g_bf16_op = CUSTOM_OP;
static OrtCustomOp g_sm_op = CUSTOM_OP;

/* ONNX Runtime's entry point for SessionOptions.register_custom_ops_library. */
__attribute__((visibility("default")))
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *api_base) {
    if (!g_api) {
        const OrtApi *api = api_base->GetApi(ORT_API_VERSION_USED);
        if (!api) {
            /* every runtime serves version 1 of the table, whose slot 0 is CreateStatus */
            char msg[160];
            snprintf(msg, sizeof msg, "optimize.PagedAttention: ONNX Runtime %s is older than API version %d "
                     "(onnxruntime 1.%d)", api_base->GetVersionString(), ORT_API_VERSION_USED, ORT_API_VERSION_USED);
            return ORT_FN(api_base->GetApi(1), CreateStatus, OrtCreateStatusFn)(ORT_FAIL, msg);
        }
        const char *info = ORT_FN(api, GetBuildInfoString, OrtGetBuildInfoStringFn)();
        if (!info || strncmp(info, "ORT Build Info", 14) != 0)
            return ORT_FN(api, CreateStatus, OrtCreateStatusFn)(
                ORT_FAIL, "optimize.PagedAttention: the OrtApi table's layout is not the one this library declares");
        g_api = api;
    }
    /* the code paths: the CPU's widest, or OPTIMIZE_CPU_ISA's pin, unless a caller chose already
     * (runtime/kernels/paged_attention_cpu.py chooses before every registration) */
    if (!g_sel[0] && optimize_select_kernel_paths(NULL) != 0) {
        char msg[400];
        snprintf(msg, sizeof msg, "optimize custom ops: %s", g_error);
        return ORT_FN(g_api, CreateStatus, OrtCreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
    }
    OrtStatus *st = NULL;
    if (!g_domain) {
        if ((st = ORT_FN(g_api, CreateCustomOpDomain, OrtCreateCustomOpDomainFn)(DOMAIN, &g_domain))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_rope_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_qrows_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_bf16_op))) return st;
        if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_sm_op))) return st;
    }
    return ORT_FN(g_api, AddCustomOpDomain, OrtAddCustomOpDomainFn)(options, g_domain);
}
