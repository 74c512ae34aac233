/* Exact int8 GEMMs for W8A8 and W4A8 with both operands K-contiguous ("NT"), on CPUs with AVX-512 VNNI.
 *
 *   W8A8:  C[m][n] = fp32( sum_k X[m][k] * W[n][k] )                  X, W int8; the int32 sum is exact
 *   W4A8:  Y[m][n] = sum_g fp32( sum_{k in g} X[m][k] * W4[n][k] ) * S[n][g]    W4 int4 packed two per byte
 *
 * VPDPBUSD multiplies unsigned bytes by signed bytes and adds each group of four products to an int32 lane, without
 * saturation (the adds wrap modulo 2^32). The signed x signed product comes from a shift by a zero point:
 * - W8A8: the weight byte w + 128 (its top bit flipped) is the unsigned side, so the lanes hold
 *   sum x (w + 128) = sum x w + 128 sum x; the caller passes 128 sum x per row (xsum128, M numbers per call, where
 *   a weight-side correction would need a pass over the weight). Wrapping arithmetic makes the difference exact
 *   whenever the true sum fits int32, however large the shifted one is.
 * - W4A8: the weight nibble is w + 8 after flipping its top bit (0..15, unsigned), the activation the signed side:
 *   sum (w + 8) x = sum w x + 8 sum x; the kernel subtracts 8 sum x per row and group. The nibbles are split in
 *   registers from the packed bytes, so the weight is read at 4 bits a value. The weight comes repacked once
 *   (int8_gemm.py's tile_int4_weight) so that byte j of each 128-column block holds columns j (low nibble) and
 *   64 + j (high nibble): the activations are then read as they are, 64 contiguous bytes per nibble half.
 *
 * Built twice by glm5_hal/native/build.py: with -mavx512vnni (4 x 4 tiles of 512-bit int32 accumulators), and
 * without it (GLM5_PORTABLE: the same loops around a scalar tile, for testing the blocking on any CPU). Both give
 * the exact integer sums; glm5_hal/native/int8_gemm.py has the Python side.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MR 4     /* rows of X per tile */
#define NR 4     /* rows of W (columns of C) per tile */
#define KC 4096  /* W8A8: K per block; a tile's 8 operand rows (32 KiB) stay in L1 across the block */
#define MC 128   /* W8A8: rows of X per block: MC x KC bytes (512 KiB) stay in L2 while W streams past */
/* W8A8: an X of at most this many bytes is not split into K blocks (it stays in L2 whole, and each weight tile is
   one sequential stream; K blocks would read every tile in KC-wide pieces, 1.5x slower at 8 rows of K = 16384). */
#define X_WHOLE (256 * 1024)
#define KB 128   /* W4A8: columns per step (64 packed weight bytes, repacked); groups are whole steps */

#ifndef GLM5_PORTABLE
#include <immintrin.h>

/* The 16 sums of v[0..15] in one vector, lane 4 * i + j holding sum(v[4 * j + i]) (the bf16_gemm.c reduction on
   int32 lanes: integer adds, so exact in any order). */
