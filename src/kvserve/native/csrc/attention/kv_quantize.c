/*
 * Quantize-and-store of a step's K or V into an 8-bit paged cache (CPU), in one pass.
 *
 * kv_quant.py's torch version makes about eight passes over the rows (widen, abs, amax,
 * divide, clamp, round, narrow, scatter): 2.6 ms per layer for a 2,048-token chunk against
 * 0.58 ms for a bf16 store, which ate what the 8-bit decode path saves.  This computes the same
 * codes bit for bit: the same float32 operations in the same order, and round-to-nearest-even
 * conversions as PyTorch's (torch.round for int8; c10's fp32 -> fp8 e4m3fn / e5m2 rounding).
 *
 *   x       [T, heads, dim] rows, row (t, h) at x + t * token_stride + h * dim elements,
 *           float32 or bfloat16 (src_kind KV_F32 or KV_BF16; float16 stays in torch)
 *   cache   [slots, heads, dim] codes ([slots, heads, dim / 2] bytes for KV_I4); scales
 *           [slots, heads] float32 (int8, e4m3, int4) or NULL
 *   out_kind KV_I8, KV_E4M3, KV_I4 (per-row scale), KV_E5M2 (unscaled)
 *   sink    [heads, dim] float32 or NULL: KV_I4 key rows near it stored relative to it
 *           (store_key_row_i4); NULL for values and the other kinds
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention/attention.h"
#include "common/kinds.h"

static inline float widen(const void *x, int kind, int64_t i) {
    if (kind == KV_F32) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16; /* bfloat16 */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* |f| <= the format's max, finite.  mant_bits 3 (e4m3, bias 7) or 2 (e5m2, bias 15). */
static inline uint8_t to_fp8(float f, int mant_bits, int bias) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    uint32_t mag = bits & 0x7fffffffu;
    int min_normal_exp = 1 - bias; /* 2^-6 or 2^-14 */
    if (mag < (uint32_t)(127 + min_normal_exp) << 23) { /* subnormal: m x 2^(min - mant) */
        float a;
        memcpy(&a, &mag, sizeof a);
        float units = ldexpf(a, mant_bits - min_normal_exp);
        return sign | (uint8_t)nearbyintf(units); /* m == 2^mant_bits: the smallest normal */
    }
    int shift = 23 - mant_bits;
    mag += ((uint32_t)1 << (shift - 1)) - 1 + ((mag >> shift) & 1); /* round half to even */
    uint32_t exp = (mag >> 23) - 127 + bias, mant = (mag >> shift) & ((1u << mant_bits) - 1);
    return sign | (uint8_t)((exp << mant_bits) | mant);
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512_STORE 1

static inline __m512 widen16(const void *x, int kind, int64_t i) {
    if (kind == KV_F32) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* to_fp8 on 16 lanes (|v| within range): the same rounding, in integer lanes. */
static inline __m128i to_fp8_16(__m512 v, int mant_bits, int bias) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    int min_normal_exp = 1 - bias, shift = 23 - mant_bits;
    __mmask16 sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32((127 + min_normal_exp) << 23));
    /* subnormal: round(|v| x 2^(mant - min)) half to even (exact scaling by a power of 2) */
    __m512 units = _mm512_mul_ps(_mm512_castsi512_ps(mag),
                                 _mm512_set1_ps(ldexpf(1.0f, mant_bits - min_normal_exp)));
    __m512i sub_code = _mm512_cvtps_epi32(_mm512_roundscale_ps(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* normal: round the mantissa half to even, then rebias the exponent */
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, shift), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(mag, _mm512_add_epi32(_mm512_set1_epi32((1 << (shift - 1)) - 1), odd));
    __m512i exp = _mm512_sub_epi32(_mm512_srli_epi32(r, 23), _mm512_set1_epi32(127 - bias));
    __m512i mant = _mm512_and_si512(_mm512_srli_epi32(r, shift), _mm512_set1_epi32((1 << mant_bits) - 1));
    __m512i norm_code = _mm512_or_si512(_mm512_slli_epi32(exp, mant_bits), mant);
    __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(sub, norm_code, sub_code), sign);
    return _mm512_cvtepi32_epi8(code);
}

