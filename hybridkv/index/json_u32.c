/* The fast read of a JSON array of u32s as JSON encoders write it: `1,2,3` or `1, 2, 3` (one space
 * after each comma at most), numbers of 1 to 7 digits. Anything else (newlines, other spacing, a
 * long number) returns -1 and seq_chain.c's general parse reads the array instead.
 *
 * The text is classified 64 bytes at a time (AVX2: digits, commas, spaces, ']', other) into bit
 * masks; every number start is a set bit of `digit & ~(digit << 1)`, so the numbers of a block are
 * read independently of one another (one 8-byte load and a few multiplies each: seq_chain.c's SWAR
 * `leading_digits` / `digits_value`, swar_digits.h) instead of one after the other. The grammar is checked on the
 * masks, with bit k-1 of the previous class carried into each block ("prev"):
 *
 *     a comma follows a digit          comma & ~prev(digit)          == 0
 *     a space follows a comma          space & ~prev(comma)          == 0
 *     a number follows a comma/space   start & ~prev(comma | space)  == 0   (but the first)
 *     the array ends after a digit     ']' at e: bit e-1 of digit
 *
 * which together allow exactly  number ( "," " "? number )*  up to the ']'. Leading zeros are
 * refused per number. The tail of the text (less than a block and a load) is read from a padded copy.
 */
#include <stdint.h>
#include <string.h>

#include "swar_digits.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>


typedef struct {
    uint64_t digit, comma, space;  /* the previous byte's class, in bit 0 */
    uint32_t *out;
    int64_t n, cap;
} scan;

__attribute__((target("avx2"))) static uint64_t class_mask(__m256i lo, __m256i hi, __m256i c) {
    uint32_t a = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, c));
    uint32_t b = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, c));
    return (uint64_t)a | (uint64_t)b << 32;
}

__attribute__((target("avx2"))) static uint64_t digit_mask(__m256i lo, __m256i hi) {
    __m256i zero = _mm256_set1_epi8('0'), nine = _mm256_set1_epi8(9);
    __m256i a = _mm256_sub_epi8(lo, zero), b = _mm256_sub_epi8(hi, zero);
    uint32_t da = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(a, nine), a));
    uint32_t db = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(b, nine), b));
    return (uint64_t)da | (uint64_t)db << 32;
}

/* One block of 64 bytes at p (8 more readable after it): its numbers into sc->out. Returns 64 when
 * the array goes on, e + 1 when its ']' is at p[e], -1 for anything this read does not take. */
__attribute__((target("avx2"))) static int64_t scan_block(const char *p, scan *sc) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)p), hi = _mm256_loadu_si256((const __m256i *)(p + 32));
    uint64_t digit = digit_mask(lo, hi);
    uint64_t comma = class_mask(lo, hi, _mm256_set1_epi8(','));
    uint64_t space = class_mask(lo, hi, _mm256_set1_epi8(' '));
    uint64_t close = class_mask(lo, hi, _mm256_set1_epi8(']'));
    uint64_t stop = ~(digit | comma | space);  /* ']' or anything else */
    uint64_t keep = ~0ull;
    int64_t e = -1;
    if (stop) {
        e = __builtin_ctzll(stop);
        if (!(close >> e & 1)) return -1;
        keep = e ? (~0ull >> (64 - e)) : 0;
        digit &= keep, comma &= keep, space &= keep;
    }
    uint64_t prev_digit = digit << 1 | sc->digit, prev_comma = comma << 1 | sc->comma;
    uint64_t prev_space = space << 1 | sc->space;
    uint64_t starts = digit & ~prev_digit;
    if ((comma & ~prev_digit) | (space & ~prev_comma) | (starts & ~(prev_comma | prev_space))) return -1;
    if (e >= 0 && !(prev_digit >> e & 1)) return -1;  /* (`,]`, ` ]`, `[]` come here: the general read) */
    if (sc->n + __builtin_popcountll(starts) > sc->cap) return -1;
    uint32_t *out = sc->out + sc->n;
    sc->n += __builtin_popcountll(starts);
    while (starts) {
        int k = __builtin_ctzll(starts);
        starts &= starts - 1;
        uint64_t x;
        memcpy(&x, p + k, 8);
        int64_t digits = leading_digits(x);
        if (digits >= 8 || (digits > 1 && (x & 0xFF) == '0')) return -1;
        *out++ = (uint32_t)digits_value(x, digits);
    }
    sc->digit = digit >> 63, sc->comma = comma >> 63, sc->space = space >> 63;
    return e >= 0 ? e + 1 : 64;
}

/* The array's numbers from s[i] (its first number: the caller is past '[' and any spaces) to its
 * ']', into out; the index after the ']', or -1 (nothing promised about out then). */
__attribute__((target("avx2"))) static int64_t read_u32s(const char *s, int64_t i, int64_t len, uint32_t *out,
                                                         int64_t cap, int64_t *count) {
    scan sc = {0, 1, 0, out, 0, cap};  /* (the first number counts as after a comma) */
    for (; i + 72 <= len; i += 64) {
        int64_t r = scan_block(s + i, &sc);
        if (r < 0) return -1;
        if (r < 64) {
            *count = sc.n;
            return i + r;
        }
    }
    char tail[64 * 2 + 8];
    memset(tail, 'x', sizeof tail);
    memcpy(tail, s + i, (size_t)(len - i));
    for (int64_t at = 0; at < 128; at += 64) {
        int64_t r = scan_block(tail + at, &sc);
        if (r < 0) return -1;
        if (r < 64) {
            *count = sc.n;
            return i + at + r;
        }
    }
    return -1;
}

int64_t hkv_read_u32s_fast(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return avx2 ? read_u32s(s, i, len, out, cap, count) : -1;
}

#else

int64_t hkv_read_u32s_fast(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    (void)s, (void)i, (void)len, (void)out, (void)cap, (void)count;
    return -1;
}

#endif
