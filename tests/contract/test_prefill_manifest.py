"""The manifest's optional prefill graph (`prefill`, contract onnx_io "Prefill graph"): round
trip, left out of the JSON of exports without one (which load as before, format 2), and one
line naming the field for an entry the runtime could not run in the target's place. Pure: no
model, no graph."""
from __future__ import annotations

import json

import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import FORMAT_VERSION, Manifest, QuantRecord, SharedTensor, SharedWeights
from tests.contract.test_manifest import _error, _manifest

INFO = QuantRecord(kind="int8", method="per_token", tool="eagle_deploy.exporter.prefill", quantised_matmuls=11,
                   batch_invariant=False, weights="int8 per output column, symmetric")
EMBED = SharedTensor(role="embedding", target_name="embed.weight", draft_name="lm_weight", prefill_name="embed.weight",
                     dtype="float32", shape=(256, 64), offset=0, length=256 * 64 * 4)
SHARED = SharedWeights(file=c.SHARED_WEIGHTS_FILE, size=EMBED.length, tensors=(EMBED,), sha256="cd")


def _with_prefill(**changes) -> Manifest:
    base = _manifest()
    prefill = base.target.replace(path=c.PREFILL_FILE, quant="int8", quant_info=INFO, sha256="ef")
    return _manifest(prefill=prefill, shared_weights=SHARED, **changes)


def _data(m: Manifest) -> dict:
    return json.loads(json.dumps(m.model_dump(mode="json")))


def test_a_prefill_graph_round_trips_in_format_2(tmp_path):
    m = _with_prefill()
    m.save(tmp_path)
    data = json.loads((tmp_path / c.MANIFEST_FILE).read_text())
    assert data["format_version"] == FORMAT_VERSION == 2
    assert data["prefill"]["path"] == "prefill.onnx" and data["prefill"]["quant"] == "int8"
    assert data["prefill"]["extra"]["quant"]["method"] == "per_token"
    assert data["prefill"]["inputs"] == data["target"]["inputs"]
    assert data["shared_weights"]["tensors"][0]["prefill_name"] == "embed.weight"
    back = Manifest.load(tmp_path)
    assert back == m
    assert back.graph_names == ("target", "draft", "prefill")
    assert back.graph_dims("prefill") == back.dims
    assert back.shared_weights.tensors[0].name_in("prefill") == "embed.weight"


def test_an_export_without_one_leaves_the_keys_out_and_loads():
    m = _manifest(shared_weights=SHARED.replace(tensors=(EMBED.replace(prefill_name=None),)))
    data = _data(m)
    assert "prefill" not in data and "prefill_name" not in data["shared_weights"]["tensors"][0]
    back = Manifest.from_json(data)
    assert back.prefill is None and back.graph_names == ("target", "draft")
    assert back.shared_weights.tensors[0].name_in("prefill") is None


def _damaged(edit) -> str:
    data = _data(_with_prefill())
    edit(data)
    return _error(data)


@pytest.mark.parametrize("edit, text", [
    (lambda d: d["prefill"].update(quant="int4"), "prefill.quant: expected 'int8' (as prefill.extra.quant.kind says)"),
    (lambda d: (d["prefill"].update(quant="int4"), d["prefill"]["extra"]["quant"].update(kind="int4")),
     "prefill.quant: expected 'int8' (the prefill graph's weights)"),
    (lambda d: d["prefill"].update(path=c.TARGET_FILE), "prefill.path: expected a graph file of its own"),
    (lambda d: d["prefill"].update(path=c.SHARED_WEIGHTS_FILE), "prefill.path: expected a graph file of its own"),
    (lambda d: d["prefill"]["inputs"][0].update(name="ids"),
     "prefill.inputs[0].name: expected 'input_ids' (the ONNX I/O contract), found 'ids'"),
    (lambda d: d["prefill"]["outputs"].pop(), "prefill.outputs: expected"),
    (lambda d: d["prefill"]["extra"].update(feature_layers=[0]),
     "prefill.extra.feature_layers: expected null (the target graph's), found [0]"),
    (lambda d: d.pop("prefill"), "shared_weights.tensors[0].prefill_name: expected no such field (this export has "
                                 "no prefill graph)"),
])
def test_a_prefill_entry_the_runtime_cannot_run_is_one_line(edit, text):
    assert text in _damaged(edit)
