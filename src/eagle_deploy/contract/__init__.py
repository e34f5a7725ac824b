"""The contract between the exporter and the runtime: ONNX I/O names and shapes
(`onnx_io`), the manifest schema (`manifest`), draft-tree settings (`tree_config`),
KV/profile arithmetic (`capacity`), dtype tables (`dtypes`) and shared CLI argument groups
(`cli_args`). Imports nothing heavy (no torch, onnx or onnxruntime)."""
