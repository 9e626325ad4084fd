"""Lab 07 part 2's extra models: one of two dtypes (part 1's buckets hold one dtype each, so
the wrapper's flat buffers must too), and those whose second step leaves trainable parameters
out, in one bucket or in two (those buckets are never complete: the wrapper must raise, name
every one of them, and leave nothing in flight). Run by
:func:`dpcourse.checks.lab07.check_bucketed_ddp` after the main model passes."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from . import fail, run_ranks
from ._lab07_bench import CONFIGS, _CheckNet, _close, _deferring_spy, _held_storages, _storage

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
                 fix=("reconsider what one flat buffer can hold, given part 1's rule that a "
                      "bucket holds one dtype."))
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
                     fix=("reconsider how many buffers, of which dtypes, part 1's buckets need, "
                          "and which of them reach the wire."))
            if not r["view"]:
                fail(f"on {what}, {r['name']}.grad ({r['dtype']}) holds the right mean on rank "
                     f"{rank} but is not a view of any buffer your wrapper keeps: it was copied "
                     f"back from a buffer of another dtype.",
                     fix=("reconsider what a view can be a view of: a tensor of its own dtype "
                          "only."))


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


class _BothNet(nn.Module):
    """`shift` registered first (the last bucket) and `head` registered last (bucket 0), both
    left out while ``use_both`` is False: two buckets never complete, and the error must name
    the parameters of both, not only those of the first bucket left waiting."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(3, 1, 1))
        self.net = _CheckNet()
        self.head = nn.Linear(10, 10)
        self.use_both = True

    def forward(self, x):
        return self.head(self.net(x + self.shift)) if self.use_both else self.net(x)


# The models and how step 2 (the one that leaves a parameter out) starts. `head` (bucket 0):
# gradients zeroed in place first — then `head.grad` still holds step 1's tensor, so "no
# gradient" cannot be read from `p.grad is None` — and then, on a fresh model, set to None.
# `shift` (the last bucket): the buckets before it were launched, and the error must not leave
# them in flight. `both` (bucket 0 and the last bucket): every incomplete bucket's parameters
# must be named, not the first one's only.
_UNUSED_CASES = (("head", False), ("head", True), ("shift", True), ("both", True))
_UNUSED_NAMES = {"head": ("head.weight", "head.bias"), "shift": ("shift",),
                 "both": ("head.weight", "head.bias", "shift")}
_UNUSED_MODELS = {"head": _UnusedNet, "shift": _ShiftNet, "both": _BothNet}
_UNUSED_WHERE = {"head": "registered last, so in bucket 0",
                 "shift": "registered first, so in the last bucket",
                 "both": "head registered last, so in bucket 0, and shift registered first, "
                         "so in the last bucket"}


def _listed(names) -> str:
    return " and ".join(names) if len(names) < 3 else \
        f"{', '.join(names[:-1])} and {names[-1]}"


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
            module = _UNUSED_MODELS[which]().to(dev)
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
            index = {id(p): i for i, b in enumerate(getattr(model, "buckets", None) or ())
                     for p in b}
            bucket_of = {n: index.get(id(p)) for n, p in module.named_parameters()
                         if n in _UNUSED_NAMES[which]}
            out[which, set_to_none] = {"said": said, "used": used, "in_flight": in_flight,
                                       "bucket_of": bucket_of}
    return out


def _check_unused(cls, timeout: float, cap_mb: float = CONFIGS[0][1]) -> None:
    """Models with a trainable parameter that the second step's forward leaves out (`head`,
    registered last, so in bucket 0; `shift`, registered first, so in the last bucket; both at
    once): finish_gradient_synchronization() must return after step 1 and raise after step 2,
    naming every parameter left out, in every bucket, and no other — whether step 2 began with
    the gradients zeroed in place (``head.grad`` then still holds a tensor) or set to None — and
    leave none of the all-reduces it launched in flight."""
    __tracebackhide__ = True
    from .. import devices

    results = run_ranks(_unused_worker, 2, cls, cap_mb, backend=devices.backend_for(2),
                        timeout=timeout,
                        hang="with a parameter that got no gradient, every rank must still "
                             "launch the same all-reduces (or none) and wait only on those.")
    for which, set_to_none in _UNUSED_CASES:
        names = _UNUSED_NAMES[which]
        unused = _listed(names)
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
                     f"model with {unused}, which the next step's forward leaves out.",
                     fix=("reconsider what tells your wrapper that a gradient is missing: its "
                          "own record of this backward, not what happens to sit in p.grad."))
            said = r["said"][2]
            if said is None:
                fail(f"on a model whose {unused} got a gradient in step 1 but none in step 2 "
                     f"(step 2 began with {how}), finish_gradient_synchronization() returned on "
                     f"rank {rank} although their bucket never became complete: that bucket "
                     f"(and every one after it) was never all-reduced, so the gradients left "
                     f"there are stale or this rank's own.{stale}",
                     fix=("reconsider what your wrapper knows at the end of the step about the "
                          "buckets that never became complete (lesson 07 §6 does not return "
                          "there)."))
            missing = [n for n in names if n not in said]
            named = [n for n in names if n in said]
            where = r.get("bucket_of", {})
            if missing and named and None not in where.values() and \
                    not {where[n] for n in missing} & {where[n] for n in named}:
                late = sorted({where[n] for n in missing})
                fail(f"on a model whose {unused} ({_UNUSED_WHERE[which]}) got a gradient in "
                     f"step 1 but none in step 2, finish_gradient_synchronization() raised on "
                     f"rank {rank} ({said[:200]}): your error names {_listed(named)} but "
                     f"not {_listed(missing)}, which "
                     f"{'is' if len(missing) == 1 else 'are'} in "
                     f"bucket{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} that "
                     f"never went out either: a bucket left waiting is not the only one. The "
                     f"contract asks for every parameter that got no gradient, in whichever "
                     f"bucket it waits.",
                     fix=("reconsider where your wrapper looks for the parameters that never "
                          "arrived: in the first bucket still waiting, or in every bucket that "
                          "never became complete?"))
            if missing:
                fail(f"on a model whose {unused} got a gradient in step 1 but none in step 2 "
                     f"(step 2 began with {how}), finish_gradient_synchronization() raised on "
                     f"rank {rank} ({said[:200]}), but its message does not name "
                     f"{_listed(missing)}, so whoever trains the model cannot find it."
                     f"{stale}",
                     fix=("reconsider what your wrapper remembers of THIS backward's arrivals: "
                          "is it enough to tell which parameters never came, whatever p.grad "
                          "holds?"))
            wrongly = [n for n in r["used"]
                       if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", said)]
            if wrongly:
                fail(f"on a model whose {unused} got no gradient in step 2, "
                     f"finish_gradient_synchronization() raised on rank {rank}, but its message "
                     f"also names {', '.join(wrongly[:3])}, which did get a gradient in this "
                     f"backward (a name kept from an earlier step, or every parameter of the "
                     f"incomplete bucket, misleads).",
                     fix=("reconsider whether what you name comes from this backward alone, and "
                          "per parameter rather than per bucket."))
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
                     fix=("reconsider what the error leaves behind: which collectives had every "
                          "rank already launched, and who will ever wait on them?"))
