"""`load_head`: a published-format draft-head folder loaded as the module its config or tensor
names call for, an EAGLE-1/2 `draft_head.EagleHead` or an EAGLE-3 `eagle3.Eagle3Head`. It sits
above both so that neither imports the other (what both read is in `heads.files`)."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from eagle_deploy.heads.files import detect_layout, read_head_config, read_head_state

from .draft_head import load_eagle12_head
from .eagle3 import load_eagle3_head


def load_head(head_dir: Path, target: nn.Module):
    """Load a published-format head for `target`: an EagleHead (EAGLE-1/2) or, when its
    config or tensor names say EAGLE-3, an `eagle3.Eagle3Head`. HeadCheckpointError names any
    bad tensor or config value."""
    head_dir = Path(head_dir)
    head_config = read_head_config(head_dir)
    state = read_head_state(head_dir)
    layout = detect_layout(head_config, state.keys())
    if layout is not None:
        return load_eagle3_head(head_dir, head_config, target, layout=layout, state=state)
    return load_eagle12_head(head_dir, head_config, target, state)
