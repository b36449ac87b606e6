"""Choosing a reduced draft vocabulary from the regenerated training data (dspark_jax/draft_vocab.py).

The drafter only ever needs to propose what the target emits, so the subset is the `size` most frequent
response tokens of the prepared shards (ties broken by token id, so the choice is deterministic), plus the
target's EOS ids (a draft must be able to end a response). `coverage` is the fraction of response tokens the
subset holds: an upper bound on how often a draft can be right at all, reported beside the choice.

A training run fixes its subset once (`run_vocabulary` writes `<out_dir>/draft_vocab.json` at the first start and
reads it back on resume), so data written later by a still-running `prepare` cannot change a run's vocabulary.
Paths are local or etils.epath URIs (gs://…).
"""

from __future__ import annotations

import json
import os

import numpy as np
from etils import epath

from train.prepare import RECORD_GLOB, decode_record


def response_token_counts(data_dir: str, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each token id occurs in the responses of the prepared shards."""
    from array_record.python.array_record_module import ArrayRecordReader

    files = sorted(os.fspath(f) for f in epath.Path(data_dir).glob(RECORD_GLOB))
    if not files:
        raise ValueError(f"no prepared data in {data_dir!r} to choose a draft vocabulary from")
    counts = np.zeros(vocab_size, np.int64)
    for path in files:
        reader = ArrayRecordReader(path)
        for raw in reader.read_all():
            rec = decode_record(raw)
            counts += np.bincount(rec["tokens"][rec["prompt_len"] :], minlength=vocab_size)
        reader.close()
    return counts


def select(counts: np.ndarray, size: int, always=()) -> tuple[tuple[int, ...], float]:
    """(sorted subset of `size` token ids: `always` first, then by descending count, ties by id; coverage)."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size {size} must be in [1, {len(counts)}]")
    always = sorted({int(t) for t in always})
    order = np.lexsort((np.arange(len(counts)), -counts))  # count descending, then id ascending
    chosen = list(always) + [int(t) for t in order if int(t) not in set(always)][: size - len(always)]
    ids = tuple(sorted(chosen))
    total = counts.sum()
    return ids, float(counts[list(ids)].sum() / total) if total else 0.0


def run_vocabulary(out_dir, data_dir, size: int, vocab_size: int, always=(), shared_file=None) -> tuple[int, ...]:
    """The run's subset, fixed at its first start: read from out_dir/draft_vocab.json if there; else from
    `shared_file` if given and present (runs compared with each other share one vocabulary); else chosen from
    `data_dir` (and written to `shared_file` too when given). Always written to out_dir/draft_vocab.json."""
    own = epath.Path(out_dir) / "draft_vocab.json"
    for path in (own, shared_file):
        if path and epath.Path(path).exists():
            saved = json.loads(epath.Path(path).read_text())
            if saved["size"] != size:
                raise ValueError(f"{path} holds a {saved['size']}-token draft vocabulary, the config asks for {size}")
            break
    else:
        ids, coverage = select(response_token_counts(data_dir, vocab_size), size, always)
        saved = {"size": size, "coverage": round(coverage, 6), "data": os.fspath(data_dir), "ids": list(ids)}
        print(f"draft vocabulary: {size} of {vocab_size} tokens, covering {coverage:.2%} of response tokens",
              flush=True)
        if shared_file:
            _write_json(shared_file, saved)
    if not own.exists():
        _write_json(own, saved)
    return tuple(int(i) for i in saved["ids"])


def _write_json(path, obj) -> None:
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)
