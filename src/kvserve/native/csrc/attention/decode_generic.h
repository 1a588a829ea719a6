/*
 * paged_decode.c's path for any CPU: each cached row widened to float32 (8- and 4-bit rows
 * scaled, fp8 through a 256-entry table), dot products and p x V on AVX2 + FMA where the build has
 * them (scalar loops otherwise), an online softmax per block.  Every kind, every head size.
 *
 * A part of paged_decode.c, included once by it (one translation unit, so that the compiler
 * sees and inlines the parts as it did when they were one file); not a header of its own.
 */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: renormalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__)
/* The 32 codes of 16 bytes of a 4-bit row (code 2j in byte j's low nibble), in order, as four
 * float32 vectors (no offset, no scale). */
static inline void nibbles32(const uint8_t *bytes16, __m256 v[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)bytes16);
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
}
#endif

/* One cached row (head_dim values at element offset `row`) as float32 in dst, times scale. */
static const float *load_row(const void *cache, int kind, int64_t row, int dim, float scale,
                             const float *lut, float *dst) {
    int d;
    switch (kind) {
    case KV_F32:
        return (const float *)cache + row;
    case KV_BF16: {
        const uint16_t *src = (const uint16_t *)cache + row;
        d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= dim; d += 16) { /* bf16 -> float32 is a 16-bit shift, 16 lanes */
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
#elif defined(__AVX2__)
        for (; d + 8 <= dim; d += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
            _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; d < dim; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(&dst[d], &bits, sizeof(float));
        }
        return dst;
    }
    case KV_F16: {
        const uint16_t *src = (const uint16_t *)cache + row;
        d = 0;
#ifdef __F16C__
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
        for (; d < dim; d++) dst[d] = half_to_float(src[d]);
        return dst;
    }
    case KV_I8: {
        const int8_t *src = (const int8_t *)cache + row;
        d = 0;
#if defined(__AVX2__)
        const __m256 s8 = _mm256_set1_ps(scale);
        for (; d + 8 <= dim; d += 8) {
            __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s8));
        }
#endif
        for (; d < dim; d++) dst[d] = (float)src[d] * scale;
        return dst;
    }
    case KV_I4: { /* two codes a byte, 2j low: (code - 7.5) x scale, as quant.dequantize */
        const uint8_t *src = (const uint8_t *)cache + row / 2;
        d = 0;
#if defined(__AVX2__)
        const __m256 s8 = _mm256_set1_ps(scale), half = _mm256_set1_ps(7.5f);
        for (; d + 32 <= dim; d += 32) {
            __m256 v[4];
            nibbles32(src + d / 2, v);
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(dst + d + 8 * c, _mm256_mul_ps(_mm256_sub_ps(v[c], half), s8));
        }
#endif
        for (; d < dim; d++) {
            int code = d & 1 ? src[d / 2] >> 4 : src[d / 2] & 15;
            dst[d] = ((float)code - 7.5f) * scale;
        }
        return dst;
    }
    default: { /* KV_E4M3, KV_E5M2: through the 256-entry table */
        const uint8_t *src = (const uint8_t *)cache + row;
        for (d = 0; d < dim; d++) dst[d] = lut[src[d]] * scale;
        return dst;
    }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* q . k over dim values. */
static inline float dot(const float *restrict q, const float *restrict k, int dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
    }
    for (; d + 8 <= dim; d += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    float total = hsum(_mm256_add_ps(a0, a1));
    for (; d < dim; d++) total += q[d] * k[d];
    return total;
}

/* out[o] = q . rows[o] for 8 rows at once: eight independent FMA chains, and one transposing
 * reduction for all eight instead of eight horizontal sums.  dim % 8 == 0. */
static inline void dot8(const float *restrict q, const float *const *rows, int dim,
                        float *out) {
    __m256 a[8];
    for (int o = 0; o < 8; o++) a[o] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int o = 0; o < 8; o++) a[o] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[o] + d), a[o]);
    }
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: s0123 = [r0 r1 r2 r3 | r0 r1 r2 r3] halves, likewise s4567: add the halves. */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
    __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

