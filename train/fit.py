"""A checkpointed, resumable distillation run (`python -m train fit`).

State per step: drafter parameters and AdamW state (pure dicts on the mesh) plus the grain iterator position.
An orbax CheckpointManager saves all three every `ckpt_every` steps (async, keep-N); a restarted run restores
the latest and continues with the same batches in the same order, so the loss curve is the uninterrupted one.
Metrics go to stdout (tqdm) and `metrics.jsonl` (one line per logged step; a resumed run rewrites the lines
after its restored step). At the end the drafter is saved to `out_dir/drafter` (and, with --export, as bf16).
With `run.carry_dir` set, each checkpoint also writes a compact carry there (the parameters as a bf16 drafter,
the step, the data position, metrics.jsonl; a few MB, meant to be committed): a run that finds no Orbax
checkpoint at least as new continues from the carry with fresh AdamW moments and the learning-rate schedule at
the carried step (re-warmed over `optim.warmup` steps), so a run of many hours survives losing its machine.
Multi-process runs (train/launch.py): every process runs this same function on its rows of each global batch;
checkpoints and the final drafter are written jointly by all processes, metrics and logs by process 0 only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.config import TrainConfig
from train.data import make_iterator
from train.distill import init_train_state, make_optimizer, make_train_step
from train.losses import LossWeights
from train.sharding import make_train_mesh, put_batch, train_shardings


def build(cfg: TrainConfig, target=None):
    """(target, initial drafter) for a config; the target is loaded unless given, in `target.dtype` ("auto":
    bfloat16 on GPU/TPU, float32 on CPU). The drafter is float32 whatever the target's dtype (master weights)."""
    from dspark_jax.drafter import init_drafter
    from dspark_jax.target import load_target, resolve_dtype

    target = load_target(cfg.target.spec, resolve_dtype(cfg.target.dtype)) if target is None else target
    overrides = dict(cfg.drafter.overrides)
    if cfg.drafter.draft_vocab_size:  # a reduced draft vocabulary, fixed at the run's first start
        from train.vocab import run_vocabulary

        overrides["draft_vocab"] = run_vocabulary(os.path.abspath(cfg.run.out_dir), cfg.data.path,
                                                  cfg.drafter.draft_vocab_size, target.config.vocab_size,
                                                  always=target.eos_token_ids,
                                                  shared_file=cfg.drafter.draft_vocab_file)
    drafter = init_drafter(target, kind=cfg.drafter.kind, seed=cfg.drafter.init_seed,
                           block_size=cfg.drafter.block_size, dtype=jnp.float32, **overrides)
    return target, drafter


def _host(metrics) -> dict:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else [round(float(x), 5) for x in v]
    return out


