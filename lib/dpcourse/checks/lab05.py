"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces, each checked by running it on fixed global batches from fixed
weights and comparing with one device without any strategy — two global batch sizes, one that
does not split evenly, two learning rates, and, when TensorFlow has a spare logical device, one
replica more than the lab's strategy (so a number tied to one batch size, one learning rate or 2
replicas fails):

* ``per_replica_loss(labels, logits, global_batch, penalty=None)`` (part 1, this module) — the
  loss one replica differentiates: its share of the step's mean, and with ``penalty`` (a
  regularisation term, identical on every replica) the step's mean plus the penalty counted
  once over the replicas. Checked inside ``strategy.run`` on even steps, on 3 + 2 (+ ...), and
  with a penalty on 3 + 2 and 3 + 3 + 1. Named: the per-replica ``reduce_mean`` (N times too
  big), slice size × replicas (``compute_average_loss`` without ``global_batch_size``, or
  ``reduce_mean`` / N), the plain sum, a fixed divisor (a captured notebook strategy named),
  the library's own answer, and with a penalty: added whole on every replica (N times), left
  out, divided by the global batch, divided by a fixed replica count, no ``penalty``
  parameter. Refused once the numbers hold: ``tf.nn.compute_average_loss`` and
  ``tf.nn.scale_regularization_loss``, called or bound to another name (the part asks for the
  arithmetic they hide).
* ``make_model_and_optimizer(strategy, lr, start=None)`` (part 2,
  :mod:`dpcourse.checks._lab05_model`) — variables created under the strategy given, plain SGD
  with the learning rate asked for, a mirrored model starting from ``start``'s current weights.
* ``distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)`` (part 3, the
  design decision: what each replica reports and how it is combined;
  :mod:`dpcourse.checks._lab05_step` runs it and names a wrong update,
  :mod:`dpcourse.checks._lab05_reports` names a wrong reported loss or accuracy by the one wrong
  calculation that explains it on the split the step ran on).

