"""Data parallelism from first principles with torch.distributed (lesson 03, lab03).

Every function whose first two arguments are ``(rank, world_size)`` is a *worker*: run it on
every rank through :func:`dpcourse.launch.spawn`, with the backend from the hardware profile::

    from dpcourse import ddp, devices, launch
    prof = devices.choose_profile()
    launch.spawn(ddp.collectives_demo, prof.world_size, backend=prof.backend)

On the cpu profile that is gloo with 2 ranks on the CPU; with a GPU per rank it is nccl and
rank r works on cuda:r (``devices.device_for_rank``) — the same workers, nothing edited.

What lesson 03 proves with these workers:

* the four collectives (:func:`collectives_demo`);
* hand-averaged gradients (:func:`average_gradients`: all_reduce SUM, then divide in place)
  == DDP's gradients == one process on the global batch (:func:`compare_three`), and after many
  steps the weights are equal on every rank (:func:`manual_dp_worker` with many steps);
* how DDP works: the rank-0 weights broadcast at construction, gradient buckets reduced by a
  comm hook during the backward (:func:`ddp_internals_worker`);
* DDP's bucket cap in bytes and its first iteration's limits, from its own
  ``_BucketCapacityConfig`` (:func:`bucket_limits`, :func:`initial_bucket_limits`; the buckets
  themselves are lesson 07's);
* DDP broadcasts rank 0's buffers (BatchNorm statistics) before every forward
  (:func:`buffer_sync_worker`);
* DistributedSampler gives each rank a disjoint shard, and without ``set_epoch`` every epoch
  repeats the same order (:func:`sampler_orders`).
"""

from __future__ import annotations

import contextlib

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import data as _data
from . import devices as _devices
from . import models as _models
from .models import flat_params

__all__ = [
    "StepConfig",
    "validate_world_size",
    "rank_device",
    "setup_rank",
    "cpu_threads_per_rank",
    "collectives_demo",
    "average_gradients",
    "make_model",
    "global_batch_for_step",
    "shard_of",
    "manual_dp_worker",
    "ddp_worker",
    "single_process",
    "compare_three",
    "ddp_internals_worker",
    "bucket_limits",
    "initial_bucket_limits",
    "BNNet",
    "buffer_sync_worker",
    "sampler_orders",
    "flat_params",
    "shard_overlap",
]


# --------------------------------------------------------------------------------------------
# Configuration and bad input
# --------------------------------------------------------------------------------------------


@dataclass
class StepConfig:
    """One small data-parallel experiment: the same numbers for every rank and the reference.

    ``global_batch`` samples per step in total; each of the ``world_size`` ranks takes a
    contiguous ``global_batch // world_size`` of them (``per_rank_batch``).
    """

    global_batch: int = 32
    steps: int = 1
    lr: float = 0.05
    width: int = 8
    n_train: int = 512
    seed: int = 0
    data_seed: int = 0

    def per_rank_batch(self, world_size: int) -> int:
        if self.global_batch < world_size:
            raise ValueError(f"global_batch {self.global_batch} is smaller than world_size "
                             f"{world_size}: some rank would get no sample")
        if self.global_batch % world_size:
            raise ValueError(f"global_batch {self.global_batch} does not split over {world_size} "
                             f"ranks; use a multiple of {world_size}")
        return self.global_batch // world_size


