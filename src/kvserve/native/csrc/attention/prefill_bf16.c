/*
 * A prefill chunk's attention in bfloat16, on AMX tiles where the CPU has them, else with
 * AVX512-BF16 dot products (vdpbf16ps).
 *
 * PyTorch's CPU flash kernel ran a 256-token causal prompt of the embedded model (9 heads of
 * 64) at ~240 GFLOP/s on two AMX cores, 373 us a layer, of which the exponentials are ~30 us:
 * its matrix products, not its softmax, held it back.  On an AVX512-BF16 CPU without AMX
 * (AMD Zen 4/5) the same call took ~1.1 ms.  Here both products run on AMX tiles or on
 * vdpbf16ps, and the softmax is in two passes per block of 16 query rows (as in
 * paged_decode.c): every score of the block first (16 x keys floats, in L2), then one max,
 * exp (vec_exp.h's exp2_16_for_bf16, within 2.7e-6, far below the bf16 rounding that
 * follows) and sum per row, then P x V with the probabilities rounded to bfloat16, as the flash
 * kernel rounds them.  No running maxima, no rescaling.
 *
 * The fields of prefill_attention_args (attention.h):
 *   q      [N, L, H, D] bf16: sequence n, token t, head h at q + n * q_batch + t * q_stride
 *          + h * D (elements); N sequences of one shape (W3's suffixes) in one call
 *   k, v   [N, S, Hkv, D] bf16: key j, KV head g at k + n * k_batch + j * k_stride + g * D;
 *          or a paged cache [blocks, block_size, Hkv, D] (kv_table not NULL): sequence n's
 *          key j in block kv_table[n * table_stride + j / block_size], slot j % block_size
 *          (block_size a multiple of 16; k_batch unused)
 *   causal query t sees keys j <= t + (S - L) (the chunk is the last L of S tokens);
 *          else every key
 *   out    [N, L, H, D] contiguous: bf16 (out_bf16) or float32 (out_f32), one of the two
 *   lse    [N, L, H] float32, or NULL: each row's log-sum-exp of its scaled scores
 *   engine 0: AMX where permitted, else vdpbf16ps; 1: vdpbf16ps (tests compare the two)
 *
 * D: a multiple of 32, at most 256.  GQA: query head h reads KV head h / (H / Hkv); K and V
 * are packed once per call per KV head into the tiles' layouts (below), which are also the
 * layouts vdpbf16ps reads (a tile row is one vector), and shared by the group.  Returns 0, 1
 * where this build or CPU has no AVX512-BF16 (the caller keeps SDPA), or 2 when out of
 * memory.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PREFILL_HAS_VECTORS 1
#include <immintrin.h>
#include <math.h>

#include "common/vec_exp.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PREFILL_HAS_AMX 1
#include "common/amx_tiles.h"
#else
#define PREFILL_HAS_AMX 0
#endif

#define TILE_WORDS 256 /* 16 rows x 64 bytes, as uint32 */

/* Where one sequence's keys (or values) of one KV head lie: key j at base + j * stride, or, in
 * a paged cache (table not NULL), in slot j % block_size of block table[j / block_size], whose
 * first token is at base + table[...] * block_size * stride.  Reading the cache in place
 * spares the caller a gather of the sequence's blocks (W3's 1,024-token prefix: ~86 us a
 * layer, every step). */
typedef struct {
    const uint16_t *base;
    int64_t stride;
    const int64_t *table;
    int64_t block_size;
} kv_rows;

static inline const uint16_t *kv_row(const kv_rows *r, int64_t j) {
    if (!r->table) return r->base + j * r->stride;
    return r->base + (r->table[j / r->block_size] * r->block_size + j % r->block_size) * r->stride;
}

/* K of one KV head as the B operand of Q x K^T: per block of 16 keys and 32 dimensions, a
 * tile whose row r holds dimensions (2r, 2r + 1) of each of the 16 keys (VNNI pairs): the
 * keys' 32-bit pairs, transposed, one gather per row (the scalar loop's 16 strided stores a
 * pair cost ~90 us a call for 1,024 keys x 3 KV heads, a quarter of a W3 decode step's call).
 * Keys past S are zero. */
