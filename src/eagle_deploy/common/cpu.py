"""The CPU a figure was measured on: model name, family / model numbers and the instruction
sets that change speed or numerics here (AVX2 vs AVX-512, native bf16, VNNI, AMX), read from
Linux's /proc/cpuinfo (the fields `lscpu` prints). Speed figures are only comparable within one
CPU, so benchmark records carry this beside their numbers, and caches keyed on the machine use
it (runtime/api.py's device costs)."""
from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

# the flags recorded with a measurement: each changes which kernels onnxruntime / torch run
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16",
             "amx_int8", "amx_tile")


@dataclass(frozen=True)
class CpuInfo:
    """model: the "model name" line (platform.processor() when /proc/cpuinfo is missing);
    family / model_id: "cpu family" / "model" (None when absent); flags: every flag of the
    first processor; cores: os.cpu_count()."""

    model: str
    family: int | None
    model_id: int | None
    flags: frozenset[str]
    cores: int | None

    @property
    def isa(self) -> list[str]:
        """The ISA_FLAGS this CPU has, in ISA_FLAGS order."""
        return [f for f in ISA_FLAGS if f in self.flags]

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 dot products run natively (avx512_bf16 or amx_bf16); elsewhere torch
        emulates bf16, slower than fp32."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def to_json(self) -> dict:
        return {"cpu_model": self.model, "cpu_family": self.family, "cpu_model_id": self.model_id,
                "isa": self.isa, "cpu_count": self.cores}


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """This machine's CpuInfo, from `cpuinfo` (the text of /proc/cpuinfo; read when None). Only
    the first processor's block is read. Never raises: unknown fields stay None / empty."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        return int(fields[key]) if re.fullmatch(r"\d+", fields.get(key, "")) else None

    model = fields.get("model name") or platform.processor() or platform.machine()
    return CpuInfo(model, number("cpu family"), number("model"), frozenset(fields.get("flags", "").split()),
                   os.cpu_count())


def machine_record(threads: int) -> dict:
    """The machine a measurement ran on, as eagle-bench's results and --tune's records hold it:
    platform, processor, the CPU (CpuInfo.to_json) and the thread count used."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            **cpu_info().to_json(), "threads": threads}
