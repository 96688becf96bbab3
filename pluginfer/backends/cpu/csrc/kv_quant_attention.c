/* Quantized KV caches of the cpu backend (kv_quant.py): the write that quantizes, and paged attention that
 * reads the 1-byte codes in place, for decode and prefill rows alike.
 *
 * A cache row (one token, one KV head; pluginfer/core/kv_quant.py) is dim codes then the float32 scale:
 * value = code * scale. kind 0: int8 codes; 1: float8 E4M3 (bias 7, max 448); 2: float8 E5M2 (bias 15,
 * max 57344). Codes are widened in registers: int8 by sign extension; E5M2 is the high byte of an IEEE half;
 * E4M3's bits shifted into a half's place read as value * 2^-8 for normals and subnormals alike, the 2^8
 * folded into the row's scale. The scale multiplies a key's dot product and a value's softmax weight, never
 * each feature.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "exp_avx512.h"
#include "half_values.h"

enum { KV_INT8 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

static const float CODE_MAX[3] = {127.0f, 448.0f, 57344.0f};
/* A code's widened value times this is its real value over the scale (E4M3 widens to value * 2^-8). */
static const float WIDE_FACTOR[3] = {1.0f, 256.0f, 1.0f};

/* float8 code of y (already within +-max), rounded to nearest even; mbits mantissa bits, exponent bias. */
static inline uint8_t fp8_encode(float y, int mbits, int bias) {
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    bits &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &bits, sizeof a);
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: steps of 2^(1 - bias - mbits); 2^mbits steps is the min normal */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.0f, bias - 1 + mbits));
    const int shift = 23 - mbits;
    bits += ((1u << (shift - 1)) - 1u) + ((bits >> shift) & 1u);
    const uint32_t exponent = (bits >> 23) - 127u + (uint32_t)bias, mantissa = (bits >> shift) & ((1u << mbits) - 1u);
    return sign | (uint8_t)((exponent << mbits) | mantissa);
}

static inline uint8_t encode(float y, int kind) {
    if (kind == KV_INT8) return (uint8_t)(int8_t)nearbyintf(y);
    return kind == KV_E4M3 ? fp8_encode(y, 3, 7) : fp8_encode(y, 2, 15);
}

/* A code widened to float32 (E4M3: value * 2^-8). */
static inline float widen(const uint8_t *p, int kind) {
    if (kind == KV_INT8) return (float)(int8_t)*p;
    const uint16_t half = kind == KV_E4M3 ? (uint16_t)(((*p & 0x80) << 8) | ((*p & 0x7F) << 7)) : (uint16_t)(*p << 8);
    uint8_t bytes[2] = {(uint8_t)(half & 0xFF), (uint8_t)(half >> 8)};
    return half_to_float(bytes);
}

static inline float row_scale(const uint8_t *row, int64_t dim) {
    float scale;
    memcpy(&scale, row + dim, sizeof scale);
    return scale;
}

/* Rows src[t * token_stride + h * dim + d] (float32) quantized into cache slot slots[t] (a negative slot is
 * a padding row: skipped). fixed: a scale per head, or NULL for each row's absmax / code max (1 for zeros).
 * Codes round to nearest even from x / scale, as core/kv_quant.py's quantize. */
int kv_quantize_rows(const float *src, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                     const int64_t *slots, const float *fixed, uint8_t *cache, int kind) {
    const float code_max = CODE_MAX[kind];
#pragma omp parallel for schedule(static) if (tokens * heads * dim > 65536)
    for (int64_t task = 0; task < tokens * heads; task++) {
        const int64_t t = task / heads, h = task % heads;
        if (slots[t] < 0) continue;
        const float *x = src + t * token_stride + h * dim;
        uint8_t *row = cache + (slots[t] * heads + h) * (dim + 4);
        float scale;
        if (fixed) {
            scale = fixed[h];
        } else {
            float absmax = 0.0f;
            for (int64_t d = 0; d < dim; d++) absmax = fmaxf(absmax, fabsf(x[d]));
            scale = absmax > 0.0f ? absmax / code_max : 1.0f;
        }
        for (int64_t d = 0; d < dim; d++) row[d] = encode(fminf(fmaxf(x[d] / scale, -code_max), code_max), kind);
        memcpy(row + dim, &scale, sizeof scale);
    }
    return 0;
}

