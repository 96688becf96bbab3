/* quant_panel_matmul on AVX2 without AVX-512 (AMD Zen 2 and 3, Intel client and server CPUs before AVX-512):
 * quant_panel_avx512.h's GEMM for many rows, with its order of float operations, so every output is bit for
 * bit the AVX-512 form's. Included by quant_dot.c inside its AVX2 part (its per-type unit decoders
 * T##_prep / T##_decode give a block of 32 levels as one vector, lane q the inputs 4q .. 4q + 3, and its
 * quantize_row rounding, q8_block_avx2); the driver is quant_panel.h's.
 *
 * A panel is 8 output columns: one 32-bit lane holds 4 consecutive levels of one column, so a vector holds the
 * same 4 inputs of the 8 columns, decoded per column and transposed 8 x 8 (llama.cpp's repacked 8-column
 * layout, built per chunk of a call instead of at load; the K-quants, Q4_0 and Q8_0 straight from their bytes). A
 * block's integer sums per column:
 * - with AVX-VNNI, lanes += vpdpbusd(panel vector, broadcast of 4 activation levels of one row), as AVX-512;
 * - without it, vpmaddubsw gives 16-bit sums of input pairs, added in 16 bits for as many steps as cannot
 *   overflow (levels below 16: a whole block of 8 steps, 8 * 2 * 15 * 127 = 30480 <= 32767; below 32: 4 steps;
 *   Q6_K's below 64: 2), then widened by vpmaddwd with ones. Q8_0 multiplies |w| by x with w's sign (its
 *   levels + 128 would overflow the pair sums). Integer sums are exact, so they equal dpbusd's;
 * then, per block, acc += (float(lanes) * dx) * dw (+ min * dx * sum(x)), as AVX-512.
 * A micro-tile is 4 rows x 8 columns: 4 accumulators in 32 bits, 4 in 16, 4 in float32 and the vectors in
 * flight fit the 16 ymm registers.
 */
#define QP_COLS 8     /* columns per panel */
#define QP_ROWS 4     /* rows per micro-tile */
#define QP_CHUNK 1024 /* inputs per decoded chunk of a panel */
#include "quant_panel.h"

