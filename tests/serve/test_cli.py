"""`eagle-serve` as a user starts it: a subprocess on a loopback port, one request, Ctrl-C."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx2
import pytest

from eagle_deploy.serve import cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a server in a child process for seconds: in `make test`, not `make test-fast`
def test_eagle_serve_subprocess(serve_export):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eagle_deploy.serve.cli", "--engines", str(serve_export),
                             "--port", str(port), "--threads", "1", "--vanilla", "--log-level", "warning",
                             "--slots", "3", "--fixed-tree"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                health = httpx2.get(url + "/health", timeout=2).json()
                break
            except httpx2.TransportError:
                assert time.monotonic() < deadline, "eagle-serve did not come up"
                time.sleep(0.2)
        assert health["decoding"]["mode"] == "vanilla" and health["batching"]["slots"] == 3
        r = httpx2.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                       "temperature": 0}, timeout=30).json()
        assert r["usage"]["completion_tokens"] == 4 and r["eagle"]["mode"] == "vanilla"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, 130), err[-2000:]
    assert "serving 'tiny'" in err and "3 requests at a time" in err


@pytest.mark.parametrize("argv", [["--acceptance", "threshold", "--threshold", "0"], ["--threshold", "0.5"],
                                  ["--max-queue", "0"],
                                  ["--total-tokens", "1"], ["--slots", "0"], ["--slots", "2", "--backend", "trt"]])
def test_bad_settings_exit_2(serve_export, argv, capsys):
    assert cli.main(["--engines", str(serve_export), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle-serve: error:") and len(err.strip().splitlines()) == 1
    if argv[0] in ("--max-queue", "--slots") and argv[1] == "0":
        assert f"{argv[0]} must be >= 1, got 0" in err
    if argv[0] == "--threshold":
        assert "--threshold has no effect without --acceptance threshold" in err


def test_missing_export_exits_2(tmp_path, capsys):
    assert cli.main(["--engines", str(tmp_path / "nope")]) == 2


def start_server(serve_export, *flags) -> tuple[subprocess.Popen, int]:
    """eagle-serve in a subprocess on a free port, once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eagle_deploy.serve.cli", "--engines", str(serve_export),
                             "--port", str(port), "--threads", "1", "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except httpx2.TransportError:
            assert time.monotonic() < deadline, "eagle-serve did not come up"
            time.sleep(0.2)


def hang_a_request(port: int) -> socket.socket:
    """A request whose body never finishes arriving: the server drains it forever. Returns
    once a later request has been answered (so the server is already reading this one)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    return sock


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except OSError:
        return True


@pytest.mark.slow  # a server in a child process for seconds: in `make test`, not `make test-fast`
def test_shutdown_timeout_bounds_the_drain(serve_export):
    proc, port = start_server(serve_export, "--shutdown-timeout-s", "1")
    sock = hang_a_request(port)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # without the bound: never (the request never completes)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    assert "timeout graceful shutdown exceeded" in err, err[-2000:]


@pytest.mark.slow  # a server in a child process for seconds: in `make test`, not `make test-fast`
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_exits_at_once(serve_export, sig):
    proc, port = start_server(serve_export, "--shutdown-timeout-s", "600")
    sock = hang_a_request(port)
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not refused(port):  # the first signal was taken: no new connections, draining
            assert time.monotonic() < deadline, "the server kept listening after SIGTERM"
            time.sleep(0.05)
        assert proc.poll() is None  # still draining the hung request (for up to 600 s)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig
    assert f"eagle-serve: second {signal.Signals(sig).name}: exiting now" in err


def test_limits_and_access_reach_uvicorn_and_the_app(monkeypatch):
    from eagle_deploy.serve.cli import SHUTDOWN_GRACE_S, api_key, build_parser, uvicorn_config
    from eagle_deploy.serve.guard import BODY_TIMEOUT_S, HEAD_TIMEOUT_S

    args = build_parser().parse_args(["--engines", "x", "--keep-alive-s", "7", "--max-connections", "40",
                                      "--shutdown-timeout-s", "12.5", "--max-body-mb", "2",
                                      "--header-timeout-s", "3", "--body-timeout-s", "20"])
    config = uvicorn_config(args, app=None)
    # --max-connections is the app's RequestLimit: uvicorn's limit_concurrency counts half-sent requests
    assert (config.timeout_keep_alive, config.limit_concurrency, config.timeout_graceful_shutdown) == \
        (7, None, 12.5 + SHUTDOWN_GRACE_S)
    assert (config.http.head_timeout, config.http.body_timeout) == (3.0, 20.0)
    defaults = uvicorn_config(build_parser().parse_args(["--engines", "x"]), app=None)
    assert (defaults.timeout_keep_alive, defaults.limit_concurrency, defaults.timeout_graceful_shutdown) == \
        (5, None, 30.0 + SHUTDOWN_GRACE_S)
    assert (defaults.http.head_timeout, defaults.http.body_timeout) == (HEAD_TIMEOUT_S, BODY_TIMEOUT_S) == (10, 60)
    monkeypatch.delenv("EAGLE_SERVE_API_KEY", raising=False)
    assert api_key(args) is None
    monkeypatch.setenv("EAGLE_SERVE_API_KEY", "from-env")
    assert api_key(args) == "from-env"
    assert api_key(build_parser().parse_args(["--engines", "x", "--api-key", "flag"])) == "flag"


def test_the_api_key_is_read_without_surrounding_whitespace(monkeypatch):
    """Issue 53: EAGLE_SERVE_API_KEY=$'k\\n' (a key written with echo) locked out every client."""
    from eagle_deploy.serve.cli import api_key, build_parser

    args = build_parser().parse_args(["--engines", "x"])
    monkeypatch.setenv("EAGLE_SERVE_API_KEY", "sk-local\n")
    assert api_key(args) == "sk-local"
    assert api_key(build_parser().parse_args(["--engines", "x", "--api-key", " sk-flag\r\n"])) == "sk-flag"


def test_eagle_serve_verifies_every_file_by_default():
    """Issue 53: a served export is hashed whole (--verify full); eagle-run keeps "fast"."""
    from eagle_deploy.runtime import cli as run_cli

    assert cli.build_parser().parse_args(["--engines", "x"]).verify == cli.SERVE_VERIFY == "full"
    assert "(default: full)" in " ".join(cli.build_parser().format_help().split())
    assert run_cli.build_parser().parse_args(["--engines", "x", "--prompt", "p"]).verify == "fast"


@pytest.mark.parametrize("argv, message", [
    (["--max-body-mb", "0"], "--max-body-mb must be > 0, got 0.0"),
    (["--request-timeout-s", "-1"], "--request-timeout-s must be > 0, got -1.0"),
    (["--shutdown-timeout-s", "0"], "--shutdown-timeout-s must be > 0, got 0.0"),
    (["--keep-alive-s", "0"], "--keep-alive-s must be >= 1, got 0"),
    (["--max-connections", "0"], "--max-connections must be >= 1, got 0"),
    (["--api-key", " "], "the API key (--api-key / EAGLE_SERVE_API_KEY) is empty"),
    (["--api-key", "\n"], "the API key (--api-key / EAGLE_SERVE_API_KEY) is empty"),
    (["--header-timeout-s", "0"], "--header-timeout-s must be > 0, got 0.0"),
    (["--body-timeout-s", "-2"], "--body-timeout-s must be > 0, got -2.0"),
])
def test_bad_limits_exit_2(serve_export, argv, message, capsys):
    assert cli.main(["--engines", str(serve_export), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle-serve: error:") and message in err and len(err.strip().splitlines()) == 1
