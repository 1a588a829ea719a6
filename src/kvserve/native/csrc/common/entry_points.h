/*
 * Entry points that one kernel file calls in another (decode_layer.c's one-call decode step
 * calls the paged decode and prefill attentions and the 8-bit store).  Each defining file includes this too, so
 * the compiler checks that the definition and the callers agree.
 */
#ifndef KVSERVE_ENTRY_POINTS_H
#define KVSERVE_ENTRY_POINTS_H
#include <stdint.h>

int paged_decode_attention(const void *query, void *out, void *key, void *value,
                           const float *key_scale, const float *value_scale, const float *lut,
                           int kind, const int64_t *block_tables, const int64_t *seq_lens,
                           int num_seqs, int max_blocks, int num_kv_heads, int group, int dim,
                           int block_size, float sm_scale, int num_threads, float *lse,
                           int io_bf16, const void *new_key, const void *new_value,
                           int64_t new_key_stride_bytes, int64_t new_value_stride_bytes,
                           const int64_t *new_slots, const float *prior_out,
                           const float *prior_lse);

int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, int64_t q_batch,
                           const uint16_t *k, int64_t k_stride, int64_t k_batch,
                           const uint16_t *v, int64_t v_stride, int64_t v_batch, int64_t num_seqs,
                           int64_t num_query, int64_t num_keys, int num_heads, int num_kv_heads,
                           int dim, float scale, int causal, uint16_t *out_bf16, float *out_f32,
                           float *lse, int engine, int num_threads, const int64_t *kv_table,
                           int64_t table_stride, int64_t kv_block_size);

int kv_quantize_store(const void *x, int src_kind, int64_t token_stride, void *cache,
                      float *scales, const int64_t *slots, int num_tokens, int heads, int dim,
                      int out_kind, int num_threads);
/* Which file's bf16 projections over oneDNN's packed weights this build has: linear_amx.c's
 * on AMX tiles, or linear_dot.c's vdpbf16ps ones on an AVX512-BF16 CPU without AMX (oneDNN
 * packs a bf16 weight in 32-column blocks for the first, 64 for the second); neither: stubs
 * that decline (return 1). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__linux__)
#define KVSERVE_LINEAR_AMX 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVSERVE_LINEAR_DOT 1
#endif
int linear_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                       const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t m,
                       int64_t n, int64_t k, int num_threads);

int silu_gate_up_bf16_packed(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int64_t m, int64_t features,
                             int64_t k, int num_threads);

/* The packed layout's column block (32 or 64), or 0 where this build has neither kernel. */
int linear_packed_block_cols(void);
#endif
