/* A small thread pool for the quantized kernels.
 *
 * One job at a time (a mutex serializes callers from different threads). A job is an object on
 * the caller's stack: a task, its context and an atomic counter of chunks handed out. The
 * caller and the workers take chunks from the counter until none is left, so a worker that
 * lost its core simply takes fewer chunks. Workers poll briefly after a job (back-to-back
 * calls of a decode step are microseconds apart), then sleep on a condition variable. While
 * polling they yield the CPU every few iterations: on a machine shared with other work, a
 * spinning thread would otherwise take time slices from the caller it waits for (measured:
 * pure spinning made a 2-thread decode step 20% slower there, yielding made it no slower).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "quant.h"

#define MAX_THREADS 256
#define SPIN_NS 50000 /* how long an idle worker polls for the next job before sleeping */

typedef struct {
    lq_task_fn task;
    void *ctx;
    size_t n_chunks;
    int slots;          /* threads numbered below this take part */
    atomic_size_t next; /* next chunk to hand out */
} job_t;

static struct {
    pthread_mutex_t submit;    /* held by the caller for a whole job */
    pthread_mutex_t lock;      /* guards job, busy, stop and the condition variables */
    pthread_cond_t wake, done;
    atomic_ulong generation;   /* bumped for every job */
    job_t *job;                /* the current job, NULL between jobs */
    atomic_int busy;           /* workers inside the current job (changed under lock) */
    int stop;
    int n_threads;             /* workers + the caller; 0 until first use */
    atomic_int forked;         /* set in a fork child, which has the pool's memory but not its threads */
    pthread_t workers[MAX_THREADS];
} pool = {
    .submit = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER,
};

static _Thread_local int inside_task; /* a task that calls the pool runs its chunks inline */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Poll `ready` for up to `ns` nanoseconds, yielding the CPU every 64 polls; true once ready. */
static int poll_for(int (*ready)(void), uint64_t ns) {
    const uint64_t start = now_ns();
    for (int i = 1;; i++) {
        if (ready()) return 1;
        if ((i & 63) == 0) {
            if (now_ns() - start > ns) return 0;
            sched_yield();
        }
        cpu_relax();
    }
}

static void run_chunks(job_t *job, int thread) {
    inside_task = 1;
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (i >= job->n_chunks) break;
        job->task(job->ctx, i, thread);
    }
    inside_task = 0;
}

typedef struct {
    unsigned long generation; /* the last job this worker has seen */
    int thread;               /* its number, 1 .. n_threads - 1 */
} worker_arg;

static worker_arg worker_args[MAX_THREADS];

static _Thread_local unsigned long worker_seen; /* the last job generation this worker saw */

static int new_job(void) { return atomic_load_explicit(&pool.generation, memory_order_acquire) != worker_seen; }

static int workers_done(void) { return atomic_load_explicit(&pool.busy, memory_order_acquire) == 0; }

static void *worker_main(void *arg) {
    const int thread = ((worker_arg *)arg)->thread;
    unsigned long seen = ((worker_arg *)arg)->generation;
    for (;;) {
        worker_seen = seen;
        poll_for(new_job, SPIN_NS);
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen && !pool.stop)
            pthread_cond_wait(&pool.wake, &pool.lock);
        if (pool.stop) {
            pthread_mutex_unlock(&pool.lock);
            return NULL;
        }
        seen = atomic_load(&pool.generation);
        job_t *job = pool.job; /* NULL if the job already finished without us */
        if (job && thread >= job->slots) job = NULL;
        if (job) pool.busy++;
        pthread_mutex_unlock(&pool.lock);
        if (!job) continue;
        run_chunks(job, thread);
        pthread_mutex_lock(&pool.lock);
        if (--pool.busy == 0) pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
}

/* CPUs this process may run on (its affinity mask on Linux), else all online CPUs. */
static int default_threads(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Stop and join the workers. Caller holds pool.submit. */
static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    pool.stop = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.n_threads - 1; i++) pthread_join(pool.workers[i], NULL);
    pool.stop = 0;
}

/* In a fork child: the workers stayed in the parent (asking getpid() on every call instead
 * costs a system call per kernel call). */
static void after_fork_in_child(void) { atomic_store(&pool.forked, 1); }

/* Start n - 1 workers (the caller is the n-th thread). Caller holds pool.submit. */
static int start_workers(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    static int fork_handler;
    if (!fork_handler) fork_handler = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    unsigned long gen = atomic_load(&pool.generation);
    int started = 1;
    for (; started < n; started++) {
        worker_args[started - 1] = (worker_arg){.generation = gen, .thread = started};
        if (pthread_create(&pool.workers[started - 1], NULL, worker_main, &worker_args[started - 1]) != 0) break;
    }
    pool.n_threads = started;
    return started;
}

/* Make sure the pool exists in this process. Caller holds pool.submit. */
static void ensure_pool(void) {
    if (pool.n_threads == 0) {
        start_workers(default_threads());
    } else if (atomic_load_explicit(&pool.forked, memory_order_relaxed)) {
        atomic_store(&pool.forked, 0);
        /* A forked child inherits the pool's memory but not its threads. */
        pool.n_threads = 0;
        atomic_store(&pool.busy, 0);
        pool.job = NULL;
        start_workers(default_threads());
    }
}

void lq_pool_run(lq_task_fn task, void *ctx, size_t n_chunks, int slots) {
    if (n_chunks == 0) return;
    if (n_chunks == 1 || slots <= 1 || inside_task) {
        for (size_t i = 0; i < n_chunks; i++) task(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&pool.submit);
    ensure_pool();
    if (pool.n_threads == 1) {
        pthread_mutex_unlock(&pool.submit);
        for (size_t i = 0; i < n_chunks; i++) task(ctx, i, 0);
        return;
    }
    job_t job = {.task = task, .ctx = ctx, .n_chunks = n_chunks, .slots = slots};
    atomic_init(&job.next, 0);
    pthread_mutex_lock(&pool.lock);
    pool.job = &job;
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    run_chunks(&job, 0);

    /* Every chunk has been handed out; wait for the workers still running one, polling
     * briefly first (they are usually a few microseconds behind). */
    poll_for(workers_done, SPIN_NS / 2);
    pthread_mutex_lock(&pool.lock);
    while (pool.busy > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pool.job = NULL;
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.submit);
}

int lq_pool_set_threads(int n) {
    if (n <= 0) n = default_threads();
    pthread_mutex_lock(&pool.submit);
    if (pool.n_threads > 0 && !atomic_load(&pool.forked)) stop_workers();
    atomic_store(&pool.forked, 0);
    int started = start_workers(n);
    pthread_mutex_unlock(&pool.submit);
    return started;
}

int lq_pool_threads(void) {
    pthread_mutex_lock(&pool.submit);
    ensure_pool();
    int n = pool.n_threads;
    pthread_mutex_unlock(&pool.submit);
    return n;
}