/* p[o] = exp(p[o] - shift); returns the sum. */
static inline float exp_shifted(float *p, int count, float shift) {
    __m256 total = _mm256_setzero_ps(), sv = _mm256_set1_ps(shift);
    int o = 0;
    for (; o + 8 <= count; o += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + o), sv));
        _mm256_storeu_ps(p + o, v);
        total = _mm256_add_ps(total, v);
    }
    float sum = hsum(total);
    for (; o < count; o++) sum += (p[o] = expf(p[o] - shift));
    return sum;
}

/* y[0:dim] += sum_o p[o] * rows[o][0:dim].  64 lanes of y stay in registers across the rows
 * (8 independent FMA chains: with 2 chains of 16 lanes, each row's FMAs waited on the row
 * before's, the FMA latency, ~4x below the FMA throughput), then 16 at a time. */
static inline void weighted_sum(float *restrict y, const float *p, const float *const *rows,
                                int count, int dim) {
    int d = 0;
    for (; d + 64 <= dim; d += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(y + d + 8 * i);
        for (int o = 0; o < count; o++) {
            const __m256 w = _mm256_set1_ps(p[o]);
            const float *row = rows[o] + d;
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + d + 8 * i, a[i]);
    }
    for (; d + 16 <= dim; d += 16) {
        __m256 a0 = _mm256_loadu_ps(y + d), a1 = _mm256_loadu_ps(y + d + 8);
        for (int o = 0; o < count; o++) {
            __m256 w = _mm256_set1_ps(p[o]);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[o] + d), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[o] + d + 8), a1);
        }
        _mm256_storeu_ps(y + d, a0);
        _mm256_storeu_ps(y + d + 8, a1);
    }
    for (; d < dim; d++)
        for (int o = 0; o < count; o++) y[d] += p[o] * rows[o][d];
}
#define HAVE_DOT8 1
#else
static inline float dot(const float *restrict q, const float *restrict k, int dim) {
    float total = 0.0f;
    for (int d = 0; d < dim; d++) total += q[d] * k[d];
    return total;
}

static inline float exp_shifted(float *p, int count, float shift) {
    float sum = 0.0f;
    for (int o = 0; o < count; o++) sum += (p[o] = expf(p[o] - shift));
    return sum;
}

static inline void weighted_sum(float *restrict y, const float *p, const float *const *rows,
                                int count, int dim) {
    for (int o = 0; o < count; o++)
        for (int d = 0; d < dim; d++) y[d] += p[o] * rows[o][d];
}
#define HAVE_DOT8 0
#endif

#if HAVE_DOT8
/* 8- and 4-bit rows read as their codes (AVX2).  Widening a row to scaled float32 cost more
 * than attending it (a 4-bit row took ~60 instructions to unpack, shift, convert, offset,
 * scale and store, against 8 FMAs a head to score it), so:
 *   keys:   the codes widened to int16 once per block and head, scored against each query
 *           head's int16 codes with vpmaddwd (the products exact in int32); the key's scale,
 *           the query's and 4-bit codes' offset of 7.5 applied to the 16 sums of a block:
 *           q . k = q_scale x k_scale x (sum q_c k_c - 7.5 x sum q_c)   (4-bit: k_c 0..15)
 *   values: the codes converted to float32 (no offset, no scale); each row's weight p_o x
 *           v_scale_o, and a 4-bit block's -7.5 x sum of weights added to every output lane.
 * A query's int16 codes round it by at most amax / 65534 a value, far below a key's own
 * rounding.  Taken where head_dim is a multiple of 32 up to 256 (the int32 sums' bound). */
#define CODE_DIM_STEP 32
#define CODE_MAX_DIM 256
#define QUERY_CODE_MAX 32767.0f

static inline int reads_codes(int kind, int dim) {
    return (kind == KV_I8 || kind == KV_I4) && dim % CODE_DIM_STEP == 0 && dim <= CODE_MAX_DIM;
}

