"""The exported draft graph and draft-head loading (draft-head weights silently wrong):
non-zero fc.bias, shared embedding/LM head bit for bit, bias-free heads, and bad checkpoints
refused by the CLI."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.heads.api import load_head
from eagle_deploy.heads.files import HeadCheckpointError
from eagle_deploy.validate.torch_backend import TorchBackend
from tests import tiny
from tests.helpers import causal_mask, kv_rows, run_step

ATOL = 1e-4


@pytest.fixture(scope="module", params=["mha", "gqa", "gqa_standard"])
def model(request):
    """Both tiny targets as the default fp32 graph (fused operators, shared KV), and the GQA one
    as the standard-op graph (sequence-major KV)."""
    return request.getfixturevalue(request.param)


def _draft_steps(hidden: int, seed: int = 0):
    """Two draft calls: 6 causal rows from an empty past, then a 4-node tree (0->1, 0->2->3)
    over those 6 rows. Yields (tokens, positions, mask, past, features)."""
    rng = np.random.default_rng(seed)
    feats = rng.normal(0, 1, size=(10, hidden)).astype(np.float32)
    yield rng.integers(0, 256, 6), np.arange(6), causal_mask(0, 6), 0, feats[:6]
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    mask = np.ones((1, 4, 10), dtype=bool)
    mask[0, :, 6:] = tree
    yield rng.integers(0, 256, 4), np.array([6, 7, 7, 8]), mask, 6, feats[6:]


def _compare_backends(a, b, hidden: int, top_k: int):
    kv_a, kv_b = a.allocate_kv(16), b.allocate_kv(16)
    for tokens, pos, mask, past, feats in _draft_steps(hidden):
        out_a = run_step(a, kv_a, tokens, pos, mask, past, features=feats)
        out_b = run_step(b, kv_b, tokens, pos, mask, past, features=feats)
        np.testing.assert_allclose(out_a[c.NEXT_FEATURES], out_b[c.NEXT_FEATURES], rtol=0, atol=ATOL)
        np.testing.assert_allclose(out_a[c.TOPK_LOGPROBS], out_b[c.TOPK_LOGPROBS], rtol=0, atol=ATOL)
        np.testing.assert_array_equal(out_a[c.TOPK_IDS], out_b[c.TOPK_IDS])
        assert out_a[c.TOPK_IDS].shape[-1] == top_k
        n = past + len(tokens)
        for x, y in zip(kv_rows(kv_a, n), kv_rows(kv_b, n)):  # either KV layout, sequence-major
            np.testing.assert_allclose(x, y, rtol=0, atol=ATOL)


def test_head_fixture_has_nonzero_fc_bias(model):
    head = model.head()
    assert head.fc.bias is not None and float(head.fc.bias.detach().abs().max()) > 0.01


def test_draft_onnx_equals_torch_reference_head(model):
    """Draft-head weights silently wrong: a head with non-zero fc.bias: the draft ONNX equals
    TorchBackend.draft (1e-4) on next features, top-k log-probs/ids and the KV it writes."""
    top_k = model.manifest.draft.graph_top_k
    ref = TorchBackend.draft(model.head(), top_k=top_k)
    _compare_backends(model.backend("draft"), ref, model.manifest.dims.hidden, top_k)


def _hf_eagle_head(head_dir: Path, hf):
    """An independent EAGLE-1/2 head from the raw checkpoint on transformers' own
    LlamaDecoderLayer: fc over [embed; feature], layer 0 with its input norm removed, then any
    later layers as they are, then the target's LM head (no code shared with the exporter)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg_dict = json.loads((head_dir / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    state = load_file(str(head_dir / "model.safetensors"))
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = LlamaDecoderLayer(cfg, i).eval()
        own = {k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        missing, unexpected = layer.load_state_dict(own, strict=False)
        assert missing == (["input_layernorm.weight"] if i == 0 else []) and unexpected == []
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layers.append(layer)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in state)
    fc.load_state_dict({k[3:]: v for k, v in state.items() if k.startswith("fc.")})
    rope = LlamaRotaryEmbedding(cfg)

    def forward(features, tokens, positions):
        with torch.no_grad():
            x = fc(torch.cat((hf.model.embed_tokens(tokens), features), dim=-1))
            S = x.shape[1]
            bias = torch.triu(torch.full((S, S), float("-inf")), 1)[None, None]
            for layer in layers:
                x = layer(x, attention_mask=bias, position_ids=positions, position_embeddings=rope(x, positions))
                x = x[0] if isinstance(x, tuple) else x
            return x, torch.log_softmax(hf.lm_head(x).float(), -1)

    return forward


