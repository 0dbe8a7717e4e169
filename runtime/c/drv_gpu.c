/* The GPU driver flow, shared by HIP and CUDA: the driver library opened with dlopen, its symbols resolved
 * from the driver's table, one non-blocking stream for copies, launches and stream capture, graphs
 * instantiated once and replayed, every error reported with the driver's own function name and text. */
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

static int g_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    gpu *g = d->state;
    return g->api->mem_alloc(g, n, addr);
}
static int g_free(v4drv *d, uint64_t addr) {
    gpu *g = d->state;
    return g->api->mem_free(g, addr);
}
/* Copies go on the runtime's (non-blocking) stream, ordered with its kernels and graphs, and complete
 * before returning: the host buffer may be freed right after. */
static int g_h2d(v4drv *d, uint64_t dst, const void *src, uint64_t n) {
    gpu *g = d->state;
    if (g->api->h2d(g, dst, src, n)) return 1;
    CK(g, stream_sync, g->stream_sync(g->stream));
    return 0;
}
static int g_d2h(v4drv *d, void *dst, uint64_t src, uint64_t n) {
    gpu *g = d->state;
    if (g->api->d2h(g, dst, src, n)) return 1;
    CK(g, stream_sync, g->stream_sync(g->stream));
    return 0;
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
static int g_capture_begin(v4drv *d) {
    gpu *g = d->state;
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
static int g_sync(v4drv *d) {
    gpu *g = d->state;
    CK(g, stream_sync, g->stream_sync(g->stream));
    return 0;
}
static int g_bind_thread(v4drv *d) {
    gpu *g = d->state;
    return g->api->make_current ? g->api->make_current(g) : 0;
}
static void g_shutdown(v4drv *d) {
    gpu *g = d->state;
    if (!g) return;
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
                 .get_function = g_get_function, .func_shared = g_func_shared, .launch = g_launch,
                 .capture_begin = g_capture_begin, .capture_end = g_capture_end, .graph_launch = g_graph_launch,
                 .graph_destroy = g_graph_destroy, .sync = g_sync, .bind_thread = g_bind_thread,
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
