"""Training configuration: frozen, keyword-only dataclasses composed into `TrainConfig`, loaded from YAML
(`configs/*.yaml`) with dotted overrides (`--set optim.steps=10`). Unknown keys are errors.

  target  — which frozen target to distil from (a name, HF directory or .gguf) and its dtype: float32, bfloat16
            or auto (bfloat16 on GPU/TPU, float32 on CPU). It sets the target's compute only: the drafter's
            master weights and AdamW state are float32 whatever it is (train/distill.py).
  drafter — DrafterConfig overrides (kind, block_size, num_layers, markov_rank, …) on top of the target's defaults.
  data    — prepared ArrayRecord shards (and, when precomputed, their target features), window length T, anchors
            per sequence A (packed over one shared context), sequences per batch, grain workers per host.
  optim   — AdamW with linear warmup then cosine decay, global-norm clipping.
  mesh    — (data, fsdp, tensor) device mesh; 1×1×1 on one CPU; `distributed` calls jax.distributed.initialize().
  run     — output directory, checkpoint cadence and retention, logging cadence, seed, carry, path roots.
  heldout — held-out acceptance every N steps on prepared sequences kept out of training (train/heldout.py),
            and which set and measure pick the best step, the run's saved drafter.

Paths. Every path a run touches — the config file, data and feature shards, the target, `out_dir`,
`carry_dir`, the draft-vocabulary file — goes through `resolve(path, roots)` and comes back as an `epath.Path`,
so one config runs from a laptop, a CPU test or a pod whose data and checkpoints sit in a bucket. Orbax and
grain take the same URIs (ArrayRecord reads gs:// itself); other gs:// access needs `gcsfs` installed (etils.epath's
backend). `roots` (`run.path_roots`, and fit's `--path-root PREFIX=ROOT`) maps URI prefixes to where they live
instead, e.g. {"gs://bucket": "file:///mnt/bucket"}: the longest matching prefix is replaced before anything is
opened, so a config written for the pod runs unchanged against a local copy of its bucket (the multi-process test
does exactly that) or on hosts that mount it (gcsfuse). `file://` URIs are local paths; relative local paths are
made absolute (Orbax requires it).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import yaml
from etils import epath


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetSection:
    spec: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # auto | bfloat16 | float32 (dspark_jax.target.resolve_dtype)
    # For configs validated with jax.eval_shape only: an HF config.json dict instead of loading weights.
    hf_config: dict | None = None

    def __post_init__(self):
        from dspark_jax.target import DTYPE_CHOICES

        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"target.dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSection:
    kind: str = "dspark"
    block_size: int = 7
    overrides: dict = dataclasses.field(default_factory=dict)  # any other DrafterConfig field
    init_seed: int = 0
    # The Markov input embedding W1 drawn N(0, σ²) with this σ instead of the network's 0.02 (a fresh run only).
    # An A/B switch (reports/2026-12-06/markov-shrink: is a higher rank's gain only a faster-moving product?).
    markov_init_std: float | None = None
    # How a fresh DSpark's Markov head starts: "zero" (W2 = 0: the backbone's logits untouched) or "pmi" (the
    # rank-R factors of data.path's smoothed bigram PMI, train/markov_init.py; reports/2026-12-06/markov-pmi).
    markov_init: str = "zero"
    # > 0: a reduced draft vocabulary of this many tokens, the most frequent in data.path's responses
    # (train/vocab.py; dspark_jax/draft_vocab.py); 0 = the target's whole vocabulary.
    draft_vocab_size: int = 0
    # Where the chosen ids are shared between runs compared with each other (read if present, else written).
    draft_vocab_file: str | None = None
    # Start from a saved drafter (a directory or a shipped name) instead of random weights: fine-tuning, or
    # moving a drafter to another draft vocabulary (the Markov head's rows follow the tokens; train/fit.py's
    # `init_from_params`). Its config must be the run's up to the draft vocabulary and calibration.
    init_from: str | None = None

    def __post_init__(self):
        if self.markov_init not in ("zero", "pmi"):
            raise ValueError(f"drafter.markov_init: expected 'zero' or 'pmi', got {self.markov_init!r}")
        if self.markov_init == "pmi" and self.init_from:
            raise ValueError("drafter.markov_init pmi starts a fresh head; drafter.init_from brings a trained one")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    path: str = "data/smollm2"  # directory written by `python -m train prepare`
    seq_len: int = 256  # T: sequences are cropped (random window) or padded to this
    anchors_per_seq: int = 8  # A
    batch_sequences: int = 8  # S sequences per global batch (S·A (sequence, anchor) rows)
    worker_count: int = 0  # grain worker processes (0 = in-process)
    # Read precomputed target features (train/features.py) instead of running the target inside the step. They
    # pay for a small target trained over many epochs (SmolLM2: ~4.6 KB a token); for an 8B target they are
    # ~48 KB a token (`python -m train features` prints the total first), so the default runs the target.
    features: bool = False
    features_path: str | None = None  # the directory holding features-<layers>/ (default: path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection:
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 100
    end_lr_ratio: float = 0.1
    clip: float = 1.0
    weight_decay: float = 0.01
    # Loss weights (eq. 12) and position decay: keys of train.losses.LossWeights (ce, tv, conf, kl, gamma), each
    # replacing the drafter kind's recipe (DSpark 0.1/0.9/1.0; DFlash plain CE; EAGLE-3 soft CE, kl 1;
    # γ = block size), e.g. {gamma: 4} for DeepSpec's decay. None = the recipe.
    loss: dict | None = None

    def __post_init__(self):
        if self.loss:
            from train.losses import LossWeights

            known = {f.name for f in dataclasses.fields(LossWeights)}
            if set(self.loss) - known:
                raise ValueError(f"optim.loss: unknown keys {sorted(set(self.loss) - known)}; known: {sorted(known)}")
            gamma = self.loss.get("gamma")
            if gamma is not None and not (isinstance(gamma, int | float) and gamma > 0):
                raise ValueError(f"optim.loss.gamma must be a positive number (or null: the block size), got {gamma!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    distributed: bool = False  # multi-host pods: jax.distributed.initialize() before anything else


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection:
    out_dir: str = "runs/dspark"
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100
    keep: int = 3
    async_checkpoint: bool = True
    # A compact resume point that can be committed, for runs longer than one machine's life: every `ckpt_every`
    # steps the parameters (bf16 safetensors), the step, the data position and metrics.jsonl are written here;
    # a run with no newer Orbax checkpoint continues from it with fresh AdamW moments (train/fit.py).
    carry_dir: str | None = None
    # Where URI prefixes live instead, e.g. {"gs://bucket": "file:///mnt/bucket"} (see `resolve` below); `fit
    # --path-root PREFIX=ROOT` adds to it. Every path above and in `data`, `target`, `drafter` goes through it.
    path_roots: dict = dataclasses.field(default_factory=dict)


MEASURES = ("c_star", "top1")  # held-out acceptance measures (train/heldout.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldoutSection:
    # Every `every` steps (and at the last step) the teacher-forced acceptance c*_k per draft position is measured on
    # each set; 0 = off. Off, the run's saved drafter is its last step; on, it is the best evaluated step.
    every: int = 0
    # name → a directory of prepared shards (`python -m train prepare`) never trained on, e.g.
    # {t1: data/heldout-t1, t0: data/heldout-t0}. Every set logs both measures (train/heldout.py): "c_star"
    # (T = 1: 1 − ½‖p_d − p_t‖₁) and "top1" (draft argmax = the sequence's next token: the T = 0 acceptance on
    # sequences the target wrote greedily).
    sets: dict = dataclasses.field(default_factory=dict)
    sequences: int = 64  # the first N sequences of each set (in shard order): a fixed slice
    anchors_per_seq: int = 16  # anchors per held-out window, drawn once with a fixed seed
    # The best step maximises the mean over draft positions of `best_measure` on `best_set` (default: the first set).
    best_set: str | None = None
    best_measure: str = "c_star"  # c_star | top1

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"heldout.every must be >= 0 (0 = off), got {self.every}")
        if self.every and not self.sets:
            raise ValueError("heldout.every > 0 needs heldout.sets: {name: directory of prepared shards}")
        if self.best_set is not None and self.best_set not in self.sets:
            raise ValueError(f"heldout.best_set {self.best_set!r} is not one of heldout.sets {sorted(self.sets)}")
        if self.best_measure not in MEASURES:
            raise ValueError(f"heldout.best_measure: expected one of {MEASURES}, got {self.best_measure!r}")
        if self.sequences < 1 or self.anchors_per_seq < 1:
            raise ValueError(f"heldout.sequences and heldout.anchors_per_seq must be >= 1, got "
                             f"{self.sequences}, {self.anchors_per_seq}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    mesh: MeshSection = MeshSection()
    run: RunSection = RunSection()
    heldout: HeldoutSection = HeldoutSection()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{where or 'config'}: unknown keys {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kw = {}
    for name, value in d.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kw[name] = _build(hint, value, f"{where}.{name}".lstrip("."))
        else:
            kw[name] = _coerce(value, hint, f"{where}.{name}".lstrip("."))
    return cls(**kw)


def _coerce(value, hint, where: str):
    """YAML scalars into the field's type; a mismatch is an error, not a silent conversion."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = typing.get_origin(hint) or hint
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {getattr(base, '__name__', base)}, got {value!r}")
    return value


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"--set {key}: {p} is not a section")
    d[parts[-1]] = value


