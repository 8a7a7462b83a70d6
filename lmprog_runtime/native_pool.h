#ifndef LM_NATIVE_POOL_H
#define LM_NATIVE_POOL_H
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
/* A help-first worker pool for lmprog's C kernels, instead of an OpenMP region (included by qdot.c
 * and paged_decode.c: each library gets its own pool, but qdot.c exports its own (LM_POOL_EXPORT
 * below) and paged_decode.py hands it to paged_decode.c, so a decode step's matmuls and attention
 * run on one set of workers; native.build keys a kernel's build on the headers it includes, so
 * an edit here rebuilds both).
 *
 * OpenMP's region ends in a join that waits for every thread of the team, also one the OS has
 * not run yet: on a machine whose other cores are busy a 25 us matmul measured 300-400 us on 2
 * threads. Here the calling thread claims spans itself, as do up to nthreads - 1 persistent
 * workers, and it waits only for spans a worker has claimed: a worker that wakes late finds no
 * span left and goes back to sleep, so a call never takes much longer than on one thread.
 * One job at a time: `word` = (generation 20 bits | spans 22 | next span 22), claimed by
 * compare-and-swap only while its generation is the job's (a late worker never touches the
 * next job's counter); `done` counts finished spans. The job's fn / ctx are written before the
 * word that publishes them and stay valid until done == spans, which needs every claimed span
 * finished. A second caller while a job runs or a failed thread start just run on the calling
 * thread; a fork's child starts its own workers. Workers wait ~100 us for the next job, a
 * few us spinning, then yielding the core (a decode step's matmuls come closer than that, and
 * waking a sleeping thread costs about as much as a small matmul), then sleep: an idle server
 * has no spinning thread. */
#include <stdatomic.h>
#define POOL_MAX 63        /* workers at most */
#define POOL_SPIN 200      /* pauses a worker spins for the next job (~2-10 us), then it yields ... */
#define POOL_YIELDS 100    /* ... this many times (sched_yield, ~100 us: other threads run meanwhile), then sleeps */
#define SPANS_MAX ((int64_t)1 << 22)
#ifndef CLAIM_MAX
#define CLAIM_MAX 8        /* spans per claim at most (paged_decode.c: 1, few big uneven tasks) */
#endif
/* LM_POOL_EXPORT: the library exports its pool as lm_pool_run(fn, ctx, spans, nthreads,
 * claim_max) (qdot.c does): another library handed its address (paged_decode.c) runs its jobs
 * on the same workers, so a step's matmuls and attention calls share one set of threads instead
 * of two sets, each yielding the cores to the other while it waits for its next job. */
typedef void (*span_fn)(const void *ctx, int64_t sp);
static struct {
    pthread_mutex_t job_mu, mu;  /* job_mu: one job at a time; mu + cv: sleeping workers */
    pthread_cond_t cv;
    _Atomic uint64_t word;
    _Atomic int64_t done;
    _Atomic int sleepers, want;  /* want: workers the current job may use (ids 0..want-1) */
    span_fn fn;
    const void *ctx;
    int started;
    _Atomic int claim;  /* the job's spans per claim at most */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0,
          CLAIM_MAX};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint32_t word_gen(uint64_t w) { return (uint32_t)(w >> 44); }

/* Wait briefly for a job generation other than seen: POOL_SPIN pauses, then POOL_YIELDS
 * yields of the core (a spinning thread would take it from whoever else wants it: the
 * OpenMP threads of torch, the other kernel libraries' workers) -> the generation (seen when
 * none came). */
static uint32_t spin_for_job(uint32_t seen) {
    uint32_t gen = seen;
    for (int i = 0; i < POOL_SPIN && (gen = word_gen(atomic_load(&pool.word))) == seen; i++) cpu_relax();
    for (int i = 0; i < POOL_YIELDS && gen == seen; i++) {
        sched_yield();
        gen = word_gen(atomic_load(&pool.word));
    }
    return gen;
}

/* Claim and run spans of generation gen until none is left: a quarter of each thread's share
 * of what is left per claim, at most CLAIM_MAX (few compare-and-swaps on a long job; a thread
 * descheduled after a claim holds the call up by CLAIM_MAX spans at most). */
static void pool_drain(uint32_t gen) {
    uint64_t w = atomic_load(&pool.word);
    for (;;) {
        const int64_t spans = (int64_t)((w >> 22) & (SPANS_MAX - 1)), next = (int64_t)(w & (SPANS_MAX - 1));
        if (word_gen(w) != gen || next >= spans) return;
        int64_t take = (spans - next) / (4 * (int64_t)(atomic_load(&pool.want) + 1));
        const int64_t most = atomic_load(&pool.claim);
        take = take < 1 ? 1 : (take > most ? most : take);
        if (!atomic_compare_exchange_weak(&pool.word, &w, w + (uint64_t)take)) continue;  /* w reloaded */
        for (int64_t sp = next; sp < next + take; sp++) pool.fn(pool.ctx, sp);
        atomic_fetch_add(&pool.done, take);
        w = atomic_load(&pool.word);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t seen = word_gen(atomic_load(&pool.word));
    for (;;) {
        uint32_t gen = spin_for_job(seen);
        if (gen == seen) {  /* asleep until a new job: counted in sleepers before the last look */
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = word_gen(atomic_load(&pool.word))) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        if (id < atomic_load(&pool.want)) pool_drain(gen);  /* a stale want only costs a failed claim */
    }
    return NULL;
}

static void pool_after_fork(void) {  /* the child has none of the parent's workers */
    pthread_mutex_init(&pool.job_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { (void)pthread_atfork(NULL, NULL, pool_after_fork); }

/* fn(ctx, sp) for sp in 0..spans-1 on the calling thread and up to nthreads - 1 workers, a
 * claim taking at most claim_max spans. */
static void pool_run_claim(span_fn fn, const void *ctx, int64_t spans, int nthreads, int claim_max) {
    const int want = (nthreads < POOL_MAX + 1 ? nthreads : POOL_MAX + 1) - 1;
    if (want < 1 || spans < 2 || spans >= SPANS_MAX || pthread_mutex_trylock(&pool.job_mu) != 0) {
        for (int64_t sp = 0; sp < spans; sp++) fn(ctx, sp);
        return;
    }
    (void)pthread_once(&pool_once, pool_init);
    while (pool.started < want) {  /* workers start on first need and live as long as the process */
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &at, pool_worker, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        pool.started++;
    }
    pool.fn = fn, pool.ctx = ctx;
    atomic_store(&pool.claim, claim_max < 1 ? 1 : claim_max);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.want, want);
    const uint32_t gen = (word_gen(atomic_load(&pool.word)) + 1) & 0xFFFFF;
    atomic_store(&pool.word, ((uint64_t)gen << 44) | ((uint64_t)spans << 22));  /* publishes fn, ctx */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    pool_drain(gen);
    while (atomic_load(&pool.done) < spans) cpu_relax();  /* only spans a worker is running */
    pthread_mutex_unlock(&pool.job_mu);
}

static inline void pool_run(span_fn fn, const void *ctx, int64_t spans, int nthreads) {
    pool_run_claim(fn, ctx, spans, nthreads, CLAIM_MAX);
}

#ifdef LM_POOL_EXPORT
void lm_pool_run(span_fn fn, const void *ctx, int64_t spans, int nthreads, int claim_max) {
    pool_run_claim(fn, ctx, spans, nthreads, claim_max);
}
#endif
#endif
