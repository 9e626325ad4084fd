"""What lab 04's ``evaluate_f1`` exchanges: a spy for :mod:`dpcourse.checks.lab04`.

For each rank it records how many numbers the rank passes into its collectives (its budget is
2 per class), whether it averaged with ``ReduceOp.AVG``, the first tensor it passes in a dtype
that cannot hold every whole number up to :data:`REAL_TEST_IMAGES` exactly (``float16`` stops at
2048, ``bfloat16`` at 256: the check's test sets of about 300 images never reach that, the
contract's real one does), and whether each tensor it passes lives on the ``device`` it was
given.

The last one needs a trick. The check runs on CPU ranks (gloo), where every tensor is on the
CPU, so a tensor made without ``device=`` is taken there; on GPUs under NCCL the same call
raises (``RuntimeError: No backend type associated with device type cpu``, seen on an H100 with
torch 2.11). So :class:`WhereTensorsLive`, a ``TorchFunctionMode``, follows where each tensor
*would* live: on the device when it was made with ``device=`` the evaluation's device, moved
with ``.to(device)`` or ``.cuda()``, or computed from a tensor on the device (the model's
parameters are); on the host when made without a device, moved with ``.cpu()``, or computed
from host tensors only. An in-place op keeps its target where it was (on a GPU, adding a device
tensor into a host one raises). Where torch returns the tensor itself for a move (the CPU is
already where it is), the spy returns a copy, as a GPU would, so that both keep their own mark.
Iterating over a tensor (``tp, both = counts``) keeps the rows where the tensor was. A device
written out (``device="cpu"``, ``.to("cpu")``) names the host unless it equals ``device``, and
the spy notes it for the sentence: so the check hands ``evaluate_f1`` ``torch.device("cpu", 0)``,
which computes on the CPU but differs from ``"cpu"``, and ``t.device`` of a tensor on the device
answers that same ``device`` (as ``cuda:0`` would on a GPU). With a ``device`` equal to the CPU
(the spy's own test) ``"cpu"`` cannot be told apart: such a tensor counts as on the device.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["WhereTensorsLive", "ExchangeSpy", "on_device", "mark", "count_numbers",
           "exact_up_to", "REAL_TEST_IMAGES"]

# The contract's real test set ("a real one has 10^5 images"): every count of it must travel
# exactly, so a dtype whose whole numbers stop below it is refused.
REAL_TEST_IMAGES = 10 ** 5

_MARK = "_dpcourse_lab04_on_device"
_NAMED = "_dpcourse_lab04_named_host"  # the device written out for a tensor put off `device`
_IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
             "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
             "__setitem__"}


def on_device(t) -> bool:
    """Whether tensor ``t`` would live on the evaluation's device (see the module's docstring)."""
    return bool(getattr(t, _MARK, False))


def mark(value, where: bool) -> None:
    """Set where the tensors in ``value`` (a tensor, or a list or tuple of them) would live."""
    if isinstance(value, torch.Tensor):
        try:
            setattr(value, _MARK, where)
        except (AttributeError, RuntimeError):  # a tensor that takes no attribute: unknown
            pass
    elif isinstance(value, (list, tuple)):
        for v in value:
            mark(v, where)


class WhereTensorsLive(TorchFunctionMode):
    """Within it, every torch function's tensor result is marked on the device or on the host,
    as it would be where ``device`` is a GPU."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)

    def _names_the_device(self, target) -> bool:
        if isinstance(target, torch.Tensor):
            return on_device(target)
        try:
            return torch.device(target) == self.device
        except (TypeError, RuntimeError, ValueError):
            return False

    def _mark_named(self, out, target) -> None:
        """Mark ``out`` on the device if ``target`` names it, else on the host, noting the
        device written out (``device="cpu"``): on a GPU that is the host, not this rank's GPU."""
        where = self._names_the_device(target)
        mark(out, where)
        if not where and not isinstance(target, torch.Tensor) and isinstance(out, torch.Tensor):
            try:
                setattr(out, _NAMED, str(target))
            except (AttributeError, RuntimeError):
                pass

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if (name == "__get__" and isinstance(out, torch.device)
                and getattr(getattr(func, "__self__", None), "__name__", "") == "device"):
            # t.device: a tensor on the device answers `device` itself, as on a GPU it would
            return self.device if isinstance(first, torch.Tensor) and on_device(first) else out
        if name in _IN_PLACE or (name.endswith("_") and not name.startswith("_")):
            return out  # in place: the target stays where it was
        if name == "__iter__" and isinstance(first, torch.Tensor):
            rows = list(out)  # unbound inside torch, where this mode does not look
            mark(rows, on_device(first))
            return iter(rows)
        if name in ("cuda", "cpu", "to") and isinstance(first, torch.Tensor):
            where = name == "cuda"
            if name == "to":
                targets = [a for a in args[1:] if not isinstance(a, (torch.dtype, bool))]
                targets += [kwargs[k] for k in ("device", "other") if kwargs.get(k) is not None]
                where = self._names_the_device(targets[0]) if targets else on_device(first)
            if out is first and where != on_device(first):
                out = first.clone()  # on a GPU a move makes a new tensor; here torch returns self
            if name == "to" and targets:
                self._mark_named(out, targets[0])
            else:
                mark(out, where)
        elif kwargs.get("device") is not None:
            self._mark_named(out, kwargs["device"])
        else:
            mark(out, any(on_device(t) for t in _tensors_in(args, kwargs)))
        return out


# Arguments that are tensors or hold none, the types torch's own functions are mostly called
# with (an image's index, a dtype, a shape, a list of tensors to stack ...): _tensors_in reads
# them without torch's pytree, which cost about half of an evaluation's time inside the mode
# (every image the DataLoader indexes passes through it).
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_NO_TENSORS = frozenset((type(None), bool, int, float, complex, str, slice, type(Ellipsis),
                         torch.dtype, torch.device, torch.layout, torch.memory_format,
                         torch.Size))


