"""Part 1 of lab 07, the parts its check reads: the cases ``check_assign_buckets`` runs,
DDP's rule and the usual other rules (to name a learner's by reproducing it), the sentence for
a wrong assignment (:func:`bucket_problem`, also used by part 2's check; :func:`mixed_problem`
for parameters of several dtypes), and the refusal of torch's and the course library's own
assignment. The puzzle whose bucket count the learner predicts before part 1 is in
:mod:`dpcourse.checks._lab07_puzzle`.

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
    but one exactly on it (DDP closes a bucket that has reached the cap: >=, not >) and one
    between 10**6 and 2**20 bytes (_mb_gap_case: only there do MB and MiB differ)."""
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
        _mb_gap_case(),
        # several dtypes: one open bucket per dtype, and a bucket still open at the end of the
        # walk is complete before one closed later (see _MIXED_CASES)
        *[(what, _mixed_params(spec), 1.0) for what, spec in _MIXED_CASES],
    ]


# (MiB, dtype) per parameter, in registration order. Each was chosen so that every other
# plausible way with several dtypes groups differently (one bucket for all dtypes, a bucket
# closed when the dtype changes, one byte count shared by the dtypes, closing before the cap),
# and so that the order DDP's reducer lists its buckets in (those closed during the walk, then
# those still open, in the order of its hash map) is not the order they complete in; together
# they tell the usual wrong orders apart (_ORDER_RULES).
_MIXED_CASES = (
    ("6 parameters, float32 and float16, cap 1 MiB",
     ((0.5, torch.float32), (0.5, torch.float32), (0.25, torch.float16), (0.25, torch.float16),
      (0.75, torch.float32), (1.5, torch.float32))),
    ("8 parameters, float64, float32 and bfloat16, cap 1 MiB",
     ((0.5, torch.float64), (0.5, torch.float32), (0.75, torch.float64), (0.25, torch.float32),
      (0.75, torch.float64), (0.5, torch.bfloat16), (1.5, torch.float64),
      (1.5, torch.bfloat16))),
    ("5 parameters, bfloat16 and float32, cap 1 MiB",
     ((1.5, torch.bfloat16), (0.25, torch.float32), (0.5, torch.bfloat16), (0.75, torch.bfloat16),
      (0.5, torch.float32))),
)


def _mb_gap_case() -> tuple[str, list, float]:
    """Three float32 parameters whose walk reaches 1,040,000 bytes after two: at least 10**6
    (1 MB) but below 2**20 (1 MiB), so a cap counted in MB closes the bucket there and DDP's
    does not (it closes it at 1,140,000 bytes, after the third)."""
    return ("3 float32 parameters, 1,040,000 bytes after two, cap 1 MiB",
            _params_of([25_000, 110_000, 150_000]), 1.0)


def _mb_cap_problem(got: list, cases: list, plain: list[int]) -> Problem | None:
    """The sentence for a cap counted in MB (10**6 bytes) instead of MiB: ``got`` (per case,
    the learner's buckets as indices of its trainable parameters, or None) is DDP's walk at
    cap × 10**6 bytes in every ``plain`` case (one dtype, nothing frozen), and differs from
    DDP's at cap × 2**20."""
    if any(got[k] != _reverse_walk(cases[k][1], cases[k][2] * 10**6) for k in plain):
        return None
    k = next((k for k in plain if got[k] != _reverse_walk(cases[k][1], cases[k][2] * MiB)), None)
    if k is None:
        return None
    what, ps, cap = cases[k]
    first = next(b for b, r in zip(got[k], _reverse_walk(ps, cap * MiB)) if b != r)
    closed = sum(ps[i].numel() * ps[i].element_size() for i in first)
    return Problem(f"your cap is 10**6 bytes (MB); DDP's MiB is 2**20 = 1,048,576 bytes ({what}: "
                   f"your bucket {got[k].index(first)} was closed at {closed:,} bytes, which "
                   f"reached {cap:g} MB but not {cap:g} MiB, so DDP keeps it open). "
                   f"bucket_cap_mb counts MiB, as torch's DDP does (a cap of 25 is "
                   f"25 × 2**20 bytes), and a bucket closed 4.9% early differs from DDP's "
                   f"wherever a boundary falls in that gap.",
                   fix=("reconsider the unit of bucket_cap_mb: the contract's first lines say "
                        "how many bytes one MiB is."))


