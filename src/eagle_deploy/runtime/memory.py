"""Memory figures for eagle-run --json and eagle-bench: resident memory now and at its peak,
device memory in use on a GPU, and an export folder's size by file.

Peak RSS is the process high-water mark (VmHWM; ru_maxrss off Linux): it only rises, so a figure
taken after vanilla decoding and before the draft graph is loaded is vanilla's peak, and one
taken after EAGLE decoding in the same process is EAGLE's (eagle-run loads in that order).
eagle-bench measures each mode in a fresh process instead (bench/memory.py).
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

MIB = 2**20


def rss_mb() -> float | None:
    """Resident memory of this process now, MiB (psutil; None without it)."""
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.Process().memory_info().rss / MIB, 1)


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident memory of process `pid` and all its descendants now,
    MiB, from /proc/<pid>/status (RssAnon; RssFile + RssShmem). Anonymous memory is what the
    process holds; file-backed pages (memory-mapped weights, page cache it maps) can be dropped
    by the kernel under pressure. (0, 0) for processes that are gone; Linux only (psutil for the
    tree)."""
    import psutil

    anon = file = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key == "RssAnon":
                        anon += int(rest.split()[0])
                    elif key in ("RssFile", "RssShmem"):
                        file += int(rest.split()[0])
        except OSError:
            continue
    return round(anon / 1024, 1), round(file / 1024, 1)


def available_mb() -> float | None:
    """Memory the system can still give a process, MiB (psutil's `available`; None without it)."""
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().available / MIB, 1)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB: Linux's VmHWM (/proc/self/status), else
    ru_maxrss (KiB on Linux, bytes on macOS). Not ru_maxrss on Linux: it survives execve, so a
    process started by a large parent (eagle-bench's probes) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (MIB if sys.platform == "darwin" else 1024), 1)


def device_memory_mb(pid: int | None = None) -> float | None:
    """GPU memory this process holds, MiB, from NVML (pynvml) or `nvidia-smi`; None without a
    GPU or either tool."""
    pid = os.getpid() if pid is None else pid
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            used = 0
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory:
                        used += proc.usedGpuMemory
            return round(used / MIB, 1)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or no driver
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    used = 0.0
    for line in out.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                used += float(parts[1])
            except ValueError:
                pass
    return round(used, 1)


def export_sizes(folder: Path) -> dict:
    """{"files": {name: bytes} (a sub-folder, e.g. tokenizer/, as one entry), "total": bytes}
    of an export folder."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_dir():
            files[p.name + "/"] = sum(q.stat().st_size for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            files[p.name] = p.stat().st_size
    return {"files": files, "total": sum(files.values())}


def snapshot(device: bool = False) -> dict:
    """{"rss_mb", "peak_rss_mb"} now (+ "device_mb" when `device`)."""
    out = {"rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()}
    if device:
        out["device_mb"] = device_memory_mb()
    return out
