"""A draft-head folder's files, read before anyone knows which kind of head it holds: the
error every head loader raises, the file names, the weights and config readers, and the
layout detection that tells an EAGLE-3 head from an EAGLE-1/2 one. Every other module of
`heads` imports this; it imports none of them."""
from __future__ import annotations

import json
from pathlib import Path

import torch

HEAD_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKEN_COUNTS_FILE = "token_counts.npy"  # optional: response-token frequencies from eagle-train ([vocab] int64)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


class HeadCheckpointError(ValueError):
    """A draft-head checkpoint is missing, unreadable, or has a missing/mis-shaped tensor."""


def read_head_state(head_dir: Path) -> dict[str, torch.Tensor]:
    """Load a head's tensors (safetensors, or a pickle read with weights_only=True)."""
    head_dir = Path(head_dir)
    for name in HEAD_WEIGHT_FILES:
        path = head_dir / name
        if not path.exists():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # corrupt or hostile file: one clear message
            raise HeadCheckpointError(f"cannot read draft head weights {path}: {err}") from None
    raise HeadCheckpointError(f"no draft head weights in {head_dir} (expected one of {', '.join(HEAD_WEIGHT_FILES)})")


def read_head_config(head_dir: Path) -> dict:
    """The parsed config.json of a head folder. Raises HeadCheckpointError."""
    path = Path(head_dir) / "config.json"
    if not path.exists():
        raise HeadCheckpointError(f"draft head folder {head_dir} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HeadCheckpointError(f"draft head config {path} is not valid JSON: {err}") from None


def detect_layout(config: dict, keys=()) -> str | None:
    """"eagle3" / "speculators" when `config` (a head's config.json) or the tensor names
    `keys` say EAGLE-3; None for an EAGLE-1/2 head."""
    if not isinstance(config, dict):
        return None
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    archs = config.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in archs) or "draft_vocab_size" in config:
        return "eagle3"
    if any(k.startswith("midlayer.") for k in keys) or "d2t" in keys:
        return "eagle3"
    return None