/* Where value d of a row sits among its int16 codes: a 4-bit row's 32 values a 16-byte run
 * widen as 16 low nibbles (the even values) then 16 high ones (the odd values). */
static inline int code_position(int kind, int d) {
    return kind == KV_I4 ? (d & ~31) + (d & 1) * 16 + ((d & 31) >> 1) : d;
}

/* One query head as int16 codes in its keys' code order, with its scale and code sum. */
static void query_codes(const float *q, int kind, int dim, int16_t *codes, float *scale,
                        int32_t *code_sum) {
    float amax = 0.0f;
    for (int d = 0; d < dim; d++) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
    const float s = amax > 0.0f ? amax / QUERY_CODE_MAX : 1.0f, inv = 1.0f / s;
    int32_t sum = 0;
    for (int d = 0; d < dim; d++) {
        float c = nearbyintf(q[d] * inv);
        c = c > QUERY_CODE_MAX ? QUERY_CODE_MAX : c < -QUERY_CODE_MAX ? -QUERY_CODE_MAX : c;
        codes[code_position(kind, d)] = (int16_t)c;
        sum += (int32_t)c;
    }
    *scale = s;
    *code_sum = sum;
}

/* A block's key rows of one KV head as int16 codes (row o at dst + o * dim) and their scales. */
static void key_codes(const void *cache, const float *scales, int kind, int64_t first_slot,
                      int count, int kv_head, int num_kv_heads, int dim, int16_t *dst,
                      float *row_scales) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int o = 0; o < count; o++) {
        const int64_t idx = (first_slot + o) * num_kv_heads + kv_head;
        int16_t *row = dst + (int64_t)o * dim;
        row_scales[o] = scales[idx];
        if (kind == KV_I8) {
            const int8_t *src = (const int8_t *)cache + idx * dim;
            for (int d = 0; d < dim; d += 16)
                _mm256_storeu_si256((__m256i *)(row + d),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + d))));
        } else {
            const uint8_t *src = (const uint8_t *)cache + idx * dim / 2;
            for (int d = 0; d < dim; d += 32) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(src + d / 2));
                const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                _mm256_storeu_si256((__m256i *)(row + d),
                                    _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4)));
                _mm256_storeu_si256((__m256i *)(row + d + 16), _mm256_cvtepu8_epi16(high));
            }
        }
    }
}

/* The eight int32 lanes' sums of a[0..7] in out[0..7] (dot8's reduction). */
static inline void sums8_epi32(const __m256i *a, int32_t *out) {
    __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    __m256i lo = _mm256_permute2x128_si256(s0123, s4567, 0x20);
    __m256i hi = _mm256_permute2x128_si256(s0123, s4567, 0x31);
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(lo, hi));
}

/* raw[o] = sum_d q[d] x rows[o * dim + d] over int16 codes, for o < count (exact: at most
 * 32767 x 127 x 256 in magnitude). */
static void code_dots(const int16_t *q, const int16_t *rows, int count, int dim, int32_t *raw) {
    int o = 0;
    for (; o + 8 <= count; o += 8) {
        __m256i a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_si256();
        for (int d = 0; d < dim; d += 16) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + d));
            for (int r = 0; r < 8; r++) {
                const __m256i k = _mm256_loadu_si256((const __m256i *)(rows + (int64_t)(o + r) * dim + d));
                a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(qv, k));
            }
        }
        sums8_epi32(a, raw + o);
    }
    for (; o < count; o++) {
        __m256i a = _mm256_setzero_si256();
        for (int d = 0; d < dim; d += 16)
            a = _mm256_add_epi32(a, _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(q + d)),
                _mm256_loadu_si256((const __m256i *)(rows + (int64_t)o * dim + d))));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, a);
        raw[o] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
}

/* scores[o] = q . k_o x sm_scale from the codes, as the comment above says; a 4-bit row's
 * offset taken in int32 before the sum is rounded to float32, as 2 x sum - 15 x sum q_c (at
 * most 2 x 15 x 32767 x 256 in magnitude: the two sums cancel to a far smaller score). */
