"""Checks for lab08: ``shard_bounds(numel, rank, world_size)``, the learner's ZeRO stage 1
wrapper (a class ``ZeroOne(params, optimizer_cls, **kwargs)`` with ``step()``, ``zero_grad()``,
its flat shard in ``self.shard`` and its inner optimizer in ``self.optimizer``) and, for the
stretch, a stage 2 wrapper with the same interface that reduce-scatters during the backward.

``check_shard_bounds`` runs in this process on seven (numel, world size) pairs, from an even
split to more ranks than numbers. Every rank's shard must be ``ceil(numel / world_size)``
long (``all_gather_single`` needs equal pieces), in rank order, touching, and together
cover the numbers. It names: the size rounded down (the last numbers belong to nobody), an
exclusive end taken as inclusive (gaps), overlapping shards, a last shard clipped at
``numel``, (start, length) returned instead of (start, end), shards out of rank order, a
first shard that does not start at 0, a return value that is not two integers.

``check_zero_one`` runs the wrapper for 3 steps on 2 ranks with Adam and on 3 ranks with SGD +
momentum (53 parameters: neither divides them), next to ``DistributedDataParallel`` with the
full optimizer on the same shards of the same batches, and next to DDP runs that make one
mistake on purpose (gradients summed, divided twice, earlier steps' gradients kept), so that
weights equal to one of those name it. Before the first step it compares every rank's
``self.shard`` with ``ceil(53 / world_size)``; it weighs the inner optimizer's state on each
rank and compares the weights after every step. It names: a shard one number too long or too
short, a last shard cut at numel, the whole model given to the inner optimizer (no memory
saved), no all-gather (each rank updates only its own shard and the ranks drift apart),
gradients summed instead of averaged (caught with SGD: Adam hardly notices a scale), divided
twice, gradients of earlier steps added to this one's (``zero_grad`` that does not clear), the
gathered weights never copied back, every parameter copied from offset 0, a shard boundary off
by one, gradients never averaged, a shard that is not a leaf, a gradient slice of the wrong
size, an unpadded vector handed to a collective, a deadlock (with the ranks that hung).

``check_zero_two`` (the stretch) runs the stage 2 wrapper the same way, against the same
references. A hook the check registers on every parameter *before* the learner's own sees
each gradient as autograd produces it and counts the gradient numbers still alive at that
moment (through weak references: a gradient is alive while anything holds it); a spy on the
collectives notes which ran during the backward. Stage 2's point is the peak: the full
gradients must never all exist at once. It names: all gradients kept until ``step()``,
reduce-scattered during the backward but never dropped (``p.grad = None``), every gradient
kept until the last one arrived.
"""

from __future__ import annotations

import copy
import math
import re
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import fail, has_todo, passed

