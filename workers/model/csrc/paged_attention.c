/* Paged attention for short chunks (decode, speculative verification) on CPU: fp32 arithmetic
 * over an fp32 or a bfloat16 pool (--kv-cache-dtype; with AVX512-BF16, optionally bf16 products there).
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
 *   - bf16 pool on AVX-512 (head_dim a multiple of 32, up to 256), keys in lanes (attend_lanes):
 *     a tile of 16 keys is widened and transposed once (vpermt2w), then each (row, head) scores
 *     it with one FMA a value of its query (16 keys a vector: no sums across lanes), and the
 *     values are added with the output rows in registers. Sequences whose block tables start
 *     alike (a cached prompt) are one task, so each shared tile is read and transposed once for
 *     all their rows. At 16 decodes sharing 512 of 561 keys, 5.0-5.5 ns a (key, head) against
 *     the tiled loop's 9.0-9.7; without sharing 12-14 against 13-15 (memory-bound) (2 threads,
 *     Zen 4).
 *     A lone sequence's chunk of more than SLICE_ROWS rows (a prompt's rest after a cached prefix)
 *     is split into tasks of SLICE_ROWS rows, each reading only the keys its rows can see: the
 *     threads share one sequence, and a chunk from position 0 reads half the keys.
 *   - the same with AVX512-BF16, products of bf16 pairs (paged_attention_short_bf16_pairs): the
 *     query and the probabilities are rounded to bf16 (as the pool's K and V are) and each
 *     vdpbf16ps adds two exact products of pairs: half the multiply-adds, the keys transposed as
 *     32-bit pairs, the values zipped two keys at a time. The values move by up to ~2^-8 of their
 *     scale (as the pool's own rounding moves them). On Zen 4, shared 512 of 561 keys 4.8-5.0 ->
 *     3.7-3.9 ns, unshared 15-20% less; on a Xeon with AMX 5-30% slower than the fp32 products
 *     (vdpbf16ps issues on one port there, FMAs on two), so the caller measures both once per CPU.
 * Compiled on first use by workers/model/cpu_kernels.py; layout in its docstring.
 * Owns: the arithmetic. Does not own: the metadata (workers/model/attention.py) or the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"
#include "fp16.h"

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

enum { OUT_OF_MEMORY = -1, BAD_BLOCK = -2, BAD_SHAPE = -3 };

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

/* The entry's own bounds, before anything is read: dims that make sense, and each sequence's
 * keys within its block table (max_blocks * block_size: the table row and the mask row end
 * there) and its rows within the padded batch (q_max). BAD_SHAPE otherwise. */
static int check_shape(const struct Shape *sh, const int64_t *num_keys, const int64_t *num_rows) {
    if (sh->num_seqs < 0 || sh->q_max < 0 || sh->heads < 1 || sh->kv_heads < 1 || sh->heads % sh->kv_heads ||
        sh->head_dim < 1 || sh->block_size < 1 || sh->max_blocks < 0 || sh->num_blocks < 0)
        return BAD_SHAPE;
    const int64_t table_keys = sh->max_blocks * sh->block_size;
    for (int64_t a = 0; a < sh->num_seqs; a++)
        if (num_keys[a] < 0 || num_keys[a] > table_keys || num_rows[a] < 0 || num_rows[a] > sh->q_max)
            return BAD_SHAPE;
    return 0;
}

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

/* One 16-bit pool value widened to fp32 (exact): bf16, or f16 where f16 is set. */
static inline __attribute__((always_inline)) float widen1(uint16_t h, const int f16) {
    return f16 ? float_of_f16(h) : float_of_bf16(h);
}

/* 8 bf16 (f16: halves) values widened to fp32 (exact: a shift; F16C's conversion). With
 * intrinsics: GCC compiled the same from vector extensions into half-width loads and inserts
 * that took half the bf16 loop's time. */
static inline __attribute__((always_inline)) v8 widen8(const uint16_t *p, const int f16) {
    v8 out;
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (f16) {
        const __m256 wide = _mm256_cvtph_ps(raw);
        memcpy(&out, &wide, sizeof out);
        return out;
    }
#endif
#if defined(__AVX2__)
    if (!f16) {
        const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
        memcpy(&out, &wide, sizeof out);
        return out;
    }
#endif
    for (int j = 0; j < 8; j++) out[j] = widen1(p[j], f16);
    return out;
}

/* Scores of nh (<= HB) query vectors q[g] [d] against TILE key rows [d]: lane k of scores[g] is
 * q[g] . keys[k], each dot summed in 8 lanes (j mod 8, in order), then across them in a fixed
 * pairing, plus the products past the last multiple of 8 in order. A key's 8 values are widened
 * once for the nh heads; the TILE x nh sums advance together (independent chains of FMAs). */
static inline __attribute__((always_inline)) void dot_tile(const float *const *q, int nh, const uint16_t *const *keys,
                                                           int64_t d, v8 *scores, const int f16) {
    v8 acc[HB][TILE];
    for (int g = 0; g < nh; g++)
        for (int k = 0; k < TILE; k++) acc[g][k] = (v8){0};
    const int64_t d8 = d & ~(int64_t)7;
    for (int64_t j = 0; j < d8; j += 8) {
        v8 qj[HB];
        for (int g = 0; g < nh; g++) qj[g] = *(const v8 *)(q[g] + j);
        for (int k = 0; k < TILE; k++) {
            const v8 key = widen8(keys[k] + j, f16);
            for (int g = 0; g < nh; g++) acc[g][k] += qj[g] * key;
        }
    }
    for (int g = 0; g < nh; g++) {
        scores[g] = sum8_lanes(acc[g]);
        if (d8 < d)
            for (int k = 0; k < TILE; k++) {
                float tail = 0.0f;
                for (int64_t j = d8; j < d; j++) tail += q[g][j] * widen1(keys[k][j], f16);
                scores[g][k] += tail;
            }
    }
}

