/* megaformer's native CPU kernels: fp32, contiguous rows, one pass over memory each.
 *
 * Built on first use by megaformer/kernels/native.py with the system C compiler
 * (cc -O3 -march=native -fopenmp) and called through ctypes; the math of each kernel is in that
 * module's docstring. Every kernel takes the thread count (torch.get_num_threads()) and splits its
 * rows (or blocks of 4096 elements) statically over that many OpenMP threads; torch's own libgomp
 * is the one already loaded, so both share one thread pool.
 *
 * Random numbers (dropout) are a counter-based hash of the element index and a 63-bit seed drawn
 * from torch's generator: the mask of element e depends on (seed, e) only, never on the thread
 * count or the order of evaluation.
 */
#include <omp.h>
#include <stdint.h>

typedef int64_t i64;
typedef uint32_t u32;
typedef uint8_t u8;

#define BLOCK 4096

/* exp(x) for x in [-87, 88]: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial,
 * 2^n by the exponent bits. Relative error ~2 ulp; written so that GCC vectorises it. */
static inline float mf_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

static inline float mf_sigmoid(float x) { return 1.0f / (1.0f + mf_exp(-x)); }

/* A bijective 32-bit integer hash (C. Wellons' "lowbias32"). */
static inline u32 mf_hash(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* Uniform 32-bit value of element (block key kb, index lo): two hash rounds. */
static inline u32 mf_random(u32 lo, u32 k0, u32 kb) { return mf_hash(mf_hash(lo ^ k0) + kb); }

/* The per-block key: mixes the high 32 bits of the element index (constant within a block). */
static inline u32 mf_block_key(i64 first, u32 k0, u32 k1) {
    return k1 ^ mf_hash((u32)((uint64_t)first >> 32) + k0);
}

/* ---- SwiGLU of the packed gate/up product y = [g | u] (rows of stride ys) ---- */

void mf_swiglu_fwd(const float *y, float *h, i64 rows, i64 f, i64 ys, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict g = y + r * ys;
        const float *restrict u = g + f;
        float *restrict o = h + r * f;
        for (i64 j = 0; j < f; j++) o[j] = g[j] * mf_sigmoid(g[j]) * u[j];
    }
}

void mf_swiglu_bwd(const float *y, const float *dh, float *dy, i64 rows, i64 f, i64 ys, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict g = y + r * ys;
        const float *restrict u = g + f;
        const float *restrict d = dh + r * f;
        float *restrict dg = dy + r * 2 * f;
        float *restrict du = dg + f;
        for (i64 j = 0; j < f; j++) {
            float s = mf_sigmoid(g[j]);
            float silu = g[j] * s;
            du[j] = d[j] * silu;
            dg[j] = d[j] * u[j] * (s + silu * (1.0f - s));
        }
    }
}

/* ---- Dropout: keep element e iff random(e) >= thr; kept values scaled by `scale` ---- */

void mf_dropout_fwd(const float *x, float *y, u8 *m, i64 n, u32 k0, u32 k1, u32 thr, float scale,
                    int nt) {
    i64 blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 b = 0; b < blocks; b++) {
        i64 first = b * BLOCK, last = first + BLOCK < n ? first + BLOCK : n;
        u32 kb = mf_block_key(first, k0, k1);
        const float *restrict xb = x + first;
        float *restrict yb = y + first;
        u8 *restrict mb = m + first;
        u32 lo = (u32)first;
        for (i64 j = 0; j < last - first; j++) {
            u32 keep = mf_random(lo + (u32)j, k0, kb) >= thr;
            mb[j] = (u8)keep;
            yb[j] = keep ? xb[j] * scale : 0.0f;
        }
    }
}

void mf_masked_scale(const float *x, const u8 *m, float *y, i64 n, float scale, int nt) {
    i64 blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 b = 0; b < blocks; b++) {
        i64 first = b * BLOCK, last = first + BLOCK < n ? first + BLOCK : n;
        const float *restrict xb = x + first;
        const u8 *restrict mb = m + first;
        float *restrict yb = y + first;
        for (i64 j = 0; j < last - first; j++) yb[j] = mb[j] ? xb[j] * scale : 0.0f;
    }
}

