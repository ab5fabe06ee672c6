/* Fused bucket-level codec kernels (2-bit MXNet, 2-bit scale-aware, 1-bit with scale).
 *
 * Plain C, no Python or torch headers: lowband loads this library with ctypes and passes
 * data_ptr()s, and ctypes releases the GIL for the duration of every call. Built by
 * `pip install` (setuptools Extension in setup.py); when it is missing lowband uses the
 * bit-identical torch path (lowband/codecs/bucket.py).
 *
 * Semantics are those of lowband.codecs.twobit / onebit applied to each chunk:
 *   r = e + g (e: residual, g: input); codes from r; e = r - decode(codes).
 * A *run* is one chunk: `len` real elements at g[src..src+len) followed by c-len zeros of
 * padding (the two-stage layout zero-pads a segment to N equal chunks). Chunk-local elements
 * in [skip_lo, skip_hi) are encoded as zeros and their residual is left untouched
 * (exact ranges, segments this rank has no gradient for).
 *
 * Sums (RMS, mean magnitude, 1-bit scale) use lowband's canonical order so that the torch
 * path can reproduce them bit for bit: rows of 256 (zero-padded) folded in halves
 * (y[j] = x[j] + x[j + w] for w = 128, 64, ..., 1), the row sums summed the same way.
 * All summed terms are >= 0, so extra zero padding never changes a result.
 * Compile with -ffp-contract=off (no FMA) and without -ffast-math.
 *
 * The scale-aware and 1-bit encoders also tell whether they proved every element of g in their
 * runs finite (return 0) or not (1): a NaN or Inf among a block's r makes its scale NaN or Inf
 * (a sum of r^2 or |r| with no max or min in it), so finite scales prove the coded elements
 * finite, and the skipped elements, which no scale covers, are tested directly. The engine's
 * NaN/Inf check then costs no pass of its own (lowband/comm/plans.py).
 *
 * The scale-aware encoder has an AVX-512F path (blocks of <= 256 elements held in registers,
 * two full blocks interleaved), chosen at run time from the CPU's features; it performs the
 * same IEEE operations in the same order as the portable C, so the bits agree (tested with
 * lb_set_simd(0) against lb_set_simd(1) and against the torch path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>

#define ROW 256

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define LB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LB_CLONES
#endif

enum { RUN_SRC = 0, RUN_LEN = 1, RUN_C = 2, RUN_WORD = 3, RUN_SCALE = 4, RUN_COLS = 5 };

/* present in builds whose encoders return the finiteness proof (older builds return 0 always) */
int lb_proves_finite(void) { return 1; }

/* 1 unless every x[0..n) is finite and n >= 0 (NaN fails the compare); no early exit, so it
 * vectorizes */
static int any_nonfinite(const float *x, int64_t n) {
    int bad = 0;
    for (int64_t j = 0; j < n; ++j) bad |= !(fabsf(x[j]) <= FLT_MAX);
    return bad;
}

/* 1 unless the skipped elements [lo, hi) of a run of len real elements at g + src are finite */
static int skipped_nonfinite(const float *g, int64_t src, int64_t len, int64_t lo, int64_t hi) {
    int64_t a = lo > 0 ? lo : 0, b = hi < len ? hi : len;
    return b > a ? any_nonfinite(g + src + a, b - a) : 0;
}

/* the canonical fold of x[0..2w) (w a power of two <= 128), from level w down: every level has
 * a constant trip count, so the compiler unrolls and vectorizes it (a loop over w did not: its
 * short levels cost more than the long ones) */
static inline float fold_from(float *x, int w) {
    if (w >= 128) for (int j = 0; j < 128; ++j) x[j] = x[j] + x[j + 128];
    if (w >= 64) for (int j = 0; j < 64; ++j) x[j] = x[j] + x[j + 64];
    if (w >= 32) for (int j = 0; j < 32; ++j) x[j] = x[j] + x[j + 32];
    for (int j = 0; j < 16; ++j) x[j] = x[j] + x[j + 16];
    for (int j = 0; j < 8; ++j) x[j] = x[j] + x[j + 8];
    for (int j = 0; j < 4; ++j) x[j] = x[j] + x[j + 4];
    x[0] = x[0] + x[2];
    x[1] = x[1] + x[3];
    return x[0] + x[1];
}

static float fold256(float *x) { return fold_from(x, 128); }

/* canonical sum of n >= 0 non-negative floats; x is clobbered (used as scratch) */
static float canon_sum_inplace(float *x, int64_t n) {
    float row[ROW];
    if (n == 0) return 0.0f;
    if (n == ROW) return fold256(x);
    while (1) {
        int64_t rows = (n + ROW - 1) / ROW;
        for (int64_t k = 0; k < rows; ++k) {
            int64_t m = n - k * ROW < ROW ? n - k * ROW : ROW;
            memcpy(row, x + k * ROW, (size_t)m * sizeof(float));
            if (m < ROW) memset(row + m, 0, (size_t)(ROW - m) * sizeof(float));
            x[k] = fold256(row);
        }
        if (rows == 1) return x[0];
        n = rows;
    }
}

/* r for chunk-local element j of a run (0 for padding and skipped elements) */
static inline float chunk_r(const float *g, const float *e, int64_t src, int64_t len,
                            int64_t lo, int64_t hi, int64_t j) {
    if (j >= len || (j >= lo && j < hi)) return 0.0f;
    return e ? e[src + j] + g[src + j] : g[src + j];
}

/* ---------------------------------------------------------------- 2-bit, fixed threshold */
/* MXNet code bytes (0b11 = +1, 0b10 = -1, 0b00 = 0), one per element, of `m` elements
 * (a multiple of 16) packed 16 per word, element j of a word in byte j/4 under 0xc0 >> 2(j%4):
 * the four code bytes of a byte-quad times MAGIC land at bits 30, 28, 26, 24. */
#define MAGIC2 ((1u << 30) + (1u << 20) + (1u << 10) + 1u)
static inline void pack_codes(const uint8_t *codes, int64_t m, uint32_t *words) {
    for (int64_t w = 0; w < m / 16; ++w) {
        uint32_t word = 0;
        for (int b = 0; b < 4; ++b) {
            uint32_t quad;
            memcpy(&quad, codes + 16 * w + 4 * b, 4);
            word |= ((quad * MAGIC2) >> 24) << (8 * b);
        }
        words[w] = word;
    }
}

#define GROUP 256
/* r = e + g for m elements; codes; e = r + (-t)*y with y = (r >= t) - (r <= -t), exactly the
 * torch path's r.add_(trunc(clamp(r/t, -1, 1)), alpha=-t) (y = 0 leaves r, -0.0 included) */
LB_CLONES
static void twobit_dense(const float *g, float *e, int64_t m, float t, uint8_t *codes) {
    float mt = -t;
    if (e) {
        for (int64_t j = 0; j < m; ++j) {
            float r = e[j] + g[j];
            int p = r >= t, n = r <= mt;
            codes[j] = (uint8_t)(p * 3 + n * 2);
            e[j] = r + mt * (float)(p - n);
        }
    } else {
        for (int64_t j = 0; j < m; ++j) {
            float r = g[j];
            int p = r >= t, n = r <= mt;
            codes[j] = (uint8_t)(p * 3 + n * 2);
        }
    }
}

