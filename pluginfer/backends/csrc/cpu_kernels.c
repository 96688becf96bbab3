/* Native CPU kernels for the cpu backend, compiled on first use (see native.py).
 *
 * paged_decode_attention: one query token per sequence attends over that sequence's keys,
 * read in place from the paged cache (no gathered copy), two passes per (sequence, kv head):
 * scores for every query head of the group, then the softmax-weighted sum of values.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512F__)
/* AVX-512 path of paged_decode_attention for head and value dims that are multiples of 16.
 *
 * Scores are computed 16 positions at a time: one accumulator register per position, then a
 * transpose-and-add tree turns the 16 registers into one register of 16 scores (no horizontal
 * sum per dot product). The softmax uses exp512 below; the value sum keeps each head's output in
 * registers across the positions. */

/* Sum of each of a[0..15] in lane j of the result. */
static inline __m512 sum16(__m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* c[i]: each 128-bit lane holds lane-partial sums of positions 4i..4i+3; add the four lanes. */
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* expf for x <= 0 (Cephes' polynomial, ~1 ulp); below -87.3 the result flushes towards 0. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* scores[h * count + i] = q_h . k(position start + i) * scale for the task's query heads. */
static void scores_avx512(const float *q, const float *key_cache, const int64_t *table, int64_t start, int64_t count,
                          int64_t rows, int64_t group, int64_t kv_begin, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float *scores) {
    const float *keys[16];
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int64_t n = count - i0 < 16 ? count - i0 : 16;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t pos = start + i0 + (j < n ? j : 0);
            const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
            keys[j] = key_cache + (slot * num_kv_heads + kv_begin) * head_dim;
        }
        const __mmask16 mask = (__mmask16)((1u << n) - 1u);
        for (int64_t h = 0; h < rows; h++) {
            const float *qh = q + h * head_dim;
            const int64_t offset = (h / group) * head_dim;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + d);
                for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + offset + d), acc[j]);
            }
            _mm512_mask_storeu_ps(scores + h * count + i0, mask, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
    }
}

/* In place: row = softmax(row) over count scores. */
static void softmax_avx512(float *row, int64_t count) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 mask = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1u);
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, row + i));
    }
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 mask = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1u);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + i), max_score));
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mask, e));
        _mm512_mask_storeu_ps(row + i, mask, e);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 mask = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1u);
        _mm512_mask_storeu_ps(row + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + i), inverse));
    }
}

/* o_h = sum_i p[h, i] v(position start + i) for the task's query heads, chunks of CHUNKS x 16 value
 * features at a time, held in registers across the positions. */
#define VALUE_CHUNKS 4
static void values_avx512(const float *scores, const float *value_cache, const int64_t *table, int64_t start,
                          int64_t count, int64_t rows, int64_t group, int64_t kv_begin, int64_t num_kv_heads,
                          int64_t v_dim, int64_t block_size, float *o) {
    for (int64_t h = 0; h < rows; h++) {
        const float *p = scores + h * count;
        const int64_t offset = (h / group) * v_dim;
        for (int64_t d0 = 0; d0 < v_dim; d0 += 16 * VALUE_CHUNKS) {
            const int chunks = (int)((v_dim - d0) / 16 < VALUE_CHUNKS ? (v_dim - d0) / 16 : VALUE_CHUNKS);
            __m512 acc[VALUE_CHUNKS];
            for (int c = 0; c < VALUE_CHUNKS; c++) acc[c] = _mm512_setzero_ps();
            for (int64_t i = 0; i < count; i++) {
                const int64_t pos = start + i;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const float *v = value_cache + (slot * num_kv_heads + kv_begin) * v_dim + offset + d0;
                const __m512 weight = _mm512_set1_ps(p[i]);
                if (chunks == VALUE_CHUNKS) {
                    for (int c = 0; c < VALUE_CHUNKS; c++)
                        acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[c]);
                } else {
                    for (int c = 0; c < chunks; c++)
                        acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[c]);
                }
            }
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + h * v_dim + d0 + 16 * c, acc[c]);
        }
    }
}
#endif

