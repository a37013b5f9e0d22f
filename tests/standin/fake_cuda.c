/* A host-memory stand-in for the few CUDA driver entry points stoker's shim uses.
 *
 * It exists to test ORDERING and LOGIC on machines without a GPU; passing tests
 * against it say nothing about real GPUs and are never reported as GPU verification.
 *
 * Model:
 *  - "device memory" is host memory: a CUdeviceptr is a host address.
 *  - every stream (the NULL stream 0 included; the legacy/per-thread handles 1 and 2
 *    alias it) is a FIFO of operations run in order by the stream's own worker thread.
 *  - a copy sleeps the configured delay (env FAKE_CUDA_COPY_DELAY_US at load time,
 *    fake_cuda_set_copy_delay_us() later) and then copies, so copies finish late. A 2-D
 *    copy (cuMemcpy2DAsync_v2) copies its rows one pitch apart; with env
 *    FAKE_CUDA_REFUSE_2D=1 it is refused with INVALID_VALUE, as a driver may refuse pitches.
 *  - events carry generations: each cuEventRecord bumps the event's `recorded`
 *    counter and enqueues a marker that, when run, completes that generation.
 *    Query/synchronize look at the latest record; an event never recorded is complete.
 *  - cuStreamWaitEvent enqueues an op that blocks the stream until the generation
 *    current at the time of the call has completed.
 *  - integrity checks (see struct fake_cuda_stats): the source of every copy is hashed
 *    when the copy is enqueued and again right before the memcpy; for a host-to-device
 *    copy a difference means the host buffer was refilled before its copy ran, for a
 *    device-to-device or 2-D one that something wrote its source in between.
 *
 * The ABI is the real driver's: CUresult is int, CUdeviceptr unsigned long long,
 * handles are opaque pointers. Calls made before cuInit return 3 (NOT_INITIALIZED);
 * calls in a process forked after cuInit return 3 without touching any lock, as the
 * real driver refuses a forked child. Calls that need a current context (creating
 * streams and events, copies, host registration, cuCtxSynchronize) return 201
 * (INVALID_CONTEXT) on a thread without one, and count it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

enum {
    OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, NO_DEVICE = 100, INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600,
    HOST_MEMORY_ALREADY_REGISTERED = 712, HOST_MEMORY_NOT_REGISTERED = 713, NOT_SUPPORTED = 801,
};

/* Counters, all uint64_t, in this order (tests read them with ctypes):
 *  0 copies               copies executed (host-to-device and device-to-device)
 *  1 bytes_copied         bytes those copies moved
 *  2 overwritten_sources  host-to-device sources whose bytes changed between enqueue and copy
 *  3 pageable_copies      host-to-device copies whose source was not inside a registered range
 *  4 registered_bytes     bytes registered with cuMemHostRegister now (not reset)
 *  5 max_registered_bytes the most ever registered at once (reset to registered_bytes)
 *  6 stream_waits         cuStreamWaitEvent calls
 *  7 event_syncs          cuEventSynchronize calls
 *  8 stream_syncs         cuStreamSynchronize + cuCtxSynchronize calls
 *  9 unregister_errors    cuMemHostUnregister of a pointer that was not registered
 * 10 register_overlaps    cuMemHostRegister of a range overlapping a registered one
 * 11 registrations        successful cuMemHostRegister calls
 * 12 no_context_calls     calls refused because the calling thread had no current context
 * 13 unpinned_at_copy     host-to-device copies whose source was unregistered before they ran
 * 14 copies_2d            2-D copies executed (cuMemcpy2DAsync_v2; also counted in copies)
 * 15 changed_device_sources  device-to-device and 2-D copies whose source bytes changed
 *                         between enqueue and copy: legitimate where stream-ordered work
 *                         writes the source in between, a bug where only the host writes
 *                         it before the copy is queued (the gather's scratch) */
struct fake_cuda_stats {
    uint64_t copies, bytes_copied, overwritten_sources, pageable_copies, registered_bytes,
        max_registered_bytes, stream_waits, event_syncs, stream_syncs, unregister_errors,
        register_overlaps, registrations, no_context_calls, unpinned_at_copy, copies_2d,
        changed_device_sources;
};

