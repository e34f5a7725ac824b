"""τ on Spec-Bench's MT-bench extraction questions (issue 22 names extraction beside
summarization and rag; eagle-bench folds MT-bench's eight categories into one task). Greedy,
128 new tokens, first turns, the commands' default drafter (hybrid, planned) and the head's
fixed tree. Run from the repository root:
python docs/results/2026-12-05-extraction-tau.py ENGINES QUESTION_JSONL OUT_JSON"""
import json
import sys

from eagle_deploy.runtime.api import EagleRuntime

folder, questions, out = sys.argv[1:4]
prompts = [json.loads(line) for line in open(questions, encoding="utf-8") if line.strip()]
prompts = [q for q in prompts if q["category"] == "extraction"]
result = {}
for name, kind, planned in (("eagle-hybrid", "hybrid", True), ("eagle (fixed tree)", "eagle", False)):
    rt = EagleRuntime.load(folder, threads=2, drafter_kind=kind, planned=planned)
    rows = []
    for q in prompts:
        r = rt.generate(q["turns"][0], max_new_tokens=128)
        rows.append({"id": q["question_id"], "tokens": r.stats.round_tokens, "rounds": r.stats.rounds,
                     "tau": r.stats.mean_accept_len, "ids": r.token_ids})
    tau = sum(x["tokens"] for x in rows) / sum(x["rounds"] for x in rows)
    result[name] = {"tau": tau, "per_question": [{k: v for k, v in x.items() if k != "ids"} for x in rows]}
    result[name]["_ids"] = [x["ids"] for x in rows]
    print(f"{name}: {len(rows)} extraction questions, tau {tau:.3f}", flush=True)
same = sum(a == b for a, b in zip(*(v.pop("_ids") for v in result.values())))
result["identical_outputs"] = f"{same}/{len(prompts)}"
print("identical outputs", result["identical_outputs"])
json.dump(result, open(out, "w"), indent=1)