/* Vectors of W floats: VF_* for the instruction set compiled for, and widen_vec for W codes. */
#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
#define VF_ZERO() _mm512_setzero_ps()
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VF_SET1(x) _mm512_set1_ps(x)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
static inline __attribute__((always_inline)) vf widen_vec(const uint8_t *p, int kind) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (kind == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    if (kind == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(half);
}
/* Lane j of the result: the sum of a[j]'s lanes (W dot products summed by one transpose-and-add tree). */
static inline vf sum_w(vf a[W]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define W 8
typedef __m256 vf;
#define VF_ZERO() _mm256_setzero_ps()
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VF_SET1(x) _mm256_set1_ps(x)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
static inline __attribute__((always_inline)) vf widen_vec(const uint8_t *p, int kind) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    if (kind == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m128i b = _mm_cvtepu8_epi16(bytes);
    if (kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(half);
}
static inline vf sum_w(vf a[W]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* What one task (a query token and a KV head) reads. */
typedef struct {
    const float *q;         /* the group's query heads, [group, head_dim] */
    float *o;               /* their outputs, [group, v_dim] */
    const uint8_t *keys;    /* key_cache */
    const uint8_t *values;  /* value_cache */
    const int64_t *rows;    /* cache row (slot * kv_heads + kv_head) of each position */
    float *scores;          /* [group, count] */
    int64_t count, group, head_dim, v_dim;
    float scale, soft_cap;
} task_t;

static void softmax_rows(float *scores, int64_t rows, int64_t count) {
    for (int64_t h = 0; h < rows; h++) {
        float *row = scores + h * count, max_score = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < count; i++) max_score = fmaxf(max_score, row[i]);
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vsum = _mm512_setzero_ps();
        for (; i + 16 <= count; i += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(max_score)));
            _mm512_storeu_ps(row + i, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
#endif
        for (; i < count; i++) sum += row[i] = expf(row[i] - max_score);
        const float inverse = 1.0f / sum;
        for (int64_t i = 0; i < count; i++) row[i] *= inverse;
    }
}

/* Scalar: any dims. */
static void attend_scalar(const task_t *t, int kind) {
    const int64_t ks = t->head_dim + 4, vs = t->v_dim + 4;
    for (int64_t i = 0; i < t->count; i++) {
        const uint8_t *k = t->keys + t->rows[i] * ks;
        const float factor = row_scale(k, t->head_dim) * WIDE_FACTOR[kind] * t->scale;
        for (int64_t g = 0; g < t->group; g++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < t->head_dim; d++) acc += t->q[g * t->head_dim + d] * widen(k + d, kind);
            float score = acc * factor;
            if (t->soft_cap > 0.0f) score = t->soft_cap * tanhf(score / t->soft_cap);
            t->scores[g * t->count + i] = score;
        }
    }
    softmax_rows(t->scores, t->group, t->count);
    memset(t->o, 0, sizeof(float) * (size_t)(t->group * t->v_dim));
    for (int64_t i = 0; i < t->count; i++) {
        const uint8_t *v = t->values + t->rows[i] * vs;
        const float factor = row_scale(v, t->v_dim) * WIDE_FACTOR[kind];
        for (int64_t g = 0; g < t->group; g++) {
            const float weight = t->scores[g * t->count + i] * factor;
            for (int64_t d = 0; d < t->v_dim; d++) t->o[g * t->v_dim + d] += weight * widen(v + d, kind);
        }
    }
}

#ifdef W
/* Scores W / 2 positions at a time: their keys widened once into kbuf (L1) for every query head of the group,
 * W dot products summed by one tree (sum_w) and scaled by each row's scale. Values: up to 4 query heads x 4
 * vectors of features in registers over every position, each value's codes widened once for them. */
static inline __attribute__((always_inline)) void attend_vec(const task_t *t, float *kbuf, const int kind) {
    const int64_t ks = t->head_dim + 4, vs = t->v_dim + 4;
    /* W / 2 positions x two query heads a tile: each widened key loaded once for both heads, the W dot products
     * summed by one tree (lanes below W / 2 the first head's); a lone last head pairs with itself. */
    enum { P = W / 2 };
    for (int64_t i0 = 0; i0 < t->count; i0 += P) {
        const int64_t n = t->count - i0 < P ? t->count - i0 : P;
        float factors[W], tile[W];
        for (int64_t j = 0; j < P; j++) {
            const uint8_t *k = t->keys + t->rows[i0 + (j < n ? j : 0)] * ks;
            for (int64_t d = 0; d < t->head_dim; d += W) VF_STORE(kbuf + j * t->head_dim + d, widen_vec(k + d, kind));
            factors[j] = factors[P + j] = row_scale(k, t->head_dim) * WIDE_FACTOR[kind] * t->scale;
        }
        for (int64_t g = 0; g < t->group; g += 2) {
            const int64_t h = g + 1 < t->group ? g + 1 : g;
            const float *qa = t->q + g * t->head_dim, *qb = t->q + h * t->head_dim;
            vf acc[W];
            for (int j = 0; j < W; j++) acc[j] = VF_ZERO();
            for (int64_t d = 0; d < t->head_dim; d += W) {
                const vf va = VF_LOAD(qa + d), vb = VF_LOAD(qb + d);
                for (int j = 0; j < P; j++) {
                    const vf kv = VF_LOAD(kbuf + j * t->head_dim + d);
                    acc[j] = VF_FMA(va, kv, acc[j]);
                    acc[P + j] = VF_FMA(vb, kv, acc[P + j]);
                }
            }
            VF_STORE(tile, VF_MUL(sum_w(acc), VF_LOAD(factors)));
            for (int64_t j = 0; j < n; j++) {
                const float sa = tile[j], sb = tile[P + j];
                t->scores[g * t->count + i0 + j] = t->soft_cap > 0.0f ? t->soft_cap * tanhf(sa / t->soft_cap) : sa;
                t->scores[h * t->count + i0 + j] = t->soft_cap > 0.0f ? t->soft_cap * tanhf(sb / t->soft_cap) : sb;
            }
        }
    }
    softmax_rows(t->scores, t->group, t->count);
    /* 4 heads x 4 vectors of value features in registers over every position */
    for (int64_t g0 = 0; g0 < t->group; g0 += 4) {
        const int ng = (int)(t->group - g0 < 4 ? t->group - g0 : 4);
        for (int64_t d0 = 0; d0 < t->v_dim; d0 += 4 * W) {
            const int chunks = (int)((t->v_dim - d0) / W < 4 ? (t->v_dim - d0) / W : 4);
            vf acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) acc[g][c] = VF_ZERO();
            for (int64_t i = 0; i < t->count; i++) {
                const uint8_t *v = t->values + t->rows[i] * vs;
                const float factor = row_scale(v, t->v_dim) * WIDE_FACTOR[kind];
                vf vv[4];
                for (int c = 0; c < chunks; c++) vv[c] = widen_vec(v + d0 + c * W, kind);
                for (int g = 0; g < ng; g++) {
                    const vf weight = VF_SET1(t->scores[(g0 + g) * t->count + i] * factor);
                    for (int c = 0; c < chunks; c++) acc[g][c] = VF_FMA(weight, vv[c], acc[g][c]);
                }
            }
            for (int g = 0; g < ng; g++)
                for (int c = 0; c < chunks; c++) VF_STORE(t->o + (g0 + g) * t->v_dim + d0 + c * W, acc[g][c]);
        }
    }
}
#endif

/* Whether the vector path runs here for these dims (tests ask: the scalar path is the fallback). */
int kv_quant_attention_width(void) {
#ifdef W
    return W;
#else
    return 1;
#endif
}

/* Paged attention over quantized caches for every query token of the batch: sequence s owns query rows
 * query_start_loc[s]..query_start_loc[s + 1], the last positions of its seq_lens[s] keys (decode: one row).
 * Causal; sliding_window > 0 keeps the keys at positions > position - window; soft_cap > 0 caps the scores.
 * query float32 [tokens, heads, head_dim] and out [tokens, heads, v_dim]; a task is (token, KV head). */
int paged_attention_quantized(const float *query, const uint8_t *key_cache, const uint8_t *value_cache,
                              const int64_t *block_tables, const int64_t *query_start_loc, const int64_t *seq_lens,
                              float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t v_dim, int64_t block_size, int64_t max_blocks, float scale,
                              int64_t sliding_window, float soft_cap, int kind) {
    const int64_t num_tokens = query_start_loc[num_seqs], group = num_heads / num_kv_heads;
    if (num_tokens <= 0) return 0;
    int64_t max_len = 1;
    int64_t *seq_of = malloc(sizeof(int64_t) * (size_t)num_tokens);
    if (!seq_of) return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) seq_of[t] = s;
    }
