/* Matmuls straight from GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) on
 * CPU, with x rounded to 8 bits per 32 values (llama.cpp's Q8_0 activations) and integer dot
 * products with the weights' codes, so a matrix is never expanded in memory.
 *
 * Every path here (quant_matmul_i8: per row of x, coded tiles or straight from the blocks;
 * quant_matmul_i8_panels: x's rows in panels) sums each 32-value group exactly in int32 and
 * applies the same float operations in the same order per (weight row, x row), so a row of x
 * gives the same bits alone or in any batch, on any of them. Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and
 * Q8_0 matrices may be packed at load (`quant_pack8`: rows interleaved by 8, kquant_packed.h);
 * every entry point takes them as `type | PACK8`, with the same bits. `quant_dequantize` expands rows
 * to fp32 or bf16 (lookups, and the tiles large steps multiply with a dense GEMM): every value
 * equals gguf's dequantization bit for bit. Compiled on first use by
 * workers/model/cpu_kernels.py with -march=native. Owns: block layouts' use and the arithmetic.
 * (The fp32 block kernel, which decoded each block to fp32 and multiplied in fp32, was retired:
 * it never won a step on the CPUs measured, docs/quantization.md "Paths kept".)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"


enum { OK = 0, BAD_TYPE = -3, BAD_SHAPE = -4, NO_MEMORY = -1 };
#define INLINE static inline __attribute__((always_inline))
/* One copy of a tile function per type: the block layout folds into its loops. */
#define SWITCH_TYPE(type, CALL) switch (type) { \
    case Q4_0: CALL(Q4_0); break; case Q4_1: CALL(Q4_1); break; case Q5_0: CALL(Q5_0); break; \
    case Q5_1: CALL(Q5_1); break; case Q8_0: CALL(Q8_0); break; case Q2_K: CALL(Q2_K); break; \
    case Q3_K: CALL(Q3_K); break; case Q4_K: CALL(Q4_K); break; case Q5_K: CALL(Q5_K); break; \
    case Q6_K: CALL(Q6_K); break; case IQ4_NL: CALL(IQ4_NL); break; case IQ4_XS: CALL(IQ4_XS); break; }
#define CHUNK 256   /* most values decoded per row at a time: one K-quant block, eight 32-blocks */
#define ROWS 4      /* weight rows per tile */
#define MAX_M 32    /* rows of x per pass (accumulators on the stack) */

/* Values per decoded piece of a row: the most of 256, 128, 64, 32 that splits k into whole
 * blocks (576 = 9 x 64 for 32-value blocks); BAD_TYPE / BAD_SHAPE (< 0) if none. */
static int chunk_of(int type, int64_t k) {
    const layout lay = layout_of(type);
    if (!lay.elems) return BAD_TYPE;
    for (int c = CHUNK; c >= 32; c /= 2)
        if (c % lay.elems == 0 && k % c == 0) return c;
    return BAD_SHAPE;
}

/* Tiles a thread takes at a time: 16 turns per thread, taken as threads come free. A static
 * split waits at the end of every call for a thread the OS descheduled (on 2 vCPUs shared with
 * the frontend and the scheduler: a served 4-sequence step's forward 1.6x the offline one's);
 * taken dynamically, the running thread does the descheduled one's share. A tile's result
 * does not depend on the thread that computes it. */
static int64_t tile_grain(int64_t num_tiles, int num_threads) {
    const int64_t grain = num_tiles / (16 * (int64_t)(num_threads > 0 ? num_threads : 1));
    return grain > 0 ? grain : 1;
}

/* ---- int8 activations: x ~ xd * xq per 32 values, integer dot products with the codes ---- */

typedef struct {  /* rows of x quantized per 32 values */
    int8_t *q;      /* [m, k] */
    float *d;       /* [m, k / 32]: x ~ d * q */
    float *sums;    /* [m, k / 16] (+ 8 zeros): d * (sum of the 16 q), for the weights' offsets */
    int32_t *isum;  /* [m, k / 32]: the sum of the 32 q, or NULL where nothing reads it */
} qx;

/* Buffers for m rows of k values (isum too if with_isum); check with qx_ok, release with qx_free. */
static qx qx_new(int64_t m, int64_t k, int with_isum) {
    return (qx){malloc((size_t)(m * k)), malloc((size_t)(m * k / 32) * sizeof(float)),
                calloc((size_t)(m * k / 16 + 8), sizeof(float)),  /* 8 zeros: read past the last half */
                with_isum ? malloc((size_t)(m * k / 32) * sizeof(int32_t)) : NULL};
}

static int qx_ok(const qx *x, int with_isum) { return x->q && x->d && x->sums && (x->isum || !with_isum); }

static void qx_free(qx *x) { free(x->q), free(x->d), free(x->sums), free(x->isum); }

static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *sums, int32_t *isum) {
    for (int64_t b = 0; b < k / 32; b++, x += 32, q += 32) {
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], amax8 = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
#endif
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int half_sum[2] = {0, 0};
#if defined(__AVX2__)
        __m256i n[4];  /* round to nearest even, as nearbyintf in the default mode */
        for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        for (int h = 0; h < 2; h++) {
            __m256i t = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
            half_sum[h] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1)));
        }
        const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
        const __m256i bytes = _mm256_packs_epi16(words, words2);  /* lanes interleaved by 32-bit pieces */
        _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int j = 0; j < 32; j++) {
            q[j] = (int8_t)nearbyintf(x[j] * inv);  /* |x| * inv <= 127 (+ rounding): no overflow */
            half_sum[j / 16] += q[j];
        }
#endif
        d[b] = scale;
        sums[2 * b] = scale * (float)half_sum[0];
        sums[2 * b + 1] = scale * (float)half_sum[1];
        if (isum) isum[b] = half_sum[0] + half_sum[1];
    }
}

/* Row r of x into xq (a worksharing loop's body). */
static void quantize_x_row(const float *x, int64_t k, int64_t r, const qx *xq) {
    quantize_row(x + r * k, k, xq->q + r * k, xq->d + r * k / 32, xq->sums + r * k / 16,
                 xq->isum ? xq->isum + r * k / 32 : NULL);
}

#define PIECE 2048  /* most values of a weight row coded at a time (4 rows: 12 KiB, in L1) */

typedef struct {  /* one weight row's piece: value = sc * c + off per 16 values */
    uint8_t c[PIECE];
    float sc[PIECE / 16], off[PIECE / 16 + 8];  /* entries past the piece's are zero */
} coded;

#if defined(__AVX2__) && defined(__F16C__)
#define HAS_CODE8 1
/* A 32-value block's codes: Q4's nibbles (byte j: value j low, j + 16 high) unsigned, Q8_0's
 * bytes, IQ4_NL's nibbles looked up in its table (signed). */
INLINE __m256i block_codes(int type, const uint8_t *b) {
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    /* the 16 bytes in both halves (a load, no shuffle), the upper half shifted down a nibble */
    const __m256i qs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + (type == Q4_1 ? 4 : 2))));
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(qs, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                             _mm256_set1_epi8(15));
    if (type != IQ4_NL) return nibbles;
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)IQ4_VALUES)), nibbles);
}

/* codes_chunk for 8 blocks of Q4_0, Q4_1, Q8_0 or IQ4_NL at once: the 8 headers' half floats converted
 * together and written as the pairs per 16 values, each block's codes in one 32-byte store.
 * The same values as codes_chunk (cvtph is exact; -8 * d and -(8 * d) are the same float), at
 * about half its cost, which at 16 rows of x was a third of a panels matmul. */
INLINE void code_blocks8(int type, const uint8_t *b, uint8_t *c, float *sc, float *off) {
    const int bytes = layout_of(type).bytes;
    int32_t head[8];  /* d, and Q4_1's m above it (other types: the 2 bytes after d, unused) */
    for (int i = 0; i < 8; i++) memcpy(head + i, b + i * bytes, 4);
    /* per 128-bit lane: its 4 d, then its 4 m; then d (blocks 0-7) | m (blocks 0-7) */
    const __m256i dm = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)head),
                                           _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i sorted = _mm256_permute4x64_epi64(dm, 0xd8);
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(sorted));
    const __m256 o = type == Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(sorted, 1))
                     : type == Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
    const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    _mm256_storeu_ps(sc, _mm256_permutevar8x32_ps(d, first));
    _mm256_storeu_ps(sc + 8, _mm256_permutevar8x32_ps(d, second));
    _mm256_storeu_ps(off, _mm256_permutevar8x32_ps(o, first));
    _mm256_storeu_ps(off + 8, _mm256_permutevar8x32_ps(o, second));
    for (int i = 0; i < 8; i++, b += bytes, c += 32) _mm256_storeu_si256((__m256i *)c, block_codes(type, b));
}
#endif

