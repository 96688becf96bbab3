/* amx_half: y = x W^T (+ bias) for 16-bit weights W [n][k] in the checkpoint's own layout and x [m][k] of
 * the same dtype, on AMX-BF16 tiles (Sapphire Rapids and later), for the few to few tens of rows where
 * half_linear.c's AVX-512 GEMV turns compute-bound and torch's GEMM is still far from the memory bound.
 * Its own library: a compiler or a CPU without AMX leaves half_linear untouched. The signature is
 * half_linear's, so the decode replay calls either through one entry.
 *
 * No repack: out^T = W x^T. Tile A is 16 weight rows x 32 inputs, loaded straight from W with the row
 * stride (k * 2 bytes); tile B is 32 inputs x 16 rows of x in the pair-interleaved (VNNI) layout
 * tdpbf16ps wants, built once per call (row i of the tile: for each x row r the pair x[r][2i], x[r][2i+1]);
 * tile C is 16 outputs x 16 rows of float32 accumulators, kept in the tile over the whole of k. A block of
 * 16 outputs passes once over its weights for up to AH_GROUPS groups of 16 rows (C tiles 0..3); more rows
 * take another pass, from cache, as long as their B tiles stay within AH_SWEEP_BYTES (a sweep); the next
 * sweep's rows pass again over every block's weights (from memory: for hundreds of rows, x's B tiles
 * re-read from L2 cost more than the weights re-read). Outputs past n and inputs
 * past k (the last partial tiles) are read from a zero-padded copy of those weights; x's padding is zeros
 * too. x is packed (split, transposed) once per call, the results transposed back to rows for stores.
 *
 * Arithmetic. bfloat16: each product of two bfloat16 values is exact in float32 and tdpbf16ps adds them
 * into the float32 accumulator in input order, rounding to nearest even (subnormal inputs and results
 * flushed to zero, as vdpbf16ps); the only rounding before the output's is the float32 sum's, as in
 * half_linear.c and torch's reference: the order of the additions differs.
 * float16 (AMX here has no float16 products): each float16 value v is split exactly into two bfloat16,
 * hi = v with its significand cut to 8 bits and lo = v - hi (at most 3 significant bits, and v's
 * magnitude >= 2^-24 keeps it a normal bfloat16), so w x = wh xh + wh xl + wl xh + wl xl, four products
 * exact in float32, summed by the tiles in float32. No input bit is lost; the float32 sum has 4k terms
 * instead of k (tests/backends/test_native_amx_half.py states the bound). An infinite v splits into
 * (v, 0), a NaN into (NaN, 0); so an infinity times a value whose low half is 0 adds inf * 0, a NaN,
 * where the unsplit product is an infinity (the output is then NaN, not +-inf; a NaN or an infinity still
 * reaches only its own row of x or its own output).
 * Every output of every row takes the same operations in the same order whatever m, the group or lane
 * it falls in, the thread or the outputs around it: a row's result never depends on its batch.
 *
 * Threads (OpenMP) split the 16-output blocks into contiguous ranges; while a block runs, each step
 * prefetches the same 64 bytes of the next block's 16 rows, one block ahead (into L2: the 16 rows of a
 * tile are k * 2 bytes apart, so in L1 they would share a few sets).
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * amx_half_init asks once per process and says whether it was granted.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__F16C__) && defined(__linux__) && defined(__x86_64__)
#define AH_AMX 1
#include <immintrin.h>
#include "amx_tile_state.h"
#include "bf16_bits.h"
#endif

enum { AH_BF16 = 0, AH_F16 = 1 };

/* Whether the library holds the AMX kernel (built for a CPU with AMX-TILE, AMX-BF16 and AVX512-BF16). */
int amx_half_compiled(void) {
#if defined(AH_AMX)
    return 1;
#else
    return 0;
#endif
}

static int ah_granted;

/* Asks Linux for the tile data state. 0: granted; otherwise the errno of the refusal, or -1 when the
 * library has no AMX kernel. */
