/* Sparse attention's two products straight from a paged bf16 latent cache, on CPUs (no gathered copy of the
 * selected rows). Per token t, over its selected keys n (row = rows + slot[t][n] * row_stride; slot -1: not a key):
 *
 *   glm5_sparse_scores: S[t][n][h]  = scale * sum_d q[t][h][d] * row_n[d]        (-inf where slot is -1)
 *   glm5_sparse_values: O[t][h][d]  = sum_n P[t][n][h] * row_n[d], d < dv        (slot -1 rows skipped: never read)
 *
 * The softmax between them stays in torch (fp32). Scores: heads are vector lanes (q packed as [D / 2][Hp][2], as
 * in indexer_scores.c), a tile is KEYS keys x 64 heads, VDPBF16PS on exact bf16 products with fp32 sums. Values: fp32
 * FMAs of the fp32 probabilities with the bf16 rows widened to fp32 (exact), a tile is 8 heads x 32 dims. So both
 * are the fp32 path's arithmetic up to the order of the sums; nothing is rounded to bf16.
 */
#include <math.h>
#include <stdlib.h>

#include "head_pairs.h"

#define KEYS 6        /* scores: keys per tile (x 4 head vectors = 24 accumulators) */
#define HEAD_GROUP 64 /* scores: heads per pass over a key */
#define VALUE_HEADS 8 /* values: heads per tile (P and O are padded to a multiple of it) */
#define VALUE_DIMS 32 /* values: dims per tile (two 16-lane vectors) */

#define PREFETCH_KEYS 8 /* rows are read this many keys ahead of use: selected rows are scattered over the cache */

#ifndef GLM5_PORTABLE
#include <immintrin.h>

static void score_tile(const uint16_t *keys[KEYS], int n_keys, const uint16_t *q, long pairs, long odd, long hp,
                       long h0, int nv, const __mmask16 live[4], float scale, float *s, long s_key) {
    __m512 acc[KEYS][4];
    for (int j = 0; j < KEYS; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
    for (long p = 0; p < pairs + odd; p++) {
        const uint16_t *qp = q + (p * hp + h0) * 2;
        __m512bh qv[4];
        qv[0] = (__m512bh)_mm512_loadu_si512(qp); /* nv >= 1 */
        for (int v = 1; v < 4; v++) qv[v] = v < nv ? (__m512bh)_mm512_loadu_si512(qp + 32 * v) : qv[0];
        for (int j = 0; j < KEYS; j++) {
            uint32_t pair; /* the pair's VDPBF16PS partner: written out here, not in head_pairs.h (gcc then keeps
                              the odd-D test out of this loop; through a helper the tile took 1.3x as long) */
            if (p < pairs) {
                memcpy(&pair, keys[j] + 2 * p, sizeof pair); /* dims 2p (low half) and 2p + 1 (high half) */
            } else {
                pair = keys[j][2 * p]; /* odd D: the last dim alone (q's packed partner is 0) */
            }
            __m512bh kv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < 4; v++)
                if (v < nv) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], qv[v], kv);
        }
    }
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int j = 0; j < n_keys; j++)
        for (int v = 0; v < nv; v++)
            _mm512_mask_storeu_ps(s + j * s_key + h0 + 16 * v, live[v], _mm512_mul_ps(acc[j][v], scaled));
}

/* Two keys' 32-dim slices as bf16 pairs (key k, key k + 1) per dim: `low` holds dims 0-3, 8-11, 16-19, 24-27 and
   `high` dims 4-7, 12-15, 20-23, 28-31 (unpack works within 128-bit lanes; value_tile puts them back in order).
   A masked load only at the edge: a masked load on every row made this loop several times slower. */
static inline void key_pairs(const uint16_t *row0, const uint16_t *row1, int full, __mmask32 mask, __m512bh *low,
                             __m512bh *high) {
    __m512i a = full ? _mm512_loadu_si512(row0) : _mm512_maskz_loadu_epi16(mask, row0);
    __m512i b = row1 == 0 ? _mm512_setzero_si512() : full ? _mm512_loadu_si512(row1) : _mm512_maskz_loadu_epi16(mask, row1);
    *low = (__m512bh)_mm512_unpacklo_epi16(a, b);
    *high = (__m512bh)_mm512_unpackhi_epi16(a, b);
}

/* The selected rows' slice d0 .. d0 + 31 as key pairs, one after another: vp[pair] = (low, high) of key_pairs,
   64 bf16. Read from the scattered rows once per slice; every head block then streams it from L2. */
