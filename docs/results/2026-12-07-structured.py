"""Structured-output benchmark: greedy vanilla vs EAGLE decoding under a JSON-schema grammar
(`response_format`, runtime/grammar.py) on docs/results/2026-12-07-structured-set.json
(10 strict schemas: extraction, classification, function arguments; 5 chat prompts each).
Run from the repository root, on a quiet machine:

    eagle-export --model smollm2-135m --out engines/ --force
    eagle-export --model smollm2-135m --quant int4 --name smollm2-135m-int4 --out engines/ --force
    .venv/bin/python docs/results/2026-12-07-structured.py engines/smollm2-135m \\
        docs/results/2026-12-07-structured-set.json docs/results/2026-12-07-structured-fp32.json
    # the same prompts without a grammar (the baseline):
    .venv/bin/python docs/results/2026-12-07-structured.py engines/smollm2-135m \\
        docs/results/2026-12-07-structured-set.json docs/results/2026-12-07-structured-fp32-nogrammar.json --no-grammar

--limit N / --per-schema N: the first N prompts / the first N of each schema (quick checks).
ENGINES_DIR is one export folder (it holds manifest.json) or a folder of exports (each
subfolder with a manifest.json is run in turn, e.g. `engines/`).

Per prompt, interleaved (the order alternates from prompt to prompt so that drift on a shared
machine falls on both sides): vanilla `rt.generate(messages, max_new_tokens=N, temperature=0,
mode="vanilla", response_format=RF)` and EAGLE `rt.generate(..., response_format=RF)` with the
default drafter; with --eagle-drafter also a second runtime with drafter_kind="eagle",
planned=False (the head's tree every round). RF = {"type": "json_schema", "json_schema":
{"name", "schema", "strict": True}}; --no-grammar leaves it out.

Recorded per run: tokens/s (stats.tokens_per_s: new tokens per second of the request,
prefill included; the grammar's compile time before the request is outside it and recorded
as `setup_ms`), tau (stats.mean_accept_len), new tokens, finish_reason, whether EAGLE's
token_ids equal vanilla's (greedy: they must), whether the text parses with json.loads and
validates against the schema (the `jsonschema` package when installed, else the small
validator below for the subset the set uses), the grammar's own time (every stats.to_json()
field with "grammar" in its name), and the whole stats.to_json().
Prints a per-schema table and an overall line, with lscpu's model name; writes everything to
OUT_JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.request import Request

try:
    import jsonschema
except ImportError:  # not a dependency of the package: the subset validator below
    jsonschema = None

REPO = Path(__file__).resolve().parents[2]


# -- validation -------------------------------------------------------------------------------

def _type_ok(value, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                              and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    raise ValueError(f"the subset validator does not know type {kind!r}")


def subset_errors(value, schema: dict, path: str = "$") -> list[str]:
    """Errors of `value` against `schema` for the keywords the set uses: type, properties,
    required, additionalProperties (false), enum, items, minItems/maxItems, minimum/maximum,
    minLength/maxLength, pattern (re.search, as JSON Schema defines it). Unknown keywords are
    refused rather than ignored."""
    known = {"type", "properties", "required", "additionalProperties", "enum", "items", "minItems", "maxItems",
             "minimum", "maximum", "minLength", "maxLength", "pattern", "description", "title"}
    unknown = set(schema) - known
    if unknown:
        raise ValueError(f"the subset validator does not know {sorted(unknown)} (install jsonschema)")
    errors = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_type_ok(value, k) for k in kinds):
            return [f"{path}: expected {'/'.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in enum")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required {key!r}")
        for key, item in value.items():
            if key in props:
                errors += subset_errors(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: additional property {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += subset_errors(item, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                errors += subset_errors(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    return errors


def check_json(text: str, schema: dict) -> dict:
    """{"parses", "valid", "error"} for a generated text."""
    try:
        value = json.loads(text)
    except ValueError as err:
        return {"parses": False, "valid": False, "error": f"json: {err}"[:200]}
    if jsonschema is not None:
        errors = [f"{'.'.join(map(str, e.absolute_path)) or '$'}: {e.message}"
                  for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    else:
        errors = subset_errors(value, schema)
    return {"parses": True, "valid": not errors, "error": "; ".join(errors)[:300] or None}


# -- environment ------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def git_state() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def environment(threads: int) -> dict:
    import onnxruntime
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
            "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "validator": "jsonschema " + jsonschema.__version__
            if jsonschema is not None else "subset (docs/results/2026-12-07-structured.py)", **git_state()}


# -- runs -------------------------------------------------------------------------------------

def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def grammar_fields(stats_json: dict) -> dict:
    return {k: v for k, v in stats_json.items() if "grammar" in k}


def run_one(rt: EagleRuntime, messages, new: int, mode: str, rf: dict | None, schema: dict) -> dict:
    settings = dict(max_new_tokens=new, temperature=0)
    if mode == "vanilla":
        settings["mode"] = "vanilla"
    if rf is not None:
        settings["response_format"] = rf
    t0 = time.perf_counter()
    r = rt.generate(messages, **settings)
    wall = time.perf_counter() - t0
    st = r.stats.to_json()
    return {"tokens_per_s": r.stats.tokens_per_s, "tau": r.stats.mean_accept_len, "new_tokens": len(r.token_ids),
            "finish_reason": r.finish_reason, "t_total_ms": round(r.stats.t_total * 1e3, 2),
            "wall_ms": round(wall * 1e3, 2),
            "setup_ms": round((wall - r.stats.t_total) * 1e3, 2),  # grammar compile + prompt encoding
            "grammar": grammar_fields(st), **check_json(r.text, schema),
            "text": r.text, "token_ids": r.token_ids, "stats": st}


def select(prompts: list[dict], limit: int | None, per_schema: int | None) -> list[dict]:
    """The first `per_schema` prompts of each schema (all without it), then the first `limit`."""
    if per_schema:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p["schema"]] = seen.get(p["schema"], 0) + 1
            if seen[p["schema"]] <= per_schema:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def load_runtimes(folder: Path, threads: int, eagle_drafter: bool, no_forced: bool = False
                  ) -> dict[str, EagleRuntime]:
    rts = {"default": EagleRuntime.load(folder, threads=threads)}
    if eagle_drafter:
        rts["eagle-head"] = EagleRuntime.load(folder, threads=threads, drafter_kind="eagle", planned=False)
    if no_forced:  # the same drafter without the grammar's forced-token chains (what they add to tau)
        rts["no-forced"] = EagleRuntime.load(folder, threads=threads, draft_forced=False)
    return rts


def warm_up(rts: dict[str, EagleRuntime], grammar: bool, name: str, schema: dict) -> None:
    msgs = [{"role": "user", "content": "Reply with a JSON object."}]
    rf = response_format(name, schema) if grammar else None
    for rt in rts.values():
        for mode in ("vanilla", "eagle"):
            run_one(rt, msgs, 16, mode, rf, schema)


def bench_export(folder: Path, data: dict, args) -> dict:
    grammar = not args.no_grammar
    rts = load_runtimes(folder, args.threads, args.eagle_drafter, args.no_forced)
    default = rts["default"]
    schemas = data["schemas"]
    prompts = select(data["prompts"], args.limit, args.per_schema)
    compile_ms = {}
    if grammar:  # every schema compiled once up front: a refused schema stops the run here
        default.grammar_for(Request("x", response_format={"type": "json_object"}))  # the grammar tokenizer, untimed
        for name in schemas:
            t0 = time.perf_counter()
            default.grammar_for(Request("x", response_format=response_format(name, schemas[name])))
            compile_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)
    first = prompts[0]["schema"]
    warm_up(rts, grammar, first, schemas[first])
    # runs per prompt: vanilla on the default runtime, then EAGLE on each runtime
    arms = [("vanilla", "default", "vanilla")] + [(f"eagle:{k}", k, "eagle") for k in rts]
    records = []
    for i, p in enumerate(prompts):
        schema = schemas[p["schema"]]
        rf = response_format(p["schema"], schema) if grammar else None
        order = arms if i % 2 == 0 else arms[::-1]
        runs = {}
        for arm, rt_name, mode in order:
            runs[arm] = run_one(rts[rt_name], p["messages"], args.max_new_tokens, mode, rf, schema)
        van = runs["vanilla"]
        for arm, run in runs.items():
            if arm != "vanilla":
                run["identical"] = run["token_ids"] == van["token_ids"]
                if not run["identical"]:
                    a, b = run["token_ids"], van["token_ids"]
                    run["first_divergence"] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                   min(len(a), len(b)))
                run["speedup"] = run["tokens_per_s"] / max(van["tokens_per_s"], 1e-9)
        records.append({"id": p["id"], "schema": p["schema"], "order": [a for a, _, _ in order], "runs": runs})
        e = runs["eagle:default"]
        g = e["grammar"].get("grammar_ms")
        print(f"  {p['id']:<18} vanilla {van['tokens_per_s']:6.1f} t/s  eagle {e['tokens_per_s']:6.1f} t/s  "
              f"tau {e['tau']:4.2f}  {e['new_tokens']:3d} tok {e['finish_reason']:<6} "
              f"valid {'y' if e['valid'] else 'n'}/{'y' if van['valid'] else 'n'}  "
              f"same {'y' if e['identical'] else 'n'}" + (f"  grammar {g:.0f} ms" if g is not None and grammar else ""),
              flush=True)
    return {"export": str(folder), "precision": _quant(folder), "grammar": grammar,
            "drafters": {k: {"kind": rt.drafter_kind, "planned": rt.planned} for k, rt in rts.items()},
            "compile_ms": compile_ms, "records": records, "summary": summarise(records, [a for a, _, _ in arms])}


def _quant(folder: Path) -> dict | None:
    """The export's precision as its manifest records it: {graph: {dtype, quant}}."""
    try:
        m = json.loads((folder / "manifest.json").read_text())
        return {g: {"dtype": m[g].get("dtype"), "quant": m[g].get("quant")} for g in ("target", "draft")}
    except (OSError, ValueError, KeyError, AttributeError):
        return None


