/* Paged attention for ONNX Runtime CPU: the custom op optimize.PagedAttention (domain "optimize"), and the
 * kernel it shares with optimize.RotaryPagedAttention (op_rotary_paged_attention.c, paged_attention.h).
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
 * p % block_size (the slots the runtime's scheduler assigns; the work item kv_write_item, per code path, on
 * the thread pool over tokens when the step is large), then attends each token to positions
 * [lo, p] of its own sequence read from the pools through the block table, lo = p - window + 1 (>= 0)
 * with a sliding window, else 0. No past is gathered into new tensors and no token of one sequence is
 * scored against another's.
 *
 * Work is split into items (sequence, KV head, query tile); a tile holds up to QT query tokens times
 * the G = H / KVH query heads that share the KV head, so every key row read from the pool serves all G
 * heads. Per item: keys in chunks, an online softmax in base 2 (running max and sum per query row, float32
 * accumulation), the weighted values accumulated per row. Items of 16 rows or more (prefill tiles) put the
 * query rows in the vector lanes, up to three registers of rows per pass (attend_lanes: Q transposed once
 * per pass, each broadcast key or value element feeding one multiply-add per row register, in register
 * tiles sized per code path; the softmax per lane); smaller ones (decode) take a dot product per (row, key)
 * over chunks of VL keys (a code path's float lanes), vectorized over the head dimension. Items run on ONNX
 * Runtime's intra-op thread pool (KernelContext_ParallelFor), the session's own threads; a step too small
 * to pay for a fork/join runs inline.
 *
 * Every index is validated before anything is written: a block table entry outside the pool, a
 * sequence longer than its table, or shapes that disagree return an error status (ONNX Runtime raises
 * it as an exception in the caller) and leave the pools untouched.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

/* multiply-adds below which a step runs without the thread pool: a batch-1 decode step over the KV heads on
 * 2 threads beats inline from ~10 tokens of context on (docs/architecture.md, "paged attention") */
#define INLINE_WORK (1 << 13)

/* ---- the kernel: attributes ------------------------------------------------------------------------- */

OrtStatus *paged_attention_init(OpKernel *kernel, const OrtKernelInfo *info, const AttnLayout *layout) {
    AttnKernel *k = (AttnKernel *)kernel;
    const char *opname = kernel->desc->name;
    char msg[256];
    OrtStatus *st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "num_heads", &k->num_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "kv_num_heads", &k->kv_heads);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_float, OrtKernelInfoGetAttributeFloatFn)(
        info, "scale", &k->scale);
    if (!st) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "local_window_size", &k->window);
    if (!st && layout->rotary) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "rotary_embedding_dim", &k->rotary_dim);
    if (!st && layout->rotary) st = ORT_FN(g_api, KernelInfoGetAttribute_int64, OrtKernelInfoGetAttributeInt64Fn)(
        info, "interleaved", &k->interleaved);
    if (!st && (k->num_heads <= 0 || k->kv_heads <= 0 || k->num_heads % k->kv_heads)) {
        snprintf(msg, sizeof msg, "optimize.%s: num_heads %lld must be a positive multiple of "
                 "kv_num_heads %lld", opname, (long long)k->num_heads, (long long)k->kv_heads);
        st = ort_status(ORT_INVALID_ARGUMENT, msg);
    }
    if (!st && (k->rotary_dim < 0 || k->rotary_dim % 2 || (k->interleaved != 0 && k->interleaved != 1))) {
        snprintf(msg, sizeof msg, "optimize.%s: rotary_embedding_dim %lld must be even and not negative, "
                 "interleaved %lld 0 or 1", opname, (long long)k->rotary_dim, (long long)k->interleaved);
        st = ort_status(ORT_INVALID_ARGUMENT, msg);
    }
    if (st) return st;
    /* OPTIMIZE_PAGED_CPU_INLINE_WORK overrides the threshold (0: always the thread pool; tests use it) */
    const char *env = getenv("OPTIMIZE_PAGED_CPU_INLINE_WORK");
    k->inline_work = env && *env ? strtoll(env, NULL, 10) : INLINE_WORK;
    return NULL;
}

/* ---- the kernel: one step -------------------------------------------------------------------------------- */

