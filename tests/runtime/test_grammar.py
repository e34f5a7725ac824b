"""Structured outputs (runtime/grammar.py) at the three levels: a grammar's masks, pruning and
forced tokens on hand-built trees over the byte-level tiny tokenizer; the sampled distribution
through the decode loop under a path-dependent constraint (chi-square on a 16-token
vocabulary); greedy EAGLE == greedy vanilla under JSON schemas end to end, every finished
output valid."""
from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.decode import TokenStopper
from eagle_deploy.runtime.grammar import Grammar, GrammarRows, GrammarState, GrammarTokenizer, check_response_format
from eagle_deploy.runtime.request import Request
from eagle_deploy.runtime.sampling import SamplingParams, target_probs
from eagle_deploy.runtime.tree import DraftTree
from tests import tiny
from tests.conftest import PROMPTS
from tests.runtime.conftest import V16_PROMPT
from tests.runtime.stats import chi2_pvalue, counts_of, total_variation, tv_noise
from tests.runtime.test_sampling import P_MIN, _fixed_pair_drafter

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["a", "bb"]}}}}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def byte_grammar():
    return Grammar.compile(GrammarTokenizer(tiny.tiny_tokenizer(), 256, tiny.EOS_ID), check_response_format(RF))


def _text(ids) -> bytes:
    return bytes(ids)


def test_the_grammar_forces_the_first_key_and_masks_every_other_byte(byte_grammar):
    state = byte_grammar.state()
    assert _text(state.forced(64)) == b'{"name": "'  # strict layout: ", " and ": " only
    assert np.flatnonzero(state.allowed()).tolist() == [ord("{")]
    for t in b'{"name": "ab", "age": 4':
        assert state.consume(t)
    allowed = state.allowed()
    assert set(np.flatnonzero(allowed).tolist()) == set(b"0123456789,")  # more digits (up to 99) or the next key
    assert not state.consume(ord("x")) and state.consume(ord("2"))  # a refused byte leaves the state unchanged
    assert _text(state.forced(64)) == b', "tags": ['
    assert not state.complete


def test_prune_keeps_only_the_paths_the_grammar_allows(byte_grammar):
    state = byte_grammar.state()
    for t in b'{"name": "':
        state.consume(t)
    tree = DraftTree.from_paths(ord('"'), [list(b'ab"'), list(b'a\x00'), list(b'"}'), list(b'", "age')])
    pruned = state.prune(tree)
    paths = sorted(bytes(int(pruned.tokens[j]) for j in pruned.path_to(i)[1:]) for i in range(pruned.size))
    assert paths == [b"", b'"', b'",', b'", ', b'", "', b'", "a', b'", "ag', b'", "age', b'a', b'ab', b'ab"']
    assert not state.complete and _text(state.forced(3)) == b""  # the walk left the state where it was


def test_grammar_rows_mask_each_node_from_its_own_path_and_roll_back(byte_grammar):
    state = byte_grammar.state()
    for t in b'{"name": "ab", "age": ':
        state.consume(t)
    tree = DraftTree.from_paths(ord(" "), [list(b"1,"), list(b"12")])
    logits = np.random.default_rng(0).normal(size=(tree.size, 256)).astype(np.float32)
    rows = GrammarRows(tree, state, lambda i: logits[i])
    one = next(i for i in range(tree.size) if tree.tokens[i] == ord("1"))
    comma = next(i for i in range(tree.size) if tree.tokens[i] == ord(","))
    assert set(np.flatnonzero(rows(0) > -np.inf)) == set(b"0123456789")
    assert set(np.flatnonzero(rows(one) > -np.inf)) == set(b"0123456789,")  # after "1": a digit or the comma
    assert set(np.flatnonzero(rows(comma) > -np.inf)) == {ord(" ")}
    rows.done()
    assert set(np.flatnonzero(state.allowed())) == set(b"0123456789")  # back at the committed tokens
    with pytest.raises(RuntimeError, match="off the accepted path"):
        rows(comma)  # not a child of the root


