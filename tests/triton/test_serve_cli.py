"""`eagle-triton-serve --print-command`: what the launcher would run (nothing is started)."""
from __future__ import annotations

import pytest

from eagle_deploy.triton import serve


@pytest.mark.parametrize("argv, address", [([], "127.0.0.1"), (["--address", "0.0.0.0"], "0.0.0.0")])
def test_launcher_listens_on_loopback_unless_widened(tmp_path, capsys, argv, address):
    assert serve.main(["--repo", str(tmp_path), "--print-command", *argv]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[0].endswith("/tritonserver")
    flags = [f for f in cmd if f.startswith(("--http-address", "--grpc-address", "--metrics-address"))]
    assert flags == [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}"]
