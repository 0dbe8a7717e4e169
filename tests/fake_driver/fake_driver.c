/* A fake GPU driver for the C runtime's tests: the symbols of libcuda (-DFAKE_CUDA) or libamdhip64
 * (-DFAKE_HIP) that the runtime dlopens, backed by host memory, recording every call.
 *
 * A code object is text: "FAKE\n" then one "symbol n_params" line per kernel (the driver needs the
 * parameter count to read a launch's argument bytes). Anything else fails to load. Failures can be
 * injected: fake_fail(what, n) fails the n-th (1-based) call of one kind: "alloc", "load", "instantiate",
 * "launch", "attr" (a function attribute), "graph_launch". As on CUDA, a launch with more dynamic shared
 * memory than the kernel's limit fails: the limit is the driver's default (CUDA 48 KiB, HIP 64 KiB) until
 * the kernel's max-dynamic-shared attribute raises it (up to the device's maximum). Real HIP is looser (it
 * checks the attribute's value, and a launch only against the device), so the fake holds both to CUDA's rule.
 * The test reads the record through fake_* functions (it loads the same library path, so it shares it):
 * counts, the launches (eager and replayed), the attribute calls, and the name of every driver call in
 * order (the trace). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXK 4096
#define MAXP 64
#define MAXLOG 100000
#define MAXLIVE 4096
#define MAXTRACE 200000
#define MAXATTR 4096
#define ATTR_MAX_DYNAMIC_SHARED 8 /* the same number on both drivers */
#ifdef FAKE_CUDA
#define SHARED_DEFAULT (48 * 1024)
#define SHARED_OPTIN (227 * 1024) /* sm_90 */
#else
#define SHARED_DEFAULT (64 * 1024)
#define SHARED_OPTIN (160 * 1024) /* gfx950 */
#endif
/* error numbers (the same on both drivers) */
#define E_INVALID_VALUE 1
#define E_LAUNCH_FAILED 719
#define E_UNKNOWN 999

typedef struct {
    char name[200];
    int nparams;
    int max_shared; /* dynamic shared bytes a launch may use */
} kern;
typedef struct {
    int n;
    kern k[MAXK];
} module;
typedef struct {
    const kern *k;
    uint32_t geom[7];
    uint64_t args[MAXP];
    int nargs;
    int replay;
} rec;
typedef struct {
    int n;
    rec *r;
} graph;

typedef struct {
    const kern *k;
    int attr, value;
    long launches_before; /* eager + replayed launches logged before this call */
    int capturing;
} attr_rec;

static rec g_log[MAXLOG];
static long g_nlog, g_allocs, g_frees, g_loads, g_unloads, g_captures, g_glaunch, g_streams, g_graphs, g_execs;
static void *g_live[MAXLIVE];
static graph *g_capturing;
static attr_rec g_attr[MAXATTR];
static long g_nattr;
static const char *g_trace[MAXTRACE];
static long g_ntrace;

static const char *const FAILS[] = {"alloc", "load", "instantiate", "launch", "attr", "graph_launch"};
enum { F_ALLOC, F_LOAD, F_INSTANTIATE, F_LAUNCH, F_ATTR, F_GRAPH_LAUNCH, F_N };
static long g_fail_at[F_N], g_attempts[F_N];
static int injected(int what) { return ++g_attempts[what] == g_fail_at[what]; }

static void trace(const char *fn) {
    if (g_ntrace < MAXTRACE) g_trace[g_ntrace++] = fn;
}

void fake_reset(void) {
    g_nlog = g_allocs = g_frees = g_loads = g_unloads = g_captures = g_glaunch = g_streams = g_graphs = g_execs = 0;
    g_nattr = g_ntrace = 0;
    memset(g_fail_at, 0, sizeof g_fail_at);
    memset(g_attempts, 0, sizeof g_attempts);
    memset(g_live, 0, sizeof g_live);
    g_capturing = NULL;
}
/* Fail the n-th call of `what` (counted from the last reset); -1: no such kind. */
int fake_fail(const char *what, long n) {
    for (int i = 0; i < F_N; i++)
        if (!strcmp(what, FAILS[i])) {
            g_fail_at[i] = n;
            return 0;
        }
    return -1;
}
/* allocs, frees, live allocations, loads, unloads, captures, graph launches, log length, streams, graphs,
 * graph execs, attribute calls, trace length */
