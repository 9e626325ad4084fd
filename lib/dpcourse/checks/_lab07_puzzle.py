"""Part 1's prediction in lab 07: the puzzle whose bucket count the learner predicts before
writing ``assign_buckets`` (:func:`show_bucket_puzzle`), the buckets torch's own reducer makes
of it, and the sentence that says why DDP's count is what it is and what the other plausible
rules would count (:func:`explain_puzzle`). The rules themselves are in
:mod:`dpcourse.checks._lab07_buckets`; ``check_bucket_prediction`` is in
:mod:`dpcourse.checks.lab07`, which re-exports every name here.
"""

from __future__ import annotations

import torch
from torch import nn

from ._lab07_buckets import MiB, _by_dtype, _close_on_switch, _dt, _shared_total

# Part 1's prediction (none of the check's cases): seven parameters of two dtypes, in
# registration order, and a 1 MiB cap. DDP's rule makes 3 buckets of them; each other plausible
# rule makes another number (one bucket for both dtypes 4, one byte count shared by the dtypes
# 5 — walking in registration order 5 too —, closing before the cap would be passed 6, closing
# whenever the dtype changes 7, the cap compared with elements 2), and no
# bucket lands exactly on the cap (where >= and > part is the check's to teach).
PUZZLE = (("a", 1.5, torch.bfloat16), ("b", 0.75, torch.float32), ("c", 0.25, torch.bfloat16),
          ("d", 0.75, torch.float32), ("e", 1.5, torch.float32), ("f", 0.5, torch.bfloat16),
          ("g", 0.75, torch.float32))
PUZZLE_CAP_MB = 1.0
BUCKET_QUESTION = (f"buckets DDP's reducer makes of part 1's {len(PUZZLE)} parameters at "
                   f"{PUZZLE_CAP_MB:g} MiB")
_PUZZLE_RULES = (
    ("walking the parameters in registration order",
     lambda s, d, c: _by_dtype(s[::-1], d[::-1], c)),
    ("one open bucket for both dtypes", lambda s, d, c: _by_dtype(s, [0] * len(s), c)),
    ("one byte count shared by the dtypes' open buckets", _shared_total),
    ("a bucket closed before the next parameter would take it over the cap",
     lambda s, d, c: _closed_before_over_by_dtype(s, d, c)),
    ("a bucket closed whenever the dtype changes", _close_on_switch),
    ("the cap compared with elements, not bytes",
     lambda s, d, c: _by_dtype([x / (torch.finfo(t).bits // 8) for x, t in zip(s, d)], d, c)),
)


def _closed_before_over_by_dtype(sizes, dtypes, cap) -> list[list[int]]:
    open_, done = {}, []
    for i in range(len(sizes) - 1, -1, -1):
        b = open_.setdefault(dtypes[i], [[], 0.0])
        if b[0] and b[1] + sizes[i] > cap:
            done.append(b[0])
            b = open_[dtypes[i]] = [[], 0.0]
        b[0].append(i)
        b[1] += sizes[i]
    return done + [b[0] for b in open_.values() if b[0]]


def _puzzle_params() -> list:
    return [nn.Parameter(torch.zeros(int(mb * MiB) // (torch.finfo(dt).bits // 8), dtype=dt))
            for _, mb, dt in PUZZLE]


def show_bucket_puzzle() -> None:
    """Print part 1's prediction: the parameters, their dtypes and sizes, and the cap."""
    print(f"bucket_cap_mb = {PUZZLE_CAP_MB:g} (MiB). The parameters in registration order")
    print(f"(the backward produces their gradients in the reverse order, {PUZZLE[-1][0]} first):")
    for name, mb, dt in PUZZLE:
        print(f"   {name}  {_dt(dt):<9} {mb:>5g} MiB")


def torch_buckets_of_puzzle() -> list[list[int]]:
    """The buckets torch's own reducer function (``dist._compute_bucket_assignment_by_size``,
    given the order the gradients arrive) makes of the puzzle, as indices, computed now."""
    import torch.distributed as dist

    params = _puzzle_params()
    n = len(params)
    got, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), [int(PUZZLE_CAP_MB * MiB)], [False] * n,
        list(range(n - 1, -1, -1)))
    return [list(b) for b in got]


def explain_puzzle(guess, learners: list[list[int]] | None) -> tuple[int, str]:
    """DDP's count for the puzzle and the sentence that says why (and what other counts mean)."""
    names = [n for n, _, _ in PUZZLE]
    sizes = [mb * MiB for _, mb, _ in PUZZLE]
    dtypes = [dt for _, _, dt in PUZZLE]
    right = _by_dtype(sizes, dtypes, PUZZLE_CAP_MB * MiB)
    theirs = torch_buckets_of_puzzle()
    if sorted(map(tuple, theirs)) != sorted(map(tuple, right)):
        raise AssertionError(f"torch's reducer function grouped the puzzle as {theirs}, the "
                             f"check's rule as {right}: the check's rule is out of date")
    show = lambda bs: ", ".join(f"[{', '.join(names[i] for i in b)}] ({_dt(dtypes[b[0]])}, "
                                f"{sum(sizes[i] for i in b) / MiB:g} MiB)" for b in bs)
    if theirs == right:
        listed = f"{show(right)} — listed in the order they complete, as part 1 asks"
    else:
        listed = (f"listed as {show(theirs)}; in the order they complete, as part 1 asks: "
                  f"{show(right)}")
    why = (f"DDP's reducer (torch's own function, run now on the order the gradients arrive, "
           f"as DDP's rebuild calls it) makes {len(right)} buckets: {listed}. ")
    if learners is not None:
        why += ("Your assign_buckets makes the same. " if learners == right else
                f"Your assign_buckets makes {len(learners)} bucket(s) here: run part 1's check. ")
    others = [(what, len(rule(sizes, dtypes, PUZZLE_CAP_MB * MiB))) for what, rule in _PUZZLE_RULES]
    why += "Other rules would give other counts: " + "; ".join(
        f"{what}, {count}" for what, count in others) + "."
    return len(right), why
