"""The speculative paths draft what the drafter, computed from scratch, would draft.

Greedy equality cannot see a wrong draft (verification corrects any draft), so these tests open the loop: they
run rounds one by one and, before every round, take the draft distributions q_k [B, L, V] and confidences c_k
drafted from the drafter's *incrementally built* context (prefill, then one KV-injection write per round) and
compare them with tests/naive_drafter.py recomputing the drafter from scratch — context features from the
transformers model's hidden states on the committed tokens, context K/V at positions 0..n−1, the block at
positions n.. — teacher-forced on the same draft tokens. Two paths: the paged round that `generate` and the
serving engine run for block drafters (dspark_jax/runner.py, with pages scattered over the pool), and the dense
`spec_step` that EAGLE-3 runs.
A wrong RoPE position, a wrong write offset, a context length off by one or a Markov bias fed the wrong token
all change q; none of them changes greedy output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REFERENCE_PROMPTS
from naive_drafter import NaiveDrafter, flat_params, hf_features, softmax

from dspark_jax import draft_vocab
from dspark_jax.decoding import first_token, pad_prompts, prefill, row_keys, sampling_arrays, step_keys
from dspark_jax.drafter import draft_block
from dspark_jax.drafter_model import TargetHead
from dspark_jax.keys import row_key_data
from dspark_jax.runner import ModelRunner
from dspark_jax.spec_decode import Policy, drafter_prefill, spec_step


def check_row(naive, hf, cfg, seq, tok, q, conf, atol: float, rnd: int, b: int) -> float:
    """One row's drafted block against the naive drafter: seq = committed tokens + anchor, tok [L] the drafted
    tokens (teacher-forced into the naive Markov head), q [L, V] and conf [L] what the path drafted. Asserts
    |log q − log q_naive| < atol and the confidences; returns the largest log-q error."""
    committed = seq[:-1]
    prev = [seq[-1]] + [int(t) for t in tok[:-1]]
    ref, ref_conf = naive.draft_logits(seq, hf_features(hf, committed, cfg.target_layers), prev)
    err = float(np.abs(np.log(softmax(ref)) - np.log(np.maximum(q, 1e-38))).max())
    assert err < atol, (f"round {rnd} row {b}: |log q - log naive q| = {err:.2e}", cfg.kind)
    if ref_conf is not None:
        np.testing.assert_allclose(conf, 1 / (1 + np.exp(-ref_conf)), atol=atol, err_msg=f"{rnd=} {b=}")
    return err


def spec_rounds_against_reference(hf, target, drafter, prompts, rounds: int, atol: float = 1e-4) -> dict:
    """Runs `rounds` greedy speculative rounds; before each, checks every row's draft distributions (as log q,
    which keeps small probabilities visible) and confidences against the naive drafter.
    Returns {"accepted": total accepted draft tokens, "max_err": largest |log q − log q_naive|}."""
    cfg = drafter.config
    B = len(prompts)
    tied = target.config.tie_word_embeddings
    head = TargetHead.from_params(target.params, tied)
    naive = NaiveDrafter(flat_params(drafter), cfg, head.embed, head.lm_head)
    tokens, lens = pad_prompts(prompts)
    capacity = 64
    tcache, dcache = target.init_cache(B, capacity), drafter.init_cache(B, capacity)
    temp, tk, tp = sampling_arrays(B, 0.0, 0, 1.0)
    keys = row_keys(0, B)
    logits, tcache, feats = prefill(target.graphdef, target.params, jnp.asarray(tokens), tcache, jnp.asarray(lens),
                                    hidden_layers=cfg.target_layers)
    dcache = drafter_prefill(drafter.graphdef, drafter.params, target.params, dcache, feats, jnp.asarray(tokens),
                             jnp.asarray(lens), tied=tied)
    anchor = first_token(logits, keys, temp, tk, tp)
    seqs = [list(p) + [int(a)] for p, a in zip(prompts, np.asarray(anchor), strict=True)]
    # Drafting at temperature 1 shows the whole distribution; rounds themselves stay greedy.
    draft = jax.jit(functools.partial(draft_block, drafter.graphdef))
    ones, zeros = jnp.ones((B,)), jnp.zeros((B,), jnp.int32)
    accepted, max_err = 0, 0.0
    for rnd in range(1, rounds + 1):
        tok, q, conf = jax.device_get(draft(drafter.params, head, dcache, anchor, step_keys(keys, 10_000 + rnd),
                                            ones, zeros, ones))
        n_ctx = np.asarray(dcache.lengths)
        for b in range(B):
            assert n_ctx[b] == len(seqs[b]) - 1 - (cfg.kind == "eagle3"), (rnd, b, n_ctx[b], len(seqs[b]) - 1)
            max_err = max(max_err, check_row(naive, hf, cfg, seqs[b], tok[b], q[b], conf[b], atol, rnd, b))
        tcache, dcache, anchor, emitted, num_emitted, _, m, _ = spec_step(
            target.graphdef, target.params, drafter.graphdef, drafter.params, tcache, dcache, anchor, keys, rnd,
            temp, tk, tp, dcfg=cfg, policy=Policy(kind="fixed"), tied=tied)
        emitted, num_emitted = np.asarray(emitted), np.asarray(num_emitted)
        for b in range(B):
            seqs[b] += [int(t) for t in emitted[b, : num_emitted[b]]]
        accepted += int(np.asarray(m).sum())
    return {"accepted": accepted, "max_err": max_err}


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_spec_path_drafts_equal_the_naive_drafter(tiny_hf_targets, distilled_drafter, kind):
    """Distilled drafters (conftest.distilled_drafter), so rounds accept several tokens and the multi-token
    context writes are exercised; three ragged rows (n = 5, 9, 2 at the start) on the qwen3 target (q/k norm,
    head_dim ≠ D / N)."""
    hf, target = tiny_hf_targets["qwen3"]
    d = distilled_drafter("qwen3", kind, block_size=4)
    res = spec_rounds_against_reference(hf, target, d, REFERENCE_PROMPTS, rounds=5)
    print(f"\n{kind}: accepted {res['accepted']}, max |log q - log naive q| {res['max_err']:.1e}")
    assert res["accepted"] > 0, "no draft accepted: the multi-token context writes were not exercised"


def runner_rounds_against_reference(hf, target, drafter, prompts, rounds: int, atol: float = 1e-4) -> dict:
    """As `spec_rounds_against_reference`, through the paged round: each row's pages are scattered over the
    pool in reverse order (a wrong block-table lookup reads another row's context), rows are prefilled in
    chunks of 4 (several drafter-context writes per prompt), drafts come from `ModelRunner.draft` at T = 1 and
    the rounds themselves are greedy `ModelRunner.step`s verifying the whole block."""
    cfg = drafter.config
    B, L, page = len(prompts), cfg.block_size, 4
    max_pages = 16
    runner = ModelRunner(target, drafter, max_batch=B, num_pages=B * max_pages, page_size=page, max_pages=max_pages,
                         chunk_sizes=(4,), kernels="reference")
    head = TargetHead.from_params(target.params, target.config.tie_word_embeddings)
    naive = NaiveDrafter(flat_params(drafter), cfg, head.embed, head.lm_head)
    pages = np.arange(B * max_pages, dtype=np.int32)[::-1].reshape(max_pages, B).T.copy()  # interleaved rows
    keys = row_key_data(0, B)
    seqs = []
    for b, p in enumerate(prompts):
        for start in range(0, len(p), 4):
            tok = runner.prefill(p[start : start + 4], start, pages[b], keys[b], 0.0, 0, 1.0)[0]
        seqs.append(list(p) + [tok])
    accepted, max_err = 0, 0.0
    for rnd in range(1, rounds + 1):
        batch = runner.empty_batch(B)
        batch.lengths[:] = [len(s) - 1 for s in seqs]
        batch.anchors[:] = [s[-1] for s in seqs]
        batch.block_tables[:], batch.keys[:], batch.rounds[:] = pages, keys, rnd
        sampled = dataclasses.replace(batch, temperature=np.ones(B, np.float32))  # drafts at T = 1: all of q
        tok, q, conf = runner.draft(sampled)
        tok, q, conf = jax.device_get((tok, draft_vocab.to_vocab(q, drafter.config), conf))  # q over the target's V
        for b in range(B):
            max_err = max(max_err, check_row(naive, hf, cfg, seqs[b], tok[b], q[b], conf[b], atol, rnd, b))
        res = runner.step(batch, capacity=runner.capacities[-1], lengths=np.full(B, L, np.int32))
        for b in range(B):
            seqs[b] += [int(t) for t in res.emitted[b, : res.num_emitted[b]]]
        accepted += int(res.num_accepted.sum())
    return {"accepted": accepted, "max_err": max_err}


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_paged_round_drafts_equal_the_naive_drafter(tiny_hf_targets, distilled_drafter, kind):
    """The round `generate` and the serving engine run: the same three ragged rows and distilled drafters."""
    hf, target = tiny_hf_targets["qwen3"]
    d = distilled_drafter("qwen3", kind, block_size=4)
    res = runner_rounds_against_reference(hf, target, d, REFERENCE_PROMPTS, rounds=5)
    print(f"\n{kind} (paged): accepted {res['accepted']}, max |log q - log naive q| {res['max_err']:.1e}")
    assert res["accepted"] > 0, "no draft accepted: the multi-token context writes were not exercised"
