"""eagle-serve left running: body size limit, tokenisation off the event loop, queue places of
clients that give up, per-request deadlines, bad JSON and bad Unicode, stop-string caps and
the speculative counters (usage.speculative, vLLM's /metrics names). Waits are bounded polls
or events the test itself sets; no assertion depends on how fast the machine is."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx2
import openai
import pytest

from eagle_deploy.serve.protocol import MAX_STOP_CHARS, MAX_STOPS
from tests.serve.conftest import ORACLE_DEPTH, ORACLE_PROMPTS

MODEL = "tiny"


def scheduler(server):
    return server.app.state.scheduler


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)
    return value


def health(server) -> dict:
    return httpx2.get(server.url + "/health", timeout=10).json()


@contextmanager
def holding(server, faults, n: int, prompt: str):
    """n requests (users hold-0.., on `prompt`, which must run rounds) that occupy n slots until
    the block ends; yields their results dict (status codes, filled when they finish)."""
    faults.release.clear()
    faults.held = threading.Semaphore(0)
    results = {}

    def run(i):
        r = httpx2.post(server.url + "/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "user": f"hold-{i}"})
        results[i] = r.status_code

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        # one holder waits in its round hook; with a BatchRuntime the others wait for the batched
        # forward it holds up: every slot is taken and none progresses
        assert faults.held.acquire(timeout=30), "no holder reached its first round"
        wait_for(lambda: health(server)["active"] == n, what=f"{n} slots busy")
        yield results
    finally:
        faults.release.set()
        for t in threads:
            t.join(60)


def raw_http(port: int, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send `head` (request line + headers, no blank line) and `body` over a raw socket, read
    the reply to EOF: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply:
                headers, _, rest = reply.partition(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in headers.split(b"\r\n")
                          if h.lower().startswith(b"content-length")]
                if length and len(rest) >= length[0]:
                    break
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2])


# ---- 1. body size, tokenisation off the event loop, prompt length ---------------------------

def test_declared_body_over_the_limit_gets_413_before_it_is_read(server):
    submitted = scheduler(server).submitted
    status, body = raw_http(server.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                         "Content-Type: application/json\r\nContent-Length: 9437184")
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and "8 MB" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert scheduler(server).submitted == submitted


def test_chunked_body_over_the_limit_gets_413(server):
    size = 8 * 2**20 + 1
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked")
    status, body = raw_http(server.port, head, f"{size:x}\r\n".encode() + b" " * size + b"\r\n")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert health(server)["status"] == "ok"


def cancelled_count(server, endpoint: str) -> float:
    for line in httpx2.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'eagle_serve_requests_total{{endpoint="{endpoint}",outcome="cancelled"}}'):
            return float(line.split()[-1])
    return 0.0


def test_client_gone_before_its_body_arrived_is_a_cancel(server):
    before = cancelled_count(server, "completions")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        assert health(server)["status"] == "ok"  # answered after the server began reading that body
    wait_for(lambda: cancelled_count(server, "completions") == before + 1, what="counted as cancelled")


def test_tokenising_runs_off_the_event_loop(server, monkeypatch):
    """While one request's prompt is being tokenised, /health and other requests answer."""
    frontend = server.app.state.frontend
    entered, release = threading.Event(), threading.Event()
    real = frontend.prompt_ids

    def slow_prompt_ids(req):
        if req.prompt == "tokenise me slowly":
            entered.set()
            release.wait(30)
        return real(req)

    monkeypatch.setattr(frontend, "prompt_ids", slow_prompt_ids)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=httpx2.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "tokenise me slowly", "max_tokens": 2},
        timeout=60)))
    t.start()
    try:
        assert entered.wait(30)
        assert health(server)["status"] == "ok"  # the event loop is free while the tokenizer works
        assert httpx2.get(server.url + "/v1/models", timeout=10).status_code == 200
    finally:
        release.set()
        t.join(60)
    assert got["r"].status_code == 200 and 1 <= got["r"].json()["usage"]["completion_tokens"] <= 2


