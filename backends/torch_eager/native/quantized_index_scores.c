/* The lightning indexer's scores straight from a paged cache of quantized index rows (glm5_hal.kv_formats
 * "fp8_index" and "int8_index": D codes, then one little-endian fp32 scale; vLLM's 132-byte DeepSeek-V3.2 rows), on
 * CPUs:
 *
 *   score[t][s] = sum_h w[t][h] * relu(sum_d q[t][h][d] * key_t(s)[d])     for s < limit[t], else -inf
 *   key_t(s)[d] = value(code[d]) * scale     (the row cache[table[t][s / block_size]][s % block_size])
 *
 * value(code) is the code's exact fp32 value (e4m3fn, NaN for 0x7F and 0xFF; or int8), so each key element is the
 * exact product rounded once to fp32: bit for bit kv_formats.decode_rows, whatever MXCSR's DAZ says (no
 * intermediate here is subnormal). The products and every sum are fp32, as in the fp32 path, in another order; relu
 * keeps NaN (max(0, x) returns x when x is NaN); heads past H contribute nothing (their dots are never added).
 *
 * Keys are decoded a chunk at a time into a per-thread fp32 workspace, and the next token reuses the decoded chunk
 * where its block table names the same blocks (the tokens of one sequence at prefill), so a prefill decodes each
 * key once per chunk of tokens, not once per token. The dot products run along D: a tile is 2 keys x 4 heads of
 * 8-lane accumulators, the keys' lanes loaded once per 8 dims for the 4 heads, the queries streamed from L1. A
 * layout with heads in the lanes (indexer_scores.c) pads 4 heads to 8 or 16 lanes; here the work per key is
 * D x ceil(H / 4) x 4 multiply-adds, whatever H. Built with AVX2 + FMA + F16C (the AVX-512 and AMX builds compile the
 * same 256-bit code: every such CPU has FMA and F16C) and portable (scalar loops with the same blocking and per-lane sums, each
 * product rounded before it is added where the vector code fuses the two).
 *
 * bf16 queries over e4m3 codes (the vLLM plugin's indexer: its queries are bf16), in the AVX-512 BF16 build and the
 * portable one: the codes of a chunk are decoded to their exact values as bf16 (every e4m3 value is one; a 128-entry
 * table, VPERMI2W), the scale kept aside, and each dot is VDPBF16PS over exact bf16 products with fp32 sums, times
 * the key's scale once:
 *
 *   dot(t, s, h) = (sum_d q[t][h][d] * value(code[d])) * scale     instead of   sum_d q[t][h][d] * (value(code[d]) * scale)
 *
 * so a key element is not rounded to fp32 before its product: each term differs from the fp32 route's by at most
 * that rounding (2^-24 of it), and the sum is fp32 as before. About a third of the instructions per key of the fp32
 * route (no fp32 decode, 32 products a VDPBF16PS). VDPBF16PS reads subnormal inputs as 0 and flushes subnormal
 * sums, so a token takes this route only where nothing subnormal can occur: every q element is finite, exactly a
 * bf16 (the op's bf16 q widened) and 0 or at least 2^-110 in magnitude (then every product, and every nonzero sum of
 * them, is a multiple of 2^-126: a normal number), and a chunk only where every key's scale is finite and at most
 * FLT_MAX / 448 (value * scale cannot overflow, as the fp32 route's keys cannot). Other tokens and chunks take the
 * fp32 route. A token alone with its keys (a decode step: no other token of the share reads its blocks) with at
 * most 4 heads skips the workspace on either route: its tiles decode each key's codes in registers on the way
 * (lone_token_chunk, lone_token_chunk_fp32; the same values in the same order, so the same bits) while the next
 * chunk's rows are prefetched. The portable build runs the same routes in scalar code (lane sums in VDPBF16PS's
 * order), so the choice between the routes is tested on every CPU.
 *
 * amx_quantized_index_scores.c builds this file with GLM5_AMX_DOTS (the AMX build, its portable and amx_emulated
 * ones): the bf16 route's dots then run on AMX tiles (amx_chunk_scores: the chunk's decoded values as the A side, read
 * in place, against q as panels of 32 heads), each key's dots times its scale, then the weighted ReLU; TDPBF16PS
 * reads subnormals as zero and flushes subnormal sums as VDPBF16PS does, so the same guards keep a token or chunk on
 * it. Every bf16 token goes through the decoded chunk there (no lone-token path: its bits are the same beside a token
 * of its sequence); the fp32 route is this file's.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "paged_tokens.h"
#include "row_prefetch.h"

#if !defined(GLM5_PORTABLE) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#if !defined(__FMA__) || !defined(__F16C__)
#pragma GCC target("avx2,fma,f16c") /* the AVX-512 builds: every CPU with AVX-512F has AVX2, FMA3 and F16C */
#endif
#include <immintrin.h>
#define VECTORS 1
#endif

#define CHUNK 256 /* key positions decoded at a time: 128 KiB of fp32 keys at D = 128, in L2 across tokens */
#if defined(GLM5_PORTABLE) || (defined(VECTORS) && defined(__AVX512BF16__) && defined(__AVX512BW__))
#define BF16_DOTS 1   /* the bf16 route (top of the file) */
#define BF16_KEYS 4   /* keys per bf16 tile: 4 keys x 4 heads of 16-lane accumulators */
#define BF16_LANES 16 /* fp32 lanes per accumulator, each summing a pair of dims per 32 */
#define BF16_MAX_DIMS 1024 /* the widest rows a lone token's tiles decode on the way (wider: decoded per chunk) */
#define MIN_Q_EXPONENT 17 /* a q element's bf16 exponent field: |q| >= 2^(17 - 127) = 2^-110 (or q = 0) */
#endif
#define HEADS 4   /* heads per tile (q is padded to a multiple of it with zero heads, never added) */
#define LANES 8   /* dims per accumulator */
#define LONE_MAX_DIMS 1024 /* the widest rows a lone token's fp32 tiles decode on the way (wider: decoded per chunk) */

enum { CODE_E4M3 = 0, CODE_INT8 = 1 };

