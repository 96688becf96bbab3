/* quant_dot: y = x W^T for float32 activations x and raw llama.cpp blocks W, without a float copy of W.
 *
 * The way llama.cpp's ggml-cpu multiplies quantized weights (ggml_vec_dot_q4_0_q8_0 and friends):
 * each row of x is first quantized per block of 32 to int8 with a float32 scale (quantize_row_q8_0:
 * d = max|x| / 127, q = round-half-even(x * 127 / max|x|)), then every output is a sum over blocks of
 * integer dot products of weight levels with those int8 values, scaled by the weight's and the
 * activation's block scales. The weights' bytes are read once, straight from the GGUF layout (rows of
 * blocks, uint8 [out, row_bytes]); nothing is repacked.
 *
 * AVX-512 VNNI: one 64-byte vector holds 64 weight levels as unsigned bytes (two blocks of 32 for the
 * legacy types, two sub-blocks of a K-quant super-block), _mm512_dpbusd_epi32 multiplies them with 64
 * int8 activations into 16 int32 lanes (4 products each, exact), lanes 0-7 belong to the first block
 * of 32 and 8-15 to the second. Signed levels are stored with an offset (Q4_0: q + 8, Q5_0: q + 16,
 * Q6_K: q + 32; Q8_0's int8 is xor-ed with 0x80, i.e. q + 128), so the unsigned-by-signed product
 * needs no sign trick: the offset times the activations' sum is subtracted by starting the dpbusd
 * accumulator at -offset * (sum of the lane's 4 activations), computed once per activation row. Then
 *     acc += (float(lanes) * dx) * dw            (dx, dw: the blocks' activation and weight scales)
 *     acc += m * (dx * sum of the block's int8)  (types with a min: Q4_1, Q5_1 per block; Q4_K, Q5_K
 *                                                 once per super-block, their 8 sub-blocks in 8 lanes)
 * and each output is the sum of acc's 16 lanes. Every output of every row takes exactly these
 * operations in this order, whatever the number of rows, tile or thread: a row's result never
 * depends on the rows batched with it.
 *
 * AVX2 (CPUs without AVX-512 VNNI): the same records and arithmetic in 256-bit halves (8 lanes, one
 * block of 32 each), with _mm256_dpbusd_avx_epi32 (AVX-VNNI) or vpmaddubsw + vpmaddwd; there Q8_0
 * multiplies |w| by x with w's sign instead (the offset form would saturate vpmaddubsw's 16-bit sums).
 *
 * Rows: up to QD_TILE_MAX = 8 rows of x share each decoded weight vector (kept in registers while it
 * is multiplied into every row's accumulator), and a tile takes 2 or 4 outputs at once (AVX-512; AVX2
 * 2 outputs for one row); more rows take several passes over the weight (from cache).
 * Threads (OpenMP, torch's thread count) split the outputs into contiguous ranges, so each reads its
 * own stretch of the weight once per pass.
 *
 * Activation quantization, as the torch reference pluginfer.quant.ggml_blocks.quantize_activations
 * does, bit for bit: a block whose max|x| is 0, or so small that 127 / max|x| overflows float32
 * (below ~3.7e-37), is all zeros with scale 0; a block holding a NaN or an infinity gets a NaN scale
 * (and zero levels), so every output of its row is NaN.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define QD_AVX512 1
#define QD_TILE_MAX 8 /* rows per tile: 8 rows x 2 outputs of accumulators */
#include <immintrin.h>
#include "q8_block_avx512.h"
#include "sum_tree_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QD_AVX2 1
#define QD_TILE_MAX 8 /* 16 ymm registers */
#include <immintrin.h>
#endif

/* Q8_0's int8 levels xor 0x80 are levels + 128 (unsigned) for dpbusd; without VNNI, the pairwise
 * 16-bit sums of vpmaddubsw would saturate at 255 * 127 * 2, so AVX2 without AVX-VNNI multiplies
 * |w| by x with w's sign (llama.cpp's mul_sum_i8_pairs), offset 0. */
#if defined(QD_AVX2) && !defined(__AVXVNNI__)
#define QD_Q8_OFFSET 0
#define QD_Q8_SIGNED 1
#else
#define QD_Q8_OFFSET 128
#define QD_Q8_SIGNED 0
#endif

enum { QD_Q4_0 = 2, QD_Q4_1 = 3, QD_Q5_0 = 6, QD_Q5_1 = 7, QD_Q8_0 = 8, QD_Q4_K = 12, QD_Q5_K = 13, QD_Q6_K = 14 };

#define QD_TILE_ROWS 16
#ifndef QD_PREFETCH
#define QD_PREFETCH 8192 /* bytes ahead of each weight row's current unit: memory parallelism for one core */
#endif
#define q4_0_UNIT_BYTES 36 /* bytes of weight a unit of the tile loop reads: two blocks, or a super-block */
#define q4_1_UNIT_BYTES 40
#define q5_0_UNIT_BYTES 44
#define q5_1_UNIT_BYTES 48
#define q8_0_UNIT_BYTES 68
#define q4_k_UNIT_BYTES 144
#define q5_k_UNIT_BYTES 176
#define q6_k_UNIT_BYTES 210

