/* amx_quant: y = x W^T for float32 activations x [m][k] and raw llama.cpp blocks W [n][row_bytes] on
 * AMX int8 tiles (Sapphire Rapids and later), for the 2..128 rows where quant_dot.c's AVX-512 VNNI
 * kernel is compute-bound. Its own library: a compiler or a CPU without AMX leaves quant_dot untouched.
 *
 * The arithmetic is quant_dot's: each row of x is quantized per block of 32 to int8 with a float32
 * scale dx (llama.cpp's quantize_row_q8_0, the same code as quant_dot.c's quantize_row, tested bit for
 * bit against it), and the integer dot product of a block's weight levels with the row's 32 int8
 * values is exact. What differs is where the float sums happen: quant_dot scales 4-product lanes and
 * sums 16 lanes at the end; here the whole block's int32 dot I comes out of the tile and is scaled once:
 *     acc += (float(I) * dx) * dw          (+ (dx * sum of the block's int8) * -min, Q4_K)
 * in block order, one float32 accumulator per (row, output). So the two kernels agree up to float32
 * rounding of the same terms (tests/backends/test_native_amx_quant.py states the bound), and every
 * output of every row takes exactly these operations whatever the rows beside it, the tile or the
 * thread: a row's result never depends on its batch.
 *
 * Tiles. The weights are the A operand, read as they lie in the file: tile A is 16 output rows x 32
 * int8 levels of one block (Q8_0: loaded straight from the blocks with the row stride, the fp16 scale
 * skipped; Q4_0, Q4_K, Q6_K: unpacked to signed levels in a 512-byte buffer first). The activations
 * are the B operand, laid out once per call in the VNNI-interleaved form tdpbssd wants (for 16 rows of
 * x: 8 rows of 64 bytes per block, byte 4m + j of row i = x[m][4i + j]). C = A B is 16 outputs x 16
 * rows of int32, stored, and each output's 16 row-lanes are scaled into its zmm accumulator. No repack
 * at load: the weights' bytes are the file's, so memory is unchanged. Q6_K has 16-weight scales, so
 * its blocks take two K=16 products. Threads (OpenMP) split the 16-output tiles; rows past 16 take
 * another pass over the tile's weights, from cache.
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * amx_quant_init asks once per process and says whether it was granted.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__F16C__) && defined(__linux__) && defined(__x86_64__)
#define AQ_AMX 1
#include <immintrin.h>
#include "q8_block_avx512.h"
#include "amx_tile_state.h"
#endif

enum { AQ_Q4_0 = 2, AQ_Q8_0 = 8, AQ_Q4_K = 12, AQ_Q6_K = 14 };

static int aq_block(int type, int64_t *weights, int64_t *bytes) {
    switch (type) {
    case AQ_Q4_0: *weights = 32; *bytes = 18; return 1;
    case AQ_Q8_0: *weights = 32; *bytes = 34; return 1;
    case AQ_Q4_K: *weights = 256; *bytes = 144; return 1;
    case AQ_Q6_K: *weights = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

/* Whether the library holds the AMX kernels (built for a CPU with AMX-TILE and AMX-INT8). */
int amx_quant_compiled(void) {
#if defined(AQ_AMX)
    return 1;
#else
    return 0;
#endif
}

static int aq_granted;

/* Asks Linux for the tile data state. 0: granted; otherwise the errno of the refusal, or -1 when the
 * library has no AMX kernels. */
int amx_quant_init(void) {
#if defined(AQ_AMX)
    return amx_request_tile_state(&aq_granted);
#else
    return -1;
#endif
}

int amx_quant_type_supported(int type) {
    int64_t weights, bytes;
    return aq_block(type, &weights, &bytes);
}

#if defined(AQ_AMX)
/* Where a call's phases begin and end (for a timing probe; nothing otherwise reads them): 0 entry,
 * 1 buffers ready, per thread 2 in the parallel region, 3 activations quantized, 4 tiles configured,
 * 5 tiles done, 6 tile state released; 7 threads joined. */
