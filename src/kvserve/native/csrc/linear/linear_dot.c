/*
 * y = x W^T (+ b) in bfloat16 with AVX512-BF16 dot products (vdpbf16ps), for a CPU without
 * AMX (AMD Zen 4/5): the same entry points as linear_amx.c (linear_bf16_packed,
 * silu_gate_up_bf16_packed), over the layout oneDNN packs a bf16 weight into on such a CPU.
 *
 * Why: a projection of our own lets csrc/decode_layer.c run a whole step's layers in C on
 * these CPUs too.  Through torch.compile the work between a decode step's projections cost
 * ~26 ms of a 128-row step of the embedded model (~164 ms) on an AMD EPYC without AMX:
 * guards, wrappers, the custom ops' dispatch, inductor's element-wise kernels.
 *
 * Layout (bf16 elements), as oneDNN's avx512_core_bf16 reorder writes it (models/
 * packed_linear.py checks it against oneDNN itself before it hands a weight here):
 * W[n][k] at ((n / 64) * (K / 2) + k / 2) * 128 + (n % 64) * 2 + k % 2, N padded to 64: per
 * block of 64 columns, K / 2 lines of 256 bytes, each a pair of k for 64 columns, which is
 * four vectors of vdpbf16ps's operand layout.
 *
 * The micro-kernel keeps ROWS x 64 float32 sums in 4 x ROWS registers (24 of the 32 at six
 * rows); per pair of k it loads the block's line once and multiplies it with each row's
 * broadcast pair.  The work is (row chunk, column block) items, a run of them per thread
 * (block_runs.h: others steal from its back), every row tile of a chunk over a block while the
 * block sits in L2.  Against oneDNN on the same packed weights: 1.03-1.08x faster at 128 rows,
 * 0.99-1.03x at 2,048 (docs/decisions/projection-kernels.md).
 *
 *   x    [M, K] bf16, row stride x_stride elements
 *   out  [M, N] bf16, row stride out_stride elements
 *   bias [N] bf16 or NULL
 * K and x_stride even; M a multiple of 16 (as linear_amx.c); silu_gate_up's features a
 * multiple of 64.  Returns 0, or 1 where the shapes do not fit (the caller keeps oneDNN).
 */
#include <stdint.h>
#include <string.h>

#include "linear/linear.h"

#if KVSERVE_LINEAR_DOT
#include <immintrin.h>
#include <omp.h>

#include "linear/block_runs.h"
#include "common/vec_exp.h"

#define BLOCK_COLS 64
#define TILE_ROWS 6
/* Prefill steps run in chunks of this many rows: a chunk's rows (128 x 1,536 bf16 at most for
 * the embedded model, 384 KB) and the block being multiplied (up to 192 KB) stay in L2. */
#define ROW_CHUNK 128


/* acc[r][0..3] = sum over k of x[r][k] x block[k][0..63] for `rows` (<= TILE_ROWS) rows. */
#define DEFINE_TILE(R)                                                                         \
    static void tile_##R(const uint16_t *x, int64_t x_stride, const uint16_t *block,          \
                         int64_t pairs, float *acc) {                                          \
        __m512 a[R][4];                                                                        \
        for (int r = 0; r < R; r++)                                                            \
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();                         \
        const uint32_t *rows = (const uint32_t *)x;                                            \
        const int64_t stride = x_stride / 2;                                                   \
        for (int64_t p = 0; p < pairs; p++) {                                                  \
            const __m512bh *line = (const __m512bh *)(block + p * 128);                        \
            const __m512bh w0 = line[0], w1 = line[1], w2 = line[2], w3 = line[3];             \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)rows[r * stride + p]);     \
                a[r][0] = _mm512_dpbf16_ps(a[r][0], b, w0);                                    \
                a[r][1] = _mm512_dpbf16_ps(a[r][1], b, w1);                                    \
                a[r][2] = _mm512_dpbf16_ps(a[r][2], b, w2);                                    \
                a[r][3] = _mm512_dpbf16_ps(a[r][3], b, w3);                                    \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * 64 + 16 * c, a[r][c]);     \
    }
DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4) DEFINE_TILE(5) DEFINE_TILE(6)
typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *);
static const tile_fn TILE_BY_ROWS[TILE_ROWS + 1] = {0, tile_1, tile_2, tile_3,
                                                    tile_4, tile_5, tile_6};

/* The next item for thread t: its own run's front, else the back of another's. */
static inline int64_t take_block(block_run *runs, int t, int threads) {
    const int64_t nb = run_take(&runs[t], 0);
    return nb >= 0 ? nb : run_steal(runs, t, threads);
}

/* acc [m, 64] float32 = rows x block, in tiles of at most TILE_ROWS rows, as even as they
 * can be (a chunk of 128 rows as 18 tiles of 6 and 4 of 5, not 21 of 6 and one of 2). */
static void block_product(const uint16_t *x, int64_t x_stride, const uint16_t *block, int64_t k,
                          int64_t m, float *acc) {
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = m * i / tiles, rows = m * (i + 1) / tiles - r0;
        TILE_BY_ROWS[rows](x + r0 * x_stride, x_stride, block, k / 2, acc + r0 * 64);
    }
}