/* 8 vectors of 8 dwords transposed: r[q] lane c becomes r[c] lane q. */
static inline void qp_transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + q], 128-bit half L: dword 4L + q of rows 4i .. 4i + 3 */
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int q = 0; q < 4; q++) {
        r[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
        r[4 + q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
    }
}

/* T##_panel, for the legacy types the direct decoders below do not take (Q4_1, Q5_0, Q5_1): units u0 .. u1 (two
 * blocks of 32 each) of the nc (<= 8) weight rows at w into a chunk's panel: the 4 inputs 4i .. 4i + 3 of the
 * chunk (from its first input) in the 32 bytes at panel + 32 i, a dword per column; the scale of the chunk's
 * block b and column c at S[8 b + c], its min at M[8 b + c]. Columns past nc are zero. */
#define QP_PANEL(T)                                                                                           \
    static void T##_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb, \
                          uint8_t *panel, float *S, float *M) {                                               \
        for (int64_t u = u0; u < u1; u++) {                                                                   \
            __m256i wv[8][2];                                                                                 \
            __m256 sv[8][2], mv[8][2];                                                                        \
            for (int64_t c = 0; c < 8; c++) {                                                                 \
                if (c < nc) {                                                                                 \
                    T##_UNIT U;                                                                               \
                    T##_prep(&U, w + c * row_bytes, u, nb);                                                   \
                    T##_decode(&U, 0, wv[c], sv[c], mv[c]);                                                   \
                } else {                                                                                      \
                    wv[c][0] = wv[c][1] = _mm256_setzero_si256();                                             \
                    sv[c][0] = sv[c][1] = mv[c][0] = mv[c][1] = _mm256_setzero_ps();                          \
                }                                                                                             \
            }                                                                                                 \
            for (int h = 0; h < 2 && 2 * u + h < nb; h++) { /* an odd count of blocks: the second is absent */ \
                const int64_t b = 2 * (u - u0) + h; /* the block in the chunk */                               \
                __m256i t[8];                                                                                 \
                for (int c = 0; c < 8; c++) t[c] = wv[c][h];                                                  \
                qp_transpose8(t);                                                                             \
                for (int q = 0; q < 8; q++) _mm256_store_si256((__m256i *)(panel + 256 * b + 32 * q), t[q]);   \
                for (int c = 0; c < 8; c++) {                                                                 \
                    S[8 * b + c] = _mm256_cvtss_f32(sv[c][h]);                                                \
                    M[8 * b + c] = _mm256_cvtss_f32(mv[c][h]);                                                \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

QP_PANEL(q4_1)
QP_PANEL(q5_0)
QP_PANEL(q5_1)

/* The types of llama.cpp's common files (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) decoded straight into the panel: each
 * column's bytes loaded as they lie and transposed by dwords (T##_panel above decodes per column first: ~3x the
 * work per weight).
 * Columns past nc repeat the last one (their lanes are never stored). */
static inline void qp_columns(const uint8_t *w, int64_t row_bytes, int64_t nc, const uint8_t *rows[8]) {
    for (int64_t c = 0; c < 8; c++) rows[c] = w + (c < nc ? c : nc - 1) * row_bytes;
}

/* The 8 columns' float16 at byte `at` of their rows, as float32 lanes. */
static inline __m256 qp_fp16_columns(const uint8_t *const rows[8], int64_t at) {
    uint16_t h[8];
    for (int c = 0; c < 8; c++) memcpy(&h[c], rows[c] + at, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Q4_0 block b: qs dword g holds inputs 4g .. 4g + 3 (low nibbles) and 16 + 4g .. (high ones); columns c and
 * c + 4 share a vector (128-bit halves), so a 4 x 4 transpose within halves gives dword g of all 8. */
static void q4_0_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                              uint8_t *panel, float *S, float *M) {
    (void)M;
    const uint8_t *rows[8];
    qp_columns(w, row_bytes, nc, rows);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t b0 = 2 * u0, b1 = 2 * u1 < nb ? 2 * u1 : nb;
    for (int64_t b = b0; b < b1; b++) {
        __m256i v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[i] + b * 18 + 2))),
                _mm_loadu_si128((const __m128i *)(rows[i + 4] + b * 18 + 2)), 1);
        const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
        const __m256i q[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
        uint8_t *dst = panel + (b - b0) * 8 * 32;
        for (int g = 0; g < 4; g++) {
            _mm256_store_si256((__m256i *)(dst + 32 * g), _mm256_and_si256(q[g], low));
            _mm256_store_si256((__m256i *)(dst + 32 * (g + 4)), _mm256_and_si256(_mm256_srli_epi16(q[g], 4), low));
        }
        _mm256_store_ps(S + 8 * (b - b0), qp_fp16_columns(rows, b * 18));
    }
}

/* Q8_0 block b: its 32 levels (+ 128 for AVX-VNNI's unsigned operand, as quant_dot.c's decoder), 8 x 8 dwords. */
static void q8_0_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                              uint8_t *panel, float *S, float *M) {
    (void)M;
    const uint8_t *rows[8];
    qp_columns(w, row_bytes, nc, rows);
    const __m256i offset = _mm256_set1_epi8(QD_Q8_SIGNED ? 0 : (char)0x80);
    const int64_t b0 = 2 * u0, b1 = 2 * u1 < nb ? 2 * u1 : nb;
    for (int64_t b = b0; b < b1; b++) {
        __m256i v[8];
        for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(rows[c] + b * 34 + 2));
        qp_transpose8(v);
        uint8_t *dst = panel + (b - b0) * 8 * 32;
        for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)(dst + 32 * g), _mm256_xor_si256(v[g], offset));
        _mm256_store_ps(S + 8 * (b - b0), qp_fp16_columns(rows, b * 34));
    }
}

