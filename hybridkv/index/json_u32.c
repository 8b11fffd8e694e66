/* The fast read of a JSON array of u32s as JSON encoders write it: `1,2,3` or `1, 2, 3` (one space
 * after each comma at most), numbers of 1 to 7 digits. Anything else (newlines, other spacing, a
 * long number) returns -1 and seq_chain.c's general parse reads the array instead.
 *
 * Two passes, neither with a branch that depends on the text (a number-by-number loop mispredicts
 * its exit about once per 64 bytes, which cost more than the arithmetic):
 *
 *   1. 64 bytes at a time, classified with AVX2 (digits, commas, spaces, ']', other) into bit masks;
 *      every number start is a set bit of `digit & ~(digit << 1)`, and the starts' offsets are
 *      written into `out` 16 at a time, unconditionally (the count advances by the popcount);
 *   2. the numbers at those offsets read four at a time, in place (`convert4`).
 *
 * The grammar is checked on the masks, with bit k-1 of the previous class carried into each block
 * ("prev"):
 *
 *     a comma follows a digit          comma & ~prev(digit)          == 0
 *     a space follows a comma          space & ~prev(comma)          == 0
 *     a number follows a comma/space   start & ~prev(comma | space)  == 0   (but the first)
 *     the array ends after a digit     ']' at e: bit e-1 of digit
 *
 * which together allow exactly  number ( "," " "? number )*  up to the ']'. Leading zeros and numbers
 * of 8 digits or more are refused in pass 2. The text's last bytes are read from padded copies.
 * `out` needs room for the count + 16 (native.py allocates it so).
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,bmi")))

typedef struct {
    uint64_t digit, comma, space;  /* the previous byte's class, in bit 0 */
    uint32_t *out;
    int64_t n, cap;
} scan;

AVX2 static uint64_t class_mask(__m256i lo, __m256i hi, __m256i c) {
    uint32_t a = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, c));
    uint32_t b = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, c));
    return (uint64_t)a | (uint64_t)b << 32;
}

AVX2 static uint64_t digit_mask(__m256i lo, __m256i hi) {
    __m256i zero = _mm256_set1_epi8('0'), nine = _mm256_set1_epi8(9);
    __m256i a = _mm256_sub_epi8(lo, zero), b = _mm256_sub_epi8(hi, zero);
    uint32_t da = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(a, nine), a));
    uint32_t db = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(b, nine), b));
    return (uint64_t)da | (uint64_t)db << 32;
}

/* Pass 1 over the 64 bytes at p (8 more readable after it), which start at offset `at` of the text:
 * the offsets of its numbers into sc->out. Returns 64 when the array goes on, e + 1 when its ']' is
 * at p[e], -1 for anything this read does not take. */
AVX2 static int64_t scan_block(const char *p, uint32_t at, scan *sc) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)p), hi = _mm256_loadu_si256((const __m256i *)(p + 32));
    uint64_t digit = digit_mask(lo, hi);
    uint64_t comma = class_mask(lo, hi, _mm256_set1_epi8(','));
    uint64_t space = class_mask(lo, hi, _mm256_set1_epi8(' '));
    uint64_t close = class_mask(lo, hi, _mm256_set1_epi8(']'));
    uint64_t stop = ~(digit | comma | space);  /* ']' or anything else */
    int64_t e = -1;
    if (stop) {
        e = (int64_t)_tzcnt_u64(stop);
        if (!(close >> e & 1)) return -1;
        uint64_t keep = e ? (~0ull >> (64 - e)) : 0;
        digit &= keep, comma &= keep, space &= keep;
    }
    uint64_t prev_digit = digit << 1 | sc->digit, prev_comma = comma << 1 | sc->comma;
    uint64_t prev_space = space << 1 | sc->space;
    uint64_t starts = digit & ~prev_digit;
    if ((comma & ~prev_digit) | (space & ~prev_comma) | (starts & ~(prev_comma | prev_space))) return -1;
    if (e >= 0 && !(prev_digit >> e & 1)) return -1;  /* (`,]`, ` ]`, `[]` come here: the general read) */
    int64_t count = __builtin_popcountll(starts);
    if (sc->n + (count > 16 ? count : 16) > sc->cap) return -1;
    uint32_t *w = sc->out + sc->n;
    for (int t = 0; t < 16; t++) {  /* (past the last start: offsets written, not counted) */
        w[t] = at + (uint32_t)_tzcnt_u64(starts);
        starts = _blsr_u64(starts);
    }
    for (int t = 16; starts; t++) {  /* (more than 16 numbers in 64 bytes: numbers of one or two digits) */
        w[t] = at + (uint32_t)_tzcnt_u64(starts);
        starts = _blsr_u64(starts);
    }
    sc->n += count;
    sc->digit = digit >> 63, sc->comma = comma >> 63, sc->space = space >> 63;
    return e >= 0 ? e + 1 : 64;
}

/* Pass 2 for four numbers: the 1 to 7 digits at base + pos[0..3] (a non-digit after each) into
 * out[0..3] (out may be pos: read first). The scalar SWAR of seq_chain.c (`leading_digits`,
 * `digits_value`) in four 64-bit lanes: the digit count from a byte sum (psadbw) instead of a count
 * of trailing zeros, the digits shifted to the top of the lane, then pairs, quads and eights combined
 * by multiply-adds. -1 for a number of 8 or more digits or with a leading zero. */
