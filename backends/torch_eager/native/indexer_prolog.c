/* The lightning indexer's prolog for a few tokens (a decode step) in two native calls, on CPUs, instead of the torch
 * path's few dozen small ops (at decode each op costs more than its arithmetic):
 *
 *   project (threads split the rows r):  proj[t][r] = sum_i a_r[t][i] * W[r][i]       (fp32 sums of exact products)
 *       W = [w_iq; w_ik; w_iw] stacked by rows: rows r < H D take a = q_norm, the rest a = x
 *   finish (one call):
 *       k[t]      = LayerNorm(proj[t][H D .. H D + D]) * norm_w + norm_b        (moments in double, then fp32)
 *       q[t][h]   = proj[t][h D .. h D + D]
 *       RoPE on the first 2 R dims of q[t][h] and k[t] (interleaved pairs (2i, 2i + 1) or half-split (i, i + R)):
 *                 (a, b) -> (a cos - b sin, a sin + b cos), each product rounded, as torch computes it
 *       q_out[t][h] = bf16(q[t][h]);  w_out[t][h] = proj[t][H D + D + h] * weight_scale
 *       k[t] -> the cache row at slot[t] (skipped where -1): bf16 (a float cache), or encoded as
 *               glm5_hal.kv_formats.encode_rows encodes fp32 rows (fp8_index / int8_index: D codes, one fp32 scale)
 *
 * All arithmetic is fp32 on exactly widened bf16 inputs, as the torch path's native route computes it (only the
 * order of the sums differs); the encoding is encode_rows' bit for bit, given the same fp32 row. Built with AVX2 + FMA
 * (the AVX-512 builds compile the same 256-bit code: every such CPU has both) and portable (scalar loops with the same
 * blocking, each product rounded before it is added where the vector code fuses the two). Subnormals are kept.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(GLM5_PORTABLE) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#if !defined(__FMA__) || !defined(__AVX2__)
#pragma GCC target("avx2,fma") /* the AVX-512 builds: every CPU with AVX-512F has AVX2 and FMA3 */
#endif
#include <immintrin.h>
#define VECTORS 1
#endif

#include "bf16.h"

#define TOKENS 4 /* tokens per pass over a weight row: its 16 widened values feed 4 tokens' accumulators */
#define STEP 16  /* inputs per step: one 256-bit load of 16 bf16 (even and odd elements as two fp32 vectors) */

enum { CACHE_BF16 = 0, CACHE_E4M3 = 1, CACHE_INT8 = 2 };

#if defined(VECTORS)
static inline __m256 even_halves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
static inline __m256 odd_halves(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline float lane_sum(__m256 v) { /* ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) */
    __m128 quads = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 pairs = _mm_add_ps(quads, _mm_movehl_ps(quads, quads));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
#endif

/* out[j * out_row] = sum_i a[j][i] * w[i] for the n tokens j < n <= TOKENS (a[j] = a + j * a_row), inputs i < k.
   Per token: 16 lanes (8 of the even inputs, 8 of the odd ones) over the whole steps, summed lane-wise (even + odd)
   then across lanes, then the inputs past the last whole step added in order. */
static void dot_tokens(const uint16_t *w, long k, const uint16_t *a, long a_row, int n, float *out, long out_row) {
    long whole = k / STEP * STEP;
    float sums[TOKENS];
#if defined(VECTORS)
    __m256 even[TOKENS], odd[TOKENS];
    for (int j = 0; j < TOKENS; j++) even[j] = odd[j] = _mm256_setzero_ps();
    for (long i = 0; i < whole; i += STEP) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256 we = even_halves(wv), wo = odd_halves(wv);
        for (int j = 0; j < n; j++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + j * a_row + i));
            even[j] = _mm256_fmadd_ps(even_halves(av), we, even[j]);
            odd[j] = _mm256_fmadd_ps(odd_halves(av), wo, odd[j]);
        }
    }
    for (int j = 0; j < n; j++) sums[j] = lane_sum(_mm256_add_ps(even[j], odd[j]));
#else
    for (int j = 0; j < n; j++) {
        float even[STEP / 2] = {0}, odd[STEP / 2] = {0};
        const uint16_t *aj = a + j * a_row;
        for (long i = 0; i < whole; i += STEP)
            for (int l = 0; l < STEP / 2; l++) {
                even[l] += bf16_to_float(aj[i + 2 * l]) * bf16_to_float(w[i + 2 * l]);
                odd[l] += bf16_to_float(aj[i + 2 * l + 1]) * bf16_to_float(w[i + 2 * l + 1]);
            }
        float lanes[STEP / 2];
        for (int l = 0; l < STEP / 2; l++) lanes[l] = even[l] + odd[l];
        sums[j] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    }
