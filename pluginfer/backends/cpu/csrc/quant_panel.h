/* quant_panel_matmul's driver, shared by its ISA forms (quant_panel_avx512.h, quant_panel_avx2.h), which
 * include it after defining QP_COLS (columns per panel), QP_ROWS (rows per micro-tile) and QP_CHUNK (inputs
 * per decoded chunk), and then define the three functions declared below: the panel decoder of a type, its
 * micro-tiles by row count, and the rows' activation quantization. Included by quant_dot.c inside the ISA's
 * part (qd_block, qd_offset, qd_rows).
 *
 * Each thread takes a contiguous range of panels (QP_COLS output columns each); per chunk of a panel it
 * decodes the weights once into the panel layout, then runs every row tile over it, the partial sums kept in
 * the output between chunks (exact: a float32 store and load). While a chunk's tiles run, the thread's next
 * chunk of weights is prefetched into L2 a few lines per block (qp_fetch): decoded straight from memory, a
 * 0.5B model's 16-row step waited ~10 ms of its ~43 on the weights' short row streams (AVX-512).
 */
#pragma once

/* The lines of the thread's next chunk of weights (rows row_bytes apart, `width` lines each), prefetched into
 * L2 a few per block of the tiles' loop (the same lines in one burst per tile gained a third as much). */
typedef struct {
    const uint8_t *row;   /* the next line's row, at the chunk's first byte */
    int64_t row_bytes, width, col, left, per_block;
} qp_fetch;

static inline void qp_fetch_lines(qp_fetch *f) {
    for (int64_t q = 0; q < f->per_block && f->left > 0; q++, f->left--) {
        _mm_prefetch((const char *)(f->row + 64 * f->col), _MM_HINT_T1);
        if (++f->col == f->width) f->col = 0, f->row += f->row_bytes;
    }
}

/* Units u0 .. u1 of the nc (<= QP_COLS) weight rows at w into a chunk's panel, scales S and mins M. */
typedef void (*qp_panel_fn)(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                            uint8_t *panel, float *S, float *M);
/* R rows (xq, dx, corr, cs at the chunk's first block of the tile's first row; a row's blocks nbb apart) x
 * one panel chunk of nbc blocks; out's rows ldo apart, its first nc columns written; first: the chunk starts
 * the row (the accumulators start at zero, else at out). */
typedef void (*qp_tile_fn)(const uint8_t *panel, const float *S, const float *M, int64_t nbc, const int8_t *xq,
                           int64_t k, const float *dx, const int32_t *corr, const float *cs, int64_t nbb, float *out,
                           int64_t ldo, int64_t nc, int first, qp_fetch *fetch);
static qp_panel_fn qp_panels(int type);
/* The micro-tiles of a type, indexed by row count 1 .. QP_ROWS. */
static const qp_tile_fn *qp_tiles_for(int type);
/* Row x [k] as int8 levels xq [k] (quantize_row's rounding) and per block of blk (32, or 16): the scale dx,
 * the offset's correction -offset * sum of levels, and for types with a min dx * sum (quant_dot.c's order). */
static void qp_quantize_row(const float *x, int64_t k, int blk, int offset, int8_t *xq, float *dx, int32_t *corr,
                            float *cs);

/* Weights per unit of T##_prep and the blocks a unit holds. */
static void qp_unit(int type, int64_t *weights, int *blocks) {
    if (type == QD_Q4_K || type == QD_Q5_K) *weights = 256, *blocks = 8;
    else if (type == QD_Q6_K) *weights = 256, *blocks = 16;
    else *weights = 64, *blocks = 2;
}

