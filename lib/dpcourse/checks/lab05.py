"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces, each checked by running it on fixed global batches from fixed
weights and comparing with one device without any strategy — two global batch sizes, one that
does not split evenly, two learning rates, and, when TensorFlow has a spare logical device, one
replica more than the lab's strategy (so a number tied to one batch size, one learning rate or 2
replicas fails):

* ``per_replica_loss(labels, logits, penalty=None)`` (part 1, this module; the lab's design
  decision) — the loss one replica differentiates, told no step size: its share of the step's
  mean, the divisor found while the step runs, and with ``penalty`` (a regularisation term,
  identical on every replica) the penalty counted once over the replicas. Checked inside
  ``strategy.run`` on even steps, on 3 + 2 (+ ...), on a step where a replica holds nothing
  (1 + 0, 1 + 1 + 0), with a penalty on 3 + 2 and 3 + 3 + 1, then in a loop built on it over
  an epoch whose last step is short, as written and in ``tf.function``
  (:func:`dpcourse.checks._lab05_epoch._check_epoch_once`). Named: a step-size parameter the
  step cannot fill, the replica's own slice size (N times too big), slice size × replicas
  (``compute_average_loss`` without ``global_batch_size``, or ``reduce_mean`` / N), the plain
  sum, a fixed divisor (a ``global_batch_size=`` or a notebook variable; a captured notebook
  strategy named), a Python number handed to ``all_reduce``, a static shape that is None once
  traced, a nan on the empty replica, the library's own answer, and with a penalty: added
  whole on every replica (N times), left out, divided by the step's count, divided by a fixed
  replica count, no ``penalty`` parameter. Refused once the numbers hold:
  ``tf.nn.compute_average_loss`` and ``tf.nn.scale_regularization_loss``, called or bound to
  another name (the part asks for the decision they hide).
* ``make_model_and_optimizer(strategy, lr, start=None)`` (part 2,
  :mod:`dpcourse.checks._lab05_model`) — variables created under the strategy given, plain SGD
  with the learning rate asked for, a mirrored model starting from ``start``'s current weights.
* ``distributed_train_step(strategy, model, optimizer, dist_batch)`` (part 3, told no batch
  size; the design decision: what each replica reports and how it is combined, on even,
  uneven and short last steps (1 + 0 (+ 0)); an accuracy divided by a nominal batch size, a
  nan from an empty replica's own mean, and a batch-size parameter are named;
  :mod:`dpcourse.checks._lab05_step` runs it and names a wrong update,
  :mod:`dpcourse.checks._lab05_reports` names a wrong reported loss or accuracy by the one wrong
  calculation that explains it on the split the step ran on).

Part 0's prediction, measured in part 4 (:mod:`dpcourse.checks._lab05_predict`): what replica
1 does in the last step of an epoch of 15 global batches and one sample — measured per replica
(samples held, whether step_fn ran, the loss it would compute) and explained after the
prediction, never before. The stretch: ``make_dist_dataset`` with ``distribute_datasets_from_function``
(:mod:`dpcourse.checks._lab05_pipeline`: order, the short last step kept, a global batch the
replicas do not divide handled by the learner's own decision, the dataset function called as on
2 workers), and ``train_epoch`` over an epoch whose last batch is padded with weight-0 samples
(:func:`dpcourse.checks._lab05_padded.check_padded_epoch`: the padding trained on, divided by
the padded size, unweighted, a replica's own weights; a step of padding alone must leave the
weights unchanged: nan (0/0), a tf.where guard's nan gradient under a finite loss, and a step
trained on its padding named). ``check_partial_batch_epoch`` (an epoch whose last step is short,
for a whole ``train_epoch``) stays for courses that ask for it; part 1's check runs its epoch.
What every runner shares is in :mod:`dpcourse.checks._lab05_common`. Every name the lab and the
tests use is importable from here.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""


from __future__ import annotations

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import (_HiddenSpy, _LibrarySpy, _captured_note, _close,
                                           _local, _refuse_library, distribute_slices, keras,
                                           pieces, reference_batch, required_positional,
                                           strategies_for, tf)
from dpcourse.checks._lab05_epoch import _check_epoch_once, check_partial_batch_epoch
from dpcourse.checks._lab05_model import (START_SEED, check_model_and_optimizer,
                                          start_model)
from dpcourse.checks._lab05_padded import check_padded_epoch, padded_epoch
from dpcourse.checks._lab05_pipeline import (PIPELINES, _expected_split, check_dataset_fn,
                                             stretch_data, stretch_global)
