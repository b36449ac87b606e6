"""Held-out acceptance during `fit`: teacher-forced c*_k per draft position on sequences never trained on.

A held-out set is a directory of prepared shards (train/prepare.py) kept out of `data.path`; its first N records
(in shard order) are cut into fixed windows with A anchors each, drawn once from a fixed seed, so every
evaluation of a run sees the same (sequence, anchor) rows. Each row runs exactly the training loss's forward
(train/distill.py `_loss`: the frozen target over the window, the drafter's teacher-forced block), and two
measures come back per draft position k (1-based), averaged over the valid slots of all rows:
  c_star  — c*_k = 1 − ½‖p_d,k − p_t,k‖₁ = Σ_v min(p_t, p_d): the probability that the target, sampling at
            T = 1, accepts draft token k given that tokens 1..k−1 were the sequence's own (with a reduced draft
            vocabulary the target's mass outside it counts as rejected). The measure that predicts τ at T = 1 on
            T = 1 sequences.
  top1    — P(draft argmax = x*_k): on sequences the target wrote greedily (T = 0) x*_k is the target's own argmax,
            so this is the T = 0 acceptance there.
The best step maximises the mean over positions of one measure on one set (`heldout.best_set`,
`heldout.best_measure`, train/config.py); `fit` saves that step's parameters as the run's drafter.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from etils import epath

from train.data import shard_files, window_and_anchors
from train.prepare import decode_record


def load_windows(path, *, sequences: int, seq_len: int, anchors_per_seq: int, seed: int = 0) -> dict:
    """The first `sequences` records under `path` as fixed training-shaped rows: {"tokens" [N, T], "lengths" [N],
    "anchors" [N, A], "anchor_mask" [N, A]} (the window and anchors of record i drawn with seed + i)."""
    from array_record.python.array_record_module import ArrayRecordReader

    rows = []
    for f in shard_files(path):
        reader = ArrayRecordReader(os.fspath(f))
        for raw in reader.read_all():
            rec = decode_record(raw)
            if len(rec["tokens"]) - rec["prompt_len"] >= 2:  # prepare keeps only these; a foreign file may not
                rows.append(window_and_anchors(rec, np.random.default_rng(seed + len(rows)), seq_len,
                                               anchors_per_seq))
            if len(rows) == sequences:
                break
        reader.close()
        if len(rows) == sequences:
            break
    if not rows:
        raise ValueError(f"held-out set {os.fspath(path)!r} holds no sequence with a response to measure")
    return {k: np.stack([r[k] for r in rows]) for k in ("tokens", "lengths", "anchors", "anchor_mask")}


def valid_slots(windows: dict, L: int) -> np.ndarray:
    """bool [N, A, L]: slot k of anchor n has a ground-truth token (n + 1 + k < length) and a real anchor."""
    k = np.arange(L)
    return ((windows["anchors"][..., None] + 1 + k) < windows["lengths"][:, None, None]) & \
        windows["anchor_mask"][..., None]


class HeldoutSets:
    """The run's held-out rows, batched like training (`batch_sequences` rows a batch; the last batch padded with
    copies of row 0 whose slots are masked out), and their evaluation with one jitted program."""

    def __init__(self, sets: dict, *, sequences: int, seq_len: int, anchors_per_seq: int, batch_sequences: int,
                 block_size: int, roots: dict | None = None):
        from train.config import resolve

        self.L, self.batch = block_size, batch_sequences
        self.sets = {}
        for name, path in sets.items():
            w = load_windows(resolve(path, roots), sequences=sequences, seq_len=seq_len,
                             anchors_per_seq=anchors_per_seq)
            n = len(w["tokens"])
            pad = -n % batch_sequences
            if pad:
                w = {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)]) for k, v in w.items()}
                w["anchor_mask"][n:] = False
            self.sets[name] = w

    def rows(self) -> dict:
        """{set name: rows with at least one valid slot}."""
        return {name: int(valid_slots(w, self.L).any((1, 2)).sum()) for name, w in self.sets.items()}

    def evaluate(self, eval_fn, params) -> dict:
        """{set: {"c_star": [L], "top1": [L], "slots": [L]}}: slot-weighted means over all held-out rows.

        `eval_fn(params, batch) → metrics` is the training loss's metrics on one batch (`make_eval_fn`); its
        per-batch per-position means are re-weighted by the batch's valid slots per position."""
        out = {}
        for name, w in self.sets.items():
            sums = {"c_star": np.zeros(self.L), "top1": np.zeros(self.L)}
            slots = np.zeros(self.L)
            for i in range(0, len(w["tokens"]), self.batch):
                batch = {k: v[i : i + self.batch] for k, v in w.items()}
                n = valid_slots(batch, self.L).sum((0, 1)).astype(np.float64)  # [L]
                m = jax.device_get(eval_fn(params, batch))
                sums["c_star"] += n * np.asarray(m["acceptance"], np.float64)
                sums["top1"] += n * np.asarray(m["top1_k"], np.float64)
                slots += n
            out[name] = {k: [round(float(x), 5) for x in v / np.maximum(slots, 1)] for k, v in sums.items()}
            out[name]["slots"] = [int(x) for x in slots]
        return out


