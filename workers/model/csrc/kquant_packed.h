/* Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 with rows interleaved by 8 ("packed"): the file's
 * bytes, rearranged once at load, read by the int8 path at any row count of x. Included by
 * quant_matmul.c after kquant_direct.h, whose scale handling (kq_load, kq_half) and float order
 * it shares.
 *
 * Layout: a matrix of n rows (n a multiple of 8) is n / 8 tiles of 8 rows, each tile its 8 rows'
 * bytes in a row of blocks: block s of the tile is the 8 rows' (super)block s, that is 8 x 144
 * (Q4_K), 8 x 176 (Q5_K), 8 x 210 (Q6_K), 8 x 18 (Q4_0), 8 x 20 (Q4_1) or 8 x 34 (Q8_0) bytes, as
 *   Q4_K, Q5_K: 8 headers (row r's d | dmin | scales[12], 16 bytes) | codes
 *   Q6_K: 8 headers (row r's scales[16] | d, 18 bytes) | codes
 *   Q4_0, Q8_0: the 8 rows' d | codes;  Q4_1: the 8 rows' d | the 8 rows' m | codes
 * where codes are the file's 32-byte code blocks (Q4_K: qs[0..127] as 4; Q5_K: qh[0..31], then
 * qs as 4; Q6_K: ql[0..127] as 4, then qh[0..63] as 2; Q4_0, Q4_1: the 16 code bytes; Q8_0:
 * the 32) interleaved 4 bytes at a time: bytes 4c..4c+3 of block j of rows 0..7
 * are the 32 bytes at p8_chunk_at(j, c). Everything lies in the order the kernel reads it, the
 * headers first (Q6_K's after its codes ran at a third of the speed: each superblock waited on
 * a line the prefetcher had not reached) and Q6_K's chunks per half of the superblock, per c,
 * its two ql blocks' and its qh block's (read as 3 streams 256-1024 bytes apart, it waited on
 * memory half the time).
 *
 * So one 32-byte load holds 4 values of a group for the 8 rows (lane r: row r), and vpdpbusd
 * with x's 4 values broadcast adds them to each row's exact group sum: the sums come out with
 * lanes = weight rows, as the float pass takes them, with no horizontal reduction and no sums
 * buffer, and a tile is one contiguous stream (what the hardware prefetcher follows;
 * tile_kq_direct's 8 rows read in turns were 8 streams, and a superblock of 8 rows at a time
 * from the file's layout ran at 0.5x ggml's bytes per second).
 * The float operations and their order per (weight row, x row) are tile_kq_direct's, so the
 * bits are the int8 path's and the panels' on the file's layout. quant_dequantize and the
 * panels read the packed form through p8_unpack (the file's bytes back, per tile).
 * Owns: the packed layout. Does not own: the arithmetic's order (rows_dot_i8 sets it).
 */
#ifndef JUSTAPI_KQUANT_PACKED_H
#define JUSTAPI_KQUANT_PACKED_H

#define PACK8 0x100  /* type | PACK8: the type's blocks in the packed layout */
#define P8 8         /* rows per tile */

static int packable(int type) {
    return type == Q4_K || type == Q5_K || type == Q6_K || type == Q4_0 || type == Q4_1 || type == Q8_0;
}

/* One copy of CALL per packable type, the layout folded into each (as SWITCH_TYPE). */
#define SWITCH_PACKED(type, CALL) switch (type) { \
    case Q4_K: CALL(Q4_K); break; case Q5_K: CALL(Q5_K); break; case Q6_K: CALL(Q6_K); break; \
    case Q4_0: CALL(Q4_0); break; case Q4_1: CALL(Q4_1); break; case Q8_0: CALL(Q8_0); break; }

/* Where a block (superblock) keeps its codes and how many bytes; its header fields (one per
 * row: Q4_K's and Q6_K's whole header; Q4_0's and Q8_0's d; Q4_1's d and m, each a field). */
typedef struct { int code_at, code_bytes, head_at, field_bytes, fields; } p8_layout;

