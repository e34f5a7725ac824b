"""Structured outputs: a request's grammar (OpenAI `response_format`), applied losslessly over
draft trees.

`check_response_format` reads `response_format` (`{"type": "text"}`, `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) without a model;
`Grammar.compile` builds it for an export's tokenizer with llguidance (the grammar engine
chosen by measurement: docs/decisions.md, 'the grammar engine for structured outputs over
draft trees'), and each request gets its own `GrammarState` (an llguidance matcher: the
grammar state after the committed tokens).

Lossless over trees (`GrammarRows`): the target's distribution at a tree node is the
grammar-masked one for that node's *own path*, so verification walks the tree from the root,
masking each row it reads with the state reached along the path it has accepted so far
(verification reads only the rows on that path: at most depth + 1 masks a round). Greedy
output then equals vanilla decoding under the same grammar token for token, and sampled output
follows it exactly. Draft tokens the grammar forbids are pruned before the target runs
(`GrammarState.prune`), and tokens the grammar forces (a schema's keys, punctuation: the only
legal continuation) are drafted as a deterministic chain (`GrammarState.forced`): the grammar
itself drafts.

JSON layout: `json_schema` with `strict` (the default here) and tool-call arguments use one
layout (`", "` and `": "` separators, no other whitespace), which makes the keys and
punctuation forced tokens and rules out whitespace loops; `json_object` allows any whitespace.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Sequence

import numpy as np

from eagle_deploy.contract.errors import SettingError, first_line

from .tree import DraftTree


class GrammarError(ValueError):
    """The grammar engine cannot follow a request's grammar mid-output (the request fails
    rather than end with output that does not match)."""


STRICT_LAYOUT = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")
MAX_SCHEMA_CHARS = 200_000  # a schema's JSON text at most (a bound on compile work)


def check_response_format(value) -> dict | None:
    """OpenAI's `response_format` -> None (plain text) or a normalised dict {"type":
    "json_object"} / {"type": "json_schema", "name", "schema", "strict"}; SettingError naming
    the field ("response_format.json_schema.schema") for any other shape. The schema itself is
    checked when it is compiled for an export (Grammar.compile)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise SettingError("response_format", 'must be an object with a "type" (text, json_object or json_schema), '
                                              f"got {value!r}"[:300])
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise SettingError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema", value if "schema" in value else None)  # the second: this function's own form
    if not isinstance(spec, dict):
        raise SettingError("response_format.json_schema", "must be an object with a name and a schema")
    schema = spec.get("schema", {"type": "object"} if "schema" not in spec else None)
    if not isinstance(schema, dict):
        raise SettingError("response_format.json_schema.schema", f"must be a JSON schema object, got {schema!r}"[:300])
    try:
        text = json.dumps(schema)
    except (ValueError, TypeError) as err:  # a schema object that refers to itself, or holds non-JSON values
        raise SettingError("response_format.json_schema.schema", f"is not JSON ({err})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise SettingError("response_format.json_schema.schema", f"is longer than {MAX_SCHEMA_CHARS} characters")
    strict = spec.get("strict", True)
    if not isinstance(strict, bool) and strict is not None:
        raise SettingError("response_format.json_schema.strict", f"must be true or false, got {strict!r}")
    name = spec.get("name", "response")
    if not isinstance(name, str):
        raise SettingError("response_format.json_schema.name", f"must be a string, got {name!r}")
    return {"type": "json_schema", "name": name, "schema": schema, "strict": strict is not False}


class GrammarTokenizer:
    """An export's tokenizer as llguidance sees it, built once per runtime (a few ms for a
    50k vocabulary). vocab: the target's vocabulary size (logit rows); eos: the token the
    grammar allows once the output is complete (the export's first EOS id)."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        import llguidance.hf

        self.vocab, self.eos = vocab, eos
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)


class Grammar:
    """A compiled grammar (llguidance's grammar text) for one tokenizer; `state()` starts a
    request's GrammarState."""

    def __init__(self, tokenizer: GrammarTokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    @classmethod
    def compile(cls, tokenizer: GrammarTokenizer, response_format: dict) -> "Grammar":
        """`check_response_format`'s dict -> Grammar; SettingError naming the schema field
        when llguidance refuses the schema."""
        import llguidance

        schema = response_format.get("schema", {"type": "object"})
        layout = STRICT_LAYOUT if response_format["type"] == "json_schema" and response_format["strict"] else None
        field = "response_format.json_schema.schema" if response_format["type"] == "json_schema" else "response_format"
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)
        except (ValueError, TypeError, RuntimeError) as err:
            raise SettingError(field, f"is not a JSON schema this server can enforce: {err}"[:500]) from None
        grammar = cls(tokenizer, text)
        error = grammar.error()  # a refused schema fails here, before the request runs
        if error:
            raise SettingError(field, f"is not a JSON schema this server can enforce: {error}"[:500])
        return grammar

    @classmethod
    def from_lark(cls, tokenizer: GrammarTokenizer, lark: str, field: str) -> "Grammar":
        """A grammar in llguidance's lark dialect (runtime/tools.py's tool calls); SettingError
        naming `field` when it cannot be enforced."""
        import llguidance

        try:
            text = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RuntimeError) as err:
            raise SettingError(field, f"cannot be enforced: {err}"[:500]) from None
        grammar = cls(tokenizer, text)
        error = grammar.error()
        if error:
            raise SettingError(field, f"cannot be enforced: {error}"[:500])
        return grammar

    def error(self) -> str | None:
        """What llguidance says against this grammar when it starts a matcher, or None."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer.ll, self.text, log_level=0)
        return matcher.get_error() if matcher.is_error() else None

    def state(self) -> "GrammarState":
        return GrammarState(self)


class GrammarState:
    """The grammar state of one request after its committed tokens (an llguidance matcher).
    `allowed()`: [V] bool of the legal next tokens; `consume(t)`: advance (False for an
    illegal token, state unchanged); `rollback(k)`; `forced(n)`: up to n tokens the grammar
    forces next; `prune(tree)`: the tree without the nodes the grammar forbids."""

    def __init__(self, grammar: Grammar):
        import llguidance
        import llguidance.numpy as lnp

        tok = grammar.tokenizer
        self.vocab, self.eos = tok.vocab, tok.eos
        self.matcher = llguidance.LLMatcher(tok.ll, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise SettingError("response_format", f"cannot be enforced: {self.matcher.get_error()}"[:500])
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, tok.vocab)
        self.masks = 0  # masks computed (each a full-vocabulary pass)
        self.seconds = 0.0  # time spent in masks, pruning and forced tokens

    def _check(self) -> None:
        """GrammarError when the engine has given up on this grammar mid-output (llguidance
        accepts some schemas it cannot follow, e.g. a regex too large to build lazily: its
        masks then allow only EOS, and the output would end as if complete)."""
        if self.matcher.is_error():
            raise GrammarError(f"the grammar engine cannot follow this response_format / tools grammar: "
                               f"{first_line(RuntimeError(self.matcher.get_error()))}"[:500])

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens legal next. Raises GrammarError (see _check)."""
        self._check()
        t0 = time.perf_counter()
        self._lnp.fill_next_token_bitmask(self.matcher, self._bits, 0)
        self.masks += 1
        out = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
        self.seconds += time.perf_counter() - t0
        self._check()
        return out

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar forbids it. Raises
        GrammarError (see _check)."""
        if self.matcher.is_stopped() or not self.matcher.validate_tokens([int(token)]):
            self._check()
            return False
        ok = bool(self.matcher.consume_token(int(token)))
        self._check()
        return ok

    def commit(self, tokens) -> None:
        """Advance by committed tokens (each verified under this grammar's mask). Raises
        GrammarError when one is refused: the engine lost track of the grammar."""
        for token in tokens:
            if not self.consume(token) and int(token) != self.eos:
                raise GrammarError(f"the grammar engine refused the committed token {int(token)}: it cannot follow "
                                   "this response_format / tools grammar")

    def rollback(self, k: int) -> None:
        if k:
            self.matcher.rollback(k)

    @property
    def complete(self) -> bool:
        """The output so far is a whole match (EOS is legal)."""
        return bool(self.matcher.is_accepting())

    def forced(self, n: int) -> list[int]:
        """Up to `n` tokens the grammar forces from here (each the only legal continuation, in
        its canonical tokenisation), EOS excluded."""
        if n <= 0 or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        out = [int(t) for t in self.matcher.compute_ff_tokens()[:n] if int(t) != self.eos]
        self.seconds += time.perf_counter() - t0
        return out

    def prune(self, tree: DraftTree) -> DraftTree:
        """`tree` without the draft nodes whose token the grammar forbids along their own path
        (and what hangs below them); the root stays. Walks the tree depth-first with one
        consume and one rollback per node."""
        keep: list[int] = []
        t0 = time.perf_counter()

        def walk(node: int) -> None:
            for child in tree.children(node):
                if self.consume(int(tree.tokens[child])):
                    keep.append(int(child))
                    walk(int(child))
                    self.rollback(1)

        walk(0)
        self.seconds += time.perf_counter() - t0
        return tree if len(keep) == tree.size - 1 else tree.subtree(keep)


class GrammarRows:
    """Verification's rows under a grammar (module doc): `row(node)` is node's target logits,
    shaped by `shape(node)` (shaping.LogitShaper's row, or the raw row) and masked by the
    grammar state reached along node's path. Verification calls it for the root first and
    then for each node it accepts, a child of the one before: the state follows that path, and
    `done()` rolls it back to the committed tokens."""

    def __init__(self, tree: DraftTree, state: GrammarState, shape: Callable[[int], np.ndarray]):
        self.tree, self.state, self.shape = tree, state, shape
        self.path: list[int] = [0]

    def __call__(self, node: int) -> np.ndarray:
        node = int(node)
        if node != self.path[-1]:
            if int(self.tree.parents[node]) != self.path[-1] or not self.state.consume(int(self.tree.tokens[node])):
                raise RuntimeError(f"grammar rows asked for node {node} off the accepted path {self.path}")
            self.path.append(node)
        return np.where(self.state.allowed(), np.asarray(self.shape(node), np.float64), -np.inf)

    def done(self) -> None:
        """Back to the committed tokens (the walk consumed the accepted draft tokens)."""
        self.state.rollback(len(self.path) - 1)
        self.path = [0]


def mask_first(state: GrammarState, row: np.ndarray) -> np.ndarray:
    """The first token's row (after the prompt) masked by the grammar's start state."""
    return np.where(state.allowed(), np.asarray(row, np.float64), -np.inf)


__all__: Sequence[str] = ["Grammar", "GrammarRows", "GrammarState", "GrammarTokenizer", "check_response_format",
                          "mask_first"]
