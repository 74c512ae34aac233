/* Sparse attention of a token over its selected keys on AMX tiles (TDPBF16PS): sparse_attention.c's contract, entry
 * points and arithmetic (its top gives the formulas), with both products as tile GEMMs (amx_blocks.h's block):
 *
 *   scores  S[k][h] = row_k . q_h: A = the token's selected rows, gathered KEY_BLOCK at a time into a buffer the tile
 *           loads read in place; B = q as panels of 32 heads in the pair layout, packed once per token. Written into
 *           the score workspace [n][hp] (hp = H rounded up to 16; attention_softmax.h's layout), then times scale.
 *   softmax exponentiate (attention_softmax.h), in place.
 *   values  O[h][d] = sum_k P[h][k] row_k[d]: A = the normalised probabilities as hi and lo bf16 parts side by side
 *           along the keys, one row per head ([P_hi | P_lo], ~2^-16 of each probability, as the AVX-512 kernel
 *           splits them; the workspace transposed); B = a panel of 32 dims of the selected rows in the pair layout
 *           (consecutive keys interleaved), packed once per 32 dims and met once per part (block's panel_steps).
 *
 * Why this split of the operands: the scores' A is the keys' rows as they are (a gather, no transpose), their B is q
 * (a few KiB a token); the values need one transpose, and P (n x H) is the small one: V^T would be n x dv.
 *
 * Numerics: the fp32 path's arithmetic up to the order of the sums and ~2^-16 of each probability, with the tile
 * instruction's DAZ / FTZ (bf16 subnormal inputs read as zero, fp32 subnormal sums flushed: below 1.2e-38;
 * amx_tiles.h). A row no valid key selects is never read; padding heads and keys past n are zero in both operands of
 * the value product. Built twice by build.py: with AMX, and portable (GLM5_PORTABLE: the same blocking around
 * amx_tiles.h's scalar tile operations, and the softmax's scalar build), so the tests check the blocking on any CPU.
 * The Python side is sparse_attention.py (its AMX kernel).
 */
#include "amx_blocks.h"
#include "attention_softmax.h" /* exponentiate, store_output */
#include "head_pairs.h"        /* prefetch_to_l2 */
#include "selected_rows.h"     /* struct key_source, select_rows */

#define KEY_BLOCK MB          /* keys per score block: the rows of its two A tiles */
#define HEAD_BLOCK NB         /* heads per score block (its two B tiles' columns); heads per value block: MB */
#define DIM_BLOCK NB          /* dims of V per value panel: its two B tiles' columns */
#define STEP_ELEMENTS (2 * TILE_ROWS) /* bf16 of K per tile row: dims of a score step, keys of a value step */
#define TRANSPOSE_KEYS 16     /* keys per pass of the probabilities' transpose (their score rows stay in L1) */

static long round_up(long x, long multiple) { return (x + multiple - 1) / multiple * multiple; }

/* The value product's A: pa [hp][2 np] bf16, row h = [P_hi[h][0 .. np) | P_lo[h][0 .. np)], P[h][k] = E[k][h] /
   denominator[h] from the exponentiated workspace s [n][hp]; hi = P rounded, lo = (P - hi) rounded, 0 where that is
   not finite (inf / NaN pass through hi alone); 0 past the real heads and past n keys. */
static void pack_probability_rows(const float *s, long n, long np, long hp, long heads, const float *denominator,
                                  uint16_t *pa) {
    for (long k0 = 0; k0 < np; k0 += TRANSPOSE_KEYS)
        for (long h = 0; h < hp; h++) {
            uint16_t *hi = pa + h * 2 * np, *lo = hi + np;
            for (long k = k0; k < k0 + TRANSPOSE_KEYS; k++) {
                float p = k < n && h < heads ? s[k * hp + h] / denominator[h] : 0.0f;
                uint16_t rounded = float_to_bf16(p);
                float rest = p - bf16_to_float(rounded);
                hi[k] = rounded;
                lo[k] = rest - rest == 0.0f ? float_to_bf16(rest) : 0;
            }
        }
}