def validate_world_size(world_size: int, backend: str) -> None:
    """One sentence instead of a hang or a CUDA error deep inside a rank."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("nccl needs one GPU per rank and this machine has no GPU; use "
                             "backend='gloo'")
        if world_size > gpus:
            raise ValueError(f"world_size {world_size} is larger than the {gpus} GPU(s) here: nccl "
                             f"needs one GPU per rank; use backend='gloo' or world_size <= {gpus}")
    elif backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def cpu_threads_per_rank(local_world_size: int, environ=None, cpu_count: int | None = None) -> int:
    """Intra-op threads for one of ``local_world_size`` CPU ranks on this machine: its share of
    the cores this process may use (its affinity: a pinned classroom seat's own cores), never
    more than ``OMP_NUM_THREADS`` when that is set to a positive number."""
    import os

    environ = os.environ if environ is None else environ
    share = max(1, (cpu_count or _devices.usable_cores()) // max(1, local_world_size))
    try:
        ceiling = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        ceiling = 0
    return min(share, ceiling) if ceiling > 0 else share


def rank_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under nccl, the CPU under gloo.

    It only reads (``LOCAL_RANK`` and the process group's backend) and changes nothing: the
    process-wide settings a rank needs are made by :func:`setup_rank`, which returns the same
    device.
    """
    import os

    return _devices.device_for_rank(int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())


def setup_rank(device: torch.device | None = None,
               local_world_size: int | None = None) -> torch.device:
    """Prepare this process to compute as one rank, and return its device.

    Call it once at the top of a worker, after the process group is up (``launch.spawn`` and
    torchrun set it up before the worker runs). ``device`` defaults to :func:`rank_device`,
    ``local_world_size`` to ``LOCAL_WORLD_SIZE`` or the group's size. It changes two
    process-wide settings:

    * on the CPU, the intra-op thread count becomes this rank's share of the cores
      (:func:`cpu_threads_per_rank`; torchrun does the same with OMP_NUM_THREADS=1): two ranks
      each running two intra-op threads on two cores fight over them, and measured here that
      made a step about ten times slower. A thread count the environment sets
      (``OMP_NUM_THREADS``, as an instructor does per learner on a shared server) is a ceiling
      this never raises;
    * on a GPU, TF32 is switched off for convolutions and matmuls: TF32 (on by default for
      cuDNN) rounds to ~1e-3, which would hide the float-tolerance equality lesson 03 proves
      against the CPU reference.
    """
    import os

    dev = rank_device() if device is None else torch.device(device)
    if dev.type == "cpu":
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return dev


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def collectives_demo(rank: int, world_size: int) -> dict:
    """broadcast, all_reduce, all_gather and reduce_scatter on small tensors; returns what this
    rank held after each (as lists).

    Shown in lesson 03, §"The four collectives".
    """
    dev = setup_rank()
    out = {}
    # broadcast: rank 0's tensor overwrites everyone's.
    t = torch.full((3,), float(rank + 1), device=dev) * (10 if rank == 0 else 1)
    dist.broadcast(t, src=0)
    out["broadcast"] = t.tolist()
    # all_reduce: everyone ends with the sum (in place).
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out["all_reduce"] = t.tolist()
    # all_gather: everyone ends with everyone's tensor, in rank order.
    mine = torch.tensor([float(rank)], device=dev)
    parts = [torch.zeros(1, device=dev) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    out["all_gather"] = [p.item() for p in parts]
    # reduce_scatter: sum the ranks' lists element-wise, rank r keeps chunk r of the sum.
    contributions = [torch.full((2,), float(10 * rank + j), device=dev) for j in range(world_size)]
    got = torch.zeros(2, device=dev)
    dist.reduce_scatter(got, contributions, op=dist.ReduceOp.SUM)
    out["reduce_scatter"] = got.tolist()
    return out


# --------------------------------------------------------------------------------------------
# The reference answer of lab03
# --------------------------------------------------------------------------------------------


def average_gradients(model: nn.Module) -> None:
    """Average every gradient over the ranks, in place: all_reduce SUM, then divide.

    Both steps act on ``p.grad`` itself. ``all_reduce`` writes the sum into the tensor it is
    given; the division must also write into it (``/=``, ``div_``) — ``g = g / world_size``
    makes a new tensor and leaves ``p.grad`` holding the sum.

    It assumes that every rank used every parameter in its forward, as lesson 03's model does:
    then a ``p.grad`` that is ``None`` is ``None`` on every rank (a frozen parameter), and
    skipping it skips the same tensors everywhere, so the ranks' ``all_reduce`` calls still
    pair up. When the ranks use different parameters (one rank's batch goes through a layer
    another rank's does not), that assumption fails: the ranks skip different tensors, so the
    calls pair the wrong tensors or hang. That is the case DDP's ``find_unused_parameters=True``
    is for (it marks the parameters that got no gradient ready to be reduced), and it is the
    case lab 03 part 1 asks for: its contract (every parameter that got a gradient on any rank
    ends with the mean on every rank) is one this function does not meet.

    Shown in lesson 03, §"Lab 03: average the gradients yourself".
    """
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


# --------------------------------------------------------------------------------------------
# The experiment: same model, same data, three ways
# --------------------------------------------------------------------------------------------


def make_model(cfg: StepConfig) -> nn.Module:
    """The same model in every process: reseeded, ``SmallCNN`` with its default ``dropout=0.0``.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    torch.manual_seed(cfg.seed)
    return _models.SmallCNN(width=cfg.width)


_DATA_CACHE: dict = {}


def _train_tensors(cfg: StepConfig):
    key = (cfg.n_train, cfg.data_seed)
    if key not in _DATA_CACHE:
        x, y = _data.make_shapes10(cfg.n_train, seed=cfg.data_seed)
        ds = _data.to_torch(x, y)
        _DATA_CACHE[key] = ds.tensors
    return _DATA_CACHE[key]


def global_batch_for_step(cfg: StepConfig, step: int):
    """The ``step``-th global batch (X, y): consecutive samples, wrapping around the data.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    X, y = _train_tensors(cfg)
    idx = (torch.arange(cfg.global_batch) + step * cfg.global_batch) % len(y)
    return X[idx], y[idx]


def shard_of(X: torch.Tensor, y: torch.Tensor, rank: int, world_size: int):
    """Rank ``rank``'s contiguous share of a global batch.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    n = X.shape[0] // world_size
    return X[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).cpu() for p in model.parameters()])


def manual_dp_worker(rank: int, world_size: int, cfg: StepConfig, average_fn=None) -> dict:
    """Data parallelism without DDP: broadcast the weights, then per step: local forward and
    backward, ``average_fn(model)`` (default :func:`average_gradients`), SGD step.

    Returns this rank's first-step averaged gradients and its final weights (flat CPU tensors).

    Shown in lesson 03, §"Lab 03: average the gradients yourself".
    """
    average_fn = average_fn or average_gradients
    cfg.per_rank_batch(world_size)
    dev = setup_rank()
    model = make_model(cfg).to(dev)
    # Start from rank 0's weights, as DDP does (here they are equal anyway: same seed).
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    first_grads = None
    for step in range(cfg.steps):
        X, y = shard_of(*global_batch_for_step(cfg, step), rank, world_size)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X.to(dev)), y.to(dev))
        loss.backward()
        average_fn(model)
        if first_grads is None:
            first_grads = _flat_grads(model)
        opt.step()
    return {"grads": first_grads, "params": flat_params(model)}


def ddp_worker(rank: int, world_size: int, cfg: StepConfig) -> dict:
    """The same experiment with ``DistributedDataParallel`` doing the averaging.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg.per_rank_batch(world_size)
    dev = setup_rank()
    model = make_model(cfg).to(dev)
    ddp_model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg.lr)
    first_grads = None
    for step in range(cfg.steps):
        X, y = shard_of(*global_batch_for_step(cfg, step), rank, world_size)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp_model(X.to(dev)), y.to(dev))
        loss.backward()  # DDP's hooks have averaged the gradients over the ranks by now
        if first_grads is None:
            first_grads = _flat_grads(model)
        opt.step()
    return {"grads": first_grads, "params": flat_params(model)}


