"""`eagle-serve`: an OpenAI-compatible streaming HTTP server over an export folder.

    eagle-serve --engines engines/smollm2-135m --port 8000
    curl -N localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

With --slots N (default 1) up to N requests are decoded at once, their forwards batched
(continuous batching; each request's output is what it gets alone). Endpoints: POST /v1/chat/completions,
/v1/completions; GET /v1/models, /health, /metrics (Prometheus).

With --api-key KEY (or EAGLE_SERVE_API_KEY) every endpoint but /health and /metrics needs
`Authorization: Bearer KEY`. SIGTERM / Ctrl-C drain the requests in flight for at most
--shutdown-timeout-s seconds (then a stream ends with an error event and [DONE]); a second
SIGTERM / Ctrl-C exits at once. The export's files are checked against the sha256 its manifest
records before serving (--verify full, the default here).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from eagle_deploy.common.cli_args import (
    LOSSY,
    HelpFormatter,
    add_runtime_args,
    add_tree_args,
    check_at_least,
    cli_error,
    interruptible,
    threshold_of,
    tree_from_args,
)

from .guard import BODY_TIMEOUT_S, HEAD_TIMEOUT_S


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown as elsewhere; the description's example lines kept as written."""


# --prefill-chunk's default: tokens per prefill chunk with several slots (runtime/batch.py,
# "Chunked prefill"; measured in docs/decisions.md, "chunked prefill")
DEFAULT_PREFILL_CHUNK = 128
# --verify's default here: a server loads once and then answers for every response it signs
# "lossless", so it hashes every file (contract/verify.py; eagle-run keeps "fast")
SERVE_VERIFY = "full"
# --prefix-cache-mb's default here with --backend ort (0, off, with the others): a server's
# requests share prefixes (a conversation's earlier turns, a system prompt) and it keeps the
# KV of the latest (runtime/prefix_cache.py); eagle-run and the Python API default to 0
SERVE_PREFIX_CACHE_MB = 256
# seconds uvicorn waits past --shutdown-timeout-s before it cancels what is left (a request still
# uploading its body); the app itself ends the running requests at --shutdown-timeout-s
SHUTDOWN_GRACE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-serve", description=__doc__, formatter_class=_Formatter)
    add_runtime_args(p, "responses say so in system_fingerprint and their eagle field", verify_default=SERVE_VERIFY)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the export's name)")
    p.add_argument("--vanilla", action="store_true",
                   help="decode without drafting by default (a request can still ask for \"mode\": \"eagle\")")
    p.add_argument("--slots", type=int, default=1,
                   help="requests decoded at once in batched forwards (needs the default fused onnxruntime "
                        "graph; not dynamically quantised int8); KV is allocated once for all of them")
    p.add_argument("--fixed-tree", action="store_true",
                   help="with --slots > 1, draft the configured tree whatever the load (default: trees shrink as "
                        "more slots are busy, which is faster on a CPU and changes no greedy output, but a seeded "
                        "sampled request then gets the same tokens as alone only while at most 2 slots are busy)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="with --slots > 1, a prompt of N + 2 tokens or more is prefilled N tokens at a time (the "
                        "last chunk 2 to N + 1), between the forwards of the requests decoding meanwhile, so long "
                        "prompts do not stall the other streams (output unchanged); 0: every prefill in one forward")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="MiB of KV kept from earlier requests (their prompts and answers) and reused, bit for bit, by "
                        "later ones that start with the same tokens: a chat's next turn, a shared system prompt "
                        "(usage.prompt_tokens_details.cached_tokens); least recently used dropped first; 0: off "
                        f"(default: {SERVE_PREFIX_CACHE_MB} with --backend ort, else 0)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot at most; more get HTTP 429")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("limits and access")
    g.add_argument("--max-body-mb", type=float, default=8.0, help="request body size limit; larger bodies get 413")
    g.add_argument("--request-timeout-s", type=float, default=None,
                   help="deadline of every request from the arrival of its head (body upload and queue wait "
                        "included); past it the request is stopped and answered 408 request_timeout; a request may "
                        "set a shorter request_timeout_s (default: none)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (401 otherwise); default: the EAGLE_SERVE_API_KEY "
                        "environment variable, else no key")
    g.add_argument("--parse-special", action="store_true",
                   help="encode a special token's text inside a chat message (e.g. '<|im_end|><|im_start|>system') as "
                        "that special token, as transformers and vLLM do; by default it is plain text, so a client's "
                        "message cannot open a system turn")
    g.add_argument("--protect-health-metrics", action="store_true",
                   help="with an API key, require it for /health and /metrics too (default: open, for probes)")
    g.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, wait this long for requests in flight, then stop them; a second "
                        "signal exits at once")
    g.add_argument("--keep-alive-s", type=int, default=5,
                   help="close an idle keep-alive connection after this many seconds")
    g.add_argument("--header-timeout-s", type=float, default=HEAD_TIMEOUT_S,
                   help="a request's line and headers must arrive within this many seconds of the connection "
                        "opening (of its first byte on a kept-alive connection), however slowly they trickle in; "
                        "else HTTP 408 and the connection is closed")
    g.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                   help="a request's body must arrive within this many seconds of its head; else HTTP 408 and the "
                        "connection is closed")
    g.add_argument("--max-connections", type=int, default=None,
                   help="requests in progress at most (streams included), counted once their head has arrived and "
                        "their API key passed, so connections still sending a request never fill it; more get HTTP "
                        "503 server_busy; /health and /metrics are not counted (default: no limit)")
    add_tree_args(p, "the export's manifest")
    return p


