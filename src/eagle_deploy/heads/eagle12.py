"""EAGLE-1/2 draft heads as torch modules (the published layout they are read from and
written to: `eagle12_checkpoint`).

Forward (EAGLE, arXiv 2401.15077 §3): x = fc([embed(token_{p+1}); feature_p]); the head's
decoder layers in turn; the result is the predicted feature at p+1, and the target's LM head
on it (no extra norm for EAGLE-1/2) gives the next-token distribution. The layers are the
exporter's export-friendly ones (`exporter.target.DecoderLayer`), so what is trained is what
the draft graph computes.

Layers. A head has N = config.json `num_hidden_layers` decoder layers (published EAGLE-1/2
heads have one; a config without the key means one). Layer 0 has no input norm, as in EAGLE:
its input is fc's output, a fresh projection rather than a residual stream that grew through
layers, so EAGLE drops the norm there. Layers 1..N-1 take the residual stream layer 0 leaves,
so they are the target's ordinary pre-norm decoder layers, input norm included
(`layers.{i}.input_layernorm.weight` for i >= 1 in the checkpoint). No final norm follows the
last layer (the LM head reads its output, as with one layer).
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


def num_head_layers(head_config: dict) -> int:
    """The decoder layers of a head with this config.json: `num_hidden_layers`, 1 when
    missing. Raises ValueError for anything but an integer >= 1."""
    n = head_config.get("num_hidden_layers", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {n!r}")
    return n


class HeadLayer(nn.Module):
    """Parameters of one of the head's decoder layers, named as in the published checkpoints;
    `input_norm`: it has `input_layernorm` (the layers after the first)."""

    def __init__(self, dims: Dims, intermediate: int, attention_bias: bool, input_norm: bool = False):
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
        if input_norm:
            self.input_layernorm = _Proj()
            self.input_layernorm.weight = nn.Parameter(torch.ones(H))


class EagleHead(nn.Module):
    """An EAGLE-1/2 draft head bound to its target's embedding and LM head (not owned: they
    are excluded from `head_state_dict`), with `dims.num_layers` = N decoder layers
    (`num_head_layers` of its config; see the module docstring).

    forward(features [B,S,H], input_ids [B,S] int64, position_ids [B,S] int64,
    attention_mask [B,S,P+S] bool, *past (2 per layer: past_k, past_v [P,B,kvh,hd] of layer
    0, then of layer 1, ...)) -> (next_features [B,S,H], *present (2 per layer: present_k,
    present_v [S,B,kvh,hd])); features' dtype throughout. ValueError when `past` holds other
    than 2N tensors. With one layer: forward(features, input_ids, position_ids,
    attention_mask, past_k, past_v) -> (next_features, present_k, present_v).

    The constructor raises ValueError for a config whose num_hidden_layers is not an integer
    >= 1.
    """

    def __init__(self, head_config: dict, target: nn.Module, fc_bias: bool = True, attention_bias: bool = False):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = dict(head_config)
        n = num_head_layers(self.config)
        hf_cfg = LlamaConfig(**{k: v for k, v in self.config.items()
                                if k not in ("architectures", "model_type", "num_hidden_layers")}, num_hidden_layers=n)
        self.dims = dims_of(hf_cfg)
        self.intermediate = hf_cfg.intermediate_size
        self.fc = nn.Linear(2 * self.dims.hidden, self.dims.hidden, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(self.dims, self.intermediate, attention_bias, input_norm=i > 0)
                                     for i in range(n)])
        rope = LlamaRotaryEmbedding(hf_cfg)
        self.rotary = Rotary(rope.inv_freq, getattr(rope, "attention_scaling", 1.0))
        # views over self.layers' modules, kept out of the module tree so every weight has
        # exactly one state-dict key
        self.__dict__["_layers"] = [DecoderLayer(layer, self.dims, input_norm=i > 0)
                                    for i, layer in enumerate(self.layers)]
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
        """Layer 0's input: fc([embed(token_{p+1}); feature_p]), [B, S, H]."""
        emb = self.embed(input_ids).to(features.dtype)  # (B, S, H)
        return self.fc(torch.cat((emb, features), dim=-1))  # (B, S, H); embedding first

    def kv_pairs(self, past) -> list[tuple]:
        """`past` (key, value per layer, in layer order) as [(past_k, past_v)] per layer.
        ValueError when it holds other than 2N tensors."""
        n = len(self.layers)
        if len(past) != 2 * n:
            raise ValueError(f"an EAGLE head of {n} layers takes {2 * n} past KV tensors (key, value per layer), "
                             f"got {len(past)}")
        return list(zip(past[0::2], past[1::2]))

    def forward(self, features, input_ids, position_ids, attention_mask, *past):
        pairs = self.kv_pairs(past)
        x = self.fc_input(features, input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        bias = mask_bias(attention_mask, self.dims.num_heads // self.dims.num_kv_heads)  # shared by all layers
        presents = []
        for layer, (past_k, past_v) in zip(self._layers, pairs):
            x, k, v = layer(x, cos, sin, bias, past_k, past_v)
            presents += [k, v]
        return (x, *presents)

    def logits(self, next_features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32 through the target's LM head."""
        return self.lm_head(next_features).float()


def head_config_for(target_config, num_layers: int = 1, **overrides) -> dict:
    """A published-style head config.json for `target_config` with `num_layers` decoder
    layers (`num_hidden_layers`; 1, the published EAGLE-1/2 head, by default)."""
    cfg = target_config.to_dict()
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings",
        "vocab_size", "hidden_act", "bos_token_id", "eos_token_id", "attention_bias",
    )
    out = {k: cfg[k] for k in keep if k in cfg and cfg[k] is not None}
    out.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=num_layers)
    out.update(overrides)
    return out


def random_eagle12_head(target: nn.Module, seed: int = 0, fc_bias: bool = True, num_layers: int = 1) -> EagleHead:
    """An untrained head of `num_layers` decoder layers (normal(0, 0.02) weights, unit norms)
    for tests, the demo and eagle-train's start (`api.random_head`). ValueError for
    num_layers < 1."""
    head = EagleHead(head_config_for(target.config, num_layers=num_layers), target, fc_bias=fc_bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.head_state_dict().items():
            if name.endswith("layernorm.weight"):
                continue
            param = dict(head.named_parameters())[name]
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return head
