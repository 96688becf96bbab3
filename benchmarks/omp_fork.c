/* What one OpenMP fork/join costs against one barrier inside a team that stays up: the fixed cost a replayed
 * decode step pays per kernel entry that opens its own `#pragma omp parallel` region (docs/performance.md,
 * "Thread-team forks per decode step").
 *
 *     gcc -O2 -fopenmp -std=c11 benchmarks/omp_fork.c -o /tmp/omp_fork
 *     OMP_NUM_THREADS=2 /tmp/omp_fork [WORK_NS]                    # libgomp's default spin
 *     OMP_NUM_THREADS=2 GOMP_SPINCOUNT=300000 /tmp/omp_fork        # as the serving core sets it
 *     OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE /tmp/omp_fork      # threads sleep at once
 *
 * Five loops of 20000 iterations, each reported as the 10th and 50th percentile over 25 batches of ns per
 * iteration (on a shared machine the low percentile is the runtime, the median adds the other processes):
 *   fork        an empty `omp parallel` region, back to back (a fork and a join);
 *   fork+work   a region whose threads each spin WORK_NS / threads ns (work split in two);
 *   serial      the same WORK_NS on the calling thread alone, no region;
 *   barrier     one region for all iterations, an `omp barrier` per iteration (what one team per step pays
 *               between entries);
 *   if(false)   an empty region whose `if` clause is false (it still calls GOMP_parallel, for a team of one).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { ITERATIONS = 20000, BATCHES = 25 };

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

/* Busy work of about ns nanoseconds (the clock read in a loop; the compiler cannot drop it). */
static void spin_ns(double ns) {
    const double until = now_ns() + ns;
    while (now_ns() < until) {
    }
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *name, double *per_batch) {
    qsort(per_batch, BATCHES, sizeof *per_batch, by_value);
    printf("%-10s p10 %8.0f ns  p50 %8.0f ns\n", name, per_batch[BATCHES / 10], per_batch[BATCHES / 2]);
}

int main(int argc, char **argv) {
    const double work = argc > 1 ? atof(argv[1]) : 2000.0;
    const int threads = omp_get_max_threads();
    double fork[BATCHES], fork_work[BATCHES], serial[BATCHES], barrier[BATCHES], if_false[BATCHES];
    volatile int split = 0;
    printf("threads %d, work %.0f ns, GOMP_SPINCOUNT=%s OMP_WAIT_POLICY=%s\n", threads, work,
           getenv("GOMP_SPINCOUNT") ? getenv("GOMP_SPINCOUNT") : "(unset)",
           getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "(unset)");
#pragma omp parallel
    spin_ns(1e6); /* the team exists before the first measurement */
    for (int b = 0; b < BATCHES; b++) { /* interleaved: each batch visits every loop */
        double start = now_ns();
        for (int i = 0; i < ITERATIONS; i++) {
#pragma omp parallel
            __asm__ volatile("" ::: "memory");
        }
        fork[b] = (now_ns() - start) / ITERATIONS;
        start = now_ns();
        for (int i = 0; i < ITERATIONS; i++) {
#pragma omp parallel
            spin_ns(work / omp_get_num_threads());
        }
        fork_work[b] = (now_ns() - start) / ITERATIONS;
        start = now_ns();
        for (int i = 0; i < ITERATIONS; i++) spin_ns(work);
        serial[b] = (now_ns() - start) / ITERATIONS;
        start = now_ns();
#pragma omp parallel
        for (int i = 0; i < ITERATIONS; i++) {
#pragma omp barrier
        }
        barrier[b] = (now_ns() - start) / ITERATIONS;
        start = now_ns();
        for (int i = 0; i < ITERATIONS; i++) {
#pragma omp parallel if (split)
            __asm__ volatile("" ::: "memory");
        }
        if_false[b] = (now_ns() - start) / ITERATIONS;
    }
    report("fork", fork);
    report("fork+work", fork_work);
    report("serial", serial);
    report("barrier", barrier);
    report("if(false)", if_false);
    return 0;
}
