/* Paged decode attention on the CPU, reading K/V in place from the token pool.
 *
 * One query token per request. For request b and query head h (kv head h / G):
 *   out[b, h] = softmax_s(scale * q[b, h] . k[slot(b, s)]) @ v[slot(b, s)],  s < seq_len[b]
 * slot(b, s) = prefix[s] for s < P (a prefix every request shares: cascade), else
 * table[rows[b] * ld + s]. Shapes (float32, contiguous):
 *   q, out [B, H, D]; k, v [num_slots, KV, D]; prefix int64 [P]; table int64 [*, ld];
 *   rows, seq_lens int64 [B], every seq_len > P.
 * Work is split into tasks run by the worker pool below: (kv head, chunk of `chunk` prefix keys)
 * for all B requests at once, so each shared key is read once per step, and (request, chunk of
 * own keys) for every kv head: a tile of keys is first touched whole (touch_rows: the slots'
 * [KV, D] rows in order, which memory streams twice as fast as one kv head's D values of each),
 * then attended by each kv head in turn. Where that leaves a thread without a task, own tasks
 * are (request, kv head, chunk) instead and read their own values only (any split gives the
 * same bits: a (kv head, chunk) part always sees the same tiles in the same order). The rows of
 * a speculative verify chain (one table row, contexts ending at consecutive positions) form a
 * group whose tasks read each tile once for all the group's rows, each row still attending
 * exactly its own tiles (a long chain is cut into several groups where the threads would
 * otherwise lack tasks). A prefix task has B x G query rows a key, compute enough to keep it
 * per kv head. Each task keeps an online
 * softmax (running max m, denominator l, accumulator acc) per query head; the parts of one
 * (request, head) are merged exactly
 * afterwards (common max, summed denominators). Scratch: B * KV * parts * G * (D + 2) floats,
 * parts = prefix chunks + own chunks; one part is [m G][l G][acc G * D]. Small calls (under
 * SERIAL_WORK key x head pairs) run on the calling thread, no parallel region; with one part per
 * (request, head) (no prefix, every context within one chunk) a task writes its output itself,
 * no merge pass; otherwise the tasks, then the merges, run on a help-first worker pool (a
 * thread the OS has not run yet never holds the call up; see pool_run). Query rows go three at
 * a time (each key and value row read once for the three: a kv head's 3 query heads in
 * SmolLM2), q.k 4 keys at a time (one transposed reduction for the 4 sums), p.v with the
 * accumulators in registers across a tile. K/V may instead be bfloat16 (kv_bf16 = 1): the
 * values are widened to float32 exactly (bf16 is the top half of a float32) in registers as
 * they are read, then the same float32 arithmetic (bitwise the float32 kernel's on the widened
 * values); a bfloat16 step reads half the bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_D 512

/* exp(x) for x <= 0 (and x > -inf), branch-free so loops over it vectorize: 2^(x log2 e) as
 * 2^n * 2^f with f in [-0.5, 0.5] by a degree-6 polynomial; relative error below 2e-7. Inputs
 * under -87 give a tiny positive number instead of 0 (harmless in a softmax sum). */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504f;
    float n = __builtin_rintf(t), f = t - n;  /* rint: vrndscaleps (roundf would not vectorize) */
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
#ifndef SERIAL_WORK
/* key x query-head pairs (x D / 64) under which one thread does it all (no parallel region):
 * ~340 keys at batch 1 with 9 heads, ~25 us on one core; a parallel region costs several us to
 * start and join, and far more when the other cores are busy */
#define SERIAL_WORK 3072
#endif
#define INL static inline __attribute__((always_inline))

/* VW floats as one vector: a zmm with AVX-512, else 8 (a ymm; GCC lowers it to two xmm where
 * there is no AVX); the _u type loads and stores at any float alignment. Head sizes that are
 * a multiple of VW take the vector loops, others plain C. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

INL vf ldv(const float *p) { return *(const vfu *)p; }

/* a * b + c. The vector loops' products and sums go through the FMA instruction as an
 * intrinsic, which -fassociative-math leaves as written: left to contract and reassociate
 * `c += a * b` itself, the compiler shapes the float32 and the bfloat16 instantiations of a loop
 * differently (seen with AVX-512), and their sums would differ in the last bits. */
