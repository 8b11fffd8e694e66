/* The recurrences of the state mixers, token by token, on the paged state in place.
 *
 * Both kernels take the step's sequences as one plan: row i of plan [S, 5] int64 is
 * (first token, tokens, running block, first checkpoint, end of its checkpoints); checkpoint j of
 * checkpoints [K, 2] is (tokens into the sequence, block). A sequence's state lives in its running
 * block (the engine has copied or zeroed it before the step) and is advanced there in place; after
 * the first `offset` tokens of each checkpoint the head's state is also copied to that block.
 * Decodes are sequences of one token. Work items are (sequence, head) pairs, dealt to OpenMP threads.
 *
 * A head's state (Gated DeltaNet [Dv, Dk], Mamba2 [P, N]; 4-16 KiB for the models here) stays in
 * L1 across the tokens: one read and one write of each state element per token, where the chunked
 * torch scans run ~100 small ops per segment.
 *
 * Gated DeltaNet, value head h over key head h / (H / Hk), per token (q, k L2-normalised, q scaled):
 *     S = exp(g) S;  S += beta (v - S k) k^T;  o = S q          (row by row: S_i is one row of Dk)
 * Mamba2, head h of group h / (H / G), per token (dt after softplus and clamp, A = -exp(A_log)):
 *     S = exp(dt A) S + dt x B^T;  y = S C + D x                (row by row: S_p is one row of N)
 */
#include <stdlib.h>

#include "vec.h"

#define PLAN_FIELDS 5

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

static void gdn_head(const float *q, const float *k, int64_t qk_stride, const float *v, int64_t v_stride,
                     const float *g, const float *beta, int64_t heads, int64_t head, float *restrict s,
                     int64_t dv, int64_t dk, float *out, int64_t out_stride, int64_t tokens) {
    for (int64_t t = 0; t < tokens; ++t) {
        const float *restrict qt = q + t * qk_stride, *restrict kt = k + t * qk_stride;
        const float *restrict vt = v + t * v_stride;
        float *restrict ot = out + t * out_stride;
        const float decay = exp_f32(g[t * heads + head]), b = beta[t * heads + head];
        for (int64_t i = 0; i < dv; ++i) {
            float *restrict row = s + i * dk;
            float sk = 0.0f;
            for (int64_t j = 0; j < dk; ++j) {
                row[j] *= decay;
                sk += row[j] * kt[j];
            }
            const float delta = b * (vt[i] - sk);
            float o = 0.0f;
            for (int64_t j = 0; j < dk; ++j) {
                row[j] += delta * kt[j];
                o += row[j] * qt[j];
            }
            ot[i] = o;
        }
    }
}

/* q, k: token t, key head kh at q + t * qk_stride + kh * dk; v: t, head h at v + t * v_stride + h * dv;
 * g, beta [T, H]; state: block b, head h at state + b * block_stride + h * dv * dk; out [T, H, Dv]. */
void gdn_scan_f32(const float *q, const float *k, int64_t qk_stride, const float *v, int64_t v_stride,
                  const float *g, const float *beta, float *state, int64_t block_stride, const int64_t *plan,
                  int64_t sequences, const int64_t *checkpoints, int64_t heads, int64_t key_heads, int64_t dv,
                  int64_t dk, float *out, int threads) {
    const int64_t r = heads / key_heads, size = dv * dk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (sequences * heads > 1)
    for (int64_t item = 0; item < sequences * heads; ++item) {
        const int64_t *row = plan + (item / heads) * PLAN_FIELDS, h = item % heads;
        const int64_t first = row[0], tokens = row[1];
        float *s = state + row[2] * block_stride + h * size;
        const int64_t qk = first * qk_stride + (h / r) * dk;
        int64_t done = 0;
        for (int64_t c = row[3]; c <= row[4]; ++c) {  /* each checkpoint, then the end (c == row[4]) */
            const int64_t until = c < row[4] ? checkpoints[2 * c] : tokens;
            const int64_t t = first + done;
            gdn_head(q + qk + done * qk_stride, k + qk + done * qk_stride, qk_stride,
                     v + t * v_stride + h * dv, v_stride, g + t * heads, beta + t * heads, heads, h, s, dv, dk,
                     out + (t * heads + h) * dv, heads * dv, until - done);
            if (c < row[4]) memcpy(state + checkpoints[2 * c + 1] * block_stride + h * size, s, size * sizeof *s);
            done = until;
        }
    }
}

static void mamba2_head(const float *x, int64_t x_stride, const float *b, const float *c, int64_t bc_stride,
                        const float *dt,
                        int64_t heads, int64_t head, float a, float skip, float *restrict s, int64_t p, int64_t n,
                        float *out, int64_t out_stride, int64_t tokens) {
    for (int64_t t = 0; t < tokens; ++t) {
        const float *restrict xt = x + t * x_stride, *restrict bt = b + t * bc_stride, *restrict ct = c + t * bc_stride;
        float *restrict ot = out + t * out_stride;
        const float step = dt[t * heads + head], decay = exp_f32(step * a);
        for (int64_t i = 0; i < p; ++i) {
            float *restrict row = s + i * n;
            const float input = step * xt[i];
            for (int64_t j = 0; j < n; ++j) row[j] = row[j] * decay + input * bt[j];
            ot[i] = dot(row, ct, n) + skip * xt[i];
        }
    }
}

/* x: token t, head h at x + t * x_stride + h * p; b, c: t, group gi at b + t * bc_stride + gi * n;
 * dt [T, H]; a, d [H]; state: block b, head h at state + b * block_stride + h * p * n; out [T, H, P]. */
void mamba2_scan_f32(const float *x, int64_t x_stride, const float *b, const float *c, int64_t bc_stride,
                     const float *dt,
                     const float *a, const float *d, float *state, int64_t block_stride, const int64_t *plan,
                     int64_t sequences, const int64_t *checkpoints, int64_t heads, int64_t groups, int64_t p,
                     int64_t n, float *out, int threads) {
    const int64_t r = heads / groups, size = p * n;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (sequences * heads > 1)
    for (int64_t item = 0; item < sequences * heads; ++item) {
        const int64_t *row = plan + (item / heads) * PLAN_FIELDS, h = item % heads;
        const int64_t first = row[0], tokens = row[1];
        float *s = state + row[2] * block_stride + h * size;
        const int64_t bc = (h / r) * n;
        int64_t done = 0;
        for (int64_t k = row[3]; k <= row[4]; ++k) {
            const int64_t until = k < row[4] ? checkpoints[2 * k] : tokens;
            const int64_t t = first + done;
            mamba2_head(x + t * x_stride + h * p, x_stride, b + t * bc_stride + bc, c + t * bc_stride + bc, bc_stride,
                        dt + t * heads,
                        heads, h, a[h], d[h], s, p, n, out + (t * heads + h) * p, heads * p, until - done);
            if (k < row[4]) memcpy(state + checkpoints[2 * k + 1] * block_stride + h * size, s, size * sizeof *s);
            done = until;
        }
    }
}