#endif
    for (int j = 0; j < n; j++) {
        const uint16_t *aj = a + j * a_row;
        for (long i = whole; i < k; i++) sums[j] += bf16_to_float(aj[i]) * bf16_to_float(w[i]);
        out[j * out_row] = sums[j];
    }
}

/* Rows [r_begin, r_end) of proj [tokens][proj_row] fp32: the stacked projection described at the top. x [tokens]
   rows of `hidden` bf16 (row stride x_row), q_norm rows of `q_lora` (stride qn_row); w_iq [heads * dims][q_lora],
   w_ik [dims][hidden], w_iw [heads][hidden] bf16 with row strides iq_row, ik_row, iw_row. */
void glm5_indexer_prolog_project(long tokens, long heads, long dims, long hidden, long q_lora, const uint16_t *x,
                                 long x_row, const uint16_t *q_norm, long qn_row, const uint16_t *w_iq, long iq_row,
                                 const uint16_t *w_ik, long ik_row, const uint16_t *w_iw, long iw_row, float *proj,
                                 long proj_row, long r_begin, long r_end) {
    long q_rows = heads * dims;
    for (long r = r_begin; r < r_end; r++) {
        const uint16_t *w, *a;
        long k, a_row;
        if (r < q_rows) {
            w = w_iq + r * iq_row, a = q_norm, a_row = qn_row, k = q_lora;
        } else if (r < q_rows + dims) {
            w = w_ik + (r - q_rows) * ik_row, a = x, a_row = x_row, k = hidden;
        } else {
            w = w_iw + (r - q_rows - dims) * iw_row, a = x, a_row = x_row, k = hidden;
        }
        for (long t = 0; t < tokens; t += TOKENS) {
            int n = tokens - t < TOKENS ? (int)(tokens - t) : TOKENS;
            dot_tokens(w, k, a + t * a_row, a_row, n, proj + t * proj_row + r, proj_row);
        }
    }
}

/* v[0 .. 2 half) rotated by the token's cos / sin [half]: pairs (2i, 2i + 1) or (i, i + half). */
static void rope(float *v, long half, int interleaved, const float *cos, const float *sin) {
    for (long i = 0; i < half; i++) {
        float *a = interleaved ? v + 2 * i : v + i, *b = interleaved ? v + 2 * i + 1 : v + i + half;
        float c = cos[i], s = sin[i], x = *a, y = *b;
        float ac = x * c, bs = y * s, as = x * s, bc = y * c; /* each product rounded, then the sum: torch's order */
        *a = ac - bs;
        *b = as + bc;
    }
}

/* The e4m3fn code of a finite fp32 ratio with |ratio| <= 448, rounded to nearest, ties to even (torch's
   float -> float8_e4m3fn conversion of a clamped value): normal codes (|ratio| >= 2^-6) keep 3 mantissa bits; below
   that the code counts steps of 2^-9 (subnormals; 8 steps is the smallest normal, whose code is 8 as well). */