int amx_half_init(void) {
#if defined(AH_AMX)
    return amx_request_tile_state(&ah_granted);
#else
    return -1;
#endif
}

#if defined(AH_AMX)
#define AH_COLS 16   /* outputs per tile (A's and C's 16 rows) */
#define AH_ROWS 16   /* rows of x per group (C's 16 float32 columns) */
#define AH_GROUPS 4  /* groups of rows per pass over a block's weights: C tiles 0..3 */
#define AH_TILE 1024 /* bytes of one 16 x 64-byte tile */
#ifndef AH_SWEEP_BYTES
#define AH_SWEEP_BYTES (512 << 10) /* x's B tiles a block's weights serve before the next block's */
#endif
#ifndef AH_PF
#define AH_PF 1 /* prefetch the next block's weights */
#endif
#ifndef AH_PF_HINT
#define AH_PF_HINT _MM_HINT_T1
#endif

/* Palette 1, every tile 16 rows of 64 bytes: 0..3 C, 4 A (bfloat16 or the high halves), 7 A (low halves),
 * 5 and 6 B. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ah_config;

static void ah_configure(void) {
    ah_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}


/* 32 float16 values as 32 bfloat16 high parts and 32 low parts (the exact split of the header), through
 * float32: hi and lo are bfloat16 values already, normal ones (>= 2^-24 in magnitude), so vcvtne2ps2bf16
 * converts them exactly. Every float16 value, zero, subnormal, infinity and NaN included. */
static inline void ah_split32_float32(__m512i h, __m512i *hi, __m512i *lo) {
    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    const __m512i cut = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(f0), cut));
    const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(f1), cut));
    const __m512 big = _mm512_set1_ps(65536.0f); /* above every finite float16: infinities and NaNs get lo = 0 */
    const __m512 l0 = _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(f0), big, _CMP_LT_OQ), f0, h0);
    const __m512 l1 = _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(f1), big, _CMP_LT_OQ), f1, h1);
    *hi = (__m512i)_mm512_cvtne2ps_pbh(h1, h0);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(l1, l0);
}

/* The same split, bit for bit, on the float16 bits in 16-bit lanes: 8 operations for 32 values where the
 * float32 route takes 17 (the weights' split is most of a float16 call's time at 16 rows).
 * For a normal float16 v (biased exponent e = 1..30, significand bits m), t = v >> 3
 * (arithmetic: the sign copied into bits 15..12): hi = sign | (e + 112) << 7 | m >> 3 = (t & 0x8fff) + 0x3800;
 * lo = (m & 7) 2^(e - 25) = sign | (e << 7) + ((102 + p) << 7 | (j << (7 - p)) & 0x7f) for j = m & 7 > 0
 * with its top bit p (a table indexed by v's low bits), +0 for j = 0. Zeros, subnormals, infinities and
 * NaNs (e = 0 or 31) take the float32 route; a test over every float16 value in every lane
 * (tests/backends/test_native_amx_half.py) checks both routes give the same bits. */
static inline void ah_split32(__m512i v, __m512i *hi, __m512i *lo) {
#if defined(__AVX512FP16__)
    /* QNaN, +-0, +-infinity, subnormal, SNaN */
    const __mmask32 special = _mm512_fpclass_ph_mask((__m512h)v, 0xbf);
#else
    /* |v| + 0x0400 (16 bits) below 0x0800 or negative as a signed number */
    const __mmask32 special = _mm512_cmplt_epi16_mask(
        _mm512_add_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(0x0400)),
        _mm512_set1_epi16(0x0800));
