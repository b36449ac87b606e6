"""Precomputed target features (`python -m train features`; `prepare` runs it after regenerating responses).

The drafter reads the frozen target's hidden states: the concatenated outputs of `target_layers` (KV
injection, eq. 2) and the final-normed hidden state (p_t = softmax(head(h)) at block positions, eq. 10–11).
They depend only on the token sequence, so one target forward per sequence, stored once, serves every epoch
and every drafter trained on the same target layers — instead of a 135M-parameter forward in each train step.
Stored in bfloat16 (range of f32; the training step upcasts), ArrayRecord shards under
`<features root>/features-<layers>/`, one output shard per token shard (same name), one record per sequence:
  4-byte little-endian header length | JSON header {tokens, prompt_len, domain, feat_dim, lse} |
  feats bf16 [n, m·D] | hidden bf16 [n, D] | lse f32 [n] (when the header says "lse": true).
`lse` is the target's log-normaliser logsumexp(head(h)) over the whole vocabulary at every position, computed
from the stored (bf16-rounded) h: with it, p_t of a reduced draft vocabulary is exp(head_subset(h) − lse), the
exact full-vocabulary softmax restricted to the subset, without a V-wide head in the train step.

Incremental: an output shard is written under a temporary name and renamed when complete, and a rerun skips
the token shards whose feature shard exists — so `features` can run while `prepare` is still writing shards,
and again later to pick up the new ones.
"""

from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np

from train.prepare import RECORD_GLOB, decode_record


def features_dir(root: str, layers) -> str:
    return os.path.join(root, "features-" + "-".join(str(i) for i in layers))


def bytes_per_token(num_layers: int, hidden_size: int, lse: bool = True) -> int:
    """Stored bytes per token: feats bf16 [m·D] + hidden bf16 [D] (+ lse f32). Qwen3-8B, 5 layers: 49,156."""
    return 2 * (num_layers + 1) * hidden_size + (4 if lse else 0)


def batch_bytes(data, drafter_config, target_config) -> int:
    """Host bytes of one global batch's features (`data`: a DataSection; the drafter's and target's configs)."""
    per_token = bytes_per_token(len(drafter_config.target_layers), target_config.hidden_size)
    return data.batch_sequences * data.seq_len * per_token


def encode(rec: dict, feats: np.ndarray, hidden: np.ndarray, lse: np.ndarray | None = None) -> bytes:
    import ml_dtypes

    head = json.dumps({"tokens": [int(t) for t in rec["tokens"]], "prompt_len": int(rec["prompt_len"]),
                       "domain": rec["domain"], "feat_dim": int(feats.shape[1]), "lse": lse is not None}).encode()
    body = feats.astype(ml_dtypes.bfloat16).tobytes() + hidden.astype(ml_dtypes.bfloat16).tobytes()
    if lse is not None:
        body += np.asarray(lse, "<f4").tobytes()
    return struct.pack("<I", len(head)) + head + body


def decode(raw: bytes) -> dict:
    import ml_dtypes

    (n_head,) = struct.unpack("<I", raw[:4])
    head = json.loads(raw[4 : 4 + n_head])
    tokens = np.asarray(head["tokens"], np.int32)
    n, m = len(tokens), head["feat_dim"]
    body = raw[4 + n_head :]
    lse = None
    if head.get("lse"):
        lse = np.frombuffer(body[len(body) - 4 * n :], "<f4")
        body = body[: len(body) - 4 * n]
    flat = np.frombuffer(body, dtype=ml_dtypes.bfloat16)
    out = {"tokens": tokens, "prompt_len": head["prompt_len"], "domain": head["domain"],
           "feats": flat[: n * m].reshape(n, m), "hidden": flat[n * m :].reshape(n, -1)}
    if lse is not None:
        out["lse"] = lse
    return out


