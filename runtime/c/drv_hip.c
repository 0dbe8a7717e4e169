/* HIP driver: libamdhip64 through the shared GPU flow (drv_gpu.c); here its symbols and what differs. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "drv_gpu.h"

#define HIP_MEMCPY_H2D 1
#define HIP_MEMCPY_D2H 2
#define HIP_MEMCPY_D2D 3
#define HIP_CAPTURE_MODE_THREAD_LOCAL 1
#define HIP_STREAM_NON_BLOCKING 1
#define HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_MEMORY_SIZE 8
/* hip_runtime_api.h: fine-grained memory that bypasses the caches, so a flag stored by one GPU is seen by a
 * peer polling it (vLLM's custom all-reduce allocates its IPC-shared buffers so on ROCm, "uncached for signal
 * on MI200": csrc/custom_all_reduce.cu, allocate_shared_buffer_and_handle, then hipIpcGetMemHandle). */
#define HIP_DEVICE_MALLOC_UNCACHED 0x3
#define HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
typedef struct {
    char reserved[64];
} hipIpcMemHandle_t; /* passed by value to hipIpcOpenMemHandle */
_Static_assert(sizeof(hipIpcMemHandle_t) == V4RT_IPC_HANDLE_BYTES, "hipIpcMemHandle_t as in hip_runtime_api.h");

typedef struct {
    gpu g;
    int (*hipSetDevice)(int);
    const char *(*hipGetErrorString)(int);
    int (*hipMalloc)(void **, size_t);
    int (*hipFree)(void *);
    int (*hipMemcpyAsync)(void *, const void *, size_t, int, void *);
    int (*hipGraphInstantiate)(void **, void *, void **, char *, size_t);
    int (*hipExtMallocWithFlags)(void **, size_t, unsigned);
    int (*hipIpcGetMemHandle)(hipIpcMemHandle_t *, void *);
    int (*hipIpcOpenMemHandle)(void **, hipIpcMemHandle_t, unsigned);
    int (*hipIpcCloseMemHandle)(void *);
} hip_t;

static hip_t *H(gpu *g) { return (hip_t *)g; }

