/* CP-SGD's global step and look-ahead local update for torch.optim.SGD, fused in one pass.
 *
 * Per element, exactly the float operations of torch/optim/sgd.py's single-tensor path, in
 * its order, with torch's CPU rounding: `x.add_(y, alpha=a)` is one fused multiply-add
 * fma(y, a, x) (probed against torch at start-up; lowband falls back to torch ops where it
 * differs), `buf.mul_(mu)` a float product.
 *
 *   global (when G is given), the user's optimizer.step() on the global weights W:
 *     d = maximize ? -G : G;  if (wd) d = fma(W, wd, d)
 *     if (momentum) { buf = has_buf ? fma(d, 1 - dampening, buf * mu) : d;
 *                     d = nesterov ? fma(buf, mu, d) : buf }
 *     W = fma(d, -lr, W)
 *   local (when g is given), the same step of g from the new W without storing its state:
 *     w = the same with g, the new W and the new buf (the tentative step); else w = W.
 *
 * `buf` may be NULL when there is no momentum, or no buffer yet and no global step.
 * Reads W, buf, G, g once and writes W, buf, w once: the torch sequence makes about a dozen
 * passes and dispatches per tensor. Compiled with -ffp-contract=off: only the explicit fmaf
 * calls fuse.
 */
#include "lowband_fma.h"

enum { SGD_GLOBAL = 1, SGD_HAS_BUF = 2, SGD_LOCAL = 4, SGD_MOMENTUM = 8, SGD_WD = 16,
       SGD_NESTEROV = 32, SGD_MAXIMIZE = 64 };

/* the direction of one step: maximize is a sign (exact), the rest torch's operations */
LB_INLINE float direction(float grad, float w, float *b, int has_buf, int flags,
                          float wd, float mu, float damp1, float sgn) {
    float d = grad * sgn;
    if (flags & SGD_WD) d = fmaf(w, wd, d);
    if (flags & SGD_MOMENTUM) {
        float nb = has_buf ? fmaf(d, damp1, *b * mu) : d;
        *b = nb;
        d = (flags & SGD_NESTEROV) ? fmaf(nb, mu, d) : nb;
    }
    return d;
}

/* `flags` is a compile-time constant at every call (the switch below), so each of the 64
 * variants is a branch-free loop the compiler can vectorize */
LB_INLINE void sgd_loop(float *restrict W, float *restrict buf, const float *restrict G,
                        const float *restrict g, float *restrict w, int64_t n,
                        float neg_lr, float wd, float mu, float damp1, float sgn, const int flags) {
    const int global = flags & SGD_GLOBAL, local = flags & SGD_LOCAL, mom = flags & SGD_MOMENTUM;
    const int has_buf = (flags & SGD_HAS_BUF) != 0;
    for (int64_t j = 0; j < n; ++j) {
        float Wj = W[j];
        float bj = (mom && has_buf) ? buf[j] : 0.0f;   /* buf may be NULL otherwise */
        if (global) {
            float d = direction(G[j], Wj, &bj, has_buf, flags, wd, mu, damp1, sgn);
            Wj = fmaf(d, neg_lr, Wj);
            W[j] = Wj;
            if (mom) buf[j] = bj;
        }
        if (local) {
            float b2 = bj;
            float d = direction(g[j], Wj, &b2, global || has_buf, flags, wd, mu, damp1, sgn);
            w[j] = fmaf(d, neg_lr, Wj);
        } else {
            w[j] = Wj;
        }
    }
}

LB_INLINE void sgd_dispatch(float *W, float *buf, const float *G, const float *g, float *w, int64_t n,
                            float neg_lr, float wd, float mu, float damp1, float sgn, int flags) {
    switch (flags & 63) {
        case 0: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 0); break;
        case 1: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 1); break;
        case 2: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 2); break;
        case 3: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 3); break;
        case 4: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 4); break;
        case 5: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 5); break;
        case 6: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 6); break;
        case 7: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 7); break;
        case 8: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 8); break;
        case 9: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 9); break;
        case 10: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 10); break;
        case 11: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 11); break;
        case 12: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 12); break;
        case 13: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 13); break;
        case 14: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 14); break;
        case 15: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 15); break;
        case 16: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 16); break;
        case 17: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 17); break;
        case 18: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 18); break;
        case 19: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 19); break;
        case 20: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 20); break;
        case 21: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 21); break;
        case 22: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 22); break;
        case 23: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 23); break;
        case 24: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 24); break;
        case 25: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 25); break;
        case 26: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 26); break;
        case 27: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 27); break;
        case 28: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 28); break;
        case 29: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 29); break;
        case 30: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 30); break;
        case 31: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 31); break;
        case 32: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 32); break;
        case 33: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 33); break;
        case 34: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 34); break;
        case 35: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 35); break;
        case 36: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 36); break;
        case 37: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 37); break;
        case 38: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 38); break;
        case 39: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 39); break;
        case 40: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 40); break;
        case 41: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 41); break;
        case 42: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 42); break;
        case 43: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 43); break;
        case 44: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 44); break;
        case 45: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 45); break;
        case 46: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 46); break;
        case 47: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 47); break;
        case 48: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 48); break;
        case 49: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 49); break;
        case 50: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 50); break;
        case 51: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 51); break;
        case 52: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 52); break;
        case 53: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 53); break;
        case 54: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 54); break;
        case 55: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 55); break;
        case 56: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 56); break;
        case 57: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 57); break;
        case 58: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 58); break;
        case 59: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 59); break;
        case 60: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 60); break;
        case 61: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 61); break;
        case 62: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 62); break;
        case 63: sgd_loop(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, 63); break;
    }
}

static void sgd_portable(float *W, float *buf, const float *G, const float *g, float *w, int64_t n,
                         float neg_lr, float wd, float mu, float damp1, float sgn, int flags) {
    sgd_dispatch(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, flags);
}

#if LB_X86_DISPATCH
LB_AVX2_FMA static void sgd_avx2_fma(float *W, float *buf, const float *G, const float *g, float *w,
                                     int64_t n, float neg_lr, float wd, float mu, float damp1, float sgn,
                                     int flags) {
    sgd_dispatch(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, flags);
}
#endif

void lb_sgd_pipeline(float *W, float *buf, const float *G, const float *g, float *w, int64_t n,
                     float neg_lr, float wd, float mu, float damp1, int flags) {
#if LB_X86_DISPATCH
    float sgn = (flags & SGD_MAXIMIZE) ? -1.0f : 1.0f;
    if (lb_have_avx2_fma()) {
        sgd_avx2_fma(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, flags);
        return;
    }
    sgd_portable(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, sgn, flags);
#else
    sgd_portable(W, buf, G, g, w, n, neg_lr, wd, mu, damp1, (flags & SGD_MAXIMIZE) ? -1.0f : 1.0f, flags);
#endif
}
