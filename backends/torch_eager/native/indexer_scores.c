/* The lightning indexer's scores straight from a paged bf16 key cache, on CPUs:
 *
 *   score[t][s] = sum_h w[t][h] * relu(sum_d q[t][h][d] * key_t(s)[d])     for s < limit[t], else -inf
 *   key_t(s)    = cache[table[t][s / block_size]][s % block_size][:]       (bf16 rows, read in place)
 *
 * Heads are the vector lanes (q packed as [D / 2][Hp][2]: for each pair of dims, every head's two values, the
 * layout VDPBF16PS multiplies against one broadcast pair of a key), keys the independent accumulators: a tile is
 * KEYS keys x 32 heads. The products are exact in fp32 and every sum is an fp32 add, as in the fp32 path; relu
 * keeps NaN (max(0, x) returns x when x is NaN), and heads past H contribute nothing, even where a key holds inf
 * or NaN (their lanes are zeroed by mask, not multiplied by a zero weight). backends/torch_eager/native/indexer_scores.py has
 * the Python side; built with AVX-512 BF16, with AVX2 and portable like bf16_gemm.c (amx_index_scores.c is the AMX
 * build's kernel, with this entry point). The AVX2 build puts 8 heads in a
 * 256-bit vector, widens q and the keys exactly in registers (bf16.h) and adds each exact product with an FMA; a
 * tile is 6 keys x 16 heads or 3 keys x 32 (head_pairs.h), and subnormals are kept (no DAZ / FTZ).
 */
#include <math.h>

#include "head_pairs.h"
#include "paged_tokens.h" /* key_row */

#if defined(GLM5_AVX2)
#define KEYS PAIR_KEYS /* keys per tile: 6 (or 2 x 3) keys x 16 (32) heads in 8-lane vectors = 12 accumulators */
#else
#define KEYS 8         /* keys per tile: 8 x 2 head vectors = 16 accumulators */
#endif
#define CHUNK 256      /* key positions per chunk: a chunk's rows (64 KiB at D = 128) stay in L2 across tokens */
#define HEAD_GROUP 32  /* heads per pass over a key: two 16-lane vectors */
#define PREFETCH_KEYS 16 /* prefetch the rows of the tile this many keys ahead (two tiles) */

/* The rows of keys s .. s + n - 1 (rows past n repeat row s). A tile of KEYS keys usually lies in one block: then
   one division finds the block and the rows follow it (a division per key cost a quarter of a tile's time). */
static inline void tile_rows(const uint16_t *cache, long block_stride, long row_stride, long block_size,
                             const int32_t *table, long s, int n, const uint16_t *rows[KEYS]) {
    long offset = s % block_size;
    if (offset + n <= block_size) {
        const uint16_t *first = cache + (long)table[s / block_size] * block_stride + offset * row_stride;
        for (int j = 0; j < KEYS; j++) rows[j] = first + (j < n ? j : 0) * row_stride;
        return;
    }
    for (int j = 0; j < KEYS; j++) rows[j] = key_row(cache, block_stride, row_stride, block_size, table, s + (j < n ? j : 0));
}

#if defined(GLM5_AVX2)

/* The lanes of the 8-head vector `v` (of 16-head vector v / 2) that are live, as all-ones lanes. */
static inline __m256 live_vector(const unsigned live[2], int v) {
    unsigned bits = (live[v / 2] >> (8 * (v % 2))) & 0xFFu;
    __m256i lane = _mm256_srlv_epi32(_mm256_set1_epi32((int)bits), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(1)), _mm256_set1_epi32(1)));
}

/* out[j] += sum over heads h0 .. h0 + 16 nv - 1 of w[h] relu(q_h . key_j), for KEYS keys; nv: 16-head groups. */
static inline void tile(const uint16_t *keys[KEYS], const uint16_t *q, long pairs, long odd, long hp, long h0,
                        int nv, const unsigned live[2], const float *w, float out[KEYS]) {
    float dots[KEYS][32];
    int vectors = live[0] >> 8 ? 2 * nv : 1; /* heads past h0 + 8 are all padding: their products are not made */
    heads_by_keys(keys, q, pairs, odd, hp, h0, vectors, dots);
    const __m256 zero = _mm256_setzero_ps();
    __m256 keep[4], wv[4];
    for (int v = 0; v < vectors; v++) keep[v] = live_vector(live, v), wv[v] = _mm256_loadu_ps(w + h0 + 8 * v);
    for (int j = 0; j < KEYS; j++) {
        __m256 sum = zero;
        for (int v = 0; v < vectors; v++) /* dead lanes are cleared, not weighted by 0 (their dot may be NaN) */
            sum = _mm256_add_ps(sum, _mm256_and_ps(keep[v], _mm256_mul_ps(_mm256_max_ps(zero, _mm256_loadu_ps(dots[j] + 8 * v)), wv[v])));
        __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        half = _mm_add_ps(half, _mm_movehl_ps(half, half));
        out[j] += _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    }
}
#elif !defined(GLM5_PORTABLE)