#endif
    if (special) {
        ah_split32_float32(v, hi, lo);
        return;
    }
    const __m512i table = _mm512_set_epi16(
        0x3460, 0x3440, 0x3420, 0x3400, 0x33c0, 0x3380, 0x3300, 0,  /* lanes 31..24 */
        0x3460, 0x3440, 0x3420, 0x3400, 0x33c0, 0x3380, 0x3300, 0,  /* 23..16 */
        0x3460, 0x3440, 0x3420, 0x3400, 0x33c0, 0x3380, 0x3300, 0,  /* 15..8 */
        0x3460, 0x3440, 0x3420, 0x3400, 0x33c0, 0x3380, 0x3300, 0); /* 7..0: j = 7..0 */
    const __m512i t = _mm512_srai_epi16(v, 3);
    *hi = _mm512_add_epi16(_mm512_and_si512(t, _mm512_set1_epi16((short)0x8fff)), _mm512_set1_epi16(0x3800));
    const __m512i signed_exponent = _mm512_and_si512(t, _mm512_set1_epi16((short)0x8f80));
    *lo = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(v, _mm512_set1_epi16(7)), signed_exponent,
                                 _mm512_permutexvar_epi16(v, table));
}

/* 32 float32 values as three bfloat16 parts each, x = hi + mid + lo exactly: hi = x with its significand cut
 * to 8 bits, mid = (x - hi) cut the same way, lo = x - hi - mid (each difference exact in float32; x's 24
 * significant bits leave at most 8 for lo, so every part is a bfloat16 value, converted exactly). The tiles
 * flush subnormal bfloat16 inputs, so a part below 2^-126 in magnitude counts as 0: |x - (hi + mid + lo)| <
 * 2^-125 as the tiles see it (0 for |x| >= 2^-102). A NaN keeps hi = a (quiet) NaN, an infinity hi = itself;
 * both mid = lo = 0. */
static inline void ah_split3_float(const float *x, int half, __m512 *hi, __m512 *mid, __m512 *lo) {
    const __m512 f = _mm512_loadu_ps(x + 16 * half);
    const __m512i cut = _mm512_set1_epi32((int)0xffff0000u);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
    const __m512 h = _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(f), cut)), nan, f);
    const __m512 d = _mm512_maskz_sub_ps(finite, f, h);
    const __m512 m = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(d), cut));
    *hi = h, *mid = m, *lo = _mm512_sub_ps(d, m);
}

static inline void ah_split32_float(const float *x, __m512i *hi, __m512i *mid, __m512i *lo) {
    __m512 h0, m0, l0, h1, m1, l1;
    ah_split3_float(x, 0, &h0, &m0, &l0);
    ah_split3_float(x, 1, &h1, &m1, &l1);
    *hi = (__m512i)_mm512_cvtne2ps_pbh(h1, h0);
    *mid = (__m512i)_mm512_cvtne2ps_pbh(m1, m0);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(l1, l0);
}

enum { AH_X_F32 = 2 }; /* x's kind in ah_pack_x: AH_BF16, AH_F16 or float32 */

/* rows[i] <- column i of the 16 x 16 matrix of 32-bit words rows[0..15] (4 rounds of 16 shuffles). */
static inline void ah_transpose16(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* rows[4 q + j] holds, in each 128-bit lane L, words j of rows 4 L' .. (input rows 4q..4q+3) */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        rows[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        rows[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* x [m][k] into the B tiles (g, s) for tiles first..last-1 of the groups x ks (g = tile / ks, s = tile % ks;
 * zeros past m and k): bfloat16 x as is into hi; float16 x split into hi and lo; float32 x into hi, lo (its mid
 * part) and lo2 (its low part). Word i * 16 + r of tile (g, s) holds x[16 g + r][32 s + 2 i .. + 1]: the 16
 * rows' 32 values each, split, then transposed as 16 x 16 words. */
