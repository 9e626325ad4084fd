"""Lab 05's answers, measured on a ``MirroredStrategy`` (lesson 05 runs them folded, after its
lab's pointer: open them once your lab passes).

Each function claims (``dpcourse.checks.claim``) what a part of lab 05 asks: where an optimizer
must be made for its step counter to be mirrored (part 2), and what each replica runs, and what
a Keras loss returns, in an epoch's last step of one sample (part 0's prediction).

TensorFlow comes from :mod:`dpcourse.tf_quiet`, which quiets it before importing it.
"""

from __future__ import annotations

import numpy as np

from dpcourse.tf_quiet import keras, tf

__all__ = ["measure_optimizer_counter", "measure_last_step", "measure_pairings"]


def measure_optimizer_counter(strategy, lr: float) -> None:
    """Claims where an SGD must be constructed for its step counter to be mirrored: one made
    outside ``strategy``'s scope and built inside it, against ``mirrored.optimizer_in``'s.

    Shown in lesson 05, §5.
    """
    from dpcourse import mirrored
    from dpcourse.checks import claim

    made_outside = keras.optimizers.SGD(learning_rate=lr)   # constructed outside the scope ...
    with strategy.scope():
        w_probe = tf.Variable(1.0)
        made_outside.build([w_probe])                       # ... built inside it
    made_inside = mirrored.optimizer_in(strategy, lr, build_for=[w_probe])
    kinds = {name: type(o.iterations.value).__name__
             for name, o in (("outside", made_outside), ("inside", made_inside))}
    claim("an SGD constructed outside the scope and built inside keeps an unmirrored step "
          "counter (its constructor made it); optimizer_in's is mirrored",
          kinds == {"outside": "ResourceVariable", "inside": "MirroredVariable"}, kinds=kinds)


def measure_pairings(strategy, model, x: np.ndarray, y: np.ndarray, g_single) -> dict:
    """Claims six of lesson 05's seven pairings of a per-replica loss with a way to combine the
    replicas' gradients (part of lab 05 part 1's answer): the norm of the gradient each gives
    for the global batch (``x``, ``y``, split evenly) against ``g_single``, one device's.
    Prints and returns the ratios, keyed by (loss, combination).

    Shown in lesson 05, §5.
    """
    from dpcourse import mirrored
    from dpcourse.checks import claim

    def norm(grads):
        return float(np.sqrt(sum(np.sum(g * g) for g in grads)))

    pairs = [("compute_average_loss", "sum"), ("reduce_mean", "sum"),
             ("compute_average_loss", "mean"), ("reduce_mean", "mean"), ("keras", "sum"),
             ("keras_over_replicas", "sum")]
    n = strategy.num_replicas_in_sync
    single = norm(g_single)
    print(f"N = {n} replicas; |gradient| on one device: {single:.4f}")
    ratios = {}
    for loss_kind, reduce_kind in pairs:
        loss_arg = "global" if loss_kind == "compute_average_loss" else loss_kind
        size = norm(mirrored.mirrored_gradients(strategy, model, x, y, loss_arg,
                                                grad_reduce=reduce_kind))
        ratios[loss_kind, reduce_kind] = size / single
        print(f"  {loss_kind:21s} + {reduce_kind.upper():4s}: |gradient| = {size:.4f} "
              f"= {ratios[loss_kind, reduce_kind]:.3f} x the right one")
    claim("compute_average_loss + SUM is right (ratio 1, to 1e-4)",
          abs(ratios["compute_average_loss", "sum"] - 1) < 1e-4, ratios=ratios)
    claim("reduce_mean + SUM is N times too big (to 1e-4 relative)",
          abs(ratios["reduce_mean", "sum"] - n) < 1e-4 * n, ratios=ratios)
    claim("compute_average_loss + MEAN is N× too small (to 1e-4)",
          abs(ratios["compute_average_loss", "mean"] - 1 / n) < 1e-4, ratios=ratios)
    claim("reduce_mean + MEAN (DDP's pairing) is right too (to 1e-4)",
          abs(ratios["reduce_mean", "mean"] - 1) < 1e-4, ratios=ratios)
    claim("a Keras loss object as is + SUM is right (to 1e-4): Keras scaled it",
          abs(ratios["keras", "sum"] - 1) < 1e-4, ratios=ratios)
    claim("a Keras loss object divided by num_replicas_in_sync + SUM is N× too small (to 1e-4)",
          abs(ratios["keras_over_replicas", "sum"] - 1 / n) < 1e-4, ratios=ratios)
    return ratios


