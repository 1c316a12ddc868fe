/*
 * Devices, memory and information APIs, and InitPlugin.
 *
 * Each of the CC_NUM_DEVICES devices owns a budget of host memory (1 GiB, or
 * CUSTOM_CPU_MEMORY_MB MiB) that device allocations draw from; memory stats report it
 * honestly and an allocation past it fails with C_FAILED. Every device allocation carries a
 * header so that a free with a wrong pointer, size or device is refused with C_ERROR.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "custom_cpu.h"

#define CC_ALIGN 64
#define CC_MAGIC 0x63757374u /* "cust" */
#define MiB ((size_t)1 << 20)

typedef struct {
  uint32_t magic;
  int32_t device;
  size_t size;
} alloc_header; /* lives in the CC_ALIGN bytes before each device pointer */

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t g_capacity; /* per device, set once */
static size_t g_used[CC_NUM_DEVICES];
static __thread int g_current_device;

int cc_valid_device(const C_Device device) {
  return device && device->id >= 0 && device->id < CC_NUM_DEVICES;
}

size_t cc_dtype_size(C_DataType dtype) {
  switch (dtype) {
    case BOOL: case UINT8: case INT8: return 1;
    case UINT16: case INT16: case FLOAT16: case BFLOAT16: return 2;
    case UINT32: case INT32: case FLOAT32: return 4;
    case UINT64: case INT64: case FLOAT64: case COMPLEX64: return 8;
    case COMPLEX128: return 16;
    default: return 0;
  }
}

static size_t capacity(void) {
  pthread_mutex_lock(&g_mem_mu);
  if (!g_capacity) {
    const char *env = getenv("CUSTOM_CPU_MEMORY_MB");
    long mb = env ? strtol(env, NULL, 10) : 0;
    g_capacity = (mb > 0 ? (size_t)mb : 1024) * MiB;
  }
  size_t cap = g_capacity;
  pthread_mutex_unlock(&g_mem_mu);
  return cap;
}

/* ---- device management ----------------------------------------------------------------- */

static C_Status initialize(void) {
  capacity();
  return C_SUCCESS;
}

static C_Status finalize(void) { return C_SUCCESS; }

static C_Status init_device(const C_Device device) {
  return cc_valid_device(device) ? C_SUCCESS : C_ERROR; /* logical ids are physical ids */
}

static C_Status set_device(const C_Device device) {
  if (!cc_valid_device(device)) return C_ERROR;
  g_current_device = device->id;
  return C_SUCCESS;
}

static C_Status get_device(const C_Device device) {
  if (!device) return C_ERROR;
  device->id = g_current_device;
  return C_SUCCESS;
}

static C_Status deinit_device(const C_Device device) {
  return cc_valid_device(device) ? C_SUCCESS : C_ERROR;
}

/* ---- memory ---------------------------------------------------------------------------- */

static C_Status device_allocate(const C_Device device, void **ptr, size_t size) {
  if (!cc_valid_device(device) || !ptr) return C_ERROR;
  size_t cap = capacity();
  pthread_mutex_lock(&g_mem_mu);
  int room = size <= cap - g_used[device->id];
  if (room) g_used[device->id] += size;
  pthread_mutex_unlock(&g_mem_mu);
  if (!room) return C_FAILED;
  void *raw = NULL;
  if (posix_memalign(&raw, CC_ALIGN, CC_ALIGN + size) != 0) {
    pthread_mutex_lock(&g_mem_mu);
    g_used[device->id] -= size;
    pthread_mutex_unlock(&g_mem_mu);
    return C_FAILED;
  }
  alloc_header *h = (alloc_header *)raw;
  h->magic = CC_MAGIC;
  h->device = device->id;
  h->size = size;
  *ptr = (char *)raw + CC_ALIGN;
  return C_SUCCESS;
}

static C_Status device_deallocate(const C_Device device, void *ptr, size_t size) {
  if (!cc_valid_device(device) || !ptr || ((uintptr_t)ptr % CC_ALIGN) != 0) return C_ERROR;
  alloc_header *h = (alloc_header *)((char *)ptr - CC_ALIGN);
  if (h->magic != CC_MAGIC || h->device != device->id || h->size != size) return C_ERROR;
  h->magic = 0;
  pthread_mutex_lock(&g_mem_mu);
  g_used[device->id] -= size;
  pthread_mutex_unlock(&g_mem_mu);
  free(h);
  return C_SUCCESS;
}

static C_Status device_memory_set(const C_Device device, void *ptr, unsigned char value,
                                  size_t size) {
  if (!cc_valid_device(device) || (!ptr && size)) return C_ERROR;
  memset(ptr, value, size);
  return C_SUCCESS;
}

static C_Status host_allocate(const C_Device device, void **ptr, size_t size) {
  if (!cc_valid_device(device) || !ptr) return C_ERROR;
  return posix_memalign(ptr, CC_ALIGN, size ? size : 1) == 0 ? C_SUCCESS : C_FAILED;
}

static C_Status host_deallocate(const C_Device device, void *ptr, size_t size) {
  (void)size;
  if (!cc_valid_device(device)) return C_ERROR;
  free(ptr);
  return C_SUCCESS;
}

