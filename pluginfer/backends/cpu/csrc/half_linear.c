/* half_linear: y = x W^T (+ bias) for bfloat16 or float16 weights W [n][k] in the checkpoint's own
 * layout (nothing repacked: a prefill too large for these tiles hands the same tensor to torch),
 * x [m][k] of the same dtype, products summed in float32, each output rounded once to x's dtype
 * (round to nearest even) or stored as float32.
 *
 * Exactness: a product of two bfloat16 (8-bit significands) or two float16 (11-bit) values is exact
 * in float32 (16 or 22 bits), so the only rounding before the output's is the float32 sum's, as in
 * torch's reference; only the order of the additions differs. vdpbf16ps (AVX512-BF16) treats
 * bfloat16 subnormal inputs as zero and flushes subnormal float32 results to zero (DAZ/FTZ).
 *
 * half_weight_linear: the same tiles for float32 x against a bfloat16/float16 weight (a GGUF file's F16/BF16
 * tensors in a float32 model), float32 bias and out: each weight widened exactly to float32 and multiplied
 * by the fused multiply-add, so the float32 reference up to the order of the additions.
 *
 * Dot-product tiles: a tile holds HL_MR rows of x and HL_NO outputs; each step loads one vector of
 * every row of x and of every weight row and adds their lane-wise products into MR x NO vector
 * accumulators; at the end of the row each accumulator's lanes are summed. Each weight vector is
 * loaded once per tile and used by all its rows, each x vector by all its outputs.
 *   AVX512-BF16: bfloat16 W and x straight into vdpbf16ps (32 products per instruction, per lane
 *                the pair 2i, 2i + 1 of a block of 32);
 *   AVX-512:     float16 W widened with vcvtph2ps (bfloat16 without AVX512-BF16: a 16-bit shift),
 *                x widened once per call into a float32 buffer, then vfmadd over 16 lanes;
 *   AVX2 + F16C: the same over 8 lanes.
 * Every output of every row takes the same operations in the same order whatever the row count, the
 * tile it falls in, the thread or the outputs around it (an output past n in a partial tile re-reads
 * the last weight row, and its result is dropped): a row's result never depends on its batch.
 *
 * Threads (OpenMP) split the output tiles into contiguous ranges. Rows go in blocks of HL_ROW_BLOCK
 * whose activations stay in cache while the tiles pass over them, so the weight is read from memory
 * once per block (once per call in decode). Each weight row's reads are followed by a prefetch of the
 * same columns of the row HL_NO rows on, which the thread's next tile reads: one tile of reads in flight
 * ahead of the loads (one core then reads a bfloat16 weight at about the machine's read bandwidth,
 * 11-15 GB/s, where a prefetch 2 KiB ahead in the row, i.e. into the tile's own next row for 1024 inputs,
 * got 8-11). In the float tiles the lines are dealt out to the block's row groups in turn (all in the
 * first group's pass left the memory idle during the others': ~6 % of a 16-row step's linears). The
 * prefetch goes to L2 (_MM_HINT_T1), not L1: with 1024 inputs (tiles then of 8 weight rows of 2 KiB) an L1 prefetch
 * left one core 10-15 % under a plain sum's read rate over the same bytes (float16 12.5-13.3 GB/s against
 * 15-16), an L2 one 5-9 % (14.0-14.5); at 2816 inputs both read at the sum's rate.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && defined(__FMA__)
#define HL_AVX512 1
#define HL_LANES 16
/* 32 zmm registers: 6 x 4 accumulators, 6 rows of x, 1 weight vector. Against 3 x 8, each widened weight vector
 * serves 6 rows instead of 3 (the widening shares the multiply-adds' ports): 1.15-1.45x at 4-24 rows, the same sums */
#define HL_MR 6
#define HL_NO 4
#if defined(__AVX512BF16__)
#define HL_DPBF16 1
#endif
#include <immintrin.h>
#include "sum_tree_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HL_AVX2 1
#define HL_LANES 8
#define HL_MR 2 /* 16 ymm registers: 2 x 4 accumulators, 2 rows, 1 weight vector */
#define HL_NO 4
#include <immintrin.h>
#endif

enum { HL_BF16 = 0, HL_F16 = 1 };

#define HL_ROW_BLOCK 48

/* 1: AVX512-BF16 (vdpbf16ps for bfloat16, vcvtph2ps for float16); 2: AVX-512 without BF16; 3: AVX2 + F16C;
 * 0: no kernel (the caller uses torch). */
int half_linear_supported(void) {
#if defined(HL_DPBF16)
    return 1;
#elif defined(HL_AVX512)
    return 2;
#elif defined(HL_AVX2)
    return 3;
#else
    return 0;
#endif
}

