/* The int8 path straight from K-quant blocks (Q4_K, Q5_K, Q6_K) for a few rows of x: included
 * by quant_matmul.c where it has the direct path (AVX2 + F16C), after tile_i8_direct's helpers.
 *
 * tile_i8 codes a 2048-value piece of 4 weight rows into L1 (a byte per value, a scale and an
 * offset per 16) and reads it back: at one row of x that is more work than the dot products
 * (a 1B model's Q4_K matrices ran at a third of llama.cpp's bytes per second on AVX2). Here a
 * superblock's codes go from the file's bytes to a register and into the integer dot product;
 * its scales (8 or 16 per row) are converted together and transposed to one vector per group
 * holding the 4 rows. The float operations are rows_dot_i8's, in its order - per group
 * t += float(exact sum) * (sc * xd) (Q6_K: per 16-value half, first then second), the offsets
 * in 4 chains over the halves, y = t + ((o0 + o1) + (o2 + o3)) - so the bits equal the coded
 * path's and the panels'. Owns: these three layouts' direct decoding. Does not own: the
 * arithmetic's order (rows_dot_i8 sets it).
 */
#ifndef JUSTAPI_KQUANT_DIRECT_H
#define JUSTAPI_KQUANT_DIRECT_H

static int has_kdirect(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Shift each byte's bits left (s > 0) or right (s < 0) by |s|, then keep `mask`: 16-bit lane
 * shifts, so `mask` must keep only bits that stay inside their own byte. */
INLINE __m256i byte_bits(__m256i v, int s, int mask) {
    const __m256i moved = s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)mask));
}

/* Group g's 32 codes of one superblock (unsigned: Q4_K < 16, Q5_K < 32, Q6_K < 64). */
INLINE __m256i kq_codes(int type, const uint8_t *b, int g) {
    if (type == Q6_K) {  /* ql[128] | qh[64] | scales[16] | d; group 4n + k */
        const int n = g / 4, k = g % 4;
        const __m256i lo = byte_bits(_mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (k % 2))), -4 * (k / 2), 15);
        return _mm256_or_si256(lo, byte_bits(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n)), 4 - 2 * k, 0x30));
    }
    const uint8_t *qs = b + (type == Q5_K ? 48 : 16);  /* d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128] */
    const __m256i lo = byte_bits(_mm256_loadu_si256((const __m256i *)(qs + 32 * (g / 2))), -4 * (g % 2), 15);
    if (type == Q4_K) return lo;
    return _mm256_or_si256(lo, byte_bits(_mm256_loadu_si256((const __m256i *)(b + 16)), 4 - g, 16));
}

#define KROWS 8  /* weight rows per tile: the lanes of a 256-bit float vector */

/* Four rows' 4 int32 each -> 4 vectors of the rows' value j (lane r: row r). */
INLINE void rows_transpose(__m128i *v) {
    const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpackhi_epi32(v[0], v[1]);
    const __m128i t2 = _mm_unpacklo_epi32(v[2], v[3]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm_unpacklo_epi64(t0, t2), v[1] = _mm_unpackhi_epi64(t0, t2);
    v[2] = _mm_unpacklo_epi64(t1, t3), v[3] = _mm_unpackhi_epi64(t1, t3);
}

/* The 16 bytes at b[r] + at of the 8 rows as 4 vectors: v[j] lane r = bytes 4j..4j+3 of row r. */
INLINE void rows_bytes(const uint8_t *const *b, int at, __m256i *v) {
    __m128i lo[4], hi[4];
    for (int r = 0; r < 4; r++) {
        lo[r] = _mm_loadu_si128((const __m128i *)(b[r] + at));
        hi[r] = _mm_loadu_si128((const __m128i *)(b[r + 4] + at));
    }
    rows_transpose(lo), rows_transpose(hi);
    for (int j = 0; j < 4; j++) v[j] = _mm256_setr_m128i(lo[j], hi[j]);
}

/* Byte j of each 32-bit lane, as a float (signed: as int8). */
INLINE __m256 lane_byte(__m256i v, int j, int is_signed) {
    if (is_signed) return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * j), 24));
    return _mm256_cvtepi32_ps(j == 3 ? _mm256_srli_epi32(v, 24)
                                     : _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), _mm256_set1_epi32(255)));
}

/* The 8 rows' IEEE halves at b[r] + at, as floats. */
INLINE __m256 rows_half(const uint8_t *const *b, int at) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)half_bits(b[0] + at), (short)half_bits(b[1] + at),
                                          (short)half_bits(b[2] + at), (short)half_bits(b[3] + at),
                                          (short)half_bits(b[4] + at), (short)half_bits(b[5] + at),
                                          (short)half_bits(b[6] + at), (short)half_bits(b[7] + at)));
}

/* One superblock's scale bytes of the 8 rows (lane r: row r) and the factors they multiply:
 * kq_half turns them into one vector per 16-value half when it is needed (kept
 * as 16 + 16 vectors they would not fit the registers). */
