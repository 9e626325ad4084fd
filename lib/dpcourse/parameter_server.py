"""A parameter server over ``torch.distributed`` point-to-point messages (lesson 09, §1–2).

Rank 0 holds the weights; ranks 1..N pull them, compute a gradient and push it
(:func:`parameter_server_worker`), in lockstep first (it equals DDP) and then asynchronously
(the server applies each gradient as it arrives, whatever the weights it was computed on).
:class:`CountingLink` counts the bytes on the wire; :func:`straggler_race` times both modes for
the same wall-clock budget with one slow worker and records when each worker computes and
waits. The problem, the model and the batches are :mod:`dpcourse.async_sgd`'s.

Why point-to-point and not ``torch.distributed.rpc``: rpc (TensorPipe) runs on the pinned
torch 2.14.1 on CPU (tests/test_async_sgd.py starts it), and a real parameter server would use
it or a framework on top. But every message here is one flat tensor between two known ranks,
which ``dist.send`` / ``dist.recv`` say in one line each, with the bytes counted where they are
sent, on the same gloo groups as lessons 03-08; rpc's futures, remote references and
serialisation would hide the one thing this lesson counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .async_sgd import (batch_schedule, evaluate, loss_and_gradient, make_model, make_problem,
                        worker_indices)
from .models import flat_params

__all__ = ["CountingLink", "PSConfig", "ps_sync_server", "ps_sync_worker", "ps_async_server",
           "ps_async_worker", "parameter_server_worker", "RaceConfig", "race_server",
           "race_worker", "straggler_race"]


# --------------------------------------------------------------------------------------------
# 1. A parameter server over point-to-point messages
# --------------------------------------------------------------------------------------------


class CountingLink:
    """``dist.send`` / ``dist.recv`` that count the bytes this rank sends and receives.

    Shown in lesson 09, §1.
    """

    def __init__(self):
        self.sent = 0
        self.received = 0

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst)
        self.sent += tensor.numel() * tensor.element_size()

    def recv(self, tensor: torch.Tensor, src: int | None = None) -> int:
        """Receive into ``tensor`` from ``src`` (from whichever rank sends first if None);
        returns the sender's rank."""
        sender = dist.recv(tensor, src)
        self.received += tensor.numel() * tensor.element_size()
        return sender


@dataclass
class PSConfig:
    """The parameter server's run: its fields are what lesson 09's runs change.

    Shown in lesson 09, §1.
    """

    steps: int = 6            # updates per worker (async) or in all (sync)
    batch: int = 64           # global batch of the synchronous mode (each worker takes
    #                           batch // workers of it: at 3 workers one sample is left out)
    lr: float = 0.1
    n_train: int = 1024
    seed: int = 0
    slow_worker_delay: float = 0.002   # async: the last worker sleeps this long per gradient


def ps_sync_server(link: CountingLink, w: torch.Tensor, workers: int, cfg: PSConfig):
    """The synchronous server (rank 0): each step, send the weights to every worker, wait for
    every worker's gradient, and step once with their mean. Returns the final weights.

    Shown in lesson 09, §1.
    """
    for _ in range(cfg.steps):
        for worker in range(1, workers + 1):
            link.send(w, worker)                              # pull: the weights go out
        total = torch.zeros_like(w)
        for worker in range(1, workers + 1):                  # push: gradients come back
            g = torch.empty_like(w)
            link.recv(g, worker)
            total += g
        w -= cfg.lr * total / workers                         # one step with the mean gradient
    return w


def ps_sync_worker(link, model, problem, batches, rank, workers):
    """A synchronous worker (rank 1..N): per global batch, pull the weights, compute the
    gradient on its part of the batch (:func:`worker_indices`), push it.

    Shown in lesson 09, §1.
    """
    w = torch.empty_like(flat_params(model))
    for indices in batches:
        link.recv(w, 0)                                       # pull
        mine = worker_indices(indices, rank - 1, workers)
        _, g = loss_and_gradient(model, w, problem.x_train[mine], problem.y_train[mine])
        link.send(g, 0)                                       # push


