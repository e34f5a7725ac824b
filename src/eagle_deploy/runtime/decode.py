"""The decode loop: prefill -> expand_tree -> verify -> commit.

One `Decoder` owns the target backend and its `KVBuffer` (allocated once) and a drafter.
Vanilla decoding is the same loop with root-only trees, so both modes share every line of
stop, capacity and KV handling.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from eagle_deploy.contract.errors import prompt_too_long

from .acceptance import SpecCounts, tau
from .backends.base import Backend, StepInputs, TargetOutputs
from .drafter import Drafter, DraftRequest, causal_mask
from .grammar import GrammarRows, GrammarState, mask_first
from .prefix_cache import PrefixCache, PrefixEntry
from .row_exact import step_rows, target_kv_capacity
from .sampling import SamplingParams, finite_number, greedy_token, sample, target_probs
from .shaping import LogitShaper, TokenLogprob, token_logprob
from .tree import DraftTree
from .verify import Verification, contiguous, verify_sampling, verify_threshold


class Stopper(Protocol):
    def push(self, token: int) -> str | None:
        """Record one committed token; return a finish reason ("stop") to end here."""
        ...


# called as f(tree, logits [n, V] float32, verification) after every verification round
RoundObserver = Callable[[DraftTree, np.ndarray, Verification], None]


@dataclass
class Stats:
    """Per-request counters; times in seconds. `to_json()` is the JSON form (eagle-run --json,
    eagle-bench records); acceptance figures are defined in `acceptance`.

    mode: "eagle" or "vanilla"; acceptance: "lossless" or "threshold" (NOT lossless); drafter:
    what proposed the drafts of an "eagle" request ("eagle": the head's tree, "hybrid": head +
    context lookup, "lookup": context lookup alone; set by EagleRuntime), None for vanilla or
    when no runtime set it.
    """

    mode: str = "eagle"
    drafter: str | None = None
    acceptance: str = "lossless"
    row_exact: bool = False  # decoded row-exact (Decoder, row_exact)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those whose KV and features came from the prefix cache
    new_tokens: int = 0
    finish_reason: str | None = None
    # which limit ended a "length" finish: "max_new_tokens", or "capacity" (the export's KV
    # capacity, max_length, was full first); None for "stop"
    limited_by: str | None = None
    accepted_per_round: list[int] = field(default_factory=list)  # tokens committed per verification round
    tree_depth_per_round: list[int] = field(default_factory=list)  # deepest draft node per round
    tree_size_per_round: list[int] = field(default_factory=list)  # nodes verified per round, root included
    draft_forwards: int = 0
    prefill_forwards: int = 1  # target forwards of the prompt (more than one when chunked: Decoder)
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_commit: float = 0.0
    t_total: float = 0.0
    t_grammar: float = 0.0  # seconds of grammar work (masks, pruning, forced tokens); 0 without a grammar
    grammar_masks: int = 0  # full-vocabulary masks computed

    @property
    def mean_accept_len(self) -> float:
        """tau (see `acceptance.tau`): tokens committed per verification forward, bonus token
        included; 0.0 when no round ran."""
        return tau(self.accepted_per_round) or 0.0

    @property
    def rounds(self) -> int:
        """Verification forwards (prefill excluded)."""
        return len(self.accepted_per_round)

    @property
    def round_tokens(self) -> int:
        """Tokens committed by the verification rounds."""
        return sum(self.accepted_per_round)

    @property
    def target_forwards(self) -> int:
        """Target forwards: the prefill's (prefill_forwards) plus one per round."""
        return self.rounds + self.prefill_forwards

    @property
    def draft_rounds(self) -> int:
        """Rounds that verified a draft (a tree beyond its root); the rest were vanilla steps
        (a cost-aware drafter found drafting would not pay, or no room was left)."""
        return sum(n > 1 for n in self.tree_size_per_round)

    @property
    def lossless(self) -> bool:
        return self.acceptance == "lossless"

    @property
    def tokens_per_s(self) -> float:
        """New tokens per wall second of the whole request (prefill included)."""
        return self.new_tokens / max(self.t_total, 1e-9)

    @property
    def decode_seconds(self) -> float:
        """Wall seconds after the prefill (the first token is the prefill's)."""
        return self.t_total - self.t_prefill

    def to_json(self) -> dict:
        """Plain-JSON form: counters, tau ("mean_accept_len"), speeds, times in ms."""
        decode_time = max(self.decode_seconds, 1e-9)
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "limited_by": self.limited_by,
            "target_forwards": self.target_forwards, "prefill_forwards": self.prefill_forwards,
            "draft_forwards": self.draft_forwards,
            "mean_accept_len": round(self.mean_accept_len, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "decode_tokens_per_s": round(max(self.new_tokens - 1, 0) / decode_time, 2),
            "ttft_ms": round(self.t_prefill * 1e3, 2),
            "time_ms": {"prefill": round(self.t_prefill * 1e3, 2), "draft": round(self.t_draft * 1e3, 2),
                        "verify": round(self.t_verify * 1e3, 2), "commit": round(self.t_commit * 1e3, 2),
                        "other": round((self.t_total - self.t_prefill - self.t_draft - self.t_verify
                                        - self.t_commit) * 1e3, 2),
                        "total": round(self.t_total * 1e3, 2)},
            "accepted_per_round": self.accepted_per_round, "tree_depth_per_round": self.tree_depth_per_round,
            "tree_size_per_round": self.tree_size_per_round, "draft_rounds": self.draft_rounds,
            "mode": self.mode, "drafter": self.drafter, "acceptance": self.acceptance, "lossless": self.lossless,
            "row_exact": self.row_exact,
            "grammar_ms": round(self.t_grammar * 1e3, 2), "grammar_masks": self.grammar_masks,
            "speculative": SpecCounts.from_stats(self).usage(),
        }


