"""Lab 05 stretch B, its second epoch: the stretch's 100 samples padded with weight-0 samples up
to whole global batches (:func:`padded_epoch`). ``check_padded_epoch`` runs the learner's
``train_epoch`` on it, eagerly and in tf.function, and names a wrong epoch by the one-device
replay whose weights it reproduced: the padding trained on, or the right samples divided by the
padded batch (:data:`_PADDED_DIVISORS`); then it checks an epoch of padding alone leaves the
weights where they are, and names a nan there that came from the gradient, not the loss (a
tf.where guard over an unsafe division), by the losses :class:`_lab05_epoch._LossSpy` noted.

Kept apart from :mod:`dpcourse.checks._lab05_epoch` (the partial last batch), whose one-device
replay and runner it uses. Imported by :mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from dpcourse.checks import _lab05_epoch, fail, passed, recorded
from dpcourse.checks._lab05_common import strategies_for, tf
from dpcourse.checks._lab05_epoch import (_first_line, _fresh_run, _replay, _same, _stretch_model)
from dpcourse.checks._lab05_pipeline import stretch_data, stretch_global


def padded_epoch(n: int):
    """The stretch's 100 samples padded with zero-feature, label-0 samples of weight 0 up to a
    whole number of global batches of ``stretch_global(n)``: ``(x, y, w, global_batch)``."""
    x, y = stretch_data()
    gb = stretch_global(n)
    pad = -len(x) % gb
    x = np.concatenate([x, np.zeros((pad, x.shape[1]), np.float32)])
    y = np.concatenate([y, np.zeros(pad, np.int64)])
    w = np.concatenate([np.ones(len(x) - pad, np.float32), np.zeros(pad, np.float32)])
    return x, y, w, gb


# A wrong padded epoch the check names: replayed on one device with the weighting and divisor
# that reproduce it (weighted, divisor: a key of _PADDED_DIVISORS), and its cause and fix.
_Mistake = collections.namedtuple("_Mistake", "weighted divisor cause fix")

# How a padded step's weighted (or unweighted) sum can be divided, as one device replays it:
# (real, size, mine) -> replica r's divisor, from the step's real samples, its size and replica
# r's real samples; None leaves the replica out. ("real", weighted) is the right one.
_PADDED_DIVISORS = {
    "real": lambda real, size, mine, n: real,
    "size": lambda real, size, mine, n: size,
    "own": lambda real, size, mine, n: mine * n if mine else None,
    "padded_skipped": lambda real, size, mine, n: None if real < size else real,
}


@functools.lru_cache(maxsize=None)
def _padded_one_device(n: int, weighted: bool, divisor: str) -> tuple:
    """SGD on one device over the padded epoch, replayed the way ``n`` replicas would split each
    step (``gb / n`` samples each, in order): replica r's summed losses — each times its weight
    if ``weighted`` — are divided by ``_PADDED_DIVISORS[divisor]``. Replayed once per process."""
    x, y, w, gb = padded_epoch(n)
    per = gb // n
    how = _PADDED_DIVISORS[divisor]
    steps = []
    for start in range(0, len(x), gb):
        ws = w[start:start + gb]
        steps.append((x[start:start + gb], y[start:start + gb], ws if weighted else None,
                      [how(float(ws.sum()), gb, float(ws[r * per:(r + 1) * per].sum()), n)
                       for r in range(n)], [per] * n))
    return _replay(steps)


def _run_padded(train_epoch, strategy, traced: bool, at: str, data=None):
    """``train_epoch`` on a fresh mirrored stretch model over ``data`` (``(x, y, w, gb)``; the
    padded epoch when None), as written or wrapped in ``tf.function``: its weights after."""
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    x, y, w, gb = padded_epoch(n) if data is None else data
    model, run = _fresh_run(train_epoch, strategy, strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y, w)).batch(gb)), traced)
    how = "wrapped in tf.function" if traced else "run as written"
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # tf.data's options note, traced
            run()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code, reported in one line
        fail(f"train_epoch raised {type(exc).__name__} {how} {at}: {_first_line(exc, traced)}")
    return model.get_weights()


@recorded
def check_padded_epoch(train_epoch, strategy) -> None:
    """Stretch B: ``train_epoch(strategy, model, optimizer, dist_dataset)`` over the stretch's
    100 samples padded to whole global batches with weight-0 samples (elements ``(x, y, w)``)
    must leave the weights where one device leaves them after the unpadded batches, each step's
    loss the mean over its real samples — run as written and wrapped in ``tf.function``, on
    the lab's strategy and one with a replica more. A wrong epoch is named by the divisor and
    weighting whose one-device replay gives its weights."""
    __tracebackhide__ = True
    tried = []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        x, y, w, gb = padded_epoch(n)
        last = w[-gb:]
        per = gb // n
        reals = [int(last[r * per:(r + 1) * per].sum()) for r in range(n)]
        real, pad = int(last.sum()), gb - int(last.sum())
        at = (f"(global batch {gb} on {n} replicas; the last step's {gb} samples are {real} real "
              f"and {pad} padding, real per replica {'+'.join(map(str, reals))})")
        got = _run_padded(train_epoch, strat, False, at)
        _judge_padded(got, n, at, real, pad, gb, reals)
        traced = _run_padded(train_epoch, strat, True, at)
        if not _same(traced, got):
            fail(f"run as written, train_epoch matched one device {at}, but wrapped in "
                 f"tf.function its weights differ: something in the step was computed once, "
                 f"when the step was traced, from a Python value — the trace is reused for "
                 f"every step, the padded last one included.",
                 fix="Compute what the step divides by from the batch, with tensor operations.")
        tried.append(f"{real} real + {pad} padding on {n}")
        _check_all_padding(train_epoch, strat)
    passed("train_epoch: every step's loss is the mean over its real samples, the padded last "
           f"step included, run as written and wrapped in tf.function (last steps "
           f"{', '.join(tried)} replicas), and a step of padding alone leaves the weights "
           f"where they are")


def _check_all_padding(train_epoch, strategy) -> None:
    """A step that holds no real sample (every weight 0: a loop that runs a fixed number of steps
    pads whole ones) must leave the weights where they are, and finite — as one device, with no
    sample to train on, leaves them. Run as written and wrapped in ``tf.function``."""
    __tracebackhide__ = True
    n = strategy.num_replicas_in_sync
    gb = stretch_global(n)
    data = (np.zeros((gb, 8), np.float32), np.zeros(gb, np.int64), np.zeros(gb, np.float32), gb)
    at = (f"(one step of {gb} samples on {n} replicas, {gb // n} each, all padding: every "
          f"weight w is 0)")
    start = _stretch_model().get_weights()
    for traced in (False, True):
        # the loss each replica differentiated, where the step runs eagerly (looked up on the
        # module, so a test's spy stands in for it)
        with _lab05_epoch._LossSpy() as spy:
            got = _run_padded(train_epoch, strategy, traced, at, data=data)
        how = "wrapped in tf.function" if traced else "run as written"
        losses = spy.last_step(n)
        if (not all(np.all(np.isfinite(v)) for v in got) and losses is not None
                and all(np.isfinite(losses))):
            fail(f"the weights became nan after a step of padding alone {at}, {how}, though "
                 f"every replica's loss was finite ({', '.join(f'{v:.4g}' for v in losses)}): "
                 f"a guard such as tf.where(count > 0, sum / count, 0.0) picks the value, but "
                 f"its gradient still flows through the division it did not pick, and the "
                 f"gradient of 0/0 is nan (0 x inf) — one nan in a gradient makes every weight "
                 f"nan after apply_gradients.",
                 fix="Make the division itself safe, not just the value it gives: "
                     "tf.math.divide_no_nan(sum, count), or divide by tf.maximum(count, a "
                     "small positive number).")
        if not all(np.all(np.isfinite(v)) for v in got):
            fail(f"the weights became nan after a step of padding alone {at}, {how}: the step's "
                 f"real samples add up to 0, and its weighted sum of losses, 0, divided by that "
                 f"0 is 0/0 = nan — one nan in a loss makes every weight nan after "
                 f"apply_gradients, where one device, with no real sample to train on, leaves "
                 f"the weights as they are.",
                 fix="Make a step with no real sample contribute a loss of 0: a division that "
                     "gives 0 when the count is 0 (tf.math.divide_no_nan), or a divisor kept "
                     "at least 1.")
        if not _same(got, start, rtol=1e-6):
            moved = max(float(np.max(np.abs(a - b))) for a, b in zip(got, start))
            fail(f"the weights moved (by up to {moved:.3g}) after a step of padding alone {at}, "
                 f"{how}: no sample of that step is real, so one device has nothing to train "
                 f"on and leaves the weights where they are — the step trained on its padding "
                 f"(zero features, label 0), pulling the weights toward predicting class 0.",
                 fix="Keep the padding out of every step, a step of padding alone included: "
                     "its weighted loss is 0, and so is its gradient.")


def _judge_padded(got, n, at, real, pad, gb, reals) -> None:
    __tracebackhide__ = True
    if not all(np.all(np.isfinite(v)) for v in got):
        empty = [r for r, k in enumerate(reals) if k == 0]
        fail(f"the weights became nan {at}: "
             + (f"replica {empty[0]} holds only padding in the last step, so a divisor of its "
                f"own (the sum of its weights, its real samples) is 0, and its loss 0/0."
                if empty else "a loss was not a finite number."),
             fix="Divide by a number the replicas share, which is not 0 while the step holds "
                 "a real sample.")

    if _same(got, _padded_one_device(n, True, "real")):
        return
    # each wrong weighting and divisor the check knows, in order
    wrong = [
        _Mistake(False, "size",
            f"the last step trained on its padding {at}: each replica's loss was the plain "
            f"mean over every sample it was handed, {real} real and {pad} padding divided by "
            f"{gb} — the padding samples (zero features, label 0) pulled the weights toward "
            f"predicting class 0 for nothing, and the {real} real samples got {real}/{gb} of "
            f"their weight. The weights w say which samples are real.",
            fix="Weight each example's loss by w, and divide by the number of real samples "
                "in the step."),
        _Mistake(True, "size",
            f"the last step was too small {at}: the padding was weighted out of the sum, but "
            f"the sum was divided by the step's {gb} samples, padding included — its mean over "
            f"{real} real samples is the sum / {real}, so the last step moved the weights "
            f"{real}/{gb} as far as one device does.",
            fix="Divide by the sum of the step's weights, combined over the replicas inside "
                "the step."),
        _Mistake(False, "real",
            f"the last step trained on its padding {at}: the sum was divided by the {real} "
            f"real samples, but the per-example losses were not weighted, so the {pad} "
            f"padding samples' losses are in the sum.",
            fix="Multiply each example's loss by its weight before summing."),
        _Mistake(True, "own",
            f"the last step was wrong {at}: each replica divided its weighted sum by its own "
            f"real samples times the {n} replicas ({', '.join(f'{k} x {n}' for k in reals)}) "
            f"— the step's real count only when every replica holds as many real samples, and "
            f"padding sits at the end of the data, on the last replicas.",
            fix="Divide by the step's real samples, summed over the replicas inside the step."),
        _Mistake(True, "padded_skipped",
            f"the padded last step changed nothing {at}: its {real} real samples were never "
            f"trained on.", fix="Train on the padded last step too, weighting out its padding."),
    ]
    for mistake in wrong:
        if _same(got, _padded_one_device(n, mistake.weighted, mistake.divisor)):
            fail(mistake.cause, fix=mistake.fix)
    fail(f"after one epoch the weights differ from one device on the unpadded batches {at}, "
         f"by a weighting or divisor the check does not recognise.",
         fix="Weight each example's loss by w and divide by the real samples of the step, "
             "summed over the replicas inside it.")
