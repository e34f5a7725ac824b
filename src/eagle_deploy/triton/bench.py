"""Measure serving through Triton against the runtime called directly, on one export.

    python -m eagle_deploy.triton.bench --engines engines/smollm2-135m [--max-tokens 64] [--out r.json]

Two measurements, greedy, the same prompts (`--prompts`, default the first `--limit` 6 of the chat
evaluation set taken across its categories), `--max-tokens` each:

1. Per-request latency at concurrency 1: `EagleRuntime.generate` in this process (threads =
   the machine's cores) vs HTTP `generate` on a 1-instance Triton model (threads "auto" = the
   same), interleaved prompt by prompt in alternating order after one warm-up each, `--reps`
   rounds. Also checks both return the same text.
2. Throughput at concurrency `--concurrency`: total new tokens / wall seconds for `--requests`
   requests (the prompts cycled) on a 1-instance model and on a 2-instance model (threads
   "auto": cores / instances), both loaded, `--rounds` runs each in alternating order.

Prints one JSON object (also written to --out): medians, per-prompt figures, machine load.
Timings on a shared machine are noisy: the load average before and after is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
    return json.loads(data) if data else {}


def triton_generate(server, model: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    """-> (seconds, answer) for one HTTP generate request."""
    t0 = time.perf_counter()
    out = _post(f"http://{server.http_url}/v2/models/{model}/generate",
                {"text_input": prompt, "max_tokens": max_tokens, "exclude_input_in_output": True})
    return time.perf_counter() - t0, out


def throughput(server, model: str, prompts, max_tokens: int, requests: int, concurrency: int) -> dict:
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: triton_generate(server, model, p, max_tokens), jobs))
    wall = time.perf_counter() - t0
    tokens = sum(int(out["new_tokens"]) for _, out in results)
    return {"requests": requests, "concurrency": concurrency, "new_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "median_latency_s": round(statistics.median(s for s, _ in results), 3)}


def run(engines: Path, max_tokens: int, reps: int, requests: int, concurrency: int, work: Path,
        rounds: int = 2, prompts: list[str] | None = None) -> dict:
    """Both measurements on `engines` (see the module docstring); `prompts`: texts (default:
    bench_prompts())."""
    from eagle_deploy.runtime.api import EagleRuntime

    from .repo import write_repo
    from .serve import TritonServer

    texts = prompts or bench_prompts()

    cores = os.cpu_count() or 1
    repo = work / "repo"
    write_repo(engines, repo, name="eagle1", instances=1, force=True)
    write_repo(engines, repo, name="eagle2", instances=2, force=True)
    load = [round(x, 2) for x in os.getloadavg()]
    rt = EagleRuntime.load(engines, threads=cores)
    server = TritonServer(repo, work / "triton.log", timeout=600,
                          extra=["--model-control-mode=explicit", "--load-model=eagle1"])
    server.start()
    try:
        per_prompt, identical = [], 0
        for p in texts:  # warm-up (first-call allocations) on both sides
            rt.generate(p, max_new_tokens=4)
            triton_generate(server, "eagle1", p, 4)
        for r in range(reps):
            for i, p in enumerate(texts):
                order = ("direct", "triton") if (i + r) % 2 == 0 else ("triton", "direct")
                row = {"prompt": i, "rep": r, "order": list(order)}
                for system in order:
                    if system == "direct":
                        t0 = time.perf_counter()
                        res = rt.generate(p, max_new_tokens=max_tokens)
                        row["direct_s"], row["direct_text"] = time.perf_counter() - t0, res.text
                        row["new_tokens"], row["tau"] = res.stats.new_tokens, round(res.stats.mean_accept_len, 3)
                    else:
                        row["triton_s"], out = triton_generate(server, "eagle1", p, max_tokens)
                        row["triton_text"] = out["text_output"]
                identical += row.pop("direct_text") == row.pop("triton_text")
                row["overhead_ms"] = round((row["triton_s"] - row["direct_s"]) * 1e3, 1)
                per_prompt.append(row)
        latency = {"direct_median_s": round(statistics.median(r["direct_s"] for r in per_prompt), 3),
                   "triton_median_s": round(statistics.median(r["triton_s"] for r in per_prompt), 3),
                   "overhead_median_ms": round(statistics.median(r["overhead_ms"] for r in per_prompt), 1),
                   "identical_texts": f"{identical}/{len(per_prompt)}", "requests": per_prompt}
        del rt  # free its sessions before the throughput runs
        _post(f"http://{server.http_url}/v2/repository/models/eagle2/load", {})  # idle workers cost no CPU
        for p in texts[:2]:
            triton_generate(server, "eagle2", p, 4)
            triton_generate(server, "eagle2", p, 4)
        runs = {"instances_1": [], "instances_2": []}
        for r in range(rounds):  # alternating A B B A ..., so drifting machine load hits both alike
            for model in (("eagle1", "eagle2") if r % 2 == 0 else ("eagle2", "eagle1")):
                runs[f"instances_{model[-1]}"].append(throughput(server, model, texts, max_tokens, requests,
                                                                 concurrency))
        scaling = {k: {"tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in v), "runs": v}
                   for k, v in runs.items()}
        scaling["speedup_2_vs_1"] = round(scaling["instances_2"]["tokens_per_s_median"]
                                          / scaling["instances_1"]["tokens_per_s_median"], 3)
    finally:
        server.stop()
    return {"engines": str(engines), "cores": cores, "max_tokens": max_tokens, "load_avg_before": load,
            "load_avg_after": [round(x, 2) for x in os.getloadavg()], "latency_concurrency_1": latency,
            "throughput": scaling}


def bench_prompts(name: str = "chat", limit: int = 6) -> list[str]:
    """The first `limit` prompt texts of a prompt set or file (common.prompts.prompt_set),
    taken across its categories."""
    from eagle_deploy.common.prompts import across_categories, prompt_set

    return [r["prompt"] for r in across_categories(prompt_set(name), limit)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_deploy.triton.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="interleaved rounds over the prompts (latency)")
    p.add_argument("--requests", type=int, default=12, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternating throughput runs per instance count")
    p.add_argument("--prompts", default="chat", help="prompt set (chat, humaneval) or JSONL file (default: chat)")
    p.add_argument("--limit", type=int, default=6, help="prompts taken from it, across its categories (default: 6)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eagle-triton-bench-") as work:
        result = run(args.engines.absolute(), args.max_tokens, args.reps, args.requests, args.concurrency, Path(work),
                     args.rounds, bench_prompts(args.prompts, args.limit))
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