INLINE p8_layout p8_parts(int type) {
    switch (type) {
        case Q4_K: return (p8_layout){16, 128, 0, 16, 1};
        case Q5_K: return (p8_layout){16, 160, 0, 16, 1};  /* qh[32] (block 0) | qs[128] (blocks 1-4) */
        case Q6_K: return (p8_layout){0, 192, 192, 18, 1};
        case Q4_0: return (p8_layout){2, 16, 0, 2, 1};
        case Q8_0: return (p8_layout){2, 32, 0, 2, 1};
        default: return (p8_layout){4, 16, 0, 2, 2};  /* Q4_1: d | m */
    }
}

/* Where in the packed codes the 8 rows' bytes 4c..4c+3 of the file's 32-byte code block j are
 * (Q4_0, Q4_1, Q8_0: the block's 16 or 32 code bytes, j = 0). */
INLINE int p8_chunk_at(int type, int j, int c) {
    if (type == Q4_K || type == Q5_K) return (j * 8 + c) * 32;
    if (type != Q6_K) return c * 32;
    return j < 4 ? (((j / 2) * 8 + c) * 3 + j % 2) * 32 : (((j - 4) * 8 + c) * 3 + 2) * 32;
}

/* Where the packed block keeps its codes and row r's header field f. */
INLINE int p8_codes_at(int type) {
    const p8_layout l = p8_parts(type);
    return P8 * l.field_bytes * l.fields;
}
INLINE int p8_head_at(int type, int r, int f) {
    const int fb = p8_parts(type).field_bytes;
    return f * P8 * fb + r * fb;
}

/* One tile: rows (file layout, row_bytes apart) <-> packed (8 * row_bytes); `unpack` the
 * other way; `blocks`: the row's blocks (superblocks). */
INLINE void p8_tile(int type, uint8_t *rows, int64_t row_bytes, uint8_t *packed, int64_t blocks, int unpack) {
    const p8_layout l = p8_parts(type);
    const int bytes = layout_of(type).bytes;
    for (int64_t s = 0; s < blocks; s++) {
        uint8_t *sp = packed + s * P8 * bytes;
        for (int r = 0; r < P8; r++) {
            uint8_t *sb = rows + r * row_bytes + s * bytes;
            for (int f = 0; f < l.fields; f++) {
                uint8_t *file = sb + l.head_at + f * l.field_bytes, *head = sp + p8_head_at(type, r, f);
                if (unpack) memcpy(file, head, (size_t)l.field_bytes);
                else memcpy(head, file, (size_t)l.field_bytes);
            }
            for (int b = 0; b < l.code_bytes / 4; b++) {  /* 4-byte chunk b: chunk b % 8 of 32-byte block b / 8 */
                uint8_t *file = sb + l.code_at + 4 * b, *p = sp + p8_codes_at(type) + p8_chunk_at(type, b / 8, b % 8) + 4 * r;
                if (unpack) memcpy(file, p, 4);
                else memcpy(p, file, 4);
            }
        }
    }
}

/* p8_tile with the type a constant in each copy (the field and chunk copies fold to moves). */
static void p8_tile_any(int type, uint8_t *rows, int64_t row_bytes, uint8_t *packed, int64_t blocks, int unpack) {
#define TILE(T) p8_tile(T, rows, row_bytes, packed, blocks, unpack)
    SWITCH_PACKED(type, TILE)
#undef TILE
}

/* Rows [8t, 8t + 8) of a packed matrix in the file's layout, into rows (8 * row_bytes). */
INLINE void p8_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t t, uint8_t *rows) {
    p8_tile_any(type, rows, row_bytes, (uint8_t *)(w + t * P8 * row_bytes), row_bytes / layout_of(type).bytes, 1);
}

#if defined(__AVX2__) && defined(__F16C__)
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define P8_VNNI 1
#else
#define P8_VNNI 0
#endif

#if P8_VNNI
/* acc + the products of 8 rows' 4 codes (lane r) with x's 4 values (every lane), per lane: one
 * dpbusd (without VNNI, p8_add's 16-bit runs). */
typedef int32_t p8_i32 __attribute__((may_alias));

