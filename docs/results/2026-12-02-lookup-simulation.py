"""Reproduces docs/results/2026-12-02-lookup-continuation.json's simulation (lookup alone over
fixed greedy outputs; see that file's notes).

    python 2026-12-02-lookup-simulation.py greedy ENGINES QUESTION_JSONL OUT.json   # greedy ids, 10 per task
    python 2026-12-02-lookup-simulation.py simulate OUT.json                        # the τ tables

The runtime figures came from the attempt's diff (2026-12-02-lookup-continuation-attempt.diff)
with EagleRuntime.load(..., drafter_kind="hybrid", planned=False) and hybrid.CONTINUE = 0, 1, 2.
"""
import json
import sys
from collections import Counter, defaultdict


def greedy(engines, questions, out):
    from eagle_deploy.common.prompts import specbench_prompts
    from eagle_deploy.runtime.api import EagleRuntime
    rt = EagleRuntime.load(engines, threads=2)
    rows = []
    for r in specbench_prompts(questions, limit=10):
        ids = rt.prompt_ids(r["prompt"])
        rows.append({"id": r["id"], "category": r["category"], "prompt": ids,
                     "output": rt.generate(ids, max_new_tokens=128, mode="vanilla").token_ids})
    json.dump(rows, open(out, "w"))
def simulate(path):
    data = json.load(open(path))
    def occurrences(ctx, n):
        """positions e (exclusive end) where ctx[e-n:e] == ctx[-n:] and e < len(ctx)."""
        suf = ctx[-n:]
        L = len(ctx)
        return [e for e in range(n, L) if ctx[e - n:e] == suf]
    
    def strat(max_ngram, length, k, min_ngram=1, mode="recent"):
        def f(ctx):
            for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
                occ = occurrences(ctx, n)
                if not occ:
                    continue
                chains, firsts = [], set()
                order = occ[::-1] if mode == "recent" else occ
                if mode == "freq":
                    from collections import Counter
                    c = Counter(ctx[e] for e in occ)
                    order = sorted(occ[::-1], key=lambda e: -c[ctx[e]])
                for e in order:
                    ch = ctx[e:e + length]
                    if ch and ch[0] not in firsts:
                        firsts.add(ch[0]); chains.append(ch)
                    if len(chains) >= k:
                        break
                return n, chains
            return 0, []
        return f
    
    def oracle(length):
        def f(ctx):
            return 1, None
        return f
    
    def common(a, b):
        n = 0
        for x, y in zip(a, b):
            if x != y: break
            n += 1
        return n
    
    def run(f, rec, oracle_len=0):
        ctx0, out = rec["prompt"], rec["output"]
        t, rounds, nodes = 0, 0, 0
        while t < len(out):
            ctx = ctx0 + out[:t]
            fut = out[t:]
            if oracle_len:
                # best copy from anywhere in ctx: longest prefix of fut that occurs in ctx
                best = 0
                s = ctx
                for L in range(1, min(oracle_len, len(fut)) + 1):
                    pat = fut[:L]
                    if any(s[i:i+L] == pat for i in range(len(s) - L + 1)):
                        best = L
                    else:
                        break
                acc = best
            else:
                n, chains = f(ctx)
                acc = max((common(c, fut) for c in chains), default=0)
                nodes += sum(len(c) for c in chains)
            acc = min(acc, len(fut) - 1)
            t += acc + 1
            rounds += 1
        return len(out), rounds, nodes
    
    strats = {
        "n1-3,L8,k1 (shipped)": strat(3, 8, 1),
        "n1-6,L8,k1": strat(6, 8, 1),
        "n1-3,L16,k1": strat(3, 16, 1),
        "n2-6,L8,k1": strat(6, 8, 1, 2),
        "n1-3,L8,k2": strat(3, 8, 2),
        "n1-3,L8,k3": strat(3, 8, 3),
        "n1-6,L8,k3": strat(6, 8, 3),
        "n1-3,L8,k1 freq": strat(3, 8, 1, mode="freq"),
    }
    res = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for rec in data:
        for name, f in strats.items():
            a = run(f, rec)
            for i in range(3): res[name][rec["category"]][i] += a[i]; res[name]["all"][i] += a[i]
        a = run(None, rec, oracle_len=16)
        for i in range(3): res["oracle copy (any pos, L16)"][rec["category"]][i] += a[i]; res["oracle copy (any pos, L16)"]["all"][i] += a[i]
    cats = sorted({r["category"] for r in data}) + ["all"]
    print(f"{'strategy':32s}" + "".join(f"{c[:10]:>11s}" for c in cats) + "  nodes/round")
    for name, d in res.items():
        print(f"{name:32s}" + "".join(f"{d[c][0]/d[c][1]:11.2f}" for c in cats) + f"  {d['all'][2]/d['all'][1]:.1f}")
    
    print("\nupper bounds with the first token known (a head always right at depth 1):")
    res2 = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    look = strat(3, 8, 1)
    look3 = strat(3, 8, 3)
    for rec in data:
        ctx0, out = rec["prompt"], rec["output"]
        for name in ("first+lookup k1", "first+lookup k3", "lookup or first+lookup"):
            t, rounds = 0, 0
            while t < len(out):
                ctx, fut = ctx0 + out[:t], out[t:]
                f = look3 if "k3" in name else look
                _, chains = f(ctx + fut[:1])
                acc = 1 + max((common(c, fut[1:]) for c in chains), default=0)
                if name.startswith("lookup or"):
                    _, ch0 = look(ctx)
                    acc = max(acc, max((common(c, fut) for c in ch0), default=0))
                acc = min(acc, len(fut) - 1)
                t += acc + 1; rounds += 1
            for c in (rec["category"], "all"):
                res2[name][c][0] += len(out); res2[name][c][1] += rounds
    for name, d in res2.items():
        print(f"{name:32s}" + "".join(f"{d[c][0]/d[c][1]:11.2f}" for c in cats))


if __name__ == "__main__":
    greedy(*sys.argv[2:5]) if sys.argv[1] == "greedy" else simulate(sys.argv[2])
