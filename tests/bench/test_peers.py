"""eagle-bench's peer runtimes (bench/peers.py): --baselines parsing, --extra-engines, the
visible skip when a peer package is absent (imports forced to fail), the conversion cache and
its record, the decoding loops against fake onnxruntime_genai / openvino_genai modules, the JSON
record and the printed table; and, where the packages are installed, one real small run
(marked slow). No assertion depends on timings."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from eagle_deploy.bench import cli, peers
from tests.tiny_export import PROMPTS, copy_export, prompt_file, tiny_export

MAX_NEW = 12


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh EAGLE_DEPLOY_CACHE (converted peer models land under it)."""
    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE_DEPLOY_OPTIMUM_CLI", raising=False)
    return tmp_path / "cache"


def _bench(export_dir, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "res" / "r.json"
    rc = cli.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)), "--max-new-tokens",
                   str(MAX_NEW), "--threads", "1", "--out", str(out), "-q", "--no-memory", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else {})


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("text, expected", [
    ("ort-genai,openvino", ["ort-genai-fp32", "ort-genai-int4", "openvino-fp32", "openvino-int8", "openvino-int4"]),
    ("openvino-int4,hf,openvino", ["openvino-int4", "hf", "openvino-fp32", "openvino-int8"]),
    ("ort-genai-int4", ["ort-genai-int4"]),
    ("all", ["hf", "hf-lookup", "llamacpp", "llamacpp-lookup", "ort-genai-fp32", "ort-genai-int4", "openvino-fp32",
             "openvino-int8", "openvino-int4", "openvino-eagle3-fp32", "openvino-eagle3-int8",
             "openvino-eagle3-int4"]),
    ("openvino-eagle3", ["openvino-eagle3-fp32", "openvino-eagle3-int8", "openvino-eagle3-int4"]),
])
def test_baselines_argument_expands_peer_families(text, expected):
    args = cli.build_parser().parse_args(["--engines", "x", "--baselines", text, "--extra-engines", "a",
                                          "--extra-engines", "b"])
    assert args.baselines == expected
    assert args.extra_engines == [Path("a"), Path("b")]