/* Values [k0, k0 + piece) of a row, a chunk at a time (piece: whole chunks). */
INLINE void code_piece(int type, const uint8_t *row, int64_t k0, int piece, int chunk, coded *out) {
    float mn[CHUNK / 16];
    int j = 0;
#if defined(HAS_CODE8)
    if (type == Q4_0 || type == Q4_1 || type == Q8_0 || type == IQ4_NL) {
        const int bytes = layout_of(type).bytes;
        for (; j + 256 <= piece; j += 256)
            code_blocks8(type, row + (k0 + j) / 32 * bytes, out->c + j, out->sc + j / 16, out->off + j / 16);
        chunk = 32;  /* the rest block by block */
    }
#endif
    for (; j < piece; j += chunk)
        codes_chunk(type, row, k0 + j, chunk, out->c + j, out->sc + j / 16, mn, out->off + j / 16);
    memset(out->off + piece / 16, 0, 8 * sizeof(float));  /* the dot product's last vector of halves */
}

#if defined(__AVX2__)
/* Unsigned codes cu . signed activations qs, 4 values per int32 lane. */
INLINE __m256i codes_dot(__m256i cu, __m256i qs) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), cu, qs);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(cu, qs), _mm256_set1_epi16(1));  /* |pair| <= 2 * 128 * 127 */
#endif
}

#endif

/* Per row of x, one tile's state: t[r] = sum over groups of float(exact group sum) * (sc *
 * xd), and o[r][j] = sum of off * sums over the 16-value halves h with h % 4 == j (four chains,
 * so the FMAs' latency is not the bound; one vector of 4 halves per step, no transpose),
 * y = t + ((o0 + o1) + (o2 + o3)). These are the operations of the panels (panels_dot) for
 * each (weight row, x row), in the same order, so the int8 and int8_panels paths give the same
 * bits and a step may take either. A piece starts at a multiple of 2048 values, so h % 4
 * counts from the piece's start. */
#define OFF_CHAINS 4
#if defined(__AVX2__)
/* Four rows' exact sums of 8 int32 lanes each, split into lanes [0, 4) (low 128 bits: row r
 * in lane r) and [4, 8) (high 128 bits). */
INLINE __m256i row_sums(const __m256i *a) {  /* unpacks and adds: single-uop operations, unlike phaddd */
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[0], a[1]));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2], a[3]), _mm256_unpackhi_epi32(a[2], a[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
}

/* Half h's scales of the tile's 4 rows, one lane each. */
INLINE __m128 row_scales(const coded *w, int h) {
    return _mm_setr_ps(w[0].sc[h], w[1].sc[h], w[2].sc[h], w[3].sc[h]);
}

/* t += each group's 4 row sums (halves: 16-value groups) converted and scaled. */
INLINE __m128 add_groups(__m128 t, __m256i sums, const coded *w, int g, float xd, int sub16) {
    const __m128 xdv = _mm_set1_ps(xd);
    const __m128i lo = _mm256_castsi256_si128(sums), hi = _mm256_extracti128_si256(sums, 1);
    if (!sub16)
        return _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(lo, hi)), _mm_mul_ps(row_scales(w, 2 * g), xdv), t);
    t = _mm_fmadd_ps(_mm_cvtepi32_ps(lo), _mm_mul_ps(row_scales(w, 2 * g), xdv), t);
    return _mm_fmadd_ps(_mm_cvtepi32_ps(hi), _mm_mul_ps(row_scales(w, 2 * g + 1), xdv), t);
}

/* o[r][h % 4] += offsets x sums: lane j of row r's vector is chain j. A piece's halves are a
 * multiple of 2: a last pair updates lanes 0-1 only. */
INLINE void add_offsets(float (*o)[OFF_CHAINS], const coded *w, int piece, const float *sums) {
    const int halves = piece / 16, full = halves / OFF_CHAINS * OFF_CHAINS;
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) {
        __m128 c = _mm_loadu_ps(o[r]);
        for (int h = 0; h < full; h += OFF_CHAINS)
            c = _mm_fmadd_ps(_mm_loadu_ps(w[r].off + h), _mm_loadu_ps(sums + h), c);
        if (full < halves)
            c = _mm_blend_ps(c, _mm_fmadd_ps(_mm_loadu_ps(w[r].off + full), _mm_loadu_ps(sums + full), c), 3);
        _mm_storeu_ps(o[r], c);
    }
}
#endif

/* One row of x over a coded piece of the tile's ROWS weight rows. */
INLINE void rows_dot_i8(int type, const coded *w, int piece, const int8_t *xq,
                        const float *xd, const float *sums, float *t, float (*o)[OFF_CHAINS]) {
    const int is_signed = codes_signed(type), sub16 = scales_per_16(type);
#if defined(__AVX2__)
    __m128 tv = _mm_loadu_ps(t);
    for (int g = 0; g < piece / 32; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(xq + 32 * g));
        __m256i a[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(w[r].c + 32 * g));
            a[r] = codes_dot(is_signed ? _mm256_sign_epi8(c, c) : c, is_signed ? _mm256_sign_epi8(q, c) : q);
        }
        tv = add_groups(tv, row_sums(a), w, g, xd[g], sub16);
    }
    _mm_storeu_ps(t, tv);
    add_offsets(o, w, piece, sums);
#else
    for (int g = 0; g < piece / 32; g++)
        for (int half = 0; half < 2; half += 1 + !sub16)
            for (int r = 0; r < ROWS; r++) {
                int32_t total = 0;
                for (int j = 32 * g + 16 * half; j < 32 * g + (sub16 ? 16 * half + 16 : 32); j++)
                    total += (is_signed ? (int)(int8_t)w[r].c[j] : (int)w[r].c[j]) * xq[j];
                t[r] = fmaf((float)total, w[r].sc[2 * g + half] * xd[g], t[r]);
            }
    for (int h = 0; h < piece / 16; h++)
        for (int r = 0; r < ROWS; r++) o[r][h % OFF_CHAINS] = fmaf(w[r].off[h], sums[h], o[r][h % OFF_CHAINS]);
#endif
}

/* rows_dot_i8 for two rows of x at once: each code vector loaded and made unsigned once for
 * both, two rows' chains in flight. */
INLINE void rows_dot_i8_x2(int type, const coded *w, int piece,
                           const int8_t *xqa, const int8_t *xqb, const float *xda, const float *xdb,
                           const float *sumsa, const float *sumsb, float *ta, float *tb, float (*oa)[OFF_CHAINS],
                           float (*ob)[OFF_CHAINS]) {
#if defined(__AVX2__)
    const int is_signed = codes_signed(type), sub16 = scales_per_16(type);
    __m128 tva = _mm_loadu_ps(ta), tvb = _mm_loadu_ps(tb);
    for (int g = 0; g < piece / 32; g++) {
        const __m256i qa = _mm256_loadu_si256((const __m256i *)(xqa + 32 * g));
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(xqb + 32 * g));
        __m256i a[ROWS], b[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(w[r].c + 32 * g));
            const __m256i cu = is_signed ? _mm256_sign_epi8(c, c) : c;
            a[r] = codes_dot(cu, is_signed ? _mm256_sign_epi8(qa, c) : qa);
            b[r] = codes_dot(cu, is_signed ? _mm256_sign_epi8(qb, c) : qb);
        }
        tva = add_groups(tva, row_sums(a), w, g, xda[g], sub16);
        tvb = add_groups(tvb, row_sums(b), w, g, xdb[g], sub16);
    }
    _mm_storeu_ps(ta, tva), _mm_storeu_ps(tb, tvb);
    add_offsets(oa, w, piece, sumsa);
    add_offsets(ob, w, piece, sumsb);
