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
 *   __AVXVNNI__ / __AVX2__: int8 weights 32 bytes a block; int4 two blocks at a time, their
 *   low nibbles in one register and high nibbles in another against pair-ordered activations
 *   (no per-block unpacking or lane shuffles; calls of several rows pair blocks g and g+2 of
 *   each quad, so the scales spread within 128-bit lanes), vpdpbusd or vpmaddubsw + vpmaddwd,
 *   and the scales of four blocks in one float16 conversion and one multiply;
 *   otherwise (or with -DLM_QDOT_PORTABLE): plain C the compiler may vectorize.
 * -DLM_QDOT_NO_AVX512 skips the first, so tests exercise the AVX2 path on AVX-512 machines.
 * Every path is T-blocked: a weight block is loaded and unpacked once for up to QR (int8 on
 * AVX-512: Q8R) activation rows, each row keeping the float sequence it has alone (see "the
 * row-blocked inner loops"); -DLM_QDOT_ONE_ROW takes one row per pass (the tests' bitwise
 * reference). That invariance needs the build qgemm.py gives this file: -fno-associative-math
 * -ffp-contract=off (the fused multiply-adds are written out where wanted).
 * Fixed cost per call (what a decode step at T = 1 pays 30 x 4 times): no allocation (each
 * calling thread keeps KEEP_BYTES of activation scratch), the quantization vectorized (AVX-512
 * or AVX2), no thread but the caller's for jobs under SERIAL_BYTES, and a help-first worker
 * pool instead of an OpenMP region (see pool_run: a late thread never holds the call up). The
 * thread count never changes a row's float order: the threads only split the weight rows.
 * All tensors are row-major and contiguous; K is a multiple of 32 (callers check).
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
 * block (the int4 layout's (scale, zmin) pairs line up with it), dxl as below. */
typedef struct {
    int8_t *qx;
    float *aux;
    float *dxl;  /* AVX-512 only: float [T, K/4], each block's dx 8 times in its lanes (see lane_pos) */
    void *owned; /* a call's own allocation (too big for the thread's kept scratch), else NULL */
    int quads;   /* int4 activations in quad order (LAYOUT_QUADS) */
} act_t;

/* Activation layouts of quantize_row */
#define LAYOUT_NATURAL 0
#define LAYOUT_PAIRS 1  /* full pairs in pair order */
#define LAYOUT_QUADS 2  /* full quads in quad order, then a last full pair in pair order */

/* Where block g's qx starts (its inputs 0..15, lo16; inputs 16..31, hi16, follow 32 bytes later
 * when the block is `paired`, else right after) in a row of G blocks laid out as `layout`:
 *   pair order (int4 paths): a full pair's 64 bytes are [lo(g), lo(g+1), hi(g), hi(g+1)], the
 *   AVX-512 register of two blocks' nibbles, the AVX2 pair of registers its two halves;
 *   quad order (the AVX2 int4 loop, calls of several rows): a full quad g..g+3 (g % 4 == 0) is
 *   the pairs (g, g+2) then (g+1, g+3), each in pair order, so a pair's two blocks sit at the
 *   same position of the two 128-bit lanes as their scales after one float16 conversion of the
 *   quad (see q4_rows_n). */
static inline int block_base(int g, int G, int layout, int *paired) {
    *paired = layout != LAYOUT_NATURAL && (g | 1) < G;
    if (layout == LAYOUT_QUADS && (g | 3) < G) return (g & ~3) * QB + (g & 1) * 64 + ((g >> 1) & 1) * 16;
    return *paired ? (g & ~1) * QB + (g & 1) * 16 : g * QB;
}

/* Where lane i (0..7) of block g's dx goes in dxl: lanes g*8.. in natural order (int8, an odd
 * last block), or within a pair's 16 the int4 register's order [lo(g), lo(g+1), hi(g), hi(g+1)]
 * (4 int32 lanes each) when `paired`. */
static inline int lane_pos(int g, int i, int paired) {
    return paired ? (g & ~1) * 8 + (i / 4) * 8 + (g & 1) * 4 + i % 4 : g * 8 + i;
}

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

/* Quantize row x [K] into qx (`layout`: LAYOUT_*; each byte ^ 0x80 when `biased`, see q8_corr). */
static void quantize_row(const float *x, int K, int layout, int biased, int8_t *qx, float *aux, float *dxl) {
    const int G = K / QB;
    for (int g = 0; g < G; g++) {
        const float *xg = x + g * QB;
        int paired;
        const int base = block_base(g, G, layout, &paired);
        float d;
        int sum = 0;
#if defined(QUANT_VEC)
        __m128i lo16, hi16;
        d = quantize_block(xg, biased ? 0x80 : 0, &lo16, &hi16, &sum);
        _mm_storeu_si128((__m128i *)(qx + base), lo16);
        _mm_storeu_si128((__m128i *)(qx + base + (paired ? 32 : 16)), hi16);
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
        int8_t q[QB];
        for (int j = 0; j < QB; j++) {
            float r = nearbyintf(xg[j] * inv);
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            q[j] = finite ? (int8_t)r : 0;
            sum += q[j];
        }
        for (int j = 0; j < QB; j++) {
            qx[base + (j / 16) * (paired ? 32 : 16) + j % 16] = (int8_t)(biased ? q[j] ^ 0x80 : q[j]);
        }
#endif
        aux[2 * g] = d;
        aux[2 * g + 1] = d * (float)sum;
        if (dxl != NULL)
            for (int i = 0; i < 8; i++) dxl[lane_pos(g, i, paired)] = d;
    }
}

/* ---- the row-blocked inner loops ------------------------------------------------------------
 * q4_rows_n / q8_rows_n: one weight row (qn) against nr activation rows (nr <= QR; int8 weights:
 * Q8R) (x: int8 [nr, K], a: aux [nr, G, 2], l: dxl [nr, K/4] or unused, each row after
 * the last) -> res [nr]. Each weight block is loaded and unpacked once and multiplied with every
 * row; each row keeps its own accumulators and runs the same float operations in the same order
 * for every nr (the loops over r only repeat a row's sequence), so a row's result is the one it
 * gets alone (nr = 1, T = 1). The bodies are inlined with a constant nr (SPAN_CASES) so their
 * accumulator arrays live in registers. */
#define INL static inline __attribute__((always_inline))

#if defined(LM_QDOT_512) || defined(LM_QDOT_256)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* u8 [32] . s8 [32] -> 8 int32 sums of 4 products, exact for what this file passes (u8 <= 127,
 * |s8| <= 127: vpmaddubsw's int16 pair sums stay below 2 * 127 * 127 < 32767) */
INL __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(LM_QDOT_512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* An odd last int4 block g, in natural order (no pair to share a register with), added to
 * the nr rows' results */
INL void q4_odd_block(const uint8_t *qn, const uint16_t *szn, const int8_t *x, const float *a, int K, int G,
                      int g, int nr, float *res) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
    float sc, mn;
    sm_at(szn, g, &sc, &mn);
    for (int r = 0; r < nr; r++) {
        const float *at = a + r * 2 * G;
        const __m256i d = dot_u8s8(w, _mm256_loadu_si256((const __m256i *)(x + r * K + g * QB)));
        res[r] += hsum256(_mm256_cvtepi32_ps(d)) * (sc * at[2 * g]) + mn * at[2 * g + 1];
    }
}
#endif

/* ---- int4 x int8: one weight row qn [K/2] (qgemm.c nibble order), szn [G, 2] -------------- */
#if defined(LM_QDOT_512)
#define QR 4           /* activation rows per weight pass: 4 rows x (2 zmm + 2 xmm) accumulators */

/* blocks g, g+1's nibbles as one register [lo(g), lo(g+1), hi(g), hi(g+1)], values 0..15 */
INL __m512i q4_unpack_pair(const uint8_t *qn, int g) {
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qn + g * 16)));
    return _mm512_and_si512(_mm512_srlv_epi64(w, shifts), _mm512_set1_epi8(15));
}

