/* A fake GPU driver for the C runtime's tests: the symbols of libcuda (-DFAKE_CUDA) or libamdhip64
 * (-DFAKE_HIP) that the runtime dlopens, backed by host memory, recording every call.
 *
 * A code object is either a real binary (a cubin / an hsaco: each kernel's parameter count and sizes and
 * its thread limit read from the ELF, as the real driver reads them; see load_cubin / load_hsaco) or text:
 * "FAKE\n", optionally "@tag\n", then one "symbol n_params" line per kernel (the placeholders of the
 * tests' tables). Anything else fails to load. A module is tagged (a real binary: the FNV-1a of its image)
 * and each launch reports its kernel's tag. Failures can be injected: fake_fail(what, n) fails the n-th
 * (1-based) call of one kind: "alloc", "load", "instantiate", "launch", "attr" (a function attribute),
 * "graph_launch", "host_alloc" (pinned memory).
 * What the real drivers refuse, the fake refuses with the real error number (CUDA's names / HIP's):
 * a block beyond the kernel's thread limit or a grid beyond the device's (INVALID_VALUE); more dynamic
 * shared memory than the kernel's limit, which is the driver's default (CUDA 48 KiB, HIP 64 KiB) until
 * the kernel's max-dynamic-shared attribute raises it (up to the device's maximum; real HIP is looser, it
 * checks the attribute's value, and a launch only against the device, so the fake holds both to CUDA's
 * rule); a pointer parameter outside every live allocation (ILLEGAL_ADDRESS, where the GPU would fault);
 * during stream capture an allocation, a free, a copy, a synchronize or a module load
 * (STREAM_CAPTURE_UNSUPPORTED, and ending the capture then reports STREAM_CAPTURE_INVALIDATED); a HIP copy
 * whose kind does not match its pointers (hipErrorInvalidValue), and on both drivers a copy whose device side
 * is not wholly inside one live allocation or whose host side lies in one (INVALID_VALUE: out of range, or a
 * copy in the wrong direction); a CUDA call from a thread with no
 * current context (CUDA_ERROR_INVALID_CONTEXT: the context is per thread).
 * Copies keep a real GPU's timing: a host-to-device copy from pinned memory (cuMemHostAlloc / hipHostMalloc)
 * is queued and performed later, reading its source then: when the stream is synchronised, when an event
 * recorded after it is synchronised, or before a device-to-host copy or a copy from pageable memory on the
 * stream (which the drivers perform at once, after the stream's earlier work). A runtime that refills a
 * pinned buffer before its copy ran uploads the new bytes. Freeing pinned memory a queued copy still reads,
 * or device memory one still writes, is refused (INVALID_VALUE; the real drivers may block instead, and a
 * runtime must not count on it); so is an event or copy on a stream other than the runtime's
 * (INVALID_HANDLE), and, during capture, a pinned allocation or free, or an event record or synchronize.
 * A test may run each launch's kernel through a hook (fake_on_launch) on the fake's memory, so a whole program
 * computes on the fake GPU.
 * IPC (the one-shot all-reduce's symmetric regions): device memory is shared memory (a memfd per allocation,
 * mapped MAP_SHARED), so a handle (cuIpcGetMemHandle / hipIpcGetMemHandle: the allocation's /proc fd path and
 * size) opened in another process (cuIpcOpenMemHandle_v2 / hipIpcOpenMemHandle) maps the same bytes. Refused as
 * the real drivers refuse them (INVALID_VALUE unless said): a handle of memory not from the device allocator
 * (pinned host memory, a pointer in no live allocation), opening a handle without the lazy peer-access flag,
 * closing what is not an open mapping (a double close), and on CUDA opening a handle this same process exported
 * (CUDA_ERROR_INVALID_CONTEXT here; CUDA documents that such a handle cannot be opened in its own process).
 * hipExtMallocWithFlags takes the flags hip_runtime_api.h defines (0 default, 1 fine-grained, 3 uncached) and
 * records the last one. fake_ipc: handles exported, opened, closed, open now, the last allocation flags.
 * The test reads the record through fake_* functions (it loads the same library path, so it shares it):
 * counts, the copies (fake_copies: by source kind, bytes, synchronisations), the launches (eager and
 * replayed; each with whether it carried cuLaunchKernelEx's programmatic stream serialization attribute, kept
 * through capture into the replays), the attribute calls, and the name of every driver call in order (the
 * trace). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
#define E_INVALID_IMAGE 200
#define E_INVALID_CONTEXT 201
#define E_ILLEGAL_ADDRESS 700
#define E_INVALID_HANDLE 400
#define E_LAUNCH_FAILED 719
#define E_CAPTURE_UNSUPPORTED 900
#define E_CAPTURE_INVALIDATED 901
#define E_UNKNOWN 999

typedef struct {
    char name[200];
    int nparams;
    int psize[MAXP];       /* each parameter's bytes */
    unsigned maxntid[3];   /* the most threads per block along each axis (CUDA .maxntid) */
    unsigned maxthreads;   /* the most threads per block (HIP: the flat work-group size) */
    int max_shared;        /* dynamic shared bytes a launch may use */
    const char *tag;       /* its module's tag */
} kern;
typedef struct {
    int n;
    char tag[80];
    kern k[MAXK];
} module;
typedef struct {
    const kern *k;
    uint32_t geom[7];
    uint64_t args[MAXP];
    int nargs;
    int replay;
    int pdl; /* launched with programmatic stream serialization (cuLaunchKernelEx's attribute) */
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

static long g_ipc_exported, g_ipc_opened, g_ipc_closed; /* IPC (below) */
static unsigned g_malloc_flags;
static const char *const FAILS[] = {"alloc", "load", "instantiate", "launch", "attr", "graph_launch", "host_alloc"};
enum { F_ALLOC, F_LOAD, F_INSTANTIATE, F_LAUNCH, F_ATTR, F_GRAPH_LAUNCH, F_HOST_ALLOC, F_N };
static long g_fail_at[F_N], g_attempts[F_N];
static int injected(int what) { return ++g_attempts[what] == g_fail_at[what]; }

static void trace(const char *fn) {
    if (g_ntrace < MAXTRACE) g_trace[g_ntrace++] = fn;
}

/* ---- copies, pinned memory, events ------------------------------------------------------------------ */
#define MAXPIN 256
#define MAXEV 256
typedef struct {
    void *dst;
    const void *src;
    size_t n;
    long seq;
} copy_t;
typedef struct {
    long mark; /* the copies enqueued before it was recorded (their seq is below it) */
} event_t;
static int live_range(const void *p, size_t n);
static int in_live(uint64_t p);
static copy_t *g_queue;        /* queued copies from pinned memory, oldest first */
static long g_nqueue, g_capq, g_qhead, g_seq;
static void *g_pinned[MAXPIN];
static size_t g_pinned_n[MAXPIN];
static event_t *g_events[MAXEV];
/* pinned copies, pinned bytes, pageable copies, pageable bytes, device-to-host copies, stream synchronises,
 * event synchronises, copies that waited for queued ones (a pageable or device-to-host copy), pinned
 * allocations live, events live, copies queued now, device-to-device copies */
#define NCOPIES 12
static long g_copy[NCOPIES];
enum { C_PINNED, C_PINNED_BYTES, C_PAGEABLE, C_PAGEABLE_BYTES, C_D2H, C_STREAM_SYNC, C_EVENT_SYNC, C_WAITED,
       C_D2D = 11 };

static void copies_reset(void) {
    free(g_queue);
    g_queue = NULL;
    g_nqueue = g_capq = g_qhead = g_seq = 0;
    memset(g_copy, 0, sizeof g_copy);
    memset(g_pinned, 0, sizeof g_pinned);
    memset(g_events, 0, sizeof g_events);
}
void fake_copies(long out[NCOPIES]) {
    memcpy(out, g_copy, sizeof g_copy);
    for (int i = 0; i < MAXPIN; i++) out[8] += g_pinned[i] != NULL;
    for (int i = 0; i < MAXEV; i++) out[9] += g_events[i] != NULL;
    out[10] = g_nqueue - g_qhead;
    out[11] = g_copy[C_D2D];
}
/* Perform the queued copies enqueued before `mark` (LONG_MAX: all), reading their sources now. */
static void perform(long mark) {
    while (g_qhead < g_nqueue && g_queue[g_qhead].seq < mark) {
        copy_t *c = &g_queue[g_qhead++];
        memcpy(c->dst, c->src, c->n);
    }
    if (g_qhead == g_nqueue) g_qhead = g_nqueue = 0;
}
static int pinned_slot(const void *p, size_t n) { /* the pinned allocation holding [p, p + n), or -1 */
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < MAXPIN; i++)
        if (g_pinned[i] && a >= (uintptr_t)g_pinned[i] && a + n <= (uintptr_t)g_pinned[i] + g_pinned_n[i]) return i;
    return -1;
}
/* A host-to-device copy on the stream: from pinned memory queued; from pageable memory at once, after the
 * stream's queued work. */
