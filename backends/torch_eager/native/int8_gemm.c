/* Exact int8 GEMMs for W8A8 and W4A8 with both operands K-contiguous ("NT"), on CPUs with AVX-512 VNNI.
 *
 *   W8A8:  C[m][n] = fp32( sum_k X[m][k] * W[n][k] )                  X, W int8; the int32 sum is exact
 *   W4A8:  Y[m][n] = sum_g fp32( sum_{k in g} X[m][k] * W4[n][k] ) * S[n][g]    W4 int4
 *
 * VPDPBUSD multiplies unsigned bytes by signed bytes and adds each group of four products to an int32 lane, without
 * saturation (the adds wrap modulo 2^32). The signed x signed product comes from a zero point on the weight, the
 * unsigned side: W8A8 stores w + 128, W4A8 the nibble w + 8, so the lanes hold sum x w + 128 sum x (or 8 sum x per
 * group); the kernels subtract that share, computed once per call from each activation row. Wrapping arithmetic
 * makes the difference exact whenever the true sum fits int32, however large the shifted one is.
 *
 * Panel form. The weight is copied once per weight (int8_gemm.py's panel_weight / panel_int4_weight) into panels of
 * PC = 64 columns, [ceil(N / 64)][steps][64][4] bytes, each panel one sequential stream. One int32 lane holds one
 * column's 4 consecutive k (W8A8: a step is 4 columns of K) or 8 as nibbles (W4A8: a step is 8 columns; byte b holds
 * k = 8s + b in its low nibble and 8s + 4 + b in its high one), zero-padded (w = 0). A kernel step broadcasts 4
 * activation bytes of a row to every lane and multiplies them by 16 columns at once, so each lane is one output and
 * nothing is summed across lanes. (The dot form this replaced, one vector per row-and-column pair summed across its
 * lanes at the end, lost to oneDNN's kernels past 4 rows.) A block of PR rows x 64 columns keeps 4 x PR accumulators
 * in registers over a K block; the panel's K block (256 KiB) stays in L2 while the row blocks go by, and the int32
 * sums wait in `sums` between K blocks. Activation bytes past K read as 0, so the weight's padding adds nothing.
 *
 * Built twice by backends/torch_eager/native/build.py: with -mavx512vnni, and without it (GLM5_PORTABLE: the same blocking
 * around scalar arithmetic, for testing it on any CPU). Both give the exact integer sums and the same epilogue bits;
 * backends/torch_eager/native/int8_gemm.py has the Python side.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define PR 6              /* rows of X per block: 4 x 6 accumulators + 4 weight vectors + 1 broadcast <= 32 */
#define PC 64             /* columns per panel */
#define KP8 4096          /* W8A8: K per block, 64 x 4096 bytes of panel (256 KiB) in L2 */
#define KP4 8192          /* W4A8: K per block, 64 x 4096 bytes of panel (256 KiB) in L2 */
#define PREFETCH_AHEAD 1024 /* bytes of the panel stream requested ahead of the loads (the hardware prefetchers stop
                               at every 4 KiB page where the VM gives no huge pages) */

/* Where the results go: y = fp32(sum) [* x_scale[m] * w_scale[n]] [+ bias[n]], each step one fp32 rounding in
   this order (the torch route's: acc.mul_(x_scale).mul_(w_scale).add_(bias)), stored as fp32 or bf16. W4A8 uses
   x_scale only (its weight scales are per group). */
typedef struct {
    const float *x_scale, *w_scale, *bias; /* NULL: not applied */
    void *y;
    long y_row;
    int bf16; /* 1: y is bf16 (rounded as torch's .to(bfloat16)), 0: fp32 */
} Epilogue;

static inline void store(const Epilogue *e, long m, long n, float value) {
    if (e->bf16)
        ((uint16_t *)e->y)[m * e->y_row + n] = float_to_bf16(value);
    else
        ((float *)e->y)[m * e->y_row + n] = value;
}

/* 4 bytes of activations from column k, those at or past column `end` read as 0, as one int32. */
static inline int32_t quad_at(const int8_t *x, long k, long end) {
    int32_t v = 0;
    if (k < end) memcpy(&v, x + k, end - k >= 4 ? 4 : (size_t)(end - k));
    return v;
}

#ifndef GLM5_PORTABLE
#include <immintrin.h>

/* The accumulators of row r of a block, named (not an array: gcc keeps arrays of vectors on the stack and copies
   them on every step), and what the kernels do with them; `if (R > r)` is decided at compile time. */