static int hip_device_open(gpu *g) { return gpu_check(g, H(g)->hipSetDevice(0), "hipSetDevice"); }
static const char *hip_error_string(gpu *g, int r) {
    return H(g)->hipGetErrorString ? H(g)->hipGetErrorString(r) : NULL;
}
static int hip_alloc(gpu *g, uint64_t n, uint64_t *addr) {
    void *p = NULL;
    if (gpu_check(g, H(g)->hipMalloc(&p, (size_t)n), "hipMalloc")) return 1;
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}
static int hip_free(gpu *g, uint64_t addr) { return gpu_check(g, H(g)->hipFree((void *)(uintptr_t)addr), "hipFree"); }
static int hip_h2d(gpu *g, uint64_t dst, const void *src, uint64_t n) {
    int r = H(g)->hipMemcpyAsync((void *)(uintptr_t)dst, src, (size_t)n, HIP_MEMCPY_H2D, g->stream);
    return gpu_check(g, r, "hipMemcpyAsync(H2D)");
}
static int hip_d2h(gpu *g, void *dst, uint64_t src, uint64_t n) {
    int r = H(g)->hipMemcpyAsync(dst, (const void *)(uintptr_t)src, (size_t)n, HIP_MEMCPY_D2H, g->stream);
    return gpu_check(g, r, "hipMemcpyAsync(D2H)");
}
static int hip_d2d(gpu *g, uint64_t dst, uint64_t src, uint64_t n) {
    int r = H(g)->hipMemcpyAsync((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n, HIP_MEMCPY_D2D,
                                 g->stream);
    return gpu_check(g, r, "hipMemcpyAsync(D2D)");
}
static int hip_instantiate(gpu *g, void **exec, void *graph) {
    return gpu_check(g, H(g)->hipGraphInstantiate(exec, graph, NULL, NULL, 0), "hipGraphInstantiate");
}

static int hip_sym_alloc(gpu *g, uint64_t n, uint64_t *addr) {
    void *p = NULL;
    if (gpu_check(g, H(g)->hipExtMallocWithFlags(&p, (size_t)n, HIP_DEVICE_MALLOC_UNCACHED), "hipExtMallocWithFlags"))
        return 1;
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}
static int hip_ipc_handle(gpu *g, uint64_t addr, unsigned char *handle) {
    hipIpcMemHandle_t h;
    if (gpu_check(g, H(g)->hipIpcGetMemHandle(&h, (void *)(uintptr_t)addr), "hipIpcGetMemHandle")) return 1;
    memcpy(handle, &h, sizeof h);
    return 0;
}
static int hip_ipc_open(gpu *g, const unsigned char *handle, uint64_t *addr) {
    hipIpcMemHandle_t h;
    void *p = NULL;
    memcpy(&h, handle, sizeof h);
    if (gpu_check(g, H(g)->hipIpcOpenMemHandle(&p, h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "hipIpcOpenMemHandle"))
        return 1;
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}
static int hip_ipc_close(gpu *g, uint64_t addr) {
    return gpu_check(g, H(g)->hipIpcCloseMemHandle((void *)(uintptr_t)addr), "hipIpcCloseMemHandle");
}

#define G(field) offsetof(hip_t, g.field)
#define OWN(field) offsetof(hip_t, field)
static const gpu_sym SYMS[] = {
    {"hipInit", G(init)},
    {"hipSetDevice", OWN(hipSetDevice)},
    {"hipGetErrorString", OWN(hipGetErrorString)},
    {"hipModuleLoadData", G(module_load)},
    {"hipModuleUnload", G(module_unload)},
    {"hipModuleGetFunction", G(get_function)},
    {"hipFuncSetAttribute", G(func_set_attribute)},
    {"hipMalloc", OWN(hipMalloc)},
    {"hipFree", OWN(hipFree)},
    {"hipMemcpyAsync", OWN(hipMemcpyAsync)},
    {"hipStreamCreateWithFlags", G(stream_create)},
    {"hipStreamDestroy", G(stream_destroy)},
    {"hipStreamSynchronize", G(stream_sync)},
    {"hipModuleLaunchKernel", G(launch)},
    {"hipStreamBeginCapture", G(capture_begin)},
    {"hipStreamEndCapture", G(capture_end)},
    {"hipGraphInstantiate", OWN(hipGraphInstantiate)},
    {"hipGraphLaunch", G(graph_launch)},
    {"hipGraphExecDestroy", G(graph_exec_destroy)},
    {"hipGraphDestroy", G(graph_destroy)},
    {"hipHostMalloc", G(host_alloc)},
    {"hipHostFree", G(host_free)},
    {"hipEventCreateWithFlags", G(event_create)},
    {"hipEventRecord", G(event_record)},
    {"hipEventSynchronize", G(event_sync)},
    {"hipEventDestroy", G(event_destroy)},
    {"hipExtMallocWithFlags", OWN(hipExtMallocWithFlags)},
    {"hipIpcGetMemHandle", OWN(hipIpcGetMemHandle)},
    {"hipIpcOpenMemHandle", OWN(hipIpcOpenMemHandle)},
    {"hipIpcCloseMemHandle", OWN(hipIpcCloseMemHandle)},
    {NULL, 0}};

/* 64 KiB of LDS per workgroup is every AMD GPU's; above it (gfx950: up to 160 KiB) the kernel is opted in as
 * on CUDA, and HIP checks the amount against the device's LDS then rather than at the first launch. */
static const gpu_api HIP = {.name = "hip", .default_lib = "libamdhip64.so", .comm_lib = "librccl.so",
                            .state_size = sizeof(hip_t),
                            .syms = SYMS, .stream_flags = HIP_STREAM_NON_BLOCKING,
                            .capture_mode = HIP_CAPTURE_MODE_THREAD_LOCAL, .shared_default = 64 * 1024,
                            .shared_attribute = HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_MEMORY_SIZE,
                            .device_open = hip_device_open, .error_string = hip_error_string,
                            .mem_alloc = hip_alloc, .mem_free = hip_free, .h2d = hip_h2d, .d2h = hip_d2h, .d2d = hip_d2d,
                            .graph_instantiate = hip_instantiate, .sym_alloc = hip_sym_alloc,
                            .ipc_handle = hip_ipc_handle, .ipc_open = hip_ipc_open, .ipc_close = hip_ipc_close};

int v4drv_hip_open(v4drv *d, const char *lib) { return gpu_open(d, &HIP, lib); }
