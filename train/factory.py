"""The drafter factory: data, training and held-out evaluation of several drafters in one timed run, for a
machine that is lent for minutes, reaches nothing and returns a few flat files (scripts/drafter_factory.py).

Phases, each stopped by the clock (`Budget`: shares of `minutes`; an overrun is taken from later phases):
  1. prompts   — Magpie queries written by the target itself (train/magpie.py) plus Python-docstring prompts
                 (train/datasets.py's stdlib pool: local files, no network);
  2. data      — responses from the batched slot decoder (train/regenerate.py), T = `temperature` for most, T = 0
                 for a seeded `greedy_share`; a seeded `heldout_share` of the sequences is kept out of training;
  3. training  — every drafter kind on the *same* batches: one frozen target forward per batch
                 (`distill.target_features`: final hidden [S, T, D] and the drafters' feature layers
                 [S, T, m·D]) feeds each drafter's `distill.make_train_step` (the precomputed-features path of
                 its loss), so the target's cost is paid once for all of them;
  4. held-out  — teacher-forced c*_k per block position (`distill.make_loss_fn`'s `acceptance`: the expected
                 acceptance 1 − ½‖p_d − p_t‖₁) on the held-out T = 1 and T = 0 sequences.
Outputs, flat in `out_dir` (at most `MAX_FILES` files, each ≤ `MAX_FILE_BYTES`): each drafter's bf16
`model.safetensors` cut into byte parts `<kind>.model.safetensors.partK` (`split_file`), `metrics.json` (the
drafters' configs, part checksums, data and step counts, throughput, held-out c*) and `factory.log`.
`assemble(out_dir, dest)` joins the parts into ordinary drafter directories `dest/<kind>/` for `load_drafter`.

Shapes: training batch tokens int32 [S, T] (right-padded windows of prompt + response), lengths [S],
anchors [S, A].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MAX_FILES = 8  # what one device run brings back
MAX_FILE_BYTES = 16 * 2**20
PART_BYTES = 15 * 2**20  # byte parts of a large file, under MAX_FILE_BYTES
METRICS_FILE, LOG_FILE = "metrics.json", "factory.log"


# ---- byte parts: a file too large to carry (the GGUF) or to bring back (a drafter) -------------------------
def split_file(path: str, out_dir: str, part_bytes: int = PART_BYTES, name: str | None = None) -> dict:
    """Cuts `path` into `<name>.part0`, `.part1`, … of ≤ part_bytes in `out_dir`; returns
    {"name", "size", "sha256", "parts": [file names]} (what `join_parts` checks)."""
    if part_bytes < 1:
        raise ValueError(f"{part_bytes=} must be positive")
    name = name or os.path.basename(path)
    os.makedirs(out_dir, exist_ok=True)
    digest, parts, size = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            part = f"{name}.part{len(parts)}"
            with open(os.path.join(out_dir, part), "wb") as out:
                out.write(chunk)
            digest.update(chunk)
            parts.append(part)
            size += len(chunk)
    return {"name": name, "size": size, "sha256": digest.hexdigest(), "parts": parts}


def join_parts(parts: list[str], dest: str, sha256: str | None = None) -> str:
    """Concatenates the part files in order into `dest` (written beside, then renamed); checks the whole
    file's sha256 when given. Returns dest."""
    digest = hashlib.sha256()
    tmp = dest + ".tmp"
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if sha256 is not None and digest.hexdigest() != sha256:
        os.remove(tmp)
        raise ValueError(f"the joined parts {parts} do not match their checksum: a part is missing, stale or "
                         f"out of order (sha256 {digest.hexdigest()[:12]}…, want {sha256[:12]}…)")
    os.replace(tmp, dest)
    return dest