#if defined(HL_AVX512) || defined(HL_AVX2)
#include "bf16_bits.h"

static inline float half_to_float(int dtype, uint16_t h) {
    return dtype == HL_BF16 ? bf16_to_float(h) : _cvtsh_ss(h);
}

#if defined(HL_AVX512)
typedef __m512 hl_vec;
#define hl_zero _mm512_setzero_ps
#define hl_load_x _mm512_loadu_ps
#define hl_fma _mm512_fmadd_ps
/* A vector's 16 lanes summed by one fixed tree, alone or four at once (sum_tree_avx512.h). */
#define hl_sum sum_tree_avx512
#define hl_sum4 sum_tree4_avx512
/* A tile row's HL_NO (= 4) sums. */
#define hl_sum_row(acc, sums) hl_sum4((acc)[0], (acc)[1], (acc)[2], (acc)[3], (sums))
static inline __m512 hl_widen(const int dtype, __m256i h) {
    return dtype == HL_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                            : _mm512_cvtph_ps(h);
}
static inline __m512 hl_load_w(const int dtype, const uint16_t *p) {
    return hl_widen(dtype, _mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 hl_load_w_tail(const int dtype, const uint16_t *p, int64_t count) {
    return hl_widen(dtype, _mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1), p));
}
#else
typedef __m256 hl_vec;
#define hl_zero _mm256_setzero_ps
#define hl_load_x _mm256_loadu_ps
#define hl_fma _mm256_fmadd_ps
static inline float hl_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 hl_widen(const int dtype, __m128i h) {
    return dtype == HL_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                            : _mm256_cvtph_ps(h);
}
static inline __m256 hl_load_w(const int dtype, const uint16_t *p) {
    return hl_widen(dtype, _mm_loadu_si128((const __m128i *)p));
}
static inline __m256 hl_load_w_tail(const int dtype, const uint16_t *p, int64_t count) {
    uint16_t lanes[8] = {0};
    memcpy(lanes, p, (size_t)count * 2);
    return hl_widen(dtype, _mm_loadu_si128((const __m128i *)lanes));
}
#endif

/* MR rows of float32 x (rows ldx apart, zeros from k to ldx) times HL_NO weight rows w[o] of k
 * elements: sums[r * HL_NO + o]. */
static inline __attribute__((always_inline)) void tile_float(const int dtype, const int mr, const float *x,
                                                             int64_t ldx, const uint16_t *const *w, int64_t k,
                                                             float *sums, int prefetch) {
    hl_vec acc[HL_MR][HL_NO];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) acc[r][o] = hl_zero();
    /* prefetch: 0, or 1 + this row group's share + 16 * the shares (row groups) the lines are split in */
    const int shares = prefetch ? (prefetch - 1) >> 4 : 0, share = prefetch ? (prefetch - 1) & 15 : 0;
    int line = 0;
    int64_t i = 0;
    for (; i + HL_LANES <= k; i += HL_LANES) {
        hl_vec xv[HL_MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) xv[r] = hl_load_x(x + r * ldx + i);
        int fetch = 0;
        if (shares && (i & 31) == 0) { /* one prefetch per 64-byte line, the lines dealt out to the row groups */
            fetch = line == share;
            line = line + 1 == shares ? 0 : line + 1;
        }
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) {
            if (fetch) _mm_prefetch((const char *)(w[o] + i + HL_NO * k), _MM_HINT_T1);
            const hl_vec wv = hl_load_w(dtype, w[o] + i);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) acc[r][o] = hl_fma(xv[r], wv, acc[r][o]);
        }
    }
    if (i < k) {
        hl_vec xv[HL_MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) xv[r] = hl_load_x(x + r * ldx + i);
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) {
            const hl_vec wv = hl_load_w_tail(dtype, w[o] + i, k - i);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) acc[r][o] = hl_fma(xv[r], wv, acc[r][o]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
#if defined(HL_AVX512)
        hl_sum_row(acc[r], sums + r * HL_NO);
#else
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) sums[r * HL_NO + o] = hl_sum(acc[r][o]);
#endif
    }
}

