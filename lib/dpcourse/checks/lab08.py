"""Checks for lab08: ``shard_bounds(numel, rank, world_size, element_size)`` and the learner's
ZeRO stage 2 wrapper, ``ZeroTwo(params, optimizer_cls, bucket_cap=..., **kwargs)`` with
``step()``, ``zero_grad()``, its flat shard in ``self.shard`` and its inner optimizer in
``self.optimizer``, which reduce-scatters the gradients bucket by bucket *during* the backward.

``check_shard_bounds`` (part 1) runs in this process; it, the rule it checks and the
diagnosis of its wrong answers live in :mod:`dpcourse.checks._lab08_bounds`.

``check_zero_two`` runs the wrapper for 3 steps on 2 ranks with Adam and on 3 ranks with SGD +
momentum, on an MLP of seven layers with a frozen bias, a weight tied between two layers and an
input gain listed after layer 0's parameters but applied before layer 0 (so its gradient
arrives after theirs, out of reverse registration order), next to ``DistributedDataParallel``
with the full optimizer on the same shards of the same batches, and next to DDP runs that make
one mistake on purpose (gradients summed, divided twice, earlier steps' gradients kept), so
that weights equal to one of those name it.

What it watches, from inside the rank: a hook registered on every parameter *before* the
learner's sees each gradient arrive; spies on the collectives log each reduce-scatter's
launch (its size, whether ``async_op=True``, whether its pieces and its output slice of
``self.shard.grad`` start on 16 bytes) and each ``wait()`` on its Work; and at every arrival,
during the backward before every line of the learner's own code, and at each launch and each
``wait()``, the check weighs the gradient memory alive (:mod:`dpcourse.checks._lab08_memory`:
by storage, wherever it is kept, the learner's local variables included).

It names: a shard (or shard gradient) that is a view of the whole padded vector, the whole
model given to the inner optimizer, a frozen parameter hooked, bucketed or stepped, the
reduce-scatters done in ``step()``, all launched at the end of the backward, a bucket
launched later than when it was full, a blocking reduce-scatter in the backward, a wait right
after each launch, a reduce-scatter not waited for before the inner step, full gradients
left in ``p.grad`` or referenced elsewhere, every bucket's padded buffer kept until
``step()``, a new bucket copied before the bucket launched before it was waited for (with the
copy and the old bucket's buffer alive beside the bucket's ``p.grad``, three buckets' worth:
whether the copy comes before the ``wait()``, or the launch too, with two reduce-scatters in
flight at once), intermediate copies of a bucket held in local variables, buffers kept after
their reduce-scatter or into the next step, gradients summed (also when the mean was written
into a new tensor) or divided twice or accumulated over steps, a bucket taken as full when
the parameter listed last in it arrived (the input gain's gradient had not: named whether
the missing ``p.grad`` raised or was read as zeros), a bucket launched at an arrival that
left it incomplete, a per-bucket count of arrived
gradients never set back after a step (the check reads the wrapper's integer lists after
construction and each step) or off by one arrival either way, no all-gather (the ranks drift
apart), a shard boundary off by one, a bucket cut in pieces that do not start on 16 bytes, an
output slice that does not start where the earlier buckets' pieces end, a reduce-scatter
whose output slice is the wrong size or whose input is not padded (named before gloo's own
"size" error), a shard gradient still all zeros when the optimizer steps (the reduce-scatters
wrote elsewhere), a shard stepped but never copied back into the parameters, the two
arguments of ``reduce_scatter_single`` or ``all_gather_single`` swapped (named before the
padding and offset sentences), ``params`` (a generator) iterated twice so that no hook was
registered, or read again after it ran out (the check passes a one-pass iterator that counts
the passes begun after its end), the library's own stages or torch's
``ZeroRedundancyOptimizer`` given as the answer, a deadlock (with the ranks that hung), a
shard or buffer made without the parameters' dtype (the learner's code runs with torch's
default dtype set to float64 while the model is fp32: the CPU-visible symptom of a buffer
made without ``device=``, which NCCL would refuse on a GPU). The messages name the cause and
the contract rule broken; what to change joins a sentence only when the same mistake comes
back (``fix=``), and where the fix is the lab's design decision (what to keep in flight, when
to wait) they do not dictate it. Those readings, and the cases the checks run, live in
:mod:`dpcourse.checks._lab08_diagnose` (what the ranks that finished did) and
:mod:`dpcourse.checks._lab08_raised` (what an exception a rank raised says); this module runs
the learner's code and calls them.

The predict-then-measure parts live in :mod:`dpcourse.checks._lab08_peak`: ``measure_peak``
and ``check_peak_prediction`` (the learner's own wrapper on a five-layer MLP), and
``measure_schedules`` and ``check_schedule_predictions`` (three orders of launching and
waiting — ``SCHEDULES`` — run by the check's own ZeRO-2 and weighed alike). Every name is
importable from here.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import check_timeout, fail, passed, recorded, require_answer, run_ranks
from ._lab08_bounds import (ALIGN_BYTES, _BOUNDS_CASES, _bounds_problem,  # noqa: F401
                            check_shard_bounds)
from ._lab08_diagnose import (BUCKET_CAP, CONFIGS, DEFAULT_TIMEOUT, _GLOBAL_BATCH, _STEPS, _WIDTHS,
                              _diagnose, _mlp)
from ._lab08_diagnose import (_FROZEN, _LATE, _live_limit,  # noqa: F401 (tests read them)
                              _trainable_numels)
from ._lab08_raised import _raised
from ._lab08_memory import (_inner_tensors, _inputs, _live_gradients, _storages,  # noqa: F401
                            _Watched, prefer, weighing_lines)
from ._lab08_peak import (PEAK_CAP, PEAK_WIDTHS, PEAK_WORLD_SIZE, SCHEDULES,  # noqa: F401
                          _peak_mlp, _peak_worker, check_peak_prediction,
                          check_schedule_predictions, expected_peak, measure_peak,
                          measure_schedules, peak_buckets, schedule_peaks)

__all__ = ["check_shard_bounds", "check_zero_two", "measure_peak", "check_peak_prediction",
           "measure_schedules", "check_schedule_predictions", "schedule_peaks", "SCHEDULES",
           "peak_buckets", "expected_peak", "CONFIGS", "BUCKET_CAP", "ALIGN_BYTES",
           "PEAK_WIDTHS", "PEAK_CAP", "PEAK_WORLD_SIZE", "DEFAULT_TIMEOUT"]

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



# The references' weights after each step, per (world size, optimizer, rank), kept for the
# life of the rank's process: they depend only on the check's model, batches and optimizer, not
# on the learner's code, so a process that runs several wrappers in turn (the tests) makes them
# once. Checked against the model's initial weights before each reuse.
_REFERENCE_RUNS: dict = {}


def _reference_runs(model, initial, rank: int, world_size: int, opt_name: str) -> list:
    """Every reference of ``_REFERENCES`` (DDP from a copy of ``model``, with the full optimizer)
    run for ``_STEPS`` steps on this rank's shards: their flat weights after each step, as
    [{name: weights}]. Run before the learner's code, with every rank of the group (DDP's
    collectives)."""
    __tracebackhide__ = True
    from torch.nn.parallel import DistributedDataParallel as DDP

    key = (world_size, opt_name, rank)
    kept_run = _REFERENCE_RUNS.get(key)
    if kept_run is not None and torch.equal(kept_run[0], initial):
        return kept_run[1]
    references = {}
    for name in _REFERENCES:
        m = copy.deepcopy(model)
        opt_cls, kw = _optimizer(opt_name)
        references[name] = (m, DDP(m), opt_cls(m.parameters(), **kw), {})
    steps = []
    for step in range(_STEPS):
        X, y = _batch(step, rank, world_size)
        rec = {}
        for name, (m, wrapped, ref_opt, kept) in references.items():
            _reference_step(name, m, wrapped, ref_opt, kept, X, y, world_size)
            rec[name] = _flat(m)
        steps.append(rec)
    _REFERENCE_RUNS[key] = (initial.clone(), steps)
    return steps


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


def _refuse_misaligned(call, world_size: int, grad_ptr) -> None:
    """Before a reduce-scatter of the learner's: every rank's piece of its input, and its
    output slice of ``self.shard.grad``, must start on an ``ALIGN_BYTES`` boundary (contract 2:
    the pieces are ``shard_bounds``')."""
    if call.op != "reduce_scatter" or not call.numel or world_size == 1:
        return
    out = (call.args or {}).get("output")
    if not isinstance(out, torch.Tensor):
        return
    size = out.element_size()
    piece = call.numel // world_size
    if (piece * size) % ALIGN_BYTES:
        raise RuntimeError(f"lab08-misaligned piece {piece} {size} {world_size}")
    if out.untyped_storage().data_ptr() == grad_ptr and \
            (out.storage_offset() * size) % ALIGN_BYTES:
        raise RuntimeError(f"lab08-misaligned offset {out.storage_offset()} {size} {world_size}")



def _zero_worker(rank: int, world_size: int, cls, opt_name: str) -> dict:
    """One rank: the learner's wrapper for ``_STEPS`` steps, beside the same steps of every
    reference (run first, and once per process: :func:`_reference_runs`). Returns the weights after every step, what happened in order during
    each backward (gradients arriving, reduce-scatters launched and waited), the gradient
    memory alive at each arrival, the optimizer's state."""
    __tracebackhide__ = True
    from ..collectives import record_collectives

    model = _mlp()
    named = dict(model.named_parameters())            # a tied weight appears once
    params = list(named.values())
    trainable = [p for p in params if p.requires_grad]
    initial = _flat(model)
    reference_steps = _reference_runs(model, initial, rank, world_size, opt_name)
    opt_cls, kw = _optimizer(opt_name)
    names = [n for n, p in named.items() for _ in range(p.numel())]
    names_of = [n for n, p in named.items() if p.requires_grad]     # trainable, in order

    log: list = []                                      # what happened, in order
    tracked: list = []                                  # weak references to each full gradient
    state = {"phase": "init", "learner": None, "skip": set(), "grad_ptr": None, "flying": {}}
    memory = {"peak": 0, "where": {}}

    def live():
        return _live_gradients(trainable, tracked, state)

    def weigh(moment=("arrival",)):        # at an arrival; inside your code: each line,
        total, where = _live_gradients(trainable, tracked, state,      # launch and wait()
                                       inside=moment[0] != "arrival")
        if total > memory["peak"] or total == memory["peak"] and \
                prefer(memory.get("moment"), moment):
            launched = {e[1] for e in log if e[0] == "launch" and e[3]}
            waited = {e[1] for e in log if e[0] == "wait"}
            memory["peak"], memory["where"] = total, where
            memory["in_flight"] = len(launched - waited)
            memory["moment"] = moment
            memory["flying_bytes"] = sum(state["flying"].values())

    index = {p: i for i, p in enumerate(trainable)}

    def seen(p):                                       # the check's hook: runs before yours
        log.append(("grad", p.numel(), index[p]))
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
            _refuse_misaligned(call, world_size, state["grad_ptr"])
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
            buckets = _bucket_indices(opt, trainable)
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
                    loss = F.cross_entropy(model(X), y)
                    with weighing_lines(weigh):
                        loss.backward()
                except Exception as exc:
                    _raise_if_reread(exc, given)
                    exc = _early_launch(exc, buckets, log, names_of, step)
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
                rec.update(reference_steps[step])
                steps.append(rec)
            state_after = _state_of(inner)
        return {"initial": initial, "steps": steps, "state_after": state_after, "names": names,
                "counters0": counters0, "reread": given.reread,
                "views": None, "hooked": hooked, "buckets": buckets, "trainable": names_of,
                "frozen": [(n, p.numel()) for n, p in named.items()
                                          if not p.requires_grad]}
    finally:
        torch.set_default_dtype(_MODEL_DTYPE)


def _bucket_indices(opt, trainable) -> list:
    """The wrapper's buckets as lists of indices into ``trainable`` when ``self.buckets``
    holds every trainable parameter once, else the contract's ``make_buckets`` (reverse
    order, closed once a bucket reaches ``BUCKET_CAP`` bytes)."""
    index = {p: i for i, p in enumerate(trainable)}
    given = getattr(opt, "buckets", None)
    try:
        out = [[index[p] for p in b] for b in given]
        if sorted(i for b in out for i in b) == list(range(len(trainable))):
            return out
    except (TypeError, KeyError):
        pass
    out, current, size = [], [], 0
    for i in reversed(range(len(trainable))):
        current.append(i)
        size += trainable[i].numel() * trainable[i].element_size()
        if size >= BUCKET_CAP:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def _early_launch(exc: Exception, buckets: list, log: list, names: list, step: int):
    """The learner's hook raised at an arrival that was the last-LISTED parameter of its
    bucket while another of that bucket's gradients had not arrived yet: tag it
    (``lab08-early``, read by ``_diagnose._raised``) — the bucket was taken as full because
    the parameter listed last had come, not because all of them had."""
    arrived = [e[2] for e in log if e[0] == "grad"]
    if not arrived:
        return exc
    last = arrived[-1]
    k = next((k for k, b in enumerate(buckets) if last in b), None)
    if k is None or buckets[k][-1] != last:
        return exc
    missing = [i for i in buckets[k] if i not in arrived]
    if not missing:
        return exc
    return RuntimeError(f"lab08-early {step + 1} {k} {names[last]} {names[missing[0]]} "
                        f"{','.join(names[i] for i in buckets[k])} | {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}")


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

