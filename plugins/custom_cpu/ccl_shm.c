/*
 * Ranks in several processes of one host, over a POSIX shared-memory segment: a header
 * (arrivals, each rank's pid, a barrier, a failure flag), a result area and one staging
 * area per rank.
 *
 * Every wait is bounded: by LLAISYS_CCL_TIMEOUT seconds (default 60), and by the peers'
 * lives, checked every CHECK_INTERVAL seconds, so a dead peer fails the wait with C_FAILED
 * instead of a hang. A failure marks the whole group failed, so its other ranks stop too.
 * Waiting spins briefly, then yields, then sleeps on a futex: ranks may outnumber cores.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "custom_cpu.h"

#define HEADER_BYTES ((size_t)4096)
#define DEFAULT_TIMEOUT 60.0
#define CHECK_INTERVAL 0.1 /* seconds between checks of the peers' lives */
#define SLEEP_NS 10000000L /* one futex sleep; a wake ends it early */

typedef struct {
  _Atomic uint32_t arrived; /* ranks attached so far */
  _Atomic uint32_t waiting; /* ranks in the current barrier */
  _Atomic uint32_t gen;     /* barriers completed */
  _Atomic int32_t failed;   /* 1 + the rank whose failure stopped the group; 0 while healthy */
  _Atomic int32_t pid[CC_CCL_MAX_RANKS];
} shm_header;

_Static_assert(sizeof(shm_header) <= HEADER_BYTES, "the header outgrew its page");

struct cc_group {
  shm_header *hdr;
  unsigned char *base;
  size_t size;
  size_t nranks, rank;
  double timeout; /* seconds one wait may take */
  int reported;   /* the group's failure was printed already */
};

static size_t segment_size(size_t nranks) { return HEADER_BYTES + (nranks + 1) * CC_CCL_CHUNK; }

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double timeout_from_env(void) {
  const char *env = getenv("LLAISYS_CCL_TIMEOUT");
  char *end = NULL;
  double t = env ? strtod(env, &end) : 0.0;
  return env && end != env && t > 0.0 ? t : DEFAULT_TIMEOUT;
}

static void sleep_on(_Atomic uint32_t *word, uint32_t value) {
#ifdef __linux__
  struct timespec ts = {0, SLEEP_NS};
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, value, &ts, NULL, 0);
#else
  (void)word, (void)value;
  struct timespec ts = {0, 1000000L};
  nanosleep(&ts, NULL);
#endif
}

static void wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* 1 when process `pid` is gone, or exited and waits for its parent to reap it. */
static int process_dead(pid_t pid) {
  if (pid <= 0 || pid == getpid()) return 0;
  if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')'); /* "pid (name) state ...": the name may hold ')' */
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

static int dead_peer(const cc_group *g) {
  for (size_t r = 0; r < g->nranks; ++r)
    if (r != g->rank && process_dead(atomic_load(&g->hdr->pid[r]))) return (int)r;
  return -1;
}

/* Mark the group failed because of rank `culprit`, say why on stderr, return C_FAILED. */
static C_Status fail(cc_group *g, int culprit, const char *what, const char *why) {
  int32_t healthy = 0;
  atomic_compare_exchange_strong(&g->hdr->failed, &healthy, culprit + 1);
  if (!g->reported)
    fprintf(stderr, "custom_cpu ccl: rank %zu of %zu: %s failed: %s\n", g->rank, g->nranks, what,
            why);
  g->reported = 1;
  return C_FAILED;
}

static C_Status group_failed(cc_group *g, const char *what) {
  char why[96];
  snprintf(why, sizeof why, "the communicator stopped after rank %d failed",
           (int)atomic_load(&g->hdr->failed) - 1);
  return fail(g, -1, what, why);
}

/* Wait until *word differs from `value`, until `deadline` at the latest. */
static C_Status wait_change(cc_group *g, _Atomic uint32_t *word, uint32_t value, double deadline,
                            const char *what) {
  double next_check = now() + CHECK_INTERVAL;
  for (unsigned spin = 0;; ++spin) {
    if (atomic_load_explicit(word, memory_order_acquire) != value) return C_SUCCESS;
    if (atomic_load(&g->hdr->failed)) return group_failed(g, what);
    if (spin < 64) continue;
    if (spin < 96) {
      sched_yield();
      continue;
    }
    sleep_on(word, value);
    double t = now();
    if (t >= next_check) {
      int dead = dead_peer(g);
      /* A peer may finish the wait for us and then exit: only a wait still open fails. */
      if (dead >= 0 && atomic_load_explicit(word, memory_order_acquire) == value) {
        char why[96];
        snprintf(why, sizeof why, "rank %d (pid %ld) died", dead,
                 (long)atomic_load(&g->hdr->pid[dead]));
        return fail(g, dead, what, why);
      }
      next_check = t + CHECK_INTERVAL;
    }
    if (t >= deadline && atomic_load_explicit(word, memory_order_acquire) == value) {
      char why[128];
      snprintf(why, sizeof why, "timed out after %g s waiting for the other ranks "
               "(LLAISYS_CCL_TIMEOUT)", g->timeout);
      return fail(g, (int)g->rank, what, why);
    }
  }
}