#ifndef AQ_PHASE
#define AQ_PHASE(thread, phase) ((void)0)
#endif
#define AQ_ROWS 16 /* rows of x per group (the B tile's 16 int32 columns) */
#define AQ_COLS 16 /* outputs per tile (the A tile's 16 rows) */
#define AQ_B_BYTES 512 /* one block of 32 activations for 16 rows, VNNI-interleaved */

/* The tile configuration (palette 1): tiles 0 and 4 A (16 x K bytes), 1 and 5 B (K/4 x 64), 2, 3, 6 and
 * 7 C (16 x 64): two pairs of products in flight. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} aq_config;

static void aq_configure(int k_bytes) {
    aq_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.colsb[0] = (uint16_t)k_bytes, config.rows[0] = AQ_COLS;
    config.colsb[1] = 64, config.rows[1] = (uint8_t)(k_bytes / 4);
    config.colsb[2] = 64, config.rows[2] = AQ_COLS;
    config.colsb[3] = 64, config.rows[3] = AQ_COLS;
    config.colsb[4] = (uint16_t)k_bytes, config.rows[4] = AQ_COLS;
    config.colsb[5] = 64, config.rows[5] = (uint8_t)(k_bytes / 4);
    config.colsb[6] = 64, config.rows[6] = AQ_COLS;
    config.colsb[7] = 64, config.rows[7] = AQ_COLS;
    _tile_loadconfig(&config);
}

/* Block b of row x as quant_dot.c's quantize_row quantizes it (d = max|x| / 127, levels rounded half to
 * even from x * (127 / max|x|); a block with an infinity or a NaN gets a NaN scale and zero levels; one
 * whose 127 / max|x| overflows is zeros with scale 0), written as lane `lane` of its group's block: the
 * levels into the interleaved B block (512 bytes), the scale into dx[lane], dx * (sum of levels) into
 * cs[lane]. */
static inline void aq_quantize_block(const float *x, uint8_t *block, float *dx, float *cs, int lane) {
    __m128i q0, q1;
    int32_t sum;
    const float d = q8_block_avx512(x, &q0, &q1, &sum);
    uint32_t words[8];
    _mm_storeu_si128((__m128i *)words, q0);
    _mm_storeu_si128((__m128i *)(words + 4), q1);
    for (int i = 0; i < 8; i++) memcpy(block + 64 * i + 4 * lane, &words[i], 4);
    dx[lane] = d;
    cs[lane] = d * (float)sum;
}

/* Block b of every row of group g (rows rows of x, k apart) into the group's B block, dx and cs; the
 * lanes past the last row are zeros (levels, dx, cs). One block of a group is 512 + 2 x 64 bytes that
 * no other block shares: threads split the work by blocks, so no two write one cache line (split by rows,
 * every 64-byte line of a B block takes 4 bytes of each of its 16 rows, and the lines went back and forth
 * between the cores: two threads were slower than one). */
static void aq_quantize_group_block(const float *x, int64_t rows, int64_t k, int64_t b, uint8_t *block, float *dx,
                                    float *cs) {
    for (int64_t r = 0; r < rows; r++) aq_quantize_block(x + r * k + 32 * b, block, dx, cs, (int)r);
    if (rows < AQ_ROWS) {
        for (int i = 0; i < 8; i++) memset(block + 64 * i + 4 * rows, 0, (size_t)(4 * (AQ_ROWS - rows)));
        for (int64_t r = rows; r < AQ_ROWS; r++) dx[r] = cs[r] = 0.0f;
    }
}

/* 16 fp16 values at base + i * stride (i = 0..15) as float32 lanes. */
static inline __m512 aq_halfs(const uint8_t *base, int64_t stride) {
    const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)stride));
    const __m512i words = _mm512_i32gather_epi32(index, base, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}

/* The weight rows of the next tile of outputs, at the same offset: one tile ahead (16 rows x the row's
 * bytes) is far enough for memory latency and near enough to stay in cache. */
