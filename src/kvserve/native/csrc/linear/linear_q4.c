/*
 * y = x W^T (+ b) in float32 over a 4-bit block-quantized weight (GGUF's Q4_1 values: per 32
 * inputs of an output row a scale d and a minimum m, W = d q + m with q in 0..15), with the
 * activations rounded to 8-bit blocks so that each block's dot product is an integer one
 * (llama.cpp's Q4_1 x Q8_1): for a decode step's few rows.
 *
 * Why: a one-row decode step reads every weight once.  linear_q8.c's 8-bit codes are 1.125
 * bytes a weight; these are 0.625 (half a byte, plus two float32 per 32).  Widening nibbles to
 * float32 as linear_q8.c widens bytes would make the kernel compute-bound (linear_q8.c already
 * is on one AMD core); an integer dot product of the unsigned nibbles with signed 8-bit
 * activations (vpmaddubsw, vpmaddwd) costs a few instructions per 32 weights
 * (docs/decisions/int4-weights.md).
 *
 * Layout (models/quantized_linear.py's quantize_q4):
 *   codes  [N, K / 2] uint8: per block of 32 inputs 16 bytes, input j in byte j's low nibble
 *          and input j + 16 in its high nibble (GGUF's Q4_1 order)
 *   scales, mins [N, K / 32] float32
 *   x [M, K] float32 rows of stride x_stride; out [M, N] rows of stride out_stride; bias [N]
 *   float32 or NULL.  K a multiple of 32 (the caller keeps torch's product otherwise).
 *
 * The arithmetic, which quantized_linear.py's q4 reference repeats: a row's block of 32 is
 * e = max|x| / 127 (1 where all zero) and a = round(x / e) to nearest even, so that block b
 * contributes d_b e_b sum(q a) + m_b e_b sum(a) (the first sum exact in integers); the row's
 * result is the float32 sum of those terms over blocks in the kernel's order, then + bias.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "linear/linear.h"

#include <omp.h>

#define QBLOCK 32
#define QMAX 127.0f
#define TILE_ROWS 4
#define MAX_ROWS 64 /* the most rows a call takes */

/* One row of activations as 8-bit blocks: codes [K], each block's scale e and e x sum(a). */
static void quantize_row(const float *x, int64_t k, int8_t *codes, float *scales, float *sums) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float e = amax > 0.0f ? amax / QMAX : 1.0f;
        int32_t total = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const int32_t a = (int32_t)nearbyintf(xb[i] / e); /* |x| <= amax: within 127 */
            codes[b * QBLOCK + i] = (int8_t)a;
            total += a;
        }
        scales[b] = amax > 0.0f ? e : 0.0f;
        sums[b] = scales[b] * (float)total;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "common/hsum.h"

/* A block's 32 nibbles (16 bytes at p) as 32 unsigned bytes in input order. */
static inline __m256i nibbles(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    return _mm256_set_m128i(hi, lo);
}

/* sum(q a) of a block as 8 int32 lanes: unsigned nibbles x signed codes (vpmaddubsw: pairs
 * into int16, at most 2 x 15 x 127), then pairs into int32. */
static inline __m256i dot32(__m256i q, const int8_t *a) {
    const __m256i products = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)a));
    return _mm256_madd_epi16(products, _mm256_set1_epi16(1));
}

/* sums[r] for R activation rows and one weight row; the d terms in vector accumulators (two
 * a row for R = 1, so that a one-row product does not wait on one FMA chain), the m terms in
 * scalar ones. */
#define DEFINE_COLUMN(R)                                                                       \
    static void column_##R(const int8_t *xq, const float *xs, const float *xsum,              \
                           int64_t blocks, const uint8_t *codes, const float *scales,          \
                           const float *mins, float *sums) {                                   \
        __m256 acc[R][2];                                                                      \
        float minsum[R];                                                                       \
        for (int r = 0; r < R; r++) {                                                          \
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                       \
            minsum[r] = 0.0f;                                                                  \
        }                                                                                      \
        for (int64_t b = 0; b < blocks; b++) {                                                 \
            const __m256i q = nibbles(codes + b * (QBLOCK / 2));                               \
            for (int r = 0; r < R; r++) {                                                      \
                const int64_t i = r * blocks + b;                                              \
                const __m256 dot = _mm256_cvtepi32_ps(dot32(q, xq + i * QBLOCK));              \
                acc[r][b & 1] =                                                                \
                    _mm256_fmadd_ps(dot, _mm256_set1_ps(scales[b] * xs[i]), acc[r][b & 1]);    \
                minsum[r] += mins[b] * xsum[i];                                                \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            sums[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + minsum[r];                  \
    }
DEFINE_COLUMN(1) DEFINE_COLUMN(2) DEFINE_COLUMN(3) DEFINE_COLUMN(4)
typedef void (*column_fn)(const int8_t *, const float *, const float *, int64_t,
                          const uint8_t *, const float *, const float *, float *);
static const column_fn COLUMN_BY_ROWS[TILE_ROWS + 1] = {0, column_1, column_2, column_3,
                                                        column_4};

static void column_rows(const int8_t *xq, const float *xs, const float *xsum, int64_t blocks,
                        const uint8_t *codes, const float *scales, const float *mins,
                        int64_t rows, float *sums) {
    COLUMN_BY_ROWS[rows](xq, xs, xsum, blocks, codes, scales, mins, sums);
}

/* One activation row times four consecutive weight rows (the decode of one sequence): each
 * activation block is loaded once for the four, and the four sums are reduced together.  A
 * weight row of the embedded model is only 18 blocks, so a column's fixed costs (the call,
 * its horizontal sum) were a large part of a one-row product. */
#define FOUR_COLUMNS 4
static void four_columns_one_row(const int8_t *xq, const float *xs, const float *xsum,
                                 int64_t blocks, const uint8_t *codes, const float *scales,
                                 const float *mins, int64_t codes_stride, int64_t scales_stride,
                                 float *sums) {
    __m256 acc[FOUR_COLUMNS];
    float minsum[FOUR_COLUMNS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; c < FOUR_COLUMNS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * QBLOCK));
        const __m256i ones = _mm256_set1_epi16(1);
        for (int c = 0; c < FOUR_COLUMNS; c++) {
            const __m256i q = nibbles(codes + c * codes_stride + b * (QBLOCK / 2));
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), ones);
            const float d = scales[c * scales_stride + b] * xs[b];
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc[c]);
            minsum[c] += mins[c * scales_stride + b] * xsum[b];
        }
    }
    /* lanes of the four accumulators summed pairwise into one vector of four sums */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(sums, four);
    for (int c = 0; c < FOUR_COLUMNS; c++) sums[c] += minsum[c];
}
#define HAVE_FOUR_COLUMNS 1