enum op_kind { OP_COPY_HTOD, OP_COPY_DTOD, OP_COPY_2D, OP_RECORD, OP_WAIT, OP_STOP };

struct event {
    uint64_t recorded, completed; /* generations */
    int refs;                     /* the handle + every queued op naming it */
    struct event *next;           /* list of live handles */
};

struct op {
    enum op_kind kind;
    char *dst;
    const char *src;
    size_t n;                           /* bytes; for a 2-D copy, the width of a row */
    size_t height, src_pitch, dst_pitch; /* 2-D copies only */
    uint64_t hash, gen;
    struct event *ev;
    struct op *next;
};

struct stream {
    struct op *head, *tail;
    uint64_t enqueued, done;
    pthread_cond_t work;
    struct stream *next; /* list of live handles */
};

struct range { uintptr_t start; size_t n; };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_progress = PTHREAD_COND_INITIALIZER; /* an op or event finished */
static struct fake_cuda_stats g_stats;
static struct stream *g_streams, *g_null_stream;
static struct event *g_events;
static struct range *g_ranges;
static size_t g_nranges, g_cap_ranges;
static int g_initialised, g_forked;
static int g_refuse_2d; /* FAKE_CUDA_REFUSE_2D=1: cuMemcpy2DAsync_v2 returns INVALID_VALUE */
static unsigned g_delay_us;
static int g_primary_ctx; /* its address is the primary context */
static __thread CUcontext t_current;

static int loaded(int *flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }
static void on_fork_child(void) { g_forked = g_initialised; }

__attribute__((constructor)) static void fake_cuda_load(void) {
    const char *d = getenv("FAKE_CUDA_COPY_DELAY_US");
    if (d) g_delay_us = (unsigned)strtoul(d, NULL, 10);
    const char *r = getenv("FAKE_CUDA_REFUSE_2D");
    g_refuse_2d = r && strcmp(r, "1") == 0;
    pthread_atfork(NULL, NULL, on_fork_child);
}

void fake_cuda_set_copy_delay_us(unsigned us) { __atomic_store_n(&g_delay_us, us, __ATOMIC_SEQ_CST); }

void fake_cuda_stats(struct fake_cuda_stats *out) {
    pthread_mutex_lock(&g_lock);
    *out = g_stats;
    pthread_mutex_unlock(&g_lock);
}

void fake_cuda_reset(void) {
    pthread_mutex_lock(&g_lock);
    uint64_t now = g_stats.registered_bytes;
    memset(&g_stats, 0, sizeof g_stats);
    g_stats.registered_bytes = g_stats.max_registered_bytes = now;
    pthread_mutex_unlock(&g_lock);
}

static uint64_t fnv1a_from(uint64_t h, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

static uint64_t fnv1a(const char *p, size_t n) { return fnv1a_from(1469598103934665603ull, p, n); }

/* The hash of what an op reads: its rows, for a 2-D copy. */
static uint64_t source_hash(const struct op *o) {
    if (o->kind != OP_COPY_2D) return fnv1a(o->src, o->n);
    uint64_t h = 1469598103934665603ull;
    for (size_t r = 0; r < o->height; r++) h = fnv1a_from(h, o->src + r * o->src_pitch, o->n);
    return h;
}

/* Whether [p, p+n) lies inside one registered range. Call with g_lock held. */
static int registered(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < g_nranges; i++)
        if (a >= g_ranges[i].start && a + n <= g_ranges[i].start + g_ranges[i].n) return 1;
    return 0;
}

static void event_unref(struct event *e) { /* g_lock held */
    if (--e->refs == 0) free(e);
}

static int live_event(struct event *e) { /* g_lock held */
    for (struct event *x = g_events; x; x = x->next)
        if (x == e) return 1;
    return 0;
}

/* The stream a handle names, or NULL when it names none. g_lock held. */
static struct stream *find_stream(void *h) {
    if ((uintptr_t)h <= 2) return g_null_stream;
    for (struct stream *s = g_streams; s; s = s->next)
        if (s == h) return s;
    return NULL;
}