#ifndef AQ_PF_TILES
#define AQ_PF_TILES 1
#endif
#ifndef AQ_PF_HINT
#define AQ_PF_HINT _MM_HINT_T1 /* L2: L1 holds the tile being multiplied and the activations (16 KiB per 1024 inputs) */
#endif
static inline void aq_prefetch(const uint8_t *w, int64_t row_bytes, int64_t at, int lines) {
    const uint8_t *next = w + AQ_PF_TILES * AQ_COLS * row_bytes + at;
#pragma GCC unroll 16
    for (int o = 0; o < AQ_COLS; o++)
        for (int line = 0; line < lines; line++) _mm_prefetch((const char *)(next + o * row_bytes + 64 * line), AQ_PF_HINT);
}

/* C as stored (16 outputs x 16 row-lanes of int32) into the accumulators: acc[o] += (float(C[o]) * dxv) * dw[o]. */
static inline void aq_scale(__m512 acc[AQ_COLS], const int32_t *c, __m512 dxv, const float *dw) {
#pragma GCC unroll 16
    for (int o = 0; o < AQ_COLS; o++)
        acc[o] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * o)), dxv),
                                 _mm512_set1_ps(dw[o]), acc[o]);
}

/* The mins of Q4_K: acc[o] += csv * -min[o]. */
static inline void aq_mins(__m512 acc[AQ_COLS], __m512 csv, const float *minus) {
#pragma GCC unroll 16
    for (int o = 0; o < AQ_COLS; o++) acc[o] = _mm512_fmadd_ps(csv, _mm512_set1_ps(minus[o]), acc[o]);
}

/* Products in flight: a pair of products is issued into one set of C tiles (set 0: tiles 2 and 3, set 1:
 * 6 and 7) while the other set's pair, issued before, is stored and scaled; A operands in tiles 0 and
 * 4, B in 1 and 5. What a pair's results are scaled with: */
typedef struct {
    __m512 dx0, dx1, cs0, cs1; /* the activations' scales (lanes: rows), and dx * sum of levels (Q4_K) */
    const float *dw0, *dw1;    /* the weights' scales (per output) */
    const float *mn0, *mn1;    /* Q4_K: -(dmin * min) per output; else null */
    int count;                 /* 2, or 1 for the last block of an odd count (the second product is not read) */
    int halves;                /* Q6_K: the two products are one block's halves: acc += dx0 * (C dw0 + C2 dw1) */
} aq_pair;

static inline void aq_issue(int set, const void *a0, int64_t lda0, const void *b0, const void *a1, int64_t lda1,
                            const void *b1) {
    _tile_loadd(0, a0, lda0);
    _tile_loadd(1, b0, 64);
    _tile_loadd(4, a1, lda1);
    _tile_loadd(5, b1, 64);
    if (set) {
        _tile_zero(6);
        _tile_zero(7);
        _tile_dpbssd(6, 0, 1);
        _tile_dpbssd(7, 4, 5);
    } else {
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbssd(2, 0, 1);
        _tile_dpbssd(3, 4, 5);
    }
}

/* The pair issued into `set`, stored and scaled into the accumulators in block order. */
static inline void aq_finish(int set, __m512 acc[AQ_COLS], int32_t *c, int32_t *c2, const aq_pair *p) {
    if (set) {
        _tile_stored(6, c, 64);
        _tile_stored(7, c2, 64);
    } else {
        _tile_stored(2, c, 64);
        _tile_stored(3, c2, 64);
    }
    if (p->halves) {
#pragma GCC unroll 16
        for (int o = 0; o < AQ_COLS; o++) {
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * o)), _mm512_set1_ps(p->dw0[o]));
            acc[o] = _mm512_fmadd_ps(p->dx0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c2 + 16 * o)),
                                                             _mm512_set1_ps(p->dw1[o]), t), acc[o]);
        }
        return;
    }
    aq_scale(acc, c, p->dx0, p->dw0);
    if (p->mn0) aq_mins(acc, p->cs0, p->mn0);
    if (p->count == 2) {
        aq_scale(acc, c2, p->dx1, p->dw1);
        if (p->mn1) aq_mins(acc, p->cs1, p->mn1);
    }
}

