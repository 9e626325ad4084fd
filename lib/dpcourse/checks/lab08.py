"""Checks for lab08: ``shard_bounds(numel, rank, world_size)`` and the learner's ZeRO stage 2
wrapper, ``ZeroTwo(params, optimizer_cls, bucket_cap=..., **kwargs)`` with ``step()``,
``zero_grad()``, its flat shard in ``self.shard`` and its inner optimizer in
``self.optimizer``, which reduce-scatters the gradients bucket by bucket *during* the backward.

``check_shard_bounds`` runs in this process on seven (numel, world size) pairs, from an even
split to more ranks than numbers. Every rank's shard must be ``ceil(numel / world_size)``
long (``all_gather_single`` needs equal pieces), in rank order, touching, and together
cover the numbers. Its sentences name the rule broken (equal pieces; every number owned; the
smallest such size), never the formula. It names: the size rounded down (the last numbers
belong to nobody), pieces larger than needed, an
exclusive end taken as inclusive (gaps), overlapping shards, a last shard clipped at
``numel``, (start, length) returned instead of (start, end), shards out of rank order, a
first shard that does not start at 0, a return value that is not two integers.

``check_zero_two`` runs the wrapper for 3 steps on 2 ranks with Adam and on 3 ranks with SGD +
momentum, on an MLP of seven layers with a frozen bias and a weight tied between two layers,
next to ``DistributedDataParallel`` with the full optimizer on the same shards of the same
batches, and next to DDP runs that make one mistake on purpose (gradients summed, divided
twice, earlier steps' gradients kept), so that weights equal to one of those name it.

What it watches, from inside the rank: a hook registered on every parameter *before* the
learner's sees each gradient arrive; spies on the collectives log each reduce-scatter's
launch (its size, whether ``async_op=True``) and each ``wait()`` on its Work; and at every
arrival, and inside the learner's hook at each reduce-scatter's launch and each ``wait()``,
the check weighs the gradient memory alive — by *storage* (``untyped_storage()``'s bytes, each
data pointer once), not by tensor: every ``p.grad``, every full gradient still referenced
anywhere, every tensor reachable from the wrapper's attributes that is not a weight, the
optimizer's state or the gradient shard itself, the inputs of collectives not yet waited
for, and (inside the hook) the tensors held by the learner's local variables on the stack,
where a buffer just filled lives. A view keeps its whole buffer alive, so it weighs the whole
buffer.

It names: a shard (or shard gradient) that is a view of the whole padded vector, the whole
model given to the inner optimizer, a frozen parameter hooked, bucketed or stepped, the
reduce-scatters done in ``step()``, all launched at the end of the backward, a bucket
launched later than when it was full, a blocking reduce-scatter in the backward, a wait right
after each launch, a reduce-scatter not waited for before the inner step, full gradients
left in ``p.grad`` or referenced elsewhere, every bucket's padded buffer kept until
``step()``, the new bucket's buffer filled before the old bucket was waited for and before
its ``p.grad`` was freed (three buckets' worth at the ``wait()``), buffers kept after
their reduce-scatter or into the next step, gradients summed
(also when the mean was written into a new tensor) or divided twice or accumulated over
steps, a per-bucket count of arrived gradients never set back after a step (step 2 launches
nothing: the check reads the wrapper's integer lists after construction and each step),
no all-gather (the ranks drift apart), a shard boundary off by one, a reduce-scatter
whose output slice is the wrong size (an offset mistake) or whose input is not padded (named
before gloo's own "size" error), a shard gradient still all zeros when the optimizer steps
(the reduce-scatters wrote elsewhere), a shard stepped but never copied back into the
parameters, the two arguments of ``reduce_scatter_single`` or ``all_gather_single`` swapped
(an output world_size times its input, or the reverse; named before the padding and offset
sentences), ``params`` (a generator) iterated twice so that no hook was registered, or read
again after it ran out (the check passes a one-pass iterator that counts the passes begun
after its end, and names that before the error it led to), the
library's own stages or torch's ``ZeroRedundancyOptimizer`` given as the answer, a deadlock
(with the ranks that hung), a shard or buffer made without the parameters' dtype (the
learner's code runs with torch's default dtype set to float64 while the model is fp32: the
CPU-visible symptom of a buffer made without ``device=``, which NCCL would refuse on a GPU).
The messages name the cause and the contract rule broken; what to change joins a sentence
only when the same mistake comes back (``fix=``), and where the fix is the lab's design
decision (what to keep in flight, when to wait) they do not dictate it. Those readings, and
the cases the checks run, live in :mod:`dpcourse.checks._lab08_diagnose`; this module runs
the learner's code and calls them.

``measure_peak`` and ``check_peak_prediction`` are the lab's predict-then-measure part: the
peak of live gradient bytes of the learner's wrapper on a five-layer MLP (``PEAK_WIDTHS``,
buckets of ``PEAK_CAP`` bytes, 2 ranks), weighed as ``check_zero_two`` weighs it, against the
learner's prediction, with where the peak comes from (two neighbouring buckets).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import check_timeout, fail, passed, recorded, require_answer, run_ranks
from ._lab08_diagnose import (BUCKET_CAP, CONFIGS, _GLOBAL_BATCH, _STEPS, _WIDTHS,
                              _bounds_problem, _diagnose, _mlp, _raised)
from ._lab08_diagnose import _FROZEN, _live_limit, _trainable_numels  # noqa: F401 (tests read them)

__all__ = ["check_shard_bounds", "check_zero_two", "measure_peak", "check_peak_prediction",
           "peak_buckets", "expected_peak", "CONFIGS", "BUCKET_CAP", "PEAK_WIDTHS", "PEAK_CAP",
           "PEAK_WORLD_SIZE", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 30.0

# --------------------------------------------------------------------------------------------
# shard_bounds
# --------------------------------------------------------------------------------------------

_BOUNDS_CASES = ((53, 2), (53, 3), (12, 3), (10, 4), (3, 4), (1, 1), (1_000_003, 8))


@recorded
def check_shard_bounds(shard_bounds) -> None:
    """Every rank's [start, end) on seven (numel, world size) pairs."""
    __tracebackhide__ = True
    require_answer(shard_bounds, "shard_bounds")
    for numel, world_size in _BOUNDS_CASES:
        size = math.ceil(numel / world_size)
        got = []
        for rank in range(world_size):
            out = shard_bounds(numel, rank, world_size)
            try:
                start, end = (int(v) for v in out)
            except (TypeError, ValueError):
                fail(f"shard_bounds({numel}, {rank}, {world_size}) returned {out!r}, which is not two "
                     f"integers.", fix="return (start, end), two integers.")
            got.append((start, end))
        _bounds_problem(got, numel, world_size, size)
    passed(f"shard_bounds: on {len(_BOUNDS_CASES)} (numel, world size) pairs, from an even "
           f"split to more ranks than numbers, every rank's piece is as long as every other's and "
           f"no longer than it must be, in rank order, touching, every number owned")


