/*
 * Collective communication.
 *
 * A communicator of one rank needs no peer: every collective is a copy of the local buffer
 * (the sum, mean, max, min or product of one value is that value), queued on the stream like
 * any other work.
 *
 * Ranks in several processes of one host meet in a shared-memory segment (ccl_shm.c) named by
 * the unique id. A collective first waits for the work queued on its stream, then runs on
 * the calling thread in steps of at most CC_CCL_CHUNK bytes per rank: each rank stages its
 * part in its own staging area, a barrier, each rank reads what it needs, a barrier (so no
 * rank overwrites a staging area another still reads). Reductions add in rank order 0, 1, ...
 * for every element, so all ranks get the same bits. Point-to-point send and recv, and
 * all-to-all, are refused between processes (C_ERROR).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "custom_cpu.h"

#define CC_UNIQUE_ID_SIZE 32
#define CC_ID_PREFIX "/llcc-"

struct C_CCLComm_st {
  size_t nranks;
  size_t rank;
  unsigned char id[CC_UNIQUE_ID_SIZE];
  cc_group *group; /* NULL for one rank */
};

static int g_group_depth;

static C_Status get_unique_id_size(size_t *size) {
  if (!size) return C_ERROR;
  *size = CC_UNIQUE_ID_SIZE;
  return C_SUCCESS;
}

/* The id is the name of the communicator's shared-memory segment, "/llcc-<pid>-<n>-<random>". */
static C_Status get_unique_id(C_CCLRootId *unique_id) {
  static _Atomic unsigned long counter;
  if (!unique_id || !unique_id->data || unique_id->sz < CC_UNIQUE_ID_SIZE) return C_ERROR;
  unsigned int nonce;
  if (getrandom(&nonce, sizeof nonce, GRND_NONBLOCK) != (ssize_t)sizeof nonce)
    nonce = (unsigned int)time(NULL) ^ (unsigned int)clock();
  memset(unique_id->data, 0, unique_id->sz);
  int n = snprintf((char *)unique_id->data, CC_UNIQUE_ID_SIZE, CC_ID_PREFIX "%ld-%lu-%08x",
                   (long)getpid(), ++counter % 1000000, nonce);
  return n > 0 && n < CC_UNIQUE_ID_SIZE ? C_SUCCESS : C_FAILED;
}

/* The segment name an id holds, or NULL when it holds none. */
static const char *segment_name(const unsigned char *id) {
  const char *name = (const char *)id;
  if (!memchr(id, '\0', CC_UNIQUE_ID_SIZE)) return NULL;
  return strncmp(name, CC_ID_PREFIX, strlen(CC_ID_PREFIX)) == 0 ? name : NULL;
}

static C_Status comm_init_rank(size_t ranks, C_CCLRootId *unique_id, size_t rank,
                               C_CCLComm *comm) {
  if (!comm || !unique_id || !unique_id->data || unique_id->sz < CC_UNIQUE_ID_SIZE)
    return C_ERROR;
  if (ranks == 0 || rank >= ranks || ranks > CC_CCL_MAX_RANKS) return C_ERROR;
  const char *name = segment_name((const unsigned char *)unique_id->data);
  if (ranks > 1 && !name) return C_ERROR; /* one rank needs no segment, so any id will do */
  C_CCLComm c = (C_CCLComm)calloc(1, sizeof *c);
  if (!c) return C_FAILED;
  c->nranks = ranks;
  c->rank = rank;
  memcpy(c->id, unique_id->data, CC_UNIQUE_ID_SIZE);
  if (ranks > 1) {
    C_Status st = cc_group_join(name, ranks, rank, &c->group);
    if (st != C_SUCCESS) {
      free(c);
      return st;
    }
  }
  *comm = c;
  return C_SUCCESS;
}

static C_Status destroy_comm(C_CCLComm comm) {
  if (!comm) return C_ERROR;
  cc_group_leave(comm->group);
  free(comm);
  return C_SUCCESS;
}

/* ---- between processes ---------------------------------------------------------------- */

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

/* Reduce `count` elements over the ranks into `recv` of every rank (root < 0) or of `root`.
   Each step the ranks split the staged elements: each reduces its share into the result area,
   which all (or the root) then copy out. */
