/* int8_gemm: y = x W^T for float32 activations x and int8 weights W with one float32 scale per output row
 * (W8A8: int8 weights, activations quantized per row at run time), on the CPU's int8 dot products.
 *
 * Each row of x is quantized once per call, symmetric, as compressed-tensors' own forward does (the library that
 * defines the checkpoint format, with which llm-compressor calibrates): scale = max|x| / 127.5,
 * q = round-half-even(x / scale) clamped to [-128, 127] (a row of zeros: scale 0, levels 0; a row holding a NaN
 * or an infinity: scale NaN, so its outputs are NaN). Then acc = sum_k q[k] * w[o, k] in int32 (exact:
 * every partial sum stays within 128 * 128 * k, so k is limited to 2^16) and
 *     y[r, o] = ((float)acc * x_scale[r]) * w_scale[o] (+ bias[o])
 * in float32, in this order, whatever the ISA, tile or thread: a row's result never depends on the rows
 * batched with it, and equals the torch reference (pluginfer.quant.compressed_tensors.w8a8_linear) bit for bit.
 *
 * Weights are repacked once at load (int8_gemm_pack) into blocks of 16 outputs: per step of 4 inputs, 64 bytes
 * (output o's 4 weights in bytes 4o .. 4o + 3, one int32 lane each), then the block's 16 int32
 * "compensations" -128 * sum_k w[o, k]; inputs are padded to a multiple of 4, outputs to 16, with zeros.
 * One layout serves every variant (llama.cpp's ggml-cpu repacks for its int8 tiles in the same spirit):
 *   AVX-512 VNNI: vpdpbusd multiplies the 4 activation bytes of a step (broadcast) by a block's 64 weight
 *     bytes into 16 int32 lanes. It wants unsigned activations: they are stored as q + 128, and the
 *     accumulator starts at the block's compensation, which takes the 128 * sum(w) back out.
 *     A tile is 6 rows x 4 blocks (24 accumulators): each weight vector loaded is used by 6 rows.
 *   AVX2 with AVX-VNNI: the same in 256-bit halves of a block (vpdpbusd ymm), tiles of 4 rows x 1 block.
 *   AVX2: weights and levels widened to int16 for vpmaddwd (vpmaddubsw's 16-bit pair sums would saturate, and
 *     its sign trick fails when weight and activation are both -128), tiles of 2 rows x 1 block.
 *   Portable C: the same sums in plain loops.
 * Threads (OpenMP, torch's thread count) take (4-block column chunk, group of rows) items: a chunk's weights
 * stay in cache while every row of the group passes over them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define I8_AVX512 1
#define I8_ISA 3
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define I8_AVXVNNI 1
#define I8_ISA 2
#elif defined(__AVX2__)
#define I8_AVX2 1
#define I8_ISA 1
#else
#define I8_ISA 0
#endif
#if I8_ISA > 0
#include <immintrin.h>
#endif

/* The VNNI variants store activations as unsigned bytes q + 128 (vpdpbusd is unsigned x signed). */
#if defined(I8_AVX512) || defined(I8_AVXVNNI)
#define I8_UNSIGNED 1
#else
#define I8_UNSIGNED 0
#endif

#define I8_BLOCK 16      /* outputs per block */
#define I8_CHUNK 4       /* blocks per column chunk (a thread's unit) */
#define I8_ROW_GROUP 96  /* rows per work item */
#define I8_MAX_K (1 << 16) /* every partial sum stays within 2^30 */

/* Which variant this build runs: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable C. */
int int8_gemm_isa(void) { return I8_ISA; }

static inline int64_t steps_of(int64_t k) { return (k + 3) / 4; }
static inline int64_t blocks_of(int64_t n) { return (n + I8_BLOCK - 1) / I8_BLOCK; }
static inline int64_t block_bytes(int64_t k) { return steps_of(k) * 64 + I8_BLOCK * 4; }

