"""A reduced draft vocabulary (dspark_jax/draft_vocab.py, train/vocab.py): training logits against the inference
draft distribution, q exactly zero outside the subset, greedy speculative output equal to target-only output,
the loss against a naive full-vocabulary reference, and the frequency selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf
from flax import nnx

import dspark_jax
from dspark_jax import draft_vocab
from dspark_jax.drafter import draft_block
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import TargetHead
from train.losses import (
    LossWeights,
    _dspark_logits_from_hidden,
    _eagle_logits,
    context_cache,
    drafter_loss,
    packed_block_hidden,
)
from train.vocab import select

SUBSET = tuple(range(0, 128, 3)) + (2,)  # 44 of the tiny model's 128 tokens, EOS (2) among them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch

    hf = make_hf_model("llama", tied=True)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)
    return target_from_hf(hf, tmp_path_factory.mktemp("llama"))


def _drafter(target, kind, L=4, scramble=0.5, vocab=SUBSET):
    over = {"num_layers": 1 if kind == "eagle3" else 2, "draft_vocab": tuple(sorted(set(vocab)))}
    if kind == "dspark":
        over["markov_rank"] = 8
    d = dspark_jax.init_drafter(target, kind=kind, block_size=L, seed=7, **over)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
    for i, (k, v) in enumerate(sorted(flat.items())):
        flat[k] = v + scramble * jax.random.normal(jax.random.fold_in(jax.random.key(1), i), v.shape, v.dtype)
    nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    return d


def _batch(S=2, T=32, A=3, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, 128, size=(S, T)), jnp.int32)
    anchors = jnp.asarray(rng.integers(1, T - 6, size=(S, A)), jnp.int32)
    return tokens, jnp.full((S,), T, jnp.int32), anchors


def test_config_round_trips_and_rejects_bad_subsets(tiny):
    d = _drafter(tiny, "dspark")
    cfg = d.config
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg and draft_vocab.size(cfg) == len(set(SUBSET))
    assert d.module().markov_w2[...].shape == (8, len(set(SUBSET)))
    assert d.module().markov_w1[...].shape == (len(set(SUBSET)) + 1, 8)  # + the shared out-of-subset row
    for bad in [(5, 3), (1, 1), (0, 128)]:
        with pytest.raises(ValueError, match="draft_vocab"):
            DrafterConfig.for_target(tiny.config, draft_vocab=bad)
    full = DrafterConfig.for_target(tiny.config)
    assert full.draft_vocab == () and draft_vocab.size(full) == 128


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_training_logits_equal_the_inference_draft_and_q_is_zero_outside(tiny, kind):
    d = _drafter(tiny, kind)
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, _, anchors = _batch()
    S, A = anchors.shape
    _, _, feats = tiny.forward(tokens, tiny.init_cache(*tokens.shape), hidden_layers=d.config.target_layers)
    n = anchors.reshape(-1)
    prev = jnp.take_along_axis(jnp.repeat(tokens, A, axis=0), n[:, None] + jnp.arange(4)[None], axis=1)
    if kind == "eagle3":
        logits = _eagle_logits(model, head, context_cache(model, head, tokens, feats, anchors), prev)
    else:
        logits, _ = _dspark_logits_from_hidden(model, head, packed_block_hidden(model, head, tokens, feats, anchors),
                                               prev)
    assert logits.shape[-1] == len(set(SUBSET))
    cache = context_cache(model, head, tokens, feats, anchors)
    ones = jnp.ones((S * A,), jnp.float32)
    toks, q, _ = draft_block(d.graphdef, d.params, head, cache, prev[:, 0], jax.random.split(jax.random.key(0), S * A),
                             ones, jnp.zeros((S * A,), jnp.int32), ones, "reference")
    assert q.shape == (S * A, 4, 128)
    inside = np.zeros(128, bool)
    inside[list(SUBSET)] = True
    q = np.asarray(q)
    assert np.all(q[..., ~inside] == 0.0)
    np.testing.assert_allclose(q[..., inside].sum(-1), 1.0, atol=1e-5)
    assert np.all(inside[np.asarray(toks)])  # drafted tokens are target ids inside the subset
    want = np.asarray(jax.nn.softmax(logits[:, 0]))
    np.testing.assert_allclose(q[:, 0][:, inside], want, atol=1e-5)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_greedy_speculative_output_equals_target_only(tiny, kind):
    d = _drafter(tiny, kind, scramble=0.2)
    prompts = [[5, 9, 17, 33, 2 + i, 70] for i in range(3)] + [[100, 3, 40]]
    want = dspark_jax.generate(tiny, prompts, max_new_tokens=16, temperature=0.0, ignore_eos=True).tokens
    got = dspark_jax.generate(tiny, prompts, d, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert got.tokens == want


def test_reduced_loss_equals_a_naive_full_vocabulary_reference(tiny):
    """TV over the subset plus the target's mass outside equals ‖scatter(p_d) − softmax(head(h))‖₁; the
    precomputed lse gives the same loss as the full head in the step; CE skips out-of-subset truths."""
    d = _drafter(tiny, "dflash")
    model, head = d.module(), TargetHead.from_params(tiny.params, True)
    tokens, lengths, anchors = _batch(seed=3)
    hidden, _, feats = tiny.forward(tokens, tiny.init_cache(*tokens.shape), hidden_layers=d.config.target_layers,
                                    compute_logits=False)
    w = LossWeights(ce=0.3, tv=0.7, conf=0.0)
    loss, m = drafter_loss(model, head, tokens, lengths, anchors, hidden, feats, w)
    lse = jax.nn.logsumexp(head.logits(hidden), axis=-1)
    loss2, _ = drafter_loss(model, head, tokens, lengths, anchors, hidden, feats, w, target_lse=lse)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)

    A = anchors.shape[1]
    n = anchors.reshape(-1)
    idx = n[:, None] + jnp.arange(4)[None]
    rows = jnp.repeat(tokens, A, axis=0)
    prev, truth = jnp.take_along_axis(rows, idx, 1), jnp.take_along_axis(rows, idx + 1, 1)
    logits, _ = _dspark_logits_from_hidden(model, head, packed_block_hidden(model, head, tokens, feats, anchors), prev)
    p_d = np.asarray(draft_vocab.to_vocab(jax.nn.softmax(logits), d.config))
    h_t = jnp.take_along_axis(jnp.repeat(hidden, A, axis=0), idx[..., None], 1)
    p_t = np.asarray(jax.nn.softmax(head.logits(h_t)))
    tv = np.abs(p_d - p_t).sum(-1)
    wk = np.exp(-np.arange(4) / 4)[None].repeat(len(n), 0)
    inside = np.isin(np.asarray(truth), SUBSET)
    ce = -np.log(np.take_along_axis(p_d, np.asarray(truth)[..., None], -1)[..., 0].clip(1e-30))
    want_tv = (wk * tv).sum() / wk.sum()
    want_ce = (wk * inside * ce).sum() / (wk * inside).sum()
    np.testing.assert_allclose(float(m["tv"]), want_tv, rtol=1e-5)
    np.testing.assert_allclose(float(m["ce"]), want_ce, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["acceptance"]), np.clip(1 - tv / 2, 0, 1).mean(0), atol=1e-5)


def test_select_takes_the_most_frequent_tokens_and_always_eos():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    ids, coverage = select(counts, 3, always=(6,))
    assert ids == (2, 3, 6)  # 6 forced; 2 and 3 (9 each, tie broken by id) before 5 (7)
    assert coverage == pytest.approx(18 / 34)
    assert select(counts, 8)[1] == 1.0
    with pytest.raises(ValueError, match="size"):
        select(counts, 0)


def test_fit_with_a_reduced_vocabulary_and_separate_features_resumes(tiny, tmp_path):
    """`fit` end to end as the fair configs run it: features under their own root, a shared draft-vocabulary
    file chosen from the data at the first start, a killed run resumed to the same losses, the saved drafter
    carrying its subset."""
    import json

    from train.config import load_config
    from train.features import featurize
    from train.fit import fit
    from train.prepare import encode_record, write_shards

    prompts = [list(np.random.default_rng(i).integers(3, 128, size=4 + i % 5)) for i in range(16)]
    res = dspark_jax.generate(tiny, prompts, max_new_tokens=30, temperature=1.0, seed=1, ignore_eos=True)
    data = tmp_path / "tokens"
    data.mkdir()
    write_shards([encode_record(p + r, len(p), "chat") for p, r in zip(prompts, res.tokens, strict=True)],
                 str(data), num_shards=2, seed=0)
    featurize(str(data), tiny, (0, 1, 2), out_root=str(tmp_path / "feats"), progress=False)
    shared = tmp_path / "vocab.json"

    def cfg(out):
        return load_config(None, [
            f"data.path={data}", "data.features=true", f"data.features_path={tmp_path / 'feats'}", "data.seq_len=32",
            "data.anchors_per_seq=6", "data.batch_sequences=2", "drafter.kind=dspark", "drafter.block_size=3",
            "drafter.overrides={num_layers: 1, markov_rank: 4, target_layers: [0, 1, 2]}",
            "drafter.draft_vocab_size=40", f"drafter.draft_vocab_file={shared}", f"run.out_dir={out}",
            "run.log_every=1", "run.ckpt_every=2", "run.async_checkpoint=false", "optim.steps=5", "optim.warmup=1"])

    straight = fit(cfg(tmp_path / "a"), target=tiny, progress=False)
    fit(cfg(tmp_path / "b"), target=tiny, stop_after=3, progress=False)
    fit(cfg(tmp_path / "b"), target=tiny, progress=False)
    ids = json.load(open(shared))["ids"]
    assert len(ids) == 40 and 2 in ids and straight.config.draft_vocab == tuple(ids)
    read = lambda d: [json.loads(ln)["loss"] for ln in open(d / "metrics.jsonl")]  # noqa: E731
    np.testing.assert_allclose(read(tmp_path / "b"), read(tmp_path / "a"), rtol=1e-6)
    loaded = dspark_jax.load_drafter(str(tmp_path / "b" / "drafter"), tiny)
    assert loaded.config.draft_vocab == tuple(ids)
    assert loaded.module().markov_w2[...].shape == (4, 40)


def test_init_from_moves_a_drafter_to_another_vocabulary(tiny, tmp_path):
    """`drafter.init_from` (train/fit.py's init_from_params): the backbone is the source's; the Markov head
    follows the tokens, so a token of both vocabularies gets the same draft logit after a previous token the
    two read alike, a token new to the subset its backbone logit alone (zero W2 column); any other config
    difference is refused."""
    import dataclasses

    from dspark_jax.drafter import Drafter
    from dspark_jax.drafter_model import DrafterModel
    from train.fit import _to_state, init_from_params

    src = _drafter(tiny, "dspark")
    src.save(str(tmp_path / "src"))
    src = dspark_jax.load_drafter(str(tmp_path / "src"), tiny, dtype=jnp.float32)  # the saved (rounded) weights
    a, head = set(SUBSET), TargetHead.from_params(tiny.params, True)
    tokens, _, anchors = _batch(seed=5)
    # Previous tokens that both vocabularies read alike: in both, or outside both (each side's shared row).
    alike = np.array([t for t in range(3, 128) if (t in a) == (t % 2 == 0)])
    tokens = jnp.asarray(np.random.default_rng(5).choice(alike, size=tokens.shape), jnp.int32)
    _, _, feats = tiny.forward(tokens, tiny.init_cache(*tokens.shape), hidden_layers=src.config.target_layers)
    n = anchors.reshape(-1)
    prev = jnp.take_along_axis(jnp.repeat(tokens, anchors.shape[1], axis=0), n[:, None] + jnp.arange(4)[None], axis=1)

    def logits(d):
        model = d.module()
        return np.asarray(_dspark_logits_from_hidden(model, head, packed_block_hidden(model, head, tokens, feats,
                                                                                      anchors), prev)[0])

    want = logits(src)
    for vocab in [tuple(sorted(set(range(0, 128, 2)))), ()]:  # another subset; the whole vocabulary
        cfg = dataclasses.replace(src.config, draft_vocab=vocab, calibration=(), calibration_offsets=())
        abstract = Drafter(cfg, nnx.eval_shape(lambda c=cfg: DrafterModel(c, rngs=nnx.Rngs(0))))
        moved = abstract.with_params(_to_state(abstract, init_from_params(str(tmp_path / "src"),
                                                                          nnx.to_pure_dict(abstract.params), cfg,
                                                                          tiny)))
        got = logits(moved)
        ids = list(vocab or range(128))
        for j, t in enumerate(ids):
            if t in a:
                np.testing.assert_allclose(got[..., j], want[..., sorted(a).index(t)], rtol=1e-5, atol=1e-5)
        new = [j for j, t in enumerate(ids) if t not in a]
        m = moved.module()
        assert new and np.all(np.asarray(m.markov_w2[...])[:, new] == 0)
        for name in ("fc", "mask_embed", "conf_w"):
            np.testing.assert_array_equal(np.asarray(getattr(m, name)[...]),
                                          np.asarray(getattr(src.module(), name)[...]))
    other = dataclasses.replace(src.config, markov_rank=4, draft_vocab=())
    abstract = nnx.to_pure_dict(Drafter(other, nnx.eval_shape(lambda: DrafterModel(other, rngs=nnx.Rngs(0)))).params)
    with pytest.raises(ValueError, match="markov_rank"):
        init_from_params(str(tmp_path / "src"), abstract, other, tiny)