/* one row's share of a block pair, added to acc: w unpacked, sm = (s, m, s', m'), sv = s, s'
 * in w's lanes; macc += sm * (dx, dx*sum, dx', dx'*sum') (lanes 1 and 3 are the minimums'
 * terms). Explicit fused multiply-adds (the build contracts nothing itself). */
INL __m512 q4_pair_row(__m512 acc, __m512i w, __m128 sm, __m512 sv, const int8_t *xt, const float *at,
                       const float *lt, int g, __m128 *macc) {
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xt + g * QB));
    *macc = _mm_fmadd_ps(sm, _mm_loadu_ps(at + 2 * g), *macc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_loadu_ps(lt + g * 8)), acc);
}

INL __m128 sm_pair(const uint16_t *szn, int g) {
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(szn + 2 * g)));
}

/* s of blocks g, g+1 (sm's lanes 0 and 2) in the int4 register's lanes */
INL __m512 s_lanes(__m128 sm) {
    const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(sm));
}

INL void q4_rows_n(const uint8_t *qn, const uint16_t *szn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, const int quads, float *res) {
    (void)quads;  /* pair order only */
    __m512 a0[QR], a1[QR];
    __m128 m0[QR], m1[QR];
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm512_setzero_ps(), m0[r] = m1[r] = _mm_setzero_ps();
    int g = 0;
    for (; g + 3 < G; g += 4) {  /* two independent chains per row hide the multiply latency */
        const __m512i w0 = q4_unpack_pair(qn, g), w1 = q4_unpack_pair(qn, g + 2);
        const __m128 s0 = sm_pair(szn, g), s1 = sm_pair(szn, g + 2);
        const __m512 v0 = s_lanes(s0), v1 = s_lanes(s1);
        for (int r = 0; r < nr; r++) {
            const int8_t *xt = x + r * K;
            const float *at = a + r * 2 * G, *lt = l + r * (K / 4);
            a0[r] = q4_pair_row(a0[r], w0, s0, v0, xt, at, lt, g, &m0[r]);
            a1[r] = q4_pair_row(a1[r], w1, s1, v1, xt, at, lt, g + 2, &m1[r]);
        }
    }
    if (g + 1 < G) {
        const __m512i w0 = q4_unpack_pair(qn, g);
        const __m128 s0 = sm_pair(szn, g);
        const __m512 v0 = s_lanes(s0);
        for (int r = 0; r < nr; r++)
            a0[r] = q4_pair_row(a0[r], w0, s0, v0, x + r * K, a + r * 2 * G, l + r * (K / 4), g, &m0[r]);
        g += 2;
    }
    for (int r = 0; r < nr; r++) {
        const __m128 m = _mm_add_ps(m0[r], m1[r]);
        res[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])) + m[1] + m[3];
    }
    if (g < G) q4_odd_block(qn, szn, x, a, K, G, g, nr, res);
}
#elif defined(LM_QDOT_256)
#define QR 4           /* activation rows per weight pass (the 16 ymm registers spill beyond) */

