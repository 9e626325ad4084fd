"""Sharded data parallelism: ZeRO stages 1-3 from scratch, then FSDP2 (lesson 08, lab08).

DDP keeps a full copy of everything on every rank: the weights, the gradients and the optimizer
state. With mixed-precision Adam that is 16 bytes per parameter (ZeRO paper, Rajbhandari et al.
2020: 2 for the bf16 weights, 2 for the bf16 gradients, and K = 12 for the optimizer: an fp32
master copy of the weights, Adam's momentum and its variance), so N ranks hold N identical
copies. ZeRO removes the copies one kind at a time:

* stage 1 shards the optimizer state: each rank steps only its 1/N slice of the parameters;
* stage 2 shards the gradients too: a rank keeps only the gradient of its own slice;
* stage 3 shards the weights: a layer's full weights exist only while it computes.

This module holds the pieces the lesson shows, in this order:

1. memory: the paper's formula (:func:`bytes_per_param`), the same with padding
   (:func:`memory_per_rank`), what fits where (:func:`fits`), and :func:`count_bytes`, which
   counts the bytes a rank *really* holds, so the lesson can check counted == formula;
2. flat shards: :func:`flatten_padded`, :func:`reduce_scatter_mean`, :func:`all_gather_flat`;
3. the stages, one small class each, all used the same way inside a rank::

       opt = Zero2(model, make_optimizer)      # or Replicated, Zero1, Zero3
       for X, y in batches:
           opt.zero_grad()
           F.cross_entropy(model(X), y).backward()
           opt.step()                          # synchronises, steps its slice, restores weights

4. traffic: :func:`summarize_traffic` weighs one step's calls, recorded by
   :func:`dpcourse.collectives.record_collectives`, and :func:`traffic_per_step` predicts them.

The experiments that train every stage beside torch's own DDP, FSDP2 and
``ZeroRedundancyOptimizer`` (the workers lesson 08 launches) live in
:mod:`dpcourse.zero_experiments`.

Memory is counted with mixed precision, the setting of the formula; equality with DDP is
proven in fp32, where it holds to float rounding (in bf16 every stage rounds differently).

What runs on CPU with gloo (torch 2.14.1, checked by tests/test_zero.py): all of it.
``dist.reduce_scatter_single`` and ``dist.all_gather_single`` work on gloo (their older names
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` still work but warn that they are
deprecated), in fp32 and bf16.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .zero_accounting import (RING_WEIGHT, STAGES, bytes_per_param, count_bytes, fits,
                              fsdp2_padded_numel, memory_per_rank, optimizer_tensors, shard_numel,
                              summarize_traffic, traffic_per_step)

__all__ = [
    "STAGES",
    "bytes_per_param",
    "memory_per_rank",
    "fits",
    "count_bytes",
    "optimizer_tensors",
    "shard_numel",
    "flatten_padded",
    "grads_of",
    "copy_flat_into",
    "reduce_scatter_mean",
    "all_gather_flat",
    "Stage",
    "Replicated",
    "Zero1",
    "Zero2",
    "ShardedLayer",
    "Zero3",
    "WRAPPERS",
    "summarize_traffic",
    "traffic_per_step",
    "RING_WEIGHT",
    "fsdp2_padded_numel",
]


# --------------------------------------------------------------------------------------------
# 2. Flat shards
# --------------------------------------------------------------------------------------------


def flatten_padded(tensors, world_size: int) -> torch.Tensor:
    """The tensors as one new flat vector, zero-padded to a multiple of ``world_size`` so it
    cuts into N equal shards (collectives want equal pieces on every rank). One new buffer:
    the tensors are concatenated straight into it, so no unpadded copy exists beside it.

    Shown in lesson 08, §2.
    """
    tensors = list(tensors)
    numel = sum(t.numel() for t in tensors)
    flat = tensors[0].new_zeros(shard_numel(numel, world_size) * world_size)
    torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:numel])
    return flat


def grads_of(params) -> list[torch.Tensor]:
    """Each parameter's gradient, zeros where it has none (a parameter this backward did not
    reach), so that every rank flattens the same sizes into its collectives.

    Shown in lesson 08, §2.
    """
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def copy_flat_into(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (casting, e.g. fp32 -> bf16); the
    padding at the end of ``flat`` is ignored.

    Shown in lesson 08, §2.
    """
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def reduce_scatter_mean(flat: torch.Tensor) -> torch.Tensor:
    """Rank r gets shard r of the mean over the ranks of ``flat`` (length a multiple of N).

    Half of an all-reduce: a ring all-reduce *is* a reduce-scatter followed by an all-gather
    (lesson 06), and ZeRO stops after the first half because a rank only needs its own slice.
    gloo takes ``ReduceOp.AVG`` here too in torch 2.14 (one of lab 08's hints offers it as an
    option); we sum and divide,
    as lesson 03 did, so that the mean's division by N is a line you can see.

    Shown in lesson 08, §2.
    """
    n = dist.get_world_size()
    shard = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
    # torch 2.14 calls it reduce_scatter_single; torch before 2.14, reduce_scatter_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(shard, flat, op=dist.ReduceOp.SUM)
    return shard.div_(n)


