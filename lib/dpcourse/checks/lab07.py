"""Checks for lab07: ``assign_buckets(params, bucket_cap_mb)`` and the learner's bucketed,
hook-driven data-parallel wrapper (a class with ``finish_gradient_synchronization()``).

``check_assign_buckets`` runs in this process on ten sets of parameters (SmallCNN at two caps,
parameters larger than the cap, float64 parameters, parameters exactly the size of the cap, a
cap that holds the whole model, a frozen layer, three models of several dtypes). It asks for
DDP's rule — add the parameter to the open bucket of its dtype, close the bucket once it has
reached the cap — with the buckets in the order they complete, and names: forward order, a
bucket closed before the next parameter would exceed the cap (the other usual rule, not
DDP's), a bucket per parameter, everything in one bucket, elements counted instead of bytes, 4
bytes assumed per element, parameters lost or repeated, frozen parameters bucketed or weighed,
two dtypes in one bucket, a bucket closed when the dtype changes, one byte count for all
dtypes, the buckets in the order they were opened, the still-open buckets put last (torch's
own list when DDP rebuilds; the order they complete is the lab's rule) or the dtypes one after
the other (judged over the three mixed cases at once).
``check_bucket_prediction`` compares the learner's predicted bucket count for part 1's puzzle
with torch's own reducer function, run on it.

``check_bucketed_ddp`` runs the class for 3 steps on 2 ranks (4 buckets that fill out of
order) and then 3 ranks (another cap, 3 buckets), on a model with a frozen parameter whose
output layer is registered before the hidden layer it follows; then real
``DistributedDataParallel`` on the same shards. While the learner's class runs,
``dist.all_reduce`` is replaced by a spy that records every call (size, the buffer's storage,
``async_op``, when it was launched and when it was waited on), fills the learner's buffer with
NaN while the all-reduce is in flight, and hands the reduced values over **only when the
handle is waited on**. A hook registered before the learner's own stores each local gradient
and the moment it arrived. From that record the check names: a hook on the frozen parameter,
one all-reduce per parameter, messages that are not a bucket's flat buffer, a blocking
all-reduce, buckets launched out of bucket order, a bucket launched before all of its
gradients had arrived in this step (a bucket judged complete by `p.grad is not None`, which
zero_grad(set_to_none=False) makes true for all), a bucket launched later than it could have
been (every one only at the end of the backward, or after the backward), waiting inside the
hook, not waiting, no reset between steps, old handles waited on again, values read before
wait(), an all-reduce of a temporary, gradients that are not views of their bucket, views that
overlap or point into another bucket, add_ where copy_ belongs (three ways), a missing or
fixed division; a value wrong in no known way gets the launch and arrival times of its bucket.
Then a parameter the second step leaves out (in the first bucket, then in the last): no error,
an error that names it wrongly, and an error raised with launched all-reduces still in
flight.

``check_topk_hook`` (the stretch) runs the learner's DDP communication hook — top-k with
error feedback — in real DDP on 2 and 3 ranks and compares every call with a replay of the
algorithm on the same buckets (see the section's comment below); right values are then held
to the lab's asynchrony: no blocking collective in the hook, and a future still pending when
the hook returns on a rank that arrived ahead of the others.

``measure_launches`` and ``check_prediction`` are the lab's predict-then-measure cell: on
part 2's model, whose bucket 1 fills before bucket 0, how many gradients have arrived when the
learner's own wrapper launches bucket 1 (its in-order launch: after bucket 0, not when full).

This module holds the public checks, the workers that run part 2's wrapper and the diagnosis
of what it did. Part 1's rules, cases and puzzle live in
:mod:`dpcourse.checks._lab07_buckets`; the stretch's probe, worker, replay and diagnosis in
:mod:`dpcourse.checks._lab07_topk`.
"""

from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import launch
from . import check_timeout, fail, passed, recorded, require_answer, run_ranks
from ._lab07_buckets import (_DDP_CLOSING_FIX, _LIBRARY_ASSIGNMENT, _OTHER_RULES,
                             _TORCH_ASSIGNMENT, BUCKET_QUESTION, PUZZLE, PUZZLE_CAP_MB, MiB,
                             _bucket_cases, _calls_torch_assignment, _frozen_problem, _greedy,
                             _is_library_assignment, _no_library_assignment,
                             _no_torch_assignment, _puzzle_params, bucket_problem,
                             explain_puzzle, mixed_problem, order_rule_of,
                             show_bucket_puzzle)
from ._lab07_topk import (_HOOK_STEPS, _SENT_PER_ENTRY, HOOK_FRACTION, HOOK_WORLD_SIZES,
                          _diagnose_hook, _launch_hook, _topk_worker)

__all__ = ["check_assign_buckets", "show_bucket_puzzle", "check_bucket_prediction",
           "check_bucketed_ddp", "check_topk_hook", "check_prediction", "measure_launches",
           "show_prediction_model", "CONFIGS", "DEFAULT_TIMEOUT", "HOOK_WORLD_SIZES",
           "HOOK_FRACTION", "PREDICTION_CAP_MB", "PREDICTION_BUCKET", "PREDICTION_QUESTION",
           "BUCKET_QUESTION"]

DEFAULT_TIMEOUT = 30.0


# --------------------------------------------------------------------------------------------
# assign_buckets (its cases, rules and sentences: _lab07_buckets)
# --------------------------------------------------------------------------------------------


