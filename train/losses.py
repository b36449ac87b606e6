"""Drafter training losses (paper §3.3, eq. 9–12) for the three drafters, as pure functions.

A batch is S sequences with A anchors each: tokens int32 [S, T], valid lengths [S], anchors n [S, A]
(or [S] for one) with 1 ≤ n ≤ length − 2. One frozen target forward over the S sequences gives the final-normed
hidden states [S, T, D] and the concatenated hidden states of `target_layers` [S, T, m·D]; all A anchors of a
sequence share them (the S·A rows below are (sequence, anchor) pairs). For a row with anchor x_n:
  context  — the drafter's context K/V are computed once per sequence over all T positions, repeated over its
             anchors, and `lengths` = n masks every position ≥ n (EAGLE-3: n − 1 entries pairing f_t with
             x_{t+1}, `last_feature` = f_{n−1});
  targets  — block slot k (0-based) predicts x*_{n+1+k} (ground truth from the sequence) and is compared with
             the target's p_t,k = softmax(head(h[n+k])), the LM head applied only at these S·A·L positions;
             slots with n+1+k ≥ length are masked.
Every per-slot term is position-weighted by w_k = exp(−k/L) (k 0-based, i.e. exp(−(k−1)/γ) 1-based) and
averaged over the weighted, valid slots of the batch:
  L_ce   = −log p_d,k(x*_k)                                   (eq. 9)
  L_tv   = ‖p_d,k − p_t,k‖₁                                    (eq. 10)
  L_conf = BCE(c_k, c*_k), c*_k = 1 − ½‖p_d,k − p_t,k‖₁ (no gradient through the label)   (eq. 11, eq. 8)
  L      = α_ce L_ce + α_tv L_tv + α_conf L_conf                (eq. 12)
DSpark's sequential head is teacher-forced: the previous token is x*_{n+k} (x*_n = the anchor).
EAGLE-3 is unrolled L steps with teacher-forced tokens and its own features (training-time test).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterCache, DrafterModel, TargetHead


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossWeights:
    """α_ce, α_tv, α_conf of eq. 12 (hashable: static under jit)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0

    @classmethod
    def for_kind(cls, kind: str) -> LossWeights:
        """The paper's defaults for DSpark; plain CE for DFlash and EAGLE-3 (their own recipes)."""
        return cls() if kind == "dspark" else cls(ce=1.0, tv=0.0, conf=0.0)


def position_weights(L: int) -> jax.Array:
    """w_k = exp(−(k−1)/γ) for k = 1..L with γ = L: [L]."""
    return jnp.exp(-jnp.arange(L, dtype=jnp.float32) / L)