/* Blocks g, g+1 as two registers, values 0..15: *lo = [lo(g), lo(g+1)] (inputs 0..15 of each),
 * *hi = [hi(g), hi(g+1)] (inputs 16..31): one load and three operations for the pair, matching
 * the activations' pair order (block_base: the AVX-512 register's 64 bytes as two halves). */
INL void q4_split(__m256i b, __m256i *lo, __m256i *hi) {
    const __m256i m = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(b, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}

INL void q4_unpack_pair(const uint8_t *qn, int g, __m256i *lo, __m256i *hi) {
    q4_split(_mm256_loadu_si256((const __m256i *)(qn + g * 16)), lo, hi);
}

/* Blocks g and g+2 as a pair (the quad order's first pair; g+1 and g+3 its second): two 16-byte
 * loads into the two lanes, then the same three operations */
INL void q4_unpack_apart(const uint8_t *qn, int g, __m256i *lo, __m256i *hi) {
    q4_split(_mm256_loadu2_m128i((const __m128i *)(qn + (g + 2) * 16), (const __m128i *)(qn + g * 16)), lo, hi);
}

/* A pair's exact integer dots with one row's pair-ordered activations xp [64]: lanes 0..3 sum
 * to block g's, 4..7 to block g+1's. Without VNNI the halves' int16 pair sums are added before
 * widening (each |.| <= 2 * 15 * 127, so the sum stays below 32767). */
INL __m256i q4_pair_dot(__m256i lo, __m256i hi, const int8_t *xp) {
    const __m256i xl = _mm256_loadu_si256((const __m256i *)xp), xh = _mm256_loadu_si256((const __m256i *)(xp + 32));
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)),
                             _mm256_set1_epi16(1));
#endif
}

/* p's lane 0 over a pair's first four dot lanes and lane 2 over the last four; the same with
 * lanes 4 and 6 for the next pair */
#define LANES_A _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0)
#define LANES_B _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4)