/* The exact value of an e4m3fn code: 2^(e - 7) (1 + m / 8), m 2^-9 for e = 0, NaN for the magnitude 0x7F. */
static inline float e4m3_value(uint8_t code) {
    int magnitude = code & 0x7F;
    float value;
    if (magnitude == 0x7F)
        value = NAN;
    else if (magnitude >= 8)
        value = ldexpf((float)(8 + (magnitude & 7)), (magnitude >> 3) - 10);
    else
        value = ldexpf((float)magnitude, -9);
    return code & 0x80 ? -value : value;
}

#if defined(VECTORS)
/* A row's scale as decode16 multiplies by it. e4m3 values come out of fp16 as value / 256 (decode16), and value x
   scale = (value / 256) x (256 scale) exactly: where 256 scale is finite (|scale| <= FLT_MAX / 256; a power of two
   times a float is exact short of overflow) one multiply by it gives the same rounding of the same product as x 256
   then x scale, so the row costs one multiply a lane instead of two. Where it would overflow, the two multiplies. */
struct row_scale {
    __m256 lanes; /* 256 scale where `folded`, else scale, in every lane */
    int folded;
};

static inline struct row_scale row_scale_of(float scale, int code) {
    struct row_scale s;
    s.folded = code == CODE_E4M3 && fabsf(scale) <= FLT_MAX / 256.0f;
    s.lanes = _mm256_set1_ps(s.folded ? scale * 256.0f : scale);
    return s;
}

/* value(codes[i]) * scale for the 16 codes at `codes`: dims 0-7 in *low, 8-15 in *high, each value exact and then
   rounded once by the scale. e4m3 through fp16: a code's magnitude bits shifted left by 7 are an fp16 of the same
   exponent and mantissa bits, whose value is the code's / 256 for normal (e >= 1) and subnormal (e = 0) codes alike
   (fp16's exponent bias is 8 more, its subnormals 2^-24 a step against e4m3's 2^-9 for 7 more mantissa bits);
   magnitude 0x7F gets fp16's all-ones exponent (NaN). F16C widens fp16 exactly, subnormals included (its input is
   not an fp32 operand, so DAZ does not apply), and x 256 is exact (row_scale). ~40% fewer operations per code than
   the fp32 bit assembly in decode_row. */
static inline void decode16(const uint8_t *codes, int code, const struct row_scale *scale, __m256 *low, __m256 *high) {
    if (code == CODE_E4M3) {
        const __m256i low7 = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16((short)0x8000);
        const __m256i nan = _mm256_set1_epi16(0x7C00);
        const __m256 unscale = _mm256_set1_ps(256.0f);
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
        __m256i magnitude = _mm256_and_si256(x, low7);
        __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7), _mm256_and_si256(_mm256_slli_epi16(x, 8), sign));
        half = _mm256_or_si256(half, _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, low7), nan));
        __m256 low_half = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
        __m256 high_half = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
        if (!scale->folded) low_half = _mm256_mul_ps(low_half, unscale), high_half = _mm256_mul_ps(high_half, unscale);
        *low = _mm256_mul_ps(low_half, scale->lanes);
        *high = _mm256_mul_ps(high_half, scale->lanes);
    } else {
        __m128i x = _mm_loadu_si128((const __m128i *)codes);
        *low = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), scale->lanes);
        *high = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8))), scale->lanes);
    }
}
#endif

/* out[d] = value(row[d]) * scale for d < dims, the scale stored right after the dims codes. */
static void decode_row(const uint8_t *row, long dims, int code, float *out) {
    float scale;
    memcpy(&scale, row + dims, sizeof scale);
    long d = 0;
#if defined(VECTORS)
    const __m256 scales = _mm256_set1_ps(scale);
    const struct row_scale row_scale = row_scale_of(scale, code);
    for (; d + 2 * LANES <= dims; d += 2 * LANES) {
        __m256 low, high;
        decode16(row + d, code, &row_scale, &low, &high);
        _mm256_storeu_ps(out + d, low);
        _mm256_storeu_ps(out + d + LANES, high);
    }
    if (code == CODE_E4M3) {
        const __m256i low7 = _mm256_set1_epi32(0x7F), eight = _mm256_set1_epi32(8);
        const __m256i bias = _mm256_set1_epi32(120 << 23), sign = _mm256_set1_epi32((int)0x80000000u);
        const __m256 step = _mm256_set1_ps(0x1p-9f), nan = _mm256_set1_ps(NAN);
        for (; d + LANES <= dims; d += LANES) { /* the last 8 codes of a row of 8 mod 16 */
            __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
            __m256i magnitude = _mm256_and_si256(x, low7);
            /* e >= 1: the code's exponent and mantissa bits moved into an fp32, the exponent rebased by 127 - 7;
               e = 0: m 2^-9 from the integer m (an exact normal fp32; no subnormal, so DAZ cannot change it). */
            __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), bias));
            __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), step);
            __m256 value = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, magnitude)));
            value = _mm256_blendv_ps(value, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, low7)));
            value = _mm256_or_ps(value, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 24), sign)));
            _mm256_storeu_ps(out + d, _mm256_mul_ps(value, scales));
        }
    } else {
        for (; d + LANES <= dims; d += LANES) {
            __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
            _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtepi32_ps(x), scales));
        }
    }
#endif
    for (; d < dims; d++) out[d] = (code == CODE_E4M3 ? e4m3_value(row[d]) : (float)(int8_t)row[d]) * scale;
}

/* partial[4 j + i] += w[i] relu(q_i . key_j) for the two keys j and the heads h0 + i < heads (i < HEADS; live =
   heads - h0); q: [HEADS][dims] fp32 from head h0, w: HEADS weights from head h0. The keys: key0, key1 [dims] fp32
   (decoded), or, where `rows` is given, the quantized rows rows[0], rows[1] (their codes, then the scale) decoded in
   registers on the way: the same values (decode_row's), so the same bits; dims then a multiple of 16 and at most
   LONE_MAX_DIMS. Per lane l of a dot, the dims d = l mod 8 in order; the 8 lanes summed as ((0 + 1) + (2 + 3)) +
   ((4 + 5) + (6 + 7)); dims past the last multiple of 8 added after, in order. relu keeps NaN; a padding head's lane
   adds nothing, whatever its dot (0 x inf is NaN). No branch on a dot's sign: with random signs a branch per dot
   cost more than the products. Inlined, so each call site compiles the loop for its kind of keys. */