typedef struct {
    __m256i v[4];   /* Q6_K: int8 scales 4j..4j+3; Q4_K/Q5_K: 6-bit scales 0-3, 4-7, mins 0-3, 4-7 */
    __m256 d, dm;   /* Q6_K: d, -32 d; Q4_K/Q5_K: d, -dmin */
} kq_state;

INLINE kq_state kq_load(int type, const uint8_t *const *b) {
    kq_state st;
    if (type == Q6_K) {  /* ql[128] | qh[64] | int8 scales[16] | d */
        rows_bytes(b, 192, st.v);
        st.d = rows_half(b, 208);
        st.dm = _mm256_mul_ps(st.d, _mm256_set1_ps(-32.0f));  /* exact: a power of two */
        return st;
    }
    __m256i v[4];
    rows_bytes(b, 4, v);  /* d | dmin | scales[12]: v[0..2] scale bytes 0-3, 4-7, 8-11 */
    st.d = rows_half(b, 0);
    st.dm = _mm256_xor_ps(rows_half(b, 2), _mm256_set1_ps(-0.0f));
    /* 6-bit scales 0-3 | mins 0-3 | the low nibbles of 4-7 (scales low, mins high), their
     * top bits in the top bits of the first 8 bytes */
    const __m256i six = _mm256_set1_epi32(0x3f3f3f3f), nib = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i two = _mm256_set1_epi32(0x03030303);
    st.v[0] = _mm256_and_si256(v[0], six);
    st.v[1] = _mm256_or_si256(_mm256_and_si256(v[2], nib),
                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v[0], 6), two), 4));
    st.v[2] = _mm256_and_si256(v[1], six);
    st.v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v[2], 4), nib),
                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v[1], 6), two), 4));
    return st;
}

/* Half h's scales and offsets, as the coded path computes them: Q4_K/Q5_K sc = d * s_j and
 * off = -(dmin * m_j) (j = h / 2), Q6_K sc = d * s_h and off = -(32 * (d * s_h)). Each is one
 * product with one rounding, which a negation or a factor of -32 on an operand leaves as it
 * is, so the bits are codes_chunk's. */
INLINE __m256 kq_half(int type, const kq_state *st, int h, __m256 *off) {
    if (type == Q6_K) {
        const __m256 s = lane_byte(st->v[h / 4], h % 4, 1);
        *off = _mm256_mul_ps(st->dm, s);
        return _mm256_mul_ps(st->d, s);
    }
    const int j = h / 2;
    *off = _mm256_mul_ps(st->dm, lane_byte(st->v[2 + j / 4], j % 4, 0));
    return _mm256_mul_ps(st->d, lane_byte(st->v[j / 4], j % 4, 0));
}

/* Where group 0 of (x row i, superblock s, weight row r, half) is in the exact sums pass 1
 * writes (kq_sums_ints of them for rows of `blocks` superblocks): one half where the halves
 * share a scale (their total), two where they do not (Q6_K). */
INLINE int64_t kq_at(int i, int64_t s, int r, int half, int halves, int64_t blocks) {
    return (((i * blocks + s) * KROWS + r) * halves + half) * 8;
}

/* Ints of the sums buffer tile_kq_direct needs for rows of k values (two rows of x). */
static int64_t kq_sums_ints(int64_t k) { return 2 * (k / 256) * KROWS * 2 * 8; }

/* Pass 1 for weight row r: each group's exact sums with each row of x, four groups at a time
 * (lane j: group g + j), written to sums at kq_at (half: the first and the second 16 values;
 * `combined`: their total). The row is read in memory order, which the hardware prefetcher
 * follows. */
INLINE void kq_row_sums(int type, const uint8_t *row, int r, int64_t blocks, int nx, const int8_t *const *xq,
                        int combined, int32_t *sums) {
    const int bytes = layout_of(type).bytes, halves = combined ? 1 : 2;
    for (int64_t s = 0; s < blocks; s++) {
        const uint8_t *sb = row + s * bytes;
        for (int g0 = 0; g0 < 8; g0 += 4) {
            __m256i c[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) c[j] = kq_codes(type, sb, g0 + j);
            for (int i = 0; i < nx; i++) {
                __m256i dots[4];
                const int8_t *q = xq[i] + 256 * s + 32 * g0;
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) dots[j] = codes_dot(c[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j)));
                const __m256i sum = row_sums(dots);  /* lanes: groups g0.. (first 16) | (second 16) */
                const __m128i h0 = _mm256_castsi256_si128(sum), h1 = _mm256_extracti128_si256(sum, 1);
                int32_t *out = sums + kq_at(i, s, r, 0, halves, blocks) + g0;
                if (combined) {
                    _mm_storeu_si128((__m128i *)out, _mm_add_epi32(h0, h1));
                } else {
                    _mm_storeu_si128((__m128i *)out, h0);
                    _mm_storeu_si128((__m128i *)(out + 8), h1);
                }
            }
        }
    }
}

