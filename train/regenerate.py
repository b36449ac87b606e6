"""Fast batched sampling from the target for training data: a fixed set of B decode slots, refilled as rows finish.

Why not `dspark_jax.decoding.generate` (measured in reports/2026-12-01/regeneration-speed/): it (1) sorts all V =
49,152 logits of every row at every step for top-p, (2) runs each batch until its longest row stops, so rows that
hit EOS early idle, and (3) compiles a new prefill and decode step for every batch's padded prompt length and cache
capacity.
Here:
  * one decode step shape [B, 1] over a cache of fixed capacity C (compiled once); rows are *slots*: when a
    row stops, the next prompts are prefilled into the free slots (a sub-batch bucketed to B/8, B/4, B/2, B rows
    and to a prompt-length bucket, so prefill compiles a handful of shapes once) and their K/V scattered in;
  * top-p is exact without a full sort: the `CANDIDATES` most likely tokens (`lax.top_k`) carry ≥ top_p of
    the mass for every row in practice at T = 0.2; a row whose candidates do not reach top_p sends the whole
    step through the exact full-sort filter of dspark_jax.sampling (a `lax.cond`, never silently truncated);
  * a row may be greedy (T = 0) while the others sample (`greedy` [B]: argmax instead of the draw), so one run
    writes T = 1 data with a T = 0 share;
  * row streams are keyed by the prompt's global index, `fold_in(fold_in(key(seed), index), step)`, so a
    prompt's response does not depend on which slot or batch it ran in (resuming is reproducible).

Shapes: cache [B, K, C, H] per layer; anchors, steps, live, greedy [B]; prefill tokens [b, Tb] with b ≤ B.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.buckets import round_up
from dspark_jax.keys import fold
from dspark_jax.sampling import filter_probs

CANDIDATES = 64  # tokens kept by lax.top_k before top-p; the exact full sort runs only if they fall short
PROMPT_BUCKET = 32  # prefill lengths are padded to a multiple of this


def sample_top_p(logits: jax.Array, keys: jax.Array, temperature: float, top_p: float,
                 candidates: int = CANDIDATES) -> jax.Array:
    """One token per row from softmax(logits / T) restricted to the top-p nucleus, exactly.

    Args:
      logits: f32 [B, V].
      keys: typed PRNG keys [B].
      temperature: > 0 samples; 0 is greedy (argmax). A Python float (static).
      top_p: nucleus mass in (0, 1]. A Python float (static).
      candidates: how many top tokens to consider before falling back to the exact sort.

    Returns:
      int32 [B].
    """
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    B, V = logits.shape
    scaled = logits.astype(jnp.float32) / temperature
    if top_p >= 1.0 or candidates >= V:  # no nucleus to find: sample the whole softmax
        e = jax.vmap(lambda key: jax.random.exponential(key, (V,), jnp.float32))(keys)
        return jnp.argmax(jax.nn.softmax(scaled, -1) / e, -1).astype(jnp.int32)
    p, idx, covered = nucleus_candidates(scaled, top_p, candidates)

    def from_candidates():
        e = jax.vmap(lambda key: jax.random.exponential(key, (candidates,), jnp.float32))(keys)
        score = jnp.where(p > 0, p / e, -1.0)
        return jnp.take_along_axis(idx, jnp.argmax(score, -1)[:, None], -1)[:, 0].astype(jnp.int32)

    def exact():
        probs = filter_probs(logits, jnp.full((B,), temperature, jnp.float32), jnp.zeros((B,), jnp.int32),
                             jnp.full((B,), top_p, jnp.float32))
        e = jax.vmap(lambda key: jax.random.exponential(key, (V,), jnp.float32))(keys)
        return jnp.argmax(jnp.where(probs > 0, probs / e, -1.0), -1).astype(jnp.int32)

    return jax.lax.cond(covered, from_candidates, exact)


def nucleus_candidates(scaled: jax.Array, top_p: float, candidates: int = CANDIDATES):
    """The top-p nucleus of softmax(scaled) among the `candidates` most likely tokens.

    Args:
      scaled: temperature-scaled logits f32 [B, V].
      top_p: nucleus mass in (0, 1).

    Returns:
      (probs f32 [B, k]: the true probabilities of the kept candidates, 0 for cut ones (unnormalised);
       ids int32 [B, k]; covered: bool scalar, True when every row's nucleus lies inside its candidates, i.e.
       the scattered, renormalised probs equal dspark_jax.sampling.filter_probs exactly).
    """
    vals, idx = jax.lax.top_k(scaled, candidates)  # descending; equal values keep the lower index first
    p = jnp.exp(vals - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(p, axis=-1) - p
    keep = (mass_before < top_p) | (jnp.arange(candidates) == 0)
    # The nucleus lies inside the candidates iff the next token would be cut: their mass reaches top_p.
    covered = jnp.all(p.sum(-1) >= top_p)
    return jnp.where(keep, p, 0.0), idx.astype(jnp.int32), covered


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotSettings:
    """Static settings of one regeneration run (hashable: jit static)."""

    batch: int  # B decode slots
    capacity: int  # C cache positions per slot (≥ longest prompt + max_new_tokens)
    max_new_tokens: int
    temperature: float
    top_p: float
    kernels: str = "auto"  # attention: Pallas kernel or jnp path (dspark_jax.kernels)


class SlotDecoder:
    """Jitted prefill-into-slots and decode steps of one target at fixed (B, C); counts its traces."""

    def __init__(self, target, settings: SlotSettings, seed: int):
        self.target, self.s = target, settings
        self.base = jax.random.key(seed)
        self.traces = {"prefill": 0, "step": 0}
        self._prefill = jax.jit(self._prefill_fn, donate_argnames=("cache",))
        self._step = jax.jit(self._step_fn, donate_argnames=("cache",))

    def init_cache(self):
        return self.target.init_cache(self.s.batch, self.s.capacity)

    def _prefill_fn(self, params, cache, tokens, lengths, rows, indices, greedy):
        """Prefills prompts tokens [b, Tb] (lengths [b]) into slots `rows` [b] (B = padding, dropped) and samples
        each one's first token (step 0 of stream `indices` [b]; argmax where `greedy` [b]). Returns (cache, first
        tokens [b])."""
        self.traces["prefill"] += 1
        model = nnx.merge(self.target.graphdef, params)
        b, Tb = tokens.shape
        small = model.init_cache(b, Tb)
        h, small, _ = model(tokens, small, lengths, compute_logits=False, kernels=self.s.kernels)
        logits = model.head(h[jnp.arange(b), lengths - 1])
        keys = jax.vmap(lambda i: fold(self.base, i, 0))(indices)
        first = _maybe_greedy(logits, sample_top_p(logits, keys, self.s.temperature, self.s.top_p), greedy)
        put = lambda big, new: big.at[rows, :, :Tb].set(new.astype(big.dtype), mode="drop")  # noqa: E731
        cache = cache.replace(k=tuple(map(put, cache.k, small.k)), v=tuple(map(put, cache.v, small.v)),
                              lengths=cache.lengths.at[rows].set(lengths, mode="drop"))
        return cache, first

    def _step_fn(self, params, cache, anchor, indices, steps, live, greedy):
        """Feeds anchors [B] of live slots (dead slots do not advance) and samples the next tokens [B] (argmax
        where `greedy` [B])."""
        self.traces["step"] += 1
        model = nnx.merge(self.target.graphdef, params)
        logits, cache, _ = model(anchor[:, None], cache, live.astype(jnp.int32), kernels=self.s.kernels)
        keys = jax.vmap(lambda i, t: fold(self.base, i, t))(indices, steps)
        return cache, _maybe_greedy(logits[:, 0], sample_top_p(logits[:, 0], keys, self.s.temperature, self.s.top_p),
                                    greedy)

    def prefill(self, cache, prompts: list[list[int]], rows: list[int], indices: list[int], greedy=None):
        """Host wrapper: pads to the row and length buckets, returns (cache, first tokens as numpy [len(rows)])."""
        B = self.s.batch
        b = next(n for n in (max(1, B // 8), max(1, B // 4), max(1, B // 2), B) if n >= len(prompts))
        Tb = round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
        toks = np.zeros((b, Tb), np.int32)
        lens = np.ones(b, np.int32)
        slot = np.full(b, B, np.int32)  # padding rows scatter to slot B: dropped
        idx = np.zeros(b, np.int32)
        grd = np.zeros(b, bool)
        grd[: len(prompts)] = False if greedy is None else greedy
        for j, (p, r, i) in enumerate(zip(prompts, rows, indices, strict=True)):
            toks[j, : len(p)], lens[j], slot[j], idx[j] = p, len(p), r, i
        cache, first = self._prefill(self.target.params, cache, jnp.asarray(toks), jnp.asarray(lens),
                                     jnp.asarray(slot), jnp.asarray(idx), jnp.asarray(grd))
        return cache, np.asarray(first)[: len(prompts)]

    def step(self, cache, anchor, indices, steps, live, greedy=None):
        greedy = np.zeros(len(live), bool) if greedy is None else greedy
        cache, nxt = self._step(self.target.params, cache, jnp.asarray(anchor, jnp.int32),
                                jnp.asarray(indices, jnp.int32), jnp.asarray(steps, jnp.int32),
                                jnp.asarray(live), jnp.asarray(greedy))
        return cache, np.asarray(nxt)


def generate_slots(target, prompts: Iterable[tuple[int, list[int]]], *, settings: SlotSettings, seed: int,
                   eos_ids: Iterable[int], on_done: Callable[[int, list[int]], None],
                   refill_fraction: float = 0.125, stats: dict | None = None,
                   decoder: SlotDecoder | None = None, greedy: Callable[[int], bool] | None = None) -> None:
    """Samples a response for every (global index, prompt ids) of `prompts`, calling on_done(index, response)
    as each finishes (any order). A response stops at and includes an EOS token, or at max_new_tokens.

    Slots are refilled once at least `refill_fraction`·B of them are free (or when no row is live), so
    prefill runs on sub-batches rather than one prompt at a time. `stats` (if given) receives step and token
    counts, seconds and trace counts. `decoder` reuses an existing SlotDecoder (its compiled steps) of the same
    settings and seed. `greedy(index)` True decodes that prompt at T = 0 (argmax) instead of sampling.
    """
    s = settings
    B = s.batch
    dec = SlotDecoder(target, s, seed) if decoder is None else decoder
    if dec.s != s:
        raise ValueError(f"decoder settings {dec.s} differ from {s}")
    eos = set(int(e) for e in eos_ids)
    queue = iter(prompts)
    pending: list[tuple[int, list[int]]] = []
    exhausted = False
    cache = dec.init_cache()
    anchor = np.zeros(B, np.int32)
    index = np.zeros(B, np.int32)
    steps = np.zeros(B, np.int32)
    live = np.zeros(B, bool)
    row_greedy = np.zeros(B, bool)
    out: list[list[int]] = [[] for _ in range(B)]
    n_steps = n_tokens = n_prefill = 0
    t0 = time.perf_counter()

    def finish(r: int) -> None:
        live[r] = False
        on_done(int(index[r]), out[r])

    def push(r: int, tok: int) -> None:
        out[r].append(tok)
        if tok in eos or len(out[r]) >= s.max_new_tokens:
            finish(r)

    while True:
        free = np.flatnonzero(~live)
        if not exhausted and len(pending) < len(free):
            for item in queue:
                if len(item[1]) + s.max_new_tokens + 1 > s.capacity:
                    raise ValueError(f"prompt {item[0]} has {len(item[1])} tokens: longer than capacity "
                                     f"{s.capacity} − max_new_tokens {s.max_new_tokens} − 1")
                pending.append(item)
                if len(pending) >= len(free):
                    break
            else:
                exhausted = True
        if pending and (len(free) >= max(1, int(refill_fraction * B)) or not live.any()):
            take = min(len(free), len(pending))
            batch, pending = pending[:take], pending[take:]
            rows = [int(r) for r in free[:take]]
            g = [bool(greedy(i)) if greedy is not None else False for i, _ in batch]
            cache, first = dec.prefill(cache, [p for _, p in batch], rows, [i for i, _ in batch], g)
            n_prefill += 1
            for r, (i, _), tok, gr in zip(rows, batch, first, g, strict=True):
                index[r], steps[r], live[r], out[r], row_greedy[r] = i, 0, True, [], gr
                push(r, int(tok))
            n_tokens += take
        if not live.any():
            if not pending and exhausted:
                break
            continue
        steps[live] += 1
        cache, nxt = dec.step(cache, anchor_of(out, live, anchor), index, steps, live, row_greedy)
        n_steps += 1
        for r in np.flatnonzero(live):
            push(int(r), int(nxt[r]))
            n_tokens += 1
    if stats is not None:
        stats.update(steps=n_steps, prefills=n_prefill, tokens=n_tokens, seconds=time.perf_counter() - t0,
                     traces=dict(dec.traces))


def _maybe_greedy(logits, sampled, greedy):
    """`sampled` [B] where a row samples, the argmax of its logits [B, V] where `greedy` [B]."""
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def anchor_of(out: list[list[int]], live: np.ndarray, anchor: np.ndarray) -> np.ndarray:
    """The last emitted token of every live slot (dead slots keep whatever they held)."""
    for r in np.flatnonzero(live):
        anchor[r] = out[r][-1]
    return anchor


__all__ = ["SlotDecoder", "SlotSettings", "generate_slots", "sample_top_p"]
