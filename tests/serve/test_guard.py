"""eagle-serve against clients that send slowly or not at all (issue 53): the request head and
body deadlines (`guard.guarded_protocol`), the request limit that half-requests cannot fill
(`guard.RequestLimit`, --max-connections), and streams ended at the close of a shutdown's
drain. Real sockets on 127.0.0.1, a handful of them; every wait is bounded and no assertion
depends on how fast the machine is (a deadline is checked to have been applied, not timed)."""
from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time

import httpx2
import pytest

from tests.serve.conftest import Faults, make_server

KEY = "sk-guard-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"  # no key, and never finished


@pytest.fixture(scope="module")
def guarded(serve_export):
    """API key, at most 1 request in progress, 1 s for a head and for a body."""
    srv = make_server(serve_export, Faults(), app_kw={"api_key": KEY, "max_requests": 1},
                      cli_flags=["--header-timeout-s", "1", "--body-timeout-s", "1"])
    yield srv
    srv.stop()


def read_to_eof(sock: socket.socket, limit_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (limit_s at most)."""
    sock.settimeout(limit_s)
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


def status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def complete(srv, **extra) -> httpx2.Response:
    return httpx2.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, **extra})


def test_half_requests_neither_fill_the_limit_nor_stay_open(guarded):
    """Issue 53 scenario: with --max-connections 4 (here 1), four sockets that sent half a
    request line made every authenticated client get 503 for as long as they stayed open."""
    socks = [socket.create_connection(("127.0.0.1", guarded.port), timeout=30) for _ in range(4)]
    try:
        for s in socks:
            s.sendall(HALF_HEAD)
        for _ in range(2):
            r = complete(guarded)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        for s in socks:  # each is answered 408 and closed once its head is overdue
            status, err = status_and_error(read_to_eof(s))
            assert (status, err["code"], err["type"]) == (408, "request_timeout", "timeout_error")
            assert "--header-timeout-s" in err["message"]
    finally:
        for s in socks:
            s.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_at_its_deadline(guarded):
    """Trickling bytes does not push the deadline back: the head's whole time is bounded."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        sent = 0
        try:
            for sent in range(1, len(head) + 1):  # 0.1 s a byte: the whole head would take 34 s
                s.sendall(head[sent - 1:sent])
                if select.select([s], [], [], 0.1)[0]:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < len(head), "the server waited for the whole trickled head"
        assert read_to_eof(s).startswith(b"HTTP/1.1 408")


def test_a_connection_that_sends_nothing_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        status, err = status_and_error(read_to_eof(s))
    assert status == 408 and err["code"] == "request_timeout"


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ".encode())
        status, err = status_and_error(read_to_eof(s))
    assert (status, err["code"]) == (408, "request_timeout") and "--body-timeout-s" in err["message"]
    assert complete(guarded).status_code == 200  # its place in the limit was given back


def test_the_limit_counts_requests_in_progress_and_refuses_with_503(guarded, long_prompt):
    faults = guarded.faults
    faults.release.clear()
    faults.held = threading.Semaphore(0)
    held = {}
    t = threading.Thread(target=lambda: held.update(r=complete(guarded, prompt=long_prompt, max_tokens=8,
                                                               user="hold-limit")))
    t.start()
    try:
        assert faults.held.acquire(timeout=30), "the holder did not reach its first round"
        r = complete(guarded)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["type"]) == (503, "server_busy", "server_error")
        assert "--max-connections" in err["message"]
        assert httpx2.post(guarded.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                           timeout=30).status_code == 401  # no key: refused as ever, never counted
        assert httpx2.get(guarded.url + "/health", timeout=30).status_code == 200  # probes are not counted
    finally:
        faults.release.set()
        t.join(60)
    assert held["r"].status_code == 200
    assert complete(guarded).status_code == 200


def test_streams_cut_by_the_shutdown_timeout_end_with_an_error_event_and_done(serve_export, long_prompt):
    """The first SIGTERM starts the drain; past --shutdown-timeout-s a running stream gets an
    error event and [DONE] (before: uvicorn cancelled it, a broken transfer), a queued request
    a 503 server_shutdown."""
    srv = make_server(serve_export, Faults(), cli_flags=["--shutdown-timeout-s", "0.5"])
    faults = srv.faults
    try:
        events, queued = [], {}

        def stream():
            body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 50, "temperature": 0, "stream": True,
                    "user": "later-drain"}
            with httpx2.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line)

        def waiting():
            queued["r"] = httpx2.post(srv.url + "/v1/completions", timeout=60,
                                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        assert faults.held.acquire(timeout=30), "the stream did not start"
        threads.append(threading.Thread(target=waiting))
        threads[1].start()
        deadline = time.monotonic() + 30
        while srv.app.state.scheduler.queued < 1:
            assert time.monotonic() < deadline, "the second request was not queued"
            time.sleep(0.02)
        srv.server.handle_exit(signal.SIGTERM, None)  # what the first SIGTERM calls
        for t in threads:
            t.join(60)
        assert events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert (err["code"], err["type"]) == ("server_shutdown", "server_error")
        assert any('"text"' in e for e in events[:-2])  # the text sent before the cut stays
        assert queued["r"].status_code == 503 and queued["r"].json()["error"]["code"] == "server_shutdown"
    finally:
        faults.release.set()
        srv.stop()