/* ---------------------------------------------------------------- 2-bit, scale-aware */
/* the block's threshold from its canonical sum of squares: t = max(a*sqrt(sq / L), FLT_MIN) */
static inline float rel_threshold(float sq, int64_t L, float a) {
    float t = (float)sqrt((double)(sq / (float)L)) * a;   /* correctly rounded sqrt */
    return t < FLT_MIN ? FLT_MIN : t;                       /* NaN stays NaN */
}

/* residual and code of each of L elements in one pass: res = r - s*v, s in {+1, 0, -1} */
static inline void rel_codes(const float *rv, int64_t L, float t, float v, float *res, uint8_t *codes) {
    float mt = -t;
    for (int64_t j = 0; j < L; ++j) {
        float r = rv[j];
        int32_t p = r >= t, n = r <= mt;
        res[j] = r - (float)(p - n) * v;
        codes[j] = (uint8_t)(p * 3 + n * 2);
    }
}

/* rel_block (below) for a full block of ROW real elements, none skipped: the same arithmetic
 * in the same order, with each canonical fold's first level (y[j] = x[j] + x[j + 128]) done
 * where its terms are produced, so the squares and the fired magnitudes are never stored. */
LB_CLONES
static float rel_block_full(const float *gp, float *ep, float a, uint32_t *words, float *scratch) {
    float *rv = scratch, *tmp = scratch + ROW;
    uint8_t *codes = (uint8_t *)(scratch + 2 * ROW);
    const int H = ROW / 2;
    if (ep) {
        for (int j = 0; j < H; ++j) {
            float r0 = ep[j] + gp[j], r1 = ep[j + H] + gp[j + H];
            rv[j] = r0; rv[j + H] = r1;
            float s0 = r0 * r0, s1 = r1 * r1;
            tmp[j] = s0 + s1;
        }
    } else {
        for (int j = 0; j < H; ++j) {
            float r0 = gp[j], r1 = gp[j + H];
            rv[j] = r0; rv[j + H] = r1;
            float s0 = r0 * r0, s1 = r1 * r1;
            tmp[j] = s0 + s1;
        }
    }
    float t = rel_threshold(fold_from(tmp, 64), ROW, a);
    int32_t nf = 0;
    for (int j = 0; j < H; ++j) {
        float m0 = fabsf(rv[j]), m1 = fabsf(rv[j + H]);
        int32_t f0 = m0 >= t, f1 = m1 >= t;
        nf += f0 + f1;
        float x0 = f0 ? m0 : 0.0f, x1 = f1 ? m1 : 0.0f;
        tmp[j] = x0 + x1;
    }
    float sa = fold_from(tmp, 64);
    float v = nf > 0 ? sa / (float)nf : t;
    rel_codes(rv, ROW, t, v, ep ? ep : tmp, codes);
    pack_codes(codes, ROW, words);
    return v;
}


/* One scale block [b0, b0+L) of a chunk: t = max(a*sqrt(sum r^2 / L), FLT_MIN);
 * fired = |r| >= t; v = sum fired |r| / nfired (t when nothing fires); codes; e = r - s*v.
 * scratch: 2*L floats + L bytes. */
LB_CLONES
static float rel_block(const float *g, float *e, int64_t src, int64_t len, int64_t lo, int64_t hi,
                       int64_t b0, int64_t L, float a, uint32_t *words, float *scratch) {
    float *rv = scratch, *tmp = scratch + L;
    uint8_t *codes = (uint8_t *)(scratch + 2 * L);
    int simple = (b0 + L <= len) && (hi <= b0 || lo >= b0 + L);
    if (simple && L == ROW)   /* the common case, with the folds' first levels fused in */
        return rel_block_full(g + src + b0, e ? e + src + b0 : NULL, a, words + b0 / 16, scratch);
    if (simple) {
        const float *gp = g + src + b0;
        if (e) {
            const float *ep = e + src + b0;
            for (int64_t j = 0; j < L; ++j) { float r = ep[j] + gp[j]; rv[j] = r; tmp[j] = r * r; }
        } else {
            for (int64_t j = 0; j < L; ++j) { float r = gp[j]; rv[j] = r; tmp[j] = r * r; }
        }
    } else {
        for (int64_t j = 0; j < L; ++j) { float r = chunk_r(g, e, src, len, lo, hi, b0 + j); rv[j] = r; tmp[j] = r * r; }
    }
    float t = rel_threshold(canon_sum_inplace(tmp, L), L, a);
    int32_t nf = 0;
    for (int64_t j = 0; j < L; ++j) {
        float m = fabsf(rv[j]);
        int32_t f = m >= t;
        nf += f;
        tmp[j] = f ? m : 0.0f;
    }
    float sa = canon_sum_inplace(tmp, L);
    float v = nf > 0 ? sa / (float)nf : t;
    float *ep = e ? e + src + b0 : NULL;
    rel_codes(rv, L, t, v, (simple && e) ? ep : tmp, codes);
    if (e && !simple) {
        for (int64_t j = 0; j < L; ++j) {
            int64_t jj = b0 + j;
            if (jj < len && !(jj >= lo && jj < hi)) ep[j] = tmp[j];
        }
    }
    if ((b0 & 15) == 0 && (L & 15) == 0) {
        pack_codes(codes, L, words + b0 / 16);
    } else {
        for (int64_t j = 0; j < L; ++j) {
            int64_t jj = b0 + j;
            words[jj >> 4] |= (uint32_t)codes[j] << (8 * ((jj >> 2) & 3) + 6 - 2 * (jj & 3));
        }
    }
    return v;
}

/* ---------------------------------------------------------------- AVX-512F paths of the 2-bit encoders */
/* lb_set_simd(0) forces the portable path (tests, benchmarks) */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define LB_HAVE_AVX512 1
#include <immintrin.h>
#define LB_AVX512 __attribute__((target("avx512f")))

/* SPREAD[b]: bit i of byte b (element i of 8) moved to bit 8*(i/4) + 6 - 2*(i%4), the low
 * bit of element i's 2-bit code in MXNet's order (the high bit is one above) */
static uint16_t SPREAD[256];
static int spread_ready = 0;

static void init_spread(void) {
    if (spread_ready) return;
    #pragma GCC unroll 16
    for (int b = 0; b < 256; ++b) {
        uint16_t w = 0;
        for (int i = 0; i < 8; ++i)
            if (b >> i & 1) w |= (uint16_t)(1u << (8 * (i / 4) + 6 - 2 * (i % 4)));
        SPREAD[b] = w;
    }
    spread_ready = 1;
}

