"""A real multi-process training run (train/launch.py, train/fit.py): `python -m train launch` starts
`python -m train fit` as 2 processes on localhost, each with 4 simulated CPU devices, joined by
`jax.distributed` (gloo collectives) into one runtime with one (data 2, fsdp 2, tensor 2) mesh over all 8.

Oracle: a single process running the same train step (`train.distill.make_train_step`, one device) on the
same global batches: the concatenation of both processes' grain shards (`dataset[p::2]`, `batch_sequences/2`
rows each), which is exactly what `put_batch` assembles across the processes. Checked:
  * the 2-process losses equal the single-process ones (rtol 1e-5) — step 1 checks the sharded forward,
    steps 2+ the cross-process gradient all-reduce;
  * a run stopped after step 4 (last checkpoint: step 3, written jointly) resumes in both processes from step 3
    and continues the same curve; its exported drafter loads on one device and equals the oracle's parameters.
The tiny target is a random Llama with a word-level tokenizer (no download).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, STOP, CKPT = 6, 4, 3
CONFIG = """\
target: {{spec: {target}}}
drafter: {{kind: dspark, block_size: 4, overrides: {{num_layers: 1, markov_rank: 8}}}}
data: {{path: {data}, seq_len: 32, anchors_per_seq: 4, batch_sequences: 8, features: false}}
optim: {{steps: {steps}, lr: 0.003, warmup: 2}}
mesh: {{data: 2, fsdp: 2, tensor: 2}}
run: {{out_dir: {out}, log_every: 1, ckpt_every: {ckpt}, keep: 5, async_checkpoint: false}}
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
    """Writes target, data and config; launches the 2-process run stopped after step 4, then its resumption."""
    from train.prepare import encode_record, write_shards

    tmp = tmp_path_factory.mktemp("multiprocess")
    target = _tiny_target_dir(str(tmp / "target"))
    rng = np.random.default_rng(0)
    # Random token sequences: the check is arithmetic equality, so the data need not be LM-like.
    records = [encode_record(list(rng.integers(3, 128, size=30 + i % 17)), 4 + i % 5, "chat") for i in range(32)]
    os.makedirs(tmp / "data")
    write_shards(records, str(tmp / "data"), num_shards=2, seed=0)
    out = tmp / "run"
    config = tmp / "tiny.yaml"
    config.write_text(CONFIG.format(target=target, data=tmp / "data", steps=STEPS, out=out, ckpt=CKPT))

    def launch(*extra):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "train", "launch", "--num-processes", "2", "--cpu-devices", "4", "--",
               "fit", "--config", str(config), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        print(f"\n{' '.join(cmd[3:])}: {time.perf_counter() - t0:.0f} s")
        return proc.stdout

    stopped = launch("--stop-after", str(STOP))
    stopped_log = _read_log(out)
    resumed = launch()
    return dict(tmp=tmp, target=target, config=str(config), out=out, stopped_log=stopped_log,
                stopped_stdout=stopped, resumed_stdout=resumed, resumed_log=_read_log(out))


def _read_log(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def oracle(run):
    """Single process, one device: the same initial drafter, optimizer and global batches for STEPS steps."""
    import jax
    from flax import nnx

    from train.config import load_config
    from train.data import make_iterator
    from train.distill import make_optimizer, make_train_step
    from train.fit import build

    cfg = load_config(run["config"])
    target, drafter = build(cfg)
    o, d = cfg.optim, cfg.data
    tx = make_optimizer(o.lr, o.steps, o.warmup, o.clip, o.weight_decay, o.end_lr_ratio)
    step = make_train_step(target, drafter, tx)
    params = jax.tree.map(jax.numpy.array, nnx.to_pure_dict(drafter.params))
    opt = tx.init(params)
    shards = [make_iterator(d.path, seq_len=d.seq_len, anchors_per_seq=d.anchors_per_seq,
                            batch_sequences=d.batch_sequences, seed=cfg.run.seed, process_index=p, process_count=2)
              for p in range(2)]
    losses = []
    for _ in range(STEPS):
        parts = [next(it) for it in shards]
        batch = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}  # process 0's rows first
        params, opt, metrics = step(params, opt, batch)
        losses.append(float(metrics["loss"]))
    return dict(target=target, losses=np.array(losses), params=jax.device_get(params))


@pytest.mark.slow
def test_two_processes_match_one_on_the_same_global_batches(run, oracle):
    stopped = run["stopped_log"]
    assert [r["step"] for r in stopped] == list(range(1, STOP + 1))
    np.testing.assert_allclose([r["loss"] for r in stopped[:3]], oracle["losses"][:3], rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in stopped], oracle["losses"][:STOP], rtol=1e-5)
    # Only process 0 logs; both processes ran (the launcher prefixes each one's output).
    assert "[p0]" in run["stopped_stdout"] and "[p1]" in run["stopped_stdout"]


@pytest.mark.slow
def test_stopped_run_resumes_in_both_processes_to_the_same_curve(run, oracle):
    out = run["resumed_stdout"]
    for p in (0, 1):
        assert f"[p{p}] resumed from step {CKPT}" in out, out[-3000:]
    resumed = run["resumed_log"]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    # Steps 1..3 are kept from before the stop; step 4 is recomputed after the restore and must repeat itself.
    np.testing.assert_allclose(resumed[STOP - 1]["loss"], run["stopped_log"][STOP - 1]["loss"], rtol=1e-6)
    np.testing.assert_allclose([r["loss"] for r in resumed], oracle["losses"], rtol=1e-5)
    # The checkpoint was written jointly: one iterator state per process beside the shared arrays.
    data_dir = run["out"] / "checkpoints" / str(CKPT) / "data"
    assert sorted(f for f in os.listdir(data_dir) if f.endswith(".json")) == ["process_0-of-2.json",
                                                                              "process_1-of-2.json"]


@pytest.mark.slow
def test_exported_drafter_loads_on_one_device_with_the_oracle_parameters(run, oracle):
    import jax
    from flax import nnx

    import dspark_jax

    loaded = dspark_jax.load_drafter(str(run["out"] / "drafter"), oracle["target"])
    got = nnx.to_pure_dict(loaded.params)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-6), got,
                 oracle["params"])