static void pack_keys(const kv_rows *k, int64_t num_keys, int dim, uint32_t *packed) {
    const int64_t k_stride = k->stride; /* 16 keys from one block: block_size % 16 == 0 */
    const int pairs = dim / 2;
    const int64_t blocks = (num_keys + 15) / 16;
    /* k_stride is even: a head size is a multiple of 32 */
    const __m512i lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)(k_stride / 2)));
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t left = num_keys - b * 16;
        const __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const int *first = (const int *)kv_row(k, b * 16);
        uint32_t *tiles = packed + b * (pairs / 16) * TILE_WORDS; /* row i: pair i's 16 keys */
        for (int i = 0; i < pairs; i++)
            _mm512_storeu_si512(tiles + i * 16, _mm512_mask_i32gather_epi32(
                                                   _mm512_setzero_si512(), live, lanes, first + i, 4));
    }
}

/* V of one KV head as the B operand of P x V: per block of 32 keys and 16 dimensions, a
 * tile whose row r holds keys (2r, 2r + 1) of each of the 16 dimensions, interleaved. */
static const uint16_t NO_VALUES[256] __attribute__((aligned(64))); /* dim <= 256 */

static void pack_values(const kv_rows *v, int64_t num_keys, int dim, uint32_t *packed) {
    const int dim_blocks = dim / 16;
    const int64_t blocks = (num_keys + 31) / 32;
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < 16; r++) {
            const int64_t k0 = b * 32 + 2 * r;
            const uint16_t *even = k0 < num_keys ? kv_row(v, k0) : NO_VALUES;
            const uint16_t *odd = k0 + 1 < num_keys ? kv_row(v, k0 + 1) : NO_VALUES;
            for (int db = 0; db < dim_blocks; db++) {
                __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + db * 16)));
                __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(odd + db * 16)));
                _mm512_storeu_si512(packed + (b * dim_blocks + db) * TILE_WORDS + r * 16,
                                    _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

typedef struct {
    const uint16_t *q;
    int64_t q_stride, q_batch, num_query, num_keys;
    int num_heads, group, dim, causal, use_amx;
    float scale;
    const uint32_t *keys, *values; /* packed, per KV head */
    int64_t keys_per_head, values_per_head;
    uint16_t *out_bf16;
    float *out_f32, *lse;
} prefill_args;

/* Query rows the vdpbf16ps loops take at a time (x 4 vectors: 24 accumulators): each K or V
 * vector loaded serves six rows' broadcasts instead of four. */
#define GROUP_ROWS 6

/* Query rows per work item: two tiles' worth, so that each K or V tile loaded from L2 feeds
 * two products (block_scores_amx2, block_output_amx2). */
#define ITEM_ROWS 32

typedef struct {
    float *scores;  /* [ITEM_ROWS, padded keys] */
    uint16_t *probs; /* [ITEM_ROWS, padded keys] bf16 */
    uint16_t *qbuf; /* [ITEM_ROWS, dim] */
    float *obuf;    /* [ITEM_ROWS, dim] */
    float row_max[ITEM_ROWS], row_sum[ITEM_ROWS];
} block_work;

#if PREFILL_HAS_AMX
/* Scores of 32 query rows (two A tiles) against keys [0, 16 * blocks): each K tile loaded
 * from L2 serves both row tiles, two key blocks at a time into four accumulators.  With one
 * row tile, every product waited on its own K tile's load: a 1,024 x 1,024 call spent ~60%
 * of its time in the two products at ~30% of the tiles' peak. */
static void block_scores_amx2(const prefill_args *a, const uint32_t *keys, block_work *w,
                              int64_t blocks, int64_t stride) {
    const int halves = a->dim / 32;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int half = 0; half < halves; half++) {
            _tile_loadd(0, w->qbuf + 32 * half, a->dim * 2);
            _tile_loadd(1, w->qbuf + 16 * a->dim + 32 * half, a->dim * 2);
            _tile_loadd(2, keys + (b * halves + half) * TILE_WORDS, 64);
            _tile_loadd(3, keys + ((b + 1) * halves + half) * TILE_WORDS, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        _tile_stored(4, w->scores + b * 16, stride * 4);
        _tile_stored(5, w->scores + (b + 1) * 16, stride * 4);
        _tile_stored(6, w->scores + 16 * stride + b * 16, stride * 4);
        _tile_stored(7, w->scores + 16 * stride + (b + 1) * 16, stride * 4);
    }
    if (b < blocks) {
        _tile_zero(4);
        _tile_zero(6);
        for (int half = 0; half < halves; half++) {
            _tile_loadd(0, w->qbuf + 32 * half, a->dim * 2);
            _tile_loadd(1, w->qbuf + 16 * a->dim + 32 * half, a->dim * 2);
            _tile_loadd(2, keys + (b * halves + half) * TILE_WORDS, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
        }
        _tile_stored(4, w->scores + b * 16, stride * 4);
        _tile_stored(6, w->scores + 16 * stride + b * 16, stride * 4);
    }
}

/* O = P x V for 32 rows: two 16-dimension V tiles at a time, each serving both row tiles. */
static void block_output_amx2(const prefill_args *a, const uint32_t *values, block_work *w,
                              int64_t pairs_blocks, int64_t stride) {
    const int dim_blocks = a->dim / 16; /* even: dim is a multiple of 32 */
    for (int dg = 0; dg < dim_blocks; dg += 2) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t b = 0; b < pairs_blocks; b++) {
            const uint32_t *vt = values + (b * dim_blocks + dg) * TILE_WORDS;
            _tile_loadd(0, w->probs + b * 32, stride * 2);
            _tile_loadd(1, w->probs + 16 * stride + b * 32, stride * 2);
            _tile_loadd(2, vt, 64);
            _tile_loadd(3, vt + TILE_WORDS, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        float *o = w->obuf + dg * 16;
        _tile_stored(4, o, a->dim * 4);
        _tile_stored(5, o + 16, a->dim * 4);
        _tile_stored(6, o + 16 * a->dim, a->dim * 4);
        _tile_stored(7, o + 16 * a->dim + 16, a->dim * 4);
    }
}
#endif

/* The same two products with vdpbf16ps, for CPUs without AMX.  A vector is one tile row:
 * 16 keys' dimension pair (Q x K^T), or 16 dimensions' key pair (P x V); the other operand's
 * pair is broadcast.  GROUP_ROWS (six) query rows by four vectors of accumulators (24
 * registers; four rows for a 16-row item's last group) hide the instruction's latency and read
 * each loaded vector six times. */
static inline __attribute__((always_inline)) void scores_rows(
    const uint32_t *q, int pairs, const uint32_t *keys, int64_t block_words, float *s,
    int64_t stride, const int rows, const int nb) {
    __m512 acc[GROUP_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int b = 0; b < nb; b++) acc[m][b] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh k[4];
        for (int b = 0; b < nb; b++) k[b] = (__m512bh)_mm512_loadu_si512(keys + b * block_words + i * 16);
        for (int m = 0; m < rows; m++) {
            const __m512bh qm = (__m512bh)_mm512_set1_epi32((int)q[m * pairs + i]);
            for (int b = 0; b < nb; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], qm, k[b]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int b = 0; b < nb; b++) _mm512_storeu_ps(s + m * stride + b * 16, acc[m][b]);
}

/* Scores of the block's rows [m, m + rows) against keys [0, 16 * blocks); rows is
 * GROUP_ROWS or 4 (the group's last). */
static void group_scores_vec(const prefill_args *a, const uint32_t *keys, block_work *w, int m,
                             int rows, int64_t blocks, int64_t stride) {
    const int pairs = a->dim / 2;
    const int64_t block_words = (int64_t)(a->dim / 32) * TILE_WORDS; /* one block of 16 keys */
    const uint32_t *q = (const uint32_t *)w->qbuf + m * pairs;
    float *s = w->scores + m * stride;
    int64_t b = 0;
    if (rows == GROUP_ROWS) {
        for (; b + 4 <= blocks; b += 4)
            scores_rows(q, pairs, keys + b * block_words, block_words, s + b * 16, stride,
                        GROUP_ROWS, 4);
        for (; b < blocks; b++)
            scores_rows(q, pairs, keys + b * block_words, block_words, s + b * 16, stride,
                        GROUP_ROWS, 1);
        return;
    }
    for (; b + 4 <= blocks; b += 4)
        scores_rows(q, pairs, keys + b * block_words, block_words, s + b * 16, stride, 4, 4);
    for (; b < blocks; b++)
        scores_rows(q, pairs, keys + b * block_words, block_words, s + b * 16, stride, 4, 1);
}

static inline __attribute__((always_inline)) void output_rows(
    const uint32_t *p, int64_t p_stride, const uint32_t *values, int dim_blocks, int64_t pairs,
    float *o, int dim, const int rows, const int nd) {
    __m512 acc[GROUP_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int d = 0; d < nd; d++) acc[m][d] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t *row = values + ((j >> 4) * dim_blocks) * TILE_WORDS + (j & 15) * 16;
        __m512bh v[4];
        for (int d = 0; d < nd; d++) v[d] = (__m512bh)_mm512_loadu_si512(row + d * TILE_WORDS);
        for (int m = 0; m < rows; m++) {
            const __m512bh pm = (__m512bh)_mm512_set1_epi32((int)p[m * p_stride + j]);
            for (int d = 0; d < nd; d++) acc[m][d] = _mm512_dpbf16_ps(acc[m][d], pm, v[d]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int d = 0; d < nd; d++) _mm512_storeu_ps(o + m * dim + d * 16, acc[m][d]);
}

/* O = P x V for the block's rows [m, m + rows), over key pairs [0, pairs): the pairs the
 * rows' keys reach, not whole blocks of 16 (the pairs past them have zero probabilities:
 * W1's 256-token prompts did ~12% more output work with the block's last pairs); each call
 * of output_rows with its row and vector counts as constants (so that its loops unroll). */
static void group_output_vec(const prefill_args *a, const uint32_t *values, block_work *w,
                             int m, int rows, int64_t pairs, int64_t stride) {
    const int dim_blocks = a->dim / 16; /* even: dim is a multiple of 32 */
    const uint32_t *p = (const uint32_t *)w->probs + m * stride / 2;
    float *o = w->obuf + m * a->dim;
#define OUTPUT_ROWS(R, ND)                                                                     \
    output_rows(p, stride / 2, values + db * TILE_WORDS, dim_blocks, pairs,                   \
                o + db * 16, a->dim, R, ND)
    for (int db = 0; db < dim_blocks;) {
        if (db + 4 <= dim_blocks) {
            if (rows == GROUP_ROWS) OUTPUT_ROWS(GROUP_ROWS, 4);
            else OUTPUT_ROWS(4, 4);
            db += 4;
        } else {
            if (rows == GROUP_ROWS) OUTPUT_ROWS(GROUP_ROWS, 2);
            else OUTPUT_ROWS(4, 2);
            db += 2;
        }
    }
#undef OUTPUT_ROWS
}

/* Row m's softmax over its keys [0, limit) into bf16 probabilities (zero up to `padded`);
 * its max (scaled) and sum kept for the output and the log-sum-exp. */
static inline __mmask16 live_lanes(int64_t j, int64_t limit) {
    return j >= limit ? 0 : limit - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (limit - j)) - 1u);
}

static void row_softmax(block_work *w, int m, int64_t limit, int64_t padded, int64_t stride,
                        float scale) {
    const float *s = w->scores + m * stride;
    uint16_t *p = w->probs + m * stride;
    /* Four independent chains for the max and the sum, unmasked over the keys in whole
     * 64-key runs (masks and two chains ran the exponentials at ~1.2 instructions a cycle,
     * a quarter of a bf16 prefill's single-thread time), then the rest with masks. */
    const int64_t whole = limit / 64 * 64;
    __m512 top[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                     _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
    int64_t j = 0;
    for (; j < whole; j += 64)
        for (int i = 0; i < 4; i++) top[i] = _mm512_max_ps(top[i], _mm512_loadu_ps(s + j + 16 * i));
    for (; j < limit; j += 16) {
        __mmask16 live = live_lanes(j, limit);
        top[0] = _mm512_mask_max_ps(top[0], live, top[0], _mm512_maskz_loadu_ps(live, s + j));
    }
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]),
                                                        _mm512_max_ps(top[2], top[3]))) * scale;
    /* e^(s scale - mx) as 2^(s scale log2(e) - mx log2(e)) */
    const float log2e = 1.4426950408889634f;
    const __m512 vscale = _mm512_set1_ps(scale * log2e), vmx = _mm512_set1_ps(mx * log2e);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (j = 0; j < whole; j += 64) {
        __m512 e[4];
        for (int i = 0; i < 4; i++) {
            e[i] = exp2_16_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16 * i), vscale, vmx));
            sum[i] = _mm512_add_ps(sum[i], e[i]);
        }
        _mm512_storeu_si512((void *)(p + j), (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_storeu_si512((void *)(p + j + 32), (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
    for (; j < padded; j += 32) { /* padded: a multiple of 32 */
        __mmask16 l0 = live_lanes(j, limit), l1 = live_lanes(j + 16, limit);
        __m512 e0 = _mm512_maskz_mov_ps(l0, exp2_16_for_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(l0, s + j), vscale, vmx)));
        __m512 e1 = _mm512_maskz_mov_ps(l1, exp2_16_for_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(l1, s + j + 16), vscale, vmx)));
        sum[0] = _mm512_add_ps(sum[0], e0);
        sum[1] = _mm512_add_ps(sum[1], e1);
        _mm512_storeu_si512((void *)(p + j), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    w->row_max[m] = mx;
    w->row_sum[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]),
                                                       _mm512_add_ps(sum[2], sum[3])));
}

