/* Paged prefill attention of the cpu backend (layer_ops.py: paged_prefill_attention; the op
 * layers/attention_ops.py defines): several query tokens per sequence, causal, over a float32, float16 or
 * bfloat16 cache read in place, on AVX-512. Where torch's SDPA took ~12 ms a layer for a 512-token prompt
 * (16 heads x 64, one thread, the gathered keys and a mask), this is two register-tiled GEMMs a layer.
 *
 * A task is one sequence, one KV head and up to PA_TASK_ROWS of its query rows (row r: token r / group,
 * query head r % group of the KV head). It points at the key and value rows its rows may see, once (a 16-bit
 * cache's rows widened into float32 buffers); then per tile of up to 48 rows:
 *   scores^T [key][row] = K Q^T: 8 keys x 3 panels of 16 rows, each key value broadcast against the rows'
 *     transposed queries (no transpose of the keys, no horizontal sums);
 *   the softmax down each column, rows in lanes (after a soft cap, if any): the masked scores (causal, sliding
 *     window) are zeroed;
 *   out [row][dim] = P V / sum: 4 rows x 4 panels of 16 features, each weight broadcast against value rows.
 * The keys start at a multiple of 16 (earlier ones masked): a row's scores, sums and products are then the
 * same float32 operations in the same order whatever its task, batch, chunk or thread count, so a prompt
 * prefilled in one step or in chunks (or after a prefix-cache hit) gets the same bits.
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
#include "transpose16_avx512.h"

#define PA_TILE 48       /* query rows per tile: 3 panels of 16 */
#define PA_TASK_ROWS 96  /* query rows per task (two tiles): the keys widened once for them */
#define PA_VALUE_KEYS 64 /* keys per block of the value sums (their values in L1) */

#if defined(__AVX512F__)
int prefill_attention_supported(void) { return 1; }

/* tanh(x) = 1 - 2 / (exp(2x) + 1) (exp512 saturates: +-1 at the ends), within ~1e-7 of tanhf: a soft cap's
 * scores (Gemma 2) to ~cap x 1e-7. */
static inline __m512 tanh512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp512(_mm512_add_ps(x, x)), one)));
}

/* row[i]: the float32 features of position from + i of one KV head (dim, a multiple of 16), for i < to - from:
 * the cache's own row (float32), else that row widened into wide (16-bit); positions past `valid` read zeros. */
static void pa_rows(const void *cache, int kind, const int64_t *table, int64_t block_size, int64_t num_kv_heads,
                    int64_t kv, int64_t dim, int64_t from, int64_t to, int64_t valid, const float *zeros, float *wide,
                    const float **row) {
    for (int64_t pos = from; pos < to; pos++) {
        if (pos >= valid) {
            row[pos - from] = zeros;
            continue;
        }
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const int64_t base = (slot * num_kv_heads + kv) * dim;
        if (kind == 0) {
            row[pos - from] = (const float *)cache + base;
            continue;
        }
        float *dst = wide + (pos - from) * dim;
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, load_cache_ps(cache, base + d, kind));
        row[pos - from] = dst;
    }
}

/* scores^T [key][PA_TILE] for MK keys (rows k[0 .. MK - 1]) x NP panels of 16 query rows: each dot product one
 * FMA chain over the features in order. qt: the tile's queries transposed, [dim][PA_TILE]. */
static inline __attribute__((always_inline)) void pa_scores(const float *const *k, const float *qt, int64_t dim,
                                                            float *st, const int MK, const int NP) {
    __m512 acc[8][3];
    for (int j = 0; j < MK; j++)
        for (int p = 0; p < NP; p++) acc[j][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 q[3];
        for (int p = 0; p < NP; p++) q[p] = _mm512_load_ps(qt + d * PA_TILE + 16 * p);
        for (int j = 0; j < MK; j++) {
            const __m512 kv = _mm512_set1_ps(k[j][d]);
            for (int p = 0; p < NP; p++) acc[j][p] = _mm512_fmadd_ps(kv, q[p], acc[j][p]);
        }
    }
    for (int j = 0; j < MK; j++)
        for (int p = 0; p < NP; p++) _mm512_store_ps(st + j * PA_TILE + 16 * p, acc[j][p]);
}

/* out rows [MR][NP x 16 features from f0] += weight x value over keys [j0, j1): the sums start at zero at the
 * first keys and are scaled by inv (1 / the row's sum) after the last (partial sums stored exactly between). */