# --------------------------------------------------------------------------------------------
# ZeroTwo, on 2 and 3 ranks
# --------------------------------------------------------------------------------------------


def _optimizer(name: str):
    if name == "adam":
        return torch.optim.Adam, {"lr": 0.05}
    return torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}


def _batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    X = torch.randn(_GLOBAL_BATCH, _WIDTHS[0], generator=g, dtype=torch.float32)
    y = torch.randint(0, _WIDTHS[-1], (_GLOBAL_BATCH,), generator=g)
    n = _GLOBAL_BATCH // world_size
    return X[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _state_of(inner) -> dict:
    """What the inner optimizer holds: how many numbers it steps, and the bytes of its state
    tensors (Adam's 0-d ``step`` counter aside)."""
    if inner is None or not hasattr(inner, "state") or not hasattr(inner, "param_groups"):
        return {"missing": True}
    numel = sum(p.numel() for g in inner.param_groups for p in g["params"])
    nbytes = sum(t.numel() * t.element_size() for s in inner.state.values()
                 for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"missing": False, "numel": numel, "bytes": nbytes}


# The references: DDP + the full optimizer, and DDP runs that make one mistake on purpose, so
# that a learner's weights equal to one of them name that mistake.
_REFERENCES = ("ddp", "summed", "twice", "accumulated")


def _reference_step(kind: str, m, wrapped, ref_opt, kept: dict, X, y, world_size: int) -> None:
    __tracebackhide__ = True
    ref_opt.zero_grad()
    F.cross_entropy(wrapped(X), y).backward()
    for name, p in m.named_parameters():
        if p.grad is None:
            continue
        if kind == "summed":                      # the reduction's sum, never divided
            p.grad.mul_(world_size)
        elif kind == "twice":                     # divided before and after the reduction
            p.grad.div_(world_size)
        elif kind == "accumulated":               # the earlier steps' gradients never cleared
            if name in kept:
                p.grad.add_(kept[name])
            kept[name] = p.grad.clone()
    ref_opt.step()


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


def _learner_locals(state, found: dict) -> None:
    """The tensors held by the local variables of the learner's functions now on the stack
    (inside its hook, at a collective's launch or a wait()): a buffer just filled lives in a
    local before it lives anywhere else. Frames of torch and of dpcourse are not the
    learner's."""
    skip = state["skip"] | {state["grad_ptr"]}
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_LEARNERS):
        frame = frame.f_back                        # the check's and the recorder's frames
    while frame is not None and not frame.f_code.co_filename.startswith(_NOT_LEARNERS):
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


