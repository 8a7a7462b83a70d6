/* Integer-dot weight-only matmuls for the CPU decode path: int4 / int8 weights times int8
 * activations, the scheme of llama.cpp's Q4_1 x Q8_1 (written from the maths, not its code).
 *
 * Each call quantizes every activation row once, in blocks of 32 inputs (qx = round(x / dx),
 * dx = max|x| / 127, |qx| <= 127), then per weight block multiplies bytes with integer SIMD and
 * applies the scales in float:
 *   int4 (w = q * s + m, q in 0..15; (s, m) as float16 pairs: GGUF Q4_1's own d and m):
 *     y[t, n] = sum_g s[n,g] * dx[t,g] * (q[n,g] . qx[t,g]) + m[n,g] * dx[t,g] * sum(qx[t,g])
 *   int8 (w = q * scale[n], q in -127..127):
 *     y[t, n] = scale[n] * sum_g dx[t,g] * (q[n,g] . qx[t,g])
 * The integer dot products are exact; only the per-block float sums round. A row's result
 * depends on that row alone, in a fixed order, whatever T or the thread count (what
 * --enable-deterministic-inference needs, and what keeps speculative verification's rows equal
 * to one-token decodes).
 *
 * Weights are stored in groups of 8 rows (the int4 and int8 layouts below; qgemm.py's
 * pack_q4_f16 / pack_q8 write them): a 32-byte register holds 4 consecutive inputs of each of
 * the 8 rows, and is multiplied with one activation row's 4 inputs broadcast to all lanes, so
 * the 8 rows' dot products build up in 8 int32 (int16) lanes. Against one row per register
 * (this file before) there are no horizontal sums and the float work is one vector operation
 * per block for 8 rows: a call of several activation rows, compute-bound on AVX2 (a verify step
 * of drafted tokens, a batch), runs 1.4-1.6x faster, and one of 1 row a little faster too.
 * The inner loop is picked at compile time (native.py builds with -march=native), all 256-bit:
 *   AVX-512 VNNI (with VL) or AVX-VNNI: vpdpbusd; int8 weights against biased activations;
 *   AVX2: vpmaddubsw, int4 sums kept in int16 through a block, then vpmaddwd; int8 weights
 *   by the sign trick (|q| . qx * sign(q));
 *   otherwise (or with -DLM_QDOT_PORTABLE): plain C the compiler may vectorize.
 * -DLM_QDOT_NO_AVX512 skips the first on AVX-512 machines; -DLM_QDOT_VNNI_EMU runs the vpdpbusd
 * loops on AVX2 with the instruction's maths written out (tests on CPUs without VNNI).
 * Every path is T-blocked: a weight block is loaded and unpacked once for up to QR activation
 * rows, each row keeping the float sequence it has alone (see "the row-blocked inner loops");
 * -DLM_QDOT_ONE_ROW takes one row per pass (the tests' bitwise reference). That invariance
 * needs the build qgemm.py gives this file: -fno-associative-math -ffp-contract=off (the fused
 * multiply-adds are written out where wanted).
 * Fixed cost per call (what a decode step at T = 1 pays 30 x 4 times): no allocation (each
 * calling thread keeps KEEP_BYTES of activation scratch), the quantization vectorized (AVX-512
 * or AVX2), no thread but the caller's for jobs under SERIAL_BYTES, and a help-first worker
 * pool instead of an OpenMP region (see pool_run: a late thread never holds the call up). The
 * thread count never changes a row's float order: the threads only split the weight groups.
 * Activations and outputs are row-major and contiguous; K is a multiple of 32 (callers check).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>

#if !defined(LM_QDOT_PORTABLE) && !defined(LM_QDOT_NO_AVX512) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#define LM_QDOT_512 1
#elif !defined(LM_QDOT_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LM_QDOT_256 1
#endif
#if defined(LM_QDOT_512) || defined(LM_QDOT_256)
#include <immintrin.h>
#endif

/* u8 x s8 dot products of 4 into int32 lanes, added to acc (vpdpbusd): AVX-512 VNNI (256-bit, VL),
 * AVX-VNNI, or (-DLM_QDOT_VNNI_EMU, tests: the VNNI loops on a CPU without it) exact AVX2 maths */