/* Dims d0 .. d0 + cols - 1 (cols <= DIM_BLOCK) of the n selected rows as a value panel of np / STEP_ELEMENTS K steps:
   step s, B tile j, tile row p holds (row_k[d0 + 16 j + c], row_{k + 1}[d0 + 16 j + c]) for k = 32 s + 2 p and the 16
   columns c; 0 past n keys and past cols. */
static void pack_value_panel(const uint16_t *const *rows, long n, long np, long d0, int cols, uint16_t *panel) {
    memset(panel, 0, (size_t)(np / STEP_ELEMENTS) * STEP_BYTES);
    for (long k = 0; k < n; k++) {
        const uint16_t *v = rows[k] + d0;
        uint16_t *pair = panel + (k / STEP_ELEMENTS) * (STEP_BYTES / 2) + (k % STEP_ELEMENTS / 2) * (TILE_ROW_BYTES / 2)
                         + k % 2;
        for (int c = 0; c < cols; c++) pair[(c / TILE_COLUMNS) * (TILE_BYTES / 2) + 2 * (c % TILE_COLUMNS)] = v[c];
    }
}

/* The scores, softmax and values of tokens t_begin .. t_end - 1 over the rows `keys` selects (sparse_attention.c's
   attend, the same arguments). q: [T][H][D] bf16 at element strides q_token, q_head (dims contiguous); rows:
   [num_slots] rows of row_stride elements; out: [T][H][dv] (element strides out_token, out_head), fp32 if out_fp32
   else bf16; lse: [T][H] fp32 (stride lse_token). Returns 0, or -1 if the per-thread workspace could not be
   allocated. */