#define ACCS(r) __m512i a##r##0, a##r##1, a##r##2, a##r##3;
#define LOAD(r)                                                                                         \
    if (R > r) {                                                                                        \
        a##r##0 = first ? _mm512_setzero_si512() : _mm512_loadu_si512(sums + r * PC);                   \
        a##r##1 = first ? _mm512_setzero_si512() : _mm512_loadu_si512(sums + r * PC + 16);              \
        a##r##2 = first ? _mm512_setzero_si512() : _mm512_loadu_si512(sums + r * PC + 32);              \
        a##r##3 = first ? _mm512_setzero_si512() : _mm512_loadu_si512(sums + r * PC + 48);              \
    }
/* a[r][c] += the 16 columns' weights in w<c> times row r's 4 bytes `quad`, four products per lane. */
#define STEP(r, quad)                                                                                   \
    if (R > r) {                                                                                        \
        __m512i xb = _mm512_set1_epi32(quad);                                                           \
        a##r##0 = _mm512_dpbusd_epi32(a##r##0, w0, xb);                                                 \
        a##r##1 = _mm512_dpbusd_epi32(a##r##1, w1, xb);                                                 \
        a##r##2 = _mm512_dpbusd_epi32(a##r##2, w2, xb);                                                 \
        a##r##3 = _mm512_dpbusd_epi32(a##r##3, w3, xb);                                                 \
    }
