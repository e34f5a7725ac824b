"""eagle-serve end to end on a loopback port over the tiny export: the official `openai`
client (streaming and not) and raw HTTP (httpx2) for malformed bodies and disconnects.
Greedy outputs are compared with `EagleRuntime.generate` on a separate runtime. No assertion
depends on timings."""
from __future__ import annotations

import json
import threading
import time

import httpx2
import openai
import pytest

from tests.serve.conftest import ORACLE_DEPTH, ORACLE_PROMPTS, Faults, make_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def scheduler(server):
    return server.app.state.scheduler


def stream_text(stream) -> tuple[str, list, list[str]]:
    """(joined text, all chunks, the non-empty text pieces) of an openai completion stream."""
    chunks, pieces = [], []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            if text:
                pieces.append(text)
    return "".join(pieces), chunks, pieces


def finish_of(chunks) -> str | None:
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1, reasons
    return reasons[0]


def wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx2.get(server.url + "/health").json()
        if (health["queued"], health["active"]) == (0, 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


def test_models_health_and_unknown_route(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx2.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["decoding"]["lossless"] is True and health["decoding"]["chat_template"]
    r = httpx2.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("prompt", ["Hello there, how are you?", "an unregistered prompt: EAGLE head drafts"])
def test_chat_stream_equals_non_stream_equals_generate(client, reference, prompt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    expected = reference.generate(messages, 40, stop=["\n\n"])
    kw = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop="\n\n")
    full = client.chat.completions.create(**kw)
    text, chunks, _ = stream_text(client.chat.completions.create(**kw, stream=True,
                                                                 stream_options={"include_usage": True}))
    assert full.choices[0].message.content == text == expected.text
    assert full.choices[0].finish_reason == finish_of(chunks) == expected.finish_reason
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert full.usage.prompt_tokens == len(reference.encode(messages))
    # SSE shape: role first, usage null on every chunk but the last, which has no choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert full.system_fingerprint == chunks[0].system_fingerprint and full.system_fingerprint.endswith("-lossless")
    assert full.model_extra["eagle"]["lossless"] is True


def test_completions_stream_equals_non_stream_equals_generate(client, reference, oracle_refs):
    prompt = ORACLE_PROMPTS[0]
    expected = reference.generate(prompt, 30, chat=False)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    text, chunks, _ = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                            stream=True))
    assert full.choices[0].text == text == expected.text
    assert full.usage.completion_tokens == len(expected.token_ids) == 30
    assert all(c.usage is None for c in chunks)  # no usage chunk without include_usage
    # the oracle drafter makes multi-token rounds for registered prompts
    assert full.model_extra["eagle"]["mean_accept_len"] > 2
    assert full.model_extra["eagle"]["drafter"] == "eagle"  # what proposed the drafts (the API's default kind)
    ids = reference.encode(prompt, chat=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_raw_sse_framing(server):
    body = {"model": MODEL, "prompt": ORACLE_PROMPTS[1], "max_tokens": 9, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    payloads = [json.loads(e[6:]) for e in events[:-2]]
    assert payloads[-1]["usage"]["completion_tokens"] == 9 and payloads[-1]["choices"] == []
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_eight_concurrent_streams_get_their_solo_output(server, reference):
    prompts = [(p, 12 + 3 * i) for i, p in enumerate(ORACLE_PROMPTS[:4] + ["zz top", "abc", "A long one: 1 2 3", "q"])]
    expected = {p: reference.generate(p, n, chat=False).text for p, n in prompts}
    got, errors = {}, []
    batched = httpx2.get(server.url + "/health").json()["batching"]["batched_forwards"]

    def one(p, n):
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            got[p] = stream_text(c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                                      stream=True))[0]
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=pn) for pn in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == expected
    health = wait_idle(server)
    assert health["queued"] == 0
    if health["batching"]["slots"] > 1:  # the 8 requests really shared batched forwards
        assert health["batching"]["batched_forwards"] > batched