static inline __attribute__((always_inline)) void tile(const float *key0, const float *key1,
                                                       const uint8_t *const *rows, int code, const float *q,
                                                       const float *w, long dims, long live, float partial[2 * HEADS]) {
    long vector_dims = dims / LANES * LANES;
    float dots[2 * HEADS];
#if defined(VECTORS)
    __m256 acc[2][HEADS];
    for (int j = 0; j < 2; j++)
        for (int h = 0; h < HEADS; h++) acc[j][h] = _mm256_setzero_ps();
    if (rows) {
        struct row_scale scale[2];
        for (int j = 0; j < 2; j++) {
            float value;
            memcpy(&value, rows[j] + dims, sizeof value);
            scale[j] = row_scale_of(value, code);
        }
        for (long d = 0; d < dims; d += 2 * LANES) {
            __m256 k0[2], k1[2];
            decode16(rows[0] + d, code, &scale[0], &k0[0], &k0[1]);
            decode16(rows[1] + d, code, &scale[1], &k1[0], &k1[1]);
            for (int half = 0; half < 2; half++)
                for (int h = 0; h < HEADS; h++) {
                    __m256 qh = _mm256_loadu_ps(q + h * dims + d + half * LANES);
                    acc[0][h] = _mm256_fmadd_ps(qh, k0[half], acc[0][h]);
                    acc[1][h] = _mm256_fmadd_ps(qh, k1[half], acc[1][h]);
                }
        }
    } else {
        for (long d = 0; d < vector_dims; d += LANES) {
            __m256 k0 = _mm256_loadu_ps(key0 + d), k1 = _mm256_loadu_ps(key1 + d);
            for (int h = 0; h < HEADS; h++) {
                __m256 qh = _mm256_loadu_ps(q + h * dims + d);
                acc[0][h] = _mm256_fmadd_ps(qh, k0, acc[0][h]);
                acc[1][h] = _mm256_fmadd_ps(qh, k1, acc[1][h]);
            }
        }
    }
    /* the 8 dots' lane sums at once: lane 4 j + h of `both` is dot (j, h) */
    __m256 pairs0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[0][1]), _mm256_hadd_ps(acc[0][2], acc[0][3]));
    __m256 pairs1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[1][0], acc[1][1]), _mm256_hadd_ps(acc[1][2], acc[1][3]));
    __m256 both = _mm256_add_ps(_mm256_permute2f128_ps(pairs0, pairs1, 0x20), _mm256_permute2f128_ps(pairs0, pairs1, 0x31));
    if (vector_dims < dims) { /* D not a multiple of 8 (never at D = 128; never with rows) */
        _mm256_storeu_ps(dots, both);
        for (int i = 0; i < 2 * HEADS; i++)
            for (long d = vector_dims; d < dims; d++) dots[i] += q[(i % HEADS) * dims + d] * (i < HEADS ? key0 : key1)[d];
        both = _mm256_loadu_ps(dots);
    }
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    __m256 alive = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(live < HEADS ? live : HEADS)), _CMP_LT_OQ);
    __m128 w4 = _mm_loadu_ps(w);
    __m256 weights = _mm256_insertf128_ps(_mm256_castps128_ps256(w4), w4, 1);
    __m256 terms = _mm256_mul_ps(weights, _mm256_max_ps(_mm256_setzero_ps(), both)); /* max(0, NaN) is NaN */
    _mm256_storeu_ps(partial, _mm256_add_ps(_mm256_loadu_ps(partial), _mm256_and_ps(alive, terms)));
#else
    float decoded[2 * LONE_MAX_DIMS];
    if (rows) { /* the rows decoded first: the same values */
        decode_row(rows[0], dims, code, decoded);
        decode_row(rows[1], dims, code, decoded + dims);
        key0 = decoded, key1 = decoded + dims;
    }
    for (int i = 0; i < 2 * HEADS; i++) {
        const float *key = i < HEADS ? key0 : key1, *qh = q + (i % HEADS) * dims;
        float lanes[LANES] = {0};
        for (long d = 0; d < vector_dims; d++) lanes[d % LANES] += qh[d] * key[d];
        dots[i] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (long d = vector_dims; d < dims; d++) dots[i] += qh[d] * key[d];
        float dot = dots[i];
        if (i % HEADS < live) partial[i] += w[i % HEADS] * (dot > 0.0f || dot != dot ? dot : 0.0f);
    }
#endif
}

#if defined(BF16_DOTS)
/* value(m) as bf16 bits for the e4m3 magnitudes m = 0 .. 127 (exact; NaN 0x7FC0 for 0x7F): the decode table. */
static void e4m3_bf16_table(uint16_t table[128]) {
    for (int m = 0; m < 128; m++) {
        float value = e4m3_value((uint8_t)m);
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        table[m] = (uint16_t)(bits >> 16); /* the low half is 0: value(m) has at most 4 significant bits */
    }
}

#if !defined(GLM5_PORTABLE)
/* The decode table in registers: magnitudes 0-63 in (t0, t1), 64-127 in (t2, t3). */
struct e4m3_decoder {
    __m512i t0, t1, t2, t3;
};

static inline struct e4m3_decoder decoder_of(const uint16_t table[128]) {
    struct e4m3_decoder dec = {_mm512_loadu_si512(table), _mm512_loadu_si512(table + 32),
                               _mm512_loadu_si512(table + 64), _mm512_loadu_si512(table + 96)};
    return dec;
}