static C_Status copy_sync(const C_Device device, void *dst, const void *src, size_t size) {
  if (!cc_valid_device(device) || ((!dst || !src) && size)) return C_ERROR;
  memmove(dst, src, size);
  return C_SUCCESS;
}

static C_Status copy_p2p(const C_Device dst_device, const C_Device src_device, void *dst,
                         const void *src, size_t size) {
  if (!cc_valid_device(src_device)) return C_ERROR;
  return copy_sync(dst_device, dst, src, size);
}

static C_Status copy_async(const C_Device device, C_Stream stream, void *dst, const void *src,
                           size_t size) {
  if (!cc_valid_device(device) || ((!dst || !src) && size)) return C_ERROR;
  return cc_stream_copy(stream, dst, src, size);
}

static C_Status copy_p2p_async(const C_Device dst_device, const C_Device src_device,
                               C_Stream stream, void *dst, const void *src, size_t size) {
  if (!cc_valid_device(src_device)) return C_ERROR;
  return copy_async(dst_device, stream, dst, src, size);
}

/* ---- information ----------------------------------------------------------------------- */

static C_Status get_device_count(size_t *count) {
  if (!count) return C_ERROR;
  *count = CC_NUM_DEVICES;
  return C_SUCCESS;
}

static C_Status get_device_list(size_t *devices) {
  if (!devices) return C_ERROR;
  for (size_t i = 0; i < CC_NUM_DEVICES; ++i) devices[i] = i;
  return C_SUCCESS;
}

static C_Status memory_stats(const C_Device device, size_t *total, size_t *free_bytes) {
  if (!cc_valid_device(device) || !total || !free_bytes) return C_ERROR;
  size_t cap = capacity();
  pthread_mutex_lock(&g_mem_mu);
  *total = cap;
  *free_bytes = cap - g_used[device->id];
  pthread_mutex_unlock(&g_mem_mu);
  return C_SUCCESS;
}

#define SIZE_API(name, expr)                                   \
  static C_Status name(const C_Device device, size_t *size) { \
    if (!cc_valid_device(device) || !size) return C_ERROR;    \
    *size = (expr);                                            \
    return C_SUCCESS;                                          \
  }

SIZE_API(min_chunk_size, 512)
SIZE_API(max_chunk_size, 32 * MiB)
SIZE_API(max_alloc_size, capacity())
SIZE_API(extra_padding_size, 0)
SIZE_API(init_alloc_size, 4 * MiB)
SIZE_API(realloc_size, 4 * MiB)

static C_Status get_compute_capability(size_t *value) {
  if (!value) return C_ERROR;
  *value = 10;
  return C_SUCCESS;
}

static C_Status get_version(size_t *value) {
  if (!value) return C_ERROR;
  *value = 100; /* 1.0.0 */
  return C_SUCCESS;
}

/* ---- entry point ----------------------------------------------------------------------- */

LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params) {
  LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = (char *)CC_DEVICE_TYPE;
  params->sub_device_type = (char *)CC_SUB_DEVICE_TYPE;

  C_DeviceInterface *api = params->interface;
  api->initialize = initialize;
  api->finalize = finalize;
  api->init_device = init_device;
  api->set_device = set_device;
  api->get_device = get_device;
  api->deinit_device = deinit_device;
  api->create_stream = cc_create_stream;
  api->destroy_stream = cc_destroy_stream;
  api->query_stream = cc_query_stream;
  api->stream_add_callback = cc_stream_add_callback;
  api->create_event = cc_create_event;
  api->record_event = cc_record_event;
  api->destroy_event = cc_destroy_event;
  api->query_event = cc_query_event;
  api->synchronize_device = cc_synchronize_device;
  api->synchronize_stream = cc_synchronize_stream;
  api->synchronize_event = cc_synchronize_event;
  api->stream_wait_event = cc_stream_wait_event;

  api->device_memory_allocate = device_allocate;
  api->device_memory_deallocate = device_deallocate;
  api->device_memory_set = device_memory_set;
  api->host_memory_allocate = host_allocate;
  api->host_memory_deallocate = host_deallocate;
  api->unified_memory_allocate = device_allocate;
  api->unified_memory_deallocate = device_deallocate;
  api->memory_copy_h2d = copy_sync;
  api->memory_copy_d2h = copy_sync;
  api->memory_copy_d2d = copy_sync;
  api->memory_copy_p2p = copy_p2p;
  api->async_memory_copy_h2d = copy_async;
  api->async_memory_copy_d2h = copy_async;
  api->async_memory_copy_d2d = copy_async;
  api->async_memory_copy_p2p = copy_p2p_async;

  api->get_device_count = get_device_count;
  api->get_device_list = get_device_list;
  api->device_memory_stats = memory_stats;
  api->device_min_chunk_size = min_chunk_size;
  api->device_max_chunk_size = max_chunk_size;
  api->device_max_alloc_size = max_alloc_size;
  api->device_extra_padding_size = extra_padding_size;
  api->device_init_alloc_size = init_alloc_size;
  api->device_realloc_size = realloc_size;
  api->get_compute_capability = get_compute_capability;
  api->get_runtime_version = get_version;
  api->get_driver_version = get_version;

  cc_fill_ccl_api(api);
  api->blas_axpby = cc_blas_axpby;
}
