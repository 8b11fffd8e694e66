/* The recurrences of the state mixers, token by token, on the paged state in place.
 *
 * The kernels take the step's sequences as one plan (`plan.h`): row i of plan [S, 5] int64 is
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
 * Gated DeltaNet, value head h over key head h / (H / Hk), per token (q, k L2-normalised here, q
 * scaled by Dk^-0.5; g and beta from the raw projections here too):
 *     S = exp(g) S;  S += beta (v - S k) k^T;  o = S q          (row by row: S_i is one row of Dk)
 * Mamba2, head h of group h / (H / G), per token (dt = clamp(softplus(dt + dt_bias)) here, A = -exp(A_log)):
 *     S = exp(dt A) S + dt x B^T;  y = S C + D x                (row by row: S_p is one row of N)
 */
#include <stdlib.h>

#include "plan.h"
#include "vec.h"

#define GDN_MAX_DK 512

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(exp_f32(x)); }  /* torch's threshold */

/* The layer's raw inputs of one token and head: q, k L2-normalised (eps 1e-6, as HF's l2norm), q
 * also scaled by Dk^-0.5, into qn, kn; returns the decay exp(g) and sets *beta. */
static inline float gdn_inputs(const float *restrict q, const float *restrict k, int64_t dk, float a, float b,
                               float neg_a, float dt_bias, float *restrict qn, float *restrict kn, float *beta) {
    const float qs = 1.0f / sqrtf(dot(q, q, dk) + 1e-6f) / sqrtf((float)dk), ks = 1.0f / sqrtf(dot(k, k, dk) + 1e-6f);
    for (int64_t j = 0; j < dk; ++j) {
        qn[j] = q[j] * qs;
        kn[j] = k[j] * ks;
    }
    *beta = sigmoid_f32(b);
    return exp_f32(neg_a * softplus(a + dt_bias));
}

/* One token on the state rows: S = decay S + delta k^T with delta_i = beta (v_i - decay S_i.k), and
 * o_i = S_new,i . q = decay S_i.q + delta_i k.q: each row read once for both dots, written once.
 * Inlined with dk a constant where the caller can (the compiler then keeps a row in registers). */
static inline __attribute__((always_inline)) void gdn_rows(float *restrict s, const float *restrict qn,
                                                           const float *restrict kn, const float *restrict vt,
                                                           float *restrict ot, float decay, float beta, int64_t dv,
                                                           const int64_t dk) {
    const float kq = dot(kn, qn, dk);
    for (int64_t i = 0; i < dv; ++i) {
        float *restrict row = s + i * dk;
        float sk, sq;
        if (dk % 8 == 0) {
            v8 ak = {0}, aq = {0};
            for (int64_t j = 0; j < dk; j += 8) {
                const v8 r = load8(row + j);
                ak += r * load8(kn + j);
                aq += r * load8(qn + j);
            }
            sk = hsum8(ak), sq = hsum8(aq);
        } else {
            sk = 0.0f, sq = 0.0f;
            for (int64_t j = 0; j < dk; ++j) sk += row[j] * kn[j], sq += row[j] * qn[j];
        }
        const float delta = beta * (vt[i] - decay * sk);
        ot[i] = decay * sq + delta * kq;
        if (dk % 8 == 0)
            for (int64_t j = 0; j < dk; j += 8) store8(row + j, load8(row + j) * decay + delta * load8(kn + j));
        else
            for (int64_t j = 0; j < dk; ++j) row[j] = row[j] * decay + delta * kn[j];
    }
}

static void gdn_head(const float *conv, int64_t conv_stride, int64_t key_size, int64_t key_head, const float *ab_a,
                     const float *ab_b, int64_t ab_stride, float neg_a, float dt_bias, int64_t head, float *restrict s,
                     int64_t dv, int64_t dk, float *out, int64_t out_stride, int64_t tokens) {
    float qn[GDN_MAX_DK], kn[GDN_MAX_DK];
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row_t = conv + t * conv_stride;
        const float *vt = row_t + 2 * key_size + head * dv;
        float b;
        const float decay = gdn_inputs(row_t + key_head * dk, row_t + key_size + key_head * dk, dk,
                                       ab_a[t * ab_stride], ab_b[t * ab_stride], neg_a, dt_bias, qn, kn, &b);
        float *ot = out + t * out_stride;
        if (dk == 32)
            gdn_rows(s, qn, kn, vt, ot, decay, b, dv, 32);
        else if (dk == 64)
            gdn_rows(s, qn, kn, vt, ot, decay, b, dv, 64);
        else if (dk == 128)
            gdn_rows(s, qn, kn, vt, ot, decay, b, dv, 128);
        else
            gdn_rows(s, qn, kn, vt, ot, decay, b, dv, dk);
    }
}

