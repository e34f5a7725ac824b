"""Load client for eagle-serve: streams the evaluation prompt sets at several concurrency
levels, for EAGLE and vanilla decoding on the same server (the request-level `mode` field),
and reports per cell: total output tokens/s, time per output token p50/p99, TTFT p50/p99 and
tau (rounds-weighted mean acceptance length).

    eagle-bench serve --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --limit 8
    python -m eagle_deploy.bench.load --url ...      # the same

Each cell sends the same prompts (the first --limit of each set), greedy unless
--temperature, with `stream_options.include_usage` so token counts are the server's. TTFT is
measured from sending the request to the first non-empty text chunk (queue wait included);
time per output token is (last chunk - first text chunk) / (completion tokens - 1) per
request. Before the cells, each mode is warmed up with as many short requests at once as the
highest concurrency (the first batched forwards of each shape are slow; --no-warmup skips
this). A server with a prefix cache (eagle-serve's default) answers a prompt it has seen from
its cache: each cell counts those prompt tokens (`cached_tokens`) and the table ends with a
note; run the server with --prefix-cache-mb 0 to measure every prefill. Standard library +
numpy only.

Columns: `conc`, requests in flight; `ok`, requests completed; `tokens`, completion tokens;
`TPOT`, time per output token; `same`, greedy texts equal to the same prompt's in the mode's
first concurrency level (`-` in that cell); `=van`, equal to vanilla's first cell (in the final
table; a row printed before vanilla has run shows `-` there); `lost`, requests that failed (those abandoned on
purpose by --disconnect are neither ok nor lost; the --json cells count them as `dropped`).
A row goes to stderr as each cell ends and the whole table to stdout at the end, so a terminal
shows it twice.
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from eagle_deploy.common.cli_args import check_at_least, cli_error, number_list
from eagle_deploy.common.prompts import load_prompts

SCHEMA = "eagle-serve-load/1"


@dataclass
class LoadConfig:
    url: str
    model: str | None = None  # None: the first model of GET /v1/models
    prompts: list[dict] = field(default_factory=list)  # [{"id", "set", "prompt"}]
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    modes: list[str] = field(default_factory=lambda: ["eagle", "vanilla"])
    max_tokens: int = 128
    temperature: float = 0.0
    endpoint: str = "chat"  # "chat" | "completions"
    timeout: float = 600.0
    warmup: bool = True
    disconnect: float = 0.0  # share of requests the client abandons after their first text chunk
    seed: int = 0  # which requests are abandoned
    long_prompts: list[dict] = field(default_factory=list)  # sent back to back by long_clients during every cell
    long_clients: int = 0
    rate: float = 0.0  # requests/s sent open-loop on a fixed schedule (0: closed loop, each client sends on reply)


@dataclass
class Sample:
    """One request as the client saw it; times in seconds from sending it."""

    prompt_id: str
    ok: bool
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    completion_tokens: int = 0
    finish_reason: str | None = None
    tau: float | None = None
    rounds: int = 0
    text: str = ""
    dropped: bool = False  # the client hung up after the first text chunk (--disconnect)
    cached_tokens: int = 0  # prompt tokens the server read from its prefix cache (usage.prompt_tokens_details)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


class Client:
    """Minimal HTTP client for one server (a new connection per request)."""

    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {url!r}")
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout
        self.base = parts.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", self.base + path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stream(self, path: str, payload: dict, prompt_id: str, hang_up: bool = False) -> Sample:
        """POST a streaming request and read its SSE events to [DONE]; hang_up: close the
        connection right after the first text chunk (a client that goes away)."""
        conn = self._conn()
        t0 = time.perf_counter()
        sample = Sample(prompt_id, ok=False)
        parts = []
        try:
            conn.request("POST", self.base + path, json.dumps(payload), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return sample
            while True:
                line = resp.readline()
                if not line:
                    sample.error = "the stream ended without [DONE]"
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    sample.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    sample.error = event["error"].get("message", "error")
                    break
                if event.get("usage"):
                    sample.completion_tokens = event["usage"]["completion_tokens"]
                    sample.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in event.get("choices") or ():
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        if sample.ttft is None:
                            sample.ttft = time.perf_counter() - t0
                        parts.append(text)
                        if hang_up:
                            sample.dropped = True
                            break
                    if choice.get("finish_reason"):
                        sample.finish_reason = choice["finish_reason"]
                        eagle = event.get("eagle") or {}
                        sample.tau, sample.rounds = eagle.get("mean_accept_len"), eagle.get("rounds", 0)
                if sample.dropped:
                    break
        except (OSError, http.client.HTTPException, ValueError) as err:
            sample.error = f"{type(err).__name__}: {err}"
        finally:
            conn.close()
        sample.latency = time.perf_counter() - t0
        sample.text = "".join(parts)
        return sample


def _payload(cfg: LoadConfig, model: str, prompt: str, mode: str) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "mode": mode}
    if cfg.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def run_cell(client: Client, cfg: LoadConfig, model: str, mode: str, concurrency: int,
             long_samples: list | None = None) -> tuple[list[Sample], float]:
    """Send every prompt with `concurrency` requests in flight (with `cfg.rate`: prompt i sent
    at i / rate seconds whatever the replies, open-loop as vLLM's benchmark_serving
    --request-rate, at most `concurrency` in flight); returns (samples in prompt order, wall
    seconds). Meanwhile `cfg.long_clients` more clients send `cfg.long_prompts`
    back to back, in turn, until the last prompt's answer is in (their samples, every one
    started before that, are appended to `long_samples`, not returned): short requests'
    figures while long prompts arrive. The wall time is the prompts' own."""
    todo = list(enumerate(cfg.prompts))
    samples: list[Sample | None] = [None] * len(todo)
    lock = threading.Lock()
    rng = np.random.default_rng([cfg.seed, concurrency, len(mode)])
    hang_up = rng.random(len(todo)) < cfg.disconnect

    in_flight = threading.Semaphore(concurrency)
    start = time.perf_counter()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, p = todo.pop(0)
            path, body = _payload(cfg, model, p["prompt"], mode)
            samples[i] = client.stream(path, body, p["id"], bool(hang_up[i]))

    def scheduled(i: int, p: dict):
        time.sleep(max(0.0, start + i / cfg.rate - time.perf_counter()))
        with in_flight:
            path, body = _payload(cfg, model, p["prompt"], mode)
            samples[i] = client.stream(path, body, p["id"], bool(hang_up[i]))

    finished = threading.Event()
    turn = itertools.count()

    def long_worker():
        while not finished.is_set():
            with lock:
                p = cfg.long_prompts[next(turn) % len(cfg.long_prompts)]
            path, body = _payload(cfg, model, p["prompt"], mode)
            sample = client.stream(path, body, p["id"])
            if long_samples is not None:  # one that started before the cell ended counts, however late it ends
                long_samples.append(sample)

    if cfg.rate:
        threads = [threading.Thread(target=scheduled, args=(i, p), daemon=True) for i, p in todo]
    else:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(todo)))]
    longs = [threading.Thread(target=long_worker, daemon=True)
             for _ in range(cfg.long_clients if cfg.long_prompts else 0)]
    t0 = time.perf_counter()
    for t in longs + threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    finished.set()
    for t in longs:
        t.join()
    return [s for s in samples if s is not None], wall


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summarize(mode: str, concurrency: int, samples: list[Sample], wall: float) -> dict:
    """One cell: counts (requests; ok; dropped: abandoned by the client on purpose; lost:
    neither), total tokens/s, TTFT and time per output token p50/p99 (ms), tau, and the prompt
    tokens the server's prefix cache gave (cached_tokens: a repeated prompt's TTFT is then not a
    full prefill's)."""
    ok = [s for s in samples if s.ok]
    tokens = sum(s.completion_tokens for s in ok)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    rounds = sum(s.rounds for s in ok if s.tau is not None)
    tau = sum(s.tau * s.rounds for s in ok if s.tau is not None) / rounds if rounds else None
    return {"mode": mode, "concurrency": concurrency, "requests": len(samples), "ok": len(ok),
            "dropped": sum(s.dropped for s in samples), "lost": sum(not s.ok and not s.dropped for s in samples),
            "errors": [s.error for s in samples if not s.ok and not s.dropped], "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / max(wall, 1e-9), 2),
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
            "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p99": _pct(tpot, 99),
            "latency_ms_p50": _pct([s.latency for s in ok], 50),
            "tau": round(tau, 3) if tau is not None else None, "cached_tokens": sum(s.cached_tokens for s in ok)}


