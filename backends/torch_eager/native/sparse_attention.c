/* Sparse attention of a token over its selected keys, straight from a paged bf16 latent cache, on CPUs: one kernel
 * per token for the scores, the softmax and the value product, with the scores in a per-thread workspace that stays
 * in L2 (no gathered copy of the selected rows, no [T, topk, H] tensor in memory, no torch passes between them).
 * Per token t, over its valid selected keys n (row_n = rows + slot[t][n] * row_stride; a slot outside the rows, -1
 * included, is not a key and is never read):
 *
 *   S[n][h]  = scale * sum_d q[t][h][d] * row_n[d]
 *   peak[h]  = max_n S[n][h], or 0 where that is -inf (no shift then; exp stays exact 0) or a score is NaN; a +inf
 *              peak stays (a +inf score: inf - inf = NaN, so lse and O are NaN, as in the reference)
 *   E[n][h]  = exp(S[n][h] - peak[h]),  total[h] = sum_n E[n][h]
 *   lse[t][h] = peak[h] + log(total[h])                      (-inf for a token without valid keys)
 *   O[t][h][d] = sum_n (E[n][h] / max(total[h], FLT_MIN)) * row_n[d],  d < dv     (0 without valid keys, and 0
 *                where lse is -inf: every score -inf, an empty softmax)
 *
 * Scores: heads are vector lanes (q packed as [D / 2][Hp][2], as in indexer_scores.c), a tile is KEYS keys x 64
 * heads, VDPBF16PS on exact bf16 products with fp32 sums. Softmax in fp32 (exp to ~1 ulp). Values: the normalised
 * probabilities enter as hi + lo bf16 parts (P to ~2^-16, as glm5_hal's other half-precision products take an fp32
 * operand), exact products summed in fp32, a tile is 8 heads x 32 dims. So this is the fp32 path's arithmetic up to
 * the order of the sums and ~2^-16 of each probability; the result is rounded once, to the output's dtype.
 *
 * The AVX2 build (GLM5_AVX2, CPUs without AVX-512): 8 heads per 256-bit vector, q and the rows widened exactly in
 * registers (bf16.h) and each exact product added by an FMA; scores in tiles of 6 keys x 16 heads or 3 x 32
 * (head_pairs.h), or, for at most 4 heads, dots along D in tiles of 3 keys x 4 heads (row_dot_tile); the same
 * softmax (exp8 is exp16's arithmetic on 8 lanes); the values take the normalised probabilities in fp32, not as
 * hi + lo parts: with the rows widened to fp32 there is no bf16-only multiplier to feed, and an FMA of the fp32 P
 * rounds once per term as the fp32 path's GEMM does (so P is not cut to ~2^-16). A value tile is 4 heads x 16
 * dims. At most 4 heads take the rows in one pass instead (attend_few_heads_online): blocks of keys, each scored,
 * exponentiated and multiplied into the output while its rows are in L1 / L2, the softmax shifted by the running
 * peak and the output divided by the total at the end; a NaN or infinite score sends the token to the two passes.
 * Subnormals are kept (no DAZ / FTZ in this build or the portable one).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "attention_softmax.h" /* exponentiate, store_output (and exp8 for the AVX2 build) */
#include "head_pairs.h"
#include "selected_rows.h"   /* select_rows */

#if defined(GLM5_AVX2)
#define KEYS PAIR_KEYS /* scores: keys per tile (6 x 2 or 3 x 4 head vectors of 8 = 12 accumulators) */
#define HEAD_GROUP 32  /* scores: heads per pass over a key (at most 4 vectors of 8) */
#define VALUE_HEADS 4  /* values: heads per tile (P and O are padded to a multiple of it; it divides 16) */
#define VALUE_DIMS 16  /* values: dims per tile (one 16-bf16 load of a row: its even and odd dims) */
#define VALUE_KEY_BLOCK 32 /* values: keys whose rows every value tile reads before the next block (32 KiB at dv 512) */
#else
#define KEYS 6        /* scores: keys per tile (x 4 head vectors = 24 accumulators) */
#define HEAD_GROUP 64 /* scores: heads per pass over a key */
#define VALUE_HEADS 8 /* values: heads per tile (P and O are padded to a multiple of it) */
#define VALUE_DIMS 32 /* values: dims per tile (two 16-lane vectors) */
#endif

