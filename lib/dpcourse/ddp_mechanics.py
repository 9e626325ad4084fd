"""What DDP does besides averaging gradients (lesson 03, §"How DDP does it" and after): the
broadcast of rank 0's weights at construction and the bucketed all-reduce that starts during
the backward (:func:`ddp_internals_worker`), the bucket cap in bytes (:func:`bucket_limits`,
:func:`initial_bucket_limits`), the broadcast of rank 0's buffers before every forward
(:func:`buffer_sync_worker`), and DistributedSampler's shards (:func:`sampler_orders`).

Every function whose first two arguments are ``(rank, world_size)`` is a worker for
:func:`dpcourse.launch.spawn`. Every name is importable from :mod:`dpcourse.ddp` too.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import models as _models
from .ddp_setup import setup_rank
from .models import flat_params


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
