/* Weight-only quantised linear layers for x86 CPUs: y[M,N] = x[M,K] . W[N,K]^T (+ bias).
 *
 * Weights are stored in blocks of 32 inputs per output row, as GGUF stores them:
 *   q4: 16 bytes of nibbles per block (byte j holds input j in its low nibble and input j+16
 *       in its high nibble), an fp16 scale d and an fp16 minimum m: w = d * code + m.
 *   q8: 32 signed bytes per block (codes in -127..127) and an fp16 scale d: w = d * code.
 * Activations are quantised per call to s16 per block of 32 (scale dx, and sx = dx * sum(codes)
 * for the q4 minimum), so every product is an integer dot of 32 s16 pairs:
 *   AVX2:        madd (s16 x s16 -> s32 pairs)
 *   AVX512-VNNI: dpwssd on 256-bit registers (the same, accumulating)
 * Results and accumulation across blocks are float32. Threads come from OpenMP; loaded into
 * a process that imported torch first, this shares torch's OpenMP runtime and thread count.
 * The file is compiled at first use, once per instruction set (see native.py).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sys/mman.h>

#define QK 32

int ts_abi_version(void) { return 5; }

/* s16 x s16 products of 16 pairs, summed pairwise into 8 s32 lanes and added to acc. */
#ifdef TS_VNNI
static inline __m256i dot16(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
static inline __m256i dot16(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#endif

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* A q4 block as 32 s16 codes: inputs 0..15 in lo, 16..31 in hi. */
static inline void unpack_q4(const uint8_t *p, __m256i *lo, __m256i *hi) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m128i m = _mm_set1_epi8(0x0F);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m));
}

static inline void unpack_q8(const int8_t *p, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
}

/* Activations are quantised to s16 per block of 32: an error of 1/65534 of the block's largest
 * magnitude, so results match float32 products of the same weights to about 1e-5 (s8
 * activations, as llama.cpp uses, err by ~0.5% per layer: enough to flip near-tied greedy
 * choices of small models). Codes q [M, K], scales dx [M, K/32], sx = dx * sum(codes). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *q, float *dx, float *sx) {
    const int64_t nb = K / QK;
    const __m256 signbit = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * K + b * QK;
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(signbit, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 32767.0f;
            const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i c[4];
            for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
            /* packs interleave 128-bit lanes: restore input order */
            __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
            __m256i bb = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(q + r * K + b * QK), a);
            _mm256_storeu_si256((__m256i *)(q + r * K + b * QK + 16), bb);
            __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* Scratch for quantised activations, grown as needed (one per process: calls come from the
 * engine's one thread; the lock-free reuse is safe because calls do not overlap). */
static int16_t *g_q = NULL;
static float *g_d = NULL;
static int64_t g_cap = 0;

static int ensure_scratch(int64_t elems) {
    if (elems <= g_cap) return 0;
    free(g_q);
    free(g_d);
    g_q = (int16_t *)aligned_alloc(64, (size_t)((2 * elems + 63) / 64 * 64));
    g_d = (float *)malloc(sizeof(float) * (size_t)(2 * (elems / QK + 1)));
    if (!g_q || !g_d) { g_cap = 0; return -1; }
    g_cap = elems;
    return 0;
}

/* S[b] = dx[b] * dw[b] over nb blocks (fp16 weight scales); returns sum_b mw[b] * sx[b] when mw is given. */
static inline float block_scales(const uint16_t *wd, const uint16_t *wm, const float *dx, const float *sx,
                                 int64_t nb, float *S) {
    int64_t b = 0;
    __m256 macc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b)));
        _mm256_storeu_ps(S + b, _mm256_mul_ps(d, _mm256_loadu_ps(dx + b)));
        if (wm) macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b))),
                                       _mm256_loadu_ps(sx + b), macc);
    }
    float m = hsum(macc);
    for (; b < nb; b++) {
        S[b] = dx[b] * h2f(wd[b]);
        if (wm) m += h2f(wm[b]) * sx[b];
    }
    return m;
}

#define MAX_NB 1024  /* K up to 32768 */

/* One tile: MR activation rows x NR weight rows over all K blocks. Per block and pair the work
 * is the integer dot, one conversion and one FMA with the precomputed scale product. */