INL vf fmadd(vf a, vf b, vf c) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VW == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}
INL void stv(float *p, vf x) { *(vfu *)p = x; }
INL vf splat(float x) { return (vf){0} + x; }

/* lanes 0..7 + lanes 8..15 (VW 16), or the vector itself (VW 8) */
INL v8 fold8(vf x) {
#if VW == 16
    v8 lo, hi;
    memcpy(&lo, &x, 32);
    memcpy(&hi, (const char *)&x + 32, 32);
    return lo + hi;
#else
    return x;
#endif
}

/* the lane sums of 4 vectors -> out[0..3]: one transposed reduction (6 shuffles, 3 adds on 8
 * lanes) instead of a horizontal sum each */
INL void sum4(vf a, vf b, vf c, vf d, float *out) {
    const v8 s0 = fold8(a), s1 = fold8(b), s2 = fold8(c), s3 = fold8(d);
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8 u0 = __builtin_shuffle(s0, s1, lo) + __builtin_shuffle(s0, s1, hi);  /* [s0 x4 | s1 x4] */
    const v8 u1 = __builtin_shuffle(s2, s3, lo) + __builtin_shuffle(s2, s3, hi);  /* [s2 x4 | s3 x4] */
    const v8i e = {0, 1, 8, 9, 4, 5, 12, 13}, o = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8 w = __builtin_shuffle(u0, u1, e) + __builtin_shuffle(u0, u1, o);  /* [s0 s0 s2 s2 s1 s1 s3 s3] */
    const v8i ev = {0, 2, 4, 6, 0, 2, 4, 6}, od = {1, 3, 5, 7, 1, 3, 5, 7};
    const v8 z = __builtin_shuffle(w, ev) + __builtin_shuffle(w, od);  /* [s0 s2 s1 s3 ...] */
    out[0] = z[0], out[1] = z[2], out[2] = z[1], out[3] = z[3];
}

/* The VW values of a K or V row from d on, as float32: the row itself (float32), or widened in
 * registers from bfloat16 (exactly: bf16 is a float32's top half); kvf the same for one value */
INL vf ldkv(const void *row, int d, const int bf16) {
    if (!bf16) return ldv((const float *)row + d);
    const uint16_t *h = (const uint16_t *)row + d;
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
#else
    vf x;
    for (int i = 0; i < VW; i++) {
        const uint32_t bits = (uint32_t)h[i] << 16;
        memcpy((float *)&x + i, &bits, 4);
    }
    return x;
#endif
}

