/*
 * y = x W^T (+ b) for a few rows (a decode step) in bfloat16 on AMX tiles, reading the weight
 * in oneDNN's own prepacked layout (models/packed_linear.py checks that layout once per shape
 * before it hands a weight here, and keeps oneDNN for everything else).
 *
 * At 48 rows oneDNN streamed the embedded model's 212 MB of projections at ~11 GB/s on two
 * cores, where a plain read runs at ~26: a decode step of a small batch is bound by how fast
 * its weights stream, and the arithmetic (on AMX) is a small part of it.  Here each thread
 * walks its own run of 32-column weight blocks once, for all the rows, with the rows' tiles
 * reloaded from L1/L2; with more than 32 rows the passes over a block ask for the next block
 * into L2 (next_block_slice; docs/decisions/projection-kernels.md).
 *
 * Layout (bf16 elements): W[n][k] at ((n / 32) * (K / 2) + k / 2) * 64 + (n % 32) * 2 + k % 2,
 * N padded to 32: per block of 32 columns, K / 2 lines of 128 bytes, each a pair of k for 32
 * columns.  16 such lines are two B tiles (columns 0-15 and 16-31) at a 128-byte stride.
 *
 *   x    [M, K] bf16, row stride x_stride elements; M a multiple of 16
 *   out  [M, N] bf16, row stride out_stride elements
 *   bias [N] bf16 or NULL
 * K: a multiple of 32.  Returns 0, or 1 where the CPU refuses AMX or the shapes do not fit (the
 * caller keeps oneDNN).  A build without AMX has linear_dot.c's kernels under the same names.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <string.h>

#include "linear/linear.h"

#if KVSERVE_LINEAR_AMX
#include <immintrin.h>
#include <omp.h>
#include "common/amx_tiles.h"
#include "linear/block_runs.h"
#include "common/vec_exp.h"

/* Measured at 16-64 rows: 4 k-steps ahead (8 KB) gained up to 8% at 32 rows; 8 or more lost. */
#define PREFETCH_AHEAD 4

/* Larger calls (prefill steps) run in chunks of this many rows, each over all the columns: a
 * chunk's rows (256 x 1,536 bf16 at most for the embedded model, 768 KB) stay in L2 across the
 * column blocks, and the layer's weights come from the last-level cache once a chunk.  Over
 * the whole 2,048 rows of a prefill step at once, the rows were re-read from memory for every
 * column block: 16.5 against 14.3 ms for a layer's qkv, o and down projections. */
#define ROW_CHUNK 256

/* Columns [32 nb, 32 nb + 32) of rows [r0, r0 + 16 * row_tiles) (row_tiles 1 or 2).
 * fetch, when not NULL: `fetch_lines` cache lines from there are asked into L2, spread over the
 * k-steps (see next_block_slice). */