/* One row of dim % 16 == 0 values: scale (unless e5m2) and codes, as the scalar loop does. */
static inline void store_row16(const void *x, int src_kind, int64_t src, uint8_t *dst, float *scale_out,
                               int dim, int out_kind, float limit) {
    __m512 scale = _mm512_set1_ps(1.0f);
    if (out_kind != KV_E5M2) {
        __m512 amax = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(widen16(x, src_kind, src + d)));
        float s = _mm512_reduce_max_ps(amax) / limit;
        if (s < 1e-12f) s = 1e-12f;
        *scale_out = s;
        scale = _mm512_set1_ps(s);
    }
    __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
    for (int d = 0; d < dim; d += 16) {
        __m512 v = widen16(x, src_kind, src + d);
        if (out_kind != KV_E5M2) v = _mm512_div_ps(v, scale);
        if (out_kind == KV_I8) {
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128((__m128i *)(dst + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
        } else {
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128((__m128i *)(dst + d), out_kind == KV_E4M3 ? to_fp8_16(v, 3, 7) : to_fp8_16(v, 2, 15));
        }
    }
}
#else
#define HAVE_AVX512_STORE 0
#endif

/* A 4-bit row's candidate scales amax / d, in kv_quant.INT4_SCALE_DIVISORS' order. */
static const float I4_SCALE_DIVISORS[] = {8.0f, 8.5f, 9.0f, 9.5f, 10.0f, 10.5f};
#define I4_NUM_DIVISORS (int)(sizeof I4_SCALE_DIVISORS / sizeof I4_SCALE_DIVISORS[0])

static inline float i4_code(float v, float scale) {
    const float c = floorf(v / scale) + 8.0f;
    return c < 0.0f ? 0.0f : c > 15.0f ? 15.0f : c;
}

/* The squared error of a row's codes under `scale`, in double ((code - 7.5) x scale exact).
 * float32 rows 8 values a step (the same codes and differences; only the sum's order moves,
 * as torch's does). */
static double i4_row_error(const void *x, int src_kind, int64_t src, float scale, int dim) {
    double error = 0.0;
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (src_kind == KV_F32) {
        const float *row = (const float *)x + src;
        const __m256 s = _mm256_set1_ps(scale), eight = _mm256_set1_ps(8.0f);
        const __m256 fifteen = _mm256_set1_ps(15.0f), zero = _mm256_setzero_ps();
        const __m256d s64 = _mm256_set1_pd((double)scale), half = _mm256_set1_pd(7.5);
        __m256d acc = _mm256_setzero_pd();
        for (; d + 8 <= dim; d += 8) {
            const __m256 v = _mm256_loadu_ps(row + d);
            __m256 c = _mm256_add_ps(_mm256_floor_ps(_mm256_div_ps(v, s)), eight);
            c = _mm256_min_ps(_mm256_max_ps(c, zero), fifteen);
            for (int h = 0; h < 2; h++) {
                const __m128 c4 = h ? _mm256_extractf128_ps(c, 1) : _mm256_castps256_ps128(c);
                const __m128 v4 = h ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v);
                const __m256d diff = _mm256_sub_pd(
                    _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(c4), half), s64),
                    _mm256_cvtps_pd(v4));
                acc = _mm256_fmadd_pd(diff, diff, acc);
            }
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, acc);
        error = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
#endif
    for (; d < dim; d++) {
        const float v = widen(x, src_kind, src + d);
        const double diff = ((double)i4_code(v, scale) - 7.5) * (double)scale - (double)v;
        error += diff * diff;
    }
    return error;
}

/* One row as 4-bit codes (KV_I4): code = clamp(floor(x / scale) + 8, 0, 15), two codes a byte,
 * value 2j low, under the candidate scale amax / d with the least squared error (the first of
 * equal ones).  quant.py's torch expressions, operation for operation. */
static inline void store_row_i4(const void *x, int src_kind, int64_t src, uint8_t *dst,
                                float *scale_out, int dim) {
    float amax = 0.0f;
    int d = 0;
#if defined(__AVX2__)
    if (src_kind == KV_F32) {
        __m256 m = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (; d + 8 <= dim; d += 8)
            m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps((const float *)x + src + d), abs_mask));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    }
#endif
    for (; d < dim; d++) {
        float a = fabsf(widen(x, src_kind, src + d));
        amax = a > amax ? a : amax;
    }
    float scale = 0.0f;
    double best = 0.0;
    for (int i = 0; i < I4_NUM_DIVISORS; i++) {
        float candidate = amax / I4_SCALE_DIVISORS[i];
        if (candidate < 1e-12f) candidate = 1e-12f;
        const double error = i4_row_error(x, src_kind, src, candidate, dim);
        if (i == 0 || error < best) {
            best = error;
            scale = candidate;
        }
    }
    *scale_out = scale;
    for (d = 0; d + 1 < dim; d += 2) {
        const int lo = (int)i4_code(widen(x, src_kind, src + d), scale);
        const int hi = (int)i4_code(widen(x, src_kind, src + d + 1), scale);
        dst[d / 2] = (uint8_t)(lo | (hi << 4));
    }
}

/* A key row nearer the layer's key sink than zero (squared distances in double, as kv_quant.py
 * sums them) is stored as row - sink (float32 differences) under a negative scale: the sink
 * (runner/key_offsets.py) sits far from the other keys, and its 4-bit rounding would be as
 * far off.  Other rows, and every row without a sink, as store_row_i4. */