def _rewrite_log(path: str, upto_step: int) -> None:
    """Keeps only log lines of steps ≤ upto_step, the restored checkpoint (a resumed run re-logs the rest)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= upto_step]
    with open(path, "w") as f:
        f.writelines(keep)


def fit(cfg: TrainConfig, *, target=None, export: str | None = None, stop_after: int | None = None,
        progress: bool = True):
    """Runs (or resumes) a training run. `stop_after` ends the process's work early (tests: a killed run).

    Returns the trained `Drafter`.
    """
    import grain
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    if cfg.mesh.distributed and not jax.distributed.is_initialized():
        jax.distributed.initialize()  # Cloud TPU / SLURM: coordinator and process ids detected
    lead = jax.process_index() == 0  # writes the logs; every process writes its part of each checkpoint
    target, drafter = build(cfg, target)
    out_dir = os.path.abspath(cfg.run.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if lead:
        with open(os.path.join(out_dir, "train_config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)

    mesh = make_train_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    o = cfg.optim
    mngr = ocp.CheckpointManager(
        os.path.join(out_dir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.run.keep, save_interval_steps=cfg.run.ckpt_every,
                                             enable_async_checkpointing=cfg.run.async_checkpoint))
    carry = read_carry(cfg.run.carry_dir)
    if carry is not None and (mngr.latest_step() or 0) >= carry["step"]:
        carry = None  # this machine's own checkpoint is at least as new
    offset_path = os.path.join(out_dir, "step_offset.json")  # where this directory's optimizer count starts
    if carry is not None:
        step_offset = carry["step"]
        if lead:
            with open(offset_path, "w") as f:
                json.dump({"step_offset": step_offset}, f)
    elif mngr.latest_step() is not None and os.path.exists(offset_path):
        with open(offset_path) as f:
            step_offset = json.load(f)["step_offset"]
    else:
        step_offset = 0
        if lead and mngr.latest_step() is None and os.path.exists(offset_path):
            os.remove(offset_path)  # a fresh start
    tx = make_optimizer(o.lr, o.steps, o.warmup, o.clip, o.weight_decay, o.end_lr_ratio, step_offset=step_offset)
    if carry is not None:
        from dspark_jax.drafter import load_drafter

        # The carry is stored bf16; resumed as float32 master weights (not the target's dtype, as serving loads).
        drafter = drafter.with_params(load_drafter(carry["drafter"], target, dtype=jnp.float32).params)
    params, opt_state = init_train_state(nnx.to_pure_dict(drafter.params), tx)  # a copy: the step donates it
    tparams = nnx.to_pure_dict(target.params)
    sh = train_shardings(mesh, params, opt_state, tparams)
    params, opt_state = jax.device_put(params, sh.params), jax.device_put(opt_state, sh.opt)
    tparams = jax.device_put(tparams, sh.target)
    weights = LossWeights(**o.loss) if o.loss else None
    step_fn = make_train_step(target, drafter, tx, weights, shardings=sh, tparams=tparams)

    d = cfg.data
    it = make_iterator(d.path, seq_len=d.seq_len, anchors_per_seq=d.anchors_per_seq,
                       batch_sequences=d.batch_sequences, seed=cfg.run.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       feature_layers=drafter.config.target_layers if d.features else None,
                       features_path=d.features_path)
    start = 0
    log_path = os.path.join(out_dir, "metrics.jsonl") if lead else os.devnull
    if carry is not None:
        start = carry["step"]
        it.set_state(carry["data"])
        if lead:
            shutil.copyfile(os.path.join(cfg.run.carry_dir, "metrics.jsonl"), log_path)
        print(f"continued from the carry at step {start} in {cfg.run.carry_dir} (fresh AdamW moments)", flush=True)
    elif mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params), opt=ocp.args.StandardRestore(opt_state),
            data=grain.checkpoint.CheckpointRestore(it)))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed from step {start} in {out_dir}", flush=True)
    if lead:
        _rewrite_log(log_path, start)

    end = o.steps if stop_after is None else min(o.steps, stop_after)
    bar = tqdm(range(start, end), initial=start, total=o.steps, desc=f"fit {cfg.drafter.kind}",
               disable=not (progress and lead))
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        for step in bar:
            batch = put_batch(next(it), sh.batch)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            done = step + 1
            if done % cfg.run.log_every == 0 or done == o.steps:
                rec = {"step": done, **_host(metrics), "elapsed_s": round(time.perf_counter() - t0, 1)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{np.mean(rec['acceptance']):.3f}")
            wrote = mngr.save(done, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt_state),
                data=grain.checkpoint.CheckpointSave(it)), force=done == o.steps)
            if wrote and cfg.run.carry_dir:
                log.flush()
                host = _gather(params)  # every process joins the gather; process 0 writes
                if lead:
                    write_carry(cfg.run.carry_dir, drafter.with_params(_to_state(drafter, host)), done,
                                it.get_state(), log_path)
    mngr.wait_until_finished()
    mngr.close()
    host = _gather(params)
    trained = drafter.with_params(_to_state(drafter, jax.tree.map(jnp.asarray, host)))
    if end == o.steps:
        # Several processes all join the save (Orbax synchronises them); numpy leaves are written once, by
        # process 0, and load on any number of devices (global arrays would carry this run's device topology).
        saved = trained if jax.process_count() == 1 else drafter.with_params(_to_state(drafter, host))
        saved.save(os.path.join(out_dir, "drafter"))
        if export:
            saved.save(export, dtype="bfloat16")
    return trained


def read_carry(carry_dir: str | None) -> dict | None:
    """The carry in `carry_dir` ({"step", "data", "drafter": path}), or None when there is none."""
    path = os.path.join(carry_dir, "carry.json") if carry_dir else None
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        carry = json.load(f)
    return {**carry, "drafter": os.path.join(carry_dir, "drafter")}


def write_carry(carry_dir: str, drafter, step: int, data_state: dict, log_path: str) -> None:
    """Writes the carry beside the old one, then swaps it in (a killed write leaves the old carry whole)."""
    parent = os.path.dirname(os.path.abspath(carry_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".carry-", dir=parent)
    drafter.save(os.path.join(tmp, "drafter"), dtype="bfloat16")
    shutil.copyfile(log_path, os.path.join(tmp, "metrics.jsonl"))
    with open(os.path.join(tmp, "carry.json"), "w") as f:
        json.dump({"step": step, "data": data_state}, f, indent=1)
    old = carry_dir.rstrip("/") + ".old"
    if os.path.exists(carry_dir):
        os.rename(carry_dir, old)
    os.rename(tmp, carry_dir)
    shutil.rmtree(old, ignore_errors=True)


def _gather(pure):
    """Global (possibly multi-process) arrays → full numpy copies on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(pure, tiled=True)
    return jax.device_get(pure)


def _to_state(drafter, pure):
    """Pure-dict parameters back into the drafter's nnx.State."""
    state = jax.tree.map(lambda x: x, drafter.params)
    nnx.replace_by_pure_dict(state, pure)
    return state


__all__ = ["build", "fit", "read_carry", "write_carry"]
