"""The round on paged caches, the one decode loop of `generate`, the serving engine and data generation (§5.2).

A round is one of three kinds (`StepKind`): a plain step (every request verifies its anchor alone, no draft
pass), a probe (a draft pass for fresh confidences, nothing verified) or a speculative step. A speculative
round for R running requests, each with n committed tokens and an anchor (the last emitted token, not yet
in the target cache):
  1. draft     — `draft`: the drafter's block pass reads each request's injected context from its pages and
                 samples draft tokens, draft probs q and confidences c (`drafter.draft_from_hidden`); an
                 EAGLE-3 drafter runs its L autoregressive steps instead, a `lax.scan` over its paged
                 context (`drafter.draft_eagle`, `paged.eagle_step_paged`).
  2. schedule  — verification lengths ℓ from the policy (dspark_jax/policy.py): given by the host
                 (mode "lengths"), computed on device from the current confidences (mode "policy"), or
                 filled on device from the current survival up to a capacity K chosen from stale
                 confidences (mode "topk", §5.2: the host never waits for the drafts).
  3. verify    — `verify`: the requests' [anchor, draft_1..draft_ℓ] packed back to back into one flat
                 capacity bucket, one target pass over pages (projections and MLPs ∝ the bucket, attention
                 over the pages in use only), the LM head on those rows only, lossless verification.
  4. commit    — the target K/V of the pass is already in the pages; the drafter's context gets the target
                 features of the same positions (KV injection). The host advances n by accepted + 1.
Cost follows the live work: the running requests are compacted into the first R rows of a batch bucket
(powers of two), every program is compiled per (batch bucket, capacity bucket) at start-up, and attention
walks only the pages in use (dspark_jax/paged.py). `TRACES` counts Python traces per program and shape, so a
test can prove that nothing recompiles after warm-up.

The programs are module-level jitted functions (graphdefs and sizes static), so every runner of the same
models shares their compiled executables.

No host stalls (§5.2): `dispatch` starts a round and returns its device outputs without waiting; `advance`
builds the next round's batch from them on device, so a caller dispatches round n+1 before reading round n
back (`fetch`). `generate`, the engine and training-data generation (train/regenerate.py) all run this way;
`step` is dispatch + fetch for callers that need the result at once. Prompts enter through `prefill_program`:
the chunks of several requests packed back to back into one pass (`prefill_chunks`: the engine's chunked
prefill, a long prompt's chunk alone or many short prompts together) or many whole short prompts
(`prefill_many`: `generate`, data generation).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import draft_vocab
from dspark_jax import kernels as kernels_lib
from dspark_jax.buckets import capacity_buckets, pick, pow2_buckets
from dspark_jax.drafter import draft_eagle, draft_from_hidden
from dspark_jax.drafter_model import TargetHead
from dspark_jax.keys import DRAFT, VERIFY, round_keys
from dspark_jax.paged import (
    PagedKV,
    drafter_block_hidden_paged,
    drafter_write_flat,
    eagle_step_paged,
    last_context_entry,
    target_forward_flat,
)
from dspark_jax.penalties import Penalties, RowPenalties, history, penalize, penalize_block
from dspark_jax.sampling import LOGIT_BIAS_MAX, TokenBias, add_logit_bias, all_greedy, filter_probs, sample
from dspark_jax.scheduling import survival, topk_fill
from dspark_jax.target import DTYPES, dtype_name, resolve_dtype
from dspark_jax.verification import VerifyResult, greedy_verify, verify

TRACES: collections.Counter = collections.Counter()
# XLA compilations per jitted function name in this process. A Python trace is not the only way to compile:
# the same trace compiles again when an argument's placement differs (an uncommitted host upload against a
# committed device output, say), which TRACES cannot see; tests compare this counter too.
COMPILES: collections.Counter = collections.Counter()


def _count_compile(event: str, duration_secs: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[kw.get("fun_name", "?")] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
PROGRAMS = ("jit(prefill_program)", "jit(draft_program)", "jit(verify_program)", "jit(advance)")
NUM_TOP_LOGPROBS = 20  # top alternatives computed when any request of a pass asks for logprobs
PROFILE_BLOCKS = 2  # profiling: interleaved rounds of chained steps per shape, the fastest counts (`_profile_shapes`)


class StepKind(enum.Enum):
    """What a round runs: the three kinds of step a scheduler can ask for (`ModelRunner.dispatch`)."""

    PLAIN = "plain"  # no draft pass: every row verifies its anchor alone (a target-only step)
    PROBE = "probe"  # a draft pass for fresh confidences that verifies no draft token (dspark)
    SPECULATE = "speculate"  # a draft pass, then verification of the draft tokens the plan admits


@dataclasses.dataclass
class StepBatch:
    """Host arrays of one step for the R running requests, in rows 0..R−1 of a batch bucket of Bb rows."""

    lengths: np.ndarray  # int32 [Bb] committed tokens n (the anchor sits at position n)
    anchors: np.ndarray  # int32 [Bb]
    block_tables: np.ndarray  # int32 [Bb, M]
    temperature: np.ndarray  # f32 [Bb]
    top_k: np.ndarray  # int32 [Bb]
    top_p: np.ndarray  # f32 [Bb]
    min_p: np.ndarray  # f32 [Bb] (0: off; verification only, drafts are drawn without it)
    bias_ids: np.ndarray  # int32 [Bb, LOGIT_BIAS_MAX] logit bias token ids (verification only, as min_p)
    bias: np.ndarray  # f32 [Bb, LOGIT_BIAS_MAX] their biases (0: padding; −inf: a ban while position < ban_until)
    ban_until: np.ndarray  # int32 [Bb] the position from which banned ids (min_tokens) are allowed
    keys: np.ndarray  # uint32 [Bb, 2] request key data (dspark_jax/keys.py)
    rounds: np.ndarray  # int32 [Bb] the round being run
    logprobs: np.ndarray  # bool [Bb] whether the request wants logprobs
    rows: int  # R
    # presence, frequency, repetition f32 [Bb] and prompt_len int32 [Bb] (dspark_jax/penalties.py; the target's
    # side only, as min_p); None: none
    penalties: RowPenalties | None = None

    @property
    def active(self) -> np.ndarray:
        return np.arange(self.lengths.shape[0]) < self.rows


@dataclasses.dataclass
class StepResult:
    """Host results of one verification pass, rows 0..R−1 (padding rows are dropped)."""

    emitted: np.ndarray  # int32 [R, L+1] (−1 padded)
    num_emitted: np.ndarray  # int32 [R]
    num_accepted: np.ndarray  # int32 [R]
    lengths: np.ndarray  # int32 [R] verified draft tokens ℓ
    confidence: np.ndarray | None  # f32 [R, L] (when asked for)
    capacity: int
    logprobs: tuple | None = None  # (logprob [R, L+1], top ids [R, L+1, k], top logprobs [R, L+1, k])


class Pass(NamedTuple):
    """Device outputs of one dispatched round, rows of the whole batch bucket (nothing waited for)."""

    emitted: jax.Array  # int32 [Bb, L+1] (−1 padded)
    num_emitted: jax.Array  # int32 [Bb]
    num_accepted: jax.Array  # int32 [Bb]
    lengths: jax.Array  # int32 [Bb] verified draft tokens ℓ
    confidence: jax.Array  # f32 [Bb, L]
    logprobs: tuple  # (logprob [Bb, L+1], top ids [Bb, L+1, k], top logprobs [Bb, L+1, k]); zeros unless asked
    capacity: int
    packed: jax.Array | None = None  # int32 [Bb, L+4]: the first four, packed for one read-back (`_packed`)


class DeviceBatch(NamedTuple):
    """A round's batch on device, rows of a batch bucket Bb (`ModelRunner.device_batch` uploads a StepBatch;
    `advance` builds the next round's from this one's outputs)."""

    active: jax.Array  # bool [Bb]: rows 0..R−1 run
    lengths: jax.Array  # int32 [Bb] committed tokens n
    anchors: jax.Array  # int32 [Bb]
    block_tables: jax.Array  # int32 [Bb, M]
    temperature: jax.Array  # f32 [Bb]
    top_k: jax.Array  # int32 [Bb]
    top_p: jax.Array  # f32 [Bb]
    min_p: jax.Array  # f32 [Bb]
    bias_ids: jax.Array  # int32 [Bb, LOGIT_BIAS_MAX]
    bias: jax.Array  # f32 [Bb, LOGIT_BIAS_MAX]
    ban_until: jax.Array  # int32 [Bb]
    keys: jax.Array  # uint32 [Bb, 2] request key data
    rounds: jax.Array  # int32 [Bb]
    logprobs: jax.Array  # bool [Bb]
    penalties: RowPenalties | None = None  # f32 [Bb] ×3, prompt_len int32 [Bb]; None: no penalties


@jax.jit
def advance(dev: DeviceBatch, emitted, num_accepted) -> DeviceBatch:
    """The next round's device batch from this round's outputs, without the host: each active row commits
    its anchor and accepted drafts (n → n + m + 1), the last emitted token becomes its anchor, round + 1."""
    m = num_accepted
    rows = jnp.arange(m.shape[0])
    return dev._replace(lengths=jnp.where(dev.active, dev.lengths + m + 1, dev.lengths),
                        anchors=jnp.where(dev.active, emitted[rows, m], dev.anchors), rounds=dev.rounds + 1)


def _first_token(logits, keys, greedy, temp, top_k, top_p, min_p):
    """The token after each anchor from its logits [Bb, V]: argmax when every row is greedy, else a draw of the
    filtered distribution with each row's key."""
    return jax.lax.cond(greedy, lambda: jnp.argmax(logits, -1).astype(jnp.int32),
                        lambda: sample(keys, filter_probs(logits, temp, top_k, top_p, min_p)))


