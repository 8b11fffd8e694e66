/* The gated MLP's middle in one pass: out = act(gate) * up, elementwise over n floats.
 *
 *     act 0, GELU (tanh approximation): x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
 *     act 1, SiLU:                      x sigmoid(x)
 *
 * with sigmoid(z) = 1 / (1 + exp(-z)) (sigmoid_f32 of vec.h). torch runs each as 3-6 separate passes.
 * Chunks of the tensor run on `threads` OpenMP threads when it is large enough.
 */
#include "vec.h"

void gated_act_f32(const float *restrict gate, const float *restrict up, float *restrict out, int64_t n, int act,
                   int threads) {
    const float c = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
    const int64_t chunk = 4096;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 65536)
    for (int64_t start = 0; start < n; start += chunk) {
        const int64_t end = start + chunk < n ? start + chunk : n;
        if (act == 0) {
            for (int64_t i = start; i < end; ++i) {
                const float x = gate[i];
                out[i] = x * sigmoid_f32(c * (x + 0.044715f * x * x * x)) * up[i];
            }
        } else {
            for (int64_t i = start; i < end; ++i) out[i] = silu_f32(gate[i]) * up[i];
        }
    }
}