static C_Status group_reduce(const unsigned char *send, unsigned char *recv, size_t count,
                             C_DataType dtype, C_CCLReduceOp op, long root, C_CCLComm c,
                             const char *what) {
  cc_group *g = c->group;
  size_t item = cc_dtype_size(dtype), n = c->nranks, step = CC_CCL_CHUNK / item;
  const void *src[CC_CCL_MAX_RANKS];
  unsigned char *result = cc_group_result(g);
  for (size_t off = 0; off < count; off += step) {
    size_t m = min_size(step, count - off);
    memcpy(cc_group_slot(g, c->rank), send + off * item, m * item);
    C_Status st = cc_group_barrier(g, what);
    if (st != C_SUCCESS) return st;
    size_t lo = m * c->rank / n, hi = m * (c->rank + 1) / n; /* this rank's share */
    for (size_t r = 0; r < n; ++r) src[r] = cc_group_slot(g, r) + lo * item;
    cc_reduce(dtype, op, result + lo * item, src, n, hi - lo);
    if ((st = cc_group_barrier(g, what)) != C_SUCCESS) return st;
    /* The next write to the result area follows the next barrier, which every rank reaches
       only after this copy. */
    if (root < 0 || (size_t)root == c->rank) memcpy(recv + off * item, result, m * item);
  }
  return C_SUCCESS;
}

static C_Status group_broadcast(unsigned char *buf, size_t count, size_t item, size_t root,
                                C_CCLComm c) {
  cc_group *g = c->group;
  size_t step = CC_CCL_CHUNK / item;
  for (size_t off = 0; off < count; off += step) {
    size_t m = min_size(step, count - off);
    if (c->rank == root) memcpy(cc_group_slot(g, root), buf + off * item, m * item);
    C_Status st = cc_group_barrier(g, "broadcast");
    if (st != C_SUCCESS) return st;
    if (c->rank != root) memcpy(buf + off * item, cc_group_slot(g, root), m * item);
    if ((st = cc_group_barrier(g, "broadcast")) != C_SUCCESS) return st;
  }
  return C_SUCCESS;
}

/* recv holds each rank's `count` elements in rank order. */
static C_Status group_all_gather(const unsigned char *send, unsigned char *recv, size_t count,
                                 size_t item, C_CCLComm c) {
  cc_group *g = c->group;
  size_t step = CC_CCL_CHUNK / item;
  for (size_t off = 0; off < count; off += step) {
    size_t m = min_size(step, count - off);
    memcpy(cc_group_slot(g, c->rank), send + off * item, m * item);
    C_Status st = cc_group_barrier(g, "all_gather");
    if (st != C_SUCCESS) return st;
    for (size_t r = 0; r < c->nranks; ++r)
      memcpy(recv + (r * count + off) * item, cc_group_slot(g, r), m * item);
    if ((st = cc_group_barrier(g, "all_gather")) != C_SUCCESS) return st;
  }
  return C_SUCCESS;
}

/* send holds nranks blocks of `count` elements; rank r gets the reduction of block r. Each
   step every rank stages a piece of every block, and reduces the pieces of its own. */
static C_Status group_reduce_scatter(const unsigned char *send, unsigned char *recv, size_t count,
                                     C_DataType dtype, C_CCLReduceOp op, C_CCLComm c) {
  cc_group *g = c->group;
  size_t item = cc_dtype_size(dtype), n = c->nranks, step = CC_CCL_CHUNK / item / n;
  const void *src[CC_CCL_MAX_RANKS];
  for (size_t off = 0; off < count; off += step) {
    size_t m = min_size(step, count - off);
    unsigned char *mine = cc_group_slot(g, c->rank);
    for (size_t r = 0; r < n; ++r)
      memcpy(mine + r * m * item, send + (r * count + off) * item, m * item);
    C_Status st = cc_group_barrier(g, "reduce_scatter");
    if (st != C_SUCCESS) return st;
    for (size_t r = 0; r < n; ++r) src[r] = cc_group_slot(g, r) + c->rank * m * item;
    cc_reduce(dtype, op, recv + off * item, src, n, m);
    if ((st = cc_group_barrier(g, "reduce_scatter")) != C_SUCCESS) return st;
  }
  return C_SUCCESS;
}

/* Every collective of one rank: recv = send (count elements). */
static C_Status local_copy(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                           C_CCLComm comm, C_Stream stream) {
  size_t item = cc_dtype_size(dtype);
  if (!comm || !item || ((!send_buf || !recv_buf) && count)) return C_ERROR;
  if (send_buf == recv_buf || !count) return C_SUCCESS;
  return cc_stream_copy(stream, recv_buf, send_buf, count * item);
}

static int valid_op(C_CCLReduceOp op) { return op >= SUM && op <= PRODUCT; }

/* Arguments every collective between processes checks; then the stream's queued work runs. */
static int group_ready(const void *send_buf, const void *recv_buf, size_t count,
                       C_DataType dtype, C_Stream stream) {
  if (!cc_dtype_size(dtype) || ((!send_buf || !recv_buf) && count)) return 0;
  cc_stream_drain(stream);
  return 1;
}

