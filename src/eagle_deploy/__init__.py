"""eagle-deploy: export a Llama-family target model and its EAGLE draft head to ONNX/TensorRT
and decode with EAGLE-2/3 draft trees.

Packages (no import crosses between `exporter` / `heads` and `runtime`; all import `contract`):
- `contract`: the ONNX I/O contract, the manifest schema, tree settings, profile arithmetic.
- `exporter`: Hugging Face checkpoint + draft head -> ONNX graphs (+ TensorRT engines).
- `heads`: EAGLE-1/2 and EAGLE-3 draft heads as torch modules, in their published layouts.
- `runtime`: backends, KV buffer, drafting, verification, the decode loop, the Python API.
- `bench`, `train`, `validate`: tools built on both halves.
- `serve`: `eagle-serve`, the OpenAI-compatible HTTP server over `runtime` (never `exporter`).
- `data`: shipped draft heads and prompt sets.
"""