__all__ = ["check_shard_bounds", "check_zero_one", "check_zero_two", "CONFIGS",
           "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 30.0

# --------------------------------------------------------------------------------------------
# shard_bounds
# --------------------------------------------------------------------------------------------

_BOUNDS_CASES = ((53, 2), (53, 3), (12, 3), (10, 4), (3, 4), (1, 1), (1_000_003, 8))


def check_shard_bounds(shard_bounds) -> None:
    """Every rank's [start, end) on seven (numel, world size) pairs."""
    __tracebackhide__ = True
    if not callable(shard_bounds):
        fail(f"the check needs your function shard_bounds, got {type(shard_bounds).__name__}.")
    if has_todo(shard_bounds):
        raise NotImplementedError("shard_bounds still raises NotImplementedError: replace the "
                                  "TODO with your answer.")
    for numel, world_size in _BOUNDS_CASES:
        size = math.ceil(numel / world_size)
        got = []
        for rank in range(world_size):
            out = shard_bounds(numel, rank, world_size)
            try:
                start, end = (int(v) for v in out)
            except (TypeError, ValueError):
                fail(f"shard_bounds({numel}, {rank}, {world_size}) returned {out!r}: return two "
                     f"integers, (start, end).")
            got.append((start, end))
        _bounds_problem(got, numel, world_size, size)
    passed("shard_bounds: equal shards of ceil(numel / world_size), in rank order, covering "
           f"every number, on {len(_BOUNDS_CASES)} cases")


def _bounds_problem(got, numel, world_size, size) -> None:
    __tracebackhide__ = True
    where = f"for numel={numel} on {world_size} ranks you gave {got}"
    expected = [(r * size, (r + 1) * size) for r in range(world_size)]
    if got == expected:
        return
    if world_size > 1 and all(s == r * size and e == size for r, (s, e) in enumerate(got)):
        fail(f"{where}: that is (start, length); return (start, end), end exclusive.")
    if got == expected[::-1] or sorted(got) == expected:
        fail(f"{where}: rank r must own the r-th shard — all_gather_single puts rank r's "
             f"piece at position r.")
    floor = numel // world_size
    if numel % world_size and got == [(r * floor, (r + 1) * floor) for r in range(world_size)]:
        fail(f"{where}: with the size rounded down, the last {numel % world_size} number(s) "
             f"belong to no rank — round up: ceil(numel / world_size) = {size}.")
    if got[-1][1] == numel and got[:-1] == expected[:-1]:
        fail(f"{where}: the last shard is clipped at numel; keep it {size} long and let it run "
             f"into the padding, so that every rank's piece of the all-gather has one size.")
    for r in range(world_size - 1):
        if got[r][1] < got[r + 1][0]:
            fail(f"{where}: numbers {got[r][1]}..{got[r + 1][0] - 1} between rank {r} and rank "
                 f"{r + 1} belong to no rank — end is exclusive: rank r ends where rank r + 1 "
                 f"starts.")
        if got[r][1] > got[r + 1][0]:
            fail(f"{where}: rank {r} and rank {r + 1} both own numbers {got[r + 1][0]}.."
                 f"{got[r][1] - 1} — shards must not overlap.")
    if got[0][0] != 0:
        fail(f"{where}: numbers 0..{got[0][0] - 1} belong to no rank — rank 0 starts at 0.")
    sizes = sorted({e - s for s, e in got})
    if sizes != [size]:
        fail(f"{where}: shard sizes {sizes}; every rank's shard must be ceil(numel / "
             f"world_size) = {size} long.")
    fail(f"{where}; expected {expected}.")


# --------------------------------------------------------------------------------------------
# ZeroOne and ZeroTwo, on 2 and 3 ranks
# --------------------------------------------------------------------------------------------

CONFIGS = ((2, "adam"), (3, "sgd"))
_STEPS = 3
_GLOBAL_BATCH = 12
_FEATURES, _HIDDEN, _CLASSES = 6, 5, 3        # 6*5 + 5 + 5*3 + 3 = 53 parameters


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(_FEATURES, _HIDDEN), nn.Tanh(), nn.Linear(_HIDDEN, _CLASSES))


def _numels() -> list[int]:
    return [p.numel() for p in _mlp().parameters()]


def _optimizer(name: str):
    if name == "adam":
        return torch.optim.Adam, {"lr": 0.05}
    return torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}


def _batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    X = torch.randn(_GLOBAL_BATCH, _FEATURES, generator=g)
    y = torch.randint(0, _CLASSES, (_GLOBAL_BATCH,), generator=g)
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


_COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                "all_gather_single", "broadcast", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single")

# The references: DDP + the full optimizer, and DDP runs that make one mistake on purpose, so
# that a learner's weights equal to one of them name that mistake.
_REFERENCES = ("ddp", "summed", "twice", "accumulated")


