"""EAGLE-1/2 draft heads in their published format, as torch modules.

Format (SafeAILab/EAGLE; e.g. yuhuili/EAGLE-llama2-chat-7B): a folder with `config.json`
(a Llama config, one hidden layer) and `model.safetensors` or `pytorch_model.bin` holding
`fc.weight` [H, 2H], optional `fc.bias` [H], and one decoder layer `layers.0.*` without
`input_layernorm`. The token embedding and LM head are the target's (shared, frozen).

Forward (EAGLE, arXiv 2401.15077 §3): x = fc([embed(token_{p+1}); feature_p]); one decoder
layer with no input norm; the result is the predicted feature at p+1, and the target's LM
head on it (no extra norm for EAGLE-1/2) gives the next-token distribution.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
from eagle_deploy.heads.files import HeadCheckpointError

from .fused import FusedDecoderLayer, as_float32, fused_inputs, gather_rows, rotary_rows
from .layers import Rotary, gather_positions, mask_bias
from .target import DecoderLayer, Dims, dims_of

OPTIONAL_KEYS = ("fc.bias",)
IGNORED_KEYS = ("embed_tokens.weight",)  # some published heads carry a copy; the target's is used


def expected_shapes(dims: Dims, intermediate: int, attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """Required tensor name -> shape of an EAGLE-1/2 head for a target with `dims`."""
    H, hd = dims.hidden, dims.head_dim
    q, kv = dims.num_heads * hd, dims.num_kv_heads * hd
    p = "layers.0."
    shapes = {
        "fc.weight": (H, 2 * H),
        p + "self_attn.q_proj.weight": (q, H),
        p + "self_attn.k_proj.weight": (kv, H),
        p + "self_attn.v_proj.weight": (kv, H),
        p + "self_attn.o_proj.weight": (H, q),
        p + "mlp.gate_proj.weight": (intermediate, H),
        p + "mlp.up_proj.weight": (intermediate, H),
        p + "mlp.down_proj.weight": (H, intermediate),
        p + "post_attention_layernorm.weight": (H,),
    }
    if attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_head_state(state: dict[str, torch.Tensor], dims: Dims, intermediate: int) -> None:
    """Raise HeadCheckpointError naming the first missing, mis-shaped or unexpected tensor."""
    attention_bias = "layers.0.self_attn.q_proj.bias" in state
    shapes = expected_shapes(dims, intermediate, attention_bias)
    for key, shape in shapes.items():
        if key not in state:
            raise HeadCheckpointError(f"draft head is missing tensor {key!r} (expected shape {list(shape)})")
        if tuple(state[key].shape) != shape:
            raise HeadCheckpointError(f"draft head tensor {key!r} has shape {list(state[key].shape)}, "
                                      f"expected {list(shape)}")
        if not state[key].is_floating_point():
            raise HeadCheckpointError(f"draft head tensor {key!r} is {state[key].dtype}, "
                                      "expected floating point weights")
        if not bool(torch.isfinite(state[key]).all()):
            raise HeadCheckpointError(f"draft head tensor {key!r} contains NaN or infinite values")
    if "fc.bias" in state and tuple(state["fc.bias"].shape) != (dims.hidden,):
        raise HeadCheckpointError(f"draft head tensor 'fc.bias' has shape {list(state['fc.bias'].shape)}, "
                                  f"expected [{dims.hidden}]")
    extra = sorted(set(state) - set(shapes) - set(OPTIONAL_KEYS) - set(IGNORED_KEYS))
    if extra:
        raise HeadCheckpointError(f"draft head has unexpected tensors {extra} (is it an EAGLE-1/2 head?)")


# config keys that fix the head's tensor geometry: they must be the target's (the head
# attends with the target's heads and reuses its embedding and LM head)
GEOMETRY_KEYS = {"hidden_size": "hidden", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
                 "head_dim": "head_dim"}


def check_head_config(config, path: Path, dims: Dims) -> None:
    """Raise HeadCheckpointError for a head config.json this exporter cannot honour: not a
    JSON object; geometry that differs from the target's; a non-positive intermediate_size or
    max_position_embeddings (the head's position limit, recorded in the manifest);
    an activation other than SiLU (the exported MLP is SwiGLU); non-numeric rope_theta or
    rms_norm_eps."""
    if not isinstance(config, dict):
        raise HeadCheckpointError(f"draft head config {path} must be a JSON object, got {type(config).__name__}")
    for key, attr in GEOMETRY_KEYS.items():
        if key in config and config[key] is not None and config[key] != getattr(dims, attr):
            raise HeadCheckpointError(f"draft head config {path}: {key} = {config[key]!r}, "
                                      f"but the target has {getattr(dims, attr)}")
    for key in ("intermediate_size", "max_position_embeddings"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HeadCheckpointError(f"draft head config {path}: {key} must be a positive integer, got {value!r}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HeadCheckpointError(f"draft head config {path}: hidden_act {act!r} is not supported "
                                  "(the head's MLP is SwiGLU: 'silu')")
    for key in ("rope_theta", "rms_norm_eps"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise HeadCheckpointError(f"draft head config {path}: {key} must be a positive number, got {value!r}")


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


def random_head(target: nn.Module, seed: int = 0, fc_bias: bool = True) -> EagleHead:
    """An untrained head (normal(0, 0.02) weights, unit norm) for tests and the demo."""
    head = EagleHead(head_config_for(target.config), target, fc_bias=fc_bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.head_state_dict().items():
            if name.endswith("layernorm.weight"):
                continue
            param = dict(head.named_parameters())[name]
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return head


def load_eagle12_head(head_dir: Path, head_config: dict, target: nn.Module,
                      state: dict[str, torch.Tensor]) -> EagleHead:
    """An EAGLE-1/2 head for `target` from its folder's parsed config.json and tensors (read
    by `heads.load_head`, which also loads EAGLE-3 heads). HeadCheckpointError names any bad
    tensor or config value."""
    cfg_path = Path(head_dir) / "config.json"
    dims = dims_of(target.config)
    check_head_config(head_config, cfg_path, dims)
    intermediate = int(head_config.get("intermediate_size", target.config.intermediate_size))
    check_head_state(state, dims, intermediate)
    merged = {**head_config_for(target.config), **head_config}
    try:
        head = EagleHead(merged, target, fc_bias="fc.bias" in state,
                         attention_bias="layers.0.self_attn.q_proj.bias" in state)
    except Exception as err:  # a config value transformers cannot use
        raise HeadCheckpointError(f"draft head config {cfg_path} is unusable: {type(err).__name__}: {err}") from None
    own = {k: v for k, v in state.items() if k not in IGNORED_KEYS}
    head.load_state_dict({**head.state_dict(), **{k: v.to(torch.float32) for k, v in own.items()}})
    return head


def save_head(head: EagleHead, out_dir: Path) -> None:
    """Write `config.json` + `model.safetensors` in the published EAGLE-1/2 layout."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().float() for k, v in head.head_state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config, indent=2) + "\n")