from dpcourse.checks._lab05_predict import (LAST_STEP_CHOICES, LAST_STEP_QUESTION,
                                            check_last_step_prediction,
                                            check_pipeline_prediction, epoch_size, last_step,
                                            last_step_sizes)
from dpcourse.checks._lab05_reports import _HOW
from dpcourse.checks._lab05_step import check_train_step, short_slices, uneven_slices

__all__ = ["check_per_replica_loss", "check_model_and_optimizer", "check_train_step",
           "reference_batch", "strategies_for", "check_dataset_fn", "check_partial_batch_epoch",
           "check_padded_epoch", "padded_epoch",
           "last_step", "last_step_sizes", "check_last_step_prediction",
           "check_pipeline_prediction", "epoch_size", "LAST_STEP_QUESTION", "LAST_STEP_CHOICES",
           "stretch_data", "stretch_global", "PENALTY", "uneven_slices", "start_model",
           "START_SEED", "PIPELINES", "short_slices", "keras", "tf", "_expected_split", "_HOW",
           "epoch_of_loss_results"]


@recorded
def check_per_replica_loss(per_replica_loss, strategy) -> None:
    """``per_replica_loss(labels, logits, penalty=None)`` is given no step size: inside
    ``strategy.run`` each replica's value must be its per-example losses summed and divided by
    the number of samples the whole step holds, which no replica sees on its own — on even
    steps, on uneven ones (3 + 2 (+ ...)), on a step where a replica holds no sample (1 + 0,
    1 + 1 + 0), on 2 and 3 replicas; with ``penalty`` (the same scalar on every replica) the
    replicas' values must hold it once per step. Then a training loop built on it runs an epoch
    whose last step is short, as written and wrapped in ``tf.function``, and must move the
    weights as one device does. The library's answer and ``tf.nn.compute_average_loss`` /
    ``tf.nn.scale_regularization_loss`` (called, or bound to another name) are refused: the part
    asks for the decision they hide."""
    __tracebackhide__ = True
    _refuse_library(per_replica_loss, "per_replica_loss")
    _refuse_a_step_size_parameter(per_replica_loss)
    # the calls that hide part 1's arithmetic are refused once everything else holds
    with _HiddenSpy(per_replica_loss, "per_replica_loss"):
        tried = []
        with _LibrarySpy("per_replica_loss"):
            # even slices first on every replica count, then 3 + 2 (+ ...), then a replica empty
            for split in ("even", "uneven", "empty"):
                for strat in strategies_for(strategy):
                    n = strat.num_replicas_in_sync
                    global_batch = {"even": 6 * n, "uneven": 2 * n + 1, "empty": n - 1}[split]
                    sizes = _check_loss_once(per_replica_loss, strat, global_batch)
                    tried.append(f"{global_batch} as {'+'.join(map(str, sizes))}")
        regularised = []   # after the library's answer had its chance to show, unregularised
        with _LibrarySpy("per_replica_loss"):
            for strat in strategies_for(strategy):
                regularised.append(_check_penalty_once(per_replica_loss, strat,
                                                       2 * strat.num_replicas_in_sync + 1))
        epochs = []
        with _LibrarySpy("per_replica_loss"):
            for strat in strategies_for(strategy):
                epochs.append(_check_epoch_of_loss(per_replica_loss, strat))
    passed("per_replica_loss: the replicas' values add up to the step's mean loss (tried "
           + ", ".join(tried) + "), hold a penalty once per step (" + ", ".join(regularised)
           + "), and an epoch built on it moves the weights as one device does, its short last "
             "step included, run as written and in tf.function (last steps "
           + ", ".join(epochs) + " replicas)")


def _refuse_a_step_size_parameter(per_replica_loss) -> None:
    """The contract hands no step size: a third parameter without a default (the old
    ``global_batch``) cannot be filled, and is named before anything runs."""
    __tracebackhide__ = True
    required = required_positional(per_replica_loss) or []
    if len(required) > 2:
        fail(f"per_replica_loss requires {len(required)} arguments ({', '.join(required)}), but "
             f"the step calls it with the labels and logits of this replica's slice only (and "
             f"penalty= on a regularised step): nothing hands it `{required[2]}`. In a training "
             f"loop traced once for an epoch, the step that is running is the only place that "
             f"knows how many samples it holds.",
             fix="Take (labels, logits, penalty=None) and find the step's size inside the "
                 "function.")