#define PREFETCH_KEYS 8 /* rows are read this many keys ahead of use: selected rows are scattered over the cache */

#if defined(GLM5_AVX2)
static void score_tile(const uint16_t *keys[KEYS], int n_keys, const uint16_t *q, long pairs, long odd, long hp,
                       long h0, int nv, const unsigned live[4], float scale, float *s, long s_key) {
    /* Every lane is stored: exponentiate clears the dead ones (their dot may be NaN). Where the heads past h0 + 8
       are all padding their products are not made, and their lanes are stored as 0. */
    int vectors = live[0] >> 8 ? 2 * nv : 1;
    float dots[KEYS][32];
    heads_by_keys(keys, q, pairs, odd, hp, h0, vectors, dots);
    const __m256 scaled = _mm256_set1_ps(scale);
    for (int j = 0; j < n_keys; j++)
        for (int v = 0; v < 2 * nv; v++)
            _mm256_storeu_ps(s + j * s_key + h0 + 8 * v,
                             v < vectors ? _mm256_mul_ps(_mm256_loadu_ps(dots[j] + 8 * v), scaled) : _mm256_setzero_ps());
}

/* At most ROW_HEADS real heads (glm5-mini's 4, a model split into shares of 4 or fewer heads): dots along D
   instead, in tiles of ROW_KEYS keys x ROW_HEADS heads of 8-lane accumulators, with q widened to fp32 once per
   token (qf [ROW_HEADS][dims], zero past the real heads). With heads in the lanes each key's every dim pair fed a
   whole 8-head vector, half of it padding at 4 heads: the score pass cost the same at 4 heads as at 8. Per lane l
   of a dot, the dims d = l mod 8 in order; the lanes summed pairwise (hadd); dims past the last multiple of 8 added
   after, in order. s[k][h] = scale x dot for h < ROW_HEADS, lanes ROW_HEADS .. 7 stored as 0 (exponentiate masks
   every lane past the real heads). */
#define ROW_HEADS 4
#define ROW_KEYS 3 /* 3 keys x 4 heads = 12 accumulators, the keys' 3 widened slices and one q slice: 16 ymm */
#if ROW_HEADS > VALUE_HEADS
#error "the one-pass route's value tile covers VALUE_HEADS heads"
#endif

/* qf [ROW_HEADS][dims] fp32 from the packed q [pairs + odd][hp][2] of one token (dim d is pair d / 2, part d % 2). */
static void widen_heads(const uint16_t *q, long hp, long heads, long dims, float *qf) {
    for (long h = 0; h < ROW_HEADS; h++)
        for (long d = 0; d < dims; d++)
            qf[h * dims + d] = h < heads ? bf16_to_float(q[((d / 2) * hp + h) * 2 + d % 2]) : 0.0f;
}

static inline __m256 widen8(const uint16_t *row) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row)), 16));
}

static void row_dot_tile(const uint16_t *const *rows, int n_keys, const float *qf, long dims, float scale, float *s,
                         long s_key) {
    long vector_dims = dims / 8 * 8;
    __m256 acc[ROW_KEYS][ROW_HEADS];
    for (int j = 0; j < ROW_KEYS; j++)
        for (int h = 0; h < ROW_HEADS; h++) acc[j][h] = _mm256_setzero_ps();
    for (long d = 0; d < vector_dims; d += 8) {
        __m256 key[ROW_KEYS];
        for (int j = 0; j < ROW_KEYS; j++) key[j] = widen8(rows[j] + d);
        for (int h = 0; h < ROW_HEADS; h++) {
            __m256 qv = _mm256_loadu_ps(qf + h * dims + d);
            for (int j = 0; j < ROW_KEYS; j++) acc[j][h] = _mm256_fmadd_ps(qv, key[j], acc[j][h]);
        }
    }
    const __m256 scaled = _mm256_set1_ps(scale);
    for (int j = 0; j < n_keys; j++) {
        /* lanes 0-3 of (low half + high half) are the 4 heads' lane sums */
        __m256 pairs01 = _mm256_hadd_ps(acc[j][0], acc[j][1]), pairs23 = _mm256_hadd_ps(acc[j][2], acc[j][3]);
        __m256 quads = _mm256_hadd_ps(pairs01, pairs23);
        __m128 sums = _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
        float dots[ROW_HEADS];
        _mm_storeu_ps(dots, sums);
        for (long d = vector_dims; d < dims; d++) {
            float k = bf16_to_float(rows[j][d]);
            for (int h = 0; h < ROW_HEADS; h++) dots[h] += qf[h * dims + d] * k;
        }
        __m128 scores = _mm_mul_ps(_mm_loadu_ps(dots), _mm256_castps256_ps128(scaled));
        _mm256_storeu_ps(s + j * s_key, _mm256_insertf128_ps(_mm256_castps128_ps256(scores), _mm_setzero_ps(), 1));
    }
}

