"""EAGLE-3 draft heads (arXiv 2503.01840) as torch modules (their config: `eagle3_config`;
their published layouts: `eagle3_checkpoint`).

Forward (paper §3.2-3.3; reference `cnets.py`): on the first draft step the three taps are
fused, h = fc([low; mid; high]) (3 x target hidden -> hidden); at later depths h is the head's
own previous output. One decoder layer whose q/k/v read [input_layernorm(embed(token_{p+1}));
hidden_norm(h)] (2 x hidden wide), with h (or, with norm_before_residual, hidden_norm(h)) as
the residual; then post-attention norm and SwiGLU MLP. Its output is fed back; the draft
distribution is lm_head(norm(output)) over the draft vocabulary, whose index i is target
token i + d2t[i].
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_deploy.contract.manifest import Dims, HeadRecord
from eagle_deploy.exporter.layers import Attention, GatedMLP, Rotary, mask_bias, rms_norm
from eagle_deploy.exporter.target import dims_of

from .eagle3_config import Eagle3Config, head_config, read_config


class _Box(nn.Module):
    """Named container so state-dict keys match the published layout."""


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head, its embedding either its own (`embed_tokens`, required when its
    width differs from the target's) or the target's (shared, not in `head_state_dict`).

    layer(h [B,S,H], input_ids [B,S] int64, position_ids [B,S] int64, attention_mask
    [B,S,P+S] bool, past_k/past_v [P,B,kvh,hd]) -> (next_features [B,S,H], present_k/v
    [S,B,kvh,hd]); `fuse(taps [B,S,taps*H_target]) -> [B,S,H]`; `logits(x) -> [..., draft_vocab]`
    float32; `draft_to_target` [draft_vocab] int64.
    """

    def __init__(self, cfg: Eagle3Config, target: nn.Module, fc_bias: bool = False, attention_bias: bool = False,
                 own_embedding: bool = False):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = cfg
        H, hd = cfg.hidden, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden, H, bias=fc_bias)
        m = self.midlayer = _Box()
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = _Box(), _Box(), _Box()
        for norm in (m.input_layernorm, m.hidden_norm, m.post_attention_layernorm):
            norm.weight = nn.Parameter(torch.ones(H))
        m.self_attn = _Box()
        m.self_attn.q_proj = nn.Linear(2 * H, q, bias=attention_bias)
        m.self_attn.k_proj = nn.Linear(2 * H, kv, bias=attention_bias)
        m.self_attn.v_proj = nn.Linear(2 * H, kv, bias=attention_bias)
        m.self_attn.o_proj = nn.Linear(q, H, bias=False)
        m.mlp = _Box()
        m.mlp.gate_proj = nn.Linear(H, cfg.intermediate, bias=False)
        m.mlp.up_proj = nn.Linear(H, cfg.intermediate, bias=False)
        m.mlp.down_proj = nn.Linear(cfg.intermediate, H, bias=False)
        self.norm = _Box()
        self.norm.weight = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, cfg.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab, dtype=torch.bool) if cfg.draft_vocab == cfg.vocab
                             else torch.zeros(cfg.vocab, dtype=torch.bool))
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab, H)
            self._shared = {}
        else:
            self._shared = {"embed": target.get_input_embeddings()}
        llama_keys = {k: v for k, v in cfg.llama.items() if k not in ("architectures", "model_type")}
        rope = LlamaRotaryEmbedding(LlamaConfig(**{**llama_keys, "num_hidden_layers": 1}))
        self.rotary = Rotary(rope.inv_freq, getattr(rope, "attention_scaling", 1.0))
        self.dims = Dims(num_layers=1, hidden=H, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=hd,
                         vocab=cfg.vocab, max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.rms_norm_eps)
        # the attention on the midlayer's projections, outside the module tree (one key per weight)
        self.__dict__["_attn"] = Attention(m.self_attn, cfg.num_heads, cfg.num_kv_heads, hd)
        self.__dict__["_mlp"] = GatedMLP(m.mlp)

    @property
    def embed(self) -> nn.Module:
        return self._shared["embed"] if "embed" in self._shared else self.embed_tokens

    @property
    def record(self) -> HeadRecord:
        return self.cfg.record

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] int64: the target id of each draft index (i + d2t[i])."""
        return torch.arange(self.cfg.draft_vocab, dtype=torch.int64, device=self.d2t.device) + self.d2t

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors under the normalised ("eagle3" layout) names."""
        return dict(self.state_dict())

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, S, n*H_target] (low, mid, high) -> [B, S, H]: the first step's input."""
        return self.fc(taps)

    def attention_input(self, h, input_ids):
        """(q/k/v input [B, S, 2H] = [input_layernorm(embed); hidden_norm(h)], residual [B, S, H])."""
        m, eps = self.midlayer, self.cfg.rms_norm_eps
        emb = rms_norm(self.embed(input_ids).to(h.dtype), m.input_layernorm.weight, eps)
        normed = rms_norm(h, m.hidden_norm.weight, eps)
        residual = normed if self.cfg.norm_before_residual else h
        return torch.cat((emb, normed), dim=-1), residual

    def layer(self, h, input_ids, position_ids, attention_mask, past_k, past_v):
        x, residual = self.attention_input(h, input_ids)
        cos, sin = self.rotary(position_ids, h.dtype)
        attn, k, v = self._attn(x, cos, sin, mask_bias(attention_mask, self.cfg.num_heads // self.cfg.num_kv_heads),
                                past_k, past_v)
        x = residual + attn
        x = x + self._mlp(rms_norm(x, self.midlayer.post_attention_layernorm.weight, self.cfg.rms_norm_eps))
        return x, k, v

    def forward(self, tapped_features, features, input_ids, position_ids, attention_mask, past_k, past_v):
        """Rows of `tapped_features` (fused by fc) then rows of `features` (the head's own)."""
        h = torch.cat((self.fuse(tapped_features), features), dim=1)
        return self.layer(h, input_ids, position_ids, attention_mask, past_k, past_v)

    def logits(self, next_features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab] float32: lm_head(norm(x))."""
        return self.lm_head(rms_norm(next_features, self.norm.weight, self.cfg.rms_norm_eps)).float()


def random_eagle3_head(target: nn.Module, seed: int = 0, draft_ids=None, **config_kw) -> Eagle3Head:
    """An untrained EAGLE-3 head (normal(0, 0.02) weights, norms 1 + normal(0, 0.1)) over
    `draft_ids` (sorted target ids; default the full vocabulary), for tests. Its own embedding
    when its width differs from the target's. config_kw: see `eagle3_config.head_config`."""
    ids = torch.arange(target.config.vocab_size) if draft_ids is None else torch.as_tensor(draft_ids).long()
    config = head_config(target.config, draft_vocab=len(ids), **config_kw)
    cfg = read_config(config, "<random>", dims_of(target.config))
    head = Eagle3Head(cfg, target, own_embedding=cfg.hidden != cfg.target_hidden)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head
