/* The one flow of the GPU drivers (internal to the library): drv_gpu.c runs it for HIP and CUDA alike; a
 * driver file gives only its gpu_api, that is its symbol table and the few adapters where the two APIs
 * differ in signature (device set-up, allocation, copies, graph instantiation, error text). */
#ifndef V4RT_DRV_GPU_H
#define V4RT_DRV_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "driver.h"

typedef struct gpu_api gpu_api;

/* Large host-to-device writes go through pinned staging buffers (drv_gpu.c g_h2d): a copy from pinned
 * memory runs at the link's speed and asynchronously, while one from pageable memory is staged by the driver
 * on the calling thread. Overridable with -D (the tests build a runtime with small buffers). */
#ifndef V4RT_STAGE_COUNT
#define V4RT_STAGE_COUNT 2
#endif
#ifndef V4RT_STAGE_BYTES
#define V4RT_STAGE_BYTES (16u << 20)
#endif
#ifndef V4RT_STAGE_MIN /* the smallest write that allocates the staging buffers */
#define V4RT_STAGE_MIN (1u << 20)
#endif

/* A driver's state starts with this. The entry points here have the same C signature on both drivers
 * (errors are ints, 0 = success; handles are pointers); the driver's own ones follow in its state. */
typedef struct {
    const gpu_api *api;
    void *lib;
    void *stream;
    v4comm *comm; /* NCCL / RCCL communicators (v4rt_comm_init), NULL until joined */
    int (*init)(unsigned flags);
    int (*stream_create)(void **stream, unsigned flags);
    int (*stream_destroy)(void *stream);
    int (*stream_sync)(void *stream);
    int (*module_load)(void **module, const void *image);
    int (*module_unload)(void *module);
    int (*get_function)(void **fn, void *module, const char *symbol);
    int (*func_set_attribute)(void *fn, int attribute, int value);
    int (*launch)(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned shared, void *stream, void **params, void **extra);
    int (*capture_begin)(void *stream, int mode);
    int (*capture_end)(void *stream, void **graph);
    int (*graph_launch)(void *exec, void *stream);
    int (*graph_exec_destroy)(void *exec);
    int (*graph_destroy)(void *graph);
    int (*host_alloc)(void **p, size_t nbytes, unsigned flags); /* pinned (page-locked) host memory */
    int (*host_free)(void *p);
    int (*event_create)(void **event, unsigned flags);
    int (*event_record)(void *event, void *stream);
    int (*event_sync)(void *event);
    int (*event_destroy)(void *event);
    /* The staged upload (drv_gpu.c g_h2d): pinned buffers filled in turn, each with the event recorded
     * after its last copy was enqueued, so it is refilled only once those copies have read it. */
    unsigned char *stage[V4RT_STAGE_COUNT];
    void *stage_done[V4RT_STAGE_COUNT];
    unsigned stage_cur;  /* the buffer being filled */
    uint64_t stage_fill; /* its bytes already handed to copies */
    int staging;         /* the buffers exist (from the first large write until close) */
    int pending;         /* staged copies may still be reading them (until the stream is synchronised) */
} gpu;

/* A driver symbol and the offset, in the driver's state, of the entry point it fills. */
typedef struct {
    const char *symbol;
    size_t offset;
} gpu_sym;

struct gpu_api {
    const char *name;        /* "hip" / "cuda": the v4drv name and the prefix of its errors */
    const char *default_lib; /* the system's driver library */
    const char *comm_lib;    /* the system's collective library (NCCL / RCCL) */
    size_t state_size;       /* the driver's state struct (a gpu first) */
    const gpu_sym *syms;     /* every entry point to resolve, in this order; ends with {NULL, 0} */
    unsigned stream_flags;   /* a non-blocking stream */
    int capture_mode;        /* thread-local stream capture */
    uint32_t shared_default; /* dynamic shared bytes a kernel may use without opting in */
    int shared_attribute;    /* the function attribute that raises that limit for one kernel */
    /* The adapters: each returns 0, or sets the error (gpu_check) and returns nonzero. */
    int (*device_open)(gpu *g);   /* after init: device 0 (CUDA: its primary context made current) */
    void (*device_close)(gpu *g); /* may be NULL; undoes what a full or partial device_open did */
    int (*make_current)(gpu *g);  /* may be NULL; the device current on the calling thread (CUDA: context) */
    const char *(*error_string)(gpu *g, int r); /* NULL: no description */
    int (*mem_alloc)(gpu *g, uint64_t nbytes, uint64_t *addr);
    int (*mem_free)(gpu *g, uint64_t addr);
    int (*h2d)(gpu *g, uint64_t dst, const void *src, uint64_t nbytes); /* enqueued on g->stream */
    int (*d2h)(gpu *g, void *dst, uint64_t src, uint64_t nbytes);      /* enqueued on g->stream */
    int (*d2d)(gpu *g, uint64_t dst, uint64_t src, uint64_t nbytes);   /* enqueued on g->stream */
    int (*graph_instantiate)(gpu *g, void **exec, void *graph);
    /* A launch with programmatic stream serialization (args: the kernel's parameter pointers), enqueued on
     * g->stream; NULL: the driver has no programmatic dependent launch (HIP), and such a launch is refused. */
    int (*launch_pdl)(gpu *g, void *fn, const uint32_t grid[3], const uint32_t block[3], uint32_t shared,
                      void **args);
    /* Symmetric memory (v4rt.h V4RT_KIND_SYMMETRIC, freed with mem_free) and its IPC: memory a peer process
     * maps, its handle (V4RT_IPC_HANDLE_BYTES), a peer's handle mapped here, and unmapped. */
    int (*sym_alloc)(gpu *g, uint64_t nbytes, uint64_t *addr);
    int (*ipc_handle)(gpu *g, uint64_t addr, unsigned char *handle);
    int (*ipc_open)(gpu *g, const unsigned char *handle, uint64_t *addr);
    int (*ipc_close)(gpu *g, uint64_t addr);
};

int gpu_open(v4drv *d, const gpu_api *api, const char *lib);

/* r = 0: 0. Else sets "<driver>: <what> failed with error <r> (<driver's text>)" and returns 1; a
 * versioned symbol's "_v2" is left out of <what>. */
int gpu_check(gpu *g, int r, const char *what);

#endif
