/* The softmax and the output of the sparse attention kernels (sparse_attention.c, amx_attention.c), written once:
 *
 *   exponentiate(s, n, hp, heads, lse, denominator): scores s [n][hp] fp32 (hp = H rounded up to 16; lanes past the
 *       real heads are ignored) -> E = exp(s - peak) in place, per head lse = peak + log(total) and denominator =
 *       max(total, FLT_MIN) (1 for the padding heads); peak = the row maximum, or 0 where it is -inf (no key, or
 *       every score -inf: exp stays an exact 0) or a score is NaN (the head is NaN anyway). A +inf peak is kept, so
 *       a +inf score gives inf - inf = NaN, and lse and the output are NaN, as in the reference (sparse_attention.c's
 *       top gives the formulas).
 *   store_output(o, heads, dv, out, out_fp32, out_head): o [heads][dv] fp32 -> out, fp32 or bf16 rounded as torch
 *       rounds (to nearest even, every NaN 0x7FC0, subnormals kept).
 *
 * Per build: AVX-512 (16 heads a vector, exp16 to ~1 ulp) for the AVX-512 and AMX builds, AVX2 (8 heads a vector,
 * exp8: exp16's arithmetic), and scalar C (expf) for the portable builds.
 */
#ifndef GLM5_HAL_ATTENTION_SOFTMAX_H
#define GLM5_HAL_ATTENTION_SOFTMAX_H
#include <float.h>
#include <math.h>
#include <string.h>

#include "head_pairs.h" /* live_lanes, bf16.h */

/* Head h's lse and softmax denominator from its peak and total (a padding head, h >= heads: denominator 1). */
static inline void head_statistics(long h, long heads, float peak, float total, float *lse, float *denominator) {
    if (h < heads) lse[h] = peak + logf(total);
    denominator[h] = h < heads ? fmaxf(total, FLT_MIN) : 1.0f;
}

#if defined(GLM5_AVX2)
/* All-ones in the lanes i < live (of 8). */
static inline __m256 lanes_below(long live) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(live < 8 ? live : 8)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* exp16's arithmetic on 8 lanes (the same clamp, reduction and polynomial, so the same values). AVX2 has no scalef:
   2^n is applied as two normal factors 2^a 2^(n - a), a = floor(n / 2), both within 2^-75 .. 2^64 for n in
   [-150, 128]; p 2^a is exact, so the second product rounds once, as scalef does (to a subnormal or inf where the
   result is one). NaN stays NaN through p. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: r is exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    /* Horner in exp16's order: coefficients of r^7 .. r^2, then p r^2 + (r + 1) */
    static const float poly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    __m256 p = _mm256_set1_ps(poly[0]);
    for (int i = 1; i < (int)(sizeof poly / sizeof *poly); i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(poly[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i whole = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(whole, 1), b = _mm256_sub_epi32(whole, a);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 two_a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
    __m256 two_b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, two_a), two_b);
}

/* s [n][hp] scores -> E = exp(s - peak) in place, and per head (h < heads) lse = peak + log(total) and
   denominator = max(total, FLT_MIN) (see the top of the file; padding lanes: scores read as 0, denominator 1). */
static void exponentiate(float *s, long n, long hp, long heads, float *lse, float *denominator) {
    const __m256 zero = _mm256_setzero_ps();
    for (long h0 = 0; h0 < hp; h0 += 8) {
        __m256 live = lanes_below(heads - h0);
        __m256 peak = _mm256_set1_ps(-INFINITY), nan = zero;
        for (long k = 0; k < n; k++) {
            __m256 x = _mm256_and_ps(live, _mm256_loadu_ps(s + k * hp + h0));
            peak = _mm256_max_ps(peak, x);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        }
        __m256 shift = _mm256_cmp_ps(peak, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ); /* see the top of the file */
        peak = _mm256_and_ps(_mm256_andnot_ps(nan, shift), peak);
        __m256 total = zero;
        for (long k = 0; k < n; k++) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_and_ps(live, _mm256_loadu_ps(s + k * hp + h0)), peak));
            _mm256_storeu_ps(s + k * hp + h0, e);
            total = _mm256_add_ps(total, e);
        }
        float peaks[8], totals[8];
        _mm256_storeu_ps(peaks, peak);
        _mm256_storeu_ps(totals, total);
        for (int i = 0; i < 8; i++) head_statistics(h0 + i, heads, peaks[i], totals[i], lse, denominator);
    }
}
#elif !defined(GLM5_PORTABLE)
#include <immintrin.h>