_LOOP: dict = {"type": "object"}
_LOOP["properties"] = {"self": _LOOP}  # an object that contains itself


@pytest.mark.parametrize("value, field", [
    ({"type": "xml"}, "response_format.type"), ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": _LOOP}}, "response_format.json_schema.schema"),
])
def test_a_bad_response_format_is_one_error_naming_the_field(value, field):
    with pytest.raises(SettingError) as err:
        Request("hi", response_format=value)
    assert err.value.field == field
    assert Request("hi", response_format={"type": "text"}).response_format is None


def test_a_schema_the_engine_refuses_is_one_error_before_any_forward(mha):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(SettingError, match="^response_format.json_schema.schema is not a JSON schema"):
        mha.rt.generate(PROMPTS[0], 8, response_format=bad)
    assert mha.rt.generate(PROMPTS[0], 8).token_ids == mha.expected(PROMPTS[0], 8)


def _valid(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 99 and len(obj["tags"]) <= 2
            and all(t in ("a", "bb") for t in obj["tags"]))


@pytest.mark.parametrize("drafter", ["head", "hybrid", "head-no-forced", "row-exact"])
def test_greedy_eagle_equals_vanilla_under_a_json_schema_and_finished_outputs_validate(model, drafter):
    kw = {"head": {}, "hybrid": dict(drafter_kind="hybrid", planned=True),
          "head-no-forced": dict(draft_forced=False), "row-exact": dict(row_exact=True)}[drafter]
    rt = model.runtime(**kw)
    finished = 0
    for prompt in PROMPTS:
        v = rt.generate(prompt, 120, response_format=RF, mode="vanilla")
        e = rt.generate(prompt, 120, response_format=RF)
        assert e.token_ids == v.token_ids and e.text == v.text
        assert e.text.startswith('{"name": "')
        if e.finish_reason == "stop":
            finished += 1
            assert _valid(e.text), e.text
        assert e.stats.grammar_masks > 0 and e.stats.to_json()["grammar_ms"] >= 0
    assert finished >= 1


def test_forced_tokens_raise_tau_without_changing_the_output(gqa):
    with_forced, without = gqa.runtime(), gqa.runtime(draft_forced=False)
    taus = []
    for prompt in PROMPTS:
        a, b = with_forced.generate(prompt, 120, response_format=RF), without.generate(prompt, 120, response_format=RF)
        assert a.token_ids == b.token_ids
        taus.append((a.stats.mean_accept_len, b.stats.mean_accept_len))
    assert sum(t[0] for t in taus) > sum(t[1] for t in taus) + 0.3  # the keys and punctuation come free


def test_a_batch_of_grammar_and_plain_requests_each_equals_vanilla(gqa):
    from eagle_deploy.runtime.batch import BatchRuntime

    eng = BatchRuntime.load(gqa.export_dir, 3, threads=1)
    settings = [dict(response_format=RF), {}, dict(response_format={"type": "json_object"})]
    results = eng.generate_many(PROMPTS, per_request=settings, max_new_tokens=60)
    solo = gqa.runtime()
    for prompt, kw, r in zip(PROMPTS, settings, results):
        assert r.token_ids == solo.generate(prompt, 60, mode="vanilla", **kw).token_ids


class AlternatingClasses(GrammarState):
    """A path-dependent stand-in grammar over a 16-token vocabulary: a token's class (1-7 low,
    8-15 high; 0 never) must differ from the previous token's. It plugs into the decoder as an
    llguidance state does (GrammarState's interface; prune is GrammarState's own)."""

    def __init__(self, last: int):
        self.vocab, self.eos, self.masks, self.seconds = 16, 0, 0, 0.0
        self.history = [last]

    def _cls(self, t: int) -> int:
        return 0 if t == 0 else (1 if t < 8 else 2)

    def allowed(self) -> np.ndarray:
        self.masks += 1
        last = self._cls(self.history[-1])
        return np.array([t != 0 and self._cls(t) != last for t in range(16)])

    def consume(self, token: int) -> bool:
        if not self.allowed()[token]:
            return False
        self.history.append(int(token))
        return True

    def rollback(self, k: int) -> None:
        del self.history[len(self.history) - k:]

    def forced(self, n: int) -> list[int]:
        return []


