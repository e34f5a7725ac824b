"""TensorRT backend (runtime/backends/trt.py) and the onnxruntime CUDA backend
(runtime/backends/ort_cuda.py).

On CPU the TensorRT backend runs against `FakeEngine`: a stand-in with TensorRT's name-based
tensor API (`set_input_shape`, `set_tensor_address`, `execute_async_v3`, profile bounds)
that reads its inputs from the raw addresses the backend binds, runs the exported ONNX graph
with onnxruntime and writes its outputs to the bound addresses. So the binding logic
(KV written in place at row `past`, staging buffers, int32 bindings, profile selection,
checks before enqueue) is exercised for real; only TensorRT's kernels are not. Its token
inputs are declared int32 so that an int64 buffer passed as a raw pointer would be read as
garbage (int64 ids handed to an int32 binding). Also covered: shapes outside the optimization
profile, and past/present aliasing per backend (the same scripted loop on every backend);
on a GPU, fp16 RMSNorm overflow with large activations. `gpu`-marked tests need TensorRT and
a CUDA GPU and skip visibly elsewhere.
"""
from __future__ import annotations

import ctypes
import enum
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.tree_config import TreeConfig, TreeConfigError
from eagle_deploy.exporter import trt_build as tb
from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.backends.ort import OrtBackend
from eagle_deploy.runtime.backends.ort_cuda import OrtCudaBackend, coerce_host_array
from eagle_deploy.runtime.backends.trt import (
    ProfileShapeError,
    TreeProfileError,
    TrtBackend,
    profile_violation,
    select_profile,
)
from eagle_deploy.runtime.decode import Decoder, TokenStopper
from eagle_deploy.runtime.drafter import EagleDrafter, causal_mask
from eagle_deploy.runtime.kv import CapacityError, KVBuffer
from eagle_deploy.runtime.sampling import SamplingParams
from tests.helpers import ScriptedDrafter, gpu_skip_reason, poison

torch = pytest.importorskip("torch")

MAX_LENGTH = 256
THREADS = 1


GPU_REASON = gpu_skip_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"TensorRT not installed / no CUDA GPU: {GPU_REASON}")
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA GPU (ort-cuda needs onnxruntime-gpu and a GPU)")


# ---------------------------------------------------------------------------------------------
# a TensorRT stand-in over onnxruntime


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    INT64 = 8
    BF16 = 7


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


FAKE_TRT = SimpleNamespace(DataType=DataType, TensorIOMode=TensorIOMode, __version__="0.0.fake")
NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT32: np.int32, DataType.INT64: np.int64,
      DataType.BOOL: np.bool_}
FROM_NAME = {"float32": DataType.FLOAT, "float16": DataType.HALF, "int64": DataType.INT64, "bool": DataType.BOOL}


def _read(ptr: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).reshape(shape).copy()


