/* GGUF block layouts for the CPU weight kernels (quant_matmul.c): every block decodes to 8-bit
 * codes c, a scale sc and a minimum mn per 16 values, and an integer zero z per type, with
 *     value = sc * (c - z) + mn.
 * One of z and mn is 0 for every type, and sc * (c - z) is the very product gguf's dequantizer
 * rounds (or an exact one), so the fp32 values equal gguf's bit for bit with or without FMA.
 * Codes are unsigned (at most 63) except Q8_0's, its signed bytes, and IQ4_NL's and IQ4_XS's,
 * the signed values of their 16-entry table (a nibble picks one: the scale times the table's
 * value is gguf's one product). Owns: the byte layouts of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K..Q6_K, IQ4_NL and IQ4_XS. Does not own: any arithmetic past the values.
 */
#ifndef JUSTAPI_GGUF_BLOCKS_H
#define JUSTAPI_GGUF_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__SSSE3__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
       Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };  /* ggml's type ids */

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t u8x32 __attribute__((vector_size(32), aligned(1)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(1)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(1)));

typedef struct { int elems, bytes, zero; } layout;

static inline __attribute__((always_inline)) layout layout_of(int type) {  /* values and bytes per block, z */
    switch (type) {
        case Q4_0: return (layout){32, 18, 8};
        case Q4_1: return (layout){32, 20, 0};
        case Q5_0: return (layout){32, 22, 16};
        case Q5_1: return (layout){32, 24, 0};
        case Q8_0: return (layout){32, 34, 0};
        case Q2_K: return (layout){256, 84, 0};
        case Q3_K: return (layout){256, 110, 4};
        case Q4_K: return (layout){256, 144, 0};
        case Q5_K: return (layout){256, 176, 0};
        case Q6_K: return (layout){256, 210, 32};
        case IQ4_NL: return (layout){32, 18, 0};
        case IQ4_XS: return (layout){256, 136, 0};
        default: return (layout){0, 0, 0};
    }
}

static int codes_signed(int type) { return type == Q8_0 || type == IQ4_NL || type == IQ4_XS; }

/* Whether values have a minimum or zero point (mn - z * sc, the int8 path's offsets) at all. */
static int has_offsets(int type) { return !codes_signed(type); }

static int scales_per_16(int type) { return type == Q6_K || type == Q3_K || type == Q2_K; }

static float half(const uint8_t *p) {  /* IEEE half -> float, exact */
#if defined(__F16C__)
    uint16_t raw;
    memcpy(&raw, p, sizeof raw);
    return _cvtsh_ss(raw);
#else
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
    if (exp == 0) {
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | man << 13 : sign | (exp + 112) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static void fill2(float *p, float a) { p[0] = p[1] = a; }

static u8x32 load32(const uint8_t *p) { return *(const u8x32 *)p; }

static void store32(uint8_t *p, u8x32 v) { *(u8x32 *)p = v; }

/* Byte shifts done on 16-bit lanes (x86 has none for bytes): bits cross into the neighbouring
 * byte, so every caller masks the result to bits that stay inside their own byte. */
static u8x32 shr(u8x32 v, int bits) { return (u8x32)((u16x16)v >> bits); }

static u8x32 shl(u8x32 v, int bits) { return (u8x32)((u16x16)v << bits); }

static u8x16 shr16(u8x16 v, int bits) { return (u8x16)((u16x8)v >> bits); }

/* Q4_0: d | qs[16];  Q4_1: d | m | qs[16]. Byte j: value j (low nibble), j + 16 (high). */
static void codes_q4(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off, int has_min) {
    const u8x16 qs = *(const u8x16 *)(b + (has_min ? 4 : 2));
    *(u8x16 *)c = qs & 15;
    *(u8x16 *)(c + 16) = shr16(qs, 4) & 15;
    const float d = half(b), m = has_min ? half(b + 2) : 0.0f;
    fill2(sc, d);
    fill2(mn, m);
    if (off) fill2(off, has_min ? m : -(8.0f * d));
}

/* Q5_0: d | qh u32 | qs[16];  Q5_1: d | m | qh | qs. Value j's fifth bit is bit j of qh. */
static void codes_q5(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off, int has_min) {
    const uint8_t *qh = b + (has_min ? 4 : 2);
    const u8x16 qs = *(const u8x16 *)(qh + 4);
    const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const u8x16 lo = {qh[0], qh[0], qh[0], qh[0], qh[0], qh[0], qh[0], qh[0],
                      qh[1], qh[1], qh[1], qh[1], qh[1], qh[1], qh[1], qh[1]};
    const u8x16 hi = {qh[2], qh[2], qh[2], qh[2], qh[2], qh[2], qh[2], qh[2],
                      qh[3], qh[3], qh[3], qh[3], qh[3], qh[3], qh[3], qh[3]};
    *(u8x16 *)c = (qs & 15) | ((u8x16)((lo & bit) != 0) & 16);
    *(u8x16 *)(c + 16) = (shr16(qs, 4) & 15) | ((u8x16)((hi & bit) != 0) & 16);
    const float d = half(b), m = has_min ? half(b + 2) : 0.0f;
    fill2(sc, d);
    fill2(mn, m);
    if (off) fill2(off, has_min ? m : -(16.0f * d));
}

/* IQ4_NL and IQ4_XS's values, indexed by a nibble (ggml's kvalues_iq4nl). */
static const int8_t IQ4_VALUES[16] __attribute__((aligned(16))) = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                                   1, 13, 25, 38, 53, 69, 89, 113};

/* 16 bytes of nibbles -> 32 table values: byte j gives value j (low nibble) and j + 16 (high). */
static void iq4_values32(const uint8_t *qs, uint8_t *c) {
#if defined(__SSSE3__)
    const __m128i table = _mm_load_si128((const __m128i *)IQ4_VALUES), q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i low = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)c, _mm_shuffle_epi8(table, _mm_and_si128(q, low)));
    _mm_storeu_si128((__m128i *)(c + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low)));
