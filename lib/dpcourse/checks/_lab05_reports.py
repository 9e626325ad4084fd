"""Lab 05 part 3's diagnosis of a wrong reported loss or accuracy (the design decision: what
each replica returns, and how the replicas' values become one number). The reported value is
compared with every wrong calculation the check knows, each computed on the very split the step
ran on — from the logits before the update and from the weights after it: SUM of the replicas'
means, MEAN of their shares, a mean of means, a count never divided, replica 0's value — and
named only when exactly one of them matches. On an even split several can coincide (counts
after the update can equal the sum of the means before it); then a later split decides, or the
check says it cannot tell and gives no fix.

Imported by :mod:`dpcourse.checks._lab05_step`.
"""

from __future__ import annotations

import numpy as np

from dpcourse.checks import fail
from dpcourse.checks._lab05_common import _close


class _Ambiguous(Exception):
    """A wrong reported value that more than one wrong calculation explains on this split."""

    def __init__(self, what, got, fmt, want_is, found, split):
        super().__init__(what)
        self.sentence = (
            f"the reduced {what} is {got:{fmt}}, but {want_is} (split {split}). On every split "
            f"the check tried, more than one wrong calculation gives that number ("
            + "; ".join(_HOW[how][0].format(what=what) + (" after the update" if when == "after"
                                                           else "")
                        for when, how, _ in found)
            + "), so the check cannot tell which one your step makes: print what each replica "
            f"returns on an uneven split and compare.")


# how a per-replica statistic was combined: (what it is, the cause, the fix)
_HOW = {
    "batch": ("the batch's {what}", "", ""),
    "sum_of_means": (
        "the replicas' own means added up",
        "the replicas' own means added up (SUM): {parts} = {value}, each a mean over its own "
        "slice. Means do not add up: {n} means added are about {n} times one mean.",
        "Let each replica return what adds up over the replicas (a count or a sum, or a share "
        "already divided by the step's sample count), combine it with SUM, and divide a count "
        "once by the step's sample count."),
    "mean_of_means": (
        "the mean of the replicas' own means",
        "the mean of the replicas' own means ({parts}) over slices of {split} samples: a mean "
        "of means weighs every replica the same, not every sample, so it is the batch's {what} "
        "only when the slices are the same size — and a short last step's are not.",
        "Let each replica return a statistic that adds up over the replicas (a sum or a count), "
        "and divide once by the step's sample count."),
    "mean_of_shares": (
        "the mean of the replicas' shares",
        "the mean (MEAN) of the replicas' shares ({parts}), each already divided by the global "
        "batch ({gb}): averaging them divides by the {n} replicas a second time.",
        "Shares add up to the mean: combine them with the operation that adds them."),
    "count": (
        "the replicas' counts of correct predictions added up, not divided",
        "the replicas' counts of correct predictions ({parts} of slices of {split} samples) "
        "added up and never divided by the {gb} samples of the step.",
        "Divide the summed statistic once by the step's sample count."),
    "counts_mean": (
        "the replicas' correct predictions over the mean of their sample counts",
        "the replicas' correct predictions ({parts}) added up and divided by the mean (MEAN) of "
        "their sample counts (slices of {split}: {gb}/{n}), where one device divides by their "
        "sum, the step's {gb} samples: counts add up over the replicas, and averaging them "
        "divides by the {n} replicas once more.",
        "Combine the replicas' sample counts with the operation that adds them."),
    "replica0": (
        "replica 0's value alone",
        "replica 0's value alone, not a reduction over the {n} replicas.",
        "Combine every replica's value into one number with strategy.reduce."),
}


def _mean(values) -> float:
    """A slice's own mean; nan for an empty slice (0/0, as reduce_mean gives), without numpy's
    warning."""
    return float(values.sum()) / len(values) if len(values) else float("nan")


def _wrong_reductions(of, slices, gb: int, what: str) -> dict:
    """The number each way of combining the per-replica statistic ``of`` (per-example losses or
    hits) over ``slices`` gives, the right way ("batch") included."""
    means = [_mean(of[s]) for s in slices]
    shares = [float(of[s].sum()) / gb for s in slices]
    out = {"batch": float(of.mean()), "sum_of_means": sum(means),
           "mean_of_shares": float(np.mean(shares)), "replica0": means[0]}
    if len({len(s) for s in slices}) > 1:
        out["mean_of_means"] = float(np.mean(means))
    if what == "accuracy":
        out["count"] = float(of.sum())
        out["counts_mean"] = float(of.sum()) / (gb / len(slices))
    else:
        out["replica0_share"] = shares[0]
    return out


