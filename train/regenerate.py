"""Batched sampling from the target for training data: B decode slots on the serving round, refilled as rows finish.

The decoding is the serving engine's (dspark_jax/runner.py, target only): its packed prefill, its plain step and
its key scheme. What this module adds is the slot loop a data run needs:
  * B slots, each owning a fixed run of pages; one plain step shape [B] (compiled once), pipelined as `generate`
    is (round r+1 is dispatched from round r's device outputs before round r is read back);
  * when a row stops, the next prompts are prefilled into the free slots once at least `refill_fraction`·B are
    free, packed into one pass (`ModelRunner.prefill_many`) bucketed to B/8, B/4, B/2 or B requests and to a
    prompt-length bucket, so prefill compiles a handful of shapes once; a refill larger than `prefill_tokens`
    tokens is split over several passes (a decode step runs between them);
  * a row may be greedy (T = 0) while the others sample, so one run writes T = 1 data with a T = 0 share;
  * prompt i's stream is the request key fold_in(key(seed), i) (dspark_jax/keys.py), so its response does not
    depend on which slot or batch it ran in (resuming is reproducible), and equals row i of
    `generate(target, prompts, seed=seed)` at the same sampling settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import jax.numpy as jnp
import numpy as np

from dspark_jax.buckets import pick, round_up
from dspark_jax.keys import key_data_of
from dspark_jax.runner import ModelRunner, RunnerConfig, StepKind

PROMPT_BUCKET = 32  # prompt lengths of a prefill pass are bucketed to a multiple of this
PAGE_SIZE = 16  # positions per page (the GPU attention kernel reads pages in blocks of 16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotSettings:
    """Static settings of one regeneration run."""

    batch: int  # B decode slots
    capacity: int  # C cache positions per slot (≥ longest prompt + max_new_tokens + 1)
    max_new_tokens: int
    temperature: float
    top_p: float
    kernels: str = "auto"  # attention: Pallas kernel or jnp path (dspark_jax.kernels)
    # Tokens one packed prefill pass may hold (row bucket × prompt bucket): a larger refill is split over several
    # passes. A pass's activations grow with it, beside B slots' page pools that already hold most of the memory.
    prefill_tokens: int = 65_536


class SlotDecoder:
    """The target-only runner of one regeneration run's settings: its page pools (slot r owns pages
    r·M .. r·M + M − 1) and compiled programs, reusable over several `generate_slots` calls."""

    def __init__(self, target, settings: SlotSettings, seed: int):
        self.s, self.seed = settings, seed
        B = settings.batch
        # One round may run past a row's stop before the host sees it (pipelining): room for it.
        pages = -(-(settings.capacity + 2) // PAGE_SIZE)
        self.runner = ModelRunner(target, None, RunnerConfig(max_batch=B, num_pages=B * pages, page_size=PAGE_SIZE,
                                                             max_pages=pages, chunk_sizes=(PROMPT_BUCKET,),
                                                             kernels=settings.kernels, penalties=False))
        self.tables = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
        self.capacity = pick(B, self.runner.capacities)  # a plain step's tokens: one per slot

    def row_buckets(self) -> tuple[int, ...]:
        B = self.s.batch
        return tuple(sorted({max(1, B // 8), max(1, B // 4), max(1, B // 2), B}))

    def rows_that_fit(self, q: int) -> int:
        """The most prompts of ≤ q tokens one packed prefill pass takes: the largest row bucket whose pass holds
        ≤ `prefill_tokens` tokens (the smallest bucket when none does)."""
        buckets = self.row_buckets()
        return max([b for b in buckets if b * q <= self.s.prefill_tokens], default=buckets[0])

    @property
    def traces(self) -> dict:
        """Python traces of the run's programs: {"prefill": …, "step": …} (one each per shape)."""
        t = self.runner.traces
        return {"prefill": sum(v for k, v in t.items() if k[0] == "prefill"),
                "step": sum(v for k, v in t.items() if k[0] == "verify")}


