/* Paged decode attention of the cpu backend (ops.py: paged_decode_attention), float32 and 16-bit.
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
#include "exp_avx512.h"
#include "half_values.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512F__)
/* AVX-512 path of paged_decode_attention for head and value dims that are multiples of 16.
 *
 * The block table is walked once per task into each position's cache row. Scores are computed 16
 * dot products at a time (16 positions of one query head, or 8 positions of two query heads sharing
 * a KV head): one accumulator register each, then a transpose-and-add tree turns the 16 registers
 * into one register of 16 scores (no horizontal sum per dot product). The softmax uses exp512 below;
 * the value sum holds up to 4 query heads of one KV head x 64 features in registers over 16
 * positions, each value vector loaded once for them. Every output element is the same sequence of
 * float32 operations however the heads and positions are blocked (test_native_branches checks it).
 * This path reads the float32 cache near the memory's rate. */

/* Software prefetch of the task's rows of positions [from, from + 8) of a 16-bit cache: without it the kv16
 * kernel gained little from reading half the bytes. The float32 kernel gained nothing from it and goes without. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, const int64_t *cache_row, int64_t from,
                                                                int64_t count, int64_t dim, int64_t heads, int kind) {
    const int64_t elem = kind ? 2 : 4, bytes = heads * dim * elem;
    for (int64_t i = from; i < from + 8 && i < count; i++) {
        const char *row = (const char *)cache + cache_row[i] * dim * elem;
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
}

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

/* rows[i]: the cache row (slot * num_kv_heads + kv_begin) of position start + i, the block table
 * walked once per task (no division per position and head). */
static void cache_rows(const int64_t *table, int64_t start, int64_t count, int64_t block_size, int64_t num_kv_heads,
                       int64_t kv_begin, int64_t *rows) {
    int64_t block = start / block_size, within = start % block_size;
    for (int64_t i = 0; i < count; i++) {
        rows[i] = (table[block] * block_size + within) * num_kv_heads + kv_begin;
        if (++within == block_size) within = 0, block++;
    }
}

/* scores[h * count + i] = q_h . k(position start + i) * scale for the task's query heads; cache_rows
 * gives each position's key row. */
static inline __attribute__((always_inline)) void scores_avx512(const float *q, const void *key_cache,
                                                                const int64_t *cache_row, int64_t count, int64_t rows,
                                                                int64_t group, int64_t head_dim, float scale,
                                                                float *scores, int kind) {
    int64_t keys[16]; /* element offsets of the positions' key rows */
    if (group % 2 == 0) {
        /* Two query heads of one KV head x 8 positions: each key vector loaded once for both. sum16 sums
         * every register's lanes in the same order, so a score is the one of the 16-position path. */
        for (int64_t i0 = 0; i0 < count; i0 += 8) {
            if (kind) prefetch_rows(key_cache, cache_row, i0 + 8, count, head_dim, rows / group, kind);
            const int64_t n = count - i0 < 8 ? count - i0 : 8;
            for (int64_t j = 0; j < 8; j++) keys[j] = cache_row[i0 + (j < n ? j : 0)] * head_dim;
            const __mmask16 mask = (__mmask16)((1u << n) - 1u);
            for (int64_t h = 0; h < rows; h += 2) {
                const float *qa = q + h * head_dim, *qb = qa + head_dim;
                const int64_t offset = (h / group) * head_dim;
                __m512 acc[16];
                for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 16) {
                    const __m512 va = _mm512_loadu_ps(qa + d), vb = _mm512_loadu_ps(qb + d);
                    for (int j = 0; j < 8; j++) {
                        const __m512 k = load_cache_ps(key_cache, keys[j] + offset + d, kind);
                        acc[j] = _mm512_fmadd_ps(va, k, acc[j]);
                        acc[8 + j] = _mm512_fmadd_ps(vb, k, acc[8 + j]);
                    }
                }
                const __m512 both = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + h * count + i0, mask, both);
                /* lanes 8..15 (masked stores do not touch, nor fault on, the masked-off lanes) */
                _mm512_mask_storeu_ps(scores + (h + 1) * count + i0 - 8, (__mmask16)(mask << 8), both);
            }
        }
        return;
    }
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int64_t n = count - i0 < 16 ? count - i0 : 16;
        for (int64_t j = 0; j < 16; j++) keys[j] = cache_row[i0 + (j < n ? j : 0)] * head_dim;
        const __mmask16 mask = (__mmask16)((1u << n) - 1u);
        for (int64_t h = 0; h < rows; h++) {
            const float *qh = q + h * head_dim;
            const int64_t offset = (h / group) * head_dim;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + d);
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_fmadd_ps(qv, load_cache_ps(key_cache, keys[j] + offset + d, kind), acc[j]);
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

