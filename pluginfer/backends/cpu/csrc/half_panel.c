/* half_panel_linear: float32 y = x W^T (+ bias) for a bfloat16/float16 weight (a GGUF file's F16/BF16 tensors in
 * a float32 model) on AVX-512 without AMX, packed once at load (pack_half_panels) into groups of 48 outputs,
 * group g holding W[48g : 48g + 48, :] transposed, [in][48] of the file's 16-bit values (the same bytes), the
 * groups one after another with zero rows padding the outputs to a multiple of 48. A tile of 3 panels reads its
 * group as one stream, 96 bytes an input. One row's decode still reads ~7 % slower than half_linear.c's GEMV
 * (its four row streams); blocks of 32-512 inputs, other prefetch hints or none were slower still.
 *
 * A tile is up to 8 rows x 3 panels (48 outputs, 24 accumulators), or from 49 rows up to 14 rows x 2 panels
 * (28): each step broadcasts one input of each row (x repacked into groups of rows, [k][group rows]) against
 * one 16-wide line of each panel. The first row group of a block widens each line exactly to float32 in
 * registers as it reads it and, with more groups to come, stores the widened block (HP_KB inputs of 3 panels,
 * twice as many of 2: 24 or 32 KiB, per thread) for them, under its own multiply-adds: a separate widening
 * pass, which also took the stalls of reading the weights from memory, cost 7-12 % at 16-32 rows and 4-10 % at
 * 64-512 (all linears of an F16 0.5B model, one thread). Against the dot-product
 * GEMV of half_linear.c, whose tiles re-read every row of x for each 4 outputs (at 16 rows x no longer fits
 * L1: the reads of x bound it), x is read once per 48 outputs: an F16 0.5B model's linears at 16 rows
 * 103 -> 91 ms a step. While a block's tiles run, the lines of the thread's next block but one are prefetched
 * into L2, a few per turn of the tiles' loop, so the weight streams from memory under the arithmetic (one block
 * ahead left them late: 32-512 rows 3-9 % slower). One core keeps ~16 lines in flight for its loads and
 * prefetches: streaming under arithmetic reaches ~7.5 GB/s here, against ~13 GB/s for reads alone.
 *
 * Each output is one float32 fused multiply-add chain over k in order (partial sums kept in out between
 * blocks: a float32 store and load, exact), whatever the rows, tile or thread count: a row's result never
 * depends on its batch. Against the exact product, the float32 x @ W.float().T up to the order of its sum.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define HP_PANEL 16
#define HP_GROUP 48       /* outputs per packed group: 3 panels, interleaved by input */
#define HP_PAD 48         /* outputs padded to whole groups (a tile of 2 panels past them is not read) */
#define HP_KB 128         /* inputs per widened block of 3 panels (24 KiB); 2 panels take twice as many */
#define HP_ROW_BLOCK 112  /* rows per pass over the weight (their x stays in L2) */
#define HP_WIDE_ROWS 48   /* above: tiles of 14 rows x 2 panels, else 8 x 3 */
#define HP_AHEAD 2        /* the block prefetched while one runs: the thread's next but one */
#define HP_UNROLL 2       /* inputs a turn of a tile's loop */

int64_t half_panel_padded_outputs(int64_t n) { return (n + HP_PAD - 1) / HP_PAD * HP_PAD; }

/* w [n][k] 16-bit -> out [padded n / 48][k][48], zero past n. */
void pack_half_panels(const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
    const int64_t groups = half_panel_padded_outputs(n) / HP_GROUP;
#pragma omp parallel for
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *dst = out + g * k * HP_GROUP;
        for (int64_t j = 0; j < HP_GROUP; j++) {
            const int64_t row = g * HP_GROUP + j;
            for (int64_t i = 0; i < k; i++) dst[i * HP_GROUP + j] = row < n ? w[row * k + i] : 0;
        }
    }
}

/* Panel p's first value (input 0, output 16p); its inputs HP_GROUP values apart. */
static inline const uint16_t *hp_panel(const uint16_t *packed, int64_t k, int64_t p) {
    return packed + p / 3 * k * HP_GROUP + p % 3 * HP_PANEL;
}

#if defined(__AVX512F__)
int half_panel_supported(void) { return 1; }

/* The lines of the next block of the tile's panels (runs of `lines` lines, `stride` bytes apart: the rows of
 * the block's inputs in each group the panels fall in), prefetched `per` at each step of the tiles' loop. */
