"""EAGLE-3 draft heads (arXiv 2503.01840) in their published layouts, as torch modules.

Two checkpoint layouts are read and normalised into one representation (`Eagle3Head`):
  "eagle3"       the reference implementation's (yuhuili/EAGLE3-*, SpecForge, ModelOpt exports):
                 `config.json` a Llama config with one layer and `draft_vocab_size`
                 (architectures e.g. `LlamaForCausalLMEagle3`), tensors `fc.weight`,
                 `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally
                 `embed_tokens.weight`;
  "speculators"  Red Hat / vLLM `speculators` (`speculators_model_type: "eagle3"`, the Llama
                 config under `transformer_layer_config`, `norm_before_residual`), tensors
                 `layers.0.*` instead of `midlayer.*`, `fc.bias` usually present.
Either may name the tapped target layers (`eagle_aux_hidden_state_layer_ids`, top level or
under `eagle_config`); otherwise the reference's low / middle / high choice is used:
`default_feature_layers` = (2, L // 2, L - 3), each meaning the hidden state *entering* that
decoder layer (transformers' `output_hidden_states[i]`), as the reference and vLLM tap them.

Forward (paper §3.2-3.3; reference `cnets.py`): on the first draft step the three taps are
fused, h = fc([low; mid; high]) (3 x target hidden -> hidden); at later depths h is the head's
own previous output. One decoder layer whose q/k/v read [input_layernorm(embed(token_{p+1}));
hidden_norm(h)] (2 x hidden wide), with h (or, with norm_before_residual, hidden_norm(h)) as
the residual; then post-attention norm and SwiGLU MLP. Its output is fed back; the draft
distribution is lm_head(norm(output)) over the draft vocabulary, whose index i is target
token i + d2t[i].
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle_deploy.contract.manifest import HeadRecord
from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
from eagle_deploy.heads.files import HeadCheckpointError, detect_layout, read_head_state

from .fused import FusedAttention, fused_inputs, gather_rows, rotary_rows, skip_rms_norm
from .layers import STATIC_ROPE_TYPES, Attention, GatedMLP, Rotary, gather_positions, mask_bias, rms_norm
from .target import Dims, dims_of

LAYOUTS = ("eagle3", "speculators")
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


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


def expected_shapes(cfg: Eagle3Config, attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """Required tensor name (normalised, "midlayer." keys) -> shape."""
    H, hd = cfg.hidden, cfg.head_dim
    q, kv, m = cfg.num_heads * hd, cfg.num_kv_heads * hd, "midlayer."
    shapes = {
        "fc.weight": (H, len(cfg.feature_layers) * cfg.target_hidden),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H),
        m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H),
        m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (cfg.intermediate, H),
        m + "mlp.up_proj.weight": (cfg.intermediate, H),
        m + "mlp.down_proj.weight": (H, cfg.intermediate),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab, H),
    }
    if attention_bias:
        shapes.update({m + "self_attn.q_proj.bias": (q,), m + "self_attn.k_proj.bias": (kv,),
                       m + "self_attn.v_proj.bias": (kv,)})
    return shapes


def normalise_state(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Tensor names of `layout` -> the "midlayer." names used here."""
    prefix = LAYER_PREFIX[layout]
    return {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}