/* out [m][n] = x [m][k] W^T, as quant_matmul (same arguments and statuses). */
int quant_panel_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                       float *out) {
    int64_t weights, bytes;
    if (!qd_block(type, &weights, &bytes)) return -1;
    if (k <= 0 || k % weights || k / weights * bytes != row_bytes) return -2;
    if (m <= 0 || n <= 0) return 0;
    const int blk = type == QD_Q6_K ? 16 : 32, offset = qd_offset(type);
    const int64_t nbb = k / blk, nb = k / 32;
    int64_t unit_weights;
    int unit_blocks;
    qp_unit(type, &unit_weights, &unit_blocks);
    const int64_t units = (k + unit_weights - 1) / unit_weights, chunk_units = QP_CHUNK / unit_weights;
    const int64_t unit_bytes = unit_weights / weights * bytes; /* a unit's bytes in a row (the last may be short) */
    const int64_t chunk_blocks = chunk_units * unit_blocks;
    const size_t xq_bytes = (size_t)((m * k + 63) / 64 * 64), side = (size_t)(m * nbb) * 4;
    uint8_t *act = qd_rows(xq_bytes + 3 * side);
    if (!act) return -3;
    int8_t *xq = (int8_t *)act;
    float *dx = (float *)(act + xq_bytes), *cs = (float *)(act + xq_bytes + 2 * side);
    int32_t *corr = (int32_t *)(act + xq_bytes + side);
    const qp_panel_fn decode = qp_panels(type);
    const qp_tile_fn *tiles = qp_tiles_for(type);
    const int64_t panels = (n + QP_COLS - 1) / QP_COLS;
    const size_t panel_bytes = (size_t)chunk_blocks * blk * QP_COLS, scale_bytes = (size_t)chunk_blocks * QP_COLS * 4;
    int failed = 0;
#pragma omp parallel if (m * n * k > (1 << 16))
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            qp_quantize_row(x + r * k, k, blk, offset, xq + r * k, dx + r * nbb, corr + r * nbb, cs + r * nbb);
        uint8_t *panel = aligned_alloc(64, panel_bytes + 2 * scale_bytes);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = panels * id / threads, hi = panels * (id + 1) / threads;
        float *S = (float *)(panel + panel_bytes), *M = (float *)(panel + panel_bytes + scale_bytes);
        for (int64_t p = lo; panel && p < hi; p++) {
            const int64_t c0 = p * QP_COLS, nc = n - c0 < QP_COLS ? n - c0 : QP_COLS;
            for (int64_t u0 = 0; u0 < units; u0 += chunk_units) {
                const int64_t u1 = u0 + chunk_units < units ? u0 + chunk_units : units;
                decode(w + c0 * row_bytes, row_bytes, nc, u0, u1, nb, panel, S, M);
                const int64_t fb = u0 * unit_blocks;
                const int64_t nbc = (u1 * unit_blocks < nbb ? u1 * unit_blocks : nbb) - fb;
                const int64_t np = u1 < units ? p : p + 1, nu0 = u1 < units ? u1 : 0;
                const int64_t nu1 = nu0 + chunk_units < units ? nu0 + chunk_units : units;
                const int64_t next_rows = np < hi ? (n - np * QP_COLS < QP_COLS ? n - np * QP_COLS : QP_COLS) : 0;
                /* + 1: a row's range need not start on a line */
                const int64_t width = ((nu1 - nu0) * unit_bytes + 63) / 64 + 1, row_tiles = (m + QP_ROWS - 1) / QP_ROWS;
                qp_fetch fetch = {w + np * QP_COLS * row_bytes + nu0 * unit_bytes, row_bytes, width, 0,
                                  next_rows * width, 0};
                fetch.per_block = (fetch.left + row_tiles * nbc - 1) / (row_tiles * nbc);
                for (int64_t r0 = 0; r0 < m; r0 += QP_ROWS) {
                    const int64_t rows = m - r0 < QP_ROWS ? m - r0 : QP_ROWS;
                    tiles[rows](panel, S, M, nbc, xq + r0 * k + fb * blk, k, dx + r0 * nbb + fb,
                                corr + r0 * nbb + fb, cs + r0 * nbb + fb, nbb, out + r0 * n + c0, n, nc, u0 == 0, &fetch);
                }
            }
        }
        free(panel);
    }
    return failed ? -3 : 0;
}
