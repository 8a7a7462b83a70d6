/* Paged decode attention on the CPU, reading K/V in place from the token pool.
 *
 * One query token per request. For request b and query head h (kv head h / G):
 *   out[b, h] = softmax_s(scale * q[b, h] . k[slot(b, s)]) @ v[slot(b, s)],  s < seq_len[b]
 * slot(b, s) = prefix[s] for s < P (a prefix every request shares: cascade), else
 * table[rows[b] * ld + s]. Shapes (float32, contiguous):
 *   q, out [B, H, D]; k, v [num_slots, KV, D]; prefix int64 [P]; table int64 [*, ld];
 *   rows, seq_lens int64 [B], every seq_len > P.
 * Work is split into tasks run by OpenMP threads: (kv head, chunk of `chunk` prefix keys) for
 * all B requests at once, so each shared key is read once per step, and (request, kv head,
 * chunk of own keys). Each task keeps an online softmax (running max m, denominator l,
 * accumulator acc) per query head; the parts of one (request, head) are merged exactly
 * afterwards (common max, summed denominators). Scratch: B * KV * parts * G * (D + 2) floats,
 * parts = prefix chunks + own chunks; one part is [m G][l G][acc G * D].
 * K/V may instead be bfloat16 (kv_bf16 = 1): each key/value row is widened to float32 exactly
 * (bf16 is the top half of a float32) before the same float32 arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 512

/* Row `row` of a [*, D] K or V buffer as float32: in place, or widened into buf. */
static inline const float *kv_row(const void *base, int64_t row, int D, int bf16, float *buf) {
    if (!bf16) return (const float *)base + row * D;
    const uint16_t *src = (const uint16_t *)base + row * D;
    for (int d = 0; d < D; d++) {
        uint32_t bits = (uint32_t)src[d] << 16;
        memcpy(buf + d, &bits, 4);
    }
    return buf;
}

/* exp(x) for x <= 0 (and x > -inf), branch-free so loops over it vectorize: 2^(x log2 e) as
 * 2^n * 2^f with f in [-0.5, 0.5] by a degree-6 polynomial; relative error below 2e-7. Inputs
 * under -87 give a tiny positive number instead of 0 (harmless in a softmax sum). */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504f;
    float n = __builtin_roundf(t), f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#define TILE 32  /* keys per tile: one max / rescale per tile, not per key */

/* Keys s0..s1 of `slots` against the G query heads of kv head kvh of nb requests; request i's
 * queries start at q + i * qstride, its part at m + i * pstride (l, acc follow). Keys are taken
 * TILE at a time: scores of the tile, its max, one rescale of the running part, exps, then
 * acc += p @ V over the tile (flash-attention's online softmax, per tile). */
static void chunk_attend(const float *q, int64_t qstride, int nb, const void *k, const void *v, int bf16,
                         const int64_t *slots, int64_t s0, int64_t s1, int KV, int G, int D, int kvh,
                         float scale, float *m, int64_t pstride) {
    float kbuf[bf16 ? TILE * D : 1], vbuf[bf16 ? TILE * D : 1], sc[TILE];
    const float *kr[TILE], *vr[TILE];
    for (int i = 0; i < nb; i++) {
        float *mi = m + i * pstride, *li = mi + G, *ai = li + G;
        for (int g = 0; g < G; g++) { mi[g] = -INFINITY; li[g] = 0.f; }
        for (int x = 0; x < G * D; x++) ai[x] = 0.f;
    }
    for (int64_t t0 = s0; t0 < s1; t0 += TILE) {
        const int n = s1 - t0 < TILE ? (int)(s1 - t0) : TILE;
        for (int j = 0; j < n; j++) {
            kr[j] = kv_row(k, slots[t0 + j] * KV + kvh, D, bf16, kbuf + (bf16 ? j * D : 0));
            vr[j] = kv_row(v, slots[t0 + j] * KV + kvh, D, bf16, vbuf + (bf16 ? j * D : 0));
        }
        for (int i = 0; i < nb; i++) {
            float *mi = m + i * pstride, *li = mi + G, *ai = li + G;
            for (int g = 0; g < G; g++) {
                const float *qg = q + i * qstride + g * D;
                float *ag = ai + g * D;
                float tmax = -INFINITY;
                for (int j = 0; j < n; j++) {
                    const float *kj = kr[j];
                    float dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qg[d] * kj[d];
                    sc[j] = dot * scale;
                    tmax = sc[j] > tmax ? sc[j] : tmax;
                }
                if (tmax > mi[g]) {  /* new running max: rescale what was summed so far */
                    float c = mi[g] == -INFINITY ? 0.f : exp_nonpos(mi[g] - tmax);
                    li[g] *= c;
                    for (int d = 0; d < D; d++) ag[d] *= c;
                    mi[g] = tmax;
                }
                const float mx = mi[g];
                float sum = 0.f;
                for (int j = 0; j < n; j++) {
                    sc[j] = exp_nonpos(sc[j] - mx);
                    sum += sc[j];
                }
                li[g] += sum;
                for (int j = 0; j < n; j++) {
                    const float p = sc[j], *vj = vr[j];
                    for (int d = 0; d < D; d++) ag[d] += p * vj[d];
                }
            }
        }
    }
}