def _stop_case(reference, oracle_refs):
    """(prompt, stop, b): a 2-character stop string made of reference tokens b-1 and b, where
    b-1 ends one oracle round's chunk and b starts the next, first completed at token b."""
    tok = reference.tokenizer
    for prompt in ORACLE_PROMPTS:
        ref = oracle_refs[prompt]
        for b in range(1 + ORACLE_DEPTH + 1, min(len(ref), 40), ORACLE_DEPTH + 1):  # chunks: [0], [1..4], [5..8], ...
            a, c = ref[b - 1], ref[b]
            if not (32 <= a < 127 and 32 <= c < 127):
                continue
            stop = chr(a) + chr(c)
            if stop not in tok.decode(ref[:b]) and tok.decode(ref[:b + 1]).endswith(stop):
                return prompt, stop, b
    raise AssertionError("no reference boundary with two printable ASCII tokens")


def test_stop_string_split_across_two_accepted_chunks(client, reference, oracle_refs):
    prompt, stop, b = _stop_case(reference, oracle_refs)
    expected = reference.generate(prompt, 60, chat=False, stop=[stop])
    assert expected.finish_reason == "stop" and len(expected.token_ids) == b + 1
    text, chunks, _ = stream_text(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True}))
    assert text == expected.text and stop not in text
    assert finish_of(chunks) == "stop"
    assert chunks[-1].usage.completion_tokens == b + 1  # tokens up to the one completing the stop
    eagle = [c.model_extra["eagle"] for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert eagle["mean_accept_len"] > 2  # multi-token rounds: the stop really spans two chunks
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=stop)
    assert full.choices[0].text == expected.text and full.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_inside_an_accepted_chunk(client, reference, oracle_refs, stream):
    prompt = ORACLE_PROMPTS[2]
    assert 0 not in oracle_refs[prompt][:8]  # no EOS before the limit
    n = 1 + (ORACLE_DEPTH + 1) + 2  # the prefill token, one full round, then 2 tokens into the next round's chunk
    expected = reference.generate(prompt, n, chat=False)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    if stream:
        text, chunks, _ = stream_text(client.completions.create(**kw, stream=True,
                                                                stream_options={"include_usage": True}))
        finish, used = finish_of(chunks), chunks[-1].usage.completion_tokens
    else:
        full = client.completions.create(**kw)
        text, finish, used = full.choices[0].text, full.choices[0].finish_reason, full.usage.completion_tokens
        assert full.model_extra["eagle"]["limited_by"] == "max_tokens"  # the HTTP field's name
    assert (text, finish, used) == (expected.text, "length", n)
    assert expected.token_ids == oracle_refs[prompt][:n]


def test_disconnect_frees_the_engine(server, client, reference, faults):
    sched = scheduler(server)
    before = sched.cancelled
    short = reference.generate(ORACLE_PROMPTS[3], 5, chat=False).text
    seqs = []
    for i in range(20):
        body = {"model": MODEL, "prompt": f"slow request {i}", "max_tokens": 200, "temperature": 0, "stream": True,
                "user": f"slow-{i}"}
        with httpx2.Client(timeout=30) as http:
            with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
        seqs.append(sched.submitted)
        # the engine is free for the next request, which completes
        got = client.completions.create(model=MODEL, prompt=ORACLE_PROMPTS[3], max_tokens=5, temperature=0)
        assert got.choices[0].text == short
    health = wait_idle(server)
    assert (health["queued"], health["active"]) == (0, 0)
    assert sched.cancelled - before == 20
    for seq in seqs:
        assert faults.after_cancel.get(seq, 0) <= 1  # at most one round ran once the job was cancelled
        assert faults.rounds.get(seq, 0) < 150  # 199 rounds to finish: it was stopped, not run out


