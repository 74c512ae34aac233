/* bf16 x bf16 -> fp32 GEMM with both operands K-contiguous ("NT"), for CPUs whose vendor GEMMs return bf16 only.
 *
 *   C[b][m][n] = sum_k A[b][m][k] * B[b][n][k]      A, B bf16 (raw uint16 bits), C fp32
 *
 * Every product of two bf16 values is exact in fp32 and every sum is an fp32 add: the result is the fp32 GEMM of
 * the upcast operands up to the order of the sums (backends/torch_eager/native/bf16_gemm.py has the Python side).
 *
 * Built twice by backends/torch_eager/native/build.py:
 * - with -mavx512bf16: a 4 x 4 tile of 512-bit accumulators fed by VDPBF16PS (32 bf16 pairs per instruction), one
 *   accumulator per output, reduced to the tile's 16 results at the end of each K block;
 * - with -mavx2 -mfma (GLM5_AVX2), for CPUs without AVX-512: a 3 x 4 tile of 256-bit fp32 accumulators, the bf16
 *   operands widened exactly in registers (bf16.h: even k from one shift, odd k from one mask of the same load) and
 *   multiplied with FMA (a bf16 x bf16 product is exact in fp32, so each FMA is the exact product plus one rounding,
 *   as an add of it); lane l of an accumulator sums k = 2l and 2l + 1 modulo 16, reduced at the end of each K block;
 * - without either (GLM5_PORTABLE): the same loops around a scalar tile, for testing the blocking on any CPU.
 * All differ from the fp32 GEMM only in the order of the fp32 additions. VDPBF16PS treats bf16 subnormal inputs
 * and fp32 subnormal results as zero (an absolute difference below 1.2e-38); the AVX2 and portable builds keep
 * subnormals (nothing here sets MXCSR's DAZ / FTZ).
 */
#include "bf16.h"

#if defined(GLM5_AVX2)
#define MR 3    /* rows of A per tile: 3 x 4 accumulators + 3 held A vectors + 1 streamed B vector = 16 ymm */
#define NR 4    /* rows of B (columns of C) per tile; bf16_gemm.py's TILE_COLUMNS */
#define KC 1024 /* K per block: a tile's 7 operand rows (14 KiB) stay in L1 (32 KiB on Zen 3) across the block */
#define MC 128  /* rows of A per block: MC x KC bf16 (256 KiB) stay in L2 (512 KiB on Zen 3) while B streams past */
#else
#define MR 4    /* rows of A per tile */
#define NR 4    /* rows of B (columns of C) per tile */
#define KC 1024 /* K per block: a tile's 8 operand rows (16 KiB) stay in L1 across the block */
#define MC 256  /* rows of A per block: MC x KC bf16 (512 KiB) stay in L2 while B streams past */
#endif
#define A_RESIDENT (256 * 1024) /* bytes of A up to which all of it stays in L2 (half of Zen 3's) over a pass */

#if defined(GLM5_AVX2)
#define STEP 16 /* k per step: one 256-bit load of a row is 16 bf16, 8 even and 8 odd */

/* One step at k: acc[m][n] lane l gains a[m][k + 2l] b[n][k + 2l], then a[m][k + 2l + 1] b[n][k + 2l + 1]. The A
   values of a phase stay in registers while B's rows stream past. `rows` is a constant once inlined. */
static inline __attribute__((always_inline)) void step(const int rows, const uint16_t *const *a,
                                                       const uint16_t *const *b, long k, __m256 acc[MR][NR]) {
    __m256 av[MR];
    for (int m = 0; m < rows; m++) av[m] = low_halves(_mm256_loadu_si256((const __m256i *)(a[m] + k)));
    for (int n = 0; n < NR; n++) {
        __m256 bv = low_halves(_mm256_loadu_si256((const __m256i *)(b[n] + k)));
        for (int m = 0; m < rows; m++) acc[m][n] = _mm256_fmadd_ps(av[m], bv, acc[m][n]);
    }
    for (int m = 0; m < rows; m++) av[m] = high_halves(_mm256_loadu_si256((const __m256i *)(a[m] + k)));
    for (int n = 0; n < NR; n++) {
        __m256 bv = high_halves(_mm256_loadu_si256((const __m256i *)(b[n] + k)));
        for (int m = 0; m < rows; m++) acc[m][n] = _mm256_fmadd_ps(av[m], bv, acc[m][n]);
    }
}

