"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces:

* ``per_replica_loss(labels, logits, global_batch)`` — the loss one replica differentiates;
* ``make_model_and_optimizer(strategy, lr)`` — the Keras CNN and an SGD optimizer;
* ``distributed_train_step(strategy, model, optimizer, dist_batch, global_batch)`` — one step,
  returning the global batch's mean loss and accuracy.

Each check runs the learner's code on a fixed global batch from fixed weights, computes the right
answer on one device without any strategy, and compares. Wrong answers that leave a known trace
are named: the per-replica ``reduce_mean`` (gradient and step N times too big), reducing a
per-replica mean with SUM (N times too big) or a per-replica share of a sum with MEAN (N times
too small), and variables created outside ``strategy.scope()``.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""

from __future__ import annotations

import numpy as np

from dpcourse import data as _data
from dpcourse import mirrored
from dpcourse.checks import fail, passed

tf = mirrored.tf
keras = mirrored.keras

__all__ = ["check_per_replica_loss", "check_model_and_optimizer", "check_train_step", "reference_batch"]

_RTOL = 1e-3


def reference_batch(global_batch: int = 64, seed: int = 5):
    """A fixed global batch (normalised NHWC float32 images, int64 labels)."""
    ds = _data.load("shapes10", n_train=global_batch, n_test=1, seed=seed)
    return _data.normalize(ds.x_train), ds.y_train


def _ratio(got: float, want: float) -> float:
    return float(got) / float(want) if want != 0 else float("inf")


def _close(a, b, rtol=_RTOL) -> bool:
    return bool(np.allclose(a, b, rtol=rtol, atol=1e-6))


def check_per_replica_loss(per_replica_loss, num_replicas: int = 2) -> None:
    """The loss of one replica's slice must be its per-example losses summed and divided by the
    *global* batch size (what ``tf.nn.compute_average_loss`` does)."""
    x, y = reference_batch(16, seed=1)
    local = len(y) // num_replicas
    global_batch = len(y)
    logits = tf.constant(np.random.default_rng(0).normal(size=(local, 10)).astype(np.float32))
    labels = tf.constant(y[:local])
    try:
        got = per_replica_loss(labels, logits, global_batch)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        fail(f"per_replica_loss raised {type(exc).__name__}: {exc}")
    got = np.asarray(got)
    if got.shape != ():
        fail(f"per_replica_loss must return one number (a scalar tensor), got shape {got.shape}: "
             f"reduce the per-example losses.")
    losses = mirrored.per_example_loss(labels, logits).numpy()
    right = losses.sum() / global_batch
    if _close(got, right):
        passed("per_replica_loss divides this replica's summed loss by the global batch")
        return
    if _close(got, losses.mean()):
        fail(f"per_replica_loss uses reduce_mean over the replica's own {local} examples; divide "
             f"the sum by the global batch ({global_batch}) with tf.nn.compute_average_loss, "
             f"because the strategy sums the replicas' gradients.")
    if _close(got, losses.sum()):
        fail("per_replica_loss returns the sum of the per-example losses; divide it by the global "
             "batch size (tf.nn.compute_average_loss(..., global_batch_size=global_batch)).")
    fail(f"per_replica_loss returned {float(got):.5f} where {right:.5f} (sum of the replica's "
         f"per-example cross-entropies / global batch) was expected.")


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


def check_model_and_optimizer(make_model_and_optimizer, strategy, lr: float = 0.1):
    """The model and optimizer must both be created under ``strategy.scope()``. Returns them."""
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


def check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int = 64, lr: float = 0.1) -> None:
    """One step of the learner's loop from fixed weights on a fixed global batch must give the
    single-device result: the same updated weights, the mean loss and the accuracy of the batch."""
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
        fail(f"one step changed the weights by {step_ratio:.3g} times the single-device SGD "
             f"step (expected 1): compute each replica's loss on its slice, take its gradient "
             f"and apply it inside strategy.run.")

    if not _close(loss, ref_loss, rtol=1e-3):
        r = _ratio(loss, ref_loss)
        if abs(r - n) < 0.01 * n:
            fail(f"the loss is {n}x too big: the per-replica losses were reduced with SUM where "
                 f"MEAN is meant (each was a mean over its own examples).")
        if abs(r - 1 / n) < 0.01 / n:
            fail(f"the loss is {n}x too small: the per-replica losses are shares of the global "
                 f"mean (already divided by the global batch), so reduce them with SUM, not MEAN.")
        fail(f"the reduced loss is {loss:.5f}, but the mean loss over the global batch before "
             f"the step is {ref_loss:.5f}.")
    if not _close(acc, ref_acc, rtol=1e-3):
        r = _ratio(acc, ref_acc)
        if abs(r - n) < 0.01 * n:
            fail(f"the accuracy is {n}x too big: each replica's accuracy is a mean over its own "
                 f"examples, so reduce it with MEAN; SUM is used where MEAN is meant.")
        if abs(r - 1 / n) < 0.01 / n:
            fail(f"the accuracy is {n}x too small: it was reduced with MEAN although each "
                 f"replica's value was already divided by the global batch; use SUM then.")
        fail(f"the reduced accuracy is {acc:.4f}, but the global batch's accuracy before the "
             f"step is {ref_acc:.4f}.")
    passed(f"one step on {n} replicas == one device on the global batch "
                  f"(weights, loss {ref_loss:.3f}, accuracy {ref_acc:.3f})")