#define SAVE(r)                                                                                         \
    if (R > r) {                                                                                        \
        _mm512_storeu_si512(sums + r * PC, a##r##0);                                                    \
        _mm512_storeu_si512(sums + r * PC + 16, a##r##1);                                               \
        _mm512_storeu_si512(sums + r * PC + 32, a##r##2);                                               \
        _mm512_storeu_si512(sums + r * PC + 48, a##r##3);                                               \
    }
#define EACH_ROW(op) op(0) op(1) op(2) op(3) op(4) op(5) /* PR rows */
#define QUAD(r, k) quad_at(x + (r) * x_row, k, k + 4)      /* a whole quad (memcpy of 4: one load) */
#define W8A8_WHOLE(r) STEP(r, QUAD(r, k))
#define W8A8_TAIL(r) STEP(r, quad_at(x + r * x_row, k, k1))
#define W4A8_LOW(r) STEP(r, QUAD(r, k))
#define W4A8_HIGH(r) STEP(r, QUAD(r, k + 4))
#define W4A8_LOW_TAIL(r) STEP(r, quad_at(x + r * x_row, k, k1))
#define W4A8_HIGH_TAIL(r) STEP(r, quad_at(x + r * x_row, k + 4, k1))

static inline void prefetch_step(const uint8_t *p) {
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(p + PREFETCH_AHEAD + 64 * c), _MM_HINT_T0);
}

/* Vector c of a step's 4 (16 columns each): W8A8's bytes w + 128, W4A8's low or high nibbles w + 8 as bytes. */
static inline __m512i int8_lanes(const uint8_t *p, int c) { return _mm512_loadu_si512(p + 64 * c); }
static inline __m512i low_nibbles(const uint8_t *p, int c) {
    return _mm512_and_si512(int8_lanes(p, c), _mm512_set1_epi8(0x0F));
}
static inline __m512i high_nibbles(const uint8_t *p, int c) {
    return _mm512_and_si512(_mm512_srli_epi16(int8_lanes(p, c), 4), _mm512_set1_epi8(0x0F));
}
#define WEIGHTS(load) w0 = load(p, 0), w1 = load(p, 1), w2 = load(p, 2), w3 = load(p, 3);

/* sums[r][j] (+)= sum over k in [k0, k1) of x[r][k] (w[j][k] + 128), modulo 2^32, for R rows of x (row stride
   x_row, columns absolute) and the panel's 64 columns; p: the panel from step k0 / 4 (k0 a multiple of 4). first:
   start from 0, else from sums. R is a constant where each caller inlines this, so the accumulators stay in
   registers. */
static inline __attribute__((always_inline)) void w8a8_rows(const int R, const int8_t *x, long x_row,
                                                          const uint8_t *p, long k0, long k1, int first,
                                                          int32_t *sums) {
    EACH_ROW(ACCS)
    EACH_ROW(LOAD)
    __m512i w0, w1, w2, w3;
    const long whole = k0 + ((k1 - k0) & ~3L);
    long k = k0;
    for (; k < whole; k += 4, p += 4 * PC) {
        prefetch_step(p);
        WEIGHTS(int8_lanes)
        EACH_ROW(W8A8_WHOLE)
    }
    if (k < k1) { /* the last, partial step of K (k1 = K there) */
        WEIGHTS(int8_lanes)
        EACH_ROW(W8A8_TAIL)
    }
    EACH_ROW(SAVE)
}

/* w8a8_rows for W4A8: sums (+)= sum over k in [k0, k1) of x[r][k] (w[j][k] + 8); p: the int4 panel from step
   k0 / 8 (k0 a multiple of 8). The low nibbles of a step meet columns k..k+3, the high ones k+4..k+7; each half is
   loaded again rather than kept (registers: 24 accumulators, 4 weight vectors, the broadcast and the mask). */
static inline __attribute__((always_inline)) void w4a8_rows(const int R, const int8_t *x, long x_row,
                                                          const uint8_t *p, long k0, long k1, int first,
                                                          int32_t *sums) {
    EACH_ROW(ACCS)
    EACH_ROW(LOAD)
    __m512i w0, w1, w2, w3;
    const long whole = k0 + ((k1 - k0) & ~7L);
    long k = k0;
    for (; k < whole; k += 8, p += 4 * PC) {
        prefetch_step(p);
        WEIGHTS(low_nibbles)
        EACH_ROW(W4A8_LOW)
        WEIGHTS(high_nibbles)
        EACH_ROW(W4A8_HIGH)
    }
    if (k < k1) { /* the last, partial step of K (k1 = K there: one group) */
        WEIGHTS(low_nibbles)
        EACH_ROW(W4A8_LOW_TAIL)
        WEIGHTS(high_nibbles)
        EACH_ROW(W4A8_HIGH_TAIL)
    }
    EACH_ROW(SAVE)
}

/* y[m][n .. n + 16) = v, as fp32, or rounded to bf16 as float_to_bf16 does (to nearest even, NaN -> 0x7FC0;
   VCVTNEPS2BF16 would flush subnormals to zero, torch does not). */
static inline void store16(const Epilogue *e, long m, long n, __m512 v) {
    if (!e->bf16) {
        _mm512_storeu_ps((float *)e->y + m * e->y_row + n, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)((uint16_t *)e->y + m * e->y_row + n), _mm512_cvtepi32_epi16(rounded));
}
#else
/* The same sums, one product at a time (unsigned: wraps modulo 2^32 like the lanes). */
static inline void w8a8_rows(const int R, const int8_t *x, long x_row, const uint8_t *p, long k0, long k1, int first,
                             int32_t *sums) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PC; j++) {
            uint32_t sum = first ? 0u : (uint32_t)sums[r * PC + j];
            for (long k = k0; k < k1; k++)
                sum += (uint32_t)(x[r * x_row + k] * (int32_t)p[((k - k0) / 4) * 4 * PC + 4 * j + (k - k0) % 4]);
            sums[r * PC + j] = (int32_t)sum;
        }
}

static inline void w4a8_rows(const int R, const int8_t *x, long x_row, const uint8_t *p, long k0, long k1, int first,
                             int32_t *sums) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PC; j++) {
            uint32_t sum = first ? 0u : (uint32_t)sums[r * PC + j];
            for (long k = k0; k < k1; k++) {
                long s = (k - k0) / 8, b = (k - k0) % 8;
                uint8_t byte = p[s * 4 * PC + 4 * j + b % 4];
                sum += (uint32_t)(x[r * x_row + k] * (int32_t)(b < 4 ? byte & 0x0F : byte >> 4));
            }
            sums[r * PC + j] = (int32_t)sum;
        }
}
#endif

/* kernel(R, ...) for R = rows (1..PR): each count its own code, the accumulators in registers. */
#define FOR_ROWS(kernel, rows, ...)                                                                     \
    switch (rows) {                                                                                     \
    case 1: kernel(1, __VA_ARGS__); break;                                                              \
    case 2: kernel(2, __VA_ARGS__); break;                                                              \
    case 3: kernel(3, __VA_ARGS__); break;                                                              \
    case 4: kernel(4, __VA_ARGS__); break;                                                              \
    case 5: kernel(5, __VA_ARGS__); break;                                                              \
    default: kernel(PR, __VA_ARGS__); break;                                                            \
    }