/* The 4 sums of v[0..3]'s lanes, in order (two levels of pairwise adds within 128-bit halves, then the halves). */
static inline __m128 sum_each_of_4(const __m256 v[4]) {
    __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* out[NR * m + n] = sum over k < K of a[m][k] * b[n][k], m < rows: the tile for a constant number of rows (an edge
   tile computes only its real rows: at decode, M = 4 is a full tile and a 1-row one). */
static inline __attribute__((always_inline)) void tile_of(const int rows, const uint16_t *a[MR],
                                                          const uint16_t *b[NR], long K, float out[MR * NR]) {
    _Static_assert(NR == 4, "sum_each_of_4 reduces a row of NR = 4 accumulators");
    __m256 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
    long k = 0;
    for (; k + STEP <= K; k += STEP) step(rows, a, b, k, acc);
    if (k < K) { /* the K - k < 16 last values, copied into zero-padded rows (zeros add exact zeros) */
        uint16_t edge[MR + NR][STEP] = {{0}};
        const uint16_t *ea[MR], *eb[NR];
        for (int m = 0; m < rows; m++) ea[m] = memcpy(edge[m], a[m] + k, sizeof(uint16_t) * (K - k));
        for (int n = 0; n < NR; n++) eb[n] = memcpy(edge[MR + n], b[n] + k, sizeof(uint16_t) * (K - k));
        step(rows, ea, eb, 0, acc);
    }
    for (int m = 0; m < rows; m++) _mm_storeu_ps(out + NR * m, sum_each_of_4(acc[m]));
}

static void tile(const uint16_t *a[MR], const uint16_t *b[NR], long K, int rows, float out[MR * NR]) {
    switch (rows) {
    case 1: tile_of(1, a, b, K, out); break;
    case 2: tile_of(2, a, b, K, out); break;
    default: tile_of(MR, a, b, K, out); break;
    }
}
#elif !defined(GLM5_PORTABLE)
#include <immintrin.h>

/* The 16 sums of v[0..15] in one vector, lane 4 * i + j holding sum(v[4 * j + i]): three levels of 128-bit
   quarter shuffles and in-lane unpacks, 15 adds in all (instead of 16 separate horizontal reductions). */
static inline __m512 sum_each_of_16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int j = 0; j < 8; j++) /* lanes 0-7: half-sums of v[2j], lanes 8-15: of v[2j+1] */
        pairs[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++) /* quarter i: 4 partial sums of v[4j + i] */
        quads[j] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * j], pairs[2 * j + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * j], pairs[2 * j + 1], 0xDD));
    __m512 r0 = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
    __m512 r1 = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
    __m512d d0 = _mm512_castps_pd(r0), d1 = _mm512_castps_pd(r1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}

/* out[4 * m + n] = sum over k < K of a[m][k] * b[n][k] for m < rows (a constant once inlined: a decode step's one
   row does a quarter of a full tile's products; out's rows from `rows` on are zeros). */
static inline __attribute__((always_inline)) void tile_of(const int rows, const uint16_t *a[MR],
                                                          const uint16_t *b[NR], long K, float out[MR * NR]) {
    __m512 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh av[MR], bv[NR];
        for (int m = 0; m < rows; m++) av[m] = (__m512bh)_mm512_loadu_si512(a[m] + k);
        for (int n = 0; n < NR; n++) bv[n] = (__m512bh)_mm512_loadu_si512(b[n] + k);
        for (int n = 0; n < NR; n++)
            for (int m = 0; m < rows; m++) acc[4 * n + m] = _mm512_dpbf16_ps(acc[4 * n + m], av[m], bv[n]);
    }
    if (k < K) { /* the K - k < 32 last pairs: masked loads read nothing past the row and give zeros */
        __mmask32 valid = (__mmask32)((1u << (K - k)) - 1u);
        __m512bh av[MR], bv[NR];
        for (int m = 0; m < rows; m++) av[m] = (__m512bh)_mm512_maskz_loadu_epi16(valid, a[m] + k);
        for (int n = 0; n < NR; n++) bv[n] = (__m512bh)_mm512_maskz_loadu_epi16(valid, b[n] + k);
        for (int n = 0; n < NR; n++)
            for (int m = 0; m < rows; m++) acc[4 * n + m] = _mm512_dpbf16_ps(acc[4 * n + m], av[m], bv[n]);
    }
    /* acc[4n + m] lands in lane 4m + n: out is the tile in row-major order (rows past `rows` sum zeros). */
    _mm512_storeu_ps(out, sum_each_of_16(acc));
}