def repeated(prompts: list[dict], times: int) -> list[dict]:
    """The prompt list `times` over; with times > 1 each id gets "#<round>" (same_text compares
    by id, so a repeat is compared with the same round of another cell)."""
    if times == 1:
        return list(prompts)
    return [{**p, "id": f"{p['id']}#{r}"} for r in range(times) for p in prompts]


def same_text(samples: list[Sample], reference: list[Sample]) -> list[int] | None:
    """[equal, compared]: completed requests whose text equals the same prompt's completed
    request in `reference` (greedy: a request's output must not depend on the concurrency, nor
    on EAGLE vs vanilla); None when nothing can be compared."""
    ref = {s.prompt_id: s.text for s in reference if s.ok}
    pairs = [(s.text, ref[s.prompt_id]) for s in samples if s.ok and s.prompt_id in ref]
    return [sum(a == b for a, b in pairs), len(pairs)] if pairs else None


def run_load(cfg: LoadConfig, log=lambda msg: None) -> dict:
    """Every (mode, concurrency) cell in turn -> {"schema", "config", "model", "server",
    "cells": [summarize(...)], "samples": {"<mode>/<c>": [Sample as dict]}}. Greedy cells also
    get same_as_first (against the mode's first concurrency level; None in that cell) and
    same_as_vanilla (against vanilla's first cell, whichever mode ran first; None in that cell
    and without vanilla) from `same_text`.
    Raises RuntimeError when the server cannot be reached, ValueError without prompts."""
    if not cfg.prompts:
        raise ValueError("no prompts")
    client = Client(cfg.url, cfg.timeout)
    try:
        health = client.get_json("/health")
        model = cfg.model or client.get_json("/v1/models")["data"][0]["id"]
    except OSError as err:
        raise RuntimeError(f"cannot reach {cfg.url}: {err}") from None
    if cfg.warmup:  # every mode at the highest concurrency: the first batched forwards of each shape are slow
        warm = [{**p, "id": f"warmup-{i}"} for i, p in enumerate((cfg.prompts * max(cfg.concurrency))
                                                                   [:max(cfg.concurrency)])]
        for mode in cfg.modes:
            run_cell(client, replace(cfg, prompts=warm, max_tokens=min(cfg.max_tokens, 16), disconnect=0.0,
                                     long_clients=0, rate=0.0), model, mode, max(cfg.concurrency))
    cells, samples, first, done = [], {}, {}, []
    for mode in cfg.modes:
        for c in cfg.concurrency:
            longs: list[Sample] = []
            got, wall = run_cell(client, cfg, model, mode, c, longs)
            cell = summarize(mode, c, got, wall)
            if cfg.long_prompts and cfg.long_clients:
                lg = summarize(mode, c, longs, wall)
                cell["long"] = {k: lg[k] for k in ("requests", "ok", "ttft_ms_p50", "ttft_ms_p99")}
            if cfg.temperature == 0:
                cell["same_as_first"] = same_text(got, first[mode]) if mode in first else None
                cell["same_as_vanilla"] = same_text(got, first.get("vanilla", []))
                first.setdefault(mode, got)
            log(format_row(cell))
            cells.append(cell)
            done.append((cell, got))
            samples[f"{mode}/{c}"] = [{**asdict(s), "tpot": s.tpot} for s in got]
    if cfg.temperature == 0 and "vanilla" in first:  # cells that ran before vanilla: compared now
        for cell, got in done:
            if cell["mode"] != "vanilla" and cell["same_as_vanilla"] is None:
                cell["same_as_vanilla"] = same_text(got, first["vanilla"])
    config = {k: v for k, v in asdict(cfg).items() if k not in ("prompts", "long_prompts")}
    config["prompt_ids"] = [p["id"] for p in cfg.prompts]
    config["long_prompt_ids"] = [p["id"] for p in cfg.long_prompts]
    return {"schema": SCHEMA, "config": config, "model": model, "server": health.get("decoding"), "cells": cells,
            "samples": samples}


