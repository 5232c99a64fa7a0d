/* e^x for x <= 0, shared by the CPU kernels (paged_attention.c, layer_ops.c). */
#ifndef JUSTAPI_EXP_NONPOSITIVE_H
#define JUSTAPI_EXP_NONPOSITIVE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0: Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6
 * polynomial for e^r (Cephes' expf coefficients), about 1 ulp. Plain arithmetic, so the
 * compiler vectorizes it and every lane gives the bits the scalar code would. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* e^-87 ~ 1.6e-38: still a normal float */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln2 = 0.693359375 - 2.12e-4 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n, n in [-126, 0] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}
#endif
