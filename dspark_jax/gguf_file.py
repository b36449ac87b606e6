"""GGUF files in Hugging Face form: a transformers-style config dict and f32 tensors under HF names.

The rest of dspark_jax only handles Hugging Face names and conventions; this file is the one place that
knows llama.cpp's. `read_gguf(path)` returns
  * `hf_config`: a dict shaped like the architecture's `config.json` (`model_type` "llama" or "qwen3");
  * `tensors`: `{hf_name: np.float32 array}`, every tensor dequantised; matrices are [out, in] like
    `torch.nn.Linear.weight`, e.g. `model.layers.N.self_attn.q_proj.weight` is [N*H, D],
    `model.embed_tokens.weight` is [V, D].
`load_tokenizer(kind, path)` returns a transformers tokenizer with its chat template, without the network.

llama.cpp conventions undone here:
  * GGUF lists a tensor's dims fastest-first (ggml `ne`), so an HF [out, in] matrix is stored as shape
    [in, out]; reversing the GGUF shape gives the row-major numpy shape.
  * For `llama`, llama.cpp's converter (`LlamaModel.permute` in convert_hf_to_gguf.py) reorders each head's
    q/k rows from HF's rotate-half layout [first half | second half] to interleaved pairs (GPT-J RoPE). We
    invert it. `qwen3` is converted by `Qwen3Model(Qwen2Model)`, whose `modify_tensors` does not permute:
    llama.cpp runs Qwen with NeoX (rotate-half) RoPE, the HF layout, and transformers' own GGUF loader
    applies its q/k un-permutation (`LlamaTensorProcessor`) to `llama` only.
"""

from __future__ import annotations

import os
import re

import gguf
import numpy as np

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name (full match) -> HF name template, filled with the regex groups in order.
GGUF_TO_HF: list[tuple[str, str]] = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{0}.self_attn.q_proj.{1}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{0}.self_attn.k_proj.{1}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{0}.self_attn.v_proj.{1}"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "model.layers.{0}.self_attn.o_proj.{1}"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),  # Qwen3
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),  # Qwen3
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", "model.layers.{0}.mlp.gate_proj.{1}"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", "model.layers.{0}.mlp.up_proj.{1}"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", "model.layers.{0}.mlp.down_proj.{1}"),
]
_GGUF_TO_HF = [(re.compile(pattern), template) for pattern, template in GGUF_TO_HF]

# GGUF `{arch}.rope.scaling.*` suffix -> key in HF's rope_scaling dict, per scaling type we map.
_ROPE_SCALING_KEYS = {
    "linear": {"factor": "factor"},
    "yarn": {
        "factor": "factor",
        "original_context_length": "original_max_position_embeddings",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
    },
}

_MISSING = object()


def hf_name(gguf_name: str) -> str:
    """Maps one GGUF tensor name to its HF name through `GGUF_TO_HF`; raises ValueError if none matches."""
    for pattern, template in _GGUF_TO_HF:
        if m := pattern.fullmatch(gguf_name):
            return template.format(*m.groups())
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF tensor 'rope_freqs.weight' (Llama-3.1-style RoPE scaling) is not supported")
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}: add a pattern for it to gguf_file.GGUF_TO_HF")


