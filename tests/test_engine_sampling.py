"""The serving engine (serve/engine.py on dspark_jax/runner.py) on deployed paths that only greedy tests covered.

- Pallas kernels (interpreted on CPU): sampled outputs at T = 1 follow the exact target distribution.
- Filtered sampling (T = 0.7, top-k, top-p) under the threshold, dspark-sync and dspark schedulers follows the
  exact *filtered* target distribution, built here in numpy from the target's logits (not `filter_probs`).
- Logprobs: every emitted token's logprob and top alternatives (prefill's token, accepted draft tokens,
  recovered and bonus tokens) equal the target's log_softmax over the same prefix, greedy and sampled.
- A (data=2, model=4) mesh of 8 simulated devices: parameters are sharded and outputs equal single-device ones.

One tiny target (V = 8, so joints over a few tokens can be enumerated) and one untrained DSpark drafter serve
every test; every engine of the same kernels shares one ModelRunner, so its programs compile once (compiling
dominates on CPU). The batch is small (max_batch 2) because a prefill pass holds 8 tokens (the one chunk bucket),
less than one prompt: requests of a few rounds overlap two at a time, and larger batch buckets would only add
compile time. Requests are driven
through `EngineCore.step` (the engine thread's loop body) so each test is deterministic.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, run_on_eight_devices, target_from_hf
from flax import nnx
from test_engine import _engine
from test_spec_decode import V_SMALL, _chi2_pvalue, _drafter

from serve.scheduler import GainCalibration, SpsTable
from serve.startup import create_engine
from serve.types import EngineRequest, SamplingParams

PROMPT = [3, 5, 2, 7, 4, 6, 1, 3, 5]  # 9 tokens: more than the one chunk bucket (8), so two prefill passes
SIZES = dict(max_batch=2, max_model_len=24, page_size=4, chunk_sizes=(8,), profile=False)
FILTERED = dict(temperature=0.7, top_k=5, top_p=0.94)  # on this target both filters remove mass (see oracle)
CONF_LOGITS = np.array([2.5, -1.5, 0.5, 3.0, -0.5, 1.5, -2.5, 1.0])  # per previous token x (V = 8)
# Sampled requests run on past the tokens a chi-square scores: a prefill pass holds less than one prompt, so only
# requests that live a few rounds overlap, and the passes then hold two rows (the top-K fill has a choice).
LIVE_TOKENS = 8
ALPHA = 1e-3  # false-alarm probability of each chi-square test (fixed seeds: a pass is reproducible)


def _models(tmpdir: str):
    """(target, drafter), deterministic (the mesh subprocess rebuilds the same ones).

    Target: tied llama, V = 8, 8 heads / 4 KV heads (a 4-way model axis divides heads, KV heads, FFN 96 and V);
    embeddings × 1.5 give a next-token distribution that is neither flat nor nearly one-hot (top-1 ≈ 0.5 at
    T = 1), whose greedy choice repeats the last token. Drafter: untrained DSpark (it proposes the anchor again,
    so draft 1 is often accepted and drafts 2–3 often not) with a confidence head set by hand (below)."""
    hf = make_hf_model("llama", tied=True, vocab_size=V_SMALL, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                       num_attention_heads=8, num_key_value_heads=4)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(1.5)
    target = target_from_hf(hf, tmpdir)
    drafter = _drafter(target, "dspark", 3, seed=1, num_layers=1, markov_rank=8)
    # Confidence by previous token alone: conf_w = [0 on h; w on W1[x]] with W1 w = a fixed spread of logits,
    # so c_k = sigmoid(CONF_LOGITS[x_{k-1}]) and the confidence-driven schedulers pick different ℓ per row.
    pure = nnx.to_pure_dict(drafter.params)
    w_e = np.linalg.solve(np.asarray(pure["markov_w1"], np.float64), CONF_LOGITS)
    pure["conf_w"] = jnp.concatenate([jnp.zeros(pure["conf_w"].shape[0] - w_e.size), jnp.asarray(w_e, jnp.float32)])
    pure["conf_b"] = jnp.zeros_like(pure["conf_b"])
    params = jax.tree.map(lambda x: x, drafter.params)
    nnx.replace_by_pure_dict(params, pure)
    return target, drafter.with_params(params)


def _sloping_sps(runner, plain: float | None = None) -> SpsTable:
    """A hand-made cost model: steps/s falls with the pass's tokens, steeply in the largest capacity bucket (so
    two rows cannot verify all their drafts and dspark's top-K fill must choose between them), and optionally a
    plain-step rate (dspark then skips the draft pass when the stale survival is low)."""
    top = max(runner.capacities)
    entries = {(bb, cap, 0): (0.25 if cap == top else 1.0) / (1.0 + 0.05 * cap) for bb, cap in runner.verify_shapes()}
    return SpsTable(entries, {} if plain is None else {(bb, 0): plain for bb in runner.batch_buckets})


def _core(runner, scheduler: str, plain: float | None = None):
    core = create_engine(runner=runner, scheduler=scheduler, profile=False, progress=False).core_only()
    core.set_sps(_sloping_sps(runner, plain))
    return core


def _run(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Submits every request, drives the core until idle → {id: [RequestOutput, ...]}."""
    outs: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        core.add_request(EngineRequest(request_id=rid, prompt_ids=prompt, params=params,
                                       on_output=lambda o: outs[o.request_id].append(o)))
    while core.has_work():
        core.step()
    assert core.pages.num_free == core.pages.num_pages
    return outs


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _sample(core, n: int, max_tokens: int, seed0: int, **params) -> np.ndarray:
    """int [n, max_tokens]: n requests of PROMPT, seeded seed0 + i."""
    reqs = {str(i): (PROMPT, SamplingParams(max_tokens=max_tokens, seed=seed0 + i, ignore_eos=True, **params))
            for i in range(n)}
    outs = _run(core, reqs)
    return np.array([_tokens(outs[str(i)]) for i in range(n)])


