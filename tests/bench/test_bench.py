"""eagle-bench on a tiny export: the end-to-end run (JSON + PNG with the documented keys),
baselines (transformers; llama.cpp through a fake llama_cpp module; a visible skip without
it), the divergence classification, and --tune writing its tree into the manifest.
No assertion depends on timings."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from eagle_deploy.bench import cli, report
from eagle_deploy.bench import divergence as dv
from eagle_deploy.bench import tune as tn
from eagle_deploy.common.cpu import cpu_info
from eagle_deploy.runtime.backends.base import TargetOutputs
from eagle_deploy.runtime.tree import DraftTree
from tests.tiny_export import PROMPTS, copy_export, prompt_file, specbench_file, tiny_export

RUN_KEYS = {"new_tokens", "seconds", "tokens_per_s", "ttft_ms", "finish_reason", "token_ids"}
TOP_KEYS = {"schema", "engines", "manifest", "date", "machine", "config", "tree", "numerics", "prompts", "aggregate",
            "greedy_identity", "baselines", "memory", "notes"}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


def _bench(export_dir, tmp_path, *extra, memory: bool = False) -> tuple[int, dict]:
    """memory=False: --no-memory (the memory probe's two fresh processes are tested once)."""
    out = tmp_path / "res" / "r.json"
    rc = cli.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)), "--max-new-tokens", "12",
                   "--threads", "1", "--out", str(out), "-q", *extra, *([] if memory else ["--no-memory"])])
    return rc, (json.loads(out.read_text()) if out.exists() else {})


@pytest.mark.slow  # several seconds of child processes: in `make test`, not `make test-fast`
def test_end_to_end_json_and_png(export_dir, tmp_path, capsys):
    rc, res = _bench(export_dir, tmp_path, "--no-baselines", "--temperatures", "0,0.8", "--json", memory=True)
    assert rc == 0
    captured = capsys.readouterr()
    stdout = json.loads(captured.out)  # --json: the aggregate on stdout
    assert set(stdout) >= {"aggregate", "greedy_identity", "json", "png"}
    assert TOP_KEYS <= set(res) and res["schema"] == "eagle-bench/1"
    here = cpu_info()  # the figures name the CPU they were measured on (lscpu's model and the ISA)
    assert (res["machine"]["cpu_model"], res["machine"]["isa"]) == (here.model, here.isa) and here.model
    png = Path(stdout["png"])
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(res["prompts"]) == 2 * len(PROMPTS)
    for r in res["prompts"]:
        assert set(r["runs"]) == {"eagle", "vanilla", "eagle-hybrid"}  # --drafters' default adds the hybrid
        assert RUN_KEYS <= set(r["runs"]["eagle"]) and {"mean_accept_len", "time_ms"} <= set(r["runs"]["eagle"])
        assert "speedup_vs_vanilla" in r["runs"]["eagle"] and "speedup_vs_vanilla" in r["runs"]["eagle-hybrid"]
        assert {"tree_size_per_round", "draft_rounds"} <= set(r["runs"]["eagle-hybrid"])
        assert ("greedy" in r) == (r["temperature"] == 0)
        if r["temperature"] == 0:
            assert r["runs"]["eagle-hybrid"]["identical_to_vanilla"] is True
    # interleaved, alternating order
    orders = [r["order"] for r in res["prompts"]]
    assert ["eagle", "vanilla", "eagle-hybrid"] in orders and ["eagle-hybrid", "vanilla", "eagle"] in orders
    assert "eagle-hybrid_vs_vanilla" in res["aggregate"]["0"]["all"]["speedup"]
    agg = res["aggregate"]
    assert set(agg) == {"0", "0.8"}
    assert set(agg["0"]) == {"all", "code", "chat"}
    eagle = agg["0"]["all"]["systems"]["eagle"]
    assert {"tokens_per_s", "tau", "ttft_ms", "time_ms_per_token"} <= set(eagle)
    assert set(eagle["time_ms_per_token"]) == set(report.PHASES)
    assert "eagle_vs_vanilla" in agg["0"]["all"]["speedup"]
    # lossless greedy: EAGLE equals vanilla on the same engine
    gi = res["greedy_identity"]["ort"]
    assert gi["prompts"] == len(PROMPTS) and gi["identical"] == len(PROMPTS) and gi["bugs"] == 0
    assert 0 <= res["numerics"]["ort"]["batch_vs_single_max_logit_diff"] < 1e-3
    assert res["memory"]["process"]["peak_rss_mb"] > 0 and "load_rss_mb" in res["memory"]["eagle"]
    # peak memory of each mode in its own process (vanilla: the target graph alone), and the export by file
    modes = res["memory"]["modes"]["ort"]
    assert modes["vanilla"]["mode"] == "vanilla" and modes["eagle"]["mode"] == "eagle"
    assert modes["vanilla"]["peak_rss_mb"] > 0 and modes["eagle"]["peak_rss_mb"] > 0
    v, e = modes["vanilla"]["peak_rss_mb"], modes["eagle"]["peak_rss_mb"]
    assert modes["eagle_vs_vanilla_peak_rss"] == round(e / v, 3)
    assert {"target.onnx", "draft.onnx", "shared.data", "manifest.json"} <= set(modes["export"]["files"])
    assert stdout["memory"]["modes"]["ort"]["eagle"]["peak_rss_mb"] == modes["eagle"]["peak_rss_mb"]
    assert "memory [ort] (fresh process per mode): peak RSS vanilla" in captured.err


