/*
 * device_ext.h: the llaisys device plugin ABI (custom runtime, version 0.1.x).
 *
 * A device plugin is a shared library exporting `InitPlugin`. llaisys loads it, hands
 * `InitPlugin` a zeroed `CustomRuntimeParams` whose `size` fields are set, and the plugin
 * fills in its version, its device type name and the function pointers of the
 * `C_DeviceInterface` it implements. Pointers left NULL are optional APIs that llaisys
 * replaces with a fallback (see docs/plugins.md for the table).
 *
 * The layout is binary-compatible with the custom-device runtime ABI 0.1.x of PaddlePaddle
 * (same field order, types and reserved slots), so a runtime plugin built for it loads here
 * unmodified, and a plugin built against this header also loads there. Its sources compile
 * against this header unchanged, in C or C++: the enumerator, type and macro names are the
 * same (PADDLE_CUSTOM_RUNTIME_*), the same standard headers are included, and the host
 * functions such plugins may call (profiler_add_*_trace_event) are declared and provided by
 * llaisys.
 *
 * Conventions of every API:
 *   - return C_SUCCESS, or another C_Status saying what went wrong (llaisys raises it as an
 *     error naming the plugin, the API and the status; C_WARNING is logged once);
 *   - a C_Device points at the host's `struct C_Device_st` for one device; `id` is the
 *     physical id from `get_device_list`;
 *   - device pointers are opaque to llaisys, which only passes them back (possibly offset by
 *     a byte count inside an allocation) and never dereferences them;
 *   - query_stream / query_event return C_SUCCESS when the work is complete and C_FAILED
 *     when it is still pending.
 */
#ifndef LLAISYS_DEVICE_EXT_H
#define LLAISYS_DEVICE_EXT_H

/* Plugin sources written for PaddlePaddle call memcpy, memset, malloc and free without
 * including anything but the device header, so these come with it. */
#ifdef __cplusplus
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#else
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define LLAISYS_PLUGIN_EXPORT __declspec(dllexport)
#define LLAISYS_HOST_API
#else
#define LLAISYS_PLUGIN_EXPORT __attribute__((visibility("default")))
#define LLAISYS_HOST_API __attribute__((visibility("default"))) /* defined by the host */
#endif

/* The ABI version this header describes. Like PaddlePaddle, llaisys loads plugins reporting
 * 0.1.1 or later (and warns about any other than 0.1.x). */
#define LLAISYS_CUSTOM_RUNTIME_MAJOR_VERSION 0
#define LLAISYS_CUSTOM_RUNTIME_MINOR_VERSION 1
#define LLAISYS_CUSTOM_RUNTIME_PATCH_VERSION 1

/* Element types as the plugin ABI numbers them (not llaisysDataType_t's numbering). */
typedef enum {
  UNDEFINED = 0,
  BOOL,
  UINT8,
  UINT16,
  UINT32,
  UINT64,
  INT8,
  INT16,
  INT32,
  INT64,
  FLOAT16,
  FLOAT32,
  FLOAT64,
  BFLOAT16,
  COMPLEX64,
  COMPLEX128,
} C_DataType;

/* Memory layouts a kernel may be registered for; ALL_LAYOUT accepts any strided tensor. */
typedef enum {
  ANY = 0,
  NHWC,
  NCHW,
  NCDHW,
  NDHWC,
  STRIDED,
  NUM_DATA_LAYOUTS,
  ALL_LAYOUT = ANY,
} C_DataLayout;

typedef enum {
  C_SUCCESS = 0,    /* done */
  C_WARNING,        /* done, but not as asked (e.g. an "async" copy ran synchronously) */
  C_FAILED,         /* out of resources, or the request could not be served */
  C_ERROR,          /* bad argument, wrong use, or not initialised */
  C_INTERNAL_ERROR  /* the plugin itself failed */
} C_Status;

typedef struct C_Device_st {
  int id;
} *C_Device;