/* ---- Attention probabilities: softmax over the allowed keys, then dropout ----
 * s, p, pd: [rows, cols] with rows = batch * heads * t (query i = row % t); with `causal`, key j is
 * allowed iff j <= i + offset (offset = cols - t: bottom-right aligned). p = softmax (0 where not
 * allowed), pd = p * m * scale. */

void mf_softmax_dropout_fwd(const float *s, float *p, float *pd, u8 *m, i64 rows, i64 t, i64 cols,
                            i64 offset, int causal, u32 k0, u32 k1, u32 thr, float scale, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict sr = s + r * cols;
        float *restrict pr = p + r * cols;
        float *restrict dr = pd + r * cols;
        u8 *restrict mr = m + r * cols;
        i64 allowed = cols;
        if (causal) {
            i64 a = r % t + offset + 1;
            allowed = a < 0 ? 0 : (a > cols ? cols : a);
        }
        float mx = -3.0e38f, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (i64 j = 0; j < allowed; j++) mx = sr[j] > mx ? sr[j] : mx;
        for (i64 j = 0; j < allowed; j++) pr[j] = mf_exp(sr[j] - mx);
#pragma omp simd reduction(+ : sum)
        for (i64 j = 0; j < allowed; j++) sum += pr[j];
        float inv = allowed > 0 ? 1.0f / sum : 0.0f;
        for (i64 j = 0; j < allowed; j++) pr[j] *= inv;
        for (i64 j = allowed; j < cols; j++) pr[j] = 0.0f;
        /* dropout, in pieces that do not cross a BLOCK boundary of the element index */
        i64 e0 = r * cols;
        for (i64 c0 = 0, c1; c0 < cols; c0 = c1) {
            i64 first = e0 + c0;
            c1 = (first / BLOCK + 1) * BLOCK - e0;
            c1 = c1 < cols ? c1 : cols;
            u32 kb = mf_block_key(first, k0, k1);
            u32 lo = (u32)first;
            for (i64 j = 0; j < c1 - c0; j++) {
                u32 keep = mf_random(lo + (u32)j, k0, kb) >= thr;
                mr[c0 + j] = (u8)keep;
                dr[c0 + j] = keep ? pr[c0 + j] * scale : 0.0f;
            }
        }
    }
}

/* ds = p (dp - sum_j p_j dp_j) with dp = dpd * m * scale, row by row. */
void mf_softmax_dropout_bwd(const float *p, const u8 *m, const float *dpd, float *ds, i64 rows,
                            i64 cols, float scale, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict pr = p + r * cols;
        const u8 *restrict mr = m + r * cols;
        const float *restrict gr = dpd + r * cols;
        float *restrict out = ds + r * cols;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (i64 j = 0; j < cols; j++) {
            float dp = mr[j] ? gr[j] * scale : 0.0f;
            out[j] = dp;
            dot += pr[j] * dp;
        }
        for (i64 j = 0; j < cols; j++) out[j] = pr[j] * (out[j] - dot);
    }
}

/* ---- Cross-entropy over rows of logits x [rows, stride] whose first v columns are the vocabulary ----
 * lse = log sum_{j<v} exp(x_j), loss = lse - x_t (0 where t == ignore); backward
 * dx_j = g (exp(x_j - lse) - [j == t]) for j < v, 0 in the padding columns and ignored rows. */

void mf_xent_fwd(const float *x, const i64 *tgt, float *loss, float *lse, i64 rows, i64 v, i64 stride,
                 i64 ignore, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict xr = x + r * stride;
        float mx = -3.0e38f, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (i64 j = 0; j < v; j++) mx = xr[j] > mx ? xr[j] : mx;
#pragma omp simd reduction(+ : sum)
        for (i64 j = 0; j < v; j++) sum += mf_exp(xr[j] - mx);
        float l = mx + __builtin_logf(sum);
        lse[r] = l;
        i64 t = tgt[r];
        loss[r] = (t == ignore || t < 0 || t >= v) ? 0.0f : l - xr[t];
    }
}

