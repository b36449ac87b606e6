"""Many anchors per sequence over one shared context (train/losses.py's packed block pass, the paper's
anchor-bounded packing): against the per-anchor reference layout, per-anchor losses, and the attention mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf

import dspark_jax
from dspark_jax.drafter_model import TargetHead
from train.losses import LossWeights, context_cache, drafter_loss, packed_block_hidden


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return target_from_hf(make_hf_model("llama", tied=True), tmp_path_factory.mktemp("llama"))


def _batch(target, S=3, T=40, A=6, L=4, seed=0, full_blocks=False):
    """Random sequences, their target features, and anchors (all L slots inside the sequence if full_blocks)."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, 128, size=(S, T)), jnp.int32)
    lengths = jnp.asarray(rng.integers(T // 2, T + 1, size=S), jnp.int32)
    hi = lengths - (L + 1 if full_blocks else 1)
    anchors = jnp.asarray(np.stack([rng.integers(1, int(h), size=A) for h in hi]), jnp.int32)
    return tokens, lengths, anchors


def _feats(target, tokens, layers):
    h, _, feats = target.forward(tokens, target.init_cache(*tokens.shape), hidden_layers=layers,
                                 compute_logits=False)
    return h, feats


def _drafter(target, kind, L=4):
    extra = dict(markov_rank=8) if kind.startswith("dspark") else {}
    if "+context_tokens" in kind:  # each context entry carries the token after it
        kind = kind.replace("+context_tokens", "")
        extra.update(context_tokens=True)
    if "+anchor_feature" in kind:  # H_ctx[n−1] joins the anchor slot's input ("…:mode": how, anchor_mode)
        kind, _, mode = kind.partition("+anchor_feature")
        extra.update(anchor_feature=True, anchor_mode=mode.lstrip(":") or "add")
    d = dspark_jax.init_drafter(target, kind=kind, block_size=L, num_layers=2, seed=1, **extra)
    # Perturb every parameter (W2 and the confidence head start at zero) so nothing is trivially equal.
    leaves, tree = jax.tree.flatten(d.params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    return d.with_params(jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                                   for x, k in zip(leaves, keys, strict=True)]))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "dflash_anchor_predicts", "dspark+anchor_feature",
                                  "dspark+anchor_feature:residual", "dspark+anchor_feature:fused",
                                  "dspark+context_tokens", "dflash+context_tokens+anchor_feature"])
def test_packed_blocks_equal_the_per_anchor_layout(tiny, kind):
    if kind == "dflash_anchor_predicts":  # DFlash in DeepSpec's form: anchor + L−1 masks, the anchor slot predicts
        d = dspark_jax.init_drafter(tiny, kind="dflash", block_size=4, num_layers=2, seed=1, anchor_predicts=True)
        d = d.with_params(_drafter(tiny, "dflash").params)  # the same parameter shapes, perturbed
    else:
        d = _drafter(tiny, kind)
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, lengths, anchors = _batch(tiny)
    _, feats = _feats(tiny, tokens, d.config.target_layers)
    packed = packed_block_hidden(model, head, tokens, feats, anchors)
    cache = context_cache(model, head, tokens, feats, anchors)
    flat = anchors.reshape(-1)
    ref = model.block_hidden(head, cache, jnp.take_along_axis(tokens, anchors, 1).reshape(-1), flat)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(ref), atol=2e-5)
    # Inference's own cache (the prompt's prefill, committed = the anchor) drafts the first anchor's block alike.
    n = anchors[:, 0]
    served = model.write_prompt(model.init_cache(*tokens.shape), head, tokens, feats, n)
    own = model.block_hidden(head, served, jnp.take_along_axis(tokens, n[:, None], 1)[:, 0], n)
    np.testing.assert_allclose(np.asarray(packed.reshape(anchors.shape + packed.shape[1:])[:, 0]), np.asarray(own),
                               atol=2e-5)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "dspark+anchor_feature", "dspark+anchor_feature:fused",
                                  "dspark+context_tokens"])
def test_packed_loss_and_gradients_equal_the_reference(tiny, kind):
    d = _drafter(tiny, kind)
    head = TargetHead.from_params(tiny.params, True)
    tokens, lengths, anchors = _batch(tiny, seed=1)
    hidden, feats = _feats(tiny, tokens, d.config.target_layers)
    w = LossWeights.for_kind(d.config.kind) if kind != "dflash" else LossWeights(ce=0.5, tv=0.5, conf=0.0)

    def loss(params, packed):
        from flax import nnx

        return drafter_loss(nnx.merge(d.graphdef, params), head, tokens, lengths, anchors, hidden, feats, w,
                            packed=packed)

    (lp, mp), gp = jax.value_and_grad(loss, has_aux=True)(d.params, True)
    (lr, mr), gr = jax.value_and_grad(loss, has_aux=True)(d.params, False)
    np.testing.assert_allclose(float(lp), float(lr), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mp["acceptance"]), np.asarray(mr["acceptance"]), atol=1e-5)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gr), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_loss_of_many_anchors_is_the_mean_of_single_anchor_losses(tiny):
    """With every block slot valid, each anchor carries the same total weight, so the A-anchor loss is the
    mean of the A one-anchor losses computed separately."""
    d = _drafter(tiny, "dspark")
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, lengths, anchors = _batch(tiny, S=2, A=5, seed=2, full_blocks=True)
    hidden, feats = _feats(tiny, tokens, d.config.target_layers)
    w = LossWeights()
    together, _ = drafter_loss(model, head, tokens, lengths, anchors, hidden, feats, w)
    singles = [drafter_loss(model, head, tokens[s : s + 1], lengths[s : s + 1], anchors[s : s + 1, a : a + 1],
                            hidden[s : s + 1], feats[s : s + 1], w)[0]
               for s in range(anchors.shape[0]) for a in range(anchors.shape[1])]
    np.testing.assert_allclose(float(together), float(np.mean(singles)), rtol=1e-5)