def read_gguf_config(path: str) -> dict:
    """Reads only the config of a GGUF file (no dequantisation); see `read_gguf`."""
    return _hf_config(gguf.GGUFReader(path, "r"))


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Reads a llama/qwen3 GGUF file into Hugging Face form.

    Args:
      path: a `.gguf` file (any quantisation `gguf.quants.dequantize` supports).

    Returns:
      `(hf_config, tensors)`: the config dict (see module docstring) and `{hf_name: float32 array}`, e.g.
      `model.embed_tokens.weight` [V, D], `...q_proj.weight` [N*H, D], `...k_proj.weight` [K*H, D],
      `...mlp.down_proj.weight` [D, F], norms [D]. Tied models (`tie_word_embeddings`) have no
      `lm_head.weight`.

    Raises:
      ValueError: unsupported architecture, RoPE scaling type or tensor name.
    """
    reader = gguf.GGUFReader(path, "r")
    config = _hf_config(reader)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        # GGUF shapes are fastest-dim-first: reversed, they are numpy's row-major [out, in].
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist())))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            w = w.copy()  # dequantize returns a view of the read-only memmap for F32; own the memory
        w = w.astype(np.float32, copy=False)
        if config["model_type"] == "llama" and (proj := name.split(".")[-2]) in heads:
            w = unpermute_qk(w, heads[proj])
        tensors[name] = w
    return config, tensors


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves).

    Args:
      w: [n_head*H, D] weight or [n_head*H] bias, rows in llama.cpp order (per head: pairs (2i, 2i+1)).
      n_head: heads in `w`: num_attention_heads for q, num_key_value_heads for k.

    Returns:
      `w` with rows in HF order (per head: all even pair members, then all odd ones), same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{w.shape=} cannot be split into {n_head} heads of even head_dim")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default=_MISSING):
    """One metadata value as a Python scalar/str/list; float32 values rounded to their shortest repr."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file has no metadata key {key!r}")
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # f32 1e-5 reads back as 9.999999747e-06; the config.json it came from said 1e-05.
        value = float(str(np.float32(value)))
    return value


def _hf_config(reader: gguf.GGUFReader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} in GGUF file; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shapes = {t.name: list(reversed(t.shape.tolist())) for t in reader.tensors}
    hidden = _field(reader, f"{arch}.embedding_length")
    n_heads = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // n_heads)
    rope_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial RoPE ({rope_dim=} of {head_dim=}) is not supported for {arch!r}")
    if "token_embd.weight" in shapes:
        vocab_size = shapes["token_embd.weight"][0]
    else:
        vocab_size = len(_field(reader, "tokenizer.ggml.tokens"))
    config = {
        "model_type": arch,
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        # GGUF omits head_count_kv when it equals head_count (no GQA).
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "torch_dtype": "float32",
    }
    if (rope_scaling := _rope_scaling(reader, arch)) is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict | None:
    """Maps `{arch}.rope.scaling.*` to HF's `rope_scaling` dict; None when there is no scaling."""
    prefix = f"{arch}.rope.scaling."
    present = {k[len(prefix) :]: _field(reader, k) for k in reader.fields if k.startswith(prefix)}
    rope_type = present.pop("type", "none")
    if rope_type == "none" and not any(k in present for k in ("factor", "original_context_length")):
        return None
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r} in GGUF file; "
            f"supported: {', '.join(_ROPE_SCALING_KEYS)}"
        )
    mapping = _ROPE_SCALING_KEYS[rope_type]
    if unmapped := sorted(set(present) - set(mapping)):
        raise ValueError(f"GGUF {rope_type} RoPE scaling keys {unmapped} have no mapping to HF rope_scaling")
    return {"rope_type": rope_type, **{mapping[k]: v for k, v in present.items()}}


def load_tokenizer(kind: str, path: str, *, require_chat_template: bool = True):
    """Loads the tokenizer (with chat template) of a resolved model source, offline.

    Args:
      kind, path: what `hub.resolve_target` returned: ("hf", directory) or ("gguf", file).
      require_chat_template: raise if no chat template can be found (chat prompts need one).

    Returns:
      A transformers tokenizer whose `chat_template` is set.
    """
    from transformers import AutoTokenizer  # imported here: transformers takes ~2 s to import

    # local_files_only keeps from_pretrained off the network, like HF_HUB_OFFLINE=1.
    if kind == "hf":
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    elif kind == "gguf":
        folder, name = os.path.split(os.path.abspath(path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if not tokenizer.chat_template:
            # transformers copies tokenizer.chat_template from GGUF; this covers versions that do not.
            tokenizer.chat_template = _field(gguf.GGUFReader(path, "r"), "tokenizer.chat_template", None)
    else:
        raise ValueError(
            f"unknown model source kind {kind!r}; expected 'hf' or 'gguf' (from hub.resolve_target)"
        )
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(f"tokenizer of {path} has no chat template; use a chat/instruct model")
    return tokenizer
