/* step_replay: a recorded decode step run again in one call (the cpu backend's capture_decode).
 *
 * A program is a flat int64 array of entries [op, argument count, arguments...]: the same kernels, with
 * the same arguments (pointers into tensors the recording keeps alive), in the order the eager forward
 * called them, so a replay computes what the eager step computes, bit for bit. Besides the kernels of
 * the library, a few copy-like ops stand in for the torch ops a decode step makes between them (row
 * gathers, the KV cache's row scatter, float32 and 16-bit adds, products by a scalar, 16-bit to float32
 * conversions); each does exactly
 * what the torch op does (an IEEE float32 add is one rounding either way).
 *
 * step_replay returns 0, or the index + 1 of the entry that failed, with that entry's status in *status.
 */
#include <stdint.h>
#include <string.h>

int paged_decode_attention(const float *query, const float *key_cache, const float *value_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                           float soft_cap);
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t cols,
              float eps, float offset);
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t n);
void gelu_tanh_and_mul(const float *x, float *out, int64_t rows, int64_t n);
void rotary_neox(float *q, float *k, const float *cos_table, const float *sin_table, int64_t tokens,
                 int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                 int64_t k_stride);
int ggml_dequantize_rows(int type, const uint8_t *raw, int64_t rows, int64_t row_bytes, int64_t cols, float *out);
int panel_linear(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                 int64_t k);
int quant_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                 float *out);
int quant_panel_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                       int64_t row_bytes, float *out);
int half_linear(int dtype, const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                const uint16_t *bias, void *out, int out_float);
int half_weight_linear(int dtype, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                       const float *bias, float *out);
int half_panel_linear(int dtype, const float *x, const uint16_t *packed, const float *bias, float *out, int64_t m,
                      int64_t n, int64_t k);
int paged_decode_attention_16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                              const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                              int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                              float soft_cap, int dtype);
int paged_decode_attention_kv16(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                                const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                                int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                                float soft_cap, int dtype);
int kv_quantize_rows(const float *src, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                     const int64_t *slots, const float *fixed, uint8_t *cache, int kind);
int paged_attention_quantized(const float *query, const uint8_t *key_cache, const uint8_t *value_cache,
                              const int64_t *block_tables, const int64_t *query_start_loc, const int64_t *seq_lens,
                              float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t v_dim, int64_t v_row, int64_t block_size, int64_t max_blocks,
                              float scale, int64_t sliding_window, float soft_cap, int kind);
void rms_norm_16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t cols, float eps, float offset, int dtype);
void silu_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype);
void gelu_tanh_and_mul_16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int dtype);
void rotary_neox_16(uint16_t *q, uint16_t *k, const float *cos_table, const float *sin_table, int64_t tokens,
                    int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rotary_dim, int64_t q_stride,
                    int64_t k_stride, int dtype);

/* Operation codes; native.py's REPLAY_OPS names them in the same order. */
enum {
    OP_PAGED_DECODE_ATTENTION = 1,
    OP_RMS_NORM,
    OP_SILU_AND_MUL,
    OP_ROTARY_NEOX,
    OP_GGML_DEQUANTIZE_ROWS,
    OP_PANEL_LINEAR,
    OP_QUANT_MATMUL,
    OP_HALF_LINEAR,
    OP_GATHER_ROWS,
    OP_SCATTER_ROWS,
    OP_ADD_F32,
    OP_TO_F32,
    OP_COPY_ROWS,
    OP_QUANT_MATMUL_AT,
    OP_PAGED_DECODE_ATTENTION_16,
    OP_RMS_NORM_16,
    OP_SILU_AND_MUL_16,
    OP_ROTARY_NEOX_16,
    OP_ADD_BF16,
    OP_ADD_F16,
    OP_HALF_LINEAR_AT,
    OP_HALF_WEIGHT_LINEAR,
    OP_GELU_TANH_AND_MUL,
    OP_GELU_TANH_AND_MUL_16,
    OP_MUL_SCALAR,
    OP_FROM_F32,
    OP_PAGED_DECODE_ATTENTION_KV16,
    OP_KV_QUANTIZE_ROWS,
    OP_PAGED_ATTENTION_QUANTIZED,
    OP_QUANT_PANEL_MATMUL,
    OP_INT8_GEMM_AT,
    OP_HALF_PANEL_LINEAR,
};