def _logprob_outputs(logits, tokens, want, rows=None):
    """Raw-model logprobs of `tokens` [..] under logits [.., V] and the top alternatives, only when `want`.
    With `rows` [..], logits are the pass's flat rows [T, V] and the tokens' rows are gathered inside the taken
    branch: gathered outside it, the [Bb, L+1, V] rows would be paid on every pass, asked for or not."""
    return _logprobs_if(want, lambda: logits if rows is None else logits[rows], tokens, logits.shape[-1])


def _logprobs_if(want, make_logits, tokens, vocab: int):
    """(logprob of each of `tokens` [..], top ids [.., k], top logprobs [.., k]) under the logits [.., V] that
    `make_logits()` builds inside the taken branch (so what it costs is paid only when `want`), else zeros."""
    k = min(NUM_TOP_LOGPROBS, vocab)
    return jax.lax.cond(want, lambda: _logprobs_of(make_logits(), tokens, k), lambda: _no_logprobs(tokens.shape, k))


def _logprobs_of(logits, tokens, k: int):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.clip(tokens, 0, lp.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp


def _no_logprobs(shape, k: int):
    return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (k,), jnp.int32), jnp.zeros(shape + (k,), jnp.float32))


PROMPT_LOGPROB_ROWS = 512  # prompt logprobs build the target's logits this many rows at a time


def _prompt_logprobs_if(want, head, h, tokens, vocab: int):
    """`_logprobs_if` for a pass's C flat rows, tokens [C] scored under head(h) [C, V], with the logits built
    PROMPT_LOGPROB_ROWS rows at a time (`lax.map`). XLA reserves the buffers of a `cond` branch whether or not it
    runs, so building all C rows at once would cost every prefill pass C·V floats, asked for or not: ~100 GB for
    a data-generation pass of 2,048 prompts × 256 tokens (train/regenerate.py) under a 49k vocabulary."""
    C = h.shape[0]
    n = min(PROMPT_LOGPROB_ROWS, C)
    pad = -C % n
    blocks_h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, n, h.shape[-1])
    blocks_t = jnp.pad(tokens, (0, pad)).reshape(-1, n)
    k = min(NUM_TOP_LOGPROBS, vocab)

    def compute():
        chosen, ids, lps = jax.lax.map(lambda b: _logprobs_of(head(b[0]), b[1], k), (blocks_h, blocks_t))
        return chosen.reshape(-1)[:C], ids.reshape(-1, k)[:C], lps.reshape(-1, k)[:C]

    return jax.lax.cond(want, compute, lambda: _no_logprobs(tokens.shape, k))


class Static:
    """A graphdef as a jit static argument, hashed once. jit hashes its static arguments on every call to find
    the compiled program, and an nnx GraphDef's hash walks the whole module graph (milliseconds of Python per
    call for a 30-layer target). Equal when the graphdefs are (the same object, in practice)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Static) and (self.value is other.value
                                               or (self._hash == other._hash and self.value == other.value))


def _model_key(target_graph, drafter_graph) -> tuple:
    return hash(target_graph), hash(drafter_graph)


def _pool_key(kv: PagedKV, tables) -> tuple[int, int]:
    """(pages in the pool, pages per request): runners of one model with other pools trace their own programs."""
    return kv.num_pages, tables.shape[-1]


# ---- programs ---------------------------------------------------------------------------------------------------
class PrefillChunk(NamedTuple):
    """A prefill pass on device: the prompt chunks of b requests packed back to back into C flat rows (padding
    at the tail), request r's chunk at positions starts[r]..starts[r]+counts[r]−1 (b, C: buckets)."""

    tokens: jax.Array  # int32 [C]
    next_tokens: jax.Array  # int32 [C]: row t's prompt-logprob target (the prompt token after it)
    starts: jax.Array  # int32 [b]
    counts: jax.Array  # int32 [b] real tokens per request (0: a padding request)
    block_tables: jax.Array  # int32 [b, M]
    keys: jax.Array  # uint32 [b, 2] request key data (dspark_jax/keys.py)
    temperature: jax.Array  # f32 [b]
    top_k: jax.Array  # int32 [b]
    top_p: jax.Array  # f32 [b]
    min_p: jax.Array  # f32 [b]
    bias_ids: jax.Array  # int32 [b, LOGIT_BIAS_MAX]
    bias: jax.Array  # f32 [b, LOGIT_BIAS_MAX]
    ban_until: jax.Array  # int32 [b]
    want_logprobs: jax.Array  # bool []: logprobs of the sampled tokens
    want_prompt_logprobs: jax.Array  # bool []: the LM head over every row, scoring `next_tokens`
    penalties: RowPenalties | None = None  # [b] each; None: no penalties


@functools.partial(jax.jit, static_argnames=("target_graph", "drafter_graph", "max_q_len", "hidden_layers", "kernels"),
                   donate_argnames=("target_kv", "drafter_kv"))
