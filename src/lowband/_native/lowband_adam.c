/* CP-SGD's global step and look-ahead local update for torch.optim.Adam / AdamW, fused.
 *
 * Per element, the float operations of torch/optim/adam.py's single-tensor path, in its order,
 * with torch's CPU rounding, except the square root: torch's float sqrt on the CPU is not
 * always correctly rounded (on an MKL build about 0.6% of the elements of a large tensor are one
 * ulp off), so it stays torch's. Two passes with torch's sqrt between them:
 *
 *   lb_adam_moments (global, when G is given: the user's optimizer.step() on W with G, the
 *   state's moments m, v updated in place):
 *     W = decay * W                              (AdamW: param.mul_(1 - lr * wd))
 *     m = lerp(m, G, 1 - beta1);  v = v * beta2;  v = addcmul(v, G, G, 1 - beta2)
 *     vg = v                                     (its sqrt is taken by torch)
 *   and (local, when g is given) the tentative step's moments from the new m, v:
 *     ml = lerp(m, g, 1 - beta1);  vl = addcmul(v * beta2, g, g, 1 - beta2)
 *
 *   lb_adam_apply, with dg = sqrt(vg) and dl = sqrt(vl):
 *     W = W + (-step_size * m) / (dg / bias_correction2_sqrt + eps)          (addcdiv)
 *     w = (decay * W) + (-step_size' * ml) / (dl / bias_correction2_sqrt' + eps)
 *   (step sizes and bias corrections of the global step count and of that count + 1)
 *
 * torch's lerp (weight < 0.5: start + weight * (end - start)) and addcmul (self + value * t1 *
 * t2) may each be one fused multiply-add or not, depending on how torch was compiled:
 * ADAM_LERP_FMA and ADAM_ADDCMUL_FMA choose, and lowband probes at start-up which choice
 * reproduces this torch bit for bit (or does not use the kernel). Coupled weight decay (Adam
 * with weight_decay) is not here: the local step's gradient would need the new W before the
 * square root. Compiled with -ffp-contract=off: only the explicit fmaf calls fuse.
 */
#include "lowband_fma.h"

enum { ADAM_GLOBAL = 1, ADAM_LOCAL = 2, ADAM_STATE = 4, ADAM_DECOUPLED = 8, ADAM_LERP_FMA = 16,
       ADAM_ADDCMUL_FMA = 32, ADAM_LERP_BIG = 64 };

/* torch's lerp(start, end, weight) with a float weight: weight < 0.5 from start, else from end */
LB_INLINE float lerp1(float s, float e, float w, const int flags) {
    if (!(flags & ADAM_LERP_BIG))
        return (flags & ADAM_LERP_FMA) ? fmaf(w, e - s, s) : s + w * (e - s);
    return (flags & ADAM_LERP_FMA) ? fmaf(w - 1.0f, e - s, e) : e - (e - s) * (1.0f - w);
}

/* v * beta2, then addcmul(., d, d, c2) */
LB_INLINE float second(float v, float d, float beta2, float c2, const int flags) {
    float x = v * beta2;
    return (flags & ADAM_ADDCMUL_FMA) ? fmaf(c2 * d, d, x) : x + (c2 * d) * d;
}

LB_INLINE void moments_loop(float *restrict W, float *restrict m, float *restrict v,
                            const float *restrict G, const float *restrict g, float *restrict ml,
                            float *restrict vl, float *restrict vg, int64_t n, float decay, float w1,
                            float beta2, float c2, const int flags) {
    for (int64_t j = 0; j < n; ++j) {
        float mj = (flags & ADAM_STATE) ? m[j] : 0.0f, vj = (flags & ADAM_STATE) ? v[j] : 0.0f;
        if (flags & ADAM_GLOBAL) {
            if (flags & ADAM_DECOUPLED) W[j] = W[j] * decay;
            mj = lerp1(mj, G[j], w1, flags);
            vj = second(vj, G[j], beta2, c2, flags);
            m[j] = mj;
            v[j] = vj;
            vg[j] = vj;
        }
        if (flags & ADAM_LOCAL) {
            ml[j] = lerp1(mj, g[j], w1, flags);
            vl[j] = second(vj, g[j], beta2, c2, flags);
        }
    }
}

LB_INLINE void apply_loop(float *restrict W, const float *restrict m, const float *restrict dg,
                          float *restrict w, const float *restrict ml, const float *restrict dl,
                          int64_t n, float bc2s_g, float nss_g, float bc2s_l, float nss_l, float eps,
                          float decay, const int flags) {
    for (int64_t j = 0; j < n; ++j) {
        float Wj = W[j];
        if (flags & ADAM_GLOBAL) {
            Wj = Wj + (nss_g * m[j]) / (dg[j] / bc2s_g + eps);
            W[j] = Wj;
        }
        if (flags & ADAM_LOCAL) {
            float x = (flags & ADAM_DECOUPLED) ? Wj * decay : Wj;
            w[j] = x + (nss_l * ml[j]) / (dl[j] / bc2s_l + eps);
        } else {
            w[j] = Wj;
        }
    }
}

