"""Start the Triton Inference Server shipped in the nvidia-pytriton wheel over a model repository.

    python -m eagle_deploy.triton.serve --repo triton-repo [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
    eagle-triton-serve --repo triton-repo -- --model-control-mode=explicit --load-model=eagle

The wheel (`pip install --no-deps nvidia-pytriton==0.7.0`; it declares numpy<2, which this
project cannot take, and none of its Python code is used) carries
`pytriton/tritonserver/bin/tritonserver` (Triton 2.51), the Python backend
(`pytriton/tritonserver/backends/python/`) and per-Python-version backend stubs
(`pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub`). The backend
needs the stub inside its own folder, so `prepare_backends` makes a backends folder
(`<sys.prefix>/triton-backends/python/`) of symlinks: the backend library and utils, and the
stub of the stub environment's Python version. Symlinks, not copies: the stub finds the wheel's
bundled libraries (libcudart, ...) through its RPATH `$ORIGIN/../../../../nvidia_pytriton.libs`,
which resolves from the symlink's target. No Debian packages are needed (all libraries are
bundled; CUDA / NVML / DCGM warnings at start are harmless on a CPU machine).

The launcher listens on 127.0.0.1 unless `--address` widens it (tritonserver itself listens
on every interface by default; access control: docs/triton-auth.md). Arguments
after `--` go to tritonserver unchanged. The launcher replaces itself with
tritonserver (exec), so signals reach the server directly. `TritonServer` is the same setup as
a context manager for tests and benchmarks (free loopback ports, readiness wait, log file).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle_deploy.common.cli_args import cli_error, interruptible

from .env import default_env_dir, ensure_stub_env, python_version

WHEEL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0"


class TritonUnavailable(RuntimeError):
    """The nvidia-pytriton wheel (tritonserver and the Python backend) is not installed."""


def wheel_root() -> Path:
    """`.../site-packages/pytriton/tritonserver` of the installed nvidia-pytriton wheel (found
    without importing pytriton). Raises TritonUnavailable with the install command."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable(f"tritonserver is not installed: {WHEEL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonUnavailable(f"{root}/bin/tritonserver is missing: reinstall with {WHEEL_HINT}")
    return root


def prepare_backends(dest: Path | None = None, stub_python: str | None = None) -> Path:
    """Make (or refresh) a Triton backends folder `dest` (default `<sys.prefix>/triton-backends`)
    whose python/ holds symlinks to the wheel's Python backend and the stub for Python
    `stub_python` ("3.11"; default: the stub environment's). Returns `dest`. Raises
    TritonUnavailable, FileNotFoundError (no stub for that Python version)."""
    root = wheel_root()
    dest = Path(dest or Path(sys.prefix) / "triton-backends").absolute()
    stub_python = stub_python or python_version(default_env_dir())
    stub = root / "python_backend_stubs" / stub_python / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise FileNotFoundError(f"the wheel has no Python-backend stub for Python {stub_python} "
                                f"(it has {', '.join(have)})")
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {p.name: p for p in (root / "backends" / "python").iterdir() if p.is_file()}
    links["triton_python_backend_stub"] = stub
    for name, target in links.items():
        link = python_dir / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        tmp = python_dir / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    return dest


def server_command(repo, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                   extra=(), backends: Path | None = None, address: str | None = None) -> list[str]:
    """The tritonserver argv for `repo` (backends folder prepared). address: bind HTTP, gRPC
    and metrics to this address only (e.g. 127.0.0.1); default all interfaces."""
    backends = backends or prepare_backends()
    cmd = [str(wheel_root() / "bin" / "tritonserver"), f"--model-repository={Path(repo).absolute()}",
           f"--backend-directory={backends}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--metrics-port={metrics_port}"]
    if address:
        cmd += [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}"]
    return cmd + list(extra)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on `host` right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TritonServer:
    """tritonserver from the wheel on free loopback ports, as a context manager:

        with TritonServer(repo, log_path=tmp / "triton.log", extra=["--model-control-mode=explicit",
                          "--load-model=eagle"]) as server:
            server.http_url   # "127.0.0.1:PORT" (tritonclient.http); server.grpc_url likewise

    `start()` waits until /v2/health/ready answers 200 (all loaded models ready) and raises
    RuntimeError with the log's tail if the server exits or `timeout` seconds pass."""

    def __init__(self, repo, log_path, extra=(), timeout: float = 300.0, exit_timeout_s: int = 5):
        self.repo, self.log_path, self.timeout = Path(repo), Path(log_path), timeout
        self.extra = [f"--exit-timeout-secs={exit_timeout_s}", *extra]
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> "TritonServer":
        ensure_stub_env()
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        cmd = server_command(self.repo, self.http_port, self.grpc_port, self.metrics_port, self.extra,
                             address="127.0.0.1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready within {self.timeout:.0f} s:\n{self.log_tail()}")

    def ready(self, model: str | None = None) -> bool:
        """GET /v2/health/ready (or /v2/models/MODEL/ready) answers 200."""
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the server's process group after exit_timeout + 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@interruptible("eagle-triton-serve")
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="eagle-triton-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, required=True,
                   help="a model repository (eagle-triton-repo / eagle-export --triton-repo)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--address", default="127.0.0.1",
                   help="address HTTP, gRPC and metrics listen on (default: 127.0.0.1, this machine only; 0.0.0.0 "
                        "for every interface: put auth in front first, docs/triton-auth.md)")
    p.add_argument("--print-command", action="store_true", help="print the tritonserver command instead of running it")
    args = p.parse_args(argv)
    try:
        ensure_stub_env()
        cmd = server_command(args.repo, args.http_port, args.grpc_port, args.metrics_port, extra, address=args.address)
    except (TritonUnavailable, FileNotFoundError, RuntimeError) as err:
        return cli_error("eagle-triton-serve", err)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
