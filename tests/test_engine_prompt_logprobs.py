"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what `echo` scores) from the engine's chunked prefill
(serve/engine.py, `prefill_program` in dspark_jax/runner.py), on a tiny real target with a drafter.

The oracle is the transformers model the target was loaded from: every prompt token after the first has the
log-softmax of its logits at the position before, with the same top alternatives, across chunk boundaries and
requests packed into one pass, whatever the drafter and scheduler, under preemption, for prompts of one token
and for `max_tokens` 0 (the request ends after its prefill). Asking for them compiles nothing new (the flag is
traced, not static).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits, make_hf_model, target_from_hf
from test_spec_decode import _drafter

import dspark_jax
from dspark_jax.runner import COMPILES, PROGRAMS
from serve.startup import create_engine
from serve.types import EngineRequest, SamplingParams

LENGTHS = [1, 8, 9, 20, 33, 17, 2]  # chunks of 8: one-token prompts, exact multiples, ragged tails


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model("llama", tied=True)
    target = target_from_hf(hf, tmp_path_factory.mktemp("llama"))
    drafter = _drafter(target, "dspark", 4, seed=3, num_layers=1, markov_rank=8)
    prompts = [[int(x) for x in np.random.default_rng(50 + i).integers(3, 128, size=n)] for i, n in enumerate(LENGTHS)]
    return hf, target, drafter, prompts


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_prompt_logprobs_equal_the_targets_log_softmax(tiny):
    hf, target, drafter, prompts = tiny
    # 18 pages of 4 (one request of max_model_len): two long requests cannot both grow, so some are preempted.
    engine = create_engine(target_obj=target, drafter_obj=drafter, scheduler="fixed:3", max_batch=2,
                           max_model_len=64, page_size=4, num_pages=18, chunk_sizes=(8,), profile=False,
                           progress=False)
    core = engine.core_only()
    try:
        compiled = {k: COMPILES[k] for k in PROGRAMS}
        params = {}
        for i in range(len(prompts)):
            k = [3, 0, None, 20, 5, 2, 1][i]
            params[str(i)] = SamplingParams(max_tokens=[0, 12, 12, 12, 0, 12, 12][i], prompt_logprobs=k,
                                            logprobs=k if i % 3 == 0 else None, ignore_eos=True,
                                            **({"temperature": 0.8, "seed": i} if i == 5 else {"temperature": 0.0}))
        outs: dict[str, list] = {}
        for i, p in enumerate(prompts):
            core.add_request(EngineRequest(request_id=str(i), prompt_ids=p, params=params[str(i)],
                                           on_output=lambda o: outs.setdefault(o.request_id, []).append(o)))
        while core.has_work():
            core.step()
        assert core.stats["preemptions_total"] > 0
        assert core.stats["prefill_chunks_total"] > core.stats["prefill_passes_total"]  # some passes packed
        assert {k: COMPILES[k] for k in PROGRAMS} == compiled  # asking for them compiled nothing
        greedy = dspark_jax.generate(target, prompts, max_new_tokens=12, ignore_eos=True).tokens
        for i, p in enumerate(prompts):
            rid, sp = str(i), params[str(i)]
            reports = outs[rid]
            gen = [t for o in reports for t in o.token_ids]
            assert reports[-1].finish_reason == "length" and len(gen) == sp.max_tokens, rid
            if sp.temperature == 0.0:
                assert gen == greedy[i][: sp.max_tokens], rid
            carrying = [o.prompt_logprobs for o in reports if o.prompt_logprobs is not None]
            if sp.prompt_logprobs is None:
                assert not carrying, rid
                continue
            assert len(carrying) == 1 and reports[0].prompt_logprobs is carrying[0], rid  # the first report only
            plp = carrying[0]
            assert [lp.token_id for lp in plp] == p and plp[0].logprob is None and plp[0].top == ()
            exact = _log_softmax(hf_logits(hf, np.asarray([p + gen]))[0])
            for j in range(1, len(p)):
                row = exact[j - 1]
                np.testing.assert_allclose(plp[j].logprob, row[p[j]], atol=1e-4, err_msg=f"{rid} prompt {j}")
                top = np.argsort(-row, kind="stable")[: sp.prompt_logprobs]
                assert [t for t, _ in plp[j].top] == list(top), (rid, j)
                np.testing.assert_allclose([v for _, v in plp[j].top], row[top], atol=1e-4)
            if sp.logprobs is not None:  # the generated tokens continue the same distribution
                lps = [lp for o in reports for lp in o.logprobs or ()]
                for j, (lp, t) in enumerate(zip(lps, gen, strict=True)):
                    np.testing.assert_allclose(lp.logprob, exact[len(p) - 1 + j, t], atol=1e-4)
        m = core.metrics()
        assert m["free_pages"] == m["total_pages"]
    finally:
        engine.stop()



def test_prompt_logprobs_are_built_a_block_of_rows_at_a_time(monkeypatch):
    """A prefill pass's prompt logprobs equal those of the whole [C, V] logits at once, built a block of rows at a
    time; compiled, the pass reserves one block's logits, not C rows' (a `cond` branch's buffers are reserved
    whether it runs or not, and most passes do not ask)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax import runner

    rng = np.random.default_rng(0)
    C, D, V = 37, 16, 300
    w = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)

    def head(x):
        return x @ w

    h = jnp.asarray(rng.normal(size=(C, D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, C), jnp.int32)
    want = runner._logprobs_if(True, lambda: head(h), tokens, V)
    monkeypatch.setattr(runner, "PROMPT_LOGPROB_ROWS", 8)  # 37 rows: 5 blocks, the last one padded
    got = runner._prompt_logprobs_if(True, head, h, tokens, V)
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    assert all(not np.asarray(x).any() for x in runner._prompt_logprobs_if(False, head, h, tokens, V))

    big = 4096
    fn = jax.jit(lambda flag, x, t: runner._prompt_logprobs_if(flag, head, x, t, V))
    mem = fn.lower(False, jnp.zeros((big, D)), jnp.zeros(big, jnp.int32)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < big * V * 4 / 2, mem.temp_size_in_bytes  # [C, V] f32 would be 4.9 MB
