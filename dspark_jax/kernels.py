"""The one door from `dspark_jax` to `pallas_kernels`: picks the Pallas kernel or its plain-jnp path.

Modes (a static argument, never an environment variable), per kernel or one string for both:
  "auto"      — the path measured faster on this backend (`AUTO_PALLAS`): on CPU the jnp path (Pallas only
                interprets there, slowly); on GPU the attention kernel and the jnp sampler; on TPU the jnp
                paths until a kernel is measured faster there (scripts/bench_pallas_*.py);
  "pallas"    — force the kernel (on CPU it runs in interpret mode: for tests);
  "reference" — force the jnp path.
"""

from __future__ import annotations

import dataclasses

import jax

KERNEL_MODES = ("auto", "pallas", "reference")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Which path each kernel takes: `markov` (draft sampling) and `attention` (target forward), and the device
    mesh the programs run on (None: one device). On a mesh a kernel runs inside `shard_map`, each device on its
    own heads: XLA cannot partition a custom call, so a kernel in a sharded program would otherwise get whole
    (all-gathered) page pools."""

    markov: str = "auto"
    attention: str = "auto"
    mesh: jax.sharding.Mesh | None = None

    def __post_init__(self):
        for mode in (self.markov, self.attention):
            if mode not in KERNEL_MODES:
                raise ValueError(f"unknown kernel mode {mode!r}; choose one of {', '.join(KERNEL_MODES)}")

    @classmethod
    def parse(cls, spec: str | KernelConfig) -> KernelConfig:
        """A KernelConfig, or one mode string for every kernel."""
        return spec if isinstance(spec, KernelConfig) else cls(markov=spec, attention=spec)

    def on(self, mesh) -> KernelConfig:
        """The same modes on `mesh` (a hashable static argument of the serving programs)."""
        return dataclasses.replace(self, mesh=mesh)

    def pallas(self, kernel: str) -> bool:
        """Whether `kernel` ("attention" or "markov") runs as the Pallas kernel here (`use_pallas`)."""
        return use_pallas(getattr(self, kernel), kernel=kernel)


# Where "auto" takes the Pallas kernel, per kernel and backend: where it was measured faster than the jnp path
# (scripts/bench_pallas_*.py; the numbers are in docs/benchmarks.md#kernels). On GPU the ragged attention kernel
# beats its reference and the Markov sampler does not beat its fused-XLA reference, so "auto" takes the attention
# kernel and the jnp sampler there. On TPU neither kernel has been measured, so plain jnp (a kernel joins this
# table once measured faster on a TPU; "pallas" forces it until then). jax's own TPU ragged paged attention
# (jax.experimental.pallas.ops.tpu.ragged_paged_attention) does not fit our pools: it reads one layer's K and V
# interleaved in one [pages, page_size, 2·K, H] array, where the serving pools are separate stacked
# [layers, pages, K, page_size, H] arrays indexed by layer inside the scan; adapting them would copy a layer's
# whole pool every call.
AUTO_PALLAS = {"attention": ("gpu",), "markov": ()}


def use_pallas(mode: str, *, kernel: str) -> bool:
    """Whether `mode` selects the Pallas `kernel` ("attention" or "markov") on the current default backend."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; choose one of {', '.join(KERNEL_MODES)}")
    if kernel not in AUTO_PALLAS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(AUTO_PALLAS)}")
    if mode == "auto":
        return jax.default_backend() in AUTO_PALLAS[kernel]
    return mode == "pallas"