static void column_block(const uint16_t *x, int64_t x_stride, const uint16_t *block, int64_t k,
                         int row_tiles, float *acc, const char *fetch, int64_t fetch_lines,
                         int first_pass) {
    const int64_t steps = k / 32, per_step = (fetch_lines + steps - 1) / steps;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kb = 0; kb < steps; kb++) {
        const uint16_t *b = block + kb * 16 * 64;
        for (int64_t line = kb * per_step; line < (kb + 1) * per_step && line < fetch_lines; line++)
            _mm_prefetch(fetch + line * 64, _MM_HINT_T1);
        if (first_pass) {
            /* The weight lines PREFETCH_AHEAD k-steps on (into the next block past the last):
             * the stream's memory requests kept in flight while the tiles compute. */
            const char *ahead = (const char *)(b + PREFETCH_AHEAD * 16 * 64);
            for (int line = 0; line < 32; line++) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        }
        _tile_loadd(2, b, 128);
        _tile_loadd(3, b + 32, 128);
        _tile_loadd(0, x + kb * 32, x_stride * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (row_tiles > 1) {
            _tile_loadd(1, x + 16 * x_stride + kb * 32, x_stride * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, acc, 32 * 4);
    _tile_stored(5, acc + 16, 32 * 4);
    if (row_tiles > 1) {
        _tile_stored(6, acc + 16 * 32, 32 * 4);
        _tile_stored(7, acc + 16 * 32 + 16, 32 * 4);
    }
}

/* A weight block is used once per 32 rows: without help, the first pass over it waits for
 * memory and the later ones (from the caches) leave the memory bus idle.  The passes ask for
 * slices of the thread's next block (into L2), so that the stream runs under their arithmetic:
 * with 3 or more passes every pass takes a slice (128 rows x the embedded model's projections:
 * 22.1 -> 20.8 ms with the later passes alone, -> 19.9-20.6 with all of them); with 2, only
 * the second (all of them measured 2-4% slower at 48-64 rows).  Pass `pass` of `passes` over
 * the current block: where its slice of the block at `next` (NULL: no next block) starts,
 * and in *lines how many lines it has. */
static inline const char *next_block_slice(const uint16_t *next, int64_t k, int64_t pass,
                                           int64_t passes, int64_t *lines) {
    const int64_t from = passes >= 3 ? 0 : 1, slices = passes - from;
    /* a block: k / 2 lines of 64 bf16 = 64 k bytes = k cache lines */
    const int64_t block_lines = k, per_slice = slices > 0 ? (block_lines + slices - 1) / slices : 0;
    const int64_t first = (pass - from) * per_slice;
    *lines = !next || pass < from || first >= block_lines ? 0
             : block_lines - first < per_slice ? block_lines - first : per_slice;
    return *lines ? (const char *)next + first * 64 : NULL;
}

/* The column blocks of one call are shared as runs (block_runs.h).  Static halves left one
 * core waiting for the other: the two cores' AMX units do not run at the same speed on a
 * shared host (two threads of equal tile work measured 2.1 and 2.6 s, one waiting 11-12% of
 * the time; the main thread sat in libgomp for 46% of the native decode layers' time). */
int linear_amx_stealing = 1; /* benchmarks compare static halves (0) with stealing (1) */

int linear_amx_set_stealing(int on) {
    const int was = linear_amx_stealing;
    linear_amx_stealing = on != 0;
    return was;
}

/* The block this thread computes next: its own run's front, else (stealing on) the back of
 * the first other run with blocks left; -1 when none is left.  *next: the block after it in
 * the same run, or -1 where it is not known to be this thread's (a stolen one). */
static inline int64_t next_block(block_run *runs, int t, int threads, int64_t *next) {
    int64_t nb = run_take(&runs[t], 0);
    if (nb >= 0) {
        const uint64_t ends = __atomic_load_n(&runs[t].ends, __ATOMIC_RELAXED);
        *next = (int64_t)(ends & 0xffffffffu) < (int64_t)(ends >> 32) ? nb + 1 : -1;
        return nb;
    }
    *next = -1;
    return linear_amx_stealing ? run_steal(runs, t, threads) : -1;
}

/* linear_bf16_packed on at most ROW_CHUNK rows. */
static void linear_rows(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                        const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t m,
                        int64_t n, int64_t k, int num_threads) {
    const int64_t blocks = (n + 31) / 32;
    const int64_t passes = (m + 31) / 32, block_elems = (k / 2) * 64;
    block_run runs[num_threads > 0 ? num_threads : 1];
    #pragma omp parallel num_threads(num_threads)
    {
        float acc[32 * 32];
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        int64_t nb, after;
        runs_init(runs, blocks);
        amx_configure_tiles();
        while ((nb = next_block(runs, t, threads, &after)) >= 0) {
            const uint16_t *block = weight + nb * block_elems;
            const uint16_t *next = after >= 0 ? weight + after * block_elems : NULL;
            const int cols = n - nb * 32 < 32 ? (int)(n - nb * 32) : 32;
            const __mmask32 live = cols == 32 ? 0xffffffffu : (__mmask32)((1ull << cols) - 1);
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            if (bias) {
                for (int c = 0; c < 16; c++) ((float *)&b0)[c] = c < cols ? bf16_value(bias[nb * 32 + c]) : 0.0f;
                for (int c = 16; c < 32; c++) ((float *)&b1)[c - 16] = c < cols ? bf16_value(bias[nb * 32 + c]) : 0.0f;
            }
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                const int row_tiles = m - r0 >= 32 ? 2 : 1;
                int64_t lines;
                const char *fetch = next_block_slice(next, k, r0 / 32, passes, &lines);
                column_block(x + r0 * x_stride, x_stride, block, k, row_tiles, acc, fetch, lines,
                             r0 == 0);
                for (int r = 0; r < 16 * row_tiles; r++) {
                    __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + r * 32), b0);
                    __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + r * 32 + 16), b1);
                    _mm512_mask_storeu_epi16(out + (r0 + r) * out_stride + nb * 32, live,
                                             (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
        }
        _tile_release();
    }
}

int linear_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                       const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t m,
                       int64_t n, int64_t k, int num_threads) {
    if (!amx_permitted() || m % 16 || k % 32 || m < 1) return 1;
    for (int64_t r = 0; r < m; r += ROW_CHUNK)
        linear_rows(x + r * x_stride, x_stride, weight, bias, out + r * out_stride, out_stride,
                    m - r < ROW_CHUNK ? m - r : ROW_CHUNK, n, k, num_threads);
    return 0;
}