/* Q4_K / Q5_K super-block u (size bytes; Q5_K: qh at 16, qs at 48): qs bytes 32i .. 32i + 31 hold block 2i (low
 * nibbles) and 2i + 1 (high), Q5_K's fifth bit of input l of block j bit j of qh byte l; each column's 8 scales
 * and mins by quant_dot.c's k4_scales, transposed to 8 columns a block. */
static inline void qp_k4_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1,
                                      uint8_t *panel, float *S, float *M, int size, int fifth) {
    const uint8_t *rows[8];
    qp_columns(w, row_bytes, nc, rows);
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const int qs_at = fifth ? 48 : 16;
    for (int64_t u = u0; u < u1; u++) {
        __m256i scales[8], mins[8], high[8];
        for (int c = 0; c < 8; c++) {
            unit_k4 U;
            k4_scales(&U, rows[c] + u * size);
            scales[c] = _mm256_castps_si256(U.scales);
            mins[c] = _mm256_castps_si256(U.mins);
            if (fifth) high[c] = _mm256_loadu_si256((const __m256i *)(rows[c] + u * size + 16));
        }
        qp_transpose8(scales);
        qp_transpose8(mins);
        if (fifth) qp_transpose8(high);
        const int64_t first = 8 * (u - u0); /* the super-block's first block in the chunk */
        for (int b = 0; b < 8; b++) {
            _mm256_store_si256((__m256i *)(S + 8 * (first + b)), scales[b]);
            _mm256_store_si256((__m256i *)(M + 8 * (first + b)), mins[b]);
        }
        for (int i = 0; i < 4; i++) {
            __m256i v[8];
            for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(rows[c] + u * size + qs_at + 32 * i));
            qp_transpose8(v);
            uint8_t *dst = panel + (first + 2 * i) * 8 * 32;
            for (int g = 0; g < 8; g++) {
                __m256i lo = _mm256_and_si256(v[g], low), hi = _mm256_and_si256(_mm256_srli_epi16(v[g], 4), low);
                if (fifth) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[g], 2 * i), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[g], 2 * i + 1), one), 4));
                }
                _mm256_store_si256((__m256i *)(dst + 32 * g), lo);
                _mm256_store_si256((__m256i *)(dst + 256 + 32 * g), hi);
            }
        }
    }
}

static void q4_k_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                              uint8_t *panel, float *S, float *M) {
    (void)nb;
    qp_k4_direct_panel(w, row_bytes, nc, u0, u1, panel, S, M, 144, 0);
}

static void q5_k_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                              uint8_t *panel, float *S, float *M) {
    (void)nb;
    qp_k4_direct_panel(w, row_bytes, nc, u0, u1, panel, S, M, 176, 1);
}

/* Q6_K super-block u, half p (128 inputs): ql runs A (bytes 64p ..) and B (+ 32), qh run Q (128 + 32p ..), dword g
 * of each: inputs 128p + 4g (A low nibbles), + 32 (B low), + 64 (A high), + 96 (B high), their high bit pairs
 * 0-1, 2-3, 4-5, 6-7 of Q; blocks of 16, scales d * sc by quant_dot.c's q6_k_prep, transposed. */
