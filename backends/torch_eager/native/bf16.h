/* bf16 helpers shared by the native kernels (bf16 values travel as their raw uint16 bits). */
#ifndef GLM5_HAL_BF16_H
#define GLM5_HAL_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16; /* bf16 is the top half of an fp32 */
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* fp32 -> bf16 as torch rounds it (c10::BFloat16): to nearest, ties to even; every NaN becomes 0x7FC0. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
#endif
