"""Checks for lab02: DataParallel's step by hand (scatter, replicas, gather, summed gradients).

The learner writes ``scatter(X, n_devices)``, ``gather(outputs)`` and
``dp_forward_backward(model, X, y, n_devices)``; each check runs them on small inputs, compares
with the reference (``dpcourse.dp`` and the plain module on the whole batch) and, when the
numbers match a known wrong answer, names it. tests/test_lab02_checks.py proves each one.

This module holds the predictions and the names; the checks are in
:mod:`~dpcourse.checks._lab02_scatter` (§1-§2), :mod:`~dpcourse.checks._lab02_step` (§3-§4),
:mod:`~dpcourse.checks._lab02_state` (part 5: what survives a replica) and
:mod:`~dpcourse.checks._lab02_threads` (the stretch).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .. import dp as reference
from ._lab02_scatter import CHUNK_SIZES, check_gather, check_scatter
from ._lab02_state import (HELD_CHOICES, PEAK_CHOICES, STATE_CASE,
                           check_dp_state, check_held_prediction, check_state_predictions,
                           held_grad_after_dp, state_after_dp, state_predictions_measured)
from ._lab02_step import (CALLS_CASE, COUNT_CASE, SampleCounter, calls_after_dp,
                          check_dp_forward_backward, counted_after_dp)
from ._lab02_threads import _check_no_thread_left, check_threaded_apply


__all__ = ["check_scatter", "check_gather", "check_dp_forward_backward",
           "check_threaded_apply", "check_prediction", "copy_share", "CHUNK_SIZES",
           "idle_devices", "idle_batch_sizes", "check_idle_prediction",
           "SampleCounter", "counted_after_dp", "CALLS_CASE",
           "calls_after_dp", "STATE_CASE", "state_after_dp",
           "check_dp_state", "HELD_CHOICES", "held_grad_after_dp", "check_held_prediction",
           "PEAK_CHOICES", "state_predictions_measured",
           "check_state_predictions"]


# --- predict, then measure: one copy's share of the gradient --------------------------------

def copy_share(n_devices: int = 4, batch: int = 10, seed: int = 0) -> float:
    """DataParallel with plain copies on a batch of ``batch`` identical samples, cut as
    ``torch.chunk`` cuts it (10 on 4: 3, 3, 3, 1), one mean loss over the gathered batch: the
    last copy's gradient as a fraction of the whole batch's (its projection on it, over all
    parameters)."""
    from ..models import SmallCNN

    torch.manual_seed(seed)
    model = SmallCNN(width=8)
    X = torch.randn(1, 3, 32, 32).repeat(batch, 1, 1, 1)
    y = torch.randint(0, 10, (1,)).repeat(batch)
    chunks = list(torch.chunk(X, n_devices))
    copies = [copy.deepcopy(model) for _ in chunks]
    outputs = reference.parallel_apply(copies, chunks)
    F.cross_entropy(torch.cat(outputs), y).backward()
    F.cross_entropy(model(X), y).backward()
    whole = torch.cat([p.grad.flatten() for p in model.parameters()])
    mine = torch.cat([p.grad.flatten() for p in copies[-1].parameters()])
    return float(mine @ whole / (whole @ whole))


def check_prediction(guess, n_devices: int = 4, batch: int = 10) -> None:
    """Measure :func:`copy_share` and compare it with the learner's prediction: right or wrong,
    the measured value, and a question to take into part 4. Why it is the last chunk's size
    over the batch's waits for part 4's pass line (``_lab02_step.WHY_RULE``): the rule that combines
    the copies' gradients is part 4's to work out from this measurement. Never raises for a
    wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    sizes = [len(c) for c in torch.chunk(torch.empty(batch), n_devices)]
    measured = round(copy_share(n_devices, batch), 2)
    reveal(guess, measured, close=abs(float(guess.value) - measured) <= 0.02, explanation=(
        f"A question to take into part 4: the last copy saw {sizes[-1]} of the {batch} "
        f"samples, on one of {n_devices} devices. What in the one loss makes its gradient "
        f"{measured:g} of the whole batch's, rather than 1 (all it saw) or 1/{n_devices} (one "
        f"device of {n_devices})?"))


# --- predict, then measure: the scatter choice's consequence -------------------------------

IDLE_CASE = (32, 8)  # every batch size from 1 to 32, on 8 devices


def idle_devices(scatter, b: int, n: int = IDLE_CASE[1]) -> tuple[int, list]:
    """Run the learner's ``scatter`` on a batch of ``b`` on ``n`` devices: (devices given no
    sample, the chunk sizes)."""
    X = torch.arange(b, dtype=torch.float32).reshape(b, 1)
    sizes = [c.shape[0] for c in scatter(X, n)]
    return n - len(sizes), sizes


def idle_batch_sizes(scatter, top: int = IDLE_CASE[0], n: int = IDLE_CASE[1]) -> list[int]:
    """The batch sizes 1..``top`` for which the learner's ``scatter`` leaves at least one of
    ``n`` devices without a sample."""
    return [b for b in range(1, top + 1) if idle_devices(scatter, b, n)[0] > 0]


def _runs(values: list[int]) -> str:
    """[1, 2, 3, 9, 10] -> '1-3, 9-10'."""
    out, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ", ".join(out) or "none"


def check_idle_prediction(guess, scatter, sizes: str | None = None) -> None:
    """Compare the predicted count of batch sizes 1..32 that leave a device idle on 8 devices,
    under the learner's own scatter, with the count; say why, and what the choice bought.
    Never raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    top, n = IDLE_CASE
    idle = idle_batch_sizes(scatter)
    rule = [b for b in range(1, top + 1) if -(-b // -(-b // n)) < n]  # DataParallel's fill
    why = (f"Your scatter leaves a device idle for {len(idle)} of the {top} batch sizes "
           f"({_runs(idle)}). ")
    if len(idle) > n - 1:
        why += (f"Below {n} samples some device must idle whatever the rule; above it, filling "
                f"each device with ceil(B/{n}) samples in turn uses the batch up early whenever "
                f"the last chunk would be short by a whole chunk: once the chunk size is c, only "
                f"B > {n - 1}c feeds all {n} devices, so the idle stretch after each multiple "
                f"of {n} shrinks by one ({_runs(rule[n - 1:])}). ")
    else:
        why += (f"Only a batch smaller than the {n} devices starves one: a balanced split feeds "
                f"every device once B >= {n}, where DataParallel's rule would idle one for "
                f"{len(rule)} sizes ({_runs(rule)}). ")
    why += ("Either way the busiest device holds ceil(B/8) samples and the step waits for it, so "
            "the step takes as long: the balanced rule spreads the same work over more devices, "
            "DataParallel's leaves the spare ones idle and copies the model to fewer.")
    reveal(guess, len(idle), close=guess.value == len(idle), explanation=why)