static int h2d(void *dst, const void *src, size_t n) {
    if (!live_range(dst, n) || in_live((uint64_t)(uintptr_t)src)) return E_INVALID_VALUE;
    if (pinned_slot(src, n) >= 0) {
        if (g_nqueue == g_capq) {
            long cap = g_capq ? 2 * g_capq : 64;
            copy_t *q = realloc(g_queue, sizeof(copy_t) * (size_t)cap);
            if (!q) return 2;
            g_queue = q;
            g_capq = cap;
        }
        g_queue[g_nqueue++] = (copy_t){dst, src, n, g_seq++};
        g_copy[C_PINNED]++;
        g_copy[C_PINNED_BYTES] += (long)n;
        return 0;
    }
    g_copy[C_WAITED] += g_qhead < g_nqueue;
    perform(LONG_MAX);
    memcpy(dst, src, n);
    g_copy[C_PAGEABLE]++;
    g_copy[C_PAGEABLE_BYTES] += (long)n;
    return 0;
}
static int d2h(void *dst, const void *src, size_t n) {
    if (!live_range(src, n) || in_live((uint64_t)(uintptr_t)dst)) return E_INVALID_VALUE;
    g_copy[C_WAITED] += g_qhead < g_nqueue;
    perform(LONG_MAX);
    memcpy(dst, src, n);
    g_copy[C_D2H]++;
    return 0;
}
static void stream_sync(void) {
    perform(LONG_MAX);
    g_copy[C_STREAM_SYNC]++;
}
/* Whether a queued copy still reads [p, p + n) (src) or writes it (dst). */
static int queued_touching(const void *p, size_t n, int src) {
    uintptr_t a = (uintptr_t)p;
    for (long i = g_qhead; i < g_nqueue; i++) {
        uintptr_t b = (uintptr_t)(src ? g_queue[i].src : g_queue[i].dst);
        if (b < a + n && a < b + g_queue[i].n) return 1;
    }
    return 0;
}
static int host_alloc(void **p, size_t n) {
    if (injected(F_HOST_ALLOC)) return 2;
    for (int i = 0; i < MAXPIN; i++)
        if (!g_pinned[i]) {
            g_pinned[i] = malloc(n ? n : 1);
            g_pinned_n[i] = n;
            *p = g_pinned[i];
            return g_pinned[i] ? 0 : 2;
        }
    return 2;
}
static int host_free(void *p) {
    for (int i = 0; i < MAXPIN; i++)
        if (g_pinned[i] == p && p) {
            if (queued_touching(p, g_pinned_n[i], 1)) return 1;
            free(p);
            g_pinned[i] = NULL;
            return 0;
        }
    return 1;
}
static int event_create(void **e) {
    for (int i = 0; i < MAXEV; i++)
        if (!g_events[i]) {
            g_events[i] = calloc(1, sizeof(event_t));
            *e = g_events[i];
            return g_events[i] ? 0 : 2;
        }
    return 2;
}
static event_t *event_of(void *e) {
    for (int i = 0; i < MAXEV; i++)
        if (e && g_events[i] == e) return g_events[i];
    return NULL;
}
static int event_record(void *e) {
    event_t *ev = event_of(e);
    if (!ev) return 400;
    ev->mark = g_seq;
    return 0;
}
static int event_sync(void *e) {
    event_t *ev = event_of(e);
    if (!ev) return 400;
    perform(ev->mark);
    g_copy[C_EVENT_SYNC]++;
    return 0;
}
static int event_destroy(void *e) {
    for (int i = 0; i < MAXEV; i++)
        if (e && g_events[i] == e) {
            free(e);
            g_events[i] = NULL;
            return 0;
        }
    return 400;
}

