/* The custom-op library's registration with ONNX Runtime, and its choice of per-CPU code paths.
 *
 * ONNX Runtime loads the library (SessionOptions.register_custom_ops_library, from runtime/kernels/
 * paged_attention_cpu.py) and calls RegisterCustomOps, which adds the ops of g_ops (one OpDesc per op_*.c file,
 * ort_ops.h) to the custom-op domain "optimize". Each op is an OrtCustomOp whose callbacks are the generic ones
 * below: they read the op's descriptor through the struct that embeds the OrtCustomOp (its name, its inputs'
 * and outputs' element types, which inputs are optional), create the kernel state the descriptor sizes and call
 * the op's own init and compute. On the first registration the library asks for version ORT_API_VERSION_USED of
 * ONNX Runtime's function table (ort_api.h) and checks its layout.
 *
 * Code paths per CPU: the work items of every op (cpu_kernels_impl.h) are compiled three times, for AVX-512
 * (16 lanes, isa_avx512.c, plus vdpbf16ps for MatMulBf16 where AVX-512 BF16 exists), AVX2 + FMA (8 lanes,
 * isa_avx2.c) and baseline SSE2 (4 lanes, isa_baseline.c). At registration each op gets the widest path the CPU
 * supports (__builtin_cpu_supports, which also checks that the OS saves the registers), or the one
 * OPTIMIZE_CPU_ISA=avx512|avx2|baseline pins: a pin the CPU cannot run fails the registration naming the missing
 * features. optimize_kernel_paths() reports the choice as JSON (op -> path); a kernel keeps the path it was
 * created with. No ifunc resolvers: the choice is a plain function pointer, which AddressSanitizer builds
 * (scripts/memcheck.sh) keep.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_ops.h"

#define DOMAIN "optimize"

const OrtApi *g_api;
static OrtCustomOpDomain *g_domain;

OrtStatus *ort_status(OrtErrorCode code, const char *msg) {
    return ORT_FN(g_api, CreateStatus, OrtCreateStatusFn)(code, msg);
}

ONNXTensorElementDataType ort_type_of(char c) {
    return c == 'F' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : c == 'I' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
         : c == 'B' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16
         : c == 'Q' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
         : c == 'U' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

/* ---- tensor access ----------------------------------------------------------------------------------- */

/* (its two messages name optimize.PagedAttention whichever op reads: the library's first op, as they always did) */
OrtStatus *ort_read_input(OrtKernelContext *ctx, size_t index, Tensor *t) {
    const OrtValue *v = NULL;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, index, &v);
    if (st) return st;
    if (!v) return ort_status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: a required input is missing");
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((st = ORT_FN(g_api, GetTensorTypeAndShape, OrtGetTensorTypeAndShapeFn)(v, &info))) return st;
    st = ORT_FN(g_api, GetTensorElementType, OrtGetTensorElementTypeFn)(info, &t->type);
    if (!st) st = ORT_FN(g_api, GetDimensionsCount, OrtGetDimensionsCountFn)(info, &t->rank);
    if (!st && t->rank > 4) st = ort_status(ORT_INVALID_ARGUMENT, "optimize.PagedAttention: input rank above 4");
    if (!st) st = ORT_FN(g_api, GetDimensions, OrtGetDimensionsFn)(info, t->dims, t->rank);
    ORT_FN(g_api, ReleaseTensorTypeAndShapeInfo, OrtReleaseTensorTypeAndShapeInfoFn)(info);
    if (st) return st;
    return ORT_FN(g_api, GetTensorMutableData, OrtGetTensorMutableDataFn)((OrtValue *)v, &t->data);
}

