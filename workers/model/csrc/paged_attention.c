/* Paged attention for short chunks (decode, speculative verification) on CPU: fp32 arithmetic
 * over an fp32 or a bfloat16 pool (--kv-cache-dtype).
 *
 * Reads each sequence's K/V where they lie in the pool (no gathered copy) and computes
 * every (row, head) in a fixed order that depends only on that row's visible keys, so a
 * row's output is bit-identical alone, beside any batch mates, and as one of a verification
 * chunk's rows. Two loops, measured on each pool (docs/runtime.md):
 *   - fp32 pool, key by key (attend_seq): the keys are read where they lie, with the lines of
 *     the next keys prefetched; at 16 x 600 keys it reads the pool at memory bandwidth.
 *   - bf16 pool, TILE keys at a time (attend_tiles): each 8 values of a K or V row are widened
 *     in registers once for up to HB query heads of their KV head, 8 dot products are summed
 *     across lanes together (sum8_lanes) and 64 values of each head's output stay in registers
 *     over the tile's keys. Half the bytes and ~1.5x less arithmetic a (key, head): 1.1-1.5x
 *     less time a layer than the fp32 pool's (`python -m tools.bench attention`). The tiled
 *     loop over an fp32 pool read memory 30-40% slower than the key-by-key one, so fp32 keeps
 *     it.
 * Compiled on first use by workers/model/cpu_kernels.py; layout in its docstring.
 * Owns: the arithmetic. Does not own: the metadata (workers/model/attention.py) or the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Sums run in 16 lanes kept as two 8-lane halves: GCC lowers a 64-byte vector type to one
 * register only with AVX-512; on AVX2 it spilled it through the stack at every step, which
 * made a decode step's attention 3-5x slower. The halves give the bits 16 lanes would. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* unaligned loads allowed */
typedef int32_t i8v __attribute__((vector_size(32)));

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

#define AHEAD 4  /* keys ahead (the fp32 loop) */

/* Every cache line of `bytes` from p, ahead of their use. Inside a step a layer's keys come
 * from memory (the weights streamed through the caches since the layer before), and a task
 * split by KV head reads 256 of every slot's 768 bytes (SmolLM2): a stride the hardware does
 * not follow. Prefetching only a slot's first line, a whole decode step at batch 1 with 1,000
 * keys took 50 ms; with the task's lines, 32 ms (AVX2 Zen 3, in turns). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t j = 0; j < bytes; j += 64) __builtin_prefetch((const char *)p + j);
}

struct Shape {
    int64_t num_seqs, q_max, heads, kv_heads, head_dim, block_size, max_blocks;
    int64_t num_blocks;  /* of the pool layer */
    float scale;
    float softcap;  /* > 0: scores s become softcap * tanh(s / softcap) (Gemma 2) */
};

/* slots[t]: where key t of sequence a lies in a pool half (in values), t < num_keys; BAD_BLOCK
 * (nothing read) where its table names a block outside the pool. */
static int seq_slots(const struct Shape *sh, int64_t a, const int64_t *tables, int64_t num_keys, int64_t *slots) {
    const int64_t slot_size = sh->kv_heads * sh->head_dim;
    for (int64_t b = 0, t = 0; t < num_keys; b++) {
        const int64_t block_id = tables[a * sh->max_blocks + b];
        if (block_id < 0 || block_id >= sh->num_blocks) return BAD_BLOCK;
        for (int64_t i = 0; i < sh->block_size && t < num_keys; i++, t++)
            slots[t] = (block_id * sh->block_size + i) * slot_size;
    }
    return 0;
}

/* Pass 2 of both loops: heads [h0, h1) of each row's output zeroed, each (row, head)'s packed
 * scores turned into probabilities, the rows' cursors back to 0 for pass 3. */
static void softmax_rows(const struct Shape *sh, int64_t a, int64_t h0, int64_t h1, int64_t num_rows,
                         int64_t num_keys, float *out, float *probs, int64_t *cursor) {
    const int64_t d = sh->head_dim;
    for (int64_t i = 0; i < num_rows; i++) {
        float *oi = out + (a * sh->q_max + i) * sh->heads * d;
        memset(oi + h0 * d, 0, sizeof(float) * (h1 - h0) * d);
        for (int64_t h = h0; h < h1; h++)
            if (cursor[i] > 0) softmax(probs + (i * sh->heads + h) * num_keys, cursor[i]);
        cursor[i] = 0;
    }
}

