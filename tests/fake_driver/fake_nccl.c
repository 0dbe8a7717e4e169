/* A fake NCCL (libnccl.so.2's symbols the C runtime dlopens, drv_nccl.c) for the tests, on top of the fake
 * CUDA driver (fake_driver.c -DFAKE_CUDA): like the real library, each collective is a kernel launched on
 * the caller's stream, so a stream capture records it into the graph and every replay runs it again. The
 * kernels come from a code object loaded when a communicator is created (FAKE_NCCL_DRIVER names the fake
 * driver library, loaded already by the runtime: the same instance); each takes the send and receive
 * pointers, which the fake driver checks lie in live allocations. Recorded here, in call order (the order
 * of capture): every communicator (ranks, rank, id) and every collective (op, count, dtype, send, recv,
 * the communicator's ranks, the stream), read by the test through fake_nccl_* functions. What the real
 * library refuses is refused: an unknown communicator or data type, a rank outside the communicator. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXCOMM 16
#define MAXCALL 100000
#define NCCL_INVALID_ARGUMENT 4
#define NCCL_SYSTEM_ERROR 2

typedef struct {
    char internal[128];
} nccl_id;

typedef struct {
    int nranks, rank;
    unsigned char id[8];
} comm;

typedef struct {
    char op[16];
    uint64_t count, send, recv;
    int dtype, nranks;
    void *stream;
} call;

static comm g_comm[MAXCOMM];
static int g_ncomm, g_ids;
static call g_call[MAXCALL];
static long g_ncall;
static void *g_fn[2]; /* the fake kernels: all_reduce, all_gather */
static int (*g_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                       void **);

int ncclGetUniqueId(nccl_id *id) {
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "fake-nccl-id-%d", ++g_ids);
    return 0;
}

static int kernels(void) {
    if (g_fn[0]) return 0;
    const char *path = getenv("FAKE_NCCL_DRIVER");
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (!lib) return NCCL_SYSTEM_ERROR;
    int (*load)(void **, const void *) = (int (*)(void **, const void *))dlsym(lib, "cuModuleLoadData");
    int (*getfn)(void **, void *, const char *) = (int (*)(void **, void *, const char *))dlsym(lib, "cuModuleGetFunction");
    *(void **)&g_launch = dlsym(lib, "cuLaunchKernel");
    void *m = NULL;
    int bad = !load || !getfn || !g_launch || load(&m, "FAKE\n@nccl\nncclAllReduce 2\nncclAllGather 2\n") ||
              getfn(&g_fn[0], m, "ncclAllReduce") || getfn(&g_fn[1], m, "ncclAllGather");
    dlclose(lib); /* the runtime keeps it loaded */
    return bad ? NCCL_SYSTEM_ERROR : 0;
}

int ncclCommInitRank(void **out, int nranks, nccl_id id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks || g_ncomm == MAXCOMM) return NCCL_INVALID_ARGUMENT;
    int r = kernels();
    if (r) return r;
    comm *c = &g_comm[g_ncomm++];
    c->nranks = nranks;
    c->rank = rank;
    memcpy(c->id, id.internal, sizeof c->id);
    *out = c;
    return 0;
}

int ncclCommDestroy(void *c) { return c ? 0 : NCCL_INVALID_ARGUMENT; }

const char *ncclGetErrorString(int r) {
    return r == NCCL_INVALID_ARGUMENT ? "invalid argument" : r == NCCL_SYSTEM_ERROR ? "system error" : "unknown";
}

static int run(int which, const char *op, uint64_t send, uint64_t recv, size_t count, int dtype, void *cm,
               void *stream) {
    comm *c = cm;
    if (!c || c < g_comm || c >= g_comm + g_ncomm || (dtype != 7 && dtype != 9) || !count)
        return NCCL_INVALID_ARGUMENT;
    void *args[2] = {&send, &recv};
    if (g_launch(g_fn[which], 1, 1, 1, 1, 1, 1, 0, stream, args, NULL)) return NCCL_SYSTEM_ERROR;
    if (g_ncall < MAXCALL) {
        call *k = &g_call[g_ncall++];
        *k = (call){.count = count, .send = send, .recv = recv, .dtype = dtype, .nranks = c->nranks, .stream = stream};
        snprintf(k->op, sizeof k->op, "%s", op);
    }
    return 0;
}

int ncclAllReduce(const void *s, void *r, size_t n, int dtype, int redop, void *c, void *stream) {
    if (redop != 0) return NCCL_INVALID_ARGUMENT; /* the runtime only sums */
    return run(0, "all_reduce", (uint64_t)(uintptr_t)s, (uint64_t)(uintptr_t)r, n, dtype, c, stream);
}

int ncclAllGather(const void *s, void *r, size_t n, int dtype, void *c, void *stream) {
    return run(1, "all_gather", (uint64_t)(uintptr_t)s, (uint64_t)(uintptr_t)r, n, dtype, c, stream);
}

/* ---- the test's view ---- */
void fake_nccl_reset(void) { g_ncomm = g_ids = 0, g_ncall = 0; }
long fake_nccl_calls(void) { return g_ncall; }
/* The i-th collective: its op into `op`, and count, dtype, send, recv, the communicator's ranks. */
int fake_nccl_call(long i, char *op, uint64_t out[5]) {
    if (i < 0 || i >= g_ncall) return -1;
    snprintf(op, 16, "%s", g_call[i].op);
    uint64_t v[5] = {g_call[i].count, (uint64_t)g_call[i].dtype, g_call[i].send, g_call[i].recv,
                     (uint64_t)g_call[i].nranks};
    memcpy(out, v, sizeof v);
    return 0;
}
/* The i-th communicator: ranks, rank, and the first bytes of its id. */
int fake_nccl_comm(int i, long out[2], char *id) {
    if (i < 0 || i >= g_ncomm) return -1;
    out[0] = g_comm[i].nranks;
    out[1] = g_comm[i].rank;
    memcpy(id, g_comm[i].id, 8);
    return 0;
}
int fake_nccl_comms(void) { return g_ncomm; }