/* value(codes[i]) as bf16 for the 32 codes at `codes` (those past `live` read as 0: value +0). */
static inline __m512i decode32(const struct e4m3_decoder *dec, const uint8_t *codes, __mmask32 live) {
    __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, codes));
    /* VPERMI2W reads the low 6 bits of each index: the code's bit 6 picks the pair of tables */
    __m512i low = _mm512_permutex2var_epi16(dec->t0, x, dec->t1), high = _mm512_permutex2var_epi16(dec->t2, x, dec->t3);
    __m512i value = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), low, high);
    /* value | (code << 8 & sign) */
    return _mm512_ternarylogic_epi32(value, _mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

static inline __mmask32 live_dims(long dims, long d) {
    return dims - d >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (dims - d)) - 1u);
}
#endif

/* out[d] = value(row[d]) as bf16 for d < dims (the sign is the code's top bit); returns the row's scale, stored
   right after the codes. */
static float decode_row_bf16(const uint8_t *row, long dims, const uint16_t table[128], uint16_t *out) {
    float scale;
    memcpy(&scale, row + dims, sizeof scale);
    long d = 0;
#if !defined(GLM5_PORTABLE)
    const struct e4m3_decoder dec = decoder_of(table);
    for (; d < dims; d += 32) {
        __mmask32 live = live_dims(dims, d);
        _mm512_mask_storeu_epi16(out + d, live, decode32(&dec, row + d, live));
    }
#endif
    for (; d < dims; d++) out[d] = (uint16_t)(table[row[d] & 0x7F] | (row[d] & 0x80) << 8);
    return scale;
}

/* Whether a scale keeps a chunk on the bf16 route: finite and value * scale cannot overflow (|value| <= 448). */
static inline int bf16_scale_ok(float scale) { return fabsf(scale) <= FLT_MAX / 448.0f; }

/* qb [hp][dims] bf16 = token t's q [hp][dims] fp32 if every element can take the bf16 route (the top of the file:
   finite, exactly a bf16, 0 or |q| >= 2^-110); returns whether it can. */
static int bf16_query(const float *q, long n, uint16_t *qb) {
    for (long i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &q[i], sizeof bits);
        uint32_t exponent = (bits >> 23) & 0xFF;
        if ((bits & 0xFFFF) || exponent == 0xFF || (exponent < MIN_Q_EXPONENT && (bits & 0x7FFFFFFF))) return 0;
        qb[i] = (uint16_t)(bits >> 16);
    }
    return 1;
}

/* partial[4 j + i] += w[i] relu(dot(j, i)), dot(j, i) = (q_i . value(key_j)) * scales[j], for the keys j < n_keys
   (BF16_KEYS at most; the other entries get garbage) and the heads h0 + i < heads (i < HEADS; live = heads - h0);
   q: [HEADS][dims] bf16 from head h0, w: HEADS weights from head h0. The keys: `keys` [n_keys][dims] bf16 values
   (decoded), or, where `codes` is given, key j's codes at codes[j] decoded in registers on the way (the same values,
   so the same bits). Per lane l of a dot: the dim pairs (32 p + 2 l, 32 p + 2 l + 1) in order p, each pair added odd
   dim first (VDPBF16PS's order); the 16 lanes summed by the tree below, the same in both builds. relu keeps NaN; no
   branch on a dot's sign (as in tile: with random signs the branches cost more than the decode and the products
   together). */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *keys, const uint8_t *const *codes,
                                                            const uint16_t table[128], int n_keys, const float *scales,
                                                            const uint16_t *q, const float *w, long dims, long live,
                                                            float partial[BF16_KEYS * HEADS]) {
#if !defined(GLM5_PORTABLE)
    struct e4m3_decoder dec;
    if (codes) dec = decoder_of(table);
    __m512 acc[BF16_KEYS][HEADS];
    for (int j = 0; j < BF16_KEYS; j++)
        for (int h = 0; h < HEADS; h++) acc[j][h] = _mm512_setzero_ps();
    const uint16_t *key[BF16_KEYS];
    for (int j = 0; j < BF16_KEYS; j++) key[j] = keys + (j < n_keys ? j : 0) * dims; /* spare keys: a real one */
    for (long d = 0; d < dims; d += 32) {
        __mmask32 live = live_dims(dims, d);
        __m512bh qv[HEADS];
        for (int h = 0; h < HEADS; h++) qv[h] = (__m512bh)_mm512_maskz_loadu_epi16(live, q + h * dims + d);
        for (int j = 0; j < BF16_KEYS; j++) {
            __m512bh kv = codes ? (__m512bh)decode32(&dec, codes[j < n_keys ? j : 0] + d, live)
                                : (__m512bh)_mm512_maskz_loadu_epi16(live, key[j] + d);
            for (int h = 0; h < HEADS; h++) acc[j][h] = _mm512_dpbf16_ps(acc[j][h], qv[h], kv);
        }
    }
    /* Lane sums of the 16 accumulators at once: per key, within each 128-bit quarter, lanes (0 + 2) + (1 + 3) of
       every head side by side; then the quarters (0 + 2) + (1 + 3) across keys. Lane 4 j + i of `sums` is dot (j, i). */
    __m512 quarters[BF16_KEYS];
    for (int j = 0; j < BF16_KEYS; j++) {
        __m512 h01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[j][0], acc[j][1]), _mm512_unpackhi_ps(acc[j][0], acc[j][1]));
        __m512 h23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[j][2], acc[j][3]), _mm512_unpackhi_ps(acc[j][2], acc[j][3]));
        quarters[j] = _mm512_add_ps(_mm512_shuffle_ps(h01, h23, 0x44), _mm512_shuffle_ps(h01, h23, 0xEE));
    }
    __m512 k01 = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[0], quarters[1], 0x44),
                               _mm512_shuffle_f32x4(quarters[0], quarters[1], 0xEE));
    __m512 k23 = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[2], quarters[3], 0x44),
                               _mm512_shuffle_f32x4(quarters[2], quarters[3], 0xEE));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(k01, k23, 0x88), _mm512_shuffle_f32x4(k01, k23, 0xDD));
    const __m512i key_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 scale = _mm512_permutexvar_ps(key_of_lane, _mm512_castps128_ps512(_mm_loadu_ps(scales)));
    const __m512 head_of_lane = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    __mmask16 alive = _mm512_cmp_ps_mask(head_of_lane, _mm512_set1_ps((float)(live < HEADS ? live : HEADS)), _CMP_LT_OQ);
    __m512 weights = _mm512_broadcast_f32x4(_mm_loadu_ps(w));
    __m512 terms = _mm512_mul_ps(weights, _mm512_max_ps(_mm512_setzero_ps(), _mm512_mul_ps(sums, scale)));
    __m512 sum = _mm512_loadu_ps(partial);
    _mm512_storeu_ps(partial, _mm512_mask_add_ps(sum, alive, sum, terms)); /* max(0, NaN) is NaN */
