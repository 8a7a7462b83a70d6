/* A quantized Llama decoder layer's CPU decode step as two C calls with no Python between its
 * pieces (llama_layer.py binds the arguments once):
 *
 *   lm_layer_head: [res += x] -> h = rms_norm(res) -> qkv = h @ Wqkv (+ bias) -> rope(q, k),
 *                  k and v written into the layer's KV slots, q to c->q
 *   (the attention backend: one call per layer, reading q and the KV pool; lm_layers_run makes
 *   it from C when it is the paged decode kernel, so a whole step is one C call, and with an
 *   lm_final it also makes the logits: rms_norm(res + x) @ Whead, when every row wants them)
 *   lm_layer_tail: o = attn @ Wo -> res += o, h = rms_norm(res) -> gu = h @ Wgate_up ->
 *                  act = silu(gate) * up -> x = act @ Wdown [-> the next layer's lm_layer_head]
 *
 * so a layer costs one C call and one attention call. Every piece is the exported function the
 * layer-by-layer path calls, reached through the pointers in lm_ctx / lm_gemm (the very code of
 * qdot.c / qgemm.c / fused_ops.c / decode_ops.c as their own builds compiled it, under their own
 * flags): the two paths give the same bits, and an edit to any of those files reaches both.
 * Each pointer's function opens its own OpenMP region (they are not re-entered from one here).
 *
 * Buffers (float32, row-major, contiguous, T rows): res, x, h, o [T, hidden]; qkv [T, (H + 2 KV) D];
 * q [T, H, D]; gu [T, 2 I]; act [T, I]. The residual add is in place (sum_out = res): the norm
 * writes each sum before reading it, lane for lane, as it would into another buffer.
 * Returns 0, -1 when a qdot.c matmul found no memory for its activation scratch, or -2 when a
 * position or KV slot of the step is out of range (rope_kv wrote nothing of that layer).
 */
#include <stdint.h>
#include <stddef.h>

/* qdot.c's lm_q4x8_gemm / lm_q8x8_gemm (status) and qgemm.c's lm_q4_gemm / lm_q8_gemm (void) */
typedef int (*gemm_status_fn)(const float *x, int T, int K, const void *q, const void *s, int64_t N, float *y,
                              int nthreads);
typedef void (*gemm_void_fn)(const float *x, int T, int K, const void *q, const void *s, int64_t N, float *y,
                             int nthreads);
typedef void (*norm_fn)(const float *x, const float *r, float *sum_out, const float *w, float *out, int64_t T,
                        int64_t H, float eps, int nthreads);
typedef int (*rope_kv_fn)(const float *qkv, int64_t T, int H, int KV, int D, const float *table,
                          const int64_t *pos, const int64_t *slots, float *q_out, void *k_cache, void *v_cache,
                          int kv_bf16, int64_t positions, int64_t num_slots, int nthreads);
typedef void (*silu_mul_fn)(const float *gu, int64_t T, int64_t I, float *out, int nthreads);

typedef struct {      /* one QuantLinear: y [T, N] = x [T, K] @ W.T (+ bias [N]) */
    void *fn;         /* a gemm_status_fn when `status`, else a gemm_void_fn */
    int64_t status;
    int64_t K, N;
    const void *q, *s;  /* the weight buffers the function takes */
    const float *bias;  /* NULL: none */
} lm_gemm;

typedef struct {      /* one decoder layer's weights and KV slots */
    lm_gemm qkv, o, gate_up, down;
    const float *in_norm, *post_norm;  /* [hidden] */
    void *k_cache, *v_cache;           /* [slots, KV, D], float32 or bfloat16 (ctx kv_bf16) */
} lm_layer;

typedef struct {      /* one batch shape's buffers and the step's positions */
    norm_fn norm;
    rope_kv_fn rope_kv;
    silu_mul_fn silu_mul;
    int64_t T, hidden, H, KV, D, I;
    int64_t nthreads;
    double eps;
    int64_t kv_bf16;                   /* the KV pool holds bfloat16 (--kv-cache-dtype bf16) */
    float *res, *x, *h, *qkv, *q, *o, *gu, *act;
    const float *table;                /* [P, 2, D] */
    const int64_t *pos, *slots;        /* [T] each (rope_kv checks them: positions in [0, P), slots in [0, num_slots)) */
    int64_t P, num_slots;
} lm_ctx;

