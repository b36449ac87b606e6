"""The training A/B switches, each off by default: per-layer RMSNorm of the target features before `fc`
(`DrafterConfig.feature_norm`), DeepSpec's position decay γ (`optim.loss.gamma`), and a fourth target feature
(the last layer, through `target_layers`), how H_ctx[n−1] joins the anchor slot (`anchor_mode`), and context
entries that carry the token after them (`context_tokens`). Oracles: a
naive numpy projection, hand-computed weights, save/load round trips and greedy equality with target-only
decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf
from flax import nnx

import dspark_jax
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterModel
from train.config import load_config
from train.fit import _to_state, loss_weights
from train.losses import LossWeights, position_weights


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return target_from_hf(make_hf_model("llama", tied=True), tmp_path_factory.mktemp("llama"))


def test_feature_norm_normalises_each_layer_before_fc(target):
    cfg = DrafterConfig.for_target(target.config, kind="dspark", block_size=3, num_layers=1, markov_rank=8,
                                   feature_norm=True)
    model = DrafterModel(cfg, rngs=nnx.Rngs(0))
    m, D = len(cfg.target_layers), cfg.hidden_size
    scale = np.random.default_rng(1).normal(1.0, 0.3, (m, D)).astype(np.float32)
    model.feature_norm[...] = jnp.asarray(scale)
    # Layers of very different sizes, as SmolLM2's layer 1 against 15 and 27.
    feats = np.random.default_rng(2).normal(size=(2, 5, m, D)).astype(np.float32) * np.array([0.02, 1.0, 3.0][:m])[
        :, None]
    x = feats / np.sqrt((feats.astype(np.float64) ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    h = (x * scale).reshape(2, 5, m * D) @ np.asarray(model.fc[...])
    want = h / np.sqrt((h**2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(model.ctx_norm.scale[...])
    got = model.project_features(jnp.asarray(feats.reshape(2, 5, m * D)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    # Off (the default) there is no such parameter: existing checkpoints load unchanged.
    plain = DrafterModel(DrafterConfig.for_target(target.config, kind="dspark", block_size=3, num_layers=1),
                         rngs=nnx.Rngs(0))
    assert not hasattr(plain, "feature_norm") and "feature_norm" not in nnx.to_pure_dict(nnx.state(plain))


def test_feature_norm_and_last_layer_drafter_round_trips_and_stays_lossless(target, tmp_path):
    last = target.config.num_layers - 1
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=3, num_layers=1, markov_rank=8, seed=3,
                                      feature_norm=True, target_layers=(0, 1, last))
    state = nnx.to_pure_dict(drafter.params)
    state["feature_norm"] = np.random.default_rng(4).normal(1.0, 0.5, np.shape(state["feature_norm"]))
    drafter = drafter.with_params(_to_state(drafter, state))
    drafter.save(str(tmp_path / "d"))
    loaded = dspark_jax.load_drafter(str(tmp_path / "d"), target)
    assert loaded.config.feature_norm and loaded.config.target_layers == (0, 1, last)
    np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(loaded.params)["feature_norm"]),
                                  np.asarray(state["feature_norm"], np.float32))
    prompts = [[5, 9, 17, 3], [11, 4, 8, 30, 2, 7]]
    ref = dspark_jax.generate(target, prompts, max_new_tokens=12, ignore_eos=True)
    spec = dspark_jax.generate(target, prompts, loaded, max_new_tokens=12, ignore_eos=True)
    assert spec.tokens == ref.tokens


def test_position_decay_gamma():
    np.testing.assert_allclose(np.asarray(position_weights(7)), np.exp(-np.arange(7) / 7), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(position_weights(7, 4.0)), np.exp(-np.arange(7) / 4), rtol=1e-6)
    # optim.loss keys replace the kind's recipe one by one.
    cfg = load_config(None, ["optim.loss={gamma: 4}"])
    assert loss_weights(cfg, "dspark") == LossWeights(ce=0.1, tv=0.9, conf=1.0, gamma=4.0)
    assert loss_weights(cfg, "eagle3") == LossWeights(ce=0.0, tv=0.0, conf=0.0, kl=1.0, gamma=4.0)
    assert loss_weights(load_config(None, []), "dflash") == LossWeights.for_kind("dflash")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(None, ["optim.loss={decay: 4}"])
    with pytest.raises(ValueError, match="gamma"):
        load_config(None, ["optim.loss={gamma: -1}"])


@pytest.mark.parametrize("mode", ["add", "residual", "fused"])
def test_anchor_mode_joins_the_last_feature_as_documented(target, mode):
    cfg = DrafterConfig.for_target(target.config, kind="dspark", block_size=3, num_layers=1, markov_rank=8,
                                   anchor_feature=True, anchor_mode=mode)
    model = DrafterModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    model.anchor_fc[...] = jnp.asarray(rng.normal(0, 0.1, model.anchor_fc.shape).astype(np.float32))
    head = dspark_jax.drafter_model.TargetHead.from_params(target.params, True)
    anchor = jnp.asarray([3, 17], jnp.int32)
    f = rng.normal(size=(2, cfg.hidden_size)).astype(np.float32)
    e = np.asarray(head.embed)[np.asarray(anchor)]
    A = np.asarray(model.anchor_fc[...])
    normed = e / np.sqrt((e.astype(np.float64) ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    if mode == "fused":
        want = np.concatenate([normed, f], -1) @ A
    else:
        want = (normed + f if mode == "residual" else e) + f @ A
    got = model.anchor_input(head, anchor, jnp.asarray(f))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", [dict(anchor_feature=True, anchor_mode="residual"),
                                     dict(anchor_feature=True, anchor_mode="fused"), dict(context_tokens=True)])
def test_anchor_and_context_options_round_trip_and_stay_lossless(target, tmp_path, options):
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=3, num_layers=2, markov_rank=8, seed=3,
                                      **options)
    pure = nnx.to_pure_dict(drafter.params)
    new = [name for name in ("anchor_fc", "context_token_fc") if name in pure]
    for name in new:  # not zero (where they start): the round trip must carry them
        pure[name] = pure[name] + 0.05
    nnx.replace_by_pure_dict(drafter.params, pure)
    drafter.save(str(tmp_path / "d"))
    loaded = dspark_jax.load_drafter(str(tmp_path / "d"), target)
    assert {k: getattr(loaded.config, k) for k in options} == options
    for name in new:
        np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(loaded.params)[name]), np.asarray(pure[name]))
    prompts = [[5, 9, 17, 3], [11, 4, 8, 30, 2, 7]]
    ref = dspark_jax.generate(target, prompts, max_new_tokens=12, ignore_eos=True)
    spec = dspark_jax.generate(target, prompts, loaded, max_new_tokens=12, ignore_eos=True)
    assert spec.tokens == ref.tokens


@pytest.mark.parametrize("mode", ["residual", "add"])
def test_init_from_starts_a_fused_drafter_from_an_add_or_residual_one(target, tmp_path, mode):
    """`drafter.init_from` may move a drafter to `anchor_mode: fused`: from residual the anchor input is the
    source's exactly; from add it is for an embedding row whose RMS is the rows' mean (elsewhere it is scaled
    by that ratio); every other parameter is the source's. fused back to add is refused."""
    import dataclasses

    from dspark_jax.drafter import Drafter
    from train.fit import init_from_params

    src = dspark_jax.init_drafter(target, kind="dspark", block_size=3, num_layers=1, markov_rank=8, seed=3,
                                  anchor_feature=True, anchor_mode=mode)
    pure = nnx.to_pure_dict(src.params)
    rng = np.random.default_rng(6)
    pure["anchor_fc"] = rng.normal(0, 0.1, np.shape(pure["anchor_fc"])).astype(np.float32)
    if mode == "residual":
        pure["anchor_norm"]["scale"] = rng.normal(1, 0.2, np.shape(pure["anchor_norm"]["scale"])).astype(np.float32)
    nnx.replace_by_pure_dict(src.params, pure)
    src.save(str(tmp_path / "src"))
    src = dspark_jax.load_drafter(str(tmp_path / "src"), target, dtype=jnp.float32)  # the saved (rounded) weights

    def abstract_for(cfg):
        return Drafter(cfg, nnx.eval_shape(lambda: DrafterModel(cfg, rngs=nnx.Rngs(0))))

    cfg = dataclasses.replace(src.config, anchor_mode="fused")
    abstract = abstract_for(cfg)
    moved = abstract.with_params(_to_state(abstract, init_from_params(str(tmp_path / "src"), nnx.to_pure_dict(
        abstract.params), cfg, target)))
    head = dspark_jax.drafter_model.TargetHead.from_params(target.params, True)
    embed = np.asarray(head.embed, np.float64)
    rms = np.sqrt((embed**2).mean(-1))
    anchor = jnp.arange(embed.shape[0], dtype=jnp.int32)
    f = jnp.asarray(rng.normal(size=(embed.shape[0], cfg.hidden_size)).astype(np.float32))
    want = np.asarray(src.module().anchor_input(head, anchor, f))
    got = np.asarray(moved.module().anchor_input(head, anchor, f))
    if mode == "add":  # e + f·A against (r / rms(e))·e + f·A: equal where rms(e) = r, off by the ratio elsewhere
        fa = np.asarray(f) @ np.asarray(src.module().anchor_fc[...])
        want = fa + (want - fa) * (rms.mean() / np.sqrt(rms**2 + cfg.rms_norm_eps))[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    theirs, mine = nnx.to_pure_dict(src.params), nnx.to_pure_dict(moved.params)
    for name in ("fc", "mask_embed", "markov_w1", "conf_w"):
        np.testing.assert_array_equal(np.asarray(mine[name]), np.asarray(theirs[name]))
    back = dataclasses.replace(src.config, anchor_mode="add")
    moved.save(str(tmp_path / "fused"))
    with pytest.raises(ValueError, match="anchor_mode"):
        init_from_params(str(tmp_path / "fused"), nnx.to_pure_dict(abstract_for(back).params), back, target)


def test_anchor_mode_needs_the_anchor_feature(target):
    with pytest.raises(ValueError, match="needs anchor_feature"):
        DrafterConfig.for_target(target.config, kind="dspark", anchor_mode="fused")
    with pytest.raises(ValueError, match="unknown anchor_mode"):
        DrafterConfig.for_target(target.config, kind="dspark", anchor_feature=True, anchor_mode="sum")


def test_context_tokens_pair_each_entry_with_the_next_token(target):
    cfg = DrafterConfig.for_target(target.config, kind="dspark", block_size=3, num_layers=1, markov_rank=8,
                                   context_tokens=True)
    model = DrafterModel(cfg, rngs=nnx.Rngs(0))
    assert not np.asarray(model.context_token_fc[...]).any()  # W starts at zero: entries start as H_ctx alone
    rng = np.random.default_rng(6)
    model.context_token_fc[...] = jnp.asarray(rng.normal(0, 0.1, model.context_token_fc.shape).astype(np.float32))
    head = dspark_jax.drafter_model.TargetHead.from_params(target.params, True)
    nxt = jnp.asarray([[3, 17, 40]], jnp.int32)
    h = rng.normal(size=(1, 3, cfg.hidden_size)).astype(np.float32)
    e = np.asarray(head.embed)[np.asarray(nxt)]
    normed = e / np.sqrt((e.astype(np.float64) ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    got = model.context_entry(head, nxt, jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(got), h + normed @ np.asarray(model.context_token_fc[...]), rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(ValueError, match="needs the token after each context entry"):
        model.context_entry(head, None, jnp.asarray(h))


def test_context_tokens_are_for_block_drafters(target):
    with pytest.raises(ValueError, match="context_tokens applies to block drafters"):
        DrafterConfig.for_target(target.config, kind="eagle3", num_layers=1, context_tokens=True)


def test_markov_init_std_scales_only_w1(target):
    """`drafter.markov_init_std`: a fresh run's Markov W1 drawn N(0, σ²) (the network's own draw, rescaled);
    every other parameter as without it."""
    from train.fit import init_params

    cfg = DrafterConfig.for_target(target.config, kind="dspark", block_size=3, num_layers=1, markov_rank=64)
    base, wide = init_params(cfg, 5), init_params(cfg, 5, markov_init_std=0.16)
    np.testing.assert_allclose(np.asarray(wide["markov_w1"]), 8.0 * np.asarray(base["markov_w1"]), rtol=1e-6)
    assert float(np.std(np.asarray(wide["markov_w1"]))) == pytest.approx(0.16, rel=0.05)
    from dspark_jax.drafter import param_key

    flat = {param_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(wide)[0]}
    others = [(param_key(p), x) for p, x in jax.tree_util.tree_flatten_with_path(base)[0]]
    assert len(others) > 10 and len(flat) == len(others)
    for k, x in others:
        if k != "markov_w1":
            np.testing.assert_array_equal(np.asarray(flat[k]), np.asarray(x), err_msg=k)
    assert load_config(None, ["drafter.markov_init_std=0.16"]).drafter.markov_init_std == 0.16