def load_config(path=None, overrides: list[str] = ()) -> TrainConfig:
    """TrainConfig from an optional YAML file (a local path or an etils.epath URI such as gs://…) plus
    `key.sub=value` overrides (values parsed as YAML)."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(epath.Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ValueError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config {path} is not valid YAML: {e}") from None
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set expects key.sub=value, got {item!r}")
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    return _build(TrainConfig, raw, "")


# ---- paths ------------------------------------------------------------------------------------------------------
FILE = "file://"


def parse_root(item: str) -> tuple[str, str]:
    """"PREFIX=ROOT" (e.g. "gs://bucket=file:///tmp/bucket") → (prefix, root), both without a trailing "/"."""
    prefix, eq, root = item.partition("=")
    if not eq or not prefix or not root:
        raise ValueError(f"--path-root expects PREFIX=ROOT (e.g. gs://bucket=file:///mnt/bucket), got {item!r}")
    return prefix.rstrip("/"), root.rstrip("/")


def resolve(path, roots: dict | None = None) -> epath.Path:
    """`path` (str or Path) with the longest matching prefix of `roots` replaced → an epath.Path.

    A prefix matches whole path components only: "gs://b" maps "gs://b/x" but not "gs://bb/x"."""
    s = os.fspath(path)
    best = max((p for p in (roots or {}) if s == p or s.startswith(p.rstrip("/") + "/")), key=len, default=None)
    if best is not None:
        s = roots[best].rstrip("/") + s[len(best.rstrip("/")) :]
    if s.startswith(FILE):
        s = s[len(FILE) :]
        if not s.startswith("/"):
            raise ValueError(f"file:// URIs must be absolute (file:///dir), got {path!r} → {FILE}{s}")
    if "://" not in s:
        s = os.path.abspath(os.path.expanduser(s))
    return epath.Path(s)


def is_local(path) -> bool:
    """Whether `path` is on this machine's file system (not a gs:// or other remote URI)."""
    return "://" not in os.fspath(path)


def resolve_config_paths(cfg: TrainConfig, roots: dict | None = None) -> TrainConfig:
    """`cfg` with `roots` merged into run.path_roots (the config's own entries lose to `roots`)."""
    merged = {**cfg.run.path_roots, **(roots or {})}
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, path_roots=merged))
