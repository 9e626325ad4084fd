"""How lab08's checks weigh the gradient memory a rank keeps alive: by *storage*, not by
tensor (a view keeps its whole buffer alive), wherever it is kept — every ``p.grad``, every
full gradient still referenced (weak references), whatever the learner's wrapper reaches
through its attributes and containers (its weights, its optimizer's state and its gradient
shard aside), the inputs of the collectives it has launched and not yet waited for, and,
inside its own code, the tensors its functions' local variables hold.

When: at every gradient's arrival (the check's hook runs before the learner's), at each
reduce-scatter the learner launches and each ``wait()`` on its Work (:class:`_Watched`), and,
during the backward, before every line of the learner's own functions (:func:`weighing_lines`,
a ``sys.settrace`` tracer limited to frames outside torch, dpcourse and the standard library).
Per line, because the costly instant is between two calls: right after a bucket is copied
into its buffer and before its ``p.grad`` is let go, the bucket exists twice. Only between
lines: a temporary made and dropped inside one line (the unpadded result of ``torch.cat``
under ``F.pad``) is not seen; the references fill a zeroed buffer in place
(``torch.cat(..., out=)``), so they make none.

Used by :mod:`dpcourse.checks.lab08` (``check_zero_two``) and
:mod:`dpcourse.checks._lab08_peak` (the predictions), so that both weigh alike.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import torch
from torch import nn

def _storages(obj, skip: set, path: str, out: dict, depth: int = 0, seen=None) -> None:
    """Every tensor storage reachable from ``obj`` through attributes and containers, as
    {data_ptr: (bytes, first path)}; storages in ``skip`` (the model's weights, the optimizer's
    state) are left out. Storage, not tensor: a view keeps its whole buffer alive."""
    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        for t in (obj, obj.grad if obj.is_leaf and obj.requires_grad else None):
            if t is None:
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if st.nbytes() and ptr not in skip and ptr not in out:
                out[ptr] = (st.nbytes(), path if t is obj else path + ".grad")
        return
    if isinstance(obj, (torch.optim.Optimizer, nn.Module, type, types.ModuleType)) or \
            callable(obj) and \
            not hasattr(obj, "__dict__"):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _storages(k, skip, path, out, depth + 1, seen)
            _storages(v, skip, f"{path}[…]", out, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _storages(v, skip, f"{path}[…]", out, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (str, bytes, int, float)):
        for k, v in vars(obj).items():
            _storages(v, skip, f"{path}.{k}", out, depth + 1, seen)


_NOT_LEARNERS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))

# Code of the check's own that is weighed as the learner's is (the schedules the peak
# predictions compare, in :mod:`dpcourse.checks._lab08_peak`): their frames and locals count.
WEIGHED_AS_LEARNERS: set = set()


def _learners(code, outside=_NOT_LEARNERS) -> bool:
    return code in WEIGHED_AS_LEARNERS or not code.co_filename.startswith(outside)


def _learner_locals(state, found: dict) -> None:
    """The tensors held by the local variables of the learner's functions now on the stack
    (inside its hook, at a collective's launch or a wait()): a buffer just filled lives in a
    local before it lives anywhere else. Frames of torch and of dpcourse are not the
    learner's."""
    skip = state["skip"] | {state["grad_ptr"]}
    frame = sys._getframe(1)
    while frame is not None and not _learners(frame.f_code):
        frame = frame.f_back                        # the check's and the recorder's frames
    while frame is not None and _learners(frame.f_code):
        for name, value in frame.f_locals.items():  # the learner's, up to torch's autograd
            if value is not state["learner"]:
                _storages(value, skip, f"`{name}` in {frame.f_code.co_name}()", found)
        frame = frame.f_back


def _live_gradients(trainable, tracked, state, inside: bool = False) -> tuple[int, dict]:
    """Gradient bytes alive now, besides the gradient shard: every p.grad, any full gradient
    still referenced (``tracked``: weak references), whatever the wrapper
    (``state["learner"]``) holds that is not weights or optimizer state (``state["skip"]``),
    the inputs of its collectives still in flight (``state["flying"]``) and, ``inside`` the
    learner's hook, the tensors of its functions' local variables; {path: bytes} too."""
    found: dict = {}
    for p in trainable:
        if p.grad is not None:
            st = p.grad.untyped_storage()
            found.setdefault(st.data_ptr(), (st.nbytes(), "p.grad"))
    for ref in tracked:
        t = ref()
        if t is not None:
            st = t.untyped_storage()
            found.setdefault(st.data_ptr(), (st.nbytes(), "a full gradient kept elsewhere"))
    if state["learner"] is not None:
        _storages(state["learner"], state["skip"] | {state["grad_ptr"]}, "self", found)
    if inside:
        _learner_locals(state, found)
    for ptr, nbytes in state.get("flying", {}).items():
        found.setdefault(ptr, (nbytes, "a collective's input, in flight"))
    found.pop(state["grad_ptr"], None)
    where: dict = {}
    for nbytes, path in found.values():
        where[path] = where.get(path, 0) + nbytes
    return sum(where.values()), where



# Frames that are not the learner's own: torch and the other installed packages, the standard
# library, dpcourse (the check's hooks and recorders).
_NOT_TRACED = _NOT_LEARNERS + (os.path.dirname(os.path.dirname(torch.__file__)),
                               os.path.dirname(os.__file__))


@contextlib.contextmanager
def weighing_lines(weigh):
    """While the block runs (the backward): call ``weigh(("line", function, line))`` before
    every line of the learner's own functions — its gradient hook and what that hook calls."""
    def local(frame, event, arg):
        if event == "line":
            weigh(("line", frame.f_code.co_name, frame.f_lineno))
        return local

    def tracer(frame, event, arg):
        if event == "call" and _learners(frame.f_code, _NOT_TRACED):
            return local
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(before)


def prefer(moment, new_moment) -> bool:
    """At an equal weight, a launch or a wait() names the moment better than a line does."""
    return moment is not None and moment[0] == "line" and new_moment[0] in ("launch", "wait")


def _inputs(call) -> dict:
    """{data_ptr: bytes} of the storages a collective reads (its output aside)."""
    out = {}
    for key, v in (call.args or {}).items():
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if key != "output" and isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                out[st.data_ptr()] = st.nbytes()
    return out


class _Watched:
    """A collective's Work with its wait() recorded: ``weigh(("wait", number))`` runs just
    before it (the memory alive while the learner waits), and its input leaves
    ``flying`` once waited; everything else passes through."""

    def __init__(self, work, number: int, log: list, weigh=None, flying=None, inputs=()):
        self._work, self._number, self._log = work, number, log
        self._weigh, self._flying, self._inputs = weigh, flying, tuple(inputs)

    def _waited(self):
        if self._weigh is not None:
            self._weigh(("wait", self._number))
        self._log.append(("wait", self._number))
        for ptr in self._inputs:
            if self._flying is not None:
                self._flying.pop(ptr, None)

    def wait(self, *args, **kwargs):
        self._waited()
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._waited()
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)



def _inner_tensors(inner) -> list:
    tensors = [p for g in inner.param_groups for p in g["params"]]
    for st in inner.state.values():
        tensors += [t for t in st.values() if isinstance(t, torch.Tensor)]
    return tensors