def _mixed_params(spec) -> list:
    return [nn.Parameter(torch.zeros(int(mb * MiB) // (torch.finfo(dt).bits // 8), dtype=dt))
            for mb, dt in spec]


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


def _reverse_walk(params: list, cap: float,
                  size_of=lambda p: p.numel() * p.element_size()) -> list[list[int]]:
    """:func:`_greedy` over ``params`` walked as the backward produces their gradients (reverse
    registration order), each weighed by ``size_of`` (its bytes unless told otherwise)."""
    return _greedy([size_of(p) for p in params], cap, list(range(len(params) - 1, -1, -1)))


def _by_dtype(sizes: list[float], dtypes: list, cap: float) -> list[list[int]]:
    """DDP's grouping with several dtypes, in the order the buckets complete: walk the
    parameters reversed, add each to the open bucket of its dtype, close that bucket once it has
    reached the cap; a bucket is complete when its last parameter's gradient arrives (for one
    still open at the end, that is its last parameter too, not the end of the walk)."""
    n = len(sizes)
    open_, done = {}, []                    # dtype -> [indices, bytes]; (complete at, indices)
    for pos, i in enumerate(range(n - 1, -1, -1)):
        b = open_.setdefault(dtypes[i], [[], 0.0])
        b[0].append(i)
        b[1] += sizes[i]
        if b[1] >= cap:
            done.append((pos, b[0]))
            open_[dtypes[i]] = [[], 0.0]
    done += [(n - 1 - b[0][-1], b[0]) for b in open_.values() if b[0]]
    return [b for _, b in sorted(done, key=lambda x: x[0])]


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


def _walk_closing_early(sizes: list[float], cap: float, close_first) -> list[list[int]]:
    """DDP's walk (reversed order; add, then close the bucket once it has reached the cap), with
    one more way to close a bucket: ``close_first(i, bucket)`` true closes the open ``bucket``
    (indices) before parameter ``i`` joins it. The other usual rules that close early are this
    walk with their own ``close_first``."""
    buckets, current, total = [], [], 0.0
    for i in range(len(sizes) - 1, -1, -1):
        if current and close_first(i, current):
            buckets.append(current)
            current, total = [], 0.0
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0.0
    return buckets + ([current] if current else [])


def _own_bucket_for_large(sizes: list[float], cap: float) -> list[list[int]]:
    """DDP's rule, except that a parameter larger than the cap first closes the open bucket to
    get one of its own (a reading of "a bucket may exceed the cap" that DDP does not make)."""
    return _walk_closing_early(sizes, cap, lambda i, _: sizes[i] >= cap)


_OTHER_RULES = (
    (_closed_before_over,
     "your buckets are those of the other usual rule in every case: a bucket closed just before "
     "the next parameter would take it over the cap, the cap tested before that parameter "
     "joins, so each such bucket goes on the wire below the cap, before it has reached it — "
     "more messages, each paying a message's start-up cost ({example}) — where DDP tests the "
     "cap after a parameter joins, so its buckets may end above the cap."),
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


_DDP_CLOSING_FIX = ("reconsider what closes a bucket: whether the cap is tested before or after "
                    "a parameter joins, and whether a bucket that has just reached it is large "
                    "enough (lesson 07 §3; part 1's hint 2).")


def bucket_problem(buckets, params: list, cap_mb: float, what: str = "") -> Problem | None:
    """None if ``buckets`` is a right assignment of ``params`` for ``cap_mb``, else the
    sentence naming the mistake, a :class:`Problem` (a str) carrying its fix. (Used by both
    checks.)"""
    where = f" ({what})" if what else ""
    basic = _basic_problem(buckets, params, where)
    if basic:
        return basic
    ids = {id(p): i for i, p in enumerate(params)}
    got = [ids[id(p)] for b in buckets for p in b]
    n = len(params)
    if got == list(range(n)) and n > 1:
        return Problem(f"the buckets are filled in forward (registration) order{where}: bucket "
                       f"0 holds the first layer's parameters, whose gradients the backward "
                       f"produces LAST, so no bucket is complete until the backward is nearly "
                       f"over and nothing goes on the wire while it runs.",
                       fix=("reconsider in which order the backward produces the gradients "
                            "(lesson 07 §2)."))
    if got != list(range(n - 1, -1, -1)):
        return Problem(f"the parameters are not in reverse registration order across the "
                       f"buckets{where}: the order within and across buckets is the order the "
                       f"backward completes them, and nothing reorders them.",
                       fix=("reconsider what may decide the order: only the order the gradients "
                            "arrive in, nothing about the parameters themselves (lesson 07 "
                            "§3)."))
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
        if before_last == cap and idx == _walk_closing_early(sizes, cap + 1, lambda i, _: False):
            return Problem(f"bucket {k} reached the cap of {cap_mb} MiB exactly after "
                           f"{len(b) - 1} parameter(s){where}, yet stayed open and took one more: you close "
                           f"a bucket only once it is OVER the cap, but in DDP reaching the cap "
                           f"is what closes it — a bucket of cap bytes is already large enough "
                           f"to be worth its message.", fix=_DDP_CLOSING_FIX)
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
                           f"parameter would take it over the cap, so it went on the wire "
                           f"before reaching the cap, a message DDP does not send yet: DDP "
                           f"tests the cap after a parameter joins, so its buckets may end "
                           f"above the cap (reducer.cpp, compute_bucket_assignment_by_size).",
                           fix=_DDP_CLOSING_FIX)
    return None


def _basic_problem(buckets, params: list, where: str) -> Problem | None:
    """The sentence for buckets that are no partition of ``params``, else None."""
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple))
                                                         for b in buckets):
        return Problem(f"the buckets must be a list of lists of parameters, got "
                       f"{type(buckets).__name__}{where}.")
    ids = {id(p): i for i, p in enumerate(params)}
    flat = [p for b in buckets for p in b]
    if any(id(p) not in ids for p in flat):
        return Problem(f"a bucket holds something that is not one of the parameters given"
                       f"{where}.", fix=("reconsider what the contract says a bucket holds: the "
                                         "very parameters you were given."))
    got = [ids[id(p)] for p in flat]
    if len(got) != len(set(got)):
        return Problem(f"a parameter is in more than one bucket{where}: its gradient would be "
                       f"averaged twice.", fix=("reconsider how your walk can add a parameter a "
                                                "second time."))
    if len(got) != len(params):
        return Problem(f"{len(params) - len(got)} of the {len(params)} parameters are in no "
                       f"bucket{where}, so their gradients are never averaged.",
                       fix=("reconsider where your walk can lose a parameter — what happens to "
                            "a bucket still open when the walk ends?"))
    if any(len(b) == 0 for b in buckets):
        return Problem(f"there is an empty bucket{where}: it would launch an all-reduce of "
                       f"nothing.", fix=("reconsider when your walk opens a bucket: one that "
                                         "never receives a parameter has nothing to send."))
    return None


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _close_on_switch(sizes, dtypes, cap) -> list[list[int]]:
    """One open bucket at a time, closed (below the cap) whenever the dtype changes."""
    return _walk_closing_early(sizes, cap, lambda i, bucket: dtypes[i] != dtypes[bucket[-1]])