static void code_scores(const int16_t *q, float q_scale, int32_t q_code_sum, int kind,
                        const int16_t *rows, const float *row_scales, int count, int dim,
                        float sm_scale, float sink_score, float *scores) {
    int32_t raw[count];
    code_dots(q, rows, count, dim, raw);
    const int i4 = kind == KV_I4;
    const float s = q_scale * sm_scale * (i4 ? 0.5f : 1.0f);
    for (int o = 0; o < count; o++) {
        const int32_t exact = i4 ? 2 * raw[o] - 15 * q_code_sum : raw[o];
        const float row_scale = row_scales[o];
        scores[o] = row_scale < 0.0f ? (float)exact * s * -row_scale + sink_score /* key - sink */
                                     : (float)exact * s * row_scale;
    }
}

/* A block's value rows of one KV head: where each row's codes start, and their scales. */
static void value_code_rows(const void *cache, const float *scales, int kind, int64_t first_slot,
                            int count, int kv_head, int num_kv_heads, int dim,
                            const uint8_t **rows, float *row_scales) {
    for (int o = 0; o < count; o++) {
        const int64_t idx = (first_slot + o) * num_kv_heads + kv_head;
        rows[o] = (const uint8_t *)cache + (kind == KV_I4 ? idx * dim / 2 : idx * dim);
        row_scales[o] = scales[idx];
    }
}

/* Values d .. d + 31 of a row of codes as four float32 vectors (no offset, no scale). */
static inline void codes32(const uint8_t *row, int kind, int d, __m256 v[4]) {
    if (kind == KV_I8) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(row + d + 8 * j))));
        return;
    }
    nibbles32(row + d / 2, v);
}

/* acc[g] += sum_o weights[g][o] x row o, for `heads` (1 to 3, a constant where inlined) heads
 * at once: each row's codes converted once, in registers, for all of them (12 accumulators,
 * 32 values a pass). */
static inline __attribute__((always_inline)) void code_rows_into(
    int heads, float *const *acc, const float *const *weights, const uint8_t *const *rows,
    int kind, int count, int dim) {
    for (int d = 0; d < dim; d += 32) {
        __m256 a[3][4];
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < 4; j++) a[g][j] = _mm256_loadu_ps(acc[g] + d + 8 * j);
        for (int o = 0; o < count; o++) {
            __m256 v[4];
            codes32(rows[o], kind, d, v);
            for (int g = 0; g < heads; g++) {
                const __m256 w = _mm256_broadcast_ss(weights[g] + o);
                for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(w, v[j], a[g][j]);
            }
        }
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[g] + d + 8 * j, a[g][j]);
    }
}

/* The group's outputs (out, group x dim) += sum_o p_g[o] x v_o over a block's rows of codes:
 * weights p_g[o] x row_scales[o] (probs: group rows of block_size), and for 4-bit rows their
 * offset, -7.5 x the weights' sum, on every lane.  Heads three at a time. */
static void group_code_sum(float *out, const float *probs, int block_size,
                           const uint8_t *const *rows, const float *row_scales, int kind,
                           int count, int group, int dim) {
    float weights[group * count];
    for (int g = 0; g < group; g++) {
        float total = 0.0f, *w = weights + g * count;
        for (int o = 0; o < count; o++) total += (w[o] = probs[g * block_size + o] * row_scales[o]);
        if (kind == KV_I4)
            for (int d = 0; d < dim; d++) out[(int64_t)g * dim + d] -= 7.5f * total;
    }
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int heads = group - g0 < 3 ? group - g0 : 3;
        float *acc[3];
        const float *w[3];
        for (int g = 0; g < heads; g++) {
            acc[g] = out + (int64_t)(g0 + g) * dim;
            w[g] = weights + (g0 + g) * count;
        }
        if (heads == 3) code_rows_into(3, acc, w, rows, kind, count, dim);
        else if (heads == 2) code_rows_into(2, acc, w, rows, kind, count, dim);
        else code_rows_into(1, acc, w, rows, kind, count, dim);
    }
}
#else
static inline int reads_codes(int kind, int dim) { (void)kind; (void)dim; return 0; }
#endif

