/*
 * A float32 decode step over 8-bit weights in one call: every layer's RMSNorm, QKV projection,
 * RoPE, paged attention (storing the step's new K/V rows first), output projection, residual,
 * RMSNorm, SiLU-gated MLP and residual, for steps of a few rows.  The float32 counterpart of
 * decode_layer.c's decode_step_layers, for CPUs without AVX512-BF16 (the AMD EPYC this was
 * written on: AVX2, so `--dtype auto` is float32 there).
 *
 * Why: a one-row decode step of the embedded model through the compiled layers made 121
 * projection calls and 30 attention calls from Python, each ~20-40 us above its kernel
 * (torch.library dispatch, argument checks, the compiled graphs' wrappers and inductor's
 * element-wise kernels between them): about half of a ~24 ms step whose weights take ~8 ms to
 * read (docs/decisions/q8-decode-step.md).  Here that work is a few loops over a few rows.
 *
 * The projections are linear_q8.c's over 8-bit weights (float32 activations: the reference's
 * values up to the order of sums) or linear_q4.c's over 4-bit ones (activations rounded to
 * 8-bit blocks, as its per-layer calls round them).  The element-wise arithmetic is the eager
 * layers' in float32 (models/llama.py: RMSNorm as x * rsqrt(mean(x^2) + eps) times the
 * weight, RoPE by halves, silu(g) * u), in this file's own order of sums: the values agree with the per-layer path to
 * float32 rounding, not bit for bit (tests/model/test_q8_decode_step.py).
 *
 * Layouts (float32, contiguous rows): hidden [m, H]; cos, sin [m, D / 2]; the work buffer
 * (q8_step_work_floats) holds normed [m, H], qkv [m, (Hq + 2 Hkv) D], q [m, Hq, D],
 * k [m, Hkv, D], attn [m, Hq D], o [m, H], gate_up [m, 2 I], act [m, I] and down [m, H].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention/attention.h"
#include "common/kinds.h"
#include "layer/layer.h"
#include "linear/linear.h"

/* out [m, n] = x [m, k] W^T (+ bias) over one of layer l's weights. */
static int project(const q8_step_args *a, const q8_layer *l, const float *x, int64_t k,
                   const void *codes, const float *scales, const float *mins, const float *bias,
                   float *out, int64_t n) {
    if (l->weight_bits == 4)
        return linear_q4_f32(x, k, codes, scales, mins, bias, out, n, a->m, n, k, a->threads);
    return linear_q8_f32(x, k, codes, scales, bias, out, n, a->m, n, k, a->threads);
}

/* normed = weight x (x / sqrt(mean(x^2) + eps)) for one row of n. */
static void rms_norm_row(const float *x, const float *weight, float *normed, int64_t n,
                         float eps) {
    float squares = 0.0f;
    for (int64_t c = 0; c < n; c++) squares += x[c] * x[c];
    const float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t c = 0; c < n; c++) normed[c] = weight[c] * (x[c] * scale);
}

/* `heads` heads of head_dim values at src rotated into dst: (x1 c - x2 s, x2 c + x1 s). */
static void rotate_heads(const float *src, float *dst, const float *cos, const float *sin,
                         int heads, int dim) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        const float *x = src + (int64_t)h * dim;
        float *y = dst + (int64_t)h * dim;
        for (int c = 0; c < half; c++) {
            y[c] = x[c] * cos[c] - x[half + c] * sin[c];
            y[half + c] = x[half + c] * cos[c] + x[c] * sin[c];
        }
    }
}

/* Where each buffer of the work area lies, for m rows of layer l's shape. */
typedef struct {
    float *normed, *qkv, *q, *k, *attn, *o, *gate_up, *act, *down;
} step_buffers;

static step_buffers buffers_of(const q8_layer *l, int64_t m, float *work) {
    const int64_t q_size = (int64_t)l->num_heads * l->head_dim;
    const int64_t kv_size = (int64_t)l->num_kv_heads * l->head_dim;
    step_buffers b;
    b.normed = work;
    b.qkv = b.normed + m * l->hidden;
    b.q = b.qkv + m * (q_size + 2 * kv_size);
    b.k = b.q + m * q_size;
    b.attn = b.k + m * kv_size;
    b.o = b.attn + m * q_size;
    b.gate_up = b.o + m * l->hidden;
    b.act = b.gate_up + m * 2 * l->intermediate;
    b.down = b.act + m * l->intermediate;
    return b;
}

int64_t q8_step_work_floats(const q8_layer *l, int64_t m) {
    const int64_t q_size = (int64_t)l->num_heads * l->head_dim;
    const int64_t kv_size = (int64_t)l->num_kv_heads * l->head_dim;
    return 3 * m * (l->hidden + q_size + kv_size + l->intermediate);
}