/* Weights per block and bytes per block of the types handled; 0 for any other type. */
static int qd_block(int type, int64_t *weights, int64_t *bytes) {
    switch (type) {
    case QD_Q4_0: *weights = 32; *bytes = 18; return 1;
    case QD_Q4_1: *weights = 32; *bytes = 20; return 1;
    case QD_Q5_0: *weights = 32; *bytes = 22; return 1;
    case QD_Q5_1: *weights = 32; *bytes = 24; return 1;
    case QD_Q8_0: *weights = 32; *bytes = 34; return 1;
    case QD_Q4_K: *weights = 256; *bytes = 144; return 1;
    case QD_Q5_K: *weights = 256; *bytes = 176; return 1;
    case QD_Q6_K: *weights = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

/* The offset added to signed levels (0 for the types with a min) and whether the type has a min. */
static int qd_offset(int type) {
    switch (type) {
    case QD_Q4_0: return 8;
    case QD_Q5_0: return 16;
    case QD_Q8_0: return QD_Q8_OFFSET;
    case QD_Q6_K: return 32;
    default: return 0;
    }
}

/* Whether the type has a min: 0 no, 1 per block of 32 applied per vector (Q4_1, Q5_1), 2 per
 * sub-block applied once per super-block (Q4_K, Q5_K). */
static int qd_has_min(int type) {
    return type == QD_Q4_1 || type == QD_Q5_1 ? 1 : type == QD_Q4_K || type == QD_Q5_K ? 2 : 0;
}

int quant_dot_max_threads(void) { return omp_get_max_threads(); }

/* The quantized activations, in records of 64 activations: for vector v (activations 64v .. 64v + 63)
 * of a row, QD_RECORD(offset, has_min) bytes:
 *   x     int8 [64]     the levels (zeros past k)
 *   dxv   float [16]    each lane's block scale (lane = 4 consecutive activations; zero past k)
 *   corr  int32 [16]    -offset * (sum of the lane's 4 levels), the dpbusd starting value (types with an offset)
 *   cs    float [16]    types with a min: the blocks' scale * (sum of their levels); per vector (has_min 1)
 *                       in lanes 0 and 8 (its two blocks), other lanes 0; per super-block (has_min 2) in
 *                       the record of the super-block's first vector, lanes 0-7 (its 8 blocks), 8-15 0
 * Rows come in groups of up to QD_TILE_ROWS: a group holds vector 0 of each of its rows, then vector
 * 1 of each, ..., so the rows a tile multiplies at one step are adjacent (one pointer, constant
 * offsets). AVX2 reads each record as two halves of 32 activations, one block each. On AVX-512, Q4_K and
 * Q5_K records hold a super-block's blocks in the order 0 2 | 1 3 | 4 6 | 5 7 (k4_pair; cs stays by block). */
#define QD_RECORD(offset, has_min) (64 * (2 + ((offset) != 0) + ((has_min) != 0)))

#if defined(QD_AVX512) || defined(QD_AVX2)
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* R rows of activations (a group's records from its row r0: vector v of row r0 + r at act + v * vstride
 * + r * QD_RECORD) x O output rows of weights (row_bytes apart); out[r * ldo + o]. */
typedef void (*qd_tile)(const uint8_t *row, int64_t row_bytes, int64_t units, int64_t nb, const uint8_t *act,
                        int64_t vstride, float *out, int64_t ldo, int64_t count);

/* T##_tile_##R##x##O: count groups of O output rows, each by T##_one_##R##x##O (the instruction set's tile). */
#define QD_TILE_GROUPS(T, R, O)                                                                              \
    static void T##_tile_##R##x##O(const uint8_t *row, int64_t row_bytes, int64_t units, int64_t nb,         \
                                   const uint8_t *act, int64_t vstride, float *out, int64_t ldo,           \
                                   int64_t count) {                                                         \
        for (int64_t g = 0; g < count; g++)                                                                 \
            T##_one_##R##x##O(row + g * O * row_bytes, row_bytes, units, nb, act, vstride, out + g * O, ldo);  \
    }

#endif

#if defined(QD_AVX512)
/* 1: AVX-512 VNNI, 2: AVX2 with AVX-VNNI, 3: AVX2 (vpmaddubsw), 0: no kernel (the caller dequantizes). */
int quant_dot_supported(void) { return 1; }

/* Row x [k] into its records, vector v's at base + v * vstride. */
static void quantize_row(const float *x, int64_t k, uint8_t *base, int64_t vstride, int offset, int has_min) {
    const int64_t nb = k / 32, nv = (k + 63) / 64;
    const int cs_at = offset ? 192 : 128;
    for (int64_t b = 0; b < 2 * nv; b++) {
        /* Q4_K / Q5_K (has_min 2): a super-block's vector j holds sub-blocks k4_pair(j) and + 2 (k4_levels) */
        const int64_t at = has_min == 2 ? (b & ~(int64_t)7) | (b & 4) | ((b & 1) << 1) | ((b >> 1) & 1) : b;
        uint8_t *record = base + (at / 2) * vstride;
        const int half = (int)(at % 2);
        float *dxv = (float *)(record + 64) + 8 * half, *cs = (float *)(record + cs_at) + 8 * half;
        if (b >= nb) { /* padding: contributes exact zeros */
            memset(record + 32 * half, 0, 32);
            _mm256_storeu_ps(dxv, _mm256_setzero_ps());
            if (has_min == 1) _mm256_storeu_ps(cs, _mm256_setzero_ps());
            continue;
        }
        __m128i q0, q1;
        int32_t sum;
        const float d = q8_block_avx512(x + 32 * b, &q0, &q1, &sum);
        _mm_storeu_si128((__m128i *)(record + 32 * half), q0);
        _mm_storeu_si128((__m128i *)(record + 32 * half + 16), q1);
        _mm256_storeu_ps(dxv, _mm256_set1_ps(d));
        if (has_min == 1) {
            _mm256_storeu_ps(cs, _mm256_setzero_ps());
            cs[0] = d * (float)sum;
        } else if (has_min == 2) {
            float *unit = (float *)(base + (b / 8) * 4 * vstride + cs_at);
            if (b % 8 == 0) _mm512_storeu_ps(unit, _mm512_setzero_ps());
            unit[b % 8] = d * (float)sum;
        }
    }
    if (offset) {
        const __m512i off = _mm512_set1_epi8((char)offset);
        for (int64_t v = 0; v < nv; v++) {
            uint8_t *record = base + v * vstride;
            const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, _mm512_load_si512(record));
            _mm512_store_si512(record + 128, _mm512_sub_epi32(_mm512_setzero_si512(), lanes));
        }
    }
}

static inline __m512 pair_ps(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }

/* Each type: a unit of VPU vectors (one vector = 64 weights) prepared once, then decoded vector by
 * vector into levels w (unsigned bytes), the lanes' weight scales sv and mins mv. */
typedef struct {
    __m512i w;
    __m512 sv, mv;
} unit32;

/* The legacy types' unit is two blocks of SIZE bytes (the second absent, read as zeros, when the
 * row has an odd number of blocks): one masked load of both, then byte permutes (AVX-512 VBMI) pick
 * the nibbles, the fp16 scale and min of each lane, and the high-bit bytes. Tables, for output byte i:
 *   nibbles  block i / 32, its byte QS + i % 16 (low nibbles for i % 32 < 16, high ones after a shift)
 *   scales   16 fp16 lanes (bytes 0-31): 8 of block a's scale, 8 of block b's; mins likewise
 *   high     the qh byte holding weight i % 32's fifth bit, tested against bit (i % 8) */
#define QD_R8(F, o) F(o + 0), F(o + 1), F(o + 2), F(o + 3), F(o + 4), F(o + 5), F(o + 6), F(o + 7)
#define QD_R64(F) QD_R8(F, 0), QD_R8(F, 8), QD_R8(F, 16), QD_R8(F, 24), QD_R8(F, 32), QD_R8(F, 40), QD_R8(F, 48), QD_R8(F, 56)
#define QD_NIBBLE(size, qs, i) ((i) / 32 * (size) + (qs) + (i) % 32 % 16)
#define QD_HALF(size, at, i) ((i) / 16 % 2 * (size) + (at) + (i) % 2)
#define QD_HIGH(size, qh, i) ((i) / 32 * (size) + (qh) + (i) % 32 / 8)
#define QD_BIT(i) (1 << ((i) % 8))
#define QD_TABLE(NAME, F) static const uint8_t NAME[64] __attribute__((aligned(64))) = {QD_R64(F)};