/* the packed word of 16 codes from their masks: +1 (p) -> 0b11, -1 (n) -> 0b10, else 0b00 */
static inline uint32_t pack_masks(uint32_t p, uint32_t n) {
    uint32_t nz = p | n;
    uint32_t lo = (uint32_t)SPREAD[p & 0xff] | (uint32_t)SPREAD[p >> 8] << 16;
    uint32_t hi = (uint32_t)SPREAD[nz & 0xff] | (uint32_t)SPREAD[nz >> 8] << 16;
    return lo | hi << 1;
}

/* the 16 code bytes of pack_masks's codes, one per element: +1 (p) -> 3, -1 (n) -> 2, else 0 */
LB_AVX512
static inline __m128i code_bytes(__mmask16 p, __mmask16 n) {
    __m512i c = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(n, _mm512_set1_epi32(2)), p, _mm512_set1_epi32(3));
    return _mm512_cvtepi32_epi8(c);
}

/* four packed words from their 4 x 16 code bytes (code_bytes), in vector registers: the words
 * pack_masks makes. Each group of four code bytes c0..c3 (elements 4j..4j+3 of a word), read
 * as a little-endian uint32, times 2^30 + 2^20 + 2^10 + 1 holds c0<<6 | c1<<4 | c2<<2 | c3 in
 * its top byte (the other partial products stay below bit 24 or leave the word), which is
 * byte j of the word in MXNet's order. Replaces four table lookups per word. */
LB_AVX512
static inline void store_packed4(uint32_t *words, __m128i a, __m128i b, __m128i c, __m128i d) {
    __m512i z = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(a), b, 1), c, 2), d, 3);
    z = _mm512_srli_epi32(_mm512_mullo_epi32(z, _mm512_set1_epi32(0x40100401)), 24);
    _mm_storeu_si128((__m128i *)words, _mm512_cvtepi32_epi8(z));
}

/* lanes [0, n) of a 16-lane mask */
static inline __mmask16 lanes_below(int64_t n) {
    return n <= 0 ? 0 : (n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u));
}

/* canonical fold of the 256 values t[k] + t[k+8] (k < 8) already summed at level 128; the last
 * 16 values fold in registers, pair for pair as fold_from's last levels (x[j] + x[j+8],
 * x[j] + x[j+4], x0 + x2 and x1 + x3, x0 + x1), so no store-to-load round trip sits on the
 * block's serial chain */
LB_AVX512
static inline float fold_regs(__m512 *y) {
    #pragma GCC unroll 16
    for (int k = 0; k < 4; ++k) y[k] = _mm512_add_ps(y[k], y[k + 4]);
    y[0] = _mm512_add_ps(y[0], y[2]);
    y[1] = _mm512_add_ps(y[1], y[3]);
    __m512 z = _mm512_add_ps(y[0], y[1]);
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(z),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
    __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

/* one block of L <= ROW elements, of which the first 16*NV (NV: a compile-time 1, 2, 4, 8 or
 * 16) cover L: the vectors past NV are exact zeros, whose terms the folds may skip (every
 * summed term is >= +0, and x + 0 == x for such x, NaN and Inf included) */
LB_AVX512 __attribute__((always_inline))
static inline float rel_block_nv(const float *g, float *e, int64_t src, int64_t len, int64_t lo, int64_t hi,
                                 int64_t b0, int64_t L, float a, uint32_t *words, const int NV) {
    __m512 r[16], y[8];
    __mmask16 valid[16];
    int64_t real = (len - b0 < L ? len - b0 : L);          /* real (unpadded) elements */
    int64_t slo = lo - b0, shi = hi - b0;                   /* skipped range, block-local */
    const float *gp = g + src + b0;
    float *ep = e ? e + src + b0 : NULL;
    #pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
        __mmask16 m = lanes_below(real - 16 * k);
        if (shi > slo) m &= (__mmask16)~(lanes_below(shi - 16 * k) & ~lanes_below(slo - 16 * k));
        valid[k] = m;
        __m512 gv = _mm512_maskz_loadu_ps(m, gp + 16 * k);
        r[k] = ep ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, ep + 16 * k), gv) : gv;
    }
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k)
        y[k] = k + 8 < NV ? _mm512_add_ps(_mm512_mul_ps(r[k], r[k]), _mm512_mul_ps(r[k + 8], r[k + 8]))
             : (k < NV ? _mm512_mul_ps(r[k], r[k]) : _mm512_setzero_ps());
    float t = rel_threshold(fold_regs(y), L, a);
    __m512 tv = _mm512_set1_ps(t), mtv = _mm512_set1_ps(-t);
    int32_t nf = 0;
    #pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
        __m512 m0 = _mm512_abs_ps(r[k]);
        __mmask16 f0 = _mm512_cmp_ps_mask(m0, tv, _CMP_GE_OQ);
        nf += __builtin_popcount((unsigned)f0);
        __m512 x0 = _mm512_maskz_mov_ps(f0, m0);
        if (k < 8) y[k] = x0;
        else y[k - 8] = _mm512_add_ps(y[k - 8], x0);
    }
    #pragma GCC unroll 8
    for (int k = NV; k < 8; ++k) y[k] = _mm512_setzero_ps();
    float sa = fold_regs(y);
    float v = nf > 0 ? sa / (float)nf : t;
    __m512 vv = _mm512_set1_ps(v), one = _mm512_set1_ps(1.0f), mone = _mm512_set1_ps(-1.0f);
    int64_t nwords = (L + 15) / 16;
    #pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
        if (k >= nwords) break;
        __mmask16 p = _mm512_cmp_ps_mask(r[k], tv, _CMP_GE_OQ), n = _mm512_cmp_ps_mask(r[k], mtv, _CMP_LE_OQ);
        if (ep) {
            __m512 s = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_setzero_ps(), p & (__mmask16)~n, one),
                                          n & (__mmask16)~p, mone);
            _mm512_mask_storeu_ps(ep + 16 * k, valid[k], _mm512_sub_ps(r[k], _mm512_mul_ps(s, vv)));
        }
        words[(b0 >> 4) + k] |= pack_masks(p, n);
    }
    return v;
}

/* rel_block for a block of L <= ROW elements on AVX-512F: the block's values of r live in
 * registers, the canonical folds are register adds, codes come from compare masks, so the
 * block is read once from memory and e written once. Same operations in the same order as
 * rel_block (no FMA: -ffp-contract=off), hence the same bits (tested against the portable
 * path and the torch path). Chosen at run time when the CPU has AVX-512F. */
LB_AVX512
static float rel_block_avx512(const float *g, float *e, int64_t src, int64_t len, int64_t lo, int64_t hi,
                              int64_t b0, int64_t L, float a, uint32_t *words) {
    int64_t nv = (L + 15) / 16;
    if (nv <= 1) return rel_block_nv(g, e, src, len, lo, hi, b0, L, a, words, 1);
    if (nv <= 2) return rel_block_nv(g, e, src, len, lo, hi, b0, L, a, words, 2);
    if (nv <= 4) return rel_block_nv(g, e, src, len, lo, hi, b0, L, a, words, 4);
    if (nv <= 8) return rel_block_nv(g, e, src, len, lo, hi, b0, L, a, words, 8);
    return rel_block_nv(g, e, src, len, lo, hi, b0, L, a, words, 16);
}