def test_hf_baselines_and_visible_llamacpp_skip(export_dir, tmp_path, capsys):
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    rc, res = _bench(export_dir, tmp_path, "--baselines", "hf,hf-lookup,llamacpp", "--limit", "2")
    assert rc == 0
    out = capsys.readouterr().out
    assert "note: baseline llamacpp:" in out and "not installed" in out
    assert res["baselines"]["llamacpp"]["status"] == "skipped"
    assert res["baselines"]["hf"]["status"] == "ok" and res["baselines"]["hf-lookup"]["status"] == "ok"
    for r in res["prompts"]:
        assert {"eagle", "vanilla", "eagle-hybrid", "hf", "hf-lookup"} == set(r["runs"])
        assert r["runs"]["hf"]["new_tokens"] >= 1
    assert "eagle_vs_hf" in res["aggregate"]["0"]["all"]["speedup"]


class _FakeLlama:
    """Stands in for llama_cpp.Llama: generate() yields a scripted token stream."""

    instances: list = []
    script = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]

    def __init__(self, model_path, **kw):
        self.model_path, self.kw, self.calls, self.resets = model_path, kw, [], 0
        # what the real constructor reads from llama_cpp.llama.llama_cpp while it loads
        self.model_params = sys.modules["llama_cpp.llama"].llama_cpp.llama_model_default_params()
        _FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kw):
        self.calls.append((list(tokens), kw))
        yield from self.script


class _FakeLookup:
    def __init__(self, num_pred_tokens=10):
        self.num_pred_tokens = num_pred_tokens


@pytest.fixture
def fake_llama_cpp(monkeypatch, tmp_path):
    mod = types.ModuleType("llama_cpp")
    mod.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    mod.Llama = _FakeLlama
    mod.__version__ = "0.0-fake"
    mod.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | "
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.__spec__ = importlib.machinery.ModuleSpec("llama_cpp.llama_speculative", None)
    spec.LlamaPromptLookupDecoding = _FakeLookup
    mod.llama_speculative = spec
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    from eagle_deploy.exporter import sources

    monkeypatch.setattr(sources, "target_source", lambda manifest: gguf)
    # llama.cpp's crash probe runs a child process with the real package; here it reports no crash
    # unless a test says otherwise (test_llamacpp_crash_in_probe_falls_back)
    from eagle_deploy.bench import systems

    monkeypatch.setattr(systems, "llamacpp_crash", lambda gguf, threads, extra_buffers: None)
    inner = types.ModuleType("llama_cpp.llama")  # llama_cpp.llama.llama_cpp: where Llama reads its defaults
    inner.llama_cpp = types.SimpleNamespace(llama_model_default_params=lambda: types.SimpleNamespace(
        use_extra_bufts=True))
    mod.llama = inner
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", inner)
    _FakeLlama.instances = []
    return gguf