def _gather_time(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx int [B, L] (clipped into range) → [B, L, ...]."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def block_targets(tokens, lengths, anchors, target_hidden, head: TargetHead, L: int):
    """For rows (tokens [B, T], lengths [B], anchors [B]): ground truth x*_{n+1..n+L} [B, L], teacher-forcing
    inputs x*_{n..n+L−1} [B, L], target probs p_t [B, L, V] (the head at the L gathered positions of
    target_hidden [B, T, D]) and the valid-slot mask [B, L]."""
    k = jnp.arange(L, dtype=jnp.int32)[None]
    idx = anchors[:, None] + k  # positions n+k: their logits predict x_{n+k+1}
    truth = _gather_time(tokens, idx + 1)
    prev = _gather_time(tokens, idx)
    p_t = jax.nn.softmax(head.logits(_gather_time(target_hidden, idx)), axis=-1)
    valid = (idx + 1) < lengths[:, None]
    return truth, prev, p_t, valid


def context_cache(model: DrafterModel, head: TargetHead, tokens, feats, anchors) -> DrafterCache:
    """The drafter's context for anchors [S, A]: K/V from every position of each sequence (computed once per
    sequence, repeated over its A anchors), lengths masking positions ≥ n. Returns a cache of S·A rows."""
    S, T = tokens.shape
    A = anchors.shape[1]
    full = model.write_prompt(model.init_cache(S, T), head, tokens, feats, jnp.full((S,), T, jnp.int32))
    rep = lambda x: jnp.repeat(x, A, axis=0)  # noqa: E731  row s·A + a = (sequence s, anchor a)
    n = anchors.reshape(-1)
    if model.cfg.kind == "eagle3":
        last = model.project_features(_gather_time(rep(feats), (n - 1)[:, None]))[:, 0]
        return DrafterCache(k=tuple(map(rep, full.k)), v=tuple(map(rep, full.v)), lengths=n - 1,
                            last_feature=last.astype(full.last_feature.dtype))
    return DrafterCache(k=tuple(map(rep, full.k)), v=tuple(map(rep, full.v)), lengths=n,
                        last_feature=rep(full.last_feature))


def _dspark_logits(model: DrafterModel, head, cache, anchors, prev):
    """Teacher-forced DSpark: (logits U_k + B_k [B, L, V], confidence logits [B, L])."""
    cfg = model.cfg
    h = model.block_hidden(head, cache, prev[:, 0], anchors)  # anchor token x*_n at position n → [B, L, D]
    U = head.logits(h)
    if cfg.head == "none":
        return U, None

    def body(state, inputs):
        prev_k, h_k = inputs
        e = model.markov_embedding(prev_k)  # [B, R]
        bias, state = model.sequential_bias(e, h_k, state)
        conf = model.confidence_logit(h_k, e) if cfg.confidence else jnp.zeros(prev_k.shape, jnp.float32)
        return state, (bias, conf)

    state0 = jnp.zeros((anchors.shape[0], cfg.markov_rank), model.markov_w1[...].dtype)
    _, (bias, conf) = jax.lax.scan(body, state0, (prev.T, h.swapaxes(0, 1)))
    return U + bias.swapaxes(0, 1), (conf.T if cfg.confidence else None)


def _eagle_logits(model: DrafterModel, head, cache, prev):
    """EAGLE-3 unrolled L steps: step k feeds x*_{n+k} at position n−1+k with the previous step's
    pre-norm output as its feature (f_{n−1} at step 0). Returns logits [B, L, V]."""
    cfg = model.cfg
    B, L = prev.shape
    shape = (B, cfg.num_kv_heads, L, cfg.head_dim)
    dtype = cache.k[0].dtype

    def body(carry, inputs):
        feat, ek, ev, emask = carry
        k, tok = inputs
        out, h, (kk, vv) = model.eagle_step(head, cache, tok, feat, cache.lengths + k, (ek, ev, emask))
        ek = jax.lax.dynamic_update_index_in_dim(ek, kk.astype(dtype), k, 2)
        ev = jax.lax.dynamic_update_index_in_dim(ev, vv.astype(dtype), k, 2)
        emask = emask.at[:, k].set(True)
        return (out.astype(feat.dtype), ek, ev, emask), head.logits(h)

    init = (cache.last_feature, jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((B, L), bool))
    _, logits = jax.lax.scan(body, init, (jnp.arange(L), prev.T))
    return logits.swapaxes(0, 1)


def drafter_loss(model: DrafterModel, head: TargetHead, tokens, lengths, anchors, target_hidden, feats,
                 weights: LossWeights):
    """Training loss of one batch (eq. 12).

    Args:
        model: the drafter (merged; its parameters are what the gradient is taken with respect to).
        head: the target's frozen embedding and LM head.
        tokens: int32 [S, T]; lengths: int32 [S] valid tokens per sequence; anchors: int32 [S, A] or [S],
            1 ≤ n ≤ length − 2.
        target_hidden: the target's final-normed hidden states [S, T, D]; feats: hidden states of
            `target_layers` [S, T, m·D] (one frozen forward).
        weights: α_ce, α_tv, α_conf.

    Returns:
        (loss scalar, metrics: loss, ce, tv, conf, top1 (draft argmax = x*), and acceptance [L] = mean c*_k,
        the per-position acceptance estimate 1 − ½‖p_d − p_t‖₁ over valid slots).
    """
    cfg: DrafterConfig = model.cfg
    L = cfg.block_size
    anchors = anchors[:, None] if anchors.ndim == 1 else anchors
    A = anchors.shape[1]
    cache = context_cache(model, head, tokens, feats, anchors)
    rep = lambda x: jnp.repeat(x, A, axis=0)  # noqa: E731
    anchors = anchors.reshape(-1)
    truth, prev, p_t, valid = block_targets(rep(tokens), rep(lengths), anchors, rep(target_hidden), head, L)
    conf_logit = None
    if cfg.kind == "eagle3":
        logits = _eagle_logits(model, head, cache, prev)
    else:
        logits, conf_logit = _dspark_logits(model, head, cache, anchors, prev)

    logp_d = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, L, V]
    p_d = jnp.exp(logp_d)
    ce = -jnp.take_along_axis(logp_d, truth[..., None], axis=-1)[..., 0]  # [B, L]
    tv = jnp.abs(p_d - p_t).sum(-1)  # [B, L], ∈ [0, 2]
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * tv, 0.0, 1.0))

    w = position_weights(L)[None] * valid  # [B, L]
    wmean = lambda x: (w * x).sum() / jnp.maximum(w.sum(), 1e-6)  # noqa: E731
    loss_ce, loss_tv = wmean(ce), wmean(tv)
    loss = weights.ce * loss_ce + weights.tv * loss_tv
    metrics = {"ce": loss_ce, "tv": loss_tv}
    if conf_logit is not None:
        loss_conf = wmean(optax.sigmoid_binary_cross_entropy(conf_logit, c_star))
        loss = loss + weights.conf * loss_conf
        metrics["conf"] = loss_conf
    vmean = lambda x: (valid * x).sum(0) / jnp.maximum(valid.sum(0), 1)  # noqa: E731  per position [L]
    metrics.update(loss=loss, top1=vmean(jnp.argmax(logp_d, -1) == truth).mean(), acceptance=vmean(c_star))
    return loss, metrics
