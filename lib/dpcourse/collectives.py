"""Record every collective and point-to-point call a process makes through ``torch.distributed``.

One recorder for the whole course: lessons 07 and 08 count what DDP's comm hooks, our ZeRO
stages, FSDP2 and ``ZeroRedundancyOptimizer`` send; lesson 10's trace and the lab checks build
on its ``before``/``after`` hooks instead of patching ``torch.distributed`` themselves::

    with record_collectives() as calls:
        loss.backward()
    calls.count_by_op()      # {"all_reduce": 3}
    calls.bytes_by_op()      # {"all_reduce": 10124}
    print(calls.summarize())

What it sees, read in the installed torch 2.14.1 (``torch/distributed``):

* every function below called as ``torch.distributed.<name>`` (``dist.<name>``). That is how
  torch's own callers reach them: DDP's comm hooks (``algorithms/ddp_comm_hooks/default_hooks.py``
  and ``powerSGD_hook.py`` call ``dist.all_reduce``), FSDP2
  (``fsdp/_fully_shard/_fsdp_collectives.py`` calls ``dist.all_gather_single``,
  ``dist.reduce_scatter_single``, ``dist.all_reduce``, ``dist.barrier``),
  ``ZeroRedundancyOptimizer`` (``optim/zero_redundancy_optimizer.py``: ``dist.broadcast``), the
  autograd-aware ``torch.distributed.nn.functional`` and pipelining (``dist.batch_isend_irecv``);
* DTensor's collectives (tensor parallelism, ``parallelize_module``), which go through the
  functional collectives: ``torch.distributed._functional_collectives.<name>``, recorded with
  ``function="funcol.<name>"``;
* ``batch_isend_irecv``: one record per ``P2POp`` in the batch (a ``send`` or ``recv`` with its
  peer). ``P2POp`` accepts only the real ``isend``/``irecv`` (``_check_op`` compares identity), so
  inside the block ``dist.P2POp`` is a subclass that unwraps our recording ``isend``/``irecv``:
  ``dist.P2POp(dist.isend, t, peer)`` works as it does outside.

What it does not see: DDP's built-in all-reduce without a comm hook (C++, ``Reducer``), and a
name imported before the block (``from torch.distributed import all_reduce``). The attributes of
``torch.distributed.distributed_c10d`` are left alone: only torch's own internal calls use them
(the deprecated ``all_gather_into_tensor`` calls ``all_gather_single``, ``all_gather_object``
calls ``all_gather``), so patching them too would count one call twice. A call made while we
record another one (inside it, or inside a hook) is passed through unrecorded for the same reason.

Sizes: ``numel``/``nbytes`` are what this rank passes in (an all-gather's local shard, a
reduce-scatter's whole input; for ``recv`` the buffer it receives into); ``out_numel``/
``out_nbytes`` what it writes into (an all-gather's whole output). Objects (``all_gather_object``
...) count their pickled size in ``nbytes``, with ``numel`` 0.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Call", "CollectiveLog", "record_collectives", "Recorder", "describe", "size_of", "RECORDED",
           "RECORDED_FUNCOL", "p2pop_unwrapping"]

# Each recorded function: (the op it performs, the argument it reads, the argument it writes).
RECORDED = {
    "all_reduce": ("all_reduce", "tensor", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors", "tensors"),
    "reduce": ("reduce", "tensor", "tensor"),
    "broadcast": ("broadcast", "tensor", "tensor"),
    "all_gather": ("all_gather", "tensor", "tensor_list"),
    "all_gather_single": ("all_gather", "input_tensor", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor", "output_tensor"),
    "_all_gather_base": ("all_gather", "input_tensor", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list", "output_tensor_lists"),
    "gather": ("gather", "tensor", "gather_list"),
    "gather_single": ("gather", "tensor", "gather_tensor"),
    "gather_into_tensor": ("gather", "tensor", "gather_tensor"),
    "scatter": ("scatter", "scatter_list", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list", "output"),
    "reduce_scatter_single": ("reduce_scatter", "input", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "output"),
    "_reduce_scatter_base": ("reduce_scatter", "input", "output"),
    "all_to_all_single": ("all_to_all", "input", "output"),
    "all_to_all": ("all_to_all", "input_tensor_list", "output_tensor_list"),
    "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None),
    "send": ("send", "tensor", None),
    "isend": ("send", "tensor", None),
    "recv": ("recv", None, "tensor"),
    "irecv": ("recv", None, "tensor"),
    "all_gather_object": ("all_gather", "obj", None),
    "gather_object": ("gather", "obj", None),
    "broadcast_object_list": ("broadcast", "object_list", None),
    "scatter_object_list": ("scatter", "scatter_object_input_list", None),
    "send_object_list": ("send", "object_list", None),
    "recv_object_list": ("recv", None, None),
}
# DTensor's path: torch.distributed._functional_collectives (the input is called ``self``).
RECORDED_FUNCOL = {
    "all_reduce": ("all_reduce", "self", None),
    "all_gather_single": ("all_gather", "self", None),
    "all_gather_tensor": ("all_gather", "self", None),
    "reduce_scatter_single": ("reduce_scatter", "self", None),
    "reduce_scatter_tensor": ("reduce_scatter", "self", None),
    "all_to_all_single": ("all_to_all", "self", None),
}
_PEER = {"send": ("dst", "group_dst"), "recv": ("src", "group_src")}


@dataclass
class Call:
    """One recorded call. ``args`` (the bound arguments) and ``result`` (what the call returned)
    are set only while the hooks run, so the log keeps no tensor alive."""

    function: str                  # what was called: "reduce_scatter_tensor", "funcol.all_reduce"
    op: str                        # what it does: "all_reduce", "reduce_scatter", "send", ...
    numel: int                     # elements this rank passes in
    nbytes: int
    dtype: torch.dtype | None
    out_numel: int = 0             # elements it writes into
    out_nbytes: int = 0
    peer: int | None = None        # send/recv: the other rank (None: recv from any)
    async_op: bool = False
    index: int = 0                 # position in the log
    args: dict | None = field(default=None, repr=False, compare=False)
    result: Any = field(default=None, repr=False, compare=False)


class CollectiveLog(list):
    """The list of :class:`Call` that :func:`record_collectives` yields, with summaries."""

    def count_by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self:
            out[c.op] = out.get(c.op, 0) + 1
        return out

    def bytes_by_op(self) -> dict[str, int]:
        """Bytes passed in, per op (an all-gather counts its local shard)."""
        out: dict[str, int] = {}
        for c in self:
            out[c.op] = out.get(c.op, 0) + c.nbytes
        return out

    def of(self, *ops: str) -> "CollectiveLog":
        """The calls whose op is one of ``ops``. Shown in lesson 04, §5."""
        return CollectiveLog(c for c in self if c.op in ops)

    def summarize(self) -> str:
        """One line per op: calls and bytes passed in."""
        if not self:
            return "no collective calls"
        nbytes = self.bytes_by_op()
        return "\n".join(f"{op}: {n} call{'s' * (n != 1)}, {nbytes[op]:,} bytes"
                         for op, n in self.count_by_op().items())


def size_of(value) -> tuple[int, int, torch.dtype | None]:
    """(numel, nbytes, dtype) of a tensor, a (nested) list of tensors, or a picklable object.

    Shown in lesson 08, §5."""
    if value is None:
        return 0, 0, None
    if isinstance(value, torch.Tensor):
        return value.numel(), value.numel() * value.element_size(), value.dtype
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, (torch.Tensor, list, tuple)) or v is None for v in value):
        sizes = [size_of(v) for v in value]
        dtypes = [d for _, _, d in sizes if d is not None]
        return (sum(n for n, _, _ in sizes), sum(b for _, b, _ in sizes),
                dtypes[0] if dtypes else None)
    return 0, len(pickle.dumps(value)), None


def describe(function: str, spec, arguments: dict) -> Call:
    """The :class:`Call` for ``function`` called with ``arguments``, read as ``spec`` says.

    Shown in lesson 07, §5; lesson 08, §5."""
    op, read, written = spec
    numel, nbytes, dtype = size_of(arguments.get(read)) if read else (0, 0, None)
    out_numel, out_nbytes, out_dtype = size_of(arguments.get(written)) if written else (0, 0, None)
    peer = None
    for name in _PEER.get(op, ()):
        if arguments.get(name) is not None:
            peer = arguments[name]
            break
    return Call(function, op, numel, nbytes, dtype or out_dtype, out_numel, out_nbytes, peer,
                bool(arguments.get("async_op", False)) or function in ("isend", "irecv"))


def _real(fn):
    """The torch function under our recording wrappers (nested recorders stack them)."""
    while hasattr(fn, "_recording_of"):
        fn = fn._recording_of
    return fn


class Recorder:
    """What one :func:`record_collectives` block shares between its wrappers: the log, the
    hooks, and a per-thread flag that passes calls made inside a recorded one through."""

    def __init__(self, before, after):
        self.log = CollectiveLog()
        self.before, self.after = before, after
        self.busy = threading.local()     # inside one of our calls: record nothing more
        self.lock = threading.Lock()      # callbacks of async work may record from gloo's threads

    def run(self, calls: list[Call], invoke: Callable[[], Any]):
        """Log ``calls``, run the ``before`` hooks, ``invoke()`` the real function, run the
        ``after`` hooks; the calls made meanwhile on this thread pass through unrecorded.
        Shown in lesson 04, §5; lesson 10, §2."""
        self.busy.on = True
        try:
            for call in calls:
                with self.lock:
                    call.index = len(self.log)
                    self.log.append(call)
                if self.before:
                    self.before(call)
            result = invoke()
            for call in calls:
                call.result = result
                if self.after:
                    replaced = self.after(call)
                    if replaced is not None and len(calls) == 1:
                        result = replaced
            return result
        finally:
            self.busy.on = False
            for call in calls:
                call.args = call.result = None

    def wrap(self, real, function: str, spec):
        """``real`` as a function that records each call, then makes it. Shown in lesson 04, §5;
        lesson 07, §5; lesson 08, §5."""
        signature = inspect.signature(real)

        @functools.wraps(real)
        def recording(*args, **kwargs):
            if getattr(self.busy, "on", False):
                return real(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return real(*args, **kwargs)          # torch says what is wrong
            call = describe(function, spec, bound.arguments)
            call.args = bound.arguments               # a hook may change what is passed on
            return self.run([call], lambda: real(*bound.args, **bound.kwargs))

        recording._recording_of = real
        return recording

    def wrap_batch(self, real):
        """``real``, ``dist.batch_isend_irecv``, as a function that records one send or receive
        per ``P2POp`` in the list it is given (the real ``isend`` or ``irecv`` that op holds
        says which), then makes the real call. Shown in lesson 11, §3."""

        @functools.wraps(real)
        def batch_isend_irecv(p2p_op_list):
            if getattr(self.busy, "on", False) or not isinstance(p2p_op_list, list):
                return real(p2p_op_list)
            calls = []
            for p in p2p_op_list:
                name = getattr(_real(getattr(p, "op", None)), "__name__", "?")
                numel, nbytes, dtype = size_of(getattr(p, "tensor", None))
                sending = name == "isend"
                calls.append(Call("batch_isend_irecv", "send" if sending else "recv",
                                  numel if sending else 0, nbytes if sending else 0, dtype,
                                  0 if sending else numel, 0 if sending else nbytes,
                                  getattr(p, "peer", None), True, args={"op": p}))
            return self.run(calls, lambda: real(p2p_op_list))

        batch_isend_irecv._recording_of = real
        return batch_isend_irecv


def p2pop_unwrapping(real_cls):
    """``dist.P2POp`` inside the block: handed the recorder's ``dist.isend`` (or ``irecv``), it
    stores the real one, which torch requires (``P2POp.__new__`` refuses any other op).
    Shown in lesson 11, §3.
    """

    class P2POp(real_cls):
        def __new__(cls, op, *args, **kwargs):
            return real_cls.__new__(cls, _real(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(_real(op), *args, **kwargs)

    P2POp.__qualname__ = real_cls.__qualname__
    P2POp.__module__ = real_cls.__module__
    return P2POp


@contextlib.contextmanager
def record_collectives(before: Callable[[Call], None] | None = None,
                       after: Callable[[Call], Any] | None = None):
    """Record every ``torch.distributed`` collective and send/recv this process makes in the
    block; yields a :class:`CollectiveLog` of :class:`Call` (op, bytes, dtype, peer, async_op).
    ``before(call)`` runs just before each call (it may raise to refuse it, or change
    ``call.args``, the bound arguments, to change what torch receives), ``after(call)`` just
    after it returns (``call.result``; what it returns, if not None, is handed back instead).
    Restored on exit, error or not; blocks nest. Shown in lesson 04, §5; lesson 07, §5;
    lesson 10, §2.
    """
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    recorder = Recorder(before, after)
    replaced = []                                       # (module, name, original)

    def replace(module, name, recording):
        replaced.append((module, name, getattr(module, name)))
        setattr(module, name, recording)

    try:
        for module, table, prefix in ((dist, RECORDED, ""), (funcol, RECORDED_FUNCOL, "funcol.")):
            for name, spec in table.items():
                if hasattr(module, name):
                    replace(module, name, recorder.wrap(getattr(module, name), prefix + name, spec))
        replace(dist, "batch_isend_irecv", recorder.wrap_batch(dist.batch_isend_irecv))
        replace(dist, "P2POp", p2pop_unwrapping(dist.P2POp))
        yield recorder.log
    finally:
        for module, name, real in reversed(replaced):
            setattr(module, name, real)
