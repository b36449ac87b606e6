"""DeepSpec checkpoints — the DSpark paper's own drafters (github.com/deepseek-ai/DeepSpec, MIT) — in and out.

A DeepSpec checkpoint is a Hugging Face `save_pretrained` directory:
  config.json   the target's config plus the drafter's fields. `architectures[0]` names the model class:
                `Qwen3DSparkModel` (DSpark, and DFlash = the same class with markov_rank 0 and no confidence
                head) or `Qwen3Eagle3Model` (EAGLE-3; eval.py also maps `Eagle3DraftModel` to it).
                DSpark/DFlash: block_size, target_layer_ids, mask_token_id, num_anchors, enable_confidence_head,
                confidence_head_with_markov, markov_rank, markov_head_type, num_target_layers.
                EAGLE-3: target_layer_ids, ttt_length (= block size), draft_num_hidden_layers (1).
  *.safetensors `Linear.weight` [out, in]; the names are `KEY_TABLES` below, plus frozen copies of the
                target's `embed_tokens.weight` [V, D] and `lm_head.weight` [V, D].

What DeepSpec does differently from this project's own drafters, and the DrafterConfig field for each:
  * the mask vector is the (frozen) embedding of `mask_token_id` → `mask_token_id`; `mask_embed` holds a copy of
    that row of the checkpoint's embedding (exact: DeepSpec never trains it);
  * DFlash's anchor slot makes the first prediction (anchor + L−1 masks) → `anchor_predicts=True`;
  * features are the target's `hidden_states[layer_id + 1]` = decoder layer `layer_id`'s output, which is what
    our `target_layers` index already (model.Decoder); DeepSpec's −1 (the embedding output) is refused;
  * Markov heads "vanilla" | "gated" | "rnn" → head "markov" | "gated" | "rnn" (+ `rnn_bias`), rank R;
  * the confidence head reads [h_k; W1[x_{k−1}]] or h_k alone → `confidence_with_markov`;
  * EAGLE-3's layer attends over [norm(embedding); norm(feature)] of width 2D → `eagle_layer="concat"`;
    DeepSpec's EAGLE-3 drafts over the full target vocabulary (no d2t/t2d maps); a checkpoint that carries a
    reduced draft vocabulary is refused.
Our drafters borrow the target's embedding and LM head at call time; loading checks that the checkpoint's copies
equal the target's on a sample of rows, so a checkpoint for another target is an error, not garbage drafts.

`load(path, target)` reads a directory (or a hub id found in the local Hugging Face cache: `resolve`);
`save(drafter, path, target)` writes one DeepSpec's `from_pretrained` reads. Round trips are bit-exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import ModelConfig
from dspark_jax.drafter_config import DrafterConfig, target_fingerprint

BLOCK_ARCH = "Qwen3DSparkModel"
EAGLE_ARCH = "Qwen3Eagle3Model"
ARCHITECTURES = {BLOCK_ARCH: "block", EAGLE_ARCH: "eagle3", "Eagle3DraftModel": "eagle3"}
EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
MARKOV_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}  # DeepSpec name → our head
# Training-only fields DeepSpec's model classes assert on; their values do not change inference.
TRAIN_DEFAULTS = {"num_anchors": 512, "step_loss_decay": 0.8}
CALIBRATION_KEY = "dspark_jax_calibration"  # ours, ignored by DeepSpec (sequential temperature scaling)
OFFSETS_KEY = "dspark_jax_calibration_offsets"  # ours too: the logit offsets fitted with those temperatures
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SAMPLE_ROWS = 8  # rows of the frozen embedding / LM head compared with the target's, at each of 3 places


@dataclasses.dataclass(frozen=True)
class Layout:
    """A tensor layout change, both ways: DeepSpec (HF) array → ours, and ours → DeepSpec."""

    to_ours: Callable
    to_deepspec: Callable


COPY = Layout(lambda w, c: w, lambda w, c: w)
T = Layout(lambda w, c: w.T, lambda w, c: w.T)  # Linear [out, in] ↔ einsum [in, out]
Q = Layout(lambda w, c: w.T.reshape(w.shape[1], c.num_heads, c.head_dim),  # [N·H, Din] ↔ [Din, N, H]
           lambda w, c: w.reshape(w.shape[0], -1).T)
KV = Layout(lambda w, c: w.T.reshape(w.shape[1], c.num_kv_heads, c.head_dim),  # [K·H, Din] ↔ [Din, K, H]
            lambda w, c: w.reshape(w.shape[0], -1).T)
O = Layout(lambda w, c: w.T.reshape(c.num_heads, c.head_dim, w.shape[0]),  # [D, N·H] ↔ [N, H, D]
           lambda w, c: w.reshape(-1, w.shape[-1]).T)
ROW = Layout(lambda w, c: w.reshape(-1), lambda w, c: w.reshape(1, -1))  # Linear(F, 1).weight [1, F] ↔ [F]
SCALAR = Layout(lambda w, c: w.reshape(()), lambda w, c: w.reshape(1))  # Linear(F, 1).bias [1] ↔ []

_LAYER = (  # one drafter layer, both architectures ({i} = layer index)
    ("layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.q", Q),
    ("layers.{i}.self_attn.k_proj.weight", "layers.{i}.attn.k", KV),
    ("layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.v", KV),
    ("layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.o", O),
    ("layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.scale", COPY),
    ("layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.scale", COPY),
    ("layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.scale", COPY),
    ("layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate", T),
    ("layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up", T),
    ("layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down", T),
    ("fc.weight", "fc", T),
    ("norm.weight", "final_norm.scale", COPY),
)
# (DeepSpec tensor name, our parameter path, layout) per architecture; the frozen embed/LM head are not here.
KEY_TABLES: dict[str, tuple[tuple[str, str, Layout], ...]] = {
    "block": _LAYER + (
        ("layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.scale", COPY),
        ("hidden_norm.weight", "ctx_norm.scale", COPY),
        ("markov_head.markov_w1.weight", "markov_w1", COPY),  # nn.Embedding [V, R], as ours
        ("markov_head.markov_w2.weight", "markov_w2", T),
        ("markov_head.gate_proj.weight", "markov_gate", T),
        ("markov_head.gate_proj.bias", "markov_gate_bias", COPY),
        ("markov_head.joint_proj.weight", "rnn", T),
        ("markov_head.joint_proj.bias", "rnn_bias", COPY),
        ("confidence_head.proj.weight", "conf_w", ROW),
        ("confidence_head.proj.bias", "conf_b", SCALAR),
    ),
    "eagle3": _LAYER + (
        ("layers.{i}.input_layernorm.weight", "layers.{i}.embed_norm.scale", COPY),  # normalises the embedding
        ("layers.{i}.hidden_norm.weight", "layers.{i}.hidden_norm.scale", COPY),
    ),
}


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(\d+)") + r"\Z")


_COMPILED = {arch: tuple((_pattern(ds), _pattern(ours), ds, ours, lay) for ds, ours, lay in table)
             for arch, table in KEY_TABLES.items()}


# ---- locating a checkpoint ---------------------------------------------------------------------------------------
def is_checkpoint(path: str) -> bool:
    """A DeepSpec (HF save_pretrained) directory: config.json naming a DeepSpec architecture."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return False
    try:
        with open(cfg_path) as f:
            archs = json.load(f).get("architectures") or []
    except (json.JSONDecodeError, OSError, AttributeError):
        return True  # let `load` report the corrupt file
    return bool(archs) and (archs[0] in ARCHITECTURES or archs[0].endswith(("DSparkModel", "Eagle3Model")))


