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

/* The array at s[i] (i at '['): its numbers into out, *count set; the index after its ']', or -1. */
static int64_t parse_u32s(const char *s, int64_t i, int64_t len, uint32_t *out, int64_t cap, int64_t *count) {
    int64_t n = 0;
    if (i >= len || s[i++] != '[') return -1;
    while (i < len && is_space(s[i])) i++;
    if (i < len && s[i] == ']') {
        *count = 0;
        return i + 1;
    }
    for (;;) {
        if (i >= len || s[i] < '0' || s[i] > '9' || n >= cap) return -1;
        if (s[i] == '0' && i + 1 < len && s[i + 1] >= '0' && s[i + 1] <= '9') return -1;
        uint64_t v = 0;
        int64_t start = i;
        while (i < len && s[i] >= '0' && s[i] <= '9' && i - start < 11) v = v * 10 + (uint64_t)(s[i++] - '0');
        if (v > 0xFFFFFFFFu || (i < len && s[i] >= '0' && s[i] <= '9')) return -1;
        out[n++] = (uint32_t)v;
        if (i < len && s[i] == ',') {  /* (the common case first: no space after a number) */
            i++;
            while (i < len && is_space(s[i])) i++;
            continue;
        }
        while (i < len && is_space(s[i])) i++;
        if (i < len && s[i] == ',') {
            i++;
            while (i < len && is_space(s[i])) i++;
            continue;
        }
        if (i < len && s[i] == ']') {
            *count = n;
            return i + 1;
        }
        return -1;
    }
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
