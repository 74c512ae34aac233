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
 * the value product. Built by build.py with AMX; portable (GLM5_PORTABLE: the same blocking around amx_tiles.h's
 * scalar tile operations, the packing and the softmax in scalar C), so the tests check the blocking on any CPU; and
 * amx_emulated (the AMX build's AVX-512 packing and softmax around the scalar tile operations), so they check that
 * code on any AVX-512 CPU. The Python side is sparse_attention.py (its AMX kernel).
 */
#include "amx_blocks.h"
#include "attention_softmax.h" /* exponentiate, store_output */
#include "head_pairs.h"        /* live_lanes, prefetch_row */
#include "selected_rows.h"     /* struct key_source, select_rows */

#define KEY_BLOCK MB          /* keys per score block: the rows of its two A tiles */
#define HEAD_BLOCK NB         /* heads per score block (its two B tiles' columns); heads per value block: MB */
#define DIM_BLOCK NB          /* dims of V per value panel: its two B tiles' columns */
#define STEP_ELEMENTS (2 * TILE_ROWS) /* bf16 of K per tile row: dims of a score step, keys of a value step */

static long round_up(long x, long multiple) { return (x + multiple - 1) / multiple * multiple; }

/* The value product's A: pa [hp][2 np] bf16, row h = [P_hi[h][0 .. np) | P_lo[h][0 .. np)], P[h][k] = E[k][h] /
   denominator[h] from the exponentiated workspace s [n][hp]; hi = P rounded, lo = (P - hi) rounded, 0 where that is
   not finite (inf / NaN pass through hi alone); 0 past the real heads and past n keys (bf16.h's rounding).

   The value product's B: dims d0 .. d0 + cols - 1 (cols <= DIM_BLOCK) of the n selected rows as a panel of
   np / STEP_ELEMENTS K steps: step s, B tile j, tile row p holds (row_k[d0 + 16 j + c], row_{k + 1}[d0 + 16 j + c])
   for k = 32 s + 2 p and the 16 columns c; 0 past n keys and past cols. Only the rows past n are cleared (the panel
   is rewritten for every 32 dims: clearing it whole cost as much as packing it). */
#if defined(GLM5_PORTABLE)
static void pack_probability_rows(const float *s, long n, long np, long hp, long heads, const float *denominator,
                                  uint16_t *pa) {
    for (long h = 0; h < hp; h++) {
        uint16_t *hi = pa + h * 2 * np, *lo = hi + np;
        for (long k = 0; k < np; k++) {
            float p = k < n && h < heads ? s[k * hp + h] / denominator[h] : 0.0f;
            uint16_t rounded = float_to_bf16(p);
            float rest = p - bf16_to_float(rounded);
            hi[k] = rounded;
            lo[k] = rest - rest == 0.0f ? float_to_bf16(rest) : 0;
        }
    }
}

static uint16_t *panel_row(uint16_t *panel, long pair) {
    return panel + (2 * pair / STEP_ELEMENTS) * (STEP_BYTES / 2) + (pair % TILE_ROWS) * (TILE_ROW_BYTES / 2);
}

static void pack_value_panel(const uint16_t *const *rows, long n, long np, long d0, int cols, uint16_t *panel) {
    for (long pair = 0; pair < np / 2; pair++) {
        uint16_t *row = panel_row(panel, pair);
        for (int c = 0; c < DIM_BLOCK; c++)
            for (int e = 0; e < 2; e++) {
                long k = 2 * pair + e;
                row[(c / TILE_COLUMNS) * (TILE_BYTES / 2) + 2 * (c % TILE_COLUMNS) + e] =
                    k < n && c < cols ? rows[k][d0 + c] : 0;
            }
    }
}
#else
#include <immintrin.h>

/* r[i] = row i of a 16 x 16 fp32 block -> r[j] = its column j (unpacks within 128-bit lanes, then lane shuffles). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
    }
}

/* Blocks of 16 keys x 16 heads: each key's P computed along the heads (a row of the workspace), the block transposed
   in registers, each head's 16 hi and lo parts stored along the keys. The portable build's values, bit for bit. */
static void pack_probability_rows(const float *s, long n, long np, long hp, long heads, const float *denominator,
                                  uint16_t *pa) {
    const __m512 zero = _mm512_setzero_ps();
    for (long h0 = 0; h0 < hp; h0 += 16) {
        const __mmask16 live = (__mmask16)live_lanes(heads, h0);
        const __m512 den = _mm512_loadu_ps(denominator + h0);
        for (long k0 = 0; k0 < np; k0 += 16) {
            __m512 r[16];
            for (int k = 0; k < 16; k++) /* dead heads read as 0 (their lanes of s were never written) */
                r[k] = k0 + k < n ? _mm512_div_ps(_mm512_maskz_loadu_ps(live, s + (k0 + k) * hp + h0), den) : zero;
            transpose16(r);
            for (int h = 0; h < 16; h++) {
                __m512i hi = bf16_lanes(r[h]);
                __m512 rest = _mm512_sub_ps(r[h], _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
                __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(rest, rest), zero, _CMP_EQ_OQ);
                uint16_t *row = pa + (h0 + h) * 2 * np + k0;
                _mm256_storeu_si256((__m256i *)row, _mm512_cvtepi32_epi16(hi));
                _mm256_storeu_si256((__m256i *)(row + np), _mm512_cvtepi32_epi16(_mm512_maskz_mov_epi32(finite, bf16_lanes(rest))));
            }
        }
    }
}

/* Per pair of keys: both rows' 32 dims loaded (masked past cols), interleaved into the two B tiles' rows. */
static void pack_value_panel(const uint16_t *const *rows, long n, long np, long d0, int cols, uint16_t *panel) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    const __mmask32 mask = cols >= DIM_BLOCK ? 0xFFFFFFFFu : (1u << cols) - 1u;
    for (long pair = 0; pair < np / 2; pair++) {
        long k = 2 * pair;
        __m512i r0 = k < n ? _mm512_maskz_loadu_epi16(mask, rows[k] + d0) : _mm512_setzero_si512();
        __m512i r1 = k + 1 < n ? _mm512_maskz_loadu_epi16(mask, rows[k + 1] + d0) : _mm512_setzero_si512();
        uint16_t *row = panel + (k / STEP_ELEMENTS) * (STEP_BYTES / 2) + (pair % TILE_ROWS) * (TILE_ROW_BYTES / 2);
        _mm512_storeu_si512(row, _mm512_permutex2var_epi16(r0, first, r1));
        _mm512_storeu_si512(row + TILE_BYTES / 2, _mm512_permutex2var_epi16(r0, second, r1));
    }
}
#endif