def test_draft_onnx_equals_independent_hf_layer_head(model):
    """Draft-head weights silently wrong, checked without sharing code with the exporter: the
    same head rebuilt from the raw safetensors on transformers' LlamaDecoderLayer (bias
    included) matches the draft ONNX."""
    forward = _hf_eagle_head(model.head_dir, model.hf)
    be = model.backend("draft")
    kv = be.allocate_kv(16)
    tokens, pos, mask, past, feats = next(_draft_steps(model.manifest.dims.hidden, seed=3))
    out = run_step(be, kv, tokens, pos, mask, past, features=feats)
    y, logp = forward(torch.from_numpy(feats)[None], torch.from_numpy(np.asarray(tokens))[None],
                      torch.from_numpy(pos)[None])
    np.testing.assert_allclose(out[c.NEXT_FEATURES][0], y[0].numpy(), rtol=0, atol=ATOL)
    k = out[c.TOPK_IDS].shape[-1]
    want_lp, want_ids = torch.topk(logp[0], k, dim=-1)
    np.testing.assert_array_equal(out[c.TOPK_IDS][0], want_ids.numpy())
    np.testing.assert_allclose(out[c.TOPK_LOGPROBS][0], want_lp.numpy(), rtol=0, atol=ATOL)


def _initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _find(inits: dict, shape) -> list[np.ndarray]:
    return [v for v in inits.values() if v.shape == tuple(shape)]


def test_shared_embedding_and_lm_head_are_the_targets_bit_for_bit(model):
    V, H = model.manifest.dims.vocab, model.manifest.dims.hidden
    embed = model.hf.model.embed_tokens.weight.detach().numpy()
    lm = model.hf.lm_head.weight.detach().numpy()
    assert not np.array_equal(embed, lm)  # untied fixture: a swap would show
    for which in ("draft", "target"):
        inits = _initializers(model.export_dir / getattr(model.manifest, which).path)
        embeds = _find(inits, (V, H))
        heads = [w.T for w in _find(inits, (H, V))] + [w for w in embeds if not np.array_equal(w, embed)]
        assert len(embeds) >= 1 and any(w.tobytes() == embed.tobytes() for w in embeds), which
        assert len(heads) == 1 and heads[0].tobytes() == lm.tobytes(), which


def test_fc_bias_initializer_is_the_checkpoints(model):
    from safetensors.numpy import load_file

    bias = load_file(str(model.head_dir / "model.safetensors"))["fc.bias"]
    inits = _initializers(model.export_dir / c.DRAFT_FILE)
    assert any(v.shape == bias.shape and v.tobytes() == bias.tobytes() for v in inits.values())


def test_head_without_fc_bias_loads_exports_and_matches(mha, tmp_path):
    """Llama-3-style heads carry no fc.bias: they load, export, and the draft ONNX equals the
    torch reference."""
    from eagle_deploy.exporter.export import ExportOptions, export
    from eagle_deploy.runtime.backends.ort import OrtBackend

    head_dir = tiny.build_tiny_head(tmp_path / "head", mha.target_dir, seed=5, fc_bias=False)
    from safetensors.numpy import load_file

    assert "fc.bias" not in load_file(str(head_dir / "model.safetensors"))
    head = load_head(head_dir, mha.hf)
    assert head.fc.bias is None
    out = export(str(mha.target_dir), str(head_dir), tmp_path / "out", ExportOptions(max_length=64, draft_quant="none"),
                 progress=None)
    manifest = Manifest.load(out)
    assert manifest.draft.trained is True
    ort = OrtBackend(out, manifest.draft, manifest.dims, threads=1)
    _compare_backends(ort, TorchBackend.draft(head, top_k=manifest.draft.graph_top_k), manifest.dims.hidden,
                      manifest.draft.graph_top_k)


# ---------------------------------------------------------------- bad heads refused


