"""A naive numpy drafter: the paper's equations written as loops, independent of dspark_jax's modules.

The oracle for the speculative path's drafting (tests/test_drafting_reference.py) and for the training loss
(tests/test_losses_reference.py). It reads the drafter's parameters as a flat dict of numpy arrays and the
target's context features as given (the tests take them from the transformers model's `hidden_states`), and
recomputes from scratch, for one row with n committed tokens x_0..x_{n−1} and the anchor x_n:

  context (eq. 2–3)  H_ctx = RMSNorm(fc(features)) [n, D]; each layer's K = RoPE(W_k H_ctx, positions 0..n−1),
                     V = W_v H_ctx — nothing cached, nothing incremental;
  block (§2.2)       [emb(x_n), mask, …] at positions n, n+1, …, attending to all context and the whole block;
                     dspark reads L slots (anchor + L−1 masks), dflash reads the L masks after the anchor;
  Markov head (eq. 5) logits_k = U_k + W2ᵀ W1[x_{k−1}] with x_0 = the anchor, teacher-forced on given tokens;
  confidence (eq. 7) c_k = σ(w·[h_k; W1[x_{k−1}]] + b);
  EAGLE-3            context entry t pairs emb(x_{t+1}) with f_t = RMSNorm(fc(features_t)) at position t
                     (t < n−1); step k feeds token x_{n+k} with f_{n−1} (k = 0) or the previous step's output at
                     position n−1+k, attending to the context entries and to earlier steps.
Only this project's own layout is implemented (the DeepSpec switches must be at their defaults).
"""

from __future__ import annotations

import numpy as np


