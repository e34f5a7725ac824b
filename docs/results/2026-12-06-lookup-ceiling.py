"""The 2026-12-06 lookup ceiling behind docs/decisions.md ("what summarization / rag tau >= 2.5
would take"): greedy vanilla outputs of the fp32 export on Spec-Bench's summarization, rag,
translation and qa questions (the output every lossless drafter must reproduce), then, offline,
the tau a context-lookup drafter alone would reach on them under several proposal rules, each
round proposing a chain of at most 16 tokens and committing its longest match plus the bonus
token: the product's rule (longest suffix of at most 3 tokens, latest occurrence), longer
suffixes, 3 continuations with distinct first tokens (the alternates), and an oracle that
tries every earlier occurrence of every suffix; and the product's rule with an index of the
earlier requests' outputs beside the request's own context. Run from the repository root:
python docs/results/2026-12-06-lookup-ceiling.py ENGINES QUESTION_JSONL LIMIT OUT_JSON"""
import json
import sys
from collections import defaultdict

from eagle_deploy.common.prompts import specbench_prompts
from eagle_deploy.runtime.api import EagleRuntime

CHAIN = 16
TASKS = ("summarization", "rag", "translation", "qa")


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def starts(toks, n):
    """Positions right after each earlier occurrence of the last n tokens."""
    suffix = toks[-n:]
    return [e for e in range(n, len(toks)) if toks[e - n:e] == suffix]


def latest(toks, max_n, min_n=1):
    for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
        if found := starts(toks, n):
            return [toks[found[-1]:found[-1] + CHAIN]]
    return []


def distinct_first(toks, k, max_n=3):
    out, firsts = [], set()
    for n in range(min(max_n, len(toks) - 1), 0, -1):
        for e in reversed(starts(toks, n)):
            if toks[e] not in firsts:
                firsts.add(toks[e])
                out.append(toks[e:e + CHAIN])
                if len(out) == k:
                    return out
    return out


def every(toks, max_n):
    return [toks[e:e + CHAIN] for n in range(min(max_n, len(toks) - 1), 0, -1) for e in starts(toks, n)]


RULES = {"latest, suffix <= 3 (product)": lambda t: latest(t, 3), "latest, suffix <= 6": lambda t: latest(t, 6),
         "latest, suffix 2-3": lambda t: latest(t, 3, 2), "3 distinct first tokens": lambda t: distinct_first(t, 3),
         "oracle: every occurrence, suffix <= 8": lambda t: every(t, 8)}

rt = EagleRuntime.load(sys.argv[1], threads=2, with_draft=False)
runs = []
for p in specbench_prompts(sys.argv[2], int(sys.argv[3])):
    if p["category"] in TASKS:
        out = rt.generate(p["prompt"], max_new_tokens=128, mode="vanilla").token_ids
        runs.append(dict(task=p["category"], prompt=rt.prompt_ids(p["prompt"]), output=list(map(int, out))))
tau = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # task -> rule -> [tokens, rounds]
for run in runs:
    prompt, out = run["prompt"], run["output"]
    for name, rule in RULES.items():
        t = 0
        while t < len(out):
            acc = min(max((common(c, out[t:]) for c in rule(prompt + out[:t])), default=0), len(out) - t - 1)
            t += acc + 1
            for key in (run["task"], "all"):
                tau[key][name][0] += acc + 1
                tau[key][name][1] += 1
# a per-server index of recent outputs (issue 22 part 3, optional): when an earlier request's
# output matches a longer suffix than the request's own context, propose its continuation
RECENT = 64
history: list[list[int]] = []
for run in runs:
    prompt, out = run["prompt"], run["output"]
    t = 0
    while t < len(out):
        ctx = prompt + out[:t]
        own, best = None, (0, [])
        for n in range(min(3, len(ctx) - 1), 0, -1):
            if found := starts(ctx, n):
                own = (n, ctx[found[-1]:found[-1] + CHAIN])
                break
        for h in history[-RECENT:]:
            for n in range(min(3, len(ctx)), best[0], -1):
                ends = [e for e in range(n, len(h)) if h[e - n:e] == ctx[-n:]]
                if ends:
                    best = (n, h[ends[-1]:ends[-1] + CHAIN])
                    break
        chain = best[1] if best[0] > (own[0] if own else 0) else (own[1] if own else [])
        acc = min(common(chain, out[t:]), len(out) - t - 1)
        t += acc + 1
        for key in (run["task"], "all"):
            tau[key][f"product's rule + outputs of the {RECENT} requests before"][0] += acc + 1
            tau[key][f"product's rule + outputs of the {RECENT} requests before"][1] += 1
    history.append(out)
table = {task: {name: round(a / b, 3) for name, (a, b) in rules.items()} for task, rules in tau.items()}
for task, rules in table.items():
    print(f"{task:14s}", " | ".join(f"{n}: {v:.2f}" for n, v in rules.items()))
stored = [dict(task=r["task"], prompt_tokens=len(r["prompt"]), output=r["output"]) for r in runs]  # no question text
json.dump(dict(engines=sys.argv[1], chain=CHAIN, tau=table, runs=stored), open(sys.argv[4], "w"))
