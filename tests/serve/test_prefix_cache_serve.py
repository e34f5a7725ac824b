"""eagle-serve's prefix cache (--prefix-cache-mb): a conversation's next turn reports the
prompt tokens it reused as OpenAI does (usage.prompt_tokens_details.cached_tokens, streamed
and not), /metrics counts the hits and the tokens, and the answers are the reference's."""
from __future__ import annotations

import httpx2
import openai
import pytest

from tests.serve.conftest import Faults, make_server

MODEL = "tiny"


def metric(srv, name: str) -> float:
    lines = [line for line in httpx2.get(srv.url + "/metrics").text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, name
    return float(lines[0].split()[1])


def idle(srv) -> None:
    """Wait until no request runs: its answer is settled into the cache by then."""
    import time

    deadline = time.monotonic() + 30
    while (h := httpx2.get(srv.url + "/health").json())["active"] + h["queued"] and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_second_chat_turn_reports_its_cached_tokens(serve_export, reference, slots):
    srv = make_server(serve_export, Faults(), slots=slots, prefix_cache_mb=4,
                      **({"prefill_chunk": 8} if slots > 1 else {}))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        chat = [{"role": "user", "content": "Hello there, how are you?"}]
        one = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        assert one.choices[0].message.content == reference.generate(chat, 16).text
        idle(srv)
        chat += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
        two = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
        cached = two.usage.prompt_tokens_details.cached_tokens
        # turn 1's prompt, and as much of its answer as its text encodes back to (the tiny
        # model's random bytes are not all UTF-8)
        assert one.usage.prompt_tokens <= cached < two.usage.prompt_tokens
        assert two.choices[0].message.content == reference.generate(chat, 16).text
        idle(srv)
        ids = reference.encode("The quick brown fox", chat=False)  # token ids: the answer's own ids come back
        answer = reference.generate(ids, 12).token_ids
        first = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
        idle(srv)
        follow = client.completions.create(model=MODEL, prompt=ids + answer + ids, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert follow.usage.prompt_tokens_details.cached_tokens == len(ids) + len(answer)
        assert follow.choices[0].text == reference.generate(ids + answer + ids, 12).text
        hits, tokens = 2, cached + len(ids) + len(answer)
        idle(srv)
        chunks = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.prompt_tokens == two.usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 2  # held whole: 2 rows prefilled
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == two.choices[0].message.content
        assert metric(srv, "eagle_serve_prefix_cache_hits_total") == hits + 1
        assert metric(srv, "eagle_serve_prefix_cache_cached_tokens_total") == tokens + usage.prompt_tokens - 2
        cache = srv.app.state.scheduler.prefix_cache
        assert metric(srv, "eagle_serve_prefix_cache_bytes") == cache.nbytes > 0
        assert cache.nbytes <= cache.budget == 4 * 2**20
    finally:
        srv.stop()


def test_without_the_cache_nothing_is_cached(serve_export):
    srv = make_server(serve_export, Faults())
    try:
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
        for _ in range(2):
            r = httpx2.post(srv.url + "/v1/completions", json=body, timeout=60).json()
            assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert srv.app.state.scheduler.prefix_cache is None
        assert metric(srv, "eagle_serve_prefix_cache_hits_total") == 0
        assert metric(srv, "eagle_serve_prefix_cache_bytes") == 0
    finally:
        srv.stop()


def test_the_load_client_counts_cached_prompt_tokens(serve_export, tmp_path):
    """Its cells send the same prompts: against a server with a cache, the later cells' TTFT is
    not a full prefill's, and the table says so."""
    from eagle_deploy.bench import load
    from tests.tiny_export import prompt_file

    srv = make_server(serve_export, Faults(), prefix_cache_mb=4)
    try:
        cfg = load.LoadConfig(srv.url, prompts=load.load_prompts([str(prompt_file(tmp_path))]), concurrency=[1, 1],
                              modes=["vanilla"], max_tokens=6, endpoint="completions", timeout=60, warmup=False)
        result = load.run_load(cfg)
        first, again = result["cells"]
        assert first["cached_tokens"] == 0 < again["cached_tokens"]
        assert f"note: {again['cached_tokens']:,} prompt tokens came from the server's prefix cache" in \
            load.format_table(result)
    finally:
        srv.stop()