#define Q4_0_NIB(i) QD_NIBBLE(18, 2, i)
#define Q4_0_SC(i) QD_HALF(18, 0, i)
#define Q4_1_NIB(i) QD_NIBBLE(20, 4, i)
#define Q4_1_SC(i) QD_HALF(20, 0, i)
#define Q4_1_MN(i) QD_HALF(20, 2, i)
#define Q5_0_NIB(i) QD_NIBBLE(22, 6, i)
#define Q5_0_SC(i) QD_HALF(22, 0, i)
#define Q5_0_HI(i) QD_HIGH(22, 2, i)
#define Q5_1_NIB(i) QD_NIBBLE(24, 8, i)
#define Q5_1_SC(i) QD_HALF(24, 0, i)
#define Q5_1_MN(i) QD_HALF(24, 2, i)
#define Q5_1_HI(i) QD_HIGH(24, 4, i)
#define Q8_0_SC(i) QD_HALF(34, 0, i)
QD_TABLE(q4_0_nib, Q4_0_NIB)
QD_TABLE(q4_0_sc, Q4_0_SC)
QD_TABLE(q4_1_nib, Q4_1_NIB)
QD_TABLE(q4_1_sc, Q4_1_SC)
QD_TABLE(q4_1_mn, Q4_1_MN)
QD_TABLE(q5_0_nib, Q5_0_NIB)
QD_TABLE(q5_0_sc, Q5_0_SC)
QD_TABLE(q5_0_hi, Q5_0_HI)
QD_TABLE(q5_1_nib, Q5_1_NIB)
QD_TABLE(q5_1_sc, Q5_1_SC)
QD_TABLE(q5_1_mn, Q5_1_MN)
QD_TABLE(q5_1_hi, Q5_1_HI)
QD_TABLE(q8_0_sc, Q8_0_SC)
QD_TABLE(fifth_bit, QD_BIT)

#if defined(__AVX512VBMI__)
#define QD_PERMUTE_BYTES(table, v) _mm512_permutexvar_epi8(_mm512_load_si512(table), (v))
#else /* the same byte gather without VBMI, through memory (slower) */
static inline __m512i qd_permute_bytes(const uint8_t *table, __m512i v) {
    uint8_t in[64], out[64];
    _mm512_storeu_si512(in, v);
    for (int i = 0; i < 64; i++) out[i] = in[table[i]];
    return _mm512_loadu_si512(out);
}
#define QD_PERMUTE_BYTES(table, v) qd_permute_bytes((table), (v))
#endif

static inline __m512i legacy_load(const uint8_t *a, int size, int has_b) {
    const __mmask64 mask = ((__mmask64)1 << (has_b ? 2 * size : size)) - 1;
    return _mm512_maskz_loadu_epi8(mask, a);
}

static inline __m512i legacy_nibbles(const uint8_t *table, __m512i v) {
    const __m512i z = QD_PERMUTE_BYTES(table, v);
    return _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xF0F0, z, 4), _mm512_set1_epi8(0x0F));
}

static inline __m512 legacy_half(const uint8_t *table, __m512i v) {
    return _mm512_cvtph_ps(_mm512_castsi512_si256(QD_PERMUTE_BYTES(table, v)));
}

static inline __m512i legacy_fifth_bits(const uint8_t *table, __m512i v) {
    const __mmask64 set = _mm512_test_epi8_mask(QD_PERMUTE_BYTES(table, v), _mm512_load_si512(fifth_bit));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
}

#define LEGACY_PREP(NAME, SIZE, BODY)                                                                         \
    static inline void NAME##_prep(unit32 *U, const uint8_t *row, int64_t u, int64_t nb) {                     \
        const uint8_t *a = row + 2 * u * (SIZE);                                                               \
        const int has_b = 2 * u + 1 < nb;                                                                      \
        BODY                                                                                                   \
    }                                                                                                          \
    static inline void NAME##_decode(const unit32 *U, int j, __m512i *w, __m512 *sv, __m512 *mv) {            \
        (void)j;                                                                                               \
        *w = U->w;                                                                                             \
        *sv = U->sv;                                                                                           \
        *mv = U->mv;                                                                                           \
    }

LEGACY_PREP(q4_0, 18, {
    const __m512i v = legacy_load(a, 18, has_b);
    U->w = legacy_nibbles(q4_0_nib, v);
    U->sv = legacy_half(q4_0_sc, v);
    U->mv = _mm512_setzero_ps();
})

LEGACY_PREP(q4_1, 20, {
    const __m512i v = legacy_load(a, 20, has_b);
    U->w = legacy_nibbles(q4_1_nib, v);
    U->sv = legacy_half(q4_1_sc, v);
    U->mv = legacy_half(q4_1_mn, v);
})

LEGACY_PREP(q5_0, 22, {
    const __m512i v = legacy_load(a, 22, has_b);
    U->w = _mm512_or_si512(legacy_nibbles(q5_0_nib, v), legacy_fifth_bits(q5_0_hi, v));
    U->sv = legacy_half(q5_0_sc, v);
    U->mv = _mm512_setzero_ps();
})

LEGACY_PREP(q5_1, 24, {
    const __m512i v = legacy_load(a, 24, has_b);
    U->w = _mm512_or_si512(legacy_nibbles(q5_1_nib, v), legacy_fifth_bits(q5_1_hi, v));
    U->sv = legacy_half(q5_1_sc, v);
    U->mv = legacy_half(q5_1_mn, v);
})

/* Q8_0: two blocks of 34 bytes do not fit one load; the scales come from a masked load of both. */
LEGACY_PREP(q8_0, 34, {
    const __m256i qa = _mm256_loadu_si256((const __m256i *)(a + 2));
    const __m256i qb = has_b ? _mm256_loadu_si256((const __m256i *)(a + 36)) : _mm256_setzero_si256();
    U->w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), _mm512_set1_epi8((char)0x80));
    U->sv = legacy_half(q8_0_sc, _mm512_maskz_loadu_epi8(has_b ? (3ull << 34) | 3ull : 3ull, a));
    U->mv = _mm512_setzero_ps();
})

static inline __m512 no_mins(const void *U) {
    (void)U;
    return _mm512_setzero_ps();
}
#define q4_0_mins no_mins
#define q4_1_mins no_mins
#define q5_0_mins no_mins
#define q5_1_mins no_mins
#define q8_0_mins no_mins
#define q6_k_mins no_mins

#define q4_0_VPU 1
#define q4_1_VPU 1
#define q5_0_VPU 1
#define q5_1_VPU 1
#define q8_0_VPU 1
#define q4_0_UNIT unit32
#define q4_1_UNIT unit32
#define q5_0_UNIT unit32
#define q5_1_UNIT unit32
#define q8_0_UNIT unit32

/* Q4_K / Q5_K: 256 weights, 8 sub-blocks of 32 with 6-bit scales and mins (get_scale_min_k4); sub-block
 * 2i is the low nibbles of qs[32i .. 32i + 31], 2i + 1 their high nibbles; vector j holds k4_pair(j). */
typedef struct {
    const uint8_t *qs, *qh;
    __m512 sm; /* lanes 0-7: d * scale of sub-block 0-7; lanes 8-15: -(dmin * min) */
} unit_k4;

/* get_scale_min_k4 for all 8 sub-blocks at once, in vector registers: bytes 0-7 the scales, 8-15 the mins.
 * With q the 12 bytes: i < 4: scale q[i] & 63, min q[i + 4] & 63; i >= 4: scale (q[i + 4] & 15) |
 * (q[i - 4] >> 6) << 4, min (q[i + 4] >> 4) | (q[i] >> 6) << 4. One shuffle gathers the low parts' bytes,
 * another the high bits' (zeros where there are none); (x >> 6) << 4 is (x >> 2) & 0x30. */