INLINE __m256i p8_dot(__m256i acc, __m256i codes, const int8_t *x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* x's 4 values as an embedded broadcast, which GCC does not form from _mm256_set1_epi32 (a
     * broadcast into a register before each one: 2048 x 8192 from memory 6-18% slower) */
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const p8_i32 *)x4));
    return acc;
#else
    int32_t v;
    memcpy(&v, x4, sizeof v);
    return _mm256_dpbusd_epi32(acc, codes, _mm256_set1_epi32(v));
#endif
}
#endif

/* The 8 rows' exact sums of one group (lane r: row r) while its chunks come in. With VNNI each
 * chunk is one dpbusd into `wide`. Without, maddubs leaves 16-bit sums of 2 products a lane
 * half, and `narrow` adds those of p8_run(type) chunks in 16 bits before one madd widens them
 * into `wide`, where a madd and an add followed each maddubs (AVX2 build on a Zen 4, one thread,
 * 1-128 rows: Q4_K / Q5_K / Q4_0 / Q6_K 1.03-1.12x). Nothing can overflow (run x 2 products x the
 * largest code x 128 <= 32767: Q4 8 x 2 x 15 x 128 = 30720, Q5_K 4 x 2 x 31 x 128 = 31744, Q6_K
 * 2 x 2 x 63 x 128 = 32256; tested at those codes), and integers give the same sums in any order,
 * so the bits are the VNNI build's. */
typedef struct { __m256i wide, narrow; } p8_sum;

INLINE int p8_run(int type) { return type == Q6_K ? 2 : type == Q5_K ? 4 : 8; }  /* codes < 64, < 32, < 16 (Q8_0 keeps its own) */

INLINE p8_sum p8_sum_zero(void) { return (p8_sum){_mm256_setzero_si256(), _mm256_setzero_si256()}; }

/* s + chunk c (0-based, of n) of the group: 8 rows' 4 codes with x's 4 values. */
INLINE void p8_add(p8_sum *s, int type, int c, int n, __m256i codes, const int8_t *x4) {
#if P8_VNNI
    (void)type, (void)c, (void)n;
    s->wide = p8_dot(s->wide, codes, x4);
#else
    int32_t v;
    memcpy(&v, x4, sizeof v);
    s->narrow = _mm256_add_epi16(s->narrow, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(v)));
    if ((c + 1) % p8_run(type) == 0 && c + 1 < n) {
        s->wide = _mm256_add_epi32(s->wide, _mm256_madd_epi16(s->narrow, _mm256_set1_epi16(1)));
        s->narrow = _mm256_setzero_si256();
    }
#endif
}

/* The group's sums once its n chunks are in. */
INLINE __m256i p8_total(p8_sum s) {
#if P8_VNNI
    return s.wide;
#else
    return _mm256_add_epi32(s.wide, _mm256_madd_epi16(s.narrow, _mm256_set1_epi16(1)));
#endif
}

/* Group g's scales and offsets (both halves; Q4_K's halves share them), for every row of x. */
typedef struct { __m256 sc0, off0, sc1, off1; } p8_scales;

INLINE p8_scales p8_group_scales(int type, const kq_state *st, int g) {
    p8_scales f;
    f.sc0 = kq_half(type, st, 2 * g, &f.off0);
    if (type == Q6_K) f.sc1 = kq_half(type, st, 2 * g + 1, &f.off1);
    else f.sc1 = f.sc0, f.off1 = f.off0;
    return f;
}

/* tile_kq_direct's float pass for one 32-value group and one row of x: lo its exact sums
 * (Q6_K: the first 16 values', hi the second's), lane r weight row r; the group's halves are x's
 * halves h, h + 1 (group g of superblock s: h = 16 s + 2 g) and go to the offsets' chains
 * `chain`, `chain` + 1 (2g mod 4: a constant at each call, so the chains stay in registers).
 * o NULL: the offsets are p8_offsets' (a pass of their own). */