typedef struct {
    const char *panel;
    int64_t stride, lines, line, left, per;
} hp_fetch;

static inline void hp_fetch_line(hp_fetch *f) {
    for (int64_t q = 0; q < f->per && f->left > 0; q++, f->left--) {
        _mm_prefetch(f->panel + 64 * f->line, _MM_HINT_T1);
        if (++f->line == f->lines) f->line = 0, f->panel += f->stride;
    }
}

/* Input i of a tile's loop. */
#define HP_STEP(MR, P, GR, SRC, STORE, i)                                                                      \
    {                                                                                                          \
        __m512 wv[P];                                                                                          \
        for (int p = 0; p < P; p++)                                                                            \
            wv[p] = SRC == 0 ? _mm512_load_ps((const float *)w + (p * kk + (i)) * HP_PANEL)                     \
                             : hp_widen_line(SRC - 1, line[p] + (i) * HP_GROUP);                                \
        if (STORE)                                                                                             \
            for (int p = 0; p < P; p++) _mm512_store_ps(widened + (p * kk + (i)) * HP_PANEL, wv[p]);           \
        for (int r = 0; r < MR; r++) {                                                                         \
            const __m512 a = _mm512_set1_ps(at[(i) * (GR) + r]);                                              \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);                      \
        }                                                                                                      \
    }
/* The k loop of a tile, HP_UNROLL inputs a turn (one prefetch call a turn: fewer scalar instructions beside the
 * multiply-adds): SRC 0 reads widened float32 lines, 1 bfloat16 and 2 float16 packed lines (widened in
 * registers, and stored widened with STORE); constants, so the loop holds no test of either. */
#define HP_LOOP(MR, P, GR, SRC, STORE)                                                                          \
    {                                                                                                          \
        int64_t i = 0;                                                                                         \
        for (; i + HP_UNROLL <= kk; i += HP_UNROLL) {                                                          \
            hp_fetch_line(&f);                                                                                 \
            for (int u = 0; u < HP_UNROLL; u++) HP_STEP(MR, P, GR, SRC, STORE, i + u)                          \
        }                                                                                                      \
        for (; i < kk; i++) HP_STEP(MR, P, GR, SRC, STORE, i)                                                  \
    }

/* MR rows x P panels over kk inputs: at the group's x at the block ([kk][GR], GR the group's rows), w the block's
 * panels (WIDE: widened float32, [P][kk][16]; else P pointers to each panel's first packed 16-bit line of the
 * block, lines HP_GROUP values apart, dtype 0 bfloat16, 1 float16; widened, if not NULL, receives those lines
 * widened, [P][kk][16]), c row 0 of the outputs (rows ldc apart); first / last: the block is the first / last
 * of the inputs (start from zero or from c; add the bias). */
#define HP_TILE(MR, P, GR, WIDE)                                                                                \
    static void hp_tile_##MR##x##P##_##WIDE(const float *at, const void *w, int dtype, int64_t kk,              \
                                            float *c, int64_t ldc, const __mmask16 *masks, const float *bias,   \
                                            int first, int last, hp_fetch *fetch, float *widened) {              \
        __m512 acc[MR][P];                                                                                     \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int p = 0; p < P; p++)                                                                        \
                acc[r][p] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(masks[p], c + r * ldc + p * HP_PANEL); \
        hp_fetch f = *fetch; /* in registers through the loop */                                            \
        const uint16_t *line[P];                                                                               \
        for (int p = 0; p < P; p++) line[p] = WIDE ? NULL : ((const uint16_t *const *)w)[p];                   \
        if (WIDE) HP_LOOP(MR, P, GR, 0, 0)                                                                     \
        else if (dtype == 0 && widened) HP_LOOP(MR, P, GR, 1, 1)                                               \
        else if (dtype == 0) HP_LOOP(MR, P, GR, 1, 0)                                                          \
        else if (widened) HP_LOOP(MR, P, GR, 2, 1)                                                             \
        else HP_LOOP(MR, P, GR, 2, 0)                                                                          \
        *fetch = f;                                                                                            \
        for (int p = 0; p < P; p++) {                                                                          \
            const __m512 b = last && bias ? _mm512_maskz_loadu_ps(masks[p], bias + p * HP_PANEL) : _mm512_setzero_ps(); \
            for (int r = 0; r < MR; r++)                                                                       \
                _mm512_mask_storeu_ps(c + r * ldc + p * HP_PANEL, masks[p], _mm512_add_ps(acc[r][p], b));      \
        }                                                                                                      \
    }