def _shared_total(sizes, dtypes, cap) -> list[list[int]]:
    """One open bucket per dtype, but one byte count for all of them."""
    open_, done, total = {}, [], 0.0
    for pos, i in enumerate(range(len(sizes) - 1, -1, -1)):
        b = open_.setdefault(dtypes[i], [])
        b.append(i)
        total += sizes[i]
        if total >= cap:
            done.append(b)
            open_[dtypes[i]], total = [], 0.0
    return done + [b for b in open_.values() if b]


_PER_DTYPE_FIX = ("reconsider what a parameter of another dtype passing by does to the open "
                  "bucket of the first, and to its size count (part 1's hint 2).")
_COMPLETE_ORDER_FIX = ("reconsider when a bucket becomes complete — is it when it is closed? — "
                       "and so where it belongs in the list (part 1's contract).")


def _nth(k: int) -> str:
    return f"{k}{'st' if k % 10 == 1 and k != 11 else 'nd' if k % 10 == 2 and k != 12 else 'rd' if k % 10 == 3 and k != 13 else 'th'}"


def _opened_order(sizes, dtypes, cap) -> list[list[int]]:
    """DDP's buckets, ordered by the moment each was opened (its first gradient)."""
    return sorted(_by_dtype(sizes, dtypes, cap), key=lambda b: -b[0])