def _reference_step(kind: str, m, wrapped, ref_opt, kept: dict, X, y, world_size: int) -> None:
    __tracebackhide__ = True
    ref_opt.zero_grad()
    F.cross_entropy(wrapped(X), y).backward()
    for name, p in m.named_parameters():
        if kind == "summed":                      # all_reduce's sum, never divided
            p.grad.mul_(world_size)
        elif kind == "twice":                     # divided before and after the reduction
            p.grad.div_(world_size)
        elif kind == "accumulated":               # the earlier steps' gradients never cleared
            if name in kept:
                p.grad.add_(kept[name])
            kept[name] = p.grad.clone()
    ref_opt.step()


def _zero_worker(rank: int, world_size: int, cls, opt_name: str, stage: int = 1) -> dict:
    """One rank: the learner's wrapper for ``_STEPS`` steps, and after each step the same step
    of every reference. Returns the weights after every step, the collectives made in the
    backward and in ``step()``, the gradient numbers alive at once, the optimizer's state."""
    __tracebackhide__ = True
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    initial = _flat(model)
    references = {}
    for name in _REFERENCES:
        m = copy.deepcopy(model)
        opt_cls, kw = _optimizer(opt_name)
        references[name] = (m, DDP(m), opt_cls(m.parameters(), **kw), {})
    opt_cls, kw = _optimizer(opt_name)
    names = [n for n, p in model.named_parameters() for _ in range(p.numel())]

    # The check's hook, registered before the learner's: it runs first as each gradient is
    # accumulated, and counts the gradient numbers alive at that moment. A weak reference does
    # not keep a tensor alive: it is dead once nothing else holds the gradient.
    tracked: list = []
    memory = {"peak": 0}

    def alive() -> int:
        return sum(n for ref, n in tracked if ref() is not None)

    def seen(p):
        tracked.append((weakref.ref(p.grad), p.numel()))
        memory["peak"] = max(memory["peak"], alive())

    for p in params:
        p.register_post_accumulate_grad_hook(seen)

    phase = {"now": "init"}
    calls: list[tuple[str, str]] = []
    real = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def spy(name):
        def spied(*args, **kwargs):
            calls.append((phase["now"], name))
            return real[name](*args, **kwargs)
        return spied

    for name in real:
        setattr(dist, name, spy(name))
    try:
        opt = cls(model.parameters(), opt_cls, **kw)
        phase["now"] = "check"
        sizes = _shard_sizes(opt, real["all_gather"], world_size)
        if stage == 1 and any(n not in (-1, math.ceil(total / world_size)) for n in sizes):
            return {"shard_sizes": sizes, "total": total}
        steps = []
        for step in range(_STEPS):
            X, y = _batch(step, rank, world_size)
            opt.zero_grad()
            tracked.clear()
            memory["peak"] = 0
            calls.clear()
            phase["now"] = "backward"
            F.cross_entropy(model(X), y).backward()
            after_backward = alive()
            phase["now"] = "step"
            opt.step()
            phase["now"] = "references"
            rec = {"learner": _flat(model),
                   "backward": [n for ph, n in calls if ph == "backward"],
                   "step": [n for ph, n in calls if ph == "step"],
                   "peak": max(memory["peak"], after_backward),
                   "after_backward": after_backward}
            for name, (m, wrapped, ref_opt, kept) in references.items():
                _reference_step(name, m, wrapped, ref_opt, kept, X, y, world_size)
                rec[name] = _flat(m)
            steps.append(rec)
        state_after = _state_of(getattr(opt, "optimizer", None))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"initial": initial, "steps": steps, "state_after": state_after, "names": names,
            "total": total, "shard_sizes": None}


def _shard_sizes(opt, all_gather, world_size: int) -> list[int]:
    """Every rank's ``self.shard.numel()`` (-1 where it is not a tensor), on every rank."""
    __tracebackhide__ = True
    shard = getattr(opt, "shard", None)
    mine = torch.tensor([shard.numel() if isinstance(shard, torch.Tensor) else -1])
    out = [torch.zeros_like(mine) for _ in range(world_size)]
    all_gather(out, mine)
    return [int(t) for t in out]


