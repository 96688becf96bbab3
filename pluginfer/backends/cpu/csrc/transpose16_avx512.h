/* 16 vectors of 16 dwords (float32 or int32 lanes) transposed in registers, 64 shuffles: r[q] lane c becomes r[c]
 * lane q. Shared by the int8 panel GEMM's weight blocks (quant_panel_avx512.h) and prefill_attention.c's queries. */
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + q], 128-bit lane L: dword 4L + q of rows 4i .. 4i + 3 */
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int q = 0; q < 4; q++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i a = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x44), b = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xEE);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x44);
        const __m512i d = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xEE);
        t[q] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[4 + q] = _mm512_shuffle_i32x4(a, c, 0xDD);
        t[8 + q] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[12 + q] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif
