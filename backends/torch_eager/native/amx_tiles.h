/* AMX tile operations, written once for every AMX kernel: the real instructions (built with -mamx-tile -mamx-bf16
 * -mamx-int8), or, with GLM5_PORTABLE or GLM5_EMULATE_TILES, scalar C that does each tile instruction's arithmetic in
 * the order the Intel SDM's pseudocode gives, so the portable build checks a kernel's blocking, staging and padding
 * on any CPU (and the amx_emulated build, AVX-512 around emulated tiles, the AMX build's vector code).
 *
 * Tiles. Eight tile registers, each configured here as TILE_ROWS rows of TILE_ROW_BYTES bytes (palette 1; the
 * configuration is per thread, so every kernel entry point calls tiles_begin() first and tiles_end() last).
 *   - TDPBF16PS c, a, b: c [16][16] fp32 += a [16 rows][16 bf16 pairs] . b [16 pairs][16 columns][2 bf16].
 *     As the SDM's pseudocode reads: for each output, the even elements of the pairs and the odd ones are summed
 *     in two fp32 accumulators that start at 0 (each step an FMA: the bf16 x bf16 product is exact, then one
 *     rounding, to nearest even), then even + odd is rounded once and added to c. bf16 subnormal inputs are read as
 *     zero (DAZ) and subnormal results are flushed to zero (FTZ); MXCSR is not consulted.
 *   - TDPBSSD c, a, b: c [16][16] int32 += the four s8 x s8 products of a's and b's dword (wrapping modulo 2^32:
 *     exact while the true sum fits int32).
 * The scalar branch rounds a product that underflows fp32 (|a b| < 2^-126) before the add where the FMA does not:
 * the two can differ there, below 1.2e-38, and nowhere else.
 *
 * The tile state. Linux gives a process the AMX register file only on request (arch_prctl ARCH_REQ_XCOMP_PERM, Linux
 * >= 5.16); a tile instruction before it kills the process with SIGILL. glm5_amx_init() asks, and amx_tiles.py calls
 * it once per library before any kernel runs (the portable build has nothing to ask for).
 */
#ifndef GLM5_HAL_AMX_TILES_H
#define GLM5_HAL_AMX_TILES_H
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define TILE_ROWS 16      /* rows of every tile */
#define TILE_ROW_BYTES 64 /* bytes of every tile row: 16 fp32 / int32, 32 bf16, 64 int8 */
#define TILE_COLUMNS 16   /* fp32 / int32 outputs per C-tile row, and pairs (quads) per A-tile row */
#define TILE_REGISTERS 8

#if !defined(GLM5_PORTABLE) && !defined(GLM5_EMULATE_TILES)
#include <errno.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* asm/prctl.h, not in every libc's headers */
#define XFEATURE_XTILEDATA 18

/* 0 once the process may use the tile registers, else the errno of the refusal (EINVAL: the CPU or Linux < 5.16
   lacks AMX; ENOSPC / EPERM: the signal stack or a policy does not allow it). Idempotent. */
int glm5_amx_init(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return errno ? errno : -1;
    return 0;
}

/* LDTILECFG's 64-byte operand: palette 1, every tile TILE_ROWS x TILE_ROW_BYTES. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void tiles_begin(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < TILE_REGISTERS; t++) {
        config.colsb[t] = TILE_ROW_BYTES;
        config.rows[t] = TILE_ROWS;
    }
    _tile_loadconfig(&config);
}

static inline void tiles_end(void) { _tile_release(); }

/* The tile numbers must be constants (they are encoded in the instruction); strides are in bytes. */
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

#else /* GLM5_PORTABLE, GLM5_EMULATE_TILES: the tile registers are this thread's memory, the instructions
         scalar loops */
#include <float.h>
#include <math.h>

int glm5_amx_init(void) { return 0; }

static __thread uint8_t tmm[TILE_REGISTERS][TILE_ROWS][TILE_ROW_BYTES];

static inline void tiles_begin(void) {}
static inline void tiles_end(void) {}

static inline void tile_zero(int t) { memset(tmm[t], 0, sizeof tmm[t]); }

static inline void tile_load(int t, const void *base, long stride) {
    for (int r = 0; r < TILE_ROWS; r++) memcpy(tmm[t][r], (const uint8_t *)base + r * stride, TILE_ROW_BYTES);
}

static inline void tile_store(int t, void *base, long stride) {
    for (int r = 0; r < TILE_ROWS; r++) memcpy((uint8_t *)base + r * stride, tmm[t][r], TILE_ROW_BYTES);
}

/* A subnormal as a zero of its sign: DAZ on inputs, FTZ on results. */
static inline float flush_subnormal(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

static inline float tile_bf16(int t, int row, int element) {
    uint16_t bits;
    memcpy(&bits, &tmm[t][row][2 * element], sizeof bits);
    return flush_subnormal(bf16_to_float(bits));
}

static inline void tile_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < TILE_ROWS; m++)
        for (int n = 0; n < TILE_COLUMNS; n++) {
            float even = 0.0f, odd = 0.0f; /* the two accumulators of the pseudocode's temp1 */
            for (int k = 0; k < TILE_COLUMNS; k++) {
                even = flush_subnormal(even + tile_bf16(a, m, 2 * k) * tile_bf16(b, k, 2 * n));
                odd = flush_subnormal(odd + tile_bf16(a, m, 2 * k + 1) * tile_bf16(b, k, 2 * n + 1));
            }
            float acc;
            memcpy(&acc, &tmm[c][m][4 * n], sizeof acc);
            acc = flush_subnormal(acc + flush_subnormal(even + odd));
            memcpy(&tmm[c][m][4 * n], &acc, sizeof acc);
        }
}

static inline void tile_dpbssd(int c, int a, int b) {
    for (int m = 0; m < TILE_ROWS; m++)
        for (int n = 0; n < TILE_COLUMNS; n++) {
            uint32_t acc; /* unsigned: wraps modulo 2^32 as the tile's int32 lanes do */
            memcpy(&acc, &tmm[c][m][4 * n], sizeof acc);
            for (int k = 0; k < TILE_COLUMNS; k++)
                for (int i = 0; i < 4; i++)
                    acc += (uint32_t)((int32_t)(int8_t)tmm[a][m][4 * k + i] * (int8_t)tmm[b][k][4 * n + i]);
            memcpy(&tmm[c][m][4 * n], &acc, sizeof acc);
        }
}

#define TILE_ZERO(t) tile_zero(t)
#define TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) tile_store(t, base, stride)
#define TILE_DPBF16PS(c, a, b) tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) tile_dpbssd(c, a, b)
#endif
#endif
