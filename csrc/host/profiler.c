/*
 * profiler.c: the host functions device plugins may call to hand trace events to the host
 * (declared in include/llaisys/device_ext.h, as PaddlePaddle's header declares them).
 *
 * A plugin that calls them has undefined references to these symbols, so its library only
 * opens when a loaded library with global symbols defines them: llaisys loads this one
 * (llaisys._native._host, RTLD_GLOBAL) before opening any plugin.
 *
 * The event records are the host profiler's own structures, which llaisys does not have, so
 * the events are counted and otherwise dropped; llaisys_trace_event_counts reads the counts.
 */
#include <stdatomic.h>
#include <stdint.h>

#include "llaisys/device_ext.h"

static atomic_uint_least64_t g_runtime_events;
static atomic_uint_least64_t g_device_events;

void profiler_add_runtime_trace_event(C_Profiler prof, void *event) {
  (void)prof, (void)event;
  atomic_fetch_add_explicit(&g_runtime_events, 1, memory_order_relaxed);
}

void profiler_add_device_trace_event(C_Profiler prof, void *event) {
  (void)prof, (void)event;
  atomic_fetch_add_explicit(&g_device_events, 1, memory_order_relaxed);
}

/* The number of runtime and device trace events plugins have handed over so far. */
LLAISYS_HOST_API void llaisys_trace_event_counts(uint64_t *runtime_events, uint64_t *device_events) {
  *runtime_events = atomic_load_explicit(&g_runtime_events, memory_order_relaxed);
  *device_events = atomic_load_explicit(&g_device_events, memory_order_relaxed);
}
