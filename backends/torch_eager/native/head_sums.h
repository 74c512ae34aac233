/* The indexer's head sum over a block of tile results, written once for its AMX kernels (amx_index_scores.c,
 * quantized_index_scores.c's AMX dots):
 *
 *   out[j] += sum over h < heads of w[h] * relu(dots[j][h] * scale_j)      j < rows (scale_j = 1 without scales)
 *
 * dots: MB x NB fp32 (amx_blocks.h's block result, rows NB apart), heads <= NB real heads (the columns past them are
 * never added: a padding head's dot may be NaN where a key holds inf), w: those heads' weights. relu keeps NaN.
 * AVX-512 in the AMX builds (each key's heads in two 16-lane vectors, summed lane-wise then across lanes); scalar,
 * head by head, in the portable build. Both are fp32 sums of the same terms, in another order.
 */
#ifndef GLM5_HAL_HEAD_SUMS_H
#define GLM5_HAL_HEAD_SUMS_H
#include "amx_blocks.h"

#if !defined(GLM5_PORTABLE)
#include <immintrin.h>

static inline void add_head_sums(const float dots[MB][NB], int rows, long heads, const float *scales, const float *w,
                                 float *out) {
    const __mmask16 live0 = heads >= 16 ? 0xFFFF : (__mmask16)((1u << heads) - 1u);
    const __mmask16 live1 = heads >= 32 ? 0xFFFF : heads > 16 ? (__mmask16)((1u << (heads - 16)) - 1u) : 0;
    const __m512 zero = _mm512_setzero_ps();
    const __m512 w0 = _mm512_maskz_loadu_ps(live0, w), w1 = _mm512_maskz_loadu_ps(live1, w + 16);
    for (int j = 0; j < rows; j++) {
        __m512 d0 = _mm512_maskz_loadu_ps(live0, dots[j]), d1 = _mm512_maskz_loadu_ps(live1, dots[j] + 16);
        if (scales) {
            const __m512 scale = _mm512_set1_ps(scales[j]);
            d0 = _mm512_mul_ps(d0, scale);
            d1 = _mm512_mul_ps(d1, scale);
        }
        /* max(0, x) returns x where x is NaN; dead lanes are 0 x 0 (their dots were never loaded) */
        __m512 terms = _mm512_add_ps(_mm512_mul_ps(w0, _mm512_max_ps(zero, d0)), _mm512_mul_ps(w1, _mm512_max_ps(zero, d1)));
        out[j] += _mm512_reduce_add_ps(terms);
    }
}
#else
static inline void add_head_sums(const float dots[MB][NB], int rows, long heads, const float *scales, const float *w,
                                 float *out) {
    for (int j = 0; j < rows; j++)
        for (long h = 0; h < heads; h++) {
            float dot = scales ? dots[j][h] * scales[j] : dots[j][h];
            out[j] += w[h] * (dot > 0.0f || dot != dot ? dot : 0.0f); /* relu keeps NaN */
        }
}
#endif
#endif
