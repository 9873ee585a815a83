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
#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

/* memcpy, with the large part as aligned vector stores (glibc's memcpy of a few KiB and up is rep movsb, which on AMD
 * Zen runs several times slower when dst - src is small mod 4096). */
static void copy_bytes(uint8_t *dst, const uint8_t *src, uint64_t n) {
#if defined(__AVX2__)
    if (n >= 256) {
        uint64_t head = (32 - ((uintptr_t)dst & 31)) & 31;
        memcpy(dst, src, 32);
        dst += head; src += head; n -= head;
        for (; n >= 128; src += 128, dst += 128, n -= 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)src);
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
            _mm256_store_si256((__m256i *)dst, a);
            _mm256_store_si256((__m256i *)(dst + 32), b);
            _mm256_store_si256((__m256i *)(dst + 64), c);
            _mm256_store_si256((__m256i *)(dst + 96), d);
        }
    }
#elif defined(__SSE2__)
    if (n >= 256) {
        uint64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, 16);
        dst += head; src += head; n -= head;
        for (; n >= 64; src += 64, dst += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_store_si128((__m128i *)dst, a);
            _mm_store_si128((__m128i *)(dst + 16), b);
            _mm_store_si128((__m128i *)(dst + 32), c);
            _mm_store_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}


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
