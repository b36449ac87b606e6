"""Training-time sharding: a (data, fsdp, tensor) mesh and the layouts of the train state on it.

  data    — batch rows only (pure data parallelism; parameters replicated across it);
  fsdp    — batch rows *and* parameter/optimizer-state shards (ZeRO-3 style: XLA all-gathers weights per use);
  tensor  — the inference rules of dspark_jax.sharding (heads, FFN columns, vocabulary), with `model` → `tensor`.
Every parameter gets the tensor rule of its path (drafter layers reuse the target's attn/mlp names), then its
largest still-unsharded dimension that `fsdp` divides goes over `fsdp`. Optimizer moments follow their
parameter (matched by path); scalars are replicated. A dimension an axis does not divide stays replicated.
The same code runs on one CPU (a 1×1×1 mesh) and on a pod slice.

Several processes (one per host). Each calls the same functions on its own copy of the config, the data listing,
the carry and the target files. They must agree on all of these or the run is silently wrong (one host's other
learning rate or stale carry makes its part of every batch another experiment), yet comparing the values
themselves is what `jax.device_put` does for a host array placed on devices of several processes: an all-gather
of every array (16 GB per host for an 8B target) before the first step. Here instead:
  agree(facts)       — each process hashes each named fact (8 bytes apiece) and one tiny all-gather compares
                       them; a mismatch is a ValueError on every process naming the facts that differ;
  place(tree, sh)    — host values known to agree → global arrays, each process filling only its own devices
                       (`jax.make_array_from_callback`), with no cross-process comparison;
  load_target_per_host — a Hugging Face target read per host, only the slices its devices hold
                       (dspark_jax.weights.load_sharded);
  gather_json, gather_params — every process's small JSON value (its data position), and full host copies of
                       global arrays (the carry, the final drafter), on every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from dspark_jax.sharding import PARAM_RULES
from train.config import is_local, resolve

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


def tree_shardings(mesh, tree):
    """NamedShardings on `mesh` for every leaf of a parameter-like pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, dict(mesh.shape)),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def train_shardings(mesh, drafter_params, opt_state, target_params) -> TrainShardings:
    named = lambda tree: tree_shardings(mesh, tree)  # noqa: E731
    return TrainShardings(params=named(drafter_params), opt=named(opt_state), target=named(target_params),
                          batch=NamedSharding(mesh, PartitionSpec(BATCH_AXES)),
                          replicated=NamedSharding(mesh, PartitionSpec()))


def per_device_bytes(tree, mesh_shape: dict) -> int:
    """Bytes the most loaded device holds of a pytree laid out by `tree_specs` (shapes only: arrays or
    ShapeDtypeStructs; an axis that does not divide a dimension leaves it replicated, as `leaf_spec` does)."""
    specs = jax.tree.leaves(tree_specs(tree, mesh_shape), is_leaf=lambda s: isinstance(s, PartitionSpec))
    total = 0
    for x, spec in zip(jax.tree.leaves(tree), specs, strict=True):
        split = 1
        for axes in spec:
            for a in (axes,) if isinstance(axes, str) else axes or ():
                split *= mesh_shape[a]
        total += -(-int(np.prod(x.shape)) // split) * np.dtype(x.dtype).itemsize
    return total


def put_batch(batch: dict, sharding: NamedSharding) -> dict:
    """This process's rows of a global batch → global arrays laid out over data × fsdp."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


# ---- several processes ------------------------------------------------------------------------------------------
def digest(value) -> str:
    """A short, stable hash of a JSON-able value (dict keys sorted; other objects by their str)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def agree(facts: dict[str, object]) -> None:
    """Raises ValueError on every process if the processes' `facts` (name → JSON-able value) differ anywhere."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(facts)
    mine = np.array([[int(digest(facts[n])[i : i + 8], 16) >> 1 for i in (0, 8)] for n in names], np.int32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))  # [P, facts, 2]
    differ = [n for j, n in enumerate(names) if (everyone[:, j] != everyone[0, j]).any()]
    if differ:
        raise ValueError(f"the {len(everyone)} processes disagree on {differ}: every host must run the same "
                         f"config, data, carry and target (process {jax.process_index()} has "
                         f"{ {n: digest(facts[n]) for n in differ} })")


def place(tree, shardings):
    """Host values (numpy or single-process jax arrays) → global arrays laid out by `shardings` (same structure).

    One process: `jax.device_put`. Several: each process builds only the shards of its own devices from its
    copy, trusting `agree` for their equality (device_put would all-gather every array to compare them)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, tree, shardings)


def gather_json(value) -> list:
    """[value of process 0, value of process 1, ...] on every process (values JSON-able)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(rows[p, : sizes[p]]).decode()) for p in range(len(sizes))]


def gather_params(tree):
    """Global (possibly multi-process) arrays → full numpy copies on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def target_source(cfg) -> tuple[str, epath.Path | None]:
    """("hf", directory) for a Hugging Face directory (local or a URI: read per host in slices), else
    ("load", None): a known name or a GGUF file, read whole by `dspark_jax.target.load_target`."""
    spec = cfg.target.spec
    if "://" in spec or any(spec.startswith(p) for p in cfg.run.path_roots) or os.path.isdir(os.path.expanduser(spec)):
        path = resolve(spec, cfg.run.path_roots)
        if (path / "config.json").exists():
            return "hf", path
    return "load", None


def load_target_per_host(directory: epath.Path, dtype: str, mesh):
    """(load, facts): `load()` returns a Target whose params are global arrays on `mesh` (laid out by
    `tree_shardings`), each process reading only its devices' slices; `facts` ({"target": ...} for `agree`) come
    from the config and safetensors headers alone, so hosts compare them before reading any weights. The
    tokenizer is loaded only from a local directory (training needs none but its EOS ids, which the config also
    gives)."""
    from dspark_jax.config import ModelConfig
    from dspark_jax.model import Decoder
    from dspark_jax.target import DTYPES, Target
    from dspark_jax.weights import SafetensorsSlices, load_sharded

    hf_config = json.loads((directory / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_config)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=DTYPES[dtype], rngs=nnx.Rngs(0))))
    reader = SafetensorsSlices(directory)
    files = {n: (os.fspath(p.name), str(d), s, o) for n, (p, d, s, o) in reader.tensors.items()}
    facts = {"target": {"config": hf_config, "dtype": dtype, "tensors": digest(files)}}

    def load():
        params = load_sharded(directory, cfg, tree_shardings(mesh, nnx.to_pure_dict(state)), DTYPES[dtype],
                              reader=reader)
        total = sum(int(np.prod(s)) * d.itemsize for _, d, s, _ in reader.tensors.values())
        print(f"target {directory}: read {reader.bytes_read / 2**20:.1f} MiB of {total / 2**20:.1f} MiB "
              f"(the slices of process {jax.process_index()}'s devices)", flush=True)
        nnx.replace_by_pure_dict(state, params)
        tokenizer = None
        if is_local(directory):
            from dspark_jax.gguf_file import load_tokenizer

            tokenizer = load_tokenizer("hf", os.fspath(directory), require_chat_template=False)
        return Target(nnx.merge(graphdef, state), tokenizer, source=os.fspath(directory))

    return load, facts