N_JOINT = 4000


@pytest.mark.statistical
def test_sampling_under_a_path_dependent_grammar_follows_the_masked_target(v16, v16_logits):
    """generate(4 tokens) over a depth-2 tree holding [a, b] and [b, a], a and b of different
    classes (so each sibling's subtree is masked differently): the joint of (t1, t2) follows
    sum_t0 p(t0) p(t1|t0) p(t2|t0,t1), each factor the masked target after its own context."""
    T, V = 0.9, 16
    l0, l1, l2 = v16_logits
    start = V16_PROMPT[-1]
    cls = lambda t: 0 if t == 0 else (1 if t < 8 else 2)  # noqa: E731

    def probs(logits, last):
        masked = np.where([t != 0 and cls(t) != cls(last) for t in range(V)], logits, -np.inf)
        return target_probs(masked, SamplingParams(temperature=T))

    p0 = probs(l0, start)
    p1 = np.stack([probs(l1[a], a) for a in range(V)])
    p2 = np.stack([[probs(l2[a, b], b) for b in range(V)] for a in range(V)])
    joint = np.einsum("a,ab,abc->bc", p0, p1, p2)
    a = int(np.argmax(joint.sum(1)))
    b = max((t for t in range(1, V) if cls(t) != cls(a)), key=lambda t: joint.sum(1)[t])
    rt = v16.runtime(drafter=_fixed_pair_drafter([[a, b], [b, a]]))
    pairs, deep = np.empty(N_JOINT, np.int64), 0
    for s in range(N_JOINT):
        chunks = list(rt.decoder.decode(V16_PROMPT, 4, SamplingParams(temperature=T, seed=s), TokenStopper(()),
                                        grammar=AlternatingClasses(start)))
        out = [t for c in chunks for t in c]
        pairs[s] = out[1] * V + out[2]
        deep += len(chunks[1]) == 3
    counts = counts_of(pairs, V * V)
    p, tv = chi2_pvalue(counts, joint), total_variation(counts, joint)
    assert p > P_MIN and tv < tv_noise(joint, N_JOINT), f"chi-square p={p:.2e}, TV={tv:.4f}"
    assert deep > 0.02 * N_JOINT


def test_eagle_run_json_schema_and_json_object(mha, tmp_path, capsys):
    from eagle_deploy.runtime import cli

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["--engines", str(mha.export_dir), "--prompt", "hello", "--raw", "--threads", "1", "--json",
            "--max-new-tokens", "80"]
    assert cli.main([*base, "--json-schema", str(schema)]) == 0
    out = json.loads(capsys.readouterr().out)
    want = mha.rt.generate("hello", 80, chat=False, mode="vanilla", response_format=RF)
    assert out["token_ids"] == want.token_ids and out["text"].startswith('{"name": "')
    assert cli.main([*base, "--json-object"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith("{")
    schema.write_text("{not json")
    assert cli.main([*base, "--json-schema", str(schema)]) == 2
    assert capsys.readouterr().err.startswith(f"eagle-run: error: --json-schema {schema} is not JSON")
    assert cli.main([*base, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_schema_the_engine_accepts_but_cannot_follow_fails_instead_of_ending_as_complete(mha):
    """A breaker's report: llguidance compiled this schema, then gave up after the first token
    (its lexer: too many expressions) and allowed only EOS, so the answer ended "stop" as `"`."""
    from eagle_deploy.runtime.grammar import GrammarError

    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                         "pattern": "^(a{1000}){1000}$"}}}
    with pytest.raises(GrammarError, match="cannot follow this response_format"):
        mha.rt.generate(PROMPTS[0], 12, response_format=rf)
    assert mha.rt.generate(PROMPTS[0], 8).token_ids == mha.expected(PROMPTS[0], 8)  # the runtime is unharmed