/* Bytes of the packed layout of an n x k weight (blocks_of(n) blocks of block_bytes(k)). */
int64_t int8_gemm_packed_bytes(int64_t n, int64_t k) { return blocks_of(n) * block_bytes(k); }

/* w int8 [n, k] row-major -> the packed layout (int8_gemm_packed_bytes(n, k) bytes at packed). */
void int8_gemm_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed) {
    const int64_t steps = steps_of(k), stride = block_bytes(k), blocks = blocks_of(n);
#pragma omp parallel for schedule(static) if (n * k > (1 << 18))
    for (int64_t b = 0; b < blocks; b++) {
        int8_t *dst = packed + b * stride;
        int32_t sums[I8_BLOCK] = {0};
        for (int o = 0; o < I8_BLOCK; o++) {
            const int64_t row = b * I8_BLOCK + o;
            for (int64_t c = 0; c < steps * 4; c++) {
                const int8_t v = row < n && c < k ? w[row * k + c] : 0;
                dst[(c / 4) * 64 + o * 4 + c % 4] = v;
                sums[o] += v;
            }
        }
        for (int o = 0; o < I8_BLOCK; o++) {
            const int32_t compensation = -128 * sums[o];
            memcpy(dst + steps * 64 + o * 4, &compensation, 4);
        }
    }
}

/* One row of x -> its levels (steps_of(k) * 4 bytes, zero levels past k; q + 128 where I8_UNSIGNED) and scale. */
static float quantize_row(const float *x, int64_t k, uint8_t *q) {
    float amax = 0.0f, poison = 0.0f; /* poison: x * 0 summed, NaN when a value is NaN or infinite */
    int64_t i = 0;
#if defined(I8_AVX512)
    __m512 vmax = _mm512_setzero_ps(), vpoison = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vpoison = _mm512_add_ps(vpoison, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    amax = _mm512_reduce_max_ps(vmax);
    poison = _mm512_reduce_add_ps(vpoison);
#elif I8_ISA > 0
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps(), vpoison = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
        vpoison = _mm256_add_ps(vpoison, _mm256_mul_ps(v, _mm256_setzero_ps()));
    }
    float lanes[8], poisons[8];
    _mm256_storeu_ps(lanes, vmax);
    _mm256_storeu_ps(poisons, vpoison);
    for (int j = 0; j < 8; j++) {
        amax = lanes[j] > amax ? lanes[j] : amax;
        poison += poisons[j];
    }
#endif
    for (; i < k; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
        poison += x[i] * 0.0f;
    }
    const int64_t padded = steps_of(k) * 4;
    const uint8_t zero = I8_UNSIGNED ? 128 : 0;
    const float scale = amax / 127.5f;
    if (poison != 0.0f || scale == 0.0f) { /* poison is 0 or NaN */
        memset(q, zero, (size_t)padded);
        return poison != 0.0f ? NAN : 0.0f;
    }
    i = 0;
#if defined(I8_AVX512)
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (; i + 16 <= k; i += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vscale),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
        v = _mm512_add_epi32(v, offset);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
    }
#elif I8_ISA > 0
    const __m256 vscale = _mm256_set1_ps(scale);
    const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
    for (; i + 8 <= k; i += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vscale),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        int32_t levels[8];
        _mm256_storeu_si256((__m256i *)levels,
                            _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi));
        for (int j = 0; j < 8; j++) q[i + j] = (uint8_t)(levels[j] + (I8_UNSIGNED ? 128 : 0));
    }
#endif
    for (; i < k; i++) {
        float r = nearbyintf(x[i] / scale);
        r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
        q[i] = (uint8_t)((int)r + (I8_UNSIGNED ? 128 : 0));
    }
    for (; i < padded; i++) q[i] = zero;
    return scale;
}

