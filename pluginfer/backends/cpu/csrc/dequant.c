/* Dequantization of the cpu backend (ops.py: ggml_dequantize, grouped_dequantize, int4_dequantize):
 * llama.cpp's GGML blocks, GPTQ/AWQ groups and the int4 method's rows, to float32 or bfloat16. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "half_values.h"

/* ggml_dequantize_rows: contiguous rows of raw llama.cpp blocks (row_bytes each) to float32 [rows, cols],
 * bit-exact with pluginfer.quant.ggml_blocks.dequantize: every value is formed by the same float32
 * operations in the same order (e.g. Q4_K: dl = d * sc, ml = dmin * m, then q * dl - ml, two
 * roundings). That relies on no contraction into FMA: -std=c11 makes gcc's default
 * -ffp-contract=off. Types are gguf's GGMLQuantizationType values; returns -1 for any other, -2
 * when cols is not whole blocks filling row_bytes. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10,
       GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

/* float32 to bfloat16 bits, round to nearest even, as torch's Tensor.to(torch.bfloat16) does on this
 * CPU (subnormals kept, not flushed as vcvtneps2bf16 would; every NaN becomes 0xFFFF, torch's choice).
 * Plain integer arithmetic: gcc vectorises the loops that call it. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFF : rounded;
}

/* Each block function writes float32 y or, when y is NULL, bfloat16 bits z (bf16_round of the same
 * float32 value). Always inlined with one of the two a literal NULL, so the test folds away and each
 * version vectorises on its own: the bfloat16 tile is written once, with no float32 copy of it. */
#define STORE(index, value)                                    \
    do {                                                       \
        const float stored_ = (value);                         \
        if (y != NULL) y[index] = stored_;                     \
        else z[index] = bf16_round(stored_);                   \
    } while (0)
#define BLOCK_FUNCTION static inline __attribute__((always_inline)) void

/* The loops below run over the 32 (or 32 of 256) weights with per-lane selects (j < 16 ? ...):
 * gcc 12 vectorises them well, better than two loops of 16 or an unpacking loop first.
 * Weight j of a 32-weight block with nibbles: low nibble of byte j, or high nibble of byte j - 16. */
#define NIBBLE(qs, j) ((j) < 16 ? (qs)[j] & 0x0F : (qs)[(j) - 16] >> 4)

BLOCK_FUNCTION dequantize_q4_0(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; j++) {
        const int level = NIBBLE(b + 2, j) - 8;
        STORE(j, (float)level * d);
    }
}

BLOCK_FUNCTION dequantize_q4_1(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int j = 0; j < 32; j++) {
        const int level = NIBBLE(b + 4, j);
        const float t = (float)level * d;
        STORE(j, t + m);
    }
}

static inline uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

BLOCK_FUNCTION dequantize_q5_0(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b);
    const uint32_t qh = load_u32(b + 2);
    for (int j = 0; j < 32; j++) STORE(j, (float)((NIBBLE(b + 6, j) | (int)((qh >> j) & 1) << 4) - 16) * d);
}

BLOCK_FUNCTION dequantize_q5_1(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const uint32_t qh = load_u32(b + 4);
    for (int j = 0; j < 32; j++) {
        const float t = (float)(NIBBLE(b + 8, j) | (int)((qh >> j) & 1) << 4) * d;
        STORE(j, t + m);
    }
}

BLOCK_FUNCTION dequantize_q8_0(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) STORE(j, (float)q[j] * d);
}

/* 256 weights, 16 sub-blocks of 16: scale nibble low, min nibble high; 2-bit levels in two halves of
 * 32 bytes, four planes each (weight h*128 + p*32 + j is bits 2p of qs[h*32 + j]). */
BLOCK_FUNCTION dequantize_q2_k(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int p = 0; p < 8; p++) { /* 32 weights: sub-blocks 2p and 2p + 1 */
        const float dl0 = d * (float)(scales[2 * p] & 0x0F), ml0 = dmin * (float)(scales[2 * p] >> 4);
        const float dl1 = d * (float)(scales[2 * p + 1] & 0x0F), ml1 = dmin * (float)(scales[2 * p + 1] >> 4);
        const uint8_t *q = qs + (p / 4) * 32;
        const int shift = 2 * (p % 4);
        for (int j = 0; j < 32; j++) {
            const float t = (float)((q[j] >> shift) & 3) * (j < 16 ? dl0 : dl1);
            STORE(p * 32 + j, t - (j < 16 ? ml0 : ml1));
        }
    }
}

