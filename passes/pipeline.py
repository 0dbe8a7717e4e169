"""The pass pipelines, one named list per target: the one place that lists them.

* `gpu` (the default): down to the program (`lower_to_program`): exact buffers and launches that
  codegen and the C runtime execute.
* `cpu`: the lowered graph the ONNX export turns into one ONNX model per function; ONNX Runtime plans
  its own memory, so the arena plan and the program stage are left out.

Where a pass may stand is the pass's own declaration (`after`, `first`, `final`: `passes/base.py`), and
the pass manager refuses a pipeline that breaks one (`manager.check_order`): e.g. `fuse_moe_router` after
`fuse_moe` (it folds the router into its op), `plan_memory` and `lower_to_program` last; these lists keep
them (`tests/passes/test_passes_infra.py` checks every one).
"""

DEFAULT_PIPELINE: list[str] = [
    "merge_wq_a_wkv",
    "fuse_moe",
    "fuse_moe_router",
    "merge_sibling_gemms",
    "fuse_mhc_post_pre",
    "fuse_moe_mhc",
    "fuse_mhc_moe",
    "fold_inverse_rope_wo_a_quant",
    "fuse_inv_rope_wo_a",
    "lower_sparse_attention",
    "fuse_indexer_topk",
    "fuse_qkv_norm_rope",
    "fuse_norm_linear",
    "pair_sibling_gemms",
    "fuse_attn_front",
    "pair_compressors",
    "fuse_out_proj",
    "pair_rope_compress",
    "cse",
    "dce",
    "oneshot_allreduce",
    "fuse_oneshot_rows",
    "fuse_oneshot_producer",
    "fuse_oneshot_consumer",
    "plan_memory",
    "lower_to_program",
]

GPU_PIPELINE: list[str] = DEFAULT_PIPELINE
# The `cpu` target (ONNX Runtime): the same rewrites on native pool planes (numerics=official already
# rounds every value onto the FP8 / FP4 grids, so native planes hold the same numbers, and a CPU gains
# nothing from emulating packed row formats); ONNX Runtime plans its own memory, so the arena plan and the
# program stage are left out.
PROGRAM_PASSES: list[str] = ["plan_memory", "lower_to_program"]
# Fusions that only save kernel launches: ONNX Runtime runs graph nodes, so the cpu target keeps the ops apart
# (and needs no lowering of the fused op).
LAUNCH_ONLY_PASSES: list[str] = ["fuse_moe_router", "fuse_moe_mhc", "fuse_attn_front", "pair_compressors",
                                   "fuse_out_proj", "pair_rope_compress"]
# GPU programs only: the one-shot all-reduce over peer memory (a kernel launch, a trailing part of its producer's
# launch: `fuse_oneshot_producer`, or the leading phase of its consumer's: `fuse_oneshot_consumer`; data parallelism's
# all-gather and reduce-scatter both, of the MoE between them: `fuse_oneshot_rows`; the cpu target's
# ONNX segments and the host program of a cpu artifact keep
# the communicator's all-reduce). `compile --allreduce nccl` leaves `oneshot_allreduce` out (nothing to fold then).
GPU_ONLY_PASSES: list[str] = ["oneshot_allreduce", "fuse_oneshot_rows", "fuse_oneshot_producer",
                               "fuse_oneshot_consumer"]
CPU_PIPELINE: list[str] = [
    "lower_sparse_attention{kv_format=native,index_format=native}" if p == "lower_sparse_attention" else p
    for p in DEFAULT_PIPELINE if p not in PROGRAM_PASSES + LAUNCH_ONLY_PASSES + GPU_ONLY_PASSES]
# The host device runs an artifact with the cpu target only through the C runtime: its module continues
# with PROGRAM_PASSES at compile time (`cli/driver.py`), and the artifact carries that program. With verify and
# MTP draft functions (`--draft-tokens`), `spec_steps` runs just before `plan_memory` there and in the GPU
# pipeline (`cli/driver.with_spec_steps`: the recorded pipeline names it).

PIPELINES: dict[str, list[str]] = {"gpu": GPU_PIPELINE, "cpu": CPU_PIPELINE}
