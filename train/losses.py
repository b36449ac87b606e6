"""Drafter training losses (paper §3.3, eq. 9–12) for the three drafters, as pure functions.

A batch is S sequences with A anchors each: tokens int32 [S, T], valid lengths [S], anchors n [S, A]
(or [S] for one) with 1 ≤ n ≤ length − 2. One frozen target forward over the S sequences gives the final-normed
hidden states [S, T, D] and the concatenated hidden states of `target_layers` [S, T, m·D]; all A anchors of a
sequence share them (the S·A rows below are (sequence, anchor) pairs). For a row with anchor x_n:
  context  — the drafter's context K/V are computed once per sequence over all T positions and shared by its
             anchors, a query of anchor n seeing positions < n (EAGLE-3: n − 1 entries pairing f_t with
             x_{t+1}, `last_feature` = f_{n−1});
  packing  — dspark/dflash run all A blocks of a sequence as one packed pass (`packed_block_hidden`, the
             paper's anchor-bounded packing; DeepSpec packs 512 anchors): the S·A·L block queries attend to the
             sequence's single context K/V [S, K, T, H] under a per-anchor prefix mask, and bidirectionally to
             their own block only — never repeating the context per anchor, so memory grows with A·L·T scores,
             not A·T keys. `context_cache` (context repeated per anchor, the inference layout) is the
             reference it is tested against, and what EAGLE-3's step-by-step unroll still uses;
  targets  — block slot k (0-based) predicts x*_{n+1+k} (ground truth from the sequence) and is compared with
             the target's p_t,k = softmax(head(h[n+k])), the LM head applied only at these S·A·L positions;
             slots with n+1+k ≥ length are masked.
Every per-slot term is position-weighted by w_k = exp(−k/γ) (k 0-based, i.e. exp(−(k−1)/γ) 1-based; γ = L unless
`LossWeights.gamma`, DeepSpec's `loss_decay_gamma`) and
averaged over the weighted, valid slots of the batch:
  L_ce   = −log p_d,k(x*_k)                                   (eq. 9)
  L_tv   = ‖p_d,k − p_t,k‖₁                                    (eq. 10)
  L_conf = BCE(c_k, c*_k), c*_k = 1 − ½‖p_d,k − p_t,k‖₁ (no gradient through the label)   (eq. 11, eq. 8)
  L_kl   = −Σ_v p_t,k(v) log p_d,k(v), soft cross-entropy: KL(p_t ‖ p_d) + the target's entropy (DeepSpec's
           EAGLE-3 loss; not in eq. 12, whose α_kl is 0)
  L      = α_ce L_ce + α_tv L_tv + α_conf L_conf + α_kl L_kl    (eq. 12)
DSpark's sequential head is teacher-forced: the previous token is x*_{n+k} (x*_n = the anchor).
EAGLE-3 is unrolled L steps with teacher-forced tokens and its own features (training-time test).
Each kind's default weights (`LossWeights.for_kind`) are DeepSpec's: DSpark eq. 12, DFlash α_ce = 1, EAGLE-3 α_kl = 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from dspark_jax import draft_vocab
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterCache, DrafterModel, TargetHead
from dspark_jax.layers import apply_rope, rope_inv_freq


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossWeights:
    """α_ce, α_tv, α_conf of eq. 12, and α_kl of a soft cross-entropy against the target's distribution
    (hashable: static under jit)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    kl: float = 0.0
    gamma: float | None = None  # position decay w_k = exp(−(k−1)/γ); None: γ = L (DeepSpec's recipes: 4)

    @classmethod
    def for_kind(cls, kind: str) -> LossWeights:
        """Each kind's own recipe, as DeepSpec trains it: the paper's α for DSpark, CE on the sequence's tokens
        for DFlash, soft cross-entropy against the target's distribution for EAGLE-3."""
        if kind == "dspark":
            return cls()
        return cls(ce=0.0, tv=0.0, conf=0.0, kl=1.0) if kind == "eagle3" else cls(ce=1.0, tv=0.0, conf=0.0)


def position_weights(L: int, gamma: float | None = None) -> jax.Array:
    """w_k = exp(−(k−1)/γ) for k = 1..L, γ = L unless given: [L]."""
    return jnp.exp(-jnp.arange(L, dtype=jnp.float32) / (L if gamma is None else gamma))


