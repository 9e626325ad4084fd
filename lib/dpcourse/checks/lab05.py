"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces, each checked by running it on fixed global batches from fixed
weights and comparing with one device without any strategy — two global batch sizes, one that
does not split evenly, two learning rates, and, when TensorFlow has a spare logical device, one
replica more than the lab's strategy (so a number tied to one batch size, one learning rate or 2
replicas fails):

* ``per_replica_loss(labels, logits, global_batch, weights=None)`` (part 1, this module) — the
  loss one replica differentiates: its share of the step's mean, or with ``weights`` of the
  step's weighted mean Σ wℓ / Σ w, whose total weight no replica is given. Checked inside
  ``strategy.run`` on even steps, on 3 + 2 (+ ...), and weighted on 3 + 2 and 3 + 3 + 1. Named:
  the per-replica ``reduce_mean`` (N times too big), slice size × replicas
  (``compute_average_loss`` without ``global_batch_size``, or ``reduce_mean`` / N), the plain
  sum, a fixed divisor (a captured notebook strategy named), the library's own answer, and on
  the weighted step the weights ignored, the weighted sum over the sample count, a replica's own
  weighted mean, its own total × N, the whole step's weighted mean on every replica, no
  ``weights`` parameter.
* ``make_model_and_optimizer(strategy, lr, start=None)`` (part 2,
  :mod:`dpcourse.checks._lab05_model`) — variables created under the strategy given, plain SGD
  with the learning rate asked for, a mirrored model starting from ``start``'s current weights.
* ``distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)`` (part 3, the
  design decision: what each replica reports and how it is combined;
  :mod:`dpcourse.checks._lab05_step` runs it and names a wrong update,
  :mod:`dpcourse.checks._lab05_reports` names a wrong reported loss or accuracy by the one wrong
  calculation that explains it on the split the step ran on).

