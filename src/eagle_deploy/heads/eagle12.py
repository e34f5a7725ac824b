"""EAGLE-1/2 draft heads as torch modules (the published layout they are read from and
written to: `eagle12_checkpoint`).

Forward (EAGLE, arXiv 2401.15077 §3): x = fc([embed(token_{p+1}); feature_p]); one decoder
layer with no input norm; the result is the predicted feature at p+1, and the target's LM
head on it (no extra norm for EAGLE-1/2) gives the next-token distribution. The layer is the
exporter's export-friendly one (`exporter.target.DecoderLayer`), so what is trained is what
the draft graph computes.
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_deploy.contract.manifest import Dims
from eagle_deploy.exporter.layers import Rotary, mask_bias
from eagle_deploy.exporter.target import DecoderLayer, dims_of


class _Proj(nn.Module):
    """Named container so state-dict keys match the published layout."""


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


class HeadLayer(nn.Module):
    """Parameters of the head's decoder layer, named as in the published checkpoints."""

    def __init__(self, dims: Dims, intermediate: int, attention_bias: bool):
        super().__init__()
        H, q, kv = dims.hidden, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        self.self_attn = _Proj()
        self.self_attn.q_proj = _linear(H, q, attention_bias)
        self.self_attn.k_proj = _linear(H, kv, attention_bias)
        self.self_attn.v_proj = _linear(H, kv, attention_bias)
        self.self_attn.o_proj = _linear(q, H, False)
        self.mlp = _Proj()
        self.mlp.gate_proj = _linear(H, intermediate, False)
        self.mlp.up_proj = _linear(H, intermediate, False)
        self.mlp.down_proj = _linear(intermediate, H, False)
        self.post_attention_layernorm = _Proj()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(H))


class EagleHead(nn.Module):
    """An EAGLE-1/2 draft head bound to its target's embedding and LM head (not owned: they
    are excluded from `head_state_dict`).

    forward(features [B,S,H], input_ids [B,S] int64, position_ids [B,S] int64,
    attention_mask [B,S,P+S] bool, past_k/past_v [P,B,kvh,hd]) ->
    (next_features [B,S,H], present_k [S,B,kvh,hd], present_v [S,B,kvh,hd]).
    """

    def __init__(self, head_config: dict, target: nn.Module, fc_bias: bool = True, attention_bias: bool = False):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = dict(head_config)
        hf_cfg = LlamaConfig(**{k: v for k, v in self.config.items() if k not in ("architectures", "model_type")})
        self.dims = dims_of(hf_cfg)
        self.intermediate = hf_cfg.intermediate_size
        self.fc = nn.Linear(2 * self.dims.hidden, self.dims.hidden, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(self.dims, self.intermediate, attention_bias)])
        rope = LlamaRotaryEmbedding(hf_cfg)
        self.rotary = Rotary(rope.inv_freq, getattr(rope, "attention_scaling", 1.0))
        # a view over self.layers[0]'s modules, kept out of the module tree so every weight
        # has exactly one state-dict key
        self.__dict__["_layer"] = DecoderLayer(self.layers[0], self.dims, input_norm=False)
        # shared with the target, not part of the head's own weights
        self._shared = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}

    @property
    def embed(self) -> nn.Module:
        return self._shared["embed"]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared["lm_head"]

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors under the published key names."""
        return dict(self.state_dict())

    def fc_input(self, features, input_ids):
        """The decoder layer's input: fc([embed(token_{p+1}); feature_p]), [B, S, H]."""
        emb = self.embed(input_ids).to(features.dtype)  # (B, S, H)
        return self.fc(torch.cat((emb, features), dim=-1))  # (B, S, H); embedding first

    def forward(self, features, input_ids, position_ids, attention_mask, past_k, past_v):
        x = self.fc_input(features, input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        return self._layer(x, cos, sin, mask_bias(attention_mask, self.dims.num_heads // self.dims.num_kv_heads),
                           past_k, past_v)

    def logits(self, next_features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32 through the target's LM head."""
        return self.lm_head(next_features).float()


def head_config_for(target_config, **overrides) -> dict:
    """A published-style head config.json for `target_config` (one decoder layer)."""
    cfg = target_config.to_dict()
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings",
        "vocab_size", "hidden_act", "bos_token_id", "eos_token_id", "attention_bias",
    )
    out = {k: cfg[k] for k in keep if k in cfg and cfg[k] is not None}
    out.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    out.update(overrides)
    return out


def random_eagle12_head(target: nn.Module, seed: int = 0, fc_bias: bool = True) -> EagleHead:
    """An untrained head (normal(0, 0.02) weights, unit norm) for tests and the demo
    (`api.random_head`)."""
    head = EagleHead(head_config_for(target.config), target, fc_bias=fc_bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.head_state_dict().items():
            if name.endswith("layernorm.weight"):
                continue
            param = dict(head.named_parameters())[name]
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return head
