"""Speculative decoding end to end: greedy output equals target-only greedy, and sampled output follows the
exact (filtered) target distribution, for every drafter kind and policy."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import make_hf_model, spec_prompts, target_from_hf
from flax import nnx

import dspark_jax
from dspark_jax.kernels import KernelConfig
from dspark_jax.policy import Policy
from dspark_jax.sampling import filter_probs

KINDS = ["dspark", "dflash", "eagle3"]


def _prompts(vocab=128):
    return spec_prompts(vocab)


def _accepted(out) -> int:
    """Draft tokens accepted over a whole `generate` call (0 means greedy equality held trivially)."""
    return int(sum(out.stats["acceptance_accepts"]))


def _drafter(target, kind, L, seed=0, scramble=0.0, **kw):
    """An untrained drafter; `scramble` > 0 gives the Markov and confidence heads random non-zero weights."""
    over = {"num_layers": 1 if kind == "eagle3" else 2, **kw}
    if kind == "dspark":
        over.setdefault("markov_rank", 16)
    d = dspark_jax.init_drafter(target, kind=kind, block_size=L, seed=seed, **over)
    if scramble:
        key = jax.random.key(seed + 100)
        flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
        for i, (k, v) in enumerate(sorted(flat.items())):
            flat[k] = v + scramble * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
        nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    return d


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_target(tiny_hf_targets, model_type):
    return tiny_hf_targets[model_type][1]


@pytest.fixture(scope="module")
def greedy_refs(tiny_hf_targets):
    """Target-only greedy output of `_prompts()` (24 tokens), per target: {"llama", "qwen3"} → tokens."""
    from conftest import _Lazy

    return _Lazy(lambda mt: dspark_jax.generate(tiny_hf_targets[mt][1], _prompts(), max_new_tokens=24,
                                                ignore_eos=True).tokens)


@pytest.fixture(scope="module")
def greedy_reference(greedy_refs, model_type):
    return greedy_refs[model_type]


# Every block size on the llama target, two on qwen3 (compile time dominates on CPU).
GREEDY_CASES = [(mt, kind, L) for mt, sizes in (("llama", (1, 4, 7, 16)), ("qwen3", (4, 7)))
                for kind in KINDS for L in sizes]


@pytest.mark.parametrize("case", GREEDY_CASES, ids=lambda c: "-".join(map(str, c)))
def test_greedy_speculative_equals_target_only(tiny_hf_targets, greedy_refs, distilled_drafter, case):
    """Distilled drafters (conftest.distilled_drafter): drafts are accepted, so equality is not trivial."""
    model_type, kind, L = case
    target = tiny_hf_targets[model_type][1]
    ref = greedy_refs[model_type]
    out = dspark_jax.generate(target, _prompts(), distilled_drafter(model_type, kind, L), max_new_tokens=24,
                              ignore_eos=True)
    assert out.tokens == ref, case
    assert _accepted(out) > 0 and out.stats["tau"] > 1.2, (case, out.stats)


@pytest.mark.parametrize("policy", ["fixed:2", "threshold:0.3", "dspark-sync"])
def test_greedy_equality_under_every_policy(tiny_target, greedy_reference, distilled_drafter, model_type, policy):
    d = distilled_drafter(model_type, "dspark", 7)
    sps = tuple(1.0 / (1 + 0.02 * b) for b in range(4 * 8 + 1))  # a sloping steps/s table
    out = dspark_jax.generate(tiny_target, _prompts(), d, max_new_tokens=24, ignore_eos=True,
                              policy=Policy.parse(policy, sps=sps))
    assert out.tokens == greedy_reference
    assert _accepted(out) > 0, out.stats


def test_greedy_equality_with_logit_bias(tiny_target, greedy_reference, distilled_drafter, model_type):
    """OpenAI's logit_bias on the target's side (drafts are drawn without it): speculative greedy output equals
    target-only greedy output under the same bias, which changes the output (a token it emits banned, one it
    never emits favoured) and leaves drafts to accept."""
    tokens, counts = np.unique(np.concatenate(greedy_reference), return_counts=True)
    unused = next(t for t in range(tiny_target.config.vocab_size) if t not in tokens)
    bias = {int(tokens[np.argsort(counts)[len(counts) // 2]]): -100.0, unused: 0.5}
    kw = dict(max_new_tokens=24, ignore_eos=True, logit_bias=bias)
    ref = dspark_jax.generate(tiny_target, _prompts(), **kw).tokens
    assert ref != greedy_reference and not any(t in bias and bias[t] < 0 for row in ref for t in row)
    out = dspark_jax.generate(tiny_target, _prompts(), distilled_drafter(model_type, "dspark", 7), **kw)
    assert out.tokens == ref
    assert _accepted(out) > 0, out.stats
    with pytest.raises(ValueError, match="logit_bias"):
        dspark_jax.generate(tiny_target, _prompts(), max_new_tokens=2, logit_bias={"x": 1})


def test_greedy_equality_with_min_tokens(tiny_target, greedy_reference, distilled_drafter, model_type):
    """vLLM's min_tokens: EOS, made the argmax everywhere by a +100 logit bias, is banned until min_tokens
    tokens are out and then ends every row: target-only and speculative greedy rows are the unbiased greedy
    tokens up to min_tokens, then EOS (the ban ends inside a verification block)."""
    eos, m = tiny_target.eos_token_ids[0], 11
    assert not any(eos in row[:m] for row in greedy_reference)
    kw = dict(max_new_tokens=24, logit_bias={eos: 100.0})
    assert dspark_jax.generate(tiny_target, _prompts(), **kw).tokens == [[eos]] * len(_prompts())
    ref = dspark_jax.generate(tiny_target, _prompts(), min_tokens=m, **kw).tokens
    assert ref == [row[:m] + [eos] for row in greedy_reference]
    out = dspark_jax.generate(tiny_target, _prompts(), distilled_drafter(model_type, "dspark", 7), min_tokens=m, **kw)
    assert out.tokens == ref
    assert _accepted(out) > 0, out.stats
    with pytest.raises(ValueError, match="min_tokens"):
        dspark_jax.generate(tiny_target, _prompts(), max_new_tokens=2, min_tokens=3)


def _penalized_greedy(target, prompts, n: int, presence: float, frequency: float, repetition: float):
    """Greedy continuations under vLLM's penalties, written from their documented semantics (not
    dspark_jax/penalties.py): each step runs the target over the whole sequence so far, divides positive (multiplies
    negative) logits of tokens in the prompt or output by `repetition`, subtracts frequency × each token's count in
    the output and presence once per output token, and takes the argmax."""
    width = max(len(p) for p in prompts) + n
    rows = [list(p) for p in prompts]
    for _ in range(n):
        ids = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        logits = np.asarray(target.logits(ids), np.float64)
        for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
            x = logits[i, len(r) - 1]
            counts = np.bincount(r[len(p):], minlength=x.size)
            hit = np.isin(np.arange(x.size), p) | (counts > 0)
            x = np.where(hit, np.where(x > 0, x / repetition, x * repetition), x)
            r.append(int(np.argmax(x - frequency * counts - presence * (counts > 0))))
    return [r[len(p):] for p, r in zip(prompts, rows, strict=True)]


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_greedy_equality_with_penalties(tiny_target, greedy_reference, distilled_drafter, model_type, kind):
    """Presence, frequency and repetition penalties on the target's side (drafts are drawn without them): the
    target-only greedy output equals a dense reference loop, and speculative greedy output equals it, with drafts
    accepted (inside a block, each row's penalties count the anchor and the drafts before it)."""
    pen = dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3)
    kw = dict(max_new_tokens=24, ignore_eos=True, **pen)
    ref = dspark_jax.generate(tiny_target, _prompts(), **kw).tokens
    assert ref != greedy_reference
    assert ref == _penalized_greedy(tiny_target, _prompts(), 24, *pen.values())
    out = dspark_jax.generate(tiny_target, _prompts(), distilled_drafter(model_type, kind, 7), **kw)
    assert out.tokens == ref
    assert _accepted(out) > 0, out.stats
    with pytest.raises(ValueError, match="repetition_penalty"):
        dspark_jax.generate(tiny_target, _prompts(), max_new_tokens=2, repetition_penalty=0.0)