#else
    uint16_t decoded[BF16_KEYS * BF16_MAX_DIMS];
    if (codes) { /* the codes decoded first: the same values */
        for (int j = 0; j < n_keys; j++) decode_row_bf16(codes[j], dims, table, decoded + j * dims);
        keys = decoded;
    }
    for (int j = 0; j < n_keys; j++)
        for (int h = 0; h < HEADS; h++) {
            float lanes[BF16_LANES] = {0.0f};
            for (long d = 0; d < dims; d += 2) { /* dims d, d + 1 into lane (d / 2) mod 16: the odd one first */
                float *lane = &lanes[(d / 2) % BF16_LANES];
                if (d + 1 < dims) *lane += bf16_to_float(q[h * dims + d + 1]) * bf16_to_float(keys[j * dims + d + 1]);
                *lane += bf16_to_float(q[h * dims + d]) * bf16_to_float(keys[j * dims + d]);
            }
            float quarter[4]; /* the vector build's tree: (0 + 2) + (1 + 3) within each quarter, then the quarters */
            for (int c = 0; c < 4; c++)
                quarter[c] = (lanes[4 * c] + lanes[4 * c + 2]) + (lanes[4 * c + 1] + lanes[4 * c + 3]);
            float dot = ((quarter[0] + quarter[2]) + (quarter[1] + quarter[3])) * scales[j];
            if (h < live) partial[4 * j + h] += w[h] * (dot > 0.0f || dot != dot ? dot : 0.0f);
        }
#endif
}
#endif

/* Key positions walked in order without a division per row (one where a walk starts): the block table entry and
   the offset in the block move along with the position. The bf16 route over 16K keys in cache (one token, 4 heads,
   Zen 4) took 0.37 -> 0.35 ms so; with the decode and dots knocked out, the divisions alone were 0.10 ms. */
struct row_cursor {
    long position, block, offset; /* key position `position` lies at `offset` in the block tt[block] */
};

static inline struct row_cursor cursor_at(long position, long block_size) {
    struct row_cursor c = {position, position / block_size, position % block_size};
    return c;
}

/* The cursor's row, and the cursor moved to the next position. */
static inline const uint8_t *next_row(struct row_cursor *c, const uint8_t *cache, long block_stride, long row_stride,
                                      long block_size, const int32_t *tt) {
    const uint8_t *row = cache + (long)tt[c->block] * block_stride + c->offset * row_stride;
    c->position++;
    if (++c->offset == block_size) c->block++, c->offset = 0;
    return row;
}

/* The bf16 route and a lone token's fp32 tiles ask for the next chunk's rows to be brought in while this chunk's
   dots run: a chunk's decode reads its rows from memory and the dots that follow leave memory idle. A cursor walks
   the next chunk's positions, a row per key of a tile, each row's lines asked for with the entry point's
   `row_prefetch` hint (row_prefetch.h), which the torch backend's probe measures here. A lone fp32 token (AVX2 build,
   one token, 4 heads, in-process A/B, Zen 4): into L2 against no prefetch, 16K keys 0.66 -> 0.57 ms and 32K 1.54 ->
   1.39 ms out of the LLC, 0.43 -> 0.44 and 1.17 -> 1.24 ms in cache; a decode reads its keys from memory inside an
   engine, so it prefetches. The fp32 route through the workspace (prefill) measured 1.1x out of the LLC but 4-7%
   slower in cache, and does not. A prefetch never faults, so a table entry that names no block costs nothing. Which
   hint: on the Zen 4 inside vLLM (glm5-mini dims, 32K context, the bf16 route) non-temporal against into L2 gave
   1.02-1.08x the decode rate in 4 rounds of 5 (0.97x in one), the kernel alone within 2% either way; on a Zen 5
   (family 26, in-process A/B, median of 120 alternating calls, 1 thread, one token over fp8_index rows from memory)
   into L2 was the slowest: bf16 route (AVX-512 BF16 build) 4 heads over 16K / 64K keys 1.20x / 1.34x the time of
   the non-temporal hint, 32 heads 1.11-1.12x, into L1 within 1% of non-temporal, no prefetch 1.6-3.4x; the AVX2
   build's lone fp32 token (4 heads) 1.06x / 1.13x; without the flush all within 3% at 16K keys, and at 64K (8.6 MB
   of rows, in L3) into L2 1.02-1.09x, no prefetch 1.11-1.63x (2026-11-30). So the hint is the CPU's;
   where nothing measured it (quantized_index_scores.py's DEFAULT_PREFETCH) it is non-temporal: each row is read once
   per call, and a call at 32K keys streams 4.3 MB of them, which into L2 may displace what the rest of the decode
   step reads again. */
static inline __attribute__((always_inline)) void prefetch_rows(struct row_cursor *c, long rows, long end,
                                                                 const uint8_t *cache, long block_stride,
                                                                 long row_stride, long row_bytes, long block_size,
                                                                 const int32_t *tt, int hint) {
    for (long i = 0; i < rows && c->position < end; i++) {
        const uint8_t *row = next_row(c, cache, block_stride, row_stride, block_size, tt);
        prefetch_lines(row, row_bytes, hint);
        prefetch_lines(row + row_bytes - 1, 1, hint); /* a row's last line, where it starts mid-line */
    }
}

/* Blocks of the table that key positions c0 .. c0 + n - 1 lie in. */
static inline long blocks_spanned(long c0, long n, long block_size) {
    return n > 0 ? (c0 + n - 1) / block_size - c0 / block_size + 1 : 0;
}

