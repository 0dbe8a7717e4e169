/* CUDA driver: libcuda opened with dlopen (driver API: modules, launches, stream capture, graphs). */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

typedef int CUresult;
typedef void *CUmodule, *CUfunction, *CUstream, *CUgraph, *CUgraphExec, *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;

#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_STREAM_NON_BLOCKING 1

typedef struct {
    void *lib;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    int ctx_retained;
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleUnload)(CUmodule);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuStreamCreate)(CUstream *, unsigned);
    CUresult (*cuStreamDestroy)(CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void **, void **);
    CUresult (*cuStreamBeginCapture)(CUstream, int);
    CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
    CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
    CUresult (*cuGraphExecDestroy)(CUgraphExec);
    CUresult (*cuGraphDestroy)(CUgraph);
} cu_t;

static int fail(cu_t *c, CUresult r, const char *what) {
    const char *s = NULL;
    if (c->cuGetErrorString) c->cuGetErrorString(r, &s);
    v4rt_seterr("cuda: %s failed with error %d (%s)", what, r, s ? s : "no description");
    return 1;
}
#define CK(c, call, what)                 \
    do {                                  \
        CUresult r_ = (call);             \
        if (r_) return fail(c, r_, what); \
    } while (0)

static int c_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    cu_t *c = d->state;
    CUdeviceptr p = 0;
    CK(c, c->cuMemAlloc(&p, (size_t)n), "cuMemAlloc");
    *addr = p;
    return 0;
}
static int c_free(v4drv *d, uint64_t addr) {
    cu_t *c = d->state;
    CK(c, c->cuMemFree((CUdeviceptr)addr), "cuMemFree");
    return 0;
}
/* Copies go on the runtime's (non-blocking) stream, so they are ordered with its kernels and graphs, and
 * complete before returning: the host buffer may be freed right after. */