/* Q3_K: as Q2_K's planes, minus 4 where the weight's bit in hmask (bit e / 32 of byte e % 32) is 0. */
BLOCK_FUNCTION dequantize_q3_k(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
    const float d = half_to_float(b + 108);
    float dl[16];
    for (int s = 0; s < 16; s++) {
        const int low = (packed[s % 8] >> (4 * (s / 8))) & 0x0F;
        const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        dl[s] = d * (float)((int8_t)(low | high << 4) - 32);
    }
    for (int p = 0; p < 8; p++) {
        const uint8_t *q = qs + (p / 4) * 32;
        const int shift = 2 * (p % 4);
        const float dl0 = dl[2 * p], dl1 = dl[2 * p + 1];
        for (int j = 0; j < 32; j++) {
            const int level = ((q[j] >> shift) & 3) - (((hmask[j] >> p) & 1) ? 0 : 4);
            STORE(p * 32 + j, (float)level * (j < 16 ? dl0 : dl1));
        }
    }
}

/* get_scale_min_k4: Q4_K/Q5_K's 12 bytes to sub-block j's six-bit scale and min. */
static inline void k_scale_min(const uint8_t *packed, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = packed[j] & 0x3F;
        *min = packed[j + 4] & 0x3F;
    } else {
        *scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 2) & 0x30);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 2) & 0x30);
    }
}

BLOCK_FUNCTION dequantize_q4_k(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qs = b + 16;
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        const float dl = d * (float)scale, ml = dmin * (float)min;
        const uint8_t *q = qs + (s / 2) * 32;
        const int shift = 4 * (s % 2);
        for (int j = 0; j < 32; j++) {
            const float t = (float)((q[j] >> shift) & 0x0F) * dl;
            STORE(s * 32 + j, t - ml);
        }
    }
}

BLOCK_FUNCTION dequantize_q5_k(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        const float dl = d * (float)scale, ml = dmin * (float)min;
        const uint8_t *q = qs + (s / 2) * 32;
        const int shift = 4 * (s % 2);
        for (int j = 0; j < 32; j++) {
            const int level = ((q[j] >> shift) & 0x0F) | ((qh[j] >> s) & 1) << 4;
            const float t = (float)level * dl;
            STORE(s * 32 + j, t - ml);
        }
    }
}

/* Weight h*128 + e (e < 128): low nibble e / 64 of ql[h*64 + e % 64], two high bits 2 (e / 32) of
 * qh[h*32 + e % 32]; sub-block of 16 weights (h*128 + e) / 16 has an int8 scale. */
BLOCK_FUNCTION dequantize_q6_k(const uint8_t *restrict b, float *restrict y, uint16_t *restrict z) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int p = 0; p < 8; p++) { /* 32 weights e0 = 32 (p % 4) .. + 31 of half h = p / 4 */
        const int h = p / 4, e0 = 32 * (p % 4);
        const float dl0 = d * (float)scales[2 * p], dl1 = d * (float)scales[2 * p + 1];
        const uint8_t *low = ql + h * 64 + e0 % 64, *high = qh + h * 32;
        const int low_shift = 4 * (e0 / 64), high_shift = 2 * (e0 / 32);
        for (int j = 0; j < 32; j++) {
            const int level = (((low[j] >> low_shift) & 0x0F) | ((high[j] >> high_shift) & 3) << 4) - 32;
            STORE(p * 32 + j, (float)level * (j < 16 ? dl0 : dl1));
        }
    }
}

/* One row of blocks; the block function is inlined into the loop (no call per block). */
#define DEQUANTIZE_ROW(block, weights, type_size)                                                 \
    for (int64_t i = 0; i < cols / (weights); i++) block(row + i * (type_size), y + i * (weights), NULL)
#define DEQUANTIZE_ROW_BF16(block, weights, type_size)                                            \
    for (int64_t i = 0; i < cols / (weights); i++) block(row + i * (type_size), NULL, yb + i * (weights))

static int ggml_block_shape(int type, int64_t *weights, int64_t *type_size) {
    switch (type) {
    case GGML_Q4_0: *weights = 32; *type_size = 18; return 0;
    case GGML_Q4_1: *weights = 32; *type_size = 20; return 0;
    case GGML_Q5_0: *weights = 32; *type_size = 22; return 0;
    case GGML_Q5_1: *weights = 32; *type_size = 24; return 0;
    case GGML_Q8_0: *weights = 32; *type_size = 34; return 0;
    case GGML_Q2_K: *weights = 256; *type_size = 84; return 0;
    case GGML_Q3_K: *weights = 256; *type_size = 110; return 0;
    case GGML_Q4_K: *weights = 256; *type_size = 144; return 0;
    case GGML_Q5_K: *weights = 256; *type_size = 176; return 0;
    case GGML_Q6_K: *weights = 256; *type_size = 210; return 0;
    default: return -1;
    }
}

