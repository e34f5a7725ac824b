"""The heads package's entry points, for either kind of head (`contract` HEAD_KINDS: "eagle"
is EAGLE-1/2, `eagle12.EagleHead`; "eagle3" is EAGLE-3, `eagle3.Eagle3Head`):

    head = load_head(head_dir, target)        # the kind its config.json or tensor names say
    head = random_head(target, seed=0)        # untrained; kind="eagle3" for an EAGLE-3 head
    save_head(head, out_dir)                  # its published layout (EAGLE-3: layout=...)

It sits above the per-kind modules so that neither imports the other (what both read is in
`files`)."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from .eagle3 import Eagle3Head, random_eagle3_head
from .eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from .eagle12 import EagleHead, random_eagle12_head
from .eagle12_checkpoint import load_eagle12_head, save_eagle12_head
from .files import detect_layout, read_head_config, read_head_state

RANDOM_HEADS = {"eagle": random_eagle12_head, "eagle3": random_eagle3_head}


def kind_of(head: EagleHead | Eagle3Head) -> str:
    """"eagle" (EAGLE-1/2) or "eagle3", as the manifest's HeadRecord.kind names it."""
    return "eagle3" if isinstance(head, Eagle3Head) else "eagle"


def load_head(head_dir: Path, target: nn.Module) -> EagleHead | Eagle3Head:
    """Load a published-format head for `target`: an EagleHead (EAGLE-1/2) or, when its
    config or tensor names say EAGLE-3, an Eagle3Head. HeadCheckpointError names any bad
    tensor or config value."""
    head_dir = Path(head_dir)
    head_config = read_head_config(head_dir)
    state = read_head_state(head_dir)
    layout = detect_layout(head_config, state.keys())
    if layout is not None:
        return load_eagle3_head(head_dir, head_config, target, layout=layout, state=state)
    return load_eagle12_head(head_dir, head_config, target, state)


def random_head(target: nn.Module, seed: int = 0, kind: str = "eagle", **options) -> EagleHead | Eagle3Head:
    """An untrained head of `kind` for `target` (tests, the demo, eagle-train's start).
    options: "eagle" takes fc_bias and num_layers (decoder layers, default 1:
    `eagle12.random_eagle12_head`); "eagle3" takes draft_ids and the config keywords of
    `eagle3.random_eagle3_head`."""
    if kind not in RANDOM_HEADS:
        raise ValueError(f"head kind {kind!r} is not one of {', '.join(RANDOM_HEADS)}")
    return RANDOM_HEADS[kind](target, seed=seed, **options)


def save_head(head: EagleHead | Eagle3Head, out_dir: Path, layout: str | None = None) -> None:
    """Write `config.json` + `model.safetensors` in the head's published layout: EAGLE-1/2's
    one layout, or for an EAGLE-3 head `layout` ("eagle3", the default, or "speculators")."""
    if isinstance(head, Eagle3Head):
        save_eagle3_head(head, out_dir, layout=layout or "eagle3")
    elif layout is not None:
        raise ValueError(f"an EAGLE-1/2 head has one layout; got layout={layout!r}")
    else:
        save_eagle12_head(head, out_dir)