typedef struct C_Stream_st *C_Stream; /* an ordered queue of device work */
typedef struct C_Event_st *C_Event;   /* a marker in a stream that others can wait for */

/* A host function a stream runs once the work queued before it is done. */
typedef void (*C_Callback)(C_Device device, C_Stream stream, void *user_data, C_Status *status);

/* Collective communication: the id rank 0 makes and shares with the others. */
typedef struct {
  size_t sz;
  void *data;
} C_CCLRootId;

typedef struct C_CCLComm_st *C_CCLComm;

typedef enum { SUM = 0, AVG, MAX, MIN, PRODUCT } C_CCLReduceOp;

typedef struct C_Profiler_st *C_Profiler;

/*
 * Host functions a plugin may call from its profiler APIs to hand trace events to the host
 * (`event` points to the host profiler's own event record). llaisys exports both from its
 * native library `llaisys._native._host`, loaded with global symbols before any plugin, so
 * plugins that link against them load. llaisys calls no profiler API and only counts these
 * calls (llaisys.plugins.trace_event_counts()).
 */
LLAISYS_HOST_API void profiler_add_runtime_trace_event(C_Profiler prof, void *event);
LLAISYS_HOST_API void profiler_add_device_trace_event(C_Profiler prof, void *event);

/* The function table a plugin fills. 912 bytes on LP64/LLP64 targets. */
typedef struct C_DeviceInterface {
  size_t size; /* set by the host before InitPlugin: sizeof(C_DeviceInterface); not read after */

  /* ---- devices, streams, events (18 APIs + 8 reserved) ---- */
  C_Status (*initialize)(void);
  C_Status (*finalize)(void);
  C_Status (*init_device)(const C_Device device);   /* may replace device->id */
  C_Status (*set_device)(const C_Device device);    /* the calling thread's current device */
  C_Status (*get_device)(const C_Device device);    /* writes the current device's id */
  C_Status (*deinit_device)(const C_Device device);
  C_Status (*create_stream)(const C_Device device, C_Stream *stream);
  C_Status (*destroy_stream)(const C_Device device, C_Stream stream);
  C_Status (*query_stream)(const C_Device device, C_Stream stream);
  C_Status (*stream_add_callback)(const C_Device device, C_Stream stream, C_Callback callback,
                                  void *user_data);
  C_Status (*create_event)(const C_Device device, C_Event *event);
  C_Status (*record_event)(const C_Device device, C_Stream stream, C_Event event);
  C_Status (*destroy_event)(const C_Device device, C_Event event);
  C_Status (*query_event)(const C_Device device, C_Event event);
  C_Status (*synchronize_device)(const C_Device device);
  C_Status (*synchronize_stream)(const C_Device device, C_Stream stream);
  C_Status (*synchronize_event)(const C_Device device, C_Event event);
  C_Status (*stream_wait_event)(const C_Device device, C_Stream stream, C_Event event);
  void *reserved_dev_api[8];

  /* ---- memory (15 APIs + 8 reserved) ---- */
  C_Status (*device_memory_allocate)(const C_Device device, void **ptr, size_t size);
  C_Status (*device_memory_deallocate)(const C_Device device, void *ptr, size_t size);
  C_Status (*device_memory_set)(const C_Device device, void *ptr, unsigned char value,
                                size_t size);
  C_Status (*host_memory_allocate)(const C_Device device, void **ptr, size_t size);
  C_Status (*host_memory_deallocate)(const C_Device device, void *ptr, size_t size);
  C_Status (*unified_memory_allocate)(const C_Device device, void **ptr, size_t size);
  C_Status (*unified_memory_deallocate)(const C_Device device, void *ptr, size_t size);
  C_Status (*memory_copy_h2d)(const C_Device device, void *dst, const void *src, size_t size);
  C_Status (*memory_copy_d2h)(const C_Device device, void *dst, const void *src, size_t size);
  C_Status (*memory_copy_d2d)(const C_Device device, void *dst, const void *src, size_t size);
  C_Status (*memory_copy_p2p)(const C_Device dst_device, const C_Device src_device, void *dst,
                              const void *src, size_t size);
  C_Status (*async_memory_copy_h2d)(const C_Device device, C_Stream stream, void *dst,
                                    const void *src, size_t size);
  C_Status (*async_memory_copy_d2h)(const C_Device device, C_Stream stream, void *dst,
                                    const void *src, size_t size);
  C_Status (*async_memory_copy_d2d)(const C_Device device, C_Stream stream, void *dst,
                                    const void *src, size_t size);
  C_Status (*async_memory_copy_p2p)(const C_Device dst_device, const C_Device src_device,
                                    C_Stream stream, void *dst, const void *src, size_t size);
  void *reserved_mem_api[8];

  /* ---- information (12 APIs + 8 reserved) ---- */
  C_Status (*get_device_count)(size_t *count);
  C_Status (*get_device_list)(size_t *devices); /* writes get_device_count ids */
  C_Status (*device_memory_stats)(const C_Device device, size_t *total_memory,
                                  size_t *free_memory);
  C_Status (*device_min_chunk_size)(const C_Device device, size_t *size);
  C_Status (*device_max_chunk_size)(const C_Device device, size_t *size);
  C_Status (*device_max_alloc_size)(const C_Device device, size_t *size);
  C_Status (*device_extra_padding_size)(const C_Device device, size_t *size);
  C_Status (*device_init_alloc_size)(const C_Device device, size_t *size);
  C_Status (*device_realloc_size)(const C_Device device, size_t *size);
  C_Status (*get_compute_capability)(size_t *compute_capability);
  C_Status (*get_runtime_version)(size_t *version);
  C_Status (*get_driver_version)(size_t *version);
  void *reserved_info_api[8];

  /* ---- collective communication (14 APIs + 8 reserved) ---- */
  C_Status (*xccl_get_unique_id_size)(size_t *size);
  C_Status (*xccl_get_unique_id)(C_CCLRootId *unique_id);
  C_Status (*xccl_comm_init_rank)(size_t ranks, C_CCLRootId *unique_id, size_t rank,
                                  C_CCLComm *comm);
  C_Status (*xccl_destroy_comm)(C_CCLComm comm);
  C_Status (*xccl_all_reduce)(void *send_buf, void *recv_buf, size_t count, C_DataType data_type,
                              C_CCLReduceOp op, C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_broadcast)(void *buf, size_t count, C_DataType data_type, size_t root,
                             C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_reduce)(void *send_buf, void *recv_buf, size_t count, C_DataType data_type,
                          C_CCLReduceOp op, size_t root, C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_all_gather)(void *send_buf, void *recv_buf, size_t count, C_DataType data_type,
                              C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_reduce_scatter)(void *send_buf, void *recv_buf, size_t count,
                                  C_DataType data_type, C_CCLReduceOp op, C_CCLComm comm,
                                  C_Stream stream);
  C_Status (*xccl_group_start)(void);
  C_Status (*xccl_group_end)(void);
  C_Status (*xccl_send)(void *send_buf, size_t count, C_DataType data_type, size_t dest_rank,
                        C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_recv)(void *recv_buf, size_t count, C_DataType data_type, size_t src_rank,
                        C_CCLComm comm, C_Stream stream);
  C_Status (*xccl_all_to_all)(const void **send_buf, const size_t *send_count,
                              const C_DataType *send_dtype, void **recv_buf,
                              const size_t *recv_count, const C_DataType *recv_dtype, size_t rank,
                              size_t nranks, C_CCLComm comm, C_Stream stream);
  void *reserved_ccl_api[8];

  /* ---- profiler (6 APIs + 8 reserved); llaisys does not call these ---- */
  C_Status (*profiler_initialize)(C_Profiler prof, void **user_data);
  C_Status (*profiler_finalize)(C_Profiler prof, void *user_data);
  C_Status (*profiler_prepare_tracing)(C_Profiler prof, void *user_data);
  C_Status (*profiler_start_tracing)(C_Profiler prof, void *user_data);
  C_Status (*profiler_stop_tracing)(C_Profiler prof, void *user_data);
  C_Status (*profiler_collect_trace_data)(C_Profiler prof, uint64_t start_ns, void *user_data);
  void *reserved_profiler_api[8];

  /* ---- other (1 API + 7 reserved): y = alpha * x + beta * y ---- */
  C_Status (*blas_axpby)(const C_Device device, C_Stream stream, C_DataType dtype, size_t numel,
                         float alpha, void *x, float beta, void *y);
  void *reserved_other_api[7];
} C_DeviceInterface;

