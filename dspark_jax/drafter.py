"""`Drafter`: a drafter network bound to its config, block sampling, and its checkpoints.

A checkpoint is a directory: `drafter_config.json` beside `model.safetensors` (one tensor per parameter, named by
its path in the module, e.g. `layers.0.attn.q`). Directories written by older versions hold an Orbax `params/`
checkpoint instead; `load_drafter` reads both.

Block sampling (`draft_block`, one jitted function) returns, for a batch of anchors:
  draft tokens x_1..x_L [B, L], the filtered draft distributions q_k [B, L, V] that rejection sampling needs,
  conditional confidences c_k [B, L] (calibrated if the checkpoint carries temperatures) — survival
  a_k = c_1⋯c_k is `scheduling.survival(c)`.
DSpark applies the sequential head left to right with `lax.scan` (eq. 4): logits_k = U_k + B_k(x_{k−1}).
Filtering (temperature, top-k, top-p) is the same function the target's side uses, so verification
compares like with like. Drafters without a confidence head report c_k = 1.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import deepspec, draft_vocab
from dspark_jax import kernels as kernels_lib
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterCache, DrafterModel, TargetHead, calibration
from dspark_jax.keys import fold_rows
from dspark_jax.sampling import all_greedy, filter_probs, sample

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"
PARAMS_DIR = "params"  # the Orbax layout of older checkpoints (read only)


def draft_block(graphdef, params, head: TargetHead, cache: DrafterCache, anchor, keys, temperature, top_k, top_p,
                kernels: str = "auto"):
    """Drafts one block per row.

    Args:
        graphdef, params: the split DrafterModel.
        head: the target's embedding and LM head.
        cache: the drafter's context cache; cache.lengths = committed tokens (n) for dspark/dflash.
        anchor: int32 [B], the last emitted token (position n).
        keys: typed PRNG keys [B] for this round (one stream per row).
        temperature, top_k, top_p: per-row filtering [B].
        kernels: "auto" | "pallas" | "reference" (dspark_jax.kernels): the Markov head may run as the fused
            Pallas sampler; batches with top-k/top-p rows always take the scan path.

    Returns:
        (draft tokens int32 [B, L], draft probs f32 [B, L, V], confidence f32 [B, L]).
    """
    model: DrafterModel = nnx.merge(graphdef, params)
    if model.cfg.kind == "eagle3":
        return _draft_eagle(model, head, cache, anchor, keys, temperature, top_k, top_p)
    h = model.block_hidden(head, cache, anchor, cache.lengths)  # [B, L, D]
    return draft_from_hidden(model, head, h, anchor, keys, temperature, top_k, top_p, kernels)


@functools.partial(jax.jit, static_argnames=("drafter_graph", "tied"), donate_argnames=("drafter_cache",))
def drafter_prefill(drafter_graph, drafter_params, target_params, drafter_cache: DrafterCache, feats, tokens, lengths,
                    *, tied: bool):
    """The dense context of a prompt batch (tokens [B, T], ragged `lengths` [B], target features feats
    [B, T, m·D]): the reference `draft_block` reads, for `propose` and the tests. Serving and `generate` write
    the paged context instead (dspark_jax/paged.py)."""
    drafter: DrafterModel = nnx.merge(drafter_graph, drafter_params)
    return drafter.write_prompt(drafter_cache, TargetHead.from_params(target_params, tied), tokens, feats, lengths)


def draft_from_hidden(model: DrafterModel, head: TargetHead, h, anchor, keys, temperature, top_k, top_p,
                      kernels: str = "auto", full_vocab_q: bool = True):
    """The sampling half of `draft_block` (dspark/dflash): block hidden states h [B, L, D] → (draft tokens
    [B, L], draft probs [B, L, V], confidence [B, L]). The serving engine computes h from paged context
    (dspark_jax/paged.py) and shares this function, so both paths sample drafts identically.
    `full_vocab_q=False` leaves q over the drafter's own vocabulary [B, L, Vd] (a reduced one's subset; the
    caller maps it with `draft_vocab.to_vocab` where it needs it: greedy verification never does)."""
    cfg = model.cfg
    widen = (lambda probs: draft_vocab.to_vocab(probs, cfg)) if full_vocab_q else (lambda probs: probs)
    L = cfg.block_size
    B = anchor.shape[0]
    greedy = all_greedy(temperature)
    U = draft_vocab.head_logits(head, h, cfg)  # [B, L, Vd]: V, or the reduced draft vocabulary's size
    if cfg.head == "none":  # DFlash: every position sampled independently from its marginal
        probs = filter_probs(U, temperature, top_k, top_p)
        conf = jnp.ones((B, L), jnp.float32)
        if cfg.confidence:  # a confidence head without the Markov input reads h_k alone (DeepSpec allows it)
            t, b = calibration(cfg)
            conf = jax.nn.sigmoid(model.confidence_logit(h, None) / t + b)
        return draft_vocab.to_target(sample(keys, probs, greedy), cfg), widen(probs), conf

    temps, offsets = calibration(cfg)

    def body(carry, inputs):
        prev, state = carry
        k, h_k, U_k, t_k, b_k = inputs
        e = model.markov_embedding(prev)  # [B, R]
        bias, state = model.sequential_bias(e, h_k, state)
        probs = filter_probs(U_k + bias, temperature, top_k, top_p)
        x = draft_vocab.to_target(sample(fold_rows(keys, k), probs, greedy), cfg)  # target ids feed W1
        conf = jax.nn.sigmoid(model.confidence_logit(h_k, e) / t_k + b_k) if cfg.confidence else jnp.ones((B,))
        return (x, state), (x, probs, conf)

    def scan_path():
        state0 = jnp.zeros((B, cfg.markov_rank), model.markov_w1[...].dtype)
        xs = (jnp.arange(L), h.swapaxes(0, 1), U.swapaxes(0, 1), temps, offsets)
        _, (tok, probs, conf) = jax.lax.scan(body, (anchor, state0), xs)
        return tok.T.astype(jnp.int32), widen(probs.swapaxes(0, 1)), conf.T.astype(jnp.float32)

    # The fused kernel indexes W1 by the sampled token: a reduced vocabulary takes the scan path.
    fused = kernels_lib.KernelConfig.parse(kernels).pallas("markov") and not draft_vocab.is_reduced(cfg)
    if cfg.head != "markov" or not fused:
        return scan_path()

    def fused_path():
        # The kernel samples the tokens without writing corrected logits; q for verification is then rebuilt
        # in one parallel pass from the Markov embeddings it returns (no sequential dependency left).
        seeds = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
        w1, w2 = model.markov_w1[...], model.markov_w2[...]
        out = kernels_lib.markov_sample(U, w1, w2, anchor, temperature.astype(jnp.float32), seeds,
                                        mesh=kernels_lib.KernelConfig.parse(kernels).mesh)
        bias = jnp.einsum("BLR,RV->BLV", out.e, w2, preferred_element_type=jnp.float32)
        probs = filter_probs(U + bias, temperature, top_k, top_p)
        conf = jax.nn.sigmoid(jax.vmap(model.confidence_logit, in_axes=1, out_axes=1)(h, out.e) / temps + offsets)
        return out.tokens.astype(jnp.int32), probs, conf.astype(jnp.float32)

    filtered = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(filtered, scan_path, fused_path)


def _draft_eagle(model: DrafterModel, head, cache, anchor, keys, temperature, top_k, top_p):
    """EAGLE-3 over a dense cache: L sequential steps; step k feeds (x_{n+k}, feature) at position n−1+k."""
    cfg = model.cfg
    L, B = cfg.block_size, anchor.shape[0]
    shape = (B, cfg.num_kv_heads, L, cfg.head_dim)
    dtype = cache.k[0].dtype

    def step(tok, feat, k, extra):
        drafted_k, drafted_v, drafted_mask = extra
        out, h, (new_k, new_v) = model.eagle_step(head, cache, tok, feat, cache.lengths + k, extra)
        drafted_k = jax.lax.dynamic_update_index_in_dim(drafted_k, new_k.astype(dtype), k, 2)
        drafted_v = jax.lax.dynamic_update_index_in_dim(drafted_v, new_v.astype(dtype), k, 2)
        return out, h, (drafted_k, drafted_v, drafted_mask.at[:, k].set(True))

    extra = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((B, L), bool))
    return draft_eagle(model, head, step, anchor, cache.last_feature, extra, keys, temperature, top_k, top_p)


def draft_eagle(model: DrafterModel, head: TargetHead, step, anchor, feature, extra, keys, temperature, top_k, top_p,
                full_vocab_q: bool = True):
    """EAGLE-3's block: L autoregressive steps (`lax.scan`), step k feeding (x_{n+k}, its feature) and sampling
    x_{n+k+1}; step 0 feeds the anchor x_n with f_{n−1}, step k > 0 the drafted token with step k−1's output.

    step(token [B], feature [B, D], k, extra) → (pre-norm output [B, D], final-normed h [B, D], extra): one
    layer pass over the drafter's context, dense (`_draft_eagle`) or paged (`paged.eagle_step_paged`); `extra`
    carries the drafted steps' keys and values. Returns (draft tokens [B, L], draft probs [B, L, V] (the
    drafter's own vocabulary [B, L, Vd] with `full_vocab_q=False`, as `draft_from_hidden`), confidence = 1)."""
    cfg = model.cfg
    L, B = cfg.block_size, anchor.shape[0]
    greedy = all_greedy(temperature)

    def body(carry, k):
        tok, feat, extra = carry
        out, h, extra = step(tok, feat, k, extra)
        probs = filter_probs(draft_vocab.head_logits(head, h, cfg), temperature, top_k, top_p)
        x = draft_vocab.to_target(sample(fold_rows(keys, k), probs, greedy), cfg)
        return (x, out.astype(feat.dtype), extra), (x, probs)

    _, (tok, probs) = jax.lax.scan(body, (anchor, feature, extra), jnp.arange(L))
    probs = probs.swapaxes(0, 1)
    return (tok.T.astype(jnp.int32), draft_vocab.to_vocab(probs, cfg) if full_vocab_q else probs,
            jnp.ones((B, L), jnp.float32))


