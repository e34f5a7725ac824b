"""Shared test helpers: plain PyTorch references, graph runners, and instrumentation
(recording / NaN-poisoning backend wrappers, scripted and forcing drafters, commit spies).

Nothing here imports the exporter's torch modules for the references: `hf_*` functions run
transformers' own `LlamaForCausalLM`, so they check the export rather than repeat it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from eagle_deploy.common.cpu import cpu_info
from eagle_deploy.contract import onnx_io as c
from eagle_deploy.runtime.backends.base import StepInputs, feature_inputs
from eagle_deploy.runtime.drafter import DraftRequest, causal_mask  # noqa: F401 (re-exported for the tests)
from eagle_deploy.runtime.kv import KVBuffer
from eagle_deploy.runtime.tree import DraftTree

# onnxruntime's MLAS picks other kernels with AVX-512 (the Xeon the batch-invariance table was
# first measured on) than with AVX2 only (AMD Zen 3): tests/exporter/test_batch_invariance.py
AVX512 = "avx512f" in cpu_info().flags

# --------------------------------------------------------------------------- references


def hf_logits(hf, ids: Sequence[int]) -> np.ndarray:
    """transformers forward over `ids` -> logits [len(ids), V] float32."""
    with torch.no_grad():
        return hf(torch.tensor([list(ids)], dtype=torch.int64)).logits[0].float().numpy()


def hf_features(hf, ids: Sequence[int], layers: Sequence[int] | None = None) -> np.ndarray:
    """transformers final-norm hidden states (the EAGLE feature) [len(ids), H]; with `layers`
    (EAGLE-3 taps) the hidden states entering those layers, concatenated [len(ids), n*H]
    (transformers' output_hidden_states[i] is the input of layer i)."""
    with torch.no_grad():
        out = hf(torch.tensor([list(ids)], dtype=torch.int64), output_hidden_states=True)
    if layers:
        return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).float().numpy()
    return out.hidden_states[-1][0].float().numpy()


def hf_draft_features(model, ids: Sequence[int]) -> np.ndarray:
    """What `model`'s draft head is fed for `ids` (a tests.conftest.TinyModel): the target's
    final features, or an EAGLE-3 export's taps."""
    return hf_features(model.hf, ids, model.manifest.target.feature_layers)


def hf_greedy(hf, prompt: Sequence[int], n: int, eos_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy loop over transformers' own forward and KV cache (torch.argmax = lowest
    id on ties); an EOS token is kept and ends the loop."""
    out = []
    with torch.no_grad():
        step = hf(torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(n):
            token = int(torch.argmax(step.logits[0, -1]))
            out.append(token)
            if token in eos_ids or len(out) == n:
                break
            step = hf(torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return out


def until_eos(tokens: Sequence[int], eos_ids: Sequence[int], n: int) -> list[int]:
    """The first n tokens, cut after the first EOS (kept)."""
    out = []
    for t in list(tokens)[:n]:
        out.append(int(t))
        if t in eos_ids:
            break
    return out


# --------------------------------------------------------------------------- graph runners


def eagle3_widths(backend) -> tuple[int, int] | None:
    """(head hidden, tapped width) when `backend` runs an EAGLE-3 draft graph, else None."""
    graph = getattr(backend, "graph", None)
    spec = next((s for s in getattr(graph, "inputs", ()) if s.name == c.TAPPED_FEATURES), None)
    return None if spec is None else (backend.dims.hidden, spec.shape[2])


def run_step(backend, kv, tokens, positions, mask, past: int, logits_at=None, features=None,
             from_target: bool = True) -> dict:
    """One forward through `backend`; returns copies of the outputs by contract name (backends
    reuse theirs). For an EAGLE-3 draft graph `features` go to `tapped_features` when
    `from_target` (the target's taps), else to `features` (the head's own)."""
    tokens = np.asarray(tokens, np.int64)[None]
    logits_at = np.arange(tokens.shape[1]) if logits_at is None else logits_at
    feats = None if features is None else np.ascontiguousarray(np.asarray(features, np.float32)[None])
    tapped = None
    if feats is not None:
        feats, tapped = feature_inputs(feats, from_target, eagle3_widths(backend))
    inputs = StepInputs(tokens, np.asarray(positions, np.int64)[None], np.asarray(mask, bool),
                        np.asarray(logits_at, np.int64)[None], feats, tapped)
    return {k: v.copy() for k, v in backend.run(inputs, kv, past).named().items()}


def prefill(backend, kv, tokens: Sequence[int], past: int = 0) -> dict:
    """Causal forward of `tokens` at rows/positions [past, past + len)."""
    n = len(tokens)
    return run_step(backend, kv, tokens, np.arange(past, past + n), causal_mask(past, n), past)


def run_tree(backend, kv, tree: DraftTree, past: int) -> dict:
    """Verification forward of `tree` over `past` cached rows (as Decoder.verify_forward)."""
    return run_step(backend, kv, tree.tokens, tree.positions(past), tree.attention_mask(past), past)


def kv_rows(kv, n: int) -> list[np.ndarray]:
    """Copies of rows [0, n) of every array of a KVBuffer, sequence-major ([n, batch, kv_heads,
    head_dim]) whatever its layout."""
    return [np.array(kv.rows(i)[:n]) for i in range(len(kv.arrays))]


def assert_kv_close(got: Sequence[np.ndarray], want: Sequence[np.ndarray], atol: float = 1e-4, what: str = "KV"):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}[{i}] shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"{what}[{i}]")


# --------------------------------------------------------------------------- instrumentation


def poison(kv: KVBuffer, start: int = 0) -> None:
    """Fill rows [start, capacity) of every KV array with NaN (numpy or torch), so that any
    read past the valid rows shows up as NaN."""
    for i in range(len(kv.arrays)):
        kv.rows(i)[start:] = float("nan")


@dataclass
class Call:
    """One recorded backend call (inputs copied)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray
    features: np.ndarray | None
    past: int


