"""Checks for lab 05 (``solutions/lab05_mirrored_strategy.py``): a MirroredStrategy custom loop.

The learner writes three pieces:

* ``per_replica_loss(labels, logits, global_batch)`` — the loss one replica differentiates;
* ``make_model_and_optimizer(strategy, lr)`` — the Keras CNN and an SGD optimizer;
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
every slice is the same size; part 1 tries 3 + 2, part 3 a step split 6 + 2 (+ 2)), reducing a
per-replica mean with SUM (N times too big) or a per-replica share of a sum with MEAN (N times
too small), a loss or accuracy reported as the MEAN of the replicas' own means (right only when
the slices are equal; in part 3's uneven step each slice holds one correctly classified sample,
so the accuracy's mean of means is off too), one replica's value returned instead of a
reduction, a fixed learning rate, variables created outside ``strategy.scope()``, and the
library's own answers (``mirrored.per_replica_loss``, ``mirrored.train_step``) passed in place of
the learner's.

Importing this module imports TensorFlow: split the devices first (lab 05's first cell does).
"""

from __future__ import annotations

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
             f"runs: the lab asks for your own {what}, so that you decide how the loss is scaled "
             f"(write the function in the lab's cell).")


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
                 f"that lesson 05 runs: the lab asks for your own {self.what}, so that you decide "
                 f"how the loss is scaled.")
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
             f"called with lr={lr:.4g}: build the optimizer with the lr argument, not a fixed "
             f"number.")


@recorded
def check_per_replica_loss(per_replica_loss, strategy) -> None:
    """Inside ``strategy.run``, each replica's loss must be its per-example losses summed and
    divided by the *global* batch size — the number of samples the whole step holds, given as
    ``global_batch`` — also when the slices differ in size (a global batch that does not split
    evenly, as a partial last batch does)."""
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
    passed("per_replica_loss divides each replica's summed loss by the global batch (tried "
           + ", ".join(tried) + ")")


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
        fail(f"per_replica_loss raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    got = _local(strat, out)
    labels, lgs = _local(strat, batch[0]), _local(strat, batch[1])
    sizes = [len(lab) for lab in labels]
    for g, lab, lg in zip(got, labels, lgs):
        if g.shape != ():
            fail(f"per_replica_loss must return one number (a scalar tensor), got shape "
                 f"{g.shape}: reduce the per-example losses.")
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
                 f"global_batch_size, and a local mean / N, both assume it). Divide by the "
                 f"global_batch argument.")
        if local and _close(g, losses.mean()):
            fail(f"per_replica_loss uses reduce_mean over the replica's own {local} examples; "
                 f"divide the sum by the global batch ({global_batch}), because the strategy "
                 f"sums the replicas' gradients.")
        if _close(g, losses.sum()):
            fail("per_replica_loss returns the sum of the per-example losses; divide it by the "
                 "global batch size (the global_batch argument).")
        k = losses.sum() / float(g) if float(g) else 0.0
        if k > 0 and abs(k - round(k)) < 1e-3 and round(k) != global_batch:
            fail(f"per_replica_loss divided the summed loss by {round(k)}, but the global batch "
                 f"here is {global_batch} on {n} replicas: use the global_batch argument, not a "
                 f"fixed number.")
        fail(f"per_replica_loss returned {float(g):.5f} where {right:.5f} (sum of the replica's "
             f"per-example cross-entropies / global batch {global_batch}) was expected.")
    return sizes


def _other_lr(lr: float) -> float:
    """A second learning rate, far from the lab's, so that a fixed number shows."""
    return 0.037 if not np.isclose(lr, 0.037) else 0.1


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
    """The model and optimizer must both be created under ``strategy.scope()``, the optimizer
    with the learning rate asked for (tried with ``lr`` and with another one). Returns them."""
    __tracebackhide__ = True
    other_lr = _other_lr(lr)
    try:
        _, other_opt = make_model_and_optimizer(strategy, other_lr)
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
    _check_lr(other_opt, other_lr)
    _check_lr(optimizer, lr)
    passed(f"the model and the optimizer are created under strategy.scope() (lr {other_lr:g} "
           f"and {lr:g} tried)")
    return model, optimizer