def _open_ones_last(sizes, dtypes, cap) -> list[list[int]]:
    """DDP's buckets: those closed during the walk in the order they closed, then those still
    open, in the order they were opened (a dict's order; torch's own list puts them last too)."""
    right = _by_dtype(sizes, dtypes, cap)
    closed = [b for b in right if sum(sizes[i] for i in b) >= cap]
    return closed + sorted((b for b in right if b not in closed), key=lambda b: -b[0])


def _dtype_after_dtype(sizes, dtypes, cap) -> list[list[int]]:
    """DDP's buckets, one dtype's after the other's, dtypes in the order they first appear."""
    right = _by_dtype(sizes, dtypes, cap)
    first = list(dict.fromkeys(dtypes[i] for i in range(len(sizes) - 1, -1, -1)))
    return [b for t in first for b in right if dtypes[b[0]] == t]


# The usual wrong orders of the right buckets, each with the sentence that names it; the check
# names one when the learner's order is that rule's in every mixed case (_MIXED_CASES tell the
# three apart: in each, at least two of them differ, and in all, every one differs from DDP's).
_ORDER_RULES = (
    (_opened_order, " Your buckets are in the order they were opened (their first gradient); "
                    "a bucket opened early can still be waiting when one opened after it is "
                    "complete."),
    (_open_ones_last, " The buckets still open when the walk ended come after every bucket "
                      "closed during it, yet an open bucket can be complete long before the walk "
                      "ends. That is how torch lists them when DDP rebuilds its buckets "
                      "(reducer.cpp, compute_bucket_assignment_by_size, given the order the "
                      "gradients arrived: the closed buckets in the order they closed, then the "
                      "still-open ones in its hash map's order, unsorted; it sorts, by each "
                      "bucket's smallest parameter index, only when no order is given, as in "
                      "DDP's first-iteration call). The order they complete is this lab's own "
                      "rule, stricter than torch's: DDP launches its buckets strictly in list "
                      "order, so with several dtypes torch's list can hold a complete bucket back "
                      "behind one still waiting, the delay part 2's wrapper exists to avoid."),
    (_dtype_after_dtype, " Your buckets come one dtype after the other; a dtype's buckets and "
                         "another's complete interleaved."),
)


def _follows(rule, got, sizes, dtypes, cap) -> bool:
    """True if ``got`` (buckets as indices) is ``rule``'s order; for the still-open buckets put
    last, in any order among themselves (torch's own list has them in its hash map's order)."""
    want = rule(sizes, dtypes, cap)
    if rule is not _open_ones_last or got is None:
        return got == want
    closed = [b for b in want if sum(sizes[i] for i in b) >= cap]
    rest = sorted(map(tuple, want[len(closed):]))
    return got[:len(closed)] == closed and sorted(map(tuple, got[len(closed):])) == rest


def order_rule_of(answers) -> str | None:
    """The sentence of the ordering rule that gives every mixed case's answer (``answers``: per
    case of _MIXED_CASES, the learner's buckets as indices, or None), else None."""
    cases = [_mixed_params(spec) for _, spec in _MIXED_CASES]
    for rule, sentence in _ORDER_RULES:
        if all(_follows(rule, got, [p.numel() * p.element_size() for p in ps],
                        [p.dtype for p in ps], MiB) for got, ps in zip(answers, cases)):
            return sentence
    return None


