/* Integer-dot weight-only matmuls for the CPU decode path: int4 / int8 weights times int8
 * activations, the scheme of llama.cpp's Q4_1 x Q8_1 (written from the maths, not its code).
 *
 * Each call quantizes every activation row once, in blocks of 32 inputs (qx = round(x / dx),
 * dx = max|x| / 127, |qx| <= 127), then per weight block multiplies bytes with integer SIMD and
 * applies the scales in float:
 *   int4 (w = q * s + m, q in 0..15; qgemm.c's nibble order, (s, m) as float16 pairs: GGUF
 *   Q4_1's own d and m, 20 bytes a block of 32 as in the file, where qgemm.c reads 24):
 *     y[t, n] = sum_g s[n,g] * dx[t,g] * (q[n,g] . qx[t,g]) + m[n,g] * dx[t,g] * sum(qx[t,g])
 *   int8 (w = q * scale[n], q in -127..127):
 *     y[t, n] = scale[n] * sum_g dx[t,g] * (q[n,g] . qx[t,g])
 * The integer dot products are exact; only the per-block float sums round. A row's result
 * depends on that row alone, in a fixed order, whatever T or the thread count (what
 * --enable-deterministic-inference needs). int8 weights keep qgemm.c's layout.
 *
 * The inner loop is picked at compile time (native.py builds with -march=native):
 *   __AVX512VNNI__ (and BW/VL): vpdpbusd on 64 bytes = two blocks per instruction;
 *   __AVXVNNI__ / __AVX2__: 32 bytes a block, vpdpbusd or vpmaddubsw + vpmaddwd;
 *   otherwise (or with -DLM_QDOT_PORTABLE): plain C the compiler may vectorize.
 * -DLM_QDOT_NO_AVX512 skips the first, so tests exercise the AVX2 path on AVX-512 machines.
 * All tensors are row-major and contiguous; K is a multiple of 32 (callers check).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(LM_QDOT_PORTABLE) && !defined(LM_QDOT_NO_AVX512) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#define LM_QDOT_512 1
#elif !defined(LM_QDOT_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define LM_QDOT_256 1
#endif
#if defined(LM_QDOT_512) || defined(LM_QDOT_256)
#include <immintrin.h>
#endif

#define QB 32          /* inputs per block */

/* IEEE half -> float (normals, subnormals, zeros, inf/nan), for the builds without F16C. */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        float f = (float)man * (1.0f / 16777216.0f);  /* man * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* (s, m) of block g from float16 pairs sm [G, 2] */
#if defined(__F16C__) && !defined(LM_QDOT_PORTABLE)
#include <immintrin.h>
static inline void sm_at(const uint16_t *sm, int g, float *s, float *m) {
    uint32_t two;
    memcpy(&two, sm + 2 * g, 4);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));
    *s = _mm_cvtss_f32(v);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(v));
}
#else
static inline void sm_at(const uint16_t *sm, int g, float *s, float *m) {
    *s = h2f(sm[2 * g]);
    *m = h2f(sm[2 * g + 1]);
}
#endif
#define T_CHUNK 64     /* activation rows per pass over the weights (their int8 copy stays in L2) */

/* Per-call activation scratch: qx int8 [T, K], aux float [T, G, 2] = (dx, dx * sum(qx)) per
 * block (the int4 layout's (scale, zmin) pairs line up with it), corr int32 [T, K/4] = -128 *
 * the sum of each 4 consecutive qx (the AVX-512 int8 path's offset, see q8_dot). */
typedef struct {
    int8_t *qx;
    float *aux;
    int32_t *corr;
} act_t;

/* The order of qx within a block pair for the AVX-512 int4 path: the 64-byte register of two
 * blocks' nibbles is [lo(g), lo(g+1), hi(g), hi(g+1)] (16 bytes each; lo(g) = inputs 0..15). */
static inline int pair_pos(int j) {
    const int blk = j / QB, i = j % QB;
    return (i / 16) * 32 + blk * 16 + i % 16;
}