static inline __m512i sum_each_of_16(const __m512i v[16]) {
    __m512i pairs[8], quads[4];
    for (int j = 0; j < 8; j++)
        pairs[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0x44),
                                    _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        quads[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(pairs[2 * j], pairs[2 * j + 1], 0x88),
                                    _mm512_shuffle_i32x4(pairs[2 * j], pairs[2 * j + 1], 0xDD));
    __m512i r0 = _mm512_add_epi32(_mm512_unpacklo_epi32(quads[0], quads[1]), _mm512_unpackhi_epi32(quads[0], quads[1]));
    __m512i r1 = _mm512_add_epi32(_mm512_unpacklo_epi32(quads[2], quads[3]), _mm512_unpackhi_epi32(quads[2], quads[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(r0, r1), _mm512_unpackhi_epi64(r0, r1));
}

/* acc_n<m> += (w[n] + 128) . x[m] over 64 bytes, for the four x rows: one weight vector's dot products. Named
   accumulators, not an array: gcc keeps an array of 16 vectors partly on the stack across the loop. */
#define DOT_ROW(n, wv)                                              \
    acc##n##0 = _mm512_dpbusd_epi32(acc##n##0, wv, x0);             \
    acc##n##1 = _mm512_dpbusd_epi32(acc##n##1, wv, x1);             \
    acc##n##2 = _mm512_dpbusd_epi32(acc##n##2, wv, x2);             \
    acc##n##3 = _mm512_dpbusd_epi32(acc##n##3, wv, x3);

/* out[4 * m + n] = sum over k < K of x[m][k] * (w[n][k] + 128), modulo 2^32; next: the weight rows of the tile
   after this one, prefetched as these are read (in step: without huge pages the rows cross a 4 KiB page every 4096
   bytes, where the hardware prefetchers stop and start over). Not inlined: inside the driver's loops gcc runs out
   of registers and keeps accumulators on the stack (a store-to-load chain per step). */
__attribute__((noinline)) static void tile_w8a8(const int8_t *x[MR], const int8_t *w[NR], const int8_t *next[NR],
                                                long w_step, long K, int32_t out[MR * NR]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* w + 128: the signed byte with its top bit flipped */
    __m512i acc00 = _mm512_setzero_si512(), acc01 = acc00, acc02 = acc00, acc03 = acc00, acc10 = acc00,
            acc11 = acc00, acc12 = acc00, acc13 = acc00, acc20 = acc00, acc21 = acc00, acc22 = acc00, acc23 = acc00,
            acc30 = acc00, acc31 = acc00, acc32 = acc00, acc33 = acc00;
    for (long k = 0; k < K; k += 64) {
        /* The K - k < 64 last bytes: masked loads read nothing past the row and give zeros; x loads as 0, so the
           128 its w becomes after the flip adds nothing. */
        __mmask64 valid = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
        __m512i x0 = _mm512_maskz_loadu_epi8(valid, x[0] + k), x1 = _mm512_maskz_loadu_epi8(valid, x[1] + k);
        __m512i x2 = _mm512_maskz_loadu_epi8(valid, x[2] + k), x3 = _mm512_maskz_loadu_epi8(valid, x[3] + k);
        long at = (k / 64) * w_step; /* the weight's 64-byte chunk k / 64 (see Layout) */
        for (int n = 0; n < NR; n++) _mm_prefetch((const char *)(next[n] + at), _MM_HINT_T0);
        __m512i w0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[0] + at), flip);
        DOT_ROW(0, w0)
        __m512i w1 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[1] + at), flip);
        DOT_ROW(1, w1)
        __m512i w2 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[2] + at), flip);
        DOT_ROW(2, w2)
        __m512i w3 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[3] + at), flip);
        DOT_ROW(3, w3)
    }
    /* acc<n><m> goes to slot 4n + m, which sum_each_of_16 lands in lane 4m + n: out is row-major. */
    const __m512i acc[MR * NR] = {acc00, acc01, acc02, acc03, acc10, acc11, acc12, acc13,
                                  acc20, acc21, acc22, acc23, acc30, acc31, acc32, acc33};
    _mm512_storeu_si512(out, sum_each_of_16(acc));
}

/* tile_w8a8 for a single row of X (decode with one token): 4 accumulators instead of 16 of which 12 would repeat
   the same row's work. out[n] as tile_w8a8's out[n]. */
__attribute__((noinline)) static void row_w8a8(const int8_t *x, const int8_t *w[NR], const int8_t *next[NR],
                                               long w_step, long K, int32_t out[MR * NR]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (long k = 0; k < K; k += 64) {
        __mmask64 valid = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
        __m512i xv = _mm512_maskz_loadu_epi8(valid, x + k);
        long at = (k / 64) * w_step;
        for (int n = 0; n < NR; n++) _mm_prefetch((const char *)(next[n] + at), _MM_HINT_T0);
        acc0 = _mm512_dpbusd_epi32(acc0, _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[0] + at), flip), xv);
        acc1 = _mm512_dpbusd_epi32(acc1, _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[1] + at), flip), xv);
        acc2 = _mm512_dpbusd_epi32(acc2, _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[2] + at), flip), xv);
        acc3 = _mm512_dpbusd_epi32(acc3, _mm512_xor_si512(_mm512_maskz_loadu_epi8(valid, w[3] + at), flip), xv);
    }
    out[0] = _mm512_reduce_add_epi32(acc0);
    out[1] = _mm512_reduce_add_epi32(acc1);
    out[2] = _mm512_reduce_add_epi32(acc2);
    out[3] = _mm512_reduce_add_epi32(acc3);
}