def prefill_program(target_params, drafter_params, target_kv, drafter_kv, chunk: PrefillChunk, *, target_graph,
                    drafter_graph, max_q_len, hidden_layers, kernels):
    """One prefill pass: b requests' prompt chunks (≤ `max_q_len` tokens each) packed into C flat rows; the
    target's K/V and the drafter's context written to their pages. Returns (pools, the token sampled after each
    chunk's last real position [b] (round 0 of each request's key), its logprobs [b], prompt logprobs [C]: row t
    scores `next_tokens[t]` under the target's logits at row t, computed only when asked (zeros otherwise)).
    The serving engine packs the chunks of the requests it prefills (`ModelRunner.prefill_chunks`); data
    generation (train/regenerate.py) and `generate` pack many whole short prompts (`prefill_many`)."""
    tokens, b = chunk.tokens, chunk.starts.shape[0]
    TRACES[_model_key(target_graph, drafter_graph), _pool_key(target_kv, chunk.block_tables), "prefill",
           tokens.shape[0], b, max_q_len] += 1
    target = nnx.merge(target_graph.value, target_params)
    C = tokens.shape[0]
    query_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunk.counts).astype(jnp.int32)])
    t = jnp.arange(C, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right"), 0, b - 1).astype(jnp.int32)
    j = t - query_start[slot]
    valid = t < query_start[-1]
    pos = chunk.starts[slot] + j
    h, target_kv, feats = target_forward_flat(target, target_kv, tokens, slot, pos, valid, chunk.block_tables,
                                              chunk.starts + chunk.counts, query_start, max_q_len=max_q_len,
                                              hidden_layers=hidden_layers, kernels=kernels)
    if drafter_graph is not None:
        drafter_kv = drafter_write_flat(nnx.merge(drafter_graph.value, drafter_params), drafter_kv, feats, slot, pos,
                                        valid, chunk.block_tables, tokens=tokens, first=j == 0,
                                        embed=target_params["embed"][...])
    logits = target.head(h[jnp.clip(query_start[1:] - 1, 0, C - 1)])  # [b, V]: after each chunk's last token
    keys = round_keys(chunk.keys, jnp.zeros((b,), jnp.int32), VERIFY)
    temperature = jnp.where(chunk.counts > 0, chunk.temperature, 0.0)
    biased = add_logit_bias(logits, chunk.bias_ids, chunk.bias, chunk.starts + chunk.counts, chunk.ban_until)
    pen = chunk.penalties
    if pen is not None and target_kv.ids is not None:  # the history is every position up to the chunk's end
        def penalized():
            counts, seen = history(target_kv.ids, chunk.block_tables, chunk.starts + chunk.counts, pen.prompt_len,
                                   logits.shape[-1])
            return penalize(biased, counts, seen, pen)

        biased = jax.lax.cond(pen.on(chunk.counts > 0), penalized, lambda: biased)
    tok = sample(keys, filter_probs(biased, temperature, chunk.top_k, chunk.top_p, chunk.min_p),
                 all_greedy(temperature))
    lp = _logprob_outputs(logits, tok, chunk.want_logprobs)
    prompt_lp = _prompt_logprobs_if(chunk.want_prompt_logprobs, target.head, h, chunk.next_tokens, logits.shape[-1])
    return target_kv, drafter_kv, tok, lp, prompt_lp


@functools.partial(jax.jit, static_argnames=("drafter_graph", "tied", "kernels"))
def draft_program(target_params, drafter_params, draft_head, drafter_kv, block_tables, lengths, anchors, keys, rounds,
                  temp, top_k, top_p, *, drafter_graph, tied, kernels):
    """Every row of the batch bucket drafts a block from its paged context → (draft [Bb, L], q [Bb, L, Vd],
    confidence [Bb, L]): q over the drafter's vocabulary (Vd = V unless it is reduced), widened to V only where
    sampled verification reads it. Padding rows have no context and are ignored downstream. `draft_head`: the
    reduced draft vocabulary's head columns [D, Vd] (ModelRunner gathers them once), or None."""
    TRACES[(None, hash(drafter_graph)), _pool_key(drafter_kv, block_tables), "draft", anchors.shape[0]] += 1
    model = nnx.merge(drafter_graph.value, drafter_params)
    head = TargetHead.from_params(target_params, tied, draft_lm_head=draft_head)
    keys = round_keys(keys, rounds, DRAFT)
    if model.cfg.kind == "eagle3":  # L autoregressive steps over its paged context, from f_{n−1} in the pool
        step, extra = eagle_step_paged(model, head, drafter_kv, block_tables, lengths)
        feature = last_context_entry(drafter_kv, block_tables, lengths)
        return draft_eagle(model, head, step, anchors, feature, extra, keys, temp, top_k, top_p, full_vocab_q=False)
    h = drafter_block_hidden_paged(model, head, drafter_kv, block_tables, lengths, anchors)
    return draft_from_hidden(model, head, h, anchors, keys, temp, top_k, top_p, kernels, full_vocab_q=False)


@functools.partial(jax.jit, static_argnames=("target_graph", "drafter_graph", "capacity", "mode", "block_size",
                                             "hidden_layers", "kernels", "policy"),
                   donate_argnames=("target_kv", "drafter_kv"))
def verify_program(target_params, drafter_params, target_kv, drafter_kv, batch: DeviceBatch, draft, q, conf,
                   lengths_or_k, *, target_graph, drafter_graph, capacity, mode, block_size, hidden_layers, kernels,
                   policy=None):
    """Schedule (mode "lengths": ℓ given; "topk": top-K fill of the current survival; "policy": `policy`'s
    ℓ from the current confidences, on device; "plain": ℓ = 0, a plain step), one flat target pass over the
    capacity bucket, lossless verification, commit of the drafter context. The capacity must hold every active
    row's ℓ + 1 tokens. A plain step's pass reads one query per request (a speculative one L + 1), so it costs
    what a target-only step does plus the drafter's context write, and samples its token as `verify` does at
    ℓ = 0 (the same key, the same draw).

    Returns (target_kv, drafter_kv, emitted [Bb, L+1], num_emitted [Bb], num_accepted [Bb], lengths [Bb], logprobs,
    the four before it packed for the host, `_packed`)."""
    L = block_size
    active, n, anchors, tables = batch.active, batch.lengths, batch.anchors, batch.block_tables
    Bb = active.shape[0]
    TRACES[_model_key(target_graph, drafter_graph), _pool_key(target_kv, tables), "verify", Bb, capacity,
           mode if policy is None else str(policy)] += 1
    if mode == "topk":
        lengths = topk_fill(survival(conf), lengths_or_k, active)
    elif mode == "plain":
        lengths = jnp.zeros((Bb,), jnp.int32)
    elif mode == "policy":
        lengths = jnp.where(active, policy.lengths(conf, L), 0) if L else jnp.zeros((Bb,), jnp.int32)
    else:
        lengths = jnp.where(active, jnp.clip(lengths_or_k, 0, L), 0)
    q_len = jnp.where(active, lengths + 1, 0).astype(jnp.int32)
    query_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len).astype(jnp.int32)])
    t = jnp.arange(capacity, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right"), 0, Bb - 1).astype(jnp.int32)
    j = t - query_start[slot]
    valid = t < query_start[-1]
    block = jnp.concatenate([anchors[:, None], draft], 1) if L else anchors[:, None]  # [Bb, L+1]
    tokens = jnp.where(valid, block[slot, jnp.clip(j, 0, L)], 0)
    pos = n[slot] + j
    target = nnx.merge(target_graph.value, target_params)
    h, target_kv, feats = target_forward_flat(target, target_kv, tokens, slot, pos, valid, tables, n + q_len,
                                              query_start, max_q_len=1 if mode == "plain" else L + 1,
                                              hidden_layers=hidden_layers, kernels=kernels)
    # The LM head on the bucket's rows only (∝ capacity), then each request's L+1 rows gathered from them.
    flat_logits = target.head(h)  # [capacity, V]
    rows = jnp.clip(query_start[:-1, None] + jnp.arange(L + 1), 0, capacity - 1)  # [Bb, L+1]
    temp, top_k, top_p, min_p = batch.temperature, batch.top_k, batch.top_p, batch.min_p
    greedy = all_greedy(jnp.where(active, temp, 0.0))
    verify_keys = round_keys(batch.keys, batch.rounds, VERIFY)
    bias = jnp.where(active[:, None], batch.bias, 0.0)
    predicts = n[:, None] + 1 + jnp.arange(L + 1)  # [Bb, L+1]: the position of the token each row predicts
    raw_first = flat_logits[rows[:, 0]]  # [Bb, V]: each request's row after its anchor
    # What it samples from (logprobs stay the raw model's).
    first = _penalized(add_logit_bias(raw_first, batch.bias_ids, bias, predicts[:, 0], batch.ban_until)[:, None],
                       batch, target_kv.ids, anchors[:, None])[:, 0]
    if L == 0:  # target only: sample the token after each anchor
        tok = _first_token(first, verify_keys, greedy, temp, top_k, top_p, min_p)
        emitted, zeros = tok[:, None], jnp.zeros((Bb,), jnp.int32)
        lp = _logprob_outputs(raw_first[:, None], emitted, jnp.any(batch.logprobs & active))
        packed = _packed(emitted, zeros + 1, zeros, lengths)
        return target_kv, drafter_kv, emitted, zeros + 1, zeros, lengths, lp, packed
    if mode == "plain":  # ℓ = 0 for every row: the token after each anchor, drawn as `verify` draws it at ℓ = 0
        emit_keys = jax.vmap(lambda k: jax.random.split(k)[1])(verify_keys)
        tok = _first_token(first, emit_keys, greedy, temp, top_k, top_p, min_p)
        zeros = jnp.zeros((Bb,), jnp.int32)
        res = VerifyResult(jnp.concatenate([tok[:, None], jnp.full((Bb, L), -1, jnp.int32)], 1), zeros + 1, zeros)
    else:
        def target_rows():  # each request's L+1 rows as verification reads them (logprobs stay the raw model's)
            return _penalized(add_logit_bias(flat_logits[rows], batch.bias_ids, bias, predicts, batch.ban_until),
                              batch, target_kv.ids, block)

        res = jax.lax.cond(
            greedy,
            lambda: greedy_verify(_adjusted_argmax(flat_logits, rows, target_rows, jnp.any(bias != 0.0)
                                                   | _penalties_on(batch, target_kv.ids)), draft, lengths),
            lambda: verify(verify_keys, filter_probs(target_rows(), temp, top_k, top_p, min_p),
                           draft, draft_vocab.to_vocab(q, nnx.merge(drafter_graph.value, drafter_params).cfg), lengths))
    if drafter_graph is not None:
        drafter_kv = drafter_write_flat(nnx.merge(drafter_graph.value, drafter_params), drafter_kv, feats, slot, pos,
                                        valid, tables, tokens=tokens, first=j == 0, embed=target_params["embed"][...])
    lp = _logprob_outputs(flat_logits, res.emitted_tokens, jnp.any(batch.logprobs & active), rows)
    return (target_kv, drafter_kv, res.emitted_tokens, res.num_emitted, res.num_accepted, lengths, lp,
            _packed(res.emitted_tokens, res.num_emitted, res.num_accepted, lengths))


def _adjusted_argmax(flat_logits, rows, target_rows, adjusted):
    """Greedy tokens [Bb, L+1] at each request's rows of the pass's flat logits [T, V]: the argmax over the flat
    rows, gathered, unless some row has a logit bias or penalties (`adjusted`), then the argmax of its
    [Bb, L+1, V] rows as `target_rows()` builds them."""
    return jax.lax.cond(adjusted, lambda: jnp.argmax(target_rows(), -1).astype(jnp.int32),
                        lambda: jnp.argmax(flat_logits, -1).astype(jnp.int32)[rows])


def _penalties_on(batch: DeviceBatch, ids) -> jax.Array | bool:
    """Whether some active row of the batch has penalties (False when it carries none, or the pool no ids)."""
    return False if batch.penalties is None or ids is None else batch.penalties.on(batch.active)


def _penalized(logits, batch: DeviceBatch, ids, block):
    """Each request's rows logits [Bb, T, V] (bias applied) with its penalties, when some active row has any:
    row j follows block[:, j] (the anchor, then drafts), its history read from the id pool `ids` up to the
    anchor (dspark_jax/penalties.py)."""
    pen = batch.penalties
    if pen is None or ids is None:
        return logits

    def apply():
        counts, seen = history(ids, batch.block_tables, batch.lengths, pen.prompt_len, logits.shape[-1])
        return penalize_block(logits, counts, seen, block, pen)

    return jax.lax.cond(pen.on(batch.active), apply, lambda: logits.astype(jnp.float32))


def _packed(emitted, num_emitted, num_accepted, lengths):
    """What the host reads back of every round, as one int32 [Bb, L+4] array (one transfer, not four):
    emitted tokens [:, :L+1], then num_emitted, num_accepted and ℓ."""
    return jnp.concatenate([emitted, num_emitted[:, None], num_accepted[:, None], lengths[:, None]], 1)


# ---- host side ------------------------------------------------------------------------------------------------
def bias_rows(rows: int, per_request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows 0..n−1 of the logit bias arrays (ids int32 [rows, LOGIT_BIAS_MAX], biases f32 [rows, ...], ban_until
    int32 [rows]) from n ≤ rows requests' `sampling.TokenBias` (or None); padding is zero."""
    ids = np.zeros((rows, LOGIT_BIAS_MAX), np.int32)
    bias = np.zeros((rows, LOGIT_BIAS_MAX), np.float32)
    until = np.zeros(rows, np.int32)
    for i, tb in enumerate(per_request):
        if tb:
            got, values = tb.entries()
            ids[i, : len(got)], bias[i, : len(got)], until[i] = got, values, tb.ban_until
    return ids, bias, until


def penalty_rows(rows: int, per_request=()) -> RowPenalties:
    """Host `RowPenalties` of `rows` rows (presence, frequency, repetition f32; prompt_len int32) from n ≤ rows
    requests' (`Penalties` or None, prompt length or None); other rows are off (prompt_len: every position)."""
    presence, frequency = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    repetition, prompt_len = np.ones(rows, np.float32), np.full(rows, np.iinfo(np.int32).max, np.int32)
    for i, (pen, n) in enumerate(per_request):
        if pen is not None:
            presence[i], frequency[i], repetition[i] = pen
        if n is not None:
            prompt_len[i] = n
    return RowPenalties(presence, frequency, repetition, prompt_len)


class PrefillItem(NamedTuple):
    """One request's chunk in a prefill pass (`ModelRunner.prefill_chunks`): `tokens` at positions start.. of
    the request whose pages `table_row` lists, sampled with its key data and filters. logprobs: also return the
    logprobs of the token sampled after the chunk. prompt_targets: the prompt tokens after the chunk's first
    len(prompt_targets) positions (≤ its length), to score under the target (prompt logprobs)."""

    tokens: list[int]
    start: int
    table_row: typing.Any  # int32 [max_pages]
    key: typing.Any  # uint32 [2]
    temperature: float
    top_k: int
    top_p: float
    logprobs: bool = False
    prompt_targets: list[int] | None = None
    min_p: float = 0.0
    bias: TokenBias | None = None  # logit bias and min_tokens bans
    penalties: Penalties | None = None  # repetition, frequency and presence penalties (every chunk token: prompt)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """A ModelRunner's shapes and paths, validated once (`ModelRunner` and `create_engine` log it at start-up).

    max_batch: most requests per step; batch buckets are powers of two up to it.
    num_pages, page_size, max_pages: the paged pools (one block-table row of `max_pages` pages per request).
    chunk_sizes: prefill buckets: the flat rows of a prefill pass (the largest: its token budget, all its
        requests' chunks together).
    kernels: which path each kernel takes (`kernels.KernelConfig`, or one mode string for both).
    kv_dtype: the page pools' dtype, "auto" (= the target's dtype), "bfloat16" or "float32". Attention reads
        the pages up to float32 whatever it is; writes cast to it.
    penalties: serve per-request repetition, frequency and presence penalties (dspark_jax/penalties.py): the
        target's pool keeps every position's token id and the programs take each row's penalties. False (data
        generation, `generate` without penalties) compiles the programs without them and their buffers."""

    max_batch: int
    num_pages: int
    page_size: int
    max_pages: int
    chunk_sizes: tuple[int, ...] = (32, 128)
    kernels: kernels_lib.KernelConfig | str = "auto"
    kv_dtype: str = "auto"
    penalties: bool = True

    def __post_init__(self):
        for name in ("max_batch", "num_pages", "page_size", "max_pages"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"RunnerConfig.{name} must be an integer >= 1, got {value!r}")
        chunks = tuple(sorted(int(c) for c in self.chunk_sizes))
        if not chunks or chunks[0] < 1:
            raise ValueError(f"RunnerConfig.chunk_sizes must be positive, got {self.chunk_sizes!r}")
        object.__setattr__(self, "chunk_sizes", chunks)
        object.__setattr__(self, "kernels", kernels_lib.KernelConfig.parse(self.kernels))
        if self.kv_dtype != "auto":
            resolve_dtype(self.kv_dtype, auto="float32")  # raises on an unknown dtype


class ModelRunner:
    """Page pools, parameters and the compiled programs for one (target, drafter) pair.

    Args:
        target, drafter: loaded models (drafter None: target only).
        config: a `RunnerConfig`, or its fields as keywords.
        mesh: optional device mesh; parameters are sharded by dspark_jax/sharding.py's rules.
    """

    def __init__(self, target, drafter, config: RunnerConfig | None = None, *, mesh=None, **fields):
        if (config is None) == (not fields):
            raise TypeError("ModelRunner takes a RunnerConfig or its fields as keywords, not both")
        self.config = config = RunnerConfig(**fields) if config is None else config
        kernels, page_size, num_pages = config.kernels, config.page_size, config.num_pages
        if kernels.pallas("attention") and jax.default_backend() == "gpu" and page_size % 16:
            raise ValueError(f"page_size={page_size}: the GPU attention kernel reads pages in blocks of 16 "
                             "positions; use a multiple of 16 (or --kernels reference)")
        compute = dtype_name(target.dtype)
        self.kv_dtype = resolve_dtype(config.kv_dtype, auto=compute)
        if kernels.pallas("attention") and self.kv_dtype != compute:
            raise ValueError(f"kv_dtype={self.kv_dtype} under a {compute} target: the Pallas attention kernel "
                             f"reads pages in the queries' dtype; use kv_dtype {compute} (or auto), or "
                             "--kernels reference")
        self.target, self.drafter = target, drafter
        self.B, self.page_size, self.max_pages = config.max_batch, page_size, config.max_pages
        self.chunk_sizes, self.kernels = config.chunk_sizes, kernels
        self.L = drafter.config.block_size if drafter is not None else 0
        self.batch_buckets = pow2_buckets(self.B)
        self.prefill_rows = pow2_buckets(min(self.B, self.chunk_sizes[-1]))  # requests packed in a prefill pass
        self.capacities = capacity_buckets(self.B, self.L)
        from dspark_jax.sharding import paged_sharding

        # Every host value a program takes is placed (committed) here, as device outputs fed back are: jit
        # compiles once per argument placement, so an uncommitted upload beside a committed output would
        # compile each program a second time in the first chained round. The page pools
        # start placed so too (they come back from every program).
        self._placement = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                           else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        self._mesh = mesh

        def pool(model_config, **extra) -> PagedKV:
            heads = model_config.num_kv_heads
            return PagedKV.init(num_layers=model_config.num_layers, num_pages=num_pages, num_kv_heads=heads,
                                page_size=page_size, head_dim=model_config.head_dim, dtype=DTYPES[self.kv_dtype],
                                sharding=paged_sharding(mesh, heads) if mesh is not None else self._placement,
                                **extra)

        self.target_kv = pool(target.config, token_ids=config.penalties, feature_sharding=self._placement)
        self.drafter_kv = None
        # On XLA:CPU the target's dense weights output-major (Target.serving_split), unless sharded.
        target_graph, self.target_params = target.serving_split(None if mesh is None else False)
        self.drafter_params = drafter.params if drafter is not None else None
        if drafter is not None:
            dcfg = drafter.config
            self.drafter_kv = pool(dcfg, feature_dim=dcfg.hidden_size if dcfg.keeps_last_feature else 0,
                                   feature_sharding=self._placement)  # replicated: one small pool
        if mesh is not None:
            from dspark_jax.sharding import shard_params

            self.target_params = shard_params(self.target_params, mesh)
            if drafter is not None:
                self.drafter_params = shard_params(self.drafter_params, mesh)
        self.draft_head = None  # a reduced draft vocabulary's head columns, gathered once here, not in every draft
        if drafter is not None and draft_vocab.is_reduced(drafter.config):
            lm_head = TargetHead.from_params(self.target_params, target.config.tie_word_embeddings).lm_head
            self.draft_head = draft_vocab.subset_head(lm_head, drafter.config)
        self._placeholders: dict = {}  # batch bucket → placeholder drafts of a plain step
        self._uploads: dict = {}  # small host arrays already on device, by value (`_put_cached`)
        self._static = dict(target_graph=Static(target_graph),
                            drafter_graph=Static(drafter.graphdef) if drafter is not None else None,
                            hidden_layers=drafter.config.target_layers if drafter is not None else (),
                            kernels=kernels.on(mesh))  # kernels under shard_map on a mesh

    @property
    def traces(self) -> collections.Counter:
        """Python traces of this runner's programs, keyed (program, shape...): 1 each after warm-up."""
        s = self._static
        mine = {_model_key(s["target_graph"], s["drafter_graph"]), (None, hash(s["drafter_graph"]))}
        pool = (self.num_pages, self.max_pages)
        return collections.Counter({k[2:]: v for k, v in TRACES.items() if k[0] in mine and k[1] == pool})

    @property
    def num_pages(self) -> int:
        return self.target_kv.num_pages

    # ---- shapes -----------------------------------------------------------------------------------------------
    def batch_bucket(self, rows: int) -> int:
        return pick(rows, self.batch_buckets)

    def verify_shapes(self, max_draft: int | None = None) -> list[tuple[int, int]]:
        """Every (batch bucket, capacity) a step can take when each request verifies 0..max_draft drafts."""
        ld = self.L if max_draft is None else min(max_draft, self.L)
        shapes = set()
        for r in range(1, self.B + 1):
            bb = self.batch_bucket(r)
            for tokens in range(r, r * (ld + 1) + 1):
                shapes.add((bb, pick(tokens, self.capacities)))
        return sorted(shapes)

    # ---- programs ---------------------------------------------------------------------------------------------
    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk bucket, request bucket) a `prefill_chunks` pass can take: C flat rows hold ≤ C requests."""
        return sorted({(C, pick(n, self.prefill_rows)) for C in self.chunk_sizes
                       for n in range(1, min(C, self.prefill_rows[-1]) + 1)})

    def prefill_fits(self, counts: list[int]) -> bool:
        """Whether chunks of these lengths (≤ `prefill_rows[-1]` of them) share a prefill pass well. The Pallas
        attention kernel works in per-request tiles, so any split of the tokens does; the jnp path computes
        every request row up to the longest chunk's queries, so there rows × longest stays ≤ twice the largest
        chunk bucket (SmolLM2 on the CPU: a 100-token chunk packed beside 27 one-token prompts cost 2.5× the two
        passes apart; bursts of short prompts stay within it)."""
        if self.kernels.pallas("attention"):
            return True
        return pick(len(counts), self.prefill_rows) * max(counts) <= 2 * self.chunk_sizes[-1]

    def prefill(self, tokens: list[int], start: int, table_row, key, temperature: float, top_k: int, top_p: float,
                logprobs: bool = False, prompt_targets=None, min_p: float = 0.0, bias: TokenBias | None = None,
                penalties: Penalties | None = None):
        """`prefill_chunks` of one request's chunk (`PrefillItem` has the arguments) → its (token, logprobs,
        prompt logprobs)."""
        return self.prefill_chunks([PrefillItem(tokens, start, table_row, key, temperature, top_k, top_p,
                                                logprobs, prompt_targets, min_p, bias, penalties)])[0]

    def prefill_chunks(self, items: list[PrefillItem]) -> list[tuple]:
        """Runs the chunks of len(items) ≤ `prefill_rows[-1]` requests, ≤ the largest chunk bucket of tokens
        together, packed back to back into one pass (rows bucketed to `prefill_rows`, tokens to a chunk bucket)
        → per item (the token sampled after its chunk, its (logprob, top ids [k], top logprobs [k]) or None,
        its prompt logprobs (logprob [n], top ids [n, k], top logprobs [n, k]) or None). A request's sample
        depends on its own key and logits alone, not on what shares its pass."""
        n = len(items)
        if not 1 <= n <= self.prefill_rows[-1]:
            raise ValueError(f"{n} chunks in one prefill pass (1 to {self.prefill_rows[-1]})")
        offsets = np.cumsum([0] + [len(it.tokens) for it in items])
        C = pick(int(offsets[-1]), self.chunk_sizes)
        targets = None
        scored = [it.prompt_targets is not None and len(it.prompt_targets) > 0 for it in items]
        if any(scored):
            targets = np.zeros(C, np.int32)
            for it, at, yes in zip(items, offsets, scored, strict=False):
                if yes:
                    if len(it.prompt_targets) > len(it.tokens):
                        raise ValueError(f"{len(it.prompt_targets)} prompt targets for a chunk of "
                                         f"{len(it.tokens)} tokens")
                    targets[at : at + len(it.prompt_targets)] = it.prompt_targets
        want_lp = any(it.logprobs for it in items)
        tok, lp, prompt_lp = self._prefill_pass(
            [it.tokens for it in items], [it.start for it in items],
            np.stack([np.asarray(it.table_row, np.int32) for it in items]), [it.key for it in items],
            [it.temperature for it in items], [it.top_k for it in items], [it.top_p for it in items],
            min_p=[it.min_p for it in items], bias=[it.bias for it in items],
            penalties=[(it.penalties, None) for it in items],
            rows=pick(n, self.prefill_rows), capacity=C, max_q_len=C,
            logprobs=want_lp, next_tokens=targets)
        tok, lp, prompt_lp = jax.device_get((tok, lp if want_lp else None, None if targets is None else prompt_lp))
        return [(int(tok[i]), tuple(x[i] for x in lp) if it.logprobs else None,
                 tuple(x[at : at + len(it.prompt_targets)] for x in prompt_lp) if yes else None)
                for i, (it, at, yes) in enumerate(zip(items, offsets, scored, strict=False))]

    def prefill_many(self, prompts: list[list[int]], block_tables, keys, temperature, top_k, top_p, *, rows: int,
                     capacity: int, max_q_len: int, min_p=0.0, bias=None, penalties=None) -> jax.Array:
        """Prefills whole prompts of len(prompts) ≤ `rows` requests in one packed pass of `capacity` flat rows
        (each prompt ≤ `max_q_len` tokens; rows, capacity and max_q_len are the caller's buckets) → the token
        sampled after each prompt, int32 [rows] on device (padding rows: ignore). Per-request arrays [n]:
        block_tables [n, M], keys [n, 2], temperature, top_k, top_p, min_p (a scalar or [n]); bias: None or per
        request a `sampling.TokenBias` (or None); penalties: None or one `Penalties` for every request."""
        return self._prefill_pass(prompts, [0] * len(prompts), block_tables, keys, temperature, top_k, top_p,
                                  min_p=min_p, bias=bias, penalties=[(penalties, None)] * len(prompts),
                                  rows=rows, capacity=capacity,
                                  max_q_len=max_q_len)[0]

    def _prefill_pass(self, chunks, starts, block_tables, keys, temperature, top_k, top_p, *, min_p=0.0,
                      bias=None, penalties=None, rows: int,
                      capacity: int, max_q_len: int, logprobs: bool = False, next_tokens=None):
        """Packs the chunks back to back into `capacity` rows, pads the requests to `rows`, uploads once and
        runs `prefill_program` → its (tokens [rows], logprobs, prompt logprobs) device outputs. penalties: None
        or per request (`Penalties` or None, its prompt length or None: every position up to the chunk's end is
        prompt; the engine samples after a resumed request's recompute but keeps its anchor)."""
        n = len(chunks)
        counts = np.zeros(rows, np.int32)
        counts[:n] = [len(c) for c in chunks]
        if n > rows or counts.sum() > capacity or counts.max(initial=0) > max_q_len or (counts[:n] < 1).any():
            raise ValueError(f"{n} chunks of {counts[:n].tolist()} tokens do not fit {rows} rows, {capacity} "
                             f"tokens, at most {max_q_len} each (and none empty)")
        tokens = np.zeros(capacity, np.int32)
        tokens[: counts.sum()] = np.concatenate([np.asarray(c, np.int32) for c in chunks])

        def per_request(values, dtype, fill=0):
            out = np.full((rows,) + np.shape(values)[1:], fill, dtype)
            out[:n] = values
            return out

        tables = np.full((rows, self.max_pages), self.num_pages, np.int32)
        tables[:n] = block_tables
        bias_ids, bias_values, ban_until = bias_rows(rows, bias or ())
        chunk = self._put(PrefillChunk(
            tokens=tokens,
            next_tokens=np.zeros(capacity, np.int32) if next_tokens is None else np.array(next_tokens, np.int32),
            starts=per_request(starts, np.int32), counts=counts, block_tables=tables,
            keys=per_request(np.asarray(keys, np.uint32).reshape(n, 2), np.uint32),
            temperature=per_request(temperature, np.float32), top_k=per_request(top_k, np.int32),
            top_p=per_request(top_p, np.float32, 1.0), min_p=per_request(min_p, np.float32),
            bias_ids=bias_ids, bias=bias_values, ban_until=ban_until, want_logprobs=np.bool_(logprobs),
            want_prompt_logprobs=np.bool_(next_tokens is not None),
            penalties=self._penalties(rows, penalties or ())))  # one upload for the pass
        s = self._static
        self.target_kv, self.drafter_kv, tok, lp, prompt_lp = prefill_program(
            self.target_params, self.drafter_params, self.target_kv, self.drafter_kv, chunk,
            target_graph=s["target_graph"], drafter_graph=s["drafter_graph"], max_q_len=max_q_len,
            hidden_layers=s["hidden_layers"], kernels=s["kernels"])
        return tok, lp, prompt_lp

    def _put(self, x):
        """A host value (or pytree of them) on device, committed to the runner's one batch placement."""
        return jax.device_put(x, self._placement)

    def _put_cached(self, x: np.ndarray):
        """`_put` of a small host array, kept by value: a step's ℓ, budget or block tables repeat from step to
        step, and each upload costs the host tens of microseconds of Python (bounded: a few hundred entries)."""
        key = (x.dtype.str, x.shape, x.tobytes())
        got = self._uploads.get(key)
        if got is None:
            if len(self._uploads) >= 512:
                self._uploads.clear()
            got = self._uploads[key] = self._put(np.array(x))  # a copy: the caller may change x in place
        return got

    def device_batch(self, b: StepBatch) -> DeviceBatch:
        """The step's arrays on device (uploaded once; `draft` and `dispatch` share them). Uploaded from copies:
        `device_put` may still be reading a host buffer after it returns, and callers update their StepBatch in
        place while the round runs."""
        return self._put(DeviceBatch(
            active=np.array(b.active, bool), lengths=np.array(b.lengths, np.int32),
            anchors=np.array(b.anchors, np.int32), block_tables=np.array(b.block_tables, np.int32),
            temperature=np.array(b.temperature, np.float32), top_k=np.array(b.top_k, np.int32),
            top_p=np.array(b.top_p, np.float32), min_p=np.array(b.min_p, np.float32),
            bias_ids=np.array(b.bias_ids, np.int32), bias=np.array(b.bias, np.float32),
            ban_until=np.array(b.ban_until, np.int32),
            keys=np.array(b.keys, np.uint32), rounds=np.array(b.rounds, np.int32), logprobs=np.array(b.logprobs, bool),
            penalties=self._penalties(len(b.lengths), given=b.penalties)))

    def _penalties(self, rows: int, per_request=(), given: RowPenalties | None = None) -> RowPenalties | None:
        """A pass's penalties as its programs take them: `penalty_rows` of `per_request`, or a copy of the host
        arrays `given`; None when this runner was built without penalties (where asking for one is an error)."""
        out = penalty_rows(rows, per_request) if given is None else RowPenalties(*(np.array(x) for x in given))
        if self.config.penalties:
            return out
        if np.any(out.presence != 0) or np.any(out.frequency != 0) or np.any(out.repetition != 1):
            raise ValueError("this runner was built without penalties (RunnerConfig.penalties=False)")
        return None

    def draft(self, b: StepBatch, dev: DeviceBatch | None = None):
        """(draft, q, confidence) device arrays for every row of the batch bucket; q is over the drafter's
        vocabulary, [Bb, L, Vd] (`draft_vocab.to_vocab` widens it to the target's)."""
        return self._draft(self.device_batch(b) if dev is None else dev)

    def _draft(self, dev: DeviceBatch):
        s = self._static
        return draft_program(self.target_params, self.drafter_params, self.draft_head, self.drafter_kv,
                             dev.block_tables, dev.lengths, dev.anchors, dev.keys, dev.rounds, dev.temperature,
                             dev.top_k, dev.top_p, drafter_graph=s["drafter_graph"],
                             tied=self.target.config.tie_word_embeddings, kernels=s["kernels"])

    def dispatch(self, dev: DeviceBatch, kind: StepKind, *, capacity: int, lengths: np.ndarray | None = None,
                 budget: int | None = None, policy=None, drafts=None) -> Pass:
        """Starts one round of `kind` and returns its device outputs without waiting for them.

        PLAIN: no draft pass, every row verifies its anchor alone (the only kind without a drafter). PROBE: a
        draft pass for fresh confidences, then the plain step's pass (one query per row: the same tokens and
        the same draw as ℓ = 0 in a verification pass, at a plain step's price plus the draft pass). SPECULATE:
        a draft pass (unless `drafts` are given) and verification of exactly one of `lengths` (host ℓ per
        row), `budget` (K ≥ 1 for the top-K fill) and `policy` (ℓ on device). The drafter's context is written
        for every token a pass commits, whatever its kind."""
        Bb = dev.active.shape[0]
        how = sum(x is not None for x in (lengths, budget, policy))
        if kind is StepKind.SPECULATE:
            if how != 1 or not self.L:
                raise ValueError("a speculative step needs a drafter and exactly one of lengths, budget and policy")
            if budget is not None and budget < 1:
                raise ValueError(f"a speculative step's budget is >= 1 (a probe verifies none), got {budget}")
        elif how or (kind is StepKind.PROBE and not self.L):
            raise ValueError(f"a {kind.value} step verifies no draft token" + ("" if self.L else " (no drafter)"))
        if not self.L:  # target only
            drafts = (self._put_cached(np.zeros((Bb, 0), np.int32)),
                      self._put_cached(np.zeros((Bb, 0, 1), np.float32)),
                      self._put_cached(np.zeros((Bb, 0), np.float32)))
            mode, lengths = "lengths", np.zeros(Bb, np.int32)
        elif kind is StepKind.PLAIN:
            drafts, mode = self._no_drafts(Bb), "plain"
        else:
            drafts = self._draft(dev) if drafts is None else drafts
            mode = ("plain" if kind is StepKind.PROBE else "topk" if budget is not None
                    else "policy" if policy is not None else "lengths")
        draft, q, conf = drafts
        arg = self._put_cached(np.asarray(budget or 0, np.int32) if lengths is None else np.asarray(lengths, np.int32))
        s = self._static
        self.target_kv, self.drafter_kv, emitted, num_emitted, m, ls, lp, packed = verify_program(
            self.target_params, self.drafter_params, self.target_kv, self.drafter_kv, dev, draft, q, conf, arg,
            target_graph=s["target_graph"], drafter_graph=s["drafter_graph"], capacity=capacity, mode=mode,
            block_size=self.L, hidden_layers=s["hidden_layers"], kernels=s["kernels"], policy=policy)
        return Pass(emitted, num_emitted, m, ls, conf, lp, capacity, packed)

    def step(self, b: StepBatch, kind: StepKind, *, capacity: int, lengths: np.ndarray | None = None,
             budget: int | None = None, drafts=None, dev: DeviceBatch | None = None,
             want_confidence: bool = False) -> StepResult:
        """One round (`dispatch`), then `fetch` of its rows 0..R−1."""
        dev = self.device_batch(b) if dev is None else dev
        out = self.dispatch(dev, kind, capacity=capacity, lengths=lengths, budget=budget, drafts=drafts)
        return self.fetch(out, b.rows, want_confidence=want_confidence and kind is not StepKind.PLAIN,
                          want_logprobs=bool(b.logprobs[: b.rows].any()))

    def fetch(self, out: Pass, rows: int, *, want_confidence: bool = False, want_logprobs: bool = False) -> StepResult:
        """Waits for a dispatched round and reads back what the host needs: rows 0..rows−1 of the emitted
        tokens, counts and ℓ, and the confidences and logprobs only when asked for."""
        want_confidence = want_confidence and self.L > 0
        got = jax.device_get((out.packed,) + ((out.confidence,) if want_confidence else ())
                             + ((out.logprobs,) if want_logprobs else ()))
        packed, L1 = got[0][:rows], self.L + 1
        emitted, num_emitted, m, ls = packed[:, :L1], packed[:, L1], packed[:, L1 + 1], packed[:, L1 + 2]
        confidence = got[1][:rows] if want_confidence else None
        logprobs = tuple(x[:rows] for x in got[-1]) if want_logprobs else None
        return StepResult(emitted, num_emitted, m, ls, confidence, out.capacity, logprobs)

    def advance(self, dev: DeviceBatch, out: Pass, block_tables: np.ndarray | None = None) -> DeviceBatch:
        """The device batch of the round after `out`, built on device (`advance`), with fresh block tables
        when pages were added; dispatching it needs no host read of `out`."""
        nxt = advance(dev, out.emitted, out.num_accepted)  # on the batch placement already (a jit output)
        if self._mesh is not None:
            nxt = self._put(nxt)  # a mesh output may come back with another, equivalent sharding: one placement
        if block_tables is not None:
            nxt = nxt._replace(block_tables=self._put_cached(np.asarray(block_tables, np.int32)))
        return nxt

    def _no_drafts(self, Bb: int):
        """Placeholder drafts for a plain step (never read: every ℓ is 0), kept on device per batch bucket."""
        if Bb not in self._placeholders:
            V = draft_vocab.size(self.drafter.config)
            self._placeholders[Bb] = self._put((np.zeros((Bb, self.L), np.int32),
                                                np.zeros((Bb, self.L, V), np.float32),
                                                np.zeros((Bb, self.L), np.float32)))
        return self._placeholders[Bb]

    def plain_shapes(self) -> list[tuple[int, int]]:
        """(batch bucket, capacity) of plain steps (one token per row) for every number of rows."""
        return sorted({(self.batch_bucket(r), pick(r, self.capacities)) for r in range(1, self.B + 1)})

    def empty_batch(self, rows: int) -> StepBatch:
        """A StepBatch of the bucket for `rows` requests, padding rows idle."""
        Bb = self.batch_bucket(max(rows, 1))
        return StepBatch(lengths=np.zeros(Bb, np.int32), anchors=np.zeros(Bb, np.int32),
                         block_tables=np.full((Bb, self.max_pages), self.num_pages, np.int32),
                         temperature=np.zeros(Bb, np.float32), top_k=np.zeros(Bb, np.int32),
                         top_p=np.ones(Bb, np.float32), min_p=np.zeros(Bb, np.float32),
                         bias_ids=np.zeros((Bb, LOGIT_BIAS_MAX), np.int32),
                         bias=np.zeros((Bb, LOGIT_BIAS_MAX), np.float32), ban_until=np.zeros(Bb, np.int32),
                         keys=np.zeros((Bb, 2), np.uint32),
                         rounds=np.zeros(Bb, np.int32), logprobs=np.zeros(Bb, bool), rows=rows,
                         penalties=penalty_rows(Bb) if self.config.penalties else None)

    # ---- start-up ---------------------------------------------------------------------------------------------
    def warmup(self, modes: tuple[str, ...], max_draft: int | None = None, progress=None, plain: bool = False) -> None:
        """Compiles every program at every shape a step can take (writes go to the dropped sentinel page).

        plain: also the plain steps (no draft pass) a scheduler may choose. progress: callable(done, total)."""
        jobs = self.warmup_jobs(modes, max_draft, plain)
        for i, job in enumerate(jobs):
            self.run_warmup_job(job)
            if progress is not None:
                progress(i + 1, len(jobs))

    def warmup_jobs(self, modes: tuple[str, ...], max_draft: int | None = None, plain: bool = False) -> list[tuple]:
        """The programs `warmup` compiles, one job each, smallest batch bucket first (what one request needs
        comes early): ("prefill", chunk, requests), ("draft", bucket), ("verify", bucket, capacity, mode),
        ("advance", bucket)."""
        prefills = self.prefill_shapes()
        jobs = []
        for bb in self.batch_buckets:
            jobs += [("prefill", c, rows) for c, rows in prefills if self.batch_bucket(rows) == bb]
            jobs.append(("advance", bb))  # the on-device bookkeeping of chained rounds
            if plain and self.drafter is not None:  # plain steps (no draft pass) at one token per row
                jobs += [("verify", b, cap, "plain") for b, cap in self.plain_shapes() if b == bb]
            if self.drafter is not None:
                jobs.append(("draft", bb))
            jobs += [("verify", b, cap, mode) for b, cap in self.verify_shapes(max_draft) if b == bb for mode in modes]
        return jobs

    def run_warmup_job(self, job: tuple) -> None:
        """Compiles (and runs once, writing only to the dropped sentinel page) one `warmup_jobs` entry."""
        if job[0] == "advance":
            dev = self.device_batch(self.empty_batch(job[1]))
            zeros = self._put(np.zeros((job[1],), np.int32))  # placed as a verify pass's outputs are
            emitted = self._put(np.zeros((job[1], self.L + 1), np.int32))
            jax.block_until_ready(self.advance(dev, Pass(emitted, zeros, zeros, zeros, None, None, 0),
                                               np.zeros((job[1], self.max_pages), np.int32)))
        elif job[0] == "prefill":  # min(rows, C) chunks of C tokens together (the last ones 1 token each)
            _, C, rows = job
            n = min(rows, C)
            self.prefill_chunks([PrefillItem([0] * (C - n + 1 if i == 0 else 1), 0, [self.num_pages] * self.max_pages,
                                             np.zeros(2, np.uint32), 0.0, 0, 1.0) for i in range(n)])
        elif job[0] == "draft":
            b = self.empty_batch(job[1])
            b.rows = 0
            jax.block_until_ready(self.draft(b))
        else:
            _, bb, cap, mode = job
            b = self.empty_batch(bb)
            b.rows = 0
            if mode == "topk":  # (a budget of 0 would run the plain program: `dispatch`)
                self.step(b, StepKind.SPECULATE, capacity=cap, budget=1)
            elif mode == "plain":
                self.step(b, StepKind.PLAIN, capacity=cap)
            else:
                kind, lengths = (StepKind.SPECULATE, np.zeros(bb, np.int32)) if self.L else (StepKind.PLAIN, None)
                self.step(b, kind, capacity=cap, lengths=lengths)

    def _timed_run(self, b: StepBatch, repeats: int, **dispatch) -> float:
        """Steps/s of `repeats` steps of one shape dispatched back to back (each behind the last, as the engine
        chains its rounds), waited for once at the end. Timing each step alone would add the host's upload,
        dispatch and read-back to every step, which a pipelined engine hides behind the step in flight: a
        constant that squeezes the ratios between shapes and so makes speculation look cheaper than it is."""
        dev = self.device_batch(b)
        t0 = _now()
        for _ in range(repeats):
            out = self.dispatch(dev, **dispatch)
        jax.block_until_ready(out.emitted)
        return repeats / (_now() - t0)

    def _profile_shapes(self, shapes: dict, repeats: int, blocks: int = PROFILE_BLOCKS) -> dict:
        """Steps/s of several step shapes ({key: (batch, dispatch kwargs)}), measured *interleaved*: one
        untimed step of each, then `blocks` rounds in which every shape runs `repeats` chained steps in turn;
        each shape keeps its fastest run. A shared host's speed drifts over seconds, and the scheduler reads
        ratios (a plain step against the full steps of its batch bucket): measured apart, a slow spell under
        one side misprices them, and requests speculate on drafts that do not pay. The fastest run, because
        noise only ever slows a run."""
        for b, kw in shapes.values():
            jax.block_until_ready(self.dispatch(self.device_batch(b), **kw).emitted)
        best = dict.fromkeys(shapes, 0.0)
        for _ in range(max(1, blocks)):
            for key, (b, kw) in shapes.items():
                best[key] = max(best[key], self._timed_run(b, repeats, **kw))
        return best

    def profile_buckets(self, mode: str, context: int = 256, repeats: int = 3, max_draft: int | None = None,
                        plain: bool = False, blocks: int = PROFILE_BLOCKS):
        """Steps per second of a full step (draft + verify) at every (batch bucket, capacity) shape, with real
        work: R = the bucket's rows active at `context` committed tokens, ℓ spread so the pass holds `capacity`
        tokens; with `plain` also the plain step (no draft pass, one token per row) of every batch bucket. Each
        batch bucket's shapes, its plain step among them, are timed interleaved (`_profile_shapes`); writes go to
        dropped pages. Yields (shapes done, shapes in all, {(bucket, capacity): steps/s}, {bucket: plain
        steps/s}) after each bucket, so a caller can interleave other work (serve/startup.py `_profile`)."""
        context = max(0, min(context, self.max_pages * self.page_size - self.L - 2))
        by_bucket: dict[int, dict] = {}
        for bb, cap in self.verify_shapes(max_draft):
            rows = min(bb, cap)
            b = self.empty_batch(rows)
            b.lengths[:rows] = context
            lens = np.zeros(bb, np.int32)
            extra = cap - rows
            for r in range(rows):  # spread the draft tokens over the rows, at most L each
                lens[r] = min(self.L, extra // rows + (1 if r < extra % rows else 0))
            if not self.L:
                how = {"kind": StepKind.PLAIN}
            elif mode == "topk":  # (no draft token to verify: the probe's pass)
                how = ({"kind": StepKind.SPECULATE, "budget": int(lens.sum())} if lens.sum()
                       else {"kind": StepKind.PROBE})
            else:
                how = {"kind": StepKind.SPECULATE, "lengths": lens}
            by_bucket.setdefault(bb, {})[bb, cap] = (b, dict(capacity=cap, **how))
        if plain and self.L:
            for bb, cap in self.plain_shapes():
                b = self.empty_batch(bb)
                b.lengths[:bb] = context
                by_bucket.setdefault(bb, {})["plain", bb] = (b, dict(kind=StepKind.PLAIN, capacity=cap))
        done, total = 0, sum(len(v) for v in by_bucket.values())
        for bb in sorted(by_bucket):
            table, plain_table = {}, {}
            for key, v in self._profile_shapes(by_bucket[bb], repeats, blocks).items():
                if key[0] == "plain":
                    plain_table[bb] = v
                else:
                    table[key] = v
            done += len(by_bucket[bb])
            yield done, total, table, plain_table


def _now() -> float:
    import time

    return time.perf_counter()