#else
    rows_dot_i8(type, w, piece, xqa, xda, sumsa, ta, oa);
    rows_dot_i8(type, w, piece, xqb, xdb, sumsb, tb, ob);
#endif
}

/* Rows [n0, n0 + num_rows) of y for x rows [m0, m0 + num_m): a piece of each weight row is
 * coded once and every row of x (two at a time) runs over all of it. */
INLINE void tile_i8(int type, int chunk, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0,
                    int num_rows, const qx *x, int64_t m0, int num_m, float *y, int64_t n) {
    coded rows[ROWS] __attribute__((aligned(64)));
    float t[MAX_M][ROWS], o[MAX_M][ROWS][OFF_CHAINS];
    memset(t, 0, (size_t)num_m * sizeof t[0]), memset(o, 0, (size_t)num_m * sizeof o[0]);
    if (num_rows < ROWS) memset(rows, 0, sizeof rows);  /* rows past num_rows: zero */
    const int most = PIECE / chunk * chunk;
    for (int64_t k0 = 0; k0 < k; k0 += most) {
        const int piece = k - k0 < most ? (int)(k - k0) : most;
        for (int r = 0; r < num_rows; r++) code_piece(type, w + (n0 + r) * row_bytes, k0, piece, chunk, rows + r);
        int m = 0;
        for (; m + 2 <= num_m; m += 2) {
            const int64_t a = m0 + m, b = a + 1;
            rows_dot_i8_x2(type, rows, piece, x->q + a * k + k0, x->q + b * k + k0,
                           x->d + (a * k + k0) / 32, x->d + (b * k + k0) / 32,
                           x->sums + (a * k + k0) / 16, x->sums + (b * k + k0) / 16, t[m], t[m + 1], o[m], o[m + 1]);
        }
        for (; m < num_m; m++) {
            const int64_t row = m0 + m;
            rows_dot_i8(type, rows, piece, x->q + row * k + k0, x->d + (row * k + k0) / 32,
                        x->sums + (row * k + k0) / 16, t[m], o[m]);
        }
    }
    for (int m = 0; m < num_m; m++)
        for (int r = 0; r < num_rows; r++)
            y[(m0 + m) * n + n0 + r] = t[m][r] + ((o[m][r][0] + o[m][r][1]) + (o[m][r][2] + o[m][r][3]));
}

#if defined(__AVX2__) && defined(__F16C__)
#define HAS_DIRECT 1
/* ---- the int8 path straight from the blocks: Q4_0, Q4_1, Q8_0 and IQ4_NL, a few rows of x ----
 * tile_i8 codes a piece of 4 weight rows into L1 (bytes, and a scale and an offset per 16
 * values) and reads it back: for one row of x that costs more than the dot products, and a
 * one-row matmul ran at ~1.4 weights a cycle. Here each block's codes go from the file's bytes
 * to a register and straight into the integer dot product (~5 weights a cycle a thread, hot);
 * the float operations are rows_dot_i8's, in its order (the group sums converted and scaled in
 * group order, the offsets in 4 chains over the halves), so the bits equal the coded path's and
 * the panels'. */
#ifndef DIRECT_ROWS
#define DIRECT_ROWS 4  /* most rows of x a call takes this way (two at a time share a decode); 0 turns
                          it off (tools/bench/quant_paths.py builds that to compare) */
#endif

static int has_direct(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == IQ4_NL; }

INLINE uint16_t half_bits(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Blocks g and g + 1 of the 4 rows: their scales d (lanes 0-3: block g's rows, 4-7: g + 1's)
 * and, for Q4_1, their minimums m. Q4_1's header is d | m: one 32-bit load per block, the
 * halves sorted by a byte shuffle (where 16 separate 16-bit inserts cost a quarter of a step). */
INLINE __m256 pair_scales(int type, const uint8_t *const *b, int64_t g, int pair, int bytes, __m256 *mins) {
    const int64_t p = g * bytes, q = pair ? p + bytes : p;  /* a lone last block: read twice, not past the row */
    if (type != Q4_1)
        return _mm256_cvtph_ps(_mm_setr_epi16((short)half_bits(b[0] + p), (short)half_bits(b[1] + p),
                                              (short)half_bits(b[2] + p), (short)half_bits(b[3] + p),
                                              (short)half_bits(b[0] + q), (short)half_bits(b[1] + q),
                                              (short)half_bits(b[2] + q), (short)half_bits(b[3] + q)));
    int32_t h[8];
    for (int r = 0; r < ROWS; r++) memcpy(h + r, b[r] + p, 4), memcpy(h + ROWS + r, b[r] + q, 4);
    const __m256i dm = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)h),  /* per lane: 4 d | 4 m */
                                           _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i sorted = _mm256_permute4x64_epi64(dm, 0xd8);  /* d (g, g + 1) | m (g, g + 1) */
    *mins = _mm256_cvtph_ps(_mm256_extracti128_si256(sorted, 1));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(sorted));
}

/* t[i] += block g's 4 exact row sums with x row i, times d * xd[i]: add_groups for 32-value
 * scales, for nx rows of x with the block's codes decoded once. */
INLINE void direct_group(int type, const uint8_t *const *b, int64_t g, int nx, const int8_t *const *xq,
                         __m128 d, const float *const *xd, __m128 *t) {
    const int is_signed = codes_signed(type), bytes = layout_of(type).bytes;
    __m256i c[ROWS], cu[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) {
        c[r] = block_codes(type, b[r] + g * bytes);
        cu[r] = is_signed ? _mm256_sign_epi8(c[r], c[r]) : c[r];
    }
    for (int i = 0; i < nx; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(xq[i] + 32 * g));
        __m256i a[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) a[r] = codes_dot(cu[r], is_signed ? _mm256_sign_epi8(q, c[r]) : q);
        const __m256i s = row_sums(a);
        const __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(d, _mm_set1_ps(xd[i][g])), t[i]);
    }
}

/* Block pair's offsets per row (Q4_1: m; Q4_0: -8d) as 4 halves: (g, g, g + 1, g + 1). */
INLINE __m128 pair_offsets(__m256 off, int r) {
    const __m128 lo = _mm256_castps256_ps128(off), hi = _mm256_extractf128_ps(off, 1);
    switch (r) {  /* the shuffle's selector must be a constant */
        case 0: return _mm_shuffle_ps(lo, hi, 0x00);
        case 1: return _mm_shuffle_ps(lo, hi, 0x55);
        case 2: return _mm_shuffle_ps(lo, hi, 0xaa);
        default: return _mm_shuffle_ps(lo, hi, 0xff);
    }
}