/* A test that needs the kernels' effect (the self-check's layer statistics on a fake GPU) hands a hook that runs
 * each launch as the GPU would execute it: an eager launch when issued, a graph's launches when replayed (none
 * while capturing), after the stream's earlier copies have landed, on the fake's memory (host memory). Its
 * arguments are the launch's parameter values; nonzero: the launch fails (LAUNCH_FAILED). */
typedef int (*fake_exec_fn)(int nargs, const uint64_t *args);
static fake_exec_fn g_exec;
void fake_on_launch(fake_exec_fn f) { g_exec = f; }
static int exec_hook(const uint64_t *args, int nargs) {
    if (!g_exec) return 0;
    perform(LONG_MAX);
    return g_exec(nargs, args) ? E_LAUNCH_FAILED : 0;
}

void fake_reset(void) {
    g_nlog = g_allocs = g_frees = g_loads = g_unloads = g_captures = g_glaunch = g_streams = g_graphs = g_execs = 0;
    g_nattr = g_ntrace = 0;
    g_ipc_exported = g_ipc_opened = g_ipc_closed = 0;
    g_malloc_flags = 0;
    memset(g_fail_at, 0, sizeof g_fail_at);
    memset(g_attempts, 0, sizeof g_attempts);
    memset(g_live, 0, sizeof g_live);
    g_capturing = NULL;
    g_exec = NULL;
    copies_reset();
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
/* What the driver read about a kernel (a function handle): parameter count, .maxntid x y z, max threads
 * per block, then each parameter's bytes. */
int fake_kernel(const void *f, long out[5 + MAXP]) {
    const kern *k = f;
    long v[5] = {k->nparams, k->maxntid[0], k->maxntid[1], k->maxntid[2], k->maxthreads};
    memcpy(out, v, sizeof v);
    for (int i = 0; i < k->nparams && i < MAXP; i++) out[5 + i] = k->psize[i];
    return 0;
}
/* The tag of the module the i-th logged launch's kernel was loaded from ("" when untagged). */
int fake_launch_module(long i, char *tag) {
    if (i < 0 || i >= g_nlog) return -1;
    snprintf(tag, 80, "%s", g_log[i].k->tag);
    return 0;
}
/* Whether the i-th logged launch (eager or replayed) carried the programmatic-serialization attribute. */
int fake_launch_pdl(long i) { return i >= 0 && i < g_nlog ? g_log[i].pdl : -1; }
int fake_launch(long i, char *name, uint32_t geom[7], uint64_t *args, int *replay) {
    if (i < 0 || i >= g_nlog) return -1;
    snprintf(name, 200, "%s", g_log[i].k->name);
    memcpy(geom, g_log[i].geom, sizeof g_log[i].geom);
    memcpy(args, g_log[i].args, sizeof(uint64_t) * (size_t)g_log[i].nargs);
    *replay = g_log[i].replay;
    return g_log[i].nargs;
}

static size_t g_live_n[MAXLIVE];
static int g_invalidated; /* an operation the capture cannot hold was attempted: the capture is invalid */

/* During stream capture the real drivers refuse what cannot be recorded in a graph or would synchronise
 * (an allocation or free, a copy from pageable host memory, a stream synchronize, a module load) with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED / hipErrorStreamCaptureUnsupported, and the capture is then
 * invalidated (ending it returns ..._STREAM_CAPTURE_INVALIDATED). */
static int refused_in_capture(void) {
    if (!g_capturing) return 0;
    g_invalidated = 1;
    return 1;
}
/* Every copy, launch, capture, synchronize and graph replay goes to the runtime's one live stream (the
 * fake's stream handle is 2); anything else (NULL: the legacy default stream, which cannot be captured
 * and would synchronise with everything) is refused as INVALID_HANDLE. */
#define STREAM(x) if (!g_streams || (x) != (void *)2) return E_INVALID_HANDLE
/* An address inside a live allocation (a kernel dereferencing anything else faults). */
static int in_live(uint64_t p) {
    for (int i = 0; i < MAXLIVE; i++)
        if (g_live[i] && p >= (uint64_t)(uintptr_t)g_live[i] && p < (uint64_t)(uintptr_t)g_live[i] + g_live_n[i])
            return 1;
    return 0;
}

/* [p, p + n) wholly inside one live allocation: the device side of a copy. */
static int live_range(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < MAXLIVE; i++)
        if (g_live[i] && a >= (uintptr_t)g_live[i] && n <= g_live_n[i] && a - (uintptr_t)g_live[i] <= g_live_n[i] - n)
            return 1;
    return 0;
}
/* A device-to-device copy on the stream: after the stream's queued work, at once. */
static int d2d(void *dst, const void *src, size_t n) {
    if (!live_range(dst, n) || !live_range(src, n)) return E_INVALID_VALUE;
    g_copy[C_WAITED] += g_qhead < g_nqueue;
    perform(LONG_MAX);
    memmove(dst, src, n);
    g_copy[C_D2D]++;
    return 0;
}

