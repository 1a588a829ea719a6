/*
 * The sampler's passes over a step's probabilities (CPU), one row at a time, without sorting
 * the vocabulary or drawing a random number per entry.
 *
 * top_p_thresholds: the nucleus is the shortest run of most likely tokens whose mass reaches
 * top_p: sorted descending, token j is kept while the mass before it is below top_p.  torch's
 * sort of [128, 49,152] float32 rows took 277 ms on two cores, more than the decode step it
 * sampled for; here each row finds the probability of its last kept token by selection
 * (quickselect on mass): partition around a pivot, keep the part above it whole when its mass
 * does not reach what is still needed, else look only inside it.  Expected ~2 passes a row.
 *
 *   probs       [rows, cols] float32, row r at probs + r * row_stride
 *   top_p       [rows] float32; a row with top_p >= 1 keeps everything (threshold 0)
 *   within      [rows] float32 or NULL: look only among the probabilities >= within[r] (the
 *               top-k floor; top_p is then top_p x their mass): one pass over the row
 *               instead of a copy and ~2 passes, 2 ms of [128, 49,152] rows
 *   threshold   [rows] float32 out: keep the tokens whose probability is >= it (every token
 *               tied with the last kept one is kept: a sort would keep an arbitrary few)
 *
 * top_k_floors: each row's floor for top-k, the k-th largest probability (every token tied
 * with it kept, as when masking the logits below the k-th), and the mass at or above it, which
 * top-p's target is scaled by: top-p applies to the top-k tokens renormalized, and a nucleus of
 * mass top_p x that among the whole row's probabilities is the same run of tokens.  Found by
 * quickselect on counts, as top_p_thresholds on mass; where torch's `topk` and a masking of the
 * logits took ~10 ms at [128, 49,152] on two cores.
 *
 *   top_k       [rows] int64; a row with top_k >= cols keeps everything (floor 0, mass 1)
 *   floor, kept [rows] float32 out
 *
 * draw_rows: one draw a row by inverting its cumulative distribution: the token whose
 * interval of the running sum (double) holds u x the row's mass, counting the probabilities
 * below the row's floor (top-p's threshold, min-p's) as 0, so a filtered token, whose interval
 * is empty, is never drawn.  Two passes over the row (sums of 16, then the one chunk the draw
 * falls in), where torch's float64 copy, cumulative sum and search took ~8 ms a step.
 *
 *   floor       [rows] float32 or NULL (no floor)
 *   uniforms    [rows] float64 in [0, 1)
 *   out         [rows] int64
 * All three return 0, or 2 when out of memory for their scratch rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


/* Which values keep_side keeps: those above the pivot, below it, or at least it. */
typedef enum { ABOVE, BELOW, AT_LEAST } side;

#ifdef __AVX512F__
#include <immintrin.h>

/* Masses (double sums) and counts of x[0:n)'s values above and equal to pivot, 16 at a time. */
static void weigh(const float *x, int64_t n, float pivot, int64_t *above, int64_t *equal,
                  double *mass_above, double *mass_equal) {
    const __m512 p = _mm512_set1_ps(pivot);
    __m512d sum_gt = _mm512_setzero_pd(), sum_eq = _mm512_setzero_pd();
    int64_t gt = 0, eq = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
        const __mmask16 g = _mm512_mask_cmp_ps_mask(live, v, p, _CMP_GT_OQ);
        const __mmask16 e = _mm512_mask_cmp_ps_mask(live, v, p, _CMP_EQ_OQ);
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        const __m512d hi = _mm512_cvtps_pd(upper);
        sum_gt = _mm512_mask_add_pd(sum_gt, (__mmask8)g, sum_gt, lo);
        sum_gt = _mm512_mask_add_pd(sum_gt, (__mmask8)(g >> 8), sum_gt, hi);
        sum_eq = _mm512_mask_add_pd(sum_eq, (__mmask8)e, sum_eq, lo);
        sum_eq = _mm512_mask_add_pd(sum_eq, (__mmask8)(e >> 8), sum_eq, hi);
        gt += __builtin_popcount(g);
        eq += __builtin_popcount(e);
    }
    *above = gt, *equal = eq;
    *mass_above = _mm512_reduce_add_pd(sum_gt), *mass_equal = _mm512_reduce_add_pd(sum_eq);
}

/* Copies src[0:n)'s values on one side of pivot to dst, in order; returns how many.  dst may
 * be src (out <= i).  Each chunk is compressed in a register and stored whole (16 values at
 * dst + out: up to 15 past the count, which the caller's buffer has room for): a compressing
 * store to memory is microcoded on AMD Zen 4, and took ~5x longer. */