#if defined(BF16_DOTS)
/* st[c0 + k] for k < n: the bf16 route's scores of one token over keys c0 .. c0 + n - 1 (a chunk), from their
   decoded values (values [n][dims]) or, with values NULL, from their codes (codes[k], decoded in the tiles), every
   head tile of q (qb [hp][dims]) added; scales [n]. The rows of keys from c0 + n on are prefetched (with `hint`) as
   the tiles run, up to next_end. Inlined, so each call site compiles the loop for its kind of keys. */
static inline __attribute__((always_inline)) void bf16_chunk_scores(
    const uint16_t *values, const uint8_t *const *codes, const uint16_t table[128], long n, const float *scales,
    const uint16_t *qb, const float *wt, long heads, long dims, long c0, long next_end, const uint8_t *cache,
    long block_stride, long row_stride, long block_size, const int32_t *tt, int hint, float *st) {
    struct row_cursor next = cursor_at(c0 + n, block_size);
    for (long k = 0; k < n; k += BF16_KEYS) {
        int n_keys = n - k < BF16_KEYS ? (int)(n - k) : BF16_KEYS;
        prefetch_rows(&next, BF16_KEYS, next_end, cache, block_stride, row_stride, dims + 4, block_size, tt, hint);
        float partial[BF16_KEYS * HEADS] = {0.0f};
        for (long h0 = 0; h0 < heads; h0 += HEADS)
            bf16_tile(values ? values + k * dims : NULL, codes ? codes + k : NULL, table, n_keys, scales + k,
                      qb + h0 * dims, wt + h0, dims, heads - h0, partial);
        for (int j = 0; j < n_keys; j++) {
            const float *p = partial + HEADS * j;
            st[c0 + k + j] = (p[0] + p[1]) + (p[2] + p[3]);
        }
    }
}

#if !defined(GLM5_AMX_DOTS)
/* The bf16 route for one token over keys c0 .. c0 + n - 1 (a chunk) when no other token reads them: the tiles decode
   each key's codes on the way instead of the chunk being decoded into the workspace first and read back (one token,
   4 heads, Zen 4: 0.35 -> 0.30 ms over 16K keys in cache, 0.85 -> 0.73 ms over 32K from memory). The same values
   in the same order: the same bits as the decoded chunk. Returns 0 (nothing written) where a key's scale keeps the
   chunk off the bf16 route. scales: CHUNK floats of workspace; the rest as score_tokens. */
static int lone_token_chunk(long dims, const uint16_t *qb, const float *wt, long heads, const uint16_t table[128],
                            const uint8_t *cache, long block_stride, long row_stride, long block_size,
                            const int32_t *tt, long c0, long n, long next_end, int hint, float *scales, float *st) {
    const uint8_t *rows[CHUNK];
    struct row_cursor at = cursor_at(c0, block_size);
    int ok = 1;
    for (long k = 0; k < n; k++) { /* the scales first: a chunk's keys take one route */
        rows[k] = next_row(&at, cache, block_stride, row_stride, block_size, tt);
        memcpy(&scales[k], rows[k] + dims, sizeof scales[k]);
        ok &= bf16_scale_ok(scales[k]);
    }
    if (!ok) return 0;
    bf16_chunk_scores(NULL, rows, table, n, scales, qb, wt, heads, dims, c0, next_end, cache, block_stride,
                      row_stride, block_size, tt, hint, st);
    return 1;
}
#else
/* st[c0 + k] for k < n: the bf16 route's scores of one token on AMX tiles, from the chunk's decoded values [n][dims]
   (32 keys a block, in place) and q's panels (pack_head_panels, `steps` K steps of 32 dims each): per key and head
   dot = (q_h . value(key)) x scale, then sum over the real heads of w[h] relu(dot), in fp32 (head_sums.h). */
static void amx_chunk_scores(const uint16_t *values, long n, const float *scales, const uint16_t *panels, long steps,
                             const float *wt, long heads, long dims, long c0, float *st) {
    for (long k0 = 0; k0 < n; k0 += MB) {
        int rows = n - k0 < MB ? (int)(n - k0) : MB;
        float out[MB] = {0.0f};
        for (long h0 = 0; h0 < heads; h0 += NB) {
            int cols = heads - h0 < NB ? (int)(heads - h0) : NB;
            float dots[MB][NB];
            block(OP_BF16, (const uint8_t *)(values + k0 * dims), 2 * dims, 2 * dims, rows,
                  (const uint8_t *)(panels + (h0 / NB) * steps * (STEP_BYTES / 2)), steps, steps, cols,
                  (uint8_t *)dots, sizeof dots[0]);
            add_head_sums((const float(*)[NB])dots, rows, cols, scales + k0, wt + h0, out);
        }
        for (int j = 0; j < rows; j++) st[c0 + k0 + j] = out[j];
    }
}
#endif
#endif

/* The fp32 route for one token over keys c0 .. c0 + n - 1 (a chunk) when no other token reads them, with one tile of
   heads (qt [HEADS][dims], wt [HEADS]; dims a multiple of 16, at most LONE_MAX_DIMS): the tiles decode each key pair's
   codes on the way instead of the chunk being decoded into the workspace first and read back, and the rows of keys
   from c0 + n on are prefetched (with `hint`) up to next_end. The same values in the same order (an odd last key
   paired with itself, as in the workspace's tiles): the same bits. The decode step of a CPU without AVX-512 BF16
   (AVX2 EPYCs) or of fp32 queries. In-process A/B against the workspace, one token, 4 heads, AVX2 build, Zen 4:
   fp8_index 16K keys 0.70 -> 0.59 ms in cache, 0.96 -> 0.73 ms out of the LLC; 32K 1.43 -> 1.23 and 1.84 -> 1.40
   ms; int8_index 32K 0.99 -> 0.82 and 1.76 -> 1.15 ms (with row_scale's one multiply a code, here and in
   decode_row). The rest as score_tokens. */
