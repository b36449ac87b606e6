"""Distilling a drafter from its frozen target (paper §3.3): batches of (sequence, anchor), one jitted step.

Train state is a value: (drafter params, optax state), both float32 whatever the target's dtype
(`init_train_state`); the target computes in its own dtype (bf16 where the config says). The target's parameters
are an argument of the jitted step, never optimised (the drafter's borrowed embedding and LM head stay frozen
with them).
Batch (`make_batch`): tokens int32 [B, T] (right-padded), lengths [B], anchors [B] drawn uniformly from
[max(1, prompt length), length − 2] with an explicit PRNG key, so every anchor has ≥ 1 ground-truth token.

The frozen target's training forward (`target_features`): one causal pass over the training windows gives the
final-normed hidden state h [B, T, D] (p_t = softmax(head(h)), eq. 10–11) and the concatenated outputs of the
drafter's `target_layers`, feats float32 [B, T, m·D] (KV injection, eq. 2). It is a prefill, not a verification
pass, so it does not go through `Decoder.__call__`'s cached path (a KV buffer of capacity T written and read per
layer, and on GPU/TPU the Pallas *verification* kernel, built for a few query tokens against a long cache and not
partitioned for a training mesh): the same stacked layers run under `lax.scan` with plain causal attention,
`jax.nn.dot_product_attention` (`is_causal`, grouped K/V heads; its default implementation is XLA's dense attention
on every backend, f32 scores [B, N, T, T] per layer, partitioned by XLA like any other op — a flash kernel, cuDNN's
or TPU Splash, would drop that buffer; none is wired in). Right padding needs no mask: a causal query
never reads a later (pad) position. tests/test_train_pipeline.py checks it equals the plain forward and
that the step's jaxpr holds no `pallas_call`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.buckets import round_up
from dspark_jax.drafter import Drafter
from dspark_jax.drafter_model import TargetHead
from dspark_jax.layers import apply_rope, rope_inv_freq
from dspark_jax.model import Decoder, concat_saved, hidden_slots, scan_layers
from train.losses import LossWeights, drafter_loss


def learning_rate_schedule(lr: float, steps: int, warmup: int | None = None,
                           end_lr_ratio: float = 0.1) -> optax.Schedule:
    """The training schedule: linear warm-up from 0 over `warmup` steps (default a tenth of `steps`), then cosine
    decay to lr·end_lr_ratio at `steps`."""
    warmup = max(1, steps // 10) if warmup is None else warmup
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * end_lr_ratio)


def schedule_values(lr: float, steps: int, **kwargs) -> np.ndarray:
    """`learning_rate_schedule`'s values at steps 0 … steps − 1, float32 [steps], computed on the host's CPU where
    jax has one (a loop that sets each step's rate must not queue behind an accelerator's steps for it)."""
    sched = learning_rate_schedule(lr, steps, **kwargs)
    try:
        device = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device
        device = None
    with jax.default_device(device):
        return np.asarray(jax.vmap(sched)(jnp.arange(steps)), np.float32)


def make_settable_optimizer(clip: float = 1.0, weight_decay: float = 0.01) -> optax.GradientTransformation:
    """`make_optimizer`'s AdamW after clipping, with the learning rate held in the state and set by the caller
    before each step (`set_learning_rate`): for a run whose length is decided while it runs (train/factory.py
    sizes its schedule to the clock after timing its first steps), without recompiling the step."""
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=weight_decay))


def set_learning_rate(opt_state, lr):
    """A `make_settable_optimizer` state with learning rate `lr` (same dtype and shape: the jitted step sees the
    same signature and does not recompile)."""
    clip_state, adamw = opt_state
    old = adamw.hyperparams["learning_rate"]
    return clip_state, adamw._replace(hyperparams={**adamw.hyperparams,
                                                   "learning_rate": jnp.asarray(lr, old.dtype).reshape(old.shape)})


def make_optimizer(lr: float, steps: int, warmup: int | None = None, clip: float = 1.0,
                   weight_decay: float = 0.01, end_lr_ratio: float = 0.1, *,
                   step_offset: int = 0) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to lr·end_lr_ratio, after global-norm clipping.

    `step_offset` > 0 continues a run at that step with fresh AdamW moments (a carried run, train/fit.py): the
    learning rate is the schedule's at step_offset + count, times a linear re-warm-up over `warmup` steps while
    the new moments settle (their count starts at 0, so Adam's bias correction stays right)."""
    warmup = max(1, steps // 10) if warmup is None else warmup
    sched = learning_rate_schedule(lr, steps, warmup, end_lr_ratio)
    if step_offset:
        base = sched

        def sched(count):
            return base(count + step_offset) * jnp.minimum(1.0, (count + 1) / warmup)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, weight_decay=weight_decay))