# ---- the oracle: exact joint of the (filtered) target, in numpy -------------------------------------------------
def _filtered_np(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0,
                 bias: np.ndarray | None = None) -> np.ndarray:
    """The filtered next-token distribution of one logit row [V] (f64), written from sampling.py's documented
    semantics, not its code: the logit bias [V] (OpenAI's) added first; softmax(logits / T); min-p first keeps
    tokens with p >= min_p · max p (vLLM's order); top-k keeps every token >= the k-th largest (ties kept);
    top-p then walks the top-k-renormalised distribution in descending order (ties: lower index first) and keeps
    a token while the mass strictly before it is < top_p (so the crossing token is kept), the first always."""
    z = (logits.astype(np.float64) + (0.0 if bias is None else bias)) / temperature
    order = sorted(range(z.size), key=lambda i: (-z[i], i))
    keep = np.ones(z.size, bool)
    if min_p:
        ratio = np.exp(z - z.max())
        assert np.all(abs(ratio - min_p) > 1e-5), (ratio, min_p)  # no token may sit on the threshold
        keep &= ratio >= min_p
    if top_k:
        keep &= z >= z[order[top_k - 1]]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        before, nucleus = 0.0, np.zeros(z.size, bool)
        for rank, i in enumerate(order):
            if not keep[i]:
                continue
            # The oracle must not hinge on rounding (f32 errors are ~1e-7): no mass-before may sit at top_p.
            assert abs(before - top_p) > 1e-5, (before, top_p)
            nucleus[i] = rank == 0 or before < top_p
            before += p[i]
        p = np.where(nucleus, p, 0.0)
    return p / p.sum()


