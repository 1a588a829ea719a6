/*
 * Decode attention over a paged KV cache, reading the blocks in place (CPU).
 *
 * The reference backend copies every decode sequence's blocks into a padded contiguous
 * tensor per layer and step, then attends over the copy: the K/V bytes cross memory three
 * times.  Here each sequence walks its block table once, block by block, with an online
 * softmax (running max and sum per head, as in FlashAttention): each K and V row is read
 * once, converted from 8/16-bit storage to float32 on the fly, and used by all the query
 * heads of its group while it is in L1.
 *
 * Layouts (all contiguous; the fields of paged_decode_args, attention.h):
 *   query, out     [num_seqs, num_kv_heads * group, head_dim] float32;
 *                  query head i attends with KV head i / group (as SDPA's enable_gqa)
 *   key, value     [num_blocks, block_size, num_kv_heads, head_dim] in the storage dtype
 *   key/val scale  [num_blocks, block_size, num_kv_heads] float32 or NULL
 *   block_tables   [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (keys to attend)
 *   lut            256 floats for the fp8 formats (byte -> value), else NULL
 *   lse            [num_seqs, num_kv_heads * group] float32 or NULL: each head's log-sum-exp
 *                  of its scaled scores, to merge this part of the keys with another
 *                  (attention/shared_prefix.py)
 *   sliding_window 0, or W > 0: a sequence of seq_len keys attends those at positions
 *                  max(0, seq_len - W) .. seq_len - 1 alone.  Its table's entries for the
 *                  blocks wholly before them may hold any block id (a window's KV group frees
 *                  those blocks): they are never read, not even prefetched (window_start)
 *
 * One path per instruction set, each in a part of its own, included here in this order (one
 * translation unit, so that the compiler inlines across them):
 *   decode_generic.h      any CPU: rows widened to float32, AVX2 + FMA where built for it
 *   decode_avx512bf16.h   AVX512-BF16: bf16 dot products, two passes (attend_sequence_fast)
 *   decode_amx.h          AMX: the scores on tiles (attend_sequence_amx), on the above's helpers
 * This file: the entry point, the sequences' scheduling and what every path shares (storing
 * the step's new rows, merging a shared prefix's attention).
 *
 * Built by kvserve/native/build.py with gcc -O3 -march=native -fopenmp; the OpenMP runtime is
 * the one torch already loaded (same soname), so the kernel shares its threads.
 */
#define _GNU_SOURCE /* syscall(), for amx_tiles.h on AMX builds */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "common/kinds.h"

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "common/vec_exp.h"

#include "decode_generic.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define HAVE_BF16_DOT 1
#include "decode_avx512bf16.h"
#else
#define HAVE_BF16_DOT 0
#endif

#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define DECODE_HAS_AMX 1
#include "decode_amx.h"
#else
#define DECODE_HAS_AMX 0
int paged_decode_use_amx(int on) { (void)on; return 0; }
#endif

typedef struct {
    const void *key, *value; /* [num_seqs] rows of row_bytes, *_stride_bytes apart */
    int64_t key_stride_bytes, value_stride_bytes;
    const int64_t *slots;
    int64_t row_bytes;
} new_rows;

