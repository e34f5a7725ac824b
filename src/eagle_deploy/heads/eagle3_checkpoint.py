"""The published EAGLE-3 checkpoint layouts: EAGLE-3 heads read and written.

Two layouts are read and normalised into one representation (`eagle3.Eagle3Head`):
  "eagle3"       the reference implementation's (yuhuili/EAGLE3-*, SpecForge, ModelOpt exports):
                 `config.json` a Llama config with one layer and `draft_vocab_size`
                 (architectures e.g. `LlamaForCausalLMEagle3`), tensors `fc.weight`,
                 `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally
                 `embed_tokens.weight`;
  "speculators"  Red Hat / vLLM `speculators` (`speculators_model_type: "eagle3"`, the Llama
                 config under `transformer_layer_config`, `norm_before_residual`), tensors
                 `layers.0.*` instead of `midlayer.*`, `fc.bias` usually present.
The config of either is read by `eagle3_config.read_config`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_deploy.exporter.target import dims_of

from .eagle3 import Eagle3Head
from .eagle3_config import Eagle3Config, read_config
from .files import HeadCheckpointError, read_head_state

LAYOUTS = ("eagle3", "speculators")
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


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