/* two full blocks at once (ROW real elements each, none skipped): rel_block_avx512's
 * operations, interleaved so the out-of-order core overlaps one block's serial chain (fold,
 * sqrt, fold, divide) with the other's work. r = e + g is recomputed from L1 in each pass
 * instead of held (32 registers would spill): 3-8% faster on the 1 MiB buckets (--ab) */
LB_AVX512
static void rel_block2_avx512(const float *gp, float *ep, float a, uint32_t *words, float *scales) {
    __m512 y[2][8];
    float t[2], v[2];
#define R2(b, k) (ep ? _mm512_add_ps(_mm512_loadu_ps(ep + ROW * (b) + 16 * (k)), _mm512_loadu_ps(gp + ROW * (b) + 16 * (k))) \
                     : _mm512_loadu_ps(gp + ROW * (b) + 16 * (k)))
    #pragma GCC unroll 16
    for (int b = 0; b < 2; ++b) {
        #pragma GCC unroll 16
        for (int k = 0; k < 8; ++k)
        {
            __m512 r0 = R2(b, k), r1 = R2(b, k + 8);
            y[b][k] = _mm512_add_ps(_mm512_mul_ps(r0, r0), _mm512_mul_ps(r1, r1));
        }
        t[b] = rel_threshold(fold_regs(y[b]), ROW, a);
    }
    #pragma GCC unroll 16
    for (int b = 0; b < 2; ++b) {
        __m512 tv = _mm512_set1_ps(t[b]);
        __m512i cnt = _mm512_setzero_si512(), mone_i = _mm512_set1_epi32(-1);
        #pragma GCC unroll 16
        for (int k = 0; k < 8; ++k) {
            __m512 m0 = _mm512_abs_ps(R2(b, k)), m1 = _mm512_abs_ps(R2(b, k + 8));
            __mmask16 f0 = _mm512_cmp_ps_mask(m0, tv, _CMP_GE_OQ), f1 = _mm512_cmp_ps_mask(m1, tv, _CMP_GE_OQ);
            cnt = _mm512_mask_sub_epi32(cnt, f0, cnt, mone_i);
            cnt = _mm512_mask_sub_epi32(cnt, f1, cnt, mone_i);
            y[b][k] = _mm512_add_ps(_mm512_maskz_mov_ps(f0, m0), _mm512_maskz_mov_ps(f1, m1));
        }
        int32_t nf = _mm512_reduce_add_epi32(cnt);
        float sa = fold_regs(y[b]);
        v[b] = nf > 0 ? sa / (float)nf : t[b];
        scales[b] = v[b];
    }
    #pragma GCC unroll 16
    for (int b = 0; b < 2; ++b) {
        /* s * v for s in {+1, 0, -1}: v, 0 * v (+0, or NaN for a NaN or infinite v), -v; t > 0,
         * so no element is both >= t and <= -t */
        __m512 tv = _mm512_set1_ps(t[b]), mtv = _mm512_set1_ps(-t[b]), pv = _mm512_set1_ps(v[b]),
               nv = _mm512_set1_ps(-1.0f * v[b]), zv = _mm512_set1_ps(0.0f * v[b]);
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            __m128i cb[4];
            #pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                int k = 4 * q + j;
                __m512 rk = R2(b, k);
                __mmask16 p = _mm512_cmp_ps_mask(rk, tv, _CMP_GE_OQ), n = _mm512_cmp_ps_mask(rk, mtv, _CMP_LE_OQ);
                if (ep) {
                    __m512 sv = _mm512_mask_mov_ps(_mm512_mask_mov_ps(zv, p, pv), n, nv);
                    _mm512_storeu_ps(ep + ROW * b + 16 * k, _mm512_sub_ps(rk, sv));
                }
                cb[j] = code_bytes(p, n);
            }
            store_packed4(words + 16 * b + 4 * q, cb[0], cb[1], cb[2], cb[3]);
        }
    }
#undef R2
}

/* one vector (elements 16w..16w+15) of twobit_dense_avx512: r = e + g, e = r + (-t)*s, and the
 * masks of the +1 (p) and -1 (n) codes of its real elements */
LB_AVX512 __attribute__((always_inline))
static inline void dense_vector(const float *g, float *e, int64_t m, int64_t w, float t,
                                __mmask16 *p, __mmask16 *n) {
    __m512 tv = _mm512_set1_ps(t), mtv = _mm512_set1_ps(-t);
    __mmask16 valid = lanes_below(m - 16 * w);
    __m512 r = _mm512_maskz_loadu_ps(valid, g + 16 * w);
    if (e) r = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, e + 16 * w), r);
    __mmask16 pm = _mm512_cmp_ps_mask(r, tv, _CMP_GE_OQ), nm = _mm512_cmp_ps_mask(r, mtv, _CMP_LE_OQ);
    if (e) {
        __m512 s = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_setzero_ps(), pm & (__mmask16)~nm, _mm512_set1_ps(1.0f)),
                                      nm & (__mmask16)~pm, _mm512_set1_ps(-1.0f));
        _mm512_mask_storeu_ps(e + 16 * w, valid, _mm512_add_ps(r, _mm512_mul_ps(mtv, s)));
    }
    *p = pm & valid;
    *n = nm & valid;
}

/* MXNet 2-bit of m <= GROUP real elements (none skipped) straight into ceil(m/16) packed words,
 * the operations of twobit_dense per element: codes from r >= t and r <= -t, e = r + (-t)*s */
LB_AVX512
static void twobit_dense_avx512(const float *g, float *e, int64_t m, float t, uint32_t *words) {
    int64_t nw = (m + 15) / 16, k = 0;
    __mmask16 p, n;
    for (; k + 4 <= nw; k += 4) {                 /* four words at a time: packed in registers */
        __m128i cb[4];
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            dense_vector(g, e, m, k + j, t, &p, &n);
            cb[j] = code_bytes(p, n);
        }
        store_packed4(words + k, cb[0], cb[1], cb[2], cb[3]);
    }
    for (; k < nw; ++k) {
        dense_vector(g, e, m, k, t, &p, &n);
        words[k] = pack_masks(p, n);
    }
}

/* the vector decoders' last step, for 16 values and for one: added to what dst holds
 * (accumulate), divided by divisor when it is not 1, stored */
LB_AVX512
static inline void put16(float *dst, __m512 x, int accumulate, float divisor) {
    if (accumulate) x = _mm512_add_ps(_mm512_loadu_ps(dst), x);
    if (divisor != 1.0f) x = _mm512_div_ps(x, _mm512_set1_ps(divisor));
    _mm512_storeu_ps(dst, x);
}

static inline void put1(float *dst, float x, int accumulate, float divisor) {
    if (accumulate) x = *dst + x;
    *dst = divisor != 1.0f ? x / divisor : x;
}

