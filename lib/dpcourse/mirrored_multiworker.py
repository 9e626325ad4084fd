"""MultiWorkerMirroredStrategy with N worker processes on this machine (lesson 05, §9): ports,
``TF_CONFIG``, and workers that are ended on error or timeout. :func:`run_multiworker` starts N
copies of ``python -m dpcourse.tf_multiworker_worker``, each training :class:`MultiWorkerConfig`'s
steps, and hands back every worker's weights and losses.

It imports no TensorFlow itself (the workers do), so it is apart from :mod:`dpcourse.mirrored`,
the in-process strategy, which re-exports every name here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dpcourse.launch import free_port


# --------------------------------------------------------------------------------------------
# MultiWorkerMirroredStrategy: N worker processes on this machine
# --------------------------------------------------------------------------------------------


@dataclass
class MultiWorkerConfig:
    """What each worker of :func:`run_multiworker` trains: the first ``steps`` global batches of
    shapes10 (``n_train`` images, ``seed``), plain SGD, starting from the weights in
    ``init_weights`` (an .npz in :func:`keras_weights_as_torch` order) or from ``seed``."""

    steps: int = 3
    global_batch: int = 64
    lr: float = 0.1
    n_train: int = 512
    seed: int = 0
    init_weights: str | None = None


@dataclass
class MultiWorkerResult:
    """Per worker: its final weights (torch layout), its step losses, and timings (seconds)."""

    weights: list[list[np.ndarray]]
    losses: list[list[float]]
    seconds: float
    worker_seconds: list[float] = field(default_factory=list)


class MultiWorkerError(RuntimeError):
    """A worker failed or the run ran out of time; the message carries the workers' output."""


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join(lines[-n:]) or "(no output)"


def kill_worker(proc: subprocess.Popen) -> None:
    """SIGKILL a worker of :func:`run_multiworker` with everything it started
    (:func:`dpcourse.launch.kill_tree`: its process group and every descendant), then reap it.
    A worker that is gone holds no port: the OS closes a dead process's sockets.

    Shown in lesson 05, §9.
    """
    from dpcourse.launch import kill_tree

    kill_tree(proc.pid)  # the worker's group and anything that left it
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_multiworker(config: MultiWorkerConfig | None = None, num_workers: int = 2,
                    timeout: float = 60.0) -> MultiWorkerResult:
    """Start ``num_workers`` processes of ``python -m dpcourse.tf_multiworker_worker``, each
    with a ``TF_CONFIG`` naming all workers (127.0.0.1 on free ports) and its own index, wait
    for all of them (at most ``timeout`` seconds), and return their results.

    Every worker runs in its own process group and is killed — with anything it started — when
    one fails, on timeout, on KeyboardInterrupt, and after success: nothing is left running and
    no port stays bound. A failure raises :class:`MultiWorkerError` with the workers' last lines.

    Shown in lesson 05, §9.
    """
    config = config or MultiWorkerConfig()
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if config.global_batch % num_workers:
        raise ValueError(f"global_batch {config.global_batch} does not split over "
                         f"{num_workers} workers")
    workdir = Path(tempfile.mkdtemp(prefix="dpcourse-mwms-"))
    ports = []
    while len(ports) < num_workers:  # distinct free ports (the OS might repeat one)
        p = free_port()
        if p not in ports:
            ports.append(p)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    (workdir / "config.json").write_text(json.dumps(asdict(config)))
    env_base = dict(os.environ)
    env_base.update(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
                    # each worker is one CPU device; keep them from fighting over the cores
                    OMP_NUM_THREADS="1")
    lib = str(Path(__file__).resolve().parents[1])
    env_base["PYTHONPATH"] = lib + os.pathsep + env_base.get("PYTHONPATH", "")
    procs: list[subprocess.Popen] = []
    logs = [workdir / f"worker{i}.log" for i in range(num_workers)]
    t0 = time.perf_counter()
    try:
        for i in range(num_workers):
            env = dict(env_base)
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dpcourse.tf_multiworker_worker", str(workdir)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))  # own process group: killpg gets its children too
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                time.sleep(0.5)  # let a partner report its own error too, then stop everyone
                raise MultiWorkerError(
                    f"worker {bad[0]} exited with code {codes[bad[0]]}:\n" + "\n".join(
                        f"--- worker {i} ---\n{_tail(logs[i])}" for i in range(num_workers)))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                pending = [i for i, c in enumerate(codes) if c is None]
                raise MultiWorkerError(
                    f"workers {pending} were not done after {timeout:g} s (killed):\n" + "\n".join(
                        f"--- worker {i} ---\n{_tail(logs[i])}" for i in range(num_workers)))
            time.sleep(0.1)
        seconds = time.perf_counter() - t0
        weights, losses, wsec = [], [], []
        for i in range(num_workers):
            out = json.loads((workdir / f"result{i}.json").read_text())
            with np.load(workdir / f"weights{i}.npz") as z:
                weights.append([z[f"w{k}"] for k in range(len(z.files))])
            losses.append(out["losses"])
            wsec.append(out["seconds"])
        return MultiWorkerResult(weights, losses, seconds, wsec)
    finally:
        for p in procs:
            kill_worker(p)
        shutil.rmtree(workdir, ignore_errors=True)