/* The float epilogue of one output, the reference's order of operations. */
static inline float finish(int32_t acc, float x_scale, float w_scale, const float *bias, int64_t o) {
    const float y = ((float)acc * x_scale) * w_scale;
    return bias ? y + bias[o] : y;
}

/* The sums of a tile's rows for block outputs [o0, o0 + 16) given as int32 acc[16] -> out (tail-safe). */
static inline void store_block(const int32_t *acc, float x_scale, const float *w_scale, const float *bias,
                               float *out, int64_t o0, int64_t n) {
    const int64_t count = n - o0 < I8_BLOCK ? n - o0 : I8_BLOCK;
    for (int64_t o = 0; o < count; o++) out[o0 + o] = finish(acc[o], x_scale, w_scale[o0 + o], bias, o0 + o);
}

#if defined(I8_AVXVNNI) || defined(I8_AVX2)
/* A row's 16 sums of one block, outputs 0-7 and 8-15, to out. */
static inline void store_halves(__m256i low, __m256i high, float x_scale, const float *w_scale, const float *bias,
                                float *out, int64_t o0, int64_t n) {
    if (o0 + I8_BLOCK <= n) {
        const __m256 scale = _mm256_set1_ps(x_scale);
        const __m256i halves[2] = {low, high};
        for (int h = 0; h < 2; h++) {
            const int64_t o = o0 + 8 * h;
            __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(halves[h]), scale), _mm256_loadu_ps(w_scale + o));
            if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + o));
            _mm256_storeu_ps(out + o, y);
        }
    } else {
        int32_t lanes[I8_BLOCK];
        _mm256_storeu_si256((__m256i *)lanes, low);
        _mm256_storeu_si256((__m256i *)(lanes + 8), high);
        store_block(lanes, x_scale, w_scale, bias, out, o0, n);
    }
}
#endif