/* The value sums of NH query heads sharing one KV head, CHUNKS x 16 value features from v_offset, over
 * positions [i0, i1): each value vector is loaded once for the NH heads. The running sums start at zero
 * (first) or are read back from o: every output element is one FMA chain over the positions in order,
 * however the positions are split. */
static inline __attribute__((always_inline)) void values_tile(const float *p, int64_t count, const void *value_cache,
                                                              const int64_t *cache_row, int64_t i0, int64_t i1,
                                                              int64_t v_dim, int64_t v_offset, float *o, int first,
                                                              const int NH, const int CHUNKS, int kind) {
    __m512 acc[4][4];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < CHUNKS; c++)
            acc[h][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + h * v_dim + 16 * c);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t v = cache_row[i] * v_dim + v_offset;
        __m512 vv[4];
        for (int c = 0; c < CHUNKS; c++) vv[c] = load_cache_ps(value_cache, v + 16 * c, kind);
        for (int h = 0; h < NH; h++) {
            const __m512 weight = _mm512_set1_ps(p[h * count + i]);
            for (int c = 0; c < CHUNKS; c++) acc[h][c] = _mm512_fmadd_ps(weight, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(o + h * v_dim + 16 * c, acc[h][c]);
}

#define VALUE_TILE(nh, chunks) \
    case (nh) * 4 + (chunks) - 5: \
        values_tile(p, count, value_cache, cache_row, i0, i1, v_dim, v_offset, o, first, nh, chunks, kind); \
        break;

/* o_h = sum_i p[h, i] v(position start + i) for the task's query heads, 16 positions at a time (a
 * stretch of the cache read in order, for every KV head of the task), up to 4 query heads of one KV head
 * x 64 value features held in registers across those positions. */
static inline __attribute__((always_inline)) void values_avx512(const float *scores, const void *value_cache,
                                                                const int64_t *cache_row, int64_t count, int64_t rows,
                                                                int64_t group, int64_t v_dim, float *out, int kind) {
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int64_t i1 = count - i0 < 16 ? count : i0 + 16;
        if (kind) prefetch_rows(value_cache, cache_row, i0 + 16, count, v_dim, rows / group, kind);
        if (kind) prefetch_rows(value_cache, cache_row, i0 + 24, count, v_dim, rows / group, kind);
        const int first = i0 == 0;
        for (int64_t h0 = 0; h0 < rows; h0 += group) {
            for (int64_t hb = 0; hb < group; hb += 4) {
                const int nh = (int)(group - hb < 4 ? group - hb : 4);
                const float *p = scores + (h0 + hb) * count;
                for (int64_t d0 = 0; d0 < v_dim; d0 += 64) {
                    const int chunks = (int)((v_dim - d0) / 16 < 4 ? (v_dim - d0) / 16 : 4);
                    const int64_t v_offset = (h0 / group) * v_dim + d0;
                    float *o = out + (h0 + hb) * v_dim + d0;
                    switch (nh * 4 + chunks - 5) {
                        VALUE_TILE(1, 1) VALUE_TILE(1, 2) VALUE_TILE(1, 3) VALUE_TILE(1, 4)
                        VALUE_TILE(2, 1) VALUE_TILE(2, 2) VALUE_TILE(2, 3) VALUE_TILE(2, 4)
                        VALUE_TILE(3, 1) VALUE_TILE(3, 2) VALUE_TILE(3, 3) VALUE_TILE(3, 4)
                        VALUE_TILE(4, 1) VALUE_TILE(4, 2) VALUE_TILE(4, 3) VALUE_TILE(4, 4)
                    }
                }
            }
        }
    }
}
#undef VALUE_TILE