AVX2 static int convert4(const char *base, const uint32_t *pos, uint32_t *out) {
    const __m256i zero = _mm256_setzero_si256();
    uint64_t w0, w1, w2, w3;  /* (four loads: Intel's gather-data-sampling fix made vpgather ~3x slower) */
    memcpy(&w0, base + pos[0], 8), memcpy(&w1, base + pos[1], 8);
    memcpy(&w2, base + pos[2], 8), memcpy(&w3, base + pos[3], 8);
    __m256i x = _mm256_setr_epi64x((long long)w0, (long long)w1, (long long)w2, (long long)w3);
    __m256i v = _mm256_xor_si256(x, _mm256_set1_epi8('0'));
    __m256i non_digit = _mm256_and_si256(_mm256_or_si256(_mm256_add_epi64(v, _mm256_set1_epi8(0x76)), v),
                                         _mm256_set1_epi8((char)0x80));
    __m256i lowest = _mm256_and_si256(non_digit, _mm256_sub_epi64(zero, non_digit));
    __m256i digits = _mm256_sub_epi64(_mm256_srli_epi64(lowest, 7), _mm256_set1_epi64x(1));  /* 0xFF a digit */
    __m256i bits = _mm256_sad_epu8(_mm256_and_si256(digits, _mm256_set1_epi8(8)), zero);  /* 8 x digits */
    __m256i leading_zero = _mm256_and_si256(_mm256_cmpeq_epi64(_mm256_and_si256(v, _mm256_set1_epi64x(0xFF)), zero),
                                            _mm256_cmpgt_epi64(bits, _mm256_set1_epi64x(8)));
    if (_mm256_movemask_epi8(_mm256_or_si256(_mm256_cmpeq_epi64(non_digit, zero), leading_zero))) return -1;
    __m256i top = _mm256_sllv_epi64(v, _mm256_sub_epi64(_mm256_set1_epi64x(64), bits));
    __m256i pairs = _mm256_maddubs_epi16(top, _mm256_set1_epi16(0x010A));     /* 10 a + b */
    __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00010064));  /* 100 ab + cd */
    __m256i value = _mm256_add_epi64(_mm256_mul_epu32(quads, _mm256_set1_epi64x(10000)), _mm256_srli_epi64(quads, 32));
    __m256i packed = _mm256_permutevar8x32_epi32(value, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(packed));
    return 0;
}

/* Pass 2: out[0..n) from offsets to numbers; the last ones (within 8 bytes of the text's end, or
 * fewer than four) from a padded copy of the text's end. */
AVX2 static int convert_all(const char *s, int64_t len, uint32_t *out, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n && out[j + 3] + 8 <= (uint64_t)len; j += 4) {
        if (convert4(s, out + j, out + j) < 0) return -1;
    }
    if (j == n) return 0;
    char tail[128 + 8];
    uint32_t from = out[j], pos[4], value[4];
    if (len - from > 128) return -1;  /* (at most 7 numbers are left: they span less) */
    memset(tail, 'x', sizeof tail);
    memcpy(tail, s + from, (size_t)(len - from));
    for (; j < n; j += 4) {
        for (int t = 0; t < 4; t++) pos[t] = out[j + t < n ? j + t : j] - from;
        if (convert4(tail, pos, value) < 0) return -1;
        memcpy(out + j, value, (size_t)(n - j < 4 ? n - j : 4) * sizeof *value);
    }
    return 0;
}

/* The array's numbers from s[i] (its first number: the caller is past '[' and any spaces) to its
 * ']', into out; the index after the ']', or -1 (nothing promised about out then). */
AVX2 static int64_t read_u32s(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    scan sc = {0, 1, 0, out, 0, cap};  /* (the first number counts as after a comma) */
    int64_t end = -1;
    for (; i + 72 <= len && end < 0; i += 64) {
        int64_t r = scan_block(s + i, (uint32_t)i, &sc);
        if (r < 0) return -1;
        if (r < 64) end = i + r;
    }
    if (end < 0) {
        char tail[64 * 2 + 8];
        memset(tail, 'x', sizeof tail);
        memcpy(tail, s + i, (size_t)(len - i));
        for (int64_t at = 0; at < 128 && end < 0; at += 64) {
            int64_t r = scan_block(tail + at, (uint32_t)(i + at), &sc);
            if (r < 0) return -1;
            if (r < 64) end = i + at + r;
        }
    }
    if (end < 0 || convert_all(s, len, out, sc.n) < 0) return -1;
    *count = sc.n;
    return end;
}

int64_t hkv_read_u32s_fast(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") ? 1 : 0;
    }
    if (!avx2 || len >= (int64_t)1 << 31) return -1;
    return read_u32s(s, i, len, out, cap, count);
}

#else

int64_t hkv_read_u32s_fast(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    (void)s, (void)i, (void)len, (void)out, (void)cap, (void)count;
    return -1;
}

#endif