class FakeEngine:
    """ICudaEngine-shaped: I/O from the graph's contract (ints listed in `int32` declared as
    INT32), profiles from `trt_build`, execution by onnxruntime on bound raw addresses."""

    def __init__(self, folder: Path, graph, dims, profiles, int32=(c.INPUT_IDS, c.POSITION_IDS)):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = THREADS
        self.session = ort.InferenceSession(str(folder / graph.path), so, providers=["CPUExecutionProvider"])
        self.graph, self.dims, self.profiles = graph, dims, profiles
        self.tensors = {}
        for spec, mode in ([(s, TensorIOMode.INPUT) for s in graph.inputs]
                           + [(s, TensorIOMode.OUTPUT) for s in graph.outputs]):
            dt = DataType.INT32 if spec.name in int32 else FROM_NAME[spec.dtype]
            self.tensors[spec.name] = (mode, dt, spec)
        self.names = list(self.tensors)
        self.enqueued = 0
        self.contexts = []

    num_io_tensors = property(lambda self: len(self.names))
    num_optimization_profiles = property(lambda self: len(self.profiles))

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return self.tensors[name][0]

    def get_tensor_dtype(self, name):
        return self.tensors[name][1]

    def get_tensor_profile_shape(self, name, p):
        return [list(s) for s in self.profiles[p].shapes[name]]

    def create_execution_context(self):
        ctx = FakeContext(self)
        self.contexts.append(ctx)
        return ctx


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

    def set_optimization_profile_async(self, p, stream):
        self.profile = p

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.profiles[self.profile].shapes[name]
        if not all(a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = int(ptr)
        return bool(ptr)

    def get_tensor_shape(self, name):
        mode, _, spec = self.engine.tensors[name]
        if mode == TensorIOMode.INPUT:
            return self.shapes[name]
        sizes = {"batch": 1, "seq": self.shapes[c.INPUT_IDS][1], "num_logits": self.shapes[c.LOGITS_INDICES][1],
                 "vocab": self.engine.dims.vocab, "hidden": self.engine.dims.hidden,
                 "kv_heads": self.engine.dims.num_kv_heads, "head_dim": self.engine.dims.head_dim}
        return tuple(d if isinstance(d, int) else sizes[d] for d in spec.shape)

    def execute_async_v3(self, stream):
        eng = self.engine
        assert set(self.addresses) == set(eng.names), "every I/O tensor needs an address"
        feeds = {}
        for name, (mode, dt, spec) in eng.tensors.items():
            if mode == TensorIOMode.INPUT:
                arr = _read(self.addresses[name], self.shapes[name], NP[dt])
                feeds[name] = arr.astype(np.int64) if dt == DataType.INT32 else arr  # the graph itself is int64
        outs = eng.session.run([n for n, t in eng.tensors.items() if t[0] == TensorIOMode.OUTPUT], feeds)
        for (name, (mode, dt, spec)), out in zip([(n, t) for n, t in eng.tensors.items()
                                                  if t[0] == TensorIOMode.OUTPUT], outs):
            out = np.ascontiguousarray(out.astype(NP[dt]))
            assert out.shape == tuple(self.get_tensor_shape(name)), name
            if out.nbytes:
                ctypes.memmove(self.addresses[name], out.ctypes.data, out.nbytes)
        eng.enqueued += 1
        return True


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tests.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("trtb-model") / "tiny", gqa=True)


@pytest.fixture(scope="module")
def export_dir(tiny_target, tmp_path_factory):
    """The standard-op graph (what TensorRT engines are built from; sequence-major KV)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    return export(str(tiny_target), "random", tmp_path_factory.mktemp("trtb-exports"),
                  ExportOptions(max_length=MAX_LENGTH, name="tiny", graph="standard"), progress=None)


@pytest.fixture(scope="module")
def fused_export_dir(tiny_target, tmp_path_factory):
    """The same target as the default fp32 graph (onnxruntime's fused operators, shared KV)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    return export(str(tiny_target), "random", tmp_path_factory.mktemp("trtb-exports-fused"),
                  ExportOptions(max_length=MAX_LENGTH, name="tiny"), progress=None)


@pytest.fixture(scope="module")
def manifest(export_dir):
    return Manifest.load(export_dir)


def fake_backend(export_dir, manifest, which="target", tree=None, options=None, align=256):
    profiles = tb.compute_profiles(manifest, which, options or tb.TrtBuildOptions(max_tree_tokens=64))
    engine = FakeEngine(export_dir, getattr(manifest, which), manifest.dims, profiles)
    backend = TrtBackend(engine, getattr(manifest, which), manifest.dims, label=f"{which} engine (fake)",
                         profile_names=[p.name for p in profiles], tree=tree or manifest.tree,
                         max_length=manifest.max_length, device="cpu", trt_module=FAKE_TRT, align=align)
    return backend, engine


def ort_backend(export_dir, manifest, which="target"):
    return OrtBackend(export_dir, getattr(manifest, which), manifest.dims, threads=THREADS)


def _prefill_inputs(tokens):
    n = len(tokens)
    return StepInputs(np.asarray(tokens, np.int64)[None], np.arange(n)[None], causal_mask(0, n), np.array([[n - 1]]))


def _step_inputs(tokens, past, logits_all=True):
    n = len(tokens)
    return StepInputs(np.asarray(tokens, np.int64)[None], np.arange(past, past + n)[None], causal_mask(past, n),
                      np.arange(n)[None] if logits_all else np.array([[n - 1]]))


