/*
 * Streams and events. A stream is a FIFO of tasks run by its own worker thread, so work
 * queued on one stream runs in order and overlaps with the host and with other streams.
 * An event counts its records; a record completes when its stream reaches it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "custom_cpu.h"

typedef struct cc_task {
  void (*fn)(void *);
  void *arg;
  struct cc_task *next;
} cc_task;

struct C_Stream_st {
  struct C_Device_st device; /* handed to callbacks */
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t has_work;
  pthread_cond_t idle;
  cc_task *head, *tail;
  size_t pending; /* queued plus running */
  int stopping;
  int refs; /* the host's handle plus device-wide synchronizations in flight */
  struct C_Stream_st *next_of_device;
};

struct C_Event_st {
  pthread_mutex_t mu;
  pthread_cond_t done;
  uint64_t recorded;  /* records made */
  uint64_t completed; /* highest record reached by its stream */
  int refs;           /* the host's handle plus queued records and waits */
};

/* Live streams per device, for synchronize_device. */
static pthread_mutex_t g_streams_mu = PTHREAD_MUTEX_INITIALIZER;
static C_Stream g_streams[CC_NUM_DEVICES];

/* ---- streams ------------------------------------------------------------------------- */

static void *stream_worker(void *p) {
  C_Stream s = (C_Stream)p;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stopping) pthread_cond_wait(&s->has_work, &s->mu);
    if (!s->head) break;
    cc_task *t = s->head;
    s->head = t->next;
    if (!s->head) s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    t->fn(t->arg);
    free(t->arg);
    free(t);
    pthread_mutex_lock(&s->mu);
    if (--s->pending == 0) pthread_cond_broadcast(&s->idle);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static void stream_wait_idle(C_Stream s) {
  pthread_mutex_lock(&s->mu);
  while (s->pending) pthread_cond_wait(&s->idle, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

void cc_stream_drain(C_Stream stream) {
  if (stream) stream_wait_idle(stream);
}

static void stream_retain(C_Stream s) {
  pthread_mutex_lock(&s->mu);
  s->refs++;
  pthread_mutex_unlock(&s->mu);
}

static void stream_release(C_Stream s) {
  pthread_mutex_lock(&s->mu);
  int last = --s->refs == 0;
  if (last) {
    s->stopping = 1;
    pthread_cond_signal(&s->has_work);
  }
  pthread_mutex_unlock(&s->mu);
  if (!last) return;
  pthread_join(s->thread, NULL); /* the worker drains the queue before it stops */
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->has_work);
  pthread_cond_destroy(&s->idle);
  free(s);
}

C_Status cc_stream_submit(C_Stream stream, void (*fn)(void *), void *arg) {
  if (!stream) {
    fn(arg);
    free(arg);
    return C_SUCCESS;
  }
  cc_task *t = (cc_task *)malloc(sizeof *t);
  if (!t) return C_FAILED;
  t->fn = fn;
  t->arg = arg;
  t->next = NULL;
  pthread_mutex_lock(&stream->mu);
  if (stream->tail)
    stream->tail->next = t;
  else
    stream->head = t;
  stream->tail = t;
  stream->pending++;
  pthread_cond_signal(&stream->has_work);
  pthread_mutex_unlock(&stream->mu);
  return C_SUCCESS;
}

typedef struct {
  void *dst;
  const void *src;
  size_t size;
} copy_args;

static void run_copy(void *p) {
  copy_args *a = (copy_args *)p;
  memmove(a->dst, a->src, a->size);
}

C_Status cc_stream_copy(C_Stream stream, void *dst, const void *src, size_t size) {
  if (!stream) {
    memmove(dst, src, size);
    return C_SUCCESS;
  }
  copy_args *a = (copy_args *)malloc(sizeof *a);
  if (!a) return C_FAILED;
  a->dst = dst;
  a->src = src;
  a->size = size;
  C_Status st = cc_stream_submit(stream, run_copy, a);
  if (st != C_SUCCESS) free(a);
  return st;
}

C_Status cc_create_stream(const C_Device device, C_Stream *stream) {
  if (!cc_valid_device(device) || !stream) return C_ERROR;
  C_Stream s = (C_Stream)calloc(1, sizeof *s);
  if (!s) return C_FAILED;
  s->device.id = device->id;
  s->refs = 1;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->has_work, NULL);
  pthread_cond_init(&s->idle, NULL);
  if (pthread_create(&s->thread, NULL, stream_worker, s) != 0) {
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->has_work);
    pthread_cond_destroy(&s->idle);
    free(s);
    return C_FAILED;
  }
  pthread_mutex_lock(&g_streams_mu);
  s->next_of_device = g_streams[device->id];
  g_streams[device->id] = s;
  pthread_mutex_unlock(&g_streams_mu);
  *stream = s;
  return C_SUCCESS;
}

C_Status cc_destroy_stream(const C_Device device, C_Stream stream) {
  if (!cc_valid_device(device) || !stream) return C_ERROR;
  int found = 0;
  pthread_mutex_lock(&g_streams_mu);
  for (C_Stream *p = &g_streams[stream->device.id]; *p; p = &(*p)->next_of_device) {
    if (*p == stream) {
      *p = stream->next_of_device;
      found = 1;
      break;
    }
  }
  pthread_mutex_unlock(&g_streams_mu);
  if (!found) return C_ERROR;
  stream_release(stream);
  return C_SUCCESS;
}

C_Status cc_query_stream(const C_Device device, C_Stream stream) {
  if (!cc_valid_device(device)) return C_ERROR;
  if (!stream) return C_SUCCESS;
  pthread_mutex_lock(&stream->mu);
  size_t pending = stream->pending;
  pthread_mutex_unlock(&stream->mu);
  return pending ? C_FAILED : C_SUCCESS;
}