def test_disconnect_while_queued_drops_the_job(server, client):
    """A non-stream client that gives up while its request waits in the queue."""
    sched = scheduler(server)
    before = sched.cancelled
    blockers = [threading.Thread(target=lambda: client.completions.create(  # one per slot: all slots busy
        model=MODEL, prompt="blocker", max_tokens=60, temperature=0, user="slow-blocker")) for _ in sched.slots]
    for b in blockers:
        b.start()
    time.sleep(0.05)
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "never", "max_tokens": 60},
                    timeout=0.1)
    for b in blockers:
        b.join(30)
    health = wait_idle(server)
    assert (health["queued"], health["active"]) == (0, 0) and sched.cancelled - before == 1


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_that_request_only(server, client, reference, stream):
    sched = scheduler(server)
    failed = sched.failed
    prompt = ORACLE_PROMPTS[4]
    expected = reference.generate(prompt, 20, chat=False).text
    results, errors = {}, {}

    def run(name, user):
        try:
            kw = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, user=user)
            if stream:
                results[name] = stream_text(client.completions.create(**kw, stream=True))[0]
            else:
                results[name] = client.completions.create(**kw).choices[0].text
        except openai.APIError as err:
            errors[name] = err

    threads = [threading.Thread(target=run, args=(n, u)) for n, u in
               [("a", "ok-a"), ("bad", "fail-me"), ("b", "ok-b")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(errors) == {"bad"} and results == {"a": expected, "b": expected}
    err = errors["bad"]
    assert "injected fault" in str(err)
    if isinstance(err, openai.APIStatusError):  # failed before the stream started
        assert err.status_code == 500 and err.body["code"] == "decoding_error"
    assert sched.failed == failed + 1
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert again.choices[0].text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_given_up_before_any_text_is_a_400_after_it_the_engines_error(server, reference, oracle_refs,
                                                                                stream):
    """A GrammarError before the first text (a schema the grammar engine accepted but cannot
    follow) is answered as a 400 naming response_format, streamed or not; one after text is
    the engine's failure: a 500, or once streaming an SSE error event and no [DONE]."""
    def texty(p):  # text within its first 30 tokens, no EOS before 50: text comes, then more rounds
        ref = oracle_refs[p]
        return len(ref) >= 50 and reference.tokenizer.decode(ref[:30], skip_special_tokens=True)

    body = {"model": MODEL, "prompt": next(p for p in ORACLE_PROMPTS if texty(p)), "max_tokens": 50,
            "temperature": 0, "stream": stream}
    r = httpx2.post(server.url + "/v1/completions", json={**body, "user": "grammar-now"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "injected: the grammar engine gave up", "type": "invalid_request_error",
        "param": "response_format", "code": "unsupported_value"}
    r = httpx2.post(server.url + "/v1/completions", json={**body, "user": "lategrammar-a"}, timeout=60)
    if stream:
        assert r.status_code == 200 and "data: [DONE]" not in r.text
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[0]["choices"][0]["text"] and events[-1]["error"]["code"] == "decoding_error"
    else:
        assert r.status_code == 500 and r.json()["error"]["code"] == "decoding_error"
    assert "GrammarError" in (events[-1] if stream else r.json())["error"]["message"]


INVALID = [
    ({"n": 2}, "n", "unsupported_value"),
    ({"max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ({"temperature": float("nan")}, "temperature", "invalid_value"),
    ({"temperature": -0.5}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_k": -1}, "top_k", "invalid_value"),
    ({"seed": -3}, "seed", "invalid_value"),
    ({"stop": ["ok", ""]}, "stop", "invalid_type"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"logprobs": "yes"}, "logprobs", "invalid_type"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "invalid_value"),
    ({"mode": "turbo"}, "mode", "invalid_value"),
    ({"messages": []}, "messages", "invalid_type"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("patch, param, code", INVALID, ids=[f"{p}-{c}" for _, p, c in INVALID])
def test_invalid_chat_requests_get_400_naming_the_field(server, patch, param, code):
    sched = scheduler(server)
    submitted = sched.submitted
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **patch}
    r = httpx2.post(server.url + "/v1/chat/completions", content=json.dumps(body), timeout=30,
                    headers={"Content-Type": "application/json"})  # json.dumps writes NaN as the bare token NaN
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    assert err["message"]
    assert sched.submitted == submitted  # never reached the engine


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/v1/completions", {"prompt": "hi"})])
def test_an_unknown_model_gets_404_model_not_found(server, path, body):
    """Issue 53: OpenAI and vLLM answer an unknown model 404 model_not_found (it was a 400)."""
    submitted = scheduler(server).submitted
    r = httpx2.post(server.url + path, json={"model": "gpt-4o", **body}, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["type"], err["code"], err["param"]) == \
        (404, "invalid_request_error", "model_not_found", "model"), r.text
    assert "'gpt-4o' does not exist" in err["message"] and f"serves '{MODEL}'" in err["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert scheduler(server).submitted == submitted


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": ["one", "two"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 999]}, "prompt"),
    ({"model": MODEL, "prompt": "y" * 256}, "prompt"),
    ({"model": MODEL, "prompt": "p", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "p", "best_of": 3}, "best_of"),
    ({"prompt": "p"}, "model"),
    ({"model": MODEL}, "prompt"),
])
def test_invalid_completion_requests(server, body, param):
    submitted = scheduler(server).submitted
    r = httpx2.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert scheduler(server).submitted == submitted


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies(server, raw):
    r = httpx2.post(server.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert info.value.body["param"] == "n"


def test_vanilla_mode_per_request_and_metrics(server, client, reference):
    prompt = ORACLE_PROMPTS[5]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"mode": "vanilla"})
    assert r.choices[0].text == reference.generate(prompt, 16, chat=False, mode="vanilla").text
    eagle = r.model_extra["eagle"]
    assert eagle["mode"] == "vanilla" and eagle["mean_accept_len"] == 1.0 and eagle["draft_forwards"] == 0
    assert eagle["drafter"] is None  # nothing drafted
    text = httpx2.get(server.url + "/metrics").text
    for name in ("eagle_serve_requests_total", "eagle_serve_prompt_tokens_total", "eagle_serve_completion_tokens_total",
                 "eagle_serve_acceptance_length_bucket", "eagle_serve_time_per_output_token_seconds_bucket",
                 "eagle_serve_time_to_first_token_seconds_count", "eagle_serve_queue_length",
                 "eagle_serve_active_requests"):
        assert name in text, name
    assert 'eagle_serve_requests_total{endpoint="completions",outcome="ok"}' in text
    assert 'eagle_serve_acceptance_length_count{mode="vanilla"}' in text
    gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("eagle_serve_slots", "eagle_serve_batched_forwards", "eagle_serve_solo_forwards"))}
    batching = httpx2.get(server.url + "/health").json()["batching"]
    assert gauges["eagle_serve_slots"] == batching["slots"] == len(scheduler(server).slots)
    if batching["slots"] > 1:  # a BatchRuntime: at least this request's prefill ran alone
        assert gauges["eagle_serve_solo_forwards"] >= 1
        assert gauges["eagle_serve_batched_forwards"] <= batching["batched_forwards"]
    else:  # one request at a time: nothing is batched
        assert gauges["eagle_serve_solo_forwards"] == gauges["eagle_serve_batched_forwards"] == 0


def test_sampled_requests_are_reproducible_with_a_seed(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=12, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 50})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == b.usage.completion_tokens


def test_threshold_acceptance_is_reported(serve_export):
    srv = make_server(serve_export, acceptance="threshold", threshold=0.3)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
        assert "not-lossless" in r.system_fingerprint and "threshold0.3" in r.system_fingerprint
        assert r.model_extra["eagle"]["lossless"] is False and r.model_extra["eagle"]["threshold"] == 0.3
        _, chunks, _ = stream_text(c.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0,
                                                        stream=True))
        assert all("not-lossless" in ch.system_fingerprint for ch in chunks)
        v = c.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0, extra_body={"mode": "vanilla"})
        assert v.system_fingerprint.endswith("-vanilla-lossless")
        assert httpx2.get(srv.url + "/health").json()["decoding"]["lossless"] is False
    finally:
        srv.stop()