/* decoded 2-bit values of chunk elements [j0, j0+m) (j0 a multiple of 16; kind 1: bs a
 * multiple of 16) into vals, or added to them (accumulate: vals + d, as acc_add does), then
 * divided by divisor when it is not 1: decode_tile's sign * scale, one packed word per vector */
LB_AVX512
static void decode2_avx512(int kind, const int32_t *sec, int64_t sword, int64_t sscale, int64_t j0,
                           int64_t m, float t, int64_t bs, float *vals, int accumulate, float divisor) {
    const uint32_t *words = (const uint32_t *)(sec + sword) + (j0 >> 4);
    const uint8_t *bytes = (const uint8_t *)(sec + sword);
    const float *v = (const float *)(sec + sscale);
    const __m512i shift = _mm512_set_epi32(24, 26, 28, 30, 16, 18, 20, 22, 8, 10, 12, 14, 0, 2, 4, 6);
    const __m512i three = _mm512_set1_epi32(3), two = _mm512_set1_epi32(2);
    const __m512 one = _mm512_set1_ps(1.0f), mone = _mm512_set1_ps(-1.0f);
    int64_t full = m / 16;
    int64_t per = kind == 0 ? full + 1 : bs / 16;        /* vectors per scale block */
    int64_t b = kind == 0 ? 0 : j0 / bs, left = kind == 0 ? per : per - (j0 % bs) / 16;
    __m512 sv = _mm512_set1_ps(kind == 0 ? t : v[b]);
    for (int64_t k = 0; k < full; ++k) {
        if (left == 0) { sv = _mm512_set1_ps(v[++b]); left = per; }
        --left;
        __m512i code = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)words[k]), shift), three);
        __mmask16 p = _mm512_cmpeq_epi32_mask(code, three), n = _mm512_cmpeq_epi32_mask(code, two);
        __m512 sign = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_setzero_ps(), p, one), n, mone);
        put16(vals + 16 * k, _mm512_mul_ps(sign, sv), accumulate, divisor);
    }
    for (int64_t j = 16 * full; j < m; ++j) {
        int64_t jj = j0 + j;
        int code = (bytes[jj >> 2] >> (6 - 2 * (jj & 3))) & 3;
        float sign = code == 3 ? 1.0f : (code == 2 ? -1.0f : 0.0f);
        put1(vals + j, sign * (kind == 0 ? t : v[jj / bs]), accumulate, divisor);
    }
}

/* bit q of a byte at position 7 - q (the 1-bit payload's order, MSB first) -> bit q */
static uint8_t REV8[256];
static int rev8_ready = 0;
static void init_rev8(void) {
    if (rev8_ready) return;
    for (int b = 0; b < 256; ++b) {
        int r = 0;
        for (int q = 0; q < 8; ++q) r |= ((b >> (7 - q)) & 1) << q;
        REV8[b] = (uint8_t)r;
    }
    rev8_ready = 1;
}

/* decoded 1-bit values of chunk elements [j0, j0+m) (j0 a multiple of 8) into vals, or added
 * to them (accumulate), then divided by divisor when it is not 1: decode_tile's value
 * (the scale's bits with the payload bit as the sign bit), 16 elements (two bytes) per vector */
LB_AVX512
static void decode1_avx512(const int32_t *sec, int64_t sword, int64_t sscale, int64_t j0, int64_t m,
                           float *vals, int accumulate, float divisor) {
    const uint8_t *bytes = (const uint8_t *)(sec + sword) + (j0 >> 3);
    uint32_t sb;
    memcpy(&sb, sec + sscale, 4);
    const __m512i sbv = _mm512_set1_epi32((int)sb), sign = _mm512_set1_epi32((int)0x80000000u);
    int64_t full = m / 16;
    for (int64_t k = 0; k < full; ++k) {
        __mmask16 neg = (__mmask16)(REV8[bytes[2 * k]] | (uint32_t)REV8[bytes[2 * k + 1]] << 8);
        put16(vals + 16 * k, _mm512_castsi512_ps(_mm512_mask_or_epi32(sbv, neg, sbv, sign)), accumulate, divisor);
    }
    for (int64_t j = 16 * full; j < m; ++j) {
        uint32_t w = sb | ((uint32_t)((bytes[j >> 3] >> (7 - (j & 7))) & 1) << 31);
        float x;
        memcpy(&x, &w, 4);
        put1(vals + j, x, accumulate, divisor);
    }
}
#endif

/* ---------------------------------------------------------------- 2-bit encoders: dispatch */
static int simd_level = -1;   /* -1: not probed; 0: portable C; 1: AVX-512F */

static int simd(void) {
    if (simd_level < 0) {
#ifdef LB_HAVE_AVX512
        __builtin_cpu_init();
        simd_level = __builtin_cpu_supports("avx512f") ? 1 : 0;
        init_spread();
        init_rev8();
#else
        simd_level = 0;
#endif
    }
    return simd_level;
}

/* for tests and benchmarks: 0 forces the portable C path, 1 allows SIMD where the CPU has it;
 * returns the level now in use */
int lb_set_simd(int allow) {
    simd_level = -1;
    if (simd() && !allow) simd_level = 0;
    return simd_level;
}

static void twobit_run(const float *g, float *e, int64_t src, int64_t len, int64_t c,
                       int64_t lo, int64_t hi, float t, uint32_t *words, int vec) {
    uint8_t codes[GROUP];
    float mt = -t;
    for (int64_t j0 = 0; j0 < c; j0 += GROUP) {
        int64_t m = c - j0 < GROUP ? c - j0 : GROUP;
        int64_t mpad = (m + 15) / 16 * 16;
#ifdef LB_HAVE_AVX512
        if (vec && j0 + m <= len && (hi <= j0 || lo >= j0 + m)) {
            twobit_dense_avx512(g + src + j0, e ? e + src + j0 : NULL, m, t, words + j0 / 16);
            continue;
        }
#else
        (void)vec;
#endif
        if (j0 + m <= len && (hi <= j0 || lo >= j0 + m)) {
            twobit_dense(g + src + j0, e ? e + src + j0 : NULL, m, t, codes);
        } else {
            for (int64_t j = 0; j < m; ++j) {
                int64_t jj = j0 + j;
                float r = chunk_r(g, e, src, len, lo, hi, jj);
                int p = r >= t, n = r <= mt;
                codes[j] = (uint8_t)(p * 3 + n * 2);
                if (e && jj < len && !(jj >= lo && jj < hi)) e[src + jj] = r + mt * (float)(p - n);
            }
        }
        if (mpad > m) memset(codes + m, 0, (size_t)(mpad - m));
        pack_codes(codes, mpad, words + j0 / 16);
    }
}

/* Where run k reads its input and residual: g + src and e + src, unless `gaddr` (the *_at
 * encoders) gives the address of the run's first input element (its gradient's own tensor, not
 * the bucket: the caller skips the copy into the bucket). The residual always lives at e + src. */