def _padded_logits(target, rows: list[list[int]]) -> np.ndarray:
    """Target logits f64 [len(rows), 24, V] of right-padded rows (causal: padding never changes earlier
    positions); one shape for every call, so `target.logits` compiles once."""
    ids = np.zeros((64, SIZES["max_model_len"]), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return np.asarray(target.logits(ids), np.float64)[:len(rows)]


def _exact_joint(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, bias: np.ndarray | None = None) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) [V, V, V] from the logits of PROMPT + every (x1, x2)."""
    V, n = V_SMALL, len(PROMPT)
    joint = np.zeros((V,) * 3)
    for j, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        p = [_filtered_np(logits[j, n - 1 + i], temperature, top_k, top_p, min_p, bias) for i in range(3)]
        joint[a, b] = p[0][a] * p[1][b] * p[2]
    return joint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, drafter = _models(str(tmp_path_factory.mktemp("v8")))
    logits = _padded_logits(target, [PROMPT + [a, b] for a, b in itertools.product(range(V_SMALL), repeat=2)])
    return target, drafter, logits


@pytest.fixture(scope="module")
def runner(models):
    """The reference-kernel device side, compiled once for every scheduler of this module."""
    target, drafter, _ = models
    return _engine(target, drafter, "fixed:3", **SIZES).core_only().runner


def _chi2(tokens: np.ndarray, joint: np.ndarray) -> tuple[float, float]:
    """(p-value, count outside the support) of sampled token tuples [N, n] against a joint [V]*n."""
    n = tokens.shape[0]
    counts = np.bincount(np.ravel_multi_index(tokens.T, joint.shape), minlength=joint.size).astype(float)
    return _chi2_pvalue(counts, joint.reshape(-1) * n), float(counts[joint.reshape(-1) == 0].sum())


# ---- 1. Pallas kernels ------------------------------------------------------------------------------------------
def test_sampled_outputs_with_pallas_kernels_follow_the_target(models):
    """kernels="pallas" (ragged attention in prefill and verification, the fused Markov sampler drafting; the
    GPU/TPU path, interpreted here) under the dspark scheduler: two tokens at T = 1 over V = 8 (64 cells)
    follow the exact joint. Token 1 comes from the two-chunk prefill, token 2 from a verification pass; the
    requests run on, so passes pack two requests into the ragged kernel's flat batch."""
    import scipy  # noqa: F401  (a dev dependency: missing, the test fails rather than skips)

    target, drafter, logits = models
    # page_size 16, as the GPU kernel requires (on CPU any size would do).
    core = _engine(target, drafter, "dspark", kernels="pallas", **{**SIZES, "page_size": 16}).core_only()
    core.set_sps(_sloping_sps(core.runner))
    N = 1500
    tokens = _sample(core, N, LIVE_TOKENS, seed0=0, temperature=1.0)[:, :2]
    joint = _exact_joint(logits, 1.0).sum(-1)
    pvalue, outside = _chi2(tokens, joint)
    assert pvalue > ALPHA and outside == 0, pvalue
    took, tried = core.accepts[0], core.attempts[0]
    assert 0 < took < tried, (took, tried)  # draft 1 was accepted sometimes and rejected (recovered) sometimes


# ---- 2. filtered sampling under every scheduler -----------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["threshold:0.3", "dspark-sync", "dspark"])
def test_filtered_sampling_follows_the_filtered_target(models, runner, scheduler):
    """T = 0.7, top_k = 5, top_p = 0.94: three tokens follow the exact joint of the filtered target (52 of 512
    cells in its support) and no token outside it is ever emitted. The drafter samples from its own filtered
    distribution, so drafts are both accepted and rejected at every position."""
    _, _, logits = models
    core = _core(runner, scheduler)
    N = 1000
    tokens = _sample(core, N, LIVE_TOKENS, seed0=10_000, **FILTERED)[:, :3]
    joint = _exact_joint(logits, **FILTERED)
    pvalue, outside = _chi2(tokens, joint)
    assert outside == 0
    assert pvalue > ALPHA, pvalue
    # Drafts were accepted and rejected at every position, and ℓ varied: some passes verified every draft,
    # others fewer (the confidence-driven schedulers really chose).
    assert np.all(core.accepts > 0) and np.all(core.accepts < core.attempts), (core.accepts, core.attempts)
    s, L = core.stats, runner.L
    assert core.attempts[-1] > 0 and s["verify_tokens_total"] < (L + 1) * s["row_steps_total"], s