#define DEFINE_TILE(FMT, WT, UNPACK, WSTRIDE, MR, NR)                                           \
static inline void tile_##FMT##_##MR##x##NR(const int16_t *q, const float *dx, const float *sx, \
        int64_t K, const WT *w, const uint16_t *wd, const uint16_t *wm, int64_t n,               \
        float *y, int64_t ldy) {                                                                 \
    const int64_t nb = K / QK;                                                                   \
    float S[MR][NR][MAX_NB + 24] __attribute__((aligned(32))); /* +24: rows 4 KiB apart alias in L1 */                                        \
    float mt[MR][NR];                                                                            \
    __m256 acc[MR][NR];                                                                          \
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++) {                                  \
        acc[i][j] = _mm256_setzero_ps();                                                         \
        mt[i][j] = block_scales(wd + (n + j) * nb, wm ? wm + (n + j) * nb : NULL,                \
                                dx + i * nb, sx + i * nb, nb, S[i][j]);                          \
    }                                                                                            \
    for (int64_t b = 0; b < nb; b++) {                                                           \
        __m256i wl[NR], wh[NR];                                                                  \
        for (int j = 0; j < NR; j++) UNPACK(w + (n + j) * (WSTRIDE) + b * (QK * (WSTRIDE) / K),  \
                                            &wl[j], &wh[j]);                                     \
        for (int i = 0; i < MR; i++) {                                                           \
            __m256i xl = _mm256_loadu_si256((const __m256i *)(q + i * K + b * QK));              \
            __m256i xh = _mm256_loadu_si256((const __m256i *)(q + i * K + b * QK + 16));         \
            for (int j = 0; j < NR; j++) {                                                       \
                __m256i p = dot16(dot16(_mm256_setzero_si256(), wl[j], xl), wh[j], xh);          \
                acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&S[i][j][b]),                    \
                                            _mm256_cvtepi32_ps(p), acc[i][j]);                   \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++)                                    \
        y[i * ldy + n + j] = hsum(acc[i][j]) + mt[i][j];                                         \
}

#define DEFINE_TILE_Q4(MR, NR) DEFINE_TILE(q4, uint8_t, unpack_q4, K / 2, MR, NR)
#define DEFINE_TILE_Q8(MR, NR) DEFINE_TILE(q8, int8_t, unpack_q8, K, MR, NR)

DEFINE_TILE_Q4(1, 1)
DEFINE_TILE_Q4(4, 2)
DEFINE_TILE_Q8(1, 1)
DEFINE_TILE_Q8(4, 2)

typedef void (*tile_fn)(const int16_t *, const float *, const float *, int64_t, const void *,
                        const uint16_t *, const uint16_t *, int64_t, float *, int64_t);

typedef void (*chunk_fn)(void *ctx, int64_t chunk);

/* Run fn(ctx, 0..n-1) on OpenMP's threads (torch's, when loaded after torch). A chunk-claiming
 * pool of our own, where the caller waits only for claimed chunks, measured slower here
 * (8.5 -> 12.7 ms per token at best, see docs/engine-cpu.md). */
static void pool_run(int64_t n, chunk_fn fn, void *ctx) {
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t c = 0; c < n; c++) fn(ctx, c);
}

typedef struct {
    int kind;
    const int16_t *q;
    const float *dx, *sx, *bias;
    int64_t M, K, N;
    const void *w;
    const uint16_t *wd, *wm;
    float *y;
} linear_job;

#define ROWS_PER_CHUNK 16

/* Rows of x are processed in tiles of 4 (single rows for the tail); weight rows in tiles of
 * 4 for one activation row (decode) or 2 for four rows (prefill: compute bound). A chunk is 16
 * weight rows, so each weight byte is read by one thread. */
static void linear_chunk(void *arg, int64_t t) {
    const linear_job *j = (const linear_job *)arg;
    const int kind = j->kind;
    const int16_t *q = j->q;
    const float *dx = j->dx, *sx = j->sx;
    const int64_t M = j->M, K = j->K, N = j->N, nb = K / QK, m4 = M / 4 * 4;
    const void *w = j->w;
    const uint16_t *wd = j->wd, *wm = j->wm;
    float *y = j->y;
    const int64_t n0 = t * ROWS_PER_CHUNK, n1 = n0 + ROWS_PER_CHUNK < N ? n0 + ROWS_PER_CHUNK : N;
    for (int64_t m = 0; m < m4; m += 4) {
        int64_t n = n0;
        for (; n + 2 <= n1; n += 2) {
            if (kind == 4) tile_q4_4x2(q + m * K, dx + m * nb, sx + m * nb, K, (const uint8_t *)w, wd, wm, n, y + m * N, N);
            else tile_q8_4x2(q + m * K, dx + m * nb, sx + m * nb, K, (const int8_t *)w, wd, wm, n, y + m * N, N);
        }
        for (; n < n1; n++) {
            for (int64_t i = 0; i < 4; i++) {
                if (kind == 4) tile_q4_1x1(q + (m + i) * K, dx + (m + i) * nb, sx + (m + i) * nb, K, (const uint8_t *)w, wd, wm, n, y + (m + i) * N, N);
                else tile_q8_1x1(q + (m + i) * K, dx + (m + i) * nb, sx + (m + i) * nb, K, (const int8_t *)w, wd, wm, n, y + (m + i) * N, N);
            }
        }
    }
    for (int64_t m = m4; m < M; m++) {
        int64_t n = n0;
        /* one weight row at a time: four rows at once ran 1.4x (q4) to 3x (q8) slower per row */
        for (; n < n1; n++) {
            if (kind == 4) tile_q4_1x1(q + m * K, dx + m * nb, sx + m * nb, K, (const uint8_t *)w, wd, wm, n, y + m * N, N);
            else tile_q8_1x1(q + m * K, dx + m * nb, sx + m * nb, K, (const int8_t *)w, wd, wm, n, y + m * N, N);
        }
    }
    if (j->bias) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * N + n] += j->bias[n];
    }
}