/* out[g] [d] += p[g][c] * values[c] [d] for c < n, in that order for every value, g < nh (<= HB):
 * 64 values of each head's output stay in registers over the keys, each value row widened once
 * for the nh heads. */
static inline __attribute__((always_inline)) void add_scaled_tile(float *const *out, int nh, const float *const *p,
                                                                  const uint16_t *const *values, int n, int64_t d,
                                                                  const int f16) {
    int64_t j = 0;
    for (; j + 64 <= d; j += 64) {
        v8 o[HB][8];
        for (int g = 0; g < nh; g++)
            for (int c = 0; c < 8; c++) o[g][c] = *(v8 *)(out[g] + j + 8 * c);
        for (int k = 0; k < n; k++)
            for (int c = 0; c < 8; c++) {
                const v8 v = widen8(values[k] + j + 8 * c, f16);
                for (int g = 0; g < nh; g++) o[g][c] += p[g][k] * v;
            }
        for (int g = 0; g < nh; g++)
            for (int c = 0; c < 8; c++) *(v8 *)(out[g] + j + 8 * c) = o[g][c];
    }
    for (; j + 8 <= d; j += 8)
        for (int g = 0; g < nh; g++) {
            v8 o = *(v8 *)(out[g] + j);
            for (int k = 0; k < n; k++) o += p[g][k] * widen8(values[k] + j, f16);
            *(v8 *)(out[g] + j) = o;
        }
    for (; j < d; j++)
        for (int g = 0; g < nh; g++)
            for (int k = 0; k < n; k++) out[g][j] += p[g][k] * widen1(values[k][j], f16);
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
        float *probs, int64_t *slots, int64_t *cursor, const uint16_t *zeros, int64_t fixed_d, const int f16) {
    /* fixed_d: head_dim as a constant where it is a common one (the compiler unrolls over it);
     * f16: the pool holds halves (else bf16) */
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
                    if (nh == HB) dot_tile(qh, HB, keys, d, scores, f16);  /* (a constant count: registers) */
                    else dot_tile(qh, nh, keys, d, scores, f16);
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
                    if (nh == HB) add_scaled_tile(oh, HB, ph, rows, n, d, f16);
                    else add_scaled_tile(oh, nh, ph, rows, n, d, f16);
                }
            }
            cursor[i] += n;
        }
    }
    return 0;
}

/* The tiled loop over a 16-bit pool: bf16, or halves where f16 is set. */
static __attribute__((noinline)) int attend_half(
        const struct Shape *sh, int64_t a, int64_t h0, int64_t h1, const float *q, const uint16_t *kv,
        const int64_t *tables, const uint8_t *mask, int64_t keys, int64_t rows, float *out, float *probs,
        int64_t *slots, int f16) {
    uint16_t *zeros = (uint16_t *)(probs + rows * sh->heads * keys);
    memset(zeros, 0, sizeof(uint16_t) * sh->head_dim);
#define TILES(D, F) attend_tiles(sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots, slots + keys, \
                                 zeros, D, F)
    if (f16) return sh->head_dim == 64 ? TILES(64, 1) : sh->head_dim == 128 ? TILES(128, 1) : TILES(0, 1);
    return sh->head_dim == 64 ? TILES(64, 0) : sh->head_dim == 128 ? TILES(128, 0) : TILES(0, 0);
#undef TILES
}

/* ------------------------------------------- the bf16 pool's loop on AVX-512: keys in lanes */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define LANES_LOOP 1
#define KEYS 16       /* keys a tile: one lane each */
#define MAX_LANES_D 256
#define QK_ROWS 6     /* (row, head)s a pass of the score loop: 4 x 6 chains of FMAs */
#define MEMBERS 8     /* sequences sharing a prefix in one task: their rows share each key tile */
#define SLICE_ROWS 32 /* a lone sequence's longer chunk is tasks of this many rows (each its own keys) */
#if defined(__AVX512BF16__)
#define CAN_PAIR 1  /* built too: products of bf16 pairs (vdpbf16ps), the query and the probabilities rounded to bf16 */
#else
#define CAN_PAIR 0  /* fp32 FMAs over the widened keys and values only */
#endif

/* One (row, head) of a task: its query, scores/probabilities [ceil16(keys)] (key t in lane t mod
 * 16 of its tile), mask row, output, and its sequence's key count. */
struct LaneRow {
    const float *q;
    const uint32_t *q2;  /* pairs: q rounded to bf16, value 2i in the low half of pair i */
    float *p;
    const uint8_t *mask;
    float *out;
    int64_t keys;
};

/* The index vectors of the tile transposition (vpermt2w): three rounds of zips, then one that
 * leaves key k of a tile's j-th value at the word unpacking with zeros widens into lane k. */
struct Transpose { __m512i zip_lo, zip_hi, last_lo, last_hi, pair_lo, pair_hi; };