@recorded
def check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                     global_batch: int = 64, lr: float = 0.1) -> None:
    """One step of the learner's loop from fixed weights on a fixed global batch must give the
    single-device result: the same updated weights, the mean loss and the accuracy of the batch.
    Tried with ``global_batch`` and three quarters of it, on the lab's strategy and (when TF has
    a spare device) on one with a replica more; the second batch with another learning rate."""
    __tracebackhide__ = True
    _refuse_library(distributed_train_step, "distributed_train_step")
    tried = []
    with _LibrarySpy("per_replica_loss"):
        strategies = strategies_for(strategy)
        for strat in strategies:
            n = strat.num_replicas_in_sync
            # multiples of n: an even split first, where the scaling mistakes show as factors of n
            for gb, step_lr in ((global_batch // n * n, lr),
                                ((global_batch * 3 // 4) // n * n, _other_lr(lr))):
                _check_step_once(distributed_train_step, make_model_and_optimizer,
                                 strat, gb, step_lr)
                tried.append(f"{gb} on {n}")
        # then a short step whose slices differ in size (6 + 2 (+ 2)), as a last step's can:
        # a mean of the replicas' own means is the batch's mean only when the slices are equal
        for strat in strategies:
            slices = uneven_slices(strat.num_replicas_in_sync)
            _check_step_once(distributed_train_step, make_model_and_optimizer, strat,
                             sum(len(s) for s in slices), lr, slices=slices)
            tried.append("+".join(str(len(s)) for s in slices) + f" on {len(slices)}")
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
    if slices is None:   # the strategy splits one global batch as evenly as it can
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
    problem = _outside_scope(strategy, model, optimizer) if isinstance(model, keras.Model) else None
    if problem:
        fail(problem)
    if len(model.get_weights()) != len(start):
        fail("make_model_and_optimizer must build mirrored.build_keras_cnn() (the lesson's CNN).")
    _check_lr(optimizer, lr)
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
        fail(f"distributed_train_step raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        fail("distributed_train_step must return (loss, accuracy), each reduced over replicas "
             "with strategy.reduce.")
    try:
        loss, acc = (float(np.asarray(v)) for v in out)
    except (TypeError, ValueError):
        fail("distributed_train_step returned per-replica values (one per replica), not one "
             "number each: combine each over the replicas into the global batch's value.")
    # What each replica held before the step: to tell one replica's value from a reduction.
    split = "+".join(str(len(s)) for s in slices)
    per_ex = mirrored.per_example_loss(y, logits).numpy()
    hit = np.argmax(logits, -1) == y
    first_share, first_mean = per_ex[slices[0]].sum() / global_batch, per_ex[slices[0]].mean()
    first_acc = float(hit[slices[0]].mean())

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
        if len({len(s) for s in slices}) > 1:
            # each replica dividing its summed loss by its own slice size x n (a local mean / n)
            local = [sum(g / n for g in gs) for gs in zip(*(
                mirrored.single_replica_gradients(ref, x[s], y[s])
                for s in slices))]
            if all(_close(d, -lr * g, rtol=1e-2) for d, g in zip(delta, local)):
                fail(f"this step's {global_batch} samples arrived in slices of {split}, and each "
                     f"replica's loss was divided by its own slice size times the replica count: "
                     f"that is the global batch only when every slice is the same size. Divide "
                     f"by the global_batch argument (part 1).")
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
        if len({len(s) for s in slices}) > 1:
            of = per_ex if what == "loss" else hit.astype(float)
            means = [float(of[s].mean()) for s in slices]
            if _close(got, np.mean(means), rtol=1e-3):
                fail(f"the {what} returned ({got:{fmt}}) is the mean of the replicas' own means "
                     f"({', '.join(f'{m:{fmt}}' for m in means)}) over slices of {split} "
                     f"samples, but {want_is}: a mean of means weighs every replica the same, "
                     f"not every sample, so it is the batch's {what} only when the slices are "
                     f"the same size — and a short last step's are not.")
        ones = (first_share, first_mean) if what == "loss" else (first_acc, first_acc / n)
        if any(_close(got, o, rtol=1e-4) for o in ones) and not _close(want / n, got, rtol=1e-4):
            fail(f"the {what} returned is replica 0's value alone ({got:{fmt}}), not a "
                 f"reduction over the {n} replicas: {want_is}. Combine every replica's value "
                 f"into one number.")
        r = _ratio(got, want)
        if abs(r - n) < 0.01 * n:
            fail(f"the {what} is {n}x too big: {too_big}")
        if abs(r - 1 / n) < 0.01 / n:
            fail(f"the {what} is {n}x too small: {too_small}")
        fail(f"the reduced {what} is {got:{fmt}}, but {want_is}.")
    return ref_loss, ref_acc


# --- stretch: datasets from a function, and a partial last batch ---------------------------

_N_SAMPLES, _GLOBAL = 100, 32  # 32 + 32 + 32 + 4: on 2 replicas the last step is 4 and 0


def stretch_data():
    """The stretch's data: 100 samples of 8 features, labels 0-9 (fixed)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(_N_SAMPLES, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=_N_SAMPLES).astype(np.int64)
    return x, y


def _expected_split(n: int) -> list:
    """Per-replica sizes of each step when every replica takes whole per-replica batches of one
    pipeline in turn (``distribute_datasets_from_function``): 32 samples as 16 + 16 on 2
    replicas, and the last step's 4 samples as 4 + 0."""
    per = _GLOBAL // n
    steps = []
    for start in range(0, _N_SAMPLES, _GLOBAL):
        steps.append([max(0, min(per, _N_SAMPLES - start - r * per)) for r in range(n)])
    return steps


@recorded
def check_dataset_fn(make_dist_dataset, strategy) -> None:
    """Stretch: ``make_dist_dataset(strategy, x, y, global_batch)`` must give, at every step, the
    next ``global_batch`` samples in order, each replica taking whole per-replica batches from its
    input pipeline (``strategy.distribute_datasets_from_function``) — so the short last step's 4
    samples all land on replica 0, not split 2 + 2 as ``experimental_distribute_dataset`` splits a
    global batch."""
    __tracebackhide__ = True
    x, y = stretch_data()
    where = {float(v): i for i, v in enumerate(x[:, 0])}   # sample -> its index in the data
    try:
        dist = make_dist_dataset(strategy, x, y, _GLOBAL)
        steps = [[np.asarray(v) for v in _local(strategy, b[0])] for b in dist]
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_dist_dataset raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    n = strategy.num_replicas_in_sync
    split = [[len(v) for v in step] for step in steps]
    sizes = [sum(s) for s in split]
    order = [where.get(float(row[0]), -1) for step in steps for v in step for row in v]
    want = [min(_GLOBAL, _N_SAMPLES - i) for i in range(0, _N_SAMPLES, _GLOBAL)]
    if sizes and sizes[0] == _GLOBAL * n:
        fail(f"each replica got {_GLOBAL} samples per step, so a step holds {_GLOBAL * n}: "
             f"global_batch is the whole step's size, and each replica's pipeline must batch "
             f"by its share of it.")
    if sorted(order) == list(range(_N_SAMPLES)) and order != list(range(_N_SAMPLES)):
        fail(f"every sample arrives once, in steps of {sizes}, but not in the data's order "
             f"(the first step starts with samples {order[:4]}): the order is the problem — "
             f"the stretch wants the data unshuffled, so that each step is the next "
             f"{_GLOBAL} samples.")
    if len(set(order)) < _N_SAMPLES:
        kept = sorted(set(order))
        if n > 1 and len(kept) == len(range(0, _N_SAMPLES, n)) and all(
                (i - kept[0]) % n == 0 for i in kept):
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples, every {n}th one: the "
                 f"data was sharded into {n} pieces (one per replica) and only one kept. Shards "
                 f"are per input pipeline (one per worker; here {n} replicas share one pipeline), "
                 f"and the replicas already take different batches from it.")
        if kept == list(range(len(kept))) and len(kept) % _GLOBAL == 0:
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}): the "
                 f"partial last batch was dropped — this exercise is about handling it.")
        fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}): every "
             f"sample must arrive once.")
    if sizes != want:
        fail(f"the steps hold {sizes} samples (expected {want}, in the data's order).")
    if split != _expected_split(n):
        fail(f"the samples and their order are right, but the last step's {want[-1]} samples "
             f"were split {'+'.join(map(str, split[-1]))} over the replicas (expected "
             f"{'+'.join(map(str, _expected_split(n)[-1]))}): that is a global batch split by "
             f"the strategy. The stretch asks for each replica's own input pipeline, batched by "
             f"the per-replica batch size, from which the replicas take whole batches in turn.")
    passed(f"make_dist_dataset: steps of {_GLOBAL} samples over {n} replicas in whole "
           f"per-replica batches, in order, the short last step kept")


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
    reveal(guess, sizes[0], close=guess.value == sizes[0],
           explanation=f"{n_samples} samples in global batches of {global_batch} leave a last "
                       f"step of {last}, and experimental_distribute_dataset splits every "
                       f"global batch over the {len(sizes)} replicas as evenly as it can "
                       f"({'+'.join(map(str, sizes))}). That step holds {last} samples, not "
                       f"{global_batch}: whoever divides its loss must know it (the stretch).")


