"""Sampling: per-request logit bias and filtering (temperature, min-p, top-k, top-p) and the exponential-trick
sampler.

The filtered distribution is the one object both speculative-decoding sides share: the drafter samples its
draft tokens from it and verification (`verification.py`, Leviathan et al. 2023) compares the target's and
the drafter's filtered distributions. Filtering is therefore exact (a renormalised distribution, not a
"filtered logits" approximation) and applied with the same per-request parameters on both sides.

Shapes: logits / probs f32 [B, T, V] or [B, V]; per-request parameters [B] (a serving batch mixes
requests, so temperature, top-k and top-p are arrays, not Python numbers, and may be traced under jit).

Semantics (vLLM / Hugging Face / OpenAI):
  * logit_bias (OpenAI's: a sparse {token id: bias in [-100, 100]}, at most LOGIT_BIAS_MAX entries) is added to
    the raw logits before anything else (`add_logit_bias`), so greedy decoding takes the argmax of the biased
    logits. It applies to the target's side only: drafts are drawn without it, which stays lossless.
  * min_tokens (vLLM's) bans the request's stop token ids (EOS and stop_token_ids) at −inf until min_tokens
    tokens are out: banned ids travel in the same sparse arrays as the bias (`TokenBias`), applied only to the
    tokens at positions before the request's `ban_until`.
  * temperature == 0 is greedy: a one-hot at argmax of the raw logits (first index on ties).
  * min_p == 0 is off; otherwise, first, keep every token whose temperature-scaled probability is >= min_p
    times the most likely token's (vLLM applies it before top-k and top-p, as here).
  * top_k == 0 is off; otherwise keep every token whose scaled logit is >= the k-th largest (ties at the
    k-th value are all kept, as `logits < kth_value` masking does in both libraries).
  * top_p >= 1 is off; otherwise, after top-k, keep the smallest prefix of the descending order whose
    mass reaches top_p, including the token that crosses the threshold, and always the most likely token.
    Equal probabilities are ordered by token index (stable sort), so the lower index is kept first.

Sampling uses the exponential trick `argmax(probs / Exp(1))` (gpt-fast): no cumulative sums, no host
sync, and a one-hot distribution returns its argmax deterministically.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)


def check_params(temperature, top_k, top_p, vocab: int | None = None) -> tuple[float, int, float]:
    """The one check of sampling parameters, for `generate`, the engine and the HTTP server: returns them
    normalised (temperature below GREEDY_BELOW → 0, greedy; top_k −1, 0 or ≥ vocab → 0, off) or raises
    ValueError with a message meant for the caller.

    Accepted: temperature a finite number ≥ 0; top_k an integer ≥ −1 (−1 and 0: off, as vLLM and OpenAI
    clients send); top_p in (0, 1]. min_p is checked by `check_min_p` (generate and the engine call both).
    """
    t = _as_float(temperature)
    if t is None or not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not 0.0 < (_as_float(top_p) or 0.0) <= 1.0:  # NaN and None fail too
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < -1:
        raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off), got {top_k!r}")
    k = int(top_k)
    if k <= 0 or (vocab is not None and k >= vocab):
        k = 0
    return (0.0 if t < GREEDY_BELOW else t), k, float(top_p)


def _as_float(x) -> float | None:
    """x as a float when it is a real number (not a bool), else None; an int too large for a float is inf."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def check_min_p(min_p) -> float:
    """min_p as a float in [0, 1] (0: off), or ValueError with a message meant for the caller."""
    m = _as_float(min_p)
    if m is None or not 0.0 <= m <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    return m


LOGIT_BIAS_MAX = 64  # entries per request (biases and min_tokens bans): the static width of the bias arrays


def check_logit_bias(bias, vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias normalised to {token id: bias}, sorted by id: a mapping of token ids (ints, or decimal
    strings as JSON object keys are) to finite numbers in [-100, 100], at most LOGIT_BIAS_MAX of them, each id in
    [0, vocab). None → {}. Raises ValueError with a message meant for the caller."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {type(bias).__name__}")
    if len(bias) > LOGIT_BIAS_MAX:
        raise ValueError(f"logit_bias may hold at most {LOGIT_BIAS_MAX} token ids, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", key):
            tid = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            tid = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if not 0 <= tid < vocab:
            raise ValueError(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab})")
        if tid in out:
            raise ValueError(f"logit_bias names token id {tid} twice")
        v = _as_float(value)
        if v is None or not -100.0 <= v <= 100.0:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {repr(value)[:32]} for token "
                             f"{tid}")
        out[tid] = v
    return {i: out[i] for i in sorted(out)}