/* The fp32 pool's loop. One sequence, query heads [h0, h1): rows [0, num_rows) of q/out, keys [0, num_keys).
 * probs: [num_rows, heads, num_keys] scratch, slots: [num_keys], cursor: [num_rows].
 *
 *   pass 1: for each key t (in order), for each row that sees t: its next score per head
 *   pass 2: each (row, head) softmax over its visible keys, packed in key order
 *   pass 3: for each key t (in order), for each row that sees t: out += p * V[t]
 */
static __attribute__((noinline)) int attend_seq(const struct Shape *sh, int64_t a, int64_t h0, int64_t h1,
                       const float *q, const float *kv, const int64_t *tables,
                       const uint8_t *mask, int64_t num_keys, int64_t num_rows, float *out,
                       float *probs, int64_t *slots, int64_t *cursor) {
    const int64_t group = sh->heads / sh->kv_heads, d = sh->head_dim;
    const int64_t slot_size = sh->kv_heads * d;
    const float *values = kv + sh->num_blocks * sh->block_size * slot_size;
    const int64_t mask_keys = sh->max_blocks * sh->block_size;
    const uint8_t *seq_mask = mask + a * sh->q_max * mask_keys;  /* [q_max, mask_keys] */
    if (seq_slots(sh, a, tables, num_keys, slots)) return BAD_BLOCK;
    memset(cursor, 0, sizeof(int64_t) * num_rows);
    /* this task's KV heads' bytes of a slot: [span0, span0 + span) floats */
    const int64_t span0 = (h0 / group) * d, span = ((h1 - 1) / group + 1) * d - span0;
    for (int64_t t = 0; t < num_keys; t++) {
        const float *key = kv + slots[t];
        if (t + AHEAD < num_keys) prefetch_span(kv + slots[t + AHEAD] + span0, span * 4);
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
    softmax_rows(sh, a, h0, h1, num_rows, num_keys, out, probs, cursor);
    for (int64_t t = 0; t < num_keys; t++) {
        const float *restrict v = values + slots[t];
        if (t + AHEAD < num_keys) prefetch_span(values + slots[t + AHEAD] + span0, span * 4);
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

/* ---------------------------------------------------------------- the bf16 pool's loop */

#define TILE 8  /* keys a pass handles together: one score lane each */
#ifndef TILE_AHEAD
#define TILE_AHEAD 4  /* keys prefetched ahead (longer distances measured slower) */
#endif

static inline v8 pair_sums(v8 a, v8 b, i8v even, i8v odd) {
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* Lane k of the result is the sum of a[k]'s 8 lanes in a fixed pairing, for 8 vectors
 * at once (14 shuffles and 7 adds instead of 8 horizontal sums of ~10 operations each): a
 * key's score takes the same operations whichever lane of whichever tile it falls in. */
static inline v8 sum8_lanes(const v8 *a) {
    const i8v e1 = {0, 8, 2, 10, 4, 12, 6, 14}, o1 = {1, 9, 3, 11, 5, 13, 7, 15};
    const i8v e2 = {0, 1, 8, 9, 4, 5, 12, 13}, o2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8v e3 = {0, 1, 2, 3, 8, 9, 10, 11}, o3 = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8 x01 = pair_sums(a[0], a[1], e1, o1), x23 = pair_sums(a[2], a[3], e1, o1);
    const v8 x45 = pair_sums(a[4], a[5], e1, o1), x67 = pair_sums(a[6], a[7], e1, o1);
    return pair_sums(pair_sums(x01, x23, e2, o2), pair_sums(x45, x67, e2, o2), e3, o3);
}

#if defined(__AVX512F__)
#define HB 3  /* query heads of one KV head computed together: HB x TILE accumulators, 32 registers */
#else
#define HB 1  /* 16 registers: one head at a time (the same bits) */
#endif

/* 8 bf16 values widened to fp32 (exact: a shift). With intrinsics: GCC compiled the same from
 * vector extensions into half-width loads and inserts that took half the bf16 loop's time. */
static inline v8 widen8(const uint16_t *p) {
#if defined(__AVX2__)
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    v8 out;
    memcpy(&out, &wide, sizeof out);
    return out;
#else
    v8 out;
    for (int j = 0; j < 8; j++) out[j] = float_of_bf16(p[j]);
    return out;
#endif
}

/* Scores of nh (<= HB) query vectors q[g] [d] against TILE key rows [d]: lane k of scores[g] is
 * q[g] . keys[k], each dot summed in 8 lanes (j mod 8, in order), then across them in a fixed
 * pairing, plus the products past the last multiple of 8 in order. A key's 8 values are widened
 * once for the nh heads; the TILE x nh sums advance together (independent chains of FMAs). */
static inline __attribute__((always_inline)) void dot_tile(const float *const *q, int nh, const uint16_t *const *keys,
                                                           int64_t d, v8 *scores) {
    v8 acc[HB][TILE];
    for (int g = 0; g < nh; g++)
        for (int k = 0; k < TILE; k++) acc[g][k] = (v8){0};
    const int64_t d8 = d & ~(int64_t)7;
    for (int64_t j = 0; j < d8; j += 8) {
        v8 qj[HB];
        for (int g = 0; g < nh; g++) qj[g] = *(const v8 *)(q[g] + j);
        for (int k = 0; k < TILE; k++) {
            const v8 key = widen8(keys[k] + j);
            for (int g = 0; g < nh; g++) acc[g][k] += qj[g] * key;
        }
    }
    for (int g = 0; g < nh; g++) {
        scores[g] = sum8_lanes(acc[g]);
        if (d8 < d)
            for (int k = 0; k < TILE; k++) {
                float tail = 0.0f;
                for (int64_t j = d8; j < d; j++) tail += q[g][j] * float_of_bf16(keys[k][j]);
                scores[g][k] += tail;
            }
    }
}

/* out[g] [d] += p[g][c] * values[c] [d] for c < n, in that order for every value, g < nh (<= HB):
 * 64 values of each head's output stay in registers over the keys, each value row widened once
 * for the nh heads. */
static inline __attribute__((always_inline)) void add_scaled_tile(float *const *out, int nh, const float *const *p,
                                                                  const uint16_t *const *values, int n, int64_t d) {
    int64_t j = 0;
    for (; j + 64 <= d; j += 64) {
        v8 o[HB][8];
        for (int g = 0; g < nh; g++)
            for (int c = 0; c < 8; c++) o[g][c] = *(v8 *)(out[g] + j + 8 * c);
        for (int k = 0; k < n; k++)
            for (int c = 0; c < 8; c++) {
                const v8 v = widen8(values[k] + j + 8 * c);
                for (int g = 0; g < nh; g++) o[g][c] += p[g][k] * v;
            }
        for (int g = 0; g < nh; g++)
            for (int c = 0; c < 8; c++) *(v8 *)(out[g] + j + 8 * c) = o[g][c];
    }
    for (; j + 8 <= d; j += 8)
        for (int g = 0; g < nh; g++) {
            v8 o = *(v8 *)(out[g] + j);
            for (int k = 0; k < n; k++) o += p[g][k] * widen8(values[k] + j);
            *(v8 *)(out[g] + j) = o;
        }
    for (; j < d; j++)
        for (int g = 0; g < nh; g++)
            for (int k = 0; k < n; k++) out[g][j] += p[g][k] * float_of_bf16(values[k][j]);
}

/* Keys [t, t + count) (those below num_keys) of a pool half, this task's bytes of each slot
 * [span0, span0 + span_bytes / 2), ahead of their use. */
static inline void prefetch_keys(const uint16_t *half, const int64_t *slots, int64_t t, int64_t count,
                                 int64_t num_keys, int64_t span0, int64_t span_bytes) {
    for (int64_t k = t; k < t + count && k < num_keys; k++) prefetch_span(half + slots[k] + span0, span_bytes);
}

/* The bf16 pool's loop: as attend_seq, TILE keys at a time, the query heads of a KV head HB at a
 * time. probs: [num_rows, heads, num_keys] scratch, slots: [num_keys], cursor: [num_rows],
 * zeros: [head_dim] (the rows of keys past the last, in the last tile).
 *
 *   pass 1: for each tile of TILE keys (in order), for each row: its scores per head for the
 *           tile (one vector), those of the keys the row sees packed in key order
 *   pass 2: each (row, head) softmax over its visible keys
 *   pass 3: for each tile of keys (in order), for each row: out += p * V[t] for the keys it
 *           sees, in key order
 * A row's bits depend on its visible keys only, not on where the tiles fall or which heads
 * share a pass. */
static inline __attribute__((always_inline)) int attend_tiles(
        const struct Shape *sh, int64_t a, int64_t h0, int64_t h1, const float *q, const uint16_t *kv,
        const int64_t *tables, const uint8_t *mask, int64_t num_keys, int64_t num_rows, float *out,
        float *probs, int64_t *slots, int64_t *cursor, const uint16_t *zeros, int64_t fixed_d) {
    /* fixed_d: head_dim as a constant where it is a common one (the compiler unrolls over it) */
    const int64_t group = sh->heads / sh->kv_heads, d = fixed_d ? fixed_d : sh->head_dim;
    const int64_t slot_size = sh->kv_heads * d;
    const uint16_t *values = kv + sh->num_blocks * sh->block_size * slot_size;
    const int64_t mask_keys = sh->max_blocks * sh->block_size;
    const uint8_t *seq_mask = mask + a * sh->q_max * mask_keys;  /* [q_max, mask_keys] */
    if (seq_slots(sh, a, tables, num_keys, slots)) return BAD_BLOCK;
    memset(cursor, 0, sizeof(int64_t) * num_rows);
    const int64_t g0 = h0 / group, g1 = (h1 - 1) / group + 1;  /* this task's KV heads */
    const int64_t span0 = g0 * d, span_bytes = (g1 - g0) * d * 2;
    prefetch_keys(kv, slots, 0, TILE_AHEAD, num_keys, span0, span_bytes);
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        prefetch_keys(kv, slots, t0 + TILE_AHEAD, TILE, num_keys, span0, span_bytes);
        for (int64_t i = 0; i < num_rows; i++) {
            const uint8_t *sees = seq_mask + i * mask_keys + t0;
            int64_t seen = 0;
            for (int k = 0; k < TILE && t0 + k < num_keys; k++) seen += sees[k] != 0;
            if (!seen) continue;
            const float *qi = q + (a * sh->q_max + i) * sh->heads * d;
            for (int64_t g = g0; g < g1; g++) {
                const uint16_t *keys[TILE];
                for (int k = 0; k < TILE; k++) keys[k] = t0 + k < num_keys ? kv + slots[t0 + k] + g * d : zeros;
                const int64_t last = h1 < (g + 1) * group ? h1 : (g + 1) * group;
                for (int64_t h = h0 > g * group ? h0 : g * group; h < last; h += HB) {
                    const int nh = last - h < HB ? (int)(last - h) : HB;
                    const float *qh[HB];
                    v8 scores[HB];
                    for (int j = 0; j < nh; j++) qh[j] = qi + (h + j) * d;
                    if (nh == HB) dot_tile(qh, HB, keys, d, scores);  /* (a constant count: registers) */
                    else dot_tile(qh, nh, keys, d, scores);
                    for (int j = 0; j < nh; j++) {
                        float *pi = probs + (i * sh->heads + h + j) * num_keys + cursor[i];
                        for (int k = 0, c = 0; k < TILE && t0 + k < num_keys; k++) {
                            if (!sees[k]) continue;
                            const float s = scores[j][k] * sh->scale;
                            pi[c++] = sh->softcap > 0.0f ? sh->softcap * tanhf(s / sh->softcap) : s;
                        }
                    }
                }
            }
            cursor[i] += seen;
        }
    }
    softmax_rows(sh, a, h0, h1, num_rows, num_keys, out, probs, cursor);
    prefetch_keys(values, slots, 0, TILE_AHEAD, num_keys, span0, span_bytes);
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        prefetch_keys(values, slots, t0 + TILE_AHEAD, TILE, num_keys, span0, span_bytes);
        for (int64_t i = 0; i < num_rows; i++) {
            const uint8_t *sees = seq_mask + i * mask_keys + t0;
            int n = 0;
            int seen_keys[TILE];
            for (int k = 0; k < TILE && t0 + k < num_keys; k++)
                if (sees[k]) seen_keys[n++] = k;
            if (!n) continue;
            float *oi = out + (a * sh->q_max + i) * sh->heads * d;
            for (int64_t g = g0; g < g1; g++) {
                const uint16_t *rows[TILE];
                for (int c = 0; c < n; c++) rows[c] = values + slots[t0 + seen_keys[c]] + g * d;
                const int64_t last = h1 < (g + 1) * group ? h1 : (g + 1) * group;
                for (int64_t h = h0 > g * group ? h0 : g * group; h < last; h += HB) {
                    const int nh = last - h < HB ? (int)(last - h) : HB;
                    float *oh[HB];
                    const float *ph[HB];
                    for (int j = 0; j < nh; j++) {
                        oh[j] = oi + (h + j) * d;
                        ph[j] = probs + (i * sh->heads + h + j) * num_keys + cursor[i];
                    }
                    if (nh == HB) add_scaled_tile(oh, HB, ph, rows, n, d);
                    else add_scaled_tile(oh, nh, ph, rows, n, d);
                }
            }
            cursor[i] += n;
        }
    }
    return 0;
}

static __attribute__((noinline)) int attend_bf16(
        const struct Shape *sh, int64_t a, int64_t h0, int64_t h1, const float *q, const uint16_t *kv,
        const int64_t *tables, const uint8_t *mask, int64_t keys, int64_t rows, float *out, float *probs,
        int64_t *slots) {
    uint16_t *zeros = (uint16_t *)(probs + rows * sh->heads * keys);
    memset(zeros, 0, sizeof(uint16_t) * sh->head_dim);
#define TILES(D) attend_tiles(sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots, slots + keys, \
                              zeros, D)
    return sh->head_dim == 64 ? TILES(64) : sh->head_dim == 128 ? TILES(128) : TILES(0);
#undef TILES
}

/* q, out: [num_seqs, q_max, heads, head_dim]; kv: [2, num_blocks, block_size, kv_heads,
 * head_dim], fp32 or (bf16) uint16 bits; tables: [num_seqs, max_blocks]; mask: [num_seqs, q_max,
 * max_blocks * block_size] (nonzero: row sees key; a sliding window is a mask too); num_keys,
 * num_rows: [num_seqs]. Scores are q . k * scale, soft-capped when softcap > 0. Rows past
 * num_rows[a] are left as they are. Returns 0, OUT_OF_MEMORY (scratch), or BAD_BLOCK (a table
 * entry outside the pool: nothing is read from it). */
static int attend_short(const float *q, const void *kv, const int64_t *tables, const uint8_t *mask,
                        const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                        float scale, float softcap, int num_threads, int bf16) {
    const struct Shape sh = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                             dims[7], scale, softcap};
    /* fewer sequences than threads: split each by KV head so every thread has work */
    const int64_t splits = sh.num_seqs < num_threads ? sh.kv_heads : 1;
    const int64_t heads_per_split = sh.heads / splits;
    const int64_t tile_floats = bf16 ? sh.head_dim : 0;  /* zeros (bf16: half of it) */
    int status = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(min:status)
    for (int64_t task = 0; task < sh.num_seqs * splits; task++) {
        const int64_t a = task / splits, h0 = (task % splits) * heads_per_split, h1 = h0 + heads_per_split;
        const int64_t keys = num_keys[a], rows = num_rows[a];
        float *probs = malloc(sizeof(float) * (rows * sh.heads * keys + tile_floats));
        int64_t *slots = malloc(sizeof(int64_t) * (keys + rows));
        int done = OUT_OF_MEMORY;
        if (probs && slots && !bf16) {
            done = attend_seq(&sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots, slots + keys);
        } else if (probs && slots) {
            done = attend_bf16(&sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots);
        }
        status = done < status ? done : status;
        free(probs);
        free(slots);
    }
    return status;
}

int paged_attention_short(const float *q, const float *kv, const int64_t *tables, const uint8_t *mask,
                          const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                          float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, 0);
}

/* The same over a bfloat16 pool (kv as uint16 bits, same layout). */
int paged_attention_short_bf16(const float *q, const uint16_t *kv, const int64_t *tables, const uint8_t *mask,
                               const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                               float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, 1);
}
