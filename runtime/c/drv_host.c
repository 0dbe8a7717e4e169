/* Host driver: buffers in host memory; every kernel call goes to a callback (Python runs the kernel).
 * Capture records the calls (with their parameters) instead of running them; a graph launch runs the
 * recorded list, the same contract as stream capture on a GPU. Symmetric memory (the one-shot all-reduce's
 * region) is POSIX shared memory: a memfd mapped MAP_SHARED, whose handle is its path under /proc (the
 * owner's pid and fd: nothing to unlink, gone with the last mapping); a peer opens the path and maps it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"

typedef struct {
    uint64_t tag;
    uint32_t n;
    uint64_t *params;
} rec_t;

typedef struct {
    uint32_t n, cap;
    rec_t *recs;
} hgraph;

typedef struct {
    uint64_t addr, nbytes;
    int fd; /* -1: a peer's mapping (no fd kept) */
} hmap;

typedef struct {
    v4rt_host_kernel cb;
    void *user;
    hgraph *capturing;
    int failed; /* a launch failed while capturing */
    hmap *maps; /* symmetric memory: this process's own regions and the peers' it mapped */
    uint32_t n_maps, cap_maps;
} hstate;

static hmap *h_find(hstate *s, uint64_t addr) {
    for (uint32_t i = 0; i < s->n_maps; i++)
        if (s->maps[i].addr == addr) return &s->maps[i];
    return NULL;
}

static int h_add_map(hstate *s, uint64_t addr, uint64_t nbytes, int fd) {
    if (s->n_maps == s->cap_maps) {
        uint32_t cap = s->cap_maps ? 2 * s->cap_maps : 8;
        hmap *m = realloc(s->maps, cap * sizeof(hmap));
        if (!m) {
            v4rt_seterr("out of host memory");
            return 1;
        }
        s->maps = m;
        s->cap_maps = cap;
    }
    s->maps[s->n_maps++] = (hmap){addr, nbytes, fd};
    return 0;
}

static void h_drop_map(hstate *s, hmap *m) {
    munmap((void *)(uintptr_t)m->addr, m->nbytes);
    if (m->fd >= 0) close(m->fd);
    *m = s->maps[--s->n_maps];
}

static int h_sym_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    hstate *s = d->state;
    int fd = memfd_create("v4rt-symmetric", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)n) != 0) {
        v4rt_seterr("symmetric memory of %llu bytes: %s failed: %s", (unsigned long long)n,
                    fd < 0 ? "memfd_create" : "ftruncate", strerror(errno));
        if (fd >= 0) close(fd);
        return 1;
    }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        v4rt_seterr("symmetric memory of %llu bytes: mmap failed: %s", (unsigned long long)n, strerror(errno));
        close(fd);
        return 1;
    }
    if (h_add_map(s, (uint64_t)(uintptr_t)p, n, fd)) {
        munmap(p, n);
        close(fd);
        return 1;
    }
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}

static int h_sym_free(v4drv *d, uint64_t addr) {
    hstate *s = d->state;
    hmap *m = h_find(s, addr);
    if (!m || m->fd < 0) {
        v4rt_seterr("freeing %#llx: not symmetric memory of this process", (unsigned long long)addr);
        return 1;
    }
    h_drop_map(s, m);
    return 0;
}

static int h_ipc_handle(v4drv *d, uint64_t addr, unsigned char *handle) {
    hstate *s = d->state;
    hmap *m = h_find(s, addr);
    if (!m || m->fd < 0) {
        v4rt_seterr("exporting %#llx: not symmetric memory of this process", (unsigned long long)addr);
        return 1;
    }
    snprintf((char *)handle, V4RT_IPC_HANDLE_BYTES, "/proc/%ld/fd/%d", (long)getpid(), m->fd);
    return 0;
}

