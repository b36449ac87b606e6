"""A real multi-process training run (train/launch.py, train/fit.py) as a pod would run it: `python -m train
launch` starts `python -m train fit` as 2 processes on localhost, each with 4 simulated CPU devices, joined by
`jax.distributed` (gloo collectives) into one runtime with one (data 1, fsdp 4, tensor 2) mesh over all 8 — FSDP
spans the two processes, so each holds (and reads from the target's safetensors) only its half of the weights.

The config is the pod's kind: every path is gs://dspark-test/… (config file, target, data, out_dir, carry_dir),
mapped by `--path-root gs://dspark-test=file://<tmp>/bucket` onto a local directory (train/config.py).

Oracle: a single process running the same train step (`train.distill.make_train_step`, one device) on the
same global batches: the concatenation of both processes' grain shards (`dataset[p::2]`, `batch_sequences/2`
rows each), which is exactly what `put_batch` assembles across the processes. Checked:
  * the 2-process losses equal the single-process ones (rtol 1e-5) — step 1 checks the sharded target load and
    forward, steps 2+ the cross-process gradient all-reduce;
  * the run stopped after step 4 left a carry at step 3 (bf16 parameters, both processes' data positions); a
    second run in a new out_dir (a new machine: no Orbax checkpoints) continues from it in both processes, and
    its curve is the single process's continued from the same carry; its exported drafter loads on one device
    with the oracle's parameters;
  * a host whose config differs (another learning rate) stops both processes before the first step, naming
    the config: the cross-host agreement check (train/sharding.py: agree) is live.
The tiny target is a random Llama with a word-level tokenizer (no download).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, STOP, CKPT = 6, 4, 3
BUCKET = "gs://dspark-test"
CONFIG = """\
target: {{spec: {bucket}/target}}
drafter: {{kind: dspark, block_size: 4, overrides: {{num_layers: 1, markov_rank: 8}}}}
data: {{path: {bucket}/data, seq_len: 32, anchors_per_seq: 4, batch_sequences: 8}}
optim: {{steps: {steps}, lr: 0.003, warmup: 2}}
mesh: {{data: 1, fsdp: 4, tensor: 2}}
run: {{out_dir: {bucket}/runs/first, carry_dir: {bucket}/carry, log_every: 1, ckpt_every: {ckpt}, keep: 5,
      async_checkpoint: false}}
"""


def _tiny_target_dir(directory: str) -> str:
    """A random tiny Llama plus a word-level tokenizer ("t0".."t127") with a trivial chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_hf_model("llama", tied=True).save_pretrained(directory, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(directory)
    return directory


def test_launcher_rejects_what_it_cannot_run(tmp_path, capsys):
    from train.__main__ import main

    assert main(["launch", "--num-processes", "2", "--", "eval", "--drafters", "x"]) == 2
    assert "launch runs `fit`" in capsys.readouterr().err
    assert main(["launch", "--num-processes", "2", "--", "fit", "--process-id", "1"]) == 2
    assert "the launcher sets" in capsys.readouterr().err
    assert main(["launch", "--num-processes", "2", "--process-ids", "2", "--", "fit"]) == 2
    assert "must be distinct and in 0..1" in capsys.readouterr().err
    assert main(["launch", "--num-processes", "4", "--process-ids", "1", "--", "fit"]) == 2
    assert "--coordinator is required" in capsys.readouterr().err
    assert main(["fit", "--coordinator", "127.0.0.1:1234"]) == 2
    assert "go together" in capsys.readouterr().err


def test_a_failing_process_fails_the_launch(tmp_path, capfd):
    """Both processes stop with the config error; the launcher returns its exit code and says which failed."""
    from train.launch import launch

    assert launch(["fit", "--config", str(tmp_path / "missing.yaml")], num_processes=2, cpu_devices=1) == 2
    out, err = capfd.readouterr()
    assert "config file not found" in out and "exited with 2" in err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Writes target, data and config into the "bucket"; launches the run stopped after step 4, the run continued
    from its carry in a new out_dir, and the run whose second host has another config."""
    from train.prepare import encode_record, write_shards

    tmp = tmp_path_factory.mktemp("multiprocess")
    bucket = tmp / "bucket"
    _tiny_target_dir(str(bucket / "target"))
    rng = np.random.default_rng(0)
    # Random token sequences: the check is arithmetic equality, so the data need not be LM-like.
    records = [encode_record(list(rng.integers(3, 128, size=30 + i % 17)), 4 + i % 5, "chat") for i in range(32)]
    os.makedirs(bucket / "data")
    write_shards(records, str(bucket / "data"), num_shards=2, seed=0)
    (bucket / "tiny.yaml").write_text(CONFIG.format(bucket=BUCKET, steps=STEPS, ckpt=CKPT))
    fit_args = ["fit", "--config", f"{BUCKET}/tiny.yaml", "--path-root", f"{BUCKET}=file://{bucket}"]

    def launch(*extra, ids=None, coordinator=None, ok=True):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "train", "launch", "--num-processes", "2", "--cpu-devices", "4"]
        if ids is not None:
            cmd += ["--process-ids", *map(str, ids), "--coordinator", coordinator]
        cmd += ["--", *fit_args, *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if ok:
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        print(f"\n{' '.join(cmd[3:])}: {time.perf_counter() - t0:.0f} s")
        return proc

    first = launch("--stop-after", str(STOP)).stdout
    first_log = _read_log(bucket / "runs" / "first")
    shutil.copytree(bucket / "carry", tmp / "carry3")  # the oracle continues from this one; the run moves it on
    second = launch("--set", f"run.out_dir={BUCKET}/runs/second").stdout

    # Each "host" runs its own launcher, as on a pod; host 1 has a stale config (another learning rate).
    from train.launch import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "train", "launch", "--num-processes", "2", "--cpu-devices", "4",
                               "--process-ids", str(i), "--coordinator", coordinator, "--", *fit_args,
                               "--set", f"run.out_dir={BUCKET}/runs/mismatch", *extra], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i, extra in [(0, []), (1, ["--set", "optim.lr=0.004"])]]
    t0 = time.perf_counter()
    mismatch = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    print(f"\nthe run with a stale config on host 1: {time.perf_counter() - t0:.0f} s")
    return dict(tmp=tmp, bucket=bucket, config=str(bucket / "tiny.yaml"), first_stdout=first, first_log=first_log,
                second_stdout=second, second_log=_read_log(bucket / "runs" / "second"), mismatch=mismatch)


def _read_log(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def oracle(run):
    """Single process, one device: the same initial drafter, optimizer and global batches for STOP steps; then
    the same carry (step 3) continued for STEPS - CKPT steps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from train.config import load_config, resolve_config_paths
    from train.data import make_iterator
    from train.distill import init_train_state, make_optimizer, make_train_step
    from train.fit import RunPaths, build, carry_params, read_carry

    cfg = resolve_config_paths(load_config(run["config"]), {BUCKET: f"file://{run['bucket']}"})
    target, drafter = build(cfg)
    o, d = cfg.optim, cfg.data
    data = RunPaths.of(cfg).data

    def iterators():
        return [make_iterator(data, seq_len=d.seq_len, anchors_per_seq=d.anchors_per_seq,
                              batch_sequences=d.batch_sequences, seed=cfg.run.seed, process_index=p,
                              process_count=2) for p in range(2)]

    def steps(params, opt, step, its, n):
        losses = []
        for _ in range(n):
            parts = [next(it) for it in its]
            batch = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}  # process 0's rows first
            params, opt, metrics = step(params, opt, batch)
            losses.append(float(metrics["loss"]))
        return params, losses

    tx = make_optimizer(o.lr, o.steps, o.warmup, o.clip, o.weight_decay, o.end_lr_ratio)
    params, opt = init_train_state(nnx.to_pure_dict(drafter.params), tx)
    _, first = steps(params, opt, make_train_step(target, drafter, tx), iterators(), STOP)

    carry = read_carry(run["tmp"] / "carry3")
    tx = make_optimizer(o.lr, o.steps, o.warmup, o.clip, o.weight_decay, o.end_lr_ratio, step_offset=CKPT)
    abstract = jax.eval_shape(lambda: nnx.to_pure_dict(drafter.params))
    params, opt = init_train_state(jax.tree.map(jnp.asarray, carry_params(carry["drafter"], abstract,
                                                                          drafter.config)), tx)
    its = iterators()
    for it, state in zip(its, carry["data"], strict=True):
        it.set_state(state)
    params, second = steps(params, opt, make_train_step(target, drafter, tx), its, STEPS - CKPT)
    return dict(target=target, first=np.array(first), second=np.array(second), params=jax.device_get(params))


