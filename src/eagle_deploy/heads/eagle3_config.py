"""An EAGLE-3 head's config.json, in either published layout (`eagle3_checkpoint`), read into
one `Eagle3Config` checked against the target (`read_config`), and written for a target
(`head_config`).

Either layout may name the tapped target layers (`eagle_aux_hidden_state_layer_ids`, top
level or under `eagle_config`); otherwise the reference's low / middle / high choice is used:
`default_feature_layers` = (2, L // 2, L - 3), each meaning the hidden state *entering* that
decoder layer (transformers' `output_hidden_states[i]`), as the reference and vLLM tap them.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_deploy.contract.manifest import Dims, HeadRecord
from eagle_deploy.exporter.layers import STATIC_ROPE_TYPES

from .files import HeadCheckpointError, detect_layout


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's taps for an L-layer target: (2, L // 2, L - 3). ValueError when they
    are not three distinct layers (targets under 7 layers must name their taps)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != 3 or min(layers) < 0:
        raise ValueError(f"the default EAGLE-3 taps (2, L // 2, L - 3) = {layers} are not three distinct layers "
                         f"of this {num_layers}-layer target: name them in the head config "
                         "(eagle_aux_hidden_state_layer_ids)")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's geometry, read from either layout (`read_config`)."""

    layout: str
    llama: dict  # the head's own Llama config (one layer)
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    feature_layers: tuple[int, ...]
    norm_before_residual: bool
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def record(self) -> HeadRecord:
        return HeadRecord(kind="eagle3", hidden=self.hidden, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, feature_layers=self.feature_layers, layout=self.layout)


def _positive(cfg: dict, key: str, path, default=None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: {key} must be a positive integer, got {value!r}")
    return value


def _number(cfg: dict, key: str, path, default: float | None = None) -> float | None:
    """A positive finite number at `key` (or `default` when absent)."""
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: {key} must be a positive number, got {value!r}")
    return float(value)


def _check_rope(llama: dict, path) -> None:
    """rope_theta (top level or in rope_parameters) a positive number; a rope type whose
    frequencies do not depend on the sequence length (as the target's, layers.STATIC_ROPE_TYPES)."""
    _number(llama, "rope_theta", path)
    for key in ("rope_parameters", "rope_scaling"):
        rope = llama.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise HeadCheckpointError(f"EAGLE-3 head config {path}: {key} must be an object, got {rope!r}")
        _number(rope, "rope_theta", path)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in STATIC_ROPE_TYPES:
            raise HeadCheckpointError(f"EAGLE-3 head config {path}: {key}.rope_type {kind!r} depends on the sequence "
                                      f"length; supported: {', '.join(STATIC_ROPE_TYPES)}")


def read_config(config: dict, path, target_dims: Dims, layout: str | None = None) -> Eagle3Config:
    """Normalise an EAGLE-3 config.json (either layout) against the target. Raises
    HeadCheckpointError naming the key: a vocabulary other than the target's, a
    target_hidden_size other than the target's hidden, tapped layers outside the target, a
    non-SiLU activation, a size / eps / rope_theta that is not a positive number, a dynamic
    rope type."""
    if not isinstance(config, dict):
        raise HeadCheckpointError(f"draft head config {path} must be a JSON object, got {type(config).__name__}")
    layout = layout or detect_layout(config)
    if layout is None:
        raise HeadCheckpointError(f"{path} is not an EAGLE-3 head config")
    llama = config.get("transformer_layer_config") if layout == "speculators" else config
    if not isinstance(llama, dict) or not llama:
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: transformer_layer_config must be the head's Llama "
                                  f"config (an object), got {llama!r}")
    llama = dict(llama)
    hidden = _positive(llama, "hidden_size", path)
    heads = _positive(llama, "num_attention_heads", path)
    kv_heads = _positive(llama, "num_key_value_heads", path, heads)
    head_dim = _positive(llama, "head_dim", path, hidden // heads) if llama.get("head_dim") else hidden // heads
    _check_rope(llama, path)
    eps = _number(llama, "rms_norm_eps", path, target_dims.rms_norm_eps)
    if heads % kv_heads:
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: num_key_value_heads {kv_heads} does not divide "
                                  f"num_attention_heads {heads}")
    vocab = _positive(llama, "vocab_size", path, target_dims.vocab)
    if vocab != target_dims.vocab:
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: vocab_size {vocab} differs from the target's "
                                  f"{target_dims.vocab}")
    draft_vocab = _positive(config, "draft_vocab_size", path, vocab)
    if draft_vocab > vocab:
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: draft_vocab_size {draft_vocab} exceeds the "
                                  f"vocabulary {vocab}")
    target_hidden = _positive(config, "target_hidden_size", path) if config.get("target_hidden_size") else hidden
    if target_hidden != target_dims.hidden:
        which = "target_hidden_size" if config.get("target_hidden_size") else "hidden_size (no target_hidden_size)"
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: {which} {target_hidden} differs from the target's "
                                  f"hidden size {target_dims.hidden}")
    act = llama.get("hidden_act", "silu")
    if act != "silu":
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: hidden_act {act!r} is not supported (SwiGLU: 'silu')")
    nested = config.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: eagle_config must be an object, got {nested!r}")
    layers = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None and not isinstance(layers, list):
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: eagle_aux_hidden_state_layer_ids must be a list of "
                                  f"layer ids, got {layers!r}")
    if layers is None:
        try:
            layers = default_feature_layers(target_dims.num_layers)
        except ValueError as err:
            raise HeadCheckpointError(f"EAGLE-3 head config {path}: {err}") from None
    layers = tuple(layers)
    if (len(layers) < 1 or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < target_dims.num_layers
                               for i in layers) or list(layers) != sorted(set(layers))):
        raise HeadCheckpointError(f"EAGLE-3 head config {path}: eagle_aux_hidden_state_layer_ids {list(layers)} must "
                                  f"be distinct ascending layer ids in [0, {target_dims.num_layers})")
    return Eagle3Config(
        layout=layout, llama=llama, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate=_positive(llama, "intermediate_size", path), vocab=vocab, draft_vocab=draft_vocab,
        target_hidden=target_hidden, feature_layers=layers,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        rms_norm_eps=eps,
        max_position_embeddings=_positive(llama, "max_position_embeddings", path,
                                          target_dims.max_position_embeddings))


def head_config(target_config, layout: str = "eagle3", hidden: int | None = None, num_heads: int | None = None,
                num_kv_heads: int | None = None, intermediate: int | None = None, draft_vocab: int | None = None,
                feature_layers=None, norm_before_residual: bool = False) -> dict:
    """A published-style EAGLE-3 config.json for a head on `target_config` (width etc. the
    target's unless given)."""
    t = target_config
    H = hidden or t.hidden_size
    heads = num_heads or t.num_attention_heads
    llama = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
             "num_attention_heads": heads, "num_key_value_heads": num_kv_heads or t.num_key_value_heads,
             "head_dim": H // heads, "intermediate_size": intermediate or t.intermediate_size,
             "num_hidden_layers": 1, "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps,
             "max_position_embeddings": t.max_position_embeddings, "hidden_act": "silu",
             "rope_theta": getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {}).get(
                 "rope_theta", 10000.0)}
    extra = {"draft_vocab_size": draft_vocab or t.vocab_size}
    if H != t.hidden_size:
        extra["target_hidden_size"] = t.hidden_size
    if feature_layers is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = list(feature_layers)
    if layout == "speculators":
        llama.pop("architectures")
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": llama, "norm_before_residual": norm_before_residual, **extra}
    return {**llama, **extra, **({"norm_before_residual": True} if norm_before_residual else {})}