def all_gather_flat(shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``shard``, concatenated in rank order (into ``out`` if given).

    Shown in lesson 08, §2.
    """
    if out is None:
        out = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype,
                          device=shard.device)
    # torch 2.14 calls it all_gather_single; torch before 2.14, all_gather_into_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, shard)
    return out


# --------------------------------------------------------------------------------------------
# 3. The stages
# --------------------------------------------------------------------------------------------


class Stage:
    """What every stage shares: start from rank 0's weights, forget gradients, say what it
    holds. Each stage keeps an fp32 master copy for the optimizer (K = 12 with Adam), as ZeRO
    does. With ``param_dtype=torch.float32`` that copy duplicates the weights (a plain fp32
    run would step the weights in place); we keep it so that fp32 — where the equality with
    DDP is tight — runs exactly the code that mixed precision runs.

    Shown in lesson 08, §2.
    """

    stage = ""

    def __init__(self, model: nn.Module, param_dtype: torch.dtype):
        self.model = model
        # The parameters the optimizer steps: frozen ones (requires_grad=False) get no
        # gradient and stay out of the flat buffers, as DDP and torch's optimizers leave them.
        # model.parameters() lists a tied (shared) parameter once.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_dtype = param_dtype
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.grad_slice = None
        for p in model.parameters():          # start from rank 0's weights, as DDP does
            dist.broadcast(p.data, src=0)
        self.units = [sum(p.numel() for p in self.params)]   # what is sharded, as one buffer

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.grad_slice = None

    def held_tensors(self) -> dict:
        """The tensors this rank keeps between steps, by category, for :func:`count_bytes`."""
        grads = [p.grad for p in self.params] + [self.grad_slice]
        return {"params": list(self.model.parameters()),
                "grads": [g for g in grads if g is not None],
                "optimizer": optimizer_tensors(self.optimizer)}

    def full_weights(self) -> torch.Tensor:
        """All the weights as one flat fp32 CPU vector (what ``ddp.flat_params`` gives)."""
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.model.parameters()])


class Replicated(Stage):
    """Stage 0, the baseline: DDP with fp32 master weights, everything on every rank.

    Lesson 03's loop (all-reduce the gradients, divide by N, step) with mixed precision: the
    model computes in ``param_dtype``; the optimizer steps an fp32 copy of all the weights,
    which is then cast back into the model. 2 + 2 + 12 = 16 bytes per parameter.

    Shown in lesson 08, §2.
    """

    stage = "ddp"

    def __init__(self, model, make_optimizer, param_dtype=torch.float32):
        super().__init__(model, param_dtype)
        self.master = flatten_padded(self.params, 1).float()   # fp32, all Ψ (N=1: no padding)
        model.to(param_dtype)
        self.optimizer = make_optimizer([self.master])

    def step(self) -> None:
        grad = flatten_padded(grads_of(self.params), 1)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)          # every rank: the whole sum
        self.master.grad = grad.div_(self.world_size).float()
        self.optimizer.step()
        self.master.grad = None                              # a temporary, as in the paper
        copy_flat_into(self.master, self.params)


class Zero1(Stage):
    """Stage 1: the optimizer state is sharded.

    See the model's parameters as one flat vector of Ψ numbers, padded to a multiple of N and
    cut into N slices. Rank r keeps the fp32 master copy and the Adam state of slice r only,
    and steps only that slice. Three changes from :class:`Replicated`:

    * the master is a slice, so the optimizer state is a slice: K·Ψ/N bytes instead of K·Ψ;
    * the gradients are reduce-scattered, not all-reduced: a rank needs the averaged gradient
      of its own slice only — and a reduce-scatter is half an all-reduce;
    * after the step an all-gather brings every rank everyone's new slices: the other half.
      Reduce-scatter + all-gather = all-reduce, so ZeRO-1 sends what DDP sends.

    The full (local) gradients still exist, as in DDP: 2 + 2 + 12/N bytes per parameter.

    Shown in lesson 08, §2.
    """

    stage = "zero1"

    def __init__(self, model, make_optimizer, param_dtype=torch.float32):
        super().__init__(model, param_dtype)
        flat = flatten_padded(self.params, self.world_size).float()
        self.shard = flat.numel() // self.world_size
        start = self.rank * self.shard
        self.master = flat[start:start + self.shard].clone()   # my slice; the rest is dropped
        model.to(param_dtype)
        self.optimizer = make_optimizer([self.master])         # state for my slice only

    def gradient_slice(self) -> torch.Tensor:
        grad = flatten_padded(grads_of(self.params), self.world_size)
        return reduce_scatter_mean(grad)                       # the mean, my slice only

    def step(self) -> None:
        self.master.grad = self.gradient_slice().float()
        self.optimizer.step()
        self.master.grad = None
        full = all_gather_flat(self.master.to(self.param_dtype))   # everyone's new slices
        copy_flat_into(full, self.params)


class Zero2(Zero1):
    """Stage 2: the gradients are sharded too. One change from :class:`Zero1`: once the
    gradients are reduce-scattered, a rank drops the full ones and keeps its slice only
    (2 + 14/N bytes per parameter at rest).

    A caveat of this short version: the full gradient still exists for a moment, between the
    backward and the reduce-scatter — beside step()'s flat copy of it, which the
    reduce-scatter sends — so its peak is no lower than ZeRO-1's. Reduce-scattering
    bucket by bucket *during* the backward (lesson 07's hooks) avoids that: lab 08 asks for
    it; :class:`Zero3` below uses the same hook, per layer.

    Shown in lesson 08, §3.
    """

    stage = "zero2"

    def gradient_slice(self) -> torch.Tensor:
        self.grad_slice = super().gradient_slice()
        for p in self.params:
            p.grad = None               # never needed again: the rest belongs to other ranks
        return self.grad_slice


class ShardedLayer:
    """One layer of :class:`Zero3`: its weights live as a 1/N shard; the full weights exist
    only between a gather and the next free.

    The layer's parameters become views into one flat buffer, ``self.full``. Freeing resizes
    that buffer's storage to 0 bytes, gathering gives it its bytes back and all-gathers the
    shards into it. The parameters — and the views of them that autograd saved in the forward
    — all point into that one storage, so a re-gather before the backward is seen by them all.
    ``modules``: every module that computes with these parameters (two, for a tied weight);
    each gathers before its forward and frees after it.

    Shown in lesson 08, §4.
    """

    def __init__(self, params, modules, param_dtype: torch.dtype, rank: int, world_size: int):
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.world_size = world_size
        flat = flatten_padded(self.params, world_size).float()
        n = flat.numel() // world_size
        self.master = flat[rank * n:(rank + 1) * n].clone()     # fp32, stepped by the optimizer
        self.shard = self.master.to(param_dtype)   # what is all-gathered (in fp32: the master)
        self.grad_slice = None
        self.full = torch.empty(flat.numel(), dtype=param_dtype, device=flat.device)
        offset = 0
        for p in self.params:
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.free()
        self._waiting = len(self.params)          # gradients still to come in this backward
        for module in modules:
            module.register_forward_pre_hook(lambda mod, args: self.gather())
            module.register_forward_hook(self._after_forward)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def gather(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full.numel() * self.full.element_size())
            all_gather_flat(self.shard, out=self.full)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _after_forward(self, module, args, output):
        self.free()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # The backward of this layer needs its weights again: this hook runs when the
            # gradient of the layer's output is ready, just before the layer's backward.
            output.register_hook(lambda grad: self.gather())

    def _grad_ready(self, p) -> None:
        self._waiting -= 1
        if self._waiting:
            return
        self._waiting = len(self.params)          # all of this layer's gradients are in
        grad = flatten_padded(grads_of(self.params), self.world_size)
        for q in self.params:
            q.grad = None
        self.free()       # as FSDP2's post_backward: the weights go before the reduce-scatter
        self.grad_slice = reduce_scatter_mean(grad)


class Zero3(Stage):
    """Stage 3 (what FSDP does): the weights are sharded too, layer by layer.

    Each module that owns parameters (here each ``nn.Linear``) becomes a :class:`ShardedLayer`;
    every rank keeps 1/N of each layer: bf16 weights, bf16 gradient, fp32 master and Adam
    state, 16/N bytes per parameter. A layer's full weights exist only while it computes:

    * forward: all-gather before the layer (a forward pre-hook), free after it (a forward
      hook);
    * backward: all-gather again when the gradient of its output arrives (a hook on the output
      tensor); once the layer's gradients are complete, free the weights, then reduce-scatter
      the gradients — FSDP2's order with its defaults (lesson 08, §6, reads it in torch's
      source), so the full weights and the full gradient are not both
      alive during the reduce-scatter.

    Three collectives over every weight per step — all-gather, all-gather, reduce-scatter —
    against DDP's all-reduce (= two): 1.5x DDP's traffic, counted in elements (bytes depend on
    the dtypes of the gathers and of the reduce). That 3Ψ holds for one forward and one
    backward per step with each layer used once: gradient accumulation gathers again for every
    micro-batch, and a tied parameter belongs to the first module that owns it, so every
    other module using it gathers that layer again (one more all-gather per extra use: above
    3Ψ). There is no all-gather after the step: the next forward gathers.
    Frozen parameters (requires_grad=False) are not sharded here: they stay whole on every
    rank, as in DDP (FSDP2 shards them too, and never reduces their gradients).

    Shown in lesson 08, §4.
    """

    stage = "zero3"

    def __init__(self, model, make_optimizer, param_dtype=torch.float32):
        super().__init__(model, param_dtype)
        owner: dict = {}                      # parameter -> the module that shards it
        users: dict = {}                      # that module -> every module computing with it
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    first = owner.setdefault(p, module)
                    users.setdefault(first, [])
                    if module not in users[first]:
                        users[first].append(module)
        self.layers = []
        for module, modules in users.items():
            mine = [p for p in module.parameters(recurse=False) if owner.get(p) is module]
            self.layers.append(ShardedLayer(mine, modules, param_dtype, self.rank,
                                            self.world_size))
        self.params = [p for layer in self.layers for p in layer.params]   # layer by layer
        for p in model.parameters():
            if not p.requires_grad:           # frozen: whole on every rank, in param_dtype
                p.data = p.data.to(param_dtype)
        self.units = [layer.numel for layer in self.layers]   # sharded one by one
        self.optimizer = make_optimizer([layer.master for layer in self.layers])

    def step(self) -> None:
        for layer in self.layers:
            layer.master.grad = (layer.grad_slice.float() if layer.grad_slice is not None
                                 else torch.zeros_like(layer.master))
        self.optimizer.step()
        for layer in self.layers:
            layer.master.grad = None
            with torch.no_grad():
                layer.shard.copy_(layer.master)     # cast the new fp32 slice to bf16

    def zero_grad(self) -> None:
        for layer in self.layers:
            layer.grad_slice = None

    def held_tensors(self) -> dict:
        # The model's own parameters are listed to show they hold nothing between uses.
        return {"params": [layer.shard for layer in self.layers] + list(self.model.parameters()),
                "grads": [layer.grad_slice for layer in self.layers
                          if layer.grad_slice is not None],
                "optimizer": optimizer_tensors(self.optimizer)}

    @contextlib.contextmanager
    def gathered(self):
        """All layers' full weights, for the block (to save or compare them); a collective."""
        for layer in self.layers:
            layer.gather()
        try:
            yield self.model
        finally:
            for layer in self.layers:
                layer.free()

    def full_weights(self) -> torch.Tensor:
        with self.gathered():
            return super().full_weights()


WRAPPERS = {"ddp": Replicated, "zero1": Zero1, "zero2": Zero2, "zero3": Zero3}