static int g_live_fd[MAXLIVE];

/* Device memory: a memfd mapped MAP_SHARED (page-aligned), its fd kept for IPC handles. */
static void *shared_alloc(size_t n, int *fd) {
    size_t m = n ? n : 1;
    *fd = memfd_create("fake-device", MFD_CLOEXEC);
    if (*fd < 0) return NULL;
    void *p = ftruncate(*fd, (off_t)m) == 0 ? mmap(NULL, m, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED) {
        close(*fd);
        return NULL;
    }
    return p;
}

static int f_alloc(void **p, size_t n) {
    if (injected(F_ALLOC)) return 1;
    for (int i = 0; i < MAXLIVE; i++)
        if (!g_live[i]) {
            g_live_n[i] = n;
            g_live[i] = shared_alloc(n, &g_live_fd[i]);
            *p = g_live[i];
            g_allocs += g_live[i] != NULL; /* successful allocations: each must be freed */
            return g_live[i] ? 0 : 1;
        }
    return 1;
}
static int f_free(void *p) {
    for (int i = 0; i < MAXLIVE; i++)
        if (g_live[i] == p && p) {
            if (queued_touching(p, g_live_n[i], 0)) return 1;
            munmap(p, g_live_n[i] ? g_live_n[i] : 1);
            close(g_live_fd[i]);
            g_live[i] = NULL;
            g_frees++;
            return 0;
        }
    return 1; /* freeing something never allocated */
}
static void kern_defaults(kern *k, const char *tag) {
    k->max_shared = SHARED_DEFAULT;
    k->maxntid[0] = k->maxntid[1] = 1024;
    k->maxntid[2] = 64;
    k->maxthreads = 1024;
    k->tag = tag;
    for (int i = 0; i < MAXP; i++) k->psize[i] = 8;
}

/* ---- real code objects: what the real driver reads from the ELF image ---------------------------------
 * cubin: a kernel per ".nv.info.<kernel>" section of EIATTR records {u8 format, u8 attribute, value}
 * (format 4: u16 size then that many bytes; others: 2 bytes). EIATTR_KPARAM_INFO (0x17): one record per
 * parameter, {u32 index, u16 ordinal, u16 offset, u32 flags}, its size in bytes in flags bits 18..31;
 * EIATTR_MAX_THREADS (0x10): the kernel's .maxntid (x, y, z).
 * hsaco: a kernel per "<kernel>.kd" symbol (its 64-byte kernel descriptor: kernarg_size, u32 at byte 8;
 * Triton's parameters are all 8-byte pointers) and the metadata note's .max_flat_workgroup_size (msgpack;
 * Triton's code objects hold one kernel). */
static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}
typedef struct {
    const unsigned char *b;
    uint64_t shoff;
    unsigned shnum, shentsize, shstrndx;
} elf_t;
static const unsigned char *sh(const elf_t *e, unsigned i) { return e->b + e->shoff + (uint64_t)i * e->shentsize; }
static const unsigned char *sec_data(const elf_t *e, unsigned i) { return e->b + le(sh(e, i) + 24, 8); }
static uint64_t sec_size(const elf_t *e, unsigned i) { return le(sh(e, i) + 32, 8); }

#ifdef FAKE_CUDA
static const char *sec_name(const elf_t *e, unsigned i) {
    return (const char *)e->b + le(sh(e, e->shstrndx) + 24, 8) + le(sh(e, i), 4);
}
static int load_cubin(module *mod, const elf_t *e) {
    for (unsigned i = 0; i < e->shnum && mod->n < MAXK; i++) {
        const char *n = sec_name(e, i);
        if (strncmp(n, ".nv.info.", 9)) continue;
        kern *k = &mod->k[mod->n++];
        kern_defaults(k, mod->tag);
        snprintf(k->name, sizeof k->name, "%s", n + 9);
        const unsigned char *d = sec_data(e, i), *end = d + sec_size(e, i);
        while (d + 4 <= end) {
            unsigned fmt = d[0], attr = d[1], len = fmt == 4 ? 4 + (unsigned)le(d + 2, 2) : 4;
            const unsigned char *v = fmt == 4 ? d + 4 : d + 2;
            if (d + len > end) return 1;
            if (attr == 0x17 && fmt == 4 && len >= 16) {
                unsigned ord = (unsigned)le(v + 4, 2), size = (unsigned)(le(v + 8, 4) >> 18) & 0x3fff;
                if (ord >= MAXP) return 1;
                k->psize[ord] = (int)size;
                if ((int)ord + 1 > k->nparams) k->nparams = (int)ord + 1;
            } else if (attr == 0x10 && fmt == 4 && len >= 16) {
                for (int a = 0; a < 3; a++) k->maxntid[a] = (unsigned)le(v + 4 * a, 4);
                k->maxthreads = k->maxntid[0] * k->maxntid[1] * k->maxntid[2];
            }
            d += len;
        }
    }
    return mod->n ? 0 : 1;
}

