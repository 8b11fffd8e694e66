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

int64_t hkv_parse_u32_array(const char *s, int64_t len, uint32_t *out, int64_t cap) {
    int64_t i = 0, n = 0;
    while (i < len && is_space(s[i])) i++;
    if (i >= len || s[i++] != '[') return -1;
    while (i < len && is_space(s[i])) i++;
    if (i < len && s[i] == ']') {
        i++;
    } else {
        for (;;) {
            if (i >= len || s[i] < '0' || s[i] > '9' || n >= cap) return -1;
            if (s[i] == '0' && i + 1 < len && s[i + 1] >= '0' && s[i + 1] <= '9') return -1;
            uint64_t v = 0;
            int64_t start = i;
            while (i < len && s[i] >= '0' && s[i] <= '9' && i - start < 11) v = v * 10 + (uint64_t)(s[i++] - '0');
            if (v > 0xFFFFFFFFu || (i < len && s[i] >= '0' && s[i] <= '9')) return -1;
            out[n++] = (uint32_t)v;
            while (i < len && is_space(s[i])) i++;
            if (i < len && s[i] == ',') {
                i++;
                while (i < len && is_space(s[i])) i++;
                continue;
            }
            if (i < len && s[i] == ']') {
                i++;
                break;
            }
            return -1;
        }
    }
    while (i < len && is_space(s[i])) i++;
    return i == len ? n : -1;
}
