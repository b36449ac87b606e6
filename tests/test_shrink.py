"""train/shrink.py: a DSpark drafter's Markov head moved to a draft vocabulary and cut to a lower rank. The cut is
the best one (the truncated SVD of the weighted product), exact when the rank is not really lowered, keeps the
confidence head's reading of W1[x] in the least-squares sense, and the result drafts losslessly."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf
from flax import nnx

import dspark_jax
from train.shrink import move_markov_vocab, shrink, truncate_markov

SUBSET = tuple(range(0, 128, 3)) + (2,)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return target_from_hf(make_hf_model("llama", tied=True), tmp_path_factory.mktemp("llama"))


def _heads(seed=0, rows=41, R=12, V=40, rank=None):
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(rows, R if rank is None else rank)).astype(np.float32)
    w2 = rng.normal(size=(R if rank is None else rank, V)).astype(np.float32)
    if rank is not None:  # a rank-`rank` product written with R columns
        mix = rng.normal(size=(rank, R)).astype(np.float32)
        w1, w2 = w1 @ mix, np.linalg.pinv(mix) @ w2
    return w1, w2, rng.normal(size=w1.shape[1]).astype(np.float32), rng.uniform(0, 5, size=rows)


def test_full_rank_and_a_low_rank_product_are_kept_exactly():
    for w1, w2, w_e, d in [_heads(), _heads(seed=1, rank=5)]:
        rank = 12 if np.linalg.matrix_rank(w1 @ w2) == 12 else 5
        cut = truncate_markov(w1, w2, w_e, rank, d)
        assert cut["w1"].shape == (41, rank) and cut["w2"].shape == (rank, 40)
        np.testing.assert_allclose(cut["w1"] @ cut["w2"], w1 @ w2, atol=2e-4)
        np.testing.assert_allclose(cut["w1"] @ cut["w_e"] + cut["bias_shift"], w1 @ w_e, atol=2e-4)
        assert cut["kept_energy"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_cut_is_the_best_rank_r_product_and_the_confidence_weights_the_best_fit(weighted):
    w1, w2, w_e, d = _heads(seed=2)
    d = d if weighted else np.ones(len(d))
    cut = truncate_markov(w1, w2, w_e, 4, d if weighted else None)
    m = d[:, None] * (w1.astype(np.float64) @ w2)
    s = np.linalg.svd(m, compute_uv=False)
    err = np.linalg.norm(d[:, None] * (cut["w1"].astype(np.float64) @ cut["w2"]) - m)
    assert err == pytest.approx(np.sqrt(np.sum(s[4:] ** 2)), rel=1e-4)  # Eckart–Young: nothing does better
    assert cut["kept_energy"] == pytest.approx(np.sum(s[:4] ** 2) / np.sum(s**2), rel=1e-6)
    a = d[:, None] * cut["w1"].astype(np.float64)
    best, *_ = np.linalg.lstsq(a, d * (w1 @ w_e), rcond=None)
    np.testing.assert_allclose(cut["w_e"], best, rtol=1e-3, atol=1e-4)
    lost = w1 @ w_e - cut["w1"] @ cut["w_e"]
    assert cut["bias_shift"] == pytest.approx(np.sum(d**2 * lost) / np.sum(d**2), rel=1e-4, abs=1e-6)
    with pytest.raises(ValueError, match="rank"):
        truncate_markov(w1, w2, w_e, 13)


def test_moving_the_vocabulary_keeps_each_kept_tokens_row_and_column():
    w1, w2, _, _ = _heads(rows=20, V=20)
    a, b = (0, 3, 5, 9, 12), (3, 4, 9, 12, 17)
    v1, v2 = move_markov_vocab(w1[:6], w2[:, :5], 20, a, b)  # source rows: a's 5 tokens + its shared row
    assert v1.shape == (6, 12) and v2.shape == (12, 5)
    for j, t in enumerate(b):
        if t in a:
            np.testing.assert_array_equal(v1[j], w1[a.index(t)])
            np.testing.assert_array_equal(v2[:, j], w2[:, a.index(t)])
        else:  # new to the subset: read with the source's shared row, no bias yet
            np.testing.assert_array_equal(v1[j], w1[5])
            assert not v2[:, j].any()
    f1, f2 = move_markov_vocab(w1, w2, 20, (), b)  # from the whole vocabulary: shared row = mean of the rest
    np.testing.assert_allclose(f1[-1], w1[[t for t in range(20) if t not in b]].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(f2, w2[:, list(b)])


def _source(tiny, tmp_path, **over):
    d = dspark_jax.init_drafter(tiny, kind="dspark", block_size=4, seed=3, num_layers=1, markov_rank=8, **over)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
    for i, (k, v) in enumerate(sorted(flat.items())):  # a drafter with every parameter non-trivial
        flat[k] = v + 0.3 * jax.random.normal(jax.random.fold_in(jax.random.key(4), i), v.shape, v.dtype)
    nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    d.save(str(tmp_path / "src"))
    return dspark_jax.load_drafter(str(tmp_path / "src"), tiny, dtype=jnp.float32)


def test_shrink_moves_and_cuts_a_drafter_that_still_drafts_losslessly(tiny, tmp_path, monkeypatch):
    from dspark_jax import target as target_module
    from train.__main__ import main

    src = _source(tiny, tmp_path)
    same, report = shrink(str(tmp_path / "src"), tiny, draft_vocab=SUBSET)
    m0, m1 = src.module(), same.module()
    idx = [list(range(128)).index(t) for t in sorted(SUBSET)]
    np.testing.assert_array_equal(np.asarray(m1.markov_w2[...]), np.asarray(m0.markov_w2[...])[:, idx])
    for name in ("fc", "conf_w", "conf_b", "mask_embed"):
        np.testing.assert_array_equal(np.asarray(getattr(m1, name)[...]), np.asarray(getattr(m0, name)[...]))
    assert report["draft_vocab"] == {"from": 128, "to": len(SUBSET)} and "kept_energy" not in report

    counts = np.arange(128, dtype=np.int64)
    cut, report = shrink(str(tmp_path / "src"), tiny, draft_vocab=SUBSET, markov_rank=3, counts=counts)
    assert cut.config.markov_rank == 3 and cut.config.draft_vocab == tuple(sorted(SUBSET))
    assert 0 < report["kept_energy"] < 1 and report["params"]["to"] < report["params"]["from"]
    m = cut.module()
    assert m.markov_w1[...].shape == (len(SUBSET) + 1, 3) and m.conf_w[...].shape == (tiny.config.hidden_size + 3,)

    monkeypatch.setattr(target_module, "load_target", lambda spec: tiny)  # a tiny model has no tokenizer
    code = main(["shrink", str(tmp_path / "src"), str(tmp_path / "out"), "--target", str(tiny.source),
                 "--markov-rank", "3"])
    assert code == 0
    saved = json.load(open(tmp_path / "out" / "drafter_config.json"))
    assert saved["markov_rank"] == 3 and not saved["draft_vocab"]
    loaded = dspark_jax.load_drafter(str(tmp_path / "out"), tiny)
    prompts = [[5, 9, 17, 33, 2 + i, 70] for i in range(3)] + [[100, 3, 40]]
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=12, temperature=0.0, ignore_eos=True).tokens
    for d in (loaded, cut):
        got = dspark_jax.generate(tiny, prompts, d, max_new_tokens=12, temperature=0.0, ignore_eos=True)
        assert got.tokens == want


def test_shrink_refuses_what_it_cannot_cut(tiny, tmp_path, monkeypatch):
    from dspark_jax import target as target_module
    from train.__main__ import main

    eagle = dspark_jax.init_drafter(tiny, kind="eagle3", block_size=3, seed=0, num_layers=1)
    eagle.save(str(tmp_path / "eagle"))
    with pytest.raises(ValueError, match="Markov head"):
        shrink(str(tmp_path / "eagle"), tiny, markov_rank=2)
    _source(tiny, tmp_path)
    monkeypatch.setattr(target_module, "load_target", lambda spec: tiny)
    assert main(["shrink", str(tmp_path / "src"), str(tmp_path / "x"), "--target", str(tiny.source),
                 "--markov-rank", "9"]) == 2  # above the source's rank 8: a clear error, no file
    assert not (tmp_path / "x").exists()


def test_init_from_a_lower_rank_computes_the_same_head_with_room_to_train(tiny, tmp_path):
    """`drafter.init_from` may start a higher-rank run (`widen_markov`): the Markov bias and the confidence logit
    are the source's for every previous token, and the new W1 columns are non-zero so the new W2 rows train."""
    import dataclasses

    from dspark_jax.drafter import Drafter
    from dspark_jax.drafter_model import DrafterModel
    from train.fit import _to_state, init_from_params

    src = _source(tiny, tmp_path, draft_vocab=tuple(sorted(SUBSET)))
    cfg = dataclasses.replace(src.config, markov_rank=20)
    abstract = Drafter(cfg, nnx.eval_shape(lambda: DrafterModel(cfg, rngs=nnx.Rngs(0))))
    wide = abstract.with_params(_to_state(abstract, init_from_params(str(tmp_path / "src"),
                                                                     nnx.to_pure_dict(abstract.params), cfg, tiny)))
    a, b = src.module(), wide.module()
    prev = jnp.asarray([0, 2, 3, 4, 9, 127], jnp.int32)  # in the subset and outside it
    h = jax.random.normal(jax.random.key(2), (len(prev), tiny.config.hidden_size))
    out = []
    for m, R in ((a, 8), (b, 20)):
        e = m.markov_embedding(prev)
        out.append((m.sequential_bias(e, h, jnp.zeros((len(prev), R)))[0], m.confidence_logit(h, e)))
    for x, y in zip(out[0], out[1], strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    assert np.asarray(b.markov_w1[...])[:, 8:].std() > 0.01
    assert not np.asarray(b.markov_w2[...])[8:].any()
    narrow = dataclasses.replace(src.config, markov_rank=4)
    abstract = Drafter(narrow, nnx.eval_shape(lambda: DrafterModel(narrow, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match="markov_rank"):
        init_from_params(str(tmp_path / "src"), nnx.to_pure_dict(abstract.params), narrow, tiny)