INLINE void p8_group(int type, const p8_scales *f, int64_t h, int chain, __m256i lo, __m256i hi, float xd,
                     const float *xs, __m256 *t, __m256 *o) {
    const __m256 xdv = _mm256_set1_ps(xd);
    *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(f->sc0, xdv), *t);
    if (type == Q6_K) *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(f->sc1, xdv), *t);
    if (!o) return;
    o[chain] = _mm256_fmadd_ps(f->off0, _mm256_set1_ps(xs[h]), o[chain]);
    o[chain + 1] = _mm256_fmadd_ps(f->off1, _mm256_set1_ps(xs[h + 1]), o[chain + 1]);
}

/* The 8 rows' header state of the packed superblock at sp (kq_load reads each header at its
 * place in the file's superblock). */
INLINE kq_state p8_kq_state(int type, const uint8_t *sp) {
    const uint8_t *head[P8];
    for (int r = 0; r < P8; r++) head[r] = sp + p8_head_at(type, r, 0) - (type == Q6_K ? 192 : 0);
    return kq_load(type, head);
}

/* The offsets' chains of a K-quant tile on their own: half h of x (16-value half h % 16 of
 * superblock h / 16) goes to chain h mod 4, in p8_group's order, so the sums are its bits. Taken
 * out of the codes' pass where 3-4 rows of x share the tile (their 16 chains left fewer
 * registers for the dot products: Q4_K 8192 x 2048, one thread, 4-64 rows 1.05-1.10x); at 1-2
 * rows they stay interleaved (a second sweep of the headers cost one row 9-19%). */
INLINE void p8_offsets(int type, const uint8_t *tile, int64_t blocks, int nx, const float *const *xs,
                       __m256 (*o)[OFF_CHAINS]) {
    const int bytes = layout_of(type).bytes;
    for (int64_t s = 0; s < blocks; s++) {
        const kq_state st = p8_kq_state(type, tile + s * P8 * bytes);
#pragma GCC unroll 16
        for (int h = 0; h < 16; h++) {
            __m256 off;
            (void)kq_half(type, &st, h, &off);
            for (int i = 0; i < nx; i++)
                o[i][h % 4] = _mm256_fmadd_ps(off, _mm256_set1_ps(xs[i][16 * s + h]), o[i][h % 4]);
        }
    }
}

/* y's 8 columns of x row i: t + the offsets' chains in their fixed pairing (tile_kq_direct's
 * and tile_i8_direct's last operations). */
INLINE void p8_store(__m256 t, const __m256 *o, float *y) {
    float out[P8];
    _mm256_storeu_ps(out, _mm256_add_ps(t, _mm256_add_ps(_mm256_add_ps(o[0], o[1]), _mm256_add_ps(o[2], o[3]))));
    memcpy(y, out, sizeof out);
}

/* Q6_K: the 8 rows' exact sums of groups 4 half + j (acc[i][j], x row i) over their first
 * (part 0) or second (part 1) 16 values; x0: x's offset of the superblock. */
INLINE void p6_sums(const uint8_t *codes, int half, int part, const int8_t *const *xq, int64_t x0, int nx,
                    __m256i out[][4]) {
    p8_sum acc[2][4];  /* nx <= 2 */
    for (int i = 0; i < nx; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = p8_sum_zero();
#pragma GCC unroll 4
    for (int c = 4 * part; c < 4 * part + 4; c++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(Q6_K, 2 * half, c)));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(Q6_K, 2 * half + 1, c)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(Q6_K, 4 + half, c)));
        __m256i cv[4];
        cv[0] = _mm256_or_si256(byte_bits(l0, 0, 15), byte_bits(h, 4, 0x30));
        cv[1] = _mm256_or_si256(byte_bits(l1, 0, 15), byte_bits(h, 2, 0x30));
        cv[2] = _mm256_or_si256(byte_bits(l0, -4, 15), byte_bits(h, 0, 0x30));
        cv[3] = _mm256_or_si256(byte_bits(l1, -4, 15), byte_bits(h, -2, 0x30));
        for (int i = 0; i < nx; i++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) p8_add(&acc[i][j], Q6_K, c % 4, 4, cv[j], xq[i] + x0 + 32 * (4 * half + j) + 4 * c);
    }
    for (int i = 0; i < nx; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) out[i][j] = p8_total(acc[i][j]);
}

