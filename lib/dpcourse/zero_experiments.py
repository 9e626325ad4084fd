"""The experiments of lesson 08: every ZeRO stage of :mod:`dpcourse.zero` trained beside torch's
own DDP, FSDP2 (``fully_shard``) and ``ZeroRedundancyOptimizer``, from the same start on the
same batches, with the bytes each rank holds and sends; FSDP2's tour; ZeRO-3's timeline.

Every ``*_worker`` runs on every rank through :func:`dpcourse.launch.spawn`:

* :func:`equality_worker` trains each of :data:`RUNS` (:func:`train_run`, built by
  :func:`prepare_run`) and returns weights, losses, bytes held and each step's traffic;
* :func:`fsdp2_worker` tours FSDP2 (DTensor shards, mixed precision, a full state dict);
* :func:`fsdp2_root_worker` shows the root unit gathered once per step;
* :func:`zero3_timeline_worker` times one :class:`dpcourse.zero.Zero3` step's gathers, frees
  and reduce-scatters.

Traffic is recorded with :func:`dpcourse.collectives.record_collectives` and weighed with
:func:`dpcourse.zero.summarize_traffic`.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import record_collectives
from .zero import (WRAPPERS, Zero3, count_bytes, fsdp2_padded_numel, optimizer_tensors,
                   summarize_traffic)

__all__ = [
    "ZeroConfig",
    "fsdp2_policy",
    "fsdp2_shard",
    "TorchRun",
    "RUNS",
    "prepare_run",
    "train_run",
    "equality_worker",
    "fsdp2_worker",
    "fsdp2_root_worker",
    "zero3_timeline_worker",
]


@dataclass
class ZeroConfig:
    """One experiment, the same on every rank.

    The MLP's widths are deliberately odd: Ψ = 31·43 + 44·22 + 23·10 = 1333 + 968 + 230 = 2531
    divides by neither 2 nor 3, nor does any layer by 3, so the padding is exercised. The data
    are synthetic: inputs from a seeded generator, labels given by a fixed random linear
    "teacher", so the loss can fall. ``mixed_precision``: bf16 weights and gradients with
    fp32 master weights and Adam state (the setting of ZeRO's memory formula); fp32 otherwise
    (the setting in which every stage must equal DDP to float tolerance). ``frozen_and_tied``:
    a square layer is added after the first, its weight tied (one ``Parameter``) with a second
    square layer after it, and the first layer's bias is frozen (``requires_grad=False``), so
    every stage meets both cases a real model has.

    Shown in lesson 08, §3.
    """

    widths: tuple = (30, 43, 22, 10)
    global_batch: int = 24
    steps: int = 4
    optimizer: str = "adam"        # "adam", "adamw" or "sgd" (with momentum 0.9)
    lr: float = 0.01
    mixed_precision: bool = False
    seed: int = 0
    frozen_and_tied: bool = False

    def __post_init__(self):
        if self.optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adam', 'adamw' or 'sgd', got {self.optimizer!r}")
        if len(self.widths) < 2 or self.steps < 1 or self.global_batch < 1:
            raise ValueError("need at least two widths, one step and one sample per batch")

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mixed_precision else torch.float32

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        layers = []
        for fan_in, fan_out in zip(self.widths[:-1], self.widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        if self.frozen_and_tied:
            width = self.widths[1]
            first, second = nn.Linear(width, width), nn.Linear(width, width)
            second.weight = first.weight                  # tied: one Parameter, two layers
            layers[0].bias.requires_grad_(False)          # frozen
            layers[2:2] = [first, nn.ReLU(), second, nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    def optimizer_class(self):
        """(class, keyword arguments), also what ZeroRedundancyOptimizer needs."""
        if self.optimizer == "adam":
            return torch.optim.Adam, {"lr": self.lr}
        if self.optimizer == "adamw":
            return torch.optim.AdamW, {"lr": self.lr, "weight_decay": 0.01}
        return torch.optim.SGD, {"lr": self.lr, "momentum": 0.9}

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        cls, kwargs = self.optimizer_class()
        return cls(params, **kwargs)

    def global_batch_for_step(self, step: int):
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        X = torch.randn(self.global_batch, self.widths[0], generator=g)
        teacher = torch.randn(self.widths[0], self.widths[-1],
                              generator=torch.Generator().manual_seed(self.seed + 7))
        return X, (X @ teacher).argmax(dim=1)

    def batches(self, rank: int, world_size: int):
        """This rank's contiguous share of each step's global batch."""
        if self.global_batch % world_size:
            raise ValueError(f"global_batch {self.global_batch} does not split over {world_size} "
                             f"ranks; use a multiple of {world_size}")
        n = self.global_batch // world_size
        return [(X[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
                for X, y in (self.global_batch_for_step(s) for s in range(self.steps))]


def fsdp2_policy(cfg: ZeroConfig):
    """bf16 compute with fp32 gradient reduction, or FSDP2's default (no casting) in fp32.

    Shown in lesson 08, §6.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.mixed_precision:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def ranks_mesh(dev: torch.device):
    """The ranks as a 1-D device mesh on the ranks' own device type. Without it fully_shard
    picks CUDA whenever a GPU exists — and on a one-GPU machine whose ranks run on the CPU
    over gloo, rank 1 then asks for cuda:1 (measured on an H100: "invalid device ordinal").

    Shown in lesson 08, §6.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev.type, (dist.get_world_size(),))


def fsdp2_shard(model: nn.Module, cfg: ZeroConfig, dev: torch.device,
                root_keeps_last: bool = False) -> nn.Module:
    """FSDP2 on the MLP: each ``nn.Linear`` a unit of its own (layers that share a tied
    parameter form one unit: FSDP2 refuses a parameter split across two), then the root.
    ``root_keeps_last``: leave the last layer to the root's own unit instead.

    Shown in lesson 08, §6.
    """
    from torch.distributed.fsdp import fully_shard

    policy, mesh = fsdp2_policy(cfg), ranks_mesh(dev)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    groups: list = []
    for layer in linears[:-1] if root_keeps_last else linears:
        tied = [g for g in groups if any(p is q for m in g for q in m.parameters()
                                         for p in layer.parameters())]
        tied[0].append(layer) if tied else groups.append([layer])
    for group in groups:
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)   # the root: its own parameters + schedule
    return model


class TorchRun:
    """torch's own ways (DDP, FSDP2, ZeroRedundancyOptimizer) behind the stages' interface.

    Shown in lesson 08, §3.
    """

    def __init__(self, model, optimizer, params, units, state_optimizer=None):
        self.model, self.optimizer, self.params, self.units = model, optimizer, params, units
        self.state_optimizer = state_optimizer or optimizer   # the one that holds the state

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def held_tensors(self) -> dict:
        return {"params": list(self.params),
                "grads": [p.grad for p in self.params if p.grad is not None],
                "optimizer": optimizer_tensors(self.state_optimizer)}

    def full_weights(self) -> torch.Tensor:
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.params]
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in full])


RUNS = ("torch_ddp", "ddp", "zero1", "zero2", "zero3", "fsdp2", "zero_redundancy")


def prepare_run(run: str, cfg: ZeroConfig, dev: torch.device):
    """(the model to call, the optimizer-like object, the dtype of the inputs) for one run.

    Shown in lesson 08, §3.
    """
    model = cfg.build().to(dev)
    psi = sum(p.numel() for p in model.parameters())
    if run in WRAPPERS:
        return model, WRAPPERS[run](model, cfg.make_optimizer, cfg.param_dtype), cfg.param_dtype
    if run in ("torch_ddp", "zero_redundancy"):       # always fp32: torch keeps no master copy
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)  # so it is recorded
        if run == "torch_ddp":
            opt = TorchRun(ddp_model, cfg.make_optimizer(model.parameters()),
                            list(model.parameters()), [psi])
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, kwargs = cfg.optimizer_class()
            zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
            opt = TorchRun(ddp_model, zro, list(model.parameters()), [psi],
                            state_optimizer=zro.optim)
        return ddp_model, opt, torch.float32
    if run == "fsdp2":
        fsdp2_shard(model, cfg, dev)
        n = dist.get_world_size()
        units = [fsdp2_padded_numel(p.shape, n) for p in model.parameters()]
        return model, TorchRun(model, cfg.make_optimizer(model.parameters()),
                               list(model.parameters()), units), torch.float32
    raise ValueError(f"run must be one of {RUNS}, got {run!r}")


def train_run(run: str, cfg: ZeroConfig, rank: int, world_size: int) -> dict:
    """Train ``cfg.steps`` steps one way; return the final weights (flat fp32), this rank's
    losses, the bytes it holds after the last step (before zero_grad) by category, each
    step's traffic (:func:`summarize_traffic`), the sizes it shards (``units``), the bytes
    of gradients alive when the first backward returns (``grads_after_backward``), and the
    most alive just before one of the first step's collectives that sum gradients
    (``grads_at_collective``, as ``weigh`` below counts them).

    Not counted, because they are not model state: activations and temporaries, and torch
    DDP's gradient buckets (a second copy of the gradients unless
    ``gradient_as_bucket_view=True``).

    Shown in lesson 08, §3.
    """
    from . import ddp

    dev = ddp.setup_rank()
    model, opt, x_dtype = prepare_run(run, cfg, dev)
    losses, traffic, grads_after_backward, at_collective = [], [], None, [0]

    def weigh(call):                    # just before each collective that sums gradients
        if call.op in ("all_reduce", "reduce_scatter") and not traffic:   # first step only
            handed = [v for v in call.args.values() if torch.is_tensor(v)]
            grads = count_bytes({"g": opt.held_tensors()["grads"] + handed})["g"]
            at_collective[0] = max(at_collective[0], grads)

    for X, y in cfg.batches(rank, world_size):
        with record_collectives(before=weigh) as calls:
            opt.zero_grad()
            loss = F.cross_entropy(model(X.to(dev, x_dtype)).float(), y.to(dev))
            loss.backward()
            if grads_after_backward is None:   # when the first backward returns
                grads_after_backward = count_bytes(
                    {"grads": opt.held_tensors()["grads"]})["grads"]
            opt.step()
        losses.append(loss.item())
        traffic.append(summarize_traffic(calls, world_size))
    held = count_bytes(opt.held_tensors())
    return {"params": opt.full_weights(), "losses": losses, "held": held, "traffic": traffic,
            "units": list(opt.units), "grads_after_backward": grads_after_backward,
            "grads_at_collective": at_collective[0]}


def equality_worker(rank: int, world_size: int, cfg: ZeroConfig, runs=RUNS) -> dict:
    """Each of ``runs`` trained from the same start on the same batches, in one launch (a
    launch costs seconds; a run of this model, milliseconds): {run: :func:`train_run`'s
    dict}. ``torch_ddp`` (the reference) and ``zero_redundancy`` always run in fp32: torch's
    optimizers keep no master copy.

    Shown in lesson 08, §3.
    """
    return {run: train_run(run, cfg, rank, world_size) for run in runs}


def fsdp2_worker(rank: int, world_size: int, cfg: ZeroConfig, path: str | None = None) -> dict:
    """A tour of FSDP2 (``fully_shard``): what the parameters become, a mixed-precision
    training run, and a full state dict gathered, saved by rank 0, and loaded back both into
    a plain model and into a fresh sharded one.

    ``path``: where rank 0 saves the state dict (a temporary file, removed, if None).

    Shown in lesson 08, §6.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    from . import ddp

    dev = ddp.setup_rank()

    def sharded_model():
        return fsdp2_shard(cfg.build().to(dev), cfg, dev)

    model = sharded_model()
    out = {"shards": [(name, type(p).__name__, tuple(p.shape), tuple(p.to_local().shape),
                       str(p.placements)) for name, p in model.named_parameters()]}
    seen_in_forward = []

    def look(module, args):                            # the weights the layer computes with
        seen_in_forward.append(str(module.weight.dtype))

    model[0].register_forward_pre_hook(look)
    opt = cfg.make_optimizer(model.parameters())
    losses, traffic = [], []
    for X, y in cfg.batches(rank, world_size):
        with record_collectives() as calls:
            opt.zero_grad()
            loss = F.cross_entropy(model(X.to(dev)).float(), y.to(dev))
            loss.backward()
            opt.step()
        losses.append(loss.item())
        traffic.append(summarize_traffic(calls, world_size))
    params = list(model.parameters())
    out.update(losses=losses, traffic=traffic, sharded_dtype=str(params[0].dtype),
               grad_dtype=str(params[0].grad.dtype), compute_dtype=seen_in_forward[0],
               held=count_bytes({"params": params, "grads": [p.grad for p in params],
                                 "optimizer": optimizer_tensors(opt)}))

    # The full state dict: gathered from the shards; with cpu_offload only rank 0 keeps it.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    out["state_dict_keys"] = list(full)
    weights = torch.cat([p.full_tensor().detach().reshape(-1).float().cpu()
                         for p in model.parameters()])
    if rank == 0:
        if path is None:
            fd, target = tempfile.mkstemp(suffix=".pt")
            os.close(fd)
        else:
            target = path
        torch.save(full, target)
        plain = cfg.build()
        plain.load_state_dict(torch.load(target, weights_only=True))
        out["file_bytes"] = os.path.getsize(target)
        out["plain_model_equal"] = torch.equal(ddp.flat_params(plain), weights)
        if path is None:
            os.unlink(target)
    # ... and back into a fresh sharded model: rank 0 has the weights, the others receive them.
    fresh = sharded_model()
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    out["reloaded_shards_equal"] = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), fresh.parameters()))
    return out


