"""Tiny fixture models: random-weight Llama targets (MHA and GQA), a byte-level tokenizer,
and their exports. Each builder is deterministic (fixed seeds)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
EOS_ID = 0  # the byte-level token for b"\x00", registered as the EOS special token


def tiny_config(gqa: bool = False, **overrides):
    from transformers import LlamaConfig

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2 if gqa else 4, max_position_embeddings=256, rms_norm_eps=1e-5,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    cfg.update(overrides)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    return config


def tiny_tokenizer():
    """Byte-level BPE with exactly the 256 byte symbols (no merges); id 0 is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _byte_chars())}
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": byte_to_char[EOS_ID]})
    return fast


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def build_tiny_target(folder: Path, gqa: bool = False, seed: int = 0, norm_noise: float = 0.0, **overrides) -> Path:
    """Save a random tiny Llama (weights scaled up so its greedy output is not one token
    repeated) with the byte tokenizer into `folder`. `norm_noise` > 0 draws the RMSNorm
    weights as 1 + normal(0, norm_noise) (unit weights hide a norm applied in the wrong place)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(gqa, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.06)
            elif norm_noise:
                p.normal_(1.0, norm_noise)
    folder = Path(folder)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def build_tiny_head(folder: Path, target_dir: Path, seed: int = 1, fc_bias: bool = True,
                    norm_noise: float = 0.0) -> Path:
    """A random EAGLE head for the tiny target in the published layout (`norm_noise` as for
    `build_tiny_target`, applied to the head's post-attention norm)."""
    from transformers import AutoModelForCausalLM

    from eagle_deploy.heads.api import random_head, save_head

    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    head = random_head(target, seed=seed, fc_bias=fc_bias)
    if fc_bias:
        with torch.no_grad():
            head.fc.bias.normal_(0.0, 0.05)  # non-zero so a dropped bias (silently wrong head weights) shows
    if norm_noise:
        with torch.no_grad():
            head.layers[0].post_attention_layernorm.weight.normal_(1.0, norm_noise,
                                                                   generator=torch.Generator().manual_seed(seed))
    save_head(head, folder)
    return Path(folder)


EAGLE3_GEOMETRY = dict(hidden=96, num_heads=6, num_kv_heads=3, intermediate=128)  # wider than the tiny target


def build_tiny_eagle3_head(folder: Path, target_dir: Path, seed: int = 1, layout: str = "eagle3",
                           draft_vocab: int = 128, **geometry) -> Path:
    """A random EAGLE-3 head for a tiny target in a published layout ("eagle3" or
    "speculators"): by default 96 wide (the target is 64; its own embedding), GQA 6/3, head
    dim 16 (onnxruntime's fused attention needs a multiple of 16), a reduced draft vocabulary
    of `draft_vocab` random ids including EOS, norms 1 + normal(0, 0.1)."""
    from transformers import AutoModelForCausalLM

    from eagle_deploy.heads.eagle3 import random_eagle3_head
    from eagle_deploy.heads.eagle3_checkpoint import save_eagle3_head

    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab - 1]
    ids = torch.sort(torch.unique(torch.cat([ids, torch.tensor([EOS_ID])]))).values
    ids = ids if len(ids) == draft_vocab else torch.sort(torch.cat([ids, torch.tensor([
        next(i for i in range(vocab) if i not in set(ids.tolist()))])])).values
    head = random_eagle3_head(target, seed=seed, draft_ids=ids, **{**EAGLE3_GEOMETRY, **geometry})
    save_eagle3_head(head, folder, layout=layout)
    return Path(folder)
