/* Paged decode attention on the CPU, reading K/V in place from the token pool.
 *
 * One query token per request. For request b and query head h (kv head h / G):
 *   out[b, h] = softmax_s(scale * q[b, h] . k[slot(b, s)]) @ v[slot(b, s)],  s < seq_len[b]
 * slot(b, s) = table[rows[b] * ld + s]. Shapes (float32, contiguous):
 *   q, out [B, H, D]; k, v [num_slots, KV, D]; table int64 [*, ld]; rows, seq_lens int64 [B].
 * Work is split into (request, kv head, chunk of `chunk` keys) tasks run by OpenMP threads;
 * each task keeps an online softmax (running max m, denominator l, accumulator acc) for the
 * G query heads of its kv head, and the chunks of one (request, head) are merged exactly
 * afterwards (common max, summed denominators). Scratch holds per task: G * (D + 2) floats.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void chunk_attend(const float *q, const float *k, const float *v, const int64_t *slots,
                         int64_t s0, int64_t s1, int KV, int G, int D, int kvh, float scale,
                         float *m, float *l, float *acc) {
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
    for (int i = 0; i < G * D; i++) acc[i] = 0.f;
    for (int64_t s = s0; s < s1; s++) {
        const float *kr = k + (slots[s] * KV + kvh) * D;
        const float *vr = v + (slots[s] * KV + kvh) * D;
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += qg[d] * kr[d];
            dot *= scale;
            float *ag = acc + g * D;
            if (dot > m[g]) {
                float c = expf(m[g] - dot);
                l[g] *= c;
                for (int d = 0; d < D; d++) ag[d] *= c;
                m[g] = dot;
            }
            float p = expf(dot - m[g]);
            l[g] += p;
            for (int d = 0; d < D; d++) ag[d] += p * vr[d];
        }
    }
}

void lm_paged_decode(const float *q, const float *k, const float *v, const int64_t *table, int64_t ld,
                     const int64_t *rows, const int64_t *seq_lens, int B, int H, int KV, int D,
                     float scale, int64_t chunk, int nthreads, float *scratch, float *out) {
    const int G = H / KV;
    int64_t max_chunks = 1;
    for (int b = 0; b < B; b++) {
        int64_t n = (seq_lens[b] + chunk - 1) / chunk;
        if (n > max_chunks) max_chunks = n;
    }
    const int64_t per_task = (int64_t)G * (D + 2);
    const int64_t tasks = (int64_t)B * KV * max_chunks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t c = t % max_chunks, bk = t / max_chunks;
        int b = (int)(bk / KV), kvh = (int)(bk % KV);
        float *m = scratch + t * per_task, *l = m + G, *acc = l + G;
        int64_t s0 = c * chunk, s1 = s0 + chunk;
        if (s1 > seq_lens[b]) s1 = seq_lens[b];
        if (s0 >= s1) { for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; } continue; }
        chunk_attend(q + ((int64_t)b * H + (int64_t)kvh * G) * D, k, v, table + rows[b] * ld, s0, s1,
                     KV, G, D, kvh, scale, m, l, acc);
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t bk = 0; bk < (int64_t)B * KV; bk++) {
        int b = (int)(bk / KV), kvh = (int)(bk % KV);
        for (int g = 0; g < G; g++) {
            float mx = -INFINITY, den = 0.f;
            for (int64_t c = 0; c < max_chunks; c++) {
                float mc = scratch[(bk * max_chunks + c) * per_task + g];
                if (mc > mx) mx = mc;
            }
            float *o = out + ((int64_t)b * H + (int64_t)kvh * G + g) * D;
            for (int d = 0; d < D; d++) o[d] = 0.f;
            for (int64_t c = 0; c < max_chunks; c++) {
                const float *base = scratch + (bk * max_chunks + c) * per_task;
                if (base[G + g] == 0.f) continue;
                float w = expf(base[g] - mx);
                den += w * base[G + g];
                const float *ac = base + 2 * G + g * D;
                for (int d = 0; d < D; d++) o[d] += w * ac[d];
            }
            for (int d = 0; d < D; d++) o[d] /= den;
        }
    }
}
