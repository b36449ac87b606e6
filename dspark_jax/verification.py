"""Lossless verification of a batch of draft blocks (Leviathan et al. 2023; Chen et al. 2023; DSpark §2).

Vocabulary (vLLM's rejection sampler, used in every name below):
  * draft tokens x_1..x_L: the drafter's block for one request, sampled from draft probs q_1..q_L.
  * verification length ℓ_r in 0..L: only the first ℓ_r draft tokens are verified; the scheduler
    (`scheduling.py`) dropped the rest unseen, and they are ignored here by masking.
  * target probs p_1..p_{ℓ+1}: the target's distribution at each verified position and one past it.
  * accepted: x_k is accepted if u_k < min(1, p_k(x_k) / q_k(x_k)), u_k ~ U[0, 1), left to right;
    verification stops at the first rejection.
  * recovered: at the first rejection k, a token drawn from the residual norm(max(0, p_k - q_k)).
  * bonus: if all ℓ verified draft tokens are accepted, a token drawn from p_{ℓ+1}.
  * emitted: the accepted draft tokens followed by the one recovered or bonus token, so
    num_emitted = num_accepted + 1 in 1..ℓ+1.

The emitted tokens are distributed exactly as target-only sampling provided ℓ_r was chosen without looking
at the draft tokens it admits (non-anticipation, DSpark §3.2.2 and Appendix A).

Both p and q must be ALREADY filtered by the caller with the same temperature / top-k / top-p
(`sampling.filter_probs`). Greedy requests then have one-hot p and q, and the rule reduces exactly to
greedy matching: accept iff x_k == argmax p_k, and the recovered token is argmax p_k.

Shapes: B batch, L draft block, V vocab. target_probs [B, L+1, V] (row k-1 scores draft token k; row ℓ is
the bonus distribution), draft_tokens int32 [B, L], draft_probs [B, L, V], lengths int32 [B].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sampling import sample


class VerifyResult(NamedTuple):
    """Outcome of verifying one batch of draft blocks.

    Attributes:
      emitted_tokens: int32 [B, L+1]; the accepted draft tokens then the recovered or bonus token,
        padded with -1 from index num_emitted on.
      num_emitted: int32 [B]; num_accepted + 1.
      num_accepted: int32 [B]; accepted draft tokens, in 0..lengths.
    """

    emitted_tokens: jax.Array
    num_emitted: jax.Array
    num_accepted: jax.Array


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """Unnormalised recovered-token distribution max(0, p - q) [V], falling back to p when it is empty.

    The residual is all zero only when p == q on the whole support, where rejection has probability 0;
    the fallback keeps the sampler well defined if float rounding makes it happen anyway.
    """
    r = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(r) > 0, r, p)


def _verify_row(key, target_probs, draft_tokens, draft_probs, length):
    """One request: key, [L+1, V], [L], [L, V], [] -> ([L+1], [], [])."""
    n_draft = draft_tokens.shape[0]
    key_accept, key_emit = jax.random.split(key)
    u = jax.random.uniform(key_accept, (n_draft,), dtype=jnp.float32)

    # Unverified positions may hold padding (-1); clamp so the gathers stay in range, the mask drops them.
    index = jnp.clip(draft_tokens, 0, draft_probs.shape[-1] - 1)[:, None]
    p_x = jnp.take_along_axis(target_probs[:n_draft], index, axis=-1)[:, 0]  # [L]
    q_x = jnp.take_along_axis(draft_probs, index, axis=-1)[:, 0]
    # u < min(1, p/q) written without the division: q = 0 accepts iff p > 0, p = 0 never accepts.
    accepted = (u * q_x < p_x) & (jnp.arange(n_draft) < length)
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32)))

    # One V-sized draw per request: the residual at the first rejection, or p_{ℓ+1} for the bonus.
    p_n = target_probs[num_accepted]
    q_n = draft_probs[jnp.minimum(num_accepted, n_draft - 1)]
    rejected = num_accepted < length
    last = sample(key_emit, jnp.where(rejected, _residual(p_n, q_n), p_n))

    pos = jnp.arange(n_draft + 1)
    drafts = jnp.concatenate([draft_tokens, jnp.full((1,), -1, jnp.int32)])
    emitted = jnp.where(pos < num_accepted, drafts, jnp.where(pos == num_accepted, last, -1))
    return emitted.astype(jnp.int32), num_accepted + 1, num_accepted


def verify(
    keys: jax.Array,
    target_probs: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    lengths: jax.Array,
) -> VerifyResult:
    """Rejection-sample a batch of draft blocks against the target; jittable, static shapes, no host sync.

    Args:
      keys: one PRNG key per request: raw uint32 [B, 2] or typed [B]. A request's result depends only on
        its own key and rows.
      target_probs: f32 [B, L+1, V], filtered. Row k-1 is p_k for draft token k; row ℓ_r is the bonus
        distribution; rows past ℓ_r are ignored.
      draft_tokens: int32 [B, L]; entries at positions >= ℓ_r are ignored (padding such as -1 is fine).
      draft_probs: f32 [B, L, V], filtered, the distributions the draft tokens were sampled from.
      lengths: int32 [B], verification lengths ℓ_r in 0..L (clipped to that range).

    Returns:
      VerifyResult with emitted_tokens [B, L+1], num_emitted [B], num_accepted [B].
    """
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [B, L], got {draft_tokens.shape=}")
    b, n_draft = draft_tokens.shape
    if n_draft < 1:
        raise ValueError(f"need a draft block of at least one token, got {draft_tokens.shape=}")
    v = target_probs.shape[-1]
    if target_probs.shape != (b, n_draft + 1, v):
        raise ValueError(f"target_probs must be [B, L+1, V]={(b, n_draft + 1, v)}, got {target_probs.shape=}")
    if draft_probs.shape != (b, n_draft, v):
        raise ValueError(f"draft_probs must be [B, L, V]={(b, n_draft, v)}, got {draft_probs.shape=}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]={(b,)}, got {lengths.shape=}")
    key_ndim = 1 if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else 2
    if keys.ndim != key_ndim or keys.shape[0] != b:
        raise ValueError(f"keys must be one key per row (typed [B] or uint32 [B, 2]), got {keys.shape=}")

    emitted, num_emitted, num_accepted = jax.vmap(_verify_row)(
        keys,
        target_probs.astype(jnp.float32),
        draft_tokens.astype(jnp.int32),
        draft_probs.astype(jnp.float32),
        jnp.clip(lengths.astype(jnp.int32), 0, n_draft),
    )
    return VerifyResult(emitted, num_emitted.astype(jnp.int32), num_accepted.astype(jnp.int32))


def greedy_verify(target_tokens: jax.Array, draft_tokens: jax.Array, lengths: jax.Array) -> VerifyResult:
    """Greedy matching from argmax tokens alone, for argmax-only paths that never build [V] rows.

    Equal to `verify` on one-hot target and draft probs: accept while x_k == argmax p_k (k <= ℓ), then
    emit the target's token at the first mismatch (recovered) or at position ℓ+1 (bonus).

    Args:
      target_tokens: int32 [B, L+1], argmax of the target at each position (index ℓ is the bonus).
      draft_tokens: int32 [B, L].
      lengths: int32 [B], verification lengths in 0..L (clipped to that range).

    Returns:
      VerifyResult as in `verify`.
    """
    b, n_draft = draft_tokens.shape
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, n_draft)
    if target_tokens.shape != (b, n_draft + 1):
        raise ValueError(f"target_tokens must be [B, L+1]={(b, n_draft + 1)}, got {target_tokens.shape=}")
    pos = jnp.arange(n_draft + 1)
    match = (target_tokens[:, :n_draft] == draft_tokens) & (pos[:n_draft] < lengths[:, None])
    num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    # Accepted draft tokens equal the target's, so the emitted row is the target's up to num_accepted.
    emitted = jnp.where(pos <= num_accepted[:, None], target_tokens, -1).astype(jnp.int32)
    return VerifyResult(emitted, num_accepted + 1, num_accepted)


def acceptance_counts(lengths, num_accepted, live, block_size: int):
    """Host-side position-wise counts (paper Fig. 2) for one round: draft position k was *reached* when it was
    verified (ℓ ≥ k) and tokens 1..k−1 were accepted (m ≥ k−1), and *accepted* when also m ≥ k.

    Args: lengths ℓ, num_accepted m, live (bool) — numpy [B]. Returns (attempts, accepts) int64 [L].
    """
    k = np.arange(1, block_size + 1)
    reached = live[:, None] & (lengths[:, None] >= k) & (num_accepted[:, None] >= k - 1)
    return reached.sum(0).astype(np.int64), (reached & (num_accepted[:, None] >= k)).sum(0).astype(np.int64)