/* quant_matmul's signature: another library's kernel (amx_quant.c's tiles) called through its address. */
typedef int (*quant_matmul_fn)(int, const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *);
/* half_linear's signature: another library's kernel (amx_half.c's tiles) called through its address. */
typedef int (*half_linear_fn)(int, const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, const uint16_t *,
                              void *, int);
/* int8_gemm's signature: int8_gemm.c's W8A8 GEMM (a library of its own) called through its address. */
typedef int (*int8_gemm_fn)(const float *, int64_t, int64_t, const int8_t *, int64_t, const float *, const float *,
                            float *);

/* out[i] = src[index[i]] for rows of row_bytes (src rows row_stride bytes apart); -1 for an index outside
 * [0, src_rows), as torch's embedding / index_select refuse one. */
int gather_rows(const uint8_t *src, int64_t src_rows, int64_t row_stride, const int64_t *index, int64_t n,
                int64_t row_bytes, uint8_t *out) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= src_rows) return -1;
    for (int64_t i = 0; i < n; i++) memcpy(out + i * row_bytes, src + index[i] * row_stride, row_bytes);
    return 0;
}

/* dst[index[i]] = src[i] (index_copy_ along the first axis): src rows src_stride bytes apart. */
int scatter_rows(uint8_t *dst, int64_t dst_rows, const int64_t *index, const uint8_t *src, int64_t src_stride,
                 int64_t n, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= dst_rows) return -1;
    for (int64_t i = 0; i < n; i++) memcpy(dst + index[i] * row_bytes, src + i * src_stride, row_bytes);
    return 0;
}

/* rows of row_bytes from src (src_stride bytes apart) to out (out_stride bytes apart): a strided tensor
 * made contiguous, or one part of a concatenation. */
void copy_rows(const uint8_t *src, int64_t src_stride, int64_t rows, int64_t row_bytes, uint8_t *out,
               int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * out_stride, src + r * src_stride, row_bytes);
}

/* out[r, c] = a[r, c] + b[r * b_stride + c] (b_stride 0: one row of b added to every row). */
void add_f32(const float *a, const float *b, float *out, int64_t rows, int64_t cols, int64_t b_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = a + r * cols, *y = b + r * b_stride;
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; c++) o[c] = x[c] + y[c];
    }
}

/* bfloat16 out[r, c] = a[r, c] + b[r * b_stride + c] as torch adds them: in float32, rounded to nearest even.
 * A NaN is written 0xffff, as torch's vectorised loop writes it (its scalar tail writes 0x7fc0). */
void add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t rows, int64_t cols, int64_t b_stride) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            uint32_t x = (uint32_t)a[r * cols + c] << 16, y = (uint32_t)b[r * b_stride + c] << 16, bits;
            float fx, fy, sum;
            memcpy(&fx, &x, sizeof fx);
            memcpy(&fy, &y, sizeof fy);
            sum = fx + fy;
            memcpy(&bits, &sum, sizeof bits);
            out[r * cols + c] = sum != sum ? 0xffff : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
    }
}

/* float32 to float16, rounded to nearest even (c10::Half's conversion, fp16_ieee_from_fp32_value: overflow
 * to infinity, subnormals rounded once); a NaN keeps its sign and the top of its payload, quieted, as
 * vcvtps2ph (torch's vectorised loop) writes it. */
static uint16_t float_to_half(float value) {
    uint32_t w, bias, bits;
    float base = (value < 0 ? -value : value) * 0x1.0p+112f * 0x1.0p-110f, scaled;
    memcpy(&w, &value, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    bits = (bias >> 1) + 0x07800000u;
    memcpy(&scaled, &bits, sizeof scaled);
    base = scaled + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u | ((w >> 13) & 0x3ffu) : nonsign));
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float16 out[r, c] = a[r, c] + b[r * b_stride + c] as torch adds them: in float32, rounded to nearest even;
 * of two NaNs, b's (torch's vectorised loop is fma(b, alpha, a)). */
void add_f16(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t rows, int64_t cols, int64_t b_stride) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const float x = half_to_float(a[r * cols + c]), y = half_to_float(b[r * b_stride + c]);
            out[r * cols + c] = float_to_half(y != y ? y : x + y);
        }
    }
}

