"""Foreign weights → our Decoder, through one declarative name table.

Every source (a Hugging Face directory of safetensors, or a GGUF file already renamed to HF names by
`gguf_file.read_gguf`) yields a flat dict of HF tensor names → numpy arrays. `WEIGHT_TABLE` maps each HF
name pattern to our parameter path and a layout transform (HF `Linear.weight` is [out, in]; we store
einsum layouts, see layers.py). Missing, unexpected or mis-shaped tensors are errors, never skipped.

`load_sharded` reads the same table the other way round; `target.load_target` serves every Hugging Face
directory through it, and a multi-host training job's target too. Each process reads only the slices of the
tensors its own devices hold, straight from the safetensors bytes (local files memory-mapped, `gs://` and other
etils.epath URIs by ranged reads), tensor by tensor and device by device, cast to the serving dtype on the host
per slice; stacked layers are assembled on each device layer by layer. Neither the host nor any one device ever
holds the whole model (tests/test_sharded_load.py measures both).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import ModelConfig
from dspark_jax.model import Decoder

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _copy(w, c):
    return w


def _t(w, c):  # [out, in] → [in, out]
    return w.T


def _q_in(w, c):  # [N·H, D] → [D, N, H]
    return w.T.reshape(c.hidden_size, c.num_heads, c.head_dim)


def _kv_in(w, c):  # [K·H, D] → [D, K, H]
    return w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim)


def _o_in(w, c):  # [D, N·H] → [N, H, D]
    return w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)


def _q_bias(w, c):  # [N·H] → [N, H]
    return w.reshape(c.num_heads, c.head_dim)


def _kv_bias(w, c):  # [K·H] → [K, H]
    return w.reshape(c.num_kv_heads, c.head_dim)


_L = r"model\.layers\.(\d+)\."
# (HF name regex, our parameter path with {0} = layer index, transform)
WEIGHT_TABLE: tuple[tuple[str, str, Transform], ...] = (
    (r"model\.embed_tokens\.weight", "embed", _copy),
    (r"lm_head\.weight", "lm_head", _t),
    (r"model\.norm\.weight", "final_norm.scale", _copy),
    (_L + r"input_layernorm\.weight", "layers.{0}.attn_norm.scale", _copy),
    (_L + r"post_attention_layernorm\.weight", "layers.{0}.mlp_norm.scale", _copy),
    (_L + r"self_attn\.q_proj\.weight", "layers.{0}.attn.q", _q_in),
    (_L + r"self_attn\.k_proj\.weight", "layers.{0}.attn.k", _kv_in),
    (_L + r"self_attn\.v_proj\.weight", "layers.{0}.attn.v", _kv_in),
    (_L + r"self_attn\.o_proj\.weight", "layers.{0}.attn.o", _o_in),
    (_L + r"self_attn\.q_proj\.bias", "layers.{0}.attn.q_bias", _q_bias),
    (_L + r"self_attn\.k_proj\.bias", "layers.{0}.attn.k_bias", _kv_bias),
    (_L + r"self_attn\.v_proj\.bias", "layers.{0}.attn.v_bias", _kv_bias),
    (_L + r"self_attn\.o_proj\.bias", "layers.{0}.attn.o_bias", _copy),
    (_L + r"self_attn\.q_norm\.weight", "layers.{0}.attn.q_norm.scale", _copy),
    (_L + r"self_attn\.k_norm\.weight", "layers.{0}.attn.k_norm.scale", _copy),
    (_L + r"mlp\.gate_proj\.weight", "layers.{0}.mlp.gate", _t),
    (_L + r"mlp\.up_proj\.weight", "layers.{0}.mlp.up", _t),
    (_L + r"mlp\.down_proj\.weight", "layers.{0}.mlp.down", _t),
    (_L + r"mlp\.gate_proj\.bias", "layers.{0}.mlp.gate_bias", _copy),
    (_L + r"mlp\.up_proj\.bias", "layers.{0}.mlp.up_bias", _copy),
    (_L + r"mlp\.down_proj\.bias", "layers.{0}.mlp.down_bias", _copy),
)
_COMPILED = tuple((re.compile(p + r"\Z"), path, fn) for p, path, fn in WEIGHT_TABLE)


def map_hf_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Renames and re-lays-out HF tensors into {our dotted path: array}."""
    out = {}
    for name, w in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy of the embedding
        for rx, path, fn in _COMPILED:
            m = rx.match(name)
            if m:
                out[path.format(*m.groups())] = fn(np.asarray(w), cfg)
                break
        else:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old checkpoints saved; we recompute it
            raise ValueError(f"unexpected tensor {name!r}: no rule in weights.WEIGHT_TABLE matches it")
    return out


