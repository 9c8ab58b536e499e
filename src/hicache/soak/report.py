"""What a soak run saw, and how it is printed."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["SoakReport"]

_BOUNDARIES = (
    ("user_to_device", "user -> device"), ("user_to_host", "user -> host"), ("device_to_host", "device -> host"),
    ("host_to_storage", "host -> storage"), ("storage_to_host", "storage -> host"),
    ("host_to_device", "host -> device"),
)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class SoakReport:
    seconds: float = 0.0
    clients: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    cancelled: Counter[str] = field(default_factory=Counter)
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    restarts: int = 0
    faults: list[str] = field(default_factory=list)
    bytes_moved: Counter[str] = field(default_factory=Counter)
    page_bytes: int = 1
    lost_pages: int = 0
    storage_failures: int = 0
    wrong_kv: int = 0
    violations: list[str] = field(default_factory=list)
    short_retrieves: int = 0
    short_retrieve_tokens: int = 0
    dropped_tokens: int = 0  # tokens stores could not place (memory full of leased pages)
    eviction_waits: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    owed_checked: int = 0  # write-through pages looked for in storage after each phase
    owed_found: int = 0

    def record(self, verb: str, ms: float) -> None:
        self.ops[verb] += 1
        self.latencies_ms.setdefault(verb, []).append(ms)

    @property
    def ok(self) -> bool:
        """Wrong KV and broken invariants are never allowed; lost pages only when faults were injected."""
        if self.wrong_kv or self.violations:
            return False
        if self.faults:
            return True
        return self.lost_pages == 0 and self.owed_found == self.owed_checked

    def summary(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latencies_ms"}
        for name in ("ops", "cancelled", "bytes_moved"):
            out[name] = dict(out[name])
        out["latency_ms"] = {
            verb: {"p50": round(statistics.median(v), 3), "p99": round(_percentile(v, 0.99), 3), "n": len(v)}
            for verb, v in sorted(self.latencies_ms.items())
        }
        out["pages_moved"] = {key: self.bytes_moved[key] // self.page_bytes for key, _ in _BOUNDARIES}
        out["violations"] = self.violations[:20]
        out["hit_rate"] = round(self.hit_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0
        out["ok"] = self.ok
        return out

    def to_json(self) -> str:
        return json.dumps(self.summary(), indent=2)

    def render(self) -> str:
        s = self.summary()
        ops = ", ".join(f"{verb} {n} ({self.cancelled[verb]} cancelled)" for verb, n in sorted(self.ops.items()))
        lat = ", ".join(f"{verb} {v['p50']:.2f}/{v['p99']:.2f}" for verb, v in s["latency_ms"].items())
        moved = ", ".join(f"{label} {s['pages_moved'][key]}" for key, label in _BOUNDARIES)
        lines = [
            f"hicache soak: {self.seconds:.0f} s, {self.clients} clients, {self.restarts} cache restarts, "
            f"faults: {', '.join(self.faults) or 'none'}",
            f"operations: {ops}",
            f"latency ms p50/p99: {lat}",
            f"pages moved: {moved}",
            f"hit rate {s['hit_rate']:.3f}; short retrieves {self.short_retrieves} ({self.short_retrieve_tokens} tokens);"
            f" dropped by stores {self.dropped_tokens} tokens; allocation waits {self.eviction_waits};"
            f" storage failures {self.storage_failures}",
            f"lost pages: {self.lost_pages}   wrong KV: {self.wrong_kv}   invariant violations: {len(self.violations)}",
            f"write-through pages found in storage after each phase: {self.owed_found}/{self.owed_checked}",
            f"result: {'OK' if self.ok else 'FAILED'}",
        ]
        lines += [f"  violation: {v}" for v in self.violations[:10]]
        return "\n".join(lines)