def test_min_p_sampling_follows_the_filtered_target(models, runner):
    """min_p = 0.1 at T = 1 (vLLM's min_p, on the target's distribution; drafts are drawn without it): three
    tokens follow the exact joint of the min_p-filtered target and no token min_p removed is ever emitted; a
    request at min_p 1 decodes exactly as a greedy one."""
    _, _, logits = models
    core = _core(runner, "dspark")
    params = dict(temperature=1.0, min_p=0.1)  # 172 of 512 cells kept (0.3 leaves the greedy one alone)
    joint = _exact_joint(logits, **params)
    assert (joint == 0).sum() > (_exact_joint(logits, 1.0) == 0).sum()  # the filter removes mass here
    pvalue, outside = _chi2(_sample(core, 1000, LIVE_TOKENS, seed0=30_000, **params)[:, :3], joint)
    assert outside == 0
    assert pvalue > ALPHA, pvalue
    assert (_sample(core, 2, LIVE_TOKENS, seed0=7, temperature=1.0, min_p=1.0).tolist()
            == _sample(core, 2, LIVE_TOKENS, seed0=7, temperature=0.0).tolist())
    with pytest.raises(ValueError, match="min_p"):
        core.add_request(EngineRequest(request_id="bad", prompt_ids=PROMPT,
                                       params=SamplingParams(max_tokens=2, min_p=-0.5), on_output=print))


def test_logit_bias_follows_the_biased_target(models, runner):
    """OpenAI's logit_bias (added to the target's raw logits; drafts are drawn without it) at T = 1: three tokens
    follow the exact joint of the biased target and the banned token never appears; greedy requests take the
    biased argmax at every position; requests without a bias sharing the passes decode as they do alone."""
    _, _, logits = models
    core = _core(runner, "dspark")
    n = len(PROMPT)
    greedy_first = int(np.argmax(logits[0, n - 1]))
    bias = {greedy_first: -100.0, 2: 1.5, 6: -0.75}  # bans the greedy token, which the drafter proposes most
    dense = np.zeros(V_SMALL)
    dense[list(bias)] = list(bias.values())
    joint = _exact_joint(logits, 1.0, bias=dense)
    sampled = _sample(core, 1000, LIVE_TOKENS, seed0=40_000, temperature=1.0,
                      logit_bias={str(k): v for k, v in bias.items()})
    pvalue, outside = _chi2(sampled[:, :3], joint)
    assert outside == 0 and not (sampled == greedy_first).any()
    assert pvalue > ALPHA, pvalue
    # Greedy: the biased argmax chain, beside requests without a bias (they decode as greedy requests alone).
    chain = []
    for i in range(3):
        j = chain[0] * V_SMALL + chain[1] if i == 2 else (chain[0] * V_SMALL if i == 1 else 0)
        chain.append(int(np.argmax(logits[j, n - 1 + i] + dense)))
    plain = _sample(core, 2, LIVE_TOKENS, seed0=7, temperature=0.0).tolist()
    mixed = {str(i): (PROMPT, SamplingParams(max_tokens=LIVE_TOKENS, seed=i, ignore_eos=True, temperature=0.0,
                                             logit_bias=bias if i % 2 else None)) for i in range(4)}
    outs = _run(core, mixed)
    assert all(_tokens(outs[str(i)])[:3] == chain for i in (1, 3)), (chain, outs)
    assert [_tokens(outs[str(i)]) for i in (0, 2)] == plain
    assert chain != plain[0][:3]
    with pytest.raises(ValueError, match="logit_bias"):
        core.add_request(EngineRequest(request_id="bad", prompt_ids=PROMPT,
                                       params=SamplingParams(max_tokens=2, logit_bias={V_SMALL: 1.0}), on_output=print))


