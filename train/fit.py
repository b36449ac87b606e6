"""A checkpointed, resumable distillation run (`python -m train fit`), on one device or a multi-host pod.

State per step: drafter parameters and AdamW state (float32 pure dicts, global arrays on the mesh) plus the grain
iterator position. An Orbax CheckpointManager saves all three every `ckpt_every` steps (async, keep-N); a
restarted run restores the latest and continues with the same batches in the same order, so the loss curve is
the uninterrupted one. Metrics go to stdout (tqdm) and `metrics.jsonl` (one line per logged step; a resumed run
rewrites the lines after its restored step). At the end the drafter is saved to `out_dir/drafter` (and, with
--export, as bf16). Every path may be a gs:// URI or map to one (`run.path_roots`, train/config.py).

Held-out acceptance (`heldout.every` > 0, train/heldout.py): every N steps and at the last, per-position
teacher-forced c* and top-1 agreement on each held-out set go to metrics.jsonl (a {"step", "heldout", ...} line) and
`out_dir/heldout.png` (loss beside held-out acceptance); each new best step's parameters go to `out_dir/best/`
(+ best.json), and at the end `out_dir/drafter` is that best step (the last step: `out_dir/drafter-last`;
a carried run starts its best afresh).

Carries: runs longer than one machine's life (`run.carry_dir`). At every checkpoint process 0 also writes
  step-<N>/drafter/      the parameters as a bf16 drafter (drafter_config.json + model.safetensors),
  step-<N>/metrics.jsonl
  carry.json             {"step": N, "dir": "step-<N>", "processes": P, "data": [iterator state of each process]}
carry.json is written last and is the commit point (a write killed half-way leaves the previous carry whole; an
object store needs no directory rename); older step-* directories are then removed (the first carries, with
drafter/ at the top and one data state, are still read). A run that finds no Orbax checkpoint at least as new
continues from the carry: fresh AdamW moments, the learning-rate schedule at the carried step re-warmed over
`optim.warmup` steps, every process reading the parameters on its own host and taking its own data position.

Multi-process runs (train/launch.py): every process runs this same function; nothing is loaded whole on one
device or compared array by array across hosts (train/sharding.py):
  * the target is read per host, only the slices its devices hold (dspark_jax.weights.load_sharded), when it
    is a Hugging Face directory; a GGUF or named target is read whole on each host and placed shard by shard;
  * the drafter is initialised by one jitted program straight into its shardings, the optimizer state too;
  * a carry is read on every host and placed the same way;
  * before any array is loaded the processes compare hashes of their config, data listing, carry, checkpoint
    step and target files (`agree`), and stop with the names of what differs.
Checkpoints are written jointly by all processes; metrics, carries and the final drafter by process 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from train.config import TrainConfig, resolve
from train.data import make_iterator
from train.distill import init_train_state, make_optimizer, make_train_step
from train.losses import LossWeights
from train.sharding import (
    agree,
    gather_json,
    gather_params,
    load_target_per_host,
    make_train_mesh,
    per_device_bytes,
    place,
    put_batch,
    target_source,
    train_shardings,
    tree_shardings,
)


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The config's paths, resolved through `run.path_roots` (train/config.py)."""

    out: epath.Path
    data: epath.Path
    features: epath.Path | None
    carry: epath.Path | None
    vocab_file: epath.Path | None

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunPaths:
        r = lambda p: None if p is None else resolve(p, cfg.run.path_roots)  # noqa: E731
        return cls(out=r(cfg.run.out_dir), data=r(cfg.data.path), features=r(cfg.data.features_path),
                   carry=r(cfg.run.carry_dir), vocab_file=r(cfg.drafter.draft_vocab_file))


