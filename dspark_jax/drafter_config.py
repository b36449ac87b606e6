"""Drafter configuration: one frozen dataclass for all three drafters of the paper's comparison (§4.1).

  dspark  — DFlash backbone (anchor + L−1 masks → L logits) + a sequential head (Markov or RNN, §3.1)
            + a confidence head (§3.2.1).
  dflash  — the same backbone without sequential or confidence head: anchor + L masks, predicting the masks.
  eagle3  — a one-layer autoregressive drafter over fused low/mid/high target features (training-time test).

DeepSpec's released checkpoints (dspark_jax/deepspec.py) differ from this project's own drafters in a few
places, each one field here whose default keeps our behaviour: the mask vector is a token's embedding
(`mask_token_id`), DFlash's anchor slot makes the first prediction (`anchor_predicts`), the confidence head may
read h_k alone (`confidence_with_markov`), the Markov head may be gated (`head="gated"`), the RNN head has a
bias (`rnn_bias`), and EAGLE-3's layer attends over [norm(embedding); norm(feature)] (`eagle_layer="concat"`).

All three read the same target layers (`target_layers`) and borrow the target's frozen embedding and LM head.
`target_fingerprint` records which target a drafter was built for, so loading against another is an error.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config import ModelConfig, RopeConfig

KINDS = ("dspark", "dflash", "eagle3")
HEADS = ("markov", "gated", "rnn", "none")
EAGLE_LAYERS = ("fused", "concat")
ANCHOR_MODES = ("add", "residual", "fused")


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (EAGLE-3's choice; DFlash also spreads them over depth)."""
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


