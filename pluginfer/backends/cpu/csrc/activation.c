/* Gated activations of the cpu backend (ops.py: silu_and_mul, gelu_and_mul), float32 and 16-bit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "exp_avx512.h"
#include "half_values.h"

/* The row-wise kernels below split their rows across the threads only past GATED_PARALLEL_VALUES: under it
 * forking the thread team costs more than the second thread saves. Below it they enter no OpenMP region at
 * all (a region whose `if` is false still costs a fork's bookkeeping). Each row is computed by the one
 * compiled copy of its *_rows function (noinline) whichever thread takes it, so results are the same bits. */
#define GATED_PARALLEL_VALUES (1 << 13)

/* gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3): silu(g) = g / (1 +
 * exp(-g))'s form, exp512 for expf (torch's 0.5 g (1 + tanh(u)) loses the low bits of 1 + tanh(u) for u below about
 * -2; this does not). */
static const float GELU_TWO_BETA = 1.5957691216057308f, GELU_KAPPA = 0.044715f; /* 2 sqrt(2/pi) */

/* silu (gelu 0) or gelu_tanh (gelu 1) of one value, and of 16 (AVX-512); the gated kernels (float32 and 16-bit)
 * take them with gelu a constant, so each inlines one activation's arithmetic, as written here. */
static inline __attribute__((always_inline)) float gate_activation(float g, int gelu) {
    return gelu ? g / (1.0f + expf(-GELU_TWO_BETA * fmaf(GELU_KAPPA * g, g * g, g))) : g / (1.0f + expf(-g));
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 gate_activation512(__m512 g, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e;
    if (gelu) {
        const __m512 kappa = _mm512_set1_ps(GELU_KAPPA), minus_two_beta = _mm512_set1_ps(-GELU_TWO_BETA);
        const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(kappa, g), _mm512_mul_ps(g, g), g);
        e = exp512(_mm512_mul_ps(minus_two_beta, inner));
    } else {
        e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    }
    return _mm512_div_ps(g, _mm512_add_ps(one, e));
}
#endif

/* One row of a gated kernel: o[i] = activation(gate[i]) * up[i]. */
static inline __attribute__((always_inline)) void gated_row(const float *gate, const float *up, float *o, int64_t n,
                                                            int gelu) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(gate_activation512(_mm512_loadu_ps(gate + i), gelu),
                                              _mm512_loadu_ps(up + i)));
#endif
    for (; i < n; i++) o[i] = gate_activation(gate[i], gelu) * up[i];
}

/* Rows [first, last) of a gated kernel on x of [rows, 2n]: out[r, i] = act(x[r, i]) * x[r, n + i], act silu
 * (gelu 0) or gelu_tanh (1); gated_row is inlined once for each, so the inner loop branches on neither. */
static __attribute__((noinline)) void
gated_and_mul_rows(const float *x, float *out, int64_t n, int gelu, int64_t first, int64_t last) {
    if (gelu)
        for (int64_t r = first; r < last; r++) gated_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, 1);
    else
        for (int64_t r = first; r < last; r++) gated_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, 0);
}

static void gated_and_mul(const float *x, float *out, int64_t rows, int64_t n, int gelu) {
    if (rows > 1 && rows * n >= GATED_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            gated_and_mul_rows(x, out, n, gelu, r, r + 1);
    } else {
        gated_and_mul_rows(x, out, n, gelu, 0, rows);
    }
}

/* silu_and_mul: out[r, i] = silu(x[r, i]) * x[r, n + i] for x of [rows, 2n]. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t n) { gated_and_mul(x, out, rows, n, 0); }

/* gelu_tanh_and_mul: out[r, i] = gelu_tanh(x[r, i]) * x[r, n + i] for x of [rows, 2n]. */
void gelu_tanh_and_mul(const float *x, float *out, int64_t rows, int64_t n) { gated_and_mul(x, out, rows, n, 1); }

/* One row of a 16-bit gated kernel: o[i] = round(round(activation(gate[i])) * up[i]), the activation in float32
 * (gated_row's) on the widened gate. */
static inline __attribute__((always_inline)) void gated_row_16(const uint16_t *gate, const uint16_t *up, uint16_t *o,
                                                               int64_t n, int dtype, int gelu) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 g = widen16_ps(_mm256_loadu_si256((const __m256i *)(gate + i)), dtype);
        const __m512 a = widen16_ps(narrow16_ps(gate_activation512(g, gelu), dtype), dtype);
        const __m512 u = widen16_ps(_mm256_loadu_si256((const __m256i *)(up + i)), dtype);
        _mm256_storeu_si256((__m256i *)(o + i), narrow16_ps(_mm512_mul_ps(a, u), dtype));
    }
#endif
    for (; i < n; i++)
        o[i] = store16(round16(gate_activation(load16(gate + i, dtype), gelu), dtype) * load16(up + i, dtype), dtype);
}

/* Rows [first, last) of a 16-bit gated kernel (gated_and_mul_rows's, the activation silu or gelu_tanh). */
static __attribute__((noinline)) void
gated_and_mul_16_rows(const uint16_t *x, uint16_t *out, int64_t n, int dtype, int gelu, int64_t first, int64_t last) {
    if (gelu)
        for (int64_t r = first; r < last; r++) gated_row_16(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, dtype, 1);
    else
        for (int64_t r = first; r < last; r++) gated_row_16(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, dtype, 0);
}

static void gated_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype, int gelu) {
    if (rows > 1 && rows * n >= GATED_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            gated_and_mul_16_rows(x, out, n, dtype, gelu, r, r + 1);
    } else {
        gated_and_mul_16_rows(x, out, n, dtype, gelu, 0, rows);
    }
}

/* out[r, i] = round(round(silu(x[r, i])) * x[r, n + i]) for x of [rows, 2n] (torch: F.silu(gate) * up). */
void silu_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype) {
    gated_and_mul_16(x, out, rows, n, dtype, 0);
}

/* out[r, i] = round(round(gelu_tanh(x[r, i])) * x[r, n + i]) for x of [rows, 2n] (torch: F.gelu(gate,
 * approximate="tanh") * up). */
void gelu_tanh_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype) {
    gated_and_mul_16(x, out, rows, n, dtype, 1);
}
