/*
 * Decode attention over a paged KV cache, reading the blocks in place (CPU).
 *
 * The reference backend copies every decode sequence's blocks into a padded contiguous
 * tensor per layer and step, then attends over the copy: the K/V bytes cross memory three
 * times.  Here each sequence walks its block table once, block by block, with an online
 * softmax (running max and sum per head, as in FlashAttention): each K and V row is read
 * once, converted from 8/16-bit storage to float32 on the fly, and used by all the query
 * heads of its group while it is in L1.
 *
 * Layouts (all contiguous):
 *   query, out     [num_seqs, num_kv_heads * group, head_dim] float32;
 *                  query head i attends with KV head i / group (as SDPA's enable_gqa)
 *   key, value     [num_blocks, block_size, num_kv_heads, head_dim] in the storage dtype
 *   key/val scale  [num_blocks, block_size, num_kv_heads] float32 or NULL
 *   block_tables   [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (keys to attend)
 *   lut            256 floats for the fp8 formats (byte -> value), else NULL
 *   lse            [num_seqs, num_kv_heads * group] float32 or NULL: each head's log-sum-exp
 *                  of its scaled scores, to merge this part of the keys with another
 *                  (attention/shared_prefix.py)
 *
 * Built by kvserve/attention/cpu_kernels.py with gcc -O3 -march=native -fopenmp; the OpenMP
 * runtime is the one torch already loaded (same soname), so the kernel shares its threads.
 */
#define _GNU_SOURCE /* syscall(), for amx_tiles.h on AMX builds */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_exp.h"

/* 4 was "fp8 through the table", before each fp8 format had its own kind */
enum kv_kind { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_I8 = 3, KV_E4M3 = 5, KV_E5M2 = 6 };

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
        for (d = 0; d < dim; d++) dst[d] = (float)src[d] * scale;
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

/* y[0:dim] += sum_o p[o] * rows[o][0:dim]; 16 lanes of y stay in registers across the rows. */
static inline void weighted_sum(float *restrict y, const float *p, const float *const *rows,
                                int count, int dim) {
    int d = 0;
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
                              int dim, float *buf, const float **rows) {
    for (int o = 0; o < count; o++) {
        int64_t idx = (first_slot + o) * num_kv_heads + kv_head;
        float s = scales ? scales[idx] : 1.0f;
        rows[o] = load_row(cache, kind, idx * dim, dim, s, lut, buf + (int64_t)o * dim);
    }
}

/* One sequence, all its heads, one pass over its blocks with an online softmax.
 * work: 2 * num_heads + group * block_size + 2 * block_size * dim floats. */
static void attend_sequence(const float *q, float *out, const void *key, const void *value,
                            const float *key_scale, const float *value_scale, const float *lut,
                            int kind, int elem_bytes, const int64_t *table, int64_t seq_len,
                            int num_kv_heads, int group, int dim, int block_size,
                            float sm_scale, float *work, float *lse) {
    const int num_heads = num_kv_heads * group;
    const int64_t block_bytes = (int64_t)block_size * num_kv_heads * dim * elem_bytes;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    float *run_max = work, *run_sum = run_max + num_heads, *probs = run_sum + num_heads;
    float *key_buf = probs + group * block_size, *value_buf = key_buf + block_size * dim;
    const float *key_rows[block_size], *value_rows[block_size];
    for (int head = 0; head < num_heads; head++) {
        run_max[head] = -INFINITY;
        run_sum[head] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)num_heads * dim);
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) {
            prefetch_rows((const char *)key + table[b + 1] * block_bytes, block_bytes);
            prefetch_rows((const char *)value + table[b + 1] * block_bytes, block_bytes);
        }
        int64_t first_slot = table[b] * block_size;
        int count = (int)(seq_len - b * block_size < block_size ? seq_len - b * block_size
                                                                : block_size);
        for (int h = 0; h < num_kv_heads; h++) {
            block_rows(key, key_scale, kind, lut, first_slot, count, h, num_kv_heads, dim,
                       key_buf, key_rows);
            block_rows(value, value_scale, kind, lut, first_slot, count, h, num_kv_heads, dim,
                       value_buf, value_rows);
            for (int g = 0; g < group; g++) {
                int head = h * group + g;
                float *p = probs + g * block_size, *acc = out + (int64_t)head * dim;
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
                weighted_sum(acc, p, value_rows, count, dim);
            }
        }
    }
    for (int head = 0; head < num_heads; head++) {
        float inv = 1.0f / run_sum[head];
        for (int d = 0; d < dim; d++) out[(int64_t)head * dim + d] *= inv;
        if (lse) lse[head] = run_max[head] + logf(run_sum[head]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define HAVE_BF16_DOT 1
/* A bfloat16 cache on a CPU with AVX512-BF16: q . k straight from the stored bf16 rows with
 * vdpbf16ps (pairs of bf16 products summed in float32).  The queries are bf16 values widened
 * to float32 by the caller, so narrowing them back is exact; sums stay float32.  Per block and
 * KV head: 16 rows' dot products in 16 accumulators folded by one transposing reduction, an
 * online softmax on 16 lanes at once, and p x V in float32. */
#define BF16_CHUNKS_MAX 8 /* dim <= 256 */

/* r[o] = sum of a[o]'s 16 lanes, for 16 vectors at once: a transposing reduction (pairs of
 * rows, then quads, then the four 128-bit quarters) instead of 16 horizontal sums. */
static inline __m512 sum16x16(const __m512 *a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane: [A02 B02 A13 B13], A, B = rows 2i, 2i+1 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++) { /* 128-bit lane: rows 4j..4j+3, one quarter's sum each */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * j]), _mm512_castps_pd(t[2 * j + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * j]), _mm512_castps_pd(t[2 * j + 1]));
        u[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                               _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                               _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                         _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* Lane o = q . row o for 16 rows of CHUNKS x 32 bf16 values (rows past the span point at
 * zeros): straight-line code, the 16 x CHUNKS loads and dot products independent of each
 * other, so the CPU overlaps their latencies (a loop with a row count and a chunk count
 * known only at run time measured ~2x slower). */
#define DEFINE_SCORES16(CHUNKS)                                                                \
    static inline __m512 bf16_scores16_##CHUNKS(const __m512bh *q,                             \
                                                const uint16_t *const *rows) {                 \
        __m512 acc[16];                                                                        \
        for (int o = 0; o < 16; o++) {                                                         \
            acc[o] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0],                               \
                                      (__m512bh)_mm512_loadu_si512(rows[o]));                  \
            for (int c = 1; c < CHUNKS; c++)                                                   \
                acc[o] = _mm512_dpbf16_ps(acc[o], q[c],                                        \
                                          (__m512bh)_mm512_loadu_si512(rows[o] + 32 * c));     \
        }                                                                                      \
        return sum16x16(acc);                                                                  \
    }