static void transpose_plan(struct Transpose *t) {
    uint16_t lo[32], hi[32], last_lo[32], last_hi[32];
    for (int e = 0; e < 32; e++) {
        lo[e] = (uint16_t)((e & 1) * 32 + e / 2);  /* a[0], b[0], a[1], b[1], ... a[15], b[15] */
        hi[e] = (uint16_t)(lo[e] + 16);            /* the same of a[16..31], b[16..31] */
    }
    /* after four zips, register m holds value 2m of keys 0..15 in words 0..15, value 2m + 1 in
     * words 16..31; unpacking with zeros widens words 8L + i (i < 4) into lane 4L + i, words
     * 8L + 4 + i into lane 4L + i of the other half */
    for (int pos = 0; pos < 32; pos++) {
        const int key = (pos / 8) * 4 + pos % 4, second = (pos % 8) / 4;
        last_lo[pos] = lo[16 * second + key];
        last_hi[pos] = hi[16 * second + key];
    }
    uint32_t pair_lo[16], pair_hi[16];  /* the same zips of 32-bit pairs: four rounds transpose 16 x 16 */
    for (int e = 0; e < 16; e++) {
        pair_lo[e] = (uint32_t)((e & 1) * 16 + e / 2);
        pair_hi[e] = pair_lo[e] + 8;
    }
    t->pair_lo = _mm512_loadu_si512(pair_lo);
    t->pair_hi = _mm512_loadu_si512(pair_hi);
    t->zip_lo = _mm512_loadu_si512(lo);
    t->zip_hi = _mm512_loadu_si512(hi);
    t->last_lo = _mm512_loadu_si512(last_lo);
    t->last_hi = _mm512_loadu_si512(last_hi);
}

/* kt [d][16] = the 16 key rows [d] widened and transposed: kt[j][k] = keys[k][j] (exact). A
 * pool of halves (f16) takes a fourth round of zips (register m: value 2m of the 16 keys in its
 * low 256 bits, 2m + 1 in its high) and F16C's conversion in place of the shift. */
static inline __attribute__((always_inline)) void transpose_keys(const struct Transpose *t, const uint16_t *const *keys,
                                                                 int64_t d, float *kt, const int f16) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t c = 0; c < d; c += 32) {
        __m512i r[16], x[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512(keys[k] + c);
        for (int round = 0; round < (f16 ? 4 : 3); round++) {
            for (int m = 0; m < 8; m++) {
                x[2 * m] = _mm512_permutex2var_epi16(r[m], t->zip_lo, r[m + 8]);
                x[2 * m + 1] = _mm512_permutex2var_epi16(r[m], t->zip_hi, r[m + 8]);
            }
            memcpy(r, x, sizeof r);
        }
        if (f16) {
            for (int m = 0; m < 16; m++) {
                _mm512_store_ps(kt + (c + 2 * m) * 16, _mm512_cvtph_ps(_mm512_castsi512_si256(r[m])));
                _mm512_store_ps(kt + (c + 2 * m + 1) * 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(r[m], 1)));
            }
            continue;
        }
        for (int m = 0; m < 8; m++) {
            const __m512i a = _mm512_permutex2var_epi16(r[m], t->last_lo, r[m + 8]);
            const __m512i b = _mm512_permutex2var_epi16(r[m], t->last_hi, r[m + 8]);
            /* a holds values c + 4m, c + 4m + 1; b values c + 4m + 2, c + 4m + 3 */
            _mm512_store_ps(kt + (c + 4 * m) * 16, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)));
            _mm512_store_ps(kt + (c + 4 * m + 1) * 16, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)));
            _mm512_store_ps(kt + (c + 4 * m + 2) * 16, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, b)));
            _mm512_store_ps(kt + (c + 4 * m + 3) * 16, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, b)));
        }
    }
}

/* kt [d / 2][16] = the 16 key rows [d] as bf16 pairs, transposed: kt[i][k] = (keys[k][2i],
 * keys[k][2i + 1]), the bits as stored (the pairs loop). */
static inline __attribute__((always_inline)) void transpose_pairs(const struct Transpose *t, const uint16_t *const *keys,
                                                                  int64_t d, uint32_t *kt) {
    for (int64_t c = 0; c < d; c += 32) {
        __m512i r[16], x[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512(keys[k] + c);
        for (int round = 0; round < 4; round++) {
            for (int m = 0; m < 8; m++) {
                x[2 * m] = _mm512_permutex2var_epi32(r[m], t->pair_lo, r[m + 8]);
                x[2 * m + 1] = _mm512_permutex2var_epi32(r[m], t->pair_hi, r[m + 8]);
            }
            memcpy(r, x, sizeof r);
        }
        for (int i = 0; i < 16; i++) _mm512_store_si512(kt + (c / 2 + i) * 16, r[i]);
    }
}

/* Scores of rows [0, n) (n <= QK_ROWS) against a tile: lane k of s[r] = sum over j of
 * q[r][j] * kt[j][k], summed in 4 chains (j mod 4, each in order of j) added as (0 + 1) + (2 + 3).
 * The same operations whatever n is and whichever rows share the pass. */
static inline __attribute__((always_inline)) void tile_scores(const void *kt, int64_t d, const struct LaneRow *rows,
                                                              int n, __m512 *s, const int pairs) {
    __m512 acc[QK_ROWS][4];
    for (int r = 0; r < n; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
#if CAN_PAIR
    if (pairs) {  /* the pairs of query values: 4 chains by pair mod 4, exact products */
        for (int64_t i = 0; i < d / 2; i += 4)
            for (int u = 0; u < 4; u++) {
                const __m512bh k = (__m512bh)_mm512_load_si512((const uint32_t *)kt + (i + u) * 16);
                for (int r = 0; r < n; r++)
                    acc[r][u] = _mm512_dpbf16_ps(acc[r][u], k, (__m512bh)_mm512_set1_epi32((int)rows[r].q2[i + u]));
            }
    } else
#endif
    {
        (void)pairs;
        for (int64_t j = 0; j < d; j += 4)
            for (int u = 0; u < 4; u++) {
                const __m512 k = _mm512_load_ps((const float *)kt + (j + u) * 16);
                for (int r = 0; r < n; r++) acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r].q[j + u]), k, acc[r][u]);
            }
    }
    for (int r = 0; r < n; r++)
        s[r] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
}

