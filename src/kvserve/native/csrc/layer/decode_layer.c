/*
 * The work between two attentions of a bfloat16 step (decodes and prefills; the file keeps
 * its first name), in one call per layer: output projection, residual, RMSNorm, SiLU-gated
 * MLP, residual, the next layer's RMSNorm, QKV projection and RoPE.  The projections are
 * linear_amx.c's kernels (AMX tiles) or linear_dot.c's (vdpbf16ps, on CPUs without AMX) on
 * oneDNN's packed weights; the element-wise work is written here.
 *
 * Why: through torch.compile the same work cost ~0.35 ms a layer more than its projections
 * alone, whatever the row count (guards, the compiled region's wrappers, the custom ops'
 * dispatch and Python, inductor's kernels): ~10 ms of a 128-row decode step of the embedded
 * model, and most of a small batch's step; a prefill step also spared inductor's element-wise
 * kernels and a separate SiLU pass (docs/decisions/native-layers.md).
 *
 * The element-wise arithmetic is inductor's, operation for operation, so that the values are
 * those of the compiled layers (models/native_layers.py stands in for them, and the tests
 * compare the two bit for bit): float32 throughout, no rounding to bfloat16 between fused
 * operations, sums of squares in two 16-lane accumulators over 32-value chunks folded as
 * ATen's vec_reduce_all folds them, and neither contraction into FMAs nor reassociation
 * (inductor compiles with -ffp-contract=off; the library's other files allow both).
 *
 * Layouts (bf16, contiguous rows): hidden [mp, H]; attn [m, Hq * D]; cos, sin [mp, D / 2];
 * q [mp, Hq, D]; k [mp, Hkv, D]; qkv [mp, (Hq + 2 Hkv) D] (v stays in it, at (Hq + Hkv) D).
 * H and D / 2 multiples of 16 (H of 32), mp of 16.
 */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention/attention.h"
#include "common/kinds.h"
#include "layer/layer.h"
#include "linear/linear.h"

#if (KVSERVE_LINEAR_AMX || KVSERVE_LINEAR_DOT) && defined(__linux__)
#define DECODE_LAYER_BUILT 1
#include <immintrin.h>
#include <omp.h>

static inline __m512 widen(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 32 float32 values rounded to bf16 (nearest even, as torch) and stored. */
static inline void store32(uint16_t *p, __m512 lo, __m512 hi) {
    _mm512_storeu_si512((void *)p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* 16 float32 values rounded to bf16 and stored. */
static inline void store16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* ATen's vec_reduce_all for 16 float lanes: halves, quarters, pairs, neighbours. */
static inline float reduce16(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}

/* The row's value (float32) at 16 columns from c: x, or x + a, or (x + a) + b (NULL: absent). */
static inline __m512 sum_at(const uint16_t *x, const uint16_t *a, const uint16_t *b, int64_t c) {
    __m512 v = widen(x + c);
    if (a) v = _mm512_add_ps(v, widen(a + c));
    if (b) v = _mm512_add_ps(v, widen(b + c));
    return v;
}

/* normed = bf16(w x (v x 1 / sqrt(mean(v^2) + eps))) for v = sum_at(x, a, b) over a row of n:
 * RMSNorm of the unrounded residual sum, as inductor fuses it.  When `store` is not NULL the
 * rounded sum is stored there first and the norm is taken of that stored row. */
static void rms_norm_row(const uint16_t *x, const uint16_t *a, const uint16_t *b, uint16_t *store,
                         const uint16_t *w, uint16_t *normed, int64_t n, float eps) {
    if (store) {
        for (int64_t c = 0; c < n; c += 32)
            store32(store + c, sum_at(x, a, b, c), sum_at(x, a, b, c + 16));
        x = store, a = b = NULL;
    }
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 32) {
        const __m512 v0 = sum_at(x, a, b, c), v1 = sum_at(x, a, b, c + 16);
        acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(v0, v0));
        acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(v1, v1));
    }
    const float mean = reduce16(_mm512_add_ps(acc0, acc1)) / (float)n;
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    for (int64_t c = 0; c < n; c += 16)
        store16(normed + c, _mm512_mul_ps(widen(w + c), _mm512_mul_ps(sum_at(x, a, b, c), scale)));
}