static inline void k4_scales(unit_k4 *U, const uint8_t *b) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4)); /* the 12 bytes, then 4 of qs (unused) */
    const __m128i lo = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i hi = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_mask_blend_epi8(
        0xF000, _mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_set1_epi8(15)));
    const __m128i fields = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
    /* lanes 0-7 d, 8-15 -dmin (the sign flipped exactly) */
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u32_at(b)));
    const __m512 dd = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                  _mm512_castps128_ps512(dm))),
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                          INT32_MIN, INT32_MIN)));
    U->sm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(fields)), dd);
}

static inline void q4_k_prep(unit_k4 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 144;
    k4_scales(U, b);
    U->qs = b + 16;
}

/* Vector j of a super-block holds sub-blocks k4_pair(j) = 4 (j / 2) + j % 2 (lanes 0-7) and k4_pair(j) + 2
 * (lanes 8-15): one 64-byte load of qs[64 (j / 2) ..] holds sub-blocks 4 (j / 2) and + 2 in its low
 * nibbles, + 1 and + 3 in its high ones (the activations' records are laid out in this order by
 * quantize_row), so a vector takes a load, an and, and for odd j a shift. */
static inline int k4_pair(int j) { return 4 * (j / 2) + j % 2; }

static inline __m512i k4_levels(const uint8_t *qs, int j) {
    const __m512i q = _mm512_loadu_si512(qs + 64 * (j / 2));
    return _mm512_and_si512(j % 2 ? _mm512_srli_epi16(q, 4) : q, _mm512_set1_epi8(0x0F));
}

/* Lanes of sub-blocks k4_pair(j) (0-7) and k4_pair(j) + 2 (8-15): their scales. The mins apply once per
 * super-block (k4_mins: lanes 0-7, against the activation record's per-sub-block sums). */
static inline void k4_lanes(const unit_k4 *U, int j, __m512 *sv, __m512 *mv) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                                         _mm512_set1_epi32(k4_pair(j)));
    *sv = _mm512_permutexvar_ps(idx, U->sm);
    *mv = _mm512_setzero_ps();
}

static inline __m512 k4_mins(const unit_k4 *U) {
    return _mm512_maskz_permutexvar_ps(0x00FF, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0),
                                       U->sm);
}
#define q4_k_mins k4_mins
#define q5_k_mins k4_mins

static inline void q4_k_decode(const unit_k4 *U, int j, __m512i *w, __m512 *sv, __m512 *mv) {
    *w = k4_levels(U->qs, j);
    k4_lanes(U, j, sv, mv);
}

static inline void q5_k_prep(unit_k4 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 176;
    k4_scales(U, b);
    U->qh = b + 16;
    U->qs = b + 48;
}

/* Q5_K: weight i of sub-block s has its fifth bit at bit s of qh[i]. */
static inline void q5_k_decode(const unit_k4 *U, int j, __m512i *w, __m512 *sv, __m512 *mv) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)U->qh);
    const uint64_t high = (uint64_t)_mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1 << k4_pair(j)))) |
                          (uint64_t)_mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1 << (k4_pair(j) + 2)))) << 32;
    *w = _mm512_or_si512(k4_levels(U->qs, j), _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
    k4_lanes(U, j, sv, mv);
}

/* Q6_K: 256 weights in two halves of 128 (ql 64 bytes, qh 32 bytes each); vector j = 2h + p covers
 * weights 64j .. 64j + 63: low nibbles (p = 0) or high nibbles (p = 1) of ql[64h ..], high bit pairs
 * 2p and 2p + 1 of qh[32h ..]; 16 int8 scales, one per 16 weights (4 lanes). */
typedef struct {
    const uint8_t *ql, *qh;
    __m512 scales;
} unit_k6;

static inline void q6_k_prep(unit_k6 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 210;
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
    U->scales = _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)), _mm512_cvtepi32_ps(sc));
    U->ql = b;
    U->qh = b + 128;
}

static inline void q6_k_decode(const unit_k6 *U, int j, __m512i *w, __m512 *sv, __m512 *mv) {
    const int h = j / 2, p = j % 2;
    const __m512i l = _mm512_loadu_si512(U->ql + 64 * h);
    /* qh's 32 bytes in both halves; bit pair 2p (first half) and 2p + 1 (second) shifted to bits 4-5 of
     * each byte (a shift of whole 64-bit lanes: the and drops what crosses from the neighbour bytes) */
    const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(U->qh + 32 * h)));
    const __m512i hh = p == 0 ? _mm512_sllv_epi64(q, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2))
                              : _mm512_srlv_epi64(q, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2));
    /* 0x0F ? low nibbles : hh & 0x30, one ternary logic (0xE4: c ? a : b) */
    *w = _mm512_ternarylogic_epi32(p == 0 ? l : _mm512_srli_epi16(l, 4), _mm512_and_si512(hh, _mm512_set1_epi8(0x30)),
                                   _mm512_set1_epi8(0x0F), 0xE4);
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                         _mm512_set1_epi32(4 * j));
    *sv = _mm512_permutexvar_ps(idx, U->scales);
    *mv = _mm512_setzero_ps();
}

#define q4_k_VPU 4
#define q5_k_VPU 4
#define q6_k_VPU 4
#define q4_k_UNIT unit_k4
#define q5_k_UNIT unit_k4
#define q6_k_UNIT unit_k6


/* Outputs per tile: 1-2 rows read four weight streams at once (memory parallelism); 3-8 rows two,
 * sharing each row's activation loads between them (16 rows: 1.7 -> 1.45 ms for a 5632 x 1024 Q4_0
 * linear on one core, against 16 rows x 1 output). */
#define QD_OUTS(R) ((R) <= 2 ? 4 : 2)

/* The sum of a vector's 16 lanes by one fixed tree (sum_tree_avx512.h: halves of 256 bits, of 128, then lanes
 * (0 + 2, 1 + 3), then 0 + 1, the tree of GCC's _mm512_reduce_add_ps). qd_sum4 sums four vectors by the same tree at
 * once (one set of shuffles and adds for the four; a 1-row tile's outputs, k of one super-block: ~10 % of
 * the work per output was its sum), so every output gets the same bits whichever tile it fell in. */
#define qd_sum sum_tree_avx512
#define qd_sum4 sum_tree4_avx512

