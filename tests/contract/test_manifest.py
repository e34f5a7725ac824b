"""The manifest as typed, validated records: every damaged field is one ManifestError line
naming the field, the expected and the found value; a manifest of another format version is
one line saying to export again. Pure: no model, no graph (the manifest is built from the ONNX
contract)."""
from __future__ import annotations

import copy
import json

import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import (
    Dims,
    DraftEntry,
    Engines,
    GraphEntry,
    HeadRecord,
    Manifest,
    ManifestError,
    QuantRecord,
    SourceRecord,
    Sources,
    TrtRecord,
    TuningRecord,
    check_graph_io,
    io_mismatch,
)
from eagle_deploy.contract.onnx_io import TensorSpec
from eagle_deploy.contract.profiles import ProfileSpec
from eagle_deploy.contract.tree_config import TreeConfig

DIMS = Dims(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab=256, max_position_embeddings=256,
            rms_norm_eps=1e-5)


def _manifest(**changes) -> Manifest:
    t_in, t_out = c.target_io(DIMS.num_layers, "float32")
    d_in, d_out = c.draft_io("float32", 10)
    fields = dict(
        name="tiny", dims=DIMS, max_length=256,
        target=GraphEntry(path=c.TARGET_FILE, dtype="float32", inputs=t_in, outputs=t_out, sha256="ab"),
        draft=DraftEntry(path=c.DRAFT_FILE, dtype="float32", inputs=d_in, outputs=d_out, graph_top_k=10,
                         trained=True, draft_vocab_size=256, max_position_embeddings=256,
                         head=HeadRecord(kind="eagle")),
        tree=TreeConfig(total_tokens=8, depth=4, top_k=2), eos_token_ids=(0,), tokenizer=c.TOKENIZER_DIR,
        chat_template=False, sources=Sources(target=SourceRecord(spec="t", path="/t",
                                                                 sha256={"model.safetensors": "00"}),
                                             draft=SourceRecord(spec="h", path="/h")),
        tools={"onnx": "1.0"}, notes=("a note",), files={})
    fields.update(changes)
    return Manifest(**fields)


def _data(**changes) -> dict:
    return json.loads(json.dumps(_manifest(**changes).model_dump(mode="json")))


def _error(data) -> str:
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(data, "x/manifest.json")
    message = str(info.value)
    assert "\n" not in message and message.startswith("x/manifest.json ")
    return message


def test_saved_manifest_loads_back_equal_with_the_format_2_layout(tmp_path):
    m = _manifest()
    m.save(tmp_path)
    data = json.loads((tmp_path / c.MANIFEST_FILE).read_text())
    assert data["format_version"] == 2 and data["dims"]["num_layers"] == 2
    assert data["draft"]["extra"] == {"graph_top_k": 10, "draft_vocab_size": 256, "trained": True,
                                      "max_position_embeddings": 256, "head": {"kind": "eagle"}}
    assert data["target"]["extra"] == {} and "shared_weights" not in data and data["files"] == {}
    assert data["sources"]["draft"] == {"spec": "h", "path": "/h", "sha256": {}}
    assert data["target"]["inputs"][4] == {"name": "past_key_values.0.key", "dtype": "float32",
                                           "shape": ["past_seq", "batch", "kv_heads", "head_dim"]}
    assert data["tree"] == {"kind": "dynamic", "total_tokens": 8, "depth": 4, "top_k": 2, "choices": None}
    loaded = Manifest.load(tmp_path)
    assert loaded == m and loaded.draft.graph_top_k == 10 and loaded.dims.num_kv_heads == 2
    assert isinstance(loaded.tree, TreeConfig) and isinstance(loaded.target.inputs[0], TensorSpec)


