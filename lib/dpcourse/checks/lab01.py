"""Checks for lab01 (lesson 01_single_device): your ``train_one_epoch`` and ``evaluate``, and
the stretch exercise ``train_accumulated`` (gradient accumulation).

Each check runs your function on a tiny model (with dropout, so train/eval mode matters) and a
loader whose last batch is short (so "mean of batch means" differs from "mean per sample"), in
two set-ups with different sizes and seeds (so a number that only fits one of them, such as a
hard-coded sample count, is caught), then compares with the reference in ``dpcourse.train``.
When the numbers differ, it replays the usual mistakes with the reference and tells you which
one yours matches. ``check_train_one_epoch`` then spoils one batch of its loader in three ways
(an image with a NaN pixel; finite images whose labels are all ignore_index, a NaN loss with a
zero gradient; a huge finite image under label smoothing, an inf loss with finite gradients) and
holds the function to its contract: a loss that is not finite raises FloatingPointError, and the
caller finds the weights, Adam's state and every p.grad as the last sound step left them.

This module holds the two predictions and the names; each check has a module of its own:
:mod:`~dpcourse.checks._lab01_train`, :mod:`~dpcourse.checks._lab01_evaluate` (with
:mod:`~dpcourse.checks._lab01_finetune`, the fine-tuning caller that holds either answer to §2's
design decision to its cost: "as found" in evaluate, "eval" in the learner's back_to_training),
:mod:`~dpcourse.checks._lab01_accumulate` (with :mod:`~dpcourse.checks._lab01_leftover`), and
what they share in :mod:`~dpcourse.checks._lab01_common`.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.checks import fail
from ._lab01_accumulate import check_train_accumulated
from ._lab01_common import LEAVES, _SETUPS, _params, _setup, is_library_function, library_calls
from ._lab01_evaluate import LoaderFailed, check_evaluate
from ._lab01_train import _BAD, _LR, _not_finite, _spoiled, _state, check_train_one_epoch


__all__ = ["check_train_one_epoch", "check_evaluate", "check_train_accumulated",
           "check_prediction", "LEAVES", "PREDICTION_QUESTION", "PREDICTION_CHOICES",
           "STEP_QUESTION", "STEP_CHOICES", "short_batch_step", "check_step_prediction"]


# --- predict, then measure: the epoch's returned loss against the trained model's ----------

PREDICTION_QUESTION = ("after epoch 1, whose loss on the training set is larger: "
                       "train_one_epoch's return value or evaluate's")
PREDICTION_CHOICES = ("train_one_epoch's", "evaluate's", "about the same")


def check_prediction(guess, epoch_loss: float, eval_loss: float) -> None:
    """Compare the learner's prediction of which is larger after the first epoch, the mean loss
    ``train_one_epoch`` returned (``epoch_loss``) or the one ``evaluate`` measures on the same
    training set right after (``eval_loss``), and say why. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    from dpcourse.checks import reveal

    epoch_loss, eval_loss = float(epoch_loss), float(eval_loss)
    if epoch_loss > 1.1 * eval_loss:
        measured = PREDICTION_CHOICES[0]
    elif eval_loss > 1.1 * epoch_loss:
        measured = PREDICTION_CHOICES[1]
    else:
        measured = PREDICTION_CHOICES[2]
    reveal(guess, measured, close=guess.value == measured, explanation=(
        f"On the same training samples, train_one_epoch returned {epoch_loss:.3f} and evaluate "
        f"measured {eval_loss:.3f} right after the epoch (the larger is "
        f"{max(epoch_loss, eval_loss) / min(epoch_loss, eval_loss):.2f} times the smaller; "
        f"within 10% counts as about the same). "
        "Same samples, two different models: train_one_epoch's mean adds up each batch's loss "
        "at the moment it was trained on, so its first batches are those of a network that "
        "still guesses; evaluate measures only the model the epoch ended with. The lab's "
        "SmallCNN has no batch norm and its dropout is 0, so the two modes compute the same "
        "function here: the whole gap is the network changing during the epoch (with dropout "
        "on, training mode would widen it). The returned number is a running summary of the "
        "epoch, not a measurement of the model you now hold."))


# --- predict, then measure: the step a short last batch takes --------------------------------

STEP_QUESTION = ("the step on the epoch's short last batch (2 samples) against a full batch's "
                 "(16 samples)")
STEP_CHOICES = ("smaller", "about the same", "larger")


def short_batch_step(train_one_epoch, setup=_SETUPS[0]) -> tuple[float, list]:
    """Run the learner's ``train_one_epoch`` on 50 samples in batches of 16 (16, 16, 16, 2)
    with plain SGD, and measure how far each optimizer step moved the weights (the norm of the
    change): (the last step over the mean of the full batches' steps, every step's norm)."""
    model, loader = _setup(*setup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list = []
    last = [_params(model)]

    def moved(optimizer, args, kwargs):
        now = _params(model)
        norms.append(float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(now, last[0])))))
        last[0] = now

    opt.register_step_post_hook(moved)
    torch.manual_seed(1)
    train_one_epoch(model, loader, nn.CrossEntropyLoss(), opt, "cpu")
    if len(norms) < 2:
        fail(f"the check counted {len(norms)} optimizer step(s) in an epoch of "
             f"{len(loader)} batches: it needs one per batch to compare them.")
    return norms[-1] / (sum(norms[:-1]) / len(norms[:-1])), norms


def check_step_prediction(guess, train_one_epoch) -> None:
    """Measure :func:`short_batch_step` with the learner's own ``train_one_epoch`` and compare
    the learner's prediction: is the step on the 2-sample last batch smaller than a full
    batch's, about the same (within 50%), or larger? Say why. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    from dpcourse.checks import reveal

    ratio, norms = short_batch_step(train_one_epoch)
    measured = ("smaller" if ratio < 0.5 else "larger" if ratio > 1.5 else "about the same")
    n, batch, _ = _SETUPS[0]
    short = n % batch
    reveal(guess, measured, close=guess.value == measured, explanation=(
        f"Your steps moved the weights by {', '.join(f'{x:.3f}' for x in norms)}: the last, on "
        f"{short} samples, {ratio:.1f} times the full batches' mean. Each batch's loss is its "
        f"own mean, so the {short}-sample batch's gradient is an average like the others', "
        f"not {short}/{batch} of one, and its step has a full step's scale; and an average of "
        f"{short} samples' gradients cancels less of their disagreement than one of {batch} "
        f"(the check's labels are random, so they disagree a lot; the more a batch's samples "
        f"agree, the less an average of many cancels, and the closer the two steps come). Each of those {short} "
        f"samples moved the weights about {ratio * batch / short:.0f} times as much as a "
        f"sample of a full batch. The number your function returns counts every sample "
        f"once; the steps do not. DataLoader(drop_last=True) skips such a batch."))