#if defined(I8_AVX512)
#define I8_TILE_ROWS 6
/* rows x blocks of outputs: xq rows of xstride bytes, wb the first block (stride block bytes). */
static inline __attribute__((always_inline)) void tile(
        const int rows, const int blocks, const uint8_t *xq, int64_t xstride, const float *xs, const int8_t *wb,
        int64_t wstride, int64_t steps, const float *w_scale, const float *bias, float *out, int64_t ldo,
        int64_t o0, int64_t n) {
    __m512i acc[I8_TILE_ROWS][I8_CHUNK];
    for (int j = 0; j < blocks; j++) {
        const __m512i compensation = _mm512_loadu_si512(wb + j * wstride + steps * 64);
        for (int r = 0; r < rows; r++) acc[r][j] = compensation;
    }
    for (int64_t s = 0; s < steps; s++) {
        __m512i w[I8_CHUNK];
        for (int j = 0; j < blocks; j++) w[j] = _mm512_loadu_si512(wb + j * wstride + s * 64);
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, xq + r * xstride + s * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < blocks; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xb, w[j]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 scale = _mm512_set1_ps(xs[r]);
        for (int j = 0; j < blocks; j++) {
            const int64_t o = o0 + j * I8_BLOCK;
            if (o + I8_BLOCK <= n) {
                __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][j]), scale),
                                         _mm512_loadu_ps(w_scale + o));
                if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + o));
                _mm512_storeu_ps(out + r * ldo + o, y);
            } else {
                int32_t lanes[I8_BLOCK];
                _mm512_storeu_si512(lanes, acc[r][j]);
                store_block(lanes, xs[r], w_scale, bias, out + r * ldo, o, n);
            }
        }
    }
}
#elif defined(I8_AVXVNNI)
#define I8_TILE_ROWS 4
static inline __attribute__((always_inline)) void tile_block(
        const int rows, const uint8_t *xq, int64_t xstride, const float *xs, const int8_t *wb, int64_t steps,
        const float *w_scale, const float *bias, float *out, int64_t ldo, int64_t o0, int64_t n) {
    __m256i acc[I8_TILE_ROWS][2];
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)(wb + steps * 64));
    const __m256i c1 = _mm256_loadu_si256((const __m256i *)(wb + steps * 64 + 32));
    for (int r = 0; r < rows; r++) {
        acc[r][0] = c0;
        acc[r][1] = c1;
    }
    for (int64_t s = 0; s < steps; s++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + s * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + s * 64 + 32));
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, xq + r * xstride + s * 4, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], xb, w0);
            acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], xb, w1);
        }
    }
    for (int r = 0; r < rows; r++) store_halves(acc[r][0], acc[r][1], xs[r], w_scale, bias, out + r * ldo, o0, n);
}
#elif defined(I8_AVX2)
#define I8_TILE_ROWS 2
/* Weights and levels widened to int16 for vpmaddwd: a quarter of a block (4 outputs x 4 inputs) per vector. */
static inline __attribute__((always_inline)) void tile_block(
        const int rows, const uint8_t *xq, int64_t xstride, const float *xs, const int8_t *wb, int64_t steps,
        const float *w_scale, const float *bias, float *out, int64_t ldo, int64_t o0, int64_t n) {
    __m256i acc[I8_TILE_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_si256();
    for (int64_t s = 0; s < steps; s++) {
        __m256i w[4];
        for (int q = 0; q < 4; q++) w[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + s * 64 + 16 * q)));
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, xq + r * xstride + s * 4, 4);
            const __m256i xb = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(four)));
            for (int q = 0; q < 4; q++) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(w[q], xb));
        }
    }
    /* lanes hold pairs of half sums: hadd joins them, outputs 0 1 4 5 | 2 3 6 7, put in order by the permute */
    for (int r = 0; r < rows; r++)
        store_halves(_mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8),
                     _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][2], acc[r][3]), 0xD8), xs[r], w_scale, bias,
                     out + r * ldo, o0, n);
}
#endif
#if defined(I8_AVXVNNI) || defined(I8_AVX2)
static inline __attribute__((always_inline)) void tile(
        const int rows, const int blocks, const uint8_t *xq, int64_t xstride, const float *xs, const int8_t *wb,
        int64_t wstride, int64_t steps, const float *w_scale, const float *bias, float *out, int64_t ldo,
        int64_t o0, int64_t n) {
    for (int j = 0; j < blocks; j++)
        tile_block(rows, xq, xstride, xs, wb + j * wstride, steps, w_scale, bias, out, ldo, o0 + j * I8_BLOCK, n);
}
#elif !defined(I8_AVX512)
#define I8_TILE_ROWS 4
static void tile(const int rows, const int blocks, const uint8_t *xq, int64_t xstride, const float *xs,
                 const int8_t *wb, int64_t wstride, int64_t steps, const float *w_scale, const float *bias,
                 float *out, int64_t ldo, int64_t o0, int64_t n) {
    for (int j = 0; j < blocks; j++) {
        const int8_t *block = wb + j * wstride;
        for (int r = 0; r < rows; r++) {
            const int8_t *levels = (const int8_t *)(xq + r * xstride);
            int32_t acc[I8_BLOCK] = {0};
            for (int64_t s = 0; s < steps; s++)
                for (int o = 0; o < I8_BLOCK; o++)
                    for (int c = 0; c < 4; c++) acc[o] += (int32_t)levels[s * 4 + c] * block[s * 64 + o * 4 + c];
            store_block(acc, xs[r], w_scale, bias, out + r * ldo, o0 + j * I8_BLOCK, n);
        }
    }
}
#endif

/* Constant row and block counts for the inlined tile, so its accumulators live in registers. */
#define I8_ROWS_CASE(R)                                                                                    \
    case R:                                                                                                \
        switch (blocks) {                                                                                  \
        case 4: tile(R, 4, xq, xstride, xs, wb, wstride, steps, w_scale, bias, out, ldo, o0, n); break;  \
        case 3: tile(R, 3, xq, xstride, xs, wb, wstride, steps, w_scale, bias, out, ldo, o0, n); break;  \
        case 2: tile(R, 2, xq, xstride, xs, wb, wstride, steps, w_scale, bias, out, ldo, o0, n); break;  \
        default: tile(R, 1, xq, xstride, xs, wb, wstride, steps, w_scale, bias, out, ldo, o0, n); break; \
        }                                                                                                  \
        break;

