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

static inline float load16(const uint16_t *p, int dtype); /* a float16 (1) or bfloat16 (2) value, widened */

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
 * On a shared one-core run this path reads the float32 cache near the memory's rate (docs/performance.md). */

/* 16 values at element index of a float32 (kind 0), float16 (1) or bfloat16 (2) cache, widened exactly: the
 * kernels below take kind as a constant (always inlined), so the float32 kernel's code is unchanged. */
static inline __attribute__((always_inline)) __m512 load_cache_ps(const void *cache, int64_t index, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)cache + index);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index));
    if (kind == 1) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Software prefetch of the task's rows of positions [from, from + 8) of a 16-bit cache: without it the kv16
 * kernel read its half-size cache only ~1.15x faster than the float32 kernel its float32 one; with it ~1.6x
 * (batch 16, one thread; docs/performance.md). The float32 kernel gained nothing from it and goes without. */
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

/* expf (Cephes' polynomial, ~1 ulp); below -87.3 the result flushes towards 0, above ~88.7 it is inf.
 * NaN stays NaN: vmaxps returns its second operand when either is NaN, so x goes second (a NaN or +inf
 * score then makes its softmax row NaN, as in torch). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
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
                        for (int64_t j = 0; j < task_heads * head_dim; j++) widened[j] = load16(k16 + j, kind);
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
                        for (int64_t j = 0; j < task_heads * v_dim; j++) widened[j] = load16(v16 + j, kind);
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

/* The row-wise kernels below split their rows across the threads from about 3 us of work: under it a fork
 * costs more than the second thread saves (a hot loop at 2 threads: 16 rows of 256 took 0.93 us on one
 * thread and 1.39 on two; docs/performance.md, "Thread-team forks per decode step"). Below it they enter no
 * OpenMP region at all (a region whose `if` is false still costs ~0.2 us). Each row is computed by the one
 * compiled copy of its *_rows function (noinline) whichever thread takes it, so results are the same bits. */
#define NORM_PARALLEL_VALUES (1 << 14)
#define GATED_PARALLEL_VALUES (1 << 13)
#define ROTARY_PARALLEL_VALUES (1 << 14)

/* rms_norm: out = (src * rsqrt(mean(src^2) + eps)) * (weight + offset), src = x, or x + residual
 * written back into residual when residual is given (the fused residual add of pre-norm blocks). */
static __attribute__((noinline)) void
rms_norm_rows(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
              float offset, int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
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

void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
              float offset) {
    if (rows > 1 && rows * cols >= NORM_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            rms_norm_rows(x, residual, weight, out, rows, cols, eps, offset, r, r + 1);
    } else {
        rms_norm_rows(x, residual, weight, out, rows, cols, eps, offset, 0, rows);
    }
}

/* gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3): silu(g) = g / (1 +
 * exp(-g))'s form, exp512 for expf (torch's 0.5 g (1 + tanh(u)) loses the low bits of 1 + tanh(u) for u below about
 * -2; this does not). */
static const float GELU_TWO_BETA = 1.5957691216057308f, GELU_KAPPA = 0.044715f; /* 2 sqrt(2/pi) */

/* silu (gelu 0) or gelu_tanh (gelu 1) of one value, and of 16 (AVX-512); the gated kernels (float32 and 16-bit)
 * take them with gelu a constant, so each inlines one activation's arithmetic, as written here. */
static inline __attribute__((always_inline)) float gate_activation(float g, int gelu) {
    return gelu ? g / (1.0f + expf(-GELU_TWO_BETA * fmaf(GELU_KAPPA * g, g * g, g))) : g / (1.0f + expf(-g));
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 gate_activation512(__m512 g, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e;
    if (gelu) {
        const __m512 kappa = _mm512_set1_ps(GELU_KAPPA), minus_two_beta = _mm512_set1_ps(-GELU_TWO_BETA);
        const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(kappa, g), _mm512_mul_ps(g, g), g);
        e = exp512(_mm512_mul_ps(minus_two_beta, inner));
    } else {
        e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    }
    return _mm512_div_ps(g, _mm512_add_ps(one, e));
}
#endif

