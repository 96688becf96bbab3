/* quant_panel_matmul: y = x W^T for many rows of x on AVX-512 VNNI without AMX, the GEMM of a prefill or a
 * large batch (quant_dot.c's tiles are for a few rows). Included by quant_dot.c inside its AVX-512 part (it
 * uses that file's per-type unit decoders T##_prep / T##_decode and quantize_row's rounding).
 *
 * The layout of llama.cpp's repacked GEMMs (ggml-cpu/repack.cpp), built per call instead of at load: the
 * weights of 32 output columns are decoded once per call into an int8 "panel" where one 32-bit lane holds
 * 4 consecutive levels of one column, so a 512-bit vector holds the same 4 inputs of 16 columns and
 *     lanes += dpbusd(panel vector, broadcast of 4 int8 activations of one row)
 * sums a whole block (8 vectors for a block of 32) in int32 per column; then one float step per block:
 *     acc += (float(lanes) * dx) * dw    (dw: the 16 columns' block scales; + min * dx * sum(x) for types
 *                                         with a min)
 * A micro-tile is 4 rows x 32 columns (8 int32 and 8 float32 accumulators), each panel vector reused by the
 * 4 rows, each broadcast by the 2 vectors. Levels are unsigned with quant_dot.c's offsets (Q4_0 + 8, Q8_0
 * + 128, ...), the accumulator starting at -offset * (the block's sum of activation levels), so the integer
 * sums are exact. The panel is decoded per chunk of 1024 inputs (L1-sized), and a chunk's partial sums are
 * kept in the output between chunks (exact: a float32 store and load). Q6_K takes blocks of 16 (its scales).
 * The driver (threads, chunks, prefetching the next chunk) is quant_panel.h's, shared with the AVX2 form.
 *
 * Every output of every row takes the same operations in the same order whatever the rows, tile or thread
 * count, so a row's result does not depend on the rows batched with it (it differs in float rounding from
 * quant_dot.c's few-row tiles, which sum lanes of 4 inputs before the blocks' scales).
 * OpenMP: the rows are quantized in parallel, then the threads split the panels (output columns).
 */
#include "transpose16_avx512.h"

#define QP_COLS 32    /* columns per panel */
#define QP_ROWS 4     /* rows per micro-tile */
#define QP_CHUNK 1024 /* inputs per decoded chunk of a panel */
#include "quant_panel.h"

/* 16 vectors of 16 dwords transposed: out[q] lane c = in[c] lane q. */
static inline void qp_transpose16(const uint8_t (*in)[64], __m512i *out) {
    for (int i = 0; i < 16; i++) out[i] = _mm512_load_si512(in[i]);
    transpose16_epi32(out);
}

/* KIND 0: the legacy types (a unit of two blocks of 32, one vector); 1: Q4_K / Q5_K (a super-block of 8
 * blocks, vector j holding blocks k4_pair(j) and + 2); 2: Q6_K (a super-block of 16 blocks of 16, vector j
 * its blocks 4j .. 4j + 3). Dword q of vector j of unit u: the chunk's block and the dword within it. */
static inline int qp_block(int kind, int64_t u, int j, int q) {
    return kind == 0 ? 2 * (int)u + q / 8 : kind == 1 ? 8 * (int)u + k4_pair(j) + 2 * (q / 8) : 16 * (int)u + 4 * j + q / 4;
}

/* T##_panel: units u0 .. u1 of the nc (<= 32) weight rows at w into a chunk's panel: for its block b, dword
 * group g, half h (columns 16h ..), 64 bytes at panel + (b * G + g) * 128 + 64 h; scales S[32 b + column],
 * mins M[32 b + column]. Columns past nc are zero. */