/* Per row and four blocks from g: p = (s, m, s', m', ...) * (dx, dx*sum, dx', dx'*sum', ...)
 * (the row's aux); the odd lanes are the minimums' terms, summed into macc, the even lanes
 * s * dx, each spread over its block's dot lanes. Two pair chains per row hide the
 * multiply-add latency. With `quads` (activations in quad order, calls of several rows) the
 * quad's pairs are (g, g+2) and (g+1, g+3), so each spread stays within 128-bit lanes
 * (vpermilps instead of a lane-crossing vpermps per pair and row; with several rows the loop
 * is bound by its vector operations, and a 4-row call runs ~10% faster); after the quads the
 * chains' halves are regrouped into the pair order's chains (g, g+1) / (g+2, g+3), which a last
 * pair continues, so every sum is the pair order's, bit for bit. A one-row call keeps the pair
 * order (one 32-byte load a pair; its loop is not bound by the shuffles). Every row runs this
 * sequence whatever nr. */
INL void q4_rows_n(const uint8_t *qn, const uint16_t *szn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, const int quads, float *res) {
    (void)l;
    __m256 a0[QR], a1[QR], mc[QR];
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = mc[r] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 3 < G; g += 4) {
        __m256i lo0, hi0, lo1, hi1;
        if (quads) {
            q4_unpack_apart(qn, g, &lo0, &hi0);
            q4_unpack_apart(qn, g + 1, &lo1, &hi1);
        } else {
            q4_unpack_pair(qn, g, &lo0, &hi0);
            q4_unpack_pair(qn, g + 2, &lo1, &hi1);
        }
        const __m256 sm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(szn + 2 * g)));
        for (int r = 0; r < nr; r++) {
            const int8_t *xt = x + r * K + g * QB;
            const __m256 p = _mm256_mul_ps(sm, _mm256_loadu_ps(a + r * 2 * G + 2 * g));
            mc[r] = _mm256_add_ps(mc[r], p);
            /* quads: (p of g | p of g+2) x 4 and (g+1 | g+3); pairs: (g | g+1) and (g+2 | g+3) */
            const __m256 sa = quads ? _mm256_permute_ps(p, 0x00) : _mm256_permutevar8x32_ps(p, LANES_A);
            const __m256 sb = quads ? _mm256_permute_ps(p, 0xAA) : _mm256_permutevar8x32_ps(p, LANES_B);
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_pair_dot(lo0, hi0, xt)), sa, a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_pair_dot(lo1, hi1, xt + 2 * QB)), sb, a1[r]);
        }
    }
    for (int r = 0; quads && r < nr; r++) {  /* (g | g+2), (g+1 | g+3) -> (g | g+1), (g+2 | g+3) */
        const __m256 e = a0[r], o = a1[r];
        a0[r] = _mm256_permute2f128_ps(e, o, 0x20);
        a1[r] = _mm256_permute2f128_ps(e, o, 0x31);
    }
    if (g + 1 < G) {  /* a last pair */
        __m256i lo0, hi0;
        q4_unpack_pair(qn, g, &lo0, &hi0);
        const __m128 sm = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(szn + 2 * g)));
        for (int r = 0; r < nr; r++) {
            const __m256 p = _mm256_zextps128_ps256(_mm_mul_ps(sm, _mm_loadu_ps(a + r * 2 * G + 2 * g)));
            mc[r] = _mm256_add_ps(mc[r], p);
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_pair_dot(lo0, hi0, x + r * K + g * QB)),
                                    _mm256_permutevar8x32_ps(p, LANES_A), a0[r]);
        }
        g += 2;
    }
    for (int r = 0; r < nr; r++) {
        const __m128 m = _mm_add_ps(_mm256_castps256_ps128(mc[r]), _mm256_extractf128_ps(mc[r], 1));
        res[r] = hsum256(_mm256_add_ps(a0[r], a1[r])) + (m[1] + m[3]);
    }
    if (g < G) q4_odd_block(qn, szn, x, a, K, G, g, nr, res);
}
#undef LANES_A
#undef LANES_B
#else
#define QR 4           /* activation rows per weight pass */
#define PCH 32         /* blocks per integer pass of the plain-C loops */
/* One row's float sum over blocks g0..g1 from its exact integer dots d [g1 - g0]: one
 * out-of-line copy for every nr, so the compiler cannot schedule a row's float sum differently
 * when other rows share the pass (-fassociative-math is on). */
static __attribute__((noinline, noclone)) float q4_scale_row(float acc, const int32_t *d, const uint16_t *szn,
                                                             const float *at, int g0, int g1) {
    for (int g = g0; g < g1; g++) {
        float sc, mn;
        sm_at(szn, g, &sc, &mn);
        acc += (float)d[g - g0] * (sc * at[2 * g]) + mn * at[2 * g + 1];
    }
    return acc;
}