def _broken_head(src, dst, change):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    change(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


BROKEN = {
    "missing fc.weight": (lambda s: s.pop("fc.weight"), ["fc.weight", "missing"]),
    "missing down_proj": (lambda s: s.pop("layers.0.mlp.down_proj.weight"), ["layers.0.mlp.down_proj.weight"]),
    "misshaped fc.weight": (lambda s: s.update({"fc.weight": torch.zeros(64, 64)}),
                            ["fc.weight", "[64, 64]", "[64, 128]"]),
    "misshaped fc.bias": (lambda s: s.update({"fc.bias": torch.zeros(65)}), ["fc.bias", "[65]"]),
    "unexpected tensor": (lambda s: s.update({"layers.1.mlp.up_proj.weight": torch.zeros(2, 2)}),
                          ["layers.1.mlp.up_proj.weight"]),
    "int8 weights": (lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int8)}), ["fc.weight", "int8"]),
    "NaN weights": (lambda s: s["layers.0.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")),
                    ["layers.0.mlp.up_proj.weight", "NaN"]),
}

# head config.json edits -> words the one error line must contain
BROKEN_CONFIG = {
    "a list": (lambda cfg: [], ["JSON object", "list"]),
    "null": (lambda cfg: None, ["JSON object", "NoneType"]),
    "zero heads": (lambda cfg: {**cfg, "num_attention_heads": 0}, ["num_attention_heads", "target has"]),
    "other head count": (lambda cfg: {**cfg, "num_attention_heads": 2}, ["num_attention_heads", "target has"]),
    "other hidden size": (lambda cfg: {**cfg, "hidden_size": 32}, ["hidden_size", "target has"]),
    "gelu": (lambda cfg: {**cfg, "hidden_act": "nonsense"}, ["hidden_act", "'nonsense'"]),
    "text rope_theta": (lambda cfg: {**cfg, "rope_theta": "abc"}, ["rope_theta", "'abc'"]),
    "zero intermediate": (lambda cfg: {**cfg, "intermediate_size": 0}, ["intermediate_size"]),
}


@pytest.mark.parametrize("case", list(BROKEN_CONFIG))
def test_bad_head_config_is_one_clear_error_and_writes_nothing(mha, tmp_path, capsys, case):
    from eagle_deploy.exporter.cli import main

    head = tmp_path / "head"
    shutil.copytree(mha.head_dir, head)
    change, words = BROKEN_CONFIG[case]
    (head / "config.json").write_text(json.dumps(change(json.loads((head / "config.json").read_text()))))
    with pytest.raises(HeadCheckpointError):
        load_head(head, mha.hf)
    out_root = tmp_path / "engines"
    rc = main(["--model", str(mha.target_dir), "--draft", str(head), "--out", str(out_root), "--max-length", "64"])
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert rc == 2 and len(error_lines) == 1 and all(w in error_lines[0] for w in words), err
    assert not out_root.exists() or list(out_root.iterdir()) == []


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_head_fails_export_naming_the_tensor_and_writes_nothing(mha, tmp_path, capsys, case):
    from eagle_deploy.exporter.cli import main

    change, words = BROKEN[case]
    head = _broken_head(mha.head_dir, tmp_path / "head", change)
    with pytest.raises(HeadCheckpointError):
        load_head(head, mha.hf)
    out_root = tmp_path / "engines"
    rc = main(["--model", str(mha.target_dir), "--draft", str(head), "--out", str(out_root), "--max-length", "64"])
    err = capsys.readouterr().err
    assert rc != 0
    error_lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert len(error_lines) == 1 and all(w in error_lines[0] for w in words), err
    assert "Traceback" not in err
    assert not out_root.exists() or list(out_root.iterdir()) == []


@pytest.mark.slow  # several seconds of child processes: in `make test`, not `make test-fast`
def test_missing_fc_weight_cli_process_exits_nonzero(mha, tmp_path):
    """The installed `eagle-export` entry point, in its own process."""
    import subprocess
    import sys

    head = _broken_head(mha.head_dir, tmp_path / "head", lambda s: s.pop("fc.weight"))
    out_root = tmp_path / "engines"
    proc = subprocess.run([sys.executable, "-m", "eagle_deploy.exporter.cli", "--model", str(mha.target_dir),
                           "--draft", str(head), "--out", str(out_root), "--max-length", "64"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "'fc.weight'" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert not out_root.exists() or list(out_root.iterdir()) == []


def test_published_head_with_embedding_copy_and_bin_format_loads(mha, tmp_path):
    """Published heads may carry their own `embed_tokens.weight` (ignored: the target's is
    shared) and may be a `pytorch_model.bin`; both load to the same weights."""
    from safetensors.torch import load_file

    state = load_file(str(mha.head_dir / "model.safetensors"))
    folder = tmp_path / "bin-head"
    folder.mkdir()
    shutil.copy(mha.head_dir / "config.json", folder / "config.json")
    torch.save({**state, "embed_tokens.weight": torch.zeros(256, 64)}, folder / "pytorch_model.bin")
    head = load_head(folder, mha.hf)
    for key, value in head.head_state_dict().items():
        assert torch.equal(value, state[key]), key
    assert head.embed is mha.hf.get_input_embeddings() and head.lm_head is mha.hf.get_output_embeddings()


@pytest.mark.parametrize("bad", ["1", "257"])
def test_max_length_outside_the_model_is_refused(mha, tmp_path, capsys, bad):
    from eagle_deploy.exporter.cli import main

    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(tmp_path / "e"),
               "--max-length", bad])
    err = capsys.readouterr().err
    assert rc == 2 and f"--max-length {bad} must be in [2, 256]" in err
    assert not (tmp_path / "e").exists()