/* out[i] = a[i] * s[0] for n values, as torch multiplies by a 0-dim tensor of a's dtype (Gemma's embedding
 * scale): dtype 0 float32, 1 float16, 2 bfloat16 (a product of two 16-bit values is exact in float32, so
 * the one rounding to nearest even is torch's; a NaN's bits may differ). */
void mul_scalar(const void *a, const void *s, void *out, int64_t n, int dtype) {
    if (dtype == 0) {
        const float *x = a, scale = *(const float *)s;
        float *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] * scale;
        return;
    }
    const uint16_t *x = a;
    uint16_t *o = out;
    if (dtype == 1) {
        const float scale = half_to_float(*(const uint16_t *)s);
        for (int64_t i = 0; i < n; i++) o[i] = float_to_half(half_to_float(x[i]) * scale);
        return;
    }
    float scale;
    uint32_t bits = (uint32_t)*(const uint16_t *)s << 16;
    memcpy(&scale, &bits, sizeof scale);
    for (int64_t i = 0; i < n; i++) {
        float value;
        bits = (uint32_t)x[i] << 16;
        memcpy(&value, &bits, sizeof value);
        value *= scale;
        memcpy(&bits, &value, sizeof bits);
        o[i] = value != value ? 0xffff : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
}

/* float32 of n contiguous 16-bit values: dtype 0 bfloat16, 1 float16 (both exact). */
void to_f32(const uint16_t *src, int dtype, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (dtype == 0) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(out + i, &bits, sizeof bits);
        } else {
            out[i] = half_to_float(src[i]);
        }
    }
}

/* n contiguous float32 values as 16-bit ones: dtype 0 bfloat16, 1 float16, rounded to nearest even as torch's
 * .to() rounds them (a NaN's bits may differ). */
void from_f32(const float *src, int dtype, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (dtype == 1) {
            out[i] = float_to_half(src[i]);
        } else {
            uint32_t bits;
            memcpy(&bits, src + i, sizeof bits);
            out[i] = src[i] != src[i] ? 0xffff : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
    }
}

static float as_float(int64_t bits) {
    double value;
    memcpy(&value, &bits, sizeof value);
    return (float)value;
}

#define P(i) ((void *)(intptr_t)a[i])