/* Rows [0, n): scores of the tile at key t0 scaled, soft-capped, -inf where the row does not see
 * the key (its mask, or past its sequence's keys), stored in lanes t0..t0 + 15 of their p. */
static inline __attribute__((always_inline)) void score_rows(const struct Shape *sh, const void *kt, int64_t d,
                                                             const struct LaneRow *rows, int n, int64_t t0,
                                                             const int pairs) {
    __m512 s[QK_ROWS];
    tile_scores(kt, d, rows, n, s, pairs);
    for (int r = 0; r < n; r++) {
        const int64_t left = rows[r].keys - t0;
        const __mmask16 inside = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m128i seen = _mm_maskz_loadu_epi8(inside, rows[r].mask + t0);
        const __mmask16 sees = _mm_test_epi8_mask(seen, seen);
        __m512 x = _mm512_mul_ps(s[r], _mm512_set1_ps(sh->scale));
        if (sh->softcap > 0.0f) {
            float lane[16];
            _mm512_storeu_ps(lane, x);
            for (int k = 0; k < 16; k++) lane[k] = sh->softcap * tanhf(lane[k] / sh->softcap);
            x = _mm512_loadu_ps(lane);
        }
        _mm512_store_ps(rows[r].p + t0, _mm512_mask_blend_ps(sees, _mm512_set1_ps(-INFINITY), x));
    }
}

/* e^x for x <= 0 in 16 lanes: exp_nonpositive's reduction and polynomial. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* A row's scores [n16] -> probabilities, unseen keys (-inf) exactly 0; none seen: all 0. */
static void softmax_lanes(float *p, int64_t n16, int pairs) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n16; t += 16) top = _mm512_max_ps(top, _mm512_load_ps(p + t));
    const float m = _mm512_reduce_max_ps(top);
    if (m == -INFINITY) {
        memset(p, 0, sizeof(float) * n16);
        return;
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n16; t += 16) {
        const __m512 x = _mm512_load_ps(p + t);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, exp16_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(m))));
        _mm512_store_ps(p + t, e);
        total = _mm512_add_ps(total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
#if CAN_PAIR
    if (pairs) {  /* rounded to bf16 in place: probability t at bf16 t of the same memory (behind the reads) */
        uint16_t *p16 = (uint16_t *)p;
        for (int64_t t = 0; t < n16; t += 16)
            _mm256_storeu_si256((__m256i *)(p16 + t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(p + t), inv)));
        return;
    }
#endif
    (void)pairs;
    for (int64_t t = 0; t < n16; t += 16) _mm512_store_ps(p + t, _mm512_mul_ps(_mm512_load_ps(p + t), inv));
}

static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p, const int f16) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return f16 ? _mm512_cvtph_ps(raw) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* out[r] [d] += p[r][t] * values[t - t0] [d] for t in [t0, t0 + count), in that order, rows
 * [0, n) with n * d / 16 <= 24 (their outputs stay in registers over the keys). */
static inline __attribute__((always_inline)) void add_values(const struct LaneRow *rows, int n,
                                                             const uint16_t *const *values, int64_t t0, int count,
                                                             int64_t d, const int f16) {
    __m512 o[24];
    const int64_t c16 = d / 16;
    if (n * c16 > 24) __builtin_unreachable();  /* value_range's row blocks */
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < c16; c++) o[r * c16 + c] = _mm512_loadu_ps(rows[r].out + 16 * c);
    for (int k = 0; k < count; k++)
        for (int64_t c = 0; c < c16; c++) {
            const __m512 v = widen16(values[k] + 16 * c, f16);
            for (int r = 0; r < n; r++)
                o[r * c16 + c] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r].p[t0 + k]), v, o[r * c16 + c]);
        }
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < c16; c++) _mm512_storeu_ps(rows[r].out + 16 * c, o[r * c16 + c]);
}

#if CAN_PAIR
/* add_values with products of bf16 pairs: keys t0 + k and t0 + k + 1 (k even; past count: zeros)
 * zipped per value (unpacklo/hi: the outputs' lanes in that permuted order until unpermute_out)
 * times their two probabilities, in order of the pairs. */