/* Entry checks: initialised, not a forked child, and (when asked) a current context. */
#define ENTER(need_ctx)                                                        \
    do {                                                                       \
        if (loaded(&g_forked) || !loaded(&g_initialised)) return NOT_INITIALIZED; \
        if ((need_ctx) && !t_current) {                                        \
            pthread_mutex_lock(&g_lock);                                       \
            g_stats.no_context_calls++;                                        \
            pthread_mutex_unlock(&g_lock);                                     \
            return INVALID_CONTEXT;                                            \
        }                                                                      \
    } while (0)

static void sleep_us(unsigned us) {
    struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {}
}

static void run_op(struct op *o) { /* g_lock held on entry and exit */
    switch (o->kind) {
    case OP_COPY_HTOD:
    case OP_COPY_DTOD:
    case OP_COPY_2D: {
        pthread_mutex_unlock(&g_lock);
        sleep_us(__atomic_load_n(&g_delay_us, __ATOMIC_SEQ_CST));
        int changed = source_hash(o) != o->hash;
        size_t rows = o->kind == OP_COPY_2D ? o->height : 1;
        for (size_t r = 0; r < rows; r++)
            memmove(o->dst + r * o->dst_pitch, o->src + r * o->src_pitch, o->n);
        pthread_mutex_lock(&g_lock);
        if (o->kind == OP_COPY_HTOD && o->n && !registered(o->src, o->n)) g_stats.unpinned_at_copy++;
        if (o->kind == OP_COPY_HTOD) g_stats.overwritten_sources += changed;
        else g_stats.changed_device_sources += changed;
        g_stats.copies++;
        g_stats.copies_2d += o->kind == OP_COPY_2D;
        g_stats.bytes_copied += o->n * rows;
        break;
    }
    case OP_RECORD:
        if (o->ev->completed < o->gen) o->ev->completed = o->gen;
        event_unref(o->ev);
        break;
    case OP_WAIT:
        while (o->ev->completed < o->gen) pthread_cond_wait(&g_progress, &g_lock);
        event_unref(o->ev);
        break;
    case OP_STOP:
        break;
    }
}

static void *worker(void *arg) {
    struct stream *s = arg;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        while (!s->head) pthread_cond_wait(&s->work, &g_lock);
        struct op *o = s->head;
        int stop = o->kind == OP_STOP;
        run_op(o);
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        free(o);
        s->done++;
        pthread_cond_broadcast(&g_progress);
        if (stop) break;
    }
    pthread_mutex_unlock(&g_lock);
    pthread_cond_destroy(&s->work);
    free(s);
    return NULL;
}

static struct stream *new_stream(void) {
    struct stream *s = calloc(1, sizeof *s);
    pthread_t t;
    if (!s) return NULL;
    pthread_cond_init(&s->work, NULL);
    if (pthread_create(&t, NULL, worker, s) != 0) {
        free(s);
        return NULL;
    }
    pthread_detach(t);
    return s;
}

static void enqueue(struct stream *s, struct op *o) { /* g_lock held */
    o->next = NULL;
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    s->enqueued++;
    pthread_cond_signal(&s->work);
}

/* ---- initialisation, devices, contexts ---------------------------------------- */

