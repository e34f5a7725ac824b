"""The int8 prefill graph (`eagle-export --quant int4 --prefill-weights int8`, exporter/prefill.py,
contract onnx_io "Prefill graph"): prefill.onnx beside the int4 target graph with the target's
inputs and outputs, every weight MatMul as per-token int8 activations x per-column int8 weights,
its token embedding in shared.data; a prompt run in chunks gives the same bits as one forward;
the flag's refusals are one line.

The export is tests/conftest.py's prefill_exports (a tiny tied-embedding GQA target)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.verify import verify_export
from eagle_deploy.exporter.export import PREFILL_NOTE, ExportOptions, check_options
from eagle_deploy.exporter.external_data import external_info
from eagle_deploy.exporter.prefill import (
    PER_TOKEN,
    _quantised_weight,
    build_prefill_graph,
    prefill_graph_wanted,
)
from eagle_deploy.runtime.backends import load_backend
from tests import tiny
from tests.conftest import MAX_LENGTH, THREADS
from tests.helpers import causal_mask, kv_rows, prefill, run_step

PROMPT = np.random.default_rng(21).integers(1, tiny.VOCAB, 120).tolist()


@pytest.fixture(scope="module")
def folder(prefill_exports):
    return prefill_exports["int4-prefill"]


def _ops(path) -> Counter:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def test_the_export_records_a_prefill_graph_with_the_targets_io(folder):
    m = Manifest.load(folder)
    assert m.prefill is not None and m.prefill.path == c.PREFILL_FILE == "prefill.onnx"
    assert (m.prefill.inputs, m.prefill.outputs) == (m.target.inputs, m.target.outputs)
    assert m.prefill.kv_layout == m.target.kv_layout == c.KV_SHARED
    assert m.prefill.repeats_one_row == m.target.repeats_one_row and m.prefill.ragged_batch
    assert m.target.quant == "int4" and m.prefill.quant == "int8"
    assert m.prefill.quant_info.method == PER_TOKEN and m.prefill.quant_info.batch_invariant is False
    assert m.prefill.sha256 == m.files[c.PREFILL_FILE].sha256
    assert PREFILL_NOTE in m.notes
    assert verify_export(folder, m, "full").files == len(m.files)


def test_every_weight_matmul_is_int8_and_the_embedding_is_read_from_shared_data(folder):
    import onnx

    m = Manifest.load(folder)
    ops, target_ops = _ops(folder / c.PREFILL_FILE), _ops(folder / c.TARGET_FILE)
    assert "MatMulNBits" not in ops and "DynamicQuantizeLinear" not in ops
    assert ops["MatMulInteger"] == m.prefill.quant_info.quantised_matmuls == target_ops["MatMulNBits"]
    model = onnx.load(str(folder / c.PREFILL_FILE), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    assert not [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    embed = next(t for t in m.shared_weights.tensors if t.role == "embedding")
    assert embed.prefill_name is not None
    stored = next(t for t in model.graph.initializer if t.name == embed.prefill_name)
    assert external_info(stored) == {"location": c.SHARED_WEIGHTS_FILE, "offset": embed.offset, "length": embed.length}
    # lm_head tensors stay the target's and the draft's: the prefill graph has its own int8 LM head
    assert all(t.prefill_name is None for t in m.shared_weights.tensors if t.role == "lm_head")


def test_the_weights_are_int8_with_one_scale_per_output_column():
    w = np.random.default_rng(0).standard_normal((48, 20)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column keeps a finite scale
    q, scale = _quantised_weight(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (20,)
    assert q.min() >= -127 and np.abs(q).max(axis=0)[np.arange(20) != 3].min() == 127
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)
    assert not q[:, 3].any()


def _backend(folder, which: str):
    m = Manifest.load(folder)
    return load_backend("ort", folder, m, which, THREADS)


def _chunked(backend, chunks: list[int]) -> tuple[dict, list]:
    """The prompt's rows in forwards of `chunks` rows (each >= 2), logits at every row."""
    kv, outs, a = backend.allocate_kv(MAX_LENGTH + 1), [], 0
    for n in chunks:
        outs.append(run_step(backend, kv, PROMPT[a:a + n], np.arange(a, a + n), causal_mask(a, n), a))
        a += n
    assert a == len(PROMPT)
    joined = {k: np.concatenate([o[k] for o in outs], axis=1) for k in outs[0]}
    return joined, kv_rows(kv, len(PROMPT))


@pytest.mark.parametrize("chunks", [[2] * 60, [7, 13, 50, 50], [64, 56], [3, 117]])
def test_a_prompt_in_chunks_computes_the_same_bits_as_one_forward(folder, chunks):
    """Each row's activations are quantised with its own scale and accumulated exactly, so a
    row's logits, features and KV do not depend on which rows share its forward."""
    backend = _backend(folder, "prefill")
    whole, whole_kv = _chunked(backend, [len(PROMPT)])
    parts, parts_kv = _chunked(backend, chunks)
    for name in whole:
        assert np.array_equal(whole[name], parts[name]), name
    assert all(np.array_equal(a, b) for a, b in zip(whole_kv, parts_kv))


def test_it_computes_the_model_the_target_graph_does(folder, prefill_exports):
    """Against the fp32 export of the same model: the int8 graph is another rounding of it,
    not another model (tiny random weights: int4's own top-1 agreement here is about 0.8)."""
    int8 = _backend(folder, "prefill")
    got = prefill(int8, int8.allocate_kv(MAX_LENGTH + 1), PROMPT)
    fp32 = _backend(prefill_exports["fp32"], "target")
    want = prefill(fp32, fp32.allocate_kv(MAX_LENGTH + 1), PROMPT)
    agree = (got["logits"][0].argmax(-1) == want["logits"][0].argmax(-1)).mean()
    assert agree >= 0.75
    assert np.abs(got["logits"] - want["logits"]).max() < 0.5 * np.abs(want["logits"]).max()


def test_the_graph_is_built_only_from_an_fp32_target(folder):
    m = Manifest.load(folder)
    with pytest.raises(ValueError, match="built from the fp32 target graph before quantisation; target.onnx is int4"):
        build_prefill_graph(folder, m.target)


@pytest.mark.parametrize("weights, quant, text", [
    ("int8", None, "--prefill-weights int8 needs --quant int4 (found no --quant): it adds an int8 copy"),
    ("int8", "int8", "--prefill-weights int8 needs --quant int4 (found --quant int8)"),
    ("int4", "int4", "--prefill-weights int4 is not one of none, int8"),
])
def test_the_flag_is_refused_without_an_int4_target(weights, quant, text):
    with pytest.raises(ValueError) as info:
        check_options(ExportOptions(quant=quant, prefill_weights=weights))
    assert text in str(info.value) and "\n" not in str(info.value)
    assert prefill_graph_wanted("none", None) is False and prefill_graph_wanted("int8", "int4") is True


def test_eagle_export_refuses_it_in_one_line_before_loading_anything(capsys):
    from eagle_deploy.exporter.cli import main

    assert main(["--model", "smollm2-135m", "--prefill-weights", "int8", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("eagle-export: error: --prefill-weights int8 needs --quant int4 (found no --quant)")