HEADER = (f"{'mode':<8} {'conc':>4} {'ok':>4} {'tokens':>7} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'tau':>6} {'same':>7} {'=van':>7} {'lost':>4}")


def format_row(c: dict) -> str:
    def ms(v):
        return f"{v:>7.1f}ms" if v is not None else f"{'-':>9}"

    tau = f"{c['tau']:>6.2f}" if c["tau"] is not None else f"{'-':>6}"
    def frac(pair):
        return f"{f'{pair[0]}/{pair[1]}':>7}" if pair else f"{'-':>7}"

    return (f"{c['mode']:<8} {c['concurrency']:>4} {c['ok']:>4} {c['completion_tokens']:>7} {c['tokens_per_s']:>8.1f} "
            f"{ms(c['tpot_ms_p50'])} {ms(c['tpot_ms_p99'])} {ms(c['ttft_ms_p50'])} {ms(c['ttft_ms_p99'])} {tau} "
            f"{frac(c.get('same_as_first'))} {frac(c.get('same_as_vanilla'))} {c.get('lost', 0):>4}")


def format_table(result: dict) -> str:
    lines = [HEADER, *(format_row(c) for c in result["cells"])]
    for c in result["cells"]:
        if "long" in c:
            lg = c["long"]
            lines.append(f"long prompts during {c['mode']}/{c['concurrency']}: {lg['ok']}/{lg['requests']} done, "
                         f"TTFT p50 {lg['ttft_ms_p50']} ms, p99 {lg['ttft_ms_p99']} ms")
    cached = sum(c.get("cached_tokens", 0) for c in result["cells"])
    if cached:
        lines.append(f"note: {cached:,} prompt tokens came from the server's prefix cache (the cells send the same "
                     "prompts), so TTFT is not every prompt's full prefill: run eagle-serve --prefix-cache-mb 0 "
                     "to measure that")
    return "\n".join(lines)


