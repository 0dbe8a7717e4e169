/* v4rt: the v4compile C runtime ABI.
 *
 * One runtime handle runs one compiled program: it parses the launch table (buffers, code objects,
 * functions = ordered kernel calls whose parameters are all pointers: buffer + byte offset), loads every
 * code object once through a driver (hip, cuda, or host), allocates every buffer, and runs a function
 * launch by launch or as a graph captured once per function and replayed after that.
 *
 * Every call returns a v4rt_status; on failure v4rt_last_error() (per thread) says what, where and why.
 * The library never exits the process and has no link-time dependency on a GPU library: the driver's
 * shared library is opened with dlopen.
 */
#ifndef V4RT_H
#define V4RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define V4RT_ABI_VERSION 1u
#define V4RT_TABLE_VERSION 3u /* 2: per-call launch flags; collective calls; 3: buffer kinds 7 and 8 */

typedef struct v4rt v4rt;

typedef enum {
    V4RT_OK = 0,
    V4RT_E_ARG = 1,     /* a bad argument to an ABI call (unknown buffer, out-of-range copy, ...) */
    V4RT_E_ABI = 2,     /* the caller was built for another ABI version */
    V4RT_E_TABLE = 3,   /* the launch table is malformed, from another version, or tampered with */
    V4RT_E_DRIVER = 4,  /* the driver library cannot be opened or initialised */
    V4RT_E_MODULE = 5,  /* a code object failed to load */
    V4RT_E_SYMBOL = 6,  /* a kernel symbol is missing from its code object */
    V4RT_E_OOM = 7,     /* a buffer allocation failed */
    V4RT_E_LAUNCH = 8,  /* a kernel launch (or its shared-memory opt-in), copy or synchronisation failed */
    V4RT_E_GRAPH = 9    /* stream capture, graph instantiation or replay failed */
} v4rt_status;

/* Host driver: every kernel call is handed to this callback with its function and call index and its
 * pointer parameters (NULL for an absent optional). Return 0 on success. */
typedef int (*v4rt_host_kernel)(void *user, uint32_t function, uint32_t call, uint32_t n_params,
                                const uint64_t *params);

/* Collectives of a partitioned program (issue 18): a launch-table call whose code object index is
 * V4RT_COLLECTIVE is a collective, not a kernel: symbol "all_reduce" (sum), "all_gather" (last axis),
 * "all_gather_rows" (first axis) or "reduce_scatter_rows" (sum, each rank its part of the first axis),
 * grid = {group size, dtype (V4RT_F32 / V4RT_BF16 / V4RT_I64), 1}, block = {1, 1, 1}, shared = the element count of the
 * operand, parameters = {operand, result}. The driver runs it on its stream, in order with the kernels
 * (inside a captured graph: recorded and replayed with it): the host driver hands it to the host callback;
 * the GPU drivers enqueue NCCL (CUDA, libnccl.so.2) or RCCL (HIP, librccl.so) on communicators joined
 * with v4rt_comm_init, one per group size. */
#define V4RT_COLLECTIVE 0xFFFFFFFFu
#define V4RT_F32 0u
#define V4RT_BF16 1u
#define V4RT_I64 2u /* all_gather_rows of token ids (data parallel) */
#define V4RT_COMM_ID_BYTES 128u /* ncclUniqueId */

/* Buffer kinds (the table's u32 per buffer; runtime/schedule.py KIND_CODE): 0-6 plain device memory (arena, input,
 * pool, state, weight, output, scratch; the caller zeroes what must start zeroed), 7 PEERS (plain device memory:
 * the one-shot all-reduce's peer table, or the kernel calls' pointer tables, written by the caller), 8 SYMMETRIC:
 * memory other processes of the group map (issue 34: the one-shot all-reduce's region; the same size on every
 * rank), allocated through the driver's IPC-capable allocator (host: a memfd; CUDA: cuMemAlloc; HIP: fine-grained
 * uncached memory). Its handle (V4RT_IPC_HANDLE_BYTES, opaque) comes from v4rt_ipc_handle; the caller exchanges the
 * handles (over torch.distributed) and maps the peers' regions with v4rt_ipc_open, which returns each region's
 * address in this process (its own for `self`); they are unmapped at v4rt_close. */
#define V4RT_KIND_PEERS 7u
#define V4RT_KIND_SYMMETRIC 8u
#define V4RT_IPC_HANDLE_BYTES 64u /* cudaIpcMemHandle_t, hipIpcMemHandle_t; the host driver's fd path */

/* Copies from a copy table (issue 36: the prefix cache's boundary snapshots and its copy-on-write blocks).
 * The table, given once (v4rt_copy_table), lists byte ranges by group: range i of a group at index k is
 * bytes [offset + k * stride, + nbytes) of its buffer (k: a slot for a snapshot, a pool block for a block
 * copy). v4rt_copy issues every range of a group at one index, in table order, on the runtime's stream in
 * order with the kernels, outside any graph: SAVE copies them into host memory one after another (host_bytes:
 * their sum), RESTORE back from it, DEVICE into the same ranges at index `to`. Every range is checked against
 * its buffer before any is issued. The host driver hands each copy to the host callback first, as function
 * V4RT_COPY_CALL, call = the range's index in the table, parameters {dst, src, nbytes, kind}: the caller checks
 * its bytes and order (runtime/copy_check.py) as it checks every launch. */
#define V4RT_COPY_SAVE 0u
#define V4RT_COPY_RESTORE 1u
#define V4RT_COPY_DEVICE 2u
#define V4RT_COPY_CALL 0xFFFFFFFEu
typedef struct {
    uint32_t buffer, group;
    uint64_t offset;
    int64_t stride; /* may be negative: a slot's window rings are counted from the end of the pool */
    uint64_t nbytes;
} v4rt_range;