#define QP_PANEL(T, KIND)                                                                                     \
    static void T##_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1, int64_t nb, \
                          uint8_t *panel, float *S, float *M) {                                               \
        enum { G = (KIND) == 2 ? 4 : 8 };                                                                     \
        uint8_t wbuf[16][64] __attribute__((aligned(64)));                                                    \
        float sbuf[16][16] __attribute__((aligned(64))), mbuf[16][16] __attribute__((aligned(64)));           \
        const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, \
                                                                   14, 15), _mm512_set1_epi32(16));           \
        for (int h = 0; h < 2; h++) {                                                                         \
            const int64_t cols = nc - 16 * h <= 0 ? 0 : nc - 16 * h > 16 ? 16 : nc - 16 * h;                  \
            for (int64_t u = u0; u < u1; u++) {                                                               \
                T##_UNIT U[16];                                                                               \
                for (int64_t c = 0; c < cols; c++) T##_prep(&U[c], w + (16 * h + c) * row_bytes, u, nb);    \
                for (int j = 0; j < T##_VPU; j++) {                                                           \
                    for (int64_t c = 0; c < 16; c++) {                                                        \
                        __m512i wv = _mm512_setzero_si512();                                                  \
                        __m512 sv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();                            \
                        if (c < cols) {                                                                       \
                            T##_decode(&U[c], j, &wv, &sv, &mv);                                             \
                            if ((KIND) == 1) mv = T##_mins(&U[c]); /* lanes 0-7: the 8 blocks' -dmin * m */  \
                        }                                                                                     \
                        _mm512_store_si512(wbuf[c], wv);                                                      \
                        _mm512_store_ps(sbuf[c], sv);                                                         \
                        _mm512_store_ps(mbuf[c], mv);                                                         \
                    }                                                                                         \
                    __m512i t[16];                                                                            \
                    qp_transpose16(wbuf, t);                                                                  \
                    for (int q = 0; q < 16; q++) {                                                            \
                        const int b = qp_block(KIND, u, j, q), first = qp_block(KIND, u0, 0, 0);              \
                        const int g = q % G;                                                                  \
                        if ((KIND) == 0 && b >= nb) break; /* an odd count of blocks: the unit's second is absent */ \
                        _mm512_store_si512(panel + ((int64_t)(b - first) * G + g) * 128 + 64 * h, t[q]);     \
                        if (g) continue;                                                                      \
                        const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(q));                     \
                        _mm512_store_ps(S + 32 * (b - first) + 16 * h, _mm512_i32gather_ps(at, &sbuf[0][0], 4)); \
                        const __m512i min_at = (KIND) == 1 ? _mm512_add_epi32(lanes, _mm512_set1_epi32(b % 8)) : at; \
                        _mm512_store_ps(M + 32 * (b - first) + 16 * h, _mm512_i32gather_ps(min_at, &mbuf[0][0], 4)); \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

QP_PANEL(q4_0, 0)
QP_PANEL(q4_1, 0)
QP_PANEL(q5_0, 0)
QP_PANEL(q5_1, 0)
QP_PANEL(q8_0, 0)
QP_PANEL(q4_k, 1)
QP_PANEL(q5_k, 1)
QP_PANEL(q6_k, 2)

/* The types of llama.cpp's common files decoded straight into the panel, a lane per column: the same 16 bytes
 * of 16 columns' blocks loaded and their dwords transposed by in-lane unpacks (qp_load16x4), or gathered
 * (vpgatherdd, masked past nc) in a last, partial half; the bytes are decoded once, in lanes (the generic
 * T##_panel above decodes per column, then transposes 16 x 16 dwords: ~2x the work per weight). */
static inline __m512i qp_gather(__mmask16 cols, __m512i at, const uint8_t *p) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), cols, at, p, 1);
}

/* out[g] lane c = dword g of the 16 bytes at p + c * stride, for 16 columns c: loaded as they are and transposed
 * by in-lane unpacks, where 4 gathers took 1-7 % longer in Q4_0, Q8_0 and Q4_K linears of 4-16 rows on a
 * Sapphire Rapids core (Q6_K's: the same time there) and AMD's gathers are slower still. */
static inline void qp_load16x4(const uint8_t *p, int64_t stride, __m512i out[4]) {
    __m512i a[4];
    for (int j = 0; j < 4; j++) { /* lane i of a[j]: column 4i + j, so the unpacks leave column c in lane c */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + j * stride)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (4 + j) * stride)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (8 + j) * stride)), 2);
        a[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (12 + j) * stride)), 3);
    }
    const __m512i lo01 = _mm512_unpacklo_epi32(a[0], a[1]), hi01 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(a[2], a[3]), hi23 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[0] = _mm512_unpacklo_epi64(lo01, lo23);
    out[1] = _mm512_unpackhi_epi64(lo01, lo23);
    out[2] = _mm512_unpacklo_epi64(hi01, hi23);
    out[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

/* The 4 dwords at p of 16 columns stride bytes apart: loaded (all 16 present) or gathered (a last, partial half). */
static inline void qp_dwords4(__mmask16 cols, __m512i at, const uint8_t *p, int64_t stride, __m512i out[4]) {
    if (cols == 0xFFFF) {
        qp_load16x4(p, stride, out);
        return;
    }
    for (int g = 0; g < 4; g++) out[g] = qp_gather(cols, at, p + 4 * g);
}

static inline __mmask16 qp_half_mask(int64_t nc, int h) {
    const int64_t cols = nc - 16 * h <= 0 ? 0 : nc - 16 * h > 16 ? 16 : nc - 16 * h;
    return (__mmask16)((1u << cols) - 1);
}

static inline __m512 qp_fp16_low(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }

#define QP_LANE_PANEL(T, ...)                                                                                 \
    static void T##_lane_panel(const uint8_t *w, int64_t row_bytes, int64_t nc, int64_t u0, int64_t u1,       \
                               int64_t nb, uint8_t *panel, float *S, float *M) {                              \
        (void)nb, (void)M;                                                                                    \
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, \
                                                                 14, 15), _mm512_set1_epi32((int)row_bytes)); \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                           \
        for (int h = 0; h < 2; h++) {                                                                         \
            const __mmask16 cols = qp_half_mask(nc, h);                                                       \
            const uint8_t *base = w + 16 * h * row_bytes;                                                     \
            __VA_ARGS__                                                                                       \
        }                                                                                                     \
    }