int64_t step_replay(const int64_t *program, int64_t length, int64_t *status) {
    int64_t entry = 0;
    for (int64_t at = 0; at < length; entry++) {
        const int64_t op = program[at], count = program[at + 1];
        const int64_t *a = program + at + 2;
        int result = 0;
        at += 2 + count;
        switch (op) {
        case OP_PAGED_DECODE_ATTENTION:
            result = paged_decode_attention(P(0), P(1), P(2), P(3), P(4), P(5), a[6], a[7], a[8], a[9], a[10],
                                            a[11], a[12], as_float(a[13]), a[14], as_float(a[15]));
            break;
        case OP_RMS_NORM:
            rms_norm(P(0), P(1), P(2), P(3), a[4], a[5], as_float(a[6]), as_float(a[7]));
            break;
        case OP_SILU_AND_MUL:
            silu_and_mul(P(0), P(1), a[2], a[3]);
            break;
        case OP_ROTARY_NEOX:
            rotary_neox(P(0), P(1), P(2), P(3), a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
            break;
        case OP_GGML_DEQUANTIZE_ROWS:
            result = ggml_dequantize_rows((int)a[0], P(1), a[2], a[3], a[4], P(5));
            break;
        case OP_PANEL_LINEAR:
            result = panel_linear(P(0), P(1), P(2), P(3), a[4], a[5], a[6]);
            break;
        case OP_QUANT_MATMUL:
            result = quant_matmul((int)a[0], P(1), a[2], a[3], P(4), a[5], a[6], P(7));
            break;
        case OP_HALF_LINEAR:
            result = half_linear((int)a[0], P(1), a[2], a[3], P(4), a[5], P(6), P(7), (int)a[8]);
            break;
        case OP_GATHER_ROWS:
            result = gather_rows(P(0), a[1], a[2], P(3), a[4], a[5], P(6));
            break;
        case OP_SCATTER_ROWS:
            result = scatter_rows(P(0), a[1], P(2), P(3), a[4], a[5], a[6]);
            break;
        case OP_ADD_F32:
            add_f32(P(0), P(1), P(2), a[3], a[4], a[5]);
            break;
        case OP_TO_F32:
            to_f32(P(0), (int)a[1], P(2), a[3]);
            break;
        case OP_COPY_ROWS:
            copy_rows(P(0), a[1], a[2], a[3], P(4), a[5]);
            break;
        case OP_QUANT_MATMUL_AT:
            result = ((quant_matmul_fn)P(0))((int)a[1], P(2), a[3], a[4], P(5), a[6], a[7], P(8));
            break;
        case OP_PAGED_DECODE_ATTENTION_16:
            result = paged_decode_attention_16(P(0), P(1), P(2), P(3), P(4), P(5), a[6], a[7], a[8], a[9], a[10],
                                               a[11], a[12], as_float(a[13]), a[14], as_float(a[15]), (int)a[16]);
            break;
        case OP_RMS_NORM_16:
            rms_norm_16(P(0), P(1), P(2), P(3), a[4], a[5], as_float(a[6]), as_float(a[7]), (int)a[8]);
            break;
        case OP_SILU_AND_MUL_16:
            silu_and_mul_16(P(0), P(1), a[2], a[3], (int)a[4]);
            break;
        case OP_ROTARY_NEOX_16:
            rotary_neox_16(P(0), P(1), P(2), P(3), a[4], a[5], a[6], a[7], a[8], a[9], a[10], (int)a[11]);
            break;
        case OP_ADD_BF16:
            add_bf16(P(0), P(1), P(2), a[3], a[4], a[5]);
            break;
        case OP_ADD_F16:
            add_f16(P(0), P(1), P(2), a[3], a[4], a[5]);
            break;
        case OP_HALF_LINEAR_AT:
            result = ((half_linear_fn)P(0))((int)a[1], P(2), a[3], a[4], P(5), a[6], P(7), P(8), (int)a[9]);
            break;
        case OP_HALF_WEIGHT_LINEAR:
            result = half_weight_linear((int)a[0], P(1), a[2], a[3], P(4), a[5], P(6), P(7));
            break;
        case OP_GELU_TANH_AND_MUL:
            gelu_tanh_and_mul(P(0), P(1), a[2], a[3]);
            break;
        case OP_GELU_TANH_AND_MUL_16:
            gelu_tanh_and_mul_16(P(0), P(1), a[2], a[3], (int)a[4]);
            break;
        case OP_MUL_SCALAR:
            mul_scalar(P(0), P(1), P(2), a[3], (int)a[4]);
            break;
        case OP_FROM_F32:
            from_f32(P(0), (int)a[1], P(2), a[3]);
            break;
        case OP_PAGED_DECODE_ATTENTION_KV16:
            result = paged_decode_attention_kv16(P(0), P(1), P(2), P(3), P(4), P(5), a[6], a[7], a[8], a[9], a[10],
                                                 a[11], a[12], as_float(a[13]), a[14], as_float(a[15]), (int)a[16]);
            break;
        case OP_KV_QUANTIZE_ROWS:
            result = kv_quantize_rows(P(0), a[1], a[2], a[3], a[4], P(5), P(6), P(7), (int)a[8]);
            break;
        case OP_PAGED_ATTENTION_QUANTIZED:
            result = paged_attention_quantized(P(0), P(1), P(2), P(3), P(4), P(5), P(6), a[7], a[8], a[9], a[10], a[11],
                                               a[12], a[13], a[14], as_float(a[15]), a[16], as_float(a[17]), (int)a[18]);
            break;
        case OP_QUANT_PANEL_MATMUL:
            result = quant_panel_matmul((int)a[0], P(1), a[2], a[3], P(4), a[5], a[6], P(7));
            break;
        case OP_INT8_GEMM_AT:
            result = ((int8_gemm_fn)P(0))(P(1), a[2], a[3], P(4), a[5], P(6), P(7), P(8));
            break;
        case OP_HALF_PANEL_LINEAR:
            result = half_panel_linear((int)a[0], P(1), P(2), P(3), P(4), a[5], a[6], a[7]);
            break;
        default:
            result = -100;
        }
        if (result != 0) {
            *status = result;
            return entry + 1;
        }
    }
    *status = 0;
    return 0;
}
