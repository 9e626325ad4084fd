"""Lab 09, part 3 (solutions/lab09_async_worker.py): predict, then measure — the smallest τ at
lr 0.2 from which every run, up to the largest τ, ends above the loss it started from, over
lesson 09's budget of updates; the same runs read earlier too, to show that the boundary moves
with the budget.

Exported by :mod:`dpcourse.checks.lab09`, where the lab calls it.
"""

from __future__ import annotations

__all__ = ["PREDICTION_LR", "PREDICTION_TAUS", "PREDICTION_STEPS", "ALONG", "CLOSE_WITHIN",
           "first_above_start", "above_for_good", "measure_sweep", "lr_tau_verdict",
           "check_prediction"]

PREDICTION_LR = 0.2
PREDICTION_TAUS = tuple(range(17))   # τ = 0 … 16, as far as lesson 09's table goes
PREDICTION_STEPS = 400               # lesson 09's table's budget of updates
ALONG = 300                          # the same runs, read after this many updates too
CLOSE_WITHIN = 2                     # a prediction within 2 of the measured τ counts as right


def first_above_start(losses: dict, start_loss: float):
    """The smallest τ ≥ 1 whose run ended at or above the loss it started from, or None."""
    return next((t for t in sorted(losses) if t > 0 and not losses[t] < start_loss), None)


def above_for_good(losses: dict, start_loss: float):
    """The smallest τ ≥ 1 from which every run, up to the largest τ, ended at or above the loss
    it started from, or None (the largest τ ended below it). Unlike the first τ above the
    start, it does not move when one run near the boundary ends on the other side."""
    taus = sorted(t for t in losses if t > 0)
    found = None
    for t in reversed(taus):
        if losses[t] < start_loss:
            break
        found = t
    return found


def measure_sweep(problem, loop, steps: int = PREDICTION_STEPS, along=(ALONG,),
                  lr: float = PREDICTION_LR, taus=PREDICTION_TAUS) -> tuple[float, dict]:
    """Part 3's runs: ``loop`` (the learner's worker loop) drives lesson 09's MLP through
    ``async_sgd.run_stale`` for every τ in ``taus`` at ``lr``, ``steps`` updates each, on the
    same batches; the test loss is read at the end and, in the same runs, after each number
    of updates in ``along``. Returns (the loss before any update, {updates: {τ: test loss}})."""
    from dpcourse import async_sgd

    batches = async_sgd.batch_schedule(len(problem.x_train), 32, steps)
    model = async_sgd.make_model()
    start = async_sgd.evaluate(model, async_sgd.flat_params(model), problem.x_test,
                               problem.y_test)[0]
    marks = sorted(a for a in along if 0 < a < steps)
    seen: dict = {}

    class ReadAlong(async_sgd.SimulatedServer):
        """The lesson's server; after the updates in ``marks`` it notes the test loss."""

        def push(self, grad, version):
            super().push(grad, version)
            if self.version in marks:
                seen[self.version] = async_sgd.evaluate(model, self.w, problem.x_test,
                                                        problem.y_test)[0]

    losses: dict = {a: {} for a in marks + [steps]}
    for tau in taus:
        seen.clear()
        end = async_sgd.run_stale(problem, tau, lr, batches, loop=loop, server_cls=ReadAlong)
        losses[steps][tau] = end["loss"]
        for a in marks:
            losses[a][tau] = seen.get(a, float("nan"))
    return start, losses


def _taus_text(taus) -> str:
    taus = list(taus)
    return ", ".join(map(str, taus[:-1])) + (" and " if len(taus) > 1 else "") + \
        (str(taus[-1]) if taus else "")


