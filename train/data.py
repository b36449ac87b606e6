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
Multi-host: each process reads `dataset[process_index::process_count]`. The iterator's state (epoch, position)
is a small dict saved with the checkpoint (grain.checkpoint.CheckpointSave), so a resumed run sees the same
batches in the same order.
"""

from __future__ import annotations

import glob
import os

import grain
import numpy as np

from train.prepare import RECORD_GLOB, decode_record


def shard_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, RECORD_GLOB)))
    if not files:
        raise ValueError(f"no prepared data in {path!r} (expected {RECORD_GLOB}); run `python -m train prepare` "
                         "(and `python -m train features` for precomputed target features)")
    return files


def window_and_anchors(rec: dict, rng: np.random.Generator, seq_len: int, num_anchors: int) -> dict:
    """One training example from a decoded record (see module docstring). Records with precomputed target
    features (train/features.py) also give "feats" [T, m·D], "hidden" [T, D] and, when stored, the target's
    log-normaliser "lse" [T] (f32, zero-padded)."""
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
            x = np.zeros((seq_len,) + rec[name].shape[1:], np.float32)
            x[:length] = rec[name][start : start + length]
            ex[name] = x
    return ex


def make_dataset(path: str, *, seq_len: int, anchors_per_seq: int, batch_sequences: int, seed: int,
                 process_index: int = 0, process_count: int = 1, feature_layers: tuple[int, ...] | None = None,
                 features_path: str | None = None) -> grain.MapDataset:
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
    ds = ds.random_map(lambda r, rng: window_and_anchors(r, rng, seq_len, anchors_per_seq), seed=seed + 1)
    return ds.batch(batch_sequences // process_count, drop_remainder=True)


def make_iterator(path: str, **kw) -> grain.DatasetIterator:
    """A checkpointable iterator (get_state / set_state) over `make_dataset`."""
    return iter(make_dataset(path, **kw).to_iter_dataset())
