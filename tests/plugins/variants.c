/*
 * Small device plugins for the loader tests, one source built with different macros.
 *
 * Without macros: a minimal plugin with only the required APIs (devices, device memory,
 * synchronous copies, memory stats, min chunk size) and no kernels, so every op runs through
 * the CPU fallback. Each macro below breaks it in one way, on purpose:
 *
 *   NO_INIT_PLUGIN     exports its entry point under another name than InitPlugin
 *   WRONG_SIZE_CHECK   built against other struct sizes: refuses the host's and fills nothing
 *   MISSING_APIS       leaves memory_copy_d2h and device_memory_stats NULL
 *   VERSION_MAJOR=n    reports runtime version n.1.1
 *   VERSION_PATCH=n    reports runtime version 0.1.n
 *   NULL_DEVICE_TYPE   leaves device_type NULL
 *   INIT_FAILS         initialize returns C_ERROR
 *   BAD_STATUS         memory_copy_d2h returns C_ERROR, device_memory_set C_FAILED,
 *                      device_memory_stats C_WARNING (with valid numbers)
 *   CAPACITY_KB=n      device memory holds n KiB; allocations past it return C_FAILED
 *   FOREIGN_KERNEL     InitPluginKernels registers a kernel for another backend
 *   FAILING_KERNEL     registers an add kernel that returns C_INTERNAL_ERROR
 *   CRASH_IN_D2D       memory_copy_d2d aborts the process
 *
 * DEVICE_TYPE sets the device type name (default "mini_dev").
 */
#include <stdlib.h>
#include <string.h>

#include "llaisys/device_ext.h"
#include "llaisys/kernel_ext.h"

#ifdef NO_INIT_PLUGIN
#define InitPlugin InitDevicePlugin /* a misspelt entry point: the host must not find it */
#endif

#ifndef DEVICE_TYPE
#define DEVICE_TYPE "mini_dev"
#endif
#define NUM_DEVICES 2

static size_t g_used[NUM_DEVICES];
static __thread int g_current;

static int valid(const C_Device d) { return d && d->id >= 0 && d->id < NUM_DEVICES; }

static size_t capacity(void) {
#ifdef CAPACITY_KB
  return (size_t)CAPACITY_KB << 10;
#else
  return (size_t)256 << 20;
#endif
}

static C_Status set_device(const C_Device d) {
  if (!valid(d)) return C_ERROR;
  g_current = d->id;
  return C_SUCCESS;
}

static C_Status get_device(const C_Device d) {
  if (!d) return C_ERROR;
  d->id = g_current;
  return C_SUCCESS;
}

static C_Status device_count(size_t *n) {
  *n = NUM_DEVICES;
  return C_SUCCESS;
}

static C_Status device_list(size_t *ids) {
  for (size_t i = 0; i < NUM_DEVICES; ++i) ids[i] = i;
  return C_SUCCESS;
}

static C_Status allocate(const C_Device d, void **ptr, size_t size) {
  if (!valid(d)) return C_ERROR;
  if (size > capacity() - g_used[d->id]) return C_FAILED;
  size_t *raw = (size_t *)malloc(size + 64);
  if (!raw) return C_FAILED;
  raw[0] = size;
  g_used[d->id] += size;
  *ptr = (char *)raw + 64;
  return C_SUCCESS;
}

static C_Status deallocate(const C_Device d, void *ptr, size_t size) {
  if (!valid(d) || !ptr) return C_ERROR;
  size_t *raw = (size_t *)((char *)ptr - 64);
  if (raw[0] != size) return C_ERROR;
  g_used[d->id] -= size;
  free(raw);
  return C_SUCCESS;
}

static C_Status copy(const C_Device d, void *dst, const void *src, size_t size) {
  if (!valid(d)) return C_ERROR;
  memmove(dst, src, size);
  return C_SUCCESS;
}

static C_Status stats(const C_Device d, size_t *total, size_t *free_bytes) {
  if (!valid(d)) return C_ERROR;
  *total = capacity();
  *free_bytes = capacity() - g_used[d->id];
#ifdef BAD_STATUS
  return C_WARNING;
#else
  return C_SUCCESS;
#endif
}

