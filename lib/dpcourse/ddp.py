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

from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import data as _data, devices as _devices, models as _models
from .ddp_mechanics import (BNNet, bucket_limits, buffer_sync_worker, ddp_internals_worker,
                            initial_bucket_limits, sampler_orders, shard_overlap)
from .ddp_setup import (StepConfig, cpu_threads_per_rank, rank_device, setup_rank,
                        validate_world_size)
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
    "same_bits",
    "sum_then_divide_hook",
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


def ddp_worker(rank: int, world_size: int, cfg: StepConfig, comm_hook=None) -> dict:
    """The same experiment with ``DistributedDataParallel`` doing the averaging.

    Called here without ``comm_hook``; lesson 03's last section passes one and says there
    what it does.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg.per_rank_batch(world_size)
    dev = setup_rank()
    model = make_model(cfg).to(dev)
    ddp_model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if comm_hook is not None:
        ddp_model.register_comm_hook(None, comm_hook)
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
    """Run hand-averaged DP, DDP and the single process; return the largest differences, whether
    each way's ranks end with the same bits (:func:`same_bits`), and rank 0's first-step
    gradients of the two distributed ways.

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
        "ranks_bitwise_equal_manual": all(same_bits(manual[0]["params"], r["params"])
                                          for r in manual),
        "ranks_bitwise_equal_ddp": all(same_bits(wrapped[0]["params"], r["params"])
                                       for r in wrapped),
        "grads_manual": manual[0]["grads"],   # rank 0's first-step averaged gradients
        "grads_ddp": wrapped[0]["grads"],
        "config": asdict(cfg),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32 tensors hold the very same bits, element by element.

    ``torch.equal`` compares values: ``-0.0 == 0.0``, and a NaN is never equal, not even to
    itself. The int32 views of two float32 tensors are equal exactly when their bits are.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"same_bits compares float32 tensors, got {a.dtype} and {b.dtype}")
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def sum_then_divide_hook(state, bucket):
    """A DDP comm hook that averages a bucket the library's way: all_reduce the raw bucket
    (SUM), then divide it by the group's size, where DDP's own path scales each gradient by
    1/world_size as it copies it into the bucket and then sums.

    Run with :func:`ddp_worker`, it keeps DDP's bucket layout and changes only the order of
    the scaling, so lesson 03 can tell the two causes of a last-bit difference apart.

    Shown in lesson 03, §"The reducer's arithmetic".
    """
    world_size = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def divide(done):
        return done.value()[0].div_(world_size)

    return fut.then(divide)

