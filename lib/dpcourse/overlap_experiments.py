"""The experiments of lesson 07: the wrappers of :mod:`dpcourse.overlap` trained beside torch's
DDP from the same start on the same shards, timed step by step, and DDP's communication hooks
counted.

* :func:`wrap` builds one of the ways by name (:data:`KINDS`, and the controls of
  :data:`CONTROLS`: :class:`LocalOnly` with no synchronisation, and the wrappers with every
  all-reduce launched only after the backward);
* :func:`equality_worker` trains each way (:func:`train_steps`) and returns its weights;
* :func:`timing_worker` times each way's step and its parts, with its last step's timeline
  (``python -m dpcourse.bench ddp`` runs it), and :func:`count_ddp_collectives` counts real
  DDP's all-reduces under the profiler;
* :func:`comm_hook_worker` counts the bytes a DDP communication hook sends (fp16, bf16,
  PowerSGD) with :func:`dpcourse.collectives.record_collectives`;
* :func:`overlap_verdicts` words the timed runs' verdicts, overlapped against control;
* :func:`stretch_tools` tries, on toys, the two tools lab 07's stretch needs
  (:func:`check_stretch_tools` holds the claim on them).

Every ``*_worker`` runs on every rank through :func:`dpcourse.launch.spawn`.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import record_collectives
from .overlap import (AfterBackward, BucketedDataParallel, PerParameterHooks, assign_buckets,
                      bucket_nbytes)

__all__ = [
    "KINDS",
    "CONTROLS",
    "LocalOnly",
    "wrap",
    "count_ddp_collectives",
    "wide_mlp",
    "rank_batches",
    "OverlapConfig",
    "train_steps",
    "equality_worker",
    "ddp_buckets_worker",
    "timing_worker",
    "comm_hook_worker",
    "off_cpu_wire",
    "stretch_tools",
    "check_stretch_tools",
    "overlap_verdicts",
]


KINDS = ("after_backward", "per_parameter", "bucketed", "ddp")
CONTROLS = ("local", "per_parameter_after", "bucketed_after")


class LocalOnly(nn.Module):
    """No synchronisation at all (each rank keeps its own gradient): the compute alone, which
    the overlap model of lesson 07 starts from. Not data parallel; for timing only.

    Shown in lesson 07, §4.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.collectives = 0
        self.events = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass


def wrap(kind: str, module: nn.Module, bucket_cap_mb: float = 25.0) -> nn.Module:
    """One of the ways, by name: the four of :data:`KINDS` (``"ddp"`` is torch's
    DistributedDataParallel itself, with its C++ reducer and no comm hook) or a control of
    :data:`CONTROLS` (``"local"``: no synchronisation; ``"..._after"``: the same asynchronous
    all-reduces launched only after the backward).

    Shown in lesson 07, §2.
    """
    if kind == "after_backward":
        return AfterBackward(module)
    if kind == "per_parameter":
        return PerParameterHooks(module)
    if kind == "bucketed":
        return BucketedDataParallel(module, bucket_cap_mb)
    if kind == "local":
        return LocalOnly(module)
    if kind == "per_parameter_after":
        return PerParameterHooks(module, overlap=False)
    if kind == "bucketed_after":
        return BucketedDataParallel(module, bucket_cap_mb, overlap=False)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = next(module.parameters()).device
        model = DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None,
                    bucket_cap_mb=bucket_cap_mb)
        model.collectives = None            # runs in C++: counted by count_ddp_collectives
        model.finish_gradient_synchronization = lambda: None   # DDP's backward already waited
        return model
    raise ValueError(f"kind must be one of {KINDS + CONTROLS}, got {kind!r}")


def count_ddp_collectives(model, step) -> dict:
    """Run ``step()`` (one training step of the DDP ``model``) under torch's profiler and
    count the all-reduces its C++ reducer issued: the process group's own ``gloo:all_reduce``
    / ``nccl:all_reduce`` records, no Python hook in DDP's path. Also returns what DDP's
    logger says it reduced (``num_buckets_reduced``) and its rebuilt buckets (parameter
    indices in gradient-ready order).

    Shown in lesson 07, §4.
    """
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
        step()
    calls = sum(1 for e in prof.events()
                if e.name in ("gloo:all_reduce", "nccl:all_reduce"))
    data = model._get_ddp_logging_data()
    buckets = [[int(i) for i in b.split()] for b in
               str(data.get("rebuilt_per_bucket_param_indices", "")).split(",") if b.strip()]
    return {"profiled_all_reduces": calls, "num_buckets_reduced": data.get("num_buckets_reduced"),
            "rebuilt_buckets": buckets}


