/*
 * paged_decode.c's path for a CPU with AVX512-BF16 (and DQ): the scores of bf16-exact queries
 * by vdpbf16ps straight from bf16 or 8-bit rows, one softmax per head over the whole
 * sequence, then p x V with register accumulators (attend_sequence_fast).  Its helpers
 * (chunk_f32, PV_ROW, the prefetch slices, next_sequence) serve decode_amx.h too.
 *
 * A part of paged_decode.c, included once by it where the build targets these instructions;
 * not a header of its own.
 */
/* A bfloat16 cache on a CPU with AVX512-BF16: q . k straight from the stored bf16 rows with
 * vdpbf16ps (pairs of bf16 products summed in float32).  The queries are bf16 values widened
 * to float32 by the caller, so narrowing them back is exact; sums stay float32.  Per block and
 * KV head: 16 rows' dot products in 16 accumulators folded by one transposing reduction, an
 * online softmax on 16 lanes at once, and p x V in float32. */
#define BF16_CHUNKS_MAX 8 /* dim <= 256 */

/* r[o] = sum of a[o]'s 16 lanes, for 16 vectors at once: a transposing reduction (pairs of
 * rows, then quads, then the four 128-bit quarters) instead of 16 horizontal sums. */
static inline __m512 sum16x16(const __m512 *a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane: [A02 B02 A13 B13], A, B = rows 2i, 2i+1 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++) { /* 128-bit lane: rows 4j..4j+3, one quarter's sum each */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * j]), _mm512_castps_pd(t[2 * j + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * j]), _mm512_castps_pd(t[2 * j + 1]));
        u[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                               _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                               _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                         _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* Lane o = q . row o for 16 rows of CHUNKS x 32 bf16 values (rows past the span point at
 * zeros): straight-line code, the 16 x CHUNKS loads and dot products independent of each
 * other, so the CPU overlaps their latencies (a loop with a row count and a chunk count
 * known only at run time measured ~2x slower). */
#define DEFINE_SCORES16(CHUNKS)                                                                \
    static inline __m512 bf16_scores16_##CHUNKS(const __m512bh *q,                             \
                                                const uint16_t *const *rows) {                 \
        __m512 acc[16];                                                                        \
        for (int o = 0; o < 16; o++) {                                                         \
            acc[o] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0],                               \
                                      (__m512bh)_mm512_loadu_si512(rows[o]));                  \
            for (int c = 1; c < CHUNKS; c++)                                                   \
                acc[o] = _mm512_dpbf16_ps(acc[o], q[c],                                        \
                                          (__m512bh)_mm512_loadu_si512(rows[o] + 32 * c));     \
        }                                                                                      \
        return sum16x16(acc);                                                                  \
    }
DEFINE_SCORES16(1)
DEFINE_SCORES16(2)
DEFINE_SCORES16(4)

static const uint16_t ZERO_ROW[128] __attribute__((aligned(64))); /* dim <= 128 */

/* q . row for the n (<= 16) rows given; lanes past n are 0. */
static inline __m512 bf16_scores16(const __m512bh *q, const uint16_t **rows, int n, int chunks) {
    for (int o = n; o < 16; o++) rows[o] = ZERO_ROW;
    switch (chunks) {
    case 1: return bf16_scores16_1(q, rows);
    case 2: return bf16_scores16_2(q, rows);
    default: return bf16_scores16_4(q, rows);
    }
}

/* True when every value of q is a bfloat16 widened to float32 (its low 16 bits are zero):
 * then the bf16 dot products are exact, and the engine's bf16 model always passes such q. */
static inline int is_bf16_exact(const float *q, int count) {
    int d = 0;
    __m512i low = _mm512_setzero_si512();
    for (; d + 16 <= count; d += 16)
        low = _mm512_or_si512(low, _mm512_and_si512(_mm512_loadu_si512(q + d),
                                                    _mm512_set1_epi32(0xffff)));
    uint32_t rest = 0;
    for (; d < count; d++) {
        uint32_t bits;
        memcpy(&bits, q + d, sizeof bits);
        rest |= bits & 0xffffu;
    }
    return _mm512_test_epi32_mask(low, low) == 0 && rest == 0;
}

