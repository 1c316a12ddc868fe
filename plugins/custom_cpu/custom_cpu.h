/*
 * custom_cpu: the reference device plugin. Host memory plays the device's memory, behind
 * the same walls a real device has: the host only reaches it through the copy APIs.
 *
 * Shared declarations of the plugin's source files.
 */
#ifndef CUSTOM_CPU_H
#define CUSTOM_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "llaisys/device_ext.h"
#include "llaisys/kernel_ext.h"

#define CC_DEVICE_TYPE "custom_cpu" /* also spelled out in kernels.c's registrations */
#define CC_SUB_DEVICE_TYPE "reference-1"
#define CC_NUM_DEVICES 2

/* 1 when `device` names one of this plugin's devices. */
int cc_valid_device(const C_Device device);

/* Bytes of one element of `dtype`; 0 for UNDEFINED or an unknown value. */
size_t cc_dtype_size(C_DataType dtype);

/* ---- streams and events (stream.c) ---- */
C_Status cc_create_stream(const C_Device device, C_Stream *stream);
C_Status cc_destroy_stream(const C_Device device, C_Stream stream);
C_Status cc_query_stream(const C_Device device, C_Stream stream);
C_Status cc_stream_add_callback(const C_Device device, C_Stream stream, C_Callback callback,
                                void *user_data);
C_Status cc_synchronize_stream(const C_Device device, C_Stream stream);
C_Status cc_synchronize_device(const C_Device device);
C_Status cc_create_event(const C_Device device, C_Event *event);
C_Status cc_record_event(const C_Device device, C_Stream stream, C_Event event);
C_Status cc_destroy_event(const C_Device device, C_Event event);
C_Status cc_query_event(const C_Device device, C_Event event);
C_Status cc_synchronize_event(const C_Device device, C_Event event);
C_Status cc_stream_wait_event(const C_Device device, C_Stream stream, C_Event event);

/* Run `fn(arg)` on `stream` after the work queued before it, then `free(arg)`.
   With a NULL stream it runs now. */
C_Status cc_stream_submit(C_Stream stream, void (*fn)(void *), void *arg);

/* Copy `size` bytes on `stream` in order (now when the stream is NULL). */
C_Status cc_stream_copy(C_Stream stream, void *dst, const void *src, size_t size);

/* Wait until the work queued on `stream` so far has run (nothing to wait for when NULL). */
void cc_stream_drain(C_Stream stream);

/* ---- collective communication (ccl.c) ---- */
void cc_fill_ccl_api(C_DeviceInterface *api);

/* ---- ranks in several processes, over POSIX shared memory (ccl_shm.c) ---- */
#define CC_CCL_MAX_RANKS 64
#define CC_CCL_CHUNK ((size_t)1 << 20) /* bytes of each staging area */

typedef struct cc_group cc_group; /* one rank's view of a communicator's shared segment */

/* Attach rank `rank` of `nranks` to the segment called `name` (creating it if first) and wait
   until every rank has; then the name is unlinked. C_ERROR for a group size that differs from
   the other ranks' or a rank taken twice, C_FAILED for a timeout or a dead peer. */
C_Status cc_group_join(const char *name, size_t nranks, size_t rank, cc_group **group);

/* Detach from the segment (the memory goes once every rank has). */
void cc_group_leave(cc_group *group);

/* Return once every rank has called it; C_FAILED (with a message on stderr) when a peer died,
   the wait timed out, or the group failed before. `what` names the caller in messages. */
C_Status cc_group_barrier(cc_group *group, const char *what);

/* Staging area of `rank` (CC_CCL_CHUNK bytes) and the shared result area (as many). */
unsigned char *cc_group_slot(cc_group *group, size_t rank);
unsigned char *cc_group_result(cc_group *group);

/* ---- reductions of staged data (ccl_reduce.c) ---- */

/* 1 when `op` is defined for `dtype`: the integer and floating types. */
int cc_reducible(C_DataType dtype, C_CCLReduceOp op);

/* dst[i] = src[0][i] op src[1][i] op ... op src[nsrc - 1][i] for i < n, in that order, so every
   rank that reduces the same inputs gets the same bits. Floating types accumulate in double
   and round once; integers wrap; AVG is the sum divided by nsrc. */
void cc_reduce(C_DataType dtype, C_CCLReduceOp op, void *dst, const void *const *src, size_t nsrc,
               size_t n);

/* ---- kernels (kernels.c) ---- */
C_Status cc_blas_axpby(const C_Device device, C_Stream stream, C_DataType dtype, size_t numel,
                       float alpha, void *x, float beta, void *y);

#endif /* CUSTOM_CPU_H */
