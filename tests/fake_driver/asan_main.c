/* Drives the C runtime through success and failure paths for AddressSanitizer / LeakSanitizer:
 *   asan_main TABLE FAKE_TABLE FAKE_CUDA_LIB FAKE_HIP_LIB FAKE_SHARED_TABLE
 * TABLE is a host table; FAKE_TABLE the same with fake code objects; FAKE_SHARED_TABLE that with one call
 * asking for more dynamic shared memory than either driver's default (an opt-in at open). Built with
 * small staging buffers (V4RT_STAGE_*), so the fake drivers' buffers are written through them. Exits
 * non-zero on any surprise. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "v4rt.h"

static long g_calls;
static int count(void *u, uint32_t f, uint32_t c, uint32_t n, const uint64_t *p) {
    (void)u; (void)f; (void)c; (void)n; (void)p;
    g_calls++;
    return 0;
}
static int failing(void *u, uint32_t f, uint32_t c, uint32_t n, const uint64_t *p) {
    (void)u; (void)f; (void)n; (void)p;
    return c == 3;
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*n);
    if (fread(b, 1, *n, f) != *n) *n = 0;
    fclose(f);
    return b;
}

#define EXPECT(cond, what)                          \
    do {                                            \
        if (!(cond)) {                              \
            fprintf(stderr, "FAILED: %s (%s)\n", what, v4rt_last_error()); \
            return 1;                               \
        }                                           \
    } while (0)

static int run_all(v4rt *rt) {
    for (uint32_t f = 0; f < v4rt_num_functions(rt); f++) {
        EXPECT(v4rt_run(rt, f, 0) == V4RT_OK, "eager run");
        EXPECT(v4rt_run(rt, f, 1) == V4RT_OK, "capture + replay");
        EXPECT(v4rt_run(rt, f, 1) == V4RT_OK, "replay");
    }
    unsigned char buf[64];
    /* probes: set (before and after the first call, up to 64 bytes of the first buffer with bytes), made in an
     * eager run, refused in a graph run and when out of range (the table then unchanged), cleared; a table left
     * set is freed at close */
    uint64_t n0 = 0;
    uint32_t b0 = 0;
    while (b0 < v4rt_num_buffers(rt) && v4rt_buffer_info(rt, b0, NULL, &n0) == V4RT_OK && !n0) b0++;
    EXPECT(n0 > 0, "a buffer with bytes");
    v4rt_probe pr[2] = {{0, V4RT_PROBE_BEFORE, b0, 0, 0, n0 < 64 ? n0 : 64, buf},
                        {0, V4RT_PROBE_AFTER, b0, 0, 0, n0 < 64 ? n0 : 64, buf}};
    EXPECT(v4rt_probe_table(rt, 0, 2, pr) == V4RT_OK, "probe table");
    EXPECT(v4rt_run(rt, 0, 0) == V4RT_OK, "eager run with probes");
    EXPECT(v4rt_run(rt, 0, 1) == V4RT_E_ARG, "a graph run with probes");
    pr[1].offset = n0;
    EXPECT(v4rt_probe_table(rt, 0, 2, pr) == V4RT_E_ARG, "a probe outside its buffer");
    EXPECT(v4rt_run(rt, 0, 0) == V4RT_OK, "the previous table holds");
    EXPECT(v4rt_probe_table(rt, 0, 0, NULL) == V4RT_OK, "probes cleared");
    EXPECT(v4rt_run(rt, 0, 1) == V4RT_OK, "a graph run without probes");
    EXPECT(v4rt_probe_table(rt, 0, 1, pr) == V4RT_OK, "a table left set");
    EXPECT(v4rt_write(rt, 0, 0, buf, 0) == V4RT_OK, "empty write");
    EXPECT(v4rt_read(rt, 9999, 0, buf, 1) == V4RT_E_ARG, "read of a bad buffer");
    EXPECT(v4rt_run(rt, 9999, 0) == V4RT_E_ARG, "run of a bad function");
    return 0;
}

/* The symmetric buffer (the tables' last) of two runtimes of this process: handles exported (a plain buffer's
 * refused), each mapping the other's region: the bytes one writes are the bytes the other's mapping holds (host,
 * fake HIP), or refused as CUDA refuses a handle opened in the process that exported it (`same_process_ok` 0); a
 * second mapping refused; closing unmaps (ASan / LeakSanitizer and the fake's counts see the rest). */
