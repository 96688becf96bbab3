/* Where one call of amx_quant_matmul spends its time, phase by phase and thread by thread: buffer set-up,
 * the OpenMP fork, the activation quantization (with the barrier after it), the tile configuration, the
 * tiles, the tile release and the join. The kernel's AQ_PHASE hooks stamp the time stamp counter; each
 * phase is reported as its 10th and 50th percentile over the calls (on a shared machine the low
 * percentiles are the kernel, the high ones the other processes).
 *
 *     gcc -O3 -march=native -fopenmp -std=c11 -I pluginfer/backends/cpu/csrc benchmarks/amx_phases.c -o /tmp/amx_phases -lm
 *     /tmp/amx_phases TYPE OUT IN ROWS THREADS      # TYPE: GGML type, 2 Q4_0, 8 Q8_0, 12 Q4_K, 14 Q6_K
 *     /tmp/amx_phases 2 1024 2816 16 2              # the 0.5B llama's down projection, 16 rows, 2 threads
 *
 * Weights: random blocks (valid fp16 scales), 256 MiB of distinct copies cycled so that each call reads
 * its weights from memory, as in a decode step; 5 passes after one warm-up pass. Another kernel source
 * (a tree before a change, the same hooks added) with -DAQ_SOURCE='"path/amx_quant.c"'.
 */
#define _GNU_SOURCE
#include <x86intrin.h>

static unsigned long long aq_stamps[64][8];
#define AQ_PHASE(thread, phase) (aq_stamps[(thread) & 63][phase] = __rdtsc())
#ifndef AQ_SOURCE
#define AQ_SOURCE "../pluginfer/backends/cpu/csrc/amx_quant.c"
#endif
#include AQ_SOURCE

#include <stdio.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The p-th fraction of values[0..count) (sorted in place). */
static double percentile(double *values, int count, double p) {
    qsort(values, (size_t)count, sizeof *values, by_value);
    return values[(int)(p * (count - 1))];
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s TYPE OUT IN ROWS THREADS\n", argv[0]);
        return 2;
    }
    const int type = atoi(argv[1]), threads = atoi(argv[5]);
    const int64_t n = atoll(argv[2]), k = atoll(argv[3]), m = atoll(argv[4]);
    int64_t weights, bytes;
    if (!aq_block(type, &weights, &bytes) || k % weights || n <= 0 || m <= 0 || threads < 1 || threads > 64) {
        fprintf(stderr, "TYPE must be 2, 8, 12 or 14, IN a multiple of its block, OUT, ROWS, THREADS (1..64) positive\n");
        return 2;
    }
    if (amx_quant_init() != 0) {
        fprintf(stderr, "no AMX tile state here\n");
        return 1;
    }
    const int64_t row_bytes = k / weights * bytes;
    const size_t matrix = (size_t)(n * row_bytes);
    int copies = (int)((256u << 20) / matrix);
    if (copies < 2) copies = 2;
    uint8_t *w = malloc(matrix * (size_t)copies);
    float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * n));
    if (!w || !x || !out) return 1;
    srand(1);
    for (size_t i = 0; i < matrix * (size_t)copies; i++) w[i] = (uint8_t)rand();
    const uint16_t scale = 0x2000; /* fp16 2^-7: no NaN, infinity or subnormal scales from random bytes */
    for (size_t r = 0; r < (size_t)n * (size_t)copies; r++)
        for (int64_t b = 0; b < k / weights; b++) {
            uint8_t *block = w + r * (size_t)row_bytes + (size_t)(b * bytes);
            if (type == AQ_Q6_K) memcpy(block + 208, &scale, 2);
            else memcpy(block, &scale, 2);
            if (type == AQ_Q4_K) memcpy(block + 2, &scale, 2);
        }
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    omp_set_num_threads(threads);

    const double start = seconds();
    const unsigned long long ticks = __rdtsc();
    while (seconds() - start < 0.05) {
    }
    const double per_ms = (double)(__rdtsc() - ticks) / ((seconds() - start) * 1e3);

    enum { PASSES = 5 };
    const int calls = PASSES * copies, columns = 2 + 5 * threads + 1;
    double *phase = malloc(sizeof(double) * (size_t)(calls * columns)), *column = malloc(sizeof(double) * (size_t)calls);
    if (!phase || !column) return 1;
    int call = 0;
    for (int pass = 0; pass <= PASSES; pass++)
        for (int c = 0; c < copies; c++) {
            if (amx_quant_matmul(type, x, m, k, w + (size_t)c * matrix, n, row_bytes, out) != 0) return 1;
            if (!pass) continue;
            double *row = phase + (size_t)call++ * (size_t)columns;
            unsigned long long(*s)[8] = aq_stamps;
            row[0] = (double)(s[0][7] - s[0][0]) / per_ms;
            row[1] = (double)(s[0][1] - s[0][0]) / per_ms;
            for (int t = 0; t < threads; t++) {
                row[2 + 5 * t] = (double)(s[t][2] - s[0][1]) / per_ms;
                for (int i = 1; i < 5; i++) row[2 + 5 * t + i] = (double)(s[t][2 + i] - s[t][1 + i]) / per_ms;
            }
            row[columns - 1] = (double)(s[0][7] - s[0][6]) / per_ms;
        }
    printf("GGML type %d, %lld x %lld, %lld rows, %d threads, %d calls (weights from memory); ms p10 / p50\n", type,
           (long long)n, (long long)k, (long long)m, threads, calls);
    static const char *names[] = {"fork", "quantize (+barrier)", "configure tiles", "tiles", "release tiles"};
    for (int j = 0; j < columns; j++) {
        for (int i = 0; i < calls; i++) column[i] = phase[(size_t)i * (size_t)columns + (size_t)j];
        const double p10 = percentile(column, calls, 0.1), p50 = percentile(column, calls, 0.5);
        if (j == 0) printf("  %-28s %.4f / %.4f\n", "whole call", p10, p50);
        else if (j == 1) printf("  %-28s %.4f / %.4f\n", "buffers", p10, p50);
        else if (j == columns - 1) printf("  %-28s %.4f / %.4f\n", "join", p10, p50);
        else printf("  thread %d %-19s %.4f / %.4f\n", (j - 2) / 5, names[(j - 2) % 5], p10, p50);
    }
    free(phase), free(column), free(w), free(x), free(out);
    return 0;
}