def target_fingerprint(cfg: ModelConfig) -> dict:
    """What must match between a drafter and its target (shapes it reads and the vocabulary it emits)."""
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Drafter hyperparameters (D = target hidden size: the drafter reads the target's embeddings directly)."""

    kind: str = "dspark"
    block_size: int = 7  # L
    num_layers: int = 5
    hidden_size: int  # = target D
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    qk_norm: bool = False
    target_layers: tuple[int, ...] = ()
    head: str = "markov"  # sequential head: markov | rnn | none
    markov_rank: int = 256  # R
    confidence: bool = True
    # Sequential temperature scaling (§3.2.1), one temperature per block position; () = uncalibrated.
    calibration: tuple[float, ...] = ()
    # Logit offsets fitted with the temperatures (train/calibrate.py): c_k = σ(z_k / T_k + b_k); () = all 0.
    calibration_offsets: tuple[float, ...] = ()
    # Reduced draft vocabulary (dspark_jax/draft_vocab.py): the sorted target ids the draft head scores; () = all.
    draft_vocab: tuple[int, ...] = ()
    target_fingerprint: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    # DeepSpec semantics (see the module docstring); the defaults are this project's own drafters.
    mask_token_id: int | None = None  # the mask vector `mask_embed` holds this token's embedding; None: learned
    anchor_predicts: bool = False  # dflash: anchor + L−1 masks, the anchor slot predicting x_{n+1} (as dspark)
    confidence_with_markov: bool = True  # confidence reads [h_k; W1[x_{k−1}]]; False: h_k alone
    rnn_bias: bool = False  # the RNN head's joint projection has a bias
    eagle_layer: str = "fused"  # eagle3: fused = fc([norm e; f]) into a standard layer; concat = EAGLE-3's own
    # dspark/dflash: the anchor slot's input also carries the last context feature H_ctx[n−1] (through a D×D
    # projection that starts at zero), as EAGLE-3's input does, so position 1 need not find it by attention.
    anchor_feature: bool = False
    # How H_ctx[n−1] = f joins the anchor's embedding e (with `anchor_feature`): "add" e + f·A (A zero at start),
    # "residual" RMSNorm(e) + f + f·A (the slot's residual stream starts from f, as in EAGLE-3's concat layer),
    # "fused" [RMSNorm(e); f]·A with A [2D, D] (EAGLE-3's fused input).
    anchor_mode: str = "add"
    # Each target layer's features are RMS-normalised (a learned scale per layer, starting at 1) before `fc`:
    # SmolLM2's layer-1 states are ~60× smaller than layers 15 and 27, so `fc` otherwise sees mostly the latter.
    feature_norm: bool = False
    # dspark/dflash: context entry t also carries the token that followed it, H_ctx[t] + RMSNorm(e(x_{t+1}))·W
    # (W zero at the start), as EAGLE-3's entry [e(x_{t+1}); f_t] does; the last entry n−1 pairs with the anchor,
    # so it is made when the block is drafted (`DrafterModel.close_last_entry`).
    context_tokens: bool = False

    @property
    def keeps_last_feature(self) -> bool:
        """Whether drafting reads H_ctx[n−1] (EAGLE-3's first step, the anchor slot, the last context entry):
        serving keeps every context feature in a pool (dspark_jax/paged.py)."""
        return self.kind == "eagle3" or self.anchor_feature or self.context_tokens

    @property
    def anchor_slot_predicts(self) -> bool:
        """Block layout: anchor + L−1 masks read at all L slots (True), or anchor + L masks read at the masks."""
        return self.kind == "dspark" or self.anchor_predicts

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.head not in HEADS:
            raise ValueError(f"unknown sequential head {self.head!r}; choose one of {', '.join(HEADS)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kind != "dspark" and (self.head != "none" or self.confidence):
            raise ValueError(f"{self.kind} has no sequential or confidence head (head='none', confidence=False)")
        if self.confidence and self.confidence_with_markov and self.head == "none":
            raise ValueError("the confidence head reads the Markov embedding W1[x_{k-1}]: it needs head "
                             "markov|gated|rnn (or confidence_with_markov=False)")
        if self.anchor_predicts and self.kind != "dflash":
            raise ValueError(f"anchor_predicts is a dflash layout switch (dspark always predicts from the anchor "
                             f"slot), got kind={self.kind!r}")
        if self.eagle_layer not in EAGLE_LAYERS:
            raise ValueError(f"unknown eagle_layer {self.eagle_layer!r}; choose one of {', '.join(EAGLE_LAYERS)}")
        if self.eagle_layer != "fused" and self.kind != "eagle3":
            raise ValueError(f"eagle_layer={self.eagle_layer!r} applies to eagle3 only, got kind={self.kind!r}")
        if self.anchor_feature and self.kind == "eagle3":
            raise ValueError("anchor_feature applies to block drafters (dspark, dflash); eagle3 reads f_{n-1} already")
        if self.context_tokens and self.kind == "eagle3":
            raise ValueError("context_tokens applies to block drafters (dspark, dflash); eagle3's entries pair "
                             "f_t with x_{t+1} already")
        if self.anchor_mode not in ANCHOR_MODES:
            raise ValueError(f"unknown anchor_mode {self.anchor_mode!r}; choose one of {', '.join(ANCHOR_MODES)}")
        if self.anchor_mode != "add" and not self.anchor_feature:
            raise ValueError(f"anchor_mode={self.anchor_mode!r} says how H_ctx[n-1] joins the anchor slot: it needs "
                             "anchor_feature=True")
        if self.rnn_bias and self.head != "rnn":
            raise ValueError(f"rnn_bias needs head='rnn', got head={self.head!r}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} out of range for vocab_size {self.vocab_size}")
        if self.kind == "eagle3" and self.num_layers != 1:
            raise ValueError(f"the EAGLE-3 drafter has exactly one layer, got num_layers={self.num_layers}")
        if not self.target_layers:
            raise ValueError("target_layers must name at least one target layer")
        if self.calibration and len(self.calibration) != self.block_size:
            raise ValueError(f"calibration needs {self.block_size} temperatures, got {len(self.calibration)}")
        if self.calibration_offsets and len(self.calibration_offsets) != len(self.calibration):
            raise ValueError(f"calibration_offsets need one per temperature ({len(self.calibration)}), got "
                             f"{len(self.calibration_offsets)} (clearing the calibration clears both: "
                             "calibration=(), calibration_offsets=())")
        if self.draft_vocab and (list(self.draft_vocab) != sorted(set(self.draft_vocab))
                                 or not 0 <= self.draft_vocab[0] <= self.draft_vocab[-1] < self.vocab_size):
            raise ValueError(f"draft_vocab must hold sorted, distinct target ids in [0, {self.vocab_size}); got "
                             f"{len(self.draft_vocab)} ids")

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, kind: str = "dspark", **overrides) -> DrafterConfig:
        """Defaults for a target: its width, heads and RoPE; 5 layers (1 for EAGLE-3); its low/mid/high layers."""
        base = dict(
            kind=kind, num_layers=1 if kind == "eagle3" else 5, hidden_size=target_cfg.hidden_size,
            num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
            intermediate_size=target_cfg.intermediate_size, vocab_size=target_cfg.vocab_size,
            rms_norm_eps=target_cfg.rms_norm_eps, rope=target_cfg.rope, qk_norm=target_cfg.qk_norm,
            target_layers=default_target_layers(target_cfg.num_layers),
            head="markov" if kind == "dspark" else "none", confidence=kind == "dspark",
            target_fingerprint=target_fingerprint(target_cfg),
        )
        base.update(overrides)
        if "target_layers" in overrides:
            base["target_layers"] = tuple(overrides["target_layers"])
        bad = [i for i in base["target_layers"] if not 0 <= i < target_cfg.num_layers]
        if bad:
            raise ValueError(f"target_layers {bad} out of range for a {target_cfg.num_layers}-layer target")
        return cls(**base)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layers"] = list(self.target_layers)
        d["calibration"] = list(self.calibration)
        d["calibration_offsets"] = list(self.calibration_offsets)
        d["draft_vocab"] = list(self.draft_vocab)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys: {unknown}")
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"]) if isinstance(d.get("rope"), dict) else d.get("rope", RopeConfig())
        d["target_layers"] = tuple(d.get("target_layers", ()))
        d["calibration"] = tuple(d.get("calibration", ()))
        d["calibration_offsets"] = tuple(float(b) for b in d.get("calibration_offsets", ()))
        d["draft_vocab"] = tuple(int(i) for i in d.get("draft_vocab", ()))
        return cls(**d)