DEFINE_SCORES16(1)
DEFINE_SCORES16(2)
DEFINE_SCORES16(4)

static const uint16_t ZERO_ROW[128] __attribute__((aligned(64))); /* dim <= 128 */

/* q . row for the n (<= 16) rows given; lanes past n are 0. */
static inline __m512 bf16_scores16(const __m512bh *q, const uint16_t **rows, int n, int chunks) {
    for (int o = n; o < 16; o++) rows[o] = ZERO_ROW;
    switch (chunks) {
    case 1: return bf16_scores16_1(q, rows);
    case 2: return bf16_scores16_2(q, rows);
    default: return bf16_scores16_4(q, rows);
    }
}

/* True when every value of q is a bfloat16 widened to float32 (its low 16 bits are zero):
 * then the bf16 dot products are exact, and the engine's bf16 model always passes such q. */
static inline int is_bf16_exact(const float *q, int count) {
    int d = 0;
    __m512i low = _mm512_setzero_si512();
    for (; d + 16 <= count; d += 16)
        low = _mm512_or_si512(low, _mm512_and_si512(_mm512_loadu_si512(q + d),
                                                    _mm512_set1_epi32(0xffff)));
    uint32_t rest = 0;
    for (; d < count; d++) {
        uint32_t bits;
        memcpy(&bits, q + d, sizeof bits);
        rest |= bits & 0xffffu;
    }
    return _mm512_test_epi32_mask(low, low) == 0 && rest == 0;
}

/* 16 float32 values (16c .. 16c+15) of one stored row, unscaled.  Every 8-bit code and every
 * bf16 value is exact in float32 (and in bf16: int8 codes are 8-bit integers, fp8 values have
 * 2-3 mantissa bits), which lets the 8-bit caches share the bf16 dot products below. */
static inline __m512 fp8_chunk(const uint8_t *src, int mant_bits, int rebias, float sub_unit) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __mmask16 normal = _mm512_cmpge_epu32_mask(em, _mm512_set1_epi32(1 << mant_bits));
    __m512 nv = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 23 - mant_bits),
                                                     _mm512_set1_epi32(rebias << 23)));
    __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(sub_unit));
    __m512 v = _mm512_mask_blend_ps(normal, sv, nv); /* exponent 0: subnormal, m x unit */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

static inline __m512 chunk_f32(int kind, const void *row, int c) {
    switch (kind) {
    case KV_BF16: {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 16 * c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case KV_I8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)row + 16 * c))));
    case KV_E4M3: /* bias 7: rebias by 120, subnormals m x 2^-9 */
        return fp8_chunk((const uint8_t *)row + 16 * c, 3, 120, 1.0f / 512.0f);
    default: /* KV_E5M2, bias 15: rebias by 112, subnormals m x 2^-16 */
        return fp8_chunk((const uint8_t *)row + 16 * c, 2, 112, 1.0f / 65536.0f);
    }
}

/* a[g][c] += weight(g) x chunk c of one stored row, for the GS heads of a group: each chunk
 * widened once, then one FMA per head (the accumulators of DEFINE_PV and DEFINE_PV_SEQ). */
#define PV_ROW(GS, C, kind, row, weight)                                                       \
    for (int c = 0; c < C; c++) {                                                              \
        __m512 v = chunk_f32(kind, row, c);                                                    \
        for (int g = 0; g < GS; g++)                                                           \
            a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight), v, a[g][c]);                     \
    }
#define PV_STORE(GS, C)                                                                        \
    for (int g = 0; g < GS; g++)                                                               \
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + g * stride + 16 * c, a[g][c]);

/* acc[g] (dim floats, g < GS, `stride` apart) += sum over the n rows of w[g * 16 + o] x V row o.
 * The GS x C accumulators stay in registers for the whole span and each V chunk is converted
 * once for all GS heads: p x V is then a handful of FMAs per loaded value. */
#define DEFINE_PV(GS, C)                                                                       \
    static void pv_##GS##_##C(float *acc, int64_t stride, const float *w,                     \
                              const void *const *rows, int n, int kind) {                      \
        __m512 a[GS][C];                                                                       \
        for (int g = 0; g < GS; g++)                                                           \
            for (int c = 0; c < C; c++) a[g][c] = _mm512_loadu_ps(acc + g * stride + 16 * c);  \
        for (int o = 0; o < n; o++) PV_ROW(GS, C, kind, rows[o], w[g * 16 + o])                \
        PV_STORE(GS, C)                                                                        \
    }
DEFINE_PV(1, 2) DEFINE_PV(2, 2) DEFINE_PV(3, 2) DEFINE_PV(4, 2)
DEFINE_PV(5, 2) DEFINE_PV(6, 2) DEFINE_PV(7, 2) DEFINE_PV(8, 2)
DEFINE_PV(1, 4) DEFINE_PV(2, 4) DEFINE_PV(3, 4) DEFINE_PV(4, 4)
DEFINE_PV(1, 8) DEFINE_PV(2, 8)
typedef void (*pv_fn)(float *, int64_t, const float *, const void *const *, int, int);
static const pv_fn PV_BY_SHAPE[9][9] = { /* [C][GS]: dim 32, 64, 128 */
    [2] = {0, pv_1_2, pv_2_2, pv_3_2, pv_4_2, pv_5_2, pv_6_2, pv_7_2, pv_8_2},
    [4] = {0, pv_1_4, pv_2_4, pv_3_4, pv_4_4},
    [8] = {0, pv_1_8, pv_2_8},
};

static inline int fast_dim(int dim) { return dim == 32 || dim == 64 || dim == 128; }

/* The scale of each of the span's rows for one KV head (1 for unscaled storage). */
static inline __m512 span_scales(const float *scales, int64_t first_slot, int n, int kv_head,
                                 int num_kv_heads) {
    if (!scales) return _mm512_set1_ps(1.0f);
    float s[16];
    for (int o = 0; o < 16; o++)
        s[o] = o < n ? scales[(first_slot + o) * num_kv_heads + kv_head] : 1.0f;
    return _mm512_loadu_ps(s);
}

/* Rows of 8-bit codes as bf16 (exact) in buf, for the bf16 dot products. */
static inline void rows_to_bf16(int kind, const void *const *rows, int n, int dim,
                                uint16_t *buf, const uint16_t **out_rows) {
    for (int o = 0; o < n; o++) {
        for (int c = 0; c < dim / 16; c += 2) {
            __m512bh pair = _mm512_cvtne2ps_pbh(chunk_f32(kind, rows[o], c + 1),
                                                chunk_f32(kind, rows[o], c));
            _mm512_storeu_si512(buf + o * dim + 16 * c, (__m512i)pair);
        }
        out_rows[o] = buf + o * dim;
    }
}

