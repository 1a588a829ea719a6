/*
 * y = x W^T (+ b) in float32 over an 8-bit block-quantized weight (Q8_0-like): for a decode
 * step's few rows, where a projection is bound by reading its weight.
 *
 * Why: a float32 decode step of the embedded model reads ~540 MB of weights (its layers' and
 * the LM head's), ~49 ms of a 64 ms step at the ~11 GB/s that MKL's sgemv streams on a 2-core
 * AMD EPYC.  The same weights as int8 codes with one float32 scale per 32 values are 3.6x
 * fewer bytes; dequantizing them in registers costs a few instructions per 8 weights, shared
 * by every row of the step (docs/decisions/int8-weights.md).
 *
 * Layout (models/quantized_linear.py writes it):
 *   codes  [N, Kp] int8, Kp = K rounded up to a multiple of 32 (zero codes past K)
 *   scales [N, Kp / 32] float32: W[n][k] = codes[n][k] * scales[n][k / 32]
 *   x      [M, K] float32, row stride x_stride elements
 *   out    [M, N] float32, row stride out_stride elements
 *   bias   [N] float32 or NULL
 * Each thread takes a contiguous run of output columns (each weight row is read once per
 * call, whatever M), and multiplies it with every row in tiles of up to TILE_ROWS rows.
 * Returns 0, or 1 where the arguments do not fit (the caller keeps torch's product).
 */
#include <stdint.h>

#include "linear/linear.h"

#include <omp.h>

#define QBLOCK 32
#define TILE_ROWS 3

/* The dequantized value of code c in a block of scale s: the reference's product, exactly. */
static inline float dequant(int8_t c, float s) { return (float)c * s; }

/* The last partial block (K % 32 values) and any build: plain C, the reference's terms. */
static void column_tail(const float *x, int64_t x_stride, const int8_t *codes, float scale,
                        int64_t k0, int64_t k, int64_t rows, float *sums) {
    for (int64_t r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int64_t i = k0; i < k; i++) s += x[r * x_stride + i] * dequant(codes[i - k0], scale);
        sums[r] += s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "common/hsum.h"

/* Eight codes at p, dequantized: sign-extended, converted, times the block's scale. */
static inline __m256 load8(const int8_t *p, __m256 scale) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
}

/* sums[r] = row r of x times one weight row over its `full` whole blocks, R rows: four
 * accumulators a row, so that the additions of a block do not wait on one another. */
#define DEFINE_COLUMN(R)                                                                       \
    static void column_##R(const float *x, int64_t x_stride, const int8_t *codes,            \
                           const float *scales, int64_t full, float *sums) {                   \
        __m256 a[R][4];                                                                        \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();                         \
        for (int64_t b = 0; b < full; b++) {                                                   \
            const __m256 s = _mm256_set1_ps(scales[b]);                                        \
            const int8_t *c = codes + b * QBLOCK;                                              \
            const __m256 w0 = load8(c, s), w1 = load8(c + 8, s);                               \
            const __m256 w2 = load8(c + 16, s), w3 = load8(c + 24, s);                         \
            for (int r = 0; r < R; r++) {                                                      \
                const float *xr = x + r * x_stride + b * QBLOCK;                               \
                a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a[r][0]);                   \
                a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, a[r][1]);               \
                a[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, a[r][2]);              \
                a[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, a[r][3]);              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            sums[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]),                     \
                                          _mm256_add_ps(a[r][2], a[r][3])));                   \
    }
DEFINE_COLUMN(1) DEFINE_COLUMN(2) DEFINE_COLUMN(3)
typedef void (*column_fn)(const float *, int64_t, const int8_t *, const float *, int64_t,
                          float *);
static const column_fn COLUMN_BY_ROWS[TILE_ROWS + 1] = {0, column_1, column_2, column_3};

static void column_blocks(const float *x, int64_t x_stride, const int8_t *codes,
                          const float *scales, int64_t full, int64_t rows, float *sums) {
    COLUMN_BY_ROWS[rows](x, x_stride, codes, scales, full, sums);
}
#else
/* Portable: the same blocks in plain C (the compiler vectorizes the inner loop). */
static void column_blocks(const float *x, int64_t x_stride, const int8_t *codes,
                          const float *scales, int64_t full, int64_t rows, float *sums) {
    for (int64_t r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int64_t b = 0; b < full; b++) {
            float block = 0.0f;
            for (int i = 0; i < QBLOCK; i++)
                block += x[r * x_stride + b * QBLOCK + i] * dequant(codes[b * QBLOCK + i], 1.0f);
            s += block * scales[b];
        }
        sums[r] = s;
    }
}
#endif

/* Output column n for every row, in tiles of up to TILE_ROWS rows. */
static void one_column(const float *x, int64_t x_stride, const int8_t *codes,
                       const float *scales, float bias, float *out, int64_t out_stride,
                       int64_t m, int64_t n, int64_t k) {
    const int64_t full = k / QBLOCK, blocks = (k + QBLOCK - 1) / QBLOCK;
    for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
        const int64_t rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
        float sums[TILE_ROWS];
        const float *xr = x + r0 * x_stride;
        column_blocks(xr, x_stride, codes, scales, full, rows, sums);
        if (full < blocks)
            column_tail(xr, x_stride, codes + full * QBLOCK, scales[full], full * QBLOCK, k,
                        rows, sums);
        for (int64_t r = 0; r < rows; r++) out[(r0 + r) * out_stride + n] = sums[r] + bias;
    }
}

int linear_q8_f32(const float *x, int64_t x_stride, const int8_t *codes, const float *scales,
                  const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                  int64_t k, int num_threads) {
    if (m < 1 || n < 1 || k < 1 || num_threads < 1 || x_stride < k || out_stride < n) return 1;
    const int64_t padded = (k + QBLOCK - 1) / QBLOCK * QBLOCK, blocks = padded / QBLOCK;
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t first = n * t / threads, last = n * (t + 1) / threads;
        for (int64_t c = first; c < last; c++)
            one_column(x, x_stride, codes + c * padded, scales + c * blocks,
                       bias ? bias[c] : 0.0f, out, out_stride, m, c, k);
    }
    return 0;
}

/* out [N, K] float32 = the weight that codes and scales stand for (the reference's products):
 * a prefill step's rows multiply it with torch's GEMM, faster there than the kernel above. */
int dequantize_q8_f32(const int8_t *codes, const float *scales, float *out, int64_t n,
                      int64_t k, int num_threads) {
    if (n < 1 || k < 1 || num_threads < 1) return 1;
    const int64_t padded = (k + QBLOCK - 1) / QBLOCK * QBLOCK, blocks = padded / QBLOCK;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const int8_t *c = codes + r * padded;
        float *o = out + r * k;
        for (int64_t b = 0; b < blocks; b++) {
            const float s = scales[r * blocks + b];
            const int64_t end = (b + 1) * QBLOCK < k ? (b + 1) * QBLOCK : k;
            for (int64_t i = b * QBLOCK; i < end; i++) o[i] = dequant(c[i], s);
        }
    }
    return 0;
}
