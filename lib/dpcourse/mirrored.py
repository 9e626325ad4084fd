"""TensorFlow's data parallelism: MirroredStrategy, Keras fit, a custom loop, multi-worker.

Used by lesson 05 (``lessons/05_mirrored_strategy.py``) and lab 05. Torch-only learners never
import this module: it is the course's TensorFlow side, kept apart from the torch modules.

**The order matters.** TensorFlow fixes its devices the first time anything uses them, so a
notebook must call ``dpcourse.devices.split_tf_devices(n)`` *before* it builds a model or a
dataset here (importing this module is fine: importing TF does not fix the devices yet).

What is here:

* :func:`build_keras_cnn` — the Keras twin of ``dpcourse.models.SmallCNN`` (same layers, same
  parameter count, channels-last), and :func:`copy_torch_weights` / :func:`keras_weights_as_torch`
  to move weights between the two (NCHW vs NHWC flatten order included). They live in
  :mod:`dpcourse.mirrored_keras` and are re-exported here; :func:`mirrored_cnn` and
  :func:`optimizer_in` build the model and its optimizer under a strategy's scope;
* :func:`make_dataset` — a ``tf.data`` pipeline from ``dpcourse.data`` arrays, batched with the
  *global* batch (the strategy splits it over the replicas), with optional cache/prefetch;
* :func:`per_replica_loss`, :func:`train_step`, :func:`mirrored_gradients` — the custom loop with
  ``strategy.run`` / ``strategy.reduce`` / ``tf.nn.compute_average_loss``, and the classic
  ``reduce_mean`` scaling bug as an option (``loss_scaling="reduce_mean"``) so the lesson can
  show its numbers;
* :func:`fit` — Keras ``fit`` under a strategy, silent (``verbose=0``);
* :func:`save_checkpoint` / :func:`restore_checkpoint` — ``tf.train.Checkpoint`` under a strategy;
* :func:`run_multiworker` — ``MultiWorkerMirroredStrategy`` with N worker processes on
  localhost (TF_CONFIG, free ports), bounded in time and killed on error or timeout; the worker
  is ``python -m dpcourse.tf_multiworker_worker``. It lives in
  :mod:`dpcourse.mirrored_multiworker` (it imports no TensorFlow) and is re-exported here.

TensorFlow's chatter (C++ log lines, "INFO:tensorflow", progress bars) would break the
notebooks' stored outputs, so TensorFlow comes from :mod:`dpcourse.tf_quiet`, which sets
``TF_CPP_MIN_LOG_LEVEL=2`` and ``TF_ENABLE_ONEDNN_OPTS=0`` (only if unset) before it imports
TensorFlow, loads triton first, and lowers TF's Python logger to ERROR: the one side effect of
importing this module, and the reason it is here and not in each notebook cell.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpcourse.tf_quiet import _preload_triton, keras, tf  # noqa: F401 - first: TF's env
from dpcourse import data as _data
from dpcourse.mirrored_keras import (build_keras_cnn, copy_torch_weights, keras_weights_as_torch,
                                     set_torch_layout_weights)
from dpcourse.mirrored_multiworker import (MultiWorkerConfig, MultiWorkerError,
                                           MultiWorkerResult, kill_worker, run_multiworker)

__all__ = [
    "build_keras_cnn",
    "copy_torch_weights",
    "mirrored_cnn",
    "optimizer_in",
    "keras_weights_as_torch",
    "set_torch_layout_weights",
    "make_dataset",
    "make_strategy",
    "cross_device_ops_in_use",
    "count_cross_device_calls",
    "per_example_loss",
    "per_replica_loss",
    "train_step",
    "make_train_step",
    "mirrored_gradients",
    "single_replica_gradients",
    "train_steps",
    "fit",
    "evaluate",
    "save_checkpoint",
    "restore_checkpoint",
    "MultiWorkerConfig",
    "MultiWorkerResult",
    "MultiWorkerError",
    "run_multiworker",
    "kill_worker",
    "LOSS_SCALINGS",
    "KERAS_LOSS_SCALINGS",
    "keras_loss_per_replica",
]

LOSS_SCALINGS = ("global", "reduce_mean")
KERAS_LOSS_SCALINGS = ("keras", "keras_over_replicas")


# --------------------------------------------------------------------------------------------
# The model and its optimizer under the strategy (the model itself: dpcourse.mirrored_keras)
# --------------------------------------------------------------------------------------------


def mirrored_cnn(strat, start=None, **build) -> keras.Model:
    """The course's Keras CNN (:func:`build_keras_cnn`, ``build`` its options), its variables
    created under ``strat``'s scope so that they are mirrored; with ``start`` (a torch
    ``SmallCNN``), that model's weights (:func:`copy_torch_weights`).

    Lab 05 part 2's answer (where the model must be built). Shown in lesson 05, §5.
    """
    with strat.scope():
        model = build_keras_cnn(**build)
    return model if start is None else copy_torch_weights(start, model)

def optimizer_in(strat, rate: float, loss_scale: bool = False, build_for=None):
    """Plain SGD at learning rate ``rate``, constructed under ``strat``'s scope so that its
    variables (its step counter too) are mirrored; with ``loss_scale``, wrapped in a
    ``LossScaleOptimizer``; with ``build_for`` (variables), built for them.

    Lab 05 part 2's answer (where the optimizer must be made). Shown in lesson 05, §5.
    """
    with strat.scope():   # the optimizer's variables must be created under the strategy too
        opt = keras.optimizers.SGD(learning_rate=rate)
        if loss_scale:
            opt = keras.optimizers.LossScaleOptimizer(opt)
        if build_for is not None:
            opt.build(build_for)
        return opt

# --------------------------------------------------------------------------------------------
# Input: tf.data with the global batch
# --------------------------------------------------------------------------------------------


def make_dataset(x: np.ndarray, y: np.ndarray, global_batch: int, shuffle: bool = False,
                 seed: int = 0, cache: bool = True, prefetch: bool = True,
                 drop_remainder: bool = True, decode_png: bool = False) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of (normalised float32 NHWC images, int64 labels) batches of
    ``global_batch`` from ``dpcourse.data`` arrays (uint8 NHWC).

    Under a strategy, batch with the *global* batch: ``fit`` and
    ``strategy.experimental_distribute_dataset`` split every batch over the replicas
    (``global_batch / num_replicas_in_sync`` each). ``drop_remainder`` keeps every step's batch
    the same size, so every replica gets equal work.

    ``decode_png=True`` stores each image PNG-encoded and decodes it in the pipeline, like a
    real image folder; that per-image work is what ``cache`` (decode once, keep the result) and
    ``prefetch`` (prepare the next batch while the model trains on this one) save.

    Shown in lesson 05, §3.
    """
    if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} images, {len(y)} labels")
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise TypeError(f"x must be uint8 images shaped (N, H, W, 3) as dpcourse.data gives, "
                        f"got {x.dtype} {x.shape}")
    mean = tf.constant(_data.MEAN)
    std = tf.constant(_data.STD)

    def norm(img):
        return (tf.cast(img, tf.float32) / 255.0 - mean) / std

    labels = tf.constant(np.asarray(y, dtype=np.int64))
    if decode_png:
        encoded = tf.map_fn(tf.io.encode_png, tf.constant(x), fn_output_signature=tf.string)
        ds = tf.data.Dataset.from_tensor_slices((encoded, labels))
        ds = ds.map(lambda s, l: (norm(tf.reshape(tf.io.decode_png(s, channels=3), x.shape[1:])), l))
    else:
        ds = tf.data.Dataset.from_tensor_slices((tf.constant(x), labels))
        ds = ds.map(lambda img, l: (norm(img), l))
    if cache:
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(global_batch, drop_remainder=drop_remainder)
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE)
    return ds


