/* A fake GPU driver for the C runtime's tests: the symbols of libcuda (-DFAKE_CUDA) or libamdhip64
 * (-DFAKE_HIP) that the runtime dlopens, backed by host memory, recording every call.
 *
 * A code object is text: "FAKE\n" then one "symbol n_params" line per kernel (the driver needs the
 * parameter count to read a launch's argument bytes). Anything else fails to load. Failures can be
 * injected: fake_fail("alloc", n) fails the n-th allocation (1-based), ("load", n) the n-th module load.
 * The test reads the record through fake_* functions (it loads the same library path, so it shares it). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXK 4096
#define MAXP 64
#define MAXLOG 100000
#define MAXLIVE 4096

typedef struct {
    char name[200];
    int nparams;
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

static rec g_log[MAXLOG];
static long g_nlog, g_allocs, g_frees, g_loads, g_unloads, g_captures, g_glaunch, g_streams, g_graphs, g_execs;
static long g_fail_alloc, g_fail_load, g_load_attempts, g_alloc_attempts;
static void *g_live[MAXLIVE];
static graph *g_capturing;

void fake_reset(void) {
    g_nlog = g_allocs = g_frees = g_loads = g_unloads = g_captures = g_glaunch = g_streams = g_graphs = g_execs = 0;
    g_fail_alloc = g_fail_load = g_load_attempts = g_alloc_attempts = 0;
    memset(g_live, 0, sizeof g_live);
    g_capturing = NULL;
}
void fake_fail(const char *what, long n) {
    if (!strcmp(what, "alloc")) g_fail_alloc = n;
    if (!strcmp(what, "load")) g_fail_load = n;
}
/* allocs, frees, live allocations, loads, unloads, captures, graph launches, log length, streams, graphs,
 * graph execs */
void fake_counts(long out[11]) {
    long live = 0;
    for (int i = 0; i < MAXLIVE; i++) live += g_live[i] != NULL;
    long v[11] = {g_allocs, g_frees, live, g_loads, g_unloads, g_captures, g_glaunch, g_nlog, g_streams, g_graphs,
                  g_execs};
    memcpy(out, v, sizeof v);
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
    g_alloc_attempts++;
    if (g_fail_alloc && g_alloc_attempts == g_fail_alloc) return 1;
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
    g_load_attempts++;
    const char *s = image;
    if ((g_fail_load && g_load_attempts == g_fail_load) || strncmp(s, "FAKE\n", 5)) return 1;
    g_loads++; /* successful loads: each must be unloaded */
    module *mod = calloc(1, sizeof *mod);
    s += 5;
    while (*s && mod->n < MAXK) {
        kern *k = &mod->k[mod->n];
        if (sscanf(s, "%199s %d", k->name, &k->nparams) != 2) break;
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
static int f_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                    unsigned shared, void **params) {
    const kern *k = f;
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
    g_captures++;
    g_execs++;
    *e = g;
    return 0;
}
static int f_glaunch(void *e) {
    graph *g = e;
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

#ifdef FAKE_CUDA
typedef unsigned long long CUdeviceptr;
int cuInit(unsigned f) { return (int)f; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = (void *)1; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxSetCurrent(void *c) { (void)c; return 0; }
int cuGetErrorString(int r, const char **s) {
    *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 200 ? "CUDA_ERROR_INVALID_IMAGE" : r == 500 ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuModuleLoadData(void **m, const void *img) { return f_load(m, img) ? 200 : 0; }
int cuModuleUnload(void *m) { return f_unload(m); }
int cuModuleGetFunction(void **f, void *m, const char *n) { return f_getfn(f, m, n) ? 500 : 0; }
int cuFuncSetAttribute(void *f, int a, int v) { (void)f; (void)a; (void)v; return 0; }
int cuMemAlloc_v2(CUdeviceptr *p, size_t n) { void *q = NULL; int r = f_alloc(&q, n); *p = (CUdeviceptr)(uintptr_t)q; return r ? 2 : 0; }
int cuMemFree_v2(CUdeviceptr p) { return f_free((void *)(uintptr_t)p) ? 1 : 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { (void)st; memcpy((void *)(uintptr_t)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { (void)st; memcpy(d, (const void *)(uintptr_t)s, n); return 0; }
int cuStreamCreate(void **s, unsigned f) { (void)f; g_streams++; *s = (void *)2; return 0; }
int cuStreamDestroy_v2(void *s) { (void)s; g_streams--; return 0; }
int cuStreamSynchronize(void *s) { (void)s; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void *st, void **p, void **e) { (void)st; (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p); }
int cuStreamBeginCapture_v2(void *s, int m) { (void)s; (void)m; return f_begin(); }
int cuStreamEndCapture(void *s, void **g) { (void)s; return f_end(g); }
int cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long f) { (void)f; return f_inst(e, g); }
int cuGraphLaunch(void *e, void *s) { (void)s; return f_glaunch(e); }
int cuGraphExecDestroy(void *e) { (void)e; g_execs--; return 0; }
int cuGraphDestroy(void *g) { return f_gdestroy(g); }
#endif

#ifdef FAKE_HIP
int hipInit(unsigned f) { return (int)f; }
int hipSetDevice(int d) { return d; }
const char *hipGetErrorString(int r) { return r == 2 ? "hipErrorOutOfMemory" : r == 200 ? "hipErrorInvalidImage" : r == 500 ? "hipErrorNotFound" : "hipErrorUnknown"; }
int hipModuleLoadData(void **m, const void *img) { return f_load(m, img) ? 200 : 0; }
int hipModuleUnload(void *m) { return f_unload(m); }
int hipModuleGetFunction(void **f, void *m, const char *n) { return f_getfn(f, m, n) ? 500 : 0; }
int hipMalloc(void **p, size_t n) { return f_alloc(p, n) ? 2 : 0; }
int hipFree(void *p) { return f_free(p) ? 1 : 0; }
int hipMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) { (void)kind; (void)st; memcpy(d, s, n); return 0; }
int hipStreamCreateWithFlags(void **s, unsigned f) { (void)f; g_streams++; *s = (void *)2; return 0; }
int hipStreamDestroy(void *s) { (void)s; g_streams--; return 0; }
int hipStreamSynchronize(void *s) { (void)s; return 0; }
int hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned sh, void *st, void **p, void **e) { (void)st; (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p); }
int hipStreamBeginCapture(void *s, int m) { (void)s; (void)m; return f_begin(); }
int hipStreamEndCapture(void *s, void **g) { (void)s; return f_end(g); }
int hipGraphInstantiate(void **e, void *g, void *n, char *l, size_t b) { (void)n; (void)l; (void)b; return f_inst(e, g); }
int hipGraphLaunch(void *e, void *s) { (void)s; return f_glaunch(e); }
int hipGraphExecDestroy(void *e) { (void)e; g_execs--; return 0; }
int hipGraphDestroy(void *g) { return f_gdestroy(g); }
#endif
