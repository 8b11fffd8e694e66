/* Decode attention that reads a paged KV cache in place (no gather of K/V blocks).
 *
 * Layout (hybridkv/engine/attention.py): cache [num_blocks, 2, block_size, kv_heads, head_dim],
 * K at [b, 0], V at [b, 1]; a row r has one query token of `heads` heads and reads key slots
 * [key_lo[r], key_hi[r]) of its blocks block_ids[r, 0..B): slot j is offset j % block_size of
 * block block_ids[r, j / block_size]. The query heads h = kvh * groups + g share KV head kvh.
 *
 *     s_j = softcap ? softcap * tanh(scale * q.k_j / softcap) : scale * q.k_j
 *     out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + (sinks ? exp(sink_h - m) : 0))
 *
 * with m the max of the scores (and the sink). Work item = one row: it reads its K and V slots in
 * order (a block's slots are one contiguous run). Rows run on `threads` OpenMP threads, dealt round
 * robin (the runner orders decodes by length: contiguous ranges would give one thread the long rows).
 */
#include <float.h>
#include <stdlib.h>

#include "vec.h"

#define MAX_HEADS 256

/* ask for the n floats at p while this block computes (blocks are scattered: no hardware stream) */
static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

/* o[0..n) += sum_s p[s] * v[s * stride + 0..n), 64 floats of o at a time held in registers */
static inline void accumulate(float *restrict o, const float *restrict p, const float *restrict v, int64_t slots,
                              int64_t stride, int64_t n) {
    int64_t d = 0;
    for (; n % 64 == 0 && d < n; d += 64) {
        v8 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = load8(o + d + 8 * i);
        for (int64_t s = 0; s < slots; ++s) {
            const float *vs = v + s * stride + d;
            for (int i = 0; i < 8; ++i) acc[i] += p[s] * load8(vs + 8 * i);
        }
        memcpy(o + d, acc, sizeof acc);
    }
    for (; d < n; ++d)
        for (int64_t s = 0; s < slots; ++s) o[d] += p[s] * v[s * stride + d];
}

static void attend_row(const float *restrict q, const float *restrict cache, const int64_t *restrict ids,
                       int64_t lo, int64_t hi, float *restrict out, float *restrict scores, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                       const float *restrict sinks) {
    const int64_t groups = heads / kv_heads;
    const int64_t token_stride = kv_heads * head_dim;      /* one slot of a block's K (or V) */
    const int64_t kv_stride = block_size * token_stride;    /* K of a block -> its V */
    const int64_t n = hi - lo;
    float total[MAX_HEADS];
    /* block by block: a block's K (and V) slots are one contiguous run */
    for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t j0 = b * block_size > lo ? b * block_size : lo;
        const int64_t j1 = (b + 1) * block_size < hi ? (b + 1) * block_size : hi;
        const float *k = cache + ids[b] * 2 * kv_stride + (j0 - b * block_size) * token_stride;
        if ((b + 1) * block_size < hi) prefetch(cache + ids[b + 1] * 2 * kv_stride, kv_stride);
        for (int64_t j = j0; j < j1; ++j, k += token_stride)
            for (int64_t h = 0; h < heads; ++h)
                scores[h * n + (j - lo)] = dot(q + h * head_dim, k + (h / groups) * head_dim, head_dim) * scale;
    }
    for (int64_t h = 0; h < heads; ++h) {
        float *sh = scores + h * n, mh = sinks ? sinks[h] : -FLT_MAX;
        if (softcap > 0.0f) /* softcap tanh(s / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1) */
            for (int64_t j = 0; j < n; ++j) sh[j] = softcap * (1.0f - 2.0f / (exp_f32(2.0f * sh[j] / softcap) + 1.0f));
        for (int64_t j = 0; j < n; ++j) mh = sh[j] > mh ? sh[j] : mh;
        float sum = sinks ? exp_f32(sinks[h] - mh) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            sh[j] = exp_f32(sh[j] - mh);
            sum += sh[j];
        }
        total[h] = sum;
    }
    memset(out, 0, (size_t)(heads * head_dim) * sizeof(float));
    for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t j0 = b * block_size > lo ? b * block_size : lo;
        const int64_t j1 = (b + 1) * block_size < hi ? (b + 1) * block_size : hi;
        const float *v = cache + (ids[b] * 2 + 1) * kv_stride + (j0 - b * block_size) * token_stride;
        if ((b + 1) * block_size < hi) prefetch(cache + (ids[b + 1] * 2 + 1) * kv_stride, kv_stride);
        for (int64_t h = 0; h < heads; ++h)
            accumulate(out + h * head_dim, scores + h * n + (j0 - lo), v + (h / groups) * head_dim, j1 - j0,
                       token_stride, head_dim);
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / total[h];
        float *o = out + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    }
}

/* Returns 0 on success, 1 when a work buffer cannot be allocated, 2 when heads > MAX_HEADS. */
int paged_decode_f32(const float *q, const float *cache, const int64_t *block_ids, const int64_t *key_lo,
                     const int64_t *key_hi, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t blocks_per_row, float scale,
                     float softcap, const float *sinks, int threads) {
    if (heads > MAX_HEADS) return 2;
    int64_t widest = 1;
    for (int64_t r = 0; r < rows; ++r)
        if (key_hi[r] - key_lo[r] > widest) widest = key_hi[r] - key_lo[r];
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(heads * widest) * sizeof(float));
#pragma omp for schedule(static, 1)
        for (int64_t r = 0; r < rows; ++r) {
            if (!scores) {
                failed = 1;
                continue;
            }
            attend_row(q + r * heads * head_dim, cache, block_ids + r * blocks_per_row, key_lo[r], key_hi[r],
                       out + r * heads * head_dim, scores, heads, kv_heads, head_dim, block_size, scale, softcap,
                       sinks);
        }
        free(scores);
    }
    return failed;
}
