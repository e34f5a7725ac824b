"""RuntimeOptions (one set of engine defaults for the API and every command), Request (one
request model, its errors naming the field), and one runtime shared by several threads."""
from __future__ import annotations

import threading

import pytest

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER
from eagle_deploy.runtime import cli as run_cli
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.batch import BatchRuntime
from eagle_deploy.runtime.decode import PREFILL_CHUNK
from eagle_deploy.runtime.options import RuntimeOptions
from eagle_deploy.runtime.request import MAX_STOPS, Request
from eagle_deploy.serve import cli as serve_cli
from tests.conftest import PROMPTS, THREADS


def test_the_api_and_the_commands_share_one_set_of_defaults():
    """The Python API used to default to the head's fixed tree (1.07x vanilla on Spec-Bench)
    while eagle-run / eagle-serve planned the hybrid drafter (1.38x): now both come from
    RuntimeOptions, and the flags left unset give exactly RuntimeOptions()."""
    default = RuntimeOptions()
    assert (default.drafter_kind, default.planned, default.acceptance, default.verify) == \
        (DEFAULT_DRAFTER, True, "lossless", "fast")
    assert DEFAULT_DRAFTER == "hybrid" and default.prefill_chunk == PREFILL_CHUNK and default.threshold is None
    assert default.prefix_cache_mb == 0
    for parser in (run_cli.build_parser(), serve_cli.build_parser()):
        args = parser.parse_args(["--engines", "x", "--prompt", "hi"] if parser.prog == "eagle-run" else
                                 ["--engines", "x"])
        # deliberate differences: a server, loaded once and signing every answer "lossless",
        # hashes every file of the export (issue 53), and keeps a prefix cache (issue 50: its
        # requests share prefixes); eagle-run and the API check fast and keep none
        if parser.prog == "eagle-serve":
            want = default.replace(verify="full", prefix_cache_mb=serve_cli.SERVE_PREFIX_CACHE_MB)
            assert serve_cli.runtime_options(args) == want and want.prefix_cache_mb > 0
        else:
            assert RuntimeOptions.from_args(args) == default, parser.prog


def test_eagle_serve_keeps_a_prefix_cache_only_where_it_is_exact(gqa, gqa_standard):
    """Its default: on with --backend ort and the fused graph; off on a device backend or the
    standard-op graph (EagleRuntime refuses the cache there); a value given is kept."""
    parse = serve_cli.build_parser().parse_args
    assert serve_cli.runtime_options(parse(["--engines", "x"]), gqa.manifest).prefix_cache_mb > 0
    assert serve_cli.runtime_options(parse(["--engines", "x"]), gqa_standard.manifest).prefix_cache_mb == 0
    assert serve_cli.runtime_options(parse(["--engines", "x", "--backend", "trt"])).prefix_cache_mb == 0
    assert serve_cli.runtime_options(parse(["--engines", "x", "--prefix-cache-mb", "0"])).prefix_cache_mb == 0
    assert serve_cli.runtime_options(parse(["--engines", "x", "--prefix-cache-mb", "64"])).prefix_cache_mb == 64
    with pytest.raises(SettingError, match="needs the onnxruntime CPU backend"):
        serve_cli.runtime_options(parse(["--engines", "x", "--backend", "trt", "--prefix-cache-mb", "64"]))


def test_a_runtime_loaded_with_no_options_plans_the_hybrid_drafter_and_stays_lossless(mha):
    rt = EagleRuntime.load(mha.export_dir, threads=THREADS)
    assert (rt.drafter_kind, rt.planned, rt.options.tree) == ("hybrid", True, mha.manifest.tree)
    assert rt.costs is not None  # measured (or read from the cache) once, at load
    for prompt in PROMPTS:
        r = rt.generate(prompt, 24)
        assert r.stats.drafter == "hybrid"
        assert r.token_ids == mha.expected(prompt, 24)  # greedy EAGLE == vanilla greedy