int paged_decode_attention(const float *query,        /* [seqs, heads, head_dim] */
                           const float *key_cache,    /* [blocks, block_size, kv_heads, head_dim] */
                           const float *value_cache,  /* [blocks, block_size, kv_heads, v_dim] */
                           const int64_t *block_tables, /* [seqs, max_blocks] */
                           const int64_t *seq_lens,     /* [seqs] */
                           float *out,                  /* [seqs, heads, v_dim] */
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t v_dim, int64_t block_size, int64_t max_blocks, float scale,
                           int64_t sliding_window, float soft_cap) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 0, total_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        total_len += seq_lens[s];
    }
    /* Below ~1M multiply-adds a second thread costs more to wake than it saves. */
    const int parallel = total_len * num_heads * (head_dim + v_dim) > (1 << 20);
    /* A task is one sequence and a run of its kv heads: each cache slot row is read as one
     * contiguous piece; with fewer sequences than threads the heads are split between threads. */
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
    int64_t splits = num_seqs >= threads ? 1 : (threads + num_seqs - 1) / num_seqs;
    if (splits > num_kv_heads) splits = num_kv_heads;
    const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads_per_task * group * (max_len > 0 ? max_len : 1)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t part = 0; part < splits; part++) {
                const int64_t kv_begin = part * heads_per_task;
                const int64_t kv_end = kv_begin + heads_per_task < num_kv_heads ? kv_begin + heads_per_task
                                                                                  : num_kv_heads;
                if (!scores || kv_begin >= kv_end) continue;
                const int64_t rows = (kv_end - kv_begin) * group; /* query heads of this task */
                const int64_t len = seq_lens[s];
                const int64_t start = (sliding_window > 0 && len > sliding_window) ? len - sliding_window : 0;
                const int64_t count = len - start;
                const float *q = query + (s * num_heads + kv_begin * group) * head_dim;
                const int64_t *table = block_tables + s * max_blocks;
                float *o = out + (s * num_heads + kv_begin * group) * v_dim;
#if defined(__AVX512F__)
                if (head_dim % 16 == 0 && v_dim % 16 == 0 && soft_cap <= 0.0f && count > 0) {
                    scores_avx512(q, key_cache, table, start, count, rows, group, kv_begin, num_kv_heads, head_dim,
                                  block_size, scale, scores);
                    for (int64_t h = 0; h < rows; h++) softmax_avx512(scores + h * count, count);
                    values_avx512(scores, value_cache, table, start, count, rows, group, kv_begin, num_kv_heads,
                                  v_dim, block_size, o);
                    continue;
                }
#endif
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const float *k = key_cache + (slot * num_kv_heads + kv_begin) * head_dim;
                    for (int64_t h = 0; h < rows; h++) {
                        float score = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
                        if (soft_cap > 0.0f) score = soft_cap * tanhf(score / soft_cap);
                        scores[h * count + i] = score;
                    }
                }
                for (int64_t h = 0; h < rows; h++) {
                    float *row = scores + h * count;
                    float max_score = -INFINITY;
                    for (int64_t i = 0; i < count; i++) max_score = row[i] > max_score ? row[i] : max_score;
                    float total = 0.0f;
                    for (int64_t i = 0; i < count; i++) {
                        row[i] = expf(row[i] - max_score);
                        total += row[i];
                    }
                    const float inverse = 1.0f / total;
                    for (int64_t i = 0; i < count; i++) row[i] *= inverse;
                }
                memset(o, 0, sizeof(float) * (size_t)(rows * v_dim));
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const float *v = value_cache + (slot * num_kv_heads + kv_begin) * v_dim;
                    for (int64_t h = 0; h < rows; h++) {
                        const float p = scores[h * count + i];
                        const float *vh = v + (h / group) * v_dim;
                        float *oh = o + h * v_dim;
#pragma omp simd
                        for (int64_t d = 0; d < v_dim; d++) oh[d] += p * vh[d];
                    }
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* rms_norm: out = (src * rsqrt(mean(src^2) + eps)) * (weight + offset), src = x, or x + residual
 * written back into residual when residual is given (the fused residual add of pre-norm blocks). */
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols,
              float eps, float offset) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
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

/* silu_and_mul: out[r, i] = silu(x[r, i]) * x[r, n + i] for x of [rows, 2n]. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* rotary_neox: rotate the first rotary_dim features of each head in place (half-split layout),
 * q of [tokens, q_heads, head_dim] and k of [tokens, k_heads, head_dim] whose token rows are
 * q_stride / k_stride floats apart (they may be views into one fused qkv buffer),
 * cos/sin of [tokens, rotary_dim/2]. */
void rotary_neox(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens,
                 int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                 int64_t k_stride) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for if (tokens > 8)
    for (int64_t t = 0; t < tokens; t++) {
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
