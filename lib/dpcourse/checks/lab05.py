"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces:

* ``per_replica_loss(labels, logits, global_batch)`` — the loss one replica differentiates;
* ``make_model_and_optimizer(strategy, lr)`` — the Keras CNN and an SGD optimizer;
* ``distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)`` — one step,
  returning the global batch's mean loss and accuracy.

Each check runs the learner's code on fixed global batches from fixed weights — two global batch
sizes, and, when TensorFlow has a spare logical device, one replica more than the lab's strategy
(so a number tied to one batch size or to 2 replicas fails) — computes the right answer on one
device without any strategy, and compares. The loss is checked inside ``strategy.run``, where a
training step calls it (so ``tf.nn.compute_average_loss`` without ``global_batch_size``, which
reads the replica count from the replica context, is accepted). Wrong answers that leave a known trace
are named: the per-replica ``reduce_mean`` (gradient and step N times too big), reducing a
per-replica mean with SUM (N times too big) or a per-replica share of a sum with MEAN (N times
too small), and variables created outside ``strategy.scope()``.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""

from __future__ import annotations

import numpy as np

from dpcourse import data as _data
from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded

tf = mirrored.tf
keras = mirrored.keras

__all__ = ["check_per_replica_loss", "check_model_and_optimizer", "check_train_step",
           "reference_batch", "strategies_for", "check_dataset_fn", "check_partial_batch_epoch"]

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


