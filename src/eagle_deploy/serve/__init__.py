"""`eagle-serve`: an OpenAI-compatible HTTP server over an export folder.

- `protocol`: request parsing and validation (OpenAI-style 400 errors naming the field),
  response and SSE chunk bodies.
- `scheduler`: the decoding side behind the `Scheduler` protocol: `SlotScheduler`, a queue and one
  decode worker per slot (`--slots N`: the slots of a `runtime.batch.BatchRuntime`).
- `metrics`: Prometheus counters, histograms and gauges.
- `app`: the FastAPI application (`create_app`: the routes) and `Frontend` (prompt -> token ids).
- `completion`: one completion request from its body to its answer (`Completions`), and its
  outcome, written once for the JSON and the streamed answer (`Completion.outcome`).
- `cli`: `eagle-serve`.

Its load client is `bench.load` (`eagle-bench serve`).

Imports `runtime` and `contract`, never `exporter`.
"""