def check_pipeline_prediction(guess, sizes) -> None:
    """Compare the prediction of replica 0's share of the stretch's last step (100 samples,
    global batches of 32) with what ``make_dist_dataset`` gave it."""
    per = _GLOBAL // len(sizes)
    reveal(guess, sizes[0], close=guess.value == sizes[0],
           explanation=f"Each replica takes whole batches of {per} from the pipeline in turn, so "
                       f"the 4 samples left at the end form one short batch, and it goes to "
                       f"replica 0: {'+'.join(map(str, sizes))}. A replica with no samples still "
                       f"runs the step, and the mean of no losses is 0/0.")


def _one_device(scale_full: float, scale_last: float) -> list:
    """SGD on one device over batches of _GLOBAL, each step's gradient scaled (1, 1 is right)."""
    x, y = stretch_data()
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
    x, y = stretch_data()

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
        first = str(exc).splitlines()[0] if str(exc) else ""
        if isinstance(exc, (AttributeError, TypeError, ValueError)) and (
                "'int' object" in first or "NoneType" in first):
            fail(f"train_epoch raised {type(exc).__name__}: {first} — a Python number (or None) "
                 f"reached a TensorFlow operation. A static shape such as x.shape[0] is a Python "
                 f"int (None while the step is traced), not a tensor: the replica context "
                 f"reduces tensors, so count the samples with a tensor operation.")
        fail(f"train_epoch raised {type(exc).__name__}: {first}")
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
             f"({_GLOBAL}), a number fixed before the epoch — but a short last step holds fewer "
             f"samples, and only the step itself can tell how many.")
    if same(_one_device(1, 1 / n)):
        fail(f"the last step was {n} times too small: its loss was divided as if every replica "
             f"held as many samples as the one that has them (compute_average_loss without "
             f"global_batch_size, or a local mean divided by the replica count, assume that), "
             f"but one replica has none: a replica's own slice does not tell how many samples "
             f"the whole step holds.")
    if same(_one_device(1, 0)):
        fail("the last, partial step changed nothing: train on it too.")
    fail("after one epoch the weights differ from one device on the same batches: divide each "
         "replica's summed loss by the step's global sample count, then apply the gradients.")