/* 16 float32 values (16c .. 16c+15) of one stored row, unscaled.  Every 8-bit code and every
 * bf16 value is exact in float32 (and in bf16: int8 codes are 8-bit integers, fp8 values have
 * 2-3 mantissa bits), which lets the 8-bit caches share the bf16 dot products below. */
static inline __m512 fp8_chunk(const uint8_t *src, int mant_bits, int rebias, float sub_unit) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __mmask16 normal = _mm512_cmpge_epu32_mask(em, _mm512_set1_epi32(1 << mant_bits));
    __m512 nv = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 23 - mant_bits),
                                                     _mm512_set1_epi32(rebias << 23)));
    __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(sub_unit));
    __m512 v = _mm512_mask_blend_ps(normal, sv, nv); /* exponent 0: subnormal, m x unit */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

static inline __m512 chunk_f32(int kind, const void *row, int c) {
    switch (kind) {
    case KV_BF16: {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 16 * c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case KV_I8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)row + 16 * c))));
    case KV_E4M3: /* bias 7: rebias by 120, subnormals m x 2^-9 */
        return fp8_chunk((const uint8_t *)row + 16 * c, 3, 120, 1.0f / 512.0f);
    default: /* KV_E5M2, bias 15: rebias by 112, subnormals m x 2^-16 */
        return fp8_chunk((const uint8_t *)row + 16 * c, 2, 112, 1.0f / 65536.0f);
    }
}

/* a[g][c] += weight(g) x chunk c of one stored row, for the GS heads of a group: each chunk
 * widened once, then one FMA per head (the accumulators of DEFINE_PV and DEFINE_PV_SEQ). */
#define PV_ROW(GS, C, kind, row, weight)                                                       \
    for (int c = 0; c < C; c++) {                                                              \
        __m512 v = chunk_f32(kind, row, c);                                                    \
        for (int g = 0; g < GS; g++)                                                           \
            a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight), v, a[g][c]);                     \
    }
#define PV_STORE(GS, C)                                                                        \
    for (int g = 0; g < GS; g++)                                                               \
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + g * stride + 16 * c, a[g][c]);

/* acc[g] (dim floats, g < GS, `stride` apart) += sum over the n rows of w[g * 16 + o] x V row o.
 * The GS x C accumulators stay in registers for the whole span and each V chunk is converted
 * once for all GS heads: p x V is then a handful of FMAs per loaded value. */
#define DEFINE_PV(GS, C)                                                                       \
    static void pv_##GS##_##C(float *acc, int64_t stride, const float *w,                     \
                              const void *const *rows, int n, int kind) {                      \
        __m512 a[GS][C];                                                                       \
        for (int g = 0; g < GS; g++)                                                           \
            for (int c = 0; c < C; c++) a[g][c] = _mm512_loadu_ps(acc + g * stride + 16 * c);  \
        for (int o = 0; o < n; o++) PV_ROW(GS, C, kind, rows[o], w[g * 16 + o])                \
        PV_STORE(GS, C)                                                                        \
    }
DEFINE_PV(1, 2) DEFINE_PV(2, 2) DEFINE_PV(3, 2) DEFINE_PV(4, 2)
DEFINE_PV(5, 2) DEFINE_PV(6, 2) DEFINE_PV(7, 2) DEFINE_PV(8, 2)
DEFINE_PV(1, 4) DEFINE_PV(2, 4) DEFINE_PV(3, 4) DEFINE_PV(4, 4)
DEFINE_PV(1, 8) DEFINE_PV(2, 8)
typedef void (*pv_fn)(float *, int64_t, const float *, const void *const *, int, int);
static const pv_fn PV_BY_SHAPE[9][9] = { /* [C][GS]: dim 32, 64, 128 */
    [2] = {0, pv_1_2, pv_2_2, pv_3_2, pv_4_2, pv_5_2, pv_6_2, pv_7_2, pv_8_2},
    [4] = {0, pv_1_4, pv_2_4, pv_3_4, pv_4_4},
    [8] = {0, pv_1_8, pv_2_8},
};

static inline int fast_dim(int dim) { return dim == 32 || dim == 64 || dim == 128; }

