"""The published EAGLE-1/2 checkpoint layout: EAGLE-1/2 heads read and written.

Format (SafeAILab/EAGLE; e.g. yuhuili/EAGLE-llama2-chat-7B): a folder with `config.json`
(a Llama config, one hidden layer) and `model.safetensors` or `pytorch_model.bin` holding
`fc.weight` [H, 2H], optional `fc.bias` [H], and one decoder layer `layers.0.*` without
`input_layernorm`. The token embedding and LM head are the target's (shared, frozen).

Heads of N > 1 layers (config.json `num_hidden_layers` N, written by `eagle-train
--head-layers N`; see `eagle12`) hold `layers.0.*` as above and `layers.{i}.*` for 0 < i < N,
each with its `input_layernorm.weight` [H].
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from eagle_deploy.contract.manifest import Dims
from eagle_deploy.exporter.target import dims_of

from .eagle12 import EagleHead, head_config_for, num_head_layers
from .files import HeadCheckpointError

OPTIONAL_KEYS = ("fc.bias",)
IGNORED_KEYS = ("embed_tokens.weight",)  # some published heads carry a copy; the target's is used


def expected_shapes(dims: Dims, intermediate: int, attention_bias: bool,
                    num_layers: int = 1) -> dict[str, tuple[int, ...]]:
    """Required tensor name -> shape of an EAGLE-1/2 head of `num_layers` decoder layers for
    a target with `dims`."""
    H, hd = dims.hidden, dims.head_dim
    q, kv = dims.num_heads * hd, dims.num_kv_heads * hd
    shapes = {"fc.weight": (H, 2 * H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        if i > 0:  # the layers after the first are ordinary pre-norm layers (eagle12's docstring)
            shapes[p + "input_layernorm.weight"] = (H,)
        shapes.update({
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (intermediate, H),
            p + "mlp.up_proj.weight": (intermediate, H),
            p + "mlp.down_proj.weight": (H, intermediate),
            p + "post_attention_layernorm.weight": (H,),
        })
        if attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_head_state(state: dict[str, torch.Tensor], dims: Dims, intermediate: int, num_layers: int = 1) -> None:
    """Raise HeadCheckpointError naming the first missing, mis-shaped or unexpected tensor of
    a head of `num_layers` decoder layers (its config.json's num_hidden_layers)."""
    attention_bias = "layers.0.self_attn.q_proj.bias" in state
    shapes = expected_shapes(dims, intermediate, attention_bias, num_layers)
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
        deeper = any(m and int(m.group(1)) >= num_layers for m in (re.match(r"layers\.(\d+)\.", k) for k in extra))
        why = f"its config.json has num_hidden_layers {num_layers}" if deeper else "is it an EAGLE-1/2 head?"
        raise HeadCheckpointError(f"draft head has unexpected tensors {extra} ({why})")


# config keys that fix the head's tensor geometry: they must be the target's (the head
# attends with the target's heads and reuses its embedding and LM head)
GEOMETRY_KEYS = {"hidden_size": "hidden", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
                 "head_dim": "head_dim"}


def check_head_config(config, path: Path, dims: Dims) -> None:
    """Raise HeadCheckpointError for a head config.json this exporter cannot honour: not a
    JSON object; geometry that differs from the target's; a non-positive intermediate_size,
    max_position_embeddings (the head's position limit, recorded in the manifest) or
    num_hidden_layers (the head's decoder layers);
    an activation other than SiLU (the exported MLP is SwiGLU); non-numeric rope_theta or
    rms_norm_eps."""
    if not isinstance(config, dict):
        raise HeadCheckpointError(f"draft head config {path} must be a JSON object, got {type(config).__name__}")
    for key, attr in GEOMETRY_KEYS.items():
        if key in config and config[key] is not None and config[key] != getattr(dims, attr):
            raise HeadCheckpointError(f"draft head config {path}: {key} = {config[key]!r}, "
                                      f"but the target has {getattr(dims, attr)}")
    for key in ("intermediate_size", "max_position_embeddings", "num_hidden_layers"):
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


def load_eagle12_head(head_dir: Path, head_config: dict, target: nn.Module,
                      state: dict[str, torch.Tensor]) -> EagleHead:
    """An EAGLE-1/2 head for `target` from its folder's parsed config.json and tensors (read
    by `api.load_head`, which also loads EAGLE-3 heads). HeadCheckpointError names any bad
    tensor or config value."""
    cfg_path = Path(head_dir) / "config.json"
    dims = dims_of(target.config)
    check_head_config(head_config, cfg_path, dims)
    intermediate = int(head_config.get("intermediate_size", target.config.intermediate_size))
    check_head_state(state, dims, intermediate, num_head_layers(head_config))
    merged = {**head_config_for(target.config), **head_config}
    try:
        head = EagleHead(merged, target, fc_bias="fc.bias" in state,
                         attention_bias="layers.0.self_attn.q_proj.bias" in state)
    except Exception as err:  # a config value transformers cannot use
        raise HeadCheckpointError(f"draft head config {cfg_path} is unusable: {type(err).__name__}: {err}") from None
    own = {k: v for k, v in state.items() if k not in IGNORED_KEYS}
    head.load_state_dict({**head.state_dict(), **{k: v.to(torch.float32) for k, v in own.items()}})
    return head


def save_eagle12_head(head: EagleHead, out_dir: Path) -> None:
    """Write `config.json` + `model.safetensors` in the published EAGLE-1/2 layout
    (`api.save_head`)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().float() for k, v in head.head_state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config, indent=2) + "\n")
