/* One block of 32 activations quantized to int8 as llama.cpp's quantize_row_q8_0, on AVX-512: the one
 * rounding the fused quantized matmuls share (quant_dot.c's AVX-512 records and amx_quant.c's tiles must
 * quantize alike bit for bit; tests/backends/test_native_amx_quant.py checks it). Include it where
 * AVX-512F is compiled in, after <immintrin.h>. */
#pragma once

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* x[0..31] to levels q0 (x[0..15]) and q1 (x[16..31]) and their sum; returns the scale d = max|x| / 127,
 * the levels rounded half to even from x * (127 / max|x|). A block with an infinity or a NaN gets a NaN
 * scale and zero levels; one whose 127 / max|x| overflows (max|x| below ~3.7e-37) is zeros with scale 0. */
static inline float q8_block_avx512(const float *x, __m128i *q0, __m128i *q1, int32_t *sum) {
    const __m512 sign = _mm512_set1_ps(-0.0f), largest = _mm512_set1_ps(FLT_MAX);
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
    /* not <= FLT_MAX: an infinity or a NaN (which max would drop) */
    const __mmask16 bad = _mm512_cmp_ps_mask(a0, largest, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, largest, _CMP_NLE_UQ);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    if (bad) {
        d = NAN;
        id = 0.0f;
    } else if (!(id <= FLT_MAX)) {
        d = 0.0f;
        id = 0.0f;
    }
    const __m512 scale = _mm512_set1_ps(id);
    const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *q0 = _mm512_cvtsepi32_epi8(i0);
    *q1 = _mm512_cvtsepi32_epi8(i1);
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    if (bad) {
        *q0 = *q1 = _mm_setzero_si128();
        *sum = 0;
    }
    return d;
}