def _learner_hooks(trainable, ours: int = 1) -> int:
    """How many gradient hooks the learner registered on the trainable parameters (``ours``
    per parameter are the check's own)."""
    count = 0
    for p in trainable:
        count += max(0, len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) - ours)
        count += len(getattr(p, "_backward_hooks", None) or {})
    return count


# The learner's code runs with torch's default dtype set to float64 while the model is fp32:
# a tensor made with torch.zeros/empty/tensor without dtype= then shows on the CPU the mistake
# that, without device=, a GPU run with NCCL would show (a buffer on the wrong device).
_LEARNER_DEFAULT = torch.float64
_MODEL_DTYPE = torch.float32


def _refuse_dtype(call) -> None:
    """Before a collective of the learner's: refuse a tensor whose dtype is not the
    parameters'."""
    for v in (call.args or {}).values():
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and \
                    t.dtype != _MODEL_DTYPE:
                raise RuntimeError(f"lab08-dtype {call.op} {t.dtype} {_MODEL_DTYPE}")


def _refuse_uneven(call, world_size: int) -> None:
    """Before a reduce-scatter or all-gather of the learner's runs: refuse, with a message the
    check turns into the cause, pieces that cannot be equal (gloo's own error says only
    "size")."""
    if call.op == "reduce_scatter" and call.numel and call.out_numel == call.numel * world_size \
            and world_size > 1:
        raise RuntimeError(f"lab08-swapped {call.function} {call.out_numel} {call.numel} "
                           f"{world_size}")
    if call.op == "all_gather" and call.out_numel and call.numel == call.out_numel * world_size \
            and world_size > 1:
        raise RuntimeError(f"lab08-swapped {call.function} {call.out_numel} {call.numel} "
                           f"{world_size}")
    if call.op == "reduce_scatter" and call.numel:
        if call.numel % world_size:
            raise RuntimeError(f"lab08-unpadded {call.numel} {world_size}")
        if call.out_numel * world_size != call.numel:
            raise RuntimeError(f"lab08-out {call.out_numel} {call.numel} {world_size}")
    elif call.op == "all_gather" and call.numel and call.out_numel and \
            call.out_numel != call.numel * world_size:
        raise RuntimeError(f"lab08-gather {call.numel} {call.out_numel} {world_size}")


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


