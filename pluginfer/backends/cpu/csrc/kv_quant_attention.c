/* Quantized KV caches of the cpu backend (kv_quant.py): the write that quantizes, and paged attention that
 * reads the 1-byte codes in place, for decode and prefill rows alike.
 *
 * A cache row (one token, one KV head; pluginfer/layers/kv_quant.py) is dim codes then the float32 scale:
 * value = code * scale. kind 0: int8 codes; 1: float8 E4M3 (bias 7, max 448); 2: float8 E5M2 (bias 15,
 * max 57344). Codes are widened in registers: int8 by sign extension; E5M2 is the high byte of an IEEE half;
 * E4M3's bits shifted into a half's place read as value * 2^-8 for normals and subnormals alike, the 2^8
 * folded into the row's scale. The scale multiplies a key's dot product and is folded into a value's softmax
 * weight, never each feature.
 *
 * Where a decode step's time goes (batch 16 x 2048 positions, 14 query heads on 2 KV heads x 64): the arithmetic,
 * not the reads, on a few cores. So each code is widened once for all the query heads of its KV head (keys: 16
 * positions into an L1 tile, one transpose tree per head's 16 dot products; values: up to 8 heads x 32 features
 * of sums in registers per widened vector), where the 16-bit kernels widen a key once per query head (or pair of heads).
 * The score pass also fetches the value rows two tiles ahead and reads their scales, so that the softmax touches no
 * cache row and the value pass finds its rows near (1.14x the whole attention against fetching them in the softmax).
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
 * Codes round to nearest even from x / scale, as layers/kv_quant.py's quantize. */
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
            for (int64_t d = 0; d < dim; d++) absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
            scale = absmax > 0.0f ? absmax / code_max : 1.0f;
        }
        for (int64_t d = 0; d < dim; d++) {
            const float y = x[d] / scale; /* clamped by ternaries: fminf and fmaxf are libm calls */
            row[d] = encode(y < -code_max ? -code_max : y > code_max ? code_max : y, kind);
        }
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

/* What one (query token, KV head) reads and the scratch it writes. */
typedef struct {
    const float *q;         /* the group's query heads, [group, head_dim] */
    float *o;               /* their outputs, [group, v_dim] */
    const uint8_t *keys;    /* key_cache */
    const uint8_t *values;  /* value_cache */
    const int64_t *rows;    /* cache row (slot * kv_heads + kv_head) of each position */
    float *scores;          /* [group, count]: scores, then softmax weights times each value row's scale */
    float *factors;         /* [count]: each position's value-row scale */
    float *widened;         /* W rows of max(head_dim, v_dim) floats (the scalar path: one) */
    int64_t count, group, head_dim, v_dim;
    int64_t v_row;          /* bytes from one value row to the next: v_dim + 4, or a key row's (a value in the key) */
    float scale, soft_cap;
} task_t;

/* t->factors[i] for positions i0 .. i0 + n: position i's value-row scale times the widening's factor. */
static inline void value_factors(const task_t *t, int kind, int64_t i0, int64_t n) {
    for (int64_t i = i0; i < i0 + n; i++)
        t->factors[i] = row_scale(t->values + t->rows[i] * t->v_row, t->v_dim) * WIDE_FACTOR[kind];
}

/* Softmax over each query head's scores, in place, each weight then times its position's value-row scale (and
 * the widening's factor: t->factors, read by the score pass), so that the value sums multiply each widened code by
 * one weight. */
static void softmax_and_fold(const task_t *t) {
    float *const scores = t->scores, *const factors = t->factors;
    const int64_t count = t->count;
    for (int64_t h = 0; h < t->group; h++) {
        float *row = scores + h * count, max_score = -INFINITY, sum = 0.0f;
        if (t->soft_cap > 0.0f)
            for (int64_t i = 0; i < count; i++) row[i] = t->soft_cap * tanhf(row[i] / t->soft_cap);
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= count; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
        max_score = _mm512_reduce_max_ps(vmax);
#endif
        for (; i < count; i++) max_score = row[i] > max_score ? row[i] : max_score; /* fmaxf: a libm call */
        i = 0;
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
        for (int64_t i = 0; i < count; i++) row[i] = row[i] * inverse * factors[i];
    }
}

/* Scalar: any dims. Each row widened once into t->widened, then used by every query head of the group. */
static void attend_scalar(const task_t *t, int kind) {
    const int64_t ks = t->head_dim + 4, vs = t->v_row;
    for (int64_t i = 0; i < t->count; i++) {
        const uint8_t *k = t->keys + t->rows[i] * ks;
        for (int64_t d = 0; d < t->head_dim; d++) t->widened[d] = widen(k + d, kind);
        const float factor = row_scale(k, t->head_dim) * WIDE_FACTOR[kind] * t->scale;
        for (int64_t g = 0; g < t->group; g++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < t->head_dim; d++) acc += t->q[g * t->head_dim + d] * t->widened[d];
            t->scores[g * t->count + i] = acc * factor;
        }
    }
    value_factors(t, kind, 0, t->count);
    softmax_and_fold(t);
    memset(t->o, 0, sizeof(float) * (size_t)(t->group * t->v_dim));
    for (int64_t i = 0; i < t->count; i++) {
        const uint8_t *v = t->values + t->rows[i] * vs;
        for (int64_t d = 0; d < t->v_dim; d++) t->widened[d] = widen(v + d, kind);
        for (int64_t g = 0; g < t->group; g++) {
            const float weight = t->scores[g * t->count + i];
            for (int64_t d = 0; d < t->v_dim; d++) t->o[g * t->v_dim + d] += weight * t->widened[d];
        }
    }
}

