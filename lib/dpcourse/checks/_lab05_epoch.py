"""Lab 05 stretch B: ``train_epoch(strategy, model, optimizer, dist_dataset)`` over 100 samples
in global batches of 32 (36 on 3 replicas) must take the steps one device takes, the short last
step included (its split is stretch A's pipeline's). A wrong epoch is replayed on one device
with each plausible divisor (the full global batch, a fixed 32, each replica's own slice x N —
compute_average_loss left to count, a local mean / N, or a Keras loss object's
SUM_OVER_BATCH_SIZE — the last step skipped) and named by the one whose weights it reproduced.
A right epoch is run again wrapped in tf.function, where a count read off a static shape is None;
a Python number handed to the replica context's all_reduce, or one set in the loop over the
batches for the step to read, is named by its cause.

The stretch's second epoch, padded with weight-0 samples, is judged in
:mod:`dpcourse.checks._lab05_padded`, which uses the replay and the runner here. Imported by
:mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import functools

import numpy as np

from dpcourse import mirrored
from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import _close, distribute_slices, keras, strategies_for, tf
from dpcourse.checks._lab05_pipeline import _GLOBAL, _expected_split, stretch_data, stretch_global


# How a replica's summed loss can be divided in an epoch's step, as one device replays it:
# (r, sizes, gb) -> the divisor of replica r's sum, ``sizes`` being the step's per-replica sizes.
# "step" is the right one; the others are the wrong answers the epoch check names.
_DIVISORS = {
    "step": lambda r, sizes, gb: sum(sizes),
    "global": lambda r, sizes, gb: gb,
    "fixed": lambda r, sizes, gb: _GLOBAL,
    "own": lambda r, sizes, gb: sizes[r] * len(sizes),
    "short_skipped": lambda r, sizes, gb: float("inf") if sum(sizes) < gb else sum(sizes),
}


@functools.lru_cache(maxsize=None)
def _one_device(n: int, global_batch: int, divisor: str) -> tuple:
    """SGD on one device over the stretch's batches of ``global_batch``: in each step, the
    samples replica r of ``n`` would hold (whole per-replica batches in turn) have their summed
    loss divided by ``_DIVISORS[divisor]``. Replayed once per process: the same for every
    answer it is compared with."""
    x, y = stretch_data()
    divisors = _DIVISORS[divisor]
    return _replay([(x[start:start + sum(sizes)], y[start:start + sum(sizes)], None,
                     [float(divisors(r, sizes, global_batch)) if k else None
                      for r, k in enumerate(sizes)], sizes)
                    for start, sizes in zip(range(0, len(x), global_batch),
                                            _expected_split(n, global_batch))])


def _replay(steps) -> tuple:
    """The stretch model's weights after plain SGD (lr 0.5) on one device over ``steps``, each
    ``(x, y, w, divisors, sizes)``: replica r's rows (``sizes[r]`` of them, in turn) have their
    per-example losses — times ``w`` unless w is None — summed and divided by ``divisors[r]``;
    None leaves replica r out, and a step with every replica left out changes nothing."""
    model = _stretch_model()
    opt = keras.optimizers.SGD(learning_rate=0.5)
    for xs, ys, ws, divisors, sizes in steps:
        if all(d is None for d in divisors):
            continue
        with tf.GradientTape() as tape:
            losses = mirrored.per_example_loss(ys, model(xs))
            if ws is not None:
                losses = losses * ws
            loss, at = 0.0, 0
            for k, d in zip(sizes, divisors):
                if d is not None:
                    loss = loss + tf.reduce_sum(losses[at:at + k]) / d
                at += k
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return tuple(model.get_weights())


# Keras 3.15, keras/src/losses/loss.py: reduce_values divides the summed losses by their count
# for these reductions, then scale_loss_for_distribution multiplies by 1 / num_replicas_in_sync
_KERAS_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class _LossSpy:
    """While active, notes the loss each replica differentiates (the target of
    ``tf.GradientTape.gradient``, when it is a number: a step run eagerly, as the lab's loop
    runs it; a traced step leaves nothing) and whether ``tf.nn.compute_average_loss`` was called
    without a ``global_batch_size``. Lets the check tell apart two divisors that move the
    weights alike: a replica's own mean / N, and compute_average_loss left to count the slice.
    Its notes add up over every time it is active (a batch of loops takes turns with one spy
    each: :func:`epochs_of_losses`)."""

    def __init__(self):
        self.targets, self.implicit = [], False   # (replica id, loss) in call order
        self.keras_mean = None   # the reduction of a Keras loss object called, if it scales

    def __enter__(self):
        self._gradient, self._average = tf.GradientTape.gradient, tf.nn.compute_average_loss
        self._loss_call = keras.losses.Loss.__call__
        spy = self

        def loss_call(loss_object, *args, **kwargs):
            if getattr(loss_object, "reduction", None) in _KERAS_MEANS:
                spy.keras_mean = loss_object.reduction
            return spy._loss_call(loss_object, *args, **kwargs)

        def gradient(tape, target, *args, **kwargs):
            spy._note(target)
            return spy._gradient(tape, target, *args, **kwargs)

        def compute_average_loss(*args, **kwargs):
            if len(args) < 3 and kwargs.get("global_batch_size") is None:
                spy.implicit = True
            return spy._average(*args, **kwargs)

        tf.GradientTape.gradient, tf.nn.compute_average_loss = gradient, compute_average_loss
        keras.losses.Loss.__call__ = loss_call
        return self

    def _note(self, target) -> None:
        try:
            ctx = tf.distribute.get_replica_context()
            replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
            value = float(np.asarray(target))   # a symbolic (traced) loss has no value
        except Exception:  # noqa: BLE001 - nothing to note; the weights still decide
            return
        self.targets.append((replica, value))

    def __exit__(self, *exc):
        tf.GradientTape.gradient, tf.nn.compute_average_loss = self._gradient, self._average
        keras.losses.Loss.__call__ = self._loss_call
        return False

    def last_step(self, n: int) -> list | None:
        """The loss each of the ``n`` replicas differentiated in the epoch's last step (the last
        ``n`` notes), or None when the step was not run eagerly."""
        tail = dict(self.targets[-n:])
        return [tail[r] for r in range(n)] if sorted(tail) == list(range(n)) else None


def _name_own_slice_divisor(spy: _LossSpy, last: list, n: int, at: str) -> None:
    """The weights say each replica divided its summed loss by its own slice size x N. Name
    which divisor did it: compute_average_loss without global_batch_size, or the replica's own
    reduce_mean divided by N (an empty replica's loss is then nan), with the last step's
    numbers where the step ran eagerly."""
    __tracebackhide__ = True
    fix = "Ask the other replicas: sum the replicas' counts inside the step."
    b, losses = sum(last), spy.last_step(n)
    empty = [r for r, k in enumerate(last) if k == 0]
    if spy.keras_mean:
        full = next(r for r, k in enumerate(last) if k)
        fail(f"the last step was wrong {at}: each replica's loss came from a Keras loss object "
             f"with the reduction {spy.keras_mean!r} (SUM_OVER_BATCH_SIZE is the default), "
             f"which under a strategy divides a replica's summed loss by its own slice size and "
             f"then by the {n} replicas (Keras' reduce_values and scale_loss_for_distribution): "
             f"replica {full}'s {last[full]} samples were divided by {last[full]} x {n} = "
             f"{last[full] * n}, where the step holds {b}. That is the step's count only when "
             f"every replica holds as many samples as this one, and the last step's slices "
             f"differ: a replica's own slice does not tell how many samples the whole step "
             f"holds.", fix="Take the per-example losses (a loss object with reduction='none' "
                            "gives them) and divide their sum by the step's count, summed over "
                            "the replicas inside the step.")
    if spy.implicit:
        fail(f"the last step was wrong {at}: each replica's loss came from compute_average_loss "
             f"without global_batch_size, which then divides a replica's summed loss by its own "
             f"slice size x the {n} replicas — the step's sample count only when every replica "
             f"holds as many as this one, and the last step's slices differ: a replica's own "
             f"slice does not tell how many samples the whole step holds.", fix=fix)
    if losses is not None and (not empty or losses[empty[0]] != losses[empty[0]]):
        full = next(r for r, k in enumerate(last) if k)
        mean, k = losses[full] * n, last[full]
        right = mean * k / b
        said = [f"replica {full} differentiated {losses[full]:.4f}: its summed loss over its "
                f"{k} samples / ({k} x {n} = {k * n}), that is its own mean over its {k} "
                f"samples ({mean:.4f}) / {n} replicas, where its share of the step's mean is "
                f"{right:.4f} (its summed loss / the step's {b} samples), "
                f"{right / losses[full]:.2g} times what it differentiated"]
        if empty:
            said.append(f"replica {empty[0]}, holding none, differentiated nan: 0 losses / "
                        f"(0 x {n}) is 0/0, as reduce_mean of no losses is (its gradient, a "
                        f"sum over no sample, is zero)")
        fail(f"the last step was wrong {at}: each replica's loss was its summed loss divided by "
             f"its own slice size times the replica count (the same number as its own "
             f"reduce_mean divided by the replica count) — " + "; ".join(said) + f". That "
             f"divisor is the step's sample count only when every replica holds the step's "
             f"samples / N; the last step's slices differ, and a replica's own slice does not "
             f"tell how many samples the step holds.",
             fix=fix)
    nan = (f" (replica {empty[0]} holds none: its own mean is 0/0, NaN from reduce_mean — "
           f"compute_average_loss's div_no_nan reports 0 — while its gradient, a sum over "
           f"no sample, is zero and moves nothing)" if empty else "")
    fail(f"the last step was wrong {at}: each replica's loss was divided by its own slice "
         f"size times the replica count (compute_average_loss without global_batch_size, or "
         f"a local mean divided by the replica count, assume every replica holds as many "
         f"samples as this one), but the last step's slices differ{nan}: a replica's own "
         f"slice does not tell how many samples the whole step holds.", fix=fix)


def _same(weights, others, rtol=1e-4) -> bool:
    """Whether two lists of weight arrays are equal to ``rtol``."""
    return all(_close(a, b, rtol=rtol) for a, b in zip(weights, others))


def _stretch_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
    model.set_weights([np.full((8, 10), 0.01, np.float32) * np.arange(10, dtype=np.float32),
                       np.zeros(10, np.float32)])
    return model


def _run_epoch(train_epoch, strategy, dist, at: str, *, traced: bool,
               who: str = "train_epoch"):
    """Runs ``train_epoch`` on a fresh mirrored model over the stretch's epoch ``dist``, as
    written or wrapped in ``tf.function``; names a Python number where the step needs a
    tensor."""
    __tracebackhide__ = True
    import re
    import warnings

    model, run = _fresh_run(train_epoch, strategy, dist, traced)
    how = "wrapped in tf.function" if traced else "run as written"
    if who != "train_epoch":
        how = f"in a training loop over an epoch, {how}"
    try:
        with _LossSpy() as spy, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # tf.data's options note, traced
            run()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        first = _first_line(exc, traced)
        if isinstance(exc, (AttributeError, TypeError, ValueError)) and (
                "NoneType" in first or "None values not supported" in first):
            fail(f"{who} raised {type(exc).__name__} {how} {at}: {first} — a count read "
                 f"off a static shape (x.shape[0], y.shape[0]). Traced, as tf.function traces "
                 f"a training loop once for all its steps, the batch dimension is None: it is "
                 f"unknown until the data arrives, and the last step is shorter than the "
                 f"others. A count that has to differ from step to step must be a tensor "
                 f"computed from the batch.",
                 fix="Count the samples with a tensor operation on the batch itself.")
        loop_var = re.search(r"'(\w+)' must be defined before the loop", first)
        if traced and isinstance(exc, ValueError) and loop_var:
            name = loop_var.group(1)
            fail(f"{who} raised ValueError {how} {at}: \"{first}\" — `{name}` is a "
                 f"Python number set in the loop over the batches for the step to read, and a "
                 f"Python number inside a traced step is fixed when tf.function traces it, once "
                 f"for every step, the short last one included: the step's count must be a "
                 f"tensor, summed across the replicas inside the step.",
                 fix=f"Count this replica's samples inside "
                    f"{'step_fn' if who == 'train_epoch' else 'the step'} with a tensor "
                    f"operation on its batch, and sum that count over the replicas with the "
                    f"replica context's all_reduce.")
        if isinstance(exc, (AttributeError, TypeError, ValueError)) and (
                "'int' object" in first or "'float' object" in first):
            kind = "an int" if "'int' object" in first else "a float"
            fail(f"{who} raised {type(exc).__name__} {how} {at}: {first} — {kind}, a "
                 f"Python number, reached the replica context's all_reduce where it needs a "
                 f"tensor of this replica's count. all_reduce combines tensors, values the "
                 f"replicas compute while the step runs; a number read off a static shape "
                 f"(x.shape[0]) is fixed when the step is traced, once for every step, and is "
                 f"None there, since the last step's size is known only when its data arrives.",
                 fix="Hand all_reduce a tensor computed from the batch in the step, not a "
                     "Python number.")
        fail(f"{who} raised {type(exc).__name__} {how} {at}: {first}")
    return model, spy


@recorded
def check_partial_batch_epoch(train_epoch, strategy) -> None:
    """Stretch: ``train_epoch(strategy, model, optimizer, dist_dataset)`` over 100 samples in
    global batches of ``stretch_global(replicas)`` must take the steps one device takes —
    including the short last step, whose split over the replicas is the pipeline's. Tried on
    the lab's strategy and on one with a replica more."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        _check_epoch_once(train_epoch, strat, stretch_global(n))
        tried.append(f"{'+'.join(map(str, _expected_split(n, stretch_global(n))[-1]))} on {n}")
    passed("train_epoch: every step, the short last one too, equals one device on the same "
           f"batch, run as written and wrapped in tf.function (last steps {', '.join(tried)} "
           f"replicas)")


def epochs_of_losses(step_fns, strategy, gb: int) -> list:
    """What :func:`_check_epoch_once` runs for each of the training loops built on the losses
    in ``step_fns`` (each ``step_fn(model, optimizer)`` -> the function ``strategy.run`` runs on
    a step), over the stretch's epoch in global batches of ``gb``, all of them in ONE eager pass
    over :func:`_epoch_steps` and ONE ``tf.function`` over the epoch's dataset (a trace and a
    dataset iterator cost more than the steps they run): per loop ``{"eager": weights after the
    eager pass, "spy": its :class:`_LossSpy` notes, "traced": weights after the traced pass}``,
    each loop training a fresh model of its own. For the tests' batch of answers that run
    (:func:`dpcourse.checks.lab05.epoch_of_loss_results`); one that raises stops the batch
    (give it to the check)."""
    import warnings

    pairs, spies = [], []
    for traced in (False, True):
        with strategy.scope():
            made = [(_stretch_model(), keras.optimizers.SGD(learning_rate=0.5))
                    for _ in step_fns]
        runs = [make(model, opt) for make, (model, opt) in zip(step_fns, made)]
        if not traced:
            spies = [_LossSpy() for _ in runs]
            for batch in _epoch_steps(strategy, gb):
                for run, spy in zip(runs, spies):
                    with spy:   # each loop's spy active only while its own step runs
                        strategy.run(run, args=batch)
        else:
            dist = strategy.distribute_datasets_from_function(_epoch_dataset_fn(gb))

            def epoch():
                for batch in dist:
                    for run in runs:
                        strategy.run(run, args=batch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)   # tf.data's options note, traced
                tf.function(epoch)()
        pairs.append([model.get_weights() for model, _ in made])
    return [{"eager": eager, "spy": spy, "traced": traced}
            for eager, spy, traced in zip(pairs[0], spies, pairs[1])]


def _epoch_dataset_fn(gb: int):
    """The dataset function of the stretch's epoch in global batches of ``gb``: each input
    pipeline's share of the data, in per-replica batches."""
    x, y = stretch_data()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(gb))
    return dataset_fn


