/* The lightning indexer's scores from a paged bf16 key cache on AMX tiles (TDPBF16PS): indexer_scores.c's contract
 * and entry point,
 *
 *   score[t][s] = sum_h w[t][h] * relu(sum_d q[t][h][d] * key_t(s)[d])     for s < limit[t], else -inf
 *
 * with each token's q . key products as tile GEMMs (amx_blocks.h's block): A = KEY_GROUP keys' rows, read in place
 * where the group lies in one cache block (its rows one stride apart), else gathered; B = the token's q as panels of
 * 32 heads, copied from the packed q [pairs][hp][2] the caller passes (already the tiles' pair layout: a panel adds
 * the zeros past the pairs). Then per key the weighted relu over the real heads in fp32 (head_sums.h); heads past H
 * are never added (their dots may be NaN where a key holds inf). Keys are taken in chunks of CHUNK positions
 * for a group of TOKEN_GROUP tokens whose panels are packed once (a chunk's rows stay in L2 across the group's tokens,
 * as in indexer_scores.c).
 *
 * Numerics: the fp32 path's up to the order of the sums, with the tile instruction's DAZ / FTZ (bf16 subnormal inputs
 * read as zero, fp32 subnormal sums flushed: below 1.2e-38; amx_tiles.h). Built with AMX and portable (GLM5_PORTABLE:
 * the same blocking around scalar tile operations), so indexer_scores.c's tests check the blocking on any CPU. The
 * Python side is indexer_scores.py (its AMX kernel).
 */
#include <math.h>

#include "amx_blocks.h"
#include "head_pairs.h"   /* prefetch */
#include "head_sums.h"    /* add_head_sums */
#include "paged_tokens.h" /* key_row */

#define CHUNK 256                     /* key positions per chunk (indexer_scores.c's; a thread's share is whole chunks) */
#define KEY_GROUP MB                  /* keys per tile block: the rows of its two A tiles */
#define HEAD_BLOCK NB                 /* heads per tile block: its two B tiles' columns */
#define STEP_ELEMENTS (2 * TILE_ROWS) /* dims per K step (16 pairs) */
#define TOKEN_GROUP 16                /* tokens whose q panels are packed at once (16 KiB each at 64 heads, D 128) */

/* One token's packed q [pair_rows][hp][2] as head_blocks panels of dim_steps K steps (amx_blocks.h's layout): step s,
   B tile j, tile row p = pair 16 s + p of heads h0 + 16 j .. + 15, zero past pair_rows and hp. */
static void pack_query_panels(const uint16_t *qt, long pair_rows, long hp, long dim_steps, long head_blocks,
                              uint16_t *panels) {
    memset(panels, 0, (size_t)(head_blocks * dim_steps) * STEP_BYTES);
    for (long b = 0; b < head_blocks; b++)
        for (long s = 0; s < dim_steps; s++)
            for (int j = 0; j < 2; j++) {
                long h0 = b * HEAD_BLOCK + j * TILE_COLUMNS;
                if (h0 >= hp) continue;
                uint16_t *tile = panels + ((b * dim_steps + s) * STEP_BYTES + j * TILE_BYTES) / 2;
                for (long p = 0; p < TILE_ROWS && s * TILE_ROWS + p < pair_rows; p++)
                    memcpy(tile + p * (TILE_ROW_BYTES / 2), qt + ((s * TILE_ROWS + p) * hp + h0) * 2, TILE_ROW_BYTES);
            }
}

/* Scores of tokens [t_begin, t_end) at key positions [s_begin, s_end): one thread's share (indexer_scores.c's
 * arguments: q [T][pairs + odd][hp][2] bf16, hp = H rounded up to 16; w [T][hp] fp32; table [T][table_width] int32,
 * every entry a valid block; limit [T]; scores [T][score_row] fp32). Returns 0, or -1 where the workspace could not
 * be allocated (nothing written). */