/* One row of a gated kernel: o[i] = activation(gate[i]) * up[i]. */
static inline __attribute__((always_inline)) void gated_row(const float *gate, const float *up, float *o, int64_t n,
                                                            int gelu) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(gate_activation512(_mm512_loadu_ps(gate + i), gelu),
                                              _mm512_loadu_ps(up + i)));
#endif
    for (; i < n; i++) o[i] = gate_activation(gate[i], gelu) * up[i];
}

/* Rows [first, last) of a gated kernel on x of [rows, 2n]: out[r, i] = act(x[r, i]) * x[r, n + i], act silu
 * (gelu 0) or gelu_tanh (1); gated_row is inlined once for each, so the inner loop branches on neither. */
static __attribute__((noinline)) void
gated_and_mul_rows(const float *x, float *out, int64_t n, int gelu, int64_t first, int64_t last) {
    if (gelu)
        for (int64_t r = first; r < last; r++) gated_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, 1);
    else
        for (int64_t r = first; r < last; r++) gated_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, 0);
}

static void gated_and_mul(const float *x, float *out, int64_t rows, int64_t n, int gelu) {
    if (rows > 1 && rows * n >= GATED_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            gated_and_mul_rows(x, out, n, gelu, r, r + 1);
    } else {
        gated_and_mul_rows(x, out, n, gelu, 0, rows);
    }
}

/* silu_and_mul: out[r, i] = silu(x[r, i]) * x[r, n + i] for x of [rows, 2n]. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t n) { gated_and_mul(x, out, rows, n, 0); }

/* gelu_tanh_and_mul: out[r, i] = gelu_tanh(x[r, i]) * x[r, n + i] for x of [rows, 2n]. */
void gelu_tanh_and_mul(const float *x, float *out, int64_t rows, int64_t n) { gated_and_mul(x, out, rows, n, 1); }

/* rotary_neox: rotate the first rotary_dim features of each head in place (half-split layout),
 * q of [tokens, q_heads, head_dim] and k of [tokens, k_heads, head_dim] whose token rows are
 * q_stride / k_stride floats apart (they may be views into one fused qkv buffer),
 * cos/sin of [tokens, rotary_dim/2]. */
static __attribute__((noinline)) void
rotary_neox_rows(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens, int64_t q_heads,
                 int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride, int64_t k_stride,
                 int64_t first, int64_t last) {
    const int64_t half = rotary_dim / 2;
    for (int64_t t = first; t < last; t++) {
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

void rotary_neox(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens, int64_t q_heads,
                 int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride, int64_t k_stride) {
    if (tokens > 1 && tokens * (q_heads + k_heads) * rotary_dim >= ROTARY_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t t = 0; t < tokens; t++)
            rotary_neox_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                             k_stride, t, t + 1);
    } else {
        rotary_neox_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                         k_stride, 0, tokens);
    }
}

/* ggml_dequantize_rows: contiguous rows of raw llama.cpp blocks (row_bytes each) to float32 [rows, cols],
 * bit-exact with pluginfer.quant.ggml_blocks.dequantize: every value is formed by the same float32
 * operations in the same order (e.g. Q4_K: dl = d * sc, ml = dmin * m, then q * dl - ml, two
 * roundings). That relies on no contraction into FMA: -std=c11 makes gcc's default
 * -ffp-contract=off. Types are gguf's GGMLQuantizationType values; returns -1 for any other, -2
 * when cols is not whole blocks filling row_bytes. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10,
       GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* IEEE half to float, exact for every input (subnormals, infinities; a NaN keeps its payload and
 * gets the quiet bit, as F16C's vcvtph2ps does). */
static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
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
 * gcc 12 vectorises them well, where two loops of 16 or an unpacking loop first run 3-4x slower.
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
 * NaN to 0xFFFF). The generic versions ran 1.1-1.8x slower to bfloat16 than to float32 for these types. */
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

/* ---- 16-bit activations: rms_norm_16, silu_and_mul_16, rotary_neox_16, paged_decode_attention_16 ----
 *
 * The same ops on float16 (dtype 1) or bfloat16 (dtype 2) tensors: each value is widened to float32 as it
 * is loaded (exactly), the arithmetic is float32, and each result is rounded to the 16-bit type (to
 * nearest even, as torch's .to() does) where torch's 16-bit reference rounds it: rms_norm_16 and
 * silu_and_mul_16 round where layers/norm.py and layers/activation.py do, rotary_neox_16 rotates in
 * float32 with float32 cos/sin and rounds once, paged_decode_attention_16 is paged_decode_attention's
 * arithmetic (the same operations in the same order) on the widened values, rounded once. */
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

