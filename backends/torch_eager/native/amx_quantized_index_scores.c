/* The indexer's scores over quantized index rows (fp8_index, int8_index) with the bf16 route's dots on AMX tiles:
 * quantized_index_scores.c built with GLM5_AMX_DOTS (its top says what changes), so the decode, the guards that keep
 * a token or chunk on the bf16 route, the fp32 route and both entry points are that file's. Built with AMX, portable
 * (the tile operations in scalar C, amx_tiles.h: the blocking checked on any CPU) and amx_emulated (the AMX build's
 * AVX-512 code around scalar tile operations: checked on any AVX-512 BF16 CPU). The Python side is
 * quantized_index_scores.py (its AMX kernel).
 */
#define GLM5_AMX_DOTS 1
#include "amx_blocks.h"
#include "head_sums.h"
#include "quantized_index_scores.c"