# ---- the run ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FactorySettings:
    """One factory run (static numbers only; the target comes separately)."""

    minutes: float = 9.0  # the whole run from run_factory's `start` (the script: before the target loads)
    prompt_share: float = 0.12
    data_share: float = 0.33
    train_share: float = 0.45  # the rest: held-out evaluation and writing the files
    kinds: tuple[str, ...] = ("dspark", "eagle3")
    block_size: int = 7
    dspark_layers: int = 2
    dflash_layers: int = 2
    # DSpark's Markov rank in training. At 300 steps, held-out c* on T = 1 text 0.180 at rank 32, 0.216 at DeepSpec's
    # 256, 0.236 at 1,024 (EAGLE-3 0.272), all at positions 2-7 (reports/2026-12-06/markov-shrink).
    markov_rank: int = 1024
    # ... and the rank its head is cut to (train/shrink.py, the truncated SVD of W1·W2) before the held-out
    # evaluation and the files, which hold rank 256 over the whole vocabulary: the rank-1,024 head cut to 256
    # scored 0.2356, to 32 0.2345 (the shipped size).
    written_markov_rank: int = 256
    # How DSpark's Markov head starts: "pmi", the rank-R factors of the training responses' smoothed bigram PMI
    # (train/markov_init.py; at rank 256 it reached by step 50 the held-out c* a zero start reached by step 300,
    # reports/2026-12-06/markov-pmi), or "zero".
    markov_init: str = "pmi"
    # EAGLE-3's fused input in the anchor slot: at 300 steps, position-1 held-out c* on T = 1 text 0.287 against
    # `add`'s 0.212 (EAGLE-3 0.297; reports/2026-12-06/anchor-ab)
    anchor_mode: str = "fused"
    magpie: int = 16384  # Magpie queries asked for
    docstrings: int = 4096  # stdlib docstring prompts (the pool holds a few thousand)
    responses_per_prompt: int = 2  # sampled answers per prompt (a second pass over all prompts, new streams)
    max_query_tokens: int = 96
    gen_tokens: int = 10_000_000  # stop generating after this many response tokens (or at the data deadline)
    gen_batch: int = 2048  # decode slots
    max_new_tokens: int = 384
    max_prompt_tokens: int = 256
    temperature: float = 1.0
    greedy_share: float = 0.2
    heldout_share: float = 0.02
    seq_len: int = 512  # T of a training window
    batch_sequences: int = 64  # S
    anchors_per_seq: int = 16  # A
    train_steps: int = 20_000  # at most; the schedule spans what the train phase's clock holds (fitted_steps)
    lr: float = 1e-3
    seed: int = 0
    # The slot decoder's attention. "reference" (XLA's) by default: the Pallas kernel ("auto" on GPU) is measured
    # at serving shapes, not at thousands of rows.
    kernels: str = "reference"

    def __post_init__(self):
        if self.responses_per_prompt < 1:
            raise ValueError(f"{self.responses_per_prompt=} must be >= 1")
        if self.prompt_share + self.data_share + self.train_share >= 1.0:
            raise ValueError("prompt_share + data_share + train_share must leave time for evaluation (< 1)")
        bad = sorted(set(self.kinds) - {"dspark", "eagle3", "dflash"})
        if bad or not self.kinds:
            raise ValueError(f"kinds must be some of dspark, eagle3, dflash; got {self.kinds}")
        if self.markov_init not in ("zero", "pmi"):
            raise ValueError(f"markov_init: expected 'zero' or 'pmi', got {self.markov_init!r}")
        if not 0 < self.written_markov_rank <= self.markov_rank:
            raise ValueError(f"written_markov_rank {self.written_markov_rank} must be in [1, markov_rank "
                             f"{self.markov_rank}]")
        if not 0 <= self.greedy_share <= 1 or not 0 < self.heldout_share < 1:
            raise ValueError(f"{self.greedy_share=} must lie in [0, 1], {self.heldout_share=} in (0, 1)")


