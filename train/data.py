"""The grain input pipeline: prepared sequences → fixed-shape batches of (sequence window, anchors).

Per sequence (a random-access record, see train/prepare.py), one seeded random transform:
  window   — a random crop of at most T tokens (T = seq_len) that keeps at least one response token, padded
             to T; `lengths` counts the real tokens;
  anchors  — A distinct positions n drawn uniformly from the response part of the window, n ∈
             [max(1, prompt_len − 1), length − 2], so every anchor has ≥ 1 ground-truth token after it (fewer
             candidates than A: the rest are masked dummies, `anchor_mask`). The L-token block of anchor n is
             tokens n+1..n+L; its target features (hidden states, p_t) come from one frozen target forward over
             the window inside the train step, shared by all A anchors of the sequence.
Then `batch` stacks S sequences: {"tokens" int32 [S, T], "lengths" int32 [S], "anchors" int32 [S, A],
"anchor_mask" bool [S, A]}.
Precomputed target features (train/features.py) stay bfloat16 on the host, as stored; the step widens them on
the device (an 8B target's features are ~48 KB a token in bf16: float32 on the host would double that).
Multi-host: each process reads `dataset[process_index::process_count]` (grain's per-process split of a
MapDataset) and batches `batch_sequences / process_count` of them. `worker_count` > 0 decodes and windows in
that many grain worker processes (`mp_prefetch`) per host. The iterator's state (epoch, position) is a small
dict saved with the checkpoint (grain.checkpoint.CheckpointSave) and in the carry, one per process, so a
resumed run sees the same batches in the same order. Paths are local directories or etils.epath URIs
(ArrayRecord reads gs:// itself).
"""

from __future__ import annotations

import functools
import os

import grain
import numpy as np
from etils import epath

from train.prepare import RECORD_GLOB, decode_record


def shard_files(path) -> list[str]:
    """The prepared ArrayRecord shards under `path` (a local directory or an epath URI), sorted."""
    files = sorted(os.fspath(p) for p in epath.Path(path).glob(RECORD_GLOB))
    if not files:
        raise ValueError(f"no prepared data in {path!r} (expected {RECORD_GLOB}); run `python -m train prepare` "
                         "(and `python -m train features` for precomputed target features)")
    return files


def window_and_anchors(rec: dict, rng: np.random.Generator, seq_len: int, num_anchors: int) -> dict:
    """One training example from a decoded record (see module docstring). Records with precomputed target
    features (train/features.py) also give "feats" [T, m·D], "hidden" [T, D] and, when stored, the target's
    log-normaliser "lse" [T] (zero-padded; feats and hidden in their stored bfloat16, lse float32)."""
    tokens, p = rec["tokens"], rec["prompt_len"]
    n_tok = len(tokens)
    # A window [start, start + T) that ends after the first response token and starts before the last one.
    lo = max(0, p + 1 - seq_len)
    hi = max(lo, min(n_tok - seq_len, n_tok - 3))
    start = int(rng.integers(lo, hi + 1)) if n_tok > seq_len else 0
    win = tokens[start : start + seq_len]
    length = len(win)
    first = max(1, p - 1 - start)
    first = min(first, length - 2)
    # Distinct anchors, as DeepSpec's anchor-bounded packing samples them (without replacement, sorted); when
    # the window has fewer candidates than A, the rest repeat the first and `anchor_mask` switches them off.
    n_cand = length - 1 - first
    picked = np.sort(rng.choice(n_cand, size=min(num_anchors, n_cand), replace=False)) + first
    anchors = np.concatenate([picked, np.full(num_anchors - len(picked), picked[0])])
    anchor_mask = np.arange(num_anchors) < len(picked)
    out = np.zeros(seq_len, np.int32)
    out[:length] = win
    ex = {"tokens": out, "lengths": np.int32(length), "anchors": anchors.astype(np.int32), "anchor_mask": anchor_mask}
    for name in ("feats", "hidden", "lse"):
        if name in rec:
            x = np.zeros((seq_len,) + rec[name].shape[1:], rec[name].dtype)  # bf16 stays bf16
            x[:length] = rec[name][start : start + length]
            ex[name] = x
    return ex


def make_dataset(path, *, seq_len: int, anchors_per_seq: int, batch_sequences: int, seed: int,
                 process_index: int = 0, process_count: int = 1, feature_layers: tuple[int, ...] | None = None,
                 features_path=None) -> grain.MapDataset:
    """An infinite, shuffled, batched MapDataset over the prepared shards (this process's slice).
    With `feature_layers`, reads the precomputed features of those target layers (under `features_path`,
    default `path`) instead of bare tokens."""
    if batch_sequences % process_count:
        raise ValueError(f"batch_sequences={batch_sequences} must divide over {process_count} processes")
    if feature_layers is not None:
        from train import features

        fdir = features.features_dir(path if features_path is None else features_path, feature_layers)
        source = grain.sources.ArrayRecordDataSource(shard_files(fdir))
        decode = features.decode
    else:
        source = grain.sources.ArrayRecordDataSource(shard_files(path))
        decode = decode_record
    ds = grain.MapDataset.source(source)[process_index::process_count]
    ds = ds.map(decode)  # prepare keeps only examples with >= 2 response tokens
    ds = ds.shuffle(seed=seed).repeat(None)
    # A partial of a module-level function, not a lambda: grain's worker processes receive it pickled.
    ds = ds.random_map(functools.partial(_window, seq_len=seq_len, num_anchors=anchors_per_seq), seed=seed + 1)
    return ds.batch(batch_sequences // process_count, drop_remainder=True)


def _window(rec: dict, rng: np.random.Generator, *, seq_len: int, num_anchors: int) -> dict:
    return window_and_anchors(rec, rng, seq_len, num_anchors)


def make_iterator(path, *, worker_count: int = 0, **kw) -> grain.DatasetIterator:
    """A checkpointable iterator (get_state / set_state) over `make_dataset`; `worker_count` > 0 prepares batches
    in that many grain worker processes (the same batches, in the same order, as in-process)."""
    ds = make_dataset(path, **kw).to_iter_dataset()
    if worker_count > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; outside an absl app none were parsed
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(ds)
