"""Lab 07 part 2: ``check_bucketed_ddp`` runs the learner's bucketed wrapper for 3 steps on 2 and
then 3 ranks under the bench's spy, compares it with real ``DistributedDataParallel`` on the same
shards, and hands what it saw to the diagnosis (:mod:`dpcourse.checks._lab07_diagnose`); then
the two extra models of :mod:`dpcourse.checks._lab07_cases`. Re-exported by
:mod:`dpcourse.checks.lab07`, whose docstring lists every mistake it names."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import check_timeout, fail, passed, recorded, require_answer, run_ranks
from ._lab07_bench import (CONFIGS, DEFAULT_TIMEOUT, _GLOBAL_BATCH, _STEPS, _ZERO_GRAD,
                           _check_net, _deferring_spy, _held_storages, _storage)
from ._lab07_cases import _check_dtypes, _check_unused
from ._lab07_diagnose import _diagnose

def _bucketed_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    __tracebackhide__ = True
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import ddp
    from ..collectives import record_collectives

    dev = ddp.setup_rank()
    cfg = ddp.StepConfig(global_batch=_GLOBAL_BATCH, steps=_STEPS, lr=0.1, width=8, n_train=96)
    batches = [ddp.shard_of(*ddp.global_batch_for_step(cfg, s), rank, world_size)
               for s in range(_STEPS)]
    module = _check_net().to(dev)
    everything = list(module.parameters())
    params = [p for p in everything if p.requires_grad]
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    frozen = {id(p): n for n, p in module.named_parameters() if not p.requires_grad}
    index = {id(p): i for i, p in enumerate(params)}
    local, ready = {}, {}

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        local[index[id(p)]] = p.grad.detach().clone()
        ready[index[id(p)]] = time.perf_counter()

    for p in params:
        p.register_post_accumulate_grad_hook(spy_ready)

    real = dist.all_reduce                  # the check's own all-reduces bypass the spy
    calls: list[dict] = []
    state = {"step": -1, "stale_waits": []}
    before, after = _deferring_spy(calls, state, where=True)

    steps = []
    with record_collectives(before=before, after=after):
        model = cls(module, bucket_cap_mb=cap_mb)
        buckets = getattr(model, "buckets", None)
        try:
            bucket_idx = [[index.get(id(p), -2 if id(p) in frozen else -1) for p in b]
                          for b in buckets]
        except TypeError:
            bucket_idx = None
        if bucket_idx is not None and any(i < 0 for b in bucket_idx for i in b):
            return {"buckets": bucket_idx, "names": names, "frozen": list(frozen.values())}
        if not hasattr(model, "finish_gradient_synchronization"):
            raise AttributeError("the class has no finish_gradient_synchronization() method")
        opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
        for step, (X, y) in enumerate(batches):
            state["step"] = step
            local.clear()
            ready.clear()
            opt.zero_grad(set_to_none=_ZERO_GRAD[step])
            t0 = time.perf_counter()
            F.cross_entropy(model(X.to(dev)), y.to(dev)).backward()
            t_backward = time.perf_counter()
            model.finish_gradient_synchronization()
            t_finish = time.perf_counter()
            after = [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]
            views = [None if p.grad is None else
                     (_storage(p.grad), p.grad.storage_offset(), p.grad.numel()) for p in params]
            held = _held_storages(model) | {v[0] for v in views if v}
            own = [local.get(i) for i in range(len(params))]
            if any(g is None for g in own):
                raise RuntimeError("the check's own hook saw no gradient for some parameter")
            mean = []
            for g in own:              # the right answer, with the real collective
                m = g.clone()
                real(m)
                mean.append((m / world_size).cpu())
            ms = lambda t: None if t is None else (t - t0) * 1e3
            steps.append({
                "after": after, "own": [g.cpu() for g in own], "views": views,
                "mean": mean, "ready": {i: ms(t) for i, t in ready.items()},
                "backward_end": ms(t_backward), "finish_end": ms(t_finish),
                "calls": [dict(c, t_launch=ms(c["t_launch"]), t_wait=ms(c["t_wait"]),
                               kept=c["storage"] in held)
                          for c in calls if c["step"] == step],
                "stale_waits": [old for now, old in state["stale_waits"] if now == step],
            })
            opt.step()
        learner = ddp.flat_params(module)
    # Real DDP from the same start on the same shards: the answer the wrapper must equal.
    ref = _check_net().to(dev)
    ddp_model = DDP(ref, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg.lr)
    for X, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(X.to(dev)), y.to(dev)).backward()
        opt.step()
    return {"steps": steps, "params": learner, "ddp": ddp.flat_params(ref),
            "buckets": bucket_idx, "names": names, "frozen": list(frozen.values()),
            "numels": [p.numel() for p in params]}


def _launch(cls, world_size: int, cap_mb: float, timeout: float) -> list:
    __tracebackhide__ = True
    from .. import devices

    def failed(exc) -> None:
        if "doesn't require gradient" in exc.summary or "does not require grad" in exc.summary:
            fail("you registered a hook on a frozen parameter (requires_grad=False; the check's "
                 "model has one, `scale`): torch refuses it, and it never gets a gradient.",
                 fix=("reconsider which parameters your wrapper attaches anything to: "
                      "self.buckets already says which ones ever get a gradient."))
        if "AVG" in exc.summary or "ReduceOp" in exc.summary:
            fail(f"your code raised on rank {exc.rank}: {exc.summary} — this backend refuses "
                 f"that reduce op.", fix=("reconsider which reduce ops every backend offers, "
                                          "and where else the average can come from (lesson 07 "
                                          "§3's class divides)."))

    return run_ranks(_bucketed_worker, world_size, cls, cap_mb,
                     backend=devices.backend_for(world_size), timeout=timeout, failed=failed,
                     hang="every rank must launch the same all-reduces in the same order (same "
                          "buckets, no rank-dependent branches), and every launched all-reduce "
                          "must be waited on.")


@recorded
def check_bucketed_ddp(cls, configs=CONFIGS, timeout: float | None = None) -> None:
    """Run the learner's wrapper class for 3 steps on 2 ranks (0.002 MiB buckets, which fill
    out of order) and on 3 ranks (0.004 MiB), on a model with a frozen parameter; its
    collectives, their order, their timing against each gradient's arrival, the gradients it
    leaves (values, and views of the bucket) are checked at every step, and its final weights
    against real DDP's."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(cls, getattr(cls, "__name__", "BucketedDDP"), "class")
    from ..overlap import BucketedDataParallel

    if isinstance(cls, type) and issubclass(cls, BucketedDataParallel):
        fail(f"{cls.__name__} is (or extends) lesson 07's BucketedDataParallel from the course "
             f"library: part 2 asks for your own wrapper, which keeps the two promises that "
             f"class does not (gradients as views of the buckets, launches in bucket order).")
    for world_size, cap_mb in configs:
        results = _launch(cls, world_size, cap_mb, timeout)
        _diagnose(results, world_size, cap_mb)
    _check_dtypes(cls, timeout)
    _check_unused(cls, timeout)
    shown = " and ".join(f"{ws} ranks ({cap} MiB buckets)" for ws, cap in configs)
    passed(f"{cls.__name__}: one async all-reduce per bucket, launched in bucket order as soon "
           f"as it could be, waited before the step; gradients are views of the buckets; "
           f"weights == DDP's after {_STEPS} steps on {shown}; a float64 layer beside float32 "
           f"ones averaged in its own bucket; every parameter left without a gradient is named, "
           f"in every bucket")