def measure_last_step(strategy, model, x: np.ndarray, y: np.ndarray,
                      global_batch: int) -> None:
    """Claims what an epoch's last step of one sample does under ``strategy``: each replica's
    slice, which replicas ``strategy.run`` calls, and what a Keras loss object (default
    reduction) returns on an empty slice, eagerly and in three kinds of ``tf.function``.
    ``model`` is a mirrored Keras model; ``x``, ``y`` at least one example.

    Shown in lesson 05, §5.
    """
    from dpcourse.checks import claim

    n_replicas = strategy.num_replicas_in_sync
    sce = keras.losses.SparseCategoricalCrossentropy
    logits = model(x[:1])
    one_sample = tf.data.Dataset.from_tensor_slices((x[:1], y[:1])).batch(global_batch)
    x_last, y_last = next(iter(strategy.experimental_distribute_dataset(one_sample)))
    sizes = [int(t.shape[0]) for t in strategy.experimental_local_results(x_last)]
    called_on = []   # the replica of every step_fn call

    def step_fn(x, y):
        called_on.append(int(tf.distribute.get_replica_context().replica_id_in_sync_group))
        return tf.shape(y)[0]

    strategy.run(step_fn, args=(x_last, y_last))
    claim("a last step of one sample: replica 0 gets the sample, every other replica an empty "
          "slice", sizes == [1] + [0] * (n_replicas - 1), sizes=sizes)
    claim("strategy.run calls step_fn on every replica, the empty ones too",
          sorted(called_on) == list(range(n_replicas)), called_on=called_on)
    with strategy.scope():
        empty = sce(from_logits=True)(y[:0], logits[:0])
    claim("eagerly, on an empty slice the default reduction returns the empty value unscaled: "
          "shape (0,)", tuple(empty.shape) == (0,), shape=tuple(empty.shape))

    @tf.function(input_signature=[tf.TensorSpec([None], y.dtype),
                                  tf.TensorSpec([None, logits.shape[-1]], logits.dtype)])
    def traced_keras_loss(y, logits):   # batch dimension unknown while tracing, as in fit
        return sce(from_logits=True)(y, logits)

    with strategy.scope():
        traced_empty = traced_keras_loss(y[:0], logits[:0])
    claim("in a tf.function with an unknown batch dimension, the same empty slice gives a "
          "scalar 0.0",
          tuple(traced_empty.shape) == () and float(traced_empty) == 0.0,
          shape=tuple(traced_empty.shape), value=float(traced_empty))
    traced_shapes = []   # the x shape each replica's loss_fn was traced with

    @tf.function          # plain: traced with the shapes of the batch it is called on
    def plain_traced_step(x, y):
        def loss_fn(x, y):
            traced_shapes.append(tuple(x.shape))
            return sce(from_logits=True)(y, model(x))
        return strategy.run(loss_fn, args=(x, y))

    per_replica_shapes = [tuple(t.shape) for t in
                          strategy.experimental_local_results(plain_traced_step(x_last, y_last))]
    claim("a plain @tf.function over strategy.run traces each replica with its slice's concrete "
          "shape, so the empty replicas' Keras loss has shape (0,) there too, as eagerly",
          sorted(s[0] for s in traced_shapes) == [0] * (n_replicas - 1) + [1]
          and per_replica_shapes == [()] + [(0,)] * (n_replicas - 1),
          traced_shapes=traced_shapes, per_replica_shapes=per_replica_shapes)
    iterator_shapes = []

    @tf.function
    def step_on_iterator(iterator):   # reads its batch inside the function, as fit does
        def loss_fn(x, y):
            iterator_shapes.append(tuple(x.shape))
            return sce(from_logits=True)(y, model(x))
        return strategy.run(loss_fn, args=next(iterator))

    from_iterator = strategy.experimental_local_results(
        step_on_iterator(iter(strategy.experimental_distribute_dataset(one_sample))))
    claim("with the batch read from an iterator inside the tf.function, the trace has batch size "
          "None and every replica's loss is a scalar: 0.0 on the empty ones",
          all(s[0] is None for s in iterator_shapes)
          and [tuple(t.shape) for t in from_iterator] == [()] * n_replicas
          and [float(t) for t in from_iterator[1:]] == [0.0] * (n_replicas - 1),
          iterator_shapes=iterator_shapes, losses=[float(t) for t in from_iterator])
