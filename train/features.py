"""Precomputed target features (`python -m train prepare` runs this after regenerating responses).

The drafter reads the frozen target's hidden states: the concatenated outputs of `target_layers` (KV
injection, eq. 2) and the final-normed hidden state (p_t = softmax(head(h)) at block positions, eq. 10–11).
They depend only on the token sequence, so one target forward per sequence, stored once, serves every epoch
and every drafter trained on the same target layers — instead of a 135M-parameter forward in each train step.
Stored in bfloat16 (range of f32; the training step upcasts), ArrayRecord shards under
`<data>/features-<layers>/`, one record per sequence:
  4-byte little-endian header length | JSON header {tokens, prompt_len, domain, feat_dim} |
  feats bf16 [n, m·D] | hidden bf16 [n, D].
"""

from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np

from train.prepare import RECORD_GLOB, decode_record


def features_dir(data_dir: str, layers) -> str:
    return os.path.join(data_dir, "features-" + "-".join(str(i) for i in layers))


def encode(rec: dict, feats: np.ndarray, hidden: np.ndarray) -> bytes:
    import ml_dtypes

    head = json.dumps({"tokens": [int(t) for t in rec["tokens"]], "prompt_len": int(rec["prompt_len"]),
                       "domain": rec["domain"], "feat_dim": int(feats.shape[1])}).encode()
    return (struct.pack("<I", len(head)) + head + feats.astype(ml_dtypes.bfloat16).tobytes()
            + hidden.astype(ml_dtypes.bfloat16).tobytes())


def decode(raw: bytes) -> dict:
    import ml_dtypes

    (n_head,) = struct.unpack("<I", raw[:4])
    head = json.loads(raw[4 : 4 + n_head])
    tokens = np.asarray(head["tokens"], np.int32)
    n, m = len(tokens), head["feat_dim"]
    body = np.frombuffer(raw[4 + n_head :], dtype=ml_dtypes.bfloat16)
    feats = body[: n * m].reshape(n, m)
    hidden = body[n * m :].reshape(n, -1)
    return {"tokens": tokens, "prompt_len": head["prompt_len"], "domain": head["domain"], "feats": feats,
            "hidden": hidden}


def featurize(data_dir: str, target, layers: tuple[int, ...], *, batch_size: int = 8, progress: bool = True) -> str:
    """Runs the target over every prepared sequence and writes the feature shards; returns their directory."""
    import jax
    import jax.numpy as jnp
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
    from tqdm.auto import tqdm

    from dspark_jax.decoding import round_up

    files = sorted(glob.glob(os.path.join(data_dir, RECORD_GLOB)))
    if not files:
        raise ValueError(f"no prepared data in {data_dir!r}; run `python -m train prepare` first")
    out_dir = features_dir(data_dir, layers)
    os.makedirs(out_dir, exist_ok=True)
    from flax import nnx

    @jax.jit
    def fwd(params, tokens):
        model = nnx.merge(target.graphdef, params)
        return model(tokens, model.init_cache(*tokens.shape), hidden_layers=tuple(layers), compute_logits=False)

    total = 0
    for path in files:  # record counts only, for the progress bar
        reader = ArrayRecordReader(path)
        total += reader.num_records()
        reader.close()
    bar = tqdm(total=total, desc="target features", unit="seq", disable=not progress)
    for path in files:
        reader = ArrayRecordReader(path)
        recs = [decode_record(r) for r in reader.read_all()]
        reader.close()
        out = [None] * len(recs)
        order = np.argsort([len(r["tokens"]) for r in recs], kind="stable")
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            T = round_up(max(len(recs[i]["tokens"]) for i in idx), 64)
            toks = np.zeros((len(idx), T), np.int32)
            for j, i in enumerate(idx):
                toks[j, : len(recs[i]["tokens"])] = recs[i]["tokens"]
            hidden, _, feats = fwd(target.params, jnp.asarray(toks))
            hidden, feats = np.asarray(hidden), np.asarray(feats)
            for j, i in enumerate(idx):
                n = len(recs[i]["tokens"])
                out[i] = encode(recs[i], feats[j, :n], hidden[j, :n])
            bar.update(len(idx))
        writer = ArrayRecordWriter(os.path.join(out_dir, os.path.basename(path)), "group_size:1")
        for raw in out:
            writer.write(raw)
        writer.close()
    bar.close()
    with open(os.path.join(out_dir, "features.json"), "w") as f:
        json.dump({"layers": list(layers), "sequences": total, "dtype": "bfloat16"}, f)
    return out_dir