/* Probes (issue 35: the self-check's layer statistics on a GPU, check mode only): a function's probe table lists
 * byte ranges copied to host memory before or after chosen calls of that function when it runs launch by launch
 * (v4rt_run with graph = 0). Each copy goes on the runtime's stream in order with the kernels and has landed in
 * `host` when v4rt_run returns; the bytes are the buffer's as that call found (V4RT_PROBE_BEFORE) or left
 * (V4RT_PROBE_AFTER) them. v4rt_probe_table replaces the function's table (n = 0: none) after checking every
 * entry (its call, its range inside its buffer, a host pointer); on an error the table is unchanged. A graph run
 * of a function with probes is refused (V4RT_E_ARG): a captured graph never holds a probe, so the users' graphs
 * are what they would be without them. The host driver makes the copies as the GPU drivers do (d2h). */
#define V4RT_PROBE_AFTER 0u
#define V4RT_PROBE_BEFORE 1u
typedef struct {
    uint32_t call; /* the call's index in the function (the launch table's order) */
    uint32_t when; /* V4RT_PROBE_AFTER / V4RT_PROBE_BEFORE that call */
    uint32_t buffer;
    uint32_t reserved; /* 0 */
    uint64_t offset, nbytes;
    void *host; /* nbytes of host memory, valid while the table is set */
} v4rt_probe;

/* Counters, for checks and reports. */
typedef struct {
    uint64_t launches;  /* kernel calls issued to the driver outside capture */
    uint64_t captures;  /* graphs captured */
    uint64_t replays;   /* graph launches */
    uint64_t bytes_allocated;
} v4rt_stats;

uint32_t v4rt_abi_version(void);
const char *v4rt_last_error(void);

/* driver: "host", "hip" or "cuda"; driver_lib: the driver library path (NULL: the system's). */
v4rt_status v4rt_open(uint32_t abi_version, const char *driver, const char *driver_lib, const void *table,
                      size_t table_len, v4rt_host_kernel host_kernel, void *host_user, v4rt **out);
void v4rt_close(v4rt *rt);

uint32_t v4rt_num_buffers(const v4rt *rt);
uint32_t v4rt_num_functions(const v4rt *rt);
v4rt_status v4rt_buffer_info(const v4rt *rt, uint32_t buffer, uint64_t *address, uint64_t *nbytes);
/* A write returns once `src` may be reused; on a GPU the copy may still be in flight, ordered before
 * every later run, read and sync. */
v4rt_status v4rt_write(v4rt *rt, uint32_t buffer, uint64_t offset, const void *src, uint64_t nbytes);
v4rt_status v4rt_read(v4rt *rt, uint32_t buffer, uint64_t offset, void *dst, uint64_t nbytes);

/* Run function `function`: graph = 0 launch by launch; graph = 1 as a graph (captured on first use). */
v4rt_status v4rt_run(v4rt *rt, uint32_t function, int graph);
v4rt_status v4rt_sync(v4rt *rt);
v4rt_status v4rt_get_stats(const v4rt *rt, v4rt_stats *out);

/* The copy table (replaces the previous one) and one copy of a group's ranges (see V4RT_COPY_SAVE). */
v4rt_status v4rt_copy_table(v4rt *rt, uint32_t n, const v4rt_range *ranges);
v4rt_status v4rt_copy(v4rt *rt, uint32_t kind, uint32_t group, uint64_t index, uint64_t to, void *host,
                      uint64_t host_bytes);

/* The probe table of `function` (see V4RT_PROBE_AFTER): replaces the previous one; n = 0 clears it. */
v4rt_status v4rt_probe_table(v4rt *rt, uint32_t function, uint32_t n, const v4rt_probe *probes);

/* A communicator's unique id (V4RT_COMM_ID_BYTES bytes into `id`) from the collective library `comm_lib`
 * (NCCL / RCCL; NULL: the default of `driver`, "cuda" or "hip"); the caller shares it with the other
 * ranks of the group (torch.distributed's store). */
v4rt_status v4rt_comm_unique_id(const char *driver, const char *comm_lib, void *id);
/* Join this rank's communicators (GPU drivers): for each of `n_groups` group sizes `sizes[i]`, the group
 * of consecutive ranks holding `rank`, as rank `rank % sizes[i]`, from its unique id (`ids`: n_groups x
 * V4RT_COMM_ID_BYTES). Once per runtime, before running a function with collectives. */
v4rt_status v4rt_comm_init(v4rt *rt, const char *comm_lib, uint32_t rank, uint32_t n_groups, const uint32_t *sizes,
                           const void *ids);

/* The IPC handle of SYMMETRIC buffer `buffer` (V4RT_IPC_HANDLE_BYTES into `handle`). */
v4rt_status v4rt_ipc_handle(v4rt *rt, uint32_t buffer, void *handle);
/* Map the `n` regions of a group whose handles are `handles` (n x V4RT_IPC_HANDLE_BYTES, in rank order; entry
 * `self` is this runtime's own SYMMETRIC buffer `buffer`, which is not opened), each the size of `buffer`: their
 * addresses in this process into `addrs` (n entries). Once per runtime; unmapped at v4rt_close. */
v4rt_status v4rt_ipc_open(v4rt *rt, uint32_t buffer, uint32_t n, uint32_t self, const void *handles, uint64_t *addrs);

#ifdef __cplusplus
}
#endif
#endif
