/* copy_bytes: memcpy with the large part as aligned vector stores, shared by the store's
 * kernels (blocks.c, seqlock.c; kvstore/native/build.py hashes an included header with the
 * source, so a change here rebuilds both).
 *
 * glibc copies blocks of a few KiB and up with `rep movsb`, which on AMD Zen runs ~7x slower
 * when destination and source are 4 KiB aliased (dst - src mod 4096 small: a 360 KiB copy took
 * 135-200 us instead of 18-26 us).
 */
#ifndef KVSTORE_COPY_BYTES_H
#define KVSTORE_COPY_BYTES_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

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

#endif
