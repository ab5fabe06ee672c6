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
#include <math.h>
#include <stdint.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define LB_FMA_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define LB_FMA_CLONES
#endif

enum { SGD_GLOBAL = 1, SGD_HAS_BUF = 2, SGD_LOCAL = 4, SGD_MOMENTUM = 8, SGD_WD = 16,
       SGD_NESTEROV = 32, SGD_MAXIMIZE = 64 };

static inline float direction(float grad, float w, float *b, int has_buf, int flags,
                              float wd, float mu, float damp1) {
    float d = (flags & SGD_MAXIMIZE) ? -grad : grad;
    if (flags & SGD_WD) d = fmaf(w, wd, d);
    if (flags & SGD_MOMENTUM) {
        float nb = has_buf ? fmaf(d, damp1, *b * mu) : d;
        *b = nb;
        d = (flags & SGD_NESTEROV) ? fmaf(nb, mu, d) : nb;
    }
    return d;
}

LB_FMA_CLONES
void lb_sgd_pipeline(float *W, float *buf, const float *G, const float *g, float *w, int64_t n,
                     float neg_lr, float wd, float mu, float damp1, int flags) {
    int global = flags & SGD_GLOBAL, local = flags & SGD_LOCAL, mom = flags & SGD_MOMENTUM;
    int has_buf = (flags & SGD_HAS_BUF) != 0;
    for (int64_t j = 0; j < n; ++j) {
        float Wj = W[j];
        float bj = (mom && has_buf) ? buf[j] : 0.0f;   /* buf may be NULL otherwise */
        int bj_valid = has_buf;
        if (global) {
            float d = direction(G[j], Wj, &bj, bj_valid, flags, wd, mu, damp1);
            Wj = fmaf(d, neg_lr, Wj);
            W[j] = Wj;
            if (mom) buf[j] = bj;
            bj_valid = 1;
        }
        if (local) {
            float b2 = bj;
            float d = direction(g[j], Wj, &b2, bj_valid, flags, wd, mu, damp1);
            w[j] = fmaf(d, neg_lr, Wj);
        } else {
            w[j] = Wj;
        }
    }
}