/* 8 rows' 8 int32 (v[r]: row r's values 0-7) -> v[j]: value j of each row (lane r: row r). */
INLINE void transpose8(__m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + j] = _mm256_unpacklo_epi64(t[i + j], t[i + j + 2]);
            u[i + j + 2] = _mm256_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    /* u[0]: rows 0-3 values 0, 4 | u[1]: values 2, 6 | u[2]: 1, 5 | u[3]: 3, 7; u[4..7]: rows 4-7 */
    const int order[4] = {0, 2, 1, 3};
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(u[order[j]], u[4 + order[j]], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(u[order[j]], u[4 + order[j]], 0x31);
    }
}

/* Rows [a, a + nx) of y (nx: 1 or 2) at columns [n0, n0 + num_rows), num_rows <= 8: tile_i8's
 * results for a K-quant type. Pass 1 sums each weight row's groups exactly, a whole row at a
 * time (kq_row_sums, into `sums`: kq_sums_ints(k) ints, 32-byte aligned); pass 2 runs the
 * float operations with lane r of every vector weight row r: per group t += float(sum) *
 * (sc * xd), and the offsets' four chains as four vectors (chain j: the halves h with
 * h % 4 == j, in order). Measured on Zen 4 (AVX2 build, one thread, CPU time, Q4_K 8192 x 2048
 * from memory): reading the 8 rows a superblock at a time, the sums reduced across rows in
 * registers, ran at 0.5x ggml's one row at a time (level from L2): 8 short strided streams the
 * hardware prefetcher does not follow, which no software prefetch made up for; rows split
 * into halves of 16 superblocks, 0.4x. Whole rows in order: 0.9-1.0x. */
INLINE void tile_kq_direct(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0, int num_rows,
                           const qx *x, int64_t a, int nx, float *y, int64_t n, int32_t *sums) {
    const int sub16 = scales_per_16(type), bytes = layout_of(type).bytes, halves = 1 + sub16;
    const int64_t blocks = k / 256;
    const uint8_t *b[KROWS];
    for (int r = 0; r < KROWS; r++) b[r] = w + (n0 + (r < num_rows ? r : 0)) * row_bytes;  /* past: row 0 again */
    const int8_t *xq[2];
    const float *xd[2], *xs[2];
    __m256 t[2], o[2][OFF_CHAINS];
    for (int i = 0; i < nx; i++) {
        xq[i] = x->q + (a + i) * k, xd[i] = x->d + (a + i) * k / 32, xs[i] = x->sums + (a + i) * k / 16;
        t[i] = _mm256_setzero_ps();
        for (int j = 0; j < OFF_CHAINS; j++) o[i][j] = _mm256_setzero_ps();
    }
    for (int r = 0; r < num_rows; r++) kq_row_sums(type, b[r], r, blocks, nx, xq, !sub16, sums);
    for (int64_t s = 0; s < blocks; s++) {
        const uint8_t *sb[KROWS];
        for (int r = 0; r < KROWS; r++) sb[r] = b[r] + s * bytes;
        const kq_state st = kq_load(type, sb);
        for (int i = 0; i < nx; i++) {
            __m256i lo[KROWS], hi[KROWS];
            for (int r = 0; r < KROWS; r++)
                lo[r] = _mm256_load_si256((const __m256i *)(sums + kq_at(i, s, r < num_rows ? r : 0, 0, halves, blocks)));
            transpose8(lo);  /* lo[g]: group g's sums (Q6_K: its first 16 values), lane r: row r */
            if (sub16) {
                for (int r = 0; r < KROWS; r++)
                    hi[r] = _mm256_load_si256((const __m256i *)(sums + kq_at(i, s, r < num_rows ? r : 0, 1, 2, blocks)));
                transpose8(hi);
            }
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {  /* the offsets' chains take halves 2g, 2g + 1 in order too */
                const __m256 xdv = _mm256_set1_ps(xd[i][8 * s + g]);
                __m256 off0, off1;
                const __m256 sc0 = kq_half(type, &st, 2 * g, &off0);
                t[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[g]), _mm256_mul_ps(sc0, xdv), t[i]);
                if (sub16) {
                    const __m256 sc1 = kq_half(type, &st, 2 * g + 1, &off1);
                    t[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[g]), _mm256_mul_ps(sc1, xdv), t[i]);
                } else {
                    off1 = off0;
                }
                const int64_t h = 16 * s + 2 * g;
                o[i][(2 * g) % 4] = _mm256_fmadd_ps(off0, _mm256_set1_ps(xs[i][h]), o[i][(2 * g) % 4]);
                o[i][(2 * g + 1) % 4] = _mm256_fmadd_ps(off1, _mm256_set1_ps(xs[i][h + 1]), o[i][(2 * g + 1) % 4]);
            }
        }
    }
    for (int i = 0; i < nx; i++) {
        float out[KROWS];
        _mm256_storeu_ps(out, _mm256_add_ps(t[i], _mm256_add_ps(_mm256_add_ps(o[i][0], o[i][1]),
                                                                _mm256_add_ps(o[i][2], o[i][3]))));
        for (int r = 0; r < num_rows; r++) y[(a + i) * n + n0 + r] = out[r];
    }
}
#endif