_ints = number_list(int, 1, "values")


def build_parser(prog: str = "python -m eagle_deploy.bench.load") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--sets", default="humaneval,chat", help="prompt sets: humaneval, chat (comma-separated)")
    p.add_argument("--prompts", type=Path, action="append", default=[], help="a JSONL prompt file; replaces --sets")
    p.add_argument("--limit", type=int, default=None,
                   help="first N prompts of each set, 0 = all (default: 8 of each built-in set, all of a file)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8],
                   help="comma-separated in-flight request counts (default: 1,2,4,8)")
    p.add_argument("--modes", default="eagle,vanilla", help="comma-separated: eagle, vanilla (default: eagle,vanilla)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=128,
                   help="completion tokens per request (the API's max_tokens; --max-new-tokens, as eagle-run and "
                        "eagle-bench call it, is the same option) (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat wraps each prompt as a user message; completions sends it raw")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up (per mode, one short request per slot of the highest --concurrency)")
    p.add_argument("--disconnect", type=float, default=0.0,
                   help="share of requests (0-1, drawn with --seed) abandoned after their first text chunk; they "
                        "count as dropped, not lost, and their slot must come back")
    p.add_argument("--seed", type=int, default=0, help="which requests --disconnect abandons")
    p.add_argument("--repeat", type=int, default=1, help="send the prompt list this many times per cell")
    p.add_argument("--long-prompts", type=Path, default=None,
                   help="a JSONL prompt file sent back to back during every cell by --long-clients more clients "
                        "(long documents: the cell's figures are then the other requests' while long prompts arrive; "
                        "the long ones' TTFT is reported apart)")
    p.add_argument("--long-clients", type=int, default=1, help="clients sending --long-prompts (default 1)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="send the prompts open-loop at this many requests per second (at most --concurrency in "
                        "flight), so TTFT includes waiting behind other requests' work; 0: closed loop (default)")
    p.add_argument("--json", type=Path, default=None, help="also write the full result (cells + samples) here")
    return p


def main(argv=None, prog: str = "python -m eagle_deploy.bench.load") -> int:
    """The load client's command line (also `eagle-bench serve`)."""
    args = build_parser(prog).parse_args(argv)
    name = prog if prog.startswith("eagle-") else "load"  # the error prefix: the command the user typed
    typed = sys.argv[1:] if argv is None else argv
    max_flag = "--max-new-tokens" if any(str(a).split("=")[0] == "--max-new-tokens" for a in typed) else "--max-tokens"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.url.startswith(("http://", "https://")):
        return cli_error(name, f"--url takes the server's address with its scheme, e.g. http://127.0.0.1:8000, "
                               f"got {args.url!r}")
    if not modes or any(m not in ("eagle", "vanilla") for m in modes):
        return cli_error(name, f"--modes takes eagle and/or vanilla (comma-separated), got {args.modes!r}")
    if not 0 <= args.disconnect <= 1:
        return cli_error(name, f"--disconnect is a share of the requests, in [0, 1], got {args.disconnect}")
    try:
        check_at_least([(max_flag, args.max_tokens, 1), ("--limit", args.limit, 0), ("--repeat", args.repeat, 1),
                        ("--long-clients", args.long_clients, 0), ("--rate", args.rate, 0)])
        sets = [str(p) for p in args.prompts] or [s.strip() for s in args.sets.split(",") if s.strip()]
        limit = args.limit if args.limit is not None else (0 if args.prompts else 8)
        prompts = load_prompts(sets, limit)
        prompts = repeated(prompts, args.repeat)
        long_prompts = load_prompts([str(args.long_prompts)], 0) if args.long_prompts else []
        cfg = LoadConfig(args.url, args.model, prompts, args.concurrency, modes, args.max_tokens, args.temperature,
                         args.endpoint, args.timeout, not args.no_warmup, args.disconnect, args.seed, long_prompts,
                         args.long_clients, args.rate)
        print(HEADER, file=sys.stderr, flush=True)
        result = run_load(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError, ModuleNotFoundError) as err:
        return cli_error(name, err)
    print(format_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    failed = sum(c["lost"] for c in result["cells"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