/* out[j] += sum over heads h0 .. h0 + heads - 1 of w[h] relu(q_h . key_j), for KEYS keys; nv: 16-lane head vectors. */
static inline void tile(const uint16_t *keys[KEYS], const uint16_t *q, long pairs, long odd, long hp, long h0,
                        int nv, const __mmask16 live[2], const float *w, float out[KEYS]) {
    __m512 acc[KEYS][2];
    for (int j = 0; j < KEYS; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (long p = 0; p < pairs + odd; p++) {
        const uint16_t *qp = q + (p * hp + h0) * 2;
        __m512bh qv0 = (__m512bh)_mm512_loadu_si512(qp);
        __m512bh qv1 = nv > 1 ? (__m512bh)_mm512_loadu_si512(qp + 32) : qv0;
        for (int j = 0; j < KEYS; j++) {
            uint32_t pair; /* the pair's VDPBF16PS partner: written out here, not in head_pairs.h (gcc then keeps
                              the odd-D test out of this loop; through a helper the tile took 1.3x as long) */
            if (p < pairs) {
                memcpy(&pair, keys[j] + 2 * p, sizeof pair); /* dims 2p (low half) and 2p + 1 (high half) */
            } else {
                pair = keys[j][2 * p]; /* odd D: the last dim alone (q's packed partner is 0) */
            }
            __m512bh kv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], qv0, kv);
            if (nv > 1) acc[j][1] = _mm512_dpbf16_ps(acc[j][1], qv1, kv);
        }
    }
    const __m512 zero = _mm512_setzero_ps();
    __m512 w0 = _mm512_maskz_loadu_ps(live[0], w + h0), w1 = _mm512_maskz_loadu_ps(live[1], w + h0 + 16);
    for (int j = 0; j < KEYS; j++) {
        __m512 v = _mm512_maskz_mul_ps(live[0], _mm512_max_ps(zero, acc[j][0]), w0);
        if (nv > 1) v = _mm512_add_ps(v, _mm512_maskz_mul_ps(live[1], _mm512_max_ps(zero, acc[j][1]), w1));
        out[j] += _mm512_reduce_add_ps(v);
    }
}
#else
static inline void tile(const uint16_t *keys[KEYS], const uint16_t *q, long pairs, long odd, long hp, long h0,
                        int nv, const unsigned live[2], const float *w, float out[KEYS]) {
    for (int j = 0; j < KEYS; j++)
        for (int h = h0; h < h0 + 16 * nv; h++) {
            if (!((live[(h - h0) / 16] >> ((h - h0) % 16)) & 1u)) continue;
            float dot = head_dot(q, pairs, odd, hp, h, keys[j]);
            out[j] += w[h] * (dot > 0.0f || dot != dot ? dot : 0.0f); /* relu that keeps NaN */
        }
}
#endif

/* Scores of tokens [t_begin, t_end) at key positions [s_begin, s_end): one thread's share.
 * q: [T][pairs + odd][hp][2] bf16 (hp: H rounded up to 16, zero-padded); w: [T][hp] fp32; table: [T][table_width]
 * int32 (each token's block table row, every entry a valid block); limit: [T] (positions >= limit get -inf);
 * scores: [T][score_row] fp32. Returns 0 (the AMX kernel's entry, which allocates, shares the signature). */
int glm5_indexer_scores(long heads, long dims, const uint16_t *q, const float *w, const uint16_t *cache,
                        long block_stride, long row_stride, long block_size, const int32_t *table, long table_width,
                        const int64_t *limit, float *scores, long score_row, long t_begin, long t_end, long s_begin,
                        long s_end) {
    long pairs = dims / 2, odd = dims % 2, hp = (heads + 15) / 16 * 16;
    for (long c0 = s_begin; c0 < s_end; c0 += CHUNK) {
        long c1 = c0 + CHUNK < s_end ? c0 + CHUNK : s_end;
        for (long t = t_begin; t < t_end; t++) {
            const uint16_t *qt = q + t * (pairs + odd) * hp * 2;
            const float *wt = w + t * hp;
            const int32_t *tt = table + t * table_width;
            float *st = scores + t * score_row;
            long visible_end = visible_in_chunk(st, limit[t], c0, c1);
            for (long s = c0; s < visible_end; s += KEYS) {
                int n = visible_end - s < KEYS ? (int)(visible_end - s) : KEYS;
                const uint16_t *keys[KEYS];
                tile_rows(cache, block_stride, row_stride, block_size, tt, s, n, keys);
                for (long ahead = s + PREFETCH_KEYS; ahead < s + PREFETCH_KEYS + KEYS && ahead < visible_end; ahead++)
                    prefetch(key_row(cache, block_stride, row_stride, block_size, tt, ahead), dims);
                float out[KEYS] = {0};
                for (long h0 = 0; h0 < hp; h0 += HEAD_GROUP) {
                    int nv = hp - h0 > 16 ? 2 : 1;
#if !defined(GLM5_PORTABLE) && !defined(GLM5_AVX2)
                    __mmask16 live[2];
#else
                    unsigned live[2];
#endif
                    for (int v = 0; v < 2; v++) live[v] = live_lanes(heads, h0 + 16 * v);
                    tile(keys, qt, pairs, odd, hp, h0, nv, live, wt, out);
                }
                for (int j = 0; j < n; j++) st[s + j] = out[j];
            }
        }
    }
    return 0;
}
