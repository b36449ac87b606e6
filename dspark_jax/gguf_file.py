"""GGUF files in Hugging Face form: a transformers-style config dict and f32 tensors under HF names.

The rest of dspark_jax only handles Hugging Face names and conventions; this file is the one place that
knows llama.cpp's. `read_gguf(path)` returns
  * `hf_config`: a dict shaped like the architecture's `config.json` (`model_type` "llama" or "qwen3");
  * `tensors`: `{hf_name: np.float32 array}`, every tensor dequantised; matrices are [out, in] like
    `torch.nn.Linear.weight`, e.g. `model.layers.N.self_attn.q_proj.weight` is [N*H, D],
    `model.embed_tokens.weight` is [V, D].
`load_tokenizer(kind, path)` returns a transformers tokenizer with its chat template, without the network.
A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, Qwen) is built here with
the `tokenizers` library, splitting text as llama.cpp does for the file's `tokenizer.ggml.pre`; transformers'
own GGUF reader needs torch, which serving on an accelerator does not install.

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


# llama.cpp's pre-tokenizer types (`tokenizer.ggml.pre`, llama-vocab.cpp) -> how the text is split before BPE.
# "gpt2": GPT-2's regex (tokenizers' ByteLevel with use_regex); "digits": every \p{N} character on its own first,
# then GPT-2's regex (the original SmolLM/StarCoder tokenizer.json: Digits(individual_digits) + ByteLevel);
# otherwise the named regex, each match kept whole, then byte-level without a regex.
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # gguf token types (llama_token_type)
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def _pre_tokenizer(pre: str):
    """The tokenizers pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` value; None for one not mapped."""
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return None


def _byte_level_tokenizer(path: str):
    """A GGUF's byte-level BPE tokenizer as a transformers fast tokenizer, or None if the file holds another kind
    (sentencepiece, unigram), a pre-tokenizer type not mapped above, or no merges.

    Tokens marked control become special added tokens (kept whole, skipped when decoding with
    skip_special_tokens), user-defined ones plain added tokens, as llama.cpp matches both whole; BOS is prepended
    when the file says `add_bos_token`.
    """
    reader = gguf.GGUFReader(path, "r")
    pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    if (_field(reader, "tokenizer.ggml.model", None) != "gpt2" or pre_tokenizer is None
            or "tokenizer.ggml.merges" not in reader.fields):  # transformers derives missing merges
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type", None) or [0] * len(tokens)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter's mislabel, not a token the model reads.
    alphabet = set(bytes_to_unicode().values())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    ids = {name: i for name, key in _SPECIAL_IDS.items()
           if (i := _field(reader, f"tokenizer.ggml.{key}", None)) is not None}
    special = {name: tokens[i] for name, i in ids.items()}
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and "bos_token" in ids:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos_token"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=_field(reader, "tokenizer.chat_template",
                                                                                  None), **special)


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
        tokenizer = _byte_level_tokenizer(path)
        if tokenizer is None:
            folder, name = os.path.split(os.path.abspath(path))
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            except ImportError as e:  # its GGUF reader imports torch
                raise ImportError(f"{path}: this GGUF's tokenizer is not byte-level BPE, and transformers reads "
                                  f"other kinds only with torch installed ({e})") from e
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