def test_llamacpp_path_with_a_fake_module(export_dir, tmp_path, fake_llama_cpp):
    rc, res = _bench(export_dir, tmp_path, "--baselines", "llamacpp,llamacpp-lookup", "--limit", "1")
    assert rc == 0
    assert res["baselines"]["llamacpp"]["status"] == "ok" and res["baselines"]["llamacpp-lookup"]["status"] == "ok"
    plain, lookup = _FakeLlama.instances
    assert plain.model_path == str(fake_llama_cpp) and plain.kw["draft_model"] is None
    assert isinstance(lookup.kw["draft_model"], _FakeLookup) and lookup.kw["draft_model"].num_pred_tokens == 10
    assert plain.kw["n_threads"] == 1 and plain.kw["n_ctx"] == 256
    recorded = res["baselines"]["llamacpp"]  # what was run, for the JSON's reader
    assert recorded["version"] == "0.0-fake" and recorded["build"] == "CPU : AVX2 = 1 |"
    assert recorded["gguf"] == str(fake_llama_cpp) and recorded["runtime"] == {"n_threads": 1, "n_ctx": 256,
                                                                                  "use_extra_bufts": True}
    assert recorded["decoding"] == "greedy, vanilla" and recorded["note"] == ""
    assert plain.model_params.use_extra_bufts is True  # llama.cpp's defaults when the probe saw no crash
    assert res["baselines"]["llamacpp-lookup"]["decoding"] == "greedy, prompt lookup (10 tokens)"
    record = res["prompts"][0]
    tokens, kw = plain.calls[-1]
    assert tokens == record["prompt_ids"] and kw["temp"] == 0.0  # same prompt ids, greedy
    assert plain.resets == len(plain.calls)  # no prompt-prefix reuse across requests
    run = record["runs"]["llamacpp"]
    assert run["token_ids"] == _FakeLlama.script[:12] and run["finish_reason"] == "length"
    assert run["ttft_ms"] is not None and "first_difference_vs_vanilla" in run


def test_llamacpp_crash_in_probe_falls_back(export_dir, tmp_path, fake_llama_cpp, monkeypatch):
    """A llama.cpp build that segfaults with its AMX weight buffers is timed without them,
    said in the record; one that crashes either way is a failed baseline, and the EAGLE numbers
    are still written."""
    from eagle_deploy.bench import systems

    probes = []

    def crash_with_extra(gguf, threads, extra_buffers):
        probes.append(extra_buffers)
        return "SIGSEGV" if extra_buffers else None

    monkeypatch.setattr(systems, "llamacpp_crash", crash_with_extra)
    rc, res = _bench(export_dir, tmp_path, "--baselines", "llamacpp", "--limit", "1")
    assert rc == 0 and probes == [True, False]
    (llm,) = _FakeLlama.instances
    assert llm.model_params.use_extra_bufts is False
    default = sys.modules["llama_cpp.llama"].llama_cpp.llama_model_default_params()
    assert default.use_extra_bufts is True  # restored after the load
    rec = res["baselines"]["llamacpp"]
    assert rec["status"] == "ok" and rec["runtime"]["use_extra_bufts"] is False
    assert "SIGSEGV" in rec["note"] and "use_extra_bufts=False" in rec["note"]
    assert res["prompts"][0]["runs"]["llamacpp"]["new_tokens"] >= 1

    monkeypatch.setattr(systems, "llamacpp_crash", lambda gguf, threads, extra_buffers: "SIGSEGV")
    _FakeLlama.instances = []
    rc, res = _bench(export_dir, tmp_path, "--baselines", "llamacpp", "--limit", "1")
    assert rc == 0 and _FakeLlama.instances == []
    rec = res["baselines"]["llamacpp"]
    assert rec["status"] == "failed" and "with and without its extra weight buffers (SIGSEGV)" in rec["note"]
    assert res["prompts"][0]["runs"]["eagle"]["new_tokens"] >= 1