def ps_async_server(link: CountingLink, w: torch.Tensor, workers: int, cfg: PSConfig):
    """Apply each gradient the moment it arrives; answer its sender with the new weights.
    A message is the flat vector plus one number: the version of the weights (pulls) or the
    version the gradient was computed on (pushes).

    Shown in lesson 09, §1.
    """
    version, staleness = 0, []
    message = torch.cat([w, torch.zeros(1)])
    for worker in range(1, workers + 1):
        link.send(message, worker)                            # everyone's first pull
    left = {worker: cfg.steps for worker in range(1, workers + 1)}
    for _ in range(workers * cfg.steps):
        pushed = torch.empty_like(message)
        sender = link.recv(pushed)                            # whoever is done first
        staleness.append(version - int(pushed[-1]))           # updates since its pull
        w -= cfg.lr * pushed[:-1]
        version += 1
        left[sender] -= 1
        if left[sender]:
            link.send(torch.cat([w, torch.tensor([float(version)])]), sender)
    return w, staleness


def ps_async_worker(link, model, problem, rank, workers, cfg: PSConfig):
    """An asynchronous worker (rank 1..N): ``cfg.steps`` times pull the weights and their
    version, compute a gradient on its own batch, push it with that version; the last worker
    sleeps ``cfg.slow_worker_delay`` per gradient (a straggler).

    Shown in lesson 09, §1.
    """
    n = len(flat_params(model))
    per_worker = cfg.batch // workers
    batches = batch_schedule(cfg.n_train, per_worker, cfg.steps, seed=cfg.seed + rank)
    message = torch.empty(n + 1)
    for indices in batches:
        link.recv(message, 0)                                 # pull weights + their version
        _, g = loss_and_gradient(model, message[:-1], problem.x_train[indices],
                                 problem.y_train[indices])
        if rank == workers:
            time.sleep(cfg.slow_worker_delay)                 # a straggler
        link.send(torch.cat([g, message[-1:]]), 0)            # push gradient + its version


def parameter_server_worker(rank: int, world_size: int, cfg: PSConfig) -> dict:
    """Rank 0 is the server, ranks 1..N the workers (N = world_size - 1). Runs, from the same
    start: the synchronous parameter server, torch DDP among the workers on the same shards of
    the same batches, then the asynchronous parameter server. Returns each rank's weights and
    the bytes it sent and received in each mode.

    Shown in lesson 09, §1.
    """
    torch.set_num_threads(1)
    workers = world_size - 1
    problem = make_problem(cfg.n_train, 256, seed=cfg.seed)
    model = make_model()
    w0 = flat_params(model)
    batches = batch_schedule(cfg.n_train, cfg.batch, cfg.steps, seed=cfg.seed)
    worker_group = dist.new_group(list(range(1, world_size)))   # every rank calls this (the default)
    out = {"numel": len(w0)}

    link = CountingLink()
    if rank == 0:
        out["sync"] = ps_sync_server(link, w0.clone(), workers, cfg)
    else:
        ps_sync_worker(link, model, problem, batches, rank, workers)
    out["sync_bytes"] = (link.sent, link.received)

    if rank > 0:                                             # the reference: DDP on 1..N
        ddp_model = make_model()
        ddp = nn.parallel.DistributedDataParallel(ddp_model, process_group=worker_group)
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
        for indices in batches:
            mine = worker_indices(indices, rank - 1, workers)
            opt.zero_grad()
            F.cross_entropy(ddp(problem.x_train[mine]), problem.y_train[mine]).backward()
            opt.step()
        out["ddp"] = flat_params(ddp_model)
    dist.barrier()

    link = CountingLink()
    if rank == 0:
        out["async"], out["staleness"] = ps_async_server(link, w0.clone(), workers, cfg)
        out["loss_before"] = evaluate(model, w0, problem.x_test, problem.y_test)[0]
        out["loss_after"] = evaluate(model, out["async"], problem.x_test, problem.y_test)[0]
    else:
        ps_async_worker(link, model, problem, rank, workers, cfg)
    out["async_bytes"] = (link.sent, link.received)
    return out


@dataclass
class RaceConfig:
    """The straggler race's settings: time budget, batch, learning rate, the slow worker's delay.

    Shown in lesson 09, §1.
    """

    budget: float = 0.6          # seconds each mode trains
    batch: int = 32              # per worker and gradient
    lr: float = 0.05
    straggler_delay: float = 0.02  # the last worker sleeps this long per gradient
    n_train: int = 1024
    seed: int = 0