@recorded
def check_per_replica_loss(per_replica_loss, strategy) -> None:
    """Inside ``strategy.run``, each replica's loss must be its per-example losses summed and
    divided by the *global* batch size (what ``tf.nn.compute_average_loss`` does)."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        for global_batch in (6 * n, 4 * n):
            _check_loss_once(per_replica_loss, strat, global_batch)
            tried.append(f"{global_batch} on {n}")
    passed("per_replica_loss divides each replica's summed loss by the global batch (tried "
           + ", ".join(tried) + " replicas)")


def _check_loss_once(per_replica_loss, strat, global_batch: int) -> None:
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
        fail(f"per_replica_loss raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    got = _local(strat, out)
    labels, lgs = _local(strat, batch[0]), _local(strat, batch[1])
    for g, lab, lg in zip(got, labels, lgs):
        if g.shape != ():
            fail(f"per_replica_loss must return one number (a scalar tensor), got shape "
                 f"{g.shape}: reduce the per-example losses.")
        losses = mirrored.per_example_loss(lab, lg).numpy()
        right = losses.sum() / global_batch
        if _close(g, right):
            continue
        local = len(lab)
        if _close(g, losses.mean()):
            fail(f"per_replica_loss uses reduce_mean over the replica's own {local} examples; "
                 f"divide the sum by the global batch ({global_batch}) with "
                 f"tf.nn.compute_average_loss, because the strategy sums the replicas' "
                 f"gradients.")
        if _close(g, losses.sum()):
            fail("per_replica_loss returns the sum of the per-example losses; divide it by the "
                 "global batch size (tf.nn.compute_average_loss(..., "
                 "global_batch_size=global_batch)).")
        k = losses.sum() / float(g) if float(g) else 0.0
        if k > 0 and abs(k - round(k)) < 1e-3 and round(k) != global_batch:
            fail(f"per_replica_loss divided the summed loss by {round(k)}, but the global batch "
                 f"here is {global_batch} on {n} replicas: use the global_batch argument, not a "
                 f"fixed number.")
        fail(f"per_replica_loss returned {float(g):.5f} where {right:.5f} (sum of the replica's "
             f"per-example cross-entropies / global batch {global_batch}) was expected.")


def _outside_scope(strategy, model, optimizer) -> str | None:
    # Keras 3 wraps each tf.Variable in a keras.Variable; the strategy knows the inner one.
    outside = [v.name for v in model.variables
               if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]
    if outside:
        return (f"the model's variables (e.g. {outside[0]!r}) were created outside "
                f"strategy.scope(): build the model inside `with strategy.scope():` so each "
                f"replica holds a mirrored copy.")
    made_under = getattr(optimizer, "_distribution_strategy", strategy)
    if made_under is not strategy:
        return ("the optimizer was created outside strategy.scope(): create it inside "
                "`with strategy.scope():` too, so its slots are mirrored and its updates are "
                "all-reduced.")
    return None


@recorded
def check_model_and_optimizer(make_model_and_optimizer, strategy, lr: float = 0.1):
    """The model and optimizer must both be created under ``strategy.scope()``. Returns them."""
    __tracebackhide__ = True
    try:
        model, optimizer = make_model_and_optimizer(strategy, lr)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_model_and_optimizer raised {type(exc).__name__}: {exc}")
    if not isinstance(model, keras.Model) or not isinstance(optimizer, keras.optimizers.Optimizer):
        fail("make_model_and_optimizer must return (keras model, keras optimizer), got "
             f"({type(model).__name__}, {type(optimizer).__name__}).")
    problem = _outside_scope(strategy, model, optimizer)
    if problem:
        fail(problem)
    passed("the model and the optimizer are created under strategy.scope()")
    return model, optimizer


@recorded
def check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int = 64, lr: float = 0.1) -> None:
    """One step of the learner's loop from fixed weights on a fixed global batch must give the
    single-device result: the same updated weights, the mean loss and the accuracy of the batch.
    Tried with ``global_batch`` and three quarters of it, on the lab's strategy and (when TF has
    a spare device) on one with a replica more."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        # multiples of n: an even split, where every right answer agrees
        for gb in (global_batch // n * n, (global_batch * 3 // 4) // n * n):
            ref_loss, ref_acc = _check_step_once(distributed_train_step, make_model_and_optimizer,
                                                 strat, gb, lr)
            tried.append(f"{gb} on {n}")
    passed(f"one step == one device on the global batch (weights, loss, accuracy; tried "
           + ", ".join(tried) + " replicas)")


def _check_step_once(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int, lr: float):
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    x, y = reference_batch(global_batch)
    # The reference: one device, mean loss over the whole global batch, plain SGD.
    ref = mirrored.build_keras_cnn(seed=3)
    start = [w.copy() for w in ref.get_weights()]
    logits = ref(x, training=False).numpy()
    ref_loss = float(mirrored.per_example_loss(y, logits).numpy().mean())
    ref_acc = float(np.mean(np.argmax(logits, -1) == y))
    grads = mirrored.single_replica_gradients(ref, x, y)
    ref_delta = [-lr * g for g in grads]  # the step SGD must take (trainable vars == all vars)

    model, optimizer = make_model_and_optimizer(strategy, lr)
    problem = _outside_scope(strategy, model, optimizer) if isinstance(model, keras.Model) else None
    if problem:
        fail(problem)
    if len(model.get_weights()) != len(start):
        fail("make_model_and_optimizer must build mirrored.build_keras_cnn() (the lesson's CNN).")
    model.set_weights(start)
    dist_batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))))
    try:
        out = distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"distributed_train_step raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        fail("distributed_train_step must return (loss, accuracy), each reduced over replicas "
             "with strategy.reduce.")
    try:
        loss, acc = (float(np.asarray(v)) for v in out)
    except (TypeError, ValueError):
        fail("distributed_train_step returned per-replica values; reduce each to one number "
             "with strategy.reduce(..., axis=None).")

    delta = [w - s for w, s in zip(model.get_weights(), start)]
    size = sum(float(np.sum(d * d)) for d in delta) ** 0.5
    ref_size = sum(float(np.sum(d * d)) for d in ref_delta) ** 0.5
    if size == 0:
        fail("the weights did not change: apply the gradients with "
             "optimizer.apply_gradients inside the function you pass to strategy.run.")
    step_ratio = size / ref_size
    if not all(_close(d, r, rtol=1e-2) for d, r in zip(delta, ref_delta)):
        if abs(step_ratio - n) < 0.05 * n:
            fail(f"the update is {n}x too big ({n} replicas): the per-replica loss uses "
                 f"reduce_mean over the replica's own examples instead of "
                 f"tf.nn.compute_average_loss with the global batch, and the replicas' "
                 f"gradients are then summed.")
        if abs(step_ratio - 1 / n) < 0.05 / n:
            fail(f"the update is {n}x too small: the loss was divided by the global batch and "
                 f"then averaged over the replicas again; the strategy already sums the "
                 f"replicas' gradients, so divide only once.")
        for k in (2, 3, 4):
            if k != n and abs(step_ratio - n / k) < 0.02 * n / k:
                fail(f"on {n} replicas the update is {n}/{k} of the right one: the loss was "
                     f"divided by a fixed {k} replicas — use the global batch (or the replica "
                     f"context's num_replicas_in_sync), not a number that holds on {k} only.")
        k = global_batch / step_ratio
        if abs(k - round(k)) < 0.02 * k and round(k) not in (global_batch, 0):
            fail(f"with a global batch of {global_batch} on {n} replicas the update is "
                 f"{step_ratio:.3g} times the right one: the loss was divided by a fixed "
                 f"{round(k)}, not by this step's global batch — use the global_batch argument.")
        fail(f"one step changed the weights by {step_ratio:.3g} times the single-device SGD "
             f"step (expected 1): compute each replica's loss on its slice, take its gradient "
             f"and apply it inside strategy.run.")

    # (what, reduced, its format, expected, what that is, why n times too big, too small)
    for what, got, fmt, want, want_is, too_big, too_small in (
            ("loss", loss, ".5f", ref_loss,
             f"the mean loss over the global batch before the step is {ref_loss:.5f}",
             "the per-replica losses were reduced with SUM where MEAN is meant (each was a mean "
             "over its own examples).",
             "the per-replica losses are shares of the global mean (already divided by the "
             "global batch), so reduce them with SUM, not MEAN."),
            ("accuracy", acc, ".4f", ref_acc,
             f"the global batch's accuracy before the step is {ref_acc:.4f}",
             "each replica's accuracy is a mean over its own examples, so reduce it with MEAN; "
             "SUM is used where MEAN is meant.",
             "it was reduced with MEAN although each replica's value was already divided by the "
             "global batch; use SUM then.")):
        if _close(got, want, rtol=1e-3):
            continue
        r = _ratio(got, want)
        if abs(r - n) < 0.01 * n:
            fail(f"the {what} is {n}x too big: {too_big}")
        if abs(r - 1 / n) < 0.01 / n:
            fail(f"the {what} is {n}x too small: {too_small}")
        fail(f"the reduced {what} is {got:{fmt}}, but {want_is}.")
    return ref_loss, ref_acc


