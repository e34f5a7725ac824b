"""Where the tools keep what they compute once per machine (converted checkpoints, peer
conversions, measured device costs): $EAGLE_DEPLOY_CACHE, else ~/.cache/eagle-deploy."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$EAGLE_DEPLOY_CACHE or ~/.cache/eagle-deploy (not created here)."""
    return Path(os.environ.get("EAGLE_DEPLOY_CACHE", Path.home() / ".cache" / "eagle-deploy"))
