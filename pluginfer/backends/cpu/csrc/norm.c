/* RMSNorm of the cpu backend (ops.py: rms_norm), float32 and 16-bit. */
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
#define NORM_PARALLEL_VALUES (1 << 14)

/* rms_norm: out = (src * rsqrt(mean(src^2) + eps)) * (weight + offset), src = x, or x + residual
 * written back into residual when residual is given (the fused residual add of pre-norm blocks). */
static __attribute__((noinline)) void
rms_norm_rows(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
              float offset, int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
        const float *in = x + r * cols;
        float *src = residual ? residual + r * cols : (float *)in;
        float sum = 0.0f;
        if (residual) {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < cols; i++) {
                src[i] = in[i] + src[i];
                sum += src[i] * src[i];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < cols; i++) sum += src[i] * src[i];
        }
        const float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
        float *o = out + r * cols;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) o[i] = (src[i] * inverse) * (weight[i] + offset);
    }
}

void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
              float offset) {
    if (rows > 1 && rows * cols >= NORM_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            rms_norm_rows(x, residual, weight, out, rows, cols, eps, offset, r, r + 1);
    } else {
        rms_norm_rows(x, residual, weight, out, rows, cols, eps, offset, 0, rows);
    }
}

/* out = round(round(src * rsqrt(mean(src^2) + eps)) * weight) (offset 0), or round(src * rsqrt(..) *
 * (weight + offset)); src = x, or round(x + residual) written back into residual. */
static __attribute__((noinline)) void
rms_norm_16_rows(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t cols, float eps, float offset, int dtype, int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
        const uint16_t *in = x + r * cols;
        uint16_t *o = out + r * cols;
        float sum = 0.0f;
        int64_t i = 0;
#if defined(__AVX512F__)
        if (cols >= 16) { /* 16 at a time, the tail below; the sum in another order than torch's (as ever) */
            const int64_t body = cols / 16 * 16;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < body; j += 16) {
                __m256i bits = _mm256_loadu_si256((const __m256i *)(in + j));
                if (residual) {
                    uint16_t *res = residual + r * cols + j;
                    bits = narrow16_ps(_mm512_add_ps(widen16_ps(bits, dtype),
                                                     widen16_ps(_mm256_loadu_si256((const __m256i *)res), dtype)), dtype);
                    _mm256_storeu_si256((__m256i *)res, bits);
                }
                const __m512 v = widen16_ps(bits, dtype);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            const uint16_t *src = residual ? residual + r * cols : in;
            for (int64_t j = body; j < cols; j++) {
                if (residual) residual[r * cols + j] = store16(load16(in + j, dtype) + load16(residual + r * cols + j, dtype), dtype);
                const float v = load16(src + j, dtype);
                sum += v * v;
            }
            sum += _mm512_reduce_add_ps(acc);
            const float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
            const __m512 vinverse = _mm512_set1_ps(inverse), voffset = _mm512_set1_ps(offset);
            for (int64_t j = 0; j < body; j += 16) {
                const __m512 normed = _mm512_mul_ps(widen16_ps(_mm256_loadu_si256((const __m256i *)(src + j)), dtype),
                                                    vinverse);
                const __m512 w = widen16_ps(_mm256_loadu_si256((const __m256i *)(weight + j)), dtype);
                const __m512 y = offset != 0.0f ? _mm512_mul_ps(normed, _mm512_add_ps(w, voffset))
                                                : _mm512_mul_ps(widen16_ps(narrow16_ps(normed, dtype), dtype), w);
                _mm256_storeu_si256((__m256i *)(o + j), narrow16_ps(y, dtype));
            }
            for (int64_t j = body; j < cols; j++)
                o[j] = offset != 0.0f ? store16((load16(src + j, dtype) * inverse) * (load16(weight + j, dtype) + offset), dtype)
                                      : store16(round16(load16(src + j, dtype) * inverse, dtype) * load16(weight + j, dtype), dtype);
            continue;
        }
#endif
        if (residual) {
            uint16_t *res = residual + r * cols;
            for (i = 0; i < cols; i++) {
                res[i] = store16(load16(in + i, dtype) + load16(res + i, dtype), dtype);
                const float v = load16(res + i, dtype);
                sum += v * v;
            }
            in = res;
        } else {
            for (i = 0; i < cols; i++) {
                const float v = load16(in + i, dtype);
                sum += v * v;
            }
        }
        const float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
        if (offset != 0.0f) {
            for (i = 0; i < cols; i++)
                o[i] = store16((load16(in + i, dtype) * inverse) * (load16(weight + i, dtype) + offset), dtype);
        } else {
            for (i = 0; i < cols; i++) {
                o[i] = store16(round16(load16(in + i, dtype) * inverse, dtype) * load16(weight + i, dtype), dtype);
            }
        }
    }
}

void rms_norm_16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t cols, float eps, float offset, int dtype) {
    if (rows > 1 && rows * cols >= NORM_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            rms_norm_16_rows(x, residual, weight, out, rows, cols, eps, offset, dtype, r, r + 1);
    } else {
        rms_norm_16_rows(x, residual, weight, out, rows, cols, eps, offset, dtype, 0, rows);
    }
}