/* Q4_0's levels of block b for the 16 outputs, minus 8, as 16 rows of 32 bytes at a. */
static inline void aq_q4_0_levels(const uint8_t *w, int64_t row_bytes, int64_t b, uint8_t *a) {
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
#pragma GCC unroll 16
    for (int o = 0; o < AQ_COLS; o++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(w + o * row_bytes + 18 * b + 2));
        _mm_store_si128((__m128i *)(a + 32 * o), _mm_sub_epi8(_mm_and_si128(q, low), eight));
        _mm_store_si128((__m128i *)(a + 32 * o + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), eight));
    }
}

/* The byte offsets of the tile's 16 weight rows, for gathers. */
static inline __m512i aq_row_offsets(int64_t row_bytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)row_bytes));
}

static inline __m512i aq_byte(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF)); }

/* Q4_K super-block at sb of the 16 rows (offsets rows): scales[j][o] = d * scale_j, minus[j][o] =
 * -(dmin * min_j) of output o, llama.cpp's get_scale_min_k4 in lanes (the same float products as one
 * at a time). */
static inline void aq_k4_scales(const uint8_t *sb, __m512i rows, float scales[8][AQ_COLS], float minus[8][AQ_COLS]) {
    const __m512i dd = _mm512_i32gather_epi32(rows, sb, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)), dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    const __m512i q0 = _mm512_i32gather_epi32(rows, sb + 4, 1), q1 = _mm512_i32gather_epi32(rows, sb + 8, 1),
                  q2 = _mm512_i32gather_epi32(rows, sb + 12, 1);
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    for (int j = 0; j < 8; j++) {
        __m512i sc, m;
        if (j < 4) {
            sc = _mm512_and_si512(aq_byte(q0, j), six);
            m = _mm512_and_si512(aq_byte(q1, j), six);
        } else {
            const int i = j - 4;
            sc = _mm512_or_si512(_mm512_and_si512(aq_byte(q2, i), four), _mm512_slli_epi32(_mm512_srli_epi32(aq_byte(q0, i), 6), 4));
            m = _mm512_or_si512(_mm512_srli_epi32(aq_byte(q2, i), 4), _mm512_slli_epi32(_mm512_srli_epi32(aq_byte(q1, i), 6), 4));
        }
        _mm512_store_ps(scales[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(minus[j], _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m))));
    }
}

/* Q6_K super-block at sb of the 16 rows: scales[s][o] = d * scale_s of output o (16 int8 scales). The
 * fp16 d is the block's last two bytes, gathered with the two before them (never past the block). */
static inline void aq_k6_scales(const uint8_t *sb, __m512i rows, float scales[16][AQ_COLS]) {
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(rows, sb + 206, 1), 16)));
    for (int i = 0; i < 4; i++) {
        const __m512i q = _mm512_i32gather_epi32(rows, sb + 192 + 4 * i, 1);
        for (int t = 0; t < 4; t++)
            _mm512_store_ps(scales[4 * i + t], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * t), 24))));
    }
}

/* 16 outputs (weight rows at w, row_bytes apart) x one group of 16 rows (its B blocks, dx, cs) over k:
 * acc[o] lane r = output o of row r. Blocks go in pairs, one pair's products in flight while the pair
 * before is scaled; each accumulator still takes its blocks in order. */