# --------------------------------------------------------------------------------------------
# Workers (run on every rank through dpcourse.launch.spawn)
# --------------------------------------------------------------------------------------------


def wide_mlp(width: int = 1024, depth: int = 8, num_classes: int = 10) -> nn.Module:
    """A model whose size is in its matrices (about 38 MB of float32 at the defaults): big enough
    that the bucket size matters, and quick on a CPU, unlike convolutions of the same size.

    Shown in lesson 07, §4.
    """
    layers = [nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@dataclass
class OverlapConfig:
    """One experiment: the model, the data and the steps, the same on every rank; ``build``
    makes the model from ``seed``, so every run of one config starts from the same weights.

    Shown in lesson 07, §4.
    """

    model: str = "small_cnn"       # "small_cnn" (lessons 01-04) or "wide_mlp" (for timing)
    width: int = 8                 # SmallCNN's width, or the MLP's
    depth: int = 8                 # the MLP's number of Linear layers
    global_batch: int = 32
    steps: int = 3
    lr: float = 0.05
    momentum: float = 0.0
    seed: int = 0
    n_train: int = 256

    def build(self) -> nn.Module:
        from . import models

        torch.manual_seed(self.seed)
        if self.model == "small_cnn":
            return models.SmallCNN(width=self.width)
        if self.model == "wide_mlp":
            return wide_mlp(self.width, self.depth)
        raise ValueError(f"model must be 'small_cnn' or 'wide_mlp', got {self.model!r}")


def rank_batches(cfg: OverlapConfig, rank: int, world_size: int):
    """This rank's shard of each step's global batch (the shapes10 data of lesson 01).

    Shown in lesson 07, §2.
    """
    from . import ddp

    step_cfg = ddp.StepConfig(global_batch=cfg.global_batch, n_train=cfg.n_train)
    step_cfg.per_rank_batch(world_size)   # a clear error for a batch that does not split
    return [ddp.shard_of(*ddp.global_batch_for_step(step_cfg, s), rank, world_size)
            for s in range(cfg.steps)]


def train_steps(model, cfg: OverlapConfig, batches, dev) -> list[float]:
    """SGD on ``batches`` with one of the wrappers (or DDP, which :func:`wrap` gives a no-op
    ``finish_gradient_synchronization``); returns the losses.

    Shown in lesson 07, §2.
    """
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    losses = []
    for X, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X.to(dev)), y.to(dev))
        loss.backward()
        model.finish_gradient_synchronization()   # (a no-op for DDP)
        opt.step()
        losses.append(loss.item())
    return losses


def equality_worker(rank: int, world_size: int, cfg: OverlapConfig,
                    kinds=KINDS, bucket_cap_mb: float = 25.0) -> dict:
    """Train ``cfg.steps`` steps with each way in ``kinds``, from the same start on the same
    shards; return each one's final weights (flat, CPU), collective count and bucket sizes.

    Shown in lesson 07, §2.
    """
    from . import ddp

    dev = ddp.setup_rank()
    batches = rank_batches(cfg, rank, world_size)
    out = {}
    for kind in kinds:
        model = wrap(kind, cfg.build().to(dev), bucket_cap_mb)
        train_steps(model, cfg, batches, dev)
        inner = model.module
        out[kind] = {"params": ddp.flat_params(inner), "collectives": model.collectives,
                     "buckets": [len(b) for b in getattr(model, "buckets", [])]}
    return out


