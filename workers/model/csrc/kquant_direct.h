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

/* Four rows' 4 int32 each -> 4 vectors of the rows' value j (lane r: row r). */
INLINE void rows_transpose(__m128i *v) {
    const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpackhi_epi32(v[0], v[1]);
    const __m128i t2 = _mm_unpacklo_epi32(v[2], v[3]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm_unpacklo_epi64(t0, t2), v[1] = _mm_unpackhi_epi64(t0, t2);
    v[2] = _mm_unpacklo_epi64(t1, t3), v[3] = _mm_unpackhi_epi64(t1, t3);
}

/* Byte j of each 32-bit lane, as a float (signed: as int8). */
INLINE __m128 lane_byte(__m128i v, int j, int is_signed) {
    if (is_signed) return _mm_cvtepi32_ps(_mm_srai_epi32(_mm_slli_epi32(v, 24 - 8 * j), 24));
    return _mm_cvtepi32_ps(j == 3 ? _mm_srli_epi32(v, 24) : _mm_and_si128(_mm_srli_epi32(v, 8 * j), _mm_set1_epi32(255)));
}

/* The 4 rows' halves of each lane's pair of IEEE halves (d | dmin) as floats: lo, hi. */
INLINE __m128 halves_lo_hi(__m128i pairs, __m128 *hi) {
    const __m128i sorted = _mm_shuffle_epi8(pairs, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    *hi = _mm_cvtph_ps(_mm_unpackhi_epi64(sorted, sorted));
    return _mm_cvtph_ps(sorted);
}

/* One superblock's scales and offsets of the 4 rows, one vector per 16-value half (lane r:
 * row r), as the coded path computes them: Q4_K/Q5_K sc = d * s_j and off = -(dmin * m_j) for
 * both halves of group j; Q6_K sc = d * s_h and off = -(32 * sc). Each is one product with one
 * rounding, which a negation or a factor of -32 on an operand leaves as it is, so the bits are
 * codes_chunk's. The rows' scale bytes are
 * transposed first, so each half's 4 values come out of one vector. */
INLINE void kq_scales(int type, const uint8_t *const *b, __m128 *sc, __m128 *off) {
    __m128i v[ROWS];
    if (type == Q6_K) {  /* ql[128] | qh[64] | int8 scales[16] | d */
        for (int r = 0; r < ROWS; r++) v[r] = _mm_loadu_si128((const __m128i *)(b[r] + 192));
        rows_transpose(v);
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)half_bits(b[0] + 208), (short)half_bits(b[1] + 208),
                                                     (short)half_bits(b[2] + 208), (short)half_bits(b[3] + 208),
                                                     0, 0, 0, 0));
        const __m128 d32 = _mm_mul_ps(d, _mm_set1_ps(-32.0f));  /* exact: a power of two */
        for (int h = 0; h < 16; h++) {
            const __m128 s = lane_byte(v[h / 4], h % 4, 1);
            sc[h] = _mm_mul_ps(d, s);
            off[h] = _mm_mul_ps(d32, s);  /* -(32 * (d * s)): scaling by -32 commutes with the rounding */
        }
        return;
    }
    for (int r = 0; r < ROWS; r++) v[r] = _mm_loadu_si128((const __m128i *)b[r]);  /* d | dmin | scales[12] */
    rows_transpose(v);  /* v[0]: d | dmin; v[1..3]: scale bytes 0-3, 4-7, 8-11 */
    __m128 dmin;
    const __m128 d = halves_lo_hi(v[0], &dmin), neg_dmin = _mm_xor_ps(dmin, _mm_set1_ps(-0.0f));
    /* 6-bit scales 0-3 | mins 0-3 | the low nibbles of 4-7 (scales low, mins high), their
     * top bits in the top bits of the first 8 bytes */
    const __m128i six = _mm_set1_epi32(0x3f3f3f3f), nib = _mm_set1_epi32(0x0f0f0f0f), two = _mm_set1_epi32(0x03030303);
    const __m128i s_lo = _mm_and_si128(v[1], six), m_lo = _mm_and_si128(v[2], six);
    const __m128i s_hi = _mm_or_si128(_mm_and_si128(v[3], nib), _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(v[1], 6), two), 4));
    const __m128i m_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(v[3], 4), nib),
                                      _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(v[2], 6), two), 4));
    for (int j = 0; j < 8; j++) {
        sc[2 * j] = sc[2 * j + 1] = _mm_mul_ps(d, lane_byte(j < 4 ? s_lo : s_hi, j % 4, 0));
        off[2 * j] = off[2 * j + 1] = _mm_mul_ps(neg_dmin, lane_byte(j < 4 ? m_lo : m_hi, j % 4, 0));  /* -(dmin m) */
    }
}

