"""The device side of the serving engine: paged caches and three jitted programs, all shapes precompiled.

  prefill(chunk)    one chunk of one request's prompt at positions start..start+C−1 (C a chunk bucket): target
                    K/V and the drafter's injected context written to the request's pages; on the last chunk
                    the first output token is sampled from the last real position.
  draft             every slot drafts a block (draft tokens, draft probs q, confidence) from its paged context.
  verify(capacity)  the running requests' [anchor, draft_1..draft_ℓ] packed back to back into one capacity
                    bucket, one flat target pass, lossless verification (greedy_verify / verify), commit of
                    the drafter context. mode "lengths": ℓ given by the host; mode "topk": ℓ from the current
                    survival by top-K fill with K given by the host (the §5.2 scheduler).
Every slot of the static batch B (max_batch) is in every program; idle slots have ℓ = 0 and q_len = 0.
`traces` counts Python traces of each program, so a test can prove nothing recompiles after warm-up.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import first_token
from dspark_jax.drafter import draft_block
from dspark_jax.drafter_model import TargetHead
from dspark_jax.paged import PagedKV, drafter_cache_view, drafter_write_flat, target_forward_flat
from dspark_jax.sampling import all_greedy, filter_probs, sample
from dspark_jax.scheduling import survival, topk_fill
from dspark_jax.verification import greedy_verify, verify


@dataclasses.dataclass
class SlotBatch:
    """Host arrays describing every slot for one step (idle slots: active False)."""

    active: np.ndarray  # bool [B]
    lengths: np.ndarray  # int32 [B] committed tokens n (the anchor sits at position n)
    anchors: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, M]
    temperature: np.ndarray  # f32 [B]
    top_k: np.ndarray  # int32 [B]
    top_p: np.ndarray  # f32 [B]
    keys: np.ndarray  # uint32 [B, 2]: each slot's request key (its seed)
    rounds: np.ndarray  # int32 [B]: the request's round counter, folded into its key on device


@dataclasses.dataclass
class StepResult:
    emitted: np.ndarray  # int32 [B, L+1] (−1 padded)
    num_emitted: np.ndarray  # int32 [B]
    num_accepted: np.ndarray  # int32 [B]
    lengths: np.ndarray  # int32 [B] verified draft tokens ℓ
    confidence: np.ndarray | None  # f32 [B, L]
    capacity: int


def _keys(data):
    return jax.random.wrap_key_data(data)


def _round_keys(data, rounds, salt: int):
    """Per-slot keys for this round: fold_in(fold_in(key(seed), round), salt)."""
    return jax.vmap(lambda k, r: jax.random.fold_in(jax.random.fold_in(k, r), salt))(_keys(data), rounds)


class ModelRunner:
    def __init__(self, target, drafter, *, max_batch: int, num_pages: int, page_size: int, max_pages: int,
                 capacities: tuple[int, ...], chunk_sizes: tuple[int, ...], kernels: str = "auto", mesh=None):
        self.target, self.drafter = target, drafter
        self.B, self.page_size, self.max_pages = max_batch, page_size, max_pages
        self.capacities, self.chunk_sizes, self.kernels = tuple(capacities), tuple(chunk_sizes), kernels
        self.L = drafter.config.block_size if drafter is not None else 0
        self.hidden_layers = drafter.config.target_layers if drafter is not None else ()
        self.tied = target.config.tie_word_embeddings
        self.traces: collections.Counter = collections.Counter()
        tc = target.config
        self.tkv = PagedKV.init(num_layers=tc.num_layers, num_pages=num_pages, num_kv_heads=tc.num_kv_heads,
                                page_size=page_size, head_dim=tc.head_dim, dtype=target.dtype)
        self.dkv = None
        if drafter is not None:
            dc = drafter.config
            self.dkv = PagedKV.init(num_layers=dc.num_layers, num_pages=num_pages, num_kv_heads=dc.num_kv_heads,
                                    page_size=page_size, head_dim=dc.head_dim, dtype=target.dtype)
        self.tparams, self.dparams = target.params, (drafter.params if drafter is not None else None)
        if mesh is not None:
            from dspark_jax.sharding import shard_params

            self.tparams = shard_params(self.tparams, mesh)
            if drafter is not None:
                self.dparams = shard_params(self.dparams, mesh)
        tg, dg = target.graphdef, (drafter.graphdef if drafter is not None else None)
        dcfg = drafter.config if drafter is not None else None
        self._prefill = jax.jit(functools.partial(self._prefill_impl, tg, dg), donate_argnums=(2, 3))
        self._draft = jax.jit(functools.partial(self._draft_impl, dg, dcfg))
        self._verify = jax.jit(functools.partial(self._verify_impl, tg, dg), donate_argnums=(2, 3),
                               static_argnames=("capacity", "mode"))

    # ---- programs ---------------------------------------------------------------------------------------------
    def _prefill_impl(self, tg, dg, tparams, dparams, tkv, dkv, tokens, start, n_real, table_row, key, temp, tk, tp):
        self.traces["prefill", tokens.shape[0]] += 1
        target = nnx.merge(tg, tparams)
        C = tokens.shape[0]
        pos = start + jnp.arange(C, dtype=jnp.int32)
        valid = jnp.arange(C) < n_real
        slot = jnp.zeros((C,), jnp.int32)
        ctx = (start + n_real)[None]
        qs = jnp.stack([jnp.int32(0), n_real]).astype(jnp.int32)
        h, tkv, feats = target_forward_flat(target, tkv, tokens, slot, pos, valid, table_row, ctx, qs,
                                            max_q_len=C, hidden_layers=self.hidden_layers, kernels=self.kernels)
        if dg is not None:
            dkv = drafter_write_flat(nnx.merge(dg, dparams), dkv, feats, slot, pos, valid, table_row)
        logits = target.head(h[jnp.maximum(n_real - 1, 0)])[None]
        tok = first_token(logits, _keys(key)[None], temp[None], tk[None], tp[None])
        return tkv, dkv, tok[0]

    def _draft_impl(self, dg, dcfg, tparams, dparams, dkv, block_tables, lengths, anchors, keys, rounds, temp, tk,
                    tp):
        self.traces["draft"] += 1
        head = TargetHead.from_params(tparams, self.tied)
        view = drafter_cache_view(dkv, block_tables, lengths, dcfg.hidden_size)
        draft_keys = _round_keys(keys, rounds, 0)
        return draft_block(dg, dparams, head, view, anchors, draft_keys, temp, tk, tp, self.kernels)

    def _verify_impl(self, tg, dg, tparams, dparams, tkv, dkv, batch, draft, q, conf, lengths_or_k, *, capacity,
                     mode):
        self.traces["verify", capacity, mode] += 1
        L = self.L
        active, n, anchors, tables = batch["active"], batch["lengths"], batch["anchors"], batch["block_tables"]
        B = active.shape[0]
        if mode == "topk":
            lengths = topk_fill(survival(conf), lengths_or_k, active)
        else:
            lengths = jnp.where(active, lengths_or_k, 0)
        q_len = jnp.where(active, lengths + 1, 0).astype(jnp.int32)
        query_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len).astype(jnp.int32)])
        t = jnp.arange(capacity, dtype=jnp.int32)
        slot = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right"), 0, B - 1).astype(jnp.int32)
        j = t - query_start[slot]
        valid = t < query_start[-1]
        block = jnp.concatenate([anchors[:, None], draft], 1) if L else anchors[:, None]  # [B, L+1]
        tokens = jnp.where(valid, block[slot, jnp.clip(j, 0, L)], 0)
        pos = n[slot] + j
        target = nnx.merge(tg, tparams)
        h, tkv, feats = target_forward_flat(target, tkv, tokens, slot, pos, valid, tables, n + q_len, query_start,
                                            max_q_len=L + 1, hidden_layers=self.hidden_layers,
                                            kernels=self.kernels)
        rows = jnp.clip(query_start[:-1, None] + jnp.arange(L + 1), 0, capacity - 1)  # [B, L+1]
        logits = target.head(h[rows])  # [B, L+1, V]: the LM head only on verified positions' rows
        temp, tk, tp = batch["temperature"], batch["top_k"], batch["top_p"]
        verify_keys = _round_keys(batch["keys"], batch["rounds"], 1)
        if L == 0:  # target only: sample the token after each anchor
            probs = filter_probs(logits[:, 0], temp, tk, tp)
            tok = sample(verify_keys, probs, all_greedy(jnp.where(active, temp, 0.0)))
            zeros = jnp.zeros((B,), jnp.int32)
            return tkv, dkv, tok[:, None], zeros + 1, zeros, lengths
        res = jax.lax.cond(
            all_greedy(jnp.where(active, temp, 0.0)),
            lambda: greedy_verify(jnp.argmax(logits, -1).astype(jnp.int32), draft, lengths),
            lambda: verify(verify_keys, filter_probs(logits, temp, tk, tp), draft, q, lengths))
        if dg is not None:
            dkv = drafter_write_flat(nnx.merge(dg, dparams), dkv, feats, slot, pos, valid, tables)
        return tkv, dkv, res.emitted_tokens, res.num_emitted, res.num_accepted, lengths

    # ---- host API --------------------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], start: int, table_row: list[int], key: np.ndarray, temperature: float,
                top_k: int, top_p: float) -> int:
        """Runs one chunk (len ≤ the largest chunk size) and returns the token sampled after it."""
        n = len(tokens)
        C = next(c for c in self.chunk_sizes if c >= n)
        buf = np.zeros(C, np.int32)
        buf[:n] = tokens
        self.tkv, self.dkv, tok = self._prefill(
            self.tparams, self.dparams, self.tkv, self.dkv, jnp.asarray(buf), jnp.int32(start), jnp.int32(n),
            jnp.asarray([table_row], jnp.int32), jnp.asarray(key, jnp.uint32), jnp.float32(temperature),
            jnp.int32(top_k), jnp.float32(top_p))
        return int(tok)

    def device_batch(self, b: SlotBatch) -> dict:
        """The slot arrays on device (uploaded once per step; `draft` and `step` share them)."""
        return {"active": jnp.asarray(b.active), "lengths": jnp.asarray(b.lengths, jnp.int32),
                "anchors": jnp.asarray(b.anchors, jnp.int32), "block_tables": jnp.asarray(b.block_tables, jnp.int32),
                "temperature": jnp.asarray(b.temperature, jnp.float32), "top_k": jnp.asarray(b.top_k, jnp.int32),
                "top_p": jnp.asarray(b.top_p, jnp.float32), "keys": jnp.asarray(b.keys, jnp.uint32),
                "rounds": jnp.asarray(b.rounds, jnp.int32)}

    def draft(self, b: SlotBatch, dev: dict):
        """(draft, q, confidence) device arrays for every slot."""
        return self._draft(self.tparams, self.dparams, self.dkv, dev["block_tables"], dev["lengths"],
                           dev["anchors"], dev["keys"], dev["rounds"], dev["temperature"], dev["top_k"], dev["top_p"])

    def step(self, b: SlotBatch, *, capacity: int, lengths: np.ndarray | None = None, budget: int | None = None,
             drafts=None, dev: dict | None = None, want_confidence: bool = False) -> StepResult:
        """One verification pass. Exactly one of `lengths` (host ℓ per slot) and `budget` (K for top-K fill)."""
        dev = self.device_batch(b) if dev is None else dev
        if self.drafter is not None and drafts is None:
            drafts = self.draft(b, dev)
        if drafts is None:  # target only
            V = self.target.config.vocab_size
            drafts = (jnp.zeros((self.B, 0), jnp.int32), jnp.zeros((self.B, 0, V), jnp.float32),
                      jnp.zeros((self.B, 0), jnp.float32))
        draft, q, conf = drafts
        mode = "topk" if budget is not None else "lengths"
        arg = jnp.int32(budget) if budget is not None else jnp.asarray(lengths, jnp.int32)
        self.tkv, self.dkv, emitted, num_emitted, m, ls = self._verify(
            self.tparams, self.dparams, self.tkv, self.dkv, dev, draft, q, conf, arg, capacity=capacity, mode=mode)
        emitted, num_emitted, m, ls = jax.device_get((emitted, num_emitted, m, ls))
        confidence = np.asarray(conf) if (want_confidence and self.L) else None
        return StepResult(emitted, num_emitted, m, ls, confidence, capacity)

    def idle_batch(self) -> SlotBatch:
        B, M = self.B, self.max_pages
        sentinel = self.tkv.num_pages
        return SlotBatch(active=np.zeros(B, bool), lengths=np.zeros(B, np.int32), anchors=np.zeros(B, np.int32),
                         block_tables=np.full((B, M), sentinel, np.int32), temperature=np.zeros(B, np.float32),
                         top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32), keys=np.zeros((B, 2), np.uint32),
                         rounds=np.zeros(B, np.int32))

    def warmup(self, modes: tuple[str, ...]) -> None:
        """Compiles every program at every bucket (writes go to the dropped sentinel page)."""
        sentinel = [self.tkv.num_pages] * self.max_pages
        for c in self.chunk_sizes:
            self.prefill([0] * c, 0, sentinel, np.zeros(2, np.uint32), 0.0, 0, 1.0)
        b = self.idle_batch()
        for cap in self.capacities:
            for mode in modes:
                if mode == "topk":
                    self.step(b, capacity=cap, budget=0)
                else:
                    self.step(b, capacity=cap, lengths=np.zeros(self.B, np.int32))

    def profile_sps(self, mode: str, repeats: int = 3) -> dict[int, float]:
        """Steps per second of a full step (draft + verify) at every capacity bucket, with the bucket filled by
        real-looking work: every slot active, ℓ spread so that the pass holds `capacity` tokens."""
        table = {}
        for cap in self.capacities:
            b = self.idle_batch()
            rows = min(self.B, cap)
            b.active[:rows] = True
            lens = np.zeros(self.B, np.int32)
            extra = cap - rows
            for i in range(rows):  # spread the draft tokens over the rows, at most L each
                lens[i] = min(self.L, extra // rows + (1 if i < extra % rows else 0))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if mode == "topk":
                    self.step(b, capacity=cap, budget=int(lens.sum()))
                else:
                    self.step(b, capacity=cap, lengths=lens)
                times.append(time.perf_counter() - t0)
            table[cap] = 1.0 / float(np.median(times))
        return table