def _epoch_steps(strategy, gb: int) -> list:
    """The steps ``distribute_datasets_from_function(_epoch_dataset_fn(gb))`` yields on one
    worker (replicas take whole per-replica batches in turn: ``_expected_split``), made without
    its iterator (tests/test_lab05_checks.py compares the two)."""
    x, y = stretch_data()
    steps = []
    for start, sizes in zip(range(0, len(x), gb), _expected_split(
            strategy.num_replicas_in_sync, gb)):
        rows = slice(start, start + sum(sizes))
        steps.append(distribute_slices(strategy, (x[rows], y[rows]), sizes))
    return steps


def _check_epoch_once(train_epoch, strategy, gb: int, who: str = "train_epoch",
                      outcome: dict | None = None) -> None:
    """``train_epoch`` over the stretch's epoch in global batches of ``gb`` must move the weights
    as one device does, run as written and wrapped in ``tf.function`` (a fresh distributed
    dataset each time). A loop that is the check's own (``who`` is the learner's loss, not a
    train_epoch) is handed the eager run's steps ready-made (:func:`_epoch_steps`): it iterates
    whatever it is given, and the per-replica batches are the dataset's. ``outcome``: the two
    runs already made (:func:`epoch_of_loss_results`, the tests' batch of answers): judged
    here as this function's own runs are."""
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    last = _expected_split(n, gb)[-1]
    at = f"(global batch {gb} on {n} replicas; the last step's {sum(last)} samples as " \
         f"{'+'.join(map(str, last))})"

    def dataset():
        return strategy.distribute_datasets_from_function(_epoch_dataset_fn(gb))

    if outcome is not None:
        got, spy = [w.copy() for w in outcome["eager"]], outcome["spy"]
    else:
        model, spy = _run_epoch(train_epoch, strategy,
                                dataset() if who == "train_epoch" else _epoch_steps(strategy, gb),
                                at, traced=False, who=who)
        got = model.get_weights()
    if not all(np.all(np.isfinite(w)) for w in got):
        fail(f"the weights became NaN {at}: in the last step a replica with no samples divided "
             f"its loss by its own count, and the mean of nothing is 0/0.",
             fix="Divide the summed loss by the step's global sample count instead.")

    def same(divisor):
        return _same(got, _one_device(n, gb, divisor))

    if same("step"):
        if outcome is not None:
            traced_weights = outcome["traced"]
        else:
            traced, _ = _run_epoch(train_epoch, strategy, dataset(), at, traced=True, who=who)
            traced_weights = traced.get_weights()
        if _same(traced_weights, got):
            return
        loop = who if who == "train_epoch" else f"a training loop built on {who}"
        fail(f"run eagerly, {loop} matched one device {at}, but wrapped in tf.function "
             f"(as a training loop is, to run fast) its weights differ: something in the step "
             f"was computed once, when the step was traced, from a Python value — the "
             f"trace is reused for every step, the short last one included.",
             fix="Compute the step's count from the batch with tensor operations.")
    if same("global"):
        fail(f"the last step was too small {at}: its {sum(last)} samples were divided by the "
             f"full global batch ({gb}), a number fixed before the epoch — but a short last "
             f"step holds fewer samples, and only the step itself can tell how many.",
             fix="Divide by this step's sample count, summed over the replicas inside the step.")
    if gb != _GLOBAL and same("fixed"):
        fail(f"every step's loss was divided by a fixed {_GLOBAL} {at}: the global batch here is "
             f"{gb}, and the last step holds {sum(last)} — a number written into the function "
             f"holds for one dataset only.",
             fix="Count the step's samples inside the step, summed over the replicas.")
    if same("own"):
        _name_own_slice_divisor(spy, last, n, at)
    if same("short_skipped"):
        fail(f"the last, partial step changed nothing {at}: its {sum(last)} samples were never "
             f"trained on.", fix="Train on the short last step too.")
    fail(f"after one epoch the weights differ from one device on the same batches {at}, by a "
         f"scaling the check does not recognise.",
         fix="Divide each replica's summed loss by the step's global sample count, then apply "
             "the gradients.")


def _fresh_run(train_epoch, strategy, dist, traced: bool):
    """A fresh mirrored stretch model and SGD (lr 0.5) under ``strategy``, and the call that
    runs ``train_epoch`` on them over ``dist``, as written or wrapped in ``tf.function``."""
    with strategy.scope():
        model = _stretch_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
    run = (tf.function(lambda: train_epoch(strategy, model, optimizer, dist)) if traced else
           lambda: train_epoch(strategy, model, optimizer, dist))
    return model, run


def _first_line(exc, traced: bool) -> str:
    """The line of an exception that says what went wrong: a traced error's last (its first is
    "in user code")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if traced and len(lines) > 1 and lines[0].startswith("in user code"):
        return lines[-1]
    return lines[0] if lines else ""
