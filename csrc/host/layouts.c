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

#define IFACE(f) LAYOUT_FIELD(C_DeviceInterface, f)

static const layout_entry LAYOUTS[] = {
    LAYOUT_TYPE(C_Device_st), LAYOUT_FIELD(C_Device_st, id),
    LAYOUT_TYPE(C_CCLRootId), LAYOUT_FIELD(C_CCLRootId, sz), LAYOUT_FIELD(C_CCLRootId, data),

    LAYOUT_TYPE(C_DeviceInterface),
    IFACE(size), IFACE(initialize), IFACE(finalize), IFACE(init_device), IFACE(set_device), IFACE(get_device),
    IFACE(deinit_device), IFACE(create_stream), IFACE(destroy_stream), IFACE(query_stream),
    IFACE(stream_add_callback), IFACE(create_event), IFACE(record_event), IFACE(destroy_event), IFACE(query_event),
    IFACE(synchronize_device), IFACE(synchronize_stream), IFACE(synchronize_event), IFACE(stream_wait_event),
    IFACE(reserved_dev_api), IFACE(device_memory_allocate), IFACE(device_memory_deallocate),
    IFACE(device_memory_set), IFACE(host_memory_allocate), IFACE(host_memory_deallocate),
    IFACE(unified_memory_allocate), IFACE(unified_memory_deallocate), IFACE(memory_copy_h2d),
    IFACE(memory_copy_d2h), IFACE(memory_copy_d2d), IFACE(memory_copy_p2p), IFACE(async_memory_copy_h2d),
    IFACE(async_memory_copy_d2h), IFACE(async_memory_copy_d2d), IFACE(async_memory_copy_p2p),
    IFACE(reserved_mem_api), IFACE(get_device_count), IFACE(get_device_list), IFACE(device_memory_stats),
    IFACE(device_min_chunk_size), IFACE(device_max_chunk_size), IFACE(device_max_alloc_size),
    IFACE(device_extra_padding_size), IFACE(device_init_alloc_size), IFACE(device_realloc_size),
    IFACE(get_compute_capability), IFACE(get_runtime_version), IFACE(get_driver_version), IFACE(reserved_info_api),
    IFACE(xccl_get_unique_id_size), IFACE(xccl_get_unique_id), IFACE(xccl_comm_init_rank),
    IFACE(xccl_destroy_comm), IFACE(xccl_all_reduce), IFACE(xccl_broadcast), IFACE(xccl_reduce),
    IFACE(xccl_all_gather), IFACE(xccl_reduce_scatter), IFACE(xccl_group_start), IFACE(xccl_group_end),
    IFACE(xccl_send), IFACE(xccl_recv), IFACE(xccl_all_to_all), IFACE(reserved_ccl_api),
    IFACE(profiler_initialize), IFACE(profiler_finalize), IFACE(profiler_prepare_tracing),
    IFACE(profiler_start_tracing), IFACE(profiler_stop_tracing), IFACE(profiler_collect_trace_data),
    IFACE(reserved_profiler_api), IFACE(blas_axpby), IFACE(reserved_other_api),

    LAYOUT_TYPE(CustomRuntimeVersion),
    LAYOUT_FIELD(CustomRuntimeVersion, major), LAYOUT_FIELD(CustomRuntimeVersion, minor),
    LAYOUT_FIELD(CustomRuntimeVersion, patch),

    LAYOUT_TYPE(CustomRuntimeParams),
    LAYOUT_FIELD(CustomRuntimeParams, size), LAYOUT_FIELD(CustomRuntimeParams, interface),
    LAYOUT_FIELD(CustomRuntimeParams, version), LAYOUT_FIELD(CustomRuntimeParams, device_type),
    LAYOUT_FIELD(CustomRuntimeParams, sub_device_type), LAYOUT_FIELD(CustomRuntimeParams, reserved),

    LAYOUT_TYPE(LlaisysTensorDesc),
    LAYOUT_FIELD(LlaisysTensorDesc, data), LAYOUT_FIELD(LlaisysTensorDesc, dtype),
    LAYOUT_FIELD(LlaisysTensorDesc, ndim), LAYOUT_FIELD(LlaisysTensorDesc, shape),
    LAYOUT_FIELD(LlaisysTensorDesc, strides),

    LAYOUT_TYPE(LlaisysKernelAttr), LAYOUT_FIELD(LlaisysKernelAttr, name), LAYOUT_FIELD(LlaisysKernelAttr, value),

    LAYOUT_TYPE(LlaisysKernelRegistrar),
    LAYOUT_FIELD(LlaisysKernelRegistrar, size), LAYOUT_FIELD(LlaisysKernelRegistrar, abi_version),
    LAYOUT_FIELD(LlaisysKernelRegistrar, context), LAYOUT_FIELD(LlaisysKernelRegistrar, register_kernel),

#ifdef HAVE_MALLINFO2
    LAYOUT_TYPE(glibc_mallinfo2),
    LAYOUT_FIELD(glibc_mallinfo2, arena), LAYOUT_FIELD(glibc_mallinfo2, ordblks), LAYOUT_FIELD(glibc_mallinfo2, smblks),
    LAYOUT_FIELD(glibc_mallinfo2, hblks), LAYOUT_FIELD(glibc_mallinfo2, hblkhd), LAYOUT_FIELD(glibc_mallinfo2, usmblks),
    LAYOUT_FIELD(glibc_mallinfo2, fsmblks), LAYOUT_FIELD(glibc_mallinfo2, uordblks),
    LAYOUT_FIELD(glibc_mallinfo2, fordblks), LAYOUT_FIELD(glibc_mallinfo2, keepcost),
#endif
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LLAISYS_HOST_API int64_t llaisys_host_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
