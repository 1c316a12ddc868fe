/*
 * A device plugin that never returns from one API, to check that llaisys does not hang on it
 * when it unloads the plugin or the process exits.
 *
 * Without macros: the required APIs (one device, host memory) work, and synchronize_device
 * blocks forever. finalize writes "hanging plugin: finalize" to stderr, so a test can tell
 * whether the host called it.
 *
 *   SYNC_RETURNS     synchronize_device returns at once instead
 *   FINALIZE_HANGS   finalize blocks forever (after writing its line)
 *   DEVICE_TYPE      the device type name (default "hang_dev")
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llaisys/device_ext.h"

#ifndef DEVICE_TYPE
#define DEVICE_TYPE "hang_dev"
#endif

static void block_forever(void) {
  for (;;) sleep(3600);
}

static C_Status set_device(const C_Device device) { return device->id == 0 ? C_SUCCESS : C_ERROR; }

static C_Status get_device(const C_Device device) {
  device->id = 0;
  return C_SUCCESS;
}

static C_Status device_count(size_t *count) {
  *count = 1;
  return C_SUCCESS;
}

static C_Status device_list(size_t *devices) {
  devices[0] = 0;
  return C_SUCCESS;
}

static C_Status allocate(const C_Device device, void **ptr, size_t size) {
  (void)device;
  *ptr = malloc(size);
  return *ptr ? C_SUCCESS : C_FAILED;
}

static C_Status deallocate(const C_Device device, void *ptr, size_t size) {
  (void)device, (void)size;
  free(ptr);
  return C_SUCCESS;
}

static C_Status copy(const C_Device device, void *dst, const void *src, size_t size) {
  (void)device;
  memcpy(dst, src, size);
  return C_SUCCESS;
}

static C_Status memory_stats(const C_Device device, size_t *total, size_t *free_bytes) {
  (void)device;
  *total = *free_bytes = (size_t)1 << 30;
  return C_SUCCESS;
}

static C_Status min_chunk_size(const C_Device device, size_t *size) {
  (void)device;
  *size = 256;
  return C_SUCCESS;
}

static C_Status synchronize_device(const C_Device device) {
  (void)device;
#ifndef SYNC_RETURNS
  block_forever();
#endif
  return C_SUCCESS;
}

static C_Status finalize(void) {
  fputs("hanging plugin: finalize\n", stderr);
  fflush(stderr);
#ifdef FINALIZE_HANGS
  block_forever();
#endif
  return C_SUCCESS;
}

LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params) {
  LLAISYS_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = (char *)DEVICE_TYPE;
  params->sub_device_type = (char *)"test";

  C_DeviceInterface *api = params->interface;
  api->finalize = finalize;
  api->set_device = set_device;
  api->get_device = get_device;
  api->get_device_count = device_count;
  api->get_device_list = device_list;
  api->synchronize_device = synchronize_device;
  api->device_memory_allocate = allocate;
  api->device_memory_deallocate = deallocate;
  api->memory_copy_h2d = copy;
  api->memory_copy_d2h = copy;
  api->memory_copy_d2d = copy;
  api->device_memory_stats = memory_stats;
  api->device_min_chunk_size = min_chunk_size;
}