def resolve(spec: str) -> str:
    """A hub id such as `deepseek-ai/dspark_qwen3_8b_block7` → its snapshot in the local Hugging Face cache.

    Never downloads (`local_files_only=True`): fetch it first with `hf download <id>`.
    """
    if not HUB_ID.fullmatch(spec):
        raise ValueError(f"not a drafter checkpoint: {spec!r} is neither a directory, a shipped drafter nor a "
                         "Hugging Face hub id")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(spec, local_files_only=True,
                                 allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"])
    except Exception as e:  # LocalEntryNotFoundError, offline errors, bad ids: all mean "not here"
        raise ValueError(f"drafter {spec!r} is not in the local Hugging Face cache ({type(e).__name__}); "
                         f"download it first: hf download {spec}") from None


# ---- reading ------------------------------------------------------------------------------------------------------
def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    raise ValueError(f"DeepSpec checkpoint {path} has no model.safetensors or model.safetensors.index.json")


def _sample_rows(V: int) -> list[tuple[int, int]]:
    return sorted({(0, min(SAMPLE_ROWS, V)), (V // 2, min(V // 2 + SAMPLE_ROWS, V)), (max(V - SAMPLE_ROWS, 0), V)})


def _read(path: str, mask_token_id: int | None):
    """All drafter tensors (jax arrays, stored dtype), the frozen copies' shapes, their sampled rows, and the
    mask token's embedding row (or None)."""
    from safetensors import SafetensorError, safe_open

    tensors, frozen_shapes, frozen_rows, mask_row = {}, {}, {}, None
    for fname in _weight_files(path):
        try:
            with safe_open(os.path.join(path, fname), framework="flax") as f:
                for name in f.keys():
                    if name not in (EMBED, LM_HEAD):
                        tensors[name] = f.get_tensor(name)
                        continue
                    # The frozen copies are V × D (1.2 GB for Qwen3-8B): read only the rows we compare or need.
                    sl = f.get_slice(name)
                    frozen_shapes[name] = tuple(sl.get_shape())
                    frozen_rows[name] = [sl[a:b] for a, b in _sample_rows(frozen_shapes[name][0])]
                    if name == EMBED and mask_token_id is not None and mask_token_id < frozen_shapes[name][0]:
                        mask_row = sl[mask_token_id:mask_token_id + 1][0]
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {os.path.join(path, fname)}: {e}") from None
    return tensors, frozen_shapes, frozen_rows, mask_row


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise ValueError(f"DeepSpec config {where} lacks {key!r}")
    return d[key]


def config_from_deepspec(d: dict, target, where: str = "config.json") -> DrafterConfig:
    """A DeepSpec config.json dict → our DrafterConfig, checked against `target` (a loaded Target)."""
    archs = d.get("architectures") or []
    arch = ARCHITECTURES.get(archs[0] if archs else None)
    if arch is None:
        raise ValueError(f"unsupported DeepSpec architecture {archs[:1]} in {where}; supported: "
                         f"{', '.join(ARCHITECTURES)} (Qwen3 targets)")
    target_config: ModelConfig = target.config
    num_target_layers = int(d.get("num_target_layers", target_config.num_layers))
    want = {"model_type": d.get("model_type"), "vocab_size": d.get("vocab_size"),
            "hidden_size": d.get("hidden_size"), "num_layers": num_target_layers}
    have = target_fingerprint(target_config)
    if want != have:
        diff = {k: (want[k], have[k]) for k in want if want[k] != have[k]}
        raise ValueError(f"DeepSpec checkpoint {where} was made for another target: (checkpoint, target) differ in "
                         f"{diff}")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError(f"DeepSpec config {where}: attention/MLP biases are not supported")
    layer_ids = tuple(int(i) for i in _require(d, "target_layer_ids", where))
    if any(i < 0 for i in layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)} in {where}: -1 (the embedding output) is not "
                         "supported; our target returns decoder-layer outputs only")
    draft = ModelConfig.from_hf(d)  # the drafter's own dims, rope and eps (DeepSpec copies the target's config)
    base = dict(block_size=0, num_layers=draft.num_layers, hidden_size=draft.hidden_size, num_heads=draft.num_heads,
                num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim, intermediate_size=draft.intermediate_size,
                vocab_size=draft.vocab_size, rms_norm_eps=draft.rms_norm_eps, rope=draft.rope, qk_norm=True,
                target_layers=layer_ids, calibration=tuple(d.get(CALIBRATION_KEY) or ()),
                calibration_offsets=tuple(d.get(OFFSETS_KEY) or ()),
                target_fingerprint=have)
    if arch == "eagle3":
        n = int(d.get("draft_num_hidden_layers", draft.num_layers))
        if n != 1 or draft.num_layers != 1:
            raise ValueError(f"DeepSpec EAGLE-3 {where} has {n} layers; only the one-layer drafter is supported")
        base.update(kind="eagle3", block_size=int(_require(d, "ttt_length", where)), head="none", markov_rank=0,
                    confidence=False, eagle_layer="concat")
    else:
        rank = int(_require(d, "markov_rank", where))
        conf = bool(_require(d, "enable_confidence_head", where))
        head = "none"
        if rank > 0:
            kind_name = str(_require(d, "markov_head_type", where)).lower()
            if kind_name not in MARKOV_TYPES:
                raise ValueError(f"unknown markov_head_type {kind_name!r} in {where}; known: {', '.join(MARKOV_TYPES)}")
            head = MARKOV_TYPES[kind_name]
        with_markov = bool(_require(d, "confidence_head_with_markov", where)) if conf else True
        dflash = head == "none" and not conf  # DeepSpec's DFlash: the same class with both heads off
        base.update(kind="dflash" if dflash else "dspark", block_size=int(_require(d, "block_size", where)),
                    head=head, markov_rank=rank, confidence=conf, confidence_with_markov=with_markov,
                    rnn_bias=head == "rnn", anchor_predicts=dflash,
                    mask_token_id=int(_require(d, "mask_token_id", where)))
    try:
        cfg = DrafterConfig(**base)
    except ValueError as e:
        raise ValueError(f"DeepSpec config {where}: {e}") from None
    bad = [i for i in layer_ids if i >= target_config.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} in {where} out of range for a "
                         f"{target_config.num_layers}-layer target")
    return cfg


def _check_frozen_copies(frozen_shapes, frozen_rows, target, cfg: DrafterConfig, where: str) -> None:
    """The checkpoint's embed_tokens / lm_head must be the target's (DeepSpec trains against frozen copies)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = target.params["embed"][...]  # [V, D]
    tied = target.config.tie_word_embeddings
    rows_of = {EMBED: lambda a, b: embed[a:b],  # HF layout [V, D]; our lm_head is [D, V]
               LM_HEAD: lambda a, b: embed[a:b] if tied else target.params["lm_head"][...][:, a:b].T}
    for name in (EMBED, LM_HEAD):
        if name not in frozen_shapes:
            raise ValueError(f"DeepSpec checkpoint {where} lacks {name!r} (the target's frozen copy)")
        if frozen_shapes[name] != (V, D):
            raise ValueError(f"DeepSpec checkpoint {where}: {name} has shape {frozen_shapes[name]}, the target "
                             f"needs {(V, D)} (a checkpoint for another target, or a reduced draft vocabulary)")
        for (a, b), rows in zip(_sample_rows(V), frozen_rows[name], strict=True):
            got = np.asarray(rows.astype(jnp.float32))
            # A bf16 checkpoint vs an f32 target: compare at the checkpoint's precision, with rounding slack.
            want = np.asarray(rows_of[name](a, b).astype(rows.dtype).astype(jnp.float32))
            if name == EMBED and cfg.mask_token_id is not None and a <= cfg.mask_token_id < b:
                # The mask token's row carries the mask vector (our exports write a learned one there).
                got, want = np.delete(got, cfg.mask_token_id - a, 0), np.delete(want, cfg.mask_token_id - a, 0)
            if not np.allclose(got, want, rtol=1e-2, atol=1e-2 * (np.abs(want).max() + 1e-6)):
                raise ValueError(f"DeepSpec checkpoint {where}: {name} rows {a}..{b - 1} differ from the target's "
                                 "(a checkpoint made for another target)")


def load(path: str, target):
    """Reads a DeepSpec checkpoint directory for `target`: (DrafterConfig, DrafterModel) with parameters cast to
    the target's dtype. `dspark_jax.drafter.load_drafter` binds them into a `Drafter`.

    Raises:
        ValueError with a one-line message for a missing, corrupt, unsupported or mismatched checkpoint.
    """
    from dspark_jax.drafter_model import DrafterModel

    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read DeepSpec config {cfg_path}: {e}") from None
    cfg = config_from_deepspec(d, target, where=cfg_path)
    tensors, frozen_shapes, frozen_rows, mask_row = _read(path, cfg.mask_token_id)
    if {"d2t", "t2d"} & set(tensors):
        raise ValueError(f"DeepSpec checkpoint {path} has a reduced draft vocabulary (d2t/t2d), not supported; "
                         "DeepSpec's own EAGLE-3 drafts over the full vocabulary")
    _check_frozen_copies(frozen_shapes, frozen_rows, target, cfg, path)

    arch = "eagle3" if cfg.kind == "eagle3" else "block"
    ours = {}
    for name, w in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer, recomputed
        for ds_rx, _, _, ours_tpl, lay in _COMPILED[arch]:
            m = ds_rx.match(name)
            if m:
                ours[ours_tpl.replace("{i}", m.group(1)) if m.groups() else ours_tpl] = lay.to_ours(w, cfg)
                break
        else:
            raise ValueError(f"DeepSpec checkpoint {path}: unexpected tensor {name!r} for {d['architectures'][0]} "
                             f"with this config (no rule in deepspec.KEY_TABLES)")
    if cfg.kind != "eagle3":
        ours["mask_embed"] = mask_row  # the mask vector is the embedding of mask_token_id

    graphdef, state = nnx.split(nnx.eval_shape(lambda: DrafterModel(cfg, dtype=target.dtype, rngs=nnx.Rngs(0))))
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(state))
    wanted = {".".join(str(p) for p in k): (k, v) for k, v in flat.items()}
    missing = sorted(set(wanted) - set(k for k, v in ours.items() if v is not None))
    if missing:
        raise ValueError(f"DeepSpec checkpoint {path} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    extra = sorted(set(ours) - set(wanted))
    if extra:
        raise ValueError(f"DeepSpec checkpoint {path} has tensors this config does not use: {extra[:3]}")
    filled = {}
    for p, (key, spec) in wanted.items():
        if tuple(ours[p].shape) != tuple(spec.shape):
            raise ValueError(f"DeepSpec checkpoint {path}: {p} has shape {tuple(ours[p].shape)}, expected "
                             f"{tuple(spec.shape)}")
        filled[key] = jnp.asarray(ours[p], dtype=target.dtype)
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(filled))
    return cfg, nnx.merge(graphdef, state)


# ---- writing ------------------------------------------------------------------------------------------------------
def _target_hf_config(target) -> dict:
    """The target's config.json when it came from an HF directory, else one rebuilt from its ModelConfig."""
    src = getattr(target, "source", "")
    if src and os.path.isfile(os.path.join(src, "config.json")):
        with open(os.path.join(src, "config.json")) as f:
            return json.load(f)
    c: ModelConfig = target.config
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
            "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids)}


def config_to_deepspec(cfg: DrafterConfig, target, mask_token_id: int | None, dtype_name: str) -> dict:
    """Our DrafterConfig → a DeepSpec config.json dict (the target's config plus the drafter's fields)."""
    target_config: ModelConfig = target.config
    d = _target_hf_config(target)
    d.pop("rope_scaling", None)
    rope = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
    if cfg.rope.rope_type != "default":
        rope.update(factor=cfg.rope.factor)
    d.update(model_type="qwen3", num_target_layers=target_config.num_layers, num_hidden_layers=cfg.num_layers,
             hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
             rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope.theta, rope_parameters=rope,
             tie_word_embeddings=False, attention_bias=False, layer_types=["full_attention"] * cfg.num_layers,
             target_layer_ids=list(cfg.target_layers), dtype=dtype_name)
    if cfg.kind == "eagle3":
        d.update(architectures=[EAGLE_ARCH], ttt_length=cfg.block_size, draft_num_hidden_layers=cfg.num_layers,
                 step_loss_decay=TRAIN_DEFAULTS["step_loss_decay"], target_model_name_or_path=str(target.source))
    else:
        rank = cfg.markov_rank if cfg.head != "none" else 0
        d.update(architectures=[BLOCK_ARCH], block_size=cfg.block_size, mask_token_id=int(mask_token_id),
                 num_anchors=TRAIN_DEFAULTS["num_anchors"], enable_confidence_head=cfg.confidence,
                 markov_rank=rank)
        if cfg.confidence:
            d["confidence_head_with_markov"] = cfg.confidence_with_markov
        if rank > 0:
            d["markov_head_type"] = {v: k for k, v in MARKOV_TYPES.items()}[cfg.head]
    if cfg.calibration:
        d[CALIBRATION_KEY] = list(cfg.calibration)
    if cfg.calibration_offsets:
        d[OFFSETS_KEY] = list(cfg.calibration_offsets)
    return d


def _exportable(cfg: DrafterConfig, target) -> None:
    """DeepSpec's classes cannot express every drafter of ours: say which switch is missing."""
    why = []
    if target.config.model_type != "qwen3" or not cfg.qk_norm:
        why.append("DeepSpec's drafters are Qwen3 classes (per-head q/k RMSNorm): the target must be a Qwen3 model")
    if cfg.kind == "dflash" and not cfg.anchor_predicts:
        why.append("DeepSpec's DFlash predicts from the anchor slot: train with anchor_predicts=True")
    if cfg.kind == "eagle3" and cfg.eagle_layer != "concat":
        why.append("DeepSpec's EAGLE-3 is the concat layer: train with eagle_layer='concat'")
    if getattr(cfg, "draft_vocab", ()):
        why.append("DeepSpec's drafters score the full vocabulary: no draft_vocab")
    if cfg.head == "rnn" and not cfg.rnn_bias:
        why.append("DeepSpec's RNN head has a bias: train with rnn_bias=True")
    if cfg.anchor_feature:
        why.append("DeepSpec's block drafters feed the anchor slot its embedding alone: no anchor_feature")
    if cfg.context_tokens:
        why.append("DeepSpec's block drafters' context entries are the features alone: no context_tokens")
    if cfg.feature_norm:
        why.append("DeepSpec's fc reads the raw target features: no feature_norm")
    if why:
        raise ValueError("this drafter has no DeepSpec equivalent: " + "; ".join(why))


def save(drafter, path: str, target, *, dtype: str | None = None, mask_token_id: int | None = None) -> None:
    """Writes `drafter` as a DeepSpec checkpoint (config.json + model.safetensors) that DeepSpec's
    `from_pretrained` reads; `load` reads it back bit-exactly.

    Args:
        drafter: a Drafter for `target`.
        path: output directory (created).
        target: the Target: its config becomes the base of config.json, and its embedding and LM head are
            written as the checkpoint's frozen copies.
        dtype: store floating tensors in this dtype (e.g. "bfloat16"); default: the parameters' own.
        mask_token_id: dspark/dflash — the token whose embedding row carries the mask vector (DeepSpec looks the
            mask up in the embedding); default the config's. Pick a token the target never emits.
    """
    from safetensors.flax import save_file

    from dspark_jax.drafter_model import TargetHead

    cfg: DrafterConfig = drafter.config
    drafter.check_target(target)
    _exportable(cfg, target)
    mask_token_id = cfg.mask_token_id if mask_token_id is None else mask_token_id
    if cfg.kind != "eagle3" and mask_token_id is None:
        raise ValueError("a DeepSpec dspark/dflash checkpoint needs mask_token_id: the token whose embedding row "
                         "carries this drafter's mask vector (an id the target never emits)")
    if mask_token_id is not None and not 0 <= mask_token_id < cfg.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} out of range for vocab_size {cfg.vocab_size}")
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(drafter.params))
    ours = {".".join(str(p) for p in k): v for k, v in flat.items()}
    store = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    arch = "eagle3" if cfg.kind == "eagle3" else "block"
    out = {}
    for path_, w in ours.items():
        if path_ == "mask_embed":
            continue
        for _, ours_rx, ds_tpl, _, lay in _COMPILED[arch]:
            m = ours_rx.match(path_)
            if m:
                out[ds_tpl.replace("{i}", m.group(1)) if m.groups() else ds_tpl] = store(lay.to_deepspec(w, cfg))
                break
        else:
            raise ValueError(f"parameter {path_!r} has no DeepSpec name (deepspec.KEY_TABLES)")
    head = TargetHead.from_params(target.params, target.config.tie_word_embeddings)
    embed = head.embed.astype(ours["fc"].dtype)
    if cfg.kind != "eagle3":
        embed = embed.at[mask_token_id].set(ours["mask_embed"])  # the mask is an embedding lookup in DeepSpec
    out[EMBED] = store(embed)
    out[LM_HEAD] = store(head.lm_head.T.astype(ours["fc"].dtype))
    os.makedirs(path, exist_ok=True)
    dtype_name = str(jnp.dtype(out["fc.weight"].dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_deepspec(cfg, target, mask_token_id, dtype_name), f, indent=2)
    # HF's loader wants format=pt metadata; contiguous copies because safetensors writes raw buffers.
    save_file({k: jnp.array(v) for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
