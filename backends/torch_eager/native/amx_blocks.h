/* The block of the AMX kernels (amx_gemm.c, amx_attention.c): MB = 32 rows x NB = 32 columns of a result held in four
 * C tiles (2 x 2) over the whole of K, fed per K step (32 bf16 or 64 int8: one tile row) by two A tiles and two B tiles,
 * four tile products per step. The B side is a panel: the block's 32 columns over all of K in the instructions' pair
 * (quad) layout, a B tile row holding one pair (quad) of K for each of 16 columns, zero past the columns and K. A tiles
 * are loaded from A in place where 16 whole rows and a whole K step are there, else from a zero-padded copy (the
 * edges of M and K); the tile products past the rows and columns are discarded, and no tile is computed whose rows or
 * columns are all padding. A panel may hold fewer K steps than A (`panel_steps`): A's step s then meets the panel's
 * step s mod panel_steps, so an A made of parts side by side along K (sparse attention's probabilities as hi and lo
 * bf16 parts) multiplies one panel once per part, each part's sums added to the same C tiles.
 */
#ifndef GLM5_HAL_AMX_BLOCKS_H
#define GLM5_HAL_AMX_BLOCKS_H
#include <stdlib.h>

#include "amx_tiles.h"

#define MB (2 * TILE_ROWS)    /* rows of the result per block: two A tiles */
#define NB (2 * TILE_COLUMNS) /* columns of the result per block (one panel): two B tiles */
#define TILE_BYTES (TILE_ROWS * TILE_ROW_BYTES)
#define STEP_BYTES (2 * TILE_BYTES) /* one K step of a panel: its two B tiles */
#define ELEMENT_BYTES 4             /* fp32 or int32 results */

enum { OP_BF16, OP_S8 }; /* which tile product a block runs */

/* Tile registers (plain numbers: the instructions encode them, and gcc's intrinsics paste them into the assembly):
   C tile (i, j) of a block is C<i><j>, A tile i is A<i>, B tile j is B<j>. */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7

/* rows x bytes of src (rows `stride` bytes apart) into a zero-padded TILE_ROWS x TILE_ROW_BYTES tile image. */
static inline void stage(const uint8_t *src, long stride, int rows, long bytes, uint8_t dst[TILE_ROWS][TILE_ROW_BYTES]) {
    memset(dst, 0, TILE_BYTES);
    const long width = bytes < TILE_ROW_BYTES ? bytes : TILE_ROW_BYTES;
    for (int r = 0; r < rows; r++) memcpy(dst[r], src + r * stride, width);
}

/* A tile i (register t) of a block at K byte offset k: in place where whole, else staged (the edges of M and K). */
#define LOAD_A(i, t)                                                                                               \
    do {                                                                                                          \
        const int left = rows - TILE_ROWS * (i), tile_rows = left < TILE_ROWS ? left : TILE_ROWS;                 \
        const uint8_t *src = A + (long)TILE_ROWS * (i) * a_row + k;                                                \
        if (tile_rows == TILE_ROWS && k + TILE_ROW_BYTES <= k_bytes) {                                            \
            TILE_LOAD(t, src, a_row);                                                                             \
        } else {                                                                                                  \
            stage(src, a_row, tile_rows, k_bytes - k, staged[i]);                                                  \
            TILE_LOAD(t, staged[i], TILE_ROW_BYTES);                                                              \
        }                                                                                                         \
    } while (0)

#define PRODUCT(c, a, b)                                                                                          \
    do {                                                                                                          \
        if (op == OP_BF16)                                                                                        \
            TILE_DPBF16PS(c, a, b);                                                                               \
        else                                                                                                      \
            TILE_DPBSSD(c, a, b);                                                                                 \
    } while (0)