static int h_ipc_open(v4drv *d, const unsigned char *handle, uint64_t n, uint64_t *addr) {
    hstate *s = d->state;
    char path[V4RT_IPC_HANDLE_BYTES];
    memcpy(path, handle, sizeof path);
    path[sizeof path - 1] = 0;
    if (strncmp(path, "/proc/", 6) != 0) {
        v4rt_seterr("a host IPC handle is a /proc/<pid>/fd/<fd> path, found '%.40s'", path);
        return 1;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        v4rt_seterr("opening the peer's region %s (%llu bytes) failed: %s", path, (unsigned long long)n,
                    strerror(errno));
        if (fd >= 0) close(fd);
        return 1;
    }
    if ((uint64_t)st.st_size < n) {
        v4rt_seterr("the peer's region %s has %lld bytes, expected at least %llu", path, (long long)st.st_size,
                    (unsigned long long)n);
        close(fd);
        return 1;
    }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        v4rt_seterr("mapping the peer's region %s failed: %s", path, strerror(err));
        return 1;
    }
    if (h_add_map(s, (uint64_t)(uintptr_t)p, n, -1)) {
        munmap(p, n);
        return 1;
    }
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}

static int h_ipc_close(v4drv *d, uint64_t addr) {
    hstate *s = d->state;
    hmap *m = h_find(s, addr);
    if (!m || m->fd >= 0) {
        v4rt_seterr("closing %#llx: not a peer's region mapped here", (unsigned long long)addr);
        return 1;
    }
    h_drop_map(s, m);
    return 0;
}

static int h_alloc(v4drv *d, uint64_t n, uint64_t *addr) {
    (void)d;
    uint64_t rounded = (n + 255) & ~(uint64_t)255;
    void *p = aligned_alloc(256, rounded);
    if (!p) {
        v4rt_seterr("host allocation of %llu bytes failed", (unsigned long long)n);
        return 1;
    }
    *addr = (uint64_t)(uintptr_t)p;
    return 0;
}

static int h_free(v4drv *d, uint64_t addr) {
    (void)d;
    free((void *)(uintptr_t)addr);
    return 0;
}

static int h_h2d(v4drv *d, uint64_t dst, const void *src, uint64_t n) {
    (void)d;
    memcpy((void *)(uintptr_t)dst, src, n);
    return 0;
}

static int h_d2h(v4drv *d, void *dst, uint64_t src, uint64_t n) {
    (void)d;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return 0;
}

static int h_module_load(v4drv *d, const void *image, uint64_t size, void **module) {
    (void)d;
    (void)image;
    (void)size;
    *module = (void *)(uintptr_t)1; /* host code objects are placeholders: the callback runs the kernel */
    return 0;
}

static int h_module_unload(v4drv *d, void *module) {
    (void)d;
    (void)module;
    return 0;
}

static int h_get_function(v4drv *d, void *module, const char *symbol, void **fn) {
    (void)d;
    (void)module;
    *fn = (void *)symbol;
    return 0;
}

static int h_run(hstate *s, uint64_t tag, uint32_t n, const uint64_t *params) {
    if (s->cb(s->user, (uint32_t)(tag >> 32), (uint32_t)tag, n, params)) {
        v4rt_seterr("the host kernel callback failed");
        return 1;
    }
    return 0;
}

static int h_launch(v4drv *d, void *fn, const uint32_t grid[3], const uint32_t block[3], uint32_t shared,
                    uint32_t n, const uint64_t *params, uint64_t tag, uint32_t flags) {
    (void)fn;
    (void)flags; /* the host runs calls one after another: every launch is already serialised */
    (void)grid;
    (void)block;
    (void)shared;
    hstate *s = d->state;
    hgraph *g = s->capturing;
    if (!g) return h_run(s, tag, n, params);
    if (g->n == g->cap) {
        uint32_t cap = g->cap ? 2 * g->cap : 64;
        rec_t *r = realloc(g->recs, cap * sizeof(rec_t));
        if (!r) {
            s->failed = 1;
            v4rt_seterr("out of host memory recording a graph");
            return 1;
        }
        g->recs = r;
        g->cap = cap;
    }
    rec_t *r = &g->recs[g->n];
    r->tag = tag;
    r->n = n;
    r->params = malloc((n ? n : 1) * sizeof(uint64_t));
    if (!r->params) {
        s->failed = 1;
        v4rt_seterr("out of host memory recording a graph");
        return 1;
    }
    memcpy(r->params, params, n * sizeof(uint64_t));
    g->n++;
    return 0;
}