static void aq_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const uint8_t *levels,
                    const float *dx, const float *cs, __m512 acc[AQ_COLS]) {
    int32_t c[AQ_COLS * 16] __attribute__((aligned(64))), c2[AQ_COLS * 16] __attribute__((aligned(64)));
    uint8_t a[4][AQ_COLS * 32] __attribute__((aligned(64)));
    float dw[2][2][AQ_COLS] __attribute__((aligned(64)));                   /* Q8_0, Q4_0: per set */
    float scales[2][16][AQ_COLS] __attribute__((aligned(64)));              /* K types: per super-block parity */
    float minus[2][8][AQ_COLS] __attribute__((aligned(64)));
    aq_pair pairs[2];
    int set = 0, pending = 0;
    for (int o = 0; o < AQ_COLS; o++) acc[o] = _mm512_setzero_ps();
    const int64_t nb = k / 32;
    const __m512i rows = aq_row_offsets(row_bytes);
#define AQ_NEXT()                                                                                             \
    do {                                                                                                      \
        if (pending) aq_finish(!set, acc, c, c2, &pairs[!set]);                                              \
        pending = 1;                                                                                          \
        set = !set;                                                                                           \
    } while (0)
    if (type == AQ_Q8_0 || type == AQ_Q4_0) {
        const int64_t size = type == AQ_Q8_0 ? 34 : 18;
        for (int64_t b = 0; b < nb; b += 2) {
            const int count = b + 1 < nb ? 2 : 1;
            aq_pair *p = &pairs[set];
            aq_prefetch(w, row_bytes, size * b, type == AQ_Q8_0 ? 2 : 1);
            _mm512_store_ps(dw[set][0], aq_halfs(w + size * b, row_bytes));
            if (count == 2) _mm512_store_ps(dw[set][1], aq_halfs(w + size * (b + 1), row_bytes));
            *p = (aq_pair){.dx0 = _mm512_load_ps(dx + AQ_ROWS * b), .dw0 = dw[set][0], .dw1 = dw[set][1], .count = count};
            if (count == 2) p->dx1 = _mm512_load_ps(dx + AQ_ROWS * (b + 1));
            const int64_t b1 = count == 2 ? b + 1 : b; /* an odd count's last pair multiplies its block twice */
            if (type == AQ_Q8_0) {
                aq_issue(set, w + 34 * b + 2, row_bytes, levels + b * AQ_B_BYTES, w + 34 * b1 + 2, row_bytes,
                         levels + b1 * AQ_B_BYTES);
            } else {
                aq_q4_0_levels(w, row_bytes, b, a[0]);
                aq_q4_0_levels(w, row_bytes, b1, a[1]);
                aq_issue(set, a[0], 32, levels + b * AQ_B_BYTES, a[1], 32, levels + b1 * AQ_B_BYTES);
            }
            AQ_NEXT();
        }
    } else if (type == AQ_Q4_K) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int64_t u = 0; u < k / 256; u++) {
            float(*sc)[AQ_COLS] = scales[u % 2], (*mn)[AQ_COLS] = minus[u % 2];
            aq_prefetch(w, row_bytes, 144 * u, 3);
            aq_k4_scales(w + 144 * u, rows, sc, mn);
            for (int j = 0; j < 4; j++) { /* sub-blocks 2j (low nibbles) and 2j + 1 (high) */
                for (int o = 0; o < AQ_COLS; o++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(w + o * row_bytes + 144 * u + 16 + 32 * j));
                    _mm256_store_si256((__m256i *)(a[0] + 32 * o), _mm256_and_si256(q, low));
                    _mm256_store_si256((__m256i *)(a[1] + 32 * o), _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
                }
                const int64_t b = 8 * u + 2 * j;
                pairs[set] = (aq_pair){.dx0 = _mm512_load_ps(dx + AQ_ROWS * b), .dx1 = _mm512_load_ps(dx + AQ_ROWS * (b + 1)),
                                       .cs0 = _mm512_load_ps(cs + AQ_ROWS * b), .cs1 = _mm512_load_ps(cs + AQ_ROWS * (b + 1)),
                                       .dw0 = sc[2 * j], .dw1 = sc[2 * j + 1], .mn0 = mn[2 * j], .mn1 = mn[2 * j + 1],
                                       .count = 2};
                aq_issue(set, a[0], 32, levels + b * AQ_B_BYTES, a[1], 32, levels + (b + 1) * AQ_B_BYTES);
                AQ_NEXT();
            }
        }
    } else { /* Q6_K: blocks of 32 in two halves of 16 weights with their own scales; K = 16 tiles */
        const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3), bias = _mm512_set1_epi8(32);
        for (int64_t u = 0; u < k / 256; u++) {
            float(*sc)[AQ_COLS] = scales[u % 2];
            aq_prefetch(w, row_bytes, 210 * u, 4);
            aq_k6_scales(w + 210 * u, rows, sc);
            for (int half = 0; half < 2; half++) {
                /* a column's 128 weights of this half at once: blocks p = 0, 1 from the low nibbles of ql's
                 * 64 bytes and qh's bit pairs 0, 1; p = 2, 3 from the high nibbles and bit pairs 2, 3 */
                for (int o = 0; o < AQ_COLS; o++) {
                    const uint8_t *s = w + o * row_bytes + 210 * u;
                    const __m512i l = _mm512_loadu_si512(s + 64 * half);
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(s + 128 + 32 * half));
                    const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
                    const __m512i h23 = _mm512_srli_epi16(h01, 4);
                    const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, low),
                                                        _mm512_slli_epi16(_mm512_and_si512(h01, three), 4));
                    const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                                        _mm512_slli_epi16(_mm512_and_si512(h23, three), 4));
                    const __m512i l01 = _mm512_sub_epi8(q01, bias), l23 = _mm512_sub_epi8(q23, bias);
                    _mm256_store_si256((__m256i *)(a[0] + 32 * o), _mm512_castsi512_si256(l01));
                    _mm256_store_si256((__m256i *)(a[1] + 32 * o), _mm512_extracti64x4_epi64(l01, 1));
                    _mm256_store_si256((__m256i *)(a[2] + 32 * o), _mm512_castsi512_si256(l23));
                    _mm256_store_si256((__m256i *)(a[3] + 32 * o), _mm512_extracti64x4_epi64(l23, 1));
                }
                for (int p = 0; p < 4; p++) {
                    const int64_t b = 8 * u + 4 * half + p;
                    pairs[set] = (aq_pair){.dx0 = _mm512_load_ps(dx + AQ_ROWS * b), .dw0 = sc[8 * half + 2 * p],
                                           .dw1 = sc[8 * half + 2 * p + 1], .count = 2, .halves = 1};
                    aq_issue(set, a[p], 32, levels + b * AQ_B_BYTES, a[p] + 16, 32, levels + b * AQ_B_BYTES + 256);
                    AQ_NEXT();
                }
            }
        }
    }
    if (pending) aq_finish(!set, acc, c, c2, &pairs[!set]);
