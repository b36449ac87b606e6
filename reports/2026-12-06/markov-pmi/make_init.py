"""A DSpark whose Markov head starts from the training data's bigram statistics instead of zero.

The head adds W1[x_{k-1}]·W2 to block position k's logits: what the previous token says about the next one beyond
what the backbone, blind to it, already predicts. Its natural starting point is the smoothed pointwise mutual
information M[r, c] = log P(c | r) − log P(c) of consecutive response tokens (r: the previous token's Markov row,
c: the next token's draft index), with P(c | r) shrunk toward P(c) by a Dirichlet prior of `--prior` pseudo-counts,
each row centred (a constant per row does not change a softmax), cut to rank R by a randomized SVD and split evenly:
W1 = U·√S, W2 = √S·Vᵀ (times √scale each). Every other parameter is the fresh init `fit` would draw for the same
config and seed, so `drafter.init_from` of the result is an A/B against a zero-started head.

    python reports/2026-12-06/markov-pmi/make_init.py --rank 256 --out runs/anchor-ab/pmi-init-r256
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
from flax import nnx  # noqa: E402
from sklearn.utils.extmath import randomized_svd  # noqa: E402

from dspark_jax import draft_vocab  # noqa: E402
from train.config import load_config  # noqa: E402
from train.fit import _to_state, build  # noqa: E402
from train.prepare import RECORD_GLOB, decode_record  # noqa: E402


def bigram_counts(data_dir: str, t2d: np.ndarray, vd: int) -> np.ndarray:
    """float64 [Vd + 1, Vd]: consecutive (previous row, next draft index) pairs whose next token is a response
    token inside the draft vocabulary."""
    import glob

    from array_record.python.array_record_module import ArrayRecordReader

    flat = np.zeros((vd + 1) * vd, np.int64)
    for path in sorted(glob.glob(os.path.join(data_dir, RECORD_GLOB))):
        reader = ArrayRecordReader(path)
        for raw in reader.read_all():
            rec = decode_record(raw)
            toks = np.asarray(rec["tokens"], np.int64)
            prev, nxt = t2d[toks[rec["prompt_len"] - 1:-1]], t2d[toks[rec["prompt_len"]:]]
            keep = nxt < vd
            flat += np.bincount(prev[keep] * vd + nxt[keep], minlength=flat.size)
        reader.close()
    return flat.reshape(vd + 1, vd).astype(np.float64)


def pmi_factors(n: np.ndarray, rank: int, prior: float, scale: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(W1 [rows, R], W2 [R, Vd], kept share of the centred matrix's squared norm)."""
    pc = (n.sum(0) + 1.0) / (n.sum() + n.shape[1])
    m = np.log((n + prior * pc) / (n.sum(1, keepdims=True) + prior)) - np.log(pc)
    m = (m - m.mean(1, keepdims=True)).astype(np.float32)
    u, s, vt = randomized_svd(m, rank, n_oversamples=64, n_iter=4, random_state=0)
    kept = float((s.astype(np.float64) ** 2).sum() / (m.astype(np.float64) ** 2).sum())
    root = np.sqrt(s * scale)
    return (u * root).astype(np.float32), (root[:, None] * vt).astype(np.float32), kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_ab_dspark.yaml")
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--prior", type=float, default=10.0, help="Dirichlet pseudo-counts toward P(c)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies W1·W2")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    overrides = f"{{num_layers: 2, anchor_feature: true, anchor_mode: fused, markov_rank: {args.rank}}}"
    cfg = load_config(args.config, [f"drafter.overrides={overrides}", f"run.out_dir={args.out}-vocab"])
    target, drafter = build(cfg)
    dcfg = drafter.config
    vd = draft_vocab.size(dcfg)
    n = bigram_counts(cfg.data.path, np.asarray(draft_vocab.t2d(dcfg)), vd)
    w1, w2, kept = pmi_factors(n, args.rank, args.prior, args.scale)
    pure = nnx.to_pure_dict(drafter.params)
    assert pure["markov_w1"].shape == w1.shape and pure["markov_w2"].shape == w2.shape
    pure["markov_w1"], pure["markov_w2"] = w1, w2
    drafter.with_params(_to_state(drafter, pure)).save(args.out)
    print(f"{int(n.sum()):,} bigrams, rank {args.rank}: kept {kept:.4f} of the centred PMI's squared norm; "
          f"W1 row RMS {np.sqrt((w1 ** 2).mean()):.3f}, |W1·W2| mean {np.abs(w1 @ w2).mean():.3f}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