#ifdef W
/* The cache lines of the row of position i (a row is dim + 4 bytes: one or two more lines than its start). */
static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *cache, const int64_t *rows,
                                                               int64_t i, int64_t count, int64_t row_bytes) {
    if (i >= count) return;
    const char *row = (const char *)cache + rows[i] * row_bytes;
    for (int64_t b = 0; b < row_bytes + 63; b += 64) _mm_prefetch(row + (b < row_bytes ? b : row_bytes - 1), _MM_HINT_T0);
}

/* Scores W positions at a time: their keys widened once into t->widened (L1) for every query head of the
 * group, each head's W dot products summed by one tree (sum_w) and scaled by the rows' scales in one multiply. */
static inline __attribute__((always_inline)) void scores_vec(const task_t *t, const int kind) {
    const int64_t ks = t->head_dim + 4, hd = t->head_dim;
    float *const kbuf = t->widened;
    for (int64_t i0 = 0; i0 < t->count; i0 += W) {
        const int64_t n = t->count - i0 < W ? t->count - i0 : W;
        float factors[W];
        for (int64_t j = 0; j < W; j++) {
            prefetch_row(t->keys, t->rows, i0 + 2 * W + j, t->count, ks);
            prefetch_row(t->values, t->rows, i0 + 2 * W + j, t->count, t->v_row);
            const uint8_t *k = t->keys + t->rows[i0 + (j < n ? j : 0)] * ks;
            for (int64_t d = 0; d < hd; d += W) VF_STORE(kbuf + j * hd + d, widen_vec(k + d, kind));
            factors[j] = row_scale(k, hd) * WIDE_FACTOR[kind] * t->scale;
        }
        value_factors(t, kind, i0, n);
        const vf factor = VF_LOAD(factors);
        for (int64_t g = 0; g < t->group; g++) {
            const float *q = t->q + g * hd;
            vf acc[W];
            for (int j = 0; j < W; j++) acc[j] = VF_ZERO();
            for (int64_t d = 0; d < hd; d += W) {
                const vf qv = VF_LOAD(q + d);
                for (int j = 0; j < W; j++) acc[j] = VF_FMA(qv, VF_LOAD(kbuf + j * hd + d), acc[j]);
            }
            float *dst = t->scores + g * t->count + i0;
            if (n == W) {
                VF_STORE(dst, VF_MUL(sum_w(acc), factor));
            } else {
                float tile[W];
                VF_STORE(tile, VF_MUL(sum_w(acc), factor));
                memcpy(dst, tile, sizeof(float) * (size_t)n);
            }
        }
    }
}

/* The value sums of NG query heads x CH vectors of features from d0, over every position: each value vector
 * widened once for the NG heads, each weight (already times the row's scale) broadcast once per vector. */
