"""eagle-validate on a tiny export: passes when the graphs match the PyTorch reference, fails
with a readable table when one initializer is perturbed, and its compare rules."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.validate import cli as v
from eagle_deploy.validate import compare
from tests.tiny_export import copy_export, tiny_export


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


def test_passes_on_a_good_export(export_dir, tmp_path, capsys):
    assert v.main(["--engines", str(export_dir), "--work", str(tmp_path), "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "FAIL" not in out
    for header in ("output", "max abs err", "max rel err", "argmax agree", "result"):
        assert header in out
    for feed in ("prefill", "tree verify", "draft extend", "draft expand d2"):
        assert feed in out
    assert f"polygraphy run {export_dir.resolve() / 'target.onnx'} --onnxrt --load-inputs" in out

    from polygraphy.json import load_json

    feeds = load_json(str(tmp_path / "target_inputs.json"))
    assert len(feeds) == 3
    verify = feeds[2]
    assert verify[c.INPUT_IDS].shape == (1, 10) and verify[c.ATTENTION_MASK].shape == (1, 10, 24 + 10)
    assert verify[c.POSITION_IDS].tolist() == [[24 + d for d in (0, 1, 1, 1, 2, 2, 2, 3, 3, 4)]]
    # the past as the graph takes it: the fused (shared KV) graph [1, kv_heads, P, head_dim], else [P, 1, ...]
    from eagle_deploy.contract.manifest import Manifest

    axis = c.KV_SEQ_AXIS[Manifest.load(export_dir).target.kv_layout]
    assert verify[c.past_name(0, "key")].shape[axis] == 24  # a real prefill's past
    assert not verify[c.ATTENTION_MASK][0, 1, 24 + 2]  # siblings do not see each other
    draft = load_json(str(tmp_path / "draft_inputs.json"))
    assert [f[c.INPUT_IDS].shape[1] for f in draft] == [24, 4, 4]
    assert draft[2][c.past_name(0, "key")].shape[axis] == 28


def test_printed_polygraphy_command_reproduces_the_check(export_dir, tmp_path, capsys):
    exe = shutil.which("polygraphy") or str(Path(sys.executable).parent / "polygraphy")
    if not Path(exe).exists():
        pytest.skip("polygraphy CLI not on PATH")
    assert v.main(["--engines", str(export_dir), "--work", str(tmp_path), "--graphs", "target"]) == 0
    line = next(ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("polygraphy run"))
    proc = subprocess.run([exe] + line.split()[1:], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "PASSED" in proc.stdout + proc.stderr


def _perturb_one_initializer(model_path: Path) -> str:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    init = max((i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
                and "embed" not in i.name), key=lambda i: int(np.prod(i.dims)))
    arr = numpy_helper.to_array(init).copy()
    arr += np.random.default_rng(0).normal(0.0, 0.02, arr.shape).astype(arr.dtype)
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(model_path))
    return init.name


def test_fails_with_a_table_when_an_initializer_is_perturbed(export_dir, tmp_path, capsys):
    bad = copy_export(export_dir, tmp_path / "bad")
    _perturb_one_initializer(bad / "target.onnx")
    # the graph was edited on purpose: the numerics are under test, not the files (--verify off)
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--graphs", "target", "--verify", "off"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and "FAIL (" in out
    failing = [ln for ln in out.splitlines() if ln.startswith("target") and "FAIL" in ln]
    assert any(" logits " in ln for ln in failing)


def test_an_edited_graph_is_refused_before_validation_unless_verify_is_off(export_dir, tmp_path, capsys):
    """eagle-validate first checks the files against the manifest (contract/verify.py)."""
    bad = copy_export(export_dir, tmp_path / "bad")
    _perturb_one_initializer(bad / "target.onnx")
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--graphs", "target"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"eagle-validate: error: {bad / 'target.onnx'} ")
    assert err[0].endswith("; re-export") and not (tmp_path / "work").exists()


def test_missing_export_is_a_usage_error(tmp_path, capsys):
    assert v.main(["--engines", str(tmp_path)]) == 2
    assert "eagle-validate: error" in capsys.readouterr().err


# --------------------------------------------------------------------------- compare rules


def _logits(rows=4, vocab=16, seed=0):
    return np.random.default_rng(seed).normal(0, 3, (1, rows, vocab)).astype(np.float32)


def test_output_paths_are_checked_before_the_validation_runs(export_dir, tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setattr(v, "run_validation", lambda *a, **kw: pytest.fail("validation ran"))
    for flags, message in ((["--work", str(afile)], f"--work {afile} is a file, not a folder"),
                           (["--json", str(afile / "r.json")], f"--json {afile / 'r.json'}: {afile} is a file"),
                           (["--json", str(tmp_path)], f"--json {tmp_path} is a folder, not a file")):
        assert v.main(["--engines", str(export_dir), *flags]) == 2
        assert capsys.readouterr().err.strip() == f"eagle-validate: error: {message}" + (
            ", not a folder" if "r.json" in message else "")


def test_a_graph_named_twice_is_validated_once(export_dir, tmp_path, monkeypatch):
    class Seen(Exception):
        pass

    def record(folder, work, graphs, **kw):
        raise Seen(graphs)

    monkeypatch.setattr(v, "run_validation", record)
    with pytest.raises(Seen) as seen:
        v.main(["--engines", str(export_dir), "--graphs", "draft,draft,target"])
    assert seen.value.args == (["draft", "target"],)


def test_fp32_rule_is_polygraphy_elementwise():
    p = compare.Policy("elementwise", atol=1e-4, rtol=1e-5)
    ref = _logits()
    assert compare.compare_output(c.LOGITS, ref, ref + 5e-5, p, {})[3]
    max_abs, _, agree, ok, note = compare.compare_output(c.LOGITS, ref, ref + 1e-3, p, {})
    assert not ok and max_abs == pytest.approx(1e-3, rel=1e-2) and agree == 1.0 and "out of tolerance" in note
    big = ref * 1e4  # large values pass on rtol alone
    assert compare.compare_output(c.FEATURES, big, big * (1 + 5e-6), p, {})[3]


def test_hidden_states_are_judged_against_their_rows_largest_element():
    """A row with one massive activation (2.4e4, as SmolLM2's residual stream has): a 6e-3 error
    on a 100-sized element is fp32 rounding of that row (rtol x 2.4e4 = 0.24) and passes for
    tapped_features / next_features / features (the final norm's output inherits the residual
    stream's rounding), but fails for a row without the massive element, and logits stay
    elementwise."""
    p = compare.Policy("elementwise", atol=1e-4, rtol=1e-5)
    ref = np.full((1, 2, 8), 100.0, np.float32)
    ref[0, :, 3] = 2.4e4
    out = ref.copy()
    out[0, 0, 0] += 6e-3
    for name in (c.TAPPED_FEATURES, c.NEXT_FEATURES, c.FEATURES):
        assert compare.compare_output(name, ref, out, p, {})[3], name
    assert not compare.compare_output(c.LOGITS, ref, out, p, {})[3]
    quiet = np.full((1, 2, 8), 100.0, np.float32)
    for name in (c.TAPPED_FEATURES, c.FEATURES):
        assert not compare.compare_output(name, quiet, quiet + np.where(out != ref, 6e-3, 0), p, {})[3], name
    # the scale is per row: the massive element of row 0 does not loosen row 1
    ref2 = ref.copy()
    ref2[0, 1, 3] = 100.0
    out2 = ref2.copy()
    out2[0, 1, 0] += 6e-3
    assert not compare.compare_output(c.FEATURES, ref2, out2, p, {})[3]


def test_argmax_flip_fails_unless_at_a_near_tie():
    p = compare.Policy("relative", rel=1.0, tie=1e-3)  # a loose error bound: only the argmax rule can fail
    ref = np.zeros((1, 2, 8), np.float32)
    ref[0, :, 5], ref[0, :, 6] = 10.0, 9.9  # a clear winner (gap 0.1)
    out = ref.copy()
    out[0, 0, 6] = 10.2
    _, _, agree, ok, _ = compare.compare_output(c.LOGITS, ref, out, p, {})
    assert agree == 0.5 and not ok
    tie = ref.copy()
    tie[0, 0, 6] = 10.0 - 5e-4  # top-2 gap 5e-4 <= tie: rounding may pick either
    flipped = tie.copy()
    flipped[0, 0, 6] = 10.0 + 1e-4
    assert compare.compare_output(c.LOGITS, tie, flipped, p, {})[3]


def test_topk_ids_may_swap_only_at_near_ties():
    p = compare.Policy("elementwise")
    lp = np.array([[[-0.1, -1.0, -1.00001, -3.0]]], np.float32)
    ids = np.array([[[7, 3, 5, 9]]])
    swapped = np.array([[[7, 5, 3, 9]]])
    assert compare.compare_output(c.TOPK_IDS, ids, swapped, p, {c.TOPK_LOGPROBS: lp})[3]
    wrong = np.array([[[3, 7, 5, 9]]])
    assert not compare.compare_output(c.TOPK_IDS, ids, wrong, p, {c.TOPK_LOGPROBS: lp})[3]


def test_quantised_graphs_need_99_percent_top1():
    p = compare.Policy("top1")
    ref = _logits(rows=200, seed=1)
    out = ref + np.random.default_rng(2).normal(0, 0.01, ref.shape).astype(np.float32)
    assert compare.compare_output(c.LOGITS, ref, out, p, {})[3]
    worse = ref.copy()
    worse[0, :10] = -ref[0, :10]  # 5% of positions get another argmax
    _, _, agree, ok, _ = compare.compare_output(c.LOGITS, ref, worse, p, {})
    assert not ok and agree < 0.99
    assert compare.compare_output(c.FEATURES, ref, worse, p, {})[3]  # reported only


def test_shape_mismatch_fails():
    assert not compare.compare_output(c.LOGITS, _logits(rows=3), _logits(rows=4), compare.Policy("elementwise"), {})[3]


def test_policy_by_dtype_and_quant():
    from eagle_deploy.contract.manifest import GraphEntry

    def entry(dtype: str, quant=None) -> GraphEntry:
        return GraphEntry(path="t.onnx", dtype=dtype, inputs=(), outputs=(), quant=quant)

    assert compare.policy_for(entry("float32")).kind == "elementwise"
    assert compare.policy_for(entry("float16")).rel == 2e-2
    assert compare.policy_for(entry("float32", "int4")).kind == "top1"


# --------------------------------------------------------------------------- quantised exports


def test_quantised_topk_ids_are_judged_by_the_first_id_only():
    """A quantised draft graph may reorder its lower top-k ids (their log-probs moved by the
    quantisation); the first id is held to the top-1 rule, as logits' argmax is."""
    p = compare.policy_for(__import__("eagle_deploy.contract.manifest", fromlist=["GraphEntry"]).GraphEntry(
        path="d.onnx", dtype="float32", inputs=(), outputs=(), quant="int4"))
    lp = np.array([[[-0.1, -1.0, -1.3, -3.0], [-0.2, -2.0, -2.5, -4.0]]], np.float32)
    ids = np.array([[[7, 3, 5, 9], [4, 1, 2, 8]]])
    reordered = np.array([[[7, 5, 3, 11], [4, 2, 1, 8]]])
    max_abs, _, agree, ok, note = compare.compare_output(c.TOPK_IDS, ids, reordered, p, {c.TOPK_LOGPROBS: lp})
    assert ok and agree == 1.0 and "top-1" in note and "5 of 8 ids differ" in note and max_abs is None
    first_differs = np.array([[[3, 7, 5, 9], [4, 1, 2, 8]]])  # top-2 gap 0.9 > the quantised tie band
    assert not compare.compare_output(c.TOPK_IDS, ids, first_differs, p, {c.TOPK_LOGPROBS: lp})[3]


def test_quantised_rule_excuses_near_ties_and_bounds_kl():
    p = compare.Policy("top1", tie=compare.QUANT_TIE, max_kl=compare.QUANT_MAX_KL)
    ref = np.zeros((1, 100, 16), np.float32)
    ref[0, :, 3] = 5.0
    ref[0, :, 4] = 5.0 - np.where(np.arange(100) < 10, 0.2, 2.0)  # 10 positions at a near-tie (gap 0.2)
    flipped = ref.copy()
    flipped[0, :10, 4] += 0.3  # those 10 flip: argmax agreement 90%, but only at near-ties
    _, _, agree, ok, note = compare.compare_output(c.LOGITS, ref, flipped, p, {})
    assert agree == pytest.approx(0.9) and ok and "100.0% off near-ties" in note
    clear = ref.copy()
    clear[0, 50:52, 4] += 2.5  # 2 flips where the reference's top-2 gap is 2.0: 98% < 99%
    assert not compare.compare_output(c.LOGITS, ref, clear, p, {})[3]
    smeared = ref * 0.1  # the same argmax everywhere, a very different distribution
    _, _, agree, ok, note = compare.compare_output(c.LOGITS, ref, smeared, p, {})
    assert agree == 1.0 and not ok and "mean KL" in note


def _tiny_quant_export(root: Path, quant: str) -> Path:
    import torch

    from eagle_deploy.exporter.export import ExportOptions, export
    from tests import tiny

    torch.set_num_threads(1)
    target = tiny.build_tiny_target(root / "target", seed=0, norm_noise=0.1)
    head = tiny.build_tiny_head(root / "head", target, seed=1, norm_noise=0.1)
    options = ExportOptions(max_length=256, name=f"tiny-{quant}", quant=quant)
    return export(str(target), str(head), root / "exports", options, progress=None)


@pytest.fixture(scope="module", params=["int4", "int8"])
def quant_export(request, tmp_path_factory) -> Path:
    return _tiny_quant_export(tmp_path_factory.mktemp(f"quant-{request.param}"), request.param)


def test_quantised_export_passes_against_its_own_weights(quant_export, tmp_path, capsys):
    """README's --quant int4 / int8 exports: the reference takes the graph's dequantised weights;
    the graph as shipped passes the top-1/KL rule, its fp32-activation copy the float32 rule."""
    import json

    report = tmp_path / "report.json"
    assert v.main(["--engines", str(quant_export), "--work", str(tmp_path), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "FAIL" not in out
    rows = json.loads(report.read_text())["rows"]
    assert {r["runner"] for r in rows} == {"onnxrt", "onnxrt-fp32act"}
    assert any(r["output"] == c.TOPK_IDS and r["runner"] == "onnxrt" for r in rows)
    fp32act = [r["max_abs"] for r in rows if r["runner"] == "onnxrt-fp32act" and r["output"] == c.LOGITS]
    assert len(fp32act) == 3 and max(fp32act) < 1e-5  # the same weights: fp32 rounding only
    assert f"polygraphy run {(tmp_path / 'target_fp32act.onnx').resolve()}" in out


def test_quantised_weight_that_matches_no_checkpoint_weight_fails(quant_export, tmp_path, capsys):
    import onnx
    from onnx import numpy_helper

    bad = copy_export(quant_export, tmp_path / "bad")
    model = onnx.load(str(bad / "draft.onnx"))
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and "fc" in n.name)
    init = next(t for t in model.graph.initializer if t.name == node.input[1])
    packed = numpy_helper.to_array(init).copy()
    packed.reshape(-1)[:8] ^= 0x77  # a few quantised values moved by several steps
    init.CopyFrom(numpy_helper.from_array(packed, init.name))
    onnx.save(model, str(bad / "draft.onnx"))
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--graphs", "draft", "--verify", "off"])
    assert rc == 1
    out = capsys.readouterr().out
    failing = [ln for ln in out.splitlines() if ln.startswith("draft") and "FAIL" in ln]
    assert any(node.name in ln and "matches no weight of the checkpoint" in ln for ln in failing), out


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_quantised_export_of_linked_files_validates(quant_export, tmp_path, capsys, link):
    """Files linked into another folder (ln -s, cp -al): onnx.load refuses linked external data
    files, so the quantised weights are read back by the project's own reader."""
    linked = tmp_path / "linked"
    shutil.copytree(quant_export, linked, symlinks=False,
                    copy_function=(lambda a, b: Path(b).symlink_to(Path(a).resolve())) if link == "symlink"
                    else (lambda a, b: Path(b).hardlink_to(a)))
    assert any(p.is_symlink() for p in linked.rglob("*")) == (link == "symlink")
    rc = v.main(["--engines", str(linked), "--work", str(tmp_path / "work"), "--graphs", "draft"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASSED" in out and "FAIL" not in out


def test_a_head_changed_since_the_export_is_named_not_blamed_on_the_export(export_dir, tmp_path, capsys):
    import json

    from eagle_deploy.contract.manifest import Manifest

    bad = copy_export(export_dir, tmp_path / "bad")
    head = Path(Manifest.load(bad).sources.draft.path)
    moved = tmp_path / "head"
    shutil.copytree(head, moved)
    data = json.loads((bad / c.MANIFEST_FILE).read_text())
    data["sources"]["draft"]["path"] = str(moved)
    (bad / c.MANIFEST_FILE).write_text(json.dumps(data))
    weights = next(n for n in data["sources"]["draft"]["sha256"])
    blob = bytearray((moved / weights).read_bytes())
    blob[-1] ^= 1  # retrained in place, as far as the bytes go
    (moved / weights).write_bytes(bytes(blob))
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--verify", "off"])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "eagle-validate" in ln]
    assert rc == 2 and len(err) == 1, err  # one error line (transformers' progress bars aside)
    assert err[0].startswith(f"eagle-validate: error: the draft head {moved} changed since the export was made "
                             f"({weights} has another sha256")


def test_eagle3_export_passes_against_an_independent_reference(eagle3, tmp_path, capsys):
    """An EAGLE-3 export (head 96 wide on a 64-wide target, reduced draft vocabulary): the target
    graph with its tapped features and the draft graph (extension fed taps, expansions fed the
    head's own features) match the reference written apart from the exporter's module."""
    assert v.main(["--engines", str(eagle3.export_dir), "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "FAIL" not in out
    assert "tapped_features" in out and "draft expand d2" in out
    from polygraphy.json import load_json

    draft = load_json(str(tmp_path / "draft_inputs.json"))
    assert [f[c.TAPPED_FEATURES].shape for f in draft] == [(1, 24, 2 * 64), (1, 0, 2 * 64), (1, 0, 2 * 64)]
    assert [f[c.FEATURES].shape for f in draft] == [(1, 0, 96), (1, 4, 96), (1, 4, 96)]


def test_eagle3_draft_graph_with_a_perturbed_weight_fails(eagle3, tmp_path, capsys):
    bad = copy_export(eagle3.export_dir, tmp_path / "bad")
    name = _perturb_one_initializer(bad / "draft.onnx")
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--graphs", "draft", "--verify", "off"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out, (name, out[-2000:])


def test_too_little_memory_is_refused_saying_how_much_is_needed(export_dir, monkeypatch, capsys):
    """The PyTorch reference is the whole model in fp32 (a 7B: 27 GB): with less memory available
    than that plus the graphs, validation says how much it needs instead of being killed."""
    import psutil

    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.validate.reference import memory_needed

    need, why = memory_needed(Manifest.load(export_dir), export_dir)
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
        str(Manifest.load(export_dir).sources.target.path)).parameters())
    assert need > 4 * params and "x 4 bytes" in why
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=need - 1))
    capsys.readouterr()  # transformers' loading bar above
    assert v.main(["--engines", str(export_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eagle-validate needs about" in err[0] and "GiB available" in err[0]
