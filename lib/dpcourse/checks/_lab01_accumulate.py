"""Lab 01's stretch: ``check_train_accumulated`` — gradient accumulation over k micro-batches
of different sizes, each step the mean over the samples it used; the leftover micro-batches'
design decision is judged in :mod:`dpcourse.checks._lab01_leftover`. Re-exported by
:mod:`dpcourse.checks.lab01`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse.checks import _lab01_leftover as _leftover
from dpcourse.checks import fail, passed, recorded
from ._lab01_common import _Spy, _as_number, _params, _same


# --- stretch: gradient accumulation -------------------------------------------------------

def _groups(loader, k):
    """The loader's micro-batches, k at a time."""
    batches = list(loader)
    return [batches[g:g + k] for g in range(0, len(batches), k)]


def _accumulate_variant(model, loader, optimizer, k, weight="share", step_every=False,
                        zero_every=False, zero_after_step=True, zero_first=True):
    """Accumulation as written right (the defaults) or with one of the usual mistakes.

    ``weight`` is what each micro-batch's mean loss is multiplied by before backward: "share"
    (its samples' share of the group's: right), "k" (1/k, right only when every micro-batch of
    the group has the same size) or "none"."""
    __tracebackhide__ = True
    model.train()
    if zero_first:
        optimizer.zero_grad()
    total, count = 0.0, 0
    for group in _groups(loader, k):
        group_n = sum(len(y) for _, y in group)
        for i, (X, y) in enumerate(group):
            if zero_every:
                optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(X), y)
            scale = {"share": len(y) / group_n, "k": 1 / k, "none": 1.0}[weight]
            (loss * scale).backward()
            if step_every or i == len(group) - 1:
                optimizer.step()
                if zero_after_step:
                    optimizer.zero_grad()
            total += loss.item() * len(y)
            count += len(y)
    return total / count


def _sizes_loader(X, y, sizes):
    """A loader whose micro-batches hold ``sizes`` samples, in order."""
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return DataLoader(TensorDataset(X, y),
                      batch_sampler=[list(range(a, b)) for a, b in zip(bounds, bounds[1:])])


# (micro-batch sizes, k, seed): every loader holds a whole number of groups of k micro-batches,
# and in each set-up some group holds micro-batches of different sizes -- a short last
# micro-batch as a DataLoader gives it (4 x 11 + 2, 8 x 7 + 2), or sizes that vary throughout --
# so weighting every micro-batch alike (1/k) takes other steps than plain training.
_ACCUM_SETUPS = (([4] * 11 + [2], 3, 0), ([8] * 7 + [2], 2, 5),
                 ([5, 3, 7, 5, 2, 6, 4, 4], 4, 7))


