/* RMSNorm in one pass over each row: out = x * (1 / sqrt(mean(x^2) + eps)) * w (w NULL: no weight).
 *
 * x, out [rows, dim] float32 (contiguous, not overlapping), w [dim]. torch's F.rms_norm on CPU runs
 * pow, mean, add, rsqrt and two multiplies as separate ops, each a pass over the whole tensor;
 * here a row is read once for its sum of squares and once for the scaled write (it stays in L1).
 * Rows run on `threads` OpenMP threads when the tensor is large enough to pay for the fork.
 */
#include "vec.h"

static void norm_row(const float *restrict x, const float *restrict w, float *out, int64_t dim, float eps) {
    const float scale = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
    if (w)
        for (int64_t d = 0; d < dim; ++d) out[d] = (x[d] * scale) * w[d];
    else
        for (int64_t d = 0; d < dim; ++d) out[d] = x[d] * scale;
}

void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, w, out + r * dim, dim, eps);
}

/* The state mixers' gated RMSNorm: row r = (token r / per_token, part r % per_token) of `dim`
 * channels at x + token * x_stride + part * dim (z likewise), weight w + part * w_part_stride.
 *     gate_first:  y = x * silu(z);  out = y / sqrt(mean(y^2) + eps) * w          (Mamba2)
 *     otherwise:   out = x / sqrt(mean(x^2) + eps) * w * silu(z)                 (Gated DeltaNet)
 * out [rows, dim] packed. torch runs silu, the multiplies and the six ops of its norm separately. */
void gated_rms_norm_f32(const float *x, int64_t x_stride, const float *z, int64_t z_stride, const float *w,
                        int64_t w_part_stride, float *out, int64_t rows, int64_t per_token, int64_t dim, float eps,
                        int gate_first, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = r / per_token, part = r % per_token;
        const float *restrict xr = x + token * x_stride + part * dim, *restrict zr = z + token * z_stride + part * dim;
        const float *restrict wr = w + part * w_part_stride;
        float *restrict o = out + r * dim;
        float ss = 0.0f;
        for (int64_t d = 0; d < dim; ++d) {
            const float gate = silu_f32(zr[d]);
            const float y = gate_first ? xr[d] * gate : xr[d];
            o[d] = gate_first ? y : gate;  /* the gate, kept for the second pass */
            ss += y * y;
        }
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        if (gate_first)
            for (int64_t d = 0; d < dim; ++d) o[d] = o[d] * scale * wr[d];
        else
            for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * scale * wr[d] * o[d];
    }
}
