/* bf16 helpers shared by the native kernels (bf16 values travel as their raw uint16 bits). */
#ifndef GLM5_HAL_BF16_H
#define GLM5_HAL_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16; /* bf16 is the top half of an fp32 */
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* fp32 -> bf16 as torch rounds it (c10::BFloat16): to nearest, ties to even; every NaN becomes 0x7FC0. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#if defined(GLM5_AVX2)
#include <immintrin.h>

/* AVX2 has no bf16 instructions: a dword holding two bf16 (element 2i in the low half, 2i + 1 in the high half, as
   they lie in memory) gives both as exact fp32 lanes, the low one shifted up by 16 bits, the high one with the low
   half cleared. No lane crossing, so a dot product over k splits into an even and an odd half. The low half is
   cleared by two shifts rather than an AND: the AND's mask would hold the 16th ymm register the tiles need (a 3 x 4
   GEMM tile spilled accumulators with it, and ran 1.18x slower at M = 256 on a Zen 3). */
static inline __m256 low_halves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }

static inline __m256 high_halves(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(pairs, 16), 16));
}
#endif
#endif