static inline __attribute__((always_inline)) void add_values_pairs(const struct LaneRow *rows, int n,
                                                                   const uint16_t *const *values, int64_t t0, int count,
                                                                   int64_t d, const uint16_t *zeros) {
    __m512 o[24];
    const int64_t c16 = d / 16;
    if (n * c16 > 24) __builtin_unreachable();  /* value_range's row blocks */
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < c16; c++) o[r * c16 + c] = _mm512_loadu_ps(rows[r].out + 16 * c);
    for (int k = 0; k < count; k += 2) {
        const uint16_t *v0 = values[k], *v1 = k + 1 < count ? values[k + 1] : zeros;
        for (int64_t c = 0; c < c16; c += 2) {
            const __m512i a = _mm512_loadu_si512(v0 + 16 * c), b = _mm512_loadu_si512(v1 + 16 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int r = 0; r < n; r++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(((const int32_t *)rows[r].p)[(t0 + k) / 2]);
                o[r * c16 + c] = _mm512_dpbf16_ps(o[r * c16 + c], lo, pp);
                o[r * c16 + c + 1] = _mm512_dpbf16_ps(o[r * c16 + c + 1], hi, pp);
            }
        }
    }
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < c16; c++) _mm512_storeu_ps(rows[r].out + 16 * c, o[r * c16 + c]);
}

/* A row's output from add_values_pairs' lane order back to value order: of each 32 values,
 * unpacklo's lane 4L + i held value 8L + i, unpackhi's value 8L + 4 + i. */
static void unpermute_out(float *out, int64_t d) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < d; c += 32) {
        const __m512 lo = _mm512_loadu_ps(out + c), hi = _mm512_loadu_ps(out + c + 16);
        _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

/* Where key t of KV head g lies in a pool half (its sequence's block table). Per key, not
 * seq_slots' array: with the slots computed ahead (or a tile's incrementally) the loop read an
 * unshared pool 10-30% slower in the C driver (16 x 561 keys: 11.7 -> 15 ns a (key, head)). */
static inline const uint16_t *slot_of(const struct Shape *sh, const uint16_t *half, const int64_t *table, int64_t t,
                                      int64_t g) {
    const int64_t block = table[t / sh->block_size];
    return half + ((block * sh->block_size + t % sh->block_size) * sh->kv_heads + g) * sh->head_dim;
}

/* Scores of rows [0, n) for tiles of keys [from, to) read through `table`. */
static inline __attribute__((always_inline)) void score_range(
        const struct Shape *sh, const struct Transpose *tp, const uint16_t *kv, const int64_t *table, int64_t g,
        int64_t from, int64_t to, const struct LaneRow *rows, int64_t n, const uint16_t *zeros, float *kt,
        int64_t d, const int pairs, const int f16) {
    for (int64_t t0 = from; t0 < to; t0 += KEYS) {
        const uint16_t *keys[KEYS];
        for (int k = 0; k < KEYS; k++) keys[k] = t0 + k < to ? slot_of(sh, kv, table, t0 + k, g) : zeros;
        for (int k = 0; k < KEYS && t0 + KEYS + k < to; k++)  /* the next tile's lines */
            prefetch_span(slot_of(sh, kv, table, t0 + KEYS + k, g), d * 2);
        if (CAN_PAIR && pairs)
            transpose_pairs(tp, keys, d, (uint32_t *)kt);
        else
            transpose_keys(tp, keys, d, kt, f16);
        int64_t r = 0;
        for (; r + QK_ROWS <= n; r += QK_ROWS) score_rows(sh, kt, d, rows + r, QK_ROWS, t0, pairs);
        switch (n - r) {  /* constant row counts: the sums in registers */
            case 1: score_rows(sh, kt, d, rows + r, 1, t0, pairs); break;
            case 2: score_rows(sh, kt, d, rows + r, 2, t0, pairs); break;
            case 3: score_rows(sh, kt, d, rows + r, 3, t0, pairs); break;
            case 4: score_rows(sh, kt, d, rows + r, 4, t0, pairs); break;
            case 5: score_rows(sh, kt, d, rows + r, 5, t0, pairs); break;
            default: break;
        }
    }
}

/* out of rows [0, n) += their probabilities times the values of keys [from, to). */
static inline __attribute__((always_inline)) void value_range(
        const struct Shape *sh, const uint16_t *values, const int64_t *table, int64_t g, int64_t from, int64_t to,
        const struct LaneRow *rows, int64_t n, const uint16_t *zeros, int64_t d, const int pairs, const int f16) {
    (void)zeros, (void)pairs;  /* the pairs loop's (builds without it: unused) */
    const int block_rows = (int)(24 / (d / 16)) < 6 ? (int)(24 / (d / 16)) : 6;
    for (int64_t t0 = from; t0 < to; t0 += KEYS) {
        const int count = to - t0 < KEYS ? (int)(to - t0) : KEYS;
        const uint16_t *rows_v[KEYS];
        for (int k = 0; k < count; k++) rows_v[k] = slot_of(sh, values, table, t0 + k, g);
        for (int k = 0; k < KEYS && t0 + KEYS + k < to; k++)
            prefetch_span(slot_of(sh, values, table, t0 + KEYS + k, g), d * 2);
        for (int64_t r = 0; r < n;) {  /* constant row counts: the outputs in registers */
            const int64_t left = n - r < block_rows ? n - r : block_rows;
#if CAN_PAIR
#define ADD(N) (pairs ? add_values_pairs(rows + r, N, rows_v, t0, count, d, zeros) \
                      : add_values(rows + r, N, rows_v, t0, count, d, f16))
#else
#define ADD(N) add_values(rows + r, N, rows_v, t0, count, d, f16)
#endif
            switch (left) {
                case 6: ADD(6); break;
                case 5: ADD(5); break;
                case 4: ADD(4); break;
                case 3: ADD(3); break;
                case 2: ADD(2); break;
                default: ADD(1); break;
            }
#undef ADD
            r += left;
        }
    }
}