/* `flags` is a compile-time constant in every instance (the switches below): branch-free loops */
#define ADAM_CASES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) X(29) X(30) \
    X(31) X(32) X(33) X(34) X(35) X(36) X(37) X(38) X(39) X(40) X(41) X(42) X(43) X(44) X(45) X(46) \
    X(47) X(48) X(49) X(50) X(51) X(52) X(53) X(54) X(55) X(56) X(57) X(58) X(59) X(60) X(61) X(62) \
    X(63) X(64) X(65) X(66) X(67) X(68) X(69) X(70) X(71) X(72) X(73) X(74) X(75) X(76) X(77) X(78) \
    X(79) X(80) X(81) X(82) X(83) X(84) X(85) X(86) X(87) X(88) X(89) X(90) X(91) X(92) X(93) X(94) \
    X(95) X(96) X(97) X(98) X(99) X(100) X(101) X(102) X(103) X(104) X(105) X(106) X(107) X(108) \
    X(109) X(110) X(111) X(112) X(113) X(114) X(115) X(116) X(117) X(118) X(119) X(120) X(121) \
    X(122) X(123) X(124) X(125) X(126) X(127)

LB_INLINE void moments_dispatch(float *W, float *m, float *v, const float *G, const float *g, float *ml,
                                 float *vl, float *vg, int64_t n, float decay, float w1, float beta2,
                                 float c2, int flags) {
    switch (flags & 127) {
#define MOMENTS_CASE(F) case F: moments_loop(W, m, v, G, g, ml, vl, vg, n, decay, w1, beta2, c2, F); break;
        ADAM_CASES(MOMENTS_CASE)
#undef MOMENTS_CASE
    }
}

LB_INLINE void apply_dispatch(float *W, const float *m, const float *dg, float *w, const float *ml,
                              const float *dl, int64_t n, float bc2s_g, float nss_g, float bc2s_l,
                              float nss_l, float eps, float decay, int flags) {
    /* only GLOBAL, LOCAL and DECOUPLED matter here */
    switch (flags & (ADAM_GLOBAL | ADAM_LOCAL | ADAM_DECOUPLED)) {
#define APPLY_CASE(F) case F: apply_loop(W, m, dg, w, ml, dl, n, bc2s_g, nss_g, bc2s_l, nss_l, eps, decay, F); break;
        APPLY_CASE(0) APPLY_CASE(1) APPLY_CASE(2) APPLY_CASE(3)
        APPLY_CASE(8) APPLY_CASE(9) APPLY_CASE(10) APPLY_CASE(11)
#undef APPLY_CASE
    }
}

static void moments_portable(float *W, float *m, float *v, const float *G, const float *g, float *ml,
                             float *vl, float *vg, int64_t n, float decay, float w1, float beta2,
                             float c2, int flags) {
    moments_dispatch(W, m, v, G, g, ml, vl, vg, n, decay, w1, beta2, c2, flags);
}

static void apply_portable(float *W, const float *m, const float *dg, float *w, const float *ml,
                           const float *dl, int64_t n, float bc2s_g, float nss_g, float bc2s_l,
                           float nss_l, float eps, float decay, int flags) {
    apply_dispatch(W, m, dg, w, ml, dl, n, bc2s_g, nss_g, bc2s_l, nss_l, eps, decay, flags);
}

#if LB_X86_DISPATCH
LB_AVX2_FMA static void moments_avx2_fma(float *W, float *m, float *v, const float *G, const float *g,
                                         float *ml, float *vl, float *vg, int64_t n, float decay, float w1,
                                         float beta2, float c2, int flags) {
    moments_dispatch(W, m, v, G, g, ml, vl, vg, n, decay, w1, beta2, c2, flags);
}

LB_AVX2_FMA static void apply_avx2_fma(float *W, const float *m, const float *dg, float *w, const float *ml,
                                       const float *dl, int64_t n, float bc2s_g, float nss_g, float bc2s_l,
                                       float nss_l, float eps, float decay, int flags) {
    apply_dispatch(W, m, dg, w, ml, dl, n, bc2s_g, nss_g, bc2s_l, nss_l, eps, decay, flags);
}

#endif

/* m, v: the optimizer's state (read only without ADAM_STATE; written with ADAM_GLOBAL); vg, ml,
 * vl: scratch the caller passes to torch's sqrt (vg) and back to lb_adam_apply */
void lb_adam_moments(float *W, float *m, float *v, const float *G, const float *g, float *ml, float *vl,
                     float *vg, int64_t n, float decay, float w1, float beta2, float c2, int flags) {
#if LB_X86_DISPATCH
    if (lb_have_avx2_fma()) {
        moments_avx2_fma(W, m, v, G, g, ml, vl, vg, n, decay, w1, beta2, c2, flags);
        return;
    }
#endif
    moments_portable(W, m, v, G, g, ml, vl, vg, n, decay, w1, beta2, c2, flags);
}

/* dg = sqrt(vg), dl = sqrt(vl) (torch's); nss: -step_size; bc2s: bias_correction2 ** 0.5 */
void lb_adam_apply(float *W, const float *m, const float *dg, float *w, const float *ml, const float *dl,
                   int64_t n, float bc2s_g, float nss_g, float bc2s_l, float nss_l, float eps, float decay,
                   int flags) {
#if LB_X86_DISPATCH
    if (lb_have_avx2_fma()) {
        apply_avx2_fma(W, m, dg, w, ml, dl, n, bc2s_g, nss_g, bc2s_l, nss_l, eps, decay, flags);
        return;
    }
#endif
    apply_portable(W, m, dg, w, ml, dl, n, bc2s_g, nss_g, bc2s_l, nss_l, eps, decay, flags);
}