static int64_t keep_side(const float *src, float *dst, int64_t n, float pivot, side keep_if) {
    const __m512 p = _mm512_set1_ps(pivot);
    int64_t out = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(live, src + i);
        const __mmask16 keep =
            keep_if == ABOVE   ? _mm512_mask_cmp_ps_mask(live, v, p, _CMP_GT_OQ)
            : keep_if == BELOW ? _mm512_mask_cmp_ps_mask(live, v, p, _CMP_LT_OQ)
                               : _mm512_mask_cmp_ps_mask(live, v, p, _CMP_GE_OQ);
        _mm512_storeu_ps(dst + out, _mm512_maskz_compress_ps(keep, v));
        out += __builtin_popcount(keep);
    }
    return out;
}
#else
static void weigh(const float *x, int64_t n, float pivot, int64_t *above, int64_t *equal,
                  double *mass_above, double *mass_equal) {
    int64_t gt = 0, eq = 0;
    double sum_gt = 0.0, sum_eq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] > pivot) gt++, sum_gt += x[i];
        else if (x[i] == pivot) eq++, sum_eq += x[i];
    }
    *above = gt, *equal = eq, *mass_above = sum_gt, *mass_equal = sum_eq;
}

static int64_t keep_side(const float *src, float *dst, int64_t n, float pivot, side keep_if) {
    int64_t out = 0;
    for (int64_t i = 0; i < n; i++)
        if (keep_if == ABOVE ? src[i] > pivot : keep_if == BELOW ? src[i] < pivot : src[i] >= pivot)
            dst[out++] = src[i];
    return out;
}
#endif

/* The probability of the last token the nucleus keeps: quickselect on mass over x[0:n), each
 * level one pass to weigh the values around a random pivot and one to keep the side the
 * nucleus ends in. */
static float nucleus_threshold(float *x, int64_t n, double top_p, uint64_t *rng) {
    double needed = top_p; /* mass still to reach after the values kept whole */
    float smallest_kept = 0.0f;
    while (n > 0) {
        *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
        const float pivot = x[(*rng >> 33) % (uint64_t)n];
        int64_t above, equal;
        double mass_above, mass_equal;
        weigh(x, n, pivot, &above, &equal, &mass_above, &mass_equal);
        if (equal == 0) return 0.0f; /* a NaN pivot (a failed forward): keep the row whole */
        if (above > 0 && mass_above >= needed) { /* the nucleus ends above the pivot */
            n = keep_side(x, x, n, pivot, ABOVE);
            continue;
        }
        if (mass_above + mass_equal >= needed) return pivot; /* it ends among the pivot's ties */
        needed -= mass_above + mass_equal; /* keep all down to the pivot, look below it */
        smallest_kept = pivot;
        n = keep_side(x, x, n, pivot, BELOW);
    }
    return smallest_kept; /* the row's mass fell short of top_p (rounding): keep it all */
}

/* The selections' rows, what each needs, and where its answers go. */
typedef struct {
    const float *probs;
    int64_t cols, row_stride;
    const float *top_p;   /* top_p_thresholds */
    const float *within;  /* top_p_thresholds, or NULL */
    const int64_t *top_k; /* top_k_floors */
    float *out, *kept;
} selection;

typedef void (*select_row)(const selection *s, int64_t r, float *scratch, uint64_t *rng);

/* select(s, r, ...) for every row on the thread team: each thread with its own scratch row
 * (room for keep_side's whole-vector stores past the end) and pivot generator; 2 when out
 * of memory. */
static int select_rows(const selection *s, int64_t rows, int num_threads, select_row select) {
    int failed = 0;
    #pragma omp parallel num_threads(rows >= 4 ? num_threads : 1)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(s->cols + 16));
        uint64_t rng = 0x9E3779B97F4A7C15ULL;
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++)
            if (scratch) select(s, r, scratch, &rng);
        free(scratch);
    }
    return failed ? 2 : 0;
}

static float *row_copy(const selection *s, int64_t r, float *scratch) {
    return memcpy(scratch, s->probs + r * s->row_stride, sizeof(float) * (size_t)s->cols);
}

static void nucleus_row(const selection *s, int64_t r, float *scratch, uint64_t *rng) {
    if (!(s->top_p[r] < 1.0f)) {
        s->out[r] = 0.0f;
        return;
    }
    const float least = s->within ? s->within[r] : 0.0f;
    int64_t n = s->cols;
    if (least > 0.0f) /* only the top-k tokens can be in the nucleus */
        n = keep_side(s->probs + r * s->row_stride, scratch, s->cols, least, AT_LEAST);
    else
        row_copy(s, r, scratch);
    s->out[r] = nucleus_threshold(scratch, n, s->top_p[r], rng);
}

