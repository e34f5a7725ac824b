"""The Python API (the one `eagle-run` uses): load an export folder once, then generate or
stream as many requests as you like.

    rt = EagleRuntime.load("engines/smollm2-135m")
    result = rt.generate("Write a haiku about rain.", max_new_tokens=64)
    s = rt.stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1)
    for delta in s:
        print(delta, end="")
    print(s.result.stats.mean_accept_len)

With a prefix cache (`prefix_cache_mb`, runtime/prefix_cache.py) a request that starts with an
earlier request's tokens, its answer included, reuses their KV: a chat's next turn prefills
only what is new (`result.stats.cached_tokens` says how many tokens were reused).

    rt = EagleRuntime.load("engines/smollm2-135m", prefix_cache_mb=256)
    chat = [{"role": "user", "content": "Name a colour."}]
    chat.append({"role": "assistant", "content": rt.generate(chat).text})
    chat.append({"role": "user", "content": "And another one?"})
    rt.generate(chat).stats.cached_tokens   # the first turn, answer included
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Sequence

from eagle_deploy.contract.errors import SettingError, prompt_too_long
from eagle_deploy.contract.manifest import Manifest, ManifestError
from eagle_deploy.contract.onnx_io import KV_SHARED
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.contract.verify import VerifyReport, verify_export

from .backends import Backend, load_backend
from .costs import CostModel, device_costs
from .decode import Decoder, RoundObserver, Stats, TokenStopper
from .drafter import Drafter, EagleDrafter
from .grammar import Grammar, GrammarState, GrammarTokenizer
from .hybrid import LOOKUP_ROWS, head_of, make_drafter, uses_draft_graph
from .options import RuntimeOptions
from .prefix_cache import PrefixCache
from .request import Prompt, Request
from .row_exact import matmuls_row_exact
from .shaping import TokenLogprob
from .text import TextStream, encode_prompt
from .tools import parse_tool_calls, tool_grammar


@dataclass
class GenerationResult:
    """text (stop string excluded), token_ids (generated only; an EOS id is kept),
    finish_reason ("stop" | "length" | "cancelled": Generation.cancel | "tool_calls"), stats (a
    decode.Stats; `stats.to_json()` for JSON), logprobs (with Request.logprobs: one
    shaping.TokenLogprob per token of token_ids; else None), tool_calls (with Request.tools: the
    calls the output made, OpenAI's form, the text then being what is outside them; else None)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict] | None = None


class Generation:
    """One streamed request (what `EagleRuntime.stream` returns): an iterator of text deltas;
    once it is exhausted, `result` is the request's GenerationResult.

        s = rt.stream("Hi")
        for delta in s:
            print(delta, end="")
        s.result.stats.mean_accept_len

    With a prefix cache, the iteration's end also settles the request into it
    (`EagleRuntime.settle`) unless `defer_settle()` was called.
    """

    def __init__(self, deltas: Generator[str, None, GenerationResult], logprobs: list[TokenLogprob] | None = None,
                 stop: threading.Event | None = None, tokens: list[int] | None = None,
                 settle: Callable[[], float] | None = None):
        """logprobs: the list the request fills as tokens are committed (Request.logprobs), or
        None; read it while streaming through `logprobs`. stop: set by `cancel`; tokens: the
        list the request fills with its committed tokens; settle: the runtime's `settle`."""
        self._deltas = deltas
        self._result: GenerationResult | None = None
        self.logprobs = logprobs  # one TokenLogprob per token committed so far (a text delta may lag behind)
        self._stop = stop or threading.Event()
        self._tokens = tokens if tokens is not None else []
        self._stepping = threading.Lock()  # held while a step runs: cancel closes only a paused stream
        self._settle = settle
        self._settle_at_end = True

    def cancel(self) -> None:
        """Stop the request before its next verification round: the iteration then ends and
        `result.finish_reason` is "cancelled" (the tokens committed so far are kept).
        Thread-safe, from any thread; a no-op once the request has finished. A stream paused
        between deltas is closed at once, so the runtime's buffers are free for the next request
        without iterating it again (its `result` then holds the token ids committed so far and no
        text). The one way to stop a request: eagle-serve (a client gone, a deadline) and the
        Triton worker use it."""
        self._stop.set()
        if self._result is not None or not self._stepping.acquire(blocking=False):
            return  # finished, or a step is running in another thread: it stops before its next round
        try:
            self._deltas.close()  # a paused (or unstarted) stream: its finally frees the buffers
        finally:
            self._stepping.release()
        if self._result is None:
            stats = Stats(finish_reason="cancelled")
            self._result = GenerationResult("", list(self._tokens), "cancelled", stats, self.logprobs)

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        try:
            with self._stepping:
                return next(self._deltas)
        except StopIteration as done:
            if self._result is None:
                self._result = done.value
            if self._settle_at_end:
                self.settle()
            raise

    def defer_settle(self) -> None:
        """Do not settle when the iteration ends: the caller calls `settle()` itself (eagle-serve
        sends the response first, then settles)."""
        self._settle_at_end = False

    def settle(self, answer: bool = True) -> float:
        """Settle the finished request into its runtime's prefix cache (EagleRuntime.settle;
        answer=False: its prompt alone, no forward), once; -> seconds spent (0.0 before the
        end, when done already, or with no cache)."""
        if self._result is None or self._settle is None:
            return 0.0
        settle, self._settle = self._settle, None
        return settle(answer)

    @property
    def result(self) -> GenerationResult:
        """The finished request. Raises RuntimeError while deltas are still to come."""
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it to the end before reading its result")
        return self._result


def load_tokenizer(folder: Path, manifest: Manifest):
    """The export's tokenizer (transformers AutoTokenizer), or None for an export without one.
    Raises ManifestError when the folder the manifest names is missing or unreadable. The one
    loader of an export's tokenizer: EagleRuntime, BatchRuntime, eagle-serve's frontend and
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


def row_exact_default(manifest: Manifest) -> bool:
    """Row-exact decoding (decode.Decoder) by default for quantised targets: their greedy EAGLE
    output then equals their vanilla greedy output token for token, at a cost in vanilla speed
    that graphs repeating one-row queries themselves (manifest `target.extra.repeats_one_row`,
    runtime/row_exact.py) mostly give back (docs/decisions.md, 'greedy identity of quantised
    exports; row-exact decoding'); fp32
    graphs keep their differences at the last bit and are identical without it."""
    return manifest.target.quant is not None


class EagleRuntime:
    """An export folder loaded once: target + draft backends, KV buffers, tokenizer, decoded
    as its `options` (a RuntimeOptions: the one set of defaults) say.

    One request at a time owns the KV buffers. A request started from another thread while
    one runs waits until it has ended (requests from several threads are served one after
    another, each answer correct); a second request started from the same thread while a
    stream of it is paused takes the buffers over, and the paused stream then raises
    RuntimeError instead of decoding from overwritten KV. For requests decoded at once, use a
    `BatchRuntime` (or one instance per thread).

    acceptance "threshold" is NOT lossless (see verify.verify_threshold); the default
    "lossless" reproduces the target's distribution exactly (greedy: token for token).
    """

    def __init__(self, folder: Path, manifest: Manifest, target, draft, tokenizer,
                 options: RuntimeOptions | None = None, drafter: Drafter | None = None,
                 round_observers: Sequence[RoundObserver] = (), costs: CostModel | None = None,
                 prefix_cache: PrefixCache | None = None, prefill: Backend | None = None):
        """target / draft: Backends (draft None with a custom `drafter`); prefill: the export's
        prefill graph's backend, run for prompt forwards (Decoder.prefill_target; None: the
        target runs them; `load` opens it as options.uses_prefill_graph says); options: how to
        decode (RuntimeOptions; its tree None: the manifest's); round_observers: see Decoder;
        costs: the device's CostModel for a planned drafter (default: `device_costs`);
        prefix_cache: a cache to share (BatchRuntime: one for every slot; default: a new one of
        options.prefix_cache_mb, None when that is 0), filled by runtimes that prefill with the
        same graph (prefix_cache.py).
        Raises SettingError (a ValueError) on options the export cannot take."""
        options = RuntimeOptions.of(options)
        self.folder, self.manifest, self.tokenizer = Path(folder), manifest, tokenizer
        self.tree = (options.tree or manifest.tree).validate(manifest.draft.graph_top_k)
        row_exact = row_exact_default(manifest) if options.row_exact is None else options.row_exact
        self.options = options.replace(tree=self.tree, row_exact=row_exact)
        self.costs = costs
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache.of_mb(options.prefix_cache_mb)
        if self.prefix_cache is not None and manifest.target.kv_layout != KV_SHARED:
            raise SettingError("prefix_cache_mb", f"needs the fused target graph (KV layout {KV_SHARED!r}); this "
                                                  f"export's has {manifest.target.kv_layout!r} (--graph standard), "
                                                  "whose rows differ in the last bit when a prompt runs in parts: "
                                                  "set it to 0 or re-export without --graph standard")
        self.decoder = Decoder(target, None, manifest.max_length, options.acceptance, options.threshold_or_zero,
                               round_observers, row_exact, options.prefill_chunk, manifest.length_limit,
                               self.prefix_cache, manifest.target.repeats_one_row,
                               matmuls_row_exact(manifest.target), prefill)
        if drafter is None and (draft is not None or not uses_draft_graph(options.drafter_kind)):
            drafter = self._drafter(draft)
        self.decoder.drafter = drafter
        self.eos_ids = list(manifest.eos_token_ids)
        self._requests = 0  # requests started on this instance (see _stream)
        self._owner: int | None = None  # the thread whose request owns the KV buffers now
        self._free = threading.Condition()
        self._open_draft: Callable[[], Backend] | None = None  # set by load(with_draft=False)
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built on the first response_format
        self.verification: VerifyReport | None = None  # what load's verify_export checked

    @property
    def drafter_kind(self) -> str:
        return self.options.drafter_kind

    @property
    def planned(self) -> bool:
        return self.options.planned

    def _drafter(self, draft: Backend | None) -> Drafter:
        """The drafter of this runtime's kind over the draft-graph backend `draft` (a planned
        one measures the device's costs first, once: `device_costs`)."""
        head = None if draft is None else EagleDrafter.for_export(draft, self.tree, self.manifest)
        if self.planned and self.costs is None:
            self.costs = device_costs(self.manifest, self.tree, self.decoder.target, draft, self.folder,
                                      getattr(self.decoder.target, "threads", None), extra_rows=LOOKUP_ROWS)
        return make_drafter(self.drafter_kind, head, self.tree, self.planned, self.costs, self.decoder.row_exact,
                            self.decoder.step_rows)

    @classmethod
    def load(cls, folder, options: RuntimeOptions | None = None, *, drafter: Drafter | None = None,
             wrap_backend: Callable[[Backend], Backend] | None = None,
             round_observers: Sequence[RoundObserver] = (), with_draft: bool = True, **changes) -> "EagleRuntime":
        """Load `folder` (an eagle-export output) to decode as `options` say (RuntimeOptions;
        default: RuntimeOptions(), the commands' defaults), with `changes` to single options on
        top (`EagleRuntime.load(folder, threads=2, drafter_kind="eagle")`).
        drafter: a custom Drafter instead of the options' kind. wrap_backend: applied to each
        loaded backend (target, draft) before use, e.g. a timing wrapper; round_observers: see
        Decoder. with_draft=False: open the target graph only (vanilla decoding, e.g. to
        measure its memory alone) until `load_draft()`. The export's prefill graph is opened
        too where options.uses_prefill_graph (manifest `prefill`, prefill_graph "auto", backend
        "ort"), else never. The folder's files are checked against the manifest first
        (options.verify; its report is `self.verification`).
        Raises SettingError (ValueError), TypeError (an unknown option), ManifestError,
        TreeConfigError, FileNotFoundError."""
        options = RuntimeOptions.of(options, **changes)
        folder = Path(folder)
        manifest = Manifest.load(folder)
        verification = verify_export(folder, manifest, options.verify)
        tree = (options.tree or manifest.tree).validate(manifest.draft.graph_top_k)
        options = options.replace(tree=tree)
        wrap = wrap_backend or (lambda b: b)
        target = wrap(load_backend(options.backend, folder, manifest, "target", options.threads, tree=tree))
        prefill = (wrap(load_backend(options.backend, folder, manifest, "prefill", options.threads))
                   if options.uses_prefill_graph(manifest) else None)
        draft = None

        def open_draft() -> Backend:
            return wrap(load_backend(options.backend, folder, manifest, "draft", options.threads, tree=tree))

        graph = drafter is None and uses_draft_graph(options.drafter_kind)
        if graph and with_draft:
            draft = open_draft()
        rt = cls(folder, manifest, target, draft, load_tokenizer(folder, manifest), options, drafter, round_observers,
                 prefill=prefill)
        if graph and not with_draft:
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
        tree = tree.validate(self.manifest.draft.graph_top_k)
        head = head_of(self.decoder.drafter)
        if self._open_draft is None and uses_draft_graph(self.drafter_kind) and not isinstance(head, EagleDrafter):
            raise TypeError("set_tree needs the EAGLE drafter (this runtime uses a custom drafter)")
        self.tree, self.options = tree, self.options.replace(tree=tree)
        if self._open_draft is None and uses_draft_graph(self.drafter_kind):  # else load_draft uses the tree
            self.decoder.drafter = self._drafter(head.backend)

    def encode(self, prompt: Prompt | Request, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids (text.encode_prompt, the one encoder: a string through the chat
        template when the export has one, unless chat=False; chat messages always, with the
        request's tools; token ids as they are). Raises SettingError (a ValueError) on a prompt
        Request refuses, a token id outside the vocabulary or tools the template cannot render,
        ValueError when the export has no tokenizer or its template refuses the messages."""
        request = prompt if isinstance(prompt, Request) else Request(prompt, chat=chat)
        return encode_prompt(self.tokenizer, request, self.manifest.chat_template, self.manifest.dims.vocab,
                             self.manifest.name)

    def prompt_ids(self, prompt: Prompt | Request, chat: bool | None = None) -> list[int]:
        """`encode`, then check the prompt is some tokens and leaves room for output in the KV
        capacity. Raises SettingError (a ValueError) and what `encode` raises."""
        ids = self.encode(prompt, chat)
        if not ids:
            raise SettingError("prompt", "encodes to no tokens")
        if len(ids) >= self.manifest.max_length:
            raise SettingError("prompt", prompt_too_long(len(ids), self.manifest.max_length,
                                                         self.manifest.length_limit).removeprefix("the prompt "))
        return ids

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this export has no tokenizer; pass token ids")
        return self.tokenizer

    def request(self, prompt: Prompt | Request, max_new_tokens: int | None = None, **settings) -> Request:
        """The Request for `prompt` and `settings` (Request's fields; a Request is returned
        as is and takes no settings). Raises SettingError, TypeError for a setting Request
        does not have."""
        if isinstance(prompt, Request):
            if max_new_tokens is not None or settings:
                raise TypeError("pass either a Request or a prompt with settings, not both")
            return prompt
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        return Request(prompt, **settings)

    def stream(self, prompt: Prompt | Request, max_new_tokens: int | None = None, **settings) -> Generation:
        """A `Generation`: iterate it for text deltas as tokens are committed; afterwards its
        `result` is the GenerationResult. prompt: a Request, or a prompt with Request's
        fields as keywords (max_new_tokens, temperature, top_p, top_k, seed, stop, mode "eagle" |
        "vanilla", chat). Raises SettingError (a ValueError) on bad settings when called
        (before any forward), not at the first `next()`."""
        request = self.request(prompt, max_new_tokens, **settings)
        if request.mode == "eagle" and self._open_draft is not None:
            raise ValueError("this runtime was loaded without its draft graph (with_draft=False): call load_draft() "
                             "before EAGLE decoding")
        ids = self.prompt_ids(request)
        request.check_vocab(self.manifest.dims.vocab)
        grammar = self.grammar_for(request)
        grammar = grammar.state() if grammar is not None else None
        if self.tokenizer is None and request.stop:
            raise SettingError("stop", "needs a tokenizer (this export has none)")
        text = TextStream(self.tokenizer, self.eos_ids, request.stop) if self.tokenizer is not None else None
        logprobs = None if request.logprobs is None else []
        stop, tokens = threading.Event(), []
        return Generation(self._stream(ids, request, text, logprobs, stop, grammar, tokens), logprobs, stop, tokens,
                          self.settle if self.prefix_cache is not None else None)

    def grammar_for(self, request: Request) -> Grammar | None:
        """The grammar a request's output follows, compiled for this export's tokenizer: its
        tool_choice "required" / named function (tools.tool_grammar), else its response_format;
        None for plain text. Raises SettingError naming the field when it cannot be enforced,
        ValueError when the export has no tokenizer."""
        lark = tool_grammar(request.tools, request.tool_choice)
        if lark is None and request.response_format is None:
            return None
        if self._grammar_tokenizer is None:
            eos = self.eos_ids[0] if self.eos_ids else None
            if eos is None:
                raise SettingError("response_format" if lark is None else "tool_choice",
                                   "needs an export with an end-of-sequence token id")
            self._grammar_tokenizer = GrammarTokenizer(self._tok(), self.manifest.dims.vocab, eos)
        if lark is not None:
            return Grammar.from_lark(self._grammar_tokenizer, lark, "tools")
        return Grammar.compile(self._grammar_tokenizer, request.response_format)

    def _stream(self, ids: list[int], request: Request, text: TextStream | None, logprobs: list[TokenLogprob] | None,
                stop: threading.Event, grammar: GrammarState | None, tokens: list[int]
                ) -> Generator[str, None, GenerationResult]:
        vanilla = request.mode == "vanilla"
        stats = Stats(drafter=None if vanilla else self.drafter_kind)
        if stop.is_set():  # cancelled before it started: no forward, the buffers untouched
            stats.finish_reason = "cancelled"
            return GenerationResult("", [], "cancelled", stats, logprobs)
        me = self._claim()
        chunks = self.decoder.decode(ids, request.max_new_tokens, request.sampling, text or TokenStopper(self.eos_ids),
                                     vanilla=vanilla, stats=stats, logprobs=logprobs,
                                     top_logprobs=request.logprobs or 0, grammar=grammar,
                                     draft_forced=self.options.draft_forced)
        try:
            for chunk in chunks:
                tokens += chunk
                if text is not None:
                    delta = text.take()
                    if delta:
                        yield delta
                if self._requests != me:
                    raise RuntimeError("another request started on this EagleRuntime while this stream was paused; "
                                       "streams on one instance cannot be interleaved (load a second instance)")
                if stop.is_set() and stats.finish_reason is None:  # Generation.cancel: no further round
                    stats.finish_reason, stats.new_tokens = "cancelled", len(tokens)
                    break
            if text is not None:
                tail = text.take(final=True)
                if tail:
                    yield tail
            out, reason, calls = text.text if text is not None else "", stats.finish_reason, None
            if request.tools and request.tool_choice != "none" and reason in ("stop", "length"):
                content, calls = parse_tool_calls(out)  # the complete calls (a cut-off one stays text)
                out, calls = content or "", calls or None
                reason = "tool_calls" if calls and reason == "stop" else reason
            return GenerationResult(out, tokens, reason, stats, logprobs, calls)
        finally:
            chunks.close()
            self._release(me)

    def _claim(self) -> int:
        """Take the KV buffers for a new request (class doc): wait while a request of another
        thread holds them; from the thread that holds them, take them over (the paused
        stream fails at its next step). Returns the request's number."""
        me_thread = threading.get_ident()
        with self._free:
            while self._owner is not None and self._owner != me_thread:
                self._free.wait()
            self._owner = me_thread
            self._requests += 1
            return self._requests

    def _release(self, me: int) -> None:
        with self._free:
            if self._requests == me:  # still the latest request: the buffers are free
                self._owner = None
                self._free.notify_all()

    def settle(self, answer: bool = True) -> float:
        """Store the last finished request, prompt and answer (answer=False: its prompt alone,
        no forward), in the prefix cache
        (Decoder.settle: its answer's rows run again as a prefill), so a request that starts
        with them reuses them exactly. `generate` and a `Generation` iterated to its end call it;
        a request started first drops it. Waits, as a request does, while another thread's
        request holds the KV buffers. -> seconds spent (0.0: no cache, or nothing to settle)."""
        if self.prefix_cache is None or self.decoder.unsettled is None:
            return 0.0
        me = self._claim()
        try:
            return self.decoder.settle(answer)
        finally:
            self._release(me)

    def generate(self, prompt: Prompt | Request, max_new_tokens: int | None = None, **settings) -> GenerationResult:
        """Generate to completion; see `stream` for the arguments."""
        request = self.stream(prompt, max_new_tokens, **settings)
        for _ in request:
            pass
        return request.result
