"""`eagle-serve`: an OpenAI-compatible HTTP server over an export folder.

- `protocol`: request parsing and validation (OpenAI-style 400 errors naming the field),
  response and SSE chunk bodies.
- `engine`: the engine side, a scheduler object with a queue and one engine worker thread
  (`SerialScheduler`); a batched scheduler can replace it behind the same `Scheduler` protocol.
- `metrics`: Prometheus counters, histograms and gauges.
- `app`: the FastAPI application (`create_app`).
- `cli`: `eagle-serve`.
- `load`: the load client (`python -m eagle_deploy.serve.load`).

Imports `runtime` and `contract`, never `exporter`.
"""
