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
#define F(f) LAYOUT_FIELD(T, f) /* a field of the structure T the lines below name */
#define T C_Device_st
    LAYOUT_TYPE(T), F(id),
#undef T
#define T C_CCLRootId
    LAYOUT_TYPE(T), F(sz), F(data),
#undef T
#define T C_DeviceInterface
    LAYOUT_TYPE(T), F(size), F(initialize), F(finalize), F(init_device), F(set_device), F(get_device), F(deinit_device),
    F(create_stream), F(destroy_stream), F(query_stream), F(stream_add_callback), F(create_event), F(record_event),
    F(destroy_event), F(query_event), F(synchronize_device), F(synchronize_stream), F(synchronize_event),
    F(stream_wait_event), F(reserved_dev_api), F(device_memory_allocate), F(device_memory_deallocate),
    F(device_memory_set), F(host_memory_allocate), F(host_memory_deallocate), F(unified_memory_allocate),
    F(unified_memory_deallocate), F(memory_copy_h2d), F(memory_copy_d2h), F(memory_copy_d2d), F(memory_copy_p2p),
    F(async_memory_copy_h2d), F(async_memory_copy_d2h), F(async_memory_copy_d2d), F(async_memory_copy_p2p),
    F(reserved_mem_api), F(get_device_count), F(get_device_list), F(device_memory_stats), F(device_min_chunk_size),
    F(device_max_chunk_size), F(device_max_alloc_size), F(device_extra_padding_size), F(device_init_alloc_size),
    F(device_realloc_size), F(get_compute_capability), F(get_runtime_version), F(get_driver_version),
    F(reserved_info_api), F(xccl_get_unique_id_size), F(xccl_get_unique_id), F(xccl_comm_init_rank),
    F(xccl_destroy_comm), F(xccl_all_reduce), F(xccl_broadcast), F(xccl_reduce), F(xccl_all_gather),
    F(xccl_reduce_scatter), F(xccl_group_start), F(xccl_group_end), F(xccl_send), F(xccl_recv), F(xccl_all_to_all),
    F(reserved_ccl_api), F(profiler_initialize), F(profiler_finalize), F(profiler_prepare_tracing),
    F(profiler_start_tracing), F(profiler_stop_tracing), F(profiler_collect_trace_data), F(reserved_profiler_api),
    F(blas_axpby), F(reserved_other_api),
#undef T
#define T CustomRuntimeVersion
    LAYOUT_TYPE(T), F(major), F(minor), F(patch),
#undef T
#define T CustomRuntimeParams
    LAYOUT_TYPE(T), F(size), F(interface), F(version), F(device_type), F(sub_device_type), F(reserved),
#undef T
#define T LlaisysTensorDesc
    LAYOUT_TYPE(T), F(data), F(dtype), F(ndim), F(shape), F(strides),
#undef T
#define T LlaisysKernelAttr
    LAYOUT_TYPE(T), F(name), F(value),
#undef T
#define T LlaisysKernelRegistrar
    LAYOUT_TYPE(T), F(size), F(abi_version), F(context), F(register_kernel),
#undef T
#ifdef HAVE_MALLINFO2
#define T glibc_mallinfo2
    LAYOUT_TYPE(T), F(arena), F(ordblks), F(smblks), F(hblks), F(hblkhd), F(usmblks), F(fsmblks), F(uordblks),
    F(fordblks), F(keepcost),
#undef T
#endif
#undef F
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LLAISYS_HOST_API int64_t llaisys_host_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
