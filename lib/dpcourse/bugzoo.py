"""The bug zoo of lesson 10: small distributed programs, each broken in one classic way, each
with its fix (``fixed=True``). Every worker runs under ``launch.spawn`` (gloo, CPU) and keeps
its bug to a line or two, marked ``# BUG`` and ``# FIX``.

The programs that hang (:func:`partial_collective`, :func:`collective_order`,
:func:`early_stop`) are run by ``detectors.diagnose`` with a short time limit. The others
finish, so :func:`zoo_worker` runs all of them, broken and fixed, in one launch and returns
what their detectors need.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dpcourse import detectors

__all__ = [
    "partial_collective", "collective_order", "early_stop", "resume_on_one_rank",
    "averaged_loss", "averaged_loss_differentiable", "batchnorm_stats", "batchnorm_ddp", "nan_on_one_rank", "forgotten_set_epoch",
    "same_checkpoint", "unused_parameter", "port_in_use", "zoo_worker", "TwoHeads",
    "average_gradients", "small_batches", "mlp", "checksum_collision",
]


def average_gradients(model) -> None:
    """Lesson 03's hand-made DDP: the mean of every gradient over the ranks.

    Shown in lesson 10, §3.
    """
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def small_batches(rank: int, steps: int, n: int = 8, d: int = 4):
    """Each rank's own batches (different per rank, the same on every run): ``steps`` pairs of
    ``n`` inputs of ``d`` features and a target ``sin(sum of the features)`` plus a little
    noise.

    Shown in lesson 10, §3.
    """
    g = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(n, d, generator=g) for _ in range(steps)]
    return [(x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g)) for x in xs]


# ---- programs that hang ---------------------------------------------------------------------


def partial_collective(rank, world_size, fixed=False):
    """Rank 0 all-reduces the loss to log it; the other ranks never call that all_reduce.

    Shown in lesson 10, §2.
    """
    loss = torch.tensor([float(rank + 1)])
    if fixed or rank == 0:  # BUG: `if rank == 0:` around a collective. FIX: every rank calls it
        dist.all_reduce(loss)
    if rank == 0:
        return loss.item() / world_size
    return None


def collective_order(rank, world_size, fixed=False):
    """Two collectives, issued in a different order on rank 0 than on the others.

    Shown in lesson 10, §2.
    """
    grads, stats = torch.ones(4), torch.full((2,), float(rank))
    if rank == 0 or fixed:
        dist.all_reduce(grads)
        dist.broadcast(stats, src=0)
    else:  # BUG: the other ranks broadcast first. FIX: the same order everywhere
        dist.broadcast(stats, src=0)
        dist.all_reduce(grads)
    return grads.tolist()


def early_stop(rank, world_size, fixed=False, patience_loss=0.5, steps=5):
    """Each rank stops when *its own* loss is low enough: the ranks leave the loop at different
    steps, and the one still training waits for the others in its next all_reduce.

    Shown in lesson 10, §2.
    """
    for step in range(steps):
        local_loss = torch.tensor([(world_size - rank) / (step + 1)])  # the last rank's falls first
        grad = torch.ones(3)
        dist.all_reduce(grad)
        if fixed:  # FIX: decide together, on the all-reduced loss
            dist.all_reduce(local_loss)
            local_loss /= world_size
        if local_loss.item() < patience_loss:  # BUG (without FIX): a per-rank decision
            return step
    return steps


# ---- programs that finish but are wrong -----------------------------------------------------


def mlp(seed=None):
    """The zoo's model, 4 → 8 → 1 with a tanh; ``seed`` seeds torch's global generator first.

    Shown in lesson 10, §3.
    """
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def resume_on_one_rank(rank, world_size, fixed=False, directory=".", steps=6):
    """Resumes an earlier run: rank 0 loads the checkpoint, after DDP has wrapped the model.
    DDP makes the replicas equal once, in its constructor, and never compares them again; the
    load comes later, so rank 0 trains from the checkpoint and the others from fresh weights.
    Returns the weights' checksums at the start and after each step.

    Shown in lesson 10, §3.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    path = os.path.join(directory, "earlier_run.pt")
    if rank == 0:  # the earlier run's checkpoint (other weights than a fresh model's)
        torch.save(mlp(seed=1).state_dict(), path)
    dist.barrier()
    model = mlp(seed=0)
    ddp = DDP(model)
    if fixed or rank == 0:  # BUG: `if rank == 0:` (one rank resumes). FIX: every rank loads it
        model.load_state_dict(torch.load(path))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sums = [detectors.state_checksums(model)]
    for x, y in small_batches(rank, steps):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sums.append(detectors.state_checksums(model))
    return sums