def featurize(data_dir: str, target, layers: tuple[int, ...], *, out_root: str | None = None, batch_size: int = 4,
              progress: bool = True) -> str:
    """Runs the target over every prepared sequence not yet featurized; returns the features directory.

    Args:
      data_dir: the token shards (`python -m train prepare --out`).
      target: the frozen target.
      layers: target layers whose outputs are stored (the drafters' `target_layers`).
      out_root: where `features-<layers>/` goes (default: data_dir).
      batch_size: sequences per forward (padded with empty rows: one compiled shape per length bucket).
    """
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
    from flax import nnx
    from tqdm.auto import tqdm

    from dspark_jax.buckets import round_up
    from train.distill import target_features

    files = sorted(glob.glob(os.path.join(data_dir, RECORD_GLOB)))
    if not files:
        raise ValueError(f"no prepared data in {data_dir!r}; run `python -m train prepare` first")
    out_dir = features_dir(data_dir if out_root is None else out_root, layers)
    os.makedirs(out_dir, exist_ok=True)

    @jax.jit
    def fwd(params, tokens):
        model = nnx.merge(target.graphdef, params)
        h, feats = target_features(model, tokens, tuple(layers))  # the train step's own target forward
        h = h.astype(jnp.bfloat16).astype(jnp.float32)  # what is stored: lse must normalise exactly this h
        lse = jax.lax.map(lambda row: jax.nn.logsumexp(model.head(row), axis=-1), h)  # one [T, V] at a time
        return h, feats, lse

    def count(path):
        reader = ArrayRecordReader(path)
        n = reader.num_records()
        reader.close()
        return n

    def _records(path):
        reader = ArrayRecordReader(path)
        raw = reader.read_all()
        reader.close()
        return raw

    todo = [p for p in files if not os.path.exists(os.path.join(out_dir, os.path.basename(p)))]
    done_seqs = sum(count(os.path.join(out_dir, os.path.basename(p))) for p in files if p not in todo)
    # Said before anything is written: for a large target they are tens of KB a token, and they only pay back
    # when the same tokens are read over several epochs (else `data.features: false` runs the target per step).
    per_token = bytes_per_token(len(layers), target.config.hidden_size)
    tokens = sum(len(decode_record(r)["tokens"]) for p in todo for r in _records(p))
    print(f"target features of layers {list(layers)}: {per_token:,} bytes a token × {tokens:,} tokens = "
          f"{per_token * tokens / 2**30:.2f} GiB to write under {out_dir}", flush=True)
    bar = tqdm(total=sum(count(p) for p in todo), desc=f"target features ({len(files) - len(todo)}/{len(files)} "
               "shards done)", unit="seq", disable=not progress, mininterval=10)
    for path in todo:
        reader = ArrayRecordReader(path)
        recs = [decode_record(r) for r in reader.read_all()]
        reader.close()
        out = [None] * len(recs)
        order = np.argsort([len(r["tokens"]) for r in recs], kind="stable")
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            T = round_up(max(len(recs[i]["tokens"]) for i in idx), 64)
            toks = np.zeros((batch_size, T), np.int32)
            for j, i in enumerate(idx):
                toks[j, : len(recs[i]["tokens"])] = recs[i]["tokens"]
            hidden, feats, lse = (np.asarray(x) for x in fwd(target.params, jnp.asarray(toks)))
            for j, i in enumerate(idx):
                n = len(recs[i]["tokens"])
                out[i] = encode(recs[i], feats[j, :n], hidden[j, :n].astype(ml_dtypes.bfloat16), lse[j, :n])
            bar.update(len(idx))
        final = os.path.join(out_dir, os.path.basename(path))
        tmp = os.path.join(out_dir, "." + os.path.basename(path) + ".tmp")
        writer = ArrayRecordWriter(tmp, "group_size:1")
        for raw in out:
            writer.write(raw)
        writer.close()
        os.replace(tmp, final)
        done_seqs += len(recs)
        with open(os.path.join(out_dir, "features.json"), "w") as f:
            json.dump({"layers": list(layers), "sequences": done_seqs, "dtype": "bfloat16", "lse": True,
                       "tokens_dir": os.path.abspath(data_dir)}, f)
    bar.close()
    return out_dir
