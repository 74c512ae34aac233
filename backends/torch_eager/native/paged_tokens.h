/* The paged batch of the ops (docs/ops.md "Conventions" and "Paged caches") as the scoring kernels read it, so that
 * the sequence, position and block table row of each query token are found in C instead of by a dozen small torch
 * ops per call (glm5_hal/paged.py spells the same rules):
 *
 *   token t belongs to sequence b = the number of cu_seqlens_q[1 ..] that are <= t (kept within 0 .. batch - 1);
 *   its position is seq_lens_k[b] - cu_seqlens_q[b + 1] + t, and it sees key positions 0 .. position;
 *   key position p of sequence b lies in block block_table[b][p / block_size] at offset p % block_size.
 *
 * A table entry outside 0 .. num_blocks - 1 names no block of the cache: its keys are not keys. The kernels read a
 * per-sequence copy of the table row with such entries replaced by block 0 (so nothing outside the cache is read)
 * and paged_mask_outside sets those keys' scores to -inf after.
 */
#ifndef GLM5_HAL_PAGED_TOKENS_H
#define GLM5_HAL_PAGED_TOKENS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

struct paged_batch {
    const int32_t *block_table; /* [batch][max_blocks], rows table_stride apart */
    long table_stride, max_blocks;
    const int32_t *seq_lens_k;   /* [batch] */
    const int32_t *cu_seqlens_q; /* [batch + 1] */
    long batch, block_size, num_blocks;
};

/* The bf16 row of key position s in a paged cache (block_stride / row_stride elements apart) from a block table row
   whose entries are all blocks of the cache (the scoring kernels' callers make it so). */
static inline const uint16_t *key_row(const uint16_t *cache, long block_stride, long row_stride, long block_size,
                                      const int32_t *table, long s) {
    return cache + (long)table[s / block_size] * block_stride + (s % block_size) * row_stride;
}

/* A token's scores st over the chunk of key positions c0 .. c1 - 1: those from `limit` on are not visible to it and
   get -inf here; returns where its visible ones end. */
static inline long visible_in_chunk(float *st, long limit, long c0, long c1) {
    long end = limit < c1 ? (limit > c0 ? limit : c0) : c1;
    for (long s = end; s < c1; s++) st[s] = -INFINITY;
    return end;
}

/* The sequence of query token t (torch.searchsorted(cu_seqlens_q[1:], t, right=True): a sequence without new
   tokens is skipped), kept inside 0 .. batch - 1 whatever the prefix sums hold. */
static inline long token_sequence(const int32_t *cu_seqlens_q, long batch, long t) {
    long low = 0, high = batch; /* the answer is in low .. high */
    while (low < high) {
        long mid = (low + high) / 2;
        if (cu_seqlens_q[mid + 1] <= t)
            low = mid + 1;
        else
            high = mid;
    }
    return low < batch ? low : batch - 1;
}

/* Key positions 0 .. limit - 1 are visible to token t: its position + 1, within 0 .. width. */
static inline long token_limit(const struct paged_batch *pb, long b, long t, long width) {
    long limit = (long)pb->seq_lens_k[b] - (long)pb->cu_seqlens_q[b + 1] + t + 1;
    return limit < 0 ? 0 : limit > width ? width : limit;
}

/* Per-token views of tokens t_begin .. t_end - 1 for a kernel written over per-token table rows and limits:
   tables[i] points at the clamped row of token t_begin + i's sequence (one copy per sequence, max_blocks entries),
   limits[i] is its limit. */
struct token_views {
    const int32_t **tables;
    int64_t *limits;
    int32_t *rows; /* the clamped rows of sequences first_seq .. */
    long first_seq;
};

static inline void token_views_free(struct token_views *v) {
    free(v->tables);
    free(v->limits);
    free(v->rows);
}

/* Returns 0, or -1 if the views could not be allocated (nothing to free then). */
static inline int token_views_make(const struct paged_batch *pb, long width, long t_begin, long t_end,
                                   struct token_views *v) {
    long tokens = t_end - t_begin, width_blocks = pb->max_blocks > 0 ? pb->max_blocks : 1;
    long first = tokens > 0 ? token_sequence(pb->cu_seqlens_q, pb->batch, t_begin) : 0;
    long last = tokens > 0 ? token_sequence(pb->cu_seqlens_q, pb->batch, t_end - 1) : 0;
    long sequences = last >= first ? last - first + 1 : 1;
    v->tables = malloc(sizeof *v->tables * (tokens > 0 ? tokens : 1));
    v->limits = malloc(sizeof *v->limits * (tokens > 0 ? tokens : 1));
    v->rows = malloc(sizeof *v->rows * sequences * width_blocks);
    v->first_seq = first;
    if (!v->tables || !v->limits || !v->rows) {
        token_views_free(v);
        return -1;
    }
    if (pb->batch <= 0) { /* no sequence (tokens past the prefix sums, value checks off): no token sees a key */
        for (long i = 0; i < tokens; i++) v->tables[i] = v->rows, v->limits[i] = 0;
        return 0;
    }
    for (long b = first; b < first + sequences && tokens > 0; b++) {
        const int32_t *raw = pb->block_table + b * pb->table_stride;
        int32_t *row = v->rows + (b - first) * width_blocks;
        for (long i = 0; i < pb->max_blocks; i++) row[i] = raw[i] >= 0 && raw[i] < pb->num_blocks ? raw[i] : 0;
    }
    for (long t = t_begin; t < t_end; t++) {
        long b = token_sequence(pb->cu_seqlens_q, pb->batch, t);
        if (b < first) b = first; /* prefix sums that are not sorted: keep within the rows made above */
        if (b > last) b = last;
        v->tables[t - t_begin] = v->rows + (b - first) * width_blocks;
        v->limits[t - t_begin] = token_limit(pb, b, t, width);
    }
    return 0;
}

/* scores [tokens][score_row] of tokens t_begin .. t_end - 1 (row t - t_begin) at key positions s_begin .. s_end - 1:
   -inf for every visible key whose table entry names no block of the cache (the others are left as they are). */
static inline void paged_mask_outside(const struct paged_batch *pb, const struct token_views *v, float *scores,
                                      long score_row, long t_begin, long t_end, long s_begin, long s_end) {
    if (pb->batch <= 0) return; /* no token sees a key (token_views_make) */
    for (long t = t_begin; t < t_end; t++) {
        long b = v->first_seq + (v->tables[t - t_begin] - v->rows) / (pb->max_blocks > 0 ? pb->max_blocks : 1);
        const int32_t *raw = pb->block_table + b * pb->table_stride;
        long end = v->limits[t - t_begin] < s_end ? v->limits[t - t_begin] : s_end;
        for (long block = s_begin / pb->block_size; block * pb->block_size < end; block++) {
            if (raw[block] >= 0 && raw[block] < pb->num_blocks) continue;
            long from = block * pb->block_size > s_begin ? block * pb->block_size : s_begin;
            long to = (block + 1) * pb->block_size < end ? (block + 1) * pb->block_size : end;
            for (long s = from; s < to; s++) scores[(t - t_begin) * score_row + s] = -INFINITY;
        }
    }
}
#endif
