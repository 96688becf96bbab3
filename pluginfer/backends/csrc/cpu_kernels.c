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

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

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
                float *o = out + (s * num_heads + kv_begin * group) * v_dim;
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
