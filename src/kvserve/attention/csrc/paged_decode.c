/*
 * Decode attention over a paged KV cache, reading the blocks in place (CPU).
 *
 * The reference backend copies every decode sequence's blocks into a padded contiguous
 * tensor per layer and step, then attends over the copy: the K/V bytes cross memory three
 * times.  Here each (sequence, KV head) walks its block table and reads each K and V row
 * once, converting 8/16-bit storage to float32 on the fly.
 *
 * Layouts (all contiguous):
 *   query, out     [num_seqs, num_kv_heads * group, head_dim] float32;
 *                  query head i attends with KV head i / group (as SDPA's enable_gqa)
 *   key, value     [num_blocks, block_size, num_kv_heads, head_dim] in the storage dtype
 *   key/val scale  [num_blocks, block_size, num_kv_heads] float32 or NULL
 *   block_tables   [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (keys to attend)
 *   lut            256 floats for the fp8 formats (byte -> value), else NULL
 *
 * Built by kvserve/attention/cpu_kernels.py with gcc -O3 -march=native -fopenmp; the OpenMP
 * runtime is the one torch already loaded (same soname), so the kernel shares its threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum kv_kind { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_I8 = 3, KV_LUT8 = 4 };

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
        for (d = 0; d < dim; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(&dst[d], &bits, sizeof(float));
        }
        return dst;
    }
    case KV_F16: {
        const uint16_t *src = (const uint16_t *)cache + row;
        for (d = 0; d < dim; d++) dst[d] = half_to_float(src[d]);
        return dst;
    }
    case KV_I8: {
        const int8_t *src = (const int8_t *)cache + row;
        for (d = 0; d < dim; d++) dst[d] = (float)src[d] * scale;
        return dst;
    }
    default: { /* KV_LUT8 */
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
#else
static inline float dot(const float *restrict q, const float *restrict k, int dim) {
    float total = 0.0f;
    for (int d = 0; d < dim; d++) total += q[d] * k[d];
    return total;
}

static inline void weighted_sum(float *restrict y, const float *p, const float *const *rows,
                                int count, int dim) {
    for (int o = 0; o < count; o++)
        for (int d = 0; d < dim; d++) y[d] += p[o] * rows[o][d];
}
#endif

/* Ask for the next block's rows while this block is being used: the blocks of one sequence
 * are scattered, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_rows(const char *base, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(base + off, 0, 3);
}

/* One sequence, all its heads.  Block by block (a block's rows of all KV heads are
 * contiguous) and head by head, the block's rows are first made float32 (pointers into a
 * float32 cache, converted copies otherwise), then used by every query head of the group.
 * scores: [num_heads][seq_len] scratch; row_buf: [block_size][dim]. */
static void attend_sequence(const float *q, float *out, const void *key, const void *value,
                            const float *key_scale, const float *value_scale, const float *lut,
                            int kind, int elem_bytes, const int64_t *table, int64_t seq_len,
                            int num_kv_heads, int group, int dim, int block_size,
                            float sm_scale, float *scores, float *row_buf) {
    const int num_heads = num_kv_heads * group;
    const int64_t token_elems = (int64_t)num_kv_heads * dim;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const float *rows[block_size];
    memset(out, 0, sizeof(float) * (size_t)num_heads * dim);
    for (int pass = 0; pass < 2; pass++) {
        const void *cache = pass == 0 ? key : value;
        const float *scales = pass == 0 ? key_scale : value_scale;
        for (int64_t b = 0; b < num_blocks; b++) {
            if (b + 1 < num_blocks)
                prefetch_rows((const char *)cache
                                  + table[b + 1] * block_size * token_elems * elem_bytes,
                              (int64_t)block_size * token_elems * elem_bytes);
            int64_t j0 = b * block_size, first = table[b] * block_size;
            int count = (int)(seq_len - j0 < block_size ? seq_len - j0 : block_size);
            for (int h = 0; h < num_kv_heads; h++) {
                for (int o = 0; o < count; o++) {
                    int64_t idx = (first + o) * num_kv_heads + h;
                    float s = scales ? scales[idx] : 1.0f;
                    rows[o] = load_row(cache, kind, idx * dim, dim, s, lut, row_buf + o * dim);
                }
                for (int g = 0; g < group; g++) {
                    int head = h * group + g;
                    float *sh = scores + head * seq_len + j0;
                    if (pass == 0) {
                        const float *qh = q + (int64_t)head * dim;
                        for (int o = 0; o < count; o++) sh[o] = dot(qh, rows[o], dim) * sm_scale;
                    } else {
                        weighted_sum(out + (int64_t)head * dim, sh, rows, count, dim);
                    }
                }
            }
        }
        if (pass == 1) break;
        for (int head = 0; head < num_heads; head++) { /* softmax, in place */
            float *sh = scores + head * seq_len;
            float mx = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < seq_len; j++) mx = sh[j] > mx ? sh[j] : mx;
            for (int64_t j = 0; j < seq_len; j++) {
                sh[j] = expf(sh[j] - mx);
                total += sh[j];
            }
            float inv = 1.0f / total;
            for (int64_t j = 0; j < seq_len; j++) sh[j] *= inv;
        }
    }
}

static int element_bytes(int kind) {
    return kind == KV_F32 ? 4 : (kind == KV_BF16 || kind == KV_F16) ? 2 : 1;
}

int paged_decode_attention(const float *query, float *out, const void *key, const void *value,
                           const float *key_scale, const float *value_scale, const float *lut,
                           int kind, const int64_t *block_tables, const int64_t *seq_lens,
                           int num_seqs, int max_blocks, int num_kv_heads, int group, int dim,
                           int block_size, float sm_scale, int num_threads) {
    const int num_heads = num_kv_heads * group;
    int64_t max_len = 0;
    for (int i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores =
            malloc(sizeof(float) * (size_t)(num_heads * max_len + (int64_t)block_size * dim));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int seq = 0; seq < num_seqs; seq++) {
            if (!scores) continue;
            int64_t head0 = (int64_t)seq * num_heads * dim;
            attend_sequence(query + head0, out + head0, key, value, key_scale, value_scale, lut,
                            kind, element_bytes(kind), block_tables + (int64_t)seq * max_blocks,
                            seq_lens[seq], num_kv_heads, group, dim, block_size, sm_scale,
                            scores, scores + num_heads * max_len);
        }
        free(scores);
    }
    return failed;
}