#define NCOUNTS 13
void fake_counts(long out[NCOUNTS]) {
    long live = 0;
    for (int i = 0; i < MAXLIVE; i++) live += g_live[i] != NULL;
    long v[NCOUNTS] = {g_allocs, g_frees, live, g_loads, g_unloads, g_captures, g_glaunch, g_nlog, g_streams,
                       g_graphs, g_execs, g_nattr, g_ntrace};
    memcpy(out, v, sizeof v);
}
/* The i-th driver call's name (NULL past the end). */
const char *fake_trace(long i) { return i >= 0 && i < g_ntrace ? g_trace[i] : NULL; }
/* The i-th attribute call: kernel name; out = attribute, value, launches logged before it, capturing. */
int fake_attr(long i, char *name, long out[4]) {
    if (i < 0 || i >= g_nattr) return -1;
    snprintf(name, 200, "%s", g_attr[i].k->name);
    long v[4] = {g_attr[i].attr, g_attr[i].value, g_attr[i].launches_before, g_attr[i].capturing != 0};
    memcpy(out, v, sizeof v);
    return 0;
}
int fake_launch(long i, char *name, uint32_t geom[7], uint64_t *args, int *replay) {
    if (i < 0 || i >= g_nlog) return -1;
    snprintf(name, 200, "%s", g_log[i].k->name);
    memcpy(geom, g_log[i].geom, sizeof g_log[i].geom);
    memcpy(args, g_log[i].args, sizeof(uint64_t) * (size_t)g_log[i].nargs);
    *replay = g_log[i].replay;
    return g_log[i].nargs;
}

static int f_alloc(void **p, size_t n) {
    if (injected(F_ALLOC)) return 1;
    for (int i = 0; i < MAXLIVE; i++)
        if (!g_live[i]) {
            g_live[i] = aligned_alloc(256, (n + 255) / 256 * 256);
            *p = g_live[i];
            g_allocs += g_live[i] != NULL; /* successful allocations: each must be freed */
            return g_live[i] ? 0 : 1;
        }
    return 1;
}
static int f_free(void *p) {
    for (int i = 0; i < MAXLIVE; i++)
        if (g_live[i] == p && p) {
            free(p);
            g_live[i] = NULL;
            g_frees++;
            return 0;
        }
    return 1; /* freeing something never allocated */
}
static int f_load(void **m, const void *image) {
    const char *s = image;
    if (injected(F_LOAD) || strncmp(s, "FAKE\n", 5)) return 1;
    g_loads++; /* successful loads: each must be unloaded */
    module *mod = calloc(1, sizeof *mod);
    s += 5;
    while (*s && mod->n < MAXK) {
        kern *k = &mod->k[mod->n];
        if (sscanf(s, "%199s %d", k->name, &k->nparams) != 2) break;
        k->max_shared = SHARED_DEFAULT;
        mod->n++;
        s = strchr(s, '\n');
        if (!s) break;
        s++;
    }
    *m = mod;
    return 0;
}
static int f_unload(void *m) {
    g_unloads++;
    free(m);
    return 0;
}
static int f_getfn(void **f, void *m, const char *name) {
    module *mod = m;
    for (int i = 0; i < mod->n; i++)
        if (!strcmp(mod->k[i].name, name)) {
            *f = &mod->k[i];
            return 0;
        }
    return 1;
}
static int f_attr(void *f, int attr, int value) {
    kern *k = f;
    if (injected(F_ATTR)) return E_UNKNOWN;
    if (attr != ATTR_MAX_DYNAMIC_SHARED || value < 0 || value > SHARED_OPTIN) return E_INVALID_VALUE;
    if (g_nattr < MAXATTR) g_attr[g_nattr++] = (attr_rec){k, attr, value, g_nlog, g_capturing != NULL};
    k->max_shared = value;
    return 0;
}
static int f_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                    unsigned shared, void **params) {
    const kern *k = f;
    if (injected(F_LAUNCH)) return E_LAUNCH_FAILED;
    if (shared > (unsigned)k->max_shared) return E_INVALID_VALUE;
    rec r = {k, {gx, gy, gz, bx, by, bz, shared}, {0}, k->nparams, 0};
    for (int i = 0; i < k->nparams && i < MAXP; i++) memcpy(&r.args[i], params[i], 8);
    if (g_capturing) {
        graph *g = g_capturing;
        g->r = realloc(g->r, sizeof(rec) * (size_t)(g->n + 1));
        g->r[g->n++] = r;
        return 0;
    }
    if (g_nlog < MAXLOG) g_log[g_nlog++] = r;
    return 0;
}
static int f_begin(void) {
    if (g_capturing) return 1;
    g_capturing = calloc(1, sizeof(graph));
    return 0;
}
static int f_end(void **g) {
    if (!g_capturing) return 1;
    *g = g_capturing;
    g_capturing = NULL;
    g_graphs++;
    return 0;
}
static int f_inst(void **e, void *g) {
    if (injected(F_INSTANTIATE)) return E_UNKNOWN;
    g_captures++;
    g_execs++;
    *e = g;
    return 0;
}
static int f_glaunch(void *e) {
    graph *g = e;
    if (injected(F_GRAPH_LAUNCH)) return E_LAUNCH_FAILED;
    g_glaunch++;
    for (int i = 0; i < g->n && g_nlog < MAXLOG; i++) {
        g_log[g_nlog] = g->r[i];
        g_log[g_nlog++].replay = 1;
    }
    return 0;
}
static int f_gdestroy(void *g) {
    graph *h = g;
    g_graphs--;
    free(h->r);
    free(h);
    return 0;
}