_GLOO_PREFIX = re.compile(r"\[rank\d+\]:\[\w+ [\d:.]+ [\w.]+:\d+\]\s*")


def _launch(cls, world_size: int, opt_name: str, timeout: float, stage: int = 1) -> list:
    __tracebackhide__ = True
    from .. import launch

    try:
        return launch.spawn(_zero_worker, world_size, cls, opt_name, stage, backend="gloo",
                            timeout=timeout, show_output=False)
    except launch.LaunchTimeoutError as exc:
        who = ", ".join(map(str, exc.pending)) or "some rank"
        fail(f"rank(s) {who} never finished within {timeout:g} s — a deadlock: every rank must "
             f"make the same collectives, in the same order, with tensors of the same size.")
    except launch.RankFailedError as exc:
        if exc.summary.startswith("NotImplementedError"):
            raise NotImplementedError(f"{exc.summary} (on rank {exc.rank})") from None
        _raised(exc.rank, exc.summary)


def _raised(rank: int, summary: str) -> None:
    """The learner's code raised on ``rank``: say so, with a hint where the error says which
    mistake it was."""
    __tracebackhide__ = True
    summary = _GLOO_PREFIX.sub("", summary.strip().splitlines()[0]).rstrip(".")
    hint = ""
    if "non-leaf" in summary:
        hint = (" — build self.shard from detached values (p.detach()), then .clone() it: "
                "a new leaf tensor, not a result of the model's autograd graph")
    elif "assign a gradient" in summary:
        hint = (" — self.shard.grad must be this rank's slice [start:end) of the averaged "
                "gradient, exactly the size of self.shard")
    elif "size" in summary.lower() or "shape" in summary.lower():
        hint = (" — every rank's shard must be the same size: pad the flat vector to a "
                "multiple of the world size before a collective, and make the output of "
                "all_gather_single world_size times a shard")
    fail(f"your code raised on rank {rank}: {summary}{hint}.")


def _run_check(cls, configs, timeout: float, stage: int) -> list[str]:
    __tracebackhide__ = True
    name = "ZeroOne" if stage == 1 else "ZeroTwo"
    if not isinstance(cls, type):
        fail(f"the check needs your class itself ({name}, not {name}(...)), got "
             f"{type(cls).__name__}.")
    if has_todo(cls):
        raise NotImplementedError(f"{cls.__name__} still raises NotImplementedError in a method: "
                                  f"replace the TODOs with your answer.")
    shown = []
    for world_size, opt_name in configs:
        results = _launch(cls, world_size, opt_name, timeout, stage)
        shown.append(_diagnose(results, world_size, opt_name, stage))
    return shown