/* The `heads` heads of one row at src (head_dim values each) rotated into dst:
 * (x1 c - x2 s, x2 c + x1 s) by halves. */
static void rotate_row(const uint16_t *src, uint16_t *dst, const uint16_t *cos,
                       const uint16_t *sin, int heads, int dim) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < half; c += 16) {
            const __m512 x1 = widen(src + h * dim + c), x2 = widen(src + h * dim + half + c);
            const __m512 co = widen(cos + c), si = widen(sin + c);
            store16(dst + h * dim + c, _mm512_sub_ps(_mm512_mul_ps(x1, co), _mm512_mul_ps(x2, si)));
            store16(dst + h * dim + half + c,
                    _mm512_add_ps(_mm512_mul_ps(x2, co), _mm512_mul_ps(x1, si)));
        }
}

/* Scratch bytes a call needs for mp rows of this layer's shape. */
int64_t decode_layer_work_bytes(const decode_layer *l, int64_t mp) {
    const int64_t q_size = (int64_t)l->num_heads * l->head_dim;
    return 2 * mp * (q_size + 3 * l->hidden + l->intermediate);
}

/* normed -> qkv projection -> q, k rotated (v stays in qkv). */
static int project_qkv(const decode_layer *l, const uint16_t *normed, int64_t mp,
                       const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *k,
                       uint16_t *qkv, int threads) {
    const int dim = l->head_dim, hq = l->num_heads, hkv = l->num_kv_heads;
    const int64_t width = (int64_t)(hq + 2 * hkv) * dim;
    if (linear_bf16_packed(normed, l->hidden, l->qkv, l->qkv_bias, qkv, width, mp, width,
                           l->hidden, threads))
        return 1;
    #pragma omp parallel for num_threads(threads)
    for (int64_t r = 0; r < mp; r++) {
        const uint16_t *row = qkv + r * width, *c = cos + r * (dim / 2), *s = sin + r * (dim / 2);
        rotate_row(row, q + r * hq * dim, c, s, hq, dim);
        rotate_row(row + hq * dim, k + r * hkv * dim, c, s, hkv, dim);
    }
    return 0;
}

/* RMSNorm, QKV projection and RoPE of the first layer (its input is the embeddings). */
int decode_pre_attention(const decode_layer *l, const uint16_t *hidden, int64_t mp,
                         const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *k,
                         uint16_t *qkv, void *work, int threads) {
    uint16_t *normed = work;
    #pragma omp parallel for num_threads(threads)
    for (int64_t r = 0; r < mp; r++)
        rms_norm_row(hidden + r * l->hidden, NULL, NULL, NULL, l->input_norm,
                     normed + r * l->hidden, l->hidden, l->eps);
    return project_qkv(l, normed, mp, cos, sin, q, k, qkv, threads);
}

/* Output projection, residual, RMSNorm, MLP; hidden <- bf16((hidden + o) + down), and with a
 * next layer its RMSNorm of the new hidden into `normed`.  attn's m rows are padded with zero
 * rows to mp (the padding rows' values are never read by the caller). */
static int mlp_block(const decode_layer *l, const decode_layer *next, uint16_t *hidden,
                     const uint16_t *attn, int64_t m, int64_t mp, void *work, uint16_t **normed_out,
                     int threads) {
    const int64_t q_size = (int64_t)l->num_heads * l->head_dim, h = l->hidden;
    uint16_t *padded = work, *o = padded + mp * q_size, *normed = o + mp * h;
    uint16_t *down = normed + mp * h, *act = down + mp * h;
    memcpy(padded, attn, (size_t)(m * q_size * 2));
    memset(padded + m * q_size, 0, (size_t)((mp - m) * q_size * 2));
    if (linear_bf16_packed(padded, q_size, l->o, NULL, o, h, mp, h, q_size, threads)) return 1;
    #pragma omp parallel for num_threads(threads)
    for (int64_t r = 0; r < mp; r++)
        rms_norm_row(hidden + r * h, o + r * h, NULL, NULL, l->post_norm, normed + r * h, h, l->eps);
    if (silu_gate_up_bf16_packed(normed, h, l->gate_up, act, l->intermediate, mp,
                                 l->intermediate, h, threads)
        || linear_bf16_packed(act, l->intermediate, l->down, NULL, down, h, mp, h,
                              l->intermediate, threads))
        return 1;
    #pragma omp parallel for num_threads(threads)
    for (int64_t r = 0; r < mp; r++) {
        if (next)
            rms_norm_row(hidden + r * h, o + r * h, down + r * h, hidden + r * h, next->input_norm,
                         normed + r * h, h, next->eps);
        else
            for (int64_t c = 0; c < h; c += 32)
                store32(hidden + r * h + c, sum_at(hidden + r * h, o + r * h, down + r * h, c),
                        sum_at(hidden + r * h, o + r * h, down + r * h, c + 16));
    }
    *normed_out = normed;
    return 0;
}

