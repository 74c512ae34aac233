/* What the kernels that put heads in vector lanes share (indexer_scores.c, sparse_attention.c): q packed as
 * [ceil(D / 2)][hp][2] bf16 (backends/torch_eager/native/packing.py: per pair of dims, every head's two values), keys as bf16
 * rows read in place, and prefetching of those rows (they are scattered over the cache, and a tile reads them a pair
 * of dims at a time, too slowly for the hardware prefetchers to run ahead). */
#ifndef GLM5_HAL_HEAD_PAIRS_H
#define GLM5_HAL_HEAD_PAIRS_H
#include "bf16.h"

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
#endif