int ggml_dequantize_rows(int type, const uint8_t *raw, int64_t rows, int64_t row_bytes, int64_t cols, float *out) {
    int64_t weights, type_size;
    if (ggml_block_shape(type, &weights, &type_size)) return -1;
    if (cols % weights || cols / weights * type_size != row_bytes) return -2;
#pragma omp parallel for if (rows * cols >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * row_bytes;
        float *y = out + r * cols;
        switch (type) {
        case GGML_Q4_0: DEQUANTIZE_ROW(dequantize_q4_0, 32, 18); break;
        case GGML_Q4_1: DEQUANTIZE_ROW(dequantize_q4_1, 32, 20); break;
        case GGML_Q5_0: DEQUANTIZE_ROW(dequantize_q5_0, 32, 22); break;
        case GGML_Q5_1: DEQUANTIZE_ROW(dequantize_q5_1, 32, 24); break;
        case GGML_Q8_0: DEQUANTIZE_ROW(dequantize_q8_0, 32, 34); break;
        case GGML_Q2_K: DEQUANTIZE_ROW(dequantize_q2_k, 256, 84); break;
        case GGML_Q3_K: DEQUANTIZE_ROW(dequantize_q3_k, 256, 110); break;
        case GGML_Q4_K: DEQUANTIZE_ROW(dequantize_q4_k, 256, 144); break;
        case GGML_Q5_K: DEQUANTIZE_ROW(dequantize_q5_k, 256, 176); break;
        case GGML_Q6_K: DEQUANTIZE_ROW(dequantize_q6_k, 256, 210); break;
        }
    }
    return 0;
}

#if defined(__AVX512F__)
/* Q4_0, Q8_0, Q4_K and Q6_K (the Q4_0, Q8_0 and Q4_K_M files' types) to bfloat16 with AVX-512, 16 weights
 * at a time: the same float32 operations per weight as dequantize_q4_0 ... dequantize_q6_k, each rounded as
 * bf16_round rounds it (as torch's vectorised conversion does: add 0x7FFF plus the kept lowest bit, shift,
 * NaN to 0xFFFF): the generic versions were slower to bfloat16 than to float32 for these types. */
static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

static inline void dequantize_q4_0_bf16_avx512(const uint8_t *restrict b, uint16_t *restrict z) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    const __m512i q = bytes16(b + 2), eight = _mm512_set1_epi32(8);
    const __m512i low = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight);
    const __m512i high = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
    _mm256_storeu_si256((__m256i *)z, bf16_round16(_mm512_mul_ps(_mm512_cvtepi32_ps(low), d)));
    _mm256_storeu_si256((__m256i *)(z + 16), bf16_round16(_mm512_mul_ps(_mm512_cvtepi32_ps(high), d)));
}

static inline void dequantize_q8_0_bf16_avx512(const uint8_t *restrict b, uint16_t *restrict z) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    for (int h = 0; h < 2; h++) {
        const __m512i level = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * h)));
        _mm256_storeu_si256((__m256i *)(z + 16 * h), bf16_round16(_mm512_mul_ps(_mm512_cvtepi32_ps(level), d)));
    }
}

static inline void dequantize_q4_k_bf16_avx512(const uint8_t *restrict b, uint16_t *restrict z) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qs = b + 16;
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        const __m512 dl = _mm512_set1_ps(d * (float)scale), ml = _mm512_set1_ps(dmin * (float)min);
        const uint8_t *q = qs + (s / 2) * 32;
        const __m128i shift = _mm_cvtsi32_si128(4 * (s % 2));
        for (int h = 0; h < 2; h++) {
            const __m512i level = _mm512_and_si512(_mm512_srl_epi32(bytes16(q + 16 * h), shift), _mm512_set1_epi32(0x0F));
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(level), dl);
            _mm256_storeu_si256((__m256i *)(z + s * 32 + 16 * h), bf16_round16(_mm512_sub_ps(t, ml)));
        }
    }
}

