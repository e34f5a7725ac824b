"""eagle-bench results: aggregation, the JSON file, the PNG plot and the printed table.

Aggregates are per temperature ("0", "0.7", ...), per system and per category ("all" plus
each prompt category): tokens/s = generated tokens / wall seconds summed over prompts
(prefill included), tau = tokens per target forward, TTFT mean, EAGLE's time split, and
speed-ups (aggregate tokens/s ratios; the per-prompt mean beside it). tau is pooled over every
round of the category's prompts (`runtime.acceptance.tau`).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from eagle_deploy.runtime.acceptance import tau

from .ceiling import ceiling_lines

PHASES = ("prefill", "draft", "verify", "commit", "other")


def temp_key(t: float) -> str:
    return f"{float(t):g}"


def _agg_runs(runs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    out = {"prompts": len(runs), "new_tokens": tokens, "seconds": round(seconds, 4),
           "tokens_per_s": round(tokens / max(seconds, 1e-9), 2)}
    ttft = [r["ttft_ms"] for r in runs if r.get("ttft_ms") is not None]
    out["ttft_ms"] = round(float(np.mean(ttft)), 2) if ttft else None
    if all("time_ms" in r for r in runs) and runs:
        pooled = tau(n for r in runs for n in r.get("accepted_per_round", []))  # tokens per verification round
        out["tau"] = None if pooled is None else round(pooled, 3)
        total = {p: sum(r["time_ms"].get(p, 0.0) for r in runs) for p in PHASES}
        out["time_ms"] = {p: round(v, 2) for p, v in total.items()}
        out["time_ms_per_token"] = {p: round(v / max(tokens, 1), 3) for p, v in total.items()}
    return out


def _system_rank(name: str) -> tuple:
    """eagle*, vanilla*, then baselines in BASELINES order."""
    from .systems import BASELINES

    base = name.split("@")[0]
    order = ["eagle", "vanilla", *BASELINES]
    return (order.index(base) if base in order else len(order), name)


def aggregate(prompts: list[dict]) -> dict:
    """{temperature: {category: {system: stats, "speedup": {...}}}} over per-prompt records."""
    groups: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for p in prompts:
        for cat in ("all", p["category"]):
            for system, run in p["runs"].items():
                groups[temp_key(p["temperature"])][cat][system].append(run)
    out = {}
    for t, cats in groups.items():
        out[t] = {}
        for cat, systems in cats.items():
            stats = {s: _agg_runs(systems[s]) for s in sorted(systems, key=_system_rank)}
            out[t][cat] = {"systems": stats,
                           "speedup": _speedups(stats, [p for p in prompts if temp_key(p["temperature"]) == t
                                                        and cat in ("all", p["category"])])}
    return out


def _speedups(stats: dict, prompts: list[dict]) -> dict:
    """EAGLE over vanilla (same engine; per backend) and over each baseline."""
    out = {}
    for system in stats:
        if not system.startswith("eagle"):
            continue
        vanilla = vanilla_of(system)
        for other in stats:
            if other.startswith("eagle"):
                continue
            if other.startswith("vanilla") and other != vanilla:
                continue
            ratio = stats[system]["tokens_per_s"] / max(stats[other]["tokens_per_s"], 1e-9)
            key = f"{system}_vs_{other}"
            out[key] = {"aggregate": round(ratio, 3)}
            per = [p["runs"][system]["tokens_per_s"] / max(p["runs"][other]["tokens_per_s"], 1e-9)
                   for p in prompts if system in p["runs"] and other in p["runs"]]
            if per:
                out[key]["mean_per_prompt"] = round(float(np.mean(per)), 3)
    return out


def write_json(result: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def plot(result: dict, path: Path) -> Path:
    """Left: tokens/s per system and category (greedy; sampled EAGLE/vanilla as extra bars).
    Right: EAGLE's time per generated token split into prefill/draft/verify/commit/other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["aggregate"]
    series: dict[str, dict[str, float]] = {}
    for t, cats in agg.items():
        for cat, block in cats.items():
            for system, s in block["systems"].items():
                label = system if t == "0" else f"{system} T={t}"
                series.setdefault(label, {})[cat] = s["tokens_per_s"]
    cats = ["all"] + sorted({c for t in agg.values() for c in t} - {"all"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 2 + 1.2 * len(cats) * max(len(series), 1) / 3), 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (label, vals) in enumerate(series.items()):
        ax1.bar(np.arange(len(cats)) + i * width, [vals.get(c, 0.0) for c in cats], width, label=label)
    ax1.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats, rotation=30, ha="right")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput by system and category")
    ax1.legend(fontsize=7)
    bars = [(f"{s} T={t}", st) for t, cats_ in agg.items() for s, st in cats_["all"]["systems"].items()
            if s.startswith("eagle") and "time_ms_per_token" in st]
    bottom = np.zeros(len(bars))
    for phase in ("prefill", "draft", "verify", "commit", "other"):
        vals = np.array([max(b[1]["time_ms_per_token"][phase], 0.0) for b in bars])
        ax2.bar(np.arange(len(bars)), vals, 0.6, bottom=bottom, label=phase)
        bottom += vals
    ax2.set_xticks(np.arange(len(bars)), [b[0] for b in bars], rotation=30, ha="right")
    ax2.set_ylabel("ms per generated token")
    ax2.set_title("EAGLE time breakdown")
    ax2.legend(fontsize=7)
    fig.suptitle(f"eagle-bench: {result['engines']} ({result['machine'].get('threads')} threads)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_lines(modes: dict) -> list[str]:
    """Summary lines for result["memory"]["modes"] (bench/memory.py): peak RSS of vanilla and
    EAGLE, each in a fresh process, and the export folder by file."""
    lines = []
    for backend, m in modes.items():
        if "error" in m:
            lines.append(f"memory [{backend}]: probe failed: {m['error']}")
            continue
        v, e = m["vanilla"], m["eagle"]
        device = "".join(f", {name} GPU {x['device_mb']} MiB" for name, x in (("vanilla", v), ("EAGLE", e))
                         if x.get("device_mb") is not None)
        lines.append(f"memory [{backend}] (fresh process per mode): peak RSS vanilla {v['peak_rss_mb']} MiB, "
                     f"EAGLE {e['peak_rss_mb']} MiB ({m['eagle_vs_vanilla_peak_rss']:.2f}x){device}")
        files = m.get("export", {}).get("files", {})
        if files:
            lines.append(f"export {m['export']['total'] / 2**20:.1f} MiB: "
                         + ", ".join(f"{name} {size / 2**20:.1f}" for name, size in files.items()))
    return lines


def vanilla_of(system: str) -> str:
    """The vanilla system on the same engine as `system` ("eagle-hybrid@int4" -> "vanilla@int4")."""
    return "vanilla" + (system[system.index("@"):] if "@" in system else "")


def category_lines(cats: dict) -> list[str]:
    """Per category (e.g. Spec-Bench task): tokens/s and tau of every system, and each EAGLE
    system's ratio to its engine's vanilla; nothing with one category."""
    names = [c for c in cats if c != "all"]
    if len(names) < 2:
        return []
    lines = ["per category: tokens/s (tau) [x vanilla]", f"{'system':<26}" + "".join(f"{c[:16]:>24}" for c in names)]
    for system in cats["all"]["systems"]:
        cells = []
        for c in names:
            s = cats[c]["systems"].get(system)
            vanilla = cats[c]["systems"].get(vanilla_of(system))
            if s is None:
                cells.append(f"{'-':>24}")
                continue
            tau = "" if s.get("tau") is None else f" ({s['tau']:.2f})"
            ratio = (f" [{s['tokens_per_s'] / vanilla['tokens_per_s']:.2f}x]"
                     if vanilla and system.startswith("eagle") else "")
            cells.append(f"{s['tokens_per_s']:.1f}{tau}{ratio}".rjust(24))
        lines.append(f"{system:<26}" + "".join(cells))
    return lines


def format_summary(result: dict) -> str:
    """The human-readable table of the aggregate (category "all"); "x vanilla" = tokens/s over
    our (first engine's) vanilla decoding in the same run. Then one line per peer runtime."""
    lines = []
    for t, cats in result["aggregate"].items():
        block = cats["all"]
        lines.append(f"== temperature {t} ({block['systems'][next(iter(block['systems']))]['prompts']} prompts)")
        lines.append(f"{'system':<26}{'tokens/s':>10}{'x vanilla':>10}{'tau':>7}{'TTFT ms':>9}{'load RSS MiB':>14}"
                     "  time split (draft/verify/commit/other, ms/token)")
        vanilla = block["systems"].get("vanilla", {}).get("tokens_per_s")
        for system, s in block["systems"].items():
            split = s.get("time_ms_per_token")
            split_txt = "/".join(f"{split[p]:.1f}" for p in ("draft", "verify", "commit", "other")) if split else "-"
            tau = "-" if s.get("tau") is None else f"{s['tau']:.2f}"
            ttft = "-" if s.get("ttft_ms") is None else f"{s['ttft_ms']:.0f}"
            rss = result["memory"].get(system, {}).get("load_rss_mb", "-")
            ratio = f"{s['tokens_per_s'] / vanilla:.2f}x" if vanilla else "-"
            lines.append(f"{system:<26}{s['tokens_per_s']:>10.1f}{ratio:>10}{tau:>7}{ttft:>9}{rss!s:>14}  {split_txt}")
        for key, sp in block["speedup"].items():
            lines.append(f"speed-up {key}: {sp['aggregate']:.2f}x"
                         + (f" (per-prompt mean {sp['mean_per_prompt']:.2f}x)" if "mean_per_prompt" in sp else ""))
        lines += category_lines(cats)
    lines += ceiling_lines(result.get("ceiling") or {})
    proc = result["memory"].get("process")
    if proc:
        lines.append(f"process peak RSS {proc['peak_rss_mb']} MiB (all systems loaded together; "
                     "'load RSS' = growth when each was loaded; EAGLE and vanilla share one loaded engine)")
    lines += memory_lines(result["memory"].get("modes") or {})
    g = result.get("greedy_identity")
    for backend, s in (g or {}).items():
        if s["prompts"]:
            lines.append(f"greedy identity [{backend}]: {s['identical']}/{s['prompts']} prompts identical to vanilla "
                         f"({s['percent_identical']}%); divergences: {s['numerics']} numerics, {s['bugs']} bug; "
                         + ("" if s["largest_gap_at_divergence"] is None
                            else f"largest top-2 gap at a divergence {s['largest_gap_at_divergence']:.3g}; ")
                         + f"batched-vs-single logit noise {s['numerics_floor']:.3g}")
    for name, b in result["baselines"].items():
        if b["status"] != "ok":
            lines.append(f"note: baseline {name}: {b['note']}")
        elif "package" in b:
            g = b.get("greedy_vs_vanilla") or {}
            same = (f"; greedy tokens = our vanilla on {g['identical_tokens']}/{g['prompts']} prompts"
                    + (f" (text {g['identical_text']}/{g['prompts']})" if g.get("identical_text") is not None else "")
                    if g.get("prompts") else "")
            spec = b.get("speculative")
            drafted = (f"; EAGLE-3 draft {spec['head']} ({spec['generation_config']}), converted with: "
                       f"{spec['draft_command']}" if isinstance(spec, dict) else "")
            lines.append(f"peer {name}: {b['package']} {b['version']}, {b['precision']}{same}; built with: "
                         f"{b['command']}{drafted}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