def make_strategy(devices: list[str] | None = None,
                  cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over ``devices`` (the names ``split_tf_devices`` returned).

    ``cross_device_ops=None`` keeps TensorFlow's own choice of how the replicas' gradients are
    summed. In the pinned TF (``tensorflow/python/distribute/mirrored_strategy.py``,
    ``MirroredExtended._make_collective_ops_with_fallbacks``) that is a ``CollectiveAllReduce``
    — an all-reduce among the replicas — with the ``RING`` implementation on CPUs, and on GPUs
    when the process has more logical GPUs than physical ones (any GPU split, whichever the
    strategy uses), else ``NCCL``; ``ReductionToOneDevice`` only when CPUs and GPUs are mixed. Pass
    ``tf.distribute.ReductionToOneDevice()`` to copy the gradients to one device, add them
    there and send the sum back (DataParallel's pattern, lesson 02) instead.

    Shown in lesson 05, §2.
    """
    global _strategies_made
    devices = list(devices) if devices is not None else None
    # Two CollectiveAllReduce strategies of different sizes in one process would both number
    # their collective groups from 1, and TF aborts ("is joining a group with size 3, but that
    # group has size 2"). TF's own tests give each strategy its own range through the class
    # attribute _collective_key_base ("Only set this in tests"); we do the same, one range each.
    _strategies_made += 1
    cls = tf.distribute.MirroredStrategy
    saved = cls._collective_key_base
    cls._collective_key_base = _strategies_made * 100_000
    try:
        return cls(devices, cross_device_ops=cross_device_ops)
    finally:
        cls._collective_key_base = saved


_strategies_made = 0


def cross_device_ops_in_use(strategy) -> tuple[str, str | None]:
    """``(class name, implementation)`` of the cross-device ops ``strategy`` sums gradients with,
    e.g. ``("CollectiveAllReduce", "RING")`` or ``("ReductionToOneDevice", None)``.

    TF has no public getter: this reads the private ``strategy.extended._cross_device_ops``
    and, for a ``CollectiveAllReduce``, its ``_options.implementation`` (as in TF 2.21; a later
    TF may rename them, and then this raises AttributeError).

    Shown in lesson 05, §2.
    """
    ops = strategy.extended._cross_device_ops  # noqa: SLF001 - TF has no public getter
    options = getattr(ops, "_options", None)
    impl = options.implementation.value if options is not None else None
    return type(ops).__name__, impl


class count_cross_device_calls:  # noqa: N801 - a context manager, named for what it does
    """While the ``with`` block runs, count the calls that reach TF's two ways of summing
    across devices: ``counts[(class name, "reduce" | "batch_reduce")]`` calls, and
    ``tensors[...]`` tensors handed over in them.

    It wraps ``reduce_implementation`` and ``batch_reduce_implementation`` of
    ``CollectiveAllReduce`` and ``ReductionToOneDevice`` (``tensorflow/python/distribute/
    cross_device_ops.py``: ``CrossDeviceOps.reduce`` and ``.batch_reduce`` end there) and puts
    them back on exit. A ``tf.function`` runs these Python methods while it is traced, so count
    over a step's first call (its trace).

    Shown in lesson 05, §5.
    """

    def __init__(self):
        self.counts: dict = {}
        self.tensors: dict = {}
        self._saved: list = []

    def __enter__(self):
        from tensorflow.python.distribute import cross_device_ops as cdo

        for cls in (cdo.CollectiveAllReduce, cdo.ReductionToOneDevice):
            for method, kind in (("reduce_implementation", "reduce"),
                                 ("batch_reduce_implementation", "batch_reduce")):
                original = cls.__dict__[method]
                self._saved.append((cls, method, original))

                def wrapper(obj, reduce_op, value, *args, _orig=original,
                            _key=(cls.__name__, kind), **kwargs):
                    self.counts[_key] = self.counts.get(_key, 0) + 1
                    n = len(value) if _key[1] == "batch_reduce" else 1
                    self.tensors[_key] = self.tensors.get(_key, 0) + n
                    return _orig(obj, reduce_op, value, *args, **kwargs)

                setattr(cls, method, wrapper)
        return self

    def __exit__(self, *exc):
        for cls, method, original in reversed(self._saved):
            setattr(cls, method, original)
        self._saved.clear()
        return False


# --------------------------------------------------------------------------------------------
# The custom loop
# --------------------------------------------------------------------------------------------


def per_example_loss(labels, logits):
    """Cross-entropy of each example (no reduction), in float32.

    Shown in lesson 05, §5.
    """
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.cast(labels, tf.int64), logits=tf.cast(logits, tf.float32))


def per_replica_loss(labels, logits, global_batch: int, loss_scaling: str = "global"):
    """The loss one replica differentiates.

    ``"global"`` (right): sum of this replica's per-example losses / ``global_batch``, i.e.
    ``tf.nn.compute_average_loss``. The strategy *sums* the replicas' gradients, so the sum of
    these is the gradient of the mean loss over the whole global batch.

    ``"reduce_mean"`` (the classic bug): the mean over this replica's examples only. Summed over
    N replicas, that gradient is N times the gradient of the global mean.

    Shown in lesson 05, §5.
    """
    losses = per_example_loss(labels, logits)
    if loss_scaling == "global":
        return tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
    if loss_scaling == "reduce_mean":
        return tf.reduce_mean(losses)
    raise ValueError(f"loss_scaling must be one of {LOSS_SCALINGS}, got {loss_scaling!r}")


def keras_loss_per_replica(labels, logits, divide_by_replicas: bool = False):
    """The loss most Keras 3 custom loops write: a Keras loss object called on this replica's
    slice, inside ``strategy.run``.

    Every call of a Keras ``Loss`` with its default reduction under ``tf.distribute`` (not only
    in ``fit``; ``reduction="sum"`` or ``"none"`` is not scaled) takes the mean
    over the replica's own slice and multiplies it by 1 / ``num_replicas_in_sync``
    (``keras/src/losses/loss.py``: ``Loss.__call__`` -> ``reduce_weighted_values`` ->
    ``reduce_values`` -> ``scale_loss_for_distribution``). With ``divide_by_replicas=True`` it
    is divided by the number of replicas once more, as code does that scales a mean loss by
    hand.

    Shown in lesson 05, §5.
    """
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    if divide_by_replicas:
        loss = loss / tf.distribute.get_replica_context().num_replicas_in_sync
    return loss


def train_step(strategy, model, optimizer, dist_batch, global_batch: int,
               loss_scaling: str = "global"):
    """One data-parallel SGD step: every replica runs forward and backward on its slice of the
    global batch, the optimizer sums the gradients over replicas (an all-reduce) and applies
    the same update to every copy of the weights. Returns the mean loss over the global batch.

    Shown in lesson 05, §5.
    """
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = per_replica_loss(y, logits, global_batch, loss_scaling)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduce (SUM) here
        return loss

    per_replica = strategy.run(step_fn, args=dist_batch)
    # Each replica's loss is already divided by the global batch: their SUM is the global mean.
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def make_train_step(strategy, model, optimizer, global_batch: int, loss_scaling: str = "global"):
    """:func:`train_step` compiled with ``tf.function`` (one graph for the whole step).

    The optimizer's per-weight state (momentum, Adam's moments) is built here, under the
    strategy, before the step is traced, so that it is made once, mirrored, rather than
    lazily during the traced function's first call. How ``optimizer`` itself is made is the
    caller's (lab 05 part 2).

    Shown in lesson 05, §5.
    """
    if not optimizer.built:
        # build() adds only per-weight state (none for plain SGD).
        with strategy.scope():
            optimizer.build(model.trainable_variables)

    @tf.function
    def step(dist_batch):
        return train_step(strategy, model, optimizer, dist_batch, global_batch, loss_scaling)
    return step


def mirrored_gradients(strategy, model, x, y, loss_scaling: str = "global",
                       grad_reduce: str = "sum") -> list[np.ndarray]:
    """The gradient a MirroredStrategy step applies for the global batch (``x``, ``y``): each
    replica's gradient on its slice, summed over the replicas by the same call Keras' optimizer
    makes in ``apply_gradients`` (``keras/src/backend/tensorflow/optimizer.py``,
    ``TFOptimizer._all_reduce_sum_gradients``: the replica context's ``all_reduce(SUM, grads)``,
    which goes through the strategy's cross-device ops). Weights are not changed.

    ``grad_reduce="mean"`` averages the replicas' gradients instead — what DDP does, and what
    TF does *not* do.
    ``loss_scaling="keras"`` (``"keras_over_replicas"``) differentiates
    :func:`keras_loss_per_replica` (with ``divide_by_replicas=True``) instead of
    :func:`per_replica_loss`.

    Shown in lesson 05, §5.
    """
    if grad_reduce not in ("sum", "mean"):
        raise ValueError(f"grad_reduce must be 'sum' or 'mean', got {grad_reduce!r}")
    if loss_scaling not in LOSS_SCALINGS + KERAS_LOSS_SCALINGS:
        raise ValueError(f"loss_scaling must be one of {LOSS_SCALINGS + KERAS_LOSS_SCALINGS}, "
                         f"got {loss_scaling!r}")
    op = tf.distribute.ReduceOp.SUM if grad_reduce == "sum" else tf.distribute.ReduceOp.MEAN
    global_batch = len(y)
    n = strategy.num_replicas_in_sync
    if global_batch % n:
        raise ValueError(f"the global batch ({global_batch}) must split evenly over {n} replicas")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    dist_batch = next(iter(strategy.experimental_distribute_dataset(ds)))

    @tf.function
    def grads_of(batch):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                if loss_scaling in KERAS_LOSS_SCALINGS:
                    loss = keras_loss_per_replica(
                        yb, logits, divide_by_replicas=loss_scaling == "keras_over_replicas")
                else:
                    loss = per_replica_loss(yb, logits, global_batch, loss_scaling)
            grads = tape.gradient(loss, model.trainable_variables)
            return tf.distribute.get_replica_context().all_reduce(op, grads)  # as the optimizer
        per_replica = strategy.run(step_fn, args=batch)
        return [strategy.experimental_local_results(g)[0] for g in per_replica]  # all equal

    return [g.numpy() for g in grads_of(dist_batch)]


def single_replica_gradients(model, x, y) -> list[np.ndarray]:
    """The gradient of the mean loss over (``x``, ``y``) on one device, no strategy.

    Shown in lesson 05, §5.
    """
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_loss(y, model(x, training=True)))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def train_steps(strategy, model, optimizer, dataset, steps: int, global_batch: int,
                loss_scaling: str = "global") -> list[float]:
    """Run ``steps`` steps of the custom loop over ``dataset`` (batched with ``global_batch``)
    and return the loss of each step. Pass ``strategy=None`` for one device, no strategy.

    Shown in lesson 05, §5.
    """
    if strategy is None:
        strategy = tf.distribute.get_strategy()  # the default: one device, a no-op strategy
    step = make_train_step(strategy, model, optimizer, global_batch, loss_scaling)
    losses = []
    for batch in strategy.experimental_distribute_dataset(dataset.take(steps)):
        losses.append(float(step(batch)))
    if len(losses) < steps:
        raise ValueError(f"the dataset ran out after {len(losses)} of {steps} steps")
    return losses


# --------------------------------------------------------------------------------------------
# Keras fit, evaluation, checkpoints
# --------------------------------------------------------------------------------------------


def fit(strategy, train_ds, epochs: int = 1, lr: float = 0.05, model: keras.Model | None = None,
        dtype=None, seed: int = 0, optimizer=None) -> keras.Model:
    """Build (unless given), compile and fit the Keras CNN under ``strategy``. Silent.

    Everything that creates variables happens inside ``strategy.scope()``: the model, and the
    optimizer, whose constructor creates its ``iterations`` and ``learning_rate`` variables
    (``keras/src/optimizers/base_optimizer.py``); its per-weight slots (momentum) are created
    when ``fit`` first builds it (``keras/src/trainers/trainer.py``, ``_symbolic_build``), under
    the scope the optimizer was made in — not by ``compile``. ``fit`` itself then splits each
    global batch over the replicas and sums the gradients across them. With a ``mixed_float16`` policy it is ``compile``
    (``keras/src/trainers/trainer.py``, ``Trainer.compile``, ``auto_scale_loss=True``) that wraps
    the optimizer in a ``LossScaleOptimizer`` (float16 gradients underflow otherwise); bfloat16
    needs no scaling.

    Shown in lesson 05, §6.
    """
    with strategy.scope():
        if model is None:
            model = build_keras_cnn(dtype=dtype, seed=seed)
        if optimizer is None:
            optimizer = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    # shuffle=False: a tf.data pipeline shuffles itself (make_dataset(shuffle=True)); Keras
    # would only warn that it ignores its own shuffle flag, into the notebook's output.
    model.fit(train_ds, epochs=epochs, verbose=0, shuffle=False)
    return model


def evaluate(model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int = 500) -> float:
    """Accuracy of ``model`` on uint8 images ``x`` with labels ``y``."""
    correct = 0
    xn = _data.normalize(x)
    for i in range(0, len(y), batch):
        logits = model(xn[i:i + batch], training=False)
        correct += int(np.sum(np.argmax(np.asarray(logits), -1) == y[i:i + batch]))
    return correct / len(y)


def save_checkpoint(directory: str | Path, model: keras.Model, optimizer=None, step: int = 0) -> str:
    """Save ``model`` (and ``optimizer``) with ``tf.train.Checkpoint``; returns the path.

    Under a strategy this saves one copy of each mirrored variable (they are equal), so the
    checkpoint restores under any strategy or none: the number of replicas is not in it.

    Shown in lesson 05, §8.
    """
    ckpt = tf.train.Checkpoint(model=model, step=tf.Variable(step, dtype=tf.int64),
                               **({"optimizer": optimizer} if optimizer is not None else {}))
    return ckpt.save(str(Path(directory) / "ckpt"))


def restore_checkpoint(path: str, model: keras.Model, optimizer=None) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), which must
    be built already (under the strategy that will train it, if any). Returns the saved step.

    ``expect_partial()`` silences TF's warnings about objects not matched (the optimizer's
    slots when only a model is restored); it checks nothing, so compare weights after a restore.

    Shown in lesson 05, §8.
    """
    step = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(model=model, step=step,
                               **({"optimizer": optimizer} if optimizer is not None else {}))
    ckpt.restore(path).expect_partial()
    return int(step.numpy())
