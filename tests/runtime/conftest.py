"""Fixtures for the sampling / text / API / threshold tests: the byte-level tokenizer, and a
tiny target with a 16-token vocabulary (so empirical distributions of one or two tokens
converge in a few thousand draws) exported with a random head and no EOS id."""
from __future__ import annotations

import json

import pytest
import torch

from eagle_deploy.contract import onnx_io as c
from tests import tiny
from tests.conftest import build_tiny

V16_PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="session")
def tok():
    """The byte-level tiny tokenizer (token id = byte value; id 0 is EOS)."""
    return tiny.tiny_tokenizer()


@pytest.fixture(scope="session")
def v16(tiny_root):
    """Vocab-16 tiny Llama + random EAGLE head (max_length 256). The manifest's EOS list is
    emptied so every request runs to max_new_tokens (the tokenizer is the 256-byte one, so
    prompts are token ids)."""
    model = build_tiny(tiny_root, "v16", gqa=False, seed=20, vocab_size=16)
    path = model.export_dir / c.MANIFEST_FILE
    data = json.loads(path.read_text())
    data["eos_token_ids"] = []
    path.write_text(json.dumps(data))
    assert model.manifest.dims.vocab == 16 and model.eos_ids == []
    return model


@pytest.fixture(scope="session")
def v16_logits(v16):
    """transformers' next-token logits (float64) after V16_PROMPT [16], V16_PROMPT + [a]
    [16, 16] and V16_PROMPT + [a, b] [16, 16, 16]: the exact target of two-token tests."""
    hf, P, V = v16.hf, V16_PROMPT, 16
    with torch.no_grad():
        l0 = hf(torch.tensor([P])).logits[0, -1].double().numpy()
        l1 = hf(torch.tensor([P + [a] for a in range(V)])).logits[:, -1].double().numpy()
        l2 = hf(torch.tensor([P + [a, b] for a in range(V) for b in range(V)])).logits[:, -1].double().numpy()
    return l0, l1, l2.reshape(V, V, V)


@pytest.fixture(scope="session")
def v16_eagle3(v16, tiny_root):
    """The vocab-16 tiny target with a random EAGLE-3 head instead (32 wide, its own embedding,
    taps of layers 0 and 1, a 12-token draft vocabulary mapped by d2t), no EOS id."""
    from eagle_deploy.exporter.export import ExportOptions, export
    from tests.conftest import MAX_LENGTH, TinyModel

    head = tiny.build_tiny_eagle3_head(tiny_root / "v16-eagle3-head", v16.target_dir, seed=5, draft_vocab=12,
                                       hidden=32, num_heads=2, num_kv_heads=2, intermediate=64, feature_layers=(0, 1))
    out = export(str(v16.target_dir), str(head), tiny_root / "exports",
                 ExportOptions(max_length=MAX_LENGTH, name="v16-eagle3", graph_top_k=8), progress=None)
    path = out / c.MANIFEST_FILE
    data = json.loads(path.read_text())
    data["eos_token_ids"] = []
    path.write_text(json.dumps(data))
    model = TinyModel("v16-eagle3", v16.target_dir, head, out)
    assert model.manifest.draft.head_kind == "eagle3" and model.eos_ids == []
    return model
