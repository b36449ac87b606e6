"""`generate`: target-only and speculative decoding of a batch of prompts (the library entry point).

`generate` runs the serving engine's round (dspark_jax/runner.py) for target-only decoding and every drafter
kind (DSpark, DFlash, EAGLE-3): one decode loop, owned by the runner. What else stays here: `prefill`, the dense
target forward over whole prompts (last-position logits and the chosen layers' hidden states) that `propose`,
the drafter tests and the DeepSpec parity tests read, with `pad_prompts` shaping its input; it decodes nothing.
Invariant of the round: after prefill the target cache holds the prompt and the *anchor* (the last emitted
token) is not yet in the cache; each round feeds the anchor. Row b of a batch has the request key
fold_in(key(seed), b) and draws round r from it as dspark_jax/keys.py says, so a row's output does not depend
on which other rows share its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.buckets import pick, pow2_at_least, round_up
from dspark_jax.kernels import KernelConfig
from dspark_jax.keys import row_key_data
from dspark_jax.penalties import Penalties, check_frequency_penalty, check_presence_penalty, check_repetition_penalty
from dspark_jax.policy import Policy
from dspark_jax.runner import ModelRunner, RunnerConfig, StepKind, bias_rows, penalty_rows
from dspark_jax.sampling import TokenBias, check_logit_bias, check_min_p, check_min_tokens, check_params
from dspark_jax.target import dtype_name, resolve_dtype
from dspark_jax.verification import acceptance_counts


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns.

    Attributes:
        tokens: new tokens per prompt (stopping at and including an EOS unless ignore_eos).
        stats: rounds, τ (emitted per round), per-position conditional acceptance counts (speculative only).
        timings: seconds spent in prefill and in decoding.
    """

    tokens: list[list[int]]
    stats: dict
    timings: dict