class Budget:
    """The run's clock: `deadline(phase)`, asked as a phase starts, is now + the time left × the phase's part of
    the shares not yet begun, so a phase that overran (a slow compile, a loaded machine) takes its time from the
    later ones in proportion instead of leaving them none."""

    ORDER = ("prompts", "data", "train", "rest")  # rest: held-out evaluation and writing the files

    def __init__(self, s: FactorySettings, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.end = self.start + 60.0 * s.minutes
        self.shares = {"prompts": s.prompt_share, "data": s.data_share, "train": s.train_share,
                       "rest": 1.0 - s.prompt_share - s.data_share - s.train_share}

    def deadline(self, phase: str) -> float:
        now = time.monotonic()
        later = sum(self.shares[p] for p in self.ORDER[self.ORDER.index(phase):])
        return now + max(self.end - now, 0.0) * self.shares[phase] / later

    @staticmethod
    def left(deadline: float) -> float:
        return deadline - time.monotonic()


def drafter_configs(target, s: FactorySettings) -> dict:
    """{kind: DrafterConfig}, all reading the same target layers (one shared forward feeds them all)."""
    from dspark_jax.drafter_config import DrafterConfig

    extra = {"dspark": dict(num_layers=s.dspark_layers, markov_rank=s.markov_rank, anchor_feature=True,
                            anchor_mode=s.anchor_mode),
             "dflash": dict(num_layers=s.dflash_layers), "eagle3": {}}
    cfgs = {k: DrafterConfig.for_target(target.config, kind=k, block_size=s.block_size, **extra[k])
            for k in s.kinds}
    if len({c.target_layers for c in cfgs.values()}) != 1:
        raise ValueError("the drafters read different target layers: one shared target forward cannot feed them")
    return cfgs


def written_configs(cfgs: dict, s: FactorySettings) -> dict:
    """{kind: DrafterConfig} of the drafters as written: DSpark's Markov head at `s.written_markov_rank`."""
    return {k: dataclasses.replace(c, markov_rank=min(c.markov_rank, s.written_markov_rank)) if k == "dspark" else c
            for k, c in cfgs.items()}


def cut_drafters(drafters: dict, s: FactorySettings, log) -> dict:
    """DSpark's Markov head cut to `s.written_markov_rank` (train/shrink.py); returns {kind: shrink report}."""
    from train.shrink import shrink_drafter

    reports = {}
    d = drafters.get("dspark")
    if d is not None and d.config.markov_rank > s.written_markov_rank:
        drafters["dspark"], reports["dspark"] = shrink_drafter(d, markov_rank=s.written_markov_rank)
        log(f"dspark: Markov head cut from rank {d.config.markov_rank} to {s.written_markov_rank}, "
            f"{100 * reports['dspark']['kept_energy']:.2f}% of W1·W2's squared norm kept")
    return reports


def planned_files(cfgs: dict) -> dict[str, int]:
    """Files each output takes (bf16 weights in byte parts), checked against MAX_FILES before any work."""
    from dspark_jax.drafter_model import DrafterModel

    out = {}
    for kind, cfg in cfgs.items():
        shapes = nnx.eval_shape(lambda c=cfg: DrafterModel(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        size = sum(x.size * 2 for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
        out[kind] = -(-int(size * 1.01 + 65536) // PART_BYTES)  # + the safetensors header
    return {**out, METRICS_FILE: 1, LOG_FILE: 1}


def collect_prompts(target, s: FactorySettings, budget: Budget, log, banned: frozenset[str]
                    ) -> list[tuple[str, list[int]]]:
    """(source, chat-templated ids) of the Magpie queries and docstring prompts, ≤ max_prompt_tokens each; a
    query equal to one of `banned` (the normalised evaluation prompts, `magpie.eval_prompts`) is dropped."""
    from train import datasets, magpie

    texts = [("docstring", t) for t in datasets.load_prompts("train", "code", s.docstrings, seed=s.seed)]
    log(f"evaluation prompts the Magpie queries are checked against: {len(banned)}")
    queries = magpie.magpie_prompts(target, s.magpie, seed=s.seed, batch_size=s.gen_batch,
                                    max_query_tokens=s.max_query_tokens, banned=banned,
                                    deadline=budget.deadline("prompts"), kernels=s.kernels)
    log(f"prompts: {len(queries)} Magpie queries, {len(texts)} docstrings")
    texts += [(f"magpie_{d}", q) for d, q in queries]
    out = [(src, ids) for src, ids in ((src, target.chat_ids(t)) for src, t in texts)
           if len(ids) <= s.max_prompt_tokens]
    order = np.random.default_rng(s.seed).permutation(len(out))
    return [out[i] for i in order]


class _Stop(Exception):
    pass


def generate_data(target, prompts, s: FactorySettings, budget: Budget, log) -> dict:
    """Responses until gen_tokens or the data deadline: {"sequences": [ids], "prompt_lens", "greedy": bool,
    "heldout": bool, "response_tokens", "seconds"}.

    Request k answers prompt k mod N in pass k div N (`responses_per_prompt` passes, each its own streams); a
    seeded share of the prompts is held out (all of a prompt's answers together), and a seeded share is answered
    greedily in the first pass (a greedy answer would repeat in later passes: those sample)."""
    from train.regenerate import SlotDecoder, SlotSettings, generate_slots

    n = len(prompts)
    if not n:
        raise ValueError("no prompts to answer: the prompt phase produced none")
    rng = np.random.default_rng(s.seed + 1)
    greedy = np.concatenate([rng.random(n) < s.greedy_share, np.zeros(n * (s.responses_per_prompt - 1), bool)])
    heldout = np.tile(rng.random(n) < s.heldout_share, s.responses_per_prompt)
    cap = -(-(max(len(p) for _, p in prompts) + s.max_new_tokens + 1) // 64) * 64
    settings = SlotSettings(batch=s.gen_batch, capacity=cap, max_new_tokens=s.max_new_tokens,
                            temperature=s.temperature, top_p=1.0, kernels=s.kernels)
    done: dict[int, list[int]] = {}
    count = [0]
    t0, deadline = time.perf_counter(), budget.deadline("data")
    decoder = SlotDecoder(target, settings, s.seed)

    def on_done(i, response):
        done[i] = response
        count[0] += len(response)
        if count[0] >= s.gen_tokens or Budget.left(deadline) <= 0:
            raise _Stop

    try:
        generate_slots(target, ((k, prompts[k % n][1]) for k in range(n * s.responses_per_prompt)),
                       settings=settings, seed=s.seed, eos_ids=target.eos_token_ids, on_done=on_done,
                       greedy=lambda k: bool(greedy[k]), decoder=decoder)
    except _Stop:
        pass
    dt = time.perf_counter() - t0
    keep = sorted(i for i, r in done.items() if len(r) >= 2)
    programs = decoder.traces  # each traced shape compiled once: on an accelerator, seconds of the phase each
    log(f"data: {len(keep)} sequences, {count[0]} response tokens in {dt:.1f} s ({count[0] / dt:.0f} tokens/s; "
        f"programs traced: {programs['prefill']} prefill, {programs['step']} step)")
    return {"sequences": [prompts[k % n][1] + done[k] for k in keep],
            "prompt_lens": [len(prompts[k % n][1]) for k in keep],
            "greedy": greedy[keep], "heldout": heldout[keep], "response_tokens": count[0], "seconds": dt,
            "programs": programs}


def windows(sequences, prompt_lens, seq_len: int):
    """(tokens int32 [N, T] right-padded, lengths [N], min_anchor [N]): each sequence's first T tokens, kept when
    its response starts inside them with ≥ 2 tokens (an anchor and its next token)."""
    rows = [(seq[:seq_len], p) for seq, p in zip(sequences, prompt_lens, strict=True)
            if min(len(seq), seq_len) - max(p - 1, 1) >= 2]
    tokens = np.zeros((len(rows), seq_len), np.int32)
    lengths = np.zeros(len(rows), np.int32)
    min_anchor = np.zeros(len(rows), np.int32)
    for j, (seq, p) in enumerate(rows):
        tokens[j, : len(seq)], lengths[j], min_anchor[j] = seq, len(seq), p - 1
    return tokens, lengths, min_anchor


def make_batch(key, tokens, lengths, min_anchor, s: FactorySettings) -> dict:
    """S rows drawn with replacement, A anchors each (uniform on [max(1, prompt length − 1), length − 2])."""
    from train.distill import make_batch as draw

    return draw(key, tokens, lengths, min_anchor, s.batch_sequences, anchors_per_seq=s.anchors_per_seq)


def shared_features_fn(target, layers: tuple[int, ...]):
    """Jitted (target params, tokens [S, T]) → the batch's one target forward: (final-normed hidden [S, T, D],
    feats [S, T, m·D]) for every drafter (the graphdef is closed over: hashing it per call costs ms)."""
    from train.distill import target_features

    return jax.jit(lambda target_params, tokens: target_features(nnx.merge(target.graphdef, target_params), tokens,
                                                                  layers))


PACE_STEPS = 10  # steps timed after the first (compiling) one, to size the schedule to the train phase's clock


def fitted_steps(done: int, seconds_per_step: float, seconds_left: float, cap: int, margin: float = 0.95) -> int:
    """The schedule's length once the pace is known: the steps done plus those `margin` of the time left holds at
    `seconds_per_step`, at most `cap` and at least `done`."""
    more = int(margin * max(seconds_left, 0.0) / max(seconds_per_step, 1e-9))
    return max(done, min(cap, done + more))


def train_drafters(target, cfgs: dict, data: dict, s: FactorySettings, budget: Budget, log) -> tuple[dict, dict]:
    """Trains every drafter on the same batches until the train deadline → ({kind: Drafter}, stats).

    The lr schedule (warm-up, cosine to 0.1·lr) spans the steps the train phase's time holds: the first step
    compiles, the next PACE_STEPS are timed, and the schedule's length becomes `fitted_steps` (at most
    `train_steps`), so a fast device trains longer and a slow one still ends its schedule inside the clock. The
    rate is set before each step (`make_settable_optimizer`), so resizing the schedule recompiles nothing; the
    deadline still stops a run whose pace changed (the stats say so)."""
    from dspark_jax.drafter import Drafter
    from dspark_jax.drafter_model import DrafterModel
    from train.distill import (
        init_train_state,
        make_settable_optimizer,
        make_train_step,
        schedule_values,
        set_learning_rate,
    )
    from train.losses import LossWeights

    train = ~data["heldout"]
    sequences = [q for q, t in zip(data["sequences"], train, strict=True) if t]
    prompt_lens = [p for p, t in zip(data["prompt_lens"], train, strict=True) if t]
    tokens, lengths, min_anchor = windows(sequences, prompt_lens, s.seq_len)
    if not len(tokens):
        raise ValueError("no training sequence: generation produced nothing usable in its time")
    n_windows = len(tokens)
    tokens, lengths, min_anchor = jax.device_put((tokens, lengths, min_anchor))  # once: batches are drawn on device
    layers = next(iter(cfgs.values())).target_layers
    features = shared_features_fn(target, layers)
    tx = make_settable_optimizer()
    weights = {kind: LossWeights.for_kind(kind) for kind in cfgs}  # what each step trains on, and metrics.json says
    drafters, states, steps, markov_init = {}, {}, {}, {}
    for kind, cfg in cfgs.items():
        d = Drafter(cfg, DrafterModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(s.seed)))
        if kind == "dspark" and s.markov_init == "pmi":
            markov_init[kind] = _start_markov_from_pmi(d, sequences, prompt_lens, log)
        drafters[kind] = d
        states[kind] = init_train_state(d.params, tx)
        steps[kind] = make_train_step(target, d, tx, weights[kind])
    key = jax.random.key(s.seed + 2)
    history: dict[str, list] = {k: [] for k in cfgs}
    total = s.train_steps  # the schedule's length until the pace is measured
    lrs = schedule_values(s.lr, total)
    pace = None
    t0, done, deadline = time.perf_counter(), 0, budget.deadline("train")
    while done < total and Budget.left(deadline) > 0:
        i = done
        batch = make_batch(jax.random.fold_in(key, i), tokens, lengths, min_anchor, s)
        batch["hidden"], batch["feats"] = features(target.params, batch["tokens"])
        lr = jnp.asarray(lrs[i])  # one upload a step, shared by every drafter
        for kind in cfgs:
            params, opt, metrics = steps[kind](states[kind][0], set_learning_rate(states[kind][1], lr), batch)
            states[kind] = (params, opt)
            if i % 50 == 0 or i == total - 1:
                m = jax.device_get(metrics)
                history[kind].append({"step": i + 1, "lr": float(lrs[i]), "loss": round(float(m["loss"]), 4),
                                      "acceptance": [round(float(x), 4) for x in m["acceptance"]]})
        done = i + 1
        if done == 1 or (pace is None and done == 1 + PACE_STEPS):
            jax.block_until_ready(states)
            if done == 1:
                t_first = time.perf_counter()
                log(f"train: first step (compiles) in {t_first - t0:.1f} s")
            else:
                pace = (time.perf_counter() - t_first) / PACE_STEPS
                total = fitted_steps(done, pace, Budget.left(deadline), s.train_steps)
                lrs = schedule_values(s.lr, total)
                log(f"train: {pace * 1e3:.1f} ms a step; the schedule spans {total} steps "
                    f"(at most {s.train_steps}; {Budget.left(deadline):.0f} s left)")
        if i % 50 == 0:
            log(f"train step {done}: " + ", ".join(f"{k} loss {h[-1]['loss']:.3f}" for k, h in history.items()))
    jax.block_until_ready(states)
    dt = time.perf_counter() - t0
    log(f"train: {done}/{total} steps in {dt:.1f} s on {n_windows} windows")
    trained = {k: drafters[k].with_params(states[k][0]) for k in cfgs}
    return trained, {"steps": done, "planned_steps": total, "max_steps": s.train_steps, "seconds": round(dt, 1),
                     "seconds_per_step": None if pace is None else round(pace, 5),
                     "cut_by_clock": done < total, "windows": int(n_windows),
                     "anchor_blocks": done * s.batch_sequences * s.anchors_per_seq,
                     "loss_weights": {k: dataclasses.asdict(w) for k, w in weights.items()},
                     "markov_init": markov_init, "history": history}


def _start_markov_from_pmi(d, sequences, prompt_lens, log) -> dict:
    """Sets the fresh DSpark `d`'s Markov head from the training responses' bigram PMI (train/markov_init.py), in
    place; returns the counts' stats."""
    from train.markov_init import pmi_head  # not train.fit: it imports grain, which the GPU image lacks

    t0 = time.perf_counter()
    w1, w2, stats = pmi_head(d.config, sequences, prompt_lens)
    nnx.replace_by_pure_dict(d.params, {**nnx.to_pure_dict(d.params), "markov_w1": w1, "markov_w2": w2})
    log(f"dspark: Markov head from {stats['bigrams']:,} bigrams ({stats['pairs']:,} distinct), rank "
        f"{d.config.markov_rank} keeps {stats['kept_energy']:.3f} of their PMI, in {time.perf_counter() - t0:.1f} s")
    return stats


def heldout_acceptance(target, drafters: dict, data: dict, s: FactorySettings, batches: int = 4) -> dict:
    """Teacher-forced c*_k per position on the held-out sequences, T = 1 and T = 0 apart: {kind: {"t1": [L],
    "t0": [L], "sequences": {...}}} (None where a split has no sequence)."""
    from train.distill import make_loss_fn

    out: dict = {k: {} for k in drafters}
    for name, want_greedy in (("t1", False), ("t0", True)):
        rows = [j for j in range(len(data["sequences"])) if data["heldout"][j] and data["greedy"][j] == want_greedy]
        tokens, lengths, min_anchor = windows([data["sequences"][j] for j in rows],
                                              [data["prompt_lens"][j] for j in rows], s.seq_len)
        for kind, d in drafters.items():
            out[kind].setdefault("sequences", {})[name] = int(len(tokens))
            if not len(tokens):
                out[kind][name] = None
                continue
            loss = make_loss_fn(target, d)
            acc = [np.asarray(jax.device_get(loss(d.params, make_batch(jax.random.key(1000 + b), tokens, lengths,
                                                                      min_anchor, s))[1]["acceptance"]))
                   for b in range(batches)]
            out[kind][name] = [round(float(x), 4) for x in np.mean(acc, 0)]
    return out


def write_drafters(out_dir: str, drafters: dict) -> dict:
    """Each drafter's bf16 model.safetensors as byte parts in `out_dir`; returns metrics.json's "drafters" entry
    ({kind: {"config", "weights" (part names and checksum), "params"}})."""
    import tempfile

    from dspark_jax.drafter import CONFIG_FILE, WEIGHTS_FILE

    os.makedirs(out_dir, exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, d in drafters.items():
            d.save(os.path.join(tmp, kind), dtype="bfloat16")
            parts = split_file(os.path.join(tmp, kind, WEIGHTS_FILE), out_dir, name=f"{kind}.{WEIGHTS_FILE}")
            with open(os.path.join(tmp, kind, CONFIG_FILE)) as f:
                out[kind] = {"config": json.load(f), "weights": parts, "params": int(d.num_params())}
    return out


def write_metrics(out_dir: str, metrics: dict) -> list[str]:
    """metrics.json (which names the weight parts `write_drafters` wrote); then checks that `out_dir` holds at most
    MAX_FILES flat files of ≤ MAX_FILE_BYTES. Returns the file names."""
    with open(os.path.join(out_dir, METRICS_FILE), "w") as f:
        json.dump(metrics, f, indent=1)
    files = sorted(os.listdir(out_dir))
    big = [(n, os.path.getsize(os.path.join(out_dir, n))) for n in files
           if os.path.getsize(os.path.join(out_dir, n)) > MAX_FILE_BYTES]
    if len(files) > MAX_FILES or big or any(os.path.isdir(os.path.join(out_dir, n)) for n in files):
        raise RuntimeError(f"{out_dir} holds {len(files)} entries (at most {MAX_FILES} flat files of ≤ 16 MiB): "
                           f"{files}; too large: {big}")
    return files


def assemble(factory_dir: str, dest: str) -> dict[str, str]:
    """The factory's flat files → `dest/<kind>/` drafter directories (drafter_config.json + model.safetensors,
    parts joined and checked) that `load_drafter` reads. Returns {kind: directory}."""
    from dspark_jax.drafter import CONFIG_FILE, WEIGHTS_FILE

    with open(os.path.join(factory_dir, METRICS_FILE)) as f:
        metrics = json.load(f)
    out = {}
    for kind, entry in metrics["drafters"].items():
        d = os.path.join(dest, kind)
        os.makedirs(d, exist_ok=True)
        w = entry["weights"]
        join_parts([os.path.join(factory_dir, p) for p in w["parts"]], os.path.join(d, WEIGHTS_FILE), w["sha256"])
        with open(os.path.join(d, CONFIG_FILE), "w") as f:
            json.dump(entry["config"], f, indent=2)
        out[kind] = d
    return out


def run_factory(target, out_dir: str, s: FactorySettings, *, banned: frozenset[str], start: float | None = None,
                say=print) -> dict:
    """Prompts → data → training → held-out c* → flat files in `out_dir`, within s.minutes from `start`
    (default: now). `banned`: the normalised evaluation prompts no Magpie query may equal. Returns the metrics
    written to metrics.json."""
    budget = Budget(s, start)
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, LOG_FILE)
    open(log_path, "w").close()

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - budget.start:7.1f} s] {msg}"
        say(line)
        with open(log_path, "a") as f:  # as it goes: a run cut off by the device's limit still returns its log
            f.write(line + "\n")

    cfgs = drafter_configs(target, s)
    files = planned_files(written_configs(cfgs, s))
    if sum(files.values()) > MAX_FILES:
        raise ValueError(f"these drafters need {files} files, more than {MAX_FILES}: drop a kind or shrink them")
    log(f"backend {jax.default_backend()}, target {target.source} ({target.dtype}), settings {dataclasses.asdict(s)}")
    prompts = collect_prompts(target, s, budget, log, banned)
    data = generate_data(target, prompts, s, budget, log)
    drafters, train_stats = train_drafters(target, cfgs, data, s, budget, log)
    train_stats["cut"] = cut_drafters(drafters, s, log)
    metrics = {
        "settings": dataclasses.asdict(s), "backend": jax.default_backend(), "target": target.source,
        "data": {"prompts": len(prompts), "eval_prompts_banned": len(banned), "sequences": len(data["sequences"]),
                 "response_tokens": data["response_tokens"], "seconds": round(data["seconds"], 1),
                 "tokens_per_s": round(data["response_tokens"] / max(data["seconds"], 1e-9), 1),
                 "greedy": int(np.sum(data["greedy"])), "heldout": int(np.sum(data["heldout"])),
                 "programs_traced": data["programs"]},
        "train": train_stats, "heldout_acceptance": None,
        "elapsed_s": round(time.monotonic() - budget.start, 1),
    }
    # The trained drafters go out before the held-out evaluation, so a run cut off there still returns them
    # (metrics.json then says "heldout_acceptance": null); only metrics.json is rewritten at the end.
    log(f"writing {out_dir} (drafters; held-out acceptance to follow)")
    metrics["drafters"] = write_drafters(out_dir, drafters)
    write_metrics(out_dir, metrics)
    held = heldout_acceptance(target, drafters, data, s)
    for kind, h in held.items():
        log(f"held-out c* {kind}: T=1 {h.get('t1')}, T=0 {h.get('t0')}")
    metrics = {**metrics, "heldout_acceptance": held, "elapsed_s": round(time.monotonic() - budget.start, 1)}
    log(f"writing {out_dir}/{METRICS_FILE}")
    write_metrics(out_dir, metrics)
    return metrics