def test_a_batch_engine_with_no_options_plans_the_hybrid_drafter(gqa):
    eng = BatchRuntime.load(gqa.export_dir, 2, threads=THREADS)
    assert all((rt.drafter_kind, rt.planned) == ("hybrid", True) for rt in eng.runtimes)
    assert eng.costs is not None and eng.prefill_chunk == PREFILL_CHUNK
    results = eng.generate_many(PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in results] == [gqa.expected(p, 16) for p in PROMPTS]


@pytest.mark.parametrize("changes, field", [
    ({"backend": "cuda"}, "backend"), ({"drafter_kind": "medusa"}, "drafter_kind"),
    ({"acceptance": "typical"}, "acceptance"), ({"verify": "some"}, "verify"), ({"threads": 0}, "threads"),
    ({"threads": 1.5}, "threads"), ({"planned": "yes"}, "planned"), ({"row_exact": 1}, "row_exact"),
    ({"prefill_chunk": -1}, "prefill_chunk"), ({"threshold": 0.5}, "threshold"),
    ({"acceptance": "threshold", "threshold": 0.0}, "threshold"),
    ({"acceptance": "threshold", "threshold": float("nan")}, "threshold"), ({"tree": "dynamic"}, "tree"),
])
def test_a_bad_option_is_one_error_naming_it(changes, field):
    with pytest.raises(SettingError) as err:
        RuntimeOptions(**changes)
    assert err.value.field == field and str(err.value).startswith(field + " ")


def test_options_and_keyword_changes_combine_and_unknown_names_are_refused(mha):
    base = RuntimeOptions(drafter_kind="eagle", planned=False)
    assert RuntimeOptions.of(base, threads=2) == RuntimeOptions(drafter_kind="eagle", planned=False, threads=2)
    assert RuntimeOptions(acceptance="threshold").threshold == 0.3  # the default threshold of threshold acceptance
    with pytest.raises(TypeError, match="unknown runtime option: drafter_knd"):
        EagleRuntime.load(mha.export_dir, base, drafter_knd="eagle")
    rt = EagleRuntime.load(mha.export_dir, base, threads=THREADS)
    assert (rt.drafter_kind, rt.planned, rt.options.threads) == ("eagle", False, THREADS)