def _kv_np(a) -> np.ndarray:
    return a.cpu().numpy() if isinstance(a, torch.Tensor) else a


# ---------------------------------------------------------------------------------------------
# pure checks: dtype coercion (int64 ids into an int32 binding) and profile bounds


def test_int64_into_int32_binding_is_cast_not_reinterpreted():
    ids = np.array([[5, 70000, 3]], dtype=np.int64)
    out = coerce_host_array("input_ids", ids, np.int32)
    assert out.dtype == np.int32 and out.flags.c_contiguous and out.tolist() == ids.tolist()
    with pytest.raises(TypeError, match=r"input_ids.*do not fit.*int32"):
        coerce_host_array("input_ids", np.array([[2**40]]), np.int32)
    same = np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2]
    assert coerce_host_array("x", same, np.int64).flags.c_contiguous


@pytest.mark.parametrize("arr, want", [(np.ones((1, 2, 2), np.int64), np.bool_), (np.ones(3, bool), np.int32),
                                       (np.ones(3, np.float32), np.int64), (np.ones(3, np.int64), np.float16)])
def test_cross_kind_dtypes_are_rejected(arr, want):
    with pytest.raises(TypeError, match="refusing to reinterpret"):
        coerce_host_array("t", arr, want)


def test_float_precision_casts_are_allowed():
    x = np.linspace(-2, 2, 8, dtype=np.float64)
    assert coerce_host_array("features", x, np.float16).dtype == np.float16


def test_profile_violation_message():
    bounds = {"input_ids": ((1, 1), (1, 16), (1, 64))}
    assert profile_violation({"input_ids": (1, 64)}, bounds) is None
    msg = profile_violation({"input_ids": (1, 65)}, bounds)
    assert "'input_ids'" in msg and "65" in msg and "[1, 64]" in msg and "(1, 64)" in msg
    assert "rank" in profile_violation({"input_ids": (65,)}, bounds)
    with pytest.raises(ProfileShapeError,
                       match=r"(?s)no TensorRT optimization profile.*profile 0 \(verify\).*--max-tree-tokens"):
        select_profile({"input_ids": (1, 65)}, [("verify", bounds)])


# ---------------------------------------------------------------------------------------------
# TrtBackend over the stand-in engine (CPU)


def test_trt_backend_matches_ort_and_writes_kv_in_place(export_dir, manifest):
    ref, (trt_b, engine) = ort_backend(export_dir, manifest), fake_backend(export_dir, manifest)
    kv_ref, kv = ref.allocate_kv(MAX_LENGTH), trt_b.allocate_kv(MAX_LENGTH)
    assert isinstance(kv.arrays[0], torch.Tensor) and kv.arrays[0].dtype == torch.float32
    poison(kv, 0)  # nothing may read rows that were never written
    prompt = [7, 100, 3, 45, 9, 200, 17]
    out = trt_b.run(_prefill_inputs(prompt), kv, 0)  # empty past through the same binding path
    exp = ref.run(_prefill_inputs(prompt), kv_ref, 0)
    for name in (c.LOGITS, c.FEATURES):
        np.testing.assert_allclose(out.named()[name], exp.named()[name], rtol=1e-5, atol=1e-5)
    past = len(prompt)
    tree = [12, 250, 31, 4]
    out, exp = trt_b.run(_step_inputs(tree, past), kv, past), ref.run(_step_inputs(tree, past), kv_ref, past)
    np.testing.assert_allclose(out.logits, exp.logits, rtol=1e-5, atol=1e-5)
    assert np.isfinite(out.logits).all()
    for a, b in zip(kv.arrays, kv_ref.arrays):
        got = _kv_np(a)
        np.testing.assert_allclose(got[: past + 4], b[: past + 4], rtol=1e-5, atol=1e-6)
        assert np.isnan(got[past + 4:]).all()  # rows beyond the call untouched
    assert engine.enqueued == 2


