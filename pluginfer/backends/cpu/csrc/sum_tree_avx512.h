/* The sum of an AVX-512 vector's 16 float lanes by one fixed tree, alone or four vectors at once, shared by
 * half_linear.c and quant_dot.c. Include it where AVX-512F is compiled in, after <immintrin.h>. */
#pragma once

#include <immintrin.h>

/* The tree: halves of 256 bits, of 128, then lanes (0 + 2, 1 + 3), then 0 + 1 (the tree of GCC's
 * _mm512_reduce_add_ps). */
static inline float sum_tree_avx512(__m512 v) {
    const __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                    _mm512_castps512_ps256(v));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* Four vectors' sums by the same tree at once (one set of shuffles and adds for the four): out[0..3], each the
 * bits sum_tree_avx512 gives. */
static inline void sum_tree4_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    /* per vector: its high 256 bits plus its low 256 (a and b in one register, c and d in another) */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0xEE), _mm512_shuffle_f32x4(a, b, 0x44));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0xEE), _mm512_shuffle_f32x4(c, d, 0x44));
    /* 128-bit lane v: vector v's high 128 of those plus its low 128 */
    const __m512 t6 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0xDD), _mm512_shuffle_f32x4(ab, cd, 0x88));
    const __m512 t8 = _mm512_add_ps(t6, _mm512_permute_ps(t6, 0x4E));  /* lanes (0 + 2, 1 + 3) */
    const __m512 r = _mm512_add_ps(t8, _mm512_permute_ps(t8, 0xB1));   /* lane 0: 0 + 1 */
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0,
                                                                                       0, 0, 0, 0, 0, 0), r)));
}