def test_huge_prompt_is_refused_from_a_prefix(server, reference):
    """A prompt far over the capacity is refused after tokenising only its first
    max_length * PREFIX_CHARS_PER_TOKEN characters."""
    from eagle_deploy.serve.app import PREFIX_CHARS_PER_TOKEN, Frontend
    from eagle_deploy.serve.protocol import parse_completion

    m = reference.manifest
    seen = []

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode(self, text, **kw):
            seen.append(len(text))
            return self.tok.encode(text, **kw)

    frontend = Frontend(Spy(reference.tokenizer), m.max_length, m.dims.vocab)
    req = parse_completion({"model": MODEL, "prompt": "words and more words " * 100_000})
    with pytest.raises(Exception) as info:
        frontend.prompt_ids(req)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "at least" in err.message and f"at most {m.max_length - 1} prompt tokens" in err.message
    n = int(err.message.split("at least ")[1].split()[0])  # a lower bound: the text was not tokenised whole
    assert err.message.endswith(f"shorten the prompt, or re-export with `eagle-export --max-length` {n + 1} or more "
                                "plus the new tokens wanted")
    assert seen == [m.max_length * PREFIX_CHARS_PER_TOKEN]
    # over the server: same refusal, the engine never sees it
    submitted = scheduler(server).submitted
    r = httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "w " * 200_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert scheduler(server).submitted == submitted


def test_compressive_text_is_refused_from_a_longer_prefix():
    """Text that packs many characters into each token: prefixes 4 times longer each time,
    never the whole text."""
    from eagle_deploy.serve.app import PREFIX_CHARS_PER_TOKEN, Frontend
    from eagle_deploy.serve.protocol import parse_completion

    seen = []

    class Packed:  # one token per 64 characters
        def encode(self, text, **kw):
            seen.append(len(text))
            return [1] * (len(text) // 64)

    frontend = Frontend(Packed(), 256, 1000)
    with pytest.raises(Exception) as info:
        frontend.prompt_ids(parse_completion({"model": MODEL, "prompt": " " * 2_000_000}))
    assert info.value.code == "context_length_exceeded"
    cut = 256 * PREFIX_CHARS_PER_TOKEN
    assert seen == [cut, 4 * cut, 16 * cut]  # 64, 256, then 1024 tokens: over 256 + 8


# ---- 2. a queued client that gives up frees its place at once -------------------------------

def test_queued_clients_that_give_up_free_their_places_at_once(server, faults, long_prompt):
    sched = scheduler(server)
    n = len(sched.slots)
    cancelled, limit = sched.cancelled, sched.max_queue
    with holding(server, faults, n, long_prompt) as held:
        for i in range(3):  # each waits in the queue, then its client gives up
            with pytest.raises(httpx2.TimeoutException):
                httpx2.post(server.url + "/v1/completions", timeout=0.5,
                            json={"model": MODEL, "prompt": f"gives up {i}", "max_tokens": 4})
        wait_for(lambda: sched.cancelled - cancelled == 3, what="3 cancelled")
        h = health(server)
        assert (h["queued"], h["active"]) == (0, n)  # places freed while every slot is still held
        sched.max_queue = 1  # one place: a new request takes it instead of getting 429
        try:
            late = {}
            t = threading.Thread(target=lambda: late.update(r=httpx2.post(
                server.url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 3,
                                                      "temperature": 0},
                timeout=60)))
            t.start()
            wait_for(lambda: health(server)["queued"] == 1, what="the late request queued")
        finally:
            sched.max_queue = limit
    t.join(60)
    assert late["r"].status_code == 200 and late["r"].json()["usage"]["completion_tokens"] == 3
    assert held == {i: 200 for i in range(n)}