static C_Status all_reduce(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                           C_CCLReduceOp op, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op)) return C_ERROR;
  if (!comm || !comm->group) return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
  if (!cc_reducible(dtype, op) || !group_ready(send_buf, recv_buf, count, dtype, stream))
    return C_ERROR;
  return group_reduce(send_buf, recv_buf, count, dtype, op, -1, comm, "all_reduce");
}

static C_Status broadcast(void *buf, size_t count, C_DataType dtype, size_t root, C_CCLComm comm,
                          C_Stream stream) {
  if (!comm || root >= comm->nranks || !cc_dtype_size(dtype) || (!buf && count)) return C_ERROR;
  if (!comm->group) return C_SUCCESS; /* the root already holds the data */
  group_ready(buf, buf, count, dtype, stream);
  return group_broadcast(buf, count, cc_dtype_size(dtype), root, comm);
}

static C_Status reduce(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                       C_CCLReduceOp op, size_t root, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op) || !comm || root >= comm->nranks) return C_ERROR;
  if (!comm->group) return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
  /* Only the root writes recv_buf; the other ranks may pass NULL for it. */
  if (!cc_reducible(dtype, op) ||
      !group_ready(send_buf, root == comm->rank ? recv_buf : send_buf, count, dtype, stream))
    return C_ERROR;
  return group_reduce(send_buf, recv_buf, count, dtype, op, (long)root, comm, "reduce");
}

static C_Status all_gather(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                           C_CCLComm comm, C_Stream stream) {
  if (!comm || !comm->group) return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
  if (!group_ready(send_buf, recv_buf, count, dtype, stream)) return C_ERROR;
  return group_all_gather(send_buf, recv_buf, count, cc_dtype_size(dtype), comm);
}

static C_Status reduce_scatter(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                               C_CCLReduceOp op, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op)) return C_ERROR;
  if (!comm || !comm->group) return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
  if (!cc_reducible(dtype, op) || !group_ready(send_buf, recv_buf, count, dtype, stream))
    return C_ERROR;
  return group_reduce_scatter(send_buf, recv_buf, count, dtype, op, comm);
}

static C_Status group_start(void) {
  g_group_depth++;
  return C_SUCCESS;
}

static C_Status group_end(void) {
  if (g_group_depth == 0) return C_ERROR;
  g_group_depth--;
  return C_SUCCESS;
}

static C_Status ccl_send(void *buf, size_t count, C_DataType dtype, size_t peer, C_CCLComm comm,
                     C_Stream stream) {
  (void)buf, (void)count, (void)dtype, (void)peer, (void)comm, (void)stream;
  return C_ERROR; /* no peer in one process; not offered between processes */
}

static C_Status ccl_recv(void *buf, size_t count, C_DataType dtype, size_t peer, C_CCLComm comm,
                     C_Stream stream) {
  (void)buf, (void)count, (void)dtype, (void)peer, (void)comm, (void)stream;
  return C_ERROR;
}

static C_Status all_to_all(const void **send_buf, const size_t *send_count,
                           const C_DataType *send_dtype, void **recv_buf,
                           const size_t *recv_count, const C_DataType *recv_dtype, size_t rank,
                           size_t nranks, C_CCLComm comm, C_Stream stream) {
  if (!comm || comm->group || nranks != comm->nranks || rank != comm->rank || !send_buf ||
      !recv_buf || !send_count || !recv_count || !send_dtype || !recv_dtype)
    return C_ERROR;
  if (send_count[0] != recv_count[0] || send_dtype[0] != recv_dtype[0]) return C_ERROR;
  return local_copy((void *)send_buf[0], recv_buf[0], send_count[0], send_dtype[0], comm, stream);
}

void cc_fill_ccl_api(C_DeviceInterface *api) {
  api->xccl_get_unique_id_size = get_unique_id_size;
  api->xccl_get_unique_id = get_unique_id;
  api->xccl_comm_init_rank = comm_init_rank;
  api->xccl_destroy_comm = destroy_comm;
  api->xccl_all_reduce = all_reduce;
  api->xccl_broadcast = broadcast;
  api->xccl_reduce = reduce;
  api->xccl_all_gather = all_gather;
  api->xccl_reduce_scatter = reduce_scatter;
  api->xccl_group_start = group_start;
  api->xccl_group_end = group_end;
  api->xccl_send = ccl_send;
  api->xccl_recv = ccl_recv;
  api->xccl_all_to_all = all_to_all;
}
