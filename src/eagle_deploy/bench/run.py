"""The eagle-bench run: every system is loaded first, then each prompt runs on all of them,
interleaved (the order reverses from one prompt to the next, so EAGLE and vanilla alternate
and a burst of load on a shared machine hits every system alike). Baselines run greedy
prompts only. Then the greedy identity check and aggregation.

Result JSON keys: schema, engines, manifest, date, machine, config, tree, numerics
({engine: batched-vs-single max |logit diff|}), prompts (one record per prompt and
temperature: id, set, category, temperature, seed, prompt_ids, prompt_tokens, order, runs
{system: run}, greedy {engine: {identical, divergence}}), aggregate ({temperature:
{category: {systems, speedup}}}), greedy_identity ({engine: summary}), baselines ({name:
{status, note, greedy_vs_vanilla: {reference, prompts, identical_tokens, identical_text}}, a
peer's also {package, version, precision, model_dir, command, converter, runtime}: bench/peers.py}),
memory ({system: {load_rss_mb}, "process": {peak_rss_mb, rss_mb}, "modes": {engine:
EAGLE's and vanilla's peak memory each in a fresh process, and the export's size by file
(bench/memory.py)}}), notes. An "engine" key is a backend name ("ort", "trt") or, for an
--extra-engines export (run on the first backend as eagle@<name>, vanilla@<name>), its folder name.
"""
from __future__ import annotations

import datetime as _dt
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eagle_deploy.common.cpu import machine_record
from eagle_deploy.common.prompts import load_prompts
from eagle_deploy.runtime.memory import peak_rss_mb

from . import divergence as dv
from .ceiling import engine_ceilings
from .report import aggregate
from .systems import EagleSystem, baseline_unavailable, make_baseline, rss_mb

SCHEMA = "eagle-bench/1"
NOISE_PREFIX = 16  # tokens in the batched-vs-single noise measurement


@dataclass
class BenchConfig:
    engines: Path
    prompt_sets: list[str] = field(default_factory=lambda: ["humaneval", "chat"])
    limit: int = 0
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    baselines: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=lambda: ["ort"])
    threads: int = 2
    tree: object | None = None  # TreeConfig; None = the manifest's
    seed: int = 0
    warmup: bool = True
    memory: bool = True  # also measure EAGLE's and vanilla's peak memory, each in a fresh process
    extra_engines: list[Path] = field(default_factory=list)  # more exports (e.g. int4), on backends[0]
    eagle3_head: Path | None = None  # the EAGLE-3 head the openvino-eagle3-* peers draft with
    drafters: list[str] = field(default_factory=list)  # more drafters per engine: "hybrid", "lookup" (planned)
    specbench: Path | None = None  # Spec-Bench's question.jsonl, run as the set "specbench"


def machine_info(threads: int) -> dict:
    import onnxruntime
    import torch

    return {**machine_record(threads), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "torch": torch.__version__}


def system_name(mode: str, backend_index: int, backend: str) -> str:
    """"eagle"/"vanilla" on the first backend, "eagle@trt" etc. on the others."""
    return mode if backend_index == 0 else f"{mode}@{backend}"


@dataclass
class Engine:
    """One loaded export on one backend. key: the backend name, or the folder name of an extra export."""

    key: str
    folder: Path
    backend: str
    rt: object  # EagleRuntime
    eagle: EagleSystem
    vanilla: EagleSystem
    others: list = field(default_factory=list)  # EagleSystems of more drafters (cfg.drafters)


class _Loaded:
    """The systems of one run, in run order, with each one's RSS growth at load."""

    def __init__(self):
        self.systems: list = []
        self.engines: list[Engine] = []

    def add(self, system, memory: dict, before: float) -> None:
        self.systems.append(system)
        memory[system.name] = {"load_rss_mb": round(rss_mb() - before, 1)}