def test_min_tokens_follows_the_banned_then_free_target(models, runner):
    """vLLM's min_tokens = 2 with a stop token id s, at T = 1: the first two tokens follow the target with s
    banned (prefill's token and the first verified row), the third the unbanned target, where s ends the request
    (reported as its stop token). The ban ends inside a verification block, at each request's own position.
    Greedy: min_tokens 3 holds the stop off for three tokens of the banned argmax chain, beside a request
    without min_tokens that stops at once."""
    _, _, logits = models
    core = _core(runner, "dspark")
    n = len(PROMPT)
    s = int(np.argmax(logits[0, n - 1]))  # the likeliest first token (the drafter proposes it most)
    ban = np.zeros(V_SMALL)
    ban[s] = -np.inf
    joint = np.zeros((V_SMALL,) * 3)
    for j, (a, b) in enumerate(itertools.product(range(V_SMALL), repeat=2)):
        p = [_filtered_np(logits[j, n - 1 + i], 1.0, 0, 1.0, bias=ban if i < 2 else None) for i in range(3)]
        joint[a, b] = p[0][a] * p[1][b] * p[2]
    N = 1000
    reqs = {str(i): (PROMPT, SamplingParams(max_tokens=LIVE_TOKENS, seed=50_000 + i, ignore_eos=True,
                                            temperature=1.0, min_tokens=2, stop_token_ids=(s,))) for i in range(N)}
    outs = _run(core, reqs)
    firsts = []
    for i in range(N):
        toks, last = _tokens(outs[str(i)]), outs[str(i)][-1]
        assert len(toks) >= 2 and s not in toks, toks
        if len(toks) == 2:
            assert last.finish_reason == "stop" and last.stop_token.token_id == s
        firsts.append((toks + [s])[:3])
    firsts = np.array(firsts)
    assert (firsts[:, 2] == s).sum() > 50  # the stop is allowed, and taken, at the third token
    pvalue, outside = _chi2(firsts, joint)
    assert outside == 0 and pvalue > ALPHA, pvalue
    # Greedy: the banned argmax chain for three tokens, then s (still the argmax there) stops it.
    chain = []
    for i in range(3):
        j = chain[0] * V_SMALL + chain[1] if i == 2 else (chain[0] * V_SMALL if i == 1 else 0)
        chain.append(int(np.argmax(logits[j, n - 1 + i] + ban)))
    greedy = dict(max_tokens=LIVE_TOKENS, ignore_eos=True, temperature=0.0, stop_token_ids=(s,))
    outs = _run(core, {"free": (PROMPT, SamplingParams(**greedy)),
                       "held": (PROMPT, SamplingParams(**greedy, min_tokens=3))})
    assert _tokens(outs["free"]) == [] and outs["free"][-1].stop_token.token_id == s
    assert _tokens(outs["held"])[:3] == chain and s not in _tokens(outs["held"])
    with pytest.raises(ValueError, match="min_tokens"):
        core.add_request(EngineRequest(request_id="bad", prompt_ids=PROMPT,
                                       params=SamplingParams(max_tokens=2, min_tokens=3), on_output=print))


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.6)