/* Softmax of the block's rows [m0, m1) (rows of the block from `first`): each over the keys
 * it sees, below `end`; rows past `rows` (the query's end) get zero probabilities. */
static void softmax_rows(const prefill_args *a, block_work *w, int64_t first, int m0, int m1,
                         int rows, int64_t end, int64_t padded, int64_t stride) {
    const int64_t offset = a->num_keys - a->num_query;
    for (int m = m0; m < m1; m++) {
        if (m < rows) {
            int64_t limit = a->causal ? first + m + offset + 1 : a->num_keys;
            row_softmax(w, m, limit < end ? limit : end, padded, stride, a->scale);
        } else {
            memset(w->probs + m * stride, 0, padded * 2);
        }
    }
}

/* Query rows [first, first + item_rows) of sequence `seq` (as far as its queries go), head h:
 * item_rows is ITEM_ROWS on AMX, 16 with vdpbf16ps (which works 4 rows at a time anyway). */
static void attend_block(const prefill_args *a, int64_t seq, int h, int64_t first, int item_rows,
                         block_work *w) {
    const int64_t offset = a->num_keys - a->num_query;
    const int rows = a->num_query - first < item_rows ? (int)(a->num_query - first) : item_rows;
    int64_t end = a->causal ? first + rows + offset : a->num_keys; /* keys any row sees */
    if (end > a->num_keys) end = a->num_keys;
    /* Rows of scores and probabilities an odd number of 64-byte lines apart: at a power of
     * two (2,048 keys) the 16 rows of a tile share one L1 set, and the block ran 1.x slower. */
    const int64_t pair_blocks = (end + 31) / 32, padded = pair_blocks * 32, stride = padded + 16;
    const int kv_head = h / a->group, dim = a->dim;
    const int tile_rows = a->use_amx ? 32 : 16; /* rows the tiles compute, zeros past `rows` */
    for (int m = 0; m < tile_rows; m++) {
        if (m < rows)
            memcpy(w->qbuf + m * dim, a->q + seq * a->q_batch + (first + m) * a->q_stride + (int64_t)h * dim,
                   dim * 2);
        else
            memset(w->qbuf + m * dim, 0, dim * 2);
    }
    const int64_t packed_head = seq * (a->num_heads / a->group) + kv_head;
    const uint32_t *keys = a->keys + packed_head * a->keys_per_head;
    const uint32_t *values = a->values + packed_head * a->values_per_head;
#if PREFILL_HAS_AMX
    if (a->use_amx) { /* 32 rows, zeros past `rows` (a short last item pays for 16 of them) */
        block_scores_amx2(a, keys, w, (end + 15) / 16, stride);
        softmax_rows(a, w, first, 0, 32, rows, end, padded, stride);
        block_output_amx2(a, values, w, pair_blocks, stride);
    } else
#endif
    /* A group of rows at a time from scores to output (6, 6 and 4 of the 16), their scores
     * and probabilities still in L1, each group over the keys its own rows see. */
    for (int m = 0; m < rows;) {
        const int n = 16 - m >= GROUP_ROWS ? GROUP_ROWS : 4; /* rows computed (zeros past) */
        int64_t seen = a->causal ? first + (m + n < rows ? m + n : rows) + offset : a->num_keys;
        if (seen > end) seen = end;
        const int64_t group_pairs = (seen + 31) / 32;
        group_scores_vec(a, keys, w, m, n, (seen + 15) / 16, stride);
        softmax_rows(a, w, first, m, m + n, rows, seen, group_pairs * 32, stride);
        group_output_vec(a, values, w, m, n, (seen + 1) / 2, stride);
        m += n;
    }
    for (int m = 0; m < rows; m++) {
        const int64_t row = (seq * a->num_query + first + m) * a->num_heads + h;
        const __m512 inv = _mm512_set1_ps(1.0f / w->row_sum[m]);
        for (int d = 0; d < dim; d += 16) {
            __m512 o = _mm512_mul_ps(_mm512_loadu_ps(w->obuf + m * dim + d), inv);
            if (a->out_f32)
                _mm512_storeu_ps(a->out_f32 + row * dim + d, o);
            else
                _mm256_storeu_si256((__m256i *)(a->out_bf16 + row * dim + d),
                                    (__m256i)_mm512_cvtneps_pbh(o));
        }
        if (a->lse) a->lse[row] = w->row_max[m] + logf(w->row_sum[m]);
    }
}