#if defined(LM_QDOT_512)
#define HAVE_DPBUSD 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(LM_QDOT_256) && defined(__AVXVNNI__) && !defined(LM_QDOT_VNNI_EMU)
#define HAVE_DPBUSD 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(LM_QDOT_256) && defined(LM_QDOT_VNNI_EMU)
#define HAVE_DPBUSD 1
#define DPBUSD(acc, u, s) dpbusd_emu(acc, u, s)
static inline __m256i dpbusd_emu(__m256i acc, __m256i u, __m256i s) {
    const __m256i lo8 = _mm256_set1_epi16(0xff);
    const __m256i ue = _mm256_and_si256(u, lo8), uo = _mm256_srli_epi16(u, 8);               /* zero-extended */
    const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8); /* sign-extended */
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
}
#endif
/* With vpdpbusd the int8-weight activations are stored biased, u = qx ^ 0x80 = qx + 128 (see
 * q8_group_rows); without it they stay signed (the sign trick). */
#if defined(HAVE_DPBUSD)
#define Q8_BIASED 1
#else
#define Q8_BIASED 0
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

/* Per-call activation scratch: qx int8 [T, K] (natural order), aux float [T, G, 2] = (dx,
 * dx * sum(qx)) per block. */
typedef struct {
    int8_t *qx;
    float *aux;
    void *owned; /* a call's own allocation (too big for the thread's kept scratch), else NULL */
} act_t;

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(LM_QDOT_PORTABLE) && !defined(LM_QDOT_NO_AVX512)
#include <immintrin.h>
/* One block of 32 inputs -> q [32] (lo16 = inputs 0..15, hi16 = 16..31, each ^ flip), its
 * dx and sum(qx): the scalar rule below, vectorized, bit for bit (max and the integer sum are
 * exact in any order; x * inv rounds once; roundscale rounds half to even as nearbyintf). */
static inline float quantize_block(const float *xg, uint8_t flip, __m128i *lo16, __m128i *hi16, int *sum) {
    const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1), inf = _mm512_set1_ps(INFINITY);
    const int finite = (__mmask16)(_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) &
                                   _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == (__mmask16)0xFFFF;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float d = finite ? amax / 127.f : NAN, inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vi = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)  /* an immediate: half to even */
#define QROUND(x_) _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x_, vi), RNE), \
                                                                   lo), hi))
    __m512i i0 = QROUND(x0), i1 = QROUND(x1);
#undef QROUND
#undef RNE
    if (!finite) i0 = i1 = _mm512_setzero_si512();  /* qx = 0: the row's outputs are NaN through dx */
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    const __m128i f = _mm_set1_epi8((char)flip);
    *lo16 = _mm_xor_si128(_mm512_cvtepi32_epi8(i0), f);
    *hi16 = _mm_xor_si128(_mm512_cvtepi32_epi8(i1), f);
    return d;
}
#define QUANT_VEC 1
#elif defined(__AVX2__) && !defined(LM_QDOT_PORTABLE)
#include <immintrin.h>
/* quantize_block of the AVX-512 build in 256-bit registers, the same bits */
static inline float quantize_block(const float *xg, uint8_t flip, __m128i *lo16, __m128i *hi16, int *sum) {
    const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
    __m256 x[4], amax = _mm256_setzero_ps();
    int finite = 1;
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(xg + 8 * i);
        const __m256 ax = _mm256_andnot_ps(sign, x[i]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(ax, inf, _CMP_LT_OQ)) == 0xFF;
        amax = _mm256_max_ps(amax, ax);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float mx = _mm_cvtss_f32(m);
    const float d = finite ? mx / 127.f : NAN, inv = finite && mx > 0.f ? 127.f / mx : 0.f;
    const __m256 vi = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i q[4], s = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(x[i], vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = finite ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)) : _mm256_setzero_si256();
        s = _mm256_add_epi32(s, q[i]);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
    /* the packs interleave 128-bit lanes: 4-byte groups come out as inputs 0-3, 8-11, 16-19,
     * 24-27 | 4-7, 12-15, 20-23, 28-31; the permutation puts them back in order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i n = _mm256_xor_si256(_mm256_permutevar8x32_epi32(b, _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0)),
                                       _mm256_set1_epi8((char)flip));
    *lo16 = _mm256_castsi256_si128(n);
    *hi16 = _mm256_extracti128_si256(n, 1);
    return d;
}
#define QUANT_VEC 1
#endif

/* Quantize row x [K] into qx (natural order; each byte ^ 0x80 when `biased`, see q8_corr). */
static void quantize_row(const float *x, int K, int biased, int8_t *qx, float *aux) {
    const int G = K / QB;
    for (int g = 0; g < G; g++) {
        const float *xg = x + g * QB;
        float d;
        int sum = 0;
#if defined(QUANT_VEC)
        __m128i lo16, hi16;
        d = quantize_block(xg, biased ? 0x80 : 0, &lo16, &hi16, &sum);
        _mm_storeu_si128((__m128i *)(qx + g * QB), lo16);
        _mm_storeu_si128((__m128i *)(qx + g * QB + 16), hi16);
#else
        float amax = 0.f;
        int finite = 1;
        for (int j = 0; j < QB; j++) {
            amax = fmaxf(amax, fabsf(xg[j]));
            finite &= isfinite(xg[j]) != 0;
        }
        /* a non-finite input makes its row's outputs NaN, as the float kernels would (qx = 0) */
        d = finite ? amax / 127.f : NAN;
        const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < QB; j++) {
            float r = nearbyintf(xg[j] * inv);
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            const int q = finite ? (int)r : 0;
            sum += q;
            qx[g * QB + j] = (int8_t)(biased ? q ^ 0x80 : q);
        }
#endif
        aux[2 * g] = d;
        aux[2 * g + 1] = d * (float)sum;
    }
}