static inline const float *run_g(const float *g, const int64_t *gaddr, int64_t k, int64_t src) {
    return gaddr ? (const float *)(intptr_t)gaddr[k] : g + src;
}
static inline float *run_e(float *e, int64_t src) { return e ? e + src : NULL; }

void lb_twobit_encode_at(const float *g, float *e, const int64_t *runs, int64_t nruns, const int64_t *gaddr,
                         const int64_t *skip, float t, int32_t *dst) {
    int vec = simd();
    for (int64_t k = 0; k < nruns; ++k) {
        const int64_t *r = runs + RUN_COLS * k;
        int64_t lo = skip ? skip[2 * k] : 0, hi = skip ? skip[2 * k + 1] : 0;
        twobit_run(run_g(g, gaddr, k, r[RUN_SRC]), run_e(e, r[RUN_SRC]), 0, r[RUN_LEN], r[RUN_C], lo, hi, t,
                   (uint32_t *)(dst + r[RUN_WORD]), vec);
    }
}

void lb_twobit_encode(const float *g, float *e, const int64_t *runs, int64_t nruns,
                      const int64_t *skip, float t, int32_t *dst) {
    lb_twobit_encode_at(g, e, runs, nruns, NULL, skip, t, dst);
}

/* Calls of at most this many real elements take the two-block kernel for full blocks, larger
 * ones one block at a time: the two-block kernel is 3-15% faster while the data is cache-resident
 * (ResNet-20's and cnn's 1 MiB buckets, flat calls up to 1M elements) but slower from 2M elements
 * on, about half the one-block speed at 4M-25M where the call streams from memory (docs/codecs.md).
 * The paths give the same bits. */
#define LB_PAIR_MAX_ELEMS (1 << 20)

int lb_twobit_rel_encode_at(const float *g, float *e, const int64_t *runs, int64_t nruns, const int64_t *gaddr,
                            const int64_t *skip, float a, int64_t bs, int32_t *dst) {
    int64_t maxL = 0, total = 0;
    for (int64_t k = 0; k < nruns; ++k) {
        int64_t c = runs[RUN_COLS * k + RUN_C];
        int64_t L = bs > 0 && bs < c ? bs : c;
        if (L > maxL) maxL = L;
        total += runs[RUN_COLS * k + RUN_LEN];
    }
    float stack[3 * 1024];
    float *scratch = maxL <= 1024 ? stack : (float *)malloc((size_t)(3 * maxL) * sizeof(float));
    if (!scratch) return -1;
    int vec = simd(), pair = vec && total <= LB_PAIR_MAX_ELEMS, unproven = 0;
    (void)vec, (void)pair;
    for (int64_t k = 0; k < nruns; ++k) {
        const int64_t *r = runs + RUN_COLS * k;
        int64_t lo = skip ? skip[2 * k] : 0, hi = skip ? skip[2 * k + 1] : 0;
        int64_t c = r[RUN_C], len = r[RUN_LEN];
        const float *gk = run_g(g, gaddr, k, r[RUN_SRC]);
        float *ek = run_e(e, r[RUN_SRC]);
        int64_t B = bs > 0 ? bs : (c > 0 ? c : 1);
        uint32_t *words = (uint32_t *)(dst + r[RUN_WORD]);
        float *scales = (float *)(dst + r[RUN_SCALE]);
        memset(words, 0, (size_t)((c + 15) / 16) * sizeof(uint32_t));
        for (int64_t b = 0, b0 = 0; b0 < c; ++b, b0 += B) {
            int64_t L = c - b0 < B ? c - b0 : B;
#ifdef LB_HAVE_AVX512
            if (pair && B == ROW && b0 + 2 * ROW <= len && (hi <= b0 || lo >= b0 + 2 * ROW || hi <= lo)) {
                rel_block2_avx512(gk + b0, ek ? ek + b0 : NULL, a, words + b0 / 16, scales + b);
                b += 1, b0 += ROW;   /* the loop's step adds the second block */
                continue;
            }
            if (L <= ROW && (b0 & 15) == 0 && vec) {
                scales[b] = rel_block_avx512(gk, ek, 0, len, lo, hi, b0, L, a, words);
                continue;
            }
#endif
            scales[b] = rel_block(gk, ek, 0, len, lo, hi, b0, L, a, words, scratch);
        }
        unproven |= any_nonfinite(scales, (c + B - 1) / B);
        unproven |= skipped_nonfinite(gk, 0, len, lo, hi);
    }
    if (scratch != stack) free(scratch);
    return unproven;
}

int lb_twobit_rel_encode(const float *g, float *e, const int64_t *runs, int64_t nruns,
                         const int64_t *skip, float a, int64_t bs, int32_t *dst) {
    return lb_twobit_rel_encode_at(g, e, runs, nruns, NULL, skip, a, bs, dst);
}

/* ---------------------------------------------------------------- 1-bit with scale */
/* scale = canonical sum |r| / max(c, 1); bit = sign bit of r (MSB-first stream);
 * e = r - copysign(scale, r). Two passes over the chunk (the scale needs all of it). */
LB_CLONES
static void abs_r(const float *g, const float *e, int64_t m, float *out) {
    if (e) for (int64_t j = 0; j < m; ++j) out[j] = fabsf(e[j] + g[j]);
    else for (int64_t j = 0; j < m; ++j) out[j] = fabsf(g[j]);
}

LB_CLONES
static void onebit_dense(const float *g, float *e, int64_t m, float scale, uint8_t *bits) {
    for (int64_t j = 0; j < m; ++j) {
        float r = e ? e[j] + g[j] : g[j];
        uint32_t u;
        memcpy(&u, &r, 4);
        bits[j] = (uint8_t)(u >> 31);
        if (e) e[j] = r - copysignf(scale, r);
    }
}

/* eight 0/1 bytes -> one MSB-first byte (the bit-gather multiply of bitpack.py) */
static inline void pack_bits8(const uint8_t *bits, int64_t m, uint8_t *out) {
    for (int64_t k = 0; k < m / 8; ++k) {
        uint64_t oct;
        memcpy(&oct, bits + 8 * k, 8);
        out[k] = (uint8_t)((oct * 0x8040201008040201ull) >> 56);
    }
}

