/*
 * Greedy sampling's argmax over a step's logits (CPU), float32 or bfloat16 rows.
 *
 * torch's `max(dim=-1)` on [128, 49152] float32 logits took 1.8-3.8 ms per decode step here,
 * after a 1.3 ms bf16 -> float32 copy of the logits; this reads the bf16 logits once per row
 * for the maximum and once (from L2) for its first index: the same index as torch (the first
 * on a tie, the first NaN when a row has one).
 *
 *   x      [rows, cols] at x + r * row_stride elements; kind KV_F32 or KV_BF16 (common/kinds.h)
 *   out    [rows] int64
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/kinds.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float value_at(const void *x, int kind, int64_t i) {
    if (kind == KV_F32) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* torch's rule, one value at a time: a NaN wins (the first one), else the first maximum. */
static int64_t argmax_scalar(const void *x, int kind, int64_t cols) {
    int64_t best = 0;
    float best_value = value_at(x, kind, 0);
    for (int64_t j = 1; j < cols && !isnan(best_value); j++) {
        float v = value_at(x, kind, j);
        if (isnan(v) || v > best_value) {
            best = j;
            best_value = v;
        }
    }
    return best;
}

#ifdef __AVX512F__
static inline __m512 load16(const void *x, int kind, int64_t j) {
    if (kind == KV_F32) return _mm512_loadu_ps((const float *)x + j);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static int64_t argmax_row(const void *x, int kind, int64_t cols) {
    if (cols < 16) return argmax_scalar(x, kind, cols);
    int64_t full = cols / 16 * 16;
    __m512 mx = load16(x, kind, 0);
    __mmask16 unordered = 0;
    for (int64_t j = 0; j < full; j += 16) {
        __m512 v = load16(x, kind, j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    float best_value = _mm512_reduce_max_ps(mx);
    for (int64_t j = full; j < cols; j++) {
        float v = value_at(x, kind, j);
        if (isnan(v)) unordered = 1;
        best_value = v > best_value ? v : best_value;
    }
    if (unordered) return argmax_scalar(x, kind, cols);
    __m512 target = _mm512_set1_ps(best_value);
    for (int64_t j = 0; j < full; j += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(load16(x, kind, j), target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (int64_t j = full; j < cols; j++)
        if (value_at(x, kind, j) == best_value) return j;
    return 0; /* not reached */
}
#else
static int64_t argmax_row(const void *x, int kind, int64_t cols) {
    return argmax_scalar(x, kind, cols);
}
#endif

int argmax_rows(const void *x, int kind, int64_t rows, int64_t cols, int64_t row_stride,
                int64_t *out, int num_threads) {
    const int64_t elem = kind == KV_F32 ? 4 : 2;
    #pragma omp parallel for num_threads(rows >= 4 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row((const char *)x + r * row_stride * elem, kind, cols);
    return 0;
}