/* One layer's post-attention work and the next one's pre-attention work. */
int decode_between_attentions(const decode_layer *l, const decode_layer *next, uint16_t *hidden,
                              const uint16_t *attn, int64_t m, int64_t mp, const uint16_t *cos,
                              const uint16_t *sin, uint16_t *q, uint16_t *k, uint16_t *qkv,
                              void *work, int threads) {
    uint16_t *normed;
    if (mlp_block(l, next, hidden, attn, m, mp, work, &normed, threads)) return 1;
    return project_qkv(next, normed, mp, cos, sin, q, k, qkv, threads);
}

/* The last layer's post-attention work: hidden updated in place. */
int decode_post_attention(const decode_layer *l, uint16_t *hidden, const uint16_t *attn,
                          int64_t m, int64_t mp, void *work, int threads) {
    uint16_t *normed;
    return mlp_block(l, NULL, hidden, attn, m, mp, work, &normed, threads);
}

/* A decode step's layers in one call: the pre-attention work of the first layer, then per
 * layer the paged attention of the step's m tokens (paged_decode.c, which stores each token's
 * new K/V row in its slot before attending it) and the work between it and the next layer's
 * attention, or the last layer's post-attention work.  The same kernels in the same order
 * as the per-layer calls of models/native_layers.py, so the same values bit for bit; what it
 * spares is the Python between them, ~0.3 ms a layer (~8 of a 32-row step's ~45 ms).
 * caches[4 i .. 4 i + 3]: layer i's key and value cache ([blocks, block_size, Hkv, D], `kind`
 * storage) and their scales ([blocks, block_size, Hkv] float32; NULL for unscaled storage).
 * An 8-bit cache (KV_I8, KV_E4M3, KV_E5M2) gets the step's new rows quantized and stored by
 * kv_quantize.c's kv_quantize_store (the per-layer path's own store, so the same codes) before
 * its attention; a bf16 cache has the decode kernel store them.  attn [m, Hq * D] bf16.
 * A shared prefix (prefix_blocks > 0, every sequence's first blocks, listed in prefix_table):
 * attended once for all m queries (prefill_bf16.c, into prior_out [m, Hq, D] and prior_lse
 * [m, Hq] float32), then each sequence over its own blocks past it (block_tables rows from
 * their prefix_blocks-th entry, seq_lens counting the tokens past the prefix), merged by the
 * log-sum-exps in the decode kernel: attention/cpu_paged.py's split at the shared prefix
 * (bf16 caches only: the prefix kernel reads bf16 rows).
 * Returns 0, or 1 where a projection declined its shapes or an attention ran out of memory
 * (nothing of the step is usable). */
