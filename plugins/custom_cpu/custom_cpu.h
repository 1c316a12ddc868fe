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

/* ---- collective communication (ccl.c) ---- */
void cc_fill_ccl_api(C_DeviceInterface *api);

/* ---- kernels (kernels.c) ---- */
C_Status cc_blas_axpby(const C_Device device, C_Stream stream, C_DataType dtype, size_t numel,
                       float alpha, void *x, float beta, void *y);

#endif /* CUSTOM_CPU_H */