def test_a_block_sees_only_its_prefix_and_its_own_block(tiny):
    """Changing the context at or after anchor n, or another anchor's block, leaves anchor n's block unchanged."""
    d = _drafter(tiny, "dspark")
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, _, _ = _batch(tiny, S=1, T=40)
    anchors = jnp.array([[10, 25, 30]], jnp.int32)
    _, feats = _feats(tiny, tokens, d.config.target_layers)
    base = packed_block_hidden(model, head, tokens, feats, anchors)
    noisy = feats.at[:, 10:].add(jax.random.normal(jax.random.key(0), feats[:, 10:].shape))
    after = packed_block_hidden(model, head, tokens, noisy, anchors)
    np.testing.assert_allclose(np.asarray(after[0]), np.asarray(base[0]), atol=1e-6)  # anchor 10: positions < 10
    assert not np.allclose(np.asarray(after[1]), np.asarray(base[1]), atol=1e-3)  # anchor 25 reads 10..24
    moved = packed_block_hidden(model, head, tokens, feats, jnp.array([[10, 20, 35]], jnp.int32))
    np.testing.assert_allclose(np.asarray(moved[0]), np.asarray(base[0]), atol=1e-6)


def test_many_anchors_fit_in_memory_without_repeating_the_context(tiny):
    """512 anchors per sequence (DeepSpec's packing) compile to a step whose temporaries stay small: no [S·A, T]
    context copy (here: under 64 MB at T=128, where the per-anchor layout would need the context 512 times)."""
    d = _drafter(tiny, "dspark")
    head = TargetHead.from_params(tiny.params, True)
    S, T, A = 2, 128, 512
    tokens = jnp.zeros((S, T), jnp.int32)
    feats = jnp.zeros((S, T, len(d.config.target_layers) * tiny.config.hidden_size))
    anchors = jnp.broadcast_to(jnp.arange(1, T - 1).repeat(5)[:A], (S, A)).astype(jnp.int32)
    fn = jax.jit(lambda p: packed_block_hidden(__import__("flax").nnx.merge(d.graphdef, p), head, tokens, feats,
                                               anchors))
    mem = fn.lower(d.params).compile().memory_analysis()
    if mem is None:
        pytest.skip("no memory analysis on this backend")
    assert mem.temp_size_in_bytes < 64 * 2**20, mem.temp_size_in_bytes
    assert fn(d.params).shape == (S * A, 4, tiny.config.hidden_size)


def test_anchors_are_distinct_and_dummies_are_masked(tiny):
    """window_and_anchors draws distinct anchors (DeepSpec's sampler); a short window pads with masked dummies,
    which change nothing in the loss."""
    from train.data import window_and_anchors

    rng = np.random.default_rng(0)
    rec = {"tokens": np.arange(1, 101, dtype=np.int32), "prompt_len": 20}
    ex = window_and_anchors(rec, rng, 64, 16)
    assert ex["anchor_mask"].all() and len(set(ex["anchors"].tolist())) == 16
    short = window_and_anchors({"tokens": np.arange(1, 13, dtype=np.int32), "prompt_len": 5}, rng, 64, 16)
    n_real = int(short["anchor_mask"].sum())
    assert n_real == 7 and sorted(short["anchors"][:n_real].tolist()) == list(range(4, 11))  # 4 = prompt_len − 1

    d = _drafter(tiny, "dspark")
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, lengths, anchors = _batch(tiny, S=2, A=4, seed=5)
    hidden, feats = _feats(tiny, tokens, d.config.target_layers)
    mask = jnp.array([[True, True, False, False], [True, False, False, False]])
    dummy = jnp.where(mask, anchors, anchors[:, :1])
    w = LossWeights()
    masked, _ = drafter_loss(model, head, tokens, lengths, dummy, hidden, feats, w, anchor_mask=mask)
    # Equal to the loss over the three real anchors alone, each as its own one-anchor sequence.
    ref, _ = drafter_loss(model, head, jnp.stack([tokens[0], tokens[0], tokens[1]]),
                          jnp.stack([lengths[0], lengths[0], lengths[1]]),
                          jnp.array([[anchors[0, 0]], [anchors[0, 1]], [anchors[1, 0]]]),
                          jnp.stack([hidden[0], hidden[0], hidden[1]]), jnp.stack([feats[0], feats[0], feats[1]]), w)
    np.testing.assert_allclose(float(masked), float(ref), rtol=1e-5)