/* The scale of each of the span's rows for one KV head (1 for unscaled storage). */
static inline __m512 span_scales(const float *scales, int64_t first_slot, int n, int kv_head,
                                 int num_kv_heads) {
    if (!scales) return _mm512_set1_ps(1.0f);
    float s[16];
    for (int o = 0; o < 16; o++)
        s[o] = o < n ? scales[(first_slot + o) * num_kv_heads + kv_head] : 1.0f;
    return _mm512_loadu_ps(s);
}

/* Rows of 8-bit codes as bf16 (exact) in buf, for the bf16 dot products. */
static inline void rows_to_bf16(int kind, const void *const *rows, int n, int dim,
                                uint16_t *buf, const uint16_t **out_rows) {
    for (int o = 0; o < n; o++) {
        for (int c = 0; c < dim / 16; c += 2) {
            __m512bh pair = _mm512_cvtne2ps_pbh(chunk_f32(kind, rows[o], c + 1),
                                                chunk_f32(kind, rows[o], c));
            _mm512_storeu_si512(buf + o * dim + 16 * c, (__m512i)pair);
        }
        out_rows[o] = buf + o * dim;
    }
}

/* Softmax of n scores in place (lanes beyond n are ignored): p = exp(s - max), returns 1 / sum. */
static float softmax_in_place(float *s, int64_t n, float *max_out) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + i));
    *max_out = _mm512_reduce_max_ps(mx);
    __m512 shift = _mm512_set1_ps(*max_out), sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
        _mm512_storeu_ps(s + i, p);
        sum = _mm512_add_ps(sum, p);
    }
    if (tail) {
        __m512 p = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), shift)));
        _mm512_mask_storeu_ps(s + i, tail, p);
        sum = _mm512_add_ps(sum, p);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Block b of a sequence's table in `cache` (bytes); *count: how many of its rows the sequence
 * uses. */
static inline const char *table_block(const void *cache, const int64_t *table, int64_t b,
                                      int64_t block_bytes, int64_t seq_len, int block_size,
                                      int *count) {
    int64_t left = seq_len - b * block_size;
    *count = (int)(left < block_size ? left : block_size);
    return (const char *)cache + table[b] * block_bytes;
}

/* Prefetch (into L2) the part-th of `parts` equal slices of the cache lines of `bytes` bytes at
 * base.  Asking for a whole block at once (~100 lines) stalls the core: each prefetch holds
 * one of its ~16 line-fill buffers until memory answers, so the compute waits for the block
 * and nothing overlaps.  Spread across the block's compute, a few lines at a time, the loads
 * run under the arithmetic: 2.38 -> 1.98 ms per layer at 128 x 320 tokens (docs/benchmarks.md). */
/* [*begin, *end): slice `part` of `parts` equal slices of `lines` lines. */
static inline void line_slice(int64_t lines, int64_t part, int64_t parts, int64_t *begin,
                              int64_t *end) {
    int64_t per = (lines + parts - 1) / parts;
    *begin = part * per;
    *end = *begin + per < lines ? *begin + per : lines;
}

static inline void prefetch_part(const char *base, int64_t bytes, int part, int parts) {
    int64_t line, end;
    line_slice((bytes + 63) / 64, part, parts, &line, &end);
    for (; line < end; line++) __builtin_prefetch(base + line * 64, 0, 2);
}

/* What the pass over V prefetches for the sequence this thread attends next: the K and V of
 * its first NEXT_SEQ_ROWS tokens (two blocks of 16; the head of one larger block), so that
 * its first pass does not start on a miss.  Whole blocks of 64 or 128 tokens would be asked
 * for under the current sequence's p x V and crowd out its own V. */
#define NEXT_SEQ_ROWS 32
typedef struct {
    const int64_t *table; /* NULL: no next sequence */
    int64_t blocks;       /* blocks holding its first min(seq_len, NEXT_SEQ_ROWS) tokens */
    int64_t bytes;        /* bytes asked for in each of them */
} next_sequence;

static inline next_sequence next_sequence_of(const int64_t *table, int64_t seq_len,
                                             int block_size, int64_t row_bytes) {
    const int64_t rows = seq_len < NEXT_SEQ_ROWS ? seq_len : NEXT_SEQ_ROWS;
    const int64_t per_block = block_size < NEXT_SEQ_ROWS ? block_size : NEXT_SEQ_ROWS;
    return (next_sequence){table, (rows + block_size - 1) / block_size, per_block * row_bytes};
}