def read_hf_config(directory: str) -> dict:
    """config.json of a Hugging Face model directory (malformed JSON is a ValueError)."""
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def read_hf_dir(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Reads config.json and single or sharded safetensors from a Hugging Face model directory."""
    from safetensors import SafetensorError, safe_open

    config = read_hf_config(directory)
    # Parse the config before touching the weights: an unsupported architecture is the error to report.
    ModelConfig.from_hf(config)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    tensors = {}
    for fname in files:
        # framework="flax" reads bfloat16 too (plain numpy has no bf16 dtype); widen to f32 here.
        try:
            with safe_open(os.path.join(directory, fname), framework="flax") as f:
                for name in f.keys():
                    tensors[name] = np.asarray(f.get_tensor(name).astype(jnp.float32))
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {fname}: {e}") from None
    return config, tensors


def group_layers(items: dict, num_layers: int) -> dict:
    """{"layers.{i}.<name>": x} for every layer i → {"layers.<name>": [x of layer 0, …, x of the last]}; other
    entries pass through. The Decoder stores its layers stacked (model.stacked_layers), so a name some layers lack,
    or one past the last layer, is an error."""
    out, per_layer = {}, {}
    for path, x in items.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        if m is None:
            out[path] = x
        else:
            per_layer.setdefault(m.group(2), {})[int(m.group(1))] = x
    for name, xs in per_layer.items():
        lacking = sorted(set(range(num_layers)) - set(xs))
        if lacking:
            raise ValueError(f"checkpoint lacks layers.N.{name} for layers {lacking[:5]} (of {num_layers})")
        if len(xs) > num_layers:
            raise ValueError(f"checkpoint has tensors this config does not use: layers.N.{name} for layers "
                             f"{sorted(set(xs) - set(range(num_layers)))[:5]} (the config has {num_layers})")
        out[f"layers.{name}"] = [xs[i] for i in range(num_layers)]
    return out


def stack_layers(params: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """{"layers.{i}.<name>": [...]} for every layer i → {"layers.<name>": [num_layers, ...]} (`group_layers`)."""
    return {path: np.stack(w) if isinstance(w, list) else w for path, w in group_layers(params, num_layers).items()}


def build_decoder(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32, *, mesh=None) -> Decoder:
    """Creates a Decoder whose parameters are exactly `tensors` (HF names), cast to `dtype` on the host and
    placed by `sharding.param_shardings(…, mesh)` (mesh None: on the default device)."""
    from dspark_jax.sharding import param_shardings

    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(state))
    wanted = {".".join(str(p) for p in k): (k, v) for k, v in flat.items()}
    ours = stack_layers(map_hf_tensors(tensors, cfg), cfg.num_layers)
    missing = sorted(set(wanted) - set(ours))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    extra = sorted(set(ours) - set(wanted))
    if extra:
        raise ValueError(f"checkpoint has tensors this config does not use: {extra[:3]}")
    shardings = nnx.traversals.flatten_mapping(param_shardings(nnx.to_pure_dict(state), mesh))
    filled = {}
    for path, (key, spec) in wanted.items():
        arr = ours.pop(path)
        if tuple(arr.shape) != tuple(spec.shape):
            raise ValueError(f"{path}: checkpoint shape {arr.shape} != expected {spec.shape}")
        filled[key] = jax.device_put(np.asarray(arr).astype(np.dtype(jnp.dtype(dtype)), copy=False), shardings[key])
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(filled))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------------------
# Per-host sharded loading: the table read backwards, one slice at a time.

# The transforms above that transpose an HF [out, in] matrix; the rest keep HF's dimension order. Every transform
# then only splits dimensions (a C-order reshape), so a slice of our layout maps back to a range of each HF
# dimension: what lets `load_sharded` read just the part of a tensor a device holds.
_TRANSPOSED = (_t, _q_in, _kv_in, _o_in)
_FILE_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "U8": "uint8", "BOOL": "bool"}


class SafetensorsSlices:
    """The tensors of a Hugging Face safetensors directory (one file or an index of shards), read slice by slice.

    Opening reads only the headers (8-byte length + JSON: dtype, shape, byte offsets per tensor). `read` returns
    a sub-array in the file's dtype: local files through a memory map (only the pages of the slice are touched),
    remote ones (`gs://…`, any etils.epath URI; `ranged=True` forces this path) by one ranged read of the rows
    [r0, r1) of the tensor's first dimension, the other dimensions then sliced in memory. `bytes_read` counts the
    bytes asked for.
    """

    def __init__(self, directory, *, ranged: bool | None = None):
        from etils import epath

        self.directory = epath.Path(directory)
        self.ranged = "://" in os.fspath(directory) if ranged is None else ranged
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
        self.tensors: dict[str, tuple] = {}  # name → (file, numpy dtype, shape, absolute byte offset)
        for fname in files:
            path = self.directory / fname
            if not path.exists():
                raise ValueError(f"{directory} lacks the shard {fname} its index names")
            with path.open("rb") as f:
                head = f.read(8)
                size = path.stat().length
                try:
                    (n,) = struct.unpack("<Q", head)
                    if n > size - 8:
                        raise ValueError(f"header of {n} bytes in a file of {size}")
                    header = json.loads(f.read(n))
                    for name, info in header.items():
                        if name == "__metadata__":
                            continue
                        if info["dtype"] not in _FILE_DTYPES:
                            raise ValueError(f"tensor {name} has unsupported dtype {info['dtype']}")
                        dtype = np.dtype(jnp.dtype(_FILE_DTYPES[info["dtype"]]))
                        shape, (a, b) = tuple(info["shape"]), info["data_offsets"]
                        if b - a != math.prod(shape) * dtype.itemsize or 8 + n + b > size:
                            raise ValueError(f"tensor {name} lies outside the file (truncated?)")
                        self.tensors[name] = (path, dtype, shape, 8 + n + a)
                except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"corrupt safetensors file {fname}: {e}") from None
        self.bytes_read = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][2]

    def read(self, name: str, ranges: list[tuple[int, int]]) -> np.ndarray:
        """x[r0:r1, s0:s1, ...] of tensor `name` ([start, stop) per dimension, HF layout, the file's dtype)."""
        path, dtype, shape, offset = self.tensors[name]
        if not shape:
            ranges = []
        if not self.ranged:
            mm = np.memmap(os.fspath(path), dtype=dtype, mode="r", offset=offset, shape=shape)
            out = np.array(mm[tuple(slice(a, b) for a, b in ranges)])
        else:
            (r0, r1), rest = (ranges[0], ranges[1:]) if shape else ((0, 1), [])
            row = math.prod(shape[1:]) * dtype.itemsize
            with path.open("rb") as f:
                f.seek(offset + r0 * row)
                buf = f.read((r1 - r0) * row)
            out = np.frombuffer(buf, dtype).reshape((r1 - r0, *shape[1:]) if shape else ())
            out = out[(slice(None), *(slice(a, b) for a, b in rest))] if shape else out
        self.bytes_read += out.nbytes
        return out


def _groups(ours: tuple[int, ...], hf: tuple[int, ...], where: str) -> list[list[int]]:
    """Which of our dimensions each HF dimension (already in our order) splits into: consecutive runs whose
    product is that HF dimension's size."""
    groups, i = [], 0
    for size in hf:
        group, prod = [], 1
        while i < len(ours) and (not group or prod < size):
            group.append(i)
            prod *= ours[i]
            i += 1
        if prod != size:
            raise ValueError(f"{where}: checkpoint shape {hf} does not reshape to the expected {ours}")
        groups.append(group)
    while i < len(ours) and ours[i] == 1:  # trailing unit dimensions
        groups[-1].append(i)
        i += 1
    if i != len(ours):
        raise ValueError(f"{where}: checkpoint shape {hf} does not reshape to the expected {ours}")
    return groups


def read_slice(reader: SafetensorsSlices, name: str, fn: Transform, ours: tuple[int, ...],
               bounds: list[tuple[int, int]]) -> np.ndarray:
    """Our layout's x[bounds] of HF tensor `name` (transform `fn` of WEIGHT_TABLE), reading only the HF rows and
    columns it comes from: for our dimensions that split one HF dimension (heads × head_dim), the whole range of
    the outermost one's slice is read and the inner ones are sliced in memory."""
    hf = reader.shape(name)
    order = tuple(reversed(range(len(hf)))) if fn in _TRANSPOSED else tuple(range(len(hf)))
    groups = _groups(ours, tuple(hf[d] for d in order), name)
    hf_ranges, shape, inner_index = [None] * len(hf), [], []
    for d, group in zip(order, groups, strict=True):
        inner = math.prod(ours[j] for j in group[1:])
        a, b = bounds[group[0]]
        hf_ranges[d] = (a * inner, b * inner)
        shape += [b - a] + [ours[j] for j in group[1:]]
        inner_index += [slice(None)] + [slice(*bounds[j]) for j in group[1:]]
    x = reader.read(name, hf_ranges).transpose(order)
    return x.reshape(shape)[tuple(inner_index)]


def _sources(names, cfg: ModelConfig) -> dict[str, tuple[Transform, list[str] | str]]:
    """{our dotted path: (transform, HF name — or, for a stacked layer parameter, one HF name per layer)}."""
    out = {}
    for name in names:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy of the embedding
        for rx, path, fn in _COMPILED:
            m = rx.match(name)
            if m:
                out[path.format(*m.groups())] = (fn, name)
                break
        else:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected tensor {name!r}: no rule in weights.WEIGHT_TABLE matches it")
    grouped = group_layers(out, cfg.num_layers)
    return {path: (v[0][0], [name for _, name in v]) if isinstance(v, list) else v for path, v in grouped.items()}


def load_sharded(directory, cfg: ModelConfig, shardings, dtype=jnp.float32, *, reader=None) -> dict:
    """A Decoder's parameters from a Hugging Face safetensors directory, as global arrays laid out by `shardings`,
    each process reading only the slices its addressable devices hold (`_place_tensor`), one at a time.

    Args:
        directory: the model directory (local path or etils.epath URI such as gs://bucket/qwen3-8b).
        cfg: the ModelConfig its config.json gives.
        shardings: a pure dict shaped like `nnx.to_pure_dict` of the Decoder's state, of jax.sharding.Sharding.
        dtype: the parameters' dtype (each slice is cast on the host as it is read).
        reader: a `SafetensorsSlices` to read through (default: one over `directory`); its `bytes_read` then
            tells how much of the checkpoint this process read.

    Returns:
        The pure dict of jax.Arrays (`nnx.replace_by_pure_dict` it into `nnx.eval_shape` of the Decoder).
        Equal, leaf for leaf, to `build_decoder` on the whole checkpoint.
    """
    reader = SafetensorsSlices(directory) if reader is None else reader
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    wanted = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(abstract)))
    sources = _sources(reader.tensors, cfg)
    paths = {".".join(str(p) for p in k): k for k in wanted}
    missing, extra = sorted(set(paths) - set(sources)), sorted(set(sources) - set(paths))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    if extra:
        raise ValueError(f"checkpoint has tensors this config does not use: {extra[:3]}")
    flat_shardings = nnx.traversals.flatten_mapping(shardings)
    np_dtype = np.dtype(jnp.dtype(dtype))
    out = {}
    for path, key in paths.items():
        fn, names = sources[path]
        out[key] = _place_tensor(reader, fn, names, tuple(wanted[key].shape), flat_shardings[key], np_dtype)
    return nnx.traversals.unflatten_mapping(out)