# -- summary ----------------------------------------------------------------------------------

def aggregate(records: list[dict], arms: list[str]) -> dict:
    out = {"prompts": len(records)}
    for arm in arms:
        runs = [r["runs"][arm] for r in records]
        tokens = sum(x["new_tokens"] for x in runs)
        seconds = sum(x["t_total_ms"] for x in runs) / 1e3
        rounds = [len(x["stats"]["accepted_per_round"]) for x in runs]
        committed = [sum(x["stats"]["accepted_per_round"]) for x in runs]
        a = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
             "tau": round(sum(committed) / max(sum(rounds), 1), 3),
             "valid_pct": round(100 * sum(x["valid"] for x in runs) / len(runs), 1),
             "parses_pct": round(100 * sum(x["parses"] for x in runs) / len(runs), 1),
             "finish": {f: sum(x["finish_reason"] == f for x in runs)
                        for f in sorted({x["finish_reason"] for x in runs})},
             "grammar_ms": round(sum(x["grammar"].get("grammar_ms", 0.0) for x in runs), 1),
             "grammar_share_pct": round(100 * sum(x["grammar"].get("grammar_ms", 0.0) for x in runs)
                                        / max(seconds * 1e3, 1e-9), 1),
             "setup_ms_mean": round(statistics.mean(x["setup_ms"] for x in runs), 2)}
        if arm != "vanilla":
            a["identical_pct"] = round(100 * sum(x["identical"] for x in runs) / len(runs), 1)
            a["speedup"] = round(a["tokens_per_s"] / max(out["vanilla"]["tokens_per_s"], 1e-9), 3)
            a["speedup_median_per_prompt"] = round(statistics.median(x["speedup"] for x in runs), 3)
        out[arm] = a
    return out


