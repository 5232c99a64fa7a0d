/* Paged attention for short chunks (decode, speculative verification) on CPU, fp32.
 *
 * Reads each sequence's K/V where they lie in the pool (no gathered copy) and computes
 * every (row, head) in a fixed order that depends only on that row's visible keys, so a
 * row's output is bit-identical alone, beside any batch mates, and as one of a verification
 * chunk's rows. Compiled on first use by workers/model/cpu_kernels.py; layout in its docstring.
 * Owns: the arithmetic. Does not own: the metadata (workers/model/attention.py) or the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"

/* Sums run in 16 lanes kept as two 8-lane halves: GCC lowers a 64-byte vector type to one
 * register only with AVX-512; on AVX2 it spilled it through the stack at every step, which
 * made a decode step's attention 3-5x slower. The halves give the bits 16 lanes would. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* unaligned loads allowed */

static inline float sum16(v8 lo, v8 hi) {  /* a fixed pairing: the same bits on every call */
    const v8 s = lo + hi;
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        lo += *(const v8 *)(a + j) * *(const v8 *)(b + j);
        hi += *(const v8 *)(a + j + 8) * *(const v8 *)(b + j + 8);
    }
    float tail = 0.0f;
    for (; j < n; j++) tail += a[j] * b[j];
    return sum16(lo, hi) + tail;
}

static float sum(const float *x, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        lo += *(const v8 *)(x + j);
        hi += *(const v8 *)(x + j + 8);
    }
    float tail = 0.0f;
    for (; j < n; j++) tail += x[j];
    return sum16(lo, hi) + tail;
}

/* In place: scores [n] -> probabilities [n]. */
static void softmax(float *s, int64_t n) {
    float top = -INFINITY;
    for (int64_t k = 0; k < n; k++) top = s[k] > top ? s[k] : top;
    for (int64_t k = 0; k < n; k++) s[k] = exp_nonpositive(s[k] - top);
    const float inv = 1.0f / sum(s, n);
    for (int64_t k = 0; k < n; k++) s[k] *= inv;
}

enum { OUT_OF_MEMORY = -1, BAD_BLOCK = -2 };

#define AHEAD 4  /* keys ahead */

/* Every cache line of n floats from p, ahead of their use. Inside a step a layer's keys come
 * from memory (the weights streamed through the caches since the layer before), and a task
 * split by KV head reads 256 of every slot's 768 bytes (SmolLM2): a stride the hardware does
 * not follow. Prefetching only a slot's first line, a whole decode step at batch 1 with 1,000
 * keys took 50 ms; with the task's lines, 32 ms (AVX2 Zen 3, in turns). */
static inline void prefetch_span(const float *p, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(p + j);
}

struct Shape {
    int64_t num_seqs, q_max, heads, kv_heads, head_dim, block_size, max_blocks;
    int64_t num_blocks;  /* of the pool layer */
    float scale;
    float softcap;  /* > 0: scores s become softcap * tanh(s / softcap) (Gemma 2) */
};

/* One sequence, query heads [h0, h1): rows [0, num_rows) of q/out, keys [0, num_keys).
 * probs: [num_rows, heads, num_keys] scratch, slots: [num_keys], cursor: [num_rows].
 *
 *   pass 1: for each key t (in order), for each row that sees t: its next score per head
 *   pass 2: each (row, head) softmax over its visible keys, packed in key order
 *   pass 3: for each key t (in order), for each row that sees t: out += p * V[t]
 */