/* Rows [row0, row1) of sequence a (clipped to its rows) and the keys they can see: a row sees no
 * key past its own position. */
struct Slice { int64_t row0, row1; };

static inline int64_t slice_end(const int64_t *num_rows, int64_t a, struct Slice sl) {
    return num_rows[a] < sl.row1 ? num_rows[a] : sl.row1;
}

static inline int64_t slice_keys(const int64_t *num_keys, const int64_t *num_rows, int64_t a, struct Slice sl) {
    return num_keys[a] - num_rows[a] + slice_end(num_rows, a, sl);
}

/* One task: KV head g of rows sl of sequences members[0, m), which read the same blocks for keys
 * [0, shared) (a multiple of 16). Their rows' scores for those keys are computed a tile at a time
 * for all of them (a key tile transposed once), then each sequence's own keys; softmax per row;
 * the values likewise. Every (row, key) takes the same operations whether shared or not, and keys
 * a row cannot see add exact zeros, so a row's bits depend on its visible keys only. */
static inline __attribute__((always_inline)) int attend_lanes_task(
        const struct Shape *sh, const struct Transpose *tp, const int64_t *members, int64_t m, int64_t shared,
        struct Slice sl, int64_t g, const float *q, const uint16_t *kv, const int64_t *tables,
        const uint8_t *mask, const int64_t *num_keys, const int64_t *num_rows, float *out, const uint16_t *zeros,
        int64_t fixed_d, const int pairs, const int f16) {
    const int64_t d = fixed_d ? fixed_d : sh->head_dim, group = sh->heads / sh->kv_heads;
    const int64_t mask_keys = sh->max_blocks * sh->block_size;
    const uint16_t *values = kv + sh->num_blocks * sh->block_size * sh->kv_heads * d;
    int64_t n = 0, floats = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t a = members[i], count = slice_end(num_rows, a, sl) - sl.row0;
        n += count * group;
        floats += count * group * ((slice_keys(num_keys, num_rows, a, sl) + 15) & ~(int64_t)15);
    }
    struct LaneRow *rows = malloc(sizeof(struct LaneRow) * n);
    float *p = aligned_alloc(64, sizeof(float) * (floats + 16));
    float *kt = aligned_alloc(64, sizeof(float) * d * KEYS);
    uint32_t *q2 = CAN_PAIR && pairs ? aligned_alloc(64, sizeof(uint32_t) * (n * d / 2 + 16)) : NULL;
    int status = rows && p && kt && (q2 || !(CAN_PAIR && pairs)) ? 0 : OUT_OF_MEMORY;
    int64_t *starts = malloc(sizeof(int64_t) * (m + 1));  /* member i's rows: [starts[i], starts[i + 1]) */
    if (!starts) status = OUT_OF_MEMORY;
    for (int64_t i = 0, r = 0, f = 0; i < m && !status; i++) {
        const int64_t a = members[i], keys = slice_keys(num_keys, num_rows, a, sl);
        for (int64_t b = 0; b * sh->block_size < keys; b++) {  /* seq_slots' check, without its slots */
            const int64_t block = tables[a * sh->max_blocks + b];
            if (block < 0 || block >= sh->num_blocks) status = BAD_BLOCK;
        }
        starts[i] = r;
        for (int64_t row = sl.row0; row < slice_end(num_rows, a, sl); row++)
            for (int64_t h = g * group; h < (g + 1) * group; h++, r++) {
                const int64_t at = (a * sh->q_max + row) * sh->heads + h;
                rows[r] = (struct LaneRow){q + at * d, q2 ? q2 + r * d / 2 : NULL, p + f,
                                           mask + (a * sh->q_max + row) * mask_keys, out + at * d, keys};
#if CAN_PAIR
                for (int64_t j = 0; q2 && j < d; j += 16)  /* round to nearest even */
                    _mm256_store_si256((__m256i *)(q2 + r * d / 2 + j / 2),
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + at * d + j)));
#endif
                f += (keys + 15) & ~(int64_t)15;
            }
        starts[i + 1] = r;
    }
    if (!status) {
        const int64_t *first = tables + members[0] * sh->max_blocks;
        score_range(sh, tp, kv, first, g, 0, shared, rows, n, zeros, kt, d, pairs, f16);
        for (int64_t i = 0; i < m; i++)
            score_range(sh, tp, kv, tables + members[i] * sh->max_blocks, g, shared,
                        slice_keys(num_keys, num_rows, members[i], sl),
                        rows + starts[i], starts[i + 1] - starts[i], zeros, kt, d, pairs, f16);
        for (int64_t r = 0; r < n; r++) {
            softmax_lanes(rows[r].p, (rows[r].keys + 15) & ~(int64_t)15, pairs);
            memset(rows[r].out, 0, sizeof(float) * d);
        }
        value_range(sh, values, first, g, 0, shared, rows, n, zeros, d, pairs, f16);
        for (int64_t i = 0; i < m; i++)
            value_range(sh, values, tables + members[i] * sh->max_blocks, g, shared,
                        slice_keys(num_keys, num_rows, members[i], sl),
                        rows + starts[i], starts[i + 1] - starts[i], zeros, d, pairs, f16);
#if CAN_PAIR
        for (int64_t r = 0; pairs && r < n; r++) unpermute_out(rows[r].out, d);
#endif
    }
    free(rows);
    free(p);
    free(kt);
    free(q2);
    free(starts);
    return status;
}