typedef struct CustomRuntimeVersion {
  size_t major, minor, patch;
} CustomRuntimeVersion;

/* The argument of InitPlugin. 88 bytes on LP64/LLP64 targets. */
typedef struct CustomRuntimeParams {
  size_t size;                  /* set by the host: sizeof(CustomRuntimeParams); not read after */
  C_DeviceInterface *interface; /* set by the host, zeroed; the plugin fills the pointers */
  CustomRuntimeVersion version; /* the plugin writes the ABI version it was built with */
  char *device_type;            /* the plugin's device type name, e.g. "custom_cpu" */
  char *sub_device_type;        /* free text, e.g. a hardware revision */
  char reserved[32];
} CustomRuntimeParams;

#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SIZE_MAX == 0xFFFFFFFFFFFFFFFFu
#ifdef __cplusplus
static_assert(sizeof(C_DeviceInterface) == 912, "C_DeviceInterface must be 912 bytes");
static_assert(sizeof(CustomRuntimeParams) == 88, "CustomRuntimeParams must be 88 bytes");
#else
_Static_assert(sizeof(C_DeviceInterface) == 912, "C_DeviceInterface must be 912 bytes");
_Static_assert(sizeof(CustomRuntimeParams) == 88, "CustomRuntimeParams must be 88 bytes");
#endif
#endif

