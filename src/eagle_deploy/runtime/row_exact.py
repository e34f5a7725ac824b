"""How many rows a row-exact one-token target forward runs (decode.Decoder, row_exact).

Row-exact decoding needs each one-token forward to give the bits the same token gets as a row
of a forward of two or more rows. Two things decide whether one row can:
- attention: onnxruntime's GroupQueryAttention computes one query row with its own kernel, so a
  target graph must repeat a one-row query inside its attention (manifest
  `target.extra.repeats_one_row`, contract "One-row queries"; quantised exports since
  2026-12-07);
- the matmuls and norms: they must give a row the same bits alone as inside two or more rows.
  fp32 MatMul with a constant weight, the norms and MatMulNBits 8-bit (block 32, int8
  activations: the export's default) do on every x86-64 CPU measured; MatMulNBits 4-bit does on
  CPUs with AVX-512 only (an AVX2-only CPU runs one row through another path, which rounds
  differently); other settings (block 128, fp32 activations, dynamic int8) do not
  (tests/exporter/test_batch_invariance.py, exporter/quantize.py).
Where both hold, a row-exact one-token forward runs as one row; elsewhere as two (the token
repeated one position on), which is exact on every graph, repeating or not.
"""
from __future__ import annotations

import platform

from eagle_deploy.common.cpu import CpuInfo, cpu_info
from eagle_deploy.contract.manifest import GraphEntry

X86 = ("x86_64", "amd64")
ROW_EXACT_NBITS = {"block_size": 32, "accuracy_level": 4}  # the MatMulNBits settings measured row-exact alone


def matmuls_row_exact(graph: GraphEntry, cpu: CpuInfo | None = None, machine: str | None = None) -> bool:
    """Whether `graph`'s matmuls and norms give a row the same bits alone as inside a forward of
    two or more rows on this CPU (`cpu`: default cpu_info(); `machine`: default
    platform.machine()); False where unmeasured (not x86-64, other quantisation settings)."""
    if (machine or platform.machine()).lower() not in X86:
        return False
    info = graph.quant_info
    if info is None:
        return graph.quant is None
    if info.method != "nbits" or any(info.settings.get(k) != v for k, v in ROW_EXACT_NBITS.items()):
        return False
    return info.kind == "int8" or "avx512f" in (cpu or cpu_info()).flags


def step_rows(row_exact: bool, repeats_one_row: bool, one_row_exact: bool = True) -> int:
    """Rows a one-token target forward runs through the graph's matmuls: 2 when row-exact
    decoding runs it as two rows itself (the graph does not repeat one-row queries, or its
    matmuls are not row-exact alone here: `one_row_exact`, matmuls_row_exact), else 1."""
    return 2 if row_exact and not (repeats_one_row and one_row_exact) else 1


def target_kv_capacity(max_length: int, row_exact: bool, repeats_one_row: bool = False) -> int:
    """Rows of the target's KV buffer a Decoder allocates: `max_length`, plus the spare row a
    row-exact one-token forward, or any one-token forward of a graph that repeats one-row
    queries (contract rows_written), writes its repeated token into."""
    return max_length + 1 if row_exact or repeats_one_row else max_length