/* Slice `part` of `parts` of the next sequence's first rows (K and V alternating by block). */
static inline void prefetch_next_part(const void *key, const void *value, next_sequence next,
                                      int64_t block_bytes, int64_t part, int64_t parts) {
    if (!next.table) return;
    int64_t lines_per = (next.bytes + 63) / 64, line, end;
    line_slice(2 * next.blocks * lines_per, part, parts, &line, &end);
    for (; line < end; line++) {
        int64_t which = line / lines_per;
        const char *base = (const char *)(which & 1 ? value : key) + next.table[which >> 1] * block_bytes;
        __builtin_prefetch(base + (line % lines_per) * 64, 0, 2);
    }
}

/* The span (16 rows, or a whole block of fewer) after the one at row `start` of block b of a
 * sequence, in a cache of rows row_stride bytes apart: its address, or NULL past the end. */
static inline const char *next_span(const void *cache, const int64_t *table, int64_t b, int start,
                                    int64_t seq_len, int block_size, int64_t row_stride) {
    const int span = block_size < 16 ? block_size : 16;
    if (b * block_size + start + span >= seq_len) return NULL;
    if (start + span < block_size)
        return (const char *)cache + (table[b] * block_size + start + span) * row_stride;
    return (const char *)cache + table[b + 1] * block_size * row_stride;
}

/* rows[o] = row o of a block for one KV head (offset bytes into each row). */
static inline void head_rows(const char *block, int count, int64_t row_stride, int64_t offset,
                             const void **rows) {
    for (int o = 0; o < count; o++) rows[o] = block + o * row_stride + offset;
}

/* One sequence over a bf16 or 8-bit cache, with bf16-exact queries (a bf16 model), in two
 * passes: every score first (bf16 dot products; 8-bit K codes widened to bf16 exactly, times
 * their scales), one softmax per head over the whole sequence, then p x V in float32 with
 * register accumulators (V scales folded into the weights).  Against an online softmax per
 * block this saves the per-block maxima, rescaling and exponentials' latency chains; the
 * scores (num_heads x seq_len floats) stay in L2.
 * Both passes walk the sequence in spans of 16 rows, all KV heads of a span before the next
 * (a block of 64 or 128 tokens is read once, not once a head), and each asks for its own rows
 * one span ahead, in slices spread over the span's work: K during the scores, V during p x V.
 * Asked for a block ahead instead, larger blocks lost (W1's 128 x 320 tokens, a layer: 32-token
 * blocks 1.55 -> 1.28 ms with spans, 64 and 128 tokens, which took the general path then,
 * 4.2-4.5 -> 1.2-1.3 ms, 16 tokens the same bit for bit; /tmp/k16/bs2.py, twenty-first round).
 * V is asked for under p x V, not under the scores: with both asked for during the scores,
 * the first pass streamed the whole 2 x 6 KiB a block at the core's limit of misses in flight
 * and p x V ran from L2 with the memory idle: on the AMD EPYC (no AMX) W1's 128 x 320 tokens
 * took 1.69 ms a layer against 1.48 with V fetched under p x V (alternating, six rounds each,
 * /tmp/k14/ab.py; docs/benchmarks.md, nineteenth round).
 * work: 16 * group + 8 * dim + num_heads * round_up(seq_len, 16) floats. */