def test_full_queue_gets_429_and_never_reaches_the_engine(server, faults, long_prompt):
    from tests.serve.test_limits import holding

    sched = scheduler(server)
    with holding(server, faults, len(sched.slots), long_prompt):  # no idle worker would take it
        submitted, limit = sched.submitted, sched.max_queue
        sched.max_queue = 0  # every request now finds the queue full
        try:
            r = httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        finally:
            sched.max_queue = limit
        assert sched.submitted == submitted
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_scheduler_queue_bound(reference):
    import asyncio

    from eagle_deploy.runtime.request import Request
    from eagle_deploy.serve.scheduler import QueueFull, RoundGate, Slot, SlotScheduler, Work

    sched = SlotScheduler([Slot(reference, RoundGate())], max_queue=2)  # never started: jobs stay queued
    loop = asyncio.new_event_loop()
    try:
        jobs = [sched.submit(Work(Request((1, 2), 4)), loop) for _ in range(2)]
        with pytest.raises(QueueFull):
            sched.submit(Work(Request((1, 2), 4)), loop)
        assert (sched.queued, sched.active, [j.state for j in jobs]) == (2, 0, ["queued", "queued"])
    finally:
        loop.close()
    with pytest.raises(ValueError):
        SlotScheduler([Slot(reference, RoundGate())], max_queue=0)


