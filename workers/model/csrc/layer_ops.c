/* The small per-layer operations of the CPU forward, each one call instead of 4-10 torch ops:
 * RMS norm, rotary embedding, the gated activation and the KV store (fp32, bf16 or f16 pools). At batch 1 SmolLM2's
 * step ran ~270 elementwise torch ops whose dispatch (5-70 us each on a 2-vCPU VM) cost as
 * much as the matmuls. Each row is computed alone in a fixed order, so a row's bits do not
 * depend on its batch. Rows are split over threads only where a call has enough work to pay
 * for waking them.
 * Compiled on first use by workers/model/cpu_kernels.py. Owns: that arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"
#include "fp16.h"

#define PARALLEL_VALUES 65536  /* fewer values than this: one thread */

/* yr = xr * 1 / sqrt(mean(xr^2) + eps) * w, n values. */
static void rms_norm_row(const float *xr, const float *w, float *yr, int64_t n, float eps) {
    float lanes[8] = {0};  /* eight partial sums, then a fixed pairing */
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lanes[l] += xr[j + l] * xr[j + l];
    for (; j < n; j++) lanes[0] += xr[j] * xr[j];
    const float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (j = 0; j < n; j++) yr[j] = xr[j] * inv * w[j];
}

/* out[r] = x[r] * 1 / sqrt(mean(x[r]^2) + eps) * w, rows of n values (x rows ldx apart). */
void rms_norm_rows(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t n,
                   float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * ldx, w, out + r * n, n, eps);
}

/* The residual add and the norm after it: sum[r] = x[r] + d[r] (rows ldx / ldd apart; sum and
 * out contiguous), out[r] = rms_norm(sum[r]) * w, the same bits as the add then rms_norm_rows. */
void add_rms_norm_rows(const float *x, int64_t ldx, const float *d, int64_t ldd, const float *w,
                       float *sum, float *out, int64_t rows, int64_t n, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx, *dr = d + r * ldd;
        float *sr = sum + r * n;
        for (int64_t j = 0; j < n; j++) sr[j] = xr[j] + dr[j];
        rms_norm_row(sr, w, out + r * n, n, eps);
    }
}

/* out [T, heads, dim] = x (token rows ldx apart, heads dim apart) with its first 2 * half dims
 * of each head rotated by the token's angles: (a, b) = (x[i], x[i + half]) ->
 * (a cos - b sin, b cos + a sin); dims past 2 * half copied. cos, sin: [T, half]. */
void rotary_rows(const float *x, int64_t ldx, const float *cos_t, const float *sin_t, float *out,
                 int64_t tokens, int64_t heads, int64_t dim, int64_t half, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PARALLEL_VALUES)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * ldx + h * dim;
            float *yh = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = xh[i], b = xh[i + half];
                yh[i] = a * c[i] - b * s[i];
                yh[i + half] = b * c[i] + a * s[i];
            }
            for (int64_t i = 2 * half; i < dim; i++) yh[i] = xh[i];
        }
    }
}

enum { SILU = 0, GELU_TANH = 1 };

/* The activations from e^-|v| (exp_nonpositive: plain arithmetic, so the loops vectorize; with
 * libm's expf a 256-row call took 3x torch's vectorized silu). */
static inline float silu(float v) {
    const float e = exp_nonpositive(-fabsf(v));  /* sigmoid(v) = 1 / (1 + e^-v) */
    const float s = 1.0f / (1.0f + e), es = e * s;  /* both computed: the select vectorizes */
    return v * (v >= 0.0f ? s : es);
}

static inline float gelu_tanh(float v) {
    const float y = 0.7978845608028654f * (v + 0.044715f * v * v * v);  /* sqrt(2 / pi) (...) */
    const float e = exp_nonpositive(-2.0f * fabsf(y));  /* tanh |y| = (1 - e) / (1 + e) */
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * v * (1.0f + copysignf(t, y));
}

/* out [rows, f] = act(g) * u where each row of x is [g (f values) | u (f values)]. */
void act_mul_rows(const float *x, float *out, int64_t rows, int64_t f, int act, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * f >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * f, *u = g + f;
        float *y = out + r * f;
        if (act == SILU) {
            #pragma omp simd
            for (int64_t j = 0; j < f; j++) y[j] = silu(g[j]) * u[j];
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < f; j++) y[j] = gelu_tanh(g[j]) * u[j];
        }
    }
}

/* The step's new K and V into their pool slots: kv [2, num_slots, slot_values] (K half, then
 * V half); k, v rows of slot_values values, ldk / ldv apart. Returns 0, or -1 (nothing
 * written) where a slot is outside the pool. */
static int slots_in_pool(const int64_t *slots, int64_t rows, int64_t num_slots) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 0;
    return 1;
}

int store_kv_rows(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                  int64_t rows, int64_t slot_values, int64_t num_slots, float *kv) {
    if (!slots_in_pool(slots, rows, num_slots)) return -1;
    float *values = kv + num_slots * slot_values;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(kv + slots[r] * slot_values, k + r * ldk, sizeof(float) * slot_values);
        memcpy(values + slots[r] * slot_values, v + r * ldv, sizeof(float) * slot_values);
    }
    return 0;
}

/* store_kv_rows into a bfloat16 pool (--kv-cache-dtype bfloat16): each value rounded to
 * nearest, ties to even, as torch's .to(torch.bfloat16). */
int store_kv_rows_bf16(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                       int64_t rows, int64_t slot_values, int64_t num_slots, uint16_t *kv) {
    if (!slots_in_pool(slots, rows, num_slots)) return -1;
    uint16_t *values = kv + num_slots * slot_values;
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *restrict kd = kv + slots[r] * slot_values, *restrict vd = values + slots[r] * slot_values;
        const float *restrict ks = k + r * ldk, *restrict vs = v + r * ldv;
        for (int64_t j = 0; j < slot_values; j++) kd[j] = bf16_of_float(ks[j]);
        for (int64_t j = 0; j < slot_values; j++) vd[j] = bf16_of_float(vs[j]);
    }
    return 0;
}

/* n values rounded to float16 (as torch's .to(torch.float16)): 8 at a time with F16C. */
static void f16_row(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t j = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) dst[j] = f16_of_float(src[j]);
}

/* store_kv_rows into a float16 pool (--kv-cache-dtype float16): each value rounded to nearest,
 * ties to even (beyond 65504: infinity), as torch's .to(torch.float16). */
int store_kv_rows_f16(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                      int64_t rows, int64_t slot_values, int64_t num_slots, uint16_t *kv) {
    if (!slots_in_pool(slots, rows, num_slots)) return -1;
    uint16_t *values = kv + num_slots * slot_values;
    for (int64_t r = 0; r < rows; r++) {
        f16_row(k + r * ldk, kv + slots[r] * slot_values, slot_values);
        f16_row(v + r * ldv, values + slots[r] * slot_values, slot_values);
    }
    return 0;
}
