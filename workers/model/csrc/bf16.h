/* bfloat16 <-> float for the CPU kernels' 16-bit KV cache (layer_ops.c stores, paged_attention.c
 * loads). A bf16 value is a float's top 16 bits, so widening is a shift (exact) and narrowing
 * rounds to nearest, ties to even: the bits torch's tensor.to(torch.bfloat16) gives. */
#ifndef JUSTAPI_BF16_H
#define JUSTAPI_BF16_H
#include <stdint.h>
#include <string.h>

static inline float float_of_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_of_float(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN: torch's quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
