/* What the two paged-attention ops share: op_paged_attention.c holds the kernel (validation, the pool writes,
 * the work items on the thread pool) and optimize.PagedAttention's inputs; op_rotary_paged_attention.c holds
 * optimize.RotaryPagedAttention's inputs, the packed q | k | v and the rotation, and runs the same kernel.
 */
#ifndef OPTIMIZE_PAGED_ATTENTION_H
#define OPTIMIZE_PAGED_ATTENTION_H

#include "ort_ops.h"

#define N_SCALES 2 /* k_scale and v_scale: an op's last two inputs, optional (int8 pools only) */

typedef struct {
    OpKernel base;
    int64_t num_heads, kv_heads, window;
    float scale;
    int64_t inline_work; /* below this many multiply-adds a step runs without the thread pool */
    int64_t rotary_dim;  /* RotaryPagedAttention: 0: head_dim */
    int64_t interleaved;
} AttnKernel;

/* Where a step's query, key and value rows start, the floats between two tokens' rows, and the rotation
 * (RotaryPagedAttention: positions, caches, rotary dimension; else pos NULL). */
typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, kv_stride;
    const int64_t *pos;
    const float *cos, *sin;
    int64_t rdim;
} AttnSources;

/* One op's inputs: their names and ranks (element types: the descriptor's input_types); key_cache at index
 * `pools`, then value_cache, cu_seqlens, past_lens, block_table, and last k_scale, v_scale. */
typedef struct {
    const char *const *names;
    const size_t *ranks;
    size_t pools;
    int rotary; /* the node has the attributes rotary_embedding_dim and interleaved */
    /* checks the inputs before the pools (their shapes against T = in[0].dims[0], the heads and the head dim D)
     * and says where q, k and v come from */
    OrtStatus *(*sources)(const AttnKernel *k, const Tensor *in, int64_t D, AttnSources *out);
} AttnLayout;

/* The attributes (num_heads, kv_num_heads, scale, local_window_size, and the rotary ones where layout->rotary),
 * checked. */
HIDDEN OrtStatus *paged_attention_init(OpKernel *kernel, const OrtKernelInfo *info, const AttnLayout *layout);

/* One step: validates every input, writes the step's K/V into the pools, attends. */
HIDDEN OrtStatus *paged_attention_compute(const OpKernel *kernel, OrtKernelContext *ctx, const AttnLayout *layout);

#endif /* OPTIMIZE_PAGED_ATTENTION_H */
