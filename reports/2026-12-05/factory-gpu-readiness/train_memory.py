"""Compiled memory of the drafter factory's training programs at its GPU settings, from XLA:CPU's buffer
assignment (no step is run): the shared target forward and each drafter's train step, for a few anchors-per-
sequence values. XLA:GPU fuses and assigns buffers differently, so read these as estimates of the peak, not
measurements of it.

    python reports/2026-12-05/factory-gpu-readiness/train_memory.py --anchors 16 32 64
"""

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.drafter import Drafter
from dspark_jax.drafter_model import DrafterModel
from dspark_jax.target import load_target
from train import factory
from train.distill import init_train_state, make_settable_optimizer, make_train_step


def jitted_of(fn):
    """make_train_step's lambda closes over its jitted step."""
    for cell in fn.__closure__:
        if hasattr(cell.cell_contents, "lower"):
            return cell.cell_contents
    raise LookupError("no jitted function in the closure")


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--anchors", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--batch-sequences", type=int, default=factory.FactorySettings().batch_sequences)
    p.add_argument("--seq-len", type=int, default=factory.FactorySettings().seq_len)
    a = p.parse_args()
    target = load_target("smollm2-135m-instruct", dtype="bfloat16")
    rows = []
    for A in a.anchors:
        s = factory.FactorySettings(anchors_per_seq=A, batch_sequences=a.batch_sequences, seq_len=a.seq_len)
        cfgs = factory.drafter_configs(target, s)
        layers = next(iter(cfgs.values())).target_layers
        S, T = s.batch_sequences, s.seq_len
        tokens = jax.ShapeDtypeStruct((S, T), jnp.int32)
        features = factory.shared_features_fn(target, layers)
        hidden, feats = jax.eval_shape(features, target.params, tokens)
        if A == a.anchors[0]:
            m = features.lower(target.params, tokens).compile().memory_analysis()
            rows.append({"program": "target forward", "S": S, "T": T, "temp_gib": gib(m.temp_size_in_bytes),
                         "args_gib": gib(m.argument_size_in_bytes), "out_gib": gib(m.output_size_in_bytes)})
        batch = {"tokens": tokens, "lengths": jax.ShapeDtypeStruct((S,), jnp.int32),
                 "anchors": jax.ShapeDtypeStruct((S, A), jnp.int32), "hidden": hidden, "feats": feats}
        tx = make_settable_optimizer()
        for kind, cfg in cfgs.items():
            d = Drafter(cfg, DrafterModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
            params, opt = init_train_state(d.params, tx)
            step = jitted_of(make_train_step(target, d, tx))
            m = step.lower(params, opt, target.params, batch).compile().memory_analysis()
            rows.append({"program": f"{kind} step", "S": S, "T": T, "A": A, "temp_gib": gib(m.temp_size_in_bytes),
                         "args_gib": gib(m.argument_size_in_bytes), "out_gib": gib(m.output_size_in_bytes)})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