/* scores[o] = q . rows[o] * sm_scale for o < count. */
static inline void block_scores(const float *q, const float *const *rows, int count, int dim,
                                float sm_scale, float *scores) {
    int o = 0;
#if HAVE_DOT8
    if (dim % 8 == 0)
        for (; o + 8 <= count; o += 8) dot8(q, rows + o, dim, scores + o);
#endif
    for (; o < count; o++) scores[o] = dot(q, rows[o], dim);
    for (o = 0; o < count; o++) scores[o] *= sm_scale;
}

/* Ask for the next block's rows while this block is being used: the blocks of one sequence
 * are scattered, so the hardware prefetcher cannot guess the next one. */
#ifndef PREFETCH_STEP
#define PREFETCH_STEP 64
#endif
static inline void prefetch_rows(const char *base, int64_t bytes) {
    if (PREFETCH_STEP == 0) return;
    for (int64_t off = 0; off < bytes; off += PREFETCH_STEP) __builtin_prefetch(base + off, 0, 2);
}

/* The rows of one block and KV head as float32: pointers into a float32 cache, converted
 * copies in buf otherwise. */
static inline void block_rows(const void *cache, const float *scales, int kind, const float *lut,
                              int64_t first_slot, int count, int kv_head, int num_kv_heads,
                              int dim, float *buf, const float **rows, const float *sink) {
    for (int o = 0; o < count; o++) {
        int64_t idx = (first_slot + o) * num_kv_heads + kv_head;
        float s = scales ? scales[idx] : 1.0f;
        float *dst = buf + (int64_t)o * dim;
        if (sink && s < 0.0f) { /* a 4-bit key stored as key - sink (kv_quantize.c) */
            load_row(cache, kind, idx * dim, dim, -s, lut, dst);
            for (int d = 0; d < dim; d++) dst[d] += sink[d];
            rows[o] = dst;
        } else {
            rows[o] = load_row(cache, kind, idx * dim, dim, s, lut, dst);
        }
    }
}

/* One sequence, all its heads, one pass over its blocks with an online softmax: the keys
 * at positions skip .. seq_len - 1 of the blocks in `table` (skip < block_size: a sliding
 * window that starts inside the table's first block; 0 otherwise).  key_sink: NULL, or
 * [num_kv_heads, dim] that a 4-bit key row with a negative scale is stored relative to
 * (kv_quantize.c): its score takes q . sink x sm_scale, once a head.
 * work: 2 * num_heads + group * block_size + 2 * block_size * dim floats. */
