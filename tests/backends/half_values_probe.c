/* Writes to stdout, as little-endian uint32 words, what csrc/half_values.h's conversions give on the CPU it was
 * built for: every float16 and bfloat16 bit pattern widened (load16, and widen16_row over whole rows and short
 * tails), then float32 values rounded to float16 (half_round): each float16 value, the midpoints between
 * neighbours and the floats one ulp either side, and a stride through all 2^32 bit patterns (NaNs included).
 * tests/backends/test_half_values.py compares the builds. */
#include <stdio.h>
#include <stdlib.h>
#include "half_values.h"

static void put(uint32_t word) { fwrite(&word, sizeof word, 1, stdout); }

static void put_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    put(bits);
}

static float from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int main(void) {
    uint16_t *all = malloc(65536 * sizeof *all);
    float *row = malloc(65536 * sizeof *row);
    if (!all || !row) return 1;
    for (uint32_t h = 0; h < 65536; h++) all[h] = (uint16_t)h;
    for (int dtype = HALF_F16; dtype <= HALF_BF16; dtype++) {
        for (uint32_t h = 0; h < 65536; h++) put_float(load16(&all[h], dtype));
        widen16_row(all, row, 65536, dtype);
        for (uint32_t h = 0; h < 65536; h++) put_float(row[h]);
        for (int64_t n = 1; n <= 19; n++) { /* tails shorter than, and past, a vector */
            widen16_row(all + 31744 + 7 * n, row, n, dtype);
            for (int64_t j = 0; j < n; j++) put_float(row[j]);
        }
    }
    for (uint32_t h = 0; h < 65536; h++) {
        /* volatile: the compiler may fold a widening and its rounding back into nothing, keeping a signalling NaN */
        volatile float widened = load16(&all[h], HALF_F16);
        const float value = widened, next = load16(&all[(h + 1) & 0xFFFF], HALF_F16);
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        put(half_round(value));
        put(half_round(from_bits(bits + 1)));
        put(half_round(from_bits(bits - 1)));
        put(half_round(0.5f * value + 0.5f * next)); /* the midpoint (where both are finite and alike in sign) */
    }
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 65537) put(half_round(from_bits((uint32_t)bits)));
    free(all);
    free(row);
    return 0;
}