#if defined(__AVX512F__)
static inline __m512 widen16_ps(__m256i bits, int dtype) {
    if (dtype == HALF_F16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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

/* out = round(round(src * rsqrt(mean(src^2) + eps)) * weight) (offset 0), or round(src * rsqrt(..) *
 * (weight + offset)); src = x, or round(x + residual) written back into residual. */
static __attribute__((noinline)) void
rms_norm_16_rows(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t cols, float eps, float offset, int dtype, int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
        const uint16_t *in = x + r * cols;
        uint16_t *o = out + r * cols;
        float sum = 0.0f;
        int64_t i = 0;
#if defined(__AVX512F__)
        if (cols >= 16) { /* 16 at a time, the tail below; the sum in another order than torch's (as ever) */
            const int64_t body = cols / 16 * 16;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < body; j += 16) {
                __m256i bits = _mm256_loadu_si256((const __m256i *)(in + j));
                if (residual) {
                    uint16_t *res = residual + r * cols + j;
                    bits = narrow16_ps(_mm512_add_ps(widen16_ps(bits, dtype),
                                                     widen16_ps(_mm256_loadu_si256((const __m256i *)res), dtype)), dtype);
                    _mm256_storeu_si256((__m256i *)res, bits);
                }
                const __m512 v = widen16_ps(bits, dtype);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            const uint16_t *src = residual ? residual + r * cols : in;
            for (int64_t j = body; j < cols; j++) {
                if (residual) residual[r * cols + j] = store16(load16(in + j, dtype) + load16(residual + r * cols + j, dtype), dtype);
                const float v = load16(src + j, dtype);
                sum += v * v;
            }
            sum += _mm512_reduce_add_ps(acc);
            const float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
            const __m512 vinverse = _mm512_set1_ps(inverse), voffset = _mm512_set1_ps(offset);
            for (int64_t j = 0; j < body; j += 16) {
                const __m512 normed = _mm512_mul_ps(widen16_ps(_mm256_loadu_si256((const __m256i *)(src + j)), dtype),
                                                    vinverse);
                const __m512 w = widen16_ps(_mm256_loadu_si256((const __m256i *)(weight + j)), dtype);
                const __m512 y = offset != 0.0f ? _mm512_mul_ps(normed, _mm512_add_ps(w, voffset))
                                                : _mm512_mul_ps(widen16_ps(narrow16_ps(normed, dtype), dtype), w);
                _mm256_storeu_si256((__m256i *)(o + j), narrow16_ps(y, dtype));
            }
            for (int64_t j = body; j < cols; j++)
                o[j] = offset != 0.0f ? store16((load16(src + j, dtype) * inverse) * (load16(weight + j, dtype) + offset), dtype)
                                      : store16(round16(load16(src + j, dtype) * inverse, dtype) * load16(weight + j, dtype), dtype);
            continue;
        }
#endif
        if (residual) {
            uint16_t *res = residual + r * cols;
            for (i = 0; i < cols; i++) {
                res[i] = store16(load16(in + i, dtype) + load16(res + i, dtype), dtype);
                const float v = load16(res + i, dtype);
                sum += v * v;
            }
            in = res;
        } else {
            for (i = 0; i < cols; i++) {
                const float v = load16(in + i, dtype);
                sum += v * v;
            }
        }
        const float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
        if (offset != 0.0f) {
            for (i = 0; i < cols; i++)
                o[i] = store16((load16(in + i, dtype) * inverse) * (load16(weight + i, dtype) + offset), dtype);
        } else {
            for (i = 0; i < cols; i++) {
                o[i] = store16(round16(load16(in + i, dtype) * inverse, dtype) * load16(weight + i, dtype), dtype);
            }
        }
    }
}

void rms_norm_16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t cols, float eps, float offset, int dtype) {
    if (rows > 1 && rows * cols >= NORM_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            rms_norm_16_rows(x, residual, weight, out, rows, cols, eps, offset, dtype, r, r + 1);
    } else {
        rms_norm_16_rows(x, residual, weight, out, rows, cols, eps, offset, dtype, 0, rows);
    }
}