def _zero_worker(rank: int, world_size: int, cls, opt_name: str) -> dict:
    """One rank: the learner's wrapper for ``_STEPS`` steps, and after each step the same step
    of every reference. Returns the weights after every step, what happened in order during
    each backward (gradients arriving, reduce-scatters launched and waited), the gradient
    memory alive at each arrival, the optimizer's state."""
    __tracebackhide__ = True
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..collectives import record_collectives

    model = _mlp()
    named = dict(model.named_parameters())            # a tied weight appears once
    params = list(named.values())
    trainable = [p for p in params if p.requires_grad]
    initial = _flat(model)
    references = {}
    for name in _REFERENCES:
        m = copy.deepcopy(model)
        opt_cls, kw = _optimizer(opt_name)
        references[name] = (m, DDP(m), opt_cls(m.parameters(), **kw), {})
    opt_cls, kw = _optimizer(opt_name)
    names = [n for n, p in named.items() for _ in range(p.numel())]

    log: list = []                                      # what happened, in order
    tracked: list = []                                  # weak references to each full gradient
    state = {"phase": "init", "learner": None, "skip": set(), "grad_ptr": None, "flying": {}}
    memory = {"peak": 0, "where": {}}

    def live():
        return _live_gradients(trainable, tracked, state)

    def weigh(moment=("arrival",)):        # at an arrival, and inside the hook: launch, wait()
        total, where = _live_gradients(trainable, tracked, state, inside=moment[0] != "arrival")
        if total > memory["peak"]:
            launched = {e[1] for e in log if e[0] == "launch" and e[3]}
            waited = {e[1] for e in log if e[0] == "wait"}
            memory["peak"], memory["where"] = total, where
            memory["in_flight"] = len(launched - waited)
            memory["moment"] = moment
            memory["flying_bytes"] = sum(state["flying"].values())

    def seen(p):                                       # the check's hook: runs before yours
        log.append(("grad", p.numel()))
        tracked.append(weakref.ref(p.grad))
        weigh()

    for p in trainable:
        p.register_post_accumulate_grad_hook(seen)

    launches = {}                                       # a recorded call's index -> its number

    def launched(call):         # a reduce-scatter (or all-reduce, then slice: accepted) of yours
        if state["phase"] in ("init", "backward", "step"):
            _refuse_dtype(call)
        if state["phase"] in ("backward", "step"):
            _refuse_uneven(call, world_size)
        if (call.op == "reduce_scatter" or call.function == "all_reduce") and \
                state["phase"] in ("backward", "step"):
            number = sum(1 for e in log if e[0] == "launch")
            log.append(("launch", number, call.numel, call.async_op, state["phase"]))
            inputs = _inputs(call)
            state["flying"].update(inputs)
            weigh(("launch", number))
            launches[call.index] = (number, inputs)

    def watched(call):                                  # its Work, with wait() noted
        number, inputs = launches.pop(call.index, (None, {}))
        if number is not None and call.result is not None:
            return _Watched(call.result, number, log, weigh, state["flying"], inputs)
        for ptr in inputs:                              # blocking: over when it returns
            state["flying"].pop(ptr, None)
        return None

    torch.set_default_dtype(_LEARNER_DEFAULT)              # see _LEARNER_DEFAULT
    try:
        with record_collectives(before=launched, after=watched):
            given = _OnePass(model.parameters())
            try:
                opt = cls(given, opt_cls, bucket_cap=BUCKET_CAP, **kw)
            except Exception as exc:
                _raise_if_reread(exc, given)
                raise
            state["given"] = given
            inner = getattr(opt, "optimizer", None)
            shard = getattr(opt, "shard", None)
            views = {}
            for what, t in (("self.shard", shard),
                            ("self.shard.grad", getattr(shard, "grad", None))):
                if isinstance(t, torch.Tensor) and \
                        t.untyped_storage().nbytes() > t.numel() * t.element_size():
                    views[what] = (t.numel() * t.element_size(), t.untyped_storage().nbytes())
            if views:
                return {"views": views}
            if isinstance(shard, torch.Tensor) and shard.dtype != _MODEL_DTYPE:
                return {"views": None, "dtype": ("self.shard", str(shard.dtype))}
            if inner is not None and hasattr(inner, "step"):
                real_step = inner.step

                def inner_step(*args, **kwargs):           # the optimizer steps: all waited?
                    log.append(("inner_step",))
                    g = getattr(getattr(opt, "shard", None), "grad", None)
                    state["zero_grad_at_step"] = isinstance(g, torch.Tensor) and \
                        not bool(g.detach().abs().sum() > 0)
                    return real_step(*args, **kwargs)
                inner.step = inner_step
            skip = {p.untyped_storage().data_ptr() for p in params}
            if inner is not None and hasattr(inner, "state"):
                skip |= {t.untyped_storage().data_ptr() for t in _inner_tensors(inner)}
            state.update(learner=opt, skip=skip)
            hooked = _learner_hooks(trainable)
            counters0 = _counters(opt)
            steps = []
            for step in range(_STEPS):
                X, y = _batch(step, rank, world_size)
                opt.zero_grad()
                tracked.clear()
                log.clear()
                memory.update(peak=0, where={}, in_flight=0, moment=("arrival",),
                              flying_bytes=0)
                g = getattr(getattr(opt, "shard", None), "grad", None)
                state["grad_ptr"] = g.untyped_storage().data_ptr() if isinstance(g, torch.Tensor) \
                    else None
                state["phase"] = "backward"
                try:
                    F.cross_entropy(model(X), y).backward()
                except Exception as exc:
                    _raise_if_reread(exc, given)
                    _raise_with_counts(exc, opt, step, log, steps)
                weigh()
                end_total, end_where = live()
                log.append(("backward_done",))
                state["phase"] = "step"
                state["zero_grad_at_step"] = None
                shard_now = getattr(opt, "shard", None)
                shard_before = shard_now.detach().clone() if isinstance(shard_now, torch.Tensor) \
                    else None
                try:
                    opt.step()
                except Exception as exc:
                    _raise_if_reread(exc, given)
                    raise
                shard_now = getattr(opt, "shard", None)
                shard_moved = shard_before is not None and isinstance(shard_now, torch.Tensor) and \
                    shard_now.shape == shard_before.shape and \
                    not torch.equal(shard_now.detach(), shard_before)
                after_step, after_where = live()            # between steps: nothing but the shard
                state["phase"] = "references"
                rec = {"learner": _flat(model), "log": list(log), "peak": memory["peak"],
                       "in_flight": memory.get("in_flight", 0), "moment": memory["moment"],
                       "flying_bytes": memory["flying_bytes"],
                       "counters": _counters(opt),
                       "where": memory["where"], "end": end_total, "end_where": end_where,
                       "after_step": after_step, "after_where": after_where,
                       "zero_grad_at_step": state["zero_grad_at_step"], "shard_moved": shard_moved}
                torch.set_default_dtype(_MODEL_DTYPE)
                for name, (m, wrapped, ref_opt, kept) in references.items():
                    _reference_step(name, m, wrapped, ref_opt, kept, X, y, world_size)
                    rec[name] = _flat(m)
                torch.set_default_dtype(_LEARNER_DEFAULT)
                steps.append(rec)
            state_after = _state_of(inner)
        return {"initial": initial, "steps": steps, "state_after": state_after, "names": names,
                "counters0": counters0, "reread": given.reread,
                "views": None, "hooked": hooked, "frozen": [(n, p.numel()) for n, p in named.items()
                                          if not p.requires_grad]}
    finally:
        torch.set_default_dtype(_MODEL_DTYPE)


