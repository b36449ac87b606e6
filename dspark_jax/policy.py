"""Verification policies: the one parser and meaning of the strings `generate(policy=...)`, the serving engine
(`--scheduler`) and the CLI accept (paper §3.2.2, §5.2). No JAX at import: the CLI validates flags with it.

  none          target only: every request verifies just its anchor (ℓ = 0), no drafter runs.
  fixed[:N]     ℓ = min(N, L) for every request ("fixed" alone: the whole block).
  threshold:X   ℓ = the leading draft tokens with survival a_k ≥ X (the current step's confidences).
  dspark-sync   Algorithm 1 with the early-stop break on the current step's survival over the SPS table.
  dspark        §5.2 (serving only): the pass capacity K from survival two passes old by a global search over
                the SPS table, filled on device with the current step's top-K draft tokens; a plain step (no
                draft pass) when the cost model says drafts do not pay.
Every policy decides ℓ without looking at the draft tokens it admits (non-anticipation, Appendix A).
"""

from __future__ import annotations

import dataclasses

KINDS = ("none", "fixed", "threshold", "dspark-sync", "dspark")
USAGE = "none, fixed[:N], threshold:X, dspark-sync or dspark (N an int >= 0, X a survival in [0, 1])"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """A parsed policy (hashable: passed to jit as static). `sps`: steps/s indexed by tokens per pass, for
    dspark-sync in `generate` (empty: a flat table, which admits every draft token with a_k > 0)."""

    kind: str = "fixed"
    n: int | None = None
    threshold: float = 0.5
    sps: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown policy {self.kind!r}; choose {USAGE}")

    @classmethod
    def parse(cls, text: str, sps: tuple[float, ...] = ()) -> Policy:
        """'none', 'fixed', 'fixed:3', 'threshold:0.4', 'dspark-sync' or 'dspark'; ValueError otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"a policy is a string, got {text!r}")
        kind, sep, arg = text.partition(":")
        bad = ValueError(f"bad policy {text!r}; choose {USAGE}")
        if kind not in KINDS:
            raise bad
        try:
            if kind == "fixed":
                n = int(arg) if sep else None
                if n is not None and n < 0:
                    raise bad
                return cls(kind=kind, n=n)
            if kind == "threshold":
                x = float(arg)
                if not 0.0 <= x <= 1.0:
                    raise bad
                return cls(kind=kind, threshold=x)
        except ValueError:
            raise bad from None
        if sep:
            raise bad
        return cls(kind=kind, sps=tuple(float(v) for v in sps))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return "fixed" if self.n is None else f"fixed:{self.n}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold}"
        return self.kind

    @property
    def needs_drafter(self) -> bool:
        return self.kind != "none" and not (self.kind == "fixed" and self.n == 0)

    @property
    def needs_confidence(self) -> bool:
        return self.kind in ("threshold", "dspark-sync", "dspark")

    @property
    def syncs_on_drafts(self) -> bool:
        """Whether the lengths depend on the current step's confidences read back on the host."""
        return self.kind in ("threshold", "dspark-sync")

    def max_draft(self, block_size: int) -> int:
        """The most draft tokens a request can verify under this policy."""
        if self.kind == "none":
            return 0
        if self.kind == "fixed" and self.n is not None:
            return min(self.n, block_size)
        return block_size

    def lengths(self, confidence, block_size: int):
        """Confidence [B, L] → verification lengths int32 [B] (jittable; fixed, threshold, dspark-sync)."""
        import jax.numpy as jnp

        from dspark_jax.scheduling import fixed_lengths, prefix_schedule, survival, threshold_lengths

        a = survival(confidence)
        if self.kind in ("none", "fixed"):
            return fixed_lengths(a, self.max_draft(block_size))
        if self.kind == "threshold":
            return threshold_lengths(a, self.threshold)
        if self.kind == "dspark-sync":
            B = confidence.shape[0]
            sps = jnp.asarray(self.sps, jnp.float32) if self.sps else jnp.ones((B * (block_size + 1) + 1,))
            return prefix_schedule(a, sps)
        raise ValueError("the dspark policy sizes passes from confidences two passes old: it needs the serving "
                         "engine; generate takes none, fixed[:N], threshold:X or dspark-sync")