static C_Status min_chunk(const C_Device d, size_t *size) {
  (void)d;
  *size = 256;
  return C_SUCCESS;
}

#ifdef CAPACITY_KB
static C_Status small_chunk(const C_Device d, size_t *size) {
  (void)d;
  *size = 64 << 10;
  return C_SUCCESS;
}
#endif

#ifdef BAD_STATUS
static C_Status failing_d2h(const C_Device d, void *dst, const void *src, size_t size) {
  (void)d, (void)dst, (void)src, (void)size;
  return C_ERROR;
}

static C_Status failing_memset(const C_Device d, void *ptr, unsigned char value, size_t size) {
  (void)d, (void)ptr, (void)value, (void)size;
  return C_FAILED;
}
#endif

#ifdef CRASH_IN_D2D
static C_Status crashing_d2d(const C_Device d, void *dst, const void *src, size_t size) {
  (void)d, (void)dst, (void)src, (void)size;
  abort();
}
#endif

#ifdef INIT_FAILS
static C_Status failing_initialize(void) { return C_ERROR; }
#endif

LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params) {
#ifdef WRONG_SIZE_CHECK
  /* What a plugin compiled against a header with other struct sizes does. */
  if (params->size != sizeof(CustomRuntimeParams) - 8 ||
      params->interface->size != sizeof(C_DeviceInterface) + 8)
    return;
#else
  LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params);
#endif
#ifdef VERSION_MAJOR
  params->version.major = VERSION_MAJOR;
#endif
#ifdef VERSION_PATCH
  params->version.patch = VERSION_PATCH;
#endif
#ifdef NULL_DEVICE_TYPE
  params->device_type = NULL;
#else
  params->device_type = (char *)DEVICE_TYPE;
#endif
  params->sub_device_type = (char *)"test";

  C_DeviceInterface *api = params->interface;
  api->set_device = set_device;
  api->get_device = get_device;
  api->get_device_count = device_count;
  api->get_device_list = device_list;
  api->device_memory_allocate = allocate;
  api->device_memory_deallocate = deallocate;
  api->memory_copy_h2d = copy;
  api->memory_copy_d2h = copy;
  api->memory_copy_d2d = copy;
  api->device_memory_stats = stats;
  api->device_min_chunk_size = min_chunk;
#ifdef MISSING_APIS
  api->memory_copy_d2h = NULL;
  api->device_memory_stats = NULL;
#endif
#ifdef PADDLE_MINIMUM /* what PaddlePaddle loads without: llaisys falls back */
  api->memory_copy_d2d = NULL;
  api->device_memory_stats = NULL;
  api->device_min_chunk_size = NULL;
#endif
#ifdef BAD_STATUS
  api->memory_copy_d2h = failing_d2h;
  api->device_memory_set = failing_memset;
#endif
#ifdef CAPACITY_KB
  api->device_max_chunk_size = small_chunk;
  api->device_init_alloc_size = small_chunk;
  api->device_realloc_size = small_chunk;
#endif
#ifdef INIT_FAILS
  api->initialize = failing_initialize;
#endif
#ifdef CRASH_IN_D2D
  api->memory_copy_d2d = crashing_d2d;
#endif
}

#if defined(FOREIGN_KERNEL) || defined(FAILING_KERNEL)
static C_Status failing_add(const C_Device device, C_Stream stream,
                            const LlaisysTensorDesc *const *outputs, size_t num_outputs,
                            const LlaisysTensorDesc *const *inputs, size_t num_inputs,
                            const LlaisysKernelAttr *attrs, size_t num_attrs) {
  (void)device, (void)stream, (void)outputs, (void)num_outputs, (void)inputs, (void)num_inputs;
  (void)attrs, (void)num_attrs;
  return C_INTERNAL_ERROR;
}

LLAISYS_PLUGIN_EXPORT C_Status InitPluginKernels(LlaisysKernelRegistrar *registrar) {
#ifdef FOREIGN_KERNEL
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, add, some_other_device, ALL_LAYOUT, failing_add, FLOAT32);
#else
  return registrar->register_kernel(registrar->context, "add", DEVICE_TYPE, ALL_LAYOUT, FLOAT32,
                                    failing_add);
#endif
  return C_SUCCESS;
}
#endif