/* ---- the row-blocked inner loops ------------------------------------------------------------
 * q4_group_rows / q8_group_rows: a group of 8 weight rows against nr activation rows
 * (nr <= QR) (x: int8 [nr, K], a: aux [nr, G, 2], each row after the last) -> 8 columns of nr
 * output rows. Each weight block is loaded and unpacked once and multiplied with every row;
 * each row keeps its own accumulators and runs the same float operations in the same order for
 * every nr (the loops over r only repeat a row's sequence), so a row's result is the one it gets
 * alone (nr = 1, T = 1). The bodies are inlined with a constant nr (SPAN_CASES) so their
 * accumulator arrays live in registers. */
#define INL static inline __attribute__((always_inline))

/* ---- int4 x int8: weight rows in groups of 8 --------------------------------------------------
 * The int4 layout (qgemm.py's pack_q4_f16 writes it): N8 = N - N % 8 rows in groups of 8, then
 * the N % 8 last rows one by one.
 *   q: group j's block g is 128 bytes at (j * G + g) * 128: byte 32 k + 4 i + b (k, b in 0..3,
 *      i in 0..7) = q[8j + i][32g + 4k + b] | q[8j + i][32g + 16 + 4k + b] << 4, so a 32-byte
 *      load holds 4 consecutive inputs of each of the 8 rows in its low nibbles and the 4 inputs
 *      16 later in its high ones; the last rows follow at N8 * K/2, row by row, block g's byte
 *      j = q[32g + j] | q[32g + j + 16] << 4 (GGUF's own order).
 *   sm (float16): group j's block g is 16 halves at (j * G + g) * 16: s of its 8 rows, then m;
 *      the last rows' (s, m) pairs follow at N8 * G * 2, row by row.
 * A register of weights meets one activation row's 4 inputs broadcast to its 8 lanes, so the 8
 * rows' dot products come out in 8 int32 lanes: no horizontal sums, and the float work (scale
 * and minimum terms) is one vector operation for 8 rows instead of one per row and block pair.
 * Per row and block, in this order (fa: the row's 8 accumulators):
 *   fa = fma(float(dot), s * dx, fa); fa = fma(m, dx * sum(qx), fa). */
#define QR 4           /* activation rows per weight pass */
#define GROUP 8        /* weight rows per group */

#if defined(LM_QDOT_512) || defined(LM_QDOT_256)
/* acc + lo . bcast(x0) + hi . bcast(x1), per lane. Without VNNI the sums stay int16 through a
 * block (|.| <= 8 * 2 * 15 * 127 = 30480 < 32767) and widen once (q4_widen). */
INL __m256i q4_dot_acc(__m256i acc, __m256i lo, __m256i hi, int32_t x0, int32_t x1) {
    const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
#if defined(HAVE_DPBUSD)
    return DPBUSD(DPBUSD(acc, lo, b0), hi, b1);
#else
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, b0), _mm256_maddubs_epi16(hi, b1)));
#endif
}

