"""The real `qwen2.5-coder-0.5b` alias (issue 51): its six pinned chunk packages put together give
the pinned GGUF, which is the model the alias names (qwen2, 24 layers, 896 wide, 14 / 2 heads,
vocabulary 151,936, its own LM head, ChatML with tools), and both end-of-turn ids reach the list
eagle-export writes into the manifest. Slow but cheap (reads and writes 469 MiB; the checkpoint is
the one an earlier `eagle-export --model qwen2.5-coder-0.5b` converted into the cache, about 2
minutes, which the test does not redo: docs/decisions.md 2026-12-07); skipped with the reason
(and the install line) when the packages are not installed or nothing is converted yet."""
from __future__ import annotations

import hashlib
import json

import pytest

from eagle_deploy.exporter.models import CHUNKED
from tests.helpers import converted_qwen_or_skip, qwen_pieces_missing

SPEC = CHUNKED["qwen2.5-coder-0.5b"]


@pytest.mark.slow
def test_the_chunks_assemble_to_the_pinned_qwen_gguf(tmp_path, monkeypatch):
    if missing := qwen_pieces_missing():
        pytest.skip(f"the qwen2.5-coder-0.5b chunk packages are not installed ({', '.join(missing)} missing): "
                    f"{SPEC.install_line()}")
    from eagle_deploy.exporter.chunks import assemble

    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path))
    gguf = assemble(SPEC)
    assert gguf.stat().st_size == 491_400_064
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        header = f.read(4)
        f.seek(0)
        while block := f.read(2**23):
            h.update(block)
    assert header == b"GGUF"
    assert h.hexdigest() == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "chunked"]


@pytest.mark.slow
def test_the_converted_checkpoint_is_qwen_with_both_end_of_turn_ids():
    """The converted checkpoint in the cache (what convert_gguf made of the assembled GGUF), read by
    the same function eagle-export fills manifest.eos_token_ids with."""
    from transformers import AutoConfig, AutoTokenizer

    from eagle_deploy.exporter.sources import eos_ids

    folder = converted_qwen_or_skip()
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "qwen2" and not config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (24, 896, 151_936)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(index)  # a separate LM head
    tok = AutoTokenizer.from_pretrained(folder)
    assert eos_ids(folder, config, tok) == [151645, 151643]
    assert tok.convert_ids_to_tokens([151645, 151643]) == ["<|im_end|>", "<|endoftext|>"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")
    assert "<tools>" in tok.chat_template
