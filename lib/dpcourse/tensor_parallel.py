"""Tensor parallelism from scratch (Megatron-LM's MLP), then torch's ``parallelize_module``, then
a 2-D mesh — data parallel over one dimension, tensor parallel over the other (lesson 11).

Data parallelism gives every rank the whole model. Tensor parallelism cuts each weight matrix
across ranks instead, so that a layer too big for one device is computed by several, each on its
slice (Shoeybi et al., *Megatron-LM*, 2019, section 3). For a two-layer MLP
``Y = GeLU(X A) B`` (``A`` is ``d × h``, ``B`` is ``h × d``; torch stores ``A`` as the first
``nn.Linear``'s weight, ``h × d``, its transpose):

* the first layer is **column-parallel**: rank r keeps columns r of ``A`` (rows of the torch
  weight) and its slice of the bias, and computes ``GeLU(X A_r)``: its own slice of the hidden
  activations, with no communication (GeLU acts element by element, so it can run on a slice);
* the second layer is **row-parallel**: rank r keeps rows r of ``B`` (columns of the torch
  weight) and multiplies its hidden slice by them: ``Y_r = GeLU(X A_r) B_r``. The output is the
  sum over ranks, ``Y = Σ_r Y_r``: one all-reduce. Its bias is added once, after the sum.

Two conjugate autograd operations carry the communication (Megatron's ``f`` and ``g``):

* :class:`CopyToTensorParallel` (``f``): the identity forward (every rank uses the same X);
  the backward all-reduces the gradient of X, since each rank's slice contributed a part;
* :class:`ReduceFromTensorParallel` (``g``): the all-reduce forward (the row layer's sum);
  the backward is the identity — because everything after ``g`` runs identically on every
  rank, so the gradient arriving at its output is the same (replicated) on every rank, and
  the sum's gradient reaches every term unchanged. (In general the backward of a sum
  all-reduce is itself an all-reduce of the ranks' output gradients; with replicated ones that
  sum would count the one gradient t times. torch's DTensor keeps such a gradient Replicate,
  ``distributed/tensor/_redistribute.py``, ``_redistribute_backward``.)

So one MLP costs two all-reduces per micro-batch, one in the forward, one in the backward, each of
the activations' size (batch × tokens × d), whatever the number of parameters. The ``f``
backward is needed only when something below the MLP wants the gradient of X (a layer before
it, as in every real model); with an input that does not require grad autograd skips it.

This module also holds the lesson's workers (run on every rank through
:func:`dpcourse.launch.spawn`): :func:`tensor_parallel_worker` (ours against the plain MLP and
against torch's ``parallelize_module``, with the collectives recorded),
:func:`sequence_parallel_worker` (torch's sequence-parallel layout: each all-reduce split into
an all-gather and a reduce-scatter), :func:`mesh_2d_worker` (a 2 × 2 mesh: FSDP2 over one
dimension, tensor parallel over the other, against one device), and two that show where data
parallelism ends: :func:`activation_memory_worker` (FSDP2 shards
the parameters, not the activations) and :func:`noise_scale_worker` (the gradient noise scale
measured inside a DDP run, McCandlish et al. 2018).

What runs on CPU with gloo (torch 2.14.1, tests/test_tensor_parallel.py): all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import record_collectives
from .dp_limits import (_quiet, activation_memory_worker, attention_saved, noise_model,
                        noise_scale_from_norms, noise_scale_worker, noise_task,
                        per_example_noise_scale)

__all__ = [
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "shard_bounds",
    "slice_of",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "plain_mlp",
    "TPConfig",
    "tensor_parallel_worker",
    "sequence_parallel_worker",
    "mesh_2d_worker",
    "noise_scale_from_norms",
    "noise_task",
    "noise_model",
    "noise_scale_worker",
    "per_example_noise_scale",
    "activation_memory_worker",
]


# --------------------------------------------------------------------------------------------
# 1. The two conjugate operations
# --------------------------------------------------------------------------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity in the forward, all-reduce (sum) of the gradient in the
    backward, over the tensor-parallel ``group`` (None: every rank).

    Shown in lesson 11, §2.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) in the forward, identity in the backward — right
    because the gradient reaching its output is replicated (every rank computes the same loss
    from the same summed output), so each rank's partial output gets that gradient as is.

    Shown in lesson 11, §2.
    """

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``f``: see :class:`CopyToTensorParallel`. Shown in lesson 11, §2."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``g``: see :class:`ReduceFromTensorParallel`. Shown in lesson 11, §2."""
    return ReduceFromTensorParallel.apply(x, group)