INL void q4_rows_n(const uint8_t *qn, const uint16_t *szn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, const int quads, float *res) {
    (void)l, (void)quads;  /* natural order only */
    float acc[QR];
    for (int r = 0; r < nr; r++) acc[r] = 0.f;
    for (int g0 = 0; g0 < G; g0 += PCH) {
        const int g1 = g0 + PCH < G ? g0 + PCH : G;
        int32_t d[QR][PCH];
        for (int g = g0; g < g1; g++) {
            const uint8_t *b = qn + g * 16;
            int8_t w[QB];  /* the block's 32 weights, natural order */
            for (int j = 0; j < 16; j++) w[j] = (int8_t)(b[j] & 15), w[j + 16] = (int8_t)(b[j] >> 4);
            for (int r = 0; r < nr; r++) {
                const int8_t *xg = x + r * K + g * QB;
                int32_t s = 0;
                for (int j = 0; j < QB; j++) s += w[j] * xg[j];
                d[r][g - g0] = s;
            }
        }
        for (int r = 0; r < nr; r++) acc[r] = q4_scale_row(acc[r], d[r], szn, a + r * 2 * G, g0, g1);
    }
    for (int r = 0; r < nr; r++) res[r] = acc[r];
}
#endif

/* ---- int8 x int8: one weight row qn [K] ----------------------------------------------------- */
#if defined(LM_QDOT_512)
#define Q8R 8          /* int8 rows per weight pass: 8 rows x 2 zmm accumulators (no minimum terms) */
#else
#define Q8R QR
#endif
#if defined(LM_QDOT_512)
/* vpdpbusd multiplies unsigned by signed bytes: the activations are stored biased (Q8_BIASED),
 * u = qx + 128 (qx ^ 0x80), so u . q = qx . q + 128 sum(q): each int32 lane starts at -128 *
 * (its 4 q), computed once per weight block for all rows, and ends exact (|u q| sums of 4 stay
 * below 4 * 255 * 127). */
INL __m512i q8_corr(__m512i w) {
    const __m512i z = _mm512_setzero_si512();
    return _mm512_sub_epi32(z, _mm512_dpbusd_epi32(z, _mm512_set1_epi8((char)0x80), w));
}

INL __m512 q8_pair_row(__m512 acc, __m512i w, __m512i wc, const int8_t *xt, const float *lt, int g) {
    const __m512i d = _mm512_dpbusd_epi32(wc, _mm512_loadu_si512(xt + g * QB), w);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(lt + g * 8), acc);  /* dx in its lanes */
}

INL void q8_rows_n(const int8_t *qn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, float *res) {
    __m512 a0[Q8R], a1[Q8R];
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int g = 0;
    for (; g + 3 < G; g += 4) {
        const __m512i w0 = _mm512_loadu_si512(qn + g * QB), w1 = _mm512_loadu_si512(qn + (g + 2) * QB);
        const __m512i c0 = q8_corr(w0), c1 = q8_corr(w1);
        for (int r = 0; r < nr; r++) {
            const int8_t *xt = x + r * K;
            const float *lt = l + r * (K / 4);
            a0[r] = q8_pair_row(a0[r], w0, c0, xt, lt, g);
            a1[r] = q8_pair_row(a1[r], w1, c1, xt, lt, g + 2);
        }
    }
    if (g + 1 < G) {
        const __m512i w0 = _mm512_loadu_si512(qn + g * QB), c0 = q8_corr(w0);
        for (int r = 0; r < nr; r++) a0[r] = q8_pair_row(a0[r], w0, c0, x + r * K, l + r * (K / 4), g);
        g += 2;
    }
    for (int r = 0; r < nr; r++) res[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    if (g < G) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qn + g * QB)), z = _mm256_setzero_si256();
        const __m256i wc = _mm256_sub_epi32(z, _mm256_dpbusd_epi32(z, _mm256_set1_epi8((char)0x80), w));
        for (int r = 0; r < nr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * K + g * QB));
            const __m256i d = _mm256_dpbusd_epi32(wc, xv, w);
            res[r] += hsum256(_mm256_cvtepi32_ps(d)) * a[r * 2 * G + 2 * g];
        }
    }
}
#elif defined(LM_QDOT_256)
/* |q| . (qx * sign(q)) = q . qx, with |q| <= 127 unsigned: pairs stay within int16 */
INL __m256 q8_block_row(__m256 acc, __m256i w, __m256i wabs, const int8_t *xt, const float *at, int g) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xt + g * QB));
    const __m256i d = dot_u8s8(wabs, _mm256_sign_epi8(xv, w));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(at + 2 * g), acc);
}

