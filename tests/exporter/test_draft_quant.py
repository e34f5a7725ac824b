"""`eagle-export --draft-quant` (exporter.export.draft_quant_for): an fp32 onnxruntime export
quantises its draft graph's weights to int8 by default. The draft only proposes tokens, so the
target graph is the same file, and every committed token is the target's own: greedy EAGLE
output equals vanilla greedy output and the fp32 draft's EAGLE output; the int8 draft's
proposals stay close to the fp32 draft's (on SmolLM2-135M: tau 2.35 vs 2.34, draft steps 1.8x
faster; the end-to-end check on that model is in tests/exporter/test_smollm2.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
from eagle_deploy.exporter.export import ExportOptions, check_options, draft_quant_for
from tests.conftest import PROMPTS, THREADS
from tests.helpers import causal_mask, run_step


@pytest.fixture(scope="module")
def exports(quant_exports) -> dict:
    """{"fp32" (int8 draft, the default), "fp32-draft" (--draft-quant none), ...}: conftest quant_exports."""
    return quant_exports


@pytest.mark.parametrize("draft_quant, quant, dtype, layout, expected", [
    ("auto", None, "float32", KV_SHARED, "int8"),  # the default fp32 onnxruntime export
    ("auto", "int4", "float32", KV_SHARED, "int4"),  # follows --quant
    ("auto", "int8", "float32", KV_SHARED, "int8"),
    ("auto", None, "float32", KV_SEQ_MAJOR, None),  # the standard graph (TensorRT runs no MatMulNBits)
    ("auto", None, "float16", KV_SEQ_MAJOR, None),
    ("none", None, "float32", KV_SHARED, None),
    ("none", "int4", "float32", KV_SHARED, None),  # --quant int4 --no-quant-draft
    ("int4", None, "float32", KV_SHARED, "int4"),
    ("int8", None, "float32", KV_SEQ_MAJOR, "int8"),  # asked for explicitly: onnxruntime runs it
])
def test_draft_quant_for_each_export(draft_quant, quant, dtype, layout, expected):
    options = ExportOptions(draft_quant=draft_quant, quant=quant)
    assert draft_quant_for(options, dtype, layout) == expected


def test_bad_draft_quant_is_refused_before_any_model_is_loaded():
    with pytest.raises(ValueError, match="--draft-quant int2 is not one of auto, none, int4, int8"):
        check_options(ExportOptions(draft_quant="int2"))
    with pytest.raises(ValueError, match="quantises an fp32 draft graph"):
        check_options(ExportOptions(draft_quant="int8", dtype="fp16"))
    assert check_options(ExportOptions(draft_quant="none", dtype="fp16"))[0] == "float16"


def test_cli_flags():
    from eagle_deploy.exporter.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["--model", "m", *a]).draft_quant  # noqa: E731
    assert parse() == "auto"
    assert parse("--no-quant-draft") == "none"
    assert parse("--draft-quant", "int4") == "int4"
    with pytest.raises(SystemExit):
        parse("--draft-quant", "int2")


def test_default_fp32_export_quantises_only_the_draft(exports):
    default, plain = Manifest.load(exports["fp32"]), Manifest.load(exports["fp32-draft"])
    assert default.target.quant is None and plain.target.quant is None and plain.draft.quant is None
    assert default.draft.quant == "int8" and default.draft.quant_info.method == "nbits"
    assert default.draft.quant_info.quantised_matmuls >= 3  # fc, the layer's projections, the LM head
    assert any("draft graph quantised to int8" in n for n in default.notes)
    # the same target graph (nodes and weights; only where a weight is stored may differ: with a full
    # draft vocabulary the fp32 draft shares the LM head with the target, the int8 draft cannot)
    a, b = _target_graph(exports["fp32"]), _target_graph(exports["fp32-draft"])
    assert [(n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in b.graph.node]
    weights = lambda m: {t.name: numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}  # noqa: E731
    assert weights(a) == weights(b)
    assert _draft_weight_bytes(exports["fp32"]) < 0.5 * _draft_weight_bytes(exports["fp32-draft"])


def _draft_weight_bytes(folder) -> int:
    """The draft graph file's size (a weight shared with the target lives in shared.data)
    without its rotary table, the same constant in both drafts (cos / sin [rows, head_dim/2]
    float32 for every position, exporter/fused.py), which the file holds exactly once."""
    from eagle_deploy.exporter.fused import rotary_rows

    manifest = Manifest.load(folder)
    table = (rotary_rows(manifest.dims.max_position_embeddings), manifest.dims.head_dim // 2)
    m = onnx.load(str(folder / "draft.onnx"), load_external_data=False)
    found = [numpy_helper.to_array(a.t) for n in m.graph.node if n.op_type == "Constant" for a in n.attribute
             if a.type == onnx.AttributeProto.TENSOR] + [numpy_helper.to_array(t) for t in m.graph.initializer
                                                          if t.data_location != onnx.TensorProto.EXTERNAL]
    tables = [t for t in found if t.shape == table]
    assert len(tables) == 2 and all(t.dtype == np.float32 for t in tables)  # cos and sin
    return (folder / "draft.onnx").stat().st_size - sum(t.nbytes for t in tables)


def _target_graph(folder):
    return onnx.load(str(folder / "target.onnx"))  # external data (shared.data) loaded too


def _draft(folder):
    from eagle_deploy.runtime.api import EagleRuntime

    return EagleRuntime.load(folder, threads=THREADS).decoder.drafter.backend


def test_int8_draft_proposals_stay_close_to_the_fp32_drafts(exports):
    """The same draft steps (random features, a prefix then a tree-like expansion) through both
    draft graphs: nearly always the same top-1 proposal, its log-prob within 0.05 (measured on
    this fixture: 97.5% of rows the same top-1, log-prob differences up to 0.0033)."""
    q, f = _draft(exports["fp32"]), _draft(exports["fp32-draft"])
    rng = np.random.default_rng(3)
    H = Manifest.load(exports["fp32"]).dims.hidden
    same_top1 = rows = 0
    worst = 0.0
    for trial in range(6):
        n = int(rng.integers(4, 20))
        tokens = rng.integers(1, 200, n).tolist()
        feats = rng.standard_normal((n, H)).astype(np.float32)
        outs = []
        for be in (q, f):
            kv = be.allocate_kv(64)
            outs.append(run_step(be, kv, tokens, np.arange(n), causal_mask(0, n), 0, features=feats))
        ids_q, ids_f = outs[0][c.TOPK_IDS][0], outs[1][c.TOPK_IDS][0]
        same_top1 += int((ids_q[:, 0] == ids_f[:, 0]).sum())
        rows += n
        worst = max(worst, float(np.abs(outs[0][c.TOPK_LOGPROBS][0][:, 0] - outs[1][c.TOPK_LOGPROBS][0][:, 0]).max()))
        assert not np.array_equal(outs[0][c.NEXT_FEATURES], outs[1][c.NEXT_FEATURES])  # it is quantised
    assert same_top1 / rows >= 0.9, (same_top1, rows)
    assert worst < 0.05


def test_int8_draft_leaves_greedy_output_the_targets(exports):
    """Greedy EAGLE with the int8 draft = vanilla greedy = EAGLE with the fp32 draft, token for
    token."""
    from eagle_deploy.runtime.api import EagleRuntime

    quant = EagleRuntime.load(exports["fp32"], threads=THREADS)
    plain = EagleRuntime.load(exports["fp32-draft"], threads=THREADS)
    for prompt in PROMPTS:
        vanilla = quant.generate(prompt, max_new_tokens=24, mode="vanilla").token_ids
        eagle = quant.generate(prompt, max_new_tokens=24)
        assert eagle.stats.draft_forwards > 0
        assert eagle.token_ids == vanilla == plain.generate(prompt, max_new_tokens=24).token_ids, prompt


def test_eagle3_draft_graph_quantises_too(eagle3, tmp_path):
    """An EAGLE-3 head's draft graph (fc over the tapped features, d2t ids) under the default
    int8: greedy EAGLE output equals vanilla greedy output."""
    from eagle_deploy.exporter.export import export
    from eagle_deploy.runtime.api import EagleRuntime

    out = export(str(eagle3.target_dir), str(eagle3.head_dir), tmp_path, ExportOptions(max_length=64, name="e3"),
                 progress=None)
    m = Manifest.load(out)
    assert m.draft.head_kind == "eagle3" and m.draft.quant == "int8" and m.target.quant is None
    rt = EagleRuntime.load(out, threads=THREADS)
    for prompt in PROMPTS[:2]:
        eagle = rt.generate(prompt, max_new_tokens=16)
        assert eagle.stats.draft_forwards > 0
        assert eagle.token_ids == rt.generate(prompt, max_new_tokens=16, mode="vanilla").token_ids


@pytest.mark.parametrize("options, expected", [
    (ExportOptions(), (6, 3, 2)),  # fp32 target, int8 draft (fused)
    (ExportOptions(draft_quant="none"), (8, 4, 2)),  # the tree measured with an fp32 draft
    (ExportOptions(dtype="fp16"), (8, 4, 2)),
    (ExportOptions(graph="standard"), (8, 4, 2)),
    (ExportOptions(quant="int4"), (2, 1, 1)),
    (ExportOptions(quant="int8", draft_quant="none"), (4, 3, 1)),
])
def test_default_tree_follows_the_draft_graphs_quantisation(options, expected):
    tree = check_options(options)[1]
    assert (tree.total_tokens, tree.depth, tree.top_k) == expected


def test_fused_fallback_keeps_an_fp32_draft_and_its_tree(tmp_path):
    """A model the fused graph cannot hold (head dim 12) falls back to the standard graph: the
    draft stays unquantised under "auto", the manifest gets that export's default tree, and the
    progress line says so."""
    from eagle_deploy.exporter.export import export
    from tests import tiny

    target = tiny.build_tiny_target(tmp_path / "t", gqa=True, seed=3, hidden_size=48)
    head = tiny.build_tiny_head(tmp_path / "h", target, seed=4)
    said = []
    out = export(str(target), str(head), tmp_path / "x", ExportOptions(max_length=64, name="x"), progress=said.append)
    m = Manifest.load(out)
    assert m.target.kv_layout == KV_SEQ_MAJOR and m.draft.quant is None
    assert (m.tree.total_tokens, m.tree.depth, m.tree.top_k) == (8, 4, 2)
    assert any("standard graph (and an unquantised draft graph)" in s for s in said)


def test_tensorrt_refuses_matmulnbits(gqa, tmp_path, capsys):
    """--backend trt with --quant or an explicit --draft-quant is refused before anything is
    exported; trt_build refuses an export whose graphs hold MatMulNBits (before any TensorRT
    import)."""
    from eagle_deploy.exporter import trt_build
    from eagle_deploy.exporter.cli import graph_for, main

    assert graph_for("auto", "trt", None, "auto") == "standard" and graph_for("auto", "trt", None, "none") == "standard"
    for flags, said in ((["--draft-quant", "int8"], "--draft-quant int8"), (["--quant", "int4"], "--quant int4")):
        rc = main(["--model", "unused", "--out", str(tmp_path / "cli"), "--backend", "trt", *flags])
        assert rc == 2 and f"--backend trt cannot take {said}" in capsys.readouterr().err
        assert not (tmp_path / "cli").exists()
    from eagle_deploy.exporter.export import export

    standard = export(str(gqa.target_dir), str(gqa.head_dir), tmp_path / "x",
                      ExportOptions(max_length=64, name="s", graph="standard", draft_quant="int8"), progress=None)
    with pytest.raises(ValueError, match="draft.onnx in .* MatMulNBits"):
        trt_build.build_engines(standard)
    with pytest.raises(SystemExit):  # the two draft flags exclude each other
        main(["--model", "m", "--no-quant-draft", "--draft-quant", "int8"])