/* Softmax of n scores in place (lanes beyond n are ignored): p = exp(s - max), returns 1 / sum. */
static float softmax_in_place(float *s, int64_t n, float *max_out) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + i));
    *max_out = _mm512_reduce_max_ps(mx);
    __m512 shift = _mm512_set1_ps(*max_out), sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
        _mm512_storeu_ps(s + i, p);
        sum = _mm512_add_ps(sum, p);
    }
    if (tail) {
        __m512 p = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), shift)));
        _mm512_mask_storeu_ps(s + i, tail, p);
        sum = _mm512_add_ps(sum, p);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Block b of a sequence's table in `cache` (bytes); *count: how many of its rows the sequence
 * uses. */
static inline const char *table_block(const void *cache, const int64_t *table, int64_t b,
                                      int64_t block_bytes, int64_t seq_len, int block_size,
                                      int *count) {
    int64_t left = seq_len - b * block_size;
    *count = (int)(left < block_size ? left : block_size);
    return (const char *)cache + table[b] * block_bytes;
}

/* Prefetch (into L2) the part-th of `parts` equal slices of the cache lines of `bytes` bytes at
 * base.  Asking for a whole block at once (~100 lines) stalls the core: each prefetch holds
 * one of its ~16 line-fill buffers until memory answers, so the compute waits for the block
 * and nothing overlaps.  Spread across the block's compute, a few lines at a time, the loads
 * run under the arithmetic: 2.38 -> 1.98 ms per layer at 128 x 320 tokens (docs/benchmarks.md). */
/* [*begin, *end): slice `part` of `parts` equal slices of `lines` lines. */
static inline void line_slice(int64_t lines, int64_t part, int64_t parts, int64_t *begin,
                              int64_t *end) {
    int64_t per = (lines + parts - 1) / parts;
    *begin = part * per;
    *end = *begin + per < lines ? *begin + per : lines;
}

static inline void prefetch_part(const char *base, int64_t bytes, int part, int parts) {
    int64_t line, end;
    line_slice((bytes + 63) / 64, part, parts, &line, &end);
    for (; line < end; line++) __builtin_prefetch(base + line * 64, 0, 2);
}

/* What the pass over V prefetches for the sequence this thread attends next: the K and V of
 * its first NEXT_SEQ_ROWS tokens (two blocks of 16; the head of one larger block), so that
 * its first pass does not start on a miss.  Whole blocks of 64 or 128 tokens would be asked
 * for under the current sequence's p x V and crowd out its own V. */
#define NEXT_SEQ_ROWS 32
typedef struct {
    const int64_t *table; /* NULL: no next sequence */
    int64_t blocks;       /* blocks holding its first min(seq_len, NEXT_SEQ_ROWS) tokens */
    int64_t bytes;        /* bytes asked for in each of them */
} next_sequence;

static inline next_sequence next_sequence_of(const int64_t *table, int64_t seq_len,
                                             int block_size, int64_t row_bytes) {
    const int64_t rows = seq_len < NEXT_SEQ_ROWS ? seq_len : NEXT_SEQ_ROWS;
    const int64_t per_block = block_size < NEXT_SEQ_ROWS ? block_size : NEXT_SEQ_ROWS;
    return (next_sequence){table, (rows + block_size - 1) / block_size, per_block * row_bytes};
}

/* Slice `part` of `parts` of the next sequence's first rows (K and V alternating by block). */
static inline void prefetch_next_part(const void *key, const void *value, next_sequence next,
                                      int64_t block_bytes, int64_t part, int64_t parts) {
    if (!next.table) return;
    int64_t lines_per = (next.bytes + 63) / 64, line, end;
    line_slice(2 * next.blocks * lines_per, part, parts, &line, &end);
    for (; line < end; line++) {
        int64_t which = line / lines_per;
        const char *base = (const char *)(which & 1 ? value : key) + next.table[which >> 1] * block_bytes;
        __builtin_prefetch(base + (line % lines_per) * 64, 0, 2);
    }
}

/* The span (16 rows, or a whole block of fewer) after the one at row `start` of block b of a
 * sequence, in a cache of rows row_stride bytes apart: its address, or NULL past the end. */
static inline const char *next_span(const void *cache, const int64_t *table, int64_t b, int start,
                                    int64_t seq_len, int block_size, int64_t row_stride) {
    const int span = block_size < 16 ? block_size : 16;
    if (b * block_size + start + span >= seq_len) return NULL;
    if (start + span < block_size)
        return (const char *)cache + (table[b] * block_size + start + span) * row_stride;
    return (const char *)cache + table[b + 1] * block_size * row_stride;
}

/* rows[o] = row o of a block for one KV head (offset bytes into each row). */
static inline void head_rows(const char *block, int count, int64_t row_stride, int64_t offset,
                             const void **rows) {
    for (int o = 0; o < count; o++) rows[o] = block + o * row_stride + offset;
}

/* One sequence over a bf16 or 8-bit cache, with bf16-exact queries (a bf16 model), in two
 * passes: every score first (bf16 dot products; 8-bit K codes widened to bf16 exactly, times
 * their scales), one softmax per head over the whole sequence, then p x V in float32 with
 * register accumulators (V scales folded into the weights).  Against an online softmax per
 * block this saves the per-block maxima, rescaling and exponentials' latency chains; the
 * scores (num_heads x seq_len floats) stay in L2.
 * Both passes walk the sequence in spans of 16 rows, all KV heads of a span before the next
 * (a block of 64 or 128 tokens is read once, not once a head), and each asks for its own rows
 * one span ahead, in slices spread over the span's work: K during the scores, V during p x V.
 * Asked for a block ahead instead, larger blocks lost (W1's 128 x 320 tokens, a layer: 32-token
 * blocks 1.55 -> 1.28 ms with spans, 64 and 128 tokens, which took the general path then,
 * 4.2-4.5 -> 1.2-1.3 ms, 16 tokens the same bit for bit; /tmp/k16/bs2.py, twenty-first round).
 * V is asked for under p x V, not under the scores: with both asked for during the scores,
 * the first pass streamed the whole 2 x 6 KiB a block at the core's limit of misses in flight
 * and p x V ran from L2 with the memory idle: on the AMD EPYC (no AMX) W1's 128 x 320 tokens
 * took 1.69 ms a layer against 1.48 with V fetched under p x V (alternating, six rounds each,
 * /tmp/k14/ab.py; docs/benchmarks.md, nineteenth round).
 * work: 16 * group + 8 * dim + num_heads * round_up(seq_len, 16) floats. */
