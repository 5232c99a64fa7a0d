/* One-row matmuls from GGUF blocks: justapi's block kernel against llama.cpp's ggml, in turns,
 * in one process (built and run by tools/bench/gemv.py; never part of the product).
 *
 * usage: ggml_gemv OURS.so TYPE N K THREADS ROUNDS COPIES REPACK [ROWS [PANELS]]
 * Both sides read the same quantized bytes (made by ggml_quantize_chunk): COPIES copies of an
 * N x K matrix of ggml type TYPE, together larger than the last-level cache, so every call
 * streams its weights from memory as a decode step does. Each round times one pass over the
 * copies per side (with THREADS 1, in this thread's CPU time; ours: quant_matmul_i8 with one row of x; ggml: mul_mat in the plain CPU
 * buffer, and, with REPACK 1, in the repacking buffer llama-server puts Q4_0/Q4_K/IQ4_NL weights
 * in on AVX2 CPUs: the caller says where that applies, since the buffer aborts on a type it has
 * no layout for), the sides' order rotating each round. Prints one line per side:
 * "name best_GBps median_GBps", then the largest relative difference between the outputs.
 * ROWS (default 1): rows of x per call on every side; PANELS 1: ours through
 * quant_matmul_i8_panels (the path of steps of many rows) instead of quant_matmul_i8. Where our library packs the type
 * (quant_pack8: Q4_K, Q6_K), a side "justapi_packed" times our kernel on packed copies too.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

typedef int (*ours_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int);
typedef int (*pack_fn)(int, uint8_t *, int64_t, int64_t, int);
#define PACK8 0x100

enum { MAX_SIDES = 3, MAX_COPIES = 256 };
static int64_t x_rows = 1;

typedef struct {
    const char *name;
    struct ggml_context *ctx_w, *ctx_x;
    struct ggml_tensor *x, *out[MAX_COPIES];
    struct ggml_cgraph *graph[MAX_COPIES];
} ggml_side;

static clockid_t clock_id = CLOCK_MONOTONIC;

static double now_s(void) {
    struct timespec t;
    clock_gettime(clock_id, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One ggml variant: the weights in `buft`, x and the outputs in the CPU buffer. */
