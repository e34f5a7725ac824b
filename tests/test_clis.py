"""What every CLI shares: `--help` and a bad flag are answered before any heavy import
(torch, onnxruntime, transformers and polygraphy are imported only by the code that runs
after argument parsing; importing torch alone takes seconds, 15 s on a cold cache; checked by
import, not by time), and Ctrl-C ends any of them with one line and exit status 130."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "onnxruntime", "transformers", "polygraphy")
SCRIPTS = {ep.name: ep.value for ep in importlib.metadata.distribution("eagle-deploy").entry_points
           if ep.group == "console_scripts"}

PROBE = """
import contextlib, importlib, io, json, sys
module, func = sys.argv[1].split(":")
main = getattr(importlib.import_module(module), func)
codes = []
for argv in (["--help"], ["--no-such-flag"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
            codes.append(None)
        except SystemExit as exit:
            codes.append(exit.code)
print(json.dumps({"codes": codes, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


def test_all_clis_are_covered():
    assert set(SCRIPTS) == {"eagle-export", "eagle-run", "eagle-train", "eagle-eval", "eagle-bench", "eagle-validate",
                            "eagle-serve", "eagle-triton-repo", "eagle-triton-serve"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_and_bad_flags_need_no_heavy_import(name):
    proc = subprocess.run([sys.executable, "-c", PROBE, SCRIPTS[name]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 2], result  # --help exits 0, an unknown flag is a usage error (2)
    assert result["loaded"] == [], f"{name}: {result['loaded'][:5]} imported before the arguments were parsed"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_ctrl_c_is_one_line_and_exit_130(name, monkeypatch, capsys):
    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", interrupted)
    module, func = SCRIPTS[name].split(":")
    assert getattr(importlib.import_module(module), func)([]) == 130
    out, err = capsys.readouterr()
    assert err.strip() == f"{name}: interrupted" and "Traceback" not in err + out


class _CtrlCAfter:
    """A stdout whose write raises KeyboardInterrupt once `n` characters of text came through,
    as Ctrl-C does when it lands while eagle-run --stream prints."""

    def __init__(self, n: int):
        self.n, self.text = n, ""

    def write(self, s: str) -> int:
        if len(self.text) >= self.n and s.strip():
            raise KeyboardInterrupt
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_ctrl_c_during_eagle_run_stream(mha, monkeypatch, capsys):
    from eagle_deploy.runtime import cli
    from tests.conftest import THREADS

    fake = _CtrlCAfter(3)
    monkeypatch.setattr(sys, "stdout", fake)
    rc = cli.main(["--engines", str(mha.export_dir), "--prompt", "hello", "--raw", "--max-new-tokens", "32",
                   "--threads", str(THREADS), "--stream"])
    err = capsys.readouterr().err
    assert rc == 130 and len(fake.text) >= 3
    assert err.strip().splitlines()[-1] == "eagle-run: interrupted" and "Traceback" not in err


def test_cli_error_is_one_line_and_status_2(capsys):
    from eagle_deploy.common.cli_args import BAD_INPUT, cli_error

    assert cli_error("eagle-x", ValueError("manifest.json tools.a\nb:  expected\tan integer")) == BAD_INPUT == 2
    assert capsys.readouterr().err == "eagle-x: error: manifest.json tools.a b: expected an integer\n"