static void attend_sequence_fast(const float *q, float *out, const void *key, const void *value,
                                 const float *key_scale, const float *value_scale, int kind,
                                 const int64_t *table, int64_t seq_len, int num_kv_heads,
                                 int group, int dim, int block_size, float sm_scale,
                                 float *work, float *lse, next_sequence next) {
    const int num_heads = num_kv_heads * group, chunks = dim / 32, elem = kind == KV_BF16 ? 2 : 1;
    const int64_t row_stride = (int64_t)num_kv_heads * dim * elem;
    const int64_t block_bytes = block_size * row_stride;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t padded = (seq_len + 15) / 16 * 16;
    float *w = work, *scores = w + 16 * group;
    uint16_t *kbuf = (uint16_t *)(scores + (int64_t)num_heads * padded);
    const int gs_max = 16 / (dim / 16) < group ? 16 / (dim / 16) : group;
    __m512bh qbf[num_heads][BF16_CHUNKS_MAX];
    for (int head = 0; head < num_heads; head++)
        for (int c = 0; c < chunks; c++) {
            const float *src = q + (int64_t)head * dim + 32 * c;
            qbf[head][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
    const void *rows[16];
    const uint16_t *kbf[16]; /* bf16_scores16 fills the rows past a short span */
    const int span_rows = block_size < 16 ? block_size : 16;
    const int64_t span_bytes = span_rows * row_stride;
    const int64_t num_spans = (seq_len + span_rows - 1) / span_rows;
    for (int64_t b = 0; b < num_blocks; b++) { /* pass 1: scores */
        int count;
        const char *block = table_block(key, table, b, block_bytes, seq_len, block_size, &count);
        for (int start = 0; start < count; start += 16) {
            const int n = count - start < 16 ? count - start : 16;
            const int64_t row0 = b * block_size + start;
            const char *ahead = next_span(key, table, b, start, seq_len, block_size, row_stride);
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int h = 0; h < num_kv_heads; h++) {
                head_rows(block + start * row_stride, n, row_stride, (int64_t)h * dim * elem, rows);
                __m512 ks = _mm512_mul_ps(
                    span_scales(key_scale, table[b] * block_size + start, n, h, num_kv_heads),
                    _mm512_set1_ps(sm_scale));
                if (kind == KV_BF16)
                    for (int o = 0; o < n; o++) kbf[o] = (const uint16_t *)rows[o];
                else
                    rows_to_bf16(kind, rows, n, dim, kbuf, kbf);
                for (int g = 0; g < group; g++) {
                    if (ahead) /* the next span's K */
                        prefetch_part(ahead, span_bytes, h * group + g, num_heads);
                    __m512 sc = _mm512_mul_ps(bf16_scores16(qbf[h * group + g], kbf, n, chunks), ks);
                    _mm512_mask_storeu_ps(scores + (int64_t)(h * group + g) * padded + row0, live, sc);
                }
            }
        }
    }
    /* pass 2's first span */
    prefetch_part((const char *)value + table[0] * block_bytes, span_bytes, 0, 1);
    float inv_sum[num_heads], max_score[num_heads];
    for (int head = 0; head < num_heads; head++)
        inv_sum[head] = softmax_in_place(scores + (int64_t)head * padded, seq_len, &max_score[head]);
    memset(out, 0, sizeof(float) * (size_t)num_heads * dim);
    for (int64_t b = 0; b < num_blocks; b++) { /* pass 2: p x V */
        int count;
        const char *block = table_block(value, table, b, block_bytes, seq_len, block_size, &count);
        for (int start = 0; start < count; start += 16) {
            const int n = count - start < 16 ? count - start : 16;
            const int64_t row0 = b * block_size + start;
            const char *ahead = next_span(value, table, b, start, seq_len, block_size, row_stride);
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int h = 0; h < num_kv_heads; h++) {
                if (ahead) prefetch_part(ahead, span_bytes, h, num_kv_heads); /* next V */
                prefetch_next_part(key, value, next, block_bytes,
                                   row0 / span_rows * num_kv_heads + h, num_spans * num_kv_heads);
                head_rows(block + start * row_stride, n, row_stride, (int64_t)h * dim * elem, rows);
                __m512 vs = span_scales(value_scale, table[b] * block_size + start, n, h, num_kv_heads);
                for (int g = 0; g < group; g++) {
                    const float *p = scores + (int64_t)(h * group + g) * padded + row0;
                    _mm512_storeu_ps(w + 16 * g, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p), vs));
                }
                for (int g0 = 0; g0 < group; g0 += gs_max) {
                    int gs = group - g0 < gs_max ? group - g0 : gs_max;
                    PV_BY_SHAPE[dim / 16][gs](out + (int64_t)(h * group + g0) * dim, dim,
                                              w + 16 * g0, rows, n, kind);
                }
            }
        }
    }
    for (int head = 0; head < num_heads; head++) {
        if (lse) lse[head] = max_score[head] - logf(inv_sum[head]);
        __m512 inv = _mm512_set1_ps(inv_sum[head]);
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + (int64_t)head * dim + d,
                             _mm512_mul_ps(_mm512_loadu_ps(out + (int64_t)head * dim + d), inv));
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define DECODE_HAS_AMX 1
#include "amx_tiles.h"

/* A bfloat16 or 8-bit cache on a CPU with AMX: the scores of a sequence on tiles instead of
 * the vdpbf16ps path's 16-lane dot products and their transposing reductions (W1's 128 x 320
 * tokens: 1.87 -> 1.76 ms a layer; the traffic, not the arithmetic, bounds both).  8-bit K
 * codes are widened to bf16 (exactly) 16 rows at a time into a buffer the A tile is loaded
 * from, and their scales multiply the stored scores; V scales multiply the softmax weights
 * (the sum stays unscaled), so p x V reads the codes as they are stored.  That is the
 * vdpbf16ps path's arithmetic, and half the bytes of a bf16 cache to read.
 * S^T = K x Q^T: the A tile is 16 cached K rows read in place (32 dimensions of one KV head, the
 * row stride apart), the B tile the queries as dimension pairs, one column per query head.
 * Column n of KV head h's B tile is zero unless head n attends with h, so one accumulator
 * tile sums all the KV heads' products without mixing them: C[t][n] = q_n . k_{h(n)}[t].
 * Scores are then [token][16 heads] float32: the softmax runs on all heads at once (one lane
 * each), and p x V reads its weights as broadcasts from one 64-byte row per token. */

#define QTILE_WORDS 512 /* 16 rows x 32 bf16 */

int paged_decode_amx_enabled = 1; /* tests and benchmarks switch it (paged_decode_use_amx) */