static void q6_k_direct_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb,
                              uint8_t *panel, float *S, float *M) {
    (void)nb, (void)M;
    const uint8_t *rows[8];
    qp_columns(w, row_bytes, nc, rows);
    const __m256i low = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(3);
    for (int64_t u = u0; u < u1; u++) {
        __m256i scales[2][8];
        for (int c = 0; c < 8; c++) {
            unit_k6 U;
            q6_k_prep(&U, rows[c], u, 0);
            scales[0][c] = _mm256_castps_si256(U.scales[0]);
            scales[1][c] = _mm256_castps_si256(U.scales[1]);
        }
        const int64_t first = 16 * (u - u0); /* the super-block's first block of 16 in the chunk */
        for (int half = 0; half < 2; half++) {
            qp_transpose8(scales[half]);
            for (int b = 0; b < 8; b++)
                _mm256_store_si256((__m256i *)(S + 8 * (first + 8 * half + b)), scales[half][b]);
        }
        for (int p = 0; p < 2; p++) {
            __m256i A[8], B[8], Q[8];
            for (int c = 0; c < 8; c++) {
                const uint8_t *block = rows[c] + u * 210;
                A[c] = _mm256_loadu_si256((const __m256i *)(block + 64 * p));
                B[c] = _mm256_loadu_si256((const __m256i *)(block + 64 * p + 32));
                Q[c] = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * p));
            }
            qp_transpose8(A);
            qp_transpose8(B);
            qp_transpose8(Q);
            for (int g = 0; g < 8; g++) {
                const __m256i parts[4] = {_mm256_and_si256(A[g], low), _mm256_and_si256(B[g], low),
                                          _mm256_and_si256(_mm256_srli_epi16(A[g], 4), low),
                                          _mm256_and_si256(_mm256_srli_epi16(B[g], 4), low)};
                for (int s = 0; s < 4; s++) {
                    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(Q[g], 2 * s), pair), 4);
                    const int64_t input = 256 * (u - u0) + 128 * p + 32 * s + 4 * g; /* in the chunk */
                    _mm256_store_si256((__m256i *)(panel + 8 * input), _mm256_or_si256(parts[s], high));
                }
            }
        }
    }
}

static qp_panel_fn qp_panels(int type) {
    switch (type) {
    case QD_Q4_0: return q4_0_direct_panel;
    case QD_Q4_1: return q4_1_panel;
    case QD_Q5_0: return q5_0_panel;
    case QD_Q5_1: return q5_1_panel;
    case QD_Q8_0: return q8_0_direct_panel;
    case QD_Q4_K: return q4_k_direct_panel;
    case QD_Q5_K: return q5_k_direct_panel;
    case QD_Q6_K: return q6_k_direct_panel;
    default: return 0;
    }
}

/* A qp_tile_fn: R rows x one panel chunk of nbc blocks of 4 G inputs; STEP: the 16-bit steps summed before
 * widening (without AVX-VNNI), Q8: Q8_0's (the sign trick where QD_Q8_SIGNED). */
#define QP_TILE(R, MIN, G, STEP, Q8)                                                                      \
    static void qp_tile_##R##_##MIN##_##G##_##STEP##_##Q8(                                                \
        const uint8_t *panel, const float *S, const float *M, int64_t nbc, const int8_t *xq, int64_t k,         \
        const float *dx, const int32_t *corr, const float *cs, int64_t nbb, float *out, int64_t ldo, int64_t nc, \
        int first, qp_fetch *fetch) {                                                                         \
        const __m256i cols = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
        __m256 acc[R];                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
            acc[r] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(out + r * ldo, cols);                   \
        qp_fetch f = *fetch; /* in registers through the loop */                                           \
        for (int64_t b = 0; b < nbc; b++) {                                                                   \
            qp_fetch_lines(&f);                                                                               \
            __m256i s[R];                                                                                     \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) s[r] = _mm256_set1_epi32(corr[r * nbb + b]);  \
            const uint8_t *wp = panel + b * (G) * 32;                                                         \
            const int8_t *xb = xq + b * 4 * (G);                                                              \
            QP_BLOCK_SUMS(R, G, STEP, (Q8) && QD_Q8_SIGNED)                                                   \
            const __m256 scale = _mm256_load_ps(S + 8 * b);                                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                const __m256 d = _mm256_set1_ps(dx[r * nbb + b]);                                             \
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[r]), d), scale, acc[r]);          \
            }                                                                                                 \
            if (MIN) {                                                                                        \
                const __m256 mins = _mm256_load_ps(M + 8 * b);                                                \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                           \
                    acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(cs[r * nbb + b]), acc[r]);                  \
            }                                                                                                 \
        }                                                                                                     \
        *fetch = f;                                                                                           \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) _mm256_maskstore_ps(out + r * ldo, cols, acc[r]); \
    }

static inline __m256i qp_broadcast4(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return _mm256_set1_epi32(four);
}

/* An integer sum kept a chain: gcc reassociates the steps' 16-bit adds into a tree, computing every product
 * first, and spills them (a third slower). */
#define QP_IN_ORDER(v) __asm__("" : "+x"(v))

