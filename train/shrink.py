"""A trained DSpark drafter made small enough to ship: its Markov head moved to a draft vocabulary and cut to a
lower rank; every other parameter is the source's.

  python -m train shrink SRC DEST --draft-vocab data_release/smollm2/draft_vocab_t1_27648.json --markov-rank 32

Vocabulary (`move_markov_vocab`, also what `drafter.init_from` does): the draft head becomes the target's LM head
restricted to the subset (dspark_jax/draft_vocab.py); a kept token keeps its W1 row and W2 column exactly, so
the draft distribution only renormalises over the subset (verification stays exact: q is 0 outside it).
Rank (`truncate_markov`): the bigram bias W1·W2 is replaced by its best rank-r approximation (truncated SVD in
the Frobenius norm, each previous token's row weighted by √count when `counts` are given, so the tokens that
actually precede a draft position are the ones kept exact); the confidence head's weights on W1[x] are refitted by
least squares in the same metric, the mean of what they lose going into its bias. The source's calibration is
kept: run `python -m train calibrate` on the result before shipping it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np


def move_markov_vocab(w1: np.ndarray, w2: np.ndarray, vocab_size: int, src_ids, dst_ids) -> tuple:
    """The Markov head (W1 [rows, R], W2 [R, Vd]) of a drafter with draft vocabulary `src_ids` (() or None: the
    whole vocabulary) moved to `dst_ids`. A token in both keeps its W1 row and W2 column; a token new to the
    subset starts from the row the source read it with (its shared outside row) and a zero W2 column (no bias,
    as an untrained head); the new shared outside row is the source's, or with a whole-vocabulary source the
    mean row of the tokens left outside."""
    V = vocab_size
    src = np.asarray(src_ids if src_ids else range(V))
    dst = np.asarray(dst_ids if dst_ids else range(V))
    src_index = np.full(V, -1)
    src_index[src] = np.arange(len(src))
    have = src_index[dst] >= 0
    new_w2 = np.zeros((w2.shape[0], len(dst)), np.float32)
    new_w2[:, have] = w2[:, src_index[dst[have]]]
    if src_ids:  # the source's shared row for every token outside its subset
        outside_row = w1[len(src)]
    else:
        outside = np.setdiff1d(np.arange(V), dst)
        outside_row = w1[outside].mean(0) if outside.size else np.zeros(w1.shape[1], np.float32)
    rows = [np.where(have[:, None], w1[np.maximum(src_index[dst], 0)], outside_row)]
    if dst_ids:
        rows.append(outside_row[None])
    return np.concatenate(rows).astype(np.float32), new_w2


def widen_markov(w1: np.ndarray, w2: np.ndarray, w_e: np.ndarray | None, rank: int, seed: int = 0) -> dict:
    """The Markov head at a higher `rank` computing the same function: W1's new columns drawn as a fresh head's
    (normal, σ 0.02), W2's new rows and the confidence head's new weights zero, so W1·W2 and the confidence logit
    are unchanged and training moves the new directions from the first step (W2's new rows get gradient W1ᵀ·g).
    Training at a high rank and cutting back (`truncate_markov`) keeps what the high rank learned: at 300 steps
    a rank-256 head cut to 32 scored as the rank-256 head, 0.036 held-out c* above a head trained at 32
    (reports/2026-12-06/markov-shrink)."""
    from dspark_jax.drafter_model import INIT_STD

    R = w1.shape[1]
    if rank < R:
        raise ValueError(f"rank {rank} is below the source's {R}: cut it with `truncate_markov` instead")
    extra = np.random.default_rng(seed).normal(0.0, INIT_STD, size=(w1.shape[0], rank - R)).astype(np.float32)
    return {"w1": np.concatenate([w1, extra], 1).astype(np.float32),
            "w2": np.concatenate([w2, np.zeros((rank - R, w2.shape[1]), np.float32)]).astype(np.float32),
            "w_e": None if w_e is None else np.concatenate([w_e, np.zeros(rank - R, np.float32)]).astype(np.float32)}


def truncate_markov(w1: np.ndarray, w2: np.ndarray, w_e: np.ndarray | None, rank: int,
                    row_weights: np.ndarray | None = None) -> dict:
    """The rank-`rank` Markov head closest to W1·W2 ([rows, R] · [R, Vd]) in the Frobenius norm with rows
    weighted by `row_weights` (default 1), as {"w1", "w2", "w_e", "bias_shift", "kept_energy"}.

    With A = diag(d)·W1 = Q1·R1 and W2ᵀ = Q2·R2 (thin QR), diag(d)·W1·W2 = Q1·(R1·R2ᵀ)·Q2ᵀ, so the SVD of the R x R
    core R1·R2ᵀ = U·S·Vᵀ gives the product's: the new W2 = (Q2·V_r·S_r^½)ᵀ and W1' = W1·T with
    T = R1⁺·U_r·S_r^½ (linear in W1, so every row, weighted or not, moves the same way). The confidence head reads
    e = W1[x] through w_e (conf_w's last R entries): the new w_e' minimises the weighted squared change of
    W1[x]·w_e, i.e. w_e' = S_r^-½·U_rᵀ·R1·w_e, and bias_shift is the weighted mean of what is left
    (W1·w_e − W1'·w_e'), to add to conf_b. kept_energy: Σ_{i<r} s_i² / Σ s_i², the share of the weighted
    product's squared norm kept."""
    w1, w2 = np.asarray(w1, np.float64), np.asarray(w2, np.float64)
    R = w1.shape[1]
    if not 0 < rank <= R:
        raise ValueError(f"rank {rank} must be in [1, {R}] (the source's Markov rank)")
    d = np.ones(w1.shape[0]) if row_weights is None else np.asarray(row_weights, np.float64)
    if d.shape != (w1.shape[0],) or np.any(d < 0) or not np.any(d > 0):
        raise ValueError(f"row_weights must be {w1.shape[0]} non-negative numbers, not all 0")
    q1, r1 = np.linalg.qr(d[:, None] * w1)
    q2, r2 = np.linalg.qr(w2.T)
    u, s, vt = np.linalg.svd(r1 @ r2.T)
    root = np.sqrt(s[:rank])
    new_w2 = (q2 @ vt[:rank].T * root).T
    new_w1 = w1 @ (np.linalg.pinv(r1) @ (u[:, :rank] * root))
    out = {"w1": new_w1.astype(np.float32), "w2": new_w2.astype(np.float32), "w_e": None, "bias_shift": 0.0,
           "kept_energy": float(np.sum(s[:rank] ** 2) / max(np.sum(s**2), 1e-300))}
    if w_e is not None:
        w_e = np.asarray(w_e, np.float64)
        new_w_e = (u[:, :rank].T @ (r1 @ w_e)) / np.where(root > 0, root, 1.0)
        lost = w1 @ w_e - new_w1 @ new_w_e
        out["w_e"] = new_w_e.astype(np.float32)
        out["bias_shift"] = float(np.sum(d**2 * lost) / np.sum(d**2))
    return out


def resize_markov(flat: dict, cfg, rank: int, row_weights: np.ndarray | None = None) -> dict:
    """A DSpark's Markov head in `flat` (its parameters by dotted name, float32; `cfg` its DrafterConfig, whose
    draft vocabulary W1 and W2 already have) set to `rank` in place: widened (`widen_markov`) or cut
    (`truncate_markov`, rows weighted by `row_weights`), W1, W2 and the confidence head's weights on W1[x] (the
    last R of conf_w, and conf_b for a cut) together. Returns {"kept_energy": …} for a cut, {} otherwise."""
    D, with_e = cfg.hidden_size, cfg.confidence and cfg.confidence_with_markov
    w1, w2, w_e = flat["markov_w1"], flat["markov_w2"], flat["conf_w"][D:] if with_e else None
    if rank >= w1.shape[1]:
        out, report = widen_markov(w1, w2, w_e, rank), {}
    else:
        out = truncate_markov(w1, w2, w_e, rank, row_weights)
        report = {"kept_energy": round(out["kept_energy"], 6)}
        if with_e:
            flat["conf_b"] = np.asarray(flat["conf_b"] + out["bias_shift"], np.float32)
    flat["markov_w1"], flat["markov_w2"] = out["w1"], out["w2"]
    if with_e:
        flat["conf_w"] = np.concatenate([flat["conf_w"][:D], out["w_e"]])
    return report


def shrink(source: str, target, *, draft_vocab=None, markov_rank: int | None = None,
           counts: np.ndarray | None = None):
    """The drafter at `source` (a directory or a shipped name), loaded in float32, through `shrink_drafter`.
    Returns (Drafter in float32, report dict)."""
    import jax.numpy as jnp

    from dspark_jax.drafter import load_drafter

    drafter, report = shrink_drafter(load_drafter(source, target, dtype=jnp.float32), draft_vocab=draft_vocab,
                                     markov_rank=markov_rank, counts=counts)
    return drafter, {"source": str(source), **report}


def shrink_drafter(src, *, draft_vocab=None, markov_rank: int | None = None, counts: np.ndarray | None = None):
    """A DSpark Drafter with its Markov head moved to `draft_vocab` (sorted target ids; None keeps the source's)
    and cut to `markov_rank` (None keeps it). `counts` [V]: how often each target token occurs in text like the
    drafter's (`train.vocab.response_token_counts`), to weight the truncation by (None: every row alike).
    Returns (Drafter in float32, report dict)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.drafter import Drafter, flat_params, param_key
    from dspark_jax.drafter_model import DrafterModel

    cfg = src.config
    if cfg.kind != "dspark" or cfg.head != "markov":
        raise ValueError(f"shrink needs a DSpark drafter with the Markov head (head: markov); this one is "
                         f"{cfg.kind} with head {cfg.head!r}")
    flat = {k: np.asarray(jax.device_get(x), np.float32) for k, x in flat_params(src.params).items()}
    V, R = cfg.vocab_size, cfg.markov_rank
    ids = tuple(cfg.draft_vocab) if draft_vocab is None else tuple(sorted({int(t) for t in draft_vocab}))
    if ids and not 0 <= ids[0] <= ids[-1] < V:
        raise ValueError(f"draft vocabulary ids must lie in [0, {V})")
    if markov_rank is not None and not 0 < markov_rank <= R:
        raise ValueError(f"rank {markov_rank} must be in [1, {R}] (the source's Markov rank): shrink only cuts")
    report = {"draft_vocab": {"from": len(cfg.draft_vocab) or V, "to": len(ids) or V},
              "markov_rank": {"from": R, "to": markov_rank or R}}
    if ids != tuple(cfg.draft_vocab):
        flat["markov_w1"], flat["markov_w2"] = move_markov_vocab(flat["markov_w1"], flat["markov_w2"], V,
                                                                 cfg.draft_vocab, ids)
    if markov_rank is not None and markov_rank != R:
        weights = None
        if counts is not None:
            counts = np.asarray(counts, np.float64)
            if counts.shape != (V,):
                raise ValueError(f"counts must have one entry per target token ({V}), not {counts.shape}")
            per_row = counts[list(ids)] if ids else counts
            if ids:  # the shared outside row is read for every token outside the subset
                per_row = np.append(per_row, counts.sum() - per_row.sum())
            weights = np.sqrt(per_row + 1.0)  # + 1: a token never seen still counts a little
        report.update(resize_markov(flat, cfg, markov_rank, weights), weighted_by_counts=counts is not None)
    new_cfg = dataclasses.replace(cfg, draft_vocab=ids, markov_rank=markov_rank or R)
    model = nnx.eval_shape(lambda: DrafterModel(new_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    drafter = Drafter(new_cfg, model)
    keys = set(flat_params(drafter.params))
    if keys != set(flat):
        raise ValueError(f"parameters differ after shrinking: {sorted(keys ^ set(flat))[:4]}")
    pure = jax.tree_util.tree_map_with_path(lambda path, _: jnp.asarray(flat[param_key(path)]),
                                            nnx.to_pure_dict(drafter.params))
    nnx.replace_by_pure_dict(drafter.params, pure)
    report["params"] = {"from": src.num_params(), "to": drafter.num_params()}
    return drafter, report


def bytes_on_disk(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