static __attribute__((noinline)) int attend_lanes_one(
        const struct Shape *sh, const struct Transpose *tp, const int64_t *members, int64_t m, int64_t shared,
        struct Slice sl, int64_t g, const float *q, const uint16_t *kv, const int64_t *tables, const uint8_t *mask,
        const int64_t *num_keys, const int64_t *num_rows, float *out, const uint16_t *zeros, int pairs, int f16) {
#define TASK(D, P, F) attend_lanes_task(sh, tp, members, m, shared, sl, g, q, kv, tables, mask, num_keys, num_rows, \
                                        out, zeros, D, P, F)
    if (f16)  /* products of fp32 values only (the bf16 pairs' instructions take no halves) */
        return sh->head_dim == 64 ? TASK(64, 0, 1) : sh->head_dim == 128 ? TASK(128, 0, 1) : TASK(0, 0, 1);
    if (CAN_PAIR && pairs)
        return sh->head_dim == 64 ? TASK(64, 1, 0) : sh->head_dim == 128 ? TASK(128, 1, 0) : TASK(0, 1, 0);
    return sh->head_dim == 64 ? TASK(64, 0, 0) : sh->head_dim == 128 ? TASK(128, 0, 0) : TASK(0, 0, 0);
#undef TASK
}

/* Keys [0, result) of sequences a and b lie in the same blocks (a multiple of 16, within both). */
static int64_t shared_keys(const struct Shape *sh, const int64_t *tables, const int64_t *num_keys, int64_t a,
                           int64_t b) {
    const int64_t keys = num_keys[a] < num_keys[b] ? num_keys[a] : num_keys[b];
    int64_t blocks = 0;
    while (blocks * sh->block_size < keys &&
           tables[a * sh->max_blocks + blocks] == tables[b * sh->max_blocks + blocks]) blocks++;
    const int64_t same = blocks * sh->block_size < keys ? blocks * sh->block_size : keys;
    return same & ~(int64_t)(KEYS - 1);
}

/* The bf16 pool on AVX-512: sequences whose tables start with the same block grouped (up to
 * MEMBERS a task) with the keys they all share, one task per group and KV head. */
static int attend_lanes(const struct Shape *sh, const float *q, const uint16_t *kv, const int64_t *tables,
                        const uint8_t *mask, const int64_t *num_keys, const int64_t *num_rows, float *out,
                        int num_threads, int pairs, int f16) {
    struct Transpose tp;
    transpose_plan(&tp);
    static const uint16_t zeros[MAX_LANES_D];
    const int64_t S = sh->num_seqs;
    int64_t *order = malloc(sizeof(int64_t) * S), *group_of = malloc(sizeof(int64_t) * S);
    int64_t *task_first = malloc(sizeof(int64_t) * (S + 1)), *task_shared = malloc(sizeof(int64_t) * (S + 1));
    if (!order || !group_of || !task_first || !task_shared) {
        free(order); free(group_of); free(task_first); free(task_shared);
        return OUT_OF_MEMORY;
    }
    for (int64_t a = 0; a < S; a++) group_of[a] = -1;
    int64_t placed = 0, tasks = 0;
    for (int64_t a = 0; a < S; a++) {
        if (group_of[a] >= 0 || num_rows[a] <= 0) continue;
        /* a, then the later sequences starting with a's first block, MEMBERS at a time */
        int64_t count = 0, shared = num_keys[a] & ~(int64_t)(KEYS - 1);
        for (int64_t b = a; b < S; b++) {
            if (group_of[b] >= 0 || num_rows[b] <= 0) continue;
            if (b != a && (num_keys[b] < 1 || tables[b * sh->max_blocks] != tables[a * sh->max_blocks])) continue;
            if (count == MEMBERS) break;
            const int64_t same = b == a ? shared : shared_keys(sh, tables, num_keys, a, b);
            group_of[b] = tasks;
            order[placed++] = b;
            shared = same < shared ? same : shared;
            count++;
        }
        task_first[tasks] = placed - count;
        task_shared[tasks] = count > 1 ? shared : 0;
        tasks++;
    }
    task_first[tasks] = placed;
    /* a lone sequence's chunk of more than SLICE_ROWS rows (a prompt's rest): a piece per SLICE_ROWS
     * rows, each reading the keys its rows see, the last (most keys) first; else a piece a task */
    int64_t pieces = 0;
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t rows = num_rows[order[task_first[t]]];
        pieces += task_first[t + 1] - task_first[t] == 1 ? (rows + SLICE_ROWS - 1) / SLICE_ROWS : 1;
    }
    int64_t *piece_task = malloc(sizeof(int64_t) * pieces);
    struct Slice *piece_rows = malloc(sizeof(struct Slice) * pieces);
    int status = piece_task && piece_rows ? 0 : OUT_OF_MEMORY;
    for (int64_t t = 0, k = 0; t < tasks && !status; t++) {
        const int64_t rows = num_rows[order[task_first[t]]];
        if (task_first[t + 1] - task_first[t] > 1) {
            piece_task[k] = t;
            piece_rows[k++] = (struct Slice){0, INT64_MAX};
            continue;
        }
        for (int64_t part = (rows + SLICE_ROWS - 1) / SLICE_ROWS - 1; part >= 0; part--) {
            piece_task[k] = t;
            piece_rows[k++] = (struct Slice){part * SLICE_ROWS, (part + 1) * SLICE_ROWS};
        }
    }
    const int64_t jobs = status ? 0 : pieces * sh->kv_heads;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(min:status)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t t = piece_task[job / sh->kv_heads], g = job % sh->kv_heads;
        const int done = attend_lanes_one(sh, &tp, order + task_first[t], task_first[t + 1] - task_first[t],
                                          task_shared[t], piece_rows[job / sh->kv_heads], g, q, kv, tables, mask,
                                          num_keys, num_rows, out, zeros, pairs, f16);
        status = done < status ? done : status;
    }
    free(order); free(group_of); free(task_first); free(task_shared); free(piece_task); free(piece_rows);
    return status;
}
#endif