static int attend_seq(const struct Shape *sh, int64_t a, int64_t h0, int64_t h1,
                       const float *q, const float *kv, const int64_t *tables,
                       const uint8_t *mask, int64_t num_keys, int64_t num_rows, float *out,
                       float *probs, int64_t *slots, int64_t *cursor) {
    const int64_t group = sh->heads / sh->kv_heads, d = sh->head_dim;
    const int64_t slot_size = sh->kv_heads * d;
    const float *values = kv + sh->num_blocks * sh->block_size * slot_size;
    const int64_t mask_keys = sh->max_blocks * sh->block_size;
    const uint8_t *seq_mask = mask + a * sh->q_max * mask_keys;  /* [q_max, mask_keys] */
    for (int64_t t = 0; t < num_keys; t++) {
        const int64_t block_id = tables[a * sh->max_blocks + t / sh->block_size];
        if (block_id < 0 || block_id >= sh->num_blocks) return BAD_BLOCK;
        slots[t] = (block_id * sh->block_size + t % sh->block_size) * slot_size;
    }
    memset(cursor, 0, sizeof(int64_t) * num_rows);
    /* this task's KV heads' bytes of a slot: [span0, span0 + span) floats */
    const int64_t span0 = (h0 / group) * d, span = ((h1 - 1) / group + 1) * d - span0;
    for (int64_t t = 0; t < num_keys; t++) {
        const float *key = kv + slots[t];
        if (t + AHEAD < num_keys) prefetch_span(kv + slots[t + AHEAD] + span0, span);
        for (int64_t i = 0; i < num_rows; i++) {
            if (!seq_mask[i * mask_keys + t]) continue;
            const float *qi = q + (a * sh->q_max + i) * sh->heads * d;
            float *pi = probs + i * sh->heads * num_keys + cursor[i]++;
            for (int64_t h = h0; h < h1; h++) {
                const float s = dot(qi + h * d, key + (h / group) * d, d) * sh->scale;
                pi[h * num_keys] = sh->softcap > 0.0f ? sh->softcap * tanhf(s / sh->softcap) : s;
            }
        }
    }
    for (int64_t i = 0; i < num_rows; i++) {
        float *oi = out + (a * sh->q_max + i) * sh->heads * d;
        memset(oi + h0 * d, 0, sizeof(float) * (h1 - h0) * d);
        for (int64_t h = h0; h < h1; h++)
            if (cursor[i] > 0) softmax(probs + (i * sh->heads + h) * num_keys, cursor[i]);
        cursor[i] = 0;
    }
    for (int64_t t = 0; t < num_keys; t++) {
        const float *restrict v = values + slots[t];
        if (t + AHEAD < num_keys) prefetch_span(values + slots[t + AHEAD] + span0, span);
        for (int64_t i = 0; i < num_rows; i++) {
            if (!seq_mask[i * mask_keys + t]) continue;
            const int64_t k = cursor[i]++;
            float *oi = out + (a * sh->q_max + i) * sh->heads * d;
            for (int64_t h = h0; h < h1; h++) {
                const float p = probs[(i * sh->heads + h) * num_keys + k];
                const float *restrict vh = v + (h / group) * d;
                float *restrict oh = oi + h * d;
                for (int64_t j = 0; j < d; j++) oh[j] += p * vh[j];
            }
        }
    }
    return 0;
}

/* q, out: [num_seqs, q_max, heads, head_dim]; kv: [2, num_blocks, block_size, kv_heads,
 * head_dim]; tables: [num_seqs, max_blocks]; mask: [num_seqs, q_max, max_blocks * block_size]
 * (nonzero: row sees key; a sliding window is a mask too); num_keys, num_rows: [num_seqs].
 * Scores are q . k * scale, soft-capped when softcap > 0. Rows past num_rows[a] are left
 * as they are. Returns 0, OUT_OF_MEMORY (scratch), or BAD_BLOCK (a table entry outside the
 * pool: nothing is read from it). */
int paged_attention_short(const float *q, const float *kv, const int64_t *tables,
                          const uint8_t *mask, const int64_t *num_keys,
                          const int64_t *num_rows, float *out, const int64_t *dims,
                          float scale, float softcap, int num_threads) {
    const struct Shape sh = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                             dims[7], scale, softcap};
    /* fewer sequences than threads: split each by KV head so every thread has work */
    const int64_t splits = sh.num_seqs < num_threads ? sh.kv_heads : 1;
    const int64_t heads_per_split = sh.heads / splits;
    int status = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(min:status)
    for (int64_t task = 0; task < sh.num_seqs * splits; task++) {
        const int64_t a = task / splits, h0 = (task % splits) * heads_per_split;
        const int64_t keys = num_keys[a], rows = num_rows[a];
        float *probs = malloc(sizeof(float) * rows * sh.heads * keys);
        int64_t *slots = malloc(sizeof(int64_t) * (keys + rows));
        const int done = probs && slots
            ? attend_seq(&sh, a, h0, h0 + heads_per_split, q, kv, tables, mask, keys, rows,
                         out, probs, slots, slots + keys)
            : OUT_OF_MEMORY;
        status = done < status ? done : status;
        free(probs);
        free(slots);
    }
    return status;
}
