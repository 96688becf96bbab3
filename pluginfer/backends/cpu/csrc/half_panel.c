/* half_panel_linear: float32 y = x W^T (+ bias) for a bfloat16/float16 weight (a GGUF file's F16/BF16 tensors in
 * a float32 model) on a CPU without AMX (AVX-512 here; AVX2 with FMA and F16C in the form at the end), packed
 * once at load (pack_half_panels) into groups of 48 outputs,
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
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HP_AVX2 1
#endif
#if defined(__AVX512F__) || defined(HP_AVX2)
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

#if defined(__AVX512F__) || defined(HP_AVX2)
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

/* panel_linear.c's: x in groups of `rows` rows, [groups][k][rows], in the calling thread's buffer (NULL: it
 * could not grow). */
float *repack_row_groups(const float *x, int64_t m, int64_t k, int64_t rows);

#endif

#if defined(__AVX512F__)
int half_panel_supported(void) { return 1; }

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
#elif defined(HP_AVX2)
/* AVX2 + FMA + F16C (no AVX-512): the same packed groups and arithmetic over 8 lanes, every output the AVX-512
 * form's chain of fused multiply-adds over k in order, then + bias: the same bits.
 *
 * From 3 rows a tile is up to 6 rows x 16 outputs, a third of a group (12 accumulators, 2 weight vectors and a
 * broadcast: 15 of the 16 registers; 4 x 24 needed all 16 and spilled), each step one input: 2 weight loads and 6
 * broadcasts for 12 multiply-adds. Per block of HQ_KB inputs each third of the group runs every row group over
 * it (the block's 12 KiB of 16-bit lines read from memory once, the other thirds from L1); the first row group
 * widens each line in registers and, with more to come, stores it widened (HQ_KB x 16 floats) for them. One or
 * two rows take the whole group a step (6 vectors, each loaded and used for the rows before the next): the
 * weight read as one stream, where thirds skipped a line in three. */
#define HQ_VEC 8
#define HQ_ROWS 6  /* rows of a tile of a third */
#define HQ_FEW 2   /* up to this many rows: tiles of the whole group */
#define HQ_UNROLL 4 /* inputs a turn: at 2 the prefetch's bookkeeping each turn cost 4-17 % (16-512 rows) */
#define HQ_KB 128

int half_panel_supported(void) { return 2; } /* the AVX2 form (1: AVX-512) */

/* 8 values of a packed line widened exactly (dtype 0 bfloat16, 1 float16). */
static inline __m256 hq_widen(int dtype, const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return dtype == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* Input i of a tile of MR rows (x groups of GR) x NV vectors: SRC 0 reads widened float32 lines ([kk][8 NV]), 1
 * bfloat16 and 2 float16 packed lines (HP_GROUP values apart); STORE also writes them widened. Thirds (NV 2)
 * load the weights first, the whole group (NV 6) each vector before its rows: either way within 16 registers. */
#define HQ_STEP(MR, NV, GR, SRC, STORE, i)                                                                     \
    {                                                                                                          \
        __m256 wv[NV], a[MR];                                                                                  \
        if (NV == 2) {                                                                                         \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {                                             \
                wv[v] = SRC == 0 ? _mm256_load_ps(wide + ((i) * NV + v) * HQ_VEC)                              \
                                 : hq_widen(SRC - 1, line + (i) * HP_GROUP + HQ_VEC * v);                      \
                if (STORE) _mm256_store_ps(widened + ((i) * NV + v) * HQ_VEC, wv[v]);                          \
            }                                                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                             \
                a[r] = _mm256_broadcast_ss(at + (i) * GR + r);                                                 \
                _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)                                           \
                    acc[r][v] = _mm256_fmadd_ps(a[r], wv[v], acc[r][v]);                                       \
            }                                                                                                  \
        } else {                                                                                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) a[r] = _mm256_broadcast_ss(at + (i) * GR + r); \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {                                             \
                wv[v] = hq_widen(SRC - 1, line + (i) * HP_GROUP + HQ_VEC * v);                                 \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                           \
                    acc[r][v] = _mm256_fmadd_ps(a[r], wv[v], acc[r][v]);                                       \
            }                                                                                                  \
        }                                                                                                      \
    }