/* The bytes of x's 64-column half starting at column `at` of a row with `cols` columns: masked past the end (0). */
static inline __mmask64 half_mask(long at, long cols) {
    long left = cols - at;
    return left >= 64 ? ~(__mmask64)0 : left <= 0 ? 0 : ((__mmask64)1 << left) - 1;
}

/* out[4 * m + n] = sum over the first `cols` columns of x / w (steps = ceil(cols / KB) of them) of (w + 8) x, exact
   modulo 2^32 (x: activation rows as stored, wp: repacked int4 rows, Layout step w_step). Columns past `cols` read
   as x = 0, so the weight's zero padding there adds nothing. next: the rows of the next tile, prefetched in step
   (as in tile_w8a8). */
static void tile_w4a8(const int8_t *x[MR], const uint8_t *wp[NR], const uint8_t *next[NR], long w_step, long cols,
                      int32_t out[MR * NR]) {
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(0x08);
    __m512i acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_si512();
    for (long s = 0, k = 0; k < cols; s++, k += KB) {
        __mmask64 lo_valid = half_mask(k, cols), hi_valid = half_mask(k + KB / 2, cols);
        __m512i x_lo[MR], x_hi[MR];
        for (int m = 0; m < MR; m++) {
            x_lo[m] = _mm512_maskz_loadu_epi8(lo_valid, x[m] + k);
            x_hi[m] = _mm512_maskz_loadu_epi8(hi_valid, x[m] + k + KB / 2);
        }
        for (int n = 0; n < NR; n++) {
            _mm_prefetch((const char *)(next[n] + s * w_step), _MM_HINT_T0);
            __m512i packed = _mm512_loadu_si512(wp[n] + s * w_step); /* whole 64-byte chunks: the tiles are padded */
            __m512i w_lo = _mm512_xor_si512(_mm512_and_si512(packed, low), flip);
            __m512i w_hi = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low), flip);
            for (int m = 0; m < MR; m++) {
                acc[4 * n + m] = _mm512_dpbusd_epi32(acc[4 * n + m], w_lo, x_lo[m]);
                acc[4 * n + m] = _mm512_dpbusd_epi32(acc[4 * n + m], w_hi, x_hi[m]);
            }
        }
    }
    _mm512_storeu_si512(out, sum_each_of_16(acc));
}
#else
static void tile_w8a8(const int8_t *x[MR], const int8_t *w[NR], const int8_t *next[NR], long w_step, long K,
                      int32_t out[MR * NR]) {
    (void)next;
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            uint32_t sum = 0; /* unsigned: wraps modulo 2^32 like the vector lanes (signed overflow is undefined) */
            for (long k = 0; k < K; k++)
                sum += (uint32_t)((int32_t)x[m][k] * ((int32_t)w[n][(k / 64) * w_step + k % 64] + 128));
            out[MR * m + n] = (int32_t)sum;
        }
}

static void row_w8a8(const int8_t *x, const int8_t *w[NR], const int8_t *next[NR], long w_step, long K,
                     int32_t out[MR * NR]) {
    const int8_t *rows[MR] = {x, x, x, x};
    tile_w8a8(rows, w, next, w_step, K, out); /* out[0..3]: row 0 */
}

static void tile_w4a8(const int8_t *x[MR], const uint8_t *wp[NR], const uint8_t *next[NR], long w_step, long cols,
                      int32_t out[MR * NR]) {
    (void)next;
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            uint32_t sum = 0;
            for (long s = 0, k = 0; k < cols; s++, k += KB)
                for (int j = 0; j < KB / 2; j++) {
                    uint8_t byte = wp[n][s * w_step + j];
                    int32_t w_lo = (int32_t)((byte & 0x0F) ^ 0x08), w_hi = (int32_t)((byte >> 4) ^ 0x08);
                    if (k + j < cols) sum += (uint32_t)(w_lo * x[m][k + j]);
                    if (k + KB / 2 + j < cols) sum += (uint32_t)(w_hi * x[m][k + KB / 2 + j]);
                }
            out[MR * m + n] = (int32_t)sum;
        }
}
#endif

