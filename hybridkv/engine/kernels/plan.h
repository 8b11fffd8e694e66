/* The step plan the state kernels share (built by `StateMetadata`): row i of plan [S, PLAN_FIELDS]
 * int64 is (first token, tokens, running block, first checkpoint, end of its checkpoints); checkpoint
 * j of checkpoints [K, 2] is (tokens into the sequence, block). Work items deal (sequence, block of
 * `width` channels) pairs to OpenMP threads. */
#ifndef HYBRIDKV_PLAN_H
#define HYBRIDKV_PLAN_H

#include <stdint.h>

#define PLAN_FIELDS 5

/* Work item `item` of `parts` channel blocks per sequence: its plan row and channels [*lo, *hi). */
static inline const int64_t *plan_item(const int64_t *plan, int64_t item, int64_t parts, int64_t width,
                                       int64_t channels, int64_t *lo, int64_t *hi) {
    *lo = (item % parts) * width;
    *hi = *lo + width < channels ? *lo + width : channels;
    return plan + (item / parts) * PLAN_FIELDS;
}

#endif