static int ipc_pair(v4rt *a, v4rt *b, int same_process_ok) {
    uint32_t sb = v4rt_num_buffers(a) - 1;
    unsigned char h[2 * V4RT_IPC_HANDLE_BYTES];
    uint64_t addrs[2] = {0, 0}, own = 0, n = 0;
    EXPECT(v4rt_ipc_handle(a, 0, h) == V4RT_E_ARG, "a plain buffer has no IPC handle");
    EXPECT(v4rt_ipc_handle(a, sb, h) == V4RT_OK && v4rt_ipc_handle(b, sb, h + V4RT_IPC_HANDLE_BYTES) == V4RT_OK,
           "IPC handles");
    v4rt_status st = v4rt_ipc_open(a, sb, 2, 0, h, addrs);
    if (!same_process_ok) {
        EXPECT(st == V4RT_E_DRIVER, "a handle opened in the process that exported it is refused");
        return 0;
    }
    EXPECT(st == V4RT_OK, "mapping the peer's region");
    EXPECT(v4rt_buffer_info(a, sb, &own, &n) == V4RT_OK && addrs[0] == own && addrs[1] && addrs[1] != own,
           "the table: its own region, then the peer's mapping");
    unsigned char pat[64];
    for (int i = 0; i < 64; i++) pat[i] = (unsigned char)(i * 13 + 5);
    EXPECT(v4rt_write(b, sb, n - 64, pat, 64) == V4RT_OK && v4rt_sync(b) == V4RT_OK, "a write into the peer's region");
    EXPECT(!memcmp((const void *)(uintptr_t)(addrs[1] + n - 64), pat, 64), "the mapping holds the peer's bytes");
    EXPECT(v4rt_ipc_open(a, sb, 2, 0, h, addrs) == V4RT_E_ARG, "a second mapping is refused");
    return 0;
}

/* Every buffer written with a pattern, in pieces of odd sizes (large ones go through the pinned staging
 * buffers, which the test build makes small), then read back and compared. */