def test_unaligned_present_rows_go_through_scratch(export_dir, manifest):
    """TensorRT wants 256-byte aligned addresses; a KV row of the GQA tiny model is 128 bytes,
    so every other `past` lands in scratch and is copied into place: same results as binding
    the rows directly (align=1) and as onnxruntime."""
    assert manifest.dims.num_kv_heads * manifest.dims.head_dim * 4 % 256 != 0
    prompt = [11, 22, 33, 44, 55]
    runs = []
    for align in (256, 1):
        backend, _ = fake_backend(export_dir, manifest, align=align)
        runs.append((_decode(backend, ScriptedDrafter(lambda committed: [[1, 2], [3]]), prompt, n=12), backend))
    (direct_run, direct), (scratch_run, scratch) = runs[1], runs[0]
    assert scratch_run == direct_run
    assert scratch.scratch_presents > 0 and direct.scratch_presents == 0
    ref = _decode(ort_backend(export_dir, manifest), ScriptedDrafter(lambda committed: [[1, 2], [3]]), prompt, n=12)
    assert ref == scratch_run


def test_profiles_are_chosen_per_call(export_dir, manifest):
    trt_b, engine = fake_backend(export_dir, manifest)
    kv = trt_b.allocate_kv(MAX_LENGTH)
    trt_b.run(_prefill_inputs(list(range(1, 101))), kv, 0)  # 100 tokens > 64: prefill profile
    trt_b.run(_step_inputs([5], 100), kv, 100)  # decode profile
    trt_b.run(_step_inputs([5, 6, 7], 101), kv, 101)  # verify profile
    trt_b.run(_step_inputs([8], 104), kv, 104)  # decode again: its context is reused
    names = [p.name for p in engine.profiles]
    assert [names[ctx.profile] for ctx in engine.contexts] == ["prefill", "decode", "verify"]


def test_out_of_profile_raises_before_enqueue(export_dir, manifest):
    """Shape outside the optimization profile: 64 tree nodes at total length 256 run; 65
    nodes, or length 257, raise a clear error naming input, size and bounds before anything
    is enqueued."""
    trt_b, engine = fake_backend(export_dir, manifest)
    kv = trt_b.allocate_kv(MAX_LENGTH)
    trt_b.run(_step_inputs(list(range(64)), MAX_LENGTH - 64), kv, MAX_LENGTH - 64)
    assert engine.enqueued == 1
    with pytest.raises(ProfileShapeError) as err:
        trt_b.run(_step_inputs(list(range(65)), 100), kv, 100)
    assert "'input_ids'" in str(err.value) and "65" in str(err.value) and "[1, 64]" in str(err.value)
    big = KVBuffer(kv.names, [torch.zeros((MAX_LENGTH + 8,) + tuple(a.shape[1:])) for a in kv.arrays])
    with pytest.raises(ProfileShapeError) as err:
        trt_b.run(_step_inputs([1], MAX_LENGTH), big, MAX_LENGTH)  # total length 257
    assert "past_key_values.0.key" in str(err.value) and "256" in str(err.value) and "[0, 255]" in str(err.value)
    with pytest.raises(CapacityError):  # within the profile but past the buffer: still before enqueue
        trt_b.run(_step_inputs([1, 2], 250), trt_b.allocate_kv(251), 250)
    assert engine.enqueued == 1


def test_tree_above_profile_fails_at_startup(export_dir, manifest):
    with pytest.raises(TreeProfileError) as err:
        fake_backend(export_dir, manifest, tree=TreeConfig(total_tokens=65, depth=5, top_k=4))
    assert isinstance(err.value, TreeConfigError) and "seq=65" in str(err.value)
    with pytest.raises(TreeProfileError, match="draft expansion"):
        fake_backend(export_dir, manifest, "draft", tree=TreeConfig(total_tokens=60, depth=9, top_k=10))
    trt_b, _ = fake_backend(export_dir, manifest)
    with pytest.raises(ProfileShapeError, match="KV buffer of 300 rows"):
        trt_b.allocate_kv(300)


