"""Why ``nn.DataParallel`` is slow, measured (lesson 02, §"Why it is slow").

:mod:`dpcourse.dp` builds DataParallel's step from scratch; this module times what that step
pays on this machine: replicating the module every step against the forward it serves
(:func:`time_replicate_vs_forward`, torch's own ``replicate`` beside ours), threads that share
one GIL (:func:`python_work`, :func:`gil_threads_demo`), and whether a torch kernel lets go of
the GIL while it runs (:func:`kernel_gil_probe`). Timings depend on the machine and its load:
the lesson shows them and asserts only what holds with a margin anywhere.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from dpcourse.dp import Broadcast, _as_devices, replicate, scatter

__all__ = [
    "time_replicate_vs_forward",
    "python_work",
    "gil_threads_demo",
    "kernel_gil_probe",
]


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_replicate_vs_forward(module: nn.Module, X: torch.Tensor, devices,
                              repeats: int = 5) -> dict:
    """Seconds (best of ``repeats``) for one :func:`replicate`, for one call of torch's own
    ``torch.nn.parallel.replicate`` onto as many devices, and for one forward of a chunk, all
    three with grad mode on, as in a training step.

    Replication is paid again every step; the lesson shows how it compares with the work it
    serves: the forward timed is the module's own on chunk 0 (replica 0's share), recording its
    autograd graph. Torch's ``replicate`` is called as ``DataParallel.replicate`` calls it in a
    training step, ``detach=False``: its parameters go through the differentiable
    ``torch.nn.parallel._functions.Broadcast``, which refuses CPU tensors; here that class is
    replaced, for the timing, by our :class:`Broadcast` (one clone of the weights per device
    after the first), and
    ``comm.broadcast_coalesced`` (its buffers') by clones too, so what is timed is torch's
    Python replication plus the same copies ours makes.
    Timings depend on the machine, so show them but assert nothing about their size.

    Shown in lesson 02, §"Why it is slow".
    """
    import importlib
    from types import SimpleNamespace
    from unittest import mock

    from torch.nn.parallel import _functions, comm
    # the module (torch.nn.parallel's own name `replicate` is the function)
    torch_replicate_module = importlib.import_module("torch.nn.parallel.replicate")

    def broadcast_by_clones(tensors, devices, buffer_size=None):   # CPU stand-in (buffers)
        return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]

    devs = _as_devices(devices)
    # CPU stand-in for torch's differentiable Broadcast: ours, on our devices, not GPU indexes
    differentiable_by_clones = SimpleNamespace(
        apply=lambda target, *tensors: Broadcast.apply(devs[:len(target)], *tensors))
    chunk = scatter(X, devs)[0]
    with torch.enable_grad():  # a training step: grad mode on for all three
        module(chunk)  # warm-up
        t_fwd = _best_of(lambda: module(chunk), repeats)
        t_rep = _best_of(lambda: replicate(module, devs), repeats)
        with mock.patch.object(comm, "broadcast_coalesced", broadcast_by_clones), \
                mock.patch.object(_functions, "Broadcast", differentiable_by_clones):
            t_torch = _best_of(lambda: torch_replicate_module.replicate(
                module, list(range(len(devs))), detach=False), repeats)
    return {"replicate_s": t_rep, "torch_replicate_s": t_torch, "forward_chunk_s": t_fwd,
            "ratio": t_rep / t_fwd}


def python_work(n: int) -> int:
    """One unit of pure-Python work: bytecode only, no call that releases the GIL, so a thread
    running it holds the GIL the whole time (but for the interpreter's forced switches).

    Shown in lesson 02, §"Why it is slow".
    """
    total = 0
    for k in range(n):
        total += k * k % 7
    return total


def gil_threads_demo(n: int = 300_000, threads: int = 2, rounds: int = 7) -> dict:
    """Time ``threads`` units of pure-Python work done one after another vs in ``threads``
    threads (``rounds`` interleaved rounds, the best of each way), and measure the CPU time the
    process used per second of each way's wall time (all rounds pooled).

    ``cpu_per_wall`` (threaded) is the load-proof sign of the GIL: threads that take turns use at
    most about one core's worth of CPU per wall second, truly parallel ones up to ``threads``.
    ``seq_cpu_per_wall`` is how much of a core the one-after-another runs got: a busy machine
    lowers both, and when the two differ the wall-clock ``speedup`` shows the load, not
    parallelism.

    Shown in lesson 02, §"Why it is slow".
    """
    if threads < 2:
        raise ValueError("the demo needs at least 2 threads")
    python_work(n // 10)  # warm-up

    def sequential():
        for _ in range(threads):
            python_work(n)

    def threaded():
        ts = [threading.Thread(target=python_work, args=(n,)) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    # Interleaved rounds, best of each: a slow moment of a loaded machine hits both ways alike
    # (timing all the sequential runs first once let a busy spell fake a 1.9x "speed-up").
    wall = {sequential: [], threaded: []}
    cpu = {sequential: 0.0, threaded: 0.0}
    for _ in range(rounds):
        for run in (sequential, threaded):
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            wall[run].append(time.perf_counter() - t0)
            cpu[run] += time.process_time() - c0  # every thread of the process counts
    t_seq, t_thr = min(wall[sequential]), min(wall[threaded])
    return {"sequential_s": t_seq, "threaded_s": t_thr, "speedup": t_seq / t_thr,
            "cpu_per_wall": cpu[threaded] / sum(wall[threaded]),
            "seq_cpu_per_wall": cpu[sequential] / sum(wall[sequential]), "threads": threads}


def kernel_gil_probe(size: int = 1536, tries: int = 3) -> dict:
    """Does a torch kernel release the GIL? While a second thread runs one long kernel (a
    ``size`` x ``size`` matrix product), this thread keeps reading the clock in pure Python,
    which needs the GIL. A kernel that held the GIL would stop those reads for its whole
    duration; one that releases it leaves only the operating system's scheduling gaps, however
    few and busy the cores. Returns the kernel's time and the longest gap between two reads
    during it (seconds), from the try whose gap was the smallest share of its kernel's time.

    Shown in lesson 02, §"Why it is slow".
    """
    a = torch.randn(size, size)
    best = None
    for _ in range(tries):
        span = []

        def kernel():
            t0 = time.perf_counter()
            torch.mm(a, a)                      # one call: one kernel, no Python inside
            span.extend((t0, time.perf_counter()))

        gaps = []                               # (previous read, next read) > 1 ms apart
        worker = threading.Thread(target=kernel)
        last = time.perf_counter()
        worker.start()
        while not span:                         # pure Python: runs only while it holds the GIL
            now = time.perf_counter()
            if now - last > 1e-3:
                gaps.append((last, now))
            last = now
        worker.join()
        t0, t1 = span
        longest = max([min(b, t1) - max(p, t0) for p, b in gaps] + [0.0])
        if best is None or longest / (t1 - t0) < best["longest_gap_s"] / best["kernel_s"]:
            best = {"kernel_s": t1 - t0, "longest_gap_s": longest}
    return best


