/* The state mixers' depthwise causal conv1d (kernel K) with its conv states, and the activation.
 *
 * Sequences come as the plan of `plan.h` (first token, tokens, block, checkpoints from, to).
 * A sequence's K-1 previous inputs are rows [K-1, C] of its block in conv_state; for token t
 *
 *     out[t, c] = act(bias[c] + sum_j taps[j, c] * in[t - (K-1) + j, c])      (in[-i] = the stored rows)
 *
 * and the K-1 inputs before each checkpoint offset (and before the end) are stored in that block.
 * The plain-torch path cuts each chunk into K shifted copies and concatenates the stored rows in
 * front; here each output row reads its K input rows where they are. Work items are (sequence,
 * block of CONV_CHANNELS channels), dealt to OpenMP threads. act: 0 none, 1 SiLU.
 */
#include "plan.h"
#include "vec.h"

#define CONV_CHANNELS 128

/* Input row `t` of the sequence (t < 0: stored row K-1+t of `state`). */
static inline const float *input_row(const float *x, int64_t x_stride, const float *state, int64_t c_stride,
                                     int64_t kernel, int64_t t) {
    return t >= 0 ? x + t * x_stride : state + (kernel - 1 + t) * c_stride;
}

static void store_rows(const float *x, int64_t x_stride, const float *state, int64_t c_stride, int64_t kernel,
                       int64_t until, float *target, int64_t lo, int64_t hi) {
    /* target rows i = 0..K-2 <- input row until-(K-1)+i. When target == state, row i reads stored
     * row until+i >= i: ascending i reads every row before it is overwritten. */
    for (int64_t i = 0; i < kernel - 1; ++i) {
        const float *src = input_row(x, x_stride, state, c_stride, kernel, until - (kernel - 1) + i);
        for (int64_t c = lo; c < hi; ++c) target[i * c_stride + c] = src[c];
    }
}

void causal_conv_f32(const float *x, int64_t x_stride, float *conv_state, int64_t block_stride,
                     int64_t c_stride, const float *taps, const float *bias, int64_t channels, int64_t kernel,
                     const int64_t *plan, int64_t sequences, const int64_t *checkpoints, int act, float *out,
                     int threads) {
    const int64_t parts = (channels + CONV_CHANNELS - 1) / CONV_CHANNELS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (sequences * parts > 1)
    for (int64_t item = 0; item < sequences * parts; ++item) {
        int64_t lo, hi;
        const int64_t *row = plan_item(plan, item, parts, CONV_CHANNELS, channels, &lo, &hi);
        const int64_t first = row[0], tokens = row[1];
        const float *xs = x + first * x_stride;
        float *state = conv_state + row[2] * block_stride;
        for (int64_t t = 0; t < tokens; ++t) {
            float *restrict o = out + (first + t) * channels;
            for (int64_t c = lo; c < hi; ++c) o[c] = bias ? bias[c] : 0.0f;
            for (int64_t j = 0; j < kernel; ++j) {
                const float *restrict in = input_row(xs, x_stride, state, c_stride, kernel, t - (kernel - 1) + j);
                const float *restrict w = taps + j * channels;
                for (int64_t c = lo; c < hi; ++c) o[c] += w[c] * in[c];
            }
            if (act == 1)
                for (int64_t c = lo; c < hi; ++c) o[c] = silu_f32(o[c]);
        }
        for (int64_t k = row[3]; k < row[4]; ++k)
            store_rows(xs, x_stride, state, c_stride, kernel, checkpoints[2 * k],
                       conv_state + checkpoints[2 * k + 1] * block_stride, lo, hi);
        store_rows(xs, x_stride, state, c_stride, kernel, tokens, state, lo, hi);
    }
}