def fsdp2_root_worker(rank: int, world_size: int, cfg: ZeroConfig) -> dict:
    """FSDP2 with the last layer left to the root's own group (every other ``nn.Linear`` is its
    own unit): the root's parameters are *not* resharded after the forward (``fully_shard``
    sets ``reshard_after_forward`` to False for the root when it is left at None), so they are
    all-gathered once per step, not twice. One step's traffic and the padded sizes of the
    root's and the other units' parameters.

    Shown in lesson 08, §6.
    """
    from . import ddp

    dev = ddp.setup_rank()
    model = fsdp2_shard(cfg.build().to(dev), cfg, dev, root_keeps_last=True)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    opt = cfg.make_optimizer(model.parameters())
    traffic = []
    for X, y in cfg.batches(rank, world_size):
        with record_collectives() as calls:
            opt.zero_grad()
            F.cross_entropy(model(X.to(dev)), y.to(dev)).backward()
            opt.step()
        traffic.append(summarize_traffic(calls, world_size))
    root = [fsdp2_padded_numel(p.shape, world_size) for p in linears[-1].parameters()]
    others = [fsdp2_padded_numel(p.shape, world_size) for m in linears[:-1]
              for p in m.parameters()]
    return {"traffic": traffic, "root_units": root, "other_units": others}