static void attend_sequence(const float *q, float *out, const void *key, const void *value,
                            const float *key_scale, const float *value_scale, const float *lut,
                            int kind, int value_kind, int64_t key_row_bytes,
                            int64_t value_row_bytes, const int64_t *table, int64_t seq_len,
                            int skip, int num_kv_heads, int group, int dim, int block_size,
                            float sm_scale, float *work, float *lse, const float *key_sink) {
    const int num_heads = num_kv_heads * group;
    const int64_t key_block_bytes = (int64_t)block_size * num_kv_heads * key_row_bytes;
    const int64_t value_block_bytes = (int64_t)block_size * num_kv_heads * value_row_bytes;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    float *run_max = work, *run_sum = run_max + num_heads, *probs = run_sum + num_heads;
    float *key_buf = probs + group * block_size, *value_buf = key_buf + block_size * dim;
    const float *key_rows[block_size], *value_rows[block_size];
    /* 8- and 4-bit rows read as codes (reads_codes): the keys' int16 codes in key_buf */
    const int key_codes_read = reads_codes(kind, dim);
    const int value_codes_read = reads_codes(value_kind, dim);
    int16_t *key_code_rows = (int16_t *)key_buf;
    int16_t q_codes[key_codes_read ? num_heads * dim : 1];
    float q_scales[num_heads];
    int32_t q_code_sums[num_heads];
    float key_scales[block_size], value_scales[block_size];
    const uint8_t *value_code_starts[block_size];
#if HAVE_DOT8
    if (key_codes_read)
        for (int head = 0; head < num_heads; head++)
            query_codes(q + (int64_t)head * dim, kind, dim, q_codes + (int64_t)head * dim,
                        &q_scales[head], &q_code_sums[head]);
#endif
    if (kind != KV_I4) key_sink = NULL;
    float sink_scores[num_heads];
    for (int head = 0; head < num_heads; head++) {
        run_max[head] = -INFINITY;
        run_sum[head] = 0.0f;
        sink_scores[head] = 0.0f;
        const float *sink = key_sink ? key_sink + (int64_t)(head / group) * dim : NULL;
        for (int d = 0; sink && d < dim; d++) sink_scores[head] += q[(int64_t)head * dim + d] * sink[d];
        sink_scores[head] *= sm_scale;
    }
    memset(out, 0, sizeof(float) * (size_t)num_heads * dim);
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) {
            prefetch_rows((const char *)key + table[b + 1] * key_block_bytes, key_block_bytes);
            prefetch_rows((const char *)value + table[b + 1] * value_block_bytes,
                          value_block_bytes);
        }
        const int lo = b == 0 ? skip : 0; /* rows before the window's first key */
        int64_t first_slot = table[b] * block_size + lo;
        int count = (int)(seq_len - b * block_size < block_size ? seq_len - b * block_size
                                                                : block_size) - lo;
        for (int h = 0; h < num_kv_heads; h++) {
#if HAVE_DOT8
            if (key_codes_read)
                key_codes(key, key_scale, kind, first_slot, count, h, num_kv_heads, dim,
                          key_code_rows, key_scales);
            else
#endif
                block_rows(key, key_scale, kind, lut, first_slot, count, h, num_kv_heads, dim,
                           key_buf, key_rows, key_sink ? key_sink + (int64_t)h * dim : NULL);
#if HAVE_DOT8
            if (value_codes_read)
                value_code_rows(value, value_scale, value_kind, first_slot, count, h,
                                num_kv_heads, dim, value_code_starts, value_scales);
            else
#endif
                block_rows(value, value_scale, value_kind, lut, first_slot, count, h,
                           num_kv_heads, dim, value_buf, value_rows, NULL);
            for (int g = 0; g < group; g++) {
                int head = h * group + g;
                float *p = probs + g * block_size, *acc = out + (int64_t)head * dim;
#if HAVE_DOT8
                if (key_codes_read)
                    code_scores(q_codes + (int64_t)head * dim, q_scales[head], q_code_sums[head],
                                kind, key_code_rows, key_scales, count, dim, sm_scale,
                                sink_scores[head], p);
                else
#endif
                    block_scores(q + (int64_t)head * dim, key_rows, count, dim, sm_scale, p);
                float new_max = run_max[head];
                for (int o = 0; o < count; o++) new_max = p[o] > new_max ? p[o] : new_max;
                float block_sum = exp_shifted(p, count, new_max);
                if (new_max != run_max[head]) { /* rescale what was summed under the old max */
                    float correction = expf(run_max[head] - new_max);
                    run_sum[head] *= correction;
                    for (int d = 0; d < dim; d++) acc[d] *= correction;
                    run_max[head] = new_max;
                }
                run_sum[head] += block_sum;
                if (!value_codes_read) weighted_sum(acc, p, value_rows, count, dim);
            }
#if HAVE_DOT8
            if (value_codes_read) /* the group's heads together, each row converted once */
                group_code_sum(out + (int64_t)h * group * dim, probs, block_size,
                               value_code_starts, value_scales, value_kind, count, group, dim);
#endif
        }
    }
    for (int head = 0; head < num_heads; head++) {
        float inv = 1.0f / run_sum[head];
        for (int d = 0; d < dim; d++) out[(int64_t)head * dim + d] *= inv;
        if (lse) lse[head] = run_max[head] + logf(run_sum[head]);
    }
}