class ExportableDraft(nn.Module):
    """Draft graph forward following `contract.py`: the head, then the top-k of its
    log-softmax computed in-graph at `logits_indices`.

    forward(features, input_ids, position_ids, attention_mask, logits_indices, past_k, past_v)
    -> (next_features [B,S,H], topk_logprobs [B,N,K] f32, topk_ids [B,N,K] int64, present_k, present_v).
    `draft_vocab` (optional [V'] int64 ids) restricts the head's LM head to those target
    tokens (a reduced draft vocabulary, as in FR-Spec); ids come back in the full vocabulary.
    kv_layout "shared": the head's layer on fused operators (exporter/fused.py), KV as for
    ExportableTarget.
    """

    def __init__(self, head: EagleHead, top_k: int, draft_vocab: torch.Tensor | None = None,
                 kv_layout: str = KV_SEQ_MAJOR):
        super().__init__()
        self.head = head
        self.top_k = top_k
        self.kv_layout = kv_layout
        # the head's layer on fused operators, outside the module tree (the head owns the weights)
        self.__dict__["_fused_layer"] = (FusedDecoderLayer(head.layers[0], head.dims, input_norm=False)
                                         if kv_layout == KV_SHARED else None)
        self.embed = head.embed  # registered here so the tracer sees the shared weights as parameters
        W = head.lm_head.weight
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.long().clone())
            self.lm_weight = nn.Parameter(W.detach()[draft_vocab].clone(), requires_grad=False)
        else:
            self.draft_vocab = None
            self.lm_weight = W

    def forward(self, features, input_ids, position_ids, attention_mask, logits_indices, past_k, past_v):
        if self._fused_layer is None:
            x, k, v = self.head(features, input_ids, position_ids, attention_mask, past_k, past_v)
            rows = gather_positions(x, logits_indices)
        else:
            x = self.head.fc_input(features, input_ids)
            f = fused_inputs(position_ids, attention_mask, self.head.rotary, x.dtype,
                             rotary_rows(self.head.dims.max_position_embeddings))
            pending, x, k, v = self._fused_layer(None, x, f, past_k, past_v)
            x = x + pending
            rows = gather_rows(x, logits_indices)
        logits = as_float32(torch.matmul(rows, self.lm_weight.t()))  # (B, N, V')
        logprobs, ids = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.draft_vocab is not None:
            ids = self.draft_vocab[ids]
        return x, logprobs, ids, k, v
