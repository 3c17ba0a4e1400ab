/*
 * Decode kernels for bfloat16 on CPU: paged decode attention read in place from the KV pool,
 * and a matrix product for decode of one or two sequences (at the end).
 *
 * One query token per sequence attends every cached token of its sequence. A sequence's
 * tokens sit in KV blocks named by its block table (token t in block table[t / tpb], row
 * t % tpb); a block's rows hold [kv_heads, head_dim] elements, rows kv_heads * head_dim
 * apart, blocks block_stride elements apart (the pool keeps every layer in a block, so the
 * caller passes the K and V base pointers of one layer).
 *
 * Work items are (sequence, kv head) pairs, shared by OpenMP threads (the process's own
 * OpenMP runtime: PyTorch's, when it is loaded first). Each item reads its K rows once
 * (scores for the kv head's `group` query heads), takes the softmax in float32 and reads its
 * V rows once, accumulating in float32. No allocation beyond one float32 score buffer per
 * thread.
 *
 * Two code paths: AVX512-BF16 (dot products with vdpbf16ps, head_dim 64 or 128) and portable
 * C for any head_dim up to 256 (the compiler vectorizes it). The Python side
 * (talaria/engine/kernels.py) validates every index before calling: this code trusts them.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HD 256

typedef struct {
    const uint16_t *q;      /* [n, kv_heads * group, hd] rows q_stride apart */
    int64_t q_stride;
    const uint16_t *k;      /* this layer's K in block 0 */
    const uint16_t *v;      /* this layer's V in block 0 */
    int64_t block_stride;   /* elements between blocks */
    const int64_t *tables;  /* [n, max_blocks] */
    int64_t max_blocks;
    const int64_t *ctxs;    /* [n] tokens to attend per sequence */
    int64_t n;
    int tpb, kvh, hd, group;
    float scale;
    uint16_t *out;          /* [n, kv_heads * group, hd] contiguous */
} Args;

static inline float bf2f(uint16_t b) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)b << 16;
    return x.f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u); /* NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

static inline const uint16_t *row(const Args *a, const uint16_t *base, const int64_t *table,
                                  int64_t t, int h) {
    return base + table[t / a->tpb] * a->block_stride + ((t % a->tpb) * a->kvh + h) * a->hd;
}

/* Softmax numerators in place over each head's ctx scores; returns nothing, fills sums. */
static void softmax_rows(float *scores, int64_t ctx, int group, const float *mx, float *sums) {
    for (int g = 0; g < group; g++) {
        float *sc = scores + g * ctx, acc = 0.f, m = mx[g];
        for (int64_t t = 0; t < ctx; t++) {
            float e = expf(sc[t] - m);
            sc[t] = e;
            acc += e;
        }
        sums[g] = acc;
    }
}