def test_scheduler_drops_a_cancelled_queued_job_at_once(reference):
    import asyncio

    from eagle_deploy.runtime.request import Request
    from eagle_deploy.serve.scheduler import RoundGate, Slot, SlotScheduler, Work

    sched = SlotScheduler([Slot(reference, RoundGate())], max_queue=2)  # never started: jobs stay queued
    loop = asyncio.new_event_loop()
    try:
        a, b = sched.submit(Work(Request((1, 2), 4)), loop), sched.submit(Work(Request((1, 2), 4)), loop)
        a.cancel()
        assert (sched.queued, sched.cancelled, a.state, b.state) == (1, 1, "cancelled", "queued")
        sched.submit(Work(Request((1, 2), 4)), loop)  # the freed place is taken
        assert sched.queued == 2
        a.cancel()  # twice: nothing more
        assert sched.cancelled == 1
    finally:
        loop.close()


# ---- 4. per-request deadline ----------------------------------------------------------------

def test_request_deadline_non_stream_gets_408(server, faults, long_prompt):
    faults.release.clear()
    cancelled = scheduler(server).cancelled
    r = httpx2.post(server.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": long_prompt, "max_tokens": 50, "temperature": 0,
                          "user": "hold-deadline", "request_timeout_s": 0.3})
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"]) == ("request_timeout", "timeout_error") and "0.3 s" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    wait_for(lambda: scheduler(server).cancelled == cancelled + 1, what="the job cancelled")
    h = wait_for(lambda: (x := health(server))["active"] == 0 and x, what="idle")
    assert h["queued"] == 0
    # the openai client (2 retries by default) raises at once instead of retrying the same deadline
    submitted = scheduler(server).submitted
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=2, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=50, temperature=0, user="hold-openai",
                                  extra_body={"request_timeout_s": 0.3})
    assert info.value.status_code == 408 and info.value.body["code"] == "request_timeout"
    assert scheduler(server).submitted == submitted + 1


def test_request_deadline_in_a_stream_ends_it_with_an_error_event(server, faults, reference, oracle_refs):
    """The first text is streamed, then every round waits past the deadline (3 s: far longer
    than the tiny model takes to its first text)."""
    faults.release.clear()

    def texty(p):  # text within its first 30 tokens, no EOS before 50: the stream starts, then waits
        ref = oracle_refs[p]
        return len(ref) >= 50 and reference.tokenizer.decode(ref[:30], skip_special_tokens=True)

    prompt = next(p for p in ORACLE_PROMPTS if texty(p))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 50, "temperature": 0, "user": "later-stream",
            "stream": True, "request_timeout_s": 3}
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1]["error"]["code"] == "request_timeout" and "data: [DONE]" not in raw
    assert events[0]["choices"][0]["text"] and all("error" not in e for e in events[:-1])
    wait_for(lambda: health(server)["active"] == 0, what="idle")


@pytest.mark.parametrize("value", [0, -1, "soon"])
def test_bad_request_timeout_field(server, value):
    r = httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "request_timeout_s": value},
                    timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_timeout_s"


# ---- 5. JSON nested too deeply, lone surrogates ---------------------------------------------

def test_deeply_nested_json_gets_400(server):
    raw = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx2.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                    timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "nested too deeply" in err["message"]


@pytest.mark.parametrize("endpoint, field, param", [
    ("completions", '"prompt": "abc \\ud800"', "prompt"),
    ("chat/completions", '"messages": [{"role": "user", "content": "abc \\udfff"}]', "messages[0].content"),
    ("completions", '"prompt": "ok", "stop": ["x", "\\ud83d"]', "stop[1]"),
])
def test_lone_surrogate_gets_400_naming_the_field(server, endpoint, field, param):
    raw = ('{"model": "tiny", ' + field + "}").encode()
    r = httpx2.post(f"{server.url}/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"},
                    timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"]


# ---- 7. stop-string caps --------------------------------------------------------------------