def test_a_fused_target_that_repeats_one_row_queries_round_trips(tmp_path):
    """`target.extra.repeats_one_row` (contract "One-row queries"): written when true, left out
    when false, and read back; older manifests (without it) read as false."""
    t_in, t_out = c.target_io(DIMS.num_layers, "float32", c.KV_SHARED)
    target = GraphEntry(path=c.TARGET_FILE, dtype="float32", inputs=t_in, outputs=t_out, ragged_batch=True)
    d_in, d_out = c.draft_io("float32", 10, c.KV_SHARED)
    draft = _manifest().draft.replace(inputs=d_in, outputs=d_out)
    for repeats in (True, False):
        m = _manifest(target=target.replace(repeats_one_row=repeats), draft=draft)
        m.save(tmp_path)
        extra = json.loads((tmp_path / c.MANIFEST_FILE).read_text())["target"]["extra"]
        assert extra == ({"ragged_batch": True, "repeats_one_row": True} if repeats else {"ragged_batch": True})
        loaded = Manifest.load(tmp_path)
        assert loaded == m and loaded.target.repeats_one_row is repeats and loaded.draft.repeats_one_row is False


def test_a_folder_that_is_no_export_says_what_to_pass(tmp_path):
    """A missing path, eagle-export's --out (which holds exports) and any other folder."""
    with pytest.raises(ManifestError) as err:
        Manifest.load(tmp_path / "nope")
    assert str(err.value) == (f"{tmp_path / 'nope'} does not exist: pass an export folder (eagle-export prints the "
                              "one it writes), or run eagle-export first")
    for name in ("b-model", "a-model"):
        (tmp_path / "engines" / name).mkdir(parents=True)
        _manifest().save(tmp_path / "engines" / name)
    (tmp_path / "engines" / "notes").mkdir()
    with pytest.raises(ManifestError) as err:
        Manifest.load(tmp_path / "engines")
    assert str(err.value) == (f"{tmp_path / 'engines'} is not an export folder (no manifest.json) but holds exports: "
                              f"pass {tmp_path / 'engines' / 'a-model'} or {tmp_path / 'engines' / 'b-model'}")
    with pytest.raises(ManifestError) as err:
        Manifest.load(tmp_path / "engines" / "notes")
    assert str(err.value) == (f"{tmp_path / 'engines' / 'notes'} is not an export folder (no manifest.json); run "
                              "eagle-export first")