def test_greedy_equality_with_randomised_heads(tiny_target, greedy_reference, distilled_drafter, model_type):
    """The distilled DSpark drafter with noise added to its Markov and confidence heads: output unchanged,
    drafts still accepted (the noise is small against the trained bias)."""
    d = distilled_drafter(model_type, "dspark", 7)
    key = jax.random.key(7)
    pure = nnx.to_pure_dict(d.params)
    for i, name in enumerate(("markov_w1", "markov_w2", "conf_w")):
        pure[name] = pure[name] + 0.1 * jax.random.normal(jax.random.fold_in(key, i), pure[name].shape)
    params = jax.tree.map(lambda x: x, d.params)
    nnx.replace_by_pure_dict(params, pure)
    out = dspark_jax.generate(tiny_target, _prompts(), d.with_params(params), max_new_tokens=24, ignore_eos=True)
    assert out.tokens == greedy_reference
    assert _accepted(out) > 0, out.stats


def test_untrained_dspark_drafter_copies_the_anchor(tiny_hf_targets, greedy_refs):
    """The untrained DSpark drafter copies the anchor, which the random llama target often repeats: τ > 1."""
    target = tiny_hf_targets["llama"][1]
    out = dspark_jax.generate(target, _prompts(), _drafter(target, "dspark", 7), max_new_tokens=24,
                              ignore_eos=True)
    assert out.tokens == greedy_refs["llama"]
    assert _accepted(out) > 0 and out.stats["tau"] > 1.0


