"""`train.losses.drafter_loss` against a loop written from the paper (§3.3, eq. 8–12) and the loss docstring.

For every (sequence, anchor n) row and block slot k (0-based) with n+1+k < length, the reference computes
  p_d,k   the draft distribution of tests/naive_drafter.py (context = positions < n, teacher-forced on x*_{n+k}),
  p_t,k   softmax of the *transformers* model's logits at position n+k,
  ℓ_ce = −log p_d,k(x*_{n+1+k})                       (eq. 9)
  ℓ_tv = ‖p_d,k − p_t,k‖₁                              (eq. 10)
  c*_k = 1 − ½‖p_d,k − p_t,k‖₁                          (eq. 8)
  ℓ_conf = −[c*_k log c_k + (1 − c*_k) log(1 − c_k)]    (eq. 11)
and combines them with w_k = exp(−k/L) as α_ce L_ce + α_tv L_tv + α_conf L_conf (eq. 12), each L a w-weighted
mean over the batch's valid slots (the paper writes per-block sums; the code documents this normalisation).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _Lazy, make_hf_model, target_from_hf
from naive_drafter import NaiveDrafter, flat_params, hf_features, softmax
from test_spec_decode import _drafter

from dspark_jax.drafter_model import TargetHead
from train.losses import LossWeights, drafter_loss


@pytest.fixture(scope="module")
def sharp_targets(tmp_path_factory):
    """The tiny llama (tied) and qwen3 (untied) with their output logits scaled ×8: peaked, LM-like target
    distributions, so that p_t matters to L_tv and c* (a near-uniform p_t would hide a misplaced one)."""
    import torch

    def make(model_type):
        hf = make_hf_model(model_type, tied=model_type == "llama")
        with torch.no_grad():
            (hf.model.embed_tokens.weight if model_type == "llama" else hf.lm_head.weight).mul_(8.0)
        return hf, target_from_hf(hf, tmp_path_factory.mktemp(f"sharp-{model_type}"))

    return _Lazy(make)


def _hf_logits(hf, tokens):
    import torch

    with torch.no_grad():
        return hf(torch.as_tensor([list(tokens)], dtype=torch.long)).logits[0].double().numpy()


def reference_loss(hf, naive: NaiveDrafter, tokens, lengths, anchors, weights: LossWeights):
    """The loop: rows (s, n) for n in anchors[s]; returns (loss, {ce, tv, conf, kl, acceptance [L], top1})."""
    cfg = naive.cfg
    L = cfg.block_size
    w_all, ce_all, tv_all, bce_all, kl_all, c_star, top1, valid_all = [], [], [], [], [], [], [], []
    for s in range(tokens.shape[0]):
        seq = [int(t) for t in tokens[s, : lengths[s]]]
        feats = hf_features(hf, seq, cfg.target_layers)
        p_target = softmax(_hf_logits(hf, seq))
        for n in anchors[s]:
            prev = [seq[min(n + k, len(seq) - 1)] for k in range(L)]  # x*_{n+k}; slots past the end are masked
            logits, conf = naive.draft_logits(seq[: n + 1], feats[:n], prev)
            for k in range(L):
                valid = n + 1 + k < lengths[s]
                valid_all.append(valid)
                w_all.append(np.exp(-k / L) * valid)
                if not valid:
                    ce_all.append(0.0), tv_all.append(0.0), bce_all.append(0.0), c_star.append(0.0), top1.append(0)
                    kl_all.append(0.0)
                    continue
                p_d = softmax(logits[k])
                truth = seq[n + 1 + k]
                tv = np.abs(p_d - p_target[n + k]).sum()
                cs = min(max(1.0 - 0.5 * tv, 0.0), 1.0)
                ce_all.append(-np.log(p_d[truth]))
                kl_all.append(-(p_target[n + k] * np.log(p_d)).sum())  # soft cross-entropy against p_t
                tv_all.append(tv)
                c_star.append(cs)
                top1.append(int(np.argmax(p_d) == truth))
                if conf is not None:
                    c = 1 / (1 + np.exp(-conf[k]))
                    bce_all.append(-(cs * np.log(c) + (1 - cs) * np.log(1 - c)))
                else:
                    bce_all.append(0.0)
    w = np.array(w_all)
    mean = lambda x: float((w * np.array(x)).sum() / w.sum())  # noqa: E731
    out = {"ce": mean(ce_all), "tv": mean(tv_all)}
    loss = weights.ce * out["ce"] + weights.tv * out["tv"]
    if cfg.confidence:
        out["conf"] = mean(bce_all)
        loss += weights.conf * out["conf"]
    if weights.kl:
        out["kl"] = mean(kl_all)
        loss += weights.kl * out["kl"]
    valid = np.array(valid_all).reshape(-1, L)
    per_pos = lambda x: (np.array(x).reshape(-1, L) * valid).sum(0) / np.maximum(valid.sum(0), 1)  # noqa: E731
    out["acceptance"] = per_pos(c_star)
    out["top1"] = float(per_pos(top1).mean())
    out["loss"] = loss
    return loss, out


def _batch():
    """Three sequences, right-padded, with anchors that put some slots past the end (masked)."""
    rng = np.random.default_rng(3)
    lengths = np.array([20, 13, 9], np.int32)
    tokens = np.zeros((3, 24), np.int32)
    for s, n in enumerate(lengths):
        tokens[s, :n] = rng.integers(3, 128, size=n)
    anchors = np.array([[1, 8, 17], [2, 6, 11], [1, 4, 7]], np.int32)  # 1 ≤ n ≤ length − 2
    return tokens, lengths, anchors


CASES = [("qwen3", "dspark", LossWeights()),  # the paper's α (0.1, 0.9, 1.0)
         ("llama", "dspark", LossWeights(ce=0.7, tv=0.2, conf=0.5)),  # tied head
         ("qwen3", "dflash", LossWeights(ce=0.4, tv=0.6, conf=0.0)),
         ("qwen3", "eagle3", LossWeights(ce=0.4, tv=0.6, conf=0.0)),
         ("llama", "dspark", LossWeights(ce=0.1, tv=0.9, conf=1.0, kl=0.5)),  # + soft cross-entropy
         ("qwen3", "eagle3", LossWeights(ce=0.0, tv=0.0, conf=0.0, kl=1.0))]  # DeepSpec's EAGLE-3 loss


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}" + ("-kl" if c[2].kl else ""))
def test_drafter_loss_equals_the_paper_loop(sharp_targets, case):
    model_type, kind, weights = case
    hf, target = sharp_targets[model_type]
    # Random heads (non-zero Markov bias and confidence weights) so every term carries weight.
    d = _drafter(target, kind, 4, seed=2, scramble=0.3, **({"num_layers": 1, "markov_rank": 8}
                                                            if kind == "dspark" else {"num_layers": 1}))
    tokens, lengths, anchors = _batch()
    tied = target.config.tie_word_embeddings
    head = TargetHead.from_params(target.params, tied)
    hidden, _, feats = target.forward(tokens, target.init_cache(*tokens.shape), hidden_layers=d.config.target_layers,
                                      compute_logits=False)
    loss, metrics = drafter_loss(d.module(), head, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(anchors),
                                 hidden, feats, weights)
    naive = NaiveDrafter(flat_params(d), d.config, head.embed, head.lm_head)
    ref_loss, ref = reference_loss(hf, naive, tokens, lengths, anchors, weights)
    for name in ("ce", "tv", "conf", "kl"):
        assert (name in metrics) == (name in ref), name
        if name in ref:
            np.testing.assert_allclose(float(metrics[name]), ref[name], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(np.asarray(metrics["acceptance"]), ref["acceptance"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["top1"]), ref["top1"], atol=1e-6)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-4)
    assert ref["tv"] > 0.1  # the terms are not trivially zero


def test_reference_loss_sees_a_shifted_target(sharp_targets):
    """The comparison has power: the target distribution taken one position late moves the loss by more than
    ten times the tolerance above (a random drafter is far from either position's p_t, so only by ~0.6%)."""
    hf, target = sharp_targets["qwen3"]
    d = _drafter(target, "dspark", 4, seed=2, scramble=0.3, num_layers=1, markov_rank=8)
    tokens, lengths, anchors = _batch()
    head = TargetHead.from_params(target.params, False)
    hidden, _, feats = target.forward(tokens, target.init_cache(*tokens.shape), hidden_layers=d.config.target_layers,
                                      compute_logits=False)
    shifted = jnp.concatenate([hidden[:, 1:], hidden[:, -1:]], 1)
    loss, _ = drafter_loss(d.module(), head, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(anchors),
                           shifted, feats, LossWeights())
    ref_loss, _ = reference_loss(hf, NaiveDrafter(flat_params(d), d.config, head.embed, head.lm_head), tokens,
                                 lengths, anchors, LossWeights())
    assert abs(float(loss) - ref_loss) > 10 * 1e-4 * abs(ref_loss), (float(loss), ref_loss)