/* Rows [a, a + nx) of y (nx: 1 or 2) at columns [n0, n0 + num_rows): tile_i8's results. */
INLINE void tile_i8_direct(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0, int num_rows,
                           const qx *x, int64_t a, int nx, float *y, int64_t n) {
    const int bytes = layout_of(type).bytes;
    const uint8_t *b[ROWS];
    for (int r = 0; r < ROWS; r++) b[r] = w + (n0 + (r < num_rows ? r : 0)) * row_bytes;  /* past: row 0 again */
    const int8_t *xq[2];
    const float *xd[2], *sums[2];
    __m128 t[2], o[2][ROWS];
    for (int i = 0; i < nx; i++) {
        xq[i] = x->q + (a + i) * k, xd[i] = x->d + (a + i) * k / 32, sums[i] = x->sums + (a + i) * k / 16;
        t[i] = _mm_setzero_ps();
        for (int r = 0; r < ROWS; r++) o[i][r] = _mm_setzero_ps();
    }
    const int64_t groups = k / 32;
    /* The next tile's bytes (this thread's next, mostly), a few lines per block pair: a tile is
     * 4 short rows, too little for the hardware's stream prefetcher to reach ahead of. Measured
     * on SmolLM2 at one row (AVX2 Zen 3): the head 1.4 vs 2.9 ms without, the layers 9.0 vs
     * 10.5 ms; two or four tiles ahead, or a non-temporal hint, were no better, and the whole next
     * tile at the start (what the K-quants' direct path does) 0.6-0.8x as fast here. */
    const char *next = (const char *)(w + (n0 + ROWS) * row_bytes);  /* past the end: prefetch does not fault */
    const int64_t lines = ROWS * row_bytes / 64 + 1, per_pair = (lines + (groups + 1) / 2 - 1) / ((groups + 1) / 2);
    for (int64_t g = 0; g < groups; g += 2) {
        const int pair = g + 1 < groups;
        if (a == 0)
            for (int64_t i = g / 2 * per_pair; i < (g / 2 + 1) * per_pair && i < lines; i++)
                _mm_prefetch(next + 64 * i, _MM_HINT_T0);
        __m256 mins = _mm256_setzero_ps();
        const __m256 d = pair_scales(type, b, g, pair, bytes, &mins);
        direct_group(type, b, g, nx, xq, _mm256_castps256_ps128(d), xd, t);
        if (pair) direct_group(type, b, g + 1, nx, xq, _mm256_extractf128_ps(d, 1), xd, t);
        if (!has_offsets(type)) continue;  /* offsets 0: the chains stay +0, as the coded path's */
        const __m256 off = type == Q4_1 ? mins
                                        : _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f), d), _mm256_set1_ps(-0.0f));
        for (int i = 0; i < nx; i++) {
            const __m128 sv = _mm_loadu_ps(sums[i] + 2 * g);  /* halves 2g..2g+3 (a lone last block: 2 read past) */
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                const __m128 c = _mm_fmadd_ps(pair_offsets(off, r), sv, o[i][r]);
                o[i][r] = pair ? c : _mm_blend_ps(o[i][r], c, 3);
            }
        }
    }
    for (int i = 0; i < nx; i++) {
        float tv[ROWS], ov[ROWS][OFF_CHAINS];
        _mm_storeu_ps(tv, t[i]);
        for (int r = 0; r < ROWS; r++) _mm_storeu_ps(ov[r], o[i][r]);
        for (int r = 0; r < num_rows; r++)
            y[(a + i) * n + n0 + r] = tv[r] + ((ov[r][0] + ov[r][1]) + (ov[r][2] + ov[r][3]));
    }
}
#include "kquant_direct.h"
#else
#define HAS_DIRECT 0
#endif
#include "kquant_packed.h"

/* The packed matrix's tile rows check: a packable type, whole tiles, whole blocks. */
static int p8_check(int type, int64_t n, int64_t k) {
    if (!packable(type)) return BAD_TYPE;
    return n % P8 == 0 && k > 0 && k % layout_of(type).elems == 0 ? OK : BAD_SHAPE;
}

/* A packed matrix's bytes per row (the file's). */
static int64_t p8_row_bytes(int type, int64_t k) { return k / layout_of(type).elems * layout_of(type).bytes; }

/* Rearrange an n x k matrix of `type` (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0) into the packed
 * layout, in place; its kernels then take `type | PACK8`. */
int quant_pack8(int type, uint8_t *w, int64_t n, int64_t k, int num_threads) {
    const int bad = p8_check(type, n, k);
    if (bad) return bad;
    const int64_t row_bytes = p8_row_bytes(type, k);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        uint8_t *rows = malloc((size_t)(P8 * row_bytes));
        if (!rows) failed = 1;
        #pragma omp barrier
        if (!failed) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < n / P8; t++) {
                memcpy(rows, w + t * P8 * row_bytes, (size_t)(P8 * row_bytes));
                p8_tile_any(type, rows, row_bytes, w + t * P8 * row_bytes, k / layout_of(type).elems, 0);
            }
        }
        free(rows);
    }
    return failed ? NO_MEMORY : OK;
}

#if HAS_DIRECT
/* quant_matmul_i8 on a packed matrix: every row count straight from the tiles. */
static int matmul_p8(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                     int num_threads) {
    const int bad = p8_check(type, n, k);
    if (bad) return bad;
    const int64_t row_bytes = p8_row_bytes(type, k), tiles = n / P8;
    /* 4 turns per thread, not tile_grain's 16: each turn one longer contiguous stream (2 threads,
     * 512 x 2048 Q4_K from memory: 22.5-24.5 GB/s against 11-13.5 with 16 turns; ggml's
     * repacked 20.0-20.4 in the same runs) */
    const int64_t grain = tiles / (4 * num_threads) > 0 ? tiles / (4 * num_threads) : 1;
    /* A few rows of x: each thread rounds them itself (a few microseconds) rather than waiting
     * at a barrier for one thread to (2 threads, 512 x 2048 Q4_K from memory: 0.67x ggml with
     * the barrier). */
    const int own = m <= P8_MAX_X, with_isum = type == Q8_0 && P8_VNNI;  /* Q8_0's bias (tile_p8_q4) */
    qx shared = own ? (qx){0} : qx_new(m, k, with_isum);
    if (!own && !qx_ok(&shared, with_isum)) {
        qx_free(&shared);
        return NO_MEMORY;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        qx mine = own ? qx_new(m, k, with_isum) : (qx){0};
        const qx *xq = own ? &mine : &shared;
        if (own && qx_ok(&mine, with_isum)) {
            for (int64_t r = 0; r < m; r++) quantize_x_row(x, k, r, &mine);
        } else if (own) {
            failed = 1;  /* this thread's tiles are skipped; the call reports it */
        } else {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_x_row(x, k, r, &shared);
        }
        const int ready = qx_ok(xq, with_isum);
        #pragma omp for schedule(dynamic, grain) nowait
        for (int64_t t = 0; t < tiles; t++) {  /* (every thread meets the loop; one without x skips) */
            if (!ready) continue;
#define ROWS_OF(T) tile_p8_rows(T, w, row_bytes, k, t, xq, m, y, n)
            SWITCH_PACKED(type, ROWS_OF)
#undef ROWS_OF
        }
        qx_free(&mine);
    }
    qx_free(&shared);
    return failed ? NO_MEMORY : OK;
}
#endif

/* quant_matmul with x rounded to 8 bits per 32 values (llama.cpp's Q8_0 activations): integer
 * dot products, about 4x fewer instructions per weight than decoding to fp32. */
int quant_matmul_i8(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                    float *y, int num_threads) {
    if (type & PACK8) {
#if HAS_DIRECT
        return matmul_p8(type & ~PACK8, w, n, k, x, m, y, num_threads);
#else
        return BAD_TYPE;
#endif
    }
    const int chunk = chunk_of(type, k);
    if (chunk < 0) return chunk;
    const int64_t row_bytes = k / layout_of(type).elems * layout_of(type).bytes;
    const int64_t num_tiles = (n + ROWS - 1) / ROWS, grain = tile_grain(num_tiles, num_threads);
    qx xq = qx_new(m, k, 0);
    if (!qx_ok(&xq, 0)) {
        qx_free(&xq);
        return NO_MEMORY;
    }
#if HAS_DIRECT
    const int direct = has_direct(type) && m <= DIRECT_ROWS, kdirect = has_kdirect(type) && m <= DIRECT_ROWS;
    const int64_t ktiles = (n + KROWS - 1) / KROWS, kgrain = tile_grain(ktiles, num_threads);
    int failed = 0;
#endif
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_x_row(x, k, r, &xq);
#if HAS_DIRECT
        int32_t *sums = kdirect ? aligned_alloc(32, (size_t)kq_sums_ints(k) * sizeof(int32_t)) : NULL;
        if (kdirect && !sums) failed = 1;  /* every thread then skips the tiles (no early exit from a region) */
        #pragma omp barrier
        if (kdirect && !failed) {  /* K-quants, a few rows of x: 8-row tiles straight from the blocks */
            #pragma omp for schedule(dynamic, kgrain)
            for (int64_t t = 0; t < ktiles; t++) {
                const int64_t n0 = t * KROWS;
                const int rows = n - n0 < KROWS ? (int)(n - n0) : KROWS;
                for (int64_t r = 0; r < m; r += 2) {  /* two rows of x at a time, one last alone */
#define KDIRECT(T, NX) tile_kq_direct(T, w, row_bytes, k, n0, rows, &xq, r, NX, y, n, sums)
#define KDIRECTS(T) if (r + 1 < m) KDIRECT(T, 2); else KDIRECT(T, 1)
                    if (type == Q4_K) KDIRECTS(Q4_K); else if (type == Q5_K) KDIRECTS(Q5_K); else KDIRECTS(Q6_K);
#undef KDIRECTS
#undef KDIRECT
                }
            }
        }
        free(sums);
        if (!kdirect)
#endif
        #pragma omp for schedule(dynamic, grain)
        for (int64_t t = 0; t < num_tiles; t++) {
            const int64_t n0 = t * ROWS;
            const int rows = n - n0 < ROWS ? (int)(n - n0) : ROWS;
#if HAS_DIRECT
            if (direct) {
                for (int64_t r = 0; r < m; r += 2) {  /* two rows of x at a time, one last alone */
#define DIRECT(T, NX) tile_i8_direct(T, w, row_bytes, k, n0, rows, &xq, r, NX, y, n)
#define DIRECTS(T) if (r + 1 < m) DIRECT(T, 2); else DIRECT(T, 1)
                    if (type == Q4_1) DIRECTS(Q4_1); else if (type == Q4_0) DIRECTS(Q4_0);
                    else if (type == IQ4_NL) DIRECTS(IQ4_NL); else DIRECTS(Q8_0);
#undef DIRECTS
#undef DIRECT
                }
                continue;
            }
#endif
            for (int64_t m0 = 0; m0 < m; m0 += MAX_M) {
                const int num_m = m - m0 < MAX_M ? (int)(m - m0) : MAX_M;
#define TILE(T) tile_i8(T, chunk, w, row_bytes, k, n0, rows, &xq, m0, num_m, y, n)
                SWITCH_TYPE(type, TILE)
#undef TILE
            }
        }
    }
    qx_free(&xq);