#else
#define PREFILL_HAS_VECTORS 0
#endif

int prefill_attention_bf16(const prefill_attention_args *args) {
    /* The arguments under the names (and types) they had as parameters. */
    const uint16_t *q = args->q, *k = args->k, *v = args->v;
    int64_t q_stride = args->q_stride, q_batch = args->q_batch;
    int64_t k_stride = args->k_stride, k_batch = args->k_batch;
    int64_t v_stride = args->v_stride, v_batch = args->v_batch;
    int64_t num_seqs = args->num_seqs, num_query = args->num_query, num_keys = args->num_keys;
    int num_heads = args->num_heads, num_kv_heads = args->num_kv_heads, dim = args->dim;
    float scale = args->scale;
    int causal = args->causal;
    uint16_t *out_bf16 = args->out_bf16;
    float *out_f32 = args->out_f32, *lse = args->lse;
    int engine = args->engine, num_threads = args->num_threads;
    const int64_t *kv_table = args->kv_table;
    int64_t table_stride = args->table_stride, kv_block_size = args->kv_block_size;
#if !PREFILL_HAS_VECTORS /* this build has no AVX512-BF16: the caller keeps SDPA */
    (void)engine, (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride;
    (void)q_batch, (void)k_batch, (void)v_batch, (void)num_seqs;
    (void)num_query, (void)num_keys, (void)num_heads, (void)num_kv_heads, (void)dim;
    (void)scale, (void)causal, (void)out_bf16, (void)out_f32, (void)lse, (void)num_threads;
    (void)kv_table, (void)table_stride, (void)kv_block_size;
    return 1;
#else
#if PREFILL_HAS_AMX
    const int use_amx = engine == 0 && amx_permitted();
#else
    const int use_amx = 0;
    (void)engine;
#endif
    if (dim % 32 || dim > 256 || num_heads % num_kv_heads || num_keys < 1 || num_seqs < 1 ||
        num_query < 1 || (causal && num_keys < num_query) ||
        (kv_table && (kv_block_size < 16 || kv_block_size % 16)))
        return 1;
    const int64_t key_blocks = (num_keys + 15) / 16, pair_blocks = (num_keys + 31) / 32;
    prefill_args a = {q, q_stride, q_batch, num_query, num_keys, num_heads,
                      num_heads / num_kv_heads, dim, causal, use_amx, scale, NULL, NULL,
                      key_blocks * (dim / 32) * TILE_WORDS, pair_blocks * (dim / 16) * TILE_WORDS,
                      out_bf16, out_f32, lse};
    const int64_t packed_heads = num_seqs * num_kv_heads;
    uint32_t *packed = aligned_alloc(64, (size_t)(a.keys_per_head + a.values_per_head) *
                                             packed_heads * sizeof(uint32_t));
    if (!packed) return 2;
    a.keys = packed;
    a.values = packed + a.keys_per_head * packed_heads;
    const int item_rows = use_amx ? ITEM_ROWS : 16;
    const int64_t query_blocks = (num_query + item_rows - 1) / item_rows;
    const int64_t per_seq = query_blocks * num_heads;
    const int64_t items = num_seqs * per_seq;
    const int64_t padded = pair_blocks * 32;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < 2 * packed_heads; i++) { /* (sequence, KV head), K and V */
            const int64_t head = i / 2, seq = head / num_kv_heads, g = head % num_kv_heads;
            const int64_t *table = kv_table ? kv_table + seq * table_stride : NULL;
            const kv_rows keys = {k + (table ? 0 : seq * k_batch) + g * dim, k_stride, table,
                                  kv_block_size};
            const kv_rows values = {v + (table ? 0 : seq * v_batch) + g * dim, v_stride, table,
                                    kv_block_size};
            if (i % 2 == 0)
                pack_keys(&keys, num_keys, dim, (uint32_t *)a.keys + head * a.keys_per_head);
            else
                pack_values(&values, num_keys, dim,
                            (uint32_t *)a.values + head * a.values_per_head);
        }
        block_work w = {0};
        char *buffer = aligned_alloc(64, (size_t)ITEM_ROWS * (padded + 16) * 6
                                             + (size_t)ITEM_ROWS * dim * 6 + 64);
        if (!buffer) {
            #pragma omp atomic write
            failed = 1;
        } else {
            w.scores = (float *)buffer;
            w.probs = (uint16_t *)(w.scores + ITEM_ROWS * (padded + 16));
            w.obuf = (float *)(w.probs + ITEM_ROWS * (padded + 16));
            w.qbuf = (uint16_t *)(w.obuf + ITEM_ROWS * dim);
#if PREFILL_HAS_AMX
            if (use_amx) amx_configure_tiles();
#endif
        }
        /* The last query blocks see the most keys: hand them out first. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t seq = item / per_seq, rest = item % per_seq;
            if (buffer)
                attend_block(&a, seq, (int)(rest % num_heads),
                             (query_blocks - 1 - rest / num_heads) * item_rows, item_rows, &w);
        }
#if PREFILL_HAS_AMX
        if (buffer && use_amx) _tile_release();
#endif
        free(buffer);
    }
    free(packed);
    return failed ? 2 : 0;
#endif
}
