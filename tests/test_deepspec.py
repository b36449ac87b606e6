"""DeepSpec checkpoints (dspark_jax/deepspec.py) against DeepSpec's own PyTorch code as the oracle.

Replicas of the released checkpoints are built offline by DeepSpec itself: its `build_draft_config` over a tiny
random Qwen3 target, its model classes (random weights, perturbed), `initialize_embeddings_and_head` from the
target, and `save_pretrained` — so key names and config fields are exactly what DeepSpec writes. `propose`
is compared with DeepSpec's inference functions (`_forward_backbone`, `sample_draft_tokens`,
`predict_confidence_step`; EAGLE-3's `extend_draft_cache` and step loop, as its evaluator runs them).
DeepSpec's source is read from $DEEPSPEC_SRC (default ../shared/reference/deepspec beside the checkout); without it
the tests that need it fail, unless DSPARK_ALLOW_NO_DEEPSPEC=1 (printed) lets them skip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf
from flax import nnx

import dspark_jax
from dspark_jax import deepspec

DEEPSPEC_SRC = os.environ.get("DEEPSPEC_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                             "shared", "reference", "deepspec"))
LAYERS = [0, 1, 2, 3, 4]  # 5 target layers, as the released configs; never the last (HF norms that one)
L, MASK = 5, 127
PROMPTS = [[5, 17, 33, 9, 64, 3, 80, 41, 12], [7, 99, 23, 45, 11, 8]]

# DeepSpec model_args per replica (its config files' fields); "eagle3" uses the EAGLE-3 builder.
VARIANTS = {
    "dspark": dict(markov_rank=16, markov_head_type="vanilla", confidence_head_alpha=1.0,
                   confidence_head_with_markov=True),  # the released DSpark configs
    "dspark-gated-conf-h": dict(markov_rank=16, markov_head_type="gated", confidence_head_alpha=1.0,
                                confidence_head_with_markov=False),
    "dspark-rnn": dict(markov_rank=16, markov_head_type="rnn", confidence_head_alpha=1.0,
                       confidence_head_with_markov=True),
    "conf-only": dict(markov_rank=0, confidence_head_alpha=1.0, confidence_head_with_markov=False),
    "dflash": dict(markov_rank=0, confidence_head_alpha=0.0),  # the released DFlash configs
    "eagle3": None,
}


@pytest.fixture(autouse=True, scope="module")
def _f32_matmuls():
    """The 1e-4 comparisons are in f32: keep accelerators from running f32 matmuls as TF32/bf16 passes."""
    with jax.default_matmul_precision("highest"):
        yield


class Args(dict):
    """DeepSpec's model_args: both `"key" in args` and `args.key`."""

    __getattr__ = dict.__getitem__


# head_dim 32 (≠ hidden / heads = 16): a power of two, so the GPU Pallas kernels accept it too.
TINY = dict(num_hidden_layers=6, head_dim=32)


@pytest.fixture(scope="module")
def hf_target():
    return make_hf_model("qwen3", tied=False, seed=1, **TINY)