def test_wrong_kv_buffers_are_rejected(export_dir, manifest):
    trt_b, engine = fake_backend(export_dir, manifest)
    host_kv = ort_backend(export_dir, manifest).allocate_kv(MAX_LENGTH)
    with pytest.raises(TypeError, match="not a torch tensor"):
        trt_b.run(_prefill_inputs([1, 2, 3]), host_kv, 0)
    half = KVBuffer(host_kv.names, [torch.zeros(a.shape, dtype=torch.float16) for a in host_kv.arrays])
    with pytest.raises(TypeError, match="float16"):
        trt_b.run(_prefill_inputs([1, 2, 3]), half, 0)
    assert engine.enqueued == 0


def test_int64_mask_is_rejected_not_reinterpreted(export_dir, manifest):
    trt_b, engine = fake_backend(export_dir, manifest)
    kv = trt_b.allocate_kv(MAX_LENGTH)
    bad = _prefill_inputs([1, 2, 3])
    bad.attention_mask = bad.attention_mask.astype(np.int64)
    with pytest.raises(TypeError, match="attention_mask"):
        trt_b.run(bad, kv, 0)
    assert engine.enqueued == 0


def _script_from(reference: list[int], prompt_len: int):
    """Scripted drafter (past/present aliasing per backend): the reference continuation for
    3 tokens, then a wrong branch."""
    def script(committed):
        done = len(committed) - prompt_len
        good = reference[done: done + 3]
        wrong = [(t + 1) % 256 for t in reference[done - 1: done + 1]]
        return [good, wrong] if good else [wrong]
    return script


def _decode(target, drafter, prompt, n=24, vanilla=False):
    dec = Decoder(target, drafter, MAX_LENGTH)
    chunks = list(dec.decode(prompt, n, SamplingParams(), TokenStopper(()), vanilla=vanilla))
    return [t for ch in chunks for t in ch], chunks


def test_scripted_loop_same_tokens_as_ort(export_dir, manifest):
    """Past/present aliasing per backend, on CPU: the same 6+ round loop with a scripted
    drafter on ORT-CPU and on the TensorRT backend (stand-in engine) commits identical tokens
    per round."""
    prompt = [65, 32, 119, 111, 114, 108, 100, 10]
    ref, _ = _decode(ort_backend(export_dir, manifest), None, prompt, vanilla=True)
    drafted = [_decode(b, ScriptedDrafter(_script_from(ref, len(prompt))), prompt)
               for b in (ort_backend(export_dir, manifest), fake_backend(export_dir, manifest)[0])]
    (tokens_ort, chunks_ort), (tokens_trt, chunks_trt) = drafted
    assert tokens_ort == tokens_trt == ref
    assert chunks_ort == chunks_trt and len(chunks_trt) >= 7 and max(map(len, chunks_trt)) > 1


def test_eagle_drafter_on_trt_matches_ort(export_dir, manifest):
    """Target and draft engines both on the TensorRT backend: same tokens and per-round
    acceptance as onnxruntime (draft prefill, extension and expansion profiles)."""
    tree = manifest.tree
    top_k = manifest.draft.graph_top_k
    prompt = list(range(30, 30 + 70))  # 70 > 64: the draft's first extension needs its prefill profile
    runs = []
    for make in (lambda w: ort_backend(export_dir, manifest, w), lambda w: fake_backend(export_dir, manifest, w)[0]):
        drafter = EagleDrafter(make("draft"), tree, MAX_LENGTH, top_k)
        runs.append(_decode(make("target"), drafter, prompt, n=20))
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------
# ort-cuda backend: the same IO binding on torch buffers, on onnxruntime's CPU provider here


@pytest.fixture(params=["standard", "fused"])
def any_export(request, export_dir):
    """(folder, manifest) of the standard-op export and of the fused one (KV layouts
    seq_major and shared)."""
    folder = export_dir if request.param == "standard" else request.getfixturevalue("fused_export_dir")
    manifest = Manifest.load(folder)
    assert manifest.target.kv_layout == (c.KV_SEQ_MAJOR if request.param == "standard" else c.KV_SHARED)
    return folder, manifest