INL float kvf(const void *row, int d, const int bf16) {
    if (!bf16) return ((const float *)row)[d];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Scores of `nq` (1 to 3) query rows qs[] against the n keys kr[] (rows of float32 or, with
 * bf16, bfloat16 values) -> sc[r * TILE + j] (unscaled). Vector path: 4 keys x nq rows per
 * pass, each key row loaded (and widened) once for all the rows: 12 independent chains for 3
 * rows; the last n % 4 keys one at a time, the same way. A row's sums are the same whatever nq
 * (the loops over r repeat its operations). */
INL void tile_scores(const float *const *qs, const int nq, const void *const *kr, int n, const int D, float *sc,
                     const int bf16) {
    int j = 0;
    if (D % VW == 0)
        for (; j + 4 <= n; j += 4) {
            vf s[3][4] = {{{0}}};
            for (int d = 0; d < D; d += VW) {
                const vf k0 = ldkv(kr[j], d, bf16), k1 = ldkv(kr[j + 1], d, bf16), k2 = ldkv(kr[j + 2], d, bf16),
                         k3 = ldkv(kr[j + 3], d, bf16);
                for (int r = 0; r < nq; r++) {
                    const vf x = ldv(qs[r] + d);
                    s[r][0] = fmadd(x, k0, s[r][0]), s[r][1] = fmadd(x, k1, s[r][1]),
                    s[r][2] = fmadd(x, k2, s[r][2]), s[r][3] = fmadd(x, k3, s[r][3]);
                }
            }
            for (int r = 0; r < nq; r++) sum4(s[r][0], s[r][1], s[r][2], s[r][3], sc + r * TILE + j);
        }
    if (D % VW == 0)  /* the last keys one at a time, in the same vector arithmetic: not a loop
                       * the compiler vectorizes its own way per instantiation (bf16 or not) */
        for (; j < n; j++) {
            vf s[3] = {{0}};
            for (int d = 0; d < D; d += VW) {
                const vf k0 = ldkv(kr[j], d, bf16);
                for (int r = 0; r < nq; r++) s[r] = fmadd(ldv(qs[r] + d), k0, s[r]);
            }
            for (int r = 0; r < nq; r++) {
                float out[4];
                sum4(s[r], splat(0.f), splat(0.f), splat(0.f), out);
                sc[r * TILE + j] = out[0];
            }
        }
    for (; j < n; j++)
        for (int r = 0; r < nq; r++) {
            float t = 0.f;
            for (int d = 0; d < D; d++) t += qs[r][d] * kvf(kr[j], d, bf16);
            sc[r * TILE + j] = t;
        }
}

/* acc_r [D] += sum_j p_r[j] * vr[j] for the nq (1 to 3) rows (p_r = sc + r * TILE): one vector
 * of D per pass for 2-3 rows (4 for one), each value vector loaded (and widened) once for all
 * the rows, the rows' accumulators in registers across the tile (up to 3 x 4 vectors). */
INL void tile_pv(float *const *acc, const int nq, const float *sc, const void *const *vr, int n, const int D,
                 const int bf16) {
    if (D % VW != 0) {
        for (int r = 0; r < nq; r++)
            for (int j = 0; j < n; j++)
                for (int d = 0; d < D; d++) acc[r][d] += sc[r * TILE + j] * kvf(vr[j], d, bf16);
        return;
    }
    for (int d0 = 0; d0 < D; d0 += 4 * VW) {
        const int nu = (D - d0) / VW < 4 ? (D - d0) / VW : 4;
        vf a[3][4];
        for (int r = 0; r < nq; r++)
            for (int u = 0; u < nu; u++) a[r][u] = ldv(acc[r] + d0 + u * VW);
        for (int j = 0; j < n; j++) {
            vf p[3];
            for (int r = 0; r < nq; r++) p[r] = splat(sc[r * TILE + j]);
            for (int u = 0; u < nu; u++) {
                const vf vv = ldkv(vr[j], d0 + u * VW, bf16);
                for (int r = 0; r < nq; r++) a[r][u] = fmadd(p[r], vv, a[r][u]);
            }
        }
        for (int r = 0; r < nq; r++)
            for (int u = 0; u < nu; u++) stv(acc[r] + d0 + u * VW, a[r][u]);
    }
}

/* One row's online softmax over a tile: scores s [n] (unscaled) -> p [n] in place, its
 * running max *mg and denominator *lg updated, its accumulator ag [D] rescaled when the max
 * grows. */
INL void tile_softmax(float *s, int n, float scale, float *mg, float *lg, float *ag, int D) {
    float tmax = -INFINITY;
    for (int j = 0; j < n; j++) {
        s[j] *= scale;
        tmax = s[j] > tmax ? s[j] : tmax;
    }
    if (tmax > *mg) {  /* new running max: rescale what was summed so far */
        const float c = *mg == -INFINITY ? 0.f : exp_nonpos(*mg - tmax);
        *lg *= c;
        for (int d = 0; d < D; d++) ag[d] *= c;
        *mg = tmax;
    }
    const float mx = *mg;
    float sum = 0.f;
    for (int j = 0; j < n; j++) {  /* vectorized (exp_nonpos is branch-free) */
        s[j] = exp_nonpos(s[j] - mx);
        sum += s[j];
    }
    *lg += sum;
}

/* Keys s0..s1 of `slots` against the G query heads of kv head kvh of nb requests; request i's
 * queries start at q + i * qstride, its part at m + i * pstride (l, acc follow). Keys are taken
 * TILE at a time (flash-attention's online softmax, per tile), the nb * G query rows three at a
 * time: scores of the tile, each row's max and rescale, exps, then acc += p @ V over the tile,
 * each key and value row read in place (bfloat16 ones widened in registers) once for the three.
 * Inlined with D and bf16 constants for the common head sizes (chunk_attend), so the loops over
 * D unroll. A row's float operations are the same whatever rows share its pass. */
INL void chunk_attend_d(const float *q, int64_t qstride, int nb, const void *k, const void *v, const int bf16,
                        const int64_t *slots, int64_t s0, int64_t s1, int KV, int G, const int D, int kvh,
                        float scale, float *m, int64_t pstride, int init) {
    float sc[3 * TILE];
    const void *kr[TILE], *vr[TILE];
    const int64_t row_bytes = (int64_t)D * (bf16 ? 2 : 4);
    const int R = nb * G;  /* query rows: row r is request r / G, head r % G */
    for (int i = 0; init && i < nb; i++) {
        float *mi = m + i * pstride, *li = mi + G, *ai = li + G;
        for (int g = 0; g < G; g++) { mi[g] = -INFINITY; li[g] = 0.f; }
        for (int x = 0; x < G * D; x++) ai[x] = 0.f;
    }
    for (int64_t t0 = s0; t0 < s1; t0 += TILE) {
        const int n = s1 - t0 < TILE ? (int)(s1 - t0) : TILE;
        for (int j = 0; j < n; j++) {
            const int64_t off = (slots[t0 + j] * KV + kvh) * row_bytes;
            kr[j] = (const char *)k + off;
            vr[j] = (const char *)v + off;
        }
        for (int r0 = 0; r0 < R; r0 += 3) {
            const int nq = R - r0 < 3 ? R - r0 : 3;
            const float *qs[3];
            float *mg[3], *acc[3];
            for (int r = 0; r < nq; r++) {
                const int i = (r0 + r) / G, g = (r0 + r) % G;
                qs[r] = q + i * qstride + g * D;
                mg[r] = m + i * pstride + g;  /* its l is mg + G, its acc at mg - g + 2 G + g D */
                acc[r] = m + i * pstride + 2 * G + g * D;
            }
#define ROWS_(NQ_)                                                                         \
            tile_scores(qs, NQ_, kr, n, D, sc, bf16);                                      \
            for (int r = 0; r < NQ_; r++)                                                  \
                tile_softmax(sc + r * TILE, n, scale, mg[r], mg[r] + G, acc[r], D);        \
            tile_pv(acc, NQ_, sc, vr, n, D, bf16);
            if (nq == 3) { ROWS_(3) } else if (nq == 2) { ROWS_(2) } else { ROWS_(1) }
#undef ROWS_
        }
    }
}

static void chunk_attend(const float *q, int64_t qstride, int nb, const void *k, const void *v, int bf16,
                         const int64_t *slots, int64_t s0, int64_t s1, int KV, int G, int D, int kvh,
                         float scale, float *m, int64_t pstride, int init) {
#define CA(D_, B_) chunk_attend_d(q, qstride, nb, k, v, B_, slots, s0, s1, KV, G, D_, kvh, scale, m, pstride, init)
    if (D == 64) {
        if (bf16) CA(64, 1); else CA(64, 0);
    } else if (D == 128) {
        if (bf16) CA(128, 1); else CA(128, 0);
    } else {
        if (bf16) CA(D, 1); else CA(D, 0);
    }
#undef CA
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

#define CLAIM_MAX 1  /* tasks per claim: few, big and uneven ones (qdot.c claims up to 8 spans) */
#include "native_pool.h"  /* the worker pool: pool_run(fn, ctx, tasks, nthreads) */

/* Another library's pool (qdot.c's lm_pool_run, handed over by paged_decode.py), so attention
 * and the matmuls of a step share one set of workers; this library's own pool where none is. */
typedef void (*ext_pool_fn)(span_fn fn, const void *ctx, int64_t spans, int nthreads, int claim_max);
static ext_pool_fn ext_pool;
void lm_paged_decode_use_pool(void *fn) { ext_pool = (ext_pool_fn)fn; }
int lm_paged_decode_shares_pool(void) { return ext_pool != NULL; }

static void run_pool(span_fn fn, const void *ctx, int64_t spans, int nthreads) {
    if (ext_pool != NULL)
        ext_pool(fn, ctx, spans, nthreads, CLAIM_MAX);
    else
        pool_run(fn, ctx, spans, nthreads);
}

/* One call's arguments and derived shapes, shared by its tasks. */
typedef struct {
    const float *q;
    const void *k, *v;
    const int64_t *prefix, *table, *rows, *seq_lens;
    int64_t P, ld, chunk, pre_chunks, own_chunks, parts, per_task, pstride, pre_tasks;
    const int64_t *group;  /* group g is requests group[g] .. group[g + 1] - 1 (see lm_paged_decode) */
    int64_t groups;
    int task_heads;  /* kv heads per own-chunk task: all of them (KV), or 1 where tasks would be too few */
    int B, H, KV, D, G, bf16;
    float scale;
    float *scratch, *out;
} job_t;

/* Bring keys t0..t1 of `slots` into the cache: one load a 64-byte line of each slot's whole
 * [KV, D] K row and V row, K and V in turn, in slot order. The kernel then reads a kv head's
 * D values of each row at a time (1 / KV of the row): read straight from memory, that stream
 * with gaps ran at ~8 GB/s on one core of the AVX2 EPYC, where whole rows in order run at
 * ~20 GB/s and the reads after the touch hit the cache (a step's K/V come from memory: the
 * weights streamed through the caches since). Measured: a layer's attention 0.55-0.65x. */
static void touch_rows(const job_t *j, const int64_t *slots, int64_t t0, int64_t t1) {
    const int64_t row_bytes = (int64_t)j->KV * j->D * (j->bf16 ? 2 : 4);
    unsigned sink = 0;
    for (int64_t x = t0; x < t1; x++) {
        const volatile unsigned char *kp = (const unsigned char *)j->k + slots[x] * row_bytes,
                                     *vp = (const unsigned char *)j->v + slots[x] * row_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64) sink += kp[o] + vp[o];
    }
    (void)sink;
}

/* Keys s0..s1 of `slots` for kv heads kv0..kv0 + nkv - 1, tile by tile: each tile touched
 * (touch_rows) when the task reads more than one kv head's values, then attended by each kv
 * head in turn (nb requests' queries from q, qstride apart; kv head kvh's part at
 * m + (kvh - kv0) * mstride, request i's pstride further). Each (kv head, chunk) part sees the
 * same tiles in the same order as a chunk_attend over s0..s1 alone would: the same bits. */
static void chunk_attend_heads(const job_t *j, int kv0, int nkv, const float *q, int64_t qstride, int nb,
                               const int64_t *slots, int64_t s0, int64_t s1, float *m, int64_t mstride,
                               int64_t pstride) {
    const int G = j->G, D = j->D;
    for (int64_t t0 = s0; t0 < s1; t0 += TILE) {
        const int64_t t1 = t0 + TILE < s1 ? t0 + TILE : s1;
        if (nkv > 1) touch_rows(j, slots, t0, t1);
        for (int kvh = kv0; kvh < kv0 + nkv; kvh++)
            chunk_attend(q + (int64_t)kvh * G * D, qstride, nb, j->k, j->v, j->bf16, slots, t0, t1, j->KV, G, D, kvh,
                         j->scale, m + (kvh - kv0) * mstride, pstride, t0 == s0);
    }
}

/* Own chunk c of the requests b0 .. b0 + nr - 1 of one group (the rows of a verify chain: one
 * slot table, contexts ending at consecutive positions), kv heads kv0 .. kv0 + nkv - 1: each tile
 * touched once (nkv > 1) and attended by every row whose chunk reaches it, while it is cached;
 * a row reads its keys s0 .. min(s0 + chunk, seq_len) tile by tile exactly as chunk_attend_heads
 * would for it alone (same tiles, same order, one request a call): the same bits. A row whose
 * chunk is empty gets an empty part. m0: the group's first request's part of kv head kv0. */
static void group_attend_heads(const job_t *j, int kv0, int nkv, int64_t b0, int nr, int64_t c, float *m0,
                               int64_t heads) {
    const int G = j->G, D = j->D, H = j->H;
    const int64_t s0 = j->P + c * j->chunk, rstride = (int64_t)j->KV * heads;  /* request b to b + 1 */
    const int64_t *slots = j->table + j->rows[b0] * j->ld;
    int64_t send = s0;  /* the group's furthest key in this chunk */
    for (int i = 0; i < nr; i++) {
        const int64_t e = s0 + j->chunk < j->seq_lens[b0 + i] ? s0 + j->chunk : j->seq_lens[b0 + i];
        if (e > send) send = e;
    }
    for (int64_t t0 = s0; t0 < send; t0 += TILE) {
        const int64_t t1 = t0 + TILE < send ? t0 + TILE : send;
        if (nkv > 1) touch_rows(j, slots, t0, t1);
        for (int i = 0; i < nr; i++) {
            const int64_t b = b0 + i;
            const int64_t e = s0 + j->chunk < j->seq_lens[b] ? s0 + j->chunk : j->seq_lens[b];
            if (e <= t0) continue;
            for (int kvh = kv0; kvh < kv0 + nkv; kvh++)
                chunk_attend(j->q + (b * H + (int64_t)kvh * G) * D, 0, 1, j->k, j->v, j->bf16, slots, t0,
                             t1 < e ? t1 : e, j->KV, G, D, kvh, j->scale, m0 + i * rstride + (kvh - kv0) * heads,
                             0, t0 == s0);
        }
    }
    for (int i = 0; i < nr; i++) {
        const int64_t b = b0 + i;
        for (int kvh = kv0; kvh < kv0 + nkv; kvh++) {
            float *m = m0 + i * rstride + (kvh - kv0) * heads;
            if (s0 >= j->seq_lens[b]) {
                empty_part(m, G);
            } else if (j->parts == 1) {
                /* acc / l, as merge_parts computes one part: a verify row whose context ends on the
                 * other side of a chunk boundary from its chain's longest row (merged, parts > 1)
                 * gets the bits a decode at its position gets */
                float *o = j->out + (b * H + (int64_t)kvh * G) * D;
                for (int g = 0; g < G; g++)
                    for (int d = 0; d < D; d++) o[g * D + d] = m[2 * G + g * D + d] / m[G + g];
            }
        }
    }
}

/* Task t: a shared prefix chunk of one kv head (all requests: B x G query rows a key, work
 * enough to keep per-kv-head tasks, read without the touch), or one (group of requests, own
 * chunk), every kv head (task_heads = KV) or one. With one part per (request, head) (no prefix,
 * every context within one chunk) the part is final: it is normalized straight into out (no
 * merge pass). */
static void run_task(const job_t *j, int64_t t) {
    const int D = j->D;
    const int64_t heads = j->parts * j->per_task;  /* from (b, kvh) to (b, kvh + 1) */
    if (t < j->pre_tasks) {  /* shared prefix chunk c of kv head kvh, every request */
        const int kvh = (int)(t / j->pre_chunks);
        const int64_t c = t % j->pre_chunks, s0 = c * j->chunk, s1 = s0 + j->chunk < j->P ? s0 + j->chunk : j->P;
        chunk_attend_heads(j, kvh, 1, j->q, (int64_t)j->H * D, j->B, j->prefix, s0, s1,
                           j->scratch + ((int64_t)kvh * j->parts + c) * j->per_task, heads, j->pstride);
        return;
    }
    const int splits = j->KV / j->task_heads;
    int64_t u = t - j->pre_tasks;
    const int kv0 = (int)(u % splits) * j->task_heads;
    u /= splits;
    const int64_t c = u % j->own_chunks, g = u / j->own_chunks, b0 = j->group ? j->group[g] : g;
    group_attend_heads(j, kv0, j->task_heads, b0, j->group ? (int)(j->group[g + 1] - b0) : 1, c,
                       j->scratch + ((b0 * j->KV + kv0) * j->parts + j->pre_chunks + c) * j->per_task, heads);
}

static void run_merge(const job_t *j, int64_t bk) {
    const int b = (int)(bk / j->KV), kvh = (int)(bk % j->KV);
    merge_parts(j->scratch + bk * j->parts * j->per_task, j->parts, j->per_task, j->G, j->D,
                j->out + ((int64_t)b * j->H + (int64_t)kvh * j->G) * j->D);
}

static void task_span(const void *j, int64_t t) { run_task(j, t); }
static void merge_span(const void *j, int64_t bk) { run_merge(j, bk); }

/* key x query-head pairs the call computes, in units of 64 dims: what decides one thread vs many */
static int64_t work_of(const job_t *j) {
    int64_t own = 0;
    for (int b = 0; b < j->B; b++) own += j->seq_lens[b] - j->P;
    return (int64_t)j->KV * j->G * (j->P * j->B + own) * j->D / 64;
}

/* Request b continues request b - 1's chain: the same table row, its context one key longer */
static int chained(const job_t *j, int b) {
    return j->rows[b] == j->rows[b - 1] && j->seq_lens[b] == j->seq_lens[b - 1] + 1;
}

void lm_paged_decode(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *prefix, int64_t P,
                     const int64_t *table, int64_t ld, const int64_t *rows, const int64_t *seq_lens,
                     int B, int H, int KV, int D, float scale, int64_t chunk, int nthreads,
                     float *scratch, float *out) {
    job_t j = {.q = q, .k = k, .v = v, .prefix = prefix, .table = table, .rows = rows, .seq_lens = seq_lens,
               .P = P, .ld = ld, .chunk = chunk, .B = B, .H = H, .KV = KV, .D = D, .G = H / KV, .bf16 = kv_bf16,
               .scale = scale, .scratch = scratch, .out = out};
    j.pre_chunks = (P + chunk - 1) / chunk;
    j.own_chunks = j.pre_chunks ? 0 : 1;  /* at least one part per (request, head) */
    for (int b = 0; b < B; b++) {
        int64_t n = (seq_lens[b] - P + chunk - 1) / chunk;
        if (n > j.own_chunks) j.own_chunks = n;
    }
    j.parts = j.pre_chunks + j.own_chunks, j.per_task = (int64_t)j.G * (D + 2);
    j.pstride = (int64_t)KV * j.parts * j.per_task;  /* from request b to b + 1 */
    j.pre_tasks = (int64_t)KV * j.pre_chunks;
    const int serial = nthreads <= 1 || work_of(&j) < SERIAL_WORK;  /* small: no parallel region */
    /* Groups: the rows of a verify chain (same table row, contexts ending at consecutive positions)
     * read each tile of their context once for all of them (group_attend_heads) instead of once a
     * row; a chain is cut into `split` groups where chains x chunks would leave the threads fewer
     * than two tasks each (every group reads the context once). Other requests: a group each. */
    int64_t chains = 0;
    for (int b = 0; b < B; b++) chains += b == 0 || !chained(&j, b);
    const int64_t want = serial ? 1 : 2 * (int64_t)nthreads, have = chains * j.own_chunks;
    const int64_t split = have >= want ? 1 : (want + have - 1) / have;
    int64_t stack_group[65], *group = B < 64 ? stack_group : malloc(sizeof(int64_t) * ((size_t)B + 1));
    j.groups = 0;
    for (int b0 = 0; b0 < B && group != NULL;) {
        int b1 = b0 + 1;
        while (b1 < B && chained(&j, b1)) b1++;
        const int64_t n = b1 - b0, k = split < n ? split : n;  /* k groups of ~n / k rows */
        for (int64_t x = 0; x < k; x++) group[j.groups++] = b0 + x * n / k;
        b0 = b1;
    }
    if (group != NULL) group[j.groups] = B;
    else j.groups = B;  /* no memory for the groups: every request a group of its own (group NULL) */
    j.group = group;
    const int64_t own_tasks = j.groups * j.own_chunks, merges = j.parts > 1 ? (int64_t)B * KV : 0;
    /* an own-chunk task reads its chunk's whole rows for every kv head, unless that leaves a
     * thread without a task: then one kv head a task, reading its own D values of each row only */
    j.task_heads = serial || j.pre_tasks + own_tasks >= (int64_t)nthreads ? KV : 1;
    const int64_t tasks = j.pre_tasks + own_tasks * (KV / j.task_heads);
    if (serial || tasks == 1) {
        for (int64_t t = 0; t < tasks; t++) run_task(&j, t);
        for (int64_t bk = 0; bk < merges; bk++) run_merge(&j, bk);
    } else {
        run_pool(task_span, &j, tasks, nthreads);  /* returns when every task is done */
        if (merges) run_pool(merge_span, &j, merges, nthreads);
    }
    if (group != stack_group) free(group);
}