class Drafter:
    """A drafter network with its config; the target's embedding and LM head are borrowed at call time."""

    def __init__(self, config: DrafterConfig, model: DrafterModel):
        if model.cfg != config:
            raise ValueError("the model was built from a different DrafterConfig; use Drafter.with_config")
        self.config = config
        self.graphdef, self.params = nnx.split(model)

    def with_config(self, **changes) -> Drafter:
        """The same parameters under a changed config (e.g. calibration temperatures); shapes must not change."""
        import dataclasses

        cfg = dataclasses.replace(self.config, **changes)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DrafterModel(cfg, rngs=nnx.Rngs(0))))
        shapes = lambda st: [x.shape for x in jax.tree.leaves(st)]  # noqa: E731
        if shapes(abstract) != shapes(self.params):
            raise ValueError(f"config change {sorted(changes)} would change parameter shapes")
        return Drafter._from_parts(cfg, graphdef, self.params)

    def with_params(self, params) -> Drafter:
        """The same config with new parameters (e.g. after a training run)."""
        return Drafter._from_parts(self.config, self.graphdef, params)

    @classmethod
    def _from_parts(cls, config, graphdef, params) -> Drafter:
        out = cls.__new__(cls)
        out.config, out.graphdef, out.params = config, graphdef, params
        return out

    def module(self) -> DrafterModel:
        return nnx.merge(self.graphdef, self.params)

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

    def init_cache(self, batch: int, capacity: int) -> DrafterCache:
        return self.module().init_cache(batch, capacity)

    def check_target(self, target) -> None:
        from dspark_jax.drafter_config import target_fingerprint

        want, have = self.config.target_fingerprint, target_fingerprint(target.config)
        if want and want != have:
            diff = {k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)}
            raise ValueError(f"drafter was trained for a different target: (drafter, target) differ in {diff}")

    def save(self, path: str, dtype: str | None = None, *, format: str = "safetensors", target=None,
             mask_token_id: int | None = None) -> None:
        """Writes `drafter_config.json` and `model.safetensors` under `path`, or with format="deepspec" a
        DeepSpec checkpoint (config.json + safetensors, dspark_jax/deepspec.py).

        dtype: store floating parameters in this dtype (e.g. "bfloat16" halves a shipped checkpoint); loading
        casts them back to the target's dtype.
        target, mask_token_id: deepspec only — the target whose config and frozen embedding / LM head the
        checkpoint carries, and the token whose embedding row holds the mask vector (see deepspec.save).
        """
        if format == "deepspec":
            if target is None:
                raise ValueError("format='deepspec' needs target=...: the checkpoint carries the target's config "
                                 "and copies of its embedding and LM head")
            return deepspec.save(self, path, target, dtype=dtype, mask_token_id=mask_token_id)
        if format != "safetensors":
            raise ValueError(f"unknown checkpoint format {format!r}; choose safetensors or deepspec")
        from safetensors.flax import save_file

        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for key, x in flat_params(self.params).items():
            x = jax.device_get(x)
            if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(dtype)
            tensors[key] = jnp.asarray(x)
        # Written beside, then renamed over: a killed save never leaves a half-written checkpoint.
        tmp = os.path.join(path, f".{WEIGHTS_FILE}.tmp")
        save_file(tensors, tmp, metadata={"format": "dspark-jax", "kind": self.config.kind})
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        os.chmod(tmp, 0o644)  # safetensors creates the file private; a checkpoint is meant to be shared
        os.replace(tmp, os.path.join(path, WEIGHTS_FILE))