@dataclass
class _State:
    """One request in flight. The root (committed[-1]) is chosen but not yet in the target KV."""

    committed: list[int]
    target_len: int  # rows in the target KV
    features: np.ndarray  # [k, F] target features (EAGLE-3: taps) not yet fed to the drafter
    generated: int = 0
    finish_reason: str | None = None
    limited_by: str | None = None  # with finish_reason "length": "max_new_tokens" | "capacity"


@dataclass(frozen=True)
class _Unsettled:
    """A finished request whose answer is still to be settled into the prefix cache
    (Decoder.settle): every committed token, the prompt's length, and the prompt's features
    [prompt_len, F] (its KV rows are still in the buffer)."""

    tokens: list[int]
    prompt_len: int
    features: np.ndarray


PREFILL_CHUNK = 256  # EagleRuntime's default rows per prefill forward (Decoder, prefill_chunk)


def chunk_end(a: int, seq: int, chunk: int) -> int:
    """The end of the prefill chunk that starts at row `a` of a `seq`-row prompt: a + chunk,
    or seq when at most chunk + 1 rows are left (so the last chunk has 2 to chunk + 1 rows,
    never one)."""
    return seq if seq - a <= chunk + 1 else a + chunk


def check_prefill_chunk(chunk) -> int:
    """`chunk` (a whole number of rows >= 0; 0: the whole prompt in one forward), or ValueError."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"prefill_chunk must be a whole number of tokens >= 0 (0: off), got {chunk!r}")
    return chunk


def check_acceptance(acceptance: str, threshold: float) -> None:
    """ValueError unless acceptance is "lossless" or "threshold" with threshold in (0, 1]."""
    if acceptance not in ("lossless", "threshold"):
        raise ValueError(f"acceptance must be 'lossless' or 'threshold', got {acceptance!r}")
    if acceptance == "threshold" and not 0.0 < finite_number(threshold, "threshold") <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")


class Decoder:
    """Speculative (or vanilla) decoding over one target graph.

    acceptance: "lossless" (default) or "threshold" (NOT lossless; see verify_threshold).
    round_observers: each called as f(tree, logits [n, V] float32, verification) after every
    verification round (tuning, analysis); the arrays are the backend's, valid until the next
    forward. Raises ValueError on a bad acceptance setting.

    row_exact: make every committed token's logits the bits vanilla decoding computes for it,
    so greedy EAGLE output is exactly vanilla greedy output on graphs whose rows round
    differently by forward shape (quantised graphs: their int8 activation rounding turns
    last-bit attention differences into different tokens; tests/exporter/test_batch_invariance.py).
    Every causal row of a forward of two or more tokens is bit-identical on onnxruntime's CPU
    kernels; a one-token forward (a separate one-row kernel) and a tree row whose attention
    skips masked siblings are not. So: one-token forwards run as two rows (the token repeated
    one position on, its KV row overwritten by the next forward; the KV buffer has one spare
    row), verification trees are laid out depth-first (DraftTree.depth_first) and acceptance
    ends at the first accepted node off the top path (verify.contiguous), whose token becomes
    the bonus token. Its cost in speed: docs/decisions.md, 'greedy identity of quantised exports;
    row-exact decoding'.

    repeats_one_row: the target graph repeats a one-row query inside its attention itself
    (manifest target.extra.repeats_one_row, contract "One-row queries"; the KV buffer then has
    the spare row whatever row_exact says). With one_row_exact too (its matmuls give a row the
    same bits alone on this CPU: row_exact.matmuls_row_exact), a row-exact one-token forward runs
    as one row with the two-row forward's bits, only attention paying for the second row
    (docs/decisions.md, 2026-12-07); otherwise as two rows (`step_rows`).

    prefill_chunk: a prompt longer than prefill_chunk + 1 tokens is prefilled in forwards of
    prefill_chunk rows (chunk_end: the last 2 to prefill_chunk + 1, never one), each at the
    past the chunks before it wrote (0: one forward). The same rows as one forward (logits,
    features and KV bit-identical), and cheaper on a CPU, where onnxruntime's GroupQueryAttention
    costs more than linearly in the query rows of one call (docs/decisions.md, 'chunked prefill
    in the Decoder, and the attention kernels measured'). Raises ValueError on a bad acceptance
    setting or chunk.

    length_limit: the largest max_length a re-export of the model may have
    (Manifest.length_limit), named in the error for a prompt that does not fit (None: unknown).

    prefix_cache: reuse the KV and features of earlier sequences that share the prompt's
    first tokens (runtime/prefix_cache.py: bit-identical to a fresh prefill); a finished
    request is kept `unsettled` until `settle` stores it (None: no cache).

    prefill_target: the export's prefill graph (contract onnx_io, "Prefill graph"), which then
    runs the forwards flagged `StepInputs.prefill` (prefill_rows: a prompt's, and those `settle`
    stores) on the same KV buffer (None: the target). Decoding and verification stay on the
    target, so EAGLE and vanilla start from the same prefill (greedy: the same tokens).
    """

    def __init__(self, target: Backend, drafter: Drafter | None, max_length: int,
                 acceptance: str = "lossless", threshold: float = 0.0, round_observers: Sequence[RoundObserver] = (),
                 row_exact: bool = False, prefill_chunk: int = 0, length_limit: int | None = None,
                 prefix_cache: PrefixCache | None = None, repeats_one_row: bool = False,
                 one_row_exact: bool = True, prefill_target: Backend | None = None):
        check_acceptance(acceptance, threshold)  # fail at load, not after the first forward
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.target, self.drafter = target, drafter
        self.prefill_target = prefill_target
        self.max_length = max_length
        self.length_limit = length_limit  # the largest max_length a re-export may have (named in errors; None: unknown)
        self.row_exact, self.repeats_one_row, self.one_row_exact = row_exact, repeats_one_row, one_row_exact
        self.kv = target.allocate_kv(target_kv_capacity(max_length, row_exact, repeats_one_row))
        self.acceptance, self.threshold = acceptance, threshold
        self.round_observers = tuple(round_observers)
        self.prefix_cache = prefix_cache
        self.unsettled: _Unsettled | None = None  # the last request, finished and still to settle

    def decode(self, prompt: Sequence[int], max_new_tokens: int, params: SamplingParams,
               stopper: Stopper, vanilla: bool = False, stats: Stats | None = None,
               logprobs: list[TokenLogprob] | None = None, top_logprobs: int = 0,
               grammar: GrammarState | None = None, draft_forced: bool = True) -> Iterator[list[int]]:
        """Yield committed token chunks until a stop, `max_new_tokens`, or KV capacity;
        `stats` (if given) is filled in as the request runs, and `logprobs` (if given) gets one
        shaping.TokenLogprob per committed token, with its `top_logprobs` alternatives. A
        request's logit_bias and penalties shape, and its `grammar` masks, each tree node's
        row from its own path (shaping.LogitShaper, grammar.GrammarRows) as verification walks
        the tree; draft tokens the grammar forbids are pruned before the target runs, and with
        `draft_forced` the tokens it forces are drafted as a chain (grammar module doc)."""
        stats = stats if stats is not None else Stats()
        stats.mode = "vanilla" if vanilla else "eagle"
        stats.acceptance, stats.row_exact = self.acceptance, self.row_exact
        rng = params.rng()
        shaper = LogitShaper.of(params, prompt)
        t0 = time.perf_counter()
        state, first_logits = self.prefill(prompt, params, rng, stats, shaper, grammar)
        prompt_features = state.features
        first = self.commit_tokens(state, [state.committed.pop()], max_new_tokens, stopper)
        if shaper is not None:
            shaper.push(first)
        if grammar is not None:
            grammar.commit(first)
        if logprobs is not None:
            logprobs.append(token_logprob(first_logits, first[0], top_logprobs))
        stats.t_prefill = time.perf_counter() - t0
        yield first
        drafter = None if vanilla else self.drafter
        if drafter is not None:
            drafter.reset()
        while state.finish_reason is None:
            t1 = time.perf_counter()
            tree = self.expand_tree(state, drafter, max_new_tokens, grammar, draft_forced)
            t2 = time.perf_counter()
            logits, features = self.verify_forward(tree, state)
            t3 = time.perf_counter()
            row = None if shaper is None else shaper.rows(logits, tree)
            if grammar is not None:
                row = GrammarRows(tree, grammar, row or (lambda i, logits=logits: logits[i]))
            verification = self.accept(tree, logits, params, rng, row)
            if grammar is not None:
                row.done()
            for observe in self.round_observers:
                observe(tree, logits, verification)
            if logprobs is not None:  # before commit: the next forward reuses the backend's arrays
                logprobs.extend(token_logprob(logits[i], t, top_logprobs)
                                for i, t in zip(verification.path, verification.tokens))
            chunk = self.commit(state, verification, features, max_new_tokens, stopper)
            if logprobs is not None:
                del logprobs[len(logprobs) - len(verification.tokens) + len(chunk):]  # tokens after a stop
            if shaper is not None:
                shaper.push(chunk)
            if grammar is not None:
                grammar.commit(chunk)
            t4 = time.perf_counter()
            stats.t_draft, stats.t_verify, stats.t_commit = (stats.t_draft + t2 - t1, stats.t_verify + t3 - t2,
                                                             stats.t_commit + t4 - t3)
            stats.accepted_per_round.append(len(chunk))
            stats.tree_depth_per_round.append(int(tree.depths.max()))
            stats.tree_size_per_round.append(tree.size)
            yield chunk
        stats.new_tokens = state.generated
        stats.finish_reason, stats.limited_by = state.finish_reason, state.limited_by
        if self.prefix_cache is not None:  # ended, not closed early (a cancelled request is not kept)
            self.unsettled = _Unsettled(list(state.committed), len(prompt), prompt_features)
        stats.draft_forwards = drafter.forwards if drafter is not None else 0
        stats.t_total = time.perf_counter() - t0
        if grammar is not None:
            stats.t_grammar, stats.grammar_masks = grammar.seconds, grammar.masks

    def prefill(self, prompt: Sequence[int], params: SamplingParams, rng, stats: Stats,
                shaper: LogitShaper | None = None, grammar: GrammarState | None = None) -> tuple[_State, np.ndarray]:
        """Run the prompt (its first rows copied from the prefix cache when it holds them);
        -> (the state with its first token chosen, that token's [V] row of target logits, a
        copy)."""
        n = len(prompt)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_length:
            raise ValueError(prompt_too_long(n, self.max_length, self.length_limit))
        stats.prompt_tokens = n
        self.unsettled = None  # this request's rows overwrite the last one's
        cached, features = 0, []
        if self.prefix_cache is not None and n >= 2:  # the rest, n - cached >= 2 rows, is prefilled (module doc)
            cached, entry = self.prefix_cache.match(prompt, n - 2)
            if entry is not None:
                entry.load(self.kv, cached)
                features.append(entry.features[:cached])
        stats.cached_tokens = cached
        out, computed = self.prefill_rows(prompt, cached)
        stats.prefill_forwards = len(computed)
        features += computed
        logits = out.logits[0, 0].copy()
        shaped = logits if shaper is None else shaper.row(logits)
        if grammar is not None:
            shaped = mask_first(grammar, shaped)
        token = greedy_token(shaped) if params.greedy else sample(target_probs(shaped, params), rng)
        state = _State(list(prompt) + [token], n, features[0] if len(features) == 1 else np.concatenate(features))
        return state, logits

    def prefill_rows(self, tokens: Sequence[int], start: int) -> tuple[TargetOutputs, list[np.ndarray]]:
        """Run tokens[start:] at past `start` as a prompt is run: one forward, or forwards of
        prefill_chunk rows (chunk_end: the last 2 to prefill_chunk + 1, never one; see the
        class doc). -> (the last forward's outputs, holding its last row's logits; each
        forward's draft features [rows, F], copies)."""
        ids, a, features = np.asarray(tokens, np.int64)[None], start, []
        n = ids.shape[1]
        while a < n:
            b = chunk_end(a, n, self.prefill_chunk) if self.prefill_chunk else n
            out = self.run_target(StepInputs(ids[:, a:b], np.arange(a, b)[None], causal_mask(a, b - a),
                                             np.array([[b - a - 1]]), prefill=True), a)
            features.append(out.draft_features[0].copy())  # the backend reuses its output arrays
            a = b
        return out, features

    def settle(self, answer: bool = True) -> float:
        """Store the last finished request (`unsettled`), prompt and answer, in the prefix
        cache: the answer's rows, computed by verification and one-token forwards, are run
        again as prefill forwards at past = the prompt's length, so every stored row is a
        prefill row (runtime/prefix_cache.py). answer=False stores the prompt's rows alone, with
        no forward (what a busy server can afford: a shared system prompt still hits). Call it
        before the next request (whose prefill drops what is unsettled); an answer that would
        not fit the budget is not run. -> seconds spent (0.0: nothing to settle, or no cache)."""
        done, self.unsettled = self.unsettled, None
        if done is None or self.prefix_cache is None:
            return 0.0
        t0 = time.perf_counter()
        if not answer:
            if done.prompt_len < 2:  # a one-token prompt's row came from a one-row forward
                return 0.0
            prompt = done.tokens[: done.prompt_len]
            self.prefix_cache.store(PrefixEntry.of(prompt, self.kv, done.features[: done.prompt_len]))
            return time.perf_counter() - t0
        tokens = done.tokens[: self.max_length]  # the last token of a full buffer has no row
        row_bytes = 8 + done.features[0].nbytes + sum(self.kv.rows(i)[0].nbytes for i in range(len(self.kv.arrays)))
        if len(tokens) * row_bytes > self.prefix_cache.budget:
            return 0.0
        # the prompt's rows are prefill rows already (a one-token prompt's came from a one-row
        # forward: run it again); the last forward has two rows or more
        start = min(done.prompt_len, len(tokens) - 2) if done.prompt_len >= 2 else 0
        _, computed = self.prefill_rows(tokens, start)
        features = np.concatenate([done.features[:start], *computed])
        self.prefix_cache.store(PrefixEntry.of(tokens, self.kv, features))
        seconds = time.perf_counter() - t0
        self.prefix_cache.settled(seconds)
        return seconds

    def expand_tree(self, state: _State, drafter: Drafter | None, max_new_tokens: int,
                    grammar: GrammarState | None = None, draft_forced: bool = True) -> DraftTree:
        """This round's draft tree: the drafter's proposal (none for vanilla decoding), with a
        grammar the nodes it forbids pruned, or, where it forces the next tokens, that chain."""
        root = state.committed[-1]
        room = self.max_length - state.target_len  # KV rows left for this round's tree
        left = max_new_tokens - state.generated  # a path of depth d commits d + 1 tokens
        if drafter is None or room <= 1 or left <= 1:
            return DraftTree.root_only(root)
        request = DraftRequest(state.committed, state.features, state.target_len, room, max_depth=min(left, room) - 1)
        if grammar is not None and draft_forced:
            forced = grammar.forced(min(left, room) - 1)
            if forced:  # the only legal continuation: every other draft would be pruned
                drafter.propose(replace(request, max_nodes=1, max_depth=0))  # keeps up with the context, drafts none
                return DraftTree.from_paths(root, [forced])
        tree = drafter.propose(request)
        if grammar is not None:
            tree = grammar.prune(tree)
        return tree.depth_first() if self.row_exact else tree

    def verify_forward(self, tree: DraftTree, state: _State) -> tuple[np.ndarray, np.ndarray]:
        """One target forward over the tree; returns (logits [n, V], the draft head's features
        [n, F]: TargetOutputs.draft_features)."""
        n, past = tree.size, state.target_len
        out = self.run_target(StepInputs(tree.tokens[None], tree.positions(past)[None], tree.attention_mask(past),
                                         np.arange(n)[None]), past)
        return out.logits[0], out.draft_features[0]

    @property
    def step_rows(self) -> int:
        """Rows a one-token target forward runs through the graph's matmuls (row_exact.step_rows)."""
        return step_rows(self.row_exact, self.repeats_one_row, self.one_row_exact)

    def run_target(self, inputs: StepInputs, past: int):
        """One target forward (a forward flagged `prefill` on prefill_target when there is
        one); with row_exact a one-token forward runs as two causal rows (the token repeated at
        the next position) and only row 0's outputs are returned, unless the graph repeats the
        row itself and one row is exact here (step_rows 1: one row in, its two-row bits out)."""
        graph = self.prefill_target if inputs.prefill and self.prefill_target is not None else self.target
        if self.step_rows == 1 or inputs.input_ids.shape[1] != 1:
            return graph.run(inputs, self.kv, past)
        twice = StepInputs(np.repeat(inputs.input_ids, 2, axis=1),
                           np.concatenate([inputs.position_ids, inputs.position_ids + 1], axis=1),
                           causal_mask(past, 2), inputs.logits_indices, prefill=inputs.prefill)
        out = graph.run(twice, self.kv, past)
        tapped = None if out.tapped_features is None else out.tapped_features[:, :1]
        return replace(out, features=out.features[:, :1], tapped_features=tapped)

    def accept(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng,
               row: Callable[[int], np.ndarray] | None = None) -> Verification:
        """Verify `tree` against its logits [n, V] (row(node): a node's shaped / masked row
        instead, read along the walked path only)."""
        if self.acceptance == "threshold":
            v = verify_threshold(tree, logits, params, rng, self.threshold, row)
        else:
            v = verify_sampling(tree, logits, params, rng, row)
        return contiguous(v) if self.row_exact else v

    def commit(self, state: _State, verification: Verification, features: np.ndarray,
               max_new_tokens: int, stopper: Stopper) -> list[int]:
        """Commit accepted + bonus tokens up to any stop; compact their KV into place."""
        chunk = self.commit_tokens(state, verification.tokens, max_new_tokens, stopper)
        kept = verification.path[: len(chunk)]  # the root and the accepted nodes now in context
        self.kv.compact(state.target_len, kept)
        state.features = features[kept].copy()
        state.target_len += len(kept)
        if state.finish_reason is None and state.target_len >= self.max_length:
            state.finish_reason, state.limited_by = "length", "capacity"
        return chunk

    def commit_tokens(self, state: _State, tokens: Sequence[int], max_new_tokens: int, stopper: Stopper) -> list[int]:
        """Append tokens one by one; stop at the first that ends the request."""
        chunk = []
        for token in tokens:
            chunk.append(int(token))
            state.committed.append(int(token))
            state.generated += 1
            reason = stopper.push(int(token))
            if reason is None and state.generated >= max_new_tokens:
                reason, state.limited_by = "length", "max_new_tokens"
            if reason is not None:
                state.finish_reason = reason
                break
        return chunk


class TokenStopper:
    """Stops on any of `eos_ids` (the token is kept, as plain greedy decoding keeps it)."""

    def __init__(self, eos_ids: Sequence[int] = (), on_token: Callable[[int], str | None] | None = None):
        self.eos_ids = set(int(e) for e in eos_ids)
        self.on_token = on_token

    def push(self, token: int) -> str | None:
        if token in self.eos_ids:
            return "stop"
        return self.on_token(token) if self.on_token else None