#if defined(HL_DPBF16)
/* MR rows of bfloat16 x (rows ldx apart) times HL_NO bfloat16 weight rows, with vdpbf16ps. */
static inline __attribute__((always_inline)) void tile_dpbf16(const int mr, const uint16_t *x, int64_t ldx,
                                                              const uint16_t *const *w, int64_t k, float *sums,
                                                              int prefetch) {
    __m512 acc[HL_MR][HL_NO];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) acc[r][o] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh xv[HL_MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + i);
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) {
            if (prefetch) _mm_prefetch((const char *)(w[o] + i + HL_NO * k), _MM_HINT_T1);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[o] + i);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv[r], wv);
        }
    }
    if (i < k) {
        const __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh xv[HL_MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + i);
#pragma GCC unroll 8
        for (int o = 0; o < HL_NO; o++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[o] + i);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv[r], wv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) hl_sum_row(acc[r], sums + r * HL_NO);
}
#endif

/* One tile of `rows` (1..HL_MR) rows, the row count a compile-time constant in each branch. HL_ROWS keeps a case
 * within HL_MR where it is smaller (AVX2's 2: those cases are never reached). */
#define HL_ROWS(r) ((r) < HL_MR ? (r) : HL_MR)
static void tile(int dpbf16, int dtype, int rows, const void *x, int64_t ldx, const uint16_t *const *w, int64_t k,
                 float *sums, int prefetch) {
#if defined(HL_DPBF16)
    if (dpbf16) {
        const uint16_t *xh = (const uint16_t *)x;
        switch (rows) {
        case 1: tile_dpbf16(1, xh, ldx, w, k, sums, prefetch); return;
        case 2: tile_dpbf16(2, xh, ldx, w, k, sums, prefetch); return;
        case 3: tile_dpbf16(3, xh, ldx, w, k, sums, prefetch); return;
        case 4: tile_dpbf16(4, xh, ldx, w, k, sums, prefetch); return;
        case 5: tile_dpbf16(5, xh, ldx, w, k, sums, prefetch); return;
        default: tile_dpbf16(HL_MR, xh, ldx, w, k, sums, prefetch); return;
        }
    }
#else
    (void)dpbf16;
#endif
    const float *xf = (const float *)x;
#define HL_FLOAT_TILES(DTYPE)                                                                 \
    switch (rows) {                                                                           \
    case 1: tile_float(DTYPE, 1, xf, ldx, w, k, sums, prefetch); return;                      \
    case 2: tile_float(DTYPE, 2, xf, ldx, w, k, sums, prefetch); return;                      \
    case 3: tile_float(DTYPE, HL_ROWS(3), xf, ldx, w, k, sums, prefetch); return;             \
    case 4: tile_float(DTYPE, HL_ROWS(4), xf, ldx, w, k, sums, prefetch); return;             \
    case 5: tile_float(DTYPE, HL_ROWS(5), xf, ldx, w, k, sums, prefetch); return;             \
    default: tile_float(DTYPE, HL_MR, xf, ldx, w, k, sums, prefetch); return;                 \
    }
    if (dtype == HL_BF16) {
        HL_FLOAT_TILES(HL_BF16)
    } else {
        HL_FLOAT_TILES(HL_F16)
    }
#undef HL_FLOAT_TILES
}

/* x widened to float32, rows padded with zeros to a whole number of vectors; one buffer per calling
 * thread, grown as needed. */
static _Thread_local float *widened;
static _Thread_local int64_t widened_capacity;

/* The tile loop shared by half_linear and half_weight_linear: x already in the tiles' form (bfloat16 for
 * vdpbf16ps, else float32 rows ldx apart, zero-padded to whole vectors), bias16 (the 16-bit dtype) or
 * bias32 (float32) or neither. */
static void run_tiles(int dpbf16, int dtype, const void *xs, int64_t ldx, int64_t m, int64_t k, const uint16_t *w,
                      int64_t n, const uint16_t *bias16, const float *bias32, void *out, int out_float) {
    const int64_t tiles = (n + HL_NO - 1) / HL_NO;
    const size_t x_row_bytes = dpbf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel if (n * k >= (1 << 15))
    for (int64_t rb = 0; rb < m; rb += HL_ROW_BLOCK) {
        const int64_t rb_end = m - rb < HL_ROW_BLOCK ? m : rb + HL_ROW_BLOCK;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint16_t *rows_w[HL_NO];
            for (int o = 0; o < HL_NO; o++) {
                const int64_t j = t * HL_NO + o < n ? t * HL_NO + o : n - 1;
                rows_w[o] = w + j * k;
            }
            for (int64_t r0 = rb; r0 < rb_end; r0 += HL_MR) {
                const int rows = rb_end - r0 < HL_MR ? (int)(rb_end - r0) : HL_MR;
                float sums[HL_MR * HL_NO];
                const int groups = (int)((rb_end - rb + HL_MR - 1) / HL_MR), group = (int)((r0 - rb) / HL_MR);
                tile(dpbf16, dtype, rows, (const char *)xs + (size_t)(r0 * ldx) * x_row_bytes, ldx, rows_w, k, sums,
                     dpbf16 ? r0 == rb : 1 + group + 16 * (groups < 16 ? groups : 16));
                for (int o = 0; o < HL_NO && t * HL_NO + o < n; o++) {
                    const int64_t j = t * HL_NO + o;
                    const float b = bias16 ? half_to_float(dtype, bias16[j]) : bias32 ? bias32[j] : 0.0f;
                    for (int r = 0; r < rows; r++) {
                        const float v = sums[r * HL_NO + o] + b;
                        const int64_t at = (r0 + r) * n + j;
                        if (out_float)
                            ((float *)out)[at] = v;
                        else
                            ((uint16_t *)out)[at] = dtype == HL_BF16 ? float_to_bf16(v)
                                                                     : _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
                    }
                }
            }
        }
    }
}