/* s [k1 - k0][hp] for the valid rows k0 .. k1 - 1 (of n), at most ROW_HEADS real heads (row_dot_tile); rows ahead
   are prefetched up to n (as row_prefetch says: row_prefetch.h). Not inlined into the token loop: there it changed how
   gcc compiled the heads-in-lanes tiles, which then ran ~12% slower at 5 to 8 heads. */
static __attribute__((noinline)) void score_few_heads(const uint16_t *const *valid_rows, long n, long k0, long k1,
                                                      const float *qf, long dims, float scale, float *s, long hp,
                                                      int row_prefetch) {
    for (long n0 = k0; n0 < k1; n0 += ROW_KEYS) {
        const uint16_t *keys[ROW_KEYS];
        for (int j = 0; j < ROW_KEYS; j++) keys[j] = valid_rows[n0 + j < k1 ? n0 + j : n0]; /* spare lanes: a real row */
        for (long ahead = n0 + 4 * ROW_KEYS; ahead < n0 + 5 * ROW_KEYS && ahead < n; ahead++)
            prefetch_row(valid_rows[ahead], dims, row_prefetch);
        row_dot_tile(keys, k1 - n0 < ROW_KEYS ? (int)(k1 - n0) : ROW_KEYS, qf, dims, scale, s + (n0 - k0) * hp, hp);
    }
}

/* E [n][hp] -> P = E / denominator in place, fp32 (value_tile's operand; pair_copy is not needed). */
static void pack_probabilities(float *s, long n, long hp, long heads, const float *denominator, float *pair_copy) {
    (void)heads, (void)pair_copy;
    for (long k = 0; k < n; k++)
        for (long h0 = 0; h0 < hp; h0 += 8)
            _mm256_storeu_ps(s + k * hp + h0, _mm256_div_ps(_mm256_loadu_ps(s + k * hp + h0), _mm256_loadu_ps(denominator + h0)));
}

/* O[h0 + i][d0 .. d0 + 15] = sum over the valid keys of P[k][h0 + i] * row_k[d0 ..], P fp32 [n][hp] (pp, as
   pack_probabilities left it). Lane l of acc[i][0] sums dim d0 + 2l, of acc[i][1] dim d0 + 2l + 1; a slice past dv
   is copied into zeros first (a row may end at dv). */
/* acc[i][0] lane l += P[k][i] row_k[2l], acc[i][1] lane l += P[k][i] row_k[2l + 1] over the keys k < n_valid, for
   16-bf16 slices read from rows[k] + d0 (p: P of head h0, hp apart per key). Inlined with the accumulators in
   registers: with the edge copy inside the same loop gcc kept them on the stack, a store per FMA (the value pass
   then took ~2x as long). */
static inline __attribute__((always_inline)) void value_sums(const uint16_t *const *rows, long n_valid, const float *p,
                                                             long hp, long d0, long left,
                                                             __m256 acc[VALUE_HEADS][2]) {
    __m256 a00 = acc[0][0], a01 = acc[0][1], a10 = acc[1][0], a11 = acc[1][1];
    __m256 a20 = acc[2][0], a21 = acc[2][1], a30 = acc[3][0], a31 = acc[3][1];
    for (long k = 0; k < n_valid; k++) {
        __m256i x;
        if (left == VALUE_DIMS) {
            x = _mm256_loadu_si256((const __m256i *)(rows[k] + d0));
        } else { /* a slice past dv: copied into zeros first (a row may end at dv) */
            uint16_t edge[VALUE_DIMS] = {0};
            memcpy(edge, rows[k] + d0, sizeof *edge * left);
            x = _mm256_loadu_si256((const __m256i *)edge);
        }
        __m256 even = low_halves(x), odd = high_halves(x);
        const float *pk = p + k * hp;
        __m256 w = _mm256_broadcast_ss(pk);
        a00 = _mm256_fmadd_ps(w, even, a00), a01 = _mm256_fmadd_ps(w, odd, a01);
        w = _mm256_broadcast_ss(pk + 1);
        a10 = _mm256_fmadd_ps(w, even, a10), a11 = _mm256_fmadd_ps(w, odd, a11);
        w = _mm256_broadcast_ss(pk + 2);
        a20 = _mm256_fmadd_ps(w, even, a20), a21 = _mm256_fmadd_ps(w, odd, a21);
        w = _mm256_broadcast_ss(pk + 3);
        a30 = _mm256_fmadd_ps(w, even, a30), a31 = _mm256_fmadd_ps(w, odd, a31);
    }
    acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11;
    acc[2][0] = a20, acc[2][1] = a21, acc[3][0] = a30, acc[3][1] = a31;
}