INL void q8_rows_n(const int8_t *qn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, float *res) {
    (void)l;
    __m256 a0[Q8R], a1[Q8R];
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 1 < G; g += 2) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(qn + g * QB));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(qn + (g + 1) * QB));
        const __m256i b0 = _mm256_sign_epi8(w0, w0), b1 = _mm256_sign_epi8(w1, w1);
        for (int r = 0; r < nr; r++) {
            a0[r] = q8_block_row(a0[r], w0, b0, x + r * K, a + r * 2 * G, g);
            a1[r] = q8_block_row(a1[r], w1, b1, x + r * K, a + r * 2 * G, g + 1);
        }
    }
    if (g < G) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(qn + g * QB)), b0 = _mm256_sign_epi8(w0, w0);
        for (int r = 0; r < nr; r++) a0[r] = q8_block_row(a0[r], w0, b0, x + r * K, a + r * 2 * G, g);
    }
    for (int r = 0; r < nr; r++) res[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}
#else
/* q4_scale_row's counterpart: acc + sum_g d[g - g0] * dx[g] */
static __attribute__((noinline, noclone)) float q8_scale_row(float acc, const int32_t *d, const float *at, int g0,
                                                             int g1) {
    for (int g = g0; g < g1; g++) acc += (float)d[g - g0] * at[2 * g];
    return acc;
}

INL void q8_rows_n(const int8_t *qn, const int8_t *x, const float *a, const float *l, int K,
                   int G, const int nr, float *res) {
    (void)l;
    float acc[Q8R];
    for (int r = 0; r < nr; r++) acc[r] = 0.f;
    for (int g0 = 0; g0 < G; g0 += PCH) {
        const int g1 = g0 + PCH < G ? g0 + PCH : G;
        int32_t d[Q8R][PCH];
        for (int g = g0; g < g1; g++)
            for (int r = 0; r < nr; r++) {
                const int8_t *xg = x + r * K + g * QB;
                int32_t s = 0;
                for (int j = 0; j < QB; j++) s += qn[g * QB + j] * xg[j];
                d[r][g - g0] = s;
            }
        for (int r = 0; r < nr; r++) acc[r] = q8_scale_row(acc[r], d[r], a + r * 2 * G, g0, g1);
    }
    for (int r = 0; r < nr; r++) res[r] = acc[r];
}
#endif

_Static_assert(QR == 4 && (Q8R == 4 || Q8R == 8), "SPAN_CASES / SPAN_CASES8 spell out nr");
#if defined(LM_QDOT_ONE_ROW)
#define ROWS 1         /* the unblocked loop (one row per pass; bench/ab_qdot.py's baseline) */
#define ROWS8 1
#else
#define ROWS QR
#define ROWS8 Q8R
#endif
#ifndef SPAN_BYTES
#define SPAN_BYTES 8192 /* weight bytes per span (at least one row): they stay in L1 beside the row blocks' data */
#endif
#define NB_MAX 32      /* weight rows per span at most */

/* nr (1..QR) as a constant in each case, so every case is its own register-allocated copy of
 * the inlined body and the dispatch happens once per span, not per weight row */
#define SPAN_CASES(call)                                                                  \
    switch (nr) {                                                                         \
    case 1: call(1); break;                                                               \
    case 2: call(2); break;                                                               \
    case 3: call(3); break;                                                               \
    default: call(QR); break;                                                             \
    }
#if Q8R == 8
#define SPAN_CASES8(call)                                                                 \
    switch (nr) {                                                                         \
    case 1: call(1); break;                                                               \
    case 2: call(2); break;                                                               \
    case 3: call(3); break;                                                               \
    case 4: call(4); break;                                                               \
    case 5: call(5); break;                                                               \
    case 6: call(6); break;                                                               \
    case 7: call(7); break;                                                               \
    default: call(8); break;                                                              \
    }
#else
#define SPAN_CASES8 SPAN_CASES
#endif
/* ---- entry points --------------------------------------------------------------------------- */
#if defined(LM_QDOT_512)
#define Q4_LAYOUT LAYOUT_PAIRS  /* int4-weight activations in pair order (see block_base) */
#elif defined(LM_QDOT_256)
#define Q4_LAYOUT LAYOUT_QUADS  /* in quad order (see block_base) */
#else
#define Q4_LAYOUT LAYOUT_NATURAL
#endif
#if defined(LM_QDOT_512)
#define Q8_BIASED 1    /* int8-weight activations stored as qx ^ 0x80 (see q8_corr) */
#define DXL 1
#else
#define Q8_BIASED 0
#define DXL 0
#endif

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
    const size_t need = nq + na + (DXL ? sizeof(float) * (size_t)T * (K / 4) : 0);
    char *base;
    a->owned = NULL;
    a->quads = 0;
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
    a->dxl = DXL ? (float *)(base + nq + na) : NULL;
    return 1;
}