def _gather_time(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx int [B, L] (clipped into range) → [B, L, ...]."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def block_targets(tokens, lengths, anchors, target_hidden, head: TargetHead, L: int, cfg: DrafterConfig | None = None,
                  target_lse=None):
    """For rows (tokens [B, T], lengths [B], anchors [B]): ground truth x*_{n+1..n+L} [B, L], teacher-forcing
    inputs x*_{n..n+L−1} [B, L], target probs p_t [B, L, Vd] (the head at the L gathered positions of
    target_hidden [B, T, D]) and the valid-slot mask [B, L].

    With a reduced draft vocabulary (cfg.draft_vocab) p_t is the target's full-vocabulary softmax restricted
    to the subset (it sums to the subset's mass, ≤ 1): exp(head_subset(h) − lse), lse = the full log-normaliser
    per position, read from `target_lse` [B, T] (precomputed features) or computed with the whole head."""
    k = jnp.arange(L, dtype=jnp.int32)[None]
    idx = anchors[:, None] + k  # positions n+k: their logits predict x_{n+k+1}
    truth = _gather_time(tokens, idx + 1)
    prev = _gather_time(tokens, idx)
    h_t = _gather_time(target_hidden, idx)
    if cfg is None or not draft_vocab.is_reduced(cfg):
        p_t = jax.nn.softmax(head.logits(h_t), axis=-1)
    else:
        lse = (jax.nn.logsumexp(head.logits(h_t), axis=-1) if target_lse is None
               else _gather_time(target_lse, idx).astype(jnp.float32))
        p_t = jnp.exp(draft_vocab.head_logits(head, h_t, cfg) - lse[..., None])
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
    last = rep(full.last_feature)
    if model.cfg.keeps_last_feature:  # H_ctx[n−1] of each anchor
        last = model.project_features(_gather_time(rep(feats), (n - 1)[:, None]))[:, 0].astype(last.dtype)
    return DrafterCache(k=tuple(map(rep, full.k)), v=tuple(map(rep, full.v)), lengths=n, last_feature=last)


def anchor_slot_predicts(cfg: DrafterConfig) -> bool:
    """Block layout: anchor + L−1 masks read at all L slots (dspark; DeepSpec's DFlash), or anchor + L masks
    read at the L mask slots (this project's original DFlash)."""
    return cfg.kind == "dspark" or getattr(cfg, "anchor_predicts", False)


def packed_attention(q, k, v, ctx_k, ctx_v, ctx_mask, A: int):
    """Attention of S sequences' packed blocks: each of A blocks of n queries reads the shared context under
    its own mask and its own block (bidirectionally), as `layers.attention` over [context; block] would.

    Args:
      q: [S, A·n, N, H] block queries; k, v: [S, A·n, K, H] block keys and values.
      ctx_k, ctx_v: [S, T, K, H] the context of each sequence, computed once.
      ctx_mask: bool [S, A·n, T], True where a query may read a context position.
      A: blocks per sequence.

    Returns:
      [S, A·n, N, H].
    """
    S, Q, N, H = q.shape
    K, n = k.shape[2], Q // A
    G = N // K
    scale = 1.0 / jnp.sqrt(jnp.float32(H))
    q_heads = q.reshape(S, Q, K, G, H)
    ctx_scores = jnp.einsum("SQKGH,STKH->SKGQT", q_heads, ctx_k, preferred_element_type=jnp.float32) * scale
    ctx_scores = jnp.where(ctx_mask[:, None, None], ctx_scores, -jnp.inf)
    q_block, k_block, v_block = q_heads.reshape(S, A, n, K, G, H), k.reshape(S, A, n, K, H), v.reshape(S, A, n, K, H)
    block_scores = jnp.einsum("SAQKGH,SAPKH->SKGAQP", q_block, k_block, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate([ctx_scores, block_scores.reshape(S, K, G, Q, n)], -1), axis=-1)
    ctx_probs, block_probs = probs[..., : ctx_k.shape[1]], probs[..., ctx_k.shape[1] :].reshape(S, K, G, A, n, n)
    out = jnp.einsum("SKGQT,STKH->SQKGH", ctx_probs.astype(ctx_v.dtype), ctx_v)
    out = out + jnp.einsum("SKGAQP,SAPKH->SAQKGH", block_probs.astype(v_block.dtype), v_block).reshape(S, Q, K, G, H)
    return out.reshape(S, Q, N, H)


