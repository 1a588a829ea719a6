/*
 * The horizontal sum of eight float32 lanes (AVX2): what the 8- and 4-bit projection kernels
 * (linear/linear_q8.c, linear/linear_q4.c) reduce each output's accumulator with.
 */
#ifndef KVSERVE_HSUM_H
#define KVSERVE_HSUM_H
#if defined(__AVX2__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
