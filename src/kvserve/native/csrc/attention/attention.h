/*
 * The attention kind's entry points: what native/ops.py declares (its ctypes structures mirror
 * the two argument structures below field for field; runtime/abi.c reports their sizes, which
 * ops.py checks at load) and what layer/decode_layer.c calls.  Each defining file includes
 * this too, so the compiler checks that the definition and the callers agree.
 */
#ifndef KVSERVE_ATTENTION_H
#define KVSERVE_ATTENTION_H
#include <stdint.h>

/* paged_decode_attention's arguments (paged_decode.c: layouts and what each part does). */
typedef struct {
    const void *query;       /* [num_seqs, num_kv_heads * group, dim]: float32, bf16 if io_bf16 */
    void *out;               /* as query */
    void *key, *value;       /* [blocks, block_size, num_kv_heads, dim] in the `kind` and
                              * `value_kind` storages (dim / 2 bytes a row for KV_I4) */
    const float *key_scale, *value_scale; /* [blocks, block_size, num_kv_heads] or NULL */
    const float *lut;        /* the fp8 kinds' 256 values (byte -> float32), else NULL */
    const int64_t *block_tables; /* [num_seqs, max_blocks] */
    const int64_t *seq_lens;     /* [num_seqs]: keys to attend */
    float *lse;              /* [num_seqs, heads] or NULL */
    const void *new_key, *new_value; /* NULL, or this step's rows, stored before attention */
    int64_t new_key_stride_bytes, new_value_stride_bytes;
    const int64_t *new_slots;        /* [num_seqs] */
    const float *prior_out, *prior_lse; /* NULL, or attention over other keys, merged in */
    int kind, num_seqs, max_blocks, num_kv_heads, group, dim, block_size;
    float sm_scale;
    int num_threads, io_bf16;
    int sliding_window;      /* 0, or W: each sequence attends its last W keys alone */
    int value_kind;          /* the values' storage: `kind` but for k8v4 (int8 K, int4 V) */
    const float *key_sink;   /* [num_kv_heads, dim] or NULL: a KV_I4 key row with a negative
                              * scale holds key - key_sink (kv_quantize.c), read back as
                              * codes x |scale| + key_sink */
} paged_decode_args;

int paged_decode_attention(const paged_decode_args *args);

/* Switch the decode's AMX scores (tests, benchmarks); returns whether they were on. */
int paged_decode_use_amx(int on);

/* prefill_attention_bf16's arguments (prefill_bf16.c: layouts, engines). */
typedef struct {
    const uint16_t *q, *k, *v;
    int64_t q_stride, q_batch, k_stride, k_batch, v_stride, v_batch;
    int64_t num_seqs, num_query, num_keys;
    int num_heads, num_kv_heads, dim, causal;
    float scale;
    uint16_t *out_bf16; /* one of the two outputs */
    float *out_f32, *lse;
    int engine, num_threads;
    const int64_t *kv_table; /* NULL, or block tables of a paged cache (k and v) */
    int64_t table_stride, kv_block_size;
} prefill_attention_args;

int prefill_attention_bf16(const prefill_attention_args *args);

int kv_quantize_store(const void *x, int src_kind, int64_t token_stride, void *cache,
                      float *scales, const int64_t *slots, int num_tokens, int heads, int dim,
                      int out_kind, const float *sink, int num_threads);

int kv_copy_store(const void *x, int64_t token_stride_bytes, void *cache, const int64_t *slots,
                  int num_tokens, int64_t row_bytes, int num_threads);
#endif