#else
static unsigned msgpack_uint(const unsigned char *p) {
    if (p[0] < 0x80) return p[0];
    if (p[0] == 0xcc) return p[1];
    if (p[0] == 0xcd) return (unsigned)p[1] << 8 | p[2];
    if (p[0] == 0xce) return (unsigned)p[1] << 24 | (unsigned)p[2] << 16 | (unsigned)p[3] << 8 | p[4];
    return 0;
}

static int load_hsaco(module *mod, const elf_t *e) {
    unsigned maxflat = 0;
    static const char key[] = "\xb8.max_flat_workgroup_size";
    for (unsigned i = 0; i < e->shnum; i++)
        if (le(sh(e, i) + 4, 4) == 7) { /* SHT_NOTE */
            const unsigned char *d = sec_data(e, i);
            uint64_t n = sec_size(e, i), kl = sizeof key - 1;
            for (uint64_t j = 0; j + kl + 5 <= n; j++)
                if (!memcmp(d + j, key, kl)) maxflat = msgpack_uint(d + j + kl);
        }
    for (unsigned i = 0; i < e->shnum; i++) {
        if (le(sh(e, i) + 4, 4) != 2) continue; /* SHT_SYMTAB */
        const unsigned char *syms = sec_data(e, i);
        unsigned strndx = (unsigned)le(sh(e, i) + 40, 4);
        const char *str = (const char *)sec_data(e, strndx);
        for (uint64_t s = 0; s + 24 <= sec_size(e, i) && mod->n < MAXK; s += 24) {
            const char *n = str + le(syms + s, 4);
            size_t len = strlen(n);
            unsigned shndx = (unsigned)le(syms + s + 6, 2);
            if (len < 4 || strcmp(n + len - 3, ".kd") || shndx == 0 || shndx >= e->shnum) continue;
            int dup = 0;
            for (int q = 0; q < mod->n; q++) dup |= !strncmp(mod->k[q].name, n, len - 3) && !mod->k[q].name[len - 3];
            if (dup) continue;
            const unsigned char *kd = sec_data(e, shndx) + (le(syms + s + 8, 8) - le(sh(e, shndx) + 16, 8));
            kern *k = &mod->k[mod->n++];
            kern_defaults(k, mod->tag);
            snprintf(k->name, sizeof k->name, "%.*s", (int)(len - 3), n);
            k->nparams = (int)(le(kd + 8, 4) / 8);
            if (maxflat) k->maxthreads = maxflat;
            k->maxntid[0] = k->maxntid[1] = k->maxntid[2] = k->maxthreads;
        }
    }
    return mod->n ? 0 : 1;
}

#endif

/* A 64-bit FNV-1a of the image's bytes (an ELF: up to the end of its section headers): the module's tag. */
static void tag_of(module *mod, const unsigned char *b, uint64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    snprintf(mod->tag, sizeof mod->tag, "%016llx", (unsigned long long)h);
}