/* conv [T, 2 Hk Dk + H Dv] (token stride conv_stride): the conv's activated q | k | v channels; token
 * t, key head kh's q at conv + t * conv_stride + kh * dk, its k Hk * dk further, value head h's v at
 * 2 Hk Dk + h * dv. a, b: token t, head h at a + t * ab_stride + h (the raw projections);
 * g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b). state: block b, head h at
 * state + b * block_stride + h * dv * dk; out [T, H, Dv]. Dk <= GDN_MAX_DK. */
void gdn_scan_f32(const float *conv, int64_t conv_stride, const float *a, const float *b, int64_t ab_stride,
                  const float *a_log, const float *dt_bias, float *state, int64_t block_stride, const int64_t *plan,
                  int64_t sequences, const int64_t *checkpoints, int64_t heads, int64_t key_heads, int64_t dv,
                  int64_t dk, float *out, int threads) {
    const int64_t r = heads / key_heads, size = dv * dk, key_size = key_heads * dk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (sequences * heads > 1)
    for (int64_t item = 0; item < sequences * heads; ++item) {
        const int64_t *row = plan + (item / heads) * PLAN_FIELDS, h = item % heads;
        const int64_t first = row[0], tokens = row[1];
        float *s = state + row[2] * block_stride + h * size;
        const float neg_a = -exp_f32(a_log[h]);
        int64_t done = 0;
        for (int64_t c = row[3]; c <= row[4]; ++c) {  /* each checkpoint, then the end (c == row[4]) */
            const int64_t until = c < row[4] ? checkpoints[2 * c] : tokens;
            const int64_t t = first + done;
            gdn_head(conv + t * conv_stride, conv_stride, key_size, h / r, a + t * ab_stride + h,
                     b + t * ab_stride + h, ab_stride, neg_a, dt_bias[h], h, s, dv, dk,
                     out + (t * heads + h) * dv, heads * dv, until - done);
            if (c < row[4]) memcpy(state + checkpoints[2 * c + 1] * block_stride + h * size, s, size * sizeof *s);
            done = until;
        }
    }
}

/* One token on the state rows: S_i = decay S_i + (step x_i) B, y_i = S_i . C + D x_i (inlined as gdn_rows). */
static inline __attribute__((always_inline)) void mamba2_rows(float *restrict s, const float *restrict xt,
                                                              const float *restrict bt, const float *restrict ct,
                                                              float *restrict ot, float step, float decay, float skip,
                                                              int64_t p, const int64_t n) {
    for (int64_t i = 0; i < p; ++i) {
        float *restrict row = s + i * n;
        const float input = step * xt[i];
        float y;
        if (n % 8 == 0) {
            v8 acc = {0};
            for (int64_t j = 0; j < n; j += 8) {
                const v8 r = load8(row + j) * decay + input * load8(bt + j);
                store8(row + j, r);
                acc += r * load8(ct + j);
            }
            y = hsum8(acc);
        } else {
            y = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                row[j] = row[j] * decay + input * bt[j];
                y += row[j] * ct[j];
            }
        }
        ot[i] = y + skip * xt[i];
    }
}

static void mamba2_head(const float *x, int64_t x_stride, const float *b, const float *c, int64_t bc_stride,
                        const float *dt, int64_t dt_stride, float dt_bias, float low, float high, float a, float skip,
                        float *restrict s, int64_t p, int64_t n, float *out, int64_t out_stride, int64_t tokens) {
    for (int64_t t = 0; t < tokens; ++t) {
        const float *xt = x + t * x_stride, *bt = b + t * bc_stride, *ct = c + t * bc_stride;
        float *ot = out + t * out_stride;
        const float step = fminf(fmaxf(softplus(dt[t * dt_stride] + dt_bias), low), high);
        const float decay = exp_f32(step * a);
        if (n == 64)
            mamba2_rows(s, xt, bt, ct, ot, step, decay, skip, p, 64);
        else if (n == 128)
            mamba2_rows(s, xt, bt, ct, ot, step, decay, skip, p, 128);
        else
            mamba2_rows(s, xt, bt, ct, ot, step, decay, skip, p, n);
    }
}

