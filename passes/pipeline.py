"""The default pass pipeline: the one place that lists it.

Order matters in three places: `fuse_moe` runs before `merge_sibling_gemms` (which would otherwise merge
the shared expert's w1 / w3); `fuse_qkv_norm_rope` runs after `lower_sparse_attention` so that in decode
it can fold the window write; `plan_memory` runs last, on the final op list.
"""

DEFAULT_PIPELINE: list[str] = [
    "merge_wq_a_wkv",
    "fuse_moe",
    "merge_sibling_gemms",
    "fuse_mhc_post_pre",
    "fold_inverse_rope_wo_a_quant",
    "lower_sparse_attention",
    "fuse_indexer_topk",
    "fuse_qkv_norm_rope",
    "fuse_norm_linear",
    "cse",
    "dce",
    "plan_memory",
]

# The `cpu` target (ONNX Runtime): the same rewrites, on native pool planes (ONNX has no FP8 / FP4 row
# formats worth emulating on a CPU, and `numerics=official` rounds every value onto those grids anyway, so
# native planes hold the same numbers); no memory plan (ONNX Runtime plans its own buffers).
CPU_PIPELINE: list[str] = [
    "merge_wq_a_wkv",
    "fuse_moe",
    "merge_sibling_gemms",
    "fuse_mhc_post_pre",
    "fold_inverse_rope_wo_a_quant",
    "lower_sparse_attention{kv_format=native,index_format=native}",
    "fuse_indexer_topk",
    "fuse_qkv_norm_rope",
    "fuse_norm_linear",
    "cse",
    "dce",
]