def ddp_buckets_worker(rank: int, world_size: int, settings) -> list[dict]:
    """Real DDP's buckets, read from its reducer, for each ``(cfg, bucket_cap_mb,
    find_unused_parameters)`` in ``settings`` (``bucket_cap_mb=None``: DDP's default): the
    parameters' names per bucket as DDP made them at construction (``"first"``), after the
    first backward (``"first_backward"``), after the second forward (``"second_forward"``: the
    reducer rebuilds its buckets, in the order the first backward's gradients arrived, at the
    start of the next forward with gradients enabled, here the second, unless this DDP never
    rebuilds) and after two training steps
    on ``cfg``'s data (``"after"``). Bucket 0 is the one DDP reduces first.

    Shown in lesson 07, §3.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import ddp

    dev = ddp.setup_rank()
    out = []
    for cfg, cap, find_unused in settings:
        module = cfg.build().to(dev)
        names = {p: n for n, p in module.named_parameters()}
        model = DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None,
                    bucket_cap_mb=cap, find_unused_parameters=find_unused)

        def buckets():
            return [[names[p] for p in b.parameters()]
                    for b in model.reducer._get_zeros_like_grad_buckets()]

        first = buckets()
        cfg2 = OverlapConfig(**{**cfg.__dict__, "steps": 2})
        for step, (X, y) in enumerate(rank_batches(cfg2, rank, world_size)):
            loss = F.cross_entropy(model(X.to(dev)), y.to(dev))
            if step == 1:
                second_forward = buckets()   # the rebuild, if any, is done by now
            loss.backward()
            if step == 0:
                first_backward = buckets()   # the 1st backward records the arrival order
        out.append({"bucket_cap_mb": cap, "find_unused_parameters": find_unused,
                    "first": first, "first_backward": first_backward,
                    "second_forward": second_forward, "after": buckets()})
    return out


def timing_worker(rank: int, world_size: int, cfg: OverlapConfig, runs, warmup: int = 2) -> dict:
    """Time the training step for each ``(kind, bucket_cap_mb)`` in ``runs``.

    All the models are built first and then take their steps in rounds (step 1 of every run,
    then step 2 of every run, ..., in a shuffled order each round, the same on every rank), so
    that a slow moment of the machine hits every run alike.
    A step's time is the median over ``cfg.steps`` steps after ``warmup`` untimed ones (DDP
    records the gradients' order in its first backward and rebuilds its buckets, allocating
    new ones, at the start of its next forward with gradients enabled: two warm-up steps keep
    that out of the timed ones), and so are its parts: the forward, the backward
    (until ``backward()`` returns), the synchronisation after it and the optimizer step. Each
    run also returns its last step's timeline on this rank, in ms since the backward began:
    when each gradient was ready (stamped before the class's own hook of that gradient runs),
    when each all-reduce was launched and done, and when the
    backward and the step ended; ``steps_s``, every timed step's parts, round by round;
    ``copy_ms``, a bucketed run's copies per bucket (in, back; medians). Real DDP (``"ddp"``) runs with nothing of ours in its path
    (no comm hook, no gradient stamps); its all-reduces are counted afterwards, in one more
    step under the profiler (:func:`count_ddp_collectives`).

    Shown in lesson 07, §4.
    """
    from . import ddp

    dev = ddp.setup_rank()
    cfg_all = OverlapConfig(**{**cfg.__dict__, "steps": cfg.steps + warmup})
    batches = [(X.to(dev), y.to(dev)) for X, y in rank_batches(cfg_all, rank, world_size)]
    setups = []
    for kind, cap in runs:
        module, ready = cfg.build().to(dev), []
        if kind != "ddp":
            # Stamps when each gradient is ready, registered *before* the class's own hooks, so
            # a gradient's tick comes first and the launch its hook may make comes after it.
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(lambda _, ready=ready: ready.append(
                    time.perf_counter()))
        model = wrap(kind, module, cap)
        setups.append({"kind": kind, "cap": cap, "model": model, "ready": ready,
                       "parts": {k: [] for k in ("step", "forward", "backward", "sync", "opt")},
                       "opt": torch.optim.SGD(model.parameters(), lr=cfg.lr)})

    def one_step(s, X, y):
        model, opt = s["model"], s["opt"]
        s["ready"].clear()
        if hasattr(model, "events"):
            model.events.clear()
        if hasattr(model, "copy_seconds"):       # this step's copies, bucket by bucket
            model.copy_seconds = [[0.0, 0.0] for _ in model.buckets]
        dist.barrier()                           # every rank starts the step together
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X), y)
        tb = time.perf_counter()
        loss.backward()
        t_backward = time.perf_counter()
        model.finish_gradient_synchronization()
        t_sync = time.perf_counter()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        return t0, tb, t_backward, t_sync, t1

    for step, (X, y) in enumerate(batches):
        order = list(setups)
        random.Random(step).shuffle(order)       # a fresh order each round, alike on every rank
        for s in order:
            before = s["model"].collectives
            t0, tb, t_backward, t_sync, t1 = one_step(s, X, y)
            if step >= warmup:
                for key, dt in (("step", t1 - t0), ("forward", tb - t0),
                                ("backward", t_backward - tb), ("sync", t_sync - t_backward),
                                ("opt", t1 - t_sync)):
                    s["parts"][key].append(dt)
                if hasattr(s["model"], "copy_seconds"):
                    s.setdefault("copies", []).append(s["model"].copy_seconds)
            ms = lambda t, tb=tb: round((t - tb) * 1e3, 3)
            s["last"] = {"ready": [ms(t) for t in s["ready"]],
                         "events": [(what, which, ms(t))
                                    for what, which, t in getattr(s["model"], "events", [])],
                         "backward_end": ms(t_backward), "sync_end": ms(t1),
                         "collectives": None if before is None
                         else s["model"].collectives - before}
    for s in setups:
        if s["kind"] == "ddp":
            X, y = batches[-1]
            counted = count_ddp_collectives(s["model"], lambda s=s: one_step(s, X, y))
            s["last"]["collectives"] = counted["profiled_all_reduces"]
            s["ddp"] = counted
    results = [{"kind": s["kind"], "bucket_cap_mb": s["cap"],
                "step_s": statistics.median(s["parts"]["step"]),
                "parts_s": {k: statistics.median(v) for k, v in s["parts"].items()},
                "steps_s": s["parts"],
                "copy_ms": [[statistics.median(c[i][j] for c in s["copies"]) * 1e3
                             for j in (0, 1)] for i in range(len(s["copies"][0]))]
                if s.get("copies") else None,
                "collectives_per_step": s["last"].pop("collectives"),
                "n_buckets": len(getattr(s["model"], "buckets", [])) or None,
                "ddp": s.get("ddp"),
                "timeline": s["last"]} for s in setups]
    return {"runs": results, "model_bytes": bucket_nbytes(cfg.build().parameters())}


def comm_hook_worker(rank: int, world_size: int, cfg: OverlapConfig, hooks,
                     powersgd_rank: int = 1, start_powersgd_iter: int = 2) -> dict:
    """Train real DDP ``cfg.steps`` steps once per name in ``hooks`` — "none" (plain
    all-reduce), "fp16", "bf16", "powersgd" or "powersgd_no_ef" (without error feedback) —
    and return each run's losses (this rank's shard), final weights, and the elements and
    bytes all-reduced in each step, counted by :func:`dpcourse.collectives.record_collectives`.

    Shown in lesson 07, §5.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import ddp

    dev = ddp.setup_rank()
    if dev.type == "cpu" and torch.cuda.is_available():
        # torch's PowerSGD hook calls torch.cuda.synchronize(device) whenever CUDA exists,
        # even for CPU tensors (powerSGD_hook.py in torch 2.14), which raises "Expected a cuda
        # device" on a GPU machine whose ranks run on the CPU. Nothing here runs on a GPU, so
        # this rank process can safely make that call a no-op.
        torch.cuda.synchronize = lambda device=None: None
    batches = rank_batches(cfg, rank, world_size)
    out = {}
    for name in hooks:
        model = DDP(cfg.build().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
        if name == "none":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name in ("powersgd", "powersgd_no_ef"):
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=start_powersgd_iter,
                # Only error feedback differs between the two PowerSGD runs; both warm-start
                # (reuse last step's Q as the power iteration's starting point).
                use_error_feedback=(name == "powersgd"), warm_start=True)
            model.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            raise ValueError(f"unknown comm hook {name!r}: none, fp16, bf16, powersgd, "
                             f"powersgd_no_ef")
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        losses, sent = [], []
        for X, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(X.to(dev)), y.to(dev))
            with record_collectives() as calls:
                loss.backward()
            opt.step()
            losses.append(loss.item())
            reduced = calls.of("all_reduce")
            sent.append({"calls": len(reduced), "elements": sum(c.numel for c in reduced),
                         "bytes": sum(c.nbytes for c in reduced),
                         "dtypes": sorted({str(c.dtype).replace("torch.", "") for c in reduced})})
        out[name] = {"losses": losses, "sent": sent, "params": ddp.flat_params(model.module)}
    shapes = [tuple(p.shape) for p in cfg.build().parameters()]
    return {"runs": out, "shapes": shapes}


