/*
 * The layer kind's entry points (decode_layer.c, decode_step_q8.c): what native/ops.py declares, its ctypes
 * structures mirroring the two structures below field for field (runtime/abi.c reports their
 * sizes, which ops.py checks at load).
 */
#ifndef KVSERVE_LAYER_H
#define KVSERVE_LAYER_H
#include <stdint.h>

/* One layer's weights (packed ones are oneDNN's layout, see linear/linear_amx.c) and shape. */
typedef struct {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *post_norm, *gate_up, *down;
    int64_t hidden, intermediate;
    int32_t num_heads, num_kv_heads, head_dim;
    float eps;
} decode_layer;

/* decode_step_layers' arguments: the layers and their buffers, then the step's attention
 * (attention/base.py's DecodeStepPlan; decode_layer.c says what each part does). */
typedef struct {
    const decode_layer *layers; /* [num_layers], of one shape */
    void *const *caches;        /* [4 * num_layers]: each layer's key, value, their scales */
    uint16_t *hidden;
    const uint16_t *cos, *sin;
    uint16_t *q, *k, *qkv, *attn;
    void *work;
    const int64_t *block_tables, *seq_lens, *slots;
    const int64_t *prefix_table; /* with prefix_blocks > 0 */
    float *prior_out, *prior_lse;
    int64_t m, mp;
    int num_layers, kind, max_blocks, block_size, prefix_blocks;
    float sm_scale;
    int threads;
} decode_step_args;

/* One layer of a float32 model over 8-bit weights (linear_q8.c's int8 codes and scales) or
 * 4-bit ones (linear_q4.c's nibbles, scales and mins), as weight_bits says. */
typedef struct {
    const float *input_norm, *post_norm, *qkv_bias; /* qkv_bias: NULL where none */
    const void *qkv, *o, *gate_up, *down;           /* the codes */
    const float *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const float *qkv_mins, *o_mins, *gate_up_mins, *down_mins; /* 4-bit weights, else NULL */
    int64_t hidden, intermediate;
    int32_t num_heads, num_kv_heads, head_dim, weight_bits;
    float eps;
} q8_layer;

/* decode_step_q8's arguments (decode_step_q8.c says what each part does). */
typedef struct {
    const q8_layer *layers;     /* [num_layers], of one shape */
    void *const *caches;        /* [4 * num_layers]: each layer's key, value, their scales */
    float *hidden;              /* [m, hidden] */
    const float *cos, *sin;     /* [m, head_dim / 2] */
    float *work;                /* q8_step_work_floats(layers, m) floats */
    const float *lut;           /* an fp8 cache's 256 values (byte -> float32), else NULL */
    const int64_t *block_tables, *seq_lens, *slots;
    int64_t m;
    int num_layers, kind, max_blocks, block_size;
    float sm_scale;
    int threads;
} q8_step_args;

int64_t q8_step_work_floats(const q8_layer *l, int64_t m);
int decode_step_q8(const q8_step_args *args);

int decode_layer_available(void);
int64_t decode_layer_work_bytes(const decode_layer *l, int64_t mp);
int decode_pre_attention(const decode_layer *l, const uint16_t *hidden, int64_t mp,
                         const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *k,
                         uint16_t *qkv, void *work, int threads);
int decode_between_attentions(const decode_layer *l, const decode_layer *next, uint16_t *hidden,
                              const uint16_t *attn, int64_t m, int64_t mp, const uint16_t *cos,
                              const uint16_t *sin, uint16_t *q, uint16_t *k, uint16_t *qkv,
                              void *work, int threads);
int decode_post_attention(const decode_layer *l, uint16_t *hidden, const uint16_t *attn,
                          int64_t m, int64_t mp, void *work, int threads);
int decode_step_layers(const decode_step_args *args);
#endif
