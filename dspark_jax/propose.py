"""`propose`: one prompt → the anchor and the drafter's first block at temperature 0 (a public, inspectable API).

  anchor      the target's greedy next token after the prompt (prefill's last-position argmax), position n;
  tokens      int32 [L]  the greedy draft x_{n+1..n+L}: x_k = argmax logits_k;
  logits      f32 [L, V] the draft logits over the target's vocabulary *after* the sequential head —
              U_k + B_k(x_{k−1}) for DSpark (eq. 4, x_0 = the anchor), U_k for DFlash, the EAGLE-3 step's logits;
  confidence  f32 [L]    c_k = σ(confidence logit / t_k) (eq. 7, calibrated if the drafter carries temperatures),
              or None for drafters without a confidence head.
With a reduced draft vocabulary (dspark_jax/draft_vocab.py) the logits outside the subset are −inf.

This is the same computation as one round of `generate` with temperature 0 (`drafter.draft_block` samples the
argmax of these logits), exposed with the logits so drafters can be compared against other implementations,
e.g. DeepSpec's PyTorch models (tests/test_deepspec.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import draft_vocab
from dspark_jax.buckets import round_up
from dspark_jax.decoding import pad_prompts, prefill
from dspark_jax.drafter import drafter_prefill
from dspark_jax.drafter_model import DrafterCache, DrafterModel, TargetHead, calibration


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What `propose` returns (numpy arrays; see the module docstring)."""

    anchor: int
    tokens: np.ndarray  # int32 [L]
    logits: np.ndarray  # f32 [L, V]
    confidence: np.ndarray | None  # f32 [L]


def _greedy(logits, cfg):
    """Draft logits [..., Vd] → (greedy target ids [...], logits over the target's vocabulary [..., V])."""
    x = draft_vocab.to_target(jnp.argmax(logits, -1).astype(jnp.int32), cfg)
    if draft_vocab.is_reduced(cfg):
        full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, logits.dtype)
        logits = full.at[..., draft_vocab.d2t(cfg)].set(logits)
    return x, logits


def _block_logits(model: DrafterModel, head: TargetHead, cache: DrafterCache, anchor):
    """dspark/dflash: one parallel pass, then the sequential head left to right, greedily."""
    cfg = model.cfg
    L, B = cfg.block_size, anchor.shape[0]
    h = model.block_hidden(head, cache, anchor, cache.lengths)  # [B, L, D]
    U = draft_vocab.head_logits(head, h, cfg)  # [B, L, Vd]
    if cfg.head == "none":
        conf = model.confidence_logit(h, None) if cfg.confidence else jnp.zeros((B, L), jnp.float32)
        return *_greedy(U, cfg), conf

    def body(carry, inputs):
        prev, state = carry
        h_k, U_k = inputs
        e = model.markov_embedding(prev)  # W1[x_{k−1}] [B, R]
        bias, state = model.sequential_bias(e, h_k, state)
        x, logits = _greedy(U_k + bias, cfg)  # x: target ids (they feed W1)
        conf = model.confidence_logit(h_k, e) if cfg.confidence else jnp.zeros((B,), jnp.float32)
        return (x, state), (x, logits, conf)

    state0 = jnp.zeros((B, cfg.markov_rank), model.markov_w1[...].dtype)
    _, (tok, logits, conf) = jax.lax.scan(body, (anchor, state0), (h.swapaxes(0, 1), U.swapaxes(0, 1)))
    return tok.T, logits.swapaxes(0, 1), conf.T


def _eagle_logits(model: DrafterModel, head: TargetHead, cache: DrafterCache, anchor):
    """EAGLE-3: L greedy steps; step k feeds (x_{n+k}, feature) at position n−1+k (as drafter._draft_eagle)."""
    cfg = model.cfg
    L, B = cfg.block_size, anchor.shape[0]
    shape = (B, cfg.num_kv_heads, L, cfg.head_dim)
    dtype = cache.k[0].dtype

    def body(carry, k):
        tok, feat, drafted_k, drafted_v, drafted_mask = carry
        drafted = (drafted_k, drafted_v, drafted_mask)
        out, h, (new_k, new_v) = model.eagle_step(head, cache, tok, feat, cache.lengths + k, drafted)
        x, logits = _greedy(draft_vocab.head_logits(head, h, cfg), cfg)
        drafted_k = jax.lax.dynamic_update_index_in_dim(drafted_k, new_k.astype(dtype), k, 2)
        drafted_v = jax.lax.dynamic_update_index_in_dim(drafted_v, new_v.astype(dtype), k, 2)
        return (x, out.astype(feat.dtype), drafted_k, drafted_v, drafted_mask.at[:, k].set(True)), (x, logits)

    init = (anchor, cache.last_feature, jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((B, L), bool))
    _, (tok, logits) = jax.lax.scan(body, init, jnp.arange(L))
    return tok.T, logits.swapaxes(0, 1), jnp.zeros((B, L), jnp.float32)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def first_block(graphdef, params, head: TargetHead, cache: DrafterCache, anchor):
    """anchor int32 [B] → (tokens int32 [B, L], logits f32 [B, L, V], confidence logits f32 [B, L])."""
    model: DrafterModel = nnx.merge(graphdef, params)
    fn = _eagle_logits if model.cfg.kind == "eagle3" else _block_logits
    return fn(model, head, cache, anchor)


def propose(target, drafter, prompt_ids) -> Proposal:
    """The anchor and the drafter's first block at T = 0 after a prompt.

    Args:
        target: a loaded Target.
        drafter: a Drafter made for `target` (ours, or a DeepSpec checkpoint via `load_drafter`).
        prompt_ids: the prompt's token ids (a non-empty list or 1-D array), e.g. `target.chat_ids(text)`.

    Returns:
        Proposal(anchor, tokens int32 [L], logits f32 [L, V], confidence f32 [L] or None).
    """
    drafter.check_target(target)
    cfg = drafter.config
    ids = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
    V = target.config.vocab_size
    if not ids or any(not 0 <= t < V for t in ids):
        raise ValueError(f"prompt_ids must be a non-empty sequence of ids in [0, {V}), got {len(ids)} ids")
    tokens, lens = pad_prompts([ids])
    capacity = round_up(tokens.shape[1] + cfg.block_size + 1, 64)
    logits, _, feats = prefill(target.graphdef, target.params, jnp.asarray(tokens), target.init_cache(1, capacity),
                               jnp.asarray(lens), hidden_layers=cfg.target_layers)
    anchor = jnp.argmax(logits, -1).astype(jnp.int32)  # [1]
    tied = target.config.tie_word_embeddings
    drafter_cache = drafter_prefill(drafter.graphdef, drafter.params, target.params, drafter.init_cache(1, capacity),
                                    feats, jnp.asarray(tokens), jnp.asarray(lens), tied=tied)
    head = TargetHead.from_params(target.params, tied)
    tok, block_logits, conf_logits = first_block(drafter.graphdef, drafter.params, head, drafter_cache, anchor)
    confidence = None
    if cfg.confidence:
        temps, offsets = calibration(cfg)
        confidence = np.asarray(jax.nn.sigmoid(conf_logits[0] / temps + offsets), np.float32)
    return Proposal(anchor=int(anchor[0]), tokens=np.asarray(tok[0], np.int32),
                    logits=np.asarray(block_logits[0], np.float32), confidence=confidence)