def off_cpu_wire(cfg: OverlapConfig, bucket_cap_mb: float, wire_ms, rounds: int = 9,
                 seed: int = 0) -> dict:
    """Overlap where communication takes no CPU: one process, no process group; each bucket's
    "all-reduce" is ``time.sleep(wire_ms(bytes) / 1000)`` on one background thread (one
    message at a time, as lesson 07's model assumes; a sleeping thread releases the GIL and
    uses no core). Overlapped, a bucket goes on this wire from the hook of its last parameter
    (enough where gradients arrive in reverse registration order, as the MLP's do; a bucket sent
    with a gradient missing raises); in the control, every bucket goes once ``backward()`` ends.
    The two take their steps in rounds (shuffled order each round, one untimed warm-up round);
    returns each one's step times (forward, backward, wire; no optimizer), forward times and
    backward times (each alone), round by round, in ms, and the buckets' bytes.

    Shown in lesson 07, §4.
    """
    import concurrent.futures

    torch.manual_seed(seed)
    model = cfg.build()
    X = torch.randn(cfg.global_batch, 3, 32, 32)
    y = torch.randint(0, 10, (cfg.global_batch,))
    buckets = assign_buckets([p for p in model.parameters() if p.requires_grad], bucket_cap_mb)
    closes = {b[-1]: i for i, b in enumerate(buckets)}   # each bucket's last parameter
    wire = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    state = {"overlap": True, "sent": []}

    def send(i):
        if any(p.grad is None for p in buckets[i]):
            raise RuntimeError(f"bucket {i} was sent before all its gradients arrived")
        state["sent"].append(wire.submit(time.sleep, wire_ms(bucket_nbytes(buckets[i])) / 1e3))

    def grad_ready(p):
        if p in closes and state["overlap"]:
            send(closes[p])

    for p in closes:
        p.register_post_accumulate_grad_hook(grad_ready)
    out = {k: {"step": [], "forward": [], "backward": []} for k in ("overlap", "control")}
    out["bucket_bytes"] = [bucket_nbytes(b) for b in buckets]
    order = random.Random(seed)
    try:
        for r in range(rounds + 1):
            for kind in order.sample(["overlap", "control"], 2):
                state.update(overlap=kind == "overlap")
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                loss = F.cross_entropy(model(X), y)
                t_forward = time.perf_counter()
                loss.backward()
                t_backward = time.perf_counter()
                if kind == "control":
                    for i in range(len(buckets)):
                        send(i)
                for f in state["sent"]:
                    f.result()
                state["sent"] = []
                if r:                                    # round 0 is the warm-up
                    out[kind]["step"].append((time.perf_counter() - t0) * 1e3)
                    out[kind]["forward"].append((t_forward - t0) * 1e3)
                    out[kind]["backward"].append((t_backward - t_forward) * 1e3)
    finally:
        wire.shutdown()
    return out