/* A collective comes back to the callback like a kernel (its call's tag names it; the parameters are its
 * operand and result): the caller runs it (torch.distributed), recorded and replayed in a graph alike. */
static int h_collective(v4drv *d, const char *op, uint32_t group, uint32_t dtype, uint64_t count, uint64_t send,
                        uint64_t recv, uint64_t tag) {
    static const uint32_t one[3] = {1, 1, 1};
    const uint64_t params[2] = {send, recv};
    (void)op;
    (void)group;
    (void)dtype;
    (void)count;
    return h_launch(d, NULL, one, one, 0, 2, params, tag, 0);
}

/* A copy of the copy table: the callback checks it first (its bytes and order), then it is made. */
static int h_copy(v4drv *d, uint32_t kind, uint64_t dst, uint64_t src, uint64_t n, uint64_t tag) {
    hstate *s = d->state;
    if (s->capturing) {
        v4rt_seterr("a copy cannot be made during a capture");
        return 1;
    }
    const uint64_t params[4] = {dst, src, n, kind};
    if (h_run(s, tag, 4, params)) return 1;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return 0;
}

static void h_graph_free(hgraph *g) {
    for (uint32_t i = 0; i < g->n; i++) free(g->recs[i].params);
    free(g->recs);
    free(g);
}

static int h_capture_begin(v4drv *d) {
    hstate *s = d->state;
    if (s->capturing) {
        v4rt_seterr("a capture is already in progress");
        return 1;
    }
    s->capturing = calloc(1, sizeof(hgraph));
    s->failed = 0;
    if (!s->capturing) {
        v4rt_seterr("out of host memory starting a capture");
        return 1;
    }
    return 0;
}

static int h_capture_end(v4drv *d, void **graph) {
    hstate *s = d->state;
    hgraph *g = s->capturing;
    s->capturing = NULL;
    *graph = NULL;
    if (!g) {
        v4rt_seterr("no capture in progress");
        return 1;
    }
    if (s->failed) {
        h_graph_free(g);
        v4rt_seterr("a launch failed during capture");
        return 1;
    }
    *graph = g;
    return 0;
}

static int h_graph_launch(v4drv *d, void *graph) {
    hgraph *g = graph;
    for (uint32_t i = 0; i < g->n; i++)
        if (h_run(d->state, g->recs[i].tag, g->recs[i].n, g->recs[i].params)) return 1;
    return 0;
}

static int h_graph_destroy(v4drv *d, void *graph) {
    (void)d;
    h_graph_free(graph);
    return 0;
}

static int h_sync(v4drv *d) {
    (void)d;
    return 0;
}

static void h_shutdown(v4drv *d) {
    hstate *s = d->state;
    if (s && s->capturing) h_graph_free(s->capturing);
    while (s && s->n_maps) h_drop_map(s, &s->maps[0]);
    if (s) free(s->maps);
    free(s);
    d->state = NULL;
}

int v4drv_host_open(v4drv *d, v4rt_host_kernel cb, void *user) {
    hstate *s = calloc(1, sizeof *s);
    if (!s) {
        v4rt_seterr("out of host memory");
        return 1;
    }
    s->cb = cb;
    s->user = user;
    *d = (v4drv){.name = "host", .state = s, .mem_alloc = h_alloc, .mem_free = h_free, .h2d = h_h2d, .d2h = h_d2h,
                 .module_load = h_module_load, .module_unload = h_module_unload, .get_function = h_get_function,
                 .launch = h_launch, .copy = h_copy, .capture_begin = h_capture_begin, .capture_end = h_capture_end,
                 .graph_launch = h_graph_launch, .graph_destroy = h_graph_destroy, .sync = h_sync,
                 .collective = h_collective, .sym_alloc = h_sym_alloc, .sym_free = h_sym_free,
                 .ipc_handle = h_ipc_handle, .ipc_open = h_ipc_open, .ipc_close = h_ipc_close,
                 .shutdown = h_shutdown};
    return 0;
}