/* Q6_K, groups jp and jp + 2 of half `half` (both from ql block 2 half + jp: its low and high
 * nibbles): the 8 rows' exact sums over their first (lo[i][j], x row i) and second 16 values
 * (hi), as p6_sums gives them. Two groups a pass keep 16 accumulators at 4 rows of x (p6_sums'
 * four groups took 16 at 2 rows) and build 2 code vectors per chunk where p6_sums builds 4. */
INLINE void p6_pair_sums(const uint8_t *codes, int half, int jp, const int8_t *const *xq, int64_t x0, int nx,
                         __m256i lo[][4], __m256i hi[][4]) {
    p8_sum acc[4][2][2];  /* [x row][group jp, jp + 2][part] */
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < 2; j++) acc[i][j][0] = acc[i][j][1] = p8_sum_zero();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(Q6_K, 2 * half + jp, c)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(Q6_K, 4 + half, c)));
        const __m256i c0 = _mm256_or_si256(byte_bits(l, 0, 15), byte_bits(h, 4 - 2 * jp, 0x30));
        const __m256i c2 = _mm256_or_si256(byte_bits(l, -4, 15), byte_bits(h, -2 * jp, 0x30));
        for (int i = 0; i < nx; i++) {
            const int8_t *q = xq[i] + x0 + 32 * (4 * half + jp) + 4 * (c % 4) + 16 * (c / 4);
            p8_add(&acc[i][0][c / 4], Q6_K, c % 4, 4, c0, q);
            p8_add(&acc[i][1][c / 4], Q6_K, c % 4, 4, c2, q + 64);
        }
    }
    for (int i = 0; i < nx; i++) {
        lo[i][jp] = p8_total(acc[i][0][0]), hi[i][jp] = p8_total(acc[i][0][1]);
        lo[i][jp + 2] = p8_total(acc[i][1][0]), hi[i][jp + 2] = p8_total(acc[i][1][1]);
    }
}

#define P8_MAX_X 4  /* rows of x a tile takes at a time (Q4_K: 8 accumulators; Q6_K: 16) */