/* O[h0 + i][d0 .. d0 + 15] += sum over the valid keys of P[k][h0 + i] * row_k[d0 ..], P fp32 [n][hp] (pp, as
   pack_probabilities left it). Lane l of acc[i][0] sums dim d0 + 2l, of acc[i][1] dim d0 + 2l + 1; a slice past dv
   is copied into zeros first (a row may end at dv). */
static void value_tile(const uint16_t *const *rows, const uint16_t *vp, long n_valid, const uint16_t *pp, long hp,
                       long h0, long d0, long dv, float *o, long o_head) {
    (void)vp;
    const float *p = (const float *)pp + h0;
    long left = dv - d0 < VALUE_DIMS ? dv - d0 : VALUE_DIMS;
    __m256 acc[VALUE_HEADS][2];
    for (int i = 0; i < VALUE_HEADS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    if (left == VALUE_DIMS) /* the loop specialised for whole slices, which every slice but a last one is */
        value_sums(rows, n_valid, p, hp, d0, VALUE_DIMS, acc);
    else
        value_sums(rows, n_valid, p, hp, d0, left, acc);
    for (int i = 0; i < VALUE_HEADS; i++) {
        __m256 lo = _mm256_unpacklo_ps(acc[i][0], acc[i][1]), hi = _mm256_unpackhi_ps(acc[i][0], acc[i][1]);
        float ordered[VALUE_DIMS]; /* dims d0 .. d0 + 15 in order: unpack interleaves within 128-bit halves */
        _mm256_storeu_ps(ordered, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(ordered + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        for (long d = 0; d < left; d++) o[(h0 + i) * o_head + d0 + d] += ordered[d]; /* a block of keys' share */
    }
}

/* At most ROW_HEADS heads, in one pass over the rows: each block of VALUE_KEY_BLOCK keys gets its scores, exps and
   value products while its rows are in L1 / L2, with the softmax's shift the running peak (the online softmax):
   where a block raises a head's peak, the exps so far, their total and the head's partial output are scaled by
   exp(old - new) first, and the output is divided by the total at the end. The two passes (all scores, then all
   values) read every row twice, and 2048 selected rows (2.3 MiB at width 576) do not stay in L2 between them. The
   values take E = exp(s - peak) in fp32 and the division comes last: the fp32 path's arithmetic up to the order of
   the sums and the ~1 ulp of each rescale. Only where every score is finite (a NaN or infinite one has the file's
   top semantics: returns 0 at once, having written nothing, and the caller runs the two passes). o [ROW_HEADS][dv]
   fp32, s: VALUE_KEY_BLOCK x hp floats of workspace; lse: the token's H values. */
static int attend_few_heads_online(const uint16_t *const *valid_rows, long n, const float *qf, long dims, long dv,
                                   long heads, long hp, float scale, float *s, float *o, float *lse, int row_prefetch) {
    const __m256 live = lanes_below(heads);
    const __m256 zero = _mm256_setzero_ps(), infinity = _mm256_set1_ps(INFINITY);
    __m256 peak = _mm256_set1_ps(-INFINITY), total = zero;
    memset(o, 0, sizeof *o * ROW_HEADS * dv);
    for (long k0 = 0; k0 < n; k0 += VALUE_KEY_BLOCK) {
        long block = n - k0 < VALUE_KEY_BLOCK ? n - k0 : VALUE_KEY_BLOCK;
        score_few_heads(valid_rows, n, k0, k0 + block, qf, dims, scale, s, hp, row_prefetch);
        __m256 block_peak = peak, not_finite = zero;
        for (long k = 0; k < block; k++) {
            __m256 x = _mm256_and_ps(live, _mm256_loadu_ps(s + k * hp)); /* dead lanes: 0 */
            block_peak = _mm256_max_ps(block_peak, x);
            /* |x| == inf, or x NaN (unordered) */
            not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), infinity,
                                                                _CMP_NLT_UQ));
        }
        if (_mm256_movemask_ps(not_finite)) return 0;
        __m256 rescale = exp8(_mm256_sub_ps(peak, block_peak)); /* (the first block: o and total are still 0) */
        float factors[8];
        _mm256_storeu_ps(factors, rescale);
        if (k0 > 0 && _mm256_movemask_ps(_mm256_cmp_ps(rescale, _mm256_set1_ps(1.0f), _CMP_NEQ_UQ)) & 0xF) {
            total = _mm256_mul_ps(total, rescale);
            for (long h = 0; h < ROW_HEADS; h++)
                for (long d = 0; d < dv; d++) o[h * dv + d] *= factors[h];
        }
        peak = block_peak;
        for (long k = 0; k < block; k++) {
            __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_and_ps(live, _mm256_loadu_ps(s + k * hp)), peak)));
            _mm256_storeu_ps(s + k * hp, e);
            total = _mm256_add_ps(total, e);
        }
        for (long d0 = 0; d0 < dv; d0 += VALUE_DIMS)
            value_tile(valid_rows + k0, NULL, block, (const uint16_t *)s, hp, 0, d0, dv, o, dv);
    }
    float peaks[8], totals[8];
    _mm256_storeu_ps(peaks, peak);
    _mm256_storeu_ps(totals, total);
    for (long h = 0; h < heads; h++) { /* total >= 1: the peak's own exp is 1 */
        lse[h] = peaks[h] + logf(totals[h]);
        for (long d = 0; d < dv; d++) o[h * dv + d] /= totals[h];
    }
    return 1;
}
#elif !defined(GLM5_PORTABLE)
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