int paged_decode_use_amx(int on) {
    int was = paged_decode_amx_enabled;
    paged_decode_amx_enabled = on;
    return was;
}

static inline int amx_shape(int kind, int num_heads, int dim, int block_size) {
    return paged_decode_amx_enabled
           && (kind == KV_BF16 || kind == KV_I8 || kind == KV_E4M3 || kind == KV_E5M2)
           && num_heads <= 16
           && (dim == 32 || dim == 64 || dim == 128) && block_size % 16 == 0 && amx_permitted();
}

/* tiles[(h * chunks + c) * QTILE_WORDS]: row r, column n = (q_n[32c + 2r], q_n[32c + 2r + 1])
 * for the heads n of KV head h's group, zero elsewhere.  q is bf16-exact float32, so its 32
 * values of a chunk narrowed to bf16 are exact, and as 16 32-bit pairs they are the column's
 * 16 rows: one scatter a chunk (the scalar loop, 576 element moves a sequence of W1, cost ~1/4
 * of a one-token decode's time). */
static void pack_query_tiles(const float *q, int num_kv_heads, int group, int dim,
                             uint16_t *tiles) {
    const int chunks = dim / 32;
    const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                           192, 208, 224, 240);
    memset(tiles, 0, sizeof(uint16_t) * QTILE_WORDS * num_kv_heads * chunks);
    for (int n = 0; n < num_kv_heads * group; n++)
        for (int c = 0; c < chunks; c++) {
            const float *src = q + (int64_t)n * dim + 32 * c;
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16),
                                                               _mm512_loadu_ps(src));
            int *tile = (int *)(tiles + ((n / group) * chunks + c) * QTILE_WORDS);
            _mm512_i32scatter_epi32(tile + n, rows, pairs, 4);
        }
}

/* x[t * 16 + n] *= scales[first_slot + t][n / group] for the n rows of a span (lanes past
 * the heads multiplied by scales of KV head 0: never read).  The scales of a row's KV heads
 * are adjacent, so one masked load and a permute give the 16 lanes' factors. */
static inline void scale_lanes(float *x, const float *scales, int64_t first_slot, int n,
                               int num_kv_heads, int group) {
    int lanes[16];
    for (int i = 0; i < 16; i++) lanes[i] = i / group < num_kv_heads ? i / group : 0;
    const __m512i head_of = _mm512_loadu_si512(lanes);
    const __mmask16 heads = (__mmask16)((1u << num_kv_heads) - 1u);
    for (int t = 0; t < n; t++) {
        const __m512 row = _mm512_maskz_loadu_ps(heads, scales + (first_slot + t) * num_kv_heads);
        _mm512_storeu_ps(x + 16 * t,
                         _mm512_mul_ps(_mm512_loadu_ps(x + 16 * t), _mm512_permutexvar_ps(head_of, row)));
    }
}

/* Pass 1: scores[t * 16 + n] = q_n . k_t for every token t of the sequence (times K's scale
 * for scaled 8-bit codes), whole spans of 16 (rows past seq_len are computed from whatever
 * the block holds and never read).  SPANS_IN_FLIGHT spans at a time, each in its own
 * accumulator tile (tmm0-3), K tiles alternating in tmm4-5 and one query tile (tmm6) shared
 * by the spans: a tile product waits for the one before it on the same accumulator, so one
 * span's six products in a row left the tile unit idle between them, and each query tile
 * was loaded once a span.  While a group's scores are computed, its blocks' V and the next
 * group's K are asked for (and their scales); the addresses are worked out once a group, not
 * in the product loop (where a few integer divisions a call made the kernel 1.4x slower).
 * W1's shape, 30 layers of 128 x 320 tokens: bf16 57.2 -> 52.0 ms, int8 50.3 -> 45.9 ms
 * (docs/benchmarks.md).  kbuf: SPANS_IN_FLIGHT x 16 rows of num_kv_heads x dim bf16 (8-bit
 * caches). */
#define SPANS_IN_FLIGHT 4

#define SPAN_PRODUCT(J, KT)                                                                    \
    if (n > J) {                                                                               \
        _tile_loadd(KT, rows[J] + offset, a_stride);                                           \
        _tile_dpbf16ps(J, KT, 6);                                                              \
        if (its_value[J]) prefetch_part(its_value[J], block_bytes, i, tiles);                  \
        if (later_key[J]) prefetch_part(later_key[J], block_bytes, i, tiles);                  \
    }
#define SPAN_STORE(J)                                                                          \
    if (n > J) _tile_stored(J, scores + (s0 + J) * 256, 64);

static void scores_amx(const uint16_t *qtiles, const char *key, const char *value,
                       const float *key_scale, const float *value_scale, int kind,
                       const int64_t *table, int64_t seq_len, int num_kv_heads, int group,
                       int dim, int block_size, int64_t row_stride, uint16_t *kbuf,
                       float *scores) {
    const int chunks = dim / 32, tiles = num_kv_heads * chunks, width = num_kv_heads * dim;
    const int64_t block_bytes = block_size * row_stride, num_spans = (seq_len + 15) / 16;
    const int64_t scale_floats = (int64_t)block_size * num_kv_heads;
    const int64_t a_stride = kind == KV_BF16 ? row_stride : (int64_t)width * 2;
    const int spans_per_block = block_size / 16;
    for (int64_t s0 = 0; s0 < num_spans; s0 += SPANS_IN_FLIGHT) {
        const int n = num_spans - s0 < SPANS_IN_FLIGHT ? (int)(num_spans - s0) : SPANS_IN_FLIGHT;
        const char *rows[SPANS_IN_FLIGHT], *its_value[SPANS_IN_FLIGHT], *later_key[SPANS_IN_FLIGHT];
        for (int j = 0; j < n; j++) {
            const int64_t s = s0 + j, b = s / spans_per_block, first = s % spans_per_block == 0;
            const int64_t later = s + SPANS_IN_FLIGHT;
            const int later_first = later < num_spans && later % spans_per_block == 0;
            rows[j] = key + (table[b] * block_size + (s % spans_per_block) * 16) * row_stride;
            its_value[j] = first ? value + table[b] * block_bytes : NULL;
            later_key[j] = later_first ? key + table[later / spans_per_block] * block_bytes : NULL;
            if (first && value_scale) /* read after the softmax */
                prefetch_part((const char *)(value_scale + table[b] * scale_floats),
                              scale_floats * 4, 0, 1);
            if (later_first && key_scale) {
                const int64_t later_block = table[later / spans_per_block];
                prefetch_part((const char *)(key_scale + later_block * scale_floats),
                              scale_floats * 4, 0, 1);
            }
            if (kind != KV_BF16) { /* the span's 16 rows as bf16 (exact), all KV heads */
                const void *codes[16];
                const uint16_t *widened[16];
                uint16_t *buf = kbuf + (int64_t)j * 16 * width;
                for (int o = 0; o < 16; o++) codes[o] = rows[j] + o * row_stride;
                rows_to_bf16(kind, codes, 16, width, buf, widened);
                rows[j] = (const char *)buf;
            }
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int i = 0; i < tiles; i++) {
            const int64_t offset = (int64_t)(i / chunks) * dim * 2 + (i % chunks) * 64;
            _tile_loadd(6, qtiles + i * QTILE_WORDS, 64);
            SPAN_PRODUCT(0, 4)
            SPAN_PRODUCT(1, 5)
            SPAN_PRODUCT(2, 4)
            SPAN_PRODUCT(3, 5)
        }
        SPAN_STORE(0)
        SPAN_STORE(1)
        SPAN_STORE(2)
        SPAN_STORE(3)
        if (key_scale)
            for (int j = 0; j < n; j++) {
                const int64_t s = s0 + j, token = s * 16, left = seq_len - token;
                scale_lanes(scores + token * 16, key_scale,
                            table[s / spans_per_block] * block_size + (s % spans_per_block) * 16,
                            left < 16 ? (int)left : 16, num_kv_heads, group);
            }
    }
}