int lb_onebit_encode_at(const float *g_bucket, float *e_bucket, const int64_t *runs, int64_t nruns,
                        const int64_t *gaddr, const int64_t *skip, int32_t *dst) {
    int64_t maxrows = 1;
    for (int64_t k = 0; k < nruns; ++k) {
        int64_t rows = (runs[RUN_COLS * k + RUN_C] + ROW - 1) / ROW;
        if (rows > maxrows) maxrows = rows;
    }
    float *part = (float *)malloc((size_t)maxrows * sizeof(float));   /* row sums */
    if (!part) return -1;
    uint8_t bits[GROUP];
    float row[ROW];
    int unproven = 0;
    for (int64_t k = 0; k < nruns; ++k) {
        const int64_t *r = runs + RUN_COLS * k;
        /* the run's own input and residual, indexed from 0 */
        const float *g = run_g(g_bucket, gaddr, k, r[RUN_SRC]);
        float *e = run_e(e_bucket, r[RUN_SRC]);
        int64_t src = 0, len = r[RUN_LEN], c = r[RUN_C];
        int64_t lo = skip ? skip[2 * k] : 0, hi = skip ? skip[2 * k + 1] : 0;
        uint8_t *words = (uint8_t *)(dst + r[RUN_WORD]);
        int simple = hi <= lo || hi <= 0 || lo >= len;
        /* canonical sum of |r|: fold each 256-row, then the row sums */
        int64_t rows = (c + ROW - 1) / ROW;
        for (int64_t q = 0; q < rows; ++q) {
            int64_t j0 = q * ROW, m = c - j0 < ROW ? c - j0 : ROW;
            if (simple && j0 + m <= len) {
                abs_r(g + src + j0, e ? e + src + j0 : NULL, m, row);
            } else {
                for (int64_t j = 0; j < m; ++j) row[j] = fabsf(chunk_r(g, e, src, len, lo, hi, j0 + j));
            }
            if (m < ROW) memset(row + m, 0, (size_t)(ROW - m) * sizeof(float));
            part[q] = fold256(row);
        }
        float scale = canon_sum_inplace(part, rows) / (float)(c > 1 ? c : 1);
        int64_t nw = (c + 31) / 32;
        for (int64_t j0 = 0; j0 < nw * 32; j0 += GROUP) {
            int64_t m = nw * 32 - j0 < GROUP ? nw * 32 - j0 : GROUP;
            if (simple && j0 + m <= len) {
                onebit_dense(g + src + j0, e ? e + src + j0 : NULL, m, scale, bits);
            } else {
                for (int64_t j = 0; j < m; ++j) {
                    int64_t jj = j0 + j;
                    float rj = jj < c ? chunk_r(g, e, src, len, lo, hi, jj) : 0.0f;
                    uint32_t u;
                    memcpy(&u, &rj, 4);
                    bits[j] = (uint8_t)(u >> 31);
                    if (e && jj < len && !(jj >= lo && jj < hi)) e[src + jj] = rj - copysignf(scale, rj);
                }
            }
            pack_bits8(bits, m, words + j0 / 8);
        }
        *(float *)(dst + r[RUN_SCALE]) = scale;
        unproven |= any_nonfinite(&scale, 1) | skipped_nonfinite(g, src, len, lo, hi);
    }
    free(part);
    return unproven;
}

int lb_onebit_encode(const float *g, float *e, const int64_t *runs, int64_t nruns,
                     const int64_t *skip, int32_t *dst) {
    return lb_onebit_encode_at(g, e, runs, nruns, NULL, skip, dst);
}

/* ---------------------------------------------------------------- decode (+ accumulate) */
/* Decode runs from K payload sections (section k at src + k*stride int32 words) and combine
 * them: out = (from_zero ? 0 + d_0 : d_0) + d_1 + ... + d_{K-1}, divided by `divisor` when it
 * is not 1. A decode run: src_word, src_scale, c, dst_off, len (only `len` of the chunk's c
 * elements are written). kind: 0 = 2-bit fixed (scale = t), 1 = 2-bit scale-aware (block bs),
 * 2 = 1-bit. */
#define TILE 2048
static float LUT2[256][4];     /* MXNet byte -> four signs (+1, -1, 0; 0b01 decodes to 0) */
static uint32_t LUT1[256][8];  /* 1-bit byte -> eight sign-bit masks */
static int lut_ready = 0;

static void init_lut(void) {
    if (lut_ready) return;
    for (int b = 0; b < 256; ++b) {
        for (int q = 0; q < 4; ++q) {
            int code = (b >> (6 - 2 * q)) & 3;
            LUT2[b][q] = code == 3 ? 1.0f : (code == 2 ? -1.0f : 0.0f);
        }
        for (int q = 0; q < 8; ++q) LUT1[b][q] = (uint32_t)((b >> (7 - q)) & 1) << 31;
    }
    lut_ready = 1;
}

/* decoded values of chunk elements [j0, j0+m) (j0 a multiple of 8) into vals */
LB_CLONES
static void decode_tile(int kind, const int32_t *sec, int64_t sword, int64_t sscale, int64_t j0,
                        int64_t m, float t, int64_t bs, float *vals) {
    const uint8_t *bytes = (const uint8_t *)(sec + sword);
    if (kind == 2) {
        float scale = *(const float *)(sec + sscale);
        uint32_t sb, u[8];
        memcpy(&sb, &scale, 4);
        int64_t full = m / 8;
        for (int64_t k = 0; k < full; ++k) {
            const uint32_t *l = LUT1[bytes[(j0 >> 3) + k]];
            for (int q = 0; q < 8; ++q) u[q] = sb | l[q];
            memcpy(vals + 8 * k, u, 32);
        }
        for (int64_t j = 8 * full; j < m; ++j) {
            int64_t jj = j0 + j;
            uint32_t w = sb | LUT1[bytes[jj >> 3]][jj & 7];
            memcpy(vals + j, &w, 4);
        }
        return;
    }
    int64_t quads = (m + 3) / 4;
    float tmp4[TILE + 4];
    for (int64_t k = 0; k < quads; ++k) memcpy(tmp4 + 4 * k, LUT2[bytes[(j0 >> 2) + k]], 16);
    if (kind == 0) {
        for (int64_t j = 0; j < m; ++j) vals[j] = tmp4[j] * t;
    } else {
        const float *v = (const float *)(sec + sscale);
        for (int64_t j = 0; j < m;) {
            int64_t jj = j0 + j, b = jj / bs, end = (b + 1) * bs - j0;
            if (end > m) end = m;
            float vb = v[b];
            for (; j < end; ++j) vals[j] = tmp4[j] * vb;
        }
    }
}

LB_CLONES
static void acc_add(float *acc, const float *vals, int64_t m) {
    for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] + vals[j];
}

/* one source's decoded tile into a (accumulate: a = a + d): decode_tile (+ acc_add through the
 * scratch vals), or the AVX-512F paths: 2-bit payloads whose scale blocks hold whole vectors,
 * and 1-bit payloads */
static inline void decode_into(int vec, int kind, const int32_t *sec, int64_t sword, int64_t sscale,
                               int64_t j0, int64_t m, float t, int64_t bs, float *a, int accumulate,
                               float divisor, float *vals) {
#ifdef LB_HAVE_AVX512
    if (vec && kind != 2 && (j0 & 15) == 0 && (kind == 0 || (bs & 15) == 0)) {
        decode2_avx512(kind, sec, sword, sscale, j0, m, t, bs, a, accumulate, divisor);
        return;
    }
    if (vec && kind == 2 && (j0 & 7) == 0) {
        decode1_avx512(sec, sword, sscale, j0, m, a, accumulate, divisor);
        return;
    }
#else
    (void)vec;
#endif
    if (!accumulate) {
        decode_tile(kind, sec, sword, sscale, j0, m, t, bs, a);
    } else {
        decode_tile(kind, sec, sword, sscale, j0, m, t, bs, vals);
        acc_add(a, vals, m);
    }
    if (divisor != 1.0f) for (int64_t j = 0; j < m; ++j) a[j] = a[j] / divisor;
}

