/* A fused CPU op of the decoder layer, float32, where torch dispatches a dozen small ops whose
 * cost is all dispatch (rope of q and k, then the K/V cache write).
 *
 *   lm_rope_kv: qkv [T, (H + 2 KV) * D] row-major (q heads, k heads, v heads of each token);
 *     table [P, 2, D] (cos with halves repeated; sin with its first half negated);
 *     pos [T] int64 in [0, P); slots [T] int64 in [0, slots) (checked: -1 otherwise).
 *     q_out[t, h, i] = q[i] * cos[i] + q[(i + D/2) % D] * ssin[i]   (rotate-half rope)
 *     k_cache[slots[t], j, :] = rope(k[t, j, :]); v_cache[slots[t], j, :] = v[t, j, :]
 *     k_cache, v_cache float32 [slots, KV, D], or bfloat16 with kv_bf16 (--kv-cache-dtype bf16):
 *     each value rounded to nearest even, as torch's float32 -> bfloat16 conversion rounds it.
 *
 * Built with -ffp-contract=off: rope is the same two products and one sum per value as torch's
 * `x * cos + swapped * ssin`, bit for bit. (silu * up was tried here too: with a scalar expf it
 * was slower than torch's three ops at batch 1, so the model keeps torch's.) Tokens are
 * independent; large T is split across threads.
 */
#include <stdint.h>
#include <string.h>

static inline void rope_row(const float *x, const float *cos, const float *ssin, float *out, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * ssin[i];
    for (int i = half; i < D; i++) out[i] = x[i] * cos[i] + x[i - half] * ssin[i];
}

/* float32 -> bfloat16 bits, round to nearest even; any NaN -> 0xFFFF (what torch's vectorized CPU
 * conversion writes) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_bf16(const float *x, uint16_t *out, int n) {
    for (int i = 0; i < n; i++) out[i] = to_bf16(x[i]);
}

static void rope_kv_row(const float *qkv, int64_t t, int H, int KV, int D, const float *table, const int64_t *pos,
                        const int64_t *slots, float *q_out, void *k_cache, void *v_cache, int kv_bf16) {
    const float *x = qkv + t * (int64_t)(H + 2 * KV) * D;
    const float *cos = table + pos[t] * 2 * D, *ssin = cos + D;
    for (int h = 0; h < H; h++) rope_row(x + h * D, cos, ssin, q_out + (t * H + h) * D, D);
    if (kv_bf16) {
        uint16_t *kd = (uint16_t *)k_cache + slots[t] * KV * D, *vd = (uint16_t *)v_cache + slots[t] * KV * D;
        float kr[D];
        for (int j = 0; j < KV; j++) {
            rope_row(x + (H + j) * D, cos, ssin, kr, D);
            store_bf16(kr, kd + j * D, D);
        }
        store_bf16(x + (int64_t)(H + KV) * D, vd, KV * D);
        return;
    }
    float *kd = (float *)k_cache + slots[t] * KV * D, *vd = (float *)v_cache + slots[t] * KV * D;
    for (int j = 0; j < KV; j++) rope_row(x + (H + j) * D, cos, ssin, kd + j * D, D);
    memcpy(vd, x + (int64_t)(H + KV) * D, sizeof(float) * KV * D);
}

/* Returns 0, or -1 (nothing written) when a position is outside [0, positions) or a slot outside
 * [0, num_slots): the op checks its own indices, once per call, so callers need no torch
 * reductions over them first. */
int lm_rope_kv(const float *qkv, int64_t T, int H, int KV, int D, const float *table, const int64_t *pos,
               const int64_t *slots, float *q_out, void *k_cache, void *v_cache, int kv_bf16, int64_t positions,
               int64_t num_slots, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= positions || slots[t] < 0 || slots[t] >= num_slots) return -1;
    if (T < 64) {  /* no OpenMP region at all (an `if` clause still enters one: ~1 us a call) */
        for (int64_t t = 0; t < T; t++) rope_kv_row(qkv, t, H, KV, D, table, pos, slots, q_out, k_cache, v_cache, kv_bf16);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < T; t++) rope_kv_row(qkv, t, H, KV, D, table, pos, slots, q_out, k_cache, v_cache, kv_bf16);
    return 0;
}