Part 4's prediction (:mod:`dpcourse.checks._lab05_predict`): what replica 1 does in the last
step of an epoch of 15 global batches and one sample — measured (step_fn runs on an empty batch:
its reduce_mean is nan, its compute_average_loss share 0) and explained, TF's ⌈b/N⌉ rule
included, never stated before the prediction. The stretch: ``make_dist_dataset`` with
``distribute_datasets_from_function`` (:mod:`dpcourse.checks._lab05_pipeline`: order, the short
last step kept, an indivisible global batch refused by the learner's own ValueError, the
dataset function called as on 2 workers), and ``train_epoch`` over an epoch whose last step is
4 + 0 (12 + 12 + 4 on 3) (:mod:`dpcourse.checks._lab05_epoch`: a fixed divisor, the last step
skipped, and a replica's own slice × N — ``compute_average_loss`` left to count the slice, or
each replica's ``reduce_mean`` / N, told apart by the loss each replica differentiated).
What every runner shares is in :mod:`dpcourse.checks._lab05_common`. Every name the lab and the
tests use is importable from here.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""


from __future__ import annotations

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import (_LibrarySpy, _captured_note, _close, _local,
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
           "stretch_data", "stretch_global", "step_weights", "uneven_slices", "start_model",
           "START_SEED", "PIPELINES", "keras", "tf", "_expected_split", "_HOW"]


@recorded
def check_per_replica_loss(per_replica_loss, strategy) -> None:
    """Inside ``strategy.run``, each replica's loss must be its per-example losses summed and
    divided by the *global* batch size — the number of samples the whole step holds, given as
    ``global_batch`` — also when the slices differ in size (a global batch that does not split
    evenly, as a partial last batch does); and with ``weights``, its weighted sum divided by the
    whole step's total weight, which it is not given."""
    __tracebackhide__ = True
    _refuse_library(per_replica_loss, "per_replica_loss")
    tried = []
    with _LibrarySpy("per_replica_loss"):
        # even slices first on every replica count, then 3 + 2 (+ ...)
        for even in (True, False):
            for strat in strategies_for(strategy):
                n = strat.num_replicas_in_sync
                global_batch = 6 * n if even else 2 * n + 1
                sizes = _check_loss_once(per_replica_loss, strat, global_batch)
                tried.append(f"{global_batch} as {'+'.join(map(str, sizes))}")
    weighted = []   # after the library's answer had its chance to show, unweighted
    with _LibrarySpy("per_replica_loss"):
        for strat in strategies_for(strategy):
            n = strat.num_replicas_in_sync
            global_batch = 2 * n + 1
            total = _check_weighted_loss_once(per_replica_loss, strat, global_batch)
            weighted.append(f"{global_batch} samples of total weight {total:.3g} on {n}")
    passed("per_replica_loss divides each replica's summed loss by the global batch (tried "
           + ", ".join(tried) + "), and a weighted step's weighted sum by the whole step's "
           "total weight, summed over the replicas (" + ", ".join(weighted) + ")")


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


def step_weights(global_batch: int) -> np.ndarray:
    """The per-sample weights of the weighted check's step: fixed, between 0.2 and 2, whose total
    is not the sample count (a weighted sum divided by the count shows)."""
    return np.random.default_rng(100 + global_batch).uniform(
        0.2, 2.0, size=global_batch).astype(np.float32)


def _check_weighted_loss_once(per_replica_loss, strat, global_batch: int) -> float:
    """With ``weights`` (this replica's samples' weights), each replica's value must be its
    weighted sum of per-example losses divided by the total weight of the *whole* step, which no
    replica is given: the replicas' own totals, added over the replicas."""
    __tracebackhide__ = True
    import inspect

    n = strat.num_replicas_in_sync
    _, y = reference_batch(global_batch, seed=global_batch)
    logits = np.random.default_rng(global_batch).normal(size=(global_batch, 10)).astype(np.float32)
    w = step_weights(global_batch)
    total = float(w.sum())
    try:
        params = inspect.signature(getattr(per_replica_loss, "func", per_replica_loss)).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and "weights" not in params and not any(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()) and len(
            params) < 4:
        fail(f"per_replica_loss takes {len(params)} arguments ({', '.join(params)}), but the "
             f"contract's weighted step calls it with a fourth, weights=: the check cannot ask "
             f"it for a weighted step's share.",
             fix="Add the parameter weights=None and use it when it is given.")
    batch = next(iter(strat.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((y, logits, w)).batch(global_batch))))
    try:
        out = strat.run(lambda labels, lg, wt: per_replica_loss(labels, lg, global_batch,
                                                                weights=wt), args=batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        fail(f"per_replica_loss raised {type(exc).__name__} on {n} replicas with weights: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}"
             + _captured_note(per_replica_loss, strat))
    got = _local(strat, out)
    labels, lgs, ws = (_local(strat, batch[i]) for i in range(3))
    sizes = [len(lab) for lab in labels]
    split = "+".join(map(str, sizes))
    at = (f"(a step of {global_batch} samples as {split} on {n} replicas, weights "
          f"totalling {total:.3f})")
    for g in got:
        if g.shape != ():
            fail(f"per_replica_loss returned a tensor of shape {g.shape} on a replica with "
                 f"weights {at}, but a gradient tape needs one number to differentiate.",
                 fix="Reduce the weighted losses to one number.")
    losses = [mirrored.per_example_loss(lab, lg).numpy() for lab, lg in zip(labels, lgs)]
    weighted = [float((wt * ls).sum()) for wt, ls in zip(ws, losses)]
    own = [float(wt.sum()) for wt in ws]
    whole = sum(weighted) / total
    for r, g in enumerate(got):
        right = weighted[r] / total
        if _close(g, right):
            continue
        if _close(g, losses[r].sum() / global_batch):
            fail(f"with weights, replica {r} returned its unweighted summed loss / "
                 f"{global_batch} {at}: the weights were ignored, so a sample of weight 0.2 "
                 f"pulled the step as hard as one of weight 2 — the loss of an unweighted step.",
                 fix="Weigh each sample's loss by its weight, and divide by the step's total "
                     "weight.")
        if _close(g, weighted[r] / global_batch):
            fail(f"with weights, replica {r} returned its weighted sum / {global_batch}, the "
                 f"step's sample count {at} — as compute_average_loss does with sample_weight — "
                 f"but the weighted mean divides the weighted sum by the total weight, "
                 f"{total:.3f} here, not by the number of samples: the step came out "
                 f"{total / global_batch:.3f} times the weighted mean's.",
                 fix="Divide by the total weight of the whole step.")
        if len(set(sizes)) > 1 and own[r] and _close(g, weighted[r] / own[r]):
            fail(f"with weights, replica {r} returned its own weighted mean (its weighted sum "
                 f"/ its own total weight {own[r]:.3f}) {at}: the strategy adds the {n} "
                 f"replicas' gradients, so the step is {n} weighted means added, not the weighted "
                 f"mean of the step.",
                 fix="Divide by the total weight of the whole step, which the replicas hold "
                     "between them.")
        if own[r] and _close(g, weighted[r] / (own[r] * n)):
            fail(f"with weights, replica {r} divided its weighted sum by its own total weight "
                 f"× {n} replicas ({own[r]:.3f} × {n} = {own[r] * n:.3f}) {at}, but the step's "
                 f"total weight is {total:.3f}: the replicas' slices do not carry the same "
                 f"weight, so one replica's total × N is not the whole step's.",
                 fix="Add the replicas' own totals together (inside strategy.run, the replica "
                     "context can).")
        if _close(g, whole):
            fail(f"with weights, every replica returned the whole step's weighted mean "
                 f"({whole:.5f}) {at}: the strategy adds the {n} replicas' gradients, so the "
                 f"step is {n} times the weighted mean's.",
                 fix="Return this replica's share: its own weighted sum over the step's total "
                     "weight.")
        fail(f"with weights, replica {r} returned {float(g):.5f} {at}, where its share of the "
             f"step's weighted mean, its weighted sum {weighted[r]:.4f} / the step's total "
             f"weight {total:.3f} = {right:.5f}, was expected.")
    return total
