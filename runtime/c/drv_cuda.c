/* CUDA driver: libcuda (driver API) through the shared GPU flow (drv_gpu.c); here its symbols and what
 * differs: the primary context, device pointers as integers, copy and instantiate signatures. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "drv_gpu.h"

typedef unsigned long long CUdeviceptr;
typedef struct {
    char reserved[64];
} CUipcMemHandle; /* passed by value to cuIpcOpenMemHandle, as cuda.h declares it */
_Static_assert(sizeof(CUipcMemHandle) == V4RT_IPC_HANDLE_BYTES, "CUipcMemHandle as in cuda.h");
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_STREAM_NON_BLOCKING 1
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6

/* cuLaunchKernelEx's launch description, as cuda.h lays it out (CUDA >= 11.8): an attribute is its id padded
 * to 8 bytes then a 64-byte value union, of which the programmatic-serialization flag is the first int. */
typedef struct {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int programmatic_stream_serialization_allowed;
    } value;
} CUlaunchAttribute;
typedef struct {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
    void *stream;
    CUlaunchAttribute *attrs;
    unsigned n_attrs;
} CUlaunchConfig;
_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute as in cuda.h");
_Static_assert(offsetof(CUlaunchConfig, stream) == 32 && offsetof(CUlaunchConfig, attrs) == 40 &&
                   offsetof(CUlaunchConfig, n_attrs) == 48 && sizeof(CUlaunchConfig) == 56,
               "CUlaunchConfig as in cuda.h (LP64)");

typedef struct {
    gpu g;
    int dev;
    void *ctx;
    int ctx_retained;
    int (*cuDeviceGet)(int *, int);
    int (*cuDevicePrimaryCtxRetain)(void **, int);
    int (*cuDevicePrimaryCtxRelease)(int);
    int (*cuCtxSetCurrent)(void *);
    int (*cuGetErrorString)(int, const char **);
    int (*cuMemAlloc)(CUdeviceptr *, size_t);
    int (*cuMemFree)(CUdeviceptr);
    int (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, void *);
    int (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, void *);
    int (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, void *);
    int (*cuGraphInstantiateWithFlags)(void **, void *, unsigned long long);
    int (*cuLaunchKernelEx)(const CUlaunchConfig *, void *, void **, void **);
    int (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    int (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned);
    int (*cuIpcCloseMemHandle)(CUdeviceptr);
} cu_t;

static cu_t *C(gpu *g) { return (cu_t *)g; }

static int cu_device_open(gpu *g) {
    cu_t *c = C(g);
    if (gpu_check(g, c->cuDeviceGet(&c->dev, 0), "cuDeviceGet") ||
        gpu_check(g, c->cuDevicePrimaryCtxRetain(&c->ctx, c->dev), "cuDevicePrimaryCtxRetain"))
        return 1;
    c->ctx_retained = 1;
    return gpu_check(g, c->cuCtxSetCurrent(c->ctx), "cuCtxSetCurrent");
}
/* The primary context is current per thread: a run from a thread other than the opener's needs it made
 * current there (what Triton's launcher does before each launch). */
static int cu_make_current(gpu *g) { return gpu_check(g, C(g)->cuCtxSetCurrent(C(g)->ctx), "cuCtxSetCurrent"); }
static void cu_device_close(gpu *g) {
    if (C(g)->ctx_retained) C(g)->cuDevicePrimaryCtxRelease(C(g)->dev);
}
static const char *cu_error_string(gpu *g, int r) {
    const char *s = NULL;
    if (C(g)->cuGetErrorString) C(g)->cuGetErrorString(r, &s);
    return s;
}
static int cu_alloc(gpu *g, uint64_t n, uint64_t *addr) {
    CUdeviceptr p = 0;
    if (gpu_check(g, C(g)->cuMemAlloc(&p, (size_t)n), "cuMemAlloc")) return 1;
    *addr = p;
    return 0;
}
static int cu_free(gpu *g, uint64_t addr) { return gpu_check(g, C(g)->cuMemFree((CUdeviceptr)addr), "cuMemFree"); }
static int cu_h2d(gpu *g, uint64_t dst, const void *src, uint64_t n) {
    return gpu_check(g, C(g)->cuMemcpyHtoDAsync((CUdeviceptr)dst, src, (size_t)n, g->stream), "cuMemcpyHtoDAsync");
}
static int cu_d2h(gpu *g, void *dst, uint64_t src, uint64_t n) {
    return gpu_check(g, C(g)->cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, (size_t)n, g->stream), "cuMemcpyDtoHAsync");
}
static int cu_d2d(gpu *g, uint64_t dst, uint64_t src, uint64_t n) {
    return gpu_check(g, C(g)->cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, (size_t)n, g->stream),
                     "cuMemcpyDtoDAsync");
}
static int cu_instantiate(gpu *g, void **exec, void *graph) {
    return gpu_check(g, C(g)->cuGraphInstantiateWithFlags(exec, graph, 0), "cuGraphInstantiateWithFlags");
}
/* Programmatic dependent launch: the launch may begin while the stream's previous kernel runs (the kernel
 * waits for it in griddepcontrol.wait). Captured into a graph, the attribute becomes a programmatic edge. */