/* SiLU(x Wg^T) x (x Wu^T) where `weight` is the packed gate_up projection, [Wg; Wu] (2 x
 * features rows): each thread computes a gate block and its up block (j and j + features /
 * 32) and writes their product, [M, features].  The separate SiLU pass read a gate_up output
 * that the two threads had written in halves (gate by one, up by the other), and ran 2x
 * slower right after the projection than on the same tensor warm (71 against 36 us at 64
 * rows x 3,072). */
static void silu_gate_up_rows(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                              uint16_t *out, int64_t out_stride, int64_t m, int64_t features,
                              int64_t k, int num_threads) {
    const int64_t pairs = features / 32, passes = (m + 31) / 32, block_elems = (k / 2) * 64;
    block_run runs[num_threads > 0 ? num_threads : 1];
    #pragma omp parallel num_threads(num_threads)
    {
        float gate[32 * 32], up[32 * 32];
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        int64_t j, after;
        runs_init(runs, pairs);
        amx_configure_tiles();
        while ((j = next_block(runs, t, threads, &after)) >= 0) {
            const uint16_t *gate_block = weight + j * block_elems;
            const uint16_t *up_block = weight + (j + pairs) * block_elems;
            const int more = after >= 0;
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                const int row_tiles = m - r0 >= 32 ? 2 : 1;
                const uint16_t *rows = x + r0 * x_stride;
                int64_t lines;
                const char *fetch = next_block_slice(more ? gate_block + block_elems : NULL, k,
                                                     r0 / 32, passes, &lines);
                column_block(rows, x_stride, gate_block, k, row_tiles, gate, fetch, lines, r0 == 0);
                fetch = next_block_slice(more ? up_block + block_elems : NULL, k, r0 / 32,
                                         passes, &lines);
                column_block(rows, x_stride, up_block, k, row_tiles, up, fetch, lines, r0 == 0);
                for (int r = 0; r < 16 * row_tiles; r++) {
                    __m512 lo = silu_times16(_mm512_loadu_ps(gate + r * 32), _mm512_loadu_ps(up + r * 32));
                    __m512 hi = silu_times16(_mm512_loadu_ps(gate + r * 32 + 16),
                                             _mm512_loadu_ps(up + r * 32 + 16));
                    _mm512_storeu_si512((void *)(out + (r0 + r) * out_stride + j * 32),
                                        (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
        }
        _tile_release();
    }
}

int silu_gate_up_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int64_t m, int64_t features,
                             int64_t k, int num_threads) {
    if (!amx_permitted() || m % 16 || k % 32 || features % 32 || m < 1) return 1;
    for (int64_t r = 0; r < m; r += ROW_CHUNK)
        silu_gate_up_rows(x + r * x_stride, x_stride, weight, out + r * out_stride, out_stride,
                          m - r < ROW_CHUNK ? m - r : ROW_CHUNK, features, k, num_threads);
    return 0;
}

int linear_packed_block_cols(void) { return 32; }
#elif !KVSERVE_LINEAR_DOT /* neither kernel: stubs that decline */
int linear_packed_block_cols(void) { return 0; }

int silu_gate_up_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int64_t m, int64_t features,
                             int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)weight, (void)out, (void)out_stride;
    (void)m, (void)features, (void)k, (void)num_threads;
    return 1;
}

int linear_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                       const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t m,
                       int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)weight, (void)bias, (void)out, (void)out_stride;
    (void)m, (void)n, (void)k, (void)num_threads;
    return 1;
}
#endif