/* x: token t, head h at x + t * x_stride + h * p; b, c: t, group gi at b + t * bc_stride + gi * n;
 * dt: t, head h at dt + t * dt_stride + h, the raw projection: the time step is
 * clamp(softplus(dt + dt_bias), low, high); a (negative), d [H]; state: block b, head h at
 * state + b * block_stride + h * p * n; out [T, H, P]. */
void mamba2_scan_f32(const float *x, int64_t x_stride, const float *b, const float *c, int64_t bc_stride,
                     const float *dt, int64_t dt_stride, const float *dt_bias, float low, float high, const float *a,
                     const float *d, float *state, int64_t block_stride, const int64_t *plan, int64_t sequences,
                     const int64_t *checkpoints, int64_t heads, int64_t groups, int64_t p, int64_t n, float *out,
                     int threads) {
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
                        dt + t * dt_stride + h, dt_stride, dt_bias[h], low, high, a[h], d[h], s, p, n,
                        out + (t * heads + h) * p, heads * p, until - done);
            if (k < row[4]) memcpy(state + checkpoints[2 * k + 1] * block_stride + h * size, s, size * sizeof *s);
            done = until;
        }
    }
}

/* Mamba1 (Jamba): a decay per channel and state column, channel i with state row S_i [N]:
 *     S_i = exp(dt_i A_i) * S_i + (dt_i x_i) B;  y_i = S_i . C + D_i x_i
 * x, dt: token t, channel i at x + t * x_stride + i (dt likewise, dt after softplus); b, c: t at
 * b + t * bc_stride (N values); a [I, N] (negative), d [I]; state: block b at state + b * block_stride,
 * [I, N]; out [T, I]. Work items: (sequence, block of MAMBA1_CHANNELS channels). */
#define MAMBA1_CHANNELS 64

void mamba1_scan_f32(const float *x, int64_t x_stride, const float *dt, int64_t dt_stride, const float *b,
                     const float *c, int64_t bc_stride, const float *a, const float *d, float *state,
                     int64_t block_stride, const int64_t *plan, int64_t sequences, const int64_t *checkpoints,
                     int64_t channels, int64_t n, float *out, int threads) {
    const int64_t parts = (channels + MAMBA1_CHANNELS - 1) / MAMBA1_CHANNELS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (sequences * parts > 1)
    for (int64_t item = 0; item < sequences * parts; ++item) {
        int64_t lo, hi;
        const int64_t *row = plan_item(plan, item, parts, MAMBA1_CHANNELS, channels, &lo, &hi);
        const int64_t first = row[0], tokens = row[1];
        float *s = state + row[2] * block_stride;
        int64_t done = 0;
        for (int64_t k = row[3]; k <= row[4]; ++k) {
            const int64_t until = k < row[4] ? checkpoints[2 * k] : tokens;
            for (int64_t t = first + done; t < first + until; ++t) {
                const float *restrict xt = x + t * x_stride, *restrict dtt = dt + t * dt_stride;
                const float *restrict bt = b + t * bc_stride, *restrict ct = c + t * bc_stride;
                float *restrict ot = out + t * channels;
                for (int64_t i = lo; i < hi; ++i) {
                    float *restrict si = s + i * n;
                    const float *restrict ai = a + i * n;
                    const float step = dtt[i], input = step * xt[i];
                    float y = 0.0f;
                    for (int64_t j = 0; j < n; ++j) {
                        si[j] = exp_f32(step * ai[j]) * si[j] + input * bt[j];
                        y += si[j] * ct[j];
                    }
                    ot[i] = y + d[i] * xt[i];
                }
            }
            if (k < row[4]) {
                float *target = state + checkpoints[2 * k + 1] * block_stride;
                memcpy(target + lo * n, s + lo * n, (size_t)((hi - lo) * n) * sizeof *s);
            }
            done = until;
        }
    }
}