def test_without_extra_buffers_on_the_installed_llama_cpp():
    """The wrap relies on llama-cpp-python's Llama reading llama_model_default_params() from
    llama_cpp.llama's module and on the struct's use_extra_bufts field: checked on the real
    package where it is installed (CI installs no llama.cpp: skipped there, with the reason)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install '.[llamacpp]')")
    from eagle_deploy.bench.systems import _without_extra_buffers

    module = importlib.import_module("llama_cpp.llama").llama_cpp
    default = module.llama_model_default_params
    assert default().use_extra_bufts is True  # llama.cpp's default: AMX / repacked weights on
    with _without_extra_buffers():
        assert module.llama_model_default_params().use_extra_bufts is False
    assert module.llama_model_default_params is default


@pytest.mark.parametrize("code, expected", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV"),
    ("raise SystemExit(3)", None),  # an ordinary failure: left to the real load to report
    ("pass", None),
])
def test_llamacpp_crash_names_the_signal(monkeypatch, tmp_path, code, expected):
    from eagle_deploy.bench import systems

    monkeypatch.setattr(systems, "_LLAMACPP_PROBE", code)
    assert systems.llamacpp_crash(tmp_path / "m.gguf", 1, extra_buffers=True) == expected


def test_llamacpp_probe_runs_once_per_setting(monkeypatch, tmp_path):
    """llamacpp and llamacpp-lookup in one run load the same file: one child process each way."""
    from eagle_deploy.bench import systems

    log = tmp_path / "probes.txt"
    monkeypatch.setattr(systems, "_LLAMACPP_PROBE", f"open({str(log)!r}, 'a').write('probe\\n')")
    for _ in range(2):
        assert systems.llamacpp_crash(tmp_path / "m.gguf", 1, extra_buffers=True) is None
    assert log.read_text().splitlines() == ["probe"]
    systems.llamacpp_crash(tmp_path / "m.gguf", 1, extra_buffers=False)  # the other setting probes again
    assert log.read_text().splitlines() == ["probe", "probe"]


def test_llamacpp_stops_at_eos(fake_llama_cpp):
    from eagle_deploy.bench.systems import LlamaCppSystem

    system = LlamaCppSystem(fake_llama_cpp, eos_ids=[14], threads=2, n_ctx=64)
    run = system.run([1, 2, 3], max_new_tokens=50)
    assert run.token_ids == [11, 12, 13, 14] and run.finish_reason == "stop"


# --------------------------------------------------------------------------- divergence


class _LogitBackend:
    """A target backend stub: every forward returns the same last-position logits."""

    def __init__(self, logits):
        self.logits = np.asarray(logits, np.float32)
        self.seen = []

    def allocate_kv(self, capacity):
        return None

    def run(self, inputs, kv, past):
        self.seen.append(inputs.input_ids[0].tolist())
        n = inputs.logits_indices.shape[1]
        return TargetOutputs(np.repeat(self.logits[None, None], n, axis=1), np.zeros((1, n, 1), np.float32))


def test_first_difference():
    assert dv.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert dv.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert dv.first_difference([1, 2], [1, 2, 7]) == 2


def test_divergence_classification():
    backend = _LogitBackend([0.0, 3.0, 2.5, -1.0])  # top-2 gap 0.5
    assert dv.check_greedy(backend, [9, 9], [1, 2, 3], [1, 2, 3], floor=1.0) is None
    d = dv.check_greedy(backend, [9, 9], [1, 2, 3], [1, 4, 3], floor=1.0)
    assert (d.position, d.eagle, d.vanilla, d.kind) == (1, 2, 4, "numerics") and d.gap == pytest.approx(0.5)
    assert backend.seen[-1] == [9, 9, 1]  # one forward over prompt + common prefix
    assert dv.check_greedy(backend, [9], [1, 2], [1, 4], floor=0.1).kind == "bug"
    assert dv.classify(None, 1.0) == "bug" and dv.classify(0.2, 0.3) == "numerics" and dv.classify(0.3, 0.3) == "bug"
    s = dv.summarize([{"identical": True, "divergence": None}, {"identical": False, "divergence": d.to_json()},
                      {"identical": False, "divergence": {"position": 3, "top2_gap": 2.0, "class": "bug"}}], floor=1.0)
    assert (s["identical"] == 1 and s["percent_identical"] == pytest.approx(33.3) and s["numerics"] == 1
            and s["bugs"] == 1)
    assert s["largest_gap_at_divergence"] == 2.0


def test_batch_vs_single_on_the_tiny_engine(export_dir):
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.runtime.backends.ort import OrtBackend

    m = Manifest.load(export_dir)
    diff = dv.batch_vs_single(OrtBackend(export_dir, m.target, m.dims, threads=1), list(range(20, 36)))
    assert 0.0 <= diff < 1e-3


def test_speedups_from_synthetic_records():
    def run(tokens, seconds):
        return {"new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "ttft_ms": 1.0}

    records = [{"category": "x", "temperature": 0.0,
                "runs": {"eagle": run(100, 1.0), "vanilla": run(100, 2.0), "hf": run(50, 2.0)}},
               {"category": "y", "temperature": 0.0,
                "runs": {"eagle": run(100, 2.0), "vanilla": run(100, 2.0), "hf": run(50, 2.0)}}]
    agg = report.aggregate(records)["0"]
    assert agg["all"]["systems"]["eagle"]["tokens_per_s"] == pytest.approx(200 / 3, rel=1e-3)
    assert agg["all"]["speedup"]["eagle_vs_vanilla"]["aggregate"] == pytest.approx(4 / 3, rel=1e-3)
    assert agg["all"]["speedup"]["eagle_vs_vanilla"]["mean_per_prompt"] == pytest.approx(1.5)
    assert agg["x"]["speedup"]["eagle_vs_hf"]["aggregate"] == pytest.approx(4.0)
    assert list(agg["all"]["systems"]) == ["eagle", "vanilla", "hf"]


# --------------------------------------------------------------------------- tune


def _round(parents, tokens, scores, argmax):
    return tn.Round(DraftTree(np.array(tokens), np.array(parents), np.array(scores)), np.array(argmax))


def test_accept_walk_on_subtrees():
    # root -> a(10, best) / b(20); a -> c(30); b -> d(40). The target wants 20 then 40.
    rnd = _round([-1, 0, 0, 1, 2], [0, 10, 20, 30, 40], [0, -0.1, -0.5, -0.2, -0.9], [20, 99, 40, 99, 99])
    assert tn.accept_walk(rnd, 5, 2) == [1, 0]  # b is the second sibling, then d
    assert len(tn.accept_walk(rnd, 4, 2)) == 1  # d (lowest score) pruned
    assert tn.accept_walk(rnd, 5, 1) == [1]  # depth cut
    assert tn.accept_walk(rnd, 2, 2) == []  # only a kept
    assert tn.expected_tau([rnd], 5, 2) == 3.0
    prof = tn.acceptance_profile([rnd], 2)
    assert prof["accept_rate_by_depth"] == [1.0, 1.0] and prof["accepted_sibling_rank_counts"] == [1, 1]


def test_growth_and_overhead_fit():
    assert tn.growth_nodes(1, 5) == 5 and tn.growth_nodes(4, 3) == 4 + 2 * 16
    assert tn.calib_depth(4, 40, 8) == 3
    a, b = tn.fit_overhead([(10, 1.0 + 0.1 * 10), (50, 1.0 + 0.1 * 50)])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.1)
    assert tn.fit_overhead([]) == (0.0, 0.0)


def test_tune_writes_the_tree_to_the_manifest(export_dir, tmp_path):
    from eagle_deploy.contract.manifest import Manifest

    folder = copy_export(export_dir, tmp_path / "tuned")
    cfg = tn.TuneConfig(folder, PROMPTS, calib=2, max_new_tokens=10, repeats=1, threads=1, top_ks=(1, 2),
                        max_depth=3, sizes=(1, 2, 4, 8), verify_top=2)
    record = tn.tune(cfg, log=lambda m: None)
    m = Manifest.load(folder)  # still loads: the record lives in engines.tuning
    assert m.tree.to_json() == record["chosen"] and m.tree.validate(10)
    assert m.engines.tuning.chosen == m.tree
    t = m.engines.tuning.model_dump(mode="json")
    assert {"date", "machine", "target_ms", "draft_ms", "calibration", "candidates", "measured", "chosen",
            "previous"} <= set(t)
    assert t["machine"]["cpu_model"] == cpu_info().model and t["machine"]["isa"] == cpu_info().isa
    assert set(t["target_ms"]) >= {"1", "2", "4", "8"} and set(t["draft_ms"]) >= {"1", "2"}
    assert {r["top_k"] for r in t["calibration"]["runs"]} == {1, 2}
    assert record["chosen"] in [r["tree"] for r in t["measured"]]
    assert max(r["tokens_per_s"] for r in t["measured"]) == t["chosen_measured_tokens_per_s"]


def test_tune_cli_no_save_leaves_the_manifest(export_dir, tmp_path, capsys, monkeypatch):
    folder = copy_export(export_dir, tmp_path / "nosave")
    before = (folder / "manifest.json").read_text()
    monkeypatch.setattr(tn.TuneConfig, "__init__", _small_tune_init(tn.TuneConfig.__init__))
    assert cli.main(["--engines", str(folder), "--prompts", str(prompt_file(tmp_path)), "--tune", "--no-save",
                     "--threads", "1", "--max-new-tokens", "8", "--repeats", "1", "-q"]) == 0
    assert "chosen tree:" in capsys.readouterr().out
    assert (folder / "manifest.json").read_text() == before


def test_tune_cli_calibrates_on_spec_bench(export_dir, tmp_path, capsys, monkeypatch):
    """--tune --specbench: the calibration prompts are Spec-Bench questions (no built-in set)."""
    folder = copy_export(export_dir, tmp_path / "sb")
    seen = []
    monkeypatch.setattr(tn.TuneConfig, "__init__", _small_tune_init(tn.TuneConfig.__init__, seen))
    assert cli.main(["--engines", str(folder), "--specbench", str(specbench_file(tmp_path, 2)), "--tune", "--no-save",
                     "--calib", "3", "--threads", "1", "--max-new-tokens", "8", "--repeats", "1", "-q"]) == 0
    assert "chosen tree:" in capsys.readouterr().out
    (cfg,) = seen
    assert {p["set"] for p in cfg.prompts} == {"specbench"}
    assert {p["category"] for p in cfg.prompts} == {"mt_bench", "translation", "summarization", "qa",
                                                    "math_reasoning", "rag"}


def _small_tune_init(init, seen=None):
    def small(self, *args, **kw):
        init(self, *args, **kw)
        self.top_ks, self.max_depth, self.sizes, self.verify_top = (1, 2), 2, (1, 2, 4), 1
        if seen is not None:
            seen.append(self)
    return small


def test_calibration_prompts_alternate_between_sets():
    prompts = ([{"id": f"a{i}", "set": "a", "prompt": "x"} for i in range(10)]
               + [{"id": "b0", "set": "b", "prompt": "y"}])
    assert [p["id"] for p in tn.pick_calibration(prompts, 4)] == ["a0", "b0", "a9"]
    assert [p["id"] for p in tn.pick_calibration(prompts, 1)] == ["a0"]


# --------------------------------------------------------------------------- defaults


class _Captured(Exception):
    pass


@pytest.mark.parametrize("flags, baselines, limit", [
    ([], [], 10),  # quick by default: EAGLE vs vanilla, 10 prompts of each built-in set
    (["--baselines", "hf,llamacpp"], ["hf", "llamacpp"], 10),
    (["--baselines", "all", "--limit", "0"], ["hf", "hf-lookup", "llamacpp", "llamacpp-lookup", "ort-genai-fp32",
                                              "ort-genai-int4", "openvino-fp32", "openvino-int8", "openvino-int4",
                                              "openvino-eagle3-fp32", "openvino-eagle3-int8",
                                              "openvino-eagle3-int4"], 0),
    (["--baselines", "all", "--no-baselines"], [], 10),
])
def test_default_run_is_quick_and_baselines_are_opt_in(export_dir, tmp_path, monkeypatch, flags, baselines, limit):
    from eagle_deploy.bench import run

    seen = []

    def capture(cfg, log):
        seen.append(cfg)
        raise _Captured

    monkeypatch.setattr(run, "run_bench", capture)
    with pytest.raises(_Captured):
        cli.main(["--engines", str(export_dir), "--out", str(tmp_path / "r.json"), *flags])
    assert seen[0].baselines == baselines and seen[0].limit == limit
    with pytest.raises(_Captured):  # a prompt file is run whole unless --limit says otherwise
        cli.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)),
                  "--out", str(tmp_path / "r.json")])
    assert seen[1].limit == 0 and seen[1].baselines == []


@pytest.mark.slow  # several seconds of child processes: in `make test`, not `make test-fast`
def test_memory_probe_peak_is_the_child_process_own(export_dir):
    """Each mode's peak is its fresh process's own high-water mark (VmHWM), not the large
    parent's: Linux's ru_maxrss survives exec and would report the parent's peak."""
    import numpy as np

    from eagle_deploy.bench.memory import measure_modes
    from eagle_deploy.runtime.memory import rss_mb

    ballast = np.ones(600 * 2**20 // 8)  # 600 MiB resident in this (parent) process
    parent = rss_mb()
    modes = measure_modes(export_dir, [5, 6, 7, 8], max_new_tokens=4, threads=1)
    assert float(ballast[-1]) == 1.0
    for mode in ("vanilla", "eagle"):
        assert 0 < modes[mode]["peak_rss_mb"] < parent - 400, (modes[mode], parent)
        assert modes[mode]["rss_loaded_mb"] >= modes[mode]["rss_before_load_mb"]


def test_specbench_questions_become_tasks(tmp_path):
    from eagle_deploy.common.prompts import load_prompts, specbench_prompts

    path = specbench_file(tmp_path)
    rows = specbench_prompts(path)
    tasks = {r["category"] for r in rows}
    assert tasks == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert sum(r["category"] == "mt_bench" for r in rows) == 9 and rows[0]["prompt"] == "writing question 0"
    limited = specbench_prompts(path, limit=3)
    mt = [r["prompt"].split()[0] for r in limited if r["category"] == "mt_bench"]
    assert mt == ["writing", "roleplay", "coding"]  # the limit spreads over MT-bench's categories
    assert sum(r["category"] == "rag" for r in limited) == 3
    assert {r["set"] for r in load_prompts([], 2, path)} == {"specbench"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(ValueError, match="line 1 is not a Spec-Bench question"):
        specbench_prompts(bad)


def test_specbench_run_reports_every_task(export_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = cli.main(["--engines", str(export_dir), "--specbench", str(specbench_file(tmp_path, 1)), "--limit", "1",
                   "--max-new-tokens", "8", "--threads", "1", "--out", str(out), "-q", "--no-memory"])
    assert rc == 0
    res = json.loads(out.read_text())
    agg = res["aggregate"]["0"]
    assert set(agg) == {"all", "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert {"eagle", "eagle-hybrid", "vanilla"} == set(agg["rag"]["systems"])
    text = capsys.readouterr().out
    assert "per category: tokens/s (tau) [x vanilla]" in text and "math_reasoning" in text
    assert all(r["set"] == "specbench" for r in res["prompts"])  # --specbench alone: no humaneval / chat
    # the ceiling beside the achieved speed-up, per task, from the hybrid runtime's measured costs
    ceil = res["ceiling"]["ort"]
    assert ceil["cost_curve"]["verify_ms"]["1"] > 0 and ceil["row_exact"] is False
    cells = ceil["systems"]["eagle-hybrid"]
    assert "all" in cells and set(cells) <= set(agg)
    for c in cells.values():
        assert c["of_ceiling"] == pytest.approx(c["achieved"] / c["ceiling"], abs=2e-3) and c["best_depth"] >= 1
    all_runs = agg["all"]["systems"]
    assert cells["all"]["achieved"] == pytest.approx(
        all_runs["eagle-hybrid"]["tokens_per_s"] / all_runs["vanilla"]["tokens_per_s"], rel=1e-2)
    assert "ceiling eagle-hybrid [ort]:" in text and "cost curve [ort]:" in text


@pytest.mark.parametrize("flags, message", [(["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                                            (["--limit", "-2"], "--limit must be >= 0, got -2"),
                                            (["--threads", "0"], "--threads must be >= 1, got 0")])
def test_out_of_range_values_name_the_flag_and_value(capsys, flags, message):
    """One line naming the flag and its value, before the export is read (it does not exist here)."""
    from eagle_deploy.bench.cli import main

    assert main(["--engines", "no-such-folder", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"eagle-bench: error: {message}"


def test_usage_names_both_modes():
    usage = cli.build_parser().format_usage()
    assert usage.startswith("usage: eagle-bench --engines DIR [options]\n")
    assert "eagle-bench serve --url URL [options]" in usage  # the load mode, dispatched before this parser


@pytest.mark.parametrize("missing, flags", [("matplotlib", []), ("psutil", []), ("matplotlib", ["--no-memory"])])
def test_a_missing_bench_extra_stops_before_any_work(export_dir, tmp_path, capsys, monkeypatch, missing, flags):
    """Issue 53: after `pip install eagle-deploy` (no bench extra) eagle-bench ran the whole
    benchmark and then died at the plot on `No module named 'matplotlib'`."""
    from eagle_deploy.bench import run

    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: find_spec says None
    monkeypatch.setattr(run, "run_bench", lambda *a, **kw: pytest.fail("the benchmark ran"))
    rc = cli.main(["--engines", str(export_dir), "--out", str(tmp_path / "r.json"), "-q", *flags])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (f"eagle-bench: error: eagle-bench needs {missing} (the bench extra): "
                                               "pip install 'eagle-deploy[bench]'")


def test_without_the_memory_probe_psutil_is_not_needed(export_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    cli.check_bench_extra(memory=False)  # no error
    with pytest.raises(ModuleNotFoundError, match="needs psutil"):
        cli.check_bench_extra(memory=True)
