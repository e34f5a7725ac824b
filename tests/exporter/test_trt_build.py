"""TensorRT engine build (exporter/trt_build.py): optimization profiles, build configuration,
external-data checks (paths of the external data files), shapes outside the optimization profile, and the
fp16 graph's fp32 islands (fp16 RMSNorm overflow, CPU check).

Everything here runs without TensorRT: profiles are pure Python, the build orchestration
runs against stand-in Polygraphy loaders, and the configuration is a real Polygraphy
`CreateConfig` (constructing it needs no TensorRT). Tests marked `gpu` build real engines
and skip, with the reason shown, where TensorRT or a CUDA GPU is missing.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.tree_config import TreeConfig, TreeConfigError
from eagle_deploy.exporter import trt_build as tb
from eagle_deploy.runtime.backends.trt import (
    ProfileShapeError,
    TreeProfileError,
    check_tree_fits,
    profile_order,
    select_profile,
    step_shapes,
)
from tests.helpers import gpu_skip_reason

MAX_LENGTH = 256


GPU_REASON = gpu_skip_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"TensorRT not installed / no CUDA GPU: {GPU_REASON}")


# ---------------------------------------------------------------------------------------------
# fixtures: one tiny export with external data forced, one fp16 export


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("trt-model") / "tiny")


def _export(tiny_dir, root: Path, name: str, **kw) -> Path:
    """An export of the standard-op graph (what TensorRT builds from), unless kw says otherwise."""
    from eagle_deploy.exporter.export import ExportOptions, export

    kw.setdefault("graph", "standard")
    return export(str(tiny_dir), "random", root, ExportOptions(max_length=MAX_LENGTH, name=name, **kw), progress=None)


@pytest.fixture(scope="module")
def ext_export(tiny_dir, tmp_path_factory):
    """fp32 export with external data forced (external-data paths)."""
    return _export(tiny_dir, tmp_path_factory.mktemp("trt-exports"), "ext", external_data="always")


@pytest.fixture(scope="module")
def fp16_export(tiny_dir, tmp_path_factory):
    return _export(tiny_dir, tmp_path_factory.mktemp("trt-exports16"), "fp16", dtype="fp16")


@pytest.fixture
def ext_copy(ext_export, tmp_path):
    """A private copy of the external-data export (tests that modify it)."""
    return Path(shutil.copytree(ext_export, tmp_path / "exports" / "ext"))


@pytest.fixture(scope="module")
def manifest(ext_export):
    return Manifest.load(ext_export)


def _named(profiles):
    return [(p.name, p.shapes) for p in profiles]


# ---------------------------------------------------------------------------------------------
# profiles (pure Python)


def _consistent(spec: tb.ProfileSpec):
    """min, opt and max are each self-consistent: total_seq = past_seq + seq (TensorRT checks
    each of the three against the network's shape constraints)."""
    for i in range(3):
        seq = spec.shapes[c.INPUT_IDS][i][1]
        past = spec.shapes[c.past_name(0, "key")][i][0]
        assert spec.shapes[c.ATTENTION_MASK][i] == (1, seq, past + seq), (spec.name, i)
        assert spec.shapes[c.POSITION_IDS][i] == (1, seq)
        for name, mom in spec.shapes.items():
            assert all(lo <= opt <= hi for lo, opt, hi in zip(*mom)), (spec.name, name, mom)


def test_target_profiles_cover_every_input_and_are_consistent(manifest):
    profiles = tb.target_profiles(manifest)
    assert [p.name for p in profiles] == ["prefill", "decode", "verify"]
    names = {s.name for s in manifest.target.inputs}
    kvh, hd = manifest.dims.num_kv_heads, manifest.dims.head_dim
    for p in profiles:
        assert set(p.shapes) == names
        _consistent(p)
        for i in range(3):
            assert p.shapes[c.past_name(1, "value")][i][1:] == (1, kvh, hd)  # batch 1, fixed model dims
    prefill, decode, verify = profiles
    assert prefill.shapes[c.INPUT_IDS][2] == (1, MAX_LENGTH - 1)  # any prompt up to max_length - 1
    assert prefill.shapes[c.past_name(0, "key")][0][0] == 0  # empty past
    assert decode.shapes[c.INPUT_IDS] == ((1, 1), (1, 1), (1, 1))
    # tree verification: 1..64 tokens (default cap), opt = the manifest's tree, past up to max_length - 1
    assert verify.shapes[c.INPUT_IDS] == ((1, 1), (1, manifest.tree.total_tokens), (1, 64))
    assert verify.shapes[c.LOGITS_INDICES][2] == (1, 64)
    assert verify.shapes[c.past_name(0, "key")][2][0] == MAX_LENGTH - 1


def test_profile_options(manifest):
    opts = tb.TrtBuildOptions(max_tree_tokens=32, max_prompt=100, decode_profile=False)
    prefill, verify = tb.target_profiles(manifest, opts)
    assert verify.shapes[c.INPUT_IDS][2] == (1, 32)
    assert prefill.shapes[c.INPUT_IDS][2] == (1, 100)
    assert prefill.shapes[c.past_name(0, "key")][2][0] == MAX_LENGTH - 100
    small = manifest.tree.total_tokens - 1
    with pytest.raises(ValueError, match=f"total_tokens={small + 1}.*max_tree_tokens={small}"):
        tb.target_profiles(manifest, tb.TrtBuildOptions(max_tree_tokens=small))
    with pytest.raises(ValueError, match="max_prompt"):
        tb.target_profiles(manifest, tb.TrtBuildOptions(max_prompt=MAX_LENGTH))
    with pytest.raises(ValueError, match="unknown graph"):
        tb.compute_profiles(manifest, "vision")


def test_draft_profiles(manifest):
    profiles = tb.draft_profiles(manifest)
    assert [p.name for p in profiles] == ["prefill", "step"]
    for p in profiles:
        assert set(p.shapes) == {s.name for s in manifest.draft.inputs}
        _consistent(p)
        for i in range(3):
            assert p.shapes[c.FEATURES][i] == (1, p.shapes[c.INPUT_IDS][i][1], manifest.dims.hidden)
    prefill, step = profiles
    cap = tb.draft_capacity(manifest)
    assert cap == MAX_LENGTH + 64
    assert prefill.shapes[c.INPUT_IDS][2] == (1, MAX_LENGTH - 1)  # the first extension feeds the whole prompt
    assert step.shapes[c.INPUT_IDS][2] == (1, 64)
    assert step.shapes[c.past_name(0, "key")][2][0] == cap - 1


def test_profiles_json_roundtrip(manifest):
    for p in tb.target_profiles(manifest) + tb.draft_profiles(manifest):
        data = json.loads(json.dumps(p.to_json()))
        assert tb.ProfileSpec.from_json(data) == p


def test_profile_bounds_64_nodes_length_256(manifest):
    """Shape outside the optimization profile: built for 64 tree nodes and length 256: 64
    nodes at 256 fit, 65 nodes or length 257 raise a clear error naming the input, its size
    and the bounds."""
    profiles = _named(tb.target_profiles(manifest, tb.TrtBuildOptions(max_tree_tokens=64)))
    order = profile_order(profiles)
    kv = c.kv_names(manifest.dims.num_layers)
    ok = step_shapes(64, MAX_LENGTH - 64, 64, manifest.dims, kv, draft=False)
    assert profiles[select_profile(ok, profiles, order)][0] == "verify"
    assert profiles[select_profile(step_shapes(1, 255, 1, manifest.dims, kv, False), profiles, order)][0] == "decode"
    assert profiles[select_profile(step_shapes(200, 0, 1, manifest.dims, kv, False), profiles, order)][0] == "prefill"
    with pytest.raises(ProfileShapeError) as err:
        select_profile(step_shapes(65, 100, 65, manifest.dims, kv, False), profiles, order, label="target engine")
    msg = str(err.value)
    assert "'input_ids'" in msg and "65" in msg and "[1, 64]" in msg and "target engine" in msg
    with pytest.raises(ProfileShapeError) as err:
        select_profile(step_shapes(1, 256, 1, manifest.dims, kv, False), profiles, order)
    assert "'past_key_values.0.key'" in str(err.value) and "256" in str(err.value) and "[0, 255]" in str(err.value)


def test_tree_above_profile_is_rejected(manifest):
    profiles = _named(tb.target_profiles(manifest))
    check_tree_fits(profiles, "target", TreeConfig(total_tokens=64, depth=6, top_k=8), MAX_LENGTH)
    with pytest.raises(TreeProfileError) as err:
        check_tree_fits(profiles, "target", TreeConfig(total_tokens=65, depth=6, top_k=8), MAX_LENGTH)
    assert isinstance(err.value, TreeConfigError) and "seq=65" in str(err.value)
    draft = _named(tb.draft_profiles(manifest))
    check_tree_fits(draft, "draft", TreeConfig(total_tokens=60, depth=6, top_k=10), MAX_LENGTH)
    check_tree_fits(draft, "draft", TreeConfig.static("eagle1"), MAX_LENGTH)
    with pytest.raises(TreeProfileError, match="draft expansion"):  # 10 x 8 scratch rows > 64
        check_tree_fits(draft, "draft", TreeConfig(total_tokens=60, depth=9, top_k=10), MAX_LENGTH)


# ---------------------------------------------------------------------------------------------
# build configuration and orchestration (stand-in loaders; no TensorRT)


def _fake_pg(calls: list, fake_trt=None):
    """Polygraphy-shaped stand-ins that record their arguments; the engine is some bytes."""
    from polygraphy.backend.trt import Profile

    class Rec:
        def __init__(self, kind, *args, **kwargs):
            self.kind, self.args, self.kwargs = kind, args, kwargs
            calls.append(self)

    def save(engine_bytes, path):
        Rec("SaveBytes", engine_bytes, path=path)

        def write():
            Path(path).write_bytes(b"fake-engine")
        return write

    return SimpleNamespace(
        trt=fake_trt or SimpleNamespace(__version__="10.99.fake"), Profile=Profile,
        NetworkFromOnnxPath=lambda *a, **k: Rec("NetworkFromOnnxPath", *a, **k),
        CreateConfig=lambda **k: Rec("CreateConfig", **k),
        EngineBytesFromNetwork=lambda *a, **k: Rec("EngineBytesFromNetwork", *a, **k),
        SaveBytes=save)


def test_build_config_is_strongly_typed_with_profiles_and_cache(manifest, tmp_path):
    """A real Polygraphy CreateConfig: profiles as computed, the timing cache path, and no
    precision flag (fp16/bf16/int8/fp8 all off: precision comes from the graph)."""
    from polygraphy.backend.trt import CreateConfig, Profile

    pg = SimpleNamespace(trt=SimpleNamespace(), Profile=Profile, CreateConfig=CreateConfig)
    profiles = tb.target_profiles(manifest)
    cfg = tb.build_config(pg, profiles, tmp_path / "cache", tb.TrtBuildOptions())
    assert not any((cfg.fp16, cfg.bf16, cfg.int8, cfg.fp8, cfg.tf32))
    assert cfg.timing_cache_path == str(tmp_path / "cache")
    assert len(cfg.profiles) == 3
    got = cfg.profiles[2][c.INPUT_IDS]
    assert (tuple(got.min), tuple(got.opt), tuple(got.max)) == ((1, 1), (1, manifest.tree.total_tokens), (1, 64))


def test_build_engines_from_another_cwd_with_relative_path(ext_copy, tmp_path, monkeypatch):
    """External-data paths: the export folder given relative to another working directory;
    every path handed to the loaders is absolute, the network is parsed strongly typed, the
    config carries no precision flag, engines + timing cache land beside the graphs, the
    manifest records them."""
    calls = []
    monkeypatch.setattr(tb, "_polygraphy_loaders", lambda: _fake_pg(calls))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    record = tb.build_engines(Path(os.path.relpath(ext_copy, elsewhere)),
                              options=tb.TrtBuildOptions(max_tree_tokens=32))
    nets = [r for r in calls if r.kind == "NetworkFromOnnxPath"]
    assert [Path(n.args[0]).name for n in nets] == [c.TARGET_FILE, c.DRAFT_FILE]
    for n in nets:
        assert Path(n.args[0]).is_absolute() and Path(n.args[0]).is_file() and n.kwargs == {"strongly_typed": True}
    for cfg in (r for r in calls if r.kind == "CreateConfig"):
        assert not {"fp16", "bf16", "int8", "fp8", "tf32"} & set(cfg.kwargs)
        assert Path(cfg.kwargs["load_timing_cache"]) == ext_copy.resolve() / tb.TIMING_CACHE_FILE
    for eng in (r for r in calls if r.kind == "EngineBytesFromNetwork"):
        assert Path(eng.kwargs["save_timing_cache"]) == ext_copy.resolve() / tb.TIMING_CACHE_FILE
    assert (ext_copy / "target.engine").read_bytes() == b"fake-engine" and (ext_copy / "draft.engine").is_file()
    assert not list(ext_copy.glob("*.partial"))
    m = Manifest.load(ext_copy)
    assert m.engines.trt == record and m.engines.trt.model_dump(mode="json") == json.loads(record.model_dump_json())
    assert record.files == {"target": "target.engine", "draft": "draft.engine"}
    assert record.trt_version == "10.99.fake" and record.timing_cache == tb.TIMING_CACHE_FILE
    assert [p.name for p in record.profiles["target"]] == ["prefill", "decode", "verify"]
    assert record.profiles["target"][2].shapes[c.INPUT_IDS][2] == (1, 32)


def test_build_failure_is_named_and_leaves_no_engine(ext_copy, monkeypatch):
    calls = []
    pg = _fake_pg(calls)

    def failing_save(engine_bytes, path):
        def run():
            Path(path).write_bytes(b"partial")
            raise RuntimeError("Invalid Engine. Please ensure the engine was built correctly")
        return run
    pg.SaveBytes = failing_save
    monkeypatch.setattr(tb, "_polygraphy_loaders", lambda: pg)
    with pytest.raises(tb.EngineBuildError, match="could not build target.onnx: Invalid Engine"):
        tb.build_engines(ext_copy)
    assert not list(ext_copy.glob("*.engine*")) and Manifest.load(ext_copy).engines.trt is None


def test_external_data_files_are_found(ext_export):
    """Each graph's own data file, and the shared file both take the embedding (and the full-vocabulary
    LM head) from."""
    assert sorted(p.name for p in tb.check_external_data(ext_export / c.TARGET_FILE)) == ["shared.data",
                                                                                           "target.onnx.data"]
    assert sorted(p.name for p in tb.check_external_data(ext_export / c.DRAFT_FILE)) == ["draft.onnx.data",
                                                                                          "shared.data"]


def test_moved_onnx_without_data_names_the_missing_file(ext_export, tmp_path):
    """External-data paths: a .onnx moved without its data file fails with an error naming
    that file."""
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(ext_export / c.TARGET_FILE, moved / c.TARGET_FILE)
    with pytest.raises(tb.ExternalDataError) as err:
        tb.check_external_data(moved / c.TARGET_FILE)
    assert "target.onnx.data" in str(err.value) and str(moved) in str(err.value)


def test_build_checks_external_data_before_tensorrt(ext_copy, monkeypatch):
    def no_trt():
        raise AssertionError("TensorRT must not be reached when a data file is missing")
    monkeypatch.setattr(tb, "_polygraphy_loaders", no_trt)
    (ext_copy / "draft.onnx.data").unlink()
    with pytest.raises(tb.ExternalDataError, match="draft.onnx.data"):
        tb.build_engines(ext_copy)
    (ext_copy / "target.onnx.data").write_bytes(b"\0" * 10)  # truncated
    with pytest.raises(tb.ExternalDataError, match="truncated"):
        tb.build_engines(ext_copy)
    assert Manifest.load(ext_copy).engines.trt is None


def test_missing_graph_is_named(ext_copy):
    (ext_copy / c.TARGET_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="target.onnx"):
        tb.build_engines(ext_copy)


def test_fused_export_is_refused_before_tensorrt(tiny_dir, tmp_path, monkeypatch, capsys):
    """TensorRT cannot run onnxruntime's contrib operators: an export of the fused graph (the
    fp32 default) is refused before TensorRT is reached, naming the fix; --backend trt exports
    the standard graph, and --backend trt --graph fused is refused by the CLI."""
    def no_trt():
        raise AssertionError("TensorRT must not be reached for a fused export")
    monkeypatch.setattr(tb, "_polygraphy_loaders", no_trt)
    fused = _export(tiny_dir, tmp_path / "exports", "fused", graph="auto")
    assert Manifest.load(fused).target.kv_layout == c.KV_SHARED
    with pytest.raises(ValueError, match="--backend trt"):
        tb.build_engines(fused)
    assert Manifest.load(fused).engines.trt is None
    from eagle_deploy.exporter.cli import graph_for, main

    assert graph_for("auto", "trt") == "standard" and graph_for("auto", "ort") == "auto"
    rc = main(["--model", str(tiny_dir), "--draft", "random", "--out", str(tmp_path / "cli"), "--backend", "trt",
               "--graph", "fused", "--max-length", "64"])
    assert rc == 2 and "--graph standard" in capsys.readouterr().err


@pytest.mark.skipif(GPU_REASON is None or "TensorRT not installed" not in (GPU_REASON or ""),
                    reason="TensorRT is installed; this checks the message shown without it")
def test_without_tensorrt_the_error_says_how_to_install(ext_copy, tiny_dir, tmp_path, capsys):
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        tb.build_engines(ext_copy)
    from eagle_deploy.exporter.cli import main

    rc = main(["--model", str(tiny_dir), "--draft", "random", "--out", str(tmp_path / "cli"), "--backend", "trt",
               "--max-length", "64"])
    err = capsys.readouterr().err
    assert rc == 3 and "TensorRT" in err and "exporting" not in err.lower()
    assert not (tmp_path / "cli").exists()  # refused before the ONNX export, which used to run first


# ---------------------------------------------------------------------------------------------
# fp16 RMSNorm overflow (CPU check): in the fp16 graph the RMSNorm chain and the softmax run in fp32


def _input_types(path: Path) -> tuple[list, dict]:
    import onnx
    from onnx import shape_inference

    model = shape_inference.infer_shapes(onnx.load(str(path)))
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return list(model.graph.node), types


@pytest.mark.parametrize("graph, norms, softmaxes", [(c.TARGET_FILE, 2 * 2 + 1, 2), (c.DRAFT_FILE, 1, 1)])
def test_fp16_graph_keeps_norm_and_softmax_in_fp32(fp16_export, graph, norms, softmaxes):
    from onnx import TensorProto

    assert Manifest.load(fp16_export).target.dtype == "float16"
    nodes, types = _input_types(fp16_export / graph)
    ops = {}
    for n in nodes:
        ops.setdefault(n.op_type, []).append(n)
    # rms_norm: x.float() -> Pow(2) -> ReduceMean -> Add(eps) -> Sqrt -> 1/x -> Mul, all float32
    for op, count in (("Pow", norms), ("ReduceMean", norms), ("Sqrt", norms), ("Softmax", softmaxes)):
        found = ops.get(op, [])
        assert len(found) == count, (op, len(found))
        for n in found:
            assert types[n.input[0]] == TensorProto.FLOAT, (f"{op} {n.name} runs in "
                                                            f"{TensorProto.DataType.Name(types[n.input[0]])}")
    by_output = {o: n for n in nodes for o in n.output}
    for sq in ops["Sqrt"]:  # the Sqrt's consumer (1/x or Reciprocal) is float32 too
        consumers = [n for n in nodes if sq.output[0] in n.input]
        assert consumers and all(types[i] == TensorProto.FLOAT for n in consumers for i in n.input if i in types)
    for rm in ops["ReduceMean"]:  # the square is taken of an fp32 tensor
        assert by_output[rm.input[0]].op_type == "Pow"
    # the fp16 parts really are fp16 (the test would be vacuous otherwise)
    assert any(types.get(n.input[0]) == TensorProto.FLOAT16 for n in ops["MatMul"])


# ---------------------------------------------------------------------------------------------
# GPU: real builds


@pytest.mark.gpu
@gpu
def test_gpu_build_engines_records_manifest(ext_copy, tmp_path, monkeypatch):
    """A real strongly typed build of the external-data export from another directory."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    record = tb.build_engines(Path(os.path.relpath(ext_copy, elsewhere)),
                              options=tb.TrtBuildOptions(max_tree_tokens=64))
    import tensorrt as trt

    assert record.trt_version == trt.__version__
    assert (ext_copy / "target.engine").stat().st_size > 0 and (ext_copy / tb.TIMING_CACHE_FILE).stat().st_size > 0
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine((ext_copy / "target.engine").read_bytes())
    assert engine.num_optimization_profiles == 3
    assert tuple(engine.get_tensor_profile_shape(c.INPUT_IDS, 2)[2]) == (1, 64)


@pytest.mark.gpu
@gpu
def test_gpu_fp16_build(fp16_export, tmp_path):
    """fp16 graph -> strongly typed engine on TRT 10 and 11 (no FP16 builder flag)."""
    folder = Path(shutil.copytree(fp16_export, tmp_path / "fp16"))
    tb.build_engines(folder, options=tb.TrtBuildOptions(max_tree_tokens=16))
    assert (folder / "target.engine").is_file() and (folder / "draft.engine").is_file()
    np.testing.assert_equal(Manifest.load(folder).engines.trt.strongly_typed, True)


def test_eagle3_draft_profiles_split_rows_between_taps_and_own_features(eagle3, tmp_path):
    """An EAGLE-3 draft engine (standard graph): every profile is a valid network shape at min,
    opt and max (tapped rows + own rows = seq), extensions at any past fit a profile that takes
    taps, expansions one that takes the head's own features, and the KV / features are sized
    by the head (96 wide, 3 KV heads of 16) rather than the target (64, 2 of 16)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    folder = export(str(eagle3.target_dir), str(eagle3.head_dir), tmp_path,
                    ExportOptions(max_length=MAX_LENGTH, name="e3", graph="standard"), progress=None)
    m = Manifest.load(folder)
    profiles = tb.draft_profiles(m)
    assert [p.name for p in profiles] == ["prefill", "extend", "step"]
    taps = 2 * m.dims.hidden
    for p in profiles:
        assert set(p.shapes) == {s.name for s in m.draft.inputs}
        _consistent(p)
        for i in range(3):
            seq = p.shapes[c.INPUT_IDS][i][1]
            tapped, own = p.shapes[c.TAPPED_FEATURES][i], p.shapes[c.FEATURES][i]
            assert tapped[1] + own[1] == seq and tapped[2] == taps and own[2] == 96
            assert p.shapes[c.past_name(0, "key")][i][2:] == (3, 16)
    prefill, extend, step = profiles
    assert prefill.shapes[c.FEATURES][2][1] == 0 and step.shapes[c.TAPPED_FEATURES][2][1] == 0
    assert extend.shapes[c.past_name(0, "key")][2][0] == tb.draft_capacity(m) - 1
    named = _named(profiles)
    check_tree_fits(named, "draft", m.tree, MAX_LENGTH)  # dims (with the tapped width) read from the bounds
    kv = c.kv_names(1)
    from eagle_deploy.contract.profiles import KVDims

    dims = KVDims(96, 3, 16, taps)
    ext = step_shapes(3, MAX_LENGTH - 3, 1, dims, kv, draft=True, from_target=True)
    assert select_profile(ext, named) == 1
    exp = step_shapes(4, MAX_LENGTH, 4, dims, kv, draft=True, from_target=False)
    assert select_profile(exp, named) == 2
    with pytest.raises(ProfileShapeError):  # own features where only taps are taken
        select_profile(step_shapes(300, 0, 1, dims, kv, draft=True, from_target=False), named)
