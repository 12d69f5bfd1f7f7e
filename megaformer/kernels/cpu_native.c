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
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

/* ---- Small GEMMs for the attention kernels ----
 * C[4][16] (+)= A[4][K] B[K][16] with A[r][k] at A + r ars + k aks (so A^T is a stride swap), B rows
 * ldb apart, C rows ldc apart: AVX2+FMA intrinsics with 8 accumulators in registers; plain C
 * elsewhere. */
static inline void mk_4x16(i64 K, const float *A, i64 ars, i64 aks, const float *Bm, i64 ldb, float *C,
                           i64 ldc, int zero) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 c[4][2];
    for (int r = 0; r < 4; r++) {
        c[r][0] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(C + r * ldc);
        c[r][1] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(C + r * ldc + 8);
    }
    for (i64 k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(Bm + k * ldb), b1 = _mm256_loadu_ps(Bm + k * ldb + 8);
        for (int r = 0; r < 4; r++) {
            __m256 a = _mm256_broadcast_ss(A + r * ars + k * aks);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(C + r * ldc, c[r][0]);
        _mm256_storeu_ps(C + r * ldc + 8, c[r][1]);
    }
#else
    float c[4][16];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 16; j++) c[r][j] = zero ? 0.0f : C[r * ldc + j];
    for (i64 k = 0; k < K; k++)
        for (int r = 0; r < 4; r++) {
            float a = A[r * ars + k * aks];
            for (int j = 0; j < 16; j++) c[r][j] += a * Bm[k * ldb + j];
        }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 16; j++) C[r * ldc + j] = c[r][j];
#endif
}

/* C[M][N] (+)= A[M][K] B[K][N] (A strided as above), M % 4 == 0, N % 16 == 0 */
static void mm_small(i64 M, i64 N, i64 K, const float *A, i64 ars, i64 aks, const float *Bm, i64 ldb,
                     float *C, i64 ldc, int zero) {
    for (i64 i = 0; i < M; i += 4)
        for (i64 j = 0; j < N; j += 16) mk_4x16(K, A + i * ars, ars, aks, Bm + j, ldb, C + i * ldc + j, ldc, zero);
}

/* ---- Causal / full attention for small head dimensions (FlashAttention-2's algorithm) ----
 * q [b, h, t, d] (strides qs_), k, v [b, hk, s, d] (strides), d contiguous, d % 16 == 0; query head
 * hi reads key/value head hi / (h / hk). o is written [b, t, h, d] (contiguous), lse [b, h, t].
 * One work unit = one (batch, key/value head): it packs K^T, V (and for backward K, V^T) once and
 * runs all the query heads sharing them, so dK, dV and dQ are private to the unit. */

#define BQ 32
#define BK 64

static float *mf_alloc(i64 n) { return (float *)aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64)); }

/* packed copies of one (batch, kv head): kt [d][sp] = K^T, kr [sp][d] = K (same for V), zero padded */
static void mf_pack(const float *x, i64 xs, i64 s, i64 sp, i64 d, float *rows, float *cols) {
    for (i64 j = 0; j < sp; j++)
        for (i64 c = 0; c < d; c++) {
            float val = j < s ? x[j * xs + c] : 0.0f;
            if (rows) rows[j * d + c] = val;
            if (cols) cols[c * sp + j] = val;
        }
}

/* p[i][j] = exp(sc[i][j] - base[i]) for allowed keys (j < lim_i), else 0 */
static inline i64 mf_limit(int causal, i64 i, i64 off, i64 j0, i64 nk) {
    i64 lim = causal ? i + off - j0 + 1 : nk;
    return lim > nk ? nk : (lim < 0 ? 0 : lim);
}