def test_ort_torch_binding_matches_ort(any_export):
    export_dir, manifest = any_export
    ref = ort_backend(export_dir, manifest)
    dev = OrtCudaBackend(export_dir, manifest.target, manifest.dims, device="cpu", threads=THREADS)
    kv_ref, kv = ref.allocate_kv(MAX_LENGTH), dev.allocate_kv(MAX_LENGTH)
    poison(kv, 0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for past, tokens in ((0, prompt), (8, [5, 3, 5])):
        inputs = _prefill_inputs(tokens) if past == 0 else _step_inputs(tokens, past)
        out, exp = dev.run(inputs, kv, past), ref.run(inputs, kv_ref, past)
        np.testing.assert_array_equal(out.logits, exp.logits)
        np.testing.assert_array_equal(out.features, exp.features)
    for i in range(len(kv.arrays)):
        np.testing.assert_array_equal(_kv_np(kv.rows(i))[:11], kv_ref.rows(i)[:11])
        assert np.isnan(_kv_np(kv.rows(i))[11:]).all()
    with pytest.raises(TypeError, match="not a torch tensor"):
        dev.run(_prefill_inputs([1]), kv_ref, 0)


def test_ort_torch_binding_decode_loop(any_export):
    export_dir, manifest = any_export
    tree = manifest.tree
    prompt = [9, 8, 7, 6, 5]
    runs = []
    for make in (lambda w: ort_backend(export_dir, manifest, w),
                 lambda w: OrtCudaBackend(export_dir, getattr(manifest, w), manifest.dims, device="cpu",
                                          threads=THREADS)):
        drafter = EagleDrafter(make("draft"), tree, MAX_LENGTH, manifest.draft.graph_top_k)
        runs.append(_decode(make("target"), drafter, prompt, n=16))
    assert runs[0] == runs[1]


def test_load_backend_dispatch_without_gpu(export_dir, manifest):
    from eagle_deploy.runtime.backends import load_backend

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            load_backend("ort-cuda", export_dir, manifest, "target")
    with pytest.raises((FileNotFoundError, ImportError), match="TensorRT|trt_build"):
        load_backend("trt", export_dir, manifest, "target")


# ---------------------------------------------------------------------------------------------
# GPU: real engines


@pytest.fixture(scope="module")
def trt_export(export_dir, tmp_path_factory):
    if GPU_REASON is not None:
        pytest.skip(f"TensorRT not installed / no CUDA GPU: {GPU_REASON}")
    folder = Path(shutil.copytree(export_dir, tmp_path_factory.mktemp("trt-gpu") / "tiny"))
    tb.build_engines(folder, options=tb.TrtBuildOptions(max_tree_tokens=64))
    return folder


@pytest.mark.gpu
@gpu
def test_gpu_scripted_loop_trt_equals_ort_cpu(trt_export):
    """Past/present aliasing per backend: the same scripted-drafter loop on ORT-CPU and
    TensorRT: identical argmax per step."""
    m = Manifest.load(trt_export)
    prompt = [65, 32, 119, 111, 114, 108, 100, 10]
    ref, _ = _decode(ort_backend(trt_export, m), None, prompt, vanilla=True)
    script = _script_from(ref, len(prompt))
    ort_run = _decode(ort_backend(trt_export, m), ScriptedDrafter(script), prompt)
    trt_run = _decode(TrtBackend.from_manifest(trt_export, m, "target"), ScriptedDrafter(script), prompt)
    assert trt_run == ort_run


@pytest.mark.gpu
@gpu
def test_gpu_trt_logits_match_ort_and_kv_in_place(trt_export):
    m = Manifest.load(trt_export)
    ref, trt_b = ort_backend(trt_export, m), TrtBackend.from_manifest(trt_export, m, "target")
    kv_ref, kv = ref.allocate_kv(MAX_LENGTH), trt_b.allocate_kv(MAX_LENGTH)
    poison(kv, 0)
    prompt = [7, 100, 3, 45, 9, 200, 17]
    for past, inputs in ((0, _prefill_inputs(prompt)), (7, _step_inputs([12, 250, 31, 4], 7))):
        out, exp = trt_b.run(inputs, kv, past), ref.run(inputs, kv_ref, past)
        assert np.isfinite(out.logits).all()
        np.testing.assert_array_equal(out.logits.argmax(-1), exp.logits.argmax(-1))
        np.testing.assert_allclose(out.logits, exp.logits, rtol=2e-2, atol=2e-3)
    assert np.isnan(_kv_np(kv.arrays[0])[11:]).all()


@pytest.mark.gpu
@gpu
def test_gpu_out_of_profile_real_engine(trt_export):
    m = Manifest.load(trt_export)
    trt_b = TrtBackend.from_manifest(trt_export, m, "target")
    kv = trt_b.allocate_kv(MAX_LENGTH)
    trt_b.run(_step_inputs(list(range(64)), MAX_LENGTH - 64), kv, MAX_LENGTH - 64)
    with pytest.raises(ProfileShapeError, match="input_ids"):
        trt_b.run(_step_inputs(list(range(65)), 100), kv, 100)
    with pytest.raises(TreeProfileError):
        TrtBackend.from_manifest(trt_export, m, "target", tree=TreeConfig(total_tokens=65, depth=5, top_k=4))


@pytest.mark.gpu
@gpu
def test_gpu_eagle_runtime_trt_equals_ort(trt_export):
    from eagle_deploy.runtime.api import EagleRuntime

    prompt = [5, 6, 7, 8, 9]
    outs = [EagleRuntime.load(trt_export, backend=b).generate(prompt, max_new_tokens=32).token_ids
            for b in ("ort", "trt")]
    assert outs[0] == outs[1]


@pytest.mark.gpu
@gpu
def test_gpu_fp16_engine_large_activations(tmp_path):
    """fp16 RMSNorm overflow: activations ~300 per element: the fp16 engine's logits are
    finite and their argmax equals the fp32 graph's."""
    from eagle_deploy.exporter.export import ExportOptions, export
    from tests.tiny import build_tiny_target

    model = build_tiny_target(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model))
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(300.0 / hf.model.embed_tokens.weight.abs().mean())
    hf.save_pretrained(model)
    fp32 = export(str(model), "random", tmp_path / "e", ExportOptions(max_length=MAX_LENGTH, name="fp32"),
                  progress=None)
    fp16 = export(str(model), "random", tmp_path / "e", ExportOptions(max_length=MAX_LENGTH, name="fp16", dtype="fp16"),
                  progress=None)
    tb.build_engines(fp16, options=tb.TrtBuildOptions(max_tree_tokens=16))
    m32, m16 = Manifest.load(fp32), Manifest.load(fp16)
    ref, trt_b = ort_backend(fp32, m32), TrtBackend.from_manifest(fp16, m16, "target")
    prompt = list(range(40, 72))
    exp = ref.run(_step_inputs(prompt, 0), ref.allocate_kv(MAX_LENGTH), 0)
    out = trt_b.run(_step_inputs(prompt, 0), trt_b.allocate_kv(MAX_LENGTH), 0)
    assert np.isfinite(out.logits).all()
    assert (out.logits.argmax(-1) == exp.logits.argmax(-1)).mean() >= 0.95


@pytest.mark.gpu
@cuda
def test_gpu_ort_cuda_equals_ort_cpu(export_dir, manifest):
    ref = ort_backend(export_dir, manifest)
    try:
        dev = OrtCudaBackend(export_dir, manifest.target, manifest.dims)
    except RuntimeError as err:
        pytest.skip(f"onnxruntime-gpu not installed: {err}")
    kv_ref, kv = ref.allocate_kv(MAX_LENGTH), dev.allocate_kv(MAX_LENGTH)
    for past, inputs in ((0, _prefill_inputs([3, 1, 4, 1, 5])), (5, _step_inputs([9, 2, 6], 5))):
        out, exp = dev.run(inputs, kv, past), ref.run(inputs, kv_ref, past)
        np.testing.assert_allclose(out.logits, exp.logits, rtol=1e-3, atol=1e-4)
    for a, b in zip(kv.arrays, kv_ref.arrays):
        np.testing.assert_allclose(_kv_np(a)[:8], b[:8], rtol=1e-3, atol=1e-4)