CUresult cuInit(unsigned flags) {
    if (loaded(&g_forked)) return NOT_INITIALIZED;
    const char *fail = getenv("FAKE_CUDA_INIT_FAIL");
    if (fail && strcmp(fail, "1") == 0) return NO_DEVICE;
    if (flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_null_stream) g_null_stream = new_stream();
    int ok = g_null_stream != NULL;
    __atomic_store_n(&g_initialised, ok, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
    return ok ? OK : INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *v) {
    if (!v) return INVALID_VALUE;
    *v = 12080;
    return OK;
}

CUresult cuDeviceGetCount(int *n) {
    ENTER(0);
    if (!n) return INVALID_VALUE;
    *n = 1;
    return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER(0);
    if (!d) return INVALID_VALUE;
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    ENTER(0);
    if (!ctx) return INVALID_VALUE;
    if (d != 0) return INVALID_DEVICE;
    *ctx = &g_primary_ctx;
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    ENTER(0);
    return d == 0 ? OK : INVALID_DEVICE;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    ENTER(0);
    if (!ctx) return INVALID_VALUE;
    *ctx = t_current;
    return OK;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER(0);
    if (ctx && ctx != (CUcontext)&g_primary_ctx) return INVALID_CONTEXT;
    t_current = ctx;
    return OK;
}

static const char *const k_names[][2] = {
    {"CUDA_SUCCESS", "no error"},
    {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {"CUDA_ERROR_NOT_READY", "device not ready"},
    {"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};
static const int k_codes[] = {OK, INVALID_VALUE, NOT_INITIALIZED, NO_DEVICE, INVALID_DEVICE,
                              INVALID_CONTEXT, INVALID_HANDLE, NOT_READY,
                              HOST_MEMORY_ALREADY_REGISTERED, HOST_MEMORY_NOT_REGISTERED,
                              NOT_SUPPORTED};

static CUresult describe(CUresult r, const char **out, int which) {
    if (!out) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof k_codes / sizeof k_codes[0]; i++)
        if (k_codes[i] == r) {
            *out = k_names[i][which];
            return OK;
        }
    *out = NULL;
    return INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult r, const char **s) { return describe(r, s, 0); }
CUresult cuGetErrorString(CUresult r, const char **s) { return describe(r, s, 1); }

/* ---- page-locking ------------------------------------------------------------- */

/* Records [p, p + n) as page-locked; the caller holds g_lock. */
static CUresult add_range(void *p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < g_nranges; i++)
        if (a < g_ranges[i].start + g_ranges[i].n && g_ranges[i].start < a + n) {
            g_stats.register_overlaps++;
            return HOST_MEMORY_ALREADY_REGISTERED;
        }
    if (g_nranges == g_cap_ranges) {
        size_t cap = g_cap_ranges ? 2 * g_cap_ranges : 16;
        struct range *grown = realloc(g_ranges, cap * sizeof *grown);
        if (!grown) return INVALID_VALUE;
        g_ranges = grown;
        g_cap_ranges = cap;
    }
    g_ranges[g_nranges++] = (struct range){a, n};
    g_stats.registrations++;
    g_stats.registered_bytes += n;
    if (g_stats.registered_bytes > g_stats.max_registered_bytes)
        g_stats.max_registered_bytes = g_stats.registered_bytes;
    return OK;
}

/* Forgets the range starting at p; the caller holds g_lock. */
static CUresult remove_range(void *p) {
    for (size_t i = 0; i < g_nranges; i++)
        if (g_ranges[i].start == (uintptr_t)p) {
            g_stats.registered_bytes -= g_ranges[i].n;
            g_ranges[i] = g_ranges[--g_nranges];
            return OK;
        }
    g_stats.unregister_errors++;
    return HOST_MEMORY_NOT_REGISTERED;
}

/* FAKE_CUDA_REGISTER_FAIL=1: registration is refused, as some sandboxes refuse it,
 * so only cuMemHostAlloc page-locks memory. */
static int register_refused(void) {
    const char *v = getenv("FAKE_CUDA_REGISTER_FAIL");
    return v && *v == '1';
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    (void)flags;
    ENTER(1);
    if (!p || n == 0) return INVALID_VALUE;
    if (register_refused()) return NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    CUresult r = add_range(p, n);
    pthread_mutex_unlock(&g_lock);
    return r;
}

CUresult cuMemHostUnregister(void *p) {
    ENTER(1);
    pthread_mutex_lock(&g_lock);
    CUresult r = remove_range(p);
    pthread_mutex_unlock(&g_lock);
    return r;
}

CUresult cuMemHostAlloc(void **out, size_t n, unsigned flags) {
    (void)flags;
    ENTER(1);
    if (!out || n == 0) return INVALID_VALUE;
    void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) return INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = add_range(p, n);
    pthread_mutex_unlock(&g_lock);
    if (r != OK) {
        free(p);
        return r;
    }
    *out = p;
    return OK;
}

CUresult cuMemFreeHost(void *p) {
    ENTER(1);
    pthread_mutex_lock(&g_lock);
    CUresult r = remove_range(p);
    pthread_mutex_unlock(&g_lock);
    if (r == OK) free(p);
    return r;
}

/* ---- streams and events ------------------------------------------------------- */

CUresult cuStreamCreate(void **out, unsigned flags) {
    (void)flags;
    ENTER(1);
    if (!out) return INVALID_VALUE;
    struct stream *s = new_stream();
    if (!s) return INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    s->next = g_streams;
    g_streams = s;
    pthread_mutex_unlock(&g_lock);
    *out = s;
    return OK;
}

/* As in CUDA, returns at once; the worker runs what is queued, then frees the stream. */
CUresult cuStreamDestroy_v2(void *h) {
    ENTER(0);
    struct op *stop = calloc(1, sizeof *stop);
    if (!stop) return INVALID_VALUE;
    stop->kind = OP_STOP;
    pthread_mutex_lock(&g_lock);
    struct stream **p = &g_streams;
    while (*p && *p != h) p = &(*p)->next;
    if (!h || !*p) {
        pthread_mutex_unlock(&g_lock);
        free(stop);
        return INVALID_HANDLE;
    }
    *p = (*p)->next;
    enqueue(h, stop);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

CUresult cuEventCreate(void **out, unsigned flags) {
    (void)flags;
    ENTER(1);
    if (!out) return INVALID_VALUE;
    struct event *e = calloc(1, sizeof *e);
    if (!e) return INVALID_VALUE;
    e->refs = 1;
    pthread_mutex_lock(&g_lock);
    e->next = g_events;
    g_events = e;
    pthread_mutex_unlock(&g_lock);
    *out = e;
    return OK;
}

CUresult cuEventDestroy_v2(void *h) {
    ENTER(0);
    pthread_mutex_lock(&g_lock);
    struct event **p = &g_events;
    while (*p && *p != h) p = &(*p)->next;
    if (!h || !*p) {
        pthread_mutex_unlock(&g_lock);
        return INVALID_HANDLE;
    }
    *p = (*p)->next;
    event_unref(h);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

/* Queue a record (OP_RECORD) or wait (OP_WAIT) of event e on stream h. */
static CUresult event_op(enum op_kind kind, void *e, void *h) {
    struct op *o = calloc(1, sizeof *o);
    if (!o) return INVALID_VALUE;
    o->kind = kind;
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(h);
    if (!s || !live_event(e)) {
        pthread_mutex_unlock(&g_lock);
        free(o);
        return INVALID_HANDLE;
    }
    o->ev = e;
    if (kind == OP_RECORD) {
        o->gen = ++o->ev->recorded;
    } else {
        g_stats.stream_waits++;
        o->gen = o->ev->recorded;
    }
    o->ev->refs++;
    enqueue(s, o);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

CUresult cuEventRecord(void *e, void *stream) {
    ENTER(0);
    return event_op(OP_RECORD, e, stream);
}

CUresult cuStreamWaitEvent(void *stream, void *e, unsigned flags) {
    ENTER(0);
    if (flags & ~1u) return INVALID_VALUE; /* 0, or CU_EVENT_WAIT_EXTERNAL */
    return event_op(OP_WAIT, e, stream);
}

CUresult cuEventQuery(void *h) {
    ENTER(0);
    pthread_mutex_lock(&g_lock);
    CUresult r = !live_event(h) ? INVALID_HANDLE
                 : ((struct event *)h)->completed >= ((struct event *)h)->recorded ? OK : NOT_READY;
    pthread_mutex_unlock(&g_lock);
    return r;
}

CUresult cuEventSynchronize(void *h) {
    ENTER(0);
    pthread_mutex_lock(&g_lock);
    if (!live_event(h)) {
        pthread_mutex_unlock(&g_lock);
        return INVALID_HANDLE;
    }
    struct event *e = h;
    g_stats.event_syncs++;
    uint64_t gen = e->recorded;
    e->refs++; /* may be destroyed by another thread while we wait */
    while (e->completed < gen) pthread_cond_wait(&g_progress, &g_lock);
    event_unref(e);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

CUresult cuStreamSynchronize(void *h) {
    ENTER(0);
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(h);
    if (!s) {
        pthread_mutex_unlock(&g_lock);
        return INVALID_HANDLE;
    }
    g_stats.stream_syncs++;
    uint64_t target = s->enqueued;
    while (s->done < target) pthread_cond_wait(&g_progress, &g_lock);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

CUresult cuCtxSynchronize(void) {
    ENTER(1);
    pthread_mutex_lock(&g_lock);
    g_stats.stream_syncs++;
    for (;;) {
        int busy = g_null_stream->done < g_null_stream->enqueued;
        for (struct stream *s = g_streams; s && !busy; s = s->next) busy = s->done < s->enqueued;
        if (!busy) break;
        pthread_cond_wait(&g_progress, &g_lock);
    }
    pthread_mutex_unlock(&g_lock);
    return OK;
}

/* ---- copies ------------------------------------------------------------------- */

/* Queues copy `o` on stream h; frees it when it cannot. */
static CUresult enqueue_copy(struct op *o, void *h) {
    o->hash = source_hash(o);
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(h);
    if (!s) {
        pthread_mutex_unlock(&g_lock);
        free(o);
        return INVALID_HANDLE;
    }
    if (o->kind == OP_COPY_HTOD && o->n && !registered(o->src, o->n)) g_stats.pageable_copies++;
    enqueue(s, o);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

static CUresult copy_op(enum op_kind kind, CUdeviceptr dst, const void *src, size_t n, void *h) {
    if ((!dst || !src) && n) return INVALID_VALUE;
    struct op *o = calloc(1, sizeof *o);
    if (!o) return INVALID_VALUE;
    *o = (struct op){.kind = kind, .dst = (char *)(uintptr_t)dst, .src = src, .n = n};
    return enqueue_copy(o, h);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    ENTER(1);
    return copy_op(OP_COPY_HTOD, dst, src, n, stream);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    ENTER(1);
    return copy_op(OP_COPY_DTOD, dst, (const void *)(uintptr_t)src, n, stream);
}

/* cuda.h's CUDA_MEMCPY2D (the _v2 layout). */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2, MEMORYTYPE_ARRAY = 3, MEMORYTYPE_UNIFIED = 4 };

/* Where a side of a 2-D copy starts: host and device memory are both host memory here;
 * arrays are not modelled (NULL). */
static char *side(int type, const void *host, CUdeviceptr device, size_t x, size_t y, size_t pitch) {
    char *base = type == MEMORYTYPE_HOST ? (char *)host
                 : type == MEMORYTYPE_DEVICE || type == MEMORYTYPE_UNIFIED ? (char *)(uintptr_t)device
                                                                           : NULL;
    return base ? base + y * pitch + x : NULL;
}

/* Rows of WidthInBytes, Height of them, each pitch apart; as the driver does, a pitch under
 * the width is refused. */
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, void *stream) {
    ENTER(1);
    if (!p) return INVALID_VALUE;
    if (__atomic_load_n(&g_refuse_2d, __ATOMIC_SEQ_CST)) return INVALID_VALUE;
    if (p->srcMemoryType == MEMORYTYPE_ARRAY || p->dstMemoryType == MEMORYTYPE_ARRAY) return NOT_SUPPORTED;
    if (p->WidthInBytes == 0 || p->Height == 0) return OK;
    if (p->srcPitch < p->WidthInBytes || p->dstPitch < p->WidthInBytes) return INVALID_VALUE;
    const char *src = side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes, p->srcY, p->srcPitch);
    char *dst = side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstXInBytes, p->dstY, p->dstPitch);
    if (!src || !dst) return INVALID_VALUE;
    struct op *o = calloc(1, sizeof *o);
    if (!o) return INVALID_VALUE;
    *o = (struct op){.kind = OP_COPY_2D, .dst = dst, .src = src, .n = p->WidthInBytes,
                     .height = p->Height, .src_pitch = p->srcPitch, .dst_pitch = p->dstPitch};
    return enqueue_copy(o, stream);
}