def summarise(records: list[dict], arms: list[str]) -> dict:
    by_schema = {}
    for name in dict.fromkeys(r["schema"] for r in records):
        by_schema[name] = aggregate([r for r in records if r["schema"] == name], arms)
    return {"by_schema": by_schema, "overall": aggregate(records, arms)}


def print_table(result: dict, cpu: str) -> None:
    s = result["summary"]
    arms = [k for k in s["overall"] if k.startswith("eagle:")]
    grammar = result["grammar"]
    print(f"\n{result['export']}  ({'response_format json_schema' if grammar else 'no grammar'}; {cpu})")
    for arm in arms:
        print(f"EAGLE = {arm}")
        head = (f"{'schema':<16}{'n':>3} {'vanilla t/s':>11} {'EAGLE t/s':>10} {'speed-up':>8} {'tau':>5} "
                f"{'valid% v/E':>11} {'same%':>6}" + (f" {'grammar%':>8}" if grammar else ""))
        print(head)
        print("-" * len(head))
        rows = list(s["by_schema"].items()) + [("overall", s["overall"])]
        for name, agg in rows:
            if name == "overall":
                print("-" * len(head))
            v, e = agg["vanilla"], agg[arm]
            print(f"{name:<16}{agg['prompts']:>3} {v['tokens_per_s']:>11.1f} {e['tokens_per_s']:>10.1f} "
                  f"{e['speedup']:>7.2f}x {e['tau']:>5.2f} {v['valid_pct']:>5.0f}/{e['valid_pct']:<5.0f} "
                  f"{e['identical_pct']:>6.0f}" + (f" {e['grammar_share_pct']:>8.1f}" if grammar else ""))
        o = s["overall"]
        print(f"overall: vanilla {o['vanilla']['tokens_per_s']:.1f} t/s, EAGLE {o[arm]['tokens_per_s']:.1f} t/s, "
              f"{o[arm]['speedup']:.2f}x (median per prompt {o[arm]['speedup_median_per_prompt']:.2f}x), "
              f"tau {o[arm]['tau']:.2f}, valid {o['vanilla']['valid_pct']:.0f}% / {o[arm]['valid_pct']:.0f}%, "
              f"identical {o[arm]['identical_pct']:.0f}%, finish {o[arm]['finish']}"
              + (f", grammar {o[arm]['grammar_ms']:.0f} ms = {o[arm]['grammar_share_pct']:.1f}% of EAGLE time "
                 f"(vanilla {o['vanilla']['grammar_share_pct']:.1f}%)" if grammar else "")
              + f"  [{cpu}]")