/* Ask for `bytes` from p into the caches, a line at a time. */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}
/* How far ahead (in weight rows) the one-row loop asks for the rows it reads next: the codes,
 * scales and minima are three streams a thread, and a projection of the embedded model only
 * ~100-800 KB, too little for the hardware prefetchers to ramp up.  Eight rows ahead took
 * the 120 projections of a one-row step from 5.40-5.55 to 4.79-4.86 ms (medians of 12,
 * alternating with 0 in one process, three runs; 4, 12, 16 and 32 rows measured no better). */
#define PREFETCH_COLUMNS 8
#else
/* Portable: the same integer blocks in plain C. */
static void column_rows(const int8_t *xq, const float *xs, const float *xsum, int64_t blocks,
                        const uint8_t *codes, const float *scales, const float *mins,
                        int64_t rows, float *sums) {
    for (int64_t r = 0; r < rows; r++) {
        float s = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = r * blocks + b;
            const uint8_t *c = codes + b * (QBLOCK / 2);
            int32_t dot = 0;
            for (int j = 0; j < QBLOCK / 2; j++)
                dot += (c[j] & 0x0F) * xq[i * QBLOCK + j] + (c[j] >> 4) * xq[i * QBLOCK + j + 16];
            s += (float)dot * (scales[b] * xs[i]) + mins[b] * xsum[i];
        }
        sums[r] = s;
    }
}
#endif

int linear_q4_f32(const float *x, int64_t x_stride, const uint8_t *codes, const float *scales,
                  const float *mins, const float *bias, float *out, int64_t out_stride, int64_t m,
                  int64_t n, int64_t k, int num_threads) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < QBLOCK || k % QBLOCK || num_threads < 1 ||
        x_stride < k || out_stride < n)
        return 1;
    const int64_t blocks = k / QBLOCK;
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc((size_t)(2 * m * blocks) * sizeof(float)), *xsum = xs + m * blocks;
    if (!xq || !xs) {
        free(xq), free(xs);
        return 1;
    }
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * x_stride, k, xq + r * k, xs + r * blocks, xsum + r * blocks);
    /* A thread takes a contiguous run of weight rows (each read once a call) and multiplies
     * each with every activation row, TILE_ROWS at a time. */
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t first = n * t / threads, last = n * (t + 1) / threads;
        int64_t c = first;
#if HAVE_FOUR_COLUMNS
        if (m == 1)
            for (; c + FOUR_COLUMNS <= last; c += FOUR_COLUMNS) {
                float sums[FOUR_COLUMNS];
                if (c + PREFETCH_COLUMNS + FOUR_COLUMNS <= last) {
                    const int64_t ahead = c + PREFETCH_COLUMNS;
                    prefetch_span(codes + ahead * (k / 2), FOUR_COLUMNS * (k / 2));
                    prefetch_span(scales + ahead * blocks, FOUR_COLUMNS * blocks * 4);
                    prefetch_span(mins + ahead * blocks, FOUR_COLUMNS * blocks * 4);
                }
                four_columns_one_row(xq, xs, xsum, blocks, codes + c * (k / 2),
                                     scales + c * blocks, mins + c * blocks, k / 2, blocks, sums);
                for (int j = 0; j < FOUR_COLUMNS; j++)
                    out[c + j] = sums[j] + (bias ? bias[c + j] : 0.0f);
            }
#endif
        for (; c < last; c++) {
            const float b = bias ? bias[c] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
                const int64_t rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
                float sums[TILE_ROWS];
                column_rows(xq + r0 * k, xs + r0 * blocks, xsum + r0 * blocks, blocks,
                            codes + c * (k / 2), scales + c * blocks, mins + c * blocks, rows,
                            sums);
                for (int64_t r = 0; r < rows; r++) out[(r0 + r) * out_stride + c] = sums[r] + b;
            }
        }
    }
    free(xq), free(xs);
    return 0;
}
