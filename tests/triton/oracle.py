"""A test drafter plugin for the Triton worker (`drafter: "tests.triton.oracle:make_drafter"`):
it proposes the target's own greedy continuation, so greedy rounds accept `depth` draft tokens
plus the bonus, and stops / max_tokens fall inside accepted multi-token chunks. It ignores the
request's token budget (`max_depth`), not its KV room (`max_nodes`), like tests.helpers'
UnclippedDrafter: the decoder itself must cut a chunk at max_tokens or a stop string."""
from __future__ import annotations

import numpy as np

from eagle_deploy.runtime.backends import load_backend
from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.drafter import DraftRequest, causal_mask
from eagle_deploy.runtime.sampling import greedy_token
from eagle_deploy.runtime.tree import DraftTree


class OracleDrafter:
    """Greedy chain of `depth` tokens from a second session of the target graph (its own KV)."""

    def __init__(self, folder, manifest, depth: int, threads=None):
        self.backend = load_backend("ort", folder, manifest, "target", threads)
        self.kv = self.backend.allocate_kv(manifest.max_length)
        self.max_length, self.depth = manifest.max_length, depth
        self.forwards = 0

    def reset(self) -> None:
        self.forwards = 0

    def _step(self, tokens, past: int) -> int:
        n = len(tokens)
        out = self.backend.run(StepInputs(np.asarray(tokens, np.int64)[None], np.arange(past, past + n)[None],
                                          causal_mask(past, n), np.array([[n - 1]])), self.kv, past)
        self.forwards += 1
        return greedy_token(out.logits[0, 0])

    def propose(self, request: DraftRequest) -> DraftTree:
        committed = [int(t) for t in request.committed]
        root = committed[-1]
        depth = min(self.depth, request.max_nodes - 1, self.max_length - len(committed))
        if depth < 1:
            return DraftTree.root_only(root)
        path = [self._step(committed, 0)]
        while len(path) < depth:
            path.append(self._step([path[-1]], len(committed) + len(path) - 1))
        return DraftTree.from_paths(root, [path])


def make_drafter(folder, manifest, tree, threads):
    """The worker's drafter factory: (export folder, Manifest, TreeConfig, threads) -> drafter."""
    return OracleDrafter(folder, manifest, max(tree.depth, 4), threads)


class PacedDrafter:
    """A vanilla step (root-only tree) every `pause_s` seconds: a 200-token request then takes at
    least 200 x pause_s, so a client's cancel always reaches the worker mid-decode, however fast or
    loaded the machine (the cancel test's drafter: the oracle finishes 200 tokens in ~50 ms, less
    than the model's cancel poll)."""

    def __init__(self, pause_s: float):
        self.pause_s = pause_s
        self.forwards = 0

    def reset(self) -> None:
        self.forwards = 0

    def propose(self, request: DraftRequest) -> DraftTree:
        import time

        time.sleep(self.pause_s)
        return DraftTree.root_only(int(request.committed[-1]))


def make_paced_drafter(folder, manifest, tree, threads):
    """The worker's drafter factory for the "paced" model: 20 ms per committed token."""
    return PacedDrafter(0.02)
