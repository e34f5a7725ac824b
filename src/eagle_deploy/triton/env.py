"""The Python environment Triton's Python-backend stub runs in (EXECUTION_ENV_PATH).

nvidia-pytriton 0.7.0's stub (Triton 2.51, pybind11 2.10) needs numpy < 2: under numpy 2 it
corrupts TYPE_STRING inputs and writes zero-byte outputs (see worker.py). The project's own
environment pins numpy 2, so the stub gets a small venv of its own holding only numpy 1.26
(`STUB_REQUIREMENTS`), made from the current interpreter (so its Python version matches the stub
copied for it) and kept beside the project's venv: `<sys.prefix>/triton-stub-env`. The model's
decode worker still runs in the project's environment.

    python -m eagle_deploy.triton.env            # create it if missing (needs PyPI once), print its path
"""
from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
from pathlib import Path

STUB_REQUIREMENTS = ("numpy==1.26.4",)
_CHECK = "import sys, numpy; sys.exit(0 if int(numpy.__version__.split('.')[0]) < 2 else 3)"


class StubEnvError(RuntimeError):
    """The stub environment is missing or could not be created."""


def default_env_dir() -> Path:
    """`<sys.prefix>/triton-stub-env` (inside the active venv folder)."""
    return Path(sys.prefix) / "triton-stub-env"


def python_version(env: Path) -> str:
    """"MAJOR.MINOR" of a venv, read from its pyvenv.cfg (the current interpreter's if unreadable)."""
    try:
        for line in (Path(env) / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version", "version_info"):
                return ".".join(value.strip().split(".")[:2])
    except OSError:
        pass
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def env_ok(env: Path) -> bool:
    """Whether `env` is a venv (bin/activate) whose Python imports a numpy older than 2."""
    env = Path(env)
    if not (env / "bin" / "activate").is_file() or not (env / "bin" / "python").exists():
        return False
    return subprocess.run([str(env / "bin" / "python"), "-c", _CHECK], capture_output=True).returncode == 0


def ensure_stub_env(env: Path | None = None, quiet: bool = True) -> Path:
    """Create the stub venv at `env` (default `default_env_dir()`) unless it is already usable;
    return its absolute path. Safe to call from several processes at once (a file lock).
    Raises StubEnvError when venv or pip fails (e.g. PyPI unreachable), with pip's last lines."""
    env = Path(env or default_env_dir()).absolute()
    if env_ok(env):
        return env
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if env_ok(env):
            return env
        steps = [[sys.executable, "-m", "venv", "--clear", "--without-pip", str(env)],
                 [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
                  "--disable-pip-version-check", *(["-q"] if quiet else []), *STUB_REQUIREMENTS]]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
                raise StubEnvError(f"creating the Triton stub environment {env} failed at "
                                   f"`{' '.join(cmd[:4])} ...`:\n{tail}")
        if not env_ok(env):
            raise StubEnvError(f"the Triton stub environment {env} was created but does not import numpy < 2")
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_deploy.triton.env", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", type=Path, default=None, help="where (default: <sys.prefix>/triton-stub-env)")
    args = p.parse_args(argv)
    try:
        print(ensure_stub_env(args.env, quiet=False))
    except StubEnvError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