def _place_tensor(reader: SafetensorsSlices, fn: Transform, names, shape: tuple[int, ...], sharding,
                  np_dtype) -> jax.Array:
    """One parameter as a global array laid out by `sharding`, streamed device by device: each distinct slice
    is read (only its HF rows and columns), cast to `np_dtype` on the host, copied to the devices that hold it
    and dropped before the next is read. A stacked layer parameter (`names` = one HF tensor per layer) is built
    on each device layer by layer into a buffer updated in place, so the host never holds more than one layer's
    slice of it: the host's peak is about one checkpoint tensor, whatever the number of layers or devices."""

    by_bounds: dict[tuple, list] = {}  # devices that hold the same slice (replicated axes) share one read
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(idx.indices(n)[:2] for idx, n in zip(index, shape, strict=True))
        by_bounds.setdefault(bounds, []).append(device)
    shards = {}
    for bounds, devices in by_bounds.items():
        if isinstance(names, list):  # stacked layers: our leading axis is the layer
            (l0, l1), rest = bounds[0], list(bounds[1:])
            local = (l1 - l0, *(b - a for a, b in rest))
            bufs = {d: jnp.zeros(local, np_dtype, device=d) for d in devices}
            for i in range(l0, l1):
                x = read_slice(reader, names[i], fn, shape[1:], rest).astype(np_dtype, copy=False)
                for d in devices:
                    bufs[d] = _set_layer(bufs[d], _to_device(x, d), np.int32(i - l0))
                del x
            shards.update(bufs)
        else:
            x = read_slice(reader, names, fn, shape, list(bounds)).astype(np_dtype, copy=False)
            shards.update({d: _to_device(x, d) for d in devices})
            del x
    return jax.make_array_from_single_device_arrays(shape, sharding, list(shards.values()))


def _to_device(x: np.ndarray, device) -> jax.Array:
    """A copy of host array `x` in a buffer `device` owns (jax.device_put may alias a numpy array on CPU, which
    would keep the host slice alive as the device's buffer and blur host from device memory)."""
    return jnp.array(x, copy=True, device=device)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf, x, i):
    """buf[i] = x on buf's device, in place (the buffer is donated): `_place_tensor`'s stacking step."""
    return jax.lax.dynamic_update_index_in_dim(buf, x, i, 0)
