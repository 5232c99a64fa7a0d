/* tools/bench/isa_peak.py's probe: each instruction the int8 and float kernels lean on, in a loop
 * of 10 independent chains (more than latency x ports on the CPUs we run), timed in this
 * thread's CPU time. Prints "name instructions_per_second multiply_adds_per_instruction" for
 * each probe this CPU supports; the rest are left out. Built with -O2 and per-function targets,
 * so it runs on any x86-64. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 10
#define PROBE(NAME, TARGET, VEC, ZERO, ASM, MACS)                                         \
    __attribute__((target(TARGET))) static void NAME(long n) {                          \
        VEC a[CHAINS], c = ZERO;                                                         \
        for (int i = 0; i < CHAINS; i++) a[i] = ZERO;                                    \
        const double t = cpu_s();                                                        \
        for (long r = 0; r < n / CHAINS; r++)                                            \
            _Pragma("GCC unroll 10") for (int i = 0; i < CHAINS; i++)                    \
                __asm__ volatile(ASM : "+v"(a[i]) : "v"(c), "v"(c));                     \
        const double s = cpu_s() - t;                                                    \
        volatile VEC sink = a[0];                                                        \
        (void)sink;                                                                      \
        printf("%s %.4g %d\n", #NAME, (double)(n / CHAINS * CHAINS) / s, MACS);          \
    }

PROBE(maddubs_ymm, "avx2", __m256i, _mm256_setzero_si256(), "vpmaddubsw %1, %2, %0", 32)
PROBE(dpbusd_ymm, "avx512vnni,avx512vl", __m256i, _mm256_setzero_si256(), "vpdpbusd %1, %2, %0", 32)
PROBE(dpbusd_zmm, "avx512vnni,avx512f", __m512i, _mm512_setzero_si512(), "vpdpbusd %1, %2, %0", 64)
PROBE(fma_ymm, "avx2,fma", __m256, _mm256_setzero_ps(), "vfmadd231ps %1, %2, %0", 8)
PROBE(fma_zmm, "avx512f", __m512, _mm512_setzero_ps(), "vfmadd231ps %1, %2, %0", 16)

/* One chain of dependent register-to-register 64-bit adds (1 cycle each; an add of an immediate
 * can be folded at rename on newer Intel cores, so not that): its rate is the core's clock
 * while the probes run, to read the others per cycle. */
static void clock_chain(long n) {
    uint64_t a = 0, one = 1;
    const double t = cpu_s();
    for (long r = 0; r < n / CHAINS; r++)
        _Pragma("GCC unroll 10") for (int i = 0; i < CHAINS; i++) __asm__ volatile("add %1, %0" : "+r"(a) : "r"(one));
    const double s = cpu_s() - t;
    volatile uint64_t sink = a;
    (void)sink;
    printf("clock %.4g 0\n", (double)(n / CHAINS * CHAINS) / s);
}

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 100000000L;
    __builtin_cpu_init();
    clock_chain(n);
    const int avx512 = __builtin_cpu_supports("avx512f"), vl = __builtin_cpu_supports("avx512vl");
    const int vnni = __builtin_cpu_supports("avx512vnni");
    if (__builtin_cpu_supports("avx2")) maddubs_ymm(n);
    if (vnni && vl) dpbusd_ymm(n);
    if (vnni && avx512) dpbusd_zmm(n);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) fma_ymm(n);
    if (avx512) fma_zmm(n);
    clock_chain(n);
    return 0;
}