/*
 * First statement of InitPlugin: give up (leaving the version unset, which the host reports)
 * when neither of the host's structs has the size this plugin was compiled with; otherwise
 * write the ABI version. One size differing is accepted, as PaddlePaddle's macro does. The
 * trailing semicolon is PaddlePaddle's too: sources may omit their own.
 */
#define LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params)                          \
  if ((params)->size != sizeof(CustomRuntimeParams) &&                        \
      ((params)->interface == NULL ||                                         \
       (params)->interface->size != sizeof(C_DeviceInterface))) {             \
    return;                                                                   \
  }                                                                           \
  (params)->version.major = LLAISYS_CUSTOM_RUNTIME_MAJOR_VERSION;             \
  (params)->version.minor = LLAISYS_CUSTOM_RUNTIME_MINOR_VERSION;             \
  (params)->version.patch = LLAISYS_CUSTOM_RUNTIME_PATCH_VERSION;

/* The spellings plugin sources written for PaddlePaddle use. */
#ifndef PADDLE_CUSTOM_RUNTIME_MAJOR_VERSION
#define PADDLE_CUSTOM_RUNTIME_MAJOR_VERSION LLAISYS_CUSTOM_RUNTIME_MAJOR_VERSION
#endif
#ifndef PADDLE_CUSTOM_RUNTIME_MINOR_VERSION
#define PADDLE_CUSTOM_RUNTIME_MINOR_VERSION LLAISYS_CUSTOM_RUNTIME_MINOR_VERSION
#endif
#ifndef PADDLE_CUSTOM_RUNTIME_PATCH_VERSION
#define PADDLE_CUSTOM_RUNTIME_PATCH_VERSION LLAISYS_CUSTOM_RUNTIME_PATCH_VERSION
#endif
#ifndef PADDLE_CUSTOM_RUNTIME_CHECK_VERSION
#define PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params) LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params)
#endif

/* The plugin's entry point, found by name. */
LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LLAISYS_DEVICE_EXT_H */
