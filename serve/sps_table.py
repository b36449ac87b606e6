"""The SPS table: the profiled cost model of the serving schedulers (paper §5.2).

Steps per second of a full step (draft + verify) by (batch bucket, capacity bucket, context length), and of a
plain step (no draft pass) by (batch bucket, context); profiled at start-up (serve/startup.py `_profile`), saved
and reloaded as JSON (`--sps-table`). The schedulers (serve/scheduler.py) read it expanded per token.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from dspark_jax.scheduling import bucket_sps


@dataclasses.dataclass
class SpsTable:
    """The profiled cost model: steps/s of a full step (draft + verify) by (batch bucket, capacity bucket,
    context length). Profiled with repeats at a few context lengths, smoothed to be monotone (more tokens or
    longer contexts never make a step faster), saved and reloaded as JSON (`--sps-table PATH`).

    `token_table(rows, context)` is what the schedulers read: SPS indexed by tokens in the pass for the batch
    bucket of `rows` running requests, linearly interpolated between the profiled context lengths (clamped at
    the ends), so the capacity search prices long contexts correctly.
    """

    entries: dict[tuple[int, int, int], float]  # (batch bucket, capacity, context) → steps/s
    plain: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (batch, context) → plain steps/s

    @property
    def contexts(self) -> list[int]:
        return sorted({c for _, _, c in self.entries})

    def smoothed(self) -> SpsTable:
        """Running minimum along capacity (for each batch bucket and context), then along context; a plain
        step is at least as fast as the full step of its batch bucket at the smallest capacity profiled there
        and the same context (it is that step without the draft pass and with ℓ = 0), then monotone in context."""
        out = dict(self.entries)
        for bb, ctx in {(b, c) for b, _, c in out}:
            best = np.inf
            for cap in sorted(k[1] for k in out if k[0] == bb and k[2] == ctx):
                best = min(best, out[bb, cap, ctx])
                out[bb, cap, ctx] = best
        for bb, cap in {(b, c) for b, c, _ in out}:
            best = np.inf
            for ctx in sorted(k[2] for k in out if k[0] == bb and k[1] == cap):
                best = min(best, out[bb, cap, ctx])
                out[bb, cap, ctx] = best
        plain = dict(self.plain)
        for bb, ctx in plain:
            caps = [c for b, c, x in out if b == bb and x == ctx]
            if caps:
                plain[bb, ctx] = max(plain[bb, ctx], out[bb, min(caps), ctx])
        for bb in {b for b, _ in plain}:
            best = np.inf
            for ctx in sorted(c for b, c in plain if b == bb):
                best = min(best, plain[bb, ctx])
                plain[bb, ctx] = best
        return SpsTable(out, plain)

    def plain_at(self, bb: int, context: float) -> float | None:
        """Steps/s of a plain step (no draft pass) for batch bucket bb, or None when not profiled."""
        ctxs = sorted(c for b, c in self.plain if b == bb)
        if not ctxs:
            return None
        return float(np.interp(context, ctxs, [self.plain[bb, c] for c in ctxs]))

    def at(self, bb: int, cap: int, context: float) -> float:
        ctxs = [c for c in self.contexts if (bb, cap, c) in self.entries]
        if not ctxs:
            return 0.0
        vals = [self.entries[bb, cap, c] for c in ctxs]
        return float(np.interp(context, ctxs, vals))

    def token_table(self, bb: int, context: float, capacities) -> np.ndarray:
        """f32 [capacities[-1] + 1]: SPS(N) = SPS of the smallest bucket ≥ N profiled for `bb`; 0 where none."""
        caps = [c for c in capacities if any(k[0] == bb and k[1] == c for k in self.entries)]
        table = np.zeros(int(capacities[-1]) + 1, np.float32)
        if not caps:
            return table
        sps_at = [self.at(bb, c, context) for c in caps]
        return np.asarray(bucket_sps(sps_at, caps, int(capacities[-1])), np.float32)

    def save(self, path: str) -> None:
        rows = [{"batch": b, "capacity": c, "context": x, "sps": v} for (b, c, x), v in sorted(self.entries.items())]
        plain = [{"batch": b, "context": x, "sps": v} for (b, x), v in sorted(self.plain.items())]
        with open(path, "w") as f:
            json.dump({"format": "dspark-sps-v2", "entries": rows, "plain": plain}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> SpsTable:
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("format") != "dspark-sps-v2":
                raise ValueError(f"unknown format {data.get('format')!r}")
            return cls({(int(r["batch"]), int(r["capacity"]), int(r["context"])): float(r["sps"])
                        for r in data["entries"]},
                       {(int(r["batch"]), int(r["context"])): float(r["sps"]) for r in data.get("plain", [])})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not an SPS table: {path}: {e}") from None

    def covers(self, shapes) -> bool:
        """Whether every (batch bucket, capacity) the runner can take has an entry."""
        have = {(b, c) for b, c, _ in self.entries}
        return all(tuple(s) in have for s in shapes)

    def summary(self) -> str:
        ctx = self.contexts[0] if self.contexts else 0
        parts = [f"{b}x{c}: {self.entries[b, c, ctx]:.1f}" for b, c, x in sorted(self.entries) if x == ctx]
        return f"steps/s at context {ctx} (batch x capacity): " + ", ".join(parts)
