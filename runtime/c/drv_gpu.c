/* The GPU driver flow, shared by HIP and CUDA: the driver library opened with dlopen, its symbols resolved
 * from the driver's table, one non-blocking stream for copies, launches and stream capture, graphs
 * instantiated once and replayed, large writes staged through pinned buffers and left in flight, every
 * error reported with the driver's own function name and text. */
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "drv_gpu.h"

_Static_assert(sizeof(void *) == sizeof(int (*)(void)), "dlsym addresses are stored as function pointers");

int gpu_check(gpu *g, int r, const char *what) {
    if (!r) return 0;
    const char *s = g->api->error_string(g, r);
    size_t n = strlen(what);
    if (n > 3 && strcmp(what + n - 3, "_v2") == 0) n -= 3;
    v4rt_seterr("%s: %.*s failed with error %d (%s)", g->api->name, (int)n, what, r, s ? s : "no description");
    return 1;
}

/* The symbol behind one of the shared entry points (for its error message). */
static const char *sym(const gpu *g, size_t offset) {
    for (const gpu_sym *s = g->api->syms; s->symbol; s++)
        if (s->offset == offset) return s->symbol;
    return "?";
}
/* `call` calls the shared entry point `field`; on failure, report it under the driver's symbol and return 1. */
#define CK(g, field, call)                                               \
    do {                                                                 \
        int r_ = (call);                                                 \
        if (r_) return gpu_check(g, r_, sym(g, offsetof(gpu, field)));   \
    } while (0)

/* Wait for everything enqueued on the stream; staged copies are then no longer reading their buffers. */
static int drain(gpu *g) {
    CK(g, stream_sync, g->stream_sync(g->stream));
    g->pending = 0;
    return 0;
}

static int g_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    gpu *g = d->state;
    return g->api->mem_alloc(g, n, addr);
}
/* Freeing device memory is not ordered with the stream: a staged copy into it must have landed first. */
static int g_free(v4drv *d, uint64_t addr) {
    gpu *g = d->state;
    if (g->pending && drain(g)) return 1;
    return g->api->mem_free(g, addr);
}

/* Symmetric memory: the driver's IPC-capable allocation, freed as any (after staged copies into it landed). */
static int g_sym_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    gpu *g = d->state;
    return g->api->sym_alloc(g, n, addr);
}
static int g_ipc_handle(v4drv *d, uint64_t addr, unsigned char *handle) {
    gpu *g = d->state;
    return g->api->ipc_handle(g, addr, handle);
}
static int g_ipc_open(v4drv *d, const unsigned char *handle, uint64_t nbytes, uint64_t *addr) {
    gpu *g = d->state;
    (void)nbytes; /* the handle knows its allocation's size */
    return g->api->ipc_open(g, handle, addr);
}
static int g_ipc_close(v4drv *d, uint64_t addr) {
    gpu *g = d->state;
    return g->api->ipc_close(g, addr);
}

/* Blocking-sync events (the host thread sleeps while it waits, leaving its core to the file reads and
 * hashing) without timing: the same flag numbers on both drivers. */
#define EVENT_FLAGS 3u

static void stage_close(gpu *g) {
    for (unsigned i = 0; i < V4RT_STAGE_COUNT; i++) {
        if (g->stage[i]) g->host_free(g->stage[i]);
        if (g->stage_done[i]) g->event_destroy(g->stage_done[i]);
        g->stage[i] = NULL;
        g->stage_done[i] = NULL;
    }
    g->staging = 0;
}
static int stage_open(gpu *g) {
    for (unsigned i = 0; i < V4RT_STAGE_COUNT; i++) {
        void *p = NULL, *e = NULL;
        int r = g->host_alloc(&p, V4RT_STAGE_BYTES, 0);
        if (r) {
            gpu_check(g, r, sym(g, offsetof(gpu, host_alloc)));
            stage_close(g);
            return 1;
        }
        g->stage[i] = p;
        r = g->event_create(&e, EVENT_FLAGS);
        if (r) {
            gpu_check(g, r, sym(g, offsetof(gpu, event_create)));
            stage_close(g);
            return 1;
        }
        g->stage_done[i] = e;
    }
    g->staging = 1;
    g->stage_cur = 0;
    g->stage_fill = 0;
    return 0;
}

/* Copies go on the runtime's (non-blocking) stream, ordered with its kernels and graphs. A small write
 * before any large one is copied from the caller's (pageable) memory, which both drivers consume before
 * returning. From the first large write on, every write is copied into a pinned staging buffer and its
 * copy left in flight: the caller's memory is free again at once, and its next piece is read from disk
 * while this one crosses the link. The buffers are filled in turn; before one is refilled, the event
 * recorded after its last copy is waited for. (After the first large write, small writes are staged too:
 * a pageable copy would wait for the whole stream first, CUDA's documented behaviour, and end the overlap.) */
