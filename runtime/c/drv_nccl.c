/* NCCL (CUDA) and RCCL (HIP) for the GPU drivers: the library opened with dlopen (the two share one API),
 * one communicator per group size of the layout, each collective enqueued on the runtime's stream, so that
 * a stream capture records it into the graph like a kernel. Errors carry the library's own text. */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define MAX_GROUPS 8
#define NCCL_INT64 4 /* ncclDataType_t */
#define NCCL_FLOAT32 7
#define NCCL_BFLOAT16 9
#define NCCL_SUM 0 /* ncclRedOp_t */

typedef struct {
    char internal[V4RT_COMM_ID_BYTES];
} nccl_id;

struct v4comm {
    void *lib;
    uint32_t n, sizes[MAX_GROUPS];
    void *comm[MAX_GROUPS];
    int (*get_unique_id)(nccl_id *);
    int (*init_rank)(void **, int, nccl_id, int);
    int (*destroy)(void *);
    int (*all_reduce)(const void *, void *, size_t, int, int, void *, void *);
    int (*all_gather)(const void *, void *, size_t, int, void *, void *);
    /* optional (data parallel: reduce_scatter_rows); NULL where the library lacks it */
    int (*reduce_scatter)(const void *, void *, size_t, int, int, void *, void *);
    const char *(*error_string)(int);
};

static int check(v4comm *c, int r, const char *what) {
    if (!r) return 0;
    const char *s = c->error_string ? c->error_string(r) : NULL;
    v4rt_seterr("collectives: %s failed with error %d (%s)", what, r, s ? s : "no description");
    return 1;
}

/* The library and its symbols into a new v4comm (NULL and the error set on failure). */
static v4comm *load(const char *lib) {
    v4comm *c = calloc(1, sizeof *c);
    if (!c) {
        v4rt_seterr("out of host memory");
        return NULL;
    }
    c->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        const char *e = dlerror();
        v4rt_seterr("collectives: cannot open the library %s: %s", lib, e ? e : "unknown error");
        free(c);
        return NULL;
    }
    struct {
        const char *name;
        void *at;
    } syms[] = {{"ncclGetUniqueId", &c->get_unique_id}, {"ncclCommInitRank", &c->init_rank},
                {"ncclCommDestroy", &c->destroy},      {"ncclAllReduce", &c->all_reduce},
                {"ncclAllGather", &c->all_gather},      {"ncclGetErrorString", &c->error_string}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(c->lib, syms[i].name);
        if (!p) {
            v4rt_seterr("collectives: symbol %s missing from %s", syms[i].name, lib);
            v4comm_close(c);
            return NULL;
        }
        memcpy(syms[i].at, &p, sizeof p); /* POSIX: a function's address fits a void * */
    }
    void *rs = dlsym(c->lib, "ncclReduceScatter");
    if (rs) memcpy(&c->reduce_scatter, &rs, sizeof rs);
    return c;
}

int v4comm_unique_id(const char *lib, unsigned char *id) {
    v4comm *c = load(lib);
    if (!c) return 1;
    nccl_id u;
    int bad = check(c, c->get_unique_id(&u), "ncclGetUniqueId");
    if (!bad) memcpy(id, u.internal, sizeof u.internal);
    v4comm_close(c);
    return bad;
}

int v4comm_open(v4comm **out, const char *lib, uint32_t rank, uint32_t n, const uint32_t *sizes,
                const unsigned char *ids) {
    if (n == 0 || n > MAX_GROUPS) {
        v4rt_seterr("collectives: %u group sizes (expected 1 to %d)", n, MAX_GROUPS);
        return 1;
    }
    v4comm *c = load(lib);
    if (!c) return 1;
    for (uint32_t i = 0; i < n; i++) {
        if (sizes[i] == 0 || sizes[i] > 1u << 16) {
            v4rt_seterr("collectives: group size %u out of range", sizes[i]);
            v4comm_close(c);
            return 1;
        }
        nccl_id u;
        memcpy(u.internal, ids + (size_t)i * V4RT_COMM_ID_BYTES, sizeof u.internal);
        c->sizes[i] = sizes[i];
        if (check(c, c->init_rank(&c->comm[i], (int)sizes[i], u, (int)(rank % sizes[i])), "ncclCommInitRank")) {
            v4comm_close(c);
            return 1;
        }
        c->n = i + 1;
    }
    *out = c;
    return 0;
}

int v4comm_run(v4comm *c, const char *op, uint32_t group, uint32_t dtype, uint64_t count, uint64_t send,
               uint64_t recv, void *stream) {
    void *comm = NULL;
    for (uint32_t i = 0; c && i < c->n; i++)
        if (c->sizes[i] == group) comm = c->comm[i];
    if (!comm) {
        v4rt_seterr("collectives: no communicator for groups of %u ranks (v4rt_comm_init first)", group);
        return 1;
    }
    int type = dtype == V4RT_BF16 ? NCCL_BFLOAT16 : dtype == V4RT_I64 ? NCCL_INT64 : NCCL_FLOAT32;
    if (strcmp(op, "reduce_scatter_rows") == 0) {
        /* `count`: the operand's elements; each rank receives its 1 / group of them (rows: contiguous) */
        if (!c->reduce_scatter) {
            v4rt_seterr("collectives: ncclReduceScatter missing from the library (reduce_scatter_rows)");
            return 1;
        }
        return check(c, c->reduce_scatter((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count / group, type,
                                          NCCL_SUM, comm, stream), "ncclReduceScatter");
    }
    if (strcmp(op, "all_reduce") == 0)
        return check(c, c->all_reduce((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, type, NCCL_SUM,
                                      comm, stream), "ncclAllReduce");
    return check(c, c->all_gather((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, type, comm, stream),
                 "ncclAllGather");
}

void v4comm_close(v4comm *c) {
    if (!c) return;
    for (uint32_t i = 0; i < c->n; i++)
        if (c->comm[i]) c->destroy(c->comm[i]);
    if (c->lib) dlclose(c->lib);
    free(c);
}