def fsdp2_accumulation_worker(rank: int, world_size: int, cfg: ZeroConfig,
                              micro_batches: int = 2) -> dict:
    """FSDP2 as in :func:`fsdp2_root_worker` (the last layer left to the root), but each
    optimizer step accumulates the gradients of ``micro_batches`` forward and backward passes,
    FSDP2's settings left at their defaults. One step's traffic, the number of all-gathers and
    reduce-scatters, and the padded sizes of the root's and the other units' parameters.

    Shown in lesson 08, §6.
    """
    from . import ddp

    dev = ddp.setup_rank()
    model = fsdp2_shard(cfg.build().to(dev), cfg, dev, root_keeps_last=True)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    opt = cfg.make_optimizer(model.parameters())
    traffic, counts = [], []
    for X, y in cfg.batches(rank, world_size):
        with record_collectives() as calls:
            opt.zero_grad()
            for Xm, ym in zip(X.chunk(micro_batches), y.chunk(micro_batches)):
                (F.cross_entropy(model(Xm.to(dev)), ym.to(dev)) / micro_batches).backward()
            opt.step()
        traffic.append(summarize_traffic(calls, world_size))
        counts.append({op: sum(1 for c in calls if c.op == op)
                       for op in ("all_gather", "reduce_scatter")})
    root = [fsdp2_padded_numel(p.shape, world_size) for p in linears[-1].parameters()]
    others = [fsdp2_padded_numel(p.shape, world_size) for m in linears[:-1]
              for p in m.parameters()]
    return {"traffic": traffic, "counts": counts, "units": len(linears) - 1,
            "root_units": root, "other_units": others}


