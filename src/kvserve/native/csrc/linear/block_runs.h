/*
 * Shared by the projection kernels (linear_amx.c, linear_dot.c): a bf16 value as float, and
 * the work-sharing of their column blocks (or row-chunk x block items).  Each thread owns a
 * contiguous run that it walks from the front; a thread done with its own takes items from the
 * back of another's.  Stealing changes who computes an item, never how, so outputs are the
 * same bits whatever the timing.  Both ends of a run sit in one word, moved by compare-and-swap.
 */
#ifndef KVSERVE_BLOCK_RUNS_H
#define KVSERVE_BLOCK_RUNS_H
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_value(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef struct {
    _Alignas(64) uint64_t ends; /* front in the low 32 bits, back (exclusive) in the high */
} block_run;

static inline void run_init(block_run *run, int64_t begin, int64_t end) {
    __atomic_store_n(&run->ends, (uint64_t)end << 32 | (uint64_t)begin, __ATOMIC_RELAXED);
}

/* The next item from the front (owner) or the back (thief), or -1 when the run is empty. */
static inline int64_t run_take(block_run *run, int from_back) {
    uint64_t ends = __atomic_load_n(&run->ends, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = ends & 0xffffffffu, back = ends >> 32;
        if (front >= back) return -1;
        const uint64_t taken = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
        if (__atomic_compare_exchange_n(&run->ends, &ends, taken, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

/* An item from the back of the first run after thread t's with items left, or -1. */
static inline int64_t run_steal(block_run *runs, int t, int threads) {
    int64_t nb = -1;
    for (int i = 1; nb < 0 && i < threads; i++) nb = run_take(&runs[(t + i) % threads], 1);
    return nb;
}

/* Every thread's run: thread t's contiguous share of `count` items, then a barrier (inside
 * the parallel region). */
static inline void runs_init(block_run *runs, int64_t count) {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    run_init(&runs[t], count * t / threads, count * (t + 1) / threads);
    #pragma omp barrier
}
#endif