def averaged_loss(rank, world_size, fixed=False, steps=6):
    """All-reduces the *loss* and backpropagates it, believing that averages the gradients. A
    rank's weights enter the mean only through its own loss: its gradient is its own / N.
    Broken, it also returns torch's warning and, per step, the largest difference between the
    gradient backward produced and this rank's own gradient / N (computed beforehand).

    Shown in lesson 10, §3.
    """
    import warnings

    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sums, grads, logged = [detectors.state_checksums(model)], [], []
    own_over_n, warned = [], []
    for x, y in small_batches(rank, steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if fixed:
            loss.backward()
            average_gradients(model)  # FIX: average the gradients
            logged.append(loss.item())
        else:
            own = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            with warnings.catch_warnings(record=True) as caught:  # kept for the lesson to print
                warnings.simplefilter("always")
                dist.all_reduce(loss)  # BUG: the loss is averaged, not the gradients
                loss = loss / world_size
                loss.backward()
            warned += [str(w.message) for w in caught if "autograd kernel" in str(w.message)]
            own_over_n.append(max(float((p.grad - o / world_size).abs().max())
                                  for p, o in zip(model.parameters(), own)))
            logged.append(loss.item())
        grads.append(detectors.state_checksums(model, grads=True))
        opt.step()
        sums.append(detectors.state_checksums(model))
    return {"weights": sums, "grads": grads, "logged_loss": logged,
            "grad_minus_own_over_n": own_over_n, "warnings": warned[:1]}


def averaged_loss_differentiable(rank, world_size, steps=2):
    """Bug 5 with torch's differentiable all-reduce (``torch.distributed.nn.functional``), whose
    backward all-reduces each rank's incoming 1/N into 1: the gradient is the rank's own, N
    times :func:`averaged_loss`'s, and still nothing of the others'. Returns, per step, the
    largest difference from this rank's own gradient (computed beforehand), and the weights'
    checksums at the start and after each step.

    Shown in lesson 10, §3.
    """
    import warnings

    from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gaps, sums = [], [detectors.state_checksums(model)]
    for x, y in small_batches(rank, steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        own = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        with warnings.catch_warnings():  # torch deprecates it for _functional_collectives
            warnings.simplefilter("ignore", FutureWarning)
            (differentiable_all_reduce(loss) / world_size).backward()  # BUG: still the loss
        gaps.append(max(float((p.grad - o).abs().max()) for p, o in zip(model.parameters(), own)))
        opt.step()
        sums.append(detectors.state_checksums(model))
    return {"grad_minus_own": gaps, "weights": sums}


def batchnorm_ddp(rank, world_size, steps=6):
    """The BatchNorm model of :func:`batchnorm_stats` under DDP, whose ``forward_sync_buffers``
    (default True) broadcasts rank 0's buffers at the start of a forward when the forward
    before it ran with gradients enabled outside ``no_sync()`` (and at the first one) — every
    forward of this loop; BatchNorm then updates them from this rank's batch. Returns the
    checksums after the last step.

    Shown in lesson 10, §3.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in small_batches(rank, steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return detectors.state_checksums(model.module)


def batchnorm_stats(rank, world_size, fixed=False, steps=6):
    """A BatchNorm layer: gradients are averaged, but each rank's running mean and variance come
    from its own batches only. Checkpoints and evaluation then depend on the rank.

    Shown in lesson 10, §3.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in small_batches(rank, steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        average_gradients(model)
        opt.step()
        if fixed:  # FIX: average the running statistics too (SyncBatchNorm on GPUs does more:
            # it normalizes with the global batch's statistics)
            for name, buf in model.named_buffers():
                if buf.is_floating_point():
                    dist.all_reduce(buf)
                    buf /= world_size
    return detectors.state_checksums(model)


def all_ranks_finite(value: float, device="cpu") -> bool:
    """True on every rank when every rank's ``value`` is finite, else False on every rank: the
    one verdict :func:`nan_on_one_rank`'s fix needs (lab 10's stretch combines its verdicts
    the same way, which is why the lesson shows it folded, after the lab pointer). ``device``
    is where the verdict travels: the parameters' device, since NCCL takes CUDA tensors only.

    Shown in lesson 10, §"Lab 10".
    """
    flag = torch.tensor([float(math.isfinite(value))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # one rank's 0 makes every rank's 0
    return flag.item() == 1.0


def checksum_collision() -> tuple[bool, list[str]]:
    """What a checksum misses, run (lab 10's stretch: its hint 2's idea, which is why the lesson
    shows it folded, after the lab pointer): two ``Linear(4, 1)`` layers whose weights differ,
    +2δ at position 1 and −δ at position 2 (δ = 2⁻⁹, a power of two, so every sum is exact in
    floating point), and whose :func:`detectors.state_checksums` are equal. Returns (whether the
    weights are equal, what :func:`detectors.compare_checksums` finds).

    Shown in lesson 10, §"Lab 10".
    """
    a = nn.Linear(4, 1, bias=False)
    b = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[0.25, 0.5, 0.75, 1.0]]))
        b.weight.copy_(a.weight)
        b.weight[0, 0] += 2 * 2.0 ** -9
        b.weight[0, 1] -= 2.0 ** -9
    return (torch.equal(a.weight, b.weight),
            detectors.compare_checksums([detectors.state_checksums(a),
                                         detectors.state_checksums(b)]))


def nan_on_one_rank(rank, world_size, fixed=False, steps=8, bad_step=3, bad_rank=1):
    """One corrupted sample (an inf) reaches rank ``bad_rank`` at step ``bad_step``; its
    gradient is NaN (its loss need not be: tanh turns inf into 1), and the all-reduce hands the
    NaN to every rank.

    Shown in lesson 10, §3.
    """
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local, after, losses = [], [], []
    held_out = small_batches(99, 1, n=64)[0]
    for step, (x, y) in enumerate(small_batches(rank, steps)):
        if rank == bad_rank and step == bad_step:
            x[0, 0] = math.inf  # the corrupted sample
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())  # this rank's own loss (finite even with the inf: tanh)
        loss.backward()
        # what this rank computed, before any all_reduce: its gradient norm
        local.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        if fixed:  # FIX: agree on whether every rank's gradients are finite; if not, all skip
            step_ok = all_ranks_finite(local[-1], device=next(model.parameters()).device)
        average_gradients(model)  # BUG (without FIX): a NaN on one rank spreads to all
        if not fixed or step_ok:
            opt.step()
        with torch.no_grad():  # the loss on a held-out batch
            after.append(nn.functional.mse_loss(model(held_out[0]), held_out[1]).item())
    return {"local_grad_norm": local, "eval_loss": after, "local_loss": losses}


def forgotten_set_epoch(rank, world_size, fixed=False, epochs=3, n=16):
    """A shuffling DistributedSampler that is never told the epoch: every epoch deals the same
    order, so the "shuffle" shuffles once.

    Shown in lesson 10, §3.
    """
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    orders = []
    for epoch in range(epochs):
        if fixed:
            sampler.set_epoch(epoch)  # FIX (BUG: this line missing)
        orders.append(list(sampler))
    return orders


def same_checkpoint(rank, world_size, fixed=False, directory="."):
    """Every rank saves "the" checkpoint to the same path: N writers on one file. ``torch.save``
    writes the file in place (no temporary file, no rename), so the writes can interleave.

    Shown in lesson 10, §3.
    """
    records: list = []
    model = mlp(seed=0)
    with detectors.record_saves(rank, records):
        if not fixed or rank == 0:  # BUG: every rank saves. FIX: rank 0 saves ...
            torch.save(model.state_dict(), os.path.join(directory, "checkpoint.pt"))
        dist.barrier()  # ... and the others wait until the file is complete
    return records


class TwoHeads(nn.Module):
    """A body and two heads, of which forward uses only ``head_a``.

    Shown in lesson 10, §3.
    """

    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.head_a(self.body(x))


def unused_parameter(rank, world_size, fixed=False, debug="OFF"):
    """DDP around a model with a parameter that no forward uses: the second iteration fails.
    Returns "ok" or DDP's whole error message; ``debug`` is the TORCH_DISTRIBUTED_DEBUG level
    in force while DDP is built and run ("OFF", "INFO" or "DETAIL").

    Shown in lesson 10, §3.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    before = dist.get_debug_level()
    dist.set_debug_level(getattr(dist.DebugLevel, debug))
    try:
        model = DDP(TwoHeads(), find_unused_parameters=fixed)  # FIX: find_unused_parameters=True
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        return "ok"
    except RuntimeError as e:
        return str(e)
    finally:
        dist.set_debug_level(before)


def unused_first_step(rank, world_size, fixed=False):
    """Bug 9's first step alone (``fixed``: with ``find_unused_parameters``): each rank's
    gradient checksums after the FIRST backward, each rank on its own batch.

    Shown in lesson 10, §3.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=fixed)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))  # this rank's batch
    model(x).sum().backward()
    return detectors.state_checksums(model.module, grads=True)