def pad_sequences(sequences, multiple: int = 16):
    """Token lists → (tokens int32 [N, T] right-padded with 0, lengths int32 [N])."""
    lens = np.array([len(s) for s in sequences], np.int32)
    if (lens < 3).any():
        raise ValueError(f"training sequences need >= 3 tokens (context, anchor, target); {lens.min()=}")
    tokens = np.zeros((len(sequences), round_up(int(lens.max()), multiple)), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    return tokens, lens


def sample_anchors(key, lengths, min_anchor):
    """Anchors int32 [B] uniform on [max(1, min_anchor), length − 2] per row."""
    lo = jnp.maximum(jnp.minimum(jnp.maximum(min_anchor, 1), lengths - 2), 1)
    return jax.random.randint(key, lengths.shape, lo, lengths - 1).astype(jnp.int32)


def master_params(params):
    """A float32 copy of drafter parameters (a State or pure dict): the weights the optimizer updates. Under a
    bfloat16 target (serving casts drafters to it) the drafter still trains in float32: bf16 master weights
    would round away updates smaller than 2⁻⁸ of a weight, and AdamW's moments are built in the params' dtype."""
    return jax.tree.map(lambda x: jnp.array(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
                        params)


def init_train_state(params, tx: optax.GradientTransformation):
    """(float32 master parameters, AdamW state over them): the train state, whatever dtype `params` came in."""
    params = master_params(params)
    return params, tx.init(params)


@functools.partial(jax.jit, static_argnames=("batch_size", "anchors_per_seq"))
def make_batch(key, tokens, lengths, min_anchor, batch_size: int, anchors_per_seq: int | None = None) -> dict:
    """Rows drawn with replacement, one anchor each — {tokens [B, T], lengths [B], anchors [B]} — or, with
    `anchors_per_seq` A, A anchors each (anchors [B, A]). One compiled program: pass the data as device arrays
    (`jax.device_put` once before the loop), or every call uploads all of it again."""
    k_rows, k_anchor = jax.random.split(key)
    rows = jax.random.randint(k_rows, (batch_size,), 0, tokens.shape[0])
    lengths, min_anchor = jnp.asarray(lengths)[rows], jnp.asarray(min_anchor)[rows]
    if anchors_per_seq is None:
        anchors = sample_anchors(k_anchor, lengths, min_anchor)
    else:
        shape = (batch_size, anchors_per_seq)
        anchors = sample_anchors(k_anchor, jnp.broadcast_to(lengths[:, None], shape),
                                 jnp.broadcast_to(min_anchor[:, None], shape))
    return {"tokens": jnp.asarray(tokens)[rows], "lengths": lengths, "anchors": anchors}


def target_features(model: Decoder, tokens: jax.Array, hidden_layers: tuple[int, ...]):
    """(final-normed hidden [B, T, D] in the target's dtype, feats float32 [B, T, len(hidden_layers)·D]).

    Equal to `model(tokens, model.init_cache(B, T), hidden_layers=..., compute_logits=False)[::2]` up to the
    order of float additions."""
    B, T = tokens.shape
    cfg = model.cfg
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    x = model.embed_tokens(tokens)
    slots = hidden_slots(cfg.num_layers, tuple(hidden_layers))
    saved = jnp.zeros((len(hidden_layers), *x.shape), x.dtype)

    def body(layer, carry, _):
        x, saved, i = carry
        q, k, v = layer.attn.qkv(layer.attn_norm(x))  # [B, T, N, H], [B, T, K, H]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        x = x + layer.attn.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))
        x = x + layer.mlp(layer.mlp_norm(x))
        saved = saved.at[slots[i]].set(x, mode="drop")  # a layer not asked for writes past the end: dropped
        return (x, saved, i + 1), None

    (x, saved, _), _ = scan_layers(model.layers, body, (x, saved, 0))
    return model.final_norm(x), concat_saved(saved)


def _loss(drafter_params, target_params, batch, *, drafter_graph, target_graph, tied, weights):
    """Frozen target forward over the sequences (final hidden + the drafter's feature layers), then the loss."""
    target = nnx.merge(target_graph, target_params)
    model = nnx.merge(drafter_graph, drafter_params)
    tokens = batch["tokens"]
    if "feats" in batch:  # precomputed (train/features.py), bf16 on the host: widened here, on the device
        hidden, feats = batch["hidden"].astype(jnp.float32), batch["feats"].astype(jnp.float32)
    else:  # the target's prefill inside the step (`target_features`: no KV cache, no verification kernel)
        hidden, feats = target_features(target, tokens, model.cfg.target_layers)
    hidden, feats = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(feats)
    head = TargetHead.from_params(target_params, tied)
    return drafter_loss(model, head, tokens, batch["lengths"], batch["anchors"], hidden, feats, weights,
                        target_lse=batch.get("lse"), anchor_mask=batch.get("anchor_mask"))


def make_loss_fn(target, drafter: Drafter, weights: LossWeights | None = None):
    """Jitted (drafter params, batch) → (loss, metrics), for evaluation."""
    weights = weights or LossWeights.for_kind(drafter.config.kind)
    fn = jax.jit(functools.partial(_loss, drafter_graph=drafter.graphdef, target_graph=target.graphdef,
                                   tied=target.config.tie_word_embeddings, weights=weights))
    return lambda drafter_params, batch: fn(drafter_params, target.params, batch)


def make_train_step(target, drafter: Drafter, tx: optax.GradientTransformation,
                    weights: LossWeights | None = None, shardings=None, target_params=None):
    """Jitted step (drafter params, opt_state, batch) → (params, opt_state, metrics); donates both states.

    `shardings` (from `train.sharding.train_shardings`) pins the parameter and optimizer-state layouts on a
    mesh; without it the step runs wherever its inputs live (one device).
    """
    weights = weights or LossWeights.for_kind(drafter.config.kind)
    loss = functools.partial(_loss, drafter_graph=drafter.graphdef, target_graph=target.graphdef,
                             tied=target.config.tie_word_embeddings, weights=weights)

    def step(drafter_params, opt_state, target_params, batch):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(drafter_params, target_params, batch)
        updates, opt_state = tx.update(grads, opt_state, drafter_params)
        metrics["grad_norm"] = optax.global_norm(grads)
        return optax.apply_updates(drafter_params, updates), opt_state, metrics

    if shardings is None:
        jitted = jax.jit(step, donate_argnums=(0, 1))
    else:
        jitted = jax.jit(step, donate_argnums=(0, 1),
                         in_shardings=(shardings.params, shardings.opt, shardings.target, shardings.batch),
                         out_shardings=(shardings.params, shardings.opt, shardings.replicated))
    target_params = target.params if target_params is None else target_params
    return lambda drafter_params, opt_state, batch: jitted(drafter_params, opt_state, target_params, batch)


def train_drafter(target, drafter: Drafter, sequences, *, steps: int, batch_size: int = 16, seed: int = 0,
                  lr: float = 1e-3, prompt_lengths=None, weights: LossWeights | None = None, on_step=None,
                  progress: bool = True) -> Drafter:
    """Trains `drafter` on token sequences (e.g. prompt + the target's own response).

    Args:
        target: the frozen `Target`.
        drafter: the starting `Drafter`; it is not modified (its parameters are copied).
        sequences: list of token-id lists.
        steps, batch_size, seed, lr: the run; `seed` fixes batches and anchors.
        prompt_lengths: optional per-sequence prompt length; anchors then start at the last prompt token.
        weights: loss weights (default: LossWeights.for_kind).
        on_step: optional callback(step, metrics as host floats/arrays).
        progress: show a tqdm bar.

    Returns:
        A new `Drafter` with the same config and trained parameters, in float32 (`master_params`).
    """
    from tqdm.auto import tqdm

    tokens, lengths = pad_sequences(sequences)
    min_anchor = np.zeros_like(lengths)
    if prompt_lengths is not None:
        min_anchor = np.asarray(prompt_lengths, np.int32) - 1
    tokens, lengths, min_anchor = jax.device_put((tokens, lengths, min_anchor))  # once, not per step
    tx = make_optimizer(lr, steps)
    step_fn = make_train_step(target, drafter, tx, weights)
    params, opt_state = init_train_state(drafter.params, tx)  # a copy: the step donates its input buffers
    key = jax.random.key(seed)
    bar = tqdm(range(steps), desc=f"train {drafter.config.kind}", disable=not progress)
    for i in bar:
        batch = make_batch(jax.random.fold_in(key, i), tokens, lengths, min_anchor, batch_size)
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        if on_step is not None or i % 10 == 0 or i == steps - 1:
            host = jax.device_get(metrics)
            acc = float(np.mean(host["acceptance"]))
            bar.set_postfix(loss=f"{float(host['loss']):.3f}", acceptance=f"{acc:.3f}")
            if on_step is not None:
                on_step(i, host)
    return drafter.with_params(params)
