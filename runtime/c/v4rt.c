/* The runtime core: launch-table parsing, buffers, code objects, eager runs and captured graphs.
 *
 * Launch table (little-endian; written by runtime/schedule.py):
 *   header  : magic "V4RTTBL1", u32 version, u32 n_buffers, u32 n_code, u32 n_functions,
 *             u64 payload bytes, u64 FNV-1a 64 checksum of the payload
 *   buffers : n_buffers x {u64 nbytes, u32 align, u32 kind} (kind <= V4RT_KIND_SYMMETRIC, v4rt.h)
 *   code    : n_code x {u64 size, bytes padded to 8}
 *   function: n_functions x {u32 n_calls, u32 flags, then n_calls x call}
 *   call    : {u32 code, u32 symbol length, u32 grid[3], u32 block[3], u32 shared, u32 n_params, u32 flags},
 *             symbol bytes padded to 8, n_params x {i64 buffer (-1: NULL), u64 byte offset}
 *             (code V4RT_COLLECTIVE: a collective, not a kernel; its fields as v4rt.h says)
 *             flags: V4DRV_LAUNCH_* (driver.h); bit 0 = programmatic dependent launch
 * A SYMMETRIC buffer (v4rt.h) is allocated with the driver's sym_alloc; the peers' regions mapped by
 * v4rt_ipc_open are unmapped at close, before the buffers are freed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

static _Thread_local char g_err[1024];

void v4rt_seterr(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
}


/* Put context in front of the error a driver just reported: "<context>: <driver's message>". */
static void wrap_err(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static void wrap_err(const char *fmt, ...) {
    char why[sizeof g_err];
    memcpy(why, g_err, sizeof why);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof g_err - 3) return;
    g_err[n] = ':';
    g_err[n + 1] = ' ';
    size_t room = sizeof g_err - (size_t)n - 3, len = 0;
    while (len < room && why[len]) len++;
    memcpy(g_err + n + 2, why, len);
    g_err[n + 2 + len] = 0;
}

uint32_t v4rt_abi_version(void) { return V4RT_ABI_VERSION; }
const char *v4rt_last_error(void) { return g_err; }

typedef struct call_t {
    uint32_t code;
    const char *symbol; /* points into the table copy */
    void *fn;
    uint32_t grid[3], block[3], shared, n_params, flags;
    struct call_t *owner; /* the first call of the same kernel (code object, symbol): it resolved fn */
    uint32_t shared_max;  /* on an owner: the most dynamic shared bytes any call of its kernel uses */
    int64_t *buffer;
    uint64_t *offset;
    uint64_t *param; /* resolved addresses */
} call_t;

typedef struct {
    uint32_t n_calls;
    call_t *calls;
    void *graph;
    v4rt_probe *probes; /* v4rt_probe_table: check-mode copies around its calls (uncaptured runs only) */
    uint32_t n_probes;
} func_t;

typedef struct {
    uint64_t nbytes, addr;
    uint32_t align, kind;
    int allocated;
} buf_t;

struct v4rt {
    v4drv drv;
    int drv_open;
    unsigned char *table; /* our copy: symbols point into it */
    uint32_t n_buffers, n_code, n_functions;
    buf_t *buffers;
    void **modules;
    func_t *functions;
    uint32_t n_collectives; /* collective calls in the table */
    v4rt_stats stats;
    v4rt_range *copies; /* the copy table (v4rt_copy_table) */
    uint32_t n_copies;
    uint64_t *peers; /* the peer regions mapped by v4rt_ipc_open (0: none, or this rank's own) */
    uint32_t n_peers;
};

typedef struct {
    const unsigned char *p, *end;
    int ok;
} reader;

static uint64_t rd(reader *r, unsigned nbytes) {
    uint64_t v = 0;
    if (!r->ok || (size_t)(r->end - r->p) < nbytes) {
        r->ok = 0;
        return 0;
    }
    for (unsigned i = 0; i < nbytes; i++) v |= (uint64_t)r->p[i] << (8 * i);
    r->p += nbytes;
    return v;
}

static const unsigned char *take(reader *r, uint64_t nbytes) {
    uint64_t padded = (nbytes + 7) & ~(uint64_t)7;
    if (!r->ok || nbytes > (uint64_t)(r->end - r->p) || padded > (uint64_t)(r->end - r->p)) {
        r->ok = 0;
        return NULL;
    }
    const unsigned char *q = r->p;
    r->p += padded;
    return q;
}

