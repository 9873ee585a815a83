/* Block kernels of the store's clients (kvstore/native/blocks.py loads them).
 *
 * kv_verify_scatter: verify one encoded block (kvstore/codec.py's layout) where it lies, then
 * copy its payload out in chunks. The header must equal the caller's template (magic, version,
 * dtype, ndim, payload length, shape) with the block's own key, and the payload's XXH3-64 must
 * equal the header's checksum; only then is anything written, chunk c of chunk_bytes bytes going
 * to dst + offsets[c]. The block is hashed first and copied second: a block that fits in L2
 * (the default model's 736 KiB) is read from memory once.
 *
 * block_keys: the chained block keys of kvstore/keys.py, key[i] = XXH3-128(key[i-1] || the
 * block's tokens as little-endian uint32), written as 16 canonical (big-endian) bytes each.
 *
 * Hash functions come from the xxhash wheel's library as pointers, so every digest is its own.
 */
#include <stdint.h>
#include <string.h>

typedef uint64_t (*xxh64_fn)(const void *data, size_t len);
typedef struct { uint64_t low64, high64; } xxh128_t;
typedef xxh128_t (*xxh128_fn)(const void *data, size_t len);

enum { HEADER = 64, KEY_AT = 8, KEY_LEN = 16, SUM_AT = 24, LEN_AT = 32 };

int kv_verify_scatter(const uint8_t *block, int64_t block_len, const uint8_t *tmpl,
                      const uint8_t *key, xxh64_fn hash, uint8_t *dst, const int64_t *offsets,
                      int64_t nchunks, int64_t chunk_bytes)
{
    int64_t payload_len = nchunks * chunk_bytes;
    if (block_len < HEADER + payload_len) return 3;
    if (memcmp(block, tmpl, KEY_AT) != 0 || memcmp(block + KEY_AT, key, KEY_LEN) != 0
        || memcmp(block + LEN_AT, tmpl + LEN_AT, HEADER - LEN_AT) != 0)
        return 1;
    uint64_t sum;
    memcpy(&sum, block + SUM_AT, sizeof sum);
    const uint8_t *payload = block + HEADER;
    if (hash(payload, (size_t)payload_len) != sum) return 2;
    for (int64_t c = 0; c < nchunks; c++)
        memcpy(dst + offsets[c], payload + c * chunk_bytes, (size_t)chunk_bytes);
    return 0;
}

static void put_be64(uint8_t *out, uint64_t v)
{
    for (int i = 7; i >= 0; i--) { out[i] = (uint8_t)v; v >>= 8; }
}

/* tokens: n_blocks * block_size uint32; parent: 16 bytes; out: n_blocks * 16 bytes. */
int kv_block_keys(const uint8_t *parent, const uint32_t *tokens, int64_t n_blocks,
                  int64_t block_size, xxh128_fn hash, uint8_t *out)
{
    enum { MAX_STACK = 16 + 4 * 1024 };
    uint8_t buf[MAX_STACK];
    size_t span = (size_t)(4 * block_size);
    if (16 + span > sizeof buf) return 1;
    memcpy(buf, parent, 16);
    for (int64_t i = 0; i < n_blocks; i++) {
        memcpy(buf + 16, tokens + i * block_size, span);
        xxh128_t h = hash(buf, 16 + span);
        put_be64(out + 16 * i, h.high64);
        put_be64(out + 16 * i + 8, h.low64);
        memcpy(buf, out + 16 * i, 16);
    }
    return 0;
}
