/* Block kernels of the store's clients (kvstore/native/blocks.py loads them).
 *
 * kv_verify_scatter: verify one encoded block (kvstore/codec.py's layout) where it lies, then
 * copy its payload out in chunks. The header must equal the caller's template (magic, version,
 * dtype, ndim, payload length, shape) with the block's own key, and the payload's XXH3-64 must
 * equal the header's checksum; only then is anything written, chunk c of chunk_bytes bytes going
 * to dst + offsets[c]. The block is hashed first and copied second: a block that fits in L2
 * (the default model's 736 KiB) is read from memory once.
 *
 * The hash function comes from the xxhash wheel's library as a pointer: its digest is the wheel's.
 */
#include <stdint.h>
#include <string.h>
#include "copy_bytes.h"

typedef uint64_t (*xxh64_fn)(const void *data, size_t len);

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
        if (dst + offsets[c] != payload + c * chunk_bytes)  /* verified in place: no copy */
            copy_bytes(dst + offsets[c], payload + c * chunk_bytes, (uint64_t)chunk_bytes);
    return 0;
}