def stretch_tools(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    """On toys, two tools lab 07's stretch needs: two asynchronous all-reduces' futures joined
    into one, and a list gathered, one entry per rank. Returns (the joined sums, the list).

    Shown in lesson 07, §6 (folded).
    """
    a = dist.all_reduce(torch.tensor([rank + 1.0]), async_op=True).get_future()
    b = dist.all_reduce(torch.tensor([10.0 * rank]), async_op=True).get_future()
    both = torch.futures.collect_all([a, b]).then(lambda f: [x.value()[0] for x in f.value()])
    parts = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(parts, torch.tensor([float(rank)]))
    return [t.item() for t in both.wait()], [t.item() for t in parts]


def check_stretch_tools(results, world_size: int) -> None:
    """The claim on :func:`stretch_tools`' results (rank 0's), for the folded cell that shows it.

    Shown in lesson 07, §6 (folded).
    """
    from .checks import claim

    joined, gathered = results
    n = world_size
    claim(f"collect_all's future completes once both all-reduces have, with both sums {joined}; "
          f"all_gather fills one list entry per rank: {gathered}",
          joined == [n * (n + 1) / 2, 5.0 * n * (n - 1)]
          and gathered == [float(r) for r in range(n)])


def overlap_verdicts(verdicts, yardstick_ok: bool = True) -> str:
    """The first sentences of lesson 07's "What this run says": each cap's overlapped run
    against its control. ``verdicts``: one (cap's name, buckets the run had, way) per cap, way
    the sign test's (-1 clearly faster, +1 clearly slower, 0 no clear difference). A run with
    one bucket is a null pair: overlap cannot act there, so its verdict is never worded as
    overlap saving or costing time, and a clear one is called an error of the test.

    Shown in lesson 07, §4 (folded).
    """
    several = [(name, way) for name, n, way in verdicts if n > 1]
    paid = [name for name, way in several if way < 0]
    cost = [name for name, way in several if way > 0]
    other = len(several) - len(paid) - len(cost)
    null = [(name if name == "one bucket" else f"{name} (one bucket)", way)
            for name, n, way in verdicts if n == 1]
    words = (f"Against its control, overlap clearly saved time at "
             f"{', '.join(paid) or 'none of the caps'}, clearly cost time at "
             f"{', '.join(cost) or 'none of the caps'}, and made no clear difference at the "
             f"other {other} cap{'' if other == 1 else 's'} with several buckets"
             f"{'' if yardstick_ok else ' (weak: identical work got a clear verdict too, above)'}.")
    for name, way in null:
        if way:
            words += (f" At {name}, where overlap cannot act, the test still called a "
                      f"difference, '{'faster' if way < 0 else 'slower'}': a measure of how "
                      f"often this run's test errs.")
    quiet = [name for name, way in null if not way]
    if quiet:
        words += (f" At {' and '.join(quiet)}, where overlap cannot act: no clear difference, "
                  f"as expected.")
    return words