#define QD_TILE(T, OFFSET, MIN, R, O)                                                                        \
    static inline __attribute__((always_inline)) void T##_one_##R##x##O(                                   \
        const uint8_t *row, int64_t row_bytes, int64_t units, int64_t nb, const uint8_t *act, int64_t vstride,  \
        float *out, int64_t ldo) {                                                                          \
        enum { REC = QD_RECORD(OFFSET, MIN), CS_AT = (OFFSET) ? 192 : 128 };                                \
        __m512 acc[R][O];                                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                \
            _Pragma("GCC unroll 4") for (int o = 0; o < O; o++) acc[r][o] = _mm512_setzero_ps();            \
        for (int64_t u = 0; u < units; u++) {                                                               \
            T##_UNIT U[O];                                                                                  \
            _Pragma("GCC unroll 4") for (int o = 0; o < O; o++) {                                           \
                for (int line = 0; line < T##_UNIT_BYTES; line += 64)                                        \
                    _mm_prefetch((const char *)(row + o * row_bytes + u * T##_UNIT_BYTES) + QD_PREFETCH + line, \
                                 _MM_HINT_T0);                                                              \
                T##_prep(&U[o], row + o * row_bytes, u, nb);                                                \
            }                                                                                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < T##_VPU; j++) {                                     \
                const int64_t v = u * T##_VPU + j;                                                          \
                __m512i w[O];                                                                               \
                __m512 sv[O], mv[O];                                                                        \
                _Pragma("GCC unroll 4") for (int o = 0; o < O; o++) T##_decode(&U[o], j, &w[o], &sv[o], &mv[o]); \
                const uint8_t *record = act + v * vstride;                                                  \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                      \
                    const uint8_t *a = record + r * REC;                                                    \
                    const __m512i x = _mm512_load_si512(a);                                                 \
                    const __m512 dx = _mm512_load_ps((const float *)(a + 64));                              \
                    const __m512i c = (OFFSET) ? _mm512_load_si512(a + 128) : _mm512_setzero_si512();       \
                    const __m512 cs = (MIN) == 1 ? _mm512_load_ps((const float *)(a + CS_AT)) : _mm512_setzero_ps(); \
                    _Pragma("GCC unroll 4") for (int o = 0; o < O; o++) {                                   \
                        const __m512i s = _mm512_dpbusd_epi32(c, w[o], x);                                  \
                        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dx);                          \
                        acc[r][o] = _mm512_fmadd_ps(t, sv[o], acc[r][o]);                                   \
                        if ((MIN) == 1) acc[r][o] = _mm512_fmadd_ps(mv[o], cs, acc[r][o]);                  \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            if ((MIN) == 2) {                                                                               \
                const uint8_t *record = act + u * T##_VPU * vstride;                                        \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                      \
                    const __m512 cs = _mm512_load_ps((const float *)(record + r * REC + CS_AT));            \
                    _Pragma("GCC unroll 4") for (int o = 0; o < O; o++)                                     \
                        acc[r][o] = _mm512_fmadd_ps(T##_mins(&U[o]), cs, acc[r][o]);                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                \
            if (O == 4)                                                                                     \
                qd_sum4(acc[r][0], acc[r][O > 1], acc[r][O > 2 ? 2 : 0], acc[r][O > 3 ? 3 : 0], out + r * ldo); \
            else                                                                                            \
                _Pragma("GCC unroll 4") for (int o = 0; o < O; o++) out[r * ldo + o] = qd_sum(acc[r][o]);   \
    } \
    QD_TILE_GROUPS(T, R, O)

#define QD_TILES(T, OFFSET, MIN)                                                                             \
    QD_TILE(T, OFFSET, MIN, 1, 4) QD_TILE(T, OFFSET, MIN, 2, 4) QD_TILE(T, OFFSET, MIN, 3, 2)                \
    QD_TILE(T, OFFSET, MIN, 4, 2) QD_TILE(T, OFFSET, MIN, 5, 2) QD_TILE(T, OFFSET, MIN, 6, 2)                \
    QD_TILE(T, OFFSET, MIN, 7, 2) QD_TILE(T, OFFSET, MIN, 8, 2)                                              \
    QD_TILE(T, OFFSET, MIN, 1, 1) QD_TILE(T, OFFSET, MIN, 2, 1) QD_TILE(T, OFFSET, MIN, 3, 1)                \
    QD_TILE(T, OFFSET, MIN, 4, 1) QD_TILE(T, OFFSET, MIN, 5, 1) QD_TILE(T, OFFSET, MIN, 6, 1)                \
    QD_TILE(T, OFFSET, MIN, 7, 1) QD_TILE(T, OFFSET, MIN, 8, 1)                                              \
    static const qd_tile T##_tiles[2][QD_TILE_ROWS + 1] = {                                                  \
        {0, T##_tile_1x1, T##_tile_2x1, T##_tile_3x1, T##_tile_4x1, T##_tile_5x1, T##_tile_6x1, T##_tile_7x1, \
         T##_tile_8x1},                                                                                      \
        {0, T##_tile_1x4, T##_tile_2x4, T##_tile_3x2, T##_tile_4x2, T##_tile_5x2, T##_tile_6x2, T##_tile_7x2, \
         T##_tile_8x2}};

QD_TILES(q4_0, 1, 0)
QD_TILES(q4_1, 0, 1)
QD_TILES(q5_0, 1, 0)
QD_TILES(q5_1, 0, 1)
QD_TILES(q8_0, 1, 0)
QD_TILES(q4_k, 0, 2)
QD_TILES(q5_k, 0, 2)
QD_TILES(q6_k, 1, 0)

typedef const qd_tile qd_tile_table[QD_TILE_ROWS + 1];

static const qd_tile_table *qd_tiles(int type) {
    switch (type) {
    case QD_Q4_0: return q4_0_tiles;
    case QD_Q4_1: return q4_1_tiles;
    case QD_Q5_0: return q5_0_tiles;
    case QD_Q5_1: return q5_1_tiles;
    case QD_Q8_0: return q8_0_tiles;
    case QD_Q4_K: return q4_k_tiles;
    case QD_Q5_K: return q5_k_tiles;
    case QD_Q6_K: return q6_k_tiles;
    default: return 0;
    }
}

#elif defined(QD_AVX2)
/* AVX2 (no AVX-512): the same records, algorithm and order of operations per 32 activations; a
 * 64-weight vector is two 256-bit halves, one block of 32 each. The integer dot products use AVX-VNNI
 * (_mm256_dpbusd_avx_epi32) where the compiler has it, else vpmaddubsw + vpmaddwd (every level below
 * 64, so the pairwise 16-bit sums never saturate; Q8_0 takes the sign trick). */
int quant_dot_supported(void) {
#if defined(__AVXVNNI__)
    return 2;
#else
    return 3;
#endif
}

static inline __m256i qd_dot(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* The sum of 8 lanes, one fixed tree for every output. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x[0..31] to int8 levels q and their sums (sum0: of the first 16, sum: all); returns the scale: the rounding
 * of q8_block_avx512.h, bit for bit. */
static inline float q8_block_avx2(const float *x, __m256i *q, int32_t *sum0, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], amax = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, v[i]);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, largest, _CMP_NLE_UQ)); /* an infinity or a NaN */
        amax = _mm256_max_ps(amax, a);
    }
    const float top = hmax8(amax);
    float d = top / 127.0f, id = top != 0.0f ? 127.0f / top : 0.0f;
    if (bad) {
        d = NAN;
        id = 0.0f;
    } else if (!(id <= FLT_MAX)) { /* max|x| below ~3.7e-37: the block counts as zeros */
        d = 0.0f;
        id = 0.0f;
    }
    __m256i l[4];
    for (int i = 0; i < 4; i++) {
        l[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (bad) l[i] = _mm256_setzero_si256();
    }
    *sum0 = hsum8_epi32(_mm256_add_epi32(l[0], l[1]));
    *sum = *sum0 + hsum8_epi32(_mm256_add_epi32(l[2], l[3]));
    /* int32 -> int8 in order: packs work within 128-bit lanes, the permute puts them back */
    const __m256i p16a = _mm256_packs_epi32(l[0], l[1]), p16b = _mm256_packs_epi32(l[2], l[3]);
    *q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return d;
}

/* Row x [k] into its records (the layout above), vector v's at base + v * vstride. */
static void quantize_row(const float *x, int64_t k, uint8_t *base, int64_t vstride, int offset, int has_min) {
    const int64_t nb = k / 32, nv = (k + 63) / 64;
    const int cs_at = offset ? 192 : 128;
    for (int64_t b = 0; b < 2 * nv; b++) {
        uint8_t *record = base + (b / 2) * vstride;
        const int half = (int)(b % 2);
        float *dxv = (float *)(record + 64) + 8 * half, *cs = (float *)(record + cs_at) + 8 * half;
        if (b >= nb) { /* padding: contributes exact zeros */
            memset(record + 32 * half, 0, 32);
            _mm256_storeu_ps(dxv, _mm256_setzero_ps());
            if (has_min == 1) _mm256_storeu_ps(cs, _mm256_setzero_ps());
            continue;
        }
        __m256i q;
        int32_t sum0, sum;
        const float d = q8_block_avx2(x + 32 * b, &q, &sum0, &sum);
        _mm256_storeu_si256((__m256i *)(record + 32 * half), q);
        _mm256_storeu_ps(dxv, _mm256_set1_ps(d));
        const float block_sum = d * (float)sum;
        if (has_min == 1) {
            _mm256_storeu_ps(cs, _mm256_setzero_ps());
            cs[0] = block_sum;
        } else if (has_min == 2) {
            float *unit = (float *)(base + (b / 8) * 4 * vstride + cs_at);
            if (b % 8 == 0) {
                _mm256_storeu_ps(unit, _mm256_setzero_ps());
                _mm256_storeu_ps(unit + 8, _mm256_setzero_ps());
            }
            unit[b % 8] = block_sum;
        }
    }
    if (offset) {
        const __m256i off = _mm256_set1_epi8((char)offset);
        for (int64_t v = 0; v < nv; v++) {
            uint8_t *record = base + v * vstride;
            for (int half = 0; half < 2; half++) {
                const __m256i lanes = qd_dot(_mm256_setzero_si256(), off, _mm256_load_si256((const __m256i *)(record + 32 * half)));
                _mm256_store_si256((__m256i *)(record + 128 + 32 * half), _mm256_sub_epi32(_mm256_setzero_si256(), lanes));
            }
        }
    }
}

/* Decoders: a unit's vector j as two halves h (32 weights each): levels w[h], weight scales sv[h] and
 * mins mv[h] (8 lanes of 4 weights). */
typedef struct {
    __m256i w[2];
    __m256 sv[2], mv[2];
} unit32;

static inline __m256i nibbles32(const uint8_t *qs) { /* 16 bytes: low nibbles then high nibbles */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256i fifth_bits32(const uint8_t *qh) { /* bit i of the 32-bit mask -> 0x10 in byte i */
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

#define LEGACY_PREP(NAME, SIZE, BODY)                                                                         \
    static inline void NAME##_prep(unit32 *U, const uint8_t *row, int64_t u, int64_t nb) {                     \
        for (int h = 0; h < 2; h++) {                                                                          \
            const uint8_t *b = row + (2 * u + h) * (SIZE);                                                     \
            if (2 * u + h >= nb) { /* the absent second block of an odd row */                                 \
                U->w[h] = _mm256_setzero_si256();                                                              \
                U->sv[h] = U->mv[h] = _mm256_setzero_ps();                                                     \
                continue;                                                                                      \
            }                                                                                                  \
            BODY                                                                                               \
        }                                                                                                      \
    }                                                                                                          \
    static inline void NAME##_decode(const unit32 *U, int j, __m256i *w, __m256 *sv, __m256 *mv) {            \
        (void)j;                                                                                               \
        for (int h = 0; h < 2; h++) {                                                                          \
            w[h] = U->w[h];                                                                                    \
            sv[h] = U->sv[h];                                                                                  \
            mv[h] = U->mv[h];                                                                                  \
        }                                                                                                      \
    }

LEGACY_PREP(q4_0, 18, {
    U->w[h] = nibbles32(b + 2);
    U->sv[h] = _mm256_set1_ps(h2f(b));
    U->mv[h] = _mm256_setzero_ps();
})

LEGACY_PREP(q4_1, 20, {
    U->w[h] = nibbles32(b + 4);
    U->sv[h] = _mm256_set1_ps(h2f(b));
    U->mv[h] = _mm256_set1_ps(h2f(b + 2));
})

LEGACY_PREP(q5_0, 22, {
    U->w[h] = _mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2));
    U->sv[h] = _mm256_set1_ps(h2f(b));
    U->mv[h] = _mm256_setzero_ps();
})

LEGACY_PREP(q5_1, 24, {
    U->w[h] = _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4));
    U->sv[h] = _mm256_set1_ps(h2f(b));
    U->mv[h] = _mm256_set1_ps(h2f(b + 2));
})

