/* GEMMs on AMX tiles, both operands K-contiguous ("NT"):
 *
 *   bf16:  C[b][m][n] = sum_k A[b][m][k] * B[b][n][k]     A, B bf16 (raw uint16 bits), C fp32   (TDPBF16PS)
 *   s8:    Y[m][n]    = sum_k X[m][k] * W[n][k]           X, W int8, Y int32, exact            (TDPBSSD)
 *
 * Blocking: amx_blocks.h's block, 32 x 32 results held in four C tiles over the whole of K. The bf16 GEMM packs its
 * panels itself, one per block of columns, and reuses it for every row block (the panel, 64 bytes x K, stays in L2);
 * the int8 GEMM reads panels packed once per weight by amx_gemm.py (prepare_s8_weight).
 *
 * Numerics are those of the tile instructions (amx_tiles.h): the bf16 GEMM sums exact products in fp32, in the
 * instruction's order (two 16-product fp32 chains per K step, their sum added to the tile), reading bf16 subnormals
 * as zero and flushing fp32 subnormal results to zero; the int8 sums are exact (modulo 2^32). The order does not
 * depend on how the calls are split over threads. Built twice by build.py: with AMX, and portable (GLM5_PORTABLE:
 * the same blocking around amx_tiles.h's scalar tile operations). amx_gemm.py has the Python side.
 */
#include "amx_blocks.h"

/* C[b][m][n] for b in [b_begin, b_end), n in [n_begin, n_end) (n_begin a multiple of NB), every m: one thread's share.
   Strides in elements; A's and B's rows are K-contiguous, C's rows N-contiguous (as bf16_gemm.c's entry point).
   Returns 0, or -1 where the panel's memory could not be allocated (nothing written). */
int glm5_amx_bf16_gemm_nt(long M, long K, const uint16_t *A, long a_batch, long a_row, const uint16_t *B,
                          long b_batch, long b_row, float *C, long c_batch, long c_row, long b_begin, long b_end,
                          long n_begin, long n_end) {
    const long steps = (K + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS);
    uint16_t *panel = malloc(steps > 0 ? (size_t)steps * STEP_BYTES : 1);
    if (!panel) return -1;
    tiles_begin();
    for (long bi = b_begin; bi < b_end; bi++) {
        const uint16_t *Ab = A + bi * a_batch, *Bb = B + bi * b_batch;
        float *Cb = C + bi * c_batch;
        for (long n0 = n_begin; n0 < n_end; n0 += NB) {
            const int cols = n_end - n0 < NB ? (int)(n_end - n0) : NB;
            pack_bf16_panel(Bb + n0 * b_row, b_row, cols, K, steps, panel);
            for (long m0 = 0; m0 < M; m0 += MB) {
                const int rows = M - m0 < MB ? (int)(M - m0) : MB;
                block(OP_BF16, (const uint8_t *)(Ab + m0 * a_row), 2 * a_row, 2 * K, rows, (const uint8_t *)panel,
                      steps, steps, cols, (uint8_t *)(Cb + m0 * c_row + n0), ELEMENT_BYTES * c_row);
            }
        }
    }
    tiles_end();
    free(panel);
    return 0;
}

/* Y[m][n] = the exact int32 sum over k of X[m][k] W[n][k], for n in [n_begin, n_end) (n_begin a multiple of NB), every
   m. X: [M, K] int8 rows x_row bytes apart; P: amx_gemm.py's panels of W (ceil(K / 64) K steps of STEP_BYTES each),
   p_stride bytes apart; Y: int32 rows y_row elements apart. */
void glm5_amx_s8_gemm_nt(long M, long K, const int8_t *X, long x_row, const uint8_t *P, long p_stride, int32_t *Y,
                         long y_row, long n_begin, long n_end) {
    const long steps = (K + TILE_ROW_BYTES - 1) / TILE_ROW_BYTES;
    tiles_begin();
    for (long n0 = n_begin; n0 < n_end; n0 += NB) {
        const int cols = n_end - n0 < NB ? (int)(n_end - n0) : NB;
        for (long m0 = 0; m0 < M; m0 += MB) {
            const int rows = M - m0 < MB ? (int)(M - m0) : MB;
            block(OP_S8, (const uint8_t *)(X + m0 * x_row), x_row, K, rows, P + (n0 / NB) * p_stride, steps, steps, cols,
                  (uint8_t *)(Y + m0 * y_row + n0), ELEMENT_BYTES * y_row);
        }
    }
    tiles_end();
}
