"""An export-friendly forward for Llama-family decoders that reuses a transformers model's
weights (it never traces transformers' own attention, mask or cache code).

Supported families are listed in `FAMILIES`; anything else is refused with
`UnsupportedModelError` naming them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle_deploy.contract.manifest import Dims
from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED, kv_names

from .fused import FusedDecoderLayer, as_float32, fused_inputs, gather_rows, rotary_rows, skip_rms_norm
from .layers import STATIC_ROPE_TYPES, Attention, GatedMLP, Rotary, gather_positions, mask_bias, rms_norm


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration cannot be exported."""


@dataclass(frozen=True)
class Family:
    """A supported decoder family: its transformers architecture name and what it may carry."""

    architecture: str
    model_type: str
    attention_bias: bool  # whether q/k/v projections may have a bias


FAMILIES = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", "llama", attention_bias=True),
        Family("MistralForCausalLM", "mistral", attention_bias=False),
        Family("Qwen2ForCausalLM", "qwen2", attention_bias=True),
    )
}


def supported_families() -> str:
    return ", ".join(FAMILIES)


def check_family(config) -> Family:
    """Return the Family of a transformers config, or raise UnsupportedModelError."""
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None and not archs:  # e.g. a GGUF-converted config names only its model_type
        arch = next((f.architecture for f in FAMILIES.values() if f.model_type == getattr(config, "model_type", None)),
                    None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or getattr(config, 'model_type', '?')} is not supported; "
            f"supported families: {supported_families()}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (SwiGLU/silu only)")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", arch == "MistralForCausalLM"):
        raise UnsupportedModelError(f"sliding-window attention (window {window}) is not supported")
    return FAMILIES[arch]


def dims_of(config) -> Dims:
    heads = config.num_attention_heads
    return Dims(
        num_layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=float(config.rms_norm_eps),
    )


def rotary_of(hf_model: nn.Module) -> Rotary:
    """The checkpoint's RoPE (inverse frequencies and scaling) as transformers computed it."""
    rope = hf_model.model.rotary_emb
    rope_type = getattr(rope, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    return Rotary(rope.inv_freq, getattr(rope, "attention_scaling", 1.0))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; `input_norm` is None for the EAGLE head's single layer."""

    def __init__(self, hf_layer: nn.Module, dims: Dims, input_norm: bool = True):
        super().__init__()
        self.attn = Attention(hf_layer.self_attn, dims.num_heads, dims.num_kv_heads, dims.head_dim)
        self.mlp = GatedMLP(hf_layer.mlp)
        self.input_norm = hf_layer.input_layernorm.weight if input_norm else None
        self.post_norm = hf_layer.post_attention_layernorm.weight
        self.eps = dims.rms_norm_eps

    def forward(self, x, cos, sin, bias, past_k, past_v):
        """x [B, S, H] -> (x [B, S, H], present_k, present_v [S, B, kvh, hd])."""
        h = x if self.input_norm is None else rms_norm(x, self.input_norm, self.eps)
        attn, k, v = self.attn(h, cos, sin, bias, past_k, past_v)
        x = x + attn
        x = x + self.mlp(rms_norm(x, self.post_norm, self.eps))
        return x, k, v


class ExportableTarget(nn.Module):
    """Target forward following the contract in `contract.py` (target graph).

    forward(input_ids [B,S] int64, position_ids [B,S] int64, attention_mask [B,S,P+S] bool,
    logits_indices [B,N] int64, *past (2 per layer, [P,B,kvh,hd])) ->
    (logits [B,N,V] float32, features [B,S,H], *present (2 per layer, [S,B,kvh,hd])).

    kv_layout "shared" (contract KV_SHARED): the fused graph (exporter/fused.py); past and
    present are then [B,kvh,C,hd] buffers of any capacity C >= P+S, present = past with rows
    [P, P+S) written (a copy when run eagerly, in place in onnxruntime).

    feature_layers (an EAGLE-3 export): also return `tapped_features` [B,S,n*H] after
    `features`, the hidden states entering those decoder layers, concatenated in order
    (contract "EAGLE-3 exports"); None: no such output.

    repeat_one_row (kv_layout "shared" only, else ValueError): a one-token call's attention
    runs as two rows, the second a repeat of the first one position on, writing one more KV
    row at P + 1 (exporter/fused.py, "One-row queries"); outputs keep S rows.
    """

    def __init__(self, hf_model: nn.Module, kv_layout: str = KV_SEQ_MAJOR, feature_layers=None,
                 repeat_one_row: bool = False):
        super().__init__()
        check_family(hf_model.config)
        if repeat_one_row and kv_layout != KV_SHARED:
            raise ValueError(f"repeat_one_row needs the fused graph (KV layout {KV_SHARED!r}), not {kv_layout!r}")
        self.dims = dims_of(hf_model.config)
        self.kv_layout = kv_layout
        self.repeat_one_row = repeat_one_row
        self.feature_layers = tuple(feature_layers) if feature_layers else ()
        if any(not 0 <= i < self.dims.num_layers for i in self.feature_layers):
            raise ValueError(f"feature_layers {list(self.feature_layers)} outside the target's "
                             f"{self.dims.num_layers} layers")
        base = hf_model.model
        self.embed = base.embed_tokens
        self.rotary = rotary_of(hf_model)
        layer_kind = FusedDecoderLayer if kv_layout == KV_SHARED else DecoderLayer
        self.layers = nn.ModuleList(layer_kind(layer, self.dims) for layer in base.layers)
        self.norm = base.norm.weight
        self.lm_head = hf_model.lm_head

    @property
    def kv_io(self) -> list[tuple[str, str]]:
        return kv_names(self.dims.num_layers)

    def forward(self, input_ids, position_ids, attention_mask, logits_indices, *past):
        if self.kv_layout == KV_SHARED:
            return self._forward_fused(input_ids, position_ids, attention_mask, logits_indices, *past)
        x = self.embed(input_ids)  # (B, S, H)
        cos, sin = self.rotary(position_ids, x.dtype)
        bias = mask_bias(attention_mask, self.dims.num_heads // self.dims.num_kv_heads)  # shared by all layers
        presents, taps = [], []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                taps.append(x)
            x, k, v = layer(x, cos, sin, bias, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        features = rms_norm(x, self.norm, self.dims.rms_norm_eps)
        logits = self.lm_head(gather_positions(features, logits_indices)).float()
        return (logits, features, *self._tapped(taps), *presents)

    def _tapped(self, taps: list) -> tuple:
        """() or (tapped_features [B, S, n*H],)."""
        return (torch.cat(taps, dim=-1),) if taps else ()

    def _forward_fused(self, input_ids, position_ids, attention_mask, logits_indices, *past):
        """The same forward on fused operators (the residual addition of each layer fused into
        the next norm, the last one into the final norm)."""
        x = self.embed(input_ids)  # (B, S, H)
        f = fused_inputs(position_ids, attention_mask, self.rotary, x.dtype,  # shared by all layers
                         rotary_rows(self.dims.max_position_embeddings), self.repeat_one_row)
        pending, presents, taps = None, [], []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:  # the stream entering layer i: residual + pending
                taps.append(x if pending is None else x + pending)
            pending, x, k, v = layer(pending, x, f, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        features, _ = skip_rms_norm(pending, x, self.norm, self.dims.rms_norm_eps)
        logits = as_float32(self.lm_head(gather_rows(features, logits_indices)))
        return (logits, features, *self._tapped(taps), *presents)
