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
#endif