@pytest.mark.parametrize("kw, field, flag", [
    ({"max_new_tokens": 0}, "max_new_tokens", "--max-new-tokens"),
    ({"temperature": -1.0}, "temperature", "--temperature"),
    ({"top_p": 2.0}, "top_p", "--top-p"), ({"top_k": -1}, "top_k", "--top-k"), ({"seed": -3}, "seed", "--seed"),
    ({"stop": ["ok", ""]}, "stop", "--stop"), ({"stop": ["s"] * (MAX_STOPS + 1)}, "stop", "--stop"),
    ({"prompt": ""}, "prompt", "--prompt"), ({"mode": "fast"}, "mode", None),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content", None),
    ({"prompt": [3, -1]}, "prompt", None), ({"chat": "yes"}, "chat", None),
])
def test_a_bad_request_is_one_error_naming_the_field(kw, field, flag, capsys):
    """One check per field, in Request; eagle-run words the same error with its flag."""
    with pytest.raises(SettingError) as err:
        Request(**{"prompt": "hi", **kw})
    assert err.value.field == field and str(err.value) == f"{field} {err.value.rule}"
    if flag is not None and "prompt" not in kw:
        argv = {"max_new_tokens": ["--max-new-tokens", "0"], "temperature": ["--temperature", "-1"],
                "top_p": ["--top-p", "2"], "top_k": ["--top-k", "-1"], "seed": ["--seed", "-3"],
                "stop": [a for s in kw.get("stop", []) for a in ("--stop", s)]}[field]
        assert run_cli.main(["--engines", "no-such-folder", "--prompt", "hi", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"eagle-run: error: {flag} {err.value.rule}"


def test_a_request_object_and_keywords_give_the_same_answer(mha):
    rt = mha.runtime()
    request = Request(PROMPTS[1], max_new_tokens=20, temperature=0.8, top_k=20, seed=5, stop=())
    assert rt.generate(request).token_ids == rt.generate(PROMPTS[1], 20, temperature=0.8, top_k=20,
                                                         seed=5).token_ids
    with pytest.raises(TypeError, match="either a Request or a prompt"):
        rt.generate(request, max_new_tokens=4)


def test_a_chat_message_without_content_is_one_error_naming_it(mha):
    """It used to reach the chat template and raise jinja2's UndefinedError (a breaker's report)."""
    with pytest.raises(SettingError, match=r"^prompt\[1\]\.content is missing$"):
        mha.rt.generate([{"role": "user", "content": "hi"}, {"role": "assistant"}], 4)


def test_requests_from_several_threads_on_one_runtime_are_served_one_after_another(mha):
    """A breaker's report: two threads calling generate on one EagleRuntime got errors and, once,
    a wrong answer with no error (the later request decoded from KV the other overwrote). Now a
    request from another thread waits for the running one: every answer is the solo answer."""
    rt = mha.runtime()
    jobs = [(p, kw) for p in PROMPTS for kw in ({}, {"temperature": 0.9, "seed": 3})]
    solo = [rt.generate(p, 24, **kw).token_ids for p, kw in jobs]
    got: dict[tuple[int, int], list[int] | BaseException] = {}

    def worker(t: int) -> None:
        for rep in range(2):
            for i, (p, kw) in enumerate(jobs):
                if (i + t) % 2 == 0:
                    try:
                        got[(t, rep * 100 + i)] = rt.generate(p, 24, **kw).token_ids
                    except BaseException as err:  # noqa: BLE001 - reported by the assertion below
                        got[(t, rep * 100 + i)] = err
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert len(got) == sum((i + t) % 2 == 0 for t in range(3) for _ in range(2) for i in range(len(jobs)))
    assert all(got[key] == solo[key[1] % 100] for key in got), {k: v for k, v in got.items()
                                                                if v != solo[k[1] % 100]}


def test_cancel_stops_a_generation_before_its_next_round_and_keeps_what_was_committed(mha):
    """The one cancellation path (eagle-serve and the Triton worker use it): from the consumer
    or another thread, the stream ends with finish_reason "cancelled" and no further forward."""
    rt = mha.runtime()
    full = rt.generate(PROMPTS[0], 60).token_ids
    s = rt.stream(PROMPTS[0], 60)
    next(s)
    rounds_before = None

    def observe(tree, logits, v):
        nonlocal rounds_before
        rounds_before = (rounds_before or 0) + 1

    rt.decoder.round_observers = (observe,)
    s.cancel()
    rest = list(s)
    r = s.result
    assert r.finish_reason == "cancelled" and r.stats.finish_reason == "cancelled"
    assert r.token_ids == full[:len(r.token_ids)] and len(r.token_ids) < 60 and len(rest) <= 1
    assert (rounds_before or 0) <= 1  # at most the round already under way
    early = rt.stream(PROMPTS[1], 10)
    early.cancel()  # before the first next(): nothing runs
    assert list(early) == [] and early.result.token_ids == [] and early.result.finish_reason == "cancelled"
    assert rt.generate(PROMPTS[0], 60).token_ids == full  # the runtime is unharmed


def test_cancelling_a_paused_stream_frees_the_runtime_for_another_thread(mha):
    """A breaker's report: thread A paused a stream and cancelled it; thread B's generate then
    waited forever, since the buffers stayed A's until A iterated again."""
    rt = mha.runtime()
    s = rt.stream(PROMPTS[0], 60)
    next(s)
    done: list = []
    waiter = threading.Thread(target=lambda: done.append(rt.generate(PROMPTS[1], 20).token_ids))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # B waits while A's request owns the buffers
    s.cancel()
    waiter.join(60)
    assert not waiter.is_alive() and done == [mha.expected(PROMPTS[1], 20)]
    r = s.result
    assert r.finish_reason == "cancelled" and 0 < len(r.token_ids) < 60 and list(s) == []
