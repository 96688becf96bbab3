/* NeoX rotary embedding of the cpu backend (ops.py: rotary_neox), float32 and 16-bit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "half_values.h"

/* The row-wise kernels below split their rows across the threads only past GATED_PARALLEL_VALUES: under it
 * forking the thread team costs more than the second thread saves. Below it they enter no OpenMP region at
 * all (a region whose `if` is false still costs a fork's bookkeeping). Each row is computed by the one
 * compiled copy of its *_rows function (noinline) whichever thread takes it, so results are the same bits. */
#define ROTARY_PARALLEL_VALUES (1 << 14)

/* rotary_neox: rotate the first rotary_dim features of each head in place (half-split layout),
 * q of [tokens, q_heads, head_dim] and k of [tokens, k_heads, head_dim] whose token rows are
 * q_stride / k_stride floats apart (they may be views into one fused qkv buffer),
 * cos/sin of [tokens, rotary_dim/2]. */
static __attribute__((noinline)) void
rotary_neox_rows(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens, int64_t q_heads,
                 int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride, int64_t k_stride,
                 int64_t first, int64_t last) {
    const int64_t half = rotary_dim / 2;
    for (int64_t t = first; t < last; t++) {
        const float *c = cos_table + t * half, *s = sin_table + t * half;
        for (int64_t h = 0; h < q_heads + k_heads; h++) {
            float *x = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

void rotary_neox(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens, int64_t q_heads,
                 int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride, int64_t k_stride) {
    if (tokens > 1 && tokens * (q_heads + k_heads) * rotary_dim >= ROTARY_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t t = 0; t < tokens; t++)
            rotary_neox_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                             k_stride, t, t + 1);
    } else {
        rotary_neox_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                         k_stride, 0, tokens);
    }
}

/* rotary_neox on 16-bit q and k rows (strides in elements), float32 cos/sin tables of [tokens, rotary_dim/2]:
 * x1' = round(x1 c - x2 s), x2' = round(x2 c + x1 s), the products and sums in float32. */
static __attribute__((noinline)) void
rotary_neox_16_rows(uint16_t *q, uint16_t *k, const float *cos_table, const float *sin_table, int64_t tokens,
                    int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                    int64_t k_stride, int dtype, int64_t first, int64_t last) {
    const int64_t half = rotary_dim / 2;
    for (int64_t t = first; t < last; t++) {
        const float *c = cos_table + t * half, *s = sin_table + t * half;
        for (int64_t h = 0; h < q_heads + k_heads; h++) {
            uint16_t *x = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load16(x + i, dtype), x2 = load16(x + i + half, dtype);
                x[i] = store16(x1 * c[i] - x2 * s[i], dtype);
                x[i + half] = store16(x2 * c[i] + x1 * s[i], dtype);
            }
        }
    }
}

void rotary_neox_16(uint16_t *q, uint16_t *k, const float *cos_table, const float *sin_table, int64_t tokens,
                    int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                    int64_t k_stride, int dtype) {
    if (tokens > 1 && tokens * (q_heads + k_heads) * rotary_dim >= ROTARY_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t t = 0; t < tokens; t++)
            rotary_neox_16_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                                k_stride, dtype, t, t + 1);
    } else {
        rotary_neox_16_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                            k_stride, dtype, 0, tokens);
    }
}