/* One task's scores, softmax and value sums on a cache of that kind. */
static inline __attribute__((always_inline)) void attend_avx512(const float *q, const void *key_cache,
                                                                const void *value_cache, const int64_t *cache_row,
                                                                int64_t count, int64_t rows, int64_t group,
                                                                int64_t head_dim, int64_t v_dim, float scale,
                                                                float *scores, float *o, int kind) {
    scores_avx512(q, key_cache, cache_row, count, rows, group, head_dim, scale, scores, kind);
    for (int64_t h = 0; h < rows; h++) softmax_avx512(scores + h * count, count);
    values_avx512(scores, value_cache, cache_row, count, rows, group, v_dim, o, kind);
}
/* values16_avx512's chunks of 16 value features held in registers across the positions. */
#define VALUE_CHUNKS 4
#endif

/* How paged_decode_attention and paged_decode_attention_16 share out their work. A task is one sequence
 * and a run of its kv heads: each cache slot row is read as one contiguous piece; with fewer sequences
 * than threads the heads are split between threads. */
typedef struct {
    int64_t max_len;        /* the longest sequence */
    int64_t splits;         /* tasks per sequence */
    int64_t heads_per_task; /* kv heads of a task (the last may have fewer) */
    int parallel;           /* whether the threads wake at all */
} decode_tasks;

static decode_tasks plan_decode_tasks(const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, int64_t v_dim) {
    int64_t max_len = 0, total_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        total_len += seq_lens[s];
    }
    /* Below ~1M multiply-adds a second thread costs more to wake than it saves. */
    const int parallel = total_len * num_heads * (head_dim + v_dim) > (1 << 20);
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
    int64_t splits = num_seqs >= threads ? 1 : (threads + num_seqs - 1) / num_seqs;
    if (splits > num_kv_heads) splits = num_kv_heads;
    return (decode_tasks){max_len, splits, (num_kv_heads + splits - 1) / splits, parallel};
}

/* Each of rows rows of count scores to its softmax, in place (the portable path of both attentions). */
static void softmax_rows(float *scores, int64_t rows, int64_t count) {
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
}

/* paged_decode_attention on a float32 (kind 0) or float16 (1) / bfloat16 (2) cache, each cached value widened
 * exactly as it is loaded (the portable path widens a position's rows into a float32 buffer first): the same
 * float32 operations in the same order whatever the cache's type. Always inlined with a constant kind. */
static inline __attribute__((always_inline)) int
decode_attention(const float *query,          /* [seqs, heads, head_dim] */
                 const void *key_cache,       /* [blocks, block_size, kv_heads, head_dim] */
                 const void *value_cache,     /* [blocks, block_size, kv_heads, v_dim] */
                 const int64_t *block_tables, /* [seqs, max_blocks] */
                 const int64_t *seq_lens,     /* [seqs] */
                 float *out,                  /* [seqs, heads, v_dim] */
                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                 int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window, float soft_cap,
                 int kind) {
    const int64_t group = num_heads / num_kv_heads;
    const decode_tasks tasks = plan_decode_tasks(seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, v_dim);
    const int64_t max_len = tasks.max_len, splits = tasks.splits, heads_per_task = tasks.heads_per_task;
    const int parallel = tasks.parallel;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        /* scores, then each position's cache row (an even float count keeps the int64s aligned), then (16-bit
         * caches) a position's key or value rows of the task widened for the portable path */
        const size_t score_floats = (size_t)(heads_per_task * group * (max_len > 0 ? max_len : 1) + 1) & ~(size_t)1;
        const size_t row_count = (size_t)(max_len > 0 ? max_len : 1);
        const size_t widened_floats = kind ? (size_t)(heads_per_task * (head_dim > v_dim ? head_dim : v_dim)) : 0;
        float *scores = malloc(sizeof(float) * (score_floats + widened_floats) + sizeof(int64_t) * row_count);
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
                    int64_t *cache_row = (int64_t *)(scores + score_floats);
                    cache_rows(table, start, count, block_size, num_kv_heads, kv_begin, cache_row);
                    /* kind as a literal: the parallel region is outlined with kind as a variable */
                    if (kind == 0)
                        attend_avx512(q, key_cache, value_cache, cache_row, count, rows, group, head_dim, v_dim, scale,
                                      scores, o, 0);
                    else if (kind == 1)
                        attend_avx512(q, key_cache, value_cache, cache_row, count, rows, group, head_dim, v_dim, scale,
                                      scores, o, 1);
                    else
                        attend_avx512(q, key_cache, value_cache, cache_row, count, rows, group, head_dim, v_dim, scale,
                                      scores, o, 2);
                    continue;
                }
