"""Training throughput of one distillation step on the SmolLM2 config: anchor rows/s and block tokens/s.

    python scripts/bench_train_step.py --config configs/smollm2_dspark.yaml --anchors 8 --steps 5
    python scripts/bench_train_step.py --config configs/smollm2_dspark.yaml --anchors 64 \
        --set drafter.draft_vocab_size=8192

The batch is synthetic with the real shapes (tokens [S, T], anchors [S, A], precomputed target features
[S, T, m·D] and hidden states [S, T, D]): a step's cost does not depend on the values. A reduced draft vocabulary
(drafter.draft_vocab_size) uses the ids 0..Vd−1 (which ids does not change the cost), and the batch carries the
log-normaliser `lse` of its hidden states, as train/features.py writes it. The loss printed is that of random
data, for a sanity check only. Runs against whichever `train`/`dspark_jax`
is first on sys.path (`--src DIR` prepends DIR: e.g. an export of an older commit, for a before/after pair).
Prints one JSON line: step seconds (median of --steps after one compiling step), rows/s, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_dspark.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--anchors", type=int, default=None, help="anchors per sequence A (default: the config's)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the compiling one")
    p.add_argument("--src", default=None, help="prepend this directory to sys.path (another version of the code)")
    p.add_argument("--label", default="")
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, args.src)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import dspark_jax
    from dspark_jax.target import load_target
    from train.config import load_config
    from train.distill import make_optimizer, make_train_step

    sets = list(args.set)
    vocab = 0
    for s in list(sets):  # the old code has no draft_vocab_size: apply it here
        if s.startswith("drafter.draft_vocab_size="):
            vocab = int(s.split("=", 1)[1])
            sets.remove(s)
    cfg = load_config(args.config, sets)
    d = cfg.data
    A = args.anchors or d.anchors_per_seq
    target = load_target(cfg.target.spec, cfg.target.dtype)
    over = dict(cfg.drafter.overrides)
    if vocab:
        over["draft_vocab"] = tuple(range(vocab))
    drafter = dspark_jax.init_drafter(target, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size, **over)
    S, T, L = d.batch_sequences, d.seq_len, cfg.drafter.block_size
    D, m = target.config.hidden_size, len(drafter.config.target_layers)
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(3, 40000, size=(S, T)), jnp.int32),
             "lengths": jnp.full((S,), T, jnp.int32),
             "anchors": jnp.asarray(rng.integers(1, T - 2, size=(S, A)), jnp.int32),
             "feats": jnp.asarray(rng.standard_normal((S, T, m * D)), jnp.float32),
             "hidden": jnp.asarray(rng.standard_normal((S, T, D)), jnp.float32)}
    if vocab:  # the log-normaliser of these hidden states, as train/features.py stores it
        head = target.module().head
        batch["lse"] = jax.lax.map(lambda h: jax.nn.logsumexp(head(h), axis=-1), batch["hidden"])
    tx = make_optimizer(1e-4, 100, 10)
    step = make_train_step(target, drafter, tx)
    params = jax.tree.map(jnp.array, drafter.params)
    opt = tx.init(params)
    t0 = time.perf_counter()
    params, opt, metrics = step(params, opt, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        params, opt, metrics = step(params, opt, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(drafter.params))
    print(json.dumps({"label": args.label, "kind": cfg.drafter.kind, "S": S, "T": T, "A": A, "L": L,
                      "draft_vocab": vocab or target.config.vocab_size, "params": n_params,
                      "first_step_s": round(compile_s, 1), "step_s": round(sec, 3),
                      "step_s_all": [round(t, 3) for t in times], "anchor_rows_per_s": round(S * A / sec, 1),
                      "block_tokens_per_s": round(S * A * L / sec, 1), "loss": float(metrics["loss"])}),
          flush=True)


if __name__ == "__main__":
    main()