static inline void dequantize_q6_k_bf16_avx512(const uint8_t *restrict b, uint16_t *restrict z) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int p = 0; p < 8; p++) {
        const int h = p / 4, e0 = 32 * (p % 4);
        const uint8_t *low = ql + h * 64 + e0 % 64, *high = qh + h * 32;
        const __m128i low_shift = _mm_cvtsi32_si128(4 * (e0 / 64)), high_shift = _mm_cvtsi32_si128(2 * (e0 / 32));
        for (int half = 0; half < 2; half++) {
            const __m512 dl = _mm512_set1_ps(d * (float)scales[2 * p + half]);
            const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(bytes16(low + 16 * half), low_shift),
                                                _mm512_set1_epi32(0x0F));
            const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(bytes16(high + 16 * half), high_shift),
                                                _mm512_set1_epi32(3));
            const __m512i level = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
            _mm256_storeu_si256((__m256i *)(z + p * 32 + 16 * half),
                                bf16_round16(_mm512_mul_ps(_mm512_cvtepi32_ps(level), dl)));
        }
    }
}
#endif

/* ggml_dequantize_rows_bf16: as ggml_dequantize_rows, to bfloat16 bits [rows, cols]: every value is
 * ggml_dequantize_rows' float32 value rounded to nearest even (bf16_round), so it equals
 * torch's dequantize(...).to(torch.bfloat16) bit for bit. Same return codes. */
int ggml_dequantize_rows_bf16(int type, const uint8_t *raw, int64_t rows, int64_t row_bytes, int64_t cols,
                              uint16_t *out) {
    int64_t weights, type_size;
    if (ggml_block_shape(type, &weights, &type_size)) return -1;
    if (cols % weights || cols / weights * type_size != row_bytes) return -2;
#pragma omp parallel for if (rows * cols >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * row_bytes;
        uint16_t *yb = out + r * cols;
        switch (type) {
        case GGML_Q4_1: DEQUANTIZE_ROW_BF16(dequantize_q4_1, 32, 20); break;
        case GGML_Q5_0: DEQUANTIZE_ROW_BF16(dequantize_q5_0, 32, 22); break;
        case GGML_Q5_1: DEQUANTIZE_ROW_BF16(dequantize_q5_1, 32, 24); break;
        case GGML_Q2_K: DEQUANTIZE_ROW_BF16(dequantize_q2_k, 256, 84); break;
        case GGML_Q3_K: DEQUANTIZE_ROW_BF16(dequantize_q3_k, 256, 110); break;
#if defined(__AVX512F__)
        case GGML_Q4_0:
            for (int64_t i = 0; i < cols / 32; i++) dequantize_q4_0_bf16_avx512(row + i * 18, yb + i * 32);
            break;
        case GGML_Q8_0:
            for (int64_t i = 0; i < cols / 32; i++) dequantize_q8_0_bf16_avx512(row + i * 34, yb + i * 32);
            break;
        case GGML_Q4_K:
            for (int64_t i = 0; i < cols / 256; i++) dequantize_q4_k_bf16_avx512(row + i * 144, yb + i * 256);
            break;
        case GGML_Q6_K:
            for (int64_t i = 0; i < cols / 256; i++) dequantize_q6_k_bf16_avx512(row + i * 210, yb + i * 256);
            break;
#else
        case GGML_Q4_0: DEQUANTIZE_ROW_BF16(dequantize_q4_0, 32, 18); break;
        case GGML_Q8_0: DEQUANTIZE_ROW_BF16(dequantize_q8_0, 32, 34); break;
        case GGML_Q4_K: DEQUANTIZE_ROW_BF16(dequantize_q4_k, 256, 144); break;
        case GGML_Q6_K: DEQUANTIZE_ROW_BF16(dequantize_q6_k, 256, 210); break;
#endif
        case GGML_Q5_K: DEQUANTIZE_ROW_BF16(dequantize_q5_k, 256, 176); break;
        }
    }
    return 0;
}

/* grouped_dequantize: output columns [start, stop) of the group-quantized layout GPTQ and AWQ keep
 * (pluginfer.quant.packing): qweight int32 [in / pack, out] packed along the inputs, qzeros int32
 * [groups, zero_words] packed along the outputs, scales [groups, out] (scale_type 0 float32, 1
 * float16, 2 bfloat16), g_idx int32 [in] or NULL (then input i is in group i / (in / groups)).
 * Writes float32 [in, stop - start] (the transposed tile), each value (q - zero) * scale as
 * GroupQuantLinear.dequantize_columns forms it: q - zero is exact, so one rounding, bit-exact.
 * bf16 nonzero: out is bfloat16 bits, each value that float32 rounded to nearest even (bf16_round).
 * Returns -1 for bits other than 4 or 8, -2 for column bounds that are not whole words, -3 when
 * the per-group buffers cannot be allocated. */