@pytest.mark.parametrize("stop, what, param", [
    ([f"s{i}" for i in range(MAX_STOPS + 1)], f"at most {MAX_STOPS} stop", "stop"),
    (["y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters", "stop[0]")])
def test_stop_strings_are_capped(server, stop, what, param):
    """The runtime's caps (runtime.request), the same in the Python API."""
    submitted = scheduler(server).submitted
    r = httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": stop}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and what in err["message"] and err["message"].startswith(param + " ")
    assert scheduler(server).submitted == submitted
    ok = httpx2.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOPS - 1)] + ["z" * 256]})
    assert ok.status_code == 200


# ---- 9. speculative counters ----------------------------------------------------------------

def spec_metrics(server) -> dict:
    out = {}
    for line in httpx2.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("vllm:spec_decode_num_", "eagle_serve_verification_rounds_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_speculative_usage_and_vllm_counters(server, long_prompt):
    prompt = long_prompt
    rounds = 3
    n = 1 + rounds * (ORACLE_DEPTH + 1)  # the prefill's token, then full oracle rounds
    before = spec_metrics(server)
    r = httpx2.post(server.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}).json()
    spec = r["usage"]["speculative"]
    assert spec == {"rounds": rounds, "drafts": rounds, "draft_tokens": rounds * ORACLE_DEPTH,
                    "accepted_tokens": rounds * ORACLE_DEPTH, "accepted_per_pos": [rounds] * ORACLE_DEPTH,
                    "mean_accept_len": ORACLE_DEPTH + 1.0}
    assert r["usage"]["completion_tokens"] == n
    after = spec_metrics(server)
    labels = '{engine="0",model_name="tiny"}'
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta[f"vllm:spec_decode_num_drafts_total{labels}"] == rounds
    assert delta['eagle_serve_verification_rounds_total{mode="eagle"}'] == rounds  # every round drafted here
    assert delta[f"vllm:spec_decode_num_draft_tokens_total{labels}"] == rounds * ORACLE_DEPTH
    assert delta[f"vllm:spec_decode_num_accepted_tokens_total{labels}"] == rounds * ORACLE_DEPTH
    for p in range(ORACLE_DEPTH):
        assert delta[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",'
                     f'position="{p}"}}'] == rounds


def test_vanilla_request_counts_no_drafts(server, long_prompt):
    before = spec_metrics(server)
    r = httpx2.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": long_prompt, "max_tokens": 6, "temperature": 0, "mode": "vanilla"}).json()
    spec = r["usage"]["speculative"]
    assert (spec["rounds"], spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (5, 0, 0, 0)
    after = spec_metrics(server)
    vanilla = 'eagle_serve_verification_rounds_total{mode="vanilla"}'
    assert after[vanilla] - before.get(vanilla, 0.0) == 5  # its rounds are counted, as no drafts
    assert {k: v for k, v in after.items() if k != vanilla} == {k: v for k, v in before.items() if k != vanilla}


def test_spec_counts_from_stats():
    from eagle_deploy.runtime.acceptance import SpecCounts
    from eagle_deploy.runtime.decode import Stats

    s = Stats(accepted_per_round=[3, 1, 1, 2], tree_depth_per_round=[3, 0, 2, 2])  # round 2: root-only tree
    c = SpecCounts.from_stats(s)
    assert (c.rounds, c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (4, 3, 7, 3, (2, 1, 0))
    assert c.mean_accept_len == 1.75
    assert s.to_json()["speculative"] == c.usage()  # what Triton's stats output and usage.speculative carry


def test_a_request_cut_by_the_kv_capacity_says_so(server, reference):
    """finish_reason "length" with `eagle.limited_by` naming the limit that ran out: "capacity"
    when the export's KV rows filled before the request's max_tokens, "max_tokens" (the HTTP
    field's name) otherwise."""
    m = reference.manifest
    ids = reference.prompt_ids(ORACLE_PROMPTS[0], chat=False)
    prompt = (ids * m.max_length)[:m.max_length - 3]  # 3 KV rows left: 4 new tokens (the last needs no row)
    r = httpx2.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 50, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4
    assert r["eagle"]["limited_by"] == "capacity"
    r = httpx2.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["eagle"]["limited_by"] == "max_tokens"