def port_in_use(rank, world_size, port, seconds=3):
    """Sets up the process group on a port that something else already listens on.

    Shown in lesson 10, §4.
    """
    import datetime

    os.environ["MASTER_PORT"] = str(port)  # BUG: a fixed port someone else holds
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    return "connected"


def zoo_worker(rank, world_size, directory):
    """Every bug that does not hang, broken and fixed, in one launch: ``{name: {False: the
    broken run's result, True: the fixed run's}}`` for seven programs, and two single runs
    (``unused_info``: bug 9 under TORCH_DISTRIBUTED_DEBUG=INFO; ``batchnorm_ddp``), and
    ``unused_first_grads``, bug 9's first step broken and fixed.

    Shown in lesson 10, §3.
    """
    out = {}
    for d in ("resume", "broken", "fixed"):
        (Path(directory) / d).mkdir(parents=True, exist_ok=True)
    out["resume"] = {fixed: resume_on_one_rank(rank, world_size, fixed,
                                               str(Path(directory) / "resume"))
                     for fixed in (False, True)}
    for name, fn in [("averaged_loss", averaged_loss),
                     ("batchnorm", batchnorm_stats), ("nan", nan_on_one_rank),
                     ("set_epoch", forgotten_set_epoch), ("unused", unused_parameter)]:
        out[name] = {fixed: fn(rank, world_size, fixed=fixed) for fixed in (False, True)}
    out["unused_info"] = unused_parameter(rank, world_size, debug="INFO")
    out["unused_first_grads"] = {fixed: unused_first_step(rank, world_size, fixed)
                                 for fixed in (False, True)}
    out["batchnorm_ddp"] = batchnorm_ddp(rank, world_size)
    out["checkpoint"] = {}
    for fixed in (False, True):
        d = Path(directory) / ("fixed" if fixed else "broken")
        out["checkpoint"][fixed] = same_checkpoint(rank, world_size, fixed, str(d))
    return out
