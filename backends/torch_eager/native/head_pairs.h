/* What the kernels that put heads in vector lanes share (indexer_scores.c, sparse_attention.c): q packed as
 * [ceil(D / 2)][hp][2] bf16 (per pair of dims, every head's two values: packed by indexer_scores.c's caller in
 * backends/torch_eager/native/packing.py, by sparse_attention.c itself with pack_head_pairs), keys as bf16 rows read
 * in place, and prefetching of those rows (they are scattered over the cache, and a tile reads them a pair of dims at
 * a time, too slowly for the hardware prefetchers to run ahead). */
#ifndef GLM5_HAL_HEAD_PAIRS_H
#define GLM5_HAL_HEAD_PAIRS_H
#include <string.h>

#include "bf16.h"
#include "row_prefetch.h"

/* One token's q [H][D] bf16 (head h at q + h * q_head, its dims contiguous) packed as [pairs + odd][hp][2]: per
   pair of dims every head's two values, zero past H and past D (an odd D's last pair has no second value). The
   kernels pack each token as they reach it: a decode step's q is a few KiB, and packing it in Python cost a zero fill
   and a strided copy in torch, each several times dearer than this loop once a step has evicted torch's code. */
static inline void pack_head_pairs(const uint16_t *q, long q_head, long heads, long dims, long hp, uint16_t *packed) {
    long pairs = dims / 2, odd = dims % 2;
    memset(packed, 0, sizeof *packed * (pairs + odd) * hp * 2);
    for (long h = 0; h < heads; h++) {
        const uint16_t *qh = q + h * q_head;
        for (long d = 0; d < dims; d++) packed[((d / 2) * hp + h) * 2 + d % 2] = qh[d];
    }
}

/* q_h . key in fp32 from the packed q (the scalar form of what the vector tiles compute). */
static inline float head_dot(const uint16_t *q, long pairs, long odd, long hp, long h, const uint16_t *key) {
    float dot = 0.0f;
    for (long p = 0; p < pairs + odd; p++) {
        const uint16_t *qp = q + (p * hp + h) * 2;
        dot += bf16_to_float(qp[0]) * bf16_to_float(key[2 * p]);
        if (p < pairs) dot += bf16_to_float(qp[1]) * bf16_to_float(key[2 * p + 1]);
    }
    return dot;
}

/* The lanes of the 16-head vector starting at head `first` that hold one of the `heads` real heads. */
static inline unsigned live_lanes(long heads, long first) {
    long left = heads - first;
    return left >= 16 ? 0xFFFFu : left > 0 ? (1u << left) - 1u : 0u;
}

#if defined(GLM5_AVX2)
#define PAIR_KEYS 6 /* keys per AVX2 tile: 6 keys x 2 head vectors or 3 x 4 (the tile's two halves) = 12 accumulators */

/* acc[j][v] lane i += q[h0 + 8 v + i] . key_j over every dim, for `keys` keys x `vectors` vectors of 8 heads
   (constants once inlined). Per pair of dims, the keys' widened values stay in registers while q's head vectors
   stream past, the even dim then the odd one: keys + 1 + keys x vectors <= 16 ymm. Each lane adds exact products
   in the order of the dims, wherever its key and head sit in the tile. */
