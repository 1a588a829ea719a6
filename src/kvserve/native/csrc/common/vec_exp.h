/*
 * exp on float vectors, shared by the kernels (softmax in paged_decode.c, SiLU in
 * silu_mul.c): Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for exp(r) on
 * |r| <= ln2/2 (relative error ~1e-7), and 2^n built in the exponent bits.  Valid for x up
 * to 88 (beyond, 2^n leaves float32's exponent range); x below -87 gives exp(-87).
 */
#ifndef KVSERVE_VEC_EXP_H
#define KVSERVE_VEC_EXP_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
/* exp8's reduction on 16 lanes: x = n ln2 + r with |r| <= ln2/2; returns r, n in *n. */
static inline __m512 exp_reduce16(__m512 x, __m512 *n) {
    *n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                              _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(0.693359375f), x);
    return _mm512_fnmadd_ps(*n, _mm512_set1_ps(-2.12194440e-4f), r);
}

/* exp(r) from y, the polynomial's value after its r^5 coefficient (exp16 folds in one more
 * term before it): y r^4 + ... + r^2 / 2 + r + 1, exp8's operations on 16 lanes. */
static inline __m512 exp_poly16(__m512 y, __m512 r) {
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

/* exp8's operations on 16 lanes, the same values lane for lane.  (Computing it as two exp8
 * halves, as the decode kernel did, made the SiLU kernel 1.46x slower.) */
static inline __m512 exp16(__m512 x) {
    __m512 n, r = exp_reduce16(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), &n);
    __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    y = exp_poly16(y, r);
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* 2^x for softmax numerators that are rounded to bfloat16 (prefill_bf16.c), x in log2 units
 * (the caller folds log2(e) into its scale): x = n + f with |f| <= 1/2, a degree-4 polynomial
 * for 2^f (fitted to relative error, at most 2.7e-6: ~1/700 of bf16's half-ulp, so it changes
 * a rounded probability by one ulp ~0.1% of the time), and 2^n applied by vscalefps, which
 * also takes x below -126 smoothly to 0.  7 instructions against exp16's 17: the softmax of
 * a 1,024 x 1,024 prefill call ran 3.22 -> 2.78 ms with a degree-3 version of it. */
static inline __m512 exp2_16_for_bf16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(9.570099413394928e-3f), f,
                               _mm512_set1_ps(5.591786280274391e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.40247443318367e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931217908859253e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999992847442627e-1f));
    return _mm512_scalef_ps(y, n);
}

/* SiLU(g) x u, the SiLU kernel's arithmetic (silu_mul.c, and linear_amx.c's fused gate and up
 * projections): exp16 of -g clamped to [-87, 88], 1 / (1 + e) as a reciprocal estimate
 * refined by one Newton step.  Below -88, SiLU is under 1e-36 in magnitude (torch: g / inf =
 * -0), but the clamped exp would give g * e^-88: the product is made zero.  NaNs compare
 * false and stay NaN. */
static inline __m512 silu_times16(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp16(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                                 _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(88.0f)));
    __m512 d = _mm512_add_ps(one, e);
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f))); /* Newton */
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, inv), u);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.0f), _CMP_LT_OQ),
                              _mm512_setzero_ps());
}
#endif
#endif
#endif