LEGACY_PREP(q8_0, 34, {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
    U->w[h] = QD_Q8_SIGNED ? q : _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    U->sv[h] = _mm256_set1_ps(h2f(b));
    U->mv[h] = _mm256_setzero_ps();
})

/* Q4_K / Q5_K: sub-blocks 2j + h; scales d * sc (8 lanes), mins -(dmin * m) applied per super-block. */
typedef struct {
    const uint8_t *qs, *qh;
    __m256 scales, mins;
} unit_k4;

static inline void k4_scales(unit_k4 *U, const uint8_t *b) {
    uint32_t q[4];
    memcpy(q, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    q[3] = ((q[2] >> 4) & low4) | (((q[1] >> 6) & low2) << 4);
    const uint32_t mins = q[1] & low6;
    q[1] = (q[2] & low4) | (((q[0] >> 6) & low2) << 4);
    q[2] = mins;
    q[0] &= low6;
    const __m128i fields = _mm_loadu_si128((const __m128i *)q);
    U->scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields)), _mm256_set1_ps(h2f(b)));
    U->mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8))),
                            _mm256_set1_ps(-h2f(b + 2)));
}

static inline void q4_k_prep(unit_k4 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 144;
    k4_scales(U, b);
    U->qs = b + 16;
    U->qh = 0;
}

static inline void q5_k_prep(unit_k4 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 176;
    k4_scales(U, b);
    U->qh = b + 16;
    U->qs = b + 48;
}

static inline void k4_decode(const unit_k4 *U, int j, int fifth, __m256i *w, __m256 *sv, __m256 *mv) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(U->qs + 32 * j)), low = _mm256_set1_epi8(0x0F);
    w[0] = _mm256_and_si256(q, low);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    if (fifth) { /* weight i of sub-block s: bit s of qh[i] */
        const __m256i h = _mm256_loadu_si256((const __m256i *)U->qh);
        for (int half = 0; half < 2; half++) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << (2 * j + half)));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
            w[half] = _mm256_or_si256(w[half], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
    }
    for (int half = 0; half < 2; half++) {
        sv[half] = _mm256_permutevar8x32_ps(U->scales, _mm256_set1_epi32(2 * j + half));
        mv[half] = _mm256_setzero_ps();
    }
}

static inline void q4_k_decode(const unit_k4 *U, int j, __m256i *w, __m256 *sv, __m256 *mv) { k4_decode(U, j, 0, w, sv, mv); }
static inline void q5_k_decode(const unit_k4 *U, int j, __m256i *w, __m256 *sv, __m256 *mv) { k4_decode(U, j, 1, w, sv, mv); }
static inline __m256 k4_mins(const unit_k4 *U) { return U->mins; }

