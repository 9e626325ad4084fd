"""Part 1 of lab 07, the parts its check reads: the cases ``check_assign_buckets`` runs,
DDP's rule and the usual other rules (to name a learner's by reproducing it), the sentence for
a wrong assignment (:func:`bucket_problem`, also used by part 2's check), the refusal of
torch's and the course library's own assignment, and the worked case the lab prints.

:mod:`dpcourse.checks.lab07` holds the public checks; kept apart so that each file holds one
part of the lab, readable top to bottom.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

MiB = 2 ** 20


# --------------------------------------------------------------------------------------------
# assign_buckets
# --------------------------------------------------------------------------------------------


def _small_cnn(width: int = 8) -> nn.Module:
    from ..models import SmallCNN

    torch.manual_seed(0)
    return SmallCNN(width=width)


def _params_of(numels, dtype=torch.float32) -> list:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def _bucket_cases() -> list[tuple[str, list, float]]:
    """(what, parameters in registration order, cap in MiB); no boundary within 10% of a cap
    but one exactly on it (DDP closes a bucket that has reached the cap: >=, not >), so MB
    (1e6) and MiB (2**20) give the same buckets."""
    cnn = list(_small_cnn().parameters())
    return [
        ("SmallCNN(width=8), cap 0.05 MiB", cnn, 0.05),
        ("SmallCNN(width=8), cap 0.01 MiB", cnn, 0.01),
        ("6 parameters, two larger than the cap", _params_of(
            [300_000, 10, 100_000, 100_000, 100_000, 400_000]), 1.0),
        ("4 float64 parameters of 0.38 MiB each", _params_of([50_000] * 4, torch.float64), 1.0),
        ("4 parameters of exactly 1 MiB, cap 1 MiB", _params_of([2**18] * 4), 1.0),
        ("SmallCNN(width=8), cap 100 MiB", cnn, 100.0),
        ("SmallCNN(width=8) with features.6 frozen, cap 0.01 MiB", _partly_frozen_cnn(), 0.01),
    ]


def _partly_frozen_cnn() -> list:
    """SmallCNN's parameters with a middle layer frozen (requires_grad=False): it belongs in no
    bucket, and its bytes count toward no cap (DDP buckets only what requires a gradient)."""
    model = _small_cnn()
    for p in model.features[6].parameters():
        p.requires_grad_(False)
    return list(model.parameters())


def _greedy(sizes: list[float], cap: float, order: list[int]) -> list[list[int]]:
    """Indices grouped by DDP's rule: add, then close the bucket once it has reached the cap."""
    buckets, current, total = [], [], 0.0
    for i in order:
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def _closed_before_over(sizes: list[float], cap: float) -> list[list[int]]:
    """The other usual rule, not DDP's: reversed order, a bucket closed before the next
    parameter would take it over the cap."""
    buckets, current, total = [], [], 0.0
    for i in range(len(sizes) - 1, -1, -1):
        if current and total + sizes[i] > cap:
            buckets.append(current)
            current, total = [], 0.0
        current.append(i)
        total += sizes[i]
    return buckets + ([current] if current else [])


def _own_bucket_for_large(sizes: list[float], cap: float) -> list[list[int]]:
    """DDP's rule, except that a parameter larger than the cap first closes the open bucket to
    get one of its own (a reading of "a bucket may exceed the cap" that DDP does not make)."""
    buckets, current, total = [], [], 0.0
    for i in range(len(sizes) - 1, -1, -1):
        if current and sizes[i] >= cap:
            buckets.append(current)
            current, total = [], 0.0
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0.0
    return buckets + ([current] if current else [])


_OTHER_RULES = (
    (_closed_before_over,
     "your buckets are those of the other usual rule in every case: a bucket closed just before "
     "the next parameter would take it over the cap, so none ever ends above it, and buckets "
     "come out smaller and more numerous than DDP's, which may end above the cap."),
    (_own_bucket_for_large,
     "your buckets are DDP's except around a parameter larger than the cap: there the open "
     "bucket was closed early, below the cap, so that the large parameter could have a bucket "
     "of its own. DDP never holds a parameter back for that: it goes into the open bucket like "
     "any other, and that bucket ends above the cap."),
)


def _mb(nbytes: float) -> str:
    return f"{nbytes / MiB:.3g} MiB"


class Problem(str):
    """A check's sentence naming a mistake (the cause), with ``fix``: what to change, said when
    the same mistake comes back (``checks.fail``'s ``fix=``)."""

    fix: str | None = None

    def __new__(cls, cause: str, fix: str | None = None):
        made = super().__new__(cls, cause)
        made.fix = fix
        return made


_DDP_CLOSING_FIX = ("add each parameter to the open bucket first, then close the bucket once it "
                    "has reached the cap (>=), as the lab's worked case shows.")