def lr_tau_verdict(value, boundary, last: int, lr: float = PREDICTION_LR, steps=None,
                   along=None) -> str:
    """What the learner's τ said in lr · τ, against the runs' boundary ``boundary`` (None: τ =
    ``last`` still ended below the start) after ``steps`` updates and, when measured, after
    ``along`` = (updates, boundary there) — and whether a fixed lr · τ could place it."""
    if not isinstance(value, (int, float)) or value != value:
        return ""
    g = value
    said = (f"Your {g:g} said no τ up to {last} stays above the start." if g > last else
            f"Your τ = {g:g} is lr · τ = {lr * g:.2g}.")
    if boundary is None:
        at = f"no τ up to {last} stayed above the start here"
        verdict = " Right." if g > last else f" The runs: {at}."
    else:
        at = f"lr · τ = {lr * boundary:.2g} (τ = {boundary})"
        verdict = (" Right on it." if g == boundary else
                   f" The runs: {at}; yours is {abs(g - boundary):g} τ too "
                   f"{'high' if g > boundary else 'low'}.")
    out = said + verdict
    if along is not None and steps is not None:
        updates, there = along
        if there != boundary:
            there_text = (f"beyond τ = {last}" if there is None else
                          f"at lr · τ = {lr * there:.2g} (τ = {there})")
            here_text = (f"beyond τ = {last}" if boundary is None else
                         f"at lr · τ = {lr * boundary:.2g} (τ = {boundary})")
            out += (f" At the same lr, the same runs put the boundary {there_text} after "
                    f"{updates} updates and {here_text} after {steps}: it moves with the budget, "
                    f"so no fixed lr · τ places it.")
    return out


def check_prediction(guess, losses: dict, start_loss: float, lr: float = PREDICTION_LR) -> None:
    """Compare the learner's τ — the smallest τ at ``lr`` from which every run, up to the
    largest τ, ends above its starting loss — with the runs. ``losses`` is
    {updates: {τ: test loss}} (:func:`measure_sweep`; the largest number of updates is the
    budget, the others the same runs read earlier), or {τ: test loss} after the budget alone.
    The explanation says only what the runs show: where they stay above the start, the runs
    below that boundary that ended above it anyway, and how the boundary moved with the
    budget."""
    from dpcourse.checks import Prediction, reveal

    if not isinstance(guess, Prediction):
        raise TypeError(f"check_prediction's first argument is the Prediction that "
                        f"predict(...) returned (guess, in the lab), not {type(guess).__name__} "
                        f"{guess!r}: pass guess, the value of the predict(...) cell.")
    if losses and all(isinstance(v, dict) for v in losses.values()):
        by_budget = {int(k): v for k, v in losses.items()}
    else:
        by_budget = {None: losses}
    steps = max(by_budget, key=lambda k: -1 if k is None else k)
    final = by_budget[steps]
    taus = sorted(final)
    last = taus[-1]
    earlier = [k for k in by_budget if k is not None and k != steps]
    along = None
    if earlier:
        a = max(earlier)
        along = (a, above_for_good(by_budget[a], start_loss))
    budget = f"after {steps} updates" if steps is not None else "after the budget"
    boundary = above_for_good(final, start_loss)
    value = guess.value if isinstance(guess.value, (int, float)) else float("nan")
    stray = [t for t in taus if t > 0 and not final[t] < start_loss and
             (boundary is None or t < boundary)]
    if boundary is None:
        measured = f"none up to τ = {last}"
        close = value > last
        text = (f"at lr {lr:g} {budget}, τ = {last} ended at {final[last]:.2f}, below the start's "
                f"{start_loss:.2f}, so no τ up to {last} stays above it")
    else:
        measured = boundary
        close = abs(value - boundary) <= CLOSE_WITHIN
        below = max(t for t in taus if t < boundary)
        text = (f"at lr {lr:g} {budget}, τ = 0 ended at {final[0]:.2f}, below the start's "
                f"{start_loss:.2f}; from τ = {boundary} on every run up to τ = {last} ended above "
                f"it (τ = {boundary} at {final[boundary]:.2f}), and τ = {below} ended at "
                f"{final[below]:.2f}")
    if stray:
        last_below = boundary if boundary is not None else last + 1
        kept = [t for t in taus if min(stray) < t < last_below and final[t] < start_loss]
        text += (f". τ = {_taus_text(stray)} ended above the start too"
                 + (f", τ = {_taus_text(kept)} below it" if kept else "")
                 + ": one run per τ — one seed, one batch order — so near the boundary a "
                   "single run's end falls on either side, and the boundary is read where the "
                   "runs stay above")
    reveal(guess, measured, close=close, explanation=text + ". " + lr_tau_verdict(
        value, boundary, last, lr, steps, along))