static uint64_t fnv1a(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* The device current on the calling thread (any thread may call the runtime, one at a time). */
static v4rt_status bind_thread(v4rt *rt) {
    if (rt->drv_open && rt->drv.bind_thread && rt->drv.bind_thread(&rt->drv)) {
        wrap_err("making the device current on this thread");
        return V4RT_E_DRIVER;
    }
    return V4RT_OK;
}

static void release(v4rt *rt) {
    (void)bind_thread(rt); /* freeing needs the device too; a failure here leaves nothing better to do */
    if (rt->functions) {
        for (uint32_t f = 0; f < rt->n_functions; f++) {
            func_t *fn = &rt->functions[f];
            if (fn->graph && rt->drv_open) rt->drv.graph_destroy(&rt->drv, fn->graph);
            if (fn->calls)
                for (uint32_t c = 0; c < fn->n_calls; c++) {
                    free(fn->calls[c].buffer);
                    free(fn->calls[c].offset);
                    free(fn->calls[c].param);
                }
            free(fn->calls);
            free(fn->probes);
        }
    }
    if (rt->peers && rt->drv_open)
        for (uint32_t i = 0; i < rt->n_peers; i++)
            if (rt->peers[i]) rt->drv.ipc_close(&rt->drv, rt->peers[i]);
    if (rt->buffers && rt->drv_open)
        for (uint32_t b = 0; b < rt->n_buffers; b++)
            if (rt->buffers[b].allocated) {
                if (rt->buffers[b].kind == V4RT_KIND_SYMMETRIC)
                    rt->drv.sym_free(&rt->drv, rt->buffers[b].addr);
                else
                    rt->drv.mem_free(&rt->drv, rt->buffers[b].addr);
            }
    if (rt->modules && rt->drv_open)
        for (uint32_t m = 0; m < rt->n_code; m++)
            if (rt->modules[m]) rt->drv.module_unload(&rt->drv, rt->modules[m]);
    if (rt->drv_open) rt->drv.shutdown(&rt->drv);
    free(rt->copies);
    free(rt->peers);
    free(rt->functions);
    free(rt->buffers);
    free(rt->modules);
    free(rt->table);
    free(rt);
}

static v4rt_status parse(v4rt *rt, const unsigned char **code_img, uint64_t *code_size) {
    reader r = {rt->table + 40, rt->table + 40, 1};
    const unsigned char *h = rt->table;
    uint64_t payload = 0;
    for (int i = 0; i < 8; i++) payload |= (uint64_t)h[24 + i] << (8 * i);
    r.end = r.p + payload;
    for (uint32_t b = 0; b < rt->n_buffers; b++) {
        rt->buffers[b].nbytes = rd(&r, 8);
        rt->buffers[b].align = (uint32_t)rd(&r, 4);
        rt->buffers[b].kind = (uint32_t)rd(&r, 4);
        if (r.ok && rt->buffers[b].kind > V4RT_KIND_SYMMETRIC) {
            v4rt_seterr("launch table: buffer %u: unknown kind %u", b, rt->buffers[b].kind);
            return V4RT_E_TABLE;
        }
    }
    for (uint32_t m = 0; m < rt->n_code; m++) {
        code_size[m] = rd(&r, 8);
        code_img[m] = take(&r, code_size[m]);
    }
    if (!r.ok) {
        v4rt_seterr("launch table: truncated in the buffer or code-object section");
        return V4RT_E_TABLE;
    }
    for (uint32_t f = 0; f < rt->n_functions; f++) {
        func_t *fn = &rt->functions[f];
        uint32_t n = (uint32_t)rd(&r, 4);
        (void)rd(&r, 4);
        if (!r.ok || n > (uint64_t)(r.end - r.p) / 44) {
            v4rt_seterr("launch table: function %u: bad call count", f);
            return V4RT_E_TABLE;
        }
        fn->calls = calloc(n ? n : 1, sizeof(call_t));
        if (!fn->calls) {
            v4rt_seterr("out of host memory reading the launch table");
            return V4RT_E_OOM;
        }
        fn->n_calls = n;
        for (uint32_t c = 0; c < n; c++) {
            call_t *k = &fn->calls[c];
            k->code = (uint32_t)rd(&r, 4);
            uint32_t slen = (uint32_t)rd(&r, 4);
            for (int i = 0; i < 3; i++) k->grid[i] = (uint32_t)rd(&r, 4);
            for (int i = 0; i < 3; i++) k->block[i] = (uint32_t)rd(&r, 4);
            k->shared = (uint32_t)rd(&r, 4);
            k->n_params = (uint32_t)rd(&r, 4);
            k->flags = (uint32_t)rd(&r, 4);
            const unsigned char *sym = take(&r, (uint64_t)slen + 1);
            if (!r.ok || sym[slen] != 0 || strlen((const char *)sym) != slen || slen == 0) {
                v4rt_seterr("launch table: function %u call %u: bad kernel symbol", f, c);
                return V4RT_E_TABLE;
            }
            k->symbol = (const char *)sym;
            if (k->flags & ~V4DRV_LAUNCH_FLAGS) {
                v4rt_seterr("launch table: function %u call %u (%s): unknown launch flags %#x", f, c, k->symbol,
                            k->flags & ~V4DRV_LAUNCH_FLAGS);
                return V4RT_E_TABLE;
            }
            if (k->code == V4RT_COLLECTIVE) {
                if ((strcmp(k->symbol, "all_reduce") != 0 && strcmp(k->symbol, "all_gather") != 0 &&
                     strcmp(k->symbol, "all_gather_rows") != 0 && strcmp(k->symbol, "reduce_scatter_rows") != 0) ||
                    !k->grid[0] || k->grid[1] > V4RT_I64 || k->n_params != 2 || !k->shared) {
                    v4rt_seterr("launch table: function %u call %u (%s): not a collective (all_reduce, all_gather, "
                                "all_gather_rows or reduce_scatter_rows of f32 / bf16 / i64 elements, operand and "
                                "result)", f, c, k->symbol);
                    return V4RT_E_TABLE;
                }
                rt->n_collectives++;
            } else if (k->code >= rt->n_code) {
                v4rt_seterr("launch table: function %u call %u (%s): code object %u of %u", f, c, k->symbol,
                            k->code, rt->n_code);
                return V4RT_E_TABLE;
            }
            if (k->code != V4RT_COLLECTIVE &&
                (!k->grid[0] || !k->grid[1] || !k->grid[2] || !k->block[0] || !k->block[1] || !k->block[2])) {
                v4rt_seterr("launch table: function %u call %u (%s): empty grid or block", f, c, k->symbol);
                return V4RT_E_TABLE;
            }
            if (k->n_params > (uint64_t)(r.end - r.p) / 16) {
                v4rt_seterr("launch table: function %u call %u (%s): truncated parameters", f, c, k->symbol);
                return V4RT_E_TABLE;
            }
            uint32_t np = k->n_params ? k->n_params : 1;
            k->buffer = calloc(np, sizeof(int64_t));
            k->offset = calloc(np, sizeof(uint64_t));
            k->param = calloc(np, sizeof(uint64_t));
            if (!k->buffer || !k->offset || !k->param) {
                v4rt_seterr("out of host memory reading the launch table");
                return V4RT_E_OOM;
            }
            for (uint32_t p = 0; p < k->n_params; p++) {
                k->buffer[p] = (int64_t)rd(&r, 8);
                k->offset[p] = rd(&r, 8);
                int64_t b = k->buffer[p];
                if (b < -1 || b >= (int64_t)rt->n_buffers || (b >= 0 && k->offset[p] > rt->buffers[b].nbytes) ||
                    (b < 0 && k->offset[p])) {
                    v4rt_seterr("launch table: function %u call %u (%s) parameter %u: buffer %lld offset %llu "
                                "outside the buffers", f, c, k->symbol, p, (long long)b,
                                (unsigned long long)k->offset[p]);
                    return V4RT_E_TABLE;
                }
            }
        }
    }
    if (!r.ok || r.p != r.end) {
        v4rt_seterr("launch table: %s", r.ok ? "trailing bytes after the last function" : "truncated");
        return V4RT_E_TABLE;
    }
    return V4RT_OK;
}

v4rt_status v4rt_open(uint32_t abi_version, const char *driver, const char *driver_lib, const void *table,
                      size_t table_len, v4rt_host_kernel host_kernel, void *host_user, v4rt **out) {
    g_err[0] = 0;
    if (!out) {
        v4rt_seterr("v4rt_open: no output handle pointer");
        return V4RT_E_ARG;
    }
    *out = NULL;
    if (abi_version != V4RT_ABI_VERSION) {
        v4rt_seterr("ABI version mismatch: the caller expects %u, this library is %u", abi_version,
                    V4RT_ABI_VERSION);
        return V4RT_E_ABI;
    }
    if (!driver || !table) {
        v4rt_seterr("v4rt_open: driver name and table are required");
        return V4RT_E_ARG;
    }
    const unsigned char *t = table;
    if (table_len < 40 || memcmp(t, "V4RTTBL1", 8) != 0) {
        v4rt_seterr("launch table: bad magic (not a v4rt launch table)");
        return V4RT_E_TABLE;
    }
    reader h = {t + 8, t + 40, 1};
    uint32_t version = (uint32_t)rd(&h, 4), nb = (uint32_t)rd(&h, 4), nc = (uint32_t)rd(&h, 4),
             nf = (uint32_t)rd(&h, 4);
    uint64_t payload = rd(&h, 8), sum = rd(&h, 8);
    if (version != V4RT_TABLE_VERSION) {
        v4rt_seterr("launch table: version %u, this runtime reads version %u", version, V4RT_TABLE_VERSION);
        return V4RT_E_TABLE;
    }
    if (payload != table_len - 40) {
        v4rt_seterr("launch table: %llu payload bytes, header says %llu (truncated or extended)",
                    (unsigned long long)(table_len - 40), (unsigned long long)payload);
        return V4RT_E_TABLE;
    }
    if (fnv1a(t + 40, payload) != sum) {
        v4rt_seterr("launch table: checksum mismatch (the file was changed or damaged)");
        return V4RT_E_TABLE;
    }
    if (nb > payload / 16 || nc > payload / 8 || nf > payload / 8) {
        v4rt_seterr("launch table: section counts exceed the table size");
        return V4RT_E_TABLE;
    }
    v4rt *rt = calloc(1, sizeof *rt);
    if (!rt) {
        v4rt_seterr("out of host memory");
        return V4RT_E_OOM;
    }
    rt->n_buffers = nb;
    rt->n_code = nc;
    rt->n_functions = nf;
    rt->table = malloc(table_len);
    rt->buffers = calloc(nb ? nb : 1, sizeof(buf_t));
    rt->modules = calloc(nc ? nc : 1, sizeof(void *));
    rt->functions = calloc(nf ? nf : 1, sizeof(func_t));
    const unsigned char **img = calloc(nc ? nc : 1, sizeof(*img));
    uint64_t *isz = calloc(nc ? nc : 1, sizeof(*isz));
    v4rt_status st = V4RT_OK;
    if (!rt->table || !rt->buffers || !rt->modules || !rt->functions || !img || !isz) {
        v4rt_seterr("out of host memory");
        st = V4RT_E_OOM;
        goto fail;
    }
    memcpy(rt->table, table, table_len);
    if ((st = parse(rt, img, isz)) != V4RT_OK) goto fail;

    int rc;
    if (strcmp(driver, "host") == 0) {
        if (!host_kernel) {
            v4rt_seterr("the host driver needs a kernel callback");
            st = V4RT_E_ARG;
            goto fail;
        }
        rc = v4drv_host_open(&rt->drv, host_kernel, host_user);
    } else if (strcmp(driver, "hip") == 0) {
        rc = v4drv_hip_open(&rt->drv, driver_lib);
    } else if (strcmp(driver, "cuda") == 0) {
        rc = v4drv_cuda_open(&rt->drv, driver_lib);
    } else {
        v4rt_seterr("unknown driver '%s' (expected host, hip or cuda)", driver);
        st = V4RT_E_ARG;
        goto fail;
    }
    if (rc) {
        st = V4RT_E_DRIVER;
        goto fail;
    }
    rt->drv_open = 1;
    if (rt->n_collectives && !rt->drv.collective) {
        v4rt_seterr("the launch table has %u collectives; the %s driver runs none", rt->n_collectives, driver);
        st = V4RT_E_DRIVER;
        goto fail;
    }
    for (uint32_t m = 0; m < nc; m++)
        if (rt->drv.module_load(&rt->drv, img[m], isz[m], &rt->modules[m])) {
            wrap_err("code object %u (%llu bytes) failed to load", m, (unsigned long long)isz[m]);
            rt->modules[m] = NULL;
            st = V4RT_E_MODULE;
            goto fail;
        }
    for (uint32_t f = 0; f < nf; f++)
        for (uint32_t c = 0; c < rt->functions[f].n_calls; c++) {
            call_t *k = &rt->functions[f].calls[c];
            if (k->code == V4RT_COLLECTIVE) continue; /* no kernel behind it */
            for (uint32_t g = 0; g <= f && !k->fn; g++) /* one lookup per (code object, symbol) */
                for (uint32_t d = 0; d < (g == f ? c : rt->functions[g].n_calls); d++) {
                    call_t *e = &rt->functions[g].calls[d];
                    if (e->code == k->code && strcmp(e->symbol, k->symbol) == 0) {
                        k->fn = e->fn;
                        k->owner = e->owner;
                        break;
                    }
                }
            if (!k->fn) {
                if (rt->drv.get_function(&rt->drv, rt->modules[k->code], k->symbol, &k->fn)) {
                    wrap_err("kernel symbol '%s' not found in code object %u (function %u call %u)", k->symbol,
                             k->code, f, c);
                    st = V4RT_E_SYMBOL;
                    goto fail;
                }
                k->owner = k;
            }
            if (k->shared > k->owner->shared_max) k->owner->shared_max = k->shared;
        }
    /* Dynamic shared memory above the driver's default needs a per-kernel opt-in: once, for the most any
     * call of the kernel uses, before anything is launched or captured. */
    for (uint32_t f = 0; f < nf && rt->drv.func_shared; f++)
        for (uint32_t c = 0; c < rt->functions[f].n_calls; c++) {
            call_t *k = &rt->functions[f].calls[c];
            if (k->code != V4RT_COLLECTIVE && k->owner == k && k->shared_max && rt->drv.func_shared(&rt->drv, k->fn, k->shared_max)) {
                wrap_err("kernel '%s' in code object %u: allowing %u bytes of dynamic shared memory failed",
                         k->symbol, k->code, k->shared_max);
                st = V4RT_E_LAUNCH;
                goto fail;
            }
        }
    for (uint32_t b = 0; b < nb; b++) {
        buf_t *bf = &rt->buffers[b];
        uint64_t n = bf->nbytes ? bf->nbytes : 1;
        int sym = bf->kind == V4RT_KIND_SYMMETRIC;
        if (sym && !rt->drv.sym_alloc) {
            v4rt_seterr("buffer %u is symmetric memory (the one-shot all-reduce's), which the %s driver cannot "
                        "allocate", b, rt->drv.name);
            st = V4RT_E_OOM;
            goto fail;
        }
        if (sym ? rt->drv.sym_alloc(&rt->drv, n, &bf->addr) : rt->drv.mem_alloc(&rt->drv, n, &bf->addr)) {
            wrap_err("allocating buffer %u (%llu bytes) failed", b, (unsigned long long)n);
            st = V4RT_E_OOM;
            goto fail;
        }
        bf->allocated = 1;
        rt->stats.bytes_allocated += n;
        if (bf->align && bf->addr % bf->align) {
            v4rt_seterr("buffer %u: the driver returned an address not aligned to %u bytes", b, bf->align);
            st = V4RT_E_OOM;
            goto fail;
        }
    }
    for (uint32_t f = 0; f < nf; f++)
        for (uint32_t c = 0; c < rt->functions[f].n_calls; c++) {
            call_t *k = &rt->functions[f].calls[c];
            for (uint32_t p = 0; p < k->n_params; p++)
                k->param[p] = k->buffer[p] < 0 ? 0 : rt->buffers[k->buffer[p]].addr + k->offset[p];
        }
    free(img);
    free(isz);
    *out = rt;
    return V4RT_OK;
fail:
    free(img);
    free(isz);
    release(rt);
    return st;
}

void v4rt_close(v4rt *rt) {
    if (rt) release(rt);
}

uint32_t v4rt_num_buffers(const v4rt *rt) { return rt ? rt->n_buffers : 0; }
uint32_t v4rt_num_functions(const v4rt *rt) { return rt ? rt->n_functions : 0; }

v4rt_status v4rt_buffer_info(const v4rt *rt, uint32_t buffer, uint64_t *address, uint64_t *nbytes) {
    if (!rt || buffer >= rt->n_buffers) {
        v4rt_seterr("buffer %u does not exist (%u buffers)", buffer, rt ? rt->n_buffers : 0);
        return V4RT_E_ARG;
    }
    if (address) *address = rt->buffers[buffer].addr;
    if (nbytes) *nbytes = rt->buffers[buffer].nbytes;
    return V4RT_OK;
}

static v4rt_status check_range(const v4rt *rt, uint32_t buffer, uint64_t offset, uint64_t n, const char *what) {
    if (!rt || buffer >= rt->n_buffers) {
        v4rt_seterr("%s: buffer %u does not exist", what, buffer);
        return V4RT_E_ARG;
    }
    uint64_t size = rt->buffers[buffer].nbytes;
    if (offset > size || n > size - offset) {
        v4rt_seterr("%s: bytes [%llu, %llu) outside buffer %u of %llu bytes", what, (unsigned long long)offset,
                    (unsigned long long)(offset + n), buffer, (unsigned long long)size);
        return V4RT_E_ARG;
    }
    return V4RT_OK;
}

v4rt_status v4rt_write(v4rt *rt, uint32_t buffer, uint64_t offset, const void *src, uint64_t nbytes) {
    v4rt_status st = check_range(rt, buffer, offset, nbytes, "write");
    if (st || !nbytes || (st = bind_thread(rt))) return st;
    return rt->drv.h2d(&rt->drv, rt->buffers[buffer].addr + offset, src, nbytes) ? V4RT_E_LAUNCH : V4RT_OK;
}

v4rt_status v4rt_read(v4rt *rt, uint32_t buffer, uint64_t offset, void *dst, uint64_t nbytes) {
    v4rt_status st = check_range(rt, buffer, offset, nbytes, "read");
    if (st || !nbytes || (st = bind_thread(rt))) return st;
    if (rt->drv.sync(&rt->drv)) return V4RT_E_LAUNCH;
    return rt->drv.d2h(&rt->drv, dst, rt->buffers[buffer].addr + offset, nbytes) ? V4RT_E_LAUNCH : V4RT_OK;
}

/* The probes of function f at call c, `when` it runs: each range copied to host memory on the stream (d2h: in
 * order with the kernels, landed when it returns). */
static v4rt_status probe(v4rt *rt, uint32_t f, uint32_t c, uint32_t when) {
    const func_t *fn = &rt->functions[f];
    for (uint32_t i = 0; i < fn->n_probes; i++) {
        const v4rt_probe *p = &fn->probes[i];
        if (p->call != c || p->when != when) continue;
        if (rt->drv.d2h(&rt->drv, p->host, rt->buffers[p->buffer].addr + p->offset, p->nbytes)) {
            wrap_err("function %u call %u: probe %u (buffer %u, %llu bytes)", f, c, i, p->buffer,
                     (unsigned long long)p->nbytes);
            return V4RT_E_LAUNCH;
        }
    }
    return V4RT_OK;
}

static v4rt_status issue(v4rt *rt, uint32_t f) {
    func_t *fn = &rt->functions[f];
    for (uint32_t c = 0; c < fn->n_calls; c++) {
        call_t *k = &fn->calls[c];
        uint64_t tag = ((uint64_t)f << 32) | c;
        v4rt_status ps = fn->n_probes ? probe(rt, f, c, V4RT_PROBE_BEFORE) : V4RT_OK;
        if (ps) return ps;
        if (k->code == V4RT_COLLECTIVE) {
            if (rt->drv.collective(&rt->drv, k->symbol, k->grid[0], k->grid[1], k->shared, k->param[0], k->param[1],
                                   tag)) {
                wrap_err("function %u call %u (%s over %u ranks): collective failed", f, c, k->symbol, k->grid[0]);
                return V4RT_E_LAUNCH;
            }
        } else if (rt->drv.launch(&rt->drv, k->fn, k->grid, k->block, k->shared, k->n_params, k->param, tag,
                                  k->flags)) {
            wrap_err("function %u call %u (%s): launch failed", f, c, k->symbol);
            return V4RT_E_LAUNCH;
        }
        if (fn->n_probes && (ps = probe(rt, f, c, V4RT_PROBE_AFTER))) return ps;
    }
    return V4RT_OK;
}

v4rt_status v4rt_run(v4rt *rt, uint32_t function, int graph) {
    if (!rt || function >= rt->n_functions) {
        v4rt_seterr("function %u does not exist (%u functions)", function, rt ? rt->n_functions : 0);
        return V4RT_E_ARG;
    }
    func_t *fn = &rt->functions[function];
    v4rt_status bt = bind_thread(rt);
    if (bt) return bt;
    if (graph && fn->n_probes) {
        v4rt_seterr("function %u has %u probes: probes are made in runs launch by launch only, never in a graph",
                    function, fn->n_probes);
        return V4RT_E_ARG;
    }
    if (!graph) {
        v4rt_status st = issue(rt, function);
        if (st == V4RT_OK) rt->stats.launches += fn->n_calls;
        return st;
    }
    if (!fn->graph) {
        if (rt->drv.capture_begin(&rt->drv)) {
            wrap_err("capturing function %u", function);
            return V4RT_E_GRAPH;
        }
        v4rt_status st = issue(rt, function);
        char why[sizeof g_err];
        memcpy(why, g_err, sizeof why); /* the launch's error, before ending the capture reports its own */
        void *g = NULL;
        int rc = rt->drv.capture_end(&rt->drv, &g); /* always end the capture, even after a failed launch */
        if (st) {
            if (!rc && g) rt->drv.graph_destroy(&rt->drv, g);
            memcpy(g_err, why, sizeof g_err);
            wrap_err("capturing function %u", function);
            return st;
        }
        if (rc) {
            wrap_err("capturing function %u", function);
            return V4RT_E_GRAPH;
        }
        fn->graph = g;
        rt->stats.captures++;
    }
    if (rt->drv.graph_launch(&rt->drv, fn->graph)) {
        wrap_err("replaying function %u", function);
        return V4RT_E_GRAPH;
    }
    rt->stats.replays++;
    return V4RT_OK;
}

v4rt_status v4rt_sync(v4rt *rt) {
    if (!rt) {
        v4rt_seterr("v4rt_sync: no runtime");
        return V4RT_E_ARG;
    }
    v4rt_status st = bind_thread(rt);
    if (st) return st;
    return rt->drv.sync(&rt->drv) ? V4RT_E_LAUNCH : V4RT_OK;
}

v4rt_status v4rt_get_stats(const v4rt *rt, v4rt_stats *out) {
    if (!rt || !out) {
        v4rt_seterr("v4rt_get_stats: no runtime or output");
        return V4RT_E_ARG;
    }
    *out = rt->stats;
    return V4RT_OK;
}

static const char *comm_default(const char *driver) {
    return !driver ? NULL : strcmp(driver, "cuda") == 0 ? "libnccl.so.2" : strcmp(driver, "hip") == 0 ? "librccl.so" : NULL;
}

v4rt_status v4rt_comm_unique_id(const char *driver, const char *comm_lib, void *id) {
    const char *lib = comm_lib ? comm_lib : comm_default(driver);
    if (!lib || !id) {
        v4rt_seterr("v4rt_comm_unique_id: a GPU driver (cuda, hip) or a library path, and an output, are required");
        return V4RT_E_ARG;
    }
    return v4comm_unique_id(lib, id) ? V4RT_E_DRIVER : V4RT_OK;
}

v4rt_status v4rt_comm_init(v4rt *rt, const char *comm_lib, uint32_t rank, uint32_t n_groups, const uint32_t *sizes,
                           const void *ids) {
    if (!rt || !sizes || !ids) {
        v4rt_seterr("v4rt_comm_init: runtime, group sizes and ids are required");
        return V4RT_E_ARG;
    }
    if (!rt->drv.comm_init) {
        v4rt_seterr("the %s driver joins no communicators (its collectives run in the host callback)", rt->drv.name);
        return V4RT_E_ARG;
    }
    v4rt_status st = bind_thread(rt);
    if (st) return st;
    return rt->drv.comm_init(&rt->drv, comm_lib, rank, n_groups, sizes, ids) ? V4RT_E_DRIVER : V4RT_OK;
}

/* A table the caller handed over (every entry already checked), copied in place of the old one: on failure the
 * old table stays. An empty table holds no memory. */
static v4rt_status replace_table(void **table, uint32_t *count, const void *entries, uint32_t n, size_t size,
                                 const char *what) {
    void *t = NULL;
    if (n && !(t = malloc(n * size))) {
        v4rt_seterr("out of host memory for the %s", what);
        return V4RT_E_OOM;
    }
    if (n) memcpy(t, entries, n * size);
    free(*table);
    *table = t;
    *count = n;
    return V4RT_OK;
}

v4rt_status v4rt_copy_table(v4rt *rt, uint32_t n, const v4rt_range *ranges) {
    if (!rt || (n && !ranges)) {
        v4rt_seterr("v4rt_copy_table: no runtime or no ranges");
        return V4RT_E_ARG;
    }
    for (uint32_t i = 0; i < n; i++) { /* index 0 must fit; a larger index is checked at each copy */
        v4rt_status st = check_range(rt, ranges[i].buffer, ranges[i].offset, ranges[i].nbytes, "copy table");
        if (st) return st;
    }
    return replace_table((void **)&rt->copies, &rt->n_copies, ranges, n, sizeof *ranges, "copy table");
}

/* Range r at index k: its byte offset, checked against the buffer (overflow-safe, either sign of stride). */
static v4rt_status range_at(const v4rt *rt, const v4rt_range *r, uint64_t k, uint64_t *off) {
    uint64_t size = rt->buffers[r->buffer].nbytes;
    uint64_t step = r->stride < 0 ? (uint64_t)0 - (uint64_t)r->stride : (uint64_t)r->stride;
    uint64_t room = r->stride < 0 ? r->offset : size - r->offset; /* offset <= size: the table was checked */
    if (step && k > room / step) {
        v4rt_seterr("copy: index %llu outside buffer %u (%llu bytes)", (unsigned long long)k, r->buffer,
                    (unsigned long long)size);
        return V4RT_E_ARG;
    }
    *off = r->stride < 0 ? r->offset - k * step : r->offset + k * step;
    return check_range(rt, r->buffer, *off, r->nbytes, "copy");
}

v4rt_status v4rt_copy(v4rt *rt, uint32_t kind, uint32_t group, uint64_t index, uint64_t to, void *host,
                      uint64_t host_bytes) {
    if (!rt || kind > V4RT_COPY_DEVICE || (kind != V4RT_COPY_DEVICE && !host)) {
        v4rt_seterr("v4rt_copy: no runtime, an unknown kind %u, or no host memory", kind);
        return V4RT_E_ARG;
    }
    uint64_t total = 0, off, to_off;
    uint32_t n = 0;
    for (uint32_t i = 0; i < rt->n_copies; i++) { /* every range checked before any copy is issued */
        const v4rt_range *r = &rt->copies[i];
        if (r->group != group) continue;
        v4rt_status st = range_at(rt, r, index, &off);
        if (!st && kind == V4RT_COPY_DEVICE) st = range_at(rt, r, to, &to_off);
        if (st) return st;
        total += r->nbytes;
        n++;
    }
    if (!n) {
        v4rt_seterr("copy: group %u has no ranges in the copy table", group);
        return V4RT_E_ARG;
    }
    if (kind != V4RT_COPY_DEVICE && host_bytes != total) {
        v4rt_seterr("copy: group %u holds %llu bytes, the host side %llu", group, (unsigned long long)total,
                    (unsigned long long)host_bytes);
        return V4RT_E_ARG;
    }
    v4rt_status st = bind_thread(rt);
    if (st) return st;
    unsigned char *h = host;
    for (uint32_t i = 0; i < rt->n_copies; i++) {
        const v4rt_range *r = &rt->copies[i];
        if (r->group != group) continue;
        (void)range_at(rt, r, index, &off);
        uint64_t dev = rt->buffers[r->buffer].addr + off, dst, src;
        if (kind == V4RT_COPY_SAVE) {
            dst = (uint64_t)(uintptr_t)h;
            src = dev;
        } else if (kind == V4RT_COPY_RESTORE) {
            dst = dev;
            src = (uint64_t)(uintptr_t)h;
        } else {
            (void)range_at(rt, r, to, &to_off);
            dst = rt->buffers[r->buffer].addr + to_off;
            src = dev;
        }
        if (rt->drv.copy(&rt->drv, kind, dst, src, r->nbytes, ((uint64_t)V4RT_COPY_CALL << 32) | i)) {
            wrap_err("copy %u (group %u, buffer %u)", i, group, r->buffer);
            return V4RT_E_LAUNCH;
        }
        if (h) h += r->nbytes;
    }
    return V4RT_OK;
}

v4rt_status v4rt_probe_table(v4rt *rt, uint32_t function, uint32_t n, const v4rt_probe *probes) {
    if (!rt || function >= rt->n_functions || (n && !probes)) {
        v4rt_seterr("v4rt_probe_table: no runtime, function %u does not exist (%u functions), or no probes", function,
                    rt ? rt->n_functions : 0);
        return V4RT_E_ARG;
    }
    func_t *fn = &rt->functions[function];
    for (uint32_t i = 0; i < n; i++) { /* every entry checked before the table changes */
        const v4rt_probe *p = &probes[i];
        char what[64];
        snprintf(what, sizeof what, "probe %u of function %u", i, function);
        if (p->call >= fn->n_calls || p->when > V4RT_PROBE_BEFORE || p->reserved || !p->host || !p->nbytes) {
            v4rt_seterr("%s: call %u of %u, when %u, reserved %u, host %s, %llu bytes (expected a call of the "
                        "function, V4RT_PROBE_AFTER or _BEFORE, 0, a host pointer and some bytes)", what, p->call,
                        fn->n_calls, p->when, p->reserved, p->host ? "set" : "NULL", (unsigned long long)p->nbytes);
            return V4RT_E_ARG;
        }
        v4rt_status st = check_range(rt, p->buffer, p->offset, p->nbytes, what);
        if (st) return st;
    }
    return replace_table((void **)&fn->probes, &fn->n_probes, probes, n, sizeof *probes, "probe table");
}

static v4rt_status symmetric(const v4rt *rt, uint32_t buffer, const char *what) {
    if (!rt || buffer >= rt->n_buffers || rt->buffers[buffer].kind != V4RT_KIND_SYMMETRIC) {
        v4rt_seterr("%s: buffer %u is not a symmetric buffer of the runtime", what, buffer);
        return V4RT_E_ARG;
    }
    return V4RT_OK;
}

v4rt_status v4rt_ipc_handle(v4rt *rt, uint32_t buffer, void *handle) {
    v4rt_status st = symmetric(rt, buffer, "v4rt_ipc_handle");
    if (st) return st;
    if (!handle) {
        v4rt_seterr("v4rt_ipc_handle: no output");
        return V4RT_E_ARG;
    }
    if ((st = bind_thread(rt))) return st;
    memset(handle, 0, V4RT_IPC_HANDLE_BYTES);
    if (rt->drv.ipc_handle(&rt->drv, rt->buffers[buffer].addr, handle)) {
        wrap_err("exporting symmetric buffer %u", buffer);
        return V4RT_E_DRIVER;
    }
    return V4RT_OK;
}

v4rt_status v4rt_ipc_open(v4rt *rt, uint32_t buffer, uint32_t n, uint32_t self, const void *handles, uint64_t *addrs) {
    v4rt_status st = symmetric(rt, buffer, "v4rt_ipc_open");
    if (st) return st;
    if (!handles || !addrs || !n || self >= n || n > 1024) {
        v4rt_seterr("v4rt_ipc_open: %u regions, self %u (expected 1-1024 handles and addresses, self among them)", n,
                    self);
        return V4RT_E_ARG;
    }
    if (rt->peers) {
        v4rt_seterr("v4rt_ipc_open: the peers' regions are already mapped");
        return V4RT_E_ARG;
    }
    if ((st = bind_thread(rt))) return st;
    if (!(rt->peers = calloc(n, sizeof(uint64_t)))) {
        v4rt_seterr("out of host memory");
        return V4RT_E_OOM;
    }
    rt->n_peers = n;
    const unsigned char *h = handles;
    for (uint32_t i = 0; i < n; i++) {
        if (i == self) {
            addrs[i] = rt->buffers[buffer].addr;
            continue;
        }
        if (rt->drv.ipc_open(&rt->drv, h + (size_t)i * V4RT_IPC_HANDLE_BYTES, rt->buffers[buffer].nbytes,
                             &rt->peers[i])) {
            wrap_err("mapping the symmetric region of peer %u of %u", i, n);
            return V4RT_E_DRIVER; /* the ones mapped so far are unmapped at v4rt_close */
        }
        addrs[i] = rt->peers[i];
    }
    return V4RT_OK;
}
