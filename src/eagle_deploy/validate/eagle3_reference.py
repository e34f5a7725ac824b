"""An EAGLE-3 draft forward written independently of the exporter's modules, for
`eagle-validate` and the tests: it shares only the head's weights with `exporter/eagle3.py`
and follows the reference implementation's structure (EAGLE repo `cnets.py`, arXiv
2503.01840 §3): transformers' own RoPE (`LlamaRotaryEmbedding`, `apply_rotary_pos_emb`) and
`repeat_kv`, eager attention over [past; new] keys with a -inf mask, RMSNorm and SwiGLU
written out, and the d2t offsets added to the top-k draft indices.
"""
from __future__ import annotations

import torch
from torch import nn


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Eagle3Reference(nn.Module):
    """forward(tapped_features [B,T,n*H_t], features [B,S-T,H], input_ids [B,S], position_ids
    [B,S], attention_mask [B,S,P+S] bool, logits_indices [B,N], past_k, past_v [P,B,kvh,hd])
    -> (next_features [B,S,H], topk_logprobs [B,N,K] f32, topk_ids [B,N,K] target ids,
    present_k, present_v [S,B,kvh,hd]): the EAGLE-3 draft graph's contract."""

    def __init__(self, head, top_k: int):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.head = head  # a heads.eagle3.Eagle3Head: only its weights are used
        self.top_k = top_k
        cfg = head.cfg
        llama = {k: v for k, v in cfg.llama.items() if k not in ("architectures", "model_type")}
        self.rope = LlamaRotaryEmbedding(LlamaConfig(**{**llama, "num_hidden_layers": 1}))
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab) + head.d2t)

    def forward(self, tapped_features, features, input_ids, position_ids, attention_mask, logits_indices, past_k,
                past_v):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        head, cfg = self.head, self.head.cfg
        m, eps, hd = head.midlayer, cfg.rms_norm_eps, cfg.head_dim
        hidden = torch.cat([head.fc(tapped_features), features], dim=1)  # first step fused, later steps own
        B, S, _ = hidden.shape
        normed = _rms(hidden, m.hidden_norm.weight, eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([_rms(head.embed(input_ids), m.input_layernorm.weight, eps), normed], dim=-1)
        attn = m.self_attn
        q = attn.q_proj(x).view(B, S, cfg.num_heads, hd).transpose(1, 2)
        k = attn.k_proj(x).view(B, S, cfg.num_kv_heads, hd).transpose(1, 2)
        v = attn.v_proj(x).view(B, S, cfg.num_kv_heads, hd).transpose(1, 2)
        cos, sin = self.rope(hidden, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = torch.cat([past_k.permute(1, 2, 0, 3), k], dim=2)  # (B, kvh, P + S, hd)
        values = torch.cat([past_v.permute(1, 2, 0, 3), v], dim=2)
        groups = cfg.num_heads // cfg.num_kv_heads
        scores = q @ repeat_kv(keys, groups).transpose(-1, -2) / hd ** 0.5
        scores = scores.masked_fill(~attention_mask[:, None], float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ repeat_kv(values, groups)
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(B, S, cfg.num_heads * hd))
        mlp, x = m.mlp, _rms(h, m.post_attention_layernorm.weight, eps)
        h = h + mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        picked = torch.gather(h, 1, logits_indices[..., None].expand(-1, -1, h.shape[-1]))
        logits = head.lm_head(_rms(picked, head.norm.weight, eps)).float()
        logprobs, idx = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        return h, logprobs, self.draft_ids[idx], k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