static void act_free(act_t *a) { free(a->owned); }

/* Every row of x [T, K] into a's scratch (natural order, pairs for int4 on AVX-512, biased for
 * int8 on AVX-512). */
static void quantize_all(const float *x, int T, int K, int layout, int biased, act_t *a) {
    const int G = K / QB;
    for (int t = 0; t < T; t++)
        quantize_row(x + (int64_t)t * K, K, layout, biased, a->qx + (int64_t)t * K, a->aux + (int64_t)t * 2 * G,
                     DXL ? a->dxl + (int64_t)t * (K / 4) : NULL);
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

/* Weight rows per span: up to SPAN_BYTES of weights (row_bytes each) and NB_MAX rows, fewer when
 * N is small, so every thread gets about 4 spans. */
static int64_t span_rows(int64_t N, int nthreads, int64_t row_bytes) {
    const int64_t per = (N + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)(nthreads > 0 ? nthreads : 1));
    int64_t cap = SPAN_BYTES / row_bytes;
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

/* Weight rows to prefetch ahead of the one being multiplied, for calls of T rows whose rows hold
 * row_bytes of weights (and scales) each: at one or two activation rows a call streams its
 * weights from memory with little compute per byte, and the hardware prefetchers, which stop at
 * each 4 KB page and restart at each span, leave both cores waiting on misses; explicit
 * non-temporal prefetches a few KB ahead (measured: 2-8 KB alike) keep the loads in flight. */
static int64_t prefetch_rows(int T, int64_t row_bytes) {
    return prefetch_bytes > 0 && T <= PREFETCH_MAX_T ? (prefetch_bytes + row_bytes - 1) / row_bytes : 0;
}

/* every cache line of p [0, n) toward L1, not to be kept (weights are read once a step) */
static inline void prefetch_span(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o, 0, 0);
}

/* Threads for a call: one (no pool job to publish and wake workers for) when its weights x row
 * blocks are under SERIAL_BYTES, else nthreads.
 * Either way each row's float order is the same (the spans only split the weight rows). */
static int threads_for(int64_t N, int64_t row_bytes, int T, int rows, int nthreads) {
    const int64_t passes = (T + rows - 1) / rows;
    return N * row_bytes * passes < SERIAL_BYTES ? 1 : nthreads;
}

/* weight rows n0..n1 (int4) x activation rows t..t+nr-1 -> y [T, N] */
static void q4_span(const act_t *a, int t, int nr, int K, const uint8_t *q, const uint16_t *sz, int64_t n0,
                    int64_t n1, int64_t N, float *y, int64_t ahead) {
    const int G = K / QB;
    const int8_t *x = a->qx + (int64_t)t * K;
    const float *at = a->aux + (int64_t)t * 2 * G, *l = DXL ? a->dxl + (int64_t)t * (K / 4) : NULL;
#define Q4_CALLQ(R_, Q_)                                                                  \
    for (int64_t n = n0; n < n1; n++) {                                                   \
        float res[QR];                                                                    \
        if (ahead && n + ahead < N) {                                                     \
            prefetch_span(q + (n + ahead) * (K / 2), K / 2);                              \
            prefetch_span(sz + (n + ahead) * 2 * G, 4 * G);                               \
        }                                                                                 \
        q4_rows_n(q + n * (K / 2), sz + n * 2 * G, x, at, l, K, G, R_, Q_, res);          \
        for (int r = 0; r < R_; r++) y[(int64_t)(t + r) * N + n] = res[r];                \
    }
#define Q4_CALL(R_) Q4_CALLQ(R_, 0)
#define Q4_CALL_QUADS(R_) Q4_CALLQ(R_, 1)
    if (a->quads) {
        SPAN_CASES(Q4_CALL_QUADS)
    } else {
        SPAN_CASES(Q4_CALL)
    }
#undef Q4_CALL_QUADS
#undef Q4_CALL
#undef Q4_CALLQ
}

