"""The 2026-12-06 counterfactual behind docs/decisions.md ("what summarization / rag tau >= 2.5
would take"): would narrower head drafts (the head's top-1 chain of 1-3 tokens, or one depth of
the tree) pay where the configured EAGLE-2 tree (6 / 3 / 2: 5 nodes, depth 3) does not? The
head's tree is drafted every round (eagle drafter, unplanned, greedy); per round the script
records how deep the accepted path ran, and how deep it ran along the head's top-1 chain (each
accepted node the best-scored of its siblings). Then, offline, every fixed choice is priced
with this process's measured costs (planner.measure_costs, after the runs): tokens / (verify
seconds at the round's tree rows and cached rows + draft forwards), as a ratio to a vanilla
step at the same rows. Rounds are those of the full tree, so a narrower draft is credited
with exactly what the full tree's nodes of it accepted. Run from the repository root:
python docs/results/2026-12-06-narrow-trees.py ENGINES QUESTION_JSONL LIMIT OUT_JSON"""
import json
import sys
from collections import defaultdict

import numpy as np

from eagle_deploy.common.prompts import specbench_prompts
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.planner import measure_costs

rounds: list[dict] = []


def observe(tree, logits, verification):
    chain = 0
    for node in verification.path[1:]:
        siblings = np.flatnonzero(tree.parents == tree.parents[node])
        if tree.scores[node] < tree.scores[siblings].max():
            break
        chain += 1
    rounds.append(dict(accepted=verification.accepted, chain=chain, size=tree.size))


rt = EagleRuntime.load(sys.argv[1], threads=2, round_observers=[observe])
runs = []
for p in specbench_prompts(sys.argv[2], int(sys.argv[3])):
    rounds = []
    r = rt.generate(p["prompt"], max_new_tokens=128)
    runs.append(dict(task=p["category"], prompt_tokens=r.stats.prompt_tokens, rounds=rounds))
    print(p["category"], r.stats.prompt_tokens, round(r.stats.mean_accept_len, 2), flush=True)
head = rt.decoder.drafter
costs = measure_costs(rt.decoder.target, head.backend, [1, 2, 3, 4, 6], rt.tree.top_k, rt.manifest.dims.vocab,
                      rt.manifest.dims.hidden, np.dtype(rt.manifest.draft.dtype), pasts=(64, 1024))
depth = rt.tree.depth
choices = {"vanilla": None, f"tree {rt.tree.total_tokens}/{depth}/{rt.tree.top_k}": "tree", "tree depth 1": "tree1",
           **{f"top-1 chain of {d}": d for d in (1, 2, 3)}}
acc = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))  # task -> choice -> [tokens, seconds]
for run in runs:
    past = run["prompt_tokens"]
    for rd in run["rounds"]:
        for name, c in choices.items():
            if c is None:
                tokens, secs = 1, costs.verify(1, past)
            elif c == "tree":
                tokens, secs = rd["accepted"] + 1, costs.verify(rd["size"], past) + depth * costs.draft(past)
            elif c == "tree1":
                tokens, secs = min(rd["accepted"], 1) + 1, costs.verify(1 + rt.tree.top_k, past) + costs.draft(past)
            else:
                tokens, secs = min(rd["chain"], c) + 1, costs.verify(1 + c, past) + c * costs.draft(past)
            for key in (run["task"], "all"):
                acc[key][name][0] += tokens
                acc[key][name][1] += secs
        past += rd["accepted"] + 1
table = {task: {n: round((v[0] / v[1]) / (d["vanilla"][0] / d["vanilla"][1]), 3) for n, v in d.items()}
         for task, d in acc.items()}
print(f"{'x vanilla':14s}", *choices)
for task, row in table.items():
    print(f"{task:14s}", *(f"{row[n]:.3f}" for n in choices))
json.dump(dict(engines=sys.argv[1], tree=[rt.tree.total_tokens, depth, rt.tree.top_k], costs=costs.to_json(),
               ratio_to_vanilla=table, runs=runs), open(sys.argv[4], "w"))
