/* How a kernel asks for cache rows it will read soon (sparse attention's selected rows, the quantized indexer's next
 * chunk of keys): into L2 (PREFETCHT2), into L1 (PREFETCHT0) or non-temporally (PREFETCHNTA). The results are the same
 * bits whatever the hint; which is fastest with the rows coming from memory is the CPU's, so each kernel takes the hint
 * as an argument (its entry points' `row_prefetch`, these codes) and the torch backend's probe measures the three:
 * over 2048 scattered rows out of L3 into L2 was the fastest on a Zen 4 and the slowest on a Zen 5 (head_pairs.h); the
 * quantized indexer's next chunk, one token over fp8_index rows from memory on a Zen 5, took 1.06-1.34x longer into
 * L2 than the other two (quantized_index_scores.c). The portable build asks for nothing. */
#ifndef GLM5_HAL_ROW_PREFETCH_H
#define GLM5_HAL_ROW_PREFETCH_H

enum { PREFETCH_L2 = 0, PREFETCH_L1 = 1, PREFETCH_NTA = 2 };

#ifndef GLM5_PORTABLE
/* The cache lines from `from` on, one every 64 bytes while below `from + bytes`, with `hint`. One loop per hint, each
   an asm instruction: gcc 12 merged three loops of _mm_prefetch into one whose hint was no longer a constant, and then
   emitted no prefetch at all (the kernel's objdump showed none; the tests read every build's code for all three). */
static inline void prefetch_lines(const void *from, long bytes, int hint) {
    const char *line = (const char *)from;
    if (hint == PREFETCH_NTA)
        for (long b = 0; b < bytes; b += 64) __asm__ volatile("prefetchnta %0" : : "m"(line[b]));
    else if (hint == PREFETCH_L1)
        for (long b = 0; b < bytes; b += 64) __asm__ volatile("prefetcht0 %0" : : "m"(line[b]));
    else
        for (long b = 0; b < bytes; b += 64) __asm__ volatile("prefetcht2 %0" : : "m"(line[b]));
}
#else
static inline void prefetch_lines(const void *from, long bytes, int hint) {
    (void)from;
    (void)bytes;
    (void)hint;
}
#endif
#endif