/* Where the weight's bytes are: row n's 64-byte chunk c (columns 64c.. of W8A8, 128c.. of W4A8, which packs two per
   byte) starts at W + (n / 4) * tile + (n % 4) * lane + c * step.
   - As stored, [N, K] (or [N, K / 2]) rows of stride r: tile = 4r, lane = r, step = 64.
   - Tiled (int8_gemm.py's tile_weight, made once per weight): [N / 4][chunks][4][64], zero-padded, so a tile of 4
     rows is one sequential stream (the hardware prefetchers follow one stream better than four, and past a 4 KiB
     page they start over): tile = 256 x chunks, lane = 64, step = 256. */
typedef struct {
    long tile, lane, step;
} Layout;

static inline const int8_t *chunk(const int8_t *W, Layout at, long n, long c) {
    return W + (n / NR) * at.tile + (n % NR) * at.lane + c * at.step;
}

/* Where the results go: y = fp32(acc) [* x_scale[m] * w_scale[n]] [+ bias[n]], each step one fp32 rounding in
   this order (the torch route's: acc.mul_(x_scale).mul_(w_scale).add_(bias)), stored as fp32 or bf16. */
typedef struct {
    const float *x_scale, *w_scale, *bias; /* NULL: not applied (w_scale / x_scale: W8A8 passes both or neither) */
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

/* 128 x the sum of each row of X[m0..m1) (the weight zero point's share of every accumulator), modulo 2^32. */
static void zero_point_shares(const int8_t *X, long x_row, long K, long m0, long m1, uint32_t share[MC]) {
    for (long m = m0; m < m1; m++) {
        int64_t sum = 0;
        for (long k = 0; k < K; k++) sum += X[m * x_row + k];
        share[m - m0] = (uint32_t)sum * 128u;
    }
}

/* The W8A8 GEMM for columns [n_begin, n_end), every row: one thread's share. X's rows K-contiguous, W as Layout
   says. Where K takes several blocks (KC; not for one row tile or an X of at most X_WHOLE bytes), the int32 sums
   wait in `acc` ([M, N], acc_row; may be NULL otherwise); else each tile's sums are final and go straight to the epilogue. Returns 0 (as
   glm5_w4a8_gemm_nt does: the callers check both alike). */
int glm5_w8a8_gemm_nt(long M, long K, const int8_t *X, long x_row, const int8_t *W, long w_tile, long w_lane,
                       long w_step, int32_t *acc,
                       long acc_row, const float *x_scale, const float *w_scale, const float *bias, void *y,
                       long y_row, int bf16, long n_begin, long n_end) {
    const Epilogue e = {x_scale, w_scale, bias, y, y_row, bf16};
    const Layout layout = {w_tile, w_lane, w_step};
    const long kc_max = M <= MR || M * K <= X_WHOLE ? K : KC; /* one row tile or a small X: one pass over K */
    int32_t out[MR * NR];
    uint32_t share[MC];
    for (long m0 = 0; m0 < M; m0 += MC) {
        long m1 = m0 + MC < M ? m0 + MC : M;
        zero_point_shares(X, x_row, K, m0, m1, share);
        long k0 = 0;
        do { /* at least once: K = 0 gives zeros */
            long kc = K - k0 < kc_max ? K - k0 : kc_max;
            int last = k0 + kc >= K, only = k0 == 0 && last;
            for (long n = n_begin; n < n_end; n += NR) {
                int cols = n_end - n < NR ? (int)(n_end - n) : NR;
                const int8_t *wp[NR], *next[NR];
                for (int j = 0; j < NR; j++) {
                    wp[j] = chunk(W, layout, n + (j < cols ? j : 0), k0 / 64); /* edge: repeat row n */
                    long after = n + NR + j < n_end ? n + NR + j : n; /* past the share: a row already read */
                    next[j] = chunk(W, layout, after, k0 / 64);
                }
                for (long m = m0; m < m1; m += MR) {
                    int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                    const int8_t *xp[MR];
                    for (int i = 0; i < MR; i++) xp[i] = X + (m + (i < rows ? i : 0)) * x_row + k0;
                    if (rows == 1)
                        row_w8a8(xp[0], wp, m == m0 ? next : wp, w_step, kc, out);
                    else
                        tile_w8a8(xp, wp, m == m0 ? next : wp, w_step, kc, out); /* later row tiles find W cached */
                    for (int i = 0; i < rows; i++)
                        for (int j = 0; j < cols; j++) {
                            /* unsigned adds: wrap modulo 2^32 like the lanes */
                            uint32_t sum = (uint32_t)out[MR * i + j];
                            if (!only) {
                                int32_t *slot = acc + (m + i) * acc_row + n + j;
                                sum += k0 == 0 ? 0u : (uint32_t)*slot;
                                if (!last) {
                                    *slot = (int32_t)sum;
                                    continue;
                                }
                            }
                            float value = (float)(int32_t)(sum - share[m + i - m0]);
                            if (e.x_scale) value = value * e.x_scale[m + i] * e.w_scale[n + j];
                            if (e.bias) value = value + e.bias[n + j];
                            store(&e, m + i, n + j, value);
                        }
                }
            }
            k0 += kc;
        } while (k0 < K);
    }
    return 0;
}

/* 8 x the sum of each group of `group` columns of each row of X, modulo 2^32: xsum8[m * groups + g] (the weight
   zero point's share of every group accumulator). */
static void group_shares(long M, long groups, long group, const int8_t *X, long x_row, uint32_t *xsum8) {
    for (long m = 0; m < M; m++)
        for (long g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (long k = g * group; k < (g + 1) * group; k++) sum += X[m * x_row + k];
            xsum8[m * groups + g] = (uint32_t)sum * 8u;
        }
}

/* The W4A8 GEMM for columns [n_begin, n_end), every row: y[m][n] = (sum over groups g, in order, of
   fp32(exact int32 accumulator of group g) * S[n][g]) [* x_scale[m]], each step an fp32 multiply then an fp32 add
   (the torch route's order). X: [M, K] int8 rows as stored (K-contiguous); Wp: the repacked int4 weight (Layout),
   groups of K / groups columns, each whole steps of KB unless there is one group. Returns 0, or -1 where the
   scratch for the group sums could not be allocated (nothing written). */
int glm5_w4a8_gemm_nt(long M, long K, long groups, const int8_t *X, long x_row, const uint8_t *Wp, long w_tile,
                      long w_lane, long w_step, const float *S, long s_row, const float *x_scale, void *y, long y_row,
                      int bf16, long n_begin, long n_end) {
    const Epilogue e = {x_scale, NULL, NULL, y, y_row, bf16};
    const Layout layout = {w_tile, w_lane, w_step};
    const int8_t *W = (const int8_t *)Wp;
    const long group = K / groups, group_steps = (group + KB - 1) / KB;
    uint32_t *xsum8 = malloc(sizeof(uint32_t) * (M * groups > 0 ? M * groups : 1));
    if (!xsum8) return -1;
    group_shares(M, groups, group, X, x_row, xsum8);
    int32_t out[MR * NR];
    for (long n = n_begin; n < n_end; n += NR) {
        int cols = n_end - n < NR ? (int)(n_end - n) : NR;
        for (long m = 0; m < M; m += MR) {
            int rows = M - m < MR ? (int)(M - m) : MR;
            float sums[MR * NR] = {0};
            for (long g = 0; g < groups; g++) {
                const int8_t *xp[MR];
                const uint8_t *wq[NR], *next[NR];
                for (int i = 0; i < MR; i++) xp[i] = X + (m + (i < rows ? i : 0)) * x_row + g * group;
                for (int j = 0; j < NR; j++) {
                    wq[j] = (const uint8_t *)chunk(W, layout, n + (j < cols ? j : 0), g * group_steps);
                    long after = m == 0 && n + NR + j < n_end ? n + NR + j : n; /* later row tiles find W cached */
                    next[j] = (const uint8_t *)chunk(W, layout, after, g * group_steps);
                }
                tile_w4a8(xp, wq, next, w_step, group, out);
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < cols; j++) {
                        int32_t exact = (int32_t)((uint32_t)out[MR * i + j] - xsum8[(m + i) * groups + g]);
                        float scaled = (float)exact * S[(n + j) * s_row + g];
                        sums[MR * i + j] = g == 0 ? scaled : sums[MR * i + j] + scaled;
                    }
            }
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < cols; j++)
                    store(&e, m + i, n + j, e.x_scale ? sums[MR * i + j] * e.x_scale[m + i] : sums[MR * i + j]);
        }
    }
    free(xsum8);
    return 0;
}
