/*
 * Devices that are valid under the plugin contract but narrow, for the conformance check and
 * the CPU fallback. One source built with different macros.
 *
 * Without macros: devices, device memory, synchronous copies, memory stats and min chunk size,
 * no other API and no kernels, so every op runs through the CPU fallback; 4 GiB of
 * (malloc'd) device memory. The macros narrow it:
 *
 *   DEVICE_TYPE="name"   the device type (default "contract_dev")
 *   CAPACITY_KB=n        device memory in KiB; allocations past it return C_FAILED
 *   MIN_CHUNK=n          device_min_chunk_size (default 256)
 *   STRICT_CHUNK         refuses (C_ERROR) an allocation whose size is not a multiple of MIN_CHUNK
 *   EXTRA_PADDING=n      reports device_extra_padding_size n
 *   MAX_ALLOC_KB=n       reports device_max_alloc_size n KiB and refuses (C_FAILED) larger allocations
 *   HANG_SYNC            synchronize_device never returns
 *   NO_STATS             leaves device_memory_stats NULL (total and free memory unknown)
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llaisys/device_ext.h"

#ifndef DEVICE_TYPE
#define DEVICE_TYPE "contract_dev"
#endif
#ifndef CAPACITY_KB
#define CAPACITY_KB (4u << 20)
#endif
#ifndef MIN_CHUNK
#define MIN_CHUNK 256
#endif
#define HEADER 64 /* bytes before each pointer: the allocation's size */

static size_t g_used;
static __thread int g_current;

static int valid(const C_Device d) { return d && d->id == 0; }

static size_t capacity(void) { return (size_t)CAPACITY_KB << 10; }

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
  *n = 1;
  return C_SUCCESS;
}

static C_Status device_list(size_t *ids) {
  ids[0] = 0;
  return C_SUCCESS;
}

static C_Status allocate(const C_Device d, void **ptr, size_t size) {
  if (!valid(d) || size == 0) return C_ERROR;
#ifdef STRICT_CHUNK
  if (size % MIN_CHUNK) return C_ERROR;
#endif
#ifdef MAX_ALLOC_KB
  if (size > ((size_t)MAX_ALLOC_KB << 10)) return C_FAILED;
#endif
  if (size > capacity() - g_used) return C_FAILED;
  char *raw = (char *)malloc(size + HEADER);
  if (!raw) return C_FAILED;
  *(size_t *)raw = size;
  g_used += size;
  *ptr = raw + HEADER;
  return C_SUCCESS;
}

static C_Status deallocate(const C_Device d, void *ptr, size_t size) {
  if (!valid(d) || !ptr) return C_ERROR;
  char *raw = (char *)ptr - HEADER;
  if (*(size_t *)raw != size) return C_ERROR;
  g_used -= size;
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
  *free_bytes = capacity() - g_used;
  return C_SUCCESS;
}

static C_Status min_chunk(const C_Device d, size_t *size) {
  (void)d;
  *size = MIN_CHUNK;
  return C_SUCCESS;
}

#ifdef EXTRA_PADDING
static C_Status padding(const C_Device d, size_t *size) {
  (void)d;
  *size = EXTRA_PADDING;
  return C_SUCCESS;
}
#endif

#ifdef MAX_ALLOC_KB
static C_Status max_alloc(const C_Device d, size_t *size) {
  (void)d;
  *size = (size_t)MAX_ALLOC_KB << 10;
  return C_SUCCESS;
}
#endif

#ifdef HANG_SYNC
static C_Status hanging_sync(const C_Device d) {
  (void)d;
  for (;;) sleep(1);
  return C_SUCCESS;
}
#endif

LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params) {
  LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = (char *)DEVICE_TYPE;
  params->sub_device_type = (char *)"contract";

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
#ifndef NO_STATS
  api->device_memory_stats = stats;
#endif
  api->device_min_chunk_size = min_chunk;
#ifdef EXTRA_PADDING
  api->device_extra_padding_size = padding;
#endif
#ifdef MAX_ALLOC_KB
  api->device_max_alloc_size = max_alloc;
#endif
#ifdef HANG_SYNC
  api->synchronize_device = hanging_sync;
#endif
}
