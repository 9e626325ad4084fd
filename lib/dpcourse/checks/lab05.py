"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces:

* ``per_replica_loss(labels, logits, global_batch, weights=None)`` — the loss one replica
  differentiates: its share of the step's mean, or with ``weights`` of the step's weighted mean
  Σ wℓ / Σ w, whose total weight no replica is given (the replicas add their own totals);
* ``make_model_and_optimizer(strategy, lr, start=None)`` — the Keras CNN and an SGD optimizer,
  the model starting from ``start``'s current weights when a one-device model is given;
* ``distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)`` — one step,
  returning the global batch's mean loss and accuracy.

Each check runs the learner's code on fixed global batches from fixed weights — two global batch
sizes, one of which does not split evenly (slices of 3 and 2), two learning rates, and, when
TensorFlow has a spare logical device, one replica more than the lab's strategy (so a number tied
to one batch size, one learning rate or to 2 replicas fails) — computes the right answer on one
device without any strategy, and compares. The loss is checked inside ``strategy.run``, where a
training step calls it. Wrong answers that leave a known trace are named: the per-replica
``reduce_mean`` (gradient and step N times too big), a divisor of slice size × replicas
(``compute_average_loss`` without ``global_batch_size``, or ``reduce_mean`` / N: right only when
every slice is the same size; part 1 tries 3 + 2, part 3 a step split 6 + 2 (+ 2)), a fixed
learning rate, an optimizer other than plain SGD (momentum included, which one step cannot show:
its configuration is compared with the contract's), variables created outside the scope of the
strategy given (parts 2 and 3 also run on the spare strategy, so the notebook's own ``strategy``
read from outside the function shows), and the library's own answers (``mirrored.per_replica_loss``,
``mirrored.train_step``) passed in place of the learner's. Part 1's weighted step (3 + 2 and
3 + 3 + 1, weights between 0.2 and 2) names the weights ignored (lesson 05's line transcribed),
no ``weights`` parameter, the weighted sum over the sample count (``compute_average_loss`` with
``sample_weight``), a replica's own weighted mean, its own total × N, and the whole step's
weighted mean on every replica. Part 2's ``start`` (a one-device CNN moved off its initial
weights) names start returned itself (the scope does not mirror existing variables), start
ignored (the lesson's lines transcribed), start's architecture cloned (its initial weights, not
its current ones), and no ``start`` parameter. The stretch's dataset function is also called as
on 2 workers (two ``tf.distribute.InputContext`` pipelines, twice the replicas in sync): a
function that ignores its context (every pipeline all the data), one that ignores the pipeline
id, one that shards by replicas, and one that batches by one worker's replicas are named.

A wrong reported loss or accuracy is compared with every wrong calculation the check knows, each
computed on that very split — from
the logits before the update and from the weights after it; SUM of the replicas' means, MEAN of
their shares, a mean of means, a count never divided, replica 0's value — and named only when
exactly one of them matches: on an even split several can coincide (counts after the update can
equal the sum of the means before it), and then a later split decides, or the check says it
cannot tell and gives no fix.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""

from __future__ import annotations

import re
import types

import numpy as np

from dpcourse import data as _data
from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded, reveal

tf = mirrored.tf
keras = mirrored.keras

__all__ = ["check_per_replica_loss", "check_model_and_optimizer", "check_train_step",
           "reference_batch", "strategies_for", "check_dataset_fn", "check_partial_batch_epoch",
           "last_step_sizes", "check_split_prediction", "check_pipeline_prediction",
           "stretch_data"]

_RTOL = 1e-3


def reference_batch(global_batch: int = 64, seed: int = 5):
    """A fixed global batch (normalised NHWC float32 images, int64 labels)."""
    ds = _data.load("shapes10", n_train=global_batch, n_test=1, seed=seed)
    return _data.normalize(ds.x_train), ds.y_train


def _ratio(got: float, want: float) -> float:
    return float(got) / float(want) if want != 0 else float("inf")


def _close(a, b, rtol=_RTOL) -> bool:
    return bool(np.allclose(a, b, rtol=rtol, atol=1e-6))


_OTHER: dict = {}


def strategies_for(strategy) -> list:
    """The lab's strategy and, if TF has a spare logical device of the same kind, a strategy
    with one replica more (built once and kept: TF cannot forget a strategy's devices)."""
    devices = list(strategy.extended.worker_devices)
    kind = "GPU" if any("GPU" in d.upper() for d in devices) else "CPU"
    have = [d.name for d in tf.config.list_logical_devices(kind)]
    if len(have) <= len(devices):
        return [strategy]
    names = tuple(have[:len(devices) + 1])
    if names not in _OTHER:
        _OTHER[names] = mirrored.make_strategy(list(names))
    return [strategy, _OTHER[names]]


def _local(strategy, value) -> list:
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


# The library holds lesson 05's answers; the lab asks for the learner's own.
_LIBRARY = {"per_replica_loss": "per_replica_loss", "distributed_train_step": "train_step"}


def _refuse_library(fn, what: str) -> None:
    __tracebackhide__ = True
    lib = getattr(mirrored, _LIBRARY[what])
    inner = getattr(fn, "func", fn)  # a functools.partial of it too
    if inner is lib or getattr(inner, "__code__", None) is lib.__code__:
        fail(f"{what} is dpcourse.mirrored.{_LIBRARY[what]}, the library's answer that lesson 05 "
             f"runs: it passes by construction, so passing proves nothing about your scaling.",
             fix=f"Write your own {what} in the lab's cell.")


class _LibrarySpy:
    """While active, a call of the library's answer from inside the learner's function is noted
    (the learner's function may wrap ``mirrored.per_replica_loss`` instead of being it)."""

    def __init__(self, what: str):
        self.name, self.called = _LIBRARY[what], False
        self.what = what

    def __enter__(self):
        self.original = getattr(mirrored, self.name)

        def spy(*args, **kwargs):
            self.called = True
            return self.original(*args, **kwargs)
        setattr(mirrored, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(mirrored, self.name, self.original)
        if self.called and exc[0] is None:
            fail(f"your {self.what} calls dpcourse.mirrored.{self.name}, the library's answer "
                 f"that lesson 05 runs: the scaling it checks is then the library's, not yours.",
                 fix=f"Compute the loss in your own {self.what}, without the library's function.")
        return False


def _lr_of(optimizer) -> float | None:
    try:
        return float(np.asarray(optimizer.learning_rate.numpy()))
    except Exception:  # noqa: BLE001 - a schedule or something else: the step check decides
        return None


def _check_lr(optimizer, lr: float) -> None:
    __tracebackhide__ = True
    got = _lr_of(optimizer)
    if got is not None and not np.isclose(got, lr, rtol=1e-5):
        fail(f"the optimizer's learning rate is {got:.4g}, but make_model_and_optimizer was "
             f"called with lr={lr:.4g}: a number written into the function holds for one call "
             f"only.", fix="Build the optimizer with the lr argument.")


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


def _other_lr(lr: float) -> float:
    """A second learning rate, far from the lab's, so that a fixed number shows."""
    return 0.037 if not np.isclose(lr, 0.037) else 0.1


def _outside_scope(strategy, model, optimizer, fn=None):
    """(cause, fix) when a variable of ``model`` or ``optimizer`` is not one ``strategy`` made."""
    # Keras 3 wraps each tf.Variable in a keras.Variable; the strategy knows the inner one.
    outside = [getattr(v, "value", v) for v in model.variables
               if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]
    n = strategy.num_replicas_in_sync
    if outside:
        other = getattr(outside[0], "_distribute_strategy", None)
        if other is not None and other is not strategy:
            return (f"the model's variables (e.g. {outside[0].name!r}) are mirrored by another "
                    f"strategy, with {other.num_replicas_in_sync} replicas, not by the "
                    f"{n}-replica strategy make_model_and_optimizer was given."
                    + _captured_note(fn, strategy),
                    "Build under the scope of the strategy the function is given.")
        return (f"the model's variables (e.g. {outside[0].name!r}) were created outside "
                f"strategy.scope(): they are plain variables on one device, not mirrored "
                f"copies the strategy keeps equal on every replica.",
                "Build the model inside `with strategy.scope():`.")
    made_under = getattr(optimizer, "_distribution_strategy", strategy)
    if made_under is not strategy:
        if isinstance(made_under, tf.distribute.MirroredStrategy):
            return (f"the optimizer was created under another strategy, with "
                    f"{made_under.num_replicas_in_sync} replicas, not under the {n}-replica "
                    f"strategy make_model_and_optimizer was given." + _captured_note(fn, strategy),
                    "Build under the scope of the strategy the function is given.")
        return ("the optimizer was created outside strategy.scope(): its own variables (step "
                "counter, learning rate, slots) are then not mirrored, and the strategy cannot "
                "update every replica's copy with them.",
                "Create the optimizer inside `with strategy.scope():` too.")
    return None


def _captured_strategies(fn) -> list:
    """(name, strategy) for each ``tf.distribute.Strategy`` that ``fn`` (or a function nested in
    it) reads from outside itself: module globals and closure cells."""
    fn = getattr(fn, "func", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    glob = getattr(fn, "__globals__", {})
    found = {nm: glob[nm] for nm in names if isinstance(glob.get(nm), tf.distribute.Strategy)}
    for nm, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            if isinstance(cell.cell_contents, tf.distribute.Strategy):
                found[nm] = cell.cell_contents
        except ValueError:   # an empty cell
            pass
    return sorted(found.items(), key=lambda kv: kv[0])


def _captured_note(fn, strategy) -> str:
    """A sentence naming a strategy that ``fn`` reads from outside itself and that is not
    ``strategy`` (the one this call runs on), or ""."""
    others = [f"`{nm}` ({obj.num_replicas_in_sync} replicas)"
              for nm, obj in _captured_strategies(fn) if obj is not strategy]
    if not others:
        return ""
    return (f" Your function reads {', '.join(others)} from outside itself, while this call runs "
            f"on {strategy.num_replicas_in_sync} replicas: a value captured from outside the "
            f"function stays what it was, whatever the call is given.")


def _check_sgd(optimizer, lr: float) -> None:
    """The contract's optimizer: plain SGD (what one device runs in the check), nothing else."""
    __tracebackhide__ = True
    if type(optimizer) is not keras.optimizers.SGD:
        fail(f"the optimizer is {type(optimizer).__name__}, but the contract asks for "
             f"keras.optimizers.SGD: the check compares your steps with plain SGD on one device.",
             fix="Build keras.optimizers.SGD with the lr argument.")
    plain = keras.optimizers.SGD(learning_rate=lr).get_config()
    got = optimizer.get_config()
    differ = {k: got.get(k) for k in plain if k not in ("name", "learning_rate")
              and got.get(k) != plain[k]}
    if differ:
        what = ", ".join(f"{k}={v!r}" for k, v in differ.items())
        momentum = (" With momentum each update adds a multiple of the previous one, so the "
                    "first step is plain SGD's and every later one is not — a one-step test "
                    "cannot see it, a training loop does." if "momentum" in differ else "")
        fail(f"the optimizer is SGD with {what}, where the contract's plain SGD has "
             + ", ".join(f"{k}={plain[k]!r}" for k in differ) + f": its steps are not the "
             f"single-device plain SGD steps the lab compares with.{momentum}",
             fix="Build keras.optimizers.SGD with the learning rate alone.")


@recorded
def check_model_and_optimizer(make_model_and_optimizer, strategy, lr: float = 0.1):
    """The model and optimizer must both be created under the ``strategy`` given (tried on the
    lab's strategy and, when TF has a spare device, on one with a replica more), the optimizer
    plain SGD with the learning rate asked for (tried with ``lr`` and with another one).
    Returns the lab strategy's pair."""
    __tracebackhide__ = True
    other_lr = _other_lr(lr)
    kept = None
    for strat in strategies_for(strategy):
        try:
            _, other_opt = make_model_and_optimizer(strat, other_lr)
            model, optimizer = make_model_and_optimizer(strat, lr)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            fail(f"make_model_and_optimizer raised {type(exc).__name__} on "
                 f"{strat.num_replicas_in_sync} replicas: {exc}"
                 + _captured_note(make_model_and_optimizer, strat))
        if not isinstance(model, keras.Model) or not isinstance(
                optimizer, keras.optimizers.Optimizer):
            fail("make_model_and_optimizer must return (keras model, keras optimizer), got "
                 f"({type(model).__name__}, {type(optimizer).__name__}).")
        problem = _outside_scope(strat, model, optimizer, make_model_and_optimizer)
        if problem:
            fail(problem[0], fix=problem[1])
        _check_lr(other_opt, other_lr)
        _check_lr(optimizer, lr)
        _check_sgd(optimizer, lr)
        kept = kept or (model, optimizer)
    _check_start(make_model_and_optimizer, strategy, lr)
    passed(f"the model and a plain SGD optimizer are created under the strategy given "
           f"({' and '.join(str(s.num_replicas_in_sync) for s in strategies_for(strategy))} "
           f"replicas; lr {other_lr:g} and {lr:g} tried), and a mirrored model that starts "
           f"from a one-device model's weights holds them on every replica")
    return kept


START_SEED = 7


def start_model():
    """Part 2's one-device model: the lesson's CNN built outside any strategy (seed 7), then
    its weights moved off their initial values, as training or a checkpoint would leave them."""
    model = mirrored.build_keras_cnn(seed=START_SEED)
    rng = np.random.default_rng(START_SEED)
    model.set_weights([w + rng.normal(0, 0.01, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


def _same_weights(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y)
                                    for x, y in zip(a, b))


def _check_start(make_model_and_optimizer, strategy, lr: float) -> None:
    """With ``start`` (a one-device model of the lesson's CNN, built outside any strategy and
    trained away from its initial weights), the mirrored model must hold start's weights on
    every replica, its variables still created under the strategy."""
    __tracebackhide__ = True
    start = start_model()
    want = [w.copy() for w in start.get_weights()]
    n = strategy.num_replicas_in_sync
    try:
        model, optimizer = make_model_and_optimizer(strategy, lr, start=start)
    except NotImplementedError:
        raise
    except TypeError as exc:
        if "start" in str(exc) or "positional argument" in str(exc):
            fail(f"make_model_and_optimizer(strategy, lr, start=...) raised TypeError: "
                 f"{str(exc).splitlines()[0]} — the contract's third argument, start, is the "
                 f"one-device model whose weights the mirrored model starts from.",
                 fix="Add the parameter start=None and use it when it is given.")
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_model_and_optimizer(strategy, lr, start=...) raised {type(exc).__name__}: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if model is start:
        fail("with start=, make_model_and_optimizer returned start itself: its variables were "
             "created before, outside any strategy, each one tensor on one device — entering "
             "strategy.scope() afterwards does not mirror them (the scope acts when a variable "
             "is created, never later), so the replicas would not share this model.",
             fix="Create a new model under the scope and give it start's weights.")
    problem = _outside_scope(strategy, model, optimizer, make_model_and_optimizer)
    if problem:
        fail(problem[0], fix=problem[1])
    got = model.get_weights()
    if _same_weights(got, want):
        for v, w in zip(model.weights, want):   # every replica's copy, not only the first
            per_replica = [np.asarray(c) for c in
                           getattr(getattr(v, "value", v), "values", ())]
            if per_replica and not all(np.array_equal(c, w) for c in per_replica):
                fail(f"with start=, replica 0 holds start's weights but another of the {n} "
                     f"replicas does not: the copies of a mirrored variable must be equal.")
        return
    if _same_weights(got, mirrored.build_keras_cnn().get_weights()):
        fail("with start=, your model holds build_keras_cnn()'s own initial weights, not "
             "start's: a model built under the scope is a new model with new variables, and "
             "nothing carried start's values into them — training would begin from scratch.",
             fix="Copy start's weights into the new model.")
    if _same_weights(got, mirrored.build_keras_cnn(seed=START_SEED).get_weights()):
        fail("with start=, your model holds the weights start was *initialised* with, not the "
             "ones it holds now: a copy of start's architecture (clone_model, or its config) "
             "re-runs its initialisers, and start's weights have moved since.",
             fix="Copy start's current weights into the new model.")
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)) if len(got) == len(
        want) and all(a.shape == b.shape for a, b in zip(got, want)) else None
    fail(f"with start=, your model's weights are not start's"
         + (f" (they differ by up to {diff:.3g})" if diff is not None else
            f" ({len(got)} weight tensors, start has {len(want)})")
         + ": the mirrored model must begin where the one-device model is.")


@recorded
def check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int = 64, lr: float = 0.1) -> None:
    """One step of the learner's loop from fixed weights on a fixed global batch must give the
    single-device result: the same updated weights, the mean loss and the accuracy of the batch
    before the update. Tried with ``global_batch`` and three quarters of it, on the lab's
    strategy and (when TF has a spare device) on one with a replica more; the second batch with
    another learning rate; then a step split unevenly. A wrong reported value is named only
    when one wrong calculation explains it; where several coincide on one split, the next split
    decides."""
    __tracebackhide__ = True
    _refuse_library(distributed_train_step, "distributed_train_step")
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
        for strat, gb, step_lr, slices, label in runs:
            try:
                _check_step_once(distributed_train_step, make_model_and_optimizer, strat, gb,
                                 step_lr, slices=slices)
            except _Ambiguous as amb:
                unsure = unsure or amb
            tried.append(label)
    if unsure is not None:
        fail(unsure.sentence)
    passed(f"one step == one device on the global batch (weights, loss, accuracy; tried "
           + ", ".join(tried) + f" replicas, lr {lr:g} and {_other_lr(lr):g})")


def uneven_slices(n: int, seed: int = 5) -> list:
    """Indices into ``reference_batch(64, seed)`` for a step split unevenly over ``n`` replicas:
    replica 0 holds 6 samples, each other replica 2, and every replica's slice holds exactly one
    sample the reference model (``build_keras_cnn(seed=3)``) classifies right — so that neither
    the mean of the replicas' loss means nor the mean of their accuracies is the batch's."""
    x, y = reference_batch(64, seed)
    logits = mirrored.build_keras_cnn(seed=3)(x, training=False).numpy()
    hit, loss = np.argmax(logits, -1) == y, mirrored.per_example_loss(y, logits).numpy()
    hits = list(np.flatnonzero(hit))
    misses = sorted(np.flatnonzero(~hit), key=lambda i: -loss[i])  # dearest first
    if len(hits) < n or len(misses) < 5 + (n - 1):  # not with the fixed batch: a plain split
        return [np.arange(6)] + [np.arange(6 + 2 * r, 8 + 2 * r) for r in range(n - 1)]
    # replica 0's misses the dearest, the others' the cheapest: their mean losses differ too
    out = [np.array([hits[0]] + misses[:5])]
    for r in range(1, n):
        out.append(np.array([hits[r], misses[-r]]))
    return out


def _check_step_once(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int, lr: float, slices: list | None = None):
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    if slices is None:   # the check splits one global batch as evenly as it can (array_split)
        x, y = reference_batch(global_batch)
        slices = [np.asarray(s) for s in np.array_split(np.arange(global_batch), n)]
    else:                # replica r holds the samples slices[r] of the reference batch
        x64, y64 = reference_batch(64)
        x, y = x64[np.concatenate(slices)], y64[np.concatenate(slices)]
        bounds = np.cumsum([0] + [len(s) for s in slices])
        slices = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    # The reference: one device, mean loss over the whole global batch, plain SGD.
    ref = mirrored.build_keras_cnn(seed=3)
    start = [w.copy() for w in ref.get_weights()]
    logits = ref(x, training=False).numpy()
    ref_loss = float(mirrored.per_example_loss(y, logits).numpy().mean())
    ref_acc = float(np.mean(np.argmax(logits, -1) == y))
    grads = mirrored.single_replica_gradients(ref, x, y)
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
    if len({len(s) for s in slices}) == 1:
        dist_batch = next(iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))))
    else:
        dist_batch = strategy.experimental_distribute_values_from_function(
            lambda ctx: (tf.constant(x[slices[ctx.replica_id_in_sync_group]]),
                         tf.constant(y[slices[ctx.replica_id_in_sync_group]])))
    try:
        out = distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)
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

    delta = [w - s for w, s in zip(model.get_weights(), start)]
    size = sum(float(np.sum(d * d)) for d in delta) ** 0.5
    ref_size = sum(float(np.sum(d * d)) for d in ref_delta) ** 0.5
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
                 fix="Divide each replica's summed loss by the global batch (part 1).")
        if abs(step_ratio - 1 / n) < 0.05 / n:
            fail(f"the update is {n}x too small: the loss was divided by the global batch and "
                 f"then once more by the {n} replicas, but the strategy sums the replicas' "
                 f"gradients — it does not average them.", fix="Divide only once.")
        for k in (2, 3, 4):
            if k != n and abs(step_ratio - n / k) < 0.02 * n / k:
                fail(f"on {n} replicas the update is {n}/{k} of the right one: the loss was "
                     f"divided by a fixed {k} replicas, a number that holds on {k} replicas only.",
                     fix="Divide by the global_batch argument.")
        k = global_batch / step_ratio
        if abs(k - round(k)) < 0.02 * k and round(k) not in (global_batch, 0):
            fail(f"with a global batch of {global_batch} on {n} replicas the update is "
                 f"{step_ratio:.3g} times the right one: the loss was divided by a fixed "
                 f"{round(k)}, not by this step's global batch.",
                 fix="Divide by the global_batch argument.")
        if len({len(s) for s in slices}) > 1:
            # each replica dividing its summed loss by its own slice size x n (a local mean / n)
            local = [sum(g / n for g in gs) for gs in zip(*(
                mirrored.single_replica_gradients(ref, x[s], y[s])
                for s in slices))]
            if all(_close(d, -lr * g, rtol=1e-2) for d, g in zip(delta, local)):
                fail(f"this step's {global_batch} samples arrived in slices of {split}, and each "
                     f"replica's loss was divided by its own slice size times the replica count: "
                     f"that is the global batch only when every slice is the same size.",
                     fix="Divide by the global_batch argument (part 1).")
        fail(f"one step changed the weights by {step_ratio:.3g} times the single-device SGD "
             f"step (expected 1), not by a factor the check recognises.",
             fix="Compute each replica's loss on its slice (part 1), take its gradient and apply "
                 "it inside strategy.run.")

    # The weights are right. Each reported value is compared with the batch's; a wrong one is
    # compared with every wrong calculation the check knows, computed on this very split — from
    # the logits before the update and from the weights after it — and named only when exactly
    # one matches (on an even split several can coincide: then a later split decides).
    ref.set_weights(model.get_weights())
    after = ref(x, training=False).numpy()
    when_of = {"before": (per_ex, hit),
               "after": (mirrored.per_example_loss(y, after).numpy(), np.argmax(after, -1) == y)}
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
        if not found:
            fail(f"the reduced {what} is {got:{fmt}}, but {want_is} (split {split} over {n} "
                 f"replicas), and it matches no wrong calculation the check knows.")
        when, how, of = found[0]
        cause, fix = _name_reduction(what, got, fmt, want_is, when, how, of, slices, global_batch)
        fail(cause, fix=fix)
    return ref_loss, ref_acc


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
        "batch ({gb}): averaging them divides by the {n} replicas a second time. Shares add up.",
        "Combine shares with the operation that adds them."),
    "count": (
        "the replicas' sums added up, not divided",
        "the replicas' sums ({parts}) added up and never divided by the {gb} samples of the "
        "step.",
        "Divide the summed statistic once by the step's sample count."),
    "replica0": (
        "replica 0's value alone",
        "replica 0's value alone, not a reduction over the {n} replicas.",
        "Combine every replica's value into one number with strategy.reduce."),
}