/* Bytes of one head's row of dim values in the storage of `kind`. */
static int64_t head_row_bytes(int kind, int dim) {
    if (kind == KV_I4) return dim / 2;
    return (int64_t)dim * (kind == KV_F32 ? 4 : (kind == KV_BF16 || kind == KV_F16) ? 2 : 1);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch (no NaNs here) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Store sequence `seq`'s new K and V rows (this step's token, [kv_heads, dim] each, in the
 * cache's own dtype) into their slot.  Done by the thread that attends the sequence, just
 * before it reads that block: the store's cache line is then one the attention loads anyway,
 * where a separate store pass over the batch (kv_copy_store) missed on 2 x 128 cold lines a
 * layer and cost ~0.11 ms of a 128-sequence decode layer. */
static inline void store_new_rows(const new_rows *rows, int seq, void *key, void *value) {
    const int64_t slot = rows->slots[seq];
    memcpy((char *)key + slot * rows->row_bytes,
           (const char *)rows->key + seq * rows->key_stride_bytes, (size_t)rows->row_bytes);
    memcpy((char *)value + slot * rows->row_bytes,
           (const char *)rows->value + seq * rows->value_stride_bytes, (size_t)rows->row_bytes);
}

/* out (one sequence's heads x dim, attended over its keys, with log-sum-exps lse) merged with
 * the attention over other keys (prior, prior_lse): each head's share of the whole softmax
 * mass is sigmoid(lse - prior_lse), as shared_prefix.merge computes it.  In the thread that
 * attended the sequence, on its output still in L1; the merge in torch read and wrote both
 * [B, H, D] float32 tensors again (~1.2 ms of W3's 62 ms decode step). */
static void merge_prior(float *out, const float *prior, const float *prior_lse, const float *lse,
                        int num_heads, int dim) {
    for (int head = 0; head < num_heads; head++) {
        const float share = 1.0f / (1.0f + expf(prior_lse[head] - lse[head]));
        for (int d = 0; d < dim; d++) {
            const int64_t i = (int64_t)head * dim + d;
            out[i] = prior[i] + share * (out[i] - prior[i]);
        }
    }
}

/* Where a sequence's attended keys start under a sliding window: its table past the blocks
 * wholly before the window (*table advanced, *len the keys from the first block it keeps),
 * and the rows of that first block before the window (0 without one, or where the window
 * starts on a block boundary).  The fast paths take the sequences with no such rows; a
 * window that starts inside a block takes attend_sequence, which skips them. */
static inline int window_start(int window, int block_size, const int64_t **table, int64_t *len) {
    if (window <= 0 || *len <= window) return 0;
    const int64_t first = *len - window, blocks = first / block_size;
    *table += blocks;
    *len -= blocks * block_size;
    return (int)(first - blocks * block_size);
}

/* Dynamic scheduling by hand, in shrinking chunks (as schedule(guided)): a thread takes a
 * quarter of its share of what is left at once, down to one sequence at the end.  One atomic
 * add a sequence moved the counter's cache line between the cores 128 times a layer: ~1/6 of
 * a one-token decode of 128 sequences (perf), ~8 us a thread. */
typedef struct {
    int *next;          /* the first sequence nobody has taken */
    int count, at, end; /* this thread's chunk: [at, end) */
} sequence_share;

static int take_sequence(sequence_share *s) {
    if (s->at < s->end) return s->at++;
    const int left = s->count - __atomic_load_n(s->next, __ATOMIC_RELAXED);
    const int threads = omp_get_num_threads();
    int chunk = left / (4 * threads);
    if (chunk < 1) chunk = 1;
    const int start = __atomic_fetch_add(s->next, chunk, __ATOMIC_RELAXED);
    if (start >= s->count) return s->count;
    s->end = start + chunk < s->count ? start + chunk : s->count;
    s->at = start + 1;
    return start;
}

/* query and out are [num_seqs, num_heads, dim]: float32, or bfloat16 when io_bf16 (a bf16
 * model's decode: each sequence's q is widened and its output rounded here, in the thread
 * that attends it, instead of two conversions of the whole batch per layer in torch).
 * new_key/new_value, when not NULL: each sequence's new token's K/V rows (row i at byte
 * i * new_*_stride_bytes, kv_heads x dim values of the cache's dtype), stored at new_slots[i]
 * before the sequence is attended.
 * prior_out/prior_lse, when not NULL: attention over other keys ([num_seqs, heads, dim] and
 * [num_seqs, heads] float32: a shared prefix's, shared_prefix.py), merged into each
 * sequence's output by the log-sum-exps (lse is then not written). */
int paged_decode_attention(const paged_decode_args *args) {
    /* The arguments under the names (and types) they had as parameters. */
    const void *query = args->query;
    void *out = args->out, *key = args->key, *value = args->value;
    const float *key_scale = args->key_scale, *value_scale = args->value_scale;
    const float *lut = args->lut;
    int kind = args->kind, value_kind = args->value_kind;
    const int64_t *block_tables = args->block_tables, *seq_lens = args->seq_lens;
    int num_seqs = args->num_seqs, max_blocks = args->max_blocks;
    int num_kv_heads = args->num_kv_heads, group = args->group, dim = args->dim;
    int block_size = args->block_size, num_threads = args->num_threads;
    float sm_scale = args->sm_scale;
    float *lse = args->lse;
    int io_bf16 = args->io_bf16, window = args->sliding_window;
    const void *new_key = args->new_key, *new_value = args->new_value;
    int64_t new_key_stride_bytes = args->new_key_stride_bytes;
    int64_t new_value_stride_bytes = args->new_value_stride_bytes;
    const int64_t *new_slots = args->new_slots;
    const float *prior_out = args->prior_out, *prior_lse = args->prior_lse;
    const new_rows rows = {new_key, new_value, new_key_stride_bytes, new_value_stride_bytes,
                           new_slots,
                           (int64_t)num_kv_heads * head_row_bytes(kind, dim)};
    const int num_heads = num_kv_heads * group;
    const int64_t row_floats = (int64_t)num_heads * dim;
    /* general path: 2 * heads + group * block_size + 2 * block_size * dim; fast path:
     * 16 * group + 8 * dim (16 rows of bf16) + heads * round_up(longest, 16) scores */
    int64_t longest = 0;
    for (int seq = 0; seq < num_seqs; seq++) longest = seq_lens[seq] > longest ? seq_lens[seq] : longest;
    size_t general = (size_t)2 * num_heads + (size_t)group * block_size + (size_t)2 * block_size * dim;
    size_t fast_work = (size_t)16 * group + (size_t)8 * dim + (size_t)num_heads * ((longest + 15) / 16 * 16);
    size_t work_floats = general > fast_work ? general : fast_work;
#if HAVE_BF16_DOT
    const int fast = (kind == KV_BF16 || kind == KV_I8 || kind == KV_E4M3 || kind == KV_E5M2)
                     && value_kind == kind && fast_dim(dim);
#endif
#if DECODE_HAS_AMX
    const int amx = fast && block_size <= 32 && amx_shape(kind, num_heads, dim, block_size);
    const size_t amx_floats = amx ? amx_work_floats(longest, num_kv_heads, dim) : 0;
    if (amx_floats > work_floats) work_floats = amx_floats;
#endif
    work_floats += io_bf16 ? 2 * (size_t)row_floats : 0;
    int failed = 0, next_seq = 0;
    /* No more threads than sequences: a thread takes whole sequences, so the others would
     * find none, yet the region would wait for each of them to wake and join.  One sequence
     * (one user at a time) runs on the calling thread alone, with no team: on a 2-core CPU
     * whose other core was busy, the second thread's wake-up and the join took 7.7 ms a call
     * against ~0.1 ms of attention (docs/decisions/decode-one-row-team.md). */
    const int team = num_threads < num_seqs ? num_threads : num_seqs > 1 ? num_seqs : 1;
    #pragma omp parallel num_threads(team) if(team > 1)
    {
        float *work = malloc(sizeof(float) * work_floats);
        if (!work) {
            #pragma omp atomic write
            failed = 1;
        }
        /* io_bf16: this sequence's q and output as float32, after the kernel's own work */
        float *q_row = work ? work + work_floats - 2 * row_floats : NULL;
        float *out_row = work ? q_row + row_floats : NULL;
        float own_lse[num_heads]; /* with prior_out: this sequence's log-sum-exps */
        /* Dynamic scheduling by hand (take_sequence), so that a thread knows the sequence
         * it takes next while it attends this one, and prefetches its first blocks. */
        sequence_share share = {&next_seq, num_seqs, 0, 0};
        int seq = work ? take_sequence(&share) : num_seqs;
#if DECODE_HAS_AMX
        if (amx) amx_configure_tiles();
#endif
        while (seq < num_seqs) {
            int following = take_sequence(&share);
            int64_t head0 = (int64_t)seq * row_floats;
            const float *q;
            float *o;
            if (io_bf16) {
                for (int64_t i = 0; i < row_floats; i++)
                    q_row[i] = bf16_to_float(((const uint16_t *)query)[head0 + i]);
                q = q_row;
                o = out_row;
            } else {
                q = (const float *)query + head0;
                o = (float *)out + head0;
            }
            float *seq_lse = prior_out ? own_lse : lse ? lse + (int64_t)seq * num_heads : NULL;
            if (new_key) store_new_rows(&rows, seq, key, value);
            const int64_t *table = block_tables + (int64_t)seq * max_blocks;
            int64_t seq_len = seq_lens[seq];
            const int skip = window_start(window, block_size, &table, &seq_len);
#if HAVE_BF16_DOT
            if (fast && skip == 0 && is_bf16_exact(q, num_heads * dim)) {
                next_sequence next = {NULL, 0, 0};
                if (following < num_seqs) {
                    const int64_t *next_table = block_tables + (int64_t)following * max_blocks;
                    int64_t next_len = seq_lens[following];
                    window_start(window, block_size, &next_table, &next_len);
                    next = next_sequence_of(next_table, next_len, block_size, rows.row_bytes);
                }
#if DECODE_HAS_AMX
                if (amx)
                    attend_sequence_amx(q, o, key, value, key_scale, value_scale, kind, table,
                                        seq_len, num_kv_heads, group, dim, block_size, sm_scale,
                                        work, seq_lse, next);
                else
#endif
                attend_sequence_fast(q, o, key, value, key_scale, value_scale, kind, table,
                                     seq_len, num_kv_heads, group, dim, block_size, sm_scale,
                                     work, seq_lse, next);
            } else
#endif
                attend_sequence(q, o, key, value, key_scale, value_scale, lut, kind, value_kind,
                                head_row_bytes(kind, dim), head_row_bytes(value_kind, dim), table,
                                seq_len, skip, num_kv_heads, group, dim, block_size, sm_scale,
                                work, seq_lse, args->key_sink);
            if (prior_out)
                merge_prior(o, prior_out + head0, prior_lse + (int64_t)seq * num_heads, own_lse,
                            num_heads, dim);
            if (io_bf16)
                for (int64_t i = 0; i < row_floats; i++)
                    ((uint16_t *)out)[head0 + i] = float_to_bf16(out_row[i]);
            seq = following;
        }
#if DECODE_HAS_AMX
        if (amx) _tile_release();
#endif
        free(work);
    }
    return failed;
}