/* lb_decode, with run k's `len` elements written at address daddr[k] (when daddr is not NULL)
 * instead of out + dst: a segment's average goes straight into its gradient's own tensor */
void lb_decode_at(int kind, const int32_t *src, int64_t stride, int64_t K, const int64_t *runs,
                  int64_t nruns, const int64_t *daddr, float t, int64_t bs, int from_zero, float divisor,
                  float *out) {
    float vals[TILE];
    int vec = simd();
    init_lut();
    for (int64_t k = 0; k < nruns; ++k) {
        const int64_t *r = runs + RUN_COLS * k;
        int64_t sword = r[0], sscale = r[1], c = r[2], dst = r[3], len = r[4];
        int64_t B = bs > 0 ? bs : (c > 0 ? c : 1);
        for (int64_t j0 = 0; j0 < len; j0 += TILE) {
            int64_t m = len - j0 < TILE ? len - j0 : TILE;
            float *a = (daddr ? (float *)(intptr_t)daddr[k] : out + dst) + j0;   /* accumulated in place;
                                                                                   the last source divides */
            for (int64_t q = 0; q < K; ++q) {
                if (q == 0 && from_zero) for (int64_t j = 0; j < m; ++j) a[j] = 0.0f;
                decode_into(vec, kind, src + q * stride, sword, sscale, j0, m, t, B, a, q > 0 || from_zero,
                            q == K - 1 ? divisor : 1.0f, vals);
            }
            if (K == 0) {
                for (int64_t j = 0; j < m; ++j) a[j] = 0.0f;
                if (divisor != 1.0f) for (int64_t j = 0; j < m; ++j) a[j] = a[j] / divisor;
            }
        }
    }
}

void lb_decode(int kind, const int32_t *src, int64_t stride, int64_t K, const int64_t *runs,
               int64_t nruns, float t, int64_t bs, int from_zero, float divisor, float *out) {
    lb_decode_at(kind, src, stride, K, runs, nruns, NULL, t, bs, from_zero, divisor, out);
}

/* Exact fp32 average of K rows: out[j] = (row_0[j] + row_1[j] + ... + row_{K-1}[j]) / divisor,
 * added in row (rank) order whatever the machine's vector width, so every rank that sums the
 * same rows gets the same bits. Row q starts at src + q*stride floats. */
void lb_sum_rows(const float *src, int64_t stride, int64_t K, int64_t n, float divisor, float *out) {
    for (int64_t j0 = 0; j0 < n; j0 += TILE) {
        int64_t m = n - j0 < TILE ? n - j0 : TILE;
        float *a = out + j0;
        if (K <= 0) { for (int64_t j = 0; j < m; ++j) a[j] = 0.0f; continue; }
        memcpy(a, src + j0, (size_t)m * sizeof(float));
        for (int64_t q = 1; q < K; ++q) acc_add(a, src + q * stride + j0, m);
        if (divisor != 1.0f) for (int64_t j = 0; j < m; ++j) a[j] = a[j] / divisor;
    }
}

/* for tests: the canonical sum of x[0..n) (copied, not clobbered) */
float lb_canon_sum(const float *x, int64_t n) {
    float *tmp = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!tmp) return NAN;
    memcpy(tmp, x, (size_t)n * sizeof(float));
    float s = canon_sum_inplace(tmp, n);
    free(tmp);
    return s;
}

/* Exact spans of a flat bucket: the elements one exchange sends in fp32 beside the codes, as
 * rows {start, length, flush} in message order (lowband.codecs.bucket.ExactSpans).
 * lb_gather_spans: dst (consecutive, in span order) = g[start .. start+length), plus e there,
 * which is then zeroed, where flush is set and e is given (g + e in that order: the bits of
 * torch's clone-then-add_). lb_scatter_mean: out[start .. start+length) = the mean of K rows'
 * consecutive values (row q at rows + q*stride floats), span by span in order (a later span
 * overwrites an earlier one where they overlap), with lb_sum_rows' arithmetic: the bits of
 * its mean scattered. */
void lb_gather_spans(const float *g, float *e, const int64_t *spans, int64_t n, float *dst) {
    for (int64_t k = 0; k < n; ++k) {
        int64_t s = spans[3 * k], len = spans[3 * k + 1], flush = spans[3 * k + 2];
        if (flush && e) {
            for (int64_t j = 0; j < len; ++j) { dst[j] = g[s + j] + e[s + j]; e[s + j] = 0.0f; }
        } else if (len > 0) {
            memcpy(dst, g + s, (size_t)len * sizeof(float));
        }
        dst += len;
    }
}

void lb_scatter_mean(const float *rows, int64_t stride, int64_t K, const int64_t *spans, int64_t n,
                     float divisor, float *out) {
    int64_t off = 0;
    for (int64_t k = 0; k < n; ++k) {
        int64_t s = spans[3 * k], len = spans[3 * k + 1];
        lb_sum_rows(rows + off, stride, K, len, divisor, out + s);
        off += len;
    }
}

/* Flag bytes of a message's sections (lowband.comm.plans): lb_write_flags sets
 * bytes [flag_off, section) of each of the `sections` sections of buf (section bytes apart) to
 * `bytes` (S of them) followed by zeros. lb_read_flags reads them from `rows` sections `stride`
 * bytes apart: 0 when every row's S bytes equal `clean` (nothing written), else 1 with
 * present[s] = 1 where some row's byte s is not 0 and bad[r * S + s] = 1 where row r's byte s
 * has a bit of `bad_bit`. */
void lb_write_flags(uint8_t *buf, int64_t sections, int64_t section, int64_t flag_off, int64_t S,
                    const uint8_t *bytes) {
    for (int64_t i = 0; i < sections; ++i) {
        uint8_t *f = buf + i * section + flag_off;
        if (S > 0) memcpy(f, bytes, (size_t)S);
        if (section - flag_off > S) memset(f + S, 0, (size_t)(section - flag_off - S));
    }
}

int lb_read_flags(const uint8_t *buf, int64_t rows, int64_t stride, int64_t flag_off, int64_t S, uint8_t clean,
                  uint8_t bad_bit, uint8_t *present, uint8_t *bad) {
    int dirty = 0;
    for (int64_t r = 0; r < rows && !dirty; ++r) {
        const uint8_t *f = buf + r * stride + flag_off;
        for (int64_t s = 0; s < S; ++s) if (f[s] != clean) { dirty = 1; break; }
    }
    if (!dirty) return 0;
    memset(present, 0, (size_t)S);
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *f = buf + r * stride + flag_off;
        for (int64_t s = 0; s < S; ++s) {
            if (f[s]) present[s] = 1;
            bad[r * S + s] = (f[s] & bad_bit) ? 1 : 0;
        }
    }
    return 1;
}