def _penalized_np(x: np.ndarray, generated: list[int], presence_penalty: float, frequency_penalty: float,
                  repetition_penalty: float) -> np.ndarray:
    """One logit row [V] penalised as vLLM documents it (written from the semantics, not penalties.py):
    repetition on the tokens of PROMPT and `generated` (x / r where x > 0, x · r otherwise), then frequency
    (× each token's count in `generated`) and presence (once per token in it)."""
    counts = np.bincount(np.asarray(generated, int), minlength=x.size)
    hit = np.isin(np.arange(x.size), PROMPT) | (counts > 0)
    x = np.where(hit, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    return x - frequency_penalty * counts - presence_penalty * (counts > 0)


def test_penalties_follow_the_penalised_target(models, runner):
    """vLLM's presence, frequency and repetition penalties at T = 1 (on the target's logits; drafts are drawn
    without them): three tokens follow the exact joint of the penalised target, where the second and third
    tokens' penalties count the tokens before them (inside a verification block, the anchor and the accepted
    drafts); the prompt spans two prefill passes, both in the repetition penalty's history. Greedy: the penalised
    argmax chain for every token of a request, beside requests without penalties that decode as they do alone.
    Out-of-range values are refused, naming the field."""
    target, _, logits = models
    core = _core(runner, "dspark")
    n = len(PROMPT)
    joint = np.zeros((V_SMALL,) * 3)
    for j, (a, b) in enumerate(itertools.product(range(V_SMALL), repeat=2)):
        p = [_filtered_np(_penalized_np(logits[j, n - 1 + i], [a, b][:i], **PENALTIES), 1.0, 0, 1.0)
             for i in range(3)]
        joint[a, b] = p[0][a] * p[1][b] * p[2]
    assert 0.5 * abs(joint - _exact_joint(logits, 1.0)).sum() > 0.2  # the penalties move the target a lot
    pvalue, outside = _chi2(_sample(core, 1000, LIVE_TOKENS, seed0=60_000, temperature=1.0, **PENALTIES)[:, :3],
                            joint)
    assert outside == 0 and pvalue > ALPHA, pvalue
    # Greedy, every token: the target's logits over the chain so far, penalised, argmax (one row per step).
    chain: list[int] = []
    for _ in range(LIVE_TOKENS):
        row = _padded_logits(target, [PROMPT + chain])[0, n - 1 + len(chain)]
        chain.append(int(np.argmax(_penalized_np(row, chain, **PENALTIES))))
    plain = _sample(core, 2, LIVE_TOKENS, seed0=7, temperature=0.0).tolist()
    assert chain != plain[0]
    mixed = {str(i): (PROMPT, SamplingParams(max_tokens=LIVE_TOKENS, seed=i, ignore_eos=True, temperature=0.0,
                                             **(PENALTIES if i % 2 else {}))) for i in range(4)}
    outs = _run(core, mixed)
    assert all(_tokens(outs[str(i)]) == chain for i in (1, 3)), (chain, outs)
    assert [_tokens(outs[str(i)]) for i in (0, 2)] == plain
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)):
        with pytest.raises(ValueError, match=field) as err:
            core.add_request(EngineRequest(request_id="bad", prompt_ids=PROMPT,
                                           params=SamplingParams(max_tokens=2, **{field: value}), on_output=print))
        assert err.value.param == field


