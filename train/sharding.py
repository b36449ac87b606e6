"""Training-time sharding: a (data, fsdp, tensor) mesh and the layouts of the train state on it.

  data    — batch rows only (pure data parallelism; parameters replicated across it);
  fsdp    — batch rows *and* parameter/optimizer-state shards (ZeRO-3 style: XLA all-gathers weights per use);
  tensor  — the inference rules of dspark_jax.sharding (heads, FFN columns, vocabulary), with `model` → `tensor`.
Every parameter gets the tensor rule of its path (drafter layers reuse the target's attn/mlp names), then its
largest still-unsharded dimension that `fsdp` divides goes over `fsdp`. Optimizer moments follow their
parameter (matched by path); scalars are replicated. A dimension an axis does not divide stays replicated.
The same code runs on one CPU (a 1×1×1 mesh) and on a pod slice.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dspark_jax.sharding import PARAM_RULES

AXES = ("data", "fsdp", "tensor")
# The drafter's own large matrices, on top of the shared rules (its layers match the target's attn/mlp names).
DRAFTER_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"markov_w1", ("model", None)),  # [V, R]: vocabulary-parallel like the embedding
    (r"markov_w2", (None, "model")),  # [R, V]
)
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class TrainShardings:
    params: object  # pytree of NamedSharding matching the drafter parameters
    opt: object  # … the optimizer state
    target: object  # … the frozen target parameters
    batch: NamedSharding  # leading (row) dimension over data × fsdp
    replicated: NamedSharding


def make_train_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    devices = jax.devices() if devices is None else devices
    n = data * fsdp * tensor
    if n > len(devices):
        raise ValueError(f"mesh data={data} × fsdp={fsdp} × tensor={tensor} needs {n} devices, have {len(devices)}")
    return jax.make_mesh((data, fsdp, tensor), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def _path_str(path) -> str:
    """Dotted parameter path from a pytree key path, keeping only dict keys (skips optax wrappers)."""
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def leaf_spec(path: str, shape: tuple[int, ...], mesh_shape: dict) -> PartitionSpec:
    """Tensor rule of `path` (if any), then fsdp on the largest free divisible dimension."""
    axes: list[str | None] = [None] * len(shape)
    for rx, rule in DRAFTER_RULES + PARAM_RULES:
        if re.fullmatch(rx, path) and len(rule) == len(shape):
            axes = ["tensor" if a == "model" else a for a in rule]
            break
    axes = [a if a is not None and dim % mesh_shape[a] == 0 else None for a, dim in zip(axes, shape, strict=True)]
    fsdp = mesh_shape.get("fsdp", 1)
    if fsdp > 1 and shape:
        free = [i for i, a in enumerate(axes) if a is None and shape[i] % fsdp == 0]
        if free:
            axes[max(free, key=lambda i: shape[i])] = "fsdp"
    return PartitionSpec(*axes)


def tree_specs(tree, mesh_shape: dict):
    """PartitionSpecs for every leaf of a parameter-like pytree (pure dicts, possibly inside optax states)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_spec(_path_str(p), tuple(np.shape(x)), mesh_shape), tree)


def train_shardings(mesh, dparams, opt_state, tparams) -> TrainShardings:
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, dict(mesh.shape)),  # noqa: E731
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    return TrainShardings(params=named(dparams), opt=named(opt_state), target=named(tparams),
                          batch=NamedSharding(mesh, PartitionSpec(BATCH_AXES)),
                          replicated=NamedSharding(mesh, PartitionSpec()))


def put_batch(batch: dict, sharding: NamedSharding) -> dict:
    """This process's rows of a global batch → global arrays laid out over data × fsdp."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