static int c_h2d(v4drv *d, uint64_t dst, const void *src, uint64_t n) {
    cu_t *c = d->state;
    CK(c, c->cuMemcpyHtoDAsync((CUdeviceptr)dst, src, (size_t)n, c->stream), "cuMemcpyHtoDAsync");
    CK(c, c->cuStreamSynchronize(c->stream), "cuStreamSynchronize");
    return 0;
}
static int c_d2h(v4drv *d, void *dst, uint64_t src, uint64_t n) {
    cu_t *c = d->state;
    CK(c, c->cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, (size_t)n, c->stream), "cuMemcpyDtoHAsync");
    CK(c, c->cuStreamSynchronize(c->stream), "cuStreamSynchronize");
    return 0;
}
static int c_module_load(v4drv *d, const void *image, uint64_t size, void **module) {
    cu_t *c = d->state;
    (void)size;
    CUmodule m = NULL;
    CK(c, c->cuModuleLoadData(&m, image), "cuModuleLoadData");
    *module = m;
    return 0;
}
static int c_module_unload(v4drv *d, void *module) {
    cu_t *c = d->state;
    CK(c, c->cuModuleUnload(module), "cuModuleUnload");
    return 0;
}
static int c_get_function(v4drv *d, void *module, const char *symbol, void **fn) {
    cu_t *c = d->state;
    CUfunction f = NULL;
    CK(c, c->cuModuleGetFunction(&f, module, symbol), "cuModuleGetFunction");
    *fn = f;
    return 0;
}
static int c_launch(v4drv *d, void *fn, const uint32_t g[3], const uint32_t b[3], uint32_t shared, uint32_t n,
                    const uint64_t *params, uint64_t tag) {
    cu_t *c = d->state;
    (void)tag;
    void *stack[64];
    void **args = n <= 64 ? stack : malloc(n * sizeof(void *));
    if (!args) {
        v4rt_seterr("out of host memory for kernel arguments");
        return 1;
    }
    /* The parameter values outlive the launch (they live in the runtime's call table): a captured graph
     * copies them at capture time anyway. */
    for (uint32_t i = 0; i < n; i++) args[i] = (void *)&params[i];
    CUresult r = 0;
    if (shared > 48 * 1024) r = c->cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared);
    if (!r) r = c->cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], shared, c->stream, args, NULL);
    if (args != stack) free(args);
    return r ? fail(c, r, "cuLaunchKernel") : 0;
}
static int c_capture_begin(v4drv *d) {
    cu_t *c = d->state;
    CK(c, c->cuStreamBeginCapture(c->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    return 0;
}
typedef struct {
    CUgraph graph;
    CUgraphExec exec;
} cgraph;
static int c_capture_end(v4drv *d, void **graph) {
    cu_t *c = d->state;
    *graph = NULL;
    CUgraph g = NULL;
    CK(c, c->cuStreamEndCapture(c->stream, &g), "cuStreamEndCapture");
    CUgraphExec e = NULL;
    CUresult r = c->cuGraphInstantiateWithFlags(&e, g, 0);
    if (r) {
        c->cuGraphDestroy(g);
        return fail(c, r, "cuGraphInstantiateWithFlags");
    }
    cgraph *h = malloc(sizeof *h);
    if (!h) {
        c->cuGraphExecDestroy(e);
        c->cuGraphDestroy(g);
        v4rt_seterr("out of host memory");
        return 1;
    }
    h->graph = g;
    h->exec = e;
    *graph = h;
    return 0;
}
static int c_graph_launch(v4drv *d, void *graph) {
    cu_t *c = d->state;
    CK(c, c->cuGraphLaunch(((cgraph *)graph)->exec, c->stream), "cuGraphLaunch");
    return 0;
}
static int c_graph_destroy(v4drv *d, void *graph) {
    cu_t *c = d->state;
    cgraph *h = graph;
    c->cuGraphExecDestroy(h->exec);
    c->cuGraphDestroy(h->graph);
    free(h);
    return 0;
}
static int c_sync(v4drv *d) {
    cu_t *c = d->state;
    CK(c, c->cuStreamSynchronize(c->stream), "cuStreamSynchronize");
    return 0;
}
static void c_shutdown(v4drv *d) {
    cu_t *c = d->state;
    if (!c) return;
    if (c->stream) c->cuStreamDestroy(c->stream);
    if (c->ctx_retained) c->cuDevicePrimaryCtxRelease(c->dev);
    if (c->lib) dlclose(c->lib);
    free(c);
    d->state = NULL;
}

#define SYM(c, field, name)                                                                 \
    do {                                                                                    \
        *(void **)(&(c)->field) = dlsym((c)->lib, name);                                    \
        if (!(c)->field) {                                                                  \
            v4rt_seterr("cuda: symbol %s missing from the driver library %s", name, path); \
            goto bad;                                                                       \
        }                                                                                   \
    } while (0)

int v4drv_cuda_open(v4drv *d, const char *lib) {
    const char *path = lib ? lib : "libcuda.so.1";
    cu_t *c = calloc(1, sizeof *c);
    if (!c) {
        v4rt_seterr("out of host memory");
        return 1;
    }
    *d = (v4drv){"cuda", c, c_alloc, c_free, c_h2d, c_d2h, c_module_load, c_module_unload, c_get_function,
                 c_launch, c_capture_begin, c_capture_end, c_graph_launch, c_graph_destroy, c_sync, c_shutdown};
    c->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        const char *e = dlerror();
        v4rt_seterr("cuda: cannot open the driver library %s: %s", path, e ? e : "unknown error");
        goto bad;
    }
    SYM(c, cuInit, "cuInit");
    SYM(c, cuDeviceGet, "cuDeviceGet");
    SYM(c, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(c, cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(c, cuCtxSetCurrent, "cuCtxSetCurrent");
    SYM(c, cuGetErrorString, "cuGetErrorString");
    SYM(c, cuModuleLoadData, "cuModuleLoadData");
    SYM(c, cuModuleUnload, "cuModuleUnload");
    SYM(c, cuModuleGetFunction, "cuModuleGetFunction");
    SYM(c, cuFuncSetAttribute, "cuFuncSetAttribute");
    SYM(c, cuMemAlloc, "cuMemAlloc_v2");
    SYM(c, cuMemFree, "cuMemFree_v2");
    SYM(c, cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    SYM(c, cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(c, cuStreamCreate, "cuStreamCreate");
    SYM(c, cuStreamDestroy, "cuStreamDestroy_v2");
    SYM(c, cuStreamSynchronize, "cuStreamSynchronize");
    SYM(c, cuLaunchKernel, "cuLaunchKernel");
    SYM(c, cuStreamBeginCapture, "cuStreamBeginCapture_v2");
    SYM(c, cuStreamEndCapture, "cuStreamEndCapture");
    SYM(c, cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
    SYM(c, cuGraphLaunch, "cuGraphLaunch");
    SYM(c, cuGraphExecDestroy, "cuGraphExecDestroy");
    SYM(c, cuGraphDestroy, "cuGraphDestroy");
    CUresult r;
    if ((r = c->cuInit(0))) {
        fail(c, r, "cuInit");
        goto bad;
    }
    if ((r = c->cuDeviceGet(&c->dev, 0))) {
        fail(c, r, "cuDeviceGet");
        goto bad;
    }
    if ((r = c->cuDevicePrimaryCtxRetain(&c->ctx, c->dev))) {
        fail(c, r, "cuDevicePrimaryCtxRetain");
        goto bad;
    }
    c->ctx_retained = 1;
    if ((r = c->cuCtxSetCurrent(c->ctx))) {
        fail(c, r, "cuCtxSetCurrent");
        goto bad;
    }
    /* Non-blocking: stream capture is illegal on the legacy default stream and must not sync with it. */
    if ((r = c->cuStreamCreate(&c->stream, CU_STREAM_NON_BLOCKING))) {
        fail(c, r, "cuStreamCreate");
        goto bad;
    }
    return 0;
bad:
    c_shutdown(d);
    return 1;
}