static void lone_token_chunk_fp32(long dims, int code, const float *qt, const float *wt, long heads,
                                  const uint8_t *cache, long block_stride, long row_stride, long block_size,
                                  const int32_t *tt, long c0, long n, long next_end, int hint, float *st) {
    struct row_cursor at = cursor_at(c0, block_size), next = cursor_at(c0 + n, block_size);
    for (long k = 0; k < n; k += 2) {
        prefetch_rows(&next, 2, next_end, cache, block_stride, row_stride, dims + 4, block_size, tt, hint);
        const uint8_t *rows[2];
        rows[0] = next_row(&at, cache, block_stride, row_stride, block_size, tt);
        rows[1] = k + 1 < n ? next_row(&at, cache, block_stride, row_stride, block_size, tt) : rows[0];
        float partial[2 * HEADS] = {0.0f};
        tile(NULL, NULL, rows, code, qt, wt, dims, heads, partial);
        for (int j = 0; j < 2 && k + j < n; j++) {
            const float *p = partial + HEADS * j;
            st[c0 + k + j] = (p[0] + p[1]) + (p[2] + p[3]);
        }
    }
}

/* Scores of tokens [t_begin, t_end) at key positions [s_begin, s_end): one thread's share.
 * q: [T][hp][dims] fp32 (hp: H rounded up to HEADS, zero heads past H); w: [T][hp] fp32; cache rows of row_stride
 * bytes, blocks of block_stride bytes (dims codes then an fp32 scale); code: CODE_E4M3 or CODE_INT8; tables[t -
 * t_begin]: token t's block table row (every entry a valid block); limits[t - t_begin] (positions >= it get -inf);
 * scores: [T][score_row] fp32; hint: how rows read next are asked for (row_prefetch.h). Returns 0, or -1 if the
 * workspace could not be allocated. */
static int score_tokens(long heads, long dims, int code, const float *q, const float *w, const uint8_t *cache,
                        long block_stride, long row_stride, long block_size, const int32_t *const *tables,
                        const int64_t *limits, float *scores, long score_row, int hint, long t_begin, long t_end,
                        long s_begin, long s_end) {
    long hp = (heads + HEADS - 1) / HEADS * HEADS;
    float *keys = malloc(sizeof *keys * CHUNK * (dims > 0 ? dims : 1));
    int32_t *decoded_blocks = malloc(sizeof *decoded_blocks * (CHUNK + 2)); /* a chunk spans <= CHUNK + 1 blocks */
    int status = keys && decoded_blocks ? 0 : -1;
#if defined(BF16_DOTS)
    /* The bf16 route's workspace: the chunk's values (in `keys`' first half) and scales, and a token's q. */
    uint16_t *values = (uint16_t *)keys, table[128];
    float *key_scales = malloc(sizeof *key_scales * CHUNK);
    uint16_t *qb = malloc(sizeof *qb * hp * (dims > 0 ? dims : 1));
    if (!key_scales || !qb) status = -1;
    if (code == CODE_E4M3) e4m3_bf16_table(table);
    long qb_token = -1; /* the token whose q is in qb (a decode call has one token and many chunks) */
    int qb_ok = 0;
#endif
#if defined(GLM5_AMX_DOTS)
    const long amx_steps = (dims + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS); /* K steps of 32 dims */
    const long amx_panel_size = (heads + NB - 1) / NB * amx_steps * STEP_BYTES;
    uint16_t *amx_panels = malloc(amx_panel_size > 0 ? amx_panel_size : 1);
    if (!amx_panels) status = -1;
    tiles_begin();
#endif
    for (long c0 = s_begin; c0 < s_end && status == 0; c0 += CHUNK) {
        long c1 = c0 + CHUNK < s_end ? c0 + CHUNK : s_end, first_block = c0 / block_size;
        long decoded = 0; /* keys c0 .. c0 + decoded - 1 are in `keys`, from the blocks in decoded_blocks */
        int decoded_bf16 = 0; /* ... as bf16 values and scales (the bf16 route), or as fp32 keys */
        for (long t = t_begin; t < t_end; t++) {
            const int32_t *tt = tables[t - t_begin];
            float *st = scores + t * score_row;
            long limit = limits[t - t_begin];
            long visible_end = visible_in_chunk(st, limit, c0, c1);
            long needed = visible_end - c0;
            if (needed <= 0) continue;
            const float *qt = q + t * hp * dims, *wt = w + t * hp;
            int bf16 = 0;
#if defined(BF16_DOTS)
            if (code == CODE_E4M3 && qb_token != t) {
                qb_ok = bf16_query(qt, hp * dims, qb);
                qb_token = t;
#if defined(GLM5_AMX_DOTS)
                if (qb_ok) pack_head_panels(qb, dims, heads, dims, amx_steps, amx_panels);
#endif
            }
            bf16 = code == CODE_E4M3 && qb_ok;
#endif
            long shared = decoded < needed ? decoded : needed;
            if (memcmp(tt + first_block, decoded_blocks, sizeof *tt * blocks_spanned(c0, shared, block_size)))
                decoded = 0; /* another sequence's blocks: decode again */
            /* A token alone with its keys (decode: the workspace holds nothing of its route it can use, and the
               next token reads other blocks), with one tile of heads: its tiles decode the codes on the way. */
            int next_elsewhere = t + 1 == t_end || memcmp(tables[t + 1 - t_begin] + first_block, tt + first_block,
                                                          sizeof *tt * blocks_spanned(c0, needed, block_size));
#if defined(BF16_DOTS) && !defined(GLM5_AMX_DOTS)
            if (bf16 && next_elsewhere && (decoded == 0 || !decoded_bf16) && hp == HEADS && dims <= BF16_MAX_DIMS &&
                lone_token_chunk(dims, qb, wt, heads, table, cache, block_stride, row_stride, block_size, tt, c0,
                                 needed, limit < s_end ? limit : s_end, hint, key_scales, st)) {
                decoded = 0; /* key_scales now holds this token's */
                continue;
            }
#endif
            if (!bf16 && next_elsewhere && (decoded == 0 || decoded_bf16) && hp == HEADS &&
                dims % (2 * LANES) == 0 && dims <= LONE_MAX_DIMS) {
                lone_token_chunk_fp32(dims, code, qt, wt, heads, cache, block_stride, row_stride, block_size, tt, c0,
                                      needed, limit < s_end ? limit : s_end, hint, st); /* the workspace is unchanged */
                continue;
            }
            /* A token takes its own route over the workspace, whatever the token before it left there: fp32 keys for
               an fp32 token; bf16 values for a bf16 one unless a scale among its own keys rules them out (the decode
               below turns to fp32 then). Reusing the other route's keys made a token's bits depend on how the
               tokens were split over threads (a bf16 token after an fp32 one of its sequence took the fp32 route,
               alone the bf16 one: found by the native tests at 10x their examples). */
            if (decoded_bf16 != bf16) decoded = 0;
            if (decoded == 0) decoded_bf16 = bf16;
            if (decoded < needed) {
                struct row_cursor at = cursor_at(c0 + decoded, block_size);
                while (at.position < visible_end) {
                    long s = at.position;
                    const uint8_t *row = next_row(&at, cache, block_stride, row_stride, block_size, tt);
#if defined(BF16_DOTS)
                    if (decoded_bf16) {
                        key_scales[s - c0] = decode_row_bf16(row, dims, table, values + (s - c0) * dims);
                        if (bf16_scale_ok(key_scales[s - c0])) continue;
                        decoded_bf16 = 0; /* a scale the bf16 route cannot take: the chunk's keys as fp32 */
                        at = cursor_at(c0, block_size);
                        continue;
                    }
#endif
                    decode_row(row, dims, code, keys + (s - c0) * dims);
                }
                memcpy(decoded_blocks, tt + first_block, sizeof *tt * blocks_spanned(c0, needed, block_size));
                decoded = needed;
            }
#if defined(BF16_DOTS)
            if (decoded_bf16) { /* (the next chunk's visible keys end before the token's limit) */
#if defined(GLM5_AMX_DOTS)
                amx_chunk_scores(values, needed, key_scales, amx_panels, amx_steps, wt, heads, dims, c0, st);
#else
                bf16_chunk_scores(values, NULL, table, needed, key_scales, qb, wt, heads, dims, c0,
                                  limit < s_end ? limit : s_end, cache, block_stride, row_stride, block_size, tt, hint,
                                  st);
#endif
                continue;
            }
#endif
            for (long k = 0; k < needed; k += 2) {
                const float *key0 = keys + k * dims, *key1 = k + 1 < needed ? key0 + dims : key0;
                float partial[2 * HEADS] = {0.0f};
                for (long h0 = 0; h0 < heads; h0 += HEADS)
                    tile(key0, key1, NULL, code, qt + h0 * dims, wt + h0, dims, heads - h0, partial);
                for (int j = 0; j < 2 && k + j < needed; j++) {
                    const float *p = partial + HEADS * j;
                    st[c0 + k + j] = (p[0] + p[1]) + (p[2] + p[3]);
                }
            }
        }
    }
    free(keys);
    free(decoded_blocks);
#if defined(BF16_DOTS)
    free(key_scales);
    free(qb);
#endif
#if defined(GLM5_AMX_DOTS)
    tiles_end();
    free(amx_panels);
#endif
    return status;
}