class _Instant:
    """A slot runtime whose every request ends at once with no text (scheduler tests)."""

    class _Gen:
        from eagle_deploy.runtime.api import GenerationResult

        result = GenerationResult("", [], "stop")
        logprobs, cancelled = None, False

        def __iter__(self):
            return iter(())

        def cancel(self):
            self.cancelled = True

        def defer_settle(self):
            pass

        def settle(self, answer=True):
            return 0.0

    def stream(self, *args, **kw):
        return self._Gen()


def test_requests_an_idle_worker_is_about_to_take_are_not_counted_as_queued():
    """Issue 53: --slots 4 --max-queue 4 and 8 requests at once on an idle server gave a 429,
    since a request sat in the queue until an idle worker woke up to take it. The lock is held
    while submitting, so that no worker takes one meanwhile: the worst case, made certain."""
    import asyncio

    from eagle_deploy.runtime.request import Request
    from eagle_deploy.serve.scheduler import QueueFull, RoundGate, Slot, SlotScheduler, Work

    sched = SlotScheduler([Slot(_Instant(), RoundGate()) for _ in range(4)], max_queue=4)
    loop = asyncio.new_event_loop()
    sched.start()
    try:
        deadline = time.monotonic() + 30
        while len(sched._idle) < 4:  # every worker waits for a job
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.01)
        with sched._lock:
            jobs = [sched.submit(Work(Request((1, 2), 4)), loop) for _ in range(8)]  # 4 for the idle workers, 4 queued
            with pytest.raises(QueueFull, match=r"the queue holds 4 requests \(--max-queue 4\)"):
                sched.submit(Work(Request((1, 2), 4)), loop)
        while sched.completed < 8:
            assert time.monotonic() < deadline, "the jobs did not finish"
            time.sleep(0.01)
        assert [j.state for j in jobs] == ["done"] * 8
    finally:
        sched.close()
        loop.close()


def test_one_request_at_a_time_always_takes_the_lowest_slot(server, client, faults):
    """Busy slots stay packed at the low end (a batched forward spans the slots between its
    lowest and highest member): requests sent one after another, each once every slot is idle
    again (a slot settles its request after the response is sent), all run in slot 0."""
    sched = scheduler(server)
    seqs = []
    for prompt in ORACLE_PROMPTS[:3]:
        deadline = time.monotonic() + 30
        while sched.idle < len(sched.slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.idle == len(sched.slots)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        seqs.append(sched.submitted)
    assert [faults.slots[s] for s in seqs] == [0, 0, 0]


def test_long_prompts_are_prefilled_in_chunks_while_others_decode(serve_export, reference):
    """eagle-serve with 2 slots and prefill_chunk 8: a long prompt that arrives while another
    request decodes is prefilled in chunks (the `later-` user holds its round until the long
    request is waiting in the engine, so the two overlap on every machine), both get the
    reference text, and /health and /metrics count the chunks."""
    faults = Faults()
    srv = make_server(serve_export, faults, slots=2, prefill_chunk=8)
    try:
        engine = srv.app.state.scheduler.batch
        assert engine.prefill_chunk == 8
        long_prompt = (ORACLE_PROMPTS[1] + " ") * 8
        out = {}

        def short():
            r = httpx2.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": ORACLE_PROMPTS[0], "max_tokens": 24, "temperature": 0, "user": "later-a"})
            out["short"] = r.json()["choices"][0]["text"]

        def long():
            r = httpx2.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0})
            out["long"] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=short)]
        threads[0].start()
        assert faults.held.acquire(timeout=30)  # the short request decodes, held between two rounds
        threads.append(threading.Thread(target=long))
        threads[1].start()
        deadline = time.monotonic() + 30
        while not any(c.past == 0 for c in list(engine._pending.values())) and time.monotonic() < deadline:
            time.sleep(0.005)
        faults.release.set()
        for t in threads:
            t.join(60)
        assert out["short"] == reference.generate(ORACLE_PROMPTS[0], 24, chat=False).text
        assert out["long"] == reference.generate(long_prompt, 8, chat=False).text
        chunks = httpx2.get(srv.url + "/health").json()["batching"]["prefill_chunks"]
        assert chunks >= 2
        assert f"eagle_serve_prefill_chunks {float(chunks)}" in httpx2.get(srv.url + "/metrics").text
    finally:
        srv.stop()
