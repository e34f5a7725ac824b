"""eagle-validate on an export with an int8 prefill graph (tests/conftest.py prefill_exports):
by default every graph the export has is compared, the prefill graph against a reference with
its own int8 weights under the quantised rule; a weight of it that matches no checkpoint weight
fails; asking for a prefill graph an export lacks is one line."""
from __future__ import annotations

import json

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.exporter.prefill import prefill_weights
from eagle_deploy.validate import cli as v
from tests.tiny_export import copy_export


def test_every_graph_is_compared_and_the_prefill_graph_passes_against_its_own_weights(prefill_exports, tmp_path,
                                                                                       capsys):
    folder, report = prefill_exports["int4-prefill"], tmp_path / "report.json"
    assert v.main(["--engines", str(folder), "--work", str(tmp_path), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "FAIL" not in out
    data = json.loads(report.read_text())
    assert list(data["policies"]) == ["target", "draft", "prefill"]
    rows = [r for r in data["rows"] if r["graph"] == "prefill"]
    assert {r["runner"] for r in rows} == {"onnxrt"}  # no fp32-activation copy of int8 x int8 matmuls
    assert sum(r["output"] == c.LOGITS for r in rows) == 3  # prefill, decode, tree verification
    assert any(n.startswith("prefill: no fp32-activation copy") for n in data["notes"])
    assert "onnxrt-fp32act" not in data["policies"]["prefill"]
    assert data["policies"]["prefill"].startswith("top-1 agreement >= 75% where the reference's top-2 gap > 0.5, "
                                                  "mean KL <= 0.5")


def test_the_reference_weights_are_the_int8_ones_the_graph_multiplies_with(prefill_exports):
    import onnx

    folder = prefill_exports["int4-prefill"]
    weights = prefill_weights(onnx.load(str(folder / c.PREFILL_FILE), load_external_data=False), folder)
    assert len(weights) == 11
    for _, w, step in weights:
        assert w.shape == step.shape and np.all(step > 0)
        assert np.allclose(np.round(w / step), w / step, atol=1e-3)  # on the int8 grid of its column
        assert np.abs(np.round(w / step)).max() <= 127


def test_a_prefill_weight_that_matches_no_checkpoint_weight_fails(prefill_exports, tmp_path, capsys):
    import onnx
    from onnx import numpy_helper

    bad = copy_export(prefill_exports["int4-prefill"], tmp_path / "bad")
    model = onnx.load(str(bad / c.PREFILL_FILE))
    node = next(n for n in model.graph.node if n.op_type == "MatMulInteger")
    init = next(t for t in model.graph.initializer if t.name == node.input[1])
    q = numpy_helper.to_array(init).copy()
    q.reshape(-1)[:8] = -q.reshape(-1)[:8] + 40  # a few int8 values moved by many steps
    init.CopyFrom(numpy_helper.from_array(q, init.name))
    onnx.save(model, str(bad / c.PREFILL_FILE))
    rc = v.main(["--engines", str(bad), "--work", str(tmp_path / "work"), "--graphs", "prefill", "--verify", "off"])
    assert rc == 1
    out = capsys.readouterr().out
    failing = [ln for ln in out.splitlines() if ln.startswith("prefill") and "FAIL" in ln]
    assert any(node.name in ln and "matches no weight of the checkpoint" in ln for ln in failing), out


def test_a_prefill_graph_the_export_lacks_is_one_line(prefill_exports, tmp_path, capsys):
    folder = prefill_exports["fp32"]
    assert v.main(["--engines", str(folder), "--work", str(tmp_path), "--graphs", "target,prefill"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--graphs prefill: " in err and "has no such graph (it has target, draft;" in err
    assert v.main(["--engines", str(folder), "--graphs", "tagret"]) == 2
    assert "--graphs takes target, draft and/or prefill, got 'tagret'" in capsys.readouterr().err