def check_vocab_map(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> torch.Tensor:
    """The draft -> target id table ([draft_vocab] int64: target id of draft index i), from
    `d2t` (target id = i + d2t[i]), checked against `t2d` when present. Raises
    HeadCheckpointError for a reduced draft vocabulary without d2t (draft index i would
    silently become target id i), a d2t that maps outside the vocabulary or twice to one id,
    or a t2d that disagrees with it. Equal vocabularies without d2t map as the identity."""
    V, Vd = cfg.vocab, cfg.draft_vocab
    d2t = state.get("d2t")
    if d2t is None:
        if Vd != V:
            raise HeadCheckpointError(f"EAGLE-3 head has a draft vocabulary of {Vd} tokens (target {V}) but no 'd2t' "
                                      "table: without it draft index i would be read as target token i")
        return torch.arange(V, dtype=torch.int64)
    if tuple(d2t.shape) != (Vd,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise HeadCheckpointError(f"EAGLE-3 head tensor 'd2t' is {list(d2t.shape)} {d2t.dtype}, expected [{Vd}] "
                                  "integer offsets (target id = draft index + d2t[index])")
    ids = torch.arange(Vd, dtype=torch.int64) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= V or len(torch.unique(ids)) != Vd:
        raise HeadCheckpointError(f"EAGLE-3 head tensor 'd2t' maps draft indices outside [0, {V}) or two indices to "
                                  "one target token")
    t2d = state.get("t2d")
    if t2d is not None:
        if tuple(t2d.shape) != (V,):
            raise HeadCheckpointError(f"EAGLE-3 head tensor 't2d' has shape {list(t2d.shape)}, expected [{V}]")
        mask = torch.zeros(V, dtype=torch.bool)
        mask[ids] = True
        if not torch.equal(t2d.bool(), mask):
            raise HeadCheckpointError("EAGLE-3 head tensors 'd2t' and 't2d' disagree on which target tokens are in "
                                      "the draft vocabulary")
    return ids


def file_key(key: str, layout: str) -> str:
    """A normalised ("midlayer.") tensor name as `layout` writes it (for messages)."""
    return LAYER_PREFIX[layout] + key[len("midlayer."):] if key.startswith("midlayer.") else key


def check_state(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> None:
    """HeadCheckpointError naming (as the checkpoint's layout spells it) the first missing,
    mis-shaped, non-float, non-finite or unexpected tensor."""
    attention_bias = "midlayer.self_attn.q_proj.bias" in state
    shapes = expected_shapes(cfg, attention_bias)
    optional = {"fc.bias": (cfg.hidden,), "embed_tokens.weight": (cfg.vocab, cfg.hidden)}
    for name, shape in {**shapes, **{k: v for k, v in optional.items() if k in state}}.items():
        key = file_key(name, cfg.layout)
        if name not in state:
            raise HeadCheckpointError(f"EAGLE-3 head is missing tensor {key!r} (expected shape {list(shape)})")
        t = state[name]
        if tuple(t.shape) != shape:
            raise HeadCheckpointError(f"EAGLE-3 head tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_floating_point():
            raise HeadCheckpointError(f"EAGLE-3 head tensor {key!r} is {t.dtype}, expected floating point weights")
        if not bool(torch.isfinite(t).all()):
            raise HeadCheckpointError(f"EAGLE-3 head tensor {key!r} contains NaN or infinite values")
    extra = sorted(file_key(k, cfg.layout) for k in set(state) - set(shapes) - set(optional) - {"d2t", "t2d"})
    if extra:
        raise HeadCheckpointError(f"EAGLE-3 head has unexpected tensors {extra[:5]} (layout {cfg.layout!r})")
    if "embed_tokens.weight" not in state and cfg.hidden != cfg.target_hidden:
        raise HeadCheckpointError(f"EAGLE-3 head of hidden size {cfg.hidden} has no 'embed_tokens.weight' and cannot "
                                  f"use the target's ({cfg.target_hidden} wide)")


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


class _FusedEagle3Layer(nn.Module):
    """Eagle3Head.layer on onnxruntime's fused operators (GroupQueryAttention with rotary,
    SkipSimplifiedLayerNormalization), KV layout "shared" (exporter/fused.py)."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.__dict__["head"] = head
        cfg = head.cfg
        self.attn = FusedAttention(head.midlayer.self_attn, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, h, input_ids, position_ids, attention_mask, past_k, past_v):
        head = self.head
        x, residual = head.attention_input(h, input_ids)
        f = fused_inputs(position_ids, attention_mask, head.rotary, h.dtype,
                         rotary_rows(head.cfg.max_position_embeddings))
        attn, k, v = self.attn(x, f, past_k, past_v)
        normed, x = skip_rms_norm(attn, residual, head.midlayer.post_attention_layernorm.weight, head.cfg.rms_norm_eps)
        return x + head._mlp(normed), k, v


class ExportableDraft3(nn.Module):
    """The EAGLE-3 draft graph (contract: onnx_io, "EAGLE-3 exports"): the head, its norm and
    LM head over the draft vocabulary, top-k of the log-softmax at `logits_indices`, and the
    draft -> target id mapping, all in-graph.

    forward(tapped_features [B,T,n*H_t], features [B,S-T,H], input_ids, position_ids,
    attention_mask, logits_indices, past_k, past_v) -> (next_features [B,S,H], topk_logprobs
    [B,N,K] f32, topk_ids [B,N,K] int64 target ids, present_k, present_v).
    """

    def __init__(self, head: Eagle3Head, top_k: int, kv_layout: str = KV_SEQ_MAJOR):
        super().__init__()
        self.head = head
        self.top_k = top_k
        self.kv_layout = kv_layout
        self.__dict__["_fused_layer"] = _FusedEagle3Layer(head) if kv_layout == KV_SHARED else None
        self.embed = head.embed  # registered here so the tracer sees shared weights as parameters
        self.register_buffer("draft_ids", head.draft_to_target.clone())

    def forward(self, tapped_features, features, input_ids, position_ids, attention_mask, logits_indices, past_k,
                past_v):
        h = torch.cat((self.head.fuse(tapped_features), features), dim=1)
        layer = self.head.layer if self._fused_layer is None else self._fused_layer
        x, k, v = layer(h, input_ids, position_ids, attention_mask, past_k, past_v)
        gather = gather_positions if self._fused_layer is None else gather_rows
        logits = self.head.logits(gather(x, logits_indices))  # (B, N, draft_vocab)
        logprobs, idx = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        return x, logprobs, self.draft_ids[idx], k, v


def load_eagle3_head(head_dir: Path, config: dict, target: nn.Module, layout: str | None = None,
                     state: dict | None = None) -> Eagle3Head:
    """Read an EAGLE-3 head folder (either layout; `config` its parsed config.json, `state` its
    tensors when already read; `layout` when known from the tensor names) for `target`.
    Raises HeadCheckpointError naming any missing, unexpected or mis-shaped tensor, an
    inconsistent d2t / t2d, or a config that does not fit the target."""
    head_dir = Path(head_dir)
    cfg = read_config(config, head_dir / "config.json", dims_of(target.config), layout)
    state = normalise_state(read_head_state(head_dir) if state is None else state, cfg.layout)
    check_state(state, cfg)
    ids = check_vocab_map(state, cfg)
    try:
        head = Eagle3Head(cfg, target, fc_bias="fc.bias" in state,
                          attention_bias="midlayer.self_attn.q_proj.bias" in state,
                          own_embedding="embed_tokens.weight" in state)
    except Exception as err:  # a config value transformers cannot use
        raise HeadCheckpointError(f"EAGLE-3 head config {head_dir / 'config.json'} is unusable: "
                                  f"{type(err).__name__}: {err}") from None
    if not bool(torch.isfinite(head.rotary.inv_freq).all()):
        raise HeadCheckpointError(f"EAGLE-3 head config {head_dir / 'config.json'}: its rope settings give "
                                  "non-finite rotary frequencies")
    weights = {k: v.to(torch.float32) for k, v in state.items() if k not in ("d2t", "t2d")}
    mask = torch.zeros(cfg.vocab, dtype=torch.bool)
    mask[ids] = True
    head.load_state_dict({**weights, "d2t": ids - torch.arange(cfg.draft_vocab), "t2d": mask}, strict=True)
    return head


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


def random_eagle3_head(target: nn.Module, seed: int = 0, draft_ids=None, **config_kw) -> Eagle3Head:
    """An untrained EAGLE-3 head (normal(0, 0.02) weights, norms 1 + normal(0, 0.1)) over
    `draft_ids` (sorted target ids; default the full vocabulary), for tests. Its own embedding
    when its width differs from the target's. config_kw: see `head_config`."""
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


def save_eagle3_head(head: Eagle3Head, out_dir: Path, layout: str = "eagle3") -> None:
    """Write `config.json` + `model.safetensors` in `layout` ("eagle3" or "speculators")."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = LAYER_PREFIX[layout]
    state = {}
    for k, v in head.head_state_dict().items():
        key = prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k
        state[key] = v.detach().contiguous() if k in ("d2t", "t2d") else v.detach().contiguous().float()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = head.cfg
    config = dict(cfg.llama) if layout == "eagle3" else {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {k: v for k, v in cfg.llama.items() if k not in ("architectures",
                                                                                      "draft_vocab_size")}}
    config.update(draft_vocab_size=cfg.draft_vocab, eagle_aux_hidden_state_layer_ids=list(cfg.feature_layers))
    if cfg.target_hidden != cfg.hidden:
        config["target_hidden_size"] = cfg.target_hidden
    if cfg.norm_before_residual or layout == "speculators":
        config["norm_before_residual"] = cfg.norm_before_residual
    if layout == "eagle3":
        config.setdefault("architectures", ["LlamaForCausalLMEagle3"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