static int gemm(const lm_ctx *c, const lm_gemm *g, const float *x, float *y) {
    if (g->status) {
        if (((gemm_status_fn)g->fn)(x, (int)c->T, (int)g->K, g->q, g->s, g->N, y, (int)c->nthreads) != 0) return -1;
    } else {
        ((gemm_void_fn)g->fn)(x, (int)c->T, (int)g->K, g->q, g->s, g->N, y, (int)c->nthreads);
    }
    if (g->bias != NULL)  /* y + bias: the one rounding torch's add makes */
        for (int64_t t = 0; t < c->T; t++)
            for (int64_t n = 0; n < g->N; n++) y[t * g->N + n] += g->bias[n];
    return 0;
}

/* first: res holds the layer's whole input (layer 0: the embeddings), else res + x is */
int lm_layer_head(const lm_ctx *c, const lm_layer *w, int first) {
    if (first)
        c->norm(c->res, NULL, NULL, w->in_norm, c->h, c->T, c->hidden, (float)c->eps, (int)c->nthreads);
    else
        c->norm(c->x, c->res, c->res, w->in_norm, c->h, c->T, c->hidden, (float)c->eps, (int)c->nthreads);
    if (gemm(c, &w->qkv, c->h, c->qkv)) return -1;
    if (c->rope_kv(c->qkv, c->T, (int)c->H, (int)c->KV, (int)c->D, c->table, c->pos, c->slots, c->q, w->k_cache,
                   w->v_cache, (int)c->kv_bf16, c->P, c->num_slots, (int)c->nthreads))
        return -2;
    return 0;
}

/* attn [T, H * D]: the attention backend's output for this layer; next: NULL after the last */
int lm_layer_tail(const lm_ctx *c, const lm_layer *w, const float *attn, const lm_layer *next) {
    if (gemm(c, &w->o, attn, c->o)) return -1;
    c->norm(c->o, c->res, c->res, w->post_norm, c->h, c->T, c->hidden, (float)c->eps, (int)c->nthreads);
    if (gemm(c, &w->gate_up, c->h, c->gu)) return -1;
    c->silu_mul(c->gu, c->T, c->I, c->act, (int)c->nthreads);
    if (gemm(c, &w->down, c->act, c->x)) return -1;
    return next != NULL ? lm_layer_head(c, next, 0) : 0;
}

/* paged_decode.c's lm_paged_decode */
typedef void (*paged_decode_fn)(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *prefix,
                                int64_t P, const int64_t *table, int64_t ld, const int64_t *rows,
                                const int64_t *seq_lens, int B, int H, int KV, int D, float scale, int64_t chunk,
                                int nthreads, float *scratch, float *out);

typedef struct {      /* a step's bound lm_paged_decode arguments (PagedDecodePlan.c_args) less K and V */
    void *fn;
    const float *q;
    int64_t kv_bf16;
    const int64_t *prefix;
    int64_t P;
    const int64_t *table;
    int64_t ld;
    const int64_t *rows, *seq_lens;
    int64_t B, H, KV, D;
    double scale;
    int64_t chunk, nthreads;
    float *scratch, *out;
} lm_attn;

typedef struct {      /* the model's last norm and logits head, for steps wanting every row's logits */
    lm_gemm head;     /* [vocab, hidden] */
    const float *norm;  /* [hidden] */
    double eps;
    float *logits;    /* [T, vocab] */
} lm_final;

/* Every layer of a step whose attention is the paged decode kernel: head(0), then per layer
 * attention over the layer's K/V and tail (which runs the next layer's head), as llama_layer.py
 * would call them one by one; a's out [T, H * D] is the attention output each tail reads.
 * f (or NULL): then logits = rms_norm(res + x) @ head, the calls the model's norm and head
 * would make (res takes the sum in place, as each layer's norm does). */
int lm_layers_run(const lm_ctx *c, const lm_layer *const *w, int64_t n, const lm_attn *a, const lm_final *f) {
    if (n <= 0) return 0;
    int rc = lm_layer_head(c, w[0], 1);
    if (rc) return rc;
    const paged_decode_fn attend = (paged_decode_fn)a->fn;
    for (int64_t i = 0; i < n; i++) {
        attend(a->q, w[i]->k_cache, w[i]->v_cache, (int)a->kv_bf16, a->prefix, a->P, a->table, a->ld, a->rows,
               a->seq_lens, (int)a->B, (int)a->H, (int)a->KV, (int)a->D, (float)a->scale, a->chunk,
               (int)a->nthreads, a->scratch, a->out);
        if ((rc = lm_layer_tail(c, w[i], a->out, i + 1 < n ? w[i + 1] : NULL))) return rc;
    }
    if (f != NULL) {
        c->norm(c->x, c->res, c->res, f->norm, c->h, c->T, c->hidden, (float)f->eps, (int)c->nthreads);
        if (gemm(c, &f->head, c->h, f->logits)) return -1;
    }
    return 0;
}
