"""eagle-eval: per-depth acceptance from hand-built rounds, the CLI on the tiny export (per
category tau, JSON), and clear errors for unknown prompt sets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_deploy.runtime.acceptance import depth_rates
from eagle_deploy.train import evaluate as ev
from tests.tiny_export import PROMPTS, prompt_file, specbench_file, tiny_export


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


def test_depth_rates_hand_built():
    # rounds: (draft tokens accepted, tree depth)
    accepted = [0, 1, 3, 2, 0]
    depths = [3, 3, 3, 2, 1]
    # depth 1: tried by every round (all reach depth 0), accepted by rounds 2, 3, 4 -> 3/5
    # depth 2: tried by rounds with depth >= 2 that accepted >= 1: rounds 2, 3, 4 -> accepted >= 2: rounds 3, 4 -> 2/3
    # depth 3: depth >= 3 and accepted >= 2: round 3 -> accepted 3 -> 1/1
    assert depth_rates(accepted, depths, 4) == [0.6, 0.6667, 1.0, None]


def test_cli_reports_tau_per_category(export_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = ev.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)), "--max-new-tokens", "10",
                  "--threads", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    (name, result), = res["sets"].items()
    summary = result["summary"]
    assert set(summary) == {"all", "code", "chat"}
    assert len(result["prompts"]) == len(PROMPTS)
    total_rounds = sum(summary[c]["rounds"] for c in ("code", "chat"))
    assert summary["all"]["rounds"] == total_rounds > 0
    for cat, s in summary.items():
        assert s["tau"] >= 1.0  # every round commits at least the bonus token
        assert len(s["depth_acceptance"]) == res["tree"]["depth"]
        assert f"{cat:>12}  tau {s['tau']:.3f}" in text
    assert f"== {name}" in text


def test_cli_reports_spec_bench_per_task(export_dir, tmp_path, capsys):
    """--specbench: Spec-Bench's first turns, --limit per task, τ and per-depth acceptance per
    task; no other set unless --prompts names one."""
    out = tmp_path / "eval.json"
    rc = ev.main(["--engines", str(export_dir), "--specbench", str(specbench_file(tmp_path, 2)), "--limit", "1",
                  "--max-new-tokens", "6", "--threads", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert list(res["sets"]) == ["specbench"]
    result = res["sets"]["specbench"]
    tasks = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert set(result["summary"]) == tasks | {"all"}
    assert [p["category"] for p in result["prompts"]].count("rag") == 1  # --limit 1 per task
    assert len(result["prompts"]) == len(tasks)
    assert all(r["id"].startswith("specbench-") for r in result["prompts"])
    text = capsys.readouterr().out
    assert "drafter: the head's tree every round" in text
    for task in tasks:
        s = result["summary"][task]
        assert s["tau"] >= 1.0 and s["rounds"] > 0 and s["depth_acceptance"][0] is not None
        assert f"{task:>14}  tau {s['tau']:.3f}" in text  # aligned on math_reasoning
    own = str(prompt_file(tmp_path))
    rc = ev.main(["--engines", str(export_dir), "--specbench", str(specbench_file(tmp_path, 1)), "--limit", "1",
                  "--prompts", own, "--max-new-tokens", "4", "--threads", "1", "--json", str(out)])
    assert rc == 0 and set(json.loads(out.read_text())["sets"]) == {own, "specbench"}


def test_cli_accepts_comma_separated_sets(export_dir, tmp_path, capsys):
    path = str(prompt_file(tmp_path))
    rc = ev.main(["--engines", str(export_dir), "--prompts", f"{path},{path}", "--max-new-tokens", "4",
                  "--threads", "1", "--limit", "1"])
    assert rc == 0
    assert capsys.readouterr().out.count("== ") == 1  # the same file twice is one set


def test_cli_unknown_prompt_set_is_one_clear_line(export_dir, capsys):
    rc = ev.main(["--engines", str(export_dir), "--prompts", "no-such-set"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["eagle-eval: error: unknown prompt set 'no-such-set': expected humaneval, chat, train "
                   "or a JSONL file ({\"prompt\": ...} per line)"]


def test_cli_row_exact_choice(export_dir, tmp_path, capsys):
    """--row-exact: auto follows the export (off for this fp32 one), on / off force it; the
    JSON and the drafter line say which ran."""
    path, out = str(prompt_file(tmp_path)), tmp_path / "eval.json"
    seen = {}
    for choice in ("auto", "on", "off"):
        rc = ev.main(["--engines", str(export_dir), "--prompts", path, "--max-new-tokens", "6", "--threads", "1",
                      "--limit", "2", "--row-exact", choice, "--json", str(out)])
        assert rc == 0
        seen[choice] = json.loads(out.read_text())["row_exact"]
        assert ("row-exact: one path accepted per round" in capsys.readouterr().out) == seen[choice]
    assert seen == {"auto": False, "on": True, "off": False}


@pytest.mark.parametrize("flags", [["--max-new-tokens", "-5"], ["--limit", "-1"], ["--threads", "0"]])
def test_cli_bad_numbers_are_one_line_before_the_export_opens(flags, tmp_path, capsys):
    """Once a traceback after the progress bar had started; the export folder is not even read
    (it does not exist here)."""
    rc = ev.main(["--engines", str(tmp_path / "none"), "--prompts", "chat", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"eagle-eval: error: {flags[0]} must be >= "), err