/* Rows [a, a + nx) of y (nx: 1 or 2) at columns [n0, n0 + num_rows): tile_i8's results for a
 * K-quant type, superblock by superblock. Lane r of every vector is weight row r; the offsets'
 * four chains are four vectors (chain j: the halves h with h % 4 == j, in order). */
INLINE void tile_kq_direct(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n0, int num_rows,
                           const qx *x, int64_t a, int nx, float *y, int64_t n) {
    const int bytes = layout_of(type).bytes, sub16 = scales_per_16(type);
    const uint8_t *b[ROWS], *next[ROWS];
    for (int r = 0; r < ROWS; r++) {
        b[r] = w + (n0 + (r < num_rows ? r : 0)) * row_bytes;  /* past: row 0 again */
        next[r] = w + (n0 + ROWS + r) * row_bytes;  /* the next tile (prefetch does not fault past the end) */
    }
    const int8_t *xq[2];
    const float *xd[2], *sums[2];
    __m128 t[2], o[2][OFF_CHAINS];
    for (int i = 0; i < nx; i++) {
        xq[i] = x->q + (a + i) * k, xd[i] = x->d + (a + i) * k / 32, sums[i] = x->sums + (a + i) * k / 16;
        t[i] = _mm_setzero_ps();
        for (int j = 0; j < OFF_CHAINS; j++) o[i][j] = _mm_setzero_ps();
    }
    for (int64_t s = 0; s < k / 256; s++) {
        const uint8_t *sb[ROWS] = {b[0] + s * bytes, b[1] + s * bytes, b[2] + s * bytes, b[3] + s * bytes};
        if (a == 0)  /* the next tile's superblock s: a tile is 4 short rows, too little for the
                        hardware's stream prefetcher to reach ahead of (see tile_i8_direct) */
            for (int r = 0; r < ROWS; r++)
                for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)next[r] + s * bytes + line, _MM_HINT_T0);
        __m128 sc[16], off[16];
        kq_scales(type, sb, sc, off);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i c[ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) c[r] = kq_codes(type, sb[r], g);
            for (int i = 0; i < nx; i++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xq[i] + 256 * s + 32 * g));
                __m256i dots[ROWS];
#pragma GCC unroll 4
                for (int r = 0; r < ROWS; r++) dots[r] = codes_dot(c[r], q);
                const __m256i sum = row_sums(dots);
                const __m128 xdv = _mm_set1_ps(xd[i][8 * s + g]);
                const __m128i h0 = _mm256_castsi256_si128(sum), h1 = _mm256_extracti128_si256(sum, 1);
                if (!sub16) {
                    t[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(h0, h1)), _mm_mul_ps(sc[2 * g], xdv), t[i]);
                } else {
                    t[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(h0), _mm_mul_ps(sc[2 * g], xdv), t[i]);
                    t[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(h1), _mm_mul_ps(sc[2 * g + 1], xdv), t[i]);
                }
            }
        }
        for (int i = 0; i < nx; i++)
#pragma GCC unroll 16
            for (int h = 0; h < 16; h++)
                o[i][h % 4] = _mm_fmadd_ps(off[h], _mm_set1_ps(sums[i][16 * s + h]), o[i][h % 4]);
    }
    for (int i = 0; i < nx; i++) {
        float out[ROWS];
        _mm_storeu_ps(out, _mm_add_ps(t[i], _mm_add_ps(_mm_add_ps(o[i][0], o[i][1]), _mm_add_ps(o[i][2], o[i][3]))));
        for (int r = 0; r < num_rows; r++) y[(a + i) * n + n0 + r] = out[r];
    }
}
#endif