/* Softmax over the tokens of all 16 lanes (heads) at once, in place: p = exp((s - max) x
 * sm_scale).  lse[n] (lse not NULL): lane n's log-sum-exp of the scaled scores; returns the
 * lanes' 1 / sum. */
static __m512 softmax_columns(float *scores, int64_t seq_len, float sm_scale, float *lse) {
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < seq_len; t++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(scores + 16 * t));
    const __m512 scale = _mm512_set1_ps(sm_scale), shift = _mm512_mul_ps(mx, scale);
    for (int64_t t = 0; t < seq_len; t++) {
        __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + 16 * t), scale, shift));
        _mm512_storeu_ps(scores + 16 * t, p);
        sum = _mm512_add_ps(sum, p);
    }
    if (lse) { /* 16 logf a sequence: skipped where nobody asks for them */
        float shifts[16], sums[16];
        _mm512_storeu_ps(shifts, shift);
        _mm512_storeu_ps(sums, sum);
        for (int n = 0; n < 16; n++) lse[n] = shifts[n] + logf(sums[n]);
    }
    return _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
}

/* acc[g] (dim floats, `stride` apart) = sum over the sequence's tokens t of p[t * 16 + g] x
 * V row t (one KV head, at head_offset in each row): the GS x C accumulators stay in registers
 * for the whole sequence, each V chunk widened once for all GS heads.  Over block b it asks
 * for slice `part0 + b` of `parts` of the next sequence's first blocks. */
#define DEFINE_PV_SEQ(GS, C, KIND, NAME)                                                       \
    static void pv_seq_##GS##_##C##_##NAME(float *acc, int64_t stride, const float *p,        \
                                  const char *value, const int64_t *table, int64_t seq_len,    \
                                  int block_size, int64_t row_stride, int64_t head_offset,     \
                                  const char *key, next_sequence next, int64_t part0,          \
                                  int64_t parts) {                                             \
        const int64_t block_bytes = block_size * row_stride;                                   \
        __m512 a[GS][C];                                                                       \
        for (int g = 0; g < GS; g++)                                                           \
            for (int c = 0; c < C; c++) a[g][c] = _mm512_setzero_ps();                         \
        for (int64_t b = 0, t = 0; t < seq_len; b++) {                                         \
            prefetch_next_part(key, value, next, block_bytes, part0 + b, parts);               \
            const char *block = value + table[b] * block_bytes + head_offset;                  \
            for (int o = 0; o < block_size && t < seq_len; o++, t++)                           \
                PV_ROW(GS, C, KIND, block + o * row_stride, p[t * 16 + g])                     \
        }                                                                                      \
        PV_STORE(GS, C)                                                                        \
    }
#define DEFINE_PV_SEQS(KIND, NAME)                                                             \
    DEFINE_PV_SEQ(1, 2, KIND, NAME) DEFINE_PV_SEQ(2, 2, KIND, NAME)                            \
    DEFINE_PV_SEQ(3, 2, KIND, NAME) DEFINE_PV_SEQ(4, 2, KIND, NAME)                            \
    DEFINE_PV_SEQ(5, 2, KIND, NAME) DEFINE_PV_SEQ(6, 2, KIND, NAME)                            \
    DEFINE_PV_SEQ(7, 2, KIND, NAME) DEFINE_PV_SEQ(8, 2, KIND, NAME)                            \
    DEFINE_PV_SEQ(1, 4, KIND, NAME) DEFINE_PV_SEQ(2, 4, KIND, NAME)                            \
    DEFINE_PV_SEQ(3, 4, KIND, NAME) DEFINE_PV_SEQ(4, 4, KIND, NAME)                            \
    DEFINE_PV_SEQ(1, 8, KIND, NAME) DEFINE_PV_SEQ(2, 8, KIND, NAME)
DEFINE_PV_SEQS(KV_BF16, bf16) DEFINE_PV_SEQS(KV_I8, i8)
DEFINE_PV_SEQS(KV_E4M3, e4m3) DEFINE_PV_SEQS(KV_E5M2, e5m2)

typedef void (*pv_seq_fn)(float *, int64_t, const float *, const char *, const int64_t *,
                          int64_t, int, int64_t, int64_t, const char *, next_sequence, int64_t,
                          int64_t);
/* [C][GS] for dim 32, 64, 128, one table per storage kind; each function's conversion of a
 * V chunk is then the kind's own, inlined, with no switch in the token loop. */