def test_json_beyond_the_parsers_limits_is_a_manifest_error(tmp_path):
    for text in ('{"format_version": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000):
        (tmp_path / c.MANIFEST_FILE).write_text(text)
        with pytest.raises(ManifestError, match=r"manifest.json is not a manifest JSON can read"):
            Manifest.load(tmp_path)


def test_records_are_frozen_and_replace_makes_a_checked_copy():
    m = _manifest()
    with pytest.raises(ValueError, match="frozen"):
        m.max_length = 3
    with pytest.raises(ValueError, match="frozen"):
        m.dims.vocab = 3
    assert m.replace(max_length=3).max_length == 3 and m.max_length == 256
    with pytest.raises(TypeError, match="Manifest has no field max_lenght"):
        m.replace(max_lenght=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        m.dims.replace(num_kv_heads=3)


@pytest.mark.parametrize("version, text", [
    (1, "x/manifest.json is format 1; this eagle-deploy reads format 2: export again with eagle-export"),
    (3, "x/manifest.json is format 3; this eagle-deploy reads format 2: export again with eagle-export"),
    (True, "x/manifest.json format_version: expected 2 (the format this eagle-deploy reads), found true; export "
           "again with eagle-export"),
    (None, "x/manifest.json format_version: expected 2 (the format this eagle-deploy reads), found nothing (the "
           "key is missing); export again with eagle-export"),
])
def test_another_format_version_says_to_export_again(version, text):
    data = _data()
    if version is None:
        del data["format_version"]
    else:
        data["format_version"] = version
    assert _error(data) == text


@pytest.mark.parametrize("key", ["max_position_embeddings", "draft_vocab_size", "trained", "head"])
def test_the_draft_record_has_no_defaults_for_older_exports(key):
    data = _data()
    del data["draft"]["extra"][key]
    assert f"draft.extra.{key}: expected " in _error(data)


def test_length_limit_is_the_smaller_of_the_target_and_head_position_limits():
    m = _manifest(max_length=128)
    assert m.length_limit == 256
    assert m.replace(draft=m.draft.replace(max_position_embeddings=200)).length_limit == 200
    assert m.replace(draft=m.draft.replace(max_position_embeddings=512)).length_limit == 256


def _rename_kv(d):
    d["target"]["inputs"][4]["name"] = "past_key_values.0.kez"


def _drop(key):
    return lambda d: d.pop(key)


def _set(path: str, value):
    def change(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if p.isdigit() else d[p]
        d[last] = value
    return change


# case -> (damage, the exact text the one-line error must contain)
DAMAGED = {
    "renamed KV input of layer 0": (_rename_kv, "target.inputs[4].name: expected 'past_key_values.0.key' "
                                                "(the ONNX I/O contract), found 'past_key_values.0.kez'"),
    "negative max_length": (_set("max_length", -3), "max_length: expected an integer >= 2, found -3"),
    "missing target": (_drop("target"),
                       "target: expected a graph entry (JSON object), found nothing (the key is missing)"),
    "changed num_layers": (_set("dims.num_layers", 3),
                           "dims.num_layers: expected 2 (target.inputs holds the KV of 2 layers), found 3"),
    "max_length as a string": (_set("max_length", "256"), "max_length: expected an integer >= 2, found '256'"),
    "max_length past the target's limit": (_set("max_length", 300),
                                           "max_length: expected at most dims.max_position_embeddings 256, found 300"),
    "max_length past the head's limit": (_set("draft.extra.max_position_embeddings", 128),
                                         "max_length: expected at most draft.extra.max_position_embeddings 128"),
    "zero hidden": (_set("dims.hidden", 0), "dims.hidden: expected an integer >= 1, found 0"),
    "boolean vocab": (_set("dims.vocab", True), "dims.vocab: expected an integer >= 1, found true"),
    "zero rms_norm_eps": (_set("dims.rms_norm_eps", 0), "dims.rms_norm_eps: expected a positive number, found 0"),
    "kv heads not dividing heads": (_set("dims.num_kv_heads", 3),
                                    "dims.num_kv_heads: expected a divisor of dims.num_heads 4, found 3"),
    "missing dims field": (lambda d: d["dims"].pop("head_dim"),
                           "dims.head_dim: expected an integer >= 1, found nothing (the key is missing)"),
    "unknown field": (_set("max_lenght", 5), "max_lenght: expected no such field"),
    "tree top_k above graph_top_k": (_set("tree.top_k", 12),
                                     "tree.top_k: expected at most draft.extra.graph_top_k 10, found 12"),
    "tree depth 0": (_set("tree.depth", 0), "tree.depth: expected an integer >= 1, found 0"),
    "unknown tree kind": (_set("tree.kind", "beam"), "tree.kind: expected one of dynamic, static, found 'beam'"),
    "graph_top_k not the graph's": (_set("draft.extra.graph_top_k", 8),
                                    "draft.extra.graph_top_k: expected 10 (the last dimension of draft.outputs "
                                    "'topk_ids'), found 8"),
    "missing graph_top_k": (lambda d: d["draft"]["extra"].pop("graph_top_k"),
                            "draft.extra.graph_top_k: expected an integer >= 1, found nothing"),
    "draft vocabulary below top-k": (_set("draft.extra.draft_vocab_size", 5),
                                     "draft.extra.draft_vocab_size: expected an integer in [graph_top_k 10, "
                                     "dims.vocab 256], found 5"),
    "graph dtype": (_set("target.dtype", "float64"),
                    "target.dtype: expected one of float32, float16, bfloat16, found 'float64'"),
    "KV dtype": (_set("target.inputs.5.dtype", "float16"),
                 "target.inputs[5].dtype: expected 'float32' (the ONNX I/O contract for 'past_key_values.0.value'), "
                 "found 'float16'"),
    "an input too many": (lambda d: d["draft"]["inputs"].append(dict(d["draft"]["inputs"][-1])),
                          "draft.inputs: expected 7 tensors (the ONNX I/O contract), found 8 tensors"),
    "graph path with a folder": (_set("draft.path", "../draft.onnx"),
                                 "draft.path: expected a file name inside the export folder, found '../draft.onnx'"),
    "negative eos id": (_set("eos_token_ids", [0, -1]),
                        "eos_token_ids[1]: expected a token id (integer >= 0), found -1"),
    "note not a string": (_set("notes", ["ok", 3]), "notes[1]: expected a string, found 3"),
    "tokenizer missing": (_drop("tokenizer"), "tokenizer: expected a non-empty string or null, found nothing"),
    "quant kind unknown": (_set("target.quant", "int2"),
                           "target.quant: expected one of int4, int8, null, found 'int2'"),
    "tool version not a string": (_set("tools.onnx", 1), "tools.onnx: expected a non-empty string, found 1"),
    "unknown engine": (_set("engines.onnx-cuda", {}), "engines.onnx-cuda: expected no such field (known: trt, tuning)"),
    "extra key beside a graph's fields": (_set("target.ragged_batch", True),
                                          "target.ragged_batch: expected no such field (known: path, dtype, inputs, "
                                          "outputs, quant, sha256, extra), found true"),
    "one-row repeat in a standard graph": (_set("target.extra.repeats_one_row", True),
                                           "repeats_one_row: expected false for a graph of KV layout 'seq_major'"),
    "eagle head with sizes": (_set("draft.extra.head", {"kind": "eagle", "hidden": 8}),
                              "draft.extra.head.hidden: expected no such field (known: kind), found 8"),
    "eagle3 head without its sizes": (_set("draft.extra.head", {"kind": "eagle3", "feature_layers": [0]}),
                                      "draft.extra.head.hidden: expected an integer >= 1, found nothing"),
    "a shape dimension that is neither": (_set("target.inputs.0.shape", ["batch", -1]),
                                          "target.inputs[0].shape[1]: expected a dimension (integer >= 0 or a "
                                          "symbol), found -1"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_manifest_is_one_line_naming_the_field(case):
    damage, text = DAMAGED[case]
    data = _data()
    damage(data)
    message = _error(data)
    assert text in message, message


def test_several_problems_name_the_first_and_count_the_rest():
    data = _data()
    data["dims"]["hidden"], data["tree"]["depth"], data["notes"] = "x", 0, [1]
    assert _error(data) == ("x/manifest.json dims.hidden: expected an integer >= 1, found 'x' (and 2 more)")


def test_standalone_engine_records_name_their_source():
    with pytest.raises(ManifestError, match=r"^tuning record chosen\.kind: expected one of dynamic, static, "
                                            r"found nothing \(the key is missing\)$"):
        TuningRecord.from_json({"date": "d", "backend": "ort", "chosen": {"total_tokens": 4, "depth": 2, "top_k": 2}})
    with pytest.raises(ManifestError, match=r"^TensorRT record \(top level\): expected a JSON object, found \[\]$"):
        TrtRecord.from_json([])


def test_load_names_the_manifest_file(tmp_path):
    data = _data(max_length=256)
    data["max_length"] = -3
    (tmp_path / c.MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"manifest\.json max_length: expected an integer >= 2, found -3$"):
        Manifest.load(tmp_path)


def test_a_static_tree_needs_its_parent_paths():
    data = _data()
    data["tree"] = {"kind": "static", "total_tokens": 3, "depth": 2, "top_k": 2, "choices": [[0], [1, 0]]}
    assert "tree: static tree path [1, 0] has no parent path [1]" in _error(data)


def _trt() -> TrtRecord:
    shapes = {c.INPUT_IDS: ((1, 1), (1, 8), (1, 64))}
    return TrtRecord(files={"target": "target.engine", "draft": "draft.engine"},
                     profiles={"target": (ProfileSpec("verify", shapes),), "draft": (ProfileSpec("step", shapes),)},
                     trt_version="10.1", timing_cache="trt_timing.cache", max_length=256, draft_capacity=270,
                     onnx_sha256={"target": "ab", "draft": None}, device="GPU")


def _tuning() -> TuningRecord:
    return TuningRecord(date="2026-01-01T00:00:00", backend="ort", chosen=TreeConfig(total_tokens=4, depth=2, top_k=2),
                        previous=TreeConfig(), chosen_measured_tokens_per_s=10.0, vanilla_tokens_per_s=5.0,
                        speedup_vs_vanilla=2.0, target_ms={"1": 2.0}, past=64)


def test_engine_records_round_trip_typed():
    m = _manifest(engines=Engines(trt=_trt(), tuning=_tuning()))
    data = json.loads(json.dumps(m.model_dump(mode="json")))
    assert data["engines"]["trt"]["profiles"]["target"][0]["shapes"][c.INPUT_IDS] == [[1, 1], [1, 8], [1, 64]]
    assert data["engines"]["tuning"]["target_ms"] == {"1": 2.0} and data["engines"]["tuning"]["chosen"]["top_k"] == 2
    loaded = Manifest.from_json(data)
    assert loaded == m
    assert loaded.engines.trt.profiles["target"][0].shapes[c.INPUT_IDS][2] == (1, 64)
    assert loaded.engines.tuning.chosen == TreeConfig(total_tokens=4, depth=2, top_k=2)


@pytest.mark.parametrize("path, value, text", [
    ("engines.trt.files", {"verify": "x.engine"}, "engines.trt.files.verify: expected a graph name (target, draft)"),
    ("engines.trt.trt_version", None, "engines.trt.trt_version: expected a non-empty string, found null"),
    ("engines.trt.profiles.target.0.shapes.input_ids", [[1, 1], [1, 8]],
     "engines.trt.profiles.target[0].shapes.input_ids: expected [min, opt, max] shapes"),
    ("engines.tuning.chosen.top_k", 11,
     "engines.tuning.chosen.top_k: expected at most draft.extra.graph_top_k 10, found 11"),
])
def test_damaged_engine_records_name_the_field(path, value, text):
    data = _data(engines=Engines(trt=_trt(), tuning=_tuning()))
    _set(path, value)(data)
    assert text in _error(data)


def test_quant_record_keeps_settings_flat():
    q = QuantRecord(kind="int4", method="nbits", quantised_matmuls=15, batch_invariant=False,
                    block_size=32, accuracy_level=4, symmetric=True)
    assert q.settings == {"block_size": 32, "accuracy_level": 4, "symmetric": True}
    t_in, t_out = c.target_io(2, "float32")
    m = _manifest(target=GraphEntry(path=c.TARGET_FILE, dtype="float32", inputs=t_in, outputs=t_out, quant="int4",
                                    quant_info=q))
    data = json.loads(json.dumps(m.model_dump(mode="json")))
    assert data["target"]["extra"]["quant"] == {"kind": "int4", "method": "nbits", "block_size": 32,
                                                "accuracy_level": 4, "symmetric": True,
                                                "tool": "onnxruntime.quantization", "quantised_matmuls": 15,
                                                "batch_invariant": False}
    assert Manifest.from_json(data) == m
    data["target"]["quant"] = "int8"
    assert "target.quant: expected 'int4' (as target.extra.quant.kind says), found 'int8'" in _error(data)


# -- manifest vs. an opened graph (pure: the graph's I/O as TensorSpecs) -----------------------


def _graph_io(num_layers: int = 2):
    """What onnxruntime reports for a target graph: fixed sizes where the exporter baked them."""
    inputs, outputs = c.target_io(num_layers, "float32")
    fixed = {"vocab": 256, "hidden": 64, "head_dim": 16}
    outputs = [TensorSpec(s.name, s.dtype, tuple(fixed.get(d, d) for d in s.shape)) for s in outputs]
    return inputs, outputs


def test_the_graph_matching_the_manifest_passes():
    m = _manifest()
    check_graph_io(m.target, "target", *_graph_io(), dims=m.dims)


def test_a_renamed_kv_input_names_layer_0_and_the_graph():
    m = _manifest()
    inputs, outputs = _graph_io()
    renamed = [TensorSpec("past_key_values.0.kez", s.dtype, s.shape) if s.name == "past_key_values.0.key" else s
               for s in m.target.inputs]
    entry = m.target.replace(inputs=renamed)
    with pytest.raises(ManifestError) as info:
        check_graph_io(entry, "target", inputs, outputs, dims=m.dims, source="e/manifest.json")
    assert str(info.value).startswith("e/manifest.json target.inputs[4]: expected input 'past_key_values.0.key' "
                                      "(graph target.onnx has it there), found 'past_key_values.0.kez'")


@pytest.mark.parametrize("change, text", [
    (lambda i, o: (i[:-2], o), "target.inputs[6]: expected no more inputs (graph target.onnx has 6), "
                               "found 'past_key_values.1.key'"),
    (lambda i, o: (i + [TensorSpec("extra", "int64", ("batch",))], o),
     "target.inputs: expected input 'extra' (graph target.onnx has 9 inputs), found only 8"),
    (lambda i, o: ([TensorSpec(s.name, "float16" if s.name.startswith("past") else s.dtype, s.shape) for s in i], o),
     "target.inputs[4].dtype: expected float16 (graph target.onnx input 'past_key_values.0.key'), found float32"),
    (lambda i, o: ([TensorSpec(s.name, s.dtype, s.shape[:3]) if s.name.startswith("past") else s for s in i], o),
     "target.inputs[4].shape: expected rank 3"),
    (lambda i, o: (i, [TensorSpec(s.name, s.dtype, (*s.shape[:2], 128)) if s.name == c.FEATURES else s for s in o]),
     "dims.hidden: expected 128 (graph target.onnx output 'features' dimension 2), found 64"),
])
def test_graph_differences_are_one_line(change, text):
    m = _manifest()
    inputs, outputs = change(*map(list, _graph_io()))
    with pytest.raises(ManifestError) as info:
        check_graph_io(m.target, "target", inputs, outputs, dims=m.dims)
    assert text in str(info.value) and "\n" not in str(info.value)


def test_io_mismatch_is_pure_and_none_when_equal():
    inputs, _ = c.target_io(1, "float32")
    assert io_mismatch(inputs, copy.deepcopy(inputs)) is None
    assert io_mismatch(inputs, inputs[:1])[0] == "[1]"


def test_runs_print_the_notes_that_bear_on_their_output():
    """A quantised draft graph changes proposals only, never a committed token: eagle-run and
    eagle-serve leave its note out (it stays in the manifest and eagle-run --json); the target's
    notes are printed."""
    from eagle_deploy.contract.manifest import DRAFT_GRAPH_NOTE

    draft_note = f"{DRAFT_GRAPH_NOTE}quantised to int8 (its proposals only)"
    m = _manifest(notes=("target quantised to int4", draft_note))
    assert m.notes == ("target quantised to int4", draft_note)
    assert m.output_notes == ("target quantised to int4",)  # a draft graph's quantisation changes no token


def test_a_draft_head_of_several_layers_round_trips_and_old_manifests_read_as_one(tmp_path):
    """`draft.extra.num_layers` (the head's decoder layers, each with its KV in the draft
    graph's I/O): written when not 1, read back; a manifest without it reads as 1 layer."""
    for layout in c.KV_LAYOUTS:
        d_in, d_out = c.draft_io("float32", 10, layout, num_layers=2)
        assert [s.name for s in d_in][-4:] == [c.past_name(0, "key"), c.past_name(0, "value"),
                                               c.past_name(1, "key"), c.past_name(1, "value")]
        draft = _manifest().draft.replace(inputs=d_in, outputs=d_out, num_layers=2,
                                          ragged_batch=layout == c.KV_SHARED)
        m = _manifest(draft=draft)
        m.save(tmp_path)
        extra = json.loads((tmp_path / c.MANIFEST_FILE).read_text())["draft"]["extra"]
        assert extra["num_layers"] == 2
        loaded = Manifest.load(tmp_path)
        assert loaded == m and loaded.draft.num_layers == 2 and loaded.draft.num_kv_layers() == 2
    old = _data()
    assert "num_layers" not in old["draft"]["extra"]  # a one-layer head: the key left out, as before
    one = Manifest.from_json(old)
    assert one.draft.num_layers == 1
    # the draft graph's dims carry the head's layer count, not the target's (DIMS: 2 layers)
    assert one.graph_dims("draft").num_layers == 1 and one.graph_dims("target").num_layers == DIMS.num_layers == 2
    assert one.graph_dims("draft").replace(num_layers=DIMS.num_layers) == one.dims


def test_a_draft_layer_count_that_contradicts_the_graphs_kv_is_one_line():
    d_in, d_out = c.draft_io("float32", 10, num_layers=2)
    two = _data(draft=_manifest().draft.replace(inputs=d_in, outputs=d_out, num_layers=2))
    del two["draft"]["extra"]["num_layers"]  # two layers of KV, the count left out
    assert "draft.extra.num_layers: expected 2 (draft.inputs holds the KV of 2 layers), found nothing" in _error(two)
    one = _data()
    one["draft"]["extra"]["num_layers"] = 3
    assert "draft.extra.num_layers: expected 1 (draft.inputs holds the KV of 1 layers), found 3" in _error(one)
    one["draft"]["extra"]["num_layers"] = 0
    assert "draft.extra.num_layers: expected an integer >= 1, found 0" in _error(one)
