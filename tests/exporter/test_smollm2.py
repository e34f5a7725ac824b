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

    rt = EagleRuntime.load(folder, threads=2)
    assert rt.manifest.dims.num_layers == 30 and rt.manifest.dims.vocab == 49152
    assert rt.manifest.max_length == 2048 and rt.manifest.chat_template
    # one copy of the embedding (49152 x 576 fp32), in shared.data; the draft graph keeps only the head's own
    # layer and its 8192 LM-head rows
    shared = rt.manifest.shared_weights
    assert [(t.role, t.shape) for t in shared.tensors] == [("embedding", (49152, 576))]
    assert (folder / "draft.onnx").stat().st_size < 40 * 2**20 < (folder / "shared.data").stat().st_size
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