class RecordingBackend:
    """Wraps a Backend: records every call's inputs; with `poison`, fills rows
    [past, capacity) of the KV buffer with NaN before each call (so any read of a row the
    call does not own shows up as NaN) and checks the outputs are finite; with `limit`,
    asserts no call writes a row at or past `limit`."""

    def __init__(self, inner, poison: bool = False, limit: int | None = None):
        self.inner, self.poison, self.limit = inner, poison, limit
        self.name, self.kv_names = inner.name, inner.kv_names
        self.calls: list[Call] = []

    def allocate_kv(self, capacity: int):
        return self.inner.allocate_kv(capacity)

    def run(self, inputs: StepInputs, kv, past: int):
        S = inputs.input_ids.shape[1]
        if self.limit is not None:
            assert past + S <= self.limit, f"a call writes rows [{past}, {past + S}) past the limit {self.limit}"
        fed = inputs.features  # the rows' features: an EAGLE-3 extension's are its tapped_features
        if inputs.tapped_features is not None and inputs.tapped_features.shape[1]:
            fed = inputs.tapped_features
        self.calls.append(Call(inputs.input_ids[0].copy(), inputs.position_ids[0].copy(),
                               inputs.attention_mask[0].copy(), None if fed is None else fed[0].copy(), past))
        if self.poison:
            poison(kv, past)
        out = self.inner.run(inputs, kv, past)
        if self.poison:
            for name, arr in out.named().items():
                assert np.all(np.isfinite(arr)), f"{name} has non-finite values: a poisoned KV row was read"
            for i in range(len(kv.arrays)):
                assert np.all(np.isfinite(kv.rows(i)[past:past + S])), "present rows were not written"
        return out


class ScriptedDrafter:
    """A drafter whose trees a test dictates: `script(committed) -> list of token paths below
    the root`; earlier paths rank first among siblings. Replaces the head's proposals with any
    tree (cut to the request's max_depth and max_nodes)."""

    def __init__(self, script: Callable[[Sequence[int]], list[list[int]]]):
        self.script = script
        self.forwards = 0

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> DraftTree:
        paths = [p[: request.max_depth] for p in self.script(list(request.committed)) if p]
        tree = DraftTree.from_paths(int(request.committed[-1]), [p for p in paths if p])
        if tree.size > request.max_nodes:
            keep = np.arange(request.max_nodes)
            tree = DraftTree(tree.tokens[keep], tree.parents[keep], tree.scores[keep])
        return tree


class ReferenceScript:
    """Script for ScriptedDrafter / ForcingDrafter built on a reference continuation `ref` of
    `prompt`: `paths(pos)` gets the index of the next reference token and returns token paths.
    Checks on every call that the committed tokens still follow the reference."""

    def __init__(self, prompt: Sequence[int], ref: Sequence[int], paths: Callable[[int, list[int]], list[list[int]]]):
        self.prompt, self.ref, self.paths = list(prompt), list(ref), paths
        self.requests = 0

    def __call__(self, committed: Sequence[int]) -> list[list[int]]:
        n = len(self.prompt)
        pos = len(committed) - n
        assert list(committed[:n]) == self.prompt and list(committed[n:]) == self.ref[:pos], "output left the reference"
        self.requests += 1
        return self.paths(pos, self.ref)


def wrong_token(*avoid: int, vocab: int = 256) -> int:
    """A fixed token id (255, 254, ...) that is none of `avoid`."""
    return next(t for t in range(vocab - 1, 0, -1) if t not in avoid)