static void item_generic(const Args *a, int64_t s, int h, float *scores) {
    const int hd = a->hd, group = a->group;
    const int64_t ctx = a->ctxs[s];
    const int64_t *table = a->tables + s * a->max_blocks;
    float qf[MAX_GROUP][MAX_HD], acc[MAX_GROUP][MAX_HD], row_f[MAX_HD], mx[MAX_GROUP], sums[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        const uint16_t *q = a->q + s * a->q_stride + (int64_t)(h * group + g) * hd;
        for (int d = 0; d < hd; d++) qf[g][d] = bf2f(q[d]);
        mx[g] = -FLT_MAX;
    }
    for (int64_t t = 0; t < ctx; t++) {
        const uint16_t *k = row(a, a->k, table, t, h);
        for (int d = 0; d < hd; d++) row_f[d] = bf2f(k[d]);
        for (int g = 0; g < group; g++) {
            float dot = 0.f;
            for (int d = 0; d < hd; d++) dot += qf[g][d] * row_f[d];
            dot *= a->scale;
            scores[g * ctx + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
        }
    }
    softmax_rows(scores, ctx, group, mx, sums);
    for (int g = 0; g < group; g++) memset(acc[g], 0, sizeof(float) * hd);
    for (int64_t t = 0; t < ctx; t++) {
        const uint16_t *v = row(a, a->v, table, t, h);
        for (int d = 0; d < hd; d++) row_f[d] = bf2f(v[d]);
        for (int g = 0; g < group; g++) {
            float p = scores[g * ctx + t];
            for (int d = 0; d < hd; d++) acc[g][d] += p * row_f[d];
        }
    }
    for (int g = 0; g < group; g++) {
        uint16_t *o = a->out + (s * a->kvh * group + (int64_t)h * group + g) * hd;
        float inv = 1.f / sums[g];
        for (int d = 0; d < hd; d++) o[d] = f2bf(acc[g][d] * inv);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TALARIA_AVX512BF16 1

/* lane j of the result = the sum of the 16 lanes of x[j] (a transpose-and-add tree). */
static inline __m512 sum16(const __m512 x[16]) {
    __m512 v[8], w[4], y[2];
    for (int i = 0; i < 8; i++)
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* Ask for the rows of tokens [t, t + m) of one head before they are needed. */
static inline void prefetch_rows(const uint16_t *first, int64_t m, int64_t tstride, int hd) {
    for (int64_t j = 0; j < m; j++)
        for (int b = 0; b < hd * 2; b += 64) _mm_prefetch((const char *)(first + j * tstride) + b, _MM_HINT_T0);
}

/* One (sequence, kv head) item for head_dim HD (a multiple of 32), AVX512-BF16. Scores of
 * 16 tokens at a time: 16 dot-product vectors reduced together by sum16. */
#define DEFINE_ITEM_AVX(HD)                                                                  \
    static void item_avx_##HD(const Args *a, int64_t s, int h, float *scores) {              \
        enum { KC = HD / 32, VC = HD / 16 };                                                 \
        const int group = a->group, tpb = a->tpb;                                            \
        const int64_t ctx = a->ctxs[s], tstride = (int64_t)a->kvh * HD;                      \
        const int64_t *table = a->tables + s * a->max_blocks;                                \
        const int64_t nblocks = (ctx + tpb - 1) / tpb;                                       \
        __m512i qv[MAX_GROUP][KC];                                                           \
        __m512 mxv[MAX_GROUP];                                                               \
        float mx[MAX_GROUP], sums[MAX_GROUP];                                                \
        for (int g = 0; g < group; g++) {                                                    \
            const uint16_t *q = a->q + s * a->q_stride + (int64_t)(h * group + g) * HD;      \
            for (int c = 0; c < KC; c++) qv[g][c] = _mm512_loadu_si512(q + 32 * c);          \
            mxv[g] = _mm512_set1_ps(-FLT_MAX);                                               \
        }                                                                                    \
        const __m512 scale = _mm512_set1_ps(a->scale);                                       \
        for (int64_t b = 0; b < nblocks; b++) {                                              \
            const uint16_t *kb = a->k + table[b] * a->block_stride + h * HD;                 \
            if (b + 1 < nblocks)                                                             \
                prefetch_rows(a->k + table[b + 1] * a->block_stride + h * HD, tpb, tstride, HD); \
            const int64_t t_end = (b + 1) * tpb < ctx ? (b + 1) * tpb : ctx;                 \
            for (int64_t t0 = b * tpb; t0 < t_end; t0 += 16) {                               \
                const int m = t_end - t0 < 16 ? (int)(t_end - t0) : 16;                      \
                const __mmask16 live = (__mmask16)((1u << m) - 1u);                          \
                const uint16_t *k0 = kb + (t0 - b * tpb) * tstride;                          \
                for (int g = 0; g < group; g++) {                                            \
                    __m512 x[16];                                                            \
                    for (int j = 0; j < 16; j++) {                                           \
                        __m512 d = _mm512_setzero_ps();                                      \
                        if (j < m)                                                           \
                            for (int c = 0; c < KC; c++)                                     \
                                d = _mm512_dpbf16_ps(d, (__m512bh)qv[g][c],                  \
                                    (__m512bh)_mm512_loadu_si512(k0 + j * tstride + 32 * c)); \
                        x[j] = d;                                                            \
                    }                                                                        \
                    __m512 sc = _mm512_mul_ps(sum16(x), scale);                              \
                    _mm512_mask_storeu_ps(scores + g * ctx + t0, live, sc);                  \
                    mxv[g] = _mm512_mask_max_ps(mxv[g], live, mxv[g], sc);                   \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < group; g++) mx[g] = _mm512_reduce_max_ps(mxv[g]);                \
        softmax_rows(scores, ctx, group, mx, sums);                                          \
        __m512 acc[MAX_GROUP][VC];                                                           \
        for (int g = 0; g < group; g++)                                                      \
            for (int c = 0; c < VC; c++) acc[g][c] = _mm512_setzero_ps();                    \
        for (int64_t b = 0; b < nblocks; b++) {                                              \
            const uint16_t *vb = a->v + table[b] * a->block_stride + h * HD;                 \
            if (b + 1 < nblocks)                                                             \
                prefetch_rows(a->v + table[b + 1] * a->block_stride + h * HD, tpb, tstride, HD); \
            const int64_t t_end = (b + 1) * tpb < ctx ? (b + 1) * tpb : ctx;                 \
            for (int64_t t = b * tpb; t < t_end; t++) {                                      \
                const uint16_t *v = vb + (t - b * tpb) * tstride;                            \
                __m512 vf[VC];                                                               \
                for (int c = 0; c < VC; c++) {                                               \
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 16 * c));         \
                    vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); \
                }                                                                            \
                for (int g = 0; g < group; g++) {                                            \
                    __m512 p = _mm512_set1_ps(scores[g * ctx + t]);                          \
                    for (int c = 0; c < VC; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < group; g++) {                                                    \
            uint16_t *o = a->out + (s * a->kvh * group + (int64_t)h * group + g) * HD;       \
            __m512 inv = _mm512_set1_ps(1.f / sums[g]);                                      \
            float tmp[HD];                                                                   \
            for (int c = 0; c < VC; c++) _mm512_storeu_ps(tmp + 16 * c, _mm512_mul_ps(acc[g][c], inv)); \
            for (int d = 0; d < HD; d++) o[d] = f2bf(tmp[d]);                                \
        }                                                                                    \
    }

DEFINE_ITEM_AVX(64)
DEFINE_ITEM_AVX(128)

/* Y[m] = W X[m] (+ bias) for m < M <= 2 bf16 rows of X: a tile is R = 16 / MP rows of W
 * (MP = M) times MP rows of X, 16 dot products accumulated by
 * vdpbf16ps over 32-element chunks and reduced together by sum16. Loop bounds are
 * compile-time constants (one function per MP) so the 16 accumulators stay in registers;
 * rows past the end of W or of X are read as row 0 and their results dropped. Streams W once
 * per call: batch-1 and -2 decode are this, bound by memory bandwidth. (Tiles for 4 and 8
 * rows were slower than PyTorch's oneDNN product here: 10.4 and 8.4 GB/s against 18.6 and
 * 11.3; for 1 row 16 ms against 20-23 ms for SmolLM2's weights.) */
#define DEFINE_GEMM_SMALL(MP)                                                                \
    static void gemm_small_##MP(const uint16_t *w, int64_t w_stride, const uint16_t *x,      \
                                int64_t x_stride, int m_rows, const uint16_t *bias,          \
                                int64_t rows, int64_t k, int threads, uint16_t *y) {         \
        enum { R = 16 / MP };                                                                \
        const int64_t kc = k / 32, tiles = (rows + R - 1) / R;                               \
        _Pragma("omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)")  \
        for (int64_t tile = 0; tile < tiles; tile++) {                                       \
            const int64_t r0 = tile * R;                                                     \
            const int live = rows - r0 < R ? (int)(rows - r0) : R;                           \
            const uint16_t *wr[R], *xr[MP];                                                  \
            for (int r = 0; r < R; r++) wr[r] = w + (r0 + (r < live ? r : 0)) * w_stride;    \
            for (int m = 0; m < MP; m++) xr[m] = x + (m < m_rows ? m : 0) * x_stride;        \
            __m512 acc[16];                                                                  \
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                       \
            for (int64_t c = 0; c < kc; c++) {                                               \
                __m512i xv[MP];                                                              \
                for (int m = 0; m < MP; m++) xv[m] = _mm512_loadu_si512(xr[m] + 32 * c);     \
                for (int r = 0; r < R; r++) {                                                \
                    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + 32 * c);        \
                    for (int m = 0; m < MP; m++)                                             \
                        acc[r * MP + m] = _mm512_dpbf16_ps(acc[r * MP + m], wv, (__m512bh)xv[m]); \
                }                                                                            \
            }                                                                                \
            float out[16];                                                                   \
            _mm512_storeu_ps(out, sum16(acc));                                               \
            for (int r = 0; r < live; r++) {                                                 \
                const float b = bias != NULL ? bf2f(bias[r0 + r]) : 0.f;                     \
                for (int m = 0; m < m_rows; m++) y[m * rows + r0 + r] = f2bf(out[r * MP + m] + b); \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_GEMM_SMALL(1)
DEFINE_GEMM_SMALL(2)
#else
#define TALARIA_AVX512BF16 0
#endif

/* Y[M, rows] = X[M, k] W[rows, k]^T (+ bias), 1 <= M <= 2, bf16 in and out, float32
 * accumulation; W's rows are w_stride elements apart, X's x_stride. Returns 0, or -1 where
 * this build has no such kernel (no AVX512-BF16), M is out of range or k is not a multiple
 * of 32 (nothing is written then). */
int talaria_gemm_small_bf16(const uint16_t *w, int64_t w_stride, const uint16_t *x,
                            int64_t x_stride, int m_rows, const uint16_t *bias, int64_t rows,
                            int64_t k, int threads, uint16_t *y) {
#if TALARIA_AVX512BF16
    if (k % 32 != 0 || k <= 0 || rows <= 0 || m_rows < 1 || m_rows > 2) return -1;
    if (m_rows == 1) gemm_small_1(w, w_stride, x, x_stride, m_rows, bias, rows, k, threads, y);
    else gemm_small_2(w, w_stride, x, x_stride, m_rows, bias, rows, k, threads, y);
    return 0;
#else
    (void)w, (void)w_stride, (void)x, (void)x_stride, (void)m_rows, (void)bias, (void)rows;
    (void)k, (void)threads, (void)y;
    return -1;
#endif
}

/* 1 when this build uses AVX512-BF16 for head_dim 64 and 128, else 0. */
int talaria_paged_decode_avx512bf16(void) { return TALARIA_AVX512BF16; }

/* Attention of n single-token queries over their paged bf16 KV. Returns 0; -1 when group
 * or head_dim exceed this build's limits (nothing is written then); -2 when a thread could
 * not allocate its score buffer (the output is incomplete). */
int talaria_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                              const uint16_t *v, int64_t block_stride, const int64_t *tables,
                              int64_t max_blocks, const int64_t *ctxs, int64_t n, int tpb,
                              int kvh, int hd, int group, float scale, int threads,
                              uint16_t *out) {
    if (group < 1 || group > MAX_GROUP || hd < 1 || hd > MAX_HD) return -1;
    Args a = {q, q_stride, k, v, block_stride, tables, max_blocks, ctxs, n,
              tpb, kvh, hd, group, scale, out};
    int64_t widest = 0;
    int failed = 0;
    for (int64_t s = 0; s < n; s++) widest = ctxs[s] > widest ? ctxs[s] : widest;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(widest * group + 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n * kvh; i++) {
            if (scores == NULL) continue;
            int64_t s = i / kvh;
            int h = (int)(i % kvh);
#if TALARIA_AVX512BF16
            if (hd == 64) item_avx_64(&a, s, h, scores);
            else if (hd == 128) item_avx_128(&a, s, h, scores);
            else item_generic(&a, s, h, scores);
#else
            item_generic(&a, s, h, scores);
#endif
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