/* The scores, softmax and values of tokens t_begin .. t_end - 1 over the rows `keys` selects (sparse_attention.c's
   attend, the same arguments). q: [T][H][D] bf16 at element strides q_token, q_head (dims contiguous); rows:
   [num_slots] rows of row_stride elements; out: [T][H][dv] (element strides out_token, out_head), fp32 if out_fp32
   else bf16; lse: [T][H] fp32 (stride lse_token). Returns 0, or -1 if the per-thread workspace could not be
   allocated. */
static int attend(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token, long q_head,
                  const uint16_t *rows, long num_slots, long row_stride, const struct key_source *keys, float scale,
                  void *out, int out_fp32, long out_token, long out_head, float *lse, long lse_token, int row_prefetch,
                  long t_begin, long t_end) {
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
        pack_head_panels(q_t, q_head, heads, dims, dim_steps, q_panels); /* head_blocks panels of q_panel */
        for (long n0 = 0; n0 < n; n0 += KEY_BLOCK) {
            int n_keys = n - n0 < KEY_BLOCK ? (int)(n - n0) : KEY_BLOCK;
            for (int j = 0; j < n_keys; j++) memcpy(gathered + j * dims, valid_rows[n0 + j], sizeof *gathered * dims);
            for (long ahead = n0 + KEY_BLOCK; ahead < n0 + 2 * KEY_BLOCK && ahead < n; ahead++) /* the next block */
                prefetch_row(valid_rows[ahead], dims, row_prefetch);
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
