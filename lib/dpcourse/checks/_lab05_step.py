"""Lab 05 part 3: ``distributed_train_step(strategy, model, optimizer, dist_batch)``. One step of
the learner's loop from fixed weights on a fixed step must give one device's result: the same
updated weights, and the step's mean loss and accuracy before the update. The step is told no
batch size: tried on two step sizes and two learning rates, on the lab's strategy and one with a
replica more, then on a step split unevenly (6 + 2 (+ 2)), then on an epoch's short last step (1
sample: 1 + 0 (+ 0)), where an accuracy divided by the nominal batch size reports 1 of 64. A wrong
update is named here by its size (N times, 1/N, a fixed divisor, slice size x N); a wrong
reported value is named by :mod:`dpcourse.checks._lab05_reports`.

Imported by :mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import collections.abc
import functools

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import (_LibrarySpy, _captured_note, _close, _refuse_library,
                                           distribute_slices, keras, reference_batch,
                                           required_positional, strategies_for)
from dpcourse.checks._lab05_model import _check_lr, _check_sgd, _other_lr, _outside_scope
from dpcourse.checks._lab05_reports import _Ambiguous, judge_reports


@recorded
def check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int = 64, lr: float = 0.1) -> None:
    """One step of the learner's loop from fixed weights on a fixed global batch must give the
    single-device result: the same updated weights, the mean loss and the accuracy of the batch
    before the update. Tried with ``global_batch`` and three quarters of it, on the lab's
    strategy and (when TF has a spare device) on one with a replica more; the second batch with
    another learning rate; then a step split unevenly. A wrong reported value is named only
    when one wrong calculation explains it; where several coincide on one split, the next split
    decides. Then the epoch's short last step: 1 sample that the reference model classifies
    right, on 1 + 0 (+ 0) replicas — one device reports accuracy 1 there."""
    __tracebackhide__ = True
    _refuse_library(distributed_train_step, "distributed_train_step")
    _refuse_a_batch_size_parameter(distributed_train_step)
    tried, unsure = [], None
    with _LibrarySpy("per_replica_loss"):
        strategies = strategies_for(strategy)
        runs = []
        for strat in strategies:
            n = strat.num_replicas_in_sync
            # multiples of n: an even split first, where the scaling mistakes show as factors of n
            for gb, step_lr in ((global_batch // n * n, lr),
                                ((global_batch * 3 // 4) // n * n, _other_lr(lr))):
                runs.append((strat, gb, step_lr, None, f"{gb} on {n}"))
        # then a short step whose slices differ in size (6 + 2 (+ 2)), as a last step's can:
        # a mean of the replicas' own means is the batch's mean only when the slices are equal
        for strat in strategies:
            slices = uneven_slices(strat.num_replicas_in_sync)
            runs.append((strat, sum(len(s) for s in slices), lr, slices,
                         "+".join(str(len(s)) for s in slices) + f" on {len(slices)}"))
        # then an epoch's short last step: 1 sample, the other replicas empty (what
        # experimental_distribute_dataset hands them); its accuracy is 1 on one device
        for strat in strategies:
            slices = short_slices(strat.num_replicas_in_sync)
            runs.append((strat, 1, lr, slices,
                         "+".join(str(len(s)) for s in slices) + f" on {len(slices)}"))
        for strat, gb, step_lr, slices, label in runs:
            try:
                _check_step_once(distributed_train_step, make_model_and_optimizer, strat, gb,
                                 step_lr, slices=slices)
            except _Ambiguous as amb:
                unsure = unsure or amb
            tried.append(label)
    if unsure is not None:
        fail(unsure.sentence)
    passed(f"one step == one device on the step's samples (weights, loss, accuracy; tried "
           + ", ".join(tried) + f" replicas, lr {lr:g} and {_other_lr(lr):g})")


def _refuse_a_batch_size_parameter(distributed_train_step) -> None:
    """The contract hands no batch size: a fifth parameter without a default (the old
    ``global_batch``) cannot be filled, and is named before anything runs."""
    __tracebackhide__ = True
    required = required_positional(distributed_train_step) or []
    if len(required) > 4:
        fail(f"distributed_train_step requires {len(required)} arguments "
             f"({', '.join(required)}), but a training loop calls it with (strategy, model, "
             f"optimizer, dist_batch) only: nothing hands it `{required[4]}`. The loop hands it "
             f"each step of an epoch, the short last one too, and only the step that is running "
             f"holds its samples.",
             fix="Take (strategy, model, optimizer, dist_batch) and find what the step holds "
                 "inside it.")


def short_slices(n: int, seed: int = 5) -> list:
    """Indices into ``reference_batch(64, seed)`` for an epoch's short last step of 1 sample on
    ``n`` replicas, split as ``experimental_distribute_dataset`` splits it (1 + 0 (+ 0)): a
    sample the reference model (``build_keras_cnn(seed=3)``) classifies right, so that one device
    reports accuracy 1 and a count divided by any other number is seen."""
    hits = np.flatnonzero(_reference_hits(seed))
    return [hits[:1]] + [np.arange(0) for _ in range(n - 1)]


def uneven_slices(n: int, seed: int = 5) -> list:
    """Indices into ``reference_batch(64, seed)`` for a step split unevenly over ``n`` replicas:
    replica 0 holds 6 samples, each other replica 2, and every replica's slice holds exactly one
    sample the reference model (``build_keras_cnn(seed=3)``) classifies right — so that neither
    the mean of the replicas' loss means nor the mean of their accuracies is the batch's."""
    hit, loss = _reference_hits(seed), _reference_losses(seed)
    hits = list(np.flatnonzero(hit))
    misses = sorted(np.flatnonzero(~hit), key=lambda i: -loss[i])  # dearest first
    if len(hits) < n or len(misses) < 5 + (n - 1):  # not with the fixed batch: a plain split
        return [np.arange(6)] + [np.arange(6 + 2 * r, 8 + 2 * r) for r in range(n - 1)]
    # replica 0's misses the dearest, the others' the cheapest: their mean losses differ too
    out = [np.array([hits[0]] + misses[:5])]
    for r in range(1, n):
        out.append(np.array([hits[r], misses[-r]]))
    return out


# The one-device reference every step is compared with: the lesson's CNN (seed 3) at its initial
# weights. Built once per process, with what it gives on each step the check feeds (logits,
# gradient), since every call of the check and every test asks the same questions of it.

@functools.lru_cache(maxsize=None)
def _reference_model():
    ref = mirrored.build_keras_cnn(seed=3)
    return ref, tuple(w.copy() for w in ref.get_weights())


def _reference_logits_of(weights, x) -> np.ndarray:
    """The reference CNN's logits on ``x`` with ``weights`` (its own start weights when None)."""
    ref, start = _reference_model()
    ref.set_weights(list(start) if weights is None else weights)
    return ref(x, training=False).numpy()