#else
    for (int j = 0; j < 16; j++) {
        c[j] = (uint8_t)IQ4_VALUES[qs[j] & 15];
        c[j + 16] = (uint8_t)IQ4_VALUES[qs[j] >> 4];
    }
#endif
}

/* IQ4_NL: d | qs[16] (Q4_0's layout), value = d * table[nibble]. */
static void codes_iq4_nl(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {
    iq4_values32(b + 2, c);
    fill2(sc, half(b));
    fill2(mn, 0.0f);
    if (off) fill2(off, 0.0f);
}

/* IQ4_XS: d | scales_h u16 | scales_l[4] | qs[128]. Sub-block j (values 32j..32j+31): qs[16j..]
 * as IQ4_NL's, 6-bit scale ls = nibble j % 2 of scales_l[j / 2] | bits 2j..2j+1 of scales_h
 * above it, value = (d * (ls - 32)) * table[nibble] (d * (ls - 32) is exact in fp32). */
static void codes_iq4_xs(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {
    const float d = half(b);
    const int high = b[2] | b[3] << 8;
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[4 + j / 2] >> 4 * (j % 2)) & 15) | ((high >> 2 * j) & 3) << 4;
        fill2(sc + 2 * j, d * (float)(ls - 32));
        fill2(mn + 2 * j, 0.0f);
        if (off) fill2(off + 2 * j, 0.0f);
        iq4_values32(b + 8 + 16 * j, c + 32 * j);
    }
}