def mixed_problem(buckets, params: list, cap_mb: float, what: str = "",
                  how: str | None = None) -> Problem | None:
    """None if ``buckets`` is DDP's grouping of ``params`` (of several dtypes) for ``cap_mb``,
    in the order the buckets complete; else the sentence naming the mistake. ``how``: the
    sentence of the ordering rule the learner's answer follows in every mixed case (from
    :func:`order_rule_of`); None judges this case alone."""
    where = f" ({what})" if what else ""
    basic = _basic_problem(buckets, params, where)
    if basic:
        return basic
    ids = {id(p): i for i, p in enumerate(params)}
    idx = [[ids[id(p)] for p in b] for b in buckets]
    n = len(params)
    dtypes = [p.dtype for p in params]
    sizes = [p.numel() * p.element_size() for p in params]
    cap = cap_mb * MiB
    arrives = {i: n - i for i in range(n)}          # the backward's order: the n-th gradient
    for k, b in enumerate(idx):
        kinds = sorted({_dt(dtypes[i]) for i in b})
        if len(kinds) > 1:
            return Problem(f"bucket {k} holds {' and '.join(kinds)} parameters together{where}: a "
                           f"bucket is one flat buffer for one all-reduce, and a buffer has one "
                           f"dtype, so DDP never puts two dtypes in one bucket.",
                           fix=_PER_DTYPE_FIX)
    for k, b in enumerate(idx):
        if [arrives[i] for i in b] != sorted(arrives[i] for i in b):
            return Problem(f"within bucket {k} the parameters are not in the order the backward "
                           f"produces their gradients{where}.",
                           fix=("reconsider what may decide the order: only the order the "
                                "gradients arrive in, not size nor dtype (lesson 07 §3)."))
    right = _by_dtype(sizes, dtypes, cap)
    as_set = lambda bs: sorted(map(tuple, bs))
    if as_set(idx) == as_set(right):
        if idx == right:
            return None
        done = [max(arrives[i] for i in b) for b in idx]
        k = next(j for j in range(len(idx)) if idx[j] != right[j])
        later = next(j for j in range(k + 1, len(idx)) if done[j] < done[k])
        if how is None:                    # no verdict over every case: judge this one alone
            how = next((s for rule, s in _ORDER_RULES
                        if _follows(rule, idx, sizes, dtypes, cap)), "")
        return Problem(f"the buckets hold the right parameters{where}, but not in the order "
                       f"they complete: your bucket {k} ({_dt(dtypes[idx[k][0]])}, "
                       f"{_mb(sum(sizes[i] for i in idx[k]))}) is complete only once the "
                       f"{_nth(done[k])} gradient has arrived, and your bucket {later} "
                       f"({_dt(dtypes[idx[later][0]])}) after the {_nth(done[later])}: a wrapper "
                       f"that launches the buckets in their order would hold bucket {later} back "
                       f"though nothing is missing from it.{how}", fix=_COMPLETE_ORDER_FIX)
    if as_set(idx) == as_set(_close_on_switch(sizes, dtypes, cap)):
        k, b = next((k, b) for k, b in enumerate(idx)
                    if b[-1] > 0 and dtypes[b[-1] - 1] != dtypes[b[0]]
                    and sum(sizes[i] for i in b) < cap
                    and any(dtypes[j] == dtypes[b[0]] for j in range(b[-1])))
        return Problem(f"a bucket was closed below the cap whenever a parameter of another dtype "
                       f"arrived{where}: your {_dt(dtypes[b[0]])} bucket {k} was closed at "
                       f"{_mb(sum(sizes[i] for i in b))}, below the cap of {cap_mb:g} MiB, when "
                       f"a {_dt(dtypes[b[-1] - 1])} gradient came next — a message smaller than "
                       f"the cap asks for, though more {_dt(dtypes[b[0]])} gradients were still "
                       f"to come. Where the dtypes alternate, the buckets stay small and the "
                       f"all-reduces many.", fix=_PER_DTYPE_FIX)
    if as_set(idx) == as_set(_shared_total(sizes, dtypes, cap)):
        k, b = next((k, b) for k, b in enumerate(idx)
                    if b not in right and sum(sizes[i] for i in b) < cap)
        return Problem(f"each dtype has its own buckets, but the bytes of every dtype were added "
                       f"into one count{where}: your {_dt(dtypes[b[0]])} bucket {k} was closed "
                       f"at {_mb(sum(sizes[i] for i in b))}, below the cap of {cap_mb:g} MiB by "
                       f"its own bytes, when another dtype's parameters filled the count — a "
                       f"message smaller than the cap asks for.",
                       fix=("reconsider whose size the cap is compared with: which bucket did "
                            "this parameter join?"))
    for t in dict.fromkeys(dtypes):
        mine = [b for b in buckets if b[0].dtype == t]
        of_t = [p for p in params if p.dtype == t]
        problem = bucket_problem(mine, of_t, cap_mb, f"{what}, its {_dt(t)} parameters" if what
                                 else f"its {_dt(t)} parameters")
        if problem:
            return problem
    return Problem(f"the buckets are not DDP's{where}: {len(idx)} buckets where DDP makes "
                   f"{len(right)}.", fix=_PER_DTYPE_FIX)


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
                       fix=("reconsider what a bucket waits for: a parameter that never gets a "
                            "gradient would keep its bucket from ever being complete."))
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
                       fix=("reconsider what the cap measures: the bytes of one message on the "
                            "wire — what does a frozen parameter put there?"))
    return None