/* Quantize row x [K] into qx (natural order, or pair order for full pairs when `pairs`). */
static void quantize_row(const float *x, int K, int pairs, int8_t *qx, float *aux, int32_t *corr) {
    const int G = K / QB;
    for (int g = 0; g < G; g++) {
        const float *xg = x + g * QB;
        float amax = 0.f;
        int finite = 1;
        for (int j = 0; j < QB; j++) {
            amax = fmaxf(amax, fabsf(xg[j]));
            finite &= isfinite(xg[j]) != 0;
        }
        /* a non-finite input makes its row's outputs NaN, as the float kernels would (qx = 0) */
        const float d = finite ? amax / 127.f : NAN, inv = finite && amax > 0.f ? 127.f / amax : 0.f;
        int8_t q[QB];
        int sum = 0;
        for (int j = 0; j < QB; j++) {
            float r = nearbyintf(xg[j] * inv);
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            q[j] = (int8_t)r;
            sum += q[j];
        }
        const int paired = pairs && (g | 1) < G;
        for (int j = 0; j < QB; j++) {
            const int pos = paired ? (g & ~1) * QB + pair_pos((g & 1) * QB + j) : g * QB + j;
            qx[pos] = q[j];
        }
        aux[2 * g] = d;
        aux[2 * g + 1] = d * (float)sum;
    }
    if (corr != NULL)
        for (int j = 0; j < K / 4; j++)
            corr[j] = -128 * (qx[4 * j] + qx[4 * j + 1] + qx[4 * j + 2] + qx[4 * j + 3]);
}

/* ---- int4 x int8: one weight row qn [K/2] (qgemm.c nibble order), szn [G, 2] -------------- */
#if defined(LM_QDOT_512)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m512 q4_pair(const uint8_t *qn, const uint16_t *szn, const int8_t *xt, const float *at, int g,
                             __m128 *macc) {
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qn + g * 16)));
    w = _mm512_and_si512(_mm512_srlv_epi64(w, shifts), _mm512_set1_epi8(15));
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xt + g * QB));
    const __m128 sm = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(szn + 2 * g)));  /* s, m, s', m' */
    const __m128 p = _mm_mul_ps(sm, _mm_loadu_ps(at + 2 * g));  /* s*dx, m*dx*sum, ... */
    *macc = _mm_add_ps(*macc, p);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(p)));
}

static float q4_dot(const uint8_t *qn, const uint16_t *szn, const int8_t *xt, const float *at, int G) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m128 m0 = _mm_setzero_ps(), m1 = _mm_setzero_ps();
    int g = 0;
    for (; g + 3 < G; g += 4) {  /* two independent chains hide the multiply latency */
        a0 = _mm512_add_ps(a0, q4_pair(qn, szn, xt, at, g, &m0));
        a1 = _mm512_add_ps(a1, q4_pair(qn, szn, xt, at, g + 2, &m1));
    }
    if (g + 1 < G) {
        a0 = _mm512_add_ps(a0, q4_pair(qn, szn, xt, at, g, &m0));
        g += 2;
    }
    const __m128 m = _mm_add_ps(m0, m1);
    float r = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + m[1] + m[3];
    if (g < G) {  /* an odd last block, in natural order */
        const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * 16));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xt + g * QB));
        const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
        float sc, mn;
        sm_at(szn, g, &sc, &mn);
        r += hsum256(_mm256_cvtepi32_ps(d)) * (sc * at[2 * g]) + mn * at[2 * g + 1];
    }
    return r;
}
#elif defined(LM_QDOT_256)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* u8 [32] . s8 [32] -> 8 int32 sums of 4 products, exact for what this file passes (u8 <= 127,
 * |s8| <= 127: vpmaddubsw's int16 pair sums stay below 2 * 127 * 127 < 32767) */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256 q4_block(const uint8_t *qn, const uint16_t *szn, const int8_t *xt, const float *at, int g,
                              float *zs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
    const __m256i d = dot_u8s8(w, _mm256_loadu_si256((const __m256i *)(xt + g * QB)));
    float sc, mn;
    sm_at(szn, g, &sc, &mn);
    *zs += mn * at[2 * g + 1];
    return _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sc * at[2 * g]));
}