/* 16 values of a panel line widened exactly. */
static inline __m512 hp_widen_line(int dtype, const uint16_t *line) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)line);
    return dtype == 0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
#define HP_TILES_8(P, WIDE) HP_TILE(1, P, 8, WIDE) HP_TILE(2, P, 8, WIDE) HP_TILE(3, P, 8, WIDE) HP_TILE(4, P, 8, WIDE) \
    HP_TILE(5, P, 8, WIDE) HP_TILE(6, P, 8, WIDE) HP_TILE(7, P, 8, WIDE) HP_TILE(8, P, 8, WIDE)
HP_TILES_8(3, 1)
HP_TILES_8(3, 0)
HP_TILE(1, 2, 14, 1) HP_TILE(2, 2, 14, 1) HP_TILE(3, 2, 14, 1) HP_TILE(4, 2, 14, 1) HP_TILE(5, 2, 14, 1)
HP_TILE(6, 2, 14, 1) HP_TILE(7, 2, 14, 1) HP_TILE(8, 2, 14, 1) HP_TILE(9, 2, 14, 1) HP_TILE(10, 2, 14, 1)
HP_TILE(11, 2, 14, 1) HP_TILE(12, 2, 14, 1) HP_TILE(13, 2, 14, 1) HP_TILE(14, 2, 14, 1)
HP_TILE(1, 2, 14, 0) HP_TILE(2, 2, 14, 0) HP_TILE(3, 2, 14, 0) HP_TILE(4, 2, 14, 0) HP_TILE(5, 2, 14, 0)
HP_TILE(6, 2, 14, 0) HP_TILE(7, 2, 14, 0) HP_TILE(8, 2, 14, 0) HP_TILE(9, 2, 14, 0) HP_TILE(10, 2, 14, 0)
HP_TILE(11, 2, 14, 0) HP_TILE(12, 2, 14, 0) HP_TILE(13, 2, 14, 0) HP_TILE(14, 2, 14, 0)
#pragma GCC pop_options

typedef void (*hp_tile)(const float *, const void *, int, int64_t, float *, int64_t, const __mmask16 *,
                        const float *, int, int, hp_fetch *, float *);
/* By rows: 8 x 3 on widened blocks, 8 x 3 widening in registers (one group), 14 x 2 on widened blocks. */
static const hp_tile HP_WIDE_3[9] = {0, hp_tile_1x3_1, hp_tile_2x3_1, hp_tile_3x3_1, hp_tile_4x3_1,
                                     hp_tile_5x3_1, hp_tile_6x3_1, hp_tile_7x3_1, hp_tile_8x3_1};
static const hp_tile HP_HALF_3[9] = {0, hp_tile_1x3_0, hp_tile_2x3_0, hp_tile_3x3_0, hp_tile_4x3_0,
                                     hp_tile_5x3_0, hp_tile_6x3_0, hp_tile_7x3_0, hp_tile_8x3_0};
static const hp_tile HP_WIDE_2[15] = {0, hp_tile_1x2_1, hp_tile_2x2_1, hp_tile_3x2_1, hp_tile_4x2_1, hp_tile_5x2_1,
                                      hp_tile_6x2_1, hp_tile_7x2_1, hp_tile_8x2_1, hp_tile_9x2_1, hp_tile_10x2_1,
                                      hp_tile_11x2_1, hp_tile_12x2_1, hp_tile_13x2_1, hp_tile_14x2_1};
static const hp_tile HP_HALF_2[15] = {0, hp_tile_1x2_0, hp_tile_2x2_0, hp_tile_3x2_0, hp_tile_4x2_0, hp_tile_5x2_0,
                                      hp_tile_6x2_0, hp_tile_7x2_0, hp_tile_8x2_0, hp_tile_9x2_0, hp_tile_10x2_0,
                                      hp_tile_11x2_0, hp_tile_12x2_0, hp_tile_13x2_0, hp_tile_14x2_0};
/* The packed lines of a panel past the outputs (a tile of 2 panels at the end; its outputs are masked). */
static const uint16_t HP_ZERO_LINES[2 * HP_KB * HP_GROUP];

/* panel_linear.c's: x in groups of `rows` rows, [groups][k][rows], in the calling thread's buffer (NULL: it
 * could not grow). */
float *repack_row_groups(const float *x, int64_t m, int64_t k, int64_t rows);