/* score_tokens with each token's table row and limit given: table [T][table_width] int32 (every entry a valid
 * block), limit [T]; row_prefetch: PREFETCH_L2, PREFETCH_L1 or PREFETCH_NTA (row_prefetch.h). Returns 0, or -1 if the
 * workspace could not be allocated. */
int glm5_quantized_index_scores(long heads, long dims, int code, const float *q, const float *w, const uint8_t *cache,
                                long block_stride, long row_stride, long block_size, const int32_t *table,
                                long table_width, const int64_t *limit, float *scores, long score_row, int row_prefetch,
                                long t_begin, long t_end, long s_begin, long s_end) {
    long tokens = t_end - t_begin;
    const int32_t **tables = malloc(sizeof *tables * (tokens > 0 ? tokens : 1));
    if (!tables) return -1;
    for (long t = t_begin; t < t_end; t++) tables[t - t_begin] = table + t * table_width;
    int status = score_tokens(heads, dims, code, q, w, cache, block_stride, row_stride, block_size, tables,
                              limit + t_begin, scores, score_row, row_prefetch, t_begin, t_end, s_begin, s_end);
    free(tables);
    return status;
}

/* score_tokens over the op's paged batch (paged_tokens.h): tokens first_token + t of the batch for t in t_begin ..
 * t_end - 1 (q, w and scores hold the tokens from first_token on), key positions < width; keys whose table entry
 * names no block of the cache get -inf and are never read; row_prefetch as above. Returns 0, or -1 if the workspace
 * could not be allocated. */
int glm5_quantized_index_scores_paged(long heads, long dims, int code, const float *q, const float *w,
                                      const uint8_t *cache, long block_stride, long row_stride, long block_size,
                                      long num_blocks, const int32_t *block_table, long table_stride,
                                      long max_blocks, const int32_t *seq_lens_k, const int32_t *cu_seqlens_q,
                                      long batch, long first_token, float *scores, long score_row, long width,
                                      int row_prefetch, long t_begin, long t_end, long s_begin, long s_end) {
    struct paged_batch pb = {block_table, table_stride, max_blocks, seq_lens_k, cu_seqlens_q, batch, block_size,
                             num_blocks};
    struct token_views views;
    if (token_views_make(&pb, width, first_token + t_begin, first_token + t_end, &views)) return -1;
    int status = score_tokens(heads, dims, code, q, w, cache, block_stride, row_stride, block_size, views.tables,
                              views.limits, scores, score_row, row_prefetch, t_begin, t_end, s_begin, s_end);
    if (status == 0)
        paged_mask_outside(&pb, &views, scores + t_begin * score_row, score_row, first_token + t_begin,
                           first_token + t_end, s_begin, s_end);
    token_views_free(&views);
    return status;
}