def check_min_tokens(min_tokens, max_tokens: int) -> int:
    """vLLM's min_tokens as an int in [0, max_tokens], or ValueError with a message meant for the caller."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, numbers.Integral) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    return int(min_tokens)


class TokenBias(NamedTuple):
    """One request's sparse additions to the target's raw logits (`add_logit_bias`): OpenAI's `logit_bias`
    {token id: bias} at every position, and `banned` ids at −inf for the tokens at positions < `ban_until`."""

    logit_bias: dict[int, float] | None = None  # as `check_logit_bias` returns it
    banned: tuple[int, ...] = ()
    ban_until: int = 0

    @classmethod
    def of(cls, logit_bias=None, *, stop_ids=(), prompt_len: int = 0, min_tokens: int = 0) -> TokenBias | None:
        """A request's bias (checked `logit_bias`) and, with min_tokens > 0, the ban of its stop ids (EOS and
        stop_token_ids, as the caller stops on them) on its first min_tokens tokens: those at positions
        prompt_len .. prompt_len + min_tokens − 1. None when there is nothing to add. Raises ValueError when the
        two need more than LOGIT_BIAS_MAX entries together."""
        banned = tuple(sorted({int(t) for t in stop_ids})) if min_tokens > 0 else ()
        if len(logit_bias or ()) + len(banned) > LOGIT_BIAS_MAX:
            raise ValueError(f"min_tokens bans the {len(banned)} stop token ids (EOS and stop_token_ids) through "
                             f"the logit bias: with {len(logit_bias or ())} logit_bias entries that is more than "
                             f"{LOGIT_BIAS_MAX} token ids")
        if not (logit_bias or banned):
            return None
        return cls(logit_bias or None, banned, prompt_len + min_tokens if banned else 0)

    def entries(self) -> tuple[list[int], list[float]]:
        """(ids, values) of the sparse entries: the biases, then the bans (−inf)."""
        bias = self.logit_bias or {}
        return list(bias) + list(self.banned), list(bias.values()) + [-math.inf] * len(self.banned)


def add_logit_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array, pos: jax.Array | None = None,
                   ban_until: jax.Array | None = None) -> jax.Array:
    """Raw logits f32 [B, V] or [B, T, V] plus each row's sparse logit bias: ids int32 [B, K], bias f32 [B, K]
    (padding entries carry bias 0, so any id will do; `TokenBias.entries` fills them). An entry of −inf is a
    ban: with `pos` (the position of the token each logits row predicts, int32 [B] or [B, T]) and `ban_until`
    int32 [B], it applies only where pos < ban_until; without them, everywhere."""
    if ids.shape != bias.shape or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"logit bias needs ids and biases [B, K] for B = {logits.shape[0]}, got {ids.shape=}, "
                         f"{bias.shape=}")
    x = logits.astype(jnp.float32)
    B = x.shape[0]
    w = bias if x.ndim == 2 else bias[:, None, :]  # [B, K] or [B, 1, K]
    if ban_until is not None:
        lifted = (pos >= (ban_until if x.ndim == 2 else ban_until[:, None]))[..., None]  # [B, 1] or [B, T, 1]
        w = jnp.where(jnp.isneginf(w) & lifted, 0.0, w)  # [B, K] or [B, T, K]
    # A scatter-add of the B·(T·)K entries into the logits' own buffer (XLA updates it in place): no dense
    # [B, (T,) V] bias and no branch; padding entries add 0.
    if x.ndim == 2:
        return x.at[jnp.arange(B)[:, None], ids].add(w)
    T = x.shape[1]
    w = jnp.broadcast_to(w, (B, T, w.shape[-1]))
    return x.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], ids[:, None, :]].add(w)


def filter_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None
) -> jax.Array:
    """Temperature / min-p / top-k / top-p filtered, renormalised distribution, per request.

    Args:
      logits: f32 [B, T, V] or [B, V].
      temperature: f32 [B]; 0 means greedy (one-hot at argmax).
      top_k: int32 [B]; 0 means off; values above V act as V.
      top_p: f32 [B]; >= 1.0 means off.
      min_p: f32 [B] or None; 0 (or None) means off.

    Returns:
      probs: f32, same shape as `logits`; each row sums to 1 and is exactly zero outside the kept set.
    """
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits must be [B, V] or [B, T, V], got {logits.shape=}")
    squeeze = logits.ndim == 2
    x = logits.astype(jnp.float32)
    if squeeze:
        x = x[:, None, :]
    b, _, v = x.shape
    for name, arr in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if arr is not None and jnp.shape(arr) != (b,):
            raise ValueError(f"{name} must have shape [B]={(b,)}, got {jnp.shape(arr)=}")

    temperature = jnp.asarray(temperature, jnp.float32)[:, None, None]  # [B, 1, 1]
    top_k = jnp.asarray(top_k, jnp.int32)[:, None, None]
    top_p = jnp.asarray(top_p, jnp.float32)[:, None, None]

    greedy = temperature <= 0.0
    scaled = x / jnp.where(greedy, 1.0, temperature)
    if min_p is not None:  # p_i >= min_p · p_max  ⇔  s_i − s_max >= log(min_p); log 0 = −inf keeps all
        min_p = jnp.asarray(min_p, jnp.float32)[:, None, None]

        def floor(s):
            return jnp.where(s >= jnp.max(s, axis=-1, keepdims=True) + jnp.log(min_p), s, -jnp.inf)

        scaled = jax.lax.cond(jnp.any(min_p > 0.0), floor, lambda s: s, scaled)
    # Sorting V logits per position is the expensive part: skip it when no row filters (the common case).
    needs_sort = jnp.any((top_k > 0) | (top_p < 1.0))
    probs = jax.lax.cond(needs_sort, lambda: _sorted_filter(scaled, top_k, top_p),
                         lambda: jax.nn.softmax(scaled, axis=-1))

    one_hot = jax.nn.one_hot(jnp.argmax(x, axis=-1), v, dtype=jnp.float32)
    probs = jnp.where(greedy, one_hot, probs)
    return probs[:, 0, :] if squeeze else probs


def all_greedy(temperature: jax.Array) -> jax.Array:
    """True when every row of the batch decodes greedily (temperature [B] all zero)."""
    return jnp.all(jnp.asarray(temperature) <= 0.0)


def _is_batched_key(key: jax.Array) -> bool:
    """True for a leading batch axis of keys: typed [B] or raw uint32 [B, 2]."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2