def pad_prompts(prompts: list[list[int]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts to a multiple of `multiple` (fewer compiled shapes) → (tokens [B, T], lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lens = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), round_up(int(lens.max()), multiple)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lens


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_layers", "kernels"), donate_argnames=("cache",))
def prefill(graphdef, params, tokens, cache, lengths, hidden_layers=(), kernels="auto"):
    """Runs the prompts through the target; returns (last-position logits [B, V], cache, hidden or None)."""
    model = nnx.merge(graphdef, params)
    h, cache, hidden = model(tokens, cache, lengths, hidden_layers=hidden_layers, compute_logits=False,
                             kernels=kernels)
    last = h[jnp.arange(tokens.shape[0]), lengths - 1]
    return model.head(last), cache, hidden


class StopTracker:
    """Host-side bookkeeping of emitted tokens, EOS and max_new_tokens per row."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids, ignore_eos: bool):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.zeros(batch, bool)
        self.max_new = max_new_tokens
        self.eos = set() if ignore_eos else set(int(e) for e in eos_ids)

    def push(self, row: int, tokens) -> list[int]:
        """Appends tokens to a live row until a stop; returns what was actually taken."""
        taken = []
        for t in tokens:
            if self.done[row]:
                break
            taken.append(int(t))
            self.out[row].append(int(t))
            if int(t) in self.eos or len(self.out[row]) >= self.max_new:
                self.done[row] = True
        return taken


PAGE_SIZE = 16  # positions per page (the GPU attention kernel reads pages in blocks of 16)


PACKED_PREFILL_TOKENS = 8192  # most prompt tokens in one packed prefill pass of `generate`
PACKED_PREFILL_ROWS = 256  # most prompts in one


def _prefill_rows(runner: ModelRunner, prompts, tables, keys, temperature, top_k, top_p, min_p,
                  bias, penalties=None) -> np.ndarray:
    """Prefills every row → the token sampled after each prompt (round 0 of the row's key), int32 [B].

    Prompts of at most the largest chunk bucket are packed back to back, many to a pass
    (`ModelRunner.prefill_many`; a pass's flat rows, requests and longest prompt bucketed to powers of two and
    chunk buckets, so a handful of shapes compile), and read back once at the end; a longer prompt runs chunk by
    chunk, one request per pass. Either way each row's tokens, pages and key are its own, so its output does not
    depend on how rows were packed."""
    chunk = runner.chunk_sizes[-1]
    anchors = np.zeros(len(prompts), np.int32)
    passes, part, total = [], [], 0

    def pack(part: list[int]):
        lens = [len(prompts[b]) for b in part]
        q = pick(max(lens), runner.chunk_sizes)
        n = len(part)
        return part, runner.prefill_many(
            [prompts[b] for b in part], tables[part], keys[part], np.full(n, temperature, np.float32),
            np.full(n, top_k, np.int32), np.full(n, top_p, np.float32), rows=pow2_at_least(n),
            capacity=max(q, pow2_at_least(sum(lens))), max_q_len=q, min_p=min_p, bias=[bias[b] for b in part],
            penalties=penalties)

    for b, p in enumerate(prompts):
        if len(p) > chunk:
            for start in range(0, len(p), chunk):
                anchors[b] = runner.prefill(p[start : start + chunk], start, tables[b], keys[b], temperature, top_k,
                                            top_p, min_p=min_p, bias=bias[b], penalties=penalties)[0]
            continue
        if part and (total + len(p) > PACKED_PREFILL_TOKENS or len(part) == PACKED_PREFILL_ROWS):
            passes.append(pack(part))
            part, total = [], 0
        part.append(b)
        total += len(p)
    if part:
        passes.append(pack(part))
    tokens = jax.device_get([tok for _, tok in passes])  # one read-back for every pass
    for (part, _), tok in zip(passes, tokens, strict=True):
        anchors[part] = tok[: len(part)]
    return anchors


def generate_paged(target, drafter, prompts, *, policy=None, max_new_tokens, temperature, top_k, top_p, seed,
                   ignore_eos, on_tokens=None, kernels="auto", on_round=None, kv_dtype="auto",
                   min_p: float = 0.0, logit_bias=None, min_tokens: int = 0,
                   penalties: Penalties | None = None) -> GenerateResult:
    """Target-only or speculative decoding of a batch through the serving engine's round
    (dspark_jax/runner.py: the same prefill, draft and verify programs over paged caches).

    Row b's stream is the request key `row_key_data(seed, B)[b]` (dspark_jax/keys.py). The host never waits
    for a round before starting the next: round r+1 is dispatched from round r's device outputs
    (`runner.advance`) and round r is read back while r+1 runs; a row found finished in round r is dropped
    from round r+2 on (round r+1's output for it is discarded).
    """
    B = len(prompts)
    check_params(temperature, top_k, top_p)  # a clear error before the runner compiles anything
    min_p = check_min_p(min_p)
    logit_bias = check_logit_bias(logit_bias, target.config.vocab_size)
    min_tokens = check_min_tokens(min_tokens, max_new_tokens)
    track = StopTracker(B, max_new_tokens, target.eos_token_ids, ignore_eos)
    # min_tokens bans what ends a row (`track.eos`: EOS unless ignored).
    bias = [TokenBias.of(logit_bias, stop_ids=track.eos, prompt_len=len(p), min_tokens=min_tokens) for p in prompts]
    if drafter is None:
        policy, L = Policy(kind="none"), 0
    else:
        drafter.check_target(target)
        policy = policy if isinstance(policy, Policy) else Policy.parse(policy or "fixed")
        if policy.kind in ("none", "dspark"):
            raise ValueError(f"generate with a drafter takes fixed[:N], threshold:X or dspark-sync, not "
                             f"{policy.kind!r}" + (" (the dspark policy needs the serving engine)"
                                                   if policy.kind == "dspark" else ""))
        if policy.needs_confidence and not drafter.config.confidence:
            raise ValueError(f"policy {policy.kind!r} needs a confidence head; a {drafter.config.kind} drafter "
                             "has none")
        L = drafter.config.block_size
    # One round can run past a row's stop before the host sees it: room for two rounds beyond max_new_tokens.
    longest = max(len(p) for p in prompts) + max_new_tokens + 2 * (L + 1) + 1
    max_pages = pow2_at_least(-(-longest // PAGE_SIZE))
    runner = ModelRunner(target, drafter, RunnerConfig(max_batch=B, num_pages=B * max_pages, page_size=PAGE_SIZE,
                                                       max_pages=max_pages, kernels=kernels, kv_dtype=kv_dtype,
                                                       penalties=penalties is not None))
    tables = np.arange(B * max_pages, dtype=np.int32).reshape(B, max_pages)
    keys = row_key_data(seed, B)

    def push(b: int, tokens) -> None:
        taken = track.push(b, tokens)
        if taken and on_tokens is not None:
            on_tokens(b, taken)

    t0 = time.perf_counter()
    anchors = _prefill_rows(runner, prompts, tables, keys, temperature, top_k, top_p, min_p, bias, penalties)
    for b in range(B):
        push(b, anchors[b : b + 1])
    t1 = time.perf_counter()

    batch = runner.empty_batch(B)
    batch.lengths[:] = [len(p) for p in prompts]
    batch.anchors[:], batch.block_tables[:], batch.keys[:] = anchors, tables, keys
    batch.temperature[:], batch.top_k[:], batch.top_p[:], batch.rounds[:] = temperature, top_k, top_p, 1
    batch.min_p[:] = min_p
    batch.bias_ids[:], batch.bias[:], batch.ban_until[:] = bias_rows(len(batch.bias), bias)
    if penalties is not None:
        batch.penalties = penalty_rows(len(batch.lengths), [(penalties, len(p)) for p in prompts])
    dev = runner.device_batch(batch)
    dev = dev._replace(active=jnp.asarray(~track.done))
    capacity = pick(B * (policy.max_draft(L) + 1), runner.capacities)
    attempts, accepts = np.zeros(L, np.int64), np.zeros(L, np.int64)
    emitted_total = row_rounds = rounds = 0
    pending = None
    while not track.done.all():
        out = runner.dispatch(dev, StepKind.SPECULATE, capacity=capacity, policy=policy) if L else runner.dispatch(
            dev, StepKind.PLAIN, capacity=capacity)
        dev = runner.advance(dev, out)
        if pending is not None:  # read the previous round while this one runs
            live = ~track.done
            emitted, num_emitted, m, ell, conf = jax.device_get(
                (pending.emitted, pending.num_emitted, pending.num_accepted, pending.lengths,
                 pending.confidence if on_round is not None else ()))
            rounds += 1
            for b in np.flatnonzero(live):
                push(b, emitted[b, : num_emitted[b]])
            if L:
                if on_round is not None:
                    on_round(live, ell, m, conf)
                tried, took = acceptance_counts(ell, m, live, L)  # position-wise conditional acceptance (Fig. 2)
                attempts += tried
                accepts += took
                emitted_total += int(num_emitted[live].sum())
                row_rounds += int(live.sum())
            if track.done.any():
                dev = dev._replace(active=dev.active & jnp.asarray(~track.done))
        pending = out
    t2 = time.perf_counter()
    if not L:
        stats = {"rounds": rounds + 1, "tau": 1.0}
    else:
        stats = {"rounds": rounds, "tau": emitted_total / max(row_rounds, 1), "row_rounds": row_rounds,
                 "acceptance_attempts": attempts.tolist(), "acceptance_accepts": accepts.tolist(),
                 "conditional_acceptance": (accepts / np.maximum(attempts, 1)).tolist()}
    return GenerateResult(tokens=track.out, stats=stats, timings={"prefill_s": t1 - t0, "decode_s": t2 - t1})


def generate(target, prompts, drafter=None, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, policy=None,
             on_tokens=None, kernels: str | KernelConfig = "auto", on_round=None,
             kv_dtype: str = "auto", min_p: float = 0.0, logit_bias: dict | None = None,
             min_tokens: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0) -> GenerateResult:
    """Generates continuations of token-id prompts, target-only or speculatively with a drafter.

    Args:
        target: a loaded `Target`.
        prompts: list of token-id lists (different lengths allowed).
        drafter: a `Drafter`, or None for target-only decoding.
        max_new_tokens: per prompt.
        temperature, top_k, top_p: filtering applied to target and draft alike (0 temperature = greedy).
        min_p: keep tokens at least min_p times as likely as the most likely one (0: off; vLLM's min_p). Applied
            to the target's distribution (drafts are drawn without it: lossless, some drafts rejected).
        logit_bias: OpenAI's {token id: bias in [-100, 100]} (at most `sampling.LOGIT_BIAS_MAX` entries), added
            to the target's raw logits before anything else (greedy takes the biased argmax); drafts, as for
            min_p, are drawn without it.
        min_tokens: no EOS before this many tokens per prompt (vLLM's min_tokens; ≤ max_new_tokens): EOS is
            banned from the target's distribution until then (unless ignore_eos), as a logit bias of −inf.
        presence_penalty, frequency_penalty: in [-2, 2] (0: off), subtracted once per generated token / per
            occurrence in the output (OpenAI's); repetition_penalty: in [0.01, 10] (1: off), divides positive and
            multiplies negative logits of prompt and output tokens (vLLM's). Applied to the target's logits after
            the logit bias (dspark_jax/penalties.py); drafts, as for min_p, are drawn without them.
        seed: a fixed seed gives a fixed output; each row has its own stream.
        ignore_eos: keep going past EOS tokens.
        policy: speculative verification-length policy (dspark_jax/policy.py); default verifies the full block.
        on_tokens: optional callback(row, new_tokens) for streaming.
        on_round: optional callback(live bool [B], lengths [B], num_accepted [B], confidence [B, L]) after every
            speculative round (host arrays), e.g. to collect calibration data.
        kernels: "auto" (Pallas where measured faster: `kernels.AUTO_PALLAS`), "pallas" (forced; interpreted on
            CPU), "reference", or a `kernels.KernelConfig` choosing per kernel.
        kv_dtype: the paged KV cache's dtype: "auto" (the target's dtype), "bfloat16" or "float32".

    Returns:
        GenerateResult with `.tokens` and `.stats`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [[int(t) for t in p] for p in prompts]
    V = target.config.vocab_size
    if any(not 0 <= t < V for p in prompts for t in p):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    penalties = Penalties(check_presence_penalty(presence_penalty), check_frequency_penalty(frequency_penalty),
                          check_repetition_penalty(repetition_penalty))
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
              logit_bias=logit_bias, min_tokens=min_tokens, ignore_eos=ignore_eos, on_tokens=on_tokens,
              kernels=kernels, penalties=penalties if penalties.active else None)
    KernelConfig.parse(kernels)  # validates the modes
    compute = dtype_name(target.dtype)
    kv_dtype = resolve_dtype(kv_dtype, auto=compute)
    return generate_paged(target, drafter, prompts, policy=policy, **kw, on_round=on_round, kv_dtype=kv_dtype)