/* exp(x) in 16 lanes to ~1 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, then
   scaled by 2^n). Clamped to [-104, 89] first, where exp is already 0 / inf in fp32, so that -inf gives 0 and +inf
   gives inf without a NaN from the reduction; NaN passes through (max / min return their second operand for it). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts: r is exact */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* s [n][hp] scores -> E = exp(s - peak) in place, and per head (h < heads) lse = peak + log(total) and
   denominator = max(total, FLT_MIN) (see the top of the file; padding lanes get 1). */
static void exponentiate(float *s, long n, long hp, long heads, float *lse, float *denominator) {
    for (long h0 = 0; h0 < hp; h0 += 16) {
        __mmask16 live = (__mmask16)live_lanes(heads, h0);
        __m512 peak = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (long k = 0; k < n; k++) {
            __m512 x = _mm512_maskz_loadu_ps(live, s + k * hp + h0);
            peak = _mm512_max_ps(peak, x);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        }
        __mmask16 shift = _mm512_cmp_ps_mask(peak, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ); /* see the top */
        peak = _mm512_maskz_mov_ps(shift & (__mmask16)~nan, peak);
        __m512 total = _mm512_setzero_ps();
        for (long k = 0; k < n; k++) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + k * hp + h0), peak));
            _mm512_storeu_ps(s + k * hp + h0, e);
            total = _mm512_add_ps(total, e);
        }
        float peaks[16], totals[16];
        _mm512_storeu_ps(peaks, peak);
        _mm512_storeu_ps(totals, total);
        for (int i = 0; i < 16; i++) head_statistics(h0 + i, heads, peaks[i], totals[i], lse, denominator);
    }
}

/* float_to_bf16 (bf16.h) of 16 lanes, in the low half of each 32-bit lane: to nearest even, every NaN 0x7FC0,
   subnormals kept (torch's rounding). */
static inline __m512i bf16_lanes(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

/* o [heads][dv] fp32 -> out[h][d] (row stride out_head), fp32 or bf16 rounded as torch rounds (bf16_lanes). */
static void store_output(const float *o, long heads, long dv, void *out, int out_fp32, long out_head) {
    for (long h = 0; h < heads; h++)
        for (long d0 = 0; d0 < dv; d0 += 16) {
            __mmask16 mask = (__mmask16)live_lanes(dv, d0);
            __m512 x = _mm512_maskz_loadu_ps(mask, o + h * dv + d0);
            if (out_fp32) {
                _mm512_mask_storeu_ps((float *)out + h * out_head + d0, mask, x);
                continue;
            }
            _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + h * out_head + d0, mask, bf16_lanes(x));
        }
}
#else
static void exponentiate(float *s, long n, long hp, long heads, float *lse, float *denominator) {
    for (long h = 0; h < hp; h++) {
        if (h >= heads) {
            denominator[h] = 1.0f;
            continue;
        }
        float peak = -INFINITY;
        int nan = 0;
        for (long k = 0; k < n; k++) {
            float x = s[k * hp + h];
            nan |= x != x;
            peak = x > peak ? x : peak;
        }
        if (nan || peak == -INFINITY) peak = 0.0f;
        float total = 0.0f;
        for (long k = 0; k < n; k++) {
            s[k * hp + h] = expf(s[k * hp + h] - peak);
            total += s[k * hp + h];
        }
        head_statistics(h, heads, peak, total, lse, denominator);
    }
}
#endif

#if defined(GLM5_AVX2) || defined(GLM5_PORTABLE)
/* o [heads][dv] fp32 -> out[h][d] (row stride out_head), fp32 or bf16 rounded as torch rounds (bf16.h). A pass over
   heads x dv values per token: in scalar code for the AVX2 build too, a small part of its time. */
static void store_output(const float *o, long heads, long dv, void *out, int out_fp32, long out_head) {
    for (long h = 0; h < heads; h++)
        for (long d = 0; d < dv; d++) {
            if (out_fp32)
                ((float *)out)[h * out_head + d] = o[h * dv + d];
            else
                ((uint16_t *)out)[h * out_head + d] = float_to_bf16(o[h * dv + d]);
        }
}
#endif
#endif