INL __m256 q4_widen(__m256i acc) {
#if defined(HAVE_DPBUSD)
    return _mm256_cvtepi32_ps(acc);
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(acc, _mm256_set1_epi16(1)));
#endif
}

/* One group (qg: its G * 128 bytes, sg: its G * 16 halves) x nr rows -> y rows [nr] (stride N),
 * 8 columns each. pf: bytes ahead of qg's blocks to prefetch (0: none). */
INL void q4_group_rows(const uint8_t *qg, const uint16_t *sg, const int8_t *x, const float *a, int K, int G,
                       const int nr, float *y, int64_t N, int64_t pf) {
    __m256 fa[QR];
    for (int r = 0; r < nr; r++) fa[r] = _mm256_setzero_ps();
    const __m256i m15 = _mm256_set1_epi8(15);
    for (int g = 0; g < G; g++) {
        const uint8_t *wb = qg + (int64_t)g * 128;
        if (pf) {
            __builtin_prefetch(wb + pf, 0, 0);
            __builtin_prefetch(wb + pf + 64, 0, 0);
            __builtin_prefetch((const char *)(sg + g * 16) + pf / 4, 0, 0);
        }
        __m256i acc[QR];
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int k = 0; k < 4; k++) {  /* rolled: unrolled, GCC hoists the loads and spills */
            const __m256i L = _mm256_loadu_si256((const __m256i *)(wb + 32 * k));
            const __m256i lo = _mm256_and_si256(L, m15), hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), m15);
            for (int r = 0; r < nr; r++) {
                const int8_t *xr = x + (int64_t)r * K + g * QB + 4 * k;
                int32_t x0, x1;
                memcpy(&x0, xr, 4);
                memcpy(&x1, xr + 16, 4);
                acc[r] = q4_dot_acc(acc[r], lo, hi, x0, x1);
            }
        }
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + g * 16)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + g * 16 + 8)));
        for (int r = 0; r < nr; r++) {
            const float *at = a + (int64_t)r * 2 * G + 2 * g;
            fa[r] = _mm256_fmadd_ps(q4_widen(acc[r]), _mm256_mul_ps(s, _mm256_set1_ps(at[0])), fa[r]);
            fa[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(at[1]), fa[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(y + r * N, fa[r]);
}
#else
/* The same layout in plain C, each row and column its own float sequence:
 * acc = acc + float(dot) * (s * dx); acc = acc + m * (dx * sum(qx)) */
INL void q4_group_rows(const uint8_t *qg, const uint16_t *sg, const int8_t *x, const float *a, int K, int G,
                       const int nr, float *y, int64_t N, int64_t pf) {
    (void)pf;
    float acc[QR][GROUP];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < GROUP; i++) acc[r][i] = 0.f;
    for (int g = 0; g < G; g++) {
        const uint8_t *wb = qg + (int64_t)g * 128;
        for (int i = 0; i < GROUP; i++) {
            const float s = h2f(sg[g * 16 + i]), m = h2f(sg[g * 16 + 8 + i]);
            for (int r = 0; r < nr; r++) {
                const int8_t *xg = x + (int64_t)r * K + g * QB;
                int32_t d = 0;
                for (int k = 0; k < 4; k++)
                    for (int b = 0; b < 4; b++) {
                        const int w = wb[32 * k + 4 * i + b];
                        d += (w & 15) * xg[4 * k + b] + (w >> 4) * xg[16 + 4 * k + b];
                    }
                const float *at = a + (int64_t)r * 2 * G + 2 * g;
                acc[r][i] = acc[r][i] + (float)d * (s * at[0]);
                acc[r][i] = acc[r][i] + m * at[1];
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < GROUP; i++) y[r * N + i] = acc[r][i];
}
#endif

/* One of the N % 8 last rows (qn [K/2] in GGUF's block order, smn [G, 2]) x nr activation rows
 * -> y rows [nr] (stride N), one column: plain C in every build (real layers have N % 16 == 0). */
static void q4_last_row(const uint8_t *qn, const uint16_t *smn, const int8_t *x, const float *a, int K, int G,
                        int nr, float *y, int64_t N) {
    for (int r = 0; r < nr; r++) {
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            const uint8_t *b = qn + g * 16;
            const int8_t *xg = x + (int64_t)r * K + g * QB;
            int32_t d = 0;
            for (int j = 0; j < 16; j++) d += (b[j] & 15) * xg[j] + (b[j] >> 4) * xg[j + 16];
            float s, m;
            sm_at(smn, g, &s, &m);
            const float *at = a + (int64_t)r * 2 * G + 2 * g;
            acc = acc + (float)d * (s * at[0]);
            acc = acc + m * at[1];
        }
        y[r * N] = acc;
    }
}

/* ---- int8 x int8: weight rows in groups of 8 --------------------------------------------------
 * The int8 layout (qgemm.py's pack_q8 writes it): N8 = N - N % 8 rows in groups of 8, group j's
 * block g 256 bytes at (j * G + g) * 256, byte 32 k + 4 i + b (k in 0..7, i in 0..7, b in 0..3)
 * = q[8j + i][32g + 4k + b]; the N % 8 last rows follow at N8 * K, row by row. scale [N] as it
 * was (row order). Per row and block: fa = fma(float(dot), dx, fa); at the end y = fa * scale. */
#if defined(LM_QDOT_512) || defined(LM_QDOT_256)
INL void q8_group_rows(const int8_t *qg, const float *scale, const int8_t *x, const float *a, int K, int G,
                       const int nr, float *y, int64_t N, int64_t pf) {
    __m256 fa[QR];
    for (int r = 0; r < nr; r++) fa[r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int8_t *wb = qg + (int64_t)g * 256;
        if (pf)
            for (int o = 0; o < 256; o += 64) __builtin_prefetch(wb + pf + o, 0, 0);
        __m256i acc[QR];
#if defined(HAVE_DPBUSD)
        /* biased activations (Q8_BIASED): u . q = qx . q + 128 sum(q); start each lane at
         * -128 sum(q) of its row's 32 weights (exact: |u q| sums stay far inside int32) */
        __m256i corr = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++)
            corr = DPBUSD(corr, _mm256_set1_epi8((char)0x80), _mm256_loadu_si256((const __m256i *)(wb + 32 * k)));
        corr = _mm256_sub_epi32(_mm256_setzero_si256(), corr);
        for (int r = 0; r < nr; r++) acc[r] = corr;
#else
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 1
        for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 32 * k));
#if !defined(HAVE_DPBUSD)
            const __m256i wabs = _mm256_sign_epi8(w, w), ones = _mm256_set1_epi16(1);
#endif
            for (int r = 0; r < nr; r++) {
                int32_t xv;
                memcpy(&xv, x + (int64_t)r * K + g * QB + 4 * k, 4);
#if defined(HAVE_DPBUSD)
                acc[r] = DPBUSD(acc[r], _mm256_set1_epi32(xv), w);
#else
                /* |q| . (qx * sign(q)) = q . qx: vpmaddubsw's pair sums stay below 2 * 127 * 127 */
                const __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(_mm256_set1_epi32(xv), w));
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
#endif
            }
        }
        for (int r = 0; r < nr; r++)
            fa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(a[(int64_t)r * 2 * G + 2 * g]), fa[r]);
    }
    const __m256 sc = _mm256_loadu_ps(scale);
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(y + r * N, _mm256_mul_ps(fa[r], sc));
}
#else
/* the same layout in plain C: acc = acc + float(dot) * dx per block; y = acc * scale */
INL void q8_group_rows(const int8_t *qg, const float *scale, const int8_t *x, const float *a, int K, int G,
                       const int nr, float *y, int64_t N, int64_t pf) {
    (void)pf;
    float acc[QR][GROUP];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < GROUP; i++) acc[r][i] = 0.f;
    for (int g = 0; g < G; g++) {
        const int8_t *wb = qg + (int64_t)g * 256;
        for (int i = 0; i < GROUP; i++)
            for (int r = 0; r < nr; r++) {
                const int8_t *xg = x + (int64_t)r * K + g * QB;
                int32_t d = 0;
                for (int k = 0; k < 8; k++)
                    for (int b = 0; b < 4; b++) d += wb[32 * k + 4 * i + b] * xg[4 * k + b];
                acc[r][i] = acc[r][i] + (float)d * a[(int64_t)r * 2 * G + 2 * g];
            }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < GROUP; i++) y[r * N + i] = acc[r][i] * scale[i];
}
#endif