static int cu_launch_pdl(gpu *g, void *fn, const uint32_t gr[3], const uint32_t b[3], uint32_t shared, void **args) {
    CUlaunchAttribute attr = {.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION};
    attr.value.programmatic_stream_serialization_allowed = 1;
    CUlaunchConfig cfg = {gr[0], gr[1], gr[2], b[0], b[1], b[2], shared, g->stream, &attr, 1};
    return gpu_check(g, C(g)->cuLaunchKernelEx(&cfg, fn, args, NULL), "cuLaunchKernelEx");
}

/* Symmetric memory: cuMemAlloc'ed memory is what cuIpcGetMemHandle exports (CUDA driver API, "Interprocess
 * communication"); a peer maps it with cuIpcOpenMemHandle (peer access enabled lazily) and unmaps it with
 * cuIpcCloseMemHandle. */
static int cu_ipc_handle(gpu *g, uint64_t addr, unsigned char *handle) {
    CUipcMemHandle h;
    if (gpu_check(g, C(g)->cuIpcGetMemHandle(&h, (CUdeviceptr)addr), "cuIpcGetMemHandle")) return 1;
    memcpy(handle, &h, sizeof h);
    return 0;
}
static int cu_ipc_open(gpu *g, const unsigned char *handle, uint64_t *addr) {
    CUipcMemHandle h;
    CUdeviceptr p = 0;
    memcpy(&h, handle, sizeof h);
    if (gpu_check(g, C(g)->cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle_v2"))
        return 1;
    *addr = p;
    return 0;
}
static int cu_ipc_close(gpu *g, uint64_t addr) {
    return gpu_check(g, C(g)->cuIpcCloseMemHandle((CUdeviceptr)addr), "cuIpcCloseMemHandle");
}

#define G(field) offsetof(cu_t, g.field)
#define OWN(field) offsetof(cu_t, field)
static const gpu_sym SYMS[] = {
    {"cuInit", G(init)},
    {"cuDeviceGet", OWN(cuDeviceGet)},
    {"cuDevicePrimaryCtxRetain", OWN(cuDevicePrimaryCtxRetain)},
    {"cuDevicePrimaryCtxRelease_v2", OWN(cuDevicePrimaryCtxRelease)},
    {"cuCtxSetCurrent", OWN(cuCtxSetCurrent)},
    {"cuGetErrorString", OWN(cuGetErrorString)},
    {"cuModuleLoadData", G(module_load)},
    {"cuModuleUnload", G(module_unload)},
    {"cuModuleGetFunction", G(get_function)},
    {"cuFuncSetAttribute", G(func_set_attribute)},
    {"cuMemAlloc_v2", OWN(cuMemAlloc)},
    {"cuMemFree_v2", OWN(cuMemFree)},
    {"cuMemcpyHtoDAsync_v2", OWN(cuMemcpyHtoDAsync)},
    {"cuMemcpyDtoHAsync_v2", OWN(cuMemcpyDtoHAsync)},
    {"cuMemcpyDtoDAsync_v2", OWN(cuMemcpyDtoDAsync)},
    {"cuStreamCreate", G(stream_create)},
    {"cuStreamDestroy_v2", G(stream_destroy)},
    {"cuStreamSynchronize", G(stream_sync)},
    {"cuLaunchKernel", G(launch)},
    {"cuLaunchKernelEx", OWN(cuLaunchKernelEx)},
    {"cuStreamBeginCapture_v2", G(capture_begin)},
    {"cuStreamEndCapture", G(capture_end)},
    {"cuGraphInstantiateWithFlags", OWN(cuGraphInstantiateWithFlags)},
    {"cuGraphLaunch", G(graph_launch)},
    {"cuGraphExecDestroy", G(graph_exec_destroy)},
    {"cuGraphDestroy", G(graph_destroy)},
    {"cuMemHostAlloc", G(host_alloc)},
    {"cuMemFreeHost", G(host_free)},
    {"cuEventCreate", G(event_create)},
    {"cuEventRecord", G(event_record)},
    {"cuEventSynchronize", G(event_sync)},
    {"cuEventDestroy_v2", G(event_destroy)},
    {"cuIpcGetMemHandle", OWN(cuIpcGetMemHandle)},
    {"cuIpcOpenMemHandle_v2", OWN(cuIpcOpenMemHandle)},
    {"cuIpcCloseMemHandle", OWN(cuIpcCloseMemHandle)},
    {NULL, 0}};

/* 48 KiB is the default dynamic shared memory of a block on every NVIDIA GPU; more (sm_90: up to 227 KiB)
 * needs the opt-in. */
static const gpu_api CUDA = {.name = "cuda", .default_lib = "libcuda.so.1", .comm_lib = "libnccl.so.2",
                             .state_size = sizeof(cu_t),
                             .syms = SYMS, .stream_flags = CU_STREAM_NON_BLOCKING,
                             .capture_mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, .shared_default = 48 * 1024,
                             .shared_attribute = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             .device_open = cu_device_open, .device_close = cu_device_close,
                             .make_current = cu_make_current,
                             .error_string = cu_error_string, .mem_alloc = cu_alloc, .mem_free = cu_free,
                             .h2d = cu_h2d, .d2h = cu_d2h, .d2d = cu_d2d, .graph_instantiate = cu_instantiate,
                             .launch_pdl = cu_launch_pdl, .sym_alloc = cu_alloc, .ipc_handle = cu_ipc_handle,
                             .ipc_open = cu_ipc_open, .ipc_close = cu_ipc_close};

int v4drv_cuda_open(v4drv *d, const char *lib) { return gpu_open(d, &CUDA, lib); }