/* P = e / denominator as (hi, lo) bf16 parts: hi = P rounded, lo = (P - hi) rounded, 0 where that is not finite
   (inf / NaN pass through hi alone); as 32-bit lanes with the bf16 in the low half. */
static inline void split_parts(__m512 p, __m512i *hi, __m512i *lo) {
    __m256bh rounded = _mm512_cvtneps_pbh(p);
    *hi = _mm512_cvtepu16_epi32((__m256i)rounded);
    __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(*hi, 16)));
    __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(rest, rest), _mm512_setzero_ps(), _CMP_EQ_OQ);
    *lo = _mm512_maskz_cvtepu16_epi32(finite, (__m256i)_mm512_cvtneps_pbh(rest));
}

/* E [n][hp] -> the probabilities' parts in the layout value_tile reads, pp[pair][h][part][2] (uint16), written over
   E: a pair's region of pp (hp x 4 bf16) is exactly its two rows of E (2 x hp fp32), so each pair is copied out
   first (pair_copy: 2 x hp floats). The odd key out of the last pair, and heads >= heads, get 0. */
static void pack_probabilities(float *s, long n, long hp, long heads, const float *denominator, float *pair_copy) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (long pair = 0; pair < (n + 1) / 2; pair++) {
        int both = 2 * pair + 1 < n;
        memcpy(pair_copy, s + 2 * pair * hp, sizeof *pair_copy * hp * (both ? 2 : 1));
        uint16_t *pp = (uint16_t *)s + pair * hp * 4;
        for (long h0 = 0; h0 < hp; h0 += 16) {
            __mmask16 live = (__mmask16)live_lanes(heads, h0);
            __m512 denominators = _mm512_loadu_ps(denominator + h0);
            __m512i hi0, lo0, hi1 = _mm512_setzero_si512(), lo1 = _mm512_setzero_si512();
            split_parts(_mm512_div_ps(_mm512_maskz_loadu_ps(live, pair_copy + h0), denominators), &hi0, &lo0);
            if (both)
                split_parts(_mm512_div_ps(_mm512_maskz_loadu_ps(live, pair_copy + hp + h0), denominators), &hi1,
                            &lo1);
            __m512i his = _mm512_or_si512(hi0, _mm512_slli_epi32(hi1, 16)); /* per head: (P[k], P[k + 1]) hi */
            __m512i los = _mm512_or_si512(lo0, _mm512_slli_epi32(lo1, 16));
            _mm512_storeu_si512(pp + h0 * 4, _mm512_permutex2var_epi32(his, first, los));
            _mm512_storeu_si512(pp + h0 * 4 + 32, _mm512_permutex2var_epi32(his, second, los));
        }
    }
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