#if HAS_DIRECT
    if (failed) return NO_MEMORY;
#endif
    return OK;
}

/* ---- int8 panels: one int32 lane per row of x (8 rows a vector), for steps of many rows ----
 * The kernel above sums a weight row's 32-value group into 8 lanes of partial sums and pays a
 * convert, a multiply and an FMA for every (weight row, x row, group): 4-5 vector operations
 * per 32 multiply-adds, as many as fp32 FMAs take. Here x's rows are interleaved 4 bytes at a
 * time ([8 rows][4 values] per vector), a weight row's 4 codes are broadcast to every lane,
 * and one dpbusd (maddubs + madd without VNNI) adds 32 products into 8 exact int32 sums, one
 * per row of x: a group's float work is paid once per 8 rows. Per (weight row, x row) the
 * operations and their order do not depend on the other rows, so a row gives the same bits
 * alone or in any batch. Rows of x past m are zeros in the last panel and are not stored. */
#if defined(__AVX2__)
#define PANEL 8      /* rows of x per panel (int32 lanes of a 256-bit vector) */
#define MAX_PANELS 16  /* panels per pass: their accumulators on the stack, x's piece in L2 */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif

typedef struct {  /* x by panels: p = row / 8, lane = row % 8 */
    int8_t *q;      /* [panels][k / 4][8][4] */
    float *d;       /* [panels][k / 32][8] */
    float *sums;    /* [panels][k / 16][8]: d * (sum of the 16 q) */
    int32_t *bias;  /* [panels][k / 32][8]: -128 * (sum of the 32 q), for codes shifted by 128 */
} qx_panels;

/* Rows [8p, 8p + 8) of the row-major quantized x into panel p (rows past m: zeros). */
static void interleave_panel(const qx *x, int64_t m, int64_t k, int64_t p, qx_panels *out) {
    const int64_t groups = k / 32;
    int32_t *q = (int32_t *)(out->q + p * k * PANEL);
    float *d = out->d + p * groups * PANEL, *sums = out->sums + p * groups * 2 * PANEL;
    int32_t *bias = out->bias + p * groups * PANEL;
    for (int lane = 0; lane < PANEL; lane++) {
        const int64_t row = p * PANEL + lane;
        const int valid = row < m;
        const int32_t *src = (const int32_t *)(x->q + row * k);
        for (int64_t j = 0; j < k / 4; j++) q[j * PANEL + lane] = valid ? src[j] : 0;
        for (int64_t g = 0; g < groups; g++) {
            d[g * PANEL + lane] = valid ? x->d[row * groups + g] : 0.0f;
            bias[g * PANEL + lane] = valid ? -128 * x->isum[row * groups + g] : 0;
        }
        for (int64_t h = 0; h < 2 * groups; h++) sums[h * PANEL + lane] = valid ? x->sums[row * 2 * groups + h] : 0.0f;
    }
}

/* acc + the products of 4 codes (broadcast) with each lane's 4 values, summed per lane. */
INLINE __m256i panel_dot(__m256i acc, __m256i codes, __m256i xq, int is_signed) {
#if HAS_VNNI
    (void)is_signed;  /* signed codes were shifted to unsigned (+128) and bias corrects */
    return _mm256_dpbusd_epi32(acc, codes, xq);
#else
    const __m256i cu = is_signed ? _mm256_sign_epi8(codes, codes) : codes;  /* |c| <= 128, or c <= 63 */
    const __m256i xs = is_signed ? _mm256_sign_epi8(xq, codes) : xq;
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(cu, xs), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512VL__)
#define PANELS_AT_ONCE 4  /* 16 accumulators + 4 codes + 4 x vectors: within 32 registers */
#else
#define PANELS_AT_ONCE 2  /* within 16 registers */
#endif

/* Weight rows [0, ROWS) of w times `np` panels from `panel` over values [k0, k0 + piece):
 * tot[p][r] += per group (integer dot) * scale * xd; off[p][r] += offsets * sums. Each code
 * broadcast feeds np dot products and each x vector ROWS: loads per dot product stay below one. */
INLINE void panels_dot(int type, const coded *w, int piece, const qx_panels *x, int64_t k, int64_t k0,
                       int64_t panel, int np, __m256 tot[][ROWS], __m256 off[][ROWS][OFF_CHAINS]) {
    const int is_signed = codes_signed(type), sub16 = scales_per_16(type);
    const int group = sub16 ? 16 : 32;  /* values per scale */
    const int8_t *xq[PANELS_AT_ONCE];
    const float *xd[PANELS_AT_ONCE], *xs[PANELS_AT_ONCE];
    const int32_t *bias[PANELS_AT_ONCE];
    __m256 t[PANELS_AT_ONCE][ROWS];
    for (int p = 0; p < np; p++) {
        xq[p] = x->q + (panel + p) * k * PANEL + k0 * PANEL;
        xd[p] = x->d + ((panel + p) * k + k0) / 32 * PANEL;
        xs[p] = x->sums + ((panel + p) * k + k0) / 16 * PANEL;
        bias[p] = x->bias + ((panel + p) * k + k0) / 32 * PANEL;
        for (int r = 0; r < ROWS; r++) t[p][r] = tot[p][r];
    }
    for (int v0 = 0; v0 < piece; v0 += group) {
        __m256i acc[PANELS_AT_ONCE][ROWS];
        for (int p = 0; p < np; p++) {
            const __m256i start = HAS_VNNI && is_signed ? _mm256_loadu_si256((const __m256i *)(bias[p] + v0 / 32 * PANEL))
                                                        : _mm256_setzero_si256();
            for (int r = 0; r < ROWS; r++) acc[p][r] = start;
        }
#pragma GCC unroll 8
        for (int j = 0; j < group; j += 4) {
            __m256i xv[PANELS_AT_ONCE];
            for (int p = 0; p < np; p++) xv[p] = _mm256_loadu_si256((const __m256i *)(xq[p] + (v0 + j) * PANEL));
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                int32_t c;
                memcpy(&c, w[r].c + v0 + j, 4);
                const __m256i cv = _mm256_set1_epi32(c);
                for (int p = 0; p < np; p++) acc[p][r] = panel_dot(acc[p][r], cv, xv[p], is_signed);
            }
        }
        for (int p = 0; p < np; p++) {
            const __m256 xdv = _mm256_loadu_ps(xd[p] + v0 / 32 * PANEL);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++)
                t[p][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[p][r]),
                                          _mm256_mul_ps(_mm256_set1_ps(w[r].sc[v0 / 16]), xdv), t[p][r]);
        }
    }
    for (int p = 0; p < np; p++)
        for (int r = 0; r < ROWS; r++) tot[p][r] = t[p][r];
    if (!has_offsets(type)) return;  /* offsets 0: the chains stay +0, as the other paths' */
    for (int p = 0; p < np; p++) {  /* the offsets: a panel's 4 rows x 4 chains (h % 4) */
        __m256 o[ROWS][OFF_CHAINS];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < OFF_CHAINS; j++) o[r][j] = off[p][r][j];
        int h = 0;
        for (; h + OFF_CHAINS <= piece / 16; h += OFF_CHAINS)
            for (int j = 0; j < OFF_CHAINS; j++) {
                const __m256 sv = _mm256_loadu_ps(xs[p] + (h + j) * PANEL);
#pragma GCC unroll 4
                for (int r = 0; r < ROWS; r++) o[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(w[r].off[h + j]), sv, o[r][j]);
            }
        for (int j = 0; h + j < piece / 16; j++) {
            const __m256 sv = _mm256_loadu_ps(xs[p] + (h + j) * PANEL);
            for (int r = 0; r < ROWS; r++) o[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(w[r].off[h + j]), sv, o[r][j]);
        }
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < OFF_CHAINS; j++) off[p][r][j] = o[r][j];
    }
}