static int g_h2d(v4drv *d, uint64_t dst, const void *src, uint64_t n) {
    gpu *g = d->state;
    if (!g->staging && n < V4RT_STAGE_MIN) return g->api->h2d(g, dst, src, n);
    if (!g->staging && stage_open(g)) return 1;
    const unsigned char *s = src;
    while (n) {
        if (g->stage_fill == V4RT_STAGE_BYTES) { /* full: its copies are enqueued; on to the next buffer */
            unsigned next = (g->stage_cur + 1) % V4RT_STAGE_COUNT;
            CK(g, event_record, g->event_record(g->stage_done[g->stage_cur], g->stream));
            CK(g, event_sync, g->event_sync(g->stage_done[next])); /* (a failure leaves it full: no refill) */
            g->stage_cur = next;
            g->stage_fill = 0;
        }
        uint64_t room = V4RT_STAGE_BYTES - g->stage_fill, m = n < room ? n : room;
        unsigned char *p = g->stage[g->stage_cur] + g->stage_fill;
        memcpy(p, s, (size_t)m);
        if (g->api->h2d(g, dst, p, m)) return 1;
        g->pending = 1;
        g->stage_fill += m;
        dst += m;
        s += m;
        n -= m;
    }
    return 0;
}
static int g_d2h(v4drv *d, void *dst, uint64_t src, uint64_t n) {
    gpu *g = d->state;
    if (g->api->d2h(g, dst, src, n)) return 1;
    return drain(g);
}
/* The copy table's copies: a save is read back (and waited for, as every read); a restore is a write (staged
 * once staging is on); a device copy is enqueued behind the kernels and left in flight. */
static int g_copy(v4drv *d, uint32_t kind, uint64_t dst, uint64_t src, uint64_t n, uint64_t tag) {
    gpu *g = d->state;
    (void)tag;
    if (kind == V4RT_COPY_SAVE) return g_d2h(d, (void *)(uintptr_t)dst, src, n);
    if (kind == V4RT_COPY_RESTORE) return g_h2d(d, dst, (const void *)(uintptr_t)src, n);
    return g->api->d2d(g, dst, src, n);
}
static int g_module_load(v4drv *d, const void *image, uint64_t size, void **module) {
    gpu *g = d->state;
    (void)size;
    void *m = NULL;
    CK(g, module_load, g->module_load(&m, image));
    *module = m;
    return 0;
}
static int g_module_unload(v4drv *d, void *module) {
    gpu *g = d->state;
    CK(g, module_unload, g->module_unload(module));
    return 0;
}
static int g_get_function(v4drv *d, void *module, const char *symbol, void **fn) {
    gpu *g = d->state;
    void *f = NULL;
    CK(g, get_function, g->get_function(&f, module, symbol));
    *fn = f;
    return 0;
}
static int g_func_shared(v4drv *d, void *fn, uint32_t shared) {
    gpu *g = d->state;
    if (shared <= g->api->shared_default) return 0;
    if (shared > INT_MAX) {
        v4rt_seterr("%s: %u bytes of dynamic shared memory is more than any device has", g->api->name, shared);
        return 1;
    }
    CK(g, func_set_attribute, g->func_set_attribute(fn, g->api->shared_attribute, (int)shared));
    return 0;
}
static int g_launch(v4drv *d, void *fn, const uint32_t gr[3], const uint32_t b[3], uint32_t shared, uint32_t n,
                    const uint64_t *params, uint64_t tag, uint32_t flags) {
    gpu *g = d->state;
    (void)tag;
    if ((flags & V4DRV_LAUNCH_PDL) && !g->api->launch_pdl) {
        v4rt_seterr("%s: programmatic dependent launch is not available on this driver (a launch table for "
                    "another target?)", g->api->name);
        return 1;
    }
    void *stack[64];
    void **args = n <= 64 ? stack : malloc(n * sizeof(void *));
    if (!args) {
        v4rt_seterr("out of host memory for kernel arguments");
        return 1;
    }
    /* The parameter values outlive the launch (they live in the runtime's call table): a captured graph
     * copies them at capture time anyway. */
    for (uint32_t i = 0; i < n; i++) args[i] = (void *)&params[i];
    if (flags & V4DRV_LAUNCH_PDL) { /* the adapter reports its own error */
        int bad = g->api->launch_pdl(g, fn, gr, b, shared, args);
        if (args != stack) free(args);
        return bad;
    }
    int r = g->launch(fn, gr[0], gr[1], gr[2], b[0], b[1], b[2], shared, g->stream, args, NULL);
    if (args != stack) free(args);
    CK(g, launch, r);
    return 0;
}
/* The upload finishes (and reports any failure of its own) before a graph is built: nothing can be
 * synchronised inside a capture. */
