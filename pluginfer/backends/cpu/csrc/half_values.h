/* float16 / bfloat16 values widened to float32 and rounded back, shared by the 16-bit kernels
 * (attention.c, norm.c, activation.c, rotary.c) and the GGML dequantization (dequant.c).
 *
 *
 * The same ops on float16 (dtype 1) or bfloat16 (dtype 2) tensors: each value is widened to float32 as it
 * is loaded (exactly), the arithmetic is float32, and each result is rounded to the 16-bit type (to
 * nearest even, as torch's .to() does) where torch's 16-bit reference rounds it: rms_norm_16 and
 * silu_and_mul_16 round where layers/norm.py and layers/activation.py do, rotary_neox_16 rotates in
 * float32 with float32 cos/sin and rounds once, paged_decode_attention_16 is paged_decode_attention's
 * arithmetic (the same operations in the same order) on the widened values, rounded once. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* IEEE half to float, exact for every input (subnormals, infinities; a NaN keeps its payload and
 * gets the quiet bit, as F16C's vcvtph2ps does). */
static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 value; /* fcvt: exact, a NaN quieted with its payload, as vcvtph2ps */
    memcpy(&value, &h, sizeof value);
    return (float)value;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13) | (mantissa ? 0x400000 : 0);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) { m <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

enum { HALF_F16 = 1, HALF_BF16 = 2 };

static inline float load16(const uint16_t *p, int dtype) {
    if (dtype == HALF_F16) return half_to_float((const uint8_t *)p);
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to IEEE half bits, round to nearest even (overflow to inf; a NaN stays a quiet NaN). */
static inline uint16_t half_round(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#elif defined(__aarch64__)
    const __fp16 value = (__fp16)f; /* fcvt in the default rounding mode, to nearest even */
    uint16_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((a >> 13) & 0x3FF));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds past 65504 */
    if (a >= 0x38800000u) {                                  /* normal half */
        const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
    }
    if (a < 0x33000000u) return sign; /* below half the smallest subnormal */
    const uint32_t exponent = a >> 23, mantissa = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - exponent;
    uint32_t value = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (value & 1u))) value++;
    return (uint16_t)(sign | value);
#endif
}

/* float32 to bfloat16 bits, round to nearest even, as torch's .to(torch.bfloat16) (every NaN becomes 0xFFFF). */
static inline uint16_t bfloat_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFF : rounded;
}

static inline uint16_t store16(float f, int dtype) { return dtype == HALF_F16 ? half_round(f) : bfloat_round(f); }

/* f rounded to the 16-bit type, as float32 again (a rounding torch's 16-bit reference makes mid-way). */
static inline float round16(float f, int dtype) {
    const uint16_t bits = store16(f, dtype);
    return load16(&bits, dtype);
}

/* n values widened exactly into out, as load16 does each; 8 at a time with AVX2 and F16C, by NEON's fcvtl on
 * ARM (a conversion per value in software made a float16 cache's portable decode attention slower than a float32
 * cache's). */
static inline void widen16_row(const uint16_t *in, float *out, int64_t n, int dtype) {
    int64_t j = 0;
#if defined(__aarch64__)
    if (dtype == HALF_F16) {
        for (; j < n; j++) { /* vectorized by the compiler */
            __fp16 value;
            memcpy(&value, in + j, sizeof value);
            out[j] = (float)value;
        }
    } else {
        for (; j < n; j++) {
            const uint32_t bits = (uint32_t)in[j] << 16;
            memcpy(out + j, &bits, sizeof bits);
        }
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; j + 8 <= n; j += 8) {
        const __m128i bits = _mm_loadu_si128((const __m128i *)(in + j));
        _mm256_storeu_ps(out + j, dtype == HALF_F16 ? _mm256_cvtph_ps(bits)
                                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
    }
#endif
    for (; j < n; j++) out[j] = load16(in + j, dtype);
}

#if defined(__AVX512F__)
static inline __m512 widen16_ps(__m256i bits, int dtype) {
    if (dtype == HALF_F16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 values at element index of a float32 (kind 0), float16 (1) or bfloat16 (2) cache, widened exactly (the
 * attention kernels: always inlined with a constant kind, so the float32 kernels' code has no branch). */
static inline __attribute__((always_inline)) __m512 load_cache_ps(const void *cache, int64_t index, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)cache + index);
    return widen16_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index)), kind);
}

/* 16 floats to 16-bit bits, as store16 does each. */
static inline __m256i narrow16_ps(__m512 v, int dtype) {
    if (dtype == HALF_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(rounded);
}
#endif