class _OnePass:
    """``model.parameters()`` as the learner gets it — an iterator that runs out after one
    pass — which counts the passes begun after it ran out (``reread``): a second loop over it
    finds nothing, and whatever the learner built from that loop is empty."""

    def __init__(self, params):
        self._it, self._done, self.reread = iter(params), False, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            self.reread += 1
            raise StopIteration
        try:
            return next(self._it)
        except StopIteration:
            self._done = True
            raise


def _raise_if_reread(exc: Exception, given: _OnePass) -> None:
    """The learner's code raised after a loop over the exhausted ``params``: say that first
    (``lab08-reread``, read by ``_diagnose._raised``), the error it led to after it."""
    __tracebackhide__ = True
    if given.reread:
        raise RuntimeError(f"lab08-reread {given.reread} | {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _raise_with_counts(exc: Exception, opt, step: int, log: list, steps: list) -> None:
    """The learner's hook raised during step ``step``'s backward: re-raise with what its
    per-bucket count of arrived gradients said (``lab08-count ...``, read by
    ``_diagnose._raised``), when the wrapper has one list of integers per bucket."""
    __tracebackhide__ = True
    buckets = getattr(opt, "buckets", None)
    sizes = [len(b) for b in buckets] if isinstance(buckets, (list, tuple)) and all(
        isinstance(b, (list, tuple)) for b in buckets) else None
    counts = [v for v in _counters(opt).values() if sizes and len(v) == len(sizes)]
    if not sizes or len(counts) != 1:
        raise exc
    before = [v for v in (steps[-1]["counters"].values() if steps else ())
              if len(v) == len(sizes)]
    launched_before = sum(1 for e in steps[-1]["log"] if e[0] == "launch") if steps else 0
    arrived = sum(1 for e in log if e[0] == "grad")
    raise RuntimeError(
        f"lab08-count {step + 1} {arrived} {launched_before} "
        f"{','.join(map(str, sizes))} {','.join(map(str, counts[0]))} "
        f"{','.join(map(str, before[0])) if len(before) == 1 else '-'} | "
        f"{type(exc).__name__}: {exc}") from exc


def _counters(opt) -> dict:
    """The wrapper's lists (or dicts) of integers, by attribute: read after construction and
    after every step, they show a per-bucket count of arrived gradients that never went back
    to where it started."""
    out = {}
    for name, v in (vars(opt).items() if hasattr(opt, "__dict__") else ()):
        values = list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else None
        if values and all(type(x) is int for x in values):
            out[name] = list(values)
    return out


def _inner_tensors(inner) -> list:
    tensors = [p for g in inner.param_groups for p in g["params"]]
    for st in inner.state.values():
        tensors += [t for t in st.values() if isinstance(t, torch.Tensor)]
    return tensors


def _launch(cls, world_size: int, opt_name: str, timeout: float) -> list:
    __tracebackhide__ = True
    return run_ranks(_zero_worker, world_size, cls, opt_name, timeout=timeout,
                     failed=lambda exc: _raised(exc.rank, exc.summary),
                     hang="every rank must make the same collectives, in the same order, with "
                          "tensors of the same size (and wait() for each one it launched).")


@recorded
def check_zero_two(cls, configs=CONFIGS, timeout: float | None = None) -> None:
    """Run the learner's ZeroTwo for 3 steps on 2 ranks (Adam) and 3 ranks (SGD + momentum)
    next to DDP with the full optimizer, on a model with a frozen and a tied parameter;
    compare the weights, weigh the optimizer state and the gradient memory alive at once, and
    check that each bucket's reduce-scatter was launched, asynchronously, as soon as its
    gradients were in."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(cls, getattr(cls, "__name__", "ZeroTwo"), "class")
    _refuse_library(cls)
    shown = []
    for world_size, opt_name in configs:
        results = _launch(cls, world_size, opt_name, timeout)
        shown.append(_diagnose(results, world_size, opt_name))
    passed(f"{cls.__name__}: weights == DDP + the full optimizer after {_STEPS} steps; every "
           f"bucket reduce-scattered asynchronously as soon as it was full; gradient bytes "
           f"alive at once, at most: {'; '.join(shown)}")


def _refuse_library(cls) -> None:
    """The library's stages and torch's ZeroRedundancyOptimizer are not the lab's answer."""
    __tracebackhide__ = True
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .. import zero
    if cls in (zero.Zero1, zero.Zero2, zero.Zero3, zero.Replicated):
        fail(f"{cls.__name__} is lesson 08's own stage (dpcourse.zero.{cls.__name__}): it "
             f"reduce-scatters after the backward, when every full gradient exists at once — "
             f"the lab asks for your own ZeroTwo, which reduce-scatters during the backward.")
    if isinstance(cls, type) and issubclass(cls, ZeroRedundancyOptimizer):
        fail("that is torch's ZeroRedundancyOptimizer, a ZeRO-1 that shards only the optimizer "
             "state and leaves the gradients to DDP: the lab asks for your own ZeroTwo, which "
             "shards the gradients too, during the backward.")


# --------------------------------------------------------------------------------------------
# Predict, then measure: the peak of live gradient memory
# --------------------------------------------------------------------------------------------

PEAK_WIDTHS = (16, 64, 64, 64, 64, 8)    # five Linear layers, ReLU between them
PEAK_CAP = 4096                          # bytes: a bucket closes once it holds 4096 B or more
PEAK_WORLD_SIZE = 2


def _peak_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(PEAK_WIDTHS[:-1], PEAK_WIDTHS[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def peak_buckets() -> list[int]:
    """The numbers in each bucket of the prediction's model, in launch order (DDP's rule:
    reverse registration order, a bucket closes once it reaches ``PEAK_CAP`` bytes)."""
    sizes, current = [], 0
    for p in reversed(list(_peak_mlp().parameters())):
        current += p.numel()
        if 4 * current >= PEAK_CAP:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def _peak_worker(rank: int, world_size: int, cls) -> dict:
    """One rank: the learner's wrapper for 2 SGD steps of the prediction's model, weighing the
    gradient memory alive as ``check_zero_two`` does: at every gradient's arrival, and inside
    the learner's hook at each reduce-scatter's launch and each wait()."""
    __tracebackhide__ = True
    from ..collectives import record_collectives

    model = _peak_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    tracked: list = []
    state = {"learner": None, "skip": set(), "grad_ptr": None, "flying": {}}
    peak = {"bytes": 0, "where": {}, "moment": None}
    log: list = []
    launches: dict = {}

    def weigh(moment=("arrival",)):
        total, where = _live_gradients(trainable, tracked, state, inside=moment[0] != "arrival")
        if total > peak["bytes"]:
            peak.update(bytes=total, where=where, moment=moment)

    def seen(p):                                       # the check's hook: runs before yours
        tracked.append(weakref.ref(p.grad))
        weigh()

    def launched(call):
        if call.op == "reduce_scatter" or call.function == "all_reduce":
            number = len(launches)
            inputs = _inputs(call)
            state["flying"].update(inputs)
            weigh(("launch", number))
            launches[call.index] = (number, inputs)

    def watched(call):
        number, inputs = launches.get(call.index, (None, {}))
        if number is not None and call.result is not None:
            return _Watched(call.result, number, log, weigh, state["flying"], inputs)
        for ptr in inputs:
            state["flying"].pop(ptr, None)
        return None

    for p in trainable:
        p.register_post_accumulate_grad_hook(seen)
    opt = cls(model.parameters(), torch.optim.SGD, bucket_cap=PEAK_CAP, lr=0.1)
    inner = getattr(opt, "optimizer", None)
    skip = {p.untyped_storage().data_ptr() for p in trainable}
    if inner is not None and hasattr(inner, "state"):
        skip |= {t.untyped_storage().data_ptr() for t in _inner_tensors(inner)}
    state.update(learner=opt, skip=skip)
    with record_collectives(before=launched, after=watched):
        for step in range(2):
            g = torch.Generator().manual_seed(200 + step)
            X = torch.randn(8 * world_size, PEAK_WIDTHS[0], generator=g)
            y = torch.randint(0, PEAK_WIDTHS[-1], (8 * world_size,), generator=g)
            X, y = X[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
            opt.zero_grad()
            tracked.clear()
            shard_grad = getattr(getattr(opt, "shard", None), "grad", None)
            state["grad_ptr"] = shard_grad.untyped_storage().data_ptr() \
                if isinstance(shard_grad, torch.Tensor) else None
            F.cross_entropy(model(X), y).backward()
            opt.step()
    return {"peak": peak["bytes"], "where": peak["where"], "moment": peak["moment"]}


def measure_peak(cls, timeout: float | None = None) -> int:
    """The most gradient bytes your ``cls`` kept alive at once on the prediction's model
    (``PEAK_WIDTHS``, buckets of ``PEAK_CAP`` bytes, fp32, ``PEAK_WORLD_SIZE`` ranks), weighed
    as ``check_zero_two`` weighs them (at every gradient's arrival, and inside your hook at
    each reduce-scatter's launch and each wait()), the largest over the ranks."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(cls, getattr(cls, "__name__", "ZeroTwo"), "class")
    results = run_ranks(_peak_worker, PEAK_WORLD_SIZE, cls, timeout=timeout,
                        failed=lambda exc: _raised(exc.rank, exc.summary),
                        hang="every rank must make the same collectives, in the same order, "
                             "with tensors of the same size.")
    return max(r["peak"] for r in results)


def expected_peak() -> tuple[int, int]:
    """(bytes, index of the bucket being filled) at the peak when one bucket is in flight:
    the bucket whose last gradient has just arrived, plus the one before it, still in flight
    (each padded to a multiple of the world size)."""
    sizes = [PEAK_WORLD_SIZE * math.ceil(n / PEAK_WORLD_SIZE) for n in peak_buckets()]
    # bucket 0 fills with nothing in flight; from bucket 1 on, the one before is in flight
    # while the new one's gradients are still in p.grad (the arrival the check weighs)
    pairs = [(4 * peak_buckets()[0], 0)] + [
        (4 * (peak_buckets()[i] + sizes[i - 1]), i) for i in range(1, len(sizes))]
    return max(pairs)


def check_peak_prediction(guess, measured: int) -> None:
    """Compare the learner's predicted peak of live gradient bytes with ``measured``
    (``measure_peak``), and say where the peak comes from."""
    __tracebackhide__ = True
    from . import reveal

    buckets = peak_buckets()
    total = 4 * sum(buckets)
    expected, i = expected_peak()
    value = guess.value if hasattr(guess, "value") else None
    close = isinstance(value, (int, float)) and abs(value - measured) <= 0.05 * measured
    why = (f"The buckets hold {', '.join(map(str, buckets))} numbers of 4 B, launched in that "
           f"order. The peak comes when the last gradient of bucket {i} ({buckets[i]} "
           f"numbers) arrives while bucket {i - 1} ({buckets[i - 1]}) is still in flight: "
           f"({buckets[i]} + {buckets[i - 1]}) × 4 = {expected} B, "
           f"{round(100 * expected / total)} % of the {total} B that DDP, or a ZeRO-2 that "
           f"reduce-scatters in step(), holds at once — two neighbouring buckets, not two "
           f"caps ({2 * PEAK_CAP} B) nor two of the largest.")
    if measured != expected:
        why += (f" Your ZeroTwo's peak, {measured} B, is not that of one bucket in flight "
                f"({expected} B): it keeps {'more' if measured > expected else 'less'} alive.")
    reveal(guess, measured, close=close, explanation=why)