static void ah_pack_x(int dtype, const void *xv, int64_t m, int64_t k, int64_t ks, int64_t first, int64_t last,
                      uint32_t *hi, uint32_t *lo, uint32_t *lo2) {
    for (int64_t tile = first; tile < last; tile++) {
        const int64_t g = tile / ks, s = tile % ks, count = k - 32 * s < 32 ? k - 32 * s : 32;
        const __mmask32 mask = (__mmask32)(count == 32 ? 0xffffffffu : ((1u << count) - 1));
        __m512i part[3][16];
        for (int lane = 0; lane < AH_ROWS; lane++) {
            const int64_t r = g * AH_ROWS + lane;
            if (r >= m) {
                part[0][lane] = part[1][lane] = part[2][lane] = _mm512_setzero_si512();
            } else if (dtype == AH_X_F32) {
                const float *row = (const float *)xv + r * k + 32 * s;
                float values[32] __attribute__((aligned(64)));
                _mm512_store_ps(values, _mm512_maskz_loadu_ps((__mmask16)mask, row));
                _mm512_store_ps(values + 16, _mm512_maskz_loadu_ps((__mmask16)(mask >> 16), row + 16));
                ah_split32_float(values, &part[0][lane], &part[1][lane], &part[2][lane]);
            } else {
                const __m512i v = _mm512_maskz_loadu_epi16(mask, (const uint16_t *)xv + r * k + 32 * s);
                if (dtype == AH_BF16) part[0][lane] = v;
                else ah_split32(v, &part[0][lane], &part[1][lane]);
            }
        }
        uint32_t *const out[3] = {hi, lo, lo2};
        const int parts = dtype == AH_X_F32 ? 3 : dtype == AH_F16 ? 2 : 1;
        for (int p = 0; p < parts; p++) {
            ah_transpose16(part[p]);
            for (int i = 0; i < 16; i++) _mm512_store_si512(out[p] + tile * (AH_TILE / 4) + 16 * i, part[p][i]);
        }
    }
}

/* The A tile(s) of outputs o0..o0+15 at step s when they cannot be read in place (outputs past n, inputs
 * past k, or float16 weights to split): 16 rows of 64 bytes each at hi (and lo). */
static inline void ah_weight_tile(int dtype, const uint16_t *w, int64_t n, int64_t k, int64_t o0, int64_t s,
                                  uint16_t *hi, uint16_t *lo) {
    const int64_t count = k - 32 * s < 32 ? k - 32 * s : 32;
    const __mmask32 mask = (__mmask32)(count == 32 ? 0xffffffffu : ((1u << count) - 1));
    for (int o = 0; o < AH_COLS; o++) {
        __m512i v = _mm512_setzero_si512();
        if (o0 + o < n) v = _mm512_maskz_loadu_epi16(mask, w + (o0 + o) * k + 32 * s);
        if (dtype == AH_BF16) {
            _mm512_store_si512(hi + 32 * o, v);
        } else {
            __m512i h, l;
            ah_split32(v, &h, &l);
            _mm512_store_si512(hi + 32 * o, h);
            _mm512_store_si512(lo + 32 * o, l);
        }
    }
}

/* C tile `c` += A (tile 4; float16: 4 high, 7 low) times the B tile(s) of group g at step s. */
#define AH_PRODUCT(c)                                                                   \
    do {                                                                                \
        _tile_loadd(5, bh + ((p0 + c) * ks + s) * (AH_TILE / 4), 64);                   \
        _tile_dpbf16ps(c, 4, 5);                                                        \
        if (x_split) {                                                                  \
            _tile_loadd(6, bl + ((p0 + c) * ks + s) * (AH_TILE / 4), 64);               \
            _tile_dpbf16ps(c, 4, 6);                                                    \
        }                                                                               \
        if (split) {                                                                    \
            _tile_dpbf16ps(c, 7, 5);                                                    \
            if (x_split) _tile_dpbf16ps(c, 7, 6);                                       \
        }                                                                               \
        if (bl2) {                                                                      \
            _tile_loadd(5, bl2 + ((p0 + c) * ks + s) * (AH_TILE / 4), 64);              \
            _tile_dpbf16ps(c, 4, 5);                                                    \
        }                                                                               \
    } while (0)

/* One group's 16 x 16 results (C tile: [output][row]) plus the bias into out rows r0.. (below m), outputs
 * o0..o0+outs-1: transposed to [row][output] for one (masked) 64- or 32-byte store a row; a 16-bit out
 * rounded to nearest even as before (_cvtss_sh's instruction; float_to_bf16's operations). */