def init_params(drafter_cfg, seed: int, shardings=None, markov_init_std: float | None = None) -> dict:
    """A fresh float32 drafter as a pure dict, made by one jitted program straight into `shardings` (each device
    computes its own shard; None: the default device): `init_drafter(..., seed=seed)`'s parameters up to float
    rounding (~1e-8: the same random bits, the initialisers' arithmetic fused), the Markov W1 scaled to
    `markov_init_std` when given."""
    from dspark_jax.drafter_model import INIT_STD, DrafterModel

    def init():
        params = nnx.to_pure_dict(nnx.split(DrafterModel(drafter_cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed)))[1])
        if markov_init_std is not None and "markov_w1" in params:
            params["markov_w1"] = params["markov_w1"] * (markov_init_std / INIT_STD)
        return params

    return jax.jit(init, out_shardings=shardings)()


def fresh_params(cfg: TrainConfig, drafter_cfg, data_dir, shardings=None) -> dict:
    """A run's fresh drafter: `init_params`, and with `drafter.markov_init: pmi` the Markov head's W1, W2 from
    the data's bigrams (train/markov_init.py), the same on every process."""
    params = init_params(drafter_cfg, cfg.drafter.init_seed, shardings, cfg.drafter.markov_init_std)
    if cfg.drafter.markov_init == "zero":
        return params
    from train.markov_init import data_pmi_head

    if drafter_cfg.head != "markov" or "markov_w1" not in params:
        raise ValueError(f"drafter.markov_init pmi needs a DSpark with head 'markov', not {drafter_cfg.kind} "
                         f"with head {drafter_cfg.head!r}")
    w1, w2, stats = data_pmi_head(drafter_cfg, os.fspath(data_dir))
    if jax.process_index() == 0:
        print(f"Markov head from the data's bigram PMI: {stats['bigrams']:,} bigrams, rank {drafter_cfg.markov_rank} "
              f"keeps {stats['kept_energy']:.3f} of it", flush=True)
    head = {"markov_w1": w1, "markov_w2": w2}
    return {**params, **(jax.tree.map(jnp.asarray, head) if shardings is None else
                         place(head, {k: shardings[k] for k in head}))}


def drafter_config(cfg: TrainConfig, target, paths: RunPaths):
    """The run's DrafterConfig; a reduced draft vocabulary is chosen by process 0 and broadcast."""
    from dspark_jax.drafter_config import DrafterConfig

    overrides = dict(cfg.drafter.overrides)
    if cfg.drafter.draft_vocab_size:  # fixed at the run's first start
        from train.vocab import run_vocabulary

        ids = np.zeros(cfg.drafter.draft_vocab_size, np.int32)
        if jax.process_index() == 0:
            ids[:] = run_vocabulary(paths.out, paths.data, cfg.drafter.draft_vocab_size, target.config.vocab_size,
                                    always=target.eos_token_ids, shared_file=paths.vocab_file)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ids = np.asarray(multihost_utils.broadcast_one_to_all(ids))
        overrides["draft_vocab"] = tuple(int(i) for i in ids)
    return DrafterConfig.for_target(target.config, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size,
                                    **overrides)


def loss_weights(cfg: TrainConfig, kind: str) -> LossWeights:
    """The drafter kind's loss recipe with `optim.loss`'s keys (ce, tv, conf, kl, gamma) replaced."""
    return dataclasses.replace(LossWeights.for_kind(kind), **(cfg.optim.loss or {}))


