/* Where one call of amx_half_linear spends its time for float16 (or bfloat16) weights: the whole call, and
 * apart, in loops of their own over the same shape: packing x into its B tiles (split), splitting the
 * weights into their A tiles (ah_weight_tile, every block and step, as one thread's call does) and the tile
 * products alone (the A tiles already split, in L1: 4 tdpbf16ps a step and group for float16, 1 for
 * bfloat16). One thread, CPU time (a shared machine), medians over the calls, in microseconds.
 *
 *     gcc -O3 -march=native -fopenmp -std=c11 -I pluginfer/backends/cpu/csrc benchmarks/amx_half_phases.c -o /tmp/amx_half_phases
 *     /tmp/amx_half_phases DTYPE OUT IN ROWS     # DTYPE 1 float16, 0 bfloat16
 *     /tmp/amx_half_phases 1 5632 1024 16        # the benchmark llama's gate and up, 16 rows
 *     /tmp/amx_half_phases 1 512 1024 16 cached  # the same weights every call (1 MiB, in L2): no memory reads
 *
 * Weights: random normal (sd 0.02, as the benchmarks' checkpoints), rounded to the dtype, 256 MiB of copies
 * cycled so that each whole call and each split pass reads its weights from memory, as in a decode step.
 * Another kernel source (a tree before a change) with -DAH_SOURCE='"path/amx_half.c"' (and -DAH_WHOLE_PACK
 * for a source before 2026-11-24's, whose ah_pack_x packed every tile). Also printed: the
 * fraction of 32-value weight rows whose low halves are all zero (a product a tile could skip).
 */
#define _GNU_SOURCE
#ifndef AH_SOURCE
#define AH_SOURCE "../pluginfer/backends/cpu/csrc/amx_half.c"
#endif
#include AH_SOURCE

#include <math.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *values, int count) {
    qsort(values, (size_t)count, sizeof *values, by_value);
    return values[count / 2];
}