def _sample_one(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Exponential trick on one key; probs [..., V] -> int32 [...]."""
    e = jax.random.exponential(key, probs.shape, dtype=jnp.float32)
    # Zero-probability tokens get -1 so they can never win, even when Exp(1) draws exactly 0
    # (uniform bits can be 0, and 0 / 0 = NaN would win a jnp.argmax).
    score = jnp.where(probs > 0, probs / e, -1.0)
    return jnp.argmax(score, axis=-1).astype(jnp.int32)


def sample(key: jax.Array, probs: jax.Array, all_greedy: jax.Array | None = None) -> jax.Array:
    """Draw one token per distribution: `argmax(probs / Exp(1))`.

    Args:
      key: a single PRNG key (typed scalar or raw uint32 [2]) used for the whole array, or one key per
        batch row (typed [B] or raw uint32 [B, 2], e.g. from `dspark_jax.keys`), in which case row b is sampled
        with keys[b] alone, so a request's samples do not depend on which batch it shares.
      probs: f32 [B, V] or [B, T, V]; need not be normalised; must have a positive entry per row.

      all_greedy: optional bool scalar (may be traced): every row is greedy (one-hot), so a plain argmax
        gives the same tokens without generating V random numbers per row.

    Returns:
      tokens: int32 [B] or [B, T]. Zero-probability tokens are never returned; a one-hot row always
      returns its hot index.
    """
    probs = probs.astype(jnp.float32)
    if all_greedy is not None:
        return jax.lax.cond(all_greedy, lambda: jnp.argmax(probs, axis=-1).astype(jnp.int32),
                            lambda: sample(key, probs))
    if _is_batched_key(key):
        if key.shape[0] != probs.shape[0]:
            raise ValueError(f"per-row keys need {key.shape[0]=} == {probs.shape[0]=}")
        return jax.vmap(_sample_one)(key, probs)
    return _sample_one(key, probs)


def _sorted_filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p on temperature-scaled logits [B, T, V] (parameters [B, 1, 1])."""
    v = scaled.shape[-1]

    # Sort once, descending; stable so equal logits keep index order (lower index ranks first).
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # [B, T, V]
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)

    # Top-k as a value threshold: everything >= the k-th largest survives (ties included).
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_logits, k - 1, axis=-1)  # [B, T, 1]
    keep = sorted_logits >= kth
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)

    # Top-p on the top-k-renormalised distribution: a token stays if the mass strictly before it is
    # < top_p, which keeps the token that crosses the threshold. The explicit `top_p >= 1` term keeps
    # "off" exact even where the float cumsum rounds up to 1 before the tail.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    rank = jnp.arange(v)
    keep &= (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    sorted_probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)

    # Undo the sort: scatter each sorted value back to its token index.
    return jnp.put_along_axis(jnp.zeros_like(sorted_probs), order, sorted_probs, axis=-1, inplace=False)