def load_systems(cfg: BenchConfig, manifest, result: dict, log: Callable) -> _Loaded:
    from eagle_deploy.runtime.api import EagleRuntime

    loaded = _Loaded()
    runs = [(backend, cfg.engines, backend, i) for i, backend in enumerate(cfg.backends)]
    runs += [(Path(f).resolve().name, Path(f), cfg.backends[0], None) for f in cfg.extra_engines]
    for key, folder, backend, i in runs:
        before = rss_mb()
        # eagle-bench's `eagle` is the head's fixed tree every round (its hybrid, planned
        # systems are `cfg.drafters`, below)
        rt = EagleRuntime.load(folder, backend=backend, tree=cfg.tree, threads=cfg.threads, drafter_kind="eagle",
                               planned=False)
        eagle, vanilla = (EagleSystem(rt, m, system_name(m, i, backend) if i is not None else f"{m}@{key}")
                          for m in ("eagle", "vanilla"))
        loaded.add(eagle, result["memory"], before)
        loaded.add(vanilla, result["memory"], before)  # the same engine and buffers
        others = []
        for kind in cfg.drafters:  # e.g. eagle-hybrid, eagle-hybrid@<key>: a runtime of their own
            before = rss_mb()
            other_rt = EagleRuntime.load(folder, backend=backend, tree=cfg.tree, threads=cfg.threads,
                                         drafter_kind=kind, planned=True)
            suffix = "" if i == 0 else f"@{backend}" if i is not None else f"@{key}"
            others.append(EagleSystem(other_rt, "eagle", f"eagle-{kind}{suffix}"))
            loaded.add(others[-1], result["memory"], before)
        loaded.engines.append(Engine(key, Path(folder), backend, rt, eagle, vanilla, others))
    if len({e.key for e in loaded.engines}) < len(loaded.engines):
        raise ValueError(f"two engines share a name: {', '.join(e.key for e in loaded.engines)}")
    result["tree"] = loaded.engines[0].rt.tree.to_json()
    hf_model = None
    for name in cfg.baselines:
        reason = baseline_unavailable(name, manifest, cfg.eagle3_head)
        if reason is None and 0.0 not in cfg.temperatures:
            reason = "baselines run greedy only and --temperatures has no 0: skipped"
        if reason:
            result["baselines"][name] = {"status": "skipped", "note": reason}
            log(f"note: baseline {name}: {reason}")
            continue
        before = rss_mb()
        try:
            if name.startswith("hf") and hf_model is None:
                from eagle_deploy.exporter.sources import load_reference_target

                hf_model = load_reference_target(manifest)
            system = make_baseline(name, manifest, cfg.threads, hf_model, log, cfg.eagle3_head)
            loaded.add(system, result["memory"], before)
            result["baselines"][name] = {"status": "ok", "note": "", **getattr(system, "record", {})}
        except Exception as err:  # a baseline failing must not lose the EAGLE numbers
            result["baselines"][name] = {"status": "failed", "note": f"{type(err).__name__}: {err}"}
            log(f"note: baseline {name} failed to load: {err}")
    return loaded


def _encode(records: list[dict], engines: list[Engine], cfg: BenchConfig, result: dict) -> list[dict]:
    """Prompt token ids (the first export's chat template) once for every system; drops prompts
    that leave no room for max_new_tokens. Raises ValueError when another export tokenizes a
    prompt differently (its systems would not get the same prompt)."""
    rt = engines[0].rt
    for r in records:
        text = r.pop("prompt")
        r["prompt_ids"] = rt.encode(text)
        r["prompt_tokens"] = len(r["prompt_ids"])
        for e in engines[1:]:
            if e.rt is not rt and e.rt.encode(text) != r["prompt_ids"]:
                raise ValueError(f"{e.folder} tokenizes prompt {r['id']} differently from {engines[0].folder}")
    room = min(e.rt.manifest.max_length for e in engines) - cfg.max_new_tokens
    too_long = sorted({str(r["id"]) for r in records if r["prompt_tokens"] > room})
    if too_long:
        result["notes"].append(f"skipped {len(too_long)} prompt(s) longer than max_length - max_new_tokens = "
                               f"{room} tokens: {', '.join(too_long)}")
    kept = [r for r in records if r["prompt_tokens"] <= room]
    if not kept:
        raise ValueError(f"no prompt fits this export: every prompt is longer than {room} tokens "
                         "(max_length - max_new_tokens)")
    return kept


def _run_one(system, r: dict, cfg: BenchConfig, result: dict, loaded: _Loaded, log: Callable) -> None:
    try:
        run = system.run(r["prompt_ids"], cfg.max_new_tokens, r["temperature"], r["seed"]).to_json()
        run["peak_rss_mb"] = peak_rss_mb()  # the process high-water mark after this run
        r["runs"][system.name] = run
    except Exception as err:
        if isinstance(system, EagleSystem):
            raise
        result["baselines"][system.name] = {"status": "failed", "note": f"{type(err).__name__}: {err}"}
        log(f"note: baseline {system.name} failed: {err}")
        loaded.systems.remove(system)


def _finish_record(r: dict, loaded: _Loaded, floors: dict, log: Callable) -> None:
    for eng in loaded.engines:
        e, v = r["runs"][eng.eagle.name], r["runs"][eng.vanilla.name]
        e["speedup_vs_vanilla"] = round(e["tokens_per_s"] / max(v["tokens_per_s"], 1e-9), 3)
        for other in eng.others:
            o = r["runs"][other.name]
            o["speedup_vs_vanilla"] = round(o["tokens_per_s"] / max(v["tokens_per_s"], 1e-9), 3)
            if r["temperature"] == 0:  # lossless drafters: the very tokens of vanilla decoding
                o["identical_to_vanilla"] = o["token_ids"] == v["token_ids"]
        if r["temperature"] == 0:
            d = dv.check_greedy(eng.rt.decoder.target, r["prompt_ids"], e["token_ids"], v["token_ids"],
                                floors[eng.key])
            r.setdefault("greedy", {})[eng.key] = {"identical": d is None, "divergence": d.to_json() if d else None}
    vanilla = r["runs"].get("vanilla")
    for name, run in r["runs"].items():
        if vanilla and not name.startswith(("eagle", "vanilla")):
            run["first_difference_vs_vanilla"] = dv.first_difference(run["token_ids"], vanilla["token_ids"])
    log(f"{r['id']} T={r['temperature']:g}: "
        + ", ".join(f"{n} {run['tokens_per_s']:.1f} tok/s" for n, run in r["runs"].items()))