Part 4's prediction (:mod:`dpcourse.checks._lab05_predict`): what replica 1 does in the last
step of an epoch of 15 global batches and one sample — measured per replica (samples held,
whether step_fn ran, the loss it would compute) and explained after the prediction, never
before. The stretch: ``make_dist_dataset`` with ``distribute_datasets_from_function``
(:mod:`dpcourse.checks._lab05_pipeline`: order, the short last step kept, a global batch the
replicas do not divide handled by the learner's own decision, the dataset function called as on
2 workers), and ``train_epoch`` over an epoch whose last step is short
(:mod:`dpcourse.checks._lab05_epoch`: a fixed divisor, the last step skipped, and a divisor
tied to a replica's own slice, told apart by the loss each replica differentiated).
What every runner shares is in :mod:`dpcourse.checks._lab05_common`. Every name the lab and the
tests use is importable from here.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""


from __future__ import annotations

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import (_HiddenSpy, _LibrarySpy, _captured_note, _close,
                                           _local,
                                           _refuse_library, keras, reference_batch,
                                           strategies_for, tf)
from dpcourse.checks._lab05_epoch import check_partial_batch_epoch
from dpcourse.checks._lab05_model import (START_SEED, check_model_and_optimizer,
                                          start_model)
from dpcourse.checks._lab05_pipeline import (PIPELINES, _expected_split, check_dataset_fn,
                                             stretch_data, stretch_global)
from dpcourse.checks._lab05_predict import (LAST_STEP_CHOICES, LAST_STEP_QUESTION,
                                            check_last_step_prediction,
                                            check_pipeline_prediction, epoch_size, last_step,
                                            last_step_sizes)
from dpcourse.checks._lab05_reports import _HOW
from dpcourse.checks._lab05_step import check_train_step, uneven_slices

__all__ = ["check_per_replica_loss", "check_model_and_optimizer", "check_train_step",
           "reference_batch", "strategies_for", "check_dataset_fn", "check_partial_batch_epoch",
           "last_step", "last_step_sizes", "check_last_step_prediction",
           "check_pipeline_prediction", "epoch_size", "LAST_STEP_QUESTION", "LAST_STEP_CHOICES",
           "stretch_data", "stretch_global", "PENALTY", "uneven_slices", "start_model",
           "START_SEED", "PIPELINES", "keras", "tf", "_expected_split", "_HOW"]


@recorded
def check_per_replica_loss(per_replica_loss, strategy) -> None:
    """Inside ``strategy.run``, each replica's loss must be its per-example losses summed and
    divided by the *global* batch size — the number of samples the whole step holds, given as
    ``global_batch`` — also when the slices differ in size (a global batch that does not split
    evenly, as a partial last batch does); and with ``penalty`` (a regularisation term, the same
    on every replica) the replicas' values must hold it once per step. The library's answer
    and ``tf.nn.compute_average_loss`` / ``tf.nn.scale_regularization_loss`` (called, or bound
    to another name) are refused: the part asks for the arithmetic they hide."""
    __tracebackhide__ = True
    _refuse_library(per_replica_loss, "per_replica_loss")
    # the calls that hide part 1's arithmetic are refused once everything else holds
    with _HiddenSpy(per_replica_loss, "per_replica_loss"):
        tried = []
        with _LibrarySpy("per_replica_loss"):
            # even slices first on every replica count, then 3 + 2 (+ ...)
            for even in (True, False):
                for strat in strategies_for(strategy):
                    n = strat.num_replicas_in_sync
                    global_batch = 6 * n if even else 2 * n + 1
                    sizes = _check_loss_once(per_replica_loss, strat, global_batch)
                    tried.append(f"{global_batch} as {'+'.join(map(str, sizes))}")
        regularised = []   # after the library's answer had its chance to show, unregularised
        with _LibrarySpy("per_replica_loss"):
            for strat in strategies_for(strategy):
                regularised.append(_check_penalty_once(per_replica_loss, strat,
                                                       2 * strat.num_replicas_in_sync + 1))
    passed("per_replica_loss divides each replica's summed loss by the global batch (tried "
           + ", ".join(tried) + "), and the replicas' values hold a penalty once per step ("
           + ", ".join(regularised) + ")")


def _check_loss_once(per_replica_loss, strat, global_batch: int) -> list:
    __tracebackhide__ = True
    n = strat.num_replicas_in_sync
    _, y = reference_batch(global_batch, seed=global_batch)
    logits = np.random.default_rng(global_batch).normal(size=(global_batch, 10)).astype(np.float32)
    batch = next(iter(strat.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((y, logits)).batch(global_batch))))
    try:
        out = strat.run(lambda labels, lg: per_replica_loss(labels, lg, global_batch),
                        args=batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        fail(f"per_replica_loss raised {type(exc).__name__} on {n} replicas: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}"
             + _captured_note(per_replica_loss, strat))
    got = _local(strat, out)
    labels, lgs = _local(strat, batch[0]), _local(strat, batch[1])
    sizes = [len(lab) for lab in labels]
    for g, lab, lg in zip(got, labels, lgs):
        if g.shape != ():
            fail(f"per_replica_loss returned a tensor of shape {g.shape} on a replica, but a "
                 f"gradient tape needs one number (a scalar tensor) to differentiate.",
                 fix="Reduce the per-example losses to one number.")
    for g, lab, lg in zip(got, labels, lgs):
        losses = mirrored.per_example_loss(lab, lg).numpy()
        right = losses.sum() / global_batch
        if _close(g, right):
            continue
        local = len(lab)
        if len(set(sizes)) > 1 and local and _close(g, losses.sum() / (local * n)):
            fail(f"per_replica_loss divided a replica's summed loss by its own slice size times "
                 f"the replica count ({local} x {n} = {local * n}), but this step's "
                 f"{global_batch} samples arrived in slices of {'+'.join(map(str, sizes))}: "
                 f"slice size x replicas is the global batch only when every slice is the same "
                 f"size, which a partial last batch breaks (compute_average_loss without "
                 f"global_batch_size, and a local mean / N, both assume it).",
                 fix="Divide by the step's sample count, which the function is given.")
        if local and _close(g, losses.mean()):
            fail(f"per_replica_loss returned the mean over the replica's own {local} examples "
                 f"(reduce_mean), but the strategy sums the {n} replicas' gradients: their sum "
                 f"is then {n} means added, {n} times the gradient of the step's mean.",
                 fix=f"Divide the summed loss by the whole step's count ({global_batch}).")
        if _close(g, losses.sum()):
            fail(f"per_replica_loss returns the sum of the per-example losses, not divided by "
                 f"anything: the step's gradient is then {global_batch} times the gradient of "
                 f"its mean loss.", fix="Divide the sum by the step's sample count.")
        k = losses.sum() / float(g) if float(g) else 0.0
        if k > 0 and abs(k - round(k)) < 1e-3 and round(k) != global_batch:
            note = _captured_note(per_replica_loss, strat)
            fail(f"per_replica_loss divided the summed loss by {round(k)}, but the global batch "
                 f"here is {global_batch} on {n} replicas: "
                 + (f"a divisor fixed before the call holds for one batch size and replica count "
                    f"only.{note}" if note else
                    "a number fixed before the call — written into the function, or a value "
                    "captured from outside it (a variable of the notebook) — holds for one batch "
                    "size and replica count only."),
                 fix="Divide by the global_batch argument.")
        fail(f"per_replica_loss returned {float(g):.5f} where {right:.5f} (sum of the replica's "
             f"per-example cross-entropies / global batch {global_batch}) was expected.")
    return sizes


PENALTY = 0.75   # the regularisation term the penalty check hands every replica


def _check_penalty_once(per_replica_loss, strat, global_batch: int) -> str:
    """With ``penalty`` (the step's regularisation term, the same scalar on every replica), the
    replicas' values must add up to the step's mean loss plus the penalty counted once: each
    replica's value minus its share of the mean (its summed loss / global batch, what it returns
    without a penalty) is its part of the penalty, and those parts must add up to the penalty.
    Any split of it does: every replica's copy of the penalty has the same gradient."""
    __tracebackhide__ = True
    import inspect

    n = strat.num_replicas_in_sync
    _, y = reference_batch(global_batch, seed=global_batch)
    logits = np.random.default_rng(global_batch).normal(size=(global_batch, 10)).astype(np.float32)
    try:
        params = inspect.signature(getattr(per_replica_loss, "func", per_replica_loss)).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and "penalty" not in params and not any(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()) and len(
            params) < 4:
        fail(f"per_replica_loss takes {len(params)} arguments ({', '.join(params)}), but the "
             f"contract's regularised step calls it with a fourth, penalty=: the check cannot "
             f"ask it for a regularised step's share.",
             fix="Add the parameter penalty=None and use it when it is given.")
    batch = next(iter(strat.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((y, logits)).batch(global_batch))))
    try:
        out = strat.run(lambda labels, lg: per_replica_loss(
            labels, lg, global_batch, penalty=tf.constant(PENALTY)), args=batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        fail(f"per_replica_loss raised {type(exc).__name__} on {n} replicas with a penalty: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}"
             + _captured_note(per_replica_loss, strat))
    got = _local(strat, out)
    labels, lgs = _local(strat, batch[0]), _local(strat, batch[1])
    sizes = [len(lab) for lab in labels]
    split = "+".join(map(str, sizes))
    at = f"(a step of {global_batch} samples as {split} on {n} replicas, penalty {PENALTY})"
    for g in got:
        if g.shape != ():
            fail(f"per_replica_loss returned a tensor of shape {g.shape} on a replica with a "
                 f"penalty {at}, but a gradient tape needs one number to differentiate.",
                 fix="Reduce the loss and the penalty to one number.")
    shares = [float(mirrored.per_example_loss(lab, lg).numpy().sum()) / global_batch
              for lab, lg in zip(labels, lgs)]
    parts = [float(g) - share for g, share in zip(got, shares)]
    counted = sum(parts) / PENALTY   # how many times the step's gradient holds the penalty's
    if abs(counted - 1) < 1e-3:
        return f"{global_batch} as {split} on {n}"
    said = (f"the {n} replicas' values add up to the step's mean loss plus {counted:.3g} x the "
            f"penalty {at}")
    if abs(counted - n) < 1e-3:
        fail(f"{said}: every replica added the whole penalty, and the strategy sums the {n} "
             f"replicas' gradients, so the regularisation pulled the weights {n} times as hard "
             f"as on one device.",
             fix="The penalty is the same on every replica, not split over them the way the "
                 "samples are: count it once per step, over all the replicas together.")
    if abs(counted) < 1e-3:
        fail(f"{said}: the penalty was left out, so the step is the unregularised one.",
             fix="Add the penalty to the loss, counted once per step over all the replicas.")
    if abs(counted - n / global_batch) < 1e-3:
        fail(f"{said}: every replica divided the penalty by the global batch ({global_batch}), "
             f"as the per-example losses are divided — but the penalty is one term of the "
             f"step, not a sum over its samples, and the strategy sums the {n} replicas' "
             f"gradients: {n}/{global_batch} of it reached the weights.",
             fix="Keep the penalty out of the division by the global batch: only the sum over "
                 "samples is divided by it.")
    k = n / counted if counted else 0.0
    if k > 1.5 and abs(k - round(k)) < 1e-3 and round(k) != n:
        fail(f"{said}: every replica added the penalty / {round(k)}, but this step runs on {n} "
             f"replicas — a number fixed before the call holds for one replica count only."
             + _captured_note(per_replica_loss, strat),
             fix="Divide by the number of replicas this step runs on.")
    fail(f"{said}, where one device's step holds it once: the replicas added "
         + ", ".join(f"{p / PENALTY:.3g}" for p in parts) + f" of it, which add up to "
         f"{counted:.3g}, not 1.")
