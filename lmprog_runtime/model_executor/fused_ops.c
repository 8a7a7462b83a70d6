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
typedef int32_t v16i __attribute__((vector_size(64)));

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
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, r ? r + t * H : NULL, r ? sum_out + t * H : NULL, w, out + t * H, H, eps);
}

/* m ? a : b per lane (m: a comparison's all-ones / zero lanes) */
static inline v16f pick(v16i m, v16f a, v16f b) { return (v16f)((m & (v16i)a) | (~m & (v16i)b)); }

/* exp(x) per lane: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-5 expf polynomial,
 * 2^n by building the exponent bits. x is clamped to [-87, 88] (results stay normal); NaN lanes
 * come out finite, so callers keep the NaN through another operand (silu's g). */
static inline v16f exp16(v16f x) {
    x = pick(x < 88.f, x, (v16f){0} + 88.f);
    x = pick(x > -87.f, x, (v16f){0} - 87.f);
    /* n = nearest integer of x / ln2, via truncation of a positive value (no magic-number add,
     * which -fassociative-math would fold away) */
    const v16i n = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, v16i) - 128;
    const v16f nf = __builtin_convertvector(n, v16f);
    const v16f r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
    v16f p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    v16i bits = (n + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline v16f silu_mul16(v16f g, v16f u) { return g / (1.f + exp16(-g)) * u; }

static void silu_mul_row(const float *gate, const float *up, float *out, int64_t I) {
    const int64_t I16 = I - I % 16;
    for (int64_t i = 0; i < I16; i += 16) st(out + i, silu_mul16(ld(gate + i), ld(up + i)));
    if (I16 < I) {  /* the tail through the same lanes' maths, zero-padded */
        float g[16] = {0}, u[16] = {0}, o[16];
        memcpy(g, gate + I16, sizeof(float) * (size_t)(I - I16));
        memcpy(u, up + I16, sizeof(float) * (size_t)(I - I16));
        st(o, silu_mul16(ld(g), ld(u)));
        memcpy(out + I16, o, sizeof(float) * (size_t)(I - I16));
    }
}

void lm_silu_mul(const float *gu, int64_t T, int64_t I, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
}