def measure_memory(cfg: BenchConfig, loaded: _Loaded, prompt_ids: list[int], log: Callable) -> dict:
    """{engine: bench.memory.measure_modes(...)} on the first prompt, or {"error": ...} for an
    engine whose probe failed (the speed results are kept)."""
    from .memory import measure_modes

    out = {}
    for e in loaded.engines:
        log(f"measuring peak memory on {e.key} (one fresh process per mode)")
        try:
            out[e.key] = measure_modes(e.folder, prompt_ids, cfg.max_new_tokens, e.backend, cfg.threads,
                                       e.rt.tree.to_json())
        except Exception as err:  # a failed probe must not lose the speed numbers
            out[e.key] = {"error": f"{type(err).__name__}: {err}"}
            log(f"note: memory probe on {e.key} failed: {err}")
    return out


def greedy_vs_vanilla(records: list[dict], name: str, tokenizer) -> dict:
    """How many greedy prompts baseline `name` answered exactly as our (first engine's) vanilla
    decoding: the same token ids, and the same text (decoded with the export's tokenizer,
    special tokens skipped; None without a tokenizer)."""
    pairs = [(r["runs"][name]["token_ids"], r["runs"]["vanilla"]["token_ids"]) for r in records
             if r["temperature"] == 0 and name in r["runs"] and "vanilla" in r["runs"]]
    text = None
    if tokenizer is not None:
        def dec(ids):
            return tokenizer.decode(ids, skip_special_tokens=True)
        text = sum(dec(a) == dec(b) for a, b in pairs)
    return {"reference": "vanilla", "prompts": len(pairs), "identical_tokens": sum(a == b for a, b in pairs),
            "identical_text": text}


def run_bench(cfg: BenchConfig, log: Callable = print) -> dict:
    """Run the benchmark described by `cfg`; returns the result dict (see module docstring)."""
    from eagle_deploy.contract.manifest import Manifest

    manifest = Manifest.load(cfg.engines)
    prompts = load_prompts(cfg.prompt_sets, cfg.limit, cfg.specbench)
    if not prompts:
        raise ValueError("no prompts selected")
    records = [{"id": p["id"], "set": p["set"], "category": p["category"], "prompt": p["prompt"],
                "temperature": float(t), "seed": cfg.seed + i, "runs": {}}
               for i, p in enumerate(prompts) for t in cfg.temperatures]
    result = {"schema": SCHEMA, "engines": str(cfg.engines), "manifest": manifest.name,
              "date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(cfg.threads),
              "config": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if k == "extra_engines" else v)
                         for k, v in asdict(cfg).items() if k != "tree"},
              "tree": None, "numerics": {}, "greedy_identity": {}, "baselines": {}, "memory": {},
              "notes": list(manifest.notes)}
    if not manifest.draft.trained:
        result["notes"].append("this export's draft head is untrained (random): expect tau near 1")
    loaded = load_systems(cfg, manifest, result, log)
    records = _encode(records, loaded.engines, cfg, result)
    floors = {}
    for e in loaded.engines:
        noise_ids = (list(records[0]["prompt_ids"]) * NOISE_PREFIX)[:NOISE_PREFIX]
        floors[e.key] = dv.batch_vs_single(e.rt.decoder.target, noise_ids)
        result["numerics"][e.key] = {"batch_vs_single_max_logit_diff": floors[e.key], "prefix_tokens": NOISE_PREFIX}
    if cfg.warmup:
        for system in list(loaded.systems):
            _run_one(system, {"prompt_ids": records[0]["prompt_ids"], "temperature": 0.0, "seed": 0, "runs": {}},
                     BenchConfig(cfg.engines, max_new_tokens=min(8, cfg.max_new_tokens)), result, loaded, log)
    for i, r in enumerate(records):
        active = [s for s in loaded.systems if r["temperature"] == 0 or isinstance(s, EagleSystem)]
        order = active if i % 2 == 0 else active[::-1]
        for system in order:
            _run_one(system, r, cfg, result, loaded, log)
        r["order"] = [s.name for s in order if s.name in r["runs"]]
        _finish_record(r, loaded, floors, log)
    for name, b in result["baselines"].items():
        if b["status"] == "failed":
            for r in records:
                r["runs"].pop(name, None)
        elif b["status"] == "ok":
            b["greedy_vs_vanilla"] = greedy_vs_vanilla(records, name, loaded.engines[0].rt.tokenizer)
    for backend in floors:
        result["greedy_identity"][backend] = dv.summarize([r["greedy"][backend] for r in records if "greedy" in r],
                                                          floors[backend])
    result["memory"]["process"] = {"peak_rss_mb": peak_rss_mb(), "rss_mb": rss_mb()}
    if cfg.memory:
        result["memory"]["modes"] = measure_memory(cfg, loaded, records[0]["prompt_ids"], log)
    result["prompts"] = records
    result["aggregate"] = aggregate(records)
    result["ceiling"] = {e.key: c for e in loaded.engines if (c := engine_ceilings(records, e)) is not None}
    return result