def packed_block_hidden(model: DrafterModel, head: TargetHead, tokens, feats, anchors):
    """dspark/dflash block hidden states of every anchor, one packed pass per sequence.

    tokens [S, T], target features feats [S, T, m·D], anchors [S, A] → h [S·A, L, D] (row s·A + a), equal to
    `model.block_hidden` over `context_cache` (the per-anchor layout) up to float reassociation.
    """
    cfg = model.cfg
    S, T = tokens.shape
    A = anchors.shape[1]
    L = cfg.block_size
    n_in = L if anchor_slot_predicts(cfg) else L + 1
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    h_ctx = model.project_features(feats)  # [S, T, D], eq. 2
    ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (S, T))
    last = _gather_time(h_ctx, anchors - 1) if cfg.anchor_feature else None  # H_ctx[n−1] [S, A, D]
    # With `context_tokens` entry t pairs with x_{t+1}: entry n−1 with the anchor x_n, as the block pass closes it.
    h_ctx = model.context_entry(head, jnp.concatenate([tokens[:, 1:], jnp.zeros((S, 1), tokens.dtype)], 1), h_ctx)
    x, pos = model.block_inputs(head, jnp.take_along_axis(tokens, anchors, axis=1), anchors, last)
    x, pos = x.reshape(S, A * n_in, -1), pos.reshape(S, A * n_in)
    ctx_mask = jnp.arange(T)[None, None, :] < jnp.repeat(anchors, n_in, axis=1)[:, :, None]  # [S, A·n_in, T]
    for layer in model.layers:
        ctx_k, ctx_v = layer.context_kv(h_ctx, ctx_pos, inv_freq)  # [S, T, K, H] (eq. 3), once per sequence
        q, k, v = layer.attn.qkv(layer.attn_norm(x))
        q, k = apply_rope(q, pos, inv_freq), apply_rope(k, pos, inv_freq)
        x = x + layer.attn.out(packed_attention(q, k, v, ctx_k.astype(k.dtype), ctx_v.astype(v.dtype), ctx_mask, A))
        x = x + layer.mlp(layer.mlp_norm(x))
    h = model.final_norm(x).reshape(S * A, n_in, -1)
    return h if anchor_slot_predicts(cfg) else h[:, 1:]


def _dspark_logits(model: DrafterModel, head, cache, anchors, prev):
    """Teacher-forced DSpark over a per-anchor cache: (logits U_k + B_k [B, L, V], confidence logits [B, L])."""
    h = model.block_hidden(head, cache, prev[:, 0], anchors)  # anchor token x*_n at position n → [B, L, D]
    return _dspark_logits_from_hidden(model, head, h, prev)


def _dspark_logits_from_hidden(model: DrafterModel, head, h, prev):
    """Block hidden states h [B, L, D] and teacher-forced previous tokens prev [B, L] → (U_k + B_k [B, L, V],
    confidence logits [B, L] or None)."""
    cfg = model.cfg
    U = draft_vocab.head_logits(head, h, cfg)  # [B, L, Vd]
    if cfg.head == "none":
        return U, None

    def body(state, inputs):
        prev_k, h_k = inputs
        e = model.markov_embedding(prev_k)  # [B, R]
        bias, state = model.sequential_bias(e, h_k, state)
        conf = model.confidence_logit(h_k, e) if cfg.confidence else jnp.zeros(prev_k.shape, jnp.float32)
        return state, (bias, conf)

    state0 = jnp.zeros((prev.shape[0], cfg.markov_rank), model.markov_w1[...].dtype)
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
        feat, drafted_k, drafted_v, drafted_mask = carry
        k, tok = inputs
        drafted = (drafted_k, drafted_v, drafted_mask)
        out, h, (new_k, new_v) = model.eagle_step(head, cache, tok, feat, cache.lengths + k, drafted)
        drafted_k = jax.lax.dynamic_update_index_in_dim(drafted_k, new_k.astype(dtype), k, 2)
        drafted_v = jax.lax.dynamic_update_index_in_dim(drafted_v, new_v.astype(dtype), k, 2)
        drafted_mask = drafted_mask.at[:, k].set(True)
        return (out.astype(feat.dtype), drafted_k, drafted_v, drafted_mask), draft_vocab.head_logits(head, h, cfg)

    init = (cache.last_feature, jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((B, L), bool))
    _, logits = jax.lax.scan(body, init, (jnp.arange(L), prev.T))
    return logits.swapaxes(0, 1)


