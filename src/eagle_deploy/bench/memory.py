"""Peak memory of EAGLE and of vanilla decoding on the same engine, each measured in a fresh
process (so vanilla's figure is the target graph alone: its process never opens the draft
graph), plus the export folder's size by file.

    measure_modes   parent side: one `python -m eagle_deploy.bench.memory` per mode -> JSON
    probe           child side: load, warm up, decode one prompt, report memory

Resident memory from psutil and the process high-water mark (VmHWM); on ort-cuda / trt
also the GPU memory the process holds (NVML or nvidia-smi; runtime/memory.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODES = ("vanilla", "eagle")


def probe(engines: Path, mode: str, backend: str = "ort", threads: int | None = None, prompt_ids: list[int] = (),
          max_new_tokens: int = 128, tree: dict | None = None) -> dict:
    """Load the export (the draft graph only for mode "eagle"), warm up, decode `prompt_ids`
    greedily; return this process's memory figures and speed."""
    from eagle_deploy.contract.tree_config import TreeConfig
    from eagle_deploy.runtime.api import EagleRuntime
    from eagle_deploy.runtime.memory import rss_mb, snapshot

    before = rss_mb()
    rt = EagleRuntime.load(engines, backend=backend, tree=TreeConfig.from_json(tree) if tree else None,
                           threads=threads, with_draft=(mode == "eagle"))
    loaded = rss_mb()
    ids = list(prompt_ids)
    rt.generate(ids, max_new_tokens=min(4, max_new_tokens), mode=mode)
    result = rt.generate(ids, max_new_tokens=max_new_tokens, mode=mode)
    return {"mode": mode, "backend": backend, "rss_before_load_mb": before, "rss_loaded_mb": loaded,
            **snapshot(device=backend != "ort"), "new_tokens": len(result.token_ids),
            "tokens_per_s": result.stats.to_json()["tokens_per_s"]}


def measure_modes(engines: Path, prompt_ids: list[int], max_new_tokens: int = 128, backend: str = "ort",
                  threads: int | None = None, tree: dict | None = None, timeout: float = 900) -> dict:
    """{"method", "vanilla": probe, "eagle": probe, "eagle_vs_vanilla_peak_rss", "export":
    export_sizes} with each probe run in its own process. Raises RuntimeError naming the mode
    whose process failed."""
    from eagle_deploy.runtime.memory import export_sizes

    out = {"method": "one fresh process per mode: load (vanilla: the target graph only), warm up, decode one "
                     "greedy prompt; peak = the process's VmHWM"}
    for mode in MODES:
        cmd = [sys.executable, "-m", "eagle_deploy.bench.memory", "--engines", str(engines), "--mode", mode,
               "--backend", backend, "--max-new-tokens", str(max_new_tokens),
               "--prompt-ids", ",".join(str(int(i)) for i in prompt_ids)]
        if threads:
            cmd += ["--threads", str(threads)]
        if tree:
            cmd += ["--tree-json", json.dumps(tree)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"memory probe ({mode}) failed with exit code {proc.returncode}: {tail[0]}")
        out[mode] = json.loads(lines[-1])
    out["eagle_vs_vanilla_peak_rss"] = round(out["eagle"]["peak_rss_mb"] / max(out["vanilla"]["peak_rss_mb"], 1e-9), 3)
    out["export"] = export_sizes(engines)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_deploy.bench.memory", description=probe.__doc__)
    p.add_argument("--engines", type=Path, required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--backend", default="ort")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--tree-json", default=None)
    args = p.parse_args(argv)
    ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    tree = json.loads(args.tree_json) if args.tree_json else None
    print(json.dumps(probe(args.engines, args.mode, args.backend, args.threads, ids, args.max_new_tokens, tree)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
