"""`Run`: one timed generation, what every system eagle-bench times returns from
`run(ids, max_new_tokens, temperature, seed)` (bench/systems.py, bench/peers.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    """One timed generation. seconds: wall time of the whole request (prefill included)."""

    system: str
    token_ids: list[int]
    seconds: float
    ttft_ms: float | None = None
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)  # EAGLE/vanilla: tau, time_ms breakdown, rounds

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / max(self.seconds, 1e-9)

    def to_json(self) -> dict:
        out = {"new_tokens": len(self.token_ids), "seconds": round(self.seconds, 4),
               "tokens_per_s": round(self.tokens_per_s, 2),
               "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
               "finish_reason": self.finish_reason, "token_ids": list(self.token_ids)}
        out.update(self.stats)
        return out
