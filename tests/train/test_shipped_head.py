"""The trained SmolLM2 head shipped in src/eagle_deploy/data/heads/smollm2-135m (slow: real export)."""
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


def test_shipped_head_is_in_the_published_layout():
    folder = SHIPPED_HEADS / "smollm2-135m"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "MODEL_CARD.md", "token_counts.npy"} <= names
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "fc.bias" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any("input_layernorm" in k or k.startswith(("embed_tokens", "lm_head")) for k in keys)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1


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