#undef AQ_NEXT
}

/* out [m][n] = x [m][k] W^T on AMX tiles. Returns -1 for a type it does not handle, -2 when k is not
 * whole blocks filling row_bytes, -3 when a buffer cannot be allocated, -4 when the tile state was
 * not granted (amx_quant_init). */
int amx_quant_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                     float *out) {
    int64_t weights, bytes;
    if (!aq_block(type, &weights, &bytes)) return -1;
    if (k <= 0 || k % weights || k / weights * bytes != row_bytes) return -2;
    if (!aq_granted) return -4;
    if (m <= 0 || n <= 0) return 0;
    AQ_PHASE(0, 0);
    const int64_t nb = k / 32, groups = (m + AQ_ROWS - 1) / AQ_ROWS, tiles = (n + AQ_COLS - 1) / AQ_COLS;
    const size_t levels_bytes = (size_t)(groups * nb * AQ_B_BYTES), scale_bytes = (size_t)(groups * nb * AQ_ROWS * 4);
    uint8_t *buffer = aligned_alloc(64, levels_bytes + 2 * scale_bytes + (size_t)(AQ_COLS * row_bytes + 64));
    if (!buffer) return -3;
    uint8_t *levels = buffer;
    float *dx = (float *)(buffer + levels_bytes), *cs = (float *)(buffer + levels_bytes + scale_bytes);
    uint8_t *tail = buffer + levels_bytes + 2 * scale_bytes; /* the last outputs, padded to 16 rows of zeros */
    if (n % AQ_COLS) {
        memset(tail, 0, (size_t)(AQ_COLS * row_bytes));
        memcpy(tail, w + (n - n % AQ_COLS) * row_bytes, (size_t)((n % AQ_COLS) * row_bytes));
    }
    const int k_bytes = type == AQ_Q6_K ? 16 : 32;
    AQ_PHASE(0, 1);
#pragma omp parallel if (n * k >= (1 << 15))
    {
        AQ_PHASE(omp_get_thread_num(), 2);
#pragma omp for schedule(static)
        for (int64_t gb = 0; gb < groups * nb; gb++) { /* block gb % nb of group gb / nb */
            const int64_t g = gb / nb, group_rows = m - g * AQ_ROWS < AQ_ROWS ? m - g * AQ_ROWS : AQ_ROWS;
            aq_quantize_group_block(x + g * AQ_ROWS * k, group_rows, k, gb % nb, levels + gb * AQ_B_BYTES,
                                    dx + gb * AQ_ROWS, cs + gb * AQ_ROWS);
        }
        AQ_PHASE(omp_get_thread_num(), 3);
        aq_configure(k_bytes);
        AQ_PHASE(omp_get_thread_num(), 4);
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = tiles * id / threads, hi = tiles * (id + 1) / threads;
        __m512 acc[AQ_COLS];
        float result[AQ_COLS][AQ_ROWS] __attribute__((aligned(64)));
        for (int64_t t = lo; t < hi; t++) {
            const int64_t o0 = t * AQ_COLS, outs = n - o0 < AQ_COLS ? n - o0 : AQ_COLS;
            const uint8_t *rows = outs < AQ_COLS ? tail : w + o0 * row_bytes;
            for (int64_t g = 0; g < groups; g++) {
                aq_tile(type, rows, row_bytes, k, levels + g * nb * AQ_B_BYTES, dx + g * nb * AQ_ROWS,
                        cs + g * nb * AQ_ROWS, acc);
                for (int o = 0; o < AQ_COLS; o++) _mm512_store_ps(result[o], acc[o]);
                const int64_t group_rows = m - g * AQ_ROWS < AQ_ROWS ? m - g * AQ_ROWS : AQ_ROWS;
                for (int64_t r = 0; r < group_rows; r++)
                    for (int64_t o = 0; o < outs; o++) out[(g * AQ_ROWS + r) * n + o0 + o] = result[o][r];
            }
        }
        AQ_PHASE(omp_get_thread_num(), 5);
        _tile_release();
        AQ_PHASE(omp_get_thread_num(), 6);
    }
    AQ_PHASE(0, 7);
    free(buffer);
    return 0;
}