int glm5_indexer_scores(long heads, long dims, const uint16_t *q, const float *w, const uint16_t *cache,
                        long block_stride, long row_stride, long block_size, const int32_t *table, long table_width,
                        const int64_t *limit, float *scores, long score_row, long t_begin, long t_end, long s_begin,
                        long s_end) {
    const long pair_rows = (dims + 1) / 2, hp = (heads + 15) / 16 * 16;
    const long dim_steps = (dims + STEP_ELEMENTS - 1) / STEP_ELEMENTS, head_blocks = (hp + HEAD_BLOCK - 1) / HEAD_BLOCK;
    const long token_panels = head_blocks * dim_steps * (STEP_BYTES / 2); /* uint16 per token */
    uint16_t *panels = malloc(sizeof *panels * (TOKEN_GROUP * token_panels > 0 ? TOKEN_GROUP * token_panels : 1));
    uint16_t *gathered = malloc(sizeof *gathered * KEY_GROUP * (dims > 0 ? dims : 1));
    if (!panels || !gathered) {
        free(panels);
        free(gathered);
        return -1;
    }
    tiles_begin();
    for (long g0 = t_begin; g0 < t_end; g0 += TOKEN_GROUP) {
        long g1 = g0 + TOKEN_GROUP < t_end ? g0 + TOKEN_GROUP : t_end;
        for (long t = g0; t < g1; t++)
            pack_query_panels(q + t * pair_rows * hp * 2, pair_rows, hp, dim_steps, head_blocks,
                              panels + (t - g0) * token_panels);
        for (long c0 = s_begin; c0 < s_end; c0 += CHUNK) {
            long c1 = c0 + CHUNK < s_end ? c0 + CHUNK : s_end;
            for (long t = g0; t < g1; t++) {
                const float *wt = w + t * hp;
                const int32_t *tt = table + t * table_width;
                float *st = scores + t * score_row;
                long visible_end = visible_in_chunk(st, limit[t], c0, c1);
                for (long s = c0; s < visible_end; s += KEY_GROUP) {
                    int n = visible_end - s < KEY_GROUP ? (int)(visible_end - s) : KEY_GROUP;
                    const uint16_t *a = key_row(cache, block_stride, row_stride, block_size, tt, s);
                    long a_row = 2 * row_stride;
                    if (s % block_size + n > block_size) { /* the group spans blocks: its rows are gathered */
                        for (int j = 0; j < n; j++)
                            memcpy(gathered + j * dims, key_row(cache, block_stride, row_stride, block_size, tt, s + j),
                                   sizeof *gathered * dims);
                        a = gathered;
                        a_row = 2 * dims;
                    }
                    for (long ahead = s + KEY_GROUP; ahead < s + 2 * KEY_GROUP && ahead < visible_end; ahead++)
                        prefetch(key_row(cache, block_stride, row_stride, block_size, tt, ahead), dims);
                    float out[KEY_GROUP] = {0};
                    for (long b = 0; b < head_blocks; b++) {
                        long h0 = b * HEAD_BLOCK;
                        int cols = hp - h0 < HEAD_BLOCK ? (int)(hp - h0) : HEAD_BLOCK;
                        float dots[KEY_GROUP][HEAD_BLOCK];
                        block(OP_BF16, (const uint8_t *)a, a_row, 2 * dims, n,
                              (const uint8_t *)(panels + (t - g0) * token_panels + b * dim_steps * (STEP_BYTES / 2)),
                              dim_steps, dim_steps, cols, (uint8_t *)dots, sizeof dots[0]);
                        long real = heads - h0 < HEAD_BLOCK ? heads - h0 : HEAD_BLOCK;
                        add_head_sums((const float(*)[NB])dots, n, real, NULL, wt + h0, out);
                    }
                    for (int j = 0; j < n; j++) st[s + j] = out[j];
                }
            }
        }
    }
    tiles_end();
    free(panels);
    free(gathered);
    return 0;
}
