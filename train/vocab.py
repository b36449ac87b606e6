"""Choosing a reduced draft vocabulary from the regenerated training data (dspark_jax/draft_vocab.py).

Two ways to choose, and one number that judges either:
  * by counts (`response_token_counts`, `select`): the `size` most frequent response tokens — what runs use by
    default (`drafter.draft_vocab_size`);
  * by mass (`target_mass`, `select_by_mass`): rank tokens by the target's own probability mass summed over the
    response positions of T = 1 text, and take the smallest size whose *outside mass* on held-out T = 1 text
    is at most a bound (2%);
  * the outside mass (`outside_mass`): the target's T = 1 probability on tokens outside the subset, averaged
    over held-out response positions. The draft puts no mass there, so 1 − outside mass caps c*_k at every draft
    position (at T = 1; T = 0 only loses positions whose argmax is outside). `python -m train vocab` reports it.

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


def read_vocab_file(path) -> tuple[int, ...]:
    """A draft-vocabulary file's token ids ({"ids": [...]}, what `python -m train vocab --out` writes)."""
    return tuple(int(t) for t in json.loads(epath.Path(path).read_text())["ids"])


def _write_json(path, obj) -> None:
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


# ---- by the target's T = 1 mass ------------------------------------------------------------------------------------
def read_records(data_dir) -> list[dict]:
    """Every decoded record of the prepared shards under `data_dir`, in shard order."""
    from array_record.python.array_record_module import ArrayRecordReader

    from train.data import shard_files

    out = []
    for path in shard_files(data_dir):
        reader = ArrayRecordReader(path)
        out += [decode_record(raw) for raw in reader.read_all()]
        reader.close()
    return out


def target_mass(target, records: list[dict], batch: int = 4, progress: bool = True) -> tuple[np.ndarray, int]:
    """(float64 [V]: Σ over the records' response positions of the target's T = 1 distribution p(· | prefix),
    the number of those positions). Position t counts when it predicts a response token (t + 1 ≥ prompt_len)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    from dspark_jax.buckets import round_up
    from dspark_jax.drafter_model import TargetHead
    from train.distill import target_features

    tied = target.config.tie_word_embeddings

    @functools.partial(jax.jit, static_argnums=0)
    def mass(graphdef, params, tokens, mask):  # tokens [B, T], mask [B, T] → [V]
        hidden, _ = target_features(nnx.merge(graphdef, params), tokens, (0,))
        p = jax.nn.softmax(TargetHead.from_params(params, tied).logits(hidden).astype(jnp.float32), axis=-1)
        return jnp.einsum("BT,BTV->V", mask.astype(jnp.float32), p)

    total, positions = np.zeros(target.config.vocab_size, np.float64), 0
    for i in tqdm(range(0, len(records), batch), desc="target mass", disable=not progress):
        recs = records[i : i + batch]
        T = round_up(max(len(r["tokens"]) for r in recs), 64)  # few shapes, few compiles
        tokens, mask = np.zeros((batch, T), np.int32), np.zeros((batch, T), bool)
        for b, r in enumerate(recs):
            n, p = len(r["tokens"]), r["prompt_len"]
            tokens[b, :n] = r["tokens"]
            mask[b, max(p - 1, 0) : n - 1] = True
        total += np.asarray(mass(target.graphdef, target.params, tokens, mask), np.float64)
        positions += int(mask.sum())
    return total, positions


def outside_mass(ids, mass: np.ndarray, positions: int) -> float:
    """The target's mean probability outside the subset `ids` over `positions` positions whose summed
    distributions are `mass` [V]."""
    return float(1.0 - mass[np.asarray(ids, np.int64)].sum() / max(positions, 1))


def select_by_mass(fit_mass: np.ndarray, heldout_mass: np.ndarray, heldout_positions: int, *,
                   max_outside: float = 0.02, multiple: int = 256, always=()) -> tuple[tuple[int, ...], float]:
    """The smallest subset (a multiple of `multiple` tokens, `always` included) of the tokens ranked by `fit_mass`
    whose outside mass on the held-out positions is ≤ `max_outside`; (sorted ids, that outside mass).
    Ranking on one half and measuring on the other keeps the reported mass honest (a subset chosen and
    scored on the same text looks better than it is)."""
    if not 0 < max_outside < 1:
        raise ValueError(f"max_outside must be in (0, 1), got {max_outside}")
    always = sorted({int(t) for t in always})
    order = np.lexsort((np.arange(len(fit_mass)), -fit_mass))
    ranked = np.array(always + [int(t) for t in order if int(t) not in set(always)])
    covered = np.cumsum(heldout_mass[ranked]) / max(heldout_positions, 1)  # covered[n − 1]: the first n tokens
    for n in range(multiple, len(ranked) + multiple, multiple):
        n = min(n, len(ranked))
        if 1.0 - covered[n - 1] <= max_outside or n == len(ranked):
            ids = tuple(sorted(int(t) for t in ranked[:n]))
            return ids, outside_mass(ids, heldout_mass, heldout_positions)
    raise AssertionError("unreachable: the whole vocabulary has no outside mass")
