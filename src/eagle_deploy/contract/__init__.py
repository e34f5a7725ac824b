"""The contract between the exporter and the runtime: ONNX I/O names and shapes
(`onnx_io`), the manifest (`manifest`, its records `manifest_records`, JSON reading
`manifest_json`), draft-tree settings (`tree_config`), engine profiles (`profiles`), dtype
tables (`dtypes`), the checks of an export against its manifest (`verify`) and the one-line
errors (`errors`, `field_errors`). Imports nothing heavy (no torch, onnx or onnxruntime);
what the commands share besides it lives in `eagle_deploy.common`."""
