/* Small fused CPU ops for the decode step, where each op's own cost is dispatch, not math:
 * one C call instead of the five to seven torch ops an RMSNorm (+ residual add) dispatches.
 *
 *   lm_add_rms_norm: s = x (+ r); out = s / sqrt(mean(s^2) + eps) * w; s written to sum_out
 * x, r, sum_out, out float32 [T, H] row-major; w float32 [H]; r and sum_out may be NULL
 * (then s = x). Rows are independent; large T is split across OpenMP threads.
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
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, r ? r + t * H : NULL, r ? sum_out + t * H : NULL, w, out + t * H, H, eps);
}
