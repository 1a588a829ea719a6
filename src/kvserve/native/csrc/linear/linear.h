/*
 * The linear kind's entry points: bf16 projections over oneDNN's packed weights and float32
 * ones over 8-bit block-quantized weights, what
 * native/ops.py declares and what layer/decode_layer.c calls.  Each defining file includes this
 * too, so the compiler checks that the definition and the callers agree.
 */
#ifndef KVSERVE_LINEAR_H
#define KVSERVE_LINEAR_H
#include <stdint.h>

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

/* linear_q8.c: float32 x times an 8-bit block-quantized weight (every build: AVX2+FMA, or
 * portable C). */
int linear_q8_f32(const float *x, int64_t x_stride, const int8_t *codes, const float *scales,
                  const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                  int64_t k, int num_threads);
/* linear_q4.c: float32 x (rounded to 8-bit blocks) times a 4-bit Q4_1-style weight; K a
 * multiple of 32, up to 64 rows. */
int linear_q4_f32(const float *x, int64_t x_stride, const uint8_t *codes, const float *scales,
                  const float *mins, const float *bias, float *out, int64_t out_stride, int64_t m,
                  int64_t n, int64_t k, int num_threads);
int dequantize_q8_f32(const int8_t *codes, const float *scales, float *out, int64_t n,
                      int64_t k, int num_threads);
#endif