static void pack_slice(const uint16_t *const *rows, long n_valid, long d0, long dv, uint16_t *vp) {
    long left = dv - d0;
    __mmask32 mask = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
    for (long k = 0; k < n_valid; k += 2) {
        if (k + PREFETCH_KEYS + 1 < n_valid) {
            prefetch(rows[k + PREFETCH_KEYS] + d0, VALUE_DIMS);
            prefetch(rows[k + PREFETCH_KEYS + 1] + d0, VALUE_DIMS);
        }
        __m512bh low, high;
        key_pairs(rows[k] + d0, k + 1 < n_valid ? rows[k + 1] + d0 : 0, left >= 32, mask, &low, &high);
        _mm512_storeu_si512(vp + (k / 2) * 64, (__m512i)low);
        _mm512_storeu_si512(vp + (k / 2) * 64 + 32, (__m512i)high);
    }
}

/* O[h0 + i][d0 .. d0 + 31] = sum over the valid keys of P[k][h0 + i] * row_k[d0 ..], from the packed slice vp and
   P as hi + lo bf16 parts packed in key pairs: pp[pair][h][part][2] (part 0: hi, 1: lo), so one broadcast dword is
   (P[k], P[k + 1]) of one part. */
static void value_tile(const uint16_t *const *rows, const uint16_t *vp, long n_valid, const uint16_t *pp, long hp,
                       long h0, long d0, long dv, float *o, long o_head) {
    (void)rows;
    __m512 acc[VALUE_HEADS][2];
    for (int i = 0; i < VALUE_HEADS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (long pair = 0; pair < (n_valid + 1) / 2; pair++) {
        __m512bh low = (__m512bh)_mm512_loadu_si512(vp + pair * 64);
        __m512bh high = (__m512bh)_mm512_loadu_si512(vp + pair * 64 + 32);
        const uint32_t *weights = (const uint32_t *)(pp + (pair * hp + h0) * 4);
        for (int i = 0; i < VALUE_HEADS; i++)
            for (int part = 0; part < 2; part++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)weights[2 * i + part]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w, low);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w, high);
            }
    }
    long left = dv - d0;
    __mmask32 mask = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < VALUE_HEADS; i++) {
        float *out = o + (h0 + i) * o_head + d0;
        _mm512_mask_storeu_ps(out, (__mmask16)mask, _mm512_permutex2var_ps(acc[i][0], first, acc[i][1]));
        _mm512_mask_storeu_ps(out + 16, (__mmask16)(mask >> 16), _mm512_permutex2var_ps(acc[i][0], second, acc[i][1]));
    }
}

static inline uint16_t to_bf16(float x) { /* round to nearest even (NaN stays NaN) */
    return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(x)));
}
#else
static void score_tile(const uint16_t *keys[KEYS], int n_keys, const uint16_t *q, long pairs, long odd, long hp,
                       long h0, int nv, const unsigned live[4], float scale, float *s, long s_key) {
    for (int j = 0; j < n_keys; j++)
        for (int h = h0; h < h0 + 16 * nv; h++) {
            if (!((live[(h - h0) / 16] >> ((h - h0) % 16)) & 1u)) continue;
            s[j * s_key + h] = head_dot(q, pairs, odd, hp, h, keys[j]) * scale;
        }
}

static void pack_slice(const uint16_t *const *rows, long n_valid, long d0, long dv, uint16_t *vp) {
    (void)rows, (void)n_valid, (void)d0, (void)dv, (void)vp; /* the scalar tile reads the rows themselves */
}

static void value_tile(const uint16_t *const *rows, const uint16_t *vp, long n_valid, const uint16_t *pp, long hp,
                       long h0, long d0, long dv, float *o, long o_head) {
    (void)vp;
    for (int i = 0; i < VALUE_HEADS; i++)
        for (long d = d0; d < d0 + VALUE_DIMS && d < dv; d++) {
            float sum = 0.0f;
            for (long k = 0; k < n_valid; k++)
                for (int part = 0; part < 2; part++)
                    sum += bf16_to_float(pp[(((k / 2) * hp + h0 + i) * 2 + part) * 2 + k % 2]) * bf16_to_float(rows[k][d]);
            o[(h0 + i) * o_head + d] = sum;
        }
}