def single_process(cfg: StepConfig, device: str = "cpu") -> dict:
    """The reference: one process, the whole global batch, no communication.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    model = make_model(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    first_grads = None
    for step in range(cfg.steps):
        X, y = global_batch_for_step(cfg, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(X.to(device)), y.to(device)).backward()
        if first_grads is None:
            first_grads = _flat_grads(model)
        opt.step()
    return {"grads": first_grads, "params": flat_params(model)}


def compare_three(cfg: StepConfig, world_size: int | None = None, backend: str | None = None,
                  timeout: float = 120.0) -> dict:
    """Run hand-averaged DP, DDP and the single process; return the largest differences.

    ``world_size`` / ``backend`` default to the hardware profile's.

    Shown in lesson 03, §"Lab 03: average the gradients yourself".
    """
    from . import launch

    prof = _devices.choose_profile(world_size=world_size)
    world_size = world_size or prof.world_size
    backend = backend or _devices.backend_for(world_size)
    validate_world_size(world_size, backend)
    cfg.per_rank_batch(world_size)
    manual = launch.spawn(manual_dp_worker, world_size, cfg, backend=backend, timeout=timeout)
    wrapped = launch.spawn(ddp_worker, world_size, cfg, backend=backend, timeout=timeout)
    single = single_process(cfg)

    def diff(a, b):
        return float((a - b).abs().max())

    return {
        "world_size": world_size,
        "backend": backend,
        "grad_manual_vs_single": max(diff(r["grads"], single["grads"]) for r in manual),
        "grad_ddp_vs_single": max(diff(r["grads"], single["grads"]) for r in wrapped),
        "grad_manual_vs_ddp": max(diff(m["grads"], d["grads"]) for m, d in zip(manual, wrapped)),
        "params_manual_vs_single": max(diff(r["params"], single["params"]) for r in manual),
        "params_ddp_vs_single": max(diff(r["params"], single["params"]) for r in wrapped),
        "ranks_bitwise_equal_manual": all(torch.equal(manual[0]["params"], r["params"])
                                          for r in manual),
        "ranks_bitwise_equal_ddp": all(torch.equal(wrapped[0]["params"], r["params"])
                                       for r in wrapped),
        "config": asdict(cfg),
    }


# --------------------------------------------------------------------------------------------
# Inside DDP: initial broadcast, buckets, all_reduce during the backward
# --------------------------------------------------------------------------------------------


def ddp_internals_worker(rank: int, world_size: int, bucket_cap_mb: float = 25.0,
                         width: int = 32, iterations: int = 2) -> dict:
    """Evidence of what DDP does, gathered on each rank.

    * every rank builds its model from a *different* seed; after ``DDP(model)`` the weights are
      equal on all ranks (DDP broadcast rank 0's);
    * a comm hook records each bucket it is asked to all-reduce (the parameter names), and a
      gradient hook on the *first* layer's weight — whose gradient is the last one the backward
      computes — records when the backward is nearly over. An all-reduce recorded before that
      event was started while the backward was still running.

    Returns, per iteration, the list of events, plus the weight check.

    Shown in lesson 03, §"How DDP does it".
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = setup_rank()
    torch.manual_seed(100 + rank)  # deliberately different weights on each rank
    model = _models.SmallCNN(width=width).to(dev)
    before = flat_params(model)
    ddp_model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                    bucket_cap_mb=bucket_cap_mb)
    after = flat_params(model)
    mine = after.to(dev)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    names = {p: n for n, p in model.named_parameters()}
    events: list = []

    def recording_allreduce(state, bucket):
        events.append(("all_reduce", [names[p] for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(None, bucket)

    ddp_model.register_comm_hook(None, recording_allreduce)
    model.features[0].weight.register_hook(lambda g: events.append(("first_layer_grad", [])))
    per_iteration = []
    torch.manual_seed(rank)
    for _ in range(iterations):
        events.clear()
        X = torch.randn(8, 3, 32, 32, device=dev)
        ddp_model(X).square().mean().backward()
        per_iteration.append(list(events))
    return {
        "changed_by_ddp": not torch.equal(before, after),
        "equal_on_all_ranks": all(torch.equal(gathered[0].cpu(), g.cpu()) for g in gathered),
        "iterations": per_iteration,
    }


# --------------------------------------------------------------------------------------------
# Inside DDP: the bucket cap in bytes (the buckets themselves are lesson 07's)
# --------------------------------------------------------------------------------------------


def bucket_limits(bucket_cap_mb: float | None) -> tuple[int, int]:
    """``(first_bucket_bytes, bucket_bytes)`` as DDP computes them from ``bucket_cap_mb``.

    Asks DDP's own ``_BucketCapacityConfig`` (torch/nn/parallel/distributed.py): the cap is in
    MiB (``int(bucket_cap_mb * 1024 * 1024)`` bytes); left at ``None`` it is 25 MiB and the
    first bucket's limit is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), otherwise the first
    bucket has the same limit as the others.

    Shown in lesson 03, §"How DDP does it".
    """
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    cfg = _BucketCapacityConfig.create(bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=None,
                                       use_python_reducer=False)
    return cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap


def initial_bucket_limits(bucket_cap_mb: float | None = None,
                          bucket_cap_mb_list: list[float] | None = None, *,
                          static_graph: bool = False,
                          find_unused_parameters: bool = False) -> list[int]:
    """The byte limits DDP builds its buckets of iteration 0 with, for these constructor
    arguments: asks ``_BucketCapacityConfig.compute_bucket_size_limits``. ``[sys.maxsize]``
    means one bucket for everything.

    Shown in lesson 03, §"How DDP does it".
    """
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    cfg = _BucketCapacityConfig.create(bucket_cap_mb=bucket_cap_mb,
                                       bucket_cap_mb_list=bucket_cap_mb_list,
                                       use_python_reducer=False)
    first_iteration, _ = cfg.compute_bucket_size_limits(static_graph, find_unused_parameters)
    return first_iteration


class BNNet(nn.Module):
    """A tiny CNN with one BatchNorm layer: its running statistics are *buffers* (state that is
    not a parameter, so no gradient is averaged for it).

    Shown in lesson 03, §"How DDP does it".
    """

    def __init__(self, width: int = 8, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


def buffer_sync_worker(rank: int, world_size: int, steps: int = 3, batch: int = 8,
                       seed: int = 0) -> dict:
    """Train :class:`BNNet` under DDP for ``steps`` steps, once with ``forward_sync_buffers=True``
    (the default) and once with ``False``; each rank reads its own data.

    Returns, per setting: the BatchNorm ``running_mean`` each forward *started* with (recorded
    by a forward pre-hook on the BatchNorm layer, which runs after DDP's own pre-forward work),
    the one this rank holds after training, its final weights, and the eval-mode output (under
    ``torch.no_grad()``) for one input that is the same on every rank. Then, in training mode,
    a forward under ``no_grad``, a step, a backward under ``no_sync()`` and two steps:
    ``later`` holds ``(the forward it follows, the running mean it started with)`` for those
    five forwards.

    Shown in lesson 03, §"How DDP does it".
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for sync in (True, False):
        torch.manual_seed(seed)
        model = BNNet()
        ddp_model = DDP(model, forward_sync_buffers=sync)
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        seen = []
        model.bn.register_forward_pre_hook(
            lambda mod, inp: seen.append(mod.running_mean.detach().clone()))
        g = torch.Generator().manual_seed(1000 * (seed + 1) + rank)   # each rank its own data
        for _ in range(steps):
            X = torch.randn(batch, 3, 16, 16, generator=g) * (1 + rank)
            y = torch.randint(0, 10, (batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp_model(X), y).backward()
            opt.step()
        final_mean = model.bn.running_mean.detach().clone()
        final_params = flat_params(model)
        ddp_model.eval()
        with torch.no_grad():
            same_input = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))
            eval_out = ddp_model(same_input)
        ddp_model.train()
        later = []   # the forwards below, each labelled with the forward it follows

        def step(no_grad=False, no_sync=False):
            X = torch.randn(batch, 3, 16, 16, generator=g) * (1 + rank)
            y = torch.randint(0, 10, (batch,), generator=g)
            if no_grad:                    # a training-mode forward without a graph
                with torch.no_grad():
                    ddp_model(X)
                return
            with ddp_model.no_sync() if no_sync else contextlib.nullcontext():
                F.cross_entropy(ddp_model(X), y).backward()
            if not no_sync:
                opt.step()
                opt.zero_grad(set_to_none=True)

        opt.zero_grad(set_to_none=True)
        for follows, kwargs in (("the eval forward", {"no_grad": True}),
                                ("a no-grad forward", {}),
                                ("a training forward", {"no_sync": True}),
                                ("a no_sync forward", {}),
                                ("a training forward", {})):
            n_seen = len(seen)
            step(**kwargs)
            later.append((follows, seen[n_seen]))
        out[sync] = {"seen": seen[:steps + 1], "later": later,
                     "final_running_mean": final_mean, "params": final_params,
                     "eval_out": eval_out}
        del ddp_model
    return out


# --------------------------------------------------------------------------------------------
# DistributedSampler
# --------------------------------------------------------------------------------------------


def sampler_orders(n: int, world_size: int, epochs: int = 2, set_epoch: bool = True,
                   seed: int = 0) -> list[list[list[int]]]:
    """``orders[epoch][rank]``: the indices ``DistributedSampler`` hands rank ``rank``.

    No process group is needed: the sampler takes ``num_replicas`` and ``rank`` explicitly, and
    each rank computes its shard by itself from (seed, epoch) — the ranks agree without talking,
    which is why they must all call ``set_epoch`` with the same epoch.

    Shown in lesson 03, §"DistributedSampler and `set_epoch`".
    """
    from torch.utils.data import DistributedSampler

    if world_size < 1 or n < 1:
        raise ValueError(f"need n >= 1 and world_size >= 1, got n={n}, world_size={world_size}")
    dataset = range(n)  # only its length matters
    samplers = [DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True,
                                   seed=seed) for r in range(world_size)]
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(epoch)
        orders.append([list(iter(s)) for s in samplers])
    return orders


def shard_overlap(orders_for_epoch: list[list[int]]) -> int:
    """How many indices appear in more than one rank's shard (0 when n splits evenly).

    Shown in lesson 03, §"DistributedSampler and `set_epoch`".
    """
    seen = np.concatenate([np.asarray(o) for o in orders_for_epoch])
    return int(len(seen) - len(np.unique(seen)))