static uint8_t e4m3_code(float ratio) {
    uint32_t bits;
    memcpy(&bits, &ratio, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float magnitude = fabsf(ratio);
    if (magnitude < 0x1p-6f) /* x 2^9 is exact; rint rounds ties to even (the default rounding mode) */
        return sign | (uint8_t)rintf(magnitude * 0x1p9f);
    uint32_t exponent = ((bits >> 23) & 0xFF) - 127 + 7, mantissa = bits & 0x7FFFFF;
    uint32_t kept = mantissa >> 20, rest = mantissa & 0xFFFFF;
    if (rest > 0x80000 || (rest == 0x80000 && (kept & 1))) kept++;
    if (kept == 8) kept = 0, exponent++; /* rounded up into the next binade (never past 448: the input is clamped) */
    return sign | (uint8_t)(exponent << 3 | kept);
}

/* row [dims] fp32 -> out: dims codes then the fp32 scale (encode_rows' rule: scale = max|x| / qmax, 1 for an
   all-zero row, NaN for a row holding NaN and +inf for one holding +-inf, whose codes are then 0). */
static void encode_row(const float *row, long dims, int code, uint8_t *out) {
    float amax = 0.0f;
    int nan = 0;
    for (long d = 0; d < dims; d++) {
        float m = fabsf(row[d]);
        if (m != m) nan = 1;
        else if (m > amax) amax = m;
    }
    float qmax = code == CACHE_E4M3 ? 448.0f : 127.0f;
    float scale = nan ? NAN : amax == 0.0f ? 1.0f : amax / qmax;
    if (!isfinite(scale)) {
        memset(out, 0, (size_t)dims);
    } else {
        for (long d = 0; d < dims; d++) {
            /* A scale that underflowed to 0 (max|x| a tiny subnormal) makes 0 / 0 NaN and x / 0 inf here, as in
               torch: NaN becomes e4m3's NaN code (with its sign bit) or int8's 0, inf the largest code. */
            float ratio = row[d] / scale;
            if (code == CACHE_E4M3) {
                uint32_t bits;
                memcpy(&bits, &ratio, sizeof bits);
                out[d] = ratio != ratio ? (uint8_t)(0x7F | ((bits >> 24) & 0x80))
                                        : e4m3_code(ratio > 448.0f ? 448.0f : ratio < -448.0f ? -448.0f : ratio);
            } else {
                float r = ratio != ratio ? 0.0f : rintf(ratio);
                out[d] = (uint8_t)(int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
        }
    }
    memcpy(out + dims, &scale, sizeof scale);
}

/* rows [n][dims] fp32 (row stride in_row) -> out [n] rows of dims codes and the scale (byte stride out_row), as
   encode_row: encode_rows' bytes, for the tests to compare bit for bit (the prolog encodes through encode_row). */
void glm5_encode_index_rows(const float *rows, long n, long in_row, long dims, int code, uint8_t *out, long out_row) {
    for (long i = 0; i < n; i++) encode_row(rows + i * in_row, dims, code, out + i * out_row);
}

/* The rest of the prolog for every token (see the top). proj as glm5_indexer_prolog_project left it; norm_w, norm_b
   [dims] fp32; cos, sin [tokens] rows of rope_half fp32 (strides cos_row, sin_row); q_out [tokens][heads][dims] bf16;
   w_out [tokens][heads] fp32; cache rows at byte strides block_stride / row_stride, block_size rows a block; slots
   [tokens] int64 (-1: not written; else a valid slot); code: CACHE_*; k_row: fp32 scratch [dims]. */
void glm5_indexer_prolog_finish(long tokens, long heads, long dims, long rope_half, int interleaved, float *proj,
                                long proj_row, const float *norm_w, const float *norm_b, float eps, const float *cos,
                                long cos_row, const float *sin, long sin_row, float weight_scale, uint16_t *q_out,
                                float *w_out, uint8_t *cache, long block_stride, long row_stride, long block_size,
                                const int64_t *slots, int code) {
    long q_rows = heads * dims;
    for (long t = 0; t < tokens; t++) {
        float *p = proj + t * proj_row, *k = p + q_rows;
        const float *ct = cos + t * cos_row, *st = sin + t * sin_row;
        for (long h = 0; h < heads; h++) {
            float *q = p + h * dims;
            rope(q, rope_half, interleaved, ct, st);
            for (long d = 0; d < dims; d++) q_out[(t * heads + h) * dims + d] = float_to_bf16(q[d]);
        }
        for (long h = 0; h < heads; h++) w_out[t * heads + h] = p[q_rows + dims + h] * weight_scale;
        double sum = 0.0, squares = 0.0;
        for (long d = 0; d < dims; d++) sum += k[d];
        float mean = (float)(sum / (double)dims);
        for (long d = 0; d < dims; d++) {
            double centred = (double)k[d] - (double)mean;
            squares += centred * centred;
        }
        float rstd = (float)(1.0 / sqrt(squares / (double)dims + (double)eps));
        for (long d = 0; d < dims; d++) k[d] = (k[d] - mean) * rstd * norm_w[d] + norm_b[d];
        rope(k, rope_half, interleaved, ct, st);
        if (slots[t] < 0) continue;
        uint8_t *row = cache + (slots[t] / block_size) * block_stride + (slots[t] % block_size) * row_stride;
        if (code == CACHE_BF16) {
            for (long d = 0; d < dims; d++) {
                uint16_t bits = float_to_bf16(k[d]);
                memcpy(row + 2 * d, &bits, sizeof bits);
            }
        } else {
            encode_row(k, dims, code, row);
        }
    }
}