void mf_flash_fwd(const float *q, const float *k, const float *v, float *o, float *lse, i64 B, i64 H,
                  i64 HK, i64 T, i64 S, i64 D, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb,
                  i64 vh, i64 vt, float scale, int causal, int nt) {
    i64 G = H / HK, off = S - T, sp = (S + BK - 1) / BK * BK;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (i64 u = 0; u < B * HK; u++) {
        i64 bi = u / HK, hk = u % HK;
        float *ktr = mf_alloc(D * sp), *vr = mf_alloc(sp * D), *qs = mf_alloc(BQ * D),
              *acc = mf_alloc(BQ * D), *sc = mf_alloc(BQ * BK);
        float m[BQ], l[BQ];
        mf_pack(k + bi * kb + hk * kh, kt, S, sp, D, 0, ktr);
        mf_pack(v + bi * vb + hk * vh, vt, S, sp, D, vr, 0);
        for (i64 hi = hk * G; hi < hk * G + G; hi++) {
            const float *qp = q + bi * qb + hi * qh;
            for (i64 i0 = 0; i0 < T; i0 += BQ) {
                i64 nq = T - i0 < BQ ? T - i0 : BQ;
                for (i64 i = 0; i < BQ; i++) {
                    m[i] = -3.0e38f;
                    l[i] = 0.0f;
                    for (i64 c = 0; c < D; c++) {
                        qs[i * D + c] = i < nq ? qp[(i0 + i) * qt + c] * scale : 0.0f;
                        acc[i * D + c] = 0.0f;
                    }
                }
                i64 jend = causal ? i0 + nq + off : S;
                jend = jend > S ? S : jend;
                for (i64 j0 = 0; j0 < jend; j0 += BK) {
                    i64 nk = jend - j0 < BK ? jend - j0 : BK;
                    mm_small(BQ, BK, D, qs, D, 1, ktr + j0, sp, sc, BK, 1);
                    for (i64 i = 0; i < BQ; i++) {
                        float *srow = sc + i * BK;
                        i64 lim = i < nq ? mf_limit(causal, i0 + i, off, j0, nk) : 0;
                        float mx = m[i];
#pragma omp simd reduction(max : mx)
                        for (i64 j = 0; j < lim; j++) mx = srow[j] > mx ? srow[j] : mx;
                        float corr = mf_exp(m[i] - mx), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                        for (i64 j = 0; j < lim; j++) {
                            float e = mf_exp(srow[j] - mx);
                            srow[j] = e;
                            sum += e;
                        }
                        for (i64 j = lim; j < BK; j++) srow[j] = 0.0f;
                        l[i] = l[i] * corr + sum;
                        m[i] = mx;
                        for (i64 c = 0; c < D; c++) acc[i * D + c] *= corr;
                    }
                    mm_small(BQ, D, BK, sc, BK, 1, vr + j0 * D, D, acc, D, 0);
                }
                for (i64 i = 0; i < nq; i++) {
                    float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                    float *oi = o + ((bi * T + i0 + i) * H + hi) * D;
                    for (i64 c = 0; c < D; c++) oi[c] = acc[i * D + c] * inv;
                    lse[(bi * H + hi) * T + i0 + i] = l[i] > 0.0f ? m[i] + __builtin_logf(l[i]) : 3.0e38f;
                }
            }
        }
        free(ktr); free(vr); free(qs); free(acc); free(sc);
    }
}

