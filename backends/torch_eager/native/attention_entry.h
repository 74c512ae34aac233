/* The exported entry points of a sparse attention kernel (sparse_attention.c, amx_attention.c), written once around
 * the including file's own
 *
 *   static int attend(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token, long q_head,
 *                     const uint16_t *rows, long num_slots, long row_stride, const struct key_source *keys,
 *                     float scale, void *out, int out_fp32, long out_token, long out_head, float *lse,
 *                     long lse_token, int row_prefetch, long t_begin, long t_end);
 *
 * (include it after attend; sparse_attention.py gives both libraries the same ctypes signatures). row_prefetch: how the
 * rows read next are asked for (PREFETCH_L2, PREFETCH_L1, PREFETCH_NTA: row_prefetch.h). */
#ifndef GLM5_HAL_ATTENTION_ENTRY_H
#define GLM5_HAL_ATTENTION_ENTRY_H
#include "selected_rows.h"

/* Tokens t_begin .. t_end - 1 over flat slots [T][topk] int64 of the rows (see attend). */
int glm5_sparse_attention(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token, long q_head,
                          const uint16_t *rows, long num_slots, long row_stride, const int64_t *slots, float scale, void *out, int out_fp32,
                          long out_token, long out_head, float *lse, long lse_token, int row_prefetch, long t_begin, long t_end) {
    struct key_source keys = {.slots = slots};
    return attend(heads, dims, dv, topk, q, q_token, q_head, rows, num_slots, row_stride, &keys, scale, out, out_fp32, out_token,
                  out_head, lse, lse_token, row_prefetch, t_begin, t_end);
}

/* Tokens t_begin .. t_end - 1 of the paged batch: indices [T][topk] int32 request-local positions, block_table
   [B][max_blocks], seq_lens_k [B] and cu_seqlens_q [B + 1] int32, the cache's rows as `rows` (slot (block b, offset
   o) = row b * block_step + o * row_step). The op's own arguments: no slot tensor is made. */
int glm5_sparse_attention_paged(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token,
                                long q_head, const uint16_t *rows, long num_slots, long row_stride, const int32_t *indices, long index_stride,
                                const int32_t *block_table, long table_stride, long max_blocks,
                                const int32_t *seq_lens_k, const int32_t *cu_seqlens_q, long batch, long block_size,
                                long num_blocks, long block_step, long row_step, float scale, void *out,
                                int out_fp32, long out_token, long out_head, float *lse, long lse_token,
                                int row_prefetch, long t_begin, long t_end) {
    struct key_source keys = {.indices = indices, .index_stride = index_stride, .block_table = block_table,
                              .table_stride = table_stride, .max_blocks = max_blocks, .seq_lens_k = seq_lens_k,
                              .cu_seqlens_q = cu_seqlens_q, .batch = batch, .block_size = block_size,
                              .num_blocks = num_blocks, .block_step = block_step, .row_step = row_step};
    return attend(heads, dims, dv, topk, q, q_token, q_head, rows, num_slots, row_stride, &keys, scale, out, out_fp32, out_token,
                  out_head, lse, lse_token, row_prefetch, t_begin, t_end);
}
#endif