# --- stretch: datasets from a function, and a partial last batch ---------------------------

_N_SAMPLES, _GLOBAL = 100, 32  # 32 + 32 + 32 + 4: on 2 replicas the last step is 4 and 0


def _stretch_data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(_N_SAMPLES, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=_N_SAMPLES).astype(np.int64)
    return x, y


@recorded
def check_dataset_fn(make_dist_dataset, strategy) -> None:
    """Stretch: ``make_dist_dataset(strategy, x, y, global_batch)`` built with
    ``strategy.distribute_datasets_from_function`` must give, at every step, the next
    ``global_batch`` samples in order, split over the replicas — the short last step included."""
    __tracebackhide__ = True
    x, y = _stretch_data()
    try:
        dist = make_dist_dataset(strategy, x, y, _GLOBAL)
        steps = [np.concatenate(_local(strategy, b[1])) for b in dist]
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_dist_dataset raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    sizes = [len(s) for s in steps]
    want = [min(_GLOBAL, _N_SAMPLES - i) for i in range(0, _N_SAMPLES, _GLOBAL)]
    if sizes == want and all(np.array_equal(s, y[i * _GLOBAL:i * _GLOBAL + len(s)])
                             for i, s in enumerate(steps)):
        passed(f"make_dist_dataset: steps of {_GLOBAL} samples over "
               f"{strategy.num_replicas_in_sync} replicas, the short last step kept")
        return
    n = strategy.num_replicas_in_sync
    if sizes and sizes[0] == _GLOBAL * n:
        fail(f"each replica got {_GLOBAL} samples per step, so a step holds {_GLOBAL * n}: batch "
             f"each replica's dataset with input_context.get_per_replica_batch_size(global_batch).")
    if sum(sizes) < _N_SAMPLES:
        fail(f"an epoch gave {sum(sizes)} of {_N_SAMPLES} samples (steps of {sizes}): keep the "
             f"partial last batch (no drop_remainder) — this exercise is about handling it.")
    fail(f"the steps hold {sizes} samples (expected {want}, in the data's order): shard by "
         f"input_context and batch by the per-replica batch size, without shuffling.")