static void run_tile(int rows, int blocks, const uint8_t *xq, int64_t xstride, const float *xs, const int8_t *wb,
                     int64_t wstride, int64_t steps, const float *w_scale, const float *bias, float *out,
                     int64_t ldo, int64_t o0, int64_t n) {
    switch (rows) {
        I8_ROWS_CASE(1)
        I8_ROWS_CASE(2)
#if I8_TILE_ROWS > 2
        I8_ROWS_CASE(3)
        I8_ROWS_CASE(4)
#endif
#if I8_TILE_ROWS > 4
        I8_ROWS_CASE(5)
        I8_ROWS_CASE(6)
#endif
    default: break;
    }
}

/* Activation rows quantized with quantize_row: levels [m, steps_of(k) * 4] (as this build stores them) and
 * scales [m], levels signed whatever this build stores (for the tests). Returns 0, -2 for k out of range. */
int int8_gemm_quantize(const float *x, int64_t m, int64_t k, int8_t *levels, float *scales) {
    if (k <= 0 || k > I8_MAX_K) return -2;
    const int64_t stride = steps_of(k) * 4;
#pragma omp parallel for schedule(static) if (m * k > (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        uint8_t *q = (uint8_t *)levels + r * stride;
        scales[r] = quantize_row(x + r * k, k, q);
        if (I8_UNSIGNED)
            for (int64_t i = 0; i < stride; i++) q[i] = (uint8_t)(q[i] - 128);
    }
    return 0;
}

/* out float32 [m, n] = x float32 [m, k] times the packed weights (n outputs) as described above; bias may be NULL.
 * Returns 0, -2 for k out of range, -3 when the activation buffer cannot be allocated. */
int int8_gemm(const float *x, int64_t m, int64_t k, const int8_t *packed, int64_t n, const float *w_scale,
              const float *bias, float *out) {
    if (k <= 0 || k > I8_MAX_K) return -2;
    if (m <= 0 || n <= 0) return 0;
    const int64_t steps = steps_of(k), xstride = steps * 4, wstride = block_bytes(k), blocks = blocks_of(n);
    uint8_t *xq = malloc((size_t)(m * xstride + 64));
    float *xs = malloc((size_t)m * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -3;
    }
    const int64_t chunks = (blocks + I8_CHUNK - 1) / I8_CHUNK, groups = (m + I8_ROW_GROUP - 1) / I8_ROW_GROUP;
#pragma omp parallel if (m * n * k > (1 << 16))
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) xs[r] = quantize_row(x + r * k, k, xq + r * xstride);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * groups; item++) {
            const int64_t chunk = item / groups, group = item % groups;
            const int64_t first_block = chunk * I8_CHUNK;
            const int chunk_blocks = (int)(blocks - first_block < I8_CHUNK ? blocks - first_block : I8_CHUNK);
            const int64_t row_end = (group + 1) * I8_ROW_GROUP < m ? (group + 1) * I8_ROW_GROUP : m;
            for (int64_t r = group * I8_ROW_GROUP; r < row_end; r += I8_TILE_ROWS) {
                const int rows = (int)(row_end - r < I8_TILE_ROWS ? row_end - r : I8_TILE_ROWS);
                run_tile(rows, chunk_blocks, xq + r * xstride, xstride, xs + r, packed + first_block * wstride,
                         wstride, steps, w_scale, bias, out + r * n, n, first_block * I8_BLOCK, n);
            }
        }
    }
    free(xq);
    free(xs);
    return 0;
}