def bucket_problem(buckets, params: list, cap_mb: float, what: str = "") -> Problem | None:
    """None if ``buckets`` is a right assignment of ``params`` for ``cap_mb``, else the
    sentence naming the mistake, a :class:`Problem` (a str) carrying its fix. (Used by both
    checks.)"""
    where = f" ({what})" if what else ""
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple))
                                                         for b in buckets):
        return Problem(f"the buckets must be a list of lists of parameters, got "
                       f"{type(buckets).__name__}{where}.")
    ids = {id(p): i for i, p in enumerate(params)}
    flat = [p for b in buckets for p in b]
    if any(id(p) not in ids for p in flat):
        return Problem(f"a bucket holds something that is not one of the parameters given"
                       f"{where}.", fix="put the parameter objects themselves in the buckets "
                                        "(not names, copies or grads).")
    got = [ids[id(p)] for p in flat]
    if len(got) != len(set(got)):
        return Problem(f"a parameter is in more than one bucket{where}: its gradient would be "
                       f"averaged twice.", fix="put each parameter in exactly one bucket.")
    if len(got) != len(params):
        return Problem(f"{len(params) - len(got)} of the {len(params)} parameters are in no "
                       f"bucket{where}, so their gradients are never averaged.",
                       fix="give every parameter that requires a gradient a bucket.")
    if any(len(b) == 0 for b in buckets):
        return Problem(f"there is an empty bucket{where}: it would launch an all-reduce of "
                       f"nothing.", fix="leave out a bucket that holds nothing.")
    n = len(params)
    if got == list(range(n)) and n > 1:
        return Problem(f"the buckets are filled in forward (registration) order{where}: bucket "
                       f"0 holds the first layer's parameters, whose gradients the backward "
                       f"produces LAST, so no bucket is complete until the backward is nearly "
                       f"over and nothing goes on the wire while it runs.",
                       fix="walk the parameters in the order the backward produces their "
                           "gradients: reversed(params).")
    if got != list(range(n - 1, -1, -1)):
        return Problem(f"the parameters are not in reverse registration order across the "
                       f"buckets{where}: the order within and across buckets is the order the "
                       f"backward completes them, and nothing reorders them.",
                       fix="walk reversed(params) and never reorder them (by size or "
                           "otherwise).")
    sizes = [p.numel() * p.element_size() for p in params]
    cap = cap_mb * MiB
    idx = [[ids[id(p)] for p in b] for b in buckets]
    if all(len(b) == 1 for b in idx) and len(idx) > 1 and sizes[idx[0][0]] + sizes[idx[1][0]] <= cap:
        return Problem(f"every parameter has a bucket of its own{where}, though the first two "
                       f"together hold {_mb(sizes[idx[0][0]] + sizes[idx[1][0]])}, not above "
                       f"the cap of {cap_mb} MiB: one all-reduce per parameter, as with no "
                       f"buckets at all.", fix=_DDP_CLOSING_FIX)
    for k, b in enumerate(idx):
        before_last = sum(sizes[i] for i in b[:-1])
        if before_last >= cap:
            return Problem(f"bucket {k} holds {_mb(sum(sizes[i] for i in b))} in {len(b)} "
                           f"parameters: it had reached the cap of {cap_mb} MiB already before "
                           f"its last one{where}, and stayed open.", fix=_DDP_CLOSING_FIX)
        if k + 1 < len(idx) and sum(sizes[i] for i in b) < cap:
            nxt = sizes[idx[k + 1][0]]
            if nxt >= cap and idx != _closed_before_over(sizes, cap):
                return Problem(
                    f"bucket {k} was closed at {_mb(sum(sizes[i] for i in b))}, below the cap "
                    f"of {cap_mb} MiB{where}, so that the next parameter ({_mb(nxt)}, more "
                    f"than the cap by itself) could start a bucket of its own: DDP never holds "
                    f"a parameter back for that — a parameter larger than the cap goes into "
                    f"the open bucket like any other, and that bucket ends above the cap.",
                    fix=_DDP_CLOSING_FIX)
            return Problem(f"bucket {k} was closed at {_mb(sum(sizes[i] for i in b))}, below "
                           f"the cap of {cap_mb} MiB{where}: it was closed because the next "
                           f"parameter would take it over the cap, but DDP's buckets may end "
                           f"above the cap (reducer.cpp, compute_bucket_assignment_by_size).",
                           fix=_DDP_CLOSING_FIX)
    return None


_TORCH_ASSIGNMENT = (
    "assign_buckets calls torch's own dist._compute_bucket_assignment_by_size (the reducer's C++ "
    "function): part 1 asks you to write DDP's rule yourself, walking the parameters in reverse "
    "and closing each bucket once it has reached the cap.")


