"""The drafter network: DFlash backbone with KV injection (paper §2.2, eq. 2–3), the sequential heads
(Markov eq. 5, RNN eq. 6), the confidence head (eq. 7), and the EAGLE-3-style autoregressive layer.

Context features. For every committed context token the target's hidden states at `target_layers` are
concatenated [B, T, m·D] (each layer's slice RMS-normalised first with `feature_norm`), projected by `fc` +
RMSNorm to the drafter width (H_ctx, eq. 2), and each drafter
layer's k/v projections of H_ctx are written once into the drafter's context cache (eq. 3) — never recomputed.

Block pass (dspark/dflash). Inputs: the anchor's embedding then mask embeddings, at absolute positions
n, n+1, …; each block query attends to the whole context cache and bidirectionally to the block.
Output hidden states h_k; base logits U_k = the target's frozen LM head applied to them.

EAGLE-3. One layer over [embedding(x_{t+1}); fused feature f_t] (f_t = fc(target features) for context,
the drafter's own output for drafted positions), run token by token. `eagle_layer="fused"` (ours) projects
[norm(e); f] to D and runs a standard layer; `"concat"` is EAGLE-3's own layer (`Eagle3ConcatLayer`, as in
DeepSpec/SpecForge): q/k/v read [norm(e); norm(f)] of width 2D and the residual stream is f itself.

Parameters of the target (embedding, LM head) are passed in at call time, never copied: `TargetHead`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax import draft_vocab
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.kv_cache import write_kv
from dspark_jax.layers import Projections, RMSNorm, SwiGLU, apply_rope, attention, rope_inv_freq

INIT_STD = 0.02  # σ of the normal initialiser of every freshly drawn weight matrix

def calibration(cfg: DrafterConfig):
    """(temperatures [L], offsets [L]) of the confidence's post-hoc calibration, c_k = σ(z_k / T_k + b_k)
    (ones and zeros for a raw head): the one place every drafting path reads them from."""
    L = cfg.block_size
    t = jnp.asarray(cfg.calibration, jnp.float32) if cfg.calibration else jnp.ones((L,), jnp.float32)
    b = (jnp.asarray(cfg.calibration_offsets, jnp.float32) if cfg.calibration_offsets
         else jnp.zeros((L,), jnp.float32))
    return t, b


@struct.dataclass
class TargetHead:
    """The target's frozen, shared pieces: embedding [V, D] and LM head [D, V]."""

    embed: jax.Array
    lm_head: jax.Array
    draft_lm_head: jax.Array | None = None  # [D, Vd]: lm_head's reduced-vocabulary columns, gathered once

    @classmethod
    def from_params(cls, params, tied: bool, draft_lm_head: jax.Array | None = None) -> TargetHead:
        """`draft_lm_head` (draft_vocab.subset_head, computed once outside the program) saves a drafter with a
        reduced vocabulary from gathering its Vd columns out of the [D, V] head on every call."""
        embed = params["embed"][...]
        return cls(embed=embed, lm_head=embed.T if tied else params["lm_head"][...], draft_lm_head=draft_lm_head)

    def logits(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("...D,DV->...V", h, self.lm_head, preferred_element_type=jnp.float32)


@struct.dataclass
class DrafterCache:
    """Context K/V of every drafter layer [B, K, S, H] for committed tokens, plus EAGLE-3's last feature.

    `lengths` [B] counts context entries (= target lengths for dspark/dflash; target lengths − 1 for eagle3,
    whose entry t pairs feature f_t with the *next* token x_{t+1}). `last_feature` [B, D] is f_{n−1} (eagle3).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    last_feature: jax.Array


class DrafterLayer(nnx.Module):
    """Pre-norm transformer layer whose attention also reads the injected context cache."""

    def __init__(self, cfg: DrafterConfig, *, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Projections(dim=D, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, bias=False, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
                                dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(dim=D, ffn=cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)

    def context_kv(self, h_ctx, positions, inv_freq):
        """h_ctx [B, T, D] (already normed) → k, v [B, T, K, H] with RoPE on k."""
        _, k, v = self.attn.qkv(h_ctx)
        return apply_rope(k, positions, inv_freq), v

    def __call__(self, x, positions, inv_freq, ctx_k, ctx_v, ctx_mask, block_mask, extra_kv=None):
        """x [B, T, D] at positions [B, T]; ctx_k/v [B, K, S, H]; ctx_mask [B, T, S]; block_mask [B, T, T'].

        `extra_kv` (eagle3) = (k, v, mask) of earlier drafted positions [B, K, J, H], prepended to the block.
        """
        a, kv = self.attend(self.attn_norm(x), positions, inv_freq, ctx_k, ctx_v, ctx_mask, block_mask, extra_kv)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), kv

    def attend(self, xn, positions, inv_freq, ctx_k, ctx_v, ctx_mask, block_mask, extra_kv=None):
        """Attention of (normed) inputs xn over [context; extra; block] → (o-projected [B, T, D], block (k, v))."""
        q, k, v = self.attn.qkv(xn)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        keys, values, mask = [ctx_k], [ctx_v], [ctx_mask]
        if extra_kv is not None:
            keys.append(extra_kv[0])
            values.append(extra_kv[1])
            mask.append(extra_kv[2])
        keys.append(k)
        values.append(v)
        mask.append(block_mask)
        a = attention(q, jnp.concatenate(keys, 2), jnp.concatenate(values, 2), jnp.concatenate(mask, 2))
        return self.attn.out(a), (k, v)


class Eagle3ConcatLayer(DrafterLayer):
    """EAGLE-3's own layer (DeepSpec's `Qwen3Eagle3DecoderLayer`), for `eagle_layer="concat"`:

        x2 = [embed_norm(e); hidden_norm(f)]          [B, T, 2D]   (`inputs`)
        y  = f + o(attention(q(x2), k(x2), v(x2)))    [B, T, D]
        y  = y + mlp(mlp_norm(y))
    """

    def __init__(self, cfg: DrafterConfig, *, dtype, rngs: nnx.Rngs):
        # Its own parameters (no super().__init__): it inherits only `attend` and `context_kv`.
        D = cfg.hidden_size
        self.embed_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Projections(dim=2 * D, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, bias=False, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
                                dtype=dtype, rngs=rngs)
        # q, k, v read the 2D-wide concatenation; the output projection writes the D-wide residual stream.
        self.attn.o = nnx.Param(nnx.initializers.normal(INIT_STD)(rngs.params(), (cfg.num_heads, cfg.head_dim, D),
                                                                 dtype))
        self.mlp_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(dim=D, ffn=cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)

    def inputs(self, e, f):
        """Token embeddings e and features f [B, T, D] → x2 [B, T, 2D] (embedding first, as DeepSpec)."""
        return jnp.concatenate([self.embed_norm(e.astype(f.dtype)), self.hidden_norm(f)], -1)

    def __call__(self, x2, positions, inv_freq, ctx_k, ctx_v, ctx_mask, block_mask, extra_kv=None, *, residual):
        """x2 [B, T, 2D] from `inputs`; residual = the un-normed features f [B, T, D]."""
        a, kv = self.attend(x2, positions, inv_freq, ctx_k, ctx_v, ctx_mask, block_mask, extra_kv)
        y = residual.astype(a.dtype) + a
        return y + self.mlp(self.mlp_norm(y)), kv


class DrafterModel(nnx.Module):
    """All drafter parameters (the target's embedding and head are not among them: see TargetHead)."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        D, R, V = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
        init = nnx.initializers.normal(INIT_STD)
        self.fc = nnx.Param(init(rngs.params(), (len(cfg.target_layers) * D, D), dtype))
        if cfg.feature_norm:  # one RMSNorm scale per target layer, applied before fc
            self.feature_norm = nnx.Param(jnp.ones((len(cfg.target_layers), D), dtype))
        if not self.concat:  # EAGLE-3's own layer norms the feature inside (hidden_norm), residual un-normed
            self.ctx_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        layer = Eagle3ConcatLayer if self.concat else DrafterLayer
        self.layers = nnx.List([layer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        if cfg.kind == "eagle3" and not self.concat:
            # [norm(embedding); norm(feature)] → D, EAGLE-3's fused input.
            self.input_fc = nnx.Param(init(rngs.params(), (2 * D, D), dtype))
            self.embed_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        elif cfg.kind != "eagle3":
            self.mask_embed = nnx.Param(init(rngs.params(), (D,), dtype))
            if cfg.anchor_feature:  # H_ctx[n−1] joins the anchor's embedding (`anchor_input`)
                # fused: [RMSNorm(e); H_ctx[n−1]] @ anchor_fc; add, residual: H_ctx[n−1] @ anchor_fc, zero at the start
                self.anchor_fc = nnx.Param(init(rngs.params(), (2 * D, D), dtype) if cfg.anchor_mode == "fused"
                                           else jnp.zeros((D, D), dtype))
                if cfg.anchor_mode != "add":  # e at H_ctx's scale (SmolLM2's rows: rms ~0.13)
                    self.anchor_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
            if cfg.context_tokens:  # entry t = H_ctx[t] + RMSNorm(e(x_{t+1}))·W, W zero at the start
                self.context_token_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
                self.context_token_fc = nnx.Param(jnp.zeros((D, D), dtype))
        if cfg.head != "none":
            # Markov embedding: a row per token (per subset token + one shared row with a reduced vocabulary).
            rows = draft_vocab.size(cfg) + 1 if draft_vocab.is_reduced(cfg) else V
            self.markov_w1 = nnx.Param(init(rngs.params(), (rows, R), dtype))
            # W2 starts at zero: an untrained head leaves the backbone's logits untouched.
            self.markov_w2 = nnx.Param(jnp.zeros((R, draft_vocab.size(cfg)), dtype))
        if cfg.head == "gated":  # σ([h_k; e] G + g) gates the Markov embedding e (DeepSpec's GatedMarkovHead)
            self.markov_gate = nnx.Param(init(rngs.params(), (D + R, R), dtype))
            self.markov_gate_bias = nnx.Param(jnp.zeros((R,), dtype))
        if cfg.head == "rnn":
            self.rnn = nnx.Param(init(rngs.params(), (2 * R + D, 3 * R), dtype))  # gate | candidate | out
            if cfg.rnn_bias:
                self.rnn_bias = nnx.Param(jnp.zeros((3 * R,), dtype))
        if cfg.confidence:
            self.conf_w = nnx.Param(jnp.zeros((D + R if cfg.confidence_with_markov else D,), dtype))
            self.conf_b = nnx.Param(jnp.zeros((), dtype))

    @property
    def concat(self) -> bool:
        """EAGLE-3's own layer (`Eagle3ConcatLayer`) rather than our fused input."""
        return self.cfg.kind == "eagle3" and self.cfg.eagle_layer == "concat"

    # ---- context -------------------------------------------------------------------------------------------
    def init_cache(self, batch: int, capacity: int) -> DrafterCache:
        c = self.cfg
        shape = (batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = self.fc[...].dtype
        return DrafterCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers)),
                            v=tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers)),
                            lengths=jnp.zeros((batch,), jnp.int32),
                            last_feature=jnp.zeros((batch, c.hidden_size), dtype))

    def project_features(self, feats: jax.Array) -> jax.Array:
        """Target hidden states [B, T, m·D] → H_ctx [B, T, D] (eq. 2; EAGLE-3's fused feature too). With
        `feature_norm` each layer's D-slice is RMS-normalised and scaled first (feature_norm [m, D])."""
        dtype = self.fc[...].dtype
        if self.cfg.feature_norm:
            m, D = self.feature_norm.shape
            x = feats.astype(jnp.float32).reshape(*feats.shape[:-1], m, D)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
            feats = (x * self.feature_norm[...].astype(jnp.float32)).reshape(feats.shape)
        h = jnp.einsum("BTE,ED->BTD", feats.astype(dtype), self.fc[...])
        return h if self.concat else self.ctx_norm(h)

    def eagle_input(self, head: TargetHead, tokens, feature):
        """EAGLE-3 layer input from tokens [B, T] and fused features [B, T, D] ([B, T, 2D] for concat)."""
        if self.concat:
            return self.layers[0].inputs(jnp.take(head.embed, tokens, axis=0), feature)
        e = self.embed_norm(jnp.take(head.embed, tokens, axis=0).astype(feature.dtype))
        return jnp.einsum("BTE,ED->BTD", jnp.concatenate([e, feature], -1), self.input_fc[...])

    def write_context(self, cache: DrafterCache, head: TargetHead, feats, positions, new_lengths,
                      next_tokens=None, last_feature=None) -> DrafterCache:
        """Writes context entries for target features feats [B, T, m·D] at positions [B, T].

        dspark/dflash: `feats` are raw target features [B, T, m·D]; entry = RMSNorm(fc(feats)) (`context_entry`
        adds the embedding of `next_tokens` [B, T] with `context_tokens`).
        eagle3: `feats` are already fused features [B, T, D] (`project_features`), and entry t pairs
        `next_tokens` [B, T] with them (EAGLE-3's [embedding(x_{t+1}); f_t]).
        """
        if self.cfg.kind == "eagle3":
            x = self.eagle_input(head, next_tokens, feats)
            h = x if self.concat else self.layers[0].attn_norm(x)
        else:
            h = self.context_entry(head, next_tokens, self.project_features(feats))
        return self._write_entries(cache, h, positions, new_lengths,
                                   cache.last_feature if last_feature is None else last_feature)

    def _write_entries(self, cache: DrafterCache, h, positions, new_lengths, last_feature) -> DrafterCache:
        """Context entries h [B, T, D] (every layer's K/V input) written at positions [B, T]."""
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(h, positions, inv_freq)
            ks.append(write_kv(cache.k[i], k, positions))
            vs.append(write_kv(cache.v[i], v, positions))
        return DrafterCache(k=tuple(ks), v=tuple(vs), lengths=new_lengths.astype(jnp.int32),
                            last_feature=last_feature)

    def context_entry(self, head: TargetHead, next_tokens, h) -> jax.Array:
        """dspark/dflash context entries from H_ctx = h [..., D]: h itself, or with `context_tokens`
        h + RMSNorm(e(next_tokens))·W, entry t paired with the token x_{t+1} that followed it."""
        if not self.cfg.context_tokens:
            return h
        if next_tokens is None:
            raise ValueError("context_tokens needs the token after each context entry")
        e = self.context_token_norm(jnp.take(head.embed, next_tokens, axis=0).astype(h.dtype))
        return h + jnp.einsum("...D,DE->...E", e, self.context_token_fc[...])

    def close_last_entry(self, cache: DrafterCache, head: TargetHead, anchor) -> DrafterCache:
        """With `context_tokens`, entry n−1 pairs H_ctx[n−1] (`cache.last_feature`) with the anchor x_n [B],
        known only once it is sampled: the block pass writes it before it reads the context."""
        if not self.cfg.context_tokens:
            return cache
        h = self.context_entry(head, anchor[:, None], cache.last_feature[:, None])
        return self._write_entries(cache, h, jnp.maximum(cache.lengths - 1, 0)[:, None], cache.lengths,
                                   cache.last_feature)

    def write_prompt(self, cache: DrafterCache, head: TargetHead, tokens, feats, committed) -> DrafterCache:
        """Context from a whole sequence: tokens [B, T] and their target features [B, T, m·D] at positions 0..T−1,
        of which the first `committed` [B] count (prefill: the prompt lengths; training: the anchors n)."""
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], 1)
        if self.cfg.kind != "eagle3":
            last = None
            if self.cfg.keeps_last_feature:  # H_ctx[n−1]: the anchor slot's, the last entry's
                last = self.project_features(feats[jnp.arange(B), committed - 1][:, None])[:, 0]
            return self.write_context(cache, head, feats, positions, committed, next_tokens=next_tokens,
                                      last_feature=None if last is None else last.astype(cache.last_feature.dtype))
        # EAGLE-3 entry t pairs f_t with x_{t+1}: entries 0..n−2 count, f_{n−1} waits for the anchor x_n.
        fused = self.project_features(feats)
        return self.write_context(cache, head, fused, positions, committed - 1, next_tokens=next_tokens,
                                  last_feature=fused[jnp.arange(B), committed - 1])

    # ---- parallel block pass (dspark / dflash) ----------------------------------------------------------------
    def block_hidden(self, head: TargetHead, cache: DrafterCache, anchor: jax.Array, start: jax.Array):
        """One parallel pass. anchor [B] at positions `start` [B] (= committed length n).

        Returns h [B, L, D] (final-normed): dspark reads slots 0..L−1 (anchor + L−1 masks); dflash feeds
        anchor + L masks and reads the L mask slots (or, with `anchor_predicts`, the dspark layout).
        """
        cache = self.close_last_entry(cache, head, anchor)
        x, positions = self.block_inputs(head, anchor, start, cache.last_feature)
        B, n_in = positions.shape
        S = cache.k[0].shape[2]
        ctx_mask = jnp.broadcast_to(jnp.arange(S)[None, None] < cache.lengths[:, None, None], (B, n_in, S))
        block_mask = jnp.ones((B, n_in, n_in), bool)
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, positions, inv_freq, cache.k[i], cache.v[i], ctx_mask, block_mask)
        return self.block_output(x)

    def block_inputs(self, head: TargetHead, anchor: jax.Array, start: jax.Array, last_feature=None):
        """The block pass's inputs: x [B, n_in, D] (anchor embedding, then mask embeddings) at positions
        [B, n_in] from `start`; n_in = L (dspark) or L + 1 (dflash). Shared by `block_hidden`, the packed
        training pass (train/losses.py) and the paged serving pass (dspark_jax/paged.py).

        anchor [...]; with `anchor_feature`, last_feature [..., D] = H_ctx[n−1] joins the anchor's embedding."""
        L = self.cfg.block_size
        n_in = L if self.cfg.anchor_slot_predicts else L + 1
        emb = self.anchor_input(head, anchor, last_feature)
        return (jnp.concatenate([emb[..., None, :], jnp.broadcast_to(self.mask_embed[...], emb.shape[:-1] + (
            n_in - 1, emb.shape[-1]))], -2), start[..., None] + jnp.arange(n_in, dtype=jnp.int32))

    def anchor_input(self, head: TargetHead, anchor: jax.Array, last_feature=None) -> jax.Array:
        """The anchor slot's input [..., D]: its token's embedding e, joined with f = H_ctx[n−1] when
        `anchor_feature` as `anchor_mode` says (add: e + f·A; residual: RMSNorm(e) + f + f·A; fused:
        [RMSNorm(e); f]·A)."""
        emb = jnp.take(head.embed, anchor, axis=0).astype(self.mask_embed[...].dtype)
        if not self.cfg.anchor_feature:
            return emb
        if last_feature is None:
            raise ValueError("anchor_feature needs the last context feature H_ctx[n-1]")
        f = last_feature.astype(emb.dtype)
        if self.cfg.anchor_mode == "fused":
            return jnp.einsum("...E,ED->...D", jnp.concatenate([self.anchor_norm(emb), f], -1), self.anchor_fc[...])
        x = self.anchor_norm(emb) + f if self.cfg.anchor_mode == "residual" else emb
        return x + jnp.einsum("...D,DE->...E", f, self.anchor_fc[...])

    def block_output(self, x: jax.Array) -> jax.Array:
        """Last layer's output [B, n_in, D] → h [B, L, D] (final-normed; dflash drops the anchor slot)."""
        h = self.final_norm(x)
        return h if self.cfg.anchor_slot_predicts else h[:, 1:]

    # ---- sequential heads ---------------------------------------------------------------------------------------
    def markov_embedding(self, prev_tokens: jax.Array) -> jax.Array:
        """W1[x_{k−1}]: [...] → [..., R]."""
        return jnp.take(self.markov_w1[...], draft_vocab.markov_rows(prev_tokens, self.cfg), axis=0)

    def sequential_bias(self, e, h_k, state):
        """Bias B_k [B, V] and the next RNN state, from the Markov embedding e [B, R] and h_k [B, D]."""
        w2 = self.markov_w2[...]
        if self.cfg.head == "markov":  # eq. 5
            return jnp.einsum("BR,RV->BV", e, w2, preferred_element_type=jnp.float32), state
        if self.cfg.head == "gated":  # B_k = W2 (σ([h_k; e] G + g) ⊙ e)
            z = jnp.concatenate([h_k.astype(e.dtype), e], -1)
            gate = jax.nn.sigmoid(jnp.einsum("BZ,ZR->BR", z, self.markov_gate[...]) + self.markov_gate_bias[...])
            return jnp.einsum("BR,RV->BV", gate * e, w2, preferred_element_type=jnp.float32), state
        z = jnp.concatenate([state, e, h_k.astype(e.dtype)], -1)  # eq. 6
        proj = jnp.einsum("BZ,ZR->BR", z, self.rnn[...])
        g, c, o = jnp.split(proj + self.rnn_bias[...] if self.cfg.rnn_bias else proj, 3, axis=-1)
        gate = jax.nn.sigmoid(g)
        state = gate * state + (1 - gate) * jnp.tanh(c)
        return jnp.einsum("BR,RV->BV", jnp.tanh(o), w2, preferred_element_type=jnp.float32), state

    def confidence_logit(self, h_k, e):
        """Pre-sigmoid confidence w·[h_k; W1[x_{k−1}]] + b (eq. 7): [B, D], [B, R] → [B].
        With `confidence_with_markov=False` it reads h_k alone (e may be None)."""
        if not self.cfg.confidence_with_markov:
            return (h_k @ self.conf_w[...] + self.conf_b[...]).astype(jnp.float32)
        feats = jnp.concatenate([h_k.astype(e.dtype), e], -1)
        return (feats @ self.conf_w[...] + self.conf_b[...]).astype(jnp.float32)

    # ---- EAGLE-3 autoregressive step -------------------------------------------------------------------------
    def eagle_step(self, head: TargetHead, cache: DrafterCache, token, feature, position, extra):
        """One token: token [B], fused feature [B, D] at position [B]; `extra` = (k, v, mask) of earlier
        drafted steps [B, K, L, H], [B, L]. Returns (pre-norm output [B, D], final-normed h [B, D], (k, v))."""
        x = self.eagle_input(head, token[:, None], feature[:, None])
        pos = position[:, None]
        S = cache.k[0].shape[2]
        ctx_mask = (jnp.arange(S)[None, None] < cache.lengths[:, None, None])
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)
        drafted_k, drafted_v, drafted_mask = extra
        kw = dict(residual=feature[:, None]) if self.concat else {}
        x, (k, v) = self.layers[0](x, pos, inv_freq, cache.k[0], cache.v[0], ctx_mask,
                                   jnp.ones((token.shape[0], 1, 1), bool),
                                   (drafted_k, drafted_v, drafted_mask[:, None, :]), **kw)
        return x[:, 0], self.final_norm(x)[:, 0], (k[:, :, 0], v[:, :, 0])
