"""Lab 03's device watch: a tensor that a factory function made without ``device=`` follows the
default device (the CPU), which gloo accepts and NCCL refuses. The watch notes such tensors and
refuses them, on every rank, before the collective they are handed to (parts 1 and 4 and the
count of part 1's prediction use it). Used by :mod:`dpcourse.checks.lab03`."""

from __future__ import annotations

import torch

from . import fail

class _Unplaced(Exception):
    """Raised on every rank, before the collective, when a tensor handed to it follows the
    default device rather than the gradients' (the same call on every rank: no rank waits)."""


def _placement_mode():
    """A TorchFunctionMode that remembers the tensors a factory function (``torch.tensor``,
    ``torch.zeros``, ... — the ones ``torch.set_default_device`` redirects) made without a
    ``device=``, and what is computed from such tensors alone. They live on the default device,
    the CPU, wherever the gradients are: under gloo on the CPU nothing shows, under NCCL the
    collective refuses them. Naming a device afterwards (``.to(dev)``, ``.to(p.grad)``,
    ``.cuda()``, ``.type_as(p.grad)``) places the result; ``*_like`` and ``new_*`` follow their
    input tensor's device, so they never count as unplaced."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors
    from torch.utils._pytree import tree_leaves

    constructors = _device_constructors()
    moves = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as}

    class Placement(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.unplaced = []          # kept alive: identity is what is compared

        def is_unplaced(self, t) -> bool:
            return any(t is u for u in self.unplaced)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            named = kwargs.get("device") is not None or (func in moves and (
                func is not torch.Tensor.to
                or any(isinstance(a, (torch.device, str, int, torch.Tensor)) for a in args[1:])))
            if func in constructors:
                if not named:
                    self.unplaced.extend(outs)
            elif named:
                self.unplaced = [u for u in self.unplaced if not any(u is o for o in outs)]
            else:
                ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                if ins and all(self.is_unplaced(t) for t in ins):
                    self.unplaced.extend(o for o in outs if not self.is_unplaced(o))
            return out

    return Placement()


class _DeviceWatch:
    """Run the learner's function under :func:`_placement_mode` with a spy on its collectives:
    the first tensor handed to a collective that a factory function made without a device (and
    what was computed from it alone) is noted in ``seen`` — never raised there, since a rank
    that stopped in the spy would leave the others waiting in the call. Parts 1, 4 and the
    stretch share it; :func:`_refuse_unplaced` turns a note into the sentence."""

    def __init__(self, dev):
        self.placement = _placement_mode()
        self.grad_device = str(torch.device(dev) if dev is not None else torch.device("cpu"))
        self.seen: list = []

    def spy(self, call) -> None:
        for v in (call.args or {}).values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and self.placement.is_unplaced(t) \
                        and not self.seen:
                    self.seen.append({"op": call.op, "shape": str(tuple(t.shape)),
                                      "device": str(t.device), "grad_device": self.grad_device})

    def run(self, fn, *args, before=None):
        """``fn(*args)`` watched; returns the collectives' log. ``before``: another spy."""
        from ..collectives import record_collectives

        def both(call):
            self.spy(call)
            if before is not None:
                before(call)

        try:
            with record_collectives(before=both) as calls, self.placement:
                fn(*args)
        finally:
            self.placement.unplaced.clear()
        return calls


def _refuse_unplaced(results: list, where: str = "") -> None:
    """A tensor handed to a collective followed the default device on some rank: refused with
    the cause (gloo accepts it, NCCL on GPUs does not)."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        if r.get("unplaced"):
            u = r["unplaced"]
            fail(f"{where}on rank {rank} the tensor of shape {u['shape']} handed to "
                 f"dist.{u['op']} was made by a factory function (torch.tensor, torch.zeros, "
                 f"...) without a device=, so it lives on the default device ({u['device']}) "
                 f"whatever device the gradients are on ({u['grad_device']} here): gloo on the "
                 f"CPU accepts it, but on GPUs, where the gradients live on cuda:<rank>, NCCL "
                 f"refuses a CPU tensor — the contract asks for every tensor you hand to a "
                 f"collective to live on the gradients' device.",
                 fix="create it on the gradients' device: pass device=p.grad.device (or "
                     "build it with p.grad.new_tensor(...) / torch.full_like(...)).")
