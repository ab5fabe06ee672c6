/* Shared by the fused optimizer kernels (lowband_sgd.c, lowband_adam.c): an AVX2+FMA build of
 * each loop chosen at run time by CPU features (not by CPU model, which is what
 * target_clones("arch=...") dispatches on), and a portable one where fmaf may be a libm call:
 * slow, but the same results. */
#ifndef LOWBAND_FMA_H
#define LOWBAND_FMA_H
#include <math.h>
#include <stdint.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define LB_X86_DISPATCH 1
#define LB_AVX2_FMA __attribute__((target("avx2,fma")))
#else
#define LB_X86_DISPATCH 0
#define LB_AVX2_FMA
#endif
#define LB_INLINE static inline __attribute__((always_inline))

#if LB_X86_DISPATCH
/* whether the AVX2+FMA build may run here */
static inline int lb_have_avx2_fma(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

#endif