@recorded
def check_train_accumulated(train_accumulated) -> None:
    """Stretch: ``train_accumulated(model, loader, loss_fn, optimizer, k, device)`` must take,
    for each group of k micro-batches, the same step as plain training on the group's samples
    (one batch of them all, its mean loss), and return the mean loss per sample over the
    epoch, as ``train_one_epoch`` does. The micro-batches of a group need not be the same size."""
    __tracebackhide__ = True
    if not callable(train_accumulated) or isinstance(train_accumulated, type):
        fail(f"the check needs your function itself (train_accumulated), got "
             f"{type(train_accumulated).__name__}.")
    for sizes, k, seed in _ACCUM_SETUPS:
        n = sum(sizes)
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(n, 3, 8, 8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)

        def fresh(stale=True):
            torch.manual_seed(seed)
            # no dropout here: the big batch and the micro-batches would draw different masks
            model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.Tanh(),
                                  nn.Linear(16, 10))
            # The model arrives with gradients left in p.grad (say, from an unfinished group
            # of the previous epoch): an answer must start from zero.
            if stale:
                nn.functional.cross_entropy(model(X[:4]), y[:4]).backward()
            return model, torch.optim.SGD(model.parameters(), lr=0.2)

        def micro_loader():
            return _sizes_loader(X, y, sizes)

        model, opt = fresh()
        start = _params(model)
        spy = _Spy(model)
        steps = []
        opt.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
        model.eval()
        returned = train_accumulated(model, micro_loader(), nn.CrossEntropyLoss(), opt, k, "cpu")
        got = _params(model)
        if len(spy.training) != len(sizes):
            fail(f"train_accumulated ran {len(spy.training)} forward passes for {len(sizes)} "
                 f"micro-batches, but accumulation saves memory by never running more than one "
                 f"micro-batch at once.", fix="one forward (and backward) per micro-batch.")
        if not all(spy.training):
            fail("train_accumulated ran the model in eval mode, so dropout would be off while "
                 "it trains: the model may arrive in eval mode, straight after an evaluation.",
                 fix="put the model in training mode at the start.")

        big, big_opt = fresh()
        group_sizes = [sum(sizes[i:i + k]) for i in range(0, len(sizes), k)]
        for Xb, yb in _sizes_loader(X, y, group_sizes):
            big_opt.zero_grad()
            nn.functional.cross_entropy(big(Xb), yb).backward()
            big_opt.step()
        if _same(got, _params(big), tol=1e-5):
            m, o = fresh()
            _check_accumulated_loss(returned, _accumulate_variant(m, micro_loader(), o, k), k,
                                    n)
            continue
        if _same(got, start):
            fail("the weights did not change: the accumulated gradients never reached the "
                 "weights through an optimizer step.",
                 fix="step the optimizer at the end of each group.")

        def replay(**kw):
            m, o = fresh()
            _accumulate_variant(m, micro_loader(), o, k, **kw)
            return _params(m)

        def replays(**kw):  # the mistake, with either weighting of the micro-batches
            return any(_same(got, replay(weight=w, **kw), tol=1e-5) for w in ("share", "k"))

        groups = len(group_sizes)
        if _same(got, replay(weight="k"), tol=1e-5):
            fail(f"your steps match plain training's on a group's samples only where its "
                 f"micro-batches hold the same number of samples; where the micro-batches of a "
                 f"group differ in size (here {sizes}), a sample in a short micro-batch counted "
                 f"for more than one in a full micro-batch: the group's mean loss counts each of "
                 f"its samples once.",
                 fix=f"weight each micro-batch by its share of the group's samples: you gave "
                     f"each micro-batch 1/{k} of the group's weight, whatever it held.")
        if _same(got, replay(weight="none"), tol=1e-5):
            fail(f"each step was about {k} times too big: your weights match steps on {k} times "
                 f"the gradient of each group's mean loss.",
                 fix=f"scale each micro-batch's loss by its share of the group's samples: "
                     f"backward adds each micro-batch's gradient into p.grad, so the group's "
                     f"gradient was the sum of {k} mean-loss gradients.")
        if replays(step_every=True) or _same(got, replay(step_every=True, weight="none"),
                                             tol=1e-5):
            fail(f"your function took {len(steps)} optimizer steps for {len(sizes)} "
                 f"micro-batches in {groups} groups of k = {k}, where the contract takes one "
                 f"step per group, on the gradient of the whole group's samples.",
                 fix="step once per group, after its last micro-batch: you stepped after every "
                     "micro-batch, so each step used one micro-batch's gradient.")
        if replays(zero_every=True) or _same(got, replay(zero_every=True, weight="none"),
                                             tol=1e-5):
            fail(f"your function took {len(steps)} steps for {groups} groups, but each step "
                 f"moved the weights as if its group held only its last micro-batch: the other "
                 f"samples of the group contributed to no step.",
                 fix="clear the gradients only after a step: you zeroed them before every "
                     "micro-batch, so each step saw only the last micro-batch of its group.")
        if replays(zero_after_step=False):
            fail(f"your first step matches plain training's on its group, but each later step "
                 f"carried the gradients of all earlier groups too (the step on group {groups}: "
                 f"groups 1 to {groups}).",
                 fix="clear the gradients after every step: backward adds into p.grad, and "
                     "nothing cleared what the previous group left there.")
        # Run the learner's function again on the same model with p.grad empty: if the weights
        # change, what p.grad held before the call reached the steps.
        clean, clean_opt = fresh(stale=False)
        train_accumulated(clean, micro_loader(), nn.CrossEntropyLoss(), clean_opt, k, "cpu")
        if not _same(got, _params(clean), tol=1e-5):
            rest = (" With p.grad empty at the start, your steps are exactly plain training's."
                    if _same(_params(clean), _params(big), tol=1e-5) else "")
            fail(f"your weights depend on what p.grad held before the call: the check ran your "
                 f"function twice on the same model and micro-batches of sizes {sizes}, once "
                 f"with p.grad holding an earlier backward's gradients (as after an unfinished "
                 f"group of a previous epoch) and once with p.grad empty, and the two runs "
                 f"ended with different weights, but the contract says the result must not "
                 f"depend on what p.grad held.{rest}",
                 fix="clear the gradients once before the first micro-batch: the gradients "
                     "p.grad held were added into your first group's gradient.")
        fail(f"with micro-batches of sizes {sizes} and k={k} your weights differ from plain "
             f"training on each group's samples (groups of {group_sizes}), in none of the ways "
             f"the check knows (each micro-batch weighted 1/k or not at all, a step per "
             f"micro-batch, gradients zeroed too often or never, leftover gradients).",
             fix="for one group, compare p.grad just before your step with the gradient of "
                 "one batch holding the group's samples (its mean loss, backward): the first "
                 "parameter where they differ shows which part of the group went wrong.")
    chosen = set()
    for sizes, k, seed in _leftover.LEFTOVER_SETUPS:
        choice, returned, want = _leftover.check_leftover(train_accumulated, sizes, k, seed)
        chosen.add(choice)
        _check_accumulated_loss(returned, want, k, sum(sizes),
                                leftover=sum(sizes[len(sizes) // k * k:]))
    said = " or ".join(_leftover.CHOSEN[c] for c in sorted(chosen))
    passed(f"train_accumulated takes the same steps as plain training on each group's samples, "
           f"whatever the micro-batches' sizes, and returns the mean loss per sample; the "
           f"micro-batches left over at the end {said}, as you decided.")


def _check_accumulated_loss(returned, want: float, k: int, n: int, leftover: int = 0) -> None:
    """The stretch's return value: the mean loss per sample of the epoch, unscaled; with
    ``leftover`` samples at the end, they count too."""
    __tracebackhide__ = True
    if returned is None:
        fail("train_accumulated returned None; its contract is train_one_epoch's: the mean "
             "loss per sample over the epoch.", fix="return that mean as a float.")
    got = _as_number(returned, "train_accumulated")
    if math.isclose(got, want, rel_tol=1e-5):
        return
    if math.isclose(got, want / k, rel_tol=1e-5):
        fail(f"train_accumulated returned {got:.4f}, {k} times less than the mean loss per "
             f"sample ({want:.4f}): the loss to report is the model's loss on its samples.",
             fix="add the unscaled loss (times the micro-batch's size) to your total: you "
                 "reported the scaled loss you backpropagated.")
    if math.isclose(got, want * n, rel_tol=1e-5):
        fail("train_accumulated returned the total loss over all samples, not the mean per "
             "sample.", fix="divide by the number of samples the epoch saw.")
    also = (f", the {leftover} left over at the end included," if leftover else "")
    fail(f"train_accumulated returned {got:.4f}; the mean loss per sample over the epoch's {n} "
         f"samples{also} is {want:.4f}.")