/* The rows of one work item: chunk `c` of `m` rows in chunks of `chunk`. */
static inline int64_t chunk_rows(int64_t c, int64_t chunk, int64_t m, int64_t *r0) {
    *r0 = c * chunk;
    return m - *r0 < chunk ? m - *r0 : chunk;
}

/* The work is items (row chunk, column block), chunk-major, shared out as runs: a chunk's
 * rows stay in L2 across its blocks.  Chunks are halved (to 16 rows) while there are fewer
 * than 8 items a thread, so that a few column blocks (9 for a 576-column projection) still
 * split evenly between the threads: 5 against 4 blocks kept one core idle 10% of the call. */
static int64_t chunk_for(int64_t m, int64_t blocks, int threads) {
    int64_t chunk = ROW_CHUNK;
    while (chunk > 16 && ((m + chunk - 1) / chunk) * blocks < 8 * threads) chunk /= 2;
    return chunk;
}

int linear_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                       const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t m,
                       int64_t n, int64_t k, int num_threads) {
    if (m % 16 || k % 2 || x_stride % 2 || m < 1 || num_threads < 1) return 1;
    const int64_t blocks = (n + BLOCK_COLS - 1) / BLOCK_COLS, block_elems = (k / 2) * 128;
    const int64_t chunk = chunk_for(m, blocks, num_threads);
    const int64_t items = (m + chunk - 1) / chunk * blocks;
    block_run runs[num_threads];
    #pragma omp parallel num_threads(num_threads)
    {
        float acc[ROW_CHUNK * 64];
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        int64_t item;
        runs_init(runs, items);
        while ((item = take_block(runs, t, threads)) >= 0) {
            const int64_t nb = item % blocks, col0 = nb * BLOCK_COLS;
            int64_t r0;
            const int64_t rows = chunk_rows(item / blocks, chunk, m, &r0);
            const int cols = n - col0 < BLOCK_COLS ? (int)(n - col0) : BLOCK_COLS;
            float b[64] = {0};
            if (bias)
                for (int c = 0; c < cols; c++) b[c] = bf16_value(bias[col0 + c]);
            block_product(x + r0 * x_stride, x_stride, weight + nb * block_elems, k, rows, acc);
            for (int64_t r = 0; r < rows; r++)
                for (int c = 0; c < cols; c += 32) {
                    const int left = cols - c;
                    const __mmask32 live = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
                    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + r * 64 + c),
                                                    _mm512_loadu_ps(b + c));
                    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + r * 64 + c + 16),
                                                    _mm512_loadu_ps(b + c + 16));
                    _mm512_mask_storeu_epi16(out + (r0 + r) * out_stride + col0 + c, live,
                                             (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
        }
    }
    return 0;
}

/* SiLU(x Wg^T) x (x Wu^T) with `weight` the packed gate_up projection [Wg; Wu]: an item is a
 * row chunk and a gate block j with its up block j + features / 64, whose product it writes. */
int silu_gate_up_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int64_t m, int64_t features,
                             int64_t k, int num_threads) {
    if (m % 16 || k % 2 || x_stride % 2 || features % BLOCK_COLS || m < 1 || num_threads < 1)
        return 1;
    const int64_t pairs = features / BLOCK_COLS, block_elems = (k / 2) * 128;
    const int64_t chunk = chunk_for(m, pairs, num_threads);
    const int64_t items = (m + chunk - 1) / chunk * pairs;
    block_run runs[num_threads];
    #pragma omp parallel num_threads(num_threads)
    {
        float gate[TILE_ROWS * 64], up[TILE_ROWS * 64];
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        int64_t item;
        runs_init(runs, items);
        while ((item = take_block(runs, t, threads)) >= 0) {
            const int64_t j = item % pairs;
            const uint16_t *gate_block = weight + j * block_elems;
            const uint16_t *up_block = weight + (j + pairs) * block_elems;
            int64_t first;
            const int64_t rows = chunk_rows(item / pairs, chunk, m, &first);
            const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
            for (int64_t i = 0; i < tiles; i++) {
                const int64_t r0 = first + rows * i / tiles;
                const int n = (int)(first + rows * (i + 1) / tiles - r0);
                TILE_BY_ROWS[n](x + r0 * x_stride, x_stride, gate_block, k / 2, gate);
                TILE_BY_ROWS[n](x + r0 * x_stride, x_stride, up_block, k / 2, up);
                for (int r = 0; r < n; r++)
                    for (int c = 0; c < 64; c += 32) {
                        const __m512 lo = silu_times16(_mm512_loadu_ps(gate + r * 64 + c),
                                                       _mm512_loadu_ps(up + r * 64 + c));
                        const __m512 hi = silu_times16(_mm512_loadu_ps(gate + r * 64 + c + 16),
                                                       _mm512_loadu_ps(up + r * 64 + c + 16));
                        _mm512_storeu_si512((void *)(out + (r0 + r) * out_stride + j * 64 + c),
                                            (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                    }
            }
        }
    }
    return 0;
}

int linear_packed_block_cols(void) { return BLOCK_COLS; }
#endif