def generate_slots(target, prompts: Iterable[tuple[int, list[int]]], *, settings: SlotSettings, seed: int,
                   eos_ids: Iterable[int], on_done: Callable[[int, list[int]], None],
                   refill_fraction: float = 0.125, stats: dict | None = None,
                   decoder: SlotDecoder | None = None, greedy: Callable[[int], bool] | None = None) -> None:
    """Samples a response for every (global index, prompt ids) of `prompts`, calling on_done(index, response)
    as each finishes (any order). A response stops at and includes an EOS token, or at max_new_tokens.

    Slots are refilled once at least `refill_fraction`·B of them are free (or when no row is live), so
    prefill runs on packed sub-batches rather than one prompt at a time. `stats` (if given) receives step and
    token counts, seconds and trace counts. `decoder` reuses an existing SlotDecoder (its compiled programs) of
    the same settings and seed. `greedy(index)` True decodes that prompt at T = 0 (argmax) instead of sampling.
    """
    s = settings
    B = s.batch
    dec = SlotDecoder(target, s, seed) if decoder is None else decoder
    if dec.s != s or dec.seed != seed:
        raise ValueError(f"decoder settings {dec.s} (seed {dec.seed}) differ from {s} (seed {seed})")
    runner = dec.runner
    eos = set(int(e) for e in eos_ids)
    queue = iter(prompts)
    pending: list[tuple[int, list[int]]] = []
    exhausted = False
    batch = runner.empty_batch(B)  # host state of every slot, rows 0..B−1
    batch.block_tables[:B] = dec.tables
    batch.top_p[:B] = s.top_p
    index = np.zeros(B, np.int64)
    live = np.zeros(B, bool)
    out: list[list[int]] = [[] for _ in range(B)]
    n_steps = n_tokens = n_prefill = 0
    dev = inflight = None
    t0 = time.perf_counter()

    def active():  # the live slots as the device batch's `active` rows (padding rows of the bucket idle)
        return jnp.asarray(np.pad(live, (0, len(batch.lengths) - B)))

    def push(r: int, tok: int) -> None:
        out[r].append(tok)
        batch.anchors[r] = tok
        if tok in eos or len(out[r]) >= s.max_new_tokens:
            live[r] = False
            on_done(int(index[r]), out[r])

    def read(pass_) -> None:  # a dispatched plain step's tokens, committed on the host
        nonlocal n_tokens
        res = runner.fetch(pass_, B)
        for r in np.flatnonzero(live):
            batch.lengths[r] += 1
            batch.rounds[r] += 1
            n_tokens += 1
            push(int(r), int(res.emitted[r, 0]))

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
            if inflight is not None:  # the host state must be current before slots change hands
                read(inflight)
                inflight = None
                free = np.flatnonzero(~live)
            take = min(len(free), len(pending))
            q = round_up(max(len(p) for _, p in pending[:take]), PROMPT_BUCKET)
            take = min(take, dec.rows_that_fit(q))  # fewer prompts can only lower q
            items, pending = pending[:take], pending[take:]
            rows = free[:take]
            ids = np.array([i for i, _ in items], np.int64)
            temps = np.array([0.0 if greedy is not None and greedy(int(i)) else s.temperature for i in ids],
                             np.float32)
            keys = key_data_of(seed, ids)
            rows_bucket = pick(take, dec.row_buckets())
            q = round_up(max(len(p) for _, p in items), PROMPT_BUCKET)
            first = np.asarray(runner.prefill_many([p for _, p in items], dec.tables[rows], keys, temps,
                                                   np.zeros(take, np.int32), np.full(take, s.top_p, np.float32),
                                                   rows=rows_bucket, capacity=rows_bucket * q, max_q_len=q))
            n_prefill += 1
            batch.lengths[rows] = [len(p) for _, p in items]
            batch.keys[rows], batch.temperature[rows], batch.rounds[rows] = keys, temps, 1
            index[rows], live[rows] = ids, True
            for r, tok in zip(rows, first[:take], strict=True):
                out[r] = []
                push(int(r), int(tok))
            n_tokens += take
            dev = None  # rebuilt from the host state
        if not live.any():
            if inflight is not None:
                read(inflight)
                inflight = None
                continue
            if not pending and exhausted:
                break
            continue
        if dev is None:
            dev = runner.device_batch(batch)._replace(active=active())
        step = runner.dispatch(dev, StepKind.PLAIN, capacity=dec.capacity)
        n_steps += 1
        dev = runner.advance(dev, step)
        if inflight is not None:  # read the previous round while this one runs
            was_live = live.copy()
            read(inflight)
            if (was_live & ~live).any():  # rows that stopped drop out from the round after `step`
                dev = dev._replace(active=dev.active & active())
        inflight = step
    if stats is not None:
        stats.update(steps=n_steps, prefills=n_prefill, tokens=n_tokens, seconds=time.perf_counter() - t0,
                     traces=dec.traces)


__all__ = ["SlotDecoder", "SlotSettings", "generate_slots"]