static int g_capture_begin(v4drv *d) {
    gpu *g = d->state;
    if (g->pending && drain(g)) return 1;
    CK(g, capture_begin, g->capture_begin(g->stream, g->api->capture_mode));
    return 0;
}
typedef struct {
    void *graph, *exec;
} graph_t;
static int g_capture_end(v4drv *d, void **graph) {
    gpu *g = d->state;
    *graph = NULL;
    void *gr = NULL, *e = NULL;
    CK(g, capture_end, g->capture_end(g->stream, &gr));
    if (g->api->graph_instantiate(g, &e, gr)) {
        g->graph_destroy(gr);
        return 1;
    }
    graph_t *h = malloc(sizeof *h);
    if (!h) {
        g->graph_exec_destroy(e);
        g->graph_destroy(gr);
        v4rt_seterr("out of host memory");
        return 1;
    }
    h->graph = gr;
    h->exec = e;
    *graph = h;
    return 0;
}
static int g_graph_launch(v4drv *d, void *graph) {
    gpu *g = d->state;
    CK(g, graph_launch, g->graph_launch(((graph_t *)graph)->exec, g->stream));
    return 0;
}
static int g_graph_destroy(v4drv *d, void *graph) {
    gpu *g = d->state;
    graph_t *h = graph;
    g->graph_exec_destroy(h->exec);
    g->graph_destroy(h->graph);
    free(h);
    return 0;
}
static int g_sync(v4drv *d) { return drain(d->state); }
static int g_bind_thread(v4drv *d) {
    gpu *g = d->state;
    return g->api->make_current ? g->api->make_current(g) : 0;
}
/* Collectives go on the runtime's stream too: ordered with the kernels, and captured with them. */
static int g_collective(v4drv *d, const char *op, uint32_t group, uint32_t dtype, uint64_t count, uint64_t send,
                        uint64_t recv, uint64_t tag) {
    gpu *g = d->state;
    (void)tag;
    return v4comm_run(g->comm, op, group, dtype, count, send, recv, g->stream);
}
static int g_comm_init(v4drv *d, const char *lib, uint32_t rank, uint32_t n, const uint32_t *sizes,
                       const unsigned char *ids) {
    gpu *g = d->state;
    if (g->comm) {
        v4rt_seterr("collectives: the communicators are already joined");
        return 1;
    }
    return v4comm_open(&g->comm, lib ? lib : g->api->comm_lib, rank, n, sizes, ids);
}
static void g_shutdown(v4drv *d) {
    gpu *g = d->state;
    if (!g) return;
    if (g->pending) (void)drain(g); /* no copy may still read the staging buffers (a failure: nothing better to do) */
    if (g->staging) stage_close(g);
    v4comm_close(g->comm);
    if (g->stream) g->stream_destroy(g->stream);
    if (g->api->device_close) g->api->device_close(g);
    if (g->lib) dlclose(g->lib);
    free(g);
    d->state = NULL;
}

int gpu_open(v4drv *d, const gpu_api *api, const char *lib) {
    const char *path = lib ? lib : api->default_lib;
    gpu *g = calloc(1, api->state_size);
    if (!g) {
        v4rt_seterr("out of host memory");
        return 1;
    }
    g->api = api;
    *d = (v4drv){.name = api->name, .state = g, .mem_alloc = g_alloc, .mem_free = g_free, .h2d = g_h2d,
                 .d2h = g_d2h, .module_load = g_module_load, .module_unload = g_module_unload,
                 .get_function = g_get_function, .func_shared = g_func_shared, .launch = g_launch, .copy = g_copy,
                 .capture_begin = g_capture_begin, .capture_end = g_capture_end, .graph_launch = g_graph_launch,
                 .graph_destroy = g_graph_destroy, .sync = g_sync, .bind_thread = g_bind_thread,
                 .collective = g_collective, .comm_init = g_comm_init, .sym_alloc = g_sym_alloc, .sym_free = g_free,
                 .ipc_handle = g_ipc_handle, .ipc_open = g_ipc_open, .ipc_close = g_ipc_close,
                 .shutdown = g_shutdown};
    g->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!g->lib) {
        const char *e = dlerror();
        v4rt_seterr("%s: cannot open the driver library %s: %s", api->name, path, e ? e : "unknown error");
        goto bad;
    }
    for (const gpu_sym *s = api->syms; s->symbol; s++) {
        void *p = dlsym(g->lib, s->symbol);
        if (!p) {
            v4rt_seterr("%s: symbol %s missing from the driver library %s", api->name, s->symbol, path);
            goto bad;
        }
        memcpy((char *)g + s->offset, &p, sizeof p); /* POSIX: a function's address fits a void * */
    }
    if (gpu_check(g, g->init(0), sym(g, offsetof(gpu, init))) || api->device_open(g)) goto bad;
    /* Non-blocking: stream capture is illegal on the legacy default stream and must not sync with it. */
    if (gpu_check(g, g->stream_create(&g->stream, api->stream_flags), sym(g, offsetof(gpu, stream_create))))
        goto bad;
    return 0;
bad:
    g_shutdown(d);
    return 1;
}