/* Q4_0 block b: qs dword g holds inputs 4g .. 4g + 3 (low nibbles) and 16 + 4g .. (high ones). */
QP_LANE_PANEL(q4_0, {
    const int64_t b0 = 2 * u0, b1 = 2 * u1 < nb ? 2 * u1 : nb;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = base + b * 18;
        uint8_t *dst = panel + (b - b0) * 8 * 128 + 64 * h;
        __m512i v[4];
        qp_dwords4(cols, at, block + 2, row_bytes, v);
        for (int g = 0; g < 4; g++) {
            _mm512_store_si512(dst + 128 * g, _mm512_and_si512(v[g], low));
            _mm512_store_si512(dst + 128 * (g + 4), _mm512_and_si512(_mm512_srli_epi32(v[g], 4), low));
        }
        _mm512_store_ps(S + 32 * (b - b0) + 16 * h, qp_fp16_low(qp_gather(cols, at, block)));
    }
})

/* Q8_0 block b: qs dword g, levels + 128 (xor 0x80, as quant_dot.c's offset). */
QP_LANE_PANEL(q8_0, {
    const int64_t b0 = 2 * u0, b1 = 2 * u1 < nb ? 2 * u1 : nb;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = base + b * 34;
        uint8_t *dst = panel + (b - b0) * 8 * 128 + 64 * h;
        __m512i v[8];
        qp_dwords4(cols, at, block + 2, row_bytes, v);
        qp_dwords4(cols, at, block + 18, row_bytes, v + 4);
        for (int g = 0; g < 8; g++)
            _mm512_store_si512(dst + 128 * g, _mm512_xor_si512(v[g], _mm512_set1_epi8((char)0x80)));
        _mm512_store_ps(S + 32 * (b - b0) + 16 * h, qp_fp16_low(qp_gather(cols, at, block)));
    }
})

/* Q4_K super-block u: qs bytes 32i .. 32i + 31 hold block 2i (low nibbles) and 2i + 1 (high); the 6-bit
 * scales and mins of get_scale_min_k4 from the 12 bytes q: for i < 4, with a, c, e bytes i of q[0..3],
 * q[4..7], q[8..11]: scale i = a & 63, min i = c & 63, scale i + 4 = (e & 15) | (a >> 6) << 4,
 * min i + 4 = (e >> 4) | (c >> 6) << 4; the panel's min is -dmin * min. */
QP_LANE_PANEL(q4_k, {
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), byte = _mm512_set1_epi32(0xFF);
    for (int64_t u = u0; u < u1; u++) {
        const uint8_t *block = base + u * 144;
        uint8_t *dst = panel + (u - u0) * 8 * 8 * 128 + 64 * h;
        for (int i = 0; i < 4; i++) {
            __m512i v[8];
            qp_dwords4(cols, at, block + 16 + 32 * i, row_bytes, v);
            qp_dwords4(cols, at, block + 32 + 32 * i, row_bytes, v + 4);
            for (int g = 0; g < 8; g++) {
                _mm512_store_si512(dst + (2 * i * 8 + g) * 128, _mm512_and_si512(v[g], low));
                const __m512i high = _mm512_and_si512(_mm512_srli_epi32(v[g], 4), low);
                _mm512_store_si512(dst + ((2 * i + 1) * 8 + g) * 128, high);
            }
        }
        __m512i head[4]; /* d and dmin, then the 12 bytes of scales and mins */
        qp_dwords4(cols, at, block, row_bytes, head);
        const __m512i dm = head[0], q0 = head[1], q1 = head[2], q2 = head[3];
        const __m512 d = qp_fp16_low(dm), dmin = qp_fp16_low(_mm512_srli_epi32(dm, 16));
        const __m512 neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), dmin);
        float *s = S + 32 * 8 * (u - u0) + 16 * h, *m = M + 32 * 8 * (u - u0) + 16 * h;
        for (int i = 0; i < 4; i++) {
            const __m512i a = _mm512_and_si512(_mm512_srli_epi32(q0, 8 * i), byte);
            const __m512i c = _mm512_and_si512(_mm512_srli_epi32(q1, 8 * i), byte);
            const __m512i e = _mm512_and_si512(_mm512_srli_epi32(q2, 8 * i), byte);
            const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(e, four), _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4));
            const __m512i mn_hi = _mm512_or_si512(_mm512_srli_epi32(e, 4), _mm512_slli_epi32(_mm512_srli_epi32(c, 6), 4));
            _mm512_store_ps(s + 32 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, six)), d));
            _mm512_store_ps(m + 32 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, six)), neg_dmin));
            _mm512_store_ps(s + 32 * (i + 4), _mm512_mul_ps(_mm512_cvtepi32_ps(sc_hi), d));
            _mm512_store_ps(m + 32 * (i + 4), _mm512_mul_ps(_mm512_cvtepi32_ps(mn_hi), neg_dmin));
        }
    }
})