static float normal(void) {
    const double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static uint16_t to_half(int dtype, float f) {
    return dtype == AH_BF16 ? float_to_bf16(f) : _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

int main(int argc, char **argv) {
    if (argc != 5 && !(argc == 6 && !strcmp(argv[5], "cached"))) {
        fprintf(stderr, "usage: %s DTYPE OUT IN ROWS [cached]\n", argv[0]);
        return 2;
    }
    const int dtype = atoi(argv[1]);
    const int64_t n = atoll(argv[2]), k = atoll(argv[3]), m = atoll(argv[4]);
    if ((dtype != AH_BF16 && dtype != AH_F16) || n <= 0 || k <= 0 || m <= 0 || m > 64) {
        fprintf(stderr, "DTYPE 0 or 1; OUT, IN positive; ROWS 1..64\n");
        return 2;
    }
    if (amx_half_init() != 0) {
        fprintf(stderr, "no AMX tile state here\n");
        return 1;
    }
    omp_set_num_threads(1);
    const size_t matrix = (size_t)(n * k);
    const int cached = argc == 6;
    int copies = cached ? 1 : (int)((256u << 20) / (matrix * 2));
    if (copies < 2) copies = cached ? 1 : 2;
    uint16_t *w = malloc(matrix * 2 * (size_t)copies), *x = malloc((size_t)(m * k) * 2);
    float *out = malloc(sizeof(float) * (size_t)(m * n));
    if (!w || !x || !out) return 1;
    srand(1);
    for (size_t i = 0; i < matrix; i++) w[i] = to_half(dtype, 0.02f * normal());
    for (int c = 1; c < copies; c++) memcpy(w + (size_t)c * matrix, w, matrix * 2);
    for (int64_t i = 0; i < m * k; i++) x[i] = to_half(dtype, normal());
    int64_t zero_rows = 0, rows32 = 0;
    for (int64_t o = 0; o < n; o++)
        for (int64_t s = 0; s < k; s += 32, rows32++) {
            int zero = 1;
            for (int64_t i = s; i < s + 32 && i < k; i++) zero &= (w[o * k + i] & 7) == 0 || dtype == AH_BF16;
            zero_rows += zero;
        }

    const int64_t ks = (k + 31) / 32, blocks = (n + AH_COLS - 1) / AH_COLS, groups = (m + AH_ROWS - 1) / AH_ROWS;
    const int PASSES = cached ? 101 : 5;
    const int calls = PASSES * copies;
    double *whole = malloc(sizeof(double) * (size_t)calls), *split = malloc(sizeof(double) * (size_t)calls);
    double *products = malloc(sizeof(double) * (size_t)calls), *pack = malloc(sizeof(double) * (size_t)calls);
    double *hot = malloc(sizeof(double) * (size_t)calls);
    uint32_t *bh = aligned_alloc(64, (size_t)(groups * ks * AH_TILE) * 2);
    if (!whole || !split || !products || !pack || !hot || !bh) return 1;
    uint32_t *bl = bh + groups * ks * AH_TILE / 4;
    uint16_t a_hi[AH_COLS * 32] __attribute__((aligned(64))), a_lo[AH_COLS * 32] __attribute__((aligned(64)));
    volatile uint16_t sink = 0;
    int call = 0;
    for (int pass = 0; pass <= PASSES; pass++)
        for (int c = 0; c < copies; c++) {
            const uint16_t *wc = w + (size_t)c * matrix;
            double t0 = cpu_seconds();
            if (amx_half_linear(dtype, x, m, k, wc, n, NULL, out, 1) != 0) return 1;
            double t1 = cpu_seconds();
            for (int64_t t = 0; t < blocks; t++)
                for (int64_t s = 0; s < ks; s++) ah_weight_tile(dtype, wc, n, k, t * AH_COLS, s, a_hi, a_lo);
            sink ^= a_hi[5] ^ a_lo[7];
            double t2 = cpu_seconds();
#if defined(AH_WHOLE_PACK) /* a source before ah_pack_x took a range of tiles */
            memset(bh, 0, (size_t)(groups * ks * AH_TILE) * 2);
            ah_pack_x(dtype, x, m, k, ks, bh, dtype == AH_F16 ? bl : NULL, NULL);
#else
            ah_pack_x(dtype, x, m, k, ks, 0, groups * ks, bh, bl, NULL);
#endif
            double t3 = cpu_seconds();
            for (int64_t t = 0; t < blocks; t++)
                for (int64_t s = 0; s < ks; s++) ah_weight_tile(dtype, wc, n, k, (t & 1) * AH_COLS, s, a_hi, a_lo);
            sink ^= a_hi[5] ^ a_lo[7];
            double t3b = cpu_seconds();
            ah_configure();
            _tile_loadd(4, a_hi, 64);
            _tile_loadd(7, a_lo, 64);
            _tile_zero(0);
            for (int64_t t = 0; t < blocks; t++)
                for (int64_t s = 0; s < ks; s++)
                    for (int64_t g = 0; g < groups; g++) {
                        _tile_loadd(5, bh + (g * ks + s) * (AH_TILE / 4), 64);
                        _tile_dpbf16ps(0, 4, 5);
                        if (dtype == AH_F16) {
                            _tile_loadd(6, bl + (g * ks + s) * (AH_TILE / 4), 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(0, 7, 5);
                            _tile_dpbf16ps(0, 7, 6);
                        }
                    }
            _tile_stored(0, out, 64);
            _tile_release();
            double t4 = cpu_seconds();
            if (!pass) continue;
            whole[call] = 1e6 * (t1 - t0), split[call] = 1e6 * (t2 - t1), pack[call] = 1e6 * (t3 - t2);
            products[call] = 1e6 * (t4 - t3b), hot[call++] = 1e6 * (t3b - t3);
        }
    const double bytes = (double)matrix * 2, w_ms = median(whole, calls);
    printf("%s %lld x %lld, %lld rows, 1 thread, %d calls (weights %s); CPU-time medians, us\n",
           dtype == AH_F16 ? "float16" : "bfloat16", (long long)n, (long long)k, (long long)m, calls,
           cached ? "the same each call: in cache" : "from memory");
    printf("  whole call        %9.1f  (%.2f GB/s of weights)\n", w_ms, bytes / w_ms * 1e-3);
    printf("  weight split      %9.1f  (ah_weight_tile, every block and step)\n", median(split, calls));
    printf("  weight split, hot %9.1f  (the same, blocks 0 and 1 over and over: in cache)\n", median(hot, calls));
    printf("  x packed          %9.1f\n", median(pack, calls));
    printf("  tile products     %9.1f  (A tiles in L1)\n", median(products, calls));
    printf("  32-value weight rows with all low halves zero: %.4f\n", (double)zero_rows / (double)rows32);
    free(whole), free(split), free(products), free(pack), free(hot), free(bh), free(w), free(x), free(out);
    return 0;
}