/* One of the N % 8 last int8 rows (qn [K], row order) x nr activation rows -> y rows [nr]
 * (stride N), one column: plain C in every build (activations unbiased here, see Q8_BIASED). */
static void q8_last_row(const int8_t *qn, float scale, const int8_t *x, const float *a, int K, int G, int nr,
                        float *y, int64_t N) {
    const int flip = Q8_BIASED ? 0x80 : 0;
    for (int r = 0; r < nr; r++) {
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            const int8_t *xg = x + (int64_t)r * K + g * QB;
            int32_t d = 0;
            for (int j = 0; j < QB; j++) d += qn[g * QB + j] * (int8_t)(xg[j] ^ flip);
            acc = acc + (float)d * a[(int64_t)r * 2 * G + 2 * g];
        }
        y[r * N] = acc * scale;
    }
}

_Static_assert(QR == 4, "SPAN_CASES spells out nr");
#if defined(LM_QDOT_ONE_ROW)
#define ROWS 1         /* the unblocked loop (one row per pass; bench/ab_qdot.py's baseline) */
#else
#define ROWS QR
#endif
/* Weight bytes per span (at least one group) and groups per span at most: a span's weights stay
 * in L1 / L2 while its row blocks pass over them, and fewer, longer spans stream better. Against
 * 8 KB and 4 groups, all of a SmolLM2 step's matmuls alternating in one process (2 threads,
 * medians of 60): 0.86x at 1 row, 0.88x at 2, 0.90x at 4, 0.91x at 9, 0.97x at 16 (16 KB: 0.91x
 * at 1 row, 64 KB and 16 groups no better). */