/* Q6_K super-block u, half p (128 inputs): ql dwords A (bytes 64p + 4g) and B (+ 32), qh dword Q (128 + 32p +
 * 4g): inputs 128p + 4g (A low nibbles), + 32 (B low), + 64 (A high), + 96 (B high), their high bit pairs
 * 0-1, 2-3, 4-5, 6-7 of Q; blocks of 16 with int8 scales (bytes 192 ..), d at 208. */
QP_LANE_PANEL(q6_k, {
    const __m512i pair = _mm512_set1_epi8(3);
    for (int64_t u = u0; u < u1; u++) {
        const uint8_t *block = base + u * 210;
        uint8_t *dst = panel + (u - u0) * 16 * 4 * 128 + 64 * h;
        for (int p = 0; p < 2; p++) {
            __m512i A[8], B[8], Q[8];
            qp_dwords4(cols, at, block + 64 * p, row_bytes, A);
            qp_dwords4(cols, at, block + 64 * p + 16, row_bytes, A + 4);
            qp_dwords4(cols, at, block + 64 * p + 32, row_bytes, B);
            qp_dwords4(cols, at, block + 64 * p + 48, row_bytes, B + 4);
            qp_dwords4(cols, at, block + 128 + 32 * p, row_bytes, Q);
            qp_dwords4(cols, at, block + 128 + 32 * p + 16, row_bytes, Q + 4);
            for (int g = 0; g < 8; g++) {
                const __m512i parts[4] = {_mm512_and_si512(A[g], low), _mm512_and_si512(B[g], low),
                                          _mm512_and_si512(_mm512_srli_epi32(A[g], 4), low),
                                          _mm512_and_si512(_mm512_srli_epi32(B[g], 4), low)};
                for (int s = 0; s < 4; s++) {
                    const __m512i high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(Q[g], 2 * s), pair), 4);
                    const int at_input = 128 * p + 32 * s + 4 * g; /* block at_input / 16, dword (at_input % 16) / 4 */
                    _mm512_store_si512(dst + (at_input / 4) * 128, _mm512_or_si512(parts[s], high));
                }
            }
        }
        const __m512 d = qp_fp16_low(_mm512_srli_epi32(qp_gather(cols, at, block + 206), 16));
        float *s = S + 32 * 16 * (u - u0) + 16 * h;
        __m512i q[4]; /* the 16 int8 scales, 4 a dword */
        qp_dwords4(cols, at, block + 192, row_bytes, q);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) {
                const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(q[i], 24 - 8 * j), 24); /* byte j */
                _mm512_store_ps(s + 32 * (4 * i + j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale)));
            }
    }
})

static qp_panel_fn qp_panels(int type) {
    switch (type) {
    case QD_Q4_0: return q4_0_lane_panel;
    case QD_Q4_1: return q4_1_panel;
    case QD_Q5_0: return q5_0_panel;
    case QD_Q5_1: return q5_1_panel;
    case QD_Q8_0: return q8_0_lane_panel;
    case QD_Q4_K: return q4_k_lane_panel;
    case QD_Q5_K: return q5_k_panel;
    case QD_Q6_K: return q6_k_lane_panel;
    default: return 0;
    }
}