static void attend_sequence_fast(const float *q, float *out, const void *key, const void *value,
                                 const float *key_scale, const float *value_scale, int kind,
                                 const int64_t *table, int64_t seq_len, int num_kv_heads,
                                 int group, int dim, int block_size, float sm_scale,
                                 float *work, float *lse, next_sequence next) {
    const int num_heads = num_kv_heads * group, chunks = dim / 32, elem = kind == KV_BF16 ? 2 : 1;
    const int64_t row_stride = (int64_t)num_kv_heads * dim * elem;
    const int64_t block_bytes = block_size * row_stride;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t padded = (seq_len + 15) / 16 * 16;
    float *w = work, *scores = w + 16 * group;
    uint16_t *kbuf = (uint16_t *)(scores + (int64_t)num_heads * padded);
    const int gs_max = 16 / (dim / 16) < group ? 16 / (dim / 16) : group;
    __m512bh qbf[num_heads][BF16_CHUNKS_MAX];
    for (int head = 0; head < num_heads; head++)
        for (int c = 0; c < chunks; c++) {
            const float *src = q + (int64_t)head * dim + 32 * c;
            qbf[head][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
    const void *rows[16];
    const uint16_t *kbf[16]; /* bf16_scores16 fills the rows past a short span */
    const int span_rows = block_size < 16 ? block_size : 16;
    const int64_t span_bytes = span_rows * row_stride;
    const int64_t num_spans = (seq_len + span_rows - 1) / span_rows;
    for (int64_t b = 0; b < num_blocks; b++) { /* pass 1: scores */
        int count;
        const char *block = table_block(key, table, b, block_bytes, seq_len, block_size, &count);
        for (int start = 0; start < count; start += 16) {
            const int n = count - start < 16 ? count - start : 16;
            const int64_t row0 = b * block_size + start;
            const char *ahead = next_span(key, table, b, start, seq_len, block_size, row_stride);
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int h = 0; h < num_kv_heads; h++) {
                head_rows(block + start * row_stride, n, row_stride, (int64_t)h * dim * elem, rows);
                __m512 ks = _mm512_mul_ps(
                    span_scales(key_scale, table[b] * block_size + start, n, h, num_kv_heads),
                    _mm512_set1_ps(sm_scale));
                if (kind == KV_BF16)
                    for (int o = 0; o < n; o++) kbf[o] = (const uint16_t *)rows[o];
                else
                    rows_to_bf16(kind, rows, n, dim, kbuf, kbf);
                for (int g = 0; g < group; g++) {
                    if (ahead) /* the next span's K */
                        prefetch_part(ahead, span_bytes, h * group + g, num_heads);
                    __m512 sc = _mm512_mul_ps(bf16_scores16(qbf[h * group + g], kbf, n, chunks), ks);
                    _mm512_mask_storeu_ps(scores + (int64_t)(h * group + g) * padded + row0, live, sc);
                }
            }
        }
    }
    /* pass 2's first span */
    prefetch_part((const char *)value + table[0] * block_bytes, span_bytes, 0, 1);
    float inv_sum[num_heads], max_score[num_heads];
    for (int head = 0; head < num_heads; head++)
        inv_sum[head] = softmax_in_place(scores + (int64_t)head * padded, seq_len, &max_score[head]);
    memset(out, 0, sizeof(float) * (size_t)num_heads * dim);
    for (int64_t b = 0; b < num_blocks; b++) { /* pass 2: p x V */
        int count;
        const char *block = table_block(value, table, b, block_bytes, seq_len, block_size, &count);
        for (int start = 0; start < count; start += 16) {
            const int n = count - start < 16 ? count - start : 16;
            const int64_t row0 = b * block_size + start;
            const char *ahead = next_span(value, table, b, start, seq_len, block_size, row_stride);
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int h = 0; h < num_kv_heads; h++) {
                if (ahead) prefetch_part(ahead, span_bytes, h, num_kv_heads); /* next V */
                prefetch_next_part(key, value, next, block_bytes,
                                   row0 / span_rows * num_kv_heads + h, num_spans * num_kv_heads);
                head_rows(block + start * row_stride, n, row_stride, (int64_t)h * dim * elem, rows);
                __m512 vs = span_scales(value_scale, table[b] * block_size + start, n, h, num_kv_heads);
                for (int g = 0; g < group; g++) {
                    const float *p = scores + (int64_t)(h * group + g) * padded + row0;
                    _mm512_storeu_ps(w + 16 * g, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p), vs));
                }
                for (int g0 = 0; g0 < group; g0 += gs_max) {
                    int gs = group - g0 < gs_max ? group - g0 : gs_max;
                    PV_BY_SHAPE[dim / 16][gs](out + (int64_t)(h * group + g0) * dim, dim,
                                              w + 16 * g0, rows, n, kind);
                }
            }
        }
    }
    for (int head = 0; head < num_heads; head++) {
        if (lse) lse[head] = max_score[head] - logf(inv_sum[head]);
        __m512 inv = _mm512_set1_ps(inv_sum[head]);
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + (int64_t)head * dim + d,
                             _mm512_mul_ps(_mm512_loadu_ps(out + (int64_t)head * dim + d), inv));
    }
}

