/* Shared helpers of the engine's kernels: 8-float vectors (GCC vector extensions: one AVX2
 * register, or two SSE/NEON ones), a dot product, and an inlined exp (with the sigmoid and SiLU
 * built on it) that the compiler vectorizes.
 *
 * exp_f32: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts, so r is exact to float32),
 * exp(r) by a degree-6 polynomial (Cephes' expf coefficients, relative error ~1e-7 on that range),
 * times 2^n built in the exponent bits. x is clamped to [-87, 88], where 2^n stays a normal float:
 * exp(-87) ~ 1.6e-38 stands in for anything smaller (softmax and sigmoid then give 0 to float32
 * precision, as they would unclamped). glibc's vector expf takes a slow scalar path outside
 * about [-87, 88]; this one has no such path.
 */
#ifndef HYBRIDKV_VEC_H
#define HYBRIDKV_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

static inline float hsum8(v8 x) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += x[i];
    return s;
}

/* a . b over n floats; two accumulators hide the FMA latency */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    int64_t d = 0;
    float tail = 0.0f;
    if (n % 16 == 0) {
        v8 acc0 = {0}, acc1 = {0};
        for (; d < n; d += 16) {
            acc0 += load8(a + d) * load8(b + d);
            acc1 += load8(a + d + 8) * load8(b + d + 8);
        }
        return hsum8(acc0 + acc1);
    }
    for (; d < n; ++d) tail += a[d] * b[d];
    return tail;
}

static inline float exp_f32(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sigmoid_f32(float z) { return 1.0f / (1.0f + exp_f32(-z)); }

static inline float silu_f32(float x) { return x * sigmoid_f32(x); }

#endif