static inline __attribute__((always_inline)) void pa_values(const float *st, int64_t j0, int64_t j1, int64_t keys,
                                                            const float *const *v, int64_t f0, int64_t r0,
                                                            const float *inv, float *const *orow, const int MR,
                                                            const int NP) {
    __m512 acc[4][4];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++)
            acc[r][p] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(orow[r0 + r] + f0 + 16 * p);
    for (int64_t j = j0; j < j1; j++) {
        __m512 vv[4];
        for (int p = 0; p < NP; p++) vv[p] = _mm512_loadu_ps(v[j] + f0 + 16 * p);
        for (int r = 0; r < MR; r++) {
            const __m512 w = _mm512_set1_ps(st[j * PA_TILE + r0 + r]);
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_fmadd_ps(w, vv[p], acc[r][p]);
        }
    }
    for (int r = 0; r < MR; r++) {
        const __m512 scale = _mm512_set1_ps(j1 == keys ? inv[r0 + r] : 1.0f);
        for (int p = 0; p < NP; p++)
            _mm512_storeu_ps(orow[r0 + r] + f0 + 16 * p, j1 == keys ? _mm512_mul_ps(acc[r][p], scale) : acc[r][p]);
    }
}

#define PA_SCORES(np) \
    case np: pa_scores(k + j, qt, head_dim, st + j * PA_TILE, 8, np); break;
#define PA_VALUES(mr, np) \
    case (mr) * 5 + (np): pa_values(st, j0, j1, keys, v, f0, r0, inv, orow, mr, np); break;

/* One tile of rows (positions pos[r], query rows qrow[r], outputs orow[r]) against the task's key and value rows
 * (krow, vrow) from position `first` (a multiple of 16) up to the tile's last position. */
static void pa_tile(int64_t rows, const int64_t *pos, const float *const *qrow, float *const *orow,
                    const float *const *krow, const float *const *vrow, int64_t first, int64_t head_dim,
                    int64_t v_dim, float scale, int64_t window, float soft_cap, float *qt, float *st, float *inv) {
    const int64_t np = (rows + 15) / 16;
    int64_t lo = pos[0], hi = pos[0];
    for (int64_t r = 1; r < rows; r++) lo = pos[r] < lo ? pos[r] : lo, hi = pos[r] > hi ? pos[r] : hi;
    int64_t tile_first = window > 0 && lo + 1 > window ? lo + 1 - window : 0;
    tile_first = tile_first / 16 * 16 > first ? tile_first / 16 * 16 : first;
    const int64_t keys = (hi + 1 - tile_first + 15) / 16 * 16; /* whole columns of 16; those past hi are masked */
    const float *const *k = krow + (tile_first - first), *const *v = vrow + (tile_first - first);
    /* the queries transposed, 16 rows x 16 features at a time; rows past `rows` zero */
    for (int64_t p = 0; p < np; p++)
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            __m512i block[16];
            for (int64_t r = 0; r < 16; r++)
                block[r] = p * 16 + r < rows ? _mm512_loadu_si512(qrow[p * 16 + r] + d0) : _mm512_setzero_si512();
            transpose16_epi32(block);
            for (int64_t d = 0; d < 16; d++) _mm512_store_si512(qt + (d0 + d) * PA_TILE + 16 * p, block[d]);
        }
    for (int64_t j = 0; j < keys; j += 8) {
        switch (np) {
            PA_SCORES(1) PA_SCORES(2) PA_SCORES(3)
        }
    }
    /* the softmax of each row (lane) over its allowed keys, kp <= pos and kp > pos - window: only the keys from
     * `masked_from` (past the lowest row's position) or below `masked_below` (out of the highest's window) need
     * the comparison; exp(score x scale - max x scale) in one rounding (scale > 0). A soft cap first turns each
     * score into cap tanh(score x scale / cap), in place */
    const int64_t masked_from = lo + 1 - tile_first, masked_below = window > 0 ? hi + 1 - window - tile_first : 0;
    if (soft_cap > 0.0f) {
        const __m512 inward = _mm512_set1_ps(scale / soft_cap), cap = _mm512_set1_ps(soft_cap);
        for (int64_t j = 0; j < keys; j++)
            for (int64_t p = 0; p < np; p++) {
                float *col = st + j * PA_TILE + 16 * p;
                _mm512_store_ps(col, _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(_mm512_load_ps(col), inward))));
            }
        scale = 1.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p = 0; p < np; p++) {
        int32_t lane_pos[16];
        for (int l = 0; l < 16; l++) lane_pos[l] = (int32_t)(p * 16 + l < rows ? pos[p * 16 + l] : -1);
        const __m512i row_pos = _mm512_loadu_si512(lane_pos);
        const __m512i row_low = _mm512_sub_epi32(row_pos, _mm512_set1_epi32(window > 0 ? (int32_t)window : INT32_MAX));
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < keys; j++) {
            const __m512 s = _mm512_load_ps(st + j * PA_TILE + 16 * p);
            if (j >= masked_below && j < masked_from) {
                vmax = _mm512_max_ps(vmax, s);
                continue;
            }
            const __m512i kp = _mm512_set1_epi32((int32_t)(tile_first + j));
            const __mmask16 allowed = _mm512_cmple_epi32_mask(kp, row_pos) & _mm512_cmpgt_epi32_mask(kp, row_low);
            vmax = _mm512_mask_max_ps(vmax, allowed, vmax, s);
        }
        const __m512 shift = _mm512_mul_ps(vmax, vscale);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            float *col = st + j * PA_TILE + 16 * p;
            __m512 e = exp512(_mm512_fmsub_ps(_mm512_load_ps(col), vscale, shift));
            if (j < masked_below || j >= masked_from) {
                const __m512i kp = _mm512_set1_epi32((int32_t)(tile_first + j));
                e = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(kp, row_pos) & _mm512_cmpgt_epi32_mask(kp, row_low), e);
            }
            _mm512_store_ps(col, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(inv + 16 * p, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    }
    /* blocks of PA_VALUE_KEYS keys: their values stay in L1 for every row of the tile */
    for (int64_t j0 = 0; j0 < keys; j0 += PA_VALUE_KEYS) {
      const int64_t j1 = keys - j0 < PA_VALUE_KEYS ? keys : j0 + PA_VALUE_KEYS;
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int mr = rows - r0 < 4 ? (int)(rows - r0) : 4;
        for (int64_t f0 = 0; f0 < v_dim; f0 += 64) {
            const int fp = (v_dim - f0) / 16 < 4 ? (int)((v_dim - f0) / 16) : 4;
            switch (mr * 5 + fp) {
                PA_VALUES(1, 1) PA_VALUES(1, 2) PA_VALUES(1, 3) PA_VALUES(1, 4)
                PA_VALUES(2, 1) PA_VALUES(2, 2) PA_VALUES(2, 3) PA_VALUES(2, 4)
                PA_VALUES(3, 1) PA_VALUES(3, 2) PA_VALUES(3, 3) PA_VALUES(3, 4)
                PA_VALUES(4, 1) PA_VALUES(4, 2) PA_VALUES(4, 3) PA_VALUES(4, 4)
            }
        }
      }
    }
}
#undef PA_SCORES
#undef PA_VALUES