#endif
                float *widened = (float *)((int64_t *)(scores + score_floats) + row_count);
                const int64_t task_heads = kv_end - kv_begin;
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const float *k = (const float *)key_cache + (slot * num_kv_heads + kv_begin) * head_dim;
                    if (kind) {
                        const uint16_t *k16 = (const uint16_t *)key_cache + (slot * num_kv_heads + kv_begin) * head_dim;
                        widen16_row(k16, widened, task_heads * head_dim, kind);
                        k = widened;
                    }
                    for (int64_t h = 0; h < rows; h++) {
                        float score = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
                        if (soft_cap > 0.0f) score = soft_cap * tanhf(score / soft_cap);
                        scores[h * count + i] = score;
                    }
                }
                softmax_rows(scores, rows, count);
                memset(o, 0, sizeof(float) * (size_t)(rows * v_dim));
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const float *v = (const float *)value_cache + (slot * num_kv_heads + kv_begin) * v_dim;
                    if (kind) {
                        const uint16_t *v16 = (const uint16_t *)value_cache + (slot * num_kv_heads + kv_begin) * v_dim;
                        widen16_row(v16, widened, task_heads * v_dim, kind);
                        v = widened;
                    }
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

int paged_decode_attention(const float *query, const float *key_cache, const float *value_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                           float soft_cap) {
    return decode_attention(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                            num_kv_heads, head_dim, v_dim, block_size, max_blocks, scale, sliding_window, soft_cap, 0);
}

/* A float32 query and output against float16 (dtype 1) or bfloat16 (2) caches (a float32 model's 16-bit KV
 * cache, --kv-cache-dtype): paged_decode_attention's code with each cached value widened exactly as it is
 * loaded, so the same bits as paged_decode_attention on the widened caches, reading half the bytes. */
int paged_decode_attention_kv16(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                                const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                                int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                                float soft_cap, int dtype) {
    if (dtype == 1)
        return decode_attention(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, v_dim, block_size, max_blocks, scale, sliding_window, soft_cap,
                                1);
    return decode_attention(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                            num_kv_heads, head_dim, v_dim, block_size, max_blocks, scale, sliding_window, soft_cap, 2);
}

#if defined(__AVX512F__)
static inline __m512 load16_ps(const uint16_t *p, int dtype) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)p);
    if (dtype == HALF_F16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* scores_avx512 with 16-bit keys widened as they are loaded (q is float32). */
static void scores16_avx512(const float *q, const uint16_t *key_cache, const int64_t *table, int64_t start,
                            int64_t count, int64_t rows, int64_t group, int64_t kv_begin, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float *scores, int dtype) {
    const uint16_t *keys[16];
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
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_fmadd_ps(qv, load16_ps(keys[j] + offset + d, dtype), acc[j]);
            }
            _mm512_mask_storeu_ps(scores + h * count + i0, mask, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
    }
}

