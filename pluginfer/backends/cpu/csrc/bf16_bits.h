/* bfloat16 <-> float32 by their bits, as torch's c10::BFloat16 (half_linear.c and amx_half.c share it). */
#pragma once

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch's c10::BFloat16; a NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
