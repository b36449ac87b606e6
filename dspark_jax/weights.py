"""Foreign weights → our Decoder, through one declarative name table.

Every source (a Hugging Face directory of safetensors, or a GGUF file already renamed to HF names by
`gguf_file.read_gguf`) yields a flat dict of HF tensor names → numpy arrays. `WEIGHT_TABLE` maps each HF
name pattern to our parameter path and a layout transform (HF `Linear.weight` is [out, in]; we store
einsum layouts, see layers.py). Missing, unexpected or mis-shaped tensors are errors, never skipped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

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


def stack_layers(params: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """{"layers.{i}.<name>": [...]} for every layer i → {"layers.<name>": [num_layers, ...]}: the Decoder's
    stacked layer (model.stacked_layers). A name some layers lack, or one past the last layer, is an error."""
    out, per_layer = {}, {}
    for path, w in params.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        if m is None:
            out[path] = w
        else:
            per_layer.setdefault(m.group(2), {})[int(m.group(1))] = w
    for name, ws in per_layer.items():
        lacking = sorted(set(range(num_layers)) - set(ws))
        if lacking:
            raise ValueError(f"checkpoint lacks layers.N.{name} for layers {lacking[:5]} (of {num_layers})")
        if len(ws) > num_layers:
            raise ValueError(f"checkpoint has tensors this config does not use: layers.N.{name} for layers "
                             f"{sorted(set(ws) - set(range(num_layers)))[:5]} (the config has {num_layers})")
        out[f"layers.{name}"] = np.stack([ws[i] for i in range(num_layers)])
    return out


def build_decoder(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> Decoder:
    """Creates a Decoder whose parameters are exactly `tensors` (HF names), cast to `dtype`."""
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
    filled = {}
    for path, (key, spec) in wanted.items():
        arr = ours[path]
        if tuple(arr.shape) != tuple(spec.shape):
            raise ValueError(f"{path}: checkpoint shape {arr.shape} != expected {spec.shape}")
        filled[key] = jnp.asarray(arr, dtype=dtype)
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(filled))
    return nnx.merge(graphdef, state)
