/*
 * The layout of the argument structures that native/ops.py mirrors with ctypes
 * (native/structs.py): each one's size, and each field's name and offset, so that ops.py can
 * refuse a library whose structures differ from its own (a field added, dropped, retyped or
 * moved on one side only) before any call reads one.  `which` follows structs.py's
 * STRUCTURES order; the fields are listed in the structures' order.
 */
#include <stddef.h>
#include <stdint.h>

#include "attention/attention.h"
#include "layer/layer.h"

typedef struct {
    const char *name;
    int64_t offset;
} field;

#define FIELD(type, name) {#name, (int64_t)offsetof(type, name)}
#define PD(name) FIELD(paged_decode_args, name)
static const field PAGED_DECODE[] = {
    PD(query), PD(out), PD(key), PD(value), PD(key_scale), PD(value_scale), PD(lut),
    PD(block_tables), PD(seq_lens), PD(lse), PD(new_key), PD(new_value),
    PD(new_key_stride_bytes), PD(new_value_stride_bytes), PD(new_slots), PD(prior_out),
    PD(prior_lse), PD(kind), PD(num_seqs), PD(max_blocks), PD(num_kv_heads), PD(group), PD(dim),
    PD(block_size), PD(sm_scale), PD(num_threads), PD(io_bf16), PD(sliding_window), PD(value_kind), PD(key_sink),
    {NULL, 0},
};
#define PF(name) FIELD(prefill_attention_args, name)
static const field PREFILL[] = {
    PF(q), PF(k), PF(v), PF(q_stride), PF(q_batch), PF(k_stride), PF(k_batch), PF(v_stride),
    PF(v_batch), PF(num_seqs), PF(num_query), PF(num_keys), PF(num_heads), PF(num_kv_heads),
    PF(dim), PF(causal), PF(scale), PF(out_bf16), PF(out_f32), PF(lse), PF(engine),
    PF(num_threads), PF(kv_table), PF(table_stride), PF(kv_block_size), {NULL, 0},
};
#define DL(name) FIELD(decode_layer, name)
static const field LAYER[] = {
    DL(input_norm), DL(qkv), DL(qkv_bias), DL(o), DL(post_norm), DL(gate_up), DL(down),
    DL(hidden), DL(intermediate), DL(num_heads), DL(num_kv_heads), DL(head_dim), DL(eps),
    {NULL, 0},
};
#define DS(name) FIELD(decode_step_args, name)
static const field STEP[] = {
    DS(layers), DS(caches), DS(hidden), DS(cos), DS(sin), DS(q), DS(k), DS(qkv), DS(attn),
    DS(work), DS(block_tables), DS(seq_lens), DS(slots), DS(prefix_table), DS(prior_out),
    DS(prior_lse), DS(m), DS(mp), DS(num_layers), DS(kind), DS(max_blocks), DS(block_size),
    DS(prefix_blocks), DS(sm_scale), DS(threads), {NULL, 0},
};
#define QL(name) FIELD(q8_layer, name)
static const field Q8_LAYER[] = {
    QL(input_norm), QL(post_norm), QL(qkv_bias), QL(qkv), QL(o), QL(gate_up), QL(down),
    QL(qkv_scales), QL(o_scales), QL(gate_up_scales), QL(down_scales), QL(qkv_mins),
    QL(o_mins), QL(gate_up_mins), QL(down_mins), QL(hidden), QL(intermediate), QL(num_heads),
    QL(num_kv_heads), QL(head_dim), QL(weight_bits), QL(eps), {NULL, 0},
};
#define QS(name) FIELD(q8_step_args, name)
static const field Q8_STEP[] = {
    QS(layers), QS(caches), QS(hidden), QS(cos), QS(sin), QS(work), QS(lut), QS(block_tables),
    QS(seq_lens), QS(slots), QS(m), QS(num_layers), QS(kind), QS(max_blocks), QS(block_size),
    QS(sm_scale), QS(threads), {NULL, 0},
};
static const field *const FIELDS[] = {PAGED_DECODE, PREFILL, LAYER, STEP, Q8_LAYER, Q8_STEP};
static const int64_t SIZES[] = {sizeof(paged_decode_args), sizeof(prefill_attention_args),
                                sizeof(decode_layer), sizeof(decode_step_args),
                                sizeof(q8_layer), sizeof(q8_step_args)};
#define COUNT ((int)(sizeof SIZES / sizeof SIZES[0]))

/* The size of structure `which`, or -1 past the last. */
int64_t native_struct_size(int which) { return which >= 0 && which < COUNT ? SIZES[which] : -1; }

/* Field i of structure `which`: its name, its offset in *offset; NULL past the last. */
const char *native_struct_field(int which, int i, int64_t *offset) {
    if (which < 0 || which >= COUNT || i < 0) return NULL;
    for (int j = 0; j <= i; j++)
        if (!FIELDS[which][j].name) return NULL;
    *offset = FIELDS[which][i].offset;
    return FIELDS[which][i].name;
}