/* Rows [a, a + nx) of y at columns [n0, n0 + 8) from packed tile `tile` (k / 256 superblocks). */
INLINE void tile_p8(int type, const uint8_t *tile, int64_t k, int64_t n0, const qx *x, int64_t a, int nx,
                    float *y, int64_t n) {
    const int bytes = layout_of(type).bytes;
    const int64_t blocks = k / 256;
    const int split = nx > 2;  /* the offsets in p8_offsets' pass */
    const int8_t *xq[P8_MAX_X];
    const float *xd[P8_MAX_X], *xs[P8_MAX_X];
    __m256 t[P8_MAX_X], o[P8_MAX_X][OFF_CHAINS];
    for (int i = 0; i < nx; i++) {
        xq[i] = x->q + (a + i) * k, xd[i] = x->d + (a + i) * k / 32, xs[i] = x->sums + (a + i) * k / 16;
        t[i] = _mm256_setzero_ps();
        for (int j = 0; j < OFF_CHAINS; j++) o[i][j] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < blocks; s++) {
        const uint8_t *sp = tile + s * P8 * bytes;
        for (int i = 0; i < nx; i++) {
            /* x's next superblock into L1: with k = 8192 a tile (36 KiB of Q4_K) streams more
             * than L1 holds between two uses of x's lines, and the broadcasts waited on them
             * (2 threads, 2048 x 8192 from memory: Q6_K 25.2 -> 30.8 GB/s, Q4_K 24.5 -> 25.6-27.2;
             * k = 2048 unchanged) */
            const int64_t next = s + 1 < blocks ? s + 1 : s;
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(xq[i] + 256 * next + l), _MM_HINT_T0);
            _mm_prefetch((const char *)(xd[i] + 8 * next), _MM_HINT_T0);
            _mm_prefetch((const char *)(xs[i] + 16 * next), _MM_HINT_T0);
        }
        const kq_state st = p8_kq_state(type, sp);
        const uint8_t *codes = sp + p8_codes_at(type);
        if (type == Q4_K || type == Q5_K) {
            const int qs = type == Q5_K;  /* Q5_K: qs blocks after qh's */
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {  /* qs block p: groups 2p (low nibbles), 2p + 1 (high) */
                p8_sum acc[P8_MAX_X][2];
                for (int i = 0; i < nx; i++) acc[i][0] = acc[i][1] = p8_sum_zero();
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(type, qs + p, c)));
                    __m256i lo = byte_bits(v, 0, 15), hi = byte_bits(v, -4, 15);
                    if (type == Q5_K) {  /* the fifth bits: bit g of qh's byte, as kq_codes */
                        const __m256i h = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(type, 0, c)));
                        lo = _mm256_or_si256(lo, byte_bits(h, 4 - 2 * p, 16));
                        hi = _mm256_or_si256(hi, byte_bits(h, 3 - 2 * p, 16));
                    }
                    for (int i = 0; i < nx; i++) {
                        const int8_t *q = xq[i] + 256 * s + 64 * p + 4 * c;
                        p8_add(&acc[i][0], type, c, 8, lo, q);
                        p8_add(&acc[i][1], type, c, 8, hi, q + 32);
                    }
                }
                const p8_scales f0 = p8_group_scales(type, &st, 2 * p), f1 = p8_group_scales(type, &st, 2 * p + 1);
                for (int i = 0; i < nx; i++) {
                    const __m256i sum0 = p8_total(acc[i][0]), sum1 = p8_total(acc[i][1]);
                    p8_group(type, &f0, 16 * s + 4 * p, 0, sum0, sum0, xd[i][8 * s + 2 * p], xs[i], &t[i],
                             split ? NULL : o[i]);
                    p8_group(type, &f1, 16 * s + 4 * p + 2, 2, sum1, sum1, xd[i][8 * s + 2 * p + 1], xs[i],
                             &t[i], split ? NULL : o[i]);
                }
            }
        } else {
            for (int half = 0; half < 2; half++) {  /* groups 4 half + j: ql blocks 2 half, 2 half + 1; qh block half */
                __m256i lo[P8_MAX_X][4], hi[P8_MAX_X][4];  /* [x row][group]: the first 16 values' sums, the second's */
                if (nx > 2) {  /* two groups a pass (at 1-2 rows 3-6% slower than p6_sums) */
                    p6_pair_sums(codes, half, 0, xq, 256 * s, nx, lo, hi);
                    p6_pair_sums(codes, half, 1, xq, 256 * s, nx, lo, hi);
                } else {
                    p6_sums(codes, half, 0, xq, 256 * s, nx, lo);
                    p6_sums(codes, half, 1, xq, 256 * s, nx, hi);
                }
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const int g = 4 * half + j;
                    const p8_scales f = p8_group_scales(type, &st, g);
                    for (int i = 0; i < nx; i++)
                        p8_group(type, &f, 16 * s + 2 * g, (2 * g) % 4, lo[i][j], hi[i][j], xd[i][8 * s + g], xs[i],
                                 &t[i], split ? NULL : o[i]);
                }
            }
        }
    }
    if (split) p8_offsets(type, tile, blocks, nx, xs, o);
    for (int i = 0; i < nx; i++) p8_store(t[i], o[i], y + (a + i) * n + n0);
}

/* Q4_1's m, or Q4_0's -8 d (d: the block's 8 rows' scales), for the 8 rows of packed block bp. */
INLINE __m256 p8_q4_offset(int type, const uint8_t *bp, __m256 d) {
    return type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + p8_head_at(type, 0, 1))))
                        : _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f), d), _mm256_set1_ps(-0.0f));
}

/* Block g of tile_p8_q4 for its nx rows of x. `odd`: g's parity, a constant in each copy, so
 * the offsets' chains it adds to (p8_group's 2 odd, 2 odd + 1) are fixed registers; with g's
 * parity read at run time they lived on the stack, each block loading and storing them. */