static int attend(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token, long q_head,
                  const uint16_t *rows, long num_slots, long row_stride, const struct key_source *keys, float scale,
                  void *out, int out_fp32, long out_token, long out_head, float *lse, long lse_token, long t_begin,
                  long t_end) {
    const long hp = round_up(heads, TILE_COLUMNS), np_max = round_up(topk, KEY_BLOCK);
    const long dim_steps = (dims + STEP_ELEMENTS - 1) / STEP_ELEMENTS, head_blocks = (hp + HEAD_BLOCK - 1) / HEAD_BLOCK;
    const long q_panel = dim_steps * (STEP_BYTES / 2); /* uint16 per head block's panel of q */
    size_t out_size = out_fp32 ? sizeof(float) : sizeof(uint16_t);
    /* Per thread (topk 2048, 64 heads, D 576, dv 512: ~1.4 MiB, L2-sized): the valid keys' rows, their scores [np][hp]
       fp32, a key block's gathered rows, q's panels, the probability rows [hp][2 np] bf16, one value panel, the fp32
       output [hp][dv], the denominators. */
    const uint16_t **valid_rows = malloc(sizeof *valid_rows * (topk > 0 ? topk : 1));
    float *s = malloc(sizeof *s * (np_max * hp > 0 ? np_max * hp : 1));
    uint16_t *gathered = malloc(sizeof *gathered * KEY_BLOCK * (dims > 0 ? dims : 1));
    uint16_t *q_panels = malloc(sizeof *q_panels * (head_blocks * q_panel > 0 ? head_blocks * q_panel : 1));
    uint16_t *pa = malloc(sizeof *pa * (hp * 2 * np_max > 0 ? hp * 2 * np_max : 1));
    uint16_t *v_panel = malloc(np_max / STEP_ELEMENTS * STEP_BYTES + 1);
    float *o = malloc(sizeof *o * (hp * dv > 0 ? hp * dv : 1));
    float *denominator = malloc(sizeof *denominator * (hp > 0 ? hp : 1));
    int status = 0;
    if (!valid_rows || !s || !gathered || !q_panels || !pa || !v_panel || !o || !denominator) {
        status = -1;
        t_end = t_begin;
    }
    tiles_begin();
    for (long t = t_begin; t < t_end; t++) {
        char *out_t = (char *)out + t * out_token * out_size;
        float *lse_t = lse + t * lse_token;
        long n = select_rows(keys, t, topk, rows, num_slots, row_stride, valid_rows);
        if (n == 0) { /* no key: out 0, lse -inf */
            for (long h = 0; h < heads; h++) {
                memset(out_t + h * out_head * out_size, 0, dv * out_size);
                lse_t[h] = -INFINITY;
            }
            continue;
        }
        const long np = round_up(n, KEY_BLOCK);
        const uint16_t *q_t = q + t * q_token;
        for (long b = 0; b < head_blocks; b++) {
            long h0 = b * HEAD_BLOCK, real = heads - h0 < HEAD_BLOCK ? heads - h0 : HEAD_BLOCK;
            pack_bf16_panel(q_t + h0 * q_head, q_head, real > 0 ? (int)real : 0, dims, dim_steps, q_panels + b * q_panel);
        }
        for (long n0 = 0; n0 < n; n0 += KEY_BLOCK) {
            int n_keys = n - n0 < KEY_BLOCK ? (int)(n - n0) : KEY_BLOCK;
            for (int j = 0; j < n_keys; j++) memcpy(gathered + j * dims, valid_rows[n0 + j], sizeof *gathered * dims);
            for (long ahead = n0 + KEY_BLOCK; ahead < n0 + 2 * KEY_BLOCK && ahead < n; ahead++) /* the next block */
                prefetch_to_l2(valid_rows[ahead], dims);
            for (long b = 0; b < head_blocks; b++) {
                long h0 = b * HEAD_BLOCK;
                int cols = hp - h0 < HEAD_BLOCK ? (int)(hp - h0) : HEAD_BLOCK;
                block(OP_BF16, (const uint8_t *)gathered, 2 * dims, 2 * dims, n_keys,
                      (const uint8_t *)(q_panels + b * q_panel), dim_steps, dim_steps, cols,
                      (uint8_t *)(s + n0 * hp + h0), sizeof *s * hp);
            }
            for (long i = n0 * hp; i < (n0 + n_keys) * hp; i++) s[i] *= scale; /* as score_tile: the dot, then x scale */
        }
        exponentiate(s, n, hp, heads, lse_t, denominator);
        pack_probability_rows(s, n, np, hp, heads, denominator, pa);
        const long key_steps = np / STEP_ELEMENTS;
        for (long d0 = 0; d0 < dv; d0 += DIM_BLOCK) {
            int cols = dv - d0 < DIM_BLOCK ? (int)(dv - d0) : DIM_BLOCK;
            pack_value_panel(valid_rows, n, np, d0, cols, v_panel);
            for (long h0 = 0; h0 < hp; h0 += MB) {
                int head_rows = hp - h0 < MB ? (int)(hp - h0) : MB;
                block(OP_BF16, (const uint8_t *)(pa + h0 * 2 * np), 4 * np, 4 * np, head_rows, (const uint8_t *)v_panel,
                      2 * key_steps, key_steps, cols, (uint8_t *)(o + h0 * dv + d0), sizeof *o * dv);
            }
        }
        store_output(o, heads, dv, out_t, out_fp32, out_head);
        for (long h = 0; h < heads; h++) /* all scores -inf: an empty softmax, out 0 whatever V holds (0 * inf) */
            if (lse_t[h] == -INFINITY) memset(out_t + h * out_head * out_size, 0, dv * out_size);
    }
    tiles_end();
    free(valid_rows);
    free(s);
    free(gathered);
    free(q_panels);
    free(pa);
    free(v_panel);
    free(o);
    free(denominator);
    return status;
}

#include "attention_entry.h" /* glm5_sparse_attention, glm5_sparse_attention_paged: around attend */
