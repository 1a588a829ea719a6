/*
 * paged_decode.c's path for a CPU with AMX (Linux): a sequence's scores on tiles, the rest as
 * decode_avx512bf16.h does it (whose helpers it uses: included after it).
 *
 * A part of paged_decode.c, included once by it where the build targets AMX; not a header of
 * its own.
 */
#include "common/amx_tiles.h"

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