C_Status cc_group_barrier(cc_group *g, const char *what) {
  shm_header *h = g->hdr;
  if (atomic_load(&h->failed)) return group_failed(g, what);
  uint32_t gen = atomic_load_explicit(&h->gen, memory_order_acquire);
  if (atomic_fetch_add_explicit(&h->waiting, 1, memory_order_acq_rel) + 1 == g->nranks) {
    atomic_store_explicit(&h->waiting, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->gen, 1, memory_order_release);
    wake_all(&h->gen);
    return C_SUCCESS;
  }
  return wait_change(g, &h->gen, gen, now() + g->timeout, what);
}

/* Open the segment `name` of `size` bytes: create it, or open the one a peer created (which
   a segment of another size, made for another number of ranks, fails with C_ERROR). Returns
   the descriptor, or -1 with *status set. */
static int open_segment(const char *name, size_t size, double deadline, C_Status *status) {
  *status = C_FAILED;
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd >= 0) {
    int err = posix_fallocate(fd, 0, (off_t)size); /* a full /dev/shm fails here, not later */
    if ((err == EINVAL || err == EOPNOTSUPP) && ftruncate(fd, (off_t)size) == 0) err = 0;
    if (err == 0) return fd;
    fprintf(stderr, "custom_cpu ccl: cannot size %s to %zu bytes: %s\n", name, size, strerror(err));
    close(fd);
    shm_unlink(name);
    return -1;
  }
  if (errno != EEXIST || (fd = shm_open(name, O_RDWR, 0600)) < 0) {
    fprintf(stderr, "custom_cpu ccl: cannot open %s: %s\n", name, strerror(errno));
    return -1;
  }
  struct stat st = {0};
  while (fstat(fd, &st) == 0 && st.st_size == 0 && now() < deadline) { /* the creator sizes it */
    struct timespec ts = {0, 1000000L};
    nanosleep(&ts, NULL);
  }
  if ((size_t)st.st_size == size) return fd;
  if (st.st_size == 0)
    fprintf(stderr, "custom_cpu ccl: %s was never sized by its creator\n", name);
  else {
    fprintf(stderr, "custom_cpu ccl: %s was made for another number of ranks\n", name);
    *status = C_ERROR;
  }
  close(fd);
  return -1;
}

static C_Status join_failed(cc_group *g, const char *name, C_Status status) {
  shm_unlink(name); /* whoever still comes finds no stale segment */
  if (g->base) munmap(g->base, g->size);
  free(g);
  return status;
}

C_Status cc_group_join(const char *name, size_t nranks, size_t rank, cc_group **out) {
  if (nranks < 2 || nranks > CC_CCL_MAX_RANKS || rank >= nranks) return C_ERROR;
  cc_group *g = (cc_group *)calloc(1, sizeof *g);
  if (!g) return C_FAILED;
  g->nranks = nranks;
  g->rank = rank;
  g->size = segment_size(nranks);
  g->timeout = timeout_from_env();
  double deadline = now() + g->timeout;
  C_Status status;
  int fd = open_segment(name, g->size, deadline, &status);
  if (fd < 0) {
    free(g);
    return status;
  }
  void *base = mmap(NULL, g->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return join_failed(g, name, C_FAILED);
  g->base = (unsigned char *)base;
  g->hdr = (shm_header *)base;
  shm_header *h = g->hdr; /* all zero as created: nothing to initialise */
  int32_t nobody = 0;
  if (!atomic_compare_exchange_strong(&h->pid[rank], &nobody, (int32_t)getpid())) {
    char why[64];
    snprintf(why, sizeof why, "the rank is taken by pid %ld", (long)nobody);
    fail(g, (int)rank, "comm_init_rank", why);
    return join_failed(g, name, C_ERROR);
  }
  uint32_t arrived = atomic_fetch_add(&h->arrived, 1) + 1;
  wake_all(&h->arrived);
  while (arrived < nranks) {
    if (wait_change(g, &h->arrived, arrived, deadline, "comm_init_rank") != C_SUCCESS)
      return join_failed(g, name, C_FAILED);
    arrived = atomic_load(&h->arrived);
  }
  shm_unlink(name); /* every rank has it mapped: nothing is left behind, whatever happens next */
  *out = g;
  return C_SUCCESS;
}

void cc_group_leave(cc_group *g) {
  if (!g) return;
  munmap(g->base, g->size);
  free(g);
}

unsigned char *cc_group_slot(cc_group *g, size_t rank) {
  return g->base + HEADER_BYTES + (rank + 1) * CC_CCL_CHUNK;
}

unsigned char *cc_group_result(cc_group *g) { return g->base + HEADER_BYTES; }
