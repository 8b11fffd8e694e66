/* RMSNorm in one pass over each row: out = x * (1 / sqrt(mean(x^2) + eps)) * w (w NULL: no weight).
 *
 * x, out [rows, dim] float32 (contiguous, not overlapping), w [dim]. torch's F.rms_norm on CPU runs
 * pow, mean, add, rsqrt and two multiplies as separate ops, each a pass over the whole tensor;
 * here a row is read once for its sum of squares and once for the scaled write (it stays in L1).
 * Rows run on `threads` OpenMP threads when the tensor is large enough to pay for the fork.
 */
#include "vec.h"

static void norm_row(const float *restrict x, const float *restrict w, float *out, int64_t dim, float eps) {
    int64_t d = 0;
    float ss = 0.0f;
    if (dim % 8 == 0) {
        v8 acc = {0};
        for (; d < dim; d += 8) acc += load8(x + d) * load8(x + d);
        for (int i = 0; i < 8; ++i) ss += acc[i];
    }
    for (; d < dim; ++d) ss += x[d] * x[d];
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    if (w)
        for (d = 0; d < dim; ++d) out[d] = (x[d] * scale) * w[d];
    else
        for (d = 0; d < dim; ++d) out[d] = x[d] * scale;
}

void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, w, out + r * dim, dim, eps);
}