/* panels_dot over `num_panels` panels, PANELS_AT_ONCE at a time (the same operations per
 * (weight row, x row) whatever the grouping). */
INLINE void panel_piece(int type, const coded *w, int piece, const qx_panels *x, int64_t k, int64_t k0,
                        int64_t p0, int num_panels, __m256 tot[][ROWS], __m256 off[][ROWS][OFF_CHAINS]) {
    int p = 0;
    for (; p + PANELS_AT_ONCE <= num_panels; p += PANELS_AT_ONCE)
        panels_dot(type, w, piece, x, k, k0, p0 + p, PANELS_AT_ONCE, tot + p, off + p);
#if PANELS_AT_ONCE > 2
    /* 2-3 panels left (9-31 rows): two at once, not one by one (16 rows took 1.6x 8 rows) */
    for (; p + 2 <= num_panels; p += 2) panels_dot(type, w, piece, x, k, k0, p0 + p, 2, tot + p, off + p);
#endif
    for (; p < num_panels; p++) panels_dot(type, w, piece, x, k, k0, p0 + p, 1, tot + p, off + p);
}

INLINE void tile_panels(int type, int chunk, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0,
                        int num_rows, const qx_panels *x, int64_t p0, int num_panels, int64_t m,
                        float *y, int64_t n) {
    coded rows[ROWS] __attribute__((aligned(64)));
    __m256 tot[MAX_PANELS][ROWS], off[MAX_PANELS][ROWS][OFF_CHAINS];
    if (num_rows < ROWS) memset(rows, 0, sizeof rows);  /* rows past num_rows: zero */
    for (int p = 0; p < num_panels; p++)
        for (int r = 0; r < ROWS; r++) {
            tot[p][r] = _mm256_setzero_ps();
            for (int j = 0; j < OFF_CHAINS; j++) off[p][r][j] = _mm256_setzero_ps();
        }
    const int most = PIECE / chunk * chunk;
    for (int64_t k0 = 0; k0 < k; k0 += most) {
        const int piece = k - k0 < most ? (int)(k - k0) : most;
        for (int r = 0; r < num_rows; r++) {
            code_piece(type, w + (n0 + r) * row_bytes, k0, piece, chunk, rows + r);
            if (HAS_VNNI && codes_signed(type))  /* dpbusd multiplies unsigned codes: c + 128 */
                for (int j = 0; j < piece; j += 32)
                    _mm256_storeu_si256((__m256i *)(rows[r].c + j),
                                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rows[r].c + j)),
                                                         _mm256_set1_epi8((char)0x80)));
        }
        panel_piece(type, rows, piece, x, k, k0, p0, num_panels, tot, off);
    }
    for (int p = 0; p < num_panels; p++) {  /* 4 weight rows x 8 x rows -> 8 rows of y, 4 floats each */
        __m256 v[ROWS];
        for (int r = 0; r < ROWS; r++)
            v[r] = _mm256_add_ps(tot[p][r], _mm256_add_ps(_mm256_add_ps(off[p][r][0], off[p][r][1]),
                                                          _mm256_add_ps(off[p][r][2], off[p][r][3])));
        const __m256 a = _mm256_unpacklo_ps(v[0], v[1]), b = _mm256_unpacklo_ps(v[2], v[3]);
        const __m256 c = _mm256_unpackhi_ps(v[0], v[1]), d = _mm256_unpackhi_ps(v[2], v[3]);
        const __m256 rows04 = _mm256_shuffle_ps(a, b, 0x44), rows15 = _mm256_shuffle_ps(a, b, 0xee);
        const __m256 rows26 = _mm256_shuffle_ps(c, d, 0x44), rows37 = _mm256_shuffle_ps(c, d, 0xee);
        __m128 out[PANEL] = {_mm256_castps256_ps128(rows04), _mm256_castps256_ps128(rows15),
                             _mm256_castps256_ps128(rows26), _mm256_castps256_ps128(rows37),
                             _mm256_extractf128_ps(rows04, 1), _mm256_extractf128_ps(rows15, 1),
                             _mm256_extractf128_ps(rows26, 1), _mm256_extractf128_ps(rows37, 1)};
        for (int lane = 0; lane < PANEL; lane++) {
            const int64_t row = (p0 + p) * PANEL + lane;
            if (row >= m) break;
            if (num_rows == ROWS) {
                _mm_storeu_ps(y + row * n + n0, out[lane]);
            } else {
                float four[ROWS];
                _mm_storeu_ps(four, out[lane]);
                for (int r = 0; r < num_rows; r++) y[row * n + n0 + r] = four[r];
            }
        }
    }
}
#endif

/* ---- AVX-512 VNNI: panels of 16 rows of x in one 512-bit vector, 8 weight rows a tile ----
 * The 8-row panels above broadcast a weight row's 4 codes into a register and read x's vector
 * for every dpbusd (two loads per 32 multiply-adds: the loads, not the multiplies, set the
 * pace). Here the codes are dpbusd's signed operand, so each 4 of them come from memory as an
 * embedded broadcast, and x's vector, its unsigned operand (x + 128), is loaded once per 4
 * values for all 8 weight rows. The + 128 adds 128 * (the group's code sum) to each exact sum;
 * the accumulator starts at minus that (from the weight row, exact), so every sum, and with it
 * every float operation and its order, is the 8-row panels', and the bits are theirs. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAS_ZPANELS 1
#define ZPANEL 16      /* rows of x per panel: the int32 lanes of a 512-bit vector */
#define ZROWS 8        /* weight rows per tile: 8 chains of dpbusd in flight */
#define MAX_ZPANELS 8  /* panels per pass (128 rows of x, as MAX_PANELS) */

typedef struct {  /* x by panels of 16: p = row / 16, lane = row % 16 */
    uint8_t *q;   /* [panels][k / 4][16][4]: the quantized values + 128 (rows past m: 128, i.e. 0) */
    float *d;     /* [panels][k / 32][16] */
    float *sums;  /* [panels][k / 16][16]: d * (sum of the 16 q) */
} qx_zpanels;

typedef struct {  /* a coded weight row and, per 16 values, -128 * (the sum of its codes) */
    coded w;
    int32_t bias[PIECE / 16];
} zcoded;

static void interleave_zpanel(const qx *x, int64_t m, int64_t k, int64_t p, qx_zpanels *out) {
    const int64_t groups = k / 32;
    uint32_t *q = (uint32_t *)(out->q + p * k * ZPANEL);
    float *d = out->d + p * groups * ZPANEL, *sums = out->sums + p * groups * 2 * ZPANEL;
    for (int lane = 0; lane < ZPANEL; lane++) {
        const int64_t row = p * ZPANEL + lane;
        const int valid = row < m;
        const uint32_t *src = (const uint32_t *)(x->q + row * k);
        for (int64_t j = 0; j < k / 4; j++) q[j * ZPANEL + lane] = valid ? src[j] ^ 0x80808080u : 0x80808080u;
        for (int64_t g = 0; g < groups; g++) d[g * ZPANEL + lane] = valid ? x->d[row * groups + g] : 0.0f;
        for (int64_t h = 0; h < 2 * groups; h++) sums[h * ZPANEL + lane] = valid ? x->sums[row * 2 * groups + h] : 0.0f;
    }
}

