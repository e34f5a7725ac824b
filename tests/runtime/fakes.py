"""Test doubles for the runtime tests of sampling, text, API and threshold acceptance.

`ScriptedTarget` is a fake target `Backend` whose next-token logits are any function of the
context. It keeps the token ids in its `KVBuffer` (so the decoder's KV compaction moves them
exactly as it moves real K/V rows) and reads each node's context through the attention mask,
so a wrong mask, position or compaction shows up as a wrong context. With it a test decides
exactly what text greedy decoding produces (multi-byte characters split across byte tokens,
stop strings at chosen places) while still going through `Decoder`, verification and
`TextStream`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from eagle_deploy.contract.manifest import Dims, DraftEntry, GraphEntry, HeadRecord, Manifest, Sources
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.backends.base import TargetOutputs
from eagle_deploy.runtime.kv import KVBuffer
from eagle_deploy.runtime.options import RuntimeOptions
from tests.helpers import ScriptedDrafter

HIDDEN = 4


class ScriptedTarget:
    """Fake target graph: `next_logits(context tuple) -> [V] logits`."""

    name = "scripted-target"

    def __init__(self, next_logits: Callable[[tuple], np.ndarray]):
        self.next_logits = next_logits
        self.kv_names = [("past_tokens", "present_tokens")]
        self.calls = 0

    def allocate_kv(self, capacity: int) -> KVBuffer:
        return KVBuffer(self.kv_names, [np.full((capacity, 1, 1, 1), np.nan)])

    def run(self, inputs, kv: KVBuffer, past: int) -> TargetOutputs:
        S = inputs.input_ids.shape[1]
        kv.check(past, S)
        inputs.check(past)
        self.calls += 1
        rows = kv.arrays[0]
        rows[past:past + S, 0, 0, 0] = inputs.input_ids[0]
        tokens = rows[:past + S, 0, 0, 0]
        assert not np.isnan(tokens).any(), "a KV row that was never written is in the context"
        tokens = tokens.astype(np.int64)
        mask = inputs.attention_mask[0]
        logits = [self.next_logits(tuple(int(t) for t in tokens[mask[j]])) for j in inputs.logits_indices[0]]
        return TargetOutputs(np.asarray(logits, np.float32)[None], np.zeros((1, S, HIDDEN), np.float32))

    @staticmethod
    def kv_tokens(kv: KVBuffer, n: int) -> list[int]:
        return [int(t) for t in kv.arrays[0][:n, 0, 0, 0]]


def fake_manifest(vocab: int = 256, max_length: int = 256, eos: Sequence[int] = (0,),
                  chat_template: bool = False) -> Manifest:
    graph = GraphEntry(path="none.onnx", dtype="float32", inputs=(), outputs=())
    draft = DraftEntry(path="none.onnx", dtype="float32", inputs=(), outputs=(), graph_top_k=10, trained=False,
                       draft_vocab_size=vocab, max_position_embeddings=max_length, head=HeadRecord(kind="eagle"))
    dims = Dims(num_layers=1, hidden=HIDDEN, num_heads=1, num_kv_heads=1, head_dim=1, vocab=vocab,
                max_position_embeddings=max_length, rms_norm_eps=1e-5)
    return Manifest(name="fake", dims=dims, max_length=max_length, target=graph, draft=draft,
                    tree=TreeConfig(), eos_token_ids=tuple(eos), tokenizer="tokenizer" if vocab else None,
                    chat_template=chat_template, sources=Sources(), tools={}, files={})


class Script:
    """Greedy target that continues `prompt` with `generation` (token ids) and then repeats
    `after`; any context off that script gets `off` as its argmax. `draft_depth` > 0 makes
    `drafter()` propose the script's next `draft_depth` tokens (every draft accepted, so a
    stop falls inside an accepted chunk); `wrong_at` (depth index) replaces one draft token
    by `off` so rounds also end early."""

    def __init__(self, prompt: Sequence[int], generation: Sequence[int], vocab: int = 256, after: int = 32,
                 off: int = 126):
        self.prompt, self.generation = list(prompt), list(generation)
        self.vocab, self.after, self.off = vocab, after, off

    def next_token(self, context: tuple) -> int:
        n = len(self.prompt)
        if list(context[:n]) != self.prompt:
            return self.off
        done = list(context[n:])
        if done != (self.generation + [self.after] * len(done))[:len(done)]:
            return self.off
        return self.generation[len(done)] if len(done) < len(self.generation) else self.after

    def logits(self, context: tuple) -> np.ndarray:
        row = np.zeros(self.vocab, np.float32)
        row[self.next_token(context)] = 8.0
        return row

    def future(self, committed: Sequence[int], k: int) -> list[int]:
        out, ctx = [], tuple(committed)
        for _ in range(k):
            t = self.next_token(ctx)
            out.append(t)
            ctx += (t,)
        return out

    def drafter(self, depth: int, wrong_at: int | None = None) -> ScriptedDrafter:
        def script(committed):
            if depth <= 0:
                return []
            path = self.future(committed, depth)
            if wrong_at is not None and wrong_at < depth:
                path[wrong_at] = self.off if path[wrong_at] != self.off else self.off + 1
            return [path]

        return ScriptedDrafter(script)


def scripted_runtime(script: Script, tokenizer, drafter=None, eos: Sequence[int] = (), max_length: int = 256,
                     acceptance: str = "lossless", threshold: float = 0.0) -> EagleRuntime:
    """An EagleRuntime over a ScriptedTarget (no ONNX at all)."""
    manifest = fake_manifest(script.vocab, max_length, eos)
    target = ScriptedTarget(script.logits)
    options = RuntimeOptions(tree=TreeConfig(), acceptance=acceptance,
                            threshold=threshold if acceptance == "threshold" else None)
    return EagleRuntime("fake", manifest, target, None, tokenizer, options,
                        drafter=drafter or ScriptedDrafter(lambda committed: []))