static void pack_probabilities(float *s, long n, long hp, long heads, const float *denominator, float *pair_copy) {
    for (long pair = 0; pair < (n + 1) / 2; pair++) {
        int both = 2 * pair + 1 < n;
        memcpy(pair_copy, s + 2 * pair * hp, sizeof *pair_copy * hp * (both ? 2 : 1));
        uint16_t *pp = (uint16_t *)s + pair * hp * 4;
        for (long h = 0; h < hp; h++)
            for (int key = 0; key < 2; key++) {
                float p = h < heads && (key == 0 || both) ? pair_copy[key * hp + h] / denominator[h] : 0.0f;
                uint16_t hi = float_to_bf16(p);
                float rest = p - bf16_to_float(hi);
                pp[h * 4 + key] = hi;
                pp[h * 4 + 2 + key] = rest - rest == 0.0f ? float_to_bf16(rest) : 0;
            }
    }
}
#endif

/* The scores, softmax and values of tokens t_begin .. t_end - 1 over the rows `keys` selects (the file's top).
   q: [T][H][D] bf16 at element strides q_token, q_head (dims contiguous), packed per token as [pairs + odd][hp][2]
   (hp = H rounded up to 16; head_pairs.h) into the workspace; rows: [num_slots] rows of row_stride elements; out:
   [T][H][dv] (element strides out_token, out_head), fp32 if out_fp32 else bf16; lse: [T][H] fp32 (stride
   lse_token); row_prefetch: how rows read next are asked for (row_prefetch.h). Returns 0, or -1 if the per-thread
   workspace could not be allocated. */
