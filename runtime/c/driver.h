/* The driver vtable the core runs on (internal to the library). Device addresses are uint64. */
#ifndef V4RT_DRIVER_H
#define V4RT_DRIVER_H

#include <stdint.h>

#include "v4rt.h"

typedef struct v4drv v4drv;

/* Launch flags. PDL: launch with programmatic stream serialization (CUDA on sm_90+), so the kernel may start
 * while the previous one finishes; only kernels that wait for it first (griddepcontrol.wait) carry it. */
#define V4DRV_LAUNCH_PDL 1u
#define V4DRV_LAUNCH_FLAGS V4DRV_LAUNCH_PDL /* every flag a table may set */
struct v4drv {
    const char *name;
    void *state;
    /* Every entry returns 0 on success, else sets the error text (v4rt_seterr) and returns nonzero. */
    int (*mem_alloc)(v4drv *d, uint64_t nbytes, uint64_t *addr);
    int (*mem_free)(v4drv *d, uint64_t addr);
    int (*h2d)(v4drv *d, uint64_t dst, const void *src, uint64_t nbytes);
    int (*d2h)(v4drv *d, void *dst, uint64_t src, uint64_t nbytes);
    int (*module_load)(v4drv *d, const void *image, uint64_t size, void **module);
    int (*module_unload)(v4drv *d, void *module);
    int (*get_function)(v4drv *d, void *module, const char *symbol, void **fn);
    /* Let fn take `shared` dynamic shared bytes per launch: called once per kernel, with the most any of
     * its calls uses, before any launch. NULL: nothing to do (the host driver). */
    int (*func_shared)(v4drv *d, void *fn, uint32_t shared);
    /* tag = function << 32 | call (only the host driver uses it); flags: V4DRV_LAUNCH_* (the table's call
     * flags) */
    int (*launch)(v4drv *d, void *fn, const uint32_t grid[3], const uint32_t block[3], uint32_t shared,
                  uint32_t n_params, const uint64_t *params, uint64_t tag, uint32_t flags);
    /* One copy of the copy table (v4rt.h, V4RT_COPY_*: kind SAVE device -> host, RESTORE host -> device,
     * DEVICE device -> device) on the runtime's stream, in order with the kernels; never during a capture.
     * tag = V4RT_COPY_CALL << 32 | range (the host driver hands it to the callback first). */
    int (*copy)(v4drv *d, uint32_t kind, uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t tag);
    int (*capture_begin)(v4drv *d);
    int (*capture_end)(v4drv *d, void **graph);
    int (*graph_launch)(v4drv *d, void *graph);
    int (*graph_destroy)(v4drv *d, void *graph);
    int (*sync)(v4drv *d);
    /* A collective call of the launch table (v4rt.h, V4RT_COLLECTIVE: op = its symbol) of `count` elements
     * of `dtype` from `send` into `recv` over this rank's group of `group` ranks, on the runtime's stream
     * (during a capture it is recorded into the graph). tag as for launch. NULL: the driver has none. */
    int (*collective)(v4drv *d, const char *op, uint32_t group, uint32_t dtype, uint64_t count, uint64_t send,
                      uint64_t recv, uint64_t tag);
    /* Join the communicators (v4rt_comm_init). NULL: the driver needs none (the host's callback has them). */
    int (*comm_init)(v4drv *d, const char *lib, uint32_t rank, uint32_t n, const uint32_t *sizes,
                     const unsigned char *ids);
    /* Symmetric memory (v4rt.h V4RT_KIND_SYMMETRIC): allocate memory a peer process can map, and free it; its
     * handle (V4RT_IPC_HANDLE_BYTES); map a peer's handle (`nbytes`: the region's size) and unmap it. NULL: the
     * driver has none (a table with a SYMMETRIC buffer is refused). */
    int (*sym_alloc)(v4drv *d, uint64_t nbytes, uint64_t *addr);
    int (*sym_free)(v4drv *d, uint64_t addr);
    int (*ipc_handle)(v4drv *d, uint64_t addr, unsigned char *handle);
    int (*ipc_open)(v4drv *d, const unsigned char *handle, uint64_t nbytes, uint64_t *addr);
    int (*ipc_close)(v4drv *d, uint64_t addr);
    /* Make the device usable from the calling thread (CUDA: its context current, as Triton's launchers do
     * per launch): the core calls it on entry to every public function. NULL: nothing to do. */
    int (*bind_thread)(v4drv *d);
    void (*shutdown)(v4drv *d);
};

void v4rt_seterr(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

int v4drv_host_open(v4drv *d, v4rt_host_kernel cb, void *user);
int v4drv_hip_open(v4drv *d, const char *lib);
int v4drv_cuda_open(v4drv *d, const char *lib);

/* NCCL / RCCL (drv_nccl.c), for the GPU drivers: the library's unique id, communicators per group size,
 * collectives enqueued on a stream; a comm is NULL until joined. */
typedef struct v4comm v4comm;
int v4comm_unique_id(const char *lib, unsigned char *id);
int v4comm_open(v4comm **out, const char *lib, uint32_t rank, uint32_t n, const uint32_t *sizes,
                const unsigned char *ids);
int v4comm_run(v4comm *c, const char *op, uint32_t group, uint32_t dtype, uint64_t count, uint64_t send,
               uint64_t recv, void *stream);
void v4comm_close(v4comm *c);

#endif