#define PV_SEQ_TABLE(NAME)                                                                     \
    {                                                                                          \
        [2] = {0, pv_seq_1_2_##NAME, pv_seq_2_2_##NAME, pv_seq_3_2_##NAME, pv_seq_4_2_##NAME,  \
               pv_seq_5_2_##NAME, pv_seq_6_2_##NAME, pv_seq_7_2_##NAME, pv_seq_8_2_##NAME},    \
        [4] = {0, pv_seq_1_4_##NAME, pv_seq_2_4_##NAME, pv_seq_3_4_##NAME, pv_seq_4_4_##NAME}, \
        [8] = {0, pv_seq_1_8_##NAME, pv_seq_2_8_##NAME},                                       \
    }
static const pv_seq_fn PV_SEQ_BF16[9][9] = PV_SEQ_TABLE(bf16), PV_SEQ_I8[9][9] = PV_SEQ_TABLE(i8),
                       PV_SEQ_E4M3[9][9] = PV_SEQ_TABLE(e4m3), PV_SEQ_E5M2[9][9] = PV_SEQ_TABLE(e5m2);

static pv_seq_fn pv_seq_for(int kind, int dim, int gs) {
    switch (kind) {
    case KV_BF16: return PV_SEQ_BF16[dim / 16][gs];
    case KV_I8: return PV_SEQ_I8[dim / 16][gs];
    case KV_E4M3: return PV_SEQ_E4M3[dim / 16][gs];
    default: return PV_SEQ_E5M2[dim / 16][gs];
    }
}

/* Floats of work attend_sequence_amx needs for sequences of up to `longest` tokens. */
static size_t amx_work_floats(int64_t longest, int num_kv_heads, int dim) {
    const size_t scores = (size_t)16 * ((longest + 15) / 16 * 16);
    return scores + (size_t)num_kv_heads * (dim / 32) * QTILE_WORDS / 2 /* + the query tiles */
           + (size_t)SPANS_IN_FLIGHT * 16 * num_kv_heads * dim / 2;     /* + the bf16 K spans */
}

/* One sequence over a bf16 or 8-bit cache with bf16-exact queries, its scores on AMX tiles
 * (the calling thread has configured them), then one softmax for all heads and p x V in
 * float32. */
static void attend_sequence_amx(const float *q, float *out, const void *key, const void *value,
                                const float *key_scale, const float *value_scale, int kind,
                                const int64_t *table, int64_t seq_len, int num_kv_heads,
                                int group, int dim, int block_size, float sm_scale, float *work,
                                float *lse, next_sequence next) {
    const int num_heads = num_kv_heads * group, elem = kind == KV_BF16 ? 2 : 1;
    const int64_t row_stride = (int64_t)num_kv_heads * dim * elem;
    float *scores = work;
    uint16_t *qtiles = (uint16_t *)(work + 16 * ((seq_len + 15) / 16 * 16));
    uint16_t *kbuf = qtiles + num_kv_heads * (dim / 32) * QTILE_WORDS;
    pack_query_tiles(q, num_kv_heads, group, dim, qtiles);
    scores_amx(qtiles, key, value, key_scale, value_scale, kind, table, seq_len, num_kv_heads,
               group, dim, block_size, row_stride, kbuf, scores);
    float inv_sum[16], lse_all[16];
    _mm512_storeu_ps(inv_sum, softmax_columns(scores, seq_len, sm_scale, lse ? lse_all : NULL));
    if (value_scale) /* after the sum: the weights of p x V, not the softmax's mass */
        for (int64_t start = 0; start < seq_len; start += block_size) {
            const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
            scale_lanes(scores + start * 16, value_scale, table[start / block_size] * block_size,
                        (int)n, num_kv_heads, group);
        }
    const int gs_max = 16 / (dim / 16) < group ? 16 / (dim / 16) : group;
    const int64_t blocks = (seq_len + block_size - 1) / block_size;
    const int calls = num_kv_heads * ((group + gs_max - 1) / gs_max);
    int call = 0;
    for (int h = 0; h < num_kv_heads; h++)
        for (int g0 = 0; g0 < group; g0 += gs_max, call++) {
            const int gs = group - g0 < gs_max ? group - g0 : gs_max, n = h * group + g0;
            pv_seq_for(kind, dim, gs)(out + (int64_t)n * dim, dim, scores + n, value, table,
                                      seq_len, block_size, row_stride, (int64_t)h * dim * elem,
                                      key, next, call * blocks, calls * blocks);
        }
    for (int head = 0; head < num_heads; head++) {
        if (lse) lse[head] = lse_all[head];
        const __m512 s = _mm512_set1_ps(inv_sum[head]);
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + (int64_t)head * dim + d,
                             _mm512_mul_ps(_mm512_loadu_ps(out + (int64_t)head * dim + d), s));
    }
}
#endif /* AMX */
#else
#define HAVE_BF16_DOT 0
#endif
#ifndef DECODE_HAS_AMX
#define DECODE_HAS_AMX 0
int paged_decode_use_amx(int on) { (void)on; return 0; }
#endif

typedef struct {
    const void *key, *value; /* [num_seqs] rows of row_bytes, *_stride_bytes apart */
    int64_t key_stride_bytes, value_stride_bytes;
    const int64_t *slots;
    int64_t row_bytes;
} new_rows;

static int element_bytes(int kind) {
    return kind == KV_F32 ? 4 : (kind == KV_BF16 || kind == KV_F16) ? 2 : 1;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch (no NaNs here) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Store sequence `seq`'s new K and V rows (this step's token, [kv_heads, dim] each, in the
 * cache's own dtype) into their slot.  Done by the thread that attends the sequence, just
 * before it reads that block: the store's cache line is then one the attention loads anyway,
 * where a separate store pass over the batch (kv_copy_store) missed on 2 x 128 cold lines a
 * layer and cost ~0.11 ms of a 128-sequence decode layer. */
static inline void store_new_rows(const new_rows *rows, int seq, void *key, void *value) {
    const int64_t slot = rows->slots[seq];
    memcpy((char *)key + slot * rows->row_bytes,
           (const char *)rows->key + seq * rows->key_stride_bytes, (size_t)rows->row_bytes);
    memcpy((char *)value + slot * rows->row_bytes,
           (const char *)rows->value + seq * rows->value_stride_bytes, (size_t)rows->row_bytes);
}

/* out (one sequence's heads x dim, attended over its keys, with log-sum-exps lse) merged with
 * the attention over other keys (prior, prior_lse): each head's share of the whole softmax
 * mass is sigmoid(lse - prior_lse), as shared_prefix.merge computes it.  In the thread that
 * attended the sequence, on its output still in L1; the merge in torch read and wrote both
 * [B, H, D] float32 tensors again (~1.2 ms of W3's 62 ms decode step). */
static void merge_prior(float *out, const float *prior, const float *prior_lse, const float *lse,
                        int num_heads, int dim) {
    for (int head = 0; head < num_heads; head++) {
        const float share = 1.0f / (1.0f + expf(prior_lse[head] - lse[head]));
        for (int d = 0; d < dim; d++) {
            const int64_t i = (int64_t)head * dim + d;
            out[i] = prior[i] + share * (out[i] - prior[i]);
        }
    }
}

/* Dynamic scheduling by hand, in shrinking chunks (as schedule(guided)): a thread takes a
 * quarter of its share of what is left at once, down to one sequence at the end.  One atomic
 * add a sequence moved the counter's cache line between the cores 128 times a layer: ~1/6 of
 * a one-token decode of 128 sequences (perf), ~8 us a thread. */
typedef struct {
    int *next;          /* the first sequence nobody has taken */
    int count, at, end; /* this thread's chunk: [at, end) */
} sequence_share;

static int take_sequence(sequence_share *s) {
    if (s->at < s->end) return s->at++;
    const int left = s->count - __atomic_load_n(s->next, __ATOMIC_RELAXED);
    const int threads = omp_get_num_threads();
    int chunk = left / (4 * threads);
    if (chunk < 1) chunk = 1;
    const int start = __atomic_fetch_add(s->next, chunk, __ATOMIC_RELAXED);
    if (start >= s->count) return s->count;
    s->end = start + chunk < s->count ? start + chunk : s->count;
    s->at = start + 1;
    return start;
}

/* query and out are [num_seqs, num_heads, dim]: float32, or bfloat16 when io_bf16 (a bf16
 * model's decode: each sequence's q is widened and its output rounded here, in the thread
 * that attends it, instead of two conversions of the whole batch per layer in torch).
 * new_key/new_value, when not NULL: each sequence's new token's K/V rows (row i at byte
 * i * new_*_stride_bytes, kv_heads x dim values of the cache's dtype), stored at new_slots[i]
 * before the sequence is attended.
 * prior_out/prior_lse, when not NULL: attention over other keys ([num_seqs, heads, dim] and
 * [num_seqs, heads] float32: a shared prefix's, shared_prefix.py), merged into each
 * sequence's output by the log-sum-exps (lse is then not written). */
int paged_decode_attention(const void *query, void *out, void *key, void *value,
                           const float *key_scale, const float *value_scale, const float *lut,
                           int kind, const int64_t *block_tables, const int64_t *seq_lens,
                           int num_seqs, int max_blocks, int num_kv_heads, int group, int dim,
                           int block_size, float sm_scale, int num_threads, float *lse,
                           int io_bf16, const void *new_key, const void *new_value,
                           int64_t new_key_stride_bytes, int64_t new_value_stride_bytes,
                           const int64_t *new_slots, const float *prior_out,
                           const float *prior_lse) {
    const new_rows rows = {new_key, new_value, new_key_stride_bytes, new_value_stride_bytes,
                           new_slots,
                           (int64_t)num_kv_heads * dim * element_bytes(kind)};
    const int num_heads = num_kv_heads * group;
    const int64_t row_floats = (int64_t)num_heads * dim;
    /* general path: 2 * heads + group * block_size + 2 * block_size * dim; fast path:
     * 16 * group + 8 * dim (16 rows of bf16) + heads * round_up(longest, 16) scores */
    int64_t longest = 0;
    for (int seq = 0; seq < num_seqs; seq++) longest = seq_lens[seq] > longest ? seq_lens[seq] : longest;
    size_t general = (size_t)2 * num_heads + (size_t)group * block_size + (size_t)2 * block_size * dim;
    size_t fast_work = (size_t)16 * group + (size_t)8 * dim + (size_t)num_heads * ((longest + 15) / 16 * 16);
    size_t work_floats = general > fast_work ? general : fast_work;
#if HAVE_BF16_DOT
    const int fast = (kind == KV_BF16 || kind == KV_I8 || kind == KV_E4M3 || kind == KV_E5M2)
                     && fast_dim(dim);
#endif
#if DECODE_HAS_AMX
    const int amx = fast && block_size <= 32 && amx_shape(kind, num_heads, dim, block_size);
    const size_t amx_floats = amx ? amx_work_floats(longest, num_kv_heads, dim) : 0;
    if (amx_floats > work_floats) work_floats = amx_floats;
#endif
    work_floats += io_bf16 ? 2 * (size_t)row_floats : 0;
    int failed = 0, next_seq = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *work = malloc(sizeof(float) * work_floats);
        if (!work) {
            #pragma omp atomic write
            failed = 1;
        }
        /* io_bf16: this sequence's q and output as float32, after the kernel's own work */
        float *q_row = work ? work + work_floats - 2 * row_floats : NULL;
        float *out_row = work ? q_row + row_floats : NULL;
        float own_lse[num_heads]; /* with prior_out: this sequence's log-sum-exps */
        /* Dynamic scheduling by hand (take_sequence), so that a thread knows the sequence
         * it takes next while it attends this one, and prefetches its first blocks. */
        sequence_share share = {&next_seq, num_seqs, 0, 0};
        int seq = work ? take_sequence(&share) : num_seqs;
#if DECODE_HAS_AMX
        if (amx) amx_configure_tiles();
#endif
        while (seq < num_seqs) {
            int following = take_sequence(&share);
            int64_t head0 = (int64_t)seq * row_floats;
            const float *q;
            float *o;
            if (io_bf16) {
                for (int64_t i = 0; i < row_floats; i++)
                    q_row[i] = bf16_to_float(((const uint16_t *)query)[head0 + i]);
                q = q_row;
                o = out_row;
            } else {
                q = (const float *)query + head0;
                o = (float *)out + head0;
            }
            float *seq_lse = prior_out ? own_lse : lse ? lse + (int64_t)seq * num_heads : NULL;
            if (new_key) store_new_rows(&rows, seq, key, value);
#if HAVE_BF16_DOT
            if (fast && is_bf16_exact(q, num_heads * dim)) {
                next_sequence next = {NULL, 0, 0};
                if (following < num_seqs)
                    next = next_sequence_of(block_tables + (int64_t)following * max_blocks,
                                            seq_lens[following], block_size, rows.row_bytes);
#if DECODE_HAS_AMX
                if (amx)
                    attend_sequence_amx(q, o, key, value, key_scale, value_scale, kind,
                                        block_tables + (int64_t)seq * max_blocks, seq_lens[seq],
                                        num_kv_heads, group, dim, block_size, sm_scale, work,
                                        seq_lse, next);
                else
#endif
                attend_sequence_fast(q, o, key, value, key_scale, value_scale, kind,
                                     block_tables + (int64_t)seq * max_blocks, seq_lens[seq],
                                     num_kv_heads, group, dim, block_size, sm_scale, work, seq_lse,
                                     next);
            } else
#endif
                attend_sequence(q, o, key, value, key_scale, value_scale, lut, kind,
                                element_bytes(kind), block_tables + (int64_t)seq * max_blocks,
                                seq_lens[seq], num_kv_heads, group, dim, block_size, sm_scale,
                                work, seq_lse);
            if (prior_out)
                merge_prior(o, prior_out + head0, prior_lse + (int64_t)seq * num_heads, own_lse,
                            num_heads, dim);
            if (io_bf16)
                for (int64_t i = 0; i < row_floats; i++)
                    ((uint16_t *)out)[head0 + i] = float_to_bf16(out_row[i]);
            seq = following;
        }
#if DECODE_HAS_AMX
        if (amx) _tile_release();
#endif
        free(work);
    }
    return failed;
}
