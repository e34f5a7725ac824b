"""EAGLE-1/2 heads of more than one decoder layer (config.json num_hidden_layers N): the
checkpoint round trip, the draft graph of both KV layouts against the torch head and against
transformers' own decoder layers, the manifest's draft layer count, and greedy EAGLE decoding
equal to vanilla with such a head."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.heads.api import load_head, random_head, save_head
from eagle_deploy.heads.files import HeadCheckpointError
from eagle_deploy.validate.torch_backend import TorchBackend
from tests.conftest import HEAD_TREE, MAX_LENGTH, PROMPTS, THREADS
from tests.exporter.test_draft_graph import _compare_backends, _draft_steps, _hf_eagle_head
from tests.helpers import run_step

LAYERS = 2
ATOL = 1e-4


def _two_layer_head(folder: Path, hf, seed: int = 21) -> Path:
    """A random 2-layer head with a non-zero fc.bias and norms 1 + normal(0, 0.1) (a norm
    dropped or applied in the wrong place shows), in the published layout."""
    head = random_head(hf, seed=seed, num_layers=LAYERS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fc.bias.normal_(0.0, 0.05, generator=gen)
        for name, p in head.named_parameters():
            if name.endswith("layernorm.weight"):
                p.normal_(1.0, 0.1, generator=gen)
    save_head(head, folder)
    return folder


@pytest.fixture(scope="module")
def deep(gqa, tmp_path_factory):
    """The GQA tiny target with a 2-layer head, exported as the fused graph (shared KV) and
    the standard-op graph (sequence-major KV): {"head_dir", "fused", "standard"}."""
    from eagle_deploy.exporter.export import ExportOptions, export

    root = tmp_path_factory.mktemp("head-layers")
    head_dir = _two_layer_head(root / "head", gqa.hf)
    out = {"head_dir": head_dir}
    for graph in ("fused", "standard"):
        out[graph] = export(str(gqa.target_dir), str(head_dir), root / "exports",
                            ExportOptions(max_length=MAX_LENGTH, name=f"deep-{graph}", graph=graph, draft_quant="none"),
                            progress=None)
    return out


def test_a_two_layer_head_round_trips_through_its_checkpoint(gqa, deep, tmp_path):
    from safetensors.torch import load_file

    config = json.loads((deep["head_dir"] / "config.json").read_text())
    assert config["num_hidden_layers"] == LAYERS
    state = load_file(str(deep["head_dir"] / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in state and "layers.0.input_layernorm.weight" not in state
    head = load_head(deep["head_dir"], gqa.hf)
    assert head.dims.num_layers == LAYERS and len(head.layers) == LAYERS
    assert set(head.head_state_dict()) == set(state)
    for key, value in head.head_state_dict().items():
        assert torch.equal(value, state[key]), key
    save_head(head, tmp_path / "again")  # written again: the same tensors and config
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(state) and all(torch.equal(again[k], v) for k, v in state.items())
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


def test_a_checkpoint_that_disagrees_with_its_layer_count_is_refused(gqa, deep, tmp_path):
    import shutil

    folder = Path(shutil.copytree(deep["head_dir"], tmp_path / "one"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(HeadCheckpointError, match=r"unexpected tensors .*layers\.1\..*num_hidden_layers 1"):
        load_head(folder, gqa.hf)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(HeadCheckpointError, match="missing tensor 'layers.2.input_layernorm.weight'"):
        load_head(folder, gqa.hf)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    with pytest.raises(HeadCheckpointError, match="num_hidden_layers must be a positive integer, got 0"):
        load_head(folder, gqa.hf)


@pytest.mark.parametrize("graph, layout", [("fused", c.KV_SHARED), ("standard", c.KV_SEQ_MAJOR)])
def test_the_manifest_and_graph_carry_the_kv_of_every_head_layer(deep, graph, layout):
    m = Manifest.load(deep[graph])
    assert m.draft.num_layers == LAYERS and m.draft.num_kv_layers() == LAYERS and m.draft.kv_layout == layout
    inputs, outputs = c.draft_io("float32", m.draft.graph_top_k, layout, num_layers=LAYERS)
    assert list(m.draft.inputs) == inputs and list(m.draft.outputs) == outputs
    assert [s.name for s in outputs][-4:] == ["present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    extra = json.loads((deep[graph] / c.MANIFEST_FILE).read_text())["draft"]["extra"]
    assert extra["num_layers"] == LAYERS and extra["head"] == {"kind": "eagle"}


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_the_draft_onnx_equals_the_torch_head(gqa, deep, graph):
    """Next features, top-k log-probs and ids, and the KV rows of both layers, over a causal
    call and a tree call."""
    from eagle_deploy.runtime.backends.ort import OrtBackend

    m = Manifest.load(deep[graph])
    ort = OrtBackend(deep[graph], m.draft, m.graph_dims("draft"), threads=THREADS)
    assert len(ort.allocate_kv(4).arrays) == 2 * LAYERS
    ref = TorchBackend.draft(load_head(deep["head_dir"], gqa.hf), top_k=m.draft.graph_top_k)
    _compare_backends(ort, ref, m.dims.hidden, m.draft.graph_top_k)


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_the_draft_onnx_equals_transformers_decoder_layers(gqa, deep, graph):
    from eagle_deploy.runtime.backends.ort import OrtBackend

    m = Manifest.load(deep[graph])
    be = OrtBackend(deep[graph], m.draft, m.graph_dims("draft"), threads=THREADS)
    tokens, pos, mask, past, feats = next(_draft_steps(m.dims.hidden, seed=5))
    out = run_step(be, be.allocate_kv(16), tokens, pos, mask, past, features=feats)
    y, logp = _hf_eagle_head(deep["head_dir"], gqa.hf)(torch.from_numpy(feats)[None],
                                                       torch.from_numpy(np.asarray(tokens))[None],
                                                       torch.from_numpy(pos)[None])
    np.testing.assert_allclose(out[c.NEXT_FEATURES][0], y[0].numpy(), rtol=0, atol=ATOL)
    want_lp, want_ids = torch.topk(logp[0], out[c.TOPK_IDS].shape[-1], dim=-1)
    np.testing.assert_array_equal(out[c.TOPK_IDS][0], want_ids.numpy())
    np.testing.assert_allclose(out[c.TOPK_LOGPROBS][0], want_lp.numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_greedy_eagle_with_a_two_layer_head_equals_vanilla_and_transformers(gqa, deep, graph):
    """The head's own tree every round (HEAD_TREE), and the commands' default drafter (the
    planned hybrid of head and context lookup)."""
    from eagle_deploy.runtime.api import EagleRuntime

    n = 48
    for options in (HEAD_TREE, {}):
        rt = EagleRuntime.load(deep[graph], **{"threads": THREADS, **options})
        for prompt in PROMPTS:
            eagle = rt.generate(prompt, max_new_tokens=n)
            vanilla = rt.generate(prompt, max_new_tokens=n, mode="vanilla")
            want = gqa.expected(prompt, n)
            assert vanilla.token_ids == want and eagle.token_ids == want, (options, prompt)
        if options is HEAD_TREE:
            assert eagle.stats.draft_forwards > 0


def test_eagle_validate_passes_on_a_two_layer_export(deep, tmp_path, capsys):
    from eagle_deploy.validate import cli as v

    assert v.main(["--engines", str(deep["fused"]), "--work", str(tmp_path), "--graphs", "draft"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "draft expand d2" in out