static void w8a8_block(int rows, const int8_t *x, long x_row, const uint8_t *p, long k0, long k1, int first,
                       int32_t *sums) {
    FOR_ROWS(w8a8_rows, rows, x, x_row, p, k0, k1, first, sums)
}

static void w4a8_block(int rows, const int8_t *x, long x_row, const uint8_t *p, long k0, long k1, int first,
                       int32_t *sums) {
    FOR_ROWS(w4a8_rows, rows, x, x_row, p, k0, k1, first, sums)
}

/* W8A8: y[m][n0 + j] for j < cols from the exact sums (sums[j] - share), the scalar `store` arithmetic, 16 lanes
   at a time where AVX-512 is there: the same fp32 roundings in the same order. */
static void w8a8_epilogue(const Epilogue *e, const int32_t *sums, uint32_t share, long m, long n0, int cols) {
    int j = 0;
#ifndef GLM5_PORTABLE
    for (; j + 16 <= cols; j += 16) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums + j), _mm512_set1_epi32((int)share)));
        if (e->x_scale)
            v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(e->x_scale[m])), _mm512_loadu_ps(e->w_scale + n0 + j));
        if (e->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(e->bias + n0 + j));
        store16(e, m, n0 + j, v);
    }
#endif
    for (; j < cols; j++) {
        float value = (float)(int32_t)((uint32_t)sums[j] - share);
        if (e->x_scale) value = value * e->x_scale[m] * e->w_scale[n0 + j];
        if (e->bias) value = value + e->bias[n0 + j];
        store(e, m, n0 + j, value);
    }
}

/* W4A8, group g of `groups` done for row m: total[j] = (g == 0 ? 0 : total[j] +) fp32(sums[j] - share) * scale[j]
   (an fp32 multiply, then an fp32 add: the torch route's order); after the last group, y = total [* x_scale[m]].
   scale: the panel's weight scales of group g, contiguous (panel_scales). */
static void w4a8_group_epilogue(const Epilogue *e, const int32_t *sums, float *total, uint32_t share,
                                const float *scale, long g, long groups, long m, long n0, int cols) {
    const int last = g == groups - 1;
    int j = 0;
#ifndef GLM5_PORTABLE
    for (; j + 16 <= cols; j += 16) {
        __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums + j), _mm512_set1_epi32((int)share)));
        __m512 scaled = _mm512_mul_ps(exact, _mm512_loadu_ps(scale + j));
        __m512 sum = g == 0 ? scaled : _mm512_add_ps(_mm512_loadu_ps(total + j), scaled);
        if (!last) {
            _mm512_storeu_ps(total + j, sum);
            continue;
        }
        store16(e, m, n0 + j, e->x_scale ? _mm512_mul_ps(sum, _mm512_set1_ps(e->x_scale[m])) : sum);
    }
#endif
    for (; j < cols; j++) {
        float scaled = (float)(int32_t)((uint32_t)sums[j] - share) * scale[j];
        float sum = g == 0 ? scaled : total[j] + scaled;
        if (!last)
            total[j] = sum;
        else
            store(e, m, n0 + j, e->x_scale ? sum * e->x_scale[m] : sum);
    }
}

/* scale[j] = S[n0 + j][g] for the panel's `cols` columns, S's rows s_row floats apart. The index is formed in 64 bits
   here, in the code both builds share: a 32-bit gather index (j * s_row in a vector lane) read outside S for row
   strides >= 2^31 / 15. Once per panel and group, for every row block that follows. */
static void panel_scales(const float *S, long s_row, long g, long n0, int cols, float scale[PC]) {
    for (int j = 0; j < cols; j++) scale[j] = S[(long)(n0 + j) * s_row + g];
}

/* zero * the sum of each group of `group` columns of each row of X, modulo 2^32: share[m * groups + g] (the weight
   zero point's part of every accumulator). */
static void zero_point_shares(long M, long groups, long group, const int8_t *X, long x_row, uint32_t zero,
                              uint32_t *share) {
    for (long m = 0; m < M; m++)
        for (long g = 0; g < groups; g++) {
            int64_t sum = 0;
            for (long k = g * group; k < (g + 1) * group; k++) sum += X[m * x_row + k];
            share[m * groups + g] = (uint32_t)sum * zero;
        }
}

/* The W8A8 GEMM for columns [n_begin, n_end) (n_begin a multiple of PC), every row: X [M, K] int8 rows of stride
   x_row; P: panel_weight's panels, p_stride bytes apart. y = the Epilogue of the exact sums (x_scale and w_scale
   both or neither). Returns 0, or -1 where its scratch could not be allocated (nothing written). */