static _Thread_local float *pa_scratch;
static _Thread_local size_t pa_scratch_bytes;

/* The calling thread's scratch for tasks of up to max_keys keys (kept between calls: a prefill's layers reuse it);
 * NULL when it cannot grow. */
static float *pa_buffer(int64_t max_keys, int64_t head_dim, int64_t v_dim, int kind) {
    const size_t floats = (size_t)(max_keys * PA_TILE + head_dim * PA_TILE + PA_TILE + (head_dim > v_dim ? head_dim : v_dim)
                                   + (kind ? max_keys * (head_dim + v_dim) : 0));
    const size_t bytes = (sizeof(float) * floats + sizeof(void *) * (size_t)(2 * max_keys + 2 * PA_TASK_ROWS)
                          + sizeof(int64_t) * PA_TASK_ROWS + 63) / 64 * 64;
    if (bytes > pa_scratch_bytes) {
        free(pa_scratch);
        pa_scratch = aligned_alloc(64, bytes);
        pa_scratch_bytes = pa_scratch ? bytes : 0;
    }
    if (pa_scratch) memset(pa_scratch + max_keys * PA_TILE + head_dim * PA_TILE + PA_TILE, 0,
                           sizeof(float) * (size_t)(head_dim > v_dim ? head_dim : v_dim)); /* the row of zeros */
    return pa_scratch;
}

/* query [tokens][heads][head_dim] float32; the caches [blocks][block_size][kv_heads][dim] of `kind` (0 float32,
 * 1 float16, 2 bfloat16); sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1], its last
 * positions of seq_lens[s] (already in the cache); out [tokens][heads][v_dim] float32. Returns 0; -1: a buffer
 * could not be allocated; -2: dims not multiples of 16 or a bad kind. */