# --------------------------------------------------------------------------------------------
# 2. Column- and row-parallel linear layers
# --------------------------------------------------------------------------------------------


def shard_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's equal slice of ``size``; refuses a size that does not divide.

    Megatron cuts the hidden dimension into equal slices; uneven slices would be possible but
    every rank's matmul would differ in shape. Shown in lesson 11, §2.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if size % world_size:
        raise ValueError(f"a dimension of {size} does not split into {world_size} equal slices "
                         f"(tensor parallelism needs it divisible by the number of ranks)")
    per = size // world_size
    return rank * per, (rank + 1) * per


def _group_rank(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(nn.Module):
    """The first linear layer of a tensor-parallel MLP: this rank's slice of the OUTPUT features.

    Built from a full ``nn.Linear(d, h)``: keeps rows [start, stop) of its weight (``h × d`` in
    torch's layout, so rows are output features — columns of Megatron's ``A``) and the same
    slice of its bias. The forward passes the input through ``f`` (identity; all-reduce of the
    input's gradient in the backward) and returns this rank's slice of the output, ``x W_r^T +
    b_r``, with no communication. Shown in lesson 11, §2.
    """

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        rank, n = _group_rank(group)
        start, stop = shard_bounds(full.out_features, rank, n)
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[start:stop].clone())
        self.bias = (nn.Parameter(full.bias.detach()[start:stop].clone())
                     if full.bias is not None else None)

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The second linear layer: this rank's slice of the INPUT features, outputs summed.

    Built from a full ``nn.Linear(h, d)``: keeps columns [start, stop) of its weight (input
    features — rows of Megatron's ``B``) and the WHOLE bias, on every rank. The forward
    multiplies this rank's hidden slice by its columns, sums the partial outputs over the ranks
    with ``g`` (all-reduce forward, identity backward), and only then adds the bias: once, not
    N times. Every rank's bias gets the same gradient, so the copies stay equal.
    Shown in lesson 11, §2.
    """

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        rank, n = _group_rank(group)
        start, stop = shard_bounds(full.in_features, rank, n)
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[:, start:stop].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x_slice):
        y = reduce_from_tensor_parallel(F.linear(x_slice, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class TensorParallelMLP(nn.Module):
    """Megatron's MLP on the ranks of ``group``: column-parallel, GeLU, row-parallel. Built
    from a plain ``Sequential(Linear(d, h), GELU(), Linear(h, d))`` (:func:`plain_mlp`), whose
    weights it slices; equal to it in outputs and gradients. Shown in lesson 11, §2.
    """

    def __init__(self, plain: nn.Sequential, group=None):
        super().__init__()
        first, act, second = plain
        self.up = ColumnParallelLinear(first, group)
        self.act = act
        self.down = RowParallelLinear(second, group)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def plain_mlp(d: int = 16, h: int = 64, seed: int = 0) -> nn.Sequential:
    """The plain MLP every version starts from: ``Linear(d, h)``, GeLU, ``Linear(h, d)``, with
    weights from ``seed`` (every rank builds the same). Shown in lesson 11, §2."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))


# --------------------------------------------------------------------------------------------
# 3. Workers
# --------------------------------------------------------------------------------------------


@dataclass
class TPConfig:
    """The MLP and its data: width d, hidden h (4d as in a transformer), a batch of ``tokens``
    input rows (batch × sequence, flattened), optimizer steps of the 2-D run.
    Shown in lesson 11, §2."""

    d: int = 16
    h: int = 64
    tokens: int = 8
    steps: int = 3
    lr: float = 0.01
    seed: int = 0

    @property
    def num_params(self) -> int:
        return 2 * self.d * self.h + self.h + self.d

    def inputs(self, step: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1009 + step + 1)
        return torch.randn(self.tokens, self.d, generator=g)

    @staticmethod
    def loss(y: torch.Tensor) -> torch.Tensor:
        return y.pow(2).mean()


def slice_of(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank's equal slice of ``full`` along ``dim`` (:func:`shard_bounds`): what a
    tensor-parallel rank should hold, or its gradient should equal. Shown in lesson 11, §2."""
    start, stop = shard_bounds(full.shape[dim], rank, world_size)
    return full.narrow(dim, start, stop - start)


def tensor_parallel_worker(rank: int, world_size: int, cfg: TPConfig) -> dict:
    """On every rank: the plain MLP, ours (:class:`TensorParallelMLP`) and torch's
    (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``), from the same
    weights, one forward and backward on the same input (which requires grad, as it would if a
    layer came before the MLP). Returns the largest differences (outputs, input gradients, each
    shard's weight and bias gradients against the same slice of the plain MLP's), both
    MLPs' gradients themselves (``grads``: this rank's, in the plain MLP's parameter order,
    ``plain_grads``), our
    collectives as recorded (``collectives.record_collectives``) in the forward and in the backward,
    torch's as counted by its ``CommDebugMode``, and what each rank holds (shapes).
    Shown in lesson 11, §2.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    _quiet()
    torch.set_num_threads(1)
    plain = plain_mlp(cfg.d, cfg.h, cfg.seed)
    x_plain = cfg.inputs().requires_grad_(True)
    y_plain = plain(x_plain)
    cfg.loss(y_plain).backward()

    ours = TensorParallelMLP(plain_mlp(cfg.d, cfg.h, cfg.seed))
    x_ours = cfg.inputs().requires_grad_(True)
    with record_collectives() as forward_calls:
        y_ours = ours(x_ours)
    with record_collectives() as backward_calls:
        cfg.loss(y_ours).backward()

    pairs = [  # (the plain gradient's slice, our local gradient)
        (slice_of(plain[0].weight.grad, 0, rank, world_size), ours.up.weight.grad),
        (slice_of(plain[0].bias.grad, 0, rank, world_size), ours.up.bias.grad),
        (slice_of(plain[2].weight.grad, 1, rank, world_size), ours.down.weight.grad),
        (plain[2].bias.grad, ours.down.bias.grad),
    ]
    grad_diff = max(float((a - b).abs().max()) for a, b in pairs)

    mesh = init_device_mesh("cpu", (world_size,))
    theirs = parallelize_module(plain_mlp(cfg.d, cfg.h, cfg.seed), mesh,
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x_theirs = cfg.inputs().requires_grad_(True)
    with CommDebugMode() as comm, record_collectives() as torch_calls:
        y_theirs = theirs(x_theirs)
        forward_counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        cfg.loss(y_theirs).backward()
        total_counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    local = [(name, type(p).__name__, tuple(p.shape), tuple(p.to_local().shape),
              str(p.placements[0])) for name, p in theirs.named_parameters()]
    theirs_vs_ours = max(
        float((theirs[0].weight.grad.to_local() - ours.up.weight.grad).abs().max()),
        float((theirs[0].bias.grad.to_local() - ours.up.bias.grad).abs().max()),
        float((theirs[2].weight.grad.to_local() - ours.down.weight.grad).abs().max()),
        float((theirs[2].bias.grad.to_local() - ours.down.bias.grad).abs().max()))
    return {
        "out_diff": float((y_ours - y_plain).abs().max()),
        "input_grad_diff": float((x_ours.grad - x_plain.grad).abs().max()),
        "grad_diff": grad_diff,
        "grads": [ours_grad.detach().clone() for _, ours_grad in pairs],   # this rank's
        "plain_grads": [p.grad.detach().clone() for p in plain.parameters()],  # in that order
        "forward": [(c.op, c.numel, c.nbytes) for c in forward_calls],
        "backward": [(c.op, c.numel, c.nbytes) for c in backward_calls],
        "ours_shapes": {name: tuple(p.shape) for name, p in ours.named_parameters()},
        "plain_shapes": {name: tuple(p.shape) for name, p in plain.named_parameters()},
        "torch_out_diff": float((torch.as_tensor(y_theirs) - y_ours).abs().max()),
        "torch_input_grad_diff": float((x_theirs.grad - x_ours.grad).abs().max()),
        "torch_grad_diff": theirs_vs_ours,
        "torch_forward_counts": forward_counts,
        "torch_counts": total_counts,
        "torch_recorded": [(c.function, c.op, c.numel, c.nbytes) for c in torch_calls],
        "torch_params": local,
    }


def sequence_parallel_worker(rank: int, world_size: int, cfg: TPConfig) -> dict:
    """torch's *sequence-parallel* layout of the same MLP (Korthikanti et al. 2022): outside the
    MLP each rank holds only its share of the tokens (``Shard(0)``), so the column layer's
    input is all-gathered (``ColwiseParallel(input_layouts=Shard(0))``) and the row layer's
    partial output reduce-scattered back to the token shards
    (``RowwiseParallel(output_layouts=Shard(0))``) — the pairs that async tensor parallelism
    can fuse with their matmuls. Each rank's loss is its tokens' share of the plain MLP's
    (their squares summed, divided by all tokens × d), so the sum over ranks is the plain loss.
    Returns the largest differences with the plain MLP (this rank's output rows, its rows of
    dL/dx, the parameters' gradients gathered whole), the collectives recorded in each
    pass (the gathering afterwards is not recorded) and the local shape of every tensor
    autograd saved in the forward (``saved_tensors_hooks``): the column layer keeps its input
    as ``ColwiseParallel``'s input hook redistributed it, all tokens × d, not this rank's
    share — Megatron-LM saves only the share and all-gathers it again in the backward.
    Shown in lesson 11, §2.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    if cfg.tokens % world_size:
        raise ValueError(f"{cfg.tokens} tokens do not split over {world_size} ranks")
    _quiet()
    torch.set_num_threads(1)
    plain = plain_mlp(cfg.d, cfg.h, cfg.seed)
    x_plain = cfg.inputs().requires_grad_(True)
    cfg.loss(plain(x_plain)).backward()

    mesh = init_device_mesh("cpu", (world_size,))
    sp = parallelize_module(plain_mlp(cfg.d, cfg.h, cfg.seed), mesh,
                            {"0": ColwiseParallel(input_layouts=Shard(0)),
                             "2": RowwiseParallel(output_layouts=Shard(0))})
    share = cfg.tokens // world_size
    rows = slice(rank * share, (rank + 1) * share)
    mine = cfg.inputs()[rows].clone().requires_grad_(True)
    saved_shapes = []                    # what autograd keeps for the backward, local shapes

    def pack(t):
        saved_shapes.append(tuple((t.to_local() if hasattr(t, "to_local") else t).shape))
        return t

    with record_collectives() as forward_calls, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = sp(mine)
    with record_collectives() as backward_calls:
        (y.pow(2).sum() / (cfg.tokens * cfg.d)).backward()
    y_plain = plain(cfg.inputs()).detach()
    grads = max(float((p.grad.full_tensor() - q.grad).abs().max())
                for p, q in zip(sp.parameters(), plain.parameters()))
    return {"out_diff": float((y - y_plain[rows]).abs().max()),
            "input_grad_diff": float((mine.grad - x_plain.grad[rows]).abs().max()),
            "grad_diff": grads,
            "forward": [(c.op, c.numel, c.nbytes) for c in forward_calls],
            "backward": [(c.op, c.numel, c.nbytes) for c in backward_calls],
            "saved_shapes": saved_shapes}


def mesh_2d_worker(rank: int, world_size: int, cfg: TPConfig, dp: int = 2, tp: int = 2) -> dict:
    """A ``dp × tp`` DeviceMesh (4 ranks as 2 × 2): tensor parallel inside each row of the
    mesh, FSDP2 (``fully_shard``) across the rows — each row gets a different slice of every
    step's batch, as in data parallelism. Two versions, each trained ``cfg.steps`` Adam steps
    from the plain MLP's start, beside one device on the whole batch: ours
    (:class:`TensorParallelMLP` on the mesh's ``tp`` group, then ``fully_shard`` on the ``dp``
    one), with every collective recorded and sorted by dimension; and torch's
    (``parallelize_module`` on ``mesh["tp"]``, ``fully_shard`` on ``mesh["dp"]``).
    Shown in lesson 11, §4.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    if dp * tp != world_size:
        raise ValueError(f"a {dp} x {tp} mesh needs {dp * tp} ranks, got {world_size}")
    if cfg.tokens % dp:
        raise ValueError(f"{cfg.tokens} tokens do not split over {dp} data-parallel rows")
    _quiet()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    share = cfg.tokens // dp

    one = plain_mlp(cfg.d, cfg.h, cfg.seed)                  # one device, whole batch
    one_opt = torch.optim.Adam(one.parameters(), lr=cfg.lr)

    ours = TensorParallelMLP(plain_mlp(cfg.d, cfg.h, cfg.seed), group=mesh["tp"].get_group())
    fully_shard(ours, mesh=mesh["dp"])
    ours_opt = torch.optim.Adam(ours.parameters(), lr=cfg.lr)

    theirs = parallelize_module(plain_mlp(cfg.d, cfg.h, cfg.seed), mesh["tp"],
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(theirs, mesh=mesh["dp"])
    theirs_opt = torch.optim.Adam(theirs.parameters(), lr=cfg.lr)

    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    dims = []

    def which_dimension(call):    # runs before each recorded call: which group is it on?
        group = call.args.get("group")
        dims.append("tp" if group is tp_group else "dp" if group is dp_group else "other")

    traffic = []
    for step in range(cfg.steps):
        x = cfg.inputs(step)
        mine = x[dp_rank * share:(dp_rank + 1) * share]
        cfg.loss(one(x)).backward()
        one_opt.step()
        one_opt.zero_grad()
        dims.clear()
        with record_collectives(before=which_dimension) as calls:
            cfg.loss(ours(mine)).backward()
        ours_opt.step()
        ours_opt.zero_grad()
        traffic.append([(dim, c.op, c.numel, c.nbytes, c.out_nbytes)
                        for dim, c in zip(dims, calls)])
        cfg.loss(theirs(mine)).backward()
        theirs_opt.step()
        theirs_opt.zero_grad()

    # our layers hold tp slices, which FSDP2 shards further over dp (full_tensor undoes that).
    # Which slice of the plain parameter each must equal is what torch's placement of the same
    # parameter on the tp dimension says: Shard(d), this rank's slice along d; else the whole.
    ours_full = {name: p.full_tensor() for name, p in ours.named_parameters()}
    theirs_params = dict(theirs.named_parameters())
    plain_params = dict(one.named_parameters())
    on_tp = mesh.mesh_dim_names.index("tp")
    diffs = []
    for mine_name, plain_name in (("up.weight", "0.weight"), ("up.bias", "0.bias"),
                                  ("down.weight", "2.weight"), ("down.bias", "2.bias")):
        ref = plain_params[plain_name].detach()
        placement = theirs_params[plain_name].placements[on_tp]
        if placement.is_shard():
            ref = slice_of(ref, placement.dim, tp_rank, tp)
        diffs.append(float((ours_full[mine_name] - ref).abs().max()))
    torch_diff = max(float((p.full_tensor() - plain_params[name].detach()).abs().max())
                     for name, p in theirs.named_parameters())
    held = {name: (tuple(p.shape), tuple(p.to_local().shape)) for name, p in
            ours.named_parameters()}
    return {"coords": (dp_rank, tp_rank), "ours_diff": max(diffs), "torch_diff": torch_diff,
            "traffic": traffic, "held": held,
            "torch_placements": {name: str(p.placements) for name, p in
                                 theirs.named_parameters()}}