def _wrong_reductions(of, slices, gb: int, what: str) -> dict:
    """The number each way of combining the per-replica statistic ``of`` (per-example losses or
    hits) over ``slices`` gives, the right way ("batch") included."""
    means = [float(of[s].mean()) for s in slices]
    shares = [float(of[s].sum()) / gb for s in slices]
    out = {"batch": float(of.mean()), "sum_of_means": sum(means),
           "mean_of_shares": float(np.mean(shares)), "replica0": means[0]}
    if len({len(s) for s in slices}) > 1:
        out["mean_of_means"] = float(np.mean(means))
    if what == "accuracy":
        out["count"] = float(of.sum())
    else:
        out["replica0_share"] = shares[0]
    return out


def _name_reduction(what, got, fmt, want_is, when, how, of, slices, gb):
    """(cause, fix) for a reported value that one wrong calculation explains."""
    n = len(slices)
    how = "replica0" if how == "replica0_share" else how
    parts = [float(of[s].mean()) for s in slices] if how in ("sum_of_means", "mean_of_means") \
        else [float(of[s].sum()) / (gb if how == "mean_of_shares" else 1) for s in slices]
    fields = dict(what=what, n=n, gb=gb, split="+".join(str(len(s)) for s in slices),
                  parts=" + ".join(f"{p:{fmt}}" for p in parts) if how == "sum_of_means"
                  else ", ".join(f"{p:{fmt}}" for p in parts),
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


# --- stretch: datasets from a function, and a partial last batch ---------------------------

_N_SAMPLES, _GLOBAL = 100, 32  # 32 + 32 + 32 + 4: on 2 replicas the last step is 4 and 0


def stretch_data():
    """The stretch's data: 100 samples of 8 features, labels 0-9 (fixed)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(_N_SAMPLES, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=_N_SAMPLES).astype(np.int64)
    return x, y


def stretch_global(n: int) -> int:
    """The global batch the stretch's checks use on ``n`` replicas: 32 where ``n`` divides it
    (100 samples: the last step 4 + 0 on 2 replicas), else 12 per replica (36 on 3: the last
    step's 28 samples as 12 + 12 + 4, uneven but on more than one replica)."""
    return _GLOBAL if _GLOBAL % n == 0 else 12 * n


def _expected_split(n: int, global_batch: int) -> list:
    """Per-replica sizes of each step when every replica takes whole per-replica batches of one
    pipeline in turn (``distribute_datasets_from_function``): 32 samples as 16 + 16 on 2
    replicas, and the last step's 4 samples as 4 + 0."""
    per = global_batch // n
    steps = []
    for start in range(0, _N_SAMPLES, global_batch):
        steps.append([max(0, min(per, _N_SAMPLES - start - r * per)) for r in range(n)])
    return steps


@recorded
def check_dataset_fn(make_dist_dataset, strategy) -> None:
    """Stretch: ``make_dist_dataset(strategy, x, y, global_batch)`` must give, at every step, the
    next ``global_batch`` samples in order, each replica taking whole per-replica batches from its
    input pipeline (``strategy.distribute_datasets_from_function``) — so on 2 replicas the short
    last step's 4 samples all land on replica 0, not split 2 + 2 as
    ``experimental_distribute_dataset`` splits a global batch. Tried on the lab's strategy and on
    one with a replica more (36 on 3: the last step 12 + 12 + 4); and a global batch the replicas
    do not divide must be refused by the learner's own ValueError naming both numbers (rounding
    the per-replica size changes every step's size; TF's ``get_per_replica_batch_size`` raising
    by itself is TF's decision, not the learner's)."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        gb = stretch_global(n)
        _check_dataset_once(make_dist_dataset, strat, gb)
        tried.append(f"{gb} on {n}")
        if n > 1:
            _check_indivisible(make_dist_dataset, strat, gb + 1)
    pipelines = _check_two_pipelines(make_dist_dataset, strategy)
    passed(f"make_dist_dataset: each step the next global batch in whole per-replica batches, "
           f"in order, the short last step kept ({', '.join(tried)} replicas), a global "
           f"batch the replicas do not divide refused, and {pipelines}")


_FROM_FUNCTION = ("distribute_datasets_from_function",
                  "experimental_distribute_datasets_from_function")


def _captured_dataset_fn(make_dist_dataset, strategy, x, y, global_batch: int):
    """The function ``make_dist_dataset`` hands to the strategy's
    ``distribute_datasets_from_function`` (None if it hands none)."""
    captured = []
    originals = {name: getattr(strategy, name) for name in _FROM_FUNCTION}

    def spy_of(original):
        def spy(dataset_fn, *args, **kwargs):
            captured.append(dataset_fn)
            return original(dataset_fn, *args, **kwargs)
        return spy

    for name, original in originals.items():
        setattr(strategy, name, spy_of(original))
    try:
        make_dist_dataset(strategy, x, y, global_batch)
    finally:
        for name in originals:
            delattr(strategy, name)   # the instance's spy gone, the class's method shows again
    return captured[0] if captured else None


PIPELINES = 2


def _check_two_pipelines(make_dist_dataset, strategy) -> str:
    """The dataset function of ``make_dist_dataset``, called as on ``PIPELINES`` workers of
    ``strategy``'s replica count each (a ``tf.distribute.InputContext`` per pipeline): the
    pipelines together must yield every sample once, each in per-replica batches of the
    global batch over all the replicas in sync (on every worker)."""
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    gb = stretch_global(n)
    fn = _captured_dataset_fn(make_dist_dataset, strategy, x, y, gb)
    if fn is None:
        return "no dataset function to try on two input pipelines"
    where = {float(v): i for i, v in enumerate(x[:, 0])}
    replicas = PIPELINES * n
    per = gb // replicas
    at = (f"(the dataset function called as on {PIPELINES} workers of {n} replicas each: "
          f"{PIPELINES} input pipelines, {replicas} replicas in sync, global batch {gb})")
    seen, sizes = [], []
    for pid in range(PIPELINES):
        ctx = tf.distribute.InputContext(num_input_pipelines=PIPELINES, input_pipeline_id=pid,
                                         num_replicas_in_sync=replicas)
        try:
            batches = [np.asarray(b[0]) for b in fn(ctx)]
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            fail(f"your dataset function raised {type(exc).__name__} {at}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
        seen.append([where.get(float(row[0]), -1) for b in batches for row in b])
        sizes.append([len(b) for b in batches])
    counts = [len(s) for s in seen]
    if all(sorted(s) == list(range(_N_SAMPLES)) for s in seen):
        fail(f"each of the {PIPELINES} input pipelines yielded all {_N_SAMPLES} samples {at}: "
             f"your dataset function keeps the whole data whatever its input_context says, so "
             f"on {PIPELINES} workers every sample is trained on {PIPELINES} times an epoch, and "
             f"the workers' steps repeat each other's samples.",
             fix="Shard the data by the context's number of input pipelines and its pipeline "
                 "id.")
    if seen[0] and all(sorted(s) == sorted(seen[0]) for s in seen[1:]):
        fail(f"the {PIPELINES} input pipelines yielded the same {counts[0]} samples {at}: the "
             f"data was cut into pieces, but every pipeline kept the same piece — the pipeline "
             f"id did not choose it.",
             fix="Choose each pipeline's piece by input_context.input_pipeline_id.")
    union = sorted(i for s in seen for i in s)
    if len(union) == len(set(union)) < _N_SAMPLES and all(
            abs(c - _N_SAMPLES / replicas) <= 1 for c in counts):
        fail(f"the {PIPELINES} input pipelines yielded {counts} samples, {len(union)} of "
             f"{_N_SAMPLES} in all {at}: the data was cut into {replicas} pieces, one per "
             f"replica in sync, and each pipeline kept one — but each pipeline feeds all "
             f"{n} replicas of its worker, which take different batches from it.",
             fix="Shard by the number of input pipelines, not replicas.")
    if union != list(range(_N_SAMPLES)):
        fail(f"the {PIPELINES} input pipelines yielded {counts} samples {at}, {len(set(union))} "
             f"different ones of {_N_SAMPLES}: together they must yield every sample once.")
    wrong = [(pid, s) for pid, s in enumerate(sizes) if any(b != per for b in s[:-1]) or
             (s and s[-1] > per)]
    if wrong:
        pid, s = wrong[0]
        fail(f"pipeline {pid} yielded batches of {s[:3]} samples {at}, but a replica's batch "
             f"is the global batch over all {replicas} replicas in sync, {gb} / {replicas} = "
             f"{per}: with batches of {s[0]} every step would hold {s[0] * replicas} samples, "
             f"not {gb}.",
             fix="Ask the input_context for the per-replica batch size; it counts the replicas "
                 "of every worker.")
    return (f"{PIPELINES} input pipelines (as on {PIPELINES} workers) split the data "
            f"{counts[0]} + {counts[1]}, in batches of {per}")


def _check_indivisible(make_dist_dataset, strategy, global_batch: int) -> None:
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    try:
        dist = make_dist_dataset(strategy, x, y, global_batch)
        steps = [[len(np.asarray(v)) for v in _local(strategy, b[0])] for b in dist]
    except NotImplementedError:
        raise
    except ValueError as exc:   # refused: is the refusal the learner's own, and clear?
        _check_refusal(exc, global_batch, n)
        return
    except Exception as exc:  # noqa: BLE001
        fail(f"with global_batch={global_batch} on {n} replicas make_dist_dataset raised "
             f"{type(exc).__name__}: {str(exc).splitlines()[0]} — the contract refuses a global "
             f"batch the replicas do not divide with a ValueError, not another error.",
             fix="Raise ValueError naming the global batch and the replica count.")
    sizes = [sum(st) for st in steps]
    fail(f"with global_batch={global_batch} on {n} replicas your steps held {sizes[:3]} samples "
         f"(per replica {steps[0] if steps else []}): {global_batch} is not a multiple of {n}, so "
         f"no per-replica batch size makes a step of {global_batch} — rounding it makes every "
         f"step the wrong size, and the loss of each step is divided by a count it does not hold.",
         fix="Refuse such a global batch: raise ValueError naming both numbers.")


def _check_refusal(exc: ValueError, global_batch: int, n: int) -> None:
    """The stretch's refusal must be the learner's own ValueError, naming both numbers: TF's
    ``InputContext.get_per_replica_batch_size`` raises one by itself for such a batch, from
    inside the strategy's call of the dataset function, and that is TF deciding, not you."""
    __tracebackhide__ = True
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)
    origin = frames[-1] if frames else None
    said = str(exc).splitlines()[0] if str(exc) else ""
    if origin is not None and "/tensorflow/" in origin.filename.replace("\\", "/"):
        fail(f"with global_batch={global_batch} on {n} replicas the ValueError came from "
             f"TensorFlow, not from your function: {origin.name} (in "
             f"{origin.filename.split('site-packages/')[-1]}) raised {said!r} while the strategy "
             f"called your dataset function. TF refused for you, from inside its own machinery: "
             f"the lab asks for your decision, made and explained by make_dist_dataset itself.",
             fix="Check the global batch in make_dist_dataset before building any pipeline, and "
                 "raise your own ValueError naming both numbers.")
    if not (re.search(rf"(?<!\d){global_batch}(?!\d)", said)
            and re.search(rf"(?<!\d){n}(?!\d)", said)):
        fail(f"with global_batch={global_batch} on {n} replicas your make_dist_dataset raised "
             f"ValueError({said!r}): the refusal is right, but its message does not name both "
             f"the global batch ({global_batch}) and the replica count ({n}), so whoever meets it "
             f"cannot see what did not divide.",
             fix="Put both numbers in the ValueError's message.")


def _check_dataset_once(make_dist_dataset, strategy, gb: int) -> None:
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    at = f"(global batch {gb} on {n} replicas)"
    where = {float(v): i for i, v in enumerate(x[:, 0])}   # sample -> its index in the data
    try:
        dist = make_dist_dataset(strategy, x, y, gb)
        steps = [[np.asarray(v) for v in _local(strategy, b[0])] for b in dist]
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_dist_dataset raised {type(exc).__name__} {at}: {str(exc).splitlines()[0]}")
    split = [[len(v) for v in step] for step in steps]
    sizes = [sum(s) for s in split]
    order = [where.get(float(row[0]), -1) for step in steps for v in step for row in v]
    want = [min(gb, _N_SAMPLES - i) for i in range(0, _N_SAMPLES, gb)]
    if n > 1 and split and split[0] and split[0][0] == gb:
        fail(f"replica 0 got {gb} samples in the first step {at}, a whole global batch: "
             f"global_batch is the size of the whole step over the {n} replicas, not one "
             f"replica's.",
             fix="Batch each replica's pipeline by its share of the global batch.")
    if sorted(order) == list(range(_N_SAMPLES)) and order != list(range(_N_SAMPLES)):
        fail(f"every sample arrives once, in steps of {sizes} {at}, but not in the data's order "
             f"(the first step starts with samples {order[:4]}): the contract makes each step "
             f"the next {gb} samples of the data, unshuffled.",
             fix="Leave the data in its order (no shuffle).")
    if len(set(order)) < _N_SAMPLES:
        kept = sorted(set(order))
        if n > 1 and len(kept) == len(range(0, _N_SAMPLES, n)) and all(
                (i - kept[0]) % n == 0 for i in kept):
            nth = f"{n}{'nd' if n == 2 else 'rd' if n == 3 else 'th'}"
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples, every {nth} one {at}: the "
                 f"data was sharded into {n} pieces (one per replica) and only one kept — but "
                 f"there is one input pipeline here (one per worker), and the replicas already "
                 f"take different batches from it.",
                 fix="Shard by the number of input pipelines, not replicas.")
        if kept == list(range(len(kept))) and len(kept) % gb == 0:
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}) {at}: "
                 f"the partial last batch was dropped — this exercise is about handling it.",
                 fix="Keep the remainder when batching.")
        fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}) {at}: "
             f"every sample must arrive once.")
    if sizes != want:
        fail(f"the steps hold {sizes} samples {at} (expected {want}, in the data's order).")
    if split != _expected_split(n, gb):
        fail(f"the samples and their order are right {at}, but the last step's {want[-1]} samples "
             f"were split {'+'.join(map(str, split[-1]))} over the replicas (expected "
             f"{'+'.join(map(str, _expected_split(n, gb)[-1]))}): that is a global batch split "
             f"by the strategy, as experimental_distribute_dataset splits one, not replicas "
             f"taking whole per-replica batches from a pipeline in turn.",
             fix="Build the dataset with strategy.distribute_datasets_from_function and batch it "
                 "by the per-replica size.")