def test_manifest_records_the_export(model):
    m = model.manifest
    assert m.max_length == 256 and list(m.eos_token_ids) == [tiny.EOS_ID]
    assert m.dims.num_kv_heads == (2 if model.name.startswith("gqa") else 4) and m.dims.vocab == 256
    assert m.draft.trained is True and m.draft.graph_top_k == 10
    assert m.draft.max_position_embeddings == 256 and m.draft.draft_vocab_size == 256  # the head's own limit
    from eagle_deploy.contract.verify import sha256_file

    assert m.target.sha256 == sha256_file(model.export_dir / c.TARGET_FILE)
    assert m.draft.sha256 == sha256_file(model.export_dir / c.DRAFT_FILE)
    assert m.sources.draft.sha256["model.safetensors"] == sha256_file(model.head_dir / "model.safetensors")


def test_reduced_draft_vocabulary_maps_ids_back_and_stays_lossless(mha, tmp_path):
    """--draft-vocab N: the head proposes only the N most frequent tokens (EOS always kept),
    top-k ids come back in the full vocabulary, and greedy EAGLE still equals the reference."""
    from eagle_deploy.exporter.export import ExportOptions, export
    from eagle_deploy.heads.files import TOKEN_COUNTS_FILE
    from eagle_deploy.runtime.backends.ort import OrtBackend
    from tests.conftest import PROMPTS

    head_dir = Path(shutil.copytree(mha.head_dir, tmp_path / "head"))
    counts = np.random.default_rng(0).integers(0, 1000, 256).astype(np.int64)
    counts[0] = 0  # EOS: kept although it was never seen
    np.save(head_dir / TOKEN_COUNTS_FILE, counts)
    out = export(str(mha.target_dir), str(head_dir), tmp_path / "out",
                 ExportOptions(max_length=128, draft_vocab=64, draft_quant="none"), progress=None)
    manifest = Manifest.load(out)
    assert manifest.draft.draft_vocab_size == 64
    allowed = set(np.argsort(-counts, kind="stable")[:63].tolist()) | {0}
    be = OrtBackend(out, manifest.draft, manifest.dims, threads=1)
    kv = be.allocate_kv(16)
    tokens, pos, mask, past, feats = next(_draft_steps(manifest.dims.hidden, seed=4))
    got = run_step(be, kv, tokens, pos, mask, past, features=feats)
    assert set(got[c.TOPK_IDS].ravel().tolist()) <= allowed
    # equal to the full head's distribution renormalised over the allowed ids
    ref = TorchBackend.draft(mha.head(), top_k=256)
    full = run_step(ref, ref.allocate_kv(16), tokens, pos, mask, past, features=feats)
    for row in range(len(tokens)):
        lp = dict(zip(full[c.TOPK_IDS][0, row].tolist(), full[c.TOPK_LOGPROBS][0, row].tolist()))
        sub = np.array([lp[i] for i in sorted(allowed)])
        norm = np.log(np.exp(sub - sub.max()).sum()) + sub.max()
        want = sorted(((lp[i] - norm, i) for i in allowed), reverse=True)[:10]
        np.testing.assert_allclose(got[c.TOPK_LOGPROBS][0, row], [w[0] for w in want], rtol=0, atol=ATOL)
        assert set(got[c.TOPK_IDS][0, row].tolist()) == {w[1] for w in want}
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(out, threads=1)
    for prompt in PROMPTS:
        assert rt.generate(prompt, max_new_tokens=40).token_ids == mha.expected(prompt, 40)