#ifndef SPAN_BYTES
#define SPAN_BYTES 32768
#endif
#ifndef NB_MAX
#define NB_MAX 8
#endif

/* nr (1..QR) as a constant in each case, so every case is its own register-allocated copy of
 * the inlined body and the dispatch happens once per span, not per weight group */
#define SPAN_CASES(call)                                                                  \
    switch (nr) {                                                                         \
    case 1: call(1); break;                                                               \
    case 2: call(2); break;                                                               \
    case 3: call(3); break;                                                               \
    default: call(QR); break;                                                             \
    }
/* ---- entry points --------------------------------------------------------------------------- */
#ifndef KEEP_BYTES
#define KEEP_BYTES (256 * 1024) /* activation scratch each calling thread keeps between calls */
#endif
static pthread_key_t keep_key;
static pthread_once_t keep_once = PTHREAD_ONCE_INIT;
static void keep_init(void) { (void)pthread_key_create(&keep_key, free); }  /* freed at thread exit */

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

/* The scratch of a call of T rows of K inputs: the calling thread's kept KEEP_BYTES when that
 * suffices (no allocation per decode step), else the call's own. 0 when out of memory. */
static int act_alloc(act_t *a, int T, int K) {
    const size_t nq = up64((size_t)T * K), na = up64(sizeof(float) * (size_t)T * (K / QB) * 2);
    const size_t need = nq + na;
    char *base;
    a->owned = NULL;
    if (need <= KEEP_BYTES) {
        (void)pthread_once(&keep_once, keep_init);
        base = pthread_getspecific(keep_key);
        if (base == NULL) {
            base = aligned_alloc(64, KEEP_BYTES);
            if (base == NULL || pthread_setspecific(keep_key, base) != 0) { free(base); return 0; }
        }
    } else if ((base = a->owned = aligned_alloc(64, up64(need))) == NULL) {
        return 0;
    }
    a->qx = (int8_t *)base;
    a->aux = (float *)(base + nq);
    return 1;
}

static void act_free(act_t *a) { free(a->owned); }

/* Every row of x [T, K] into a's scratch (for int8 weights biased where Q8_BIASED). */
static void quantize_all(const float *x, int T, int K, int for_q8, act_t *a) {
    const int G = K / QB;
    for (int t = 0; t < T; t++)
        quantize_row(x + (int64_t)t * K, K, for_q8 && Q8_BIASED, a->qx + (int64_t)t * K, a->aux + (int64_t)t * 2 * G);
}

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

/* Weight groups per span: up to SPAN_BYTES of weights (group_bytes each) and NB_MAX groups, fewer
 * when NG is small, so every thread gets about 4 spans. */