def build(cfg: TrainConfig, target=None):
    """(target, initial drafter) for a config, on one process: the target is loaded unless given, in
    `target.dtype` ("auto": bfloat16 on GPU/TPU, float32 on CPU); the drafter is float32 (master weights)."""
    from dspark_jax.drafter import Drafter
    from dspark_jax.drafter_model import DrafterModel
    from dspark_jax.target import load_target, resolve_dtype

    if target is None:
        kind, directory = target_source(cfg)  # a path through run.path_roots, or a name / GGUF file
        target = load_target(os.fspath(directory) if kind == "hf" else cfg.target.spec,
                             resolve_dtype(cfg.target.dtype))
    drafter_cfg = drafter_config(cfg, target, RunPaths.of(cfg))
    drafter = Drafter(drafter_cfg,
                      nnx.eval_shape(lambda: DrafterModel(drafter_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    params = (init_from_params(cfg.drafter.init_from, nnx.to_pure_dict(drafter.params), drafter_cfg, target)
              if cfg.drafter.init_from else fresh_params(cfg, drafter_cfg, RunPaths.of(cfg).data))
    return target, drafter.with_params(_to_state(drafter, params))


def init_from_params(source: str, abstract: dict, config, target) -> dict:
    """The parameters of a saved drafter (`drafter.init_from`: a directory or a shipped name) as host float32
    arrays shaped like `abstract`, for a run whose DrafterConfig `config` is the source's up to the draft
    vocabulary and the calibration. Every parameter is the source's except the Markov head's, which follow the
    tokens into the run's vocabulary (train/shrink.py `move_markov_vocab`). A source with `anchor_mode` add or
    residual may start a fused run (`_fused_anchor`), and a Markov head a run at a higher rank (`resize_markov`:
    the same function, new directions free to train)."""
    from dspark_jax.drafter import flat_params, load_drafter, param_key
    from train.shrink import move_markov_vocab, resize_markov

    src = load_drafter(source, target, dtype=jnp.float32)
    loose = ("draft_vocab", "calibration", "calibration_offsets")
    mine, theirs = config.to_dict(), src.config.to_dict()
    to_fused = mine.get("anchor_mode") == "fused" and theirs.get("anchor_mode") in ("add", "residual")
    wider = mine.get("head") == "markov" and mine["markov_rank"] > theirs["markov_rank"]
    diff = sorted(k for k in mine if k not in loose and mine[k] != theirs.get(k)
                  and not (k == "anchor_mode" and to_fused) and not (k == "markov_rank" and wider))
    if diff:
        raise ValueError(f"drafter.init_from {source!r} was trained with another drafter config (differs in "
                         f"{diff}); only the draft vocabulary, the calibration, anchor_mode (add or residual "
                         f"to fused) and a higher Markov rank (head: markov) may change")
    flat = {k: np.asarray(x, np.float32) for k, x in flat_params(src.params).items()}
    if to_fused:
        flat.update(_fused_anchor(flat, theirs["anchor_mode"], np.asarray(target.params["embed"][...], np.float32)))
    if wider:
        resize_markov(flat, src.config, config.markov_rank)
    if "markov_w1" in flat and src.config.draft_vocab != config.draft_vocab:
        flat["markov_w1"], flat["markov_w2"] = move_markov_vocab(flat["markov_w1"], flat["markov_w2"],
                                                                 config.vocab_size, src.config.draft_vocab,
                                                                 config.draft_vocab)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for path, spec in leaves:
        key = param_key(path)
        if key not in flat or flat[key].shape != tuple(spec.shape):
            raise ValueError(f"drafter.init_from {source!r}: {key} is missing or shaped "
                             f"{None if key not in flat else flat[key].shape}, the run needs {tuple(spec.shape)}")
        out.append(flat[key])
    return jax.tree_util.tree_unflatten(treedef, out)


def _fused_anchor(flat: dict, mode: str, embed: np.ndarray) -> dict:
    """A fused anchor input [RMSNorm(e); f]·W for a drafter trained with `mode` (its D x D `anchor_fc` = A).
    residual (RMSNorm(e) + f + f·A) moves exactly: W = [I; I + A], its norm kept. add (e + f·A) moves up to the
    norm: W = [r·I; A] with a fresh norm, r the embedding rows' mean RMS, so a row of RMS r reads as before."""
    A = flat["anchor_fc"]
    eye = np.eye(A.shape[0], dtype=np.float32)
    if mode == "residual":
        return {"anchor_fc": np.concatenate([eye, eye + A])}
    r = float(np.sqrt(np.mean(embed.astype(np.float64) ** 2, axis=-1)).mean())
    return {"anchor_fc": np.concatenate([r * eye, A]), "anchor_norm.scale": np.ones(A.shape[0], np.float32)}


def _host(metrics) -> dict:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else [round(float(x), 5) for x in v]
    return out


class MetricsLog:
    """metrics.jsonl of process 0: the kept lines (steps ≤ the resumed step) plus this run's, the whole file
    rewritten at each record (an object store has no append; the file is a few hundred KB at most)."""

    def __init__(self, path: epath.Path | None, keep_from: epath.Path | None, upto_step: int):
        self.path, self.lines = path, []
        if path is not None and keep_from is not None and keep_from.exists():
            self.lines = [ln for ln in keep_from.read_text().splitlines()
                          if ln.strip() and json.loads(ln)["step"] <= upto_step]
            self._write()

    def record(self, rec: dict) -> None:
        self.lines.append(json.dumps(rec))
        self._write()

    def text(self) -> str:
        return "".join(ln + "\n" for ln in self.lines)

    def _write(self) -> None:
        if self.path is not None:
            tmp = self.path.parent / f".{self.path.name}.tmp"
            tmp.write_text(self.text())
            tmp.replace(self.path)


def fit(cfg: TrainConfig, *, target=None, export: str | None = None, stop_after: int | None = None,
        progress: bool = True):
    """Runs (or resumes) a training run. `stop_after` ends the process's work early (tests: a killed run).

    Returns the trained `Drafter` (host parameters).
    """
    import grain
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    from dspark_jax.drafter import Drafter
    from dspark_jax.drafter_model import DrafterModel
    from dspark_jax.target import load_target, resolve_dtype

    if cfg.mesh.distributed and not jax.distributed.is_initialized():
        jax.distributed.initialize()  # Cloud TPU / SLURM: coordinator and process ids detected
    lead = jax.process_index() == 0  # writes logs and carries; every process writes its part of each checkpoint
    paths = RunPaths.of(cfg)
    mesh = make_train_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    dtype = resolve_dtype(cfg.target.dtype)
    kind, directory = ("given", None) if target is not None else target_source(cfg)
    facts = {"config": {**cfg.to_dict(), "run": {k: v for k, v in cfg.to_dict()["run"].items()
                                                 if k != "path_roots"}},  # mount points may differ per host
             "data": _listing(paths.data, sizes=False), "target": {"spec": cfg.target.spec, "dtype": dtype}}
    if kind == "hf":
        load, target_facts = load_target_per_host(directory, dtype, mesh)
        facts.update(target_facts)
    paths.out.mkdir(parents=True, exist_ok=True)
    mngr = ocp.CheckpointManager(
        paths.out / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.run.keep, save_interval_steps=cfg.run.ckpt_every,
                                             enable_async_checkpointing=cfg.run.async_checkpoint))
    latest = mngr.latest_step()
    carry = read_carry(paths.carry)
    if carry is not None and (latest or 0) >= carry["step"]:
        carry = None  # this run's own checkpoint is at least as new
    if carry is not None and len(carry["data"]) != jax.process_count():
        raise ValueError(f"the carry in {paths.carry} holds the data positions of {len(carry['data'])} processes; "
                         f"this run has {jax.process_count()} (each reads its own share of the data)")
    facts["resume"] = {"checkpoint": latest, "carry": None if carry is None else
                       {"step": carry["step"], "data": carry["data"], "params": _listing(carry["drafter"])}}
    agree(facts)  # before any array is loaded: a disagreement costs seconds, not a target load

    if kind == "hf":
        target = load()
    elif kind == "load":
        target = load_target(cfg.target.spec, dtype)
    target_params = nnx.to_pure_dict(target.params)
    if kind != "hf":  # load_sharded made global arrays already
        target_params = place(target_params, tree_shardings(mesh, target_params))
    drafter_cfg = drafter_config(cfg, target, paths)
    drafter = Drafter(drafter_cfg,
                      nnx.eval_shape(lambda: DrafterModel(drafter_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    abstract = nnx.to_pure_dict(drafter.params)
    if lead:
        (paths.out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    o = cfg.optim
    offset_path = paths.out / "step_offset.json"  # where this directory's optimizer count starts
    if carry is not None:
        step_offset = carry["step"]
        if lead:
            offset_path.write_text(json.dumps({"step_offset": step_offset}))
    elif latest is not None and offset_path.exists():
        step_offset = json.loads(offset_path.read_text())["step_offset"]
    else:
        step_offset = 0
        if lead and latest is None and offset_path.exists():
            offset_path.unlink()  # a fresh start
    tx = make_optimizer(o.lr, o.steps, o.warmup, o.clip, o.weight_decay, o.end_lr_ratio, step_offset=step_offset)
    opt_abstract = jax.eval_shape(lambda p: init_train_state(p, tx)[1], abstract)
    sh = train_shardings(mesh, abstract, opt_abstract, target_params)
    if lead:
        held = {name: per_device_bytes(tree, dict(mesh.shape)) / 2**30
                for name, tree in [("target", target_params), ("drafter", abstract), ("AdamW", opt_abstract)]}
        print("train state per device: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in held.items()), flush=True)
    if carry is not None:
        params = place(carry_params(carry["drafter"], abstract, drafter_cfg), sh.params)
    elif cfg.drafter.init_from:
        params = place(init_from_params(cfg.drafter.init_from, abstract, drafter_cfg, target), sh.params)
    else:
        params = fresh_params(cfg, drafter_cfg, paths.data, sh.params)
    params, opt_state = jax.jit(lambda p: init_train_state(p, tx), out_shardings=(sh.params, sh.opt),
                                donate_argnums=0)(params)
    weights = loss_weights(cfg, drafter_cfg.kind)
    step_fn = make_train_step(target, drafter, tx, weights, shardings=sh, target_params=target_params)

    d = cfg.data
    it = make_iterator(paths.data, seq_len=d.seq_len, anchors_per_seq=d.anchors_per_seq,
                       batch_sequences=d.batch_sequences, seed=cfg.run.seed, worker_count=d.worker_count,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       feature_layers=drafter_cfg.target_layers if d.features else None, features_path=paths.features)
    if d.features:
        from train.features import batch_bytes

        print(f"precomputed features: {batch_bytes(d, drafter_cfg, target.config) / 2**30:.2f} GiB of host memory per "
              "global batch (bf16)", flush=True)
    start, keep_from = 0, paths.out / "metrics.jsonl"
    if carry is not None:
        start, keep_from = carry["step"], carry["metrics"]
        it.set_state(carry["data"][jax.process_index()])
        print(f"continued from the carry at step {start} in {paths.carry} (fresh AdamW moments)", flush=True)
    elif latest is not None:
        start = latest
        restored = mngr.restore(start, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params), opt=ocp.args.StandardRestore(opt_state),
            data=grain.checkpoint.CheckpointRestore(it)))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed from step {start} in {paths.out}", flush=True)
    log = MetricsLog(paths.out / "metrics.jsonl" if lead else None, keep_from if lead else None, start)
    h = cfg.heldout
    if h.every:
        from train.heldout import BestStep, HeldoutSets, make_eval_fn, summary

        heldout = HeldoutSets(h.sets, sequences=h.sequences, seq_len=d.seq_len, anchors_per_seq=h.anchors_per_seq,
                              batch_sequences=d.batch_sequences, block_size=drafter_cfg.block_size,
                              roots=cfg.run.path_roots)
        eval_fn = make_eval_fn(target, drafter, weights, shardings=sh, target_params=target_params)
        best, best_set = BestStep(paths.out, start), h.best_set or next(iter(h.sets))
        if lead:
            print(f"held-out acceptance every {h.every} steps on {heldout.rows()} sequences; the saved drafter is "
                  f"the step with the best mean {h.best_measure} on {best_set!r}", flush=True)

    def save_params(directory, params):
        host = gather_params(params)  # every process joins the gathers; process 0 writes
        if lead:
            save_drafter(drafter.with_params(_to_state(drafter, host)), directory)
        if jax.process_count() > 1:  # the others read it back at the end
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"saved {directory}")

    end = o.steps if stop_after is None else min(o.steps, stop_after)
    bar = tqdm(range(start, end), initial=start, total=o.steps, desc=f"fit {cfg.drafter.kind}",
               disable=not (progress and lead))
    t0 = time.perf_counter()
    for step in bar:
        batch = put_batch(next(it), sh.batch)
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        done = step + 1
        if done % cfg.run.log_every == 0 or done == o.steps:
            rec = {"step": done, **_host(metrics), "elapsed_s": round(time.perf_counter() - t0, 1)}
            log.record(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{np.mean(rec['acceptance']):.3f}")
        if h.every and (done % h.every == 0 or done == o.steps):
            result = heldout.evaluate(eval_fn, params)
            value = summary(result, best_set, h.best_measure)
            kept = best.offer(done, value, lambda where, p=params: save_params(where, p), write=lead)
            log.record({"step": done, "heldout": result, "heldout_summary": round(value, 5), "best": kept})
            if lead:
                from train.plots import plot_heldout

                plot_heldout([json.loads(ln) for ln in log.lines], paths.out / "heldout.png", best_step=best.step,
                             title=f"{cfg.drafter.kind}: training loss and held-out acceptance")
        wrote = mngr.save(done, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt_state),
            data=grain.checkpoint.CheckpointSave(it)), force=done == o.steps)
        if wrote and paths.carry is not None:
            host = gather_params(params)  # every process joins the gathers; process 0 writes
            states = gather_json(it.get_state())
            if lead:
                write_carry(paths.carry, drafter.with_params(_to_state(drafter, host)), done, states, log.text())
    mngr.wait_until_finished()
    mngr.close()
    it.close()  # stops grain's worker processes, if any
    host = gather_params(params)
    # One process: arrays on its default device, ready to draft with; several: host copies.
    trained = drafter.with_params(_to_state(drafter, jax.tree.map(
        jnp.asarray if jax.process_count() == 1 else np.asarray, host)))
    if end == o.steps and h.every and best.step is not None:
        # The run's drafter is its best held-out step; the last step is kept beside it as drafter-last.
        if lead:
            save_drafter(trained, paths.out / "drafter-last")
        kept = carry_params(paths.out / "best", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host),
                            drafter_cfg)
        trained = drafter.with_params(_to_state(drafter, jax.tree.map(
            jnp.asarray if jax.process_count() == 1 else np.asarray, kept)))
        if lead:
            print(f"saved drafter: step {best.step} (held-out {h.best_measure} on {best_set!r} "
                  f"{best.value:.4f}); the last step is in drafter-last", flush=True)
    if end == o.steps and lead:
        save_drafter(trained, paths.out / "drafter")
        if export:
            save_drafter(trained, resolve(export, cfg.run.path_roots), dtype="bfloat16")
    return trained


# ---- carries (see the module docstring) ---------------------------------------------------------------------------
CARRY_FILE = "carry.json"


def read_carry(carry_dir) -> dict | None:
    """The carry in `carry_dir` as {"step", "data": [state per process], "drafter": epath.Path, "metrics":
    epath.Path}, or None when there is none."""
    if carry_dir is None:
        return None
    carry_dir = epath.Path(carry_dir)
    path = carry_dir / CARRY_FILE
    if not path.exists():
        return None
    carry = json.loads(path.read_text())
    where = carry_dir / carry["dir"] if "dir" in carry else carry_dir
    data = carry["data"] if isinstance(carry["data"], list) else [carry["data"]]
    return {"step": carry["step"], "data": data, "drafter": where / "drafter", "metrics": where / "metrics.jsonl"}


def write_carry(carry_dir, drafter, step: int, data_states: list, metrics_text: str) -> None:
    """Writes the carry of `step` (process 0 only; `drafter` holds host parameters)."""
    carry_dir = epath.Path(carry_dir)
    name = f"step-{step}"
    save_drafter(drafter, carry_dir / name / "drafter", dtype="bfloat16")
    (carry_dir / name / "metrics.jsonl").write_text(metrics_text)
    tmp = carry_dir / f".{CARRY_FILE}.tmp"
    tmp.write_text(json.dumps({"step": step, "dir": name, "processes": len(data_states), "data": data_states},
                              indent=1))
    tmp.replace(carry_dir / CARRY_FILE)
    for old in carry_dir.glob("step-*"):
        if old.name != name:
            old.rmtree()
    for old in ("drafter", "metrics.jsonl"):  # the first carries' layout, now superseded
        if (carry_dir / old).exists():
            (carry_dir / old).rmtree() if (carry_dir / old).is_dir() else (carry_dir / old).unlink()


def save_drafter(drafter, directory, dtype: str | None = None) -> None:
    """`Drafter.save` to a local directory or, through a local temporary copy, to any epath URI."""
    directory = epath.Path(directory)
    if "://" not in os.fspath(directory):
        drafter.save(os.fspath(directory), dtype=dtype)
        return
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save(tmp, dtype=dtype)
        directory.mkdir(parents=True, exist_ok=True)
        for f in sorted(os.listdir(tmp)):
            epath.Path(tmp, f).copy(directory / f, overwrite=True)


def carry_params(drafter_dir, abstract: dict, config) -> dict:
    """The carried parameters as host arrays shaped like `abstract` (the run's drafter: a pure dict of
    ShapeDtypeStructs, float32) read from the carry's safetensors on this host, never through one device.
    `config` (the run's DrafterConfig) must be the carry's."""
    from dspark_jax.drafter import param_key
    from dspark_jax.drafter_config import DrafterConfig
    from dspark_jax.weights import SafetensorsSlices

    drafter_dir = epath.Path(drafter_dir)
    reader = SafetensorsSlices(drafter_dir, ranged="://" in os.fspath(drafter_dir))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for path, spec in leaves:
        key = param_key(path)
        if key not in reader.tensors:
            raise ValueError(f"the carry in {drafter_dir} lacks {key}: was it written for another drafter config?")
        x = reader.read(key, [(0, n) for n in reader.shape(key)])
        if x.shape != spec.shape:
            raise ValueError(f"the carry's {key} has shape {x.shape}, this run's drafter needs {spec.shape}")
        out.append(np.asarray(x, spec.dtype))
    extra = sorted(set(reader.tensors) - {param_key(p) for p, _ in leaves})
    if extra:
        raise ValueError(f"the carry in {drafter_dir} has parameters this run's drafter lacks: {extra[:3]}")
    carried = DrafterConfig.from_dict(json.loads((drafter_dir / "drafter_config.json").read_text()))
    if carried != config:
        diff = sorted(k for k, v in carried.to_dict().items() if config.to_dict().get(k) != v)
        raise ValueError(f"the carry in {drafter_dir} was written for another drafter config (differs in {diff})")
    return jax.tree_util.tree_unflatten(treedef, out)


def _listing(directory, sizes: bool = True) -> list | None:
    """The names (and sizes) of the files directly under `directory`, a fact every host must agree on; None
    when it does not exist. Data shards are listed by name only: a bucket answers one request per size."""
    directory = epath.Path(directory)
    if not directory.exists():
        return None
    files = sorted(p for p in directory.iterdir() if not p.is_dir())
    return [(p.name, p.stat().length) if sizes else p.name for p in files]


def _to_state(drafter, pure):
    """Pure-dict parameters back into the drafter's nnx.State."""
    state = jax.tree.map(lambda x: x, drafter.params)
    nnx.replace_by_pure_dict(state, pure)
    return state


__all__ = ["RunPaths", "build", "carry_params", "fit", "fresh_params", "init_from_params", "init_params",
           "loss_weights", "read_carry", "save_drafter", "write_carry"]