/* Whether rows over a bf16 or f16 pool of this head_dim take the keys-in-lanes loop (AVX-512). */
int paged_attention_lanes(int64_t head_dim) {
#if defined(LANES_LOOP)
    return head_dim % 32 == 0 && head_dim <= MAX_LANES_D;
#else
    (void)head_dim;
    return 0;
#endif
}

enum { POOL_FP32 = 0, POOL_BF16 = 1, POOL_F16 = 2 };

/* q, out: [num_seqs, q_max, heads, head_dim]; kv: [2, num_blocks, block_size, kv_heads,
 * head_dim], fp32 or (bf16, f16) uint16 bits; tables: [num_seqs, max_blocks]; mask: [num_seqs, q_max,
 * max_blocks * block_size] (nonzero: row sees key; a sliding window is a mask too); num_keys,
 * num_rows: [num_seqs]. Scores are q . k * scale, soft-capped when softcap > 0. Rows past
 * num_rows[a] are left as they are. Returns 0, OUT_OF_MEMORY (scratch), BAD_BLOCK (a table
 * entry outside the pool: nothing is read from it) or BAD_SHAPE (a sequence's keys past its
 * table, its rows past q_max, or dims that make no sense: nothing is read at all). `pool`: the
 * pool's element type (POOL_*: fp32, or bf16 / f16 as uint16 bits). */
static int attend_short(const float *q, const void *kv, const int64_t *tables, const uint8_t *mask,
                        const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                        float scale, float softcap, int num_threads, int pool, int pairs) {
    const int half = pool != POOL_FP32, f16 = pool == POOL_F16;
    const struct Shape sh = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                             dims[7], scale, softcap};
    if (check_shape(&sh, num_keys, num_rows)) return BAD_SHAPE;
#if defined(LANES_LOOP)
    if (half && paged_attention_lanes(sh.head_dim))
        return attend_lanes(&sh, q, kv, tables, mask, num_keys, num_rows, out, num_threads, pairs && !f16, f16);
#else
    (void)pairs;
#endif
    /* fewer sequences than threads: split each by KV head so every thread has work */
    const int64_t splits = sh.num_seqs < num_threads ? sh.kv_heads : 1;
    const int64_t heads_per_split = sh.heads / splits;
    const int64_t tile_floats = half ? sh.head_dim : 0;  /* zeros (16-bit values: half of it) */
    int status = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(min:status)
    for (int64_t task = 0; task < sh.num_seqs * splits; task++) {
        const int64_t a = task / splits, h0 = (task % splits) * heads_per_split, h1 = h0 + heads_per_split;
        const int64_t keys = num_keys[a], rows = num_rows[a];
        float *probs = malloc(sizeof(float) * (rows * sh.heads * keys + tile_floats));
        int64_t *slots = malloc(sizeof(int64_t) * (keys + rows));
        int done = OUT_OF_MEMORY;
        if (probs && slots && !half) {
            done = attend_seq(&sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots, slots + keys);
        } else if (probs && slots) {
            done = attend_half(&sh, a, h0, h1, q, kv, tables, mask, keys, rows, out, probs, slots, f16);
        }
        status = done < status ? done : status;
        free(probs);
        free(slots);
    }
    return status;
}

/* 1 where a bf16 pool's rows take products of bf16 pairs (head_dim a multiple of 32 up to 256:
 * the query and the probabilities rounded to bf16), 0 where every product is fp32. */
int paged_attention_bf16_products(void) {
#if defined(LANES_LOOP) && CAN_PAIR
    return 1;
#else
    return 0;
#endif
}

int paged_attention_short(const float *q, const float *kv, const int64_t *tables, const uint8_t *mask,
                          const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                          float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, POOL_FP32, 0);
}

/* The same over a bfloat16 pool (kv as uint16 bits, same layout). */
int paged_attention_short_bf16(const float *q, const uint16_t *kv, const int64_t *tables, const uint8_t *mask,
                               const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                               float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, POOL_BF16, 0);
}

/* The same with products of bf16 pairs where this build has them (paged_attention_bf16_products;
 * else it is paged_attention_short_bf16): which is faster depends on the CPU (cpu_kernels.py
 * measures both once per CPU and picks). */
int paged_attention_short_bf16_pairs(const float *q, const uint16_t *kv, const int64_t *tables, const uint8_t *mask,
                                     const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                                     float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, POOL_BF16, 1);
}

/* The same over a float16 pool (kv as uint16 bits, same layout): the bf16 pool's loops with each
 * value widened from a half (exact), products in fp32. */
int paged_attention_short_f16(const float *q, const uint16_t *kv, const int64_t *tables, const uint8_t *mask,
                              const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                              float scale, float softcap, int num_threads) {
    return attend_short(q, kv, tables, mask, num_keys, num_rows, out, dims, scale, softcap, num_threads, POOL_F16, 0);
}