#if defined(__AVXVNNI__)
#define QP_BLOCK_SUMS(R, G, STEP, SIGNED)                                                                     \
    _Pragma("GCC unroll 8") for (int g = 0; g < (G); g++) {                                                   \
        const __m256i wg = _mm256_load_si256((const __m256i *)(wp + 32 * g));                                 \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
            s[r] = _mm256_dpbusd_avx_epi32(s[r], wg, qp_broadcast4(xb + r * k + 4 * g));                      \
    }
#else
#define QP_BLOCK_SUMS(R, G, STEP, SIGNED)                                                                     \
    _Pragma("GCC unroll 8") for (int g0 = 0; g0 < (G); g0 += (STEP)) {                                        \
        __m256i pairs[R];                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) pairs[r] = _mm256_setzero_si256();                \
        _Pragma("GCC unroll 8") for (int g = g0; g < g0 + (STEP); g++) {                                      \
            const __m256i wg = _mm256_load_si256((const __m256i *)(wp + 32 * g));                             \
            const __m256i level = (SIGNED) ? _mm256_sign_epi8(wg, wg) : wg;                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                const __m256i x = qp_broadcast4(xb + r * k + 4 * g);                                          \
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(level, (SIGNED) ? _mm256_sign_epi8(x, wg) : x)); \
                QP_IN_ORDER(pairs[r]);                                                                        \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1)));                 \
    }
#endif

#define QP_TILES(MIN, G, STEP, Q8)                                                                             \
    QP_TILE(1, MIN, G, STEP, Q8) QP_TILE(2, MIN, G, STEP, Q8) QP_TILE(3, MIN, G, STEP, Q8)                   \
    QP_TILE(4, MIN, G, STEP, Q8)                                                                              \
    static const qp_tile_fn qp_tiles_##MIN##_##G##_##STEP##_##Q8[QP_ROWS + 1] = {                             \
        0, qp_tile_1_##MIN##_##G##_##STEP##_##Q8, qp_tile_2_##MIN##_##G##_##STEP##_##Q8,                        \
        qp_tile_3_##MIN##_##G##_##STEP##_##Q8, qp_tile_4_##MIN##_##G##_##STEP##_##Q8};
QP_TILES(0, 8, 8, 0)            /* Q4_0 */
QP_TILES(1, 8, 8, 0)            /* Q4_1, Q4_K (its mins per block of 32 in M) */
QP_TILES(0, 8, 4, 0)            /* Q5_0 */
QP_TILES(1, 8, 4, 0)            /* Q5_1, Q5_K */
QP_TILES(0, 8, 1, 1)            /* Q8_0 */
QP_TILES(0, 4, 2, 0)            /* Q6_K: blocks of 16 */

static const qp_tile_fn *qp_tiles_for(int type) {
    switch (type) {
    case QD_Q4_0: return qp_tiles_0_8_8_0;
    case QD_Q4_1: case QD_Q4_K: return qp_tiles_1_8_8_0;
    case QD_Q5_0: return qp_tiles_0_8_4_0;
    case QD_Q5_1: case QD_Q5_K: return qp_tiles_1_8_4_0;
    case QD_Q8_0: return qp_tiles_0_8_1_1;
    default: return qp_tiles_0_4_2_0;
    }
}

static void qp_quantize_row(const float *x, int64_t k, int blk, int offset, int8_t *xq, float *dx, int32_t *corr,
                            float *cs) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m256i q;
        int32_t sum0, sum;
        const float d = q8_block_avx2(x + 32 * b, &q, &sum0, &sum);
        _mm256_storeu_si256((__m256i *)(xq + 32 * b), q);
        if (blk == 32) {
            dx[b] = d;
            corr[b] = -offset * sum;
            cs[b] = d * (float)sum;
        } else {
            dx[2 * b] = dx[2 * b + 1] = d;
            corr[2 * b] = -offset * sum0;
            corr[2 * b + 1] = -offset * (sum - sum0);
            cs[2 * b] = cs[2 * b + 1] = 0.0f;
        }
    }
}
