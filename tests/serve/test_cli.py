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
        assert health["engine"]["mode"] == "vanilla" and health["batching"]["slots"] == 3
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


@pytest.mark.parametrize("argv", [["--acceptance", "threshold", "--threshold", "0"], ["--max-queue", "0"],
                                  ["--total-tokens", "1"], ["--slots", "0"], ["--slots", "2", "--backend", "trt"]])
def test_bad_settings_exit_2(serve_export, argv, capsys):
    assert cli.main(["--engines", str(serve_export), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle-serve: error:") and len(err.strip().splitlines()) == 1
    if argv[0] in ("--max-queue", "--slots") and argv[1] == "0":
        assert f"{argv[0]} must be >= 1, got 0" in err


def test_missing_export_exits_2(tmp_path, capsys):
    assert cli.main(["--engines", str(tmp_path / "nope")]) == 2