# ---- 3. logprobs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["fixed:3", "dspark"])
def test_logprobs_equal_the_targets_log_softmax(models, runner, scheduler):
    """Every emitted token's logprob and its top alternatives equal log_softmax(target logits) at that prefix,
    for prefill's token, accepted draft tokens, recovered tokens and bonus tokens; greedy requests alone (the
    greedy verification path), then sampled ones mixed with greedy (raw logprobs: before temperature and
    filters). dspark is given a plain-step rate, so passes without drafts report logprobs too."""
    target, _, _ = models
    core = _core(runner, scheduler, plain=1.2 if scheduler == "dspark" else None)
    # Confidences taken at their word (a prior no evidence moves), so dspark keeps drafting deep enough to reach
    # every kind of token below; the tiny drafter over-promises, and priced by what it delivers it would not.
    core.scheduler.calibration = GainCalibration(prior=1e12)
    prompts = [PROMPT, [4], [7, 7, 2, 6, 1, 0, 5, 3, 2, 4, 6, 1], [2, 5, 5]]  # 1 or 2 prefill chunks
    greedy = {"temperature": 0.0}
    waves = [  # logprobs=None: none reported; 0: the token's own only; 20 > V: all V alternatives
        {f"g{i}": (p, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=k, **greedy))
         for i, (p, k) in enumerate(zip(prompts, [5, 0, 20, None], strict=True))},
        {f"s{i}": (prompts[i % 4], SamplingParams(max_tokens=10, seed=i, ignore_eos=True, logprobs=k, **params))
         for i, (k, params) in enumerate(zip([3, 8, None, 1, 5, 2, 0, 4, 20, 6, 7, None] * 2, [
             {"temperature": 1.0}, greedy, {"temperature": 1.0}, FILTERED] * 6, strict=True))},
    ]
    seen = {}
    for wave in waves:
        outs = _run(core, wave)
        seen.update(outs)
        rows = {rid: prompt + _tokens(outs[rid]) for rid, (prompt, _) in wave.items()}
        ref = dict(zip(rows, _padded_logits(target, list(rows.values())), strict=True))
        for rid, (prompt, params) in wave.items():
            toks = _tokens(outs[rid])
            assert len(toks) == 10, rid
            if params.logprobs is None:
                assert all(o.logprobs is None for o in outs[rid]), rid
                continue
            lps = [lp for o in outs[rid] for lp in o.logprobs]
            assert [lp.token_id for lp in lps] == toks, rid
            for j, lp in enumerate(lps):
                z = ref[rid][len(prompt) - 1 + j]
                exact = z - z.max() - np.log(np.exp(z - z.max()).sum())  # log_softmax in f64
                np.testing.assert_allclose(lp.logprob, exact[toks[j]], atol=1e-4, err_msg=f"{rid} token {j}")
                top = sorted(range(V_SMALL), key=lambda v: -exact[v])[:min(params.logprobs, V_SMALL)]
                assert [t for t, _ in lp.top] == top, (rid, j, lp.top)
                np.testing.assert_allclose([v for _, v in lp.top], exact[top], atol=1e-4)
    # A stop token id ends a greedy row and is reported apart (RequestOutput.stop_token), with the logprob the
    # row reported for that token when it ran on.
    stopped = {}
    for rid, (prompt, params) in waves[0].items():
        toks = _tokens(seen[rid])
        j = max(j for j, t in enumerate(toks) if t not in toks[:j])  # the last token's first occurrence
        stopped[rid] = (prompt, dataclasses.replace(params, stop_token_ids=(toks[j],)), j)
    outs = _run(core, {rid: (p, params) for rid, (p, params, _) in stopped.items()})
    for rid, (_, params, j) in stopped.items():
        full = [lp for o in seen[rid] for lp in (o.logprobs or ())]
        assert _tokens(outs[rid]) == _tokens(seen[rid])[:j] and outs[rid][-1].finish_reason == "stop", rid
        stop = outs[rid][-1].stop_token
        assert stop.token_id == params.stop_token_ids[0], rid
        if params.logprobs is None:
            assert stop.logprob is None, rid
        else:
            assert [t for t, _ in stop.top] == [t for t, _ in full[j].top], rid
            np.testing.assert_allclose([stop.logprob] + [v for _, v in stop.top],
                                       [full[j].logprob] + [v for _, v in full[j].top], atol=1e-4, err_msg=rid)
    # Every kind of emitted token was checked: accepted drafts, rejected ones (then a recovered token), all
    # three accepted (then a bonus token), and (dspark) passes without drafts as well as with.
    assert core.accepts[0] > 0 and np.any(core.accepts < core.attempts) and core.accepts[-1] > 0, core.accepts
    if scheduler == "dspark":
        assert 0 < core.stats["plain_steps_total"] < core.stats["steps_total"], core.stats


# ---- 4. a mesh with a data axis ---------------------------------------------------------------------------------
MESH_REQUESTS = [(PROMPT, dict(temperature=0.0)), ([4, 6], dict(temperature=0.0)),
                 ([7, 7, 2, 6, 1, 0, 5, 3, 2, 4, 6], dict(temperature=0.0)),
                 (PROMPT, dict(temperature=1.0, seed=3)), ([2, 5, 5], dict(FILTERED, seed=4))]

MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from flax import nnx
    sys.path.insert(0, {tests!r})
    import test_engine_sampling as t
    from test_engine import _engine
    assert jax.device_count() == 8
    target, drafter = t._models({tmp!r})
    core = _engine(target, drafter, "fixed:3", mesh_shape=(2, 4), **t.SIZES).core_only()
    runner = core.runner
    specs = {{}}
    for side, params in (("target", runner.target_params), ("drafter", runner.drafter_params)):
        for path, x in nnx.traversals.flatten_mapping(nnx.to_pure_dict(params)).items():
            s = x.sharding
            specs[side + "." + ".".join(map(str, path))] = [str(s.spec), dict(s.mesh.shape), len(s.device_set)]

    def pools(when, runner):
        for side, kv in (("tkv", runner.target_kv), ("dkv", runner.drafter_kv)):
            for i, x in enumerate((kv.k, kv.v)):  # [num_layers, P, K, page_size, H] each
                s = x.sharding
                specs[f"{{when}}.{{side}}.{{i}}"] = [(list(s.spec) + [None] * 5)[:5], dict(s.mesh.shape),
                                                   len(s.device_set),
                                                   x.addressable_shards[0].data.shape[2]]

    from dspark_jax.runner import ModelRunner
    from dspark_jax.sharding import make_mesh
    fresh = ModelRunner(target, drafter, max_batch=2, num_pages=8, page_size=4, max_pages=4, mesh=make_mesh(2, 4))
    pools("start", fresh)  # as allocated, before any program ran
    outputs = t._mesh_outputs(core)
    pools("served", runner)
    json.dump({{"outputs": outputs, "specs": specs}}, open({out!r}, "w"))
""")


def _mesh_outputs(core) -> list[list[int]]:
    reqs = {str(i): (p, SamplingParams(max_tokens=12, ignore_eos=True, **kw))
            for i, (p, kw) in enumerate(MESH_REQUESTS)}
    outs = _run(core, reqs)
    return [_tokens(outs[str(i)]) for i in range(len(reqs))]


def test_engine_on_a_data_and_model_mesh_matches_single_device(runner, tmp_path):
    """mesh_shape (2, 4) on 8 simulated CPU devices: the attention and MLP weights of target and drafter are
    split over `model` on a mesh with data = 2, and greedy and seeded sampled outputs equal the single-device
    engine's (same models, scheduler and seeds). The paged KV pools of target and drafter are split by KV head
    over `model` from the moment they are allocated (each device holds 4 / 4 = 1 head) and stay so after
    serving. Not asserted: any use of the `data` axis (batch rows and pools are replicated over it)."""
    single = _mesh_outputs(_core(runner, "fixed:3"))
    out = tmp_path / "out.json"
    code = MESH_SCRIPT.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "m"), out=str(out))
    run_on_eight_devices(code, timeout=900)
    res = json.loads(out.read_text())
    assert res["outputs"] == single
    specs = res["specs"]
    pools = {k: v for k, v in specs.items() if k.startswith(("start.", "served."))}
    specs = {k: v for k, v in specs.items() if k not in pools}
    assert len(pools) == 2 * 2 * 2, sorted(pools)  # k and v pools (layers stacked) of target and drafter, twice
    for name, (spec, mesh, devices, heads_per_shard) in pools.items():
        assert spec == [None, None, "model", None, None] and mesh == {"data": 2, "model": 4}, (name, spec, mesh)
        assert devices == 8 and heads_per_shard == 1, (name, devices, heads_per_shard)
    split = [k for k in specs if any(w in k for w in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp."))]
    assert len(split) == 7 * 2, sorted(specs)  # q, k, v, o, gate, up, down of the target (stacked) and drafter
    for name in split:
        spec, mesh, devices = specs[name]
        assert "model" in spec and mesh == {"data": 2, "model": 4} and devices == 8, (name, specs[name])