def param_key(path) -> str:
    """A pure-dict leaf's tree path as its dotted module path, the name it has in model.safetensors
    ("layers.0.attn.q")."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_params(params) -> dict:
    """{"layers.0.attn.q": array, ...}: a drafter's parameters keyed by their dotted module path."""
    return {param_key(keys): x for keys, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}


def init_drafter(target, kind: str = "dspark", seed: int = 0, block_size: int = 7, *, dtype=None,
                 **overrides) -> Drafter:
    """An untrained drafter for `target` (see DrafterConfig.for_target for defaults and overrides).

    dtype: its parameters' dtype; None = the target's (serving). Training passes float32: the master weights
    and the AdamW moments stay float32 under a bfloat16 target (train/distill.py)."""
    cfg = DrafterConfig.for_target(target.config, kind=kind, block_size=block_size, **overrides)
    return Drafter(cfg, DrafterModel(cfg, dtype=target.dtype if dtype is None else dtype, rngs=nnx.Rngs(seed)))


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters")


def shipped_drafters() -> list[str]:
    """Names of the drafters shipped with the package, e.g. "smollm2-135m-instruct/dspark"."""
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(f"{t}/{k}" for t in os.listdir(SHIPPED_DIR) if os.path.isdir(os.path.join(SHIPPED_DIR, t))
                  for k in os.listdir(os.path.join(SHIPPED_DIR, t))
                  if os.path.isfile(os.path.join(SHIPPED_DIR, t, k, CONFIG_FILE)))


