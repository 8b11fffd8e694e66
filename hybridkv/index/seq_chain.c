/* The Conductor's rolling sequence hashes of a run of full blocks, in one native loop (seq_hash.py).
 *
 *   local[i] = XXH3-64(block i's tokens as little-endian u32, seed)
 *   seq[0]   = has_parent ? XXH3-64(parent LE || local[0] LE, seed) : local[0]
 *   seq[i]   = XXH3-64(seq[i-1] LE || local[i] LE, seed)
 *
 * XXH3 itself is not restated here: `xxh3` is the XXH3_64bits_withSeed of the xxhash library the
 * Python side already loads (its address is passed in), so the results are the library's own.
 * The caller gives little-endian u32 tokens and runs this on little-endian hosts only.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "swar_digits.h"

int64_t hkv_read_u32s_fast(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count);

typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);

void hkv_seq_hashes(xxh3_fn xxh3, const uint32_t *tokens, int64_t num_blocks, int64_t block_tokens,
                    int has_parent, uint64_t parent, uint64_t seed, uint64_t *out) {
    uint64_t pair[2];
    uint64_t prev = parent;
    size_t stride = (size_t)block_tokens * sizeof(uint32_t);
    for (int64_t i = 0; i < num_blocks; i++) {
        uint64_t local = xxh3(tokens + i * block_tokens, stride, seed);
        if (i == 0 && !has_parent) {
            prev = local;
        } else {
            pair[0] = prev;
            pair[1] = local;
            prev = xxh3(pair, sizeof pair, seed);
        }
        out[i] = prev;
    }
}

/* A JSON array of unsigned integers (`[1, 2, 3]`, whitespace allowed) into u32s: the count, or -1
 * for anything else (a sign, a fraction, an exponent, a leading zero, a value over 2^32 - 1, more
 * than `cap` numbers, text after the array): the caller then decodes it the slow way, which names
 * the fault. */
static int is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

/* A cursor over an array's numbers: text s[i..len), numbers into out[n..cap). */
typedef struct {
    const char *s;
    int64_t i, len;
    uint32_t *out;
    int64_t n, cap;
} cursor;

static int64_t skip_spaces(const char *s, int64_t i, int64_t len) {
    while (i < len && (unsigned char)s[i] <= ' ' && is_space(s[i])) i++;
    return i;
}

/* What follows a number ending at i: past a comma (and the spaces after it): 1; past the closing
 * ']': 0; anything else: -1. */
static int after_number(cursor *c, int64_t i) {
    const char *s = c->s;
    int64_t len = c->len;
    i = skip_spaces(s, i, len);
    if (i < len && s[i] == ',') {
        c->i = skip_spaces(s, i + 1, len);
        return 1;
    }
    if (i < len && s[i] == ']') {
        c->i = i + 1;
        return 0;
    }
    return -1;
}

/* The number at c->i (into out) and what follows it (`after_number`). The common case, 1 to 7
 * digits then a comma, all from one 8-byte load. */
__attribute__((always_inline)) static inline int take_number(cursor *c) {
    const char *s = c->s;
    int64_t i = c->i, len = c->len;
    if (c->n >= c->cap) return -1;
    if (i + 8 <= len) {
        uint64_t x;
        memcpy(&x, s + i, 8);
        int64_t digits = leading_digits(x);
        if (digits == 0 || (digits > 1 && (x & 0xFF) == '0')) return -1;  /* (no number; a leading zero) */
        if (digits < 8) {
            c->out[c->n++] = (uint32_t)digits_value(x, digits);
            if (((x >> (8 * digits)) & 0xFF) == ',') {
                c->i = skip_spaces(s, i + digits + 1, len);
                return 1;
            }
            return after_number(c, i + digits);
        }
    }
    if (i >= len || s[i] < '0' || s[i] > '9') return -1;
    if (s[i] == '0' && i + 1 < len && s[i + 1] >= '0' && s[i + 1] <= '9') return -1;
    uint64_t v = 0;
    int64_t start = i;
    while (i < len && s[i] >= '0' && s[i] <= '9' && i - start < 11) v = v * 10 + (uint64_t)(s[i++] - '0');
    if (v > 0xFFFFFFFFu || (i < len && s[i] >= '0' && s[i] <= '9')) return -1;
    c->out[c->n++] = (uint32_t)v;
    return after_number(c, i);
}

/* The array at s[i] (i at '['): its numbers into out, *count set; the index after its ']', or -1.
 *
 * Each number's end is found from its bytes, and the next number starts there: one dependent chain
 * of ~15 cycles a number. A long array is read as two chains at once (the CPU overlaps them):
 *
 *   [ 12, 345, 6, ... 78, | 9, 1011, ... 12 ]
 *     a: from the start    ^ b: from after the first comma at or past the middle (`mid`)
 *
 * a's result stands on its own; b's counts only when a, read in order, lands exactly on `mid` (the
 * comma was a separator of this array), so the answer is always that of the one chain in order. b
 * writes its numbers past the most a can write before `mid` (a number and a comma: 2 bytes at least)
 * and they are moved down after a's. */
