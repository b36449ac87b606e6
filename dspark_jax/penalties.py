"""Repetition, frequency and presence penalties, as vLLM applies them (and OpenAI names the last two).

For the token at position t of a request whose prompt is its first `prompt_len` tokens, with counts c[v] of
token v among its generated tokens so far (positions prompt_len..t−1) and seen[v] = v in its prompt:
  * repetition_penalty r (1: off; Hugging Face's, as vLLM applies it): a token in the prompt or the output has
    its logit x divided by r when x > 0, multiplied by r otherwise;
  * frequency_penalty f then subtracts f·c[v], presence_penalty p subtracts p·[c[v] > 0] (0: off; negative
    values reward repeats).
They act on the raw logits after the logit bias and min_tokens bans (`sampling.add_logit_bias`) and before
temperature and the filters, so greedy decoding takes the argmax of the penalised logits; logprobs stay the raw
model's. Drafts are drawn without them: verification against the penalised target stays lossless.

Where the counts come from: the target's page pool keeps the token id of every cached position (`PagedKV.ids`,
written by every prefill and verification pass), so a request's history is read from its own pages on device
(`history`) and survives preemption (its recompute writes the same ids). Inside a verification block the row
after draft j must see the anchor and drafts 1..j as generated too (`penalize_block`): the penalised rows are
those of the target that would have generated that prefix, which is what lossless verification needs.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PENALTY_RANGE = 2.0  # |presence_penalty|, |frequency_penalty| ≤ this (OpenAI's range)
REPETITION_RANGE = (0.01, 10.0)  # repetition_penalty bounds: finite logits either way (vLLM: any r > 0)


class Penalties(NamedTuple):
    """One request's penalties (all off by default)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


def _number(name: str, value, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {repr(value)[:32]}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return x


def check_presence_penalty(value) -> float:
    """presence_penalty as a float in [-2, 2] (None: 0), or ValueError with a message meant for the caller."""
    x = _number("presence_penalty", value, 0.0)
    if abs(x) > PENALTY_RANGE:
        raise ValueError(f"presence_penalty must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
    return x


def check_frequency_penalty(value) -> float:
    """frequency_penalty as a float in [-2, 2] (None: 0), or ValueError with a message meant for the caller."""
    x = _number("frequency_penalty", value, 0.0)
    if abs(x) > PENALTY_RANGE:
        raise ValueError(f"frequency_penalty must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
    return x


def check_repetition_penalty(value) -> float:
    """repetition_penalty as a float in [0.01, 10] (None: 1, off), or ValueError with a message meant for the
    caller. vLLM takes any r > 0; the bounds keep x / r and x · r finite for any float32 logit x."""
    x = _number("repetition_penalty", value, 1.0)
    lo, hi = REPETITION_RANGE
    if not lo <= x <= hi:
        raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1: off), got {value!r}")
    return x


class RowPenalties(NamedTuple):
    """The penalties of a pass's rows on device: presence, frequency, repetition f32 [B]; prompt_len int32 [B]
    (positions before it are the prompt, from it on generated tokens)."""

    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    prompt_len: jax.Array

    def on(self, active: jax.Array | None = None) -> jax.Array:
        """bool []: some (active) row has a penalty."""
        rows = (self.presence != 0.0) | (self.frequency != 0.0) | (self.repetition != 1.0)
        return jnp.any(rows if active is None else rows & active)


def history(ids: jax.Array, block_tables: jax.Array, upto: jax.Array, prompt_len: jax.Array, vocab: int):
    """Each row's token history from the id pool `ids` int32 [P, page_size] through its pages `block_tables`
    [B, M]: (counts int32 [B, V] of the generated tokens at positions prompt_len..upto−1, seen bool [B, V] for
    the prompt's tokens at positions < min(prompt_len, upto))."""
    B, M = block_tables.shape
    toks = jnp.take(ids, block_tables, axis=0, mode="fill", fill_value=0).reshape(B, -1)  # [B, M·page_size]
    toks = jnp.clip(toks, 0, vocab - 1)
    pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None]
    generated = (pos >= prompt_len[:, None]) & (pos < upto[:, None])
    prompt = pos < jnp.minimum(prompt_len, upto)[:, None]
    rows = jnp.arange(B)[:, None]
    counts = jnp.zeros((B, vocab), jnp.int32).at[rows, toks].add(generated.astype(jnp.int32))
    seen = jnp.zeros((B, vocab), jnp.int8).at[rows, toks].max(prompt.astype(jnp.int8)) > 0
    return counts, seen


def _penalize(x, count, seen, presence, frequency, repetition):
    """Logits x with the penalties of tokens generated `count` times and in the prompt where `seen`."""
    hit = seen | (count > 0)
    x = jnp.where(hit, jnp.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * count.astype(jnp.float32) - presence * (count > 0)


def penalize(logits: jax.Array, counts: jax.Array, seen: jax.Array, pen: RowPenalties) -> jax.Array:
    """Logits f32 [B, V] penalised by each row's `history` (counts [B, V], seen [B, V])."""
    p, f, r = (a[:, None] for a in (pen.presence, pen.frequency, pen.repetition))
    return _penalize(logits.astype(jnp.float32), counts, seen, p, f, r)


def penalize_block(logits: jax.Array, counts: jax.Array, seen: jax.Array, block: jax.Array,
                   pen: RowPenalties) -> jax.Array:
    """Logits f32 [B, T, V] of a verification block: row j predicts the token after block[:, j] (block [B, T]:
    the anchor, then the drafts), so the row's generated history is `counts` plus block[:, :j+1]. The rows are
    penalised with `counts` alone (elementwise), then the ≤ T columns the block names are set again from the raw
    logits with their exact counts at each row (a sparse scatter: no [B, T, V] count array)."""
    B, T, V = logits.shape
    x = logits.astype(jnp.float32)
    block = jnp.clip(block, 0, V - 1)
    p, f, r = (a[:, None, None] for a in (pen.presence, pen.frequency, pen.repetition))
    out = _penalize(x, counts[:, None, :], seen[:, None, :], p, f, r)
    # Row j, column block[i]: counts[block[i]] + #{i' ≤ j : block[i'] = block[i]} (for every i, so a column the
    # block names twice gets the same value twice).
    extra = jnp.cumsum((block[:, :, None] == block[:, None, :]).astype(jnp.int32), axis=1)  # [B, j, i]
    cols = jnp.broadcast_to(block[:, None, :], (B, T, T))
    raw = jnp.take_along_axis(x, cols, axis=2)  # [B, j, i] = logits[b, j, block[b, i]]
    count = jnp.take_along_axis(counts, block, axis=1)[:, None, :] + extra
    fixed = _penalize(raw, count, jnp.take_along_axis(seen, block, axis=1)[:, None, :], p, f, r)
    return out.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], cols].set(fixed)