int paged_prefill_attention(const float *query, const void *key_cache, const void *value_cache,
                            const int64_t *block_tables, const int64_t *query_start_loc, const int64_t *seq_lens,
                            float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t v_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            float soft_cap, int kind) {
    if (head_dim % 16 || v_dim % 16 || kind < 0 || kind > 2) return -2;
    const int64_t group = num_heads / num_kv_heads;
    /* tasks: (sequence, kv head, PA_TASK_ROWS rows), the sequences' row chunks listed first to last */
    int64_t tasks = 0, max_keys = 16;
    for (int64_t s = 0; s < num_seqs; s++) {
        tasks += ((query_start_loc[s + 1] - query_start_loc[s]) * group + PA_TASK_ROWS - 1) / PA_TASK_ROWS;
        max_keys = seq_lens[s] + 16 > max_keys ? seq_lens[s] + 16 : max_keys;
    }
    int64_t *task_seq = malloc(sizeof(int64_t) * (size_t)(2 * tasks + 1));
    if (!task_seq) return -1;
    int64_t *task_row = task_seq + tasks;
    for (int64_t s = 0, t = 0; s < num_seqs; s++)
        for (int64_t r = 0; r < (query_start_loc[s + 1] - query_start_loc[s]) * group; r += PA_TASK_ROWS)
            task_seq[t] = s, task_row[t++] = r;
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; s++) work += (query_start_loc[s + 1] - query_start_loc[s]) * seq_lens[s];
    /* below ~1M multiply-adds a second thread costs more to wake than it saves (as attention.c) */
    const int parallel = work * num_heads * (head_dim + v_dim) > (1 << 20) && tasks * num_kv_heads > 1;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *buffer = pa_buffer(max_keys, head_dim, v_dim, kind);
        if (!buffer) {
#pragma omp atomic write
            failed = 1;
        }
        /* scores, transposed queries, 1 / sums, a row of zeros, the widened rows (16-bit caches), the tasks' rows */
        float *st = buffer, *qt = st + max_keys * PA_TILE, *inv = qt + head_dim * PA_TILE, *zeros = inv + PA_TILE;
        float *wide_k = zeros + (head_dim > v_dim ? head_dim : v_dim), *wide_v = wide_k + (kind ? max_keys * head_dim : 0);
        const float **krow = (const float **)(wide_v + (kind ? max_keys * v_dim : 0)), **vrow = krow + max_keys;
        const float **qrow = vrow + max_keys;
        float **orow = (float **)(qrow + PA_TASK_ROWS);
        int64_t *pos = (int64_t *)(orow + PA_TASK_ROWS);
        /* the last chunks (the most keys) first */
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t ti = 0; ti < tasks; ti++) {
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                if (!buffer) continue;
                const int64_t t = tasks - 1 - ti, s = task_seq[t], r_first = task_row[t];
                const int64_t count = query_start_loc[s + 1] - query_start_loc[s], len = seq_lens[s];
                const int64_t r_end = count * group - r_first < PA_TASK_ROWS ? count * group : r_first + PA_TASK_ROWS;
                for (int64_t r = r_first; r < r_end; r++) {
                    const int64_t token = query_start_loc[s] + r / group, head = kv * group + r % group;
                    pos[r - r_first] = len - count + r / group;
                    qrow[r - r_first] = query + (token * num_heads + head) * head_dim;
                    orow[r - r_first] = out + (token * num_heads + head) * v_dim;
                }
                const int64_t lo = pos[0], hi = pos[r_end - r_first - 1];
                const int64_t first = (window > 0 && lo + 1 > window ? lo + 1 - window : 0) / 16 * 16;
                const int64_t last = first + (hi + 1 - first + 15) / 16 * 16;
                const int64_t *table = block_tables + s * max_blocks;
                pa_rows(key_cache, kind, table, block_size, num_kv_heads, kv, head_dim, first, last, len, zeros, wide_k,
                        krow);
                pa_rows(value_cache, kind, table, block_size, num_kv_heads, kv, v_dim, first, last, len, zeros, wide_v,
                        vrow);
                for (int64_t r0 = 0; r0 < r_end - r_first; r0 += PA_TILE) {
                    const int64_t rows = r_end - r_first - r0 < PA_TILE ? r_end - r_first - r0 : PA_TILE;
                    pa_tile(rows, pos + r0, qrow + r0, orow + r0, krow, vrow, first, head_dim, v_dim, scale, window,
                            soft_cap, qt, st, inv);
                }
            }
        }
    }
    free(task_seq);
    return failed ? -1 : 0;
}
#else
int prefill_attention_supported(void) { return 0; }

int paged_prefill_attention(const float *query, const void *key_cache, const void *value_cache,
                            const int64_t *block_tables, const int64_t *query_start_loc, const int64_t *seq_lens,
                            float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t v_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            float soft_cap, int kind) {
    (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)query_start_loc, (void)seq_lens;
    (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)v_dim, (void)block_size;
    (void)max_blocks, (void)scale, (void)window, (void)soft_cap, (void)kind;
    return -2;
}
#endif
