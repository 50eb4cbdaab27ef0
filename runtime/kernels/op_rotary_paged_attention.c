/* The custom op optimize.RotaryPagedAttention: paged attention (op_paged_attention.c's kernel) on the QKV
 * projection's output as it is, applying the rotary embedding itself (what ONNX Runtime's RotaryEmbedding
 * computes), so that a decoder layer's attention is one node from the fused QKV Gemm to o_proj
 * (compiler/fusion/attention.py writes it):
 *
 *   inputs   qkv [T, (H + 2*KVH)*D]                   q | k | v of this step's tokens (before RoPE)
 *            positions int64 [T]                       each token's position (the rotation's row)
 *            cos_cache, sin_cache [P, R/2]              R = rotary_embedding_dim (0: D)
 *            key_cache, value_cache, cu_seqlens, past_lens, block_table   as PagedAttention's
 *            k_scale, v_scale [KVH] (optional; int8 pools only)
 *   attrs    PagedAttention's (num_heads, kv_num_heads, scale, local_window_size) + rotary_embedding_dim,
 *            interleaved (0: rotate-half pairs (i, i + R/2); 1: (2i, 2i+1))
 *   output   [T, H*D]
 *
 * K is rotated on its way into the pool and Q on its way into a work item's scratch; dimensions from R
 * on pass through unrotated. No [T, H*D] copy of the rotated queries is made. A position outside the
 * caches is refused before anything is written.
 */
#include "paged_attention.h"

/* Names and ranks of the inputs, in order (their element types: the descriptor's input_types below, U for the
 * pools, which are float32 or int8); the last two (k_scale, v_scale) are optional. */
static const char *const g_names[] = {"qkv", "positions", "cos_cache", "sin_cache", "key_cache", "value_cache",
                                      "cu_seqlens", "past_lens", "block_table", "k_scale", "v_scale"};
static const size_t g_ranks[] = {2, 1, 2, 2, 4, 4, 1, 1, 2, 1, 1};

/* qkv [T, (H + 2*KVH)*D]: a token's q, k and v in one row; positions and the caches checked */
static OrtStatus *sources(const AttnKernel *k, const Tensor *in, int64_t D, AttnSources *out) {
    const char *opname = k->base.desc->name;
    char msg[320];
    const int64_t T = in[0].dims[0], H = k->num_heads, KVH = k->kv_heads;
    const int64_t stride = (H + 2 * KVH) * D;
    if (in[0].dims[1] != stride) FAIL("qkv has %lld columns, (num_heads + 2 * kv_num_heads) * head_dim is %lld",
                                      (long long)in[0].dims[1], (long long)stride);
    const float *qkv = (const float *)in[0].data;
    const int64_t rdim = k->rotary_dim > 0 ? k->rotary_dim : D;
    if (rdim > D || rdim % 2) FAIL("rotary_embedding_dim %lld must be even and at most head_dim %lld",
                                   (long long)rdim, (long long)D);
    if (in[1].dims[0] != T) FAIL("positions must have one entry per token");
    const int64_t rows = in[2].dims[0];
    for (int i = 2; i < 4; i++)
        if (in[i].dims[0] != rows || in[i].dims[1] != rdim / 2)
            FAIL("%s must be [rows, rotary_embedding_dim / 2 = %lld]", g_names[i], (long long)(rdim / 2));
    const int64_t *pos = (const int64_t *)in[1].data;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= rows)
            FAIL("position %lld of token %lld is outside the rotary cache of %lld rows", (long long)pos[t],
                 (long long)t, (long long)rows);
    *out = (AttnSources){qkv, qkv + H * D, qkv + (H + KVH) * D, stride, stride, pos, (const float *)in[2].data,
                         (const float *)in[3].data, rdim};
    return NULL;
}

static const AttnLayout g_layout = {g_names, g_ranks, 4, 1, sources};

static OrtStatus *init(OpKernel *kernel, const OrtKernelInfo *info) {
    return paged_attention_init(kernel, info, &g_layout);
}

static OrtStatus *compute(const OpKernel *kernel, OrtKernelContext *ctx) {
    return paged_attention_compute(kernel, ctx, &g_layout);
}

const OpDesc optimize_op_rotary_paged_attention = {
    .name = "RotaryPagedAttention",
    .input_types = "FLFFUUIIIFF",
    .optional_inputs = N_SCALES,
    .output_types = "F",
    .kernel_size = sizeof(AttnKernel),
    .init = init,
    .compute = compute,
};
