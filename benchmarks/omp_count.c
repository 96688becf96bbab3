/* Counts the OpenMP regions a process opens: loaded by benchmarks/replay_entries.py (ctypes, RTLD_GLOBAL) before
 * the native library, so that the library's GOMP_parallel resolves here first; each call is counted (as a
 * fork when the region runs on more than one thread: GCC passes num_threads 1 for an `if` clause found false)
 * and handed on to the libgomp already loaded.
 *
 *     gcc -O2 -shared -fPIC benchmarks/omp_count.c -o /tmp/omp_count.so -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);

static gomp_parallel_fn real_parallel;
int64_t omp_count_regions, omp_count_forks;

void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
    if (!real_parallel) {
        void *gomp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
        real_parallel = (gomp_parallel_fn)dlsym(gomp ? gomp : RTLD_NEXT, "GOMP_parallel");
    }
    __atomic_add_fetch(&omp_count_regions, 1, __ATOMIC_RELAXED);
    if (num_threads != 1) __atomic_add_fetch(&omp_count_forks, 1, __ATOMIC_RELAXED);
    real_parallel(fn, data, num_threads, flags);
}
