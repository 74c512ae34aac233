/* The deterministic top-k of fp32 score rows (glm5_hal/topk.py's contract), on CPUs: per row, the k best columns,
 * by score descending, equal scores by the LOWER column; NaN above everything (every NaN ties every other), -0.0
 * ties +0.0. Per row:
 *
 *   1. key[s] = ordered(score[s]): an unsigned key whose order is the contract's score order (as ordered_key in
 *      topk.py: -0.0 -> +0.0, every NaN -> +NaN, then the usual sign-magnitude -> unsigned map), with a histogram
 *      of its top 11 bits;
 *   2. the bin of the k-th largest key, then the (key, column) of every column in that bin or above, in column
 *      order (usually a few k of the row), and the k-th largest key T itself from two more digits (11 + 10 bits)
 *      over that bin's entries;
 *   3. the k taken, still in column order: every key > T, and the first `need` keys == T (the lowest columns);
 *   4. a stable LSD radix sort of those k by key, descending (11 / 11 / 10 bit digits, a pass skipped where all
 *      share the digit): stability keeps equal keys in column order, which is the contract's order.
 *
 * Values are the row's own fp32 bits at the chosen columns (-0.0 and NaN payloads stay as they were). Plain C, no
 * intrinsics: every step is a pass over the row or the few k chosen. backends/torch_eager/native/topk.py has the Python side.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOP_BITS 11                  /* digit 1: bits 31 .. 21 */
#define MID_BITS 11                  /* digit 2: bits 20 .. 10 */
#define LOW_BITS 10                  /* digit 3: bits 9 .. 0 */
#define BINS (1 << TOP_BITS)         /* the largest histogram (digits 1 and 2) */
#define INSERTION_SORT_BELOW 64      /* fewer taken than this: an insertion sort beats three histograms */

typedef struct {
    uint32_t key;
    uint32_t column; /* columns below 2^32 (the wrapper checks the width) */
} Entry;

static inline uint32_t ordered_key(float score) {
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits = 0x7FC00000u; /* any NaN, either sign: +NaN, above +inf */
    if (bits == 0x80000000u) bits = 0;                           /* -0.0 ties +0.0 */
    /* Negative: flip every bit (a larger magnitude is a smaller key, and below every positive); positive: set the
       sign bit (above every negative). Unsigned order is then float order, -inf lowest and NaN highest. */
    uint32_t flip = (uint32_t)((int32_t)bits >> 31) | 0x80000000u;
    return bits ^ flip;
}

#define NEGATIVE_INFINITY_KEY 0x007FFFFFu /* ordered_key(-inf): 0xFF800000 with every bit flipped */

/* The bin, counted from the top, in which the running count of hist[bins - 1], hist[bins - 2], ... reaches rank
   (1 <= rank <= the total); *above gets the count of the bins above it. */
static inline uint32_t bin_of_rank(const uint32_t *hist, uint32_t bins, long rank, long *above) {
    long count = 0;
    uint32_t bin = bins - 1;
    while (count + (long)hist[bin] < rank) count += hist[bin--];
    *above = count;
    return bin;
}

/* Stable sort of n entries by key descending, in `entries` (scratch: n more). */
static void sort_descending(Entry *entries, Entry *scratch, long n, uint32_t *hist) {
    if (n < INSERTION_SORT_BELOW) {
        for (long i = 1; i < n; i++) {
            Entry e = entries[i];
            long j = i;
            for (; j > 0 && entries[j - 1].key < e.key; j--) entries[j] = entries[j - 1]; /* strict: stable */
            entries[j] = e;
        }
        return;
    }
    static const int shifts[3] = {0, LOW_BITS, LOW_BITS + MID_BITS};
    static const uint32_t masks[3] = {(1u << LOW_BITS) - 1, (1u << MID_BITS) - 1, (1u << TOP_BITS) - 1};
    uint32_t *counts[3] = {hist, hist + BINS, hist + 2 * BINS};
    memset(hist, 0, sizeof *hist * 3 * BINS);
    for (long i = 0; i < n; i++) {
        uint32_t inverted = ~entries[i].key; /* ascending order of ~key is descending order of key */
        for (int d = 0; d < 3; d++) counts[d][(inverted >> shifts[d]) & masks[d]]++;
    }
    Entry *from = entries, *to = scratch;
    for (int d = 0; d < 3; d++) {
        uint32_t *count = counts[d];
        if (count[(~from[0].key >> shifts[d]) & masks[d]] == (uint32_t)n) continue; /* one digit value: no-op */
        uint32_t start = 0;
        for (uint32_t b = 0; b <= masks[d]; b++) {
            uint32_t c = count[b];
            count[b] = start;
            start += c;
        }
        for (long i = 0; i < n; i++) to[count[(~from[i].key >> shifts[d]) & masks[d]]++] = from[i];
        Entry *swap = from;
        from = to;
        to = swap;
    }
    if (from != entries) memcpy(entries, from, sizeof *entries * n);
}