def drafter_loss(model: DrafterModel, head: TargetHead, tokens, lengths, anchors, target_hidden, feats,
                 weights: LossWeights, packed: bool = True, target_lse=None, anchor_mask=None):
    """Training loss of one batch (eq. 12).

    Args:
        model: the drafter (merged; its parameters are what the gradient is taken with respect to).
        head: the target's frozen embedding and LM head.
        tokens: int32 [S, T]; lengths: int32 [S] valid tokens per sequence; anchors: int32 [S, A] or [S],
            1 ≤ n ≤ length − 2.
        target_hidden: the target's final-normed hidden states [S, T, D]; feats: hidden states of
            `target_layers` [S, T, m·D] (one frozen forward).
        weights: α_ce, α_tv, α_conf.
        packed: dspark/dflash blocks through `packed_block_hidden` (default) or the per-anchor reference.
        target_lse: optional [S, T] full-vocabulary log-normaliser of the target per position (features);
            used by a reduced draft vocabulary only.
        anchor_mask: optional bool [S, A]; False marks a dummy anchor (a window with fewer candidates than A),
            whose slots count nowhere.

    With a reduced draft vocabulary (dspark_jax/draft_vocab.py) p_d is zero outside the subset, so
    ‖p_d − p_t‖₁ = Σ_subset |p_d − p_t| + (target mass outside the subset): c* stays the exact acceptance
    probability; L_ce skips slots whose ground-truth token is outside the subset (its log-probability is −∞).

    Returns:
        (loss scalar, metrics: loss, ce, tv, conf, top1 (draft argmax = x*) and its per-position top1_k [L], and
        acceptance [L] = mean c*_k, the per-position acceptance estimate 1 − ½‖p_d − p_t‖₁ over valid slots).
    """
    cfg: DrafterConfig = model.cfg
    L = cfg.block_size
    anchors = anchors[:, None] if anchors.ndim == 1 else anchors
    A = anchors.shape[1]
    rep = lambda x: jnp.repeat(x, A, axis=0)  # noqa: E731
    flat = anchors.reshape(-1)
    lse = None if target_lse is None else rep(target_lse)
    truth, prev, p_t, valid = block_targets(rep(tokens), rep(lengths), flat, rep(target_hidden), head, L, cfg, lse)
    if anchor_mask is not None:
        valid = valid & anchor_mask.reshape(-1, 1)
    conf_logit = None
    if cfg.kind == "eagle3":
        logits = _eagle_logits(model, head, context_cache(model, head, tokens, feats, anchors), prev)
    elif packed:
        h = packed_block_hidden(model, head, tokens, feats, anchors)
        logits, conf_logit = _dspark_logits_from_hidden(model, head, h, prev)
    else:
        logits, conf_logit = _dspark_logits(model, head, context_cache(model, head, tokens, feats, anchors), flat,
                                            prev)

    logp_d = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, L, Vd]
    p_d = jnp.exp(logp_d)
    truth_d = draft_vocab.markov_rows(truth, cfg)  # subset index (= truth without a reduced vocabulary)
    in_vocab = truth_d < logp_d.shape[-1]  # [B, L]
    ce = -jnp.take_along_axis(logp_d, jnp.minimum(truth_d, logp_d.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    tv = jnp.abs(p_d - p_t).sum(-1)  # [B, L], ∈ [0, 2]
    if draft_vocab.is_reduced(cfg):  # the target's mass outside the subset, where p_d = 0
        tv = tv + jnp.maximum(1.0 - p_t.sum(-1), 0.0)
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * tv, 0.0, 1.0))

    w = position_weights(L, weights.gamma)[None] * valid  # [B, L]
    wmean = lambda x, m=w: (m * x).sum() / jnp.maximum(m.sum(), 1e-6)  # noqa: E731
    loss_ce, loss_tv = wmean(jnp.where(in_vocab, ce, 0.0), w * in_vocab), wmean(tv)
    loss = weights.ce * loss_ce + weights.tv * loss_tv
    metrics = {"ce": loss_ce, "tv": loss_tv}
    if weights.kl:  # p_t restricted to a reduced vocabulary sums to its mass there: the rest cannot be matched
        loss_kl = wmean(-(p_t * logp_d).sum(-1))
        loss = loss + weights.kl * loss_kl
        metrics["kl"] = loss_kl
    if conf_logit is not None:
        loss_conf = wmean(optax.sigmoid_binary_cross_entropy(conf_logit, c_star))
        loss = loss + weights.conf * loss_conf
        metrics["conf"] = loss_conf
    vmean = lambda x: (valid * x).sum(0) / jnp.maximum(valid.sum(0), 1)  # noqa: E731  per position [L]
    top1 = draft_vocab.to_target(jnp.argmax(logp_d, -1), cfg) == truth
    metrics.update(loss=loss, top1=vmean(top1).mean(), top1_k=vmean(top1), acceptance=vmean(c_star))
    return loss, metrics
