"""EAGLE-3's speculative round: `spec_step`, one pure jitted round over dense caches, and `generate_speculative`,
the loop around it. `generate` sends EAGLE-3 drafters here because they draft token by token from their own
growing cache, which the paged round does not hold; block drafters (DSpark, DFlash) and target-only decoding
run the serving engine's round (dspark_jax/runner.py). The key scheme is the same (dspark_jax/keys.py).

A round (paper Fig. 1), per row with n committed tokens and anchor x_n (emitted, not yet in the target cache):
  1. draft      — the drafter proposes x_{n+1..n+L} with draft probs q and confidences c (drafter.draft_block);
  2. schedule   — a policy picks a verification length ℓ ∈ 0..L from survival a_k = c_1⋯c_k;
  3. verify     — the target runs [anchor, x_1..x_L] (static width L+1; only ℓ+1 tokens are real) and
                  rejection-samples: m accepted, then a recovered or bonus token (verification.verify);
  4. commit     — target cache length n → n+m+1 (anchor + accepted); the drafter's context gets the
                  target features of those positions (KV injection, computed once here);
  5. emit       — accepted + 1 tokens; the last becomes the next anchor.
Non-anticipation: every policy here decides ℓ before (fixed, threshold) or with the early-stop break
(dspark-sync, Algorithm 1) so the admission of x_k never depends on x_k's own value (Appendix A).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import draft_vocab
from dspark_jax.decoding import (
    GenerateResult,
    StopTracker,
    first_token,
    pad_prompts,
    prefill,
    round_up,
    row_keys,
    sampling_arrays,
    step_keys,
)
from dspark_jax.drafter import draft_block
from dspark_jax.drafter_model import DrafterModel, TargetHead
from dspark_jax.policy import Policy
from dspark_jax.runner import Static
from dspark_jax.sampling import all_greedy, filter_probs
from dspark_jax.verification import acceptance_counts, greedy_verify, verify


def _unwrap(graph):
    return graph.value if isinstance(graph, Static) else graph


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "dcfg", "policy", "tied", "kernels"),
                   donate_argnames=("tcache", "dcache"))
def spec_step(tgraph, tparams, dgraph, dparams, tcache, dcache, anchor, keys, rnd, temperature, top_k, top_p, *,
              dcfg, policy: Policy, tied: bool, kernels: str = "auto", dhead=None):
    """One speculative round for a batch. Returns (tcache, dcache, next anchor [B], emitted [B, L+1]
    (padded with −1), num_emitted [B], verification lengths [B], num_accepted [B], confidence [B, L]).
    `dhead`: a reduced draft vocabulary's head columns [D, Vd] (`draft_vocab.subset_head`, gathered once by the
    caller rather than in every round), or None. `tgraph` / `dgraph` may come wrapped in `runner.Static`
    (hashed once: jit hashes static arguments on every call, and a 30-layer graphdef's hash is ~5 ms of Python)."""
    L = dcfg.block_size
    tgraph, dgraph = _unwrap(tgraph), _unwrap(dgraph)
    target = nnx.merge(tgraph, tparams)
    drafter: DrafterModel = nnx.merge(dgraph, dparams)
    head = TargetHead.from_params(tparams, tied, draft_lm_head=dhead)
    round_keys = step_keys(keys, rnd)
    draft_keys, verify_keys = step_keys(round_keys, 0), step_keys(round_keys, 1)

    draft, q, conf = draft_block(dgraph, dparams, head, dcache, anchor, draft_keys, temperature, top_k, top_p,
                                 kernels)
    lengths = policy.lengths(conf, L)
    n = tcache.lengths
    block = jnp.concatenate([anchor[:, None], draft], axis=1)  # [B, L+1]
    logits, tcache, feats = target(block, tcache, lengths + 1, hidden_layers=dcfg.target_layers, kernels=kernels)
    # All-greedy batches skip the V-sized filtering and random draws: greedy_verify equals verify on one-hots.
    res = jax.lax.cond(
        all_greedy(temperature),
        lambda: greedy_verify(jnp.argmax(logits, -1).astype(jnp.int32), draft, lengths),
        lambda: verify(verify_keys, filter_probs(logits, temperature, top_k, top_p), draft, q, lengths))
    m = res.num_accepted
    tcache = tcache.with_lengths(n + m + 1)
    rows = jnp.arange(anchor.shape[0])
    if dcfg.kind == "eagle3":
        fused = drafter.project_features(feats)  # [B, L+1, D]
        ctx_feats = jnp.concatenate([dcache.last_feature[:, None].astype(fused.dtype), fused[:, :L]], 1)
        positions = (n - 1)[:, None] + jnp.arange(L + 1, dtype=jnp.int32)
        dcache = drafter.write_context(dcache, head, ctx_feats, positions, n + m, next_tokens=block,
                                       last_feature=fused[rows, m])
    else:
        positions = n[:, None] + jnp.arange(L + 1, dtype=jnp.int32)
        last = drafter.project_features(feats[rows, m][:, None])[:, 0] if dcfg.anchor_feature else None
        dcache = drafter.write_context(dcache, head, feats, positions, n + m + 1,
                                       last_feature=None if last is None else last.astype(dcache.last_feature.dtype))
    next_anchor = res.emitted_tokens[rows, m]
    return tcache, dcache, next_anchor, res.emitted_tokens, res.num_emitted, lengths, m, conf


@functools.partial(jax.jit, static_argnames=("dgraph", "tied"), donate_argnames=("dcache",))
def drafter_prefill(dgraph, dparams, tparams, dcache, feats, tokens, lengths, *, tied: bool):
    """Writes the prompt's target features into the drafter's context cache (the prompt is [B, T], ragged)."""
    drafter: DrafterModel = nnx.merge(dgraph, dparams)
    return drafter.write_prompt(dcache, TargetHead.from_params(tparams, tied), tokens, feats, lengths)


def generate_speculative(target, drafter, prompts, *, policy=None, max_new_tokens, temperature, top_k, top_p,
                         seed, ignore_eos, on_tokens=None, kernels="auto", on_round=None) -> GenerateResult:
    """Speculative decoding of a batch of prompts. See `dspark_jax.generate`.

    on_round: optional callback(live bool [B], lengths [B], num_accepted [B], confidence [B, L]) after every
        round (host arrays), e.g. to collect calibration data.
    """
    drafter.check_target(target)
    dcfg = drafter.config
    L = dcfg.block_size
    policy = policy if isinstance(policy, Policy) else Policy.parse(policy or "fixed")
    if policy.kind in ("none", "dspark"):
        raise ValueError(f"generate with a drafter takes fixed[:N], threshold:X or dspark-sync, not {policy.kind!r}"
                         + (" (the dspark policy needs the serving engine)" if policy.kind == "dspark" else ""))
    if policy.kind != "fixed" and not dcfg.confidence:
        raise ValueError(f"policy {policy.kind!r} needs a confidence head; a {dcfg.kind} drafter has none")
    B = len(prompts)
    temp, tk, tp = sampling_arrays(B, temperature, top_k, top_p)
    tokens, lens = pad_prompts(prompts)
    capacity = round_up(tokens.shape[1] + max_new_tokens + 2 * (L + 1), 64)
    tcache, dcache = target.init_cache(B, capacity), drafter.init_cache(B, capacity)
    keys = row_keys(seed, B)
    tied = target.config.tie_word_embeddings
    dhead = (draft_vocab.subset_head(TargetHead.from_params(target.params, tied).lm_head, dcfg)
             if draft_vocab.is_reduced(dcfg) else None)  # gathered once, not in every round
    track = StopTracker(B, max_new_tokens, target.eos_token_ids, ignore_eos)
    attempts, accepts = np.zeros(L, np.int64), np.zeros(L, np.int64)
    emitted_total = row_rounds = 0

    t0 = time.perf_counter()
    logits, tcache, feats = prefill(target.graphdef, target.params, jnp.asarray(tokens), tcache, jnp.asarray(lens),
                                    hidden_layers=dcfg.target_layers, kernels=kernels)
    dcache = drafter_prefill(drafter.graphdef, drafter.params, target.params, dcache, feats, jnp.asarray(tokens),
                             jnp.asarray(lens), tied=tied)
    # The first token comes from the prefill (as in target-only decoding) and is the first anchor.
    anchor = first_token(logits, keys, temp, tk, tp)
    first = np.asarray(anchor)
    for b in range(B):
        taken = track.push(b, first[b : b + 1])
        if taken and on_tokens is not None:
            on_tokens(b, taken)
    t1 = time.perf_counter()
    rnd = 0
    tgraph, dgraph = Static(target.graphdef), Static(drafter.graphdef)
    while not track.done.all():
        rnd += 1
        live = ~track.done
        tcache, dcache, anchor, emitted, num_emitted, lengths, m, conf = spec_step(
            tgraph, target.params, dgraph, drafter.params, tcache, dcache, anchor, keys, rnd,
            temp, tk, tp, dcfg=dcfg, policy=policy, tied=tied, kernels=kernels, dhead=dhead)
        emitted, num_emitted = np.asarray(emitted), np.asarray(num_emitted)
        lengths, m = np.asarray(lengths), np.asarray(m)
        if on_round is not None:
            on_round(live, lengths, m, np.asarray(conf))
        for b in np.flatnonzero(live):
            taken = track.push(b, emitted[b, : num_emitted[b]])
            if taken and on_tokens is not None:
                on_tokens(b, taken)
        tried, took = acceptance_counts(lengths, m, live, L)  # position-wise conditional acceptance (Fig. 2)
        attempts += tried
        accepts += took
        emitted_total += int(num_emitted[live].sum())
        row_rounds += int(live.sum())
    t2 = time.perf_counter()
    stats = {"rounds": rnd, "tau": emitted_total / max(row_rounds, 1), "row_rounds": row_rounds,
             "acceptance_attempts": attempts.tolist(), "acceptance_accepts": accepts.tolist(),
             "conditional_acceptance": (accepts / np.maximum(attempts, 1)).tolist()}
    return GenerateResult(tokens=track.out, stats=stats, timings={"prefill_s": t1 - t0, "decode_s": t2 - t1})