int top_p_thresholds(const float *probs, int64_t rows, int64_t cols, int64_t row_stride,
                     const float *top_p, const float *within, float *threshold,
                     int num_threads) {
    const selection s = {probs, cols, row_stride, top_p, within, NULL, threshold, NULL};
    return select_rows(&s, rows, num_threads, nucleus_row);
}

/* x[0:n)'s k-th largest value (1 <= k <= n), the mass of the values at or above it in *kept:
 * quickselect on counts, each level one pass to weigh around a random pivot and one to keep
 * the side the k-th value is in. */
static float kth_largest(float *x, int64_t n, int64_t k, double *kept, uint64_t *rng) {
    double mass = 0.0; /* of the values kept whole, above what is still searched */
    while (n > 0) {
        *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
        const float pivot = x[(*rng >> 33) % (uint64_t)n];
        int64_t above, equal;
        double mass_above, mass_equal;
        weigh(x, n, pivot, &above, &equal, &mass_above, &mass_equal);
        if (equal == 0) break; /* a NaN pivot (a failed forward) */
        if (above >= k) { /* the k-th value is above the pivot */
            n = keep_side(x, x, n, pivot, ABOVE);
            continue;
        }
        if (above + equal >= k) { /* it is the pivot */
            *kept = mass + mass_above + mass_equal;
            return pivot;
        }
        k -= above + equal;
        mass += mass_above + mass_equal;
        n = keep_side(x, x, n, pivot, BELOW);
    }
    *kept = 1.0; /* NaNs took the place of values: keep the row whole */
    return 0.0f;
}

static void top_k_row(const selection *s, int64_t r, float *scratch, uint64_t *rng) {
    double mass = 1.0;
    s->out[r] = 0.0f;
    if (s->top_k[r] >= 1 && s->top_k[r] < s->cols)
        s->out[r] = kth_largest(row_copy(s, r, scratch), s->cols, s->top_k[r], &mass, rng);
    s->kept[r] = (float)mass;
}

int top_k_floors(const float *probs, int64_t rows, int64_t cols, int64_t row_stride,
                 const int64_t *top_k, float *floor, float *kept, int num_threads) {
    const selection s = {probs, cols, row_stride, NULL, NULL, top_k, floor, kept};
    return select_rows(&s, rows, num_threads, top_k_row);
}

/* Sums of the row's chunks of 16 (double), values below floor counted as 0; returns the
 * row's mass.  The draw walks these same sums, so it and the mass agree. */
static double chunk_sums(const float *x, int64_t n, float floor, double *sums) {
    double total = 0.0;
    for (int64_t c = 0; c * 16 < n; c++) {
        double sum = 0.0;
        const int64_t end = (c + 1) * 16 < n ? (c + 1) * 16 : n;
        for (int64_t i = c * 16; i < end; i++) sum += x[i] >= floor ? (double)x[i] : 0.0;
        sums[c] = sum;
        total += sum;
    }
    return total;
}

/* The token of x[0:n) (values below floor as 0) whose running-sum interval holds u x mass. */
static int64_t draw_row(const float *x, int64_t n, float floor, double u, double *sums) {
    const double total = chunk_sums(x, n, floor, sums);
    if (!(total > 0.0)) return 0; /* NaNs or nothing left (a failed forward) */
    const double target = u * total < total ? u * total : nextafter(total, 0.0);
    double before = 0.0; /* the mass of the chunks before `last` */
    int64_t last = -1;    /* the chunk the draw falls in, or the last with mass (rounding) */
    for (int64_t c = 0; c * 16 < n; c++) {
        if (sums[c] <= 0.0) continue;
        if (last >= 0) before += sums[last];
        last = c;
        if (before + sums[c] > target) break;
    }
    if (last < 0) return 0;
    const int64_t end = (last + 1) * 16 < n ? (last + 1) * 16 : n;
    int64_t chosen = -1;
    for (int64_t i = last * 16; i < end; i++) {
        if (!(x[i] >= floor) || x[i] <= 0.0f) continue;
        chosen = i;
        before += x[i];
        if (before > target) break;
    }
    return chosen; /* the chunk has mass, so one of its values is positive; past the end (a
                    * rounding), the last of them */
}

int draw_rows(const float *probs, int64_t rows, int64_t cols, int64_t row_stride,
              const float *floor, const double *uniforms, int64_t *out, int num_threads) {
    int failed = 0;
    #pragma omp parallel num_threads(rows >= 4 ? num_threads : 1)
    {
        double *sums = malloc(sizeof(double) * (size_t)((cols + 15) / 16));
        if (!sums) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            out[r] = sums ? draw_row(probs + r * row_stride, cols, floor ? floor[r] : 0.0f,
                                     uniforms[r], sums)
                          : 0;
        free(sums);
    }
    return failed ? 2 : 0;
}