static inline void ah_store_rows(const float *result, __m512 bias, int64_t r0, int64_t m, int64_t o0, int64_t outs,
                                 int64_t n, int dtype, void *out, int out_float) {
    __m512i rows[16];
    for (int o = 0; o < 16; o++) rows[o] = _mm512_load_si512(result + 16 * o);
    ah_transpose16(rows);
    const __mmask16 valid = (__mmask16)((1u << outs) - 1);
    const int64_t count = m - r0 < AH_ROWS ? m - r0 : AH_ROWS;
    for (int64_t r = 0; r < count; r++) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(rows[r]), bias);
        const int64_t at = (r0 + r) * n + o0;
        if (out_float) _mm512_mask_storeu_ps((float *)out + at, valid, v);
        else if (dtype == AH_F16)
            _mm256_mask_storeu_epi16((uint16_t *)out + at, valid, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        else { /* float_to_bf16 on 16 lanes (vcvtneps2bf16 would flush subnormal results) */
            const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
            const __m512i one = _mm512_set1_epi32(1);
            const __m512i rounded = _mm512_srli_epi32(
                _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, one))), 16);
            const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
            const __m512i word = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
            _mm256_mask_storeu_epi16((uint16_t *)out + at, valid, _mm512_cvtepi32_epi16(word));
        }
    }
}

/* dtype: 0 bfloat16, 1 float16 (x, w, bias and a 16-bit out share it). x [m][k], w [n][k], bias [n] or NULL,
 * out [m][n]: float32 when out_float, else the 16-bit dtype (rounded to nearest even). Returns 0; -2: a bad
 * dtype; -3: a buffer could not be allocated; -4: the tile state was not granted (amx_half_init). */