static inline void store_key_row_i4(const void *x, int src_kind, int64_t src, uint8_t *dst,
                                    float *scale_out, int dim, const float *sink) {
    if (sink) {
        double to_sink = 0.0, to_zero = 0.0;
        for (int d = 0; d < dim; d++) {
            const double v = (double)widen(x, src_kind, src + d);
            to_sink += (v - (double)sink[d]) * (v - (double)sink[d]);
            to_zero += v * v;
        }
        if (to_sink < to_zero) {
            float shifted[dim];
            for (int d = 0; d < dim; d++) shifted[d] = widen(x, src_kind, src + d) - sink[d];
            store_row_i4(shifted, KV_F32, 0, dst, scale_out, dim);
            *scale_out = -*scale_out;
            return;
        }
    }
    store_row_i4(x, src_kind, src, dst, scale_out, dim);
}

int kv_quantize_store(const void *x, int src_kind, int64_t token_stride, void *cache,
                      float *scales, const int64_t *slots, int num_tokens, int heads, int dim,
                      int out_kind, const float *sink, int num_threads) {
    if (out_kind == KV_I4) {
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int t = 0; t < num_tokens; t++)
            for (int h = 0; h < heads; h++)
                store_key_row_i4(x, src_kind, (int64_t)t * token_stride + (int64_t)h * dim,
                                 (uint8_t *)cache + (slots[t] * heads + h) * (int64_t)(dim / 2),
                                 &scales[slots[t] * heads + h], dim,
                                 sink ? sink + (int64_t)h * dim : NULL);
        return 0;
    }
    const float limit = out_kind == KV_I8 ? 127.0f : out_kind == KV_E4M3 ? 448.0f : 57344.0f;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        for (int h = 0; h < heads; h++) {
            int64_t src = (int64_t)t * token_stride + (int64_t)h * dim;
            int64_t dst = (slots[t] * heads + h) * (int64_t)dim;
#if HAVE_AVX512_STORE
            if (dim % 16 == 0) {
                store_row16(x, src_kind, src, (uint8_t *)cache + dst,
                            scales ? &scales[slots[t] * heads + h] : NULL, dim, out_kind, limit);
                continue;
            }
#endif
            float scale = 1.0f;
            if (out_kind != KV_E5M2) {
                float amax = 0.0f;
                for (int d = 0; d < dim; d++) {
                    float a = fabsf(widen(x, src_kind, src + d));
                    amax = a > amax ? a : amax;
                }
                scale = amax / limit;
                if (scale < 1e-12f) scale = 1e-12f;
                scales[slots[t] * heads + h] = scale;
            }
            for (int d = 0; d < dim; d++) {
                float v = widen(x, src_kind, src + d);
                if (out_kind != KV_E5M2) v = v / scale;
                if (out_kind == KV_I8) {
                    v = nearbyintf(v);
                    v = v > limit ? limit : v < -limit ? -limit : v;
                    ((int8_t *)cache)[dst + d] = (int8_t)v;
                } else {
                    v = v > limit ? limit : v < -limit ? -limit : v;
                    ((uint8_t *)cache)[dst + d] = out_kind == KV_E4M3 ? to_fp8(v, 3, 7) : to_fp8(v, 2, 15);
                }
            }
        }
    }
    return 0;
}

/* One row into its slot with non-temporal stores, where both fit them (64-byte lines): a
 * streaming store skips reading each cold line before writing it.  A prefill chunk is attended
 * from the tensors its rows came from; only requests that share a prefix computed in the same
 * step read those rows back from the cache this step (from memory, once: correct either way,
 * see the fence below). */
static inline int store_row_streaming(char *dst, const char *src, int64_t row_bytes) {
#if HAVE_AVX512_STORE
    if (((uintptr_t)dst & 63) || (row_bytes & 63)) return 0;
    for (int64_t i = 0; i < row_bytes; i += 64)
        _mm512_stream_si512((__m512i *)(dst + i), _mm512_loadu_si512(src + i));
    return 1;
#else
    (void)dst, (void)src, (void)row_bytes;
    return 0;
#endif
}

/* A step's K or V rows into a cache of their own dtype (no quantization): one copy of
 * row_bytes per token (its heads x dim values, contiguous in x) to its slot.  torch's
 * index_copy_ measured ~40 us per call for a 128-row decode step, two calls per layer.
 * Large stores (prefill chunks) stream past the caches (see store_row_streaming). */
int kv_copy_store(const void *x, int64_t token_stride_bytes, void *cache, const int64_t *slots,
                  int num_tokens, int64_t row_bytes, int num_threads) {
    const int streaming = num_tokens >= 1024;
    #pragma omp parallel num_threads(streaming ? num_threads : 1)
    {
        #pragma omp for schedule(static) nowait
        for (int t = 0; t < num_tokens; t++) {
            char *dst = (char *)cache + slots[t] * row_bytes;
            const char *src = (const char *)x + t * token_stride_bytes;
            if (!(streaming && store_row_streaming(dst, src, row_bytes)))
                memcpy(dst, src, (size_t)row_bytes);
        }
#if HAVE_AVX512_STORE
        if (streaming) _mm_sfence(); /* streaming stores are weakly ordered: each thread's
                                      * are visible before the region's closing barrier */
#endif
    }
    return 0;
}