def resolve_drafter(spec: str) -> str:
    """A drafter directory, the name of a shipped one ("<target>/<kind>"), or a Hugging Face hub id in the
    local cache (e.g. "deepseek-ai/dspark_qwen3_8b_block7") → its directory."""
    if os.path.isdir(spec):
        return spec
    if spec in shipped_drafters():
        return os.path.join(SHIPPED_DIR, *spec.split("/"))
    shipped_targets = {n.split("/")[0] for n in shipped_drafters()}
    if deepspec.HUB_ID.fullmatch(spec) and spec.split("/")[0] not in shipped_targets:
        return deepspec.resolve(spec)  # a hub id (DeepSpec's released drafters) in the local HF cache
    known = ", ".join(shipped_drafters()) or "none"
    raise ValueError(f"not a drafter checkpoint: {spec!r} is neither a directory nor a shipped drafter "
                     f"(shipped: {known})")


def load_drafter(path: str, target, *, dtype=None) -> Drafter:
    """Loads a drafter saved by `Drafter.save` (a directory, or a shipped name such as
    "smollm2-135m-instruct/dspark") or a DeepSpec checkpoint (a directory or a hub id in the local Hugging Face
    cache, see dspark_jax/deepspec.py) and checks it was made for `target`. Parameters are cast to `dtype`,
    by default the target's (serving a bf16 target: a bf16 drafter); training resumes in float32.

    Raises:
        ValueError with a one-line message for a missing, corrupt or mismatched checkpoint.
    """
    dtype = target.dtype if dtype is None else dtype
    path = resolve_drafter(path)
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)) and deepspec.is_checkpoint(path):
        drafter = Drafter(*deepspec.load(path, target))  # in the target's dtype
        drafter.check_target(target)
        return drafter if jnp.dtype(dtype) == jnp.dtype(target.dtype) else drafter.with_params(
            jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, drafter.params))
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"not a drafter checkpoint: {cfg_path} does not exist")
    try:
        with open(cfg_path) as f:
            cfg = DrafterConfig.from_dict(json.load(f))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"corrupt drafter config {cfg_path}: {e}") from None
    abstract = nnx.eval_shape(lambda: DrafterModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    drafter = Drafter(cfg, abstract)
    drafter.check_target(target)
    if os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        restored = _read_safetensors(os.path.join(path, WEIGHTS_FILE), drafter.params)
    else:
        restored = _read_orbax(path, drafter.params)
    nnx.replace_by_pure_dict(drafter.params, restored)
    return drafter


def _read_safetensors(file: str, abstract_params) -> dict:
    """The parameters in `file` as a pure dict shaped like `abstract_params`, each cast to its dtype and placed
    on one device (a drafter trained on any mesh loads anywhere)."""
    from safetensors import SafetensorError, safe_open

    want = flat_params(abstract_params)
    one = jax.devices()[0]
    try:
        with safe_open(file, framework="flax") as f:
            have = set(f.keys())
            if have != set(want):
                missing, extra = sorted(set(want) - have), sorted(have - set(want))
                raise ValueError(f"drafter weights {file} do not match its config: missing {missing[:5]}, "
                                 f"unexpected {extra[:5]}")
            flat = {}
            for key, spec in want.items():
                x = f.get_tensor(key)
                if x.shape != spec.shape:
                    raise ValueError(f"drafter weights {file}: {key} has shape {x.shape}, the config needs "
                                     f"{spec.shape}")
                flat[key] = jax.device_put(x.astype(spec.dtype), one)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"corrupt drafter checkpoint {file}: {e}") from None
    pure = nnx.to_pure_dict(abstract_params)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(pure)
    keys = [param_key(p) for p, _ in leaves_with_path]
    return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys])


def _read_orbax(path: str, abstract_params) -> dict:
    """The parameters of an Orbax `params/` checkpoint (the layout older versions wrote), on one device."""
    import orbax.checkpoint as ocp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target_tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                               nnx.to_pure_dict(abstract_params))
    try:
        with ocp.StandardCheckpointer() as c:
            return c.restore(os.path.join(os.path.abspath(path), PARAMS_DIR), target_tree)
    except Exception as e:  # orbax raises many types for truncated/missing files
        raise ValueError(f"corrupt or incompatible drafter checkpoint at {path}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
