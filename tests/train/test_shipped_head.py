"""The trained heads shipped in src/eagle_deploy/data/heads/ (SmolLM2-135M's, Qwen2.5-Coder-0.5B's;
the τ checks are slow: real exports)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_deploy.exporter.models import SHIPPED_HEADS

PROMPTS = [  # fixed, not in the training prompts
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in three sentences.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]


@pytest.mark.parametrize("name, max_mib, dims", [
    ("smollm2-135m", 20, (576, 9, 3)),  # hidden, query heads, KV heads of the target
    ("qwen2.5-coder-0.5b", 40, (896, 14, 2)),
])
def test_shipped_head_is_in_the_published_layout(name, max_mib, dims):
    """Each alias's shipped head: the published EAGLE-1/2 files and tensors, the target's
    geometry in config.json (the exporter refuses any other), a card, and the response-token
    counts over the target's vocabulary that its alias's draft vocabulary is picked from."""
    from safetensors import safe_open

    from eagle_deploy.exporter.models import ALIASES

    folder = SHIPPED_HEADS / name
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "MODEL_CARD.md", "token_counts.npy"} <= names
    assert (folder / "model.safetensors").stat().st_size <= max_mib * 2**20
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        fc = f.get_slice("fc.weight").get_shape()
    assert "fc.bias" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any("input_layernorm" in k or k.startswith(("embed_tokens", "lm_head")) for k in keys)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == dims
    assert fc == [dims[0], 2 * dims[0]]
    counts = np.load(folder / "token_counts.npy")
    assert counts.shape == (config["vocab_size"],) and counts.sum() > 0
    alias = ALIASES[name]
    assert alias.draft == f"shipped:{name}" and 0 < alias.draft_vocab < config["vocab_size"]
    assert (counts > 0).sum() >= alias.draft_vocab  # every draft-vocabulary id was seen in training


@pytest.mark.slow
def test_shipped_head_accepts_well_above_a_random_head(smollm2_export):
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(smollm2_export, threads=2, drafter_kind="eagle", planned=False)  # the head's tau
    assert rt.manifest.draft.trained and rt.manifest.draft.draft_vocab_size < rt.manifest.dims.vocab
    taus = []
    for prompt in PROMPTS:
        r = rt.generate(prompt, max_new_tokens=64)
        assert r.token_ids == rt.generate(prompt, max_new_tokens=64, mode="vanilla").token_ids
        taus.append(r.stats.mean_accept_len)
    assert np.mean(taus) >= 1.8, taus  # a random head stays near 1.0


QWEN_PROMPTS = [  # fixed, not in the training prompts
    "Write a Python function that merges two sorted lists into one sorted list.",
    "def count_vowels(s: str) -> int:\n    \"\"\"Return how many vowels s holds.\"\"\"\n",
]


@pytest.mark.slow
def test_qwen_head_accepts_above_a_random_head(tmp_path):
    """The alias's int4 export drafts with the shipped head (about 1 minute; needs the converted
    checkpoint in the cache, as tests/exporter/test_qwen.py): greedy EAGLE equals vanilla, and the
    head alone, over the int4 default tree 2 / 1 / 1, accepts well above a random head (τ ~1.0;
    this head 1.5 on HumanEval)."""
    from eagle_deploy.exporter.cli import main as export_main
    from eagle_deploy.runtime.api import EagleRuntime
    from tests.helpers import converted_qwen_or_skip

    converted_qwen_or_skip()
    assert export_main(["--model", "qwen2.5-coder-0.5b", "--quant", "int4", "--out", str(tmp_path)]) == 0
    rt = EagleRuntime.load(tmp_path / "qwen2.5-coder-0.5b", threads=2, drafter_kind="eagle", planned=False)
    assert rt.manifest.draft.trained and rt.manifest.draft.draft_vocab_size == 16384
    taus = []
    for prompt in QWEN_PROMPTS:
        r = rt.generate(prompt, max_new_tokens=64)
        assert r.token_ids == rt.generate(prompt, max_new_tokens=64, mode="vanilla").token_ids
        taus.append(r.stats.mean_accept_len)
    assert np.mean(taus) >= 1.3, taus