@pytest.mark.slow
def test_two_processes_match_one_on_the_same_global_batches(run, oracle):
    first = run["first_log"]
    assert [r["step"] for r in first] == list(range(1, STOP + 1))
    np.testing.assert_allclose([r["loss"] for r in first], oracle["first"], rtol=1e-5)
    # Only process 0 logs; both processes ran (the launcher prefixes each one's output).
    out = run["first_stdout"]
    assert "[p0]" in out and "[p1]" in out
    # FSDP spans the processes: each read about half of the target's bytes (norms are replicated, so a bit more).
    for p in (0, 1):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"[p{p}] target "))
        got, total = (float(x) for x in line.split("read ")[1].split(" MiB (")[0].split(" MiB of "))
        assert 0.4 * total < got < 0.7 * total, line


@pytest.mark.slow
def test_a_new_machine_continues_from_the_carry_in_both_processes_to_the_same_curve(run, oracle):
    out = run["second_stdout"]
    for p in (0, 1):
        assert f"[p{p}] continued from the carry at step {CKPT}" in out, out[-3000:]
    second = run["second_log"]
    assert [r["step"] for r in second] == list(range(1, STEPS + 1))
    assert second[:CKPT] == run["first_log"][:CKPT]  # the carried metrics
    np.testing.assert_allclose([r["loss"] for r in second[CKPT:]], oracle["second"], rtol=1e-5)
    # bf16 parameters and fresh moments: step 4 is the uninterrupted step 4 up to that rounding.
    np.testing.assert_allclose(second[CKPT]["loss"], run["first_log"][CKPT]["loss"], rtol=2e-2)
    carried = json.loads((run["bucket"] / "carry" / "carry.json").read_text())
    assert carried["step"] == STEPS and carried["processes"] == 2 and len(carried["data"]) == 2


@pytest.mark.slow
def test_exported_drafter_loads_on_one_device_with_the_oracle_parameters(run, oracle):
    import jax
    from flax import nnx

    import dspark_jax

    loaded = dspark_jax.load_drafter(str(run["bucket"] / "runs" / "second" / "drafter"), oracle["target"])
    got = nnx.to_pure_dict(loaded.params)
    # FSDP over two processes sums gradients in another order than one device: Adam's normalised steps carry
    # that to ~1e-6 absolute on parameters of ~1e-2.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5), got,
                 oracle["params"])


@pytest.mark.slow
def test_hosts_that_disagree_stop_before_the_first_step(run):
    for code, out in run["mismatch"]:
        assert code == 2, out[-3000:]
        assert "processes disagree on ['config']" in out, out[-3000:]
    assert not (run["bucket"] / "runs" / "mismatch" / "metrics.jsonl").exists()
