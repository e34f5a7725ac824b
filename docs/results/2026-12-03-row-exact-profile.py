"""Where a two-row (row-exact) one-token forward spends its extra time: onnxruntime's profiler
on the int4 target graph, vanilla decoding with row_exact on (2 rows) and off (1 row).
Usage: python 2026-12-03-row-exact-profile.py on|off EXPORT_DIR (an eagle-export --quant int4 folder)."""
import collections, json, sys
from eagle_deploy.runtime.backends import ort as ob
from eagle_deploy.runtime.api import EagleRuntime

real = ob.session_options
def profiled(*a, **kw):
    so = real(*a, **kw)
    so.enable_profiling = True
    so.profile_file_prefix = f"/tmp/prof-{sys.argv[1]}"
    return so
ob.session_options = profiled
rt = EagleRuntime.load(sys.argv[2], threads=2, row_exact=sys.argv[1] == "on", with_draft=False)
p = "Explain the difference between a list and a tuple in Python, with examples of when to use each one."
r = rt.generate(p, max_new_tokens=96, mode="vanilla")
path = rt.decoder.target.session.end_profiling()
ev = json.load(open(path))
by, runs = collections.Counter(), 0
for e in ev:
    if e.get("cat") == "Session" and e["name"] == "model_run":
        runs += 1
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        by[e["args"]["op_name"]] += e["dur"]
steps = r.stats.new_tokens
print(sys.argv[1], "runs", runs, "new tokens", steps, "tok/s", round(r.stats.tokens_per_s, 1))
tot = sum(by.values())
for op, us in by.most_common(12):
    print(f"  {op:36s} {us / runs:8.1f} us/run")
print(f"  {'total':36s} {tot / runs:8.1f} us/run")
