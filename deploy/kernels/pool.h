/* A small thread pool for parallel_for(fn, ctx, n_tasks): persistent workers that spin briefly
 * between calls and then sleep; the calling thread works too. Included once, by _qmatmul.c. */
#ifndef KNOT_POOL_H
#define KNOT_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef void (*task_fn)(void *ctx, int task);

#define MAX_THREADS 256

static struct {
    int n_threads;               /* including the caller */
    int n_workers;               /* threads started: n_threads - 1 */
    pthread_t *threads;
    pid_t pid;                   /* the pool belongs to this process (fork leaves no workers) */
    long spin_ns;                /* how long an idle worker spins before sleeping */
    pthread_mutex_t busy;        /* one caller at a time; others run single-threaded */
    pthread_mutex_t mu;          /* guards sleeping workers' wait */
    pthread_cond_t cv;
    atomic_uint gen;             /* bumped once per job */
    struct { _Alignas(64) _Atomic uint64_t v; } range[MAX_THREADS];  /* per thread: tasks [lo, hi) as lo | hi << 32 */
    atomic_int next_slot;        /* the next joining worker's range */
    atomic_int open;             /* the current job still takes workers */
    atomic_int refs;             /* workers inside the current job */
    atomic_int stop;
    int sleeping;                /* under mu */
    task_fn fn;
    void *ctx;
    int n_tasks;
} P = {.n_threads = 1, .spin_ns = 1000000, .busy = PTHREAD_MUTEX_INITIALIZER,
       .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Each thread owns a contiguous range of the tasks and takes them from the front, so it reads
 * W as one sequential stream (interleaved small chunks defeat the hardware prefetchers: half
 * the bandwidth). A thread without work left steals the back half of the fullest range and
 * goes on from its front, so a descheduled thread on a loaded machine delays little. */
static int take_front(int slot) {
    _Atomic uint64_t *r = &P.range[slot].v;
    uint64_t v = atomic_load_explicit(r, memory_order_relaxed);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        if (atomic_compare_exchange_weak(r, &v, ((uint64_t)hi << 32) | (lo + 1))) return (int)lo;
    }
}

static int steal_half(int slot) {  /* 1: range[slot] holds stolen tasks; 0: none left */
    for (;;) {
        int best = -1;
        uint32_t most = 0;
        for (int i = 0; i < P.n_threads; i++) {
            const uint64_t v = atomic_load_explicit(&P.range[i].v, memory_order_relaxed);
            const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
            if (i != slot && hi > lo && hi - lo > most) { most = hi - lo; best = i; }
        }
        if (best < 0) return 0;
        uint64_t v = atomic_load(&P.range[best].v);
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32), mid = lo + (hi - lo) / 2;
        if (lo < hi && atomic_compare_exchange_strong(&P.range[best].v, &v, ((uint64_t)mid << 32) | lo)) {
            atomic_store(&P.range[slot].v, ((uint64_t)hi << 32) | mid);
            return 1;
        }
    }
}

static void run_tasks(int slot) {
    do {
        int t;
        while ((t = take_front(slot)) >= 0) P.fn(P.ctx, t);
    } while (steal_half(slot));
}

/* A worker joins the job of generation g only while it is open: it takes a reference first,
 * then checks; the caller closes the job first, then waits for the references to drop. So the
 * caller never waits for a worker that was descheduled before it joined (a loaded machine), and
 * never rewrites the job while a worker reads it. */
static void join_job(unsigned g) {
    atomic_fetch_add(&P.refs, 1);
    if (atomic_load(&P.gen) == g && atomic_load(&P.open)) {
        const int slot = atomic_fetch_add(&P.next_slot, 1);
        if (slot < P.n_threads) run_tasks(slot);
    }
    atomic_fetch_sub_explicit(&P.refs, 1, memory_order_release);
}

static void *worker_main(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg;  /* the generation when the pool started */
    for (;;) {
        unsigned g;
        long t0 = 0;
        for (int spins = 0; (g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen; spins++) {
            if (atomic_load_explicit(&P.stop, memory_order_relaxed)) return NULL;
            cpu_relax();
            if ((spins & 255) == 0) {
                sched_yield();  /* on a loaded machine, a thread with work may be waiting for this CPU */
                const long t = now_ns();
                if (!t0) t0 = t;
                else if (t - t0 > P.spin_ns) {
                    pthread_mutex_lock(&P.mu);
                    P.sleeping++;
                    while ((g = atomic_load(&P.gen)) == seen && !atomic_load(&P.stop))
                        pthread_cond_wait(&P.cv, &P.mu);
                    P.sleeping--;
                    pthread_mutex_unlock(&P.mu);
                    break;
                }
            }
        }
        if (atomic_load(&P.stop)) return NULL;
        seen = g;
        join_job(g);
    }
}

static void pool_stop(void) {
    if (P.n_workers && P.pid == getpid()) {
        pthread_mutex_lock(&P.mu);
        atomic_store(&P.stop, 1);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
        for (int i = 0; i < P.n_workers; i++) pthread_join(P.threads[i], NULL);
    }
    free(P.threads);
    P.threads = NULL;
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
}

/* Start the workers of P.n_threads in this process if they are not running. Holds P.busy. */
static void pool_ensure(void) {
    if (P.n_workers == P.n_threads - 1 && P.pid == getpid()) return;
    pool_stop();
    P.pid = getpid();
    P.threads = calloc((size_t)(P.n_threads > 1 ? P.n_threads - 1 : 1), sizeof(pthread_t));
    if (!P.threads) return;
    for (int i = 0; i < P.n_threads - 1; i++) {
        void *gen = (void *)(uintptr_t)atomic_load(&P.gen);  /* a worker starting late must not miss a job */
        if (pthread_create(&P.threads[P.n_workers], NULL, worker_main, gen) != 0) break;
        P.n_workers++;
    }
}

static void after_fork_child(void) {
    /* the child has only the forking thread: forget the workers, reset the locks */
    P.threads = NULL;
    P.n_workers = 0;
    P.pid = 0;
    pthread_mutex_init(&P.busy, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    P.sleeping = 0;
    atomic_store(&P.refs, 0);
    atomic_store(&P.open, 0);
}

/* fn(ctx, task) for task in [0, n_tasks), on the pool when it is free and parallel is set. */
static void parallel_for(task_fn fn, void *ctx, int n_tasks, int parallel) {
    if (!parallel || n_tasks < 2 || P.n_threads < 2 || pthread_mutex_trylock(&P.busy) != 0) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    pool_ensure();
    P.fn = fn;
    P.ctx = ctx;
    P.n_tasks = n_tasks;
    for (int i = 0; i < P.n_threads; i++) {  /* contiguous ranges: thread i gets the i-th share */
        const uint64_t lo = (uint64_t)n_tasks * i / P.n_threads, hi = (uint64_t)n_tasks * (i + 1) / P.n_threads;
        atomic_store_explicit(&P.range[i].v, lo | hi << 32, memory_order_relaxed);
    }
    atomic_store_explicit(&P.next_slot, 1, memory_order_relaxed);
    atomic_store(&P.open, 1);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.gen, 1);  /* publishes the job */
    if (P.sleeping) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    run_tasks(0);
    atomic_store(&P.open, 0);  /* close, then wait for the workers inside to finish their tasks */
    /* a worker inside still runs its last task; if it was descheduled, let it have the CPU */
    for (int spins = 0; atomic_load_explicit(&P.refs, memory_order_acquire) > 0; spins++) {
        cpu_relax();
        if (spins > 256) sched_yield();
    }
    pthread_mutex_unlock(&P.busy);
}

#endif