static inline __attribute__((always_inline)) void heads_by_keys_of(const int keys, const int vectors,
                                                                   const uint16_t *const *rows, const uint16_t *q,
                                                                   long pairs, long odd, long hp, long h0,
                                                                   __m256 acc[PAIR_KEYS][4]) {
    for (int j = 0; j < keys; j++)
        for (int v = 0; v < vectors; v++) acc[j][v] = _mm256_setzero_ps();
    for (long p = 0; p < pairs + odd; p++) {
        const __m256i *qp = (const __m256i *)(q + (p * hp + h0) * 2); /* 8 heads' (dim 2p, dim 2p + 1) dwords */
        __m256i kp[PAIR_KEYS];
        for (int j = 0; j < keys; j++) {
            uint32_t pair;
            if (p < pairs) {
                memcpy(&pair, rows[j] + 2 * p, sizeof pair); /* dims 2p (low half) and 2p + 1 (high half) */
            } else {
                pair = rows[j][2 * p]; /* odd D: the last dim alone (q's packed partner is 0) */
            }
            kp[j] = _mm256_set1_epi32((int)pair);
        }
        __m256 kv[PAIR_KEYS];
        for (int j = 0; j < keys; j++) kv[j] = low_halves(kp[j]);
        for (int v = 0; v < vectors; v++) {
            __m256 qv = low_halves(_mm256_loadu_si256(qp + v));
            for (int j = 0; j < keys; j++) acc[j][v] = _mm256_fmadd_ps(qv, kv[j], acc[j][v]);
        }
        for (int j = 0; j < keys; j++) kv[j] = high_halves(kp[j]);
        for (int v = 0; v < vectors; v++) {
            __m256 qv = high_halves(_mm256_loadu_si256(qp + v));
            for (int j = 0; j < keys; j++) acc[j][v] = _mm256_fmadd_ps(qv, kv[j], acc[j][v]);
        }
    }
}

/* dots[j][i] = q_{h0 + i} . key_j (fp32) for the PAIR_KEYS keys and the 8 x vectors heads from h0 (vectors: 1, 2
   or 4; one where at most 8 heads from h0 are real: a model with few heads per device, as GLM-5 split 8 ways, then
   does no products for padding heads, about 2x fewer per key). */
static inline void heads_by_keys(const uint16_t *const rows[PAIR_KEYS], const uint16_t *q, long pairs, long odd,
                                 long hp, long h0, int vectors, float dots[PAIR_KEYS][32]) {
    __m256 acc[PAIR_KEYS][4];
    if (vectors <= 2) {
        if (vectors == 1)
            heads_by_keys_of(PAIR_KEYS, 1, rows, q, pairs, odd, hp, h0, acc);
        else
            heads_by_keys_of(PAIR_KEYS, 2, rows, q, pairs, odd, hp, h0, acc);
        for (int j = 0; j < PAIR_KEYS; j++)
            for (int v = 0; v < vectors; v++) _mm256_storeu_ps(dots[j] + 8 * v, acc[j][v]);
        return;
    }
    for (int half = 0; half < 2; half++) {
        heads_by_keys_of(PAIR_KEYS / 2, 4, rows + half * (PAIR_KEYS / 2), q, pairs, odd, hp, h0, acc);
        for (int j = 0; j < PAIR_KEYS / 2; j++)
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(dots[half * (PAIR_KEYS / 2) + j] + 8 * v, acc[j][v]);
    }
}
#endif

#ifndef GLM5_PORTABLE
#include <immintrin.h>

static inline void prefetch(const uint16_t *from, long elements) {
    for (long e = 0; e < elements; e += 32) _mm_prefetch((const char *)(from + e), _MM_HINT_T0);
}
#else
static inline void prefetch(const uint16_t *from, long elements) {
    (void)from;
    (void)elements;
}
#endif

/* Sparse attention's whole rows (`elements` bf16 from `from`) with its entry points' `row_prefetch` hint
   (row_prefetch.h). Measured on this kernel: over 2048 scattered rows of a cache out of L3, on a Zen 4 (AVX-512 BF16)
   L2 took 1.04-1.22x less time than L1 (4 to 64 heads, both builds: more lines than L1 can have in flight), while on a
   Zen 5 L1 and NTA took ~1.5x less than L2 at 4 heads (AVX2 build) and 1.07-1.17x less at 16 and 64 (AVX-512); where
   the rows are in cache, the same time. */
static inline void prefetch_row(const uint16_t *from, long elements, int hint) {
    prefetch_lines(from, 2 * elements, hint);
}
#endif