/* dtype 0 bfloat16, 1 float16; x [m][k] float32, packed from pack_half_panels, bias [n] float32 or NULL, out [m][n]
 * float32. Returns 0; -1: the row buffer could not be allocated; -2: a bad dtype. */
int half_panel_linear(int dtype, const float *x, const uint16_t *packed, const float *bias, float *out, int64_t m,
                      int64_t n, int64_t k) {
    if (dtype != 0 && dtype != 1) return -2;
    if (m <= 0 || n <= 0) return 0;
    const int P = m > HP_WIDE_ROWS ? 2 : 3, GR = P == 2 ? 14 : 8;
    const hp_tile *tiles = P == 2 ? HP_WIDE_2 : HP_WIDE_3;
    const float *at = repack_row_groups(x, m, k, GR);
    if (!at) return -1;
    const int64_t width = (int64_t)P * HP_PANEL, blocks = (n + width - 1) / width;
    const int64_t panels = half_panel_padded_outputs(n) / HP_PANEL;
    const int64_t KB = P == 2 ? 2 * HP_KB : HP_KB, kblocks = (k + KB - 1) / KB, row_block = HP_ROW_BLOCK / GR * GR;
    /* below 256 x 1024 weights for one row a second thread saves less than its fork costs */
#pragma omp parallel if (m * n * k >= (1 << 18))
    {
        static _Thread_local float wide[4 * HP_KB * HP_PANEL] __attribute__((aligned(64)));
        for (int64_t rb = 0; rb < m; rb += row_block) {
            const int64_t rb_end = m - rb < row_block ? m : rb + row_block, steps = (rb_end - rb + GR - 1) / GR;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                __mmask16 masks[3];
                for (int p = 0; p < P; p++) {
                    const int64_t valid = n - b * width - p * HP_PANEL;
                    masks[p] = valid >= HP_PANEL ? (__mmask16)0xFFFF : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
                }
                const float *bias_b = bias ? bias + b * width : NULL;
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    const int64_t i0 = kb * KB, kk = k - i0 < KB ? k - i0 : KB, turns = steps * (kk / HP_UNROLL);
                    /* the block HP_AHEAD on: these panels' later inputs, else the next panels' first; the rows of
                     * those inputs in the groups its panels fall in (one group, or two for tiles of 2 panels) */
                    int64_t nb = b, nkb = kb + HP_AHEAD;
                    while (nkb >= kblocks) nkb -= kblocks, nb++; /* no division: this runs for every block */
                    const int64_t ni0 = nkb * KB;
                    const int64_t nkk = k - ni0 < KB ? k - ni0 : KB, lines = (nkk * HP_GROUP * 2 + 63) / 64 + 1;
                    const int64_t g0 = nb * P / 3, g1 = (nb * P + P - 1) / 3 < panels / 3 ? (nb * P + P - 1) / 3 : g0;
                    hp_fetch fetch = {(const char *)(packed + (g0 * k + ni0) * HP_GROUP), k * HP_GROUP * 2, lines, 0,
                                      nb < blocks ? (g1 - g0 + 1) * lines : 0, 0};
                    fetch.per = turns ? (fetch.left + turns - 1) / turns : 0;
                    const uint16_t *first_lines[3];
                    for (int p = 0; p < P; p++)
                        first_lines[p] = b * P + p < panels ? hp_panel(packed, k, b * P + p) + i0 * HP_GROUP
                                                            : HP_ZERO_LINES;
                    for (int64_t r0 = rb; r0 < rb_end; r0 += GR) {
                        const int64_t rows = rb_end - r0 < GR ? rb_end - r0 : GR;
                        /* the first group widens each line in registers (and, with more groups to come, stores it
                         * widened for them) */
                        const int widens = r0 == rb;
                        const hp_tile tile = widens ? (P == 3 ? HP_HALF_3 : HP_HALF_2)[rows] : tiles[rows];
                        tile(at + r0 * k + i0 * GR, widens ? (const void *)first_lines : (const void *)wide, dtype, kk,
                             out + r0 * n + b * width, n, masks, bias_b, kb == 0, kb + 1 == kblocks, &fetch,
                             widens && rb_end - rb > GR ? wide : NULL);
                    }
                }
            }
        }
    }
    return 0;
}
#else
int half_panel_supported(void) { return 0; }

int half_panel_linear(int dtype, const float *x, const uint16_t *packed, const float *bias, float *out, int64_t m,
                      int64_t n, int64_t k) {
    (void)dtype, (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k;
    return -2;
}
#endif