static int side_init(ggml_side *s, const char *name, ggml_backend_t backend, ggml_backend_buffer_type_t buft,
                     enum ggml_type type, int64_t n, int64_t k, int copies, uint8_t **raw, const float *x) {
    s->name = name;
    struct ggml_init_params pw = {ggml_tensor_overhead() * (size_t)(copies + 1), NULL, true};
    s->ctx_w = ggml_init(pw);
    struct ggml_tensor *w[MAX_COPIES];
    for (int i = 0; i < copies; i++) w[i] = ggml_new_tensor_2d(s->ctx_w, type, k, n);
    if (!ggml_backend_alloc_ctx_tensors_from_buft(s->ctx_w, buft)) return -1;
    for (int i = 0; i < copies; i++) ggml_backend_tensor_set(w[i], raw[i], 0, ggml_nbytes(w[i]));
    struct ggml_init_params px = {(ggml_tensor_overhead() + ggml_graph_overhead()) * (size_t)(2 * copies + 4), NULL, true};
    s->ctx_x = ggml_init(px);
    s->x = ggml_new_tensor_2d(s->ctx_x, GGML_TYPE_F32, k, x_rows);
    for (int i = 0; i < copies; i++) {
        s->out[i] = ggml_mul_mat(s->ctx_x, w[i], s->x);
        s->graph[i] = ggml_new_graph(s->ctx_x);
        ggml_build_forward_expand(s->graph[i], s->out[i]);
    }
    if (!ggml_backend_alloc_ctx_tensors(s->ctx_x, backend)) return -1;
    ggml_backend_tensor_set(s->x, x, 0, (size_t)(k * x_rows) * sizeof(float));
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 9 || argc > 11) {
        fprintf(stderr, "usage: %s OURS.so TYPE N K THREADS ROUNDS COPIES REPACK [ROWS [PANELS]]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    const char *symbol = argc == 11 && atoi(argv[10]) ? "quant_matmul_i8_panels" : "quant_matmul_i8";
    ours_fn ours = lib ? (ours_fn)dlsym(lib, symbol) : NULL;
    if (!ours) {
        fprintf(stderr, "cannot load %s from %s: %s\n", symbol, argv[1], dlerror());
        return 1;
    }
    const enum ggml_type type = (enum ggml_type)atoi(argv[2]);
    const int64_t n = atoll(argv[3]), k = atoll(argv[4]);
    const int threads = atoi(argv[5]), rounds = atoi(argv[6]), copies = atoi(argv[7]), repack = atoi(argv[8]);
    if (argc >= 10) x_rows = atoll(argv[9]);
    if (copies < 1 || copies > MAX_COPIES || rounds < 1 || x_rows < 1) return 2;
    /* one thread: both sides run on this thread, so its CPU time leaves out the time other
     * processes held the core (a shared host), though not their effect on caches and memory */
    if (threads == 1) clock_id = CLOCK_THREAD_CPUTIME_ID;

    srand(1);
    float *src = malloc((size_t)(n * k) * sizeof(float)), *x = malloc((size_t)(k * x_rows) * sizeof(float));
    for (int64_t i = 0; i < n * k; i++) src[i] = ((float)rand() / RAND_MAX - 0.5f) * (1.0f + (float)(i % 7));
    for (int64_t i = 0; i < k * x_rows; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    const size_t bytes = ggml_row_size(type, k) * (size_t)n;
    uint8_t *raw[MAX_COPIES];
    raw[0] = malloc(bytes);
    ggml_quantize_chunk(type, src, raw[0], 0, n, k, NULL);
    for (int i = 1; i < copies; i++) raw[i] = memcpy(malloc(bytes), raw[0], bytes);
    pack_fn pack = (pack_fn)dlsym(lib, "quant_pack8");
    uint8_t *packed[MAX_COPIES];
    int has_packed = pack != NULL;
    for (int i = 0; i < copies && has_packed; i++) {
        packed[i] = memcpy(malloc(bytes), raw[0], bytes);
        if (pack((int)type, packed[i], n, k, threads) != 0) has_packed = 0;  /* a type or shape it does not pack */
    }

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_side sides[MAX_SIDES];
    int num_sides = 0;
    if (side_init(&sides[num_sides], "ggml", backend, ggml_backend_cpu_buffer_type(), type, n, k, copies, raw, x) == 0)
        num_sides++;
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t extra =
        (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t *bufts = extra ? extra(ggml_backend_reg_dev_get(reg, 0)) : NULL;
    for (; repack && bufts && *bufts; bufts++) {
        if (strstr(ggml_backend_buft_name(*bufts), "REPACK") == NULL) continue;
        if (side_init(&sides[num_sides], "ggml_repack", backend, *bufts, type, n, k, copies, raw, x) == 0) num_sides++;
    }

    float *y = malloc((size_t)(n * x_rows) * sizeof(float)), *yp = malloc((size_t)(n * x_rows) * sizeof(float));
    double *times = calloc((size_t)(rounds * (MAX_SIDES + 2)), sizeof(double));
    const int ours_sides = 1 + has_packed, total = num_sides + ours_sides;
    for (int r = 0; r < rounds + 1; r++) {  /* round 0: untimed */
        for (int j = 0; j < total; j++) {
            const int side = (j + r) % total;  /* 0: ours, (1: ours packed), then the ggml sides */
            const double t0 = now_s();
            for (int i = 0; i < copies; i++) {
                if (side == 0) ours((int)type, raw[i], n, k, x, x_rows, y, threads);
                else if (side < ours_sides) ours((int)type | PACK8, packed[i], n, k, x, x_rows, y, threads);
                else ggml_backend_graph_compute(backend, sides[side - ours_sides].graph[i]);
            }
            if (r > 0) times[side * rounds + r - 1] = (now_s() - t0) / copies;
        }
    }
    for (int side = 0; side < total; side++) {
        double *t = times + side * rounds;
        qsort(t, (size_t)rounds, sizeof(double), cmp_double);
        printf("%s %.3f %.3f\n", side == 0 ? "justapi" : side < ours_sides ? "justapi_packed" : sides[side - ours_sides].name,
               bytes / t[0] / 1e9, bytes / t[rounds / 2] / 1e9);
    }
    ours((int)type, raw[0], n, k, x, x_rows, y, threads);
    if (has_packed) {  /* the packed kernel's bits must be the plain one's */
        ours((int)type | PACK8, packed[0], n, k, x, x_rows, yp, threads);
        printf("same_bits %d\n", memcmp(y, yp, (size_t)(n * x_rows) * sizeof(float)) == 0);
    }
    for (int side = 0; side < num_sides; side++) {
        float *g = malloc((size_t)(n * x_rows) * sizeof(float));
        ggml_backend_tensor_get(sides[side].out[0], g, 0, (size_t)(n * x_rows) * sizeof(float));
        double worst = 0, scale = 0;
        for (int64_t i = 0; i < n * x_rows; i++) scale = fmax(scale, fabs(g[i]));
        for (int64_t i = 0; i < n * x_rows; i++) worst = fmax(worst, fabs(g[i] - y[i]) / scale);
        printf("diff %s %.3g\n", sides[side].name, worst);
        free(g);
    }
    return 0;
}