/* scores: rows of `width` fp32, element [r][s] at scores[r * row_stride + s * column_stride]; values [N][k] fp32
   and either columns [N][k] int64 or (columns NULL) positions [N][k] int32, the column or -1 where the value is
   -inf (a key nothing may select: the indexer's rule, so that it needs no pass of its own), contiguous. Rows
   row_begin .. row_end - 1, 1 <= k <= width. Returns 0, or -1 if the scratch could not be allocated. */
static int topk_rows(long width, long k, const float *scores, long row_stride, long column_stride, float *values,
                     int64_t *columns, int32_t *positions, long row_begin, long row_end) {
    uint32_t *keys = malloc(sizeof *keys * width);
    Entry *entries = malloc(sizeof *entries * width); /* the columns in the k-th key's top bin or above */
    Entry *scratch = malloc(sizeof *scratch * k);
    uint32_t *hist = malloc(sizeof *hist * 3 * BINS);
    if (!keys || !entries || !scratch || !hist) {
        free(keys);
        free(entries);
        free(scratch);
        free(hist);
        return -1;
    }
    for (long r = row_begin; r < row_end; r++) {
        const float *row = scores + r * row_stride;

        /* 1. Keys, and the histogram of their top digit. */
        if (column_stride == 1) {
            for (long s = 0; s < width; s++) keys[s] = ordered_key(row[s]); /* a separate loop: vectorized */
        } else {
            for (long s = 0; s < width; s++) keys[s] = ordered_key(row[s * column_stride]);
        }
        memset(hist, 0, sizeof *hist * BINS);
        for (long s = 0; s < width; s++) hist[keys[s] >> (32 - TOP_BITS)]++;

        /* 2. The k-th largest key's top digit; every column with that digit or a larger one, in column order
           (branch-free: a write at every column, the count advancing only for the wanted ones). */
        long above_top, above_mid, above_low;
        uint32_t top = bin_of_rank(hist, BINS, k, &above_top);
        long n = 0;
        for (long s = 0; s < width; s++) {
            entries[n].key = keys[s];
            entries[n].column = (uint32_t)s;
            n += (keys[s] >> (32 - TOP_BITS)) >= top;
        }
        /* The k-th largest key's next digits, from the entries in its top bin. */
        memset(hist, 0, sizeof *hist * BINS);
        for (long i = 0; i < n; i++)
            hist[(entries[i].key >> LOW_BITS) & ((1u << MID_BITS) - 1)] += entries[i].key >> (32 - TOP_BITS) == top;
        uint32_t mid = bin_of_rank(hist, 1u << MID_BITS, k - above_top, &above_mid);
        uint32_t prefix = top << MID_BITS | mid;
        memset(hist, 0, sizeof *hist * (1u << LOW_BITS));
        for (long i = 0; i < n; i++)
            hist[entries[i].key & ((1u << LOW_BITS) - 1)] += entries[i].key >> LOW_BITS == prefix;
        uint32_t low = bin_of_rank(hist, 1u << LOW_BITS, k - above_top - above_mid, &above_low);
        uint32_t threshold = prefix << LOW_BITS | low;
        long need = k - above_top - above_mid - above_low; /* keys == threshold to take: the lowest columns */

        /* 3. The k taken, in place and still in column order. */
        long taken = 0, ties = 0;
        for (long i = 0; i < n; i++) {
            Entry e = entries[i];
            int tie = e.key == threshold;
            entries[taken] = e;
            taken += (e.key > threshold) | (tie & (ties < need));
            ties += tie;
        }

        /* 4. Best first; equal keys stay in column order. */
        sort_descending(entries, scratch, k, hist);
        float *row_values = values + r * k;
        for (long j = 0; j < k; j++) {
            /* Copied as bits: no float load or store between the row and the result (NaN payloads stay). */
            memcpy(row_values + j, row + (long)entries[j].column * column_stride, sizeof *row_values);
            if (columns)
                columns[r * k + j] = entries[j].column;
            else /* the key's ordered form: -inf is the one key below every number's (NaN ranks above) */
                positions[r * k + j] = entries[j].key == NEGATIVE_INFINITY_KEY ? -1 : (int32_t)entries[j].column;
        }
    }
    free(keys);
    free(entries);
    free(scratch);
    free(hist);
    return 0;
}

int glm5_topk(long width, long k, const float *scores, long row_stride, long column_stride, float *values,
              int64_t *columns, long row_begin, long row_end) {
    return topk_rows(width, k, scores, row_stride, column_stride, values, columns, NULL, row_begin, row_end);
}

/* glm5_topk with positions [N][k] int32 (-1 where the value is -inf) in place of the columns. */
int glm5_topk_positions(long width, long k, const float *scores, long row_stride, long column_stride, float *values,
                        int32_t *positions, long row_begin, long row_end) {
    return topk_rows(width, k, scores, row_stride, column_stride, values, NULL, positions, row_begin, row_end);
}