@recorded
def check_assign_buckets(assign_buckets) -> None:
    """Run ``assign_buckets(params, bucket_cap_mb)`` on ten sets of parameters and caps."""
    __tracebackhide__ = True
    require_answer(assign_buckets, "assign_buckets")
    if _is_library_assignment(assign_buckets):
        fail(_LIBRARY_ASSIGNMENT)
    if _calls_torch_assignment(assign_buckets):
        fail(_TORCH_ASSIGNMENT)
    counts, problems, got, answers, problems_at = [], [], [], [], []
    library = []            # per case that called the course's reference: answer == its answer?
    cases = _bucket_cases()
    for what, everything, cap in cases:
        try:
            with _no_torch_assignment() as called, _no_library_assignment() as ours:
                buckets = assign_buckets(list(everything), cap)
        except NotImplementedError:
            raise
        except Exception as exc:
            fail(f"assign_buckets raised {type(exc).__name__}: {exc} ({what}).")
        if ours:        # the course's reference called: is the answer simply its answer?
            from ..overlap import assign_buckets as reference
            same = [[id(p) for p in b] for b in reference(
                [p for p in everything if p.requires_grad], cap)]
            try:
                library.append([[id(p) for p in b] for b in buckets] == same)
            except TypeError:
                library.append(False)
        if called:
            fail(_TORCH_ASSIGNMENT)
        answers.append(buckets)
        ids = {id(p): i for i, p in enumerate(p for p in everything if p.requires_grad)}
        try:
            got.append([[ids.get(id(p)) for p in b] for b in buckets])
        except TypeError:
            got.append(None)
    if library and all(library):    # the course's reference, handed on unchanged
        fail(_LIBRARY_ASSIGNMENT)
    several = [len({p.dtype for p in ps}) > 1 for _, ps, _ in cases]
    # the order of the buckets, judged over every case of several dtypes at once
    how = order_rule_of([g for g, s in zip(got, several) if s])
    for (what, everything, cap), buckets, mixed in zip(cases, answers, several):
        params = [p for p in everything if p.requires_grad]
        problem = (_frozen_problem(buckets, everything, cap, what)
                   or (mixed_problem(buckets, params, cap, what, how) if mixed
                       else bucket_problem(buckets, params, cap, what)))
        problems_at.append(problem)
        if problem:
            problems.append(problem)
        else:
            counts.append(len(buckets))
    # the cases of one dtype and no frozen parameter (those have sentences of their own)
    plain = [k for k, (_, ps, _) in enumerate(cases)
             if all(p.requires_grad for p in ps) and len({p.dtype for p in ps}) == 1]
    if problems and all(got[k] is not None for k in plain):
        # Sizes measured in the wrong unit give buckets that are right for that unit in
        # every case: name the unit rather than the first over-full bucket.
        for variant, size_of in (("counted elements (p.numel()) as bytes", lambda p: p.numel()),
                                 ("assumed 4 bytes per element", lambda p: 4 * p.numel())):
            predicted = [_greedy([size_of(p) for p in cases[k][1]], cases[k][2] * MiB,
                                 list(range(len(cases[k][1]) - 1, -1, -1))) for k in plain]
            if [got[k] for k in plain] == predicted:
                k = next(k for k in plain if problems_at[k])
                what, ps, cap = cases[k]
                right = _greedy([p.numel() * p.element_size() for p in ps], cap * MiB,
                                list(range(len(ps) - 1, -1, -1)))
                fail(f"the buckets are what you get if you {variant}, so the cap was compared "
                     f"with a number that is not the parameter's bytes ({what}: "
                     f"{len(got[k])} bucket(s) where DDP makes {len(right)}). The cap bounds "
                     f"each message's bytes on the wire, and an element's bytes depend on its "
                     f"dtype ({ps[0].dtype} here: {ps[0].element_size()} each).",
                     fix="a parameter's size in bytes is p.numel() * p.element_size().")
        for rule, sentence in _OTHER_RULES:
            predicted = [rule([p.numel() * p.element_size() for p in cases[k][1]],
                              cases[k][2] * MiB) for k in plain]
            if [got[k] for k in plain] == predicted:
                fail(sentence, fix=_DDP_CLOSING_FIX)
    if problems:
        fail(problems[0], fix=problems[0].fix)
    passed(f"assign_buckets: reverse order, each bucket closed once it reached the cap, in bytes, "
           f"frozen parameters in no bucket, one open bucket per dtype, buckets in the order "
           f"they complete ({'/'.join(map(str, counts))} buckets in the {len(cases)} cases)")


def check_bucket_prediction(guess, assign_buckets=None) -> None:
    """Compare the learner's predicted number of buckets for part 1's puzzle with the buckets
    torch's own reducer function makes of it (run now), and say why, and what the other counts
    would have meant; with ``assign_buckets``, say whether the learner's makes the same."""
    __tracebackhide__ = True
    from . import reveal

    learners = None
    if assign_buckets is not None:
        params = _puzzle_params()
        ids = {id(p): i for i, p in enumerate(params)}
        try:
            learners = [[ids.get(id(p)) for p in b] for b in assign_buckets(params, PUZZLE_CAP_MB)]
        except NotImplementedError:
            raise
        except Exception as exc:
            fail(f"assign_buckets raised {type(exc).__name__}: {exc} (part 1's "
                 f"{len(PUZZLE)} parameters).", fix="make part 1's check pass first.")
    count, why = explain_puzzle(guess, learners)
    reveal(guess, count, close=guess.value == count, explanation=why)


# --------------------------------------------------------------------------------------------
# The wrapper, on 2 and 3 ranks
# --------------------------------------------------------------------------------------------

# The check's model: registered in one order, run in another, with a frozen parameter.
# Registration: conv (3 -> w -> 2w), out (64 -> 10), hidden (64 -> 64), a frozen scale.
# Forward: conv -> hidden -> scale -> out, so the backward produces out's gradients first: in
# reverse registration order out comes *after* hidden, and at 0.002 MiB its bucket (bucket 1)
# is complete before bucket 0 (hidden) — buckets fill out of order.
CONFIGS = ((2, 0.002), (3, 0.004))   # (world size, bucket_cap_mb): 4 buckets, then 3
_STEPS = 3
_GLOBAL_BATCH = 24
# how each step starts: p.grad None (nothing yet), zeroed in place, set to None again
_ZERO_GRAD = (True, False, True)


class _CheckNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),            # 8x8
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4))    # 2x2
        self.out = nn.Linear(64, 10)          # registered before `hidden`, runs after it
        self.hidden = nn.Linear(8 * width, 64)
        self.scale = nn.Parameter(torch.full((64,), 0.5), requires_grad=False)   # frozen

    def forward(self, x):
        h = torch.relu(self.hidden(self.conv(x).flatten(1))) * self.scale
        return self.out(h)


def _check_net() -> nn.Module:
    torch.manual_seed(0)
    return _CheckNet()