static void run_linear(int kind, const float *x, int64_t M, int64_t K, const void *w,
                       const uint16_t *wd, const uint16_t *wm, int64_t N, const float *bias, float *y) {
    const int64_t nb = K / QK;
    if (ensure_scratch(M * K) != 0) return;
    float *dx = g_d, *sx = g_d + M * nb;
    quantize_rows(x, M, K, g_q, dx, sx);
    linear_job j = {kind, g_q, dx, sx, bias, M, K, N, w, wd, wm, y};
    const int64_t nt = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    pool_run(nt, linear_chunk, &j);
}

/* Returns 0, or -1 when K is not a multiple of 32 or scratch memory could not be allocated. */
int ts_linear_q4(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *wd,
                 const uint16_t *wm, int64_t N, const float *bias, float *y) {
    if (K % QK || K / QK > MAX_NB) return -1;
    run_linear(4, x, M, K, w, wd, wm, N, bias, y);
    return g_cap >= M * K ? 0 : -1;
}

int ts_linear_q8(const float *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *wd,
                 int64_t N, const float *bias, float *y) {
    if (K % QK || K / QK > MAX_NB) return -1;
    run_linear(8, x, M, K, w, wd, NULL, N, bias, y);
    return g_cap >= M * K ? 0 : -1;
}

/* ---- the elementwise parts of a decoder layer, for steps of a few rows (decode) ---- */

/* out[r] = w * x[r] / rms(x[r]); when res is given, x[r] += res[r] first (x then holds the sum). */
void ts_add_rms_norm(float *x, const float *res, int64_t M, int64_t K, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M; r++) {
        float *xr = x + r * K;
        if (res) {
            const float *rr = res + r * K;
            for (int64_t i = 0; i < K; i++) xr[i] += rr[i];
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= K; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < K; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        float *o = out + r * K;
        for (int64_t j = 0; j < K; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

/* exp(x) for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial
 * (relative error ~2e-7 over the float range; inputs are clamped to [-88, 88]). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float silu1(float g) { return g / (1.0f + expf(-g)); }

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i] */
void ts_silu_mul(const float *gu, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M * I >= 65536)
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = silu1(g[i]) * u[i];
    }
}

/* Rotate one head [hd] in place (half-split layout) by cos/sin [hd/2]. */
static inline void rope_head(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

typedef struct {
    const float *qkv;
    int64_t nh, nkv, hd, width, group;
    const float *kc, *vc;
    const int64_t *kv_idx, *kv_off;
    float scale;
    float *out;
} attn_job;

static void attn_chunk(void *arg, int64_t job);

/* One decode step's attention for T rows, each the newest token of its own sequence:
 * rope on q and k, the new k/v written to cache slot slot[t], then softmax attention of the
 * row's heads over the cache slots kv_idx[kv_off[t] .. kv_off[t+1]) (grouped-query heads).
 * qkv [T, (nh + 2 nkv) hd] is modified (rotated); caches are [slots, nkv, hd] float32. */
void ts_attn_decode(float *qkv, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                    const float *cos_sin, const int64_t *pos, float *kc, float *vc,
                    const int64_t *slot, const int64_t *kv_idx, const int64_t *kv_off,
                    float scale, float *out) {
    const int64_t half = hd / 2, width = (nh + 2 * nkv) * hd, group = nh / nkv;
    for (int64_t t = 0; t < T; t++) {
        float *q = qkv + t * width, *k = q + nh * hd, *v = k + nkv * hd;
        const float *c = cos_sin + pos[t] * hd, *s = c + half;
        for (int64_t h = 0; h < nh; h++) rope_head(q + h * hd, c, s, half);
        for (int64_t h = 0; h < nkv; h++) rope_head(k + h * hd, c, s, half);
        memcpy(kc + slot[t] * nkv * hd, k, sizeof(float) * (size_t)(nkv * hd));
        memcpy(vc + slot[t] * nkv * hd, v, sizeof(float) * (size_t)(nkv * hd));
    }
    attn_job j = {qkv, nh, nkv, hd, width, group, kc, vc, kv_idx, kv_off, scale, out};
    pool_run(T * nh, attn_chunk, &j);
}

static void attn_chunk(void *arg, int64_t job) {
    const attn_job *aj = (const attn_job *)arg;
    const float *qkv = aj->qkv, *kc = aj->kc, *vc = aj->vc;
    const int64_t nh = aj->nh, nkv = aj->nkv, hd = aj->hd, width = aj->width, group = aj->group;
    const int64_t *kv_idx = aj->kv_idx, *kv_off = aj->kv_off;
    const float scale = aj->scale;
    float *out = aj->out;
    {
        const int64_t t = job / nh, h = job % nh, g = h / group;
        const int64_t n = kv_off[t + 1] - kv_off[t];
        const int64_t *idx = kv_idx + kv_off[t];
        const float *q = qkv + t * width + h * hd;
        float stack[1024];
        float *sc = n <= 1024 ? stack : (float *)malloc(sizeof(float) * (size_t)n);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const float *kr = kc + (idx[j] * nkv + g) * hd;
            __m256 acc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kr + i), acc);
            float d = hsum(acc);
            for (; i < hd; i++) d += q[i] * kr[i];
            sc[j] = d * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
        float *o = out + t * nh * hd + h * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++) {
            const float *vr = vc + (idx[j] * nkv + g) * hd;
            const __m256 p = _mm256_set1_ps(sc[j] * inv);
            int64_t i = 0;
            for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + i), _mm256_loadu_ps(o + i)));
            for (; i < hd; i++) o[i] += sc[j] * inv * vr[i];
        }
        if (sc != stack) free(sc);
    }
}