static int ah_linear(int dtype, int float_x, const void *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                     const void *bias, void *out, int out_float) {
    if (dtype != AH_BF16 && dtype != AH_F16) return -2;
    if (!ah_granted) return -4;
    if (m <= 0 || n <= 0) return 0;
    const int split = dtype == AH_F16, x_split = split || float_x;
    const int64_t ks = (k + 31) / 32, groups = (m + AH_ROWS - 1) / AH_ROWS, blocks = (n + AH_COLS - 1) / AH_COLS;
    const size_t x_bytes = (size_t)(groups * ks * AH_TILE);
    const size_t parts = float_x ? 3 : x_split ? 2 : 1;
    uint32_t *bh = aligned_alloc(64, x_bytes * parts);
    if (!bh) return -3;
    uint32_t *bl = x_split ? bh + x_bytes / 4 : NULL, *bl2 = float_x ? bh + 2 * (x_bytes / 4) : NULL;
    ah_pack_x(float_x ? AH_X_F32 : dtype, x, m, k, ks, 0, groups * ks, bh, bl, bl2);
    /* whole 32-input steps whose weights are read in place (bfloat16, full blocks) */
    const int64_t full_steps = k / 32;
    /* groups of x rows whose B tiles (about AH_SWEEP_BYTES, in L2) pass over a block's weights before the next
     * block's: at least one pass (AH_GROUPS groups); the weights are read once per sweep */
    const int64_t pass_bytes = AH_GROUPS * ks * AH_TILE * (int64_t)parts;
    const int64_t sweep_groups = AH_GROUPS * (pass_bytes >= AH_SWEEP_BYTES ? 1 : AH_SWEEP_BYTES / pass_bytes);
#pragma omp parallel if (n * k >= (1 << 15))
    {
        ah_configure();
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = blocks * id / threads, hi = blocks * (id + 1) / threads;
        uint16_t a_hi[AH_COLS * 32] __attribute__((aligned(64))), a_lo[AH_COLS * 32] __attribute__((aligned(64)));
        float result[AH_GROUPS][AH_COLS * AH_ROWS] __attribute__((aligned(64)));
        for (int64_t sweep = 0; sweep < groups; sweep += sweep_groups) {
            for (int64_t t = lo; t < hi; t++) {
                const int64_t o0 = t * AH_COLS, outs = n - o0 < AH_COLS ? n - o0 : AH_COLS;
                const int in_place = !split && outs == AH_COLS;
                const uint16_t *next =
                    AH_PF && t + 1 < hi && n - o0 - AH_COLS >= AH_COLS ? w + (o0 + AH_COLS) * k : NULL;
                for (int64_t p0 = sweep; p0 < groups && p0 < sweep + sweep_groups; p0 += AH_GROUPS) {
                    const int count = groups - p0 < AH_GROUPS ? (int)(groups - p0) : AH_GROUPS;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < ks; s++) {
                        if (next && p0 == sweep)
#pragma GCC unroll 16
                            for (int o = 0; o < AH_COLS; o++)
                                _mm_prefetch((const char *)(next + o * k + 32 * s), AH_PF_HINT);
                        if (in_place && s < full_steps) {
                            _tile_loadd(4, w + o0 * k + 32 * s, k * 2);
                        } else {
                            ah_weight_tile(dtype, w, n, k, o0, s, a_hi, a_lo);
                            _tile_loadd(4, a_hi, 64);
                            if (split) _tile_loadd(7, a_lo, 64);
                        }
                        AH_PRODUCT(0);
                        if (count > 1) AH_PRODUCT(1);
                        if (count > 2) AH_PRODUCT(2);
                        if (count > 3) AH_PRODUCT(3);
                    }
                    _tile_stored(0, result[0], 64);
                    if (count > 1) _tile_stored(1, result[1], 64);
                    if (count > 2) _tile_stored(2, result[2], 64);
                    if (count > 3) _tile_stored(3, result[3], 64);
                    __m512 b = _mm512_setzero_ps();
                    if (bias) {
                        const __mmask16 valid = (__mmask16)((1u << outs) - 1);
                        const __m256i bits = _mm256_maskz_loadu_epi16(valid, (const uint16_t *)bias + o0);
                        b = float_x            ? _mm512_maskz_loadu_ps(valid, (const float *)bias + o0)
                            : dtype == AH_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))
                                               : _mm512_cvtph_ps(bits);
                    }
                    for (int g = 0; g < count; g++)
                        ah_store_rows(result[g], b, (p0 + g) * AH_ROWS, m, o0, outs, n, dtype, out, out_float);
                }
            }
        }
        _tile_release();
    }
    free(bh);
    return 0;
}

int amx_half_linear(int dtype, const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    const uint16_t *bias, void *out, int out_float) {
    return ah_linear(dtype, 0, x, m, k, w, n, bias, out, out_float);
}

/* float32 x [m][k] against a 16-bit w [n][k] (dtype 0 bfloat16, 1 float16), float32 bias [n] or NULL, float32
 * out [m][n] (half_linear.c's half_weight_linear on the tiles). x is split exactly into three bfloat16 parts
 * (ah_split3_float; parts below 2^-126 flushed by the tiles), a float16 w exactly into two as above; products
 * exact in float32, summed in float32: bfloat16 w: w hi + w mid + w lo, 3 a pair; float16 w: the 6 products
 * but w's low part times x's low part (|w_lo| < 2^-7 |w|, |x_lo| < 2^-15 |x|: each dropped term < 2^-22 |x w|),
 * 5 a pair. out_float must be 1 (the argument makes the signature amx_half_linear's, for the replay's
 * half_linear_at entry); else -2. */
int amx_half_weight_linear(int dtype, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                           const float *bias, float *out, int out_float) {
    if (!out_float) return -2;
    return ah_linear(dtype, 1, x, m, k, w, n, bias, out, 1);
}
#else
int amx_half_linear(int dtype, const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    const uint16_t *bias, void *out, int out_float) {
    (void)dtype, (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)out_float, (void)ah_granted;
    return -4;
}
int amx_half_weight_linear(int dtype, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                           const float *bias, float *out, int out_float) {
    (void)dtype, (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)out_float;
    return -4;
}
#endif