OrtStatus *paged_attention_compute(const OpKernel *kernel, OrtKernelContext *ctx, const AttnLayout *layout) {
    const AttnKernel *k = (const AttnKernel *)kernel;
    const char *opname = kernel->desc->name;
    const char *types = kernel->desc->input_types;
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
        if ((st = ort_read_input(ctx, i, &in[i]))) return st;
    if (count == n_all) { /* the scales, when the node has them (an absent optional input reads as NULL) */
        const OrtValue *v = NULL;
        if ((st = ORT_FN(g_api, KernelContext_GetInput, OrtKernelContextGetInputFn)(ctx, n_req, &v))) return st;
        if (v) {
            n_in = n_all;
            for (size_t i = n_req; i < n_all; i++)
                if ((st = ort_read_input(ctx, i, &in[i]))) return st;
        }
    }
    const char *const *names = layout->names;
    const size_t *ranks = layout->ranks;
    for (size_t i = 0; i < n_in; i++) {
        if (types[i] == 'U') {
            if (in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && in[i].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
                FAIL("%s must be float32 or int8", names[i]);
        } else if (in[i].type != ort_type_of(types[i])) {
            FAIL("%s must be %s", names[i], types[i] == 'F' ? "float32" : types[i] == 'I' ? "int32" : "int64");
        }
        if (in[i].rank != ranks[i]) FAIL("%s must have rank %zu, has %zu", names[i], ranks[i], in[i].rank);
    }
    /* the pools and the step description: in that order from input layout->pools on */
    const Tensor *kct = &in[layout->pools], *vct = &in[layout->pools + 1], *cut = &in[layout->pools + 2];
    const Tensor *pastt = &in[layout->pools + 3], *btt = &in[layout->pools + 4];
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
    /* where q, k and v of token t start, the floats between two tokens' rows, and the rotation */
    AttnSources src;
    if ((st = layout->sources(k, in, D, &src))) return st;
    const float *qsrc = src.q, *ksrc = src.k, *vsrc = src.v;
    const int64_t q_stride = src.q_stride, kv_stride = src.kv_stride, rdim = src.rdim;
    const int64_t *pos = src.pos;
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
     * KV head into int8 pools): kv_write_item, over tokens on the thread pool when the step is large */
    float *kc = pools_i8 ? NULL : (float *)kct->data, *vc = pools_i8 ? NULL : (float *)vct->data;
    int8_t *kc8 = pools_i8 ? (int8_t *)kct->data : NULL, *vc8 = pools_i8 ? (int8_t *)vct->data : NULL;
    const float *cos_c = src.cos, *sin_c = src.sin;
    /* int8 pools and rotary: the step's rotated keys [T][KVH * D], quantized into the pool and read unquantized
     * by the step itself */
    float *rot = NULL;
    if (pools_i8 && pos && !(rot = (float *)malloc(sizeof(float) * (size_t)(T * KVH * D + 1)))) FAIL("out of memory");
    const int64_t G = H / KVH;
    Job job = {qsrc, q_stride, pos, cos_c, sin_c, rdim, k->interleaved, kc, vc, kc8, vc8, k_scale, v_scale,
               rot ? rot : ksrc, vsrc, rot ? KVH * D : kv_stride, kv_stride, cu, past, bt, out, MB, BS, H, KVH,
               D, G, k->window, k->scale * 1.4426950408889634f, NULL, 0, ksrc, vsrc, kv_stride, T, T, rot};
    OrtKernelContextParallelForFn parallel_for =
        ORT_FN(g_api, KernelContext_ParallelFor, OrtKernelContextParallelForFn);
    /* items of at least 64K elements of K and V: a decode step's few tokens are written inline (an inline
     * threshold of 0, OPTIMIZE_PAGED_CPU_INLINE_WORK=0 in the tests, writes one token per item) */
    job.write_tokens = k->inline_work == 0 ? 1 : ((1 << 16) + 2 * KVH * D - 1) / (2 * KVH * D);
    const size_t write_items = (size_t)((T + job.write_tokens - 1) / job.write_tokens);
    if (write_items > 1) {
        if ((st = parallel_for(ctx, kernel->paths->kv_write_item, write_items, 0, &job))) {
            free(rot);
            return st;
        }
    } else {
        kernel->paths->kv_write_item(&job, 0);
    }

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
    job.items = items;
    if (work >= k->inline_work && n_items > 1) {
        st = parallel_for(ctx, kernel->paths->attention_item, (size_t)n_items, 0, &job);
    } else {
        for (int64_t i = 0; i < n_items; i++) kernel->paths->attention_item(&job, (size_t)i);
    }
    free(items);
    free(rot);
    if (st) return st;
    if (job.failed) {
        snprintf(msg, sizeof msg, "optimize.%s: out of memory for a work item's scratch", opname);
        return ort_status(ORT_FAIL, msg);
    }
    return NULL;
}

/* ---- optimize.PagedAttention's inputs --------------------------------------------------------------- */

/* Names and ranks of the inputs, in order (their element types: the descriptor's input_types below, U for the
 * pools, which are float32 or int8); the last two (k_scale, v_scale) are optional. */
static const char *const g_names[] = {"query", "key", "value", "key_cache", "value_cache", "cu_seqlens",
                                      "past_lens", "block_table", "k_scale", "v_scale"};
static const size_t g_ranks[] = {2, 2, 2, 4, 4, 1, 1, 2, 1, 1};

/* query [T, H*D], key and value [T, KVH*D], each token's rows one after the other */
static OrtStatus *sources(const AttnKernel *k, const Tensor *in, int64_t D, AttnSources *out) {
    const char *opname = k->base.desc->name;
    char msg[320];
    const int64_t T = in[0].dims[0], H = k->num_heads, KVH = k->kv_heads;
    if (in[0].dims[1] != H * D) FAIL("query has %lld columns, num_heads * head_dim is %lld",
                                     (long long)in[0].dims[1], (long long)(H * D));
    for (int i = 1; i < 3; i++)
        if (in[i].dims[0] != T || in[i].dims[1] != KVH * D)
            FAIL("%s must be [T, kv_num_heads * head_dim]", g_names[i]);
    *out = (AttnSources){(const float *)in[0].data, (const float *)in[1].data, (const float *)in[2].data, H * D,
                         KVH * D, NULL, NULL, NULL, 0};
    return NULL;
}

static const AttnLayout g_layout = {g_names, g_ranks, 3, 0, sources};

static OrtStatus *init(OpKernel *kernel, const OrtKernelInfo *info) {
    return paged_attention_init(kernel, info, &g_layout);
}

static OrtStatus *compute(const OpKernel *kernel, OrtKernelContext *ctx) {
    return paged_attention_compute(kernel, ctx, &g_layout);
}

const OpDesc optimize_op_paged_attention = {
    .name = "PagedAttention",
    .input_types = "FFFUUIIIFF",
    .optional_inputs = N_SCALES,
    .output_types = "F",
    .kernel_size = sizeof(AttnKernel),
    .init = init,
    .compute = compute,
};