int decode_step_layers(const decode_step_args *args) {
    /* The arguments under the names (and types) they had as parameters. */
    const decode_layer *layers = args->layers;
    void *const *caches = args->caches;
    int num_layers = args->num_layers;
    uint16_t *hidden = args->hidden;
    int64_t m = args->m, mp = args->mp;
    const uint16_t *cos = args->cos, *sin = args->sin;
    uint16_t *q = args->q, *k = args->k, *qkv = args->qkv, *attn = args->attn;
    void *work = args->work;
    int kind = args->kind;
    const int64_t *block_tables = args->block_tables, *seq_lens = args->seq_lens;
    const int64_t *slots = args->slots;
    int max_blocks = args->max_blocks, block_size = args->block_size;
    float sm_scale = args->sm_scale;
    const int64_t *prefix_table = args->prefix_table;
    int prefix_blocks = args->prefix_blocks;
    float *prior_out = args->prior_out, *prior_lse = args->prior_lse;
    int threads = args->threads;
    const decode_layer *l = layers;
    const int64_t kv_row_bytes = (int64_t)l->num_kv_heads * l->head_dim * 2;
    const int64_t qkv_row_bytes = ((int64_t)l->num_heads + 2 * l->num_kv_heads) * l->head_dim * 2;
    const uint16_t *v = qkv + ((int64_t)l->num_heads + l->num_kv_heads) * l->head_dim;
    if (decode_pre_attention(l, hidden, mp, cos, sin, q, k, qkv, work, threads)) return 1;
    const int64_t q_row = (int64_t)l->num_heads * l->head_dim;
    const int shared = prefix_blocks > 0;
    const int quantized = kind == KV_I8 || kind == KV_E4M3 || kind == KV_E5M2;
    const int64_t kv_row = (int64_t)l->num_kv_heads * l->head_dim;
    for (int i = 0; i < num_layers; i++) {
        l = layers + i;
        void *key = caches[4 * i], *value = caches[4 * i + 1];
        float *key_scale = caches[4 * i + 2], *value_scale = caches[4 * i + 3];
        if (quantized) { /* bf16 rows: k [m, Hkv, D]; v inside qkv's rows */
            kv_quantize_store(k, KV_BF16, kv_row, key, key_scale, slots, (int)m, l->num_kv_heads,
                              l->head_dim, kind, NULL, threads);
            kv_quantize_store(v, KV_BF16, qkv_row_bytes / 2, value, value_scale, slots, (int)m,
                              l->num_kv_heads, l->head_dim, kind, NULL, threads);
        }
        if (shared) { /* the shared prefix, attended once for all m queries */
            const prefill_attention_args prefix = {
                .q = q, .q_stride = q_row, .q_batch = m * q_row,
                .k = key, .k_stride = kv_row_bytes / 2, .k_batch = 0,
                .v = value, .v_stride = kv_row_bytes / 2, .v_batch = 0,
                .num_seqs = 1, .num_query = m, .num_keys = (int64_t)prefix_blocks * block_size,
                .num_heads = l->num_heads, .num_kv_heads = l->num_kv_heads, .dim = l->head_dim,
                .scale = sm_scale, .causal = 0, .out_bf16 = NULL, .out_f32 = prior_out,
                .lse = prior_lse, .engine = 0, .num_threads = threads, .kv_table = prefix_table,
                .table_stride = prefix_blocks, .kv_block_size = block_size,
            };
            if (prefill_attention_bf16(&prefix)) return 1;
        }
        const paged_decode_args decode = {
            .query = q, .out = attn, .key = key, .value = value,
            .key_scale = key_scale, .value_scale = value_scale, .lut = NULL, .kind = kind,
            .value_kind = kind,
            .block_tables = block_tables + prefix_blocks, .seq_lens = seq_lens,
            .num_seqs = (int)m, .max_blocks = max_blocks, .num_kv_heads = l->num_kv_heads,
            .group = l->num_heads / l->num_kv_heads, .dim = l->head_dim,
            .block_size = block_size, .sm_scale = sm_scale, .num_threads = threads, .lse = NULL,
            .io_bf16 = 1, .new_key = quantized ? NULL : k, .new_value = quantized ? NULL : v,
            .new_key_stride_bytes = kv_row_bytes, .new_value_stride_bytes = qkv_row_bytes,
            .new_slots = quantized ? NULL : slots, .prior_out = shared ? prior_out : NULL,
            .prior_lse = shared ? prior_lse : NULL,
        };
        if (paged_decode_attention(&decode)) return 1;
        int failed = i + 1 < num_layers
                         ? decode_between_attentions(l, l + 1, hidden, attn, m, mp, cos, sin, q,
                                                     k, qkv, work, threads)
                         : decode_post_attention(l, hidden, attn, m, mp, work, threads);
        if (failed) return 1;
    }
    return 0;
}
#else
/* Neither projection kernel in this build: models/native_layers.py never calls these
 * (decode_layer_available). */
int64_t decode_layer_work_bytes(const decode_layer *l, int64_t mp) { (void)l, (void)mp; return -1; }
#endif

/* 1 where this build has the functions above. */
int decode_layer_available(void) {
#if DECODE_LAYER_BUILT
    return 1;
#else
    return 0;
#endif
}
