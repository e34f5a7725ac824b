"""The Python API (the one `eagle-run` uses): load an export folder once, then generate or
stream as many requests as you like.

    rt = EagleRuntime.load("engines/smollm2-135m")
    result = rt.generate("Write a haiku about rain.", max_new_tokens=64)
    s = rt.stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1)
    for delta in s:
        print(delta, end="")
    print(s.result.stats.mean_accept_len)
"""
from __future__ import annotations

import hashlib
import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Sequence

import numpy as np

from eagle_deploy.contract.cache import cache_root
from eagle_deploy.contract.cpu import cpu_info
from eagle_deploy.contract.errors import prompt_too_long
from eagle_deploy.contract.manifest import Manifest, ManifestError
from eagle_deploy.contract.onnx_io import MANIFEST_FILE
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.contract.verify import VerifyReport, sha256_file, verify_export

from .backends import Backend, load_backend
from .decode import PREFILL_CHUNK, Decoder, RoundObserver, Stats, TokenStopper
from .drafter import Drafter, EagleDrafter
from .hybrid import ALTERNATE_LEN, ALTERNATES, MAX_LOOKUP, check_drafter_kind, head_of, make_drafter, uses_draft_graph
from .planner import CostModel, measure_costs
from .sampling import SamplingParams, whole_number
from .text import TextStream, encode_chat

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class GenerationResult:
    """text (stop string excluded), token_ids (generated only; an EOS id is kept),
    finish_reason ("stop" | "length"), stats (a decode.Stats; `stats.to_json()` for JSON)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)


class Generation:
    """One streamed request (what `EagleRuntime.stream` returns): an iterator of text deltas;
    once it is exhausted, `result` is the request's GenerationResult.

        s = rt.stream("Hi")
        for delta in s:
            print(delta, end="")
        s.result.stats.mean_accept_len
    """

    def __init__(self, deltas: Generator[str, None, GenerationResult]):
        self._deltas = deltas
        self._result: GenerationResult | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration as done:
            if self._result is None:
                self._result = done.value
            raise

    @property
    def result(self) -> GenerationResult:
        """The finished request. Raises RuntimeError while deltas are still to come."""
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it to the end before reading its result")
        return self._result


def load_tokenizer(folder: Path, manifest: Manifest):
    """The export's tokenizer (transformers AutoTokenizer), or None for an export without one.
    Raises ManifestError when the folder the manifest names is missing or unreadable. The one
    loader of an export's tokenizer: EagleRuntime, BatchEngine, eagle-serve's frontend and
    eagle-validate all call it."""
    if not manifest.tokenizer:
        return None
    from transformers import AutoTokenizer

    tok_dir = Path(folder) / manifest.tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir)) if tok_dir.is_dir() else None
    except Exception as err:  # unreadable tokenizer files
        raise ManifestError(f"cannot load the tokenizer in {tok_dir} ({type(err).__name__}); re-export") from None
    if tokenizer is None:
        raise ManifestError(f"the tokenizer folder {tok_dir} named by the manifest is missing; re-export")
    return tokenizer


def device_costs(manifest: Manifest, tree: TreeConfig, target: Backend, draft: Backend | None,
                 folder: Path | None = None, threads: int | None = None) -> CostModel:
    """The cost model a planned drafter plans with: the curves of the export's last
    `eagle-bench --tune` when the manifest has them; else the costs measured for this export,
    tree, backend, thread count and CPU once and cached (`costs_cache_path`), so every process
    on this machine plans alike (and a seed gives the same tokens); else measured now
    (planner.measure_costs: the tree sizes the planner can choose, one draft expansion of
    top_k rows) and cached. A cache that cannot be written is skipped."""
    tuning = manifest.engines.tuning
    costs = CostModel.from_tuning(tuning.details) if tuning is not None else None
    if costs is not None:
        return costs
    path = costs_cache_path(folder, tree, target, draft, threads) if folder is not None else None
    if path is not None and path.is_file():
        try:
            return CostModel.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            try:  # a damaged or older cache entry is measured again
                path.unlink(missing_ok=True)
            except OSError:
                pass
    full = tree.total_tokens + MAX_LOOKUP + ALTERNATES * ALTERNATE_LEN
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < full] + [full]
    head = manifest.draft.head
    eagle3 = manifest.draft.head_kind == "eagle3"
    widths = (head.hidden, head.tapped_width(manifest.dims.hidden)) if eagle3 else None
    room = max(0, manifest.max_length - full - 1)
    pasts = sorted({min(64, room), min(1024, room)})
    costs = measure_costs(target, draft, sizes, max(tree.top_k, 1), manifest.dims.vocab,
                          head.hidden if eagle3 else manifest.dims.hidden, np.dtype(manifest.draft.dtype), widths,
                          pasts)
    if path is not None:  # the first process to finish measuring wins; every process then plans with its costs
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(costs.to_json()))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            costs = CostModel.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no cache here: plan with this process's own measurement
        finally:
            tmp.unlink(missing_ok=True)
    return costs


COSTS_METHOD = "fastest-of-rounds"  # part of the cache key: costs measured another way are measured again


def costs_cache_path(folder: Path, tree: TreeConfig, target: Backend, draft: Backend | None,
                     threads: int | None) -> Path:
    """<cache_root>/costs/<export>-<digest>.json, the digest over how costs are measured
    (COSTS_METHOD), the export's manifest, the tree, the backends, the thread count and the CPU
    model."""
    cpu = cpu_info()
    key = json.dumps([COSTS_METHOD, sha256_file(Path(folder) / MANIFEST_FILE), tree.to_json(),
                      MAX_LOOKUP, ALTERNATES, ALTERNATE_LEN, getattr(target, "name", "?"),
                      getattr(draft, "name", None), threads, cpu.model,
                      cpu.cores])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{Path(folder).resolve().name}-{digest}.json"


def row_exact_default(manifest: Manifest) -> bool:
    """Row-exact decoding (decode.Decoder) by default for quantised targets: their greedy EAGLE
    output then equals their vanilla greedy output token for token (measured on SmolLM2:
    20 / 20 prompts for int8 and int4, instead of 7 and 4) at -11 to -13% vanilla speed; fp32
    graphs keep their differences at the last bit and are identical without it."""
    return manifest.target.quant is not None


class EagleRuntime:
    """An export folder loaded once: target + draft backends, KV buffers, tokenizer.

    acceptance "threshold" is NOT lossless (see verify.verify_threshold); the default
    "lossless" reproduces the target's distribution exactly (greedy: token for token).
    """

    def __init__(self, folder: Path, manifest: Manifest, target, draft, tokenizer, tree: TreeConfig,
                 acceptance: str = "lossless", threshold: float = 0.0, drafter: Drafter | None = None,
                 round_observers: Sequence[RoundObserver] = (), row_exact: bool | None = None,
                 drafter_kind: str = "eagle", planned: bool = False, costs: CostModel | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        """target / draft: Backends (draft None with a custom `drafter`); row_exact: see
        Decoder (None: on for quantised targets, `row_exact_default`); round_observers: see
        Decoder. drafter_kind: "eagle" (the EAGLE head's tree), "hybrid" (head + context lookup
        in one tree) or "lookup" (hybrid.make_drafter); planned: size each round's draft by its
        expected tokens per second (planner.DraftPlanner), else draft the configured tree every
        round. The API's default is the plain EAGLE tree (`eagle`, unplanned: every round the
        same tree, so a seed gives the same tokens in every process); the commands default to
        hybrid.DEFAULT_DRAFTER, planned. costs: the device's CostModel (default: `device_costs`).
        prefill_chunk: rows per prefill forward of a long prompt (Decoder; 0: one forward).
        Raises ValueError on a bad acceptance setting, drafter kind or chunk."""
        self.folder, self.manifest, self.tokenizer, self.tree = Path(folder), manifest, tokenizer, tree
        self.drafter_kind, self.planned = check_drafter_kind(drafter_kind), planned
        self.costs = costs
        row_exact = row_exact_default(manifest) if row_exact is None else row_exact
        self.decoder = Decoder(target, None, manifest.max_length, acceptance, threshold, round_observers, row_exact,
                               prefill_chunk, manifest.length_limit)
        if drafter is None and (draft is not None or not uses_draft_graph(drafter_kind)):
            drafter = self._drafter(draft)
        self.decoder.drafter = drafter
        self.eos_ids = list(manifest.eos_token_ids)
        self._requests = 0  # requests started on this instance (see _stream)
        self._open_draft: Callable[[], Backend] | None = None  # set by load(with_draft=False)
        self.verification: VerifyReport | None = None  # what load's verify_export checked

    def _drafter(self, draft: Backend | None) -> Drafter:
        """The drafter of this runtime's kind over the draft-graph backend `draft` (a planned
        one measures the device's costs first, once: `device_costs`)."""
        head = None if draft is None else EagleDrafter.for_export(draft, self.tree, self.manifest)
        if self.planned and self.costs is None:
            self.costs = device_costs(self.manifest, self.tree, self.decoder.target, draft, self.folder,
                                      getattr(self.decoder.target, "threads", None))
        return make_drafter(self.drafter_kind, head, self.tree, self.planned, self.costs, self.decoder.row_exact)

    @classmethod
    def load(cls, folder, backend: str = "ort", tree: TreeConfig | None = None, threads: int | None = None,
             acceptance: str = "lossless", threshold: float = 0.0, drafter: Drafter | None = None,
             wrap_backend: Callable[[Backend], Backend] | None = None,
             round_observers: Sequence[RoundObserver] = (), with_draft: bool = True, verify: str = "fast",
             row_exact: bool | None = None, drafter_kind: str = "eagle",
             planned: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> "EagleRuntime":
        """Load `folder` (an eagle-export output). backend: "ort" (CPU), "ort-cuda", "trt".
        wrap_backend: applied to each loaded backend (target, draft) before use, e.g. a timing
        wrapper; round_observers: see Decoder. with_draft=False: open the target graph only
        (vanilla decoding, e.g. to measure its memory alone) until `load_draft()`.
        verify: "fast" | "full" | "off", how the folder's files are checked against the manifest
        before any graph is opened (contract.verify.verify_export: a mismatch raises
        ManifestError); its report is `self.verification`.
        drafter_kind / planned / prefill_chunk: see __init__ ("lookup" opens no draft graph).
        Raises ManifestError, TreeConfigError, FileNotFoundError, ValueError."""
        folder = Path(folder)
        check_drafter_kind(drafter_kind)
        manifest = Manifest.load(folder)
        verification = verify_export(folder, manifest, verify)
        tree = (tree or manifest.tree).validate(manifest.draft.graph_top_k)
        wrap = wrap_backend or (lambda b: b)
        target = wrap(load_backend(backend, folder, manifest, "target", threads, tree=tree))
        draft = None

        def open_draft() -> Backend:
            return wrap(load_backend(backend, folder, manifest, "draft", threads, tree=tree))

        if drafter is None and with_draft and uses_draft_graph(drafter_kind):
            draft = open_draft()
        tokenizer = load_tokenizer(folder, manifest)
        rt = cls(folder, manifest, target, draft, tokenizer, tree, acceptance, threshold, drafter, round_observers,
                 row_exact, drafter_kind, planned, prefill_chunk=prefill_chunk)
        if drafter is None and not with_draft and uses_draft_graph(drafter_kind):
            rt._open_draft = open_draft
        rt.verification = verification
        return rt

    def load_draft(self) -> None:
        """Open the draft graph of a runtime loaded with with_draft=False (no-op otherwise).
        Raises as load does."""
        if self._open_draft is None:
            return
        backend = self._open_draft()
        self._open_draft = None
        self.decoder.drafter = self._drafter(backend)

    def set_tree(self, tree: TreeConfig) -> None:
        """Use another draft tree from the next request on (a new drafter over the same draft
        backend; its KV buffer is sized for the new tree). Raises TreeConfigError."""
        drafter = self.decoder.drafter
        if self._open_draft is not None:  # the draft graph is not open yet: load_draft uses the tree
            self.tree = tree.validate(self.manifest.draft.graph_top_k)
            return
        head = head_of(drafter)
        if not uses_draft_graph(self.drafter_kind):
            self.tree = tree.validate(self.manifest.draft.graph_top_k)
            return
        if not isinstance(head, EagleDrafter):
            raise TypeError("set_tree needs the EAGLE drafter (this runtime uses a custom drafter)")
        self.tree = tree.validate(self.manifest.draft.graph_top_k)
        self.decoder.drafter = self._drafter(head.backend)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids. A string is wrapped in the chat template when the export has
        one (unless chat=False); a list of {"role", "content"} dicts always is; a list of ints
        is used as is. Raises ValueError on an empty prompt."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            check_unicode(prompt, "the prompt")
            use_chat = self.manifest.chat_template if chat is None else chat
            if use_chat:
                return self._chat_ids([{"role": "user", "content": prompt}])
            return list(self._tok().encode(prompt, add_special_tokens=True))
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if isinstance(m.get("content"), str):
                    check_unicode(m["content"], f"message {i}'s content")
            return self._chat_ids(prompt)
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            prompt = [int(t) for t in prompt]
            vocab = self.manifest.dims.vocab
            if any(t < 0 or t >= vocab for t in prompt):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            return prompt
        raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this export has no tokenizer; pass token ids")
        return self.tokenizer

    def _chat_ids(self, messages) -> list[int]:
        return encode_chat(self._tok(), messages)

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: Sequence[str] | str = (), mode: str = "eagle",
               chat: bool | None = None) -> Generation:
        """A `Generation`: iterate it for text deltas as tokens are committed; afterwards its
        `result` is the GenerationResult. mode: "eagle" or "vanilla" (same engine, one token
        per target forward). Raises ValueError on bad settings when called (before any
        forward), not at the first `next()`."""
        params, stop = check_request(max_new_tokens, temperature, top_p, top_k, seed, stop, mode)
        if mode == "eagle" and self._open_draft is not None:
            raise ValueError("this runtime was loaded without its draft graph (with_draft=False): call load_draft() "
                             "before EAGLE decoding")
        ids = self.prompt_ids(prompt, chat)
        if self.tokenizer is None and stop:
            raise ValueError("stop strings need a tokenizer")
        text = TextStream(self.tokenizer, self.eos_ids, stop) if self.tokenizer is not None else None
        return Generation(self._stream(ids, int(max_new_tokens), params, text, mode))

    def prompt_ids(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """`encode`, then check the prompt leaves room for output. Raises ValueError."""
        ids = self.encode(prompt, chat)
        if len(ids) >= self.manifest.max_length:
            raise ValueError(prompt_too_long(len(ids), self.manifest.max_length, self.manifest.length_limit))
        return ids

    def _stream(self, ids: list[int], max_new_tokens: int, params: SamplingParams, text: TextStream | None,
                mode: str) -> Generator[str, None, GenerationResult]:
        stopper = text or TokenStopper(self.eos_ids)
        stats = Stats(drafter=None if mode == "vanilla" else self.drafter_kind)
        tokens: list[int] = []
        # one request at a time owns the KV buffers: a stream resumed after another request
        # started on this instance would decode from overwritten KV, so it fails instead
        self._requests += 1
        me = self._requests
        for chunk in self.decoder.decode(ids, max_new_tokens, params, stopper, vanilla=(mode == "vanilla"),
                                         stats=stats):
            tokens += chunk
            if text is not None:
                delta = text.take()
                if delta:
                    yield delta
            if self._requests != me:
                raise RuntimeError("another request started on this EagleRuntime while this stream was paused; "
                                   "streams on one instance cannot be interleaved (load a second instance)")
        if text is not None:
            tail = text.take(final=True)
            if tail:
                yield tail
        return GenerationResult(text.text if text is not None else "", tokens, stats.finish_reason, stats)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: Sequence[str] | str = (), mode: str = "eagle",
                 chat: bool | None = None) -> GenerationResult:
        """Generate to completion; see `stream` for the arguments."""
        request = self.stream(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, mode, chat)
        for _ in request:
            pass
        return request.result


def check_unicode(text: str, what: str) -> None:
    """Raise ValueError unless `text` is valid Unicode (encodable as UTF-8): Python keeps the
    bytes of a command-line argument that is not UTF-8 as lone surrogates (U+DC80-U+DCFF), and
    no tokenizer takes those. `what` names the text in the message ("the prompt")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise ValueError(f"{what} is not valid UTF-8: the byte 0x{code - 0xDC00:02x} at character {err.start} "
                             "(text in another encoding?)") from None
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate \\u{code:04x} at character "
                         f"{err.start}") from None


def check_request(max_new_tokens, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  stop: Sequence[str] | str = (), mode: str = "eagle") -> tuple[SamplingParams, list[str]]:
    """Validate one request's settings (no model needed) -> (SamplingParams, stop list).
    A single string is one stop string. Raises ValueError naming the bad setting."""
    if mode not in ("eagle", "vanilla"):
        raise ValueError(f"mode must be 'eagle' or 'vanilla', got {mode!r}")
    whole_number(max_new_tokens, "max_new_tokens", 1)
    params = SamplingParams(temperature, top_p, top_k, seed)
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not isinstance(s, str) or s == "" for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    for s in stop:
        check_unicode(s, "a stop string")
    return params, stop