def _calls_torch_assignment(fn) -> bool:
    """True if ``fn``'s code (or any function nested in it) names the reducer's C++ assignment."""
    code = getattr(fn, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        if any("compute_bucket_assignment" in n for n in c.co_names):
            return True
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return False


@contextlib.contextmanager
def _no_torch_assignment():
    """Within the block, a call of torch's ``_compute_bucket_assignment_by_size`` (through
    ``torch.distributed`` or ``torch._C._distributed_c10d``) is recorded in the yielded list."""
    import torch.distributed as dist

    called = []
    modules = [dist]
    try:
        from torch._C import _distributed_c10d
        modules.append(_distributed_c10d)
    except ImportError:
        pass
    saved = [(m, getattr(m, "_compute_bucket_assignment_by_size", None)) for m in modules]
    for m, real in saved:
        if real is not None:
            def spy(*args, real=real, **kwargs):
                called.append(True)
                return real(*args, **kwargs)
            setattr(m, "_compute_bucket_assignment_by_size", spy)
    try:
        yield called
    finally:
        for m, real in saved:
            if real is not None:
                setattr(m, "_compute_bucket_assignment_by_size", real)


_LIBRARY_ASSIGNMENT = (
    "assign_buckets is (or calls) the course library's dpcourse.overlap.assign_buckets, lesson "
    "07's reference answer: part 1 asks for your own, so that you decide where each bucket "
    "closes.")


def _is_library_assignment(fn) -> bool:
    """True if ``fn`` is the course's reference ``overlap.assign_buckets`` (or a bound alias)."""
    from .. import overlap

    ref = overlap.assign_buckets
    return fn is ref or getattr(fn, "__code__", None) is ref.__code__ or (
        getattr(fn, "__module__", None) == ref.__module__
        and getattr(fn, "__name__", None) == ref.__name__)


@contextlib.contextmanager
def _no_library_assignment():
    """Within the block, a call of ``dpcourse.overlap.assign_buckets`` through the module is
    recorded in the yielded list."""
    from .. import overlap

    called, real = [], overlap.assign_buckets

    def spy(*args, **kwargs):
        called.append(True)
        return real(*args, **kwargs)

    overlap.assign_buckets = spy
    try:
        yield called
    finally:
        overlap.assign_buckets = real


# Part 1's worked case (none of the check's): six float32 parameters, sizes in MiB, in
# registration order, and a 1 MiB cap. Its buckets tell DDP's rule from the two usual others:
# closing before the next parameter would go over the cap gives [f], [e, d], [c], [b, a];
# closing only once strictly over it gives [f], [e, d, c], [b, a].
WORKED_CASE_MB = (("a", 0.25), ("b", 0.5), ("c", 0.75), ("d", 0.25), ("e", 0.75), ("f", 2.0))
WORKED_CASE_CAP_MB = 1.0


def show_worked_case() -> None:
    """Print part 1's worked case and the buckets torch's own reducer function
    (``dist._compute_bucket_assignment_by_size``) makes of it, computed now."""
    import torch.distributed as dist

    names = [n for n, _ in WORKED_CASE_MB]
    params = [torch.zeros(int(mb * MiB) // 4) for _, mb in WORKED_CASE_MB]
    n = len(params)
    got, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), [int(WORKED_CASE_CAP_MB * MiB)], [False] * n,
        list(range(n - 1, -1, -1)))
    sizes = dict(WORKED_CASE_MB)
    print("parameters in registration order (float32): " +
          ", ".join(f"{k} {mb:g} MiB" for k, mb in WORKED_CASE_MB) +
          f"; bucket_cap_mb={WORKED_CASE_CAP_MB:g}")
    print("DDP's reducer makes: " + ", ".join(
        f"bucket {i} = [{', '.join(names[j] for j in b)}] "
        f"({sum(sizes[names[j]] for j in b):g} MiB)" for i, b in enumerate(got)))


def _frozen_problem(buckets, everything: list, cap_mb: float, what: str) -> Problem | None:
    """The sentence for a frozen parameter in a bucket, or for frozen bytes counted toward the
    cap (buckets right for the trainable parameters had the frozen ones weighed too)."""
    frozen = {id(p) for p in everything if not p.requires_grad}
    if not frozen or not isinstance(buckets, (list, tuple)):
        return None
    try:
        held = [id(p) for b in buckets for p in b]
    except TypeError:
        return None
    if any(i in frozen for i in held):
        return Problem(f"a bucket holds a frozen parameter (requires_grad=False){f' ({what})'}: "
                       f"it never gets a gradient, so its bucket would never be complete.",
                       fix="bucket only the parameters that require a gradient.")
    index = {id(p): i for i, p in enumerate(everything)}
    got = [[index.get(i) for i in map(id, b)] for b in buckets]
    weighed = _greedy([p.numel() * p.element_size() for p in everything], cap_mb * MiB,
                      list(range(len(everything) - 1, -1, -1)))
    weighed = [[i for i in b if id(everything[i]) not in frozen] for b in weighed]
    trainable = [i for i, p in enumerate(everything) if p.requires_grad]
    right = _greedy([everything[i].numel() * everything[i].element_size() for i in trainable],
                    cap_mb * MiB, list(range(len(trainable) - 1, -1, -1)))
    right = [[trainable[i] for i in b] for b in right]
    if got == [b for b in weighed if b] and got != right:
        return Problem(f"the frozen parameters are in no bucket, but their bytes counted "
                       f"toward the cap ({what}), so the buckets close early: a parameter that "
                       f"requires no gradient is sent by no bucket.",
                       fix="leave the frozen parameters out of the assignment altogether, "
                           "bytes included.")
    return None