class _Deferred:
    """What the spy returns for ``all_reduce(..., async_op=True)``: the real all-reduce runs on
    a copy, and its result is written into the learner's tensor when the handle is waited on
    (or its future completes). Until then the learner's tensor holds NaN, as a buffer a GPU
    collective is still writing holds no defined value."""

    def __init__(self, work, buf, target, rec, state):
        self._work, self._buf, self._target, self._rec = work, buf, target, rec
        self._state = state          # the check's current step, to notice stale handles
        self._delivered = False

    def _deliver(self):
        if not self._delivered:
            self._target.copy_(self._buf)
            self._delivered = True

    def wait(self, *args, **kwargs):
        if self._state["step"] != self._rec["step"]:
            self._state["stale_waits"].append((self._state["step"], self._rec["step"]))
        self._work.wait(*args, **kwargs)
        if self._rec["t_wait"] is None:
            self._rec["t_wait"] = time.perf_counter()
        self._deliver()
        return True

    def is_completed(self):
        return self._work.is_completed() and self._delivered

    def get_future(self):
        self._rec["future"] = True

        def delivered(fut):
            self._deliver()
            if self._rec["t_wait"] is None:
                self._rec["t_wait"] = time.perf_counter()
            return [self._target]

        return self._work.get_future().then(delivered)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _deferring_spy(calls, state, where=False):
    """The ``before``/``after`` pair for ``record_collectives`` that both workers use: each
    all_reduce the learner launches is appended to ``calls`` (its step, size, whether async,
    when waited on; with ``where``, also when launched and which storage it reads), and an async
    one runs on a copy that a ``_Deferred`` delivers on wait(), while the learner's tensor holds
    NaN — so reading it before waiting gives wrong numbers, as on a GPU."""
    pending = {}                            # a recorded call's index -> (its record, tensors)

    def before(call):
        if call.function != "all_reduce":
            return
        tensor = call.args["tensor"]
        rec = {"step": state["step"], "numel": tensor.numel(), "async": call.async_op,
               "t_wait": None, "future": False}
        if where:
            rec.update(t_launch=time.perf_counter(), storage=_storage(tensor),
                       offset=tensor.storage_offset())
        calls.append(rec)
        if call.async_op:
            call.args["tensor"] = tensor.detach().clone()
        pending[call.index] = (rec, tensor, call.args["tensor"])

    def after(call):
        if call.index not in pending:
            return None
        rec, tensor, buf = pending.pop(call.index)
        if not call.async_op:
            rec["t_wait"] = time.perf_counter()
            return None
        tensor.detach().fill_(float("nan"))     # in flight: no defined value until wait()
        return _Deferred(call.result, buf, tensor, rec, state)

    return before, after


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held_storages(obj, depth: int = 0, seen=None) -> set:
    """The storages of every tensor the learner's object keeps (attributes, lists, dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return set()
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {_storage(obj)}
    items = []
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif isinstance(obj, nn.Module):
        items = [v for k, v in vars(obj).items() if k not in ("_modules", "_parameters")]
    out = set()
    for x in items:
        out |= _held_storages(x, depth + 1, seen)
    return out


def _bucketed_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    __tracebackhide__ = True
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import ddp
    from ..collectives import record_collectives

    dev = ddp.setup_rank()
    cfg = ddp.StepConfig(global_batch=_GLOBAL_BATCH, steps=_STEPS, lr=0.1, width=8, n_train=96)
    batches = [ddp.shard_of(*ddp.global_batch_for_step(cfg, s), rank, world_size)
               for s in range(_STEPS)]
    module = _check_net().to(dev)
    everything = list(module.parameters())
    params = [p for p in everything if p.requires_grad]
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    frozen = {id(p): n for n, p in module.named_parameters() if not p.requires_grad}
    index = {id(p): i for i, p in enumerate(params)}
    local, ready = {}, {}

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        local[index[id(p)]] = p.grad.detach().clone()
        ready[index[id(p)]] = time.perf_counter()

    for p in params:
        p.register_post_accumulate_grad_hook(spy_ready)

    real = dist.all_reduce                  # the check's own all-reduces bypass the spy
    calls: list[dict] = []
    state = {"step": -1, "stale_waits": []}
    before, after = _deferring_spy(calls, state, where=True)

    steps = []
    with record_collectives(before=before, after=after):
        model = cls(module, bucket_cap_mb=cap_mb)
        buckets = getattr(model, "buckets", None)
        try:
            bucket_idx = [[index.get(id(p), -2 if id(p) in frozen else -1) for p in b]
                          for b in buckets]
        except TypeError:
            bucket_idx = None
        if bucket_idx is not None and any(i < 0 for b in bucket_idx for i in b):
            return {"buckets": bucket_idx, "names": names, "frozen": list(frozen.values())}
        if not hasattr(model, "finish_gradient_synchronization"):
            raise AttributeError("the class has no finish_gradient_synchronization() method")
        opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
        for step, (X, y) in enumerate(batches):
            state["step"] = step
            local.clear()
            ready.clear()
            opt.zero_grad(set_to_none=_ZERO_GRAD[step])
            t0 = time.perf_counter()
            F.cross_entropy(model(X.to(dev)), y.to(dev)).backward()
            t_backward = time.perf_counter()
            model.finish_gradient_synchronization()
            t_finish = time.perf_counter()
            after = [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]
            views = [None if p.grad is None else
                     (_storage(p.grad), p.grad.storage_offset(), p.grad.numel()) for p in params]
            held = _held_storages(model) | {v[0] for v in views if v}
            own = [local.get(i) for i in range(len(params))]
            if any(g is None for g in own):
                raise RuntimeError("the check's own hook saw no gradient for some parameter")
            mean = []
            for g in own:              # the right answer, with the real collective
                m = g.clone()
                real(m)
                mean.append((m / world_size).cpu())
            ms = lambda t: None if t is None else (t - t0) * 1e3
            steps.append({
                "after": after, "own": [g.cpu() for g in own], "views": views,
                "mean": mean, "ready": {i: ms(t) for i, t in ready.items()},
                "backward_end": ms(t_backward), "finish_end": ms(t_finish),
                "calls": [dict(c, t_launch=ms(c["t_launch"]), t_wait=ms(c["t_wait"]),
                               kept=c["storage"] in held)
                          for c in calls if c["step"] == step],
                "stale_waits": [old for now, old in state["stale_waits"] if now == step],
            })
            opt.step()
        learner = ddp.flat_params(module)
    # Real DDP from the same start on the same shards: the answer the wrapper must equal.
    ref = _check_net().to(dev)
    ddp_model = DDP(ref, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg.lr)
    for X, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(X.to(dev)), y.to(dev)).backward()
        opt.step()
    return {"steps": steps, "params": learner, "ddp": ddp.flat_params(ref),
            "buckets": bucket_idx, "names": names, "frozen": list(frozen.values()),
            "numels": [p.numel() for p in params]}


def _launch(cls, world_size: int, cap_mb: float, timeout: float) -> list:
    __tracebackhide__ = True
    from .. import devices

    def failed(exc) -> None:
        if "doesn't require gradient" in exc.summary or "does not require grad" in exc.summary:
            fail("you registered a hook on a frozen parameter (requires_grad=False; the check's "
                 "model has one, `scale`): torch refuses it, and it never gets a gradient.",
                 fix="give views and hooks only to the parameters in self.buckets.")
        if "AVG" in exc.summary or "ReduceOp" in exc.summary:
            fail(f"your code raised on rank {exc.rank}: {exc.summary} — this backend refuses "
                 f"that reduce op.", fix="all-reduce with SUM and divide by the world size.")

    return run_ranks(_bucketed_worker, world_size, cls, cap_mb,
                     backend=devices.backend_for(world_size), timeout=timeout, failed=failed,
                     hang="every rank must launch the same all-reduces in the same order (same "
                          "buckets, no rank-dependent branches), and every launched all-reduce "
                          "must be waited on.")


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def _all_close(xs, ys) -> bool:
    return all(_close(x, y) for x, y in zip(xs, ys))


@recorded
def check_bucketed_ddp(cls, configs=CONFIGS, timeout: float | None = None) -> None:
    """Run the learner's wrapper class for 3 steps on 2 ranks (0.002 MiB buckets, which fill
    out of order) and on 3 ranks (0.004 MiB), on a model with a frozen parameter; its
    collectives, their order, their timing against each gradient's arrival, the gradients it
    leaves (values, and views of the bucket) are checked at every step, and its final weights
    against real DDP's."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(cls, getattr(cls, "__name__", "BucketedDDP"), "class")
    from ..overlap import BucketedDataParallel

    if isinstance(cls, type) and issubclass(cls, BucketedDataParallel):
        fail(f"{cls.__name__} is (or extends) lesson 07's BucketedDataParallel from the course "
             f"library: part 2 asks for your own wrapper, which keeps the two promises that "
             f"class does not (gradients as views of the buckets, launches in bucket order).")
    for world_size, cap_mb in configs:
        results = _launch(cls, world_size, cap_mb, timeout)
        _diagnose(results, world_size, cap_mb)
    _check_dtypes(cls, timeout)
    _check_unused(cls, timeout)
    shown = " and ".join(f"{ws} ranks ({cap} MiB buckets)" for ws, cap in configs)
    passed(f"{cls.__name__}: one async all-reduce per bucket, launched in bucket order as soon "
           f"as it could be, waited before the step; gradients are views of the buckets; "
           f"weights == DDP's after {_STEPS} steps on {shown}; a float64 layer beside float32 "
           f"ones averaged in its own bucket; a parameter left without a gradient is named")