static int64_t span_groups(int64_t NG, int nthreads, int64_t group_bytes) {
    const int64_t per = (NG + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)(nthreads > 0 ? nthreads : 1));
    int64_t cap = SPAN_BYTES / group_bytes;
    cap = cap < 1 ? 1 : (cap > NB_MAX ? NB_MAX : cap);
    return per < 1 ? 1 : (per > cap ? cap : per);
}

#define LM_POOL_EXPORT  /* lm_pool_run: paged_decode.c's jobs run on these workers too */
#include "native_pool.h"  /* the worker pool: pool_run(fn, ctx, spans, nthreads) */

#ifndef SERIAL_BYTES
#define SERIAL_BYTES 65536 /* weight bytes x row blocks under which the calling thread does it all */
#endif
#define PREFETCH_MAX_T 2    /* calls of up to this many rows prefetch (more rows: compute-bound) */
static int prefetch_bytes = 3072; /* how far ahead a span's weight rows are prefetched (0: not at all) */

/* Set prefetch_bytes, returning the old value (qgemm.set_prefetch: benchmarks compare settings in
 * one process). Read once per call by the calling thread, before its job is published. */
int lm_qdot_set_prefetch(int bytes) {
    const int old = prefetch_bytes;
    prefetch_bytes = bytes < 0 ? 0 : bytes;
    return old;
}

/* Bytes of a span's weight stream to prefetch ahead of the block being multiplied, for calls of
 * T rows: at one or two activation rows a call streams its weights from memory with little
 * compute per byte, and the hardware prefetchers, which stop at each 4 KB page and restart at
 * each span, leave both cores waiting on misses; explicit non-temporal prefetches a few KB
 * ahead (measured: 2-8 KB alike) keep the loads in flight. 0: none. */
static int64_t prefetch_ahead(int T) {
    return T <= PREFETCH_MAX_T ? prefetch_bytes : 0;
}

/* Threads for a call: one (no pool job to publish and wake workers for) when its weights x row
 * blocks are under SERIAL_BYTES, else nthreads.
 * Either way each row's float order is the same (the spans only split the weight rows). */
static int threads_for(int64_t N, int64_t row_bytes, int T, int rows, int nthreads) {
    const int64_t passes = (T + rows - 1) / rows;
    return N * row_bytes * passes < SERIAL_BYTES ? 1 : nthreads;
}

/* int4 weight groups j0..j1 (and, with `last`, the N % 8 last rows) x activation rows t..t+nr-1
 * -> y [T, N]; pf: nibble bytes to prefetch ahead (0: none) */
static void q4_span(const act_t *a, int t, int nr, int K, const uint8_t *q, const uint16_t *sm, int64_t j0,
                    int64_t j1, int last, int64_t N, float *y, int64_t pf) {
    const int G = K / QB;
    const int8_t *x = a->qx + (int64_t)t * K;
    const float *at = a->aux + (int64_t)t * 2 * G;
    float *yt = y + (int64_t)t * N;
#define Q4_CALL(R_)                                                                       \
    for (int64_t j = j0; j < j1; j++)                                                     \
        q4_group_rows(q + j * G * 128, sm + j * G * 16, x, at, K, G, R_, yt + j * GROUP, N, pf);
    SPAN_CASES(Q4_CALL)
#undef Q4_CALL
    if (last) {
        const int64_t N8 = N - N % GROUP;
        for (int64_t n = N8; n < N; n++)
            q4_last_row(q + n * (K / 2), sm + n * 2 * G, x, at, K, G, nr, yt + n, N);
    }
}

/* int8 weight groups j0..j1 (and, with `last`, the N % 8 last rows) x activation rows t..t+nr-1
 * -> y [T, N]; pf: weight bytes to prefetch ahead (0: none) */
static void q8_span(const act_t *a, int t, int nr, int K, const int8_t *q, const float *scale, int64_t j0,
                    int64_t j1, int last, int64_t N, float *y, int64_t pf) {
    const int G = K / QB;
    const int8_t *x = a->qx + (int64_t)t * K;
    const float *at = a->aux + (int64_t)t * 2 * G;
    float *yt = y + (int64_t)t * N;
#define Q8_CALL(R_)                                                                       \
    for (int64_t j = j0; j < j1; j++)                                                     \
        q8_group_rows(q + j * GROUP * K, scale + j * GROUP, x, at, K, G, R_, yt + j * GROUP, N, pf);
    SPAN_CASES(Q8_CALL)
#undef Q8_CALL
    if (last) {
        const int64_t N8 = N - N % GROUP;
        for (int64_t n = N8; n < N; n++) q8_last_row(q + n * K, scale[n], x, at, K, G, nr, yt + n, N);
    }
}