static void codes_q8_0(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {  /* d | int8[32] */
    memcpy(c, b + 2, 32);
    fill2(sc, half(b));
    fill2(mn, 0.0f);
    if (off) fill2(off, 0.0f);
}

static void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Q4_K: d | dmin | scales[12] | qs[128];  Q5_K: d | dmin | scales[12] | qh[32] | qs[128].
 * Sub-block j (values 32j..32j+31): nibble j % 2 of qs[32 (j / 2) + l], fifth bit j of qh[l]. */
static void codes_qk(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off, int has_high) {
    const float d = half(b), dmin = half(b + 2);
    const u8x32 qh = load32(b + 16);
    const uint8_t *qs = b + (has_high ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(j, b + 4, &s, &m);
        fill2(sc + 2 * j, d * (float)s);
        fill2(mn + 2 * j, -(dmin * (float)m));
        if (off) fill2(off + 2 * j, -(dmin * (float)m));
        u8x32 q = shr(load32(qs + 32 * (j / 2)), 4 * (j % 2)) & 15;
        if (has_high) q |= shl(shr(qh, j) & 1, 4);
        store32(c + 32 * j, q);
    }
}

/* Q6_K: ql[128] | qh[64] | int8 scales[16] | d. Value 128n + 32k + l: nibble k / 2 of
 * ql[64n + 32 (k % 2) + l], bits 2k..2k+1 of qh[32n + l]. */
static void codes_q6_k(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {
    const float d = half(b + 208);
    for (int i = 0; i < 16; i++) {
        const float s = d * (float)(int8_t)b[192 + i];
        sc[i] = s;
        mn[i] = 0.0f;
        if (off) off[i] = -(32.0f * s);
    }
    for (int g = 0; g < 8; g++) {
        const int n = g / 4, k = g % 4;
        const u8x32 lo = shr(load32(b + 64 * n + 32 * (k % 2)), 4 * (k / 2)) & 15;
        store32(c + 32 * g, lo | shl(shr(load32(b + 128 + 32 * n), 2 * k) & 3, 4));
    }
}

/* Q3_K: hmask[32] | qs[64] | scales[12] | d. Value 128n + 32j + l: bits 2j..2j+1 of
 * qs[32n + l] and bit 4n + j of hmask[l]; code = low2 | hbit << 2, value = dl * (code - 4). */
static void codes_q3_k(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {
    const float d = half(b + 108);
    const uint8_t *s = b + 96;
    for (int i = 0; i < 16; i++) {
        const int s6 = ((s[i % 8] >> 4 * (i / 8)) & 15) | ((s[8 + i % 4] >> 2 * (i / 4)) & 3) << 4;
        sc[i] = d * (float)(s6 - 32);
        mn[i] = 0.0f;
        if (off) off[i] = -(4.0f * sc[i]);
    }
    const u8x32 hm = load32(b);
    for (int g = 0; g < 8; g++) {
        const int n = g / 4, j = g % 4;
        store32(c + 32 * g, (shr(load32(b + 32 + 32 * n), 2 * j) & 3) | shl(shr(hm, g) & 1, 2));
    }
}

/* Q2_K: scales[16] (low nibble scale, high min) | qs[64] | d | dmin. Value 128n + 32j + l:
 * bits 2j..2j+1 of qs[32n + l]. */
static void codes_q2_k(const uint8_t *b, uint8_t *c, float *sc, float *mn, float *off) {
    const float d = half(b + 80), dmin = half(b + 82);
    for (int i = 0; i < 16; i++) {
        sc[i] = d * (float)(b[i] & 15);
        mn[i] = -(dmin * (float)(b[i] >> 4));
        if (off) off[i] = mn[i];
    }
    for (int g = 0; g < 8; g++)
        store32(c + 32 * g, shr(load32(b + 16 + 32 * (g / 4)), 2 * (g % 4)) & 3);
}

/* Codes, scales and minimums of values [k0, k0 + chunk) of one row (k0, chunk: whole blocks),
 * and, if off is not NULL, the offsets mn - z * sc (the int8 path's form: value = sc * c + off),
 * written as each block is read: computing them after from sc and mn reloaded pairs of floats
 * as vectors, a store-forwarding stall that took 40% of a one-row int8 matmul. */
static inline __attribute__((always_inline)) void codes_chunk(int type, const uint8_t *row, int64_t k0, int chunk,
                                                              uint8_t *c, float *sc, float *mn, float *off) {
    const layout lay = layout_of(type);
    const uint8_t *b = row + k0 / lay.elems * lay.bytes;
    const int step = lay.elems / 16;
    for (int e = 0; e < chunk; e += lay.elems, b += lay.bytes, c += lay.elems, sc += step, mn += step,
         off = off ? off + step : off) {
        switch (type) {
            case Q4_0: codes_q4(b, c, sc, mn, off, 0); break;
            case Q4_1: codes_q4(b, c, sc, mn, off, 1); break;
            case Q5_0: codes_q5(b, c, sc, mn, off, 0); break;
            case Q5_1: codes_q5(b, c, sc, mn, off, 1); break;
            case Q8_0: codes_q8_0(b, c, sc, mn, off); break;
            case Q2_K: codes_q2_k(b, c, sc, mn, off); break;
            case Q3_K: codes_q3_k(b, c, sc, mn, off); break;
            case Q4_K: codes_qk(b, c, sc, mn, off, 0); break;
            case Q5_K: codes_qk(b, c, sc, mn, off, 1); break;
            case Q6_K: codes_q6_k(b, c, sc, mn, off); break;
            case IQ4_NL: codes_iq4_nl(b, c, sc, mn, off); break;
            case IQ4_XS: codes_iq4_xs(b, c, sc, mn, off); break;
        }
    }
}

/* fp32 values [k0, k0 + chunk) of one row: sc * (c - z) + mn. */
static inline __attribute__((always_inline)) void decode_chunk(int type, const uint8_t *row, int64_t k0, int chunk, float *out) {
    uint8_t c[256] __attribute__((aligned(32)));
    float sc[16], mn[16];
    const int zero = layout_of(type).zero, is_signed = codes_signed(type);
    codes_chunk(type, row, k0, chunk, c, sc, mn, NULL);
    for (int h = 0; h < chunk / 16; h++)
        for (int j = 16 * h; j < 16 * h + 16; j++)
            out[j] = sc[h] * (float)((is_signed ? (int)(int8_t)c[j] : (int)c[j]) - zero) + mn[h];
}
#endif