/* values_avx512 with 16-bit values widened as they are loaded; o is float32. */
static void values16_avx512(const float *scores, const uint16_t *value_cache, const int64_t *table, int64_t start,
                            int64_t count, int64_t rows, int64_t group, int64_t kv_begin, int64_t num_kv_heads,
                            int64_t v_dim, int64_t block_size, float *o, int dtype) {
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
                const uint16_t *v = value_cache + (slot * num_kv_heads + kv_begin) * v_dim + offset + d0;
                const __m512 weight = _mm512_set1_ps(p[i]);
                if (chunks == VALUE_CHUNKS) {
                    for (int c = 0; c < VALUE_CHUNKS; c++)
                        acc[c] = _mm512_fmadd_ps(weight, load16_ps(v + 16 * c, dtype), acc[c]);
                } else {
                    for (int c = 0; c < chunks; c++)
                        acc[c] = _mm512_fmadd_ps(weight, load16_ps(v + 16 * c, dtype), acc[c]);
                }
            }
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + h * v_dim + d0 + 16 * c, acc[c]);
        }
    }
}
#endif

/* paged_decode_attention over 16-bit query, caches and output (dtype as above). */
int paged_decode_attention_16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                              const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                              int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                              float soft_cap, int dtype) {
    const int64_t group = num_heads / num_kv_heads;
    const decode_tasks tasks = plan_decode_tasks(seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, v_dim);
    const int64_t max_len = tasks.max_len, splits = tasks.splits, heads_per_task = tasks.heads_per_task;
    const int parallel = tasks.parallel;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        /* scores, then the task's query rows and output rows in float32 */
        const size_t score_floats = (size_t)(heads_per_task * group * (max_len > 0 ? max_len : 1));
        float *scores = malloc(sizeof(float) * (score_floats + (size_t)(heads_per_task * group * (head_dim + v_dim))));
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
                const int64_t rows = (kv_end - kv_begin) * group;
                const int64_t len = seq_lens[s];
                const int64_t start = (sliding_window > 0 && len > sliding_window) ? len - sliding_window : 0;
                const int64_t count = len - start;
                const uint16_t *q16 = query + (s * num_heads + kv_begin * group) * head_dim;
                float *q = scores + score_floats, *o = q + rows * head_dim;
                for (int64_t i = 0; i < rows * head_dim; i++) q[i] = load16(q16 + i, dtype);
                const int64_t *table = block_tables + s * max_blocks;
                uint16_t *o16 = out + (s * num_heads + kv_begin * group) * v_dim;
#if defined(__AVX512F__)
                if (head_dim % 16 == 0 && v_dim % 16 == 0 && soft_cap <= 0.0f && count > 0) {
                    scores16_avx512(q, key_cache, table, start, count, rows, group, kv_begin, num_kv_heads, head_dim,
                                    block_size, scale, scores, dtype);
                    for (int64_t h = 0; h < rows; h++) softmax_avx512(scores + h * count, count);
                    values16_avx512(scores, value_cache, table, start, count, rows, group, kv_begin, num_kv_heads,
                                    v_dim, block_size, o, dtype);
                    for (int64_t i = 0; i < rows * v_dim; i++) o16[i] = store16(o[i], dtype);
                    continue;
                }
#endif
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const uint16_t *k = key_cache + (slot * num_kv_heads + kv_begin) * head_dim;
                    for (int64_t h = 0; h < rows; h++) {
                        const uint16_t *kh = k + (h / group) * head_dim;
                        const float *qh = q + h * head_dim;
                        float acc = 0.0f;
                        for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * load16(kh + d, dtype);
                        float score = acc * scale;
                        if (soft_cap > 0.0f) score = soft_cap * tanhf(score / soft_cap);
                        scores[h * count + i] = score;
                    }
                }
                softmax_rows(scores, rows, count);
                memset(o, 0, sizeof(float) * (size_t)(rows * v_dim));
                for (int64_t i = 0; i < count; i++) {
                    const int64_t pos = start + i;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    const uint16_t *v = value_cache + (slot * num_kv_heads + kv_begin) * v_dim;
                    for (int64_t h = 0; h < rows; h++) {
                        const float p = scores[h * count + i];
                        const uint16_t *vh = v + (h / group) * v_dim;
                        float *oh = o + h * v_dim;
                        for (int64_t d = 0; d < v_dim; d++) oh[d] += p * load16(vh + d, dtype);
                    }
                }
                for (int64_t i = 0; i < rows * v_dim; i++) o16[i] = store16(o[i], dtype);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