void mf_xent_bwd(const float *x, const i64 *tgt, const float *lse, float *dx, i64 rows, i64 v,
                 i64 stride, i64 ignore, float g, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict xr = x + r * stride;
        float *restrict dr = dx + r * stride;
        i64 t = tgt[r];
        if (t == ignore || t < 0 || t >= v) {
            for (i64 j = 0; j < stride; j++) dr[j] = 0.0f;
            continue;
        }
        float l = lse[r];
        for (i64 j = 0; j < v; j++) dr[j] = g * mf_exp(xr[j] - l);
        for (i64 j = v; j < stride; j++) dr[j] = 0.0f;
        dr[t] -= g;
    }
}

/* ---- RMSNorm over rows of width n: r = 1 / sqrt(|x|^2 / n + eps), y = x r w ----
 * backward: g = dy w, dx = r g - x r^3 (g . x) / n, dw = sum_rows dy x r (per-thread partial sums in
 * `work` [nt, n], then added in thread order: deterministic for a given thread count). */

void mf_rmsnorm_fwd(const float *x, const float *w, float *y, float *rstd, i64 rows, i64 n, float eps,
                    int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float *restrict xr = x + r * n;
        float *restrict yr = y + r * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (i64 j = 0; j < n; j++) ss += xr[j] * xr[j];
        float inv = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
        rstd[r] = inv;
        for (i64 j = 0; j < n; j++) yr[j] = xr[j] * inv * w[j];
    }
}

void mf_rmsnorm_bwd(const float *x, const float *w, const float *rstd, const float *dy, float *dx,
                    float *dw, float *work, i64 rows, i64 n, int nt) {
    int team = 1;
#pragma omp parallel num_threads(nt)
    {
        int tid = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        float *restrict acc = work + (i64)tid * n;
        for (i64 j = 0; j < n; j++) acc[j] = 0.0f;
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; r++) {
            const float *restrict xr = x + r * n;
            const float *restrict dr = dy + r * n;
            float *restrict out = dx + r * n;
            float inv = rstd[r], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (i64 j = 0; j < n; j++) dot += dr[j] * w[j] * xr[j];
            float c = dot * inv * inv * inv / (float)n;
            for (i64 j = 0; j < n; j++) {
                out[j] = inv * dr[j] * w[j] - c * xr[j];
                acc[j] += dr[j] * xr[j] * inv;
            }
        }
    }
    for (i64 j = 0; j < n; j++) dw[j] = 0.0f;
    for (int k = 0; k < team; k++)
        for (i64 j = 0; j < n; j++) dw[j] += work[(i64)k * n + j];
}

/* ---- RoPE of x [b, t, h, d] (element strides sb, st, sh; last dimension contiguous) into a
 * contiguous y [b, t, h, d], by the half tables c, s [t, d/2] (pass -s for the backward):
 * y1 = x1 c - x2 s, y2 = x2 c + x1 s for the halves x1, x2 of each head. */

void mf_rope(const float *x, const float *c, const float *s, float *y, i64 b, i64 t, i64 h, i64 d,
             i64 sb, i64 st, i64 sh, int nt) {
    i64 half = d / 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 row = 0; row < b * t; row++) {
        i64 bi = row / t, ti = row % t;
        const float *restrict cr = c + ti * half;
        const float *restrict sr = s + ti * half;
        for (i64 hi = 0; hi < h; hi++) {
            const float *restrict x1 = x + bi * sb + ti * st + hi * sh;
            const float *restrict x2 = x1 + half;
            float *restrict y1 = y + (row * h + hi) * d;
            float *restrict y2 = y1 + half;
            for (i64 i = 0; i < half; i++) {
                y1[i] = x1[i] * cr[i] - x2[i] * sr[i];
                y2[i] = x2[i] * cr[i] + x1[i] * sr[i];
            }
        }
    }
}
