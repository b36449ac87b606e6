"""The runner interface the serving engine drives: dspark_jax/runner.py's `ModelRunner` satisfies it, and so does
the engine tests' numpy mock (tests/test_engine_mock.py), so the engine has one control flow for both.

A round is `device_batch` → (`draft`, when the scheduler reads the current drafts on the host) → `dispatch`
(a `StepKind`: plain, probe or speculative; not waited for) → `fetch` (read back); `advance` builds the next round's
batch on device from a dispatched one (pipelining); `step` is dispatch + fetch. Shapes: Bb rows of a batch
bucket, R of them running; L the drafter's block (0: target only).
"""

from __future__ import annotations

import typing

import numpy as np

from dspark_jax.runner import PrefillItem, StepKind


@typing.runtime_checkable
class Runner(typing.Protocol):
    L: int  # draft block size (0: target only)
    B: int  # most requests per step
    page_size: int
    max_pages: int  # pages per request (one block-table row)
    chunk_sizes: tuple[int, ...]  # prefill chunk buckets
    batch_buckets: tuple[int, ...]
    capacities: tuple[int, ...]  # verification capacity buckets (tokens per pass)
    drafter: typing.Any  # None for target only; `.config.confidence`, `.config.kind`
    target: typing.Any  # `.config.vocab_size`, `.eos_token_ids`, `.tokenizer`

    @property
    def num_pages(self) -> int: ...

    prefill_rows: tuple[int, ...]  # buckets of requests packed into one prefill pass

    def prefill_chunks(self, items: list[PrefillItem]) -> list[tuple]: ...  # one pass, ≤ chunk_sizes[-1] tokens

    def prefill_fits(self, counts: list[int]) -> bool: ...  # whether chunks of these lengths pack well

    def empty_batch(self, rows: int): ...

    def device_batch(self, b) -> typing.Any: ...  # the runner's DeviceBatch; opaque to the engine

    def draft(self, b, dev=None) -> tuple: ...

    def dispatch(self, dev, kind: StepKind, *, capacity: int, lengths: np.ndarray | None = None,
                 budget: int | None = None, policy=None, drafts=None): ...

    def fetch(self, out, rows: int, *, want_confidence: bool = False, want_logprobs: bool = False): ...

    def advance(self, dev, out, block_tables: np.ndarray | None = None) -> typing.Any: ...

    def step(self, b, kind: StepKind, *, capacity: int, lengths: np.ndarray | None = None, budget: int | None = None,
             drafts=None, dev=None, want_confidence: bool = False): ...