C_Status cc_synchronize_stream(const C_Device device, C_Stream stream) {
  if (!cc_valid_device(device)) return C_ERROR;
  if (stream) stream_wait_idle(stream);
  return C_SUCCESS;
}

C_Status cc_synchronize_device(const C_Device device) {
  if (!cc_valid_device(device)) return C_ERROR;
  /* Snapshot the streams (retained), then wait without holding the list lock, so that
     callbacks running meanwhile may create or destroy streams. */
  pthread_mutex_lock(&g_streams_mu);
  size_t n = 0;
  for (C_Stream s = g_streams[device->id]; s; s = s->next_of_device) n++;
  C_Stream *snap = (C_Stream *)malloc((n ? n : 1) * sizeof *snap);
  if (!snap) {
    pthread_mutex_unlock(&g_streams_mu);
    return C_FAILED;
  }
  n = 0;
  for (C_Stream s = g_streams[device->id]; s; s = s->next_of_device) {
    stream_retain(s);
    snap[n++] = s;
  }
  pthread_mutex_unlock(&g_streams_mu);
  for (size_t i = 0; i < n; ++i) {
    stream_wait_idle(snap[i]);
    stream_release(snap[i]);
  }
  free(snap);
  return C_SUCCESS;
}

typedef struct {
  C_Stream stream;
  C_Callback callback;
  void *user_data;
} callback_args;

static void run_callback(void *p) {
  callback_args *a = (callback_args *)p;
  C_Status status = C_SUCCESS;
  a->callback(&a->stream->device, a->stream, a->user_data, &status);
}

C_Status cc_stream_add_callback(const C_Device device, C_Stream stream, C_Callback callback,
                                void *user_data) {
  if (!cc_valid_device(device) || !callback) return C_ERROR;
  if (!stream) {
    C_Status status = C_SUCCESS;
    callback(device, NULL, user_data, &status);
    return C_SUCCESS;
  }
  callback_args *a = (callback_args *)malloc(sizeof *a);
  if (!a) return C_FAILED;
  a->stream = stream;
  a->callback = callback;
  a->user_data = user_data;
  C_Status st = cc_stream_submit(stream, run_callback, a);
  if (st != C_SUCCESS) free(a);
  return st;
}

/* ---- events -------------------------------------------------------------------------- */

static void event_release(C_Event e) {
  pthread_mutex_lock(&e->mu);
  int last = --e->refs == 0;
  pthread_mutex_unlock(&e->mu);
  if (!last) return;
  pthread_mutex_destroy(&e->mu);
  pthread_cond_destroy(&e->done);
  free(e);
}

static void event_complete(C_Event e, uint64_t record) {
  pthread_mutex_lock(&e->mu);
  if (e->completed < record) e->completed = record;
  pthread_cond_broadcast(&e->done);
  pthread_mutex_unlock(&e->mu);
}

static void event_wait(C_Event e, uint64_t record) {
  pthread_mutex_lock(&e->mu);
  while (e->completed < record) pthread_cond_wait(&e->done, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

C_Status cc_create_event(const C_Device device, C_Event *event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  C_Event e = (C_Event)calloc(1, sizeof *e);
  if (!e) return C_FAILED;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->done, NULL);
  e->refs = 1;
  *event = e;
  return C_SUCCESS;
}

C_Status cc_destroy_event(const C_Device device, C_Event event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  event_release(event); /* queued records and waits keep it alive until they ran */
  return C_SUCCESS;
}

typedef struct {
  C_Event event;
  uint64_t record;
} event_args;

static void run_record(void *p) {
  event_args *a = (event_args *)p;
  event_complete(a->event, a->record);
  event_release(a->event);
}

static void run_wait(void *p) {
  event_args *a = (event_args *)p;
  event_wait(a->event, a->record);
  event_release(a->event);
}

static C_Status queue_event_task(C_Stream stream, C_Event event, uint64_t record,
                                 void (*fn)(void *)) {
  event_args *a = (event_args *)malloc(sizeof *a);
  if (!a) return C_FAILED;
  pthread_mutex_lock(&event->mu);
  event->refs++;
  pthread_mutex_unlock(&event->mu);
  a->event = event;
  a->record = record;
  C_Status st = cc_stream_submit(stream, fn, a);
  if (st != C_SUCCESS) {
    free(a);
    event_release(event);
  }
  return st;
}

C_Status cc_record_event(const C_Device device, C_Stream stream, C_Event event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  pthread_mutex_lock(&event->mu);
  uint64_t record = ++event->recorded;
  pthread_mutex_unlock(&event->mu);
  if (!stream) { /* the NULL stream is synchronous: everything before is done */
    event_complete(event, record);
    return C_SUCCESS;
  }
  return queue_event_task(stream, event, record, run_record);
}

C_Status cc_query_event(const C_Device device, C_Event event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  pthread_mutex_lock(&event->mu);
  int done = event->completed >= event->recorded;
  pthread_mutex_unlock(&event->mu);
  return done ? C_SUCCESS : C_FAILED;
}

C_Status cc_synchronize_event(const C_Device device, C_Event event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  pthread_mutex_lock(&event->mu);
  uint64_t record = event->recorded;
  pthread_mutex_unlock(&event->mu);
  event_wait(event, record);
  return C_SUCCESS;
}

C_Status cc_stream_wait_event(const C_Device device, C_Stream stream, C_Event event) {
  if (!cc_valid_device(device) || !event) return C_ERROR;
  pthread_mutex_lock(&event->mu);
  uint64_t record = event->recorded; /* waits for the latest record made so far */
  pthread_mutex_unlock(&event->mu);
  if (!stream) {
    event_wait(event, record);
    return C_SUCCESS;
  }
  return queue_event_task(stream, event, record, run_wait);
}