OrtStatus *ort_read_rows(OrtKernelContext *ctx, const char *opname, Tensor *x) {
    char msg[256];
    OrtStatus *st = ort_read_input(ctx, 0, x);
    if (st) return st;
    if (x->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("x must be float32");
    if (x->rank < 1) FAIL("x must have rank 1 or more");
    return NULL;
}

OrtStatus *ort_read_row_scale(OrtKernelContext *ctx, const char *opname, size_t index, size_t rank, int64_t rows,
                              const float **scale) {
    char msg[256];
    size_t count = 0;
    *scale = NULL;
    OrtStatus *st = ORT_FN(g_api, KernelContext_GetInputCount, OrtKernelContextGetInputCountFn)(ctx, &count);
    if (st || count <= index) return st;
    Tensor s;
    if ((st = ort_read_input(ctx, index, &s))) return st;
    if (s.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) FAIL("scale must be float32");
    int64_t n = 1;
    for (size_t i = 0; i < s.rank; i++) n *= s.dims[i];
    if (s.rank != rank || s.dims[s.rank - 1] != 1 || n != rows)
        FAIL("scale must hold one value per row of x ([.., 1], %lld rows), got %lld values", (long long)rows,
             (long long)n);
    *scale = (const float *)s.data;
    return NULL;
}

OrtStatus *ort_run_rows(OrtKernelContext *ctx, void (*item)(void *job, size_t index), void *job, int64_t rows,
                        int64_t width, int64_t *rows_per_item) {
    *rows_per_item = width > 0 ? ((1 << 16) + width - 1) / width : rows;
    if (*rows_per_item < 1) *rows_per_item = 1;
    const size_t items = (size_t)((rows + *rows_per_item - 1) / *rows_per_item);
    if (items > 1)
        return ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn)(ctx, item, items, 0, job);
    item(job, 0);
    return NULL;
}

/* The current choice of code path (optimize_select_kernel_paths below; NULL until one is made). */
static const CpuKernels *g_sel;

/* ---- the OrtCustomOp callbacks: every op's, reading its descriptor ----------------------------------------- */

/* ONNX Runtime's view of an op: the callbacks get &RegisteredOp.op and read the descriptor behind it. */
typedef struct {
    OrtCustomOp op; /* first: a pointer to it is a pointer to the RegisteredOp */
    const OpDesc *desc;
} RegisteredOp;

static const OpDesc *desc_of(const OrtCustomOp *op) { return ((const RegisteredOp *)op)->desc; }

static OrtStatus *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)api;
    const OpDesc *d = desc_of(op);
    OpKernel *k = (OpKernel *)calloc(1, d->kernel_size);
    if (!k) return ort_status(ORT_FAIL, "optimize.PagedAttention: out of memory");
    k->desc = d;
    k->paths = g_sel ? g_sel : &optimize_kernels_baseline; /* chosen at registration (set there) */
    OrtStatus *st = d->init ? d->init(k, info) : NULL;
    if (st) {
        free(k);
        return st;
    }
    *out = k;
    return NULL;
}

