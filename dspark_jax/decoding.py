"""Target-only decoding: ragged prefill, then one token per step — the baseline every speculative path must equal.

Invariant shared with speculative decoding (spec_decode.py): after prefill the target cache holds the prompt
and the *anchor* (the last emitted token) is not yet in the cache; each step feeds the anchor and samples the
next one. Each batch row has its own PRNG stream, `fold_in(fold_in(key(seed), row), step)`, so a row's output
does not depend on which other rows share its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.kernels import KernelConfig
from dspark_jax.sampling import all_greedy, filter_probs, sample


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns.

    Attributes:
        tokens: new tokens per prompt (stopping at and including an EOS unless ignore_eos).
        stats: rounds, τ (emitted per round), per-position conditional acceptance counts (speculative only).
        timings: seconds spent in prefill and in decoding.
    """

    tokens: list[list[int]]
    stats: dict
    timings: dict


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def row_keys(seed: int, batch: int) -> jax.Array:
    """Typed PRNG keys [B]: row b's stream is fold_in(key(seed), b)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(batch))


def step_keys(keys: jax.Array, step) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)


def pad_prompts(prompts: list[list[int]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts to a multiple of `multiple` (fewer compiled shapes) → (tokens [B, T], lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lens = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), round_up(int(lens.max()), multiple)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lens


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_layers", "kernels"), donate_argnames=("cache",))
def prefill(graphdef, params, tokens, cache, lengths, hidden_layers=(), kernels="auto"):
    """Runs the prompts through the target; returns (last-position logits [B, V], cache, hidden or None)."""
    model = nnx.merge(graphdef, params)
    h, cache, hidden = model(tokens, cache, lengths, hidden_layers=hidden_layers, compute_logits=False,
                             kernels=kernels)
    last = h[jnp.arange(tokens.shape[0]), lengths - 1]
    return model.head(last), cache, hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels"), donate_argnames=("cache",))
def decode_step(graphdef, params, cache, anchor, keys, step, temperature, top_k, top_p, kernels="auto"):
    """One target-only step: feed the anchors [B], sample the next tokens [B]."""
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(anchor[:, None], cache, kernels=kernels)
    probs = filter_probs(logits[:, 0], temperature, top_k, top_p)
    return cache, sample(step_keys(keys, step), probs, all_greedy(temperature))


@jax.jit
def first_token(logits, keys, temperature, top_k, top_p):
    """The token after the prompt, from prefill's last-position logits [B, V] (step 0 of each row's stream)."""
    probs = filter_probs(logits, temperature, top_k, top_p)
    return sample(step_keys(keys, 0), probs, all_greedy(temperature))


def sampling_arrays(batch: int, temperature: float, top_k: int, top_p: float):
    """Validates sampling parameters and broadcasts them to per-row arrays."""
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return (jnp.full((batch,), temperature, jnp.float32), jnp.full((batch,), top_k, jnp.int32),
            jnp.full((batch,), top_p, jnp.float32))


class StopTracker:
    """Host-side bookkeeping of emitted tokens, EOS and max_new_tokens per row."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids, ignore_eos: bool):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.zeros(batch, bool)
        self.max_new = max_new_tokens
        self.eos = set() if ignore_eos else set(int(e) for e in eos_ids)

    def push(self, row: int, tokens) -> list[int]:
        """Appends tokens to a live row until a stop; returns what was actually taken."""
        taken = []
        for t in tokens:
            if self.done[row]:
                break
            taken.append(int(t))
            self.out[row].append(int(t))
            if int(t) in self.eos or len(self.out[row]) >= self.max_new:
                self.done[row] = True
        return taken


def generate_target_only(target, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, ignore_eos,
                         on_tokens=None, kernels="auto") -> GenerateResult:
    """Plain autoregressive decoding with the target alone. See `dspark_jax.generate`."""
    B = len(prompts)
    temp, tk, tp = sampling_arrays(B, temperature, top_k, top_p)
    tokens, lens = pad_prompts(prompts)
    cache = target.init_cache(B, round_up(int(lens.max()) + max_new_tokens + 1, 64))
    keys = row_keys(seed, B)
    track = StopTracker(B, max_new_tokens, target.eos_token_ids, ignore_eos)
    t0 = time.perf_counter()
    logits, cache, _ = prefill(target.graphdef, target.params, jnp.asarray(tokens), cache, jnp.asarray(lens),
                               kernels=kernels)
    anchor = first_token(logits, keys, temp, tk, tp)
    t1 = time.perf_counter()
    step = 0
    while True:
        host = np.asarray(anchor)
        for b in range(B):
            taken = track.push(b, host[b : b + 1])
            if taken and on_tokens is not None:
                on_tokens(b, taken)
        if track.done.all():
            break
        step += 1
        cache, anchor = decode_step(target.graphdef, target.params, cache, anchor, keys, step, temp, tk, tp,
                                    kernels=kernels)
    t2 = time.perf_counter()
    return GenerateResult(tokens=track.out, stats={"rounds": step + 1, "tau": 1.0},
                          timings={"prefill_s": t1 - t0, "decode_s": t2 - t1})


def generate(target, prompts, drafter=None, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, policy=None,
             on_tokens=None, kernels: str | KernelConfig = "auto") -> GenerateResult:
    """Generates continuations of token-id prompts, target-only or speculatively with a drafter.

    Args:
        target: a loaded `Target`.
        prompts: list of token-id lists (different lengths allowed).
        drafter: a `Drafter`, or None for target-only decoding.
        max_new_tokens: per prompt.
        temperature, top_k, top_p: filtering applied to target and draft alike (0 temperature = greedy).
        seed: a fixed seed gives a fixed output; each row has its own stream.
        ignore_eos: keep going past EOS tokens.
        policy: speculative verification-length policy (see spec_decode.py); default verifies the full block.
        on_tokens: optional callback(row, new_tokens) for streaming.
        kernels: "auto" (Pallas on GPU/TPU), "pallas" (forced; interpreted on CPU), "reference", or a
            `kernels.KernelConfig` choosing per kernel.

    Returns:
        GenerateResult with `.tokens` and `.stats`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [[int(t) for t in p] for p in prompts]
    V = target.config.vocab_size
    if any(not 0 <= t < V for p in prompts for t in p):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
              ignore_eos=ignore_eos, on_tokens=on_tokens, kernels=kernels)
    KernelConfig.parse(kernels)  # validates the modes
    if drafter is None:
        return generate_target_only(target, prompts, **kw)
    from dspark_jax.spec_decode import generate_speculative

    return generate_speculative(target, drafter, prompts, policy=policy, **kw)