def last_step_sizes(strategy, dist_dataset) -> list:
    """How many samples each replica holds in the last step of ``dist_dataset``."""
    last = None
    for batch in dist_dataset:
        last = batch
    return [int(np.shape(v)[0]) for v in strategy.experimental_local_results(last[1])]


def check_split_prediction(guess, sizes, n_samples: int, global_batch: int) -> None:
    """Compare the prediction of replica 0's share of the last step of an epoch distributed with
    ``experimental_distribute_dataset`` with what it held."""
    last = n_samples - (n_samples - 1) // global_batch * global_batch
    n = len(sizes)
    piece = -(-last // n)
    why = (f"{n_samples} samples in global batches of {global_batch} leave a last step of "
           f"{last}, and experimental_distribute_dataset cut that batch, as it cuts every batch "
           f"the dataset yields, into {n} pieces of ⌈{last}/{n}⌉ = {piece} in replica order, "
           f"the last replica taking what is left: {'+'.join(map(str, sizes))}. That step holds "
           f"{last} samples, not {global_batch}: whoever divides its loss must know it (the "
           f"stretch).")
    full = -(-global_batch // n)
    if getattr(guess, "value", None) == full and full != sizes[0]:
        why += (f" Your {full} is a full step's piece, ⌈{global_batch}/{n}⌉: the strategy cuts "
                f"the batch it receives, {last} samples here, not the {global_batch} the other "
                f"steps hold.")
    reveal(guess, sizes[0], close=guess.value == sizes[0], explanation=why)


def check_pipeline_prediction(guess, sizes) -> None:
    """Compare the prediction of replica 0's share of the stretch's last step (100 samples,
    global batches of ``stretch_global(replicas)``) with what ``make_dist_dataset`` gave it."""
    n = len(sizes)
    gb = stretch_global(n)
    per, last = gb // n, _N_SAMPLES % gb or gb
    reveal(guess, sizes[0], close=guess.value == sizes[0],
           explanation=f"Each replica takes whole batches of {per} from the pipeline in turn, so "
                       f"the {last} samples left at the end fill replica 0's batch first: "
                       f"{'+'.join(map(str, sizes))}. A replica with no samples still runs the "
                       f"step, and the mean of no losses is 0/0.")


def _one_device(global_batch: int, divisors) -> list:
    """SGD on one device over the stretch's batches of ``global_batch``: in each step, the
    samples replica r would hold (whole per-replica batches in turn) have their summed loss
    divided by ``divisors(r, sizes)``, ``sizes`` being that step's per-replica sizes; dividing
    every replica's sum by ``sum(sizes)`` is the right step."""
    x, y = stretch_data()
    model = _stretch_model()
    opt = keras.optimizers.SGD(learning_rate=0.5)
    for step, sizes in enumerate(_SPLITS[global_batch]):
        start = step * global_batch
        with tf.GradientTape() as tape:
            losses = mirrored.per_example_loss(y[start:start + sum(sizes)],
                                               model(x[start:start + sum(sizes)]))
            loss, at = 0.0, 0
            for r, k in enumerate(sizes):
                if k:
                    loss = loss + tf.reduce_sum(losses[at:at + k]) / float(divisors(r, sizes))
                at += k
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return model.get_weights()


_SPLITS: dict = {}


def _stretch_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
    model.set_weights([np.full((8, 10), 0.01, np.float32) * np.arange(10, dtype=np.float32),
                       np.zeros(10, np.float32)])
    return model


@recorded
def check_partial_batch_epoch(train_epoch, strategy) -> None:
    """Stretch: ``train_epoch(strategy, model, optimizer, dist_dataset)`` over 100 samples in
    global batches of ``stretch_global(replicas)`` must take the steps one device takes —
    including the last step, where the replicas hold unequal slices (4 + 0 on 2 replicas,
    12 + 12 + 4 on 3). Tried on the lab's strategy and on one with a replica more."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        _check_epoch_once(train_epoch, strat, stretch_global(n))
        tried.append(f"{'+'.join(map(str, _expected_split(n, stretch_global(n))[-1]))} on {n}")
    passed("train_epoch: every step, the short last one too, equals one device on the same "
           f"batch (last steps {', '.join(tried)} replicas)")


def _check_epoch_once(train_epoch, strategy, gb: int) -> None:
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    last = _expected_split(n, gb)[-1]
    _SPLITS[gb] = _expected_split(n, gb)
    at = f"(global batch {gb} on {n} replicas; the last step's {sum(last)} samples as " \
         f"{'+'.join(map(str, last))})"

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(gb))

    with strategy.scope():
        model = _stretch_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
    try:
        train_epoch(strategy, model, optimizer, strategy.distribute_datasets_from_function(dataset_fn))
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        first = str(exc).splitlines()[0] if str(exc) else ""
        if isinstance(exc, (AttributeError, TypeError, ValueError)) and (
                "'int' object" in first or "NoneType" in first):
            fail(f"train_epoch raised {type(exc).__name__} {at}: {first} — a Python number (or "
                 f"None) reached a TensorFlow operation. A static shape such as x.shape[0] is a "
                 f"Python int (None while the step is traced), and the replica context reduces "
                 f"tensors only.", fix="Count the samples with a tensor operation.")
        fail(f"train_epoch raised {type(exc).__name__} {at}: {first}")
    got = model.get_weights()
    if not all(np.all(np.isfinite(w)) for w in got):
        fail(f"the weights became NaN {at}: in the last step a replica with no samples divided "
             f"its loss by its own count, and the mean of nothing is 0/0.",
             fix="Divide the summed loss by the step's global sample count instead.")

    def same(divisors):
        return all(_close(a, b, rtol=1e-4) for a, b in zip(got, _one_device(gb, divisors)))

    if same(lambda r, sizes: sum(sizes)):
        return
    if same(lambda r, sizes: gb):
        fail(f"the last step was too small {at}: its {sum(last)} samples were divided by the "
             f"full global batch ({gb}), a number fixed before the epoch — but a short last "
             f"step holds fewer samples, and only the step itself can tell how many.",
             fix="Divide by this step's sample count, summed over the replicas inside the step.")
    if gb != _GLOBAL and same(lambda r, sizes: _GLOBAL):
        fail(f"every step's loss was divided by a fixed {_GLOBAL} {at}: the global batch here is "
             f"{gb}, and the last step holds {sum(last)} — a number written into the function "
             f"holds for one dataset only.",
             fix="Count the step's samples inside the step, summed over the replicas.")
    if same(lambda r, sizes: sizes[r] * n):
        empty = [r for r, k in enumerate(last) if k == 0]
        nan = (f" (replica {empty[0]} holds none: its own mean is 0/0, NaN from reduce_mean — "
               f"compute_average_loss's div_no_nan reports 0 — while its gradient, a sum over "
               f"no sample, is zero and moves nothing)" if empty else "")
        fail(f"the last step was wrong {at}: each replica's loss was divided by its own slice "
             f"size times the replica count (compute_average_loss without global_batch_size, or "
             f"a local mean divided by the replica count, assume every replica holds as many "
             f"samples as this one), but the last step's slices differ{nan}: a replica's own "
             f"slice does not tell how many samples the whole step holds.",
             fix="Ask the other replicas: sum the replicas' counts inside the step.")
    if same(lambda r, sizes: float("inf") if sum(sizes) < gb else sum(sizes)):
        fail(f"the last, partial step changed nothing {at}: its {sum(last)} samples were never "
             f"trained on.", fix="Train on the short last step too.")
    fail(f"after one epoch the weights differ from one device on the same batches {at}, by a "
         f"scaling the check does not recognise.",
         fix="Divide each replica's summed loss by the step's global sample count, then apply "
             "the gradients.")
