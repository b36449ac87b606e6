"""Target-model configuration: one frozen dataclass for Llama- and Qwen3-family decoders.

`ModelConfig.from_hf(d)` reads a Hugging Face `config.json` dict in either of its two forms:
the old one (top-level `rope_theta`, optional `rope_scaling`) and the transformers-5 one
(`rope_parameters: {rope_theta, rope_type, ...}`). GGUF files are first turned into the same dict
by `gguf_file.read_gguf`, so this is the only place that knows HF config key names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 frequency-band scaling (Llama 3.1+); unused for other types.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder hyperparameters, in our dimension alphabet.

    D = hidden_size, F = intermediate_size, N = num_heads, K = num_kv_heads, H = head_dim, V = vocab_size.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head (RMSNorm over H) before RoPE."""
        return self.model_type == "qwen3"

    @property
    def group_size(self) -> int:
        """G: query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face config.json dict (old or new rope form)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            head_dim = d.get("head_dim") or hidden // num_heads
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required key {e.args[0]!r}") from None


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files have `rope_theta` + `rope_scaling`.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    kw = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor") if k in params}
    if "original_max_position_embeddings" in params:
        kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(theta=float(theta), rope_type=rope_type, **{k: v for k, v in kw.items()})