class ForcingDrafter:
    """Runs a real drafter's `propose` each round (so its KV and token-shift bookkeeping are
    exercised) but hands `script(committed)`'s tree to verification."""

    def __init__(self, inner, script):
        self.inner, self.script = inner, script
        self.call_marks: list[int] = []  # draft-backend calls made before each propose (RecordingBackend)

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, request: DraftRequest) -> DraftTree:
        self.call_marks.append(len(getattr(self.inner.backend, "calls", ())))
        real = self.inner.propose(request)
        assert real.size <= request.max_nodes
        paths = [p[: request.max_depth] for p in self.script(list(request.committed))]
        tree = DraftTree.from_paths(int(request.committed[-1]), [p for p in paths if p])
        assert tree.size <= request.max_nodes, "test script proposed more nodes than the KV has room for"
        return tree


class UnclippedDrafter:
    """A drafter that ignores `max_depth` (not `max_nodes`): shows that the decoder itself
    stops at max_new_tokens even inside an accepted chunk."""

    def __init__(self, script):
        self.script = script
        self.forwards = 0

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> DraftTree:
        tree = DraftTree.from_paths(int(request.committed[-1]), self.script(list(request.committed)))
        assert tree.size <= request.max_nodes
        return tree


@dataclass
class Round:
    """State right after one Decoder.commit."""

    committed: list[int]
    target_len: int
    path: list[int]
    chunk: list[int]
    finish_reason: str | None
    target_kv: list[np.ndarray]
    draft_len: int | None = None
    draft_kv: list[np.ndarray] | None = None


@dataclass
class CommitSpy:
    """Wraps `decoder.commit` (instance attribute) and snapshots state after every round."""

    decoder: object
    rounds: list[Round] = field(default_factory=list)

    def __post_init__(self):
        original = self.decoder.commit

        def commit(state, verification, features, max_new_tokens, stopper):
            chunk = original(state, verification, features, max_new_tokens, stopper)
            drafter = _inner_drafter(self.decoder.drafter)
            kv = getattr(drafter, "kv", None)
            dlen = getattr(drafter, "length", None)
            self.rounds.append(Round(list(state.committed), state.target_len, list(verification.path), list(chunk),
                                     state.finish_reason, kv_rows(self.decoder.kv, state.target_len),
                                     dlen, kv_rows(kv, dlen) if kv is not None else None))
            return chunk

        self.decoder.commit = commit


def _inner_drafter(drafter):
    return getattr(drafter, "inner", drafter)


def export_with_template(src, dst, template: str):
    """Copy an export folder with `template` as its tokenizer's chat template (the manifest
    says it has one; its file records follow the changed tokenizer)."""
    from transformers import AutoTokenizer

    from eagle_deploy.contract.verify import rerecord_files

    folder = clone_runtime_export(src, dst, chat_template=True)
    tok = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    tok.chat_template = template
    tok.save_pretrained(str(folder / "tokenizer"))
    rerecord_files(folder)
    return folder


def clone_runtime_export(src, dst, **manifest_changes):
    """Copy an export folder and edit its manifest (e.g. eos_token_ids)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    path = dst / c.MANIFEST_FILE
    data = json.loads(path.read_text())
    data.update(copy.deepcopy(manifest_changes))
    path.write_text(json.dumps(data))
    return dst


def gpu_skip_reason() -> str | None:
    """Why the GPU-only tests cannot run here (None on a CUDA host with TensorRT)."""
    try:
        import tensorrt  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any load failure means "not here"
        return f"TensorRT not installed ({type(err).__name__})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def qwen_pieces_missing() -> list[str]:
    """The qwen2.5-coder-0.5b chunk packages that are not installed (found without importing them)."""
    import importlib.util

    from eagle_deploy.exporter.models import CHUNKED

    return [c.package for c in CHUNKED["qwen2.5-coder-0.5b"].chunks if importlib.util.find_spec(c.module) is None]


def converted_qwen_or_skip():
    """The converted qwen2.5-coder-0.5b checkpoint in the cache (what an earlier eagle-export made
    of the assembled GGUF), or pytest.skip with what to do first (install the pieces, or export
    once: about 2 min); the tests do not convert it themselves."""
    import pytest

    from eagle_deploy.exporter.models import CHUNKED, converted_dir

    spec = CHUNKED["qwen2.5-coder-0.5b"]
    folder = converted_dir(spec.name, spec.sha256)
    if not (folder / "model.safetensors.index.json").is_file():
        reason = (f"install them first: {spec.install_line()}" if qwen_pieces_missing() else
                  "run `eagle-export --model qwen2.5-coder-0.5b --quant int4 --out engines/` once (about 2 min)")
        pytest.skip(f"no converted qwen2.5-coder-0.5b checkpoint in {folder.parent}: {reason}")
    return folder