/* RMSNorm of hidden, QKV projection, RoPE of q and k (v stays in qkv). */
static int pre_attention(const q8_step_args *a, const q8_layer *l, const step_buffers *b) {
    const int dim = l->head_dim, hq = l->num_heads, hkv = l->num_kv_heads;
    const int64_t width = (int64_t)(hq + 2 * hkv) * dim;
    for (int64_t r = 0; r < a->m; r++)
        rms_norm_row(a->hidden + r * l->hidden, l->input_norm, b->normed + r * l->hidden,
                     l->hidden, l->eps);
    if (project(a, l, b->normed, l->hidden, l->qkv, l->qkv_scales, l->qkv_mins, l->qkv_bias,
                b->qkv, width))
        return 1;
    for (int64_t r = 0; r < a->m; r++) {
        const float *row = b->qkv + r * width;
        const float *c = a->cos + r * (dim / 2), *s = a->sin + r * (dim / 2);
        rotate_heads(row, b->q + r * hq * dim, c, s, hq, dim);
        rotate_heads(row + (int64_t)hq * dim, b->k + r * hkv * dim, c, s, hkv, dim);
    }
    return 0;
}

/* Layer `i`'s attention of the step's m tokens over its cache, into b->attn: the new rows
 * stored first (quantized by kv_quantize.c for 8-bit caches, by the decode kernel else). */
static int attend(const q8_step_args *a, const q8_layer *l, int i, const step_buffers *b) {
    void *key = a->caches[4 * i], *value = a->caches[4 * i + 1];
    float *key_scale = a->caches[4 * i + 2], *value_scale = a->caches[4 * i + 3];
    const int64_t kv_row = (int64_t)l->num_kv_heads * l->head_dim;
    const int64_t qkv_row = ((int64_t)l->num_heads + 2 * l->num_kv_heads) * l->head_dim;
    const float *v = b->qkv + ((int64_t)l->num_heads + l->num_kv_heads) * l->head_dim;
    const int quantized = a->kind == KV_I8 || a->kind == KV_E4M3 || a->kind == KV_E5M2;
    if (quantized) {
        kv_quantize_store(b->k, KV_F32, kv_row, key, key_scale, a->slots, (int)a->m,
                          l->num_kv_heads, l->head_dim, a->kind, NULL, a->threads);
        kv_quantize_store(v, KV_F32, qkv_row, value, value_scale, a->slots, (int)a->m,
                          l->num_kv_heads, l->head_dim, a->kind, NULL, a->threads);
    }
    const paged_decode_args decode = {
        .query = b->q, .out = b->attn, .key = key, .value = value, .key_scale = key_scale,
        .value_scale = value_scale, .lut = a->lut, .kind = a->kind, .value_kind = a->kind,
        .block_tables = a->block_tables, .seq_lens = a->seq_lens, .num_seqs = (int)a->m,
        .max_blocks = a->max_blocks, .num_kv_heads = l->num_kv_heads,
        .group = l->num_heads / l->num_kv_heads, .dim = l->head_dim,
        .block_size = a->block_size, .sm_scale = a->sm_scale, .num_threads = a->threads,
        .lse = NULL, .io_bf16 = 0, .new_key = quantized ? NULL : b->k,
        .new_value = quantized ? NULL : v, .new_key_stride_bytes = kv_row * 4,
        .new_value_stride_bytes = qkv_row * 4, .new_slots = quantized ? NULL : a->slots,
        .prior_out = NULL, .prior_lse = NULL,
    };
    return paged_decode_attention(&decode);
}

/* Output projection, residual, RMSNorm, SiLU-gated MLP, residual: hidden updated. */
static int post_attention(const q8_step_args *a, const q8_layer *l, const step_buffers *b) {
    const int64_t h = l->hidden, inter = l->intermediate;
    const int64_t q_size = (int64_t)l->num_heads * l->head_dim;
    if (project(a, l, b->attn, q_size, l->o, l->o_scales, l->o_mins, NULL, b->o, h)) return 1;
    for (int64_t r = 0; r < a->m; r++) {
        float *x = a->hidden + r * h;
        for (int64_t c = 0; c < h; c++) x[c] += b->o[r * h + c];
        rms_norm_row(x, l->post_norm, b->normed + r * h, h, l->eps);
    }
    if (project(a, l, b->normed, h, l->gate_up, l->gate_up_scales, l->gate_up_mins, NULL,
                b->gate_up, 2 * inter))
        return 1;
    for (int64_t r = 0; r < a->m; r++) {
        const float *gate = b->gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c++)
            b->act[r * inter + c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
    }
    if (project(a, l, b->act, inter, l->down, l->down_scales, l->down_mins, NULL, b->down, h))
        return 1;
    for (int64_t i = 0; i < a->m * h; i++) a->hidden[i] += b->down[i];
    return 0;
}

/* Every layer of the step; hidden [m, H] holds the embeddings in and the last layer's output
 * (before the final norm) out.  Returns 0, or 1 where a projection declined its shapes or an
 * attention ran out of memory (nothing of the step is usable). */
int decode_step_q8(const q8_step_args *a) {
    if (a->m < 1 || a->num_layers < 1) return 1;
    const step_buffers b = buffers_of(a->layers, a->m, a->work);
    for (int i = 0; i < a->num_layers; i++) {
        const q8_layer *l = a->layers + i;
        if (pre_attention(a, l, &b) || attend(a, l, i, &b) || post_attention(a, l, &b)) return 1;
    }
    return 0;
}
