/* panel_linear: float32 y = x W^T (+ bias) for the dense weights of the cpu backend.
 *
 * The weight is packed once (pack_panels) into panels of 16 output features: panel p holds
 * W[16p : 16p + 16, :] transposed, [in][16], and the panels follow each other, [out / 16][in][16],
 * with zero rows padding the outputs to a multiple of 64. A step of the inner loop reads one
 * 64-byte line of each panel it works on and multiplies it by one input of every row it holds in
 * registers: up to 14 rows x 2 panels (28 accumulators), or 4 rows x 4 panels for up to 4 rows,
 * so that a lone sequence still reads four streams at once. The inputs are cut into blocks of
 * PANEL_K_BLOCK so that the block of a panel pair stays in cache while the row groups pass over
 * it: the weight is read from memory once per PANEL_ROW_GROUPS row groups (once per call for up to
 * 112 rows, a decode step). x is first repacked into row groups, [groups][in][rows of the group],
 * so each broadcast reads the next float.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 16
#define PANEL_PAD 64
#define PANEL_K_BLOCK 256
#define PANEL_ROW_GROUPS 8 /* row groups per pass over the weight: their x stays in L2 */
#define PANEL_PREFETCH 32 /* inputs ahead: 2 KiB of each panel */
#define GROUP_ROWS(P) ((P) == 4 ? 4 : 14) /* rows per group of repacked x for tiles of P panels */

int64_t panel_padded_outputs(int64_t n) { return (n + PANEL_PAD - 1) / PANEL_PAD * PANEL_PAD; }

/* w [n][k] -> out [padded n / 16][k][16], zero past n. */
void pack_panels(const float *w, float *out, int64_t n, int64_t k) {
    const int64_t panels = panel_padded_outputs(n) / PANEL;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t row = p * PANEL + j;
            for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = row < n ? w[row * k + i] : 0.0f;
        }
    }
}

/* The repacked rows of x, one buffer per calling thread, grown as needed. */
static _Thread_local float *row_groups;
static _Thread_local int64_t row_groups_capacity;

/* x [m][k] repacked into groups of `rows` rows, [groups][k][rows] (the group's inputs in turn, its rows' values
 * side by side, so a tile's broadcasts read the next float), in the calling thread's buffer; NULL when it cannot
 * grow. Shared with half_panel.c (whose AVX2 form needs it without AVX-512). */
float *repack_row_groups(const float *x, int64_t m, int64_t k, int64_t rows) {
    const int64_t groups = (m + rows - 1) / rows, needed = groups * rows * k;
    if (needed > row_groups_capacity) {
        float *grown = realloc(row_groups, (size_t)needed * sizeof(float));
        if (!grown) return NULL;
        row_groups = grown;
        row_groups_capacity = needed;
    }
    float *at = row_groups;
#pragma omp parallel for if (m * k >= (1 << 16))
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = g * rows, count = m - r0 < rows ? m - r0 : rows;
        float *dst = at + r0 * k;
        const float *src = x + r0 * k;
        for (int64_t i = 0; i < k; i++)
            for (int64_t r = 0; r < count; r++) dst[i * rows + r] = src[r * k + i];
    }
    return at;
}

#if defined(__AVX512F__)
int panel_linear_supported(void) { return 1; }

/* MR rows x P panels over kk inputs. at: the row group's inputs, [k][GROUP_ROWS(P)]; w: the first panel at the
 * block's first input (panels k * 16 floats apart); c: row 0 of the outputs, rows ldc apart;
 * masks: the output columns of each panel that exist. first / last: the block is the first / last
 * of the inputs (start from zero or from c; add the bias and store). prefetch: the first row group
 * of a block brings the weight lines the following steps need. */