_STOP = -1.0  # a message whose last number is this tells a worker to stop


def race_server(w, workers, cfg: RaceConfig, asynchronous: bool):
    """Train for ``cfg.budget`` seconds; each message is the weights plus their version (or
    _STOP). Synchronous: every round waits for every worker and steps with the mean.
    Asynchronous: each gradient is applied when it arrives and its sender alone gets the new
    weights. Returns the weights, the number of gradients applied, and their staleness.

    Shown in lesson 09, §1.
    """
    version, applied, staleness = 0, 0, []
    end = time.perf_counter() + cfg.budget
    message = lambda v: torch.cat([w, torch.tensor([float(v)])])  # noqa: E731
    pushed = torch.empty(len(w) + 1)
    if not asynchronous:
        while time.perf_counter() < end:
            for worker in range(1, workers + 1):
                dist.send(message(version), worker)
            total = torch.zeros_like(w)
            for worker in range(1, workers + 1):
                dist.recv(pushed, worker)
                total += pushed[:-1]
            w -= cfg.lr * total / workers
            version += 1
            applied += workers
        for worker in range(1, workers + 1):
            dist.send(message(_STOP), worker)
        return w, applied, staleness
    for worker in range(1, workers + 1):
        dist.send(message(version), worker)
    running = workers
    while running:
        sender = dist.recv(pushed)
        staleness.append(version - int(pushed[-1]))
        w -= cfg.lr * pushed[:-1]
        version += 1
        applied += 1
        if time.perf_counter() < end:
            dist.send(message(version), sender)
        else:
            dist.send(message(_STOP), sender)
            running -= 1
    return w, applied, staleness


def race_worker(model, problem, rank, workers, cfg: RaceConfig):
    """Pull, compute (the last worker then sleeps: a slower machine), push, until told to stop.
    Returns this worker's spans: ("compute" | "sleep" | "wait", start, end) in
    time.perf_counter(); "sleep" is the straggler's injected delay, apart from its computing.

    Shown in lesson 09, §1.
    """
    message = torch.empty(len(flat_params(model)) + 1)
    g = torch.Generator().manual_seed(cfg.seed + rank)
    spans = []
    t = time.perf_counter()
    while True:
        dist.recv(message, 0)                                   # the weights (or stop)
        got = time.perf_counter()
        spans.append(("wait", t, got))
        if message[-1] == _STOP:
            return spans
        mine = torch.randint(cfg.n_train, (cfg.batch,), generator=g)
        _, grad = loss_and_gradient(model, message[:-1], problem.x_train[mine],
                                    problem.y_train[mine])
        t = time.perf_counter()
        spans.append(("compute", got, t))
        if rank == workers:
            time.sleep(cfg.straggler_delay)                     # the straggler
            spans.append(("sleep", t, time.perf_counter()))
            t = spans[-1][2]                                    # the next wait starts here
        dist.send(torch.cat([grad, message[-1:]]), 0)


def straggler_race(rank: int, world_size: int, cfg: RaceConfig) -> dict:
    """Rank 0 serves, ranks 1..N compute, the last of them ``cfg.straggler_delay`` slower per
    gradient. The same budget of wall-clock time, first synchronous, then asynchronous. Every
    rank returns its spans per mode (workers) or the gradients applied, the staleness and the
    test loss per mode (the server); times are ``time.perf_counter()`` on this one machine.

    Shown in lesson 09, §1.
    """
    torch.set_num_threads(1)
    workers = world_size - 1
    problem = make_problem(cfg.n_train, 256, seed=cfg.seed)
    model = make_model(seed=cfg.seed)
    w0 = flat_params(model)
    out = {}
    for mode in ("sync", "async"):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            w, applied, stale = race_server(w0.clone(), workers, cfg, mode == "async")
            out[mode] = {"applied": applied, "staleness": stale,
                         "loss": evaluate(model, w, problem.x_test, problem.y_test)[0],
                         "seconds": time.perf_counter() - start}
        else:
            out[mode] = {"spans": [(kind, a - start, b - start)
                                   for kind, a, b in race_worker(model, problem, rank,
                                                                  workers, cfg)]}
    out["loss_before"] = evaluate(model, w0, problem.x_test, problem.y_test)[0]
    return out
