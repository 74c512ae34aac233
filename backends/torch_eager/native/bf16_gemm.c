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
 * - without it (GLM5_PORTABLE): the same loops around a scalar tile, for testing the blocking on any CPU.
 * Both differ from the fp32 GEMM only in the order of the fp32 additions. VDPBF16PS treats bf16 subnormal inputs
 * and fp32 subnormal results as zero (an absolute difference below 1.2e-38).
 */
#include "bf16.h"

#define MR 4    /* rows of A per tile */
#define NR 4    /* rows of B (columns of C) per tile */
#define KC 1024 /* K per block: a tile's 8 operand rows (16 KiB) stay in L1 across the block */
#define MC 256  /* rows of A per block: MC x KC bf16 (512 KiB) stay in L2 while B streams past */

#ifndef GLM5_PORTABLE
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

/* out[4 * m + n] = sum over k < K of a[m][k] * b[n][k]. */
static void tile(const uint16_t *a[MR], const uint16_t *b[NR], long K, float out[MR * NR]) {
    __m512 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh av[MR], bv[NR];
        for (int m = 0; m < MR; m++) av[m] = (__m512bh)_mm512_loadu_si512(a[m] + k);
        for (int n = 0; n < NR; n++) bv[n] = (__m512bh)_mm512_loadu_si512(b[n] + k);
        for (int n = 0; n < NR; n++)
            for (int m = 0; m < MR; m++) acc[4 * n + m] = _mm512_dpbf16_ps(acc[4 * n + m], av[m], bv[n]);
    }
    if (k < K) { /* the K - k < 32 last pairs: masked loads read nothing past the row and give zeros */
        __mmask32 valid = (__mmask32)((1u << (K - k)) - 1u);
        __m512bh av[MR], bv[NR];
        for (int m = 0; m < MR; m++) av[m] = (__m512bh)_mm512_maskz_loadu_epi16(valid, a[m] + k);
        for (int n = 0; n < NR; n++) bv[n] = (__m512bh)_mm512_maskz_loadu_epi16(valid, b[n] + k);
        for (int n = 0; n < NR; n++)
            for (int m = 0; m < MR; m++) acc[4 * n + m] = _mm512_dpbf16_ps(acc[4 * n + m], av[m], bv[n]);
    }
    /* acc[4n + m] lands in lane 4m + n: out is the tile in row-major order. */
    _mm512_storeu_ps(out, sum_each_of_16(acc));
}
#else
static void tile(const uint16_t *a[MR], const uint16_t *b[NR], long K, float out[MR * NR]) {
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            float sum = 0.0f;
            for (long k = 0; k < K; k++) sum += bf16_to_float(a[m][k]) * bf16_to_float(b[n][k]);
            out[MR * m + n] = sum;
        }
}
#endif

/* C[b][m][n] for b in [b_begin, b_end), n in [n_begin, n_end), every m: one thread's share (the Python side splits
   the work over threads by batch or by columns; an output element's sums do not depend on the split). Strides are
   in elements; A's and B's rows are K-contiguous, C's rows N-contiguous. */
void glm5_bf16_gemm_nt(long M, long K, const uint16_t *A, long a_batch, long a_row, const uint16_t *B, long b_batch,
                       long b_row, float *C, long c_batch, long c_row, long b_begin, long b_end, long n_begin,
                       long n_end) {
    float out[MR * NR];
    for (long bi = b_begin; bi < b_end; bi++) {
        const uint16_t *Ab = A + bi * a_batch, *Bb = B + bi * b_batch;
        float *Cb = C + bi * c_batch;
        for (long m0 = 0; m0 < M; m0 += MC) {
            long m1 = m0 + MC < M ? m0 + MC : M;
            long k0 = 0;
            do { /* at least once: K = 0 writes zeros */
                long kc = K - k0 < KC ? K - k0 : KC;
                for (long n = n_begin; n < n_end; n += NR) {
                    int cols = n_end - n < NR ? (int)(n_end - n) : NR;
                    const uint16_t *bp[NR];
                    for (int j = 0; j < NR; j++) bp[j] = Bb + (n + (j < cols ? j : 0)) * b_row + k0; /* edge: repeat row n */
                    for (long m = m0; m < m1; m += MR) {
                        int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                        const uint16_t *ap[MR];
                        for (int i = 0; i < MR; i++) ap[i] = Ab + (m + (i < rows ? i : 0)) * a_row + k0;
                        tile(ap, bp, kc, out);
                        float *c = Cb + m * c_row + n;
                        for (int i = 0; i < rows; i++)
                            for (int j = 0; j < cols; j++)
                                c[i * c_row + j] = k0 == 0 ? out[MR * i + j] : c[i * c_row + j] + out[MR * i + j];
                    }
                }
                k0 += KC;
            } while (k0 < K);
        }
    }
}