# A model of two dtypes: part 1's buckets hold one dtype each, so the float64 head gets a
# bucket of its own, and its gradients can be views only of a float64 buffer.
class _TwoDtypeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.head = nn.Linear(16, 4).double()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)).double())


def _dtype_worker(rank: int, world_size: int, cls, cap_mb: float) -> list:
    """One step of the two-dtype model: every parameter's dtype, its p.grad's dtype and values,
    whether p.grad is a view of a buffer the wrapper keeps, and the right mean."""
    __tracebackhide__ = True
    import torch.distributed as dist

    torch.manual_seed(0)
    module = _TwoDtypeNet()
    named = list(module.named_parameters())
    own = {}

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        own[id(p)] = p.grad.detach().clone()

    for _, p in named:
        p.register_post_accumulate_grad_hook(spy_ready)
    model = cls(module, bucket_cap_mb=cap_mb)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(6, 12), torch.arange(6) % 4
    module.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    model.finish_gradient_synchronization()
    held = _held_storages(model)
    out = []
    for name, p in named:
        mean = own[id(p)].clone()
        dist.all_reduce(mean)
        out.append({"name": name, "dtype": str(p.dtype).removeprefix("torch."),
                    "grad": None if p.grad is None else p.grad.detach().clone(),
                    "view": p.grad is not None and _storage(p.grad) in held,
                    "mean": mean / world_size})
    return out


def _check_dtypes(cls, timeout: float, cap_mb: float = CONFIGS[0][1]) -> None:
    """On 2 ranks, one step of a model with a float64 layer beside float32 ones: the float64
    gradients averaged, and views of a float64 bucket."""
    __tracebackhide__ = True
    what = ("a model whose head is float64 and its body float32 (part 1 gives each dtype "
            "buckets of its own)")

    def failed(exc) -> None:
        if "different type" in exc.summary or "dtype" in exc.summary.lower() or (
                "Double" in exc.summary and "Float" in exc.summary):
            fail(f"your wrapper raised on rank {exc.rank} on {what}: {exc.summary[:240]} — a "
                 f"float64 parameter's gradient can be no view of a float32 buffer, and "
                 f"autograd refuses it as p.grad.",
                 fix="make each bucket's flat buffer of its parameters' dtype (and device).")
        fail(f"your wrapper raised on rank {exc.rank} on {what}: {exc.summary[:300]}")

    results = run_ranks(_dtype_worker, 2, cls, cap_mb, timeout=timeout, failed=failed,
                        hang="every rank must launch the same all-reduces in the same order, "
                             "and every launched all-reduce must be waited on.")
    for rank, per_param in enumerate(results):
        for r in per_param:
            if r["grad"] is None or not _close(r["grad"].double(), r["mean"].double()):
                fail(f"on {what}, {r['name']}.grad ({r['dtype']}) is not the mean over the "
                     f"ranks on rank {rank} after finish_gradient_synchronization(), though the "
                     f"float32 model's were right.",
                     fix="give every bucket its own buffer of its own dtype, and all-reduce "
                         "each.")
            if not r["view"]:
                fail(f"on {what}, {r['name']}.grad ({r['dtype']}) holds the right mean on rank "
                     f"{rank} but is not a view of any buffer your wrapper keeps: it was copied "
                     f"back from a buffer of another dtype.",
                     fix="make each bucket's flat buffer of its parameters' dtype, so that "
                         "p.grad can be its view.")


# A trainable parameter the second step's forward does not use: its bucket is never complete.
class _UnusedNet(_CheckNet):
    def __init__(self, width: int = 8):
        super().__init__(width)
        self.head = nn.Linear(10, 10)         # trainable, registered last: in bucket 0
        self.use_head = True

    def forward(self, x):
        out = super().forward(x)
        return self.head(out) if self.use_head else out


class _ShiftNet(nn.Module):
    """A trainable `shift` registered first, so in the LAST bucket, added to the input only
    while ``use_shift``: when a backward leaves it out, every bucket before its own is complete
    and launched, and still in flight when the step ends."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(3, 1, 1))
        self.net = _CheckNet()
        self.use_shift = True

    def forward(self, x):
        return self.net(x + self.shift if self.use_shift else x)


# The models and how step 2 (the one that leaves a parameter out) starts. `head` (bucket 0):
# gradients zeroed in place first — then `head.grad` still holds step 1's tensor, so "no
# gradient" cannot be read from `p.grad is None` — and then, on a fresh model, set to None.
# `shift` (the last bucket): the buckets before it were launched, and the error must not leave
# them in flight.
_UNUSED_CASES = (("head", False), ("head", True), ("shift", True))
_UNUSED_NAMES = {"head": ("head.weight", "head.bias"), "shift": ("shift",)}
_UNUSED_WHERE = {"head": "registered last, so in bucket 0",
                 "shift": "registered first, so in the last bucket"}


def _unused_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    """Per case of _UNUSED_CASES (a fresh model and wrapper each): step 1 uses every parameter,
    step 2 leaves one out. Records what finish_gradient_synchronization() said after each step,
    and which of step 2's launched all-reduces were never waited on when it ended."""
    __tracebackhide__ = True
    from .. import ddp
    from ..collectives import record_collectives

    dev = ddp.setup_rank()
    state = {"step": 0, "stale_waits": []}
    calls = []
    before, after = _deferring_spy(calls, state)

    out = {}
    with record_collectives(before=before, after=after):
        for which, set_to_none in _UNUSED_CASES:
            torch.manual_seed(0)
            module = (_UnusedNet() if which == "head" else _ShiftNet()).to(dev)
            model = cls(module, bucket_cap_mb=cap_mb)
            torch.manual_seed(1 + rank)
            x, y = torch.randn(4, 3, 32, 32, device=dev), torch.arange(4, device=dev)
            said, in_flight = {}, []
            for step, use in ((1, True), (2, False)):
                module.zero_grad(set_to_none=True if step == 1 else set_to_none)
                setattr(module, f"use_{which}", use)
                state["step"] = (which, set_to_none, step)
                F.cross_entropy(model(x), y).backward()
                try:
                    model.finish_gradient_synchronization()
                except NotImplementedError:
                    raise
                except Exception as exc:
                    said[step] = f"{type(exc).__name__}: {exc}"
                else:
                    said[step] = None
                in_flight = [n for n, c in enumerate(c for c in calls
                                                     if c["step"] == state["step"])
                             if c["async"] and c["t_wait"] is None and not c["future"]]
                if step == 1 and said[1] is not None:
                    break
            used = [n for n, p in module.named_parameters()
                    if p.requires_grad and n not in _UNUSED_NAMES[which]]
            out[which, set_to_none] = {"said": said, "used": used, "in_flight": in_flight}
    return out


