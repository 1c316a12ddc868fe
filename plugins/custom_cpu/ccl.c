/*
 * Collective communication for one process: a communicator has exactly one rank, so every
 * collective is a copy of the local buffer (the sum, mean, max, min or product of one value
 * is that value), queued on the stream like any other work. Point-to-point send and recv
 * have no peer and are refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "custom_cpu.h"

#define CC_UNIQUE_ID_SIZE 32

struct C_CCLComm_st {
  size_t nranks;
  size_t rank;
  unsigned char id[CC_UNIQUE_ID_SIZE];
};

static int g_group_depth;

static C_Status get_unique_id_size(size_t *size) {
  if (!size) return C_ERROR;
  *size = CC_UNIQUE_ID_SIZE;
  return C_SUCCESS;
}

static C_Status get_unique_id(C_CCLRootId *unique_id) {
  static unsigned long counter;
  if (!unique_id || !unique_id->data || unique_id->sz < CC_UNIQUE_ID_SIZE) return C_ERROR;
  memset(unique_id->data, 0, unique_id->sz);
  snprintf((char *)unique_id->data, CC_UNIQUE_ID_SIZE, "cc-%ld-%lu", (long)getpid(), ++counter);
  return C_SUCCESS;
}

static C_Status comm_init_rank(size_t ranks, C_CCLRootId *unique_id, size_t rank,
                               C_CCLComm *comm) {
  if (!comm || !unique_id || !unique_id->data || unique_id->sz < CC_UNIQUE_ID_SIZE)
    return C_ERROR;
  if (ranks != 1 || rank != 0) return C_ERROR; /* one process, one rank */
  C_CCLComm c = (C_CCLComm)calloc(1, sizeof *c);
  if (!c) return C_FAILED;
  c->nranks = ranks;
  c->rank = rank;
  memcpy(c->id, unique_id->data, CC_UNIQUE_ID_SIZE);
  *comm = c;
  return C_SUCCESS;
}

static C_Status destroy_comm(C_CCLComm comm) {
  if (!comm) return C_ERROR;
  free(comm);
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

static C_Status all_reduce(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                           C_CCLReduceOp op, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op)) return C_ERROR;
  return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
}

static C_Status broadcast(void *buf, size_t count, C_DataType dtype, size_t root, C_CCLComm comm,
                          C_Stream stream) {
  (void)stream;
  if (!comm || root != 0 || !cc_dtype_size(dtype) || (!buf && count)) return C_ERROR;
  return C_SUCCESS; /* the root already holds the data */
}

static C_Status reduce(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                       C_CCLReduceOp op, size_t root, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op) || root != 0) return C_ERROR;
  return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
}

static C_Status all_gather(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                           C_CCLComm comm, C_Stream stream) {
  return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
}

static C_Status reduce_scatter(void *send_buf, void *recv_buf, size_t count, C_DataType dtype,
                               C_CCLReduceOp op, C_CCLComm comm, C_Stream stream) {
  if (!valid_op(op)) return C_ERROR;
  return local_copy(send_buf, recv_buf, count, dtype, comm, stream);
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
  return C_ERROR; /* no other rank to talk to */
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
  if (!comm || nranks != comm->nranks || rank != comm->rank || !send_buf || !recv_buf ||
      !send_count || !recv_count || !send_dtype || !recv_dtype)
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