/* bias[h] = -128 * (sum of codes [16h, 16h + 16)), the codes read as dpbusd's signed bytes:
 * sums of 8 bytes as unsigned (c ^ 0x80 = c + 128) by vpsadbw, paired, less 16 * 128, all in
 * registers (storing the 8 sums to add them as scalars stalled on the store each time). */
INLINE void code_bias(int piece, zcoded *row) {
    for (int j = 0; j < piece; j += 64) {
        const __m512i c = _mm512_loadu_si512(row->w.c + j);  /* a last partial vector reads the rest of c[] */
        const __m256i eights = _mm512_cvtepi64_epi32(_mm512_sad_epu8(_mm512_xor_si512(c, _mm512_set1_epi8((char)0x80)),
                                                                     _mm512_setzero_si512()));
        const __m256i pairs = _mm256_permute4x64_epi64(_mm256_hadd_epi32(eights, eights), 0x08);  /* 4 sums of 16 */
        const __m128i bias = _mm_slli_epi32(_mm_sub_epi32(_mm_set1_epi32(16 * 128), _mm256_castsi256_si128(pairs)), 7);
        if (piece - j >= 64) _mm_storeu_si128((__m128i *)(row->bias + j / 16), bias);
        else _mm_mask_storeu_epi32(row->bias + j / 16, (__mmask8)((1u << ((piece - j) / 16)) - 1), bias);
    }
}

typedef int32_t int32_alias __attribute__((may_alias));

/* acc + each lane's 4 unsigned bytes of xv times the 4 signed codes at c: vpdpbusd with the
 * codes as an embedded broadcast from memory, which GCC does not form from _mm512_set1_epi32
 * (it broadcast into a register before each dpbusd: the matmul 5-10% slower on Zen 4). */
INLINE __m512i dot_broadcast(__m512i acc, __m512i xv, const uint8_t *c) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(xv), "m"(*(const int32_alias *)c));
    return acc;
}

/* One panel's state for the tile's 8 weight rows over values [k0, k0 + piece): panels_dot's
 * operations per (weight row, x row), in its order. */
INLINE void zpanel_dot(int type, const zcoded *w, int piece, const qx_zpanels *x, int64_t k, int64_t k0,
                       int64_t panel, __m512 tot[ZROWS], __m512 off[ZROWS][OFF_CHAINS]) {
    const int sub16 = scales_per_16(type), group = sub16 ? 16 : 32;
    const uint8_t *xq = x->q + panel * k * ZPANEL + k0 * ZPANEL;
    const float *xd = x->d + (panel * k + k0) / 32 * ZPANEL, *xs = x->sums + (panel * k + k0) / 16 * ZPANEL;
    __m512 t[ZROWS];
    for (int r = 0; r < ZROWS; r++) t[r] = tot[r];
    for (int v0 = 0; v0 < piece; v0 += group) {
        __m512i acc[ZROWS];
#pragma GCC unroll 8
        for (int r = 0; r < ZROWS; r++)
            acc[r] = _mm512_set1_epi32(sub16 ? w[r].bias[v0 / 16] : w[r].bias[v0 / 16] + w[r].bias[v0 / 16 + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < group; j += 4) {
            const __m512i xv = _mm512_loadu_si512(xq + (v0 + j) * ZPANEL);
#pragma GCC unroll 8
            for (int r = 0; r < ZROWS; r++) {
                acc[r] = dot_broadcast(acc[r], xv, w[r].w.c + v0 + j);
            }
        }
        const __m512 xdv = _mm512_loadu_ps(xd + v0 / 32 * ZPANEL);
#pragma GCC unroll 8
        for (int r = 0; r < ZROWS; r++)
            t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(_mm512_set1_ps(w[r].w.sc[v0 / 16]), xdv), t[r]);
    }
    for (int r = 0; r < ZROWS; r++) tot[r] = t[r];
    if (!has_offsets(type)) return;  /* offsets 0: the chains stay +0, as the other paths' */
    for (int r = 0; r < ZROWS; r += 2) {  /* the offsets, two weight rows at a time: 8 chains */
        __m512 o[2][OFF_CHAINS];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < OFF_CHAINS; j++) o[i][j] = off[r + i][j];
        int h = 0;
        for (; h + OFF_CHAINS <= piece / 16; h += OFF_CHAINS)
#pragma GCC unroll 4
            for (int j = 0; j < OFF_CHAINS; j++) {
                const __m512 sv = _mm512_loadu_ps(xs + (h + j) * ZPANEL);
                o[0][j] = _mm512_fmadd_ps(_mm512_set1_ps(w[r].w.off[h + j]), sv, o[0][j]);
                o[1][j] = _mm512_fmadd_ps(_mm512_set1_ps(w[r + 1].w.off[h + j]), sv, o[1][j]);
            }
        for (int j = 0; h + j < piece / 16; j++) {
            const __m512 sv = _mm512_loadu_ps(xs + (h + j) * ZPANEL);
            o[0][j] = _mm512_fmadd_ps(_mm512_set1_ps(w[r].w.off[h + j]), sv, o[0][j]);
            o[1][j] = _mm512_fmadd_ps(_mm512_set1_ps(w[r + 1].w.off[h + j]), sv, o[1][j]);
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < OFF_CHAINS; j++) off[r + i][j] = o[i][j];
    }
}

INLINE void tile_zpanels(int type, int chunk, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0,  /* w: row n0 */
                         int num_rows, const qx_zpanels *x, int64_t p0, int num_panels, int64_t m,
                         float *y, int64_t n) {
    zcoded rows[ZROWS] __attribute__((aligned(64)));
    __m512 tot[MAX_ZPANELS][ZROWS], off[MAX_ZPANELS][ZROWS][OFF_CHAINS];
    if (num_rows < ZROWS) memset(rows, 0, sizeof rows);  /* rows past num_rows: zero */
    for (int p = 0; p < num_panels; p++)
        for (int r = 0; r < ZROWS; r++) {
            tot[p][r] = _mm512_setzero_ps();
            for (int j = 0; j < OFF_CHAINS; j++) off[p][r][j] = _mm512_setzero_ps();
        }
    const int most = PIECE / chunk * chunk;
    for (int64_t k0 = 0; k0 < k; k0 += most) {
        const int piece = k - k0 < most ? (int)(k - k0) : most;
        for (int r = 0; r < num_rows; r++) {
            code_piece(type, w + r * row_bytes, k0, piece, chunk, &rows[r].w);
            code_bias(piece, rows + r);
        }
        for (int p = 0; p < num_panels; p++) zpanel_dot(type, rows, piece, x, k, k0, p0 + p, tot[p], off[p]);
    }
    for (int p = 0; p < num_panels; p++) {
        float out[ZROWS][ZPANEL] __attribute__((aligned(64)));
        for (int r = 0; r < ZROWS; r++)
            _mm512_store_ps(out[r], _mm512_add_ps(tot[p][r], _mm512_add_ps(_mm512_add_ps(off[p][r][0], off[p][r][1]),
                                                                           _mm512_add_ps(off[p][r][2], off[p][r][3]))));
        for (int lane = 0; lane < ZPANEL; lane++) {
            const int64_t row = (p0 + p) * ZPANEL + lane;
            if (row >= m) break;
            for (int r = 0; r < num_rows; r++) y[row * n + n0 + r] = out[r][lane];
        }
    }
}

/* quant_matmul_i8_panels by panels of 16 rows (its bits); `packed`: w in the packed layout,
 * each tile read back into the file's (p8_unpack) before it is coded. */