static OrtStatus *compute(void *op_kernel, OrtKernelContext *ctx) {
    const OpKernel *k = (const OpKernel *)op_kernel;
    return k->desc->compute(k, ctx);
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
static const char *op_name(const OrtCustomOp *op) { return desc_of(op)->name; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) {
    return ort_type_of(desc_of(op)->input_types[i]);
}
static size_t input_count(const OrtCustomOp *op) { return strlen(desc_of(op)->input_types); }
static ONNXTensorElementDataType output_type(const OrtCustomOp *op, size_t i) {
    return ort_type_of(desc_of(op)->output_types[i]);
}
static size_t output_count(const OrtCustomOp *op) { return strlen(desc_of(op)->output_types); }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) {
    (void)op; (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
/* the descriptor's last optional_inputs inputs are optional (the attention ops' k_scale and v_scale: int8 pools
 * only; SiluMul's row scale) */
static OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp *op, size_t i) {
    return i + desc_of(op)->optional_inputs >= input_count(op) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtMemType input_mem(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return OrtMemTypeDefault; }
static int one(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return INT_MAX; }
static size_t no_pairs(int **in, int **out) { *in = NULL; *out = NULL; return 0; }
static void release_pairs(int *in, int *out) { (void)in; (void)out; }

#define REGISTERED(desc)                                                                                   \
    {                                                                                                      \
        {                                                                                                  \
            ORT_API_VERSION_USED, create_kernel_v1, op_name, op_provider, input_type, input_count,         \
            output_type, output_count, compute_v1, destroy_kernel, input_characteristic, required,          \
            input_mem, one, one, one, one, create_kernel, compute, NULL, start_version, end_version,         \
            no_pairs, release_pairs, no_pairs, release_pairs,                                              \
        },                                                                                                 \
        &(desc),                                                                                           \
    }

/* The ops, in the order RegisterCustomOps adds them and optimize_kernel_paths() reports them. */
static const RegisteredOp g_ops[] = {
    REGISTERED(optimize_op_paged_attention), REGISTERED(optimize_op_rotary_paged_attention),
    REGISTERED(optimize_op_quantize_rows), REGISTERED(optimize_op_matmul_bf16), REGISTERED(optimize_op_silu_mul),
    REGISTERED(optimize_op_skip_norm_quantize),
};
#define N_OPS (sizeof g_ops / sizeof g_ops[0])

/* ---- the code path per op: chosen from the CPU's features, pinned by OPTIMIZE_CPU_ISA, reported ---------- */

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

int cpu_has(const char *feature) {
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

/* The current choice (g_sel, above): set by optimize_select_kernel_paths (which ONNX Runtime's registration
 * calls when nothing chose yet). A kernel copies it when ONNX Runtime creates it, so a session keeps the path
 * it was created with. */
static const char *g_op_path[N_OPS]; /* the path each op reports (its choose_path, else g_sel's name) */
static char g_source[32];            /* "cpu" (the widest this CPU runs), "OPTIMIZE_CPU_ISA", or "call" */
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
                     "\"cpu_features\": [%s], \"ops\": {", g_sel->name, g_source, avail, feats);
    for (size_t op = 0; op < N_OPS && n > 0 && (size_t)n < sizeof g_report; op++)
        n += snprintf(g_report + n, sizeof g_report - (size_t)n, "%s\"%s\": \"%s\"", op ? ", " : "",
                      g_ops[op].desc->name, g_op_path[op]);
    if (n > 0 && (size_t)n < sizeof g_report) snprintf(g_report + n, sizeof g_report - (size_t)n, "}}");
}

/* Choose every op's path: `request` "avx512", "avx2" or "baseline" pins it (NULL: OPTIMIZE_CPU_ISA's value;
 * unset, empty or "auto": the widest path this CPU runs). A pinned path this CPU cannot run, or an unknown
 * name, is an error (-1; optimize_kernel_error() says which features are missing): a pin never falls back
 * silently. An op may refine the chosen path (its choose_path: MatMulBf16 on the avx512 path multiplies with
 * vdpbf16ps where the CPU has AVX-512 BF16, unless OPTIMIZE_BF16_DOT=0). Returns 0 on success. */
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
    g_sel = chosen->kernels;
    for (size_t op = 0; op < N_OPS; op++) {
        const OpDesc *d = g_ops[op].desc;
        g_op_path[op] = d->choose_path ? d->choose_path(g_sel) : g_sel->name;
    }
    snprintf(g_source, sizeof g_source, "%s", source);
    g_error[0] = '\0';
    write_report();
    return 0;
}

/* JSON: {"isa", "source" (cpu | OPTIMIZE_CPU_ISA | call), "available": [paths this CPU runs], "cpu_features",
 * "ops": {op: path}} of the current choice (made from OPTIMIZE_CPU_ISA first if none was); on an error,
 * {"error": "..."}. */
__attribute__((visibility("default"))) const char *optimize_kernel_paths(void) {
    if (!g_sel && optimize_select_kernel_paths(NULL) != 0) {
        snprintf(g_report, sizeof g_report, "{\"error\": \"%s\"}", g_error);
        return g_report;
    }
    return g_report;
}

/* The last optimize_select_kernel_paths error ("" when it succeeded). */
__attribute__((visibility("default"))) const char *optimize_kernel_error(void) { return g_error; }

/* ---- registration ------------------------------------------------------------------------------------- */

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
    if (!g_sel && optimize_select_kernel_paths(NULL) != 0) {
        char msg[400];
        snprintf(msg, sizeof msg, "optimize custom ops: %s", g_error);
        return ORT_FN(g_api, CreateStatus, OrtCreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
    }
    OrtStatus *st = NULL;
    if (!g_domain) {
        if ((st = ORT_FN(g_api, CreateCustomOpDomain, OrtCreateCustomOpDomainFn)(DOMAIN, &g_domain))) return st;
        for (size_t op = 0; op < N_OPS; op++)
            if ((st = ORT_FN(g_api, CustomOpDomain_Add, OrtCustomOpDomainAddFn)(g_domain, &g_ops[op].op))) return st;
    }
    return ORT_FN(g_api, AddCustomOpDomain, OrtAddCustomOpDomainFn)(options, g_domain);
}