/* Every exported driver function starts with T: its name goes to the trace. */
#define T trace(__func__)

#ifdef FAKE_CUDA
typedef unsigned long long CUdeviceptr;
int cuInit(unsigned f) { T; return (int)f; }
int cuDeviceGet(int *d, int o) { T; *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { T; (void)d; *c = (void *)1; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { T; (void)d; return 0; }
int cuCtxSetCurrent(void *c) { T; (void)c; return 0; }
int cuGetErrorString(int r, const char **s) {
    *s = r == 1 ? "CUDA_ERROR_INVALID_VALUE" : r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 200 ? "CUDA_ERROR_INVALID_IMAGE"
       : r == 500 ? "CUDA_ERROR_NOT_FOUND" : r == 719 ? "CUDA_ERROR_LAUNCH_FAILED" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuModuleLoadData(void **m, const void *img) { T; return f_load(m, img) ? 200 : 0; }
int cuModuleUnload(void *m) { T; return f_unload(m); }
int cuModuleGetFunction(void **f, void *m, const char *n) { T; return f_getfn(f, m, n) ? 500 : 0; }
int cuFuncSetAttribute(void *f, int a, int v) { T; return f_attr(f, a, v); }
int cuMemAlloc_v2(CUdeviceptr *p, size_t n) { T; void *q = NULL; int r = f_alloc(&q, n); *p = (CUdeviceptr)(uintptr_t)q; return r ? 2 : 0; }
int cuMemFree_v2(CUdeviceptr p) { T; return f_free((void *)(uintptr_t)p) ? 1 : 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { T; (void)st; memcpy((void *)(uintptr_t)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { T; (void)st; memcpy(d, (const void *)(uintptr_t)s, n); return 0; }
int cuStreamCreate(void **s, unsigned f) { T; (void)f; g_streams++; *s = (void *)2; return 0; }
int cuStreamDestroy_v2(void *s) { T; (void)s; g_streams--; return 0; }
int cuStreamSynchronize(void *s) { T; (void)s; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void *st, void **p, void **e) { T; (void)st; (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p); }
int cuStreamBeginCapture_v2(void *s, int m) { T; (void)s; (void)m; return f_begin(); }
int cuStreamEndCapture(void *s, void **g) { T; (void)s; return f_end(g); }
int cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long f) { T; (void)f; return f_inst(e, g); }
int cuGraphLaunch(void *e, void *s) { T; (void)s; return f_glaunch(e); }
int cuGraphExecDestroy(void *e) { T; (void)e; g_execs--; return 0; }
int cuGraphDestroy(void *g) { T; return f_gdestroy(g); }
#endif

#ifdef FAKE_HIP
int hipInit(unsigned f) { T; return (int)f; }
int hipSetDevice(int d) { T; return d; }
const char *hipGetErrorString(int r) {
    return r == 1 ? "hipErrorInvalidValue" : r == 2 ? "hipErrorOutOfMemory" : r == 200 ? "hipErrorInvalidImage"
         : r == 500 ? "hipErrorNotFound" : r == 719 ? "hipErrorLaunchFailure" : "hipErrorUnknown";
}
int hipModuleLoadData(void **m, const void *img) { T; return f_load(m, img) ? 200 : 0; }
int hipModuleUnload(void *m) { T; return f_unload(m); }
int hipModuleGetFunction(void **f, void *m, const char *n) { T; return f_getfn(f, m, n) ? 500 : 0; }
int hipFuncSetAttribute(const void *f, int a, int v) { T; return f_attr((void *)f, a, v); }
int hipMalloc(void **p, size_t n) { T; return f_alloc(p, n) ? 2 : 0; }
int hipFree(void *p) { T; return f_free(p) ? 1 : 0; }
int hipMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) { T; (void)kind; (void)st; memcpy(d, s, n); return 0; }
int hipStreamCreateWithFlags(void **s, unsigned f) { T; (void)f; g_streams++; *s = (void *)2; return 0; }
int hipStreamDestroy(void *s) { T; (void)s; g_streams--; return 0; }
int hipStreamSynchronize(void *s) { T; (void)s; return 0; }
int hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned sh, void *st, void **p, void **e) { T; (void)st; (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p); }
int hipStreamBeginCapture(void *s, int m) { T; (void)s; (void)m; return f_begin(); }
int hipStreamEndCapture(void *s, void **g) { T; (void)s; return f_end(g); }
int hipGraphInstantiate(void **e, void *g, void *n, char *l, size_t b) { T; (void)n; (void)l; (void)b; return f_inst(e, g); }
int hipGraphLaunch(void *e, void *s) { T; (void)s; return f_glaunch(e); }
int hipGraphExecDestroy(void *e) { T; (void)e; g_execs--; return 0; }
int hipGraphDestroy(void *g) { T; return f_gdestroy(g); }
#endif