/* One row of a 16-bit gated kernel: o[i] = round(round(activation(gate[i])) * up[i]), the activation in float32
 * (gated_row's) on the widened gate. */
static inline __attribute__((always_inline)) void gated_row_16(const uint16_t *gate, const uint16_t *up, uint16_t *o,
                                                               int64_t n, int dtype, int gelu) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 g = widen16_ps(_mm256_loadu_si256((const __m256i *)(gate + i)), dtype);
        const __m512 a = widen16_ps(narrow16_ps(gate_activation512(g, gelu), dtype), dtype);
        const __m512 u = widen16_ps(_mm256_loadu_si256((const __m256i *)(up + i)), dtype);
        _mm256_storeu_si256((__m256i *)(o + i), narrow16_ps(_mm512_mul_ps(a, u), dtype));
    }
#endif
    for (; i < n; i++)
        o[i] = store16(round16(gate_activation(load16(gate + i, dtype), gelu), dtype) * load16(up + i, dtype), dtype);
}

/* Rows [first, last) of a 16-bit gated kernel (gated_and_mul_rows's, the activation silu or gelu_tanh). */
static __attribute__((noinline)) void
gated_and_mul_16_rows(const uint16_t *x, uint16_t *out, int64_t n, int dtype, int gelu, int64_t first, int64_t last) {
    if (gelu)
        for (int64_t r = first; r < last; r++) gated_row_16(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, dtype, 1);
    else
        for (int64_t r = first; r < last; r++) gated_row_16(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n, dtype, 0);
}

static void gated_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype, int gelu) {
    if (rows > 1 && rows * n >= GATED_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t r = 0; r < rows; r++)
            gated_and_mul_16_rows(x, out, n, dtype, gelu, r, r + 1);
    } else {
        gated_and_mul_16_rows(x, out, n, dtype, gelu, 0, rows);
    }
}

/* out[r, i] = round(round(silu(x[r, i])) * x[r, n + i]) for x of [rows, 2n] (torch: F.silu(gate) * up). */
void silu_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype) {
    gated_and_mul_16(x, out, rows, n, dtype, 0);
}

/* out[r, i] = round(round(gelu_tanh(x[r, i])) * x[r, n + i]) for x of [rows, 2n] (torch: F.gelu(gate,
 * approximate="tanh") * up). */
void gelu_tanh_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype) {
    gated_and_mul_16(x, out, rows, n, dtype, 1);
}

/* rotary_neox on 16-bit q and k rows (strides in elements), float32 cos/sin tables of [tokens, rotary_dim/2]:
 * x1' = round(x1 c - x2 s), x2' = round(x2 c + x1 s), the products and sums in float32. */
static __attribute__((noinline)) void
rotary_neox_16_rows(uint16_t *q, uint16_t *k, const float *cos_table, const float *sin_table, int64_t tokens,
                    int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                    int64_t k_stride, int dtype, int64_t first, int64_t last) {
    const int64_t half = rotary_dim / 2;
    for (int64_t t = first; t < last; t++) {
        const float *c = cos_table + t * half, *s = sin_table + t * half;
        for (int64_t h = 0; h < q_heads + k_heads; h++) {
            uint16_t *x = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load16(x + i, dtype), x2 = load16(x + i + half, dtype);
                x[i] = store16(x1 * c[i] - x2 * s[i], dtype);
                x[i + half] = store16(x2 * c[i] + x1 * s[i], dtype);
            }
        }
    }
}

void rotary_neox_16(uint16_t *q, uint16_t *k, const float *cos_table, const float *sin_table, int64_t tokens,
                    int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                    int64_t k_stride, int dtype) {
    if (tokens > 1 && tokens * (q_heads + k_heads) * rotary_dim >= ROTARY_PARALLEL_VALUES) {
#pragma omp parallel for
        for (int64_t t = 0; t < tokens; t++)
            rotary_neox_16_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                                k_stride, dtype, t, t + 1);
    } else {
        rotary_neox_16_rows(q, k, cos_table, sin_table, tokens, q_heads, k_heads, head_dim, rotary_dim, q_stride,
                            k_stride, dtype, 0, tokens);
    }
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