static float q4_dot(const uint8_t *qn, const uint16_t *szn, const int8_t *xt, const float *at, int G) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float z0 = 0.f, z1 = 0.f;
    int g = 0;
    for (; g + 1 < G; g += 2) {
        a0 = _mm256_add_ps(a0, q4_block(qn, szn, xt, at, g, &z0));
        a1 = _mm256_add_ps(a1, q4_block(qn, szn, xt, at, g + 1, &z1));
    }
    if (g < G) a0 = _mm256_add_ps(a0, q4_block(qn, szn, xt, at, g, &z0));
    return hsum256(_mm256_add_ps(a0, a1)) + (z0 + z1);
}
#else
static float q4_dot(const uint8_t *qn, const uint16_t *szn, const int8_t *xt, const float *at, int G) {
    float r = 0.f;
    for (int g = 0; g < G; g++) {
        const uint8_t *b = qn + g * 16;
        const int8_t *xg = xt + g * QB;
        int32_t d = 0;
        for (int j = 0; j < 16; j++) d += (b[j] & 15) * xg[j] + (b[j] >> 4) * xg[j + 16];
        float sc, mn;
        sm_at(szn, g, &sc, &mn);
        r += (float)d * (sc * at[2 * g]) + mn * at[2 * g + 1];
    }
    return r;
}
#endif

/* ---- int8 x int8: one weight row qn [K] ----------------------------------------------------- */
#if defined(LM_QDOT_512)
/* vpdpbusd multiplies unsigned by signed bytes: (q + 128) . qx = q . qx + 128 sum(qx), so each
 * int32 lane starts at corr = -128 * (its 4 qx) and ends exact. */
static inline __m512 q8_pair(const int8_t *qn, const int8_t *xt, const float *at, const int32_t *ct, int g) {
    const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(qn + g * QB), _mm512_set1_epi8((char)0x80));
    const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(ct + g * 8), w, _mm512_loadu_si512(xt + g * QB));
    const __m512 dx = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(at + 2 * g)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(d), dx);
}

static float q8_dot(const int8_t *qn, const int8_t *xt, const float *at, const int32_t *ct, int G) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int g = 0;
    for (; g + 3 < G; g += 4) {
        a0 = _mm512_add_ps(a0, q8_pair(qn, xt, at, ct, g));
        a1 = _mm512_add_ps(a1, q8_pair(qn, xt, at, ct, g + 2));
    }
    if (g + 1 < G) {
        a0 = _mm512_add_ps(a0, q8_pair(qn, xt, at, ct, g));
        g += 2;
    }
    float r = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    if (g < G) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qn + g * QB)),
                                           _mm256_set1_epi8((char)0x80));
        const __m256i d = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(ct + g * 8)), w,
                                              _mm256_loadu_si256((const __m256i *)(xt + g * QB)));
        r += hsum256(_mm256_cvtepi32_ps(d)) * at[2 * g];
    }
    return r;
}
#elif defined(LM_QDOT_256)
/* |q| . (qx * sign(q)) = q . qx, with |q| <= 127 unsigned: pairs stay within int16 */
static inline __m256 q8_block(const int8_t *qn, const int8_t *xt, const float *at, int g) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(qn + g * QB));
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xt + g * QB));
    const __m256i d = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(at[2 * g]));
}

static float q8_dot(const int8_t *qn, const int8_t *xt, const float *at, const int32_t *ct, int G) {
    (void)ct;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int g = 0;
    for (; g + 1 < G; g += 2) {
        a0 = _mm256_add_ps(a0, q8_block(qn, xt, at, g));
        a1 = _mm256_add_ps(a1, q8_block(qn, xt, at, g + 1));
    }
    if (g < G) a0 = _mm256_add_ps(a0, q8_block(qn, xt, at, g));
    return hsum256(_mm256_add_ps(a0, a1));
}
#else
static float q8_dot(const int8_t *qn, const int8_t *xt, const float *at, const int32_t *ct, int G) {
    (void)ct;
    float r = 0.f;
    for (int g = 0; g < G; g++) {
        int32_t d = 0;
        for (int j = 0; j < QB; j++) d += qn[g * QB + j] * xt[g * QB + j];
        r += (float)d * at[2 * g];
    }
    return r;
}
#endif