/* MR rows x NV vectors of outputs over kk inputs, reading SRC and with STORE writing the lines widened
 * (HQ_STEP's): at the row group's x at the block ([kk][GR]); line the tile's first packed line of the block (SRC
 * 1, 2); wide the block widened (SRC 0); widened receives the lines widened (STORE); c row 0 of the outputs (rows
 * ldc apart), nc of them valid (mask: their lanes); first / last: the block is the first / last of the inputs
 * (start from zero or from c; add the bias). One function a source with its loop free of tests, the loops
 * unrolled by pragma: otherwise gcc kept the accumulators in memory. */
#define HQ_TILE(MR, NV, GR, SRC, STORE)                                                                        \
    static void hq_tile_##MR##_##NV##_##SRC##_##STORE(const float *at, const uint16_t *line, const float *wide, \
                                                      int64_t kk, float *c, int64_t ldc, int64_t nc,           \
                                                      const __m256i *mask, const float *bias, int first,       \
                                                      int last, hp_fetch *fetch, float *widened) {             \
        (void)line, (void)wide, (void)widened;                                                                 \
        const int full = nc == NV * HQ_VEC;                                                                    \
        __m256 acc[MR][NV];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)                                               \
                acc[r][v] = first ? _mm256_setzero_ps()                                                        \
                          : full ? _mm256_loadu_ps(c + r * ldc + HQ_VEC * v)                                   \
                                 : _mm256_maskload_ps(c + r * ldc + HQ_VEC * v, mask[v]);                      \
        hp_fetch f = *fetch; /* in registers through the loop */                                            \
        int64_t i = 0;                                                                                         \
        for (; i + HQ_UNROLL <= kk; i += HQ_UNROLL) {                                                          \
            hp_fetch_line(&f);                                                                                 \
            _Pragma("GCC unroll 8") for (int u = 0; u < HQ_UNROLL; u++) HQ_STEP(MR, NV, GR, SRC, STORE, i + u) \
        }                                                                                                      \
        for (; i < kk; i++) HQ_STEP(MR, NV, GR, SRC, STORE, i)                                                 \
        *fetch = f;                                                                                            \
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) {                                                 \
            const __m256 b = !(last && bias) ? _mm256_setzero_ps()                                             \
                           : full ? _mm256_loadu_ps(bias + HQ_VEC * v) : _mm256_maskload_ps(bias + HQ_VEC * v, mask[v]); \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                             \
                const __m256 y = _mm256_add_ps(acc[r][v], b);                                                  \
                if (full) _mm256_storeu_ps(c + r * ldc + HQ_VEC * v, y);                                       \
                else _mm256_maskstore_ps(c + r * ldc + HQ_VEC * v, mask[v], y);                                \
            }                                                                                                  \
        }                                                                                                      \
    }
/* Thirds by source: widened lines, bfloat16, bfloat16 storing them widened, float16, float16 storing them
 * widened; the whole group: bfloat16, float16. */
#define HQ_THIRDS(MR) HQ_TILE(MR, 2, HQ_ROWS, 0, 0) HQ_TILE(MR, 2, HQ_ROWS, 1, 0) HQ_TILE(MR, 2, HQ_ROWS, 1, 1) \
    HQ_TILE(MR, 2, HQ_ROWS, 2, 0) HQ_TILE(MR, 2, HQ_ROWS, 2, 1)