#ifdef W
    const int vector = head_dim % W == 0 && v_dim % W == 0;
#endif
    int failed = 0;
#pragma omp parallel if (num_tokens * num_kv_heads > 1)
    {
        const int64_t score_floats = (group * max_len + 1) / 2 * 2; /* the rows after it 8-byte aligned */
        /* scores, each position's cache row, then the widened keys of W positions (the vector path's) */
        float *scores = malloc(sizeof(float) * (size_t)(score_floats + 16 * head_dim) + sizeof(int64_t) * (size_t)max_len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t t = 0; t < num_tokens; t++) {
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                if (!scores) continue;
                const int64_t s = seq_of[t];
                const int64_t position = seq_lens[s] - (query_start_loc[s + 1] - query_start_loc[s])
                                         + (t - query_start_loc[s]);
                const int64_t start = sliding_window > 0 && position + 1 > sliding_window
                                      ? position + 1 - sliding_window : 0;
                int64_t *rows = (int64_t *)(scores + score_floats);
                const int64_t *table = block_tables + s * max_blocks;
                task_t task = {query + (t * num_heads + kv * group) * head_dim, out + (t * num_heads + kv * group) * v_dim,
                               key_cache, value_cache, rows, scores, position + 1 - start, group, head_dim, v_dim,
                               scale, soft_cap};
                int64_t block = start / block_size, within = start % block_size; /* no division per position */
                for (int64_t i = 0; i < task.count; i++) {
                    rows[i] = (table[block] * block_size + within) * num_kv_heads + kv;
                    if (++within == block_size) within = 0, block++;
                }
#ifdef W
                if (vector) {
                    /* kind as a literal: each variant compiled with its own widening */
                    float *kbuf = (float *)(rows + max_len);
                    if (kind == KV_INT8) attend_vec(&task, kbuf, KV_INT8);
                    else if (kind == KV_E4M3) attend_vec(&task, kbuf, KV_E4M3);
                    else attend_vec(&task, kbuf, KV_E5M2);
                    continue;
                }
#endif
                attend_scalar(&task, kind);
            }
        }
        free(scores);
    }
    free(seq_of);
    return failed ? -1 : 0;
}