def _reference_gradients(x, y) -> list:
    """One device's gradient of the mean loss over (``x``, ``y``) at the start weights."""
    ref, start = _reference_model()
    ref.set_weights(list(start))
    return mirrored.single_replica_gradients(ref, x, y)


@functools.lru_cache(maxsize=None)
def _reference_logits(seed: int) -> np.ndarray:
    logits = _reference_logits_of(None, reference_batch(64, seed)[0])
    logits.setflags(write=False)
    return logits


def _reference_hits(seed: int) -> np.ndarray:
    return np.argmax(_reference_logits(seed), -1) == reference_batch(64, seed)[1]


def _reference_losses(seed: int) -> np.ndarray:
    return mirrored.per_example_loss(reference_batch(64, seed)[1], _reference_logits(seed)).numpy()


_STEPS: dict = {}


def _reference_step(global_batch: int, n: int, slices: list | None) -> tuple:
    """A step the check feeds and one device's view of it, made once per step in a process:
    ``(x, y, rows, logits, grads)`` — the step's samples in replica order, replica r's rows of
    them, the reference's logits and its mean loss's gradient at the start weights. ``slices``
    None: one global batch of ``reference_batch(global_batch)`` cut over ``n`` replicas as
    evenly as it goes (array_split); else replica r holds the samples ``slices[r]`` of
    ``reference_batch(64)``."""
    key = (global_batch, n, None if slices is None else
           tuple(tuple(int(i) for i in s) for s in slices))
    if key not in _STEPS:
        if slices is None:   # the check splits one global batch as evenly as it can
            x, y = reference_batch(global_batch)
            rows = [np.asarray(s) for s in np.array_split(np.arange(global_batch), n)]
        else:                # replica r holds the samples slices[r] of the reference batch
            x64, y64 = reference_batch(64)
            x, y = x64[np.concatenate(slices).astype(int)], y64[np.concatenate(slices).astype(int)]
            bounds = np.cumsum([0] + [len(s) for s in slices])
            rows = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        logits, grads = _reference_logits_of(None, x), _reference_gradients(x, y)
        for arr in (x, y, logits, *grads):   # shared by every call: nobody may change them
            arr.setflags(write=False)
        _STEPS[key] = (x, y, rows, logits, grads)
    return _STEPS[key]