def dumps(value) -> str:
    """JSON with indent 1, lists of numbers kept on one line (token ids, rounds). Only lists
    that json.dumps spread over lines are joined (a JSON string holds no raw newline, so
    generated texts are never touched)."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    num = r"-?[0-9][0-9.eE+-]*"
    return re.sub(rf"\[\n\s*({num}(?:,\n\s*{num})*)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def exports(root: Path) -> list[Path]:
    if (root / "manifest.json").is_file():
        return [root]
    found = sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())
    if not found:
        sys.exit(f"{root}: neither an export (manifest.json) nor a folder of exports")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", type=Path, help="an export folder, or a folder of exports")
    ap.add_argument("set_json", type=Path, help="the prompt set (2026-12-07-structured-set.json)")
    ap.add_argument("out_json", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--per-schema", type=int, default=None, help="the first N prompts of each schema only")
    ap.add_argument("--no-grammar", action="store_true", help="no response_format (the baseline)")
    ap.add_argument("--eagle-drafter", action="store_true",
                    help="also EAGLE with a second runtime: drafter_kind='eagle', planned=False")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-forced", action="store_true",
                    help="also EAGLE without drafting the grammar's forced tokens (draft_forced=False)")
    args = ap.parse_args()

    data = json.loads(args.set_json.read_text())
    missing = {p["schema"] for p in data["prompts"]} - set(data["schemas"])
    if missing:
        sys.exit(f"{args.set_json}: prompts name unknown schemas {sorted(missing)}")
    env = environment(args.threads)
    print(f"cpu: {env['cpu']} ({env['cores']} cores, {args.threads} threads), load {env['load_average']}, "
          f"validator: {env['validator']}", flush=True)
    results = []
    for folder in exports(args.engines):
        print(f"\n{folder}", flush=True)
        results.append(bench_export(folder, data, args))
    env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    for r in results:
        print_table(r, env["cpu"])
    out = {"benchmark": "structured outputs (response_format json_schema), greedy vanilla vs EAGLE",
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "set": str(args.set_json),
           "max_new_tokens": args.max_new_tokens, "limit": args.limit, "per_schema": args.per_schema,
           "grammar": not args.no_grammar,
           "environment": env, "results": results}
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(dumps(out))
    print(f"\nwrote {args.out_json}")


if __name__ == "__main__":
    main()