/* weight rows n0..n1 (int8, scale [N]) x activation rows t..t+nr-1 -> y [T, N] */
static void q8_span(const act_t *a, int t, int nr, int K, const int8_t *q, const float *scale, int64_t n0,
                    int64_t n1, int64_t N, float *y, int64_t ahead) {
    const int G = K / QB;
    const int8_t *x = a->qx + (int64_t)t * K;
    const float *at = a->aux + (int64_t)t * 2 * G, *l = DXL ? a->dxl + (int64_t)t * (K / 4) : NULL;
#define Q8_CALL(R_)                                                                       \
    for (int64_t n = n0; n < n1; n++) {                                                   \
        float res[Q8R];                                                                   \
        if (ahead && n + ahead < N) prefetch_span(q + (n + ahead) * K, K);                \
        q8_rows_n(q + n * K, x, at, l, K, G, R_, res);                                 \
        for (int r = 0; r < R_; r++) y[(int64_t)(t + r) * N + n] = scale[n] * res[r];     \
    }
    SPAN_CASES8(Q8_CALL)
#undef Q8_CALL
}

/* One pass of a call: weight-row span sp against activation rows t0..t1. */
typedef struct {
    const act_t *a;
    int t0, t1, K;
    const void *q, *scales;
    int64_t nb, N;
    float *y;
    int64_t ahead;  /* weight rows prefetched ahead (prefetch_rows) */
} pass_t;

static void q4_pass_span(const void *c, int64_t sp) {
    const pass_t *p = c;
    const int64_t n0 = sp * p->nb, n1 = n0 + p->nb < p->N ? n0 + p->nb : p->N;
    for (int t = p->t0; t < p->t1; t += ROWS)
        q4_span(p->a, t, p->t1 - t < ROWS ? p->t1 - t : ROWS, p->K, p->q, p->scales, n0, n1, p->N, p->y,
                p->ahead);
}

static void q8_pass_span(const void *c, int64_t sp) {
    const pass_t *p = c;
    const int64_t n0 = sp * p->nb, n1 = n0 + p->nb < p->N ? n0 + p->nb : p->N;
    for (int t = p->t0; t < p->t1; t += ROWS8)
        q8_span(p->a, t, p->t1 - t < ROWS8 ? p->t1 - t : ROWS8, p->K, p->q, p->scales, n0, n1, p->N, p->y,
                p->ahead);
}

/* x float32 [T, K], q uint8 [N, K/2] (qgemm.c's nibble order), sz float16 [N, K/32, 2] (s, m)
 * -> y [T, N]. Returns 0, or -1 when scratch could not be allocated (y untouched). Threads split
 * the weight rows (spans); each span meets every row block of a chunk while its weights are cached. */
int lm_q4x8_gemm(const float *x, int T, int K, const uint8_t *q, const uint16_t *sz, int64_t N, float *y,
                 int nthreads) {
    const int G = K / QB;
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K)) return -1;
    /* one row keeps the pair order (see q4_rows_n); the sums are the same either way */
    const int layout = Q4_LAYOUT == LAYOUT_QUADS && T == 1 ? LAYOUT_PAIRS : Q4_LAYOUT;
    quantize_all(x, T, K, layout, 0, &a);
    a.quads = layout == LAYOUT_QUADS;
    const int nt = threads_for(N, K / 2 + 4 * G, T, ROWS, nthreads);
    const int64_t nb = span_rows(N, nt, K / 2 + 4 * G), spans = (N + nb - 1) / nb;
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {  /* one pool job per chunk */
        const pass_t p = {&a, t0, t0 + T_CHUNK < T ? t0 + T_CHUNK : T, K, q, sz, nb, N, y,
                          prefetch_rows(T, K / 2 + 4 * G)};
        pool_run(q4_pass_span, &p, spans, nt);
    }
    act_free(&a);
    return 0;
}

/* x float32 [T, K], q int8 [N, K], scale float32 [N] (qgemm.c's int8 layout) -> y [T, N]. */
int lm_q8x8_gemm(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, float *y,
                 int nthreads) {
    act_t a;
    if (T <= 0 || N <= 0) return 0;
    if (!act_alloc(&a, T, K)) return -1;
    quantize_all(x, T, K, 0, Q8_BIASED, &a);
    const int nt = threads_for(N, K, T, ROWS8, nthreads);
    const int64_t nb = span_rows(N, nt, K), spans = (N + nb - 1) / nb;
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
        const pass_t p = {&a, t0, t0 + T_CHUNK < T ? t0 + T_CHUNK : T, K, q, scale, nb, N, y,
                          prefetch_rows(T, K)};
        pool_run(q8_pass_span, &p, spans, nt);
    }
    act_free(&a);
    return 0;
}