static inline uint16_t to_bf16(float x) { /* round to nearest even (NaN stays NaN) */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#endif

/* q: [T][pairs + odd][hp][2] bf16 (hp = H rounded up to 16); slots: [T][topk] int64; S: [T][topk][s_key] fp32. */
void glm5_sparse_scores(long heads, long dims, long topk, const uint16_t *q, const uint16_t *rows, long row_stride,
                        const int64_t *slots, float scale, float *s, long s_token, long s_key, long t_begin,
                        long t_end) {
    long pairs = dims / 2, odd = dims % 2, hp = (heads + 15) / 16 * 16;
    for (long t = t_begin; t < t_end; t++) {
        const int64_t *st = slots + t * topk;
        float *out = s + t * s_token;
        const uint16_t *qt = q + t * (pairs + odd) * hp * 2;
        for (long n0 = 0; n0 < topk; n0 += KEYS) {
            int n_keys = topk - n0 < KEYS ? (int)(topk - n0) : KEYS;
            const uint16_t *keys[KEYS];
            const uint16_t *some_row = 0;
            for (int j = 0; j < n_keys; j++)
                if (st[n0 + j] >= 0) some_row = rows + st[n0 + j] * row_stride;
            for (int j = 0; j < KEYS; j++) /* an invalid key reads a valid key's row; its scores are -inf below */
                keys[j] = j < n_keys && st[n0 + j] >= 0 ? rows + st[n0 + j] * row_stride : some_row;
            for (long ahead = n0 + 2 * KEYS; ahead < n0 + 3 * KEYS && ahead < topk; ahead++) /* two tiles ahead */
                if (st[ahead] >= 0) prefetch(rows + st[ahead] * row_stride, dims);
            if (some_row) {
                for (long h0 = 0; h0 < hp; h0 += HEAD_GROUP) {
                    int nv = (int)((hp - h0) / 16 < 4 ? (hp - h0) / 16 : 4);
#ifndef GLM5_PORTABLE
                    __mmask16 live[4];
#else
                    unsigned live[4];
#endif
                    for (int v = 0; v < 4; v++) live[v] = live_lanes(heads, h0 + 16 * v);
                    score_tile(keys, n_keys, qt, pairs, odd, hp, h0, nv, live, scale, out + n0 * s_key, s_key);
                }
            }
            for (int j = 0; j < n_keys; j++)
                if (st[n0 + j] < 0)
                    for (long h = 0; h < heads; h++) out[(n0 + j) * s_key + h] = -INFINITY;
        }
    }
}

/* p: [T][topk][p_key] fp32 (p_key >= heads); o: [T][o_token / o_head][o_head] fp32 with room for heads rounded up
   to VALUE_HEADS. Per token, the valid keys' probabilities are split into hi + lo bf16 parts (hi = P rounded,
   lo = P - hi rounded, 0 where hi is not finite so that inf / NaN pass through hi alone: P to ~2^-16) and packed in
   key pairs for VDPBF16PS. Returns 0, or -1 if the per-token workspace could not be allocated. */
int glm5_sparse_values(long heads, long dv, long topk, const float *p, long p_token, long p_key,
                       const uint16_t *rows, long row_stride, const int64_t *slots, float *o, long o_token,
                       long o_head, long t_begin, long t_end) {
    long hp = (heads + VALUE_HEADS - 1) / VALUE_HEADS * VALUE_HEADS, pairs = (topk + 1) / 2;
    const uint16_t **valid_rows = malloc(sizeof *valid_rows * (topk > 0 ? topk : 1));
    uint16_t *pp = malloc(sizeof *pp * (pairs > 0 ? pairs : 1) * hp * 4);
    uint16_t *vp = malloc(sizeof *vp * (pairs > 0 ? pairs : 1) * 2 * VALUE_DIMS);
    if (!valid_rows || !pp || !vp) {
        free(valid_rows);
        free(pp);
        free(vp);
        return -1;
    }
    for (long t = t_begin; t < t_end; t++) {
        const int64_t *st = slots + t * topk;
        const float *pt = p + t * p_token;
        long n_valid = 0;
        for (long n = 0; n < topk; n++) {
            if (st[n] < 0) continue;
            valid_rows[n_valid] = rows + st[n] * row_stride;
            uint16_t *pair = pp + (n_valid / 2) * hp * 4;
            for (long h = 0; h < hp; h++) {
                float value = h < heads ? pt[n * p_key + h] : 0.0f;
                uint16_t hi = to_bf16(value);
                float rest = value - bf16_to_float(hi);
                pair[h * 4 + n_valid % 2] = hi;
                pair[h * 4 + 2 + n_valid % 2] = rest == rest && rest - rest == 0.0f ? to_bf16(rest) : 0;
            }
            n_valid++;
        }
        if (n_valid % 2) /* the last key's partner: zero weights (its row is never read) */
            for (long h = 0; h < hp; h++) pp[(n_valid / 2) * hp * 4 + h * 4 + 1] = pp[(n_valid / 2) * hp * 4 + h * 4 + 3] = 0;
        /* Dims outer: each 32-dim slice of the selected rows is gathered and paired once (128 KiB at topk 2048, in
           L2), then every head block streams it. */
        for (long d0 = 0; d0 < dv; d0 += VALUE_DIMS) {
            pack_slice(valid_rows, n_valid, d0, dv, vp);
            for (long h0 = 0; h0 < hp; h0 += VALUE_HEADS)
                value_tile(valid_rows, vp, n_valid, pp, hp, h0, d0, dv, o + t * o_token, o_head);
        }
    }
    free(valid_rows);
    free(pp);
    free(vp);
    return 0;
}