/* dq [b, t, h, d], dk, dv [b, s, hk, d] (contiguous); do_ with strides like q; o, lse from forward */
void mf_flash_bwd(const float *q, const float *k, const float *v, const float *o, const float *lse,
                  const float *dout, float *dq, float *dk, float *dv, i64 B, i64 H, i64 HK, i64 T, i64 S,
                  i64 D, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb, i64 vh, i64 vt, i64 gb,
                  i64 gh, i64 gt, float scale, int causal, int nt) {
    i64 G = H / HK, off = S - T, sp = (S + BK - 1) / BK * BK;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (i64 u = 0; u < B * HK; u++) {
        i64 bi = u / HK, hk = u % HK;
        float *ktr = mf_alloc(D * sp), *kr = mf_alloc(sp * D), *vtr = mf_alloc(D * sp),
              *dka = mf_alloc(sp * D), *dva = mf_alloc(sp * D), *qs = mf_alloc(BQ * D),
              *gs = mf_alloc(BQ * D), *dqa = mf_alloc(BQ * D), *p = mf_alloc(BQ * BK),
              *dp = mf_alloc(BQ * BK);
        float di[BQ], li[BQ];
        mf_pack(k + bi * kb + hk * kh, kt, S, sp, D, kr, ktr);
        mf_pack(v + bi * vb + hk * vh, vt, S, sp, D, 0, vtr);
        for (i64 j = 0; j < sp * D; j++) { dka[j] = 0.0f; dva[j] = 0.0f; }
        for (i64 hi = hk * G; hi < hk * G + G; hi++) {
            const float *qp = q + bi * qb + hi * qh, *gp = dout + bi * gb + hi * gh;
            for (i64 i0 = 0; i0 < T; i0 += BQ) {
                i64 nq = T - i0 < BQ ? T - i0 : BQ;
                for (i64 i = 0; i < BQ; i++) {
                    float dot = 0.0f;
                    const float *oi = o + ((bi * T + i0 + i) * H + hi) * D;
                    for (i64 c = 0; c < D; c++) {
                        float g = i < nq ? gp[(i0 + i) * gt + c] : 0.0f;
                        qs[i * D + c] = i < nq ? qp[(i0 + i) * qt + c] * scale : 0.0f;
                        gs[i * D + c] = g;
                        dqa[i * D + c] = 0.0f;
                        dot += i < nq ? g * oi[c] : 0.0f;
                    }
                    di[i] = dot;
                    li[i] = i < nq ? lse[(bi * H + hi) * T + i0 + i] : 0.0f;
                }
                i64 jend = causal ? i0 + nq + off : S;
                jend = jend > S ? S : jend;
                for (i64 j0 = 0; j0 < jend; j0 += BK) {
                    i64 nk = jend - j0 < BK ? jend - j0 : BK;
                    mm_small(BQ, BK, D, qs, D, 1, ktr + j0, sp, p, BK, 1);        /* S = (scale Q) K^T */
                    mm_small(BQ, BK, D, gs, D, 1, vtr + j0, sp, dp, BK, 1);       /* dP = dO V^T */
                    for (i64 i = 0; i < BQ; i++) {
                        i64 lim = i < nq ? mf_limit(causal, i0 + i, off, j0, nk) : 0;
                        float *pr = p + i * BK, *dr = dp + i * BK;
                        for (i64 j = 0; j < lim; j++) {
                            float e = mf_exp(pr[j] - li[i]);                     /* P */
                            dr[j] = e * (dr[j] - di[i]);                         /* dS = P (dP - D_i) */
                            pr[j] = e;
                        }
                        for (i64 j = lim; j < BK; j++) pr[j] = dr[j] = 0.0f;
                    }
                    mm_small(BK, D, BQ, p, 1, BK, gs, D, dva + j0 * D, D, 0);     /* dV += P^T dO */
                    mm_small(BQ, D, BK, dp, BK, 1, kr + j0 * D, D, dqa, D, 0);    /* dQ += dS K */
                    mm_small(BK, D, BQ, dp, 1, BK, qs, D, dka + j0 * D, D, 0);    /* dK += dS^T (scale Q) */
                }
                for (i64 i = 0; i < nq; i++) {
                    float *row = dq + ((bi * T + i0 + i) * H + hi) * D;
                    for (i64 c = 0; c < D; c++) row[c] = dqa[i * D + c] * scale;
                }
            }
        }
        for (i64 j = 0; j < S; j++) {
            float *kj = dk + ((bi * S + j) * HK + hk) * D, *vj = dv + ((bi * S + j) * HK + hk) * D;
            for (i64 c = 0; c < D; c++) { kj[c] = dka[j * D + c]; vj[c] = dva[j * D + c]; }
        }
        free(ktr); free(kr); free(vtr); free(dka); free(dva); free(qs); free(gs); free(dqa);
        free(p); free(dp);
    }
}
