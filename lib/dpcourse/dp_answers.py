"""Lab 02's answers, measured on :mod:`dpcourse.dp` (lesson 02 runs them folded, after its
lab's pointer: open them once your lab passes).

Each function claims (``dpcourse.checks.claim``) one thing a learner's DataParallel step must
get right: the grad mode a replica's thread runs in, where BatchNorm's running statistics come
from, how the replicas' gradients combine, and which replica shares the module's own storage.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from dpcourse.dp import _as_devices, parallel_apply, scatter

__all__ = [
    "measure_thread_grad_mode",
    "measure_bn_stats_source",
    "measure_averaged_shares",
    "measure_replica0_storage",
]


def measure_thread_grad_mode(replicas, chunks) -> None:
    """Claims what a thread of :func:`parallel_apply` must take care of besides the call: a new
    thread's grad mode is its own, so the caller's must be passed on.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    from dpcourse.checks import claim

    seen_in_thread = []
    with torch.no_grad():
        probe = threading.Thread(target=lambda: seen_in_thread.append(torch.is_grad_enabled()))
        probe.start()
        probe.join()
        quiet = parallel_apply(replicas, chunks)
    claim("a thread started inside torch.no_grad() runs with grad mode ON (it is per thread)",
          seen_in_thread == [True], seen_in_thread=seen_in_thread)
    claim("parallel_apply passes the caller's mode on: under no_grad no replica records a graph",
          not any(o.requires_grad for o in quiet))


def measure_bn_stats_source(module: nn.Module, chunk0: torch.Tensor) -> None:
    """Claims where ``module``'s BatchNorm running statistics came from after one
    :func:`data_parallel` forward: compared with a copy, reset, that saw ``chunk0`` alone.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    from dpcourse.checks import claim

    only_chunk0 = copy.deepcopy(module)
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    bns_chunk0 = [m for m in only_chunk0.modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for b in bns_chunk0:
        b.reset_running_stats()   # back to the state before the DataParallel forward
    only_chunk0(chunk0)           # a plain copy that sees device 0's chunk only
    claim("after one DataParallel forward, the module's BatchNorm running mean and variance are "
          "bit-identical (torch.equal) to those of a copy that saw chunk 0 alone",
          all(torch.equal(a.running_mean, b.running_mean)
              and torch.equal(a.running_var, b.running_var) for a, b in zip(bns, bns_chunk0)))
    claim("the module counted one BatchNorm update, not one per replica",
          all(b.num_batches_tracked.item() == 1 for b in bns))


def measure_averaged_shares(plain: nn.Module, X: torch.Tensor, y: torch.Tensor,
                            devices) -> float:
    """Claims how the replicas' gradients combine into the whole batch's: each replica's share
    (its chunk's summed loss over the whole batch's size), recomputed by hand and averaged,
    against ``plain``'s gradient on the whole batch (already in its ``.grad``). Returns the
    ratio.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    import torch.nn.functional as F

    from dpcourse.checks import claim

    devs = _as_devices(devices)
    avg_grad = [torch.zeros_like(p) for p in plain.parameters()]
    for Xc, yc in zip(scatter(X, devs), scatter(y, devs)):
        share = copy.deepcopy(plain)
        share.zero_grad(set_to_none=True)
        (F.cross_entropy(share(Xc), yc, reduction="sum") / len(X)).backward()
        for a, p in zip(avg_grad, share.parameters()):
            a += p.grad / len(devs)
    ratio = (next(plain.parameters()).grad / avg_grad[0]).mean().item()
    print(f"full-batch gradient / averaged shares = {ratio:.2f}")
    claim(f"averaging the shares makes the gradient {len(devs)}x (the number of devices) too "
          "small (to 1e-3)", abs(ratio - len(devs)) < 1e-3, ratio=ratio)
    return ratio


def measure_replica0_storage(module: nn.Module, replicas) -> None:
    """Claims what replica 0 is: on the module's own device, its weights share the module's
    memory (views, with the broadcast as their ``grad_fn``), while replica 1's are copies.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    from dpcourse.checks import claim

    w0 = next(module.parameters())
    w_rep0, w_rep1 = (next(r.parameters()) for r in replicas[:2])
    claim("replica 0's weight shares the original's memory; replica 1's is a copy",
          w_rep0.data_ptr() == w0.data_ptr() and w_rep1.data_ptr() != w0.data_ptr())