#define HQ_THIRDS_OF(SRC, STORE)                                                                               \
    {0, hq_tile_1_2_##SRC##_##STORE, hq_tile_2_2_##SRC##_##STORE, hq_tile_3_2_##SRC##_##STORE,               \
     hq_tile_4_2_##SRC##_##STORE, hq_tile_5_2_##SRC##_##STORE, hq_tile_6_2_##SRC##_##STORE}
HQ_THIRDS(1) HQ_THIRDS(2) HQ_THIRDS(3) HQ_THIRDS(4) HQ_THIRDS(5) HQ_THIRDS(6)
HQ_TILE(1, 6, HQ_FEW, 1, 0) HQ_TILE(2, 6, HQ_FEW, 1, 0) HQ_TILE(1, 6, HQ_FEW, 2, 0) HQ_TILE(2, 6, HQ_FEW, 2, 0)

typedef void (*hq_tile)(const float *, const uint16_t *, const float *, int64_t, float *, int64_t, int64_t,
                        const __m256i *, const float *, int, int, hp_fetch *, float *);
static const hq_tile HQ_THIRD_TILES[5][HQ_ROWS + 1] = {HQ_THIRDS_OF(0, 0), HQ_THIRDS_OF(1, 0), HQ_THIRDS_OF(1, 1),
                                                       HQ_THIRDS_OF(2, 0), HQ_THIRDS_OF(2, 1)};
static const hq_tile HQ_GROUP_TILES[2][HQ_FEW + 1] = {{0, hq_tile_1_6_1_0, hq_tile_2_6_1_0},
                                                      {0, hq_tile_1_6_2_0, hq_tile_2_6_2_0}};

int half_panel_linear(int dtype, const float *x, const uint16_t *packed, const float *bias, float *out, int64_t m,
                      int64_t n, int64_t k) {
    if (dtype != 0 && dtype != 1) return -2;
    if (m <= 0 || n <= 0) return 0;
    const int few = m <= HQ_FEW, GR = few ? HQ_FEW : HQ_ROWS, width = few ? HP_GROUP : HP_GROUP / 3;
    const float *at = repack_row_groups(x, m, k, GR);
    if (!at) return -1;
    const int64_t groups = half_panel_padded_outputs(n) / HP_GROUP, kblocks = (k + HQ_KB - 1) / HQ_KB;
    const int64_t row_block = HP_ROW_BLOCK / HQ_ROWS * HQ_ROWS;
    /* below 256 x 1024 weights for one row a second thread saves less than its fork costs */
#pragma omp parallel if (m * n * k >= (1 << 18))
    {
        static _Thread_local float wide[HQ_KB * HP_GROUP / 3] __attribute__((aligned(32)));
        for (int64_t rb = 0; rb < m; rb += row_block) {
            const int64_t rb_end = m - rb < row_block ? m : rb + row_block, steps = (rb_end - rb + GR - 1) / GR;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    const int64_t i0 = kb * HQ_KB, kk = k - i0 < HQ_KB ? k - i0 : HQ_KB;
                    /* the block HP_AHEAD on (this group's later inputs, else the next group's first), one run of
                     * lines, prefetched through the block's tiles */
                    int64_t ng = g, nkb = kb + HP_AHEAD;
                    while (nkb >= kblocks) nkb -= kblocks, ng++;
                    const int64_t ni0 = nkb * HQ_KB, nkk = k - ni0 < HQ_KB ? k - ni0 : HQ_KB;
                    const int64_t lines = (nkk * HP_GROUP * 2 + 63) / 64 + 1;
                    const int64_t turns = HP_GROUP / width * steps * (kk / HQ_UNROLL);
                    hp_fetch fetch = {(const char *)(packed + (ng * k + ni0) * HP_GROUP), 0, lines, 0,
                                      ng < groups ? lines : 0, 0};
                    fetch.per = turns ? (fetch.left + turns - 1) / turns : 0;
                    for (int64_t c0 = g * HP_GROUP; c0 < (g + 1) * HP_GROUP && c0 < n; c0 += width) {
                        const int64_t nc = n - c0 < width ? n - c0 : width;
                        __m256i mask[HP_GROUP / HQ_VEC];
                        for (int v = 0; v < width / HQ_VEC; v++)
                            mask[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nc - HQ_VEC * v)),
                                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                        const uint16_t *first_line = packed + (g * k + i0) * HP_GROUP + c0 % HP_GROUP;
                        for (int64_t r0 = rb; r0 < rb_end; r0 += GR) {
                            const int64_t rows = rb_end - r0 < GR ? rb_end - r0 : GR;
                            /* the first row group widens the lines in registers, and stores them for the rest */
                            const hq_tile tile = few ? HQ_GROUP_TILES[dtype][rows]
                                                     : HQ_THIRD_TILES[r0 > rb ? 0 : 1 + 2 * dtype + (rb_end - rb > GR)][rows];
                            tile(at + r0 * k + i0 * GR, first_line, wide, kk, out + r0 * n + c0, n, nc, mask,
                                 bias ? bias + c0 : NULL, kb == 0, kb + 1 == kblocks, &fetch, wide);
                        }
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
