"""Multi-process training: `python -m train launch --num-processes N -- fit --config ...`.

JAX runs one Python process per host; `jax.distributed.initialize(coordinator, num_processes, process_id)`
joins them into one runtime whose `jax.devices()` lists every process's devices, so `train.sharding` builds one
global mesh over all of them, each process feeds its own rows of every global batch (`put_batch`, with grain
reading `dataset[process_index::process_count]`), and Orbax writes each checkpoint jointly (every process its
own shards, process 0 the metadata).

The launcher starts processes `--process-ids` (default: all N) of an N-process run on this machine, each as
`python -m train fit ... --coordinator ADDR --num-processes N --process-id I`, prefixes their output with
`[pI]`, and stops the others as soon as one fails (the rest would wait at the next collective until the
coordinator's timeout). On one machine `--cpu-devices D` gives every process D simulated CPU devices
(`--xla_force_host_platform_device_count`), and cross-process CPU collectives go through gloo. On a TPU pod
slice every host runs the same command with its own `--process-ids` and the coordinator's address (a v5p-64
slice: 32 chips on 8 hosts, one process per host):

    python -m train launch --num-processes 8 --process-ids $HOST_INDEX --coordinator $HOST0_IP:8476 \\
        -- fit --config gs://your-bucket/dspark/configs/qwen3_8b_tpu_v5p64.yaml

(or, on Cloud TPU, `python -m train fit` alone with `mesh.distributed: true`: JAX then detects all three).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

DISTRIBUTED_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to a multi-process JAX runtime (before any other JAX call touches a device)."""
    import jax

    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
    # CPU collectives across processes need an implementation; gloo is the one jaxlib ships for CPU (a no-op
    # setting on TPU and GPU, where collectives run over ICI / NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_command(train_args: list[str], coordinator: str, num_processes: int, process_id: int) -> list[str]:
    """`python -m train <train_args>` for one process of the run (train_args start with `fit`)."""
    if not train_args or train_args[0] != "fit":
        raise ValueError(f"launch runs `fit` (after `--`), got {train_args[:1] or 'nothing'}")
    given = [a for a in train_args if a.split("=")[0] in DISTRIBUTED_FLAGS]
    if given:
        raise ValueError(f"the launcher sets {given} itself; leave them out of the fit arguments")
    return [sys.executable, "-m", "train", *train_args, "--coordinator", coordinator,
            "--num-processes", str(num_processes), "--process-id", str(process_id)]


def _pump(stream, prefix: str, out) -> None:
    # tqdm redraws with '\r': split on it too so every update stays one prefixed line.
    for line in iter(stream.readline, ""):
        for part in line.rstrip("\n").split("\r"):
            if part.strip():
                out.write(f"{prefix}{part}\n")
                out.flush()
    stream.close()


def launch(train_args: list[str], *, num_processes: int, process_ids: list[int] | None = None,
           coordinator: str | None = None, cpu_devices: int | None = None, timeout: float | None = None) -> int:
    """Runs processes `process_ids` (default all) of an N-process `fit`; returns the first non-zero exit code,
    else 0. With `cpu_devices`, every process runs on the CPU with that many simulated devices."""
    if num_processes < 1:
        raise ValueError(f"{num_processes=} must be >= 1")
    ids = list(range(num_processes)) if process_ids is None else list(process_ids)
    if not ids or any(not 0 <= i < num_processes for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"process ids {ids} must be distinct and in 0..{num_processes - 1}")
    if coordinator is None:
        if len(ids) != num_processes:
            raise ValueError("--coordinator is required when this machine runs only some of the processes")
        coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    if cpu_devices is not None:
        # JAX's own switches for a simulated multi-device CPU (read when the backend starts in each child).
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={cpu_devices}".strip()
    procs, pumps = {}, []
    for i in ids:
        cmd = child_command(train_args, coordinator, num_processes, i)
        procs[i] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    bufsize=1)
        t = threading.Thread(target=_pump, args=(procs[i].stdout, f"[p{i}] ", sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    while procs:
        for i, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[i]
            if rc != 0 and code == 0:
                code = rc
                print(f"[launch] process {i} exited with {rc}; stopping the others", file=sys.stderr, flush=True)
                _stop(procs.values())
        if deadline is not None and time.monotonic() > deadline and procs:
            print(f"[launch] timed out after {timeout:.0f} s; stopping all processes", file=sys.stderr, flush=True)
            _stop(procs.values())
            code = code or 124
        time.sleep(0.1)
    for t in pumps:
        t.join(timeout=5)
    return code


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


__all__ = ["child_command", "initialize", "launch"]
