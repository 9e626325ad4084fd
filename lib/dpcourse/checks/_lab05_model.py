"""Lab 05 part 2: ``make_model_and_optimizer(strategy, lr, start=None)``. The model and a plain
SGD optimizer must both be created under the strategy given (tried on the lab's strategy and on
one with a replica more), with the learning rate asked for (two are tried); with ``start`` (a
one-device CNN moved off its initial weights) the mirrored model holds start's current weights
on every replica. The part-3 runner reuses the scope and optimizer checks on every step.

Imported by :mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import _captured_note, keras, strategies_for, tf


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