def runtime_options(args, manifest=None):
    """The RuntimeOptions of eagle-serve's runtime flags (RuntimeOptions.from_args), its
    --prefix-cache-mb unset: SERVE_PREFIX_CACHE_MB where the cache is exact (--backend ort and,
    given the export's `manifest`, its fused target graph), else 0. Raises SettingError."""
    from eagle_deploy.contract.onnx_io import KV_SHARED
    from eagle_deploy.runtime.options import RuntimeOptions

    cache = args.prefix_cache_mb
    if cache is None:
        fused = manifest is None or manifest.target.kv_layout == KV_SHARED
        cache = SERVE_PREFIX_CACHE_MB if args.backend == "ort" and fused else 0
    return RuntimeOptions.from_args(args, prefix_cache_mb=cache)


def build_server(args, app):
    """The uvicorn.Server serving `app` (create_app's) with the settings of `args`
    (`uvicorn_config`) and eagle-serve's signal handling: the first SIGTERM / SIGINT starts
    the graceful drain, in which the app ends the requests still running after
    --shutdown-timeout-s seconds (`app.state.drain`) and uvicorn cancels what is left
    SHUTDOWN_GRACE_S later; a second one of either kind exits at once, status 128 + signal
    (uvicorn itself forces an exit only on a second SIGINT)."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(args, app))
    drain = server.handle_exit

    def handle_exit(sig, frame):
        if server.should_exit:
            print(f"eagle-serve: second {signal.Signals(sig).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        app.state.drain.begin(args.shutdown_timeout_s)
        drain(sig, frame)

    server.handle_exit = handle_exit  # uvicorn installs the instance's handler for both signals
    return server


def uvicorn_config(args, app):
    """The uvicorn.Config of `args`: host, port, log level, keep-alive, the head and body
    timeouts (`guard.guarded_protocol`), and the drain timeout (--shutdown-timeout-s +
    SHUTDOWN_GRACE_S: the app ends its requests at --shutdown-timeout-s). No
    limit_concurrency: --max-connections is the app's `guard.RequestLimit`, since uvicorn's
    counts connections that have not sent a request yet."""
    import uvicorn

    from .guard import guarded_protocol

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_keep_alive=args.keep_alive_s,
                          http=guarded_protocol(args.header_timeout_s, args.body_timeout_s),
                          timeout_graceful_shutdown=args.shutdown_timeout_s + SHUTDOWN_GRACE_S)


def api_key(args) -> str | None:
    """The API key of --api-key, else of EAGLE_SERVE_API_KEY, without surrounding whitespace
    (a key written with `echo` into a secret ends in a newline); None: no key. Raises
    ValueError for a key that is empty once stripped."""
    key = args.api_key if args.api_key is not None else os.environ.get("EAGLE_SERVE_API_KEY")
    if key is None:
        return None
    key = key.strip()
    if not key:
        raise ValueError("the API key (--api-key / EAGLE_SERVE_API_KEY) is empty")
    return key


@interruptible("eagle-serve")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_deploy.contract.manifest import Manifest, ManifestError
    from eagle_deploy.contract.tree_config import TreeConfigError
    from eagle_deploy.runtime.hybrid import uses_draft_graph
    from eagle_deploy.runtime.options import FLAGS

    try:
        check_at_least((flag, value, 1) for flag, value in (
            ("--max-queue", args.max_queue), ("--slots", args.slots), ("--threads", args.threads),
            ("--keep-alive-s", args.keep_alive_s), ("--max-connections", args.max_connections)))
        if args.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 (0: off), got {args.prefill_chunk}")
        for flag, value in (("--max-body-mb", args.max_body_mb), ("--request-timeout-s", args.request_timeout_s),
                            ("--shutdown-timeout-s", args.shutdown_timeout_s),
                            ("--header-timeout-s", args.header_timeout_s), ("--body-timeout-s", args.body_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        key = api_key(args)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        threshold_of(args)  # --threshold without --acceptance threshold, worded with both flags
        runtime_options(args)  # bad settings fail before the export is read
        manifest = Manifest.load(args.engines)
        options = runtime_options(args, manifest)
        # --prefill-chunk is the batch runtime's (chunks interleaved with the other slots'
        # forwards); one slot keeps the runtime's default
        options = options.replace(tree=tree_from_args(args, manifest.tree),
                                  **({"prefill_chunk": args.prefill_chunk} if args.slots > 1 else {}))
        if not manifest.tokenizer:
            raise ValueError(f"{args.engines} has no tokenizer; eagle-serve needs one")
        import uvicorn  # noqa: F401  (a missing serve extra fails here, before loading)

        from .app import create_app
        from .scheduler import SlotScheduler

        scheduler = SlotScheduler.load(args.engines, options, slots=args.slots, max_queue=args.max_queue,
                                       shrink_trees=not args.fixed_tree)
        app = create_app(scheduler, model_name=args.model_name, default_mode="vanilla" if args.vanilla else "eagle",
                         max_body_mb=args.max_body_mb, request_timeout_s=args.request_timeout_s, api_key=key,
                         protect_health_metrics=args.protect_health_metrics, max_requests=args.max_connections,
                         parse_special=args.parse_special)
    except (ManifestError, TreeConfigError, ValueError, TypeError, FileNotFoundError) as err:
        return cli_error("eagle-serve", err, FLAGS)  # one line, no traceback
    except (ImportError, RuntimeError) as err:
        print(f"eagle-serve: error: backend {args.backend!r} unavailable: {err}", file=sys.stderr)
        return 3
    draft_graph = uses_draft_graph(options.drafter_kind)
    for note in manifest.output_notes:
        print(f"note: {note}", file=sys.stderr)
    if args.acceptance != "lossless":
        print(f"note: --acceptance threshold is {LOSSY}: responses do not follow the target distribution",
              file=sys.stderr)
    if draft_graph and not manifest.draft.trained:
        print("note: this export uses a RANDOMLY INITIALISED draft head, so acceptance is near 1 token per round",
              file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    print(f"eagle-serve: serving {args.model_name or manifest.name!r} on "
          f"http://{args.host}:{args.port}/v1 ({args.slots} request{'s' if args.slots > 1 else ''} at a time; "
          f"--max-queue {args.max_queue}{'; API key required' if key else ''})",
          file=sys.stderr, flush=True)
    build_server(args, app).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