static void tile(const uint16_t *a[MR], const uint16_t *b[NR], long K, int rows, float out[MR * NR]) {
    switch (rows) {
    case 1: tile_of(1, a, b, K, out); break;
    case 2: tile_of(2, a, b, K, out); break;
    default: tile_of(MR, a, b, K, out); break; /* 3 rows: the fourth repeats a real one */
    }
}
#else
static void tile(const uint16_t *a[MR], const uint16_t *b[NR], long K, int rows, float out[MR * NR]) {
    for (int m = 0; m < rows; m++)
        for (int n = 0; n < NR; n++) {
            float sum = 0.0f;
            for (long k = 0; k < K; k++) sum += bf16_to_float(a[m][k]) * bf16_to_float(b[n][k]);
            out[NR * m + n] = sum;
        }
}
#endif

/* The tile at rows m..m + rows, columns n..n + cols, over K block k0 (kc deep): computed and added to C (stored
   where k0 == 0), so every output is the sum of its K blocks' partial sums in k0 order, whatever the loop order. */
static inline void block_tile(const uint16_t *Ab, long a_row, const uint16_t *Bb, long b_row, float *Cb, long c_row,
                              long m, int rows, long n, int cols, long k0, long kc) {
    float out[MR * NR];
    const uint16_t *ap[MR], *bp[NR];
    for (int i = 0; i < MR; i++) ap[i] = Ab + (m + (i < rows ? i : 0)) * a_row + k0;
    for (int j = 0; j < NR; j++) bp[j] = Bb + (n + (j < cols ? j : 0)) * b_row + k0; /* edge: repeat row n */
    tile(ap, bp, kc, rows, out);
    float *c = Cb + m * c_row + n;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) c[i * c_row + j] = k0 == 0 ? out[NR * i + j] : c[i * c_row + j] + out[NR * i + j];
}

/* C[b][m][n] for b in [b_begin, b_end), n in [n_begin, n_end), every m: one thread's share (the Python side splits
   the work over threads by batch or by columns; an output element's sums do not depend on the split). Strides are
   in elements; A's and B's rows are K-contiguous, C's rows N-contiguous. */
void glm5_bf16_gemm_nt(long M, long K, const uint16_t *A, long a_batch, long a_row, const uint16_t *B, long b_batch,
                       long b_row, float *C, long c_batch, long c_row, long b_begin, long b_end, long n_begin,
                       long n_end) {
    if (M <= 0) return;
    for (long bi = b_begin; bi < b_end; bi++) {
        const uint16_t *Ab = A + bi * a_batch, *Bb = B + bi * b_batch;
        float *Cb = C + bi * c_batch;
        if (M * K * (long)sizeof(uint16_t) <= A_RESIDENT) {
            /* A small enough to stay in L2 whole (decode, a MoE expert's few rows): B is read once whatever the
               order, so each group of B rows is read whole, its K blocks one after the other, instead of one block
               of every row per pass: a few long sequential streams the hardware prefetcher keeps ahead of, not
               short ones a row's stride apart (1.55-1.8x at 1-2 rows on 24-48 MiB weights, 1.2x at 4 rows on
               8 MiB, Zen 4). The K blocks are the same and summed in the same order (block_tile): the same result
               to the bit. */
            for (long n = n_begin; n < n_end; n += NR) {
                int cols = n_end - n < NR ? (int)(n_end - n) : NR;
                for (long k0 = 0; k0 < K || k0 == 0; k0 += KC) /* at least once: K = 0 writes zeros */
                    for (long m = 0; m < M; m += MR) {
                        int rows = M - m < MR ? (int)(M - m) : MR;
                        block_tile(Ab, a_row, Bb, b_row, Cb, c_row, m, rows, n, cols, k0, K - k0 < KC ? K - k0 : KC);
                    }
            }
            continue;
        }
        for (long m0 = 0; m0 < M; m0 += MC) {
            long m1 = m0 + MC < M ? m0 + MC : M;
            long k0 = 0;
            do { /* at least once: K = 0 writes zeros */
                long kc = K - k0 < KC ? K - k0 : KC;
                for (long n = n_begin; n < n_end; n += NR) {
                    int cols = n_end - n < NR ? (int)(n_end - n) : NR;
                    for (long m = m0; m < m1; m += MR) {
                        int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                        block_tile(Ab, a_row, Bb, b_row, Cb, c_row, m, rows, n, cols, k0, kc);
                    }
                }
                k0 += KC;
            } while (k0 < K);
        }
    }
}