def zero3_timeline_worker(rank: int, world_size: int, cfg: ZeroConfig) -> list:
    """One :class:`dpcourse.zero.Zero3` step after a warm-up step, timed from the calls themselves: for each
    layer, when its weights were all-gathered (forward, then backward: each layer's ``gather``
    and ``free`` are replaced by timed ones), freed, and its gradients reduce-scattered (timed
    by the ``before``/``after`` hooks of :func:`dpcourse.collectives.record_collectives`). Returns [(layer, kind, start_ms, end_ms)] in the order the
    calls happened; the span from a gather's end to the layer's next free is the time the full
    weights existed (the layer computed in it; the backward frees them before the
    reduce-scatter).

    Shown in lesson 08, §4.
    """
    from . import ddp

    dev = ddp.setup_rank()
    model = cfg.build().to(dev)
    opt = Zero3(model, cfg.make_optimizer, cfg.param_dtype)
    events: list = []
    phase = {"now": "forward", "t0": 0.0}

    def clock() -> float:
        return (time.perf_counter() - phase["t0"]) * 1e3

    by_numel = {layer.full.numel(): i for i, layer in enumerate(opt.layers)}
    for i, layer in enumerate(opt.layers):
        def gather(layer=layer, i=i, real=layer.gather):
            if layer.full.untyped_storage().nbytes() == 0:
                start = clock()
                real()
                events.append((i, f"all-gather ({phase['now']})", start, clock()))

        def free(i=i, real=layer.free):
            real()
            events.append((i, "free", clock(), clock()))

        layer.gather, layer.free = gather, free
    started = {}

    def before(call):                   # the recorder's hooks time each reduce-scatter
        if call.op == "reduce_scatter":
            started["at"] = clock()

    def after(call):
        if call.op == "reduce_scatter":
            events.append((by_numel.get(call.numel, -1), "reduce-scatter", started["at"],
                           clock()))

    with record_collectives(before=before, after=after):
        for X, y in cfg.batches(rank, world_size)[:2]:
            events.clear()
            dist.barrier()
            phase.update(now="forward", t0=time.perf_counter())
            opt.zero_grad()
            loss = F.cross_entropy(model(X.to(dev, cfg.param_dtype)).float(), y.to(dev))
            phase["now"] = "backward"
            loss.backward()
            opt.step()
    return events
