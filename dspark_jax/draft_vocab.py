"""A reduced draft vocabulary: the drafter's head scores a subset of the target's vocabulary (EAGLE-3's d2t/t2d).

`DrafterConfig.draft_vocab` lists the subset's target token ids, sorted (Vd of them; () = the whole vocabulary).
Drafting and training then pay for Vd columns of the LM head instead of V: the draft LM head is the target's
head restricted to those columns (the embedding stays the target's, so any token — an anchor outside the
subset too — is read exactly), and the Markov head's output W2 is [R, Vd]. Its input W1 has Vd + 1 rows: one per
subset token and a shared row for every token outside it (an anchor can be any token).

Losslessness: the draft distribution q is exactly 0 outside the subset (`to_vocab` scatters the subset's
probabilities into [.., V]), and drafted tokens are mapped back to target ids (`to_target`), so verification
(rejection sampling against the target's p) is unchanged and stays exact.

  d2t: [Vd] subset index → target id (the config's tuple)     t2d: [V] target id → subset index, Vd if outside
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_reduced(cfg) -> bool:
    return bool(getattr(cfg, "draft_vocab", ()))


def size(cfg) -> int:
    """Vd: the draft head's output width."""
    return len(cfg.draft_vocab) if is_reduced(cfg) else cfg.vocab_size


def d2t(cfg) -> jax.Array:
    """int32 [Vd]: the target id of each subset index."""
    return jnp.asarray(cfg.draft_vocab, jnp.int32)


def t2d(cfg) -> jax.Array:
    """int32 [V]: the subset index of each target id, Vd for ids outside the subset."""
    Vd = len(cfg.draft_vocab)
    return jnp.full((cfg.vocab_size,), Vd, jnp.int32).at[d2t(cfg)].set(jnp.arange(Vd, dtype=jnp.int32))


def head_logits(head, h: jax.Array, cfg) -> jax.Array:
    """Draft logits: the target's frozen LM head on h [..., D], restricted to the subset → f32 [..., Vd]."""
    if not is_reduced(cfg):
        return head.logits(h)
    w = head.draft_lm_head if head.draft_lm_head is not None else subset_head(head.lm_head, cfg)
    return jnp.einsum("...D,DV->...V", h, w, preferred_element_type=jnp.float32)


def subset_head(lm_head: jax.Array, cfg) -> jax.Array:
    """The target's LM head [D, V] restricted to the subset's columns → [D, Vd]. Gathered inside a program it
    copies Vd·D values on every call (most of a one-request draft pass on XLA:CPU); a caller that drafts
    repeatedly computes it once and hands it over as `TargetHead.draft_lm_head`."""
    return jnp.take(lm_head, d2t(cfg), axis=1)


def to_target(tokens: jax.Array, cfg) -> jax.Array:
    """Subset indices (as sampled from [.., Vd] distributions) → target token ids."""
    return jnp.take(d2t(cfg), tokens, axis=0).astype(jnp.int32) if is_reduced(cfg) else tokens


def to_vocab(probs: jax.Array, cfg) -> jax.Array:
    """Subset probabilities [..., Vd] → [..., V], exactly 0 outside the subset."""
    if not is_reduced(cfg):
        return probs
    out = jnp.zeros(probs.shape[:-1] + (cfg.vocab_size,), probs.dtype)
    return out.at[..., d2t(cfg)].set(probs)


def markov_rows(tokens: jax.Array, cfg) -> jax.Array:
    """Target ids → rows of the Markov input embedding W1 (the subset index, or the shared row Vd)."""
    return jnp.take(t2d(cfg), tokens, axis=0) if is_reduced(cfg) else tokens