/* One block: out[r][j] (r < rows <= MB, j < cols <= NB; rows y_row bytes apart) = the sums over K of A's `rows`
   rows (a_row bytes apart, k_bytes of K each: `steps` K steps) with the panel's columns (panel_steps K steps of
   STEP_BYTES, step s of A meeting step s mod panel_steps), in the order of the steps. */
static inline void block(int op, const uint8_t *A, long a_row, long k_bytes, int rows, const uint8_t *panel,
                         long steps, long panel_steps, int cols, uint8_t *out, long y_row) {
    uint8_t staged[2][TILE_ROWS][TILE_ROW_BYTES];
    uint8_t result[MB][NB * ELEMENT_BYTES];
    const int two_rows = rows > TILE_ROWS, two_cols = cols > TILE_COLUMNS;
    TILE_ZERO(C00);
    TILE_ZERO(C01);
    TILE_ZERO(C10);
    TILE_ZERO(C11);
    for (long s = 0; s < steps; s++) {
        const long k = s * TILE_ROW_BYTES;
        const uint8_t *b = panel + (s % panel_steps) * STEP_BYTES;
        TILE_LOAD(B0, b, TILE_ROW_BYTES);
        if (two_cols) TILE_LOAD(B1, b + TILE_BYTES, TILE_ROW_BYTES);
        LOAD_A(0, A0);
        PRODUCT(C00, A0, B0);
        if (two_cols) PRODUCT(C01, A0, B1);
        if (two_rows) {
            LOAD_A(1, A1);
            PRODUCT(C10, A1, B0);
            if (two_cols) PRODUCT(C11, A1, B1);
        }
    }
    const long result_row = NB * ELEMENT_BYTES;
    TILE_STORE(C00, result[0], result_row);
    if (two_cols) TILE_STORE(C01, result[0] + TILE_ROW_BYTES, result_row);
    if (two_rows) {
        TILE_STORE(C10, result[TILE_ROWS], result_row);
        if (two_cols) TILE_STORE(C11, result[TILE_ROWS] + TILE_ROW_BYTES, result_row);
    }
    for (int r = 0; r < rows; r++) memcpy(out + r * y_row, result[r], (size_t)cols * ELEMENT_BYTES);
}

/* Columns [n0, n0 + cols) of B (bf16 rows b_row elements apart, K long) as a panel: for K step s and B tile j, row p
   holds (B[n0 + 16 j + c][32 s + 2 p], B[..][32 s + 2 p + 1]) for c < 16, zero past `cols` and K. */
static inline void pack_bf16_panel(const uint16_t *B, long b_row, int cols, long K, long steps, uint16_t *panel) {
    memset(panel, 0, (size_t)steps * STEP_BYTES);
    const int bf16_per_step = 2 * TILE_ROWS;
    for (int c = 0; c < cols; c++) {
        const uint16_t *row = B + c * b_row;
        uint16_t *column = panel + (c / TILE_COLUMNS) * (TILE_BYTES / 2) + 2 * (c % TILE_COLUMNS);
        for (long k = 0; k < K; k++) {
            const long s = k / bf16_per_step, p = (k % bf16_per_step) / 2;
            column[s * (STEP_BYTES / 2) + p * (TILE_ROW_BYTES / 2) + k % 2] = row[k];
        }
    }
}

/* The B side of products with every head's q as a column: q [heads][dims] bf16 (head h at q + h * q_head, its dims
   contiguous) as one panel per block of NB heads (pack_bf16_panel), `steps` K steps of 2 * TILE_ROWS dims each,
   block b at panels + b * steps * STEP_BYTES / 2. */
static inline void pack_head_panels(const uint16_t *q, long q_head, long heads, long dims, long steps,
                                    uint16_t *panels) {
    for (long h0 = 0; h0 < heads; h0 += NB)
        pack_bf16_panel(q + h0 * q_head, q_head, heads - h0 < NB ? (int)(heads - h0) : NB, dims, steps,
                        panels + (h0 / NB) * steps * (STEP_BYTES / 2));
}
#endif
