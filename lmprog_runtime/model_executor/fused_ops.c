/* Small fused CPU ops for the decode step, where each op's own cost is dispatch, not math:
 * one C call instead of the five to seven torch ops an RMSNorm (+ residual add) dispatches.
 *
 *   lm_add_rms_norm: s = x (+ r); out = s / sqrt(mean(s^2) + eps) * w; s written to sum_out
 * x, r, sum_out, out float32 [T, H] row-major; w float32 [H]; r and sum_out may be NULL
 * (then s = x). Rows are independent; large T is split across OpenMP threads.
 *
 *   lm_silu_mul: out[t, i] = silu(gu[t, i]) * gu[t, I + i], gu float32 [T, 2I] (gate | up, the
 * fused gate_up projection's output), out float32 [T, I]. silu(g) = g / (1 + exp(-g)) with exp
 * a vectorized polynomial (a few ulp from expf; not torch's bits): the quantized models' MLP
 * calls this one function on both the layer-by-layer and the fused-layer path (llama_layer.py),
 * so those two agree bit for bit. Each value is computed alone (no cross-lane reduction), so a
 * row's result does not depend on T or the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));

static inline v16f ld(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static void norm_row(const float *x, const float *r, float *s_out, const float *w, float *out, int64_t H,
                     float eps) {
    const int64_t H16 = H - H % 16;
    v16f acc = {0};
    float tail = 0.f;
    for (int64_t h = 0; h < H16; h += 16) {
        v16f s = ld(x + h);
        if (r) { s += ld(r + h); st(s_out + h, s); }
        acc += s * s;
    }
    for (int64_t h = H16; h < H; h++) {
        float s = x[h] + (r ? r[h] : 0.f);
        if (r) s_out[h] = s;
        tail += s * s;
    }
    float ss = tail;
    for (int j = 0; j < 16; j++) ss += acc[j];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    const float *src = r ? s_out : x;
    for (int64_t h = 0; h < H16; h += 16) st(out + h, ld(src + h) * inv * ld(w + h));
    for (int64_t h = H16; h < H; h++) out[h] = src[h] * inv * w[h];
}

void lm_add_rms_norm(const float *x, const float *r, float *sum_out, const float *w, float *out, int64_t T,
                     int64_t H, float eps, int nthreads) {
    if (T < 64) {  /* as lm_silu_mul */
        for (int64_t t = 0; t < T; t++)
            norm_row(x + t * H, r ? r + t * H : NULL, r ? sum_out + t * H : NULL, w, out + t * H, H, eps);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, r ? r + t * H : NULL, r ? sum_out + t * H : NULL, w, out + t * H, H, eps);
}

/* silu's vectors: 16 lanes with AVX-512, else 8 (GCC compares vectors wider than the machine's
 * lane by lane in scalar code: a 16-lane silu on AVX2 ran ~10x slower). Each value is computed
 * alone, so the width changes no bit. */
#if defined(__AVX512F__)
#define SW 16
#else
#define SW 8
#endif
typedef float svf __attribute__((vector_size(4 * SW)));
typedef int32_t svi __attribute__((vector_size(4 * SW)));
static inline svf lds(const float *p) { svf v; memcpy(&v, p, sizeof v); return v; }
static inline void sts(float *p, svf v) { memcpy(p, &v, sizeof v); }

/* m ? a : b per lane (m: a comparison's all-ones / zero lanes) */
static inline svf pick(svi m, svf a, svf b) { return (svf)((m & (svi)a) | (~m & (svi)b)); }

/* exp(x) per lane: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-5 expf polynomial,
 * 2^n by building the exponent bits. x is clamped to [-87, 88] (results stay normal); NaN lanes
 * come out finite, so callers keep the NaN through another operand (silu's g). */
static inline svf expv(svf x) {
    x = pick(x < 88.f, x, (svf){0} + 88.f);
    x = pick(x > -87.f, x, (svf){0} - 87.f);
    /* n = nearest integer of x / ln2, via truncation of a positive value (no magic-number add,
     * which -fassociative-math would fold away) */
    const svi n = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, svi) - 128;
    const svf nf = __builtin_convertvector(n, svf);
    const svf r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
    svf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    svi bits = (n + 127) << 23;
    svf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline svf silu_mulv(svf g, svf u) { return g / (1.f + expv(-g)) * u; }

static void silu_mul_row(const float *gate, const float *up, float *out, int64_t I) {
    const int64_t IV = I - I % SW;
    for (int64_t i = 0; i < IV; i += SW) sts(out + i, silu_mulv(lds(gate + i), lds(up + i)));
    if (IV < I) {  /* the tail through the same lanes' maths, zero-padded */
        float g[SW] = {0}, u[SW] = {0}, o[SW];
        memcpy(g, gate + IV, sizeof(float) * (size_t)(I - IV));
        memcpy(u, up + IV, sizeof(float) * (size_t)(I - IV));
        sts(o, silu_mulv(lds(g), lds(u)));
        memcpy(out + IV, o, sizeof(float) * (size_t)(I - IV));
    }
}

void lm_silu_mul(const float *gu, int64_t T, int64_t I, float *out, int nthreads) {
    if (T < 64) {  /* no OpenMP region at all (an `if` clause still enters one: ~1 us a call) */
        for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
}
