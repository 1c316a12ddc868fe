/*
 * A device plugin written the way plugins for PaddlePaddle's custom runtime often are, to
 * check that llaisys loads what PaddlePaddle loads:
 *
 *   - it includes nothing but the device header, yet calls memcpy, memset, malloc and free;
 *   - InitPlugin runs the version check, then memsets the whole C_DeviceInterface (which
 *     clears its `size`) and fills the pointers afterwards;
 *   - it has events that do nothing, and no kernels (ops run through the CPU fallback).
 *
 * TRACE_EVENTS   initialize hands one runtime and one device trace event to the host through
 *                profiler_add_runtime_trace_event / profiler_add_device_trace_event, so the
 *                library only opens when the host defines them
 * DEVICE_TYPE    the device type name (default "paddle_habits")
 *
 * Device memory is host memory; two devices.
 */
#include "llaisys/device_ext.h"

#ifndef DEVICE_TYPE
#define DEVICE_TYPE "paddle_habits"
#endif
#define NUM_DEVICES 2

static int g_current;

static C_Status set_device(const C_Device device) {
  if (device->id < 0 || device->id >= NUM_DEVICES) return C_ERROR;
  g_current = device->id;
  return C_SUCCESS;
}

static C_Status get_device(const C_Device device) {
  device->id = g_current;
  return C_SUCCESS;
}

static C_Status device_count(size_t *count) {
  *count = NUM_DEVICES;
  return C_SUCCESS;
}

static C_Status device_list(size_t *devices) {
  for (size_t i = 0; i < NUM_DEVICES; ++i) devices[i] = i;
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

static C_Status fill(const C_Device device, void *ptr, unsigned char value, size_t size) {
  (void)device;
  memset(ptr, value, size);
  return C_SUCCESS;
}

static C_Status memory_stats(const C_Device device, size_t *total, size_t *free_bytes) {
  (void)device;
  *total = (size_t)1 << 30;
  *free_bytes = (size_t)1 << 30;
  return C_SUCCESS;
}

static C_Status min_chunk_size(const C_Device device, size_t *size) {
  (void)device;
  *size = 512;
  return C_SUCCESS;
}

/* Synchronous devices: an event is complete as soon as it is recorded. */
static C_Status create_event(const C_Device device, C_Event *event) {
  (void)device;
  *event = (C_Event)malloc(1);
  return *event ? C_SUCCESS : C_FAILED;
}

static C_Status destroy_event(const C_Device device, C_Event event) {
  (void)device;
  free(event);
  return C_SUCCESS;
}

static C_Status record_event(const C_Device device, C_Stream stream, C_Event event) {
  (void)device, (void)stream, (void)event;
  return C_SUCCESS;
}

static C_Status synchronize_event(const C_Device device, C_Event event) {
  (void)device, (void)event;
  return C_SUCCESS;
}

#ifdef TRACE_EVENTS
static C_Status initialize(void) {
  int runtime_event = 1, device_event = 2; /* stand-ins for the host profiler's records */
  profiler_add_runtime_trace_event(NULL, &runtime_event);
  profiler_add_device_trace_event(NULL, &device_event);
  return C_SUCCESS;
}
#endif

LLAISYS_PLUGIN_EXPORT void InitPlugin(CustomRuntimeParams *params) {
  PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = (char *)DEVICE_TYPE;
  params->sub_device_type = (char *)"v0.1";

  memset(params->interface, 0, sizeof(C_DeviceInterface));

  C_DeviceInterface *api = params->interface;
#ifdef TRACE_EVENTS
  api->initialize = initialize;
#endif
  api->set_device = set_device;
  api->get_device = get_device;
  api->get_device_count = device_count;
  api->get_device_list = device_list;
  api->create_event = create_event;
  api->destroy_event = destroy_event;
  api->record_event = record_event;
  api->synchronize_event = synchronize_event;
  api->device_memory_allocate = allocate;
  api->device_memory_deallocate = deallocate;
  api->device_memory_set = fill;
  api->memory_copy_h2d = copy;
  api->memory_copy_d2h = copy;
  api->memory_copy_d2d = copy;
  api->device_memory_stats = memory_stats;
  api->device_min_chunk_size = min_chunk_size;
}