def _one_device(scale_full: float, scale_last: float) -> list:
    """SGD on one device over batches of _GLOBAL, each step's gradient scaled (1, 1 is right)."""
    x, y = _stretch_data()
    model = _stretch_model()
    opt = keras.optimizers.SGD(learning_rate=0.5)
    for i in range(0, _N_SAMPLES, _GLOBAL):
        xb, yb = x[i:i + _GLOBAL], y[i:i + _GLOBAL]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(mirrored.per_example_loss(yb, model(xb)))
            loss = loss * (scale_last if len(yb) < _GLOBAL else scale_full)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return model.get_weights()


def _stretch_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
    model.set_weights([np.full((8, 10), 0.01, np.float32) * np.arange(10, dtype=np.float32),
                       np.zeros(10, np.float32)])
    return model


@recorded
def check_partial_batch_epoch(train_epoch, strategy) -> None:
    """Stretch: ``train_epoch(strategy, model, optimizer, dist_dataset)`` over 100 samples in
    global batches of 32 must take the steps one device takes — including the last step, where
    one replica has 4 samples and the other none."""
    __tracebackhide__ = True
    x, y = _stretch_data()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(_GLOBAL))

    with strategy.scope():
        model = _stretch_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
    try:
        train_epoch(strategy, model, optimizer, strategy.distribute_datasets_from_function(dataset_fn))
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"train_epoch raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    got = model.get_weights()
    if not all(np.all(np.isfinite(w)) for w in got):
        fail("the weights became NaN: in the last step one replica has no samples, and the mean "
             "of nothing is NaN (0/0). Divide the summed loss by the step's global sample count "
             "instead.")

    def same(ws):
        return all(_close(a, b, rtol=1e-4) for a, b in zip(got, ws))

    if same(_one_device(1, 1)):
        passed("train_epoch: every step, the short last one too, equals one device on the same "
               "batch")
        return
    n = strategy.num_replicas_in_sync
    if same(_one_device(1, 4 / _GLOBAL)):
        fail(f"the last step was too small: its 4 samples were divided by the full global batch "
             f"({_GLOBAL}). Divide by the number of samples this step really has, summed over "
             f"the replicas (replica context's all_reduce of tf.shape(y)[0]).")
    if same(_one_device(1, 1 / n)):
        fail(f"the last step was {n} times too small: its loss was divided as if every replica "
             f"held as many samples as the one that has them (compute_average_loss without "
             f"global_batch_size, or a local mean divided by the replica count, assume that), "
             f"but one replica has none. Divide by the step's real global count (all_reduce "
             f"of the local sizes).")
    if same(_one_device(1, 0)):
        fail("the last, partial step changed nothing: train on it too.")
    fail("after one epoch the weights differ from one device on the same batches: divide each "
         "replica's summed loss by the step's global sample count, then apply the gradients.")
