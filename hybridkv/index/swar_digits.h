/* Decimal digits read 8 bytes at a time (seq_chain.c; json_u32.c `convert4` does the same in four lanes). */
#ifndef HKV_SWAR_DIGITS_H
#define HKV_SWAR_DIGITS_H

#include <stdint.h>

/* SWAR ("SIMD within a register") over 8 bytes of text loaded little-endian (first byte lowest; this
 * file runs on little-endian hosts only): b ^ '0' is 0..9 for a digit; + 0x76 sets a byte's top bit
 * from 10 up (no carry out of a byte: ASCII is below 0x80, and a byte from 0x80 up has its top bit
 * already). The number of leading digits, 0..8. */
static inline int64_t leading_digits(uint64_t x) {
    uint64_t v = x ^ 0x3030303030303030ull;
    uint64_t non_digit = ((v + 0x7676767676767676ull) | v) & 0x8080808080808080ull;
    return non_digit ? __builtin_ctzll(non_digit) >> 3 : 8;
}

/* The value of the first `digits` (1..7) decimal digits of x: the digits shifted to the top of the
 * word (the lower bytes zero, i.e. leading zeros), then pairs, quads and the eight combined in place:
 *   byte k = d_k  ->  byte 2j = 10 d_2j + d_2j+1  ->  16-bit lane 2j = 100 p_2j + p_2j+1  ->  the value */
static inline uint64_t digits_value(uint64_t x, int64_t digits) {
    uint64_t v = ((x ^ 0x3030303030303030ull) << (8 * (8 - digits)));
    v = (v * 10 + (v >> 8)) & 0x00FF00FF00FF00FFull;
    v = (v * 100 + (v >> 16)) & 0x0000FFFF0000FFFFull;
    return (v * 10000 + (v >> 32)) & 0xFFFFFFFFull;
}

#endif