def check_zero_one(cls, configs=CONFIGS, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run the learner's ZeroOne for 3 steps on 2 ranks (Adam) and 3 ranks (SGD + momentum)
    next to DDP with the full optimizer; weigh the optimizer state, compare the weights."""
    __tracebackhide__ = True
    shown = _run_check(cls, configs, timeout, stage=1)
    passed(f"{cls.__name__}: weights == DDP + the full optimizer after {_STEPS} steps; "
           f"optimizer state per rank {'; '.join(shown)}")


def check_zero_two(cls, configs=CONFIGS, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run the learner's stage 2 wrapper like ``check_zero_one``, and count the gradient
    numbers alive at once during the backward: fewer than the model's."""
    __tracebackhide__ = True
    shown = _run_check(cls, configs, timeout, stage=2)
    passed(f"{cls.__name__}: weights == DDP + the full optimizer after {_STEPS} steps; "
           f"gradient numbers alive at once during the backward, at most: {'; '.join(shown)}")


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _edges(world_size: int, stage: int) -> set[int]:
    """Indices next to a shard boundary: of the whole flat vector (stage 1), or of each
    parameter (a stage 2 answer may shard each parameter on its own)."""
    numels = _numels()
    total = sum(numels)
    spans = [(0, total)]
    if stage == 2:
        starts = [sum(numels[:i]) for i in range(len(numels))]
        spans += list(zip(starts, numels))
    edges = set()
    for offset, n in spans:
        size = math.ceil(n / world_size)
        edges |= {offset + r * size + d for r in range(1, world_size) for d in (-1, 0)}
        edges |= {offset, offset + n - 1}
    return {e for e in edges if 0 <= e < total}


def _diagnose(results: list, world_size: int, opt_name: str, stage: int = 1) -> str:
    __tracebackhide__ = True
    total = results[0]["total"]
    size = math.ceil(total / world_size)
    if results[0]["shard_sizes"]:
        _diagnose_shard_sizes(results[0]["shard_sizes"], total, world_size)
    per_number = 2 if opt_name == "adam" else 1       # exp_avg + exp_avg_sq, or momentum
    full_bytes = total * per_number * 4
    # stage 2 may shard each parameter on its own: each pads up to a multiple of world_size
    most = size if stage == 1 else sum(math.ceil(n / world_size) for n in _numels())
    for rank, r in enumerate(results):
        st = r["state_after"]
        if st["missing"]:
            fail("the wrapper has no self.optimizer (a torch optimizer): keep the inner "
                 "optimizer there, built over [self.shard].")
        if st["numel"] >= total:
            fail(f"rank {rank}'s inner optimizer steps all {st['numel']} numbers of the model, "
                 f"so every rank keeps the whole optimizer state ({st['bytes']} bytes) — "
                 f"no memory saved: give it only this rank's shard, [self.shard].")
        if st["bytes"] > most * per_number * 4:
            fail(f"rank {rank}'s optimizer state is {st['bytes']} bytes, more than one shard's "
                 f"({most} numbers × {per_number} × 4 bytes).")
    for step in range(_STEPS):
        learner = [r["steps"][step]["learner"] for r in results]
        if not all(_close(w, learner[0]) for w in learner[1:]):
            _diagnose_drift(results, step)
        _diagnose_weights(results, step, world_size, opt_name, stage)
    if stage == 2:
        return _diagnose_memory(results, world_size, opt_name)
    st = results[0]["state_after"]
    return f"{st['bytes']} B of {full_bytes} B on {world_size} ranks ({opt_name})"


def _diagnose_shard_sizes(sizes: list[int], total: int, world_size: int) -> None:
    __tracebackhide__ = True
    size = math.ceil(total / world_size)
    got = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
    # flat[start:end + 1] on the padded vector: one more, but the last rank runs out of it
    longer = all(n == size + 1 for n in sizes[:-1]) and sizes[-1] in (size, size + 1)
    if longer or all(n == size - 1 for n in sizes):
        fail(f"self.shard holds {got} numbers, not ceil({total} / {world_size}) = {size}: one "
             f"{'more' if longer else 'fewer'} — an off-by-one; the end of a slice is "
             f"exclusive, take flat[start:end].")
    last = sizes[-1]
    if sizes[:-1] == [size] * (world_size - 1) and last == total - size * (world_size - 1):
        fail(f"self.shard holds {got} numbers: the last shard was cut at numel = {total} — pad "
             f"the flat vector to {world_size} × {size} first, so that every rank's shard has "
             f"the same size.")
    fail(f"self.shard holds {got} numbers: every rank's shard must be ceil({total} / "
         f"{world_size}) = {size} numbers of the padded flat vector.")


def _diagnose_weights(results: list, step: int, world_size: int, opt_name: str,
                      stage: int) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    s = r0["steps"][step]
    w, ref = s["learner"], s["ddp"]
    if _close(w, ref):
        return
    after = f"after step {step + 1}"
    if _close(w, s["summed"]):
        fail(f"{after} the weights equal those of DDP with gradients {world_size}× too large: "
             f"you summed the gradients over the ranks — divide by the world size "
             f"(reduce-scatter and all-reduce sum).")
    if _close(w, s["twice"]):
        fail(f"{after} the weights equal those of DDP with gradients {world_size}× too small: "
             f"you divided by the world size twice — once, before or after the reduction.")
    if step > 0 and _close(w, s["accumulated"]):
        fail(f"{after} the weights are what you get when the gradients of the earlier steps are "
             f"added to this one's: zero_grad() must clear every p.grad (set it to None) — and "
             f"anything you add gradients into.")
    if _close(w, r0["initial"]) and step == 0:
        fail("after step 1 the weights have not changed: copy the gathered shards back "
             "into p.data (or step the inner optimizer).")
    total = w.numel()
    numels = _numels()
    if _close(w, torch.cat([ref[:n] for n in numels])):
        fail(f"{after} every parameter holds the first numbers of the gathered vector: advance "
             f"the offset by p.numel() after copying each parameter back.")
    bad = (~torch.isclose(w, ref, rtol=1e-5, atol=1e-6)).nonzero().flatten().tolist()
    if bad and set(bad) <= _edges(world_size, stage):
        fail(f"{after} only the numbers at the shard edges {bad} are wrong: a shard boundary "
             f"is off by one — slice [start:end), end exclusive.")
    if not any("reduce" in c for c in s["backward"] + s["step"]):
        fail(f"{after} every rank holds the same weights, but they differ from DDP's: the "
             f"gradients were never averaged over the ranks — reduce-scatter (or all-reduce) "
             f"them, then divide, before stepping the shard.")
    name = r0["names"][bad[0]]
    fail(f"{after} the weights differ from DDP + {opt_name} at {len(bad)} of {total} numbers "
         f"(first: index {bad[0]}, in {name}): the shard must be stepped with this rank's "
         f"slice of the averaged gradient, then all-gathered.")


def _diagnose_drift(results: list, step: int) -> None:
    __tracebackhide__ = True
    if step == 0:
        initial = results[0]["initial"]
        changed = [r["steps"][0]["learner"] != initial for r in results]
        apart = all(not (changed[a] & changed[b]).any()
                    for a in range(len(changed)) for b in range(a + 1, len(changed)))
        if apart:
            fail("after step 1 each rank changed only its own shard and the ranks now hold "
                 "different weights: all-gather the shards (all_gather_single) and copy the "
                 "full vector back into every parameter.")
    fail(f"after step {step + 1} the ranks hold different weights: every rank must end the "
         f"step with every shard — all-gather them and copy them back into the parameters.")


def _diagnose_memory(results: list, world_size: int, opt_name: str) -> str:
    """Stage 2: the weights are right; were the full gradients ever all alive at once?"""
    __tracebackhide__ = True
    total = results[0]["total"]
    steps = [s for r in results for s in r["steps"]]
    peak = max(s["peak"] for s in steps)
    if peak >= total:
        if not any("reduce" in c for s in steps for c in s["backward"]):
            fail(f"you kept all full gradients until step(): all {total} gradient numbers were "
                 f"alive at once when the backward ended — reduce-scatter each parameter's "
                 f"gradient from a post-accumulate-grad hook as soon as it is ready, and drop "
                 f"it there (p.grad = None).")
        if max(s["after_backward"] for s in steps) >= total:
            fail(f"the gradients were reduce-scattered during the backward, but all {total} "
                 f"full gradient numbers were still alive when it ended: set p.grad = None in "
                 f"the hook once this rank's slice is taken (and keep no other reference).")
        fail(f"all {total} gradient numbers were alive at once during the backward: you waited "
             f"for the whole model before reduce-scattering — reduce-scatter each parameter "
             f"(or group) as soon as its own gradients are ready, and drop them at once.")
    return f"{peak} of {total} on {world_size} ranks ({opt_name})"