def _plain_tensors(values, found: list) -> bool:
    """Append the tensors of ``values`` to ``found``, looking inside plain lists and tuples;
    False at the first value of any other type (pytree may flatten it)."""
    for v in values:
        kind = type(v)
        if kind in _TENSOR_TYPES:
            found.append(v)
        elif kind is tuple or kind is list:
            if not _plain_tensors(v, found):
                return False
        elif kind not in _NO_TENSORS:
            return False
    return True


def _tensors_in(args, kwargs) -> list:
    """The tensors among ``tree_leaves((args, kwargs))``: read directly where the arguments are
    tensors, values of ``_NO_TENSORS`` and plain lists and tuples of them (the same tensors);
    else flattened by pytree."""
    found: list = []
    if _plain_tensors(args, found) and _plain_tensors(kwargs.values(), found):
        return found
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def count_numbers(value) -> int:
    """How many numbers ``value`` holds: a tensor's elements, a NumPy array's, 1 per Python
    number, summed through lists, tuples, sets and dicts' values."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, bool) or isinstance(value, (int, float, complex)):
        return 1
    if isinstance(value, dict):
        return sum(count_numbers(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(count_numbers(v) for v in value)
    size = getattr(value, "size", None)
    if isinstance(size, int) and hasattr(value, "dtype"):  # a NumPy array or scalar
        return size
    return 0


def exact_up_to(dtype) -> int:
    """The largest n such that every whole number 0..n is exact in ``dtype``: 2^(mantissa bits
    + 1) for a floating dtype (2 / eps: float16 2048, bfloat16 256, float32 16,777,216), the
    largest value of an integer dtype (uint8 255), 1 for bool."""
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point or dtype.is_complex:
        return int(round(2 / torch.finfo(dtype).eps))
    return int(torch.iinfo(dtype).max)


def _after_the_limit(dtype, limit: int) -> str:
    """What ``limit + 1`` becomes in ``dtype`` (float16: 2049 -> 2048; int16 wraps), as text."""
    try:
        value = torch.tensor(limit + 1).to(dtype).item()
    except (RuntimeError, TypeError):
        return ""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{limit + 1:,} becomes {value:,}"


# The argument holding what a rank puts into each collective, and the one it receives into
# (their tensors must be on the device too); a broadcast's sender is ``src``.
_SENT = {"all_reduce": "tensor", "all_reduce_coalesced": "tensors", "reduce": "tensor",
         "broadcast": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
         "_all_gather_base": "input_tensor", "all_gather_coalesced": "input_tensor_list",
         "gather": "tensor", "scatter": "scatter_list", "reduce_scatter": "input_list",
         "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input",
         "all_to_all_single": "input", "all_to_all": "input_tensor_list", "send": "tensor",
         "isend": "tensor", "all_gather_object": "obj", "gather_object": "obj",
         "broadcast_object_list": "object_list", "scatter_object_list": "scatter_object_input_list",
         "send_object_list": "object_list"}
_RECEIVED = {"all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor",
             "_all_gather_base": "output_tensor", "gather": "gather_list", "scatter": "tensor",
             "reduce_scatter": "output", "reduce_scatter_tensor": "output",
             "_reduce_scatter_base": "output", "all_to_all_single": "output",
             "all_to_all": "output_tensor_list", "recv": "tensor", "irecv": "tensor"}
_FROM_SOURCE = {"broadcast", "broadcast_object_list", "scatter", "scatter_object_list"}
_TO_ONE = {"reduce", "gather", "gather_object"}  # only the destination rank gets the result


class ExchangeSpy:
    """The ``before`` hook of :func:`dpcourse.collectives.record_collectives` for one rank:
    it adds up the numbers the rank sends and notes the first tensor that is not on the
    device and any ``ReduceOp.AVG``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.numbers = 0
        self.off_device: str | None = None
        self.off_named: str | None = None  # the device written out for it (device="cpu")
        self.averaged = False
        self.narrow: dict | None = None  # the first tensor in a dtype that stops below 10^5
        self.to_one: list = []  # (collective, destination) of those whose result one rank gets

    def before(self, call) -> None:
        import torch.distributed as dist

        args = call.args or {}
        name = call.function
        sent = args.get(_SENT.get(name, ""))
        source = args.get("src", args.get("group_src", 0))
        if name not in _FROM_SOURCE or source in (None, self.rank):
            self.numbers += count_numbers(sent)
        if args.get("op") is not None and args["op"] == dist.ReduceOp.AVG:
            self.averaged = True
        if name in _TO_ONE:
            dst = args.get("dst", args.get("group_dst"))
            self.to_one.append((name, 0 if dst is None else int(dst)))
        if self.narrow is None:
            for t in tree_leaves(sent):
                if isinstance(t, torch.Tensor) and exact_up_to(t.dtype) < REAL_TEST_IMAGES:
                    limit = exact_up_to(t.dtype)
                    self.narrow = {"collective": name, "shape": tuple(t.shape),
                                   "dtype": str(t.dtype), "limit": limit,
                                   "after": _after_the_limit(t.dtype, limit)}
                    break
        if name.endswith("_object") or name.endswith("_object_list"):
            return  # object collectives put their bytes on the right device themselves
        for value in (sent, args.get(_RECEIVED.get(name, ""))):
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and not on_device(t) and self.off_device is None:
                    self.off_device = (f"the tensor of shape {tuple(t.shape)} that rank "
                                       f"{self.rank} passed to {name}")
                    self.off_named = getattr(t, _NAMED, None)