static int f_load(void **m, const void *image) {
    const char *s = image;
    if (injected(F_LOAD)) return 1;
    if (!memcmp(s, "\x7f" "ELF", 4)) {
        const unsigned char *b = image;
        elf_t e = {b, le(b + 0x28, 8), (unsigned)le(b + 0x3c, 2), (unsigned)le(b + 0x3a, 2), (unsigned)le(b + 0x3e, 2)};
        if (b[4] != 2 || e.shentsize != 64 || e.shstrndx >= e.shnum) return 1;
        module *mod = calloc(1, sizeof *mod);
        if (!mod) return 1;
        tag_of(mod, b, e.shoff + (uint64_t)e.shnum * e.shentsize);
#ifdef FAKE_CUDA
        int bad = load_cubin(mod, &e);
#else
        int bad = load_hsaco(mod, &e);
#endif
        if (bad) {
            free(mod);
            return 1;
        }
        g_loads++;
        *m = mod;
        return 0;
    }
    if (strncmp(s, "FAKE\n", 5)) return 1;
    g_loads++; /* successful loads: each must be unloaded */
    module *mod = calloc(1, sizeof *mod);
    s += 5;
    if (*s == '@') { /* "@tag": names the module (tests: which binary a launch's kernel came from) */
        if (sscanf(s + 1, "%79s", mod->tag) != 1) mod->tag[0] = 0;
        s = strchr(s, '\n');
        s = s ? s + 1 : "";
    }
    while (*s && mod->n < MAXK) {
        kern *k = &mod->k[mod->n];
        kern_defaults(k, mod->tag);
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
static int f_attr(void *f, int attr, int value) {
    kern *k = f;
    if (injected(F_ATTR)) return E_UNKNOWN;
    if (attr != ATTR_MAX_DYNAMIC_SHARED || value < 0 || value > SHARED_OPTIN) return E_INVALID_VALUE;
    if (g_nattr < MAXATTR) g_attr[g_nattr++] = (attr_rec){k, attr, value, g_nlog, g_capturing != NULL};
    k->max_shared = value;
    return 0;
}
static int f_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                    unsigned shared, void **params, int pdl) {
    const kern *k = f;
    if (injected(F_LAUNCH)) return E_LAUNCH_FAILED;
    if (shared > (unsigned)k->max_shared) return E_INVALID_VALUE;
    /* the kernel's own thread limit (.maxntid / flat work-group size) and the grid limits of both drivers */
    if (bx > k->maxntid[0] || by > k->maxntid[1] || bz > k->maxntid[2] || (uint64_t)bx * by * bz > k->maxthreads)
        return E_INVALID_VALUE;
    if (!gx || !gy || !gz || gx > 2147483647u || gy > 65535 || gz > 65535) return E_INVALID_VALUE;
    rec r = {k, {gx, gy, gz, bx, by, bz, shared}, {0}, k->nparams, 0, pdl};
    for (int i = 0; i < k->nparams && i < MAXP; i++) { /* each parameter's bytes, as the binary sizes it */
        memcpy(&r.args[i], params[i], (size_t)(k->psize[i] < 8 ? k->psize[i] : 8));
        /* every parameter of these kernels is a pointer: NULL (an absent optional) or into a live allocation
         * (on the GPU the kernel would fault: the error surfaces at the launch or the next synchronize) */
        if (k->psize[i] == 8 && r.args[i] && !in_live(r.args[i])) return E_ILLEGAL_ADDRESS;
    }
    if (g_capturing) {
        graph *g = g_capturing;
        g->r = realloc(g->r, sizeof(rec) * (size_t)(g->n + 1));
        g->r[g->n++] = r;
        return 0;
    }
    if (g_nlog < MAXLOG) g_log[g_nlog++] = r;
    return exec_hook(r.args, r.nargs);
}
static int f_begin(void) {
    if (g_capturing) return 1;
    g_capturing = calloc(1, sizeof(graph));
    g_invalidated = 0;
    return 0;
}
static int f_end(void **g) {
    if (!g_capturing) return 1;
    *g = NULL;
    if (g_invalidated) {
        free(g_capturing->r);
        free(g_capturing);
        g_capturing = NULL;
        return E_CAPTURE_INVALIDATED;
    }
    *g = g_capturing;
    g_capturing = NULL;
    g_graphs++;
    return 0;
}
#ifdef FAKE_HIP
/* The HIP copy kinds honoured: the device side must be a live allocation, the host side must not be. */
static int copy_ok(int kind, const void *dst, const void *src) {
    if (kind == 1) return in_live((uint64_t)(uintptr_t)dst) && !in_live((uint64_t)(uintptr_t)src);
    if (kind == 2) return in_live((uint64_t)(uintptr_t)src) && !in_live((uint64_t)(uintptr_t)dst);
    if (kind == 3) return in_live((uint64_t)(uintptr_t)src) && in_live((uint64_t)(uintptr_t)dst);
    return 0;
}
#endif
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
    for (int i = 0; i < g->n; i++) {
        if (g_nlog < MAXLOG) {
            g_log[g_nlog] = g->r[i];
            g_log[g_nlog++].replay = 1;
        }
        if (exec_hook(g->r[i].args, g->r[i].nargs)) return E_LAUNCH_FAILED;
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

/* ---- IPC ------------------------------------------------------------------------------------------- */
#define MAXIPC 256
#define IPC_BYTES 64
static struct {
    void *p;
    size_t n;
} g_ipc[MAXIPC];
void fake_ipc(long out[5]) {
    long open_now = 0;
    for (int i = 0; i < MAXIPC; i++) open_now += g_ipc[i].p != NULL;
    long v[5] = {g_ipc_exported, g_ipc_opened, g_ipc_closed, open_now, (long)g_malloc_flags};
    memcpy(out, v, sizeof v);
}
static int ipc_handle(char *h, const void *p) {
    for (int i = 0; i < MAXLIVE; i++)
        if (g_live[i] && (uintptr_t)p >= (uintptr_t)g_live[i] && (uintptr_t)p < (uintptr_t)g_live[i] + g_live_n[i]) {
            memset(h, 0, IPC_BYTES);
            snprintf(h, IPC_BYTES, "/proc/%ld/fd/%d %zu", (long)getpid(), g_live_fd[i], g_live_n[i]);
            g_ipc_exported++;
            return 0;
        }
    return E_INVALID_VALUE; /* not device memory from the allocator */
}
static int ipc_open(void **out, const char *h, unsigned flags, int own_refused) {
    char path[IPC_BYTES];
    long pid = 0;
    int fd = -1;
    size_t n = 0;
    memcpy(path, h, IPC_BYTES);
    path[IPC_BYTES - 1] = 0;
    if (flags != 1 || sscanf(path, "/proc/%ld/fd/%d %zu", &pid, &fd, &n) != 3 || !n) return E_INVALID_VALUE;
    if (own_refused && pid == (long)getpid()) return E_INVALID_CONTEXT;
    *strchr(path, ' ') = 0;
    int f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) return E_INVALID_VALUE;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    close(f);
    if (p == MAP_FAILED) return E_INVALID_VALUE;
    for (int i = 0; i < MAXIPC; i++)
        if (!g_ipc[i].p) {
            g_ipc[i].p = p;
            g_ipc[i].n = n;
            g_ipc_opened++;
            *out = p;
            return 0;
        }
    munmap(p, n);
    return 2;
}
static int ipc_close(void *p) {
    for (int i = 0; i < MAXIPC; i++)
        if (p && g_ipc[i].p == p) {
            munmap(p, g_ipc[i].n);
            g_ipc[i].p = NULL;
            g_ipc_closed++;
            return 0;
        }
    return E_INVALID_VALUE; /* never opened, or closed already */
}

/* Every exported driver function starts with T: its name goes to the trace. */
#define T trace(__func__)

#ifdef FAKE_CUDA
/* CUDA's context is per thread: every call below needs one current on the calling thread (else
 * CUDA_ERROR_INVALID_CONTEXT), as a thread other than the one that opened the runtime finds none. */
static _Thread_local void *g_ctx;
#define CTX if (!g_ctx) return E_INVALID_CONTEXT
#define NOCAP if (refused_in_capture()) return E_CAPTURE_UNSUPPORTED
typedef unsigned long long CUdeviceptr;
int cuInit(unsigned f) { T; return (int)f; }
int cuDeviceGet(int *d, int o) { T; *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { T; (void)d; *c = (void *)1; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { T; (void)d; return 0; }
int cuCtxSetCurrent(void *c) { T; g_ctx = c; return 0; }
int cuGetErrorString(int r, const char **s) {
    *s = r == 1 ? "CUDA_ERROR_INVALID_VALUE" : r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 200 ? "CUDA_ERROR_INVALID_IMAGE"
       : r == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : r == 400 ? "CUDA_ERROR_INVALID_HANDLE" : r == 500 ? "CUDA_ERROR_NOT_FOUND"
       : r == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : r == 719 ? "CUDA_ERROR_LAUNCH_FAILED"
       : r == 900 ? "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" : r == 901 ? "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
       : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuModuleLoadData(void **m, const void *img) { T; CTX; NOCAP; return f_load(m, img) ? 200 : 0; }
int cuModuleUnload(void *m) { T; CTX; NOCAP; return f_unload(m); }
int cuModuleGetFunction(void **f, void *m, const char *n) { T; CTX; return f_getfn(f, m, n) ? 500 : 0; }
int cuFuncSetAttribute(void *f, int a, int v) { T; CTX; return f_attr(f, a, v); }
int cuMemAlloc_v2(CUdeviceptr *p, size_t n) { T; CTX; NOCAP; void *q = NULL; int r = f_alloc(&q, n); *p = (CUdeviceptr)(uintptr_t)q; return r ? 2 : 0; }
int cuMemFree_v2(CUdeviceptr p) { T; CTX; NOCAP; return f_free((void *)(uintptr_t)p) ? 1 : 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { T; CTX; NOCAP; STREAM(st); return h2d((void *)(uintptr_t)d, s, n); }
int cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { T; CTX; NOCAP; STREAM(st); return d2h(d, (const void *)(uintptr_t)s, n); }
int cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { T; CTX; NOCAP; STREAM(st); return d2d((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n); }
int cuStreamCreate(void **s, unsigned f) { T; CTX; (void)f; g_streams++; *s = (void *)2; return 0; }
int cuStreamDestroy_v2(void *s) { T; CTX; STREAM(s); perform(LONG_MAX); g_streams--; return 0; } /* its work completes */
int cuStreamSynchronize(void *s) { T; CTX; NOCAP; STREAM(s); stream_sync(); return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned f) { T; CTX; NOCAP; return f > 7 ? 1 : host_alloc(p, n); }
int cuMemFreeHost(void *p) { T; CTX; NOCAP; return host_free(p); }
int cuEventCreate(void **e, unsigned f) { T; CTX; return f > 7 ? 1 : event_create(e); }
int cuEventRecord(void *e, void *st) { T; CTX; NOCAP; STREAM(st); return event_record(e); }
int cuEventSynchronize(void *e) { T; CTX; NOCAP; return event_sync(e); }
int cuEventDestroy_v2(void *e) { T; CTX; return event_destroy(e); }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void *st, void **p, void **e) { T; CTX; STREAM(st); (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p, 0); }
/* cuLaunchKernelEx (cuda.h's CUlaunchConfig and CUlaunchAttribute layouts). Refused as the driver does: no
 * config, attributes announced but absent, extra and kernelParams both given, an attribute id the driver does
 * not know (INVALID_VALUE). Recorded: whether programmatic stream serialization (id 6) was allowed. */
typedef struct {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int allowed;
    } value;
} cu_attr;
typedef struct {
    unsigned gx, gy, gz, bx, by, bz, shared;
    void *stream;
    cu_attr *attrs;
    unsigned n;
} cu_config;
#define CU_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION 6
#define CU_ATTR_LAST_KNOWN 12
int cuLaunchKernelEx(const cu_config *c, void *f, void **p, void **e) {
    T;
    CTX;
    if (!c || (c->n && !c->attrs) || (p && e)) return E_INVALID_VALUE;
    STREAM(c->stream);
    int pdl = 0;
    for (unsigned i = 0; i < c->n; i++) {
        if (c->attrs[i].id < 0 || c->attrs[i].id > CU_ATTR_LAST_KNOWN) return E_INVALID_VALUE;
        if (c->attrs[i].id == CU_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION) pdl = c->attrs[i].value.allowed != 0;
    }
    return f_launch(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shared, p, pdl);
}
int cuStreamBeginCapture_v2(void *s, int m) { T; CTX; STREAM(s); (void)m; return f_begin(); }
int cuStreamEndCapture(void *s, void **g) { T; CTX; STREAM(s); return f_end(g); }
int cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long f) { T; CTX; (void)f; return f_inst(e, g); }
int cuGraphLaunch(void *e, void *s) { T; CTX; STREAM(s); return f_glaunch(e); }
int cuGraphExecDestroy(void *e) { T; CTX; (void)e; g_execs--; return 0; }
int cuGraphDestroy(void *g) { T; CTX; return f_gdestroy(g); }
typedef struct {
    char reserved[IPC_BYTES];
} CUipcMemHandle;
int cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) { T; CTX; return ipc_handle(h->reserved, (void *)(uintptr_t)p); }
int cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned f) {
    T;
    CTX;
    void *q = NULL;
    int r = ipc_open(&q, h.reserved, f, 1);
    *p = (CUdeviceptr)(uintptr_t)q;
    return r;
}
int cuIpcCloseMemHandle(CUdeviceptr p) { T; CTX; return ipc_close((void *)(uintptr_t)p); }
#endif

#ifdef FAKE_HIP
#define NOCAP if (refused_in_capture()) return E_CAPTURE_UNSUPPORTED
int hipInit(unsigned f) { T; return (int)f; }
int hipSetDevice(int d) { T; return d; }
const char *hipGetErrorString(int r) {
    return r == 1 ? "hipErrorInvalidValue" : r == 2 ? "hipErrorOutOfMemory" : r == 200 ? "hipErrorInvalidImage"
         : r == 400 ? "hipErrorInvalidHandle" : r == 500 ? "hipErrorNotFound" : r == 700 ? "hipErrorIllegalAddress" : r == 719 ? "hipErrorLaunchFailure"
         : r == 900 ? "hipErrorStreamCaptureUnsupported" : r == 901 ? "hipErrorStreamCaptureInvalidated"
         : "hipErrorUnknown";
}
int hipModuleLoadData(void **m, const void *img) { T; NOCAP; return f_load(m, img) ? 200 : 0; }
int hipModuleUnload(void *m) { T; return f_unload(m); }
int hipModuleGetFunction(void **f, void *m, const char *n) { T; return f_getfn(f, m, n) ? 500 : 0; }
int hipFuncSetAttribute(const void *f, int a, int v) { T; return f_attr((void *)f, a, v); }
int hipMalloc(void **p, size_t n) { T; NOCAP; return f_alloc(p, n) ? 2 : 0; }
int hipFree(void *p) { T; NOCAP; return f_free(p) ? 1 : 0; }
int hipMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) {
    T;
    NOCAP;
    STREAM(st);
    if (!copy_ok(kind, d, s)) return E_INVALID_VALUE;
    if (kind == 1) return h2d(d, s, n);
    if (kind == 3) return d2d(d, s, n);
    return d2h(d, s, n);
}
int hipStreamCreateWithFlags(void **s, unsigned f) { T; (void)f; g_streams++; *s = (void *)2; return 0; }
int hipStreamDestroy(void *s) { T; STREAM(s); perform(LONG_MAX); g_streams--; return 0; } /* its work completes */
int hipStreamSynchronize(void *s) { T; NOCAP; STREAM(s); stream_sync(); return 0; }
int hipHostMalloc(void **p, size_t n, unsigned f) { T; NOCAP; return f > 7 ? 1 : host_alloc(p, n); }
int hipHostFree(void *p) { T; NOCAP; return host_free(p); }
int hipEventCreateWithFlags(void **e, unsigned f) { T; return f > 7 ? 1 : event_create(e); }
int hipEventRecord(void *e, void *st) { T; NOCAP; STREAM(st); return event_record(e); }
int hipEventSynchronize(void *e) { T; NOCAP; return event_sync(e); }
int hipEventDestroy(void *e) { T; return event_destroy(e); }
int hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned sh, void *st, void **p, void **e) { T; STREAM(st); (void)e; return f_launch(f, gx, gy, gz, bx, by, bz, sh, p, 0); }
int hipStreamBeginCapture(void *s, int m) { T; STREAM(s); (void)m; return f_begin(); }
int hipStreamEndCapture(void *s, void **g) { T; STREAM(s); return f_end(g); }
int hipGraphInstantiate(void **e, void *g, void *n, char *l, size_t b) { T; (void)n; (void)l; (void)b; return f_inst(e, g); }
int hipGraphLaunch(void *e, void *s) { T; STREAM(s); return f_glaunch(e); }
int hipGraphExecDestroy(void *e) { T; (void)e; g_execs--; return 0; }
int hipGraphDestroy(void *g) { T; return f_gdestroy(g); }
typedef struct {
    char reserved[IPC_BYTES];
} hipIpcMemHandle_t;
int hipExtMallocWithFlags(void **p, size_t n, unsigned f) {
    T;
    NOCAP;
    if (f != 0 && f != 1 && f != 3) return E_INVALID_VALUE;
    g_malloc_flags = f;
    return f_alloc(p, n) ? 2 : 0;
}
int hipIpcGetMemHandle(hipIpcMemHandle_t *h, void *p) { T; return ipc_handle(h->reserved, p); }
int hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t h, unsigned f) { T; return ipc_open(p, h.reserved, f, 0); }
int hipIpcCloseMemHandle(void *p) { T; return ipc_close(p); }
#endif