def _check_step_once(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int, lr: float, slices: list | None = None):
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    # The reference: one device, mean loss over the whole global batch, plain SGD.
    x, y, slices, logits, grads = _reference_step(global_batch, n, slices)
    start = list(_reference_model()[1])
    ref_loss = float(mirrored.per_example_loss(y, logits).numpy().mean())
    ref_acc = float(np.mean(np.argmax(logits, -1) == y))
    ref_delta = [-lr * g for g in grads]  # the step SGD must take (trainable vars == all vars)

    model, optimizer = make_model_and_optimizer(strategy, lr)
    problem = (_outside_scope(strategy, model, optimizer, make_model_and_optimizer)
               if isinstance(model, keras.Model) else None)
    if problem:
        fail(problem[0], fix=problem[1])
    if len(model.get_weights()) != len(start):
        fail(f"the model has {len(model.get_weights())} weight arrays where the lesson's CNN "
             f"has {len(start)}: the check compares with mirrored.build_keras_cnn().",
             fix="Build mirrored.build_keras_cnn() in make_model_and_optimizer.")
    _check_lr(optimizer, lr)
    _check_sgd(optimizer, lr)
    model.set_weights(start)
    # replica r holds rows slices[r]: on an even step, the element experimental_distribute_dataset
    # makes of one batch of (x, y) (the split the ceiling rule gives, tested)
    dist_batch = distribute_slices(strategy, (x, y), [len(s) for s in slices])
    try:
        out = distributed_train_step(strategy, model, optimizer, dist_batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"distributed_train_step raised {type(exc).__name__} on {n} replicas: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}"
             + _captured_note(distributed_train_step, strategy))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        fail(f"distributed_train_step returned {type(out).__name__}, not a pair: the contract "
             f"is (loss, accuracy), one number each.", fix="Return (loss, accuracy).")
    try:
        loss, acc = (float(np.asarray(v)) for v in out)
    except (TypeError, ValueError):
        fail("distributed_train_step returned per-replica values (one per replica), not one "
             "number each: the global batch's loss and accuracy are one number each.",
             fix="Combine each value over the replicas into one number on the host.")
    # What each replica held before the step.
    split = "+".join(str(len(s)) for s in slices)
    per_ex = mirrored.per_example_loss(y, logits).numpy()
    hit = np.argmax(logits, -1) == y

    updated = model.get_weights()
    delta = [w - s for w, s in zip(updated, start)]
    size = sum(float(np.sum(d * d)) for d in delta) ** 0.5
    ref_size = sum(float(np.sum(d * d)) for d in ref_delta) ** 0.5
    if not np.isfinite(size):
        empty = [r for r, sl in enumerate(slices) if len(sl) == 0]
        fail(f"the weights became nan after one step of {global_batch} sample"
             f"{'s' if global_batch != 1 else ''} split {split} over {n} replicas: "
             + (f"replica {empty[0]} holds no sample, and a loss it divided by a count of its "
                f"own (0) is 0/0 — one nan in a replica's loss makes every weight nan after "
                f"apply_gradients." if empty else "a loss was not a finite number."),
             fix="Use your part 1 per_replica_loss, whose divisor is the step's count.")
    if size == 0:
        fail("the weights did not change after one step: no gradient was applied to the "
             "mirrored variables.",
             fix="Apply the gradients with optimizer.apply_gradients inside the function you "
                 "pass to strategy.run.")
    step_ratio = size / ref_size
    if not all(_close(d, r, rtol=1e-2) for d, r in zip(delta, ref_delta)):
        if abs(step_ratio - n) < 0.05 * n:
            fail(f"the update is {n}x too big ({n} replicas): each replica's loss was the "
                 f"reduce_mean over its own examples, and the strategy then summed the "
                 f"{n} replicas' gradients.",
                 fix="Divide each replica's summed loss by the step's sample count (part 1).")
        if abs(step_ratio - 1 / n) < 0.05 / n:
            fail(f"the update is {n}x too small: the loss was divided by the global batch and "
                 f"then once more by the {n} replicas, but the strategy sums the replicas' "
                 f"gradients — it does not average them.", fix="Divide only once.")
        for k in (2, 3, 4):
            if k != n and abs(step_ratio - n / k) < 0.02 * n / k:
                fail(f"on {n} replicas the update is {n}/{k} of the right one: the loss was "
                     f"divided by a fixed {k} replicas, a number that holds on {k} replicas only.",
                     fix="Drop the fixed replica count: divide each replica's sum by the "
                         "step's sample count alone.")
        k = global_batch / step_ratio
        if abs(k - round(k)) < 0.02 * k and round(k) not in (global_batch, 0):
            fail(f"with a global batch of {global_batch} on {n} replicas the update is "
                 f"{step_ratio:.3g} times the right one: the loss was divided by a fixed "
                 f"{round(k)}, not by this step's global batch.",
                 fix="Divide by this step's sample count (part 1).")
        if len({len(s) for s in slices}) > 1:
            # each replica dividing its summed loss by its own slice size x n (a local mean / n)
            local = [sum(g / n for g in gs) for gs in zip(*(
                _reference_gradients(x[s], y[s]) for s in slices))]
            if all(_close(d, -lr * g, rtol=1e-2) for d, g in zip(delta, local)):
                fail(f"this step's {global_batch} samples arrived in slices of {split}, and each "
                     f"replica's loss was divided by its own slice size times the replica count: "
                     f"that is the global batch only when every slice is the same size.",
                     fix="Divide by the step's sample count, the same on every replica (part 1).")
        fail(f"one step changed the weights by {step_ratio:.3g} times the single-device SGD "
             f"step (expected 1), not by a factor the check recognises.",
             fix="Compute each replica's loss on its slice (part 1), take its gradient and apply "
                 "it inside strategy.run.")

    # The weights are right: what the step reported is judged against the wrong calculations
    # the check knows, on this very split, from the logits before and after the update.
    def after_update():
        after = _reference_logits_of(updated, x)
        return mirrored.per_example_loss(y, after).numpy(), np.argmax(after, -1) == y
    judge_reports(loss, acc, ref_loss, ref_acc, _BeforeAfter((per_ex, hit), after_update),
                  slices, global_batch)
    return ref_loss, ref_acc


class _BeforeAfter(collections.abc.Mapping):
    """``{"before": ..., "after": ...}`` for :func:`judge_reports`: the per-example losses and
    hits before the update, and after it — the reference CNN run again at the updated weights,
    only when a reported value is judged wrong and the wrong calculations are tried (a right
    report never reads it: a forward pass saved on almost every step the check runs)."""

    def __init__(self, before: tuple, after_update):
        self._before, self._after_update, self._after = before, after_update, None

    def __getitem__(self, when: str) -> tuple:
        if when == "before":
            return self._before
        if when == "after":
            if self._after is None:
                self._after = self._after_update()
            return self._after
        raise KeyError(when)

    def __iter__(self):
        return iter(("before", "after"))

    def __len__(self) -> int:
        return 2
