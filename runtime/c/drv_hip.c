/* HIP driver: libamdhip64 opened with dlopen (module API, launches, stream capture, graphs). */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

typedef int hipError_t;
typedef void *hipModule_t, *hipFunction_t, *hipStream_t, *hipGraph_t, *hipGraphExec_t, *hipGraphNode_t;

#define HIP_MEMCPY_H2D 1
#define HIP_MEMCPY_D2H 2
#define HIP_CAPTURE_MODE_THREAD_LOCAL 1
#define HIP_STREAM_NON_BLOCKING 1

typedef struct {
    void *lib;
    hipStream_t stream;
    hipError_t (*hipInit)(unsigned);
    hipError_t (*hipSetDevice)(int);
    const char *(*hipGetErrorString)(hipError_t);
    hipError_t (*hipModuleLoadData)(hipModule_t *, const void *);
    hipError_t (*hipModuleUnload)(hipModule_t);
    hipError_t (*hipModuleGetFunction)(hipFunction_t *, hipModule_t, const char *);
    hipError_t (*hipMalloc)(void **, size_t);
    hipError_t (*hipFree)(void *);
    hipError_t (*hipMemcpyAsync)(void *, const void *, size_t, int, hipStream_t);
    hipError_t (*hipStreamCreateWithFlags)(hipStream_t *, unsigned);
    hipError_t (*hipStreamDestroy)(hipStream_t);
    hipError_t (*hipStreamSynchronize)(hipStream_t);
    hipError_t (*hipModuleLaunchKernel)(hipFunction_t, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, hipStream_t, void **, void **);
    hipError_t (*hipStreamBeginCapture)(hipStream_t, int);
    hipError_t (*hipStreamEndCapture)(hipStream_t, hipGraph_t *);
    hipError_t (*hipGraphInstantiate)(hipGraphExec_t *, hipGraph_t, hipGraphNode_t *, char *, size_t);
    hipError_t (*hipGraphLaunch)(hipGraphExec_t, hipStream_t);
    hipError_t (*hipGraphExecDestroy)(hipGraphExec_t);
    hipError_t (*hipGraphDestroy)(hipGraph_t);
} hip_t;

static int fail(hip_t *c, hipError_t r, const char *what) {
    const char *s = c->hipGetErrorString ? c->hipGetErrorString(r) : NULL;
    v4rt_seterr("hip: %s failed with error %d (%s)", what, r, s ? s : "no description");
    return 1;
}
#define CK(c, call, what)                 \
    do {                                  \
        hipError_t r_ = (call);           \
        if (r_) return fail(c, r_, what); \
    } while (0)

static int h_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    hip_t *c = d->state;
    void *p = NULL;
    CK(c, c->hipMalloc(&p, (size_t)n), "hipMalloc");
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}
static int h_free(v4drv *d, uint64_t addr) {
    hip_t *c = d->state;
    CK(c, c->hipFree((void *)(uintptr_t)addr), "hipFree");
    return 0;
}
/* Copies go on the runtime's (non-blocking) stream, ordered with its kernels and graphs, and complete
 * before returning: the host buffer may be freed right after. */