static inline float scale_to_float(const void *scales, int scale_type, int64_t index) {
    if (scale_type == 1) return half_to_float((const uint8_t *)scales + 2 * index);
    if (scale_type == 2) {
        const uint32_t bits = (uint32_t)((const uint16_t *)scales)[index] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)scales)[index];
}

int grouped_dequantize(int bits, const int32_t *qweight, const int32_t *qzeros, const void *scales,
                       int scale_type, const int32_t *g_idx, int64_t in, int64_t out_features, int64_t groups,
                       int64_t zero_words, int64_t start, int64_t stop, void *out, int bf16) {
    if (bits != 4 && bits != 8) return -1;
    const int64_t pack = 32 / bits, rows = stop - start, group_size = in / groups;
    const uint32_t mask = (1u << bits) - 1;
    if (start % pack || stop % pack || rows <= 0 || stop > out_features) return -2;
    /* Every group's zero points and scales for this tile, as floats (exact for both). */
    float *zero = malloc(sizeof(float) * groups * rows), *scale = malloc(sizeof(float) * groups * rows);
    if (zero == NULL || scale == NULL) {
        free(zero);
        free(scale);
        return -3;
    }
#pragma omp parallel for if (groups * rows >= (1 << 14))
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < rows; c++) {
            const int64_t o = start + c;
            const uint32_t word = (uint32_t)qzeros[g * zero_words + o / pack];
            zero[g * rows + c] = (float)((word >> ((o % pack) * bits)) & mask);
            scale[g * rows + c] = scale_to_float(scales, scale_type, g * out_features + o);
        }
    }
#pragma omp parallel for if (in * rows >= (1 << 16))
    for (int64_t p = 0; p < in / pack; p++) {
        const uint32_t *restrict words = (const uint32_t *)qweight + p * out_features + start;
        for (int64_t k = 0; k < pack; k++) {
            const int64_t i = p * pack + k;
            const int64_t g = g_idx != NULL ? g_idx[i] : i / group_size;
            const float *restrict z = zero + g * rows, *restrict s = scale + g * rows;
            const int shift = (int)(k * bits);
            if (bf16) {
                uint16_t *restrict y = (uint16_t *)out + i * rows;
                for (int64_t c = 0; c < rows; c++) {
                    const float q = (float)((words[c] >> shift) & mask);
                    y[c] = bf16_round((q - z[c]) * s[c]);
                }
            } else {
                float *restrict y = (float *)out + i * rows;
                for (int64_t c = 0; c < rows; c++) {
                    const float q = (float)((words[c] >> shift) & mask);
                    y[c] = (q - z[c]) * s[c];
                }
            }
        }
    }
    free(zero);
    free(scale);
    return 0;
}

/* int4_dequantize_rows: rows of the int4 method's layout (pluginfer.quant.int4): qweight uint8
 * [rows, in / 2], input 2j in the low nibble of byte j and 2j + 1 in the high one; scales and zeros
 * float16 [rows, in / group]. Writes float32 [rows, in], q * scale + zero with dequantize_int4's
 * two roundings (no FMA: -std=c11); bf16 nonzero: bfloat16 bits, those values rounded to nearest even.
 * Returns -2 when group is not even or does not divide in. */
int int4_dequantize_rows(const uint8_t *qweight, const uint8_t *scales, const uint8_t *zeros, int64_t rows,
                         int64_t in, int64_t group, void *out, int bf16) {
    if (group <= 0 || group % 2 || in % group) return -2;
    const int64_t groups = in / group;
#pragma omp parallel for if (rows * in >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float s = half_to_float(scales + 2 * (r * groups + g)), z = half_to_float(zeros + 2 * (r * groups + g));
            const uint8_t *restrict b = qweight + r * (in / 2) + g * (group / 2);
            if (bf16) {
                uint16_t *restrict y = (uint16_t *)out + r * in + g * group;
                for (int64_t k = 0; k < group / 2; k++) {
                    const float low = (float)(b[k] & 0x0F) * s, high = (float)(b[k] >> 4) * s;
                    y[2 * k] = bf16_round(low + z);
                    y[2 * k + 1] = bf16_round(high + z);
                }
                continue;
            }
            float *restrict y = (float *)out + r * in + g * group;
            for (int64_t k = 0; k < group / 2; k++) {  /* pairs: gcc vectorises this with interleaved stores */
                const float low = (float)(b[k] & 0x0F) * s, high = (float)(b[k] >> 4) * s;
                y[2 * k] = low + z;
                y[2 * k + 1] = high + z;
            }
        }
    }
    return 0;
}