def _rms(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
    """Rotate-half RoPE: x [T, heads, H] at integer positions [T]."""
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    ang = np.asarray(positions, np.float64)[:, None] * inv  # [T, H/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class NaiveDrafter:
    """params: {dotted path: array} (as `flat_params` gives); cfg: the DrafterConfig; embed [V, D];
    lm_head [D, V] (the target's, frozen)."""

    def __init__(self, params: dict, cfg, embed, lm_head):
        for field, default in (("mask_token_id", None), ("anchor_predicts", False),
                               ("confidence_with_markov", True), ("eagle_layer", "fused")):
            if getattr(cfg, field, default) != default:
                raise NotImplementedError(f"naive drafter: {field}={getattr(cfg, field)!r} is not implemented")
        if cfg.rope.rope_type != "default" or cfg.head not in ("markov", "none"):
            raise NotImplementedError(f"naive drafter: rope {cfg.rope.rope_type}, head {cfg.head}")
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.cfg = cfg
        self.embed = np.asarray(embed, np.float64)
        self.lm_head = np.asarray(lm_head, np.float64)

    # ---- one layer, written out --------------------------------------------------------------------------------
    def _proj(self, i, x):
        """Normed input x [T, D] → q [T, N, H], k, v [T, K, H] (q/k RMSNorm when the config has it)."""
        p, c = self.p, self.cfg
        q = np.einsum("td,dnh->tnh", x, p[f"layers.{i}.attn.q"])
        k = np.einsum("td,dkh->tkh", x, p[f"layers.{i}.attn.k"])
        v = np.einsum("td,dkh->tkh", x, p[f"layers.{i}.attn.v"])
        if c.qk_norm:
            q = _rms(q, p[f"layers.{i}.attn.q_norm.scale"], c.rms_norm_eps)
            k = _rms(k, p[f"layers.{i}.attn.k_norm.scale"], c.rms_norm_eps)
        return q, k, v

    def _layer(self, i, x, positions, ctx_k, ctx_v, causal_from=None):
        """x [T, D] at positions [T]; context keys/values [S, K, H] (already RoPE'd). Block queries see every
        context entry and every block entry (bidirectional), or, with `causal_from`, block entries ≤ their own
        index (EAGLE-3's steps). Returns (new x, block k, block v)."""
        p, c = self.p, self.cfg
        q, k, v = self._proj(i, _rms(x, p[f"layers.{i}.attn_norm.scale"], c.rms_norm_eps))
        q, k = _rope(q, positions, c.rope.theta), _rope(k, positions, c.rope.theta)
        keys, values = np.concatenate([ctx_k, k]), np.concatenate([ctx_v, v])
        S, T = len(ctx_k), len(x)
        G = c.num_heads // c.num_kv_heads
        out = np.zeros((T, c.num_heads, c.head_dim))
        for t in range(T):
            visible = S + (t + 1 if causal_from is not None else T)
            for n in range(c.num_heads):
                s = keys[:visible, n // G] @ q[t, n] / np.sqrt(c.head_dim)
                out[t, n] = softmax(s) @ values[:visible, n // G]
        x = x + np.einsum("tnh,nhd->td", out, p[f"layers.{i}.attn.o"])
        y = _rms(x, p[f"layers.{i}.mlp_norm.scale"], c.rms_norm_eps)
        y = (_silu(y @ p[f"layers.{i}.mlp.gate"]) * (y @ p[f"layers.{i}.mlp.up"])) @ p[f"layers.{i}.mlp.down"]
        return x + y, k, v

    def _context(self, i, h_ctx):
        """Context K/V of layer i from H_ctx [n, D] at positions 0..n−1 (eq. 3)."""
        _, k, v = self._proj(i, h_ctx)
        return _rope(k, np.arange(len(h_ctx)), self.cfg.rope.theta), v

    def _fc(self, feats):
        return _rms(np.asarray(feats, np.float64) @ self.p["fc"], self.p["ctx_norm.scale"], self.cfg.rms_norm_eps)

    # ---- dspark / dflash ---------------------------------------------------------------------------------------
    def block_hidden(self, feats, anchor):
        """feats [n, m·D] of the n committed tokens; anchor = x_n → final-normed h [L, D]."""
        c, p = self.cfg, self.p
        n, L = len(feats), c.block_size
        n_in = L if c.kind == "dspark" else L + 1
        x = np.stack([self.embed[anchor]] + [p["mask_embed"]] * (n_in - 1))
        h_ctx = self._fc(feats)
        positions = n + np.arange(n_in)
        for i in range(c.num_layers):
            ck, cv = self._context(i, h_ctx)
            x, _, _ = self._layer(i, x, positions, ck, cv)
        h = _rms(x, p["final_norm.scale"], c.rms_norm_eps)
        return h if c.kind == "dspark" else h[1:]

    def block_logits(self, feats, anchor, prev):
        """Teacher-forced draft logits [L, V] and confidence logits [L] (None without a head).

        prev [L]: x_{k−1} for slot k (prev[0] = the anchor)."""
        c, p = self.cfg, self.p
        h = self.block_hidden(feats, anchor)
        U = h @ self.lm_head
        if c.head == "none":
            return U, None
        e = p["markov_w1"][np.asarray(prev)]  # [L, R]
        logits = U + e @ p["markov_w2"]
        conf = np.concatenate([h, e], -1) @ p["conf_w"] + p["conf_b"] if c.confidence else None
        return logits, conf

    # ---- eagle3 ------------------------------------------------------------------------------------------------
    def _eagle_in(self, token, f):
        e = _rms(self.embed[token], self.p["embed_norm.scale"], self.cfg.rms_norm_eps)
        return np.concatenate([e, f], -1) @ self.p["input_fc"]

    def eagle_logits(self, tokens, feats, prev):
        """tokens: the n committed tokens and the anchor, x_0..x_n; feats [n, m·D]; prev [L] = x_{n+k} fed at
        step k (prev[0] = the anchor). Returns logits [L, V]."""
        c, p = self.cfg, self.p
        n = len(feats)
        f = self._fc(feats)  # [n, D]
        ctx_x = np.stack([self._eagle_in(tokens[t + 1], f[t]) for t in range(n - 1)] or [np.zeros(c.hidden_size)])
        _, ck, cv = self._proj(0, _rms(ctx_x, p["layers.0.attn_norm.scale"], c.rms_norm_eps))
        ck, cv = _rope(ck, np.arange(len(ck)), c.rope.theta)[: n - 1], cv[: n - 1]  # n = 1: no context entry
        feature, out = f[n - 1], []
        for k, tok in enumerate(prev):
            x = self._eagle_in(tok, feature)[None]
            y, kk, vv = self._layer(0, x, np.array([n - 1 + k]), ck, cv, causal_from=0)
            ck, cv = np.concatenate([ck, kk]), np.concatenate([cv, vv])  # later steps read this one
            feature = y[0]
            out.append(_rms(y[0], p["final_norm.scale"], c.rms_norm_eps) @ self.lm_head)
        return np.stack(out)

    def draft_logits(self, tokens, feats, prev):
        """Any kind: committed tokens + anchor `tokens` [n+1], feats [n, m·D], teacher-forcing inputs prev [L]
        → (logits [L, V], confidence logits [L] or None)."""
        if self.cfg.kind == "eagle3":
            return self.eagle_logits(tokens, feats, prev), None
        return self.block_logits(feats, tokens[-1], prev)


def flat_params(drafter) -> dict:
    """A Drafter's parameters as {dotted path: numpy array}."""
    from flax import nnx

    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(drafter.params))
    return {".".join(str(k) for k in key): np.asarray(v) for key, v in flat.items()}


def hf_features(hf_model, tokens, layers) -> np.ndarray:
    """The transformers model's hidden_states[i + 1] for i in `layers`, concatenated: [T, m·D]."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.as_tensor([list(tokens)], dtype=torch.long), output_hidden_states=True)
    return np.concatenate([out.hidden_states[i + 1][0].double().numpy() for i in layers], -1)
