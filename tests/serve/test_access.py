"""eagle-serve with an API key and a server-wide deadline: a second server over the tiny export
(`create_app(api_key=..., request_timeout_s=...)`), raw HTTP and the official `openai` client."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx2
import openai
import pytest

from eagle_deploy.serve.guard import BearerAuth
from tests.serve.conftest import Faults, make_server

KEY = "sk-test-0123456789"
MODEL = "tiny"


@pytest.fixture(scope="module")
def locked(serve_export):
    srv = make_server(serve_export, Faults(), app_kw={"api_key": KEY, "request_timeout_s": 0.4})
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_gets_401(locked, headers):
    submitted = locked.app.state.scheduler.submitted
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/openapi.json")):
        r = httpx2.request(method, locked.url + path, headers=headers, json={"model": MODEL, "prompt": "x"},
                           timeout=30)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert locked.app.state.scheduler.submitted == submitted


def test_right_key_is_served_and_health_metrics_stay_open(locked, long_prompt):
    ok = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = ok.completions.create(model=MODEL, prompt=long_prompt, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert httpx2.get(locked.url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx2.get(locked.url + "/health").json()["status"] == "ok"
    assert "vllm:spec_decode_num_drafts_total" in httpx2.get(locked.url + "/metrics").text


def test_protected_health_and_metrics():
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(app, path, headers=()):
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(app({"type": "http", "path": path, "headers": list(headers)}, None, send))
        return sent[0]["status"], sent[1]["body"]

    guarded = BearerAuth(inner, KEY, open_paths=())
    for path in ("/health", "/metrics"):
        status, body = call(guarded, path)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert call(guarded, path, [(b"authorization", f"Bearer {KEY}".encode())]) == (200, b"ok")
    assert call(BearerAuth(inner, KEY), "/health") == (200, b"ok")  # open by default
    with pytest.raises(ValueError):
        BearerAuth(inner, "")


def test_server_deadline_applies_and_a_request_cannot_lengthen_it(locked, long_prompt):
    faults = locked.faults
    faults.release.clear()
    headers = {"Authorization": f"Bearer {KEY}"}
    for extra in ({}, {"request_timeout_s": 100}):
        r = httpx2.post(locked.url + "/v1/completions", headers=headers, timeout=60,
                        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 40, "temperature": 0,
                              "user": "hold-x", **extra})
        assert r.status_code == 408 and "0.4 s" in r.json()["error"]["message"], r.text
    faults.release.set()
    metrics = httpx2.get(locked.url + "/metrics").text
    assert 'eagle_serve_requests_total{endpoint="completions",outcome="timeout"} 2.0' in metrics


def test_the_deadline_covers_the_upload_of_the_body(locked):
    """Issue 53: half a body stayed open past the deadline with no answer; now a 408 at the
    deadline (0.4 s here), and the connection is closed (the rest of the body never came)."""
    with socket.create_connection(("127.0.0.1", locked.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ".encode())
        reply = b""
        while chunk := s.recv(65536):  # to EOF: the server closes the connection
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "0.4 s" in err["message"]