INLINE void p8_q4_block(int type, const uint8_t *tile, int64_t g, int odd, int nx, const int8_t *const *xq,
                        const float *const *xd, const float *const *xs, const int32_t *const *xi, __m256 *t,
                        __m256 (*o)[OFF_CHAINS]) {
    const int bytes = layout_of(type).bytes;
    const uint8_t *bp = tile + g * P8 * bytes, *codes = bp + p8_codes_at(type);
    /* two chains of dpbusd per row of x, added at the block's end (integers: the same sums):
     * with one, each dpbusd waited on the last one's result */
    __m256i acc[P8_MAX_X], acc2[P8_MAX_X];
    for (int i = 0; i < nx; i++) acc[i] = acc2[i] = _mm256_setzero_si256();
    if (type == Q8_0) {
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(type, 0, c)));
#if P8_VNNI
            const __m256i u = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
            for (int i = 0; i < nx; i++) {
                if (c % 2) acc2[i] = p8_dot(acc2[i], u, xq[i] + 32 * g + 4 * c);
                else acc[i] = p8_dot(acc[i], u, xq[i] + 32 * g + 4 * c);
            }
#else
            const __m256i u = _mm256_sign_epi8(v, v);
            for (int i = 0; i < nx; i++) {
                int32_t x4;
                memcpy(&x4, xq[i] + 32 * g + 4 * c, sizeof x4);
                const __m256i prod = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_set1_epi32(x4), v));
                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
            }
#endif
        }
#if P8_VNNI
        for (int i = 0; i < nx; i++) acc[i] = _mm256_sub_epi32(acc[i], _mm256_set1_epi32(128 * xi[i][g]));
#endif
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + p8_head_at(type, 0, 0))));
        for (int i = 0; i < nx; i++) {
            acc[i] = _mm256_add_epi32(acc[i], acc2[i]);
            t[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(d, _mm256_set1_ps(xd[i][g])), t[i]);
        }
        return;
    }
    p8_sum part[P8_MAX_X], part2[P8_MAX_X];  /* the low nibbles' chain and the high ones' */
    for (int i = 0; i < nx; i++) part[i] = part2[i] = p8_sum_zero();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + p8_chunk_at(type, 0, c)));
        const __m256i lo = byte_bits(v, 0, 15), hi = byte_bits(v, -4, 15);
        for (int i = 0; i < nx; i++) {
            const int8_t *q = xq[i] + 32 * g + 4 * c;
            p8_add(&part[i], type, c, 4, lo, q);
            p8_add(&part2[i], type, c, 4, hi, q + 16);
        }
    }
    p8_scales f;
    f.sc0 = f.sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + p8_head_at(type, 0, 0))));
    f.off0 = f.off1 = p8_q4_offset(type, bp, f.sc0);
    for (int i = 0; i < nx; i++) {
        const __m256i sum = _mm256_add_epi32(p8_total(part[i]), p8_total(part2[i]));
        p8_group(type, &f, 2 * g, 2 * odd, sum, sum, xd[i][g], xs[i], &t[i], o ? o[i] : NULL);
    }
}

/* Q4_0 / Q4_1: block g's part of p8_offsets' pass (its halves 2g, 2g + 1 to chains 2 odd,
 * 2 odd + 1; `odd` g's parity, a constant in each copy as in p8_q4_block). */
INLINE void p8_q4_offsets(int type, const uint8_t *tile, int64_t g, int odd, int nx, const float *const *xs,
                          __m256 (*o)[OFF_CHAINS]) {
    const uint8_t *bp = tile + g * P8 * layout_of(type).bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + p8_head_at(type, 0, 0))));
    const __m256 off = p8_q4_offset(type, bp, d);
    for (int i = 0; i < nx; i++) {
        o[i][2 * odd] = _mm256_fmadd_ps(off, _mm256_set1_ps(xs[i][2 * g]), o[i][2 * odd]);
        o[i][2 * odd + 1] = _mm256_fmadd_ps(off, _mm256_set1_ps(xs[i][2 * g + 1]), o[i][2 * odd + 1]);
    }
}