def _check_loss_once(per_replica_loss, strat, global_batch: int) -> list:
    __tracebackhide__ = True
    n = strat.num_replicas_in_sync
    _, y = reference_batch(max(global_batch, 1), seed=max(global_batch, 1))
    logits = np.random.default_rng(global_batch).normal(size=(len(y), 10)).astype(np.float32)
    # the step experimental_distribute_dataset makes of one batch of (y, logits)
    batch = distribute_slices(strat, (y, logits), pieces(global_batch, n))
    labels, lgs = _local(strat, batch[0]), _local(strat, batch[1])
    sizes = [len(lab) for lab in labels]
    split = "+".join(map(str, sizes))
    try:
        out = strat.run(lambda labels, lg: per_replica_loss(labels, lg), args=batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        if isinstance(exc, (AttributeError, TypeError, ValueError)) and (
                "'int' object" in first or "'float' object" in first):
            kind = "an int" if "'int' object" in first else "a float"
            fail(f"per_replica_loss raised {type(exc).__name__} on {n} replicas (a step of "
                 f"{global_batch} samples as {split}): {first} — {kind}, a Python number, "
                 f"reached the replica context's all_reduce, which combines tensors: values the "
                 f"replicas compute while the step runs. A number read in Python (a static "
                 f"shape, labels.shape[0]) is fixed when a step is traced, once for a whole "
                 f"epoch, and is None there: the last step's size is known only when its data "
                 f"arrives.",
                 fix="Hand all_reduce a tensor computed from the batch, not a Python number.")
        fail(f"per_replica_loss raised {type(exc).__name__} on {n} replicas (a step of "
             f"{global_batch} samples as {split}): "
             f"{str(exc).splitlines()[0] if str(exc) else ''}"
             + _captured_note(per_replica_loss, strat))
    got = _local(strat, out)
    for g in got:
        if g.shape != ():
            fail(f"per_replica_loss returned a tensor of shape {g.shape} on a replica, but a "
                 f"gradient tape needs one number (a scalar tensor) to differentiate.",
                 fix="Reduce the per-example losses to one number.")
    at = f"a step of {global_batch} samples as {split} on {n} replicas"
    for r, (g, lab, lg) in enumerate(zip(got, labels, lgs)):
        losses = mirrored.per_example_loss(lab, lg).numpy()
        right = losses.sum() / global_batch
        local = len(lab)
        if not np.isfinite(g):
            fail(f"per_replica_loss returned {float(g)} on replica {r}, which holds {local} of "
                 f"the {global_batch} samples ({at}): "
                 + (f"a replica with no sample divided by a count of its own, 0 — its own "
                    f"mean over no sample is 0/0 — and one nan in a loss makes every weight "
                    f"nan after apply_gradients, although that replica's gradient, a sum over "
                    f"no sample, is zero." if local == 0 else
                    "a loss that is not a finite number makes every weight nan."),
                 fix="Divide every replica's summed loss by a number that is the same on "
                     "every replica and never 0 while the step holds a sample.")
        if _close(g, right):
            continue
        if len(set(sizes)) > 1 and local and _close(g, losses.sum() / (local * n)):
            fail(f"per_replica_loss divided replica {r}'s summed loss by its own slice size "
                 f"times the replica count ({local} x {n} = {local * n}), but {at}: slice size x "
                 f"replicas is the step's sample count only when every slice is the same size, "
                 f"which a short last step breaks (compute_average_loss without "
                 f"global_batch_size, a Keras loss object's default reduction, and a local "
                 f"mean / N all assume it).",
                 fix="Divide by the step's sample count: no replica holds it alone, so it has "
                     "to be put together from every replica's count while the step runs.")
        if local and _close(g, losses.mean()):
            fail(f"per_replica_loss divided replica {r}'s summed loss by {local}, the number of "
                 f"samples that replica holds itself (its own mean), but the strategy sums the "
                 f"{n} replicas' gradients ({at}): their sum is then {n} means added, about {n} "
                 f"times the gradient of the step's mean.",
                 fix="Divide the summed loss by the whole step's count, the same number on "
                     "every replica.")
        if _close(g, losses.sum()) and local:
            fail(f"per_replica_loss returns the sum of the per-example losses, not divided by "
                 f"anything: the step's gradient is then {global_batch} times the gradient of "
                 f"its mean loss ({at}).", fix="Divide the sum by the step's sample count.")
        k = losses.sum() / float(g) if float(g) else 0.0
        if k > 0 and abs(k - round(k)) < 1e-3 and round(k) != global_batch:
            note = _captured_note(per_replica_loss, strat)
            fail(f"per_replica_loss divided the summed loss by {round(k)}, but {at}: "
                 + (f"a divisor fixed before the call holds for one step size and replica count "
                    f"only.{note}" if note else
                    "a number fixed before the call — written into the function (a "
                    "global_batch_size=), or a value captured from outside it (a variable of "
                    "the notebook, a size read when the loop was traced) — holds for one step "
                    "size and replica count only, and a short last step has a size of its "
                    "own."),
                 fix="Find the step's sample count while the step runs, from the replicas' "
                     "batches.")
        if not local:
            fail(f"per_replica_loss returned {float(g):.5f} on replica {r}, which holds no "
                 f"sample ({at}): its share of the step's mean is 0 (a sum over no sample), "
                 f"and any other constant there shifts every replica's loss.")
        fail(f"per_replica_loss returned {float(g):.5f} on replica {r} where {right:.5f} (its "
             f"summed per-example cross-entropies / the step's {global_batch} samples) was "
             f"expected ({at}): its summed loss was divided by {k:.4g}.")
    return sizes


def _loss_step(per_replica_loss, model, optimizer):
    """The step of the check's training loop built on the learner's loss (as lab 05's step is):
    the function ``strategy.run`` runs on each step."""
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = per_replica_loss(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return step_fn


def _check_epoch_of_loss(per_replica_loss, strat, outcome: dict | None = None) -> str:
    """A training loop built on the learner's loss (the check's, as lab 05's step is) runs the
    stretch's epoch of 100 samples, whose last step is short, as written and wrapped in
    ``tf.function``; its weights must be one device's. Returns the last step's split.
    ``outcome``: the two runs already made (:func:`epoch_of_loss_results`), judged alike."""
    __tracebackhide__ = True
    n = strat.num_replicas_in_sync

    def train_epoch(strategy, model, optimizer, dist_dataset):
        step_fn = _loss_step(per_replica_loss, model, optimizer)
        for batch in dist_dataset:
            strategy.run(step_fn, args=batch)

    _check_epoch_once(train_epoch, strat, stretch_global(n), who="per_replica_loss",
                      outcome=outcome)
    return f"{'+'.join(map(str, _expected_split(n, stretch_global(n))[-1]))} on {n}"


def epoch_of_loss_results(losses, strategy) -> dict:
    """For the tests' batch of per_replica_loss answers that run (right numbers, or refused
    after them): what :func:`check_per_replica_loss`'s epoch runs for each, on the lab's
    strategy and the one with a replica more, from one eager pass and one ``tf.function`` per
    replica count for the whole batch (see :func:`dpcourse.checks._lab05_epoch.epochs_of_losses`):
    ``{(loss, id(strat)): outcome}``, each outcome for ``_check_epoch_of_loss(loss, strat,
    outcome)`` to judge as it judges its own runs."""
    from dpcourse.checks._lab05_epoch import epochs_of_losses

    losses, out = list(losses), {}
    for strat in strategies_for(strategy):
        gb = stretch_global(strat.num_replicas_in_sync)
        makers = [lambda model, opt, fn=fn: _loss_step(fn, model, opt) for fn in losses]
        for fn, outcome in zip(losses, epochs_of_losses(makers, strat, gb)):
            out[(fn, id(strat))] = outcome
    return out


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
            params) < 3:
        fail(f"per_replica_loss takes {len(params)} arguments ({', '.join(params)}), but the "
             f"contract's regularised step calls it with penalty= as well: the check cannot "
             f"ask it for a regularised step's share.",
             fix="Add the parameter penalty=None and use it when it is given.")
    batch = distribute_slices(strat, (y, logits), pieces(global_batch, n))
    try:
        out = strat.run(lambda labels, lg: per_replica_loss(
            labels, lg, penalty=tf.constant(PENALTY)), args=batch)
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
        fail(f"{said}: every replica divided the penalty by the step's sample count "
             f"({global_batch}), as the per-example losses are divided — but the penalty is one "
             f"term of the "
             f"step, not a sum over its samples, and the strategy sums the {n} replicas' "
             f"gradients: {n}/{global_batch} of it reached the weights.",
             fix="Keep the penalty out of the division by the step's count: only the sum "
                 "over samples is divided by it.")
    k = n / counted if counted else 0.0
    if k > 1.5 and abs(k - round(k)) < 1e-3 and round(k) != n:
        fail(f"{said}: every replica added the penalty / {round(k)}, but this step runs on {n} "
             f"replicas — a number fixed before the call holds for one replica count only."
             + _captured_note(per_replica_loss, strat),
             fix="Divide by the number of replicas this step runs on.")
    fail(f"{said}, where one device's step holds it once: the replicas added "
         + ", ".join(f"{p / PENALTY:.3g}" for p in parts) + f" of it, which add up to "
         f"{counted:.3g}, not 1.")
