"""The price of verifying: one target pass over T tokens against a pass over 1, and where it goes.

    python scripts/bench_verify_price.py [--tokens 1 2 4 8 16] [--contexts 64 512] [--repeats 30]
        [--layouts einsum served] [--xla-flags= --xla-flags=--xla_cpu_experimental_ynn_fusion_type= ...]
        [--out verify_price.json]

For each T and context length n, one request's pass as the serving round runs it (`paged.target_forward_flat`
over a flat bucket of T tokens at positions n..n+T−1, then the LM head over the T rows), jitted, timed as the
median of `--repeats` runs after one warm-up. Beside it, the same pass split into its parts, each jitted alone:
the 30 layers' projections and MLPs (x[T, D] @ W for every dense weight, the same einsums), the LM head, and
the rest (attention, norms, RoPE, page writes) as the difference. The weight-read ceiling of a pass is
bytes of weights read once / the measured read bandwidth (a numpy sum over a buffer larger than the caches).

`--layouts`: the target's weights as stored (einsum layout, x @ W) and as the serving round runs them on
XLA:CPU (`Target.serving_split`: output-major, W @ xᵀ; layers.dense), both by default, interleaved per shape
so that drift hits both; the last table compares them.

Each `--xla-flags` value runs the whole table in a fresh process with XLA_FLAGS set to it (XLA reads them at
start-up), so compiler options can be compared in one run; the first value is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layouts", nargs="+", choices=["einsum", "served"], default=["einsum", "served"],
                   help="the target's stored weight layout and/or the serving round's (Target.serving_split)")
    p.add_argument("--xla-flags", action="append", default=None, metavar="FLAGS",
                   help="an XLA_FLAGS value to compare (repeat it; write --xla-flags=VALUE, since values start with "
                        "--); one process each; default: only the inherited XLA_FLAGS")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _median_s(repeats: int, fn, *args) -> float:
    from pallas_kernels.timing import timed  # imports jax: after a child's XLA_FLAGS are set

    return timed(fn, *args, repeats=repeats)


def read_bandwidth_gbs() -> float:
    """Bytes/s of a numpy sum over 1 GiB (larger than any cache), best of 5."""
    import numpy as np

    buf = np.ones(1 << 28, np.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import dspark_jax
    from dspark_jax.paged import PagedKV, target_forward_flat

    target = dspark_jax.load_target(args.target)
    cfg = target.config
    page = 16
    max_ctx = max(args.contexts) + max(args.tokens)
    pages = -(-max_ctx // page)
    kv = PagedKV.init(num_layers=cfg.num_layers, num_pages=pages, num_kv_heads=cfg.num_kv_heads, page_size=page,
                      head_dim=cfg.head_dim, dtype=target.dtype)
    tables = jnp.arange(pages, dtype=jnp.int32)[None]

    def programs(gd):
        @jax.jit
        def full(params, kv, tokens, n):
            model = nnx.merge(gd, params)
            T = tokens.shape[0]
            pos = n + jnp.arange(T, dtype=jnp.int32)
            h, kv, _ = target_forward_flat(model, kv, tokens, jnp.zeros((T,), jnp.int32), pos,
                                           jnp.ones((T,), bool), tables, (n + T)[None], jnp.array([0, T], jnp.int32),
                                           max_q_len=T)
            return model.head(h), kv

        @jax.jit
        def dense_only(params, x):
            from dspark_jax.model import scan_layers

            def body(layer, x, _):
                q, k, v = layer.attn.qkv(x[None])
                y = layer.attn.out(q) + layer.mlp(x[None])
                return x + y[0] + 0 * (k.sum() + v.sum()), None

            return scan_layers(nnx.merge(gd, params).layers, body, x)[0]

        @jax.jit
        def head_only(params, x):
            return nnx.merge(gd, params).head(x)

        return full, dense_only, head_only

    splits = {name: target.serving_split(name == "served") for name in args.layouts}
    progs = {name: programs(gd) for name, (gd, _) in splits.items()}
    weights = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in jax.tree.leaves(target.params))
    bw = read_bandwidth_gbs()
    rows = []
    for n in args.contexts:
        for T in args.tokens:
            tokens = jnp.arange(T, dtype=jnp.int32) + 100
            x = jnp.ones((T, cfg.hidden_size), target.dtype)
            for name, (_, params) in splits.items():
                full, dense_only, head_only = progs[name]
                t_full = _median_s(args.repeats, full, params, kv, tokens, jnp.int32(n))
                t_dense = _median_s(args.repeats, dense_only, params, x)
                t_head = _median_s(args.repeats, head_only, params, x)
                rows.append(dict(layout=name, context=n, tokens=T, pass_ms=1e3 * t_full, dense_ms=1e3 * t_dense,
                                 head_ms=1e3 * t_head, rest_ms=1e3 * max(0.0, t_full - t_dense - t_head)))
    return dict(xla_flags=os.environ.get("XLA_FLAGS", ""), weight_bytes=weights, read_bandwidth_gbs=bw,
                weight_read_ms=1e3 * weights / (bw * 1e9), load=os.getloadavg()[0], rows=rows)


def print_table(res: dict) -> None:
    print(f"\nXLA_FLAGS={res['xla_flags']!r}  weights {res['weight_bytes'] / 1e6:.0f} MB, read bandwidth "
          f"{res['read_bandwidth_gbs']:.1f} GB/s -> weight-read ceiling {res['weight_read_ms']:.1f} ms/pass "
          f"(load {res['load']:.1f})")
    print(f"{'layout':>7} {'context':>7} {'T':>3} {'pass ms':>8} {'/ T=1':>6} {'dense ms':>9} {'head ms':>8} "
          f"{'rest ms':>8}")
    t1 = min(r["tokens"] for r in res["rows"])
    base = {(r["layout"], r["context"]): r["pass_ms"] for r in res["rows"] if r["tokens"] == t1}
    for r in res["rows"]:
        print(f"{r['layout']:>7} {r['context']:>7} {r['tokens']:>3} {r['pass_ms']:>8.1f} "
              f"{r['pass_ms'] / base[r['layout'], r['context']]:>6.2f} {r['dense_ms']:>9.1f} {r['head_ms']:>8.1f} "
              f"{r['rest_ms']:>8.1f}")
    by = {(r["layout"], r["context"], r["tokens"]): r for r in res["rows"]}
    if {r["layout"] for r in res["rows"]} == {"einsum", "served"}:
        print("served / einsum layout, same run:")
        for (layout, n, T), r in by.items():
            if layout == "served":
                e = by["einsum", n, T]
                print(f"  context {n:>4} T {T:>3}: pass {r['pass_ms'] / e['pass_ms']:.2f}, "
                      f"dense {r['dense_ms'] / e['dense_ms']:.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    results = []
    for flags in args.xla_flags or [os.environ.get("XLA_FLAGS", "")]:
        env = dict(os.environ, XLA_FLAGS=flags)
        cmd = [sys.executable, __file__, "--child", "--target", args.target, "--repeats", str(args.repeats),
               "--tokens", *map(str, args.tokens), "--contexts", *map(str, args.contexts),
               "--layouts", *args.layouts]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            print(f"XLA_FLAGS={flags!r}: the measuring process failed (exit {out.returncode})", file=sys.stderr)
            return 1
        res = json.loads(out.stdout.strip().splitlines()[-1])
        print_table(res)
        results.append(res)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
