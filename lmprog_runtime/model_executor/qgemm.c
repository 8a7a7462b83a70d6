/* Weight-only int8 and int4 matmuls for the CPU decode path (few activation rows: the step is
 * bound by reading weights, so each weight byte is read from memory once per call).
 *
 * Written with GCC/Clang vector extensions (16 float lanes): compiled with -march=native they
 * become one AVX-512 register or two AVX2 ones, so one source serves every x86 CPU (and others).
 * All tensors are row-major and contiguous; K is a multiple of 32 (callers check).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v16i32 __attribute__((vector_size(64)));

static inline v16f load_f(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
/* widened in two steps (bytes -> int32 -> float), which compilers vectorize; signed bytes go
 * through the unsigned path (GCC 12 scalarizes the signed widening): q = (q ^ 0x80) - 128 */
static inline v16f u8_to_f(v16u8 v) { return __builtin_convertvector(__builtin_convertvector(v, v16i32), v16f); }
static inline v16f load_i8(const int8_t *p) {
    v16u8 v;
    memcpy(&v, p, sizeof v);
    return u8_to_f(v ^ (uint8_t)0x80) - 128.f;
}
static inline v16u8 load_u8(const uint8_t *p) { v16u8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v16f v) {
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += v[j];
    return s;
}

/* int8, one symmetric scale per output row:
 *   y[t, n] = scale[n] * sum_k x[t, k] * q[n, k]
 * x float32 [T, K], q int8 [N, K], scale float32 [N], y float32 [T, N]. Output rows are split
 * across threads in blocks of 4; a block's 4 weight rows (4K bytes, in L1) are widened and
 * multiplied with every activation row. */
static void q8_rows4(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, int64_t n0,
                     float *y) {
    const int8_t *q0 = q + n0 * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * K;
        v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int k = 0; k < K; k += 16) {
            const v16f xv = load_f(xt + k);
            a0 += xv * load_i8(q0 + k);
            a1 += xv * load_i8(q1 + k);
            a2 += xv * load_i8(q2 + k);
            a3 += xv * load_i8(q3 + k);
        }
        float *yt = y + (int64_t)t * N + n0;
        yt[0] = hsum(a0) * scale[n0];
        yt[1] = hsum(a1) * scale[n0 + 1];
        yt[2] = hsum(a2) * scale[n0 + 2];
        yt[3] = hsum(a3) * scale[n0 + 3];
    }
}

static void q8_row(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, int64_t n,
                   float *y) {
    const int8_t *qn = q + n * K;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * K;
        v16f a = {0};
        for (int k = 0; k < K; k += 16) a += load_f(xt + k) * load_i8(qn + k);
        y[(int64_t)t * N + n] = hsum(a) * scale[n];
    }
}

void lm_q8_gemm(const float *x, int T, int K, const int8_t *q, const float *scale, int64_t N, float *y,
                int nthreads) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 4;
        if (n0 + 4 <= N) {
            q8_rows4(x, T, K, q, scale, N, n0, y);
        } else {
            for (int64_t n = n0; n < N; n++) q8_row(x, T, K, q, scale, N, n, y);
        }
    }
}

/* int4, groups of 32 inputs per output row (GGUF Q4 blocks' layout):
 *   w[n, k] = q[n, k] * scale[n, g] + zmin[n, g],  g = k / 32, q in 0..15
 * q packed [N, K/2]: byte j of group g holds q[32g + j] in its low nibble and q[32g + 16 + j] in
 * its high one; sz float32 [N, K/32, 2] = (scale, zmin). So
 *   y[t, n] = sum_g scale[n, g] * (x[t, g-block] . q[n, g-block]) + zmin[n, g] * xsum[t, g]
 * with xsum[t, g] the sum of x over group g (computed once per call, `xsum` scratch [T, K/32]).
 * The 16-lane partial sums stay in registers across a row's groups (one reduction per row). */
static void q4_row(const float *x, int T, int K, const uint8_t *qn, const float *szn, const float *xsum,
                   int64_t N, int64_t n, float *y) {
    const int G = K / 32;
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * K, *st = xsum + (int64_t)t * G;
        v16f acc = {0};
        float zsum = 0.f;
        for (int g = 0; g < G; g++) {
            const v16u8 b = load_u8(qn + g * 16);
            const v16f lo = u8_to_f(b & low), hi = u8_to_f(b >> 4);
            const float *xg = xt + g * 32;
            acc += szn[2 * g] * (load_f(xg) * lo + load_f(xg + 16) * hi);
            zsum += szn[2 * g + 1] * st[g];
        }
        y[(int64_t)t * N + n] = hsum(acc) + zsum;
    }
}

void lm_q4_gemm(const float *x, int T, int K, const uint8_t *q, const float *sz, int64_t N, float *y,
                int nthreads) {
    const int G = K / 32;
    float *xsum = malloc(sizeof(float) * (size_t)T * G);
    if (xsum == NULL) return;  /* callers check K and shapes; out of memory leaves y untouched */
    for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
            const float *xg = x + (int64_t)t * K + g * 32;
            float s = 0.f;
            for (int j = 0; j < 32; j++) s += xg[j];
            xsum[(int64_t)t * G + g] = s;
        }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++)
        q4_row(x, T, K, q + n * (K / 2), sz + n * 2 * G, xsum, N, n, y);
    free(xsum);
}