def _name_reduction(what, got, fmt, want_is, when, how, of, slices, gb):
    """(cause, fix) for a reported value that one wrong calculation explains."""
    n = len(slices)
    how = "replica0" if how == "replica0_share" else how
    parts = [_mean(of[s]) for s in slices] if how in ("sum_of_means", "mean_of_means") \
        else [float(of[s].sum()) / (gb if how == "mean_of_shares" else 1) for s in slices]
    pfmt = ".0f" if how in ("count", "counts_mean") else fmt   # a count of correct predictions is whole
    fields = dict(what=what, n=n, gb=gb, split="+".join(str(len(s)) for s in slices),
                  parts=" + ".join(f"{p:{pfmt}}" for p in parts) if how == "sum_of_means"
                  else ", ".join(f"{p:{pfmt}}" for p in parts),
                  value=f"{got:{fmt}}")
    late = (f"computed from the weights after this step's update (the model run again after "
            f"apply_gradients), but the contract asks for the {what} before the update: "
            f"{want_is}.")
    step = f" (This step: {gb} samples, split {fields['split']} over {n} replicas.)"
    if how == "batch":
        return (f"the {what} returned ({got:{fmt}}) is the batch's {what} {late}{step}",
                f"Report the {what} of the logits the step's loss was computed from.")
    cause = f"the {what} returned ({got:{fmt}}) is " + _HOW[how][1].format(**fields)
    fix = _HOW[how][2]
    if when == "after":
        cause += f" It is also {late}"
        fix += f" And report the {what} of the logits the step's loss was computed from."
    else:
        cause += f" ({want_is[0].upper()}{want_is[1:]}.)"
    return cause + step, fix


def judge_reports(loss: float, acc: float, ref_loss: float, ref_acc: float, when_of: dict,
                  slices: list, global_batch: int) -> None:
    """Each reported value is compared with the batch's; a wrong one is compared with every
    wrong calculation the check knows, computed on this very split from ``when_of`` ("before":
    the per-example losses and hits of the logits before the update, "after": of the weights
    after it), and named only when exactly one matches. Raises :class:`_Ambiguous` when several
    match (a later split decides)."""
    __tracebackhide__ = True
    n = len(slices)
    split = "+".join(str(len(s)) for s in slices)
    for what, got, fmt, want, want_is in (
            ("loss", loss, ".5f", ref_loss,
             f"the batch's mean loss before the update is {ref_loss:.5f}"),
            ("accuracy", acc, ".4f", ref_acc,
             f"the batch's accuracy before the update is {ref_acc:.4f}")):
        if _close(got, want, rtol=1e-3):
            continue
        found = []
        for when, (w_loss, w_hit) in when_of.items():
            of = w_loss if what == "loss" else w_hit.astype(float)
            for how, value in _wrong_reductions(of, slices, global_batch, what).items():
                if (when, how) != ("before", "batch") and _close(got, value, rtol=1e-3):
                    found.append((when, how, of))
        if len(found) > 1:
            raise _Ambiguous(what, got, fmt, want_is, found, split)
        if not found and not np.isfinite(got):
            empty = [r for r, s in enumerate(slices) if len(s) == 0]
            fail(f"the reduced {what} is {got}, but {want_is} (split {split} over {n} "
                 f"replicas): "
                 + (f"replica {empty[0]} holds no sample of this step, and a mean over its own "
                    f"slice is 0/0 = nan there — multiplied by its share of the step (0) or "
                    f"averaged with the others, it stays nan. An epoch's short last step leaves "
                    f"replicas empty." if empty else "a value that is not a finite number "
                                                     "was reported."),
                 fix=f"Let each replica return a statistic that is 0 over no sample (a sum or a "
                     f"count), combine with SUM, and divide once by the step's count.")
        if not found and what == "accuracy":
            _name_a_fixed_divisor(got, fmt, want_is, when_of, slices)
        if not found:
            fail(f"the reduced {what} is {got:{fmt}}, but {want_is} (split {split} over {n} "
                 f"replicas), and it matches no wrong calculation the check knows.")
        when, how, of = found[0]
        cause, fix = _name_reduction(what, got, fmt, want_is, when, how, of, slices, global_batch)
        fail(cause, fix=fix)


def _name_a_fixed_divisor(got: float, fmt: str, want_is: str, when_of: dict, slices: list):
    """An accuracy that is the step's count of correct predictions divided by a whole number
    other than the step's sample count (a nominal batch size, a notebook's global_batch): named
    with that number and the step's count."""
    __tracebackhide__ = True
    count = sum(len(s) for s in slices)
    split = "+".join(str(len(s)) for s in slices)
    for when, (_, hit) in when_of.items():
        hits = float(hit.sum())
        if not hits or not got:
            continue
        k = hits / got
        if abs(k - round(k)) < 1e-3 * k and round(k) != count:
            late = (" (counted from the weights after the update, where the contract asks "
                    "before it)" if when == "after" else "")
            k = round(k)
            short = ("" if count == 1 else
                     f" — an epoch's short last step of 1 sample, classified right, would be "
                     f"reported as 1/{k} = {1 / k:.4f} where one device reports 1")
            fail(f"the accuracy returned ({got:{fmt}}) is the {hits:.0f} correct "
                 f"prediction{'s' if hits != 1 else ''} of this step{late} divided by {k}, but "
                 f"the step holds {count} sample{'s' if count != 1 else ''} (split {split} over "
                 f"{len(slices)} replicas): {want_is}. {k} is a number fixed before the step "
                 f"ran — the nominal batch size, or a variable of the notebook — and steps are "
                 f"not all that size: this one holds {count}{short}.",
                 fix="Count the step's samples while it runs, over all the replicas (as part 1 "
                     "found its divisor), and divide the step's correct predictions by that.")