static int64_t parse_u32s(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    if (i >= len || s[i++] != '[') return -1;
    i = skip_spaces(s, i, len);
    if (i < len && s[i] == ']') {
        *count = 0;
        return i + 1;
    }
    int64_t fast = hkv_read_u32s_fast(s, i, len, out, cap, count);  /* (json_u32.c: the common spellings) */
    if (fast >= 0) return fast;
    cursor a = {s, i, len, out, 0, cap};
    int ra = 1, rb = -1;
    const char *comma = len - i > 4096 ? memchr(s + (i + len) / 2, ',', (size_t)(len - (i + len) / 2)) : NULL;
    int64_t mid = comma ? skip_spaces(s, comma - s + 1, len) : len;
    int64_t room = (mid - i) / 2 + 1;
    cursor b = {s, mid, len, out + room, 0, cap - room};
    if (comma && room < cap) {
        rb = 1;
        while (ra == 1 && rb == 1 && a.i < mid) {
            ra = take_number(&a);
            rb = take_number(&b);
        }
    }
    while (ra == 1 && a.i < mid) ra = take_number(&a);
    if (ra == 1 && a.i == mid && rb >= 0) {  /* (b's numbers follow a's) */
        while (rb == 1) rb = take_number(&b);
        if (rb < 0) return -1;
        memmove(out + a.n, out + room, (size_t)b.n * sizeof *out);
        *count = a.n + b.n;
        return b.i;
    }
    while (ra == 1) ra = take_number(&a);  /* (b, if any, read something else: its numbers are dropped) */
    if (ra < 0) return -1;
    *count = a.n;
    return a.i;
}

int64_t hkv_parse_u32_range(const char *s, int64_t start, int64_t end, uint32_t *out, int64_t cap) {
    int64_t count = 0, i = start;
    while (i < end && is_space(s[i])) i++;
    i = parse_u32s(s, i, end, out, cap, &count);
    if (i < 0) return -1;
    while (i < end && is_space(s[i])) i++;
    return i == end ? count : -1;
}

/* The top-level key `key` of a JSON object, an array of u32s: parsed into out (*count of them),
 * its value's place [*start, *end); returns 1, or -1 when it is absent or anything is unusual (a key
 * with an escape, the key twice, a value that is not such an array, unbalanced brackets, text after
 * the object). Other values are skipped by their brackets and quotes only: the caller validates the
 * rest of the text with a JSON decoder, and on -1 decodes all of it. */
static int64_t skip_string(const char *s, int64_t i, int64_t n) {
    for (i++; i < n; i++) {
        if (s[i] == '\\') {
            i++;
        } else if (s[i] == '"') {
            return i + 1;
        }
    }
    return -1;
}

static int64_t skip_value(const char *s, int64_t i, int64_t n) {
    if (i < n && s[i] == '"') return skip_string(s, i, n);
    if (i < n && (s[i] == '[' || s[i] == '{')) {
        int64_t depth = 0;
        while (i < n) {
            char c = s[i];
            if (c == '"') {
                i = skip_string(s, i, n);
                if (i < 0) return -1;
                continue;
            }
            if (c == '[' || c == '{') depth++;
            if (c == ']' || c == '}') {
                if (--depth == 0) return i + 1;
            }
            i++;
        }
        return -1;
    }
    int64_t start = i;
    while (i < n && s[i] != ',' && s[i] != '}' && s[i] != ']' && !is_space(s[i])) i++;
    return i > start ? i : -1;
}

int64_t hkv_take_u32_array(const char *s, int64_t n, const char *key, int64_t key_len, uint32_t *out, int64_t cap,
                           int64_t *count, int64_t *start, int64_t *end) {
    int64_t i = 0, found = 0;
    while (i < n && is_space(s[i])) i++;
    if (i >= n || s[i++] != '{') return -1;
    while (i < n && is_space(s[i])) i++;
    if (i < n && s[i] == '}') {
        i++;
    } else {
        for (;;) {
            if (i >= n || s[i] != '"') return -1;
            int64_t k = i + 1, k_end = skip_string(s, i, n);
            if (k_end < 0 || memchr(s + k, '\\', (size_t)(k_end - 1 - k)) != NULL) return -1;
            int match = k_end - 1 - k == key_len && memcmp(s + k, key, (size_t)key_len) == 0;
            i = k_end;
            while (i < n && is_space(s[i])) i++;
            if (i >= n || s[i++] != ':') return -1;
            while (i < n && is_space(s[i])) i++;
            int64_t v_end = match ? parse_u32s(s, i, n, out, cap, count) : skip_value(s, i, n);
            if (v_end < 0 || (match && found)) return -1;
            if (match) {
                found = 1;
                *start = i;
                *end = v_end;
            }
            i = v_end;
            while (i < n && is_space(s[i])) i++;
            if (i < n && s[i] == ',') {
                i++;
                while (i < n && is_space(s[i])) i++;
                continue;
            }
            if (i < n && s[i] == '}') {
                i++;
                break;
            }
            return -1;
        }
    }
    while (i < n && is_space(s[i])) i++;
    return i == n && found ? 1 : -1;
}
