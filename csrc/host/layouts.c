/* The layouts of the plugin ABI's structures (include/llaisys/device_ext.h, kernel_ext.h) and
 * of glibc's struct mallinfo2 as this compiler lays them out, for the ctypes mirrors of
 * src/llaisys/backends/plugin/abi.py and src/llaisys/_native/structs.py, which
 * llaisys._native checks against them when it loads this library, before any plugin opens
 * (common/layout.h). */
#include <stdlib.h> /* defines __GLIBC__ where the C library is glibc */

#include "common/layout.h"
#include "llaisys/kernel_ext.h"

typedef struct C_Device_st C_Device_st;

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#include <malloc.h>
#define HAVE_MALLINFO2 1
typedef struct mallinfo2 glibc_mallinfo2; /* the grammar sandbox's heap counts */
#endif

static const layout_entry LAYOUTS[] = {
    LAYOUT(C_Device_st, id),
    LAYOUT(C_CCLRootId, sz, data),
    LAYOUT(C_DeviceInterface, size, initialize, finalize, init_device, set_device, get_device, deinit_device,
                              create_stream, destroy_stream, query_stream, stream_add_callback, create_event,
                              record_event, destroy_event, query_event, synchronize_device, synchronize_stream,
                              synchronize_event, stream_wait_event, reserved_dev_api, device_memory_allocate,
                              device_memory_deallocate, device_memory_set, host_memory_allocate, host_memory_deallocate,
                              unified_memory_allocate, unified_memory_deallocate, memory_copy_h2d, memory_copy_d2h,
                              memory_copy_d2d, memory_copy_p2p, async_memory_copy_h2d, async_memory_copy_d2h,
                              async_memory_copy_d2d, async_memory_copy_p2p, reserved_mem_api, get_device_count,
                              get_device_list, device_memory_stats, device_min_chunk_size, device_max_chunk_size,
                              device_max_alloc_size, device_extra_padding_size, device_init_alloc_size,
                              device_realloc_size, get_compute_capability, get_runtime_version, get_driver_version,
                              reserved_info_api, xccl_get_unique_id_size, xccl_get_unique_id, xccl_comm_init_rank,
                              xccl_destroy_comm, xccl_all_reduce, xccl_broadcast, xccl_reduce, xccl_all_gather,
                              xccl_reduce_scatter, xccl_group_start, xccl_group_end, xccl_send, xccl_recv,
                              xccl_all_to_all, reserved_ccl_api, profiler_initialize, profiler_finalize,
                              profiler_prepare_tracing, profiler_start_tracing, profiler_stop_tracing,
                              profiler_collect_trace_data, reserved_profiler_api, blas_axpby, reserved_other_api),
    LAYOUT(CustomRuntimeVersion, major, minor, patch),
    LAYOUT(CustomRuntimeParams, size, interface, version, device_type, sub_device_type, reserved),
    LAYOUT(LlaisysTensorDesc, data, dtype, ndim, shape, strides),
    LAYOUT(LlaisysKernelAttr, name, value),
    LAYOUT(LlaisysKernelRegistrar, size, abi_version, context, register_kernel),
#ifdef HAVE_MALLINFO2
    LAYOUT(glibc_mallinfo2, arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks, uordblks, fordblks, keepcost),
#endif
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LLAISYS_HOST_API int64_t llaisys_host_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