static int h_h2d(v4drv *d, uint64_t dst, const void *src, uint64_t n) {
    hip_t *c = d->state;
    CK(c, c->hipMemcpyAsync((void *)(uintptr_t)dst, src, (size_t)n, HIP_MEMCPY_H2D, c->stream), "hipMemcpyAsync(H2D)");
    CK(c, c->hipStreamSynchronize(c->stream), "hipStreamSynchronize");
    return 0;
}
static int h_d2h(v4drv *d, void *dst, uint64_t src, uint64_t n) {
    hip_t *c = d->state;
    CK(c, c->hipMemcpyAsync(dst, (const void *)(uintptr_t)src, (size_t)n, HIP_MEMCPY_D2H, c->stream), "hipMemcpyAsync(D2H)");
    CK(c, c->hipStreamSynchronize(c->stream), "hipStreamSynchronize");
    return 0;
}
static int h_module_load(v4drv *d, const void *image, uint64_t size, void **module) {
    hip_t *c = d->state;
    (void)size;
    hipModule_t m = NULL;
    CK(c, c->hipModuleLoadData(&m, image), "hipModuleLoadData");
    *module = m;
    return 0;
}
static int h_module_unload(v4drv *d, void *module) {
    hip_t *c = d->state;
    CK(c, c->hipModuleUnload(module), "hipModuleUnload");
    return 0;
}
static int h_get_function(v4drv *d, void *module, const char *symbol, void **fn) {
    hip_t *c = d->state;
    hipFunction_t f = NULL;
    CK(c, c->hipModuleGetFunction(&f, module, symbol), "hipModuleGetFunction");
    *fn = f;
    return 0;
}
static int h_launch(v4drv *d, void *fn, const uint32_t g[3], const uint32_t b[3], uint32_t shared, uint32_t n,
                    const uint64_t *params, uint64_t tag) {
    hip_t *c = d->state;
    (void)tag;
    void *stack[64];
    void **args = n <= 64 ? stack : malloc(n * sizeof(void *));
    if (!args) {
        v4rt_seterr("out of host memory for kernel arguments");
        return 1;
    }
    for (uint32_t i = 0; i < n; i++) args[i] = (void *)&params[i];
    hipError_t r = c->hipModuleLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], shared, c->stream, args, NULL);
    if (args != stack) free(args);
    return r ? fail(c, r, "hipModuleLaunchKernel") : 0;
}
static int h_capture_begin(v4drv *d) {
    hip_t *c = d->state;
    CK(c, c->hipStreamBeginCapture(c->stream, HIP_CAPTURE_MODE_THREAD_LOCAL), "hipStreamBeginCapture");
    return 0;
}
typedef struct {
    hipGraph_t graph;
    hipGraphExec_t exec;
} hgraph;
static int h_capture_end(v4drv *d, void **graph) {
    hip_t *c = d->state;
    *graph = NULL;
    hipGraph_t g = NULL;
    CK(c, c->hipStreamEndCapture(c->stream, &g), "hipStreamEndCapture");
    hipGraphExec_t e = NULL;
    hipError_t r = c->hipGraphInstantiate(&e, g, NULL, NULL, 0);
    if (r) {
        c->hipGraphDestroy(g);
        return fail(c, r, "hipGraphInstantiate");
    }
    hgraph *h = malloc(sizeof *h);
    if (!h) {
        c->hipGraphExecDestroy(e);
        c->hipGraphDestroy(g);
        v4rt_seterr("out of host memory");
        return 1;
    }
    h->graph = g;
    h->exec = e;
    *graph = h;
    return 0;
}
static int h_graph_launch(v4drv *d, void *graph) {
    hip_t *c = d->state;
    CK(c, c->hipGraphLaunch(((hgraph *)graph)->exec, c->stream), "hipGraphLaunch");
    return 0;
}
static int h_graph_destroy(v4drv *d, void *graph) {
    hip_t *c = d->state;
    hgraph *h = graph;
    c->hipGraphExecDestroy(h->exec);
    c->hipGraphDestroy(h->graph);
    free(h);
    return 0;
}
static int h_sync(v4drv *d) {
    hip_t *c = d->state;
    CK(c, c->hipStreamSynchronize(c->stream), "hipStreamSynchronize");
    return 0;
}
static void h_shutdown(v4drv *d) {
    hip_t *c = d->state;
    if (!c) return;
    if (c->stream) c->hipStreamDestroy(c->stream);
    if (c->lib) dlclose(c->lib);
    free(c);
    d->state = NULL;
}

#define SYM(c, field, name)                                                                \
    do {                                                                                   \
        *(void **)(&(c)->field) = dlsym((c)->lib, name);                                   \
        if (!(c)->field) {                                                                 \
            v4rt_seterr("hip: symbol %s missing from the driver library %s", name, path); \
            goto bad;                                                                      \
        }                                                                                  \
    } while (0)

int v4drv_hip_open(v4drv *d, const char *lib) {
    const char *path = lib ? lib : "libamdhip64.so";
    hip_t *c = calloc(1, sizeof *c);
    if (!c) {
        v4rt_seterr("out of host memory");
        return 1;
    }
    *d = (v4drv){"hip", c, h_alloc, h_free, h_h2d, h_d2h, h_module_load, h_module_unload, h_get_function,
                 h_launch, h_capture_begin, h_capture_end, h_graph_launch, h_graph_destroy, h_sync, h_shutdown};
    c->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        const char *e = dlerror();
        v4rt_seterr("hip: cannot open the driver library %s: %s", path, e ? e : "unknown error");
        goto bad;
    }
    SYM(c, hipInit, "hipInit");
    SYM(c, hipSetDevice, "hipSetDevice");
    SYM(c, hipGetErrorString, "hipGetErrorString");
    SYM(c, hipModuleLoadData, "hipModuleLoadData");
    SYM(c, hipModuleUnload, "hipModuleUnload");
    SYM(c, hipModuleGetFunction, "hipModuleGetFunction");
    SYM(c, hipMalloc, "hipMalloc");
    SYM(c, hipFree, "hipFree");
    SYM(c, hipMemcpyAsync, "hipMemcpyAsync");
    SYM(c, hipStreamCreateWithFlags, "hipStreamCreateWithFlags");
    SYM(c, hipStreamDestroy, "hipStreamDestroy");
    SYM(c, hipStreamSynchronize, "hipStreamSynchronize");
    SYM(c, hipModuleLaunchKernel, "hipModuleLaunchKernel");
    SYM(c, hipStreamBeginCapture, "hipStreamBeginCapture");
    SYM(c, hipStreamEndCapture, "hipStreamEndCapture");
    SYM(c, hipGraphInstantiate, "hipGraphInstantiate");
    SYM(c, hipGraphLaunch, "hipGraphLaunch");
    SYM(c, hipGraphExecDestroy, "hipGraphExecDestroy");
    SYM(c, hipGraphDestroy, "hipGraphDestroy");
    hipError_t r;
    if ((r = c->hipInit(0))) {
        fail(c, r, "hipInit");
        goto bad;
    }
    if ((r = c->hipSetDevice(0))) {
        fail(c, r, "hipSetDevice");
        goto bad;
    }
    if ((r = c->hipStreamCreateWithFlags(&c->stream, HIP_STREAM_NON_BLOCKING))) {
        fail(c, r, "hipStreamCreateWithFlags");
        goto bad;
    }
    return 0;
bad:
    h_shutdown(d);
    return 1;
}
