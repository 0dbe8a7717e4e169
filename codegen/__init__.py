"""v4compile.codegen: the Triton kernel families (`kernels/`), their ahead-of-time compilation for the GPU
targets (`aot`, `gpu_target`), the roofline model of a step (`roofline`) and the ONNX export of the cpu
target (`onnx_export`)."""