static int matmul_zpanels(int type, int chunk, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                          float *y, int num_threads, int packed) {
    const int64_t row_bytes = k / layout_of(type).elems * layout_of(type).bytes;
    const int64_t num_tiles = (n + ZROWS - 1) / ZROWS, panels = (m + ZPANEL - 1) / ZPANEL;
    const int64_t grain = tile_grain(num_tiles, num_threads);
    qx xq = qx_new(m, k, 0);
    qx_zpanels xp = {malloc((size_t)(panels * ZPANEL * k)), malloc((size_t)(panels * ZPANEL * k / 32) * sizeof(float)),
                     malloc((size_t)(panels * ZPANEL * k / 16) * sizeof(float))};
    if (!qx_ok(&xq, 0) || !xp.q || !xp.d || !xp.sums) {
        qx_free(&xq), free(xp.q), free(xp.d), free(xp.sums);
        return NO_MEMORY;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        uint8_t *unpacked = packed ? malloc((size_t)(ZROWS * row_bytes)) : NULL;
        if (packed && !unpacked) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_x_row(x, k, r, &xq);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) interleave_zpanel(&xq, m, k, p, &xp);
        for (int64_t p0 = 0; p0 < panels && !failed; p0 += MAX_ZPANELS) {  /* passes: as quant_matmul_i8_panels */
            const int num_panels = panels - p0 < MAX_ZPANELS ? (int)(panels - p0) : MAX_ZPANELS;
            #pragma omp for schedule(dynamic, grain)
            for (int64_t t = 0; t < num_tiles; t++) {
                const int64_t n0 = t * ZROWS;
                const int rows = n - n0 < ZROWS ? (int)(n - n0) : ZROWS;
                const uint8_t *tile = w + n0 * row_bytes;
                if (packed) p8_unpack(type, w, row_bytes, t, unpacked), tile = unpacked;  /* ZROWS == P8 */
#define TILE(T) tile_zpanels(T, chunk, tile, row_bytes, k, n0, rows, &xp, p0, num_panels, m, y, n)
                SWITCH_TYPE(type, TILE)
#undef TILE
            }
        }
        free(unpacked);
    }
    qx_free(&xq), free(xp.q), free(xp.d), free(xp.sums);
    return failed ? NO_MEMORY : OK;
}
#endif

/* Whether the matmuls read the packed layout on this build (quant_pack8 packs on any). */
int quant_has_packed(void) { return HAS_DIRECT; }

/* Whether quant_matmul_i8_panels runs on this build (it needs AVX2). */
int quant_has_panels(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* quant_matmul_i8's arithmetic by panels of 8 rows of x; BAD_TYPE where the CPU lacks AVX2. */
int quant_matmul_i8_panels(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                           float *y, int num_threads) {
#if defined(__AVX2__)
    if (type & PACK8) {
        /* packed: 16-row panels at every row count where built (else the packed tiles). Not the
         * tiles up to 8 rows: the plans fit one line per path, and a path that was the tiles'
         * call up to 8 rows and the panels' past them fitted neither (cached plans kept the panels
         * at 9-23 rows, where they computed 32 rows for 20 and ran 1.4-1.8x the tiles' time). */
#if defined(HAS_ZPANELS)
        const int bad = p8_check(type & ~PACK8, n, k);
        if (bad) return bad;
        return matmul_zpanels(type & ~PACK8, chunk_of(type & ~PACK8, k), w, n, k, x, m, y, num_threads, 1);
#endif
        return quant_matmul_i8(type, w, n, k, x, m, y, num_threads);
    }
    const int chunk = chunk_of(type, k);
    if (chunk < 0) return chunk;
#if defined(HAS_ZPANELS)
    if (m > PANEL) return matmul_zpanels(type, chunk, w, n, k, x, m, y, num_threads, 0);  /* up to 8 rows: one 8-row panel */
#endif
    const int64_t row_bytes = k / layout_of(type).elems * layout_of(type).bytes;
    const int64_t num_tiles = (n + ROWS - 1) / ROWS, panels = (m + PANEL - 1) / PANEL;
    const int64_t grain = tile_grain(num_tiles, num_threads);
    qx xq = qx_new(m, k, 1);
    qx_panels xp = {malloc((size_t)(panels * PANEL * k)), malloc((size_t)(panels * PANEL * k / 32) * sizeof(float)),
                    malloc((size_t)(panels * PANEL * k / 16) * sizeof(float)),
                    malloc((size_t)(panels * PANEL * k / 32) * sizeof(int32_t))};
    if (!qx_ok(&xq, 1) || !xp.q || !xp.d || !xp.sums || !xp.bias) {
        qx_free(&xq), free(xp.q), free(xp.d), free(xp.sums), free(xp.bias);
        return NO_MEMORY;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_x_row(x, k, r, &xq);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) interleave_panel(&xq, m, k, p, &xp);
        /* One pass of MAX_PANELS panels (128 rows of x) over every weight tile, then the next:
         * the pass's x stays in cache while the weights stream past it. Looping the passes
         * inside each 4-row weight tile instead read all of x from L3 n / 4 times (at 2048
         * rows of SmolLM2's gate/up, 1.2 MB of x: ~900 MB a call), and the panels fell from
         * 1.05-1.15x the fp32 GEMM at 256 rows to 0.91x at 2048. The passes, and with them
         * every row's operations, are the same either way. */
        for (int64_t p0 = 0; p0 < panels; p0 += MAX_PANELS) {
            const int num_panels = panels - p0 < MAX_PANELS ? (int)(panels - p0) : MAX_PANELS;
            #pragma omp for schedule(dynamic, grain)
            for (int64_t t = 0; t < num_tiles; t++) {
                const int64_t n0 = t * ROWS;
                const int rows = n - n0 < ROWS ? (int)(n - n0) : ROWS;
#define TILE(T) tile_panels(T, chunk, w, row_bytes, k, n0, rows, &xp, p0, num_panels, m, y, n)
                SWITCH_TYPE(type, TILE)
#undef TILE
            }
        }
    }
    qx_free(&xq), free(xp.q), free(xp.d), free(xp.sums), free(xp.bias);
    return OK;
#else
    (void)type, (void)w, (void)n, (void)k, (void)x, (void)m, (void)y, (void)num_threads;
    return BAD_TYPE;
#endif
}

static uint16_t to_bf16(float f) {  /* round to nearest even (no NaNs here: finite weights) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

INLINE void dequantize_row(int type, int chunk, const uint8_t *row, int64_t k, float *out, uint16_t *out_bf16) {
    float buf[CHUNK] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        if (out) {
            decode_chunk(type, row, k0, chunk, out + k0);
            continue;
        }
        decode_chunk(type, row, k0, chunk, buf);
        for (int j = 0; j < chunk; j++) out_bf16[k0 + j] = to_bf16(buf[j]);
    }
}

/* quant_dequantize of a packed matrix (rows: whole tiles), each tile read back into the file's
 * layout first. */
static int dequantize_p8(int type, const uint8_t *w, int64_t rows, int64_t k, void *out, int is_bf16,
                         int num_threads) {
    const int bad = p8_check(type, rows, k);
    if (bad) return bad;
    const int64_t row_bytes = p8_row_bytes(type, k);
    const int chunk = chunk_of(type, k);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        uint8_t *tile = malloc((size_t)(P8 * row_bytes));
        if (!tile) failed = 1;
        #pragma omp barrier
        if (!failed) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < rows / P8; t++) {
                p8_unpack(type, w, row_bytes, t, tile);
                for (int64_t r = t * P8; r < (t + 1) * P8; r++) {
                    const uint8_t *row = tile + (r - t * P8) * row_bytes;
#define ROW(T) dequantize_row(T, chunk, row, k, is_bf16 ? NULL : (float *)out + r * k, is_bf16 ? (uint16_t *)out + r * k : NULL)
                    SWITCH_PACKED(type, ROW)
#undef ROW
                }
            }
        }
        free(tile);
    }
    return failed ? NO_MEMORY : OK;
}

/* out [rows, k] (fp32, or bf16 if is_bf16) = the rows' values. */
int quant_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, void *out, int is_bf16,
                     int num_threads) {
    if (type & PACK8) return dequantize_p8(type & ~PACK8, w, rows, k, out, is_bf16, num_threads);
    const int chunk = chunk_of(type, k);
    if (chunk < 0) return chunk;
    const int64_t row_bytes = k / layout_of(type).elems * layout_of(type).bytes;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(T) dequantize_row(T, chunk, w + r * row_bytes, k, is_bf16 ? NULL : (float *)out + r * k, \
                              is_bf16 ? (uint16_t *)out + r * k : NULL)
        SWITCH_TYPE(type, ROW)
#undef ROW
    }
    return OK;
}
