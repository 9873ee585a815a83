/* Decode attention over the paged KV cache, read in place (CPU, float32).
 *
 * One query token per sequence. For each (sequence, KV head) pair, the query heads of that
 * KV group are scored against the sequence's keys block by block, straight from the cache
 * (no gather into a contiguous copy), softmaxed, and used to weight the values. Every key and
 * value is read from memory once per step, which is the floor for memory-bound decode.
 *
 *   q            [n, num_heads, head_dim]                    contiguous
 *   k_cache      [num_blocks, block_size, kv_heads, head_dim] contiguous (one layer)
 *   v_cache      same layout as k_cache
 *   block_tables [n, bt_stride] int32, the first ceil(ctx / block_size) entries valid
 *   context_lens [n] int32, keys to attend over (>= 1)
 *   out          [n, num_heads, head_dim]                    contiguous
 *   scratch      [num_threads, group * max_ctx] float32, per-thread scores
 *
 * Work is split over the n * kv_heads pairs with OpenMP; linked against the process's
 * libgomp (the one torch loaded), so torch's threads and these are one pool.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                     float *out, float *scratch, int64_t max_ctx, int n, int num_heads,
                     int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return -1;
    const int group = num_heads / kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -2;
    const int64_t tok_stride = (int64_t)kv_heads * head_dim;   /* floats between slots */
    const int64_t blk_stride = (int64_t)block_size * tok_stride;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t w = 0; w < (int64_t)n * kv_heads; w++) {
        const int s = (int)(w / kv_heads), h = (int)(w % kv_heads);
        const int ctx = context_lens[s];
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
        const float *qs = q + ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;
        float *scores = scratch + (int64_t)omp_get_thread_num() * group * max_ctx;

        /* scores[g][t] = scale * q_g . k_t, keys read block by block in place */
        for (int t0 = 0; t0 < ctx; t0 += block_size) {
            const float *kb = k_cache + (int64_t)table[t0 / block_size] * blk_stride
                              + (int64_t)h * head_dim;
            const int len = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int j = 0; j < len; j++) {
                const float *kt = kb + j * tok_stride;
                for (int g = 0; g < group; g++)
                    scores[(int64_t)g * max_ctx + t0 + j] = scale * dot(qs + g * head_dim, kt, head_dim);
            }
        }
        /* softmax per query head; 1/sum applied at the end */
        float inv_sum[MAX_GROUP];
        for (int g = 0; g < group; g++) {
            float *sc = scores + (int64_t)g * max_ctx;
            float m = sc[0];
            for (int t = 1; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < ctx; t++) {
                sc[t] = expf(sc[t] - m);
                sum += sc[t];
            }
            inv_sum[g] = 1.0f / sum;
        }
        /* out_g = sum_t p[g][t] v_t, values read block by block in place */
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        for (int g = 0; g < group; g++) memset(acc[g], 0, sizeof(float) * head_dim);
        for (int t0 = 0; t0 < ctx; t0 += block_size) {
            const float *vb = v_cache + (int64_t)table[t0 / block_size] * blk_stride
                              + (int64_t)h * head_dim;
            const int len = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int j = 0; j < len; j++) {
                const float *vt = vb + j * tok_stride;
                for (int g = 0; g < group; g++) {
                    const float p = scores[(int64_t)g * max_ctx + t0 + j];
                    float *a = acc[g];
#pragma omp simd
                    for (int i = 0; i < head_dim; i++) a[i] += p * vt[i];
                }
            }
        }
        float *os = out + ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;
        for (int g = 0; g < group; g++)
            for (int i = 0; i < head_dim; i++) os[g * head_dim + i] = acc[g][i] * inv_sum[g];
    }
    return 0;
}