static void empty_part(float *m, int G) {
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; m[G + g] = 0.f; }
}

/* out[b, kvh * G + g] from the `parts` parts of (b, kvh) starting at `base`. */
static void merge_parts(const float *base, int64_t parts, int64_t per_task, int G, int D, float *o) {
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY, den = 0.f;
        for (int64_t c = 0; c < parts; c++) {
            float mc = base[c * per_task + g];
            if (mc > mx) mx = mc;
        }
        float *og = o + g * D;
        for (int d = 0; d < D; d++) og[d] = 0.f;
        for (int64_t c = 0; c < parts; c++) {
            const float *part = base + c * per_task;
            if (part[G + g] == 0.f) continue;
            float w = expf(part[g] - mx);
            den += w * part[G + g];
            const float *ac = part + 2 * G + g * D;
            for (int d = 0; d < D; d++) og[d] += w * ac[d];
        }
        for (int d = 0; d < D; d++) og[d] /= den;
    }
}

void lm_paged_decode(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *prefix, int64_t P,
                     const int64_t *table, int64_t ld, const int64_t *rows, const int64_t *seq_lens,
                     int B, int H, int KV, int D, float scale, int64_t chunk, int nthreads,
                     float *scratch, float *out) {
    const int G = H / KV;
    const int64_t pre_chunks = (P + chunk - 1) / chunk;
    int64_t own_chunks = pre_chunks ? 0 : 1;  /* at least one part per (request, head) */
    for (int b = 0; b < B; b++) {
        int64_t n = (seq_lens[b] - P + chunk - 1) / chunk;
        if (n > own_chunks) own_chunks = n;
    }
    const int64_t parts = pre_chunks + own_chunks, per_task = (int64_t)G * (D + 2);
    const int64_t pstride = (int64_t)KV * parts * per_task;  /* from request b to b + 1 */
    const int64_t pre_tasks = (int64_t)KV * pre_chunks, tasks = pre_tasks + (int64_t)B * KV * own_chunks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t < pre_tasks) {  /* shared prefix chunk c of kv head kvh, every request */
            int kvh = (int)(t / pre_chunks);
            int64_t c = t % pre_chunks, s0 = c * chunk, s1 = s0 + chunk < P ? s0 + chunk : P;
            chunk_attend(q + (int64_t)kvh * G * D, (int64_t)H * D, B, k, v, kv_bf16, prefix, s0, s1, KV, G, D, kvh,
                         scale, scratch + ((int64_t)kvh * parts + c) * per_task, pstride);
            continue;
        }
        int64_t u = t - pre_tasks, c = u % own_chunks, bk = u / own_chunks;
        int b = (int)(bk / KV), kvh = (int)(bk % KV);
        float *m = scratch + (bk * parts + pre_chunks + c) * per_task;
        int64_t s0 = P + c * chunk, s1 = s0 + chunk;
        if (s1 > seq_lens[b]) s1 = seq_lens[b];
        if (s0 >= s1) { empty_part(m, G); continue; }
        chunk_attend(q + ((int64_t)b * H + (int64_t)kvh * G) * D, 0, 1, k, v, kv_bf16, table + rows[b] * ld, s0, s1,
                     KV, G, D, kvh, scale, m, 0);
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t bk = 0; bk < (int64_t)B * KV; bk++) {
        int b = (int)(bk / KV), kvh = (int)(bk % KV);
        merge_parts(scratch + bk * parts * per_task, parts, per_task, G, D,
                    out + ((int64_t)b * H + (int64_t)kvh * G) * D);
    }
}