static int roundtrip(v4rt *rt) {
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t b = 0; b < v4rt_num_buffers(rt); b++) {
            uint64_t n = 0;
            EXPECT(v4rt_buffer_info(rt, b, NULL, &n) == V4RT_OK, "buffer info");
            unsigned char *p = malloc(n ? n : 1), *q = malloc(n ? n : 1);
            EXPECT(p && q, "host memory");
            for (uint64_t i = 0; i < n; i++) /* no period that a misplaced piece could repeat */
                p[i] = (unsigned char)(i * 7 + (i >> 8) * 3 + (i >> 16) + b + pass);
            for (uint64_t at = 0; at < n;) {
                uint64_t k = n - at < 3001 ? n - at : 3001;
                EXPECT(v4rt_write(rt, b, at, p + at, k) == V4RT_OK, "write");
                at += k;
            }
            if (pass) {
                EXPECT(v4rt_read(rt, b, 0, q, n) == V4RT_OK, "read");
                EXPECT(!n || !memcmp(p, q, n), "a buffer read back as written");
            }
            free(p);
            free(q);
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) return 2;
    size_t n, nf, ns;
    unsigned char *t = slurp(argv[1], &n), *ft = slurp(argv[2], &nf), *st = slurp(argv[5], &ns);
    EXPECT(t && ft && st && n && nf && ns, "reading the tables");
    v4rt *rt = NULL;
    EXPECT(v4rt_open(V4RT_ABI_VERSION, "host", NULL, t, n, count, NULL, &rt) == V4RT_OK, "host open");
    if (run_all(rt)) return 1;
    v4rt *peer = NULL;
    EXPECT(v4rt_open(V4RT_ABI_VERSION, "host", NULL, t, n, count, NULL, &peer) == V4RT_OK, "host open (peer)");
    if (ipc_pair(rt, peer, 1)) return 1;
    v4rt_close(peer);
    v4rt_close(rt);
    EXPECT(v4rt_open(V4RT_ABI_VERSION, "host", NULL, t, n, failing, NULL, &rt) == V4RT_OK, "host open 2");
    EXPECT(v4rt_run(rt, 0, 1) == V4RT_E_GRAPH, "a failing kernel in a replay (capture only records)");
    EXPECT(v4rt_run(rt, 0, 0) == V4RT_E_LAUNCH, "a failing kernel");
    v4rt_close(rt);
    EXPECT(v4rt_open(V4RT_ABI_VERSION + 1, "host", NULL, t, n, count, NULL, &rt) == V4RT_E_ABI && !rt, "abi");
    t[n / 2] ^= 1;
    EXPECT(v4rt_open(V4RT_ABI_VERSION, "host", NULL, t, n, count, NULL, &rt) == V4RT_E_TABLE, "tampered");
    t[n / 2] ^= 1;
    EXPECT(v4rt_open(V4RT_ABI_VERSION, "host", NULL, t, n - 8, count, NULL, &rt) == V4RT_E_TABLE, "truncated");
    for (int d = 0; d < 2; d++) {
        const char *drv = d ? "hip" : "cuda", *lib = argv[3 + d];
        void *h = dlopen(lib, RTLD_NOW);
        EXPECT(h, "dlopen fake");
        void (*fail)(const char *, long) = (void (*)(const char *, long))dlsym(h, "fake_fail");
        void (*counts)(long *) = (void (*)(long *))dlsym(h, "fake_counts");
        void (*reset)(void) = (void (*)(void))dlsym(h, "fake_reset");
        long c[13]; /* fake_counts */
        reset();
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, ft, nf, NULL, NULL, &rt) == V4RT_OK, "fake open");
        if (run_all(rt) || roundtrip(rt)) return 1;
        v4rt *peer = NULL;
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, ft, nf, NULL, NULL, &peer) == V4RT_OK, "fake open (peer)");
        if (ipc_pair(rt, peer, d == 1)) return 1;
        v4rt_close(peer);
        v4rt_close(rt);
        void (*ipc)(long *) = (void (*)(long *))dlsym(h, "fake_ipc");
        long ip[5]; /* fake_ipc: exported, opened, closed, open now, hipExtMallocWithFlags' last flags */
        ipc(ip);
        EXPECT(ip[0] == 2 && ip[1] == d && ip[2] == d && ip[3] == 0 && ip[4] == (d ? 3 : 0), "the fake's IPC record");
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, t, n, NULL, NULL, &rt) == V4RT_E_MODULE, "bad image");
        reset();
        fail("alloc", 3);
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, ft, nf, NULL, NULL, &rt) == V4RT_E_OOM, "oom");
        counts(c);
        EXPECT(c[2] == 0 && c[8] == 0 && c[3] == c[4], "nothing leaked after oom");
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, "/nonexistent/libfake.so", ft, nf, NULL, NULL, &rt) == V4RT_E_DRIVER,
               "missing driver");
        /* failures inside runs: each leaves the runtime usable, and closing it frees everything */
        struct {
            const char *kind;
            int graph;
            v4rt_status want;
        } runs[] = {{"instantiate", 1, V4RT_E_GRAPH}, {"launch", 1, V4RT_E_LAUNCH}, {"graph_launch", 1, V4RT_E_GRAPH},
                    {"launch", 0, V4RT_E_LAUNCH}};
        for (int i = 0; i < 4; i++) {
            reset();
            EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, ft, nf, NULL, NULL, &rt) == V4RT_OK, "fake open 2");
            fail(runs[i].kind, 1);
            EXPECT(v4rt_run(rt, 0, runs[i].graph) == runs[i].want, runs[i].kind);
            if (run_all(rt)) return 1;
            v4rt_close(rt);
            counts(c);
            EXPECT(c[2] == 0 && c[8] == 0 && c[9] == 0 && c[10] == 0 && c[3] == c[4], "nothing leaked after a failed run");
        }
        reset();
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, st, ns, NULL, NULL, &rt) == V4RT_OK, "large shared memory");
        counts(c);
        EXPECT(c[11] == 1, "one opt-in");
        if (run_all(rt)) return 1;
        v4rt_close(rt);
        reset();
        fail("attr", 1);
        EXPECT(v4rt_open(V4RT_ABI_VERSION, drv, lib, st, ns, NULL, NULL, &rt) == V4RT_E_LAUNCH && !rt, "opt-in refused");
        counts(c);
        EXPECT(c[2] == 0 && c[8] == 0 && c[3] == c[4], "nothing leaked after a refused opt-in");
        dlclose(h);
    }
    free(t);
    free(ft);
    free(st);
    printf("asan_main: ok (%ld host kernel calls)\n", g_calls);
    return 0;
}