/* Q6_K: as the AVX-512 decoder, by halves; scales d * sc, 16 of them, 4 lanes (16 weights) each. */
typedef struct {
    const uint8_t *ql, *qh;
    __m256 scales[2];
} unit_k6;

static inline void q6_k_prep(unit_k6 *U, const uint8_t *row, int64_t u, int64_t nb) {
    (void)nb;
    const uint8_t *b = row + u * 210;
    const __m256 d = _mm256_set1_ps(h2f(b + 208));
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    U->scales[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    U->scales[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    U->ql = b;
    U->qh = b + 128;
}

static inline void q6_k_decode(const unit_k6 *U, int j, __m256i *w, __m256 *sv, __m256 *mv) {
    const int part = j / 2, p = j % 2;
    const __m256i q = _mm256_loadu_si256((const __m256i *)(U->qh + 32 * part)), low = _mm256_set1_epi8(0x0F);
    for (int half = 0; half < 2; half++) {
        __m256i l = _mm256_loadu_si256((const __m256i *)(U->ql + 64 * part + 32 * half));
        if (p) l = _mm256_srli_epi16(l, 4);
        const __m256i hh = _mm256_srli_epi16(q, 4 * p + 2 * half); /* bit pair 2 (2p + half) of qh */
        w[half] = _mm256_or_si256(_mm256_and_si256(l, low),
                                  _mm256_slli_epi16(_mm256_and_si256(hh, _mm256_set1_epi8(3)), 4));
        const int first = 4 * j + 2 * half; /* its two sub-blocks of 16: scales first, first + 1 */
        sv[half] = _mm256_permutevar8x32_ps(U->scales[first / 8],
                                            _mm256_setr_epi32(first % 8, first % 8, first % 8, first % 8,
                                                              first % 8 + 1, first % 8 + 1, first % 8 + 1, first % 8 + 1));
        mv[half] = _mm256_setzero_ps();
    }
}

static inline __m256 no_mins(const void *U) {
    (void)U;
    return _mm256_setzero_ps();
}
#define q4_0_mins no_mins
#define q4_1_mins no_mins
#define q5_0_mins no_mins
#define q5_1_mins no_mins
#define q8_0_mins no_mins
#define q6_k_mins no_mins
#define q4_k_mins k4_mins
#define q5_k_mins k4_mins
#define q4_0_VPU 1
#define q4_1_VPU 1
#define q5_0_VPU 1
#define q5_1_VPU 1
#define q8_0_VPU 1
#define q4_k_VPU 4
#define q5_k_VPU 4
#define q6_k_VPU 4
#define q4_0_UNIT unit32
#define q4_1_UNIT unit32
#define q5_0_UNIT unit32
#define q5_1_UNIT unit32
#define q8_0_UNIT unit32
#define q4_k_UNIT unit_k4
#define q5_k_UNIT unit_k4
#define q6_k_UNIT unit_k6


#define QD_OUTS(R) ((R) == 1 ? 2 : 1)

/* As the AVX-512 tile, by halves: acc[r][o] += (float(dot) * dx) * sv (+ mv * cs). SIGNED (Q8_0
 * without VNNI): |w| times x with w's sign. */
#define QD_TILE(T, OFFSET, MIN, SIGNED, R, O)                                                                \
    static inline __attribute__((always_inline)) void T##_one_##R##x##O(                                   \
        const uint8_t *row, int64_t row_bytes, int64_t units, int64_t nb, const uint8_t *act, int64_t vstride,  \
        float *out, int64_t ldo) {                                                                          \
        enum { REC = QD_RECORD(OFFSET, MIN), CS_AT = (OFFSET) ? 192 : 128 };                                \
        __m256 acc[R][O];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                 \
            _Pragma("GCC unroll 2") for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();            \
        for (int64_t u = 0; u < units; u++) {                                                               \
            T##_UNIT U[O];                                                                                  \
            _Pragma("GCC unroll 2") for (int o = 0; o < O; o++) {                                           \
                for (int line = 0; line < T##_UNIT_BYTES; line += 64)                                        \
                    _mm_prefetch((const char *)(row + o * row_bytes + u * T##_UNIT_BYTES) + QD_PREFETCH + line, \
                                 _MM_HINT_T0);                                                              \
                T##_prep(&U[o], row + o * row_bytes, u, nb);                                                \
            }                                                                                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < T##_VPU; j++) {                                     \
                const int64_t v = u * T##_VPU + j;                                                          \
                __m256i w[O][2];                                                                            \
                __m256 sv[O][2], mv[O][2];                                                                  \
                _Pragma("GCC unroll 2") for (int o = 0; o < O; o++) T##_decode(&U[o], j, w[o], sv[o], mv[o]); \
                const uint8_t *record = act + v * vstride;                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                    const uint8_t *a = record + r * REC;                                                    \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                   \
                        const __m256i x = _mm256_load_si256((const __m256i *)(a + 32 * h));                 \
                        const __m256 dx = _mm256_load_ps((const float *)(a + 64 + 32 * h));                 \
                        const __m256i c = (OFFSET) ? _mm256_load_si256((const __m256i *)(a + 128 + 32 * h)) \
                                                   : _mm256_setzero_si256();                                \
                        const __m256 cs = (MIN) == 1 ? _mm256_load_ps((const float *)(a + CS_AT + 32 * h))  \
                                                     : _mm256_setzero_ps();                                 \
                        _Pragma("GCC unroll 2") for (int o = 0; o < O; o++) {                               \
                            const __m256i s = (SIGNED) ? qd_dot(c, _mm256_sign_epi8(w[o][h], w[o][h]),     \
                                                                _mm256_sign_epi8(x, w[o][h]))               \
                                                       : qd_dot(c, w[o][h], x);                             \
                            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), dx);                      \
                            acc[r][o] = _mm256_fmadd_ps(t, sv[o][h], acc[r][o]);                            \
                            if ((MIN) == 1) acc[r][o] = _mm256_fmadd_ps(mv[o][h], cs, acc[r][o]);           \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            if ((MIN) == 2) {                                                                               \
                const uint8_t *record = act + u * T##_VPU * vstride;                                        \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                    const __m256 cs = _mm256_load_ps((const float *)(record + r * REC + CS_AT));            \
                    _Pragma("GCC unroll 2") for (int o = 0; o < O; o++)                                     \
                        acc[r][o] = _mm256_fmadd_ps(T##_mins(&U[o]), cs, acc[r][o]);                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                 \
            _Pragma("GCC unroll 2") for (int o = 0; o < O; o++) out[r * ldo + o] = hsum8(acc[r][o]);        \
    } \
    QD_TILE_GROUPS(T, R, O)

#define QD_TILES(T, OFFSET, MIN, SIGNED)                                                                     \
    QD_TILE(T, OFFSET, MIN, SIGNED, 1, 2)                                                                    \
    QD_TILE(T, OFFSET, MIN, SIGNED, 1, 1) QD_TILE(T, OFFSET, MIN, SIGNED, 2, 1)                              \
    QD_TILE(T, OFFSET, MIN, SIGNED, 3, 1) QD_TILE(T, OFFSET, MIN, SIGNED, 4, 1)                              \
    QD_TILE(T, OFFSET, MIN, SIGNED, 5, 1) QD_TILE(T, OFFSET, MIN, SIGNED, 6, 1)                              \
    QD_TILE(T, OFFSET, MIN, SIGNED, 7, 1) QD_TILE(T, OFFSET, MIN, SIGNED, 8, 1)                              \
    static const qd_tile T##_tiles[2][QD_TILE_ROWS + 1] = {                                                  \
        {0, T##_tile_1x1, T##_tile_2x1, T##_tile_3x1, T##_tile_4x1, T##_tile_5x1, T##_tile_6x1, T##_tile_7x1, \
         T##_tile_8x1},                                                                                      \
        {0, T##_tile_1x2, T##_tile_2x1, T##_tile_3x1, T##_tile_4x1, T##_tile_5x1, T##_tile_6x1, T##_tile_7x1, \
         T##_tile_8x1}};

QD_TILES(q4_0, 1, 0, 0)
QD_TILES(q4_1, 0, 1, 0)
QD_TILES(q5_0, 1, 0, 0)
QD_TILES(q5_1, 0, 1, 0)
QD_TILES(q8_0, QD_Q8_OFFSET, 0, QD_Q8_SIGNED)
QD_TILES(q4_k, 0, 2, 0)
QD_TILES(q5_k, 0, 2, 0)
QD_TILES(q6_k, 1, 0, 0)

typedef const qd_tile qd_tile_table[QD_TILE_ROWS + 1];

static const qd_tile_table *qd_tiles(int type) {
    switch (type) {
    case QD_Q4_0: return q4_0_tiles;
    case QD_Q4_1: return q4_1_tiles;
    case QD_Q5_0: return q5_0_tiles;
    case QD_Q5_1: return q5_1_tiles;
    case QD_Q8_0: return q8_0_tiles;
    case QD_Q4_K: return q4_k_tiles;
    case QD_Q5_K: return q5_k_tiles;
    case QD_Q6_K: return q6_k_tiles;
    default: return 0;
    }
}
#else
int quant_dot_supported(void) { return 0; }

int quant_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                 float *out) {
    (void)type, (void)x, (void)m, (void)k, (void)w, (void)n, (void)row_bytes, (void)out;
    (void)qd_block, (void)qd_offset, (void)qd_has_min;
    return -4;
}

int quant_dot_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    (void)x, (void)m, (void)k, (void)q, (void)d;
    return -4;
}
#endif

#if defined(QD_AVX512) || defined(QD_AVX2)
/* The quantized activations, one buffer per calling thread, grown as needed (64-byte aligned). */
static _Thread_local uint8_t *qd_buffer;
static _Thread_local size_t qd_capacity;

static uint8_t *qd_rows(size_t bytes) {
    if (bytes > qd_capacity) {
        uint8_t *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!grown) return 0;
        free(qd_buffer);
        qd_buffer = grown;
        qd_capacity = bytes;
    }
    return qd_buffer;
}

/* out [m][n] = x [m][k] W^T for W n rows of raw blocks (row_bytes each) of GGML type `type`.
 * Returns -1 for a type it does not handle, -2 when k is not whole blocks filling row_bytes, -3 when
 * the activation buffer cannot be allocated. */
int quant_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                 float *out) {
    int64_t weights, bytes;
    if (!qd_block(type, &weights, &bytes)) return -1;
    if (k <= 0 || k % weights || k / weights * bytes != row_bytes) return -2;
    if (m <= 0 || n <= 0) return 0;
    const int offset = qd_offset(type), has_min = qd_has_min(type);
    const int64_t nv = (k + 63) / 64, record = QD_RECORD(offset, has_min), nb = k / 32, units = k / weights;
    const int64_t group_bytes = QD_TILE_ROWS * nv * record;
    uint8_t *act = qd_rows((size_t)(((m + QD_TILE_ROWS - 1) / QD_TILE_ROWS) * group_bytes));
    if (!act) return -3;
    const qd_tile_table *tiles = qd_tiles(type);
    const int64_t loop_units = weights == 32 ? nv : units, loop_nb = weights == 32 ? nb : units;
    /* one row of 256 x 256 or less runs on the calling thread: a second one saves less than its fork costs
     * here; each output's sums are the same either way */
#pragma omp parallel if (m * n * k > (1 << 16))
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const int64_t g = r / QD_TILE_ROWS, rows = m - g * QD_TILE_ROWS < QD_TILE_ROWS ? m - g * QD_TILE_ROWS : QD_TILE_ROWS;
            quantize_row(x + r * k, k, act + g * group_bytes + (r % QD_TILE_ROWS) * record, rows * record, offset,
                         has_min);
        }
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = n * id / threads, hi = n * (id + 1) / threads;
        for (int64_t g0 = 0; g0 < m; g0 += QD_TILE_ROWS) { /* a group of rows; tiles of up to QD_TILE_MAX */
            const int64_t group_rows = m - g0 < QD_TILE_ROWS ? m - g0 : QD_TILE_ROWS;
            const uint8_t *group = act + (g0 / QD_TILE_ROWS) * group_bytes;
            for (int64_t t0 = 0; t0 < group_rows; t0 += QD_TILE_MAX) {
                const int64_t rows = group_rows - t0 < QD_TILE_MAX ? group_rows - t0 : QD_TILE_MAX;
                const int64_t outs = QD_OUTS(rows), r0 = g0 + t0;
                const uint8_t *first = group + t0 * record;
                const int64_t groups = (hi - lo) / outs, o = lo + groups * outs; /* whole tiles in one call */
                if (groups)
                    tiles[1][rows](w + lo * row_bytes, row_bytes, loop_units, loop_nb, first, group_rows * record,
                                   out + r0 * n + lo, n, groups);
                if (o < hi)
                    tiles[0][rows](w + o * row_bytes, row_bytes, loop_units, loop_nb, first, group_rows * record,
                                   out + r0 * n + o, n, hi - o);
            }
        }
    }
    return 0;
}

/* The activation quantization alone (for tests): q int8 [m][k], d float [m][k / 32]. */
int quant_dot_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    if (k <= 0 || k % 32) return -2;
    const int64_t nv = (k + 63) / 64, record = QD_RECORD(0, 0);
    uint8_t *row = aligned_alloc(64, (size_t)(nv * record));
    if (!row) return -3;
    for (int64_t r = 0; r < m; r++) {
        quantize_row(x + r * k, k, row, record, 0, 0);
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *rec = row + (b / 2) * record;
            memcpy(q + r * k + 32 * b, rec + 32 * (b % 2), 32);
            d[r * (k / 32) + b] = ((const float *)(rec + 64))[8 * (b % 2)];
        }
    }
    free(row);
    return 0;
}
#endif

#if defined(QD_AVX512)
#include "quant_panel_avx512.h"
#elif defined(QD_AVX2)
#include "quant_panel_avx2.h"
#else
/* No many-row GEMM without AVX2 (the caller dequantizes). */
int quant_panel_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                       float *out) {
    (void)type, (void)x, (void)m, (void)k, (void)w, (void)n, (void)row_bytes, (void)out;
    return -4;
}
#endif