/* ---- entry points --------------------------------------------------------------------------- */
static int act_alloc(act_t *a, int T, int K, int with_corr) {
    a->qx = malloc((size_t)T * K);
    a->aux = malloc(sizeof(float) * (size_t)T * (K / QB) * 2);
    a->corr = with_corr ? malloc(sizeof(int32_t) * (size_t)T * (K / 4)) : NULL;
    return a->qx != NULL && a->aux != NULL && (!with_corr || a->corr != NULL);
}

static void act_free(act_t *a) {
    free(a->qx);
    free(a->aux);
    free(a->corr);
}

#if defined(LM_QDOT_512)
#define Q4_PAIRS 1
#define Q8_CORR 1
#else
#define Q4_PAIRS 0
#define Q8_CORR 0
#endif

/* Which inner loop this build has: 512 (AVX-512 VNNI), 256 (AVX2 / AVX-VNNI) or 0 (portable). */
int lm_qdot_isa(void) {
#if defined(LM_QDOT_512)
    return 512;
#elif defined(LM_QDOT_256)
    return 256;
#else
    return 0;
#endif
}

/* x float32 [T, K], q uint8 [N, K/2] (qgemm.c's nibble order), sz float16 [N, K/32, 2] (s, m)
 * -> y [T, N]. Returns 0, or -1 when scratch could not be allocated (y untouched). */
int lm_q4x8_gemm(const float *x, int T, int K, const uint8_t *q, const uint16_t *sz, int64_t N, float *y,
                 int nthreads) {
    const int G = K / QB;
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K, 0)) { act_free(&a); return -1; }
    for (int t = 0; t < T; t++)
        quantize_row(x + (int64_t)t * K, K, Q4_PAIRS, a.qx + (int64_t)t * K, a.aux + (int64_t)t * 2 * G, NULL);
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {  /* one parallel region (one join) per chunk */
        const int t1 = t0 + T_CHUNK < T ? t0 + T_CHUNK : T;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *qn = q + n * (K / 2);
            const uint16_t *szn = sz + n * 2 * G;
            for (int t = t0; t < t1; t++)
                y[(int64_t)t * N + n] = q4_dot(qn, szn, a.qx + (int64_t)t * K, a.aux + (int64_t)t * 2 * G, G);
        }
    }
    act_free(&a);
    return 0;
}

/* x float32 [T, K], q int8 [N, K], scale float32 [N] (qgemm.c's int8 layout) -> y [T, N]. */
int lm_q8x8_gemm(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, float *y,
                 int nthreads) {
    const int G = K / QB;
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K, Q8_CORR)) { act_free(&a); return -1; }
    for (int t = 0; t < T; t++)
        quantize_row(x + (int64_t)t * K, K, 0, a.qx + (int64_t)t * K, a.aux + (int64_t)t * 2 * G,
                     Q8_CORR ? a.corr + (int64_t)t * (K / 4) : NULL);
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {  /* one parallel region (one join) per chunk */
        const int t1 = t0 + T_CHUNK < T ? t0 + T_CHUNK : T;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N; n++) {
            const int8_t *qn = q + n * K;
            for (int t = t0; t < t1; t++) {
                const int32_t *ct = Q8_CORR ? a.corr + (int64_t)t * (K / 4) : NULL;
                y[(int64_t)t * N + n] = scale[n] * q8_dot(qn, a.qx + (int64_t)t * K, a.aux + (int64_t)t * 2 * G, ct, G);
            }
        }
    }
    act_free(&a);
    return 0;
}