/* A qp_tile_fn: R rows x one panel chunk of nbc blocks of 4 G inputs. */
#define QP_TILE(R, MIN, G)                                                                                    \
    static void qp_tile_##R##_##MIN##_##G(const uint8_t *panel, const float *S, const float *M, int64_t nbc,   \
                                          const int8_t *xq, int64_t k, const float *dx, const int32_t *corr,   \
                                          const float *cs, int64_t nbb, float *out, int64_t ldo, int64_t nc,   \
                                          int first, qp_fetch *fetch) {                                       \
        const __mmask16 m0 = qp_half_mask(nc, 0), m1 = qp_half_mask(nc, 1);                                   \
        __m512 acc[R][2];                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            acc[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, out + r * ldo);               \
            acc[r][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, out + r * ldo + 16);          \
        }                                                                                                     \
        qp_fetch f = *fetch; /* in registers through the loop */                                           \
        for (int64_t b = 0; b < nbc; b++) {                                                                   \
            qp_fetch_lines(&f);                                                                               \
            __m512i s[R][2];                                                                                  \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) s[r][0] = s[r][1] =                           \
                _mm512_set1_epi32(corr[r * nbb + b]);                                                         \
            const uint8_t *wp = panel + b * (G) * 128;                                                        \
            const int8_t *xb = xq + b * 4 * (G);                                                              \
            _Pragma("GCC unroll 8") for (int g = 0; g < (G); g++) {                                           \
                const __m512i w0 = _mm512_load_si512(wp + 128 * g), w1 = _mm512_load_si512(wp + 128 * g + 64); \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                         \
                    int32_t four;                                                                             \
                    memcpy(&four, xb + r * k + 4 * g, 4);                                                     \
                    const __m512i x = _mm512_set1_epi32(four);                                                \
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, x);                                            \
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, x);                                            \
                }                                                                                             \
            }                                                                                                 \
            const __m512 s0 = _mm512_load_ps(S + 32 * b), s1 = _mm512_load_ps(S + 32 * b + 16);               \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                const __m512 d = _mm512_set1_ps(dx[r * nbb + b]);                                             \
                acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][0]), d), s0, acc[r][0]);    \
                acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][1]), d), s1, acc[r][1]);    \
            }                                                                                                 \
            if (MIN) {                                                                                        \
                const __m512 n0 = _mm512_load_ps(M + 32 * b), n1 = _mm512_load_ps(M + 32 * b + 16);           \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                         \
                    const __m512 c = _mm512_set1_ps(cs[r * nbb + b]);                                         \
                    acc[r][0] = _mm512_fmadd_ps(n0, c, acc[r][0]);                                            \
                    acc[r][1] = _mm512_fmadd_ps(n1, c, acc[r][1]);                                            \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        *fetch = f;                                                                                           \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);                                              \
            _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);                                         \
        }                                                                                                     \
    }

#define QP_TILES(MIN, G) QP_TILE(1, MIN, G) QP_TILE(2, MIN, G) QP_TILE(3, MIN, G) QP_TILE(4, MIN, G)
QP_TILES(0, 8)
QP_TILES(1, 8)
QP_TILES(0, 4)

static const qp_tile_fn qp_tiles_plain[QP_ROWS + 1] = {0, qp_tile_1_0_8, qp_tile_2_0_8, qp_tile_3_0_8, qp_tile_4_0_8};
static const qp_tile_fn qp_tiles_min[QP_ROWS + 1] = {0, qp_tile_1_1_8, qp_tile_2_1_8, qp_tile_3_1_8, qp_tile_4_1_8};
static const qp_tile_fn qp_tiles_16[QP_ROWS + 1] = {0, qp_tile_1_0_4, qp_tile_2_0_4, qp_tile_3_0_4, qp_tile_4_0_4};

static const qp_tile_fn *qp_tiles_for(int type) {
    return type == QD_Q6_K ? qp_tiles_16 : qd_has_min(type) ? qp_tiles_min : qp_tiles_plain;
}

static void qp_quantize_row(const float *x, int64_t k, int blk, int offset, int8_t *xq, float *dx, int32_t *corr,
                            float *cs) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m128i q0, q1;
        int32_t sum;
        const float d = q8_block_avx512(x + 32 * b, &q0, &q1, &sum);
        _mm_storeu_si128((__m128i *)(xq + 32 * b), q0);
        _mm_storeu_si128((__m128i *)(xq + 32 * b + 16), q1);
        if (blk == 32) {
            dx[b] = d;
            corr[b] = -offset * sum;
            cs[b] = d * (float)sum;
        } else {
            const int32_t s0 = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q0));
            dx[2 * b] = dx[2 * b + 1] = d;
            corr[2 * b] = -offset * s0;
            corr[2 * b + 1] = -offset * (sum - s0);
            cs[2 * b] = cs[2 * b + 1] = 0.0f;
        }
    }
}