/* ---- a whole decode step through every layer in one call ---- */

typedef struct {
    int64_t fmt;  /* 4 or 8 */
    int64_t n, k;
    const void *w;
    const uint16_t *d, *m;
    const float *bias;
} ts_qlin;

typedef struct {
    ts_qlin qkv, o, gate_up, down;
    const float *post_norm, *next_norm;
    float *kc, *vc;
} ts_layer;

typedef struct {
    int64_t T, H, nh, nkv, hd;
    const float *cos_sin;
    const int64_t *pos, *slot, *kv_idx, *kv_off;
    float scale, eps;
} ts_step;

static void qlin(const ts_qlin *l, const float *x, int64_t M, float *y) {
    run_linear((int)l->fmt, x, M, l->k, l->w, l->d, l->m, l->n, l->bias, y);
}

/* h [T, H]: the residual stream (updated); x [T, H]: the first layer's normed input on entry,
 * the final norm's output on return. Returns 0, or -1 when scratch memory ran out. */
int ts_decode_layers(const ts_layer *layers, int64_t L, const ts_step *st, float *h, float *x) {
    const int64_t T = st->T, H = st->H;
    int64_t wide = 0;
    for (int64_t l = 0; l < L; l++) {
        const ts_layer *ly = &layers[l];
        int64_t c[4] = {ly->qkv.n, ly->o.k, ly->gate_up.n, ly->down.k};
        for (int i = 0; i < 4; i++) if (c[i] > wide) wide = c[i];
    }
    float *buf = (float *)malloc(sizeof(float) * (size_t)(T * (2 * wide + H)));
    if (!buf) return -1;
    float *a = buf, *b = buf + T * wide, *o = buf + 2 * T * wide;
    for (int64_t l = 0; l < L; l++) {
        const ts_layer *ly = &layers[l];
        qlin(&ly->qkv, x, T, a);
        ts_attn_decode(a, T, st->nh, st->nkv, st->hd, st->cos_sin, st->pos, ly->kc, ly->vc, st->slot,
                       st->kv_idx, st->kv_off, st->scale, b);
        qlin(&ly->o, b, T, o);
        ts_add_rms_norm(h, o, T, H, ly->post_norm, st->eps, x);
        qlin(&ly->gate_up, x, T, a);
        ts_silu_mul(a, T, ly->gate_up.n / 2, b);
        qlin(&ly->down, b, T, o);
        ts_add_rms_norm(h, o, T, H, ly->next_norm, st->eps, x);
    }
    free(buf);
    return g_cap > 0 ? 0 : -1;
}

/* Memory for weights on transparent huge pages where the kernel allows them (madvise mode):
 * a token's decode walks ~100 MB of weights once, and on 4 KiB pages that is a TLB miss per page. */
void *ts_alloc_huge(int64_t bytes) {
    const size_t align = (size_t)2 << 20;
    size_t n = ((size_t)bytes + align - 1) / align * align;
    void *p = aligned_alloc(align, n);
    if (p) madvise(p, n, MADV_HUGEPAGE);
    return p;
}

void ts_free(void *p) { free(p); }
