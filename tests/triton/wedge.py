"""A drafter plugin for the Triton worker (`drafter: "tests.triton.wedge:make_drafter"`) that
wedges the worker: for a sequence of WEDGE_TOKENS tokens or more its `propose` sleeps for an
hour (alive, deaf to cancels, silent); shorter ones get vanilla steps (root-only trees). With
EAGLE_TEST_WEDGE_MARKER set, it creates that file as it starts sleeping."""
from __future__ import annotations

import os
import time
from pathlib import Path

from eagle_deploy.runtime.drafter import DraftRequest
from eagle_deploy.runtime.tree import DraftTree

WEDGE_TOKENS = 40


class WedgedDrafter:
    forwards = 0

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> DraftTree:
        if len(request.committed) >= WEDGE_TOKENS:
            if os.environ.get("EAGLE_TEST_WEDGE_MARKER"):
                Path(os.environ["EAGLE_TEST_WEDGE_MARKER"]).touch()
            time.sleep(3600)
        return DraftTree.root_only(int(request.committed[-1]))


def make_drafter(folder, manifest, tree, threads):
    """The worker's drafter factory: (export folder, Manifest, TreeConfig, threads) -> drafter."""
    return WedgedDrafter()
