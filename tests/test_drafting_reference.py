"""The speculative paths draft what the drafter, computed from scratch, would draft.

Greedy equality cannot see a wrong draft (verification corrects any draft), so these tests open the loop: they
run rounds one by one and, before every round, take the draft distributions q_k [B, L, V] and confidences c_k
drafted from the drafter's *incrementally built* context (prefill, then one KV-injection write per round) and
compare them with tests/naive_drafter.py recomputing the drafter from scratch — context features from the
transformers model's hidden states on the committed tokens, context K/V at positions 0..n−1, the block at
positions n.. — teacher-forced on the same draft tokens, through the paged round that `generate` and the serving
engine run for every drafter kind (dspark_jax/runner.py, with pages scattered over the pool).
A wrong RoPE position, a wrong write offset, a context length off by one or a Markov bias fed the wrong token
all change q; none of them changes greedy output.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import REFERENCE_PROMPTS
from naive_drafter import NaiveDrafter, flat_params, hf_features, softmax

from dspark_jax import draft_vocab
from dspark_jax.drafter_model import TargetHead
from dspark_jax.keys import row_key_data
from dspark_jax.runner import ModelRunner, StepKind


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


def runner_rounds_against_reference(hf, target, drafter, prompts, rounds: int, atol: float = 1e-4) -> dict:
    """Runs `rounds` greedy speculative rounds through the paged round; before each, checks every row's draft
    distributions (as log q, which keeps small probabilities visible) and confidences against the naive drafter.
    Each row's pages are scattered over the pool in reverse order (a wrong block-table lookup reads another
    row's context), rows are prefilled in chunks of 4 (several drafter-context writes per prompt), drafts come
    from `ModelRunner.draft` at T = 1 and the rounds themselves are greedy `ModelRunner.step`s verifying the
    whole block.
    Returns {"accepted": total accepted draft tokens, "max_err": largest |log q − log q_naive|}."""
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
        res = runner.step(batch, StepKind.SPECULATE, capacity=runner.capacities[-1], lengths=np.full(B, L, np.int32))
        for b in range(B):
            seqs[b] += [int(t) for t in res.emitted[b, : res.num_emitted[b]]]
        accepted += int(res.num_accepted.sum())
    return {"accepted": accepted, "max_err": max_err}


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_paged_round_drafts_equal_the_naive_drafter(tiny_hf_targets, distilled_drafter, kind):
    """Distilled drafters (conftest.distilled_drafter), so rounds accept several tokens and the multi-token
    context writes are exercised; three ragged rows (n = 5, 9, 2 at the start) on the qwen3 target (q/k norm,
    head_dim ≠ D / N)."""
    hf, target = tiny_hf_targets["qwen3"]
    d = distilled_drafter("qwen3", kind, block_size=4)
    res = runner_rounds_against_reference(hf, target, d, REFERENCE_PROMPTS, rounds=5)
    print(f"\n{kind} (paged): accepted {res['accepted']}, max |log q - log naive q| {res['max_err']:.1e}")
    assert res["accepted"] > 0, "no draft accepted: the multi-token context writes were not exercised"