@pytest.fixture(scope="module")
def target(hf_target, tmp_path_factory):
    return target_from_hf(hf_target, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def ds():
    """DeepSpec's modules (its source on sys.path). Missing source fails, unless DSPARK_ALLOW_NO_DEEPSPEC=1 says
    (loudly) to skip: the oracle of these tests must not silently go away."""
    if not os.path.isdir(os.path.join(DEEPSPEC_SRC, "deepspec")):
        msg = f"DeepSpec source not found at {DEEPSPEC_SRC} (set DEEPSPEC_SRC)"
        if os.environ.get("DSPARK_ALLOW_NO_DEEPSPEC") == "1":
            print(f"SKIPPED (DSPARK_ALLOW_NO_DEEPSPEC=1): {msg}")
            pytest.skip(msg)
        pytest.fail(msg)
    sys.path.insert(0, DEEPSPEC_SRC)
    try:
        from deepspec.modeling.dspark import extract_context_feature
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
        from deepspec.modeling.dspark.qwen3.config import build_draft_config
        from deepspec.modeling.eagle3 import extract_eagle3_context_feature
        from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model
        from deepspec.modeling.eagle3.qwen3.config import build_draft_config as build_eagle3_config
    finally:
        sys.path.remove(DEEPSPEC_SRC)
    return dict(Qwen3DSparkModel=Qwen3DSparkModel, build_draft_config=build_draft_config,
                extract_context_feature=extract_context_feature, Qwen3Eagle3Model=Qwen3Eagle3Model,
                build_eagle3_config=build_eagle3_config, extract_eagle3_context_feature=extract_eagle3_context_feature)


def make_replica(ds, hf, path, variant: str, seed: int = 0):
    """A DeepSpec checkpoint written by DeepSpec's own classes and `save_pretrained`."""
    import torch

    if variant == "eagle3":
        cfg = ds["build_eagle3_config"](target_config=hf.config, model_args=Args(
            target_model_name_or_path="tiny-qwen3", target_layer_ids=LAYERS, ttt_length=L, step_loss_decay=0.8,
            draft_num_hidden_layers=1))
        model = ds["Qwen3Eagle3Model"](cfg)
    else:
        cfg = ds["build_draft_config"](hf.config, Args(block_size=L, num_draft_layers=2, target_layer_ids=LAYERS,
                                                       mask_token_id=MASK, num_anchors=16, **VARIANTS[variant]))
        model = ds["Qwen3DSparkModel"](cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, W2 and biases away from 0
            p.add_(0.1 * torch.randn_like(p))
    model.initialize_embeddings_and_head(embed_tokens=hf.get_input_embeddings(), lm_head=hf.get_output_embeddings())
    model.save_pretrained(path)
    return path


def deepspec_propose(ds, hf, path, prompt):
    """DeepSpec's first proposal at T=0 after `prompt`: (anchor, tokens [L], logits [L, V], confidence or None)."""
    import torch
    from transformers import DynamicCache

    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    cls = ds["Qwen3Eagle3Model"] if arch == "Qwen3Eagle3Model" else ds["Qwen3DSparkModel"]
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()  # as its evaluator
    ids = torch.tensor([prompt])
    P = ids.shape[1]
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        anchor = out.logits[:, -1].argmax(-1)  # [1]
        if arch == "Qwen3Eagle3Model":  # eval/eagle3/evaluator.py: _init_context, then _propose's loop
            feats = ds["extract_eagle3_context_feature"](out.hidden_states, model.target_layer_ids)
            cache = DynamicCache()
            h = model.extend_draft_cache(hidden_states=feats, input_ids=torch.cat([ids[:, 1:], anchor[:, None]], 1),
                                         position_ids=torch.arange(P)[None], past_key_values=cache)
            tokens, logits = [], []
            for k in range(model.ttt_length):
                step = model.compute_logits(h)[:, -1]  # [1, V]
                tokens.append(int(step.argmax(-1)))
                logits.append(step[0].numpy())
                h = model(hidden_states=h, input_ids=torch.tensor([[tokens[-1]]]),
                          position_ids=torch.tensor([[P + k]]), past_key_values=cache, use_cache=True)
            return int(anchor), np.array(tokens), np.stack(logits), None
        # eval/dspark: anchor + L−1 mask tokens at positions P.., attending to every prompt feature.
        feats = ds["extract_context_feature"](out.hidden_states, model.target_layer_ids)
        draft_ids = torch.full((1, model.block_size), int(model.mask_token_id))
        draft_ids[:, 0] = anchor
        h = model._forward_backbone(target_hidden_states=feats, noise_embedding=model.embed_tokens(draft_ids),
                                    position_ids=torch.arange(P + model.block_size)[None], attention_mask=None,
                                    past_key_values=None, use_cache=False, is_causal=False)
        tokens, logits = model.sample_draft_tokens(model.compute_logits(h), first_prev_token_ids=draft_ids[:, 0],
                                                   temperature=0.0, hidden_states=h)
        conf = None
        if model.confidence_head is not None:
            prev = torch.cat([draft_ids[:, :1], tokens[:, :-1]], 1)
            conf = torch.sigmoid(model.predict_confidence_step(h, prev_token_ids=prev))[0].numpy()
    return int(anchor), tokens[0].numpy(), logits[0].numpy(), conf


def _assert_proposals_match(ours, ref):
    anchor, tokens, logits, conf = ref
    assert ours.anchor == anchor
    np.testing.assert_array_equal(ours.tokens, tokens)
    assert ours.logits.shape == logits.shape and ours.logits.dtype == np.float32
    np.testing.assert_allclose(ours.logits, logits, rtol=0, atol=1e-4)
    if conf is None:
        assert ours.confidence is None
    else:
        np.testing.assert_allclose(ours.confidence, conf, rtol=0, atol=1e-4)


# ---- DeepSpec → ours ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_propose_matches_deepspec_models(ds, hf_target, target, tmp_path, variant):
    path = make_replica(ds, hf_target, str(tmp_path / variant), variant)
    drafter = dspark_jax.load_drafter(path, target)
    want_kind = {"dflash": "dflash", "eagle3": "eagle3"}.get(variant, "dspark")
    assert drafter.config.kind == want_kind and drafter.config.target_layers == tuple(LAYERS)
    for prompt in PROMPTS:
        _assert_proposals_match(dspark_jax.propose(target, drafter, prompt),
                                deepspec_propose(ds, hf_target, path, prompt))


@pytest.mark.parametrize("variant", ["dspark", "dflash", "eagle3"])
def test_greedy_speculative_through_deepspec_drafter_equals_target_only(ds, hf_target, target, tmp_path, variant):
    drafter = dspark_jax.load_drafter(make_replica(ds, hf_target, str(tmp_path / "d"), variant), target)
    plain = dspark_jax.generate(target, PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = dspark_jax.generate(target, PROMPTS, drafter, max_new_tokens=24, ignore_eos=True)
    assert spec.tokens == plain.tokens
    assert spec.stats["rounds"] < 24  # it did draft (each round emits at least one token)


def test_propose_agrees_with_the_decode_path(ds, hf_target, target, tmp_path):
    """`propose`'s tokens are what `draft_block` (generate's drafting) samples at T=0."""
    import jax.numpy as jnp

    from dspark_jax.decoding import pad_prompts, prefill
    from dspark_jax.drafter import draft_block, drafter_prefill
    from dspark_jax.drafter_model import TargetHead
    from dspark_jax.keys import row_keys

    d = dspark_jax.load_drafter(make_replica(ds, hf_target, str(tmp_path / "d"), "dspark-rnn"), target)
    tokens, lens = pad_prompts([PROMPTS[0]])
    logits, _, feats = prefill(target.graphdef, target.params, jnp.asarray(tokens), target.init_cache(1, 64),
                               jnp.asarray(lens), hidden_layers=d.config.target_layers)
    dcache = drafter_prefill(d.graphdef, d.params, target.params, d.init_cache(1, 64), feats, jnp.asarray(tokens),
                             jnp.asarray(lens), tied=False)
    anchor = jnp.argmax(logits, -1).astype(jnp.int32)
    tok, _, conf = draft_block(d.graphdef, d.params, TargetHead.from_params(target.params, False), dcache, anchor,
                               row_keys(0, 1), jnp.zeros((1,)), jnp.zeros((1,), jnp.int32), jnp.ones((1,)))
    p = dspark_jax.propose(target, d, PROMPTS[0])
    np.testing.assert_array_equal(np.asarray(tok[0]), p.tokens)
    np.testing.assert_allclose(np.asarray(conf[0]), p.confidence, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_propose_with_a_reduced_draft_vocabulary(target, kind):
    """Logits are over the target's vocabulary (−inf outside the subset); tokens are target ids, as drafted."""
    import jax.numpy as jnp

    from dspark_jax import draft_vocab
    from dspark_jax.decoding import pad_prompts, prefill
    from dspark_jax.drafter import draft_block, drafter_prefill
    from dspark_jax.drafter_model import TargetHead
    from dspark_jax.keys import row_keys

    subset = tuple(range(1, 128, 3))
    d = _randomised(target, kind=kind, draft_vocab=subset)
    p = dspark_jax.propose(target, d, PROMPTS[1])
    assert p.logits.shape == (L, 128) and set(p.tokens.tolist()) <= set(subset)
    outside = np.setdiff1d(np.arange(128), subset)
    assert np.all(np.isneginf(p.logits[:, outside])) and np.all(np.isfinite(p.logits[:, list(subset)]))
    np.testing.assert_array_equal(p.tokens, p.logits.argmax(-1))
    assert draft_vocab.is_reduced(d.config)
    # The decode path drafts the same tokens at T=0.
    tokens, lens = pad_prompts([PROMPTS[1]])
    _, _, feats = prefill(target.graphdef, target.params, jnp.asarray(tokens), target.init_cache(1, 64),
                          jnp.asarray(lens), hidden_layers=d.config.target_layers)
    dcache = drafter_prefill(d.graphdef, d.params, target.params, d.init_cache(1, 64), feats, jnp.asarray(tokens),
                             jnp.asarray(lens), tied=False)
    tok, _, _ = draft_block(d.graphdef, d.params, TargetHead.from_params(target.params, False), dcache,
                            jnp.asarray([p.anchor], jnp.int32), row_keys(0, 1), jnp.zeros((1,)),
                            jnp.zeros((1,), jnp.int32), jnp.ones((1,)))
    np.testing.assert_array_equal(np.asarray(tok[0]), p.tokens)


def test_deepspec_file_through_ours_and_back_is_bit_exact(ds, hf_target, target, tmp_path):
    """DeepSpec's own files → load → save(format="deepspec") → the same tensors, bit for bit."""
    from safetensors.numpy import load_file

    for variant in ("dspark", "dspark-rnn", "eagle3"):
        src = make_replica(ds, hf_target, str(tmp_path / f"src-{variant}"), variant)
        out = str(tmp_path / f"out-{variant}")
        dspark_jax.load_drafter(src, target).save(out, format="deepspec", target=target)
        a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


# ---- ours → DeepSpec → ours ---------------------------------------------------------------------------------------
# Our own drafters with the DeepSpec-compatible switches (what `save(format="deepspec")` can express).
OURS = {
    "dspark": dict(kind="dspark", calibration=(1.5, 1.2, 1.0, 0.9, 0.8),
                   calibration_offsets=(0.1, -0.2, 0.0, 0.3, -0.5)),
    "dspark-gated": dict(kind="dspark", head="gated", confidence_with_markov=False),
    "dspark-rnn": dict(kind="dspark", head="rnn", rnn_bias=True),
    "dflash": dict(kind="dflash", anchor_predicts=True),
    "eagle3": dict(kind="eagle3", eagle_layer="concat"),
}


def _randomised(target, seed=0, **kw):
    kind = kw.pop("kind")
    extra = dict(num_layers=2, markov_rank=16) if kind != "eagle3" else {}
    d = dspark_jax.init_drafter(target, kind=kind, block_size=L, seed=seed, target_layers=LAYERS, **extra, **kw)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
    key = jax.random.key(seed)
    for i, (k, v) in enumerate(sorted(flat.items())):
        flat[k] = v + 0.1 * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
    nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    return d


@pytest.mark.parametrize("name", list(OURS))
def test_export_reload_round_trip_is_bit_exact(target, tmp_path, name):
    ours = _randomised(target, **OURS[name])
    ours.save(str(tmp_path), format="deepspec", target=target, mask_token_id=None if name == "eagle3" else MASK)
    back = dspark_jax.load_drafter(str(tmp_path), target)
    a = nnx.traversals.flatten_mapping(nnx.to_pure_dict(ours.params))
    b = nnx.traversals.flatten_mapping(nnx.to_pure_dict(back.params))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    # The config comes back too; the format adds the mask token and drops the rank of an absent Markov head.
    want = dataclasses.replace(ours.config, mask_token_id=None if name == "eagle3" else MASK,
                               markov_rank=ours.config.markov_rank if ours.config.head != "none" else 0)
    assert back.config == want and back.config.target_fingerprint == ours.config.target_fingerprint
    p, q = dspark_jax.propose(target, ours, PROMPTS[0]), dspark_jax.propose(target, back, PROMPTS[0])
    np.testing.assert_array_equal(p.logits, q.logits)


@pytest.mark.parametrize("name", ["dspark", "dspark-gated", "dflash", "eagle3"])
def test_deepspec_reads_our_export(ds, hf_target, target, tmp_path, name):
    """DeepSpec's `from_pretrained` loads our export with no missing or unexpected keys, and drafts as we do."""
    import torch

    ours = _randomised(target, seed=3, **OURS[name])
    ours.save(str(tmp_path), format="deepspec", target=target, mask_token_id=None if name == "eagle3" else MASK)
    cls = ds["Qwen3Eagle3Model"] if name == "eagle3" else ds["Qwen3DSparkModel"]
    _, info = cls.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    raw = ours.with_config(calibration=(), calibration_offsets=())  # DeepSpec ignores our calibration (own keys)
    for prompt in PROMPTS:
        _assert_proposals_match(dspark_jax.propose(target, raw, prompt),
                                deepspec_propose(ds, hf_target, str(tmp_path), prompt))


# ---- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,match", [
    (dict(hidden_size=32), "another target"),
    (dict(vocab_size=96), "another target"),
    (dict(), "differ from the target's"),  # same shapes, other weights
])
def test_checkpoint_for_another_target_is_a_clear_error(ds, target, tmp_path, overrides, match):
    other = make_hf_model("qwen3", tied=False, seed=7, **{**TINY, **overrides})
    path = make_replica(ds, other, str(tmp_path / "other"), "dspark")
    with pytest.raises(ValueError, match=match):
        dspark_jax.load_drafter(path, target)


def test_unsupported_or_incomplete_configs_are_clear_errors(ds, hf_target, target, tmp_path):
    path = make_replica(ds, hf_target, str(tmp_path / "d"), "dspark")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        good = json.load(f)
    cases = [({**good, "architectures": ["Gemma4DSparkModel"]}, "unsupported DeepSpec architecture"),
             ({**good, "target_layer_ids": [-1, 1, 2, 3, 4]}, "embedding output"),
             ({k: v for k, v in good.items() if k != "mask_token_id"}, "lacks 'mask_token_id'"),
             ({**good, "markov_head_type": "lstm"}, "unknown markov_head_type")]
    for cfg, match in cases:
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        with pytest.raises(ValueError, match=match):
            dspark_jax.load_drafter(path, target)
    with open(cfg_path, "w") as f:
        json.dump(good, f)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="no model.safetensors"):
        dspark_jax.load_drafter(path, target)


def test_hub_id_resolves_from_the_local_cache_only(ds, hf_target, target, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snap = cache / "models--deepspec-test--tiny_dspark" / "snapshots" / ("0" * 40)
    make_replica(ds, hf_target, str(snap), "dspark")
    (cache / "models--deepspec-test--tiny_dspark" / "refs").mkdir()
    (cache / "models--deepspec-test--tiny_dspark" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = dspark_jax.load_drafter("deepspec-test/tiny_dspark", target)
    assert d.config.kind == "dspark" and d.config.mask_token_id == MASK
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        dspark_jax.load_drafter("deepspec-test/not_downloaded", target)
    shutil.rmtree(cache)


def test_exports_deepspec_cannot_express_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="anchor_predicts=True"):
        _randomised(target, kind="dflash").save(str(tmp_path), format="deepspec", target=target, mask_token_id=MASK)
    with pytest.raises(ValueError, match="eagle_layer='concat'"):
        _randomised(target, kind="eagle3").save(str(tmp_path), format="deepspec", target=target)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        _randomised(target, kind="dspark").save(str(tmp_path), format="deepspec", target=target)
    with pytest.raises(ValueError, match="no anchor_feature"):
        _randomised(target, kind="dspark", anchor_feature=True).save(str(tmp_path), format="deepspec", target=target,
                                                                     mask_token_id=MASK)
    with pytest.raises(ValueError, match="needs target="):
        _randomised(target, kind="dspark").save(str(tmp_path), format="deepspec")
    assert deepspec.is_checkpoint(str(tmp_path)) is False


# ---- scripts/reproduce_table1.py ------------------------------------------------------------------------------
def _char_tokenizer(path, vocab: int):
    """A character-level tokenizer with a chat template, saved beside a tiny target (ids < vocab)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {chr(c): 4 + i for i, c in enumerate(range(32, 127)) if 4 + i < vocab}
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **chars}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    template = ("{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}{% if enable_thinking is false %}#{% endif %}:{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", chat_template=template).save_pretrained(path)


def test_reproduce_table1_runs_end_to_end_on_a_tiny_model(ds, hf_target, tmp_path, capsys):
    tdir = tmp_path / "target"
    hf_target.save_pretrained(tdir)
    _char_tokenizer(tdir, hf_target.config.vocab_size)
    ddir = make_replica(ds, hf_target, str(tmp_path / "drafter"), "dspark")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("gsm8k", "mt-bench"):  # invented prompts: the real files are not needed (nor trained on)
        with open(data / f"{name}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"turns": [f"{name} question {i}: what is {i} + {i}?", "second turn"]}) + "\n")
    from conftest import load_script

    script = load_script("reproduce_table1")
    out = tmp_path / "tau.json"
    rc = script.main(["--target", str(tdir), "--drafter", ddir, "--data-dir", str(data), "--limit", "2",
                      "--max-new-tokens", "12", "--dtype", "float32", "--paper-row", "Qwen3-8B/dspark",
                      "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert list(res["sets"]) == ["gsm8k", "mt-bench"] and res["gamma"] == L
    for s in res["sets"].values():
        for T in ("1", "0"):
            assert s[T]["prompts"] == 2 and s[T]["rounds"] >= 1 and 1.0 <= s[T]["tau"] <= L + 1
            assert s[T]["emitted"] >= s[T]["new_tokens"] - 2  # the first token of each prompt comes from prefill
    assert res["paper"] == {"gsm8k": 6.17, "mt-bench": 3.72}
    printed = capsys.readouterr().out
    assert "Table 1" in printed and "macro" in printed and "6.17" in printed


def test_serving_engine_with_a_deepspec_drafter_is_exact(ds, hf_target, target, tmp_path):
    """The paged serving path (python -m dspark_jax.serve) drafts with a loaded DeepSpec checkpoint and stays
    lossless: greedy outputs equal target-only decoding. DFlash: the one DeepSpec layout the engine's block pass
    handles differently (the anchor slot predicts); the dspark semantics live in the shared model code."""
    variant = "dflash"
    from serve.startup import create_engine
    from serve.types import EngineRequest, SamplingParams

    drafter = dspark_jax.load_drafter(make_replica(ds, hf_target, str(tmp_path / "d"), variant), target)
    ref = dspark_jax.generate(target, PROMPTS, max_new_tokens=12, ignore_eos=True).tokens
    engine = create_engine(target_obj=target, drafter_obj=drafter, scheduler="fixed:3", max_batch=2,
                           max_model_len=48, page_size=8, chunk_sizes=(8, 32), profile=False, progress=False)
    outs: dict[str, list[int]] = {}
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineRequest(
                request_id=str(i), prompt_ids=p,
                params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                on_output=lambda o: outs.setdefault(o.request_id, []).extend(o.token_ids)))
        assert engine.wait_idle(300)
    finally:
        engine.stop()
    assert [outs[str(i)] for i in range(len(PROMPTS))] == ref
