// The C++ counterpart of paddle_habits.c, in the style of plugins written for PaddlePaddle's
// custom runtime: C++ with external functions, InitPlugin defined without extern "C" (the
// header's declaration gives it C linkage and makes it exported), the check macro without a
// semicolon of its own, the whole table memset after it, and memcpy, memset, malloc and free
// from nothing but the device header. One device whose memory is host memory; no kernels.
#include "llaisys/device_ext.h"

#ifndef DEVICE_TYPE
#define DEVICE_TYPE "paddle_habits_cxx"
#endif

C_Status Init() { return C_SUCCESS; }

C_Status Finalize() { return C_SUCCESS; }

C_Status SetDevice(const C_Device device) { return device->id == 0 ? C_SUCCESS : C_ERROR; }

C_Status GetDevice(const C_Device device) {
  device->id = 0;
  return C_SUCCESS;
}

C_Status GetDevicesCount(size_t *count) {
  *count = 1;
  return C_SUCCESS;
}

C_Status GetDevicesList(size_t *devices) {
  devices[0] = 0;
  return C_SUCCESS;
}

C_Status Allocate(const C_Device, void **ptr, size_t size) {
  *ptr = malloc(size);
  return *ptr != nullptr ? C_SUCCESS : C_FAILED;
}

C_Status Deallocate(const C_Device, void *ptr, size_t) {
  free(ptr);
  return C_SUCCESS;
}

C_Status MemCpy(const C_Device, void *dst, const void *src, size_t size) {
  memcpy(dst, src, size);
  return C_SUCCESS;
}

C_Status MemSet(const C_Device, void *ptr, unsigned char value, size_t size) {
  memset(ptr, value, size);
  return C_SUCCESS;
}

C_Status CreateEvent(const C_Device, C_Event *event) {
  *event = reinterpret_cast<C_Event>(malloc(1));
  return *event != nullptr ? C_SUCCESS : C_FAILED;
}

C_Status DestroyEvent(const C_Device, C_Event event) {
  free(event);
  return C_SUCCESS;
}

C_Status RecordEvent(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }

C_Status SyncEvent(const C_Device, C_Event) { return C_SUCCESS; }

C_Status SyncDevice(const C_Device) { return C_SUCCESS; }

C_Status DeviceMemStats(const C_Device, size_t *total_memory, size_t *free_memory) {
  *total_memory = size_t(1) << 30;
  *free_memory = size_t(1) << 30;
  return C_SUCCESS;
}

C_Status DeviceMinChunkSize(const C_Device, size_t *size) {
  *size = 512;
  return C_SUCCESS;
}

void InitPlugin(CustomRuntimeParams *params) {
  PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params)  // the macro brings its own semicolon
  params->device_type = const_cast<char *>(DEVICE_TYPE);
  params->sub_device_type = const_cast<char *>("v0.1");

  memset(reinterpret_cast<void *>(params->interface), 0, sizeof(C_DeviceInterface));

  params->interface->initialize = Init;
  params->interface->finalize = Finalize;
  params->interface->set_device = SetDevice;
  params->interface->get_device = GetDevice;
  params->interface->get_device_count = GetDevicesCount;
  params->interface->get_device_list = GetDevicesList;
  params->interface->create_event = CreateEvent;
  params->interface->destroy_event = DestroyEvent;
  params->interface->record_event = RecordEvent;
  params->interface->synchronize_event = SyncEvent;
  params->interface->synchronize_device = SyncDevice;
  params->interface->device_memory_allocate = Allocate;
  params->interface->device_memory_deallocate = Deallocate;
  params->interface->device_memory_set = MemSet;
  params->interface->memory_copy_h2d = MemCpy;
  params->interface->memory_copy_d2h = MemCpy;
  params->interface->memory_copy_d2d = MemCpy;
  params->interface->device_memory_stats = DeviceMemStats;
  params->interface->device_min_chunk_size = DeviceMinChunkSize;
}