/* The activation quantization alone (for tests), in quant_dot_quantize's layout: q int8 [m][k], d
 * float [m][k / 32]. */
int amx_quant_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    if (k <= 0 || k % 32) return -2;
    const int64_t nb = k / 32;
    uint8_t *levels = aligned_alloc(64, (size_t)(nb * AQ_B_BYTES + 2 * nb * AQ_ROWS * 4));
    if (!levels) return -3;
    float *dx = (float *)(levels + nb * AQ_B_BYTES), *cs = dx + nb * AQ_ROWS;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) aq_quantize_block(x + r * k + 32 * b, levels + b * AQ_B_BYTES, dx + AQ_ROWS * b,
                                                           cs + AQ_ROWS * b, 0);
        for (int64_t b = 0; b < nb; b++) {
            for (int i = 0; i < 8; i++) memcpy(q + r * k + 32 * b + 4 * i, levels + b * AQ_B_BYTES + 64 * i, 4);
            d[r * nb + b] = dx[AQ_ROWS * b];
        }
    }
    free(levels);
    return 0;
}
#else
int amx_quant_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                     float *out) {
    (void)type, (void)x, (void)m, (void)k, (void)w, (void)n, (void)row_bytes, (void)out, (void)aq_granted;
    return -4;
}

int amx_quant_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    (void)x, (void)m, (void)k, (void)q, (void)d;
    return -4;
}
#endif
