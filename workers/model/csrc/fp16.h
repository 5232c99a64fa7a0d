/* IEEE half <-> float for the CPU kernels' float16 KV cache (layer_ops.c stores, paged_attention.c
 * loads; --kv-cache-dtype float16). Widening is exact; narrowing rounds to nearest, ties to even,
 * overflow to infinity: the bits torch's tensor.to(torch.float16) gives. With F16C (every AVX2
 * CPU) one instruction each; the plain C forms give the same bits elsewhere.
 * A half keeps 11 significant bits where bfloat16 keeps 8, over a smaller range (up to 65504,
 * normal from 2^-14): K and V values lie well inside it, so it is the more exact 16-bit cache. */
#ifndef JUSTAPI_FP16_H
#define JUSTAPI_FP16_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float float_of_f16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 0x3ffu;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact */
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | man << 13 : sign | (exp + 112) << 23 | man << 13;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t f16_of_float(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;  /* NaN: a quiet NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00u;  /* from 65520 (half-way past 65504, ties to even): inf */
    if (u >= 0x38800000u) {  /* a normal half: the exponent rebased, the mantissa rounded (a carry is exact) */
        u += 0xc8000000u + 0xfffu + ((u >> 13) & 1u);  /* (15 - 127) << 23, mod 2^32 */
        return sign | (uint16_t)(u >> 13);
    }
    float magnitude;  /* below 2^-14: a subnormal half, f * 2^24 rounded to an integer (exact scaling) */
    memcpy(&magnitude, &u, sizeof magnitude);
    return sign | (uint16_t)nearbyintf(magnitude * 16777216.0f);
#endif
}
#endif