int glm5_w8a8_gemm_nt(long M, long K, const int8_t *X, long x_row, const uint8_t *P, long p_stride,
                      const float *x_scale, const float *w_scale, const float *bias, void *y, long y_row, int bf16,
                      long n_begin, long n_end) {
    const Epilogue e = {x_scale, w_scale, bias, y, y_row, bf16};
    uint32_t *share = malloc(sizeof(uint32_t) * (M > 0 ? M : 1));
    int32_t *sums = malloc(sizeof(int32_t) * PC * (M > 0 ? M : 1));
    if (!share || !sums) {
        free(share);
        free(sums);
        return -1;
    }
    zero_point_shares(M, 1, K, X, x_row, 128u, share);
    for (long n0 = n_begin; n0 < n_end; n0 += PC) {
        const uint8_t *panel = P + (n0 / PC) * p_stride;
        const int cols = n_end - n0 < PC ? (int)(n_end - n0) : PC;
        long k0 = 0;
        do { /* at least once: K = 0 gives zeros */
            long k1 = K - k0 > KP8 ? k0 + KP8 : K;
            for (long m = 0; m < M; m += PR) {
                int rows = M - m < PR ? (int)(M - m) : PR;
                w8a8_block(rows, X + m * x_row, x_row, panel + (k0 / 4) * 4 * PC, k0, k1, k0 == 0, sums + m * PC);
                if (k1 == K)
                    for (int r = 0; r < rows; r++) w8a8_epilogue(&e, sums + (m + r) * PC, share[m + r], m + r, n0, cols);
            }
            k0 = k1;
        } while (k0 < K);
    }
    free(share);
    free(sums);
    return 0;
}

/* The W4A8 GEMM for columns [n_begin, n_end) (n_begin a multiple of PC), every row: y[m][n] = (sum over groups g,
   in order, of fp32(exact int32 sum of group g) * S[n][g]) [* x_scale[m]] (the torch route's fp32 steps, in its
   order). X: [M, K] int8 rows as stored (K-contiguous); P: panel_int4_weight's panels, p_stride bytes apart; groups
   of K / groups columns, each a multiple of 8 unless there is one group. Returns 0, or -1 where its scratch could
   not be allocated (nothing written). */
int glm5_w4a8_gemm_nt(long M, long K, long groups, const int8_t *X, long x_row, const uint8_t *P, long p_stride,
                      const float *S, long s_row, const float *x_scale, void *y, long y_row, int bf16, long n_begin,
                      long n_end) {
    const Epilogue e = {x_scale, NULL, NULL, y, y_row, bf16};
    const long group = K / groups, rows_total = M > 0 ? M : 1;
    uint32_t *share = malloc(sizeof(uint32_t) * rows_total * (groups > 0 ? groups : 1));
    int32_t *sums = malloc(sizeof(int32_t) * PC * rows_total);
    float *total = malloc(sizeof(float) * PC * rows_total);
    if (!share || !sums || !total) {
        free(share);
        free(sums);
        free(total);
        return -1;
    }
    zero_point_shares(M, groups, group, X, x_row, 8u, share);
    for (long n0 = n_begin; n0 < n_end; n0 += PC) {
        const uint8_t *panel = P + (n0 / PC) * p_stride;
        const int cols = n_end - n0 < PC ? (int)(n_end - n0) : PC;
        for (long g = 0; g < groups; g++) {
            const long g_end = (g + 1) * group;
            float scale[PC];
            panel_scales(S, s_row, g, n0, cols, scale);
            for (long k0 = g * group; k0 < g_end;) {
                long k1 = g_end - k0 > KP4 ? k0 + KP4 : g_end;
                for (long m = 0; m < M; m += PR) {
                    int rows = M - m < PR ? (int)(M - m) : PR;
                    w4a8_block(rows, X + m * x_row, x_row, panel + (k0 / 8) * 4 * PC, k0, k1, k0 == g * group,
                               sums + m * PC);
                    if (k1 == g_end)
                        for (int r = 0; r < rows; r++)
                            w4a8_group_epilogue(&e, sums + (m + r) * PC, total + (m + r) * PC,
                                                share[(m + r) * groups + g], scale, g, groups, m + r, n0, cols);
                }
                k0 = k1;
            }
        }
    }
    free(share);
    free(sums);
    free(total);
    return 0;
}
