"""One-token target forwards and greedy decoding of one export made twice: NEW, whose target
graph repeats one-row queries inside attention (`eagle-export --quant int4`, the default since
2026-12-07), and OLD, the same without it (`--repeat-one-row off`). In one process, interleaved:

  two-row      OLD, row-exact as before: a one-token forward run as two rows, row 0 kept
  one-row      NEW, row-exact: one row in, the graph repeats it in attention only
  plain        OLD, not row-exact: one row (the one-row attention kernel: not EAGLE-exact)
  new-two-row  NEW run as two rows (what the runtime does where one row is not exact:
               int4 without AVX-512, runtime/row_exact.py)

Part 1: ms per one-token forward at past 128 and 512 (median and fastest of --rounds
interleaved rounds of 20 forwards). Part 2: vanilla tokens/s over PROMPTS (5 chat + 5
HumanEval, 128 new tokens, --passes passes, interleaved per prompt; "new-choice" is NEW with
the runtime's own choice of rows). Part 3: greedy EAGLE (the default drafter) vs vanilla,
tokens identical per prompt, and tokens/s, interleaved per prompt: OLD (two rows), NEW with the
runtime's own choice, NEW with one row forced (matmuls_row_exact patched to True).
Usage: python 2026-12-07-repeat-one-row.py NEW OLD [--threads 2] [--json OUT] [--parts 123]"""
import argparse
import json
import statistics
import time

import numpy as np

from eagle_deploy.common.cpu import cpu_info
from eagle_deploy.common.prompts import across_categories, prompt_set
from eagle_deploy.runtime import api
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.drafter import causal_mask

ap = argparse.ArgumentParser()
ap.add_argument("new")
ap.add_argument("old")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--json", default=None)
ap.add_argument("--parts", default="123")
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--rounds", type=int, default=30)
ap.add_argument("--passes", type=int, default=3)
args = ap.parse_args()
T = args.threads
PROMPTS = [r["prompt"] for r in across_categories(prompt_set("chat"), 5) + prompt_set("humaneval")[:5]]
out = {"cpu": cpu_info().to_json(), "threads": T, "new": args.new, "old": args.old}


def load(folder, row_exact, force_one_row=False, with_draft=False):
    real = api.matmuls_row_exact
    if force_one_row:
        api.matmuls_row_exact = lambda graph, *a: True
    try:
        return EagleRuntime.load(folder, threads=T, row_exact=row_exact, with_draft=with_draft)
    finally:
        api.matmuls_row_exact = real


if "1" in args.parts:
    new_t, old_t = (load(f, False).decoder.target for f in (args.new, args.old))
    rng = np.random.default_rng(0)
    vocab = 49152
    ms = {}
    for past in (128, 512):
        kvs = {}
        for name, be in (("new", new_t), ("old", old_t)):
            kvs[name] = be.allocate_kv(past + 4)
            ids = rng.integers(3, vocab, (1, past))
            be.run(StepInputs(ids, np.arange(past)[None], causal_mask(0, past), np.array([[past - 1]])), kvs[name], 0)
        tok = int(rng.integers(3, vocab))
        one = StepInputs(np.array([[tok]]), np.array([[past]]), causal_mask(past, 1), np.array([[0]]))
        two = StepInputs(np.array([[tok, tok]]), np.array([[past, past + 1]]), causal_mask(past, 2), np.array([[0]]))
        cells = {"two-row": lambda: old_t.run(two, kvs["old"], past),
                 "one-row": lambda: new_t.run(one, kvs["new"], past),
                 "plain": lambda: old_t.run(one, kvs["old"], past),
                 "new-two-row": lambda: new_t.run(two, kvs["new"], past)}
        rounds = {k: [] for k in cells}
        for fn in cells.values():
            for _ in range(5):
                fn()
        for _ in range(args.rounds):
            for k, fn in cells.items():
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                rounds[k].append((time.perf_counter() - t0) / 20 * 1e3)
        ms[past] = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3)} for k, v in rounds.items()}
        print(f"past {past}: " + ", ".join(f"{k} {v['median']:.2f} ms (min {v['min']:.2f})"
                                           for k, v in ms[past].items()), flush=True)
    out["forward_ms"] = ms

if "2" in args.parts:
    systems = {"two-row": load(args.old, True), "one-row": load(args.new, True, force_one_row=True),
               "plain": load(args.old, False), "new-choice": load(args.new, True)}
    print("step rows:", {k: rt.decoder.step_rows for k, rt in systems.items()}, flush=True)
    res = {k: [0, 0.0] for k in systems}
    tokens = {k: [] for k in systems}
    for rep in range(args.passes):
        for p in PROMPTS:
            ids = systems["two-row"].encode(p)
            for k, rt in systems.items():
                r = rt.generate(ids, max_new_tokens=args.tokens, mode="vanilla")
                res[k][0] += r.stats.new_tokens
                res[k][1] += r.stats.t_total
                if rep == 0:
                    tokens[k].append(r.token_ids)
    out["vanilla_tokens_per_s"] = {k: round(n / s, 1) for k, (n, s) in res.items()}
    out["vanilla_same_tokens_as_two_row"] = {k: sum(a == b for a, b in zip(v, tokens["two-row"]))
                                             for k, v in tokens.items()}
    print("vanilla tokens/s:", out["vanilla_tokens_per_s"], "same tokens as two-row:",
          out["vanilla_same_tokens_as_two_row"], flush=True)
    del systems

if "3" in args.parts:
    runtimes = {"OLD two-row": load(args.old, True, with_draft=True),
                "NEW runtime's choice": load(args.new, True, with_draft=True),
                "NEW one row forced": load(args.new, True, force_one_row=True, with_draft=True)}
    same = {k: 0 for k in runtimes}
    speeds = {k: {"eagle": [0, 0.0], "vanilla": [0, 0.0]} for k in runtimes}
    for p in PROMPTS:
        for label, rt in runtimes.items():
            ids = rt.encode(p)
            runs = {m: rt.generate(ids, max_new_tokens=args.tokens, mode=m) for m in ("vanilla", "eagle")}
            same[label] += runs["eagle"].token_ids == runs["vanilla"].token_ids
            for m, r in runs.items():
                speeds[label][m][0] += r.stats.new_tokens
                speeds[label][m][1] += r.stats.t_total
    out["greedy_identity"] = {k: {"step_rows": rt.decoder.step_rows, "identical": f"{same[k]} / {len(PROMPTS)}",
                                  **{f"{m}_tokens_per_s": round(n / s, 1) for m, (n, s) in speeds[k].items()}}
                              for k, rt in runtimes.items()}
    for k, v in out["greedy_identity"].items():
        print(k, v, flush=True)

if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