def make_eval_fn(target, drafter, weights=None, shardings=None, target_params=None):
    """(drafter params, host batch) → the loss's metrics, jitted once. With `shardings` (a training mesh) the batch
    is this process's rows of every global batch, placed like a training batch."""
    from train.distill import _loss
    from train.losses import LossWeights
    from train.sharding import put_batch

    weights = weights or LossWeights.for_kind(drafter.config.kind)
    loss = functools.partial(_loss, drafter_graph=drafter.graphdef, target_graph=target.graphdef,
                             tied=target.config.tie_word_embeddings, weights=weights)
    metrics = lambda drafter_params, target_params, batch: loss(drafter_params, target_params, batch)[1]  # noqa: E731
    target_params = target.params if target_params is None else target_params
    if shardings is None:
        jitted = jax.jit(metrics)
        return lambda drafter_params, batch: jitted(drafter_params, target_params, batch)
    jitted = jax.jit(metrics, in_shardings=(shardings.params, shardings.target, shardings.batch),
                     out_shardings=shardings.replicated)
    P, i = jax.process_count(), jax.process_index()
    return lambda drafter_params, batch: jitted(drafter_params, target_params,
                                                put_batch({k: v[i::P] for k, v in batch.items()}, shardings.batch))


def summary(result: dict, best_set: str, measure: str) -> float:
    """The number that ranks steps: the mean over draft positions of `measure` on `best_set`."""
    return float(np.mean(result[best_set][measure]))


class BestStep:
    """The best evaluated step so far, kept in `out_dir/best.json` beside its parameters in `out_dir/best/`
    (a float32 drafter, process 0), so a resumed run still knows it. A record from after the resumed step is
    dropped: the resumed run replays those steps and finds it again."""

    FILE = "best.json"

    def __init__(self, out_dir, resumed_step: int):
        import json

        self.dir = epath.Path(out_dir)
        self.step, self.value = None, -np.inf
        f = self.dir / self.FILE
        if f.exists():
            rec = json.loads(f.read_text())
            if rec["step"] <= resumed_step:
                self.step, self.value = rec["step"], rec["value"]

    def offer(self, step: int, value: float, save, write: bool = True) -> bool:
        """Keeps `step` if `value` beats the best so far: `save(directory)` writes its drafter (every process
        calls it: gathering the parameters takes them all), then best.json, the commit point, where `write`
        (process 0). Returns whether it was kept."""
        import json

        if not value > self.value:
            return False
        save(self.dir / "best")
        if write:
            tmp = self.dir / f".{self.FILE}.tmp"
            tmp.write_text(json.dumps({"step": step, "value": value}))
            tmp.replace(self.dir / self.FILE)
        self.step, self.value = step, value
        return True


__all__ = ["BestStep", "HeldoutSets", "load_windows", "make_eval_fn", "summary", "valid_slots"]