#define PANEL_TILE(MR, P)                                                                              \
    static void tile_##MR##x##P(const float *at, const float *w, int64_t k, float *c, int64_t ldc,     \
                                int64_t kk, const __mmask16 *masks, const float *bias, int first,     \
                                int last, int prefetch) {                                             \
        __m512 acc[MR][P];                                                                             \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int p = 0; p < P; p++)                                                                \
                acc[r][p] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(masks[p], c + r * ldc + p * PANEL); \
        if (prefetch) {                                                                                \
            for (int64_t i = 0; i < kk; i++) {                                                         \
                __m512 wv[P];                                                                          \
                for (int p = 0; p < P; p++) {                                                          \
                    wv[p] = _mm512_loadu_ps(w + (p * k + i) * PANEL);                                  \
                    _mm_prefetch((const char *)(w + (p * k + i + PANEL_PREFETCH) * PANEL), _MM_HINT_T0); \
                }                                                                                      \
                for (int r = 0; r < MR; r++) {                                                         \
                    const __m512 a = _mm512_set1_ps(at[i * GROUP_ROWS(P) + r]);                                   \
                    for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);      \
                }                                                                                      \
            }                                                                                          \
        } else {                                                                                       \
            for (int64_t i = 0; i < kk; i++) {                                                         \
                __m512 wv[P];                                                                          \
                for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_ps(w + (p * k + i) * PANEL);         \
                for (int r = 0; r < MR; r++) {                                                         \
                    const __m512 a = _mm512_set1_ps(at[i * GROUP_ROWS(P) + r]);                                   \
                    for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);      \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int p = 0; p < P; p++) {                                                                  \
            const __m512 b = last && bias ? _mm512_maskz_loadu_ps(masks[p], bias + p * PANEL) : _mm512_setzero_ps(); \
            for (int r = 0; r < MR; r++)                                                               \
                _mm512_mask_storeu_ps(c + r * ldc + p * PANEL, masks[p], _mm512_add_ps(acc[r][p], b)); \
        }                                                                                              \
    }

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
PANEL_TILE(1, 2) PANEL_TILE(2, 2) PANEL_TILE(3, 2) PANEL_TILE(4, 2) PANEL_TILE(5, 2) PANEL_TILE(6, 2)
PANEL_TILE(7, 2) PANEL_TILE(8, 2) PANEL_TILE(9, 2) PANEL_TILE(10, 2) PANEL_TILE(11, 2) PANEL_TILE(12, 2)
PANEL_TILE(13, 2) PANEL_TILE(14, 2)
PANEL_TILE(1, 4) PANEL_TILE(2, 4) PANEL_TILE(3, 4) PANEL_TILE(4, 4)
#pragma GCC pop_options

typedef void (*panel_tile)(const float *, const float *, int64_t, float *, int64_t, int64_t, const __mmask16 *,
                           const float *, int, int, int);
static const panel_tile TILES_2[15] = {0, tile_1x2, tile_2x2, tile_3x2, tile_4x2, tile_5x2, tile_6x2, tile_7x2,
                                       tile_8x2, tile_9x2, tile_10x2, tile_11x2, tile_12x2, tile_13x2, tile_14x2};
static const panel_tile TILES_4[5] = {0, tile_1x4, tile_2x4, tile_3x4, tile_4x4};

/* x [m][k], packed weight from pack_panels, bias [n] or NULL, out [m][n]. Returns -1 when the
 * row-group buffer cannot be allocated. */
int panel_linear(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                 int64_t k) {
    const int P = m <= 4 ? 4 : 2, MR = GROUP_ROWS(P);
    const panel_tile *tiles = P == 4 ? TILES_4 : TILES_2;
    const float *at = repack_row_groups(x, m, k, MR);
    if (!at) return -1;
    const int64_t width = (int64_t)P * PANEL, blocks = (n + width - 1) / width;
    const int64_t row_block = PANEL_ROW_GROUPS * MR;
    /* below 256 x 1024 weights for one row a second thread saves less than its fork costs;
     * each output's sum runs over k in the same order either way */
#pragma omp parallel if (m * n * k >= (1 << 18))
    for (int64_t rb = 0; rb < m; rb += row_block) {
        const int64_t rb_end = m - rb < row_block ? m : rb + row_block;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            __mmask16 masks[4];
            for (int p = 0; p < P; p++) {
                const int64_t valid = n - b * width - p * PANEL;
                masks[p] = valid >= PANEL ? (__mmask16)0xFFFF : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
            }
            const float *w = packed + b * P * k * PANEL;
            const float *bias_b = bias ? bias + b * width : NULL;
            for (int64_t i0 = 0; i0 < k; i0 += PANEL_K_BLOCK) {
                const int64_t kk = k - i0 < PANEL_K_BLOCK ? k - i0 : PANEL_K_BLOCK;
                const int first = i0 == 0, last = i0 + kk == k;
                for (int64_t r0 = rb; r0 < rb_end; r0 += MR) {
                    const int64_t rows = rb_end - r0 < MR ? rb_end - r0 : MR;
                    tiles[rows](at + r0 * k + i0 * MR, w + i0 * PANEL, k, out + r0 * n + b * width, n, kk, masks,
                                bias_b, first, last, r0 == rb);
                }
            }
        }
    }
    return 0;
}
#else
int panel_linear_supported(void) { return 0; }

int panel_linear(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                 int64_t k) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k;
    return -2;
}
#endif