def test_eos_and_max_tokens_stop_each_row(tiny_hf_targets, distilled_drafter, tmp_path):
    """EOS = a token the first row's greedy output reaches: that row stops at it, the others at max_tokens."""
    plain = tiny_hf_targets["llama"][1]
    first = dspark_jax.generate(plain, _prompts(), max_new_tokens=30, ignore_eos=True).tokens
    eos = first[0][-1]
    assert eos not in first[1], "pick another EOS: it must stop row 0 and not row 1"
    # The same weights (seed 0) with that EOS id; the llama drafter's fingerprint still matches.
    target = target_from_hf(make_hf_model("llama", tied=True, eos_token_id=int(eos)), tmp_path)
    prompts = _prompts()
    ref = dspark_jax.generate(target, prompts, max_new_tokens=30)
    out = dspark_jax.generate(target, prompts, distilled_drafter("llama", "dspark", 7), max_new_tokens=30)
    assert out.tokens == ref.tokens
    assert ref.tokens[0][-1] == eos and len(ref.tokens[0]) == first[0].index(eos) + 1 < 30
    assert len(ref.tokens[1]) == 30
    assert all(len(t) <= 30 for t in out.tokens)
    assert _accepted(out) > 0, out.stats


# ---- the sampled output follows the exact target distribution ------------------------------------------------
V_SMALL = 8


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    hf = make_hf_model("llama", tied=False, vocab_size=V_SMALL, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    import torch

    with torch.no_grad():  # a peakier, more structured target so the joint distribution is far from uniform
        hf.lm_head.weight.mul_(8.0)
    return target_from_hf(hf, tmp_path_factory.mktemp("v8"))


def _exact_joint(target, prompt, temperature, top_k, top_p, n=3, min_p=0.0):
    """P(x1..xn | prompt) of the filtered target, by enumerating every prefix."""
    V = target.config.vocab_size
    prefixes = np.array(list(itertools.product(range(V), repeat=n - 1)), np.int32)  # [m, n - 1], C order
    m = len(prefixes)
    ids = np.concatenate([np.tile(np.array(prompt, np.int32), (m, 1)), prefixes], axis=1)
    logits = target.logits(ids)[:, len(prompt) - 1:]  # [m, n, V]: every prefix in one forward
    p = np.asarray(filter_probs(logits, np.full(m, temperature), np.full(m, top_k, np.int32), np.full(m, top_p),
                                np.full(m, min_p, np.float32)))
    prefix_prob = p[np.arange(m)[:, None], np.arange(n - 1), prefixes].prod(axis=1)  # [m]
    return (prefix_prob[:, None] * p[:, n - 1]).reshape((V,) * n)


def _chi2_pvalue(counts, expected):
    """Pearson chi-square with cells of expected count < 5 pooled; returns the p-value."""
    from scipy.stats import chi2

    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return chi2.sf(stat, keep.sum() - 1)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "dspark-reduced"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampled_output_follows_exact_target_distribution(small_vocab_target, kind, temperature, top_k, top_p):
    """dspark-reduced drafts from 5 of the 8 tokens: q is kept over that subset through the paged round and
    widened (zero outside it) only for sampled verification."""
    target = small_vocab_target
    prompt = [3, 5, 2, 7]
    joint = _exact_joint(target, prompt, temperature, top_k, top_p).reshape(-1)
    # A deliberately poor drafter: random heads, far from the target.
    extra = {"draft_vocab": (1, 2, 3, 5, 6)} if kind == "dspark-reduced" else {}
    kind = kind.split("-")[0]
    d = _drafter(target, kind, 3, seed=1, scramble=1.0 if kind == "dspark" else 0.3, **extra)
    N, per_call = 12000, 4000
    counts = np.zeros_like(joint)
    for call in range(N // per_call):
        res = dspark_jax.generate(target, [prompt] * per_call, d, max_new_tokens=3, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=1000 + call, ignore_eos=True)
        idx = np.ravel_multi_index(np.array([t[:3] for t in res.tokens]).T, (V_SMALL,) * 3)
        counts += np.bincount(idx, minlength=joint.size)
    # A false alarm has probability 1e-3 per test; the poor drafter is rejected often, so recovery is exercised.
    assert _chi2_pvalue(counts, joint * N) > 1e-3
    assert counts[joint == 0].sum() == 0


def test_min_p_sampled_output_follows_exact_target_distribution(small_vocab_target):
    """min_p filters the target's distribution only (drafts are drawn without it): verification still gives
    exactly the min_p-filtered target distribution, and never a token min_p removed."""
    target, prompt, min_p = small_vocab_target, [3, 5, 2, 7], 0.25
    joint = _exact_joint(target, prompt, 1.0, 0, 0.95, min_p=min_p).reshape(-1)
    assert (joint == 0).sum() > (_exact_joint(target, prompt, 1.0, 0, 0.95).reshape(-1) == 0).sum()  # it bites
    d = _drafter(target, "dspark", 3, seed=1, scramble=1.0)
    N, per_call = 12000, 4000
    counts = np.zeros_like(joint)
    for call in range(N // per_call):
        res = dspark_jax.generate(target, [prompt] * per_call, d, max_new_tokens=3, temperature=1.0, top_p=0.95,
                                  min_p=min_p, seed=2000 + call, ignore_eos=True)
        idx = np.ravel_multi_index(np.array([t[:3] for t in res.tokens]).T, (V_SMALL,) * 3)
        counts += np.bincount(idx, minlength=joint.size)
    assert _chi2_pvalue(counts, joint * N) > 1e-3
    assert counts[joint == 0].sum() == 0
    with pytest.raises(ValueError, match="min_p"):
        dspark_jax.generate(target, [prompt], d, max_new_tokens=2, min_p=1.5)


def test_distribution_test_detects_a_biased_sampler(small_vocab_target):
    """The chi-square machinery has power: the *draft* distribution itself (no verification) fails it."""
    target = small_vocab_target
    prompt = [3, 5, 2, 7]
    joint = _exact_joint(target, prompt, 1.0, 0, 1.0).reshape(-1)
    other = np.roll(joint, 1) * 0.2 + joint * 0.8  # a 20% mixture with a shifted distribution
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(joint.size, size=12000, p=other / other.sum()), minlength=joint.size)
    assert _chi2_pvalue(counts.astype(float), joint * 12000) < 1e-3


# ---- checkpoints -------------------------------------------------------------------------------------------------
def test_checkpoint_round_trip_and_wrong_target(tiny_target, tmp_path, small_vocab_target):
    d = _drafter(tiny_target, "dspark", 4, scramble=0.3)
    d.save(str(tmp_path / "ck"))
    back = dspark_jax.load_drafter(str(tmp_path / "ck"), tiny_target)
    assert back.config == d.config
    for a, b in zip(jax.tree.leaves(d.params), jax.tree.leaves(back.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="different target"):
        dspark_jax.load_drafter(str(tmp_path / "ck"), small_vocab_target)
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        dspark_jax.load_drafter(str(tmp_path / "nothing"), tiny_target)
    assert sorted(os.listdir(tmp_path / "ck")) == ["drafter_config.json", "model.safetensors"]
    # Truncated, then garbage weights: a clear error, not a crash deep in safetensors.
    weights = tmp_path / "ck" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="corrupt"):
        dspark_jax.load_drafter(str(tmp_path / "ck"), tiny_target)
    weights.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        dspark_jax.load_drafter(str(tmp_path / "ck"), tiny_target)


def test_checkpoint_from_older_orbax_layout_still_loads(tiny_target, tmp_path):
    """Checkpoints written before the safetensors format (an Orbax `params/` directory) load unchanged."""
    import orbax.checkpoint as ocp
    from flax import nnx

    d = _drafter(tiny_target, "dspark", 4, scramble=0.3)
    d.save(str(tmp_path / "ck"))
    os.remove(tmp_path / "ck" / "model.safetensors")
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "ck" / "params"), nnx.to_pure_dict(d.params))
    back = dspark_jax.load_drafter(str(tmp_path / "ck"), tiny_target)
    for a, b in zip(jax.tree.leaves(d.params), jax.tree.leaves(back.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- Pallas kernels forced on (interpret mode on CPU) ------------------------------------------------------------
def test_greedy_equality_with_pallas_kernels(tiny_target, greedy_reference, distilled_drafter, model_type):
    """Both kernels forced on: the fused Markov sampler drafts, ragged attention runs prefill and verification."""
    d = distilled_drafter(model_type, "dspark", 4)
    out = dspark_jax.generate(tiny_target, _prompts(), d, max_new_tokens=24, ignore_eos=True, kernels="pallas")
    assert out.tokens == greedy_reference
    assert _accepted(out) > 0, out.stats
    alone = dspark_jax.generate(tiny_target, _prompts(), max_new_tokens=24, ignore_eos=True, kernels="pallas")
    assert alone.tokens == greedy_reference


def _pallas_distribution_check(tmpdir: str) -> None:
    """Chi-square of the first three tokens with the fused Pallas Markov sampler forced on (interpret mode)."""
    import torch

    hf = make_hf_model("llama", tied=False, vocab_size=V_SMALL, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    target = target_from_hf(hf, tmpdir)
    prompt = [3, 5, 2, 7]
    joint = _exact_joint(target, prompt, 1.0, 0, 1.0).reshape(-1)
    d = _drafter(target, "dspark", 3, seed=1, scramble=1.0)
    N, per_call = 8000, 1000
    counts = np.zeros_like(joint)
    # The Markov kernel only: interpreting the attention kernel for thousands of rows takes minutes on a CPU.
    for call in range(N // per_call):
        res = dspark_jax.generate(target, [prompt] * per_call, d, max_new_tokens=3, temperature=1.0,
                                  seed=7 + call, ignore_eos=True,
                                  kernels=KernelConfig(markov="pallas", attention="reference"))
        idx = np.ravel_multi_index(np.array([t[:3] for t in res.tokens]).T, (V_SMALL,) * 3)
        counts += np.bincount(idx, minlength=joint.size)
    assert _chi2_pvalue(counts, joint * N) > 1e-3


def test_pallas_markov_sampler_follows_exact_target_distribution(tmp_path):
    """The only end-to-end distribution test of the fused sampler that `auto` picks on TPU. It runs in a
    fresh process (late in a full-suite run, XLA:CPU once segfaulted compiling this interpret-mode round,
    which fits exhausted memory mappings in a long-lived process). A fresh process has no such excuse: any
    nonzero exit, a crash included, fails the test."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_spec_decode as t; "
            f"t._pallas_distribution_check({str(tmp_path)!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
    assert proc.returncode == 0, f"{how}\n{proc.stderr[-3000:]}"


def test_sampling_with_a_fixed_seed_is_reproducible(tiny_target):
    d = _drafter(tiny_target, "dspark", 4, scramble=0.5)
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, ignore_eos=True)
    a = dspark_jax.generate(tiny_target, _prompts(), d, seed=5, **kw).tokens
    b = dspark_jax.generate(tiny_target, _prompts(), d, seed=5, **kw).tokens
    c = dspark_jax.generate(tiny_target, _prompts(), d, seed=6, **kw).tokens
    assert a == b
    assert a != c
    assert len({tuple(t) for t in a}) > 1  # rows draw from their own streams


def test_a_rows_sample_does_not_depend_on_how_prefill_packed_it(tiny_target):
    """`generate` packs short prompts many to a prefill pass and runs a prompt longer than a chunk alone: a
    row's tokens are the same whichever way its neighbours went (its own key, its own pages)."""
    d = _drafter(tiny_target, "dspark", 4, scramble=0.5)
    kw = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=3)
    prompts = _prompts()
    long = list(map(int, np.random.default_rng(9).integers(3, 128, size=150)))  # > the 128-token chunk
    packed = dspark_jax.generate(tiny_target, prompts, d, **kw).tokens
    mixed = dspark_jax.generate(tiny_target, [prompts[0], long, *prompts[2:]], d, **kw).tokens
    assert [mixed[i] for i in (0, 2, 3)] == [packed[i] for i in (0, 2, 3)]
    assert packed[1] != mixed[1]


@pytest.mark.parametrize("backend,attention,markov", [("cpu", False, False), ("gpu", True, False),
                                                      ("tpu", False, False)])
def test_auto_kernels_follow_the_measured_table(monkeypatch, backend, attention, markov):
    """"auto" takes a Pallas kernel only where it was measured faster than the jnp path (kernels.AUTO_PALLAS):
    on an H200 the attention kernel ran 1.2-3.0× its reference and the Markov sampler 0.76-0.97×; on TPU
    nothing is measured yet, so plain jnp. The explicit modes are not second-guessed."""
    import dspark_jax.kernels as kernels_lib

    monkeypatch.setattr(kernels_lib.jax, "default_backend", lambda: backend)
    assert kernels_lib.use_pallas("auto", kernel="attention") is attention
    assert kernels_lib.use_pallas("auto", kernel="markov") is markov
    assert kernels_lib.use_pallas("pallas", kernel="markov")
    assert not kernels_lib.use_pallas("reference", kernel="attention")
    with pytest.raises(ValueError, match="unknown kernel mode"):
        kernels_lib.use_pallas("fast", kernel="markov")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels_lib.use_pallas("auto", kernel="sampler")
    auto = kernels_lib.KernelConfig.parse("auto")  # what the call sites ask
    assert auto.pallas("attention") is attention and auto.pallas("markov") is markov