static int attend(long heads, long dims, long dv, long topk, const uint16_t *q, long q_token, long q_head,
                  const uint16_t *rows, long num_slots, long row_stride, const struct key_source *keys, float scale, void *out, int out_fp32,
                  long out_token, long out_head, float *lse, long lse_token, int row_prefetch,
                  long t_begin, long t_end) {
    long pairs = dims / 2, odd = dims % 2, hp = (heads + 15) / 16 * 16;
    long value_heads = (heads + VALUE_HEADS - 1) / VALUE_HEADS * VALUE_HEADS, key_pairs = (topk + 1) / 2 + 1;
    size_t out_size = out_fp32 ? sizeof(float) : sizeof(uint16_t);
    /* Per thread: the valid keys' rows, their scores (then exps, then probability parts: 2 x key_pairs x hp fp32,
       ~512 KiB at topk 2048 and 64 heads), a packed 32-dim slice of the rows, the fp32 output, and small per-head
       arrays. */
    const uint16_t **valid_rows = malloc(sizeof *valid_rows * (topk > 0 ? topk : 1));
    float *s = malloc(sizeof *s * 2 * key_pairs * (hp > 0 ? hp : 1));
    uint16_t *vp = malloc(sizeof *vp * key_pairs * 2 * VALUE_DIMS);
    float *o = malloc(sizeof *o * (value_heads * dv > 0 ? value_heads * dv : 1));
    float *per_head = malloc(sizeof *per_head * 3 * (hp > 0 ? hp : 1)); /* denominators, then a pair's copy */
    uint16_t *qt = malloc(sizeof *qt * (pairs + odd) * hp * 2 + 1); /* this token's packed q */
#if defined(GLM5_AVX2)
    float *qf = malloc(sizeof *qf * ROW_HEADS * (dims > 0 ? dims : 1)); /* q widened, where heads <= ROW_HEADS */
#else
    float *qf = malloc(sizeof *qf);
#endif
    int status = 0;
    if (!valid_rows || !s || !vp || !o || !per_head || !qt || !qf) {
        status = -1;
        t_end = t_begin;
    }
    for (long t = t_begin; t < t_end; t++) {
        char *out_t = (char *)out + t * out_token * out_size;
        long n = select_rows(keys, t, topk, rows, num_slots, row_stride, valid_rows);
        if (n == 0) { /* no key: out 0, lse -inf */
            for (long h = 0; h < heads; h++) {
                memset(out_t + h * out_head * out_size, 0, dv * out_size);
                lse[t * lse_token + h] = -INFINITY;
            }
            continue;
        }
        pack_head_pairs(q + t * q_token, q_head, heads, dims, hp, qt);
#if defined(GLM5_AVX2)
        if (heads <= ROW_HEADS) {
            widen_heads(qt, hp, heads, dims, qf);
            if (attend_few_heads_online(valid_rows, n, qf, dims, dv, heads, hp, scale, s, o, lse + t * lse_token,
                                        row_prefetch)) {
                store_output(o, heads, dv, out_t, out_fp32, out_head);
                continue;
            }
            score_few_heads(valid_rows, n, 0, n, qf, dims, scale, s, hp, row_prefetch);
        } else
#endif
        for (long n0 = 0; n0 < n; n0 += KEYS) {
            int n_keys = n - n0 < KEYS ? (int)(n - n0) : KEYS;
            const uint16_t *keys[KEYS];
            for (int j = 0; j < KEYS; j++) keys[j] = valid_rows[j < n_keys ? n0 + j : n0]; /* spare lanes: a real row */
            for (long ahead = n0 + 2 * KEYS; ahead < n0 + 3 * KEYS && ahead < n; ahead++) /* two tiles ahead */
                prefetch_row(valid_rows[ahead], dims, row_prefetch);
            for (long h0 = 0; h0 < hp; h0 += HEAD_GROUP) {
                int nv = (int)((hp - h0) / 16 < HEAD_GROUP / 16 ? (hp - h0) / 16 : HEAD_GROUP / 16);
#if !defined(GLM5_PORTABLE) && !defined(GLM5_AVX2)
                __mmask16 live[4];
#else
                unsigned live[4];
#endif
                for (int v = 0; v < 4; v++) live[v] = live_lanes(heads, h0 + 16 * v);
                score_tile(keys, n_keys, qt, pairs, odd, hp, h0, nv, live, scale, s + n0 * hp, hp);
            }
        }
        exponentiate(s, n, hp, heads, lse + t * lse_token, per_head);
        pack_probabilities(s, n, hp, heads, per_head, per_head + hp);
#if defined(GLM5_AVX2)
        /* Blocks of keys outer: a block's rows (VALUE_KEY_BLOCK x dv bf16) stay in L1 / L2 while every dim slice and
           head tile reads them, and each tile adds its block's share to o. Dims outer instead read every selected
           row once per 16-dim slice from L3 or memory, scattered (at 4 heads the value pass took ~2x as long). */
        memset(o, 0, sizeof *o * value_heads * dv);
        for (long k0 = 0; k0 < n; k0 += VALUE_KEY_BLOCK) {
            long block = n - k0 < VALUE_KEY_BLOCK ? n - k0 : VALUE_KEY_BLOCK;
            for (long d0 = 0; d0 < dv; d0 += VALUE_DIMS)
                for (long h0 = 0; h0 < value_heads; h0 += VALUE_HEADS)
                    value_tile(valid_rows + k0, vp, block, (const uint16_t *)(s + k0 * hp), hp, h0, d0, dv, o, dv);
        }
#else
        /* Dims outer: each 32-dim slice of the selected rows is gathered and paired once (128 KiB at topk 2048, in
           L2), then every head block streams it. */
        for (long d0 = 0; d0 < dv; d0 += VALUE_DIMS) {
            pack_slice(valid_rows, n, d0, dv, vp);
            for (long h0 = 0; h0 < value_heads; h0 += VALUE_HEADS)
                value_tile(valid_rows, vp, n, (const uint16_t *)s, hp, h0, d0, dv, o, dv);
        }
#endif
        store_output(o, heads, dv, out_t, out_fp32, out_head);
        for (long h = 0; h < heads; h++) /* all scores -inf: an empty softmax, out 0 whatever V holds (0 * inf) */
            if (lse[t * lse_token + h] == -INFINITY) memset(out_t + h * out_head * out_size, 0, dv * out_size);
    }
    free(valid_rows);
    free(s);
    free(vp);
    free(o);
    free(per_head);
    free(qt);
    free(qf);
    return status;
}

#include "attention_entry.h" /* glm5_sparse_attention, glm5_sparse_attention_paged: around attend */