def markov_sample(U, w1, w2, anchor, temperature, seeds, mesh=None):
    """The fused Markov-head sampler (pallas_kernels/markov_sample.py), interpreted on CPU.

    U [B, L, V], w1 [V, R], w2 [R, V], anchor int32 [B], temperature f32 [B], seeds uint32 [B, 2] →
    MarkovSample(tokens [B, L], logq [B, L], lse [B, L], e [B, L, R]). Temperature-only: callers route batches
    with top-k/top-p to the scan path. On a `mesh` it runs under `shard_map`, replicated (the draft batch is
    replicated, and the sampler reads whole vocabulary rows), so no custom call sits in a partitioned program.
    """
    from pallas_kernels.markov_sample import markov_sample as kernel

    if mesh is None:
        return kernel(U, w1, w2, anchor, temperature, seeds)
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(kernel, mesh=mesh, in_specs=(P(),) * 6, out_specs=P(), check_vma=False)(
        U, w1, w2, anchor, temperature, seeds)


def cached_attention(q, k_buf, v_buf, positions):
    """Causal attention of padded query blocks over a contiguous KV cache, through the ragged paged kernel.

    A contiguous cache [B, K, S, H] is the paged layout with one page of S slots per row (block table [b] = [b]).
    Every row's T queries count as its verification block (padding queries produce values nobody reads), so
    query_start = [0, T, 2T, …] and context_lens = positions[:, −1] + 1 (the block's K/V are already written).

    Args:
        q: [B, T, N, H]; k_buf, v_buf: [B, K, S, H]; positions: int32 [B, T] absolute query positions.

    Returns:
        [B, T, N, H].
    """
    from pallas_kernels.ragged_verify_attention import ragged_verify_attention

    B, T, N, H = q.shape
    out = ragged_verify_attention(
        q.reshape(B * T, N, H), k_buf, v_buf,
        block_tables=jax.numpy.arange(B, dtype=jax.numpy.int32)[:, None],
        context_lens=(positions[:, -1] + 1).astype(jax.numpy.int32),
        query_start=(jax.numpy.arange(B + 1, dtype=jax.numpy.int32) * T))
    return out.reshape(B, T, N, H)


def ragged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, *, max_q_len: int,
                     use_kernel: bool, layer=None, mesh=None):
    """Attention of a flat bucket of query tokens over paged caches: the Pallas kernel, or its jnp reference
    (one request at a time, working set [max_q_len, N, S]). Shapes as in ragged_verify_attention; with `layer`,
    stacked pools [num_layers, P, K, page_size, H] read at that layer. With a `mesh` whose `model` axis divides
    the query and KV heads (as the sharding rules split them), the kernel runs under `shard_map`, each device on
    its heads' queries and pool shards; otherwise replicated."""
    if use_kernel and mesh is not None and "model" in mesh.shape and mesh.shape["model"] > 1:
        return _sharded_ragged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, layer, mesh)
    from pallas_kernels.ragged_verify_attention import (
        ragged_verify_attention,
        ragged_verify_attention_reference,
    )

    if use_kernel:
        return ragged_verify_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, layer=layer)
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    return ragged_verify_attention_reference(q, k_pages, v_pages, block_tables, context_lens, query_start,
                                             max_q_len=max_q_len)


def _sharded_ragged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, layer, mesh):
    """The ragged attention kernel under `shard_map` over the mesh's `model` axis (heads), every other input
    replicated: GQA groups stay whole on a device because N and K are split by the same factor."""
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.ragged_verify_attention import ragged_verify_attention

    m = mesh.shape["model"]
    N, K = q.shape[1], k_pages.shape[-3]
    heads = "model" if N % m == 0 and K % m == 0 else None
    pool = P(None, heads, None, None) if layer is None else P(None, None, heads, None, None)
    layer = jax.numpy.zeros((), jax.numpy.int32) if layer is None else layer
    stacked = k_pages.ndim == 5

    def local(q, k, v, tables, lens, starts, i):
        return ragged_verify_attention(q, k, v, tables, lens, starts, layer=i if stacked else None)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(None, heads, None), pool, pool, P(), P(), P(), P()),
                         out_specs=P(None, heads, None), check_vma=False)(
        q, k_pages, v_pages, block_tables, context_lens, query_start, layer)