def _check_unused(cls, timeout: float, cap_mb: float = CONFIGS[0][1]) -> None:
    """Models with a trainable parameter that the second step's forward leaves out (`head`,
    registered last, so in bucket 0; `shift`, registered first, so in the last bucket):
    finish_gradient_synchronization() must return after step 1 and raise after step 2, naming
    that parameter and no other — whether step 2 began with the gradients zeroed in place
    (``head.grad`` then still holds a tensor) or set to None — and leave none of the
    all-reduces it launched in flight."""
    __tracebackhide__ = True
    from .. import devices

    results = run_ranks(_unused_worker, 2, cls, cap_mb, backend=devices.backend_for(2),
                        timeout=timeout,
                        hang="with a parameter that got no gradient, every rank must still "
                             "launch the same all-reduces (or none) and wait only on those.")
    for which, set_to_none in _UNUSED_CASES:
        names = _UNUSED_NAMES[which]
        unused = " and ".join(names)
        how = f"zero_grad(set_to_none={set_to_none})"
        stale = "" if set_to_none else (
            f" After {how}, a parameter the backward left out still has a .grad (step 1's "
            f"tensor, zeroed in place), so whether it got a gradient in this backward cannot be "
            f"read from p.grad; only this backward's hooks know which parameters arrived.")
        for rank, per_case in enumerate(results):
            r = per_case[which, set_to_none]
            if r["said"][1] is not None:
                fail(f"finish_gradient_synchronization() raised on rank {rank} after a backward "
                     f"in which every parameter got a gradient ({r['said'][1][:200]}) — on a "
                     f"model with a parameter `{which}` that the next step's forward leaves out.",
                     fix="raise only when a bucket is still awaiting a gradient at the end of "
                         "the step.")
            said = r["said"][2]
            if said is None:
                fail(f"on a model whose {unused} got a gradient in step 1 but none in step 2 "
                     f"(step 2 began with {how}), finish_gradient_synchronization() returned on "
                     f"rank {rank} although their bucket never became complete: that bucket "
                     f"(and every one after it) was never all-reduced, so the gradients left "
                     f"there are stale or this rank's own.{stale}",
                     fix="raise an error that names the parameter(s) that got no gradient in "
                         "this backward.")
            missing = [n for n in names if n not in said]
            if missing:
                fail(f"on a model whose {unused} got a gradient in step 1 but none in step 2 "
                     f"(step 2 began with {how}), finish_gradient_synchronization() raised on "
                     f"rank {rank} ({said[:200]}), but its message does not name "
                     f"{' and '.join(missing)}, so whoever trains the model cannot find it."
                     f"{stale}",
                     fix="name every parameter that got no gradient in this backward, by its "
                         "name in the module.")
            wrongly = [n for n in r["used"]
                       if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", said)]
            if wrongly:
                fail(f"on a model whose {unused} got no gradient in step 2, "
                     f"finish_gradient_synchronization() raised on rank {rank}, but its message "
                     f"also names {', '.join(wrongly[:3])}, which did get a gradient in this "
                     f"backward (a name kept from an earlier step, or every parameter of the "
                     f"incomplete bucket, misleads).",
                     fix="name only the parameters that got no gradient in this backward.")
            flying = r["in_flight"]
            if flying:
                shown = (f"bucket {flying[0]}" if len(flying) == 1 else
                         f"buckets {', '.join(map(str, flying[:-1]))} and {flying[-1]}")
                fail(f"on a model whose {unused} ({_UNUSED_WHERE[which]}) got "
                     f"no gradient in step 2, finish_gradient_synchronization() raised on rank "
                     f"{rank} while the all-reduces it had launched for {shown} were still in "
                     f"flight, never waited on: those buffers are the parameters' .grad, so a "
                     f"collective may still be writing them after the error has reached the "
                     f"caller, who may read them (to log them, to save a checkpoint) — and a "
                     f"work never waited on is never known to have finished. The error ends "
                     f"the run; it need not leave the gradients racing.",
                     fix="wait on the all-reduces already launched before raising: every rank "
                         "launched them (they are the buckets before the incomplete one), so "
                         "waiting cannot hang.")


def _diagnose(results: list, world_size: int, cap_mb: float) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    names = r0["names"]
    buckets = r0["buckets"]
    if buckets is None:
        fail("the wrapper has no self.buckets list of lists of parameters: keep the buckets "
             "from assign_buckets in self.buckets.")
    if any(i == -2 for b in buckets for i in b):
        fail(f"self.buckets holds the frozen parameter {r0['frozen'][0]} (requires_grad=False): "
             f"it never gets a gradient, so its bucket would never be complete.",
             fix="bucket only the parameters that require a gradient.")
    if any(i < 0 for b in buckets for i in b):
        fail("self.buckets holds something that is not one of the model's parameters.")
    params = [p for p in _check_net().parameters() if p.requires_grad]
    problem = bucket_problem([[params[i] for i in b] for b in buckets], params, cap_mb)
    if problem:
        fail(f"self.buckets is wrong at {cap_mb} MiB: {problem}", fix=problem.fix)
    numels = r0["numels"]
    for rank, r in enumerate(results):
        for step, s in enumerate(r["steps"]):
            prev = r["steps"][step - 1] if step else None
            _diagnose_step(s, prev, step, rank, world_size, buckets, names, numels)
    for rank, r in enumerate(results):
        if not torch.allclose(r["params"], r["ddp"], rtol=1e-4, atol=1e-6):
            fail(f"every step's gradients were right, but after {_STEPS} steps rank {rank}'s "
                 f"weights differ from DDP's: something in the wrapper changed the weights.",
                 fix="leave the optimizer step to the caller and do not change the weights in "
                     "the wrapper.")


def _bucket_of_call(calls, buckets, numels) -> list:
    """The bucket each call carried: by its size (the check's buckets all differ in size)."""
    by_size = {sum(numels[i] for i in b): k for k, b in enumerate(buckets)}
    return [by_size.get(c["numel"]) for c in calls]


def _diagnose_step(s, prev, step, rank, world_size, buckets, names, numels) -> None:
    __tracebackhide__ = True
    calls = s["calls"]
    n_params = len(names)
    when = f"in step {step + 1}" + (f" on rank {rank}" if rank else "")
    bucket_numels = sorted(sum(numels[i] for i in b) for b in buckets)
    # 1. How many all-reduces, and how large.
    if not calls:
        if step > 0:
            fail(f"no all-reduce was launched {when}, after a first step that had them: what "
                 f"the wrapper remembered from the first step still said every bucket was "
                 f"launched.",
                 fix="at the end of finish_gradient_synchronization() reset each bucket's count "
                     "of awaited gradients, the next bucket to launch and the list of handles.")
        fail("the check saw no dist.all_reduce call: launch it as dist.all_reduce(buffer, "
             "async_op=True) from the hook (the check counts calls made through "
             "torch.distributed).")
    sync_in_backward = [c for c in calls if not c["async"] and c["t_launch"] < s["backward_end"]]
    if sync_in_backward:
        fail("the hook calls a blocking all_reduce (no async_op=True): the backward stops until "
             "each bucket has crossed the wire, so nothing overlaps.",
             fix="launch it with async_op=True, keep the handle, and wait in "
                 "finish_gradient_synchronization().")
    if len(calls) != len(buckets):
        if len(calls) == n_params:
            fail(f"{len(calls)} all-reduces {when}, one per parameter, for {len(buckets)} "
                 f"buckets.", fix="all-reduce each bucket's flat buffer once.")
        fail(f"{len(calls)} all-reduces {when} for {len(buckets)} buckets.",
             fix="launch exactly one per bucket, when it is complete and every bucket before it "
                 "has been launched.")
    if sorted(c["numel"] for c in calls) != bucket_numels:
        fail(f"the all-reduces {when} carried {sorted(c['numel'] for c in calls)} elements; "
             f"the buckets hold {bucket_numels}.",
             fix="all-reduce each bucket's whole flat buffer (the sum of its parameters' "
                 "numel).")
    # 2. In which order, and when, they were launched; when they were waited on.
    order = _bucket_of_call(calls, buckets, numels)
    if order != sorted(order):
        k = next(j for j in range(len(order)) if order[j] != sorted(order)[j])
        fail(f"bucket {order[k]} was launched before bucket {sorted(order)[k]} {when}: buckets "
             f"filled out of order (this model registers its output layer before the hidden "
             f"layer it follows) and you launched each as it filled, so the i-th all-reduce "
             f"need not be the same bucket on every rank.",
             fix="when a bucket is complete, launch it only if every earlier bucket has been "
                 "launched, then every later one already complete.")
    arrivals = sorted(s["ready"].values())
    for k, b in enumerate(buckets):
        launched_at = calls[order.index(k)]["t_launch"]
        arrived = sum(1 for i in b if s["ready"][i] < launched_at)
        if arrived < len(b):
            stale = "" if _ZERO_GRAD[step] else (
                f" This step began with zero_grad(set_to_none=False): every p.grad existed "
                f"already (the step before's tensor, zeroed in place), so a p.grad that is not "
                f"None says nothing about whether its gradient has arrived in this backward.")
            fail(f"bucket {k} was launched {when} after {arrived} of its {len(b)} gradients had "
                 f"arrived in this step ({launched_at:.2f} ms into the step; its last gradient "
                 f"arrived at {max(s['ready'][i] for i in b):.2f} ms): its all-reduce summed a "
                 f"buffer whose gradients were still to come, so the ranks averaged something "
                 f"that is not this step's gradient.{stale}",
                 fix="count, per bucket, the gradients whose hook has run in this backward, "
                     "and put the counts back when the step ends.")
    if all(c["t_launch"] >= s["backward_end"] for c in calls):
        fail("every all-reduce was launched after the backward had finished (in "
             "finish_gradient_synchronization): nothing overlaps the backward.",
             fix="launch each bucket from the hook, as soon as it is complete and its turn has "
                 "come.")
    launchable = 0.0
    late = []
    for k, b in enumerate(buckets):
        launchable = max(launchable, max(s["ready"][i] for i in b))
        launch_k = calls[order.index(k)]["t_launch"]
        missed = [t for t in arrivals if launchable < t < launch_k]
        if missed:
            late.append((k, launchable, launch_k, len(missed)))
    if late:
        if all(c["t_launch"] >= arrivals[-1] for c in calls):
            fail(f"every bucket was launched only when the backward's last gradient had arrived "
                 f"({arrivals[-1]:.2f} ms into the step) {when}: nothing overlapped the "
                 f"backward.", fix="launch each bucket from the hook call that completes it (or "
                                   "its predecessor), not all of them at the end.")
        k, ready_at, launched, missed = late[0]
        fail(f"bucket {k} could go at {ready_at:.2f} ms {when} (its last gradient had arrived "
             f"and every earlier bucket had been launched) but was launched at {launched:.2f} "
             f"ms, after {missed} more gradient(s) had arrived.",
             fix="launch it from the hook call that makes it launchable.")
    waited_early = [c for c in calls if c["async"] and c["t_wait"] is not None
                    and not c["future"] and c["t_wait"] < s["backward_end"]]
    if waited_early:
        fail("you waited on each all-reduce inside the hook (work.wait() before the backward "
             "had finished): the backward stalls until each bucket has crossed the wire, so "
             "nothing overlaps.",
             fix="keep the handles and wait in finish_gradient_synchronization().")
    unwaited = [c for c in calls if c["async"] and c["t_wait"] is None and not c["future"]]
    if unwaited:
        fail(f"finish_gradient_synchronization() returned while {len(unwaited)} of "
             f"{len(calls)} all-reduces had not been waited on: optimizer.step() would read "
             f"gradients the all-reduce may still be writing (a race).",
             fix="call wait() on every handle.")
    if s["stale_waits"]:
        fail(f"{when}, finish_gradient_synchronization() waited again on "
             f"{len(s['stale_waits'])} handle(s) from step {s['stale_waits'][0] + 1}: the list "
             f"of handles grows by one per bucket every step.",
             fix="empty the list of handles after waiting.")
    # 3. The gradients left for optimizer.step(): their values, then where they live.
    after, own, mean = s["after"], s["own"], s["mean"]
    if any(a is None for a in after):
        missing = [names[i] for i, a in enumerate(after) if a is None]
        fail(f"p.grad is None for {missing[:3]} after finish_gradient_synchronization() {when}, "
             f"so the optimizer would skip them.",
             fix="every parameter's p.grad must be its view of the bucket.")
    for i, (a, m) in enumerate(zip(after, mean)):
        if a.shape != m.shape:
            fail(f"{names[i]}.grad has shape {tuple(a.shape)} instead of {tuple(m.shape)}.",
                 fix="make its view with .view_as(p).")
    if _all_close(after, mean):
        _diagnose_views(s, when, buckets, names, order, calls)
        return
    _diagnose_values(s, prev, step, when, world_size, buckets, names, numels)


def _diagnose_views(s, when, buckets, names, order, calls) -> None:
    """The values are right: are the gradients views of the buffers that were all-reduced?"""
    __tracebackhide__ = True
    for k, b in enumerate(buckets):
        c = calls[order.index(k)]
        for i in b:
            storage, offset, numel = s["views"][i]
            if storage != c["storage"]:
                fail(f"{names[i]}.grad holds the right average {when} but is not a view of its "
                     f"bucket's buffer: it was copied back (or copied in and never pointed at "
                     f"the bucket), so the contract's views, and the memory they save, are "
                     f"missing.",
                     fix="make p.grad the view buffer[offset:offset + p.numel()].view_as(p), as "
                         "DDP's gradient_as_bucket_view does: autograd then writes into the "
                         "bucket and the all-reduced buffer is the gradient.")


def _overlapping_views(s, buckets, names):
    spans = {}
    for b in buckets:
        for i in b:
            storage, offset, numel = s["views"][i]
            spans.setdefault(storage, []).append((offset, offset + numel, i))
    for group in spans.values():
        group.sort()
        for (a0, a1, i), (b0, b1, j) in zip(group, group[1:]):
            if b0 < a1:
                return names[i], names[j], a0, b0
    return None


def _diagnose_values(s, prev, step, when, world_size, buckets, names, numels) -> None:
    __tracebackhide__ = True
    after, own, mean, calls = s["after"], s["own"], s["mean"], s["calls"]
    if any(torch.isnan(a).any() for a in after):
        bad = next(names[i] for i, a in enumerate(after) if torch.isnan(a).any())
        fail(f"{bad}.grad was read from its bucket before wait() {when}: the check leaves a "
             f"buffer whose all-reduce is in flight without a defined value (NaN), as a GPU "
             f"collective still writing it would — copying back before wait() copies garbage.",
             fix="with p.grad a view of the bucket, wait() is all it takes.")
    temporary = [c for c in calls if c["async"] and not c["kept"]]
    if temporary:
        fail(f"{len(temporary)} of the {len(calls)} all-reduces {when} were of a temporary "
             f"tensor that neither your wrapper nor any p.grad keeps (torch.cat, .clone(), "
             f"buffer / world_size, ... make a new tensor): its result is thrown away.",
             fix="divide the bucket's own buffer in place (div_) and all-reduce that buffer, "
                 "the one the gradients are views of.")
    clash = _overlapping_views(s, buckets, names)
    if clash:
        a, b, oa, ob = clash
        fail(f"the views of {a} (offset {oa}) and {b} (offset {ob}) overlap in their bucket's "
             f"buffer {when}: both gradients are written into the same numbers.",
             fix="start each parameter's view where the previous one ended "
                 "(offset += p.numel()).")
    for i, b in enumerate(buckets):
        for j in b:
            storage = s["views"][j][0]
            home = [c["storage"] for c in calls if c["numel"] == sum(numels[x] for x in b)]
            others = [c["storage"] for c in calls if c["storage"] != (home[0] if home else None)]
            if home and storage != home[0] and storage in others:
                fail(f"{names[j]}.grad is a view of another bucket's buffer {when}.",
                     fix="make each parameter's view from the buffer of the bucket it is in.")
    total = [m * world_size for m in mean]
    if _all_close(after, total) and (step == 0 or prev is None or world_size != 2
                                     or not _all_close(prev["after"], prev["mean"])):
        fail(f"the gradients hold the sum over the ranks, {world_size} times the mean, {when}.",
             fix="divide each bucket by the world size (before the all-reduce or after the "
                 "wait).")
    if _all_close(after, [2 * m for m in mean]):
        fail(f"the gradients are twice the mean {when}, after a right step 1: p.grad was "
             f"already the bucket's view, and adding it onto itself (view.add_(p.grad)) "
             f"doubled it.", fix="copy_ a fresh gradient into the view, and do nothing when "
                                 "p.grad is the view already.")
    if prev is not None and _all_close(after, [m + q for m, q in zip(mean, prev["mean"])]):
        fail(f"the gradients {when} are this step's mean plus the last step's: a fresh p.grad "
             f"(after zero_grad(set_to_none=True)) was added (add_) to the bucket, which still "
             f"held the last average.", fix="copy_ a fresh gradient in.")
    for k in sorted({2, 3, 4} - {world_size}):
        if _all_close(after, [t / k for t in total]):
            fail(f"on {world_size} ranks the gradients are the sum divided by {k}, a fixed "
                 f"number that is not this group's size.",
                 fix="divide by dist.get_world_size().")
    for extra, what in ((own, "its own gradient"), ([o / world_size for o in own],
                                                    "its own gradient divided by the world size")):
        if _all_close(after, [m + e for m, e in zip(mean, extra)]):
            fail(f"p.grad holds the mean plus {what} {when}: the average was added (add_) to "
                 f"the gradient instead of replacing it.",
                 fix="make p.grad a view of the bucket: then there is nothing to copy back.")
    if _all_close(after, own) or _all_close(after, [o / world_size for o in own]):
        fail(f"p.grad still holds this rank's own gradient after finish_gradient_"
             f"synchronization() {when}, while the bucket holds the average: p.grad is not "
             f"the bucket's view (autograd's fresh gradient was copied in but p.grad never "
             f"pointed at the view).", fix="set p.grad = view in the hook.")
    wrong = [i for i, (a, m) in enumerate(zip(after, mean)) if not _close(a, m)]
    for i in wrong:
        others = [j for j in range(len(names)) if j != i and numels[j] == numels[i]
                  and _close(after[i].reshape(-1), mean[j].reshape(-1))]
        if others:
            fail(f"{names[i]}.grad holds the averaged gradient of {names[others[0]]} {when}: it "
                 f"was given the wrong slice of the bucket.",
                 fix="use the offset recorded for each parameter.")
    for b in buckets:
        got = torch.cat([after[i].reshape(-1) for i in b])
        right = torch.cat([mean[i].reshape(-1) for i in b])
        if any(i in wrong for i in b) and torch.allclose(got.sort().values, right.sort().values,
                                                         rtol=1e-4, atol=1e-7):
            fail(f"bucket {buckets.index(b)} holds the right averages {when}, but in the wrong "
                 f"parameters: {names[next(i for i in b if i in wrong)]}.grad was given another "
                 f"offset of the buffer than the one its gradient went in at.",
                 fix="give each parameter one offset (the numel of those before it in the "
                     "bucket) and use it both ways, or better, make p.grad the view at that "
                     "offset.")
    order = _bucket_of_call(calls, buckets, numels)
    k = next(j for j, b in enumerate(buckets) if wrong[0] in b)
    c = calls[order.index(k)] if k in order else None
    seen = "" if c is None else (
        f" What the check saw of its bucket {k}: its {len(buckets[k])} gradients had all "
        f"arrived by {max(s['ready'][i] for i in buckets[k]):.2f} ms into the step, its "
        f"all-reduce was launched at {c['t_launch']:.2f} ms" + (
            f" and waited on at {c['t_wait']:.2f} ms" if c["t_wait"] is not None else "") +
        ", so the bucket was complete when it went and the timing is not the cause: what "
        "was in the buffer that went, what was done to it, or where this gradient's view lies "
        "in it is.")
    fail(f"{names[wrong[0]]}.grad is not the mean over the ranks {when} (nor the sum, nor this "
         f"rank's own gradient, nor any single mistake the check knows).{seen}",
         fix="each gradient's view must be buffer[offset:offset + p.numel()] at offsets that "
             "add up p.numel() in bucket order, and the whole buffer must be all-reduced once.")


# --------------------------------------------------------------------------------------------
# Stretch: a top-k communication hook with error feedback (its probe, worker, replay and
# diagnosis: _lab07_topk)
# --------------------------------------------------------------------------------------------


@recorded
def check_topk_hook(hook, state_cls, world_sizes=HOOK_WORLD_SIZES, fraction=HOOK_FRACTION,
                    timeout: float | None = None) -> None:
    """Run the learner's comm hook in real DDP (probe model, 12 steps, two buckets after DDP's
    rebuild) on 2 and 3 ranks; compare every hook call with top-k + error feedback replayed on
    the same buckets, weigh what each rank sends, and name the mistake when they differ."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(hook, "topk_hook")
    for world_size in world_sizes:
        results = _launch_hook(hook, state_cls, world_size, fraction, timeout)
        _diagnose_hook(results, world_size, state_cls(fraction).k)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{getattr(hook, '__name__', 'hook')}: top-k with error feedback equals the replay "
           f"on {shown} ranks for {_HOOK_STEPS} steps, sending ≤ {_SENT_PER_ENTRY} bytes per "
           f"selected entry (a float32 value and an int64 index; {fraction:.0%} of the "
           f"entries), still in flight when the hook returned")


# --------------------------------------------------------------------------------------------
# Predict, then measure: when does the bucket that fills first go on the wire?
# --------------------------------------------------------------------------------------------
#
# Part 2's check model at its first cap (0.002 MiB, 4 buckets): the backward reaches `out`
# (bucket 1) before `hidden` (bucket 0), so bucket 1 is complete after the 2nd gradient but may
# go only after bucket 0, complete at the 4th. The question is how many gradients have arrived
# when bucket 1's all-reduce is launched: "as soon as it is full" (the lesson's class) says 2,
# the in-order launch says 4. The measurement runs the learner's own class with a hook
# registered before theirs that counts arrivals, and notes the count at every all-reduce.

PREDICTION_CAP_MB = CONFIGS[0][1]
PREDICTION_BUCKET = 1
PREDICTION_QUESTION = (f"gradients arrived when bucket {PREDICTION_BUCKET}'s all-reduce is "
                       f"launched (part 2's model, {PREDICTION_CAP_MB} MiB)")


def _prediction_buckets(cap_mb: float = PREDICTION_CAP_MB) -> tuple[list, list]:
    """The check model's trainable parameter names and DDP's buckets of them (indices)."""
    model = _check_net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for _, p in named]
    return [n for n, _ in named], _greedy(sizes, cap_mb * MiB, list(range(len(named) - 1, -1, -1)))


def show_prediction_model(cap_mb: float = PREDICTION_CAP_MB) -> None:
    """Print part 2's check model: its parameters in registration order, its forward, and the
    buckets DDP's rule makes of it at ``cap_mb``."""
    model = _check_net()
    print(f"bucket_cap_mb = {cap_mb} MiB = {cap_mb * MiB:,.0f} bytes")
    print(f"{'parameter':<16} {'shape':<10} {'bytes':>7}  trainable")
    for name, p in model.named_parameters():
        shape = "×".join(map(str, p.shape))
        print(f"{name:<16} {shape:<10} {p.numel() * p.element_size():>7,}  "
              f"{'yes' if p.requires_grad else 'no (frozen)'}")
    print("forward: out(relu(hidden(conv(x).flatten(1))) * scale)")
    names, buckets = _prediction_buckets(cap_mb)
    for i, b in enumerate(buckets):
        print(f"bucket {i}: {', '.join(names[j] for j in b)}")


def _launch_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    __tracebackhide__ = True
    import torch.distributed as dist  # noqa: F401  (the learner's class uses it)

    from ..collectives import record_collectives

    module = _check_net()
    names = {id(p): n for n, p in module.named_parameters()}
    arrived: list[str] = []

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        arrived.append(names[id(p)])

    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(spy_ready)
    launches: list[tuple[int, int]] = []

    def before(call):
        if call.function == "all_reduce":
            launches.append((len(arrived), call.args["tensor"].numel()))

    model = cls(module, bucket_cap_mb=cap_mb)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    module.zero_grad(set_to_none=True)
    with record_collectives(before=before):
        F.cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
    return {"arrived": arrived, "launches": launches}


def measure_launches(cls, cap_mb: float = PREDICTION_CAP_MB, timeout: float | None = None) -> dict:
    """Run ``cls`` (your BucketedDDP) on 2 ranks for one step of part 2's check model and
    return rank 0's record: the parameters in the order their gradients arrived, and for every
    all-reduce (in launch order) how many gradients had arrived and how many elements it
    carried."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    per_rank = run_ranks(_launch_worker, 2, cls, cap_mb, timeout=timeout,
                         hang="every rank must launch the same all-reduces in the same order, "
                              "and every launched all-reduce must be waited on.")
    return per_rank[0]


def _nth(k: int) -> str:
    return f"{k}{'st' if k == 1 else 'nd' if k == 2 else 'rd' if k == 3 else 'th'}"


def check_prediction(guess, measured: dict, cap_mb: float = PREDICTION_CAP_MB) -> None:
    """Compare the learner's prediction with the arrivals counted when bucket 1 was launched,
    and say when each bucket was complete and when it went."""
    __tracebackhide__ = True
    from . import reveal

    names, buckets = _prediction_buckets(cap_mb)
    model = _check_net()
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    sizes = [sum(numel[names[j]] for j in b) for b in buckets]
    order = measured["arrived"]
    complete = [max(order.index(names[j]) + 1 for j in b) for b in buckets]
    launched = [None] * len(buckets)
    for count, n in measured["launches"]:
        i = sizes.index(n) if n in sizes else None
        if i is not None and launched[i] is None:
            launched[i] = count
    k = PREDICTION_BUCKET
    value = launched[k]
    if value is None:
        fail(f"your wrapper launched no all-reduce of bucket {k}'s {sizes[k]} elements in this "
             f"step (its all-reduces carried {[n for _, n in measured['launches']]} elements): "
             f"there is nothing to compare your prediction with.",
             fix="make part 2's check pass first, then run the measurement again.")
    story = "; ".join(f"bucket {i}: complete after the {_nth(c)}, launched after the "
                      f"{_nth(l) if l is not None else '(never)'}"
                      for i, (c, l) in enumerate(zip(complete, launched)))
    waited = value - complete[k]
    why = (f"The backward reaches `out` first, so bucket {k} was "
           f"complete after the {_nth(complete[k])} gradient, while bucket 0 (`hidden`) was "
           f"complete only after the {_nth(complete[0])}. ")
    if value == complete[0] and waited > 0:
        why += (f"So bucket {k} waited {waited} more gradient(s): every rank must issue bucket "
                f"0's all-reduce first, so bucket {k} goes in the same hook call that "
                f"completes bucket 0, right after it. ")
    elif value < complete[0]:
        why += (f"Your wrapper launched bucket {k} the moment it was full, before bucket 0: "
                f"that is the lesson's class, not part 2's in-order launch. ")
    else:
        why += (f"In order, bucket {k} could have gone right after bucket 0, after the "
                f"{_nth(complete[0])} gradient; your wrapper sent it only after the "
                f"{_nth(value)}. ")
    reveal(guess, value, close=guess.value == value,
           explanation=why + f"Gradients counted on rank 0: {story}.")