@pytest.mark.parametrize("text", ["ort-genai,onnx-genai", "openvino-fp16", "llamacpp,ort"])
def test_unknown_baseline_is_a_clear_error(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["--engines", "x", "--baselines", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    bad = [n for n in text.split(",") if n not in ("ort-genai", "llamacpp")]
    assert f"unknown {', '.join(bad)}; choose from hf, hf-lookup" in err and "openvino-int4" in err


def test_peer_names_and_commands(cache):
    hf = Path("/models/SmolLM2-hf")
    assert peers.split_name("openvino-int8") == ("openvino", "int8")
    with pytest.raises(ValueError, match="unknown peer 'openvino-fp16'"):
        peers.split_name("openvino-fp16")
    out = Path("/o")
    assert peers.convert_command("ort-genai-int4", hf, out) == [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", "/o", "-p", "int4", "-e", "cpu",
        "-c", "/o/_builder_cache"]
    cli_path = Path("/venv/bin/optimum-cli")
    assert peers.convert_command("openvino-int4", hf, out, cli_path) == [
        "/venv/bin/optimum-cli", "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
        "--weight-format", "int4", "--group-size", "32", "/o"]
    assert "--group-size" not in peers.convert_command("openvino-int8", hf, out, cli_path)
    folder = peers.model_dir(hf, "openvino-int4")
    assert folder == cache / "peers" / "SmolLM2-hf" / f"openvino-{peers.version('openvino-genai')}-int4"


def test_optimum_cli_lookup(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda name: None)
    if (Path(sys.executable).parent / "optimum-cli").is_file():
        pytest.skip("optimum-cli is installed beside this Python")
    assert peers.optimum_cli() is None
    in_cache = cache / peers.OPTIMUM_VENV / "bin" / "optimum-cli"
    in_cache.parent.mkdir(parents=True)
    in_cache.write_text("#!/bin/sh\n")
    assert peers.optimum_cli() == in_cache
    named = tmp_path / "my-optimum-cli"
    named.write_text("#!/bin/sh\n")
    monkeypatch.setenv("EAGLE_DEPLOY_OPTIMUM_CLI", str(named))
    assert peers.optimum_cli() == named


# --------------------------------------------------------------------------- skips


def test_missing_peer_packages_skip_with_a_visible_note(export_dir, tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    rc, res = _bench(export_dir, tmp_path, "--baselines", "ort-genai,openvino-int4", "--limit", "1")
    assert rc == 0
    out = capsys.readouterr().out
    for name, dist in (("ort-genai-fp32", "onnxruntime-genai"), ("ort-genai-int4", "onnxruntime-genai"),
                       ("openvino-int4", "openvino-genai")):
        b = res["baselines"][name]
        assert b["status"] == "skipped"
        assert b["note"] == f"{dist} is not installed (pip install -c constraints.txt -e '.[peers]'): skipped"
        assert f"note: baseline {name}: {dist} is not installed" in out  # printed with the table
    assert set(res["prompts"][0]["runs"]) == {"eagle", "vanilla", "eagle-hybrid"}
    assert not (cache / "peers").exists()  # nothing converted for a skipped peer


def test_openvino_without_a_converter_skips_naming_the_venv_command(export_dir, tmp_path, cache, monkeypatch):
    fake = types.ModuleType("openvino_genai")
    monkeypatch.setitem(sys.modules, "openvino_genai", fake)
    monkeypatch.setattr(peers.shutil, "which", lambda name: None)
    if (Path(sys.executable).parent / "optimum-cli").is_file():
        pytest.skip("optimum-cli is installed beside this Python")
    rc, res = _bench(export_dir, tmp_path, "--baselines", "openvino-fp32", "--limit", "1")
    assert rc == 0
    note = res["baselines"]["openvino-fp32"]["note"]
    assert res["baselines"]["openvino-fp32"]["status"] == "skipped"
    assert "no optimum-cli" in note and peers.OPTIMUM_INSTALL in note and "EAGLE_DEPLOY_OPTIMUM_CLI" in note


# --------------------------------------------------------------------------- conversion cache


def test_conversion_is_cached_with_its_command(cache, tmp_path, monkeypatch):
    hf = tmp_path / "hf-model"
    calls = []

    def convert(cmd, logfile):
        calls.append(cmd)
        out = Path(cmd[cmd.index("-o") + 1])
        (out / "genai_config.json").write_text("{}")
        (out / "_builder_cache").mkdir()
        return 0

    monkeypatch.setattr(peers, "_run_converter", convert)
    folder, record = peers.ensure_model("ort-genai-int4", hf, log=lambda m: None)
    assert folder == peers.model_dir(hf, "ort-genai-int4") and (folder / "genai_config.json").is_file()
    assert not (folder / "_builder_cache").exists()
    assert record["command"] == (f"python -m onnxruntime_genai.models.builder -i {hf} -o {folder} -p int4 -e cpu "
                                 f"-c {folder}/_builder_cache")
    assert json.loads((folder / "peer.json").read_text()) == record
    assert peers.ensure_model("ort-genai-int4", hf)[1] == record and len(calls) == 1  # cached: not converted again
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary folder left


def test_failed_conversion_raises_with_the_log_tail(cache, tmp_path, monkeypatch):
    def convert(cmd, logfile):
        logfile.write_text("loading\nNo module named 'onnx_ir'\n")
        return 1

    monkeypatch.setattr(peers, "_run_converter", convert)
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): loading \| No module named 'onnx_ir'"):
        peers.ensure_model("ort-genai-fp32", tmp_path / "hf")
    assert list((cache / "peers" / "hf").iterdir()) == []


# --------------------------------------------------------------------------- fake runtimes


class _FakeGenerator:
    script: dict = {}  # tuple(prompt ids) -> tokens it generates (default: 40, 41, ...)
    seen: list = []

    def __init__(self, model, params):
        self.params, self.out, self.ids = params, [], None

    def append_tokens(self, ids):
        self.ids = [int(t) for t in ids]
        _FakeGenerator.seen.append((self.ids, dict(self.params.options)))
        self.stream = list(_FakeGenerator.script.get(tuple(self.ids), range(40, 80)))

    def is_done(self):
        return len(self.ids) + len(self.out) >= self.params.options["max_length"] or not self.stream

    def generate_next_token(self):
        self.out.append(self.stream.pop(0))

    def get_next_tokens(self):
        return np.array(self.out[-1:], np.int32)


def _fake_og():
    og = types.ModuleType("onnxruntime_genai")

    class Config:
        def __init__(self, path):
            self.path, self.overlays = path, []

        def overlay(self, text):
            self.overlays.append(json.loads(text))

    class Model:
        def __init__(self, config):
            self.config = config

    class GeneratorParams:
        def __init__(self, model):
            self.options = {}

        def set_search_options(self, **kw):
            self.options.update(kw)

    og.Config, og.Model, og.GeneratorParams, og.Generator = Config, Model, GeneratorParams, _FakeGenerator
    return og


def test_ort_genai_loop_stops_at_eos_and_keeps_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", _fake_og())
    _FakeGenerator.script = {(1, 2, 3): [11, 12, 7, 13]}
    system = peers.OrtGenaiSystem(tmp_path, eos_ids=[7], threads=2, name="ort-genai-fp32")
    assert system.model.config.overlays == [{"model": {"decoder": {"session_options": {
        "intra_op_num_threads": 2, "inter_op_num_threads": 1}}}}]
    run = system.run([1, 2, 3], max_new_tokens=10)
    assert run.token_ids == [11, 12, 7] and run.finish_reason == "stop" and run.ttft_ms is not None
    assert _FakeGenerator.seen[-1] == ([1, 2, 3], {"do_sample": False, "max_length": 13})
    run = system.run([1, 2, 3], max_new_tokens=2)
    assert run.token_ids == [11, 12] and run.finish_reason == "length"


def _fake_ov(monkeypatch, script):
    ov = types.ModuleType("openvino")
    ov.Tensor = lambda arr: arr

    class _Type:
        def __init__(self, name):
            self.name = name

        def to_string(self):
            return self.name

    class Core:
        def get_property(self, device, key):
            return _Type({"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8"}[key])

    ov.Core = Core
    ovg = types.ModuleType("openvino_genai")

    class StreamerBase:
        def __init__(self):
            pass

    class GenerationConfig:
        pass

    def draft_model(folder, device, **props):
        return ("draft", folder, device, props)

    class LLMPipeline:
        instances: list = []

        def __init__(self, folder, device, **props):
            self.folder, self.device, self.props, self.calls = folder, device, props, []
            LLMPipeline.instances.append(self)

        def generate(self, ids, config, streamer):
            self.calls.append((ids, config))
            tokens = script[: config.max_new_tokens]
            for t in tokens:
                assert streamer.write([t]) == "RUNNING"
            return types.SimpleNamespace(tokens=[tokens])

    ovg.StreamerBase, ovg.GenerationConfig, ovg.LLMPipeline = StreamerBase, GenerationConfig, LLMPipeline
    ovg.draft_model = draft_model
    ovg.StreamingStatus = types.SimpleNamespace(RUNNING="RUNNING")
    monkeypatch.setitem(sys.modules, "openvino", ov)
    monkeypatch.setitem(sys.modules, "openvino_genai", ovg)
    return LLMPipeline


@pytest.mark.parametrize("precision, props", [
    ("fp32", {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
    ("int4", {"INFERENCE_NUM_THREADS": 2}),
])
def test_openvino_pipeline_gets_token_ids_and_greedy_config(monkeypatch, tmp_path, precision, props):
    pipeline = _fake_ov(monkeypatch, [21, 22, 5, 23])
    system = peers.OpenVinoSystem(tmp_path, eos_ids=[5], threads=2, precision=precision, name=f"openvino-{precision}")
    pipe = pipeline.instances[-1]
    assert (pipe.folder, pipe.device, pipe.props) == (str(tmp_path), "CPU", props)
    assert system.defaults == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8"}
    run = system.run([9, 8, 7], max_new_tokens=3)
    ids, config = pipe.calls[-1]
    assert ids.dtype == np.int64 and ids.tolist() == [[9, 8, 7]]
    assert (config.max_new_tokens, config.do_sample, config.eos_token_id, config.stop_token_ids) == (3, False, 5, {5})
    assert run.token_ids == [21, 22, 5] and run.finish_reason == "stop" and run.ttft_ms is not None


def _eagle3_head(folder: Path, archs=("LlamaForCausalLMEagle3",)) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_eagle3_head_checks_and_draft_command(cache, tmp_path):
    assert "--eagle3-head DIR" in peers.eagle3_head_problem(None)
    head = _eagle3_head(tmp_path / "head")
    assert peers.eagle3_head_problem(head) is None
    eagle2 = _eagle3_head(tmp_path / "eagle2", archs=("LlamaForCausalLM",))
    assert "name no EAGLE-3 draft model" in peers.eagle3_head_problem(eagle2)
    assert "no readable config.json" in peers.eagle3_head_problem(tmp_path / "missing")
    assert peers.draft_command(head, Path("/o"), Path("/venv/bin/optimum-cli")) == [
        "/venv/bin/optimum-cli", "export", "openvino", "--model", str(head), "--task", "text-generation-with-past",
        "--weight-format", "fp32", "--trust-remote-code", "/o"]
    folder = peers.draft_dir(head)
    assert folder.parent == cache / "peers" / "eagle3-drafts" and folder.name.startswith("head-")
    (head / "model.safetensors").write_bytes(b"other weights")  # another head: another cache entry
    assert peers.draft_dir(head) != folder
    hf = Path("/models/SmolLM2-hf")  # the EAGLE-3 peer runs the plain peer's converted model
    assert peers.model_dir(hf, "openvino-eagle3-int4") == peers.model_dir(hf, "openvino-int4")


def test_eagle3_peer_without_a_head_skips_with_a_note(export_dir, tmp_path, cache, monkeypatch, capsys):
    _fake_ov(monkeypatch, [1])
    rc, res = _bench(export_dir, tmp_path, "--baselines", "openvino-eagle3-fp32", "--limit", "1")
    assert rc == 0
    b = res["baselines"]["openvino-eagle3-fp32"]
    assert b["status"] == "skipped" and b["note"].startswith("needs an EAGLE-3 draft head: eagle-bench --eagle3-head")
    assert "note: baseline openvino-eagle3-fp32: needs an EAGLE-3 draft head" in capsys.readouterr().out
    assert not (cache / "peers").exists()
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # and without the package: both said at once
    assert peers.unavailable("openvino-eagle3-int4") == (
        f"openvino-genai is not installed ({peers.INSTALL}); " + peers.eagle3_head_problem(None) + ": skipped")


def test_eagle3_peer_drafts_with_the_converted_head(cache, tmp_path, monkeypatch):
    """openvino-eagle3-int4: the openvino-int4 model plus the head's IR as OpenVINO GenAI's
    draft_model, greedy with OV_EAGLE3's settings; both conversions cached and recorded."""
    pipeline = _fake_ov(monkeypatch, [31, 32, 33])
    head = _eagle3_head(tmp_path / "head")
    hf = tmp_path / "hf-model"
    calls = []

    def convert(cmd, logfile):
        calls.append(cmd)
        (Path(cmd[-1]) / "openvino_model.xml").write_text("<net/>")
        return 0

    monkeypatch.setattr(peers, "_run_converter", convert)
    monkeypatch.setattr(peers, "optimum_cli", lambda: Path("/venv/bin/optimum-cli"))
    system = peers.make_peer("openvino-eagle3-int4", hf, [2], threads=2, eagle3_head=head)
    main, draft = peers.model_dir(hf, "openvino-int4"), peers.draft_dir(head)
    assert [c[c.index("--model") + 1] for c in calls] == [str(hf), str(head)]
    pipe = pipeline.instances[-1]
    assert pipe.folder == str(main) and pipe.props["draft_model"] == ("draft", str(draft), "CPU",
                                                                      {"INFERENCE_NUM_THREADS": 2})
    run = system.run([5, 6], max_new_tokens=2)
    config = pipe.calls[-1][1]
    assert run.token_ids == [31, 32] and config.do_sample is False
    assert all(getattr(config, k) == v for k, v in peers.OV_EAGLE3.items())
    r = system.record
    assert r["model_dir"] == str(main) and "EAGLE-3" in r["decoding"]
    drafted = " ".join(peers.draft_command(head, draft, Path("/venv/bin/optimum-cli")))
    assert r["speculative"] == {"method": "EAGLE-3", "head": str(head), "draft_model_dir": str(draft),
                                "draft_command": drafted, "generation_config": peers.OV_EAGLE3}
    peers.make_peer("openvino-eagle3-int4", hf, [2], threads=2, eagle3_head=head)
    assert len(calls) == 2  # both cached
    plain = peers.make_peer("openvino-int4", hf, [2], threads=2)
    assert plain.record["speculative"] == peers.NO_SPECULATION and "draft_model" not in pipeline.instances[-1].props
    assert plain.speculative == {}


def test_peer_record_in_the_json_and_the_table(export_dir, tmp_path, cache, monkeypatch, capsys):
    """A fake onnxruntime_genai answers the first prompt exactly as our vanilla decoding and the
    others with a different first token: the record counts 1 identical prompt of 3."""
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(export_dir, threads=1)
    vanilla = {}
    for i, p in enumerate(PROMPTS):
        ids = rt.encode(p["prompt"])
        tokens = list(rt.generate(ids, max_new_tokens=MAX_NEW, mode="vanilla").token_ids)
        if i:
            tokens[0] = rt.tokenizer.encode("Q" if rt.tokenizer.decode(tokens[:1]) != "Q" else "Z")[-1]
        vanilla[tuple(ids)] = tokens
    _FakeGenerator.script = vanilla
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", _fake_og())

    def convert(cmd, logfile):
        (Path(cmd[cmd.index("-o") + 1]) / "genai_config.json").write_text("{}")
        return 0

    monkeypatch.setattr(peers, "_run_converter", convert)
    rc, res = _bench(export_dir, tmp_path, "--baselines", "ort-genai-int4")
    assert rc == 0
    b = res["baselines"]["ort-genai-int4"]
    hf = Path(json.loads((export_dir / "manifest.json").read_text())["sources"]["target"]["path"])
    folder = peers.model_dir(hf, "ort-genai-int4")
    assert b["status"] == "ok" and b["package"] == "onnxruntime-genai" and b["precision"] == "int4"
    assert b["version"] == peers.version("onnxruntime-genai") and b["model_dir"] == str(folder)
    assert b["command"] == (f"python -m onnxruntime_genai.models.builder -i {hf} -o {folder} -p int4 -e cpu "
                            f"-c {folder}/_builder_cache")
    assert b["runtime"]["session_options"]["intra_op_num_threads"] == 1
    assert b["greedy_vs_vanilla"] == {"reference": "vanilla", "prompts": 3, "identical_tokens": 1,
                                      "identical_text": 1}
    firsts = [r["runs"]["ort-genai-int4"]["first_difference_vs_vanilla"] for r in res["prompts"]]
    assert firsts == [None, 0, 0]
    assert "eagle_vs_ort-genai-int4" in res["aggregate"]["0"]["all"]["speedup"]
    out = capsys.readouterr().out
    assert "x vanilla" in out and "\nvanilla                       " in out
    assert (f"peer ort-genai-int4: onnxruntime-genai {b['version']}, int4; greedy tokens = our vanilla on 1/3 "
            "prompts (text 1/3); built with: python -m onnxruntime_genai.models.builder") in out


def test_extra_engines_run_interleaved_beside_the_first(export_dir, tmp_path):
    other = copy_export(export_dir, tmp_path / "tiny-b")
    rc, res = _bench(export_dir, tmp_path, "--extra-engines", str(other), "--limit", "2")
    assert rc == 0
    assert res["config"]["extra_engines"] == [str(other)]
    for r in res["prompts"]:
        assert set(r["runs"]) == {"eagle", "vanilla", "eagle-hybrid", "eagle@tiny-b", "vanilla@tiny-b",
                                  "eagle-hybrid@tiny-b"}
        assert r["runs"]["vanilla@tiny-b"]["token_ids"] == r["runs"]["vanilla"]["token_ids"]  # the same export
        assert set(r["greedy"]) == {"ort", "tiny-b"}
    assert res["greedy_identity"]["tiny-b"]["identical"] == 2 == len(res["prompts"])
    assert "eagle@tiny-b_vs_vanilla@tiny-b" in res["aggregate"]["0"]["all"]["speedup"]
    assert "eagle-hybrid@tiny-b_vs_vanilla@tiny-b" in res["aggregate"]["0"]["all"]["speedup"]


# --------------------------------------------------------------------------- real peers (slow)


def _real(name: str) -> str | None:
    family, _ = peers.split_name(name)
    if importlib.util.find_spec(peers.PACKAGES[family][0]) is None:
        return f"{peers.PACKAGES[family][1]} is not installed"
    if family == "openvino" and peers.optimum_cli() is None:
        return "no optimum-cli (README: eagle-bench peers)"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ort-genai-fp32", "openvino-fp32"])
def test_real_peer_on_the_tiny_export(export_dir, tmp_path, monkeypatch, name):
    """Converts the tiny target with the peer's own tool (into a fresh cache) and decodes 8
    tokens: in fp32 its greedy tokens equal our vanilla decoding's on every prompt."""
    reason = _real(name)
    if reason:
        pytest.skip(reason)
    converter = peers.optimum_cli()  # found before the cache moves (it may live in the cache's venv)
    if converter:
        monkeypatch.setenv("EAGLE_DEPLOY_OPTIMUM_CLI", str(converter))
    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    rc = cli.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)), "--max-new-tokens", "8",
                   "--threads", "1", "--out", str(out), "-q", "--no-memory", "--baselines", name])
    assert rc == 0
    res = json.loads(out.read_text())
    b = res["baselines"][name]
    assert b["status"] == "ok", b["note"]
    assert b["version"] == peers.version(peers.PACKAGES[peers.split_name(name)[0]][1])
    assert (Path(b["model_dir"]) / "peer.json").is_file()
    for r in res["prompts"]:
        assert 1 <= r["runs"][name]["new_tokens"] <= 8
    assert b["greedy_vs_vanilla"]["prompts"] == len(PROMPTS)
    assert b["greedy_vs_vanilla"]["identical_tokens"] == len(PROMPTS)