/* Q4_0 / Q4_1 / Q8_0: rows [a, a + nx) of y at columns [n0, n0 + 8) from packed tile `tile` (k / 32
 * blocks). Per block its 8 rows' d (and Q4_1's m) are one load each; Q4's 16 code bytes are 4
 * loads of the 8 rows' 4 bytes (low nibbles values 4c..4c+3, high 16 + 4c.., the file's order),
 * Q8_0's 32 bytes 8 loads, all summed into the block's exact sum. Q8_0's codes are signed:
 * with VNNI they go in as code + 128 (unsigned) and 128 * (x's sum) comes off the block's sum;
 * without, maddubs takes |code| and x with the code's sign (no saturation: 2 * 128 * 127). The
 * float operations are tile_i8_direct's, in its order (t += float(sum) * (d * xd); offsets m
 * or -8d in 4 chains over the halves; Q8_0 none: the chains stay +0). */
INLINE void tile_p8_q4(int type, const uint8_t *tile, int64_t k, int64_t n0, const qx *x, int64_t a, int nx,
                       float *y, int64_t n) {
    const int64_t blocks = k / 32;
    const int split = type != Q8_0 && nx > 2;  /* the offsets in p8_q4_offsets' pass */
    const int8_t *xq[P8_MAX_X];
    const float *xd[P8_MAX_X], *xs[P8_MAX_X];
    const int32_t *xi[P8_MAX_X];  /* Q8_0 with VNNI: x's sums per block */
    __m256 t[P8_MAX_X], o[P8_MAX_X][OFF_CHAINS];
    for (int i = 0; i < nx; i++) {
        xq[i] = x->q + (a + i) * k, xd[i] = x->d + (a + i) * k / 32, xs[i] = x->sums + (a + i) * k / 16;
        xi[i] = x->isum ? x->isum + (a + i) * k / 32 : NULL;
        t[i] = _mm256_setzero_ps();
        for (int j = 0; j < OFF_CHAINS; j++) o[i][j] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < blocks; g += 2) {
        if (g % 8 == 0)  /* x's next 256 values into L1, as tile_p8 */
            for (int i = 0; i < nx; i++) {
                const int64_t next = g + 8 < blocks ? g + 8 : g;
                for (int l = 0; l < 256 && 32 * next + l < k; l += 64) _mm_prefetch((const char *)(xq[i] + 32 * next + l), _MM_HINT_T0);
                _mm_prefetch((const char *)(xd[i] + next), _MM_HINT_T0);
                _mm_prefetch((const char *)(xs[i] + 2 * next), _MM_HINT_T0);
            }
        p8_q4_block(type, tile, g, 0, nx, xq, xd, xs, xi, t, split ? NULL : o);
        if (g + 1 < blocks) p8_q4_block(type, tile, g + 1, 1, nx, xq, xd, xs, xi, t, split ? NULL : o);
    }
    if (split)
        for (int64_t g = 0; g < blocks; g += 2) {
            p8_q4_offsets(type, tile, g, 0, nx, xs, o);
            if (g + 1 < blocks) p8_q4_offsets(type, tile, g + 1, 1, nx, xs, o);
        }
    for (int i = 0; i < nx; i++) p8_store(t[i], o[i], y + (a + i) * n + n0);
}

/* Every row of x over packed tile t: P8_MAX_X rows at a time, each tile's codes
 * read from memory once and from L1 after. */
INLINE void tile_p8_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t t, const qx *x,
                         int64_t m, float *y, int64_t n) {
    const uint8_t *tile = w + t * P8 * row_bytes;
    for (int64_t a = 0; a < m; a += P8_MAX_X) {
        const int nx = m - a < P8_MAX_X ? (int)(m - a) : P8_MAX_X;
#define P8_TILE(T, NX) (T == Q4_0 || T == Q4_1 || T == Q8_0 ? tile_p8_q4(T, tile, k, t * P8, x, a, NX, y, n) \
                              : tile_p8(T, tile, k, t * P8, x, a, NX, y, n))
        switch (nx) {
            case 1: P8_TILE(type, 1); break;
            case 2: P8_TILE(type, 2); break;
            case 3: P8_TILE(type, 3); break;
            default: P8_TILE(type, 4); break;
        }
#undef P8_TILE
    }
}
#endif
#endif
