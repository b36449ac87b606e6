"""Sharding: one rules table from parameter paths to mesh axes, applied at the jit boundary.

Mesh axes: `data` (batch rows) and `model` (tensor parallel: heads, FFN columns, vocabulary).
Single-device code is the same code on a 1×1 mesh. A dimension that the mesh axis does not divide
(SmolLM2's 9 heads on 8 chips, say) is replicated instead — correct, just less parallel.
"""

from __future__ import annotations

import re

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dspark_jax.kv_cache import KVCache

# (regex on the dotted parameter path, mesh axis per dimension)
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("model", None)),  # [V, D]: vocabulary-parallel
    (r"lm_head", (None, "model")),  # [D, V]
    (r".*attn\.(q|k|v)", (None, "model", None)),  # [D, N|K, H]: head-parallel
    (r".*attn\.(q|k|v)_bias", ("model", None)),  # [N|K, H]
    (r".*attn\.o", ("model", None, None)),  # [N, H, D]
    (r".*mlp\.(gate|up)", (None, "model")),  # [D, F]
    (r".*mlp\.(gate|up)_bias", ("model",)),  # [F]
    (r".*mlp\.down", ("model", None)),  # [F, D]
)
# The KV cache [B, K, S, H]: rows over `data`, KV heads over `model`.
CACHE_AXES = ("data", "model", None, None)
# The serving engine's page pools [num_layers, P, K, page_size, H]: KV heads over `model`, as the attention
# weights that write them. Pages are not split over `data`: any request may own any page, so each data replica holds the
# whole pool (the engine's batch is not split over `data` either: on a mesh with data > 1 it is replicated).
PAGED_AXES = (None, None, "model", None, None)


def make_mesh(data: int = 1, model: int = 1) -> jax.sharding.Mesh:
    """A (data, model) mesh over the first data·model devices, with classic auto sharding."""
    n = data * model
    if n > jax.device_count():
        raise ValueError(f"mesh {data}x{model} needs {n} devices, have {jax.device_count()}")
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:n])


def _spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh) -> PartitionSpec:
    fitted = [a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape, strict=True)]
    return PartitionSpec(*fitted)


def param_spec(path: str, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The PartitionSpec of one parameter (replicated if no rule matches: norms, small vectors)."""
    for rx, axes in PARAM_RULES:
        if re.fullmatch(rx, path):
            if len(shape) == len(axes) + 1:  # the target's stacked layers ([num_layers, ...]): layers replicated
                axes = (None, *axes)
            return _spec(axes, shape, mesh)
    return PartitionSpec()


def param_shardings(tree: dict, mesh=None) -> dict:
    """NamedShardings on `mesh` by PARAM_RULES for a pure dict of parameters (arrays or ShapeDtypeStructs, as
    `nnx.to_pure_dict` gives): what `shard_params` places and `weights.load_sharded` loads straight into.
    mesh None: every parameter on the default device."""
    flat = nnx.traversals.flatten_mapping(tree)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return nnx.traversals.unflatten_mapping({k: one for k in flat})
    return nnx.traversals.unflatten_mapping(
        {k: NamedSharding(mesh, param_spec(".".join(map(str, k)), v.shape, mesh)) for k, v in flat.items()})


def shard_params(params: nnx.State, mesh) -> nnx.State:
    """Places an NNX parameter state on `mesh` according to PARAM_RULES (a no-op for arrays already there)."""
    pure = nnx.to_pure_dict(params)
    placed = jax.tree.map(jax.device_put, pure, param_shardings(pure, mesh))
    out = jax.tree.map(lambda x: x, params)  # a copy we may update
    nnx.replace_by_pure_dict(out, placed)
    return out


def shard_cache(cache: KVCache, mesh) -> KVCache:
    """Places a KV cache on `mesh`: rows over `data`, KV heads over `model` (when they divide)."""
    put = lambda x: jax.device_put(x, NamedSharding(mesh, _spec(CACHE_AXES, x.shape, mesh)))  # noqa: E731
    rows = NamedSharding(mesh, _spec(("data",), cache.lengths.shape, mesh))
    return KVCache(k=tuple(map(put, cache.k)), v=tuple(map(put, cache.v)),
                   lengths=jax.device_put(cache.lengths, rows))


def paged_sharding(mesh, num_kv_heads: int) -> NamedSharding:
    """The sharding of a page pool [num_layers, P, K, page_size, H] on `mesh` (KV heads over `model` when they
    divide)."""
    return NamedSharding(mesh, _spec(PAGED_AXES, (1, 1, num_kv_heads, 1, 1), mesh))