static inline __attribute__((always_inline)) void values_tile(const task_t *t, int64_t g0, int64_t d0, const int NG,
                                                              const int CH, const int kind) {
    const int64_t vs = t->v_row;
    const float *p = t->scores + g0 * t->count;
    vf acc[W / 2][2];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < CH; c++) acc[g][c] = VF_ZERO();
    for (int64_t i = 0; i < t->count; i++) {
        prefetch_row(t->values, t->rows, i + 48, t->count, vs);
        const uint8_t *v = t->values + t->rows[i] * vs + d0;
        vf vv[2];
        for (int c = 0; c < CH; c++) vv[c] = widen_vec(v + c * W, kind);
        for (int g = 0; g < NG; g++) {
            const vf weight = VF_SET1(p[g * t->count + i]);
            for (int c = 0; c < CH; c++) acc[g][c] = VF_FMA(weight, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < CH; c++) VF_STORE(t->o + (g0 + g) * t->v_dim + d0 + c * W, acc[g][c]);
}

#define VALUES_TILE(ng, ch) \
    case (ng) * 2 + (ch) - 3: values_tile(t, g0, d0, ng, ch, kind); break;

/* One task on the vector path: scores, softmax (weights folded with the value scales), value sums of up to
 * W / 2 query heads x 2 vectors of features at a time (registers: W / 2 x 2 sums and 2 widened values). */
static inline __attribute__((always_inline)) void attend_vec(const task_t *t, const int kind) {
    scores_vec(t, kind);
    softmax_and_fold(t);
    for (int64_t g0 = 0; g0 < t->group; g0 += W / 2) {
        const int ng = (int)(t->group - g0 < W / 2 ? t->group - g0 : W / 2);
        for (int64_t d0 = 0; d0 < t->v_dim; d0 += 2 * W) {
            const int ch = t->v_dim - d0 >= 2 * W ? 2 : 1;
            switch (ng * 2 + ch - 3) {
                VALUES_TILE(1, 1) VALUES_TILE(1, 2) VALUES_TILE(2, 1) VALUES_TILE(2, 2)
                VALUES_TILE(3, 1) VALUES_TILE(3, 2) VALUES_TILE(4, 1) VALUES_TILE(4, 2)
#if W == 16
                VALUES_TILE(5, 1) VALUES_TILE(5, 2) VALUES_TILE(6, 1) VALUES_TILE(6, 2)
                VALUES_TILE(7, 1) VALUES_TILE(7, 2) VALUES_TILE(8, 1) VALUES_TILE(8, 2)
#endif
            }
        }
    }
}
#undef VALUES_TILE
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
 * query float32 [tokens, heads, head_dim] and out [tokens, heads, v_dim]. Value rows lie v_row bytes apart: v_dim + 4
 * in a cache of their own, a key row's head_dim + 4 where the value is the key's last features (its scale the key's).
 * A thread's task is a query token and
 * a run of its KV heads: all of them (a slot's rows read by one thread) unless there are fewer tokens than
 * threads. */
int paged_attention_quantized(const float *query, const uint8_t *key_cache, const uint8_t *value_cache,
                              const int64_t *block_tables, const int64_t *query_start_loc, const int64_t *seq_lens,
                              float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t v_dim, int64_t v_row, int64_t block_size, int64_t max_blocks,
                              float scale, int64_t sliding_window, float soft_cap, int kind) {
    const int64_t num_tokens = query_start_loc[num_seqs], group = num_heads / num_kv_heads;
    if (num_tokens <= 0) return 0;
    int64_t max_len = 1, total = 0;
    int64_t *seq_of = malloc(sizeof(int64_t) * (size_t)num_tokens);
    if (!seq_of) return -1;
    for (int64_t s = 0; s < num_seqs; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) seq_of[t] = s, total += seq_lens[s];
    }
    /* below ~1M multiply-adds a second thread costs more to wake than it saves (as attention.c) */
    const int parallel = total * num_heads * (head_dim + v_dim) > (1 << 20);
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
    int64_t splits = num_tokens >= threads ? 1 : (threads + num_tokens - 1) / num_tokens;
    splits = splits < num_kv_heads ? splits : num_kv_heads;
    const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
#ifdef W
    const int vector = head_dim % W == 0 && v_dim % W == 0;
    const int64_t widened_floats = W * (head_dim > v_dim ? head_dim : v_dim);
#else
    const int64_t widened_floats = head_dim > v_dim ? head_dim : v_dim;
#endif
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        const int64_t score_floats = (group * max_len + 15) / 16 * 16; /* the rows after it 64-byte aligned */
        /* scores, each position's value scale, each position's cache row, then the widened rows */
        const int64_t factor_floats = (max_len + 15) / 16 * 16;
        float *scores = aligned_alloc(64, (sizeof(float) * (size_t)(score_floats + factor_floats + widened_floats)
                                           + sizeof(int64_t) * (size_t)max_len + 63) / 64 * 64);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task_index = 0; task_index < num_tokens * splits; task_index++) {
            if (!scores) continue;
            const int64_t t = task_index / splits, kv_begin = task_index % splits * heads_per_task;
            const int64_t kv_end = kv_begin + heads_per_task < num_kv_heads ? kv_begin + heads_per_task : num_kv_heads;
            const int64_t s = seq_of[t];
            const int64_t position = seq_lens[s] - (query_start_loc[s + 1] - query_start_loc[s])
                                     + (t - query_start_loc[s]);
            const int64_t start = sliding_window > 0 && position + 1 > sliding_window ? position + 1 - sliding_window : 0;
            float *factors = scores + score_floats;
            int64_t *rows = (int64_t *)(factors + factor_floats);
            float *widened = (float *)(rows + max_len);
            const int64_t *table = block_tables + s * max_blocks;
            for (int64_t kv = kv_begin; kv < kv_end; kv++) {
                task_t task = {query + (t * num_heads + kv * group) * head_dim, out + (t * num_heads + kv * group) * v_dim,
                               key_cache, value_cache, rows, scores, factors, widened, position + 1 - start, group, head_dim,
                               v_dim, v_row, scale, soft_cap};
                int64_t block = start / block_size, within = start % block_size; /* no division per position */
                for (int64_t i = 0; i < task.count; i++) {
                    rows[i] = (table[block] * block_size + within) * num_kv_heads + kv;
                    if (++within == block_size) within = 0, block++;
                }
#ifdef W
                if (vector) {
                    /* kind as a literal: each variant compiled with its own widening */
                    if (kind == KV_INT8) attend_vec(&task, KV_INT8);
                    else if (kind == KV_E4M3) attend_vec(&task, KV_E4M3);
                    else attend_vec(&task, KV_E5M2);
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
