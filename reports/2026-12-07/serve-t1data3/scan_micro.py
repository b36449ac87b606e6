"""XLA:CPU, batch 1: 30 layers of a SmolLM2-sized MLP (576 → 1536 → 576, f32) three ways — `lax.scan` over
stacked weights, per-layer arrays in one program, static slices of the stacks — mean ms over 50 calls."""

import time

import jax
import jax.numpy as jnp
import numpy as np

L, D, F = 30, 576, 1536
rng = np.random.default_rng(0)
W1 = jnp.asarray(rng.standard_normal((L, D, F), np.float32) * 0.02)
W2 = jnp.asarray(rng.standard_normal((L, F, D), np.float32) * 0.02)
x = jnp.ones((1, D), jnp.float32)


@jax.jit
def scanned(x, W1, W2):
    def body(h, w):
        a, b = w
        return h + jax.nn.silu(h @ a) @ b, None

    return jax.lax.scan(body, x, (W1, W2))[0]


@jax.jit
def per_layer(x, ws1, ws2):
    h = x
    for a, b in zip(ws1, ws2, strict=True):
        h = h + jax.nn.silu(h @ a) @ b
    return h


@jax.jit
def static_slices(x, W1, W2):
    h = x
    for i in range(L):
        h = h + jax.nn.silu(h @ W1[i]) @ W2[i]
    return h


cases = [("scan", scanned, (x, W1, W2)), ("per-layer arrays", per_layer, (x, list(W1), list(W2))),
         ("static slices", static_slices, (x, W1, W2))]
for name, f, args in cases:
    f(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(50):
        f(*args).block_until_ready()
    print(f"{name}: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms")
