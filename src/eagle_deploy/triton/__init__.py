"""Serving an export with Triton Inference Server (EAGLE decoding, streaming, cancellation).

- `repo`: write a model repository (config.pbtxt + model.py) for an export folder
  (`eagle-triton-repo`, `eagle-export --triton-repo`).
- `model`: the decoupled Python-backend model copied into the repository; runs in Triton's
  stub (numpy<2 environment, `env`) and relays requests to one decode worker per instance.
- `worker`: the decode worker (the project's environment): EagleRuntime over the export.
- `select`: which engine backend (ort / ort-cuda / trt) an instance uses.
- `serve`: start the tritonserver shipped in the nvidia-pytriton wheel (`eagle-triton-serve`).

Imports nothing heavy; this package may import both `exporter` and `runtime`, which never
import each other (only `worker` imports the runtime, lazily).
"""
