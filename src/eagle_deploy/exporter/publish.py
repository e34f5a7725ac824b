"""Putting a finished folder in place: `destination_lock` (one writer per destination) and
`publish_folder` (one atomic rename that never deletes the old folder before the new one is in
place). Standard library only; Linux (fcntl, renameat2) with a portable fallback."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


class DestinationBusyError(FileExistsError):
    """Another process (named in the message) is writing the same destination folder."""


def lock_path(out: Path) -> Path:
    """The lock file of destination `out`: `.<name>.lock` beside it."""
    return out.parent / f".{out.name}.lock"


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it ("pid 123, since 19:40:02 UTC")."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
    except OSError:
        text = []
    return f"pid {text[0]}, since {' '.join(text[1:3])} UTC" if len(text) >= 3 else "a process that is starting"


@contextmanager
def destination_lock(out: Path, what: str = "eagle-export"):
    """Hold an exclusive lock (fcntl.flock) on destination `out` for the `with` block, so that
    one process at a time writes it; the lock file (`lock_path`) holds the holder's pid and
    start time and is removed on exit. Raises DestinationBusyError naming the holder when
    another process holds it (nothing is waited for), OSError when the lock file cannot be
    written (read-only or full destination)."""
    path = lock_path(Path(out))
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise DestinationBusyError(f"{out} is being written by another {what} ({holder}; lock {path}): wait "
                                       "for it to finish or choose another --name") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its previous holder removed the file after we opened it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}\n".encode(), 0)
        yield path
    finally:
        try:
            os.unlink(path)  # still holding the lock: a waiter re-checks the inode (above)
        except OSError:
            pass
        os.close(fd)


def partial_prefix(out: Path) -> str:
    """The name prefix of the private folders a destination `out` is written in before its
    rename (`.<name>.partial-`)."""
    return f".{Path(out).name}.partial-"


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the partial folders of destination `out` (`partial_prefix`) that an export killed
    before it could clean up (SIGKILL, power loss) left beside it; returns them. Call it only
    while holding `destination_lock(out)`: then no live process is writing any of them. Backup
    folders (`.<name>.old-<pid>`) are left alone: one may be the only copy of an old export."""
    out = Path(out)
    stale = sorted(p for p in out.parent.glob(partial_prefix(out) + "*") if p.is_dir() and not p.is_symlink())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2) with `flags`; False where the C library or the file system lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def publish_folder(tmp: Path, out: Path, replace: bool = True) -> None:
    """Move the completely written folder `tmp` to `out` in one rename, so readers never see
    a half-written one. An existing `out` is replaced only if `replace` (checked now, at the
    rename): swapped with `tmp` atomically (RENAME_EXCHANGE), else renamed to a backup name
    first and restored if the new folder cannot be moved in; the old folder is deleted only
    once the new one is in place. Raises FileExistsError when `out` exists and not `replace`
    (nothing is changed), OSError when a rename fails."""
    tmp, out = Path(tmp), Path(out)
    tmp.chmod(0o755)  # mkdtemp makes it private
    if not os.path.lexists(out):
        try:
            if _renameat2(tmp, out, _RENAME_NOREPLACE) or _rename_if_absent(tmp, out):
                return
        except FileExistsError:
            pass  # appeared since the check above: handled as an existing folder
    if not replace:
        raise FileExistsError(f"{out} was created by another process while this one was writing it; nothing was "
                              "replaced (pass --force to replace it)")
    if _renameat2(tmp, out, _RENAME_EXCHANGE):  # tmp now holds the old folder
        shutil.rmtree(tmp, ignore_errors=True)
        return
    backup = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, backup)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(backup, out)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _rename_if_absent(tmp: Path, out: Path) -> bool:
    """os.rename where renameat2 is missing: it replaces nothing but an empty folder, which
    is refused here too (FileExistsError)."""
    if os.path.lexists(out):
        raise FileExistsError(str(out))
    try:
        os.rename(tmp, out)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(str(out)) from None
        raise
    return True