/* The per-thread float32 buffer of m rows of ldx; NULL if it cannot grow. */
static float *widened_rows(int64_t m, int64_t ldx) {
    if (m * ldx > widened_capacity) {
        float *grown = realloc(widened, (size_t)(m * ldx) * sizeof(float));
        if (!grown) return NULL;
        widened = grown;
        widened_capacity = m * ldx;
    }
    return widened;
}

/* dtype: 0 bfloat16, 1 float16 (x, w, bias and a 16-bit out share it). x [m][k], w [n][k], bias [n] or
 * NULL, out [m][n]: float32 when out_float, else the 16-bit dtype. Returns 0; -2: a bad dtype;
 * -3: the widening buffer could not be allocated; -4: no kernel for this CPU. */
int half_linear(int dtype, const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                const uint16_t *bias, void *out, int out_float) {
    if (dtype != HL_BF16 && dtype != HL_F16) return -2;
    if (m <= 0 || n <= 0) return 0;
#if defined(HL_DPBF16)
    const int dpbf16 = dtype == HL_BF16;
#else
    const int dpbf16 = 0;
#endif
    const void *xs = x;
    int64_t ldx = k;
    if (!dpbf16) {
        ldx = (k + HL_LANES - 1) / HL_LANES * HL_LANES;
        float *wide = widened_rows(m, ldx);
        if (!wide) return -3;
#pragma omp parallel for if (m * k >= (1 << 16))
        for (int64_t r = 0; r < m; r++) {
            for (int64_t i = 0; i < k; i++) wide[r * ldx + i] = half_to_float(dtype, x[r * k + i]);
            for (int64_t i = k; i < ldx; i++) wide[r * ldx + i] = 0.0f;
        }
        xs = wide;
    }
    run_tiles(dpbf16, dtype, xs, ldx, m, k, w, n, bias, NULL, out, out_float);
    return 0;
}

/* y = x W^T (+ bias) for float32 x [m][k] (rows contiguous) and a bfloat16 / float16 weight w [n][k] (dtype
 * as above; a GGUF file's F16/BF16 tensor in a float32 model), float32 bias [n] or NULL, float32 out [m][n].
 * Each weight is widened to float32 exactly (vcvtph2ps, or a 16-bit shift for bfloat16) and multiplied
 * with x in float32 by fused multiply-adds, as half_linear's float tiles do: the float32 reference
 * x @ W.float().T up to the order of its additions (and the fused multiply-add's single rounding).
 * vdpbf16ps is not used: it would round x to bfloat16. x is read in place when k is a whole number of
 * vectors, else copied once into the zero-padded buffer. Returns as half_linear. */
int half_weight_linear(int dtype, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                       const float *bias, float *out) {
    if (dtype != HL_BF16 && dtype != HL_F16) return -2;
    if (m <= 0 || n <= 0) return 0;
    const float *xs = x;
    int64_t ldx = k;
    if (k % HL_LANES) {
        ldx = (k + HL_LANES - 1) / HL_LANES * HL_LANES;
        float *wide = widened_rows(m, ldx);
        if (!wide) return -3;
        for (int64_t r = 0; r < m; r++) {
            memcpy(wide + r * ldx, x + r * k, (size_t)k * sizeof(float));
            for (int64_t i = k; i < ldx; i++) wide[r * ldx + i] = 0.0f;
        }
        xs = wide;
    }
    run_tiles(0, dtype, xs, ldx, m, k, w, n, NULL, bias, out, 1);
    return 0;
}
#else
int half_linear(int dtype, const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                const uint16_t *bias, void *out, int out_float) {
    (void)dtype, (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)out_float;
    return -4;
}

int half_weight_linear(int dtype, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                       const float *bias, float *out) {
    (void)dtype, (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)out;
    return -4;
}
#endif
