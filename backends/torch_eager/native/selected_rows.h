/* The rows a sparse attention token attends over (sparse_attention.c, amx_attention.c): its selected keys as
 * flat slots of the cache's rows, or as request-local positions of the op's paged batch, turned into row pointers
 * with every test of glm5_hal.paged.key_slots applied as each value is read. */
#ifndef GLM5_HAL_SELECTED_ROWS_H
#define GLM5_HAL_SELECTED_ROWS_H
#include <stdint.h>

#include "paged_tokens.h" /* token_sequence */

/* Where a token's selected rows are: flat slots of the rows, or the paged batch the op takes. */
struct key_source {
    const int64_t *slots; /* [T][topk]: a row of `rows` per key; a slot outside 0 .. num_slots - 1 is not a key.
                             NULL: the paged batch below */
    const int32_t *indices;      /* [T][topk] request-local key positions (index_stride apart) */
    long index_stride;
    const int32_t *block_table;  /* [B][max_blocks] (table_stride apart) */
    long table_stride, max_blocks;
    const int32_t *seq_lens_k;   /* [B] */
    const int32_t *cu_seqlens_q; /* [B + 1] */
    long batch, block_size, num_blocks;
    long block_step, row_step;   /* slot (block b, offset o) is row b * block_step + o * row_step */
};

/* valid_rows[0 .. n) = the rows of token t's keys, in the order of its selection; returns n. A paged key is a key
   when 0 <= position < seq_lens_k[b], its block lies in the table and the table names a block of the cache
   (docs/ops.md "Paged caches"): the test glm5_hal.paged.key_slots makes, on each value as it is read, so no table
   entry or position can send a read outside the rows. */
static long select_rows(const struct key_source *keys, long t, long topk, const uint16_t *rows, long num_slots,
                        long row_stride, const uint16_t **valid_rows) {
    long n = 0;
    if (keys->slots) {
        const int64_t *st = keys->slots + t * topk;
        for (long k = 0; k < topk; k++)
            if (st[k] >= 0 && st[k] < num_slots) valid_rows[n++] = rows + st[k] * row_stride; /* else: not a key */
        return n;
    }
    if (keys->batch <= 0 || keys->block_size <= 0) return 0;
    long b = token_sequence(keys->cu_seqlens_q, keys->batch, t);
    long limit = keys->seq_lens_k[b], capacity = keys->max_blocks * keys->block_size;
    if (limit > capacity) limit = capacity;
    const int32_t *table = keys->block_table + b * keys->table_stride;
    const int32_t *positions = keys->indices + t * keys->index_stride;
    for (long k = 0; k < topk; k++) {
        long p = positions[k];
        if (p < 0 || p >= limit) continue;
        long block = table[p / keys->block_size];
        if (block < 0 || block >= keys->num_blocks) continue;
        long row = block * keys->block_step + (p % keys->block_size) * keys->row_step;
        if (row < num_slots) valid_rows[n++] = rows + row * row_stride;
    }
    return n;
}
#endif