/* One pass of a call: weight-row span sp against activation rows t0..t1. */
typedef struct {
    const act_t *a;
    int t0, t1, K;
    const void *q, *scales;
    int64_t nb, N;
    float *y;
    int64_t ahead;  /* weight bytes to prefetch ahead (prefetch_ahead; int4: of the nibbles) */
} pass_t;

/* int4: span sp is weight groups sp * nb.. (nb groups; the last span also takes the last rows) */
static void q4_pass_span(const void *c, int64_t sp) {
    const pass_t *p = c;
    const int64_t NG = p->N / GROUP, j0 = sp * p->nb, j1 = j0 + p->nb < NG ? j0 + p->nb : NG;
    const int last = j1 == NG;
    for (int t = p->t0; t < p->t1; t += ROWS)
        q4_span(p->a, t, p->t1 - t < ROWS ? p->t1 - t : ROWS, p->K, p->q, p->scales, j0, j1, last, p->N, p->y,
                p->ahead);
}

static void q8_pass_span(const void *c, int64_t sp) {
    const pass_t *p = c;
    const int64_t NG = p->N / GROUP, j0 = sp * p->nb, j1 = j0 + p->nb < NG ? j0 + p->nb : NG;
    const int last = j1 == NG;
    for (int t = p->t0; t < p->t1; t += ROWS)
        q8_span(p->a, t, p->t1 - t < ROWS ? p->t1 - t : ROWS, p->K, p->q, p->scales, j0, j1, last, p->N, p->y,
                p->ahead);
}

/* x float32 [T, K], q uint8 [N * K/2] and sm float16 [N * K/32 * 2] in the int4 layout (groups
 * of 8 rows, see q4_group_rows) -> y [T, N]. Returns 0, or -1 when scratch could not be allocated
 * (y untouched). Threads split the weight groups (spans); each span meets every row block of a
 * chunk while its weights are cached. */
int lm_q4x8_gemm(const float *x, int T, int K, const uint8_t *q, const uint16_t *sm, int64_t N, float *y,
                 int nthreads) {
    const int G = K / QB;
    const int64_t gbytes = GROUP * (int64_t)(K / 2 + 4 * G), NG = N / GROUP;
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K)) return -1;
    quantize_all(x, T, K, 0, &a);
    const int nt = threads_for(N, K / 2 + 4 * G, T, ROWS, nthreads);
    /* (with N < 8: no group, one span for the last rows) */
    const int64_t nb = NG > 0 ? span_groups(NG, nt, gbytes) : 1, spans = NG > 0 ? (NG + nb - 1) / nb : 1;
    /* prefetch_bytes of weights and scales ahead, 4/5 of them nibbles */
    const int64_t pf = prefetch_ahead(T) * 4 / 5;
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {  /* one pool job per chunk */
        const pass_t p = {&a, t0, t0 + T_CHUNK < T ? t0 + T_CHUNK : T, K, q, sm, nb, N, y, pf};
        pool_run(q4_pass_span, &p, spans, nt);
    }
    act_free(&a);
    return 0;
}

/* x float32 [T, K], q int8 [N * K] in the int8 layout (groups of 8 rows, see q8_group_rows),
 * scale float32 [N] -> y [T, N]. */
int lm_q8x8_gemm(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, float *y,
                 int nthreads) {
    const int64_t NG = N / GROUP;
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K)) return -1;
    quantize_all(x, T, K, 1, &a);
    const int nt = threads_for(N, K, T, ROWS, nthreads);
    const int64_t nb = NG > 0 ? span_groups(NG, nt, GROUP * (int64_t)K) : 1, spans = NG > 0 ? (NG + nb - 1) / nb : 1;
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
        const pass_t p = {&a, t0, t0 + T_CHUNK < T ? t0 + T_CHUNK : T, K, q, scale, nb, N, y, prefetch_ahead(T)};
        pool_run(q8_pass_span, &p, spans, nt);
    }
    act_free(&a);
    return 0;
}
